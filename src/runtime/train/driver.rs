//! The one training loop of every run: validation, steps, checkpoints and progress, around a
//! [`StepRunner`] that runs one step (a single process without a plan, or one rank of a plan).

use std::path::PathBuf;

use super::amp::{Autocast, LossScaleConfig};
use crate::runtime::state::checkpoint::LossScaleState;
use super::loss::LossKind;
use super::optim::{AdamWConfig, LrSchedule};
use super::records::{EvalConfig, EvalRecord, StepRecord, TrainObserver};
use crate::runtime::RuntimeError;
use crate::runtime::data::DataSource;
use crate::runtime::heartbeat::{self, Phase};
use crate::runtime::state::checkpoint::{self, Checkpointing, OnCheckpointError, Piece, SaveConfig};

/// Settings of a training run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Microbatches per step (the global batch is split along axis 0).
    pub microbatches: usize,
    /// What is minimised.
    pub loss: LossKind,
    /// Optimizer settings.
    pub adamw: AdamWConfig,
    /// Global gradient-norm limit (`None`: no clipping).
    pub clip: Option<f64>,
    /// Learning rate of each step (its base overrides `adamw.lr`).
    pub schedule: LrSchedule,
    /// Validation, with its data.
    pub eval: Option<EvalConfig>,
    /// The run's seed (Dropout masks, with the step, node and sample).
    pub seed: i64,
    /// Mixed precision: the low type matrix products compute in (`None`: one type throughout).
    pub autocast: Option<Autocast>,
    /// The loss scale of an fp16 run (used only when `autocast` scales the loss).
    pub loss_scale: LossScaleConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        let adamw = AdamWConfig::default();
        TrainConfig { steps: 10, microbatches: 1, loss: LossKind::CausalLm, adamw, clip: Some(1.0), schedule: LrSchedule::constant(adamw.lr), eval: None, seed: 0, autocast: None, loss_scale: LossScaleConfig::default() }
    }
}


/// One training step, however the run executes it: the single-process trainer
/// ([`super::single::SingleProcess`]) or a rank's program interpreter.
pub trait StepRunner {
    /// Runs step `step` (from 1: it reads the step-th global batch): forward, backward and the
    /// optimizer update. Its record's loss is the global batch's mean.
    fn run_step(&mut self, step: usize) -> Result<StepRecord, RuntimeError>;
    /// The mean loss over `batches` global batches of `data`, forward only (the same on every
    /// rank).
    fn run_eval(&mut self, data: &DataSource, batches: usize) -> Result<f64, RuntimeError>;
    /// What this process writes into a checkpoint between steps: its parameters, their AdamW
    /// moments and the module buffers it holds the live copy of, each with its slice.
    fn checkpoint_pieces(&self) -> Result<Vec<Piece>, RuntimeError>;
    /// This process's rank (its checkpoint shard's index; rank 0 writes the manifest).
    fn rank(&self) -> usize;
    /// Ranks in the run.
    fn world(&self) -> usize;
    /// Waits until every rank has reached this point (nothing to wait for alone).
    fn barrier(&self) -> Result<(), RuntimeError>;
    /// Whether every rank says `ok` (a collective: every rank calls it, and all get the same
    /// answer).
    fn agree(&self, ok: bool) -> Result<bool, RuntimeError>;
    /// Ranks that must leave the job after the step just run (a straggler dropped under
    /// `launch --elastic --drop-stragglers`): the same answer on every rank.
    fn leaving(&self) -> Option<Leave> {
        None
    }
    /// What the optimizer has done after step `step`, for a checkpoint's manifest: an update
    /// per step, unless fp16 loss scaling skipped some.
    fn optimizer_progress(&self, step: usize) -> OptimizerProgress {
        OptimizerProgress { adamw_steps: step, loss_scale: None }
    }
}

/// Ranks leaving the job: every rank ends the run after a checkpoint of the step, and the
/// launcher plans the job again without them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leave {
    /// The global ranks that leave.
    pub ranks: Vec<usize>,
    /// Why, in words.
    pub why: String,
    /// The step after which they leave.
    pub step: usize,
}

/// What the optimizer has done, as a checkpoint records it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerProgress {
    /// AdamW updates taken (steps skipped on inf/NaN take none).
    pub adamw_steps: usize,
    /// The loss scale of an fp16 run.
    pub loss_scale: Option<LossScaleState>,
}

/// A checkpoint a run completed (the `--json` report's `checkpoints` entries).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CheckpointRecord {
    /// The step after which it was written.
    pub step: usize,
    /// Its manifest, written last.
    pub manifest: PathBuf,
}

/// What a run's loop did.
#[derive(Clone, Debug, Default)]
pub struct Trained {
    /// One record per step run.
    pub steps: Vec<StepRecord>,
    /// One record per validation.
    pub evals: Vec<EvalRecord>,
    /// Checkpoints completed (on rank 0, which writes the manifests; empty elsewhere).
    pub checkpoints: Vec<CheckpointRecord>,
    /// Checkpoints that could not be written, with why (`--on-checkpoint-error continue`).
    pub failed_checkpoints: Vec<FailedCheckpoint>,
}

/// A checkpoint the run went on without (the `--json` report's `failed_checkpoints`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FailedCheckpoint {
    /// The step after which it was to be written.
    pub step: usize,
    /// Why it was not (as this rank knows it).
    pub error: String,
}

/// The training loop: validates before the first step (unless resuming), then runs steps
/// `ckpt.start_step() + 1 ..= steps`, validating on `eval` as its config says and writing
/// checkpoints as `ckpt.save` says after each, telling `obs` of everything as it completes.
pub fn drive(
    runner: &mut dyn StepRunner,
    steps: usize,
    eval: Option<(EvalConfig, &DataSource)>,
    ckpt: &Checkpointing<'_>,
    obs: &mut dyn TrainObserver,
) -> Result<Trained, RuntimeError> {
    let mut out = Trained::default();
    let validate = |runner: &mut dyn StepRunner, step: usize, out: &mut Trained, obs: &mut dyn TrainObserver| -> Result<(), RuntimeError> {
        if let Some((e, data)) = eval.filter(|(e, _)| e.due(step)) {
            heartbeat::set_phase(Phase::Eval(step));
            let rec = EvalRecord { step, loss: runner.run_eval(data, e.batches)? };
            obs.on_eval(&rec);
            out.evals.push(rec);
        }
        Ok(())
    };
    let start = ckpt.start_step();
    if start == 0 {
        validate(runner, 0, &mut out, obs)?;
    }
    out.steps.reserve(steps.saturating_sub(start));
    for step in start + 1..=steps {
        heartbeat::set_phase(Phase::Step(step));
        // a rank ending on an error is not stuck in its step
        let rec = runner.run_step(step).inspect_err(|_| heartbeat::set_phase(Phase::Finish))?;
        if step == start + 1 {
            heartbeat::first_step_done();
        }
        obs.on_step(&rec);
        out.steps.push(rec);
        validate(runner, step, &mut out, obs)?;
        if let Some(save) = ckpt.save.as_ref().filter(|s| s.due(step)) {
            heartbeat::set_phase(Phase::Checkpoint(step));
            match save_checkpoint(runner, save, step) {
                Ok(Some(done)) => {
                    obs.on_checkpoint(done.step, &done.manifest);
                    out.checkpoints.push(done);
                }
                Ok(None) => {}
                // every rank agreed the checkpoint failed, so every rank goes on (or stops) alike
                Err(e @ RuntimeError::CheckpointNotWritten { .. }) if save.on_error == OnCheckpointError::Continue => {
                    obs.on_checkpoint_failed(step, &e.to_string());
                    out.failed_checkpoints.push(FailedCheckpoint { step, error: e.to_string() });
                }
                Err(e) => {
                    heartbeat::set_phase(Phase::Finish);
                    return Err(e);
                }
            }
        }
        if let Some(leave) = runner.leaving() {
            // the job goes on without them from this step: its checkpoint first, if the run keeps any
            if let Some(save) = ckpt.save.as_ref().filter(|s| !s.due(step)) {
                heartbeat::set_phase(Phase::Checkpoint(step));
                if let Some(done) = save_checkpoint(runner, save, step)? {
                    obs.on_checkpoint(done.step, &done.manifest);
                }
            }
            return Err(RuntimeError::Leave { leaving: leave.ranks.contains(&runner.rank()), ranks: leave.ranks, why: leave.why, step });
        }
    }
    heartbeat::set_phase(Phase::Finish);
    Ok(out)
}

/// Writes the checkpoint of step `step`: rank 0 opens its directory, every rank writes its
/// shard, and once all have, rank 0 writes the manifest (so a checkpoint without one is never
/// read) and prunes old ones. Returns the record on rank 0. The ranks agree on each of the
/// three: when any fails (a full disk, a missing directory), every rank returns
/// [`RuntimeError::CheckpointNotWritten`] at the same point, none waits for a manifest that will
/// not come, and rank 0 removes the partial directory.
pub fn save_checkpoint(runner: &dyn StepRunner, save: &SaveConfig, step: usize) -> Result<Option<CheckpointRecord>, RuntimeError> {
    let (rank, world) = (runner.rank(), runner.world());
    let dir = checkpoint::step_dir(&save.root, step);
    let not_written = |mine: Option<RuntimeError>, what: &str| {
        if rank == 0 {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let message = match mine {
            Some(e) => e.to_string(),
            None => format!("{what} (see that rank's error)"),
        };
        RuntimeError::CheckpointNotWritten { step, message }
    };
    let began = if rank == 0 { checkpoint::begin(&dir) } else { Ok(()) };
    if !runner.agree(began.is_ok())? {
        return Err(not_written(began.err(), "rank 0 could not create the checkpoint's directory"));
    }
    let wrote = runner.checkpoint_pieces().and_then(|pieces| checkpoint::write_shard(&dir, rank, &pieces));
    checkpoint::fault_point(rank, step);
    if !runner.agree(wrote.is_ok())? {
        return Err(not_written(wrote.err(), "another rank could not write its shard"));
    }
    let manifest = if rank == 0 {
        let mut state = save.state(step, world);
        let progress = runner.optimizer_progress(step);
        state.adamw_step = progress.adamw_steps;
        state.loss_scale = progress.loss_scale;
        checkpoint::write_manifest(&dir, state).map(Some)
    } else {
        Ok(None)
    };
    if !runner.agree(manifest.is_ok())? {
        return Err(not_written(manifest.err(), "rank 0 could not write the manifest"));
    }
    let Ok(Some(manifest)) = manifest else { return Ok(None) };
    if let Some(k) = save.keep {
        // past the commit point: a checkpoint left unpruned costs space, never correctness
        if let Err(e) = checkpoint::prune(&save.root, k) {
            tracing::warn!("keeping old checkpoints: {e}");
        }
    }
    Ok(Some(CheckpointRecord { step, manifest }))
}
