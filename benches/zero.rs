//! ZeRO 3 against PyTorch's FSDP2, side by side in one run: the HF Llama of `benches/context.rs`
//! (4 layers × hidden 256, 8 query heads over 2 KV heads, MLP intermediate 704, vocab 2048,
//! RoPE, HF's default init; exported by `benches/peers/cp_peer.py`) trained on 8 × 128 tokens
//! (causal LM, AdamW, gradient norm clipped at 1) by dp 2 = 2 ranks × 1 thread, 4 sequences
//! each, f32:
//! - the runner: `smp-runner launch` of the plan `--dp 2 --zero 3` (one microbatch: each rank
//!   holds its block of the parameters, gathers them around the forward and the backward,
//!   reduce-scatters the gradients; the c10d shim on Gloo);
//! - PyTorch: `fsdp_peer.py fsdp`, `fully_shard` on every decoder layer and the root,
//!   resharding after forward, Gloo.
//!
//! The runs alternate, ROUNDS times, each STEPS steps (first excluded); prints each round's
//! ms/step (and rank 0's CPU ms/step), the medians and the ratio PyTorch / runner (≥ 1: the
//! runner as fast or faster), and checks both trained the same losses (within 1e-4 relative).
//!
//!     cargo bench --features runner --profile dev --bench zero [-- ROUNDS STEPS]
//!
//! `SMP_BENCH_CP_DIR=DIR` reuses `cp_peer.py`'s export in DIR (llama.onnx, llama.pt, batch.npz)
//! or writes one there.

#[path = "peers/mod.rs"]
mod peers;

use std::path::Path;
use std::process::Output;

use peers::{launch_two, llama_export, load, losses, mean_cpu, mean_step, median, phases, plan_two, run_peer};

/// `fsdp_peer.py fsdp DIR STEPS`.
fn peer(dir: &Path, steps: usize) -> Output {
    run_peer("fsdp_peer.py", "fsdp", dir, Some(steps), &[])
}

/// Plans dp 2 under ZeRO 3 into `out`; returns the plan.
fn plan(dir: &Path, out: &Path) -> serde_json::Value {
    let plan = plan_two(&dir.join("llama.onnx"), out, &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "3"]);
    assert_eq!((plan["parallel"]["dp"].as_u64(), plan["parallel"]["zero"].as_u64()), (Some(2), Some(3)), "the plan's dp and ZeRO stage");
    plan
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rounds, steps) = (arg(0, 3), arg(1, 6));
    let (_tmp, dir) = llama_export();
    let zero3 = dir.join("dp2-zero3.json");
    plan(&dir, &zero3);
    let names = ["runner dp 2, ZeRO 3", "PyTorch FSDP2 dp 2"];

    let load_before = load();
    let mut wall: [Vec<f64>; 2] = Default::default();
    let mut cpu: [Vec<f64>; 2] = Default::default();
    let mut worst = 0.0f64;
    let mut last_phases = Vec::new();
    for r in 0..rounds {
        // alternate which goes first, so neither always runs on a cooler machine
        let outs = if r % 2 == 0 {
            let a = launch_two(&dir, &zero3, steps, "smp-runner launch (dp 2, ZeRO 3)");
            [a, peer(&dir, steps)]
        } else {
            let b = peer(&dir, steps);
            [launch_two(&dir, &zero3, steps, "smp-runner launch (dp 2, ZeRO 3)"), b]
        };
        let (ours, theirs) = (losses(&outs[0]), losses(&outs[1]));
        assert_eq!(ours.len(), theirs.len(), "step count");
        worst = ours.iter().zip(&theirs).map(|(x, y)| (x - y).abs() / y.abs()).fold(worst, f64::max);
        for (i, o) in outs.iter().enumerate() {
            wall[i].push(mean_step(o));
            cpu[i].push(mean_cpu(o));
        }
        println!(
            "round {r}: {} {:.1} ms/step ({:.1} ms CPU), {} {:.1} ms/step ({:.1} ms CPU)",
            names[0],
            wall[0][r] * 1e3,
            cpu[0][r] * 1e3,
            names[1],
            wall[1][r] * 1e3,
            cpu[1][r] * 1e3
        );
        last_phases = phases(&outs[0]);
    }
    assert!(worst < 1e-4, "the runner's losses differ from FSDP2's by {worst:.2e}");
    let med = |v: &Vec<f64>| median(v.clone());
    println!("HF Llama 4 × 256 (8 heads, 2 KV heads, intermediate 704, vocab 2048), batch 8 × 128, dp 2 = 2 ranks × 1 thread (4 sequences each), f32, {rounds} rounds × {steps} steps (first excluded)");
    println!("load average before {load_before}, after {}", load());
    println!("losses agree with FSDP2 within {worst:.1e}");
    println!("{} phases (last round):", names[0]);
    for l in &last_phases {
        println!("  {l}");
    }
    let (a, b) = (med(&wall[0]), med(&wall[1]));
    let (ca, cb) = (med(&cpu[0]), med(&cpu[1]));
    println!("{:<22} {:.1} ms/step (median of rounds), rank 0 CPU {:.1} ms/step", names[0], a * 1e3, ca * 1e3);
    println!("{:<22} {:.1} ms/step, rank 0 CPU {:.1} ms/step", names[1], b * 1e3, cb * 1e3);
    println!("ratio FSDP2 / runner {:.2} (goal: ≥ 1.1); CPU ratio {:.2}", b / a, cb / ca);
}
