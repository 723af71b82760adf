//! What a split changes in a layer besides slicing weights: shape constants, structural
//! rewrites and backward gradient reductions. Plan-contract types (serde), carried into each
//! rank's `LayerShard` by codegen.

use serde::{Deserialize, Serialize};


/// A constant operand replaced for one node input (the constant may be shared by other nodes,
/// which keep the original).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConstantRewrite {
    /// The reading node.
    pub node: String,
    /// Its input slot.
    pub input: usize,
    /// The original constant's name.
    pub value: String,
    /// The new integer values (same dtype and dims as the original).
    pub new_values: Vec<i64>,
}

/// A structural change to one node of the layer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "rewrite", rename_all = "snake_case")]
pub enum NodeRewrite {
    /// A Gemm whose output is a partial sum: its bias `C` is added after the all-reduce.
    DeferBias {
        /// The Gemm.
        node: String,
    },
    /// Experts split by their intermediate dim whose outputs are partial sums: each tensor rank
    /// adds its share of the down-projection bias, `bias / tp` (the kernel's attribute
    /// `down_bias_share`), so the reduced sum holds it once.
    ShareExpertBias {
        /// The `MixtureOfExperts` node.
        node: String,
    },
    /// A vocabulary-parallel lookup: indices outside `[start, end)` read row 0 and are zeroed.
    MaskedGather {
        /// The Gather.
        node: String,
        /// First vocabulary row of this rank.
        start: i64,
        /// One past the last.
        end: i64,
    },
    /// A shape operand computed at run time, divided elementwise by `divisors` (a Reshape
    /// target or Expand shape whose split entry shrinks).
    DivideShape {
        /// The reading node.
        node: String,
        /// Its input slot.
        input: usize,
        /// One divisor per element (1 where nothing changes).
        divisors: Vec<i64>,
    },
}

/// A gradient the backward pass must all-reduce over the tensor group (Megatron's *f*): `node`
/// reads the replicated `value` at input slot `input` but produces a split or partial-sum
/// output, so the gradient it sends back to `value` is only this rank's part.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PartialGradient {
    /// The reading node.
    pub node: String,
    /// Its input slot.
    pub input: usize,
    /// The replicated value read there.
    pub value: String,
}

/// The node adding a deferred Gemm bias after the collective.
pub fn add_bias_name(gemm: &str) -> String {
    format!("{gemm}.add_bias")
}
