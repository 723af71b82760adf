//! Shared by the runner benches: the bench GPT-2 (4 × 256, vocab 2048, HF's default init)
//! exported by `benches/peers/gpt2_peer.py`, the HF Llama of `cp_peer.py`, plans for two CPU
//! ranks, the peers' runs and step-time summaries.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn python() -> PathBuf {
    std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo().join(".venv/bin/python"))
}

/// `gpt2_peer.py MODE DIR ARGS`.
pub fn peer(mode: &str, dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(python());
    c.arg(repo().join("benches/peers/gpt2_peer.py")).arg(mode).arg(dir).args(args);
    c
}

/// Exports the model, its weights and the batch into `dir` (or reuses `$SMP_BENCH_GPT2_DIR`).
pub fn export() -> (Option<tempfile::TempDir>, PathBuf) {
    if let Some(d) = std::env::var_os("SMP_BENCH_GPT2_DIR").map(PathBuf::from).filter(|d| d.join("gpt2.onnx").exists()) {
        return (None, d);
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().to_path_buf();
    ok("export", peer("export", &dir, &[]).output().expect("run gpt2_peer.py export"));
    (Some(tmp), dir)
}

pub fn ok(what: &str, out: Output) -> Output {
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// Mean step time (s) of a run's JSON, the first step excluded: the runner's `steps[].time_s`
/// or a peer's `step_times_s`.
pub fn mean_step(out: &Output) -> f64 {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let times: Vec<f64> = match v.get("step_times_s") {
        Some(t) => t.as_array().expect("step_times_s").iter().filter_map(|x| x.as_f64()).collect(),
        None => v["steps"].as_array().expect("steps").iter().filter_map(|s| s["time_s"].as_f64()).collect(),
    };
    let timed = &times[usize::from(times.len() > 1)..];
    timed.iter().sum::<f64>() / timed.len().max(1) as f64
}

/// Mean CPU time per step (s) of a run's JSON, the first step excluded: the runner's
/// `steps[].cpu_s` or a peer's `cpu_times_s`.
pub fn mean_cpu(out: &Output) -> f64 {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let times: Vec<f64> = match v.get("cpu_times_s") {
        Some(t) => t.as_array().expect("cpu_times_s").iter().filter_map(|x| x.as_f64()).collect(),
        None => v["steps"].as_array().expect("steps").iter().filter_map(|s| s["cpu_s"].as_f64()).collect(),
    };
    let timed = &times[usize::from(times.len() > 1)..];
    timed.iter().sum::<f64>() / timed.len().max(1) as f64
}

/// Each rank's `phases` from a runner's launch JSON, one line per rank (ms per step).
pub fn phases(out: &Output) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let ms = |r: &serde_json::Value, k: &str| r["phases"][k].as_f64().unwrap_or(f64::NAN) * 1e3;
    v["ranks"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .map(|r| {
                    format!(
                        "rank {}: step {:.1}, CPU {:.1}; compute {:.1}, send {:.1}, receive wait {:.1}, collectives {:.1}, optimizer {:.1} ms",
                        r["rank"],
                        r["step_time_s"].as_f64().unwrap_or(f64::NAN) * 1e3,
                        r["cpu_time_s"].as_f64().unwrap_or(f64::NAN) * 1e3,
                        ms(r, "compute_s"),
                        ms(r, "send_s"),
                        ms(r, "recv_s"),
                        ms(r, "collective_s"),
                        ms(r, "optimizer_s")
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The 1-, 5- and 15-minute load averages.
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

/// Median of a list.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// The per-step losses a run printed: a peer's `losses`, or the runner's `--json` `steps`.
pub fn losses(out: &Output) -> Vec<f64> {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    match v.get("losses") {
        Some(l) => l.as_array().expect("losses").iter().filter_map(|x| x.as_f64()).collect(),
        None => v["steps"].as_array().expect("steps").iter().filter_map(|s| s["loss"].as_f64()).collect(),
    }
}

/// `smp-runner launch` of `plan` on 2 ranks × 1 thread, `steps` steps on `dir/batch.npz`: its
/// output (`what` names it in a failure).
pub fn launch_two(dir: &Path, plan: &Path, steps: usize, what: &str) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--data", dir.join("batch.npz").to_str().unwrap()])
        .args(["--steps", &steps.to_string(), "--threads", "1", "--json", "--timeout", "300"])
        .output()
        .expect("run smp-runner");
    ok(what, out)
}

/// `benches/peers/SCRIPT MODE DIR [STEPS] EXTRA…`: its output (a failure names the script).
pub fn run_peer(script: &str, mode: &str, dir: &Path, steps: Option<usize>, extra: &[&str]) -> Output {
    let mut c = Command::new(python());
    c.arg(repo().join("benches/peers").join(script)).arg(mode).arg(dir);
    if let Some(s) = steps {
        c.arg(s.to_string());
    }
    c.args(extra);
    ok(&format!("{script} {mode}"), c.output().unwrap_or_else(|e| panic!("run {script}: {e}")))
}

/// The HF Llama bench model of `cp_peer.py` (llama.onnx, llama.pt, batch.npz): in
/// `$SMP_BENCH_CP_DIR` (written there if missing) or in a temporary directory.
pub fn llama_export() -> (Option<tempfile::TempDir>, PathBuf) {
    if let Some(d) = std::env::var_os("SMP_BENCH_CP_DIR").map(PathBuf::from) {
        if !d.join("llama.onnx").exists() {
            run_peer("cp_peer.py", "export", &d, None, &[]);
        }
        return (None, d);
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().to_path_buf();
    run_peer("cp_peer.py", "export", &dir, None, &[]);
    (Some(tmp), dir)
}

/// Plans `model` for the 2 CPU ranks of `tests/data/cpu.toml` (batch 8 × 128, one microbatch,
/// no recompute) with `args` beside, into `out`: the plan.
pub fn plan_two(model: &Path, out: &Path, args: &[&str]) -> serde_json::Value {
    let cluster = format!("{}:2", repo().join("tests/data/cpu.toml").display());
    let planned = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .arg(model)
        .args(["--cluster", &cluster, "--global-batch", "8", "--seq-len", "128", "--microbatches", "1", "--checkpointing", "none"])
        .args(args)
        .args(["-o", out.to_str().expect("a UTF-8 path")])
        .output()
        .expect("run smp-partition");
    ok("smp-partition", planned);
    serde_json::from_slice(&std::fs::read(out).expect("plan")).expect("plan JSON")
}
