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

/// The axes a reduction's node lists (its `axes` input), normalised; `None` when it reduces nothing (`noop_with_empty_axes` with no axes).
fn reduced_dims(a: &Args, rank: usize) -> KResult<Option<Vec<i64>>> {
    let listed = a.ints(1)?.unwrap_or_default();
    if listed.is_empty() {
        if a.int("noop_with_empty_axes", 0) != 0 {
            return Ok(None);
        }
        return Ok(Some((0..rank as i64).collect()));
    }
    Ok(Some(axes(&listed, rank)?))
}

/// ReduceL1, ReduceL2, ReduceLogSumExp, ReduceSumSquare. ReduceL2 is `torch.norm`,
/// whose gradient at a zero vector is zero (√Σx² would give NaN), as PyTorch's.
pub(super) fn reduce_norm(kind: OpKind, a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let keep = a.int("keepdims", 1) != 0;
    let k = x.f_kind()?;
    let Some(dims) = reduced_dims(a, x.dim())? else {
        // nothing reduced: each element alone
        return Ok(match kind {
            OpKind::ReduceL1 | OpKind::ReduceL2 => x.f_abs()?,
            OpKind::ReduceSumSquare => x.f_mul(x)?,
            _ => x.shallow_clone(),
        });
    };
    let float = is_float_kind(k);
    let xf = if float { x.shallow_clone() } else { x.f_to_kind(Kind::Double)? };
    let y = match kind {
        OpKind::ReduceL1 => xf.f_abs()?.f_sum_dim_intlist(dims.as_slice(), keep, None::<Kind>)?,
        OpKind::ReduceL2 => xf.f_norm_scalaropt_dim(2.0, dims.as_slice(), keep)?,
        OpKind::ReduceSumSquare => xf.f_mul(&xf)?.f_sum_dim_intlist(dims.as_slice(), keep, None::<Kind>)?,
        _ => xf.f_logsumexp(dims.as_slice(), keep)?,
    };
    // integer inputs: ONNX keeps the type (ReduceL2 of ints rounds down, as the reference casts)
    Ok(if y.f_kind()? != k { y.f_to_kind(k)? } else { y })
}

/// LpNormalization: `x / ‖x‖_p` along `axis` (p 1 or 2), no epsilon; a zero vector stays
/// zero, as in the ONNX reference.
pub(super) fn lp_normalization(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let ax = axis(a.int("axis", -1), x.dim())?;
    let p = a.int("p", 2);
    if p != 1 && p != 2 {
        super::bail!("p must be 1 or 2, it is {p}");
    }
    let norm = x.f_norm_scalaropt_dim(p as f64, [ax].as_slice(), true)?;
    // a zero vector stays zero (the reference's 0/0 = 0), with a finite gradient
    let zero = norm.f_eq(0)?;
    Ok(x.f_div(&norm.f_masked_fill(&zero, 1.0)?)?)
}
