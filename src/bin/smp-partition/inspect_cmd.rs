//! `smp-partition inspect PLAN.json`: explain a plan.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args;

use smp_partition::plan::{Plan, dot, io, report};
use smp_partition::sim::{chrome_trace, plan_timeline};


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
    /// Write the graph the plan runs as Graphviz DOT: per stage, what its first rank executes,
    /// collectives included (needs the plan's model file).
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
        print!("{}{}", report::render(&plan), report::memory_parts(&plan));
    }
    Ok(ExitCode::SUCCESS)
}

/// The DOT of what the plan runs, on the graph rebuilt from its model file as the runner does.
fn graph_dot(plan: &Plan, plan_file: &Path) -> Result<String> {
    let planned = smp_partition::load_planned(plan, plan_file).context("--dot needs the model the plan was made for")?;
    if !planned.same_file {
        tracing::warn!("{}: the file changed since the plan was made (SHA-256 differs)", planned.path.display());
    }
    Ok(dot::to_dot(plan, &planned.graph, &planned.dims).with_context(|| planned.path.display().to_string())?)
}
