//! Token-file data, learning-rate schedules and validation through `smp-runner`:
//! - a pp2 plan, a dp2 plan (ZeRO 0 and 3), a tp2 plan and a one-rank plan read the same global
//!   batches from a token file as one process does, and train (under a cosine schedule with
//!   warm-up) within 1e-9 (f64) of it over steps whose batches change, validation included;
//! - the sample order depends on (seed, step) alone: replica shares tile the global batch,
//!   an epoch visits every window once, and step 1 of the stream equals a run on that batch;
//! - `prepare-data` is deterministic (whole files held out, every k-th by sorted path), and with
//!   `--tokenizer tokenizer.json` writes the ids Hugging Face's tokenizers give;
//! - the schedules equal PyTorch's `LinearLR`/`CosineAnnealingLR`/`SequentialLR` (Python
//!   oracle), and validation loss equals a forward pass of `smp-runner eval` on those batches;
//! - bad sidecars, dtypes, sizes, vocabularies and sequence lengths are refused naming the file
//!   and the fix.
#![cfg(feature = "runner")]

mod common;

use common::runner::{field, json, ok, plan_into, random_tokens, runner};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use smp_partition::runtime::data::{self, DataSource, Order, TokenFile, TokenStream};
use smp_partition::runtime::train::{LrSchedule, LrShape};
use tch::{Kind, Tensor};

const SEQ: usize = 16;
const BATCH: usize = 8;
const STEPS: usize = 6;
/// Windows in the training file: 6 steps × 8 samples run past one epoch of 40.
const WINDOWS: usize = 40;
const SEED: &str = "3";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn model() -> PathBuf {
    repo().join("models/gpt2.onnx")
}

/// Writes `tokens` as a uint16 token file with its sidecar.
fn write_u16(path: &Path, tokens: &[u16]) {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
    std::fs::write(data::sidecar_path(path), r#"{"dtype": "uint16"}"#).unwrap();
}

struct Files {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    train: PathBuf,
    val: PathBuf,
    tokens: Vec<u16>,
    val_tokens: Vec<u16>,
}

fn files() -> &'static Files {
    static F: OnceLock<Files> = OnceLock::new();
    F.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let tokens = random_tokens(WINDOWS * SEQ + 5, 1);
        let val_tokens = random_tokens(3 * BATCH * SEQ, 2);
        let (train, val) = (dir.join("train.bin"), dir.join("val.bin"));
        write_u16(&train, &tokens);
        write_u16(&val, &val_tokens);
        Files { _dir: tmp, dir, train, val, tokens, val_tokens }
    })
}

/// Options every run of the stream test shares.
fn run_args(f: &Files) -> Vec<String> {
    let s = |x: &str| x.to_string();
    vec![
        s("--data"), f.train.display().to_string(), s("--seed"), s(SEED),
        s("--steps"), STEPS.to_string(), s("--dtype"), s("f64"), s("--threads"), s("1"), s("--json"),
        s("--lr-schedule"), s("cosine"), s("--warmup-steps"), s("2"), s("--min-lr"), s("1e-4"),
        s("--eval-data"), f.val.display().to_string(), s("--eval-every"), s("3"), s("--eval-batches"), s("2"),
    ]
}

/// The single-process run on the token file.
fn reference() -> &'static serde_json::Value {
    static R: OnceLock<serde_json::Value> = OnceLock::new();
    R.get_or_init(|| {
        let f = files();
        let r = runner()
            .arg("train")
            .arg(model())
            .args(["--batch", &BATCH.to_string(), "--seq-len", &SEQ.to_string(), "--microbatches", "4"])
            .args(run_args(f))
            .output()
            .unwrap();
        json(&ok("reference run", r))
    })
}

fn plan(dir: &Path, name: &str, cluster: &str, flags: &[&str]) -> PathBuf {
    let shape = ["--seq-len", &SEQ.to_string(), "--global-batch", &BATCH.to_string()].map(String::from);
    let args: Vec<&str> = shape.iter().map(String::as_str).chain(flags.iter().copied()).collect();
    plan_into(&model(), cluster, &args, &dir.join(format!("{name}.json")))
}

fn max_rel(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "record count: {got:?} vs {want:?}");
    got.iter().zip(want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max)
}

#[test]
fn plans_read_the_same_token_batches_and_train_like_one_process() {
    let f = files();
    let want = reference();
    let want_loss = field(want, "steps", "loss");
    let want_eval = field(want, "eval", "loss");
    assert_eq!(field(want, "eval", "step"), vec![0.0, 3.0, 6.0]);
    for (name, cluster, nproc, flags) in [
        ("pp2", "cpu:2", 2, &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4"][..]),
        ("dp2", "cpu:2", 2, &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "0", "--microbatches", "2"][..]),
        ("one", "cpu:1", 1, &["--pp", "1", "--tp", "1", "--dp", "1", "--microbatches", "4"][..]),
        // forward-only validation through ZeRO-3 gathers and tensor-parallel shards
        ("dp2-zero3", "cpu:2", 2, &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "3", "--microbatches", "2"][..]),
        ("tp2", "cpu:2", 2, &["--pp", "1", "--tp", "2", "--dp", "1", "--microbatches", "4", "--baseline", "megatron"][..]),
    ] {
        let p = plan(&f.dir, name, cluster, flags);
        let r = runner().args(["launch", "--nproc", &nproc.to_string()]).arg(&p).args(run_args(f)).args(["--timeout", "120"]).output().unwrap();
        let got = json(&ok(&format!("launch of {name}"), r));
        let (loss, eval) = (field(&got, "steps", "loss"), field(&got, "eval", "loss"));
        let (wl, we) = (max_rel(&loss, &want_loss), max_rel(&eval, &want_eval));
        eprintln!("{name}: max relative difference {wl:.3e} (losses), {we:.3e} (validation)");
        assert!(wl <= 1e-9, "{name}: losses {loss:?} vs one process {want_loss:?}");
        assert!(we <= 1e-9, "{name}: validation {eval:?} vs one process {want_eval:?}");
        assert_eq!(field(&got, "steps", "lr"), field(want, "steps", "lr"), "{name}: learning rates");
    }
}

/// Token ids of window `w` of `tokens` as a [1, SEQ] row.
fn window(tokens: &[u16], w: usize) -> Vec<i64> {
    tokens[w * SEQ..(w + 1) * SEQ].iter().map(|&t| i64::from(t)).collect()
}

fn write_batch(path: &Path, rows: &[Vec<i64>]) {
    let flat: Vec<i64> = rows.concat();
    let t = Tensor::from_slice(&flat).reshape([rows.len() as i64, SEQ as i64]);
    smp_partition::runtime::formats::npz::write_npz(path, &[("input_ids".into(), t, None)]).unwrap();
}

#[test]
fn the_first_step_reads_the_seeded_first_batch_and_later_steps_read_others() {
    let f = files();
    let want = field(reference(), "steps", "loss");
    // the windows of step 1, by the order's definition
    let rows: Vec<Vec<i64>> =
        (0..BATCH as u64).map(|j| window(&f.tokens, data::sample_window(Order::Shuffled { seed: 3 }, j, WINDOWS as u64) as usize)).collect();
    let npz = f.dir.join("first.npz");
    write_batch(&npz, &rows);
    let r = runner()
        .arg("train")
        .arg(model())
        .args(["--data", npz.to_str().unwrap(), "--microbatches", "4", "--steps", "2", "--dtype", "f64", "--threads", "1", "--json"])
        .args(["--lr-schedule", "cosine", "--warmup-steps", "2", "--min-lr", "1e-4", "--seed", SEED])
        .output()
        .unwrap();
    let fixed = field(&json(&ok("fixed-batch run", r)), "steps", "loss");
    assert_eq!(fixed[0], want[0], "step 1 of the stream is the seeded first batch");
    assert!((fixed[1] - want[1]).abs() > 1e-6, "step 2 of the stream reads a new batch: {fixed:?} vs {want:?}");
    // another seed, another order
    let r = runner()
        .arg("train")
        .arg(model())
        .args(["--batch", "8", "--seq-len", "16", "--microbatches", "4", "--steps", "1", "--dtype", "f64", "--json", "--seed", "4"])
        .args(["--data", f.train.to_str().unwrap()])
        .output()
        .unwrap();
    let other = field(&json(&ok("seed-4 run", r)), "steps", "loss");
    assert!((other[0] - want[0]).abs() > 1e-6, "seed 4 reads other samples than seed 3");
}

fn stream(path: &Path, seed: u64) -> DataSource {
    let graph = smp_partition::frontend::onnx::load_model(&model()).unwrap().graph;
    let weights = smp_partition::runtime::Weights::load(&graph, smp_partition::runtime::InitMode::Random { seed: 0 }, None).unwrap();
    let exec = smp_partition::runtime::Executor::new(&graph, weights, smp_partition::runtime::ExecOptions { float_kind: None, training: false, autocast: None }).unwrap();
    let file = TokenFile::open(path).unwrap();
    DataSource::Tokens(TokenStream::new(file, &exec, SEQ as i64, BATCH as i64, Order::Shuffled { seed }).unwrap())
}

fn ids(mbs: &[Vec<(String, Tensor)>]) -> Tensor {
    let parts: Vec<Tensor> = mbs.iter().map(|mb| mb.iter().find(|(n, _)| n == "input_ids").unwrap().1.shallow_clone()).collect();
    Tensor::cat(&parts, 0)
}

#[test]
fn the_sample_order_depends_on_seed_and_step_alone() {
    let f = files();
    let (a, b, c) = (stream(&f.train, 3), stream(&f.train, 3), stream(&f.train, 5));
    let mut seen: Vec<Vec<i64>> = Vec::new();
    for k in 1..=WINDOWS / BATCH {
        let whole = ids(&a.replica_microbatches(k, 0, 1, 4).unwrap());
        // two replicas of two microbatches, and four of one, tile the global batch
        for dp in [2, 4] {
            let shares: Vec<Vec<(String, Tensor)>> = (0..dp).flat_map(|d| a.replica_microbatches(k, d, dp, BATCH / dp / 2).unwrap()).collect();
            assert!(ids(&shares).equal(&whole), "step {k}: dp {dp} shares differ from the global batch");
        }
        assert!(ids(&b.replica_microbatches(k, 0, 1, 1).unwrap()).equal(&whole), "a second stream of seed 3 agrees at step {k}");
        assert!(!ids(&c.replica_microbatches(k, 0, 1, 1).unwrap()).equal(&whole), "seed 5 differs at step {k}");
        seen.extend((0..BATCH as i64).map(|i| Vec::<i64>::try_from(whole.get(i)).unwrap()));
    }
    // the first epoch visits every window once
    let mut all: Vec<Vec<i64>> = (0..WINDOWS).map(|w| window(&f.tokens, w)).collect();
    all.sort();
    seen.sort();
    assert_eq!(seen, all);
}

fn ce_of_logits(logits: &Tensor, ids: &Tensor) -> f64 {
    let (_, s, v) = logits.size3().unwrap();
    let pred = logits.narrow(1, 0, s - 1).reshape([-1, v]);
    let target = ids.narrow(1, 1, s - 1).reshape([-1]).to_kind(Kind::Int64);
    pred.cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::Mean, -100, 0.0).double_value(&[])
}

#[test]
fn validation_loss_is_a_forward_pass_on_the_validation_batches() {
    let f = files();
    let got = field(reference(), "eval", "loss");
    // step 0: the initial weights on batches 1 and 2 of the validation file, in file order
    let mut sum = 0.0;
    for k in 0..2 {
        let rows: Vec<Vec<i64>> = (0..BATCH).map(|b| window(&f.val_tokens, k * BATCH + b)).collect();
        let (inputs, outputs) = (f.dir.join(format!("val{k}.npz")), f.dir.join(format!("val{k}.out.npz")));
        write_batch(&inputs, &rows);
        let r = runner().arg("eval").arg(model()).args(["--dtype", "f64", "--inputs"]).arg(&inputs).arg("--outputs").arg(&outputs).output().unwrap();
        ok("eval", r);
        let outs = smp_partition::runtime::formats::npz::read_npz(&outputs).unwrap();
        let logits = &outs.iter().find(|(n, _)| n == "logits").unwrap().1;
        let ids = Tensor::from_slice(&rows.concat()).reshape([BATCH as i64, SEQ as i64]);
        sum += ce_of_logits(logits, &ids);
    }
    let want = sum / 2.0;
    assert!(((got[0] - want) / want).abs() < 1e-12, "validation before training {} vs forward pass {want}", got[0]);
    assert!(got.iter().skip(1).all(|&l| (l - got[0]).abs() > 1e-9), "later validations see trained weights: {got:?}");
}

fn python() -> PathBuf {
    std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv/bin/python"))
}

/// PyTorch's learning rates per step for each schedule: warm-up `LinearLR(1/W, 1, W−1)` then
/// `CosineAnnealingLR(T−W, min)` / `LinearLR(1, min/base, T−W)` / constant, chained by
/// `SequentialLR`, stepped after each optimizer step.
const ORACLE: &str = r#"
import json, sys, warnings
import torch
from torch.optim import lr_scheduler as L
warnings.simplefilter("ignore")
out = []
for c in json.loads(sys.argv[1]):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=c["base"])
    W, T, base, lo = c["warmup"], c["total"], c["base"], c["min"]
    if c["shape"] == "cosine":
        after = lambda: L.CosineAnnealingLR(opt, T_max=T - W, eta_min=lo)
    elif c["shape"] == "linear":
        after = lambda: L.LinearLR(opt, start_factor=1.0, end_factor=lo / base, total_iters=T - W)
    else:
        after = lambda: L.LambdaLR(opt, lambda _: 1.0)
    if W > 0:
        warm = L.LinearLR(opt, start_factor=1.0 / W, end_factor=1.0, total_iters=W - 1)
        sched = L.SequentialLR(opt, [warm, after()], milestones=[W])
    else:
        sched = after()
    lrs = []
    for _ in range(T):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    out.append(lrs)
print(json.dumps(out))
"#;

#[test]
fn lr_schedules_equal_pytorchs() {
    let cases = [
        (LrShape::Cosine, "cosine", 3, 12, 1e-3, 1e-4),
        (LrShape::Cosine, "cosine", 0, 7, 2e-3, 0.0),
        (LrShape::Linear, "linear", 2, 10, 1e-3, 0.0),
        (LrShape::Linear, "linear", 4, 9, 5e-4, 5e-5),
        (LrShape::Constant, "constant", 4, 8, 1e-3, 0.0),
    ];
    let spec: Vec<serde_json::Value> = cases
        .iter()
        .map(|&(_, name, w, t, base, min)| serde_json::json!({"shape": name, "warmup": w, "total": t, "base": base, "min": min}))
        .collect();
    let r = Command::new(python()).args(["-c", ORACLE, &serde_json::to_string(&spec).unwrap()]).output().expect("run the .venv's python");
    let want: Vec<Vec<f64>> = serde_json::from_slice(&ok("the PyTorch oracle", r).stdout).unwrap();
    for (&(shape, name, warmup, total, base, min_lr), want) in cases.iter().zip(&want) {
        let s = LrSchedule { shape, base, warmup, min_lr, total };
        let got: Vec<f64> = (1..=total).map(|k| s.lr(k)).collect();
        for (k, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-12 * base, "{name} W={warmup} T={total}: step {} lr {g} vs PyTorch {w}", k + 1);
        }
    }
    // a run reports the rates it used
    let lrs = field(reference(), "steps", "lr");
    let s = LrSchedule { shape: LrShape::Cosine, base: 1e-3, warmup: 2, min_lr: 1e-4, total: STEPS };
    assert_eq!(lrs, (1..=STEPS).map(|k| s.lr(k)).collect::<Vec<_>>());
}

#[test]
fn prepare_data_holds_out_every_kth_file_deterministically() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    // created in reverse order: the split follows sorted paths, not the directory listing
    let mut names: Vec<String> = (0..9).map(|i| format!("f{i}.txt")).collect();
    names.push("sub/g.txt".into());
    for (i, n) in names.iter().enumerate().rev() {
        std::fs::write(src.join(n), format!("file {i}: {}\n", "x".repeat(i))).unwrap();
    }
    std::fs::write(src.join("notes.md"), "skipped by --ext").unwrap();
    let prepare = |out: &Path, inputs: &[PathBuf]| {
        let r = runner().arg("prepare-data").args(inputs).arg("-o").arg(out).args(["--val-fraction", "0.25", "--ext", "txt"]).output().unwrap();
        ok("prepare-data", r);
    };
    let (a, b) = (tmp.path().join("a.bin"), tmp.path().join("b.bin"));
    prepare(&a, std::slice::from_ref(&src));
    let mut listed: Vec<PathBuf> = names.iter().map(|n| src.join(n)).collect();
    listed.reverse();
    prepare(&b, &listed);
    let read = |p: &Path| std::fs::read(p).unwrap();
    assert_eq!(read(&a), read(&b), "training files differ between two runs");
    assert_eq!(read(&data::val_path(&a)), read(&data::val_path(&b)), "validation files differ between two runs");
    // sorted: f0..f8, sub/g; k = 4 holds out files 3 and 7
    let mut sorted: Vec<PathBuf> = names.iter().map(|n| src.join(n)).collect();
    sorted.sort();
    let as_tokens = |files: &[&PathBuf]| -> Vec<u8> { files.iter().flat_map(|p| read(p)).flat_map(|b| u16::from(b).to_le_bytes()).collect() };
    let val: Vec<&PathBuf> = vec![&sorted[3], &sorted[7]];
    let train: Vec<&PathBuf> = sorted.iter().enumerate().filter(|(i, _)| i % 4 != 3).map(|(_, p)| p).collect();
    assert_eq!(read(&data::val_path(&a)), as_tokens(&val));
    assert_eq!(read(&a), as_tokens(&train));
    let side: serde_json::Value = serde_json::from_slice(&read(&data::sidecar_path(&a))).unwrap();
    assert_eq!(side["dtype"], "uint16");
    assert_eq!(side["tokens"].as_u64().unwrap() as usize, read(&a).len() / 2);
    // 10 files cannot hold out every 20th
    let e = refused(&["prepare-data", src.to_str().unwrap(), "-o", tmp.path().join("c.bin").to_str().unwrap(), "--val-fraction", "0.05"]);
    assert!(e.contains("--val-fraction 0.05") && e.contains("every 20-th") && e.contains("only 11 files"), "{e}");
    // the file trains
    let r = runner().arg("train").arg(model()).args(["--data", a.to_str().unwrap(), "--batch", "2", "--seq-len", "8", "--steps", "1"]).output().unwrap();
    ok("training on the prepared file", r);
}

/// Trains a small byte-level BPE tokenizer with Hugging Face's `tokenizers` (Python), writes
/// its tokenizer.json and the ids it gives each file, and checks that `prepare-data
/// --tokenizer` writes exactly those ids, file after file in sorted order.
const TOKENIZER_ORACLE: &str = r#"
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
files, out = json.loads(sys.argv[1]), sys.argv[2]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(files, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
tok.save(out)
ids = {f: tok.encode(open(f, encoding="utf-8", errors="replace").read(), add_special_tokens=False).ids for f in files}
print(json.dumps({"vocab": tok.get_vocab_size(), "ids": ids}))
"#;

#[test]
fn prepare_data_with_a_tokenizer_json_writes_the_ids_hugging_face_gives() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let stdlib = ["json/decoder.py", "textwrap.py", "colorsys.py", "bisect.py"];
    let mut files = Vec::new();
    for (i, rel) in stdlib.iter().enumerate() {
        let text = std::fs::read_to_string(Path::new("/usr/lib/python3.11").join(rel))
            .unwrap_or_else(|_| format!("def f{i}(x):\n    return x * {i}  # ünïcode ✓\n").repeat(50));
        let p = src.join(format!("{i}.py"));
        std::fs::write(&p, text).unwrap();
        files.push(p.display().to_string());
    }
    let tokenizer = tmp.path().join("tokenizer.json");
    let r = Command::new(python()).args(["-c", TOKENIZER_ORACLE, &serde_json::to_string(&files).unwrap()]).arg(&tokenizer).output().unwrap();
    let oracle: serde_json::Value = serde_json::from_slice(&ok("training a tokenizer in Python", r).stdout).unwrap();
    let out = tmp.path().join("tok.bin");
    let r = runner().arg("prepare-data").arg(&src).arg("-o").arg(&out).arg("--tokenizer").arg(&tokenizer).args(["--val-fraction", "0.25"]).output().unwrap();
    ok("prepare-data --tokenizer", r);
    let ids = |bin: &Path| -> Vec<u64> { std::fs::read(bin).unwrap().chunks(2).map(|c| u64::from(u16::from_le_bytes([c[0], c[1]]))).collect() };
    let want = |fs: &[&String]| -> Vec<u64> { fs.iter().flat_map(|f| oracle["ids"][f.as_str()].as_array().unwrap().iter().map(|v| v.as_u64().unwrap())).collect() };
    // sorted 0..3.py, k = 4: 3.py is held out
    assert_eq!(ids(&out), want(&[&files[0], &files[1], &files[2]]), "training ids differ from Hugging Face's");
    assert_eq!(ids(&data::val_path(&out)), want(&[&files[3]]), "validation ids differ from Hugging Face's");
    let side: serde_json::Value = serde_json::from_slice(&std::fs::read(data::sidecar_path(&out)).unwrap()).unwrap();
    assert_eq!((side["dtype"].as_str(), side["vocab_size"].as_u64()), (Some("uint16"), oracle["vocab"].as_u64()));
    assert!(ids(&out).len() < files[..3].iter().map(|f| std::fs::metadata(f).unwrap().len() as usize).sum::<usize>(), "BPE merges bytes");
    // a file that is not a tokenizer is refused, naming it
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, "{}").unwrap();
    let e = refused(&["prepare-data", src.to_str().unwrap(), "-o", out.to_str().unwrap(), "--tokenizer", bad.to_str().unwrap()]);
    assert!(e.contains("bad.json") && e.contains("tokenizer.json"), "{e}");
}

/// Runs `smp-runner ARGS`, expects exit status 1 and returns stderr.
fn refused(args: &[&str]) -> String {
    let r = runner().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&r.stderr).into_owned();
    assert_eq!(r.status.code(), Some(1), "{args:?} should fail with status 1: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    err
}

#[test]
fn bad_token_files_and_sequence_lengths_are_refused_naming_the_file_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model();
    let m = m.to_str().unwrap();
    let train = |data: &Path, extra: &[&str]| {
        let mut a = vec!["train", m, "--data", data.to_str().unwrap(), "--batch", "2", "--seq-len", "8", "--steps", "1"];
        a.extend_from_slice(extra);
        refused(&a)
    };
    let bin = |name: &str, bytes: &[u8], sidecar: Option<&str>| {
        let p = tmp.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        if let Some(s) = sidecar {
            std::fs::write(data::sidecar_path(&p), s).unwrap();
        }
        p
    };
    let tokens: Vec<u8> = random_tokens(64, 9).iter().flat_map(|t| t.to_le_bytes()).collect();

    let p = bin("nosidecar.bin", &tokens, None);
    let e = train(&p, &[]);
    assert!(e.contains("nosidecar.bin.json") && e.contains("\"dtype\"") && e.contains("prepare-data"), "{e}");

    let p = bin("int8.bin", &tokens, Some(r#"{"dtype": "int8"}"#));
    let e = train(&p, &[]);
    assert!(e.contains("int8.bin.json") && e.contains("`int8`") && e.contains("uint16"), "{e}");

    let p = bin("notjson.bin", &tokens, Some("dtype=uint16"));
    let e = train(&p, &[]);
    assert!(e.contains("notjson.bin.json") && e.contains("JSON"), "{e}");

    let p = bin("odd.bin", &tokens[..tokens.len() - 2], Some(r#"{"dtype": "uint32"}"#));
    let e = train(&p, &[]);
    assert!(e.contains("odd.bin") && e.contains("uint32") && e.contains("truncated"), "{e}");

    let p = bin("short.bin", &tokens, Some(r#"{"dtype": "uint16", "tokens": 100}"#));
    let e = train(&p, &[]);
    assert!(e.contains("short.bin") && e.contains("64") && e.contains("100"), "{e}");

    let big: Vec<u8> = (0..64u32).flat_map(|i| (if i == 37 { 300 } else { i }).to_le_bytes()).collect();
    let p = bin("vocab.bin", &big, Some(r#"{"dtype": "uint32"}"#));
    // one step of 8 samples reads all 8 windows
    let e = refused(&["train", m, "--data", p.to_str().unwrap(), "--batch", "8", "--seq-len", "8", "--steps", "1"]);
    assert!(e.contains("vocab.bin") && e.contains("300") && e.contains("vocabulary of 256"), "{e}");

    let p = bin("few.bin", &tokens[..10], Some(r#"{"dtype": "uint16"}"#));
    let e = train(&p, &[]);
    assert!(e.contains("few.bin") && e.contains("fewer than one sample"), "{e}");

    let p = bin("ok.bin", &tokens, Some(r#"{"dtype": "uint16"}"#));
    let e = train(&p, &["--loss", "mse"]);
    assert!(e.contains("ok.bin") && e.contains("--loss causal-lm"), "{e}");

    let e = refused(&["train", m, "--eval-every", "2", "--steps", "1"]);
    assert!(e.contains("--eval-data"), "{e}");

    // a plan made for sequence length 16, run at 32
    let plan = plan(tmp.path(), "seq16", "cpu:1", &["--pp", "1", "--tp", "1", "--dp", "1"]);
    let e = refused(&["run", plan.to_str().unwrap(), "--data", p.to_str().unwrap(), "--seq-len", "32", "--steps", "1"]);
    assert!(e.contains("--seq-len 32") && e.contains("seq16.json") && e.contains("sequence length 16") && e.contains("re-plan"), "{e}");
}

#[test]
fn progress_is_one_line_on_a_terminal_and_plain_lines_otherwise() {
    let f = files();
    let args = |steps: &str| {
        let mut a = vec!["train".to_string(), model().display().to_string(), "--data".into(), f.train.display().to_string()];
        a.extend(["--batch", "2", "--seq-len", "16", "--steps", steps, "--threads", "1"].map(String::from));
        a
    };
    // not a terminal: one plain line per step
    let r = ok("plain run", runner().args(args("3")).output().unwrap());
    let err = String::from_utf8_lossy(&r.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(lines[2].contains("loss") && lines[2].contains("lr 1.000e-3") && !err.contains("tok/s"), "{err}");
    // a terminal (a pty from `script`): the bar, with step, loss, lr, tokens/s and ETA
    let Ok(script) = which_script() else {
        eprintln!("SKIPPED the terminal half: no `script` command to give the run a pty");
        return;
    };
    let cmd = std::iter::once(env!("CARGO_BIN_EXE_smp-runner").to_string()).chain(args("4")).collect::<Vec<_>>().join(" ");
    let r = ok("run on a pty", Command::new(script).args(["-qec", &cmd, "/dev/null"]).output().unwrap());
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(out.contains("step 4/4") && out.contains("tok/s") && out.contains("lr 1.00e-3") && out.contains(" < "), "{out}");
    assert!(!out.contains("step    1  loss"), "plain lines on a terminal: {out}");
}

fn which_script() -> Result<PathBuf, ()> {
    ["/usr/bin/script", "/bin/script"].iter().map(PathBuf::from).find(|p| p.exists()).ok_or(())
}

/// A data file whose array is not named as the model's input: the run refuses it naming the
/// input, the arrays the file has and the fix, one process and a pipeline's ranks alike (the
/// array was dropped as not the model's, and the message used to list none).
#[test]
fn an_array_named_unlike_the_input_is_refused_naming_both() {
    let f = files();
    let npz = f.dir.join("misnamed.npz");
    let t = Tensor::from_slice(&window(&f.tokens, 0)).reshape([1, SEQ as i64]).repeat([BATCH as i64, 1]);
    smp_partition::runtime::formats::npz::write_npz(&npz, &[("ids".into(), t, None)]).unwrap();
    let said = |what: &str, r: std::process::Output| {
        let err = String::from_utf8_lossy(&r.stderr).into_owned();
        assert!(!r.status.success(), "{what}: {err}");
        assert!(err.contains("input_ids") && err.contains("the data has [\"ids\"]") && err.contains("name the array `input_ids`"), "{what}: {err}");
    };
    let r = runner().arg("train").arg(model()).args(["--data", npz.to_str().unwrap(), "--steps", "1", "--threads", "1"]).output().unwrap();
    said("train", r);
    let p = plan(&f.dir, "misnamed-pp2", "cpu:2", &["--pp", "2", "--tp", "1", "--dp", "1", "--microbatches", "2"]);
    let r = runner().args(["launch", "--nproc", "2"]).arg(&p).args(["--data", npz.to_str().unwrap(), "--steps", "1", "--threads", "1"]).output().unwrap();
    said("launch", r);
}
