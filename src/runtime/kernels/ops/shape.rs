//! Shape and data-movement ops, and the ops that make constants.

use tch::{Kind, Tensor};

use super::{Args, KResult, axes, axis, bail};
use crate::ir::{Attr, PADDING_ROWS};
use crate::runtime::kernels::tensor::{from_ir, is_float_kind};

fn required_ints(a: &Args, i: usize, what: &str) -> KResult<Vec<i64>> {
    match a.ints(i)? {
        Some(v) => Ok(v),
        None => bail!("input `{what}` is required"),
    }
}

/// Replaces negative indices by `index + dim`.
fn wrap_indices(idx: &Tensor, dim: i64) -> KResult<Tensor> {
    let idx = idx.f_to_kind(Kind::Int64)?;
    Ok(idx.f_where_self(&idx.f_ge(0)?, &idx.f_add_scalar(dim)?)?)
}

pub(super) fn reshape(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let mut shape = required_ints(a, 1, "shape")?;
    let allow_zero = a.int("allowzero", 0) != 0;
    let size = x.size();
    for (i, d) in shape.iter_mut().enumerate() {
        if *d == 0 && !allow_zero {
            match size.get(i) {
                Some(&s) => *d = s,
                None => bail!("shape entry {i} is 0 (copy) but the input has rank {}", size.len()),
            }
        }
    }
    Ok(x.f_reshape(&shape)?)
}

pub(super) fn transpose(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let rank = x.dim();
    let perm = match a.attrs().ints("perm") {
        Some(p) => axes(p, rank)?,
        None => (0..rank as i64).rev().collect(),
    };
    if perm.len() != rank {
        bail!("perm {perm:?} does not have {rank} entries");
    }
    Ok(x.f_permute(&perm)?)
}

pub(super) fn concat(a: &Args) -> KResult<Tensor> {
    let xs: Vec<&Tensor> = a.inputs.iter().flatten().collect();
    let Some(first) = xs.first() else { bail!("needs at least one input") };
    let ax = axis(a.int("axis", 0), first.dim())?;
    Ok(Tensor::f_cat(&xs, ax)?)
}

pub(super) fn split(a: &Args) -> KResult<Vec<Tensor>> {
    let x = a.x(0)?;
    let ax = axis(a.int("axis", 0), x.dim())?;
    let dim = x.size()[ax as usize];
    let given = a.ints(1)?;
    let sizes = match given {
        Some(s) => s,
        None => {
            let n = a.attrs().int_opt("num_outputs").unwrap_or(a.n_out() as i64).max(1);
            let chunk = (dim + n - 1) / n;
            (0..n).map(|i| (dim - i * chunk).clamp(0, chunk)).collect()
        }
    };
    if sizes.iter().sum::<i64>() != dim {
        bail!("split sizes {sizes:?} do not add up to {dim} along axis {ax}");
    }
    Ok(x.f_split_with_sizes(&sizes, ax)?)
}

pub(super) fn slice(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let rank = x.dim();
    let (starts, ends, ax, steps) = (required_ints(a, 1, "starts")?, required_ints(a, 2, "ends")?, a.ints(3)?, a.ints(4)?);
    let ax = match ax {
        Some(v) => axes(&v, rank)?,
        None => (0..starts.len() as i64).collect(),
    };
    let steps = steps.unwrap_or(vec![1; starts.len()]);
    if ends.len() != starts.len() || ax.len() != starts.len() || steps.len() != starts.len() {
        bail!("starts {starts:?}, ends {ends:?}, axes {ax:?} and steps {steps:?} differ in length");
    }
    let mut y = x.shallow_clone();
    for i in 0..starts.len() {
        let d = ax[i];
        let dim = y.size()[d as usize];
        let step = steps[i];
        let fix = |v: i64| if v < 0 { v.saturating_add(dim) } else { v };
        if step > 0 {
            let s = fix(starts[i]).clamp(0, dim);
            let e = fix(ends[i]).clamp(0, dim).max(s);
            y = y.f_slice(d, s, e, step)?;
        } else if step < 0 {
            let s = fix(starts[i]).clamp(0, (dim - 1).max(0));
            let e = fix(ends[i]).clamp(-1, dim - 1);
            let idx: Vec<i64> = if dim == 0 { vec![] } else { (e + 1..=s).rev().step_by((-step) as usize).collect() };
            let idx = Tensor::f_from_slice(&idx)?.f_to_device(y.device())?;
            y = y.f_index_select(d, &idx)?;
        } else {
            bail!("step 0 on axis {d}");
        }
    }
    Ok(y)
}

pub(super) fn gather(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let idx = a.x(1)?;
    let ax = axis(a.int("axis", 0), x.dim())?;
    let size = x.size();
    let flat = wrap_indices(idx, size[ax as usize])?.f_reshape([-1])?;
    let mut shape = size[..ax as usize].to_vec();
    shape.extend(idx.size());
    shape.extend(&size[ax as usize + 1..]);
    let rows = x.f_index_select(ax, &flat)?;
    let rows = match a.attrs().ints(PADDING_ROWS) {
        Some(pad) if !pad.is_empty() && ax == 0 && x.requires_grad() => without_padding_gradient(x, &flat, rows, pad)?,
        _ => rows,
    };
    Ok(rows.f_reshape(&shape)?)
}

/// The looked-up `rows` of table `x` (axis 0, at `flat`), with the lookups of the padding
/// rows read from a detached table: same values, and no gradient reaches those rows through
/// them, as PyTorch's `embedding(..., padding_idx)` gives none (`PADDING_ROWS`).
fn without_padding_gradient(x: &Tensor, flat: &Tensor, rows: Tensor, pad: &[i64]) -> KResult<Tensor> {
    let pad = Tensor::f_from_slice(pad)?.f_to_device(flat.device())?;
    let hit = Tensor::f_isin(flat, &pad, false, false)?;
    let mut mask_shape = vec![-1i64];
    mask_shape.extend(std::iter::repeat_n(1, x.dim().saturating_sub(1)));
    let hit = hit.f_reshape(&mask_shape)?;
    let held = x.f_detach()?.f_index_select(0, flat)?;
    Ok(held.f_where_self(&hit, &rows)?)
}

pub(super) fn gather_elements(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let ax = axis(a.int("axis", 0), x.dim())?;
    let idx = wrap_indices(a.x(1)?, x.size()[ax as usize])?;
    Ok(x.f_gather(ax, &idx, false)?)
}

pub(super) fn gather_nd(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let idx = a.x(1)?;
    let b = a.int("batch_dims", 0) as usize;
    let xs = x.size();
    let is = idx.size();
    let Some(&k) = is.last() else { bail!("indices must have rank ≥ 1") };
    let k = k as usize;
    if b + k > xs.len() || b >= is.len() {
        bail!("indices {is:?} with batch_dims {b} do not fit data {xs:?}");
    }
    let batch: i64 = xs[..b].iter().product();
    let m: i64 = is[b..is.len() - 1].iter().product();
    let data = x.f_reshape([batch].iter().copied().chain(xs[b..].iter().copied()).collect::<Vec<_>>())?;
    let idx2 = idx.f_reshape([batch, m, k as i64])?.f_to_kind(Kind::Int64)?;
    let bidx = Tensor::f_arange(batch, (Kind::Int64, x.device()))?.f_reshape([batch, 1])?.f_expand([batch, m], false)?;
    let mut list: Vec<Option<Tensor>> = vec![Some(bidx)];
    for j in 0..k {
        list.push(Some(wrap_indices(&idx2.f_select(2, j as i64)?, xs[b + j])?));
    }
    let y = data.f_index(&list)?;
    let mut shape = is[..is.len() - 1].to_vec();
    shape.extend(&xs[b + k..]);
    Ok(y.f_reshape(&shape)?)
}

pub(super) fn unsqueeze(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let Some(list) = a.ints(1)? else { bail!("`axes` is required") };
    let mut ax = axes(&list, x.dim() + list.len())?;
    ax.sort_unstable();
    let mut y = x.shallow_clone();
    for d in ax {
        y = y.f_unsqueeze(d)?;
    }
    Ok(y)
}

pub(super) fn squeeze(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    match a.ints(1)? {
        Some(list) if !list.is_empty() => {
            let ax = axes(&list, x.dim())?;
            let size = x.size();
            if let Some(d) = ax.iter().find(|&&d| size[d as usize] != 1) {
                bail!("cannot squeeze axis {d} of size {}", size[*d as usize]);
            }
            Ok(x.f_squeeze_dims(&ax)?)
        }
        _ => {
            let keep: Vec<i64> = x.size().into_iter().filter(|&d| d != 1).collect();
            Ok(x.f_reshape(&keep)?)
        }
    }
}

/// numpy broadcasting of two shapes.
fn broadcast(p: &[i64], q: &[i64]) -> KResult<Vec<i64>> {
    let n = p.len().max(q.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let a = if i + p.len() >= n { p[i + p.len() - n] } else { 1 };
        let b = if i + q.len() >= n { q[i + q.len() - n] } else { 1 };
        out[i] = match (a, b) {
            (a, b) if a == b => a,
            (1, b) => b,
            (a, 1) => a,
            _ => bail!("shapes {p:?} and {q:?} do not broadcast"),
        };
    }
    Ok(out)
}

pub(super) fn expand(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let shape = required_ints(a, 1, "shape")?;
    let out = broadcast(&x.size(), &shape)?;
    Ok(x.f_expand(&out, false)?)
}

pub(super) fn shape(a: &Args) -> KResult<Tensor> {
    let size = a.x(0)?.size();
    let r = size.len() as i64;
    let fix = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = fix(a.int("start", 0));
    let end = fix(a.int("end", r)).max(start);
    Ok(Tensor::f_from_slice(&size[start..end])?)
}

pub(super) fn size(a: &Args) -> KResult<Tensor> {
    Ok(Tensor::f_scalar_tensor(a.x(0)?.numel() as i64, (Kind::Int64, tch::Device::Cpu))?)
}

/// A constant attribute tensor, with the run's float override applied.
fn attr_tensor(a: &Args, t: &crate::ir::Tensor) -> KResult<Tensor> {
    let y = from_ir(t)?;
    let k = y.f_kind()?;
    Ok(if is_float_kind(k) && a.float_kind(k) != k { y.f_to_kind(a.float_kind(k))? } else { y })
}

pub(super) fn constant_of_shape(a: &Args) -> KResult<Tensor> {
    let shape = required_ints(a, 0, "input")?;
    let value = match a.attrs().tensor("value") {
        Some(t) => attr_tensor(a, t)?,
        None => Tensor::f_scalar_tensor(0.0, (a.float_kind(Kind::Float), tch::Device::Cpu))?,
    };
    if value.numel() != 1 {
        bail!("attribute `value` must hold one element");
    }
    Ok(value.f_reshape([0i64; 0])?.f_expand(&shape, false)?.f_contiguous()?)
}

pub(super) fn range(a: &Args) -> KResult<Tensor> {
    let start = a.x(0)?;
    let k = start.f_kind()?;
    let (Some(s), Some(l), Some(d)) = (a.scalar(0)?, a.scalar(1)?, a.scalar(2)?) else {
        bail!("start, limit and delta are required");
    };
    if d == 0.0 {
        bail!("delta is 0");
    }
    let n = ((l - s) / d).ceil().max(0.0) as i64;
    if is_float_kind(k) {
        // start + i * delta, computed in f64 like the reference, then cast
        let i = Tensor::f_arange(n, (Kind::Double, start.device()))?;
        Ok(i.f_mul_scalar(d)?.f_add_scalar(s)?.f_to_kind(k)?)
    } else {
        let (s, d) = (s as i64, d as i64);
        let i = Tensor::f_arange(n, (Kind::Int64, start.device()))?;
        Ok(i.f_mul_scalar(d)?.f_add_scalar(s)?.f_to_kind(k)?)
    }
}

pub(super) fn flatten(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let size = x.size();
    let r = size.len() as i64;
    let ax = a.int("axis", 1);
    let ax = if ax < 0 { ax + r } else { ax };
    if !(0..=r).contains(&ax) {
        bail!("axis {} is out of range for rank {r}", a.int("axis", 1));
    }
    let outer: i64 = size[..ax as usize].iter().product();
    let inner: i64 = size[ax as usize..].iter().product();
    Ok(x.f_reshape([outer, inner])?)
}

pub(super) fn tile(a: &Args) -> KResult<Tensor> {
    let reps = required_ints(a, 1, "repeats")?;
    Ok(a.x(0)?.f_repeat(&reps)?)
}

pub(super) fn pad(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let rank = x.dim();
    let mode = a.attrs().str("mode").unwrap_or("constant");
    let (pads, value, ax) = (required_ints(a, 1, "pads")?, a.scalar(2)?.unwrap_or(0.0), a.ints(3)?);
    let ax = match ax {
        Some(v) => axes(&v, rank)?,
        None => (0..rank as i64).collect(),
    };
    if pads.len() != 2 * ax.len() {
        bail!("pads {pads:?} must have 2×{} entries", ax.len());
    }
    let n = ax.len();
    let mut per_axis = vec![(0i64, 0i64); rank];
    for (i, &d) in ax.iter().enumerate() {
        per_axis[d as usize] = (pads[i], pads[n + i]);
    }
    if mode == "constant" {
        let torch: Vec<i64> = per_axis.iter().rev().flat_map(|&(b, e)| [b, e]).collect();
        return Ok(x.f_pad(&torch, "constant", value)?);
    }
    let mut y = x.shallow_clone();
    for (d, &(b, e)) in per_axis.iter().enumerate() {
        if b == 0 && e == 0 {
            continue;
        }
        let len = y.size()[d];
        if len == 0 {
            bail!("cannot {mode}-pad empty axis {d}");
        }
        let idx: Vec<i64> = (-b..len + e)
            .map(|i| match mode {
                "edge" => Ok(i.clamp(0, len - 1)),
                "wrap" => Ok(i.rem_euclid(len)),
                "reflect" => {
                    if len == 1 {
                        return Ok(0);
                    }
                    let period = 2 * (len - 1);
                    let m = i.rem_euclid(period);
                    Ok(if m >= len { period - m } else { m })
                }
                other => Err(super::KernelError(format!("pad mode `{other}` is not an ONNX mode"))),
            })
            .collect::<KResult<_>>()?;
        let idx = Tensor::f_from_slice(&idx)?.f_to_device(y.device())?;
        y = y.f_index_select(d as i64, &idx)?;
    }
    Ok(y)
}

pub(super) fn trilu(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let k = a.scalar(1)?.unwrap_or(0.0) as i64;
    Ok(if a.int("upper", 1) != 0 { x.f_triu(k)? } else { x.f_tril(k)? })
}

pub(super) fn scatter_nd(a: &Args) -> KResult<Tensor> {
    let data = a.x(0)?;
    let idx = a.x(1)?;
    let upd = a.x(2)?;
    let ds = data.size();
    let is = idx.size();
    let Some(&k) = is.last() else { bail!("indices must have rank ≥ 1") };
    let k = k as usize;
    if k > ds.len() {
        bail!("index depth {k} exceeds data rank {}", ds.len());
    }
    let idx2 = idx.f_reshape([-1, k as i64])?.f_to_kind(Kind::Int64)?;
    let rows = idx2.size()[0];
    let rest = &ds[k..];
    let upd2 = upd.f_reshape([rows].iter().chain(rest).copied().collect::<Vec<_>>())?;
    let reduction = a.attrs().str("reduction").unwrap_or("none");
    let cols: Vec<Tensor> = (0..k)
        .map(|j| wrap_indices(&idx2.f_select(1, j as i64)?, ds[j]))
        .collect::<KResult<_>>()?;
    match reduction {
        "none" | "add" => {
            let list: Vec<Option<Tensor>> = cols.into_iter().map(Some).collect();
            Ok(data.f_index_put(&list, &upd2, reduction == "add")?)
        }
        "mul" | "max" | "min" => {
            let mut lin = Tensor::f_zeros([rows], (Kind::Int64, data.device()))?;
            let mut stride = 1i64;
            for j in (0..k).rev() {
                lin = lin.f_add(&cols[j].f_mul_scalar(stride)?)?;
                stride *= ds[j];
            }
            let flat = data.f_reshape([stride].iter().chain(rest).copied().collect::<Vec<_>>())?;
            let how = match reduction {
                "mul" => "prod",
                "max" => "amax",
                _ => "amin",
            };
            Ok(flat.f_index_reduce(0, &lin, &upd2, how, true)?.f_reshape(&ds)?)
        }
        other => bail!("reduction `{other}` is not an ONNX value"),
    }
}

pub(super) fn constant(a: &Args) -> KResult<Tensor> {
    let attrs = a.attrs();
    let fk = a.float_kind(Kind::Float);
    let cpu = tch::Device::Cpu;
    if let Some(t) = attrs.tensor("value") {
        return attr_tensor(a, t);
    }
    match (attrs.get("value_float"), attrs.get("value_floats"), attrs.get("value_int"), attrs.get("value_ints")) {
        (Some(Attr::Float(v)), ..) => Ok(Tensor::f_scalar_tensor(*v as f64, (fk, cpu))?),
        (_, Some(Attr::Floats(v)), ..) => Ok(Tensor::f_from_slice(v)?.f_to_kind(fk)?),
        (_, _, Some(Attr::Int(v)), _) => Ok(Tensor::f_scalar_tensor(*v, (Kind::Int64, cpu))?),
        (_, _, _, Some(Attr::Ints(v))) => Ok(Tensor::f_from_slice(v)?),
        _ => {
            let names: Vec<&String> = attrs.0.keys().collect();
            bail!("unsupported Constant attributes {names:?} (strings and sparse tensors have no tch form)")
        }
    }
}
