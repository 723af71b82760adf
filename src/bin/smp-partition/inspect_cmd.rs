//! `smp-partition inspect PLAN.json`: explain a plan.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;

use smp_partition::codegen::lower::{LowerOptions, lower_schedule};
use smp_partition::cost::{ClusterSpec, CommModel, in_flight};
use smp_partition::ir::ScheduleKind;
use smp_partition::plan::{Plan, dot, io, report};
use smp_partition::sim::{CostTable, chrome_trace, simulate};

use crate::graph_cmd::DimArgs;

/// Options of `inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The plan file.
    #[arg(value_name = "PLAN.json")]
    pub plan: PathBuf,
    /// Print the plan and the findings as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Write the simulated timeline as a Perfetto/Chrome trace.
    #[arg(long, value_name = "TRACE.json")]
    pub trace: Option<PathBuf>,
    /// Write the model graph coloured by stage as Graphviz DOT (needs the plan's model file).
    #[arg(long, value_name = "GRAPH.dot")]
    pub dot: Option<PathBuf>,
}

/// Runs `inspect`.
pub fn run(args: &InspectArgs) -> Result<ExitCode> {
    let plan = io::load(&args.plan)?;
    if let Some(path) = &args.trace {
        let trace = trace(&plan)?;
        std::fs::write(path, serde_json::to_string(&trace)?)
            .with_context(|| format!("writing the trace to {}", path.display()))?;
    }
    if let Some(path) = &args.dot {
        let text = graph_dot(&plan, &args.plan)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report::to_json_with_report(&plan))?);
    } else {
        print!("{}", report::render(&plan));
    }
    Ok(ExitCode::SUCCESS)
}

/// Lowers the plan's schedule for one data-parallel replica and tensor rank and replays it
/// with the plan's stage times.
fn trace(plan: &Plan) -> Result<serde_json::Value> {
    let kind = plan.parallel.schedule;
    let (p, m) = (plan.parallel.pp, plan.parallel.microbatches);
    let ranks: Vec<usize> = (0..p)
        .map(|r| plan.stages_of_rank(r).next().and_then(|s| s.ranks.first().copied()).unwrap_or(r))
        .collect();
    let opts = LowerOptions {
        ranks,
        boundary_bytes: plan.stages.iter().map(|s| s.output_bytes).collect(),
        epilogue: Vec::new(),
    };
    let programs = lower_schedule(kind, p, m, &opts).context("lowering the plan's schedule")?;
    // The plan names a preset, or records the machine of a `cpu` plan; its links are what the
    // trace needs (a cluster file that has moved makes communication free in the trace).
    let cluster = match &plan.cluster.machine {
        Some(machine) => ClusterSpec::cpu(machine, Some(plan.cluster.devices)).ok(),
        None => ClusterSpec::parse(&format!("{}:{}", plan.cluster.preset, plan.cluster.devices)).ok(),
    };
    let comm = cluster.map(|c| CommModel::new(&c));
    let weight_share = if matches!(kind, ScheduleKind::ZbH1) { 0.5 } else { 0.0 };
    let costs = CostTable {
        forward: plan.stages.iter().map(|s| s.forward_s).collect(),
        backward_input: plan.stages.iter().map(|s| s.backward_s * (1.0 - weight_share)).collect(),
        backward_weight: plan.stages.iter().map(|s| s.backward_s * weight_share).collect(),
        activation_bytes: plan
            .stages
            .iter()
            .map(|s| s.memory_bytes.activations as f64 / in_flight(kind, p, m, s.pp_rank + 1).max(1.0))
            .collect(),
        comm,
        optimizer: 0.0,
    };
    let result = simulate(&programs, &costs).context("simulating the plan")?;
    Ok(chrome_trace(&result))
}

/// The model file a plan names: as recorded, else beside the plan file.
fn model_path(plan: &Plan, plan_file: &Path) -> PathBuf {
    let recorded = PathBuf::from(&plan.model.path);
    if recorded.exists() || recorded.is_absolute() {
        return recorded;
    }
    match plan_file.parent() {
        Some(dir) if dir.join(&recorded).exists() => dir.join(&recorded),
        _ => recorded,
    }
}

fn graph_dot(plan: &Plan, plan_file: &Path) -> Result<String> {
    let path = model_path(plan, plan_file);
    let dims = DimArgs {
        global_batch: None,
        seq_len: plan.seq_len.map(|s| s as i64),
        dims: plan.dims.iter().map(|(k, v)| (k.clone(), *v)).collect(),
    };
    let analysed = smp_partition::load_and_analyze(&path, &dims.analyze_options()).context("--dot needs the model the plan was made for")?;
    if analysed.model.sha256 != plan.model.sha256 {
        tracing::warn!("{}: the file changed since the plan was made (SHA-256 differs)", path.display());
    }
    Ok(dot::to_dot(&analysed.lg, plan).with_context(|| path.display().to_string())?)
}
