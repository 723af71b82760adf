//! Elementwise ops: Identity; unary Abs, Neg, Sign, Not, IsNaN, IsInf, Exp, Log, Sqrt,
//! Reciprocal, Tanh, Sigmoid, Relu, Erf, Sin, Cos, Floor, Ceil, Round, Softplus, LeakyRelu, Elu,
//! Gelu, HardSigmoid, HardSwish, Clip; Cast, CastLike; binary and variadic Add, Sub, Mul, Div,
//! Mod, Pow, Max, Min, Sum, Mean; comparisons and logic Equal, Less, LessOrEqual, Greater,
//! GreaterOrEqual, And, Or, Xor; Where. Numpy broadcasting, and integer values evaluated
//! (wrapping, as the int64 kernels do) for shape arithmetic.

use super::context::{Ctx, MAX_EVAL_ELEMS, Out, Outs, Ty, int_like, numel, one};
use crate::ir::{DType, OpKind};

/// Multidirectional (numpy) broadcasting.
pub fn broadcast(a: &[i64], b: &[i64]) -> Result<Vec<i64>, String> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i < r - a.len() { 1 } else { a[i - (r - a.len())] };
        let db = if i < r - b.len() { 1 } else { b[i - (r - b.len())] };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(format!("shapes {a:?} and {b:?} do not broadcast"));
        };
    }
    Ok(out)
}

/// For each element of `out`, the row-major index into a tensor of shape `input` broadcast to
/// it. `out` holds at most [`MAX_EVAL_ELEMS`] elements (callers check).
pub(super) fn bcast_index(out: &[i64], input: &[i64]) -> Vec<usize> {
    let n: i64 = out.iter().product();
    let off = out.len() - input.len();
    let mut strides = vec![0i64; out.len()];
    let mut s = 1i64;
    for i in (0..input.len()).rev() {
        strides[i + off] = if input[i] == 1 { 0 } else { s };
        // wraps only where another dim is 0, and then no stride is used
        s = s.wrapping_mul(input[i]);
    }
    let mut idx = Vec::with_capacity(n.max(0) as usize);
    let mut coord = vec![0i64; out.len()];
    for _ in 0..n.max(0) {
        idx.push(coord.iter().zip(&strides).map(|(c, s)| c * s).sum::<i64>() as usize);
        for d in (0..out.len()).rev() {
            coord[d] += 1;
            if coord[d] < out[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    idx
}

type Eval<'f> = Option<&'f dyn Fn(&[i64]) -> i64>;

/// Elementwise over broadcast inputs: result type and (if all inputs are evaluated) values.
fn elementwise(cx: &Ctx, inputs: &[usize], dtype: Option<DType>, f: Eval) -> Result<Out, String> {
    let Some(dtype) = dtype else { return Ok((None, None)) };
    let mut shape: Option<Vec<i64>> = Some(Vec::new());
    for &i in inputs {
        if cx.input(i).is_none() {
            continue;
        }
        shape = match (shape, cx.shape(i)) {
            (Some(s), Some(t)) => Some(broadcast(&s, t)?),
            _ => None,
        };
    }
    let mut ints = None;
    if let (Some(f), Some(out)) = (f, &shape)
        && (dtype.is_int() || dtype == DType::Bool)
        && numel(out)? as usize <= MAX_EVAL_ELEMS
    {
        let vals: Option<Vec<(&[i64], Vec<usize>)>> = inputs
            .iter()
            .map(|&i| Some((cx.ints(i)?, bcast_index(out, cx.shape(i)?))))
            .collect();
        if let Some(vals) = vals {
            let n = numel(out)? as usize;
            let mut res = Vec::with_capacity(n);
            let mut args = vec![0i64; vals.len()];
            for e in 0..n {
                for (k, (v, idx)) in vals.iter().enumerate() {
                    args[k] = *v.get(idx[e]).ok_or("evaluated value has the wrong size")?;
                }
                res.push(f(&args));
            }
            ints = Some(res);
        }
    }
    Ok((Some(Ty { dtype, shape }), ints))
}

/// Identity: the input's type and value.
pub(super) fn identity(cx: &Ctx) -> Outs {
    one((cx.ty(0).cloned(), cx.ints(0).map(<[i64]>::to_vec)))
}

/// Unary ops: the input's shape; Abs, Neg, Sign and Not evaluated on integers.
pub(super) fn unary(cx: &Ctx, kind: OpKind) -> Outs {
    use OpKind::*;
    let f: &dyn Fn(&[i64]) -> i64 = match kind {
        Abs => &|x| x[0].wrapping_abs(),
        Neg => &|x| x[0].wrapping_neg(),
        Sign => &|x| x[0].signum(),
        Not => return one(elementwise(cx, &[0], Some(DType::Bool), Some(&|x| (x[0] == 0) as i64))?),
        IsNaN | IsInf => return one(elementwise(cx, &[0], Some(DType::Bool), None)?),
        _ => return one(cx.same(0)),
    };
    one(elementwise(cx, &[0], cx.dtype(0), Some(f))?)
}

/// BitwiseNot: the input's type; integer values evaluated for signed types, whose i64 form
/// has the same bits (unsigned ones are zero-extended, so their complement is not).
pub(super) fn bitwise_not(cx: &Ctx) -> Outs {
    let signed = matches!(cx.dtype(0), Some(DType::I8 | DType::I16 | DType::I32 | DType::I64));
    let f: Eval = if signed { Some(&|x| !x[0]) } else { None };
    one(elementwise(cx, &[0], cx.dtype(0), f)?)
}

/// Cast (to the `to` attribute) and CastLike (to the second input's type).
pub(super) fn cast(cx: &Ctx, kind: OpKind) -> Outs {
    let to = if kind == OpKind::CastLike {
        match cx.dtype(1) {
            Some(to) => to,
            None => return one((None, None)),
        }
    } else {
        DType::from_onnx(cx.attrs().int("to", 0) as i32).ok_or("Cast has no valid `to` type")?
    };
    let shape = cx.shape(0).map(<[i64]>::to_vec);
    let ints = if int_like(Some(to)) { cx.ints(0).map(|v| v.iter().map(|&x| cast_int(x, to)).collect()) } else { None };
    one((Some(Ty { dtype: to, shape }), ints))
}

fn cast_int(v: i64, to: DType) -> i64 {
    match to {
        DType::Bool => (v != 0) as i64,
        DType::I8 => v as i8 as i64,
        DType::U8 => v as u8 as i64,
        DType::I16 => v as i16 as i64,
        DType::U16 => v as u16 as i64,
        DType::I32 => v as i32 as i64,
        DType::U32 => v as u32 as i64,
        _ => v,
    }
}

/// Arithmetic over broadcast inputs (binary, or variadic Max/Min/Sum/Mean), in the first
/// input's type.
pub(super) fn arithmetic(cx: &Ctx, kind: OpKind) -> Outs {
    use OpKind::*;
    let n = cx.node.inputs.len();
    let idx: Vec<usize> = (0..n).collect();
    let fmod = cx.attrs().int("fmod", 0) != 0;
    let f: Eval = match kind {
        Add => Some(&|x| x[0].wrapping_add(x[1])),
        Sub => Some(&|x| x[0].wrapping_sub(x[1])),
        Mul => Some(&|x| x[0].wrapping_mul(x[1])),
        Div => Some(&|x| if x[1] == 0 { 0 } else { x[0].wrapping_div(x[1]) }),
        Mod if fmod => Some(&|x| if x[1] == 0 { 0 } else { x[0].wrapping_rem(x[1]) }),
        Mod => Some(&|x| if x[1] == 0 { 0 } else { x[0].wrapping_rem(x[1]).wrapping_add(x[1]).wrapping_rem(x[1]) }),
        Max => Some(&|x| x.iter().copied().max().unwrap_or(0)),
        Min => Some(&|x| x.iter().copied().min().unwrap_or(0)),
        Sum => Some(&|x| x.iter().fold(0, |a, &b| a.wrapping_add(b))),
        BitwiseAnd => Some(&|x| x[0] & x[1]),
        BitwiseOr => Some(&|x| x[0] | x[1]),
        BitwiseXor => Some(&|x| x[0] ^ x[1]),
        _ => None,
    };
    // the binary ones evaluate only with their two operands (a damaged node may have fewer)
    let f = if matches!(kind, Add | Sub | Mul | Div | Mod | BitwiseAnd | BitwiseOr | BitwiseXor) && n != 2 { None } else { f };
    one(elementwise(cx, &idx, cx.dtype(0), f)?)
}

/// `ApplyRotary(x, cos, sin)`: the three broadcast, in x's type; a table whose last axis is
/// half x's (one angle per pair) counts as x's width.
pub(super) fn apply_rotary(cx: &Ctx) -> Outs {
    let d = cx.shape(0).and_then(|s| s.last().copied());
    let mut shape = cx.shape(0).map(<[i64]>::to_vec);
    for i in [1, 2] {
        let Some(mut t) = cx.shape(i).map(<[i64]>::to_vec) else {
            shape = None;
            continue;
        };
        if let (Some(d), Some(last)) = (d, t.last_mut())
            && d % 2 == 0
            && *last * 2 == d
        {
            *last = d;
        }
        shape = match shape {
            Some(s) => Some(broadcast(&s, &t)?),
            None => None,
        };
    }
    one((cx.dtype(0).map(|dtype| Ty { dtype, shape }), None))
}

/// Comparisons and logic: bool over the two broadcast inputs.
pub(super) fn compare(cx: &Ctx, kind: OpKind) -> Outs {
    use OpKind::*;
    let f: &dyn Fn(&[i64]) -> i64 = match kind {
        Equal => &|x| (x[0] == x[1]) as i64,
        Less => &|x| (x[0] < x[1]) as i64,
        LessOrEqual => &|x| (x[0] <= x[1]) as i64,
        Greater => &|x| (x[0] > x[1]) as i64,
        GreaterOrEqual => &|x| (x[0] >= x[1]) as i64,
        And => &|x| (x[0] != 0 && x[1] != 0) as i64,
        Or => &|x| (x[0] != 0 || x[1] != 0) as i64,
        _ => &|x| ((x[0] != 0) ^ (x[1] != 0)) as i64,
    };
    let f = if int_like(cx.dtype(0)) { Some(f) } else { None };
    one(elementwise(cx, &[0, 1], Some(DType::Bool), f)?)
}

/// Where(cond, x, y): the three inputs broadcast, in x's type.
pub(super) fn where_(cx: &Ctx) -> Outs {
    one(elementwise(cx, &[0, 1, 2], cx.dtype(1), Some(&|x| if x[0] != 0 { x[1] } else { x[2] }))?)
}
