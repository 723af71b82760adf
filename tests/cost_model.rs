//! Cost model against closed forms from the literature: model state 16Ψ and its ZeRO
//! divisions, ring collectives, hierarchical all-reduce, roofline and memory accounting.

mod common;

use smp_partition::cost::{CalibrationFile, FactSource, MachineFacts};
use smp_partition::cost::memory::{stage_activation_bytes, StatePrecision};
use smp_partition::cost::{ClusterSpec, CommModel, GroupSpan, LinkKind, model_state};
use smp_partition::ir::{Graph, Layer, LayerKind, NodeFigures};

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-300)
}

#[test]
fn model_state_is_16_psi_divided_as_zero_defines() {
    // ZeRO paper, Fig. 1: Ψ = 7.5B, N_d = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    let psi = 7.5e9;
    let gb = |z| model_state(psi, psi, z, 64, StatePrecision::MIXED_ADAM).total() / 1e9;
    assert!(rel(gb(0), 120.0) < 1e-12);
    assert!(rel(gb(1), 31.4) < 0.01, "{}", gb(1));
    assert!(rel(gb(2), 16.6) < 0.01, "{}", gb(2));
    assert!(rel(gb(3), 1.875) < 1e-12, "{}", gb(3));
    let s = model_state(psi, psi, 2, 8, StatePrecision::MIXED_ADAM);
    assert_eq!((s.params, s.grads, s.optimizer), (2.0 * psi, 2.0 * psi / 8.0, 12.0 * psi / 8.0));
    assert_eq!(model_state(1.0, 1.0, 0, 1, StatePrecision::FP32_ADAM).total(), 16.0);
}

#[test]
fn ring_collectives_match_the_closed_forms() {
    let spec = ClusterSpec::parse("a100-80gb:64").unwrap();
    let c = CommModel::new(&spec);
    let b = 2.0e9;
    for n in [2usize, 4, 8] {
        let g = GroupSpan::intra_node(n);
        let nf = n as f64;
        let (bw, a) = (spec.intra_node_bandwidth, spec.intra_node_latency);
        assert!(rel(c.all_reduce(b, &g), 2.0 * (nf - 1.0) / nf * b / bw + 2.0 * (nf - 1.0) * a) < 1e-12);
        assert!(rel(c.all_gather(b, &g), (nf - 1.0) / nf * b / bw + (nf - 1.0) * a) < 1e-12);
        assert!(rel(c.reduce_scatter(b, &g), (nf - 1.0) / nf * b / bw + (nf - 1.0) * a) < 1e-12);
    }
    // One rank per node: a flat ring on the network.
    let g = GroupSpan::strided(0, 8, 8, 8);
    assert_eq!(g.link_kind(), LinkKind::InterNode);
    let (bw, a) = (spec.inter_node_bandwidth, spec.inter_node_latency);
    assert!(rel(c.all_reduce(b, &g), 2.0 * 7.0 / 8.0 * b / bw + 14.0 * a) < 1e-12);
    assert_eq!(c.all_reduce(b, &GroupSpan::intra_node(1)), 0.0);
    assert!(rel(c.p2p(b, LinkKind::InterNode), b / bw + a) < 1e-12);
}

#[test]
fn crossing_nodes_costs_the_network_and_hierarchy_helps() {
    let spec = ClusterSpec::parse("h100-80gb:64").unwrap();
    let c = CommModel::new(&spec);
    let b = 1.0e9;
    // 64 ranks, 8 per node: hierarchical = 2 intra half-rings of 8 + inter ring of 8 on B/8.
    let g = GroupSpan::strided(0, 64, 1, 8);
    assert_eq!((g.per_node, g.nodes()), (8, 8));
    let (bi, ai, be, ae) = (spec.intra_node_bandwidth, spec.intra_node_latency, spec.inter_node_bandwidth, spec.inter_node_latency);
    let hier = 2.0 * (7.0 / 8.0 * b / bi + 7.0 * ai) + (2.0 * 7.0 / 8.0 * (b / 8.0) / be + 14.0 * ae);
    let flat = 2.0 * 63.0 / 64.0 * b / be + 126.0 * ae;
    assert!(hier < flat);
    assert!(rel(c.all_reduce(b, &g), hier) < 1e-12);
    // Inside a node is faster than across nodes for the same group size.
    assert!(c.all_reduce(b, &GroupSpan::intra_node(8)) < c.all_reduce(b, &GroupSpan::strided(0, 8, 8, 8)));
    // Tiny messages: latency dominates, the flat ring's 2(n−1) inter hops lose to hierarchy too.
    assert!(c.all_reduce(1e3, &g) <= 126.0 * ae + 1e-3);
}

fn layer(saved: f64, input: f64) -> Layer {
    Layer {
        index: 0,
        name: "h.0".into(),
        kind: LayerKind::Block,
        nodes: vec![],
        signature: String::new(),
        params: vec![],
        shared_params: vec![],
        inputs: vec![],
        outputs: vec![],
        figures: NodeFigures { saved_bytes: saved, ..Default::default() },
        input_bytes: input,
        offload_bytes: input,
        output_bytes: input,
        shared_input_bytes: 0.0,
        shared_saved_bytes: 0.0,
        selective_bytes: 0.0,
        selective_nodes: Vec::new(),
        op_selective: Default::default(),
        op_freed_bytes: 0.0,
        op_held_bytes: 0.0,
        loss_kept_bytes: 0.0,
    }
}

#[test]
fn activations_with_and_without_checkpointing() {
    let (a, b) = (layer(100.0, 10.0), layer(60.0, 10.0));
    // No checkpointing: in-flight × Σ saved × microbatch.
    assert_eq!(stage_activation_bytes(&[(&a, false), (&b, false)], 2.0, 4.0, 1.0), 4.0 * 2.0 * 160.0);
    // Both checkpointed: inputs only, plus the larger layer's recompute set once.
    assert_eq!(stage_activation_bytes(&[(&a, true), (&b, true)], 2.0, 4.0, 1.0), 4.0 * 2.0 * 20.0 + 2.0 * 90.0);
    // bf16 training of an f32 graph halves the bytes.
    assert_eq!(stage_activation_bytes(&[(&a, false)], 1.0, 1.0, 0.5), 50.0);
    let _ = Graph::default();
}

#[test]
fn usable_memory_subtracts_the_workspace_margin() {
    let s = ClusterSpec::parse("a100-40gb").unwrap();
    assert_eq!(s.usable_memory(), (40_960u64 << 20) - (2u64 << 30));
}

fn facts(memory_gib: u64, cores: usize, calibration: Option<CalibrationFile>) -> MachineFacts {
    MachineFacts { memory_bytes: memory_gib << 30, cores, calibration, source: FactSource::Host }
}

#[test]
fn cpu_preset_is_the_machine_it_is_given() {
    let small = ClusterSpec::parse_on("cpu", &facts(24, 2, None)).unwrap();
    assert_eq!((small.devices, small.memory_bytes), (2, 12 << 30));
    let big = ClusterSpec::parse_on("cpu:4", &facts(64, 16, None)).unwrap();
    assert_eq!((big.devices, big.devices_per_node, big.memory_bytes), (4, 4, 16 << 30));
    assert_eq!(big.machine.as_ref().map(|m| m.cores), Some(16));
    // without facts, `cpu` says what is missing and how to state it
    let e = ClusterSpec::parse("cpu:2").unwrap_err().to_string();
    assert!(e.contains("machine facts") && e.contains("[machine]"), "{e}");
    // GPU presets need none and record none
    assert!(ClusterSpec::parse_on("h100-80gb:8", &facts(1, 1, None)).unwrap().machine.is_none());
}

#[test]
fn cpu_preset_takes_rates_from_the_calibration() {
    let cal = CalibrationFile::new("cpu.toml", "fp32_flops = 123e9\nintra_node_bandwidth = 7e9\n".to_string());
    let s = ClusterSpec::parse_on("cpu:2", &facts(8, 2, Some(cal.clone()))).unwrap();
    assert_eq!((s.devices, s.fp32_flops, s.intra_node_bandwidth), (2, 123e9, 7e9));
    assert_eq!(s.machine.unwrap().calibration.unwrap().sha256, cal.sha256);
    let bad = CalibrationFile::new("cpu.toml", "fp32_flops = \"fast\"\n".to_string());
    let e = ClusterSpec::parse_on("cpu", &facts(8, 2, Some(bad))).unwrap_err().to_string();
    assert!(e.contains("cpu.toml") && e.contains("fp32_flops"), "{e}");
}

#[test]
fn several_cpu_devices_compute_at_the_calibrated_shared_rates() {
    let text = "fp32_flops = 100e9\nbf16_flops = 100e9\nhbm_bandwidth = 10e9\n[concurrent]\nflops_factor = 0.9\nbandwidth_factor = 0.5\n";
    let cal = CalibrationFile::new("cpu.toml", text.to_string());
    // one device computes alone: its own rates
    let one = ClusterSpec::parse_on("cpu:1", &facts(8, 2, Some(cal.clone()))).unwrap();
    assert_eq!((one.fp32_flops, one.bf16_flops, one.hbm_bandwidth), (100e9, 100e9, 10e9));
    // two share the machine: each at what a core keeps while every core computes
    let two = ClusterSpec::parse_on("cpu:2", &facts(8, 2, Some(cal))).unwrap();
    assert!((two.fp32_flops - 90e9).abs() < 1.0 && (two.bf16_flops - 90e9).abs() < 1.0, "{two:?}");
    assert!((two.hbm_bandwidth - 5e9).abs() < 1.0, "{two:?}");
    // a factor that is no fraction names itself and the fix
    let bad = CalibrationFile::new("cpu.toml", "[concurrent]\nflops_factor = 0.0\nbandwidth_factor = 1.0\n".to_string());
    let e = ClusterSpec::parse_on("cpu:2", &facts(8, 2, Some(bad))).unwrap_err().to_string();
    assert!(e.contains("cpu.toml") && e.contains("flops_factor") && e.contains("calibrate"), "{e}");
    // the table belongs to a calibration file, not to a cluster file
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("box.toml");
    std::fs::write(&file, "preset = \"h100-80gb\"\n[concurrent]\nflops_factor = 0.9\nbandwidth_factor = 0.9\n").unwrap();
    let e = ClusterSpec::parse(&format!("{}:2", file.display())).unwrap_err().to_string();
    assert!(e.contains("box.toml") && e.contains("[concurrent]") && e.contains("calibration"), "{e}");
}

#[test]
fn a_cluster_file_states_the_machine() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cal.toml"), "fp32_flops = 80e9\n").unwrap();
    let file = dir.path().join("box.toml");
    std::fs::write(&file, "preset = \"cpu\"\n[machine]\nmemory_bytes = 34359738368\ncores = 4\ncalibration = \"cal.toml\"\n").unwrap();
    let spec = format!("{}:2", file.display());
    // the host's facts are not consulted when the file states them
    let s = ClusterSpec::parse_on(&spec, &facts(1, 64, None)).unwrap();
    assert_eq!((s.devices, s.devices_per_node, s.memory_bytes, s.fp32_flops), (2, 2, 16 << 30, 80e9));
    let m = s.machine.unwrap();
    assert_eq!((m.cores, m.source), (4, FactSource::ClusterFile(file.display().to_string())));
    assert!(m.calibration.unwrap().path.ends_with("cal.toml"));
    // and it needs no host at all
    assert_eq!(ClusterSpec::parse(&spec).unwrap().memory_bytes, 16 << 30);
    // a `cpu` file without the table takes the host's
    std::fs::write(&file, "preset = \"cpu\"\n").unwrap();
    assert_eq!(ClusterSpec::parse_on(&spec, &facts(8, 2, None)).unwrap().memory_bytes, 4 << 30);
    let e = ClusterSpec::parse(&spec).unwrap_err().to_string();
    assert!(e.contains("box.toml") && e.contains("[machine]"), "{e}");
    // the table is for cpu files only
    std::fs::write(&file, "preset = \"h100-80gb\"\n[machine]\nmemory_bytes = 1\ncores = 1\n").unwrap();
    let e = ClusterSpec::parse(&spec).unwrap_err().to_string();
    assert!(e.contains("[machine]") && e.contains("cpu"), "{e}");
}

/// ZeRO 3's weight gathers, one before each forward and backward of a layer, are prefetched
/// beside the layer before (the same block): on a device that overlaps them only what exceeds
/// the layer's pass is paid, on one that does not (`cpu`, or `overlapped_gathers = false`) all
/// of it. Checked against the ring's closed form on a small and a large microbatch, so that one
/// gather hides and one does not.
#[test]
fn zero3_gathers_are_paid_beyond_the_pass_they_hide_behind() {
    use smp_partition::solve::layer_cost::{CostContext, LayerConfig};
    let lg = common::gpt(common::GptShape { layers: 2, hidden: 2048.0, heads: 16.0, seq: 1024.0, vocab: 32000.0 });
    let overlapping = ClusterSpec::parse("h100-80gb:16").unwrap();
    assert!(overlapping.overlapped_gathers);
    let exposed = ClusterSpec { overlapped_gathers: false, ..overlapping.clone() };
    let group = GroupSpan { size: 16, per_node: 8 };
    let tp1 = GroupSpan { size: 1, per_node: 1 };
    let (mut hidden, mut paid) = (0, 0);
    for microbatch in [1usize, 64] {
        for spec in [&overlapping, &exposed] {
            let mut ctx = CostContext::new(&lg, spec, spec.default_precision());
            let block = (0..lg.layers.len()).find(|&l| lg.layers[l].kind == LayerKind::Block).unwrap();
            let at = |ctx: &mut CostContext, zero| ctx.layer(block, &LayerConfig::dense(1, microbatch, zero, group, group, tp1, false)).points[0].clone();
            let (plain, sharded) = (at(&mut ctx, 0), at(&mut ctx, 3));
            let gather = ctx.comm.all_gather(sharded.gathered_bytes, &group);
            assert!(gather > 0.0);
            for (pass, with) in [(plain.fwd_s, sharded.fwd_s), (plain.bwd_s, sharded.bwd_s)] {
                let want = if spec.overlapped_gathers { pass + (gather - pass).max(0.0) } else { pass + gather };
                assert!(rel(with, want) < 1e-12, "microbatch {microbatch}, overlapped {}: {with} s against {want} s", spec.overlapped_gathers);
                if spec.overlapped_gathers {
                    if gather <= pass { hidden += 1 } else { paid += 1 }
                }
            }
        }
    }
    assert!(hidden > 0 && paid > 0, "both regimes: {hidden} hidden, {paid} partly paid");
}

/// torchtitan's per-op selective recompute on a Llama 3 8B block, counted by hand at sequence
/// 8,192 in bf16 (one sample): the policy keeps q, v, attention's output, the gate projection
/// and the MLP's output (wq, wv, attention, w1, w2: the first, third, … weight products and
/// attention) and rebuilds k, the output projection, w3, the norms, rotary, the residual sum
/// and SwiGLU. What the backwards kept of the rebuilt ones is freed: the two norms' outputs,
/// the rotated q, k and v expanded over the 32 heads, the attention output's copy, the residual
/// sum (seven hidden-sized tensors) and w3's and SwiGLU's outputs and its silu(gate) (three
/// MLP-sized ones). Held
/// beyond what the backwards keep: q, v (8 heads), attention's output and w2's.
#[test]
fn per_op_policy_keeps_and_rebuilds_what_torchtitan_does_in_a_llama_block() {
    use smp_partition::compile::load_and_analyze;
    use smp_partition::passes::AnalyzeOptions;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join("llama3-8b.onnx");
    let a = load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(8192), ..Default::default() }).unwrap();
    let lg = &a.lg;
    let block = lg.layers.iter().find(|l| l.kind == LayerKind::Block).unwrap();
    let kinds = |nodes: &[smp_partition::ir::NodeId]| nodes.iter().map(|&n| lg.graph.node(n).op.kind().map_or("?", |k| k.name())).collect::<Vec<_>>();
    // weight products first, third, fifth and seventh, and the product that reads the scores
    assert_eq!(kinds(&block.op_selective.kept), ["MatMul"; 5]);
    let rebuilt = kinds(&block.op_selective.rebuilt);
    for (kind, count) in [("MatMul", 3), ("RMSNormalization", 2), ("ApplyRotary", 2), ("SwiGlu", 1), ("Add", 1)] {
        assert_eq!(rebuilt.iter().filter(|&&k| k == kind).count(), count, "{kind} in {rebuilt:?}");
    }
    let (s, h, kv, f, bf16) = (8192.0, 4096.0, 1024.0, 14336.0, 2.0);
    let hidden = s * h * bf16;
    // and SwiGLU's silu(gate), kept inside the fused op, rebuilt with it
    assert_eq!(block.op_freed_bytes, 7.0 * hidden + 3.0 * s * f * bf16);
    assert_eq!(block.op_held_bytes, 3.0 * hidden + s * kv * bf16);
    // the embedding and the head keep theirs, as torchtitan wraps its blocks alone
    assert!(lg.layers.iter().filter(|l| l.kind != LayerKind::Block).all(|l| l.op_selective.rebuilt.is_empty() && l.op_freed_bytes == 0.0));
}

/// The training loss's copies, by hand: PyTorch's cross entropy keeps the log-probabilities of
/// the logits and, in its backward, makes their gradient and the logits' beside them, each in
/// f32 (torchtitan's `.float()` first). On Llama 3 8B at 8,192 tokens a microbatch that is
/// 3 × 8,192 × 128,256 × 4 bytes at the loss's backward on the stage computing it, nothing on
/// the others; the log-probabilities of the other microbatches in flight are kept activations,
/// and checkpointing the head does not free them (the loss, outside the layer, keeps them); a
/// vocabulary-split head halves the copies at t 2.
#[test]
fn the_loss_working_copies_are_priced_on_the_stage_computing_it() {
    use smp_partition::ir::{CheckpointRule, MixedRecipe};
    use smp_partition::passes::AnalyzeOptions;
    use smp_partition::solve::{PlanOptions, plan};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join("llama3-8b.onnx");
    let a = smp_partition::compile::load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(8192), ..Default::default() }).unwrap();
    let (tokens, vocab) = (8192.0, 128_256.0);
    let logits_f32 = tokens * vocab * 4.0;
    let plan_at = |tp: usize, checkpointing: CheckpointRule, schedule: smp_partition::ir::ScheduleKind| {
        let spec = ClusterSpec::parse(&format!("h100-80gb:{}", 2 * tp)).unwrap();
        let opts = PlanOptions {
            global_batch: Some(4),
            seq_len: Some(8192),
            tp: Some(tp),
            cp: Some(1),
            pp: Some(2),
            dp: Some(1),
            microbatches: Some(4),
            checkpointing: Some(checkpointing),
            schedule: Some(schedule),
            memory_limit_gib: Some(1e6),
            mixed_recipe: Some(MixedRecipe::LowModel),
            ..Default::default()
        };
        plan(&a.lg, &spec, &opts, &mut |_| {}).unwrap()
    };
    use smp_partition::ir::ScheduleKind::{GPipe, OneFOneB};
    let whole = plan_at(1, CheckpointRule::Never, OneFOneB);
    let [first, last] = [&whole.stages[0], &whole.stages[1]];
    assert_eq!(first.memory.loss, 0.0);
    assert!(rel(last.memory.loss, 3.0 * logits_f32) < 1e-9, "{} against {}", last.memory.loss, 3.0 * logits_f32);
    // the total counts it beside the kept activations (no layer recomputed: no other transient)
    let m = last.memory;
    assert!(rel(m.total, m.params + m.grads + m.optimizer + m.activations + m.loss + m.workspace) < 1e-12);
    // every layer checkpointed under GPipe: the last stage keeps the log-probabilities of the
    // three microbatches beside the one at the loss
    let ckpt = plan_at(1, CheckpointRule::Always, GPipe);
    assert!(ckpt.stages[1].memory.activations >= 3.0 * logits_f32, "{} kept under full recompute", ckpt.stages[1].memory.activations);
    let split = plan_at(2, CheckpointRule::Never, OneFOneB);
    // the logits' node as the plan splits it: by vocabulary columns, the loss runs on each
    // rank's (loss parallel); replicated, whole
    let logits = &a.lg.graph.node(a.lg.loss.unwrap().node).name;
    let strategy = split.layers.iter().flat_map(|l| &l.nodes).find(|(n, _)| n == logits).map(|(_, s)| *s).unwrap();
    let by = if strategy == smp_partition::split::Strategy::Replicate { 1.0 } else { 2.0 };
    assert!(rel(split.stages[1].memory.loss, 3.0 * logits_f32 / by) < 1e-9, "t 2, logits {strategy:?}: {}", split.stages[1].memory.loss);
}
