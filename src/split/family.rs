//! Op families: every `OpKind` belongs to exactly one, and each family's file holds everything
//! about how its ops split (tensor-parallel propagation, the token rules of sequence and context
//! parallelism, offers and their prices, emission). The engines dispatch on [`Family`] with no
//! catch-all arm, so a new op is placed by adding it to [`family`] (the add-an-op checklist is
//! in docs/architecture.md).

use crate::ir::{Node, OpKind, ValueId};

/// How an op family splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Elementwise ops (and Identity, Dropout): one output element per broadcast input element
    /// (`elementwise.rs`).
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
        | BitShift | Dropout => F::Elementwise,
        MatMul | Gemm => F::Matmul,
        ScaledDotProductAttention => F::Attention,
        LayerNormalization | Softmax | LogSoftmax | ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd | ArgMax | ArgMin
        | CumSum | TopK | Slice | ReduceL1 | ReduceL2 | ReduceLogSumExp | ReduceSumSquare | LpNormalization => F::Norm,
        Reshape | Transpose | Concat | Split | Unsqueeze | Squeeze | Expand | Flatten => F::View,
        Gather => F::Gather,
        MixtureOfExperts => F::Experts,
        Shape | Size | ConstantOfShape | Range | Constant => F::Shape,
        Conv | BatchNormalization | InstanceNormalization | LRN | MaxPool | AveragePool | GlobalAveragePool | GlobalMaxPool
        | GatherElements | GatherND | Tile | Pad | Trilu | ScatterND | ScatterElements | OneHot | Einsum | Resize | GridSample => F::Whole,
    }
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
