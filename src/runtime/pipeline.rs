//! One rank of a plan: stage subgraphs of the model, the rank's program (forward, backward,
//! weight-gradient, sends, receives, collectives, optimizer step) executed in order, with
//! autograd across stage boundaries, data-parallel gradient sums (bucketed), ZeRO-sharded
//! AdamW and tied-weight gradient sums.
//!
//! The parts: `layout.rs` reads the plan's stage lists on the graph the plan was made for,
//! `rank.rs` sets the rank up from the plan (its codegen section: stage node ids, programs,
//! shards), `interp.rs` executes its program one method per instruction, `zero.rs`
//! holds the ZeRO state and data-parallel synchronisation, `report.rs` gathers what the ranks
//! measured.

use std::time::Duration;

use tch::Tensor;

use super::RuntimeError;
use super::checkpoint::{self, Checkpointing, Loaded, Piece, Role, SaveConfig, Slice};
use super::dist::{DistError, RankEnv};
use super::executor::Executor;
use super::weights::Source;
use super::interp::Interp;
use super::zero::{self, Restore};
use super::rank::{Rank, Shards, check_world};
use super::data::DataSource;
use super::train::{AdamWConfig, EvalConfig, EvalRecord, LossKind, LrSchedule, TrainObserver};
use crate::ir::{DimBindings, ValueId};
use crate::plan::Plan;

pub use super::layout::{REPLAN, StageLayout, codegen_section, planned_graph, rank_programs, stage_layout};
pub use super::rank::rank_weights;
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
    /// Learning rate of each step (its base overrides `adamw.lr`).
    pub schedule: LrSchedule,
    /// Validation.
    pub eval: Option<EvalConfig>,
    /// The run's seed (Dropout masks, with the step, node and sample).
    pub seed: i64,
}

/// Runs this rank's part of `plan` for `cfg.steps` steps on `data` (step k reads its k-th
/// global batch; each replica takes its share, and only ranks whose stages read data read it),
/// validating on `eval_data` as `cfg.eval` says; tells `obs` of each step (with the global
/// loss) and validation as it completes. `exec` runs the graph the plan was made for
/// ([`planned_graph`], whose dim bindings are `dims`).
#[allow(clippy::too_many_arguments)]
pub fn run_rank(
    plan: &Plan,
    exec: &Executor<'_>,
    dims: &DimBindings,
    source: &Source<'_>,
    data: &DataSource,
    eval_data: Option<&DataSource>,
    cfg: &RunConfig,
    env: &RankEnv,
    ckpt: &Checkpointing<'_>,
    obs: &mut dyn TrainObserver,
) -> Result<RankReport, RuntimeError> {
    codegen_section(plan)?;
    check_world(plan, env)?;
    let shards = Shards::new(plan, exec.graph(), dims, env.rank)?;
    let rank = Rank::new(plan, exec, source, &shards, data, cfg, env)?;
    let restore = ckpt.resume.map(|l| restored_moments(&rank, l)).transpose()?;
    let mut interp = Interp::new(&rank, restore)?;
    let mut evals: Vec<EvalRecord> = Vec::new();
    let mut validate = |interp: &mut Interp<'_, '_>, step: usize, obs: &mut dyn TrainObserver| -> Result<(), RuntimeError> {
        if let (Some(e), Some(d)) = (cfg.eval.filter(|e| e.due(step)), eval_data) {
            let rec = EvalRecord { step, loss: interp.run_eval(d, e.batches)? };
            obs.on_eval(&rec);
            evals.push(rec);
        }
        Ok(())
    };
    let start = ckpt.start_step();
    if start == 0 {
        validate(&mut interp, 0, obs)?;
    }
    let mut records = Vec::with_capacity(cfg.steps.saturating_sub(start));
    for step in start + 1..=cfg.steps {
        let rec = interp.run_step(step)?;
        obs.on_step(&rec);
        records.push(rec);
        validate(&mut interp, step, obs)?;
        if let Some(save) = ckpt.save.as_ref().filter(|s| s.due(step)) {
            save_checkpoint(&interp, &rank, env, save, step, obs)?;
        }
    }
    let mut report = super::report::gather(&rank.groups.world, env.world, records, &interp.tally, source.bytes_read())?;
    report.eval = evals;
    Ok(report)
}

/// The rank's part of the AdamW moments of a checkpoint: its tensor-parallel cut of each, and
/// of a stage whose optimizer state is a ZeRO block only that block, read from the pieces
/// holding those elements (never a whole tensor it holds a part of).
fn restored_moments(rank: &Rank<'_>, ckpt: &Loaded) -> Result<Restore, RuntimeError> {
    let ids = rank.param_ids();
    let graph = rank.graph();
    let kind = rank.params.opts.0;
    let blocks = zero::zero_blocks(rank)?;
    let mut in_block = vec![false; ids.len()];
    for (s, b) in blocks.iter().enumerate() {
        if b.is_some() {
            for &i in &rank.params.owned[s] {
                in_block[i] = true;
            }
        }
    }
    let read = |v: ValueId, role: Role, part: &Slice| -> Result<Tensor, RuntimeError> {
        let dims = graph.value(v).data.as_ref().map(|d| d.dims.clone()).unwrap_or_default();
        Ok(ckpt.read_part(&checkpoint::param_name(graph, v), role, &dims, part)?.f_to_kind(kind)?)
    };
    let (mut exp_avg, mut exp_avg_sq) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
    for (&v, &blocked) in ids.iter().zip(&in_block) {
        if blocked {
            exp_avg.push(None);
            exp_avg_sq.push(None);
        } else {
            let part = rank.part_of(v);
            exp_avg.push(Some(read(v, Role::ExpAvg, &part)?));
            exp_avg_sq.push(Some(read(v, Role::ExpAvgSq, &part)?));
        }
    }
    let blocks = blocks
        .iter()
        .enumerate()
        .map(|(s, b)| {
            b.map(|(parts, index)| {
                Ok((
                    rank.read_block_with(s, parts, index, |v, part| read(v, Role::ExpAvg, part))?,
                    rank.read_block_with(s, parts, index, |v, part| read(v, Role::ExpAvgSq, part))?,
                ))
            })
            .transpose()
        })
        .collect::<Result<_, RuntimeError>>()?;
    Ok(Restore { step: ckpt.manifest.state.adamw_step, exp_avg, exp_avg_sq, blocks })
}

/// Writes this rank's shard of the checkpoint after `step`; rank 0 writes the manifest once
/// every rank has written its shard.
fn save_checkpoint(interp: &Interp<'_, '_>, rank: &Rank<'_>, env: &RankEnv, save: &SaveConfig, step: usize, obs: &mut dyn TrainObserver) -> Result<(), RuntimeError> {
    let dir = checkpoint::step_dir(&save.root, step);
    let world = &rank.groups.world;
    if env.rank == 0 {
        checkpoint::begin(&dir)?;
    }
    world.barrier()?;
    let graph = rank.graph();
    let ids = rank.param_ids();
    let mut pieces = Vec::new();
    for lp in interp.checkpoint_pieces()? {
        let v = ids[lp.pos];
        let val = graph.value(v);
        let shape = val.data.as_ref().map(|d| d.dims.clone()).ok_or_else(|| terr(format!("parameter `{}` has no data to checkpoint", val.name)))?;
        let (axis, ranges) = match rank.slices.get(&val.name) {
            Some(sl) => (Some(sl.axis), sl.ranges.clone()),
            None => (None, Vec::new()),
        };
        pieces.push(Piece {
            name: checkpoint::param_name(graph, v),
            role: lp.role,
            shape,
            transposed: checkpoint::is_transposed(graph, v),
            slice: Slice { axis, ranges, flat: lp.flat },
            tensor: lp.tensor,
        });
    }
    pieces.extend(checkpoint::buffer_pieces(graph, |v| rank.live_buffer(v))?);
    checkpoint::write_shard(&dir, env.rank, &pieces)?;
    checkpoint::fault_point(env.rank, step);
    world.barrier()?;
    if env.rank == 0 {
        let manifest = checkpoint::write_manifest(&dir, save.state(step, env.world))?;
        if let Some(k) = save.keep {
            checkpoint::prune(&save.root, k)?;
        }
        obs.on_checkpoint(step, &manifest);
    }
    Ok(())
}
