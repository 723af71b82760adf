//! Faults a long run meets, on one host: a rank killed mid-run (`launch --max-restarts`
//! restarts every rank from the newest complete checkpoint, and the run ends with the losses of
//! the uninterrupted run, bit for bit), a user error (not retried), and a disk that fills while
//! a checkpoint is written (the ranks agree the save failed; the previous checkpoint stays the
//! newest and loadable; the run stops, or goes on under `--on-checkpoint-error continue`).
//! Link faults between hosts are in tests/runner_hosts.rs.
#![cfg(feature = "runner")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::runner::{json, ok, plan_into, runner};
use smp_partition::runtime::state::checkpoint::{self, Loaded};

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx")
}

/// A plan of gpt2 (sequence 16, batch 8) on two CPU ranks.
fn plan(dir: &Path, name: &str, flags: &[&str]) -> PathBuf {
    let args: Vec<&str> = ["--seq-len", "16", "--global-batch", "8"].into_iter().chain(flags.iter().copied()).collect();
    plan_into(&model(), "cpu:2", &args, &dir.join(format!("{name}.json")))
}

const STEPS: usize = 8;

fn run_args() -> Vec<String> {
    ["--steps", &STEPS.to_string(), "--dtype", "f64", "--threads", "1", "--json"].iter().map(|s| s.to_string()).collect()
}

/// Kills rank 1 (SIGKILL) once it has reported step `at`; the launcher, with one restart
/// allowed, resumes every rank from the newest complete checkpoint. Returns the final report
/// and the launcher's stderr.
fn killed_and_restarted(plan: &Path, ckpt: &Path, at: usize) -> (serde_json::Value, Vec<String>) {
    let mut launcher = runner()
        .args(["launch", "--nproc", "2", "--max-restarts", "1", "--restart-backoff", "0"])
        .arg(plan)
        .args(run_args())
        .args(["--progress", "--checkpoint-every", "2", "--keep", "1", "--checkpoint-dir"])
        .arg(ckpt)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    let stderr = launcher.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let mut pid = None;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(300) {
        let Ok(line) = rx.recv_timeout(Duration::from_secs(300)) else { break };
        seen.push(line.clone());
        if let Some(p) = line.strip_prefix("smp-runner launch: rank 1: pid ") {
            pid.get_or_insert(p.trim().to_string());
        }
        let step = line.split("[rank 1] step ").nth(1).and_then(|t| t.split(' ').next()?.parse::<usize>().ok());
        if step.is_some_and(|n| n >= at) {
            break;
        }
    }
    let pid = pid.unwrap_or_else(|| panic!("the launcher named no pid of rank 1: {seen:?}"));
    assert!(Command::new("kill").args(["-9", &pid]).status().unwrap().success());
    let out = launcher.wait_with_output().unwrap();
    seen.extend(rx.iter());
    assert!(out.status.success(), "the restarted run failed ({:?}): {seen:?}", out.status);
    (serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&out.stdout))), seen)
}

fn losses(report: &serde_json::Value) -> Vec<(usize, f64)> {
    report["steps"].as_array().unwrap().iter().map(|s| (s["step"].as_u64().unwrap() as usize, s["loss"].as_f64().unwrap())).collect()
}

#[test]
fn a_killed_rank_restarts_from_the_last_checkpoint_with_the_losses_of_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    for (name, flags) in [
        ("pp2", &["--pp", "2", "--tp", "1", "--dp", "1", "--microbatches", "2"][..]),
        ("dp2-zero3", &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "3", "--microbatches", "2"][..]),
    ] {
        let p = plan(dir.path(), name, flags);
        let whole = ok(&format!("{name}: the uninterrupted run"), runner().args(["launch", "--nproc", "2"]).arg(&p).args(run_args()).output().unwrap());
        let want: Vec<(usize, f64)> = losses(&json(&whole));
        assert_eq!(want.len(), STEPS);
        let ckpt = dir.path().join(format!("{name}-ckpt"));
        let (report, log) = killed_and_restarted(&p, &ckpt, 5);
        let restarts = report["restarts"].as_array().unwrap_or_else(|| panic!("{name}: no restarts in {report}"));
        assert_eq!(restarts.len(), 1, "{name}: {report}");
        let cause = restarts[0]["cause"].as_str().unwrap();
        assert!(cause.contains("rank 1") && cause.contains("SIGKILL"), "{name}: {cause}");
        let from = restarts[0]["resumed_from_step"].as_u64().unwrap_or_else(|| panic!("{name}: resumed from no checkpoint: {report}")) as usize;
        assert!(from >= 4 && from % 2 == 0, "{name}: resumed from step {from}");
        assert!(log.iter().any(|l| l.contains("restart 1 of 1") && l.contains(&format!("step {from}"))), "{name}: the restart is logged: {log:?}");
        // the steps after the checkpoint, run again, equal the uninterrupted run's, bit for bit
        let got = losses(&report);
        assert_eq!(got.first().map(|s| s.0), Some(from + 1), "{name}: {got:?}");
        for (step, loss) in &got {
            assert_eq!(loss.to_bits(), want[step - 1].1.to_bits(), "{name}: step {step}: {loss} after the restart, {} uninterrupted", want[step - 1].1);
        }
        assert_eq!(got.last().map(|s| s.0), Some(STEPS));
    }
}

#[test]
fn a_user_error_is_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path(), "pp2", &["--pp", "2", "--tp", "1", "--dp", "1", "--microbatches", "2"]);
    // the plan was made for sequence 16: a run asking 32 is refused before its first step
    let r = runner().args(["launch", "--nproc", "2", "--max-restarts", "3", "--restart-backoff", "0"]).arg(&p).args(["--seq-len", "32", "--steps", "2"]).output().unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("rank 0: pid").count(), 1, "started more than once: {err}");
    assert!(!err.contains("restart"), "{err}");
    assert!(err.contains("--seq-len 32"), "the cause is named: {err}");
}

/// A rendezvous port another process holds: rank 0 says so, naming the port and the fix, and
/// exits with the status a launcher that chose the port retries on (it chooses again; a port
/// the user gave is kept). The retry itself is the launcher's unit test.
#[test]
fn a_taken_rendezvous_port_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path(), "dp2", &["--pp", "1", "--tp", "1", "--dp", "2"]);
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let r = runner().args(["launch", "--nproc", "2", "--master-port", &port]).arg(&p).args(["--steps", "1", "--timeout", "60"]).output().unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("the rendezvous port {port} is in use")) && err.contains("--master-port"), "{err}");
    assert!(err.contains("rank 0 found the rendezvous port taken"), "{err}");
    drop(held);
}

/// A small tmpfs mounted at a temporary directory (root only), unmounted on drop.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn new(bytes: u64) -> Result<SmallDisk, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let r = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("cannot run mount ({e})"))?;
        if !r.status.success() {
            return Err(format!("mount -t tmpfs failed: {}", String::from_utf8_lossy(&r.stderr).trim()));
        }
        Ok(SmallDisk { dir })
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // lazily: a rank that was just stopped may still hold a file open
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

#[test]
fn a_full_disk_during_a_save_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path(), "pp2", &["--pp", "2", "--tp", "1", "--dp", "1", "--microbatches", "2"]);
    // one checkpoint of the f32 run (parameters and two moments of ~225 k elements, ~2.7 MB)
    // fits, a second does not
    let args = |on_error: &str| -> Vec<String> {
        ["--steps", "6", "--threads", "1", "--json", "--checkpoint-every", "2", "--on-checkpoint-error", on_error].iter().map(|s| s.to_string()).collect()
    };
    for on_error in ["stop", "continue"] {
        let disk = match SmallDisk::new(4 << 20) {
            Ok(d) => d,
            Err(why) => panic!("a full disk needs a small tmpfs (root, as CI runs): {why}"),
        };
        let ckpt = disk.dir.path().join("ckpt");
        let r = runner().args(["launch", "--nproc", "2"]).arg(&p).args(args(on_error)).arg("--checkpoint-dir").arg(&ckpt).output().unwrap();
        let err = String::from_utf8_lossy(&r.stderr).into_owned();
        // the rank that could not write says so, with the file
        assert!(err.contains("no space") && err.contains(&ckpt.display().to_string()), "{on_error}: {err}");
        // no partial checkpoint is complete; the one before stays the newest, and loads
        let done = checkpoint::complete(&ckpt);
        assert_eq!(done.iter().map(|d| d.0).collect::<Vec<_>>(), vec![2], "{on_error}: {err}");
        let l = Loaded::open(&ckpt).unwrap_or_else(|e| panic!("{on_error}: the previous checkpoint does not load: {e}"));
        assert_eq!(l.manifest.state.step, 2);
        assert!(!ckpt.join("step-4").exists(), "{on_error}: the failed checkpoint's directory is left behind");
        match on_error {
            "stop" => {
                assert!(!r.status.success(), "{err}");
                assert!(err.contains("checkpoint of step 4 not written"), "{err}");
            }
            _ => {
                assert!(r.status.success(), "{err}");
                let report = json(&r);
                assert_eq!(report["steps"].as_array().unwrap().len(), 6);
                let failed: Vec<u64> = report["failed_checkpoints"].as_array().unwrap().iter().map(|f| f["step"].as_u64().unwrap()).collect();
                assert_eq!(failed, vec![4, 6], "{report}");
            }
        }
        drop(disk);
    }
}
