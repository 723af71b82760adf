//! The run front door, as `compile()` is for planning: [`RunSession::open`] takes a model or a
//! plan with the user's [`RunOptions`] and makes every check a run needs before it starts (the
//! plan against its model file, sequence length and parameter patterns, the rank count, the
//! checkpoint to resume against the run); [`RunSession::run`] trains in the one training loop
//! (one process, or this rank of a plan), keeps the final weights where asked, and returns the
//! one [`RunReport`]. `commands` holds the runner's other jobs (evaluate, export).

pub mod commands;
mod error;
pub mod options;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::frontend::onnx::load_model;
use crate::ir::Graph;
use crate::passes::params;
use crate::plan::Plan;
use crate::runtime::comm::RankEnv;
use crate::runtime::device::{Placement, Ranks};
use crate::runtime::data::{self, DataSource, Order};
use crate::runtime::kernels::executor::{self, ExecOptions, Executor};
use crate::runtime::rank::{self, RankOptions, RankRun, peak_rss_bytes};
use crate::runtime::state::checkpoint::{self, Checkpointing, Loaded, SaveConfig};
use crate::runtime::state::export;
use crate::runtime::state::weights::Source;
use crate::runtime::train::{self, LossKind, TrainConfig, TrainObserver, mean_step_time};
use crate::runtime::{RuntimeError, Weights};

pub use error::SessionError;
pub use options::{CheckpointOptions, DataOptions, FloatType, InitChoice, OnCheckpointError, OptimizerOptions, ParamOptions, RunOptions};
pub use report::{MembershipChange, RESTARTS_ENV, RankDetail, RankEntry, RestartRecord, RunReport, restarts_from_env};

/// What a run executes.
#[derive(Clone, Debug)]
pub enum RunTarget {
    /// An ONNX model, on one process without a plan (`smp-runner train`).
    Model(PathBuf),
    /// A plan: this rank of it (`smp-runner run`, started by `launch` or torchrun), or the
    /// whole of a one-rank plan.
    Plan(PathBuf),
}

/// A plan's run: the plan, with what was read alongside it.
struct PlanRun {
    plan: Plan,
    path: PathBuf,
    /// This process's place in the world (none for a one-rank plan run alone).
    env: Option<RankEnv>,
}

/// A run, checked and ready to train.
pub struct RunSession {
    opts: RunOptions,
    /// The model file.
    model: PathBuf,
    /// Its graph with the trained parameters decided; for a plan, the graph the plan was made
    /// for ([`rank::planned_graph`]) once the session runs.
    graph: Graph,
    sha256: String,
    /// The sequence length of token windows and synthetic data.
    seq_len: i64,
    plan: Option<PlanRun>,
    save: Option<SaveConfig>,
    resume: Option<Loaded>,
    notes: Vec<String>,
    /// Where the run's tensors live and how its ranks talk.
    placement: Placement,
}

fn plan_err(path: &Path, e: impl std::fmt::Display) -> SessionError {
    SessionError::Plan(format!("plan `{}`: {e}", path.display()))
}

impl RunSession {
    /// Checks `target` and `opts` for a run: every refusal a run can meet before its first
    /// step happens here.
    pub fn open(target: RunTarget, opts: RunOptions) -> Result<RunSession, SessionError> {
        opts.check()?;
        match target {
            RunTarget::Model(model) => Self::open_model(model, opts),
            RunTarget::Plan(path) => Self::open_plan(path, opts),
        }
    }

    fn open_model(model: PathBuf, mut opts: RunOptions) -> Result<RunSession, SessionError> {
        if let Some(precision) = opts.precision {
            // without a plan, --precision says what a plan's parallel.precision would
            let dtype = match opts.dtype {
                Some(FloatType::F64) => FloatType::F64,
                Some(d) => {
                    return Err(SessionError::Options(format!("--dtype {d} and --precision {precision} both set the run's type: give one (--dtype f64 alone may verify a precision)")));
                }
                None if precision == crate::ir::Precision::Bf16 => FloatType::Bf16,
                None => FloatType::F32,
            };
            opts.dtype = Some(dtype);
            opts.autocast = if dtype == FloatType::F64 { None } else { crate::runtime::train::Autocast::of(precision) };
        }
        check_loss_scale(&opts, &format!("this run of `{}`", model.display()))?;
        let imported = load_model(&model).map_err(|e| SessionError::Model(format!("cannot load model `{}`: {e}", model.display())))?;
        let params = opts.params.clone();
        let mut notes = Vec::new();
        let (graph, sha256) = decided(imported.graph, imported.sha256, &model, &params, Some(&mut notes))?;
        let seq_len = opts.seq_len.unwrap_or(options::DEFAULT_SEQ_LEN);
        let placement = place(&opts, Ranks::single(), &mut notes)?;
        let mut s = RunSession { opts, model, graph, sha256, seq_len, plan: None, save: None, resume: None, notes, placement };
        s.checkpointing(None, "train".into())?;
        Ok(s)
    }

    fn open_plan(path: PathBuf, opts: RunOptions) -> Result<RunSession, SessionError> {
        // signs of life for the launcher from the start (loading counts against start-up's timeout)
        crate::runtime::heartbeat::start_from_env();
        let plan = crate::plan::load(&path).map_err(|e| SessionError::Plan(e.to_string()))?;
        let bytes = std::fs::read(&path).map_err(|e| SessionError::Plan(format!("cannot read plan `{}`: {e}", path.display())))?;
        let plan_hash = sha256_hex(&bytes);
        rank::codegen_section(&plan).map_err(|e| plan_err(&path, e))?;
        if plan.parallel.experts_folded() && plan.parallel.etp > 1 {
            let p = &plan.parallel;
            return Err(plan_err(
                &path,
                format!(
                    "its expert groups fold over tensor × data ranks with each expert split over {} of the {} tensor ranks (etp {}), which smp-runner does not execute: it folds them with whole experts (etp 1) or splits every expert over all tensor ranks (etp = tp); re-plan with --etp 1 or --etp {}",
                    p.etp, p.tp, p.etp, p.tp
                ),
            ));
        }
        let params = plan_params(&plan, &opts.params, &path)?;
        // the plan's precision, or the `--dtype f64` verification override
        let dtype = FloatType::for_plan(plan.parallel.precision, opts.dtype, &path).map_err(SessionError::Options)?;
        let p = &plan.parallel;
        let world = plan_world(&plan);
        let env = RankEnv::from_env().map_err(RuntimeError::from)?;
        // first: libtorch keeps its first answer about CUDA
        let ranks = env.as_ref().map_or(Ranks::single(), |e| Ranks::on_host(e.local_rank, e.world));
        let mut device_notes = Vec::new();
        let placement = place(&opts, ranks, &mut device_notes)?;
        if world != 1 && env.is_none() {
            return Err(SessionError::Plan(format!(
                "plan `{}` needs {world} ranks (pp={} tp={} cp={} dp={}); start it with `smp-runner launch --nproc {world} {}` or torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT",
                path.display(),
                p.pp,
                p.tp,
                p.cp,
                p.dp,
                path.display()
            )));
        }
        let model = plan.model_file(&path);
        let imported = load_model(&model).map_err(|e| SessionError::Model(format!("model `{}` of plan `{}`: {e}", model.display(), path.display())))?;
        if imported.sha256 != plan.model.sha256 {
            return Err(SessionError::Plan(format!(
                "model `{}` is not the one plan `{}` was made for (sha256 differs); re-plan with smp-partition",
                model.display(),
                path.display()
            )));
        }
        let seq_len = match (plan.seq_len, opts.seq_len) {
            (Some(p), Some(s)) if p as i64 != s => {
                return Err(SessionError::Options(format!(
                    "--seq-len {s} disagrees with plan `{}`, made for sequence length {p}; drop --seq-len, or re-plan with `smp-partition … --seq-len {s}`",
                    path.display()
                )));
            }
            (Some(p), _) => p as i64,
            (None, s) => s.unwrap_or(options::DEFAULT_SEQ_LEN),
        };
        // a multi-rank plan's ranks would all say the same: rank 0 speaks
        let speaks = env.as_ref().is_none_or(|e| e.rank == 0);
        let mut notes = if speaks { device_notes } else { Vec::new() };
        let (graph, sha256) = decided(imported.graph, imported.sha256, &model, &params, speaks.then_some(&mut notes))?;
        if let Some(w) = plan.batch_statistics_warning().filter(|_| speaks) {
            notes.push(format!("warning: {w}"));
        }
        let mesh = format!("pp{} dp{} tp{} zero{}", p.pp, p.dp, p.tp, p.zero);
        if let Some(asked) = opts.precision.filter(|&p| p != plan.parallel.precision) {
            return Err(SessionError::Options(format!(
                "--precision {asked} contradicts plan `{}`, made for {} precision (parallel.precision); drop --precision, or re-plan with `smp-partition … --precision {asked}`",
                path.display(),
                plan.parallel.precision
            )));
        }
        // mixed precision: fp32 masters under autocast, unless `--dtype f64` verifies the plan
        let autocast = if dtype == FloatType::F64 { None } else { crate::runtime::train::Autocast::of(plan.parallel.precision) };
        let run_opts = RunOptions { params, dtype: Some(dtype), autocast, precision: Some(plan.parallel.precision), ..opts };
        check_loss_scale(&run_opts, &format!("plan `{}`", path.display()))?;
        let mut s = RunSession { opts: run_opts, model, graph, sha256, seq_len, plan: None, save: None, resume: None, notes, placement };
        s.checkpointing(Some(plan_hash.clone()), mesh.clone())?;
        if let Some(l) = s.resume.as_ref().filter(|l| l.manifest.state.plan_hash.as_deref() != Some(plan_hash.as_str()) && speaks) {
            s.notes.push(format!("resharding checkpoint `{}` ({}, {} ranks) to this plan ({mesh})", l.dir.display(), l.manifest.state.mesh, l.manifest.state.world));
        }
        s.plan = Some(PlanRun { plan, path, env });
        Ok(s)
    }

    /// Where checkpoints go (with what their manifests record of this run) and the checkpoint
    /// to resume, checked against the model, patterns, seed and steps.
    fn checkpointing(&mut self, plan_hash: Option<String>, mesh: String) -> Result<(), SessionError> {
        let o = &self.opts;
        self.save = o.checkpoints.dir.as_ref().map(|root| SaveConfig {
            root: root.clone(),
            every: o.checkpoints.every.unwrap_or(o.steps.max(1)),
            keep: o.checkpoints.keep,
            seed: o.seed,
            plan_hash,
            mesh,
            model_sha256: self.sha256.clone(),
            params: o.params.clone(),
            model_path: std::fs::canonicalize(&self.model).unwrap_or_else(|_| self.model.clone()).display().to_string(),
            on_error: o.checkpoints.on_error,
        });
        if let Some(path) = &o.checkpoints.resume {
            let l = Loaded::open(path)?;
            l.check_resumable(&self.sha256, &o.params, o.seed, o.steps)?;
            self.resume = Some(l);
        }
        Ok(())
    }

    /// What the session has to say before the run (what is trained, resharding, statistics
    /// BatchNorm computes per microbatch), one line each.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Steps of the whole run and tokens of one global batch, for progress displays.
    pub fn steps(&self) -> usize {
        self.opts.steps
    }

    /// Whether this process reports the run (a plan's rank 0, or a single process).
    pub fn reports(&self) -> bool {
        self.plan.as_ref().and_then(|p| p.env.as_ref()).is_none_or(|e| e.rank == 0)
    }

    /// Trains: steps, validation and checkpoints as asked, telling `obs` as they complete;
    /// then the final weights where `--save-weights` asks. The report is complete on the
    /// process that [`reports`](Self::reports).
    pub fn run(mut self, obs: &mut dyn TrainObserver) -> Result<RunReport, SessionError> {
        if let Some(n) = self.opts.threads {
            crate::runtime::kernels::set_threads(n);
        }
        match self.plan.take() {
            // a plan of several ranks, or one rank started among several
            Some(PlanRun { plan, path, env: Some(env) }) if env.world > 1 || plan_world(&plan) > 1 => {
                let _ = path;
                self.run_rank(&plan, &env, obs)
            }
            single => self.run_single(single.as_ref(), obs),
        }
    }

    fn run_single(mut self, plan: Option<&PlanRun>, obs: &mut dyn TrainObserver) -> Result<RunReport, SessionError> {
        let model = self.model.clone();
        let mut graph = std::mem::take(&mut self.graph);
        let (batch, microbatches, predicted) = match plan {
            Some(p) => {
                // the graph the plan was made for, as a rank of a larger plan runs it
                graph = rank::planned_graph(&p.plan, graph).map(|(g, _)| g).map_err(|e| SessionError::Model(format!("model `{}` of plan `{}`: {e}", model.display(), p.path.display())))?;
                (p.plan.global_batch as i64, p.plan.parallel.microbatches.max(1), Some(p.plan.predicted.step_time_s))
            }
            None => {
                self.rebind_fixed_batch(&mut graph)?;
                fuse_chains(&mut graph);
                (self.opts.batch, self.opts.microbatches, None)
            }
        };
        let o = &self.opts;
        let float_kind = Some(o.float_type().kind());
        executor::check_supported(&graph).map_err(|e| SessionError::Model(format!("model `{}`: {e}", model.display())))?;
        let mut weights = Weights::load(&graph, o.init_mode(), float_kind)?;
        if let Some(l) = &self.resume {
            checkpoint::restore_params(l, &graph, &mut weights.tensors)?;
        }
        let exec = Executor::new_on(&graph, weights, ExecOptions { float_kind, training: true, autocast: o.autocast.map(|a| a.kind()) }, self.placement.device)?;
        let cfg = self.train_config(&graph, microbatches);
        let (data, eval_data) = open_data(&exec, o, self.seq_len, batch, cfg.loss)?;
        let ckpt = Checkpointing { save: self.save.take(), resume: self.resume.as_ref() };
        obs.on_start(data.tokens_per_batch());
        let t0 = Instant::now();
        let trained = train::train_with(&exec, &data, eval_data.as_ref(), &cfg, &ckpt, obs).map_err(SessionError::during_training)?;
        let wall_s = t0.elapsed().as_secs_f64();
        let saved_weights = match &o.save_weights {
            Some(path) => Some(export::write_module_tensors(&exec, path).map_err(SessionError::Interrupted)?),
            None => None,
        };
        let step_time = mean_step_time(&trained.steps);
        Ok(RunReport {
            samples_per_s: if step_time > 0.0 { data.global_batch() as f64 / step_time } else { 0.0 },
            measured_step_time_s: step_time,
            predicted_step_time_s: predicted,
            wall_s,
            ranks: vec![RankEntry { rank: 0, step_time_s: step_time, peak_memory_bytes: peak_rss_bytes(), detail: None }],
            eval: trained.evals,
            checkpoints: trained.checkpoints,
            failed_checkpoints: trained.failed_checkpoints,
            resumed_from: self.resume.as_ref().map(|l| l.dir.display().to_string()),
            restarts: report::restarts_with_first_step(crate::runtime::heartbeat::first_step_at()),
            stragglers: Vec::new(),
            saved_weights: saved_weights.map(|p| p.display().to_string()),
            steps: trained.steps,
        })
    }

    fn run_rank(mut self, plan: &Plan, env: &RankEnv, obs: &mut dyn TrainObserver) -> Result<RunReport, SessionError> {
        // before any weight is read, so the parameters and constants count among the tensors
        // the rank holds
        rank::install_memory_counter();
        let model = self.model.clone();
        let in_rank = |e: RuntimeError| match e {
            e @ (RuntimeError::CheckpointNotWritten { .. } | RuntimeError::File { .. } | RuntimeError::Input { .. } | RuntimeError::Leave { .. } | RuntimeError::PortInUse { .. }) => {
                SessionError::during_training(e)
            }
            e => SessionError::Interrupted(RuntimeError::Train(format!("rank {} of {}: {e}", env.rank, env.world))),
        };
        // the graph the plan was made for: specialised as the planner did, the plan's fused
        // ops applied, its fixed batch rebound
        let (graph, dims) = rank::planned_graph(plan, std::mem::take(&mut self.graph)).map_err(|e| SessionError::Model(format!("model `{}`: {e}", model.display())))?;
        let o = &self.opts;
        let float_kind = Some(o.float_type().kind());
        // only the parts of weights this rank holds are read (from the model file, its
        // external data or the checkpoint), when its stages and shards are set up
        let mut source = Source::new(&graph, o.init_mode(), float_kind).on(self.placement.device);
        if let Some(l) = &self.resume {
            source = source.with_checkpoint(l);
        }
        let weights = rank::rank_weights(plan, &source, env.rank)?;
        let exec = Executor::new_on(&graph, weights, ExecOptions { float_kind, training: true, autocast: o.autocast.map(|a| a.kind()) }, self.placement.device)?;
        let cfg = self.train_config(&graph, plan.parallel.microbatches.max(1));
        if plan.parallel.cp > 1 && !cfg.loss.per_token() {
            return Err(SessionError::Options(format!(
                "plan `{}` splits each sequence over {} context ranks, but the {:?} loss is not a sum over tokens; pass --loss causal-lm or --loss cross-entropy with per-token labels, or re-plan with --cp 1",
                plan.model.path,
                plan.parallel.cp,
                cfg.loss
            )));
        }
        let (data, eval_data) = open_data(&exec, o, self.seq_len, plan.global_batch as i64, cfg.loss)?;
        let stragglers = rank::StragglerOptions {
            factor: o.straggler_factor,
            window: o.straggler_window,
            drop_after: std::env::var(rank::DROP_STRAGGLERS_ENV).ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0),
        };
        let rank_opts = RankOptions { timeout: o.timeout, bucket_bytes: 25 << 20, progress: o.progress, backend: self.placement.backend, stragglers };
        // the final weights are the last step's state, gathered as a checkpoint: the run's own
        // if its last step writes one, else one in a scratch directory beside the output
        let last = self.save.as_ref().is_some_and(|s| s.due(o.steps));
        let scratch = o.save_weights.as_ref().filter(|_| !last).map(|w| scratch_dir(w));
        let final_state = scratch.as_ref().map(|root| SaveConfig { root: root.clone(), every: o.steps.max(1), keep: None, ..self.final_save_config(plan) });
        let ckpt = Checkpointing { save: self.save.clone(), resume: self.resume.as_ref() };
        obs.on_start(data.tokens_per_batch());
        let t0 = Instant::now();
        let run = RankRun { plan, exec: &exec, dims: &dims, source: &source, data: &data, eval_data: eval_data.as_ref(), cfg: &cfg, opts: &rank_opts, env, ckpt: &ckpt, final_state: final_state.as_ref() };
        let report = rank::run_rank(&run, obs).map_err(in_rank)?;
        let wall_s = t0.elapsed().as_secs_f64();
        let step_time = report.ranks.iter().map(|r| r.step_time_s).fold(0.0, f64::max);
        let mut saved_weights = None;
        if let (Some(out), 0) = (&o.save_weights, env.rank) {
            let root = scratch.clone().or_else(|| self.save.as_ref().map(|s| s.root.clone()));
            if let Some(root) = root {
                let written = self.write_final_weights(&checkpoint::step_dir(&root, o.steps), out);
                if let Some(dir) = &scratch {
                    let _ = std::fs::remove_dir_all(dir);
                }
                saved_weights = Some(written.map_err(|e| match e {
                    SessionError::Runtime(e) => SessionError::Interrupted(e),
                    e => e,
                })?.display().to_string());
            }
        }
        let mesh = plan.mesh();
        Ok(RunReport {
            samples_per_s: if step_time > 0.0 { data.global_batch() as f64 / step_time } else { 0.0 },
            measured_step_time_s: step_time,
            predicted_step_time_s: Some(plan.predicted.step_time_s),
            wall_s,
            ranks: report
                .ranks
                .iter()
                .enumerate()
                .map(|(r, st)| {
                    let predicted = mesh.coord(r).map(|c| report::MemoryEntry::predicted(plan, c.pp));
                    RankEntry { rank: r, step_time_s: st.step_time_s, peak_memory_bytes: st.peak_rss_bytes, detail: Some(RankDetail::of(st, predicted)) }
                })
                .collect(),
            eval: report.eval,
            checkpoints: report.checkpoints,
            failed_checkpoints: report.failed_checkpoints,
            resumed_from: self.resume.as_ref().map(|l| l.dir.display().to_string()),
            restarts: report::restarts_with_first_step(crate::runtime::heartbeat::first_step_at()),
            stragglers: report.stragglers,
            saved_weights,
            steps: report.steps,
        })
    }

    /// The save settings of a final-state checkpoint: the run's own, or those the run would
    /// write with a checkpoint directory.
    fn final_save_config(&self, plan: &Plan) -> SaveConfig {
        self.save.clone().unwrap_or_else(|| {
            let p = &plan.parallel;
            SaveConfig {
                root: PathBuf::new(),
                every: self.opts.steps.max(1),
                keep: None,
                seed: self.opts.seed,
                plan_hash: None,
                mesh: format!("pp{} dp{} tp{} zero{}", p.pp, p.dp, p.tp, p.zero),
                model_sha256: self.sha256.clone(),
                params: self.opts.params.clone(),
                model_path: self.model.display().to_string(),
                on_error: OnCheckpointError::Stop,
            }
        })
    }

    /// Writes the module tensors of the checkpoint in `dir` to `out` (rank 0, after the run).
    fn write_final_weights(&self, dir: &Path, out: &Path) -> Result<PathBuf, SessionError> {
        let l = Loaded::open(dir)?;
        let imported = load_model(&self.model).map_err(|e| SessionError::Model(format!("cannot load model `{}`: {e}", self.model.display())))?;
        let (graph, _) = decided(imported.graph, imported.sha256, &self.model, &self.opts.params, None)?;
        // the weights as the run trained them (an f64 run's in f64)
        let exec = export::trained_executor_in(&l, &graph, Some(self.opts.float_type().kind()))?;
        Ok(export::write_module_tensors(&exec, out)?)
    }

    /// The training settings of this run on `graph`.
    fn train_config(&self, graph: &Graph, microbatches: usize) -> TrainConfig {
        let o = &self.opts;
        TrainConfig {
            steps: o.steps,
            microbatches,
            loss: o.loss.unwrap_or_else(|| LossKind::infer(graph)),
            adamw: o.adamw(),
            clip: o.clip(),
            schedule: o.schedule(),
            eval: o.eval(),
            seed: o.seed,
            autocast: o.autocast,
            loss_scale: o.loss_scale,
        }
    }

    /// A model whose batch is fixed runs the microbatch size asked (the data's batch, split):
    /// its graph is rewritten where the rewrite is proven (`codegen::rebatch`), else refused.
    fn rebind_fixed_batch(&self, graph: &mut Graph) -> Result<(), SessionError> {
        let Some(fixed) = crate::codegen::rebatch::fixed_batch(graph) else { return Ok(()) };
        let o = &self.opts;
        let (global, seq) = match &o.data.train {
            Some(path) if !data::is_token_file(path) => {
                let size = crate::runtime::formats::npz::read_npz(path)?.first().map(|(_, t)| t.size()).unwrap_or_default();
                (size.first().copied().unwrap_or(o.batch), size.get(1).copied().unwrap_or(self.seq_len))
            }
            _ => (o.batch, self.seq_len),
        };
        let b = global / o.microbatches.max(1) as i64;
        if b == fixed || b <= 0 {
            return Ok(());
        }
        // a symbolic sequence (fixed batch) is bound to the data's
        let symbolic_seq = graph
            .inputs
            .first()
            .and_then(|&v| graph.value(v).ty.as_ref())
            .and_then(|t| t.shape.as_ref())
            .is_some_and(|s| matches!(s.0.get(1), Some(crate::ir::Dim::Sym(_))));
        let done = crate::codegen::rebatch::rebind_unplanned(graph, b, symbolic_seq.then_some(seq)).map_err(|e| SessionError::Model(format!("model `{}`: {e}", self.model.display())))?;
        if let Some(r) = done {
            tracing::info!(from = r.from, to = r.to, shape_constants = r.shape_constants.len(), constants = r.constants.len(), "fixed batch rebound");
        }
        Ok(())
    }
}

/// Where a run at `ranks` places its tensors (`--device`, `--share-gpu`), with a note of it
/// when that is a GPU.
fn place(opts: &RunOptions, ranks: Ranks, notes: &mut Vec<String>) -> Result<Placement, SessionError> {
    let p = opts.device.place(ranks).map_err(|e| SessionError::Options(e.to_string()))?;
    if p.is_cuda() {
        notes.push(p.describe());
    }
    Ok(p)
}

/// Ranks of `plan`.
fn plan_world(plan: &Plan) -> usize {
    plan.parallel.devices()
}

/// A scratch checkpoint directory for the final weights beside `out`.
fn scratch_dir(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    out.with_file_name(format!(".{name}.final-state"))
}

/// What a run of `plan` trains: the plan's `--trainable`/`--frozen` patterns. The run's own
/// patterns must be absent or the same, since the plan's memory and programs assume its.
fn plan_params(plan: &Plan, given: &ParamOptions, path: &Path) -> Result<ParamOptions, SessionError> {
    let planned = ParamOptions { trainable: plan.trainable.clone(), frozen: plan.frozen.clone() };
    if *given == ParamOptions::default() || *given == planned {
        return Ok(planned);
    }
    Err(SessionError::Options(format!(
        "plan `{}` was made to train {}, but this run asks {}: the plan's memory figures and programs assume its patterns; re-plan with `smp-partition {} {} …`, or drop --trainable/--frozen here",
        path.display(),
        planned.describe(),
        given.describe(),
        plan.model.path,
        given.flags()
    )))
}

/// Decides what `model`'s imported graph trains (`passes::params`); records the counts in
/// `notes` if given.
fn decided(mut graph: Graph, sha256: String, model: &Path, opts: &ParamOptions, notes: Option<&mut Vec<String>>) -> Result<(Graph, String), SessionError> {
    let summary = params::decide(&mut graph, opts).map_err(|e| SessionError::Model(format!("model `{}`: {e}", model.display())))?;
    if let Some(n) = notes {
        n.push(summary.to_string());
    }
    Ok((graph, sha256))
}

/// Rewrites op chains into fused ops as analysis does, for a model run without a plan; a plan's
/// run applies the plan's own list ([`rank::planned_graph`]).
pub(crate) fn fuse_chains(graph: &mut Graph) {
    let fused = crate::codegen::stage_graph::fuse_unplanned(graph);
    if !fused.is_empty() {
        tracing::info!(%fused, "op chains fused");
    }
}

/// The training and validation data of a run: `--data` (or synthetic) and `--eval-data`.
fn open_data(exec: &Executor, o: &RunOptions, seq_len: i64, batch: i64, loss: LossKind) -> Result<(DataSource, Option<DataSource>), SessionError> {
    let open = |path: &Path, order: Order| -> Result<DataSource, SessionError> {
        let d = data::open_data(exec, path, seq_len, batch, order)?;
        if matches!(d, DataSource::Tokens(_)) && !matches!(loss, LossKind::CausalLm | LossKind::Model) {
            return Err(SessionError::Options(format!(
                "token file `{}` holds token ids only, which give no labels for this loss; use --loss causal-lm",
                path.display()
            )));
        }
        Ok(d)
    };
    let train = match &o.data.train {
        Some(path) => open(path, Order::Shuffled { seed: o.seed as u64 })?,
        None => DataSource::Fixed(data::synthetic_batch(exec, batch, seq_len, o.seed)?),
    };
    let eval = o.data.eval.as_deref().map(|p| open(p, Order::Sequential)).transpose()?;
    Ok((train, eval))
}

/// Lower-case hex sha256 of `bytes`.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Refuses fp16's loss-scale flags on a run that does not scale its loss, naming what it is.
fn check_loss_scale(o: &RunOptions, what: &str) -> Result<(), SessionError> {
    if o.autocast.is_some_and(|a| a.scales_loss()) || o.loss_scale == crate::runtime::train::LossScaleConfig::default() {
        return Ok(());
    }
    let precision = o.precision.map_or_else(|| o.float_type().to_string(), |p| p.to_string());
    let verified = if o.dtype == Some(FloatType::F64) && o.precision.is_some_and(|p| p.is_mixed()) { ", verified in f64 here" } else { "" };
    Err(SessionError::Options(format!(
        "--loss-scale and --loss-scale-window set fp16's loss scale, and {what} trains in {precision} precision{verified}; drop them, or use `--precision fp16-mixed`"
    )))
}
