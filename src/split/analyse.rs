//! The split structure of a layer, independent of the tensor degree: each node's role (weight
//! matmul, embedding, other), where a column split of each weight matmul flows (through views,
//! elementwise ops and attention matmuls to its row consumers), and the attention cores (the
//! matmuls of two activations between QKV and output projections). [`super::offer`] prices it
//! per degree; [`super::realise`] emits it.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::family::{Opaque, opaque_nodes, tp_rule};
use crate::ir::{Graph, LayeredGraph, NodeId, OpKind, ValueId, ValueKind};

/// What a node of a layer is to the tensor split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeRole {
    /// A matmul/Gemm whose second operand is a parameter (or a transpose of one).
    WeightMatmul,
    /// A gather from a parameter table.
    Embedding,
    /// A mixture of experts (split by each expert's intermediate dim, or whole).
    Experts,
    /// Anything else (follows its input, sequence-parallel).
    Follow,
}

fn is_float_init(g: &Graph, v: ValueId) -> bool {
    let val = g.value(v);
    val.kind == ValueKind::Initializer && val.ty.as_ref().is_some_and(|t| t.dtype.is_float())
}

/// The parameter behind a weight operand (itself, or the input of a Transpose of it) and
/// whether it is transposed.
pub(super) fn weight_param(g: &Graph, producers: &HashMap<ValueId, NodeId>, v: ValueId) -> Option<(ValueId, bool)> {
    if is_float_init(g, v) {
        return Some((v, false));
    }
    let n = g.try_node(*producers.get(&v)?)?;
    let x = n.inputs.first().copied().flatten()?;
    (n.op.is(OpKind::Transpose) && is_float_init(g, x)).then_some((x, true))
}

fn producers(g: &Graph) -> HashMap<ValueId, NodeId> {
    let mut m = HashMap::new();
    for id in g.node_ids() {
        for &o in &g.node(id).outputs {
            m.insert(o, id);
        }
    }
    m
}

fn dims(g: &Graph, v: ValueId) -> Option<Vec<Option<i64>>> {
    let s = g.value(v).ty.as_ref()?.shape.as_ref()?;
    Some(s.0.iter().map(|d| d.known()).collect())
}

/// Roles of a layer's nodes, in the layer's node order.
pub fn roles(lg: &LayeredGraph, layer: usize) -> Vec<NodeRole> {
    roles_with(lg, layer, &producers(&lg.graph))
}

fn roles_with(lg: &LayeredGraph, layer: usize, prod: &HashMap<ValueId, NodeId>) -> Vec<NodeRole> {
    let g = &lg.graph;
    lg.layers[layer]
        .nodes
        .iter()
        .map(|&id| match g.try_node(id).and_then(|n| n.op.kind().map(|k| (n, k))) {
            Some((n, OpKind::MatMul | OpKind::Gemm))
                if n.inputs.get(1).copied().flatten().is_some_and(|w| weight_param(g, prod, w).is_some()) =>
            {
                NodeRole::WeightMatmul
            }
            Some((n, OpKind::Gather)) if n.inputs.first().copied().flatten().is_some_and(|v| is_float_init(g, v)) => {
                NodeRole::Embedding
            }
            Some((_, OpKind::MixtureOfExperts)) => NodeRole::Experts,
            _ => NodeRole::Follow,
        })
        .collect()
}

/// Where a weight matmul's column split flows inside its layer.
#[derive(Clone, Debug, Default)]
pub(super) struct Reach {
    /// Weight matmuls reading the split (they must split by rows).
    pub(super) consumers: BTreeSet<usize>,
    /// Attention cores reached (core matmul indices).
    pub(super) cores: BTreeSet<usize>,
    /// Nodes run split before any core (layer node indices).
    pub(super) pre: BTreeSet<usize>,
    /// Per core matmul reached: nodes after it and weight matmuls reading them.
    pub(super) post: BTreeMap<usize, (BTreeSet<usize>, BTreeSet<usize>)>,
    /// Whether the split leaves the layer outside attention heads (gathered there).
    pub(super) exits: bool,
}

/// The t-independent split structure of a layer (see [`analyse`]); reuse it across tensor
/// degrees with [`build_from`].
pub struct SplitGraph {
    pub(super) roles: Vec<NodeRole>,
    /// Per weight matmul: where its column split flows, `None` when codegen cannot carry it.
    pub(super) reach: BTreeMap<usize, Option<Reach>>,
    /// Attention cores: core matmul indices, other nodes, weight matmuls reading them, and the
    /// head counts of the 4-D reshapes on the way.
    pub(super) cores: Vec<Core>,
    /// (k, n) of each weight matmul's weight, where known.
    pub(super) kn: HashMap<usize, (Option<i64>, Option<i64>)>,
    /// Rows of each embedding's table, and whether it is the vocabulary table codegen splits.
    pub(super) vocab: HashMap<usize, (Option<i64>, bool)>,
    /// Input value of each weight matmul.
    pub(super) input: HashMap<usize, Option<ValueId>>,
    /// Per mixture of experts: each expert's intermediate dim, its routes per token over
    /// the hidden size (the router weights' share of the tokens' bytes), and the elements of
    /// its down-projection biases (0 without).
    pub(super) experts: HashMap<usize, (Option<i64>, f64, f64)>,
    /// Nodes the engines cannot see into ([`super::family::opaque`]): choosing ones are
    /// offered `replicate` only.
    pub(super) opaque: BTreeSet<usize>,
}

impl SplitGraph {
    /// Per attention core: its matmuls (layer node indices, ascending: the scores' first, or
    /// the one fused attention) and the most heads its 4-D reshapes name, if any.
    pub fn core_matmuls(&self) -> Vec<(Vec<usize>, Option<i64>)> {
        self.cores.iter().map(|c| (c.matmuls.iter().copied().collect(), c.heads.iter().max().copied())).collect()
    }
}

#[derive(Clone, Debug, Default)]
pub(super) struct Core {
    pub(super) matmuls: BTreeSet<usize>,
    pub(super) nodes: BTreeSet<usize>,
    pub(super) consumers: BTreeSet<usize>,
    pub(super) producers: BTreeSet<usize>,
    pub(super) heads: BTreeSet<i64>,
}

struct Walker<'g> {
    g: &'g Graph,
    index: &'g HashMap<NodeId, usize>,
    uses: &'g [Vec<NodeId>],
    roles: &'g [NodeRole],
    /// Nodes no split may flow into.
    opaque: &'g HashMap<NodeId, Opaque>,
    /// Values a column split reaches (from any producer); `None` in the permissive pass.
    split_values: Option<&'g HashSet<ValueId>>,
    /// The node producing each value.
    producers: &'g HashMap<ValueId, NodeId>,
    heads_seen: BTreeSet<i64>,
}

impl Walker<'_> {
    fn rank(&self, v: ValueId) -> Option<usize> {
        dims(self.g, v).map(|d| d.len())
    }

    /// An operand combined with a split value without being sliced: a constant, another split
    /// value, or one that broadcasts along the split axis.
    fn operand_ok(&self, w: ValueId, out: ValueId, heads: bool) -> bool {
        let val = self.g.value(w);
        if matches!(val.kind, ValueKind::Initializer | ValueKind::Constant) {
            return true;
        }
        if !val.ty.as_ref().is_some_and(|t| t.dtype.is_float()) {
            return true;
        }
        if self.split_values.is_none_or(|s| s.contains(&w)) {
            return true;
        }
        let (Some(wd), Some(od)) = (dims(self.g, w), dims(self.g, out)) else { return false };
        if heads {
            // [b, h, s, d] or [b, s, h, d]: a size-1 axis 1 or 2, or a lower rank, broadcasts;
            // so does one head expanded over all of them (latent attention's rotary key)
            let broadcast = |d: &[Option<i64>]| d.len() < od.len() || (d.len() == 4 && (d[1] == Some(1) || d[2] == Some(1)));
            broadcast(&wd) || self.expanded_head(w).is_some_and(|xd| broadcast(&xd))
        } else {
            wd.is_empty() || wd.last().copied().flatten() == Some(1)
        }
    }

    /// Whether a reduction or norm of a 4-d heads value works along the last axis only (each
    /// head's own dims) and keeps every axis: the heads axis passes through it.
    fn along_head_dims_only(&self, n: &crate::ir::Node) -> bool {
        if n.attrs.int("keepdims", 1) != 1 {
            return false;
        }
        // (nodes are in the importer's canonical form: a reduction's axes are its input 1)
        let axes: Option<Vec<i64>> = if n.op.is(OpKind::LayerNormalization) || n.op.is(OpKind::RMSNormalization) {
            Some(vec![n.attrs.int("axis", -1)])
        } else {
            n.inputs.get(1).copied().flatten().and_then(|a| self.g.value(a).data.as_ref()?.to_i64_vec())
        };
        axes.is_some_and(|a| !a.is_empty() && a.iter().all(|&x| x == -1 || x == 3))
    }

    /// The dims of the input of the Expand producing `w`, when one produces it.
    fn expanded_head(&self, w: ValueId) -> Option<Vec<Option<i64>>> {
        let n = self.g.try_node(*self.producers.get(&w)?)?;
        n.op.is(OpKind::Expand).then(|| n.inputs.first().copied().flatten().and_then(|x| dims(self.g, x)))?
    }

    /// Follows the split from `start` (output of weight matmul `from`).
    fn walk(&mut self, start: ValueId, from: usize) -> Option<Reach> {
        let mut r = Reach::default();
        let start_heads = self.rank(start) == Some(4);
        let mut stack = vec![(start, start_heads, None::<usize>)];
        let mut seen: HashSet<(ValueId, Option<usize>)> = HashSet::new();
        while let Some((v, heads, core)) = stack.pop() {
            if !seen.insert((v, core)) {
                continue;
            }
            if self.g.outputs.contains(&v) {
                r.exits |= !heads && core.is_none();
            }
            for &u in &self.uses[v.index()] {
                let Some(&i) = self.index.get(&u) else {
                    r.exits |= !heads && core.is_none();
                    continue;
                };
                // emission keeps these whole: a split cannot reach them
                if self.opaque.contains_key(&u) {
                    return None;
                }
                let n = self.g.node(u);
                let first = n.inputs.first().copied().flatten() == Some(v);
                match self.roles[i] {
                    NodeRole::WeightMatmul if first && i != from => {
                        match core {
                            Some(c) => r.post.entry(c).or_default().1.insert(i),
                            None => r.consumers.insert(i),
                        };
                        continue;
                    }
                    NodeRole::WeightMatmul | NodeRole::Embedding | NodeRole::Experts => return None,
                    NodeRole::Follow => {}
                }
                let note = |r: &mut Reach, core: Option<usize>| match core {
                    Some(c) => {
                        r.post.entry(c).or_default().0.insert(i);
                    }
                    None => {
                        r.pre.insert(i);
                    }
                };
                use OpKind::*;
                let out = n.outputs.first().copied();
                let kind = n.op.kind()?;
                if !tp_rule(kind) {
                    return None;
                }
                let mut next_heads = heads;
                let mut next_core = core;
                match kind {
                    MatMul | Gemm | ScaledDotProductAttention => {
                        r.cores.insert(i);
                        next_core = Some(core.unwrap_or(i));
                        if let Some(c) = core {
                            r.post.entry(c).or_default().0.insert(i);
                        }
                        r.post.entry(i).or_default();
                        // the other operands (q, kᵀ, v and the mask of a fused attention)
                        let others = n.inputs.iter().flatten().filter(|&&w| w != v).copied();
                        let others: Vec<ValueId> = if kind == ScaledDotProductAttention { others.collect() } else { others.take(1).collect() };
                        if let Some(o) = out
                            && others.iter().any(|&w| self.split_values.is_some_and(|s| !s.contains(&w)) && !self.operand_ok(w, o, true))
                        {
                            return None;
                        }
                    }
                    Reshape => {
                        if !first {
                            return None;
                        }
                        note(&mut r, core);
                        let od = out.and_then(|o| dims(self.g, o));
                        next_heads = od.as_ref().is_some_and(|d| d.len() == 4);
                        // Heads of a [b, s, h·d] → [b, s, h, d] split.
                        if let Some(d) = od.filter(|d| d.len() == 4)
                            && self.rank(v) == Some(3)
                            && let Some(h) = d[2]
                        {
                            self.heads_seen.insert(h);
                        }
                    }
                    Transpose | Squeeze | Unsqueeze | Identity | Cast | Dropout | Split => note(&mut r, core),
                    Softmax | LogSoftmax | Slice | Concat | Expand | Where if heads => {
                        note(&mut r, core);
                        if matches!(kind, Concat | Where)
                            && let Some(o) = out
                            && n.inputs.iter().flatten().any(|&w| w != v && !self.operand_ok(w, o, true))
                        {
                            return None;
                        }
                    }
                    // a per-head norm (Qwen3's q and k norms): along each head's own dims only
                    ReduceMean | ReduceSum | ReduceMax | ReduceMin | LayerNormalization | RMSNormalization if heads && self.along_head_dims_only(n) => {
                        note(&mut r, core);
                        if let Some(o) = out
                            && n.inputs.iter().skip(1).flatten().any(|&w| !self.operand_ok(w, o, true))
                        {
                            return None;
                        }
                    }
                    // a rotary embedding of heads: its tables broadcast over them
                    ApplyRotary if heads => {
                        note(&mut r, core);
                        if let Some(o) = out
                            && n.inputs.iter().flatten().any(|&w| w != v && !self.operand_ok(w, o, true))
                        {
                            return None;
                        }
                    }
                    // (a `Where` of heads is above: its mask broadcasts over them)
                    k if k.is_elementwise() => {
                        note(&mut r, core);
                        if let Some(o) = out
                            && n.inputs.iter().flatten().any(|&w| w != v && !self.operand_ok(w, o, heads))
                        {
                            return None;
                        }
                    }
                    _ => return None,
                }
                for &o in &n.outputs {
                    stack.push((o, next_heads, next_core));
                }
            }
        }
        Some(r)
    }
}

/// The graph-wide facts [`analyse`] needs, computed once per graph.
pub struct GraphFacts {
    producers: HashMap<ValueId, NodeId>,
    uses: Vec<Vec<NodeId>>,
    opaque: HashMap<NodeId, Opaque>,
}

impl GraphFacts {
    /// Producers and readers of every value of `lg`'s graph, and the nodes the engines cannot
    /// see into.
    pub fn new(lg: &LayeredGraph) -> GraphFacts {
        GraphFacts { producers: producers(&lg.graph), uses: lg.graph.uses(), opaque: opaque_nodes(lg) }
    }
}

/// Where column splits of `layer` can flow (independent of the tensor degree).
pub fn analyse(lg: &LayeredGraph, layer: usize, facts: &GraphFacts) -> SplitGraph {
    let g = &lg.graph;
    let lay = &lg.layers[layer];
    let prod = &facts.producers;
    let roles = roles_with(lg, layer, prod);
    let index: HashMap<NodeId, usize> = lay.nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let uses = &facts.uses;
    let vocab_rows = g.outputs.first().and_then(|&v| dims(g, v)).and_then(|d| d.last().copied().flatten());
    let mut kn = HashMap::new();
    let mut vocab = HashMap::new();
    let mut input = HashMap::new();
    let mut experts = HashMap::new();
    for (i, role) in roles.iter().enumerate() {
        let Some(n) = g.try_node(lay.nodes[i]) else { continue };
        match role {
            NodeRole::WeightMatmul => {
                let w = n.inputs.get(1).copied().flatten();
                let wp = w.and_then(|w| weight_param(g, prod, w));
                let transposed = wp.is_some_and(|(_, t)| t);
                let d = wp.and_then(|(param, _)| dims(g, param)).unwrap_or_default();
                let trans_b = n.op.is(OpKind::Gemm) && n.attrs.int("transB", 0) != 0;
                let (k, nn) = if d.len() == 2 {
                    if transposed ^ trans_b { (d[1], d[0]) } else { (d[0], d[1]) }
                } else {
                    (None, None)
                };
                kn.insert(i, (k, nn));
                input.insert(i, n.inputs.first().copied().flatten());
            }
            NodeRole::Embedding => {
                let table = n.inputs.first().copied().flatten();
                let rows = table.and_then(|t| dims(g, t)).filter(|d| d.len() == 2).and_then(|d| d[0]);
                let is_vocab = n.attrs.int("axis", 0) == 0 && rows.is_some() && rows == vocab_rows;
                vocab.insert(i, (rows, is_vocab));
            }
            NodeRole::Experts => {
                let d = |i: usize| n.inputs.get(i).copied().flatten().and_then(|v| dims(g, v)).unwrap_or_default();
                let inter = d(3).get(1).copied().flatten().map(|r| r / 2);
                let routes = match (d(1).get(1).copied().flatten(), d(0).get(1).copied().flatten()) {
                    (Some(k), Some(h)) if h > 0 => k as f64 / h as f64,
                    _ => 0.0,
                };
                let bias_elems = match d(6).as_slice() {
                    [Some(e), Some(h)] => (e * h) as f64,
                    _ => 0.0,
                };
                experts.insert(i, (inter, routes, bias_elems));
            }
            NodeRole::Follow => {}
        }
    }
    let producers_list: Vec<usize> = (0..roles.len()).filter(|&i| roles[i] == NodeRole::WeightMatmul).collect();
    let out_of = |i: usize| g.try_node(lay.nodes[i]).and_then(|n| n.outputs.first().copied());
    // Permissive pass: every value a column split could reach.
    let mut split_values: HashSet<ValueId> = HashSet::new();
    {
        let mut w = Walker { g, index: &index, uses, roles: &roles, opaque: &facts.opaque, split_values: None, producers: prod, heads_seen: BTreeSet::new() };
        for &p in producers_list.iter().filter(|&&p| !facts.opaque.contains_key(&lay.nodes[p])) {
            if let (Some(o), Some(r)) = (out_of(p), out_of(p).and_then(|o| w.walk(o, p))) {
                split_values.insert(o);
                for &i in r.pre.iter().chain(r.cores.iter()).chain(r.post.values().flat_map(|x| x.0.iter())) {
                    if let Some(n) = g.try_node(lay.nodes[i]) {
                        split_values.extend(n.outputs.iter().copied());
                    }
                }
            }
        }
    }
    let mut reach = BTreeMap::new();
    let mut heads_of: HashMap<usize, BTreeSet<i64>> = HashMap::new();
    let mut w = Walker { g, index: &index, uses, roles: &roles, opaque: &facts.opaque, split_values: Some(&split_values), producers: prod, heads_seen: BTreeSet::new() };
    for &p in &producers_list {
        w.heads_seen.clear();
        let r = out_of(p).filter(|_| !facts.opaque.contains_key(&lay.nodes[p])).and_then(|o| w.walk(o, p));
        heads_of.insert(p, w.heads_seen.clone());
        reach.insert(p, r);
    }
    // Attention cores: core matmuls reached together form one core.
    let mut cores: Vec<Core> = Vec::new();
    for (&p, r) in &reach {
        let Some(r) = r else { continue };
        let mut ids: BTreeSet<usize> = r.cores.clone();
        ids.extend(r.post.keys());
        if ids.is_empty() {
            continue;
        }
        let hit: Vec<usize> = (0..cores.len()).filter(|&c| cores[c].matmuls.iter().any(|m| ids.contains(m))).collect();
        let mut core = Core::default();
        for &c in hit.iter().rev() {
            let old = cores.remove(c);
            core.matmuls.extend(old.matmuls);
            core.nodes.extend(old.nodes);
            core.consumers.extend(old.consumers);
            core.producers.extend(old.producers);
            core.heads.extend(old.heads);
        }
        core.matmuls.extend(ids);
        for (nodes, consumers) in r.post.values() {
            core.nodes.extend(nodes.iter().copied());
            core.consumers.extend(consumers.iter().copied());
        }
        core.producers.insert(p);
        core.heads.extend(heads_of[&p].iter().copied());
        cores.push(core);
    }
    for c in &mut cores {
        let m = c.matmuls.clone();
        c.nodes.retain(|i| !m.contains(i));
    }
    let opaque = (0..lay.nodes.len()).filter(|&i| facts.opaque.contains_key(&lay.nodes[i])).collect();
    SplitGraph { roles, reach, cores, kn, vocab, input, experts, opaque }
}

