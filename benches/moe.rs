//! The fused `MixtureOfExperts` kernel against the dense form the front door exports, side by
//! side in one process: one Mixtral sparse-MoE block (8 experts, top-2, hidden 256, expert
//! intermediate 512, HF's default init; `benches/peers/moe_block.py`) trained on 8 × 128
//! tokens (MSE against fixed targets, AdamW), 1 thread. The same file runs twice: as exported
//! (every expert on every token) and with its experts fused as analysis fuses them (each token
//! through its 2 experts). The two alternate, ROUNDS times, each STEPS steps (first excluded);
//! prints each round's ms/step, the medians and the ratio exported / fused (> 1: fused faster).
//!
//!     cargo bench --features runner --profile dev --bench moe [-- ROUNDS STEPS]

#[path = "peers/mod.rs"]
mod peers;

use std::path::Path;
use std::process::Command;

use peers::{load, median, ok, python, repo};
use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{FusedOp, Graph};
use smp_partition::passes::{self, AnalyzeOptions, fuse};
use smp_partition::runtime::train::{self, LossKind, TrainConfig};
use smp_partition::runtime::{ExecOptions, Executor, InitMode, Weights};
use tch::Kind;

/// Mean step time (s) of `steps` training steps of `graph` on the batch in `dir`, first excluded.
fn step_time(graph: &Graph, dir: &Path, steps: usize) -> f64 {
    let weights = Weights::load(graph, InitMode::Load, Some(Kind::Float)).expect("weights");
    let exec = Executor::new(graph, weights, ExecOptions { float_kind: Some(Kind::Float), training: true, autocast: None }).expect("executor");
    let batch = smp_partition::runtime::data::read_batch(&exec, &dir.join("batch.npz")).expect("batch");
    let cfg = TrainConfig { steps, microbatches: 1, loss: LossKind::Mse, ..TrainConfig::default() };
    let recs = train::train(&exec, &batch, &cfg).expect("train");
    let timed = &recs[usize::from(recs.len() > 1)..];
    timed.iter().map(|r| r.time_s).sum::<f64>() / timed.len().max(1) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rounds, steps) = (arg(0, 3), arg(1, 4));
    tch::set_num_threads(1);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let script = repo().join("benches/peers/moe_block.py");
    ok("moe_block.py", Command::new(python()).arg(&script).arg(dir).output().expect("run moe_block.py"));
    let g = load_model(&dir.join("moe_block.onnx")).expect("moe_block.onnx").graph;
    let dense = passes::specialise(g, &AnalyzeOptions::default()).expect("specialise").0;
    let mut fused = dense.clone();
    let records = fuse::fuse(&mut dense.clone());
    let experts: Vec<_> = records.iter().filter(|r| matches!(r.op, FusedOp::MixtureOfExperts { .. })).collect();
    assert_eq!(experts.len(), 1, "the block's experts fuse");
    for r in experts {
        fuse::apply(&mut fused, r).expect("apply");
    }
    let load_before = load();
    let (mut d, mut f) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        d.push(step_time(&dense, dir, steps));
        f.push(step_time(&fused, dir, steps));
        println!("round {r}: exported (dense) {:.1} ms/step, fused {:.1} ms/step", d[r] * 1e3, f[r] * 1e3);
    }
    let (d, f) = (median(d), median(f));
    println!("Mixtral MoE block, 8 experts top-2, hidden 256, intermediate 512, 8 × 128 tokens, 1 thread, {rounds} rounds × {steps} steps (first excluded)");
    println!("load average before {load_before}, after {}", load());
    println!("exported (dense)  {:.1} ms/step (median of rounds)", d * 1e3);
    println!("fused             {:.1} ms/step", f * 1e3);
    println!("ratio exported / fused {:.2} (acceptance: > 1, fused faster)", d / f);
}
