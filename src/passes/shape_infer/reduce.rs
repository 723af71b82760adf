//! Reductions: ReduceMean, ReduceSum, ReduceMax, ReduceMin, ReduceProd (axes from the input;
//! integer values folded for shape arithmetic);
//! ArgMax, ArgMin; TopK; CumSum.

use super::context::{Ctx, MAX_EVAL_ELEMS, Outs, norm_axis, numel, one, ty_opt};
use crate::ir::{DType, OpKind};

/// ReduceMean/Sum/Max/Min/Prod over `axes` (all when empty, none with
/// `noop_with_empty_axes`), keeping reduced dims as 1 with `keepdims`.
pub(super) fn reduce(cx: &Ctx, kind: OpKind) -> Outs {
    use OpKind::*;
    let a = cx.attrs();
    let Some(x) = cx.shape(0) else { return one((ty_opt(cx.dtype(0), None), None)) };
    let axes: Vec<i64> = cx.need_ints(1, "axes")?.map(<[i64]>::to_vec).unwrap_or_default();
    let noop = a.int("noop_with_empty_axes", 0) != 0;
    if axes.is_empty() && noop {
        return one(cx.same(0));
    }
    let axes: Vec<usize> = if axes.is_empty() {
        (0..x.len()).collect()
    } else {
        axes.iter().map(|&ax| norm_axis(ax, x.len())).collect::<Result<_, _>>()?
    };
    let keep = a.int("keepdims", 1) != 0;
    let out = reduce_shape(x, &axes, keep);
    let fold: Option<fn(i64, i64) -> i64> = match kind {
        ReduceSum => Some(i64::wrapping_add),
        ReduceProd => Some(i64::wrapping_mul),
        ReduceMax => Some(i64::max),
        ReduceMin => Some(i64::min),
        _ => None,
    };
    let ints = match (fold, cx.ints(0)) {
        (Some(f), Some(v)) => reduce_ints(x, v, &axes, f),
        _ => None,
    };
    one((ty_opt(cx.dtype(0), Some(out)), ints))
}

/// ArgMax and ArgMin: int64 indices, reduced over `axis`.
pub(super) fn arg(cx: &Ctx) -> Outs {
    let a = cx.attrs();
    let s = match cx.shape(0) {
        Some(x) => {
            let ax = norm_axis(a.int("axis", 0), x.len())?;
            Some(reduce_shape(x, &[ax], a.int("keepdims", 1) != 0))
        }
        None => None,
    };
    one((ty_opt(Some(DType::I64), s), None))
}

/// CumSum: the input's type.
pub(super) fn cumsum(cx: &Ctx) -> Outs {
    one(cx.same(0))
}

/// Reduces the row-major integer tensor `v` of shape `x` over `axes` with `f` (shape-arithmetic
/// chains such as tf2onnx's `ReduceProd(Gather(Shape(x)))`); `None` for an empty reduction or
/// a result too large to evaluate.
pub(super) fn reduce_ints(x: &[i64], v: &[i64], axes: &[usize], f: fn(i64, i64) -> i64) -> Option<Vec<i64>> {
    let kept: Vec<i64> = x.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
    let n_kept = numel(&kept).ok().filter(|&n| n as usize <= MAX_EVAL_ELEMS)?;
    let mut out: Vec<Option<i64>> = vec![None; n_kept as usize];
    let mut coord = vec![0i64; x.len()];
    for &val in v.iter().take(numel(x).ok()? as usize) {
        let mut at = 0i64;
        for (i, (&c, &d)) in coord.iter().zip(&kept).enumerate() {
            at = at * d + if axes.contains(&i) { 0 } else { c };
        }
        let slot = out.get_mut(at as usize)?;
        *slot = Some(slot.map_or(val, |acc| f(acc, val)));
        for d in (0..x.len()).rev() {
            coord[d] += 1;
            if coord[d] < x[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    out.into_iter().collect()
}

/// `x` without (or, with `keep`, with 1 at) the reduced `axes`.
pub(super) fn reduce_shape(x: &[i64], axes: &[usize], keep: bool) -> Vec<i64> {
    x.iter()
        .enumerate()
        .filter_map(|(i, &d)| {
            if axes.contains(&i) {
                if keep { Some(1) } else { None }
            } else {
                Some(d)
            }
        })
        .collect()
}

/// ONNX `TopK(x, k)`: values of x's type and int64
/// indices, x's shape with `k` along `axis`.
pub(super) fn top_k(cx: &Ctx) -> Outs {
    let k = match cx.need_ints(1, "k")? {
        Some(&[k]) => Some(k),
        Some(k) => return Err(format!("k must hold one value, it holds {k:?}")),
        None => return Err("no k".into()),
    };
    let shape = match (cx.shape(0), k) {
        (Some(x), Some(k)) => {
            let ax = norm_axis(cx.attrs().int("axis", -1), x.len())?;
            if k < 0 || k > x[ax] {
                return Err(format!("k = {k} is outside 0..={} (axis {ax} of {x:?})", x[ax]));
            }
            let mut out = x.to_vec();
            out[ax] = k;
            Some(out)
        }
        _ => None,
    };
    Ok(vec![(ty_opt(cx.dtype(0), shape.clone()), None), (ty_opt(Some(DType::I64), shape), None)])
}

/// The axes a ReduceMean/Sum/Max/Min/Prod node reduces over an input of `rank` axes (its `axes`
/// input; all of them when empty or absent, none with `noop_with_empty_axes`), or None when
/// they are not known.
pub fn reduced_axes(node: &crate::ir::Node, info: &super::ShapeInfo, rank: usize) -> Option<Vec<usize>> {
    let axes: Vec<i64> = match node.inputs.get(1).copied().flatten() {
        Some(v) => info.ints(v)?.to_vec(),
        None => Vec::new(),
    };
    if axes.is_empty() {
        return Some(if node.attrs.int("noop_with_empty_axes", 0) != 0 { Vec::new() } else { (0..rank).collect() });
    }
    axes.iter()
        .map(|&a| {
            let a = if a < 0 { a + rank as i64 } else { a };
            (0..rank as i64).contains(&a).then_some(a as usize)
        })
        .collect()
}
