//! Resize and GridSample: resampled spatial dims.

use super::context::{Ctx, Outs, norm_axis, one, ty, ty_opt};
use crate::ir::{Op, OpKind, ValueId};

/// What a Resize computes per dim of its input: the scale and the output size.
#[derive(Clone, Debug, PartialEq)]
pub struct ResizeTarget {
    /// Scale per dim (1 on dims not resized).
    pub scales: Vec<f64>,
    /// Output size per dim.
    pub sizes: Vec<i64>,
}

/// The ONNX rule for Resize's output (the reference's `_interpolate_nd`): `sizes` (over
/// `axes`) if given, with `keep_aspect_ratio_policy` (`stretch`, `not_larger`, `not_smaller`)
/// rounding the scaled sizes half up; otherwise `floor(scale · size)`.
pub fn resize_target(shape: &[i64], axes: &[usize], scales: Option<&[f64]>, sizes: Option<&[i64]>, policy: &str) -> Result<ResizeTarget, String> {
    let rank = shape.len();
    let mut scale = vec![1.0; rank];
    let mut size = shape.to_vec();
    match (sizes, scales) {
        (Some(given), _) => {
            if given.len() != axes.len() {
                return Err(format!("`sizes` has {} entries for {} resized axes", given.len(), axes.len()));
            }
            for (&ax, &s) in axes.iter().zip(given) {
                if s < 0 {
                    return Err(format!("`sizes` holds the negative size {s}"));
                }
                size[ax] = s;
                scale[ax] = if shape[ax] > 0 { s as f64 / shape[ax] as f64 } else { 1.0 };
            }
            if policy != "stretch" {
                let pick = axes.iter().map(|&ax| scale[ax]);
                let s = match policy {
                    "not_larger" => pick.fold(f64::INFINITY, f64::min),
                    "not_smaller" => pick.fold(f64::NEG_INFINITY, f64::max),
                    other => return Err(format!("keep_aspect_ratio_policy `{other}` is not stretch, not_larger or not_smaller")),
                };
                for &ax in axes {
                    scale[ax] = s;
                    size[ax] = (s * shape[ax] as f64 + 0.5) as i64;
                }
            }
        }
        (None, Some(given)) => {
            if given.len() != axes.len() {
                return Err(format!("`scales` has {} entries for {} resized axes", given.len(), axes.len()));
            }
            for (&ax, &s) in axes.iter().zip(given) {
                if !(s > 0.0) || !s.is_finite() {
                    return Err(format!("`scales` holds {s}; scales must be positive"));
                }
                scale[ax] = s;
                size[ax] = (s * shape[ax] as f64).floor() as i64;
            }
        }
        (None, None) => return Err("neither `scales` nor `sizes` is given".into()),
    }
    Ok(ResizeTarget { scales: scale, sizes: size })
}

/// The numbers of a constant input (an initializer, or a Constant node's value): Resize's
/// scales are floats, which the integer evaluation of shape arithmetic does not hold.
pub(super) fn constant_numbers(cx: &Ctx, v: ValueId) -> Option<Vec<f64>> {
    if let Some(ints) = cx.info.ints(v) {
        return Some(ints.iter().map(|&x| x as f64).collect());
    }
    let val = cx.graph.value(v);
    if let Some(d) = &val.data {
        return d.to_f64_vec();
    }
    let producer = cx.graph.node(val.producer?);
    if producer.op != Op::Known(OpKind::Constant) {
        return None;
    }
    producer.attrs.tensor("value").and_then(|t| t.to_f64_vec())
}

/// Resize: the input's type with the resized dims (scales and sizes must be constants).
pub(super) fn resize(cx: &Ctx) -> Outs {
    let Some(x) = cx.shape(0) else { return one((ty_opt(cx.dtype(0), None), None)) };
    let (scales_at, sizes_at) = (2, 3);
    let numbers = |i: usize| -> Result<Option<Vec<f64>>, String> {
        match cx.input(i) {
            None => Ok(None),
            Some(v) => match constant_numbers(cx, v) {
                Some(n) if n.is_empty() => Ok(None),
                Some(n) => Ok(Some(n)),
                None => Err(format!("its {} (`{}`) is not a constant; the output shape must be known at plan time", if i == sizes_at { "sizes" } else { "scales" }, cx.graph.value(v).name)),
            },
        }
    };
    let scales = numbers(scales_at)?;
    let sizes = numbers(sizes_at)?.map(|s| s.into_iter().map(|x| x as i64).collect::<Vec<_>>());
    let axes: Vec<usize> = match cx.attrs().ints("axes") {
        Some(list) => list.iter().map(|&a| norm_axis(a, x.len())).collect::<Result<_, _>>()?,
        None => (0..x.len()).collect(),
    };
    let policy = cx.attrs().str("keep_aspect_ratio_policy").unwrap_or("stretch");
    let target = resize_target(x, &axes, scales.as_deref(), sizes.as_deref(), policy)?;
    one((cx.dtype(0).and_then(|d| ty(d, target.sizes)), None))
}

/// Col2Im(x, image_shape, block_shape): x `[N, C·∏block, L]` summed back into `[N, C, H, W]`;
/// both shapes must be constants, and `L` the number of block positions the image, pads,
/// strides and dilations give.
pub(super) fn col2im(cx: &Ctx) -> Outs {
    let Some(x) = cx.shape(0) else { return one((ty_opt(cx.dtype(0), None), None)) };
    let constant = |i: usize, what: &str| -> Result<Vec<i64>, String> {
        let v = cx.input(i).ok_or_else(|| format!("has no {what} input"))?;
        let n = constant_numbers(cx, v).ok_or_else(|| format!("its {what} (`{}`) is not a constant; the output shape must be known at plan time", cx.graph.value(v).name))?;
        Ok(n.into_iter().map(|x| x as i64).collect())
    };
    let (image, block) = (constant(1, "image_shape")?, constant(2, "block_shape")?);
    let n = image.len();
    if n == 0 || block.len() != n || x.len() != 3 {
        return Err(format!("input {x:?}, image_shape {image:?} and block_shape {block:?} do not agree (input [N, C·∏block, L])"));
    }
    if n != 2 {
        return Err(format!("Col2Im over {n} spatial dims: only 2-D images are supported (as `torch.nn.Fold` and libtorch's col2im)"));
    }
    let attr = |name: &str, len: usize, default: i64| cx.attrs().ints(name).map_or(vec![default; len], <[i64]>::to_vec);
    let (dilations, strides, pads) = (attr("dilations", n, 1), attr("strides", n, 1), attr("pads", 2 * n, 0));
    if dilations.len() != n || strides.len() != n || pads.len() != 2 * n {
        return Err(format!("dilations {dilations:?}, strides {strides:?} or pads {pads:?} do not match {n} spatial dims"));
    }
    let per_block: i64 = block.iter().product();
    let mut positions = 1i64;
    for d in 0..n {
        let span = dilations[d] * (block[d] - 1) + 1;
        let room = image[d] + pads[d] + pads[n + d] - span;
        if block[d] <= 0 || strides[d] <= 0 || room < 0 {
            return Err(format!("block {block:?} does not fit image {image:?} with pads {pads:?} and dilations {dilations:?}"));
        }
        positions *= room / strides[d] + 1;
    }
    if per_block <= 0 || x[1] % per_block != 0 || (x[2] >= 0 && x[2] != positions) {
        return Err(format!("input {x:?} is not [N, C·{per_block}, {positions}] for image {image:?} and block {block:?}"));
    }
    let mut out = vec![x[0], x[1] / per_block];
    out.extend_from_slice(&image);
    one((ty_opt(cx.dtype(0), Some(out)), None))
}

/// GridSample: `[N, C]` of the input, the grid's spatial dims `grid[1..-1]`.
pub(super) fn grid_sample(cx: &Ctx) -> Outs {
    let (Some(x), Some(grid)) = (cx.shape(0), cx.shape(1)) else { return one((ty_opt(cx.dtype(0), None), None)) };
    if x.len() < 3 || grid.len() != x.len() || grid[grid.len() - 1] != x.len() as i64 - 2 {
        return Err(format!("input {x:?} and grid {grid:?} do not agree (grid [N, spatial…, {}])", x.len().saturating_sub(2)));
    }
    let mut out = vec![x[0], x[1]];
    out.extend_from_slice(&grid[1..grid.len() - 1]);
    one((ty_opt(cx.dtype(0), Some(out)), None))
}
