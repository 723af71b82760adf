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

use crate::cost::compute::{SplitDim, node_times, product_dtype, saved_bytes, split};
use crate::cost::{ClusterSpec, CommModel, GroupSpan};
use crate::ir::{DType, Layer, LayeredGraph, ValueId};

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
    /// The model's byte figures at the training precision.
    pub bytes: &'a crate::cost::TrainingBytes,
    /// Tensor degree.
    pub tp: usize,
    /// Samples per microbatch.
    pub microbatch: f64,
    /// The tensor-parallel group.
    pub tp_group: GroupSpan,
    /// Bytes per parameter in the memory measure (weights, grads, optimizer).
    pub state_bytes_per_param: f64,
    /// Bytes per element of a parameter's gradient (what its all-reduce moves).
    pub grad_bytes_per_param: f64,
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
    let p = Pricer::new(lg, layer, x);
    let f = Feasible::new(sg, &p);
    let (lay, g) = (p.lay, &lg.graph);
    let mut nodes = Vec::new();
    let mut members = Vec::new();
    let mut index_of: HashMap<usize, usize> = HashMap::new();
    let mut rest = [0.0f64; 6];
    let mut rest_partial_grads = 0.0;
    for (i, role) in sg.roles.iter().enumerate() {
        let name = g.try_node(lay.nodes[i]).map(|n| n.name.clone()).unwrap_or_default();
        let options = match role {
            NodeRole::Follow => {
                if f.in_core.contains(&i) || f.owner_share.get(&i).is_some_and(|o| o.iter().any(|q| f.col_ok[q])) {
                    continue;
                }
                let fig = p.figures([(i, 1.0)]);
                for (r, v) in rest.iter_mut().zip(fig) {
                    *r += v;
                }
                rest_partial_grads += p.partial_grad(fig[4]);
                continue;
            }
            // what emission keeps whole is offered whole
            _ if sg.opaque.contains(&i) => vec![p.replicate(&p.figures([(i, 1.0)]))],
            NodeRole::WeightMatmul => p.weight_matmul_offers(&f, i),
            NodeRole::Experts => p.experts_offers(sg.experts[&i], i),
            NodeRole::Embedding => p.embedding_offers(sg.vocab[&i], i),
        };
        index_of.insert(i, nodes.len());
        nodes.push(NodeOffers { name, members: Vec::new(), options });
        members.push(vec![i]);
    }
    let mut core_index: Vec<usize> = Vec::new();
    for (k, c) in sg.cores.iter().enumerate() {
        let first = c.matmuls.iter().next().copied().unwrap_or(0);
        let name = g.try_node(lay.nodes[first]).map(|n| format!("attention@{}", n.name)).unwrap_or_default();
        core_index.push(nodes.len());
        nodes.push(NodeOffers { name, members: Vec::new(), options: p.core_offers(&f, k) });
        members.push(c.matmuls.iter().copied().collect());
    }
    let lb = x.bytes.layer(layer);
    // the weight copies autocast's products keep split with the weights
    let act = (crate::cost::compute::layer_saved_bytes(&lb, x.spec).max(lb.input_bytes) * p.b + lb.weight_copy_bytes) / p.t;
    // Hook for `--sequence-parallel`: the rest runs ÷t; otherwise whole on every rank.
    let rest_option = if x.sequence_parallel {
        p.opt(Strategy::Sequence, rest[0], rest[1] + p.sp_ag + rest_partial_grads, rest[4] / p.t, act)
    } else {
        p.opt(Strategy::Follow, rest[2], rest[3], rest[4], act + rest[5])
    };
    nodes.push(NodeOffers { name: "rest".into(), members: Vec::new(), options: vec![rest_option] });
    for (node, m) in nodes.iter_mut().zip(members) {
        node.members = m;
    }
    LayerOffers { nodes, couplings: f.couplings(&index_of, &core_index) }
}

/// What pricing a layer's offers at one tensor degree needs: the layer, the inputs, and the
/// collective times every family's offers share.
pub(super) struct Pricer<'a> {
    pub lg: &'a LayeredGraph,
    pub lay: &'a Layer,
    pub x: &'a StrategyInputs<'a>,
    /// The tensor degree.
    pub tp: i64,
    /// The same, as a divisor.
    pub t: f64,
    /// Samples per microbatch.
    pub b: f64,
    /// Bytes of the layer's larger boundary value per microbatch.
    pub hidden: f64,
    /// All-reduce of `hidden` over the tensor group.
    pub ar: f64,
    /// Sequence parallelism's extra all-gather (0 without it).
    pub sp_ag: f64,
    /// A row split's forward collective: an all-reduce, or under sequence parallelism a
    /// reduce-scatter plus a later all-gather.
    pub row_fwd: f64,
}

impl<'a> Pricer<'a> {
    fn new(lg: &'a LayeredGraph, layer: usize, x: &'a StrategyInputs<'a>) -> Pricer<'a> {
        let lay = &lg.layers[layer];
        let tp = x.tp.max(1) as i64;
        let b = x.microbatch;
        let lb = x.bytes.layer(layer);
        let hidden = lb.input_bytes.max(lb.output_bytes) * b;
        let ar = x.comm.all_reduce(hidden, &x.tp_group);
        let ag = x.comm.all_gather(hidden, &x.tp_group);
        // Sequence parallelism as codegen emits it: a row split's all-reduce becomes a
        // reduce-scatter plus a later all-gather (before the next column split, or at the layer's
        // exit), but the reduce-scatter's backward is one more all-gather, and so is that of the
        // residual's local scatter. Parameters applied to a sequence chunk (the row's deferred
        // bias, norms in `rest`) get partial gradients: one all-reduce each.
        let sp_ag = if x.sequence_parallel { ag } else { 0.0 };
        let row_fwd = if x.sequence_parallel { x.comm.reduce_scatter(hidden, &x.tp_group) + ag } else { ar };
        Pricer { lg, lay, x, tp, t: tp as f64, b, hidden, ar, sp_ag, row_fwd }
    }

    /// The all-reduce of a parameter's partial gradient under sequence parallelism (0 without).
    pub fn partial_grad(&self, elems: f64) -> f64 {
        if self.x.sequence_parallel && elems > 0.0 { self.x.comm.all_reduce(elems * self.x.grad_bytes_per_param, &self.x.tp_group) } else { 0.0 }
    }

    /// Forward and backward time of layer node `i` on the microbatch, split `t` ways along `dim`.
    fn times_at(&self, i: usize, t: f64, dim: SplitDim) -> (f64, f64) {
        let id = self.lay.nodes[i];
        let Some(n) = self.lg.graph.try_node(id) else { return (0.0, 0.0) };
        let f = split(&self.x.bytes.node(id), self.b, t, dim);
        let dtype = product_dtype(&n.op, &f, self.lay.kind, self.x.dtype, self.x.spec);
        let tm = node_times(&n.op, &f, dtype, self.x.spec);
        (tm.fwd, tm.bwd)
    }

    /// Whether a dim (unknown: yes) divides by the tensor degree.
    pub fn divides(&self, d: Option<i64>) -> bool {
        d.is_none_or(|d| d > 0 && d % self.tp == 0)
    }

    /// Split and whole figures of weighted layer nodes: (fwd/t, bwd/t, fwd, bwd, params,
    /// activation bytes a split saves), the split dividing their tokens.
    pub fn figures(&self, nodes: impl IntoIterator<Item = (usize, f64)>) -> [f64; 6] {
        self.figures_split(nodes, SplitDim::Rows)
    }

    /// [`Self::figures`] with the split dividing the nodes' products along `dim`.
    pub fn figures_split(&self, nodes: impl IntoIterator<Item = (usize, f64)>, dim: SplitDim) -> [f64; 6] {
        let (b, t) = (self.b, self.t);
        let mut s = [0.0f64; 6];
        for (i, w) in nodes {
            let fig = self.x.bytes.node(self.lay.nodes[i]);
            let (sf, sb) = self.times_at(i, t, dim);
            let (rf, rb) = self.times_at(i, 1.0, dim);
            s[0] += w * sf;
            s[1] += w * sb;
            s[2] += w * rf;
            s[3] += w * rb;
            s[4] += w * fig.param_elems as f64;
            s[5] += w * saved_bytes(&fig, self.x.spec) * b * (1.0 - 1.0 / t);
        }
        s
    }

    /// An offer of `strategy` at these times and sizes.
    pub fn opt(&self, strategy: Strategy, fwd: f64, bwd: f64, elems: f64, act: f64) -> Offer {
        Offer { strategy, fwd_s: fwd, bwd_s: bwd, param_elems: elems, param_bytes: elems * self.x.state_bytes_per_param, act_bytes: act }
    }

    /// The whole (replicated) offer from a node set's figures.
    pub fn replicate(&self, f: &[f64; 6]) -> Offer {
        self.opt(Strategy::Replicate, f[2], f[3], f[4], f[5])
    }
}

/// Which splits of a layer's structure divide at the tensor degree, and who owns the nodes
/// that are not choosing ones.
pub(super) struct Feasible<'a> {
    pub sg: &'a SplitGraph,
    /// Per attention core: its heads divide (or grouped KV heads are shared).
    pub core_ok: Vec<bool>,
    /// Per weight matmul: a column split divides and every core it reaches can split.
    pub col_ok: BTreeMap<usize, bool>,
    /// Row consumers: the column producers and cores feeding them.
    pub fed_by: BTreeMap<usize, (BTreeSet<usize>, BTreeSet<usize>)>,
    /// Non-choosing nodes run split with these column producers.
    pub owner_share: HashMap<usize, Vec<usize>>,
    /// The nodes of attention cores.
    pub in_core: HashSet<usize>,
    /// The first column reader of each input value (it pays the backward all-reduce).
    pub first_reader: HashMap<Option<ValueId>, usize>,
}

impl<'a> Feasible<'a> {
    fn new(sg: &'a SplitGraph, p: &Pricer<'_>) -> Feasible<'a> {
        let tp = p.tp;
        let core_of = |m: usize| sg.cores.iter().position(|c| c.matmuls.contains(&m));
        // Query heads divide by t; fewer (grouped-query KV) heads may be shared by t / h ranks.
        let core_ok: Vec<bool> = sg
            .cores
            .iter()
            .map(|c| c.heads.last().is_none_or(|&q| q % tp == 0) && c.heads.iter().all(|&h| h % tp == 0 || tp % h == 0))
            .collect();
        let mut col_ok: BTreeMap<usize, bool> = BTreeMap::new();
        for (&m, r) in &sg.reach {
            let ok = r.as_ref().is_some_and(|r| p.divides(sg.kn[&m].1) && r.cores.iter().chain(r.post.keys()).all(|&m| core_of(m).is_none_or(|c| core_ok[c])));
            col_ok.insert(m, ok);
        }
        let mut fed_by: BTreeMap<usize, (BTreeSet<usize>, BTreeSet<usize>)> = BTreeMap::new();
        for (&m, r) in &sg.reach {
            if let Some(r) = r.as_ref().filter(|_| col_ok[&m]) {
                for &c in &r.consumers {
                    fed_by.entry(c).or_default().0.insert(m);
                }
            }
        }
        for (k, c) in sg.cores.iter().enumerate() {
            for &m in &c.consumers {
                fed_by.entry(m).or_default().1.insert(k);
            }
        }
        // Ownership of the non-choosing nodes: cores, then producers (shared evenly), then rest.
        let mut owner_share: HashMap<usize, Vec<usize>> = HashMap::new();
        for (&m, r) in &sg.reach {
            if let Some(r) = r {
                for &i in &r.pre {
                    owner_share.entry(i).or_default().push(m);
                }
            }
        }
        let in_core: HashSet<usize> = sg.cores.iter().flat_map(|c| c.nodes.iter().chain(c.matmuls.iter()).copied()).collect();
        let mut first_reader: HashMap<Option<ValueId>, usize> = HashMap::new();
        for &m in sg.reach.keys() {
            if col_ok[&m] {
                first_reader.entry(sg.input[&m]).or_insert(m);
            }
        }
        Feasible { sg, core_ok, col_ok, fed_by, owner_share, in_core, first_reader }
    }

    /// Whether weight matmul `i` can split by rows: something split feeds it and its
    /// contracted dim divides.
    pub fn row_ok(&self, p: &Pricer<'_>, i: usize) -> bool {
        self.fed_by.contains_key(&i) && p.divides(self.sg.kn[&i].0)
    }

    /// Split producers ⇔ row consumers / heads cores.
    fn couplings(&self, index_of: &HashMap<usize, usize>, core_index: &[usize]) -> Vec<Coupling> {
        let mut couplings = Vec::new();
        for (&c, (prods, cores)) in &self.fed_by {
            for m in prods {
                couplings.push(Coupling { from: index_of[m], to: index_of[&c], split_from: Strategy::Column, split_to: Strategy::Row });
            }
            for &k in cores {
                couplings.push(Coupling { from: core_index[k], to: index_of[&c], split_from: Strategy::Heads, split_to: Strategy::Row });
            }
        }
        for (k, c) in self.sg.cores.iter().enumerate() {
            for m in &c.producers {
                couplings.push(Coupling { from: index_of[m], to: core_index[k], split_from: Strategy::Column, split_to: Strategy::Heads });
            }
        }
        couplings
    }
}
