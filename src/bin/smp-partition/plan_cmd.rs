//! The main job: `smp-partition MODEL.onnx [options]` plans a model and writes the plan.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use smp_partition::codegen;
use smp_partition::cost::ClusterSpec;
use smp_partition::plan::build::{self, ModelRef};
use smp_partition::plan::config::{
    Baseline, Checkpointing, Constraints, Layout, Optimize, Placement, PlanRequest, Schedule, SmpConfig,
    parse_dim,
};
use smp_partition::plan::{Plan, io, report, validate};
use smp_partition::solve::{self, Progress};

use crate::graph_cmd::{DimArgs, load_and_analyze};

/// Options of the planning job (flattened into the top-level command).
#[derive(Args, Debug, Default)]
pub struct PlanArgs {
    /// The ONNX model to plan.
    #[arg(value_name = "MODEL.onnx")]
    pub model: Option<PathBuf>,
    /// Cluster: a preset (a100-40gb, a100-80gb, h100-80gb, h200, v100-16gb, cpu) with an
    /// optional device count, or a cluster TOML file.
    #[arg(long, value_name = "PRESET[:N]|FILE.toml", default_value = "h100-80gb:8")]
    pub cluster: String,
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
    #[arg(long, value_name = "gpipe|1f1b|interleaved:V|zb-h1")]
    pub schedule: Option<Schedule>,
    /// Activation checkpointing.
    #[arg(long, value_name = "auto|none|full")]
    pub checkpointing: Option<Checkpointing>,
    /// Objective: speed, or least memory within 5 % of the fastest step.
    #[arg(long, value_name = "speed|memory")]
    pub optimize: Option<Optimize>,
    /// Mesh axis order (cluster = DPT, spread = TPD; the last axis gets the fastest link).
    #[arg(long, value_name = "cluster|spread|DPT|...")]
    pub placement: Option<Placement>,
    /// Sequence parallelism in tensor-parallel layers (Megatron-LM's): reduce-scatter over the
    /// tokens instead of all-reduce, norms and residuals on each rank's tokens.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Manual pipeline cuts over `graph`'s layers, e.g. "0-11|12-23".
    #[arg(long, value_name = "FIRST-LAST|...")]
    pub layout: Option<Layout>,
    /// Memory per device to plan for, in GiB (default: the device's).
    #[arg(long, value_name = "GIB")]
    pub memory_limit: Option<f64>,
    /// Solver time limit in seconds; the plan then says `feasible` with its gap.
    #[arg(long, value_name = "SECONDS")]
    pub time_limit: Option<f64>,
    /// SageMaker model-parallel parameters as JSON (SMP names).
    #[arg(long, value_name = "SMP.json")]
    pub config: Option<PathBuf>,
    /// Plan the way a peer would, for comparison.
    #[arg(long, value_name = "megatron|uniform|parameters")]
    pub baseline: Option<Baseline>,
    /// Write the plan here.
    #[arg(short = 'o', long = "output", value_name = "PLAN.json")]
    pub output: Option<PathBuf>,
    /// Print the plan as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

impl PlanArgs {
    /// The flags as a library request.
    pub fn request(&self) -> PlanRequest {
        PlanRequest {
            global_batch: self.global_batch,
            seq_len: self.seq_len,
            pp: self.pp,
            tp: self.tp,
            dp: self.dp,
            zero: self.zero,
            sharded_dp: self.sharded_dp,
            microbatches: self.microbatches,
            schedule: self.schedule,
            checkpointing: self.checkpointing,
            optimize: self.optimize,
            placement: self.placement,
            layout: self.layout.clone(),
            memory_limit_gib: self.memory_limit,
            time_limit_s: self.time_limit,
            baseline: self.baseline,
        }
    }

    /// Flags and `--config` merged and checked.
    pub fn constraints(&self) -> Result<Constraints> {
        let config = match &self.config {
            Some(path) => Some(SmpConfig::load(path)?),
            None => None,
        };
        let c = Constraints::resolve(&self.request(), config)?;
        for key in &c.ignored_config_keys {
            tracing::warn!("--config: `{key}` does not affect planning; ignored");
        }
        Ok(c)
    }
}

/// Runs the planning job.
pub fn run(args: &PlanArgs) -> Result<ExitCode> {
    let Some(model) = &args.model else {
        eprintln!("error: give MODEL.onnx to plan, or a subcommand (graph, inspect); see --help");
        return Ok(ExitCode::from(2));
    };
    let constraints = args.constraints()?;
    let plan = make_plan(model, args, &constraints)?;
    emit(&plan, args)?;
    Ok(ExitCode::SUCCESS)
}

/// Model → layered graph → cluster → solver → plan.
fn make_plan(model: &Path, args: &PlanArgs, constraints: &Constraints) -> Result<Plan> {
    let started = Instant::now();
    let host = smp_partition::host::machine_facts()?;
    let cluster = ClusterSpec::parse_on(&args.cluster, &host).with_context(|| format!("--cluster {}", args.cluster))?;
    constraints.check_devices(cluster.devices, &args.cluster)?;
    let dims = DimArgs {
        global_batch: args.global_batch,
        seq_len: args.seq_len.map(|s| s as i64),
        dims: args.dim.clone(),
    };
    let analysed = load_and_analyze(model, &dims)?;
    let lg = &analysed.lg;
    constraints.check_layers(lg.layers.len(), &model.display().to_string())?;
    let default_batch = cluster.devices as u64 * lg.dims.graph_batch.max(1) as u64;
    if args.global_batch.is_none() {
        eprintln!("note: --global-batch not given; planning for {default_batch} samples per step");
    }
    let mut cfg = constraints.to_plan_config(default_batch);
    cfg.sequence_parallel = args.sequence_parallel;
    let model_ref = ModelRef { path: model.display().to_string(), sha256: analysed.sha256.clone() };
    let plan_with = |cfg: &solve::PlanConfig| -> Result<(Plan, Result<codegen::CodegenSection>)> {
        let mut plan = search_and_build(lg, &cluster, cfg, &model_ref, args, started)
            .with_context(|| format!("planning {} on {}", model.display(), args.cluster))?;
        plan.parallel.sequence_parallel = args.sequence_parallel && plan.parallel.tp > 1;
        let input = plan.codegen_input().context("the planner produced an inconsistent plan (a bug)")?;
        let section = codegen::encode::build(lg, &input).with_context(|| {
            format!(
                "code generation for {} (pp={}, tp={}, dp={}): the planner chose a split codegen cannot emit",
                model.display(),
                plan.parallel.pp,
                plan.parallel.tp,
                plan.parallel.dp
            )
        });
        Ok((plan, section))
    };
    let (mut plan, section) = plan_with(&cfg)?;
    let section = match section {
        Ok(section) => section,
        // a searched tensor degree some layer cannot be split at: search again over the
        // degrees codegen can emit for every layer, each fixed, and keep the fastest
        Err(e) if cfg.constraints.tp.is_none() && plan.parallel.tp > 1 => {
            let sharder = codegen::Sharder::new(lg).context("code generation: preparing the sharder")?.with_sequence_parallel(args.sequence_parallel);
            let splits = |t: usize| t == 1 || (0..lg.layers.len()).all(|l| sharder.shard_layer_strict(l, t).is_ok());
            let mut best: Option<(Plan, codegen::CodegenSection)> = None;
            for t in (1..=cluster.devices_per_node.max(1)).filter(|&t| cluster.devices % t == 0 && t != plan.parallel.tp && splits(t)) {
                let mut fixed = cfg.clone();
                fixed.constraints.tp = Some(t);
                if let Ok((p, Ok(sec))) = plan_with(&fixed)
                    && best.as_ref().is_none_or(|(b, _)| p.predicted.step_time_s < b.predicted.step_time_s)
                {
                    best = Some((p, sec));
                }
            }
            let (p, sec) = best.ok_or(e).context("no tensor degree that codegen can split gives a plan")?;
            eprintln!("note: tp {} does not split every layer; planned again over the degrees that do", plan.parallel.tp);
            plan = p;
            sec
        }
        Err(e) => return Err(e),
    };
    if args.sequence_parallel && plan.parallel.tp == 1 {
        eprintln!("note: --sequence-parallel has no effect at tp = 1");
    }
    plan.codegen = Some(section);
    validate(&plan).context("the planner produced an inconsistent plan (a bug)")?;
    Ok(plan)
}

/// Searches (with a progress bar past one second) and builds the plan, without codegen.
fn search_and_build(
    lg: &smp_partition::ir::LayeredGraph,
    cluster: &ClusterSpec,
    cfg: &solve::PlanConfig,
    model_ref: &ModelRef,
    args: &PlanArgs,
    started: Instant,
) -> Result<Plan, solve::SolveError> {
    let mut bar: Option<ProgressBar> = None;
    let mut progress = |p: Progress| {
        if bar.is_none() && started.elapsed().as_secs_f64() > 1.0 {
            let b = ProgressBar::new(p.total);
            b.set_style(
                ProgressStyle::with_template("{elapsed} [{bar:30}] {pos}/{len} candidates {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar = Some(b);
        }
        if let Some(b) = &bar {
            b.set_length(p.total);
            b.set_position(p.done);
            if let Some(best) = p.best_step_s {
                b.set_message(format!("best step {best:.4} s"));
            }
        }
    };
    let decision = solve::plan(lg, cluster, cfg, &mut progress)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(build::from_decision(&decision, lg, cluster, cfg, model_ref, args.seq_len, &args.dim, started.elapsed().as_secs_f64()))
}

/// Writes the plan (`-o`) and prints it (`--json`) or its report.
fn emit(plan: &Plan, args: &PlanArgs) -> Result<()> {
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
