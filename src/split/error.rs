//! Errors of the tensor split; each names the layer, node and op concerned and the fix.

use crate::ir::GraphError;
use crate::passes::PassError;

/// Errors of sharding; each names the layer, node and op concerned.
#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    /// The layer cannot be split this way.
    #[error("layer {layer}: node `{node}` ({op}) cannot be split {tp} ways: {why}")]
    Unsupported {
        /// Layer index.
        layer: usize,
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// Tensor-parallel degree.
        tp: usize,
        /// Why.
        why: String,
    },
    /// A shard names something the graph does not have, or is inconsistent with it.
    #[error("shard of layer {layer}, rank {rank}: {msg}")]
    BadShard {
        /// Layer index.
        layer: usize,
        /// Tensor rank.
        rank: usize,
        /// What is wrong.
        msg: String,
    },
    /// A layer does not divide at the chosen tensor degree and its strategy does not say
    /// replicate.
    #[error(
        "layer {layer} (`{name}`) does not split {tp} ways: {} would stay whole on every tensor rank while the plan prices a split; {}",
        weights.join(", "),
        if working.is_empty() { "no tensor degree up to 64 splits it: plan it with strategy `replicate` or tp = 1".to_string() }
        else { format!("tensor degrees that split it: {}", working.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")) }
    )]
    Indivisible {
        /// Layer index.
        layer: usize,
        /// Layer name.
        name: String,
        /// The tensor degree asked for.
        tp: usize,
        /// Initializers left whole.
        weights: Vec<String>,
        /// Tensor degrees (2..=64) at which the layer splits entirely.
        working: Vec<usize>,
    },
    /// Sequence parallelism cannot split a layer's token axis `tp` ways.
    #[error(
        "layer {layer}: sequence parallelism splits `{value}` along its token axis of length {len}, which does not divide by tp = {tp}; use a sequence length divisible by {tp} or plan without --sequence-parallel"
    )]
    SequenceIndivisible {
        /// Layer index.
        layer: usize,
        /// The reduce-scattered value.
        value: String,
        /// Its token axis length (per outer block).
        len: i64,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// A layer index out of range.
    #[error("layer {layer} does not exist (the graph has {layers} layers)")]
    NoLayer {
        /// Asked for.
        layer: usize,
        /// Number of layers.
        layers: usize,
    },
    /// Shape inference of the shard failed.
    #[error("shape inference of the shard failed: {0}")]
    Pass(#[from] PassError),
    /// The shard graph is malformed.
    #[error(transparent)]
    Graph(#[from] GraphError),
}
