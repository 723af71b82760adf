//! The plan's codegen section for GPT-3 175B on 1,024 ranks: time to build it (shards of every
//! layer, boundary tensors, program templates), to validate it (all 1,024 concrete programs),
//! to serialise it, and its size. Configurations, fixed for the planner (which still chooses
//! the cuts, checkpointing and tensor strategies): its optimum (BENCHMARKS.md: pp 8 · tp 4 ·
//! dp 32, ZeRO 1, 48 microbatches, zb-h1) and a deeper one (pp 16 · tp 8 · dp 8,
//! interleaved:2, 192 microbatches). Goals: plan written < 1 s, < 20 MB.
//! Run: `cargo bench --bench codegen [-- MODEL.onnx]`.

use std::path::PathBuf;
use std::time::Instant;

use smp_partition::compile::{Observer, Stage};
use smp_partition::cost::ClusterSpec;
use smp_partition::ir::ScheduleKind;
use smp_partition::passes::AnalyzeOptions;
use smp_partition::solve::PlanOptions;
use smp_partition::{compile_observed, load_and_analyze};

/// Seconds spent in each stage of `compile`.
#[derive(Default)]
struct StageTimes {
    current: Option<(Stage, Instant)>,
    done: Vec<(Stage, f64)>,
}

impl StageTimes {
    fn finish(&mut self) {
        if let Some((s, t)) = self.current.take() {
            self.done.push((s, t.elapsed().as_secs_f64()));
        }
    }
    fn of(&self, stage: Stage) -> f64 {
        self.done.iter().filter(|(s, _)| *s == stage).map(|(_, t)| t).sum()
    }
}

impl Observer for StageTimes {
    fn stage(&mut self, stage: Stage) {
        self.finish();
        self.current = Some((stage, Instant::now()));
    }
}

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .skip(1)
        .find(|a| a.ends_with(".onnx"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt3-175b.onnx"));
    let t0 = Instant::now();
    let model = load_and_analyze(&path, &AnalyzeOptions::default())?;
    let lg = &model.lg;
    println!("model: {} ({} layers, {} nodes; load + analyze {:.2} s)", path.display(), lg.layers.len(), lg.graph.node_count(), t0.elapsed().as_secs_f64());
    let cluster = ClusterSpec::parse("a100-80gb:1024")?;
    let configs = [
        ("pp 8 · tp 4 · dp 32, ZeRO 1, zb-h1, m 48", 8, 4, 32, 1, ScheduleKind::ZbH1, 48),
        ("pp 16 · tp 8 · dp 8, ZeRO 0, interleaved:2, m 192", 16, 8, 8, 0, ScheduleKind::Interleaved { virtual_stages: 2 }, 192),
    ];
    for (name, pp, tp, dp, zero, schedule, m) in configs {
        let options = PlanOptions {
            global_batch: Some(1536),
            pp: Some(pp),
            tp: Some(tp),
            dp: Some(dp),
            zero: Some(zero),
            schedule: Some(schedule),
            microbatches: Some(m),
            ..PlanOptions::default()
        };
        let mut times = StageTimes::default();
        let plan = compile_observed(&model, &cluster, &options, &mut times)?;
        times.finish();
        let (build_s, validate_s) = (times.of(Stage::Codegen), times.of(Stage::Validate));
        let section = plan.codegen.as_ref().ok_or_else(|| anyhow::anyhow!("{name}: the plan has no codegen section"))?;
        let t3 = Instant::now();
        let json = serde_json::to_vec_pretty(section)?;
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
