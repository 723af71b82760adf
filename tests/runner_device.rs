//! `--device` and `--share-gpu` at the front door (`train`, `run`, `eval`, `launch`): on a
//! machine whose GPU libtorch does not see, `--device cuda` is refused naming the flag and what
//! libtorch sees, before anything runs (`launch` refuses once, before starting ranks); the
//! default and `--device cpu` are the CPU run of before, to the last bit, and `--share-gpu`
//! changes nothing on the CPU. (The GPU path itself is checked by scripts/gpu-check.sh on a
//! GPU machine.)
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};

use common::runner::{field, json, ok, plan_into, runner};
use smp_partition::runtime::device::CudaView;

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx")
}

/// Whether libtorch sees a GPU here (then the refusals below cannot happen).
fn gpu_here() -> bool {
    CudaView::probe().gpus > 0
}

const SMALL: [&str; 8] = ["--steps", "3", "--batch", "4", "--seq-len", "16", "--threads", "1"];

fn stderr(r: &std::process::Output) -> String {
    String::from_utf8_lossy(&r.stderr).into_owned()
}

fn losses(r: std::process::Output, what: &str) -> Vec<f64> {
    field(&json(&ok(what, r)), "steps", "loss")
}

#[test]
fn cuda_without_a_gpu_is_refused_naming_the_flag_and_what_libtorch_sees() {
    if gpu_here() {
        eprintln!("skipped: libtorch sees a GPU on this machine");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.npz");
    let io = model().with_extension("io.npz");
    let runs = [
        runner().arg("train").arg(model()).args(SMALL).args(["--device", "cuda"]).output().unwrap(),
        runner().arg("eval").arg(model()).arg("--inputs").arg(&io).arg("--outputs").arg(&out).args(["--device", "cuda"]).output().unwrap(),
        // --share-gpu does not make a GPU appear
        runner().arg("train").arg(model()).args(SMALL).args(["--device", "cuda", "--share-gpu"]).output().unwrap(),
    ];
    for r in runs {
        let e = stderr(&r);
        assert_eq!(r.status.code(), Some(1), "{e}");
        assert!(e.contains("--device cuda: libtorch sees no GPU") && e.contains("--device cpu"), "{e}");
    }
    assert!(!out.exists(), "eval wrote outputs after refusing");
}

#[test]
fn launch_refuses_cuda_once_before_starting_ranks() {
    if gpu_here() {
        eprintln!("skipped: libtorch sees a GPU on this machine");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_into(&model(), "cpu:2", &["--seq-len", "16", "--global-batch", "4", "--pp", "2", "--microbatches", "2"], &dir.path().join("pp2.json"));
    let r = runner().args(["launch", "--nproc", "2", "--device", "cuda"]).arg(&plan).args(SMALL).output().unwrap();
    let e = stderr(&r);
    assert_eq!(r.status.code(), Some(1), "{e}");
    assert!(e.contains("--device cuda: libtorch sees no GPU"), "{e}");
    assert!(!e.contains("rank 0: pid"), "ranks were started: {e}");
    // the same flag twice (launch's and the ranks') is refused
    let r = runner().args(["launch", "--nproc", "2", "--device", "cpu"]).arg(&plan).args(SMALL).args(["--device", "cpu"]).output().unwrap();
    assert_eq!(r.status.code(), Some(1), "{}", stderr(&r));
    assert!(stderr(&r).contains("give them once"), "{}", stderr(&r));
}

#[test]
fn a_device_outside_cpu_and_cuda_is_a_usage_error() {
    let r = runner().arg("train").arg(model()).args(["--device", "gpu"]).output().unwrap();
    assert_eq!(r.status.code(), Some(2));
    assert!(stderr(&r).contains("expected cpu or cuda"), "{}", stderr(&r));
}

fn train(extra: &[&str]) -> Vec<f64> {
    losses(runner().arg("train").arg(model()).args(SMALL).arg("--json").args(extra).output().unwrap(), &format!("train {extra:?}"))
}

#[test]
fn cpu_is_the_run_of_before_and_share_gpu_changes_nothing_there() {
    let cpu = train(&["--device", "cpu"]);
    assert_eq!(cpu.len(), 3);
    assert_eq!(train(&["--device", "cpu", "--share-gpu"]), cpu);
    if !gpu_here() {
        // the default is the CPU where libtorch sees no GPU
        assert_eq!(train(&[]), cpu);
        assert_eq!(train(&["--share-gpu"]), cpu);
    }
}

fn launch(plan: &Path, launch_flags: &[&str], rank_flags: &[&str]) -> Vec<f64> {
    let r = runner().args(["launch", "--nproc", "2"]).args(launch_flags).arg(plan).args(SMALL).arg("--json").args(rank_flags).output().unwrap();
    losses(r, &format!("launch {launch_flags:?} {rank_flags:?}"))
}

#[test]
fn a_pipeline_on_the_cpu_is_the_same_with_device_flags_on_launch_or_its_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan_into(&model(), "cpu:2", &["--seq-len", "16", "--global-batch", "4", "--pp", "2", "--microbatches", "2"], &dir.path().join("pp2.json"));
    let base = launch(&plan, &[], &["--device", "cpu"]);
    assert_eq!(base.len(), 3);
    assert_eq!(launch(&plan, &["--device", "cpu", "--share-gpu"], &[]), base);
    assert_eq!(launch(&plan, &[], &["--device", "cpu", "--share-gpu"]), base);
}
