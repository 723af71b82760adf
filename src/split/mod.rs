//! The tensor-split engine: one place that knows how each op family splits across the tensor
//! ranks of a stage.
//!
//! Place in the spine: `frontend` → `ir` → `passes` → `cost` → **`split`** → `solve` →
//! `codegen`. It uses `ir`, `passes` (shape inference) and `cost` (to price offers); `solve` asks
//! it what each node can take, `codegen` asks it to emit the chosen strategy. It names nothing
//! from `solve` or `codegen`.
//!
//! - [`offer`]: "which strategies can this node take, at what cost": per layer and tensor
//!   degree, the choosing nodes (weight matmuls, embedding lookups, attention cores), their
//!   priced [`Strategy`] options and the pairs that must split together. The structure behind
//!   it (roles, where a column split flows, attention cores) is [`analyse`].
//! - [`realise`]: "emit this strategy": propagation of placements through the layer, producing
//!   a rank-independent [`SplitPlan`] (weight splits, rewrites, collectives) and, per choosing
//!   node, the strategy it realised. [`Engine::check_offers`] keeps every offer the solver sees
//!   to what emission realises (an offer the emitter does not realise is withdrawn).
//! - One file per op family holds its emission rule: [`matmul`] (column/row/heads), [`gather`]
//!   (vocabulary split), [`view`] (reshape, transpose, squeeze, split, concat, expand),
//!   [`elementwise`], [`norm`] (softmax, layer norm, reductions), [`attention`] (shared KV
//!   heads), [`experts`] (a mixture of experts split by each expert's intermediate dim), and
//!   [`sequence`] (sequence parallelism over a finished placement).

pub mod analyse;
mod attention;
pub mod check;
mod elementwise;
pub mod error;
mod experts;
mod gather;
mod matmul;
mod norm;
pub mod offer;
pub mod realise;
pub mod rewrite;
mod sequence;
mod view;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use analyse::{GraphFacts, NodeRole, SplitGraph, analyse, roles};
pub use check::{forced_assignment, isolated_assignment};
pub use error::SplitError;
pub use offer::{Coupling, LayerOffers, NodeOffers, Offer, StrategyInputs, offers, offers_from};
pub use realise::{CollectiveKind, Engine, SplitPlan, TensorCollective, WeightSplit};
pub use rewrite::{ConstantRewrite, NodeRewrite, PartialGradient, add_bias_name};

/// How one node of a layer runs across the tensor ranks. The plan file spells it in lower
/// case (`"column"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// A weight matmul's weight split by output columns (output split, input-gradient
    /// all-reduce in the backward).
    Column,
    /// A weight matmul's weight split by contracted rows (partial sums all-reduced).
    Row,
    /// Whole on every tensor rank.
    Replicate,
    /// An embedding table split by vocabulary rows (masked lookup, all-reduce).
    Vocab,
    /// An attention core split by heads.
    Heads,
    /// A mixture of experts with every expert's MLP split by its intermediate dim (whole
    /// tokens in, partial sums all-reduced).
    Experts,
    /// Any other node under sequence parallelism: runs on the rank's tokens.
    Sequence,
    /// Any other node without sequence parallelism: follows its inputs.
    Follow,
}

impl Strategy {
    /// Every strategy.
    pub const ALL: [Strategy; 8] = [
        Strategy::Column,
        Strategy::Row,
        Strategy::Replicate,
        Strategy::Vocab,
        Strategy::Heads,
        Strategy::Experts,
        Strategy::Sequence,
        Strategy::Follow,
    ];

    /// The plan file's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Column => "column",
            Strategy::Row => "row",
            Strategy::Replicate => "replicate",
            Strategy::Vocab => "vocab",
            Strategy::Heads => "heads",
            Strategy::Experts => "experts",
            Strategy::Sequence => "sequence",
            Strategy::Follow => "follow",
        }
    }

    /// Whether the node is a choosing node's (emission realises it per node and codegen checks
    /// it); `sequence` and `follow` are the aggregate rest of the layer.
    pub fn is_choosing(self) -> bool {
        !matches!(self, Strategy::Sequence | Strategy::Follow)
    }

    /// Whether the node's work is split across the tensor ranks.
    pub fn is_split(self) -> bool {
        !matches!(self, Strategy::Replicate | Strategy::Follow)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = String;

    fn from_str(s: &str) -> Result<Strategy, String> {
        Strategy::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            format!("unknown strategy `{s}`; expected one of {}", Strategy::ALL.map(Strategy::name).join(", "))
        })
    }
}
