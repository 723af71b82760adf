//! `MixtureOfExperts` (made by `passes::fuse`): each token runs through its top-k experts only.
//! The token-expert pairs are sorted by expert (stably, so a token's experts keep their order),
//! each expert's tokens go through its gated MLP as two matmuls, the results are scaled by the
//! router's weights and added back into their tokens' rows. Every step is a differentiable
//! libtorch op, so autograd gives the gradients of x, the router's weights and the experts.

use tch::{Kind, Tensor};

use super::{Args, KResult, bail};
use crate::runtime::kernels::tensor::to_i64_vec;

/// `MixtureOfExperts(x [N, H], weights [N, k], indices [N, k], gate_up [E, 2I, H],
/// down [E, H, I])` → `[N, H]`.
pub(super) fn mixture_of_experts(a: &Args) -> KResult<Tensor> {
    let (x, weights, indices, gate_up, down) = (a.x(0)?, a.x(1)?, a.x(2)?, a.x(3)?, a.x(4)?);
    let experts = gate_up.size().first().copied().unwrap_or(0);
    if indices.dim() != 2 || x.dim() != 2 || gate_up.dim() != 3 || down.dim() != 3 {
        bail!("operands of ranks {}, {}, {}, {}, {}; expected x [N, H], weights and indices [N, k], gate_up [E, 2I, H], down [E, H, I]", x.dim(), weights.dim(), indices.dim(), gate_up.dim(), down.dim());
    }
    let k = indices.size()[1];
    let flat = indices.f_reshape([-1])?.f_to_kind(Kind::Int64)?;
    let (sorted, order) = flat.f_sort_stable(true, 0, false)?;
    let ids = to_i64_vec(&sorted)?;
    if let Some(bad) = ids.iter().find(|&&e| e < 0 || e >= experts) {
        bail!("expert index {bad} is outside 0..{experts}");
    }
    // routed pair p belongs to token order[p] / k
    let tokens = order.f_floor_divide_scalar(k)?;
    let xs = x.f_index_select(0, &tokens)?;
    let ws = weights.f_reshape([-1])?.f_index_select(0, &order)?.f_to_kind(x.kind())?.f_unsqueeze(-1)?;
    let mut parts = Vec::new();
    let mut start = 0i64;
    for e in 0..experts {
        let count = ids[start as usize..].iter().take_while(|&&i| i == e).count() as i64;
        if count == 0 {
            continue;
        }
        let xe = xs.f_narrow(0, start, count)?;
        let gu = xe.f_matmul(&gate_up.f_get(e)?.f_tr()?)?;
        let halves = gu.f_chunk(2, -1)?;
        let [gate, up] = halves.as_slice() else { bail!("gate_up of expert {e} does not halve") };
        let h = gate.f_silu()?.f_mul(up)?;
        let y = h.f_matmul(&down.f_get(e)?.f_tr()?)?.f_mul(&ws.f_narrow(0, start, count)?)?;
        parts.push(y);
        start += count;
    }
    let out = x.f_zeros_like()?;
    if parts.is_empty() {
        return Ok(out);
    }
    Ok(out.f_index_add(0, &tokens, &Tensor::f_cat(&parts, 0)?)?)
}
