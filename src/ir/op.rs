//! Operators and their attributes.

use std::collections::BTreeMap;
use std::fmt;

use super::{CollectiveKind, GroupKind, Tensor};

macro_rules! op_kinds {
    ($($(#[$doc:meta])* $kind:ident),* $(,)?) => {
        /// Every ONNX operator (default domain) the IR knows. Unknown ones become
        /// [`Op::Placeholder`].
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum OpKind { $($(#[$doc])* $kind,)* }

        impl OpKind {
            /// All known kinds, in declaration order.
            pub const ALL: &'static [OpKind] = &[$(OpKind::$kind,)*];

            /// Looks up an ONNX `op_type` of the default domain (never an IR-internal kind,
            /// see [`OpKind::is_onnx`]).
            pub fn from_onnx(op_type: &str) -> Option<OpKind> {
                match op_type { $(stringify!($kind) => Some(OpKind::$kind),)* _ => None }.filter(|k| k.is_onnx())
            }

            /// The ONNX `op_type`.
            pub fn name(self) -> &'static str {
                match self { $(OpKind::$kind => stringify!($kind),)* }
            }
        }
    };
}

op_kinds! {
    // elementwise unary
    Abs, Neg, Exp, Log, Sqrt, Reciprocal, Tanh, Sigmoid, Relu, Erf, Sin, Cos, Floor, Ceil,
    Round, Sign, Not, IsNaN, IsInf, Softplus, LeakyRelu, Elu, Gelu, HardSigmoid, HardSwish,
    Identity, Cast, CastLike, Clip,
    // elementwise binary and variadic
    Add, Sub, Mul, Div, Pow, Mod, Max, Min, Sum, Mean, Equal, Less, LessOrEqual, Greater,
    GreaterOrEqual, And, Or, Xor, Where,
    // contractions
    MatMul, Gemm, Conv,
    // normalisation
    LayerNormalization, BatchNormalization, InstanceNormalization, LRN, RMSNormalization,
    // pooling
    MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool,
    // softmax and reductions
    Softmax, LogSoftmax, ReduceMean, ReduceSum, ReduceMax, ReduceMin, ReduceProd, ArgMax,
    ArgMin, CumSum, TopK,
    // shape and data movement
    Reshape, Transpose, Concat, Split, Slice, Gather, GatherElements, GatherND, Unsqueeze, Squeeze,
    Expand, Shape, Size, ConstantOfShape, Range, Flatten, Tile, Pad, Trilu, ScatterND,
    Constant, Dropout,
    // what the exporters emit beside: norms of reductions, einsum, resampling, scatters by
    // element, one-hot, bit shifts and bitwise logic (masks built from integer flags)
    ReduceL1, ReduceL2, ReduceLogSumExp, ReduceSumSquare, LpNormalization, Einsum, Resize,
    GridSample, ScatterElements, OneHot, BitShift, BitwiseAnd, BitwiseOr, BitwiseXor, BitwiseNot,
    // blocks summed back into an image (`torch.nn.Fold`)
    Col2Im,
    // training losses a model computes itself (a causal LM exported with its labels)
    SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss,
    // IR-internal (made by `passes::fuse`, never read from a model file)
    /// Softmax attention as one kernel (libtorch's `scaled_dot_product_attention`), inputs
    /// `(q, kᵀ, v, mask?)`: `softmax(scale·q·kᵀ (+ mask)) · v`, reading Kᵀ (`[.., d, L]`) as the
    /// score MatMul it replaces read it. Attribute `scale` (a one-element f64 tensor). The mask
    /// is additive when floating point, and a keep-mask (true = attend) when bool.
    ScaledDotProductAttention,
    /// The routed experts of a mixture-of-experts block as one kernel that runs each token
    /// through its top-k experts only, inputs `(x, weights, indices, gate_up, down)`: `x`
    /// `[N, H]` tokens, `weights` `[N, k]` the router's combine weights, `indices` `[N, k]`
    /// (int64) its chosen experts, `gate_up` `[E, 2I, H]` each expert's gate and up projections
    /// stacked (gate rows first), `down` `[E, H, I]`. Output `[N, H]`:
    /// `Σ_j weights[n, j] · down[e]·(silu(gate[e]·x[n]) ⊙ up[e]·x[n])` with `e = indices[n, j]`.
    /// Attribute `experts` (E, an int). The router (logits, softmax, top-k, normalisation) stays
    /// ordinary nodes before it.
    MixtureOfExperts,
    /// The elementwise half of a gated MLP (SwiGLU), inputs `(gate, up)` broadcast together:
    /// `silu(gate) ⊙ up` = `gate·σ(gate)·up`, run as libtorch's `silu` and one multiply.
    SwiGlu,
    /// Rotary position embedding, inputs `(x, cos, sin)` broadcast together (`x` `[.., d]`,
    /// `d` even): `x·cos + rot(x)·sin`, where `rot` is the half rotation `[−x₂, x₁]` of `x`'s
    /// two halves, or with attribute `interleaved` 1 (ONNX's name) the pairwise one
    /// `[−x₁, x₀, −x₃, x₂, …]`. Tables whose last axis is `d/2` hold one angle per pair
    /// (interleaved: each repeated for both members of its pair; half rotation: for both
    /// halves). Mixes along the last axis only.
    ApplyRotary,
}

impl OpKind {
    /// False for the IR-internal kinds that fused op chains become (no ONNX file spells them).
    pub fn is_onnx(self) -> bool {
        !matches!(self, OpKind::ScaledDotProductAttention | OpKind::MixtureOfExperts | OpKind::SwiGlu | OpKind::ApplyRotary)
    }

    /// True for ops whose output is their first input under another shape: the same storage,
    /// where the input is contiguous (freeing one frees the other).
    pub fn aliases_input(self) -> bool {
        use OpKind::*;
        matches!(self, Reshape | Flatten | Squeeze | Unsqueeze | Identity)
    }

    /// True for ops whose runner kernel may return a view of their first input (libtorch's
    /// `reshape` where no copy is needed, `permute`, `slice`, `split`, `expand`): the same
    /// storage.
    pub fn may_view_input(self) -> bool {
        use OpKind::*;
        matches!(self, Reshape | Flatten | Squeeze | Unsqueeze | Identity | Transpose | Slice | Split | Expand)
    }

    /// True for ops that only reinterpret or move data (no arithmetic, nothing saved).
    pub fn is_view(self) -> bool {
        use OpKind::*;
        matches!(
            self,
            Reshape | Transpose | Unsqueeze | Squeeze | Flatten | Identity | Expand | Slice | Split
                | Concat | Gather | Shape | Size | Constant | ConstantOfShape | Dropout
        )
    }

    /// True for ops whose kernel always writes a new tensor that no backward reads back: not
    /// their own (a product's or a sum's gradient needs its inputs, not its output), so once
    /// its one reader is an op that saves nothing, that reader may write over it.
    pub fn output_is_scratch(self) -> bool {
        use OpKind::*;
        matches!(self, MatMul | Gemm | Conv | Add | Sub | Mul)
    }

    /// The operands an op may write its result over (in place) when that operand is scratch
    /// no one reads after it: the sums, whose backward reads neither operand. `Sub` only into
    /// its minuend.
    pub fn in_place_operands(self) -> &'static [usize] {
        match self {
            OpKind::Add => &[0, 1],
            OpKind::Sub => &[0],
            _ => &[],
        }
    }

    /// True for the cheap modules selective recompute rebuilds instead of keeping (Megatron's
    /// `--recompute-modules layernorm mlp_act`): normalisations and activation functions, whose
    /// forward is one pass over their input and draws no random numbers.
    pub fn recomputed_selectively(self) -> bool {
        use OpKind::*;
        matches!(
            self,
            LayerNormalization | RMSNormalization | Gelu | SwiGlu | Relu | Sigmoid | Tanh | Softplus | Elu | LeakyRelu | HardSigmoid | HardSwish
        )
    }

    /// True for fused ops whose selective recompute rebuilds what they make inside them and keep
    /// for the backward, their output kept: a mixture of experts' activation functions
    /// (Megatron's `moe_act`).
    pub fn recomputed_inside(self) -> bool {
        matches!(self, OpKind::MixtureOfExperts)
    }

    /// True for fused ops whose backward keeps a tensor made inside them beside their inputs
    /// (SwiGlu: silu(gate), for the product's gradient), which a recompute that rebuilds their
    /// output frees and rebuilds with it.
    pub fn keeps_inside(self) -> bool {
        matches!(self, OpKind::SwiGlu)
    }

    /// True for ops whose training result for one sample depends on the other samples of its
    /// forward pass: BatchNormalization, which the runner trains on the statistics of the
    /// samples it is given (one microbatch of one replica), as a module in `train()` mode does.
    pub fn mixes_samples(self) -> bool {
        matches!(self, OpKind::BatchNormalization)
    }

    /// True for elementwise ops (one output element per broadcast input element).
    pub fn is_elementwise(self) -> bool {
        use OpKind::*;
        matches!(
            self,
            Abs | Neg | Exp | Log | Sqrt | Reciprocal | Tanh | Sigmoid | Relu | Erf | Sin | Cos
                | Floor | Ceil | Round | Sign | Not | IsNaN | IsInf | Softplus | LeakyRelu | Elu
                | Gelu | HardSigmoid | HardSwish | Cast | CastLike | Clip | Add | Sub | Mul | Div
                | Pow | Mod | Max | Min | Sum | Mean | Equal | Less | LessOrEqual | Greater
                | GreaterOrEqual | And | Or | Xor | Where | BitShift | BitwiseAnd | BitwiseOr
                | BitwiseXor | BitwiseNot | SwiGlu
        )
    }

    /// True for reductions over the `axes` input (the importer moves older opsets' attribute
    /// there).
    pub fn is_reduction(self) -> bool {
        use OpKind::*;
        matches!(self, ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd | ReduceL1 | ReduceL2 | ReduceLogSumExp | ReduceSumSquare)
    }

    /// How a mixed-precision run (`torch.autocast`, CPU op lists) runs this op: the one place
    /// the runner's kernels and the cost model's activation bytes read it from.
    pub fn autocast_class(self) -> AutocastClass {
        use OpKind::*;
        match self {
            // einsum contracts with batched matrix products, which autocast runs in the low type
            MatMul | Gemm | Conv | ScaledDotProductAttention | Einsum => AutocastClass::Low,
            ReduceProd | ReduceL2 | ReduceLogSumExp | ReduceSumSquare | LpNormalization | GridSample | SoftmaxCrossEntropyLoss
            | NegativeLogLikelihoodLoss => AutocastClass::Fp32,
            MixtureOfExperts => AutocastClass::Inside,
            _ => AutocastClass::AsIs,
        }
    }
}

/// How `torch.autocast` (CPU) runs an op in a mixed-precision run ([`OpKind::autocast_class`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AutocastClass {
    /// Matrix products and convolutions: every floating-point input cast to the low type, the
    /// output in it.
    Low,
    /// Ops autocast keeps in fp32 (products of many terms): low-type inputs widened.
    Fp32,
    /// Everything else runs in its inputs' types (elementwise ops promote a mixed pair to fp32).
    AsIs,
    /// The kernel applies autocast to the products inside it (the fused mixture of experts:
    /// expert products in the low type, routing weights and the sum in the input's type).
    Inside,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A node's operator: a known kind, a collective codegen inserted, or a placeholder for one
/// the IR does not know.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// A default-domain operator the IR knows.
    Known(OpKind),
    /// A collective or a conversion between the ranks' parts of a value, over one group
    /// (inserted by codegen; never in a model file).
    Collective {
        /// What it computes.
        kind: CollectiveKind,
        /// Over which group.
        group: GroupKind,
    },
    /// An operator the IR does not know; kept with its declared output types, if any.
    Placeholder {
        /// ONNX `op_type`.
        op_type: String,
        /// ONNX domain (empty for the default domain).
        domain: String,
    },
}

impl Op {
    /// The known kind, if any.
    pub fn kind(&self) -> Option<OpKind> {
        match self {
            Op::Known(k) => Some(*k),
            Op::Collective { .. } | Op::Placeholder { .. } => None,
        }
    }

    /// True if this is `kind`.
    pub fn is(&self, kind: OpKind) -> bool {
        self.kind() == Some(kind)
    }

    /// The collective, if this is one.
    pub fn collective(&self) -> Option<(CollectiveKind, GroupKind)> {
        match self {
            Op::Collective { kind, group } => Some((*kind, *group)),
            _ => None,
        }
    }

    /// The op type as ONNX spells it (a collective's kind name).
    pub fn name(&self) -> &str {
        match self {
            Op::Known(k) => k.name(),
            Op::Collective { kind, .. } => kind.name(),
            Op::Placeholder { op_type, .. } => op_type,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Known(k) => f.write_str(k.name()),
            Op::Collective { kind, group } => write!(f, "{}@{group}", kind.name()),
            Op::Placeholder { op_type, domain } if domain.is_empty() => write!(f, "?{op_type}"),
            Op::Placeholder { op_type, domain } => write!(f, "?{domain}.{op_type}"),
        }
    }
}

/// An IR-internal attribute of `Gather` on axis 0 (`INTS`; set by `passes::params` from the
/// parameter record's `smp.padding_rows`, never read from a model file): rows of the table
/// whose lookups send the table no gradient, as PyTorch's `embedding(..., padding_idx)`. The
/// forward is plain Gather; a tensor-parallel shard holds it in its own row numbers.
pub const PADDING_ROWS: &str = "smp.padding_rows";

/// One attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    /// `INT`
    Int(i64),
    /// `FLOAT`
    Float(f32),
    /// `STRING` (bytes as written; usually UTF-8)
    Str(String),
    /// `INTS`
    Ints(Vec<i64>),
    /// `FLOATS`
    Floats(Vec<f32>),
    /// `STRINGS`
    Strs(Vec<String>),
    /// `TENSOR`
    Tensor(Tensor),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(v) => write!(f, "{v}"),
            Attr::Float(v) => write!(f, "{v}"),
            Attr::Str(v) => write!(f, "{v:?}"),
            Attr::Ints(v) => write!(f, "{v:?}"),
            Attr::Floats(v) => write!(f, "{v:?}"),
            Attr::Strs(v) => write!(f, "{v:?}"),
            Attr::Tensor(t) => write!(f, "tensor<{}{:?}>", t.dtype, t.dims),
        }
    }
}

/// A node's attributes by name, with typed getters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attrs(pub BTreeMap<String, Attr>);

impl Attrs {
    /// The raw attribute.
    pub fn get(&self, name: &str) -> Option<&Attr> {
        self.0.get(name)
    }

    /// An `INT` attribute or `default`.
    pub fn int(&self, name: &str, default: i64) -> i64 {
        match self.0.get(name) {
            Some(Attr::Int(v)) => *v,
            _ => default,
        }
    }

    /// An `INT` attribute if present.
    pub fn int_opt(&self, name: &str) -> Option<i64> {
        match self.0.get(name) {
            Some(Attr::Int(v)) => Some(*v),
            _ => None,
        }
    }

    /// A `FLOAT` attribute or `default`.
    pub fn float(&self, name: &str, default: f32) -> f32 {
        match self.0.get(name) {
            Some(Attr::Float(v)) => *v,
            Some(Attr::Int(v)) => *v as f32,
            _ => default,
        }
    }

    /// A `FLOAT` attribute or `default`, as the decimal its writer meant: ONNX stores f32, so
    /// an exporter's `1e-5` arrives as 9.99999975e-06 and momentum `0.9` as 0.899999976; the
    /// shortest decimal that rounds to the same f32 gives back 1e-5 and 0.9 exactly in f64 (in
    /// f32 arithmetic both readings are the same number). A one-element tensor (what the fusion
    /// pass writes: a fused op's constant exactly as the chain it replaces held it) is read as
    /// it is.
    pub fn real(&self, name: &str, default: f64) -> f64 {
        match self.0.get(name) {
            Some(Attr::Float(v)) => shortest_decimal(*v),
            Some(Attr::Int(v)) => *v as f64,
            Some(Attr::Tensor(t)) => match t.to_f64_vec().as_deref() {
                Some(&[v]) => v,
                _ => default,
            },
            _ => default,
        }
    }

    /// An `INTS` attribute if present.
    pub fn ints(&self, name: &str) -> Option<&[i64]> {
        match self.0.get(name) {
            Some(Attr::Ints(v)) => Some(v),
            _ => None,
        }
    }

    /// A `FLOATS` attribute if present.
    pub fn floats(&self, name: &str) -> Option<&[f32]> {
        match self.0.get(name) {
            Some(Attr::Floats(v)) => Some(v),
            _ => None,
        }
    }

    /// A `STRING` attribute if present.
    pub fn str(&self, name: &str) -> Option<&str> {
        match self.0.get(name) {
            Some(Attr::Str(v)) => Some(v),
            _ => None,
        }
    }

    /// A `TENSOR` attribute if present.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        match self.0.get(name) {
            Some(Attr::Tensor(v)) => Some(v),
            _ => None,
        }
    }

    /// Sets an attribute.
    pub fn set(&mut self, name: &str, value: Attr) {
        self.0.insert(name.to_string(), value);
    }
}

/// The f64 of the shortest decimal that rounds to `v` in f32 (Rust prints f32 that way).
fn shortest_decimal(v: f32) -> f64 {
    format!("{v}").parse().unwrap_or(f64::from(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn attrs(v: f32) -> Attrs {
        let mut a = Attrs::default();
        a.set("epsilon", Attr::Float(v));
        a
    }

    #[test]
    fn real_gives_back_the_decimal_an_exporter_wrote() {
        for (written, want) in [(1e-5f32, 1e-5f64), (0.9, 0.9), (1e-6, 1e-6), (0.1, 0.1), (1.702, 1.702)] {
            assert_eq!(attrs(written).real("epsilon", 0.0), want);
            assert_ne!(f64::from(written), want, "{written} is exact in f32: the test would not see the reading");
        }
        assert_eq!(Attrs::default().real("epsilon", 0.25), 0.25);
    }

    proptest! {
        #[test]
        fn real_rounds_back_to_the_stored_f32(bits in any::<u32>()) {
            let v = f32::from_bits(bits);
            prop_assume!(v.is_finite());
            prop_assert_eq!(attrs(v).real("epsilon", 0.0) as f32, v);
        }
    }
}
