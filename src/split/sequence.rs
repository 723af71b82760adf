//! Sequence parallelism (Megatron-LM, Korthikanti et al. 2022) on top of a layer's
//! tensor-parallel placement.
//!
//! The all-reduce after a row-parallel matmul becomes a reduce-scatter along the token axis;
//! the ops after it that work token by token (elementwise ops, norms over the hidden axis,
//! reshapes that keep the tokens) run on the rank's chunk of tokens; a replicated operand they
//! read at full size is sliced locally (a scatter, no communication); a value read by anything
//! else (the next column-parallel matmul) or leaving the layer is all-gathered back.
//!
//! A token-split value of shape `S` is split along axis `a`: `S[a] = outer · len`, and rank
//! `r` holds, in each of the `outer` blocks, the `r`-th of `t` equal chunks of `len`. The
//! residual stream `[batch, seq, hidden]` has `a = 1, outer = 1`; GPT-2's flattened
//! `[batch · seq, hidden]` has `a = 0, outer = batch`.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::error::SplitError;
use super::family::{Family, family};
use super::realise::{CollectiveKind, Prop, R, Sh, TensorCollective};
use super::rewrite::{NodeRewrite, PartialGradient, add_bias_name};
use crate::ir::{Graph, NodeId, OpKind, ValueId, ValueKind};
use crate::passes::shape_infer::ShapeInfo;

/// Placement of a token-split value (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Seq {
    pub(super) axis: usize,
    pub(super) outer: i64,
    /// The axis holds the batch too (tokens flattened into axis 0), so `outer` is the batch the
    /// shapes were inferred at, not necessarily the one run: collectives go through a view.
    pub(super) flat: bool,
}

/// What sequence parallelism adds to a layer's tensor-parallel plan.
pub(super) struct SeqPlan {
    /// All-reduced values that become reduce-scatters: value, axis, view.
    pub reduce_scatter: Vec<(ValueId, usize, Option<Vec<i64>>)>,
    /// Gathers and scatters to insert.
    pub collectives: Vec<TensorCollective>,
    /// Reshape targets whose entry shrinks by t: node, entry, global size.
    pub shape_entries: Vec<(NodeId, usize, i64)>,
    /// Replicated inputs of token-split nodes whose gradient is a partial sum: node, slot, value.
    pub partial_gradients: Vec<(NodeId, usize, ValueId)>,
}

/// The layer as sequence parallelism sees it.
pub(super) struct SeqLayer<'s> {
    /// The model graph.
    pub g: &'s Graph,
    /// Its shapes at the bound dims.
    pub info: &'s ShapeInfo,
    /// Readers of each value.
    pub uses: &'s [Vec<NodeId>],
    /// Values that get a gradient.
    pub grad: &'s [bool],
    /// The layer's nodes, in order.
    pub nodes: &'s [NodeId],
    /// The same, as a set.
    pub in_layer: &'s HashSet<NodeId>,
    /// Layer index.
    pub layer: usize,
    /// Tensor-parallel degree.
    pub t: i64,
}

/// A node that runs on token chunks: its outputs' placement, the replicated inputs it slices,
/// and the target entry of a Reshape that names the tokens (entry, global size).
pub(super) struct Decision {
    pub(super) out: Seq,
    pub(super) scatters: Vec<(usize, ValueId)>,
    pub(super) shape_entry: Option<(usize, i64)>,
}

impl SeqLayer<'_> {
    pub(super) fn shape(&self, v: ValueId) -> Option<&[i64]> {
        self.info.types[v.index()].as_ref().and_then(|t| t.shape.as_deref())
    }

    fn leaves(&self, v: ValueId) -> bool {
        self.g.outputs.contains(&v) || self.uses[v.index()].iter().any(|u| !self.in_layer.contains(u))
    }

    /// Readers of `v` inside the layer, with the slot.
    fn readers(&self, v: ValueId) -> Vec<(NodeId, usize)> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for &u in &self.uses[v.index()] {
            if self.in_layer.contains(&u) && seen.insert(u) {
                for (slot, i) in self.g.node(u).inputs.iter().enumerate() {
                    if *i == Some(v) {
                        out.push((u, slot));
                    }
                }
            }
        }
        out
    }

    /// The sequence length: the token axis of the layer's first float input of rank ≥ 3.
    fn seq_len(&self) -> Option<i64> {
        for &n in self.nodes {
            for v in self.g.node(n).inputs.iter().flatten() {
                let val = self.g.value(*v);
                let outside = val.producer.is_none_or(|p| !self.in_layer.contains(&p));
                let float = self.info.types[v.index()].as_ref().is_some_and(|t| t.dtype.is_float());
                if outside && float && matches!(val.kind, ValueKind::Input | ValueKind::Intermediate)
                    && let Some(s) = self.shape(*v)
                    && s.len() >= 3
                {
                    return Some(s[s.len() - 2]);
                }
            }
        }
        None
    }

    /// Placement of a reduced matmul output: its token axis.
    fn candidate_state(&self, v: ValueId, seq_len: Option<i64>) -> Option<Seq> {
        let s = self.shape(v)?;
        match s.len() {
            0 | 1 => None,
            2 => match seq_len {
                Some(len) if len > 0 && s[0] % len == 0 => Some(Seq { axis: 0, outer: s[0] / len, flat: true }),
                _ => Some(Seq { axis: 0, outer: 1, flat: false }),
            },
            r => Some(Seq { axis: r - 2, outer: 1, flat: false }),
        }
    }

    /// How node `n` runs when its inputs in `seq` are token-split, or None if it cannot (the
    /// rules are in the family files: elementwise.rs, norm.rs, view.rs).
    fn decide(&self, n: NodeId, seq: &HashMap<ValueId, Seq>, tp_rep: &dyn Fn(ValueId) -> bool) -> Option<Decision> {
        let node = self.g.node(n);
        let kind = node.op.kind()?;
        if node.inputs.iter().flatten().chain(&node.outputs).any(|&v| !tp_rep(v)) {
            return None;
        }
        let o = *node.outputs.first()?;
        let os = self.shape(o)?;
        let state = node.inputs.iter().flatten().find_map(|v| seq.get(v).copied())?;
        match family(kind) {
            Family::Elementwise => self.elementwise(node, seq, state, os),
            Family::Norm => self.norm(node, seq, state),
            Family::View if kind == OpKind::Reshape => self.reshape(node, seq, state, os),
            // other views, contractions, lookups and the rest read their tokens gathered
            Family::View | Family::Matmul | Family::Attention | Family::Gather | Family::Experts | Family::Shape | Family::Whole => None,
        }
    }
}

/// Plans sequence parallelism for a layer whose all-reduced values produced by matmuls are
/// `candidates`; `tp_rep` says which values the tensor-parallel plan keeps replicated.
pub(super) fn plan(l: &SeqLayer, tp_rep: &dyn Fn(ValueId) -> bool, candidates: &[ValueId]) -> Result<SeqPlan, SplitError> {
    let seq_len = l.seq_len();
    let mut forbidden: HashSet<NodeId> = HashSet::new();
    let mut dropped: HashSet<ValueId> = HashSet::new();
    let cand_set: HashSet<ValueId> = candidates.iter().copied().collect();
    let (seq, decisions) = loop {
        let mut seq: HashMap<ValueId, Seq> = HashMap::new();
        let mut decisions: BTreeMap<usize, (NodeId, Decision)> = BTreeMap::new();
        for (pos, &n) in l.nodes.iter().enumerate() {
            let node = l.g.node(n);
            let produced: Vec<ValueId> = node.outputs.iter().copied().filter(|o| cand_set.contains(o) && !dropped.contains(o)).collect();
            if !produced.is_empty() {
                for o in produced {
                    if let Some(s) = l.candidate_state(o, seq_len) {
                        seq.insert(o, s);
                    }
                }
                continue;
            }
            if forbidden.contains(&n) || !node.inputs.iter().flatten().any(|v| seq.contains_key(v)) {
                continue;
            }
            if let Some(d) = l.decide(n, &seq, tp_rep) {
                for &o in &node.outputs {
                    seq.insert(o, d.out);
                }
                decisions.insert(pos, (n, d));
            }
        }
        let sp_nodes: HashSet<NodeId> = decisions.values().map(|(n, _)| *n).collect();
        let mut changed = false;
        for &v in seq.keys() {
            let sp_readers: Vec<NodeId> = l.readers(v).into_iter().map(|r| r.0).filter(|n| sp_nodes.contains(n)).collect();
            if l.leaves(v) && !sp_readers.is_empty() {
                // a value leaving the layer is gathered under its own name; its readers here
                // then see it whole
                forbidden.extend(sp_readers.iter().copied());
                changed = true;
            }
            if cand_set.contains(&v) && sp_readers.is_empty() {
                // nothing runs on the chunks: the all-reduce stays
                dropped.insert(v);
                changed = true;
            }
        }
        if !changed {
            break (seq, decisions);
        }
    };
    let sp_nodes: HashSet<NodeId> = decisions.values().map(|(n, _)| *n).collect();
    let name = |v: ValueId| l.g.value(v).name.clone();
    let view_of = |v: ValueId, s: Seq| -> (usize, Option<Vec<i64>>) {
        let shape = l.shape(v).unwrap_or(&[]);
        if s.outer == 1 && !s.flat {
            return (s.axis, None);
        }
        let mut view = vec![-1, shape[s.axis] / s.outer];
        view.extend_from_slice(&shape[s.axis + 1..]);
        (1, Some(view))
    };
    let mut out = SeqPlan { reduce_scatter: Vec::new(), collectives: Vec::new(), shape_entries: Vec::new(), partial_gradients: Vec::new() };
    let mut ordered: Vec<(ValueId, Seq)> = seq.iter().map(|(&v, &s)| (v, s)).collect();
    ordered.sort_by_key(|(v, _)| *v);
    for &(v, s) in &ordered {
        let shape = l.shape(v).unwrap_or(&[]);
        let len = shape.get(s.axis).copied().unwrap_or(0) / s.outer;
        if cand_set.contains(&v) {
            if len % l.t != 0 || len == 0 {
                return Err(SplitError::SequenceIndivisible { layer: l.layer, value: name(v), len, tp: l.t as usize });
            }
            let (axis, view) = view_of(v, s);
            out.reduce_scatter.push((v, axis, view));
        }
        let readers = l.readers(v);
        let sp_readers = readers.iter().any(|r| sp_nodes.contains(&r.0));
        let whole: Vec<(NodeId, usize)> = readers.iter().filter(|r| !sp_nodes.contains(&r.0)).copied().collect();
        let (axis, view) = view_of(v, s);
        if readers.is_empty() && !l.leaves(v) {
            continue;
        }
        if !sp_readers && !cand_set.contains(&v) {
            // only whole readers (or none inside): gather under the value's own name
            let mut c = TensorCollective::after(v, CollectiveKind::AllGather { axis });
            c.view = view;
            out.collectives.push(c);
        } else if !whole.is_empty() {
            let mut c = TensorCollective::after(v, CollectiveKind::AllGather { axis });
            c.readers = whole;
            c.view = view;
            out.collectives.push(c);
        }
    }
    // scatters of replicated operands, one per (value, placement)
    let mut scatters: BTreeMap<(ValueId, usize, i64, bool), Vec<(NodeId, usize)>> = BTreeMap::new();
    for (n, d) in decisions.values() {
        let node = l.g.node(*n);
        for &(slot, v) in &d.scatters {
            scatters.entry((v, d.out.axis, d.out.outer, d.out.flat)).or_default().push((*n, slot));
        }
        if let Some((k, global)) = d.shape_entry {
            out.shape_entries.push((*n, k, global));
        }
        for (slot, v) in node.inputs.iter().enumerate() {
            let Some(v) = *v else { continue };
            if !seq.contains_key(&v) && !d.scatters.iter().any(|s| s.0 == slot) && l.grad[v.index()] {
                out.partial_gradients.push((*n, slot, v));
            }
        }
    }
    for ((v, axis, outer, flat), readers) in scatters {
        let (axis, view) = view_of(v, Seq { axis, outer, flat });
        let mut c = TensorCollective::after(v, CollectiveKind::Scatter { axis });
        c.readers = readers;
        c.view = view;
        out.collectives.push(c);
    }
    Ok(out)
}

impl Prop<'_, '_> {
    /// Sequence parallelism over the finished tensor-parallel placement (see
    /// the module docs).
    pub(super) fn sequence_parallel(&mut self) -> R<()> {
        let candidates: Vec<ValueId> = self
            .collectives
            .iter()
            .filter(|c| c.op == CollectiveKind::AllReduce && c.readers.is_empty())
            .map(|c| c.value)
            .filter(|&v| {
                // a matmul's or the experts' output, or the experts' `[N, H]` output reshaped to the
                // tokens' shape
                let made_by = |v: ValueId, families: &[Family]| {
                    self.g.value(v).producer.filter(|p| self.in_layer.contains(p) && self.g.node(*p).op.kind().is_some_and(|k| families.contains(&family(k))))
                };
                let experts_reshaped = made_by(v, &[Family::View])
                    .filter(|&p| self.g.node(p).op.is(OpKind::Reshape))
                    .and_then(|p| self.g.node(p).inputs.first().copied().flatten())
                    .is_some_and(|x| made_by(x, &[Family::Experts]).is_some());
                made_by(v, &[Family::Matmul, Family::Experts]).is_some() || experts_reshaped
            })
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let sh = &self.sh;
        let tp_rep = |v: ValueId| sh.get(&v).is_none_or(|s| *s == Sh::Rep);
        let layer = SeqLayer {
            g: self.g,
            info: &self.s.info,
            uses: &self.s.uses,
            grad: &self.s.grad,
            nodes: self.nodes,
            in_layer: &self.in_layer,
            layer: self.layer,
            t: self.t,
        };
        let plan = plan(&layer, &tp_rep, &candidates)?;
        for (v, axis, view) in plan.reduce_scatter {
            if let Some(c) = self.collectives.iter_mut().find(|c| c.value == v && c.readers.is_empty()) {
                c.op = CollectiveKind::ReduceScatter { axis };
                c.view = view;
            }
            // a deferred Gemm bias is added to the chunk after the reduce-scatter
            if let Some(p) = self.g.value(v).producer {
                let node = self.g.node(p);
                let deferred = self.rewrites.iter().any(|r| matches!(r, NodeRewrite::DeferBias { node: n } if *n == node.name));
                if deferred && let Some(bias) = node.inputs.get(2).copied().flatten() && self.s.grad[bias.index()] {
                    self.partial_gradients.push(PartialGradient { node: add_bias_name(&node.name), input: 1, value: self.g.value(bias).name.clone() });
                }
            }
        }
        self.collectives.extend(plan.collectives);
        for (n, k, global) in plan.shape_entries {
            self.current = Some(n);
            self.shrink_shape_entry(n, 1, k, global)?;
        }
        for (n, slot, v) in plan.partial_gradients {
            self.partial_gradients.push(PartialGradient { node: self.g.node(n).name.clone(), input: slot, value: self.g.value(v).name.clone() });
        }
        Ok(())
    }
}

