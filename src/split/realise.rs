//! Emitting a strategy: tensor-parallel propagation over one layer (Megatron-LM's patterns).
//!
//! Every value of a layer gets a placement: replicated, split along one axis, or a partial sum.
//! A weight matmul whose input is replicated splits its weight by columns (output split); one
//! whose input is split along the contracted axis splits its weight by rows (partial sums); the
//! split then flows through reshapes, transposes, splits, elementwise ops and attention
//! matmuls, so QKV projections split by heads (KV heads for grouped-query attention), the output
//! projection and the MLP's second matmul reduce, and norms stay replicated. Partial sums are
//! all-reduced as soon as something other than a view reads them; a split value leaving the
//! layer is all-gathered (the LM head's logits). The vocabulary table of an embedding splits by
//! rows with a masked lookup and an all-reduce.
//!
//! A split axis of global size `d` is laid out as `[outer, t, inner]`: rank `r` holds, for each
//! outer block `o`, the elements `(o·t + r)·inner .. (o·t + r + 1)·inner`. Plain column splits
//! have `outer = 1`; GPT-2's fused `c_attn` has `outer = 3` (q, k and v each split by heads).
//!
//! This file holds the driver (the per-node dispatch, layer outputs, retries); each op family's
//! rule is in its own file (`matmul`, `gather`, `view`, `elementwise`, `norm`, `attention`).
//! The result is a rank-independent [`SplitPlan`]; codegen turns it into one shard per rank.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};


use super::Strategy;
use super::error::SplitError;
use super::family::{Family, Opaque, family, opaque_with, tp_rule};
use super::rewrite::{ConstantRewrite, NodeRewrite, PartialGradient};
pub use crate::ir::CollectiveKind;
use crate::ir::{Graph, LayeredGraph, NodeId, OpKind, ValueId, ValueKind};
use crate::passes::shape_infer::{self, ShapeInfo};

/// A collective on one value of the layer (codegen names it in the plan's shard).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorCollective {
    /// The value combined.
    pub value: ValueId,
    /// What is computed.
    pub op: CollectiveKind,
    /// The only node inputs `(node, slot)` that read the result (empty: every reader).
    pub readers: Vec<(NodeId, usize)>,
    /// The whole tensor's shape as the collective sees it when it runs on a view.
    pub view: Option<Vec<i64>>,
}

impl TensorCollective {
    /// A collective every reader of `value` reads.
    pub fn after(value: ValueId, op: CollectiveKind) -> TensorCollective {
        TensorCollective { value, op, readers: Vec::new(), view: None }
    }
}

/// The tensor-split engine of one analysed graph: shape information computed once, then
/// [`Engine::plan`] / [`Engine::plan_keeping`] per layer and tensor degree.
pub struct Engine<'a> {
    pub(super) lg: &'a LayeredGraph,
    pub(super) info: ShapeInfo,
    pub(super) uses: Vec<Vec<NodeId>>,
    pub(super) vocab: Option<i64>,
    /// Values that get a gradient: trained weights, float graph inputs, and float values
    /// computed from them.
    pub(super) grad: Vec<bool>,
    /// Whether row-parallel outputs are reduce-scattered over the tokens (sequence parallelism).
    pub(super) sequence_parallel: bool,
    /// Nodes the engine cannot see into ([`super::family::opaque`]): kept whole.
    pub(super) opaque: HashMap<NodeId, Opaque>,
}

impl<'a> Engine<'a> {
    /// Prepares to split the layers of `lg`.
    pub fn new(lg: &'a LayeredGraph) -> Result<Engine<'a>, SplitError> {
        let info = shape_infer::infer(&lg.graph, &lg.dims.values, false)?;
        let uses = lg.graph.uses();
        let vocab = lg
            .graph
            .outputs
            .first()
            .and_then(|&v| info.types[v.index()].as_ref())
            .and_then(|t| t.shape.as_ref())
            .and_then(|s| s.last().copied())
            .filter(|&v| v > 1);
        let g = &lg.graph;
        let mut grad: Vec<bool> = g
            .value_ids()
            .map(|v| {
                let val = g.value(v);
                let float = info.types[v.index()].as_ref().is_some_and(|t| t.dtype.is_float());
                (val.kind == ValueKind::Input && float) || crate::passes::figures::is_trainable(g, v)
            })
            .collect();
        for n in g.topo_order()? {
            let node = g.node(n);
            if node.inputs.iter().flatten().any(|v| grad[v.index()]) {
                for &o in &node.outputs {
                    grad[o.index()] = info.types[o.index()].as_ref().is_some_and(|t| t.dtype.is_float());
                }
            }
        }
        let opaque = opaque_with(g, &info);
        Ok(Engine { lg, info, uses, vocab, grad, sequence_parallel: false, opaque })
    }

    /// Turns sequence parallelism on or off (default off): each row-parallel all-reduce becomes
    /// a reduce-scatter over the tokens, token-wise ops after it run on the rank's tokens, and
    /// all-gathers restore whole values where needed.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// The analysed graph.
    pub fn graph(&self) -> &'a LayeredGraph {
        self.lg
    }

    /// Shapes at the bound dims.
    pub fn info(&self) -> &ShapeInfo {
        &self.info
    }

    /// The most-split plan of `layer` at degree `tp` (weights that do not divide stay whole and
    /// are listed in [`SplitPlan::kept_whole`]).
    pub fn plan(&self, layer: usize, tp: usize) -> Result<SplitPlan, SplitError> {
        self.plan_whole(layer, tp, HashSet::new())
    }

    /// Emits a per-node choice: the plan of `layer` at degree `tp` with the weights of the
    /// nodes named in `keep_whole` (matmuls and embedding lookups chosen `replicate`) left
    /// whole, and the strategy realised per choosing node.
    pub fn plan_keeping(&self, layer: usize, tp: usize, keep_whole: &[String]) -> Result<(SplitPlan, Vec<(String, Strategy)>), SplitError> {
        let l = self.lg.layers.get(layer).ok_or(SplitError::NoLayer { layer, layers: self.lg.layers.len() })?;
        let g = &self.lg.graph;
        let mut keep = HashSet::new();
        for &n in &l.nodes {
            let node = g.node(n);
            if !keep_whole.contains(&node.name) {
                continue;
            }
            let operands = node.op.kind().map_or(Vec::new(), |k| family(k).weight_operands(node));
            for w in operands.into_iter().filter_map(|v| self.weight_of(v)) {
                keep.insert(w);
            }
        }
        let plan = self.plan_whole(layer, tp, keep)?;
        let realised = l.nodes.iter().filter_map(|&n| self.realised(&plan, n).map(|s| (g.node(n).name.clone(), s))).collect();
        Ok((plan, realised))
    }

    /// Degrees in 2..=64 other than `tp` at which `layer` splits with nothing kept whole.
    pub fn working_degrees(&self, layer: usize, tp: usize) -> Vec<usize> {
        (2..=64).filter(|&t| t != tp && self.plan(layer, t).is_ok_and(|p| p.kept_whole.is_empty())).collect()
    }

    /// The float initializer behind a weight operand (through transposes).
    fn weight_of(&self, v: ValueId) -> Option<ValueId> {
        let g = &self.lg.graph;
        let val = g.value(v);
        if val.kind == ValueKind::Initializer {
            return self.info.types[v.index()].as_ref().is_some_and(|t| t.dtype.is_float()).then_some(v);
        }
        let p = g.node_ids().find(|&n| g.node(n).outputs.contains(&v))?;
        let node = g.node(p);
        if node.op.is(OpKind::Transpose) { node.inputs.first().copied().flatten().and_then(|x| self.weight_of(x)) } else { None }
    }

    /// The strategy a node got: weight matmuls column/row/replicate, vocabulary lookups
    /// vocab/replicate, matmuls of two activations and fused attention heads/replicate, mixtures
    /// of experts experts/replicate; `None` for other nodes.
    pub fn realised(&self, plan: &SplitPlan, n: NodeId) -> Option<Strategy> {
        let g = &self.lg.graph;
        let node = g.node(n);
        let out = *node.outputs.first()?;
        let split = |v: ValueId| matches!(plan.placements.get(&v), Some(Sh::Split { .. }));
        let fam = family(node.op.kind()?);
        match fam {
            Family::Matmul => match node.inputs.get(1).copied().flatten().and_then(|w| self.weight_of(w)) {
                Some(w) if plan.weights.contains_key(&w) => {
                    let gathered = plan.collectives.iter().any(|c| c.value == out && matches!(c.op, CollectiveKind::AllGather { .. }));
                    Some(if split(out) || gathered { Strategy::Column } else { Strategy::Row })
                }
                Some(_) => Some(Strategy::Replicate),
                None => Some(if split(out) { Strategy::Heads } else { Strategy::Replicate }),
            },
            Family::Attention => Some(if split(out) { Strategy::Heads } else { Strategy::Replicate }),
            Family::Experts => {
                let gate_up = *fam.weight_operands(node).first()?;
                Some(if plan.weights.contains_key(&gate_up) { Strategy::Experts } else { Strategy::Replicate })
            }
            Family::Gather => {
                let w = node.inputs.first().copied().flatten().and_then(|v| self.weight_of(v))?;
                Some(if plan.weights.contains_key(&w) { Strategy::Vocab } else { Strategy::Replicate })
            }
            Family::Elementwise | Family::Norm | Family::View | Family::Shape | Family::Whole => None,
        }
    }

    fn plan_whole(&self, layer: usize, tp: usize, keep: HashSet<ValueId>) -> Result<SplitPlan, SplitError> {
        let l = self.lg.layers.get(layer).ok_or(SplitError::NoLayer { layer, layers: self.lg.layers.len() })?;
        let mut demands: HashMap<ValueId, i64> = HashMap::new();
        let mut replicate: HashSet<ValueId> = keep;
        let mut replicas: HashMap<ValueId, i64> = HashMap::new();
        let plan = loop {
            let mut p = Prop::new(self, layer, &l.nodes, tp as i64, &demands, &replicate, &replicas);
            let res = p.run().and_then(|()| if self.sequence_parallel { p.sequence_parallel() } else { Ok(()) });
            let last = p.unsupported_last(String::new());
            let done = res.map(|()| p.finish());
            match done {
                Ok(plan) => break plan,
                Err(Fail::Demand { weight, outer }) => {
                    let prev = demands.insert(weight, outer);
                    if prev == Some(outer) || demands.len() > 64 {
                        let why = format!("the split layout of `{}` cannot satisfy its consumers", self.lg.graph.value(weight).name);
                        return Err(match last {
                            SplitError::Unsupported { layer, node, op, tp, .. } => SplitError::Unsupported { layer, node, op, tp, why },
                            e => e,
                        });
                    }
                }
                Err(Fail::Replicate { weight }) => {
                    // A split that a later op cannot take: keep that weight whole.
                    replicate.insert(weight);
                }
                Err(Fail::Replicas { weight, rep }) => {
                    // Fewer heads than ranks (grouped-query KV): ranks share whole heads.
                    if replicas.insert(weight, rep).is_some() {
                        replicate.insert(weight);
                    }
                }
                Err(Fail::Error(e)) => return Err(e),
            }
        };
        Ok(plan)
    }
}

/// The rank-independent result of emitting a layer's split.
#[derive(Clone, Debug)]
pub struct SplitPlan {
    /// Weights split, by initializer.
    pub weights: BTreeMap<ValueId, WeightSplit>,
    /// Shape constants rewritten.
    pub constant_rewrites: Vec<ConstantRewrite>,
    /// Structural rewrites (rank-independent).
    pub rewrites: Vec<NodeRewrite>,
    /// Vocabulary-parallel lookups: (node, table); their masked range depends on the rank.
    pub gathers: Vec<(String, ValueId)>,
    /// Collectives over the tensor group, in insertion order.
    pub collectives: Vec<TensorCollective>,
    /// Gradients all-reduced in the backward pass.
    pub partial_gradients: Vec<PartialGradient>,
    /// Matmul weights and vocabulary tables left whole because they do not divide.
    pub kept_whole: BTreeSet<ValueId>,
    /// Final placement of the layer's values.
    placements: HashMap<ValueId, Sh>,
}

/// Placement of a value across the tensor ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sh {
    /// Every rank holds all of it.
    Rep,
    /// Split along `axis` with the `[outer, t, inner]` layout; `origin` is the weight whose
    /// split made it (for layout demands).
    Split {
        /// Split axis.
        axis: usize,
        /// Blocks.
        outer: i64,
        /// Elements per rank per block.
        inner: i64,
        /// Weight whose split made it.
        origin: Option<ValueId>,
    },
    /// Each rank holds a partial sum of the full tensor.
    Partial,
}

/// A decided weight split (rank-independent): rank `r` of `t` holds, per outer block `o`,
/// elements `(o·(t/rep) + r/rep)·inner ..` of `axis`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightSplit {
    /// Axis of the initializer.
    pub axis: usize,
    /// Blocks along the axis (`[outer, t, inner]` layout).
    pub outer: i64,
    /// Elements of one rank's part of a block.
    pub inner: i64,
    /// Ranks sharing each block (the split is `t / rep` ways).
    pub rep: i64,
}

pub(super) enum Fail {
    Demand { weight: ValueId, outer: i64 },
    Replicate { weight: ValueId },
    Replicas { weight: ValueId, rep: i64 },
    Error(SplitError),
}

impl From<SplitError> for Fail {
    fn from(e: SplitError) -> Fail {
        Fail::Error(e)
    }
}

pub(super) type R<T> = Result<T, Fail>;

pub(super) struct Prop<'s, 'a> {
    pub(super) s: &'s Engine<'a>,
    pub(super) g: &'a Graph,
    pub(super) layer: usize,
    pub(super) nodes: &'s [NodeId],
    pub(super) in_layer: HashSet<NodeId>,
    pub(super) t: i64,
    pub(super) demands: &'s HashMap<ValueId, i64>,
    pub(super) replicate: &'s HashSet<ValueId>,
    /// Weights whose blocks are shared by this many consecutive ranks.
    pub(super) replicas: &'s HashMap<ValueId, i64>,
    pub(super) sh: HashMap<ValueId, Sh>,
    /// Initializers and transposes of them not yet placed: the initializer and the permutation
    /// from this value's axes to the initializer's.
    pub(super) weight_src: HashMap<ValueId, (ValueId, Vec<usize>)>,
    pub(super) weights: BTreeMap<ValueId, WeightSplit>,
    pub(super) constant_rewrites: Vec<ConstantRewrite>,
    pub(super) rewrites: Vec<NodeRewrite>,
    pub(super) gathers: Vec<(String, ValueId)>,
    pub(super) collectives: Vec<TensorCollective>,
    pub(super) partial_gradients: Vec<PartialGradient>,
    /// Matmul weights and vocabulary tables left whole because they do not divide.
    pub(super) kept_whole: BTreeSet<ValueId>,
    pub(super) current: Option<NodeId>,
}

pub(super) fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a.abs() } else { gcd(b, a % b) }
}

pub(super) fn lcm(a: i64, b: i64) -> i64 {
    a / gcd(a, b) * b
}

pub(super) use super::axes::norm_axis;

impl<'s, 'a> Prop<'s, 'a> {
    pub(super) fn new(
        s: &'s Engine<'a>,
        layer: usize,
        nodes: &'s [NodeId],
        t: i64,
        demands: &'s HashMap<ValueId, i64>,
        replicate: &'s HashSet<ValueId>,
        replicas: &'s HashMap<ValueId, i64>,
    ) -> Self {
        Prop {
            s,
            g: &s.lg.graph,
            layer,
            nodes,
            in_layer: nodes.iter().copied().collect(),
            t,
            demands,
            replicate,
            replicas,
            sh: HashMap::new(),
            weight_src: HashMap::new(),
            weights: BTreeMap::new(),
            constant_rewrites: Vec::new(),
            rewrites: Vec::new(),
            gathers: Vec::new(),
            collectives: Vec::new(),
            partial_gradients: Vec::new(),
            kept_whole: BTreeSet::new(),
            current: None,
        }
    }

    pub(super) fn finish(self) -> SplitPlan {
        SplitPlan {
            weights: self.weights,
            constant_rewrites: self.constant_rewrites,
            rewrites: self.rewrites,
            gathers: self.gathers,
            collectives: self.collectives,
            partial_gradients: self.partial_gradients,
            kept_whole: self.kept_whole,
            placements: self.sh,
        }
    }

    pub(super) fn unsupported_last(&self, why: String) -> SplitError {
        let (node, op) = self
            .current
            .map(|n| (self.g.node(n).name.clone(), self.g.node(n).op.to_string()))
            .unwrap_or_default();
        SplitError::Unsupported { layer: self.layer, node, op, tp: self.t as usize, why }
    }

    pub(super) fn err<T>(&self, why: impl Into<String>) -> R<T> {
        Err(Fail::Error(self.unsupported_last(why.into())))
    }

    pub(super) fn shape(&self, v: ValueId) -> Option<&[i64]> {
        self.s.info.types[v.index()].as_ref().and_then(|t| t.shape.as_deref())
    }

    pub(super) fn need_shape(&self, v: ValueId) -> R<Vec<i64>> {
        match self.shape(v) {
            Some(s) => Ok(s.to_vec()),
            None => self.err(format!("the shape of `{}` is unknown", self.g.value(v).name)),
        }
    }

    pub(super) fn ints(&self, v: ValueId) -> Option<&[i64]> {
        self.s.info.ints(v)
    }

    pub(super) fn state(&self, v: ValueId) -> Sh {
        self.sh.get(&v).copied().unwrap_or(Sh::Rep)
    }

    pub(super) fn is_float(&self, v: ValueId) -> bool {
        self.s.info.types[v.index()].as_ref().is_some_and(|t| t.dtype.is_float())
    }

    pub(super) fn run(&mut self) -> R<()> {
        for &v in self.g.initializers().collect::<Vec<_>>().iter() {
            if self.is_float(v) {
                self.weight_src.insert(v, (v, (0..self.shape(v).map_or(0, <[i64]>::len)).collect()));
            }
        }
        for &n in self.nodes {
            self.current = Some(n);
            // Replicated inputs that get a gradient, and the collectives so far: a node that
            // turns them into a split or partial output sends back a partial gradient. A weight
            // it reads whole (a per-head norm's scale over split heads) is one of them.
            let rep_inputs: Vec<(usize, ValueId)> = self
                .g
                .node(n)
                .inputs
                .iter()
                .enumerate()
                .filter_map(|(slot, v)| v.map(|v| (slot, v)))
                .filter(|&(_, v)| self.s.grad[v.index()] && self.state(v) == Sh::Rep)
                .collect();
            let collectives_before = self.collectives.len();
            match self.node(n) {
                Ok(()) => {
                    let node = self.g.node(n);
                    let reduced = |o: ValueId| {
                        self.collectives[collectives_before..].iter().any(|c| c.value == o && c.op == CollectiveKind::AllReduce)
                    };
                    let split_out = node.outputs.iter().any(|&o| matches!(self.state(o), Sh::Split { .. } | Sh::Partial) || reduced(o));
                    // a weight added after the all-reduce (a row split's bias) is whole
                    let split_only = node.outputs.iter().all(|&o| matches!(self.state(o), Sh::Split { .. }) && !reduced(o));
                    if split_out {
                        for (slot, v) in rep_inputs {
                            let weight = self.g.value(v).kind == ValueKind::Initializer;
                            if self.state(v) == Sh::Rep && (!weight || split_only) {
                                self.partial_gradients.push(PartialGradient { node: node.name.clone(), input: slot, value: self.g.value(v).name.clone() });
                            }
                        }
                    }
                }
                Err(Fail::Error(e)) => {
                let origin = self.g.node(n).inputs.iter().flatten().find_map(|v| match self.state(*v) {
                    Sh::Split { origin: Some(w), .. } if !self.replicate.contains(&w) => Some(w),
                    _ => None,
                });
                return Err(match origin {
                    Some(weight) => Fail::Replicate { weight },
                    None => Fail::Error(e),
                });
                }
                Err(other) => return Err(other),
            }
        }
        // Values leaving the layer must be whole.
        let outs = self.layer_outputs();
        for v in outs {
            match self.state(v) {
                Sh::Rep => {}
                Sh::Partial => self.reduce(v),
                Sh::Split { axis, outer, origin, .. } => {
                    if let Some(w) = origin
                        && self.rep(origin) > 1
                    {
                        return Err(Fail::Replicate { weight: w });
                    }
                    if outer != 1 {
                        return self.err(format!("`{}` leaves the layer split with {outer} blocks", self.g.value(v).name));
                    }
                    self.collectives.push(TensorCollective::after(v, CollectiveKind::AllGather { axis }));
                    self.sh.insert(v, Sh::Rep);
                }
            }
        }
        Ok(())
    }

    pub(super) fn layer_outputs(&self) -> Vec<ValueId> {
        let mut outs = Vec::new();
        for &n in self.nodes {
            for &o in &self.g.node(n).outputs {
                let used_outside = self.s.uses[o.index()].iter().any(|u| !self.in_layer.contains(u));
                if used_outside || self.g.outputs.contains(&o) {
                    outs.push(o);
                }
            }
        }
        outs
    }

    pub(super) fn reduce(&mut self, v: ValueId) {
        self.collectives.push(TensorCollective::after(v, CollectiveKind::AllReduce));
        self.sh.insert(v, Sh::Rep);
    }

    /// A partial output stays partial only while views read it; otherwise it is reduced now.
    pub(super) fn settle_partial(&mut self, v: ValueId) {
        use OpKind::*;
        let views_only = self.s.uses[v.index()].iter().all(|&u| {
            self.in_layer.contains(&u)
                && matches!(self.g.node(u).op.kind(), Some(Reshape | Transpose | Squeeze | Unsqueeze | Identity))
                && self.g.node(u).inputs.first().copied().flatten() == Some(v)
        });
        let leaves = self.g.outputs.contains(&v) || self.s.uses[v.index()].iter().any(|u| !self.in_layer.contains(u));
        if leaves || !views_only {
            self.reduce(v);
        }
    }

    pub(super) fn set(&mut self, v: ValueId, s: Sh) {
        self.sh.insert(v, s);
        if s == Sh::Partial {
            self.settle_partial(v);
        }
    }

    /// Decides the split of a weight-like value (an initializer or a transpose of one) along
    /// its `axis`; returns false if it does not divide.
    pub(super) fn split_weight(&mut self, v: ValueId, axis: usize, outer: i64, inner: i64) -> bool {
        let Some((init, perm)) = self.weight_src.get(&v).cloned() else { return false };
        if self.replicate.contains(&init) {
            return false;
        }
        let Some(&iaxis) = perm.get(axis) else { return false };
        let s = WeightSplit { axis: iaxis, outer, inner, rep: self.rep(Some(init)) };
        if let Some(prev) = self.weights.get(&init)
            && *prev != s
        {
            return false;
        }
        self.weights.insert(init, s);
        self.weight_src.remove(&init);
        self.sh.insert(init, Sh::Split { axis: iaxis, outer, inner, origin: Some(init) });
        self.sh.insert(v, Sh::Split { axis, outer, inner, origin: Some(init) });
        true
    }

    pub(super) fn is_free_weight(&self, v: ValueId) -> bool {
        self.weight_src.get(&v).is_some_and(|(init, _)| !self.weights.contains_key(init))
    }

    /// Ranks sharing each block of a split made by weight `origin`.
    pub(super) fn rep(&self, origin: Option<ValueId>) -> i64 {
        origin.and_then(|w| self.replicas.get(&w).copied()).unwrap_or(1)
    }

    /// Ways a split made by weight `origin` divides its axis.
    pub(super) fn ways(&self, origin: Option<ValueId>) -> i64 {
        self.t / self.rep(origin)
    }

    /// Column layout for a split of a dim of size `d`: `outer` from the weight's demand.
    pub(super) fn layout(&self, weight: Option<ValueId>, d: i64) -> Option<(i64, i64)> {
        let init = weight.and_then(|w| self.weight_src.get(&w).map(|x| x.0));
        let outer = init.and_then(|w| self.demands.get(&w).copied()).unwrap_or(1);
        let t = self.ways(init);
        (d % (outer * t) == 0 && d > 0).then_some((outer, d / (outer * t)))
    }

    /// Records that entry `pos` of the shape operand `slot` of `node` shrinks by t.
    pub(super) fn shrink_shape_entry(&mut self, node: NodeId, slot: usize, pos: usize, global: i64) -> R<()> {
        self.shrink_shape_entry_by(node, slot, pos, global, self.t)
    }

    /// [`Self::shrink_shape_entry`] by `by` ways.
    pub(super) fn shrink_shape_entry_by(&mut self, node: NodeId, slot: usize, pos: usize, global: i64, by: i64) -> R<()> {
        let n = self.g.node(node);
        let Some(v) = n.inputs.get(slot).copied().flatten() else { return self.err("no shape operand") };
        let Some(vals) = self.ints(v).map(<[i64]>::to_vec) else {
            return self.err(format!("shape operand `{}` is not computable", self.g.value(v).name));
        };
        let Some(&cur) = vals.get(pos) else { return self.err("shape operand too short") };
        if cur == -1 || (cur == 0 && n.op.is(OpKind::Reshape) && n.attrs.int("allowzero", 0) == 0) {
            return Ok(());
        }
        // Expand's entry 1 keeps the input's dim (broadcast), which is already the rank's part:
        // `repeat_kv` written as Expand(Unsqueeze(kv), [1, 1, rep, 1, 1]).
        if cur == 1 && global > 1 && n.op.is(OpKind::Expand) {
            return Ok(());
        }
        if cur != global {
            return self.err(format!("shape entry {pos} is {cur}, expected {global}"));
        }
        let val = self.g.value(v);
        if matches!(val.kind, ValueKind::Constant | ValueKind::Initializer) {
            let mut new_values = vals.clone();
            new_values[pos] = cur / by;
            self.constant_rewrites.push(ConstantRewrite { node: n.name.clone(), input: slot, value: val.name.clone(), new_values });
        } else {
            let mut divisors = vec![1; vals.len()];
            divisors[pos] = by;
            self.rewrites.push(NodeRewrite::DivideShape { node: n.name.clone(), input: slot, divisors });
        }
        Ok(())
    }

    pub(super) fn node(&mut self, id: NodeId) -> R<()> {
        use OpKind::*;
        let n = self.g.node(id);
        let ins: Vec<Option<ValueId>> = n.inputs.clone();
        let outs = n.outputs.clone();
        let inp = |i: usize| ins.get(i).copied().flatten();
        // Weight-like transposes stay undecided until a matmul places them.
        if n.op.is(Transpose)
            && let Some(x) = inp(0)
            && self.is_free_weight(x)
        {
            let (init, perm0) = self.weight_src[&x].clone();
            let r = perm0.len();
            let perm: Vec<usize> = match n.attrs.ints("perm") {
                Some(p) => p.iter().map(|&a| a as usize).collect(),
                None => (0..r).rev().collect(),
            };
            let composed: Vec<usize> = perm.iter().map(|&p| perm0.get(p).copied().unwrap_or(p)).collect();
            self.weight_src.insert(outs[0], (init, composed));
            return Ok(());
        }
        let states: Vec<Sh> = ins.iter().map(|v| v.map_or(Sh::Rep, |v| self.state(v))).collect();
        let opaque = self.s.opaque.get(&id);
        if states.iter().all(|s| *s == Sh::Rep) && (opaque.is_some() || !n.op.kind().is_some_and(|k| family(k).chooses())) {
            // an opaque choosing node keeps its weights whole (the offers give it `replicate` only)
            if opaque.is_some() {
                let weights = n.op.kind().map_or(Vec::new(), |k| family(k).weight_operands(n));
                for w in weights {
                    if let Some((init, _)) = self.weight_src.get(&w) {
                        self.kept_whole.insert(*init);
                    }
                }
            }
            for &o in &outs {
                self.sh.insert(o, Sh::Rep);
            }
            return Ok(());
        }
        if let Some(why) = opaque {
            return self.err(why.to_string());
        }
        let Some(kind) = n.op.kind() else { return self.err("unknown op with a split input") };
        if !tp_rule(kind) {
            return self.err(if matches!(kind, Shape | Size) { "it reads the shape of a split tensor" } else { "no sharding rule for this op" });
        }
        // the rules are in the family files
        match family(kind) {
            Family::Matmul => self.matmul(id),
            Family::Gather => self.gather(id),
            Family::Attention => self.attention(id),
            Family::Experts => self.experts(id),
            Family::Elementwise => match kind {
                Identity | Cast | Neg | Sqrt | Tanh | Erf | Sigmoid | Relu | Gelu | Reciprocal | Exp | Log | Abs | Not | IsNaN | Dropout | Softplus => {
                    self.unary(id, kind)
                }
                _ => self.elementwise(id),
            },
            // the ops `tp_rule` names
            Family::Norm => self.norm(id, kind),
            Family::View => match kind {
                Reshape => self.reshape(id),
                Split => self.split(id),
                Concat => self.concat(id),
                Expand => self.expand(id),
                _ => self.unary(id, kind),
            },
            Family::Shape | Family::Whole => self.err("no sharding rule for this op"),
        }
    }
}
