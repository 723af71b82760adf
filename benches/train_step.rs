//! GPT-2 (models/gpt2.onnx) training step time on the runner against PyTorch eager training
//! of the same HF model (tests/torch_reference.py) with the same data and thread count.
//! Prints both mean step times (first step excluded) and the ratio torch / runner from one run
//! (≥ 1.0 means the runner is at least as fast).
//!
//!     cargo bench --features runner --bench train_step [-- THREADS STEPS BATCH SEQ]

use std::path::PathBuf;
use std::process::Command;

use smp_partition::frontend::onnx::load_model;
use smp_partition::runtime::train::{self, AdamWConfig, LossKind, TrainConfig};
use smp_partition::runtime::{ExecOptions, Executor, InitMode, Weights, npz};
use tch::{Kind, Tensor};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: i64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (threads, steps, batch, seq) = (arg(0, 1), arg(1, 12) as usize, arg(2, 8), arg(3, 64));
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let model = repo.join("models/gpt2.onnx");
    tch::set_num_threads(threads as i32);

    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("batch.npz");
    tch::manual_seed(0);
    let ids = Tensor::randint(256, [batch, seq], (Kind::Int64, tch::Device::Cpu));
    npz::write_npz(&data, &[("input_ids".into(), ids, None)]).expect("write batch");

    let graph = load_model(&model).expect("load models/gpt2.onnx").graph;
    let weights = Weights::load(&graph, InitMode::Load, Some(Kind::Float)).expect("weights");
    let exec = Executor::new(&graph, weights, ExecOptions { float_kind: Some(Kind::Float), training: true }).expect("executor");
    let b = train::read_batch(&exec, &data).expect("batch");
    let cfg = TrainConfig { steps, microbatches: 1, loss: LossKind::CausalLm, adamw: AdamWConfig::default(), clip: Some(1.0), ..TrainConfig::default() };
    let recs = train::train(&exec, &b, &cfg).expect("train");
    let ours: f64 = recs.iter().skip(1).map(|r| r.time_s).sum::<f64>() / (steps - 1).max(1) as f64;

    let py = std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo.join(".venv/bin/python"));
    let out = Command::new(py)
        .arg(repo.join("tests/torch_reference.py"))
        .arg(&model)
        .args(["--data", data.to_str().unwrap(), "--steps", &steps.to_string(), "--threads", &threads.to_string(), "--bench"])
        .output()
        .expect("run tests/torch_reference.py");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let times: Vec<f64> = v["step_times_s"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let torch: f64 = times.iter().skip(1).sum::<f64>() / (times.len() - 1).max(1) as f64;
    println!("gpt2 train step, batch {batch} × seq {seq}, {threads} thread(s), {steps} steps (first excluded)");
    println!("runner  {:.2} ms/step", ours * 1e3);
    println!("pytorch {:.2} ms/step", torch * 1e3);
    println!("ratio (pytorch / runner) {:.3}", torch / ours);
}
