//! Fused attention: the IR-internal ScaledDotProductAttention(q, kᵀ, v, mask?), made by
//! `passes::fuse`; its output is `softmax(q·kᵀ)·v`'s shape, with a mask that broadcasts to the
//! scores.

use super::context::{Ctx, Outs, one, ty_opt};
use super::elementwise::broadcast;
use super::matmul::matmul_shape;

/// ScaledDotProductAttention(q, kᵀ, v, mask?).
pub(super) fn scaled_dot_product_attention(cx: &Ctx) -> Outs {
    let (Some(q), Some(kt), Some(v)) = (cx.shape(0), cx.shape(1), cx.shape(2)) else {
        return one((ty_opt(cx.dtype(0), None), None));
    };
    let scores = matmul_shape(q, kt)?;
    if let Some(m) = cx.shape(3)
        && broadcast(&scores, m)? != scores
    {
        return Err(format!("the mask {m:?} does not broadcast to the scores {scores:?}"));
    }
    one((ty_opt(cx.dtype(0), Some(matmul_shape(&scores, v)?)), None))
}
