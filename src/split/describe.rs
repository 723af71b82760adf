//! What a layer's attention and experts are, in the words a user knows them by, read off what
//! its nodes compute (never names): each attention core the split analysis finds ([`analyse`]:
//! the matmuls of two activations between the projections, or a fused attention), its heads and
//! whether its key shares one rotary part over every head (latent attention, DeepSeek's MLA);
//! each mixture of experts' routed experts, top-k and the shared experts beside them. `plan`
//! carries it per layer, so that `inspect` names the choices made for each.
//!
//! [`analyse`]: super::analyse

use std::collections::HashMap;

use super::analyse::{SplitGraph, weight_param};
use crate::ir::{Graph, LayeredGraph, NodeId, OpKind, ValueId};

/// The attention and experts of one layer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerParts {
    /// Its attention cores, in layer order.
    pub attention: Vec<AttentionPart>,
    /// Its mixtures of experts, in layer order.
    pub experts: Vec<ExpertsPart>,
}

/// The kind of an attention core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionForm {
    /// Every head with its own key and value.
    MultiHead,
    /// Groups of query heads sharing a key and value head, broadcast over the group
    /// (grouped-query attention; multi-query with one KV head).
    GroupedQuery {
        /// Key and value heads.
        kv_heads: i64,
    },
    /// Latent attention: keys and values expanded per head from a shared latent, the key's
    /// rotary part one head broadcast over all of them (DeepSeek-V2/V3's MLA).
    Latent,
}

/// One attention core.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttentionPart {
    /// Its matmuls (the scores' and the context's, or the one fused attention node).
    pub nodes: Vec<String>,
    /// What it is.
    pub form: AttentionForm,
    /// Its query heads, where known.
    pub heads: Option<i64>,
    /// Whether a head split reaches it (the analysis found it between projections it can split).
    pub splittable: bool,
}

/// One mixture of experts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertsPart {
    /// The fused experts node.
    pub node: String,
    /// Routed experts.
    pub routed: usize,
    /// Experts each token is routed to, where known.
    pub top_k: Option<i64>,
    /// Shared experts beside the routed ones: a gated MLP whose output is added to the
    /// experts', counted in experts' widths (0 when there is none).
    pub shared: i64,
}

/// The attention and experts of layer `layer`, whose split structure is `sg`.
pub fn describe(lg: &LayeredGraph, layer: usize, sg: &SplitGraph) -> LayerParts {
    let g = &lg.graph;
    let nodes = &lg.layers[layer].nodes;
    let mut out = LayerParts::default();
    let mut readers: HashMap<ValueId, Vec<NodeId>> = HashMap::new();
    for id in g.node_ids() {
        for &v in g.node(id).inputs.iter().flatten() {
            readers.entry(v).or_default().push(id);
        }
    }
    let dims = |v: Option<ValueId>| -> Vec<Option<i64>> {
        v.and_then(|v| g.value(v).ty.as_ref()?.shape.as_ref().map(|s| s.0.iter().map(|d| d.known()).collect()))
            .unwrap_or_default()
    };
    // (first matmul's layer index, part)
    let mut attention: Vec<(usize, AttentionPart)> = Vec::new();
    let attention_part = |first: NodeId, matmuls: Vec<NodeId>, splittable: bool, heads: Option<i64>| {
        let n = g.node(first);
        let q = dims(n.inputs.first().copied().flatten());
        let heads = if q.len() == 4 { q[1] } else { None }.or(heads);
        let form = n.inputs.get(1).copied().flatten().map_or(AttentionForm::MultiHead, |k| key_form(g, k));
        let names = matmuls.iter().map(|&m| g.node(m).name.clone()).collect();
        AttentionPart { nodes: names, form, heads, splittable }
    };
    let mut in_core = vec![false; nodes.len()];
    for (matmuls, heads) in sg.core_matmuls() {
        let Some(&first) = matmuls.first() else { continue };
        for &i in &matmuls {
            in_core[i] = true;
        }
        let ids: Vec<NodeId> = matmuls.iter().map(|&i| nodes[i]).collect();
        attention.push((first, attention_part(nodes[first], ids, true, heads)));
    }
    for (i, &id) in nodes.iter().enumerate() {
        let Some(n) = g.try_node(id) else { continue };
        let input = |i: usize| n.inputs.get(i).copied().flatten();
        match n.op.kind() {
            Some(OpKind::ScaledDotProductAttention) if !in_core[i] => {
                attention.push((i, attention_part(id, vec![id], false, None)));
            }
            Some(OpKind::MixtureOfExperts) => {
                let routed = usize::try_from(n.attrs.int("experts", 0)).unwrap_or(0);
                let top_k = dims(input(1)).get(1).copied().flatten();
                let width = dims(input(3)).get(1).copied().flatten().map(|r| r / 2);
                let shared = match (width, n.outputs.first()) {
                    (Some(w), Some(&o)) if w > 0 => shared_width(g, &readers, o).map_or(0, |s| s / w),
                    _ => 0,
                };
                out.experts.push(ExpertsPart { node: n.name.clone(), routed, top_k, shared });
            }
            _ => {}
        }
    }
    attention.sort_by_key(|a| a.0);
    out.attention = attention.into_iter().map(|a| a.1).collect();
    out
}

/// What key `k` (as the attention reads it) says of the attention, through views: a Concat one
/// of whose parts is one head expanded over all of them is latent attention's; a 5-D Expand
/// broadcasting each head over a group (`[b, kv, 1, s, d]` to `[b, kv, g, s, d]`) is
/// grouped-query attention's.
fn key_form(g: &Graph, k: ValueId) -> AttentionForm {
    let shape = |v: Option<ValueId>| g.value(v?).ty.as_ref()?.shape.as_ref()?.known();
    let mut v = k;
    for _ in 0..8 {
        let Some(n) = g.value(v).producer.map(|p| g.node(p)) else { break };
        match n.op.kind() {
            Some(OpKind::Transpose | OpKind::Reshape | OpKind::Identity) => match n.inputs.first().copied().flatten() {
                Some(x) => v = x,
                None => break,
            },
            Some(OpKind::Expand) => {
                if let (Some(x), Some(o)) = (shape(n.inputs.first().copied().flatten()), shape(Some(v)))
                    && x.len() == 5
                    && o.len() == 5
                    && x[2] == 1
                    && o[2] > 1
                {
                    return AttentionForm::GroupedQuery { kv_heads: x[1] };
                }
                break;
            }
            Some(OpKind::Concat) => {
                let latent = n.inputs.iter().flatten().any(|&part| {
                    let Some(e) = g.value(part).producer.map(|p| g.node(p)).filter(|e| e.op.is(OpKind::Expand)) else {
                        return false;
                    };
                    matches!((shape(e.inputs.first().copied().flatten()), shape(Some(part))),
                        (Some(x), Some(o)) if x.len() == 4 && o.len() == 4 && x[1] == 1 && o[1] > 1)
                });
                if latent {
                    return AttentionForm::Latent;
                }
                break;
            }
            _ => break,
        }
    }
    AttentionForm::MultiHead
}

/// The intermediate width of the MLP whose output is added to the experts' output `o` (through
/// views): its down-projection's contracted size.
fn shared_width(g: &Graph, readers: &HashMap<ValueId, Vec<NodeId>>, o: ValueId) -> Option<i64> {
    let mut v = o;
    for _ in 0..4 {
        let [r] = readers.get(&v)?.as_slice() else { return None };
        let n = g.node(*r);
        match n.op.kind()? {
            OpKind::Reshape | OpKind::Transpose | OpKind::Squeeze | OpKind::Unsqueeze => v = *n.outputs.first()?,
            OpKind::Add => {
                let other = n.inputs.iter().flatten().copied().find(|&x| x != v)?;
                let mm = g.node(g.value(other).producer?);
                if !mm.op.is(OpKind::MatMul) {
                    return None;
                }
                let producers: HashMap<ValueId, NodeId> = mm.inputs.get(1).copied().flatten().and_then(|w| g.value(w).producer.map(|p| (w, p))).into_iter().collect();
                let (w, transposed) = weight_param(g, &producers, mm.inputs.get(1).copied().flatten()?)?;
                let d = g.value(w).ty.as_ref()?.shape.as_ref()?.known()?;
                return if d.len() == 2 { Some(if transposed { d[1] } else { d[0] }) } else { None };
            }
            _ => return None,
        }
    }
    None
}
