//! The plan's codegen section for GPT-3 175B on 1,024 ranks: time to build it (shards of every
//! layer, boundary tensors, program templates), to validate it (all 1,024 concrete programs),
//! to serialise it, and its size. Configurations: the planner's optimum (BENCHMARKS.md: pp 8 ·
//! tp 4 · dp 32, ZeRO 1, 48 microbatches, zb-h1) and a deeper one (pp 16 · tp 8 · dp 8,
//! interleaved:2, 192 microbatches). Goals: plan written < 1 s, < 20 MB.
//! Run: `cargo bench --bench codegen [-- MODEL.onnx]`.

use std::path::PathBuf;
use std::time::Instant;

use smp_partition::codegen::encode::{CodegenInput, Mesh, StageInput, build};
use smp_partition::codegen::validate::validate_section;
use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::ScheduleKind;
use smp_partition::passes::{AnalyzeOptions, analyze};
use smp_partition::solve::Placement;

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .skip(1)
        .find(|a| a.ends_with(".onnx"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt3-175b.onnx"));
    let t0 = Instant::now();
    let model = load_model(&path)?;
    let lg = analyze(model.graph, &AnalyzeOptions::default())?;
    println!("model: {} ({} layers, {} nodes; load + analyze {:.2} s)", path.display(), lg.layers.len(), lg.graph.node_count(), t0.elapsed().as_secs_f64());
    let configs = [
        ("pp 8 · tp 4 · dp 32, ZeRO 1, zb-h1, m 48", 8, 4, 32, 1, ScheduleKind::ZbH1, 48),
        ("pp 16 · tp 8 · dp 8, ZeRO 0, interleaved:2, m 192", 16, 8, 8, 0, ScheduleKind::Interleaved { virtual_stages: 2 }, 192),
    ];
    for (name, pp, tp, dp, zero, schedule, m) in configs {
        let n_stages = schedule.stages(pp);
        let layers = lg.layers.len();
        let stages = (0..n_stages)
            .map(|s| StageInput {
                layers: [s * layers / n_stages, (s + 1) * layers / n_stages - 1],
                checkpointed_layers: Vec::new(),
                output_bytes: 2048 * 12288 * 2,
            })
            .collect();
        let input = CodegenInput { pp, tp, dp, zero, sharded_dp: None, microbatches: m, schedule, stages, replicated_layers: vec![], node_strategies: vec![], sequence_parallel: false };
        // Ranks as the DPT placement numbers them: d·(pp·tp) + p·tp + t.
        let mesh = Mesh::numbered(Placement::CLUSTER, pp, tp, dp);
        let t1 = Instant::now();
        let section = build(&lg, &input)?;
        let build_s = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        validate_section(&section, &mesh, m, None)?;
        let validate_s = t2.elapsed().as_secs_f64();
        let t3 = Instant::now();
        let json = serde_json::to_vec_pretty(&section)?;
        let ser_s = t3.elapsed().as_secs_f64();
        let steps: usize = section.templates.iter().map(|t| t.steps.len()).sum();
        println!(
            "{name}: {} ranks; build {build_s:.3} s, validate {validate_s:.3} s, serialise {ser_s:.3} s, total {:.3} s; {:.2} MB ({} templates, {steps} steps, {} shards)  (goals: < 1 s, < 20 MB)",
            pp * tp * dp,
            build_s + validate_s + ser_s,
            json.len() as f64 / 1e6,
            section.templates.len(),
            section.shards.iter().map(Vec::len).sum::<usize>()
        );
    }
    Ok(())
}
