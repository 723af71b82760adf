//! Elastic training across two hosts (network namespaces joined by a veth pair, as in
//! tests/runner_hosts.rs; two ranks each, Gloo, real processes) under `launch --elastic`:
//! - a host lost at a step (every process in its namespace SIGKILLed): the survivors re-plan
//!   for their devices, resume the newest checkpoint on the new plan, and train on with the
//!   losses of a manual reshard-and-resume of that checkpoint onto that plan, bit for bit;
//!   when the host comes back (a new launcher), the job grows at the next checkpoint the same
//!   way; the data stream resumes at the same sample (the losses stay within f64 rounding of
//!   one process trained without a break);
//! - a rank stopped (SIGSTOP): named hung within the step timeout, then dropped as lost;
//! - a rank slowed (stopped and continued in turn, as `cpulimit` throttles): named a straggler,
//!   no loss changed;
//! - fewer devices left than `--elastic`'s least: the job stops cleanly, its last checkpoint
//!   loadable, saying how many devices were left and the fewest the planner needs;
//! - on one host, `--drop-stragglers 1`: a slowed rank leaves the job after a checkpoint of the
//!   step it was named at, and the job goes on from that step without its device.
//!
//! The tests need root and iproute2, as CI runs them; without them they fail saying so. They
//! run one at a time (each keeps four ranks busy on a small machine).
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Output};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::netns::{Hosts, lines_until, step_of};
use common::runner::{json, ok, plan_into, random_tokens, runner};
use smp_partition::runtime::state::checkpoint::{self, Loaded};

const SEQ: usize = 16;

/// One test at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static M: Mutex<()> = Mutex::new(());
    M.lock().unwrap_or_else(|e| e.into_inner())
}

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx")
}

/// A token file of random ids (every step a new global batch).
fn tokens(dir: &Path) -> PathBuf {
    static T: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let _ = dir;
    T.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("train.bin");
        let bytes: Vec<u8> = random_tokens(1024 * SEQ + 3, 11).iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(&path, bytes).unwrap();
        std::fs::write(smp_partition::runtime::data::sidecar_path(&path), r#"{"dtype": "uint16"}"#).unwrap();
        (tmp, path)
    })
    .1
    .clone()
}

/// pp 2 × dp 2 of gpt2 on four CPU devices (its planning request recorded in the file).
fn plan(dir: &Path) -> PathBuf {
    let args = ["--seq-len", "16", "--global-batch", "8", "--pp", "2", "--tp", "1", "--dp", "2", "--schedule", "1f1b", "--microbatches", "2"];
    plan_into(&model(), "cpu:4", &args, &dir.join("pp2dp2.json"))
}

/// The ranks' arguments: `steps` f64 steps on the token file, a checkpoint every 2 (unless
/// `extra` says otherwise).
fn run_args(data: &Path, steps: usize, ckpt: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["--data", data.to_str().unwrap(), "--seed", "3", "--steps", &steps.to_string(), "--dtype", "f64", "--threads", "1", "--json", "--progress", "--timeout", "60"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if !extra.contains(&"--checkpoint-every") {
        a.extend(["--checkpoint-every".to_string(), "2".to_string()]);
    }
    a.extend(["--checkpoint-dir".to_string(), ckpt.display().to_string()]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn steps_of(report: &serde_json::Value) -> Vec<(u64, f64)> {
    report["steps"].as_array().unwrap().iter().map(|s| (s["step"].as_u64().unwrap(), s["loss"].as_f64().unwrap())).collect()
}

/// One process trained `steps` steps on the same data without a break.
fn one_process(data: &Path, steps: usize) -> Vec<f64> {
    let r = runner()
        .arg("train")
        .arg(model())
        .args(["--batch", "8", "--seq-len", "16", "--microbatches", "4", "--data", data.to_str().unwrap(), "--seed", "3"])
        .args(["--steps", &steps.to_string(), "--dtype", "f64", "--threads", "1", "--json"])
        .output()
        .unwrap();
    steps_of(&json(&ok("the single-process run", r))).into_iter().map(|(_, l)| l).collect()
}

/// A manual reshard-and-resume: `plan` on `nproc` local ranks from `resume`, to `steps`,
/// checkpointing into `ckpt`; its report.
fn resume_manually(plan: &Path, nproc: usize, data: &Path, resume: &Path, steps: usize, ckpt: &Path) -> serde_json::Value {
    let every = steps.to_string();
    let r = runner()
        .args(["launch", "--nproc", &nproc.to_string()])
        .arg(plan)
        .args(run_args(data, steps, ckpt, &["--checkpoint-every", &every]))
        .arg("--resume")
        .arg(resume)
        .output()
        .unwrap();
    json(&ok(&format!("resuming {} on {}", resume.display(), plan.display()), r))
}

fn wait_all(nodes: Vec<Child>) -> Vec<Output> {
    nodes.into_iter().map(|n| n.wait_with_output().unwrap()).collect()
}

fn text(log: &[(usize, String)]) -> String {
    log.iter().map(|(i, l)| format!("[host {i}] {l}")).collect::<Vec<_>>().join("\n")
}

#[test]
fn a_lost_host_is_planned_around_and_the_job_grows_when_it_comes_back() {
    let _one = serial();
    let hosts = Hosts::needed();
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path());
    let data = tokens(dir.path());
    let ckpt = dir.path().join("ckpt");
    // enough steps after the loss for the host to come back well before the end (a step of
    // this model takes tens of milliseconds)
    let steps = 120;
    let every = 10;
    let run = run_args(&data, steps, &ckpt, &["--checkpoint-every", "10"]);
    let launch = ["--nproc", "2", "--elastic", "2:4", "--rejoin-timeout", "3", "--restart-backoff", "0"];
    let (tx, rx) = mpsc::channel();
    let node0 = hosts.start(0, 2, 29520, &launch, &p, &run, &tx);
    let _node1 = hosts.start(1, 2, 29520, &launch, &p, &run, &tx);
    let mut log = lines_until(&rx, Duration::from_secs(300), |(_, l)| step_of(l).is_some_and(|s| s >= 15));
    assert!(log.iter().any(|(_, l)| step_of(l) == Some(15)), "no step 15: {}", text(&log));
    // the host is lost: every process in it killed
    let killed_at = Instant::now();
    assert!(hosts.kill_all(1) > 0);
    // the survivors re-plan; once they train again, the host comes back
    log.extend(lines_until(&rx, Duration::from_secs(240), |(i, l)| *i == 0 && l.contains("the job's devices change")));
    let change = log.last().map(|(_, l)| l.clone()).unwrap_or_default();
    assert!(change.contains("lost host 1") && change.contains("4 → 2 devices"), "{}", text(&log));
    let node1 = hosts.start(1, 2, 29520, &launch, &p, &run, &tx);
    log.extend(lines_until(&rx, Duration::from_secs(240), |(i, l)| *i == 0 && l.contains("first step after the restart")));
    let first_step_after = killed_at.elapsed();
    drop(tx);
    let outs = wait_all(vec![node0, node1]);
    log.extend(rx.iter());
    for (i, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "host {i} ({:?}):\n{}", o.status, text(&log));
    }
    let report = json(&outs[0]);
    let restarts = report["restarts"].as_array().unwrap_or_else(|| panic!("no restarts: {report}"));
    assert_eq!(restarts.len(), 2, "{report}");
    let (lost, grown) = (&restarts[0], &restarts[1]);
    assert_eq!(lost["membership"]["lost"], serde_json::json!(["host 1"]), "{lost}");
    assert_eq!(lost["membership"]["devices"], serde_json::json!([4, 2]), "{lost}");
    assert_eq!(grown["membership"]["joined"], serde_json::json!(["host 1"]), "{grown}");
    assert_eq!(grown["membership"]["devices"], serde_json::json!([2, 4]), "{grown}");
    for change in [lost, grown] {
        let m = &change["membership"];
        assert_eq!(m["meshes"].as_array().map(Vec::len), Some(2), "{change}");
        let predicted = m["predicted_step_time_s"].as_array().unwrap_or_else(|| panic!("no predicted step times: {change}"));
        assert!(predicted.len() == 2 && predicted.iter().all(|t| t.as_f64().is_some_and(|t| t > 0.0)), "{change}");
    }
    let s1 = lost["resumed_from_step"].as_u64().unwrap() as usize;
    let s2 = grown["resumed_from_step"].as_u64().unwrap() as usize;
    // at most the steps since the last checkpoint are lost
    assert!(s1 >= 10 && s1 % every == 0 && s2 > s1 && s2 < steps, "resumed from {s1}, then {s2}");
    let p1 = PathBuf::from(lost["membership"]["plans"][1].as_str().unwrap());
    let p2 = PathBuf::from(grown["membership"]["plans"][1].as_str().unwrap());
    assert!(p1.starts_with(ckpt.join("plans")) && p1.is_file() && p2.is_file(), "{lost} {grown}");
    let fault_s = lost["fault_to_first_step_s"].as_f64().unwrap_or_else(|| panic!("no fault_to_first_step_s: {lost}"));
    let grow_s = grown["fault_to_first_step_s"].as_f64().unwrap_or_else(|| panic!("no fault_to_first_step_s: {grown}"));
    eprintln!(
        "host lost after step ≥ 15: first step {fault_s:.1} s after the fault as the launcher saw it ({:.1} s after the kill, rejoin timeout 3 s); grown at step {s2}: first step {grow_s:.1} s after the checkpoint",
        first_step_after.as_secs_f64()
    );
    // the manual chain: the checkpoint the survivors resumed, on their plan, to the checkpoint
    // the job grew at; that one on the grown plan to the end
    let manual = dir.path().join("manual");
    resume_manually(&p1, 2, &data, &checkpoint::step_dir(&ckpt, s1), s2, &manual);
    let want = steps_of(&resume_manually(&p2, 4, &data, &checkpoint::step_dir(&manual, s2), steps, &dir.path().join("manual-2")));
    let got = steps_of(&report);
    assert_eq!(got.first().map(|s| s.0), Some(s2 as u64 + 1), "{got:?}");
    assert_eq!(got.len(), want.len());
    for ((step, g), (_, w)) in got.iter().zip(&want) {
        assert_eq!(g.to_bits(), w.to_bits(), "step {step}: {g} elastic, {w} resharded and resumed by hand");
    }
    // the same samples as one process trained without a break
    let whole = one_process(&data, steps);
    for (step, g) in &got {
        let w = whole[*step as usize - 1];
        assert!(((g - w) / w).abs() <= 1e-9, "step {step}: {g} vs one process {w}");
    }
}

#[test]
fn a_stopped_rank_is_named_hung_within_the_step_timeout_and_dropped() {
    let _one = serial();
    let hosts = Hosts::needed();
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path());
    let data = tokens(dir.path());
    let ckpt = dir.path().join("ckpt");
    let steps = 8;
    let run = run_args(&data, steps, &ckpt, &[]);
    let step_timeout = 10;
    let launch = ["--nproc", "2", "--elastic", "2:4", "--rejoin-timeout", "3", "--restart-backoff", "0", "--step-timeout", "10"];
    let (tx, rx) = mpsc::channel();
    let nodes = vec![hosts.start(0, 2, 29530, &launch, &p, &run, &tx), hosts.start(1, 2, 29530, &launch, &p, &run, &tx)];
    drop(tx);
    let mut log = lines_until(&rx, Duration::from_secs(300), |(_, l)| l.starts_with("[rank 3] step 3 "));
    let pid = log
        .iter()
        .find_map(|(_, l)| l.strip_prefix("smp-runner launch: rank 3: pid "))
        .unwrap_or_else(|| panic!("no pid of rank 3:\n{}", text(&log)))
        .trim()
        .to_string();
    assert!(std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    let stopped = Instant::now();
    log.extend(lines_until(&rx, Duration::from_secs(120), |(_, l)| l.contains("rank 3 is hung")));
    let named = stopped.elapsed();
    let hung = log.last().map(|(_, l)| l.clone()).unwrap_or_default();
    assert!(hung.contains("rank 3 is hung") && hung.contains("no sign of life"), "{}", text(&log));
    // what its host's other rank waits on: the collective or message and its group
    let wait = hung.split("rank 2 waits in ").nth(1).unwrap_or_else(|| panic!("rank 2's wait not named: {hung}"));
    assert!(wait.contains(" over ranks [") || wait.starts_with("recv from rank ") || wait.starts_with("send to rank "), "{hung}");
    assert!(named <= Duration::from_secs(step_timeout + 5), "named hung {:.1} s after SIGSTOP (step timeout {step_timeout} s)", named.as_secs_f64());
    let outs = wait_all(nodes);
    log.extend(rx.iter());
    for (i, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "host {i} ({:?}):\n{}", o.status, text(&log));
    }
    let report = json(&outs[0]);
    let change = &report["restarts"][0];
    assert_eq!(change["membership"]["lost"], serde_json::json!(["host 1 device 1"]), "{report}");
    assert!(change["cause"].as_str().unwrap().contains("rank 3 is hung"), "{change}");
    let devices = change["membership"]["devices"][1].as_u64().unwrap() as usize;
    assert!((2..=3).contains(&devices), "{change}");
    let from = change["resumed_from_step"].as_u64().unwrap() as usize;
    let fault_s = change["fault_to_first_step_s"].as_f64().unwrap();
    eprintln!("rank stopped after step 3: named hung {:.1} s later (step timeout {step_timeout} s); first step {fault_s:.1} s after its last sign of life, on {devices} devices", named.as_secs_f64());
    // as a manual reshard-and-resume of the checkpoint onto the new plan
    let p1 = PathBuf::from(change["membership"]["plans"][1].as_str().unwrap());
    let want = steps_of(&resume_manually(&p1, devices, &data, &checkpoint::step_dir(&ckpt, from), steps, &dir.path().join("manual")));
    let got = steps_of(&report);
    assert_eq!(got.len(), want.len());
    for ((step, g), (_, w)) in got.iter().zip(&want) {
        assert_eq!(g.to_bits(), w.to_bits(), "step {step}: {g} elastic, {w} by hand");
    }
}

#[test]
fn a_slowed_rank_is_named_a_straggler_and_no_loss_changes() {
    let _one = serial();
    let hosts = Hosts::needed();
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path());
    let data = tokens(dir.path());
    let steps = 10;
    let launch = ["--nproc", "2", "--elastic", "2:4"];
    let go = |name: &str, slow: bool| -> (serde_json::Value, Vec<(usize, String)>) {
        let run = run_args(&data, steps, &dir.path().join(name), &["--straggler-window", "3"]);
        let (tx, rx) = mpsc::channel();
        let nodes = vec![hosts.start(0, 2, 29540, &launch, &p, &run, &tx), hosts.start(1, 2, 29540, &launch, &p, &run, &tx)];
        drop(tx);
        let mut log = lines_until(&rx, Duration::from_secs(300), |(_, l)| step_of(l).is_some_and(|s| s >= 1));
        let pid: i32 = log.iter().find_map(|(_, l)| l.strip_prefix("smp-runner launch: rank 2: pid ")?.trim().parse().ok()).unwrap_or_else(|| panic!("{}", text(&log)));
        // rank 2 throttled: stopped 6 ms of every 7 until the run ends
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let throttle = slow.then(|| {
            let done = done.clone();
            std::thread::spawn(move || {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = std::process::Command::new("kill").args(["-STOP", &pid.to_string()]).stderr(std::process::Stdio::null()).status();
                    std::thread::sleep(Duration::from_millis(60));
                    let _ = std::process::Command::new("kill").args(["-CONT", &pid.to_string()]).stderr(std::process::Stdio::null()).status();
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        });
        let outs = wait_all(nodes);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = throttle {
            t.join().unwrap();
            let _ = std::process::Command::new("kill").args(["-CONT", &pid.to_string()]).stderr(std::process::Stdio::null()).status();
        }
        log.extend(rx.iter());
        for (i, o) in outs.iter().enumerate() {
            assert!(o.status.success(), "host {i} ({:?}):\n{}", o.status, text(&log));
        }
        (json(&outs[0]), log)
    };
    let (plain, _) = go("plain", false);
    let (slowed, log) = go("slowed", true);
    let named: Vec<&serde_json::Value> = slowed["stragglers"].as_array().unwrap().iter().filter(|s| s["rank"] == 2).collect();
    assert!(!named.is_empty(), "rank 2 not named a straggler: {}\n{}", slowed["stragglers"], text(&log));
    assert!(log.iter().any(|(i, l)| *i == 0 && l.contains("straggler: rank 2")), "no progress line names it:\n{}", text(&log));
    let s = named[0];
    eprintln!("throttled rank 2: computes {:.3} s/step, {:.1}× the median rank's pace; waits {:.3} s/step", s["compute_s"].as_f64().unwrap(), s["ratio"].as_f64().unwrap(), s["wait_s"].as_f64().unwrap());
    assert!(slowed["restarts"].as_array().unwrap().is_empty(), "nothing dropped without --drop-stragglers: {slowed}");
    let (a, b) = (steps_of(&plain), steps_of(&slowed));
    assert_eq!(a.len(), steps);
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert_eq!(x.to_bits(), y.to_bits(), "step {step}: {x} unthrottled, {y} throttled");
    }
}

#[test]
fn fewer_devices_than_the_least_stop_the_job_cleanly() {
    let _one = serial();
    let hosts = Hosts::needed();
    let dir = tempfile::tempdir().unwrap();
    let p = plan(dir.path());
    let data = tokens(dir.path());
    let ckpt = dir.path().join("ckpt");
    let run = run_args(&data, 12, &ckpt, &[]);
    let launch = ["--nproc", "2", "--elastic", "3:4", "--rejoin-timeout", "2", "--restart-backoff", "0"];
    let (tx, rx) = mpsc::channel();
    let node0 = hosts.start(0, 2, 29550, &launch, &p, &run, &tx);
    let _node1 = hosts.start(1, 2, 29550, &launch, &p, &run, &tx);
    drop(tx);
    let mut log = lines_until(&rx, Duration::from_secs(300), |(_, l)| step_of(l).is_some_and(|s| s >= 3));
    assert!(hosts.kill_all(1) > 0);
    let out = node0.wait_with_output().unwrap();
    log.extend(rx.iter());
    assert_eq!(out.status.code(), Some(1), "{}", text(&log));
    let stop = log.iter().rev().find(|(i, l)| *i == 0 && l.contains("the job stops")).map(|(_, l)| l.clone()).unwrap_or_else(|| panic!("{}", text(&log)));
    assert!(stop.contains("2 devices left (host 0: 2)") && stop.contains("fewer than --elastic's least of 3"), "{stop}");
    // the planner's least: gpt2 fits one CPU device
    assert!(stop.contains("the model needs at least 1 device"), "{stop}");
    let l = Loaded::open(&ckpt).unwrap_or_else(|e| panic!("the newest checkpoint does not load: {e}"));
    assert!(l.manifest.state.step >= 2, "{stop}");
    assert!(stop.contains(&format!("step {}", l.manifest.state.step)), "{stop}");
}

/// `--drop-stragglers 1` on one host: a rank slowed (as above) is named over a window, every
/// rank writes a checkpoint of that step and ends, and the job goes on without its device, from
/// that very step.
#[test]
fn a_straggler_named_under_drop_stragglers_leaves_the_job() {
    let _one = serial();
    let dir = tempfile::tempdir().unwrap();
    let args = ["--seq-len", "16", "--global-batch", "8", "--pp", "1", "--tp", "1", "--dp", "2", "--microbatches", "1"];
    let p = plan_into(&model(), "cpu:2", &args, &dir.path().join("dp2.json"));
    let data = tokens(dir.path());
    let ckpt = dir.path().join("ckpt");
    let steps = 40;
    let mut launcher = runner()
        .args(["launch", "--nproc", "2", "--elastic", "1:2", "--drop-stragglers", "1", "--restart-backoff", "0"])
        .arg(&p)
        .args(run_args(&data, steps, &ckpt, &["--straggler-window", "3", "--checkpoint-every", "100"]))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stderr = launcher.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send((0usize, line));
        }
    });
    let mut log = lines_until(&rx, Duration::from_secs(300), |(_, l)| l.starts_with("[rank 1] step 1 "));
    let pid: i32 = log.iter().find_map(|(_, l)| l.strip_prefix("smp-runner launch: rank 1: pid ")?.trim().parse().ok()).unwrap_or_else(|| panic!("{}", text(&log)));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let throttle = {
        let done = done.clone();
        std::thread::spawn(move || {
            let signal = |s: &str| {
                let _ = std::process::Command::new("kill").args([s, &pid.to_string()]).stderr(std::process::Stdio::null()).status();
            };
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                signal("-STOP");
                std::thread::sleep(Duration::from_millis(60));
                signal("-CONT");
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    log.extend(lines_until(&rx, Duration::from_secs(300), |(_, l)| l.contains("the job's devices change")));
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    throttle.join().unwrap();
    let out = launcher.wait_with_output().unwrap();
    log.extend(rx.iter());
    assert!(out.status.success(), "{:?}:\n{}", out.status, text(&log));
    let report = json(&out);
    let change = &report["restarts"][0];
    assert_eq!(change["membership"]["lost"], serde_json::json!(["host 0 device 1"]), "{report}");
    assert_eq!(change["membership"]["devices"], serde_json::json!([2, 1]), "{report}");
    assert!(change["cause"].as_str().unwrap().contains("rank 1 left the job"), "{change}");
    assert!(log.iter().any(|(_, l)| l.contains("straggler: rank 1")), "{}", text(&log));
    assert!(log.iter().any(|(_, l)| l.contains("leave the job after step")), "the ranks say why they end:\n{}", text(&log));
    // the checkpoint of the step it was named at, written before the ranks ended, resumed
    let from = change["resumed_from_step"].as_u64().unwrap();
    let steps_after = steps_of(&report);
    assert_eq!(steps_after.first().map(|s| s.0), Some(from + 1), "{report}");
    assert_eq!(steps_after.last().map(|s| s.0), Some(steps as u64));
    assert!(from % 3 == 1, "named at the end of a window (steps 2-4, 5-7, …): step {from}");
}
