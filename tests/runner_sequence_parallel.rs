//! Sequence-parallel plans executed by real processes through `smp-runner launch`: 20
//! training steps of the GPT-2 export give the single-process run's losses (same seed and
//! data) — f64 within 1e-9 relative, f32 within 1e-4 — with the reduce-scatters, scatters and
//! all-gathers of sequence parallelism in every block (checked in the plan).
#![cfg(feature = "runner")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const STEPS: &str = "20";
const BATCH: &str = "8";
const SEQ: &str = "16";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn model() -> PathBuf {
    repo().join("models/gpt2.onnx")
}

fn plan(dir: &Path, name: &str, cluster: &str, flags: &[&str]) -> PathBuf {
    let out = dir.join(format!("{name}.json"));
    let m = model();
    let mut args = vec![m.to_str().unwrap(), "--cluster", cluster, "--seq-len", SEQ, "-o", out.to_str().unwrap()];
    args.extend_from_slice(flags);
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(&args).output().unwrap();
    assert!(r.status.success(), "planning {name} failed: {}", String::from_utf8_lossy(&r.stderr));
    out
}

fn losses(stdout: &[u8]) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_slice(stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(stdout)));
    v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

fn reference(dtype: &str) -> &'static Vec<f64> {
    static F64: OnceLock<Vec<f64>> = OnceLock::new();
    static F32: OnceLock<Vec<f64>> = OnceLock::new();
    let cell = if dtype == "f64" { &F64 } else { &F32 };
    cell.get_or_init(|| {
        let m = model();
        let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .args(["train", m.to_str().unwrap(), "--batch", BATCH, "--seq-len", SEQ, "--microbatches", "4"])
            .args(["--steps", STEPS, "--dtype", dtype, "--threads", "1", "--json"])
            .output()
            .unwrap();
        assert!(r.status.success(), "reference run failed: {}", String::from_utf8_lossy(&r.stderr));
        losses(&r.stdout)
    })
}

fn launch(nproc: usize, plan: &Path, dtype: &str) -> Vec<f64> {
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", &nproc.to_string(), plan.to_str().unwrap()])
        .args(["--steps", STEPS, "--dtype", dtype, "--threads", "1", "--json", "--timeout", "120"])
        .output()
        .unwrap();
    assert!(r.status.success(), "launch of {} failed: {}", plan.display(), String::from_utf8_lossy(&r.stderr));
    losses(&r.stdout)
}

/// Counts of each collective kind in the plan's shards.
fn collective_kinds(plan: &Path) -> std::collections::BTreeMap<String, usize> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(plan).unwrap()).unwrap();
    let mut out = std::collections::BTreeMap::new();
    for layer in v["codegen"]["shards"].as_array().unwrap() {
        for shard in layer.as_array().unwrap() {
            for c in shard["collectives"].as_array().unwrap() {
                *out.entry(c["kind"]["kind"].as_str().unwrap().to_string()).or_default() += 1;
            }
        }
    }
    out
}

/// Plans `flags` with `--sequence-parallel` on `cluster`, checks the plan holds sequence
/// parallelism's collectives, runs it in f64 and f32 and compares with the single process.
fn equivalent(name: &str, cluster: &str, nproc: usize, flags: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let mut flags = flags.to_vec();
    // Megatron's split: the planner alone replicates every matmul of this tiny model
    flags.extend_from_slice(&["--global-batch", BATCH, "--sequence-parallel", "--baseline", "megatron"]);
    let p = plan(dir.path(), name, cluster, &flags);
    let kinds = collective_kinds(&p);
    for k in ["reduce_scatter", "scatter", "all_gather"] {
        assert!(kinds.get(k).copied().unwrap_or(0) > 0, "{name}: the plan has no {k}: {kinds:?}");
    }
    for (dtype, tol) in [("f64", 1e-9), ("f32", 1e-4)] {
        let want = reference(dtype);
        let got = launch(nproc, &p, dtype);
        assert_eq!(got.len(), want.len(), "{name} {dtype}: step count");
        let worst = got.iter().zip(want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max);
        eprintln!("{name} {dtype}: max relative loss difference {worst:.3e} over {} steps", got.len());
        assert!(worst <= tol, "{name} {dtype}: losses {got:?} vs single-process {want:?} (max rel {worst:.3e} > {tol})");
    }
}

#[test]
fn tp2_sequence_parallel_matches_single_process() {
    equivalent("tp2sp", "cpu:2", 2, &["--pp", "1", "--tp", "2", "--dp", "1", "--microbatches", "4"]);
}

#[test]
fn pp2_tp2_sequence_parallel_matches_single_process() {
    equivalent("pp2tp2sp", "cpu:4", 4, &["--pp", "2", "--tp", "2", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4"]);
}
