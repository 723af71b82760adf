//! Mixture of experts: each expert's gated MLP splits by its intermediate dim, as Megatron
//! splits a dense MLP (its gate and up projections by columns, its down projection by rows).
//! Experts with biases split the gate-up bias with its rows; the down bias, added to a partial
//! sum, is shared: each rank adds `bias / t` and its gradient is all-reduced.

use super::Strategy;
use super::context::{Decision, Splitter, Tokens};
use super::offer::{Offer, Pricer};
use super::realise::{Prop, R, Sh};
use super::rewrite::{NodeRewrite, PartialGradient};
use crate::ir::NodeId;

impl Prop<'_, '_> {
    /// `MixtureOfExperts(x, weights, indices, gate_up, down)` with whole tokens, router weights
    /// and indices: rank `r` holds the `r`-th of `t` parts of every expert's intermediate dim
    /// (`gate_up` `[E, 2I, H]` along axis 1 as two blocks, gate and up; `down` `[E, H, I]`
    /// along axis 2), routes every token as one rank would, and makes a partial sum of the
    /// output (all-reduced; the gradients of x and of the router's weights are partial too,
    /// all-reduced in the backward). With biases (`gate_up_bias [E, 2I]`, `down_bias [E, H]`),
    /// the gate-up bias splits as its rows do and the down bias is shared
    /// ([`NodeRewrite::ShareExpertBias`]). Whole on every rank when I does not divide by t or the
    /// weights are kept whole.
    pub(super) fn experts(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let o = n.outputs[0];
        let input = |i: usize| n.inputs.get(i).copied().flatten();
        let (Some(x), Some(w), Some(idx), Some(gate_up), Some(down)) = (input(0), input(1), input(2), input(3), input(4)) else {
            return self.err("missing operand");
        };
        for v in [x, w, idx] {
            if self.state(v) != Sh::Rep {
                return self.err(format!("`{}` reaches the experts split; they take whole tokens and routes", self.g.value(v).name));
            }
        }
        let biases = match (input(5), input(6)) {
            (None, None) => None,
            (Some(gb), Some(db)) => Some((gb, db)),
            _ => return self.err("one expert bias without the other"),
        };
        let free = self.is_free_weight(gate_up) && self.is_free_weight(down) && biases.is_none_or(|(gb, _)| self.is_free_weight(gb));
        let rows = self.need_shape(gate_up)?.get(1).copied().unwrap_or(0);
        let inter = rows / 2;
        let split = free
            && inter > 0
            && inter % self.t == 0
            && self.split_weight(gate_up, 1, 2, inter / self.t)
            && self.split_weight(down, 2, 1, inter / self.t)
            && biases.is_none_or(|(gb, _)| self.split_weight(gb, 1, 2, inter / self.t));
        if split {
            if let Some((_, db)) = biases {
                let name = self.g.node(id).name.clone();
                self.partial_gradients.push(PartialGradient { node: name.clone(), input: 6, value: self.g.value(db).name.clone() });
                self.rewrites.push(NodeRewrite::ShareExpertBias { node: name });
            }
            self.set(o, Sh::Partial);
            return Ok(());
        }
        for v in [Some(gate_up), Some(down), biases.map(|b| b.0)].into_iter().flatten() {
            if let Some((init, _)) = self.weight_src.get(&v) {
                self.kept_whole.insert(*init);
            }
        }
        if [Some(gate_up), Some(down), biases.map(|b| b.0)].into_iter().flatten().any(|v| self.weights.contains_key(&v)) {
            return self.err("one expert weight is split and another is not");
        }
        self.set(o, Sh::Rep);
        Ok(())
    }
}

/// Offers.
impl Pricer<'_> {
    /// Every expert's MLP split by its intermediate dim `inter` (where it divides), or whole.
    /// `routes` is the router weights' share of the tokens' bytes; `bias_elems` the down bias's
    /// elements, whose shared gradient is all-reduced in each backward.
    pub(super) fn experts_offers(&self, (inter, routes, bias_elems): (Option<i64>, f64, f64), i: usize) -> Vec<Offer> {
        let own = self.figures_split([(i, 1.0)], crate::cost::SplitDim::Inner);
        let mut options = Vec::new();
        if self.divides(inter) {
            // the output's partial sums are reduced like a row split's; backward, the gradients
            // of the tokens and of the router's weights are all-reduced
            let weights_ar = self.x.comm.all_reduce(self.hidden * routes, &self.x.tp_group);
            let bias_ar = if bias_elems > 0.0 { self.x.comm.all_reduce(bias_elems * self.x.grad_bytes_per_param, &self.x.tp_group) } else { 0.0 };
            options.push(self.opt(Strategy::Experts, own[0] + self.row_fwd, own[1] + self.ar + weights_ar + bias_ar + self.sp_ag, own[4] / self.t, 0.0));
        }
        options.push(self.replicate(&own));
        options
    }
}

/// Context parallelism.
impl Splitter<'_> {
    /// Routed experts run on local tokens: the tokens, the router's weights and indices local
    /// alike along the token axis, the expert weights whole.
    pub(super) fn experts(&self, n: NodeId) -> Option<Decision> {
        let node = self.g.node(n);
        let tok = |i: usize| node.inputs.get(i).copied().flatten().map_or(Tokens::Whole, |v| self.tokens[v.index()]);
        let t0 = tok(0);
        let same = (0..3).all(|i| tok(i) == t0) && (3..node.inputs.len()).all(|i| tok(i) == Tokens::Whole);
        matches!(t0, Tokens::Local { axis: 0, .. }).then_some(()).filter(|_| same).map(|_| Decision::to(t0))
    }
}
