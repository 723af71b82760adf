//! `smp-partition inspect PLAN.json`: explain a plan.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;

use smp_partition::plan::{Plan, dot, io, report};
use smp_partition::sim::{chrome_trace, plan_timeline};

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
        let trace = chrome_trace(&plan_timeline(&plan)?);
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
