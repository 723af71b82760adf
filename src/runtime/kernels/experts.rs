//! `MixtureOfExperts` under expert parallelism: the node's expert weights hold this rank's
//! experts alone (member j of a group of e holds experts `j·E/e .. (j+1)·E/e`), so each
//! token-expert pair travels to the rank owning its expert and back (dropless: every pair,
//! no capacity factor):
//! 1. the pairs are sorted by expert (as the one-rank kernel sorts them), which groups them by
//!    owning rank; the per-expert counts go to the owners first (an all-to-all of counts);
//! 2. the pairs' hidden vectors go by an all-to-all with those per-rank counts;
//! 3. each rank regroups what it received by local expert and runs its experts' gated MLPs;
//! 4. the outputs go back by the reverse all-to-all, are scaled by the router's weights (unless
//!    the tokens were, before step 2) and added into their tokens, on the rank that routed them.
//!
//! The exchanges are autograd functions of the c10d shim: the backward of each all-to-all is
//! the reverse all-to-all of the gradients, as the tensor-parallel collectives' backwards are
//! collectives, so the interpreter's backward needs nothing more. Every member of a group runs
//! the same stages in the same order (they are replicas), so their exchanges pair up.

use std::sync::Arc;

use tch::Tensor;

use super::ops::OpContext;
use super::ops::moe::{ExpertWeights, combine, route, run_experts};
use crate::runtime::comm::ProcessGroup;

/// Where a rank's `MixtureOfExperts` nodes send their tokens.
#[derive(Clone, Default)]
pub struct ExpertRouting {
    /// The expert group the token-expert pairs travel over (none: every expert is local).
    pub group: Option<Arc<ProcessGroup>>,
    /// Folded expert groups: the tensor group whose ranks hold the same tokens, each routing
    /// its own share of them, the outputs gathered back over it.
    pub tokens_over: Option<Arc<ProcessGroup>>,
}

impl ExpertRouting {
    /// Whether the mixtures of experts route anything off this rank (else the one-rank kernel).
    pub fn leaves_the_rank(&self) -> bool {
        self.group.is_some() || self.tokens_over.is_some()
    }
}

/// `MixtureOfExperts` as `routing` says: over its expert group, and with folded groups on this
/// tensor rank's share of the tokens alone. The tensor ranks of a folded group hold the same
/// tokens (replicated, or gathered under sequence parallelism) and the same routes: rank r
/// takes the r-th of t equal runs of them (its gradient is gathered back in the backward),
/// sends them to their experts, and the outputs are gathered over the tensor group (the
/// backward keeps this rank's run of their gradient, as every tensor rank holds it whole).
pub(super) fn routed(node: &crate::ir::Node, inputs: &[Option<Tensor>], ctx: &OpContext, routing: &ExpertRouting) -> Result<Tensor, String> {
    let run = |inputs: &[Option<Tensor>]| match &routing.group {
        Some(pg) => expert_parallel(node, inputs, ctx, pg),
        None => super::ops::run(node, inputs, ctx).map_err(|e| e.0).map(|mut out| out.remove(0)),
    };
    let Some(tp) = &routing.tokens_over else { return run(inputs) };
    let get = |i: usize| inputs.get(i).and_then(Option::as_ref).ok_or_else(|| format!("MixtureOfExperts without operand {i}"));
    let (x, weights, indices) = (get(0)?, get(1)?, get(2)?);
    let (t, r) = (tp.size() as i64, tp.index() as i64);
    let tokens = x.size().first().copied().unwrap_or(0);
    if tokens % t != 0 {
        return Err(format!(
            "its expert groups fold over the {t} tensor ranks, which route equal shares of the {tokens} tokens of a microbatch, and {t} does not divide {tokens}; choose a microbatch whose tokens (batch × sequence) divide by {t}"
        ));
    }
    let kerr = |m: tch::TchError| m.to_string();
    let derr = |m: crate::runtime::comm::DistError| m.to_string();
    let mut local: Vec<Option<Tensor>> = inputs.iter().map(|o| o.as_ref().map(Tensor::shallow_clone)).collect();
    local[0] = Some(tp.scatter_along_axis(x, 0).map_err(derr)?);
    local[1] = Some(tp.scatter_along_axis(weights, 0).map_err(derr)?);
    let share = tokens / t;
    local[2] = Some(indices.f_narrow(0, r * share, share).map_err(kerr)?);
    let y = run(&local)?;
    tp.gather_along_axis(&y, 0).map_err(derr)
}

/// `MixtureOfExperts(x, weights, indices, gate_up [E/e, 2I, H], down [E/e, H, I],
/// gate_up_bias [E/e, 2I]?, down_bias [E/e, H]?)` over the expert group `pg` of e members.
pub(super) fn expert_parallel(node: &crate::ir::Node, inputs: &[Option<Tensor>], ctx: &OpContext, pg: &ProcessGroup) -> Result<Tensor, String> {
    let get = |i: usize| inputs.get(i).and_then(Option::as_ref).ok_or_else(|| format!("MixtureOfExperts without operand {i}"));
    let (x, weights, indices) = (get(0)?, get(1)?, get(2)?);
    let opt = |i: usize| inputs.get(i).and_then(Option::as_ref);
    let experts = ExpertWeights::of(&[opt(3), opt(4), opt(5), opt(6)], &node.attrs).map_err(|m| m.0)?;
    let (gate_up, down) = (experts.gate_up, experts.down);
    let e = pg.size() as i64;
    let local = gate_up.size().first().copied().unwrap_or(0);
    if down.size().first().copied() != Some(local) || local == 0 {
        return Err(format!("expert weights gate_up {:?} and down {:?} hold different expert counts", gate_up.size(), down.size()));
    }
    let routed = route(x, weights, indices, &experts, local * e, &node.attrs).map_err(|m| m.0)?;
    let kerr = |m: tch::TchError| m.to_string();
    // pairs per owning rank: the sorted pairs are grouped by owner, expert-minor
    let sizes: Vec<i64> = routed.counts.chunks(local as usize).map(|c| c.iter().sum()).collect();
    // what each member sends this rank: its pairs per expert of this rank's experts
    let counts = Tensor::from_slice(&routed.counts);
    let equal = vec![local; e as usize];
    let got = pg.all_to_all_rows(&counts, &equal, &equal).map_err(|m| m.to_string())?;
    let got = crate::runtime::kernels::tensor::to_i64_vec(&got)?;
    let incoming: Vec<i64> = got.chunks(local as usize).map(|c| c.iter().sum()).collect();
    let xs = routed.rows_in(x).map_err(|m| m.0)?;
    let received = pg.all_to_all_rows(&xs, &sizes, &incoming).map_err(|m| m.to_string())?;
    // received rows are member-major, expert-minor: regroup them expert-major
    let (by_expert, per_expert) = expert_major(&got, local as usize, e as usize);
    let order = Tensor::from_slice(&by_expert).f_to_device(x.device()).map_err(kerr)?;
    let rows = received.f_index_select(0, &order).map_err(kerr)?;
    let ys = run_experts(&rows, &per_expert, &experts, routed.activation, ctx.autocast).map_err(|m| m.0)?;
    // back to member-major order, then home
    let mut inverse = vec![0i64; by_expert.len()];
    for (i, &r) in by_expert.iter().enumerate() {
        inverse[r as usize] = i as i64;
    }
    let inverse = Tensor::from_slice(&inverse).f_to_device(x.device()).map_err(kerr)?;
    let ys = ys.f_index_select(0, &inverse).map_err(kerr)?;
    let back = pg.all_to_all_rows(&ys, &incoming, &sizes).map_err(|m| m.to_string())?;
    combine(x, &routed, &back).map_err(|m| m.0)
}

/// For rows received member-major (member j's rows for local expert l counted by
/// `got[j·local + l]`): the row order that lists them expert-major (member order within an
/// expert, as one rank sorting the members' pairs stably would), and the rows per local expert.
fn expert_major(got: &[i64], local: usize, members: usize) -> (Vec<i64>, Vec<i64>) {
    let mut start = vec![0i64; members * local];
    let mut at = 0;
    for (i, &c) in got.iter().enumerate() {
        start[i] = at;
        at += c;
    }
    let mut order = Vec::with_capacity(at as usize);
    let mut per_expert = vec![0i64; local];
    for (l, rows) in per_expert.iter_mut().enumerate() {
        for j in 0..members {
            let i = j * local + l;
            order.extend(start[i]..start[i] + got[i]);
            *rows += got[i];
        }
    }
    (order, per_expert)
}

#[cfg(test)]
mod tests {
    use super::expert_major;

    #[test]
    fn received_rows_regroup_by_expert_in_member_order() {
        // two members, two local experts: member 0 sent 1 row for expert 0, 2 for expert 1;
        // member 1 sent 2 for expert 0, none for expert 1
        let (order, per) = expert_major(&[1, 2, 2, 0], 2, 2);
        assert_eq!(order, vec![0, 3, 4, 1, 2]);
        assert_eq!(per, vec![3, 2]);
    }
}
