//! Sharding strategies per node at tensor degree t and the intra-layer problem they form.
//!
//! Nodes with choices: matmuls with a weight operand (`column`: output sharded, input-gradient
//! all-reduce in the backward; `row`: partial sums all-reduced in the forward; `replicate`) and
//! embedding lookups (`vocab`: one forward all-reduce; `replicate`). Every other op of the layer
//! runs sharded (`sequence`, attention by heads) and is one aggregate node with that single
//! option. Consecutive weight matmuls are joined by resharding edges (an all-gather where a
//! sharded output feeds an op that needs it whole). The Megatron split (column/row
//! alternating, vocabulary-split embeddings) is one assignment of this problem and costs
//! exactly what the Megatron layer point costs, so the ILP's optimum is never slower.

use crate::cost::compute::{node_times, scaled};
use crate::cost::{ClusterSpec, CommModel, GroupSpan};
use crate::ir::{DType, LayeredGraph, OpKind, ValueKind};

use super::problem::{IntraEdge, IntraLayerProblem, IntraNode, NodeOption};

/// What a node of a layer is to the tensor split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeRole {
    /// A matmul/Gemm whose second operand is a parameter.
    WeightMatmul,
    /// A gather from a parameter table.
    Embedding,
    /// Anything else (follows its input, sequence-parallel).
    Follow,
}

/// Option indices of a weight matmul.
pub const COLUMN: usize = 0;
/// Row split (partial sums).
pub const ROW: usize = 1;
/// Whole weight on every tensor rank.
pub const REPLICATE: usize = 2;
/// Option index of a vocabulary-split embedding.
pub const VOCAB: usize = 0;
/// Option index of a replicated embedding.
pub const EMB_REPLICATE: usize = 1;

/// The intra-layer problem of one layer with what is needed to name its answer.
#[derive(Clone, Debug)]
pub struct LayerStrategies {
    /// The problem (`nodes` = the layer's choosing nodes in order, then one `rest` node).
    pub problem: IntraLayerProblem,
    /// Graph node index (into the layer's node list) of each problem node but the last.
    pub members: Vec<usize>,
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
}

/// Roles of a layer's nodes, in the layer's node order.
pub fn roles(lg: &LayeredGraph, layer: usize) -> Vec<NodeRole> {
    let g = &lg.graph;
    let is_param = |v: Option<crate::ir::ValueId>| {
        v.is_some_and(|v| {
            let val = g.value(v);
            val.kind == ValueKind::Initializer && val.ty.as_ref().is_some_and(|t| t.dtype.is_float())
        })
    };
    lg.layers[layer]
        .nodes
        .iter()
        .map(|&id| match g.try_node(id).and_then(|n| n.op.kind().map(|k| (n, k))) {
            Some((n, OpKind::MatMul | OpKind::Gemm)) if is_param(n.inputs.get(1).copied().flatten()) => NodeRole::WeightMatmul,
            Some((n, OpKind::Gather)) if is_param(n.inputs.first().copied().flatten()) => NodeRole::Embedding,
            _ => NodeRole::Follow,
        })
        .collect()
}

/// Builds the intra-layer problem of `layer` at tensor degree `x.tp` (> 1).
pub fn build(lg: &LayeredGraph, layer: usize, x: &StrategyInputs<'_>) -> LayerStrategies {
    let lay = &lg.layers[layer];
    let g = &lg.graph;
    let t = x.tp.max(1) as f64;
    let b = x.microbatch;
    let roles = roles(lg, layer);
    let hidden = lay.input_bytes.max(lay.output_bytes) * b * x.bytes_scale;
    let ar = x.comm.all_reduce(hidden, &x.tp_group);
    let ag = x.comm.all_gather(hidden, &x.tp_group);
    let times_at = |i: usize, share: f64| {
        let id = lay.nodes[i];
        let Some(n) = g.try_node(id) else { return (0.0, 0.0) };
        let mut f = scaled(&lg.node_figures(id), share);
        f.memory_bytes *= x.bytes_scale;
        let tm = node_times(&n.op, &f, x.dtype, x.spec);
        (tm.fwd, tm.bwd)
    };
    let opt = |name: &str, fwd: f64, bwd: f64, elems: f64, act: f64| NodeOption {
        name: name.to_string(),
        fwd_s: fwd,
        bwd_s: bwd,
        param_bytes: elems * x.state_bytes_per_param,
        act_bytes: act,
        sync_s: 0.0,
    };
    let matmuls: Vec<usize> = (0..roles.len()).filter(|&i| roles[i] == NodeRole::WeightMatmul).collect();
    let (first_mm, last_mm) = (matmuls.first().copied(), matmuls.last().copied());
    let mut nodes = Vec::new();
    let mut members = Vec::new();
    let mut param_elems = Vec::new();
    let mut megatron = Vec::new();
    let (mut rest_fwd, mut rest_bwd, mut rest_params) = (0.0, 0.0, 0.0);
    let mut mm_seen = 0usize;
    for (i, role) in roles.iter().enumerate() {
        let id = lay.nodes[i];
        let fig = lg.node_figures(id);
        let elems = fig.param_elems as f64;
        let (sf, sb) = times_at(i, b / t);
        let name = g.try_node(id).map(|n| n.name.clone()).unwrap_or_default();
        // Saved bytes the node keeps beyond its shard when it is replicated.
        let extra_act = fig.saved_bytes * b * x.bytes_scale * (1.0 - 1.0 / t);
        match role {
            NodeRole::Follow => {
                rest_fwd += sf;
                rest_bwd += sb;
                rest_params += elems;
            }
            NodeRole::WeightMatmul => {
                let (rf, rb) = times_at(i, b);
                // Megatron's accounting: an odd last column is gathered with an all-reduce;
                // a row split first in the layer gathers its input gradient.
                let col_exit = if Some(i) == last_mm { ar } else { 0.0 };
                let row_entry = if Some(i) == first_mm { ag } else { 0.0 };
                nodes.push(IntraNode {
                    name,
                    options: vec![
                        opt("column", sf + col_exit, sb + ar, elems / t, 0.0),
                        opt("row", sf + ar, sb + row_entry, elems / t, 0.0),
                        opt("replicate", rf, rb, elems, extra_act),
                    ],
                });
                param_elems.push(vec![elems / t, elems / t, elems]);
                megatron.push(if mm_seen % 2 == 0 { COLUMN } else { ROW });
                mm_seen += 1;
                members.push(i);
            }
            NodeRole::Embedding => {
                let (rf, rb) = times_at(i, b);
                nodes.push(IntraNode {
                    name,
                    options: vec![opt("vocab", sf + ar, sb, elems / t, 0.0), opt("replicate", rf, rb, elems, extra_act)],
                });
                param_elems.push(vec![elems / t, elems]);
                megatron.push(VOCAB);
                members.push(i);
            }
        }
    }
    let act = lay.figures.saved_bytes.max(lay.input_bytes) * b * x.bytes_scale / t;
    nodes.push(IntraNode { name: "rest".into(), options: vec![opt("sequence", rest_fwd, rest_bwd, rest_params / t, act)] });
    param_elems.push(vec![rest_params / t]);
    megatron.push(0);
    // Resharding between consecutive weight matmuls (rows: producer option, columns: consumer).
    let mut edges = Vec::new();
    let mm_index: Vec<usize> = members.iter().enumerate().filter(|(_, i)| roles[**i] == NodeRole::WeightMatmul).map(|(k, _)| k).collect();
    for w in mm_index.windows(2) {
        let fwd = vec![vec![ag, 0.0, ag], vec![0.0; 3], vec![0.0; 3]];
        let bwd = vec![vec![0.0; 3], vec![0.0, ag, 0.0], vec![0.0, ag, 0.0]];
        edges.push(IntraEdge { from: w[0], to: w[1], fwd_s: fwd, bwd_s: bwd });
    }
    LayerStrategies {
        problem: IntraLayerProblem { nodes, edges, memory_cap: None, act_weight: 1.0 },
        members,
        param_elems,
        megatron,
    }
}

impl LayerStrategies {
    /// Parameter elements per device of an assignment.
    pub fn params_of(&self, choice: &[usize]) -> f64 {
        choice.iter().zip(&self.param_elems).map(|(&k, p)| p.get(k).copied().unwrap_or(0.0)).sum()
    }

    /// Strategy name per graph node of the layer for an assignment (`follow` nodes get `rest`).
    pub fn node_names(&self, lg: &LayeredGraph, layer: usize, choice: &[usize]) -> Vec<(String, String)> {
        let lay = &lg.layers[layer];
        let rest = self.problem.nodes.last().and_then(|n| n.options.first()).map_or("sequence", |o| o.name.as_str());
        lay.nodes
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                let node = lg.graph.try_node(id).map(|n| n.name.clone()).unwrap_or_default();
                let s = match self.members.iter().position(|&m| m == i) {
                    Some(k) => self.problem.nodes[k].options[choice[k]].name.clone(),
                    None => rest.to_string(),
                };
                (node, s)
            })
            .collect()
    }
}
