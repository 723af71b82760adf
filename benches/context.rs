//! Context parallelism against a hand-written PyTorch context-parallel Llama, side by side in
//! one run: HF Llama (4 layers × hidden 256, 8 query heads over 2 KV heads, MLP intermediate 704,
//! vocab 2048, RoPE, HF's default init; `benches/peers/cp_peer.py`) trained on 8 × 128 tokens
//! (causal LM, AdamW, gradient norm clipped at 1) by 2 ranks × 1 thread, each rank the same
//! load-balanced front and back chunks of every sequence (rank 0 tokens 0–31 and 96–127, rank 1
//! tokens 32–95):
//! - the runner: `smp-runner launch` of the planner's cp 2 plan (keys and values all-gathered
//!   before attention by the c10d shim, the gradient back by a reduce-scatter, weight gradients
//!   all-reduced; Gloo);
//! - PyTorch: `cp_peer.py cp`, the HF model with its attention function replaced by an
//!   all-gather of K and V (`torch.distributed.nn.functional.all_gather`, Gloo) and SDPA with
//!   the causal mask of global positions.
//!
//! Also, for reference, one process with 1 thread on the whole batch: `smp-runner train` and
//! `cp_peer.py eager` (HF's SDPA attention).
//!
//! The four alternate, ROUNDS times, each STEPS steps (first excluded); prints each round's
//! ms/step (and rank 0's CPU ms/step), the medians and the ratio PyTorch / runner (≥ 1: the
//! runner as fast or faster), and checks all trained the same losses (within 1e-4 relative).
//!
//!     cargo bench --features runner --profile dev --bench context [-- ROUNDS STEPS]
//!
//! `SMP_BENCH_CP_DIR=DIR` reuses an export in DIR (llama.onnx, llama.pt, batch.npz) or writes one there.

#[path = "peers/mod.rs"]
mod peers;

use std::path::Path;
use std::process::{Command, Output};

use peers::{launch_two, llama_export, load, losses, mean_cpu, mean_step, median, ok, phases, plan_two, run_peer};

/// `cp_peer.py MODE DIR [STEPS]`.
fn peer(mode: &str, dir: &Path, steps: Option<usize>) -> Output {
    run_peer("cp_peer.py", mode, dir, steps, &[])
}


/// One run of the runner in one process (1 thread) on the same batch: its output.
fn runner_one(dir: &Path, steps: usize) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["train", dir.join("llama.onnx").to_str().unwrap(), "--data", dir.join("batch.npz").to_str().unwrap()])
        .args(["--batch", "8", "--seq-len", "128", "--steps", &steps.to_string(), "--threads", "1", "--json"])
        .output()
        .expect("run smp-runner");
    ok("smp-runner train", out)
}


fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rounds, steps) = (arg(0, 3), arg(1, 6));
    let (_tmp, dir) = llama_export();
    let cp2 = dir.join("cp2.json");
    let plan = plan_two(&dir.join("llama.onnx"), &cp2, &["--cp", "2", "--pp", "1", "--tp", "1", "--dp", "1"]);
    assert_eq!(plan["parallel"]["cp"], 2, "the plan's cp");

    let load_before = load();
    let names = ["runner cp 2", "PyTorch cp 2", "runner 1 process", "PyTorch 1 process"];
    let mut wall: [Vec<f64>; 4] = Default::default();
    let mut cpu: [Vec<f64>; 4] = Default::default();
    let mut worst = [0.0f64; 4];
    let mut last_phases = Vec::new();
    for r in 0..rounds {
        let outs = [launch_two(&dir, &cp2, steps, "smp-runner launch (cp 2)"), peer("cp", &dir, Some(steps)), runner_one(&dir, steps), peer("eager", &dir, Some(steps))];
        // every run against PyTorch's cp 2
        let reference = losses(&outs[1]);
        for (i, o) in outs.iter().enumerate() {
            let l = losses(o);
            assert_eq!(l.len(), reference.len(), "{}: step count", names[i]);
            worst[i] = l.iter().zip(&reference).map(|(x, y)| (x - y).abs() / y.abs()).fold(worst[i], f64::max);
            wall[i].push(mean_step(o));
            cpu[i].push(mean_cpu(o));
        }
        println!(
            "round {r}: runner cp 2 {:.1} ms/step ({:.1} ms CPU), PyTorch cp 2 {:.1} ms/step ({:.1} ms CPU); one process: runner {:.1}, PyTorch {:.1} ms/step",
            wall[0][r] * 1e3,
            cpu[0][r] * 1e3,
            wall[1][r] * 1e3,
            cpu[1][r] * 1e3,
            wall[2][r] * 1e3,
            wall[3][r] * 1e3
        );
        last_phases = phases(&outs[0]);
    }
    for (i, w) in worst.iter().enumerate() {
        assert!(*w < 1e-4, "{}'s losses differ from PyTorch cp 2's by {w:.2e}", names[i]);
    }
    let med = |v: &Vec<f64>| median(v.clone());
    let (a, b) = (med(&wall[0]), med(&wall[1]));
    let (ca, cb) = (med(&cpu[0]), med(&cpu[1]));
    println!("HF Llama 4 × 256 (8 heads, 2 KV heads, intermediate 704, vocab 2048), batch 8 × 128, cp 2 = 2 ranks × 1 thread, {rounds} rounds × {steps} steps (first excluded)");
    println!("load average before {load_before}, after {}", load());
    println!(
        "losses agree with PyTorch cp 2 within {:.1e} (runner cp 2), {:.1e} (runner 1 process), {:.1e} (PyTorch 1 process) (relative)",
        worst[0], worst[2], worst[3]
    );
    println!("runner cp 2 phases (last round):");
    for l in &last_phases {
        println!("  {l}");
    }
    println!("runner cp 2             {:.1} ms/step (median of rounds)", a * 1e3);
    println!("PyTorch cp 2 (all-gather) {:.1} ms/step", b * 1e3);
    println!("ratio PyTorch / runner {:.2} (goal: ≥ 1.0, the runner as fast or faster)", b / a);
    println!("CPU time per step on rank 0 (less sensitive to a loaded machine): runner {:.1} ms, PyTorch {:.1} ms, ratio {:.2}", ca * 1e3, cb * 1e3, cb / ca);
    println!(
        "one process, 1 thread: runner {:.1} ms/step ({:.1} ms CPU), PyTorch {:.1} ms/step ({:.1} ms CPU), ratio {:.2}",
        med(&wall[2]) * 1e3,
        med(&cpu[2]) * 1e3,
        med(&wall[3]) * 1e3,
        med(&cpu[3]) * 1e3,
        med(&wall[3]) / med(&wall[2])
    );
}
