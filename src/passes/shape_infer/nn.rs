//! Neural-network ops: Conv, MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool;
//! LayerNormalization, BatchNormalization, InstanceNormalization, LRN; Softmax, LogSoftmax;
//! Dropout. Spatial sizes honour strides, pads, dilations, `auto_pad` and `ceil_mode`.

use super::context::{Ctx, Outs, norm_axis, one, ty, ty_opt};
use crate::ir::DType;

/// Conv(x, w, b?): `[n, c_out, spatial…]`.
pub(super) fn conv(cx: &Ctx) -> Outs {
    let (Some(x), Some(w)) = (cx.shape(0), cx.shape(1)) else {
        return one((ty_opt(cx.dtype(0), None), None));
    };
    if x.len() < 3 || w.len() != x.len() {
        return Err(format!("Conv input {x:?} and weight {w:?} ranks do not fit"));
    }
    let kernel = cx.attrs().ints("kernel_shape").map(<[i64]>::to_vec).unwrap_or(w[2..].to_vec());
    let mut out = vec![x[0], w[0]];
    out.extend(spatial(cx, &x[2..], &kernel, false)?);
    one((ty_opt(cx.dtype(0), Some(out)), None))
}

/// MaxPool and AveragePool: `[n, c, spatial…]`, and MaxPool's optional int64 indices.
pub(super) fn pool(cx: &Ctx) -> Outs {
    let Some(x) = cx.shape(0) else { return one((ty_opt(cx.dtype(0), None), None)) };
    let a = cx.attrs();
    let kernel = a.ints("kernel_shape").ok_or("no kernel_shape")?.to_vec();
    if x.len() < 2 {
        return Err(format!("pooling input {x:?} has rank < 2"));
    }
    let mut out = x[..2].to_vec();
    out.extend(spatial(cx, &x[2..], &kernel, a.int("ceil_mode", 0) != 0)?);
    let mut outs = vec![(ty_opt(cx.dtype(0), Some(out.clone())), None)];
    if cx.node.outputs.len() > 1 {
        outs.push((ty(DType::I64, out), None));
    }
    Ok(outs)
}

/// GlobalAveragePool and GlobalMaxPool: every spatial dim becomes 1.
pub(super) fn global_pool(cx: &Ctx) -> Outs {
    let s = cx.shape(0).map(|x| x.iter().enumerate().map(|(i, &d)| if i < 2 { d } else { 1 }).collect());
    one((ty_opt(cx.dtype(0), s), None))
}

/// LayerNormalization: the input's type, and the optional mean and inverse std-dev, reduced
/// from `axis` on, in `stash_type`.
pub(super) fn layer_norm(cx: &Ctx) -> Outs {
    let a = cx.attrs();
    let x = cx.shape(0).map(<[i64]>::to_vec);
    let mut outs = vec![cx.same(0)];
    if cx.node.outputs.len() > 1 {
        let stats = match &x {
            Some(x) => {
                let ax = norm_axis(a.int("axis", -1), x.len())?;
                Some(x.iter().enumerate().map(|(i, &d)| if i < ax { d } else { 1 }).collect())
            }
            None => None,
        };
        let st = DType::from_onnx(a.int("stash_type", 1) as i32).unwrap_or(DType::F32);
        outs.push((ty_opt(Some(st), stats.clone()), None));
        outs.push((ty_opt(Some(st), stats), None));
    }
    Ok(outs)
}

/// BatchNormalization: the input's type, and the optional running statistics `[c]`.
pub(super) fn batch_norm(cx: &Ctx) -> Outs {
    let c = cx.shape(0).and_then(|x| x.get(1).copied());
    let mut outs = vec![cx.same(0)];
    for _ in 1..cx.node.outputs.len() {
        outs.push((ty_opt(cx.dtype(1).or(cx.dtype(0)), c.map(|c| vec![c])), None));
    }
    Ok(outs)
}

/// InstanceNormalization, LRN, Softmax and LogSoftmax: the input's type.
pub(super) fn same_as_input(cx: &Ctx) -> Outs {
    one(cx.same(0))
}

/// Dropout: the input's type, and the optional bool mask of its shape.
pub(super) fn dropout(cx: &Ctx) -> Outs {
    let mut outs = vec![cx.same(0)];
    if cx.node.outputs.len() > 1 {
        outs.push((ty_opt(Some(DType::Bool), cx.shape(0).map(<[i64]>::to_vec)), None));
    }
    Ok(outs)
}

/// SoftmaxCrossEntropyLoss(scores, labels, weights?) and NegativeLogLikelihoodLoss(input,
/// target, weight?): scores `[N, C, d…]` against labels `[N, d…]`. The loss has the labels'
/// shape under `reduction = none`, else it is a scalar; SoftmaxCrossEntropyLoss's optional
/// second output, the log-probabilities, has the scores' shape.
pub(super) fn loss(cx: &Ctx) -> Outs {
    let reduction = cx.attrs().str("reduction").unwrap_or("mean");
    let per_target = match reduction {
        "none" => true,
        "mean" | "sum" => false,
        other => return Err(format!("attribute `reduction` is `{other}`; expected `none`, `sum` or `mean`")),
    };
    if let (Some(x), Some(l)) = (cx.shape(0), cx.shape(1)) {
        let fits = x.len() >= 2 && l.len() + 1 == x.len() && l[0] == x[0] && l[1..] == x[2..];
        if !fits {
            return Err(format!("scores `{}` {x:?} and labels `{}` {l:?} do not fit: labels must be the scores' shape without axis 1 (the classes)", cx.name(0), cx.name(1)));
        }
    }
    if let (Some(x), Some(w)) = (cx.shape(0), cx.shape(2)) {
        if w.len() != 1 || x.get(1) != w.first() {
            return Err(format!("weights `{}` {w:?} must hold one weight per class ({:?})", cx.name(2), x.get(1)));
        }
    }
    let shape = if per_target { cx.shape(1).map(<[i64]>::to_vec) } else { Some(Vec::new()) };
    let mut outs = vec![(ty_opt(cx.dtype(0), shape), None)];
    if cx.node.outputs.len() > 1 {
        outs.push(cx.same(0));
    }
    Ok(outs)
}

/// `ceil(a / b)` for `a ≥ 0`, `b > 0`.
fn ceil_div(a: i64, b: i64) -> i64 {
    a / b + (a % b != 0) as i64
}

fn pool_out(input: i64, k: i64, stride: i64, pad: i64, dil: i64, ceil: bool) -> Result<i64, String> {
    let overflow = || format!("kernel {k}, dilation {dil} and pads {pad} overflow over a dim of {input}");
    let eff = (k - 1).checked_mul(dil).and_then(|e| e.checked_add(1)).ok_or_else(overflow)?;
    let num = input.checked_add(pad).and_then(|n| n.checked_sub(eff)).ok_or_else(overflow)?;
    if num < 0 {
        return Ok(0);
    }
    Ok(if ceil { ceil_div(num, stride) + 1 } else { num / stride + 1 })
}

/// Output spatial sizes of Conv/pooling, honouring auto_pad.
fn spatial(cx: &Ctx, input: &[i64], kernel: &[i64], ceil: bool) -> Result<Vec<i64>, String> {
    let n = kernel.len();
    if input.len() != n {
        return Err(format!("kernel rank {n} does not match {} spatial dims", input.len()));
    }
    let a = cx.attrs();
    let strides = a.ints("strides").map(<[i64]>::to_vec).unwrap_or(vec![1; n]);
    let dil = a.ints("dilations").map(<[i64]>::to_vec).unwrap_or(vec![1; n]);
    let pads = a.ints("pads").map(<[i64]>::to_vec).unwrap_or(vec![0; 2 * n]);
    let auto = a.str("auto_pad").unwrap_or("NOTSET");
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let s = *strides.get(i).unwrap_or(&1);
        let d = *dil.get(i).unwrap_or(&1);
        if s <= 0 {
            return Err(format!("stride {s} must be positive"));
        }
        if kernel[i] <= 0 || d <= 0 {
            return Err(format!("kernel size {} and dilation {d} must be positive", kernel[i]));
        }
        out.push(match auto {
            "SAME_UPPER" | "SAME_LOWER" => ceil_div(input[i], s),
            "VALID" => pool_out(input[i], kernel[i], s, 0, d, ceil)?,
            _ => {
                let (p0, p1) = (*pads.get(i).unwrap_or(&0), *pads.get(i + n).unwrap_or(&0));
                let p = p0.checked_add(p1).ok_or_else(|| format!("pads {pads:?} overflow"))?;
                pool_out(input[i], kernel[i], s, p, d, ceil)?
            }
        });
    }
    Ok(out)
}
