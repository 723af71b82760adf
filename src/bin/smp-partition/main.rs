//! `smp-partition`: plan a model for model-parallel training, inspect plans.

mod emit_cmd;
mod from_engine_cmd;
mod graph_cmd;
mod inspect_cmd;
mod plan_cmd;
mod sweep_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Plans an ONNX model over many devices: pipeline cuts, tensor splits, data-parallel and
/// ZeRO degrees, checkpointing, microbatches and schedule.
#[derive(Parser, Debug)]
#[command(name = "smp-partition", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    plan: plan_cmd::PlanArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the model's layers with parameters, FLOPs and activations.
    Graph(graph_cmd::GraphArgs),
    /// Explain a plan file: stages, bottleneck, memory, communication, the solver's proof.
    Inspect(inspect_cmd::InspectArgs),
    /// Write a plan as the configuration of Megatron-LM, torchtitan, DeepSpeed or SMP, saying
    /// what the engine cannot express and pricing the nearest configuration it can run.
    Emit(emit_cmd::EmitArgs),
    /// Plan one model on several clusters: predicted step time, tokens/s, MFU, memory and
    /// cost per cluster, as a table and an SVG chart ("what should I rent?").
    Sweep(sweep_cmd::SweepArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::from(2) } else { ExitCode::SUCCESS };
        }
    };
    smp_partition::logging::init();
    let result = match cli.command {
        Some(Command::Inspect(args)) => inspect_cmd::run(&args),
        Some(Command::Graph(args)) => graph_cmd::run(&args).map(|()| ExitCode::SUCCESS),
        Some(Command::Sweep(args)) => sweep_cmd::run(&args),
        Some(Command::Emit(args)) => emit_cmd::run(&args),
        None => plan_cmd::run(&cli.plan),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}
