//! `smp-partition emit PLAN.json --engine ENGINE`: a plan as the configuration of Megatron-LM,
//! torchtitan, DeepSpeed or SMP, with what the engine cannot express, priced; and the printing
//! `--emit` at plan time shares.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

use smp_partition::compile::{Analysed, analyze_for};
use smp_partition::cost::{ClusterSpec, MachineFacts};
use smp_partition::engines::{self, Emission, Engine, exact_request};
use smp_partition::plan::{Plan, io};

/// Options of `emit`.
#[derive(Args, Debug)]
pub struct EmitArgs {
    /// The plan file.
    #[arg(value_name = "PLAN.json")]
    pub plan: PathBuf,
    /// The engine whose configuration to write.
    #[arg(long, value_name = "megatron|torchtitan|deepspeed|smp")]
    pub engine: Engine,
    /// Write the configuration's files into this directory (created if missing).
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// The model file (default: the one the plan names).
    #[arg(long, value_name = "MODEL.onnx")]
    pub model: Option<PathBuf>,
    /// Price the nearest configuration on this cluster (default: the plan's).
    #[arg(long, value_name = "PRESET[:N]|FILE.toml")]
    pub cluster: Option<String>,
    /// Print the emission as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Runs `emit`.
pub fn run(args: &EmitArgs) -> Result<ExitCode> {
    let plan = io::load(&args.plan)?;
    let analysed = analyse_plan_model(&plan, args.model.as_deref())?;
    let host = smp_partition::host::machine_facts()?;
    let cluster = plan_cluster(&plan, args.cluster.as_deref(), &host)?;
    let emission = engines::emit(args.engine, &plan, &analysed, &cluster).with_context(|| format!("emitting {} for {}", args.engine, args.plan.display()))?;
    show(&emission, args.output.as_deref(), args.json)?;
    Ok(ExitCode::SUCCESS)
}

/// The plan's model, analysed as the plan was made (its sequence length, dims and trained
/// parameters); refused when the file is not the one the plan was made for.
pub fn analyse_plan_model(plan: &Plan, model: Option<&Path>) -> Result<Analysed> {
    let path = model.map_or_else(|| PathBuf::from(&plan.model.path), Path::to_path_buf);
    let analysed = analyze_for(&path, &exact_request(plan)).with_context(|| format!("reading the plan's model {}", path.display()))?;
    if analysed.model.sha256 != plan.model.sha256 {
        bail!("{} is not the model the plan was made for (its SHA-256 differs); give the plan's model with --model, or re-plan", path.display());
    }
    Ok(analysed)
}

/// The cluster a plan was made for (the machine it recorded, for `cpu` plans), or `over`.
pub fn plan_cluster(plan: &Plan, over: Option<&str>, host: &MachineFacts) -> Result<ClusterSpec> {
    if let Some(c) = over {
        return ClusterSpec::parse_on(c, host).with_context(|| format!("--cluster {c}"));
    }
    match &plan.cluster.machine {
        Some(machine) => ClusterSpec::cpu(machine, Some(plan.cluster.devices)).context("the plan's cpu cluster"),
        None => {
            let spec = format!("{}:{}", plan.cluster.preset, plan.cluster.devices);
            ClusterSpec::parse_on(&spec, host).with_context(|| format!("the plan's cluster {spec}"))
        }
    }
}

/// Prints an emission (and writes its files into `dir`): what the engine cannot express,
/// priced; the files; the launch line; the notes. `--json`: one object.
pub fn show(e: &Emission, dir: Option<&Path>, json_out: bool) -> Result<()> {
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for f in &e.written.files {
            let path = dir.join(&f.name);
            std::fs::write(&path, &f.text).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    if json_out {
        let gaps: Vec<_> = e
            .gaps
            .iter()
            .map(|g| json!({ "field": g.gap.field.plan_key(), "chose": g.gap.chose, "why": g.gap.why, "nearest": g.gap.nearest, "priced": g.gap.change.is_some(), "step_time_s": g.step_s }))
            .collect();
        let files: Vec<_> = e.written.files.iter().map(|f| json!({ "name": f.name, "text": f.text })).collect();
        let out = json!({
            "engine": e.engine.name(),
            "plan_step_time_s": e.plan_step_s,
            "step_time_s": e.step_s(),
            "gaps": gaps,
            "over_memory": e.over_memory.map(|(peak, limit)| json!({ "peak_bytes": peak, "limit_bytes": limit })),
            "nearest": e.nearest.as_ref().map(|p| serde_json::to_value(p).unwrap_or_default()),
            "files": files,
            "launch": e.written.launch,
            "notes": e.written.notes,
        });
        println!("{out}");
        return Ok(());
    }
    let lines = e.gap_lines();
    if lines.is_empty() {
        println!("{} expresses the whole plan (predicted {:.3} s per step)", e.engine, e.plan_step_s);
    } else {
        for l in &lines {
            println!("{l}");
        }
    }
    for f in &e.written.files {
        match dir {
            Some(d) => println!("wrote {}", d.join(&f.name).display()),
            None => {
                println!("--- {} ---", f.name);
                print!("{}", f.text);
            }
        }
    }
    println!("launch: {}", e.written.launch);
    for n in &e.written.notes {
        println!("note: {n}");
    }
    Ok(())
}
