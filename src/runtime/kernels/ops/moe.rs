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
    // under autocast the experts' products (and the gate between them) run in the low type,
    // as a module's experts do; weighting and the sum into the tokens stay in x's type
    let low = |t: Tensor| -> KResult<Tensor> {
        Ok(match a.ctx.autocast {
            Some(k) if t.kind() != k => t.f_to_kind(k)?,
            _ => t,
        })
    };
    let mut parts = Vec::new();
    let mut start = 0i64;
    for e in 0..experts {
        let count = ids[start as usize..].iter().take_while(|&&i| i == e).count() as i64;
        if count == 0 {
            continue;
        }
        let xe = low(xs.f_narrow(0, start, count)?)?;
        let gu = xe.f_matmul(&low(gate_up.f_get(e)?)?.f_tr()?)?;
        let halves = gu.f_chunk(2, -1)?;
        let [gate, up] = halves.as_slice() else { bail!("gate_up of expert {e} does not halve") };
        let h = gate.f_silu()?.f_mul(up)?;
        let y = h.f_matmul(&low(down.f_get(e)?)?.f_tr()?)?.f_to_kind(x.kind())?.f_mul(&ws.f_narrow(0, start, count)?)?;
        parts.push(y);
        start += count;
    }
    let out = x.f_zeros_like()?;
    if parts.is_empty() {
        return Ok(out);
    }
    Ok(out.f_index_add(0, &tokens, &Tensor::f_cat(&parts, 0)?)?)
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use crate::ir::{Attrs, Node, Op, OpKind};
    use crate::runtime::kernels::ops::{NormStats, OpContext, run};

    /// The kernel's result under `autocast`, by hand: expert products (and the gate between
    /// them) in `low`, routing weights and the sum in x's fp32.
    fn by_hand(x: &Tensor, w: &Tensor, idx: &Tensor, gu: &Tensor, down: &Tensor, low: Kind) -> Tensor {
        let (n, k) = (idx.size()[0], idx.size()[1]);
        let out = x.zeros_like();
        for t in 0..n {
            for j in 0..k {
                let e = idx.int64_value(&[t, j]);
                let h = x.get(t).unsqueeze(0).to_kind(low).matmul(&gu.get(e).to_kind(low).tr());
                let halves = h.chunk(2, -1);
                let y = (halves[0].silu() * &halves[1]).matmul(&down.get(e).to_kind(low).tr()).to_kind(Kind::Float) * w.double_value(&[t, j]);
                let _ = out.get(t).unsqueeze(0).shallow_clone().g_add_(&y);
            }
        }
        out
    }

    #[test]
    fn under_autocast_the_expert_products_run_in_the_low_type_and_the_sum_in_the_inputs() {
        tch::manual_seed(3);
        let f = (Kind::Float, Device::Cpu);
        let (x, gu, down) = (Tensor::randn([5, 8], f), Tensor::randn([3, 12, 8], f), Tensor::randn([3, 8, 6], f));
        let w = Tensor::rand([5, 2], f);
        let idx = Tensor::from_slice(&[0i64, 2, 1, 0, 2, 1, 0, 1, 2, 2]).reshape([5, 2]);
        let node = Node { name: "moe".into(), op: Op::Known(OpKind::MixtureOfExperts), attrs: Attrs::default(), inputs: Vec::new(), outputs: Vec::new(), namespace: None, order: 0 };
        let inputs: Vec<Option<Tensor>> = [&x, &w, &idx, &gu, &down].iter().map(|t| Some(t.shallow_clone())).collect();
        let ctx = |autocast| OpContext { opset: 18, float_kind: None, training: false, norm: NormStats::Running, dropout: None, autocast };
        for (autocast, low) in [(Some(Kind::BFloat16), Kind::BFloat16), (None, Kind::Float)] {
            let got = run(&node, &inputs, &ctx(autocast)).unwrap().remove(0);
            assert_eq!(got.kind(), Kind::Float);
            let want = by_hand(&x, &w, &idx, &gu, &down, low);
            let d = (&got - &want).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
            assert!(d < 1e-6, "{autocast:?}: {d:.2e} from the computation by hand");
        }
        let (a, b) = (run(&node, &inputs, &ctx(Some(Kind::BFloat16))).unwrap().remove(0), run(&node, &inputs, &ctx(None)).unwrap().remove(0));
        assert!((&a - &b).abs().max().double_value(&[]) > 1e-4, "autocast changed nothing");
    }
}
