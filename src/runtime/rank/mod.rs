//! One rank of a plan: stage subgraphs of the model, the rank's program (forward, backward,
//! weight-gradient, sends, receives, collectives, optimizer step) executed in order, with
//! autograd across stage boundaries, data-parallel gradient sums (bucketed), ZeRO-sharded
//! AdamW and tied-weight gradient sums.
//!
//! The parts: `layout` reads the plan's stage lists on the graph the plan was made for,
//! `setup` sets the rank up from the plan (its codegen section: stage node ids, programs,
//! shards, parameters, process groups), `interp` executes its program one method per
//! instruction and is the rank's step in the one training loop (`train::driver`), `zero`
//! holds the ZeRO state and data-parallel synchronisation, `offload` the kept inputs of
//! recomputed stages and their trips to host memory, `report` gathers what the ranks measured, `memory` counts the bytes of the tensors a rank holds.

mod check;
mod experts;
mod interp;
mod layout;
mod memory;
mod offload;
mod params;
mod report;
mod segments;
mod setup;
mod straggler;
mod zero;

use crate::ir::DimBindings;
use crate::plan::Plan;
use crate::runtime::RuntimeError;
use crate::runtime::comm::RankEnv;
use crate::runtime::data::DataSource;
use crate::runtime::kernels::executor::Executor;
use crate::runtime::state::checkpoint::{Checkpointing, SaveConfig};
use crate::runtime::state::weights::Source;
use crate::runtime::train::{TrainConfig, TrainObserver, drive, save_checkpoint};
use interp::Interp;
use setup::{Rank, Shards};

pub use check::check_rank;
pub use layout::{REPLAN, StageLayout, codegen_section, planned_graph, rank_programs, stage_layout};
pub use memory::{MemoryParts, install as install_memory_counter};
pub use report::{PhaseTimes, RankReport, RankStats, StateBytes, peak_rss_bytes};
pub use setup::{RankOptions, rank_weights};
pub use straggler::{DROP_STRAGGLERS_ENV, StragglerOptions};

/// What one rank of a plan runs with, handed from the run session to the rank.
pub struct RankRun<'a, 'g> {
    /// The plan (its codegen section checked by [`planned_graph`]).
    pub plan: &'a Plan,
    /// The executor of the graph the plan was made for ([`planned_graph`]).
    pub exec: &'a Executor<'g>,
    /// That graph's dim bindings.
    pub dims: &'a DimBindings,
    /// Where the rank reads the parts of weights it holds.
    pub source: &'a Source<'g>,
    /// The training data.
    pub data: &'a DataSource,
    /// The validation data, if any.
    pub eval_data: Option<&'a DataSource>,
    /// What is trained and how.
    pub cfg: &'a TrainConfig,
    /// How the rank runs (timeouts, buckets, progress lines, backend).
    pub opts: &'a RankOptions,
    /// This process's place in the world.
    pub env: &'a RankEnv,
    /// Checkpoints written and resumed.
    pub ckpt: &'a Checkpointing<'a>,
    /// With `Some`, the state after the last step is written as a checkpoint under its root.
    pub final_state: Option<&'a SaveConfig>,
}

/// Runs this rank's part of `run.plan` for `cfg.steps` steps on `data` (step k reads its k-th
/// global batch; each replica takes its share, and only ranks whose stages read data read it)
/// in the one training loop, validating on `eval_data` as `cfg.eval` says and checkpointing as
/// `ckpt` says (and `final_state`); tells `obs` of each step (with the global loss), validation
/// and checkpoint as it completes.
pub fn run_rank(run: &RankRun<'_, '_>, obs: &mut dyn TrainObserver) -> Result<RankReport, RuntimeError> {
    let RankRun { plan, exec, dims, source, data, eval_data, cfg, opts, env, ckpt, final_state } = *run;
    memory::install();
    let shards = Shards::new(plan, exec.graph(), dims, env.rank)?;
    let rank = Rank::new(plan, exec, source, &shards, data, (cfg, opts), env)?;
    let restore = ckpt.resume.map(|l| zero::restored_moments(&rank, l)).transpose()?;
    let mut interp = Interp::new(&rank, restore, ckpt.resume.map(|l| &l.manifest.state))?;
    let trained = drive(&mut interp, cfg.steps, cfg.eval.zip(eval_data), ckpt, obs)?;
    if let Some(save) = final_state {
        save_checkpoint(&interp, save, cfg.steps)?;
    }
    let mut report = report::gather(&rank.groups.world, env.world, trained.steps, &interp.tally, source.bytes_read())?;
    report.eval = trained.evals;
    report.checkpoints = trained.checkpoints;
    report.failed_checkpoints = trained.failed_checkpoints;
    report.stragglers = std::mem::take(&mut interp.stragglers.named);
    Ok(report)
}
