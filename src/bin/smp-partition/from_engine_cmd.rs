//! `smp-partition MODEL.onnx --from-engine ENGINE:CONFIG`: a team's Megatron-LM, torchtitan or
//! DeepSpeed configuration planned exactly as written and printed beside the automatic plan
//! under the same cost model.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};

use smp_partition::compile::analyze_for;
use smp_partition::cost::ClusterSpec;
use smp_partition::engines::{self, Column, Engine, ModelShape, Origin};
use smp_partition::solve::PlanOptions;

use crate::plan_cmd::{CliObserver, PlanArgs};

/// The configuration text and where it came from: `ENGINE:FILE`, `ENGINE:TEXT`, and for
/// DeepSpeed `deepspeed:FILE,LAUNCHER` (the launcher line after the first comma).
fn configuration(engine: Engine, rest: &str) -> Result<(String, Origin)> {
    let file = |p: &str| -> Result<String> { std::fs::read_to_string(p).with_context(|| format!("reading {p}")) };
    if Path::new(rest).is_file() {
        return Ok((file(rest)?, Origin { what: PathBuf::from(rest) }));
    }
    if engine == Engine::DeepSpeed
        && let Some((path, launcher)) = rest.split_once(',')
        && Path::new(path).is_file()
    {
        return Ok((format!("{}\n{launcher}", file(path)?), Origin { what: PathBuf::from(path) }));
    }
    let what = match engine {
        Engine::Megatron => "the Megatron-LM arguments",
        Engine::Torchtitan => "the torchtitan configuration",
        Engine::DeepSpeed => "the DeepSpeed configuration",
        Engine::Smp => "the SMP configuration",
    };
    Ok((rest.to_string(), Origin { what: PathBuf::from(what) }))
}

/// The planning flags `--from-engine` leaves to the command line; any other is a conflict.
fn check_flags(args: &PlanArgs) -> Result<()> {
    let f = &args.flags;
    let given: Vec<&str> = [
        (f.global_batch.is_some(), "--global-batch"),
        (f.pp.is_some(), "--pp"),
        (f.tp.is_some(), "--tp"),
        (f.dp.is_some(), "--dp"),
        (f.cp.is_some(), "--cp"),
        (f.etp.is_some(), "--etp"),
        (f.overlap_expert_comm, "--overlap-expert-comm"),
        (f.overlap_grad_sync, "--overlap-grad-sync"),
        (f.float8_linears, "--float8-linears"),
        (f.zero.is_some(), "--zero"),
        (f.sharded_dp.is_some(), "--sharded-dp"),
        (f.microbatches.is_some(), "--microbatches"),
        (f.schedule.is_some(), "--schedule"),
        (f.checkpointing.is_some(), "--checkpointing"),
        (f.recompute_layers.is_some(), "--recompute-layers"),
        (f.selective_layers.is_some(), "--selective-layers"),
        (f.placement.is_some(), "--placement"),
        (f.sequence_parallel || f.no_sequence_parallel, "--sequence-parallel"),
        (f.precision.is_some(), "--precision"),
        (f.offload_activations.is_some(), "--offload-activations"),
        (f.activation_loading_horizon.is_some(), "--activation-loading-horizon"),
        (f.layout.is_some(), "--layout"),
        (f.config.is_some(), "--config"),
        (f.baseline.is_some(), "--baseline"),
    ]
    .into_iter()
    .filter_map(|(on, name)| on.then_some(name))
    .collect();
    if !given.is_empty() {
        bail!(
            "--from-engine plans the configuration as written, which sets {}; drop the flag (or plan without --from-engine)",
            given.join(", ")
        );
    }
    Ok(())
}

/// Runs `--from-engine`.
pub fn run(model: &Path, spec: &str, args: &PlanArgs) -> Result<ExitCode> {
    let Some((name, rest)) = spec.split_once(':') else {
        bail!("--from-engine {spec}: expected ENGINE:CONFIG, e.g. megatron:args.txt");
    };
    let engine: Engine = name.parse().map_err(|e: String| anyhow::anyhow!("--from-engine {spec}: {e}"))?;
    if engine == Engine::Smp {
        bail!("--from-engine smp: SMP parameters are read by --config SMP.json (with --layout for SMP v1's manual partition)");
    }
    check_flags(args)?;
    let (text, origin) = configuration(engine, rest)?;
    let f = &args.flags;
    let base = PlanOptions {
        seq_len: f.seq_len,
        dims: f.dim.clone(),
        params: smp_partition::compile::ParamOptions { trainable: f.trainable.clone(), frozen: f.frozen.clone() },
        ..PlanOptions::default()
    };
    // a graph whose sequence is symbolic is analysed at the configuration's length
    let first = match (f.seq_len, engines::sequence_length(engine, &text)) {
        (None, Some(seq)) => PlanOptions { seq_len: Some(seq), ..base.clone() },
        _ => base.clone(),
    };
    let mut analysed = analyze_for(model, &first).with_context(|| format!("reading {}", model.display()))?;
    // the device count: --cluster PRESET:N, else the launcher's
    let explicit_count = args.cluster.as_deref().filter(|c| c.contains(':') || Path::new(c).is_file());
    let host = smp_partition::host::machine_facts()?;
    let devices = match explicit_count {
        Some(c) => Some(ClusterSpec::parse_on(c, &host).with_context(|| format!("--cluster {c}"))?.devices),
        None => None,
    };
    let shape = ModelShape::of(&analysed.lg);
    let (mut reading, world) = engines::read(engine, &text, origin.clone(), &shape, devices).with_context(|| format!("--from-engine {name}:{}", origin.name()))?;
    // the configuration's sequence length binds the model's, unless --seq-len did
    if let (Some(read), None) = (reading.options.seq_len, f.seq_len)
        && first.seq_len != Some(read)
    {
        let rebound = PlanOptions { seq_len: Some(read), ..base.clone() };
        analysed = analyze_for(model, &rebound).with_context(|| format!("reading {} at sequence length {read}", model.display()))?;
    } else if let (Some(read), Some(flag)) = (reading.options.seq_len, f.seq_len)
        && read != flag
    {
        bail!("--seq-len {flag} conflicts with the configuration's sequence length {read}");
    }
    let preset = args.cluster.clone().unwrap_or_else(|| "h100-80gb".to_string());
    let cluster_text = if explicit_count.is_some() { preset } else { format!("{}:{world}", preset.split(':').next().unwrap_or("h100-80gb")) };
    let cluster = ClusterSpec::parse_on(&cluster_text, &host).with_context(|| format!("--cluster {cluster_text}"))?;
    let o = &mut reading.options;
    o.dims = f.dim.clone();
    o.params = base.params.clone();
    o.memory_limit_gib = f.memory_limit;
    o.time_limit_s = f.time_limit;
    // the flag over what the configuration implies (forced balancing's uniform routing)
    o.expert_imbalance = f.expert_imbalance.or(o.expert_imbalance);
    o.cluster_flag = Some(cluster_text.clone());
    if let Some(ep) = f.ep {
        match o.ep {
            Some(e) if e != ep => bail!("--ep {ep} conflicts with the configuration's expert-parallel degree {e}"),
            _ => o.ep = Some(ep),
        }
    }

    let options = reading.options.clone().resolve(None).context("--from-engine")?;
    let (yours, over) = engines::price(engine, &analysed, &cluster, &options).with_context(|| format!("planning the {engine} configuration"))?;
    // ours: the same model, cluster, batch and precision (the gradients' type as the engine
    // keeps them, its linears in fp8 where the engine runs them so), everything else searched
    let auto = PlanOptions {
        global_batch: options.global_batch,
        seq_len: options.seq_len,
        dims: options.dims.clone(),
        precision: options.precision,
        mixed_recipe: options.mixed_recipe,
        params: options.params.clone(),
        memory_limit_gib: f.memory_limit,
        time_limit_s: f.time_limit,
        expert_imbalance: options.expert_imbalance,
        float8_linears: options.float8_linears,
        optimize: f.optimize,
        cluster_flag: Some(cluster_text.clone()),
        ..PlanOptions::default()
    };
    let mut cli = CliObserver::new();
    let ours = smp_partition::compile_observed(&analysed, &cluster, &auto, &mut cli);
    cli.clear_bar();
    let ours = ours.context("planning automatically for comparison")?;
    crate::plan_cmd::emit(&yours, args)?;
    if !args.json {
        println!();
        let columns = [
            Column { title: format!("yours ({engine}: {})", origin.name()), plan: &yours, over_memory: over },
            Column { title: "ours (searched)".into(), plan: &ours, over_memory: None },
        ];
        print!("{}", engines::side_by_side(&columns));
        println!("{}; {}", engines::summary("yours", &yours), engines::summary("ours", &ours));
        for l in engines::reading_lines(engine, &reading) {
            println!("{l}");
        }
    } else {
        for l in engines::reading_lines(engine, &reading) {
            eprintln!("note: {l}");
        }
    }
    if let Some(target) = args.emit {
        crate::plan_cmd::emit_engine(target, &ours, &analysed, &cluster, args)?;
    }
    Ok(ExitCode::SUCCESS)
}
