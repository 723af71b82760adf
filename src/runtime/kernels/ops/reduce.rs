//! Reductions, ArgMax/ArgMin, CumSum.

use tch::{Kind, Tensor};

use super::{Args, KResult, axes, axis};
use crate::ir::OpKind;
use crate::runtime::kernels::tensor::is_float_kind;

pub(super) fn reduce(kind: OpKind, a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let rank = x.dim();
    let keep = a.int("keepdims", 1) != 0;
    let listed = a.ints(1)?.unwrap_or_default();
    let dims: Vec<i64> = if listed.is_empty() {
        if a.int("noop_with_empty_axes", 0) != 0 {
            return Ok(x.shallow_clone());
        }
        (0..rank as i64).collect()
    } else {
        axes(&listed, rank)?
    };
    let k = x.f_kind()?;
    let y = match kind {
        OpKind::ReduceSum => x.f_sum_dim_intlist(dims.as_slice(), keep, k)?,
        OpKind::ReduceMean if is_float_kind(k) => x.f_mean_dim(dims.as_slice(), keep, None::<Kind>)?,
        OpKind::ReduceMean => x.f_to_kind(Kind::Double)?.f_mean_dim(dims.as_slice(), keep, None::<Kind>)?,
        OpKind::ReduceMax => x.f_amax(dims.as_slice(), keep)?,
        OpKind::ReduceMin => x.f_amin(dims.as_slice(), keep)?,
        _ => {
            let mut sorted = dims.clone();
            sorted.sort_unstable_by(|p, q| q.cmp(p));
            let mut y = x.shallow_clone();
            for d in sorted {
                y = y.f_prod_dim_int(d, keep, k)?;
            }
            y
        }
    };
    Ok(if y.f_kind()? != k { y.f_to_kind(k)? } else { y })
}

pub(super) fn arg(kind: OpKind, a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let ax = axis(a.int("axis", 0), x.dim())?;
    let keep = a.int("keepdims", 1) != 0;
    let last = a.int("select_last_index", 0) != 0;
    let src = if last { x.f_flip([ax])? } else { x.shallow_clone() };
    let idx = if kind == OpKind::ArgMax { src.f_argmax(ax, keep)? } else { src.f_argmin(ax, keep)? };
    Ok(if last { idx.f_neg()?.f_add_scalar(x.size()[ax as usize] - 1)? } else { idx })
}

pub(super) fn cumsum(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let ax = match a.scalar(1)? {
        Some(v) => axis(v as i64, x.dim())?,
        None => super::bail!("input `axis` is required"),
    };
    let k = x.f_kind()?;
    let reverse = a.int("reverse", 0) != 0;
    let exclusive = a.int("exclusive", 0) != 0;
    let src = if reverse { x.f_flip([ax])? } else { x.shallow_clone() };
    let mut y = src.f_cumsum(ax, k)?;
    let n = src.size()[ax as usize];
    if exclusive && n > 0 {
        let zero = src.f_narrow(ax, 0, 1)?.f_zeros_like()?;
        y = Tensor::f_cat(&[zero, y.f_narrow(ax, 0, n - 1)?], ax)?;
    }
    Ok(if reverse { y.f_flip([ax])? } else { y })
}

/// ONNX `TopK(x, k)`: the `k` largest (or smallest) elements along `axis` and their int64
/// indices, sorted, ties with the lower index first as ONNX specifies (a stable sort: libtorch's
/// `topk` orders ties as it finds them).
pub(super) fn top_k(a: &Args) -> KResult<Vec<Tensor>> {
    let x = a.x(0)?;
    let ax = axis(a.int("axis", -1), x.dim())?;
    let k = match a.ints(1)?.as_deref() {
        Some(&[k]) => k,
        Some(k) => super::bail!("k must hold one value, it holds {k:?}"),
        None => super::bail!("input `k` is required"),
    };
    if k < 0 || k > x.size()[ax as usize] {
        super::bail!("k = {k} is outside 0..={} along axis {ax}", x.size()[ax as usize]);
    }
    let (values, indices) = x.f_sort_stable(true, ax, a.int("largest", 1) != 0)?;
    Ok(vec![values.f_narrow(ax, 0, k)?, indices.f_narrow(ax, 0, k)?])
}
