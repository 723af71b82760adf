//! `smp-runner`: execute ONNX models and plans on libtorch.
//!
//! Exit status: 0 success, 1 user error (the message on stderr names the cause), 2 usage.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use smp_partition::frontend::onnx::{ImportedModel, load_model};
use smp_partition::ir::{Graph, ParamTransform, RecordKind, Training};
use smp_partition::passes::params::{self, ParamOptions};
use smp_partition::runtime::data::{self, DataSource, Order};
use indicatif::{ProgressBar, ProgressStyle};
use smp_partition::runtime::train::{self, AdamWConfig, EvalConfig, EvalRecord, LossKind, LrSchedule, LrShape, StepRecord, TrainConfig, TrainObserver};
use smp_partition::runtime::dist::RankEnv;
use smp_partition::runtime::checkpoint::{self, Checkpointing, Loaded, SaveConfig};
use smp_partition::runtime::pipeline::{self, RunConfig};
use smp_partition::runtime::weights::Source;
use smp_partition::runtime::{ExecOptions, Executor, InitMode, Weights, export, launch, npz};
use tch::Kind;

#[derive(Parser)]
#[command(name = "smp-runner", version, about = "Execute ONNX models and smp-partition plans on libtorch")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DTypeArg {
    F32,
    F64,
    Bf16,
}

impl DTypeArg {
    fn kind(self) -> Kind {
        match self {
            DTypeArg::F32 => Kind::Float,
            DTypeArg::F64 => Kind::Double,
            DTypeArg::Bf16 => Kind::BFloat16,
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum InitArg {
    /// Read every weight (external files must be present).
    Load,
    /// Seeded random values for external weights, without reading their files.
    Random,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LossArg {
    Model,
    CausalLm,
    CrossEntropy,
    Mse,
    Seq2seq,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LrScheduleArg {
    Constant,
    Cosine,
    Linear,
}

#[derive(Subcommand)]
enum Command {
    /// Forward pass: arrays keyed by graph input names in, graph outputs out.
    Eval {
        /// The ONNX model.
        model: PathBuf,
        /// Inputs, keyed by graph input name.
        #[arg(long)]
        inputs: PathBuf,
        /// Where to write the outputs, keyed by graph output name.
        #[arg(long)]
        outputs: PathBuf,
        /// Run floating-point tensors in this type (default: the model's own types).
        #[arg(long, value_enum)]
        dtype: Option<DTypeArg>,
        #[arg(long, value_enum, default_value = "load")]
        init: InitArg,
        /// Seed for `--init random`.
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// Run with the trained weights of this checkpoint (a `step-N` directory, or a
        /// checkpoint directory: its newest).
        #[arg(long, value_name = "DIR")]
        checkpoint: Option<PathBuf>,
    },
    /// Write the trained model of a checkpoint: `-o M.onnx` (the model file with the trained
    /// weights) or `-o W.safetensors` (the weights alone, under module parameter names).
    Export {
        /// A `step-N` checkpoint directory, or a checkpoint directory (its newest).
        checkpoint: PathBuf,
        /// `.onnx` or `.safetensors`.
        #[arg(short, long)]
        output: PathBuf,
        /// The model the checkpoint trained (default: the path its manifest records).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Put the ONNX initializers in `OUT.onnx.data` beside it (default: when they exceed
        /// 1 GiB or the model kept them outside).
        #[arg(long)]
        external_data: bool,
    },
    /// Train an ONNX model on one device.
    Train {
        /// The ONNX model.
        model: PathBuf,
        #[command(flatten)]
        opts: TrainArgs,
    },
    /// Run one rank of a plan (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them).
    Run {
        /// The plan file.
        plan: PathBuf,
        #[command(flatten)]
        opts: TrainArgs,
    },
    /// Measure this machine for the cost model's `cpu` preset (matmul rate by size, memory
    /// bandwidth, Gloo latency and bandwidth between two local ranks).
    Calibrate {
        /// The cluster file to write (the `cpu` preset reads ~/.cache/smp-partition/cpu.toml or
        /// $SMP_CPU_CALIBRATION).
        #[arg(short, long)]
        output: PathBuf,
        /// Internal: where a rank of the communication measurement writes its results.
        #[arg(long, hide = true)]
        comm_json: Option<PathBuf>,
    },
    /// Start N local ranks of `run` with torchrun's environment; forwards SIGINT/SIGTERM, and
    /// when one rank fails, names it and stops the others.
    Launch {
        /// Ranks to start (on this host).
        #[arg(long)]
        nproc: usize,
        /// Hosts of the job, each running one launcher with the same --nproc.
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This host's index (its ranks are node-rank × nproc + 0..nproc).
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Node 0's address, reachable from every host (default: 127.0.0.1, one host only).
        #[arg(long)]
        master_addr: Option<String>,
        /// The rendezvous port, the same on every host (default: a free one, one host only).
        #[arg(long)]
        master_port: Option<u16>,
        /// The plan file.
        plan: PathBuf,
        /// Options passed to every rank's `run`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        run_args: Vec<String>,
    },
    /// Write a token file for `--data` from text files: byte-level ids (0–255, uint16), with
    /// its `.bin.json` sidecar; `--val-fraction` holds out whole files (every k-th by sorted
    /// path) into `NAME.val.bin`.
    PrepareData {
        /// Text files, or directories (walked recursively).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// The token file to write (`.bin`).
        #[arg(short, long)]
        output: PathBuf,
        /// Share of the files held out for validation (k = round(1/F): files k−1, 2k−1, … of the sorted list).
        #[arg(long, default_value_t = 0.0)]
        val_fraction: f64,
        /// Only files with this extension (e.g. `py`) from directories.
        #[arg(long)]
        ext: Option<String>,
        /// Tokenize with this Hugging Face `tokenizer.json` (default: one token per byte).
        #[arg(long, value_name = "tokenizer.json")]
        tokenizer: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct TrainArgs {
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Global batch (samples per step).
    #[arg(long, default_value_t = 8)]
    batch: i64,
    /// Sequence length of token-file samples and synthetic data (default 128); `run` takes the
    /// plan's, and a different value is an error.
    #[arg(long)]
    seq_len: Option<i64>,
    /// Microbatches per step (gradients accumulate).
    #[arg(long, default_value_t = 1)]
    microbatches: usize,
    /// Loss; default: the model's scalar output if it has one, else seq2seq for a model with
    /// `decoder_input_ids`, else causal-lm.
    #[arg(long, value_enum)]
    loss: Option<LossArg>,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Decay of the learning rate after the warm-up (towards --min-lr).
    #[arg(long, value_enum, default_value = "constant")]
    lr_schedule: LrScheduleArg,
    /// Steps of linear warm-up from lr/N to lr.
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    /// Where cosine and linear schedules decay towards.
    #[arg(long, default_value_t = 0.0)]
    min_lr: f64,
    /// Global gradient-norm limit; 0 disables clipping.
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Training data: a token file (.bin with its .bin.json sidecar; every step a new global
    /// batch of sequence-length windows, in an order drawn from --seed), or one batch (.npy,
    /// .npz, .safetensors) repeated every step; default: seeded synthetic data.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Validation data (a token file, read in order, or one batch).
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// Validate before the first step and after every N-th (default: before and after the run).
    #[arg(long, value_name = "N")]
    eval_every: Option<usize>,
    /// Global batches per validation.
    #[arg(long, value_name = "K", default_value_t = 8)]
    eval_batches: usize,
    /// Seed of the weights (`--init random`), synthetic data and the token files' sample order.
    #[arg(long, default_value_t = 0)]
    seed: i64,
    #[arg(long, value_enum, default_value = "load")]
    init: InitArg,
    /// Intra-op threads (default: libtorch's choice).
    #[arg(long)]
    threads: Option<i32>,
    /// Print one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Seconds any collective or receive may wait before the rank fails.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Each rank prints `[rank R] step N` on stderr after every step.
    #[arg(long)]
    progress: bool,
    /// Train initializers matching this glob (`*`, `?`) that the rules would freeze; matched
    /// against initializer and module parameter names. Repeatable.
    #[arg(long, value_name = "GLOB")]
    trainable: Vec<String>,
    /// Never train initializers matching this glob (wins over --trainable). Repeatable.
    #[arg(long, value_name = "GLOB")]
    frozen: Vec<String>,
    /// After training, write the trained tensors (.npz keyed by module parameter name, in the
    /// module's layout; rows gathered at export time also under `NAME#rows`).
    #[arg(long, value_name = "NPZ")]
    save_weights: Option<PathBuf>,
    /// Write checkpoints under this directory (`step-N/`: a safetensors shard per rank and a
    /// manifest, written last); see docs/checkpoints.md.
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint after every N-th step (default: after the last).
    #[arg(long, value_name = "N")]
    checkpoint_every: Option<usize>,
    /// Keep only the K newest checkpoints.
    #[arg(long, value_name = "K")]
    keep: Option<usize>,
    /// Continue from a checkpoint: a `step-N` directory, or a checkpoint directory (its newest
    /// complete checkpoint). `--steps` stays the run's total; the plan may differ from the one
    /// that wrote it (weights and optimizer state are resharded).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
}

impl TrainArgs {
    fn param_options(&self) -> ParamOptions {
        ParamOptions { trainable: self.trainable.clone(), frozen: self.frozen.clone() }
    }

    fn schedule(&self) -> Result<LrSchedule> {
        let shape = match self.lr_schedule {
            LrScheduleArg::Constant => LrShape::Constant,
            LrScheduleArg::Cosine => LrShape::Cosine,
            LrScheduleArg::Linear => LrShape::Linear,
        };
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            bail!("--lr {} must be a positive number", self.lr);
        }
        if !(0.0..=self.lr).contains(&self.min_lr) {
            bail!("--min-lr {} must lie between 0 and --lr {}", self.min_lr, self.lr);
        }
        Ok(LrSchedule { shape, base: self.lr, warmup: self.warmup_steps, min_lr: self.min_lr, total: self.steps })
    }

    fn eval(&self) -> Result<Option<EvalConfig>> {
        match (&self.eval_data, self.eval_every) {
            (None, Some(_)) => bail!("--eval-every needs --eval-data (the validation data)"),
            (None, None) => Ok(None),
            (Some(_), every) => {
                if self.eval_batches == 0 {
                    bail!("--eval-batches must be at least 1");
                }
                Ok(Some(EvalConfig { every: every.unwrap_or(self.steps).max(1), batches: self.eval_batches }))
            }
        }
    }

    /// Checkpointing: where to write them (with what the manifest records of this run) and
    /// the checkpoint to resume from, checked against the model.
    fn checkpointing(
        &self,
        model: &Path,
        model_sha256: &str,
        params: &ParamOptions,
        plan_hash: Option<String>,
        mesh: String,
    ) -> Result<(Option<SaveConfig>, Option<Loaded>)> {
        let save = match (&self.checkpoint_dir, self.checkpoint_every, self.keep) {
            (None, Some(_), _) | (None, _, Some(_)) => bail!("--checkpoint-every and --keep need --checkpoint-dir"),
            (None, None, None) => None,
            (Some(root), every, keep) => {
                if every == Some(0) || keep == Some(0) {
                    bail!("--checkpoint-every and --keep must be at least 1");
                }
                Some(SaveConfig {
                    root: root.clone(),
                    every: every.unwrap_or(self.steps.max(1)),
                    keep,
                    seed: self.seed,
                    plan_hash,
                    mesh,
                    model_sha256: model_sha256.to_string(),
                    params: params.clone(),
                    model_path: std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf()).display().to_string(),
                })
            }
        };
        let resume = match &self.resume {
            None => None,
            Some(path) => {
                let l = Loaded::open(path)?;
                if l.manifest.state.model_sha256 != model_sha256 {
                    bail!(
                        "checkpoint `{}` was written for another model (sha256 {}); resume it with the model it trained",
                        l.dir.display(),
                        l.manifest.state.model_sha256
                    );
                }
                if l.manifest.state.params() != *params {
                    bail!(
                        "checkpoint `{}` trained {}, this run {}: what is trained must stay the same across a resume; give the checkpoint's patterns",
                        l.dir.display(),
                        describe_params(&l.manifest.state.params()),
                        describe_params(params)
                    );
                }
                if l.manifest.state.seed != self.seed {
                    bail!(
                        "checkpoint `{}` was trained with --seed {}, this run has --seed {}: the seed orders the samples and draws the dropout masks, so a resume must keep it; pass --seed {}",
                        l.dir.display(),
                        l.manifest.state.seed,
                        self.seed,
                        l.manifest.state.seed
                    );
                }
                if l.manifest.state.step > self.steps {
                    bail!("checkpoint `{}` is at step {}, past --steps {}", l.dir.display(), l.manifest.state.step, self.steps);
                }
                Some(l)
            }
        };
        Ok((save, resume))
    }

    fn adamw(&self) -> AdamWConfig {
        AdamWConfig { lr: self.lr, weight_decay: self.weight_decay, ..AdamWConfig::default() }
    }
}

/// The training and validation data of a run: `--data` (or synthetic) and `--eval-data`.
fn open_data(exec: &Executor, o: &TrainArgs, shape: &TrainShape, loss: LossKind) -> Result<(DataSource, Option<DataSource>)> {
    let open = |path: &Path, order: Order| -> Result<DataSource> {
        let d = data::open_data(exec, path, shape.seq_len, shape.batch, order)?;
        if matches!(d, DataSource::Tokens(_)) && !matches!(loss, LossKind::CausalLm | LossKind::Model) {
            bail!("token file `{}` holds token ids only, which give no labels for this loss; use --loss causal-lm", path.display());
        }
        Ok(d)
    };
    let train = match &o.data {
        Some(path) => open(path, Order::Shuffled { seed: o.seed as u64 })?,
        None => DataSource::Fixed(train::synthetic_batch(exec, shape.batch, shape.seq_len, o.seed)?),
    };
    let eval = o.eval_data.as_deref().map(|p| open(p, Order::Sequential)).transpose()?;
    Ok((train, eval))
}

/// Progress of a run on stderr: on a terminal one line updated in place (step, loss, lr,
/// tokens/s, ETA) with validations printed above it; otherwise plain lines as steps complete
/// (none with `--json`, whose report holds them).
struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    tokens_per_step: f64,
    /// Checkpoints written (step, manifest), for `--json`.
    checkpoints: Vec<serde_json::Value>,
}

impl Progress {
    /// For a run of `steps` steps of `tokens_per_step` tokens; `shown`: this process reports.
    fn new(steps: usize, tokens_per_step: f64, shown: bool, json: bool) -> Progress {
        use std::io::IsTerminal;
        let terminal = shown && std::io::stderr().is_terminal();
        let bar = terminal.then(|| {
            let b = ProgressBar::new(steps as u64);
            b.set_style(
                ProgressStyle::with_template("step {pos}/{len} [{bar:12}] {msg}  {elapsed} < {eta}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        });
        Progress { bar, plain: shown && !terminal && !json, tokens_per_step, checkpoints: Vec::new() }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish();
        }
    }
}

impl TrainObserver for Progress {
    fn on_step(&mut self, s: &StepRecord) {
        if let Some(b) = &self.bar {
            let rate = if s.time_s > 0.0 { self.tokens_per_step / s.time_s } else { 0.0 };
            b.set_position(s.step as u64);
            b.set_message(format!("loss {:.4}  lr {:.2e}  {rate:.0} tok/s", s.loss, s.lr));
        } else if self.plain {
            eprintln!("step {:>4}  loss {:.6}  lr {:.3e}  {:.3} s", s.step, s.loss, s.lr, s.time_s);
        }
    }

    fn on_checkpoint(&mut self, step: usize, manifest: &Path) {
        let line = format!("checkpoint after step {step:>4}  {}", manifest.display());
        if let Some(b) = &self.bar {
            b.println(line);
        } else if self.plain {
            eprintln!("{line}");
        }
        self.checkpoints.push(serde_json::json!({"step": step, "manifest": manifest.display().to_string()}));
    }

    fn on_eval(&mut self, e: &EvalRecord) {
        let line = format!("eval after step {:>4}  val loss {:.6}", e.step, e.loss);
        if let Some(b) = &self.bar {
            b.println(line);
        } else if self.plain {
            eprintln!("{line}");
        }
    }
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    smp_partition::logging::init();
    if let Err(e) = run(cli) {
        eprintln!("smp-runner: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Eval { model, inputs, outputs, dtype, init, seed, checkpoint } => eval(&model, &inputs, &outputs, dtype, init, seed, checkpoint.as_deref()),
        Command::Export { checkpoint, output, model, external_data } => export_cmd(&checkpoint, &output, model.as_deref(), external_data),
        Command::Train { model, opts } => {
            let seq_len = opts.seq_len.unwrap_or(DEFAULT_SEQ_LEN);
            let shape = TrainShape { batch: opts.batch, seq_len, microbatches: opts.microbatches, predicted: None };
            let params = opts.param_options();
            train_cmd(&model, load_decided_sha(&model, &params, true)?, &opts, &params, shape, None)
        }
        Command::Run { plan, opts } => run_plan(&plan, &opts),
        Command::Calibrate { output, comm_json } => calibrate(&output, comm_json.as_deref()),
        Command::PrepareData { files, output, val_fraction, ext, tokenizer } => {
            prepare_data(&files, &output, val_fraction, ext.as_deref(), tokenizer.as_deref())
        }
        Command::Launch { nproc, nnodes, node_rank, master_addr, master_port, plan, run_args } => {
            let exe = std::env::current_exe().context("cannot find the smp-runner executable")?;
            let nodes = launch::Nodes { nnodes, node_rank, master_addr, master_port };
            let code = launch::launch_on(&exe, nproc, &nodes, &plan, &run_args)?;
            std::process::exit(code)
        }
    }
}

/// Sequence length of synthetic data and token windows without a plan or `--seq-len`.
const DEFAULT_SEQ_LEN: i64 = 128;

fn prepare_data(files: &[PathBuf], output: &Path, val_fraction: f64, ext: Option<&str>, tokenizer: Option<&Path>) -> Result<()> {
    let tokenizer = match tokenizer {
        Some(path) => data::TextTokenizer::from_file(path)?,
        None => data::TextTokenizer::Bytes,
    };
    let p = data::prepare(files, ext, output, val_fraction, &tokenizer)?;
    if let Some(first) = p.not_utf8.first() {
        eprintln!(
            "smp-runner: warning: {} files are not UTF-8 text (e.g. {}); their invalid bytes were tokenized as U+FFFD",
            p.not_utf8.len(),
            first.display()
        );
    }
    eprintln!("smp-runner: wrote {} ({} tokens from {} files)", output.display(), p.train.0, p.train.1.len());
    if !p.val.1.is_empty() {
        eprintln!("smp-runner: wrote {} ({} tokens from {} files)", data::val_path(output).display(), p.val.0, p.val.1.len());
    }
    Ok(())
}

/// Batch geometry of a run: from flags (`train`) or from the plan (`run`).
struct TrainShape {
    batch: i64,
    seq_len: i64,
    microbatches: usize,
    predicted: Option<f64>,
}

/// One rank of a plan: single-device plans train directly; others need torchrun's
/// environment (`smp-runner launch` sets it).
fn run_plan(path: &Path, o: &TrainArgs) -> Result<()> {
    let plan = smp_partition::plan::load(path)?;
    let plan_hash = sha256_hex(&std::fs::read(path).with_context(|| format!("cannot read plan `{}`", path.display()))?);
    pipeline::codegen_section(&plan).with_context(|| format!("plan `{}`", path.display()))?;
    let params = plan_params(&plan, o, path)?;
    let p = &plan.parallel;
    let env = RankEnv::from_env()?;
    let single = p.pp * p.tp * p.dp == 1;
    if !single && env.is_none() {
        bail!(
            "plan `{}` needs {} ranks (pp={} tp={} dp={}); start it with `smp-runner launch --nproc {} {}` or torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT",
            path.display(),
            p.pp * p.tp * p.dp,
            p.pp,
            p.tp,
            p.dp,
            p.pp * p.tp * p.dp,
            path.display()
        );
    }
    let given = PathBuf::from(&plan.model.path);
    let model = if given.is_relative() && !given.exists() {
        path.parent().map(|d| d.join(&given)).filter(|m| m.exists()).unwrap_or(given)
    } else {
        given
    };
    let imported = load_model(&model).with_context(|| format!("model `{}` of plan `{}`", model.display(), path.display()))?;
    if imported.sha256 != plan.model.sha256 {
        bail!(
            "model `{}` is not the one plan `{}` was made for (sha256 differs); re-plan with smp-partition",
            model.display(),
            path.display()
        );
    }
    let seq_len = match (plan.seq_len, o.seq_len) {
        (Some(p), Some(s)) if p as i64 != s => bail!(
            "--seq-len {s} disagrees with plan `{}`, made for sequence length {p}; drop --seq-len, or re-plan with `smp-partition … --seq-len {s}`",
            path.display()
        ),
        (Some(p), _) => p as i64,
        (None, s) => s.unwrap_or(DEFAULT_SEQ_LEN),
    };
    let shape = TrainShape {
        batch: plan.global_batch as i64,
        seq_len,
        microbatches: p.microbatches.max(1),
        predicted: Some(plan.predicted.step_time_s),
    };
    let mesh = format!("pp{} dp{} tp{} zero{}", p.pp, p.dp, p.tp, p.zero);
    let mut ckpt = o.checkpointing(&model, &imported.sha256, &params, Some(plan_hash.clone()), mesh.clone())?;
    if !single && o.save_weights.is_some() {
        ckpt.0 = Some(weights_checkpoint(o, ckpt.0.take(), &model, &imported.sha256, &params, plan_hash.clone(), mesh.clone())?);
    }
    if let Some(l) = &ckpt.1 {
        if l.manifest.state.plan_hash.as_deref() != Some(plan_hash.as_str()) && env.as_ref().is_none_or(|e| e.rank == 0) {
            eprintln!("smp-runner: resharding checkpoint `{}` ({}, {} ranks) to this plan ({mesh})", l.dir.display(), l.manifest.state.mesh, l.manifest.state.world);
        }
    }
    match env {
        Some(env) if !(single && env.world == 1) => {
            let (graph, _) = decided(imported, &model, &params, env.rank == 0)?;
            rank_cmd(&plan, &model, graph, o, &shape, &env, ckpt)
        }
        _ => {
            let (graph, sha) = decided(imported, &model, &params, true)?;
            // the graph the plan was made for, as a rank of a larger plan runs it
            let (graph, _) = pipeline::planned_graph(&plan, graph).with_context(|| format!("model `{}` of plan `{}`", model.display(), path.display()))?;
            train_cmd(&model, (graph, sha), o, &params, shape, Some(ckpt))
        }
    }
}

/// What a run of `plan` trains: the plan's `--trainable`/`--frozen` patterns. The run's own
/// patterns must be absent or the same, since the plan's memory and programs assume its.
fn plan_params(plan: &smp_partition::plan::Plan, o: &TrainArgs, path: &Path) -> Result<ParamOptions> {
    let planned = ParamOptions { trainable: plan.trainable.clone(), frozen: plan.frozen.clone() };
    let given = o.param_options();
    if given == ParamOptions::default() || given == planned {
        return Ok(planned);
    }
    bail!(
        "plan `{}` was made to train {}, but this run asks {}: the plan's memory figures and programs assume its patterns; re-plan with `smp-partition {} {} …`, or drop --trainable/--frozen here",
        path.display(),
        describe_params(&planned),
        describe_params(&given),
        plan.model.path,
        param_flags(&given)
    )
}

/// `--trainable`/`--frozen` patterns in words, for messages.
fn describe_params(p: &ParamOptions) -> String {
    if *p == ParamOptions::default() { "by the model's record and rules (no --trainable/--frozen)".into() } else { format!("with `{}`", param_flags(p)) }
}

/// The patterns as command-line flags.
fn param_flags(p: &ParamOptions) -> String {
    let t = p.trainable.iter().map(|g| format!("--trainable '{g}'"));
    let f = p.frozen.iter().map(|g| format!("--frozen '{g}'"));
    t.chain(f).collect::<Vec<_>>().join(" ")
}

fn loss_kind(o: &TrainArgs, graph: &Graph) -> LossKind {
    match o.loss {
        Some(LossArg::Model) => LossKind::Model,
        Some(LossArg::CausalLm) => LossKind::CausalLm,
        Some(LossArg::CrossEntropy) => LossKind::CrossEntropy,
        Some(LossArg::Mse) => LossKind::Mse,
        Some(LossArg::Seq2seq) => LossKind::Seq2Seq,
        None => {
            let scalar_out = graph.outputs.iter().any(|&v| {
                graph.value(v).ty.as_ref().and_then(|t| t.shape.as_ref()).is_some_and(|s| s.numel() == Some(1))
            });
            let seq2seq = graph.inputs.iter().any(|&v| graph.value(v).name == train::DECODER_INPUT_IDS);
            if scalar_out {
                LossKind::Model
            } else if seq2seq {
                LossKind::Seq2Seq
            } else {
                LossKind::CausalLm
            }
        }
    }
}

/// One rank of a multi-device plan, on `model`'s graph decided by the plan's patterns.
fn rank_cmd(
    plan: &smp_partition::plan::Plan,
    model: &Path,
    graph: Graph,
    o: &TrainArgs,
    shape: &TrainShape,
    env: &RankEnv,
    (save, resume): (Option<SaveConfig>, Option<Loaded>),
) -> Result<()> {
    if let Some(n) = o.threads {
        tch::set_num_threads(n);
    }
    // the graph the plan was made for: specialised as the planner did, the plan's fused ops
    // applied, its fixed batch rebound
    let (graph, dims) = pipeline::planned_graph(plan, graph).with_context(|| format!("model `{}`", model.display()))?;
    let float_kind = Some(o.dtype.kind());
    // only the parts of weights this rank holds are read (from the model file, its external
    // data or the checkpoint), when its stages and shards are set up
    let mut source = Source::new(&graph, init_mode(o.init, o.seed), float_kind);
    if let Some(l) = &resume {
        source = source.with_checkpoint(l);
    }
    let weights = pipeline::rank_weights(plan, &source, env.rank)?;
    let exec = Executor::new(&graph, weights, ExecOptions { float_kind, training: true })?;
    let loss = loss_kind(o, &graph);
    let (data, eval_data) = open_data(&exec, o, shape, loss)?;
    let global = data.global_batch();
    let ckpt = Checkpointing { save, resume: resume.as_ref() };
    let cfg = RunConfig {
        steps: o.steps,
        loss,
        adamw: o.adamw(),
        clip: (o.clip > 0.0).then_some(o.clip),
        timeout: std::time::Duration::from_secs(o.timeout),
        bucket_bytes: 25 << 20,
        progress: o.progress,
        schedule: o.schedule()?,
        eval: o.eval()?,
        seed: o.seed,
    };
    let t0 = Instant::now();
    let mut progress = Progress::new(o.steps, data.tokens_per_batch() as f64, env.rank == 0, o.json);
    let report = pipeline::run_rank(plan, &exec, &dims, &source, &data, eval_data.as_ref(), &cfg, env, &ckpt, &mut progress)
        .with_context(|| format!("rank {} of {}", env.rank, env.world))?;
    progress.finish();
    if let (Some(path), Some(save), 0) = (&o.save_weights, &ckpt.save, env.rank) {
        // rank 0 wrote the manifest of the last step's checkpoint before returning
        save_weights_of_checkpoint(&save.root, model, path, o.dtype.kind())?;
    }
    let wall = t0.elapsed().as_secs_f64();
    let step_time = report.ranks.iter().map(|r| r.step_time_s).fold(0.0, f64::max);
    if env.rank == 0 && o.json {
        let ranks: Vec<_> = report
            .ranks
            .iter()
            .enumerate()
            .map(|(r, st)| {
                let predicted = plan.mesh().coord(r).map(|c| plan.rank_memory(c.pp).total);
                serde_json::json!({
                    "rank": r,
                    "step_time_s": st.step_time_s,
                    "peak_memory_bytes": st.peak_rss_bytes,
                    "predicted_memory_bytes": predicted,
                    "peak_state_bytes": st.peak_state.total(),
                    "peak_state": {"params": st.peak_state.params, "grads": st.peak_state.grads, "optimizer": st.peak_state.optimizer},
                    "peak_param_bytes": st.peak_param_bytes,
                    "resident_param_bytes": st.resident_param_bytes,
                    "weight_bytes_read": {"params": st.weight_bytes_read.params, "other": st.weight_bytes_read.other},
                    "cpu_time_s": st.cpu_time_s,
                    "phases": {
                        "compute_s": st.phases.compute_s,
                        "send_s": st.phases.send_s,
                        "recv_s": st.phases.recv_s,
                        "collective_s": st.phases.collective_s,
                        "optimizer_s": st.phases.optimizer_s,
                    },
                })
            })
            .collect();
        let out = serde_json::json!({
            "steps": report.steps,
            "samples_per_s": if step_time > 0.0 { global as f64 / step_time } else { 0.0 },
            "measured_step_time_s": step_time,
            "predicted_step_time_s": shape.predicted,
            "wall_s": wall,
            "ranks": ranks,
            "eval": report.eval,
            "checkpoints": progress.checkpoints,
            "resumed_from": resume.as_ref().map(|l| l.dir.display().to_string()),
        });
        println!("{out}");
    }
    Ok(())
}

fn calibrate(output: &Path, comm_json: Option<&Path>) -> Result<()> {
    use smp_partition::runtime::calibrate::{self as cal, Calibration};
    tch::set_num_threads(1);
    if let Some(json) = comm_json {
        // one of the two ranks started below
        let env = RankEnv::from_env()?.context("--comm-json is for the ranks calibrate starts itself")?;
        let mut c = Calibration::default();
        cal::measure_comm(&env, &mut c)?;
        if env.rank == 0 {
            std::fs::write(json, serde_json::to_string(&c)?).with_context(|| format!("cannot write {}", json.display()))?;
        }
        return Ok(());
    }
    let mut c = cal::measure_compute()?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    cal::measure_concurrency(&mut c, cores).context("measuring the rates while every core computes")?;
    let dir = std::env::temp_dir().join(format!("smp-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let json = dir.join("comm.json");
    let exe = std::env::current_exe().context("cannot find the smp-runner executable")?;
    let args: Vec<std::ffi::OsString> = vec!["calibrate".into(), "-o".into(), output.into(), "--comm-json".into(), json.clone().into()];
    let code = launch::launch_args(&exe, 2, &args)?;
    if code != 0 {
        bail!("the two-rank communication measurement failed (exit {code})");
    }
    let comm: Calibration = serde_json::from_str(&std::fs::read_to_string(&json).with_context(|| format!("cannot read {}", json.display()))?)?;
    let _ = std::fs::remove_dir_all(&dir);
    c.p2p_latency = comm.p2p_latency;
    c.p2p_bandwidth = comm.p2p_bandwidth;
    c.allreduce_bandwidth = comm.allreduce_bandwidth;
    c.collective_samples = comm.collective_samples;
    c.collectives = comm.collectives;
    let text = cal::cluster_toml(&c);
    if let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    std::fs::write(output, &text).with_context(|| format!("cannot write {}", output.display()))?;
    eprint!("{text}");
    Ok(())
}

/// Loads a model and decides what is trained ([`decided`]): the graph and the file's sha256.
fn load_decided_sha(model: &Path, opts: &ParamOptions, log: bool) -> Result<(Graph, String)> {
    let imported = load_model(model).with_context(|| format!("cannot load model `{}`", model.display()))?;
    decided(imported, model, opts, log)
}

/// Decides what `model`'s imported graph trains (`passes::params`); logs the counts if `log`.
fn decided(imported: ImportedModel, model: &Path, opts: &ParamOptions, log: bool) -> Result<(Graph, String)> {
    let mut graph = imported.graph;
    let summary = params::decide(&mut graph, opts).with_context(|| format!("model `{}`", model.display()))?;
    if log {
        eprintln!("smp-runner: {summary}");
    }
    Ok((graph, imported.sha256))
}

/// Lower-case hex sha256 of `bytes`.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Rewrites op chains into fused ops with the library pass analysis runs (`passes::fuse`), for
/// the commands that run a model without a plan (`train`, `eval`); a plan's run applies the
/// plan's own list instead (`pipeline::planned_graph`).
fn fuse_chains(graph: &mut Graph) {
    let fused = smp_partition::passes::fuse::Fused::of(&smp_partition::passes::fuse::fuse(graph));
    if fused.total() > 0 {
        tracing::info!(%fused, "op chains fused");
    }
}

/// Rewrites a model whose batch is fixed to run microbatches of `b` samples
/// (`passes::rebatch`; refused where the rewrite is not proven).
fn rebind_batch(graph: &mut Graph, b: i64, opts: &smp_partition::passes::AnalyzeOptions, model: &Path) -> Result<()> {
    if let Some(r) = smp_partition::passes::rebatch::rebind_batch(graph, b, opts).with_context(|| format!("model `{}`", model.display()))? {
        tracing::info!(from = r.from, to = r.to, shape_constants = r.shape_constants.len(), constants = r.constants.len(), "fixed batch rebound");
    }
    Ok(())
}

/// The checkpointing of a plan of several ranks run with `--save-weights`: the run's own
/// (`--checkpoint-dir`), whose last step must be checkpointed, else one of the last step only
/// in `FILE.checkpoint/` (removed once the weights are written).
// TODO(issue 27): the run front door keeps the final weights of any plan; this bridge goes then.
fn weights_checkpoint(
    o: &TrainArgs,
    save: Option<SaveConfig>,
    model: &Path,
    model_sha256: &str,
    params: &ParamOptions,
    plan_hash: String,
    mesh: String,
) -> Result<SaveConfig> {
    let Some(path) = &o.save_weights else { bail!("no --save-weights") };
    if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
        bail!("--save-weights `{}`: a plan of several ranks writes its weights as .safetensors", path.display());
    }
    match save {
        Some(s) if s.due(o.steps) => Ok(s),
        Some(s) => bail!(
            "--save-weights takes the weights from the checkpoint of the last step, but --checkpoint-every {} does not checkpoint step {}",
            s.every,
            o.steps
        ),
        None => Ok(SaveConfig {
            root: weights_checkpoint_dir(path),
            every: o.steps.max(1),
            keep: Some(1),
            seed: o.seed,
            plan_hash: Some(plan_hash),
            mesh,
            model_sha256: model_sha256.to_string(),
            params: params.clone(),
            model_path: std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf()).display().to_string(),
        }),
    }
}

fn weights_checkpoint_dir(path: &Path) -> PathBuf {
    let mut dir = path.as_os_str().to_owned();
    dir.push(".checkpoint");
    PathBuf::from(dir)
}

/// Writes the newest checkpoint under `root` as `path` (safetensors, module parameter names, as
/// `export` writes them) with the floating-point weights in the run's `kind`.
fn save_weights_of_checkpoint(root: &Path, model: &Path, path: &Path, kind: tch::Kind) -> Result<()> {
    let l = Loaded::open(root)?;
    let (graph, _) = load_decided_sha(model, &l.manifest.state.params(), false)?;
    let exec = export::trained_executor_in(&l, &graph, Some(kind)).with_context(|| format!("checkpoint `{}`", l.dir.display()))?;
    export::write_safetensors(&exec, path).with_context(|| format!("writing trained weights to `{}`", path.display()))?;
    if root == weights_checkpoint_dir(path) {
        std::fs::remove_dir_all(root).with_context(|| format!("cannot remove {}", root.display()))?;
    }
    Ok(())
}

/// Writes the trained tensors keyed by module parameter name, in the module's layout: as
/// `.safetensors`, the tensors `export` writes; otherwise as `.npz`, with the buffers the
/// parameter record names (BatchNorm running statistics) as `NAME#buffer`.
fn save_weights(path: &Path, exec: &Executor) -> Result<()> {
    if path.extension().and_then(|e| e.to_str()) == Some("safetensors") {
        export::write_safetensors(exec, path).with_context(|| format!("writing trained weights to `{}`", path.display()))?;
        return Ok(());
    }
    let graph = exec.graph();
    let mut arrays = Vec::new();
    for v in graph.initializers() {
        let val = graph.value(v);
        if let (Some(rec), Some(w)) = (val.record.as_ref().filter(|r| r.kind == RecordKind::Buffer && r.persistent), exec.weights.get(&v)) {
            for n in rec.params.iter().flatten() {
                arrays.push((format!("{n}#buffer"), w.detach(), None));
            }
            continue;
        }
        let Some(Training::Trained { names, transform, .. }) = &graph.value(v).training else { continue };
        let Some(w) = exec.weights.get(&v) else { continue };
        let w = w.detach();
        let w = if *transform == ParamTransform::Transpose { w.tr().contiguous() } else { w };
        if let ParamTransform::Gather { rows, .. } = transform {
            arrays.push((format!("{}#rows", names[0]), tch::Tensor::from_slice(rows), None));
        }
        for n in names {
            arrays.push((n.clone(), w.shallow_clone(), None));
        }
    }
    npz::write_npz(path, &arrays).with_context(|| format!("writing trained weights to `{}`", path.display()))
}

/// `export`: the trained model of a checkpoint as ONNX or safetensors.
fn export_cmd(ckpt: &Path, output: &Path, model: Option<&Path>, external: bool) -> Result<()> {
    let l = Loaded::open(ckpt)?;
    let model = model.map_or_else(|| PathBuf::from(&l.manifest.state.model_path), Path::to_path_buf);
    let (graph, sha256) = load_decided_sha(&model, &l.manifest.state.params(), false)?;
    if sha256 != l.manifest.state.model_sha256 {
        bail!(
            "model `{}` is not the one checkpoint `{}` trained (sha256 differs); pass that model with --model",
            model.display(),
            l.dir.display()
        );
    }
    let exec = export::trained_executor(&l, &graph).with_context(|| format!("checkpoint `{}`", l.dir.display()))?;
    match output.extension().and_then(|e| e.to_str()) {
        Some("safetensors") => {
            let keys = export::write_safetensors(&exec, output)?;
            eprintln!("smp-runner: wrote {} ({} tensors, step {})", output.display(), keys.len(), l.manifest.state.step);
        }
        Some("onnx") => {
            let data = export::write_onnx(&exec, &model, output, export::needs_external_data(&graph, external))?;
            let beside = data.map(|d| format!(" with its data in {}", d.display())).unwrap_or_default();
            eprintln!("smp-runner: wrote {}{beside} (step {})", output.display(), l.manifest.state.step);
        }
        _ => bail!("export writes `.onnx` or `.safetensors`, not `{}`", output.display()),
    }
    Ok(())
}

fn init_mode(init: InitArg, seed: i64) -> InitMode {
    match init {
        InitArg::Load => InitMode::Load,
        InitArg::Random => InitMode::Random { seed },
    }
}

fn eval(model: &Path, inputs: &Path, outputs: &Path, dtype: Option<DTypeArg>, init: InitArg, seed: i64, checkpoint: Option<&Path>) -> Result<()> {
    let loaded = checkpoint.map(Loaded::open).transpose()?;
    // a checkpoint's tensors are named as its run decided what is trained
    let params = loaded.as_ref().map(|l| l.manifest.state.params()).unwrap_or_default();
    let (mut graph, sha256) = load_decided_sha(model, &params, false)?;
    // the graph training runs, so validation and evaluation agree to the last bit
    fuse_chains(&mut graph);
    let float_kind = dtype.map(DTypeArg::kind);
    smp_partition::runtime::executor::check_supported(&graph).with_context(|| format!("model `{}`", model.display()))?;
    let mut weights = Weights::load(&graph, init_mode(init, seed), float_kind)?;
    if let Some(l) = &loaded {
        if l.manifest.state.model_sha256 != sha256 {
            bail!("checkpoint `{}` was written for another model (sha256 {})", l.dir.display(), l.manifest.state.model_sha256);
        }
        checkpoint::restore_params(l, &graph, &mut weights.tensors)?;
    }
    let exec = Executor::new(&graph, weights, ExecOptions { float_kind, training: false })?;
    let named = npz::read_npz(inputs)?;
    let feeds = exec.bind_inputs(named).with_context(|| format!("inputs file `{}`", inputs.display()))?;
    let outs = tch::no_grad(|| exec.forward(&feeds))?;
    let arrays: Vec<(String, tch::Tensor, Option<smp_partition::ir::DType>)> = graph
        .outputs
        .iter()
        .zip(outs)
        .map(|(&v, t)| {
            let val = graph.value(v);
            (val.name.clone(), t, val.ty.as_ref().map(|ty| ty.dtype))
        })
        .collect();
    npz::write_npz(outputs, &arrays)?;
    Ok(())
}

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Single-process training of `model` (its graph, decided by `params`, and sha256); `ckpt`:
/// checkpointing as a one-rank plan set it up, whose graph is the one the plan was made for
/// (none: `train`, which sets checkpointing up here and fuses the model's op chains at load).
fn train_cmd(
    model: &Path,
    (mut graph, sha256): (Graph, String),
    o: &TrainArgs,
    params: &ParamOptions,
    shape: TrainShape,
    ckpt: Option<(Option<SaveConfig>, Option<Loaded>)>,
) -> Result<()> {
    if let Some(n) = o.threads {
        tch::set_num_threads(n);
    }
    let planned = ckpt.is_some();
    let (save, resume) = match ckpt {
        Some(c) => c,
        None => o.checkpointing(model, &sha256, params, None, "train".into())?,
    };
    if let Some((_, fixed)) = smp_partition::passes::rebatch::fixed_batch(&graph) {
        // a fixed batch runs the microbatch size asked (the data's batch, split)
        let (global, seq) = match &o.data {
            Some(path) => {
                let size = npz::read_npz(path)?.first().map(|(_, t)| t.size()).unwrap_or_default();
                (size.first().copied().unwrap_or(shape.batch), size.get(1).copied().unwrap_or(shape.seq_len))
            }
            None => (shape.batch, shape.seq_len),
        };
        let b = global / shape.microbatches.max(1) as i64;
        if b != fixed && b > 0 {
            // a symbolic sequence (fixed batch) is bound to the data's
            let symbolic_seq = graph.inputs.first().and_then(|&v| graph.value(v).ty.as_ref()).and_then(|t| t.shape.as_ref()).is_some_and(|s| {
                matches!(s.0.get(1), Some(smp_partition::ir::Dim::Sym(_)))
            });
            let opts = smp_partition::passes::AnalyzeOptions { seq_len: symbolic_seq.then_some(seq), ..Default::default() };
            rebind_batch(&mut graph, b, &opts, model)?;
        }
    }
    if !planned {
        fuse_chains(&mut graph);
    }
    let float_kind = Some(o.dtype.kind());
    smp_partition::runtime::executor::check_supported(&graph).with_context(|| format!("model `{}`", model.display()))?;
    let mut weights = Weights::load(&graph, init_mode(o.init, o.seed), float_kind)?;
    if let Some(l) = &resume {
        checkpoint::restore_params(l, &graph, &mut weights.tensors)?;
    }
    let exec = Executor::new(&graph, weights, ExecOptions { float_kind, training: true })?;
    let loss = loss_kind(o, &graph);
    let (data, eval_data) = open_data(&exec, o, &shape, loss)?;
    let ckpt = Checkpointing { save, resume: resume.as_ref() };
    let cfg = TrainConfig {
        steps: o.steps,
        microbatches: shape.microbatches,
        loss,
        adamw: o.adamw(),
        clip: (o.clip > 0.0).then_some(o.clip),
        schedule: o.schedule()?,
        eval: o.eval()?,
        seed: o.seed,
    };
    let global = data.global_batch();
    let t0 = Instant::now();
    let mut progress = Progress::new(o.steps, data.tokens_per_batch() as f64, true, o.json);
    let (steps, evals) = train::train_with(&exec, &data, eval_data.as_ref(), &cfg, &ckpt, &mut progress)?;
    progress.finish();
    let wall = t0.elapsed().as_secs_f64();
    if let Some(path) = &o.save_weights {
        save_weights(path, &exec)?;
    }
    // the first step pays one-time costs; report the mean of the others when there are any
    let timed: Vec<f64> = steps.iter().skip(usize::from(steps.len() > 1)).map(|s| s.time_s).collect();
    let step_time = timed.iter().sum::<f64>() / timed.len().max(1) as f64;
    if o.json {
        let out = serde_json::json!({
            "steps": steps,
            "samples_per_s": if step_time > 0.0 { global as f64 / step_time } else { 0.0 },
            "measured_step_time_s": step_time,
            "predicted_step_time_s": shape.predicted,
            "wall_s": wall,
            "ranks": [{"rank": 0, "step_time_s": step_time, "peak_memory_bytes": peak_rss_bytes()}],
            "eval": evals,
            "checkpoints": progress.checkpoints,
            "resumed_from": resume.as_ref().map(|l| l.dir.display().to_string()),
        });
        println!("{out}");
    }
    Ok(())
}
