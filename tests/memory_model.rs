//! The memory model against what the runner holds, on the bundled Llama export (4 blocks,
//! hidden 64, f32): the causal mask every block's attention reads is one tensor, held once per
//! pipeline stage and microbatch in flight (not once per block).

use std::path::{Path, PathBuf};
use std::process::Command;

use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{LayerKind, LayeredGraph};
use smp_partition::passes::{AnalyzeOptions, analyze};

const SEQ: usize = 256;

fn llama_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/llama.onnx")
}

fn llama() -> LayeredGraph {
    analyze(load_model(&llama_path()).unwrap().graph, &AnalyzeOptions { seq_len: Some(SEQ as i64), ..Default::default() }).unwrap()
}

/// Plans the export with `flags` (sequence 256, no recompute) and returns each stage's
/// activation bytes, with the log-probabilities of the microbatch at the loss, which the plan
/// counts in the loss's part (a third of it: they and their two gradients).
fn stage_activations(nproc: usize, flags: &[&str]) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .arg(llama_path())
        .args(["--cluster", &format!("cpu:{nproc}"), "--seq-len", &SEQ.to_string(), "--checkpointing", "none", "-o"])
        .arg(&out)
        .args(flags)
        .output()
        .unwrap();
    assert!(r.status.success(), "planning: {}", String::from_utf8_lossy(&r.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let m = |s: &serde_json::Value, part: &str| s["memory_bytes"][part].as_f64().unwrap();
    plan["stages"].as_array().unwrap().iter().map(|s| m(s, "activations") + m(s, "loss") / 3.0).collect()
}

/// The additive causal mask, f32 [s, s] per sample.
fn mask_bytes() -> f64 {
    (SEQ * SEQ * 4) as f64
}

#[test]
fn every_block_reads_the_one_mask() {
    let lg = llama();
    let blocks: Vec<_> = lg.layers.iter().filter(|l| l.kind == LayerKind::Block).collect();
    assert_eq!(blocks.len(), 4);
    for l in &blocks {
        // the mask and the rotary tables (cos and sin, [s, 16] f32 each) are inputs every
        // block reads, and attention keeps the mask for its backward
        let tables = (2 * SEQ * 16 * 4) as f64;
        let shared = l.shared_input_bytes;
        assert!(shared >= mask_bytes() + tables && shared < 1.01 * (mask_bytes() + tables), "{}: shared {shared}", l.name);
        assert!(l.shared_saved_bytes >= mask_bytes() && l.shared_saved_bytes <= l.shared_input_bytes, "{}: {}", l.name, l.shared_saved_bytes);
    }
}

#[test]
fn one_process_holds_the_mask_once_not_once_per_block() {
    let lg = llama();
    let batch = 2.0;
    let per_block: f64 = lg.layers.iter().map(|l| l.figures.saved_bytes).sum::<f64>() * batch;
    let got = stage_activations(1, &["--global-batch", "2", "--pp", "1", "--tp", "1", "--dp", "1", "--microbatches", "1"]);
    assert_eq!(got.len(), 1);
    // every block's own bytes, and the mask once: three masks fewer than a count per block
    let want = per_block - 3.0 * mask_bytes() * batch;
    assert!((got[0] - want).abs() < 0.02 * want, "predicted {:.1} MB, want {:.1} MB (a mask per block: {:.1} MB)", got[0] / 1e6, want / 1e6, per_block / 1e6);
}

#[test]
fn pipeline_stages_each_hold_the_mask_once() {
    let lg = llama();
    // 1F1B over 2 stages, 4 microbatches of 1: stage 0 holds 2 in flight, stage 1 one
    let got = stage_activations(2, &["--global-batch", "4", "--pp", "2", "--tp", "1", "--dp", "1", "--microbatches", "4", "--schedule", "1f1b"]);
    assert_eq!(got.len(), 2);
    let own = |l: &smp_partition::ir::Layer| l.figures.saved_bytes - l.shared_saved_bytes;
    let total_own: f64 = lg.layers.iter().map(own).sum();
    // the mask and the rotary tables
    let mask = lg.layers.iter().map(|l| l.shared_input_bytes).fold(0.0, f64::max);
    assert!(mask > mask_bytes());
    // whichever the cut, the two stages hold every layer's own bytes and one mask each (and
    // the tables): stage 0 twice (2 in flight), stage 1 once
    let stage0_own = got[0] / 2.0 - mask;
    let stage1_own = got[1] - mask;
    assert!(stage0_own > 0.0 && stage1_own > 0.0, "{got:?}");
    let sum = stage0_own + stage1_own;
    assert!((sum - total_own).abs() < 1e-6 * total_own, "stages' own bytes {sum} vs the layers' {total_own} ({got:?})");
}
