//! Elementwise unary, binary and variadic ops, casts, Clip and Where.

use tch::{Kind, Tensor};

use super::{Args, KResult, bail};
use crate::ir::{DType, OpKind};
use crate::runtime::kernels::tensor::{is_float_kind, kind_of};

pub(super) fn unary(kind: OpKind, a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    use OpKind::*;
    Ok(match kind {
        Abs => x.f_abs()?,
        Neg => x.f_neg()?,
        Exp => x.f_exp()?,
        Log => x.f_log()?,
        Sqrt => x.f_sqrt()?,
        Reciprocal => x.f_reciprocal()?,
        Tanh => x.f_tanh()?,
        Sigmoid => x.f_sigmoid()?,
        Relu => x.f_relu()?,
        Erf => x.f_erf()?,
        Sin => x.f_sin()?,
        Cos => x.f_cos()?,
        Floor => x.f_floor()?,
        Ceil => x.f_ceil()?,
        Round => x.f_round()?,
        Sign => x.f_sign()?,
        Not => x.f_logical_not()?,
        BitwiseNot => x.f_bitwise_not()?,
        IsNaN => x.f_isnan()?,
        IsInf => {
            let neg = a.int("detect_negative", 1) != 0;
            let pos = a.int("detect_positive", 1) != 0;
            let inf = x.f_isinf()?;
            match (neg, pos) {
                (true, true) => inf,
                (true, false) => inf.f_logical_and(&x.f_lt(0.0)?)?,
                (false, true) => inf.f_logical_and(&x.f_gt(0.0)?)?,
                (false, false) => inf.f_zeros_like()?,
            }
        }
        Softplus => x.f_softplus()?,
        LeakyRelu => {
            let alpha = a.float("alpha", 0.01);
            x.f_where_self(&x.f_ge(0.0)?, &x.f_mul_scalar(alpha)?)?
        }
        Elu => {
            let alpha = a.float("alpha", 1.0);
            let neg = x.f_exp()?.f_sub_scalar(1.0)?.f_mul_scalar(alpha)?;
            x.f_where_self(&x.f_ge(0.0)?, &neg)?
        }
        Gelu => x.f_gelu(a.attrs().str("approximate").unwrap_or("none"))?,
        HardSigmoid => {
            let alpha = a.float("alpha", 0.2);
            let beta = a.float("beta", 0.5);
            x.f_mul_scalar(alpha)?.f_add_scalar(beta)?.f_clamp(0.0, 1.0)?
        }
        HardSwish => x.f_hardswish()?,
        Identity => x.shallow_clone(),
        _ => bail!("not a unary op"),
    })
}

/// The tch kind for an ONNX `to` code, honouring the run's float override.
fn target_kind(a: &Args, code: i64) -> KResult<Kind> {
    let Some(dtype) = DType::from_onnx(code as i32) else {
        bail!("unknown element type code {code}");
    };
    let k = kind_of(dtype)?;
    Ok(if is_float_kind(k) { a.float_kind(k) } else { k })
}

pub(super) fn cast(a: &Args) -> KResult<Tensor> {
    let Some(to) = a.attrs().int_opt("to") else {
        bail!("attribute `to` is required");
    };
    let k = target_kind(a, to)?;
    let y = to_kind_onnx(a, a.x(0)?, k)?;
    // 4-bit integers are held unpacked in 8 bits: wrap into their range as a 4-bit store would
    Ok(match DType::from_onnx(to as i32) {
        Some(DType::I4) => y.f_add_scalar(8)?.f_remainder(16)?.f_sub_scalar(8)?,
        Some(DType::U4) => y.f_remainder(16)?,
        _ => y,
    })
}

pub(super) fn cast_like(a: &Args) -> KResult<Tensor> {
    let k = a.x(1)?.f_kind()?;
    to_kind_onnx(a, a.x(0)?, k)
}

/// The largest finite value of a float8 kind.
fn float8_max(k: Kind) -> Option<f64> {
    match k {
        Kind::Float8e4m3fn => Some(448.0),
        Kind::Float8e4m3fnuz => Some(240.0),
        Kind::Float8e5m2 | Kind::Float8e5m2fnuz => Some(57344.0),
        _ => None,
    }
}

/// A cast with ONNX's float8 rules, which libtorch's conversion does not follow: with
/// `saturate` (the default) values beyond the range, infinities included, clamp to ±max; without
/// it they become NaN (±inf for E5M2, the one type with infinities).
fn to_kind_onnx(a: &Args, x: &Tensor, k: Kind) -> KResult<Tensor> {
    let from = x.f_kind()?;
    let Some(max) = float8_max(k).filter(|_| is_float_kind(from)) else {
        return Ok(x.f_to_kind(k)?);
    };
    // wide enough for every float8 value and the overflow test
    let wide = x.f_to_kind(Kind::Float)?;
    if a.int("saturate", 1) != 0 {
        return Ok(wide.f_clamp(-max, max)?.f_to_kind(k)?);
    }
    // beyond the midpoint to the next (unrepresentable) step, rounding cannot come back to max
    let step = match k {
        Kind::Float8e4m3fn => 32.0,
        Kind::Float8e4m3fnuz => 16.0,
        _ => 8192.0,
    };
    let over = wide.f_abs()?.f_gt(max + step / 2.0)?;
    let fill = if k == Kind::Float8e5m2 { wide.f_sign()?.f_mul_scalar(f64::INFINITY)? } else { wide.f_full_like(f64::NAN)? };
    Ok(wide.f_clamp(-max, max)?.f_where_self(&over.f_logical_not()?, &fill)?.f_to_kind(k)?)
}

pub(super) fn clip(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    // ONNX's bounds are of x's type; under autocast x may be in the low type where the bounds
    // stay fp32, and the result keeps x's type as torch's clamp by a number does
    let bound = |i: usize| -> KResult<Option<Tensor>> {
        Ok(match a.opt(i) {
            Some(t) if t.kind() != x.kind() && is_float_kind(x.f_kind()?) => Some(t.f_to_kind(x.kind())?),
            Some(t) => Some(t.shallow_clone()),
            None => None,
        })
    };
    let (lo, hi) = (bound(1)?, bound(2)?);
    if lo.is_none() && hi.is_none() {
        return Ok(x.shallow_clone());
    }
    Ok(x.f_clamp_tensor(lo.as_ref(), hi.as_ref())?)
}

pub(super) fn binary(kind: OpKind, a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let y = a.x(1)?;
    use OpKind::*;
    let int = !is_float_kind(x.f_kind()?);
    Ok(match kind {
        Add => x.f_add(y)?,
        Sub => x.f_sub(y)?,
        Mul => x.f_mul(y)?,
        Div if int => x.f_div_tensor_mode(y, "trunc")?,
        Div => x.f_div(y)?,
        Pow => {
            let k = x.f_kind()?;
            let r = x.f_pow(y)?;
            if r.f_kind()? != k { r.f_to_kind(k)? } else { r }
        }
        Mod => {
            if a.int("fmod", 0) != 0 {
                x.f_fmod_tensor(y)?
            } else {
                x.f_remainder_tensor(y)?
            }
        }
        Equal => x.f_eq_tensor(y)?,
        Less => x.f_lt_tensor(y)?,
        LessOrEqual => x.f_le_tensor(y)?,
        Greater => x.f_gt_tensor(y)?,
        GreaterOrEqual => x.f_ge_tensor(y)?,
        And => x.f_logical_and(y)?,
        Or => x.f_logical_or(y)?,
        Xor => x.f_logical_xor(y)?,
        BitwiseAnd => x.f_bitwise_and_tensor(y)?,
        BitwiseOr => x.f_bitwise_or_tensor(y)?,
        BitwiseXor => x.f_bitwise_xor_tensor(y)?,
        _ => bail!("not a binary op"),
    })
}

pub(super) fn variadic(kind: OpKind, a: &Args) -> KResult<Tensor> {
    let xs: Vec<&Tensor> = a.inputs.iter().flatten().collect();
    let Some((first, rest)) = xs.split_first() else {
        bail!("needs at least one input");
    };
    let mut acc = first.shallow_clone();
    for x in rest {
        acc = match kind {
            OpKind::Max => acc.f_maximum(x)?,
            OpKind::Min => acc.f_minimum(x)?,
            _ => acc.f_add(x)?,
        };
    }
    if kind == OpKind::Mean {
        acc = acc.f_div_scalar(xs.len() as f64)?;
    }
    Ok(acc)
}

pub(super) fn where_(a: &Args) -> KResult<Tensor> {
    let c = a.x(0)?.f_to_kind(Kind::Bool)?;
    Ok(a.x(1)?.f_where_self(&c, a.x(2)?)?)
}

/// BitShift (unsigned integers): shifted in int64, where every unsigned value up to 32 bits
/// is exact, and wrapped back to the input's width.
pub(super) fn bit_shift(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let y = a.x(1)?;
    let k = x.f_kind()?;
    let (xi, yi) = (x.f_to_kind(Kind::Int64)?, y.f_to_kind(Kind::Int64)?);
    let r = match a.attrs().str("direction") {
        Some("LEFT") => xi.f_bitwise_left_shift(&yi)?,
        Some("RIGHT") => xi.f_bitwise_right_shift(&yi)?,
        other => bail!("direction must be LEFT or RIGHT, it is {other:?}"),
    };
    Ok(r.f_to_kind(k)?)
}
