//! Expert parallelism on a rank: which experts of each stacked expert weight it holds, and the
//! groups its experts' tokens and gradients travel in.
//!
//! Expert groups are runs of `ep` consecutive replicas at one (pipeline, tensor) position:
//! replicas {0..ep-1}, {ep..2ep-1}, ... Member j of a group holds experts
//! `j·E/ep .. (j+1)·E/ep` of every `MixtureOfExperts` node's `gate_up [E, 2I, H]` and
//! `down [E, H, I]`; the groups replicate them, so an expert's gradient is summed over the
//! dp / ep ranks holding it (the same place in their groups). Every other weight is plain data
//! parallel.

use std::collections::HashMap;

use crate::codegen::Mesh;
use crate::ir::{Graph, OpKind};
use crate::runtime::RuntimeError;
use crate::runtime::state::slice::Slice;
use crate::runtime::terr;

/// The operand positions of `MixtureOfExperts` that are stacked expert weights (the biases,
/// 5 and 6, are optional).
const EXPERT_OPERANDS: [usize; 4] = [3, 4, 5, 6];

/// A rank's part of the experts.
#[derive(Clone, Debug, Default)]
pub(crate) struct Experts {
    /// Ranks per expert group (1: no expert parallelism).
    pub ep: usize,
    /// The experts (range of axis 0) this rank holds, by stacked expert weight's initializer name.
    held: HashMap<String, [u64; 2]>,
}

impl Experts {
    /// The experts replica `replica` holds of every `MixtureOfExperts` of `graph` under degree
    /// `ep` (nothing to hold when `ep` is 1). Refused when an expert count is not a multiple of
    /// `ep`, or the experts' weights are not initializers.
    pub fn of(graph: &Graph, ep: usize, replica: usize) -> Result<Experts, RuntimeError> {
        let ep = ep.max(1);
        let slot = replica % ep;
        let mut held = HashMap::new();
        if ep == 1 {
            return Ok(Experts { ep, held });
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
        Ok(Experts { ep, held })
    }

    /// The experts this rank holds of the initializer `name`, if it is a stacked expert weight
    /// held in part.
    pub fn held(&self, name: &str) -> Option<[u64; 2]> {
        self.held.get(name).copied()
    }

    /// `part` of the initializer `name` narrowed to this rank's experts.
    pub fn narrow(&self, name: &str, part: Slice) -> Slice {
        Slice { experts: self.held(name), ..part }
    }

    /// Whether this rank writes (and counts in the gradient norm) its copy of a weight held in
    /// part: the first expert group's members hold every expert once.
    pub fn first_group(&self, replica: usize) -> bool {
        replica < self.ep
    }

    /// The expert group of the rank at pipeline rank `q`, replica `d`, tensor rank `t`.
    pub fn group(mesh: &Mesh, ep: usize, (q, d, t): (usize, usize, usize)) -> Vec<usize> {
        let replicas = mesh.replica_group(q, t);
        let first = d - d % ep.max(1);
        replicas[first..(first + ep).min(replicas.len())].to_vec()
    }

    /// The ranks holding the same experts as the rank at (`q`, `d`, `t`): the same place in
    /// every expert group, replica order.
    pub fn replicas(mesh: &Mesh, ep: usize, (q, d, t): (usize, usize, usize)) -> Vec<usize> {
        let ep = ep.max(1);
        mesh.replica_group(q, t).into_iter().enumerate().filter(|(r, _)| r % ep == d % ep).map(|(_, g)| g).collect()
    }

    /// Every expert group and expert-replica group of `mesh` under degree `ep` (with more than
    /// one member), for creating them in one global order.
    pub fn all_groups(mesh: &Mesh, ep: usize) -> Vec<Vec<usize>> {
        let mut out = Vec::new();
        if ep <= 1 {
            return out;
        }
        for q in 0..mesh.pp() {
            for t in 0..mesh.tp().max(1) {
                for d in 0..mesh.dp() {
                    for g in [Self::group(mesh, ep, (q, d, t)), Self::replicas(mesh, ep, (q, d, t))] {
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
