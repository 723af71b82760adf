//! ScatterElements and OneHot: writes and encodings by element index.

use tch::{Kind, Tensor};

use super::{Args, KResult, axis, bail};

/// Negative indices counted from the end of a dim of `size`.
fn wrapped(idx: &Tensor, size: i64) -> KResult<Tensor> {
    let idx = idx.f_to_kind(Kind::Int64)?;
    Ok(idx.f_where_self(&idx.f_ge(0)?, &idx.f_add_scalar(size)?)?)
}

/// ScatterElements: `data` with `updates` written (or reduced: add, mul, max, min) at
/// `indices` along `axis`.
pub(super) fn scatter_elements(a: &Args) -> KResult<Tensor> {
    let data = a.x(0)?;
    let ax = axis(a.int("axis", 0), data.dim())?;
    let idx = wrapped(a.x(1)?, data.size()[ax as usize])?;
    let updates = a.x(2)?;
    Ok(match a.attrs().str("reduction").unwrap_or("none") {
        "none" => data.f_scatter(ax, &idx, updates)?,
        "add" => data.f_scatter_add(ax, &idx, updates)?,
        "mul" => data.f_internal_scatter_reduce(ax, &idx, updates, "prod", true)?,
        "max" => data.f_internal_scatter_reduce(ax, &idx, updates, "amax", true)?,
        "min" => data.f_internal_scatter_reduce(ax, &idx, updates, "amin", true)?,
        other => bail!("reduction must be none, add, mul, max or min, it is `{other}`"),
    })
}

/// OneHot(indices, depth, values = [off, on]): a new `axis` of `depth` entries, `on` where
/// the entry is the index (negative indices count from the end) and `off` elsewhere, in
/// `values`' type; an index outside −depth..depth marks nothing.
pub(super) fn one_hot(a: &Args) -> KResult<Tensor> {
    let indices = a.x(0)?;
    let depth = match a.scalar(1)? {
        Some(d) if d >= 1.0 => d as i64,
        Some(d) => bail!("depth must be at least 1, it is {d}"),
        None => bail!("input `depth` is required"),
    };
    let values = a.x(2)?;
    if values.numel() != 2 {
        bail!("values must hold [off, on], it holds {} elements", values.numel());
    }
    let rank = indices.dim() + 1;
    let ax = axis(a.int("axis", -1), rank)?;
    let idx = indices.f_to_kind(Kind::Int64)?;
    let idx = idx.f_where_self(&idx.f_ge(0)?, &idx.f_add_scalar(depth)?)?.f_unsqueeze(ax)?;
    let mut shape = vec![1i64; rank];
    shape[ax as usize] = depth;
    let positions = Tensor::f_arange(depth, (Kind::Int64, indices.device()))?.f_reshape(shape.as_slice())?;
    let hot = idx.f_eq_tensor(&positions)?;
    let flat = values.f_reshape([2])?;
    let (off, on) = (flat.f_select(0, 0)?, flat.f_select(0, 1)?);
    Ok(on.f_where_self(&hot, &off)?)
}
