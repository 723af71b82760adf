//! Fixed-batch exports run at any microbatch size: a small GPT-2 (HF's default init) exported
//! at a fixed batch of 8 and with a dynamic batch (tests/fixed_batch.py, run at test time with
//! the project venv, cached under the target dir by the script's content), planned at
//! `--pp 2 --global-batch 8 --microbatches 8` and trained 5 f32 steps on the same data
//! through `smp-runner launch`: the fixed export's plan rebinds the batch to microbatches of 1
//! (its codegen section says so) and its losses equal the dynamic export's within 1e-5
//! relative. A batch reshaped into a later dim is refused with the fix.
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;


/// The exports' directory, generated once per content of the scripts.
fn exports() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::exports::exported("fixed_batch.py", "data.npz"))
}

fn plan(model: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    let cluster = common::cluster_arg("cpu:2");
    Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args([model.to_str().unwrap(), "--cluster", &cluster, "-o", out.to_str().unwrap()])
        .args(["--pp", "2", "--tp", "1", "--dp", "1", "--global-batch", "8", "--microbatches", "8"])
        .args(extra)
        .output()
        .unwrap()
}

fn losses(plan: &Path) -> Vec<f64> {
    let data = exports().join("data.npz");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--data", data.to_str().unwrap()])
        .args(["--steps", "5", "--dtype", "f32", "--threads", "1", "--json", "--timeout", "120"])
        .output()
        .unwrap();
    assert!(r.status.success(), "launch of {} failed: {}", plan.display(), String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

#[test]
fn fixed_batch_export_trains_microbatches_of_one_under_pp2_as_the_dynamic_export() {
    let dir = tempfile::tempdir().unwrap();
    let (fixed, dynamic) = (dir.path().join("fixed.json"), dir.path().join("dynamic.json"));
    let r = plan(&exports().join("fixed.onnx"), &fixed, &[]);
    assert!(r.status.success(), "planning the fixed export: {}", String::from_utf8_lossy(&r.stderr));
    let r = plan(&exports().join("dynamic.onnx"), &dynamic, &["--seq-len", "16"]);
    assert!(r.status.success(), "planning the dynamic export: {}", String::from_utf8_lossy(&r.stderr));
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&fixed).unwrap()).unwrap();
    assert_eq!(p["codegen"]["batch"], serde_json::json!({"fixed": 8, "microbatch": 1}), "the plan rebinds the batch");
    let q: serde_json::Value = serde_json::from_slice(&std::fs::read(&dynamic).unwrap()).unwrap();
    assert!(q["codegen"].get("batch").is_none(), "a dynamic batch needs no rebinding");

    let want = losses(&dynamic);
    let got = losses(&fixed);
    assert_eq!(got.len(), 5);
    let worst = got.iter().zip(&want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max);
    eprintln!("fixed vs dynamic export, pp 2, 8 microbatches of 1: max relative loss difference {worst:.2e}");
    assert!(worst <= 1e-5, "fixed-batch losses {got:?} vs dynamic {want:?} (max rel {worst:.2e})");
    // the losses move: the steps train
    assert!(want[4] < want[0], "{want:?}");
}

#[test]
fn single_process_microbatches_of_a_fixed_export_match_its_whole_batch() {
    // `smp-runner train --microbatches 4` on the fixed export runs microbatches of 2; the
    // gradient accumulation over them equals one batch of 8 (f64)
    let data = exports().join("data.npz");
    let run = |m: &str| {
        let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .args(["train", exports().join("fixed.onnx").to_str().unwrap(), "--data", data.to_str().unwrap()])
            .args(["--microbatches", m, "--steps", "3", "--dtype", "f64", "--threads", "1", "--json"])
            .output()
            .unwrap();
        assert!(r.status.success(), "train --microbatches {m}: {}", String::from_utf8_lossy(&r.stderr));
        let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
        v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect::<Vec<f64>>()
    };
    let (whole, split) = (run("1"), run("4"));
    let worst = whole.iter().zip(&split).map(|(a, b)| ((a - b) / a).abs()).fold(0.0, f64::max);
    assert!(worst <= 1e-9, "microbatches 4 {split:?} vs 1 {whole:?} ({worst:.2e})");
}

#[test]
fn a_batch_reshaped_into_a_later_dim_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let flat = exports().join("flat.onnx");
    let out = dir.path().join("flat.json");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args([flat.to_str().unwrap(), "--cluster", &common::cluster_arg("cpu:1"), "-o", out.to_str().unwrap()])
        .args(["--global-batch", "8", "--microbatches", "8"])
        .output()
        .unwrap();
    assert!(!r.status.success());
    let e = String::from_utf8_lossy(&r.stderr);
    assert!(e.contains("fixed at 8") && e.contains("exactly 8 samples") && e.contains("torch.export.Dim(\"batch\")"), "{e}");
    // the runner names the node where the proof fails
    let data = exports().join("data.npz");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["train", flat.to_str().unwrap(), "--data", data.to_str().unwrap(), "--microbatches", "2", "--steps", "1"])
        .output()
        .unwrap();
    assert!(!r.status.success());
    let e = String::from_utf8_lossy(&r.stderr);
    assert!(e.contains("fixed at 8") && e.contains("Reshape") && e.contains("torch.export.Dim(\"batch\")"), "{e}");
}
