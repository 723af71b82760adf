//! Planner speed, old binary against new, alternated in one run.
//!
//! The old binary is `SMP_PARTITION_OLD`, default `target/old-smp-partition`: main's before the
//! change measured (last: 6587c61, before the planner ran on both cores; `git archive` of it
//! built with `cargo build --release`). Each case runs `ROUNDS` rounds, old then new in odd
//! rounds and new then old in even ones (so drift in the shared machine's load falls on both
//! alike), and reports medians: a single plan's `solver.wall_s` (search and assembly, what
//! `benches/planner.rs` reports) and process wall time, the sweep's process wall time.
//!
//! Run: `cargo bench --bench old_new`. Prints a markdown table for BENCHMARKS.md.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Rounds per case.
const ROUNDS: usize = 5;

/// The old binary first in odd rounds, the new one first in even ones.
const ORDER: [[usize; 2]; 2] = [[0, 1], [1, 0]];

/// The median of `v` (the mean of the middle two for an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 { f64::NAN } else if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// (name, model, cluster, batch)
const PLANS: [(&str, &str, &str, &str); 2] =
    [("GPT-3 175B, 1,024 A100s", "models/gpt3-175b.onnx", "a100-80gb:1024", "1536"), ("GPT 1T, 3,072 A100s", "models/gpt-1t.onnx", "a100-80gb:3072", "3072")];

/// Runs `bin` with `args`; (process wall, the plan's `solver.wall_s` when `out` is a plan).
fn timed(bin: &Path, args: &[&str], out: Option<&Path>) -> (f64, f64) {
    let t = Instant::now();
    let o = Command::new(bin).args(args).output().expect("binary runs");
    let wall = t.elapsed().as_secs_f64();
    assert!(o.status.success(), "{} {args:?}: {}", bin.display(), String::from_utf8_lossy(&o.stderr));
    let solve = out
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v["solver"]["wall_s"].as_f64())
        .unwrap_or(wall);
    (wall, solve)
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let new = PathBuf::from(env!("CARGO_BIN_EXE_smp-partition"));
    let old = std::env::var_os("SMP_PARTITION_OLD").map(PathBuf::from).unwrap_or_else(|| root.join("target/old-smp-partition"));
    assert!(old.exists(), "the old binary {} is missing (see this file's header)", old.display());
    let dir = std::env::temp_dir().join(format!("smp-old-new-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    println!("| case (median of {ROUNDS}) | old (s) | new (s) | new / old | goal | met |");
    println!("|---|---|---|---|---|---|");
    for (name, model, cluster, batch) in PLANS {
        let model = root.join(model).display().to_string();
        let out = dir.join("plan.json");
        let out_s = out.display().to_string();
        let args = [model.as_str(), "--cluster", cluster, "--global-batch", batch, "--seq-len", "2048", "-o", out_s.as_str()];
        let mut times: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
        for round in 0..ROUNDS {
            for which in ORDER[round % 2] {
                let bin = if which == 0 { &old } else { &new };
                times[which].push(timed(bin, &args, Some(&out)));
            }
        }
        let med = |v: &[(f64, f64)], f: fn(&(f64, f64)) -> f64| median(v.iter().map(f).collect());
        let (so, sn) = (med(&times[0], |t| t.1), med(&times[1], |t| t.1));
        let (wo, wn) = (med(&times[0], |t| t.0), med(&times[1], |t| t.0));
        let goal = if name.contains("175B") { 0.5 } else { 3.0 };
        println!("| {name}, planning (`solver.wall_s`) | {so:.2} | {sn:.2} | {:.2}× | ≤ {goal} s | {} |", sn / so, if sn <= goal { "yes" } else { "no" });
        println!("| {name}, whole process | {wo:.2} | {wn:.2} | {:.2}× | | |", wn / wo);
    }
    let model = root.join("models/gpt3-175b.onnx").display().to_string();
    let svg = dir.join("sweep.svg").display().to_string();
    let args = ["sweep", model.as_str(), "--clusters", "a100-80gb:256,512,1024", "h100-80gb:256,512,1024", "--global-batch", "1536", "--seq-len", "2048", "-o", svg.as_str()];
    let mut times = [Vec::new(), Vec::new()];
    for round in 0..ROUNDS {
        for which in ORDER[round % 2] {
            let bin = if which == 0 { &old } else { &new };
            times[which].push(timed(bin, &args, None).0);
        }
    }
    let [o, n] = times.map(median);
    println!("| `sweep` GPT-3 175B, 6 clusters, whole process | {o:.2} | {n:.2} | {:.2}× | ≤ 5 s | {} |", n / o, if n <= 5.0 { "yes" } else { "no" });
    let _ = std::fs::remove_dir_all(&dir);
}
