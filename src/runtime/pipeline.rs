//! One rank of a plan: stage subgraphs of the model, the rank's program (forward, backward,
//! weight-gradient, sends, receives, collectives, optimizer step) executed in order, with
//! autograd across stage boundaries, data-parallel gradient sums (bucketed), ZeRO-sharded
//! AdamW and tied-weight gradient sums.
//!
//! The parts: `rank.rs` sets the rank up from the plan (its codegen section: stage node ids,
//! programs, shards), `interp.rs` executes its program one method per instruction, `zero.rs`
//! holds the ZeRO state and data-parallel synchronisation, `report.rs` gathers what the ranks
//! measured.

use std::time::Duration;

use super::RuntimeError;
use super::dist::{DistError, RankEnv};
use super::executor::Executor;
use super::interp::Interp;
use super::rank::{Rank, Shards, check_world};
use super::train::{AdamWConfig, Batch, LossKind};
use crate::plan::Plan;

pub use super::layout::{REPLAN, StageLayout, codegen_section, rank_programs, stage_layout};
pub use super::report::{RankReport, RankStats, StateBytes, peak_rss_bytes};

impl From<DistError> for RuntimeError {
    fn from(e: DistError) -> Self {
        RuntimeError::Train(e.to_string())
    }
}

pub(super) fn terr(m: impl Into<String>) -> RuntimeError {
    RuntimeError::Train(m.into())
}

/// Settings of a distributed run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// What is minimised.
    pub loss: LossKind,
    /// Optimizer settings.
    pub adamw: AdamWConfig,
    /// Global gradient-norm limit.
    pub clip: Option<f64>,
    /// Timeout of every collective and receive.
    pub timeout: Duration,
    /// Data-parallel all-reduce bucket size.
    pub bucket_bytes: usize,
    /// Print `[rank R] step N` on stderr after every step.
    pub progress: bool,
}

/// Runs this rank's part of `plan` for `cfg.steps` steps on `batch` (the global batch; every
/// rank holds it and takes its replica's share).
pub fn run_rank(plan: &Plan, exec: &Executor<'_>, batch: &Batch, cfg: &RunConfig, env: &RankEnv) -> Result<RankReport, RuntimeError> {
    codegen_section(plan)?;
    check_world(plan, env)?;
    let shards = Shards::new(plan, exec.graph(), env.rank)?;
    let rank = Rank::new(plan, exec, &shards, batch, cfg, env)?;
    let mut interp = Interp::new(&rank)?;
    let records = (1..=cfg.steps).map(|step| interp.run_step(step)).collect::<Result<Vec<_>, _>>()?;
    super::report::gather(&rank.groups.world, env.world, records, &interp.tally)
}
