//! Einsum: libtorch's einsum (explicit `->` output or the implicit one, `...` broadcast),
//! which contracts by batched matrix products and differentiates through them.

use tch::Tensor;

use super::{Args, KResult, bail};

pub(super) fn einsum(a: &Args) -> KResult<Tensor> {
    let Some(equation) = a.attrs().str("equation") else { bail!("attribute `equation` is required") };
    let equation: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let operands: Vec<Tensor> = a.inputs.iter().flatten().map(Tensor::shallow_clone).collect();
    if operands.is_empty() {
        bail!("needs at least one input");
    }
    Ok(Tensor::f_einsum(&equation, &operands, None::<&[i64]>)?)
}
