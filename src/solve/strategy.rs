//! Sharding strategies per node at tensor degree t and the intra-layer problem they form.
//!
//! Choosing nodes: matmuls with a weight operand (`column`: output sharded, input-gradient
//! all-reduce in the backward; `row`: partial sums all-reduced in the forward; `replicate`),
//! embedding lookups (`vocab`: one forward all-reduce; `replicate`) and attention cores (the
//! matmuls without a parameter operand between the QKV and output projections, with the ops
//! between them: `heads` or `replicate`). Every other op of the layer runs sharded (`sequence`)
//! and is one aggregate `rest` node with that single option.
//!
//! An option exists only where it divides: column when the weight's output dim (and the heads
//! of an attention core it feeds) divide by t, row when the contracted dim does, vocab when the
//! vocabulary does; replicate always. The ops a column split flows through before its row
//! consumer (Gelu, bias adds, head reshapes) run split with it, or whole when it is replicated.
//!
//! Codegen (tensor-parallel propagation) realises only these combinations, so the edges forbid
//! every other pair:
//! - a column output feeds row consumers / `heads` cores only: column → column and
//!   column → replicate are excluded (codegen inserts no gather inside a layer);
//! - a row consumer or a `heads` core needs every producer split by columns: replicate/row →
//!   row and replicate/row → heads are excluded;
//! - a column split that meets an op codegen cannot run split (a norm over the split axis, a
//!   residual add) is not offered at all.
//!
//! The Megatron split (maximal column/heads/row pairs, vocabulary-split embeddings) is one
//! assignment of this problem; the Megatron layer point is its evaluation, so the ILP's
//! optimum is never slower.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::cost::compute::{node_times, scaled};
use crate::cost::{ClusterSpec, CommModel, GroupSpan};
use crate::ir::{DType, Graph, LayeredGraph, NodeId, OpKind, ValueId, ValueKind};

use super::problem::{IntraEdge, IntraLayerProblem, IntraNode, NodeOption};

/// What a node of a layer is to the tensor split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeRole {
    /// A matmul/Gemm whose second operand is a parameter (or a transpose of one).
    WeightMatmul,
    /// A gather from a parameter table.
    Embedding,
    /// Anything else (follows its input, sequence-parallel).
    Follow,
}

/// Strategy name: weight split by output columns.
pub const COLUMN: &str = "column";
/// Strategy name: weight split by contracted rows (partial sums).
pub const ROW: &str = "row";
/// Strategy name: whole on every tensor rank.
pub const REPLICATE: &str = "replicate";
/// Strategy name: embedding table split by vocabulary rows.
pub const VOCAB: &str = "vocab";
/// Strategy name: attention core split by heads.
pub const HEADS: &str = "heads";
/// Strategy name of the aggregate `rest` node (norms, residual adds, ...) under sequence
/// parallelism.
pub const SEQUENCE: &str = "sequence";
/// Strategy name of the aggregate `rest` node without sequence parallelism: replicated.
pub const FOLLOW: &str = "follow";

/// Strategies codegen realises and checks per node (the others are aggregate).
pub const CHOOSING: [&str; 5] = [COLUMN, ROW, REPLICATE, VOCAB, HEADS];

/// The intra-layer problem of one layer with what is needed to name its answer.
#[derive(Clone, Debug)]
pub struct LayerStrategies {
    /// The problem (`nodes` = the layer's choosing nodes in order, then one `rest` node).
    pub problem: IntraLayerProblem,
    /// Graph node indices (into the layer's node list) each problem node but the last names
    /// (one for matmuls and embeddings, the core matmuls for an attention core).
    pub members: Vec<Vec<usize>>,
    /// Parameter elements per device of each option, same shape as the problem's options.
    pub param_elems: Vec<Vec<f64>>,
    /// The Megatron assignment.
    pub megatron: Vec<usize>,
}

/// Inputs of [`build`] that are not the layer.
pub struct StrategyInputs<'a> {
    /// Cluster.
    pub spec: &'a ClusterSpec,
    /// Links.
    pub comm: &'a CommModel,
    /// Training dtype.
    pub dtype: DType,
    /// Graph bytes → training bytes.
    pub bytes_scale: f64,
    /// Tensor degree.
    pub tp: usize,
    /// Samples per microbatch.
    pub microbatch: f64,
    /// The tensor-parallel group.
    pub tp_group: GroupSpan,
    /// Bytes per parameter in the memory measure (weights, grads, optimizer).
    pub state_bytes_per_param: f64,
    /// Whether norms and elementwise ops run sequence-parallel (÷t); otherwise they run
    /// replicated (`follow`), which is what codegen's plain tensor parallelism emits.
    pub sequence_parallel: bool,
}

fn is_float_init(g: &Graph, v: ValueId) -> bool {
    let val = g.value(v);
    val.kind == ValueKind::Initializer && val.ty.as_ref().is_some_and(|t| t.dtype.is_float())
}

/// The parameter behind a weight operand (itself, or the input of a Transpose of it) and
/// whether it is transposed.
fn weight_param(g: &Graph, producers: &HashMap<ValueId, NodeId>, v: ValueId) -> Option<(ValueId, bool)> {
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
            _ => NodeRole::Follow,
        })
        .collect()
}

/// Where a weight matmul's column split flows inside its layer.
#[derive(Clone, Debug, Default)]
struct Reach {
    /// Weight matmuls reading the split (they must split by rows).
    consumers: BTreeSet<usize>,
    /// Attention cores reached (core matmul indices).
    cores: BTreeSet<usize>,
    /// Nodes run split before any core (layer node indices).
    pre: BTreeSet<usize>,
    /// Per core matmul reached: nodes after it and weight matmuls reading them.
    post: BTreeMap<usize, (BTreeSet<usize>, BTreeSet<usize>)>,
    /// Whether the split leaves the layer outside attention heads (gathered there).
    exits: bool,
}

/// The t-independent split structure of a layer (see [`analyse`]); reuse it across tensor
/// degrees with [`build_from`].
pub struct SplitGraph {
    roles: Vec<NodeRole>,
    /// Per weight matmul: where its column split flows, `None` when codegen cannot carry it.
    reach: BTreeMap<usize, Option<Reach>>,
    /// Attention cores: core matmul indices, other nodes, weight matmuls reading them, and the
    /// head counts of the 4-D reshapes on the way.
    cores: Vec<Core>,
    /// (k, n) of each weight matmul's weight, where known.
    kn: HashMap<usize, (Option<i64>, Option<i64>)>,
    /// Rows of each embedding's table, and whether it is the vocabulary table codegen splits.
    vocab: HashMap<usize, (Option<i64>, bool)>,
    /// Input value of each weight matmul.
    input: HashMap<usize, Option<ValueId>>,
}

#[derive(Clone, Debug, Default)]
struct Core {
    matmuls: BTreeSet<usize>,
    nodes: BTreeSet<usize>,
    consumers: BTreeSet<usize>,
    producers: BTreeSet<usize>,
    heads: BTreeSet<i64>,
}

struct Walker<'g> {
    g: &'g Graph,
    index: &'g HashMap<NodeId, usize>,
    uses: &'g [Vec<NodeId>],
    roles: &'g [NodeRole],
    /// Values a column split reaches (from any producer); `None` in the permissive pass.
    split_values: Option<&'g HashSet<ValueId>>,
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
            // [b, h, s, d] or [b, s, h, d]: a size-1 axis 1 or 2, or a lower rank, broadcasts.
            wd.len() < od.len() || (wd.len() == 4 && (wd[1] == Some(1) || wd[2] == Some(1)))
        } else {
            wd.is_empty() || wd.last().copied().flatten() == Some(1)
        }
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
                    NodeRole::WeightMatmul | NodeRole::Embedding => return None,
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
                let mut next_heads = heads;
                let mut next_core = core;
                match kind {
                    MatMul | Gemm => {
                        r.cores.insert(i);
                        next_core = Some(core.unwrap_or(i));
                        if let Some(c) = core {
                            r.post.entry(c).or_default().0.insert(i);
                        }
                        r.post.entry(i).or_default();
                        let other = n.inputs.iter().flatten().find(|&&w| w != v).copied();
                        if let (Some(w), Some(o)) = (other, out)
                            && self.split_values.is_some_and(|s| !s.contains(&w))
                            && !self.operand_ok(w, o, true)
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
                    k if k.is_elementwise() && k != Where => {
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
}

impl GraphFacts {
    /// Producers and readers of every value of `lg`'s graph.
    pub fn new(lg: &LayeredGraph) -> GraphFacts {
        GraphFacts { producers: producers(&lg.graph), uses: lg.graph.uses() }
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
            NodeRole::Follow => {}
        }
    }
    let producers_list: Vec<usize> = (0..roles.len()).filter(|&i| roles[i] == NodeRole::WeightMatmul).collect();
    let out_of = |i: usize| g.try_node(lay.nodes[i]).and_then(|n| n.outputs.first().copied());
    // Permissive pass: every value a column split could reach.
    let mut split_values: HashSet<ValueId> = HashSet::new();
    {
        let mut w = Walker { g, index: &index, uses, roles: &roles, split_values: None, heads_seen: BTreeSet::new() };
        for &p in &producers_list {
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
    let mut w = Walker { g, index: &index, uses, roles: &roles, split_values: Some(&split_values), heads_seen: BTreeSet::new() };
    for &p in &producers_list {
        w.heads_seen.clear();
        let r = out_of(p).and_then(|o| w.walk(o, p));
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
    SplitGraph { roles, reach, cores, kn, vocab, input }
}

/// Builds the intra-layer problem of `layer` at tensor degree `x.tp` (> 1).
pub fn build(lg: &LayeredGraph, layer: usize, x: &StrategyInputs<'_>) -> LayerStrategies {
    build_from(lg, layer, &analyse(lg, layer, &GraphFacts::new(lg)), x)
}

/// [`build`] from a layer's analysed split structure.
pub fn build_from(lg: &LayeredGraph, layer: usize, sg: &SplitGraph, x: &StrategyInputs<'_>) -> LayerStrategies {
    let lay = &lg.layers[layer];
    let g = &lg.graph;
    let tp = x.tp.max(1) as i64;
    let t = tp as f64;
    let b = x.microbatch;
    let roles = &sg.roles;
    let hidden = lay.input_bytes.max(lay.output_bytes) * b * x.bytes_scale;
    let ar = x.comm.all_reduce(hidden, &x.tp_group);
    // Sequence parallelism as codegen emits it: a row split's all-reduce becomes a
    // reduce-scatter plus a later all-gather (the same bytes), but the reduce-scatter's backward
    // is one more all-gather, and so is that of the residual's local scatter.
    let sp_ag = if x.sequence_parallel { x.comm.all_gather(hidden, &x.tp_group) } else { 0.0 };
    let times_at = |i: usize, share: f64| {
        let id = lay.nodes[i];
        let Some(n) = g.try_node(id) else { return (0.0, 0.0) };
        let mut f = scaled(&lg.node_figures(id), share);
        f.memory_bytes *= x.bytes_scale;
        let tm = node_times(&n.op, &f, x.dtype, x.spec);
        (tm.fwd, tm.bwd)
    };
    let divides = |d: Option<i64>| d.is_none_or(|d| d > 0 && d % tp == 0);
    // Split and whole figures of a node set: (fwd/t, bwd/t, fwd, bwd, params, extra act).
    let figures = |nodes: &mut dyn Iterator<Item = (usize, f64)>| {
        let mut s = [0.0f64; 6];
        for (i, w) in nodes {
            let fig = lg.node_figures(lay.nodes[i]);
            let (sf, sb) = times_at(i, b / t);
            let (rf, rb) = times_at(i, b);
            s[0] += w * sf;
            s[1] += w * sb;
            s[2] += w * rf;
            s[3] += w * rb;
            s[4] += w * fig.param_elems as f64;
            s[5] += w * fig.saved_bytes * b * x.bytes_scale * (1.0 - 1.0 / t);
        }
        s
    };
    let opt = |name: &str, fwd: f64, bwd: f64, elems: f64, act: f64| NodeOption {
        name: name.to_string(),
        fwd_s: fwd,
        bwd_s: bwd,
        param_bytes: elems * x.state_bytes_per_param,
        act_bytes: act,
        sync_s: 0.0,
    };
    // Which columns and cores can split.
    let core_of = |m: usize| sg.cores.iter().position(|c| c.matmuls.contains(&m));
    // Query heads divide by t; fewer (grouped-query KV) heads may be shared by t / h ranks.
    let core_ok: Vec<bool> = sg
        .cores
        .iter()
        .map(|c| c.heads.last().is_none_or(|&q| q % tp == 0) && c.heads.iter().all(|&h| h % tp == 0 || tp % h == 0))
        .collect();
    let mut col_ok: BTreeMap<usize, bool> = BTreeMap::new();
    for (&p, r) in &sg.reach {
        let ok = r.as_ref().is_some_and(|r| {
            divides(sg.kn[&p].1) && r.cores.iter().chain(r.post.keys()).all(|&m| core_of(m).is_none_or(|c| core_ok[c]))
        });
        col_ok.insert(p, ok);
    }
    // Row consumers and the producers/cores feeding them.
    let mut fed_by: BTreeMap<usize, (BTreeSet<usize>, BTreeSet<usize>)> = BTreeMap::new();
    for (&p, r) in &sg.reach {
        if let Some(r) = r.as_ref().filter(|_| col_ok[&p]) {
            for &c in &r.consumers {
                fed_by.entry(c).or_default().0.insert(p);
            }
        }
    }
    for (k, c) in sg.cores.iter().enumerate() {
        for &m in &c.consumers {
            fed_by.entry(m).or_default().1.insert(k);
        }
    }
    let row_ok = |i: usize| fed_by.contains_key(&i) && divides(sg.kn[&i].0);
    // Ownership of the non-choosing nodes: cores, then producers (shared evenly), then rest.
    let mut owner_share: HashMap<usize, Vec<usize>> = HashMap::new();
    for (&p, r) in &sg.reach {
        if let Some(r) = r {
            for &i in &r.pre {
                owner_share.entry(i).or_default().push(p);
            }
        }
    }
    let in_core: HashSet<usize> = sg.cores.iter().flat_map(|c| c.nodes.iter().chain(c.matmuls.iter()).copied()).collect();
    // First column reader of each input value pays the backward input-gradient all-reduce.
    let mut first_reader: HashMap<Option<ValueId>, usize> = HashMap::new();
    for &p in sg.reach.keys() {
        if col_ok[&p] {
            first_reader.entry(sg.input[&p]).or_insert(p);
        }
    }

    let mut nodes = Vec::new();
    let mut members = Vec::new();
    let mut param_elems = Vec::new();
    let mut index_of: HashMap<usize, usize> = HashMap::new();
    let mut core_index: Vec<usize> = Vec::new();
    let mut rest = [0.0f64; 6];
    for (i, role) in roles.iter().enumerate() {
        let id = lay.nodes[i];
        let name = g.try_node(id).map(|n| n.name.clone()).unwrap_or_default();
        match role {
            NodeRole::Follow => {
                if in_core.contains(&i) || owner_share.get(&i).is_some_and(|o| o.iter().any(|p| col_ok[p])) {
                    continue;
                }
                let f = figures(&mut std::iter::once((i, 1.0)));
                for (r, v) in rest.iter_mut().zip(f) {
                    *r += v;
                }
            }
            NodeRole::WeightMatmul => {
                let own = figures(&mut std::iter::once((i, 1.0)));
                let mut options = Vec::new();
                let mut elems = Vec::new();
                if col_ok[&i] {
                    // The ops it feeds before its consumer run split with it (or whole).
                    let region: Vec<(usize, f64)> = owner_share
                        .iter()
                        .filter(|(n, o)| o.contains(&i) && !in_core.contains(n))
                        .map(|(&n, o)| (n, 1.0 / o.iter().filter(|p| col_ok[p]).count().max(1) as f64))
                        .collect();
                    let reg = figures(&mut region.iter().copied());
                    let exit = if sg.reach[&i].as_ref().is_some_and(|r| r.exits) { ar } else { 0.0 };
                    let grad = if first_reader.get(&sg.input[&i]) == Some(&i) { ar } else { 0.0 };
                    options.push(opt(COLUMN, own[0] + reg[0] + exit, own[1] + reg[1] + grad, (own[4] + reg[4]) / t, 0.0));
                    elems.push((own[4] + reg[4]) / t);
                    options.push(opt(REPLICATE, own[2] + reg[2], own[3] + reg[3], own[4] + reg[4], own[5] + reg[5]));
                    elems.push(own[4] + reg[4]);
                } else {
                    options.push(opt(REPLICATE, own[2], own[3], own[4], own[5]));
                    elems.push(own[4]);
                }
                if row_ok(i) {
                    options.insert(options.len() - 1, opt(ROW, own[0] + ar, own[1] + sp_ag, own[4] / t, 0.0));
                    elems.insert(elems.len() - 1, own[4] / t);
                }
                index_of.insert(i, nodes.len());
                nodes.push(IntraNode { name, options });
                param_elems.push(elems);
                members.push(vec![i]);
            }
            NodeRole::Embedding => {
                let own = figures(&mut std::iter::once((i, 1.0)));
                let (rows, is_vocab) = sg.vocab[&i];
                let mut options = Vec::new();
                let mut elems = Vec::new();
                if is_vocab && divides(rows) {
                    options.push(opt(VOCAB, own[0] + ar, own[1], own[4] / t, 0.0));
                    elems.push(own[4] / t);
                }
                options.push(opt(REPLICATE, own[2], own[3], own[4], own[5]));
                elems.push(own[4]);
                index_of.insert(i, nodes.len());
                nodes.push(IntraNode { name, options });
                param_elems.push(elems);
                members.push(vec![i]);
            }
        }
    }
    for (k, c) in sg.cores.iter().enumerate() {
        let all = figures(&mut c.nodes.iter().chain(c.matmuls.iter()).map(|&i| (i, 1.0)));
        let split = core_ok[k] && c.producers.iter().all(|p| col_ok[p]);
        let mut options = Vec::new();
        let mut elems = Vec::new();
        if split {
            options.push(opt(HEADS, all[0], all[1], all[4] / t, 0.0));
            elems.push(all[4] / t);
        }
        options.push(opt(REPLICATE, all[2], all[3], all[4], all[5]));
        elems.push(all[4]);
        let first = c.matmuls.iter().next().copied().unwrap_or(0);
        let name = g.try_node(lay.nodes[first]).map(|n| format!("attention@{}", n.name)).unwrap_or_default();
        core_index.push(nodes.len());
        nodes.push(IntraNode { name, options });
        param_elems.push(elems);
        members.push(c.matmuls.iter().copied().collect());
    }
    let act = lay.figures.saved_bytes.max(lay.input_bytes) * b * x.bytes_scale / t;
    // Hook for `--sequence-parallel`: the rest runs ÷t; otherwise whole on every rank.
    let rest_option = if x.sequence_parallel {
        opt(SEQUENCE, rest[0], rest[1] + sp_ag, rest[4] / t, act)
    } else {
        opt(FOLLOW, rest[2], rest[3], rest[4], act + rest[5])
    };
    param_elems.push(vec![if x.sequence_parallel { rest[4] / t } else { rest[4] }]);
    nodes.push(IntraNode { name: "rest".into(), options: vec![rest_option] });

    // Feasibility edges: split producers ⇔ row consumers / heads cores.
    let names = |k: usize| -> Vec<String> { nodes[k].options.iter().map(|o| o.name.clone()).collect() };
    let mut edges = Vec::new();
    let mut couple = |from: usize, to: usize, split_from: &str, split_to: &str| {
        let (a, bn) = (names(from), names(to));
        let zero = vec![vec![0.0; bn.len()]; a.len()];
        let mut forbidden = Vec::new();
        for (ka, na) in a.iter().enumerate() {
            for (kb, nb) in bn.iter().enumerate() {
                if (na == split_from) != (nb == split_to) {
                    forbidden.push((ka, kb));
                }
            }
        }
        edges.push(IntraEdge { from, to, fwd_s: zero.clone(), bwd_s: zero, forbidden });
    };
    for (&c, (prods, cores)) in &fed_by {
        for p in prods {
            couple(index_of[p], index_of[&c], COLUMN, ROW);
        }
        for &k in cores {
            couple(core_index[k], index_of[&c], HEADS, ROW);
        }
    }
    for (k, c) in sg.cores.iter().enumerate() {
        for p in &c.producers {
            couple(index_of[p], core_index[k], COLUMN, HEADS);
        }
    }
    let problem = IntraLayerProblem { nodes, edges, memory_cap: None, act_weight: 1.0 };
    let megatron = megatron_assignment(&problem);
    LayerStrategies { problem, members, param_elems, megatron }
}

/// The most-split feasible assignment: every node its first (most split) option, then nodes
/// whose edges forbid it fall back to `replicate` until every edge holds.
fn megatron_assignment(p: &IntraLayerProblem) -> Vec<usize> {
    let mut choice: Vec<usize> = p.nodes.iter().map(|n| n.options.iter().position(|o| o.name == ROW).unwrap_or(0)).collect();
    let replicate = |v: usize| p.nodes[v].options.iter().position(|o| o.name == REPLICATE);
    for _ in 0..=p.nodes.len() * 2 {
        let mut changed = false;
        for e in &p.edges {
            if e.forbidden.contains(&(choice[e.from], choice[e.to])) {
                // Give up the split on the side that has a replicate option and is split.
                for v in [e.from, e.to] {
                    if let Some(r) = replicate(v)
                        && choice[v] != r
                    {
                        choice[v] = r;
                        changed = true;
                        break;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    choice
}

impl LayerStrategies {
    /// Parameter elements per device of an assignment.
    pub fn params_of(&self, choice: &[usize]) -> f64 {
        choice.iter().zip(&self.param_elems).map(|(&k, p)| p.get(k).copied().unwrap_or(0.0)).sum()
    }

    /// Strategy name per graph node of the layer for an assignment: choosing nodes (weight
    /// matmuls, embeddings, attention-core matmuls) get their option, all others the `rest`
    /// node's (`follow`, or `sequence` under sequence parallelism).
    pub fn node_names(&self, lg: &LayeredGraph, layer: usize, choice: &[usize]) -> Vec<(String, String)> {
        let lay = &lg.layers[layer];
        let rest = self.problem.nodes.last().and_then(|n| n.options.first()).map_or(FOLLOW, |o| o.name.as_str());
        let mut of: HashMap<usize, &str> = HashMap::new();
        for (k, m) in self.members.iter().enumerate() {
            let name = self.problem.nodes[k].options.get(choice.get(k).copied().unwrap_or(0)).map_or(REPLICATE, |o| o.name.as_str());
            for &i in m {
                of.insert(i, name);
            }
        }
        lay.nodes
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                let node = lg.graph.try_node(id).map(|n| n.name.clone()).unwrap_or_default();
                (node, of.get(&i).copied().unwrap_or(rest).to_string())
            })
            .collect()
    }
}
