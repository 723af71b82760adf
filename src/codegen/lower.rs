//! Lowering compute-only schedule lists to per-rank programs: a receive right before the
//! compute that needs it, a send right after the compute that produced it (no send or receive
//! between stages on the same rank), then the gradient-synchronisation epilogue and the
//! optimizer step.

use crate::ir::{Action, ActionKind, ScheduleError, ScheduleKind, compute_actions};

use super::program::{Instr, Payload, RankProgram};

/// How pipeline ranks map to the cluster and what crosses stage boundaries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LowerOptions {
    /// Global rank of each pipeline rank (empty: pipeline rank r is global rank r).
    pub ranks: Vec<usize>,
    /// Bytes per microbatch leaving stage s for stage s + 1 (the gradient coming back has the
    /// same size); missing entries count as 0.
    pub boundary_bytes: Vec<u64>,
    /// Instructions each pipeline rank runs after its last compute and before the optimizer
    /// step (data-parallel gradient all-reduce, ZeRO reduce-scatter, tied-weight sums); missing
    /// entries are empty.
    pub epilogue: Vec<Vec<Instr>>,
}

/// A compute list that cannot be lowered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// The schedule itself is invalid.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// An action names a stage outside the pipeline.
    #[error("pipeline rank {rank}: action {action} names stage {}, but the schedule has {stages} stages", action.stage)]
    StageOutOfRange {
        /// Pipeline rank.
        rank: usize,
        /// The action.
        action: Action,
        /// Number of stages.
        stages: usize,
    },
    /// An action sits on a rank that does not own its stage.
    #[error("pipeline rank {rank}: action {action} belongs to pipeline rank {owner}")]
    WrongRank {
        /// Pipeline rank holding the action.
        rank: usize,
        /// The action.
        action: Action,
        /// The rank that owns the stage.
        owner: usize,
    },
    /// A non-compute action in a compute-only list.
    #[error("pipeline rank {rank}: {action} is not a compute action (F, B or W); lowering inserts sends and receives itself")]
    NotCompute {
        /// Pipeline rank.
        rank: usize,
        /// The action.
        action: Action,
    },
    /// `ranks` has the wrong length.
    #[error("lowering options list {given} global ranks for {p} pipeline ranks")]
    RankCount {
        /// Entries given.
        given: usize,
        /// Pipeline ranks.
        p: usize,
    },
}

/// The programs of `kind` on `p` pipeline ranks with `m` microbatches.
pub fn lower_schedule(kind: ScheduleKind, p: usize, m: usize, opts: &LowerOptions) -> Result<Vec<RankProgram>, LowerError> {
    let actions = compute_actions(kind, p, m)?;
    lower(kind, &actions, opts)
}

/// Lowers one compute-only action list per pipeline rank to per-rank programs.
pub fn lower(kind: ScheduleKind, actions: &[Vec<Action>], opts: &LowerOptions) -> Result<Vec<RankProgram>, LowerError> {
    let p = actions.len();
    if !opts.ranks.is_empty() && opts.ranks.len() != p {
        return Err(LowerError::RankCount { given: opts.ranks.len(), p });
    }
    let stages = kind.stages(p);
    let global = |pp: usize| opts.ranks.get(pp).copied().unwrap_or(pp);
    let owner = |stage: usize| kind.rank_of_stage(stage, p);
    let boundary = |stage: usize| opts.boundary_bytes.get(stage).copied().unwrap_or(0);
    let mut programs = Vec::with_capacity(p);
    for (r, list) in actions.iter().enumerate() {
        let mut instrs = Vec::with_capacity(list.len() * 3 + 2);
        for &a in list {
            let (s, mb) = (a.stage, a.microbatch);
            if s >= stages {
                return Err(LowerError::StageOutOfRange { rank: r, action: a, stages });
            }
            if owner(s) != r {
                return Err(LowerError::WrongRank { rank: r, action: a, owner: owner(s) });
            }
            let prev = (s > 0 && owner(s - 1) != r).then(|| global(owner(s - 1)));
            let next = (s + 1 < stages && owner(s + 1) != r).then(|| global(owner(s + 1)));
            match a.kind {
                ActionKind::Forward => {
                    if let Some(peer) = prev {
                        let bytes = boundary(s - 1);
                        instrs.push(Instr::Recv { from: peer, what: Payload::Activation, stage: s, mb, bytes });
                    }
                    instrs.push(Instr::Forward { stage: s, mb });
                    if let Some(peer) = next {
                        instrs.push(Instr::Send { to: peer, what: Payload::Activation, stage: s, mb, bytes: boundary(s) });
                    }
                }
                ActionKind::Backward => {
                    if let Some(peer) = next {
                        instrs.push(Instr::Recv { from: peer, what: Payload::Gradient, stage: s, mb, bytes: boundary(s) });
                    }
                    instrs.push(Instr::Backward { stage: s, mb });
                    if let Some(peer) = prev {
                        let bytes = boundary(s - 1);
                        instrs.push(Instr::Send { to: peer, what: Payload::Gradient, stage: s, mb, bytes });
                    }
                }
                ActionKind::BackwardWeight => instrs.push(Instr::BackwardWeight { stage: s, mb }),
                _ => return Err(LowerError::NotCompute { rank: r, action: a }),
            }
        }
        if let Some(extra) = opts.epilogue.get(r) {
            instrs.extend(extra.iter().cloned());
        }
        instrs.push(Instr::OptimizerStep);
        programs.push(RankProgram { rank: global(r), instrs });
    }
    Ok(programs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_follow_and_receives_precede_compute() {
        let progs = lower_schedule(ScheduleKind::OneFOneB, 2, 2, &LowerOptions::default()).unwrap();
        let text = |r: usize| progs[r].instrs.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" ");
        assert_eq!(text(0), "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 OPTIMIZER_STEP");
        assert_eq!(text(1), "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 OPTIMIZER_STEP");
    }

    #[test]
    fn interleaved_on_one_rank_needs_no_messages() {
        let progs = lower_schedule(ScheduleKind::Interleaved { virtual_stages: 3 }, 1, 2, &LowerOptions::default()).unwrap();
        assert!(progs[0].instrs.iter().all(|i| i.is_compute() || *i == Instr::OptimizerStep));
    }
}
