//! `smp-runner train` against PyTorch eager, 1 process, 1 thread each, on the GPT-2 bench setup:
//! HF GPT-2 (4 blocks × 256, vocab 2048, HF's default init) exported with dynamic batch and
//! sequence and its parameter record, batch 8 × 128, AdamW, clip 1.0, causal-LM loss
//! (`benches/peers/gpt2_peer.py`). The two run alternately, ROUNDS times, each STEPS steps
//! (first excluded); prints each round's ms/step, the medians and the throughput ratio
//! PyTorch / runner (≥ 1.0: the runner is at least as fast).
//!
//!     cargo bench --features runner --profile dev --bench train_step [-- ROUNDS STEPS]

#[path = "peers/mod.rs"]
mod peers;

use std::process::Command;

use peers::{load, mean_cpu, mean_step, median, ok, peer};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rounds, steps) = (arg(0, 3), arg(1, 6));
    let (_tmp, dir) = peers::export();
    let n = steps.to_string();
    let load_before = load();
    let (mut ours, mut torch, mut ours_cpu, mut torch_cpu) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        let out = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .arg("train")
            .arg(dir.join("gpt2.onnx"))
            .arg("--data")
            .arg(dir.join("batch.npz"))
            .args(["--steps", &n, "--threads", "1", "--json"])
            .output()
            .expect("run smp-runner train");
        let out = ok("smp-runner train", out);
        ours.push(mean_step(&out));
        ours_cpu.push(mean_cpu(&out));
        let out = ok("PyTorch eager", peer("eager", &dir, &["--steps", &n, "--threads", "1"]).output().expect("run peer"));
        torch.push(mean_step(&out));
        torch_cpu.push(mean_cpu(&out));
        println!(
            "round {r}: smp-runner {:.1} ms/step ({:.1} ms CPU), PyTorch eager {:.1} ms/step ({:.1} ms CPU)",
            ours[r] * 1e3,
            ours_cpu[r] * 1e3,
            torch[r] * 1e3,
            torch_cpu[r] * 1e3
        );
    }
    let (o, t, oc, tc) = (median(ours), median(torch), median(ours_cpu), median(torch_cpu));
    println!("gpt2 4×256 vocab 2048, batch 8 × 128, 1 thread, {rounds} rounds × {steps} steps (first excluded)");
    println!("load average before {load_before}, after {}", load());
    println!("smp-runner train  {:.1} ms/step, {:.1} ms CPU/step (medians of rounds)", o * 1e3, oc * 1e3);
    println!("PyTorch eager     {:.1} ms/step, {:.1} ms CPU/step", t * 1e3, tc * 1e3);
    println!("throughput ratio (PyTorch / runner) {:.3} wall, {:.3} CPU (goal >= 1.0)", t / o, tc / oc);
}
