//! Planner speed and quality on graph-only models. Prints a markdown table for BENCHMARKS.md.
//!
//! Run: `cargo bench --bench planner` (or `--profile dev` for a quick look).
//! Every case goes through `compile()` (solve, assemble, codegen, validate); the wall time is
//! the plan's own `solver.wall_s` (search and assembly), as before.
//! Goals: GPT-3 175B on a100-80gb:1024, batch 1536, seq 2048 in ≤ 0.5 s; the 1T
//! model on a100-80gb:3072, batch 3072, in ≤ 5 s (default flags, optimal or gap ≤ 1 %);
//! Megatron Table 1: the faithful `--baseline megatron` against the published TFLOP/s per GPU
//! (±10 %), and the automatic plan against it (≥ 1.0× on every row);
//! Llama-3-8B on h100-80gb:64, batch 512, pp 8: automatic cuts vs uniform and parameters.

use std::path::Path;
use std::time::Instant;

use smp_partition::cost::ClusterSpec;
use smp_partition::ir::ScheduleKind;
use smp_partition::passes::AnalyzeOptions;
use smp_partition::plan::Plan;
use smp_partition::solve::{Baseline, PlanDecision, PlanOptions};
use smp_partition::{Analysed, CompileError, compile, load_and_analyze};

#[path = "../tests/common/synthetic_gpt.rs"]
mod synthetic_gpt;
#[path = "../tests/common/table1.rs"]
mod table1;

fn load(path: &str, seq: i64) -> Option<Analysed> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    match load_and_analyze(&p, &AnalyzeOptions { seq_len: Some(seq), ..Default::default() }) {
        Ok(a) => Some(a),
        Err(e) => {
            eprintln!("{path}: {e}");
            None
        }
    }
}

/// Options with the global batch (and the sequence length the model was analysed with).
fn options(batch: u64, seq: u64) -> PlanOptions {
    PlanOptions { global_batch: Some(batch), seq_len: Some(seq), ..Default::default() }
}

/// Compiles; the wall time is the plan's planning time (search and assembly).
fn run(a: &Analysed, cluster: &str, opts: &PlanOptions) -> (Result<Plan, CompileError>, f64) {
    let spec = ClusterSpec::parse(cluster).expect("preset");
    let p = compile(a, &spec, opts);
    let wall = p.as_ref().map_or(0.0, |p| p.solver.wall_s);
    (p, wall)
}

/// An error with its causes, as the CLI prints it.
fn error_text(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

fn describe_decision(d: &PlanDecision) -> String {
    format!(
        "pp{} tp{}{} dp{} zero{} m{}×{} {} ckpt {}",
        d.parallel.pp,
        d.parallel.tp,
        if d.parallel.sequence_parallel { " sp" } else { "" },
        d.parallel.dp,
        d.parallel.zero,
        d.parallel.microbatches,
        d.microbatch_size,
        d.parallel.schedule,
        d.layers.iter().filter(|l| l.checkpoint).count()
    )
}

fn describe(p: &Plan) -> String {
    let par = &p.parallel;
    let schedule = par.schedule.to_string();
    format!(
        "pp{} tp{}{} dp{} zero{} m{}×{} {} ckpt {}",
        par.pp,
        par.tp,
        if par.sequence_parallel { " sp" } else { "" },
        par.dp,
        par.zero,
        par.microbatches,
        p.global_batch as usize / (par.dp * par.microbatches).max(1),
        schedule,
        p.stages.iter().map(|s| s.checkpointed_layers.len()).sum::<usize>()
    )
}

fn main() {
    // `RUST_LOG=smp_partition::solve=debug` shows the search's phases and every ILP.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    }
    println!("| case | plan | step s | MFU | status | gap | solved/skipped | wall s | goal |");
    println!("|---|---|---|---|---|---|---|---|---|");
    // Default time limit (60 s): the wall time is how long the proof took.
    // Each also with `--sequence-parallel` (norms on token chunks).
    for (name, path, cluster, batch, goal, sp) in [
        ("GPT-3 175B", "models/gpt3-175b.onnx", "a100-80gb:1024", 1536, "≤ 0.5 s", false),
        ("GPT 1T", "models/gpt-1t.onnx", "a100-80gb:3072", 3072, "≤ 5 s", false),
        ("GPT-3 175B", "models/gpt3-175b.onnx", "a100-80gb:1024", 1536, "≤ 0.5 s", true),
        ("GPT 1T", "models/gpt-1t.onnx", "a100-80gb:3072", 3072, "≤ 5 s", true),
    ] {
        let Some(a) = load(path, 2048) else { continue };
        let cfg = PlanOptions { sequence_parallel: sp.then_some(true), ..options(batch, 2048) };
        let sp = if sp { ", --sequence-parallel" } else { "" };
        match run(&a, cluster, &cfg) {
            (Ok(d), wall) => println!(
                "| {name} on {cluster}, batch {batch}{sp} | {} | {:.3} | {:.3} | {} | {:.4} | {}/{} | {wall:.2} | {goal} |",
                describe(&d),
                d.predicted.step_time_s,
                d.predicted.mfu,
                d.solver.status,
                d.solver.gap,
                d.solver.candidates.solved,
                d.solver.candidates.skipped
            ),
            (Err(e), wall) => println!("| {name} | error: {} | | | | | | {wall:.2} | {goal} |", error_text(&e)),
        }
    }

    // Planning time against depth, in one run: a GPT-3-wide model (hidden 12288, 96 heads,
    // seq 2048) with 24 and with 192 blocks on a100-80gb:1024, batch 1536 (synthetic layered
    // graphs, so only planning is timed). Goal: ratio ≤ 8 × 1.3.
    println!();
    println!("| depth | plan | status | wall s |");
    println!("|---|---|---|---|");
    let mut walls = Vec::new();
    for layers in [24, 192] {
        let lg = synthetic_gpt::gpt(synthetic_gpt::GptShape { layers, hidden: 12288.0, heads: 96.0, seq: 2048.0, vocab: 51200.0 });
        let spec = ClusterSpec::parse("a100-80gb:1024").expect("preset");
        let t = Instant::now();
        // The solver alone: a synthetic graph has no file and one node per layer to emit.
        match (smp_partition::solve::plan(&lg, &spec, &options(1536, 2048), &mut |_| {}), t.elapsed().as_secs_f64()) {
            (Ok(d), wall) => {
                println!("| {layers} blocks | {} | {} | {wall:.3} |", describe_decision(&d), d.solver.status.name());
                walls.push(wall);
            }
            (Err(e), wall) => println!("| {layers} blocks | error: {e} | | {wall:.3} |"),
        }
    }
    if let [a, b] = walls[..] {
        println!("\nPlanning time 192 / 24 blocks: {:.2} (goal ≤ {:.1})", b / a, 8.0 * 1.3);
    }

    // Megatron-LM Table 1: the faithful baseline (published t, p, d and batch, the authors'
    // script's microbatch size and interleaving, full recompute) against the published per-GPU
    // TFLOP/s (equation 3), and the automatic plan (default flags) against that baseline.
    println!();
    println!("| Table 1 model | t, p, d | batch | mbs, schedule | published TFLOP/s | predicted (eq. 3) | predicted / published | baseline step s | auto plan | auto step s | baseline / auto |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut logs = Vec::new();
    for r in &table1::TABLE1 {
        let name = r.name;
        let Some(model) = load(&format!("models/megatron/gpt-{name}.onnx"), 2048) else { continue };
        let cluster = format!("a100-80gb:{}", r.gpus);
        let base = table1::baseline_options(r, r.mbs, r.v);
        let auto = options(r.batch as u64, 2048);
        let (b, _) = run(&model, &cluster, &base);
        let (a, wall) = run(&model, &cluster, &auto);
        let d = r.gpus / (r.t * r.p);
        match (b, a) {
            (Ok(b), Ok(a)) => {
                let ratio = b.predicted.step_time_s / a.predicted.step_time_s;
                logs.push(ratio.ln());
                let tflops = table1::eq3_flops(r) / (b.predicted.step_time_s * r.gpus as f64) / 1e12;
                println!(
                    "| {name} | {}, {}, {d} | {} | {}, {} | {} | {tflops:.1} | {:.3} | {:.3} | {} ({wall:.1} s, {}) | {:.3} | {ratio:.3} |",
                    r.t,
                    r.p,
                    r.batch,
                    r.mbs,
                    b.parallel.schedule,
                    r.published,
                    tflops / r.published,
                    b.predicted.step_time_s,
                    describe(&a),
                    a.solver.status,
                    a.predicted.step_time_s
                );
            }
            (b, a) => println!(
                "| {name} | | {} | | | | | {} | {} | | |",
                r.batch,
                b.err().map(|e| error_text(&e)).unwrap_or_default(),
                a.err().map(|e| error_text(&e)).unwrap_or_default()
            ),
        }
    }
    if !logs.is_empty() {
        let g = (logs.iter().sum::<f64>() / logs.len() as f64).exp();
        println!("\nGeometric mean of faithful-baseline/auto step-time ratios: {g:.3}");
    }

    // A published run on H100s: Llama 3 405B pre-training (Llama Team, "The Llama 3 Herd of
    // Models", 2024, Table 4): 8,192 H100s, t 8, p 16, d 64, sequence 8192, 32 sequences per
    // data-parallel replica (2,048 per step), 430 TFLOP/s per GPU = 43 % BF16 MFU (model
    // FLOPs, no recompute counted). Their stages hold 8 of the 128 layers each (one block
    // fewer on the first and last, which carry the embedding and the head): `uniform` cuts.
    println!();
    println!("| Llama 3 405B, h100-80gb:8192, t 8, p 16, d 64, batch 2048, seq 8192 | plan | step s | predicted MFU | published MFU | predicted / published |");
    println!("|---|---|---|---|---|---|");
    if let Some(model) = load("models/llama3-405b.onnx", 8192) {
        // Meta's mixed precision: a bf16 model beside fp32 masters (as tests/published_runs.rs)
        let cfg = PlanOptions { baseline: Some(Baseline::Uniform), tp: Some(8), pp: Some(16), dp: Some(64), mixed_recipe: Some(smp_partition::ir::MixedRecipe::LowModel), ..options(2048, 8192) };
        match run(&model, "h100-80gb:8192", &cfg).0 {
            Ok(d) => println!(
                "| uniform cuts, rest searched | {} | {:.3} | {:.3} | 0.43 | {:.3} |",
                describe(&d),
                d.predicted.step_time_s,
                d.predicted.mfu,
                d.predicted.mfu / 0.43
            ),
            Err(e) => println!("| error: {} | | | | | |", error_text(&e)),
        }
    }

    // Llama-3-8B cuts vs DeepSpeed's partition methods.
    println!();
    println!("| Llama-3-8B, h100-80gb:64, batch 512, seq 8192, pp 8 | step s | ratio to auto |");
    println!("|---|---|---|");
    if let Some(model) = load("models/llama3-8b.onnx", 8192) {
        let mk = |b: Option<Baseline>| PlanOptions { baseline: b, pp: Some(8), schedule: Some(ScheduleKind::OneFOneB), ..options(512, 8192) };
        let (auto, _) = run(&model, "h100-80gb:64", &mk(None));
        if let Ok(auto) = auto {
            println!("| auto ({}) | {:.3} | 1.000 |", describe(&auto), auto.predicted.step_time_s);
            for b in [Baseline::Uniform, Baseline::Parameters] {
                match run(&model, "h100-80gb:64", &mk(Some(b))).0 {
                    Ok(d) => println!(
                        "| {b:?} | {:.3} | {:.3} |",
                        d.predicted.step_time_s,
                        d.predicted.step_time_s / auto.predicted.step_time_s
                    ),
                    Err(e) => println!("| {b:?} | error: {} | |", error_text(&e)),
                }
            }
        }
    }
}
