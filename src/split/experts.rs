//! Mixture of experts: each expert's gated MLP splits by its intermediate dim, as Megatron
//! splits a dense MLP (its gate and up projections by columns, its down projection by rows).

use super::Strategy;
use super::context::{Decision, Splitter, Tokens};
use super::offer::{Offer, Pricer};
use super::realise::{Prop, R, Sh};
use crate::ir::NodeId;

impl Prop<'_, '_> {
    /// `MixtureOfExperts(x, weights, indices, gate_up, down)` with whole tokens, router weights
    /// and indices: rank `r` holds the `r`-th of `t` parts of every expert's intermediate dim
    /// (`gate_up` `[E, 2I, H]` along axis 1 as two blocks, gate and up; `down` `[E, H, I]`
    /// along axis 2), routes every token as one rank would, and makes a partial sum of the
    /// output (all-reduced; the gradients of x and of the router's weights are partial too,
    /// all-reduced in the backward). Whole on every rank when I does not divide by t or the
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
        let free = self.is_free_weight(gate_up) && self.is_free_weight(down);
        let rows = self.need_shape(gate_up)?.get(1).copied().unwrap_or(0);
        let inter = rows / 2;
        let split = free && inter > 0 && inter % self.t == 0 && self.split_weight(gate_up, 1, 2, inter / self.t) && self.split_weight(down, 2, 1, inter / self.t);
        if split {
            self.set(o, Sh::Partial);
            return Ok(());
        }
        for v in [gate_up, down] {
            if let Some((init, _)) = self.weight_src.get(&v) {
                self.kept_whole.insert(*init);
            }
        }
        if self.weights.contains_key(&gate_up) || self.weights.contains_key(&down) {
            return self.err("one expert weight is split and the other is not");
        }
        self.set(o, Sh::Rep);
        Ok(())
    }
}

/// Offers.
impl Pricer<'_> {
    /// Every expert's MLP split by its intermediate dim `inter` (where it divides), or whole.
    /// `routes` is the router weights' share of the tokens' bytes.
    pub(super) fn experts_offers(&self, (inter, routes): (Option<i64>, f64), i: usize) -> Vec<Offer> {
        let own = self.figures([(i, 1.0)]);
        let mut options = Vec::new();
        if self.divides(inter) {
            // the output's partial sums are reduced like a row split's; backward, the gradients
            // of the tokens and of the router's weights are all-reduced
            let weights_ar = self.x.comm.all_reduce(self.hidden * routes, &self.x.tp_group);
            options.push(self.opt(Strategy::Experts, own[0] + self.row_fwd, own[1] + self.ar + weights_ar + self.sp_ag, own[4] / self.t, 0.0));
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
