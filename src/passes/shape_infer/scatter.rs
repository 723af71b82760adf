//! ScatterElements and OneHot.

use super::context::{Ctx, Outs, norm_axis, one, ty_opt};
use super::resample::constant_numbers;

/// ScatterElements: the data's type.
pub(super) fn scatter_elements(cx: &Ctx) -> Outs {
    one(cx.same(0))
}

/// OneHot(indices, depth, values): the indices' dims with `depth` inserted at `axis`, in the
/// values' type (depth must be a constant).
pub(super) fn one_hot(cx: &Ctx) -> Outs {
    let dtype = cx.dtype(2);
    let Some(indices) = cx.shape(0) else { return one((ty_opt(dtype, None), None)) };
    let depth = match cx.input(1) {
        Some(v) => match constant_numbers(cx, v).as_deref() {
            Some(&[d]) if d >= 1.0 => d as i64,
            Some(d) => return Err(format!("depth must be one number of at least 1, it is {d:?}")),
            None => return Err(format!("its depth (`{}`) is not a constant; the output shape must be known at plan time", cx.name(1))),
        },
        None => return Err("OneHot has no depth".into()),
    };
    let ax = norm_axis(cx.attrs().int("axis", -1), indices.len() + 1)?;
    let mut out = indices.to_vec();
    out.insert(ax, depth);
    one((ty_opt(dtype, Some(out)), None))
}
