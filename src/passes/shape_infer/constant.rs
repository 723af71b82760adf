//! Ops that make values: Constant, ConstantOfShape, Range (integer ones evaluated).

use super::context::{Ctx, MAX_EVAL_ELEMS, Outs, int_like, numel, one, ty, ty_opt};
use crate::ir::DType;

/// Constant: the type (and integer value) of its `value*` attribute.
pub(super) fn constant(cx: &Ctx) -> Outs {
    let a = cx.attrs();
    if let Some(t) = a.tensor("value") {
        let ints = if t.dtype.is_int() || t.dtype == DType::Bool { t.to_i64_vec() } else { None };
        one((ty(t.dtype, t.dims.clone()), ints))
    } else if let Some(v) = a.int_opt("value_int") {
        one((ty(DType::I64, vec![]), Some(vec![v])))
    } else if let Some(v) = a.ints("value_ints") {
        one((ty(DType::I64, vec![v.len() as i64]), Some(v.to_vec())))
    } else if a.get("value_float").is_some() {
        one((ty(DType::F32, vec![]), None))
    } else if let Some(v) = a.floats("value_floats") {
        one((ty(DType::F32, vec![v.len() as i64]), None))
    } else {
        let t = cx.node.outputs.first().and_then(|&o| cx.graph.value(o).data.as_ref());
        match t {
            Some(t) => one((ty(t.dtype, t.dims.clone()), t.to_i64_vec())),
            None => Err("Constant without a value attribute".into()),
        }
    }
}

/// ConstantOfShape(shape): a tensor of that shape filled with `value` (f32 0 by default).
pub(super) fn constant_of_shape(cx: &Ctx) -> Outs {
    let shape = cx.need_ints(0, "shape")?.ok_or("no shape")?.to_vec();
    let (dtype, fill) = match cx.attrs().tensor("value") {
        Some(t) => (t.dtype, t.to_i64_vec().and_then(|v| v.first().copied())),
        None => (DType::F32, None),
    };
    let n = numel(&shape)?;
    let ints = match fill {
        Some(f) if (dtype.is_int() || dtype == DType::Bool) && n as usize <= MAX_EVAL_ELEMS => Some(vec![f; n as usize]),
        _ => None,
    };
    one((ty(dtype, shape), ints))
}

/// Range(start, limit, delta): `[ceil((limit − start) / delta)]`, from constant scalars.
pub(super) fn range(cx: &Ctx) -> Outs {
    let dtype = cx.dtype(0).or(cx.dtype(1));
    let scalar = |i: usize| -> Option<f64> {
        if let Some(v) = cx.ints(i) {
            return v.first().map(|&x| x as f64);
        }
        let val = cx.graph.value(cx.input(i)?);
        val.data.as_ref().and_then(|t| t.to_f64_vec()).and_then(|v| v.first().copied())
    };
    let (Some(s), Some(l), Some(d)) = (scalar(0), scalar(1), scalar(2)) else {
        let v = cx.input(1).map(|v| cx.graph.value(v).name.clone()).unwrap_or_default();
        return Err(format!("its limit `{v}` (or start/delta) is not a constant after binding dims"));
    };
    if d == 0.0 {
        return Err("delta is 0".into());
    }
    let n = ((l - s) / d).ceil().max(0.0) as i64;
    let ints = if int_like(dtype) && n as usize <= MAX_EVAL_ELEMS {
        Some((0..n).map(|i| (s as i64).wrapping_add(i.wrapping_mul(d as i64))).collect())
    } else {
        None
    };
    one((ty_opt(dtype, Some(vec![n])), ints))
}
