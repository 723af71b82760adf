//! Shape ops and views: Shape, Size, Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Expand,
//! Tile, Trilu. Integer values pass through the views (and Shape and Size make them), so shape
//! arithmetic evaluates.

use super::context::{Ctx, MAX_EVAL_ELEMS, Outs, dim_axis, norm_axis, numel, one, ty, ty_opt};
use super::elementwise::bcast_index;
use super::elementwise::broadcast;
use crate::ir::DType;

/// Shape(x) with optional `start`/`end`: int64 `[k]`, evaluated.
pub(super) fn shape(cx: &Ctx) -> Outs {
    let Some(x) = cx.shape(0) else { return one((None, None)) };
    let a = cx.attrs();
    let r = x.len() as i64;
    let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = clampi(a.int("start", 0));
    let end = clampi(a.int("end", r));
    let v: Vec<i64> = if start < end { x[start..end].to_vec() } else { Vec::new() };
    one((ty(DType::I64, vec![v.len() as i64]), Some(v)))
}

/// Size(x): an int64 scalar, evaluated.
pub(super) fn size(cx: &Ctx) -> Outs {
    let v = match cx.shape(0) {
        Some(x) => Some(vec![numel(x)?]),
        None => None,
    };
    one((ty(DType::I64, vec![]), v))
}

/// Reshape(x, target): 0 copies a dim (unless `allowzero`), one -1 takes the rest.
pub(super) fn reshape(cx: &Ctx) -> Outs {
    let target = cx.need_ints(1, "target shape")?.ok_or("no target shape")?;
    let Some(x) = cx.shape(0) else { return one((ty_opt(cx.dtype(0), None), None)) };
    let allowzero = cx.attrs().int("allowzero", 0) != 0;
    let mut out: Vec<i64> = Vec::with_capacity(target.len());
    let mut infer_at = None;
    for (i, &t) in target.iter().enumerate() {
        if t == 0 && !allowzero {
            out.push(*x.get(i).ok_or_else(|| format!("target {target:?} copies dim {i} of {x:?}"))?);
        } else if t == -1 {
            if infer_at.replace(i).is_some() {
                return Err(format!("target {target:?} has two -1"));
            }
            out.push(1);
        } else if t < 0 {
            return Err(format!("target {target:?} has a negative size"));
        } else {
            out.push(t);
        }
    }
    let total = numel(x)?;
    let cannot = || format!("cannot reshape {x:?} ({total} elements) to {target:?}");
    if let Some(i) = infer_at {
        let rest = numel(&out).map_err(|_| cannot())?;
        if rest == 0 || total % rest != 0 {
            return Err(format!("cannot reshape {x:?} to {target:?}"));
        }
        out[i] = total / rest;
    } else if numel(&out).map_err(|_| cannot())? != total {
        return Err(format!("cannot reshape {x:?} ({total} elements) to {out:?}"));
    }
    one((ty_opt(cx.dtype(0), Some(out)), cx.ints(0).map(<[i64]>::to_vec)))
}

/// Flatten(x): `[∏ dims before axis, ∏ dims from axis]`.
pub(super) fn flatten(cx: &Ctx) -> Outs {
    let s = match cx.shape(0) {
        Some(x) => {
            let mut ax = cx.attrs().int("axis", 1);
            if ax < 0 {
                ax += x.len() as i64;
            }
            let ax = (ax.max(0) as usize).min(x.len());
            Some(vec![numel(&x[..ax])?, numel(&x[ax..])?])
        }
        None => None,
    };
    one((ty_opt(cx.dtype(0), s), cx.ints(0).map(<[i64]>::to_vec)))
}

/// Transpose(x) by `perm` (reversed dims by default).
pub(super) fn transpose(cx: &Ctx) -> Outs {
    let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
    let perm: Vec<i64> = cx.attrs().ints("perm").map(<[i64]>::to_vec).unwrap_or_else(|| (0..x.len() as i64).rev().collect());
    if perm.len() != x.len() {
        return Err(format!("perm {perm:?} does not fit rank {}", x.len()));
    }
    let axes = perm.iter().map(|&p| dim_axis(p, x.len())).collect::<Result<Vec<_>, _>>()?;
    if (0..axes.len()).any(|i| axes[..i].contains(&axes[i])) {
        return Err(format!("perm {perm:?} repeats an axis"));
    }
    let out = axes.iter().map(|&p| x[p]).collect();
    let ints = match cx.ints(0) {
        Some(v) if x.len() <= 1 => Some(v.to_vec()),
        _ => None,
    };
    one((ty_opt(cx.dtype(0), Some(out)), ints))
}

/// Unsqueeze(x, axes): a 1 inserted at each of `axes` (of the output).
pub(super) fn unsqueeze(cx: &Ctx) -> Outs {
    let axes: Vec<i64> = cx.need_ints(1, "axes")?.ok_or("no axes")?.to_vec();
    let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
    let r = x.len() + axes.len();
    let mut ax: Vec<usize> = axes.iter().map(|&v| norm_axis(v, r)).collect::<Result<_, _>>()?;
    ax.sort_unstable();
    let mut out = Vec::with_capacity(r);
    let mut it = x.iter();
    for i in 0..r {
        if ax.binary_search(&i).is_ok() {
            out.push(1);
        } else {
            out.push(*it.next().ok_or("repeated axes")?);
        }
    }
    one((ty_opt(cx.dtype(0), Some(out)), cx.ints(0).map(<[i64]>::to_vec)))
}

/// Squeeze(x, axes?): the given axes removed, or every dim of size 1.
pub(super) fn squeeze(cx: &Ctx) -> Outs {
    let axes: Option<Vec<i64>> = cx.need_ints(1, "axes")?.map(<[i64]>::to_vec);
    let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
    let out: Vec<i64> = match axes {
        Some(axes) => {
            let ax: Vec<usize> = axes.iter().map(|&v| norm_axis(v, x.len())).collect::<Result<_, _>>()?;
            x.iter().enumerate().filter(|(i, _)| !ax.contains(i)).map(|(_, &d)| d).collect()
        }
        None => x.iter().copied().filter(|&d| d != 1).collect(),
    };
    one((ty_opt(cx.dtype(0), Some(out)), cx.ints(0).map(<[i64]>::to_vec)))
}

/// Expand(x, shape): x broadcast with `shape`.
pub(super) fn expand(cx: &Ctx) -> Outs {
    let target = cx.need_ints(1, "shape")?.ok_or("no shape")?;
    let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
    let out = broadcast(x, target)?;
    let ints = match cx.ints(0) {
        Some(v) if (numel(&out)? as usize) <= MAX_EVAL_ELEMS => {
            Some(bcast_index(&out, x).into_iter().map(|i| v.get(i).copied().unwrap_or(0)).collect())
        }
        _ => None,
    };
    one((ty_opt(cx.dtype(0), Some(out)), ints))
}

/// Tile(x, repeats): each dim times its repeat count.
pub(super) fn tile(cx: &Ctx) -> Outs {
    let reps = cx.need_ints(1, "repeats")?.ok_or("no repeats")?;
    let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
    if reps.len() != x.len() {
        return Err(format!("repeats {reps:?} do not fit {x:?}"));
    }
    if let Some(r) = reps.iter().find(|&&r| r < 0) {
        return Err(format!("repeats {reps:?} hold a negative count {r}"));
    }
    let out = x
        .iter()
        .zip(reps)
        .map(|(d, r)| d.checked_mul(*r).ok_or_else(|| format!("repeats {reps:?} of {x:?} overflow")))
        .collect::<Result<Vec<_>, _>>()?;
    one((ty_opt(cx.dtype(0), Some(out)), None))
}

/// Trilu: the input's type.
pub(super) fn trilu(cx: &Ctx) -> Outs {
    one(cx.same(0))
}
