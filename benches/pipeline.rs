//! Pipeline throughput and the `cpu` cost model on the GPT-2 bench setup (HF GPT-2 4 × 256, vocab
//! 2048, batch 8 × 128, 1 thread per rank, `benches/peers/gpt2_peer.py`), runs alternated in
//! one process, ROUNDS times, STEPS steps each (first excluded):
//! - smp-runner pp 2, 1F1B, 8 microbatches, blocks split 2 | 2 (`--layout 0-2|3-5`), 2 ranks;
//! - torch.distributed.pipelining Schedule1F1B, 2 ranks (gloo), 8 microbatches, the same split;
//! - smp-runner train, 1 process, the same 8 microbatches.
//!
//! Then predicted (the plan's `predicted.step_time_s`, `cpu` preset with the calibration file
//! `smp-runner calibrate` wrote, if any) against measured step time for 5 plans of ≤ 2 ranks.
//!
//!     cargo bench --features runner --profile dev --bench pipeline [-- ROUNDS STEPS]

#[path = "peers/mod.rs"]
mod peers;

use std::path::Path;
use std::process::{Command, Output};

use peers::{load, mean_step, median, ok, peer};

fn plan(dir: &Path, name: &str, args: &[&str]) -> std::path::PathBuf {
    let out = dir.join(format!("{name}.json"));
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .arg(dir.join("gpt2.onnx"))
        .args(args)
        .args(["--global-batch", "8", "--seq-len", "128", "-o"])
        .arg(&out)
        .output()
        .expect("run smp-partition");
    ok(&format!("planning {name}"), r);
    out
}

fn launch(dir: &Path, plan: &Path, nproc: usize, steps: &str) -> Output {
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", &nproc.to_string()])
        .arg(plan)
        .args(["--steps", steps, "--threads", "1", "--json", "--data"])
        .arg(dir.join("batch.npz"))
        .output()
        .expect("run smp-runner launch");
    ok("smp-runner launch", r)
}

fn one_process(dir: &Path, micro: &str, steps: &str) -> Output {
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .arg("train")
        .arg(dir.join("gpt2.onnx"))
        .arg("--data")
        .arg(dir.join("batch.npz"))
        .args(["--microbatches", micro, "--steps", steps, "--threads", "1", "--json"])
        .output()
        .expect("run smp-runner train");
    ok("smp-runner train", r)
}

fn predicted(out: &Output) -> f64 {
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("runner JSON");
    v["predicted_step_time_s"].as_f64().unwrap_or(f64::NAN)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rounds, steps) = (arg(0, 2), arg(1, 6));
    let (_tmp, dir) = peers::export();
    let n = steps.to_string();
    let pp2 = plan(&dir, "pp2", &["--cluster", "cpu:2", "--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "8", "--layout", "0-2|3-5"]);
    let load_before = load();
    let (mut ours, mut torch, mut single) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let run = launch(&dir, &pp2, 2, &n);
        for line in peers::phases(&run) {
            println!("  pp 2 {line}");
        }
        ours.push(mean_step(&run));
        torch.push(mean_step(&ok("torch pipelining", peer("pipe", &dir, &["--steps", &n, "--microbatches", "8"]).output().expect("run peer"))));
        single.push(mean_step(&one_process(&dir, "8", &n)));
        println!(
            "round {r}: smp-runner pp 2 {:.1} ms/step, torch.distributed.pipelining {:.1} ms/step, smp-runner 1 process {:.1} ms/step",
            ours[r] * 1e3,
            torch[r] * 1e3,
            single[r] * 1e3
        );
    }
    let (o, t, s) = (median(ours), median(torch), median(single));
    println!("gpt2 4×256 vocab 2048, batch 8 × 128, m = 8, 1 thread per rank, {rounds} rounds × {steps} steps (first excluded)");
    println!("load average before {load_before}, after {}", load());
    println!("smp-runner pp 2 1F1B            {:8.1} ms/step", o * 1e3);
    println!("torch.distributed.pipelining    {:8.1} ms/step", t * 1e3);
    println!("smp-runner 1 process, m = 8     {:8.1} ms/step", s * 1e3);
    println!("pp 2 vs torch pipelining: {:.3}x (goal >= 1.0)", t / o);
    println!("pp 2 vs our 1 process:    {:.3}x (goal >= 1.5)", s / o);

    if std::env::var_os("SMP_BENCH_SKIP_PREDICTIONS").is_some() {
        return;
    }
    println!("\npredicted vs measured step time (goal: within 15 %), load average {}", load());
    let cases: [(&str, usize, &[&str]); 5] = [
        ("1 process", 1, &["--cluster", "cpu:1", "--microbatches", "1"]),
        ("1 process, m 8", 1, &["--cluster", "cpu:1", "--microbatches", "8"]),
        ("pp 2, 1F1B, m 8", 2, &["--cluster", "cpu:2", "--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "8", "--layout", "0-2|3-5"]),
        ("dp 2", 2, &["--cluster", "cpu:2", "--pp", "1", "--tp", "1", "--dp", "2", "--microbatches", "1"]),
        ("tp 2", 2, &["--cluster", "cpu:2", "--pp", "1", "--tp", "2", "--dp", "1", "--microbatches", "1"]),
    ];
    println!("| plan | predicted | measured | error |");
    for (i, (name, nproc, args)) in cases.iter().enumerate() {
        let p = plan(&dir, &format!("case{i}"), args);
        let out = launch(&dir, &p, *nproc, &n);
        let (pred, meas) = (predicted(&out), mean_step(&out));
        println!("| {name} | {:.1} ms | {:.1} ms | {:+.0} % |", pred * 1e3, meas * 1e3, (pred / meas - 1.0) * 100.0);
        for line in peers::phases(&out) {
            println!("  {name} {line}");
        }
    }
}
