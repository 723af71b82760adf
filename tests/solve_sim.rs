//! The simulator referees the ILP's step time: the chosen plan's stage times are replayed on
//! the lowered schedule and compared with the pipeline part of the objective.

mod common;

use smp_partition::codegen::lower::{LowerOptions, lower_schedule};
use smp_partition::cost::ClusterSpec;
use smp_partition::ir::ScheduleKind;
use smp_partition::sim::replay::{CostTable, simulate};
use smp_partition::solve::{CheckpointRule, PlanOptions, PlanDecision, plan};

fn decide(kind: ScheduleKind, layers: usize, m: usize) -> PlanDecision {
    let lg = common::gpt(common::GptShape { layers, hidden: 1024.0, heads: 16.0, seq: 1024.0, vocab: 32000.0 });
    let spec = ClusterSpec::parse("h100-80gb:4").unwrap();
    let mut cfg = PlanOptions { global_batch: Some((4 * m) as u64), ..Default::default() };
    cfg.pp = Some(4);
    cfg.microbatches = Some(m);
    cfg.schedule = Some(kind);
    cfg.checkpointing = Some(CheckpointRule::Never);
    plan(&lg, &spec, &cfg, &mut |_| {}).unwrap()
}

/// Simulated pipeline time of the decision (no transfers, no data-parallel sync).
fn simulated(d: &PlanDecision) -> f64 {
    let progs = lower_schedule(d.parallel.schedule, d.parallel.pp, d.parallel.microbatches, &LowerOptions::default()).unwrap();
    let split = d.parallel.schedule == ScheduleKind::ZbH1;
    let table = CostTable {
        forward: d.stages.iter().map(|s| s.forward_s).collect(),
        backward_input: d.stages.iter().map(|s| if split { s.backward_s / 2.0 } else { s.backward_s }).collect(),
        backward_weight: d.stages.iter().map(|s| if split { s.backward_s / 2.0 } else { 0.0 }).collect(),
        activation_bytes: vec![1.0; d.stages.len()],
        comm: None,
        optimizer: 0.0,
    };
    simulate(&progs, &table).unwrap().step_time
}

/// The ILP's pipeline term: c·ΣT + (m − c)·max T over pipeline ranks.
fn ilp_pipeline(d: &PlanDecision) -> f64 {
    let e = d.problem.evaluate(&d.choices).unwrap();
    d.predicted.step_time_s - e.transfer_s - e.sync_s
}

#[test]
fn one_f_one_b_and_gpipe_objective_bounds_the_simulator_from_above() {
    // ΣT + (m − 1)·max T is exact on equal stages and an upper bound otherwise: the replay
    // overlaps part of the fill and drain of the faster stages. The gap is below the
    // imbalance between the slowest and fastest stage, per rank.
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
        let d = decide(kind, 8, 8);
        let (sim, ilp) = (simulated(&d), ilp_pipeline(&d));
        let t: Vec<f64> = d.stages.iter().map(|s| s.forward_s + s.backward_s).collect();
        let spread = t.iter().cloned().fold(0.0, f64::max) - t.iter().cloned().fold(f64::INFINITY, f64::min);
        assert!(sim <= ilp * (1.0 + 1e-9), "{kind}: simulated {sim} above ILP {ilp}");
        assert!(ilp - sim <= (d.parallel.pp as f64 - 1.0) * spread + 1e-12, "{kind}: simulated {sim} vs ILP {ilp}, spread {spread}");
    }
}

#[test]
fn interleaved_and_zb_h1_are_within_the_stated_bound() {
    // The ILP prices interleaving as c = 1/v of 1F1B's bubble and ZB-H1 as 1/3 (equal F, B,
    // W); with unequal chunks the replay differs, by less than one stage time per rank.
    for kind in [ScheduleKind::Interleaved { virtual_stages: 2 }, ScheduleKind::ZbH1] {
        let d = decide(kind, 10, 8);
        let (sim, ilp) = (simulated(&d), ilp_pipeline(&d));
        let tmax = d.stages.iter().map(|s| s.forward_s + s.backward_s).fold(0.0, f64::max);
        assert!((sim - ilp).abs() <= (d.parallel.pp as f64) * tmax, "{kind}: simulated {sim} vs ILP {ilp}");
    }
}

#[test]
fn zb_h1_with_fewer_microbatches_than_stages_matches_the_replay() {
    // With m < p the last microbatch's backward chain cannot hide behind other work: the ILP
    // prices it with c = (2p − m − 1)/(3(p − 1)), exact for equal F, B and W on equal stages.
    // Before, c = 1/3 whatever m, which for m = 1 claimed a third of the real bubble.
    for m in [1, 2, 3] {
        let d = decide(ScheduleKind::ZbH1, 8, m);
        let (sim, ilp) = (simulated(&d), ilp_pipeline(&d));
        let t: Vec<f64> = d.stages.iter().map(|s| s.forward_s + s.backward_s).collect();
        let spread = t.iter().cloned().fold(0.0, f64::max) - t.iter().cloned().fold(f64::INFINITY, f64::min);
        let fb = d.stages.iter().map(|s| (s.forward_s - s.backward_s / 2.0).abs()).fold(0.0, f64::max);
        eprintln!("m {m}: sim {sim} ilp {ilp} spread {spread} |F-B| {fb}");
        // Within one stage-time spread (the old c = 1/3 was off by more than that).
        assert!(
            (sim - ilp).abs() <= spread + d.parallel.pp as f64 * fb + 1e-12,
            "m {m}: simulated {sim} vs ILP {ilp} (spread {spread}, |F − B| {fb})"
        );
    }
}
