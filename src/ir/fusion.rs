//! Fused ops: one node that computes what a chain of nodes computed, as `passes::fuse` rewrote
//! it. Analysis records each rewrite ([`super::LayeredGraph::fused`]), the plan carries the
//! records, and the runner applies exactly them to the graph it executes.

use serde::{Deserialize, Serialize};

use super::{NodeId, ValueId};

/// The op of a fused node (with its attributes). The plan file spells it
/// `{"gelu": {"approximate": "tanh"}}`,
/// `{"attention": {"scale": 0.125, "mask": "additive"}}`,
/// `{"mixture_of_experts": {"experts": 8, "activation": "silu"}}` (with `"weighting": "input"`
/// where the router's weights scale the tokens going in, `"biases": true` where the experts
/// carry biases; a clamped gate's activation is `{"clamped_silu": {"limit": 7.0}}`, gpt-oss's
/// `{"clamped_swish": {"alpha": 1.702, "limit": 7.0}}`),
/// `{"rms_norm": {"epsilon": 1e-6}}`, `"swiglu"` or `{"rotary": {"interleaved": false}}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum FusedOp {
    /// ONNX `Gelu` (opset 20), libtorch's fused `gelu` kernel. One input: the chain's.
    Gelu {
        /// The `approximate` attribute.
        approximate: GeluApproximation,
    },
    /// Softmax attention `softmax(scale·q·kᵀ (+ mask)) · v`, the IR op
    /// [`OpKind::ScaledDotProductAttention`](super::OpKind::ScaledDotProductAttention), run as
    /// libtorch's `scaled_dot_product_attention`. Inputs `q, kᵀ, v` and, with a mask, the mask.
    Attention {
        /// What the scores are multiplied by before the softmax.
        scale: AttentionScale,
        /// How the mask input (the fourth) applies, if there is one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mask: Option<AttentionMask>,
    },
    /// The routed experts of a mixture-of-experts block, the IR op
    /// [`OpKind::MixtureOfExperts`](super::OpKind::MixtureOfExperts): each token through its
    /// top-k experts' gated MLPs, weighted and summed. Inputs `x, weights, indices, gate_up,
    /// down`, then, with `biases`, `gate_up_bias [E, 2I]` and `down_bias [E, H]`.
    MixtureOfExperts {
        /// How many experts the block holds (E).
        experts: usize,
        /// The gate's activation.
        activation: ExpertActivation,
        /// Where the router's weights apply.
        #[serde(default, skip_serializing_if = "ExpertWeighting::is_output")]
        weighting: ExpertWeighting,
        /// Whether each expert adds a bias after its gate-up and its down projection.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        biases: bool,
    },
    /// Root-mean-square norm over the last axis, `x / √(mean(x², -1) + ε) · w`, the ONNX op
    /// `RMSNormalization` (opset 23, `axis` −1), run as libtorch's `rms_norm`. Inputs `x, w`.
    RmsNorm {
        /// What is added to the mean square.
        epsilon: Epsilon,
    },
    /// Layer norm over the last axis as an export without `LayerNormalization` (opsets before
    /// 17) writes it, `(x − mean(x)) / √(mean((x − mean(x))², -1) + ε) · γ (+ β)`, the ONNX op
    /// `LayerNormalization` (`axis` −1), run as libtorch's `native_layer_norm`. Inputs `x, γ`
    /// and `β` when it adds one.
    LayerNorm {
        /// What is added to the variance.
        epsilon: Epsilon,
        /// Whether it adds a bias β after scaling.
        bias: bool,
    },
    /// The elementwise half of a gated MLP, `silu(gate) ⊙ up`, the IR op
    /// [`OpKind::SwiGlu`](super::OpKind::SwiGlu). Inputs `gate, up`.
    #[serde(rename = "swiglu")]
    SwiGlu,
    /// Rotary position embedding `x·cos + rot(x)·sin`, the IR op
    /// [`OpKind::ApplyRotary`](super::OpKind::ApplyRotary). Inputs `x, cos, sin`.
    Rotary {
        /// Whether `rot` turns pairs of neighbours (GPT-J's `rotate_every_two`) rather than the
        /// two halves of the last axis (Llama's `rotate_half`).
        interleaved: bool,
    },
}

/// A newtype over an f64 attribute of a fused op, compared and hashed by its bits (the plan file
/// writes the number).
macro_rules! exact_f64 {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub f64);

        impl PartialEq for $name {
            fn eq(&self, o: &Self) -> bool {
                self.0.to_bits() == o.0.to_bits()
            }
        }

        impl Eq for $name {}

        impl std::hash::Hash for $name {
            fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
                self.0.to_bits().hash(h);
            }
        }
    };
}

exact_f64!(
    /// A norm's ε.
    Epsilon
);

exact_f64!(
    /// An attention scale.
    AttentionScale
);

exact_f64!(
    /// The bound of a clamped expert gate: the gate is clamped to at most it, the up projection
    /// to ±it.
    ClampLimit
);

exact_f64!(
    /// The factor α inside a swish gate's sigmoid, `g·σ(α·g)`.
    SwishScale
);

/// The activation of an expert's gate (`act(gate·x) ⊙ up·x`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertActivation {
    /// `silu(g) ⊙ u` (SwiGLU experts: Mixtral, Qwen-MoE, DeepSeek-V3, OLMoE).
    Silu,
    /// `silu(min(g, limit)) ⊙ clip(u, −limit, limit)` (DeepSeek-V4, GLM-5: a SwiGLU whose
    /// projections are clamped).
    ClampedSilu {
        /// The clamp's bound.
        limit: ClampLimit,
    },
    /// `min(g, limit)·σ(alpha·min(g, limit)) ⊙ (clip(u, −limit, limit) + 1)` (gpt-oss: a
    /// clamped swish gate, the up projection offset by one).
    ClampedSwish {
        /// The factor inside the sigmoid.
        alpha: SwishScale,
        /// The clamp's bound.
        limit: ClampLimit,
    },
}

impl ExpertActivation {
    /// The activation of a `MixtureOfExperts` node with these attributes (`activation` absent:
    /// SiLU; `"clamped_silu"` with a one-element tensor `limit`; `"clamped_swish"` with `limit`
    /// and `alpha`), or what is wrong with them.
    pub fn of_node(attrs: &super::Attrs) -> Result<ExpertActivation, String> {
        let number = |act: &str, key: &str| match attrs.tensor(key).and_then(|t| t.to_f64_vec()).as_deref() {
            Some(&[v]) if v > 0.0 && v.is_finite() => Ok(v),
            _ => Err(format!("activation `{act}` without a positive one-element `{key}`")),
        };
        match attrs.str("activation") {
            None | Some("silu") => Ok(ExpertActivation::Silu),
            Some(act @ "clamped_silu") => Ok(ExpertActivation::ClampedSilu { limit: ClampLimit(number(act, "limit")?) }),
            Some(act @ "clamped_swish") => {
                Ok(ExpertActivation::ClampedSwish { alpha: SwishScale(number(act, "alpha")?), limit: ClampLimit(number(act, "limit")?) })
            }
            Some(other) => Err(format!("activation `{other}` is none of `silu`, `clamped_silu`, `clamped_swish`")),
        }
    }

    /// Writes the node attributes [`ExpertActivation::of_node`] reads (none for SiLU).
    pub fn set_attrs(&self, attrs: &mut super::Attrs) {
        let number = |v: f64| super::Attr::Tensor(super::Tensor::from_f64(vec![], &[v]));
        match self {
            ExpertActivation::Silu => {}
            ExpertActivation::ClampedSilu { limit } => {
                attrs.set("activation", super::Attr::Str("clamped_silu".into()));
                attrs.set("limit", number(limit.0));
            }
            ExpertActivation::ClampedSwish { alpha, limit } => {
                attrs.set("activation", super::Attr::Str("clamped_swish".into()));
                attrs.set("alpha", number(alpha.0));
                attrs.set("limit", number(limit.0));
            }
        }
    }
}

impl std::fmt::Display for ExpertActivation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpertActivation::Silu => f.write_str("silu"),
            // the exporters' constants are f32: shown as such (the plan file keeps every digit)
            ExpertActivation::ClampedSilu { limit } => write!(f, "clamped_silu(limit = {})", limit.0 as f32),
            ExpertActivation::ClampedSwish { alpha, limit } => write!(f, "clamped_swish(alpha = {}, limit = {})", alpha.0 as f32, limit.0 as f32),
        }
    }
}

/// Where a mixture of experts applies the router's weights: to each expert's output (Mixtral,
/// Qwen-MoE, DeepSeek: `Σ w·expert(x)`) or to the token entering it (Llama 4:
/// `Σ expert(w·x)`). The experts are nonlinear, so the two differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertWeighting {
    /// `Σ_j w_j · expert_j(x)`.
    #[default]
    Output,
    /// `Σ_j expert_j(w_j · x)`.
    Input,
}

impl ExpertWeighting {
    /// True for the default, [`ExpertWeighting::Output`] (the plan file leaves it out).
    pub fn is_output(&self) -> bool {
        *self == ExpertWeighting::Output
    }

    /// The weighting of a `MixtureOfExperts` node with these attributes (`weighting` absent:
    /// output; `"input"`: input), or the attribute's value when it is neither.
    pub fn of_node(attrs: &super::Attrs) -> Result<ExpertWeighting, String> {
        match attrs.str("weighting") {
            None | Some("output") => Ok(ExpertWeighting::Output),
            Some("input") => Ok(ExpertWeighting::Input),
            Some(other) => Err(other.to_string()),
        }
    }

    /// The node attribute `weighting` spells it as (none for the default).
    pub fn attr(&self) -> Option<&'static str> {
        match self {
            ExpertWeighting::Output => None,
            ExpertWeighting::Input => Some("input"),
        }
    }
}

impl FusedOp {
    /// The op the fused node runs.
    pub fn op_kind(&self) -> super::OpKind {
        use super::OpKind;
        match self {
            FusedOp::Gelu { .. } => OpKind::Gelu,
            FusedOp::Attention { .. } => OpKind::ScaledDotProductAttention,
            FusedOp::MixtureOfExperts { .. } => OpKind::MixtureOfExperts,
            FusedOp::RmsNorm { .. } => OpKind::RMSNormalization,
            FusedOp::LayerNorm { .. } => OpKind::LayerNormalization,
            FusedOp::SwiGlu => OpKind::SwiGlu,
            FusedOp::Rotary { .. } => OpKind::ApplyRotary,
        }
    }

    /// How many inputs the fused node reads, in the order [`Fusion::inputs`] lists them.
    pub fn arity(&self) -> usize {
        match self {
            FusedOp::Gelu { .. } => 1,
            FusedOp::Attention { mask, .. } => 3 + usize::from(mask.is_some()),
            FusedOp::MixtureOfExperts { biases, .. } => 5 + 2 * usize::from(*biases),
            FusedOp::RmsNorm { .. } | FusedOp::SwiGlu => 2,
            FusedOp::LayerNorm { bias, .. } => 2 + usize::from(*bias),
            FusedOp::Rotary { .. } => 3,
        }
    }
}

/// How a fused attention's mask applies to the scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionMask {
    /// A floating-point mask added to the scaled scores (`Add(scores, mask)`).
    Additive,
    /// A bool mask, true where a score is kept (`Where(mask, scores, -inf or the lowest
    /// float)`); the kernel's bool mask has the same meaning.
    Keep,
}

/// `Gelu`'s `approximate` attribute, spelled as ONNX spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GeluApproximation {
    /// `0.5·x·(1 + erf(x/√2))`.
    None,
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    Tanh,
}

impl std::fmt::Display for FusedOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FusedOp::Gelu { approximate: GeluApproximation::None } => f.write_str("Gelu"),
            FusedOp::Gelu { approximate: GeluApproximation::Tanh } => f.write_str("Gelu(approximate = tanh)"),
            FusedOp::Attention { scale, mask } => {
                write!(f, "ScaledDotProductAttention(scale = {}", scale.0)?;
                match mask {
                    Some(AttentionMask::Additive) => f.write_str(", additive mask)"),
                    Some(AttentionMask::Keep) => f.write_str(", bool mask)"),
                    None => f.write_str(")"),
                }
            }
            FusedOp::MixtureOfExperts { experts, activation, weighting, biases } => {
                write!(f, "MixtureOfExperts(experts = {experts}, activation = {activation}")?;
                if *biases {
                    f.write_str(", biases")?;
                }
                match weighting.attr() {
                    Some(w) => write!(f, ", weighting = {w})"),
                    None => f.write_str(")"),
                }
            }
            FusedOp::RmsNorm { epsilon } => write!(f, "RMSNormalization(epsilon = {})", epsilon.0),
            FusedOp::LayerNorm { epsilon, bias } => write!(f, "LayerNormalization(epsilon = {}{})", epsilon.0, if *bias { "" } else { ", no bias" }),
            FusedOp::SwiGlu => f.write_str("SwiGlu"),
            FusedOp::Rotary { interleaved: false } => f.write_str("ApplyRotary"),
            FusedOp::Rotary { interleaved: true } => f.write_str("ApplyRotary(interleaved)"),
        }
    }
}

/// One rewrite of a chain into a fused node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fusion {
    /// The fused node: the chain's last node, whose id and output it keeps.
    pub node: NodeId,
    /// Its op.
    pub op: FusedOp,
    /// The values the chain computes from: the fused node's inputs, in the op's order
    /// ([`FusedOp::arity`] of them; a GELU's one input, an attention's `q, kᵀ, v, mask?`, a
    /// mixture of experts' `x, weights, indices, gate_up, down` (and its biases), an RMS norm's `x, w`, a
    /// SwiGLU's `gate, up`, a rotary embedding's `x, cos, sin`).
    pub inputs: Vec<ValueId>,
    /// The chain's output (the fused node's output).
    pub output: ValueId,
    /// Every node of the chain, `node` included, ascending; all but `node` are removed.
    pub replaces: Vec<NodeId>,
}
