//! The fuzzing harness's inputs replayed (docs/fuzzing.md):
//! - every crash the fuzzer found, kept under `tests/data/fuzz-regressions/TARGET/`, and every
//!   committed seed of `fuzz/corpus/TARGET/`, goes through the target's entry points (the ones
//!   `fuzz/targets.rs` runs, the binaries' library calls) and is accepted or refused with an
//!   error, never a panic; a regression with a `NAME.expect` file is refused with that text;
//! - a few regressions go through the binaries themselves: exit status 1 and a message naming
//!   the file, never a panic (exit 101).
#![cfg(feature = "runner")]

#[allow(dead_code)] // the fuzzer's parts these tests do not call
#[path = "../fuzz/case.rs"]
mod case;
#[allow(dead_code)]
#[path = "../fuzz/targets.rs"]
mod targets;

use std::path::{Path, PathBuf};
use std::process::Command;

use case::Case;
use targets::{Env, TARGETS};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The stored inputs of one kind (`fuzz-regressions` or `corpus`) of `target`, without the
/// `.expect` files.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).collect();
    out.retain(|p| p.extension().is_none_or(|e| e != "expect" && e != "md"));
    out.sort();
    out
}

#[test]
fn every_regression_and_seed_is_accepted_or_refused_never_a_panic() {
    let scratch = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut replayed = 0;
    for target in TARGETS {
        let mut env = Env::new(&repo(), scratch.path());
        let regressions = inputs(&repo().join("tests/data/fuzz-regressions").join(target.name));
        let seeds = inputs(&repo().join("fuzz/corpus").join(target.name));
        for path in regressions.iter().chain(&seeds) {
            let case = Case::read(path, target.default_file).unwrap_or_else(|| panic!("{}: unreadable", path.display()));
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (target.run)(&mut env, &case)));
            replayed += 1;
            let expect = std::fs::read_to_string(format!("{}.expect", path.display())).ok();
            match (outcome, expect) {
                (Err(_), _) => failures.push(format!("{}: panicked", path.display())),
                (Ok(Ok(())), Some(want)) => failures.push(format!("{}: accepted, expected a refusal with `{want}`", path.display())),
                (Ok(Err(msg)), Some(want)) if !msg.contains(want.trim()) => {
                    failures.push(format!("{}: refused with `{msg}`, expected `{want}`", path.display()))
                }
                _ => {}
            }
        }
    }
    assert!(replayed >= 10, "only {replayed} inputs found");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Runs a binary; it must exit 1 with `expect` on stderr and not panic.
fn refused(bin: &str, args: &[&str], expect: &str) {
    let out = Command::new(bin).args(args).current_dir(repo()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(stderr.contains(expect), "{args:?}: `{expect}` not in: {stderr}");
}

#[test]
fn regressions_through_the_binaries_exit_1_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let regressions = repo().join("tests/data/fuzz-regressions");
    let planner = env!("CARGO_BIN_EXE_smp-partition");
    let runner = env!("CARGO_BIN_EXE_smp-runner");
    let onnx = regressions.join("onnx/reduceprod-scalar-into-concat.onnx");
    refused(planner, &["graph", onnx.to_str().unwrap()], "node `concat` (Concat)");
    let plan = regressions.join("plan/node-ranges-overlapping-past-the-graph.json");
    refused(planner, &["inspect", plan.to_str().unwrap()], "is listed twice");
    // the batch regression is an archived case: its one file written out as a `.npy`
    let case = Case::read(&regressions.join("batch/npy-shape-past-its-data.case"), "batch.npz").unwrap();
    let npy = dir.path().join("batch.npy");
    std::fs::write(&npy, case.get("batch.npy").unwrap()).unwrap();
    refused(runner, &["train", "models/gpt2.onnx", "--steps", "1", "--data", npy.to_str().unwrap()], "needs 16777216 bytes of data");
    // a cluster file whose `[machine]` names /dev/zero as its calibration
    let case = Case::read(&regressions.join("cluster/calibration-names-dev-zero.case"), "cluster.toml").unwrap();
    case.write_to(&dir.path().join("cluster"), &mut Vec::new()).unwrap();
    let cluster = dir.path().join("cluster/cluster.toml");
    refused(planner, &["models/gpt2.onnx", "--seq-len", "16", "--cluster", cluster.to_str().unwrap()], "is not a regular file");
}
