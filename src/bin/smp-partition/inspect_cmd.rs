//! `smp-partition inspect PLAN.json`: explain a plan.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::Args;

use smp_partition::plan::{io, report};

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
    if args.trace.is_some() {
        bail!("--trace needs the simulator, which is not in this build yet");
    }
    if args.dot.is_some() {
        bail!("--dot needs the ONNX frontend, which is not in this build yet");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report::to_json_with_report(&plan))?);
    } else {
        print!("{}", report::render(&plan));
    }
    Ok(ExitCode::SUCCESS)
}
