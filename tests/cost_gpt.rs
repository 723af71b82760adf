//! The cost model on the graph-only GPT-3 175B export (bf16, seq 2048, h 12288, 96 heads):
//! per block saved activations against Korthikanti et al. 2022 without dropout, forward FLOPs
//! against Narayanan et al. 2021, and the compute model's backward/forward ratio.

use std::path::Path;

use smp_partition::cost::compute::{graph_float_dtype, layer_times};
use smp_partition::cost::memory::layer_activation_bytes;
use smp_partition::cost::ClusterSpec;
use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{DType, LayerKind, LayeredGraph};
use smp_partition::passes::{AnalyzeOptions, analyze};

fn gpt3() -> LayeredGraph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/gpt3-175b.onnx");
    let model = load_model(&path).unwrap();
    analyze(model.graph, &AnalyzeOptions { seq_len: Some(2048), ..Default::default() }).unwrap()
}

#[test]
fn gpt3_block_saved_activations_match_korthikanti_without_dropout() {
    let lg = gpt3();
    assert_eq!(graph_float_dtype(&lg.graph), DType::BF16);
    let (s, h, a) = (2048.0, 12288.0, 96.0);
    // Korthikanti et al. 2022, Eq. 2, bytes per layer for b = 1: sbh(34 + 5as/h); without the
    // three dropout masks (2 × sbh, as²b) and the attention dropout output (2as²b):
    let expect = s * h * (32.0 + 2.0 * a * s / h);
    let blocks: Vec<_> = lg.layers.iter().filter(|l| l.kind == LayerKind::Block).collect();
    assert_eq!(blocks.len(), 96);
    for l in &blocks {
        let got = layer_activation_bytes(l, 1.0, false, 1.0);
        let rel = (got - expect).abs() / expect;
        assert!(rel < 0.05, "block {}: saved {got:.4e} vs Korthikanti {expect:.4e} ({:.2} %)", l.name, rel * 100.0);
        // Checkpointed, a block keeps only its input: sbh bf16 = 2sh bytes (plus small masks).
        let ck = layer_activation_bytes(l, 1.0, true, 1.0);
        assert!(ck >= 2.0 * s * h && ck < 1.05 * 2.0 * s * h + 8.0 * s * s, "block {}: input {ck:.4e}", l.name);
    }
}

#[test]
fn gpt3_block_flops_and_times() {
    let lg = gpt3();
    let (s, h) = (2048.0, 12288.0);
    // Narayanan et al. 2021: forward of one layer 24bsh² + 4bs²h (b = 1).
    let expect = 24.0 * s * h * h + 4.0 * s * s * h;
    let spec = ClusterSpec::parse("a100-80gb:8").unwrap();
    let block = lg.layers.iter().find(|l| l.kind == LayerKind::Block).unwrap();
    let rel = (block.figures.flops - expect).abs() / expect;
    assert!(rel < 0.02, "block flops {:.4e} vs {expect:.4e}", block.figures.flops);
    let t = layer_times(&lg, block.index, &spec, DType::BF16, 1.0, 1);
    // GEMMs dominate: backward ≈ 2× forward; half of it is weight gradient.
    assert!(t.bwd > 1.8 * t.fwd && t.bwd <= 2.0 * t.fwd, "fwd {} bwd {}", t.fwd, t.bwd);
    // Large GEMMs at ~75 % of 312 TFLOP/s: the block's forward within 30 % of FLOPs / (0.75·peak).
    let ideal = expect / (0.75 * 312e12);
    assert!(t.fwd > ideal && t.fwd < 1.3 * ideal, "fwd {} vs {ideal}", t.fwd);
    // Tensor parallelism divides the work (efficiency drops a little on smaller shards).
    let t8 = layer_times(&lg, block.index, &spec, DType::BF16, 1.0, 8);
    assert!(t8.fwd > t.fwd / 8.0 && t8.fwd < t.fwd / 6.0, "t=8 fwd {}", t8.fwd);
}

/// Attention scores as the figures mark them, against the shapes: per block, Q·Kᵀ writes
/// a·s² elements, the scale, the mask and the softmax each read and write them, ·V reads them
/// (bf16: 2 bytes); the softmax output (a·s² · 2 bytes) is the saved part. With fused attention
/// (the H100 preset) none of it is charged, so the block's forward drops by at least the
/// materialised score traffic's time; without it (A100) nothing changes.
#[test]
fn gpt3_attention_scores_are_marked_and_free_under_fused_attention() {
    let lg = gpt3();
    let (s, a) = (2048.0, 96.0);
    let scores = a * s * s * 2.0;
    let block = lg.layers.iter().find(|l| l.kind == LayerKind::Block).unwrap();
    // The graph-only export holds no constant data: its scale and its `Where` fill are unknown,
    // so `passes::fuse` leaves the attention unfused (it fuses only what it proves).
    assert!(lg.fused.is_empty(), "{:?}", lg.fused);
    // Q·Kᵀ writes once; scale, mask and softmax read and write; ·V reads: 8 score passes.
    let marked: f64 = block.nodes.iter().map(|&n| lg.node_figures(n).score_bytes).sum();
    assert!((marked - 8.0 * scores).abs() < 1e-6 * scores, "score bytes {marked:.4e} vs 8 × {scores:.4e}");
    assert_eq!(block.figures.score_saved_bytes, scores);
    // The marked nodes are the attention core's: Q·Kᵀ, scale, mask, softmax, ·V.
    let marked: Vec<String> =
        block.nodes.iter().filter(|&&n| lg.node_figures(n).score_bytes > 0.0).map(|&n| lg.graph.node(n).op.to_string()).collect();
    assert_eq!(marked, ["MatMul", "Mul", "Where", "Softmax", "MatMul"]);
    let a100 = ClusterSpec::parse("a100-80gb:8").unwrap();
    let fused_a100 = ClusterSpec { fused_attention: true, ..a100.clone() };
    let plain = layer_times(&lg, block.index, &a100, DType::BF16, 1.0, 1);
    let fused = layer_times(&lg, block.index, &fused_a100, DType::BF16, 1.0, 1);
    let traffic = 8.0 * scores / (a100.hbm_bandwidth * a100.hbm_efficiency);
    assert!(fused.fwd < plain.fwd && plain.fwd - fused.fwd <= traffic * 1.0001, "fwd {} → {}", plain.fwd, fused.fwd);
    // The elementwise score ops were memory-bound: their 6 passes are all saved.
    assert!(plain.fwd - fused.fwd >= 6.0 * scores / (a100.hbm_bandwidth * a100.hbm_efficiency) * 0.999);
    assert!(!a100.fused_attention && ClusterSpec::parse("h100-80gb:8").unwrap().fused_attention);
}
