//! Tensor-parallel sharding of a layer (Megatron-LM's patterns, found by propagation).
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
//! The result is a [`LayerShard`] per tensor rank: names and ranges, never weight data.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::collectives::{CollectiveInsert, CollectiveKind, GroupKind, collective_node, is_collective};
use super::sequence;
use crate::ir::{
    Attr, Attrs, DType, DimBindings, Graph, GraphError, LayeredGraph, Node, NodeId, Op, OpKind, Shape, Storage, Tensor,
    TensorType, ValueId, ValueKind,
};
use crate::passes::PassError;
use crate::passes::shape_infer::{self, ShapeInfo};

/// A slice of an initializer along one axis: the concatenation of `ranges` (start, end).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WeightSlice {
    /// Initializer name.
    pub initializer: String,
    /// Axis sliced.
    pub axis: usize,
    /// Half-open ranges along `axis`, concatenated in order.
    pub ranges: Vec<[u64; 2]>,
    /// Consecutive tensor ranks holding this same slice (grouped-query KV heads when the
    /// tensor degree exceeds the KV heads): ranks `r - r % replicas ..` share it, and its
    /// gradient is summed over them.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replicas: u64,
}

fn one() -> u64 {
    1
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

impl WeightSlice {
    /// Elements along `axis` this slice keeps.
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(|r| r[1].saturating_sub(r[0])).sum()
    }

    /// True if the slice keeps nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A constant operand replaced for one node input (the constant may be shared by other nodes,
/// which keep the original).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConstantRewrite {
    /// The reading node.
    pub node: String,
    /// Its input slot.
    pub input: usize,
    /// The original constant's name.
    pub value: String,
    /// The new integer values (same dtype and dims as the original).
    pub new_values: Vec<i64>,
}

/// A structural change to one node of the layer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "rewrite", rename_all = "snake_case")]
pub enum NodeRewrite {
    /// A Gemm whose output is a partial sum: its bias `C` is added after the all-reduce.
    DeferBias {
        /// The Gemm.
        node: String,
    },
    /// A vocabulary-parallel lookup: indices outside `[start, end)` read row 0 and are zeroed.
    MaskedGather {
        /// The Gather.
        node: String,
        /// First vocabulary row of this rank.
        start: i64,
        /// One past the last.
        end: i64,
    },
    /// A shape operand computed at run time, divided elementwise by `divisors` (a Reshape
    /// target or Expand shape whose split entry shrinks).
    DivideShape {
        /// The reading node.
        node: String,
        /// Its input slot.
        input: usize,
        /// One divisor per element (1 where nothing changes).
        divisors: Vec<i64>,
    },
}

/// A gradient the backward pass must all-reduce over the tensor group (Megatron's *f*): `node`
/// reads the replicated `value` at input slot `input` but produces a split or partial-sum
/// output, so the gradient it sends back to `value` is only this rank's part.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PartialGradient {
    /// The reading node.
    pub node: String,
    /// Its input slot.
    pub input: usize,
    /// The replicated value read there.
    pub value: String,
}

/// What one tensor rank runs of one layer: the plan-file description of its shard.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerShard {
    /// Layer index.
    pub layer: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Tensor rank (0..tp).
    pub rank: usize,
    /// Initializers this rank holds a slice of (all others are replicated).
    pub weight_slices: Vec<WeightSlice>,
    /// Shape constants rewritten for the shard.
    pub constant_rewrites: Vec<ConstantRewrite>,
    /// Structural rewrites.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rewrites: Vec<NodeRewrite>,
    /// Collectives inserted.
    pub collectives: Vec<CollectiveInsert>,
    /// Gradients to all-reduce over the tensor group in the backward pass (forward unchanged).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial_gradients: Vec<PartialGradient>,
}

impl LayerShard {
    /// The unsharded layer (tp = 1): nothing sliced, rewritten or inserted.
    pub fn whole(layer: usize) -> LayerShard {
        LayerShard {
            layer,
            tp: 1,
            rank: 0,
            weight_slices: Vec::new(),
            constant_rewrites: Vec::new(),
            rewrites: Vec::new(),
            collectives: Vec::new(),
            partial_gradients: Vec::new(),
        }
    }
}

/// Errors of sharding; each names the layer, node and op concerned.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// The layer cannot be split this way.
    #[error("layer {layer}: node `{node}` ({op}) cannot be split {tp} ways: {why}")]
    Unsupported {
        /// Layer index.
        layer: usize,
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// Tensor-parallel degree.
        tp: usize,
        /// Why.
        why: String,
    },
    /// A shard names something the graph does not have, or is inconsistent with it.
    #[error("shard of layer {layer}, rank {rank}: {msg}")]
    BadShard {
        /// Layer index.
        layer: usize,
        /// Tensor rank.
        rank: usize,
        /// What is wrong.
        msg: String,
    },
    /// A layer does not divide at the chosen tensor degree and its strategy does not say
    /// replicate.
    #[error(
        "layer {layer} (`{name}`) does not split {tp} ways: {} would stay whole on every tensor rank while the plan prices a split; {}",
        weights.join(", "),
        if working.is_empty() { "no tensor degree up to 64 splits it: plan it with strategy `replicate` or tp = 1".to_string() }
        else { format!("tensor degrees that split it: {}", working.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")) }
    )]
    Indivisible {
        /// Layer index.
        layer: usize,
        /// Layer name.
        name: String,
        /// The tensor degree asked for.
        tp: usize,
        /// Initializers left whole.
        weights: Vec<String>,
        /// Tensor degrees (2..=64) at which the layer splits entirely.
        working: Vec<usize>,
    },
    /// Sequence parallelism cannot split a layer's token axis `tp` ways.
    #[error(
        "layer {layer}: sequence parallelism splits `{value}` along its token axis of length {len}, which does not divide by tp = {tp}; use a sequence length divisible by {tp} or plan without --sequence-parallel"
    )]
    SequenceIndivisible {
        /// Layer index.
        layer: usize,
        /// The reduce-scattered value.
        value: String,
        /// Its token axis length (per outer block).
        len: i64,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// A layer index out of range.
    #[error("layer {layer} does not exist (the graph has {layers} layers)")]
    NoLayer {
        /// Asked for.
        layer: usize,
        /// Number of layers.
        layers: usize,
    },
    /// Shape inference of the shard failed.
    #[error("shape inference of the shard failed: {0}")]
    Pass(#[from] PassError),
    /// The shard graph is malformed.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Placement of a value across the tensor ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sh {
    /// Every rank holds all of it.
    Rep,
    /// Split along `axis` with the `[outer, t, inner]` layout; `origin` is the weight whose
    /// split made it (for layout demands).
    Split { axis: usize, outer: i64, inner: i64, origin: Option<ValueId> },
    /// Each rank holds a partial sum of the full tensor.
    Partial,
}

/// A decided weight split (rank-independent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WeightSplit {
    axis: usize,
    outer: i64,
    inner: i64,
    /// Ranks sharing each block (the split is `t / rep` ways).
    rep: i64,
}

/// Shards layers of one analysed graph; computes the graph's shape information once.
pub struct Sharder<'a> {
    lg: &'a LayeredGraph,
    info: ShapeInfo,
    uses: Vec<Vec<NodeId>>,
    vocab: Option<i64>,
    /// Values that get a gradient: trained weights, float graph inputs, and float values
    /// computed from them.
    grad: Vec<bool>,
    /// Whether row-parallel outputs are reduce-scattered over the tokens (sequence parallelism).
    sequence_parallel: bool,
}

impl<'a> Sharder<'a> {
    /// Prepares to shard the layers of `lg`.
    pub fn new(lg: &'a LayeredGraph) -> Result<Sharder<'a>, CodegenError> {
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
        Ok(Sharder { lg, info, uses, vocab, grad, sequence_parallel: false })
    }

    /// Turns sequence parallelism on or off for the shards this sharder makes (default off):
    /// each row-parallel all-reduce becomes a reduce-scatter over the tokens, token-wise ops
    /// after it run on the rank's tokens, and all-gathers restore whole values where needed.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// The `tp` shards of layer `layer`, rank 0 first. Weights that do not divide `tp` ways
    /// stay whole (see [`Sharder::shard_layer_strict`]).
    pub fn shard_layer(&self, layer: usize, tp: usize) -> Result<Vec<LayerShard>, CodegenError> {
        let plan = self.plan_layer(layer, tp)?;
        Ok((0..tp).map(|r| plan.for_rank(&self.lg.graph, layer, tp, r)).collect())
    }

    /// [`Sharder::shard_layer`], but a layer whose matmul weights or vocabulary table do not
    /// divide `tp` ways is an error naming them and the degrees up to 64 that do divide it.
    pub fn shard_layer_strict(&self, layer: usize, tp: usize) -> Result<Vec<LayerShard>, CodegenError> {
        let plan = self.plan_layer(layer, tp)?;
        if !plan.kept_whole.is_empty() {
            let weights = plan.kept_whole.iter().map(|&w| self.lg.graph.value(w).name.clone()).collect();
            let working = (2..=64).filter(|&t| t != tp && self.plan_layer(layer, t).is_ok_and(|p| p.kept_whole.is_empty())).collect();
            let name = self.lg.layers[layer].name.clone();
            return Err(CodegenError::Indivisible { layer, name, tp, weights, working });
        }
        Ok((0..tp).map(|r| plan.for_rank(&self.lg.graph, layer, tp, r)).collect())
    }

    /// The `tp` shards of `layer` with the weights of the nodes named in `keep_whole`
    /// (matmuls and embedding lookups a plan chose to replicate) left whole, and the strategy
    /// realised per choosing node: `(node, column | row | replicate | vocab | heads)`.
    pub fn shard_layer_keeping(
        &self,
        layer: usize,
        tp: usize,
        keep_whole: &[String],
    ) -> Result<(Vec<LayerShard>, Vec<(String, String)>), CodegenError> {
        let l = self.lg.layers.get(layer).ok_or(CodegenError::NoLayer { layer, layers: self.lg.layers.len() })?;
        let g = &self.lg.graph;
        let mut keep = HashSet::new();
        for &n in &l.nodes {
            let node = g.node(n);
            if !keep_whole.contains(&node.name) {
                continue;
            }
            let operand = match node.op.kind() {
                Some(OpKind::MatMul | OpKind::Gemm) => node.inputs.get(1).copied().flatten(),
                Some(OpKind::Gather) => node.inputs.first().copied().flatten(),
                _ => None,
            };
            if let Some(w) = operand.and_then(|v| self.weight_of(v)) {
                keep.insert(w);
            }
        }
        let plan = self.plan_layer_keeping(layer, tp, keep)?;
        let realised = l.nodes.iter().filter_map(|&n| self.realised(&plan, n).map(|s| (g.node(n).name.clone(), s.to_string()))).collect();
        Ok(((0..tp).map(|r| plan.for_rank(g, layer, tp, r)).collect(), realised))
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
    /// vocab/replicate, matmuls of two activations heads/replicate; `None` for other nodes.
    fn realised(&self, plan: &LayerPlan, n: NodeId) -> Option<&'static str> {
        let g = &self.lg.graph;
        let node = g.node(n);
        let out = *node.outputs.first()?;
        let split = |v: ValueId| matches!(plan.placements.get(&v), Some(Sh::Split { .. }));
        match node.op.kind()? {
            OpKind::MatMul | OpKind::Gemm => match node.inputs.get(1).copied().flatten().and_then(|w| self.weight_of(w)) {
                Some(w) if plan.weights.contains_key(&w) => {
                    let name = &g.value(out).name;
                    let gathered = plan.collectives.iter().any(|c| &c.after_value == name && matches!(c.kind, CollectiveKind::AllGather { .. }));
                    Some(if split(out) || gathered { "column" } else { "row" })
                }
                Some(_) => Some("replicate"),
                None => Some(if split(out) { "heads" } else { "replicate" }),
            },
            OpKind::Gather => {
                let w = node.inputs.first().copied().flatten().and_then(|v| self.weight_of(v))?;
                Some(if plan.weights.contains_key(&w) { "vocab" } else { "replicate" })
            }
            _ => None,
        }
    }

    fn plan_layer(&self, layer: usize, tp: usize) -> Result<LayerPlan, CodegenError> {
        self.plan_layer_keeping(layer, tp, HashSet::new())
    }

    fn plan_layer_keeping(&self, layer: usize, tp: usize, keep: HashSet<ValueId>) -> Result<LayerPlan, CodegenError> {
        let l = self.lg.layers.get(layer).ok_or(CodegenError::NoLayer { layer, layers: self.lg.layers.len() })?;
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
                            CodegenError::Unsupported { layer, node, op, tp, .. } => CodegenError::Unsupported { layer, node, op, tp, why },
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

/// The rank-independent result of propagation.
struct LayerPlan {
    weights: BTreeMap<ValueId, WeightSplit>,
    constant_rewrites: Vec<ConstantRewrite>,
    rewrites: Vec<NodeRewrite>,
    gathers: Vec<(String, ValueId)>,
    collectives: Vec<CollectiveInsert>,
    partial_gradients: Vec<PartialGradient>,
    kept_whole: BTreeSet<ValueId>,
    /// Final placement of the layer's values.
    placements: HashMap<ValueId, Sh>,
}

impl LayerPlan {
    fn for_rank(&self, g: &Graph, layer: usize, tp: usize, rank: usize) -> LayerShard {
        let t = tp as i64;
        let r = rank as i64;
        let weight_slices = self
            .weights
            .iter()
            .map(|(&w, s)| {
                let (t, r) = (t / s.rep, r / s.rep);
                WeightSlice {
                    initializer: g.value(w).name.clone(),
                    axis: s.axis,
                    ranges: (0..s.outer)
                        .map(|o| [((o * t + r) * s.inner) as u64, ((o * t + r + 1) * s.inner) as u64])
                        .collect(),
                    replicas: s.rep as u64,
                }
            })
            .collect();
        let mut rewrites = self.rewrites.clone();
        for (node, table) in &self.gathers {
            let s = self.weights[table];
            rewrites.push(NodeRewrite::MaskedGather { node: node.clone(), start: r * s.inner, end: (r + 1) * s.inner });
        }
        LayerShard {
            layer,
            tp,
            rank,
            weight_slices,
            constant_rewrites: self.constant_rewrites.clone(),
            rewrites,
            collectives: self.collectives.clone(),
            partial_gradients: self.partial_gradients.clone(),
        }
    }
}

enum Fail {
    Demand { weight: ValueId, outer: i64 },
    Replicate { weight: ValueId },
    Replicas { weight: ValueId, rep: i64 },
    Error(CodegenError),
}

impl From<CodegenError> for Fail {
    fn from(e: CodegenError) -> Fail {
        Fail::Error(e)
    }
}

type R<T> = Result<T, Fail>;

struct Prop<'s, 'a> {
    s: &'s Sharder<'a>,
    g: &'a Graph,
    layer: usize,
    nodes: &'s [NodeId],
    in_layer: HashSet<NodeId>,
    t: i64,
    demands: &'s HashMap<ValueId, i64>,
    replicate: &'s HashSet<ValueId>,
    /// Weights whose blocks are shared by this many consecutive ranks.
    replicas: &'s HashMap<ValueId, i64>,
    sh: HashMap<ValueId, Sh>,
    /// Initializers and transposes of them not yet placed: the initializer and the permutation
    /// from this value's axes to the initializer's.
    weight_src: HashMap<ValueId, (ValueId, Vec<usize>)>,
    weights: BTreeMap<ValueId, WeightSplit>,
    constant_rewrites: Vec<ConstantRewrite>,
    rewrites: Vec<NodeRewrite>,
    gathers: Vec<(String, ValueId)>,
    collectives: Vec<CollectiveInsert>,
    partial_gradients: Vec<PartialGradient>,
    /// Matmul weights and vocabulary tables left whole because they do not divide.
    kept_whole: BTreeSet<ValueId>,
    current: Option<NodeId>,
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a.abs() } else { gcd(b, a % b) }
}

fn lcm(a: i64, b: i64) -> i64 {
    a / gcd(a, b) * b
}

fn norm_axis(axis: i64, rank: usize) -> Option<usize> {
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    (a >= 0 && (a as usize) < rank.max(1)).then_some(a as usize)
}

impl<'s, 'a> Prop<'s, 'a> {
    fn new(
        s: &'s Sharder<'a>,
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

    fn finish(self) -> LayerPlan {
        LayerPlan {
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

    fn unsupported_last(&self, why: String) -> CodegenError {
        let (node, op) = self
            .current
            .map(|n| (self.g.node(n).name.clone(), self.g.node(n).op.to_string()))
            .unwrap_or_default();
        CodegenError::Unsupported { layer: self.layer, node, op, tp: self.t as usize, why }
    }

    fn err<T>(&self, why: impl Into<String>) -> R<T> {
        Err(Fail::Error(self.unsupported_last(why.into())))
    }

    fn shape(&self, v: ValueId) -> Option<&[i64]> {
        self.s.info.types[v.index()].as_ref().and_then(|t| t.shape.as_deref())
    }

    fn need_shape(&self, v: ValueId) -> R<Vec<i64>> {
        match self.shape(v) {
            Some(s) => Ok(s.to_vec()),
            None => self.err(format!("the shape of `{}` is unknown", self.g.value(v).name)),
        }
    }

    fn ints(&self, v: ValueId) -> Option<&[i64]> {
        self.s.info.ints(v)
    }

    fn state(&self, v: ValueId) -> Sh {
        self.sh.get(&v).copied().unwrap_or(Sh::Rep)
    }

    fn is_float(&self, v: ValueId) -> bool {
        self.s.info.types[v.index()].as_ref().is_some_and(|t| t.dtype.is_float())
    }

    fn run(&mut self) -> R<()> {
        for &v in self.g.initializers().collect::<Vec<_>>().iter() {
            if self.is_float(v) {
                self.weight_src.insert(v, (v, (0..self.shape(v).map_or(0, <[i64]>::len)).collect()));
            }
        }
        for &n in self.nodes {
            self.current = Some(n);
            // Replicated inputs that get a gradient, and the collectives so far: a node that
            // turns them into a split or partial output sends back a partial gradient.
            let rep_inputs: Vec<(usize, ValueId)> = self
                .g
                .node(n)
                .inputs
                .iter()
                .enumerate()
                .filter_map(|(slot, v)| v.map(|v| (slot, v)))
                .filter(|&(_, v)| self.s.grad[v.index()] && self.state(v) == Sh::Rep && !self.weight_src.contains_key(&v))
                .collect();
            let collectives_before = self.collectives.len();
            match self.node(n) {
                Ok(()) => {
                    let node = self.g.node(n);
                    let reduced = |o: ValueId| {
                        let name = &self.g.value(o).name;
                        self.collectives[collectives_before..].iter().any(|c| &c.after_value == name && c.kind == CollectiveKind::AllReduce)
                    };
                    let split_out = node.outputs.iter().any(|&o| matches!(self.state(o), Sh::Split { .. } | Sh::Partial) || reduced(o));
                    if split_out {
                        for (slot, v) in rep_inputs {
                            if self.state(v) == Sh::Rep && !self.g.value(v).kind.eq(&ValueKind::Initializer) {
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
                    self.collectives.push(CollectiveInsert::after(self.g.value(v).name.clone(), CollectiveKind::AllGather { axis }, GroupKind::Tensor));
                    self.sh.insert(v, Sh::Rep);
                }
            }
        }
        Ok(())
    }

    fn layer_outputs(&self) -> Vec<ValueId> {
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

    fn reduce(&mut self, v: ValueId) {
        self.collectives.push(CollectiveInsert::after(self.g.value(v).name.clone(), CollectiveKind::AllReduce, GroupKind::Tensor));
        self.sh.insert(v, Sh::Rep);
    }

    /// A partial output stays partial only while views read it; otherwise it is reduced now.
    fn settle_partial(&mut self, v: ValueId) {
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

    fn set(&mut self, v: ValueId, s: Sh) {
        self.sh.insert(v, s);
        if s == Sh::Partial {
            self.settle_partial(v);
        }
    }

    /// Decides the split of a weight-like value (an initializer or a transpose of one) along
    /// its `axis`; returns false if it does not divide.
    fn split_weight(&mut self, v: ValueId, axis: usize, outer: i64, inner: i64) -> bool {
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

    fn is_free_weight(&self, v: ValueId) -> bool {
        self.weight_src.get(&v).is_some_and(|(init, _)| !self.weights.contains_key(init))
    }

    /// Ranks sharing each block of a split made by weight `origin`.
    fn rep(&self, origin: Option<ValueId>) -> i64 {
        origin.and_then(|w| self.replicas.get(&w).copied()).unwrap_or(1)
    }

    /// Ways a split made by weight `origin` divides its axis.
    fn ways(&self, origin: Option<ValueId>) -> i64 {
        self.t / self.rep(origin)
    }

    /// Column layout for a split of a dim of size `d`: `outer` from the weight's demand.
    fn layout(&self, weight: Option<ValueId>, d: i64) -> Option<(i64, i64)> {
        let init = weight.and_then(|w| self.weight_src.get(&w).map(|x| x.0));
        let outer = init.and_then(|w| self.demands.get(&w).copied()).unwrap_or(1);
        let t = self.ways(init);
        (d % (outer * t) == 0 && d > 0).then_some((outer, d / (outer * t)))
    }

    /// Records that entry `pos` of the shape operand `slot` of `node` shrinks by t.
    fn shrink_shape_entry(&mut self, node: NodeId, slot: usize, pos: usize, global: i64) -> R<()> {
        self.shrink_shape_entry_by(node, slot, pos, global, self.t)
    }

    /// [`Self::shrink_shape_entry`] by `by` ways.
    fn shrink_shape_entry_by(&mut self, node: NodeId, slot: usize, pos: usize, global: i64, by: i64) -> R<()> {
        let n = self.g.node(node);
        let Some(v) = n.inputs.get(slot).copied().flatten() else { return self.err("no shape operand") };
        let Some(vals) = self.ints(v).map(<[i64]>::to_vec) else {
            return self.err(format!("shape operand `{}` is not computable", self.g.value(v).name));
        };
        let Some(&cur) = vals.get(pos) else { return self.err("shape operand too short") };
        if cur == -1 || (cur == 0 && n.op.is(OpKind::Reshape) && n.attrs.int("allowzero", 0) == 0) {
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

    fn node(&mut self, id: NodeId) -> R<()> {
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
        if states.iter().all(|s| *s == Sh::Rep) && !matches!(n.op.kind(), Some(MatMul | Gemm | Gather)) {
            for &o in &outs {
                self.sh.insert(o, Sh::Rep);
            }
            return Ok(());
        }
        if is_collective(&n.op) {
            return self.err("already holds a collective");
        }
        let Some(kind) = n.op.kind() else { return self.err("unknown op with a split input") };
        match kind {
            MatMul | Gemm => self.matmul(id),
            Gather => self.gather(id),
            Reshape => {
                let (x, o) = (inp(0).unwrap_or(outs[0]), outs[0]);
                match self.state(x) {
                    Sh::Partial => {
                        self.set(o, Sh::Partial);
                        Ok(())
                    }
                    Sh::Split { axis, inner, origin, .. } => {
                        let is = self.need_shape(x)?;
                        let os = self.need_shape(o)?;
                        let s_in: i64 = is[axis + 1..].iter().product();
                        let ways = self.ways(origin);
                        let find = |digit: i64, ways: i64| {
                            (0..os.len()).find_map(|k| {
                                let sk: i64 = os[k + 1..].iter().product();
                                (os[k] > 1 && digit % sk == 0 && (sk * os[k]) % (digit * ways) == 0)
                                    .then(|| (k, digit / sk, os[k] * sk / (digit * ways)))
                            })
                        };
                        let Some((k, inner_k, outer_k)) = find(s_in * inner, ways) else {
                            // Fewer whole heads than ways (grouped-query KV heads): let `rep`
                            // ranks share each head, if that makes it survive.
                            if let Some(w) = origin
                                && self.rep(origin) == 1
                                && let Some(rep) = (2..=self.t).find(|&rep| self.t % rep == 0 && find(s_in * inner * rep, self.t / rep).is_some())
                            {
                                return Err(Fail::Replicas { weight: w, rep });
                            }
                            return self.err("the split axis does not survive the reshape");
                        };
                        self.shrink_shape_entry_by(id, 1, k, os[k], ways)?;
                        self.set(o, Sh::Split { axis: k, outer: outer_k, inner: inner_k, origin });
                        Ok(())
                    }
                    Sh::Rep => {
                        self.sh.insert(o, Sh::Rep);
                        Ok(())
                    }
                }
            }
            Transpose | Squeeze | Unsqueeze | Identity | Cast | Neg | Sqrt | Tanh | Erf | Sigmoid | Relu | Gelu
            | Reciprocal | Exp | Log | Abs | Not | IsNaN | Dropout | Softplus => {
                let x = inp(0).unwrap_or(outs[0]);
                let s = self.state(x);
                let out = match s {
                    Sh::Partial if matches!(kind, Transpose | Squeeze | Unsqueeze | Identity | Neg) => Sh::Partial,
                    Sh::Partial => return self.err("a partial sum reaches a nonlinear op"),
                    Sh::Rep => Sh::Rep,
                    Sh::Split { axis, outer, inner, origin } => {
                        let axis = self.map_axis(id, kind, axis)?;
                        Sh::Split { axis, outer, inner, origin }
                    }
                };
                for &o in &outs {
                    self.set(o, out);
                }
                Ok(())
            }
            Split => self.split(id),
            Softmax | LogSoftmax | LayerNormalization | ReduceMean | ReduceSum | ReduceMax | CumSum | Slice => {
                let x = inp(0).unwrap_or(outs[0]);
                let Sh::Split { axis, outer, inner, origin } = self.state(x) else {
                    return self.err("a partial sum reaches a normalisation");
                };
                let rank = self.need_shape(x)?.len();
                let touched: Vec<usize> = match kind {
                    Softmax | LogSoftmax => vec![norm_axis(n.attrs.int("axis", -1), rank).unwrap_or(rank)],
                    LayerNormalization => {
                        let a = norm_axis(n.attrs.int("axis", -1), rank).unwrap_or(0);
                        (a..rank).collect()
                    }
                    CumSum => inp(1).and_then(|v| self.ints(v)).map(|a| a.iter().filter_map(|&a| norm_axis(a, rank)).collect()).unwrap_or_default(),
                    Slice => {
                        let starts = inp(1).and_then(|v| self.ints(v)).map_or(0, <[i64]>::len);
                        match inp(3).and_then(|v| self.ints(v)) {
                            Some(a) => a.iter().filter_map(|&a| norm_axis(a, rank)).collect(),
                            None => (0..starts).collect(),
                        }
                    }
                    _ => {
                        let axes: Vec<i64> = inp(1).and_then(|v| self.ints(v)).map(<[i64]>::to_vec).or_else(|| n.attrs.ints("axes").map(<[i64]>::to_vec)).unwrap_or_default();
                        if axes.is_empty() { (0..rank).collect() } else { axes.iter().filter_map(|&a| norm_axis(a, rank)).collect() }
                    }
                };
                if touched.contains(&axis) {
                    return self.err(format!("it works along the split axis {axis}"));
                }
                if kind == LayerNormalization {
                    for (i, s) in states.iter().enumerate().skip(1) {
                        if *s != Sh::Rep || inp(i).is_some_and(|v| self.weights.contains_key(&v)) {
                            return self.err("split norm weights");
                        }
                    }
                }
                let keep = !matches!(kind, ReduceMean | ReduceSum | ReduceMax) || n.attrs.int("keepdims", 1) == 1;
                let axis = if keep { axis } else { axis - touched.iter().filter(|&&a| a < axis).count() };
                self.set(outs[0], Sh::Split { axis, outer, inner, origin });
                for &o in &outs[1..] {
                    self.sh.insert(o, Sh::Split { axis, outer, inner, origin });
                }
                Ok(())
            }
            Concat => {
                let o = outs[0];
                let rank = self.need_shape(o)?.len();
                let cat = norm_axis(n.attrs.int("axis", 0), rank).unwrap_or(0);
                let first = states[0];
                if states.iter().any(|s| *s != first) {
                    return self.err("inputs are placed differently");
                }
                if let Sh::Split { axis, .. } = first
                    && axis == cat
                {
                    return self.err("it concatenates along the split axis");
                }
                self.set(o, first);
                Ok(())
            }
            Expand => {
                let (x, o) = (inp(0).unwrap_or(outs[0]), outs[0]);
                match self.state(x) {
                    Sh::Split { axis, outer, inner, origin } => {
                        let xr = self.need_shape(x)?.len();
                        let os = self.need_shape(o)?;
                        let oaxis = axis + os.len() - xr;
                        let slen = inp(1).and_then(|v| self.ints(v)).map_or(0, <[i64]>::len);
                        let rep = self.rep(origin);
                        if rep > 1 {
                            return self.expand_shared_heads(id, oaxis, outer, inner, rep, origin);
                        }
                        if slen + oaxis >= os.len() {
                            let pos = slen + oaxis - os.len();
                            self.shrink_shape_entry(id, 1, pos, os[oaxis])?;
                        }
                        self.set(o, Sh::Split { axis: oaxis, outer, inner, origin });
                        Ok(())
                    }
                    _ => self.err("a partial sum reaches Expand"),
                }
            }
            Shape | Size => self.err("it reads the shape of a split tensor"),
            k if k.is_elementwise() => self.elementwise(id),
            _ => self.err("no sharding rule for this op"),
        }
    }

    /// Grouped-query attention's `repeat_kv` when `rep` ranks share each KV head: the Expand
    /// that repeats each head `n` times along `oaxis + 1` keeps `n / rep` copies per rank, and
    /// the Reshape that merges the two axes into query heads then holds this rank's query heads
    /// (a plain `t`-way split of the merged axis).
    fn expand_shared_heads(&mut self, id: NodeId, oaxis: usize, outer: i64, inner: i64, rep: i64, origin: Option<ValueId>) -> R<()> {
        let n = self.g.node(id);
        let (Some(x), o) = (n.inputs.first().copied().flatten(), n.outputs[0]) else { return self.err("missing operand") };
        let xs = self.need_shape(x)?;
        let os = self.need_shape(o)?;
        let iaxis = oaxis + xs.len() - os.len();
        let slen = n.inputs.get(1).copied().flatten().and_then(|v| self.ints(v)).map_or(0, <[i64]>::len);
        let reshaped_only = self.s.uses[o.index()]
            .iter()
            .all(|&u| self.in_layer.contains(&u) && self.g.node(u).op.is(OpKind::Reshape) && self.g.node(u).inputs.first().copied().flatten() == Some(o));
        let copies = os.get(oaxis + 1).copied().unwrap_or(0);
        let fits = outer == 1
            && inner == 1
            && xs.get(iaxis + 1) == Some(&1)
            && copies % rep == 0
            && slen + oaxis >= os.len()
            && reshaped_only
            && !self.g.outputs.contains(&o);
        if !fits {
            return match origin {
                Some(weight) => Err(Fail::Replicate { weight }),
                None => self.err("a head shared by several ranks is expanded other than by repeat_kv"),
            };
        }
        let pos = slen + oaxis - os.len();
        self.shrink_shape_entry_by(id, 1, pos, os[oaxis], self.t / rep)?;
        self.shrink_shape_entry_by(id, 1, pos + 1, copies, rep)?;
        self.set(o, Sh::Split { axis: oaxis + 1, outer: 1, inner: copies / rep, origin: None });
        Ok(())
    }

    /// The output axis of a unary-shaped op for input split axis `axis`.
    fn map_axis(&self, id: NodeId, kind: OpKind, axis: usize) -> R<usize> {
        let n = self.g.node(id);
        let x = n.inputs[0].unwrap_or(n.outputs[0]);
        let xr = self.need_shape(x)?.len();
        let orank = self.need_shape(n.outputs[0])?.len();
        let axes = || -> Vec<i64> {
            n.inputs.get(1).copied().flatten().and_then(|v| self.ints(v)).map(<[i64]>::to_vec).or_else(|| n.attrs.ints("axes").map(<[i64]>::to_vec)).unwrap_or_default()
        };
        Ok(match kind {
            OpKind::Transpose => {
                let perm: Vec<usize> = match n.attrs.ints("perm") {
                    Some(p) => p.iter().map(|&a| a as usize).collect(),
                    None => (0..xr).rev().collect(),
                };
                match perm.iter().position(|&p| p == axis) {
                    Some(a) => a,
                    None => return self.err("bad perm"),
                }
            }
            OpKind::Unsqueeze => {
                let mut ax: Vec<usize> = axes().iter().filter_map(|&a| norm_axis(a, orank)).collect();
                ax.sort_unstable();
                let mut a = axis;
                for &u in &ax {
                    if u <= a {
                        a += 1;
                    }
                }
                a
            }
            OpKind::Squeeze => {
                let ax: Vec<usize> = axes().iter().filter_map(|&a| norm_axis(a, xr)).collect();
                if ax.contains(&axis) {
                    return self.err("it squeezes the split axis");
                }
                axis - ax.iter().filter(|&&a| a < axis).count()
            }
            _ => axis,
        })
    }

    fn split(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let x = n.inputs[0].unwrap_or(n.outputs[0]);
        let outs = n.outputs.clone();
        let xs = self.need_shape(x)?;
        let ax = norm_axis(n.attrs.int("axis", 0), xs.len()).unwrap_or(0);
        match self.state(x) {
            Sh::Partial => {
                for &o in &outs {
                    self.set(o, Sh::Partial);
                }
                Ok(())
            }
            Sh::Split { axis, outer, inner, origin } if axis != ax => {
                for &o in &outs {
                    self.set(o, Sh::Split { axis, outer, inner, origin });
                }
                Ok(())
            }
            Sh::Split { outer, inner, origin, .. } => {
                let d = xs[ax];
                let sizes: Vec<i64> = outs.iter().map(|&o| self.shape(o).map_or(0, |s| s[ax])).collect();
                let block = self.ways(origin) * inner;
                if sizes.iter().any(|&s| s % block != 0) {
                    let mut g = d;
                    let mut acc = 0;
                    for s in &sizes {
                        acc += s;
                        g = gcd(g, acc);
                    }
                    let need = lcm(outer, d / g.max(1));
                    return match origin {
                        Some(w) if need != outer && d % (need * self.ways(origin)) == 0 => Err(Fail::Demand { weight: w, outer: need }),
                        _ => self.err("the split sizes cut through a rank's block"),
                    };
                }
                if let Some(sv) = n.inputs.get(1).copied().flatten() {
                    let val = self.g.value(sv);
                    let Some(vals) = self.ints(sv).map(<[i64]>::to_vec) else {
                        return self.err("split sizes are not computable");
                    };
                    let ways = self.ways(origin);
                    let new_values: Vec<i64> = vals.iter().map(|v| v / ways).collect();
                    if matches!(val.kind, ValueKind::Constant | ValueKind::Initializer) {
                        self.constant_rewrites.push(ConstantRewrite { node: n.name.clone(), input: 1, value: val.name.clone(), new_values });
                    } else {
                        self.rewrites.push(NodeRewrite::DivideShape { node: n.name.clone(), input: 1, divisors: vec![ways; vals.len()] });
                    }
                } else if n.attrs.ints("split").is_some() {
                    return self.err("split sizes as an attribute (opset < 13)");
                }
                for (&o, &s) in outs.iter().zip(&sizes) {
                    self.set(o, Sh::Split { axis: ax, outer: s / block, inner, origin });
                }
                Ok(())
            }
            Sh::Rep => Ok(()),
        }
    }

    fn elementwise(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let o = n.outputs[0];
        let kind = n.op.kind();
        let os = self.need_shape(o)?;
        let ins: Vec<Option<ValueId>> = n.inputs.clone();
        let mut split: Option<(usize, i64, i64, Option<ValueId>)> = None;
        let mut partial = 0;
        for v in ins.iter().flatten() {
            match self.state(*v) {
                Sh::Partial => partial += 1,
                Sh::Split { axis, outer, inner, origin } => {
                    let r = self.need_shape(*v)?.len();
                    let oa = axis + os.len() - r;
                    match split {
                        Some((a, ou, inn, o2)) if (a, ou, inn, self.rep(o2)) != (oa, outer, inner, self.rep(origin)) => {
                            return self.err("inputs are split differently");
                        }
                        _ => split = Some((oa, outer, inner, origin.or(split.and_then(|s| s.3)))),
                    }
                }
                Sh::Rep => {}
            }
        }
        if partial > 0 {
            // Linear uses of partial sums: sums of partials, scaling by a replicated value.
            let all_partial_float = ins.iter().flatten().all(|v| self.state(*v) == Sh::Partial || !self.is_float(*v));
            let ok = match kind {
                Some(OpKind::Add | OpKind::Sub) => all_partial_float && split.is_none(),
                Some(OpKind::Mul) => partial == 1 && split.is_none(),
                Some(OpKind::Div) => ins.first().copied().flatten().is_some_and(|v| self.state(v) == Sh::Partial) && partial == 1 && split.is_none(),
                _ => false,
            };
            if !ok {
                return self.err("a partial sum is combined non-linearly");
            }
            self.set(o, Sh::Partial);
            return Ok(());
        }
        let Some((axis, outer, inner, origin)) = split else {
            self.sh.insert(o, Sh::Rep);
            return Ok(());
        };
        for v in ins.iter().flatten().copied() {
            if self.state(v) != Sh::Rep {
                continue;
            }
            let vs = self.need_shape(v)?;
            let off = os.len() - vs.len();
            if axis < off || vs[axis - off] == 1 {
                continue;
            }
            // A replicated full-size operand: slice it if it is a weight.
            if !(self.is_free_weight(v) && self.split_weight(v, axis - off, outer, inner)) {
                return self.err(format!("replicated operand `{}` would need slicing", self.g.value(v).name));
            }
        }
        self.sh.insert(o, Sh::Split { axis, outer, inner, origin });
        Ok(())
    }

    fn matmul(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let gemm = n.op.is(OpKind::Gemm);
        let (Some(a), Some(b)) = (n.inputs.first().copied().flatten(), n.inputs.get(1).copied().flatten()) else {
            return self.err("missing operand");
        };
        let c = n.inputs.get(2).copied().flatten();
        let o = n.outputs[0];
        let (ta, tb) = if gemm { (n.attrs.int("transA", 0) != 0, n.attrs.int("transB", 0) != 0) } else { (false, false) };
        let ash = self.need_shape(a)?;
        let bsh = self.need_shape(b)?;
        let osh = self.need_shape(o)?;
        let (ra, rb, ro) = (ash.len(), bsh.len(), osh.len());
        if ra < 2 || rb < 2 {
            return self.err("vector matmul");
        }
        // Positions of k and n in B, and k/m in A.
        let (bk, bn) = if tb { (rb - 1, rb - 2) } else { (rb - 2, rb - 1) };
        let (am, ak) = if ta { (ra - 1, ra - 2) } else { (ra - 2, ra - 1) };
        let sa = self.state(a);
        let out: Sh;
        if self.is_free_weight(b) && rb == 2 && !self.is_free_weight(a) {
            match sa {
                Sh::Rep => {
                    let nd = bsh[bn];
                    out = match self.layout(Some(b), nd) {
                        Some((outer, inner)) if self.split_weight(b, bn, outer, inner) => {
                            Sh::Split { axis: ro - 1, outer, inner, origin: self.init_of(b) }
                        }
                        _ => {
                            if let Some((init, _)) = self.weight_src.get(&b) {
                                self.kept_whole.insert(*init);
                            }
                            Sh::Rep
                        }
                    };
                }
                Sh::Split { axis, outer, inner, origin } if axis == ak => {
                    if let Some(w) = origin
                        && self.rep(origin) > 1
                    {
                        return Err(Fail::Replicate { weight: w });
                    }
                    if !self.split_weight(b, bk, outer, inner) {
                        return self.err("the weight cannot be split by rows");
                    }
                    out = Sh::Partial;
                }
                Sh::Split { axis, outer, inner, origin } if axis != ak && !ta => {
                    out = Sh::Split { axis: axis + ro - ra, outer, inner, origin };
                }
                Sh::Partial => return self.err("partial input"),
                _ => return self.err("transposed split input"),
            }
        } else {
            let sb = self.state(b);
            out = match (sa, sb) {
                (Sh::Rep, Sh::Rep) => Sh::Rep,
                (Sh::Split { axis: x, outer: o1, inner: i1, origin }, Sh::Split { axis: y, outer: o2, inner: i2, origin: origin2 })
                    if !ta && !tb && (o1, i1, self.rep(origin)) == (o2, i2, self.rep(origin2)) =>
                {
                    if x + 2 < ra + 0 && y + 2 < rb && ra - x == rb - y {
                        Sh::Split { axis: x + ro - ra, outer: o1, inner: i1, origin }
                    } else if x == ak && y == bk {
                        Sh::Partial
                    } else {
                        return self.err("operands split on incompatible axes");
                    }
                }
                (Sh::Split { axis: x, outer, inner, origin }, Sh::Rep) if !ta => {
                    if x == am {
                        Sh::Split { axis: ro - 2, outer, inner, origin }
                    } else if x + 2 < ra && (rb < ra - x || bsh[x + rb - ra] == 1) {
                        Sh::Split { axis: x + ro - ra, outer, inner, origin }
                    } else {
                        return self.err("split operand against a replicated one");
                    }
                }
                (Sh::Rep, Sh::Split { axis: y, outer, inner, origin }) if !tb => {
                    if y == bn {
                        Sh::Split { axis: ro - 1, outer, inner, origin }
                    } else if y + 2 < rb && (ra < rb - y || ash[y + ra - rb] == 1) {
                        Sh::Split { axis: y + ro - rb, outer, inner, origin }
                    } else {
                        return self.err("replicated operand against a split one");
                    }
                }
                _ => return self.err("unsupported operand placements"),
            };
        }
        // Gemm bias.
        if let Some(c) = c {
            match out {
                Sh::Split { axis, outer, inner, .. } => {
                    let cs = self.need_shape(c)?;
                    let off = ro - cs.len();
                    if axis >= off && cs[axis - off] > 1 && !(self.is_free_weight(c) && self.split_weight(c, axis - off, outer, inner)) {
                        return self.err("the bias cannot be split");
                    }
                }
                Sh::Partial => {
                    self.rewrites.push(NodeRewrite::DeferBias { node: n.name.clone() });
                    self.reduce(o);
                    return Ok(());
                }
                Sh::Rep => {}
            }
        }
        self.set(o, out);
        Ok(())
    }

    fn init_of(&self, v: ValueId) -> Option<ValueId> {
        match self.state(v) {
            Sh::Split { origin, .. } => origin,
            _ => None,
        }
    }

    fn gather(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let (Some(data), Some(idx)) = (n.inputs.first().copied().flatten(), n.inputs.get(1).copied().flatten()) else {
            return self.err("missing operand");
        };
        let o = n.outputs[0];
        let axis = n.attrs.int("axis", 0);
        let ds = self.need_shape(data)?;
        if self.state(idx) != Sh::Rep {
            return self.err("split indices");
        }
        if self.is_free_weight(data)
            && axis == 0
            && ds.len() == 2
            && Some(ds[0]) == self.s.vocab
            && ds[0] % self.t == 0
            && self.weight_src.get(&data).is_some_and(|(i, _)| *i == data)
            && self.split_weight(data, 0, 1, ds[0] / self.t)
        {
            self.gathers.push((n.name.clone(), data));
            self.set(o, Sh::Partial);
            return Ok(());
        }
        if self.is_free_weight(data) && axis == 0 && ds.len() == 2 && Some(ds[0]) == self.s.vocab {
            self.kept_whole.insert(data);
        }
        match self.state(data) {
            Sh::Rep => {
                self.sh.insert(o, Sh::Rep);
                Ok(())
            }
            Sh::Split { axis: sa, outer, inner, origin } if sa as i64 != axis && axis == 0 => {
                let ir = self.need_shape(idx)?.len();
                self.set(o, Sh::Split { axis: sa + ir - 1, outer, inner, origin });
                Ok(())
            }
            _ => self.err("gather from a split table"),
        }
    }
}

impl Prop<'_, '_> {
    /// Sequence parallelism over the finished tensor-parallel placement (see
    /// [`super::sequence`]).
    fn sequence_parallel(&mut self) -> R<()> {
        let candidates: Vec<ValueId> = self
            .collectives
            .iter()
            .filter(|c| c.kind == CollectiveKind::AllReduce && c.readers.is_empty())
            .filter_map(|c| self.g.value_by_name(&c.after_value))
            .filter(|&v| {
                self.g.value(v).producer.is_some_and(|p| self.in_layer.contains(&p) && matches!(self.g.node(p).op.kind(), Some(OpKind::MatMul | OpKind::Gemm)))
            })
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let sh = &self.sh;
        let tp_rep = |v: ValueId| sh.get(&v).is_none_or(|s| *s == Sh::Rep);
        let layer = sequence::SeqLayer {
            g: self.g,
            info: &self.s.info,
            uses: &self.s.uses,
            grad: &self.s.grad,
            nodes: self.nodes,
            in_layer: &self.in_layer,
            layer: self.layer,
            t: self.t,
        };
        let plan = sequence::plan(&layer, &tp_rep, &candidates)?;
        for (v, axis, view) in plan.reduce_scatter {
            let name = self.g.value(v).name.clone();
            if let Some(c) = self.collectives.iter_mut().find(|c| c.after_value == name && c.readers.is_empty()) {
                c.kind = CollectiveKind::ReduceScatter { axis };
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

/// The node adding a deferred Gemm bias after the collective.
fn add_bias_name(gemm: &str) -> String {
    format!("{gemm}.add_bias")
}

/// The `tp` shards of every layer of `lg` (index: layer, then rank).
pub fn shard_all(lg: &LayeredGraph, tp: usize) -> Result<Vec<Vec<LayerShard>>, CodegenError> {
    let s = Sharder::new(lg)?;
    (0..lg.layers.len()).map(|l| s.shard_layer(l, tp)).collect()
}

/// The values a node set reads from outside and produces for outside (graph outputs included).
pub fn layer_boundary(graph: &Graph, nodes: &[NodeId]) -> (Vec<ValueId>, Vec<ValueId>) {
    let set: HashSet<NodeId> = nodes.iter().copied().collect();
    let uses = graph.uses();
    let mut inputs = Vec::new();
    let mut seen = HashSet::new();
    let mut outputs = Vec::new();
    for &n in nodes {
        let node = graph.node(n);
        for v in node.inputs.iter().flatten() {
            let val = graph.value(*v);
            let outside = val.producer.is_none_or(|p| !set.contains(&p));
            if outside && val.kind == ValueKind::Intermediate || val.kind == ValueKind::Input {
                if seen.insert(*v) {
                    inputs.push(*v);
                }
            }
        }
        for &o in &node.outputs {
            if graph.outputs.contains(&o) || uses[o.index()].iter().any(|u| !set.contains(u)) {
                outputs.push(o);
            }
        }
    }
    (inputs, outputs)
}

/// Slices `t` along `axis` to the concatenation of `ranges` (inline data only).
pub fn slice_tensor(t: &Tensor, axis: usize, ranges: &[[u64; 2]]) -> Option<Tensor> {
    let dims = &t.dims;
    if axis >= dims.len() {
        return None;
    }
    let len: u64 = ranges.iter().map(|r| r[1] - r[0]).sum();
    let mut new_dims = dims.clone();
    new_dims[axis] = len as i64;
    let size = t.dtype.size_bytes() as usize;
    let raw = t.raw()?;
    let outer: usize = dims[..axis].iter().map(|&d| d as usize).product();
    let inner: usize = dims[axis + 1..].iter().map(|&d| d as usize).product::<usize>() * size;
    let d = dims[axis] as usize;
    let mut out = Vec::with_capacity(outer * len as usize * inner);
    for o in 0..outer {
        for r in ranges {
            let (s, e) = (r[0] as usize, r[1] as usize);
            if e > d || s > e {
                return None;
            }
            out.extend_from_slice(raw.get((o * d + s) * inner..(o * d + e) * inner)?);
        }
    }
    Some(Tensor { dtype: t.dtype, dims: new_dims, storage: Storage::Raw(out.into()) })
}

fn scalar_const(g: &mut Graph, name: String, dtype: DType, v: i64) -> Result<ValueId, GraphError> {
    let size = dtype.size_bytes() as usize;
    let bytes: Vec<u8> = if dtype.is_float() { vec![0; size] } else { v.to_le_bytes()[..size.min(8)].to_vec() };
    let t = Tensor { dtype, dims: vec![], storage: Storage::Raw(bytes.into()) };
    g.add_value(name, ValueKind::Constant, Some(TensorType { dtype, shape: Some(Shape(vec![])) }), Some(t))
}

fn i64_const(g: &mut Graph, name: String, vals: &[i64]) -> Result<ValueId, GraphError> {
    let t = Tensor::from_i64(vec![vals.len() as i64], vals);
    g.add_value(name, ValueKind::Constant, Some(TensorType { dtype: DType::I64, shape: Some(Shape::from_known(&[vals.len() as i64])) }), Some(t))
}

/// Builds the rank's subgraph of a layer: weights sliced, constants rewritten, rewrites
/// applied, collectives inserted as `smp` placeholder nodes; shape-inferred and verified.
///
/// Integer inputs the shard needs for its shapes (shape arithmetic that depends on the batch
/// or sequence, computed by an earlier layer) stay inputs; inference evaluates them at the
/// bound dims.
pub fn apply_shard(graph: &Graph, layer_nodes: &[NodeId], shard: &LayerShard, dims: &DimBindings) -> Result<Graph, CodegenError> {
    let info = shape_infer::infer(graph, &dims.values, false)?;
    apply_shard_with(graph, &info, layer_nodes, shard, dims)
}

impl Sharder<'_> {
    /// [`apply_shard`] for a layer of this sharder's graph (reuses its shape information).
    pub fn apply(&self, layer: usize, shard: &LayerShard) -> Result<Graph, CodegenError> {
        let l = self.lg.layers.get(layer).ok_or(CodegenError::NoLayer { layer, layers: self.lg.layers.len() })?;
        apply_shard_with(&self.lg.graph, &self.info, &l.nodes, shard, &self.lg.dims)
    }
}

fn apply_shard_with(graph: &Graph, info: &ShapeInfo, layer_nodes: &[NodeId], shard: &LayerShard, dims: &DimBindings) -> Result<Graph, CodegenError> {
    let bad = |msg: String| CodegenError::BadShard { layer: shard.layer, rank: shard.rank, msg };
    let mut g = Graph::new(format!("{}.layer{}.tp{}", graph.name, shard.layer, shard.rank));
    g.opsets = graph.opsets.clone();
    let (inputs, outputs) = layer_boundary(graph, layer_nodes);
    let slices: HashMap<&str, &WeightSlice> = shard.weight_slices.iter().map(|s| (s.initializer.as_str(), s)).collect();
    let collect: HashMap<&str, &CollectiveInsert> =
        shard.collectives.iter().filter(|c| c.readers.is_empty()).map(|c| (c.after_value.as_str(), c)).collect();
    // collectives read only at some node inputs: (node, slot) → index into `shard.collectives`
    let mut scoped_at: HashMap<(&str, usize), usize> = HashMap::new();
    for (i, c) in shard.collectives.iter().enumerate() {
        for r in &c.readers {
            if scoped_at.insert((r.node.as_str(), r.input), i).is_some() {
                return Err(bad(format!("input {} of node `{}` is read through two collectives", r.input, r.node)));
            }
        }
    }
    let mut scoped_out: HashMap<usize, ValueId> = HashMap::new();
    let full_shape = |v: ValueId| info.types[v.index()].as_ref().and_then(|t| t.shape.clone());
    let dtype_of = |v: ValueId| info.types[v.index()].as_ref().map_or(DType::F32, |t| t.dtype);
    let mut map: HashMap<ValueId, ValueId> = HashMap::new();
    for s in &shard.weight_slices {
        if graph.value_by_name(&s.initializer).is_none() {
            return Err(bad(format!("weight slice names `{}`, which the model does not have", s.initializer)));
        }
    }
    // Values from outside the layer.
    let copy = |g: &mut Graph, map: &mut HashMap<ValueId, ValueId>, v: ValueId| -> Result<ValueId, CodegenError> {
        if let Some(&m) = map.get(&v) {
            return Ok(m);
        }
        let val = graph.value(v);
        let (kind, mut ty, mut data) = match val.kind {
            ValueKind::Initializer | ValueKind::Constant => (val.kind, val.ty.clone(), val.data.clone()),
            _ => (ValueKind::Input, val.ty.clone(), None),
        };
        if let Some(s) = slices.get(val.name.as_str()) {
            let shape = ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(Shape::known).or_else(|| data.as_ref().map(|d| d.dims.clone()));
            let Some(mut shape) = shape else { return Err(bad(format!("`{}` has no known shape", val.name))) };
            if s.axis >= shape.len() || s.ranges.iter().any(|r| r[0] > r[1] || r[1] > shape[s.axis] as u64) {
                return Err(bad(format!("slice of `{}` along axis {} is out of range for shape {shape:?}", val.name, s.axis)));
            }
            shape[s.axis] = s.len() as i64;
            if let Some(d) = &data
                && let Storage::Raw(_) = d.storage
            {
                data = Some(slice_tensor(d, s.axis, &s.ranges).ok_or_else(|| bad(format!("cannot slice `{}`", val.name)))?);
            } else if data.is_some() {
                data = None;
            }
            let dtype = ty.as_ref().map(|t| t.dtype).or(data.as_ref().map(|d| d.dtype)).unwrap_or(DType::F32);
            ty = Some(TensorType { dtype, shape: Some(Shape::from_known(&shape)) });
        }
        let id = g.add_value(val.name.clone(), kind, ty, data)?;
        if kind == ValueKind::Input {
            g.inputs.push(id);
        }
        map.insert(v, id);
        Ok(id)
    };
    for &v in &inputs {
        copy(&mut g, &mut map, v)?;
    }
    let node_by_name: HashMap<&str, NodeId> = layer_nodes.iter().map(|&n| (graph.node(n).name.as_str(), n)).collect();
    for c in &shard.constant_rewrites {
        if !node_by_name.contains_key(c.node.as_str()) {
            return Err(bad(format!("constant rewrite names node `{}`, which is not in the layer", c.node)));
        }
    }
    let counter = std::cell::Cell::new(0u32);
    let fresh = |base: &str, what: &str| -> String {
        counter.set(counter.get() + 1);
        format!("{base}.{what}{}", counter.get())
    };
    let mut topo: Vec<NodeId> = layer_nodes.to_vec();
    let pos: HashMap<NodeId, usize> = graph.topo_order()?.into_iter().enumerate().map(|(i, n)| (n, i)).collect();
    topo.sort_by_key(|n| pos.get(n).copied().unwrap_or(usize::MAX));
    for &nid in &topo {
        let node = graph.node(nid);
        let mut inputs: Vec<Option<ValueId>> = Vec::with_capacity(node.inputs.len());
        for (slot, v) in node.inputs.iter().enumerate() {
            let Some(v) = *v else {
                inputs.push(None);
                continue;
            };
            let mut id = copy(&mut g, &mut map, v)?;
            if let Some(&ci) = scoped_at.get(&(node.name.as_str(), slot)) {
                id = match scoped_out.get(&ci) {
                    Some(&x) => x,
                    None => {
                        let c = &shard.collectives[ci];
                        if graph.value(v).name != c.after_value {
                            return Err(bad(format!("collective on `{}` names input {slot} of `{}`, which reads `{}`", c.after_value, node.name, graph.value(v).name)));
                        }
                        let name = fresh(&c.after_value, c.kind.op_type());
                        let out = g.add_value(format!("{name}.out"), ValueKind::Intermediate, None, None)?;
                        emit_collective(&mut g, c, &name, id, out, full_shape(v).as_deref(), dtype_of(v), shard.tp, node.order)?;
                        scoped_out.insert(ci, out);
                        out
                    }
                };
            }
            if let Some(c) = shard.constant_rewrites.iter().find(|c| c.node == node.name && c.input == slot) {
                let val = graph.value(v);
                let dtype = val.data.as_ref().map_or(DType::I64, |d| d.dtype);
                let dims_ = val.data.as_ref().map_or(vec![c.new_values.len() as i64], |d| d.dims.clone());
                let t = crate::passes::fold::int_tensor(dtype, dims_.clone(), &c.new_values);
                id = g.add_value(fresh(&val.name, "tp"), ValueKind::Constant, Some(TensorType { dtype, shape: Some(Shape::from_known(&dims_)) }), Some(t))?;
            }
            for r in &shard.rewrites {
                if let NodeRewrite::DivideShape { node: rn, input, divisors } = r
                    && *rn == node.name
                    && *input == slot
                {
                    let d = i64_const(&mut g, fresh(&node.name, "divisors"), divisors)?;
                    let out = g.add_value(fresh(&node.name, "shape"), ValueKind::Intermediate, None, None)?;
                    g.add_node(Node {
                        name: fresh(&node.name, "divide_shape"),
                        op: Op::Known(OpKind::Div),
                        attrs: Attrs::default(),
                        inputs: vec![Some(id), Some(d)],
                        outputs: vec![out],
                        namespace: node.namespace.clone(),
                        order: node.order,
                    })?;
                    id = out;
                }
            }
            inputs.push(Some(id));
        }
        let defer = shard.rewrites.iter().any(|r| matches!(r, NodeRewrite::DeferBias { node: n } if *n == node.name));
        let masked = shard.rewrites.iter().find_map(|r| match r {
            NodeRewrite::MaskedGather { node: n, start, end } if *n == node.name => Some((*start, *end)),
            _ => None,
        });
        let mut outs = Vec::with_capacity(node.outputs.len());
        let mut after: Vec<(ValueId, ValueId, ValueId)> = Vec::new();
        for &o in &node.outputs {
            let val = graph.value(o);
            if let Some(c) = collect.get(val.name.as_str()) {
                let local = g.add_value(format!("{}.local", val.name), ValueKind::Intermediate, None, None)?;
                let full = g.add_value(val.name.clone(), ValueKind::Intermediate, val.ty.clone(), None)?;
                map.insert(o, full);
                outs.push(local);
                after.push((local, full, o));
                let _ = c;
            } else {
                let id = g.add_value(val.name.clone(), ValueKind::Intermediate, None, None)?;
                map.insert(o, id);
                outs.push(id);
            }
        }
        let mut emit_outs = outs.clone();
        if let Some((start, end)) = masked {
            let (Some(table), Some(ids)) = (inputs.first().copied().flatten(), inputs.get(1).copied().flatten()) else {
                return Err(bad(format!("masked gather `{}` lacks operands", node.name)));
            };
            let idt = graph.value(node.inputs[1].unwrap_or(node.outputs[0])).ty.as_ref().map_or(DType::I64, |t| t.dtype);
            let fdt = g.value(table).ty.as_ref().map_or(DType::F32, |t| t.dtype);
            let cs = scalar_const(&mut g, fresh(&node.name, "vocab_start"), idt, start)?;
            let ce = scalar_const(&mut g, fresh(&node.name, "vocab_end"), idt, end)?;
            let zi = scalar_const(&mut g, fresh(&node.name, "zero_index"), idt, 0)?;
            let zf = scalar_const(&mut g, fresh(&node.name, "zero"), fdt, 0)?;
            let axes = i64_const(&mut g, fresh(&node.name, "last_axis"), &[-1])?;
            let val = |g: &mut Graph, what: &str| g.add_value(fresh(&node.name, what), ValueKind::Intermediate, None, None);
            let ge = val(&mut g, "ge")?;
            let lt = val(&mut g, "lt")?;
            let inr = val(&mut g, "in_range")?;
            let sh = val(&mut g, "shifted")?;
            let safe = val(&mut g, "safe")?;
            let got = val(&mut g, "rows")?;
            let m = val(&mut g, "mask")?;
            let mk = |op: OpKind, ins: Vec<ValueId>, out: ValueId, name: String, attrs: Attrs| Node {
                name,
                op: Op::Known(op),
                attrs,
                inputs: ins.into_iter().map(Some).collect(),
                outputs: vec![out],
                namespace: node.namespace.clone(),
                order: node.order,
            };
            let mut gattrs = Attrs::default();
            gattrs.set("axis", Attr::Int(0));
            for n in [
                mk(OpKind::GreaterOrEqual, vec![ids, cs], ge, fresh(&node.name, "ge"), Attrs::default()),
                mk(OpKind::Less, vec![ids, ce], lt, fresh(&node.name, "lt"), Attrs::default()),
                mk(OpKind::And, vec![ge, lt], inr, fresh(&node.name, "and"), Attrs::default()),
                mk(OpKind::Sub, vec![ids, cs], sh, fresh(&node.name, "sub"), Attrs::default()),
                mk(OpKind::Where, vec![inr, sh, zi], safe, fresh(&node.name, "where_index"), Attrs::default()),
                mk(OpKind::Gather, vec![table, safe], got, node.name.clone(), gattrs),
                mk(OpKind::Unsqueeze, vec![inr, axes], m, fresh(&node.name, "unsqueeze"), Attrs::default()),
                mk(OpKind::Where, vec![m, got, zf], emit_outs[0], fresh(&node.name, "where_rows"), Attrs::default()),
            ] {
                g.add_node(n)?;
            }
        } else if defer && node.op.is(OpKind::Gemm) && inputs.get(2).copied().flatten().is_some() {
            let bias = inputs[2];
            let nb = g.add_value(fresh(&node.name, "nobias"), ValueKind::Intermediate, None, None)?;
            let mut ins = inputs.clone();
            ins.truncate(2);
            let mut attrs = node.attrs.clone();
            let beta = attrs.float("beta", 1.0);
            attrs.0.remove("beta");
            g.add_node(Node { name: node.name.clone(), op: node.op.clone(), attrs, inputs: ins, outputs: vec![nb], namespace: node.namespace.clone(), order: node.order })?;
            // The bias joins after the collective; until then the local output is the bias-free sum.
            let Some(&(local, full, _)) = after.first() else {
                return Err(bad(format!("Gemm `{}` defers its bias but nothing reduces its output", node.name)));
            };
            let _ = local;
            let reduced = g.add_value(fresh(&node.name, "reduced"), ValueKind::Intermediate, graph.value(node.outputs[0]).ty.clone(), None)?;
            // Re-point: nobias → collective → reduced; reduced + beta·C → full.
            let c = after[0].2;
            let ck = collect[graph.value(c).name.as_str()];
            let cname = fresh(&node.name, ck.kind.op_type());
            emit_collective(&mut g, ck, &cname, nb, reduced, full_shape(c).as_deref(), dtype_of(c), shard.tp, node.order)?;
            let mut b = bias.ok_or_else(|| bad("no bias".into()))?;
            if beta != 1.0 {
                let bt = g.value(b).ty.as_ref().map_or(DType::F32, |t| t.dtype);
                let s = g.add_value(fresh(&node.name, "beta"), ValueKind::Constant, Some(TensorType { dtype: bt, shape: Some(Shape(vec![])) }), Some(float_scalar(bt, beta)))?;
                let sb = g.add_value(fresh(&node.name, "scaled_bias"), ValueKind::Intermediate, None, None)?;
                g.add_node(Node { name: fresh(&node.name, "scale_bias"), op: Op::Known(OpKind::Mul), attrs: Attrs::default(), inputs: vec![Some(b), Some(s)], outputs: vec![sb], namespace: None, order: node.order })?;
                b = sb;
            }
            g.add_node(Node { name: add_bias_name(&node.name), op: Op::Known(OpKind::Add), attrs: Attrs::default(), inputs: vec![Some(reduced), Some(b)], outputs: vec![full], namespace: node.namespace.clone(), order: node.order })?;
            after.clear();
            emit_outs.clear();
        } else {
            g.add_node(Node { name: node.name.clone(), op: node.op.clone(), attrs: node.attrs.clone(), inputs, outputs: emit_outs.clone(), namespace: node.namespace.clone(), order: node.order })?;
        }
        for (local, full, o) in after {
            let c = collect[graph.value(o).name.as_str()];
            let name = fresh(&graph.value(o).name, c.kind.op_type());
            emit_collective(&mut g, c, &name, local, full, full_shape(o).as_deref(), dtype_of(o), shard.tp, node.order)?;
        }
    }
    for (i, c) in shard.collectives.iter().enumerate() {
        if !c.readers.is_empty() {
            if !scoped_out.contains_key(&i) {
                let r = &c.readers[0];
                return Err(bad(format!("collective on `{}` names input {} of `{}`, which the layer does not read", c.after_value, r.input, r.node)));
            }
            continue;
        }
        if !graph.value_by_name(&c.after_value).is_some_and(|v| map.contains_key(&v) && graph.value(v).producer.is_some_and(|p| node_by_name.contains_key(graph.node(p).name.as_str()))) {
            return Err(bad(format!("collective after `{}`, which the layer does not produce", c.after_value)));
        }
    }
    for o in outputs {
        g.outputs.push(map[&o]);
    }
    g.verify()?;
    // Infer on a probe where integer inputs are constants at the bound dims.
    let mut probe = g.clone();
    let mut kept = Vec::new();
    for &v in &g.inputs {
        let global = graph.value_by_name(&g.value(v).name);
        let ints = global.and_then(|gv| info.ints(gv).map(|x| (gv, x)));
        match ints {
            Some((gv, vals)) => {
                let ty = info.types[gv.index()].as_ref();
                let dtype = ty.map_or(DType::I64, |t| t.dtype);
                let shape = ty.and_then(|t| t.shape.clone()).unwrap_or_else(|| vec![vals.len() as i64]);
                let val = probe.value_mut(v);
                val.kind = ValueKind::Constant;
                val.data = Some(crate::passes::fold::int_tensor(dtype, shape, vals));
            }
            None => kept.push(v),
        }
    }
    probe.inputs = kept;
    shape_infer::infer_shapes(&mut probe, dims)?;
    for v in g.value_ids().collect::<Vec<_>>() {
        if g.value(v).kind == ValueKind::Intermediate {
            g.value_mut(v).ty = probe.value(v).ty.clone();
        }
    }
    g.verify()?;
    Ok(g)
}

/// Adds the nodes of collective `c` from `input` to `output`: the collective node, wrapped in
/// reshapes to and from its view if it has one. `full` is the model value's shape.
#[allow(clippy::too_many_arguments)]
fn emit_collective(
    g: &mut Graph,
    c: &CollectiveInsert,
    name: &str,
    input: ValueId,
    output: ValueId,
    full: Option<&[i64]>,
    dtype: DType,
    tp: usize,
    order: u32,
) -> Result<(), CodegenError> {
    let t = tp as i64;
    let splits = matches!(c.kind, CollectiveKind::ReduceScatter { .. } | CollectiveKind::Scatter { .. });
    let axis = c.kind.axis().unwrap_or(0);
    let Some(view) = &c.view else {
        // a collective's result has the declared type of the whole value, or its chunk
        let mut ty = g.value(output).ty.clone().or_else(|| full.map(|f| TensorType { dtype, shape: Some(Shape::from_known(f)) }));
        if splits {
            if let Some(shape) = ty.as_mut().and_then(|t| t.shape.as_mut())
                && let Some(d) = shape.0.get_mut(axis)
            {
                *d = match (d.known(), full.and_then(|f| f.get(axis))) {
                    (Some(k), _) | (None, Some(&k)) => crate::ir::Dim::Known(k / t),
                    _ => d.clone(),
                };
            }
        }
        g.value_mut(output).ty = ty;
        g.add_node(collective_node(name.to_string(), c.kind, c.group, input, output, order))?;
        return Ok(());
    };
    let bad = |m: &str| CodegenError::BadShard { layer: 0, rank: 0, msg: format!("collective on `{}`: {m}", c.after_value) };
    let full = full.ok_or_else(|| bad("its view needs the value's shape, which is unknown"))?;
    if axis >= view.len() || view[axis] <= 0 || view[axis] % t != 0 {
        return Err(bad(&format!("view {view:?} does not split {tp} ways along axis {axis}")));
    }
    let numel: i64 = full.iter().product();
    let known: i64 = view.iter().filter(|&&d| d != -1).product();
    let resolved: Vec<i64> = view.iter().map(|&d| if d == -1 { numel / known.max(1) } else { d }).collect();
    let mut in_target = view.clone();
    let mut out_view = resolved.clone();
    if splits {
        out_view[axis] /= t;
    } else {
        in_target[axis] /= t;
    }
    // back to the value's own layout: its entry holding the token chunk is left free
    let upto: i64 = resolved[..=axis].iter().product();
    let mut acc = 1;
    let k = full.iter().position(|&d| {
        acc *= d;
        acc >= upto
    });
    let mut back = full.to_vec();
    if let Some(k) = k {
        back[k] = -1;
    }
    let reshape = |g: &mut Graph, what: &str, x: ValueId, target: ValueId, out: ValueId| {
        g.add_node(Node {
            name: format!("{name}.{what}"),
            op: Op::Known(OpKind::Reshape),
            attrs: Attrs::default(),
            inputs: vec![Some(x), Some(target)],
            outputs: vec![out],
            namespace: None,
            order,
        })
    };
    let tin = i64_const(g, format!("{name}.view_shape"), &in_target)?;
    let vin = g.add_value(format!("{name}.view_in"), ValueKind::Intermediate, None, None)?;
    reshape(g, "view", input, tin, vin)?;
    let vout = g.add_value(format!("{name}.view_out"), ValueKind::Intermediate, Some(TensorType { dtype, shape: Some(Shape::from_known(&out_view)) }), None)?;
    g.add_node(collective_node(name.to_string(), c.kind, c.group, vin, vout, order))?;
    let tback = i64_const(g, format!("{name}.unview_shape"), &back)?;
    reshape(g, "unview", vout, tback, output)?;
    g.value_mut(output).ty = None;
    Ok(())
}

fn float_scalar(dtype: DType, v: f32) -> Tensor {
    match dtype {
        DType::F64 => Tensor { dtype, dims: vec![], storage: Storage::Raw((v as f64).to_le_bytes().to_vec().into()) },
        _ => Tensor::from_f32(vec![], &[v]),
    }
}
