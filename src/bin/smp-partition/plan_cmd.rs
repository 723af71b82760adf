//! The main job: `smp-partition MODEL.onnx [options]` plans a model and writes the plan.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use smp_partition::compile::{Analysed, Observer, Stage};
use smp_partition::cost::ClusterSpec;
use smp_partition::ir::{OffloadRule, Precision, ScheduleKind, SelectivePolicy};
use smp_partition::compile::ParamOptions;
use smp_partition::engines::Engine;
use smp_partition::plan::{Plan, io, report};
use smp_partition::solve::options::{Layout, parse_checkpointing, parse_dim, parse_layer_set, parse_schedule};
use smp_partition::solve::{Baseline, CheckpointRule, Optimize, Placement, PlanOptions, Progress, SmpConfig};

/// Options of the planning job (flattened into the top-level command).
#[derive(Args, Debug, Default)]
pub struct PlanArgs {
    /// The ONNX model to plan.
    #[arg(value_name = "MODEL.onnx")]
    pub model: Option<PathBuf>,
    /// Cluster: a preset (a100-40gb, a100-80gb, h100-80gb, h200, v100-16gb, cpu) with an
    /// optional device count, or a cluster TOML file [default: h100-80gb:8; with
    /// --from-engine, h100-80gb with the launcher's device count]
    #[arg(long, value_name = "PRESET[:N]|FILE.toml")]
    pub cluster: Option<String>,
    #[command(flatten)]
    pub flags: PlanFlags,
    /// Write the plan here.
    #[arg(short = 'o', long = "output", value_name = "PLAN.json")]
    pub output: Option<PathBuf>,
    /// Print the plan as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Plan the configuration a team runs in another engine today and print it beside the
    /// automatic plan: `megatron:ARGS`, `torchtitan:TOML` (or its command line),
    /// `deepspeed:JSON[,LAUNCHER]`, each a file or the text itself. `-o` and `--json` give that
    /// configuration's plan.
    #[arg(long, value_name = "ENGINE:CONFIG")]
    pub from_engine: Option<String>,
    /// Also write the plan as this engine's configuration (with --from-engine: the automatic
    /// plan), saying what the engine cannot express, priced.
    #[arg(long, value_name = "megatron|torchtitan|deepspeed|smp")]
    pub emit: Option<Engine>,
    /// Write --emit's files into this directory (default: print them).
    #[arg(long, value_name = "DIR", requires = "emit")]
    pub emit_dir: Option<PathBuf>,
    /// Price only the configuration given by the flags (settings not given take their
    /// defaults: pp, tp, cp, ep 1, dp the devices left, ZeRO 0, 1F1B, no recompute, no
    /// offloading): memory per device by part against the device's capacity, and the step
    /// time, without searching other configurations. With --json, as one JSON object.
    #[arg(long, conflicts_with_all = ["from_engine", "emit", "output"])]
    pub estimate: bool,
}

/// The cluster when `--cluster` is not given.
pub const DEFAULT_CLUSTER: &str = "h100-80gb:8";

/// What the user asks of a plan, cluster aside (shared by planning and `sweep`).
#[derive(Args, Debug, Default)]
pub struct PlanFlags {
    /// Samples per optimizer step, over all data-parallel replicas.
    #[arg(long, value_name = "B")]
    pub global_batch: Option<u64>,
    /// Binds the symbolic sequence dimension.
    #[arg(long, value_name = "S")]
    pub seq_len: Option<u64>,
    /// Binds any other symbolic dimension (repeatable).
    #[arg(long, value_name = "NAME=V", value_parser = parse_dim)]
    pub dim: Vec<(String, i64)>,
    /// Pipeline-parallel degree (omitted = searched).
    #[arg(long, value_name = "N")]
    pub pp: Option<usize>,
    /// Tensor-parallel degree (omitted = searched).
    #[arg(long, value_name = "N")]
    pub tp: Option<usize>,
    /// Data-parallel degree (omitted = searched).
    #[arg(long, value_name = "N")]
    pub dp: Option<usize>,
    /// Context-parallel degree: ranks each microbatch's sequence is split over (omitted = searched).
    #[arg(long, value_name = "N")]
    pub cp: Option<usize>,
    /// Expert-parallel degree: ranks a mixture of experts' experts are split over, dividing the
    /// data-parallel degree (omitted = searched; 1 for dense models).
    #[arg(long, value_name = "N")]
    pub ep: Option<usize>,
    /// Expert-tensor-parallel degree: ranks each expert's weights are split over (Megatron-Core's
    /// expert-tensor-parallel size) [default: tp]; below tp the expert groups fold over tensor ×
    /// data ranks, ep · etp dividing tp · dp.
    #[arg(long, value_name = "N")]
    pub etp: Option<usize>,
    /// Expert-parallel load imbalance: the busiest rank of an expert group runs this many times
    /// the mean routed tokens [default: 1.1]
    #[arg(long, value_name = "F")]
    pub expert_imbalance: Option<f64>,
    /// Price each merged forward–backward pair's expert all-to-alls beside the other
    /// microbatch's compute, as Megatron-Core's combined 1F1B runs them
    /// (`--overlap-moe-expert-parallel-comm`; with expert parallelism, no pipeline or an
    /// interleaved one). smp-runner runs them in turn.
    #[arg(long)]
    pub overlap_expert_comm: bool,
    /// Price each layer's gradient reduction (all-reduce, or ZeRO's reduce-scatter) beside the
    /// rest of the backward, as the engines' bucketed reductions run it (Megatron's
    /// `--overlap-grad-reduce`, Megatron-FSDP). smp-runner reduces after the backward.
    #[arg(long)]
    pub overlap_grad_sync: bool,
    /// Price the blocks' linear layers in fp8 with per-tensor dynamic scaling (torchao's
    /// Float8Linear, Transformer Engine's fp8 recipes): their products at the device's fp8
    /// rate, beside their operands' casts (H100, H200). smp-runner runs them in 16 bits.
    #[arg(long)]
    pub float8_linears: bool,
    /// ZeRO stage (omitted = searched).
    #[arg(long, value_name = "0..3", value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: Option<u8>,
    /// Sharded data parallelism: ZeRO-3 over groups of N replicas.
    #[arg(long, value_name = "N")]
    pub sharded_dp: Option<usize>,
    /// Microbatches per step (omitted = searched).
    #[arg(long, value_name = "M")]
    pub microbatches: Option<usize>,
    /// Pipeline schedule (omitted = searched).
    #[arg(long, value_name = "gpipe|1f1b|interleaved:V|zb-h1", value_parser = parse_schedule)]
    pub schedule: Option<ScheduleKind>,
    /// Activation recompute: chosen per layer (auto: none or the whole layer; auto-selective:
    /// also the norms' and activation functions' outputs alone rebuilt, a longer search), none,
    /// selective (every layer rebuilds its norms' and activation functions' outputs, a mixture
    /// of experts its experts' activations) or full.
    #[arg(long, value_name = "auto|auto-selective|none|selective|full", value_parser = parse_checkpointing)]
    pub checkpointing: Option<CheckpointRule>,
    /// Recompute exactly these layers of `graph` (e.g. "1-7,9"; "none"), the others not.
    #[arg(long, value_name = "LIST", value_parser = parse_layer_set, conflicts_with = "checkpointing")]
    pub recompute_layers: Option<BTreeSet<usize>>,
    /// Rebuild the norms' and activation functions' outputs of exactly these layers (selective
    /// recompute), beside `--recompute-layers`; the others keep theirs.
    #[arg(long, value_name = "LIST", value_parser = parse_layer_set, conflicts_with = "checkpointing")]
    pub selective_layers: Option<BTreeSet<usize>>,
    /// What selective recompute rebuilds: pointwise (the norms' and activation functions'
    /// outputs, the default) or op (torchtitan's per-op policy: attention's and every other
    /// weight product's outputs kept, the rest of the layer rebuilt from them).
    #[arg(long, value_name = "pointwise|op")]
    pub selective_policy: Option<SelectivePolicy>,
    /// Objective: speed, or least memory within 5 % of the fastest step.
    #[arg(long, value_name = "speed|memory")]
    pub optimize: Option<Optimize>,
    /// Mesh axis order (cluster = DPT, spread = TPD; the last axis gets the fastest link).
    #[arg(long, value_name = "cluster|spread|DPT|...")]
    pub placement: Option<Placement>,
    /// Force sequence parallelism in tensor-parallel layers (Megatron-LM's): reduce-scatter
    /// over the tokens instead of all-reduce, norms and residuals on each rank's tokens.
    /// Default: searched (every tensor-parallel candidate priced with and without it).
    #[arg(long, conflicts_with = "no_sequence_parallel")]
    pub sequence_parallel: bool,
    /// Forbid sequence parallelism (plain tensor parallelism in every tensor-parallel layer).
    #[arg(long)]
    pub no_sequence_parallel: bool,
    /// Training precision the plan is priced for and the runner executes (default: bf16-mixed
    /// on GPU presets, f32 on `cpu`; SMP's `fp16`/`bf16`/`fp16_params` keys say it too).
    #[arg(long, value_name = "f32|bf16|bf16-mixed|fp16-mixed")]
    pub precision: Option<Precision>,
    /// Offload checkpointed layers' kept inputs to host memory between forward and backward:
    /// `auto` where memory needs it (the default), `on` for every checkpointed layer, `off`
    /// (SMP's `offload_activations` / `sm_activation_offloading` say it too).
    #[arg(long, value_name = "auto|on|off")]
    pub offload_activations: Option<OffloadRule>,
    /// Microbatches of offloaded inputs brought back ahead of their backward (default 4, as
    /// SMP's `activation_loading_horizon`).
    #[arg(long, value_name = "N")]
    pub activation_loading_horizon: Option<usize>,
    /// Manual pipeline cuts over `graph`'s layers, e.g. "0-11|12-23".
    #[arg(long, value_name = "FIRST-LAST|...")]
    pub layout: Option<Layout>,
    /// Memory per device to plan for, in GiB (default: the device's).
    #[arg(long, value_name = "GIB")]
    pub memory_limit: Option<f64>,
    /// Solver time limit in seconds; the plan then says `feasible` with its gap.
    #[arg(long, value_name = "SECONDS")]
    pub time_limit: Option<f64>,
    /// Train initializers matching this glob (`*`, `?`) that the rules would freeze; matched
    /// against initializer and module parameter names. Recorded in the plan. Repeatable.
    #[arg(long, value_name = "GLOB")]
    pub trainable: Vec<String>,
    /// Never train initializers matching this glob (wins over --trainable): no gradients or
    /// optimizer state are planned for them. Recorded in the plan. Repeatable.
    #[arg(long, value_name = "GLOB")]
    pub frozen: Vec<String>,
    /// SageMaker model-parallel parameters as JSON (SMP names).
    #[arg(long, value_name = "SMP.json")]
    pub config: Option<PathBuf>,
    /// Plan the way a peer would, for comparison.
    #[arg(long, value_name = "megatron|uniform|parameters")]
    pub baseline: Option<Baseline>,
}

impl PlanArgs {
    /// The flags and `--config` merged and checked, as the library's options.
    pub fn options(&self) -> Result<PlanOptions> {
        self.flags.options(self.cluster_text())
    }

    /// `--cluster` as given, or the default.
    pub fn cluster_text(&self) -> &str {
        self.cluster.as_deref().unwrap_or(DEFAULT_CLUSTER)
    }
}

impl PlanFlags {
    /// The flags and `--config` merged and checked, as the library's options for the cluster
    /// named `cluster` (as the user wrote it, for messages).
    pub fn options(&self, cluster: &str) -> Result<PlanOptions> {
        let flags = PlanOptions {
            global_batch: self.global_batch,
            seq_len: self.seq_len,
            dims: self.dim.clone(),
            pp: self.pp,
            tp: self.tp,
            dp: self.dp,
            cp: self.cp,
            ep: self.ep,
            etp: self.etp,
            expert_imbalance: self.expert_imbalance,
            expert_overlap: self.overlap_expert_comm.then_some(true),
            grad_overlap: self.overlap_grad_sync.then_some(true),
            float8_linears: self.float8_linears.then_some(true),
            zero: self.zero,
            sharded_dp: self.sharded_dp,
            microbatches: self.microbatches,
            schedule: self.schedule,
            checkpointing: self.checkpointing,
            checkpointed_layers: self.recompute_layers.clone(),
            selective_layers: self.selective_layers.clone(),
            selective_policy: self.selective_policy,
            optimize: self.optimize,
            placement: self.placement,
            layout: self.layout.clone(),
            memory_limit_gib: self.memory_limit,
            time_limit_s: self.time_limit,
            baseline: self.baseline,
            sequence_parallel: match (self.sequence_parallel, self.no_sequence_parallel) {
                (true, _) => Some(true),
                (_, true) => Some(false),
                _ => None,
            },
            precision: self.precision,
            offload: self.offload_activations,
            loading_horizon: self.activation_loading_horizon,
            params: ParamOptions { trainable: self.trainable.clone(), frozen: self.frozen.clone() },
            cluster_flag: Some(cluster.to_string()),
            ..PlanOptions::default()
        };
        let config = match &self.config {
            Some(path) => Some(SmpConfig::load(path)?),
            None => None,
        };
        let options = flags.resolve(config)?;
        for key in &options.ignored_config_keys {
            tracing::warn!("--config: `{key}` does not affect planning; ignored");
        }
        Ok(options)
    }
}

/// Runs the planning job.
pub fn run(args: &PlanArgs) -> Result<ExitCode> {
    let Some(model) = &args.model else {
        eprintln!("error: give MODEL.onnx to plan, or a subcommand (graph, inspect, sweep); see --help");
        return Ok(ExitCode::from(2));
    };
    if let Some(spec) = &args.from_engine {
        return crate::from_engine_cmd::run(model, spec, args);
    }
    let options = args.options()?;
    let host = smp_partition::host::machine_facts()?;
    let cluster = ClusterSpec::parse_on(args.cluster_text(), &host).with_context(|| format!("--cluster {}", args.cluster_text()))?;
    let mut cli = CliObserver::new();
    if args.estimate {
        let estimate = smp_partition::estimate(model, &cluster, &options, &mut cli);
        cli.clear_bar();
        let estimate = estimate?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&estimate.report())?);
        } else {
            print!("{}", estimate.render());
        }
        return Ok(ExitCode::SUCCESS);
    }
    let plan = smp_partition::compile_observed(model, &cluster, &options, &mut cli);
    cli.clear_bar();
    let plan = plan?;
    if let Some(w) = plan.batch_statistics_warning() {
        eprintln!("warning: {w}");
    }
    let p = &plan.parallel;
    if options.expert_overlap == Some(true) && !p.expert_overlap {
        eprintln!("warning: --overlap-expert-comm had no effect: combined 1F1B merges passes only with expert parallelism and no pipeline or an interleaved one (this plan: ep {}, {} over pp {}); priced with the all-to-alls in turn", p.ep, p.schedule, p.pp);
    }
    if options.grad_overlap == Some(true) && !p.grad_overlap {
        eprintln!("warning: --overlap-grad-sync had no effect: the plan has no data-parallel replicas to reduce gradients over");
    }
    emit(&plan, args)?;
    if let Some(engine) = args.emit {
        let analysed = smp_partition::compile::analyze_for(model, &options).with_context(|| format!("reading {}", model.display()))?;
        emit_engine(engine, &plan, &analysed, &cluster, args)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `--emit ENGINE`: the plan as the engine's configuration, after the plan's own output
/// (which `--json` keeps to one object: the emission then goes to stderr's notes only as
/// files under `--emit-dir`).
pub fn emit_engine(engine: Engine, plan: &Plan, analysed: &Analysed, cluster: &ClusterSpec, args: &PlanArgs) -> Result<()> {
    let emission = smp_partition::engines::emit(engine, plan, analysed, cluster).with_context(|| format!("--emit {}", engine.name()))?;
    if args.json {
        if args.emit_dir.is_none() {
            eprintln!("note: --emit with --json writes the configuration only with --emit-dir");
        }
        for l in emission.gap_lines() {
            eprintln!("note: {l}");
        }
        if let Some(dir) = &args.emit_dir {
            crate::emit_cmd::show(&emission, Some(dir), true).map(|_| ())?;
        }
        return Ok(());
    }
    println!();
    println!("{} configuration:", engine);
    crate::emit_cmd::show(&emission, args.emit_dir.as_deref(), false)
}

/// Notes on stderr, and a progress bar once the search runs past one second.
pub struct CliObserver {
    started: Instant,
    bar: Option<ProgressBar>,
}

impl CliObserver {
    /// An observer whose clock starts now.
    pub fn new() -> CliObserver {
        CliObserver { started: Instant::now(), bar: None }
    }

    /// Removes the progress bar.
    pub fn clear_bar(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

impl Observer for CliObserver {
    fn stage(&mut self, stage: Stage) {
        if stage > Stage::Solve {
            self.clear_bar();
        }
    }

    fn progress(&mut self, p: Progress) {
        if self.bar.is_none() && self.started.elapsed().as_secs_f64() > 1.0 {
            let b = ProgressBar::new(p.total);
            b.set_style(
                ProgressStyle::with_template("{elapsed} [{bar:30}] {pos}/{len} candidates {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            self.bar = Some(b);
        }
        if let Some(b) = &self.bar {
            b.set_length(p.total);
            b.set_position(p.done);
            if let Some(best) = p.best_step_s {
                b.set_message(format!("best step {best:.4} s"));
            }
        }
    }

    fn note(&mut self, note: &str) {
        eprintln!("note: {note}");
    }
}

/// Writes the plan (`-o`) and prints it (`--json`) or its report.
pub fn emit(plan: &Plan, args: &PlanArgs) -> Result<()> {
    if let Some(path) = &args.output {
        io::save(plan, path).with_context(|| format!("writing the plan to {}", path.display()))?;
    }
    if args.json {
        println!("{}", io::to_json(plan));
    } else {
        print!("{}", report::render(plan));
        if let Some(path) = &args.output {
            println!("plan written to {}", path.display());
        }
    }
    Ok(())
}
