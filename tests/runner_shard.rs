//! Only-own-shard weights (docs/checkpoints.md, "Only-own-shard weights"), on the GPT-2 export
//! under pp2, tp2 (Megatron split), pp2×tp2 and dp2 with ZeRO 3:
//! - each rank reads exactly the parameter bytes it holds (the loader's count equals the bytes
//!   of the parameter tensors the rank holds after training, measured separately), and less
//!   than the whole model where its stages or shards are a part of it;
//! - the parts equal the whole-tensor path: every part (a tensor-parallel cut, a ZeRO block of
//!   it) read alone equals, bit for bit, that part of the whole tensor, from the model file and
//!   from `--init random`; the losses of pp2×tp2 and dp2 ZeRO 3 runs equal a one-process
//!   `train`'s (which loads whole tensors) within 1e-12 in f64;
//! - resuming reads only the parts too: a pp2×tp2 rank resumed from a one-process checkpoint
//!   reads what it holds, and continues as the one-process run does.
#![cfg(feature = "runner")]

mod common;

use common::runner::{field, json, ok, runner};

use std::path::{Path, PathBuf};
use std::process::Command;

use smp_partition::frontend::onnx::load_model;
use smp_partition::passes::params;
use smp_partition::passes::figures::is_trainable;
use smp_partition::runtime::state::weights::{Slice, Source};
use smp_partition::runtime::{InitMode, Weights};
use tch::{Kind, Tensor};

const SEQ: &str = "16";
const BATCH: &str = "8";

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx")
}

fn plan(dir: &Path, name: &str) -> (PathBuf, usize) {
    let (cluster, nproc, flags): (&str, usize, Vec<&str>) = match name {
        "pp2" => ("cpu:2", 2, vec!["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "2"]),
        "tp2" => ("cpu:2", 2, vec!["--pp", "1", "--tp", "2", "--dp", "1", "--microbatches", "2", "--baseline", "megatron"]),
        "pp2tp2" => ("cpu:4", 4, vec!["--pp", "2", "--tp", "2", "--dp", "1", "--schedule", "1f1b", "--microbatches", "2", "--baseline", "megatron"]),
        "dp2-zero3" => ("cpu:2", 2, vec!["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "3", "--microbatches", "2"]),
        other => panic!("no plan `{other}`"),
    };
    let out = dir.join(format!("{name}.json"));
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .arg(model())
        .args(["--cluster", &common::cluster_arg(cluster), "--seq-len", SEQ, "--global-batch", BATCH, "-o"])
        .arg(&out)
        .args(&flags)
        .output()
        .unwrap();
    ok(&format!("planning {name}"), r);
    (out, nproc)
}

/// Bytes of the model's trained parameters, from the model file.
fn model_param_bytes() -> u64 {
    let mut graph = load_model(&model()).unwrap().graph;
    params::decide(&mut graph, &Default::default()).unwrap();
    graph.initializers().filter(|&v| is_trainable(&graph, v)).map(|v| graph.value(v).data.as_ref().unwrap().nbytes()).sum()
}

fn launch(plan: &Path, nproc: usize, extra: &[&str]) -> serde_json::Value {
    let r = runner()
        .args(["launch", "--nproc", &nproc.to_string()])
        .arg(plan)
        .args(["--threads", "1", "--json", "--timeout", "120", "--seed", "3"])
        .args(extra)
        .output()
        .unwrap();
    json(&ok(&format!("{} {extra:?}", plan.display()), r))
}

#[test]
fn each_rank_reads_exactly_the_parameter_bytes_it_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = model_param_bytes();
    for name in ["pp2", "tp2", "pp2tp2", "dp2-zero3"] {
        let (p, nproc) = plan(tmp.path(), name);
        let report = launch(&p, nproc, &["--steps", "1"]);
        let ranks = report["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), nproc);
        for (r, st) in ranks.iter().enumerate() {
            let read = st["weight_bytes_read"]["params"].as_u64().unwrap();
            let held = st["resident_param_bytes"].as_u64().unwrap();
            assert!(held > 0, "{name} rank {r} holds no parameters");
            assert_eq!(read, held, "{name} rank {r}: read {read} parameter bytes but holds {held}");
            // every plan here cuts the model in two (or four): no rank reads it whole
            assert!(read * 10 < whole * 6, "{name} rank {r} read {read} of the model's {whole} parameter bytes");
        }
    }
}

#[test]
fn every_part_a_rank_reads_equals_that_part_of_the_whole_tensor() {
    let mut graph = load_model(&model()).unwrap().graph;
    params::decide(&mut graph, &Default::default()).unwrap();
    for mode in [InitMode::Load, InitMode::Random { seed: 3 }] {
        let whole = Weights::load(&graph, mode, Some(Kind::Double)).unwrap();
        let source = Source::new(&graph, mode, Some(Kind::Double));
        let mut expected = 0u64;
        for v in graph.initializers().filter(|&v| is_trainable(&graph, v)) {
            let w = &whole.tensors[&v];
            let dims = w.size();
            let axis = dims.len() - 1;
            let d = dims[axis] as u64;
            // a tensor-parallel cut of two ranges along the last axis, then a ZeRO block of it
            let ranges = vec![[0, d / 4], [d / 2, d / 2 + d / 4]];
            let cut = Tensor::cat(&[w.narrow(axis as i64, 0, (d / 4) as i64), w.narrow(axis as i64, (d / 2) as i64, (d / 4) as i64)], axis as i64);
            let n = cut.numel() as u64;
            let part = Slice { axis: Some(axis), ranges, flat: Some([n / 3, n / 3 + n / 2]), experts: None };
            let got = source.read(v, &part).unwrap();
            let want = cut.reshape([-1]).narrow(0, (n / 3) as i64, (n / 2) as i64);
            assert!(got.equal(&want), "{mode:?}: `{}`", graph.value(v).name);
            expected += n / 2 * graph.value(v).data.as_ref().unwrap().dtype.size_bytes();
        }
        assert_eq!(source.bytes_read().params, expected, "{mode:?}: the source counts the bytes of the parts alone");
    }
}

/// The step losses of a run (f64, one step per batch).
#[test]
fn the_first_loss_under_every_plan_equals_the_whole_tensor_path() {
    let tmp = tempfile::tempdir().unwrap();
    for init in ["load", "random"] {
        let common = ["--steps", "2", "--dtype", "f64", "--init", init];
        let r = runner().arg("train").arg(model()).args(["--threads", "1", "--seed", "3", "--seq-len", SEQ, "--batch", BATCH, "--json", "--microbatches", "2"]).args(common).output().unwrap();
        let want = field(&json(&ok(&format!("one-process run ({init})"), r)), "steps", "loss");
        for name in ["pp2tp2", "dp2-zero3"] {
            let (p, nproc) = plan(tmp.path(), name);
            let got = field(&launch(&p, nproc, &common), "steps", "loss");
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 1e-12, "{name}, --init {init}, step {}: {a} vs the one-process {b}", k + 1);
            }
        }
    }
}

#[test]
fn a_resumed_rank_reads_only_its_parts_of_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    let args = ["--threads", "1", "--seed", "3", "--dtype", "f64", "--json", "--steps", "4"];
    let r = runner().arg("train").arg(model()).args(["--seq-len", SEQ, "--batch", BATCH, "--checkpoint-every", "2", "--checkpoint-dir"]).arg(&one).args(args).output().unwrap();
    let all = field(&json(&ok("one-process run", r)), "steps", "loss");
    let (p, nproc) = plan(tmp.path(), "pp2tp2");
    let from = one.join("step-00000002");
    let report = launch(&p, nproc, &["--resume", from.to_str().unwrap(), "--dtype", "f64", "--steps", "4"]);
    for (r, st) in report["ranks"].as_array().unwrap().iter().enumerate() {
        let read = st["weight_bytes_read"]["params"].as_u64().unwrap();
        let held = st["resident_param_bytes"].as_u64().unwrap();
        assert_eq!(read, held, "resumed pp2×tp2 rank {r}: read {read} parameter bytes but holds {held}");
    }
    let tail = field(&report, "steps", "loss");
    assert_eq!(tail.len(), 2);
    for (k, (a, b)) in tail.iter().zip(&all[2..]).enumerate() {
        assert!((a - b).abs() < 1e-9, "step {}: resumed pp2×tp2 loss {a} vs one process {b}", k + 3);
    }
}
