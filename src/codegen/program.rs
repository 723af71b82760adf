//! Per-rank programs: what each rank executes, in order. Part of the plan file contract.
//!
//! Point-to-point semantics (what the runner must do and the simulator assumes): a `Send` is
//! posted without waiting (torch's `isend`; the runner waits on outstanding sends before the
//! optimizer step), a `Recv` blocks until the message has arrived. Each `Recv` sits right before
//! the compute that needs it and each `Send` right after the compute that produced it, as in
//! torch.distributed.pipelining.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ir::{Action, ActionKind};

/// What a point-to-point message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Payload {
    /// A stage's forward output, the next stage's input.
    Activation,
    /// The gradient of a stage's input, sent to the previous stage.
    Gradient,
}

/// One instruction of a rank's program.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Instr {
    /// Forward of `stage` on microbatch `mb`.
    Forward {
        /// Global stage index.
        stage: usize,
        /// Microbatch.
        mb: usize,
    },
    /// Backward of `stage` on `mb` (input-gradient half only if a `BackwardWeight` for the same
    /// stage and microbatch follows in this program).
    Backward {
        /// Global stage index.
        stage: usize,
        /// Microbatch.
        mb: usize,
    },
    /// Weight-gradient half of the backward (ZB-H1).
    BackwardWeight {
        /// Global stage index.
        stage: usize,
        /// Microbatch.
        mb: usize,
    },
    /// Post a message to `peer` (non-blocking). `stage` is the sending stage.
    Send {
        /// Global rank of the receiver.
        peer: usize,
        /// What is sent.
        what: Payload,
        /// The sending stage.
        stage: usize,
        /// Microbatch.
        mb: usize,
        /// Message size.
        bytes: u64,
    },
    /// Wait for a message from `peer`. `stage` is the receiving stage.
    Recv {
        /// Global rank of the sender.
        peer: usize,
        /// What is received.
        what: Payload,
        /// The receiving stage.
        stage: usize,
        /// Microbatch.
        mb: usize,
        /// Message size.
        bytes: u64,
    },
    /// All-reduce over `group` (global ranks, same order on every member).
    AllReduce {
        /// Member ranks.
        group: Vec<usize>,
        /// Buffer size per rank.
        bytes: u64,
        /// What is reduced (`dp-grads:stage1`); members match collectives by tag and order.
        tag: String,
    },
    /// Reduce-scatter over `group` (`bytes`: the input each rank holds).
    ReduceScatter {
        /// Member ranks.
        group: Vec<usize>,
        /// Input size per rank.
        bytes: u64,
        /// Tag, as for `AllReduce`.
        tag: String,
    },
    /// All-gather over `group` (`bytes`: the gathered output).
    AllGather {
        /// Member ranks.
        group: Vec<usize>,
        /// Output size per rank.
        bytes: u64,
        /// Tag, as for `AllReduce`.
        tag: String,
    },
    /// The optimizer step, after all gradients are final.
    OptimizerStep,
}

impl Instr {
    /// The schedule action this instruction is, if it is one (`2F0`, `1SEND_F0`, …).
    pub fn action(&self) -> Option<Action> {
        let (stage, kind, mb) = match *self {
            Instr::Forward { stage, mb } => (stage, ActionKind::Forward, mb),
            Instr::Backward { stage, mb } => (stage, ActionKind::Backward, mb),
            Instr::BackwardWeight { stage, mb } => (stage, ActionKind::BackwardWeight, mb),
            Instr::Send { what: Payload::Activation, stage, mb, .. } => (stage, ActionKind::SendForward, mb),
            Instr::Send { what: Payload::Gradient, stage, mb, .. } => (stage, ActionKind::SendBackward, mb),
            Instr::Recv { what: Payload::Activation, stage, mb, .. } => (stage, ActionKind::RecvForward, mb),
            Instr::Recv { what: Payload::Gradient, stage, mb, .. } => (stage, ActionKind::RecvBackward, mb),
            _ => return None,
        };
        Some(Action::new(stage, kind, mb))
    }

    /// True for forward, backward and weight-gradient compute.
    pub fn is_compute(&self) -> bool {
        matches!(self, Instr::Forward { .. } | Instr::Backward { .. } | Instr::BackwardWeight { .. })
    }

    /// The collective's group and tag, for collectives.
    pub fn collective(&self) -> Option<(&[usize], &str)> {
        match self {
            Instr::AllReduce { group, tag, .. }
            | Instr::ReduceScatter { group, tag, .. }
            | Instr::AllGather { group, tag, .. } => Some((group, tag)),
            _ => None,
        }
    }
}

impl fmt::Display for Instr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(a) = self.action() {
            return write!(f, "{a}");
        }
        match self {
            Instr::AllReduce { tag, .. } => write!(f, "ALL_REDUCE({tag})"),
            Instr::ReduceScatter { tag, .. } => write!(f, "REDUCE_SCATTER({tag})"),
            Instr::AllGather { tag, .. } => write!(f, "ALL_GATHER({tag})"),
            Instr::OptimizerStep => f.write_str("OPTIMIZER_STEP"),
            _ => Ok(()),
        }
    }
}

/// The program one global rank runs for one training step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankProgram {
    /// Global rank.
    pub rank: usize,
    /// Instructions in order.
    pub instrs: Vec<Instr>,
}
