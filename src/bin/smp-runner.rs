//! `smp-runner`: execute ONNX models and smp-partition plans on libtorch. Flags in, the run
//! front door (`runtime::session`) does the work, its report out.
//!
//! Exit status: 0 success, 1 user error (the message on stderr names the cause), 2 usage, 3
//! the run failed after it started training (`launch --max-restarts` starts it again), 4 and 5
//! a rank leaves or stops in an elastic job, 6 rank 0 found the rendezvous port taken.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use smp_partition::runtime::data;
use smp_partition::runtime::device::{DeviceKind, DeviceRequest, Ranks};
use smp_partition::runtime::RuntimeError;
use smp_partition::runtime::launch::elastic::{self, Elastic};
use smp_partition::runtime::launch::{calibrate, launcher, verify};
use smp_partition::runtime::session::commands::{self, EvalJob};
use smp_partition::ir::Precision;
use smp_partition::runtime::train::LossScaleConfig;
use smp_partition::runtime::session::{CheckpointOptions, DataOptions, FloatType, InitChoice, OnCheckpointError, OptimizerOptions, ParamOptions, RunOptions, RunSession, RunTarget, SessionError};
use smp_partition::runtime::train::{EvalRecord, LossKind, LrShape, StepRecord, TrainObserver};

#[derive(Parser)]
#[command(name = "smp-runner", version, about = "Execute ONNX models and smp-partition plans on libtorch")]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
        /// Run floating-point tensors in this type: f32, f64 or bf16 (default: the model's own).
        #[arg(long)]
        dtype: Option<FloatType>,
        /// load (read every weight) or random (seeded values for external weights, unread).
        #[arg(long, default_value = "load")]
        init: InitChoice,
        /// Seed for `--init random`.
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// Run with the trained weights of this checkpoint (a `step-N` directory, or a
        /// checkpoint directory: its newest).
        #[arg(long, value_name = "DIR")]
        checkpoint: Option<PathBuf>,
        /// Where the pass runs: cpu, or cuda (GPU LOCAL_RANK, default 0). Default: cuda when
        /// libtorch sees a GPU, else cpu.
        #[arg(long)]
        device: Option<DeviceKind>,
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
        /// Start every rank again, from the newest complete checkpoint of --checkpoint-dir,
        /// when the run fails after it started training (a rank killed, crashed or cut off), up
        /// to N times; a user error (exit 1) is not retried.
        #[arg(long, value_name = "N", default_value_t = 0)]
        max_restarts: usize,
        /// Seconds to wait before a restart.
        #[arg(long, value_name = "S", default_value_t = 3)]
        restart_backoff: u64,
        /// Node 0's port for the launchers' own store, which agrees on restarts (and the
        /// devices of an elastic job) across hosts (default: --master-port + 1).
        #[arg(long)]
        restart_port: Option<u16>,
        /// An elastic job of MIN to MAX devices: when a host or a rank is lost (and does not
        /// come back within --rejoin-timeout), the survivors plan the model again for the
        /// devices left with the plan's own planning request, and resume the newest checkpoint
        /// of --checkpoint-dir on the new plan (kept under its plans/); a host started later
        /// joins at the next checkpoint. Needs --checkpoint-dir on storage every host reads.
        #[arg(long, value_name = "MIN:MAX", value_parser = parse_elastic)]
        elastic: Option<(usize, usize)>,
        /// Under --elastic: seconds the survivors wait for a lost host's launcher to come back
        /// before going on without it.
        #[arg(long, value_name = "S", default_value_t = 30)]
        rejoin_timeout: u64,
        /// Under --elastic: a rank named a straggler N windows in a row leaves the job, as a
        /// lost host does (after a checkpoint of that step). Off by default.
        #[arg(long, value_name = "N")]
        drop_stragglers: Option<usize>,
        /// Seconds from a rank's start to its first step (loading, connecting) before it is hung.
        #[arg(long, value_name = "S", default_value_t = 600)]
        startup_timeout: u64,
        /// Seconds one step (or validation) may take, and a rank go without a sign of life in
        /// it, before it is hung: named with what its peers wait on, and killed (under --elastic
        /// its device is lost).
        #[arg(long, value_name = "S", default_value_t = 300)]
        step_timeout: u64,
        /// Seconds writing a checkpoint (or the end of the run) may take before a rank is hung.
        #[arg(long, value_name = "S", default_value_t = 600)]
        checkpoint_timeout: u64,
        /// Every rank's device (checked here against --nproc and the GPUs, then passed on):
        /// cpu, or cuda (rank r on GPU r of its host). Default: cuda when libtorch sees a GPU.
        #[arg(long)]
        device: Option<DeviceKind>,
        /// Let ranks share GPUs (more ranks than GPUs), talking by Gloo through host memory
        /// instead of NCCL; passed on to every rank. No effect on the CPU.
        #[arg(long)]
        share_gpu: bool,
        /// Check the plan before a long job instead of running it: its ranks train K steps
        /// (default 3) in f64 on the given data and options, one process trains the same, and
        /// the largest differences in losses, parameters and buffers are reported (exit 1 past
        /// 1e-9 unless the plan says why), with the model's own f32 sensitivity (one process in
        /// f32 against f64). Files go to PLAN.verify/ beside the plan.
        #[arg(long, value_name = "K", num_args = 0..=1, default_missing_value = "3")]
        verify: Option<usize>,
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
    /// Loss: model, causal-lm, cross-entropy, mse or seq2seq; default: the model's scalar
    /// output if it has one, else seq2seq for a model with `decoder_input_ids`, else causal-lm.
    #[arg(long)]
    loss: Option<LossKind>,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Decay of the learning rate after the warm-up (towards --min-lr): constant, cosine, linear.
    #[arg(long, default_value = "constant")]
    lr_schedule: LrShape,
    /// Steps of linear warm-up from lr/N to lr.
    #[arg(long, default_value_t = 0)]
    warmup_steps: usize,
    /// Where cosine and linear schedules decay towards.
    #[arg(long, default_value_t = 0.0)]
    min_lr: f64,
    /// Global gradient-norm limit; 0 disables clipping.
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Floating-point type of the run: f32, f64 or bf16. Default: the plan's precision (f32
    /// without a plan); f64 is the verification override on any plan, and another type that
    /// contradicts the plan's precision is refused.
    #[arg(long)]
    dtype: Option<FloatType>,
    /// Training precision of a run without a plan: f32, bf16 (throughout), bf16-mixed or
    /// fp16-mixed (autocast over fp32 master weights; fp16 with loss scaling). A plan's run
    /// takes the plan's (parallel.precision) and refuses another.
    #[arg(long)]
    precision: Option<Precision>,
    /// fp16-mixed runs: the loss scale of the first step (GradScaler's `init_scale`); it halves
    /// after a step whose gradients hold inf/NaN (skipped on every rank) and doubles after
    /// --loss-scale-window steps in a row without.
    #[arg(long, value_name = "S", default_value_t = 65536.0)]
    loss_scale: f64,
    /// fp16-mixed runs: steps without inf/NaN before the loss scale doubles (`growth_interval`).
    #[arg(long, value_name = "N", default_value_t = 2000)]
    loss_scale_window: u64,
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
    /// load (read every weight) or random (seeded values for external weights, unread).
    #[arg(long, default_value = "load")]
    init: InitChoice,
    /// Intra-op threads (default: libtorch's choice).
    #[arg(long)]
    threads: Option<i32>,
    /// Print one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Seconds any collective or receive may wait before the rank fails.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Where tensors live: cpu, or cuda (the rank's GPU, LOCAL_RANK). Default: cuda when
    /// libtorch sees a GPU, else cpu. Several ranks on GPUs talk by NCCL (a build with
    /// `make check-cuda`), one GPU per rank.
    #[arg(long)]
    device: Option<DeviceKind>,
    /// Ranks may share a GPU (more ranks on a host than GPUs, e.g. a 2-stage pipeline on one
    /// GPU), talking by Gloo through host memory instead of NCCL. No effect on the CPU.
    #[arg(long)]
    share_gpu: bool,
    /// Each rank prints `[rank R] step N` on stderr after every step.
    #[arg(long)]
    progress: bool,
    /// A rank whose busy time per step (the step less its waits on peers, against the plan's
    /// prediction for its stages) exceeds the median rank's by this factor over a window is
    /// named a straggler (in the progress lines and the report).
    #[arg(long, value_name = "F", default_value_t = 1.5)]
    straggler_factor: f64,
    /// Steps per straggler window (0: no straggler watch).
    #[arg(long, value_name = "N", default_value_t = 5)]
    straggler_window: usize,
    /// Train initializers matching this glob (`*`, `?`) that the rules would freeze; matched
    /// against initializer and module parameter names. Repeatable.
    #[arg(long, value_name = "GLOB")]
    trainable: Vec<String>,
    /// Never train initializers matching this glob (wins over --trainable). Repeatable.
    #[arg(long, value_name = "GLOB")]
    frozen: Vec<String>,
    /// After training, write the trained model's tensors under module parameter names, in the
    /// module's layout (`.safetensors` or `.npz`; what `export` writes), for any plan.
    #[arg(long, value_name = "FILE")]
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
    /// When a checkpoint cannot be written (a full disk): stop (every rank) or continue (without it).
    #[arg(long, default_value = "stop")]
    on_checkpoint_error: OnCheckpointError,
    /// Continue from a checkpoint: a `step-N` directory, or a checkpoint directory (its newest
    /// complete checkpoint). `--steps` stays the run's total; the plan may differ from the one
    /// that wrote it (weights and optimizer state are resharded).
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
}

impl TrainArgs {
    /// The run's options, as the run front door takes them.
    fn options(&self) -> RunOptions {
        RunOptions {
            steps: self.steps,
            batch: self.batch,
            seq_len: self.seq_len,
            microbatches: self.microbatches,
            loss: self.loss,
            optimizer: OptimizerOptions {
                lr: self.lr,
                weight_decay: self.weight_decay,
                schedule: self.lr_schedule,
                warmup_steps: self.warmup_steps,
                min_lr: self.min_lr,
                clip: self.clip,
            },
            dtype: self.dtype,
            data: DataOptions { train: self.data.clone(), eval: self.eval_data.clone(), eval_every: self.eval_every, eval_batches: self.eval_batches },
            seed: self.seed,
            init: self.init,
            threads: self.threads,
            timeout: std::time::Duration::from_secs(self.timeout),
            progress: self.progress,
            straggler_factor: self.straggler_factor,
            straggler_window: self.straggler_window,
            params: ParamOptions { trainable: self.trainable.clone(), frozen: self.frozen.clone() },
            save_weights: self.save_weights.clone(),
            checkpoints: CheckpointOptions {
                dir: self.checkpoint_dir.clone(),
                every: self.checkpoint_every,
                keep: self.keep,
                resume: self.resume.clone(),
                on_error: self.on_checkpoint_error,
            },
            precision: self.precision,
            autocast: None,
            loss_scale: LossScaleConfig { initial: self.loss_scale, growth_interval: self.loss_scale_window, ..LossScaleConfig::default() },
            device: DeviceRequest { device: self.device, share_gpu: self.share_gpu },
        }
    }
}

/// Progress of a run on stderr: on a terminal one line updated in place (step, loss, lr,
/// tokens/s, ETA) with validations and checkpoints printed above it; otherwise plain lines as
/// steps complete (none with `--json`, whose report holds them).
struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    tokens_per_step: f64,
}

impl Progress {
    /// For a run of `steps` steps; `shown`: this process reports.
    fn new(steps: usize, shown: bool, json: bool) -> Progress {
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
        Progress { bar, plain: shown && !terminal && !json, tokens_per_step: 0.0 }
    }

    fn line(&self, line: String) {
        if let Some(b) = &self.bar {
            b.println(line);
        } else if self.plain {
            smp_partition::logging::say!("{line}");
        }
    }
}

impl TrainObserver for Progress {
    fn on_start(&mut self, tokens_per_step: i64) {
        self.tokens_per_step = tokens_per_step as f64;
    }

    fn on_step(&mut self, s: &StepRecord) {
        if let Some(b) = &self.bar {
            let rate = if s.time_s > 0.0 { self.tokens_per_step / s.time_s } else { 0.0 };
            b.set_position(s.step as u64);
            b.set_message(format!("loss {:.4}  lr {:.2e}  {rate:.0} tok/s", s.loss, s.lr));
        } else if self.plain {
            smp_partition::logging::say!("step {:>4}  loss {:.6}  lr {:.3e}  {:.3} s", s.step, s.loss, s.lr, s.time_s);
        }
    }

    fn on_checkpoint(&mut self, step: usize, manifest: &Path) {
        self.line(format!("checkpoint after step {step:>4}  {}", manifest.display()));
    }

    fn on_checkpoint_failed(&mut self, _step: usize, error: &str) {
        smp_partition::logging::say!("smp-runner: warning: {error}; training goes on (--on-checkpoint-error continue)");
    }

    fn on_eval(&mut self, e: &EvalRecord) {
        self.line(format!("eval after step {:>4}  val loss {:.6}", e.step, e.loss));
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
    if !smp_partition::runtime::allocator::keep_freed_buffers() {
        tracing::debug!("the C library's allocator keeps its own policy (not glibc)");
    }
    if let Err(e) = run(cli) {
        smp_partition::logging::say!("smp-runner: error: {e:#}");
        // 3: the run failed after it started training, and a restart can resume it; 4 and 5:
        // this rank leaves an elastic job, or stops as others leave it; 6: rank 0 found the
        // rendezvous port taken (a launcher that chose it picks another)
        let code = match e.downcast_ref::<SessionError>() {
            Some(SessionError::Interrupted(RuntimeError::Leave { leaving: true, .. })) => launcher::EXIT_LEFT,
            Some(SessionError::Interrupted(RuntimeError::Leave { leaving: false, .. })) => launcher::EXIT_STOPPED,
            Some(SessionError::Interrupted(RuntimeError::PortInUse { .. })) => launcher::EXIT_PORT_IN_USE,
            Some(SessionError::Interrupted(_)) => 3,
            _ => 1,
        };
        std::process::exit(code);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Eval { model, inputs, outputs, dtype, init, seed, checkpoint, device } => {
            let job = EvalJob { model, inputs, outputs, dtype, init, seed, checkpoint, device: DeviceRequest { device, share_gpu: false } };
            Ok(commands::evaluate(&job)?)
        }
        Command::Export { checkpoint, output, model, external_data } => {
            let e = commands::export_checkpoint(&checkpoint, &output, model.as_deref(), external_data)?;
            match &e.data {
                _ if e.tensors > 0 => smp_partition::logging::say!("smp-runner: wrote {} ({} tensors, step {})", e.path.display(), e.tensors, e.step),
                Some(d) => smp_partition::logging::say!("smp-runner: wrote {} with its data in {} (step {})", e.path.display(), d.display(), e.step),
                None => smp_partition::logging::say!("smp-runner: wrote {} (step {})", e.path.display(), e.step),
            }
            Ok(())
        }
        Command::Train { model, opts } => train(RunTarget::Model(model), &opts),
        Command::Run { plan, opts } => train(RunTarget::Plan(plan), &opts),
        Command::Calibrate { output, comm_json } => match comm_json {
            Some(json) => Ok(calibrate::calibrate_comm_rank(&json)?),
            None => {
                let exe = std::env::current_exe().context("cannot find the smp-runner executable")?;
                eprint!("{}", calibrate::calibrate(&output, &exe)?);
                Ok(())
            }
        },
        Command::PrepareData { files, output, val_fraction, ext, tokenizer } => prepare_data(&files, &output, val_fraction, ext.as_deref(), tokenizer.as_deref()),
        Command::Launch { verify: Some(steps), nproc, nnodes, plan, run_args, .. } => {
            if nnodes != 1 {
                anyhow::bail!("--verify runs on one host (the plan's {nproc} ranks and one process); drop --nnodes");
            }
            let exe = std::env::current_exe().context("cannot find the smp-runner executable")?;
            let report = verify::verify(&exe, nproc, &plan, &run_args, steps.max(1), &plan.with_extension("verify"))?;
            for line in report.lines() {
                smp_partition::logging::say!("smp-runner: {line}");
            }
            if run_args.iter().any(|a| a == "--json") {
                println!("{}", serde_json::to_string(&report)?);
            }
            std::process::exit(if report.passed || report.expected_difference.is_some() { 0 } else { 1 })
        }
        Command::Launch {
            nproc,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            max_restarts,
            restart_backoff,
            restart_port,
            elastic,
            rejoin_timeout,
            drop_stragglers,
            startup_timeout,
            step_timeout,
            checkpoint_timeout,
            device,
            share_gpu,
            plan,
            mut run_args,
            verify: None,
        } => {
            let exe = std::env::current_exe().context("cannot find the smp-runner executable")?;
            let asked = DeviceRequest { device, share_gpu };
            if asked != DeviceRequest::default() {
                if run_args.iter().any(|a| a == "--device" || a.starts_with("--device=") || a == "--share-gpu") {
                    anyhow::bail!("--device/--share-gpu are given both to launch and in the ranks' options; give them once");
                }
                // one refusal here rather than one per rank: rank 0 of this host stands for all
                asked.check(Ranks { local_rank: 0, local_world: nproc, world: nproc * nnodes })?;
                run_args.extend(asked.args());
            }
            let nodes = launcher::Nodes { nnodes, node_rank, master_addr, master_port };
            let secs = std::time::Duration::from_secs;
            let timeouts = launcher::Timeouts { startup: secs(startup_timeout), step: secs(step_timeout), checkpoint: secs(checkpoint_timeout) };
            let restarts = launcher::Restarts { max: max_restarts, backoff: secs(restart_backoff), port: restart_port, timeouts, ..Default::default() };
            let code = match elastic {
                Some((min, max)) => {
                    let planner = replan::Planner;
                    let elastic = Elastic { min, max, rejoin_timeout: secs(rejoin_timeout), drop_stragglers, replanner: &planner };
                    elastic::launch_elastic(&exe, nproc, &nodes, &restarts, &elastic, &plan, &run_args)?
                }
                None => {
                    if drop_stragglers.is_some() {
                        anyhow::bail!("--drop-stragglers applies under --elastic MIN:MAX (a dropped rank's device leaves the job)");
                    }
                    launcher::launch_on(&exe, nproc, &nodes, &restarts, &plan, &run_args)?
                }
            };
            std::process::exit(code)
        }
    }
}

/// `train` and `run`: the run front door opens the run, the progress observer shows it, and
/// the reporting process prints its report with `--json`.
fn train(target: RunTarget, o: &TrainArgs) -> Result<()> {
    let session = RunSession::open(target, o.options())?;
    for note in session.notes() {
        smp_partition::logging::say!("smp-runner: {note}");
    }
    let shown = session.reports();
    let mut progress = Progress::new(session.steps(), shown, o.json);
    let report = session.run(&mut progress)?;
    if let Some(b) = &progress.bar {
        b.finish();
    }
    if shown && o.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

/// `--elastic MIN:MAX`.
fn parse_elastic(s: &str) -> Result<(usize, usize), String> {
    let bad = || format!("`{s}`: expected MIN:MAX devices, e.g. 2:4");
    let (a, b) = s.split_once(':').ok_or_else(bad)?;
    let (min, max) = (a.trim().parse::<usize>().map_err(|_| bad())?, b.trim().parse::<usize>().map_err(|_| bad())?);
    if min == 0 || min > max {
        return Err(format!("`{s}`: MIN must be at least 1 and at most MAX"));
    }
    Ok((min, max))
}

/// Re-planning for an elastic job: the plan's recorded request, planned again for the devices
/// left (the planner's front door, `compile`).
mod replan {
    use std::path::{Path, PathBuf};

    use smp_partition::cost::ClusterSpec;
    use smp_partition::plan::Plan;
    use smp_partition::runtime::launch::elastic::Replanner;

    /// The planner, as `smp-partition` runs it.
    pub struct Planner;

    /// The model file `plan` names, as a run of the plan at `path` finds it (relative to the
    /// plan's directory when not found as given), absolute.
    fn model_of(plan: &Plan, path: &Path) -> PathBuf {
        let given = PathBuf::from(&plan.model.path);
        let found = if given.is_relative() && !given.exists() { path.parent().map(|d| d.join(&given)).filter(|m| m.exists()).unwrap_or(given) } else { given };
        std::fs::canonicalize(&found).unwrap_or(found)
    }

    impl Replanner for Planner {
        fn replan(&self, plan: &Plan, path: &Path, devices: usize) -> Result<Plan, String> {
            let request = plan.request.as_ref().ok_or_else(|| {
                format!("plan `{}` records no planning request (it was made before plans recorded one): make it again with this smp-partition to run it elastically", path.display())
            })?;
            let mut opts = request.options().map_err(|e| format!("plan `{}`: {e}", path.display()))?;
            // the global batch the run trains with; how it is split is the planner's again
            opts.global_batch = Some(plan.global_batch);
            opts.dp = None;
            opts.microbatches = None;
            opts.active_microbatches = None;
            opts.sharded_dp = None;
            // degrees the user fixed stay while they divide the devices; otherwise searched
            let fixed: usize = [opts.pp, opts.tp, opts.cp].iter().flatten().product();
            if devices % fixed.max(1) != 0 {
                (opts.pp, opts.tp, opts.cp, opts.layout) = (None, None, None, None);
            }
            if opts.tp.is_none() {
                opts.etp = None;
            }
            let fixed: usize = [opts.pp, opts.tp, opts.cp].iter().flatten().product();
            // folded expert groups span tp · dp / etp ranks; otherwise dp
            let room = match (opts.etp, opts.tp) {
                (Some(et), Some(tp)) if et != tp => devices / fixed.max(1) * tp / et.max(1),
                _ => devices / fixed.max(1),
            };
            if opts.ep.is_some_and(|e| room % e != 0) {
                (opts.ep, opts.etp) = (None, None);
            }
            let cluster_name = request.cluster_with(devices);
            opts.cluster_flag = Some(cluster_name.clone());
            let host = smp_partition::host::machine_facts().map_err(|e| e.to_string())?;
            let cluster = ClusterSpec::parse_on(&cluster_name, &host).map_err(|e| format!("--cluster {cluster_name}: {e}"))?;
            let model = model_of(plan, path);
            smp_partition::compile(&model, &cluster, &opts).map_err(|e| {
                let mut m = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    m += &format!(": {s}");
                    src = s.source();
                }
                m
            })
        }

        fn least_devices(&self, plan: &Plan, path: &Path, most: usize) -> Option<usize> {
            (1..=most).find(|&n| self.replan(plan, path, n).is_ok())
        }
    }
}

fn prepare_data(files: &[PathBuf], output: &Path, val_fraction: f64, ext: Option<&str>, tokenizer: Option<&Path>) -> Result<()> {
    let tokenizer = match tokenizer {
        Some(path) => data::TextTokenizer::from_file(path)?,
        None => data::TextTokenizer::Bytes,
    };
    let p = data::prepare(files, ext, output, val_fraction, &tokenizer)?;
    if let Some(first) = p.not_utf8.first() {
        smp_partition::logging::say!(
            "smp-runner: warning: {} files are not UTF-8 text (e.g. {}); their invalid bytes were tokenized as U+FFFD",
            p.not_utf8.len(),
            first.display()
        );
    }
    smp_partition::logging::say!("smp-runner: wrote {} ({} tokens from {} files)", output.display(), p.train.0, p.train.1.len());
    if !p.val.1.is_empty() {
        smp_partition::logging::say!("smp-runner: wrote {} ({} tokens from {} files)", data::val_path(output).display(), p.val.0, p.val.1.len());
    }
    Ok(())
}
