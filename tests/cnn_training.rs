//! CNN training: torchvision's ResNet-18 with BatchNormalization in train() mode. Batch
//! statistics per microbatch, running statistics updated by PyTorch's momentum rule and never
//! trained, ResNet stages pipelined, replica 0's buffers broadcast under data parallelism.
//! Oracle: PyTorch's own training of the module (`tests/cnn_exports.py`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::exports::python;

fn exports() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::exports::exported("cnn_exports.py", "torch_state.npz"))
}

fn losses(stdout: &[u8]) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_slice(stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(stdout)));
    v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

fn max_rel(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "step count");
    got.iter().zip(want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max)
}

const RUN: [&str; 9] = ["--loss", "cross-entropy", "--steps", "3", "--dtype", "f64", "--threads", "1", "--json"];

/// One process, 4 microbatches, as PyTorch ran them; writes the trained weights and buffers.
fn single_process(dir: &Path) -> (Vec<f64>, PathBuf) {
    let (model, data) = (exports().join("resnet18.onnx"), exports().join("data.npz"));
    let saved = dir.join("trained.npz");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["train", model.to_str().unwrap(), "--batch", "8", "--microbatches", "4", "--data", data.to_str().unwrap()])
        .args(["--save-weights", saved.to_str().unwrap()])
        .args(RUN)
        .output()
        .unwrap();
    assert!(r.status.success(), "train: {}", String::from_utf8_lossy(&r.stderr));
    (losses(&r.stdout), saved)
}

#[test]
fn resnet18_trains_as_pytorch_in_train_mode() {
    let dir = tempfile::tempdir().unwrap();
    let (got, saved) = single_process(dir.path());
    let want: Vec<f64> = {
        let code = "import sys, numpy as np\nprint(' '.join(repr(float(x)) for x in np.load(sys.argv[1])))";
        let r = Command::new(python()).args(["-c", code, exports().join("torch_losses.npy").to_str().unwrap()]).output().unwrap();
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        String::from_utf8_lossy(&r.stdout).split_whitespace().map(|x| x.parse().unwrap()).collect()
    };
    let worst = max_rel(&got, &want);
    assert!(worst <= 1e-9, "losses {got:?} vs PyTorch {want:?} (max rel {worst:.2e})");
    // Weights and running statistics after 3 steps equal PyTorch's state_dict.
    let code = "import sys, numpy as np\nsaved, want = np.load(sys.argv[1]), np.load(sys.argv[2])\n\
                got = {k: saved[k] for k in saved.files}\n\
                keys = [k for k in want.files if 'running' in k]\nassert len(keys) == 40, keys\n\
                assert all(k in saved.files for k in keys), saved.files\n\
                missing = [k for k in want.files if k not in got]\nassert not missing, missing\n\
                print(max(float(np.abs(got[k] - want[k]).max() / max(np.abs(want[k]).max(), 1e-12)) for k in want.files))";
    let r = Command::new(python())
        .args(["-c", code, saved.to_str().unwrap(), exports().join("torch_state.npz").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let rel: f64 = String::from_utf8_lossy(&r.stdout).trim().parse().unwrap();
    // f64 Adam steps: rounding alone; reading the attributes as f32 values gave 2.3e-7
    assert!(rel <= 1e-10, "trained state differs from PyTorch's by {rel:.2e}");
}

#[test]
fn resnet18_pipelines_and_replicates_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let (want, _) = single_process(dir.path());
    let (model, data) = (exports().join("resnet18.onnx"), exports().join("data.npz"));
    let cluster = common::machine::cluster_arg("cpu:2");
    for (name, flags) in [
        ("pp2", &["--pp", "2", "--tp", "1", "--dp", "1", "--microbatches", "4"][..]),
        ("dp2", &["--pp", "1", "--tp", "1", "--dp", "2", "--microbatches", "2"][..]),
    ] {
        let plan = dir.path().join(format!("{name}.json"));
        let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
            .args([model.to_str().unwrap(), "--cluster", &cluster, "--global-batch", "8", "-o", plan.to_str().unwrap()])
            .args(flags)
            .output()
            .unwrap();
        assert!(r.status.success(), "planning {name}: {}", String::from_utf8_lossy(&r.stderr));
        // both say that the statistics are those of a microbatch (8 = 4 × 2 and 2 × 2 × 2)
        let said = "BatchNorm statistics are per microbatch: 20 BatchNormalization node(s)";
        let per = "normalise each microbatch of 2 samples";
        let planner = String::from_utf8_lossy(&r.stderr);
        assert!(planner.contains(&format!("warning: {said}")) && planner.contains(per), "planning {name}: {planner}");
        let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--data", data.to_str().unwrap(), "--timeout", "300"])
            .args(RUN)
            .output()
            .unwrap();
        assert!(r.status.success(), "launch {name}: {}", String::from_utf8_lossy(&r.stderr));
        let runner = String::from_utf8_lossy(&r.stderr);
        assert_eq!(runner.matches(&format!("smp-runner: warning: {said}")).count(), 1, "launch {name}: {runner}");
        let got = losses(&r.stdout);
        let worst = max_rel(&got, &want);
        assert!(worst <= 1e-9, "{name}: {got:?} vs one process {want:?} (max rel {worst:.2e})");
    }
}

/// Running statistics survive a checkpoint: saved under pp 2 at step 2 (each written by the rank
/// whose stage trained it), resumed in one process for step 3, the weights and buffers equal the
/// uninterrupted run's.
#[test]
fn resnet18_running_statistics_resume_from_a_pipeline_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (want, uninterrupted) = single_process(dir.path());
    let (model, data) = (exports().join("resnet18.onnx"), exports().join("data.npz"));
    let plan = dir.path().join("pp2.json");
    let cluster = common::machine::cluster_arg("cpu:2");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args([model.to_str().unwrap(), "--cluster", &cluster, "--global-batch", "8", "-o", plan.to_str().unwrap()])
        .args(["--pp", "2", "--tp", "1", "--dp", "1", "--microbatches", "4"])
        .output()
        .unwrap();
    assert!(r.status.success(), "planning: {}", String::from_utf8_lossy(&r.stderr));
    let ckpt = dir.path().join("ckpt");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--data", data.to_str().unwrap(), "--timeout", "300"])
        .args(["--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "2"])
        .args(["--loss", "cross-entropy", "--steps", "2", "--dtype", "f64", "--threads", "1", "--json"])
        .output()
        .unwrap();
    assert!(r.status.success(), "launch: {}", String::from_utf8_lossy(&r.stderr));
    let resumed = dir.path().join("resumed.npz");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["train", model.to_str().unwrap(), "--batch", "8", "--microbatches", "4", "--data", data.to_str().unwrap()])
        .args(["--resume", ckpt.to_str().unwrap(), "--save-weights", resumed.to_str().unwrap()])
        .args(RUN)
        .output()
        .unwrap();
    assert!(r.status.success(), "resume: {}", String::from_utf8_lossy(&r.stderr));
    let got = losses(&r.stdout);
    let last = (got.last().unwrap() - want[2]).abs() / want[2];
    assert!(last <= 1e-9, "resumed step 3 loss {got:?} vs uninterrupted {want:?}");
    let code = "import sys, numpy as np\na, b = np.load(sys.argv[1]), np.load(sys.argv[2])\nassert sorted(a.files) == sorted(b.files)\n\
                assert sum('running' in k for k in a.files) == 40\n\
                print(max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-12)) for k in b.files))";
    let r = Command::new(python()).args(["-c", code, resumed.to_str().unwrap(), uninterrupted.to_str().unwrap()]).output().unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let rel: f64 = String::from_utf8_lossy(&r.stdout).trim().parse().unwrap();
    assert!(rel <= 1e-12, "resumed weights and buffers differ from the uninterrupted run by {rel:.2e}");
}
