//! Contractions: MatMul (numpy batched matmul) and Gemm (rank-2, `transA`/`transB`).

use super::context::{Ctx, Outs, one, ty_opt};
use super::elementwise::broadcast;

/// numpy matmul result shape.
pub fn matmul_shape(a: &[i64], b: &[i64]) -> Result<Vec<i64>, String> {
    if a.is_empty() || b.is_empty() {
        return Err("MatMul of a scalar".into());
    }
    let a2: Vec<i64> = if a.len() == 1 { vec![1, a[0]] } else { a.to_vec() };
    let b2: Vec<i64> = if b.len() == 1 { vec![b[0], 1] } else { b.to_vec() };
    let (m, k1) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    if k1 != k2 {
        return Err(format!("inner dims differ: {a:?} × {b:?}"));
    }
    let mut out = broadcast(&a2[..a2.len() - 2], &b2[..b2.len() - 2])?;
    if a.len() > 1 {
        out.push(m);
    }
    if b.len() > 1 {
        out.push(n);
    }
    Ok(out)
}

/// MatMul(a, b).
pub(super) fn matmul(cx: &Ctx) -> Outs {
    let (Some(sa), Some(sb)) = (cx.shape(0), cx.shape(1)) else {
        return one((ty_opt(cx.dtype(0), None), None));
    };
    one((ty_opt(cx.dtype(0), Some(matmul_shape(sa, sb)?)), None))
}

/// Gemm(a, b, c?): `[m, n]` of rank-2 operands, transposed as the attributes say.
pub(super) fn gemm(cx: &Ctx) -> Outs {
    let (Some(sa), Some(sb)) = (cx.shape(0), cx.shape(1)) else {
        return one((ty_opt(cx.dtype(0), None), None));
    };
    if sa.len() != 2 || sb.len() != 2 {
        return Err(format!("Gemm needs rank-2 inputs, got {sa:?} and {sb:?}"));
    }
    let a = cx.attrs();
    let (m, ka) = if a.int("transA", 0) != 0 { (sa[1], sa[0]) } else { (sa[0], sa[1]) };
    let (kb, n) = if a.int("transB", 0) != 0 { (sb[1], sb[0]) } else { (sb[0], sb[1]) };
    if ka != kb {
        return Err(format!("inner dims differ: {sa:?} × {sb:?}"));
    }
    one((ty_opt(cx.dtype(0), Some(vec![m, n])), None))
}
