//! Per-layer recompute: a stage with checkpointed layers runs as segments, each checkpointed
//! layer one segment and each run of layers that keep their activations another. A checkpointed
//! segment's forward runs without autograd and keeps only its inputs (what its recompute starts
//! from, the offloader's to move); its backward recomputes it from them. Every segment's
//! floating-point inputs are fresh gradient leaves, so the backward goes segment by segment,
//! last first, each feeding its inputs' gradients to the segments that made them: what
//! `torch.utils.checkpoint` does around each checkpointed layer.
//!
//! Selective recompute runs inside a segment that keeps its autograd graph: the outputs of its
//! normalisations and activation functions that the plan names are freed once the forward has
//! run (their storage, which autograd's saved references share) and rebuilt into the same
//! storage before the segment's backward, as Megatron-Core's `CheckpointWithoutOutput` does; a
//! mixture of experts so named frees and rebuilds its experts' activations instead (`moe_act`).

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::ir::{Graph, NodeId, ValueId};

/// A run of consecutive nodes of a stage's execution order, in the ids of the graph that runs
/// it (the model's, or a tensor-parallel stage's shard subgraph's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Segment {
    /// Its nodes, in execution order.
    pub nodes: Vec<NodeId>,
    /// A checkpointed layer: no autograd in the forward, recomputed in the backward.
    pub checkpointed: bool,
    /// Values it reads that an earlier segment made or the stage received.
    pub inputs: Vec<ValueId>,
    /// Values it makes that a later segment reads or the stage yields.
    pub outputs: Vec<ValueId>,
    /// Positions (in the rank's `Params`) of the trained parameters its nodes read (filled in
    /// once the parameters are known).
    pub params: Vec<usize>,
    /// Nodes of a segment that keeps its activations whose output is freed after its forward
    /// and rebuilt before its backward (selective recompute), in execution order.
    pub rebuilt: Vec<NodeId>,
    /// Nodes of such a segment whose outputs it holds until its backward though no backward
    /// reads them (torchtitan's per-op policy keeps them).
    pub held: Vec<NodeId>,
}

/// A stage's selective recompute by node name ([`crate::codegen::encode::StageCode`]'s
/// `selective_nodes` and `selective_kept`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SelectiveNames {
    /// Nodes whose outputs are freed after the forward and rebuilt before the backward.
    pub rebuilt: HashSet<String>,
    /// Nodes whose outputs are held from the forward to the backward.
    pub kept: HashSet<String>,
}

impl SelectiveNames {
    /// True when the stage recomputes nothing selectively.
    pub fn is_empty(&self) -> bool {
        self.rebuilt.is_empty()
    }
}

/// A recomputed stage's segments, and which kept values may leave the device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct StageSegments {
    /// In execution order.
    pub segments: Vec<Segment>,
    /// Kept values one offloaded layer alone reads (those the offloader moves to host memory).
    pub movable: HashSet<ValueId>,
    /// Segment inputs that carry no gradient in the model (masks, positions, rotary tables made
    /// from the data and constants): plain tensors, never gradient leaves. A mask made a leaf
    /// would also turn fused attention into its math path, which keeps the s × s probabilities.
    pub no_gradient: HashSet<ValueId>,
}

/// The segments of a stage running `order` in `graph`: `layer_of` names each node's layer
/// (nodes it does not name, such as collectives inserted by sharding, belong to the layer of
/// the node before them), `checkpointed` and `offloaded` the stage's layers of each kind,
/// `received` the values the stage gets from the previous one, `yields` what it gives on and
/// `shared` the names of values several layers of the model read (kept on the device, as the
/// planner prices offloading: `Layer::offload_bytes`). `per_layer`: every layer its own
/// segment (ZeRO 3 gathers each layer's parameters for its segment alone; selective recompute
/// rebuilds one layer's outputs at a time). `selective`: the names of the nodes whose outputs
/// are rebuilt ([`Segment::rebuilt`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn stage_segments(
    graph: &Graph,
    order: &[NodeId],
    layer_of: &HashMap<&str, usize>,
    (checkpointed, offloaded): (&BTreeSet<usize>, &BTreeSet<usize>),
    (received, yields): (&HashSet<ValueId>, &[ValueId]),
    shared: &HashSet<String>,
    per_layer: bool,
    selective: &SelectiveNames,
) -> StageSegments {
    let layers = node_layers(graph, order, layer_of);
    // each layer's nodes together (the order may interleave a layer's nodes with ones an
    // earlier layer makes for later ones), where that keeps every value made before its use
    let mut by_layer: Vec<(NodeId, usize)> = order.iter().copied().zip(layers.iter().copied()).collect();
    by_layer.sort_by_key(|&(_, l)| l);
    let mut made: HashSet<ValueId> = HashSet::new();
    let mine: HashSet<ValueId> = order.iter().flat_map(|&n| graph.node(n).outputs.iter().copied()).collect();
    let topological = by_layer.iter().all(|&(n, _)| {
        let node = graph.node(n);
        let ok = node.inputs.iter().flatten().all(|v| !mine.contains(v) || made.contains(v));
        made.extend(node.outputs.iter().copied());
        ok
    });
    let ordered: Vec<(NodeId, usize)> = if topological { by_layer } else { order.iter().copied().zip(layers.iter().copied()).collect() };
    // group: a checkpointed layer alone, consecutive other layers together (or each alone)
    let mut groups: Vec<(bool, Option<usize>, Vec<NodeId>)> = Vec::new();
    for &(n, l) in &ordered {
        let ck = checkpointed.contains(&l);
        let key = (ck || per_layer).then_some(l);
        match groups.last_mut() {
            Some((c, k, nodes)) if *c == ck && *k == key => nodes.push(n),
            _ => groups.push((ck, key, vec![n])),
        }
    }
    let mut made_in: HashMap<ValueId, usize> = HashMap::new();
    for (i, (_, _, nodes)) in groups.iter().enumerate() {
        for &n in nodes {
            for &v in &graph.node(n).outputs {
                made_in.insert(v, i);
            }
        }
    }
    let mut segments: Vec<Segment> = groups
        .iter()
        .map(|(ck, _, nodes)| Segment { nodes: nodes.clone(), checkpointed: *ck, inputs: Vec::new(), outputs: Vec::new(), params: Vec::new(), rebuilt: Vec::new(), held: Vec::new() })
        .collect();
    for (i, seg) in segments.iter_mut().enumerate() {
        let mut seen = HashSet::new();
        for &n in &seg.nodes {
            for &v in graph.node(n).inputs.iter().flatten() {
                let outside = made_in.get(&v).map_or(received.contains(&v), |&j| j < i);
                if outside && seen.insert(v) {
                    seg.inputs.push(v);
                }
            }
        }
    }
    // outputs: read by a later segment, or yielded
    let mut wanted: Vec<Vec<ValueId>> = vec![Vec::new(); segments.len()];
    for &v in segments.iter().flat_map(|seg| seg.inputs.iter()).chain(yields) {
        if let Some(&j) = made_in.get(&v).filter(|&&j| !wanted[j].contains(&v)) {
            wanted[j].push(v);
        }
    }
    for (seg, w) in segments.iter_mut().zip(wanted) {
        seg.outputs = w;
        // a value another segment or the stage's receiver reads stays
        if !seg.checkpointed {
            seg.rebuilt = seg
                .nodes
                .iter()
                .copied()
                .filter(|&n| selective.rebuilt.contains(&graph.node(n).name))
                // a mixture of experts rebuilds its experts' activations, its output stays
                .filter(|&n| graph.node(n).op.kind().is_some_and(crate::ir::OpKind::recomputed_inside) || matches!(graph.node(n).outputs.as_slice(), [v] if !seg.outputs.contains(v) && !yields.contains(v)))
                .collect();
            seg.held = seg.nodes.iter().copied().filter(|&n| selective.kept.contains(&graph.node(n).name)).collect();
        }
    }
    // a kept value leaves the device when one offloaded layer alone reads it
    let movable = groups
        .iter()
        .zip(&segments)
        .filter(|((ck, key, _), _)| *ck && key.is_some_and(|l| offloaded.contains(&l)))
        .flat_map(|(_, seg)| seg.inputs.iter().copied())
        .filter(|&v| !shared.contains(&graph.value(v).name))
        .collect();
    StageSegments { segments, movable, no_gradient: HashSet::new() }
}

/// The layer of each node of `order`: the one `layer_of` names; for a node it does not name (a
/// collective or cut the split inserted), the latest layer among the nodes that make its inputs
/// here, else the earliest among those that read its outputs, else the node's before it (the
/// first named one's at the start). A node so placed never precedes what it reads when the
/// nodes are grouped by layer: an all-gather of a layer's key goes with that layer, a cut of a
/// table the stage is given with its first reader.
fn node_layers(graph: &Graph, order: &[NodeId], layer_of: &HashMap<&str, usize>) -> Vec<usize> {
    let mut layers: Vec<Option<usize>> = order.iter().map(|&n| layer_of.get(graph.node(n).name.as_str()).copied()).collect();
    let mut made_at: HashMap<ValueId, usize> = HashMap::new();
    for (i, &n) in order.iter().enumerate() {
        if layers[i].is_none() {
            layers[i] = graph.node(n).inputs.iter().flatten().filter_map(|v| made_at.get(v)).filter_map(|&j| layers[j]).max();
        }
        made_at.extend(graph.node(n).outputs.iter().map(|&v| (v, i)));
    }
    let mut read_at: HashMap<ValueId, Vec<usize>> = HashMap::new();
    for (i, &n) in order.iter().enumerate() {
        for &v in graph.node(n).inputs.iter().flatten() {
            read_at.entry(v).or_default().push(i);
        }
    }
    for i in (0..order.len()).rev() {
        if layers[i].is_none() {
            layers[i] = graph.node(order[i]).outputs.iter().filter_map(|v| read_at.get(v)).flatten().filter_map(|&j| layers[j]).min();
        }
    }
    let mut layer = layers.iter().flatten().next().copied().unwrap_or(0);
    layers
        .into_iter()
        .map(|l| {
            layer = l.unwrap_or(layer);
            layer
        })
        .collect()
}

/// Names of the values that several layers of `model` read (each a layer's input: made by
/// another layer or given), by the layers `layer_of` names.
pub(super) fn shared_inputs(model: &Graph, layer_of: &HashMap<&str, usize>) -> HashSet<String> {
    let mut made_by: HashMap<ValueId, usize> = HashMap::new();
    for n in model.node_ids() {
        if let Some(&l) = layer_of.get(model.node(n).name.as_str()) {
            for &v in &model.node(n).outputs {
                made_by.insert(v, l);
            }
        }
    }
    let mut readers: HashMap<ValueId, BTreeSet<usize>> = HashMap::new();
    for n in model.node_ids() {
        let Some(&l) = layer_of.get(model.node(n).name.as_str()) else { continue };
        for &v in model.node(n).inputs.iter().flatten() {
            if made_by.get(&v).is_some_and(|&m| m != l) {
                readers.entry(v).or_default().insert(l);
            }
        }
    }
    readers.into_iter().filter(|(_, r)| r.len() > 1).map(|(v, _)| model.value(v).name.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, OpKind};
    use crate::passes::testutil::Builder;

    /// A collective the split inserted after another layer's node goes with the layer whose
    /// value it carries; a cut of a given table with its first reader: grouped by layer, no
    /// node then precedes what it reads, so a layer stays one segment.
    #[test]
    fn inserted_nodes_go_with_the_layer_of_what_they_carry_or_feed() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["4", "8"]);
        let w = b.param("w", DType::F32, &[8, 8]);
        let a = b.node(OpKind::Relu, &[x], &[]); // layer 0
        let q = b.node(OpKind::MatMul, &[a, w], &[]); // layer 1
        let mask = b.node(OpKind::Sigmoid, &[x], &[]); // layer 0, made after layer 1 began
        let gathered = b.node(OpKind::Identity, &[q], &[]); // inserted: carries layer 1's q
        let cut = b.node(OpKind::Identity, &[x], &[]); // inserted: a cut of a given value
        let m2 = b.node(OpKind::Mul, &[mask, cut], &[]); // layer 0 reads the cut
        let y = b.node(OpKind::Add, &[gathered, m2], &[]); // layer 1
        b.output(y);
        let g = b.g;
        let order: Vec<NodeId> = g.topo_order().unwrap();
        let name = |v: ValueId| g.node(order.iter().copied().find(|&n| g.node(n).outputs.contains(&v)).unwrap()).name.clone();
        let names: Vec<(String, usize)> = [(a, 0), (q, 1), (mask, 0), (m2, 0), (y, 1)].iter().map(|&(v, l)| (name(v), l)).collect();
        let layer_of: HashMap<&str, usize> = names.iter().map(|(n, l)| (n.as_str(), *l)).collect();
        let layers = node_layers(&g, &order, &layer_of);
        let at = |v: ValueId| layers[order.iter().position(|&n| g.node(n).outputs.contains(&v)).unwrap()];
        assert_eq!((at(gathered), at(cut)), (1, 0), "the gather with q's layer, the cut with its reader's");
        let segs = stage_segments(&g, &order, &layer_of, (&BTreeSet::from([1]), &BTreeSet::new()), (&HashSet::new(), &[y]), &HashSet::new(), false, &SelectiveNames::default());
        assert_eq!(segs.segments.len(), 2, "layer 0, then the checkpointed layer 1 whole: {:?}", segs.segments);
        assert!(segs.segments[1].checkpointed && segs.segments[1].nodes.len() == 3);
    }
}
