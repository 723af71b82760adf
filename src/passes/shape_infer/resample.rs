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
