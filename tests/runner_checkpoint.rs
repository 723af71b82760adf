//! Checkpoints through `smp-runner` (docs/checkpoints.md), on the GPT-2 export in f64 with a
//! token file (every step a new batch) and a cosine schedule with warm-up:
//! - exact resume: 20 steps with a checkpoint at step 10, resumed from it: steps 11–20 equal
//!   the uninterrupted run bit for bit, for pp2, tp2 (Megatron split), dp2 with ZeRO 3,
//!   pp2×tp2 and one process; each rank wrote its own shard (tensor-parallel ranges, ZeRO
//!   element ranges in the manifest);
//! - crash safety: a rank aborted by the fault hook while checkpoint 15 is written leaves no
//!   manifest; `--resume DIR` loads checkpoint 10 and continues identically; a damaged
//!   manifest or safetensors header is refused naming the file;
//! - resharding: saved under pp2×tp2 (4 ranks), resumed under dp2 and under one rank: losses
//!   11–20 within 1e-9 of the uninterrupted run; its reassembled weights and moments agree with
//!   a one-process run's;
//! - export: `eval` of trained.onnx equals the runner's forward on the checkpoint (and
//!   onnxruntime agrees); trained.safetensors holds the checkpoint's parameters by name; for an
//!   export with a parameter record, PyTorch loads it with `load_state_dict(strict=True)` and
//!   gets what PyTorch trained, and trained.onnx re-imports with one initializer per tensor;
//! - `--keep` keeps the newest checkpoints, and `--resume DIR` takes the newest;
//! - Dropout (an export with Dropout in training mode after every attention softmax): its
//!   masks are a function of the seed, step, node and sample alone, so a pp2 plan and a dp2
//!   plan equal one process, a plan recomputing its activations equals the same plan keeping
//!   them, and a resume continues bit for bit; a resume under another `--seed` is refused;
//! - `--frozen` given to the planner: the plan records it and plans no gradients or moments
//!   for those tensors; the run trains by it (as one process `train --frozen` does), refuses
//!   other patterns, and `export` writes the frozen tensors as the model holds them.
#![cfg(feature = "runner")]

mod common;

use common::runner::{field, json, ok, random_tokens, runner};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

use smp_partition::runtime::data;

const SEQ: usize = 16;
const BATCH: usize = 8;
const STEPS: usize = 20;
const WINDOWS: usize = 48;
/// The `--frozen` pattern of the `pp2-frozen` plan: the first block.
const FROZEN: &str = "model.transformer.h.0.*";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn model() -> PathBuf {
    repo().join("models/gpt2.onnx")
}

struct Files {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    train: PathBuf,
}

fn files() -> &'static Files {
    static F: OnceLock<Files> = OnceLock::new();
    F.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let train = dir.join("train.bin");
        let bytes: Vec<u8> = random_tokens(WINDOWS * SEQ + 3, 7).iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(&train, bytes).unwrap();
        std::fs::write(data::sidecar_path(&train), r#"{"dtype": "uint16"}"#).unwrap();
        Files { _dir: tmp, dir, train }
    })
}

/// Options every run shares.
fn run_args() -> Vec<String> {
    let f = files();
    [
        "--data", f.train.to_str().unwrap(), "--seed", "3", "--steps", &STEPS.to_string(), "--dtype", "f64", "--threads", "1",
        "--json", "--lr-schedule", "cosine", "--warmup-steps", "2", "--min-lr", "1e-4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The plans of the tests: name → (cluster, ranks, planner flags).
fn plan_spec(name: &str) -> (&'static str, usize, Vec<&'static str>) {
    match name {
        "pp2" => ("cpu:2", 2, vec!["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4"]),
        "tp2" => ("cpu:2", 2, vec!["--pp", "1", "--tp", "2", "--dp", "1", "--microbatches", "4", "--baseline", "megatron"]),
        "dp2-zero3" => ("cpu:2", 2, vec!["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "3", "--microbatches", "2"]),
        "pp2tp2" => ("cpu:4", 4, vec!["--pp", "2", "--tp", "2", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4", "--baseline", "megatron"]),
        "dp2" => ("cpu:2", 2, vec!["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "0", "--microbatches", "2"]),
        "dp2-zero1" => ("cpu:2", 2, vec!["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "1", "--microbatches", "2"]),
        "dp2-zero2" => ("cpu:2", 2, vec!["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "2", "--microbatches", "2"]),
        "one" => ("cpu:1", 1, vec!["--pp", "1", "--tp", "1", "--dp", "1", "--microbatches", "4"]),
        "pp2-frozen" => ("cpu:2", 2, vec!["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4", "--frozen", FROZEN]),
        "drop-one" => plan_spec("one"),
        "drop-pp2" => plan_spec("pp2"),
        "drop-dp2" => plan_spec("dp2"),
        "drop-pp2-recompute" => ("cpu:2", 2, vec!["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4", "--checkpointing", "full"]),
        other => panic!("no plan `{other}`"),
    }
}

/// The plan file of `name` (planned once).
fn plan(name: &str) -> (PathBuf, usize) {
    static PLANS: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let (cluster, nproc, flags) = plan_spec(name);
    let mut plans = PLANS.get_or_init(Default::default).lock().unwrap();
    let path = plans
        .entry(name.to_string())
        .or_insert_with(|| {
            let out = files().dir.join(format!("{name}.json"));
            let cluster = common::cluster_arg(cluster);
            let m = if name.starts_with("drop-") { dropout_model() } else { model() };
            let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
                .arg(m)
                .args(["--cluster", &cluster, "--seq-len", &SEQ.to_string(), "--global-batch", &BATCH.to_string(), "-o"])
                .arg(&out)
                .args(&flags)
                .output()
                .unwrap();
            ok(&format!("planning {name}"), r);
            out
        })
        .clone();
    (path, nproc)
}

/// `smp-runner launch` of plan `name` with the shared options and `extra`.
fn launch(name: &str, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let (p, nproc) = plan(name);
    let mut c = runner();
    c.args(["launch", "--nproc", &nproc.to_string()]).arg(&p).args(run_args()).args(["--timeout", "120"]).args(extra);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// An uninterrupted 20-step run of `name` that checkpoints every 10 steps.
struct Saved {
    dir: PathBuf,
    report: serde_json::Value,
}

fn saved(name: &str) -> &'static Saved {
    static RUNS: OnceLock<Mutex<HashMap<String, &'static Saved>>> = OnceLock::new();
    let mut runs = RUNS.get_or_init(Default::default).lock().unwrap();
    runs.entry(name.to_string()).or_insert_with(|| {
        let dir = files().dir.join(format!("ckpt-{name}"));
        let r = launch(name, &["--checkpoint-dir", dir.to_str().unwrap(), "--checkpoint-every", "10"], &[]);
        let report = json(&ok(&format!("checkpointing run of {name}"), r));
        Box::leak(Box::new(Saved { dir, report }))
    })
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

fn step_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("step-{step:08}"))
}

/// Runs `name` from `from` (a checkpoint) and returns its report.
fn resume(name: &str, from: &Path) -> serde_json::Value {
    json(&ok(&format!("resumed run of {name}"), launch(name, &["--resume", from.to_str().unwrap()], &[])))
}

fn exact_resume(name: &str) {
    let s = saved(name);
    let all = field(&s.report, "steps", "loss");
    assert_eq!(all.len(), STEPS);
    let ckpts: Vec<u64> = s.report["checkpoints"].as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(ckpts, vec![10, 20], "{name}: checkpoints in --json");
    let m = manifest(&step_dir(&s.dir, 10));
    let (_, nproc) = plan(name);
    assert_eq!(m["step"], 10);
    assert_eq!(m["files"].as_array().unwrap().len(), nproc, "{name}: one shard per rank");
    let tensors = m["tensors"].as_array().unwrap();
    let files: std::collections::BTreeSet<&str> = tensors.iter().map(|t| t["file"].as_str().unwrap()).collect();
    assert_eq!(files.len(), nproc, "{name}: every rank wrote pieces");
    if name.contains("tp2") {
        assert!(tensors.iter().any(|t| t["ranges"].is_array()), "{name}: tensor-parallel pieces carry their ranges");
    }
    if name.contains("zero3") {
        assert!(tensors.iter().any(|t| t["flat"].is_array()), "{name}: ZeRO-3 pieces carry their element ranges");
    }
    let got = resume(name, &step_dir(&s.dir, 10));
    assert_eq!(field(&got, "steps", "step"), (11..=STEPS).map(|k| k as f64).collect::<Vec<_>>());
    let tail = field(&got, "steps", "loss");
    assert_eq!(tail, all[10..].to_vec(), "{name}: resumed steps 11-20 differ from the uninterrupted run");
    assert_eq!(field(&got, "steps", "lr"), field(&s.report, "steps", "lr")[10..].to_vec(), "{name}: learning rates");
}

#[test]
fn pp2_resumes_bit_for_bit() {
    exact_resume("pp2");
}

#[test]
fn tp2_resumes_bit_for_bit() {
    exact_resume("tp2");
}

#[test]
fn dp2_zero3_resumes_bit_for_bit() {
    exact_resume("dp2-zero3");
}

/// ZeRO 1 and 2 resume their optimizer blocks read as blocks from the checkpoint.
#[test]
fn dp2_zero1_and_zero2_resume_bit_for_bit() {
    exact_resume("dp2-zero1");
    exact_resume("dp2-zero2");
}

#[test]
fn pp2_tp2_resumes_bit_for_bit() {
    exact_resume("pp2tp2");
}

#[test]
fn one_process_resumes_bit_for_bit() {
    exact_resume("one");
}

#[test]
fn a_rank_aborted_while_writing_leaves_the_previous_checkpoint_to_resume() {
    let name = "pp2";
    let want = field(&saved(name).report, "steps", "loss");
    let dir = files().dir.join("ckpt-crash");
    let d = dir.to_str().unwrap();
    let r = launch(name, &["--checkpoint-dir", d, "--checkpoint-every", "5"], &[("SMP_CHECKPOINT_FAULT", "1:15")]);
    assert!(!r.status.success(), "the fault hook aborts rank 1");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains("rank 1 aborts after writing its shard of step 15"), "{err}");
    // rank 1's shard of step 15 is there, the manifest is not
    assert!(step_dir(&dir, 15).join("rank-00001.safetensors").is_file());
    assert!(!step_dir(&dir, 15).join("manifest.json").exists());
    assert!(step_dir(&dir, 10).join("manifest.json").is_file());
    let got = resume(name, &dir);
    assert!(got["resumed_from"].as_str().unwrap().ends_with("step-00000010"), "{got}");
    assert_eq!(field(&got, "steps", "loss"), want[10..].to_vec(), "resumed after the crash");
}

#[test]
fn damaged_manifests_and_headers_are_refused_naming_the_file() {
    let s = saved("pp2");
    let copy = |tag: &str| {
        let d = files().dir.join(format!("damaged-{tag}"));
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(step_dir(&s.dir, 10)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        d
    };
    let d = copy("manifest");
    let text = std::fs::read(d.join("manifest.json")).unwrap();
    std::fs::write(d.join("manifest.json"), &text[..text.len() / 2]).unwrap();
    let r = launch("pp2", &["--resume", d.to_str().unwrap()], &[]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains(&d.join("manifest.json").display().to_string()) && err.contains("damaged"), "{err}");

    let d = copy("header");
    let shard = d.join("rank-00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[8..16].copy_from_slice(b"{\"x\":[1,");
    std::fs::write(&shard, &bytes).unwrap();
    let r = launch("pp2", &["--resume", d.to_str().unwrap()], &[]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains(&shard.display().to_string()) && err.contains("safetensors header"), "{err}");
}

#[test]
fn a_pp2_tp2_checkpoint_resumes_under_dp2_and_one_rank() {
    let s = saved("pp2tp2");
    let want = field(&s.report, "steps", "loss");
    for other in ["dp2", "one"] {
        let got = resume(other, &step_dir(&s.dir, 10));
        let tail = field(&got, "steps", "loss");
        assert_eq!(tail.len(), STEPS - 10);
        let worst = tail.iter().zip(&want[10..]).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max);
        eprintln!("pp2tp2 -> {other}: max relative loss difference {worst:.3e}");
        assert!(worst <= 1e-9, "{other}: {tail:?} vs {:?}", &want[10..]);
    }
}

fn eval_logits(model: &Path, inputs: &Path, out: &Path, checkpoint: Option<&Path>) -> tch::Tensor {
    let mut c = runner();
    c.arg("eval").arg(model).arg("--inputs").arg(inputs).arg("--outputs").arg(out).args(["--dtype", "f32"]);
    if let Some(ck) = checkpoint {
        c.arg("--checkpoint").arg(ck);
    }
    ok(&format!("eval of {}", model.display()), c.output().unwrap());
    let arrays = smp_partition::runtime::formats::npz::read_npz(out).unwrap();
    arrays.into_iter().find(|(n, _)| n == "logits").expect("logits").1
}

fn max_abs(a: &tch::Tensor, b: &tch::Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn exports_hold_the_trained_weights() {
    let f = files();
    let dir = f.dir.join("ckpt-export");
    let r = runner()
        .arg("train")
        .arg(model())
        .args(["--batch", "8", "--seq-len", "16", "--microbatches", "2", "--steps", "5", "--dtype", "f32", "--threads", "1", "--seed", "3"])
        .arg("--data")
        .arg(&f.train)
        .arg("--checkpoint-dir")
        .arg(&dir)
        .arg("--json")
        .output()
        .unwrap();
    let report = json(&ok("f32 training", r));
    assert_eq!(report["checkpoints"][0]["step"], 5, "a checkpoint after the last step by default");
    let ckpt = step_dir(&dir, 5);
    let onnx = dir.join("trained.onnx");
    let st = dir.join("trained.safetensors");
    for out in [&onnx, &st] {
        ok("export", runner().arg("export").arg(&dir).arg("-o").arg(out).output().unwrap());
    }
    let io = smp_partition::runtime::formats::npz::read_npz(&repo().join("models/gpt2.io.npz")).unwrap();
    let ids = io.into_iter().find(|(n, _)| n == "input_ids").expect("input_ids").1;
    let inputs = dir.join("inputs.npz");
    smp_partition::runtime::formats::npz::write_npz(&inputs, &[("input_ids".into(), ids, None)]).unwrap();
    let exported = eval_logits(&onnx, &inputs, &dir.join("a.npz"), None);
    let own = eval_logits(&model(), &inputs, &dir.join("b.npz"), Some(&ckpt));
    let before = eval_logits(&model(), &inputs, &dir.join("c.npz"), None);
    let scale = own.abs().max().double_value(&[]);
    let diff = max_abs(&exported, &own);
    eprintln!("trained.onnx vs the runner's forward on the checkpoint: max abs {diff:.3e} (scale {scale:.3})");
    assert!(diff <= 1e-6 * scale.max(1.0), "trained.onnx differs from the checkpoint's forward by {diff}");
    assert!(max_abs(&before, &own) > 1e-4, "training changed the outputs");
    // with the initializers in a data file beside it (small shape operands stay inline)
    let ext = dir.join("ext");
    std::fs::create_dir_all(&ext).unwrap();
    let onnx_ext = ext.join("trained.onnx");
    ok("export --external-data", runner().arg("export").arg(&dir).arg("-o").arg(&onnx_ext).arg("--external-data").output().unwrap());
    assert!(ext.join("trained.onnx.data").is_file());
    assert!(std::fs::metadata(&onnx_ext).unwrap().len() < std::fs::metadata(&onnx).unwrap().len() / 2, "the weights are outside the model file");
    assert_eq!(max_abs(&eval_logits(&onnx_ext, &inputs, &dir.join("e.npz"), None), &own), 0.0);
    // onnxruntime reads the file too, and agrees
    let py = repo().join(".venv/bin/python");
    if py.exists() {
        let script = "import sys, numpy as np, onnxruntime as ort\n\
            s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n\
            x = np.load(sys.argv[2])['input_ids']\n\
            np.save(sys.argv[3], s.run(['logits'], {'input_ids': x})[0])\n";
        for m in [&onnx, &onnx_ext] {
            let npy = dir.join("ort.npy");
            let r = Command::new(&py).args(["-c", script]).arg(m).arg(&inputs).arg(&npy).output().unwrap();
            ok(&format!("onnxruntime on {}", m.display()), r);
            let ort = smp_partition::runtime::formats::npz::read_npy(&npy).unwrap();
            let d = max_abs(&ort, &own);
            eprintln!("onnxruntime on {} vs the runner: max abs {d:.3e}", m.display());
            assert!(d <= 1e-4 * scale.max(1.0), "onnxruntime: {d}");
        }
    }
    // the safetensors hold every trained parameter under its name, as the checkpoint does
    let loaded = smp_partition::runtime::state::checkpoint::Loaded::open(&ckpt).unwrap();
    let names = loaded.names(smp_partition::runtime::state::checkpoint::Role::Param);
    let weights: HashMap<String, tch::Tensor> = tch::Tensor::read_safetensors(&st).unwrap().into_iter().collect();
    // a tied tensor is written under each of its aliases, as a state_dict holds it
    let graph = smp_partition::frontend::onnx::load_model(&model()).unwrap().graph;
    let aliases: HashMap<String, Vec<String>> = graph
        .initializers()
        .filter_map(|v| graph.value(v).record.as_ref())
        .flat_map(|r| r.params.iter())
        .filter_map(|a| Some((a.first()?.clone(), a.clone())))
        .collect();
    let want_keys: std::collections::BTreeSet<String> =
        names.keys().flat_map(|n| aliases.get(n).cloned().unwrap_or_else(|| vec![n.clone()])).collect();
    let keys: std::collections::BTreeSet<String> = weights.keys().cloned().collect();
    assert_eq!(keys, want_keys, "safetensors keys are the parameter names and their tied aliases");
    for name in names.keys() {
        let want = loaded.assemble(name, smp_partition::runtime::state::checkpoint::Role::Param).unwrap();
        for alias in aliases.get(name).cloned().unwrap_or_else(|| vec![name.clone()]) {
            assert_eq!(max_abs(&weights[&alias], &want), 0.0, "`{alias}` (of `{name}`)");
        }
    }
}

#[test]
fn a_tensor_parallel_checkpoint_reassembles_to_one_process_weights() {
    // the same 10 steps under pp2×tp2 and on one process: the reassembled f64 weights and
    // moments agree
    use smp_partition::runtime::state::checkpoint::{Loaded, Role};
    let (a, b) = (saved("pp2tp2"), saved("one"));
    let la = Loaded::open(&step_dir(&a.dir, 10)).unwrap();
    let lb = Loaded::open(&step_dir(&b.dir, 10)).unwrap();
    let names = lb.names(Role::Param);
    assert_eq!(la.names(Role::Param).keys().collect::<Vec<_>>(), names.keys().collect::<Vec<_>>());
    let mut worst = [0.0f64; 3];
    for (i, role) in [Role::Param, Role::ExpAvg, Role::ExpAvgSq].into_iter().enumerate() {
        for name in names.keys() {
            let (x, y) = (la.assemble(name, role).unwrap(), lb.assemble(name, role).unwrap());
            assert_eq!(x.kind(), tch::Kind::Double);
            worst[i] = worst[i].max(max_abs(&x, &y) / y.abs().max().double_value(&[]).max(1e-300));
        }
    }
    eprintln!("pp2tp2 vs one process after 10 steps: max relative difference {:.3e} (weights), {:.3e} (exp_avg), {:.3e} (exp_avg_sq)", worst[0], worst[1], worst[2]);
    assert!(worst[0] <= 1e-9, "weights {worst:?}");
    assert!(worst[1] <= 1e-6 && worst[2] <= 1e-6, "moments {worst:?}");
    // the export rounds to the model's own element type (float32 here)
    let p = files().dir.join("pp2tp2.safetensors");
    ok("export", runner().arg("export").arg(step_dir(&a.dir, 10)).arg("-o").arg(&p).output().unwrap());
    let w: HashMap<String, tch::Tensor> = tch::Tensor::read_safetensors(&p).unwrap().into_iter().collect();
    for name in names.keys() {
        let want = la.assemble(name, Role::Param).unwrap().to_kind(tch::Kind::Float);
        assert_eq!(w[name].kind(), tch::Kind::Float);
        assert_eq!(max_abs(&w[name], &want), 0.0, "`{name}`");
    }
}

/// Pieces of one 6×8 tensor as three tensor ranks × two ZeRO blocks would hold them
/// (column ranges, then halves of each cut flattened), written as rank shards.
#[test]
fn pieces_reassemble_and_gaps_are_refused() {
    use smp_partition::runtime::state::checkpoint::{self as ck, Loaded, Piece, Role, RunState};
    use smp_partition::runtime::state::slice::Slice;
    let whole = tch::Tensor::arange(48, (tch::Kind::Double, tch::Device::Cpu)).reshape([6, 8]);
    let cuts: [Vec<[u64; 2]>; 3] = [vec![[0, 2], [6, 7]], vec![[2, 4], [7, 8]], vec![[4, 6]]];
    let write = |dir: &Path, skip: Option<(usize, usize)>| {
        ck::begin(dir).unwrap();
        let mut rank = 0;
        for (t, ranges) in cuts.iter().enumerate() {
            let parts: Vec<tch::Tensor> = ranges.iter().map(|r| whole.narrow(1, r[0] as i64, (r[1] - r[0]) as i64)).collect();
            let local = tch::Tensor::cat(&parts, 1).reshape([-1]);
            let n = local.size()[0] as u64;
            for (z, flat) in [[0, n / 2], [n / 2, n]].into_iter().enumerate() {
                let pieces = if skip == Some((t, z)) {
                    Vec::new()
                } else {
                    vec![Piece {
                        name: "w".into(),
                        role: Role::Param,
                        shape: vec![6, 8],
                        transposed: false,
                        slice: Slice { axis: Some(1), ranges: ranges.clone(), flat: Some(flat), experts: None },
                        tensor: local.narrow(0, flat[0] as i64, (flat[1] - flat[0]) as i64),
                    }]
                };
                ck::write_shard(dir, rank, &pieces).unwrap();
                rank += 1;
            }
        }
        let state = RunState {
            step: 1,
            next_batch: 2,
            seed: 0,
            plan_hash: None,
            mesh: "test".into(),
            model_sha256: String::new(),
            model_path: String::new(),
            trainable: Vec::new(),
            frozen: Vec::new(),
            world: rank,
            adamw_step: 1,
            loss_scale: None,
        };
        ck::write_manifest(dir, state).unwrap();
    };
    let root = files().dir.join("pieces");
    let full = root.join("full");
    write(&full, None);
    let l = Loaded::open(&full).unwrap();
    assert_eq!(max_abs(&l.assemble("w", Role::Param).unwrap(), &whole), 0.0);
    let gap = root.join("gap");
    write(&gap, Some((1, 1)));
    let err = Loaded::open(&gap).unwrap().assemble("w", Role::Param).err().expect("a missing block is refused").to_string();
    assert!(err.contains("in no shard") && err.contains("manifest.json"), "{err}");
}

/// The GPT-2 oracle export of tests/train_oracle.py (HF GPT-2 at default init, dynamic shapes,
/// with the parameter record: merged LayerNorm initializers, transposed weights, a tied
/// embedding), generated once per content of the scripts.
fn recorded_gpt2() -> serde_json::Value {
    use sha2::Digest;
    let script = repo().join("tests/train_oracle.py");
    let mut h = sha2::Sha256::new();
    for f in [&script, &repo().join(common::exports::PARAM_RECORD), &repo().join("scripts/export_models.py")] {
        h.update(std::fs::read(f).unwrap());
    }
    h.update(b"checkpoint:gpt2");
    let key: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("checkpoint_oracle").join(key);
    if !dir.join("cases.json").exists() {
        let r = Command::new(repo().join(".venv/bin/python")).arg(&script).arg(&dir).arg("gpt2").output().unwrap();
        ok("tests/train_oracle.py gpt2", r);
    }
    let cases: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(dir.join("cases.json")).unwrap()).unwrap();
    cases.into_iter().find(|c| c["case"] == "gpt2-dynamic").expect("gpt2-dynamic case")
}

#[test]
fn a_recorded_export_comes_out_as_its_module_state_dict_and_a_retrainable_onnx() {
    let case = recorded_gpt2();
    let s = |k: &str| case[k].as_str().unwrap().to_string();
    let dir = files().dir.join("ckpt-recorded");
    let r = runner()
        .args(["train", &s("onnx"), "--data", &s("data"), "--loss", &s("loss"), "--steps", "5", "--threads", "1", "--json"])
        .arg("--checkpoint-dir")
        .arg(&dir)
        .output()
        .unwrap();
    let trained_log = String::from_utf8_lossy(&ok("training the recorded export", r).stderr).lines().find(|l| l.contains("trains")).unwrap().to_string();
    let (st, onnx) = (dir.join("trained.safetensors"), dir.join("trained.onnx"));
    for out in [&st, &onnx] {
        ok("export", runner().arg("export").arg(&dir).arg("-o").arg(out).output().unwrap());
    }
    // PyTorch loads the safetensors into the module with strict=True, and gets what PyTorch
    // trained (5 AdamW steps from the same init; attention key biases move by rounding noise)
    let script = "import sys, json, numpy as np, torch\n\
        sys.path[:0] = [sys.argv[3] + '/tests', sys.argv[3] + '/scripts']\n\
        from train_oracle import configs\n\
        from export_models import LogitsOnly\n\
        from safetensors.torch import load_file\n\
        cls, cfg, kind = configs()['gpt2']\n\
        cfg._attn_implementation = 'eager'\n\
        m = LogitsOnly(cls(cfg), 'input_ids')\n\
        m.load_state_dict(load_file(sys.argv[1]), strict=True)\n\
        want = np.load(sys.argv[2])\n\
        worst = max(float((p.detach() - torch.from_numpy(want[n])).norm() / torch.from_numpy(want[n]).norm()) for n, p in m.named_parameters(remove_duplicate=False))\n\
        print(json.dumps({'worst': worst, 'params': len(list(m.named_parameters(remove_duplicate=False)))}))\n";
    let r = Command::new(repo().join(".venv/bin/python")).args(["-c", script]).arg(&st).arg(s("trained")).arg(repo()).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&ok("load_state_dict(strict=True)", r).stdout).unwrap();
    eprintln!("trained.safetensors in PyTorch: {v}");
    assert!(v["worst"].as_f64().unwrap() <= 1e-3, "{v}");
    // trained.onnx: the checkpoint's forward, and it imports as one module tensor per initializer
    let data = PathBuf::from(s("data"));
    let exported = eval_logits(&onnx, &data, &dir.join("a.npz"), None);
    let own = eval_logits(Path::new(&s("onnx")), &data, &dir.join("b.npz"), Some(&dir));
    let diff = max_abs(&exported, &own);
    assert!(diff <= 1e-6 * own.abs().max().double_value(&[]).max(1.0), "trained.onnx vs the checkpoint: {diff}");
    let r = runner().arg("train").arg(&onnx).args(["--data", &s("data"), "--loss", &s("loss"), "--steps", "1", "--threads", "1"]).output().unwrap();
    let again = String::from_utf8_lossy(&ok("training trained.onnx", r).stderr).lines().find(|l| l.contains("trains")).unwrap().to_string();
    let count = |l: &str| l.split(';').next().unwrap().to_string();
    assert_eq!(count(&again), count(&trained_log), "trained.onnx trains the same tensors");
    assert!(!again.contains("untied"), "the untied copies are initializers of their own: {again}");
}

#[test]
fn keep_holds_the_newest_checkpoints() {
    let f = files();
    let dir = f.dir.join("ckpt-keep");
    let r = runner()
        .arg("train")
        .arg(model())
        .args(["--batch", "8", "--seq-len", "16", "--steps", "6", "--threads", "1", "--json", "--checkpoint-every", "2", "--keep", "2"])
        .arg("--data")
        .arg(&f.train)
        .arg("--checkpoint-dir")
        .arg(&dir)
        .output()
        .unwrap();
    let report = json(&ok("training with --keep 2", r));
    assert_eq!(report["checkpoints"].as_array().unwrap().len(), 3, "three written");
    let mut left: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, vec!["step-00000004", "step-00000006"]);
    // resuming the directory takes the newest
    let r = runner()
        .arg("train")
        .arg(model())
        .args(["--batch", "8", "--seq-len", "16", "--steps", "6", "--threads", "1", "--json"])
        .arg("--data")
        .arg(&f.train)
        .arg("--resume")
        .arg(&dir)
        .output()
        .unwrap();
    let got = json(&ok("resume at the end", r));
    assert!(got["resumed_from"].as_str().unwrap().ends_with("step-00000006"));
    assert_eq!(got["steps"].as_array().unwrap().len(), 0, "nothing left to run");
}

/// The model's values of module tensor `name` as loaded.
fn model_initializer(name: &str) -> tch::Tensor {
    use smp_partition::runtime::{InitMode, Weights};
    let graph = smp_partition::frontend::onnx::load_model(&model()).unwrap().graph;
    // the initializer standing for module tensor `name` (by the parameter record), else by name
    let by_record = graph.initializers().find(|&v| graph.value(v).record.as_ref().is_some_and(|r| r.params.iter().flatten().any(|n| n == name)));
    let v = by_record.or_else(|| graph.value_by_name(name)).unwrap_or_else(|| panic!("no initializer `{name}`"));
    let mut w = Weights::load(&graph, InitMode::Load, None).unwrap();
    w.tensors.remove(&v).unwrap_or_else(|| panic!("`{name}` has no data"))
}

#[test]
fn frozen_patterns_go_from_the_plan_to_the_run_and_its_export() {
    let read = |p: &Path| -> serde_json::Value { serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap() };
    let (frozen_plan, _) = plan("pp2-frozen");
    let (fp, pp) = (read(&frozen_plan), read(&plan("pp2").0));
    assert_eq!(fp["frozen"], serde_json::json!([FROZEN]), "the plan records the pattern");
    assert!(pp.get("frozen").is_none());
    // the first block's elements, in stage 0: the same weights, but no gradients or moments
    // h.0's module tensors, by the parameter record (an initializer the exporter merged
    // stands for one tensor per block)
    let graph = smp_partition::frontend::onnx::load_model(&model()).unwrap().graph;
    let in_h0 = |n: &str| n.starts_with("model.transformer.h.0.");
    let elems: u64 = graph
        .initializers()
        .map(|v| {
            let val = graph.value(v);
            let copies = match &val.record {
                Some(r) => r.params.iter().filter(|a| a.iter().any(|n| in_h0(n))).count() as u64,
                None => u64::from(in_h0(&val.name)),
            };
            copies * val.data.as_ref().unwrap().numel()
        })
        .sum();
    let mem = |p: &serde_json::Value, s: usize, k: &str| p["stages"][s]["memory_bytes"][k].as_u64().unwrap();
    eprintln!("h.0: {elems} elements; stage 0 grads {} → {}, optimizer {} → {}", mem(&pp, 0, "grads"), mem(&fp, 0, "grads"), mem(&pp, 0, "optimizer"), mem(&fp, 0, "optimizer"));
    assert_eq!(mem(&fp, 0, "params"), mem(&pp, 0, "params"));
    assert_eq!(mem(&pp, 0, "grads") - mem(&fp, 0, "grads"), 4 * elems, "f32 gradients of h.0 are not planned");
    assert_eq!(mem(&pp, 0, "optimizer") - mem(&fp, 0, "optimizer"), 8 * elems, "AdamW's two f32 moments of h.0 are not planned");
    for k in ["params", "grads", "optimizer"] {
        assert_eq!(mem(&fp, 1, k), mem(&pp, 1, k), "stage 1 `{k}`");
    }

    // the run trains by the plan's pattern, as one process told the same pattern does
    let dir = files().dir.join("ckpt-frozen");
    let report = json(&ok("pp2 under the plan's --frozen", launch("pp2-frozen", &["--checkpoint-dir", dir.to_str().unwrap()], &[])));
    let one = runner()
        .arg("train")
        .arg(model())
        .args(run_args())
        .args(["--batch", &BATCH.to_string(), "--seq-len", &SEQ.to_string(), "--microbatches", "4", "--frozen", FROZEN])
        .output()
        .unwrap();
    let (frozen, single) = (field(&report, "steps", "loss"), field(&json(&ok("train --frozen", one)), "steps", "loss"));
    let trained_all = field(&saved("pp2").report, "steps", "loss");
    for (s, (a, b)) in frozen.iter().zip(&single).enumerate() {
        assert!((a - b).abs() <= 1e-9 * b.abs(), "step {}: pp2 {a} vs one process {b}", s + 1);
    }
    assert!((frozen[STEPS - 1] - trained_all[STEPS - 1]).abs() > 1e-6, "freezing h.0 changes training");

    // other patterns on this plan, and a resume that would train otherwise, are refused
    let (onep, _) = plan("one");
    let refused = runner().arg("run").arg(&frozen_plan).args(run_args()).args(["--frozen", "model.transformer.h.1.*"]).output().unwrap();
    let msg = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && msg.contains("re-plan") && msg.contains("model.transformer.h.1.*"), "{msg}");
    let resumed = runner().arg("run").arg(&onep).args(run_args()).arg("--resume").arg(&dir).output().unwrap();
    let msg = String::from_utf8_lossy(&resumed.stderr);
    assert!(!resumed.status.success() && msg.contains("must stay the same"), "{msg}");

    // export: the frozen tensors as the model holds them, the others trained
    let st = dir.join("trained.safetensors");
    ok("export", runner().arg("export").arg(&dir).arg("-o").arg(&st).output().unwrap());
    let weights: HashMap<String, tch::Tensor> = tch::Tensor::read_safetensors(&st).unwrap().into_iter().collect();
    for (name, held) in [("model.transformer.h.0.attn.c_attn.weight", true), ("model.transformer.h.0.ln_1.bias", true), ("model.transformer.h.1.attn.c_attn.weight", false)] {
        let w = weights.get(name).unwrap_or_else(|| panic!("`{name}` is not in the export"));
        let d = max_abs(w, &model_initializer(name).to_kind(w.kind()));
        assert_eq!(d == 0.0, held, "`{name}`: max abs change {d}");
    }
}

/// models/gpt2.onnx with a Dropout (ratio 0.25, training mode) after every attention softmax,
/// as an export in training mode has them.
fn dropout_model() -> PathBuf {
    static M: OnceLock<PathBuf> = OnceLock::new();
    M.get_or_init(|| common::runner::gpt2_with_attention_dropout(&files().dir.join("gpt2-dropout.onnx"))).clone()
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| ((x - y) / y).abs()).fold(0.0, f64::max)
}

#[test]
fn dropout_masks_follow_the_sample_so_plans_recompute_and_resume_agree() {
    let losses = |name: &str| field(&json(&ok(name, launch(name, &[], &[]))), "steps", "loss");
    let one = losses("drop-one");
    let plain = field(&saved("one").report, "steps", "loss");
    // the masks act: the first step's loss (same weights, same batch) changes
    assert!(((one[0] - plain[0]) / plain[0]).abs() > 1e-6, "dropout changed nothing: {} vs {}", one[0], plain[0]);
    for name in ["drop-pp2", "drop-dp2", "drop-pp2-recompute"] {
        let got = losses(name);
        let worst = max_rel(&got, &one);
        eprintln!("{name} vs one process: max relative loss difference {worst:.3e}");
        assert!(worst <= 1e-9, "{name}: {got:?} vs {one:?}");
    }
    // resume: the masks of steps 11-20 are those of the uninterrupted run
    let dir = files().dir.join("ckpt-drop-pp2");
    let all = field(&json(&ok("drop-pp2 with checkpoints", launch("drop-pp2", &["--checkpoint-dir", dir.to_str().unwrap(), "--checkpoint-every", "10"], &[]))), "steps", "loss");
    let got = resume("drop-pp2", &step_dir(&dir, 10));
    assert_eq!(field(&got, "steps", "loss"), all[10..].to_vec(), "resumed dropout run");
    // another seed would draw other masks and another sample order
    let (plan_path, nproc) = plan("drop-pp2");
    let args: Vec<String> = run_args().into_iter().scan(false, |after_seed, a| {
        let out = if *after_seed { "4".to_string() } else { a.clone() };
        *after_seed = a == "--seed";
        Some(out)
    }).collect();
    let r = runner().args(["launch", "--nproc", &nproc.to_string()]).arg(&plan_path).args(&args).arg("--resume").arg(step_dir(&dir, 10)).output().unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("--seed 3"), "{err}");
}
