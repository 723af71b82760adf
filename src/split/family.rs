//! Op families: every `OpKind` belongs to exactly one, and each family's file holds everything
//! about how its ops split (tensor-parallel propagation, the token rules of sequence and context
//! parallelism, offers and their prices, emission). The engines dispatch on [`Family`] with no
//! catch-all arm, so a new op is placed by adding it to [`family`] (the add-an-op checklist is
//! in docs/architecture.md).

use std::collections::HashMap;

use crate::ir::{Graph, LayeredGraph, Node, NodeId, OpKind, ValueId};
use crate::passes::shape_infer::{self, ShapeInfo};

/// How an op family splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Elementwise ops (and Identity, Dropout): one output element per broadcast input element
    /// (`elementwise.rs`); and the rotary embedding, which broadcasts alike but mixes along its
    /// last axis, so no split cuts that one.
    Elementwise,
    /// Matmuls and Gemm: a weight operand splits by columns or rows, two activations by heads
    /// (`matmul.rs`).
    Matmul,
    /// The fused attention core (`attention.rs`).
    Attention,
    /// Ops that work along some axes: norms, softmaxes, reductions, scans, top-k and slices;
    /// they run on a part of their input along the other axes (`norm.rs`).
    Norm,
    /// Views that move elements: reshapes, transposes, squeezes, expands, splits, concats
    /// (`view.rs`).
    View,
    /// Embedding lookups (`gather.rs`).
    Gather,
    /// The fused mixture of experts (`experts.rs`).
    Experts,
    /// Ops that make values from shapes or nothing (Shape, Size, Constant, ConstantOfShape,
    /// Range): they read no split data.
    Shape,
    /// Ops with no split rule (convolutions, pooling, batch statistics, index scatters, einsum,
    /// resampling, one-hot): they run
    /// whole on every rank, reading whole inputs.
    Whole,
}

impl Family {
    /// The weight operands a choosing node of this family splits or keeps whole: a matmul's
    /// `B`, a lookup's table, the experts' gate-up and down projections; none for the others.
    pub fn weight_operands(self, node: &Node) -> Vec<ValueId> {
        let input = |i: usize| node.inputs.get(i).copied().flatten();
        match self {
            Family::Matmul => input(1).into_iter().collect(),
            Family::Gather => input(0).into_iter().collect(),
            Family::Experts => [input(3), input(4)].into_iter().flatten().collect(),
            Family::Elementwise | Family::Attention | Family::Norm | Family::View | Family::Shape | Family::Whole => Vec::new(),
        }
    }

    /// Whether this family's nodes choose a strategy of their own (weight matmuls, lookups,
    /// experts): they are placed even when every input is whole.
    pub fn chooses(self) -> bool {
        matches!(self, Family::Matmul | Family::Gather | Family::Experts)
    }
}

/// The family of `kind`.
pub fn family(kind: OpKind) -> Family {
    use Family as F;
    use OpKind::*;
    match kind {
        Abs | Neg | Exp | Log | Sqrt | Reciprocal | Tanh | Sigmoid | Relu | Erf | Sin | Cos | Floor | Ceil | Round | Sign | Not | IsNaN
        | IsInf | Softplus | LeakyRelu | Elu | Gelu | HardSigmoid | HardSwish | Identity | Cast | CastLike | Clip | Add | Sub | Mul
        | Div | Pow | Mod | Max | Min | Sum | Mean | Equal | Less | LessOrEqual | Greater | GreaterOrEqual | And | Or | Xor | Where
        | BitShift | BitwiseAnd | BitwiseOr | BitwiseXor | BitwiseNot | Dropout | SwiGlu
        // broadcast like the rest, but mixing along the last axis (elementwise.rs keeps it whole)
        | ApplyRotary => F::Elementwise,
        MatMul | Gemm => F::Matmul,
        ScaledDotProductAttention => F::Attention,
        LayerNormalization | RMSNormalization | Softmax | LogSoftmax | ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd
        | ArgMax | ArgMin | CumSum | TopK | Slice | ReduceL1 | ReduceL2 | ReduceLogSumExp | ReduceSumSquare | LpNormalization => F::Norm,
        Reshape | Transpose | Concat | Split | Unsqueeze | Squeeze | Expand | Flatten => F::View,
        Gather => F::Gather,
        MixtureOfExperts => F::Experts,
        Shape | Size | ConstantOfShape | Range | Constant => F::Shape,
        Conv | BatchNormalization | InstanceNormalization | LRN | MaxPool | AveragePool | GlobalAveragePool | GlobalMaxPool
        | GatherElements | GatherND | Tile | Pad | Trilu | ScatterND | ScatterElements | OneHot | Einsum | Resize | GridSample | Col2Im
        | SoftmaxCrossEntropyLoss | NegativeLogLikelihoodLoss => F::Whole,
    }
}

/// Whether tensor-parallel propagation has a rule for `kind` reading a split input. Ops
/// without one run whole, and a split never flows into them: the offers' walk
/// ([`super::analyse`]) and the emission (`Prop::node`) both ask this.
pub fn tp_rule(kind: OpKind) -> bool {
    use OpKind::*;
    match family(kind) {
        Family::Matmul | Family::Gather | Family::Attention | Family::Experts | Family::Elementwise => true,
        Family::Norm => matches!(kind, Softmax | LogSoftmax | LayerNormalization | RMSNormalization | ReduceMean | ReduceSum | ReduceMax | CumSum | Slice),
        Family::View => matches!(kind, Reshape | Transpose | Squeeze | Unsqueeze | Split | Concat | Expand),
        Family::Shape | Family::Whole => false,
    }
}

/// Why the split engines cannot see into a node: it runs whole on every rank, reading whole
/// inputs, it chooses no split of its own, and no split flows into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Opaque {
    /// An op the IR does not know (a placeholder).
    UnknownOp(String),
    /// The shape of an input or output is unknown at the planned dims.
    UnknownShape(String),
}

impl std::fmt::Display for Opaque {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Opaque::UnknownOp(op) => write!(f, "the op `{op}` is unknown to the planner"),
            Opaque::UnknownShape(v) => write!(f, "the shape of `{v}` is unknown"),
        }
    }
}

/// Whether (and why) the split engines cannot see into node `id` of `g`, with shapes `info`
/// (inferred at the planned dims) and each value's readers `uses`. The one rule both sides
/// share: the offers ([`super::analyse`]) give such a node no split, and emission keeps it
/// whole.
pub fn opaque(g: &Graph, info: &ShapeInfo, uses: &[Vec<NodeId>], id: NodeId) -> Option<Opaque> {
    let node = g.try_node(id)?;
    if node.op.kind().is_none() {
        return Some(Opaque::UnknownOp(node.op.to_string()));
    }
    let known = |v: ValueId| info.types.get(v.index()).and_then(|t| t.as_ref()).is_some_and(|t| t.shape.is_some());
    let read = node.inputs.iter().flatten();
    // every input, and the outputs something reads
    let made = node.outputs.iter().filter(|&&v| uses.get(v.index()).is_some_and(|u| !u.is_empty()) || g.outputs.contains(&v));
    read.chain(made).find(|&&v| !known(v)).map(|&v| Opaque::UnknownShape(g.value(v).name.clone()))
}

/// Every node of `lg` the split engines cannot see into ([`opaque`]), shapes inferred at the
/// graph's bound dims as the engines infer them.
pub fn opaque_nodes(lg: &LayeredGraph) -> HashMap<NodeId, Opaque> {
    match shape_infer::infer(&lg.graph, &lg.dims.values, false) {
        Ok(info) => opaque_with(&lg.graph, &info),
        // no shapes at all: nothing can be seen into
        Err(_) => lg.graph.node_ids().map(|n| (n, Opaque::UnknownShape(lg.graph.node(n).name.clone()))).collect(),
    }
}

/// [`opaque_nodes`] from shapes already inferred.
pub fn opaque_with(g: &Graph, info: &ShapeInfo) -> HashMap<NodeId, Opaque> {
    let uses = g.uses();
    g.node_ids().filter_map(|n| opaque(g, info, &uses, n).map(|o| (n, o))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_ops_are_the_elementwise_family() {
        for &k in OpKind::ALL {
            if k.is_elementwise() {
                assert_eq!(family(k), Family::Elementwise, "{k}");
            }
        }
    }
}
