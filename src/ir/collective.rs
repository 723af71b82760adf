//! Collectives and conversions between the ranks' parts of a value, as IR ops
//! ([`super::Op::Collective`]): what codegen inserts into a rank's graph (tensor-parallel
//! all-reduces and gathers, Megatron's *f*, context parallelism's token gather and cut). Never
//! read from a model file. The kinds are also plan-file content (codegen's shards list them),
//! hence serde.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a collective computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CollectiveKind {
    /// Sum over the group; every member gets the sum (Megatron's *g*: the backward is the
    /// identity).
    AllReduce,
    /// Concatenation of the members' parts along `axis`, in group order.
    AllGather {
        /// Axis of the gathered (full) tensor.
        axis: usize,
    },
    /// Sum over the group, each member keeping its slice along `axis`.
    ReduceScatter {
        /// Axis of the full tensor that is scattered.
        axis: usize,
    },
    /// No communication: each member keeps its own slice along `axis` of a replicated tensor
    /// (the backward all-gathers the gradient).
    Scatter {
        /// Axis of the full tensor that is sliced.
        axis: usize,
    },
    /// Megatron's *f*: the identity forward, the gradient all-reduced over the group (where a
    /// replicated value enters split work).
    CopyToRegion,
    /// Context parallelism: the members' tokens along `axis` gathered into one-process order
    /// (an all-gather, then the reordering of the load-balanced chunks; the backward a
    /// reduce-scatter).
    TokenGather {
        /// The token axis.
        axis: usize,
        /// Sequence blocks in that axis (tokens flattened with the batch: `batch` blocks) at
        /// the batch the shapes were inferred at.
        outer: i64,
        /// Tokens of one whole sequence block along the axis (0: unknown, `outer` is used): the
        /// kernel counts the blocks of the tensor it runs on by it, so a token axis flattened
        /// with the batch is cut right at any batch.
        #[serde(default)]
        seq: i64,
    },
    /// Context parallelism: a whole value cut to this member's tokens along `axis`, without
    /// communication.
    TokenLocalize {
        /// The token axis.
        axis: usize,
        /// Sequence blocks in that axis.
        outer: i64,
        /// Tokens of one whole sequence block along the axis (see `TokenGather`).
        #[serde(default)]
        seq: i64,
    },
}

impl CollectiveKind {
    /// The op's name in dumps and messages.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "AllReduce",
            CollectiveKind::AllGather { .. } => "AllGather",
            CollectiveKind::ReduceScatter { .. } => "ReduceScatter",
            CollectiveKind::Scatter { .. } => "Scatter",
            CollectiveKind::CopyToRegion => "CopyToRegion",
            CollectiveKind::TokenGather { .. } => "TokenGather",
            CollectiveKind::TokenLocalize { .. } => "TokenLocalize",
        }
    }

    /// The axis it gathers, scatters or cuts along, if any.
    pub fn axis(self) -> Option<usize> {
        match self {
            CollectiveKind::AllReduce | CollectiveKind::CopyToRegion => None,
            CollectiveKind::AllGather { axis }
            | CollectiveKind::ReduceScatter { axis }
            | CollectiveKind::Scatter { axis }
            | CollectiveKind::TokenGather { axis, .. }
            | CollectiveKind::TokenLocalize { axis, .. } => Some(axis),
        }
    }

    /// True for the kinds that sum partial values (reduced in fp32 for low-precision inputs).
    pub fn sums(self) -> bool {
        matches!(self, CollectiveKind::AllReduce | CollectiveKind::ReduceScatter { .. })
    }
}

/// Which process group a collective runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// The stage's tensor-parallel ranks.
    Tensor,
    /// The data-parallel replicas of a tensor rank.
    Data,
    /// The stages sharing a tied weight.
    TiedWeight,
    /// The context-parallel ranks sharing a replica's sequences.
    Context,
}

impl GroupKind {
    /// The group's name.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tensor => "tensor",
            GroupKind::Data => "data",
            GroupKind::TiedWeight => "tied_weight",
            GroupKind::Context => "context",
        }
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
