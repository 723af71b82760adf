//! Tensor parallelism on exports at Hugging Face's default init: Llama (4 heads, 2 KV heads,
//! like models/llama.onnx) and GPT-NeoX (partial rotary, parallel residual), exported at test
//! time by tests/tp_exports.py with the parameter record and no perturbation (the exporter
//! merges the equal LayerNorm weights and drops zero biases; `passes::params` unties and
//! restores them). Megatron's split is forced (`--baseline megatron`) so heads are really split;
//! tp 2 and pp 2 × tp 2 plans train 5 f64 steps through `smp-runner launch` and must equal one
//! process within 1e-9 relative. Merged or restored tensors that reached every rank with a
//! partial gradient would show here from step 2 on.
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;


/// The exports' directory, generated once per content of the scripts.
fn exports() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::exports::exported("tp_exports.py", "neox.onnx"))
}

fn step_losses(stdout: &[u8]) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_slice(stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(stdout)));
    v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

/// One process, 5 f64 steps, 2 microbatches of 4 (the plans' geometry).
fn single(model: &Path) -> Vec<f64> {
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["train", model.to_str().unwrap(), "--batch", "8", "--seq-len", "16", "--microbatches", "2"])
        .args(["--steps", "5", "--dtype", "f64", "--threads", "1", "--json"])
        .output()
        .unwrap();
    assert!(r.status.success(), "single-process run of {} failed: {}", model.display(), String::from_utf8_lossy(&r.stderr));
    step_losses(&r.stdout)
}

/// Plans `model` at pp × tp with Megatron's split, checks every block's heads are split, and
/// returns its 5 f64 steps' losses.
fn planned(model: &Path, pp: usize, tp: usize) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let n = pp * tp;
    let plan = common::runner::plan_megatron(model, pp, tp, &out);
    let shards = plan["codegen"]["shards"].as_array().unwrap();
    // embedding, 4 blocks, head: each block slices its attention and MLP weights
    assert_eq!(shards.len(), 6, "{}", model.display());
    for (l, layer) in shards.iter().enumerate().skip(1).take(4) {
        let slices = layer[0]["weight_slices"].as_array().map_or(0, Vec::len);
        assert!(slices >= 4, "{} pp{pp} tp{tp}: block layer {l} slices {slices} weights", model.display());
    }
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", &n.to_string(), out.to_str().unwrap()])
        .args(["--steps", "5", "--dtype", "f64", "--threads", "1", "--json", "--timeout", "120"])
        .output()
        .unwrap();
    assert!(r.status.success(), "launch of {} pp{pp} tp{tp} failed: {}", model.display(), String::from_utf8_lossy(&r.stderr));
    step_losses(&r.stdout)
}

fn check(name: &str) {
    let model = exports().join(format!("{name}.onnx"));
    let want = single(&model);
    assert_eq!(want.len(), 5);
    assert!(want[4] < want[0], "{name}: the single process does not train: {want:?}");
    for (pp, tp) in [(1, 2), (2, 2)] {
        let got = planned(&model, pp, tp);
        assert_eq!(got.len(), want.len());
        let worst = got.iter().zip(&want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max);
        eprintln!("{name} pp{pp} tp{tp} f64: max relative loss difference {worst:.2e}");
        assert!(worst <= 1e-9, "{name} pp{pp} tp{tp}: losses {got:?} vs one process {want:?} ({worst:.2e})");
    }
}

#[test]
fn llama_at_default_init_tp2_and_pp2_tp2_equal_one_process() {
    check("llama");
}

#[test]
fn neox_at_default_init_tp2_and_pp2_tp2_equal_one_process() {
    check("neox");
}
