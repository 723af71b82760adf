//! Tensor parallelism against PyTorch's DTensor tensor parallelism, side by side in one run:
//! the HF Llama of `benches/context.rs` (4 layers × hidden 256, 8 query heads over 2 KV heads,
//! MLP intermediate 704, vocab 2048, RoPE, HF's default init; exported by
//! `benches/peers/cp_peer.py`) trained on 8 × 128 tokens (causal LM, AdamW, gradient norm
//! clipped at 1) by tp 2 = 2 ranks × 1 thread, both ranks on the whole batch, f32:
//! - the runner: `smp-runner launch` of two tp 2 plans: the planner's own choice and
//!   `--baseline megatron` (Megatron's column/row split of every attention and MLP matmul, an
//!   all-reduce after o and down; the c10d shim on Gloo);
//! - PyTorch: `tp_peer.py tp`, the HF model with `parallelize_module` (ColwiseParallel on
//!   q/k/v/gate/up, RowwiseParallel on o/down, the lm_head ColwiseParallel with its logits
//!   all-gathered), Gloo. Where the runner's plan splits the token embedding (`codegen.shards`
//!   of layer 0 slices a weight), the peer splits it too (`--vocab-embed`: RowwiseParallel,
//!   masked lookup + all-reduce); otherwise it is replicated on both sides.
//!
//! The runs alternate, ROUNDS times, each STEPS steps (first excluded); prints each round's
//! ms/step (and rank 0's CPU ms/step), the medians and the ratio PyTorch / runner (≥ 1: the
//! runner as fast or faster), and checks all trained the same losses (within 1e-4 relative).
//!
//!     cargo bench --features runner --profile dev --bench tensor [-- ROUNDS STEPS]
//!
//! `SMP_BENCH_CP_DIR=DIR` reuses `cp_peer.py`'s export in DIR (llama.onnx, llama.pt, batch.npz)
//! or writes one there.

#[path = "peers/mod.rs"]
mod peers;

use std::path::Path;
use std::process::Output;

use peers::{launch_two, llama_export, load, losses, mean_cpu, mean_step, median, phases, plan_two, run_peer};

/// `tp_peer.py tp DIR STEPS [--vocab-embed]`.
fn peer(dir: &Path, steps: usize, vocab_embed: bool) -> Output {
    run_peer("tp_peer.py", "tp", dir, Some(steps), if vocab_embed { &["--vocab-embed"] } else { &[] })
}

/// Plans tp 2 into `out` with `extra` arguments; returns the plan.
fn plan(dir: &Path, out: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["--pp", "1", "--tp", "2", "--dp", "1"];
    args.extend_from_slice(extra);
    let plan = plan_two(&dir.join("llama.onnx"), out, &args);
    assert_eq!(plan["parallel"]["tp"], 2, "the plan's tp");
    plan
}

/// Whether the plan's first shard (the embedding layer) and last (the lm_head) slice a weight,
/// and whether any collective is a reduce-scatter (sequence parallelism).
fn shape(plan: &serde_json::Value) -> (bool, bool, bool) {
    let shards = plan["codegen"]["shards"].as_array().expect("codegen.shards");
    let slices = |s: &serde_json::Value| s[0]["weight_slices"].as_array().is_some_and(|w| !w.is_empty());
    let sp = shards.iter().flat_map(|s| s.as_array().into_iter().flatten()).flat_map(|r| r["collectives"].as_array().into_iter().flatten()).any(|c| c["kind"]["kind"] == "reduce_scatter");
    (slices(&shards[0]), slices(shards.last().unwrap()), sp)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rounds, steps) = (arg(0, 3), arg(1, 6));
    let (_tmp, dir) = llama_export();
    let (own, meg) = (dir.join("tp2.json"), dir.join("tp2-megatron.json"));
    let plans = [plan(&dir, &own, &[]), plan(&dir, &meg, &["--baseline", "megatron"])];
    let mut embed = [false; 2];
    for (i, p) in plans.iter().enumerate() {
        let (e, head, sp) = shape(p);
        assert!(head, "plan {i}: the peer splits the lm_head's vocabulary, the plan does not");
        assert!(!sp, "plan {i}: sequence parallel; the peer has no DTensor sequence-parallel plan");
        embed[i] = e;
    }
    let same = plans[0]["codegen"] == plans[1]["codegen"];
    let names = ["runner tp 2 (planner)", "PyTorch DTensor tp 2 (planner's)", "runner tp 2 (megatron)", "PyTorch DTensor tp 2 (megatron's)"];
    let embed_s = |e: bool| if e { "vocabulary-parallel" } else { "replicated" };
    println!("planner's plan: embedding {}, lm_head vocabulary-parallel", embed_s(embed[0]));
    println!("megatron plan: embedding {}, lm_head vocabulary-parallel{}", embed_s(embed[1]), if same { " (the same plan)" } else { "" });
    let runs = if same { 2 } else { 4 };

    let load_before = load();
    let mut wall: [Vec<f64>; 4] = Default::default();
    let mut cpu: [Vec<f64>; 4] = Default::default();
    let mut worst = [0.0f64; 4];
    let mut last_phases = [Vec::new(), Vec::new()];
    for r in 0..rounds {
        let mut outs = vec![launch_two(&dir, &own, steps, "smp-runner launch (tp 2)"), peer(&dir, steps, embed[0])];
        if !same {
            outs.push(launch_two(&dir, &meg, steps, "smp-runner launch (tp 2)"));
            outs.push(peer(&dir, steps, embed[1]));
        }
        // every run against PyTorch's on the planner's plan
        let reference = losses(&outs[1]);
        for (i, o) in outs.iter().enumerate() {
            let l = losses(o);
            assert_eq!(l.len(), reference.len(), "{}: step count", names[i]);
            worst[i] = l.iter().zip(&reference).map(|(x, y)| (x - y).abs() / y.abs()).fold(worst[i], f64::max);
            wall[i].push(mean_step(o));
            cpu[i].push(mean_cpu(o));
        }
        let line = (0..runs).map(|i| format!("{} {:.1} ms/step ({:.1} ms CPU)", names[i], wall[i][r] * 1e3, cpu[i][r] * 1e3)).collect::<Vec<_>>().join(", ");
        println!("round {r}: {line}");
        last_phases[0] = phases(&outs[0]);
        if !same {
            last_phases[1] = phases(&outs[2]);
        }
    }
    for (i, w) in worst.iter().enumerate().take(runs) {
        assert!(*w < 1e-4, "{}'s losses differ from PyTorch's by {w:.2e}", names[i]);
    }
    let med = |v: &Vec<f64>| median(v.clone());
    println!("HF Llama 4 × 256 (8 heads, 2 KV heads, intermediate 704, vocab 2048), batch 8 × 128, tp 2 = 2 ranks × 1 thread, f32, {rounds} rounds × {steps} steps (first excluded)");
    println!("load average before {load_before}, after {}", load());
    println!(
        "losses agree with PyTorch (planner's plan) within {}",
        (0..runs).filter(|&i| i != 1).map(|i| format!("{:.1e} ({})", worst[i], names[i])).collect::<Vec<_>>().join(", ")
    );
    for (k, ph) in last_phases.iter().enumerate().take(runs / 2) {
        println!("{} phases (last round):", names[2 * k]);
        for l in ph {
            println!("  {l}");
        }
    }
    for k in 0..runs / 2 {
        let (a, b) = (med(&wall[2 * k]), med(&wall[2 * k + 1]));
        let (ca, cb) = (med(&cpu[2 * k]), med(&cpu[2 * k + 1]));
        println!("{:<34} {:.1} ms/step (median of rounds), rank 0 CPU {:.1} ms/step", names[2 * k], a * 1e3, ca * 1e3);
        println!("{:<34} {:.1} ms/step, rank 0 CPU {:.1} ms/step", names[2 * k + 1], b * 1e3, cb * 1e3);
        println!("  ratio PyTorch / runner {:.2} (goal: ≥ 1.0, the runner as fast or faster); CPU ratio {:.2}", b / a, cb / ca);
    }
}
