//! Fusion: op chains that one fused kernel computes are rewritten into that one op.
//!
//! Exporters spell GELU as elementwise arithmetic: Hugging Face's `gelu_new` (GPT-2) as
//! `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, `F.gelu` at opsets below 20 as
//! `0.5·x·(1 + erf(x/√2))`. Each chain is eight or five elementwise nodes, each a full pass over
//! the activation forward and more backward (`Pow` with a tensor exponent runs `powf`). The chain
//! is the ONNX `Gelu` op (opset 20; `approximate = "tanh"` for the first form), whose meaning
//! every stage already knows (shape inference, figures, split rules: elementwise), and which the
//! runner runs as libtorch's fused `gelu` kernel.
//!
//! The rewrite keeps ids: the chain's last node becomes the `Gelu` node (same id, same output
//! value) reading the chain's input, and the chain's other nodes are removed. Each rewrite is
//! returned as an [`ir::Fusion`](crate::ir::Fusion): analysis runs this pass and keeps the
//! records (`LayeredGraph::fused`), the plan carries them, and the runner replays exactly them
//! with [`apply`], which checks each against the graph (no pattern matching at run time).
//!
//! Attention: eager attention as exporters spell it (Hugging Face's eager implementations,
//! `torch.onnx`'s decomposition of `F.scaled_dot_product_attention`),
//! `MatMul(Dropout?(Softmax(mask?(scale(MatMul(q, kᵀ))))), v)`, materialises the `s × s` scores
//! three or four times forward and backward. The chain is the IR op
//! [`OpKind::ScaledDotProductAttention`] (inputs `q, kᵀ, v, mask?`, attribute `scale`), which
//! the runner runs as libtorch's `scaled_dot_product_attention`. Recognised, exactly:
//! - scores `MatMul(q, kᵀ)` of rank-4 operands with equal leading (batch, heads) dims, `kᵀ` as
//!   the MatMul reads it (a Transpose before it stays a node of its own);
//! - a scale: `Mul` or `Div` of the scores by a one-element constant, and/or `Mul` of `q` and of
//!   `kᵀ` by one each (√scale on both sides, `torch.onnx`'s decomposition), or none;
//! - a mask, optionally: `Add` of a floating-point value of q's type that carries no gradient
//!   (additive mask), or `Where(bool mask, scores, c)` with `c` −∞ or below −1e30 (keep mask:
//!   the kernel's bool mask keeps where true, as the `Where` does);
//! - `Softmax` over the last axis, then optionally a `Dropout` that is inactive (no
//!   `training_mode`, or a constant false one, or ratio 0), then `MatMul(probabilities, v)`.
//!
//! Mixture of experts: `smp_partition.export` writes a model's routed experts (transformers'
//! experts interface: tokens, the router's top-k weights and indices, the stacked expert
//! weights) as a dense form every runtime can execute — the combine weights `[N, E]` from a
//! one-hot of the indices, every expert's gated MLP on every token, the weighted sum over
//! experts — so its compute grows with the expert count. The chain is the IR op
//! [`OpKind::MixtureOfExperts`] (inputs `x, weights, indices, gate_up, down`), whose kernel runs
//! each token through its k experts only. Recognised, exactly (`_moe.py`'s `dense_experts`):
//! ```text
//! dense = ReduceSum(Mul(Cast(Equal(Unsqueeze(indices, -1), 0..E)), Unsqueeze(weights, -1)), 1)
//! g, u  = Split(MatMul(gate_up, Transpose(x)), axis 1)
//! out   = Transpose(ReduceSum(Mul(MatMul(down, Mul(Mul(g, Sigmoid(g)), u)),
//!                                 Unsqueeze(Transpose(dense), 1)), 0))
//! ```
//! with `gate_up` `[E, 2I, H]` and `down` `[E, H, I]` initializers. A clamped SwiGLU
//! (DeepSeek-V4, GLM-5) clamps the halves first, `g` by `Clip(g, , L)` and `u` by
//! `Clip(u, −L, L)`, one constant L: the op's activation is then `clamped_silu` with that limit.
//! gpt-oss's gate, after the same two clamps, is `Mul(Mul(g, Sigmoid(Mul(g, α))), Add(u, 1))`:
//! `clamped_swish` with α and L. Experts with biases add `Unsqueeze(gate_up_bias [E, 2I], -1)`
//! to the gate-up MatMul and `Unsqueeze(down_bias [E, H], -1)` to the down MatMul (both or
//! neither, output weighting): the op then reads them as its sixth and seventh inputs. The router before it
//! (logits, softmax, top-k, normalisation) stays ordinary nodes, so every model's own routing
//! rule is kept as exported, and its outputs may have other readers (the auxiliary loss).
//!
//! RMSNorm: Hugging Face's Llama-family norm exports as
//! `Mul(w, Mul(x, Reciprocal(Sqrt(Add(ReduceMean(Pow(x, 2), [-1]), ε)))))`: six elementwise
//! passes forward and more backward, with the square as a `powf` per element (the exponent is a
//! tensor). The chain is the ONNX op `RMSNormalization` (`axis` −1, attribute `epsilon`), which
//! the runner runs as libtorch's `rms_norm`. Recognised, in any operand order: the square as
//! `Pow(x, 2)` or `Mul(x, x)`; `ReduceMean` over the last axis only, keeping it; `Add` of one
//! constant ε; the inverse root as `Reciprocal(Sqrt(·))` or `Div(1, Sqrt(·))`, multiplied into
//! `x`, or `Div(x, Sqrt(·))`; then `Mul` by a rank-1 weight as long as the last axis. Under
//! mixed precision (HF computes the norm in f32) the chain may sit between a `Cast` of `x` up
//! and a `Cast` back to `x`'s type before the weight; the fused op reads `x` as it was.
//!
//! SwiGLU: a gated MLP's `silu(gate) ⊙ up`, exported as `Mul(Mul(g, Sigmoid(g)), u)` (any
//! operand order), is the IR op [`OpKind::SwiGlu`] (inputs `gate, up`): libtorch's `silu` and
//! one multiply instead of three passes. Both are matched after the other fusions, so a
//! mixture of experts' dense form keeps its own SiLU gate.
//!
//! Rotary position embedding: `x·cos + rot(x)·sin`, exported as `Add(Mul(x, cos), Mul(rot(x),
//! sin))` (any operand order), is the IR op [`OpKind::ApplyRotary`] (inputs `x, cos, sin`): one
//! kernel instead of six to nine passes. `rot` is recognised in the two forms the exporters write,
//! on `x`'s last axis `d` (known, even):
//! - the half rotation (Llama's `rotate_half`): `Concat(Neg(Slice(x, d/2:)), Slice(x, :d/2))`,
//!   or with both halves cut by one `Split` (`torch.chunk`);
//! - the pairwise one (GPT-J's `rotate_every_two`, attribute `interleaved`):
//!   `Reshape(Concat(Unsqueeze(Neg(Slice(x, 1::2)), -1), Unsqueeze(Slice(x, 0::2), -1), -1))`
//!   back to `x`'s shape;
//! - the complex product (Llama 4's and DeepSeek-V2's `view_as_complex(x) · e^{iθ}`, which the
//!   front door exports in real arithmetic): with `a, b = Gather(Reshape(x, [.., d/2, 2]), 0 | 1,
//!   axis −1)`, `Reshape(Concat(Unsqueeze(a·c − b·s, −1), Unsqueeze(a·s + b·c, −1), −1))` back
//!   to `x`'s shape. That is the pairwise rotation with tables of one angle per pair (`c`, `s`
//!   broadcast to `[.., d/2]`), which `ApplyRotary` reads as they are.
//!
//! `cos` and `sin` broadcast to `x` (none longer than it along any axis; in the complex product,
//! to `x` with its last axis halved) and the output has `x`'s shape. A partial rotary (Phi, GPT-NeoX, GPT-J: the first channels rotated, the rest
//! concatenated back unchanged) fuses where `x` is the rotated slice: the slice and the concat
//! around it stay nodes of their own. The op's record is checked by matching the chain again.
//!
//! A chain is fused only where each interior value has the chain as its only reader and every
//! constant equals the formula's (within f32 rounding), so the fused op computes what the chain
//! computes, up to rounding.

use std::collections::HashSet;

use super::PassError;
use crate::ir::{
    Attr, AttentionMask, AttentionScale, ClampLimit, DType, Epsilon, ExpertActivation, ExpertWeighting, FusedOp, Fusion, GeluApproximation, Graph, NodeId,
    OpKind, SwishScale, ValueId,
};

/// How many chains of each kind a list of rewrites fused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fused {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` chains now `Gelu(approximate = "tanh")`.
    pub gelu_tanh: usize,
    /// `0.5·x·(1 + erf(x/√2))` chains now `Gelu`.
    pub gelu_erf: usize,
    /// Softmax attention chains now `ScaledDotProductAttention`.
    pub attention: usize,
    /// Dense mixture-of-experts chains now `MixtureOfExperts`.
    pub experts: usize,
    /// RMSNorm chains now `RMSNormalization`.
    pub rms_norm: usize,
    /// Written-out layer norms now `LayerNormalization`.
    pub layer_norm: usize,
    /// `silu(gate) ⊙ up` chains now `SwiGlu`.
    pub swiglu: usize,
    /// `x·cos + rot(x)·sin` chains now `ApplyRotary`, both forms.
    pub rotary: usize,
}

impl Fused {
    /// The counts of `fusions`.
    pub fn of(fusions: &[Fusion]) -> Fused {
        let mut out = Fused::default();
        for f in fusions {
            match f.op {
                FusedOp::Gelu { approximate: GeluApproximation::Tanh } => out.gelu_tanh += 1,
                FusedOp::Gelu { approximate: GeluApproximation::None } => out.gelu_erf += 1,
                FusedOp::Attention { .. } => out.attention += 1,
                FusedOp::MixtureOfExperts { .. } => out.experts += 1,
                FusedOp::RmsNorm { .. } => out.rms_norm += 1,
                FusedOp::LayerNorm { .. } => out.layer_norm += 1,
                FusedOp::SwiGlu => out.swiglu += 1,
                FusedOp::Rotary { .. } => out.rotary += 1,
            }
        }
        out
    }

    /// Chains rewritten in all.
    pub fn total(&self) -> usize {
        self.gelu_tanh + self.gelu_erf + self.attention + self.experts + self.rms_norm + self.layer_norm + self.swiglu + self.rotary
    }
}

impl std::fmt::Display for Fused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fused {} tanh-GELU and {} erf-GELU chains into Gelu, {} attention chains into ScaledDotProductAttention, {} expert chains into MixtureOfExperts, {} RMSNorm chains into RMSNormalization, {} layer norms into LayerNormalization, {} SwiGLU chains into SwiGlu, {} rotary chains into ApplyRotary",
            self.gelu_tanh, self.gelu_erf, self.attention, self.experts, self.rms_norm, self.layer_norm, self.swiglu, self.rotary
        )
    }
}

/// Rewrites every GELU, attention, mixture-of-experts, rotary, RMSNorm and SwiGLU chain of `graph`
/// into one node each (see the module docs); returns the rewrites in the order applied.
pub fn fuse(graph: &mut Graph) -> Vec<Fusion> {
    let mut out = Vec::new();
    // the norm and gate chains after the others: a dense mixture of experts holds a SiLU gate
    for late in [false, true] {
        fuse_sweep(graph, late, &mut out);
    }
    out
}

/// One sweep of [`fuse`] over the graph in topological order: the GELU, attention, experts
/// and rotary chains, or (`late`) the RMSNorm and SwiGLU chains.
fn fuse_sweep(graph: &mut Graph, late: bool, out: &mut Vec<Fusion>) {
    let Ok(order) = graph.topo_order() else { return };
    let grad = carries_gradient(graph, &order);
    let mut uses = readers(graph);
    for id in order {
        let Some(op) = graph.try_node(id).and_then(|n| n.op.kind()) else { continue };
        let m = Matcher { g: graph, uses: std::mem::take(&mut uses) };
        let output = || graph.node(id).outputs[0];
        let fusion = match (late, op) {
            (false, OpKind::Mul) => m.gelu(id).map(|(x, approximate)| {
                let approximate = if approximate { GeluApproximation::Tanh } else { GeluApproximation::None };
                Fusion { node: id, op: FusedOp::Gelu { approximate }, inputs: vec![x], output: output(), replaces: chain(graph, id, x) }
            }),
            (false, OpKind::MatMul) => m.attention(id, &grad).map(|a| Fusion {
                node: id,
                op: FusedOp::Attention { scale: AttentionScale(a.scale), mask: a.mask },
                inputs: a.inputs,
                output: output(),
                replaces: a.nodes,
            }),
            (false, OpKind::Transpose) => m.experts(id).map(|e| Fusion {
                node: id,
                op: FusedOp::MixtureOfExperts { experts: e.experts, activation: e.activation, weighting: e.weighting, biases: e.biases },
                inputs: e.inputs,
                output: output(),
                replaces: e.nodes,
            }),
            (false, OpKind::Add | OpKind::Reshape) => m.rotary(id).map(|r| Fusion {
                node: id,
                op: FusedOp::Rotary { interleaved: r.interleaved },
                inputs: r.inputs.to_vec(),
                output: output(),
                replaces: r.nodes,
            }),
            (true, OpKind::Mul | OpKind::Add) => m
                .layer_norm(id)
                .map(|l| Fusion { node: id, op: FusedOp::LayerNorm { epsilon: Epsilon(l.epsilon), bias: l.inputs.len() == 3 }, inputs: l.inputs, output: output(), replaces: l.nodes })
                .or_else(|| {
                    // a layer norm's scaling whose bias add comes next is fused at that add
                    if op != OpKind::Mul || m.layer_normed(id).is_some() {
                        return None;
                    }
                    m.rms_norm(id)
                        .map(|(x, w, epsilon, nodes)| Fusion { node: id, op: FusedOp::RmsNorm { epsilon: Epsilon(epsilon) }, inputs: vec![x, w], output: output(), replaces: nodes })
                        .or_else(|| m.swiglu(id).map(|(gate, up, nodes)| Fusion { node: id, op: FusedOp::SwiGlu, inputs: vec![gate, up], output: output(), replaces: nodes }))
                }),
            _ => None,
        };
        uses = m.uses;
        let Some(fusion) = fusion else { continue };
        // the matcher proved the chain; the checks of `apply` hold by construction
        let chain_reads: Vec<ValueId> = fusion.replaces.iter().filter_map(|&n| graph.try_node(n)).flat_map(|n| n.inputs.iter().flatten().copied()).collect();
        if apply_counted(graph, &fusion, &uses).is_ok() {
            // the chain's reads gone, the fused node's added: the counts without a rescan
            for v in chain_reads {
                uses[v.index()] = uses[v.index()].saturating_sub(1);
            }
            uses.resize(graph.value_count(), 0);
            for v in graph.node(fusion.node).inputs.iter().flatten() {
                uses[v.index()] += 1;
            }
            #[cfg(test)]
            assert_eq!(uses, readers(graph), "the counts after fusing `{}`", graph.node(fusion.node).name);
            out.push(fusion);
        }
    }
}

/// Which values carry a gradient: trained parameters and float values computed from them.
fn carries_gradient(g: &Graph, order: &[NodeId]) -> Vec<bool> {
    let mut grad: Vec<bool> = g.value_ids().map(|v| super::figures::is_trainable(g, v)).collect();
    grad.resize(g.value_count(), false);
    for &n in order {
        let node = g.node(n);
        if node.inputs.iter().flatten().any(|v| grad[v.index()]) {
            for &o in &node.outputs {
                grad[o.index()] = g.value(o).ty.as_ref().is_some_and(|t| t.dtype.is_float());
            }
        }
    }
    grad
}

/// The nodes between `x` and node `last`: `last` and every producer reached backwards from it
/// without passing through `x`, ascending.
fn chain(g: &Graph, last: NodeId, x: ValueId) -> Vec<NodeId> {
    let mut seen: HashSet<NodeId> = HashSet::new();
    let mut stack = vec![last];
    while let Some(n) = stack.pop() {
        if !seen.insert(n) {
            continue;
        }
        for &v in g.node(n).inputs.iter().flatten() {
            if v != x
                && let Some(p) = g.value(v).producer
            {
                stack.push(p);
            }
        }
    }
    let mut out: Vec<NodeId> = seen.into_iter().collect();
    out.sort();
    out
}

/// Applies one rewrite to `graph`: node `f.node` becomes `f.op` reading `f.inputs` (its output
/// kept), the chain's other nodes are removed. Refused, naming the node, unless the record fits
/// the graph: every replaced node exists, `f.node` is one of them and makes `f.output`, the
/// chain is closed (its nodes read only `f.inputs`, constants and each other, and a pairwise
/// rotary's `Reshape` its target shape; only `f.output` leaves it) and reads each of `f.inputs`, and its ops are those of `f.op`'s formula (for
/// attention: two MatMuls and a Softmax, the mask's `Add` or `Where` exactly when it has a
/// mask, and scalar `Mul`/`Div` constants whose product is the scale; for a rotary embedding:
/// the chain the matcher finds at the node, of the record's inputs and form).
pub fn apply(graph: &mut Graph, f: &Fusion) -> Result<(), PassError> {
    let uses = readers(graph);
    apply_counted(graph, f, &uses)
}

/// [`apply`] with `readers`, how many nodes read each value of `graph` (as [`readers`] counts).
fn apply_counted(graph: &mut Graph, f: &Fusion, readers: &[usize]) -> Result<(), PassError> {
    let name = graph.try_node(f.node).map_or_else(|| format!("#{}", f.node.index()), |n| n.name.clone());
    let bad = |msg: String| PassError::Fusion { node: name.clone(), msg };
    if !f.replaces.contains(&f.node) {
        return Err(bad("the node is not among the nodes it replaces".into()));
    }
    if f.inputs.len() != f.op.arity() {
        return Err(bad(format!("{} reads {} inputs, the record lists {}", f.op, f.op.arity(), f.inputs.len())));
    }
    if let Some(&v) = f.inputs.iter().find(|v| v.index() >= graph.value_count()) {
        return Err(bad(format!("input #{} is not a value of the graph", v.index())));
    }
    let mut members: HashSet<NodeId> = HashSet::new();
    for &n in &f.replaces {
        if graph.try_node(n).is_none() {
            return Err(bad(format!("it replaces node #{}, which the graph does not have", n.index())));
        }
        if !members.insert(n) {
            return Err(bad(format!("it lists node `{}` twice", graph.node(n).name)));
        }
    }
    if graph.node(f.node).outputs != [f.output] {
        return Err(bad(format!("the node does not make `{}` (alone)", graph.value(f.output).name)));
    }
    let mut read = vec![false; f.inputs.len()];
    let mut ops: Vec<OpKind> = Vec::new();
    // nodes outside the chain that it reads and that compute from its indices alone (`index_only`)
    let mut external: Vec<NodeId> = Vec::new();
    for &n in &f.replaces {
        let node = graph.node(n);
        match node.op {
            crate::ir::Op::Known(k) => ops.push(k),
            crate::ir::Op::Collective { .. } | crate::ir::Op::Placeholder { .. } => return Err(bad(format!("node `{}` of the chain has op {}, which no fused op has", node.name, node.op))),
        }
        for &v in node.inputs.iter().flatten() {
            let val = graph.value(v);
            if f.inputs.contains(&v) {
                for (r, _) in read.iter_mut().zip(&f.inputs).filter(|(_, x)| **x == v) {
                    *r = true;
                }
            } else if shape_operand(f, node, v) {
                // read where it stands (the rotary check below holds the reshape's output dims)
            } else if let Some(p) = val.producer.filter(|p| !members.contains(p)) {
                match index_only(graph, f, p, &members) {
                    Some(nodes) => external.extend(nodes),
                    None => return Err(bad(format!("node `{}` of the chain reads `{}`, made by `{}` outside it", node.name, val.name, graph.node(p).name))),
                }
            } else if val.producer.is_none() && val.data.is_none() {
                return Err(bad(format!("node `{}` of the chain reads `{}`, which is neither made in the chain nor a constant", node.name, val.name)));
            }
        }
    }
    external.sort();
    external.dedup();
    for &n in &external {
        ops.extend(graph.node(n).op.kind());
        for (r, x) in read.iter_mut().zip(&f.inputs) {
            *r |= graph.node(n).inputs.contains(&Some(*x));
        }
    }
    if let Some(i) = read.iter().position(|r| !r) {
        return Err(bad(format!("no node of the chain reads its input `{}`", graph.value(f.inputs[i]).name)));
    }
    for &n in f.replaces.iter().filter(|&&n| n != f.node) {
        for &o in &graph.node(n).outputs {
            let inside: usize = f.replaces.iter().map(|&m| graph.node(m).inputs.iter().flatten().filter(|&&v| v == o).count()).sum();
            if readers[o.index()] != inside {
                return Err(bad(format!("`{}` of node `{}` is read outside the chain", graph.value(o).name, graph.node(n).name)));
            }
        }
    }
    let count = |k: OpKind| ops.iter().filter(|&&o| o == k).count();
    let mut attrs = crate::ir::Attrs::default();
    let kind = match f.op {
        FusedOp::Gelu { approximate } => {
            let core = match approximate {
                GeluApproximation::Tanh => OpKind::Tanh,
                GeluApproximation::None => OpKind::Erf,
            };
            if count(core) == 0 || count(OpKind::Mul) == 0 {
                return Err(bad(format!("the chain has no {core:?} and Mul, so it is not {}", f.op)));
            }
            if approximate == GeluApproximation::Tanh {
                attrs.set("approximate", Attr::Str("tanh".into()));
            }
            OpKind::Gelu
        }
        FusedOp::Attention { scale, mask } => {
            check_attention(graph, f, &ops, scale.0, mask).map_err(bad)?;
            attrs.set("scale", Attr::Tensor(crate::ir::Tensor::from_f64(vec![], &[scale.0])));
            OpKind::ScaledDotProductAttention
        }
        FusedOp::MixtureOfExperts { experts, activation, weighting, biases } => {
            check_experts(graph, f, &ops, &external, experts, activation, weighting, biases).map_err(bad)?;
            attrs.set("experts", Attr::Int(experts as i64));
            activation.set_attrs(&mut attrs);
            if let Some(w) = weighting.attr() {
                attrs.set("weighting", Attr::Str(w.into()));
            }
            OpKind::MixtureOfExperts
        }
        FusedOp::RmsNorm { epsilon } => {
            check_rms_norm(graph, f, &ops, epsilon.0).map_err(bad)?;
            attrs.set("axis", Attr::Int(-1));
            // exactly the chain's constant (an f32 attribute would be read as its decimal)
            attrs.set("epsilon", Attr::Tensor(crate::ir::Tensor::from_f64(vec![], &[epsilon.0])));
            OpKind::RMSNormalization
        }
        FusedOp::LayerNorm { epsilon, bias } => {
            let m = Matcher { g: graph, uses: readers.to_vec() };
            let found = m.layer_norm(f.node);
            if !found.as_ref().is_some_and(|l| l.inputs == f.inputs && l.nodes == f.replaces && l.epsilon.to_bits() == epsilon.0.to_bits() && (l.inputs.len() == 3) == bias) {
                return Err(bad(format!("the chain is not a layer norm over the last axis of its inputs with ε = {}", epsilon.0)));
            }
            attrs.set("axis", Attr::Int(-1));
            attrs.set("epsilon", Attr::Tensor(crate::ir::Tensor::from_f64(vec![], &[epsilon.0])));
            OpKind::LayerNormalization
        }
        FusedOp::SwiGlu => {
            use OpKind::*;
            if !graph.node(f.node).op.is(Mul) || count(Mul) != 2 || count(Sigmoid) != 1 || ops.len() != 3 {
                return Err(bad(format!("the chain's ops are {ops:?}, not SwiGLU's two Muls and a Sigmoid")));
            }
            OpKind::SwiGlu
        }
        FusedOp::Rotary { interleaved } => {
            let m = Matcher { g: graph, uses: readers.to_vec() };
            let found = m.rotary(f.node);
            if !found.as_ref().is_some_and(|r| r.inputs[..] == f.inputs[..] && r.interleaved == interleaved && r.nodes == f.replaces) {
                let form = if interleaved { "pairwise" } else { "half" };
                return Err(bad(format!("the chain is not x·cos + rot(x)·sin with the {form} rotation, of its inputs")));
            }
            attrs.set("interleaved", Attr::Int(i64::from(interleaved)));
            OpKind::ApplyRotary
        }
    };
    let node = graph.node_mut(f.node);
    node.op = crate::ir::Op::Known(kind);
    node.attrs = attrs;
    node.inputs = f.inputs.iter().map(|&v| Some(v)).collect();
    // rewires the node's edges to its inputs
    graph.set_input(f.node, 0, Some(f.inputs[0]));
    for &n in f.replaces.iter().filter(|&&n| n != f.node) {
        graph.remove_node(n);
    }
    Ok(())
}

/// Whether `v`, read by `node` of a rotary record's chain, is the target shape of its pairwise
/// rotation's `Reshape`: a dynamic-shape export computes it from the input's shape outside the
/// chain.
fn shape_operand(f: &Fusion, node: &crate::ir::Node, v: ValueId) -> bool {
    matches!(f.op, FusedOp::Rotary { interleaved: true }) && node.op.is(OpKind::Reshape) && node.inputs.get(1) == Some(&Some(v))
}

/// For a mixture-of-experts record, node `p` outside its chain with every node it reads from
/// (outside the chain too), when together they compute from the record's indices and constants
/// alone: the one-hot of the indices, which blocks routing by the same indices (hash routing on
/// the same tokens) share once the exporter merged their identical nodes. The chain reads it
/// where it stands, and the node stays for its other readers. `None` for any other node or
/// record.
fn index_only(g: &Graph, f: &Fusion, p: NodeId, members: &HashSet<NodeId>) -> Option<Vec<NodeId>> {
    let FusedOp::MixtureOfExperts { .. } = f.op else { return None };
    let indices = f.inputs[2];
    let (mut seen, mut stack) = (Vec::new(), vec![p]);
    while let Some(n) = stack.pop() {
        if seen.contains(&n) {
            continue;
        }
        // a one-hot is three nodes (Unsqueeze, Equal, Cast): a longer computation is not one
        if seen.len() >= 8 || members.contains(&n) {
            return None;
        }
        seen.push(n);
        for &v in g.node(n).inputs.iter().flatten() {
            match g.value(v).producer {
                _ if v == indices => {}
                Some(q) => stack.push(q),
                None if g.value(v).data.is_some() => {}
                None => return None,
            }
        }
    }
    Some(seen)
}

/// The op checks of an attention record (see [`apply`]): the chain's ops, the mask's type and
/// the scale its constants multiply to.
fn check_attention(g: &Graph, f: &Fusion, ops: &[OpKind], scale: f64, mask: Option<AttentionMask>) -> Result<(), String> {
    use OpKind::*;
    let count = |k: OpKind| ops.iter().filter(|&&o| o == k).count();
    if !g.node(f.node).op.is(MatMul) {
        return Err(format!("the node is a {}, not the MatMul by V", g.node(f.node).op));
    }
    if count(MatMul) != 2 || count(Softmax) != 1 {
        return Err(format!("the chain has {} MatMuls and {} Softmaxes, not 2 and 1", count(MatMul), count(Softmax)));
    }
    if let Some(k) = ops.iter().find(|k| !matches!(k, MatMul | Softmax | Mul | Div | Add | Where | Dropout)) {
        return Err(format!("the chain has a {k}, which attention does not"));
    }
    let mask_dtype = f.inputs.get(3).and_then(|&m| g.value(m).ty.as_ref()).map(|t| t.dtype);
    let (adds, wheres) = match mask {
        None => (0, 0),
        Some(AttentionMask::Additive) if mask_dtype.is_some_and(|d| d.is_float()) => (1, 0),
        Some(AttentionMask::Keep) if mask_dtype == Some(DType::Bool) => (0, 1),
        Some(m) => return Err(format!("the mask `{}` is not a {m:?} mask's type", g.value(f.inputs[3]).name)),
    };
    if count(Add) != adds || count(Where) != wheres {
        return Err(format!("the chain has {} Adds and {} Wheres, its mask ({mask:?}) needs {adds} and {wheres}", count(Add), count(Where)));
    }
    let mut product = 1.0;
    for &n in &f.replaces {
        let node = g.node(n);
        let konst = node.inputs.iter().flatten().find_map(|&v| {
            let val = g.value(v);
            (val.producer.is_none() && !f.inputs.contains(&v)).then(|| val.data.as_ref().and_then(|d| d.to_f64_vec())).flatten()
        });
        match (node.op.kind(), konst.as_deref()) {
            (Some(Mul), Some([c])) => product *= c,
            (Some(Div), Some([c])) => product /= c,
            (Some(Mul | Div), _) => return Err(format!("`{}` does not scale by one constant", node.name)),
            _ => {}
        }
    }
    if (product - scale).abs() > 1e-12 * scale.abs().max(1e-300) {
        return Err(format!("its constants scale by {product}, the record by {scale}"));
    }
    Ok(())
}

/// The op checks of an RMSNorm record (see [`apply`]): the node is the weight's `Mul`, the
/// chain's ops are the norm's (one `ReduceMean`, `Sqrt` and `Add`), and the `Add` adds ε.
fn check_rms_norm(g: &Graph, f: &Fusion, ops: &[OpKind], epsilon: f64) -> Result<(), String> {
    use OpKind::*;
    let count = |k: OpKind| ops.iter().filter(|&&o| o == k).count();
    if !g.node(f.node).op.is(Mul) {
        return Err(format!("the node is a {}, not the Mul by the weight", g.node(f.node).op));
    }
    if let Some(k) = ops.iter().find(|k| !matches!(k, Pow | Mul | ReduceMean | Add | Sqrt | Reciprocal | Div | Cast)) {
        return Err(format!("the chain has a {k}, which RMSNorm does not"));
    }
    if count(ReduceMean) != 1 || count(Sqrt) != 1 || count(Add) != 1 || !matches!(count(Cast), 0 | 2) {
        return Err(format!("the chain has {} ReduceMeans, {} Sqrts and {} Adds, not one each", count(ReduceMean), count(Sqrt), count(Add)));
    }
    let added = f.replaces.iter().filter(|&&n| g.node(n).op.is(Add)).flat_map(|&n| g.node(n).inputs.iter().flatten().copied()).find_map(|v| {
        let val = g.value(v);
        (val.producer.is_none() && !f.inputs.contains(&v)).then(|| val.data.as_ref().and_then(|d| d.to_f64_vec())).flatten()
    });
    match added.as_deref() {
        Some([e]) if (e - epsilon).abs() <= 1e-12 * epsilon.abs().max(1e-300) => Ok(()),
        _ => Err(format!("its Add does not add ε = {epsilon}")),
    }
}

/// The op checks of a mixture-of-experts record (see [`apply`]): the dense chain's ops, once
/// each as its formula has them, the expert ids it compares the indices with (`0..experts`), and
/// weights of `experts` experts.
#[allow(clippy::too_many_arguments)]
fn check_experts(g: &Graph, f: &Fusion, ops: &[OpKind], external: &[NodeId], experts: usize, activation: ExpertActivation, weighting: ExpertWeighting, biases: bool) -> Result<(), String> {
    use OpKind::*;
    if !g.node(f.node).op.is(Transpose) {
        return Err(format!("the node is a {}, not the Transpose of the combined output", g.node(f.node).op));
    }
    // the expert sum reads the weighted outputs (a Mul) or, with the tokens weighted going in,
    // the experts' outputs themselves (a MatMul)
    let summed = g.node(f.node).inputs.first().copied().flatten().and_then(|v| g.value(v).producer);
    let summand = summed.and_then(|r| g.node(r).inputs.first().copied().flatten()).and_then(|v| g.value(v).producer);
    let want_op = if weighting == ExpertWeighting::Input { MatMul } else { Mul };
    if !summand.is_some_and(|n| g.node(n).op.is(want_op)) {
        return Err(format!("the expert sum does not read a {want_op}, as {weighting:?} weighting does"));
    }
    let clips = if activation == ExpertActivation::Silu { 0 } else { 2 };
    // gpt-oss's gate scales g inside the sigmoid and offsets u; each bias is an Unsqueeze and an Add
    let swish = usize::from(matches!(activation, ExpertActivation::ClampedSwish { .. }));
    let biased = 2 * usize::from(biases);
    let want: [(OpKind, usize); 11] = [
        (Transpose, 3),
        (ReduceSum, 2),
        (Mul, 4 + swish),
        (MatMul, 2),
        (Unsqueeze, 3 + biased),
        (Cast, 1),
        (Equal, 1),
        (Sigmoid, 1),
        (Split, 1),
        (Clip, clips),
        (Add, swish + biased),
    ];
    let count = |k: OpKind| ops.iter().filter(|&&o| o == k).count();
    if let Some(k) = ops.iter().find(|k| !want.iter().any(|(w, _)| w == *k)) {
        return Err(format!("the chain has a {k}, which the dense experts do not"));
    }
    if let Some((k, n)) = want.iter().find(|(k, n)| count(*k) != *n) {
        return Err(format!("the chain has {} {k} nodes, the dense experts {n}", count(*k)));
    }
    for (i, what) in [(3usize, "gate_up"), (4, "down")] {
        let lead = g.value(f.inputs[i]).ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(|s| s.0.first()).and_then(|d| d.known());
        if lead.is_some_and(|e| e != experts as i64) {
            return Err(format!("{what} `{}` holds {} experts, the record {experts}", g.value(f.inputs[i]).name, lead.unwrap_or(0)));
        }
    }
    if let ExpertActivation::ClampedSwish { alpha, .. } = activation {
        // one Mul by α (inside the sigmoid) and one Add of 1 (to the up projection)
        let constants = |k: OpKind| -> Vec<f64> {
            f.replaces
                .iter()
                .filter(|&&n| g.node(n).op.is(k))
                .flat_map(|&n| g.node(n).inputs.iter().flatten().filter_map(|&v| constant_f64s(g, v)).filter(|c| c.len() == 1).flatten().collect::<Vec<_>>())
                .collect()
        };
        let (scales, offsets) = (constants(Mul), constants(Add));
        let near = |c: &[f64], want: f64| matches!(c, [v] if (v - want).abs() <= 1e-6 * want.abs());
        if !near(&scales, alpha.0) || !near(&offsets, 1.0) {
            return Err(format!("its gate's constants (scales {scales:?}, offsets {offsets:?}) are not the swish's α {} and the up projection's + 1", alpha.0));
        }
    }
    if let ExpertActivation::ClampedSilu { limit } | ExpertActivation::ClampedSwish { limit, .. } = activation {
        // the gate clamped to at most the limit, the up projection to ± it
        let konst = |v: Option<ValueId>| v.and_then(|v| constant_f64s(g, v));
        type Bounds = (Option<Vec<f64>>, Option<Vec<f64>>);
        let mut bounds: Vec<Bounds> = f
            .replaces
            .iter()
            .filter(|&&n| g.node(n).op.is(Clip))
            .map(|&n| (konst(g.node(n).inputs.get(1).copied().flatten()), konst(g.node(n).inputs.get(2).copied().flatten())))
            .collect();
        bounds.sort_by_key(|b| b.0.is_some());
        let l = limit.0;
        if bounds != [(None, Some(vec![l])), (Some(vec![-l]), Some(vec![l]))] {
            return Err(format!("its Clip bounds {bounds:?} are not the gate's (none, {l}) and the up projection's ({}, {l})", -l));
        }
    }
    let ids: Vec<f64> = (0..experts).map(|e| e as f64).collect();
    let compared = f.replaces.iter().chain(external).filter(|&&n| g.node(n).op.is(Equal)).flat_map(|&n| g.node(n).inputs.iter().flatten().copied()).find_map(|v| constant_f64s(g, v));
    if compared.as_deref() != Some(ids.as_slice()) {
        return Err(format!("the indices are not compared with the expert ids 0..{experts}"));
    }
    Ok(())
}

/// The values of `v` when it is a constant (an initializer or folded value, made by no node).
fn constant_f64s(g: &Graph, v: ValueId) -> Option<Vec<f64>> {
    let val = g.value(v);
    if val.producer.is_some() {
        return None;
    }
    val.data.as_ref()?.to_f64_vec()
}

/// How many nodes read each value (graph outputs count as a reader).
pub(super) fn readers(g: &Graph) -> Vec<usize> {
    let mut n = vec![0; g.value_count()];
    for id in g.node_ids() {
        for v in g.node(id).inputs.iter().flatten() {
            n[v.index()] += 1;
        }
    }
    for v in &g.outputs {
        n[v.index()] += 1;
    }
    n
}

/// The one output of node `n`.
fn a_out(g: &Graph, n: NodeId) -> Option<ValueId> {
    g.node(n).outputs.first().copied()
}

struct Matcher<'g> {
    g: &'g Graph,
    uses: Vec<usize>,
}

/// What [`Matcher::attention`] found.
struct AttentionMatch {
    inputs: Vec<ValueId>,
    scale: f64,
    mask: Option<AttentionMask>,
    nodes: Vec<NodeId>,
}

/// What [`Matcher::experts`] found.
struct ExpertsMatch {
    inputs: Vec<ValueId>,
    experts: usize,
    activation: ExpertActivation,
    weighting: ExpertWeighting,
    biases: bool,
    nodes: Vec<NodeId>,
}

/// What [`Matcher::layer_norm`] found.
#[derive(Debug, PartialEq)]
struct LayerNormMatch {
    /// `x, γ` and `β` when the chain adds one.
    inputs: Vec<ValueId>,
    epsilon: f64,
    nodes: Vec<NodeId>,
}

/// What [`Matcher::rotary`] found.
#[derive(Debug, PartialEq, Eq)]
struct RotaryMatch {
    /// `x, cos, sin`.
    inputs: [ValueId; 3],
    interleaved: bool,
    nodes: Vec<NodeId>,
}

/// A `Where` fill at or below this (or −∞) masks a score out as the kernel's −∞ does.
const MASKED_OUT: f64 = -1e30;

/// √(2/π) and 1/√2 as the formulas use them.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const SQRT_2: f64 = std::f64::consts::SQRT_2;

impl Matcher<'_> {
    /// The node making `v` when `v` is read only by the chain, with its op.
    fn inner(&self, v: ValueId, op: OpKind) -> Option<NodeId> {
        let p = self.g.value(v).producer?;
        let n = self.g.node(p);
        (n.op.is(op) && n.outputs.len() == 1 && self.uses[v.index()] == 1).then_some(p)
    }

    /// The node making `v`, with its op, whatever reads `v`.
    fn made_by(&self, v: ValueId, op: OpKind) -> Option<NodeId> {
        let p = self.g.value(v).producer?;
        let n = self.g.node(p);
        (n.op.is(op) && n.outputs.len() == 1).then_some(p)
    }

    /// The two inputs of a binary node.
    fn pair(&self, id: NodeId) -> Option<(ValueId, ValueId)> {
        match self.g.node(id).inputs.as_slice() {
            [Some(a), Some(b)] => Some((*a, *b)),
            _ => None,
        }
    }

    /// The value of a one-element constant (initializer or folded constant).
    fn scalar(&self, v: ValueId) -> Option<f64> {
        let val = self.g.value(v);
        if val.producer.is_some() {
            return None;
        }
        if val.training.as_ref().is_some_and(|t| matches!(t, crate::ir::Training::Trained { .. })) {
            return None;
        }
        let data = val.data.as_ref()?;
        if data.numel() != 1 {
            return None;
        }
        data.to_f64_vec()?.first().copied()
    }

    fn is_const(&self, v: ValueId, want: f64) -> bool {
        // f32 rounding of the formula's constant, and of its reciprocal for `Div`
        self.scalar(v).is_some_and(|c| (c - want).abs() <= 1e-6 * want.abs().max(1e-30))
    }

    /// For a commutative binary node: (the other input, true) when one input is the constant.
    fn with_const(&self, id: NodeId, want: f64) -> Option<ValueId> {
        let (a, b) = self.pair(id)?;
        if self.is_const(b, want) {
            Some(a)
        } else if self.is_const(a, want) {
            Some(b)
        } else {
            None
        }
    }

    /// The shape of `v` when known (dims may be symbolic).
    fn dims(&self, v: ValueId) -> Option<&[crate::ir::Dim]> {
        self.g.value(v).ty.as_ref()?.shape.as_ref().map(|s| s.0.as_slice())
    }

    fn dtype(&self, v: ValueId) -> Option<DType> {
        self.g.value(v).ty.as_ref().map(|t| t.dtype)
    }

    /// For a binary node with a one-element constant operand of rank at most 4: (the other
    /// operand, the constant, whether the constant is the second operand).
    fn scalar_operand(&self, id: NodeId) -> Option<(ValueId, f64, bool)> {
        let (a, b) = self.pair(id)?;
        let small = |v: ValueId| self.g.value(v).data.as_ref().is_some_and(|d| d.dims.len() <= 4);
        if let Some(c) = self.scalar(b).filter(|_| small(b)) {
            Some((a, c, true))
        } else {
            self.scalar(a).filter(|_| small(a)).map(|c| (b, c, false))
        }
    }

    /// `id` = MatMul(Dropout?(Softmax(mask?(scale(MatMul(q, kᵀ))))), v), exactly as the module
    /// docs list; `grad` marks values that carry a gradient (a mask must not).
    fn attention(&self, id: NodeId, grad: &[bool]) -> Option<AttentionMatch> {
        use OpKind::*;
        let mut nodes = vec![id];
        let (mut p, v) = self.pair(id)?;
        // an inactive dropout on the probabilities
        if let Some(d) = self.g.value(p).producer.filter(|&d| self.g.node(d).op.is(Dropout)) {
            let node = self.g.node(d);
            let extra_unread = node.outputs.iter().skip(1).all(|o| self.uses[o.index()] == 0);
            if self.uses[p.index()] != 1 || node.outputs[0] != p || !extra_unread || !self.dropout_inactive(d) {
                return None;
            }
            nodes.push(d);
            p = node.inputs.first().copied().flatten()?;
        }
        let sm = self.inner(p, Softmax)?;
        nodes.push(sm);
        let x = self.g.node(sm).inputs.first().copied().flatten()?;
        let rank = self.dims(x)?.len() as i64;
        let axis = self.g.node(sm).attrs.int("axis", -1);
        if rank != 4 || (axis != -1 && axis != rank - 1) {
            return None;
        }
        // the mask, if any, then the scaled scores
        let mut mask = None;
        let mut scores = x;
        if let Some(a) = self.inner(x, Add) {
            let (l, r) = self.pair(a)?;
            let (s, m) = if self.inner(l, Mul).or(self.inner(l, Div)).or(self.inner(l, MatMul)).is_some() { (l, r) } else { (r, l) };
            if grad[m.index()] || self.dims(a_out(self.g, a)?)? != self.dims(s)? || self.dims(m)?.len() > 4 {
                return None;
            }
            mask = Some((m, AttentionMask::Additive));
            scores = s;
            nodes.push(a);
        } else if let Some(w) = self.inner(x, Where) {
            let ins = &self.g.node(w).inputs;
            let (Some(Some(c)), Some(Some(s)), Some(Some(fill))) = (ins.first(), ins.get(1), ins.get(2)) else { return None };
            let masked_out = self.scalar(*fill).is_some_and(|f| f <= MASKED_OUT);
            if !masked_out || self.dtype(*c) != Some(DType::Bool) || self.dims(a_out(self.g, w)?)? != self.dims(*s)? || self.dims(*c)?.len() > 4 {
                return None;
            }
            mask = Some((*c, AttentionMask::Keep));
            scores = *s;
            nodes.push(w);
        }
        let mut scale = 1.0;
        for op in [Mul, Div] {
            if let Some(n) = self.inner(scores, op) {
                let (other, c, second) = self.scalar_operand(n)?;
                scale *= match op {
                    Div if second && c != 0.0 => 1.0 / c,
                    Div => return None,
                    _ => c,
                };
                scores = other;
                nodes.push(n);
                break;
            }
        }
        let mm = self.inner(scores, MatMul)?;
        nodes.push(mm);
        let (mut q, mut kt) = self.pair(mm)?;
        // √scale on each side
        for side in [&mut q, &mut kt] {
            if let Some(n) = self.inner(*side, Mul)
                && let Some((other, c, _)) = self.scalar_operand(n)
            {
                scale *= c;
                *side = other;
                nodes.push(n);
            }
        }
        // rank-4 operands, equal leading dims, of one float type
        let (qd, kd, vd, sd) = (self.dims(q)?, self.dims(kt)?, self.dims(v)?, self.dims(scores)?);
        let dt = self.dtype(q)?;
        let same_type = [kt, v].iter().all(|&w| self.dtype(w) == Some(dt)) && dt.is_float();
        if qd.len() != 4 || kd.len() != 4 || vd.len() != 4 || sd.len() != 4 || !same_type {
            return None;
        }
        if qd[..2] != kd[..2] || qd[..2] != vd[..2] || qd[3] != kd[2] || kd[3] != vd[2] || !scale.is_finite() {
            return None;
        }
        if let Some((m, AttentionMask::Additive)) = mask
            && self.dtype(m) != Some(dt)
        {
            return None;
        }
        let mut inputs = vec![q, kt, v];
        inputs.extend(mask.map(|(m, _)| m));
        nodes.sort();
        Some(AttentionMatch { inputs, scale, mask: mask.map(|(_, k)| k), nodes })
    }

    /// The int constant of input `i` of node `n`.
    fn const_ints(&self, n: NodeId, i: usize) -> Option<Vec<i64>> {
        let v = self.g.node(n).inputs.get(i).copied().flatten()?;
        let val = self.g.value(v);
        if val.producer.is_some() {
            return None;
        }
        val.data.as_ref()?.to_f64_vec().map(|d| d.iter().map(|&x| x as i64).collect())
    }

    /// `n` is a Transpose swapping the two axes of a rank-2 value.
    fn is_swap(&self, n: NodeId) -> bool {
        let node = self.g.node(n);
        let x = node.inputs.first().copied().flatten();
        node.op.is(OpKind::Transpose)
            && x.and_then(|x| self.dims(x)).is_some_and(|d| d.len() == 2)
            && node.attrs.ints("perm").is_none_or(|p| p == [1, 0])
    }

    /// `n`'s axes (input 1), normalised against `rank`.
    fn axes_of(&self, n: NodeId, rank: usize) -> Option<Vec<usize>> {
        self.axes_of_at(n, 1, rank)
    }

    /// The input of `Unsqueeze` node `n` when it adds a last axis to a rank-2 value.
    fn unsqueezed_last(&self, n: NodeId) -> Option<ValueId> {
        let x = self.g.node(n).inputs.first().copied().flatten()?;
        (self.axes_of(n, 3)? == [2] && self.dims(x)?.len() == 2).then_some(x)
    }

    /// `id` = the dense mixture of experts of the module docs, ending in the Transpose back to
    /// `[N, H]`.
    fn experts(&self, id: NodeId) -> Option<ExpertsMatch> {
        use OpKind::*;
        let input0 = |n: NodeId| self.g.node(n).inputs.first().copied().flatten();
        if !self.is_swap(id) {
            return None;
        }
        let mut nodes = vec![id];
        let (r_out, summand) = self.reduce_sum(input0(id)?, 0)?;
        nodes.push(r_out);
        // Output weighting: Mul(MatMul(down, h), Unsqueeze(Transpose(dense), 1)); input
        // weighting: MatMul(down, h), the tokens scaled before gate_up instead
        // Output weighting: Mul(MatMul(down, h) (+ its bias), Unsqueeze(Transpose(dense), 1))
        let (mm_down, output_combine, down_bias) = match self.inner(summand, MatMul) {
            Some(mm) => (mm, None, None),
            None => {
                let mul = self.inner(summand, Mul)?;
                nodes.push(mul);
                let (a, b) = self.pair(mul)?;
                let is_y = |v: ValueId| self.inner(v, MatMul).is_some() || self.bias_add(v).is_some();
                let (y, du) = if is_y(a) { (a, b) } else { (b, a) };
                let (y, bias) = match self.bias_add(y) {
                    Some((add, unsq, y0, bias)) => {
                        nodes.extend([add, unsq]);
                        (y0, Some(bias))
                    }
                    None => (y, None),
                };
                (self.inner(y, MatMul)?, Some(du), bias)
            }
        };
        let (down, h) = self.pair(mm_down)?;
        nodes.push(mm_down);
        // h = act(g) ⊙ u, g and u the halves of gate_up · xᵀ (+ its bias)
        let mh = self.inner(h, Mul)?;
        let (a, b) = self.pair(mh)?;
        let (g, u, activation) = if let Some((gate_nodes, g, u, alpha)) = self.swish_gate(a, b) {
            // gpt-oss: min(g, L)·σ(α·min(g, L)) ⊙ (clip(u, ±L) + 1)
            let ((cg, g0, limit), (cu, u0, limit_up)) = (self.clip(g, 2, true)?, self.clip(u, 1, false)?);
            if limit.to_bits() != limit_up.to_bits() {
                return None;
            }
            nodes.extend(gate_nodes);
            nodes.extend([cg, cu]);
            (g0, u0, ExpertActivation::ClampedSwish { alpha: SwishScale(alpha), limit: ClampLimit(limit) })
        } else {
            let (act, u) = if self.silu(a).is_some() { (a, b) } else { (b, a) };
            let (m_silu, sig, g) = self.silu(act)?;
            nodes.extend([m_silu, sig]);
            // a clamped SwiGLU clamps both halves first: the gate to at most the limit, up to ± it
            match (self.clip(g, 2, true), self.clip(u, 1, false)) {
                (Some((cg, g0, limit)), Some((cu, u0, limit_up))) if limit.to_bits() == limit_up.to_bits() => {
                    nodes.extend([cg, cu]);
                    (g0, u0, ExpertActivation::ClampedSilu { limit: ClampLimit(limit) })
                }
                _ => (g, u, ExpertActivation::Silu),
            }
        };
        let gate_reads = if activation == ExpertActivation::Silu { 2 } else { 1 };
        let split = self.g.value(g).producer?;
        let sp = self.g.node(split);
        let two_halves = sp.outputs == [g, u]
            && self.uses[g.index()] == gate_reads
            && self.uses[u.index()] == 1
            && sp.attrs.int("axis", 0) == 1
            && self.const_ints(split, 1).is_none_or(|s| s.len() == 2 && s[0] == s[1]);
        if !two_halves {
            return None;
        }
        let (projected, gate_up_bias) = match self.bias_add(input0(split)?) {
            Some((add, unsq, m, bias)) => {
                nodes.extend([add, unsq]);
                (m, Some(bias))
            }
            None => (input0(split)?, None),
        };
        if gate_up_bias.is_some() != down_bias.is_some() {
            return None;
        }
        let mm_gu = self.inner(projected, MatMul)?;
        let (gate_up, xt) = self.pair(mm_gu)?;
        nodes.extend([mh, split, mm_gu]);
        // the combine weights: after the experts, or scaling xᵀ before them
        let (xt, du, weighting) = match output_combine {
            Some(du) => (xt, du, ExpertWeighting::Output),
            None => {
                let scale = self.inner(xt, Mul)?;
                nodes.push(scale);
                let (a, b) = self.pair(scale)?;
                let (du, xt) = if self.inner(a, Unsqueeze).is_some() { (a, b) } else { (b, a) };
                (xt, du, ExpertWeighting::Input)
            }
        };
        let tx = self.inner(xt, Transpose)?;
        if !self.is_swap(tx) {
            return None;
        }
        let x = input0(tx)?;
        nodes.push(tx);
        let (weights, indices, experts) = self.combine_weights(du, &mut nodes)?;
        // operands: x [N, H], weights and indices [N, k], gate_up [E, 2I, H], down [E, H, I]
        let e = experts.len() as i64;
        let known = |v: ValueId| -> Option<Vec<Option<i64>>> { Some(self.dims(v)?.iter().map(|d| d.known()).collect()) };
        let (xd, wd, id_d, gud, dd) = (known(x)?, known(weights)?, known(indices)?, known(gate_up)?, known(down)?);
        let weight = |v: ValueId| self.g.value(v).kind == crate::ir::ValueKind::Initializer && self.dtype(v).is_some_and(|d| d.is_float());
        let fits = xd.len() == 2
            && wd.len() == 2
            && wd == id_d
            && gud.len() == 3
            && dd.len() == 3
            && gud[0] == Some(e)
            && dd[0] == Some(e)
            && gud[2].is_some()
            && gud[2] == xd[1]
            && dd[1] == xd[1]
            && gud[1].zip(dd[2]).is_some_and(|(gu, i)| gu == 2 * i)
            && self.dtype(indices) == Some(DType::I64)
            && self.dtype(weights).is_some_and(|d| d.is_float())
            && weight(gate_up)
            && weight(down);
        if !fits {
            return None;
        }
        let mut inputs = vec![x, weights, indices, gate_up, down];
        if let (Some(gb), Some(db)) = (gate_up_bias, down_bias) {
            // gate_up_bias [E, 2I], down_bias [E, H]
            let (gbd, dbd) = (known(gb)?, known(db)?);
            if gbd != [Some(e), gud[1]] || dbd != [Some(e), xd[1]] || !weight(gb) || !weight(db) {
                return None;
            }
            inputs.extend([gb, db]);
        }
        nodes.sort();
        let biases = inputs.len() == 7;
        Some(ExpertsMatch { inputs, experts: experts.len(), activation, weighting, biases, nodes })
    }

    /// `v` = Add(m, Unsqueeze(bias, 2)) in either order, read only by the chain, `m` made by a
    /// MatMul and `bias` of rank 2: (the Add, the Unsqueeze, m, bias).
    fn bias_add(&self, v: ValueId) -> Option<(NodeId, NodeId, ValueId, ValueId)> {
        let add = self.inner(v, OpKind::Add)?;
        let (a, b) = self.pair(add)?;
        [(a, b), (b, a)].into_iter().find_map(|(m, u)| {
            self.inner(m, OpKind::MatMul)?;
            let unsq = self.inner(u, OpKind::Unsqueeze)?;
            Some((add, unsq, m, self.unsqueezed_last(unsq)?))
        })
    }

    /// `a` and `b`, in either order, = Mul(g, Sigmoid(Mul(g, α))) and Add(u, 1), each read only
    /// by the chain (gpt-oss's gate before its clamps): (their four nodes, g, u, α).
    fn swish_gate(&self, a: ValueId, b: ValueId) -> Option<(Vec<NodeId>, ValueId, ValueId, f64)> {
        use OpKind::*;
        [(a, b), (b, a)].into_iter().find_map(|(s, p)| {
            let add = self.inner(p, Add)?;
            let u = self.with_const(add, 1.0)?;
            let m = self.inner(s, Mul)?;
            let (x, y) = self.pair(m)?;
            [(x, y), (y, x)].into_iter().find_map(|(g, sv)| {
                let sig = self.inner(sv, Sigmoid)?;
                let scale = self.inner(self.g.node(sig).inputs.first().copied().flatten()?, Mul)?;
                let (other, alpha, _) = self.scalar_operand(scale)?;
                (other == g && alpha > 0.0 && alpha.is_finite()).then(|| (vec![add, m, sig, scale], g, u, alpha))
            })
        })
    }

    /// `v` = ReduceSum over `axis` alone, not kept, read only by the chain: (the node, its input).
    fn reduce_sum(&self, v: ValueId, axis: usize) -> Option<(NodeId, ValueId)> {
        let r = self.inner(v, OpKind::ReduceSum)?;
        let x = self.g.node(r).inputs.first().copied().flatten()?;
        let rank = self.dims(x)?.len();
        (self.axes_of(r, rank)? == [axis] && self.g.node(r).attrs.int("keepdims", 1) == 0).then_some((r, x))
    }

    /// `du` = Unsqueeze(Transpose(dense), 1) with `dense [N, E]` = ReduceSum(Mul(Cast(Equal(
    /// Unsqueeze(indices, -1), 0..E)), Unsqueeze(weights, -1)), 1): (weights, indices, the
    /// expert ids), the nodes added to `nodes`.
    fn combine_weights(&self, du: ValueId, nodes: &mut Vec<NodeId>) -> Option<(ValueId, ValueId, Vec<f64>)> {
        use OpKind::*;
        let input0 = |n: NodeId| self.g.node(n).inputs.first().copied().flatten();
        let unsq = self.inner(du, Unsqueeze)?;
        let dt = input0(unsq)?;
        if self.axes_of(unsq, 3)? != [1] {
            return None;
        }
        let tr = self.inner(dt, Transpose)?;
        if !self.is_swap(tr) {
            return None;
        }
        let (dense, prod) = self.reduce_sum(input0(tr)?, 1)?;
        let m2 = self.inner(prod, Mul)?;
        let (p, q) = self.pair(m2)?;
        // the one-hot of the indices may have other readers (blocks routing by the same
        // indices share it once exported): `apply` keeps it for them
        let (hot, wu) = if self.made_by(p, Cast).is_some() { (p, q) } else { (q, p) };
        let cast = self.made_by(hot, Cast)?;
        let eq = self.made_by(input0(cast)?, Equal)?;
        let (e1, e2) = self.pair(eq)?;
        let (unsqueezed, ids) = if self.made_by(e1, Unsqueeze).is_some() { (e1, e2) } else { (e2, e1) };
        let iu = self.made_by(unsqueezed, Unsqueeze)?;
        let wun = self.inner(wu, Unsqueeze)?;
        let (indices, weights) = (self.unsqueezed_last(iu)?, self.unsqueezed_last(wun)?);
        nodes.extend([unsq, tr, dense, m2, wun]);
        // a one-hot other nodes read too stays where it is (`apply` reads it there)
        if [hot, input0(cast)?, unsqueezed].iter().all(|v| self.uses[v.index()] == 1) {
            nodes.extend([cast, eq, iu]);
        }
        let float_to = DType::from_onnx(self.g.node(cast).attrs.int("to", 0) as i32);
        let experts = self.scalar_list(ids)?;
        if !float_to.is_some_and(|d| d.is_float()) || experts.iter().enumerate().any(|(i, &e)| e != i as f64) {
            return None;
        }
        Some((weights, indices, experts))
    }

    /// `v` = Clip(x, lo, hi) read by the chain alone, `reads` times, with a positive constant
    /// `hi` and `lo` absent (`upper_only`) or −`hi`: (the Clip, x, hi).
    fn clip(&self, v: ValueId, reads: usize, upper_only: bool) -> Option<(NodeId, ValueId, f64)> {
        let p = self.g.value(v).producer?;
        let n = self.g.node(p);
        if !n.op.is(OpKind::Clip) || n.outputs.len() != 1 || self.uses[v.index()] != reads {
            return None;
        }
        let x = n.inputs.first().copied().flatten()?;
        let hi = self.scalar(n.inputs.get(2).copied().flatten()?)?;
        if hi <= 0.0 || !hi.is_finite() {
            return None;
        }
        match (n.inputs.get(1).copied().flatten(), upper_only) {
            (None, true) => Some((p, x, hi)),
            (Some(lo), false) if self.scalar(lo).is_some_and(|l| l.to_bits() == (-hi).to_bits()) => Some((p, x, hi)),
            _ => None,
        }
    }

    /// `v` = Mul(g, Sigmoid(g)) in either order, read only by the chain: (the Mul, the Sigmoid, g).
    fn silu(&self, v: ValueId) -> Option<(NodeId, NodeId, ValueId)> {
        let m = self.inner(v, OpKind::Mul)?;
        let (a, b) = self.pair(m)?;
        for (g, s) in [(a, b), (b, a)] {
            if let Some(sig) = self.inner(s, OpKind::Sigmoid)
                && self.g.node(sig).inputs.first().copied().flatten() == Some(g)
            {
                return Some((m, sig, g));
            }
        }
        None
    }

    /// The values of a constant (initializer or folded) as f64.
    fn scalar_list(&self, v: ValueId) -> Option<Vec<f64>> {
        constant_f64s(self.g, v)
    }

    /// Whether Dropout `d` passes its input through in training too, as the runner runs it:
    /// with no `training_mode`, a constant false one, or a constant ratio 0.
    fn dropout_inactive(&self, d: NodeId) -> bool {
        let ins = &self.g.node(d).inputs;
        let konst = |i: usize| ins.get(i).copied().flatten().map(|v| self.scalar(v));
        match konst(2) {
            None => true,
            Some(Some(t)) => t == 0.0 || konst(1) == Some(Some(0.0)),
            Some(None) => false,
        }
    }

    /// `id` = Mul(w, x·(mean(x², -1) + ε)^-½) as the module docs list it, in any operand order:
    /// (x, w, ε, the chain's nodes ascending).
    fn rms_norm(&self, id: NodeId) -> Option<(ValueId, ValueId, f64, Vec<NodeId>)> {
        use OpKind::*;
        let (a, b) = self.pair(id)?;
        for (w, normed) in [(a, b), (b, a)] {
            // mixed precision: the norm in f32 between a Cast up and a Cast back
            let cast_back = self.inner(normed, Cast);
            let normed = match cast_back {
                Some(c) => self.g.node(c).inputs.first().copied().flatten()?,
                None => normed,
            };
            let Some(n) = self.inner(normed, Mul).or_else(|| self.inner(normed, Div)) else { continue };
            let Some((x, mut nodes, eps)) = self.rms_normed(n) else { continue };
            let x = match cast_back {
                Some(back) => {
                    let Some((x0, up)) = self.cast_up(x, &nodes) else { continue };
                    let to = DType::from_onnx(self.g.node(back).attrs.int("to", 0) as i32);
                    if to.is_none() || to != self.dtype(x0) {
                        continue;
                    }
                    nodes.extend([back, up]);
                    x0
                }
                None => x,
            };
            // a weight as long as x's last axis, broadcast over the rest
            let (wd, xd) = (self.dims(w)?, self.dims(x)?);
            let float = |v: ValueId| self.dtype(v).is_some_and(|d| d.is_float());
            if wd.len() != 1 || xd.last() != wd.first() || wd[0].known().is_none() || !float(w) || self.dtype(w) != self.dtype(x) {
                continue;
            }
            nodes.push(id);
            nodes.sort();
            return Some((x, w, eps, nodes));
        }
        None
    }

    /// `id` = Mul(normed, γ) where `normed` is RMSNorm's normalisation ([`Matcher::rms_norm`]) of
    /// `d` = Sub(x, ReduceMean(x, [-1], keepdims 1)), the centred input: a layer norm's scaling,
    /// (x, γ, ε, the nodes ascending).
    fn layer_normed(&self, id: NodeId) -> Option<(ValueId, ValueId, f64, Vec<NodeId>)> {
        use OpKind::*;
        let (d, gamma, eps, mut nodes) = self.rms_norm(id)?;
        // `d` is read by the square and the normalisation, nothing else
        let reads: usize = nodes.iter().map(|&n| self.g.node(n).inputs.iter().flatten().filter(|&&v| v == d).count()).sum();
        let sub = self.made_by(d, Sub).filter(|_| self.uses[d.index()] == reads)?;
        let (x, m) = self.pair(sub)?;
        let mean = self.inner(m, ReduceMean)?;
        let rank = self.dims(x)?.len();
        let last_kept = self.axes_of(mean, rank)? == [rank - 1] && self.g.node(mean).attrs.int("keepdims", 1) == 1;
        if !last_kept || self.g.node(mean).inputs.first().copied().flatten() != Some(x) || self.dtype(x) != self.dtype(gamma) {
            return None;
        }
        nodes.extend([sub, mean]);
        nodes.sort();
        Some((x, gamma, eps, nodes))
    }

    /// A written-out layer norm ending at `id`: Add(scaling, β) with a 1-D β as long as the last
    /// axis, or the scaling itself ([`Matcher::layer_normed`]) when no such add reads it alone.
    fn layer_norm(&self, id: NodeId) -> Option<LayerNormMatch> {
        let node = self.g.node(id);
        if node.op.is(OpKind::Mul) {
            let (x, gamma, epsilon, nodes) = self.layer_normed(id)?;
            let out = node.outputs.first().copied()?;
            let bias_next = self.uses[out.index()] == 1
                && self.g.node_ids().any(|n| self.g.node(n).op.is(OpKind::Add) && self.g.node(n).inputs.contains(&Some(out)) && self.bias_of(n, out).is_some());
            return (!bias_next).then_some(LayerNormMatch { inputs: vec![x, gamma], epsilon, nodes });
        }
        let (a, b) = self.pair(id)?;
        for scaled in [a, b] {
            let Some(beta) = self.bias_of(id, scaled) else { continue };
            let Some(mul) = self.inner(scaled, OpKind::Mul) else { continue };
            let Some((x, gamma, epsilon, mut nodes)) = self.layer_normed(mul) else { continue };
            if self.dtype(beta) != self.dtype(x) {
                continue;
            }
            nodes.push(id);
            nodes.sort();
            return Some(LayerNormMatch { inputs: vec![x, gamma, beta], epsilon, nodes });
        }
        None
    }

    /// For Add node `add` reading `scaled`: its other operand when that is 1-D, float and as long
    /// as `scaled`'s last axis (a bias).
    fn bias_of(&self, add: NodeId, scaled: ValueId) -> Option<ValueId> {
        let (a, b) = self.pair(add)?;
        let beta = if a == scaled { b } else if b == scaled { a } else { return None };
        let (bd, sd) = (self.dims(beta)?, self.dims(scaled)?);
        let float = self.dtype(beta).is_some_and(|d| d.is_float());
        (bd.len() == 1 && bd[0].known().is_some() && sd.last() == bd.first() && float).then_some(beta)
    }

    /// `x` = Cast(x0) to a float type, read only by `nodes`: (x0, the Cast).
    fn cast_up(&self, x: ValueId, nodes: &[NodeId]) -> Option<(ValueId, NodeId)> {
        let up = self.g.value(x).producer.filter(|&p| self.g.node(p).op.is(OpKind::Cast))?;
        let x0 = self.g.node(up).inputs.first().copied().flatten()?;
        let reads: usize = nodes.iter().map(|&n| self.g.node(n).inputs.iter().flatten().filter(|&&v| v == x).count()).sum();
        let float = |v: ValueId| self.dtype(v).is_some_and(|d| d.is_float());
        (reads == self.uses[x.index()] && float(x) && float(x0)).then_some((x0, up))
    }

    /// `n` = Mul(x, Reciprocal(Sqrt(·))), Mul(x, Div(1, Sqrt(·))) or Div(x, Sqrt(·)), the root of
    /// `mean(x², -1) + ε`: (x, the nodes, ε).
    fn rms_normed(&self, n: NodeId) -> Option<(ValueId, Vec<NodeId>, f64)> {
        use OpKind::*;
        let (a, b) = self.pair(n)?;
        let mut nodes = vec![n];
        if self.g.node(n).op.is(Div) {
            let sq = self.inner(b, Sqrt)?;
            let (x, rest, eps) = self.mean_square(sq)?;
            nodes.extend(rest);
            return (x == a).then_some((a, nodes, eps));
        }
        for (x, r) in [(a, b), (b, a)] {
            let inv = self.inner(r, Reciprocal).map(|i| (i, self.g.node(i).inputs.first().copied().flatten())).or_else(|| {
                let d = self.inner(r, Div)?;
                let (one, s) = self.pair(d)?;
                self.is_const(one, 1.0).then_some((d, Some(s)))
            });
            let Some((inv, Some(s))) = inv else { continue };
            let Some(sq) = self.inner(s, Sqrt) else { continue };
            let Some((x2, rest, eps)) = self.mean_square(sq) else { continue };
            if x2 != x {
                continue;
            }
            nodes.push(inv);
            nodes.extend(rest);
            return Some((x, nodes, eps));
        }
        None
    }

    /// `sq` = Sqrt(Add(ReduceMean(Pow(x, 2) | Mul(x, x), [-1], keepdims 1), ε)): (x, the nodes
    /// from the Sqrt down, ε).
    fn mean_square(&self, sq: NodeId) -> Option<(ValueId, Vec<NodeId>, f64)> {
        use OpKind::*;
        let add = self.inner(self.g.node(sq).inputs.first().copied().flatten()?, Add)?;
        let (p, q) = self.pair(add)?;
        let (m, eps) = match (self.scalar(q), self.scalar(p)) {
            (Some(e), _) => (p, e),
            (None, Some(e)) => (q, e),
            _ => return None,
        };
        let mean = self.inner(m, ReduceMean)?;
        let squared = self.g.node(mean).inputs.first().copied().flatten()?;
        let rank = self.dims(squared)?.len();
        let last_kept = self.axes_of(mean, rank)? == [rank - 1] && self.g.node(mean).attrs.int("keepdims", 1) == 1;
        if !last_kept || !(eps > 0.0 && eps.is_finite()) {
            return None;
        }
        let x = if let Some(pw) = self.inner(squared, Pow) {
            let (base, exp) = self.pair(pw)?;
            self.is_const(exp, 2.0).then_some((base, pw))
        } else {
            let mm = self.inner(squared, Mul)?;
            let (l, r) = self.pair(mm)?;
            (l == r).then_some((l, mm))
        };
        let (x, square) = x?;
        self.dtype(x).is_some_and(|d| d.is_float()).then_some((x, vec![sq, add, mean, square], eps))
    }

    /// `id` = Mul(Mul(g, Sigmoid(g)), u) in any operand order, g and u of one float type:
    /// (g, u, the chain's nodes ascending).
    fn swiglu(&self, id: NodeId) -> Option<(ValueId, ValueId, Vec<NodeId>)> {
        let (a, b) = self.pair(id)?;
        for (act, up) in [(a, b), (b, a)] {
            let Some((m, sig, gate)) = self.silu(act) else { continue };
            let ty = self.dtype(gate);
            if gate == up || !ty.is_some_and(|d| d.is_float()) || self.dtype(up) != ty {
                continue;
            }
            let mut nodes = vec![id, m, sig];
            nodes.sort();
            return Some((gate, up, nodes));
        }
        None
    }

    /// `id` = Add(Mul(x, cos), Mul(rot(x), sin)) as the module docs list it, in any operand
    /// order, or the complex product ending in the `Reshape` `id`.
    fn rotary(&self, id: NodeId) -> Option<RotaryMatch> {
        use OpKind::*;
        if self.g.node(id).op.is(Reshape) {
            return self.complex_rotary(id);
        }
        let (a, b) = self.pair(id)?;
        let out = self.g.node(id).outputs.first().copied()?;
        for (plain, rotated) in [(a, b), (b, a)] {
            let (Some(by_cos), Some(by_sin)) = (self.inner(plain, Mul), self.inner(rotated, Mul)) else { continue };
            let (p, q) = self.pair(by_sin)?;
            for (r, sin) in [(p, q), (q, p)] {
                let Some((x, interleaved, rot_nodes)) = self.rotation(r) else { continue };
                let (u, v) = self.pair(by_cos)?;
                let cos = if u == x { v } else if v == x { u } else { continue };
                if cos == x || sin == x || !self.broadcasts_to(cos, x) || !self.broadcasts_to(sin, x) || self.dims(out) != self.dims(x) {
                    continue;
                }
                let ty = self.dtype(x);
                if !ty.is_some_and(|d| d.is_float()) || self.dtype(cos) != ty || self.dtype(sin) != ty {
                    continue;
                }
                let mut nodes = vec![id, by_cos, by_sin];
                nodes.extend(rot_nodes);
                nodes.sort();
                return Some(RotaryMatch { inputs: [x, cos, sin], interleaved, nodes });
            }
        }
        None
    }

    /// Whether `t` broadcasts to `x`'s shape without growing it: no more axes, each (aligned
    /// from the right) 1 or `x`'s.
    fn broadcasts_to(&self, t: ValueId, x: ValueId) -> bool {
        let (Some(td), Some(xd)) = (self.dims(t), self.dims(x)) else { return false };
        td.len() <= xd.len() && td.iter().rev().zip(xd.iter().rev()).all(|(a, b)| a == b || a.known() == Some(1))
    }

    /// `id` = the complex product `view_as_real(view_as_complex(x) · (cos + i·sin))` flattened
    /// back to `x`'s shape, in real arithmetic (the module docs' third form): the pairwise
    /// rotation with tables of one angle per pair.
    fn complex_rotary(&self, id: NodeId) -> Option<RotaryMatch> {
        use OpKind::*;
        let out = self.g.node(id).outputs.first().copied()?;
        let stacked = self.g.node(id).inputs.first().copied().flatten()?;
        let cat = self.inner(stacked, Concat)?;
        let [Some(u_re), Some(u_im)] = self.g.node(cat).inputs[..] else { return None };
        let (un_re, un_im) = (self.inner(u_re, Unsqueeze)?, self.inner(u_im, Unsqueeze)?);
        let re = self.g.node(un_re).inputs.first().copied().flatten()?;
        let im = self.g.node(un_im).inputs.first().copied().flatten()?;
        // re = a·c − b·s
        let sub = self.inner(re, Sub)?;
        let (ac, bs) = self.pair(sub)?;
        let (m_ac, m_bs) = (self.inner(ac, Mul)?, self.inner(bs, Mul)?);
        let (parts, gathers, x, reshape) = self.complex_parts(m_ac, m_bs)?;
        let [(a, c), (b, s)] = parts;
        // im = a·s + b·c, in any order
        let add = self.inner(im, Add)?;
        let (p, q) = self.pair(add)?;
        let (m_p, m_q) = (self.inner(p, Mul)?, self.inner(q, Mul)?);
        let is = |m: NodeId, u: ValueId, v: ValueId| self.pair(m).is_some_and(|(l, r)| (l, r) == (u, v) || (l, r) == (v, u));
        let im_ok = (is(m_p, a, s) && is(m_q, b, c)) || (is(m_p, b, c) && is(m_q, a, s));
        let rank = self.dims(a)?.len();
        let last_new = |n: NodeId| self.axes_of(n, rank + 1).is_some_and(|ax| ax == [rank]);
        let axis = self.g.node(cat).attrs.int("axis", 0);
        let ty = self.dtype(x);
        let tables_ok = [c, s].iter().all(|&t| t != x && t != a && t != b && self.broadcasts_to(t, a) && self.dtype(t) == ty);
        let ok = im_ok
            && c != s
            && tables_ok
            && ty.is_some_and(|d| d.is_float())
            && last_new(un_re)
            && last_new(un_im)
            && (axis == -1 || axis == rank as i64)
            && self.dims(out) == self.dims(x);
        if !ok {
            return None;
        }
        let mut nodes = vec![id, cat, un_re, un_im, sub, add, m_ac, m_bs, m_p, m_q, gathers[0], gathers[1], reshape];
        nodes.sort();
        Some(RotaryMatch { inputs: [x, c, s], interleaved: true, nodes })
    }

    /// For the products `a·c` and `b·s` of a complex rotary (any operand order), where `a` and
    /// `b` are the real and imaginary parts of `x` taken pairwise (`Gather` 0 and 1 on the last
    /// axis of `Reshape(x, [.., d/2, 2])`, each read by two products, the reshape by the two
    /// gathers only): ([(a, c), (b, s)], the gathers, x, the reshape).
    #[allow(clippy::type_complexity)]
    fn complex_parts(&self, m_ac: NodeId, m_bs: NodeId) -> Option<([(ValueId, ValueId); 2], [NodeId; 2], ValueId, NodeId)> {
        let part = |m: NodeId, index: i64| -> Option<(ValueId, ValueId, NodeId)> {
            let (l, r) = self.pair(m)?;
            [(l, r), (r, l)].into_iter().find_map(|(p, t)| {
                let g = self.made_by(p, OpKind::Gather)?;
                let idx = self.g.node(g).inputs.get(1).copied().flatten()?;
                let scalar = self.g.value(idx).data.as_ref().is_some_and(|d| d.dims.is_empty());
                (self.uses[p.index()] == 2 && scalar && self.const_ints(g, 1)? == [index]).then_some((p, t, g))
            })
        };
        let (a, c, ga) = part(m_ac, 0)?;
        let (b, s, gb) = part(m_bs, 1)?;
        let v = self.g.node(ga).inputs.first().copied().flatten()?;
        if self.g.node(gb).inputs.first().copied().flatten()? != v || self.uses[v.index()] != 2 {
            return None;
        }
        let reshape = self.made_by(v, OpKind::Reshape)?;
        let x = self.g.node(reshape).inputs.first().copied().flatten()?;
        let (xd, vd, ad) = (self.dims(x)?, self.dims(v)?, self.dims(a)?);
        let d = self.last_dim(x)?;
        let rank = xd.len();
        let axis_last = |g: NodeId| {
            let ax = self.g.node(g).attrs.int("axis", 0);
            ax == -1 || ax == rank as i64
        };
        let pairs = vd.len() == rank + 1
            && vd[..rank - 1] == xd[..rank - 1]
            && vd[rank - 1].known() == Some(d / 2)
            && vd[rank].known() == Some(2)
            && ad == &vd[..rank]
            && self.dims(b) == Some(ad);
        (pairs && axis_last(ga) && axis_last(gb)).then_some(([(a, c), (b, s)], [ga, gb], x, reshape))
    }

    /// `r` = rot(x) in one of the module docs' two forms: (x, whether pairwise, its nodes).
    fn rotation(&self, r: ValueId) -> Option<(ValueId, bool, Vec<NodeId>)> {
        use OpKind::*;
        if let Some(cat) = self.inner(r, Concat) {
            // the half rotation: [−x[d/2:], x[:d/2]]
            let [Some(neg_out), Some(first)] = self.g.node(cat).inputs[..] else { return None };
            let neg = self.inner(neg_out, Neg)?;
            let second = self.g.node(neg).inputs.first().copied().flatten()?;
            let axis = self.g.node(cat).attrs.int("axis", 0);
            if let Some((split, x)) = self.halves_split(first, second) {
                // the same rotation cut by one Split into halves (`torch.chunk(x, 2, -1)`)
                let rank = self.dims(x)?.len() as i64;
                return (axis == -1 || axis == rank - 1).then(|| (x, false, vec![cat, neg, split]));
            }
            let (s2, (x, start2, end2, step2)) = self.slice_of(second)?;
            let (s1, (x1, start1, end1, step1)) = self.slice_of(first)?;
            let d = self.last_dim(x)?;
            let rank = self.dims(x)?.len() as i64;
            let halves = (start1, end1, step1, start2, end2, step2) == (0, d / 2, 1, d / 2, d, 1);
            return (x1 == x && halves && (axis == -1 || axis == rank - 1)).then(|| (x, false, vec![cat, neg, s1, s2]));
        }
        // the pairwise rotation: [−x₁, x₀, −x₃, x₂, …] as pairs stacked on a new last axis, flattened
        let reshape = self.inner(r, Reshape)?;
        // (its target may be computed from the input's shape: the output's dims are checked)
        let stacked = self.g.node(reshape).inputs.first().copied().flatten()?;
        let cat = self.inner(stacked, Concat)?;
        let [Some(u1), Some(u2)] = self.g.node(cat).inputs[..] else { return None };
        let (un1, un2) = (self.inner(u1, Unsqueeze)?, self.inner(u2, Unsqueeze)?);
        let neg = self.inner(self.g.node(un1).inputs.first().copied().flatten()?, Neg)?;
        let (odd, (x, start1, end1, step1)) = self.slice_of(self.g.node(neg).inputs.first().copied().flatten()?)?;
        let (even, (x0, start0, end0, step0)) = self.slice_of(self.g.node(un2).inputs.first().copied().flatten()?)?;
        let d = self.last_dim(x)?;
        let rank = self.dims(x)?.len();
        let axis = self.g.node(cat).attrs.int("axis", 0);
        let last_new = |n: NodeId| self.axes_of(n, rank + 1).is_some_and(|a| a == [rank]);
        let pairs = (start0, end0, step0, start1, end1, step1) == (0, d, 2, 1, d, 2);
        let ok = x0 == x
            && pairs
            && (axis == -1 || axis == rank as i64)
            && last_new(un1)
            && last_new(un2)
            && self.dims(r) == self.dims(x);
        ok.then(|| (x, true, vec![reshape, cat, un1, un2, neg, odd, even]))
    }

    /// `first` and `second` = the two outputs, in order, of one `Split` cutting some `x` into
    /// equal halves along its last axis, each read only by the chain: (the Split, x).
    fn halves_split(&self, first: ValueId, second: ValueId) -> Option<(NodeId, ValueId)> {
        let s = self.g.value(first).producer?;
        let node = self.g.node(s);
        if !node.op.is(OpKind::Split) || node.outputs != [first, second] || self.g.value(second).producer != Some(s) {
            return None;
        }
        if self.uses[first.index()] != 1 || self.uses[second.index()] != 1 {
            return None;
        }
        let x = node.inputs.first().copied().flatten()?;
        let d = self.last_dim(x)?;
        let rank = self.dims(x)?.len() as i64;
        let axis = node.attrs.int("axis", 0);
        let sizes_ok = match node.inputs.get(1).copied().flatten() {
            Some(_) => self.const_ints(s, 1)? == [d / 2, d / 2],
            // before opset 13 the sizes are an attribute; without them the outputs are equal
            None => node.attrs.ints("split").is_none_or(|v| v == [d / 2, d / 2]),
        };
        ((axis == -1 || axis == rank - 1) && sizes_ok).then_some((s, x))
    }

    /// The known, even last axis of `x`.
    fn last_dim(&self, x: ValueId) -> Option<i64> {
        let d = self.dims(x)?.last()?.known()?;
        (d >= 2 && d % 2 == 0).then_some(d)
    }

    /// `v` = Slice(x) along x's last axis only, read only by the chain: (the Slice, (x, start,
    /// end, step)) with start and end clamped to `0..=d` and a positive step.
    fn slice_of(&self, v: ValueId) -> Option<(NodeId, (ValueId, i64, i64, i64))> {
        let s = self.inner(v, OpKind::Slice)?;
        let x = self.g.node(s).inputs.first().copied().flatten()?;
        let rank = self.dims(x)?.len();
        let d = self.dims(x)?.last()?.known()?;
        let one = |i: usize| -> Option<i64> {
            match self.const_ints(s, i)?.as_slice() {
                [c] => Some(*c),
                _ => None,
            }
        };
        let (start, end) = (one(1)?, one(2)?);
        let axes_ok = match self.g.node(s).inputs.get(3).copied().flatten() {
            Some(_) => self.axes_of_at(s, 3, rank)? == [rank - 1],
            None => rank == 1,
        };
        let step = match self.g.node(s).inputs.get(4).copied().flatten() {
            Some(_) => one(4)?,
            None => 1,
        };
        let clamp = |c: i64| if c < 0 { (c.saturating_add(d)).max(0) } else { c.min(d) };
        (axes_ok && step > 0).then_some((s, (x, clamp(start), clamp(end), step)))
    }

    /// The axes of input `i` of `n`, normalised against `rank`.
    fn axes_of_at(&self, n: NodeId, i: usize, rank: usize) -> Option<Vec<usize>> {
        self.const_ints(n, i)?
            .iter()
            .map(|&a| {
                let v = if a < 0 { a + rank as i64 } else { a };
                (0..rank as i64).contains(&v).then_some(v as usize)
            })
            .collect()
    }

    /// `id` = Mul(Mul(x, 0.5), Add(1, tanh(...)|erf(...))) in any operand order: (x, tanh form).
    fn gelu(&self, id: NodeId) -> Option<(ValueId, bool)> {
        let (a, b) = self.pair(id)?;
        for (half, one_plus) in [(a, b), (b, a)] {
            let Some(h) = self.inner(half, OpKind::Mul) else { continue };
            let Some(x) = self.with_const(h, 0.5) else { continue };
            let Some(add) = self.inner(one_plus, OpKind::Add) else { continue };
            let Some(f) = self.with_const(add, 1.0) else { continue };
            if let Some(t) = self.inner(f, OpKind::Tanh) {
                if self.tanh_arg(self.g.node(t).inputs.first().copied().flatten()?, x) {
                    return Some((x, true));
                }
            }
            if let Some(e) = self.inner(f, OpKind::Erf) {
                if self.erf_arg(self.g.node(e).inputs.first().copied().flatten()?, x) {
                    return Some((x, false));
                }
            }
        }
        None
    }

    /// `s` = √(2/π)·(x + 0.044715·x³).
    fn tanh_arg(&self, s: ValueId, x: ValueId) -> bool {
        let inner = || -> Option<bool> {
            let m = self.inner(s, OpKind::Mul)?;
            let r = self.with_const(m, SQRT_2_OVER_PI)?;
            let add = self.inner(r, OpKind::Add)?;
            let (p, q) = self.pair(add)?;
            let cube_term = if p == x { q } else if q == x { p } else { return None };
            let mq = self.inner(cube_term, OpKind::Mul)?;
            let cube = self.with_const(mq, 0.044715)?;
            let pw = self.inner(cube, OpKind::Pow)?;
            let (base, exp) = self.pair(pw)?;
            Some(base == x && self.is_const(exp, 3.0))
        };
        inner().unwrap_or(false)
    }

    /// `s` = x/√2 (`Div` by √2 or `Mul` by 1/√2).
    fn erf_arg(&self, s: ValueId, x: ValueId) -> bool {
        if let Some(d) = self.inner(s, OpKind::Div) {
            return self.pair(d).is_some_and(|(a, b)| a == x && self.is_const(b, SQRT_2));
        }
        if let Some(m) = self.inner(s, OpKind::Mul) {
            return self.with_const(m, 1.0 / SQRT_2) == Some(x);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, DType, Node, Op, Shape, Tensor, TensorType, ValueKind};

    fn ty() -> Option<TensorType> {
        Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[4])) })
    }

    struct B {
        g: Graph,
        n: u32,
    }

    impl B {
        fn c(&mut self, v: f32) -> ValueId {
            self.n += 1;
            let t = Tensor::from_f32(vec![], &[v]);
            self.g.add_value(format!("c{}", self.n), ValueKind::Initializer, None, Some(t)).unwrap()
        }
        fn op(&mut self, k: OpKind, ins: &[ValueId]) -> ValueId {
            self.n += 1;
            let out = self.g.add_value(format!("v{}", self.n), ValueKind::Intermediate, ty(), None).unwrap();
            let node = Node {
                name: format!("n{}", self.n),
                op: Op::Known(k),
                attrs: Attrs::default(),
                inputs: ins.iter().map(|&v| Some(v)).collect(),
                outputs: vec![out],
                namespace: None,
                order: self.n,
            };
            self.g.add_node(node).unwrap();
            out
        }
    }

    fn tanh_gelu(b: &mut B, x: ValueId, swap: bool) -> ValueId {
        tanh_gelu_with(b, x, swap, 0.044715)
    }

    /// The tanh chain with `k` in place of 0.044715.
    fn tanh_gelu_with(b: &mut B, x: ValueId, swap: bool, k: f32) -> ValueId {
        let (c05, c3, ck, cs, c1) = (b.c(0.5), b.c(3.0), b.c(k), b.c(SQRT_2_OVER_PI as f32), b.c(1.0));
        let half = b.op(OpKind::Mul, &[x, c05]);
        let p = b.op(OpKind::Pow, &[x, c3]);
        let q = b.op(OpKind::Mul, &[p, ck]);
        let r = b.op(OpKind::Add, &[x, q]);
        let s = b.op(OpKind::Mul, &[r, cs]);
        let t = b.op(OpKind::Tanh, &[s]);
        let u = if swap { b.op(OpKind::Add, &[c1, t]) } else { b.op(OpKind::Add, &[t, c1]) };
        if swap { b.op(OpKind::Mul, &[u, half]) } else { b.op(OpKind::Mul, &[half, u]) }
    }

    fn graph() -> (B, ValueId) {
        let mut b = B { g: Graph::new("t"), n: 0 };
        let x = b.g.add_value("x", ValueKind::Input, ty(), None).unwrap();
        b.g.inputs = vec![x];
        (b, x)
    }

    #[test]
    fn counted_readers_stay_exact_through_a_models_fusions() {
        // each fusion updates the reader counts in place; `fuse_sweep` asserts them equal to a
        // recount after every one (in this crate's tests): attention, rotary, experts and norms
        let mut kinds = HashSet::new();
        for (model, seq_len) in [("mixtral-8x7b.onnx", None), ("qwen3-235b-a22b.onnx", None), ("llama.onnx", Some(64)), ("gpt2.onnx", Some(64)), ("bert.onnx", Some(64))] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(model);
            let graph = crate::frontend::onnx::load_model(&path).expect("a bundled model").graph;
            let lg = super::super::analyze(graph, &super::super::AnalyzeOptions { seq_len, ..Default::default() }).expect("analyse");
            assert!(!lg.fused.is_empty(), "{model}: nothing fused");
            kinds.extend(lg.fused.iter().map(|f| std::mem::discriminant(&f.op)));
        }
        assert!(kinds.len() >= 6, "{} kinds of chain fused", kinds.len());
    }

    #[test]
    fn tanh_and_erf_chains_become_one_gelu_each() {
        let (mut b, x) = graph();
        let y1 = tanh_gelu(&mut b, x, false);
        let y2 = tanh_gelu(&mut b, y1, true);
        let (c05, c1, r2) = (b.c(0.5), b.c(1.0), b.c(SQRT_2 as f32));
        let half = b.op(OpKind::Mul, &[y2, c05]);
        let d = b.op(OpKind::Div, &[y2, r2]);
        let e = b.op(OpKind::Erf, &[d]);
        let u = b.op(OpKind::Add, &[e, c1]);
        let y3 = b.op(OpKind::Mul, &[half, u]);
        b.g.outputs = vec![y3];
        let mut g = b.g;
        let unfused = g.clone();
        let fusions = fuse(&mut g);
        assert_eq!(Fused::of(&fusions), Fused { gelu_tanh: 2, gelu_erf: 1, ..Fused::default() });
        assert_eq!(fusions.iter().map(|f| f.replaces.len()).collect::<Vec<_>>(), [8, 8, 5]);
        g.verify().unwrap();
        // the chains' other nodes are gone
        assert_eq!(crate::passes::dce::remove_dead_nodes(&mut g), 0);
        assert_eq!(g.node_count(), 3);
        // replaying the records on the unfused graph gives the same graph
        let mut replayed = unfused;
        for f in &fusions {
            apply(&mut replayed, f).unwrap();
        }
        assert_eq!(format!("{replayed}"), format!("{g}"));
        let ops: Vec<String> = g.topo_order().unwrap().iter().map(|&n| {
            let node = g.node(n);
            format!("{}{}", node.op, node.attrs.str("approximate").map(|a| format!("({a})")).unwrap_or_default())
        }).collect();
        assert_eq!(ops, ["Gelu(tanh)", "Gelu(tanh)", "Gelu"]);
        // the chain now reads its input directly and makes the same output value
        let last = g.value(y3).producer.unwrap();
        assert_eq!(g.node(last).inputs, vec![Some(y2)]);
    }

    #[test]
    fn wrong_constants_or_shared_interiors_are_left_alone() {
        // 0.04 instead of 0.044715
        let (mut b, x) = graph();
        let y = tanh_gelu_with(&mut b, x, false, 0.04);
        b.g.outputs = vec![y];
        assert!(fuse(&mut b.g).is_empty());

        // the tanh is also a graph output
        let (mut b, x) = graph();
        let y = tanh_gelu(&mut b, x, false);
        let tanh = b.g.value_ids().find(|&v| b.g.value(v).producer.is_some_and(|p| b.g.node(p).op.is(OpKind::Tanh))).unwrap();
        b.g.outputs = vec![y, tanh];
        assert!(fuse(&mut b.g).is_empty());
    }

    #[test]
    fn records_that_do_not_fit_the_graph_are_refused_naming_the_node() {
        let (mut b, x) = graph();
        let y = tanh_gelu(&mut b, x, false);
        b.g.outputs = vec![y];
        let unfused = b.g.clone();
        let mut g = b.g;
        let f = fuse(&mut g).pop().unwrap();
        let node = unfused.node(f.node).name.clone();
        let refused = |f: &Fusion, want: &str| {
            let err = apply(&mut unfused.clone(), f).unwrap_err().to_string();
            assert!(err.contains(&format!("`{node}`")) && err.contains(want), "{err}");
        };
        // another input: the chain reads x, which it neither makes nor holds as a constant
        let other = unfused.value_by_name("c1").unwrap();
        refused(&Fusion { inputs: vec![other], ..f.clone() }, "reads `x`");
        // a node of the chain left out: its output is read by the chain, made outside it
        refused(&Fusion { replaces: f.replaces[1..].to_vec(), ..f.clone() }, "outside it");
        // the other approximation
        refused(&Fusion { op: FusedOp::Gelu { approximate: GeluApproximation::None }, ..f.clone() }, "not Gelu");
        // the record as made applies
        apply(&mut unfused.clone(), &f).unwrap();
    }
}
