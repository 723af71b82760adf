//! `MixtureOfExperts` (made by `passes::fuse`): each token runs through its top-k experts only.
//! The token-expert pairs are sorted by expert (stably, so a token's experts keep their order),
//! each expert's tokens go through its gated MLP as two matmuls, the results are scaled by the
//! router's weights (or, with `weighting = "input"`, the tokens are scaled going in) and added
//! back into their tokens' rows. Experts with biases (gpt-oss) add them after each projection.
//! Every step is a differentiable
//! libtorch op, so autograd gives the gradients of x, the router's weights and the experts.

use tch::{Kind, Tensor};

use super::{Args, KResult, bail};
use crate::ir::{Attrs, ExpertActivation, ExpertWeighting};
use crate::runtime::kernels::tensor::to_i64_vec;

/// `MixtureOfExperts(x [N, H], weights [N, k], indices [N, k], gate_up [E, 2I, H],
/// down [E, H, I], gate_up_bias [E, 2I]?, down_bias [E, H]?)` → `[N, H]`.
pub(super) fn mixture_of_experts(a: &Args) -> KResult<Tensor> {
    let (x, weights, indices) = (a.x(0)?, a.x(1)?, a.x(2)?);
    let experts = ExpertWeights::of(&[a.opt(3), a.opt(4), a.opt(5), a.opt(6)], a.attrs())?;
    let count = experts.gate_up.size().first().copied().unwrap_or(0);
    let routed = route(x, weights, indices, &experts, count, a.attrs())?;
    let xs = routed.rows_in(x)?;
    let ys = run_experts(&xs, &routed.counts, &experts, routed.activation, a.ctx.autocast)?;
    combine(x, &routed, &ys)
}

/// The experts' weights of a `MixtureOfExperts` node (operands 3 to 6).
pub(crate) struct ExpertWeights<'a> {
    /// `[E, 2I, H]`: each expert's gate rows, then its up rows.
    pub gate_up: &'a Tensor,
    /// `[E, H, I]`.
    pub down: &'a Tensor,
    /// `[E, 2I]`, added after the gate-up projection.
    pub gate_up_bias: Option<&'a Tensor>,
    /// `[E, H]`, added after the down projection: this rank's share of it, the whole bias over
    /// the node's `down_bias_share` (the tensor ranks whose partial outputs are summed).
    pub down_bias: Option<Tensor>,
}

impl<'a> ExpertWeights<'a> {
    /// The weights among `operands` (gate_up, down, gate_up_bias, down_bias; the biases both
    /// present or both absent), the down bias divided by the attribute `down_bias_share`.
    pub(crate) fn of(operands: &[Option<&'a Tensor>; 4], attrs: &Attrs) -> KResult<ExpertWeights<'a>> {
        let [Some(gate_up), Some(down), gate_up_bias, down_bias] = *operands else { bail!("missing the expert weights gate_up or down (operands 3 and 4)") };
        if gate_up.dim() != 3 || down.dim() != 3 {
            bail!("expert weights of ranks {} and {}; expected gate_up [E, 2I, H] and down [E, H, I]", gate_up.dim(), down.dim());
        }
        let down_bias = match (gate_up_bias, down_bias) {
            (None, None) => None,
            (Some(gb), Some(db)) => {
                let (e, rows, h) = (gate_up.size()[0], gate_up.size()[1], down.size()[1]);
                if gb.size() != [e, rows] || db.size() != [e, h] {
                    bail!("expert biases {:?} and {:?}; expected gate_up_bias [{e}, {rows}] and down_bias [{e}, {h}]", gb.size(), db.size());
                }
                let share = attrs.int("down_bias_share", 1);
                if share < 1 {
                    bail!("down_bias_share {share} is not a positive count of ranks");
                }
                Some(if share == 1 { db.shallow_clone() } else { db.f_div_scalar(share as f64)? })
            }
            _ => bail!("an expert bias without the other: gate_up_bias and down_bias come together"),
        };
        Ok(ExpertWeights { gate_up, down, gate_up_bias, down_bias })
    }
}

/// A microbatch's token-expert pairs sorted by expert (stably, so a token's experts keep
/// their order).
pub(crate) struct Routed {
    /// The token of each sorted pair.
    pub tokens: Tensor,
    /// The router's weight of each sorted pair, `[P, 1]` in x's kind.
    pub weights: Tensor,
    /// For each pair in the router's order (token-major, `n·k + j`), its place among the
    /// sorted pairs.
    pub unsort: Tensor,
    /// Experts per token (k).
    pub per_token: i64,
    /// Pairs per expert, expert order.
    pub counts: Vec<i64>,
    /// Where the weights apply.
    pub weighting: ExpertWeighting,
    /// The experts' gate.
    pub activation: ExpertActivation,
}

impl Routed {
    /// The sorted pairs' rows of `x`, scaled by their weights when the weighting is the input's.
    pub(crate) fn rows_in(&self, x: &Tensor) -> KResult<Tensor> {
        let rows = x.f_index_select(0, &self.tokens)?;
        Ok(match self.weighting {
            ExpertWeighting::Input => rows.f_mul(&self.weights)?,
            ExpertWeighting::Output => rows,
        })
    }
}

/// The pairs of `indices [N, k]` (experts `0..experts`) sorted by expert, with their tokens,
/// router `weights [N, k]` and per-expert counts, weighted as the node's `attrs` say. Checks the
/// operands' ranks.
pub(crate) fn route(x: &Tensor, weights: &Tensor, indices: &Tensor, w: &ExpertWeights, experts: i64, attrs: &Attrs) -> KResult<Routed> {
    let (gate_up, down) = (w.gate_up, w.down);
    let weighting = match ExpertWeighting::of_node(attrs) {
        Ok(w) => w,
        Err(other) => bail!("weighting `{other}` is neither `input` nor `output`"),
    };
    let activation = match ExpertActivation::of_node(attrs) {
        Ok(a) => a,
        Err(why) => bail!("{why}"),
    };
    if indices.dim() != 2 || x.dim() != 2 || gate_up.dim() != 3 || down.dim() != 3 {
        bail!("operands of ranks {}, {}, {}, {}, {}; expected x [N, H], weights and indices [N, k], gate_up [E, 2I, H], down [E, H, I]", x.dim(), weights.dim(), indices.dim(), gate_up.dim(), down.dim());
    }
    let k = indices.size()[1];
    let flat = indices.f_reshape([-1])?.f_to_kind(Kind::Int64)?;
    let (sorted, order) = flat.f_sort_stable(true, 0, false)?;
    let ids = to_i64_vec(&sorted)?;
    let mut counts = vec![0i64; experts.max(0) as usize];
    for &e in &ids {
        if e < 0 || e >= experts {
            bail!("expert index {e} is outside 0..{experts}");
        }
        counts[e as usize] += 1;
    }
    // routed pair p belongs to token order[p] / k
    let tokens = order.f_floor_divide_scalar(k)?;
    let ws = weights.f_reshape([-1])?.f_index_select(0, &order)?.f_to_kind(x.kind())?.f_unsqueeze(-1)?;
    // `order` is a permutation: its argsort is its inverse
    let unsort = order.f_argsort(0, false)?;
    Ok(Routed { tokens, weights: ws, unsort, per_token: k, counts, weighting, activation })
}

/// Each row of `rows` (sorted by expert, `counts[e]` rows for expert e) through its expert's
/// gated MLP (`w`: `gate_up [E, 2I, H]`, `down [E, H, I]` and their biases; the gate
/// `activation`), unweighted, in the rows' kind. Under
/// `autocast` the experts' products (and the gate between them) run in the low type, as a
/// module's experts do. With no rows at all, the (empty) result still derives from `rows`, so
/// autograd reaches what produced them.
pub(crate) fn run_experts(rows: &Tensor, counts: &[i64], w: &ExpertWeights, activation: ExpertActivation, autocast: Option<Kind>) -> KResult<Tensor> {
    let (gate_up, down) = (w.gate_up, w.down);
    let low = |t: Tensor| -> KResult<Tensor> {
        Ok(match autocast {
            Some(k) if t.kind() != k => t.f_to_kind(k)?,
            _ => t,
        })
    };
    let mut parts = Vec::new();
    let mut start = 0i64;
    for (e, &count) in counts.iter().enumerate() {
        if count == 0 {
            continue;
        }
        let e = e as i64;
        let xe = low(rows.f_narrow(0, start, count)?)?;
        let mut gu = xe.f_matmul(&low(gate_up.f_get(e)?)?.f_tr()?)?;
        if let Some(b) = w.gate_up_bias {
            gu = gu.f_add(&low(b.f_get(e)?)?)?;
        }
        let halves = gu.f_chunk(2, -1)?;
        let [gate, up] = halves.as_slice() else { bail!("gate_up of expert {e} does not halve") };
        let made = activate(gate, up, activation)?;
        let Some(h) = made.last() else { bail!("expert {e}: the activation made nothing") };
        let mut y = h.f_matmul(&low(down.f_get(e)?)?.f_tr()?)?;
        SET_ASIDE.with_borrow_mut(|aside| {
            if let Some(aside) = aside {
                aside.push(ExpertActivationParts { gate: gate.shallow_clone(), up: up.shallow_clone(), activation, made });
            }
        });
        if let Some(b) = &w.down_bias {
            y = y.f_add(&low(b.f_get(e)?)?)?;
        }
        parts.push(y.f_to_kind(rows.kind())?);
        start += count;
    }
    if parts.is_empty() {
        return Ok(rows.f_mul_scalar(0.0)?);
    }
    Ok(Tensor::f_cat(&parts, 0)?)
}

/// Every tensor the experts' gated activation makes from the gate and up halves, in order, the
/// gated product (what the down projection reads) last.
fn activate(gate: &Tensor, up: &Tensor, activation: ExpertActivation) -> KResult<Vec<Tensor>> {
    Ok(match activation {
        ExpertActivation::Silu => {
            let s = gate.f_silu()?;
            let h = s.f_mul(up)?;
            vec![s, h]
        }
        ExpertActivation::ClampedSilu { limit } => {
            let l = limit.0;
            let c = gate.f_clamp_max(l)?;
            let s = c.f_silu()?;
            let u = up.f_clamp(-l, l)?;
            let h = s.f_mul(&u)?;
            vec![c, s, u, h]
        }
        ExpertActivation::ClampedSwish { alpha, limit } => {
            let (a, l) = (alpha.0, limit.0);
            let g = gate.f_clamp_max(l)?;
            let ga = g.f_mul_scalar(a)?;
            let sg = ga.f_sigmoid()?;
            let gs = g.f_mul(&sg)?;
            let u = up.f_clamp(-l, l)?;
            let u1 = u.f_add_scalar(1.0)?;
            let h = gs.f_mul(&u1)?;
            vec![g, ga, sg, gs, u, u1, h]
        }
    })
}

thread_local! {
    /// While [`setting_aside`] runs: the activations [`run_experts`] made.
    static SET_ASIDE: std::cell::RefCell<Option<Vec<ExpertActivationParts>>> = const { std::cell::RefCell::new(None) };
}

/// One expert's activation in a forward whose mixture of experts selective recompute rebuilds
/// (Megatron-Core's `moe_act`): what the activation made (autograd's saved tensors share their
/// storage), freed after the forward and rebuilt from the gate and up halves, which the
/// products' backwards keep anyway, before the backward.
pub(crate) struct ExpertActivationParts {
    gate: Tensor,
    up: Tensor,
    activation: ExpertActivation,
    made: Vec<Tensor>,
}

impl ExpertActivationParts {
    /// Frees what the activation made.
    pub(crate) fn free(&self) -> Result<(), crate::runtime::RuntimeError> {
        self.made.iter().filter(|t| t.numel() > 0).try_for_each(crate::runtime::kernels::storage::free)
    }

    /// Computes the activation again without autograd into the storage [`Self::free`] freed.
    pub(crate) fn rebuild(&self) -> Result<(), crate::runtime::RuntimeError> {
        let fresh = tch::no_grad(|| activate(&self.gate, &self.up, self.activation)).map_err(|e| crate::runtime::error::terr(format!("rebuilding an expert's activation: {}", e.0)))?;
        for (dst, src) in self.made.iter().zip(&fresh).filter(|(t, _)| t.numel() > 0) {
            crate::runtime::kernels::storage::take(dst, src)?;
        }
        Ok(())
    }
}

/// While [`setting_aside`] runs, records a SwiGLU's silu(gate) (the fused op keeps it for its
/// product's backward) as one more activation to free and rebuild from `gate` and `up`.
pub(crate) fn note_inside_silu(gate: &Tensor, up: &Tensor, silu: &Tensor) {
    SET_ASIDE.with(|c| {
        if let Some(v) = c.borrow_mut().as_mut() {
            // `activate` makes silu(gate) and the product; the product is the op's own output,
            // which the recompute rebuilds as a node: only silu(gate) is refilled here
            v.push(ExpertActivationParts { gate: gate.shallow_clone(), up: up.shallow_clone(), activation: ExpertActivation::Silu, made: vec![silu.shallow_clone()] });
        }
    });
}

/// Runs `f` and hands back the experts' activations every [`run_experts`] inside it made.
pub(crate) fn setting_aside<T>(f: impl FnOnce() -> T) -> (T, Vec<ExpertActivationParts>) {
    let before = SET_ASIDE.replace(Some(Vec::new()));
    let out = f();
    let got = SET_ASIDE.replace(before).unwrap_or_default();
    (out, got)
}

/// `ys` (one row per sorted pair) scaled by the router's weights (unless they scaled the
/// input) and summed over each token's k pairs; weighting and the sum stay in x's type.
/// The weighted rows go back to the router's order (`[N, k, H]`) and are summed over k: what
/// autograd keeps is `ys` alone (the product's gradient), not also the weighted rows, as an
/// `index_add` into the tokens would (its backward keeps its source).
pub(crate) fn combine(x: &Tensor, routed: &Routed, ys: &Tensor) -> KResult<Tensor> {
    if ys.size().first().copied().unwrap_or(0) == 0 {
        return Ok(x.f_zeros_like()?.f_add(&ys.f_sum(ys.kind())?.f_mul_scalar(0.0)?)?);
    }
    let ys = match routed.weighting {
        ExpertWeighting::Output => ys.f_mul(&routed.weights)?,
        ExpertWeighting::Input => ys.shallow_clone(),
    };
    let rows = x.size().first().copied().unwrap_or(0);
    let by_token = ys.f_index_select(0, &routed.unsort)?.f_reshape([rows, routed.per_token, -1])?;
    Ok(by_token.f_sum_dim_intlist(1, false, x.kind())?)
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
        let ctx = |autocast| OpContext { float_kind: None, training: false, norm: NormStats::Running, dropout: None, autocast, context: None };
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

    #[test]
    fn biased_experts_with_a_clamped_swish_gate_are_computed_as_by_hand_in_f64_and_share_their_down_bias() {
        tch::manual_seed(9);
        let f = (Kind::Double, Device::Cpu);
        let leaf = |t: Tensor| t.set_requires_grad(true);
        let (e, h, i, n, k) = (3, 8, 6, 5, 2);
        let (x, gu, down) = (leaf(Tensor::randn([n, h], f)), leaf(Tensor::randn([e, 2 * i, h], f)), leaf(Tensor::randn([e, h, i], f)));
        let (gub, db) = (leaf(Tensor::randn([e, 2 * i], f)), leaf(Tensor::randn([e, h], f)));
        let w = leaf(Tensor::rand([n, k], f));
        let idx = Tensor::from_slice(&[0i64, 2, 1, 0, 2, 1, 0, 1, 2, 2]).reshape([n, k]);
        let (alpha, limit) = (1.702, 0.8);
        let mut attrs = Attrs::default();
        crate::ir::ExpertActivation::ClampedSwish { alpha: crate::ir::SwishScale(alpha), limit: crate::ir::ClampLimit(limit) }.set_attrs(&mut attrs);
        let node = Node { name: "moe".into(), op: Op::Known(OpKind::MixtureOfExperts), attrs, inputs: Vec::new(), outputs: Vec::new(), namespace: None, order: 0 };
        let inputs: Vec<Option<Tensor>> = [&x, &w, &idx, &gu, &down, &gub, &db].iter().map(|t| Some(t.shallow_clone())).collect();
        let ctx = OpContext { float_kind: None, training: true, norm: NormStats::Running, dropout: None, autocast: None, context: None };
        let got = run(&node, &inputs, &ctx).unwrap().remove(0);
        // Σ_j w_j · (down_e · (g·σ(α·g) ⊙ (clip(u, ±L) + 1)) + db_e), g = min(gate, L), token by token
        let mut rows = Vec::new();
        for t in 0..n {
            let mut acc = x.get(t).zeros_like();
            for j in 0..k {
                let ex = idx.int64_value(&[t, j]);
                let z = gu.get(ex).matmul(&x.get(t)) + gub.get(ex);
                let halves = z.chunk(2, -1);
                let g = halves[0].clamp_max(limit);
                let act = &g * (&g * alpha).sigmoid() * (halves[1].clamp(-limit, limit) + 1.0);
                acc += (down.get(ex).matmul(&act) + db.get(ex)) * w.get(t).get(j);
            }
            rows.push(acc);
        }
        let want = Tensor::stack(&rows, 0);
        let rel = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]);
        assert!(rel(&got, &want) < 1e-14, "forward {:.2e}", rel(&got, &want));
        let r = Tensor::randn([n, h], f);
        let params = [&x, &w, &gu, &down, &gub, &db];
        let grads = |y: &Tensor| Tensor::run_backward(&[(y * &r).sum(Kind::Double)], &params, false, false);
        let (a, b) = (grads(&got), grads(&want));
        for (name, ga, gb) in ["x", "weights", "gate_up", "down", "gate_up_bias", "down_bias"].iter().zip(&a).zip(&b).map(|((n, a), b)| (n, a, b)) {
            assert!(rel(ga, gb) < 1e-12, "gradient of {name}: {:.2e}", rel(ga, gb));
        }
        // shared over 2 tensor ranks, each adds half of the down bias: the two halves of a zero
        // expert sum make the whole bias term
        let mut halved = node.clone();
        halved.attrs.set("down_bias_share", crate::ir::Attr::Int(2));
        let zero = |t: &Tensor| Some(t.zeros_like());
        let same = |t: &Tensor| Some(t.shallow_clone());
        let only_bias: Vec<Option<Tensor>> = vec![same(&x), same(&w), same(&idx), zero(&gu), zero(&down), zero(&gub), same(&db)];
        let (whole, half) = (run(&node, &only_bias, &ctx).unwrap().remove(0), run(&halved, &only_bias, &ctx).unwrap().remove(0));
        assert!(rel(&(&half * 2.0), &whole) < 1e-15 && whole.abs().max().double_value(&[]) > 0.1);
    }

    #[test]
    fn input_weighting_scales_each_token_going_into_its_expert_in_f64_forward_and_backward() {
        tch::manual_seed(5);
        let f = (Kind::Double, Device::Cpu);
        let leaf = |t: Tensor| t.set_requires_grad(true);
        let (x, gu, down) = (leaf(Tensor::randn([5, 8], f)), leaf(Tensor::randn([3, 12, 8], f)), leaf(Tensor::randn([3, 8, 6], f)));
        let w = leaf(Tensor::rand([5, 2], f));
        let idx = Tensor::from_slice(&[0i64, 2, 1, 0, 2, 1, 0, 1, 2, 2]).reshape([5, 2]);
        let mut attrs = Attrs::default();
        attrs.set("weighting", crate::ir::Attr::Str("input".into()));
        let node = Node { name: "moe".into(), op: Op::Known(OpKind::MixtureOfExperts), attrs, inputs: Vec::new(), outputs: Vec::new(), namespace: None, order: 0 };
        let inputs: Vec<Option<Tensor>> = [&x, &w, &idx, &gu, &down].iter().map(|t| Some(t.shallow_clone())).collect();
        let ctx = OpContext { float_kind: None, training: true, norm: NormStats::Running, dropout: None, autocast: None, context: None };
        let got = run(&node, &inputs, &ctx).unwrap().remove(0);
        // Σ_j expert_j(w_j · x), token by token
        let mut rows = Vec::new();
        for t in 0..5 {
            let mut acc = x.get(t).zeros_like();
            for j in 0..2 {
                let e = idx.int64_value(&[t, j]);
                let xin = x.get(t) * w.get(t).get(j);
                let h = gu.get(e).matmul(&xin);
                let halves = h.chunk(2, -1);
                acc = acc + down.get(e).matmul(&(halves[0].silu() * &halves[1]));
            }
            rows.push(acc);
        }
        let want = Tensor::stack(&rows, 0);
        let rel = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]);
        assert!(rel(&got, &want) < 1e-14, "forward {:.2e}", rel(&got, &want));
        let r = Tensor::randn([5, 8], f);
        let grads = |y: &Tensor| Tensor::run_backward(&[(y * &r).sum(Kind::Double)], &[&x, &w, &gu, &down], false, false);
        let (a, b) = (grads(&got), grads(&want));
        for (name, ga, gb) in [("x", &a[0], &b[0]), ("weights", &a[1], &b[1]), ("gate_up", &a[2], &b[2]), ("down", &a[3], &b[3])] {
            assert!(rel(ga, gb) < 1e-12, "gradient of {name}: {:.2e}", rel(ga, gb));
        }
        // output weighting differs: the experts are not linear
        let out = run(&Node { attrs: Attrs::default(), ..node.clone() }, &inputs, &ctx).unwrap().remove(0);
        assert!(rel(&out, &want) > 1e-3);
    }
}
