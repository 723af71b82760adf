//! The runner trains what PyTorch trains: small Hugging Face models at HF's default init
//! (no perturbation: the exporter merges equal-valued parameters and folds masks and
//! positions), exported at test time in a fixed-shape and a dynamic-shape variant with the
//! parameter record (`smp_partition.param_record`), trained 5 steps by PyTorch
//! (tests/train_oracle.py: AdamW lr 1e-3, weight decay 0.01 on every parameter, clip 1.0) and
//! by `smp-runner train`. Losses must agree within 1e-5 relative and every trained parameter
//! within 1e-5 norm-relative; the runner must train exactly the module's parameters.
//! Elements whose gradient is zero in exact arithmetic (attention key biases: softmax ignores a
//! shift shared by a row) are flagged by the PyTorch run and only bounded: Adam scales their
//! rounding noise to ±lr a step.
//!
//! Where PyTorch's own float32 training is itself farther than 1e-5 from its float64 training
//! of the same steps (an element whose gradient cancels below float32's resolution, which Adam
//! turns into a visible step: GPT-NeoX), a tensor also passes if the runner is at most as far
//! from the float64 training as PyTorch's float32 one is (times [`CONDITION_MARGIN`]): it
//! trains as accurately as PyTorch does. Each use of this is printed.
//!
//! The exports are cached under the target dir, keyed by the two Python files' contents.
#![cfg(feature = "runner")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use sha2::{Digest, Sha256};
use smp_partition::runtime::formats::npz;
use tch::{Kind, Tensor};

const LOSS_TOL: f64 = 1e-5;
const WEIGHT_TOL: f64 = 1e-5;
/// 5 AdamW steps of lr 1e-3 on each side.
const NOISE_BOUND: f64 = 2.0 * 5.0 * 1e-3;
/// How much farther than PyTorch's float32 training the runner may be from the float64 one.
const CONDITION_MARGIN: f64 = 2.0;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> PathBuf {
    std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv/bin/python"))
}

/// Runs tests/train_oracle.py for `models` (all but the known failures if empty), once per
/// content of it and of the parameter record and export_models.py (which it imports).
fn generate(models: &[&str]) -> Vec<serde_json::Value> {
    let script = repo().join("tests/train_oracle.py");
    let mut h = Sha256::new();
    for f in [&script, &repo().join("python/smp_partition/param_record.py"), &repo().join("scripts/export_models.py")] {
        h.update(std::fs::read(f).expect("read oracle script"));
    }
    h.update(models.join(",").as_bytes());
    let key: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("train_oracle").join(key);
    let list = dir.join("cases.json");
    if !list.exists() {
        let r = Command::new(python()).arg(&script).arg(&dir).args(models).output().expect("run tests/train_oracle.py");
        assert!(r.status.success(), "train_oracle.py failed: {}", String::from_utf8_lossy(&r.stderr));
    }
    serde_json::from_slice(&std::fs::read(&list).expect("cases.json")).expect("cases.json is JSON")
}

/// The default cases, generated once per test process.
fn cases() -> &'static Vec<serde_json::Value> {
    static CASES: OnceLock<Vec<serde_json::Value>> = OnceLock::new();
    CASES.get_or_init(|| generate(&[]))
}

fn norm_rel(got: &Tensor, want: &Tensor) -> f64 {
    let g = got.to_kind(Kind::Double);
    let w = want.to_kind(Kind::Double);
    (&g - &w).norm().double_value(&[]) / w.norm().double_value(&[]).max(1e-30)
}

/// Trains one case with the runner; returns (worst loss difference, worst weight difference,
/// description).
fn check(case: &serde_json::Value, dir: &Path) -> Result<(f64, f64), String> {
    let name = case["case"].as_str().unwrap_or("?");
    let saved = dir.join(format!("{name}.runner.npz"));
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["train", case["onnx"].as_str().unwrap(), "--data", case["data"].as_str().unwrap()])
        .args(["--loss", case["loss"].as_str().unwrap(), "--steps", "5", "--threads", "1", "--json"])
        .arg("--save-weights")
        .arg(&saved)
        .output()
        .expect("run smp-runner");
    if !r.status.success() {
        return Err(format!("{name}: train failed: {}", String::from_utf8_lossy(&r.stderr)));
    }
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).map_err(|e| format!("{name}: stdout: {e}"))?;
    let ours: Vec<f64> = v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect();
    let theirs: Vec<f64> = case["losses"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let loss_rel = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
    let mut errors = Vec::new();
    if ours.len() != theirs.len() || loss_rel > LOSS_TOL {
        errors.push(format!("losses differ by {loss_rel:.2e} relative: runner {ours:?}, torch {theirs:?}"));
    }
    let want: BTreeMap<String, Tensor> = npz::read_npz(Path::new(case["trained"].as_str().unwrap())).unwrap().into_iter().collect();
    let exact: BTreeMap<String, Tensor> = npz::read_npz(Path::new(case["trained64"].as_str().unwrap())).unwrap().into_iter().collect();
    let got: BTreeMap<String, Tensor> = npz::read_npz(&saved).map_err(|e| format!("{name}: {e}"))?.into_iter().collect();
    let mut worst = (0.0f64, String::new());
    let mut gradfree = 0i64;
    for (p, w) in want.iter().filter(|(p, _)| !p.ends_with("#gradfree")) {
        let Some(g) = got.get(p) else {
            errors.push(format!("`{p}` is not trained by the runner"));
            continue;
        };
        let rows = got.get(&format!("{p}#rows"));
        let select = |t: &Tensor| match rows {
            Some(rows) => t.index_select(0, rows),
            None => t.shallow_clone(),
        };
        let w = select(w);
        let Some(x) = exact.get(p).map(select) else {
            errors.push(format!("`{p}` has no float64 PyTorch result"));
            continue;
        };
        if g.size() != w.size() {
            errors.push(format!("`{p}`: shape {:?}, torch {:?}", g.size(), w.size()));
            continue;
        }
        // gradient-free elements (zero gradient in exact arithmetic) move by Adam-scaled
        // rounding noise, at most lr a step either way: bounded, the rest compared exactly
        let (g, w, x) = match want.get(&format!("{p}#gradfree")) {
            Some(mask) => {
                let mask = match got.get(&format!("{p}#rows")) {
                    Some(rows) => mask.index_select(0, rows),
                    None => mask.shallow_clone(),
                }
                .to_kind(Kind::Bool);
                let diff = (g.masked_select(&mask) - w.masked_select(&mask)).abs();
                let noise = if diff.numel() == 0 { 0.0 } else { diff.max().double_value(&[]) };
                if noise > NOISE_BOUND {
                    errors.push(format!("`{p}`: gradient-free elements differ by {noise:.2e} > {NOISE_BOUND:.0e}"));
                }
                gradfree += mask.sum(Kind::Int64).int64_value(&[]);
                let keep = mask.logical_not();
                (g.masked_select(&keep), w.masked_select(&keep), x.to_kind(Kind::Double).masked_select(&keep))
            }
            None => (g.shallow_clone(), w, x),
        };
        if w.numel() == 0 {
            continue;
        }
        let rel = norm_rel(&g, &w);
        if rel > worst.0 {
            worst = (rel, p.clone());
        }
        if rel > WEIGHT_TOL {
            // as accurate as PyTorch's own float32 training?
            let (ours, torch32) = (norm_rel(&g, &x), norm_rel(&w, &x));
            if ours <= CONDITION_MARGIN * torch32 {
                eprintln!(
                    "{name}: `{p}` differs from PyTorch by {rel:.2e}, but is {ours:.2e} from PyTorch's float64 training, \
                     where PyTorch's float32 one is {torch32:.2e}"
                );
            } else {
                errors.push(format!(
                    "`{p}` differs by {rel:.2e} norm-relative ({ours:.2e} from PyTorch's float64 training, PyTorch's float32 {torch32:.2e})"
                ));
            }
        }
    }
    // the module's buffers, as the export's record names them (the runner writes them too)
    let model = smp_partition::frontend::onnx::load_model(Path::new(case["onnx"].as_str().unwrap())).map_err(|e| format!("{name}: {e}"))?;
    let buffers: std::collections::BTreeSet<String> = model
        .graph
        .initializers()
        .filter_map(|v| model.graph.value(v).record.as_ref())
        .filter(|r| r.kind == smp_partition::ir::RecordKind::Buffer)
        .flat_map(|r| r.params.iter().flatten().cloned())
        .collect();
    for p in got.keys() {
        if !p.ends_with("#rows") && !buffers.contains(p) && !want.contains_key(p) {
            errors.push(format!("the runner trains `{p}`, which is no parameter of the module"));
        }
    }
    eprintln!("{name}: loss rel {loss_rel:.2e}, worst weight rel {:.2e} ({}), {gradfree} gradient-free elements", worst.0, worst.1);
    if errors.is_empty() { Ok((loss_rel, worst.0)) } else { Err(format!("{name}: {}", errors.join("; "))) }
}

fn oracle(model: &str) {
    oracle_of(cases(), model);
}

fn oracle_of(cases: &[serde_json::Value], model: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mine: Vec<&serde_json::Value> = cases.iter().filter(|c| c["model"] == model).collect();
    assert_eq!(mine.len(), 2, "{model}: want a fixed and a dynamic export");
    let failures: Vec<String> = mine.iter().filter_map(|c| check(c, dir.path()).err()).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn gpt2_trains_as_pytorch() {
    oracle("gpt2");
}

#[test]
fn opt_trains_as_pytorch() {
    oracle("opt");
}

#[test]
fn llama_trains_as_pytorch() {
    oracle("llama");
}

#[test]
fn qwen2_trains_as_pytorch() {
    oracle("qwen2");
}

/// Losses agree (6.5e-7 relative after 5 steps); weights differ from PyTorch's by up to 2.9e-4
/// norm-relative. The cause is float32 itself: at step 1 one element of
/// `layers.0.mlp.dense_h_to_4h.weight` has a gradient of 2.5e-9 (float64) where its tensor's
/// reach 1.5e-2; float32 gets 8.4e-10 (PyTorch) and something else again (the runner), below
/// Adam's eps after clipping, so that element's first step differs by up to 1.8e-4 and every
/// later step carries the difference into every tensor. PyTorch's own float32 training is
/// 2.0e-4 from its float64 one; the runner's is closer (at most 8.8e-5), which the
/// conditioning rule above accepts.
#[test]
fn neox_trains_as_pytorch() {
    oracle("neox");
}

/// GPT-NeoX's default parallel residual: both LayerNorms of a block read the block input, and
/// at HF's default init (equal weights) the exporter merges the two LayerNorm nodes, so a plain
/// export holds no `post_attention_layernorm` (the record lists them in `smp.missing`). The
/// oracle exports it with its nodes kept apart (`param_record.keep_apart`: distinct values
/// during the export only, the module's own values put back into the file), so the file is the
/// module at HF's default init, node for node.
#[test]
fn neox_parallel_residual_trains_as_pytorch() {
    oracle_of(&generate(&["neox_parallel"]), "neox_parallel");
}

#[test]
fn phi_trains_as_pytorch() {
    oracle("phi");
}

#[test]
fn bert_trains_as_pytorch() {
    oracle("bert");
}

#[test]
fn vit_trains_as_pytorch() {
    oracle("vit");
}

/// Mixed precision as PyTorch's own recipe: 5 steps of a one-device plan in `bf16-mixed`
/// (`torch.autocast("cpu", torch.bfloat16)` over fp32 weights, AdamW, clip) and `fp16-mixed`
/// (autocast in float16 with `torch.amp.GradScaler("cpu")`) give PyTorch's losses within
/// 1e-2 relative, and not the f32 run's exactly (the plan's precision took effect).
fn mixed_oracle(model: &str) {
    let dir = tempfile::tempdir().unwrap();
    let case = cases().iter().find(|c| c["model"] == model && c["variant"] == "fixed").expect("fixed case");
    let f32_losses: Vec<f64> = case["losses"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    for precision in ["bf16-mixed", "fp16-mixed"] {
        let theirs: Vec<f64> = case["mixed"][precision].as_array().unwrap_or_else(|| panic!("{model}: no {precision} losses")).iter().map(|x| x.as_f64().unwrap()).collect();
        let plan = dir.path().join(format!("{precision}.json"));
        let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
            .arg(case["onnx"].as_str().unwrap())
            .args(["--cluster", "cpu:1", "--pp", "1", "--tp", "1", "--dp", "1", "--microbatches", "1", "--global-batch", "2", "--precision", precision, "-o"])
            .arg(&plan)
            .output()
            .expect("run smp-partition");
        assert!(r.status.success(), "{model} {precision}: plan failed: {}", String::from_utf8_lossy(&r.stderr));
        let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .arg("run")
            .arg(&plan)
            .args(["--data", case["data"].as_str().unwrap(), "--loss", case["loss"].as_str().unwrap(), "--steps", "5", "--threads", "1", "--json"])
            .output()
            .expect("run smp-runner");
        assert!(r.status.success(), "{model} {precision}: run failed: {}", String::from_utf8_lossy(&r.stderr));
        let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
        let ours: Vec<f64> = v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect();
        let rel = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max);
        eprintln!("{model} {precision}: runner {ours:?}\n  torch {theirs:?}\n  max relative {rel:.2e}");
        assert_eq!(ours.len(), theirs.len());
        assert!(rel <= 1e-2, "{model} {precision}: losses differ from PyTorch's recipe by {rel:.2e} relative");
        assert_ne!(ours, f32_losses, "{model} {precision}: the run equals f32 training exactly");
    }
}

#[test]
fn gpt2_trains_in_mixed_precision_as_pytorch() {
    mixed_oracle("gpt2");
}

#[test]
fn llama_trains_in_mixed_precision_as_pytorch() {
    mixed_oracle("llama");
}

#[test]
fn bert_trains_in_mixed_precision_as_pytorch() {
    mixed_oracle("bert");
}
