//! ONNX normalised once (`frontend/onnx/canonical.rs`): the forms opsets before 13 and 18 write
//! mean what they meant, and no later stage sees them.
//!
//! - Single-node models in the old forms (attributes that later became inputs; Softmax and
//!   LogSoftmax before 13, which coerce their input to 2-D at `axis`), built and run by
//!   onnxruntime in tests/opset_exports.py: `smp-runner eval` gives onnxruntime's outputs.
//! - One small transformer LM exported by torch's TorchScript exporter at opsets 11, 13 and 18:
//!   each plans to the same configuration and stages, and trains the same f64 losses under
//!   pp 2.
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use smp_partition::frontend::onnx::load_model;
use smp_partition::runtime::formats::npz::read_npz;

/// The exports' directory, generated once per content of the script.
fn exports() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::exports::exported("opset_exports.py", "cases.txt"))
}

#[test]
fn old_opset_forms_evaluate_as_onnxruntime() {
    let dir = tempfile::tempdir().unwrap();
    let cases = std::fs::read_to_string(exports().join("cases.txt")).unwrap();
    let mut checked = 0;
    for name in cases.lines().filter(|l| !l.is_empty()) {
        let model = exports().join(format!("case_{name}.onnx"));
        let imported = load_model(&model).unwrap_or_else(|e| panic!("{name}: {e}"));
        let c = imported.canonicalised;
        // every case but the plain last-axis softmax is in a form the canonicalisation rewrites
        if name != "softmax_last_op11" {
            assert!(c.attrs_to_inputs + c.softmax_rewrites > 0, "{name}: nothing canonicalised ({c:?})");
        }
        let out = dir.path().join(format!("{name}.npz"));
        let r = common::runner::runner()
            .args(["eval", model.to_str().unwrap(), "--inputs"])
            .arg(exports().join(format!("case_{name}.in.npz")))
            .arg("--outputs")
            .arg(&out)
            .output()
            .unwrap();
        common::runner::ok(&format!("eval of {name}"), r);
        let want = read_npz(&exports().join(format!("case_{name}.out.npz"))).unwrap();
        let got = read_npz(&out).unwrap();
        assert_eq!(got.len(), want.len(), "{name}: outputs");
        for (k, w) in &want {
            let g = &got.iter().find(|(n, _)| n == k).unwrap_or_else(|| panic!("{name}: no output `{k}`")).1;
            assert_eq!(g.size(), w.size(), "{name}: `{k}` shape");
            let diff = (g.to_kind(tch::Kind::Double) - w.to_kind(tch::Kind::Double)).abs().max().double_value(&[]);
            assert!(diff <= 1e-6, "{name}: `{k}` differs from onnxruntime by {diff}");
        }
        checked += 1;
    }
    assert_eq!(checked, 14, "cases run");
}

fn plan(model: &Path, out: &Path) -> serde_json::Value {
    let cluster = common::cluster_arg("cpu:2");
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args([model.to_str().unwrap(), "--cluster", &cluster, "-o", out.to_str().unwrap()])
        .args(["--seq-len", "16", "--global-batch", "8", "--microbatches", "2", "--pp", "2", "--tp", "1", "--dp", "1"])
        .output()
        .unwrap();
    common::runner::ok(&format!("planning {}", model.display()), r);
    serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap()
}

fn losses(plan: &Path) -> Vec<f64> {
    let r = common::runner::runner()
        .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--data"])
        .arg(exports().join("data.npz"))
        .args(["--steps", "5", "--dtype", "f64", "--threads", "1", "--json", "--timeout", "120"])
        .output()
        .unwrap();
    let r = common::runner::ok(&format!("launch of {}", plan.display()), r);
    common::runner::field(&common::runner::json(&r), "steps", "loss")
}

#[test]
fn the_same_model_at_opsets_11_13_and_18_plans_and_trains_identically() {
    let dir = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for opset in [11, 13, 18] {
        let model = exports().join(format!("lm{opset}.onnx"));
        let imported = load_model(&model).unwrap();
        if opset < 18 {
            assert!(imported.canonicalised.attrs_to_inputs > 0, "opset {opset}: its reductions' axes are attributes: {:?}", imported.canonicalised);
        }
        let path = dir.path().join(format!("plan{opset}.json"));
        let p = plan(&model, &path);
        runs.push((opset, p, losses(&path)));
    }
    let (_, p18, l18) = &runs[2];
    for (opset, p, l) in &runs[..2] {
        assert_eq!(p["parallel"], p18["parallel"], "opset {opset}: parallel configuration");
        let layers = |p: &serde_json::Value| p["stages"].as_array().unwrap().iter().map(|s| s["layers"].clone()).collect::<Vec<_>>();
        assert_eq!(layers(p), layers(p18), "opset {opset}: stages");
        assert_eq!(l.len(), 5, "opset {opset}: steps");
        for (a, b) in l.iter().zip(l18) {
            assert!((a - b).abs() <= 1e-12 * b.abs(), "opset {opset}: losses {l:?} against opset 18's {l18:?}");
        }
    }
}
