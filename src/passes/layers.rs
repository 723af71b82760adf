//! Layer grouping: contiguous runs of nodes in execution order, found (a) from the module
//! paths in node `namespace` metadata, else (b) from initializer-name prefixes, else
//! (c) structurally at residual-add boundaries.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use super::PassError;
use super::figures::{Figures, is_param};
use crate::ir::{DimBindings, Graph, Layer, LayerKind, NodeFigures, NodeId, OpKind, ValueId, ValueKind};

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
        tracing::debug!("layers from residual-add boundaries");
        let x = structural(graph, order, &pos);
        (x.0, x.1, true)
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
                // Token/position lookups, or a patch projection: any parameter before the blocks.
                let emb = nodes.iter().any(|&n| {
                    let node = graph.node(n);
                    fig.per_node[n.index()].param_elems > 0
                        || node.op.is(OpKind::Gather) && node.inputs.first().copied().flatten().is_some_and(|v| is_param(graph, v))
                });
                ("embedding".to_string(), if emb { LayerKind::Embedding } else { LayerKind::Other })
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
            output_bytes: 0.0,
        });
    }
    for layer in &mut layers {
        fill(graph, fig, layer, &layer_of, &uses);
    }
    Ok(layers)
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

/// The prefix with the most distinct indices (at least two); ties go to the outermost.
fn pick_container(counts: &HashMap<String, BTreeSet<u64>>) -> Option<String> {
    counts
        .iter()
        .filter(|(_, s)| s.len() >= 2)
        .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.0.len().cmp(&a.0.len())).then(b.0.cmp(a.0)))
        .map(|(p, _)| p.clone())
}

fn index_in(name: &str, prefix: &str) -> Option<u64> {
    let rest = name.strip_prefix(prefix)?.strip_prefix('.')?;
    rest.split('.').next()?.parse().ok()
}

type Placement = (Vec<Place>, HashMap<usize, String>);

/// Block keys in index order, and their names.
fn keys(prefix: &str, seen: &BTreeSet<u64>) -> (HashMap<u64, usize>, HashMap<usize, String>) {
    let key: HashMap<u64, usize> = seen.iter().enumerate().map(|(k, &i)| (i, k + 1)).collect();
    let names = seen.iter().enumerate().map(|(k, &i)| (k + 1, format!("{prefix}.{i}"))).collect();
    (key, names)
}

fn by_namespace(graph: &Graph, order: &[NodeId]) -> Option<Placement> {
    let mut counts: HashMap<String, BTreeSet<u64>> = HashMap::new();
    for &n in order {
        if let Some(ns) = &graph.node(n).namespace {
            for p in module_paths(ns) {
                for (prefix, i) in containers(p) {
                    counts.entry(prefix).or_default().insert(i);
                }
            }
        }
    }
    let prefix = pick_container(&counts)?;
    let (key, names) = keys(&prefix, &counts[&prefix]);
    let slots = graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut place = vec![Place::Helper; slots];
    for &n in order {
        let Some(ns) = &graph.node(n).namespace else { continue };
        let mut has_path = false;
        for p in module_paths(ns) {
            has_path = true;
            if let Some(i) = index_in(p, &prefix) {
                place[n.index()] = Place::Group(key[&i]);
                break;
            }
        }
        if has_path && place[n.index()] == Place::Helper {
            place[n.index()] = Place::Positional;
        }
    }
    Some((place, names))
}

fn by_initializer_names(graph: &Graph, order: &[NodeId]) -> Option<Placement> {
    let mut counts: HashMap<String, BTreeSet<u64>> = HashMap::new();
    let params = |n: NodeId| -> Vec<ValueId> { graph.node(n).inputs.iter().flatten().copied().filter(|&v| is_param(graph, v)).collect() };
    for &n in order {
        for v in params(n) {
            for (prefix, i) in containers(&graph.value(v).name) {
                counts.entry(prefix).or_default().insert(i);
            }
        }
    }
    let prefix = pick_container(&counts)?;
    let (key, names) = keys(&prefix, &counts[&prefix]);
    let slots = graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut place = vec![Place::Helper; slots];
    for &n in order {
        let ps = params(n);
        if ps.is_empty() {
            continue;
        }
        place[n.index()] = ps
            .iter()
            .find_map(|&v| index_in(&graph.value(v).name, &prefix))
            .map(|i| Place::Group(key[&i]))
            .unwrap_or(Place::Positional);
    }
    Some((place, names))
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
        if !node.op.is(OpKind::Add) || node.inputs.len() != 2 {
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
    for (i, &n) in order.iter().enumerate() {
        let k = starts.iter().take_while(|&&s| s <= i).count();
        place[n.index()] = if i > last { Place::Group(HEAD) } else { Place::Group(k) };
    }
    for k in 1..=starts.len() {
        names.insert(k, format!("block.{}", k - 1));
    }
    (place, names)
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
    let mut saved: Vec<ValueId> = Vec::new();
    let mut extra = 0.0;
    let mut figures = NodeFigures::default();
    for &n in &layer.nodes {
        let f = fig.per_node[n.index()];
        figures += f;
        let s = &fig.saved[n.index()];
        extra += s.extra_bytes;
        for &v in &s.values {
            if !saved.contains(&v) {
                saved.push(v);
            }
        }
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
    figures.saved_bytes = saved.iter().map(|&v| fig.value_bytes(graph, v)).sum::<f64>() + extra;
    layer.figures = figures;
    layer.input_bytes = layer.inputs.iter().map(|&v| fig.value_bytes(graph, v)).sum();
    layer.output_bytes = layer.outputs.iter().map(|&v| fig.value_bytes(graph, v)).sum();
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
