//! Per-rank programs: what each rank executes, in order. Part of the plan file contract.
//!
//! Point-to-point semantics (what the runner must do and the simulator assumes): a `Send` is
//! posted without waiting (torch's `isend`; the runner waits on outstanding sends before the
//! optimizer step), a `Recv` blocks until the message has arrived. Each `Recv` sits right before
//! the compute that needs it and each `Send` right after the compute that produced it, as in
//! torch.distributed.pipelining.

use std::fmt;
use std::str::FromStr;

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

impl Payload {
    /// The stage that receives what stage `sender` sends (`None` before the first stage).
    pub fn receiver(self, sender: usize) -> Option<usize> {
        match self {
            Payload::Activation => Some(sender + 1),
            Payload::Gradient => sender.checked_sub(1),
        }
    }
}

/// What a collective is for: which state it moves, and of which stage or weight. Written in
/// the plan as its tag text (`dp-grads:stage1`), parsed once when the plan is read.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Purpose {
    /// ZeRO 3: all-gather of a stage's sharded parameters before its forward or backward
    /// (`zero3-params:stageS`).
    Zero3Params {
        /// The stage.
        stage: usize,
    },
    /// Data-parallel gradient sum of a stage: all-reduce, or reduce-scatter under ZeRO 2 and
    /// sharded data parallelism, where an all-reduce across sharding groups follows
    /// (`dp-grads:stageS`).
    DpGrads {
        /// The stage.
        stage: usize,
    },
    /// ZeRO 2 and 3: reduce-scatter of a stage's gradients of the microbatches so far into
    /// this rank's block, after a backward that is not the stage's last of the step, so no
    /// whole gradient outlives its backward; the step's `DpGrads` adds the last
    /// (`mb-grads:stageS`).
    MicrobatchGrads {
        /// The stage.
        stage: usize,
    },
    /// ZeRO 1 and 2: all-gather of a stage's updated parameters after the optimizer step
    /// (`zero-params:stageS`).
    ZeroParams {
        /// The stage.
        stage: usize,
    },
    /// Gradient sum of a tied weight over the pipeline ranks reading it (`tied-grad:NAME`).
    TiedGrad {
        /// Initializer name.
        weight: String,
    },
}

impl Purpose {
    /// The stage whose state it moves (none for tied weights).
    pub fn stage(&self) -> Option<usize> {
        match *self {
            Purpose::Zero3Params { stage } | Purpose::DpGrads { stage } | Purpose::MicrobatchGrads { stage } | Purpose::ZeroParams { stage } => Some(stage),
            Purpose::TiedGrad { .. } => None,
        }
    }
}

impl fmt::Display for Purpose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Purpose::Zero3Params { stage } => write!(f, "zero3-params:stage{stage}"),
            Purpose::DpGrads { stage } => write!(f, "dp-grads:stage{stage}"),
            Purpose::MicrobatchGrads { stage } => write!(f, "mb-grads:stage{stage}"),
            Purpose::ZeroParams { stage } => write!(f, "zero-params:stage{stage}"),
            Purpose::TiedGrad { weight } => write!(f, "tied-grad:{weight}"),
        }
    }
}

impl FromStr for Purpose {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let stage = |rest: &str| rest.strip_prefix("stage").and_then(|n| n.parse::<usize>().ok());
        let parsed = match s.split_once(':') {
            Some(("zero3-params", rest)) => stage(rest).map(|stage| Purpose::Zero3Params { stage }),
            Some(("dp-grads", rest)) => stage(rest).map(|stage| Purpose::DpGrads { stage }),
            Some(("mb-grads", rest)) => stage(rest).map(|stage| Purpose::MicrobatchGrads { stage }),
            Some(("zero-params", rest)) => stage(rest).map(|stage| Purpose::ZeroParams { stage }),
            // `tied:` is how early plans spelled it.
            Some(("tied-grad" | "tied", weight)) if !weight.is_empty() => Some(Purpose::TiedGrad { weight: weight.to_string() }),
            _ => None,
        };
        parsed.ok_or_else(|| {
            format!("collective tag `{s}`: expected zero3-params:stageS, dp-grads:stageS, mb-grads:stageS, zero-params:stageS or tied-grad:WEIGHT (re-plan with this smp-partition)")
        })
    }
}

impl TryFrom<String> for Purpose {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Purpose> for String {
    fn from(p: Purpose) -> String {
        p.to_string()
    }
}

/// One instruction of a program. `P` names a point-to-point peer and `G` a collective's
/// group: global ranks in a rank's concrete program ([`Instr`]'s defaults), pipeline ranks
/// and group kinds in a plan's program templates (`codegen::encode::Step`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Instr<P = usize, G = Vec<usize>> {
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
    /// Post a message to `to` (non-blocking). `stage` is the sending stage.
    Send {
        /// The receiver.
        to: P,
        /// What is sent: an activation (`outputs_to_next` of `stage`) or a gradient (of
        /// `outputs_to_next` of `stage − 1`).
        what: Payload,
        /// The sending stage.
        stage: usize,
        /// Microbatch.
        mb: usize,
        /// Message size.
        bytes: u64,
    },
    /// Wait for a message from `from`. `stage` is the receiving stage.
    Recv {
        /// The sender.
        from: P,
        /// What is received.
        what: Payload,
        /// The receiving stage.
        stage: usize,
        /// Microbatch.
        mb: usize,
        /// Message size.
        bytes: u64,
    },
    /// All-reduce (sum) over `group` (same member order on every member).
    AllReduce {
        /// Member ranks.
        group: G,
        /// Buffer size per rank.
        bytes: u64,
        /// What is reduced; members match collectives by purpose and order.
        #[serde(rename = "tag")]
        purpose: Purpose,
    },
    /// Reduce-scatter over `group` (`bytes`: the input each rank holds).
    ReduceScatter {
        /// Member ranks.
        group: G,
        /// Input size per rank.
        bytes: u64,
        /// What is reduced.
        #[serde(rename = "tag")]
        purpose: Purpose,
    },
    /// All-gather over `group` (`bytes`: the gathered output).
    AllGather {
        /// Member ranks.
        group: G,
        /// Output size per rank.
        bytes: u64,
        /// What is gathered.
        #[serde(rename = "tag")]
        purpose: Purpose,
    },
    /// The optimizer step on this rank's parameters (its ZeRO shard when zero ≥ 1), after all
    /// gradients are final.
    OptimizerStep,
}

impl<P, G> Instr<P, G> {
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

    /// The collective's group and purpose, for collectives.
    pub fn collective(&self) -> Option<(&G, &Purpose)> {
        match self {
            Instr::AllReduce { group, purpose, .. }
            | Instr::ReduceScatter { group, purpose, .. }
            | Instr::AllGather { group, purpose, .. } => Some((group, purpose)),
            _ => None,
        }
    }

    /// The same instruction with peers and groups renamed (a template instantiated for one
    /// rank, or a lowered program turned into a template).
    pub fn map<Q, H, E>(self, mut peer: impl FnMut(P) -> Result<Q, E>, mut group: impl FnMut(G) -> Result<H, E>) -> Result<Instr<Q, H>, E> {
        Ok(match self {
            Instr::Forward { stage, mb } => Instr::Forward { stage, mb },
            Instr::Backward { stage, mb } => Instr::Backward { stage, mb },
            Instr::BackwardWeight { stage, mb } => Instr::BackwardWeight { stage, mb },
            Instr::Send { to, what, stage, mb, bytes } => Instr::Send { to: peer(to)?, what, stage, mb, bytes },
            Instr::Recv { from, what, stage, mb, bytes } => Instr::Recv { from: peer(from)?, what, stage, mb, bytes },
            Instr::AllReduce { group: g, bytes, purpose } => Instr::AllReduce { group: group(g)?, bytes, purpose },
            Instr::ReduceScatter { group: g, bytes, purpose } => Instr::ReduceScatter { group: group(g)?, bytes, purpose },
            Instr::AllGather { group: g, bytes, purpose } => Instr::AllGather { group: group(g)?, bytes, purpose },
            Instr::OptimizerStep => Instr::OptimizerStep,
        })
    }
}

impl<P, G> fmt::Display for Instr<P, G> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(a) = self.action() {
            return write!(f, "{a}");
        }
        match self {
            Instr::AllReduce { purpose, .. } => write!(f, "ALL_REDUCE({purpose})"),
            Instr::ReduceScatter { purpose, .. } => write!(f, "REDUCE_SCATTER({purpose})"),
            Instr::AllGather { purpose, .. } => write!(f, "ALL_GATHER({purpose})"),
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
