//! The strategies a node of a layer can take across the tensor ranks: the solver's choice per
//! node, recorded in the plan file.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

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
