//! Expert parallelism against PyTorch's, side by side in one run: the Mixtral sparse-MoE block
//! of benches/moe.rs (8 experts, top-2, hidden 256, expert intermediate 512, HF's default init;
//! `benches/peers/moe_block.py`) trained on 8 × 128 tokens (MSE, AdamW, gradient norm clipped at
//! 1) by 2 ranks × 1 thread, each rank half the batch and half the experts:
//! - the runner: `smp-runner launch` of the planner's dp 2 plan with `parallel.ep` = 2 (tokens
//!   to their experts and back by the c10d shim's all-to-all with per-rank counts, Gloo);
//! - PyTorch: `benches/peers/moe_ep_peer.py`, an all-to-all MoE layer written in PyTorch
//!   (`torch.distributed.nn.functional.all_to_all_single` with split sizes, Gloo);
//! - the runner's folded plan (tp 2 · ep 2 · etp 1, Megatron-Core's layout): the two ranks are
//!   one replica's tensor ranks, each routing half of the batch's tokens over the same expert
//!   group, the outputs all-gathered back (the router runs on every token on both ranks).
//!
//! The two alternate, ROUNDS times, each STEPS steps (first excluded); prints each round's
//! ms/step (and rank 0's CPU ms/step), the medians and the ratio PyTorch / runner (≥ 1: the runner as fast or faster), and
//! checks both trained the same losses (within 1e-5 relative).
//!
//!     cargo bench --features runner --profile dev --bench expert [-- ROUNDS STEPS]

#[path = "peers/mod.rs"]
mod peers;

use std::path::Path;
use std::process::Command;

use peers::{load, losses, mean_cpu, mean_step, median, ok, plan_two, python, repo};

/// One run of the runner's ep 2 plan: its output.
fn runner(dir: &Path, plan: &Path, steps: usize) -> std::process::Output {
    let out = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--data", dir.join("batch.npz").to_str().unwrap()])
        .args(["--loss", "mse", "--steps", &steps.to_string(), "--threads", "1", "--json", "--timeout", "300"])
        .output()
        .expect("run smp-runner");
    ok("smp-runner launch (ep 2)", out)
}

/// One run of PyTorch's all-to-all MoE layer on 2 ranks: its output.
fn pytorch(dir: &Path, steps: usize) -> std::process::Output {
    let out = Command::new(python()).arg(repo().join("benches/peers/moe_ep_peer.py")).arg(dir).arg(steps.to_string()).output().expect("run moe_ep_peer.py");
    ok("moe_ep_peer.py", out)
}


fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rounds, steps) = (arg(0, 3), arg(1, 6));
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    ok("moe_block.py", Command::new(python()).arg(repo().join("benches/peers/moe_block.py")).arg(dir).output().expect("run moe_block.py"));
    let dp2 = dir.join("dp2.json");
    let mut plan = plan_two(&dir.join("moe_block.onnx"), &dp2, &["--pp", "1", "--tp", "1", "--dp", "2", "--baseline", "megatron"]);
    plan["parallel"]["ep"] = serde_json::json!(2);
    let ep2 = dir.join("ep2.json");
    std::fs::write(&ep2, serde_json::to_vec(&plan).expect("plan JSON")).expect("write the ep 2 plan");

    let folded = dir.join("folded.json");
    plan_two(&dir.join("moe_block.onnx"), &folded, &["--pp", "1", "--tp", "2", "--dp", "1", "--ep", "2", "--etp", "1", "--no-sequence-parallel"]);

    let load_before = load();
    let (mut ours, mut theirs, mut ours_cpu, mut theirs_cpu) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut fold = Vec::new();
    let mut worst = 0.0f64;
    for r in 0..rounds {
        let (a, b, f) = (runner(dir, &ep2, steps), pytorch(dir, steps), runner(dir, &folded, steps));
        let (la, lb, lf) = (losses(&a), losses(&b), losses(&f));
        assert!(la.len() == lb.len() && lf.len() == lb.len(), "step counts");
        worst = la.iter().chain(&lf).zip(lb.iter().chain(&lb)).map(|(x, y)| (x - y).abs() / y.abs()).fold(worst, f64::max);
        fold.push(mean_step(&f));
        ours.push(mean_step(&a));
        theirs.push(mean_step(&b));
        ours_cpu.push(mean_cpu(&a));
        theirs_cpu.push(mean_cpu(&b));
        println!(
            "round {r}: runner ep 2 {:.1} ms/step ({:.1} ms CPU), PyTorch all-to-all MoE {:.1} ms/step ({:.1} ms CPU), runner folded {:.1} ms/step",
            ours[r] * 1e3,
            ours_cpu[r] * 1e3,
            theirs[r] * 1e3,
            theirs_cpu[r] * 1e3,
            fold[r] * 1e3
        );
    }
    assert!(worst < 1e-5, "the runner's and PyTorch's losses differ by {worst:.2e}");
    let (a, b) = (median(ours), median(theirs));
    let (ca, cb) = (median(ours_cpu), median(theirs_cpu));
    println!("Mixtral MoE block, 8 experts top-2, hidden 256, intermediate 512, 8 × 128 tokens, ep 2 = 2 ranks × 1 thread, {rounds} rounds × {steps} steps (first excluded)");
    println!("load average before {load_before}, after {}", load());
    println!("losses agree within {worst:.1e} (relative)");
    println!("runner ep 2             {:.1} ms/step (median of rounds)", a * 1e3);
    println!("PyTorch all-to-all MoE  {:.1} ms/step", b * 1e3);
    println!("ratio PyTorch / runner {:.2} (goal: ≥ 1.0, the runner as fast or faster)", b / a);
    let f = median(fold);
    println!("runner folded (tp 2 · ep 2 · etp 1) {:.1} ms/step; ratio PyTorch / folded {:.2}, ep 2 / folded {:.2}", f * 1e3, b / f, a / f);
    println!("CPU time per step on rank 0 (less sensitive to a loaded machine): runner {:.1} ms, PyTorch {:.1} ms, ratio {:.2}", ca * 1e3, cb * 1e3, cb / ca);
}
