//! Sharding strategies per node at tensor degree t and the intra-layer problem they form.
//!
//! Choosing nodes: matmuls with a weight operand (`column`: output sharded, input-gradient
//! all-reduce in the backward; `row`: partial sums all-reduced in the forward; `replicate`),
//! embedding lookups (`vocab`: one forward all-reduce; `replicate`), mixtures of experts
//! (`experts`: each expert's MLP split by its intermediate dim, one all-reduce each way;
//! `replicate`) and attention cores (the
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


use crate::cost::compute::{node_times, saved_bytes, scaled};
use crate::cost::{ClusterSpec, CommModel, GroupSpan};
use crate::ir::{DType, LayeredGraph, ValueId};

use super::Strategy;
use super::analyse::{GraphFacts, NodeRole, SplitGraph, analyse};

/// One strategy a choosing node can take, priced at the tensor degree asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Offer {
    /// The strategy.
    pub strategy: Strategy,
    /// Forward time per microbatch (compute plus the strategy's own forward collective), s.
    pub fwd_s: f64,
    /// Backward time per microbatch, s.
    pub bwd_s: f64,
    /// Parameter elements held per device.
    pub param_elems: f64,
    /// Parameter, gradient and optimizer bytes held per device.
    pub param_bytes: f64,
    /// Bytes kept for the backward pass per microbatch.
    pub act_bytes: f64,
}

/// A choosing node (a weight matmul, an embedding lookup, an attention core) or the layer's
/// aggregate `rest` node (last, no members), with its offers.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeOffers {
    /// Node name (`attention@<first core matmul>` for a core, `rest` for the rest).
    pub name: String,
    /// Indices into the layer's node list this node names.
    pub members: Vec<usize>,
    /// Its strategies, most split first; at least one.
    pub options: Vec<Offer>,
}

/// Two choosing nodes that split together: `from` takes `split_from` exactly when `to` takes
/// `split_to` (a column producer and its row consumer or heads core, a core and its output
/// projection). Emission realises nothing else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coupling {
    /// Index into [`LayerOffers::nodes`].
    pub from: usize,
    /// Index into [`LayerOffers::nodes`].
    pub to: usize,
    /// `from`'s split strategy.
    pub split_from: Strategy,
    /// `to`'s split strategy.
    pub split_to: Strategy,
}

impl Coupling {
    /// Whether the pair of strategies is allowed.
    pub fn allows(&self, a: Strategy, b: Strategy) -> bool {
        (a == self.split_from) == (b == self.split_to)
    }
}

/// What a layer offers the solver at one tensor degree.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerOffers {
    /// Choosing nodes in layer order, then attention cores, then `rest`.
    pub nodes: Vec<NodeOffers>,
    /// Pairs that must split together.
    pub couplings: Vec<Coupling>,
}

/// Inputs of [`offers`] that are not the layer.
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

/// The strategies each choosing node of `layer` can take at tensor degree `x.tp` (> 1), priced.
pub fn offers(lg: &LayeredGraph, layer: usize, x: &StrategyInputs<'_>) -> LayerOffers {
    offers_from(lg, layer, &analyse(lg, layer, &GraphFacts::new(lg)), x)
}

/// [`offers`] from a layer's analysed split structure.
pub fn offers_from(lg: &LayeredGraph, layer: usize, sg: &SplitGraph, x: &StrategyInputs<'_>) -> LayerOffers {
    let lay = &lg.layers[layer];
    let g = &lg.graph;
    let tp = x.tp.max(1) as i64;
    let t = tp as f64;
    let b = x.microbatch;
    let roles = &sg.roles;
    let hidden = lay.input_bytes.max(lay.output_bytes) * b * x.bytes_scale;
    let ar = x.comm.all_reduce(hidden, &x.tp_group);
    let ag = x.comm.all_gather(hidden, &x.tp_group);
    // Sequence parallelism as codegen emits it: a row split's all-reduce becomes a
    // reduce-scatter plus a later all-gather (before the next column split, or at the layer's
    // exit), but the reduce-scatter's backward is one more all-gather, and so is that of the
    // residual's local scatter. Parameters applied to a sequence chunk (the row's deferred
    // bias, norms in `rest`) get partial gradients: one all-reduce each.
    let sp_ag = if x.sequence_parallel { ag } else { 0.0 };
    let row_fwd = if x.sequence_parallel { x.comm.reduce_scatter(hidden, &x.tp_group) + ag } else { ar };
    let partial_grad = |elems: f64| {
        if x.sequence_parallel && elems > 0.0 { x.comm.all_reduce(elems * x.dtype.size_bytes() as f64, &x.tp_group) } else { 0.0 }
    };
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
            s[5] += w * saved_bytes(&fig, x.spec) * b * x.bytes_scale * (1.0 - 1.0 / t);
        }
        s
    };
    let opt = |strategy: Strategy, fwd: f64, bwd: f64, elems: f64, act: f64| Offer {
        strategy,
        fwd_s: fwd,
        bwd_s: bwd,
        param_elems: elems,
        param_bytes: elems * x.state_bytes_per_param,
        act_bytes: act,
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
    let mut index_of: HashMap<usize, usize> = HashMap::new();
    let mut core_index: Vec<usize> = Vec::new();
    let mut rest = [0.0f64; 6];
    let mut rest_partial_grads = 0.0;
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
                rest_partial_grads += partial_grad(f[4]);
            }
            NodeRole::WeightMatmul => {
                let own = figures(&mut std::iter::once((i, 1.0)));
                let mut options = Vec::new();
                if col_ok[&i] {
                    // The ops it feeds before its consumer run split with it (or whole).
                    let region: Vec<(usize, f64)> = owner_share
                        .iter()
                        .filter(|(n, o)| o.contains(&i) && !in_core.contains(n))
                        .map(|(&n, o)| (n, 1.0 / o.iter().filter(|p| col_ok[p]).count().max(1) as f64))
                        .collect();
                    let reg = figures(&mut region.iter().copied());
                    // A split output that leaves the split region is all-gathered by codegen,
                    // but priced as an all-reduce (twice its traffic): the exact price moves
                    // Megatron's Table 1 76.1B row past 10 % of its published rate
                    // (tests/published_runs.rs), whose runs use a vocabulary-parallel loss
                    // this model does not price; both belong together.
                    let exit = if sg.reach[&i].as_ref().is_some_and(|r| r.exits) { ar } else { 0.0 };
                    let grad = if first_reader.get(&sg.input[&i]) == Some(&i) { ar } else { 0.0 };
                    options.push(opt(Strategy::Column, own[0] + reg[0] + exit, own[1] + reg[1] + grad, (own[4] + reg[4]) / t, 0.0));
                    options.push(opt(Strategy::Replicate, own[2] + reg[2], own[3] + reg[3], own[4] + reg[4], own[5] + reg[5]));
                } else {
                    options.push(opt(Strategy::Replicate, own[2], own[3], own[4], own[5]));
                }
                if row_ok(i) {
                    let bias = match sg.kn[&i] {
                        (Some(k), Some(n)) => (own[4] - (k * n) as f64).max(0.0),
                        _ => 0.0,
                    };
                    options.insert(options.len() - 1, opt(Strategy::Row, own[0] + row_fwd, own[1] + sp_ag + partial_grad(bias), own[4] / t, 0.0));
                }
                index_of.insert(i, nodes.len());
                nodes.push(NodeOffers { name, members: Vec::new(), options });
                members.push(vec![i]);
            }
            NodeRole::Experts => {
                let own = figures(&mut std::iter::once((i, 1.0)));
                let (inter, routes) = sg.experts[&i];
                let mut options = Vec::new();
                if divides(inter) {
                    // the output's partial sums are reduced like a row split's; backward, the
                    // gradients of the tokens and of the router's weights are all-reduced
                    let weights_ar = x.comm.all_reduce(hidden * routes, &x.tp_group);
                    options.push(opt(Strategy::Experts, own[0] + row_fwd, own[1] + ar + weights_ar + sp_ag, own[4] / t, 0.0));
                }
                options.push(opt(Strategy::Replicate, own[2], own[3], own[4], own[5]));
                index_of.insert(i, nodes.len());
                nodes.push(NodeOffers { name, members: Vec::new(), options });
                members.push(vec![i]);
            }
            NodeRole::Embedding => {
                let own = figures(&mut std::iter::once((i, 1.0)));
                let (rows, is_vocab) = sg.vocab[&i];
                let mut options = Vec::new();
                if is_vocab && divides(rows) {
                    options.push(opt(Strategy::Vocab, own[0] + ar, own[1], own[4] / t, 0.0));
                }
                options.push(opt(Strategy::Replicate, own[2], own[3], own[4], own[5]));
                index_of.insert(i, nodes.len());
                nodes.push(NodeOffers { name, members: Vec::new(), options });
                members.push(vec![i]);
            }
        }
    }
    for (k, c) in sg.cores.iter().enumerate() {
        let all = figures(&mut c.nodes.iter().chain(c.matmuls.iter()).map(|&i| (i, 1.0)));
        let split = core_ok[k] && c.producers.iter().all(|p| col_ok[p]);
        let mut options = Vec::new();
        if split {
            options.push(opt(Strategy::Heads, all[0], all[1], all[4] / t, 0.0));
        }
        options.push(opt(Strategy::Replicate, all[2], all[3], all[4], all[5]));
        let first = c.matmuls.iter().next().copied().unwrap_or(0);
        let name = g.try_node(lay.nodes[first]).map(|n| format!("attention@{}", n.name)).unwrap_or_default();
        core_index.push(nodes.len());
        nodes.push(NodeOffers { name, members: Vec::new(), options });
        members.push(c.matmuls.iter().copied().collect());
    }
    let act = saved_bytes(&lay.figures, x.spec).max(lay.input_bytes) * b * x.bytes_scale / t;
    // Hook for `--sequence-parallel`: the rest runs ÷t; otherwise whole on every rank.
    let rest_option = if x.sequence_parallel {
        opt(Strategy::Sequence, rest[0], rest[1] + sp_ag + rest_partial_grads, rest[4] / t, act)
    } else {
        opt(Strategy::Follow, rest[2], rest[3], rest[4], act + rest[5])
    };
    nodes.push(NodeOffers { name: "rest".into(), members: Vec::new(), options: vec![rest_option] });

    // Feasibility: split producers ⇔ row consumers / heads cores.
    let mut couplings = Vec::new();
    for (&c, (prods, cores)) in &fed_by {
        for p in prods {
            couplings.push(Coupling { from: index_of[p], to: index_of[&c], split_from: Strategy::Column, split_to: Strategy::Row });
        }
        for &k in cores {
            couplings.push(Coupling { from: core_index[k], to: index_of[&c], split_from: Strategy::Heads, split_to: Strategy::Row });
        }
    }
    for (k, c) in sg.cores.iter().enumerate() {
        for p in &c.producers {
            couplings.push(Coupling { from: index_of[p], to: core_index[k], split_from: Strategy::Column, split_to: Strategy::Heads });
        }
    }
    for (node, m) in nodes.iter_mut().zip(members) {
        node.members = m;
    }
    LayerOffers { nodes, couplings }
}
