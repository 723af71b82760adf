//! Layer grouping: contiguous runs of nodes in execution order, found (a) from the module
//! paths in node `namespace` metadata (or node names of the older torch exporter), else (b) from initializer-name prefixes, else
//! (c) structurally at residual-add boundaries, else (d) at narrow cuts of the data path,
//! merged into layers of balanced cost (chains and branchy CNNs without metadata).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use super::PassError;
use super::figures::{Figures, is_param};
use crate::ir::{DimBindings, Graph, Layer, LayerBytes, LayerKind, Node, NodeFigures, NodeId, OpKind, OpSelective, ValueId, ValueKind};

/// How a node was placed before helpers are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// A group key (0 = before the blocks, 1 + i = block i, `HEAD` after them).
    Group(usize),
    /// A node with a module path outside the repeated container: placed by position.
    Positional,
    /// A node with no usable path: placed with its first consumer (or producer).
    Helper,
}

const HEAD: usize = usize::MAX;

/// Groups the nodes into layers in execution order and fills their figures.
pub fn group(graph: &Graph, fig: &Figures, _dims: &DimBindings) -> Result<Vec<Layer>, PassError> {
    let order = &fig.order;
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let (mut place, names, prefer_producer) = if let Some(x) = by_namespace(graph, order) {
        tracing::debug!("layers from namespace module paths");
        (x.0, x.1, false)
    } else if let Some(x) = by_initializer_names(graph, order) {
        tracing::debug!("layers from initializer-name prefixes");
        (x.0, x.1, true)
    } else {
        let residual = structural(graph, order, &pos);
        if residual.1.len() >= 2 && balanced(&residual.0, fig) {
            tracing::debug!("layers from residual-add boundaries");
            (residual.0, residual.1, true)
        } else if let Some(x) = by_narrow_cuts(graph, fig) {
            tracing::debug!("layers from narrow cuts of the data path");
            (x.0, x.1, true)
        } else {
            tracing::debug!("one layer: no module metadata, residual adds or narrow cuts");
            (residual.0, residual.1, true)
        }
    };
    resolve_positional(order, &mut place);
    let mut groups = attach_helpers(graph, order, &place, prefer_producer);
    hoist_shared_constants(graph, fig, &mut groups);

    let mut by_group: BTreeMap<usize, Vec<NodeId>> = BTreeMap::new();
    for &n in order {
        by_group.entry(groups[n.index()]).or_default().push(n);
    }
    let uses = graph.uses();
    let mut layer_of = vec![usize::MAX; groups.len()];
    let mut layers = Vec::new();
    for (key, nodes) in by_group {
        let index = layers.len();
        for &n in &nodes {
            layer_of[n.index()] = index;
        }
        let (name, kind) = match key {
            0 => {
                // What the layer does, not where it sits: token lookups or a patch projection
                // make an embedding; a CNN's stem does not.
                let emb = nodes.iter().any(|&n| embeds(graph, n));
                let name = if emb { "embedding" } else { "stem" };
                (name.to_string(), if emb { LayerKind::Embedding } else { LayerKind::Other })
            }
            HEAD => ("head".to_string(), LayerKind::Head),
            k => (names.get(&k).cloned().unwrap_or_else(|| format!("layer.{}", k - 1)), LayerKind::Block),
        };
        layers.push(Layer {
            index,
            name,
            kind,
            nodes,
            signature: String::new(),
            params: Vec::new(),
            shared_params: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            figures: NodeFigures::default(),
            input_bytes: 0.0,
            offload_bytes: 0.0,
            output_bytes: 0.0,
            shared_input_bytes: 0.0,
            shared_saved_bytes: 0.0,
            selective_bytes: 0.0,
            selective_nodes: Vec::new(),
            op_selective: Default::default(),
            op_freed_bytes: 0.0,
            op_held_bytes: 0.0,
            loss_kept_bytes: 0.0,
        });
    }
    for layer in &mut layers {
        fill(graph, fig, layer, &layer_of, &uses);
    }
    let bytes = layer_bytes(graph, fig, &layers);
    for (layer, b) in layers.iter_mut().zip(bytes) {
        layer.figures.saved_bytes = b.saved_bytes;
        layer.figures.score_saved_bytes = b.score_saved_bytes;
        layer.figures.norm_saved_bytes = b.norm_saved_bytes;
        layer.input_bytes = b.input_bytes;
        layer.offload_bytes = b.offload_bytes;
        layer.output_bytes = b.output_bytes;
        layer.shared_input_bytes = b.shared_input_bytes;
        layer.shared_saved_bytes = b.shared_saved_bytes;
        layer.selective_bytes = b.selective_bytes;
        layer.op_freed_bytes = b.op_freed_bytes;
        layer.op_held_bytes = b.op_held_bytes;
        layer.loss_kept_bytes = b.loss_kept_bytes;
    }
    for layer in &mut layers {
        let saved = saved_values(fig, layer);
        layer.selective_nodes = selectively_recomputed(graph, layer, &saved).into_iter().map(|(n, _)| n).collect();
        // a mixture of experts rebuilds its experts' activations inside it
        layer.selective_nodes.extend(layer.nodes.iter().copied().filter(|n| fig.saved[n.index()].experts_activation_bytes > 0.0));
        layer.op_selective = op_policy(graph, fig, layer, &saved).selective;
    }
    Ok(layers)
}

/// The byte figures of `layers` (grouped, their inputs and outputs found) at `fig`'s types:
/// the graph's own, or an autocast run's (`super::autocast::bytes`).
pub fn layer_bytes(graph: &Graph, fig: &Figures, layers: &[Layer]) -> Vec<LayerBytes> {
    // what offloading moves: the computed inputs no other layer reads (a mask or rotary table
    // every block reads is kept once per stage, on the device)
    let mut readers: HashMap<ValueId, usize> = HashMap::new();
    for v in layers.iter().flat_map(|l| l.inputs.iter()) {
        *readers.entry(*v).or_default() += 1;
    }
    let bytes = |vs: &mut dyn Iterator<Item = &ValueId>| vs.map(|&v| fig.value_bytes(graph, v)).fold(0.0, |a, b| a + b);
    layers
        .iter()
        .map(|layer| {
            let saved = saved_values(fig, layer);
            let (mut extra, mut weight_copy_bytes, mut norm) = (0.0, 0.0, 0.0);
            for &n in &layer.nodes {
                extra += fig.saved[n.index()].extra_bytes;
                norm += fig.saved[n.index()].norm_bytes;
                weight_copy_bytes += fig.saved[n.index()].weight_copy_bytes;
            }
            // the same tensor for every reader: the memory model holds it once per stage
            let shared: Vec<ValueId> = layer.inputs.iter().copied().filter(|v| readers[v] > 1).collect();
            let selective = selectively_recomputed(graph, layer, &saved);
            let ops = op_policy(graph, fig, layer, &saved);
            LayerBytes {
                op_freed_bytes: bytes(&mut ops.freed.iter()) + ops.freed_inside,
                op_held_bytes: bytes(&mut ops.held.iter()),
                loss_kept_bytes: fig.loss.filter(|l| layer.nodes.contains(&l.node)).map_or(0.0, |l| l.kept_bytes),
                selective_bytes: selective.iter().map(|&(_, v)| fig.value_bytes(graph, v)).sum::<f64>()
                    + layer.nodes.iter().map(|n| fig.saved[n.index()].experts_activation_bytes).sum::<f64>(),
                saved_bytes: saved.iter().map(|&v| fig.value_bytes(graph, v)).sum::<f64>() + extra,
                score_saved_bytes: saved.iter().filter(|v| fig.score.get(v.index()).copied().unwrap_or(false)).map(|&v| fig.value_bytes(graph, v)).sum(),
                norm_saved_bytes: norm,
                input_bytes: layer.inputs.iter().map(|&v| fig.value_bytes(graph, v)).sum(),
                offload_bytes: layer.inputs.iter().filter(|v| readers[v] == 1 && graph.value(**v).kind == ValueKind::Intermediate).map(|&v| fig.value_bytes(graph, v)).sum(),
                output_bytes: layer.outputs.iter().map(|&v| fig.value_bytes(graph, v)).sum(),
                shared_input_bytes: bytes(&mut shared.iter()),
                shared_saved_bytes: bytes(&mut saved.iter().filter(|v| shared.contains(v))),
                weight_copy_bytes,
            }
        })
        .collect()
}

/// The nodes of `layer` whose output selective recompute frees after the forward and rebuilds
/// before the backward, with that output: a normalisation or activation function
/// ([`OpKind::recomputed_selectively`]) whose output another node keeps, itself or through
/// reshapes of it ([`OpKind::aliases_input`]: one storage), in `saved` (what the layer's nodes
/// keep, each value once), that no other layer reads, and whose computed inputs are kept
/// anyway (saved, or the layer's own inputs), so rebuilding it holds nothing more.
pub fn selectively_recomputed(graph: &Graph, layer: &Layer, saved: &[ValueId]) -> Vec<(NodeId, ValueId)> {
    let saved: HashSet<ValueId> = saved.iter().copied().collect();
    let held = |v: ValueId| saved.contains(&v) || layer.inputs.contains(&v) || graph.value(v).kind != ValueKind::Intermediate;
    layer
        .nodes
        .iter()
        .enumerate()
        .filter(|&(_, &n)| graph.node(n).op.kind().is_some_and(OpKind::recomputed_selectively))
        .filter_map(|(at, &n)| {
            let node = graph.node(n);
            let &[v] = node.outputs.as_slice() else { return None };
            // the output and its reshapes in the layer, one storage
            let mut same = vec![v];
            for &m in &layer.nodes[at + 1..] {
                let reader = graph.node(m);
                if reader.op.kind().is_some_and(OpKind::aliases_input) && reader.inputs.first().copied().flatten().is_some_and(|i| same.contains(&i)) {
                    same.extend(reader.outputs.iter().copied());
                }
            }
            let escapes = same.iter().any(|w| layer.outputs.contains(w) || graph.outputs.contains(w));
            let kept = same.iter().any(|w| saved.contains(w));
            (kept && !escapes && node.inputs.iter().flatten().all(|&i| held(i))).then_some((n, v))
        })
        .collect()
}

/// A layer under torchtitan's per-op selective recompute ([`op_policy`]).
pub struct OpPolicy {
    /// Its rebuilt and kept nodes.
    pub selective: OpSelective,
    /// Saved values whose storage the rebuilt nodes' outputs are (freed after the forward).
    pub freed: Vec<ValueId>,
    /// Values held that no backward keeps: the kept nodes' outputs and what the rebuilt nodes
    /// read, beyond the saved values and the layer's inputs.
    pub held: Vec<ValueId>,
    /// Bytes per sample a rebuilt SwiGLU keeps inside it (silu(gate)), freed and rebuilt with it.
    pub freed_inside: f64,
}

/// torchtitan's per-op selective recompute of `layer` (its `_op_sac_save_list` policy): the
/// outputs of attention (fused, or the product that reads its scores), of a mixture of experts
/// and of every other weight product (the first, third, … in execution order, as its `mm`
/// count, a router's aside) are kept whether or not a backward reads them; every other node
/// whose output a backward keeps (in `saved`) is rebuilt, with whatever of the layer it reads
/// in turn, from those and the layer's inputs. A node that cannot be rebuilt alone (several
/// outputs, random draws, an unknown op, an output that leaves the layer) is kept instead. A
/// rebuilt SwiGLU's silu(gate), which the fused op keeps for its product's backward, is freed
/// and rebuilt with it (torchtitan's separate `silu` and `mul` rebuild it too). Only a block
/// has them: the embedding and the head keep theirs, as torchtitan checkpoints its
/// transformer blocks alone.
pub fn op_policy(graph: &Graph, fig: &Figures, layer: &Layer, saved: &[ValueId]) -> OpPolicy {
    // torchtitan wraps its transformer blocks alone
    if layer.kind != LayerKind::Block {
        return OpPolicy { selective: OpSelective::default(), freed: Vec::new(), held: Vec::new(), freed_inside: 0.0 };
    }
    let producer: HashMap<ValueId, NodeId> = layer.nodes.iter().flat_map(|&n| graph.node(n).outputs.iter().map(move |&v| (v, n))).collect();
    let kind = |n: NodeId| graph.node(n).op.kind();
    // a reshape of an expanded or transposed tensor copies it (libtorch's `reshape`): a tensor
    // of its own, rebuilt as any op's output
    let copies = |n: NodeId| {
        let reshape = matches!(kind(n), Some(OpKind::Reshape | OpKind::Flatten));
        let strided = graph.node(n).inputs.first().copied().flatten().and_then(|i| producer.get(&i)).is_some_and(|&p| matches!(kind(p), Some(OpKind::Expand | OpKind::Transpose)));
        reshape && strided
    };
    // a view is never freed on its own: it follows the tensor it views
    let is_view = |n: NodeId| kind(n).is_some_and(OpKind::may_view_input) && !copies(n);
    // a router's products (one column per expert) are recomputed and not counted, as its
    // default `per_op_sac_force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]` has it
    let routers: HashSet<i64> = layer.nodes.iter().filter(|&&n| kind(n) == Some(OpKind::MixtureOfExperts)).map(|&n| graph.node(n).attrs.int("experts", 0)).collect();
    let router = |n: NodeId| routers.contains(&(fig.per_node[n.index()].gemms[0].n as i64));
    // an attention left as ops: its scores are inside it (never stored where attention is
    // fused), the product that reads them is its output
    let score = |n: NodeId| graph.node(n).outputs.iter().any(|v| fig.score.get(v.index()).copied().unwrap_or(false));
    let reads_scores = |n: NodeId| graph.node(n).inputs.iter().flatten().any(|v| fig.score.get(v.index()).copied().unwrap_or(false));
    let mut products = 0usize;
    let kept: HashSet<NodeId> = layer
        .nodes
        .iter()
        .copied()
        .filter(|&n| match kind(n) {
            _ if score(n) => false,
            _ if reads_scores(n) => true,
            Some(OpKind::MatMul | OpKind::Gemm) if fig.per_node[n.index()].gemms[0].share > 0.0 && !router(n) => {
                products += 1;
                products % 2 == 1
            }
            Some(OpKind::ScaledDotProductAttention | OpKind::MixtureOfExperts) => true,
            _ => false,
        })
        .collect();
    let escapes = |v: ValueId| layer.outputs.contains(&v) || graph.outputs.contains(&v);
    let rebuildable = |n: NodeId| {
        let node = graph.node(n);
        node.outputs.len() == 1
            && !escapes(node.outputs[0])
            && kind(n).is_some_and(|k| !matches!(k, OpKind::Dropout) && !k.recomputed_inside())
    };
    // from each saved value back through what making it reads, stopping at kept nodes and at
    // the layer's edge
    let mut rebuilt: HashSet<NodeId> = HashSet::new();
    let mut seen: HashSet<NodeId> = HashSet::new();
    let mut work: Vec<NodeId> = saved.iter().filter_map(|v| producer.get(v).copied()).collect();
    while let Some(n) = work.pop() {
        if kept.contains(&n) || score(n) || !seen.insert(n) {
            continue;
        }
        let through_view = is_view(n);
        if !through_view {
            if !rebuildable(n) {
                continue;
            }
            rebuilt.insert(n);
        }
        work.extend(graph.node(n).inputs.iter().flatten().filter_map(|i| producer.get(i).copied()));
    }
    // a view is freed with the tensor it views
    let mut freed_storage: HashSet<ValueId> = HashSet::new();
    for &n in &layer.nodes {
        let node = graph.node(n);
        let views_freed = is_view(n) && node.inputs.first().copied().flatten().is_some_and(|i| freed_storage.contains(&i));
        if rebuilt.contains(&n) || views_freed {
            freed_storage.extend(node.outputs.iter().copied());
        }
    }
    let saved_set: HashSet<ValueId> = saved.iter().copied().collect();
    let freed: Vec<ValueId> = saved.iter().copied().filter(|v| freed_storage.contains(v)).collect();
    // a view held holds the tensor it views
    let base = |mut v: ValueId| {
        while let Some(&p) = producer.get(&v).filter(|&&p| is_view(p)) {
            match graph.node(p).inputs.first().copied().flatten() {
                Some(i) => v = i,
                None => break,
            }
        }
        v
    };
    let saved_bases: HashSet<ValueId> = saved.iter().map(|&v| base(v)).collect();
    let mut held: Vec<ValueId> = Vec::new();
    let mut hold = |v: ValueId| {
        let v = base(v);
        let extra = !saved_set.contains(&v) && !saved_bases.contains(&v) && !layer.inputs.contains(&v) && !freed_storage.contains(&v) && !escapes(v);
        if extra && graph.value(v).kind == ValueKind::Intermediate && !held.contains(&v) {
            held.push(v);
        }
    };
    for &n in &layer.nodes {
        let node = graph.node(n);
        if kept.contains(&n) {
            node.outputs.iter().copied().for_each(&mut hold);
        }
        if rebuilt.contains(&n) {
            node.inputs.iter().flatten().copied().for_each(&mut hold);
        }
    }
    let freed_inside = rebuilt.iter().filter(|&&n| kind(n).is_some_and(OpKind::keeps_inside)).map(|n| fig.saved[n.index()].extra_bytes).sum();
    let in_order = |set: &HashSet<NodeId>| layer.nodes.iter().copied().filter(|n| set.contains(n)).collect();
    OpPolicy { selective: OpSelective { rebuilt: in_order(&rebuilt), kept: in_order(&kept) }, freed, held, freed_inside }
}

/// What the layer's nodes keep for the backward under `fig`, each value once, in the order
/// they are first kept.
pub fn saved_values(fig: &Figures, layer: &Layer) -> Vec<ValueId> {
    let mut seen: HashSet<ValueId> = HashSet::new();
    layer.nodes.iter().flat_map(|&n| fig.saved[n.index()].values.iter().copied()).filter(|&v| seen.insert(v)).collect()
}

/// Whether node `n` embeds its input: a row lookup in a parameter table, or a convolution
/// whose strides equal its kernel (patches to tokens, as ViT's).
fn embeds(graph: &Graph, n: NodeId) -> bool {
    let node = graph.node(n);
    let weight = |i: usize| node.inputs.get(i).copied().flatten().is_some_and(|v| is_param(graph, v));
    if node.op.is(OpKind::Gather) {
        return weight(0);
    }
    if node.op.is(OpKind::Conv) && weight(1) {
        let kernel = node.attrs.ints("kernel_shape").map(<[i64]>::to_vec).or_else(|| {
            let w = node.inputs.get(1).copied().flatten()?;
            Some(graph.value(w).ty.as_ref()?.shape.as_ref()?.known()?.get(2..)?.to_vec())
        });
        return kernel.is_some_and(|k| !k.is_empty() && node.attrs.ints("strides") == Some(k.as_slice()) && k.iter().any(|&d| d > 1));
    }
    false
}

/// The innermost module path of a node's namespace (the module that made it), if any.
pub(crate) fn innermost_module(ns: &str) -> Option<String> {
    module_paths(ns).last().map(str::to_string)
}

/// Module paths of a namespace (`path: class` segments joined by `/`; the last is the op).
fn module_paths(ns: &str) -> impl Iterator<Item = &str> {
    let segs: Vec<&str> = ns.split('/').collect();
    let n = segs.len().saturating_sub(1);
    segs.into_iter()
        .take(n)
        .map(|s| s.split(": ").next().unwrap_or("").trim())
        .filter(|p| !p.is_empty() && !p.starts_with('_'))
}

/// Every `(prefix, index)` such that `name` contains `prefix.<index>` followed by `.` or its end.
fn containers(name: &str) -> Vec<(String, u64)> {
    let parts: Vec<&str> = name.split('.').collect();
    let mut out = Vec::new();
    for j in 1..parts.len() {
        if let Ok(i) = parts[j].parse::<u64>()
            && !parts[j - 1].is_empty()
        {
            out.push((parts[..j].join("."), i));
        }
    }
    out
}

/// The prefix with the most distinct indices (at least two) among the outermost containers;
/// ties go to the shortest. A container inside a block of another (T5's `block.0.layer`, a
/// mixture's `layers.0.mlp.experts`, Swin's `layers.0.blocks`) is part of that block, however
/// many indices it has.
fn pick_container(counts: &HashMap<String, BTreeSet<u64>>) -> Option<String> {
    counts
        .iter()
        .filter(|(p, s)| s.len() >= 2 && !nested(p, counts))
        .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.0.len().cmp(&a.0.len())).then(b.0.cmp(a.0)))
        .map(|(p, _)| p.clone())
}

/// Whether container `prefix` lies inside a block of another container of `counts` (one with
/// at least two indices).
fn nested(prefix: &str, counts: &HashMap<String, BTreeSet<u64>>) -> bool {
    containers(prefix).iter().any(|(outer, i)| counts.get(outer).is_some_and(|s| s.len() >= 2 && s.contains(i)))
}

/// The stacks of an encoder–decoder: containers of `main`'s name under siblings of its parent
/// (`model.encoder.block` and `model.decoder.block`), each with at least two blocks.
fn is_stack_of(main: &str, p: &str) -> bool {
    let split = |x: &str| x.rsplit_once('.').map(|(a, b)| (a.to_string(), b.to_string()));
    let (Some((parent, name)), Some((other_parent, other_name))) = (split(main), split(p)) else { return false };
    let grandparent = |x: &str| x.rsplit_once('.').map_or(String::new(), |(a, _)| a.to_string());
    name == other_name && parent != other_parent && grandparent(&parent) == grandparent(&other_parent)
}

fn index_in(name: &str, prefix: &str) -> Option<u64> {
    let rest = name.strip_prefix(prefix)?.strip_prefix('.')?;
    rest.split('.').next()?.parse().ok()
}

type Placement = (Vec<Place>, HashMap<usize, String>);

/// The repeated containers whose blocks become layers: the one [`pick_container`] picks, with
/// its siblings (containers of the same parent holding at least two blocks, as ResNet's
/// `layer1` … `layer4`) and the other stacks of an encoder–decoder ([`is_stack_of`]), in
/// order of first appearance; each block's group key and name.
struct Blocks {
    prefixes: Vec<String>,
    key: HashMap<(usize, u64), usize>,
    names: HashMap<usize, String>,
}

impl Blocks {
    fn pick(counts: &HashMap<String, BTreeSet<u64>>, first_seen: &HashMap<String, usize>) -> Option<Blocks> {
        let main = pick_container(counts)?;
        let parent = |p: &str| p.rsplit_once('.').map_or(String::new(), |(a, _)| a.to_string());
        let mut prefixes: Vec<String> = counts
            .iter()
            .filter(|(p, s)| s.len() >= 2 && !nested(p, counts) && (parent(p) == parent(&main) || is_stack_of(&main, p)))
            .map(|(p, _)| p.clone())
            .collect();
        prefixes.sort_by_key(|p| (first_seen.get(p).copied().unwrap_or(usize::MAX), p.clone()));
        let (mut key, mut names) = (HashMap::new(), HashMap::new());
        for (c, p) in prefixes.iter().enumerate() {
            for &i in &counts[p] {
                let k = key.len() + 1;
                key.insert((c, i), k);
                names.insert(k, format!("{p}.{i}"));
            }
        }
        Some(Blocks { prefixes, key, names })
    }

    /// The group of the block `name` lies in, if any.
    fn group_of(&self, name: &str) -> Option<usize> {
        self.prefixes.iter().enumerate().find_map(|(c, p)| index_in(name, p).and_then(|i| self.key.get(&(c, i)).copied()))
    }
}

/// Module paths of a node: from its `namespace` metadata, else from a name in the form of the
/// older torch exporter (`/h.3/attn/c_attn/Gemm` gives `h.3`, `h.3.attn`, `h.3.attn.c_attn`),
/// else from a TensorFlow name scope as tf2onnx writes it, where Keras numbers layers with a
/// suffix (`model/block_3/attn/query/MatMul` gives `model`, `model.block.3`, …).
fn node_paths(node: &Node) -> Vec<String> {
    if let Some(ns) = &node.namespace {
        return module_paths(ns).map(str::to_string).collect();
    }
    let segs: Vec<String> = if let Some(rest) = node.name.strip_prefix('/') {
        rest.split('/').map(str::to_string).collect()
    } else if node.name.matches('/').count() >= 2 {
        node.name.split('/').map(keras_segment).collect()
    } else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut path = String::new();
    for seg in segs[..segs.len().saturating_sub(1)].iter().filter(|s| !s.is_empty()) {
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(seg);
        out.push(path.clone());
    }
    out
}

/// A TensorFlow scope segment as a module path segment: `block_3` → `block.3` (Keras' layer
/// numbering), anything else unchanged.
fn keras_segment(seg: &str) -> String {
    match seg.rsplit_once('_') {
        Some((base, n)) if !base.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => format!("{base}.{n}"),
        _ => seg.to_string(),
    }
}

fn by_namespace(graph: &Graph, order: &[NodeId]) -> Option<Placement> {
    let mut counts: HashMap<String, BTreeSet<u64>> = HashMap::new();
    // Only modules holding weights are containers: Keras also numbers its weightless op layers
    // (`tf.__operators__.add_7`).
    let reads_weight = |n: NodeId| graph.node(n).inputs.iter().flatten().any(|&v| is_param(graph, v));
    let mut first_seen: HashMap<String, usize> = HashMap::new();
    for (pos, &n) in order.iter().enumerate().filter(|&(_, &n)| reads_weight(n)) {
        for p in node_paths(graph.node(n)) {
            for (prefix, i) in containers(&p) {
                first_seen.entry(prefix.clone()).or_insert(pos);
                counts.entry(prefix).or_default().insert(i);
            }
        }
    }
    let blocks = Blocks::pick(&counts, &first_seen)?;
    let slots = graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut place = vec![Place::Helper; slots];
    for &n in order {
        let paths = node_paths(graph.node(n));
        if paths.is_empty() {
            continue;
        }
        place[n.index()] = paths.iter().find_map(|p| blocks.group_of(p)).map(Place::Group).unwrap_or(Place::Positional);
    }
    Some((place, blocks.names))
}

fn by_initializer_names(graph: &Graph, order: &[NodeId]) -> Option<Placement> {
    let mut counts: HashMap<String, BTreeSet<u64>> = HashMap::new();
    let params = |n: NodeId| -> Vec<ValueId> { graph.node(n).inputs.iter().flatten().copied().filter(|&v| is_param(graph, v)).collect() };
    let mut first_seen: HashMap<String, usize> = HashMap::new();
    for (pos, &n) in order.iter().enumerate() {
        for v in params(n) {
            for (prefix, i) in containers(&graph.value(v).name) {
                first_seen.entry(prefix.clone()).or_insert(pos);
                counts.entry(prefix).or_default().insert(i);
            }
        }
    }
    let blocks = Blocks::pick(&counts, &first_seen)?;
    let slots = graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut place = vec![Place::Helper; slots];
    for &n in order {
        let ps = params(n);
        if ps.is_empty() {
            continue;
        }
        place[n.index()] =
            ps.iter().find_map(|&v| blocks.group_of(&graph.value(v).name)).map(Place::Group).unwrap_or(Place::Positional);
    }
    Some((place, blocks.names))
}

/// True if `a` is an ancestor of (or is) the producer chain of `b`.
fn depends_on(graph: &Graph, b: ValueId, a: ValueId, pos: &HashMap<NodeId, usize>) -> bool {
    let floor = graph.value(a).producer.map(|p| pos[&p]).unwrap_or(0);
    let mut stack: Vec<NodeId> = graph.value(b).producer.into_iter().collect();
    let mut seen = HashSet::new();
    while let Some(n) = stack.pop() {
        if !seen.insert(n) || pos[&n] < floor {
            continue;
        }
        if graph.node(n).inputs.iter().flatten().any(|&v| v == a) {
            return true;
        }
        stack.extend(graph.predecessors(n));
    }
    false
}

/// Residual adds: `Add(x, f(x))`; blocks start right after each skip input is produced.
fn structural(graph: &Graph, order: &[NodeId], pos: &HashMap<NodeId, usize>) -> Placement {
    let activation = |v: ValueId| {
        let val = graph.value(v);
        matches!(val.kind, ValueKind::Input | ValueKind::Intermediate) && val.ty.as_ref().is_some_and(|t| t.dtype.is_float())
    };
    let mut starts = BTreeSet::new();
    let mut last_add = None;
    for &n in order {
        let node = graph.node(n);
        if !(node.op.is(OpKind::Add) || node.op.is(OpKind::Sum)) || node.inputs.len() != 2 {
            continue;
        }
        let (Some(x), Some(y)) = (node.inputs[0], node.inputs[1]) else { continue };
        if !activation(x) || !activation(y) || graph.value(x).ty != graph.value(y).ty {
            continue;
        }
        let skip = if depends_on(graph, y, x, pos) {
            x
        } else if depends_on(graph, x, y, pos) {
            y
        } else {
            continue;
        };
        starts.insert(graph.value(skip).producer.map(|p| pos[&p] + 1).unwrap_or(0));
        last_add = Some(pos[&n]);
    }
    let slots = graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut place = vec![Place::Group(0); slots];
    let mut names = HashMap::new();
    let Some(last) = last_add else { return (place, names) };
    let starts: Vec<usize> = starts.into_iter().collect();
    // Nodes off the data path (weights made by ConstantOfShape, constant masks) join their
    // consumers instead of being placed by position.
    let mut data = vec![false; graph.value_count()];
    for &v in &graph.inputs {
        data[v.index()] = true;
    }
    for (i, &n) in order.iter().enumerate() {
        let node = graph.node(n);
        let on_path = node.inputs.iter().flatten().any(|v| data[v.index()]);
        for &o in &node.outputs {
            data[o.index()] = on_path;
        }
        let k = starts.iter().take_while(|&&s| s <= i).count();
        place[n.index()] = if !on_path {
            Place::Helper
        } else if i > last {
            Place::Group(HEAD)
        } else {
            Place::Group(k)
        };
    }
    for k in 1..=starts.len() {
        names.insert(k, format!("block.{}", k - 1));
    }
    (place, names)
}

/// Whether no group of `place` has more than twice the mean forward FLOPs of its groups.
fn balanced(place: &[Place], fig: &Figures) -> bool {
    let mut flops: HashMap<usize, f64> = HashMap::new();
    for &n in &fig.order {
        if let Some(Place::Group(k)) = place.get(n.index()) {
            *flops.entry(*k).or_default() += fig.per_node[n.index()].flops;
        }
    }
    let total: f64 = flops.values().sum();
    flops.values().all(|&f| f <= 2.0 * total / flops.len() as f64)
}

/// Most layers a graph without metadata is cut into by [`by_narrow_cuts`].
const MAX_CUT_LAYERS: usize = 32;

/// Widest cut (activations live across it) [`by_narrow_cuts`] considers.
const MAX_CUT_WIDTH: i64 = 8;

/// Layers at narrow cuts, for graphs with neither module metadata nor residual adds (VGG-style
/// chains, Inception or DenseNet modules, converted TensorFlow models). A cut follows a node of
/// the data path (nodes reading graph inputs, transitively) where few activations are live:
/// one where every path passes through a single tensor, else the narrowest width (up to
/// [`MAX_CUT_WIDTH`]) that occurs at least three times, as where skip connections cross. The
/// runs between cuts are merged, in order, into the most layers (up to [`MAX_CUT_LAYERS`])
/// whose largest forward FLOPs stay within twice the mean.
fn by_narrow_cuts(graph: &Graph, fig: &Figures) -> Option<Placement> {
    let mut data = vec![false; graph.value_count()];
    for &v in &graph.inputs {
        data[v.index()] = true;
    }
    let mut path = Vec::new();
    for &n in &fig.order {
        let node = graph.node(n);
        let on_path = node.inputs.iter().flatten().any(|v| data[v.index()]);
        for &o in &node.outputs {
            data[o.index()] = on_path;
        }
        if on_path {
            path.push(n);
        }
    }
    if path.len() < 2 {
        return None;
    }
    // Width of the cut after each path position: values made at or before it and read after
    // it (graph outputs stay live to the end; graph inputs are read from the data, not sent).
    let mut last_read = vec![None; graph.value_count()];
    for (i, &n) in path.iter().enumerate() {
        for &v in graph.node(n).inputs.iter().flatten() {
            last_read[v.index()] = Some(i);
        }
    }
    for &v in &graph.outputs {
        last_read[v.index()] = Some(path.len());
    }
    let mut delta = vec![0i64; path.len() + 1];
    for (i, &n) in path.iter().enumerate() {
        for &o in &graph.node(n).outputs {
            if let Some(u) = last_read[o.index()].filter(|&u| u > i) {
                delta[i] += 1;
                delta[u] -= 1;
            }
        }
    }
    let width: Vec<i64> = delta[..path.len() - 1]
        .iter()
        .scan(0, |live, d| {
            *live += d;
            Some(*live)
        })
        .collect();
    let narrowest = (1..=MAX_CUT_WIDTH).find(|&k| width.iter().filter(|&&w| w <= k).count() >= 3)?;
    // Runs of path nodes between cuts, with their forward FLOPs (+1 so empty runs weigh).
    let mut runs: Vec<(usize, f64)> = Vec::new(); // (last path position, cost)
    let mut cost = 0.0;
    for (i, &n) in path.iter().enumerate() {
        cost += fig.per_node[n.index()].flops + 1.0;
        if i + 1 == path.len() || width[i] <= narrowest {
            runs.push((i, cost));
            cost = 0.0;
        }
    }
    let costs: Vec<f64> = runs.iter().map(|r| r.1).collect();
    let total: f64 = costs.iter().sum();
    let groups = (1..=runs.len().min(MAX_CUT_LAYERS))
        .rev()
        .map(|layers| balanced_runs(&costs, layers))
        .find(|g| {
            let largest = g.iter().map(|r| costs[r.clone()].iter().sum::<f64>()).fold(0.0, f64::max);
            largest <= 2.0 * total / g.len() as f64
        })?;
    let slots = graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut place = vec![Place::Helper; slots];
    let mut names = HashMap::new();
    let mut first = 0;
    for (k, g) in groups.iter().enumerate() {
        let last = runs[g.end - 1].0;
        for &n in &path[first..=last] {
            place[n.index()] = Place::Group(k + 1);
        }
        names.insert(k + 1, format!("block.{k}"));
        first = last + 1;
    }
    Some((place, names))
}

/// The split of `costs`, in order, into at most `layers` contiguous groups whose largest sum is
/// least (bisection on that sum; each group is filled greedily).
fn balanced_runs(costs: &[f64], layers: usize) -> Vec<std::ops::Range<usize>> {
    let pack = |limit: f64| {
        let mut out = Vec::new();
        let (mut start, mut sum) = (0, 0.0);
        for (i, &c) in costs.iter().enumerate() {
            if i > start && sum + c > limit {
                out.push(start..i);
                start = i;
                sum = 0.0;
            }
            sum += c;
        }
        out.push(start..costs.len());
        out
    };
    let (mut lo, mut hi) = (costs.iter().copied().fold(0.0, f64::max), costs.iter().sum::<f64>());
    for _ in 0..64 {
        let mid = 0.5 * (lo + hi);
        if pack(mid).len() <= layers {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    pack(hi)
}

/// Positional nodes go before the first block, after the last, or with the block before them.
fn resolve_positional(order: &[NodeId], place: &mut [Place]) {
    let first = order.iter().position(|n| matches!(place[n.index()], Place::Group(_)));
    let last = order.iter().rposition(|n| matches!(place[n.index()], Place::Group(_)));
    let mut current = 0;
    for (i, &n) in order.iter().enumerate() {
        match place[n.index()] {
            Place::Group(g) => current = g,
            Place::Positional => {
                place[n.index()] = Place::Group(match (first, last) {
                    (Some(f), _) if i < f => 0,
                    (_, Some(l)) if i > l => HEAD,
                    (None, None) => 0,
                    _ => current,
                });
            }
            Place::Helper => {}
        }
    }
}

/// Helpers join their first consumer's group (or producer's); then groups are made
/// non-decreasing along every edge so that layers are contiguous in execution order.
fn attach_helpers(graph: &Graph, order: &[NodeId], place: &[Place], prefer_producer: bool) -> Vec<usize> {
    let mut g: Vec<Option<usize>> = place.iter().map(|p| if let Place::Group(k) = p { Some(*k) } else { None }).collect();
    let from_consumers = |g: &mut Vec<Option<usize>>| {
        for &n in order.iter().rev() {
            if g[n.index()].is_none() {
                g[n.index()] = graph.successors(n).filter_map(|s| g[s.index()]).min();
            }
        }
    };
    let from_producers = |g: &mut Vec<Option<usize>>| {
        for &n in order {
            if g[n.index()].is_none() {
                g[n.index()] = graph.predecessors(n).filter_map(|p| g[p.index()]).max();
            }
        }
    };
    if prefer_producer {
        from_producers(&mut g);
        from_consumers(&mut g);
    } else {
        from_consumers(&mut g);
        from_producers(&mut g);
    }
    let mut out: Vec<usize> = g.into_iter().map(|x| x.unwrap_or(0)).collect();
    for &n in order.iter().rev() {
        if let Some(m) = graph.successors(n).map(|s| out[s.index()]).min() {
            out[n.index()] = out[n.index()].min(m);
        }
    }
    out
}

/// Nodes off the gradient path (shape arithmetic, masks) whose outputs several layers read
/// move to the earliest layer their inputs allow, so that the first block does not carry
/// what all blocks share and identical blocks keep one signature.
fn hoist_shared_constants(graph: &Graph, fig: &Figures, groups: &mut [usize]) {
    let mut trained = vec![false; graph.value_count()];
    for v in graph.value_ids() {
        trained[v.index()] = fig.grad[v.index()];
    }
    for &n in &fig.order {
        let node = graph.node(n);
        if node.inputs.iter().flatten().any(|v| trained[v.index()]) || node.outputs.iter().any(|o| graph.outputs.contains(o)) {
            continue;
        }
        let here = groups[n.index()];
        let mut readers = graph.successors(n).map(|s| groups[s.index()]).filter(|&g| g != here);
        if readers.next().is_none() {
            continue;
        }
        groups[n.index()] = graph.predecessors(n).map(|p| groups[p.index()]).max().unwrap_or(0).min(here);
    }
}

fn fill(graph: &Graph, fig: &Figures, layer: &mut Layer, layer_of: &[usize], uses: &[Vec<NodeId>]) {
    let here = layer.index;
    let mut figures = NodeFigures::default();
    for &n in &layer.nodes {
        let f = fig.per_node[n.index()];
        figures += f;
        let node = graph.node(n);
        for &v in node.inputs.iter().flatten() {
            let val = graph.value(v);
            if is_param(graph, v) {
                let owned = fig.param_owner[v.index()].is_some_and(|o| layer_of[o.index()] == here);
                let list = if owned { &mut layer.params } else { &mut layer.shared_params };
                if !list.contains(&v) {
                    list.push(v);
                }
            } else if matches!(val.kind, ValueKind::Input | ValueKind::Intermediate)
                && val.producer.is_none_or(|p| layer_of[p.index()] != here)
                && !layer.inputs.contains(&v)
            {
                layer.inputs.push(v);
            }
        }
        for &o in &node.outputs {
            let later = uses[o.index()].iter().any(|u| layer_of[u.index()] != here) || graph.outputs.contains(&o);
            if later {
                layer.outputs.push(o);
            }
        }
    }
    layer.figures = figures;
    layer.signature = signature(graph, layer);
}

/// A stable hash of the layer's structure: op kinds, attributes, shapes, parameter shapes and
/// wiring, in order, ignoring names.
pub fn signature(graph: &Graph, layer: &Layer) -> String {
    let mut local: HashMap<ValueId, String> = HashMap::new();
    let mut external: HashMap<ValueId, usize> = HashMap::new();
    let mut text = String::new();
    let ty = |v: ValueId| graph.value(v).ty.as_ref().map(|t| t.to_string()).unwrap_or_else(|| "?".into());
    for (i, &n) in layer.nodes.iter().enumerate() {
        let node = graph.node(n);
        let _ = write!(text, "{}", node.op);
        for (k, a) in &node.attrs.0 {
            let _ = write!(text, " {k}={a}");
        }
        text.push('(');
        for inp in &node.inputs {
            match inp {
                None => text.push('_'),
                Some(v) => {
                    let val = graph.value(*v);
                    if let Some(l) = local.get(v) {
                        text.push_str(l);
                    } else if is_param(graph, *v) {
                        let _ = write!(text, "P{}", ty(*v));
                    } else if matches!(val.kind, ValueKind::Initializer | ValueKind::Constant) {
                        let data = val.data.as_ref().and_then(|d| d.to_i64_vec()).filter(|d| d.len() <= 16);
                        let _ = write!(text, "C{}{:?}", ty(*v), data);
                    } else {
                        let next = external.len();
                        let e = *external.entry(*v).or_insert(next);
                        let _ = write!(text, "X{e}:{}", ty(*v));
                    }
                }
            }
            text.push(',');
        }
        text.push_str(")->");
        for (j, &o) in node.outputs.iter().enumerate() {
            local.insert(o, format!("L{i}.{j}"));
            let _ = write!(text, "{},", ty(o));
        }
        text.push('\n');
    }
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().take(8).fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

#[cfg(test)]
mod tests {
    use crate::ir::{Attr, DType, LayerKind, ValueId};
    use crate::passes::testutil::Builder;
    use crate::passes::{AnalyzeOptions, analyze};

    #[test]
    fn tensorflow_scopes_read_as_module_paths() {
        use super::keras_segment;
        assert_eq!(keras_segment("block_3"), "block.3");
        assert_eq!(keras_segment("keras_lm"), "keras_lm");
        assert_eq!(keras_segment("_3"), "_3");
        assert_eq!(keras_segment("conv2d_"), "conv2d_");
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["2", "4"]);
        let w = b.param("w", DType::F32, &[4, 4]);
        let y = b.node(crate::ir::OpKind::MatMul, &[x, w], &[]);
        let id = b.g.value(y).producer.unwrap();
        b.g.node_mut(id).name = "model/block_12/dense_1/MatMul".into();
        assert_eq!(super::node_paths(b.g.node(id)), ["model", "model.block.12", "model.block.12.dense.1"]);
    }

    /// A CNN-shaped graph without metadata, residual adds or numbered names: a chain of
    /// matmuls, then Inception-style modules (parallel branches joined by a concat), of
    /// uneven widths.
    fn branchy() -> crate::ir::Graph {
        let mut b = Builder::new();
        let mut x = b.input("pixels", DType::F32, &["4", "64"]);
        let mut width = 64;
        for (i, w) in [64, 128, 128, 256].into_iter().enumerate() {
            let p = b.param(&format!("stem_w{}", "abcd".as_bytes()[i] as char), DType::F32, &[width, w]);
            let y = b.node(crate::ir::OpKind::MatMul, &[x, p], &[]);
            x = b.node(crate::ir::OpKind::Relu, &[y], &[]);
            width = w;
        }
        for m in 0..6 {
            let branches: Vec<_> = (0..3)
                .map(|k| {
                    let p = b.param(&format!("mix{}branch{}", "abcdef".as_bytes()[m] as char, "xyz".as_bytes()[k] as char), DType::F32, &[width, 64]);
                    let y = b.node(crate::ir::OpKind::MatMul, &[x, p], &[]);
                    b.node(crate::ir::OpKind::Relu, &[y], &[])
                })
                .collect();
            x = b.node(crate::ir::OpKind::Concat, &branches, &[("axis", Attr::Int(1))]);
            width = 192;
        }
        b.output(x);
        b.g
    }

    /// The older torch exporter writes no namespace but names nodes by module path
    /// (`/m/h.0/attn/MatMul`): those names group layers as the namespace does.
    #[test]
    fn node_names_of_the_older_exporter_group_layers_as_namespaces_do() {
        use crate::passes::testutil::{Gpt, gpt};
        let cfg = Gpt { blocks: 2, hidden: 64, heads: 4, vocab: 128, ffn: 256, batch: Some(2), seq: Some(8), dtype: DType::F32, namespaces: true, layer_names: false };
        let by_ns = analyze(gpt(cfg), &AnalyzeOptions::default()).unwrap();
        let mut g = gpt(cfg);
        let ids: Vec<_> = g.node_ids().collect();
        for n in ids {
            let node = g.node_mut(n);
            let ns = node.namespace.take().unwrap();
            let paths: Vec<&str> = super::module_paths(&ns).collect();
            // each segment relative to its parent, as the old exporter writes it
            let mut segs = Vec::new();
            let mut parent = "";
            for p in &paths {
                segs.push(p.strip_prefix(parent).map(|s| s.trim_start_matches('.')).unwrap_or(p).to_string());
                parent = p;
            }
            node.name = format!("/{}/{}_{}", segs.join("/"), node.op.name(), n.index());
        }
        let by_names = analyze(g, &AnalyzeOptions::default()).unwrap();
        let layers = |lg: &crate::ir::LayeredGraph| lg.layers.iter().map(|l| (l.kind, l.nodes.clone())).collect::<Vec<_>>();
        assert_eq!(by_ns.layers.len(), 4);
        assert_eq!(layers(&by_names), layers(&by_ns));
    }

    /// An encoder–decoder as T5 exports it: `model.encoder.block.N` and `model.decoder.block.N`,
    /// each block holding sub-layers `layer.0 … layer.K` (the decoder's three outnumber its
    /// two blocks), every decoder block reading the encoder's output.
    fn encoder_decoder(blocks: usize) -> crate::ir::Graph {
        use crate::ir::OpKind::{Add, Gather, MatMul};
        let mut b = Builder::new();
        let ids = b.input("input_ids", DType::I64, &["2", "8"]);
        let dec_ids = b.input("decoder_input_ids", DType::I64, &["2", "8"]);
        let ns = |b: &mut Builder, path: &str| b.namespace = Some(format!(": W/model: T5{path}/op: aten.op"));
        ns(&mut b, "/model.shared: Embedding");
        let table = b.param("model.shared.weight", DType::F32, &[64, 16]);
        let mut x = b.node(Gather, &[table, ids], &[]);
        let sub = |b: &mut Builder, stack: &str, i: usize, k: usize, x: ValueId, other: Option<ValueId>| {
            let block = format!("model.{stack}.block.{i}");
            ns(b, &format!("/{block}: T5Block/{block}.layer.{k}: T5Layer"));
            let w = b.param(&format!("{block}.layer.{k}.w"), DType::F32, &[16, 16]);
            let y = b.node(MatMul, &[other.unwrap_or(x), w], &[]);
            b.node(Add, &[x, y], &[])
        };
        for i in 0..blocks {
            x = sub(&mut b, "encoder", i, 0, x, None);
            x = sub(&mut b, "encoder", i, 1, x, None);
        }
        let encoded = x;
        ns(&mut b, "/model.shared: Embedding");
        let mut y = b.node(Gather, &[table, dec_ids], &[]);
        for i in 0..blocks {
            y = sub(&mut b, "decoder", i, 0, y, None);
            y = sub(&mut b, "decoder", i, 1, y, Some(encoded));
            y = sub(&mut b, "decoder", i, 2, y, None);
        }
        b.output(y);
        b.g
    }

    #[test]
    fn both_stacks_of_an_encoder_decoder_are_blocks_and_sub_layers_are_not() {
        let lg = analyze(encoder_decoder(2), &AnalyzeOptions::default()).unwrap();
        let names: Vec<&str> = lg.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(
            names,
            ["embedding", "model.encoder.block.0", "model.encoder.block.1", "model.decoder.block.0", "model.decoder.block.1"]
        );
        // the encoder's output crosses into every decoder block
        let encoded = lg.layers[2].outputs.clone();
        assert!(lg.layers[3..].iter().all(|l| l.inputs.iter().any(|v| encoded.contains(v))), "{:?}", lg.layers);
    }

    #[test]
    fn graphs_without_metadata_are_cut_where_one_tensor_crosses_into_balanced_layers() {
        let lg = analyze(branchy(), &AnalyzeOptions::default()).unwrap();
        let flops: Vec<f64> = lg.layers.iter().map(|l| l.figures.flops).collect();
        let mean = flops.iter().sum::<f64>() / flops.len() as f64;
        assert!(lg.layers.len() >= 4, "{} layers", lg.layers.len());
        assert!(flops.iter().all(|&f| f <= 2.0 * mean), "{flops:?}");
        // Every cut lies where a single activation crosses, never inside a module.
        for l in &lg.layers[..lg.layers.len() - 1] {
            assert_eq!(l.outputs.len(), 1, "layer {} sends {:?}", l.name, l.outputs);
        }
        // A stem of matmuls is not an embedding.
        assert!(lg.layers.iter().all(|l| l.kind != LayerKind::Embedding));
        let covered: usize = lg.layers.iter().map(|l| l.nodes.len()).sum();
        assert_eq!(covered, lg.graph.node_count());
    }
}
