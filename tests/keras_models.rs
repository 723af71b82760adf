//! TensorFlow models end to end: a Keras transformer LM and a Keras CNN converted by tf2onnx
//! (`make keras-models`, `scripts/keras_models.py`) are analysed without module metadata, cut
//! into balanced layers, planned over 2 and 4 stages, evaluate as Keras does, and train under a
//! 2-stage pipeline exactly as in one process.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::exports::{python, repo};
use common::machine::{CPU2, CPU4};
use smp_partition::compile;
use smp_partition::cost::ClusterSpec;
use smp_partition::load_and_analyze;
use smp_partition::passes::AnalyzeOptions;
use smp_partition::solve::PlanOptions;

/// A converted model: its file, the sequence length to bind, and the loss and data it trains on.
struct Keras {
    name: &'static str,
    seq_len: Option<i64>,
    loss: &'static str,
}

const MODELS: [Keras; 2] = [
    Keras { name: "keras_lm", seq_len: Some(16), loss: "causal-lm" },
    Keras { name: "keras_cnn", seq_len: None, loss: "cross-entropy" },
];

fn path(k: &Keras, ext: &str) -> PathBuf {
    repo().join(format!("models/keras/{}.{ext}", k.name))
}

#[test]
fn keras_models_have_balanced_layers_and_pipeline() {
    for k in &MODELS {
        let opts = AnalyzeOptions { seq_len: k.seq_len, ..Default::default() };
        let model = load_and_analyze(&path(k, "onnx"), &opts).unwrap_or_else(|e| panic!("{}: {e}", k.name));
        let flops: Vec<f64> = model.lg.layers.iter().map(|l| l.figures.flops).collect();
        let mean = flops.iter().sum::<f64>() / flops.len() as f64;
        assert!(flops.len() >= 4, "{}: {} layers", k.name, flops.len());
        assert!(flops.iter().all(|&f| f <= 2.0 * mean), "{}: layer FLOPs {flops:?} exceed twice the mean {mean}", k.name);
        for (cluster, pp) in [(CPU2, 2), (CPU4, 4)] {
            let cluster = ClusterSpec::parse(cluster).unwrap();
            let plan = compile(&model, &cluster, &PlanOptions { pp: Some(pp), ..Default::default() })
                .unwrap_or_else(|e| panic!("{} --pp {pp}: {e}", k.name));
            assert_eq!(plan.parallel.pp, pp, "{} --pp {pp}", k.name);
            let run: usize = plan.stages.iter().map(|s| s.layers[1] + 1 - s.layers[0]).sum();
            assert_eq!(run, flops.len(), "{} --pp {pp}: every layer runs once", k.name);
        }
    }
}

/// `smp-runner eval` of each model on the inputs of its `.io.npz` equals Keras' own outputs.
#[test]
fn keras_models_evaluate_as_keras_does() {
    let dir = tempfile::tempdir().unwrap();
    for k in &MODELS {
        let (inputs, outputs) = (dir.path().join(format!("{}.in.npz", k.name)), dir.path().join(format!("{}.out.npz", k.name)));
        let split = "import sys, numpy as np\nd = np.load(sys.argv[1])\nnp.savez(sys.argv[2], **{k: v for k, v in d.items() if k != 'logits'})";
        let r = Command::new(python()).args(["-c", split, path(k, "io.npz").to_str().unwrap(), inputs.to_str().unwrap()]).output().unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .args(["eval", path(k, "onnx").to_str().unwrap(), "--inputs", inputs.to_str().unwrap(), "--outputs", outputs.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(r.status.success(), "eval {}: {}", k.name, String::from_utf8_lossy(&r.stderr));
        let compare = "import sys, numpy as np\nout = list(np.load(sys.argv[1]).values())[0]\nref = np.load(sys.argv[2])['logits']\n\
                       assert out.shape == ref.shape, (out.shape, ref.shape)\nprint(float(np.abs(out - ref).max() / np.abs(ref).max()))";
        let r = Command::new(python()).args(["-c", compare, outputs.to_str().unwrap(), path(k, "io.npz").to_str().unwrap()]).output().unwrap();
        assert!(r.status.success(), "{}: {}", k.name, String::from_utf8_lossy(&r.stderr));
        let rel: f64 = String::from_utf8_lossy(&r.stdout).trim().parse().unwrap();
        assert!(rel <= 1e-4, "{}: eval differs from Keras by {rel:.2e} (relative to the largest logit)", k.name);
    }
}

fn losses(stdout: &[u8]) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_slice(stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(stdout)));
    v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

/// Data for `k`: seeded images and labels for the CNN; none (synthetic token ids) for the LM.
fn data_args(k: &Keras, dir: &Path) -> Vec<String> {
    if k.loss != "cross-entropy" {
        return Vec::new();
    }
    let data = dir.join("images.npz");
    let code = "import sys, numpy as np\nr = np.random.default_rng(3)\n\
                np.savez(sys.argv[1], pixels=r.standard_normal((8, 32, 32, 3)).astype(np.float32), labels=r.integers(0, 10, 8))";
    let r = Command::new(python()).args(["-c", code, data.to_str().unwrap()]).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    vec!["--data".into(), data.to_str().unwrap().into()]
}

#[test]
fn keras_models_train_under_a_pipeline_as_in_one_process() {
    let dir = tempfile::tempdir().unwrap();
    for k in &MODELS {
        let model = path(k, "onnx");
        let data = data_args(k, dir.path());
        let seq: Vec<String> = k.seq_len.map(|s| vec!["--seq-len".into(), s.to_string()]).unwrap_or_default();
        let plan = dir.path().join(format!("{}_pp2.json", k.name));
        let cluster = common::machine::cluster_arg("cpu:2");
        let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
            .args([model.to_str().unwrap(), "--cluster", &cluster, "--pp", "2", "--global-batch", "8", "--microbatches", "2", "-o", plan.to_str().unwrap()])
            .args(&seq)
            .output()
            .unwrap();
        assert!(r.status.success(), "planning {}: {}", k.name, String::from_utf8_lossy(&r.stderr));
        let common_args = ["--loss", k.loss, "--steps", "5", "--dtype", "f64", "--threads", "1", "--json"];
        let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .args(["train", model.to_str().unwrap(), "--batch", "8", "--microbatches", "2"])
            .args(&seq)
            .args(&data)
            .args(common_args)
            .output()
            .unwrap();
        assert!(r.status.success(), "train {}: {}", k.name, String::from_utf8_lossy(&r.stderr));
        let want = losses(&r.stdout);
        let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--timeout", "120"])
            .args(&data)
            .args(common_args)
            .output()
            .unwrap();
        assert!(r.status.success(), "launch {}: {}", k.name, String::from_utf8_lossy(&r.stderr));
        let got = losses(&r.stdout);
        assert_eq!(got.len(), want.len());
        assert!(want[4] < want[0], "{}: the loss does not fall: {want:?}", k.name);
        let worst = got.iter().zip(&want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max);
        assert!(worst <= 1e-9, "{} pp2: {got:?} vs one process {want:?} (max rel {worst:.2e})", k.name);
    }
}
