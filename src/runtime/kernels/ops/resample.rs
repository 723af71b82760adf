//! Resize and GridSample. Resize is separable: along each resized axis the output is a fixed
//! linear map of the input, so each axis is one matrix `W [out, in]` built on the host by the
//! ONNX rules (coordinate transformation, nearest rounding, linear and cubic taps with their
//! antialiased forms, `exclude_outside`, edge clamping, `tf_crop_and_resize`'s extrapolation)
//! and applied as a matrix product, which autograd differentiates like any other.

use tch::{Kind, Tensor};

use super::{Args, KResult, axis, bail};
use crate::passes::shape_infer::{ResizeTarget, resize_target};
use crate::runtime::kernels::tensor::{is_float_kind, to_f64_vec, to_i64_vec};

/// How one axis maps output positions to input coordinates and weighs the neighbours.
struct Taps<'a> {
    mode: &'a str,
    coordinate: &'a str,
    nearest: &'a str,
    cubic_a: f64,
    antialias: bool,
    exclude_outside: bool,
}

impl Taps<'_> {
    /// The weights of the neighbours of a coordinate whose distance past its floor is `ratio`
    /// (in (0, 1]), at `scale`.
    fn coeffs(&self, ratio: f64, scale: f64) -> Vec<f64> {
        let a = self.cubic_a;
        match self.mode {
            "nearest" => {
                let on_right = if ratio == 1.0 {
                    true
                } else {
                    match self.nearest {
                        "round_prefer_ceil" => ratio >= 0.5,
                        "floor" => false,
                        "ceil" => true,
                        _ => ratio > 0.5,
                    }
                };
                if on_right { vec![0.0, 1.0] } else { vec![1.0, 0.0] }
            }
            "linear" if self.antialias => {
                let s = scale.min(1.0);
                let start = (-1.0 / s).floor() as i64 + 1;
                let footprint = 2 - 2 * start;
                let c: Vec<f64> = (start..start + footprint).map(|i| (1.0 - ((i as f64 - ratio) * s).abs()).clamp(0.0, 1.0)).collect();
                normalised(c)
            }
            "linear" => vec![1.0 - ratio, ratio],
            _ if self.antialias => {
                let s = scale.min(1.0);
                let cubic = |x: f64| {
                    let x = x.abs();
                    if x <= 1.0 {
                        (a + 2.0) * x * x * x - (a + 3.0) * x * x + 1.0
                    } else if x < 2.0 {
                        a * x * x * x - 5.0 * a * x * x + 8.0 * a * x - 4.0 * a
                    } else {
                        0.0
                    }
                };
                let start = (-2.0 / s).floor() as i64 + 1;
                let end = 2 - start;
                normalised((start..end).map(|i| cubic(s * (i as f64 - ratio))).collect())
            }
            _ => {
                let (r1, q) = (ratio + 1.0, 1.0 - ratio);
                let q1 = q + 1.0;
                vec![
                    ((a * r1 - 5.0 * a) * r1 + 8.0 * a) * r1 - 4.0 * a,
                    ((a + 2.0) * ratio - (a + 3.0)) * ratio * ratio + 1.0,
                    ((a + 2.0) * q - (a + 3.0)) * q * q + 1.0,
                    ((a * q1 - 5.0 * a) * q1 + 8.0 * a) * q1 - 4.0 * a,
                ]
            }
        }
    }

    /// The input coordinate of output position `y`; `None` where `tf_crop_and_resize` puts
    /// the extrapolation value.
    fn source(&self, y: f64, scale: f64, input: i64, output: i64, roi: (f64, f64)) -> Option<f64> {
        let (width, out_width) = (input as f64, scale * input as f64);
        Some(match self.coordinate {
            "align_corners" if out_width == 1.0 => 0.0,
            "align_corners" => y * (width - 1.0) / (out_width - 1.0),
            "asymmetric" => y / scale,
            "tf_crop_and_resize" => {
                let x = if out_width == 1.0 { (roi.1 - roi.0) * (width - 1.0) / 2.0 } else { y * (roi.1 - roi.0) * (width - 1.0) / (out_width - 1.0) };
                let x = x + roi.0 * (width - 1.0);
                if x < 0.0 || x > width - 1.0 {
                    return None;
                }
                x
            }
            "pytorch_half_pixel" if out_width == 1.0 => -0.5,
            "half_pixel_symmetric" => {
                let adjustment = output as f64 / out_width;
                let offset = width / 2.0 * (1.0 - adjustment);
                offset + (y + 0.5) / scale - 0.5
            }
            _ => (y + 0.5) / scale - 0.5,
        })
    }

    /// The axis's matrix `[output, input]` (row-major) and the rows that take the
    /// extrapolation value instead.
    fn matrix(&self, input: i64, output: i64, scale: f64, roi: (f64, f64)) -> (Vec<f64>, Vec<bool>) {
        let (n_in, n_out) = (input as usize, output as usize);
        let mut w = vec![0.0; n_out * n_in];
        let mut outside = vec![false; n_out];
        for o in 0..n_out {
            let Some(x) = self.source(o as f64, scale, input, output, roi) else {
                outside[o] = true;
                continue;
            };
            let floor = x.floor();
            let ratio = if x == floor { 1.0 } else { x - floor };
            let mut c = self.coeffs(ratio, scale);
            let n = c.len() as i64;
            // the n neighbours nearest x, ties to the smaller index, on the edge-padded axis
            let pad = (n + 1) / 2;
            let padded = x + pad as f64;
            let p = padded.floor();
            let frac = padded - p;
            let offset = if n % 2 == 0 {
                if frac == 0.0 { -(n / 2) } else { -(n / 2) + 1 }
            } else if frac <= 0.5 {
                -((n - 1) / 2)
            } else {
                -((n - 1) / 2) + 1
            };
            let start = p as i64 + offset - pad;
            if self.exclude_outside {
                for (j, cj) in c.iter_mut().enumerate() {
                    let i = start + j as i64;
                    if i < 0 || i >= input {
                        *cj = 0.0;
                    }
                }
                c = normalised(c);
            }
            for (j, cj) in c.iter().enumerate() {
                let i = (start + j as i64).clamp(0, input - 1) as usize;
                w[o * n_in + i] += cj;
            }
        }
        (w, outside)
    }
}

fn normalised(c: Vec<f64>) -> Vec<f64> {
    let sum: f64 = c.iter().sum();
    let sum = if sum == 0.0 { 1.0 } else { sum };
    c.into_iter().map(|x| x / sum).collect()
}

/// Optional input `i` as numbers, `None` when absent or empty (an empty roi or scales).
fn listed(a: &Args, i: usize) -> KResult<Option<Vec<f64>>> {
    match a.opt(i) {
        Some(t) if t.numel() > 0 => Ok(Some(to_f64_vec(t)?)),
        _ => Ok(None),
    }
}

/// Resize `(X, roi, scales, sizes)` with `axes`, `antialias` and `keep_aspect_ratio_policy`
/// (opset 10's `(X, scales)` is canonicalised into this form).
pub(super) fn resize(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let shape = x.size();
    let rank = shape.len();
    let sizes = match a.opt(3) {
        Some(t) if t.numel() > 0 => Some(to_i64_vec(t)?),
        _ => None,
    };
    let (roi, scales) = (listed(a, 1)?, listed(a, 2)?);
    let axes: Vec<usize> = match a.attrs().ints("axes") {
        Some(list) => list.iter().map(|&ax| axis(ax, rank).map(|v| v as usize)).collect::<KResult<_>>()?,
        None => (0..rank).collect(),
    };
    let policy = a.attrs().str("keep_aspect_ratio_policy").unwrap_or("stretch");
    let ResizeTarget { scales, sizes } = resize_target(&shape, &axes, scales.as_deref(), sizes.as_deref(), policy)?;
    let taps = Taps {
        mode: a.attrs().str("mode").unwrap_or("nearest"),
        coordinate: a.attrs().str("coordinate_transformation_mode").unwrap_or("half_pixel"),
        nearest: a.attrs().str("nearest_mode").unwrap_or("round_prefer_floor"),
        cubic_a: a.float("cubic_coeff_a", -0.75),
        antialias: a.int("antialias", 0) != 0 && a.attrs().str("mode").unwrap_or("nearest") != "nearest",
        exclude_outside: a.int("exclude_outside", 0) != 0,
    };
    if !matches!(taps.mode, "nearest" | "linear" | "cubic") {
        bail!("mode must be nearest, linear or cubic, it is `{}`", taps.mode);
    }
    let extrapolation = a.float("extrapolation_value", 0.0);
    let kind = x.f_kind()?;
    let work = if is_float_kind(kind) { kind } else { Kind::Double };
    let mut y = x.f_to_kind(work)?;
    for (k, &ax) in axes.iter().enumerate() {
        let (input, output, scale) = (shape[ax], sizes[ax], scales[ax]);
        // roi, when given, lists starts then ends of the resized axes
        let pair = roi.as_ref().filter(|r| r.len() == 2 * axes.len()).map_or((0.0, 1.0), |r| (r[k], r[axes.len() + k]));
        if (scale - 1.0).abs() < 1e-9 && output == input && pair == (0.0, 1.0) {
            continue;
        }
        let (w, outside) = taps.matrix(input, output, scale, pair);
        let w = Tensor::from_slice(&w).f_reshape([output, input])?.f_to_kind(work)?.f_to_device(x.device())?;
        let moved = y.f_movedim(&[ax as i64], &[-1])?;
        let mut z = moved.f_matmul(&w.f_tr()?)?;
        if outside.iter().any(|&o| o) {
            let mask = Tensor::from_slice(&outside).f_to_device(x.device())?;
            z = z.f_masked_fill(&mask, extrapolation)?;
        }
        y = z.f_movedim(&[-1], &[ax as i64])?;
    }
    Ok(if y.f_kind()? != kind { y.f_to_kind(kind)? } else { y })
}

/// GridSample (opset 16's bilinear/nearest/bicubic, 20's linear/nearest/cubic; the importer
/// writes the opset's default mode out) on 4-D and 5-D
/// inputs (5-D: no cubic), as libtorch's `grid_sampler`.
pub(super) fn grid_sample(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let grid = a.x(1)?;
    let mode = match a.attrs().str("mode").unwrap_or("linear") {
        "bilinear" | "linear" => 0,
        "nearest" => 1,
        "bicubic" | "cubic" => 2,
        other => bail!("mode `{other}` is not linear, nearest or cubic"),
    };
    let padding = match a.attrs().str("padding_mode").unwrap_or("zeros") {
        "zeros" => 0,
        "border" => 1,
        "reflection" => 2,
        other => bail!("padding_mode `{other}` is not zeros, border or reflection"),
    };
    if !(x.dim() == 4 || (x.dim() == 5 && mode != 2)) {
        bail!("the runner samples 4-D inputs (and 5-D ones without cubic mode), this one is {}-D", x.dim());
    }
    let grid = if grid.f_kind()? != x.f_kind()? { grid.f_to_kind(x.f_kind()?)? } else { grid.shallow_clone() };
    Ok(Tensor::f_grid_sampler(x, &grid, mode, padding, a.int("align_corners", 0) != 0)?)
}

/// Col2Im (opset 18): the blocks of `x` `[N, C·∏block, L]` summed back into `[N, C, H, W]`, as
/// libtorch's `col2im` (`torch.nn.Fold`), 2 spatial dims only. ONNX's pads may differ at the
/// two ends, libtorch's may not: the padded image is built without pads and cropped.
pub(super) fn col2im(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let Some(image) = a.ints(1)? else { bail!("image_shape is missing") };
    let Some(block) = a.ints(2)? else { bail!("block_shape is missing") };
    if image.len() != 2 || block.len() != 2 {
        bail!("Col2Im over {} spatial dims: the runner's kernel (libtorch's col2im) sums 2-D images only", image.len());
    }
    let attr = |name: &str, len: usize, default: i64| a.attrs().ints(name).map_or(vec![default; len], <[i64]>::to_vec);
    let (dilations, strides, pads) = (attr("dilations", 2, 1), attr("strides", 2, 1), attr("pads", 4, 0));
    if dilations.len() != 2 || strides.len() != 2 || pads.len() != 4 {
        bail!("dilations {dilations:?}, strides {strides:?} or pads {pads:?} do not match 2 spatial dims");
    }
    let padded = [image[0] + pads[0] + pads[2], image[1] + pads[1] + pads[3]];
    let y = x.f_col2im(padded, block.as_slice(), dilations.as_slice(), [0i64, 0], strides.as_slice())?;
    Ok(y.f_slice(2, pads[0], pads[0] + image[0], 1)?.f_slice(3, pads[1], pads[1] + image[1], 1)?)
}
