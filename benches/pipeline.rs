//! Pipeline throughput on CPU: GPT-2 (models/gpt2.onnx) as a 2-stage 1F1B pipeline on 2 ranks
//! × 1 thread with m = 8 microbatches, against the same model trained by 1 rank × 1 thread
//! (same global batch and microbatches). Prints both samples/s and the ratio (goal ≥ 1.6×).
//!
//!     cargo bench --features runner --bench pipeline [-- STEPS BATCH SEQ]

use std::process::Command;

fn samples_per_s(out: &std::process::Output, what: &str) -> f64 {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("runner JSON");
    v["samples_per_s"].as_f64().expect("samples_per_s")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (steps, batch, seq) = (arg(0, 6), arg(1, 32), arg(2, 64));
    let repo = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let model = repo.join("models/gpt2.onnx");
    let dir = tempfile::tempdir().expect("tempdir");
    let plan = dir.path().join("pp2.json");
    let (b, s, n) = (batch.to_string(), seq.to_string(), steps.to_string());
    let planned = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .arg(&model)
        .args(["--cluster", "cpu:2", "--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "8"])
        .args(["--global-batch", &b, "--seq-len", &s, "-o"])
        .arg(&plan)
        .output()
        .expect("run smp-partition");
    assert!(planned.status.success(), "planning failed: {}", String::from_utf8_lossy(&planned.stderr));
    let runner = env!("CARGO_BIN_EXE_smp-runner");
    let one = Command::new(runner)
        .arg("train")
        .arg(&model)
        .args(["--batch", &b, "--seq-len", &s, "--microbatches", "8", "--steps", &n, "--threads", "1", "--json"])
        .output()
        .expect("run smp-runner train");
    let one = samples_per_s(&one, "1 rank");
    let two = Command::new(runner)
        .args(["launch", "--nproc", "2"])
        .arg(&plan)
        .args(["--steps", &n, "--threads", "1", "--json"])
        .output()
        .expect("run smp-runner launch");
    let two = samples_per_s(&two, "2-rank pipeline");
    println!("gpt2 batch {batch} seq {seq}, m = 8, 1 thread per rank");
    println!("1 rank                : {one:8.2} samples/s");
    println!("2-stage pipeline (1F1B): {two:8.2} samples/s");
    println!("ratio                 : {:.2}x (goal >= 1.6x)", two / one);
}
