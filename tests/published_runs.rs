//! The cost model against published training runs: Megatron-LM's Table 1 (Narayanan et al.
//! 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM").
//!
//! Each row is planned as `--baseline megatron` with the published t, p, d and batch, the
//! microbatch size and interleaving of the authors' script for the table
//! (`examples/sc21/run_table_1.sh` in NVIDIA/Megatron-LM) and full recompute. Its predicted
//! step time is turned into per-GPU TFLOP/s as the paper counts them (equation 3:
//! F = 96·B·s·l·h²·(1 + s/6h + V/16lh), recompute included) and compared with the published
//! per-GPU figure. docs/baselines.md explains the choices; BENCHMARKS.md has the table.
//! Also runs on H100s: Llama 3 405B on 8,192 GPUs (43 % MFU) and in its long-context stage (38 %),
//! and torchtitan's Llama 3.1 405B schedule and context-parallel comparisons (docs/planner.md,
//! "Published checks", lists every check with its source, bound and ratio).

use std::path::Path;

use smp_partition::cost::ClusterSpec;
use smp_partition::ir::ScheduleKind;
use smp_partition::load_and_analyze;
use smp_partition::passes::AnalyzeOptions;
use smp_partition::solve::plan;

#[path = "common/table1.rs"]
mod table1;
use table1::{Row, SEQ, TABLE1, baseline_options, eq3_flops};

/// Predicted per-GPU TFLOP/s (equation 3) of the faithful baseline of `r`.
fn predicted_tflops(r: &Row, mbs: usize, v: usize) -> (f64, f64) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("models/megatron/gpt-{}.onnx", r.name));
    let a = load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(SEQ as i64), ..Default::default() }).unwrap();
    let spec = ClusterSpec::parse(&format!("a100-80gb:{}", r.gpus)).unwrap();
    let d = plan(&a.lg, &spec, &baseline_options(r, mbs, v), &mut |_| {}).unwrap();
    assert_eq!((d.parallel.tp, d.parallel.pp, d.microbatch_size), (r.t, r.p, mbs), "{}", r.name);
    // Megatron's placement: equal blocks per stage.
    let per: Vec<usize> = d.stages.iter().map(|s| (s.layers[0]..=s.layers[1]).filter(|&l| a.lg.layers[l].kind == smp_partition::ir::LayerKind::Block).count()).collect();
    assert!(per.iter().all(|&n| n == per[0]), "{}: blocks per stage {per:?}", r.name);
    let step = d.predicted.step_time_s;
    (eq3_flops(r) / (step * r.gpus as f64) / 1e12, step)
}

#[test]
fn table1_faithful_baseline_matches_the_published_throughput() {
    let mut worst: f64 = 0.0;
    let mut lines = Vec::new();
    for r in &TABLE1 {
        let (tflops, step) = predicted_tflops(r, r.mbs, r.v);
        let ratio = tflops / r.published;
        worst = worst.max((ratio - 1.0).abs());
        lines.push(format!(
            "| {} | {}, {}, {} | {} | {}{} | {:.0} | {:.1} ({:.1} % of 312) | {:.3} | step {:.2} s |",
            r.name,
            r.t,
            r.p,
            r.gpus / (r.t * r.p),
            r.batch,
            r.mbs,
            if r.v > 1 { format!(", interleaved:{}", r.v) } else { String::new() },
            r.published,
            tflops,
            tflops / 312.0 * 100.0,
            ratio,
            step
        ));
    }
    for l in &lines {
        eprintln!("{l}");
    }
    assert!(worst <= 0.10, "a row is off by {:.1} % (> 10 %):\n{}", worst * 100.0, lines.join("\n"));
}

/// The automatic plan (default flags: cluster, batch, sequence length) against the faithful
/// baseline of each row: never slower. Slow (the 1008B search), so run on demand:
/// `cargo test --features runner --test published_runs -- --ignored`.
#[test]
#[ignore]
fn table1_automatic_plan_is_never_slower_than_the_faithful_baseline() {
    let mut logs = Vec::new();
    let mut lines = Vec::new();
    for r in &TABLE1 {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("models/megatron/gpt-{}.onnx", r.name));
        let a = load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(SEQ as i64), ..Default::default() }).unwrap();
        let spec = ClusterSpec::parse(&format!("a100-80gb:{}", r.gpus)).unwrap();
        let base = plan(&a.lg, &spec, &baseline_options(r, r.mbs, r.v), &mut |_| {}).unwrap();
        let t = std::time::Instant::now();
        // priced as the baseline is (Megatron-LM's mixed precision)
        let auto_opts = smp_partition::solve::PlanOptions { global_batch: Some(r.batch as u64), seq_len: Some(SEQ as u64), mixed_recipe: baseline_options(r, r.mbs, r.v).mixed_recipe, ..Default::default() };
        let auto = plan(&a.lg, &spec, &auto_opts, &mut |_| {}).unwrap();
        let ratio = base.predicted.step_time_s / auto.predicted.step_time_s;
        logs.push(ratio.ln());
        lines.push(format!(
            "{}: baseline {:.3} s, auto {:.3} s (pp{} tp{} sp {} dp{} zero{} m{}x{} {} {}, gap {:.4}, {:.1} s), ratio {ratio:.3}",
            r.name,
            base.predicted.step_time_s,
            auto.predicted.step_time_s,
            auto.parallel.pp,
            auto.parallel.tp,
            auto.parallel.sequence_parallel,
            auto.parallel.dp,
            auto.parallel.zero,
            auto.parallel.microbatches,
            auto.microbatch_size,
            auto.parallel.schedule,
            auto.solver.status.name(),
            auto.solver.gap,
            t.elapsed().as_secs_f64()
        ));
    }
    let g = (logs.iter().sum::<f64>() / logs.len() as f64).exp();
    for l in &lines {
        eprintln!("{l}");
    }
    eprintln!("geometric mean {g:.3}");
    assert!(logs.iter().all(|&l| l >= -1e-9), "a row is slower than the baseline:\n{}", lines.join("\n"));
}

/// Regression: a tied embedding and head on different pipeline stages must be sliced alike, or
/// codegen refuses the plan. The automatic plan of 76.1B at t 4 · p 32 · d 8 once replicated the
/// embedding (the intra-layer ILP's point, on a tie) while the head split the vocabulary.
#[test]
fn tied_embedding_and_head_on_different_stages_compile() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/megatron/gpt-76.1B.onnx");
    let a = load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(SEQ as i64), ..Default::default() }).unwrap();
    let spec = ClusterSpec::parse("a100-80gb:1024").unwrap();
    for sp in [false, true] {
        let opts = smp_partition::solve::PlanOptions {
            global_batch: Some(1792),
            seq_len: Some(SEQ as u64),
            pp: Some(32),
            tp: Some(4),
            dp: Some(8),
            sequence_parallel: Some(sp),
            ..Default::default()
        };
        let p = smp_partition::compile(&a, &spec, &opts).unwrap_or_else(|e| panic!("sequence parallel {sp}: {e}"));
        // The tied pair really is on two pipeline ranks, and both split the vocabulary.
        assert_eq!(p.parallel.pp, 32);
        let (first, last) = (&p.layer_strategies[0], &p.layer_strategies[p.layer_strategies.len() - 1]);
        assert_eq!((first.strategy.as_str(), last.strategy.as_str()), ("megatron-tp4", "megatron-tp4"));
    }
}

/// A published run on H100s: Llama 3 405B pre-training (Llama Team, "The Llama 3 Herd of
/// Models", 2024, Table 4): 8,192 H100s, t 8, p 16, d 64, sequence 8,192, 2,048 sequences per
/// step, 430 TFLOP/s per GPU = 43 % BF16 MFU (model FLOPs, recompute not counted; 38 % on
/// 16,384 GPUs). Planned as benches/planner.rs plans it: t, p, d fixed, `uniform` cuts (8 of the
/// 128 layers per stage, as Meta cut), the rest searched.
#[test]
fn llama3_405b_on_8192_h100s_against_the_published_mfu() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/llama3-405b.onnx");
    let a = load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(8192), ..Default::default() }).unwrap();
    let spec = ClusterSpec::parse("h100-80gb:8192").unwrap();
    let opts = smp_partition::solve::PlanOptions {
        global_batch: Some(2048),
        seq_len: Some(8192),
        baseline: Some(smp_partition::solve::Baseline::Uniform),
        tp: Some(8),
        pp: Some(16),
        dp: Some(64),
        // Meta's mixed precision: a bf16 model beside fp32 masters
        mixed_recipe: Some(smp_partition::ir::MixedRecipe::LowModel),
        ..Default::default()
    };
    let d = plan(&a.lg, &spec, &opts, &mut |_| {}).unwrap();
    let mfu = d.predicted.mfu;
    eprintln!(
        "llama3-405b: pp{} tp{} sp {} dp{} zero{} m{}x{} {} recomputed {}: step {:.2} s, MFU {:.3}, HFU {:.3}, peak {:.1} GiB; {:.3} of the published 0.43",
        d.parallel.pp,
        d.parallel.tp,
        d.parallel.sequence_parallel,
        d.parallel.dp,
        d.parallel.zero,
        d.parallel.microbatches,
        d.microbatch_size,
        d.parallel.schedule,
        d.layers.iter().filter(|l| l.checkpoint).count(),
        d.predicted.step_time_s,
        mfu,
        d.predicted.hfu,
        d.predicted.peak_memory_bytes / (1u64 << 30) as f64,
        mfu / 0.43
    );
    for s in &d.stages {
        eprintln!("  stage {} layers {:?}: fwd {:.3} bwd {:.3} comm {:.3} mem {:.1} GiB", s.index, s.layers, s.forward_s, s.backward_s, s.comm_s, s.memory.total / (1u64 << 30) as f64);
    }
    assert!((mfu / 0.43 - 1.0).abs() <= 0.10, "predicted MFU {mfu:.3} against the published 0.43");
}

/// The torchtitan runs' settings that are not degrees, as torchtitan ran them at the benchmark's
/// commit (pytorch/torchtitan 9dec370, 2024-12-26): full recompute; FSDP, which under a pipeline
/// keeps the parameters gathered (`reshard_after_forward = not pp_enabled`,
/// parallelize_llama.py) and reduce-scatters the gradients once per step, accumulating them whole
/// in its fp32 reduce dtype (torch.distributed.pipelining turns gradient sync off for all but the
/// last backward): ZeRO 1's layout with fp32 gradients, as `--from-engine torchtitan` reads it;
/// microbatches = the pipeline degree under every schedule (`pipeline_parallel_microbatches`
/// unset, pipelining_utils.py); the schedule; Float8 linears, which every 405B row ran.
struct Torchtitan {
    microbatches: usize,
    schedule: smp_partition::ir::ScheduleKind,
    /// Float8 linears priced (all the published 405B rows ran them).
    float8: bool,
}

/// Llama 3 405B planned with t, cp, p, d and the batch pinned and `uniform` cuts (equal layers
/// per stage, as Meta and torchtitan cut); torchtitan's other settings where given, else searched.
fn llama3_405b_step(devices: usize, seq: u64, batch: u64, degrees: [usize; 4], titan: Option<Torchtitan>) -> smp_partition::solve::PlanDecision {
    let [tp, cp, pp, dp] = degrees;
    // The graph-only models fix their sequence: 8,192, or 32K to 256K (`-{k}k`).
    let file = if seq == 8192 { "llama3-405b.onnx".to_string() } else { format!("llama3-405b-{}k.onnx", seq / 1024) };
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(file);
    let a = load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(seq as i64), ..Default::default() }).unwrap();
    let spec = ClusterSpec::parse(&format!("h100-80gb:{devices}")).unwrap();
    let opts = smp_partition::solve::PlanOptions {
        global_batch: Some(batch),
        seq_len: Some(seq),
        baseline: Some(smp_partition::solve::Baseline::Uniform),
        tp: Some(tp),
        cp: Some(cp),
        pp: Some(pp),
        dp: Some(dp),
        zero: titan.as_ref().map(|_| 1),
        microbatches: titan.as_ref().map(|t| t.microbatches),
        schedule: titan.as_ref().map(|t| t.schedule),
        checkpointing: titan.as_ref().map(|_| smp_partition::ir::CheckpointRule::Always),
            // torchtitan's H100s hold 96 GB; its rows are compared with each other, not with a limit.
        memory_limit_gib: titan.as_ref().map(|_| 1e6),
        // Meta's mixed precision: a bf16 model beside fp32 masters; torchtitan's FSDP under
        // its pipeline accumulates the gradients in fp32 (its reduce dtype)
        mixed_recipe: Some(if titan.is_some() { smp_partition::ir::MixedRecipe::LowModelFp32Grads } else { smp_partition::ir::MixedRecipe::LowModel }),
        // torchtitan's 405B rows ran Float8 linears (the output projection in bf16)
        float8_linears: titan.as_ref().map(|t| t.float8),
        ..Default::default()
    };
    let d = plan(&a.lg, &spec, &opts, &mut |_| {}).unwrap();
    let p = &d.parallel;
    assert_eq!((p.tp, p.cp, p.pp, p.dp), (tp, cp, pp, dp));
    eprintln!(
        "405b seq {seq} batch {batch} tp{tp} cp{cp} pp{pp} dp{dp} zero{} m{} {}: step {:.2} s, {:.1} tokens/s/GPU",
        p.zero,
        p.microbatches,
        p.schedule,
        d.predicted.step_time_s,
        (batch * seq) as f64 / d.predicted.step_time_s / devices as f64
    );
    d
}

/// Llama 3's long-context stage (Llama Team 2024, Table 4): 16,384 H100s, t 8, cp 16, p 16,
/// d 8, sequence 131,072, 16 sequences per data-parallel rank, 380 TFLOP/s per GPU = 38 % MFU.
/// The planner's choice of the rest (ZB-H1, 16 microbatches, ZeRO 1) at 0.962 of it, since
/// GEMMs are priced by shape (1.12 before).
#[test]
fn llama3_405b_long_context_stage_against_the_published_mfu() {
    let d = llama3_405b_step(16384, 131072, 128, [8, 16, 16, 8], None);
    let mfu = d.predicted.mfu;
    eprintln!("llama3-405b at 131,072: MFU {mfu:.3}, {:.3} of the published 0.38", mfu / 0.38);
    assert!((mfu / 0.38 - 1.0).abs() <= 0.10, "predicted MFU {mfu:.3} against the published 0.38");
}

/// torchtitan's context-parallel sweep (benchmarks/llama3_h100_202412_torchtitan.md in
/// pytorch/torchtitan, Table 6): Llama 3.1 405B on 512 H100s, t 8, p 8 under 1F1B, FSDP over the
/// rest, local batch 8 (so 2M tokens a step in every row), full recompute; sequence 32K, 64K,
/// 128K, 256K at cp 1, 2, 4, 8: 76, 47, 31 and 16 tokens/s per GPU. The runs used Float8
/// linears (priced: `float8_linears`) on H100s of an unstated peak (500 W), so the ratios
/// between rows are held (within 15 %), not the throughput. Microbatches: torchtitan's default,
/// the pipeline degree (8).
///
/// Not met (docs/planner.md, "Published checks"): the predicted ratios are 1.28, 1.36 and 1.65×
/// the published ones (1.34, 1.51 and 1.92× before Float8 linears were priced). One term
/// explains all three rows: a row's time per token is linear work plus attention work growing
/// with the sequence, and the published rows fit an attention cost at 32K of 1.19× the linear
/// layers' (within 0.03 on every row), where this model prices 0.35× (0.22× with the linears in
/// bf16; FLOPs alone say 0.17×). The 3.4× left is the speed of torchtitan's ring attention per
/// FLOP, which Meta's own long-context run (the test above, 0.962) does not show. Run on demand:
/// `cargo test --features runner --test published_runs -- --ignored torchtitan_context`.
#[test]
#[ignore = "not met: attention's time per FLOP in torchtitan's context-parallel runs (see the doc comment)"]
fn torchtitan_context_parallel_sweep_ratios() {
    let published = [(1usize, 32768u64, 76.0), (2, 65536, 47.0), (4, 131072, 31.0), (8, 262144, 16.0)];
    let tps: Vec<f64> = published
        .iter()
        .map(|&(cp, seq, _)| {
            let dp = 8 / cp;
            let batch = 8 * dp as u64;
            let d = llama3_405b_step(512, seq, batch, [8, cp, 8, dp], Some(Torchtitan { microbatches: 8, schedule: ScheduleKind::OneFOneB, float8: true }));
            (batch * seq) as f64 / d.predicted.step_time_s / 512.0
        })
        .collect();
    let mut report = String::new();
    for (i, &(cp, seq, tokens)) in published.iter().enumerate() {
        let (pred, publ) = (tps[i] / tps[0], tokens / published[0].2);
        report += &format!("cp {cp} at {seq}: predicted {:.1} tokens/s/GPU, ratio to cp 1 {pred:.3} (published {publ:.3}, {:.3})\n", tps[i], pred / publ);
    }
    eprint!("{report}");
    for (i, &(_, _, tokens)) in published.iter().enumerate().skip(1) {
        let ratio = (tps[i] / tps[0]) / (tokens / published[0].2);
        assert!((ratio - 1.0).abs() <= 0.15, "{report}");
    }
}

/// torchtitan's schedule comparison (same source, Table 5): Llama 3.1 405B on 512 H100s, FSDP 8,
/// t 8, p 8, local batch 32 (global 256), sequence 8,192, full recompute: interleaved 1F1B 128
/// tokens/s per GPU against 1F1B's 100, 1.28×. Microbatches: torchtitan's default at the
/// benchmark's commit, the pipeline degree, 8 under both (the same microbatch of 4 sequences;
/// interleaving halves the bubble's share of the step), Float8 linears: 1.270 predicted (1.283
/// with the linears priced in bf16).
#[test]
fn torchtitan_interleaved_against_1f1b_ratio() {
    let [one, inter] = torchtitan_405b_schedule_plans();
    let ratio = one.predicted.step_time_s / inter.predicted.step_time_s;
    eprintln!("interleaved / 1F1B throughput: predicted {ratio:.3}, published 1.28 ({:.3})", ratio / 1.28);
    assert!((ratio / 1.28 - 1.0).abs() <= 0.10, "predicted {ratio:.3} against the published 1.28");
}

/// torchtitan's memory figures (the file of the checks above): the largest peak over every GPU,
/// read from PyTorch's caching allocator. GiB.
const TORCHTITAN_405B_PEAK_GIB: [(&str, f64); 2] = [("1F1B", 82.5), ("interleaved 1F1B", 72.7)];

/// The 405B schedule comparison's two plans (Table 5): 1F1B and interleaved 1F1B, in that order.
fn torchtitan_405b_schedule_plans() -> [smp_partition::solve::PlanDecision; 2] {
    [
        llama3_405b_step(512, 8192, 256, [8, 1, 8, 8], Some(Torchtitan { microbatches: 8, schedule: ScheduleKind::OneFOneB, float8: true })),
        llama3_405b_step(512, 8192, 256, [8, 1, 8, 8], Some(Torchtitan { microbatches: 8, schedule: ScheduleKind::Interleaved { virtual_stages: 2 }, float8: true })),
    ]
}

fn gib(bytes: f64) -> f64 {
    bytes / (1u64 << 30) as f64
}

/// The memory the interleaved schedule saves (Table 5: 82.5 GiB under 1F1B, 72.7 GiB
/// interleaved, 1.135×): the predicted ratio of the two plans' peaks within 10 %.
///
/// Not met: 0.970 predicted (63.1 against 65.0 GiB), 0.855 of the published. At torchtitan's
/// default of 8 microbatches under both schedules the first rank holds the same activations:
/// 8 microbatches' inputs of 16 layers under 1F1B, and under torch's Interleaved1F1B, whose
/// warm-up on rank 0 is min((v − 1)·8 + 2·7, 16) = 16 forwards, all 16 chunk-microbatches of 8
/// layers (15.0 GiB each way); the model state is the same (43.5 GiB); interleaving adds a
/// second chunk's received boundary values. It passed before (1.026) only with 16 interleaved
/// microbatches of 2 sequences, which is not what torchtitan ran and put the schedules' step
/// ratio at 1.51 against the published 1.28. What saves 9.8 GiB in the published run is not a
/// term this planner prices. Run on demand: `cargo test --features runner --test
/// published_runs -- --ignored torchtitan_interleaved_memory`.
#[test]
#[ignore = "not met: 0.855 of the published 1.135 (at torchtitan's 8 microbatches both schedules hold the same activations; see the doc comment)"]
fn torchtitan_interleaved_memory_saving_ratio() {
    let plans = torchtitan_405b_schedule_plans();
    let peaks = plans.each_ref().map(|d| gib(d.predicted.peak_memory_bytes));
    let published = TORCHTITAN_405B_PEAK_GIB[0].1 / TORCHTITAN_405B_PEAK_GIB[1].1;
    let ratio = peaks[0] / peaks[1];
    eprintln!("405b peak memory 1F1B / interleaved: predicted {:.1} / {:.1} GiB = {ratio:.3}, published {published:.3} ({:.3})", peaks[0], peaks[1], ratio / published);
    assert!((ratio / published - 1.0).abs() <= 0.10, "predicted {ratio:.3} against the published {published:.3}");
}

/// The same two peaks absolutely. Not met: 0.765 and 0.894 of the published 82.5 and 72.7 GiB
/// (63.1 and 65.0 GiB predicted; 0.47 and 0.46 when priced as ZeRO 3 with 16-bit gradients).
/// As torchtitan runs them (FSDP under its pipeline: ZeRO 1's layout, fp32 gradients) the
/// first rank holds bf16 parameters 11.6 GiB, fp32 gradients 23.2 GiB, sharded masters and
/// moments 8.7 GiB, activations 15.0 GiB, a recomputed layer 2.5 GiB and the 2 GiB workspace.
/// Not priced: the Float8 casts' buffers (their time is priced), the pipeline's receive buffers (one per
/// microbatch and stage), and the caching allocator's reserve over what it hands out (torchtitan
/// reports the reserved peak); with no published measure of that reserve, no preset term is
/// fitted to these rows. Run on demand: `cargo test --features runner --test published_runs --
/// --ignored torchtitan_405b_peak`.
#[test]
#[ignore = "not met: 0.765 / 0.894 of the published peaks (Float8 casts' buffers, receive buffers and the allocator's reserve not priced; see the doc comment)"]
fn torchtitan_405b_peak_memory() {
    let plans = torchtitan_405b_schedule_plans();
    for (d, (schedule, published)) in plans.iter().zip(TORCHTITAN_405B_PEAK_GIB) {
        let peak = gib(d.predicted.peak_memory_bytes);
        eprintln!("405b {schedule}: predicted peak {peak:.1} GiB, published {published} ({:.3})", peak / published);
        assert!((peak / published - 1.0).abs() <= 0.10, "{schedule}: predicted {peak:.1} GiB against the published {published}");
    }
}

/// Llama 3.1 8B under FSDP alone (the same file, Tables 1 and 3): local batch 2, sequence
/// 8,192, selective activation checkpointing, on 8 and on 128 H100s: 82.4 and 67.0 GiB. The
/// activations are the same per GPU in both; the difference, 15.4 GiB, is the model state that
/// 128 shards hold less of than 8 (fp32 parameters, gradients and Adam's moments, 16 bytes a
/// parameter). The predicted difference within 10 %, so ZeRO 3's sharded state is held against
/// a real run. Recompute is torchtitan's per-op policy (`--selective-policy op`), as it ran.
#[test]
fn torchtitan_8b_fsdp_sharded_state_against_two_world_sizes() {
    let [at8, at128] = [8usize, 128].map(|n| gib(llama3_8b_fsdp(n, smp_partition::ir::CheckpointRule::Selective).predicted.peak_memory_bytes));
    let (diff, published) = (at8 - at128, 82.4 - 67.0);
    eprintln!("8b FSDP peak at 8 GPUs {at8:.1} GiB, at 128 {at128:.1}: difference {diff:.1} GiB, published {published:.1} ({:.3})", diff / published);
    assert!((diff / published - 1.0).abs() <= 0.10, "predicted difference {diff:.1} GiB against the published {published:.1}");
}

/// The 8B rows absolutely (67.0 GiB on 128 GPUs), planned with torchtitan's per-op selective
/// recompute (`--selective-policy op`), as they ran: 67.6 GiB, 1.009 (and 81.7 of 82.4 GiB on 8
/// GPUs, 0.991). A block keeps 0.97 GiB at 16,384 tokens (its input, q, v, attention's output,
/// the gate projection, the MLP's output), as torchtitan's policy keeps. The peak is at the
/// loss's backward: torchtitan's `cross_entropy(pred.flatten(0, 1).float(), ...)` keeps the
/// log-probabilities in f32 (7.8 GiB) and makes their gradient and the logits' beside them
/// (15.7 GiB more). Before the loss was priced so (its copies in the model's 16 bits, its
/// working copies not at all) the row read 0.805 (53.9 GiB), and 0.824 on 8 GPUs: the 13 GiB
/// gap on both world sizes that looked like the caching allocator's reserve was the loss.
#[test]
fn torchtitan_8b_peak_memory() {
    let peak = gib(llama3_8b_fsdp(128, smp_partition::ir::CheckpointRule::Selective).predicted.peak_memory_bytes);
    eprintln!("8b FSDP on 128 GPUs: predicted peak {peak:.1} GiB, published 67.0 ({:.3})", peak / 67.0);
    assert!((peak / 67.0 - 1.0).abs() <= 0.10, "predicted {peak:.1} GiB against the published 67.0");
    let at8 = gib(llama3_8b_fsdp(8, smp_partition::ir::CheckpointRule::Selective).predicted.peak_memory_bytes);
    eprintln!("8b FSDP on 8 GPUs: predicted peak {at8:.1} GiB, published 82.4 ({:.3})", at8 / 82.4);
    assert!((at8 / 82.4 - 1.0).abs() <= 0.10, "predicted {at8:.1} GiB against the published 82.4");
}

/// Llama 3.1 8B on `devices` H100s as torchtitan's FSDP rows ran it: dp over every GPU, ZeRO 3,
/// local batch 2 as one microbatch, sequence 8,192, bf16 beside fp32 masters.
fn llama3_8b_fsdp(devices: usize, checkpointing: smp_partition::ir::CheckpointRule) -> smp_partition::solve::PlanDecision {
    llama3_8b_fsdp_with(devices, checkpointing, false)
}

/// [`llama3_8b_fsdp`], its blocks' linears in Float8 where `float8`.
fn llama3_8b_fsdp_with(devices: usize, checkpointing: smp_partition::ir::CheckpointRule, float8: bool) -> smp_partition::solve::PlanDecision {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join("llama3-8b.onnx");
    let a = load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(8192), ..Default::default() }).unwrap();
    let spec = ClusterSpec::parse(&format!("h100-80gb:{devices}")).unwrap();
    let opts = smp_partition::solve::PlanOptions {
        global_batch: Some(2 * devices as u64),
        seq_len: Some(8192),
        tp: Some(1),
        cp: Some(1),
        pp: Some(1),
        dp: Some(devices),
        zero: Some(3),
        microbatches: Some(1),
        checkpointing: Some(checkpointing),
        // its selective checkpointing is the per-op policy
        selective_policy: (checkpointing == smp_partition::ir::CheckpointRule::Selective).then_some(smp_partition::ir::SelectivePolicy::Ops),
        // torchtitan's H100s hold 96 GB
        memory_limit_gib: Some(1e6),
        mixed_recipe: Some(smp_partition::ir::MixedRecipe::LowModel),
        float8_linears: Some(float8),
        ..Default::default()
    };
    plan(&a.lg, &spec, &opts, &mut |_| {}).unwrap()
}

/// What Float8 linears gain (the same file, Tables 1 and 3): Llama 3.1 8B under FSDP, local
/// batch 2, sequence 8,192, with torch.compile, without and with Float8 (torchao's
/// `Float8Linear`, tensorwise dynamic scaling, the output projection left in bf16): 6,667 →
/// 8,532 tokens/s per GPU on 8 H100s (1.280×) and 6,514 → 8,380 on 128 (1.286×). The predicted
/// ratio of the two steps within 10 % at both sizes (1.036 and 1.020). Both rows ran torchtitan's
/// per-op selective recompute, priced as it (`--selective-policy op`).
#[test]
fn torchtitan_float8_linears_speedup_on_8b() {
    for (devices, bf16, float8) in [(8usize, 6667.0, 8532.0), (128, 6514.0, 8380.0)] {
        let [plain, fp8] = [false, true].map(|f| llama3_8b_fsdp_with(devices, smp_partition::ir::CheckpointRule::Selective, f).predicted.step_time_s);
        let (ratio, published) = (plain / fp8, float8 / bf16);
        eprintln!("8b FSDP on {devices}: step {plain:.3} s in bf16, {fp8:.3} s with Float8 linears: {ratio:.3}× against the published {published:.3}× ({:.3})", ratio / published);
        assert!((ratio / published - 1.0).abs() <= 0.10, "{devices} GPUs: predicted {ratio:.3}× against the published {published:.3}×");
    }
}
