//! Errors of the passes.

use crate::ir::GraphError;

/// Errors of the passes. Each names the node, value or dim concerned.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// A symbolic dim is needed but nothing binds it.
    #[error("symbolic dim `{dim}` of input `{input}` is unbound: {fix}")]
    UnboundDim {
        /// The symbol.
        dim: String,
        /// The graph input that has it.
        input: String,
        /// How to bind it.
        fix: String,
    },
    /// `--seq-len` asks for another sequence length than the graph's fixed one.
    #[error("--seq-len {requested} conflicts with input `{input}`, whose sequence dim is fixed at {fixed}; drop --seq-len or re-export with a symbolic sequence dim")]
    SeqLenConflict {
        /// The graph input.
        input: String,
        /// Its fixed size.
        fixed: i64,
        /// What was asked.
        requested: i64,
    },
    /// A binding that makes no sense (non-positive size, unknown name).
    #[error("bad dim binding: {0}")]
    BadBinding(String),
    /// A `--frozen` or `--trainable` pattern names no initializer and no module tensor.
    #[error("{flag} '{pattern}' matches no parameter of the model (the nearest name is `{nearest}`){hint}; fix the pattern, or drop it")]
    PatternMatchesNothing {
        /// `--frozen` or `--trainable`.
        flag: &'static str,
        /// The glob pattern.
        pattern: String,
        /// The name sharing the longest prefix with the pattern.
        nearest: String,
        /// More on why, where known.
        hint: String,
    },
    /// An initializer's parameter record cannot be applied.
    #[error("parameter record of initializer `{value}`: {msg}; re-export with `smp_partition.export` or strip its `smp.*` metadata")]
    ParamRecord {
        /// The initializer.
        value: String,
        /// What is wrong.
        msg: String,
    },
    /// A fixed batch cannot be rebound to another microbatch size.
    #[error(
        "the model's batch is fixed at {batch} (first dim of input `{input}`){}, and rebinding it is not proven: {reason}; \
         plan microbatches of exactly {batch} samples, or re-export with a dynamic batch: \
         torch.onnx.export(model, args, path, dynamo=True, dynamic_shapes=({{0: torch.export.Dim(\"batch\")}},))",
        to.map(|t| format!(" but microbatches of {t} were asked")).unwrap_or_default()
    )]
    FixedBatch {
        /// The batch the graph fixes.
        batch: i64,
        /// The graph input that fixes it.
        input: String,
        /// The microbatch size asked, if known.
        to: Option<i64>,
        /// Where the proof failed.
        reason: String,
    },
    /// A fused-op record does not fit the graph.
    #[error("fused op at node `{node}`: {msg}")]
    Fusion {
        /// The fused node.
        node: String,
        /// What does not fit.
        msg: String,
    },
    /// Shape inference failed at a node.
    #[error("shape inference failed at node `{node}` ({op}): {msg}")]
    Shape {
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// What went wrong.
        msg: String,
    },
    /// A graph input's or initializer's dims are out of range (negative, too many).
    #[error("value `{value}`: {msg}")]
    ValueShape {
        /// The value.
        value: String,
        /// What is wrong.
        msg: String,
    },
    /// The graph is structurally broken.
    #[error(transparent)]
    Graph(#[from] GraphError),
}
