//! Fused ops: one node that computes what a chain of nodes computed, as `passes::fuse` rewrote
//! it. Analysis records each rewrite ([`super::LayeredGraph::fused`]), the plan carries the
//! records, and the runner applies exactly them to the graph it executes.

use serde::{Deserialize, Serialize};

use super::{NodeId, ValueId};

/// The op of a fused node (with its attributes). The plan file spells it
/// `{"gelu": {"approximate": "tanh"}}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum FusedOp {
    /// ONNX `Gelu` (opset 20), libtorch's fused `gelu` kernel.
    Gelu {
        /// The `approximate` attribute.
        approximate: GeluApproximation,
    },
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
    /// The value the chain computes from (the fused node's one input).
    pub input: ValueId,
    /// The chain's output (the fused node's output).
    pub output: ValueId,
    /// Every node of the chain, `node` included, ascending; all but `node` are removed.
    pub replaces: Vec<NodeId>,
}
