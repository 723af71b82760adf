//! The runner on the real exports in `models/`: `eval` equals onnxruntime's outputs
//! (`models/<name>.io.npz`, norm-relative ≤ 1e-4 in f32); bad inputs and external data fail
//! cleanly with exit 1; GPT-2 trains (loss falls ≥ 90 % in 50 steps on one batch) and its
//! first 5 losses equal a PyTorch training of the same HF model (`tests/torch_reference.py`).
#![cfg(feature = "runner")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use smp_partition::frontend::onnx::load_model;
use smp_partition::runtime::formats::npz;
use tch::{Kind, Tensor};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> PathBuf {
    std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv/bin/python"))
}

fn runner(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smp-runner")).args(args).output().expect("run smp-runner")
}

fn norm_rel(got: &Tensor, want: &Tensor) -> f64 {
    let g = got.to_kind(Kind::Double);
    let w = want.to_kind(Kind::Double);
    (&g - &w).norm().double_value(&[]) / w.norm().double_value(&[]).max(1e-30)
}

/// Models with a reference pair: `models/<name>.onnx` + `models/<name>.io.npz`.
fn reference_models() -> Vec<(String, PathBuf, PathBuf)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(repo().join("models")).expect("models/").flatten() {
        let p = e.path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if let Some(stem) = name.strip_suffix(".io.npz") {
            let onnx = repo().join("models").join(format!("{stem}.onnx"));
            if onnx.exists() {
                out.push((stem.to_string(), onnx, p));
            }
        }
    }
    out.sort();
    out
}

/// Splits a reference npz into an inputs-only file; returns the expected outputs.
fn split_io(model: &Path, io: &Path, inputs_out: &Path) -> Vec<(String, Tensor)> {
    let graph = load_model(model).expect("load model").graph;
    let inputs: Vec<String> = graph.inputs.iter().map(|&v| graph.value(v).name.clone()).collect();
    let arrays = npz::read_npz(io).expect("read io npz");
    let (ins, outs): (Vec<_>, Vec<_>) = arrays.into_iter().partition(|(n, _)| inputs.contains(n));
    let ins: Vec<_> = ins.into_iter().map(|(n, t)| (n, t, None)).collect();
    npz::write_npz(inputs_out, &ins).expect("write inputs");
    outs
}

#[test]
fn eval_matches_onnxruntime_on_every_export() {
    let models = reference_models();
    assert!(!models.is_empty(), "no models/<name>.io.npz reference pairs");
    let dir = tempfile::tempdir().unwrap();
    let mut report = Vec::new();
    for (name, onnx, io) in models {
        let ins = dir.path().join(format!("{name}.in.npz"));
        let outs = dir.path().join(format!("{name}.out.npz"));
        let want = split_io(&onnx, &io, &ins);
        let r = runner(&["eval", onnx.to_str().unwrap(), "--inputs", ins.to_str().unwrap(), "--outputs", outs.to_str().unwrap()]);
        assert!(r.status.success(), "{name}: eval failed: {}", String::from_utf8_lossy(&r.stderr));
        let got = npz::read_npz(&outs).unwrap();
        for (out_name, w) in &want {
            let g = &got.iter().find(|(n, _)| n == out_name).unwrap_or_else(|| panic!("{name}: no output `{out_name}`")).1;
            assert_eq!(g.size(), w.size(), "{name}/{out_name} shape");
            let rel = norm_rel(g, w);
            report.push(format!("{name}/{out_name}: norm-relative {rel:.2e}"));
            assert!(rel <= 1e-4, "{name}/{out_name}: norm-relative {rel:.3e} > 1e-4");
        }
    }
    eprintln!("{}", report.join("\n"));
}

fn gpt2() -> PathBuf {
    repo().join("models/gpt2.onnx")
}

fn assert_user_error(r: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "want exit 1, stderr: {err}");
    assert!(err.contains(needle), "stderr should mention `{needle}`: {err}");
}

#[test]
fn bad_eval_inputs_are_user_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = gpt2();
    let m = model.to_str().unwrap();
    let out = dir.path().join("out.npz");
    let o = out.to_str().unwrap();
    let cases: [(&str, Tensor, &str); 3] = [
        ("tokens", Tensor::zeros([1, 8], (Kind::Int64, tch::Device::Cpu)), "tokens"),
        ("input_ids", Tensor::zeros([8], (Kind::Int64, tch::Device::Cpu)), "input_ids"),
        ("input_ids", Tensor::zeros([1, 8], (Kind::Float, tch::Device::Cpu)), "element type"),
    ];
    for (i, (name, t, needle)) in cases.into_iter().enumerate() {
        let p = dir.path().join(format!("in{i}.npz"));
        npz::write_npz(&p, &[(name.to_string(), t, None)]).unwrap();
        let r = runner(&["eval", m, "--inputs", p.to_str().unwrap(), "--outputs", o]);
        assert_user_error(&r, needle);
    }
}

/// A MatMul model whose weight lives in `w.bin`, written by onnx's own helpers.
fn external_model(dir: &Path) -> PathBuf {
    let script = r#"
import sys, numpy as np, onnx
from onnx import helper, TensorProto, numpy_helper
d = sys.argv[1]
w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
onnx.save_model(m, d + "/ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
                location="w.bin", size_threshold=0)
"#;
    let st = Command::new(python()).args(["-c", script, dir.to_str().unwrap()]).status().expect("python");
    assert!(st.success());
    dir.join("ext.onnx")
}

#[test]
fn external_data_is_checked_against_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let model = external_model(dir.path());
    let m = model.to_str().unwrap();
    let ins = dir.path().join("in.npz");
    let x = Tensor::from_slice(&[1f32, 0., 0., 0., 1., 0.]).reshape([2, 3]);
    npz::write_npz(&ins, &[("x".into(), x, None)]).unwrap();
    let i = ins.to_str().unwrap();
    let out = dir.path().join("out.npz");
    let o = out.to_str().unwrap();

    let r = runner(&["eval", m, "--inputs", i, "--outputs", o]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let y = &npz::read_npz(&out).unwrap()[0].1;
    let want = Tensor::from_slice(&[0f32, 1., 2., 3., 4., 5., 6., 7.]).reshape([2, 4]);
    assert!(y.allclose(&want, 0.0, 0.0, false), "x·w wrong: {y}");

    let bin = dir.path().join("w.bin");
    let bytes = std::fs::read(&bin).unwrap();
    std::fs::write(&bin, &bytes[..20]).unwrap();
    assert_user_error(&runner(&["eval", m, "--inputs", i, "--outputs", o]), "truncated");

    std::fs::remove_file(&bin).unwrap();
    assert_user_error(&runner(&["eval", m, "--inputs", i, "--outputs", o]), "--init random");
    let r = runner(&["eval", m, "--inputs", i, "--outputs", o, "--init", "random"]);
    assert!(r.status.success(), "--init random should run a graph-only model: {}", String::from_utf8_lossy(&r.stderr));
}

fn fixed_batch(dir: &Path) -> PathBuf {
    tch::manual_seed(1234);
    let ids = Tensor::randint(256, [2, 16], (Kind::Int64, tch::Device::Cpu));
    let p = dir.join("batch.npz");
    npz::write_npz(&p, &[("input_ids".into(), ids, None)]).unwrap();
    p
}

fn losses(json: &[u8]) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_slice(json).expect("one JSON object on stdout");
    v["steps"].as_array().expect("steps").iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

const LR: &str = "5e-3";

#[test]
fn gpt2_trains_and_matches_pytorch() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixed_batch(dir.path());
    let d = data.to_str().unwrap();
    let model = gpt2();
    let m = model.to_str().unwrap();
    // lr 5e-3 (not the 1e-3 default) so 50 steps memorise the batch; PyTorch gets the same
    let r = runner(&["train", m, "--steps", "50", "--data", d, "--loss", "causal-lm", "--lr", LR, "--threads", "1", "--json"]);
    assert!(r.status.success(), "train failed: {}", String::from_utf8_lossy(&r.stderr));
    let ours = losses(&r.stdout);
    assert_eq!(ours.len(), 50);
    let (first, last) = (ours[0], ours[49]);
    eprintln!("runner losses: first {first:.5}, last {last:.5}");
    assert!(last <= 0.1 * first, "loss fell only from {first} to {last} (want ≥ 90 %)");

    let r = Command::new(python())
        .arg(repo().join("tests/torch_reference.py"))
        .args([m, "--data", d, "--steps", "5", "--lr", LR, "--threads", "1"])
        .output()
        .expect("run tests/torch_reference.py");
    assert!(r.status.success(), "torch reference failed: {}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    let theirs: Vec<f64> = v["losses"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let a = Tensor::from_slice(&ours[..5]);
    let b = Tensor::from_slice(&theirs);
    let rel = norm_rel(&a, &b);
    eprintln!("runner {:?}\ntorch  {:?}\nnorm-relative {rel:.2e}", &ours[..5], theirs);
    assert!(rel <= 1e-5, "first 5 losses differ from PyTorch by {rel:.3e} (norm-relative)");
}

/// Training in f64 and bf16 follows the f32 run: f64 agrees to f32 rounding, bf16 to its 8-bit
/// mantissa (first 5 losses, same weights and data).
#[test]
fn gpt2_trains_in_f64_and_bf16_like_f32() {
    let dir = tempfile::tempdir().unwrap();
    let data = fixed_batch(dir.path());
    let (d, model) = (data.to_str().unwrap(), gpt2());
    let run = |dtype: &str| {
        let r = runner(&["train", model.to_str().unwrap(), "--steps", "5", "--data", d, "--loss", "causal-lm", "--dtype", dtype, "--threads", "1", "--json"]);
        assert!(r.status.success(), "train --dtype {dtype} failed: {}", String::from_utf8_lossy(&r.stderr));
        Tensor::from_slice(&losses(&r.stdout))
    };
    let (f32_, f64_, bf16) = (run("f32"), run("f64"), run("bf16"));
    let (rel64, rel16) = (norm_rel(&f32_, &f64_), norm_rel(&bf16, &f64_));
    eprintln!("f32 vs f64 {rel64:.2e}, bf16 vs f64 {rel16:.2e}");
    assert!(rel64 <= 1e-5, "f32 losses differ from f64 by {rel64:.3e}");
    assert!(rel16 <= 2e-2, "bf16 losses differ from f64 by {rel16:.3e}");
    assert!(rel16 > 0.0, "bf16 losses equal f64 exactly: --dtype bf16 did not take effect");
}

/// The same batch as `.npz`, `.npy` and `.safetensors` trains to the same losses; other
/// extensions are user errors naming the accepted ones.
#[test]
fn data_files_in_every_format_give_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let npz = fixed_batch(dir.path());
    let ids = npz::read_npz(&npz).unwrap().remove(0).1;
    let npy = dir.path().join("batch.npy");
    ids.write_npy(&npy).unwrap();
    let st = dir.path().join("batch.safetensors");
    Tensor::write_safetensors(&[("input_ids", &ids)], &st).unwrap();
    let model = gpt2();
    let run = |data: &Path| {
        let r = runner(&["train", model.to_str().unwrap(), "--steps", "3", "--data", data.to_str().unwrap(), "--loss", "causal-lm", "--threads", "1", "--json"]);
        assert!(r.status.success(), "train with {} failed: {}", data.display(), String::from_utf8_lossy(&r.stderr));
        losses(&r.stdout)
    };
    let want = run(&npz);
    assert_eq!(run(&npy), want, ".npy batch trains differently");
    assert_eq!(run(&st), want, ".safetensors batch trains differently");
    let bad = dir.path().join("batch.csv");
    std::fs::write(&bad, "1,2,3").unwrap();
    let r = runner(&["train", model.to_str().unwrap(), "--steps", "1", "--data", bad.to_str().unwrap()]);
    assert_user_error(&r, ".npy, .npz or .safetensors");
}
