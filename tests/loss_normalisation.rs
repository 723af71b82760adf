//! A step's loss is the mean over the whole global batch's counted targets, whatever the
//! microbatch and replica counts: a masked-LM batch whose labelled tokens are spread unevenly
//! trains alike with 1 and 4 microbatches, under a pipeline and under data parallelism, and its
//! first loss equals onnxruntime's forward pass with PyTorch's `ignore_index` mean.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::exports::{python, repo};

const BATCH: &str = "8";
const SEQ: &str = "16";

fn model() -> PathBuf {
    repo().join("models/bert.onnx")
}

fn losses(stdout: &[u8]) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_slice(stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(stdout)));
    v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

/// Token ids and masked-LM labels: rows 0 and 1 label 12 tokens each, the other rows one each,
/// so microbatch means differ from the batch mean. Returns the file and onnxruntime's loss.
fn masked_lm_batch(dir: &Path) -> (PathBuf, f64) {
    let data = dir.join("mlm.npz");
    let code = r#"
import sys, numpy as np, onnxruntime as ort
model, out, B, S = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = np.random.default_rng(11)
ids = r.integers(0, 256, (B, S)).astype(np.int64)
labels = np.full((B, S), -100, dtype=np.int64)
for b in range(B):
    k = 12 if b < 2 else 1
    pos = r.choice(S, k, replace=False)
    labels[b, pos] = r.integers(0, 256, k)
np.savez(out, input_ids=ids, labels=labels)
sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
name = sess.get_inputs()[0].name
logits = sess.run(None, {name: ids})[0].astype(np.float64)
z = logits - logits.max(-1, keepdims=True)
logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
m = labels != -100
print(repr(float(-logp[m, labels[m]].mean())))
"#;
    let r = Command::new(python())
        .args(["-c", code, model().to_str().unwrap(), data.to_str().unwrap(), BATCH, SEQ])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let loss: f64 = String::from_utf8_lossy(&r.stdout).trim().parse().unwrap();
    (data, loss)
}

fn train(data: &Path, microbatches: &str) -> Vec<f64> {
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["train", model().to_str().unwrap(), "--batch", BATCH, "--seq-len", SEQ, "--microbatches", microbatches])
        .args(["--data", data.to_str().unwrap(), "--loss", "cross-entropy"])
        .args(["--steps", "4", "--dtype", "f64", "--threads", "1", "--json"])
        .output()
        .unwrap();
    assert!(r.status.success(), "train m={microbatches}: {}", String::from_utf8_lossy(&r.stderr));
    losses(&r.stdout)
}

fn launch(dir: &Path, data: &Path, name: &str, flags: &[&str]) -> Vec<f64> {
    let plan = dir.join(format!("{name}.json"));
    let cluster = common::machine::cluster_arg("cpu:2");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args([model().to_str().unwrap(), "--cluster", &cluster, "--seq-len", SEQ, "--global-batch", BATCH, "-o", plan.to_str().unwrap()])
        .args(flags)
        .output()
        .unwrap();
    assert!(r.status.success(), "planning {name}: {}", String::from_utf8_lossy(&r.stderr));
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--data", data.to_str().unwrap(), "--loss", "cross-entropy"])
        .args(["--steps", "4", "--dtype", "f64", "--threads", "1", "--json", "--timeout", "120"])
        .output()
        .unwrap();
    assert!(r.status.success(), "launch {name}: {}", String::from_utf8_lossy(&r.stderr));
    losses(&r.stdout)
}

fn max_rel(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "step count");
    got.iter().zip(want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max)
}

#[test]
fn masked_lm_loss_is_the_global_batch_mean_under_any_split() {
    let dir = tempfile::tempdir().unwrap();
    let (data, ort_loss) = masked_lm_batch(dir.path());
    let whole = train(&data, "1");
    let first = (whole[0] - ort_loss).abs() / ort_loss;
    assert!(first < 1e-5, "step 1 loss {} vs onnxruntime's batch mean {ort_loss} (rel {first:.2e})", whole[0]);
    let four = train(&data, "4");
    assert!(max_rel(&four, &whole) < 1e-9, "4 microbatches {four:?} vs 1 {whole:?}");
    for (name, flags) in [
        ("pp2", &["--pp", "2", "--tp", "1", "--dp", "1", "--microbatches", "4"][..]),
        ("dp2", &["--pp", "1", "--tp", "1", "--dp", "2", "--microbatches", "2"][..]),
    ] {
        let got = launch(dir.path(), &data, name, flags);
        let worst = max_rel(&got, &whole);
        assert!(worst < 1e-9, "{name}: {got:?} vs one process, one microbatch {whole:?} (max rel {worst:.2e})");
    }
}
