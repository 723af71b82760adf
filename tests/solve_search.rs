//! The outer search and the baselines on synthetic GPT models.

mod common;

use smp_partition::cost::ClusterSpec;
use smp_partition::solve::oracle::brute_force_pipeline;
use smp_partition::solve::{Baseline, PlanOptions, SolveError, SolveStatus, plan};

fn small() -> smp_partition::ir::LayeredGraph {
    common::gpt(common::GptShape { layers: 6, hidden: 1024.0, heads: 16.0, seq: 1024.0, vocab: 32000.0 })
}

#[test]
fn plans_a_small_gpt_and_the_objective_is_the_evaluated_step() {
    let lg = small();
    let spec = ClusterSpec::parse("h100-80gb:8").unwrap();
    let d = plan(&lg, &spec, &PlanOptions { global_batch: Some(64), ..Default::default() }, &mut |_| {}).unwrap();
    assert_eq!(d.parallel.pp * d.parallel.tp * d.parallel.dp, 8);
    assert_eq!(d.solver.status, SolveStatus::Optimal);
    let eval = d.problem.evaluate(&d.choices).unwrap();
    assert!((eval.step_s - d.predicted.step_time_s).abs() <= 1e-9 * eval.step_s);
    assert!((d.solver.objective - eval.step_s).abs() <= 1e-6 * eval.step_s);
    assert!(d.predicted.peak_memory_bytes <= d.memory_limit_bytes);
    // Stages cover every layer once, in order.
    let mut next = 0;
    for s in &d.stages {
        assert_eq!(s.layers[0], next);
        next = s.layers[1] + 1;
    }
    assert_eq!(next, lg.layers.len());
    assert!(d.candidates_solved >= 1);
}

#[test]
fn chosen_candidate_is_optimal_by_brute_force() {
    // 8 layers, pp fixed to 2 with the other settings fixed: brute force the chosen problem.
    let lg = common::gpt(common::GptShape { layers: 5, hidden: 512.0, heads: 8.0, seq: 512.0, vocab: 8000.0 });
    let spec = ClusterSpec::parse("a100-40gb:4").unwrap();
    let mut cfg = PlanOptions { global_batch: Some(16), ..Default::default() };
    cfg.pp = Some(2);
    cfg.tp = Some(2);
    cfg.zero = Some(1);
    cfg.microbatches = Some(4);
    cfg.schedule = Some(smp_partition::ir::ScheduleKind::OneFOneB);
    cfg.placement = Some(smp_partition::solve::Placement::CLUSTER);
    let d = plan(&lg, &spec, &cfg, &mut |_| {}).unwrap();
    let (best, _, _) = brute_force_pipeline(&d.problem).unwrap();
    assert!((best - d.predicted.step_time_s).abs() <= 1e-6 * best, "{best} vs {}", d.predicted.step_time_s);
}

#[test]
fn automatic_plan_is_no_worse_than_the_baselines() {
    let lg = small();
    let spec = ClusterSpec::parse("h100-80gb:8").unwrap();
    let auto = plan(&lg, &spec, &PlanOptions { global_batch: Some(64), ..Default::default() }, &mut |_| {}).unwrap();
    for b in [Baseline::Megatron, Baseline::Uniform, Baseline::Parameters] {
        let mut cfg = PlanOptions { global_batch: Some(64), ..Default::default() };
        cfg.baseline = Some(b);
        let base = plan(&lg, &spec, &cfg, &mut |_| {}).unwrap();
        assert!(auto.predicted.step_time_s <= base.predicted.step_time_s * (1.0 + 1e-9), "{b:?}");
    }
}

#[test]
fn infeasible_says_what_would_fit() {
    let lg = common::gpt(common::GptShape { layers: 24, hidden: 8192.0, heads: 64.0, seq: 2048.0, vocab: 51200.0 });
    let spec = ClusterSpec::parse("a100-40gb:2").unwrap();
    let err = plan(&lg, &spec, &PlanOptions { global_batch: Some(8), ..Default::default() }, &mut |_| {}).unwrap_err();
    match err {
        SolveError::Infeasible { fix, .. } => {
            assert!(fix.contains("GiB per device"), "{fix}");
            assert!(fix.contains("devices"), "{fix}");
        }
        other => panic!("expected infeasible, got {other}"),
    }
}

#[test]
fn manual_layout_is_honoured() {
    let lg = small();
    let spec = ClusterSpec::parse("h100-80gb:8").unwrap();
    let mut cfg = PlanOptions { global_batch: Some(64), ..Default::default() };
    cfg.layout = Some(smp_partition::solve::Layout(vec![[0, 1], [2, 7]]));
    let d = plan(&lg, &spec, &cfg, &mut |_| {}).unwrap();
    assert_eq!(d.parallel.pp, 2);
    assert_eq!(d.stages[0].layers, [0, 1]);
    assert_eq!(d.stages[1].layers, [2, 7]);
}

#[test]
fn placement_puts_the_last_axis_on_consecutive_ranks() {
    use smp_partition::solve::{MeshAxis, Placement};
    let deg = [3, 2, 4]; // dp, pp, tp
    // cluster = DPT: tensor ranks consecutive, data-parallel replicas pp·tp apart.
    assert_eq!(Placement::CLUSTER.rank([0, 0, 1], deg), 1);
    assert_eq!(Placement::CLUSTER.rank([1, 0, 0], deg), 8);
    assert_eq!(Placement::CLUSTER.stride(MeshAxis::D, deg), 8);
    // spread = TPD: replicas consecutive, tensor ranks pp·dp apart.
    assert_eq!(Placement::SPREAD.rank([1, 0, 0], deg), 1);
    assert_eq!(Placement::SPREAD.rank([0, 0, 1], deg), 6);
    assert_eq!(Placement::SPREAD.stride(MeshAxis::T, deg), 6);
    // Every coordinate gets a distinct rank below the device count.
    let mut seen = std::collections::BTreeSet::new();
    for d in 0..3 {
        for p in 0..2 {
            for t in 0..4 {
                assert!(seen.insert(Placement::SPREAD.rank([d, p, t], deg)));
            }
        }
    }
    assert_eq!(seen.into_iter().max(), Some(23));
}
