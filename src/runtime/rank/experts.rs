//! Expert parallelism on a rank: which experts of each stacked expert weight it holds, and the
//! groups its experts' tokens and gradients travel in.
//!
//! Carved from the data-parallel ranks (expert-TP = TP), expert groups are runs of `ep`
//! consecutive replicas at one (pipeline, tensor) position: replicas {0..ep-1}, {ep..2ep-1},
//! ... Folded over tensor × data ranks (expert-TP 1 below TP, Megatron-Core's layout), a
//! stage's `dp · tp` ranks, taken replica-major then tensor rank, are re-factored as
//! `ep × expert-dp` with the expert rank fastest ([`Parallelism::expert_position`]), and each
//! tensor rank routes its own share of the tokens.
//!
//! Member j of a group holds experts `j·E/ep .. (j+1)·E/ep` of every `MixtureOfExperts` node's
//! `gate_up [E, 2I, H]` and `down [E, H, I]`; the groups replicate them, so an expert's
//! gradient is summed over the ranks holding it (the same place in their groups). Every other
//! weight is plain data parallel.

use std::collections::HashMap;

use crate::codegen::{Coord, Mesh};
use crate::ir::{Graph, OpKind, Parallelism};
use crate::runtime::RuntimeError;
use crate::runtime::state::slice::Slice;
use crate::runtime::terr;

/// The operand positions of `MixtureOfExperts` that are stacked expert weights (the biases,
/// 5 and 6, are optional).
const EXPERT_OPERANDS: [usize; 4] = [3, 4, 5, 6];

/// A rank's part of the experts.
#[derive(Clone, Debug, Default)]
pub(crate) struct Experts {
    /// The groups fold over tensor × data ranks: the tensor ranks route different tokens and
    /// hold different experts.
    pub folded: bool,
    /// This rank's place among the ranks holding its experts (0: the first expert group, whose
    /// members write the experts and count them in the gradient norm).
    holder: usize,
    /// The experts (range of axis 0) this rank holds, by stacked expert weight's initializer name.
    held: HashMap<String, [u64; 2]>,
}

impl Experts {
    /// The experts the rank at replica `d`, tensor rank `t` holds of every `MixtureOfExperts`
    /// of `graph` under `par` (nothing held in part without expert parallelism). Refused when
    /// an expert count is not a multiple of `ep`, or the experts' weights are not initializers.
    pub fn of(graph: &Graph, par: &Parallelism, (d, t): (usize, usize)) -> Result<Experts, RuntimeError> {
        let ep = par.ep.max(1);
        let folded = par.experts_folded();
        let (slot, holder) = position(par, (d, t));
        let mut held = HashMap::new();
        if ep == 1 && !folded {
            return Ok(Experts { folded, holder, held });
        }
        for id in graph.node_ids() {
            let node = graph.node(id);
            if !node.op.is(OpKind::MixtureOfExperts) {
                continue;
            }
            for i in EXPERT_OPERANDS {
                let Some(v) = node.inputs.get(i).copied().flatten() else {
                    if i >= 5 {
                        continue;
                    }
                    return Err(terr(format!("MixtureOfExperts node `{}` has no operand {i}", node.name)));
                };
                let val = graph.value(v);
                let Some(data) = val.data.as_ref() else {
                    return Err(terr(format!(
                        "MixtureOfExperts node `{}`: expert parallelism needs its experts' weights as initializers; `{}` is computed",
                        node.name, val.name
                    )));
                };
                let e = data.dims.first().copied().unwrap_or(0);
                if e <= 0 || e % ep as i64 != 0 {
                    return Err(terr(format!(
                        "MixtureOfExperts node `{}` has {e} experts, which ep {ep} does not divide; re-plan with an ep that divides {e}",
                        node.name
                    )));
                }
                let per = (e / ep as i64) as u64;
                held.insert(val.name.clone(), [slot as u64 * per, (slot as u64 + 1) * per]);
            }
        }
        Ok(Experts { folded, holder, held })
    }

    /// The experts this rank holds of the initializer `name`, if it is a stacked expert weight
    /// held in part.
    pub fn held(&self, name: &str) -> Option<[u64; 2]> {
        self.held.get(name).copied()
    }

    /// Whether some weight is held in part: its gradients sum over the ranks holding the same
    /// experts instead of the replicas.
    pub fn in_part(&self) -> bool {
        !self.held.is_empty()
    }

    /// `part` of the initializer `name` narrowed to this rank's experts.
    pub fn narrow(&self, name: &str, part: Slice) -> Slice {
        Slice { experts: self.held(name), ..part }
    }

    /// Whether this rank writes (and counts in the gradient norm) its copy of a weight held in
    /// part: the first expert group's members hold every expert once.
    pub fn first_group(&self) -> bool {
        self.holder == 0
    }

    /// The expert group of the rank at pipeline rank `q`, replica `d`, tensor rank `t`, in the
    /// order its members hold the experts.
    pub fn group(mesh: &Mesh, par: &Parallelism, (q, d, t): (usize, usize, usize)) -> Vec<usize> {
        let ep = par.ep.max(1);
        if par.experts_folded() {
            let (_, holder) = position(par, (d, t));
            return (0..ep).filter_map(|e| folded_rank(mesh, par, q, e, holder)).collect();
        }
        let replicas = mesh.replica_group(q, t);
        let first = d - d % ep;
        replicas[first.min(replicas.len())..(first + ep).min(replicas.len())].to_vec()
    }

    /// The ranks holding the same experts as the rank at (`q`, `d`, `t`): the same place in
    /// every expert group, in their groups' order.
    pub fn replicas(mesh: &Mesh, par: &Parallelism, (q, d, t): (usize, usize, usize)) -> Vec<usize> {
        let ep = par.ep.max(1);
        if par.experts_folded() {
            let (slot, _) = position(par, (d, t));
            let holders = (mesh.dp() * mesh.tp().max(1)) / ep;
            return (0..holders).filter_map(|j| folded_rank(mesh, par, q, slot, j)).collect();
        }
        mesh.replica_group(q, t).into_iter().enumerate().filter(|(r, _)| r % ep == d % ep).map(|(_, g)| g).collect()
    }

    /// Every expert group and expert-replica group of `mesh` under `par` (with more than one
    /// member), for creating them in one global order.
    pub fn all_groups(mesh: &Mesh, par: &Parallelism) -> Vec<Vec<usize>> {
        let mut out = Vec::new();
        if par.ep <= 1 && !par.experts_folded() {
            return out;
        }
        for q in 0..mesh.pp() {
            for t in 0..mesh.tp().max(1) {
                for d in 0..mesh.dp() {
                    for g in [Self::group(mesh, par, (q, d, t)), Self::replicas(mesh, par, (q, d, t))] {
                        if g.len() > 1 && !out.contains(&g) {
                            out.push(g);
                        }
                    }
                }
            }
        }
        out
    }
}

/// (place in its expert group, place among the ranks holding its experts) of the rank at
/// replica `d`, tensor rank `t`.
fn position(par: &Parallelism, (d, t): (usize, usize)) -> (usize, usize) {
    let ep = par.ep.max(1);
    if par.experts_folded() {
        let (_, slot, holder) = par.expert_position(d, t);
        (slot, holder)
    } else {
        (d % ep, d / ep)
    }
}

/// The global rank at pipeline rank `q` of folded expert-group slot `slot` in the `holder`-th
/// group (expert-TP 1).
fn folded_rank(mesh: &Mesh, par: &Parallelism, q: usize, slot: usize, holder: usize) -> Option<usize> {
    let (d, t) = par.expert_member(0, slot, holder);
    mesh.rank(Coord { pp: q, dp: d, tp: t })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One pipeline rank at degrees `tp`, `dp`, `ep`, `etp`.
    fn par(tp: usize, dp: usize, ep: usize, etp: usize) -> Parallelism {
        Parallelism { ep, etp, ..Parallelism::of_degrees(1, tp, dp) }
    }

    /// A mesh of `pp` pipeline ranks, `dp` replicas and `tp` tensor ranks numbered tensor rank
    /// fastest, then replica, then pipeline rank.
    fn mesh(pp: usize, dp: usize, tp: usize) -> Mesh {
        let rows = (0..pp).map(|q| (q * dp * tp..(q + 1) * dp * tp).collect()).collect();
        Mesh::from_rows(rows, tp)
    }

    #[test]
    fn folded_groups_take_the_expert_rank_fastest_over_replica_then_tensor_rank() {
        // tp 2, dp 2, ep 2, etp 1: positions i = d·2 + t; expert rank i % 2, holder i / 2
        let par = par(2, 2, 2, 1);
        let m = mesh(1, 2, 2);
        assert_eq!(Experts::group(&m, &par, (0, 0, 1)), vec![0, 1]);
        assert_eq!(Experts::group(&m, &par, (0, 1, 0)), vec![2, 3]);
        assert_eq!(Experts::replicas(&m, &par, (0, 0, 1)), vec![1, 3]);
        assert_eq!(Experts::all_groups(&m, &par), vec![vec![0, 1], vec![0, 2], vec![2, 3], vec![1, 3]]);
        // ep 4 over all four ranks: one group, no replicas of an expert
        let whole = Parallelism { ep: 4, ..par };
        assert_eq!(Experts::group(&m, &whole, (0, 1, 1)), vec![0, 1, 2, 3]);
        assert_eq!(Experts::replicas(&m, &whole, (0, 1, 1)), vec![3]);
        // ep 1 folded: every rank holds every expert, summed over the whole stage
        let one = Parallelism { ep: 1, ..par };
        assert_eq!(Experts::all_groups(&m, &one), vec![vec![0, 1, 2, 3]]);
    }

    #[test]
    fn carved_groups_are_runs_of_replicas_at_one_tensor_rank() {
        let par = par(2, 4, 2, 2);
        let m = mesh(1, 4, 2);
        assert_eq!(Experts::group(&m, &par, (0, 3, 1)), vec![5, 7]);
        assert_eq!(Experts::replicas(&m, &par, (0, 3, 1)), vec![3, 7]);
    }
}
