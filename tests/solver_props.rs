//! The ILPs against exact oracles on random small instances: brute force for the pipeline
//! and intra-layer problems, a PipeDream-style DP for pure cut problems.

use proptest::prelude::*;
use smp_partition::solve::oracle::{brute_force_intra, brute_force_pipeline, min_max_cuts, min_max_lower_bound};
use smp_partition::solve::problem::{
    CheckpointRule, IntraEdge, IntraLayerProblem, IntraNode, NodeOption, OffloadRule, ParetoPoint, PipelineLayer,
    PipelineObjective, PipelineProblem, TiedCopy,
};
use smp_partition::solve::heuristic::incumbent;
use smp_partition::solve::search::{bounds, pruning_bound, spread_lower_bound};
use smp_partition::solve::{SolveStatus, SolverOptions};

const GIB: f64 = (1u64 << 30) as f64;

fn point() -> impl Strategy<Value = ParetoPoint> {
    (0.05f64..2.0, 0.05f64..4.0, 0.0f64..8.0, 0.0f64..4.0, 0.0f64..1.0, 0.0f64..0.5, 0.0f64..3.0).prop_map(
        |(f, b, state, act, in_frac, sync, host)| ParetoPoint {
            fwd_s: f,
            bwd_s: b,
            state_bytes: state * GIB,
            act_bytes: act * GIB,
            input_bytes: act * in_frac * GIB,
            offload_bytes: act * in_frac * GIB,
            sync_s: sync,
            grad_scatter_s: 0.0,
            choice: 0,
            // copies from fully hidden (0) to several times the layer's compute
            host_s: host,
            shared_bytes: 0.0,
            gathered_bytes: 0.0,
            selective_bytes: 0.0,
            all_to_all_hidden_s: 0.0,
            gather_fwd_s: 0.0,
            loss_bytes: 0.0,
            loss_kept_bytes: 0.0,
        },
    )
}

fn layer() -> impl Strategy<Value = PipelineLayer> {
    // some layers read an input several layers share (a mask), the same at every point
    (prop::collection::vec(point(), 1..=2), 0.0f64..1.0, prop::option::of(0.0f64..1.5)).prop_map(|(mut points, out, shared)| {
        for pt in &mut points {
            pt.shared_bytes = shared.unwrap_or(0.0) * GIB;
        }
        PipelineLayer { points, output_bytes: out * GIB, tied: Vec::new() }
    })
}

#[derive(Debug, Clone)]
struct Instance(PipelineProblem);

fn instance() -> impl Strategy<Value = Instance> {
    (
        prop::collection::vec(layer(), 2..=7),
        prop::collection::vec(any::<bool>(), 7),
        1usize..=3,
        1usize..=2,
        1usize..=8,
        0usize..3,
        (0usize..3, 0usize..3, 1usize..=3, prop::option::of(prop::collection::vec(0.0f64..1.0, 8))),
        0.3f64..1.3,
        prop::collection::vec(0.0f64..0.3, 8),
        prop::collection::vec(0.0f64..1.0, 8),
        any::<bool>(),
        (prop::option::of(0usize..7), prop::collection::vec(0usize..7, 1..=2), 0.0f64..4.0),
    )
        .prop_filter_map(
            "layers must fill the chunks",
            |(mut layers, dup, p, v, m, coeff, (rule, offload, horizon, to_b), cap_frac, beta, inflight, memory_obj, (owner, readers, tie_bytes))| {
                let offload = [OffloadRule::Never, OffloadRule::Auto, OffloadRule::Always][offload];
                if offload == OffloadRule::Auto {
                    // three flag options per layer: keep brute force small
                    layers.truncate(5);
                }
                // Identical neighbours exercise the symmetry-breaking rows.
                for l in 1..layers.len() {
                    if dup[l] {
                        layers[l] = layers[l - 1].clone();
                    }
                }
                // A weight tied across layers: its readers hold a copy on devices without its owner.
                if let Some(owner) = owner.filter(|&o| o < layers.len()) {
                    let n = layers.len();
                    for r in readers.into_iter().filter(|&r| r < n && r != owner) {
                        layers[r].tied = vec![TiedCopy { weight: 0, owner, elems: 0.0, trained: 0.0, state_bytes: tie_bytes * GIB }];
                    }
                }
                let chunks = p * v;
                if layers.len() < chunks {
                    return None;
                }
                let total_state: f64 = layers.iter().map(|l| l.points[0].state_bytes).sum();
                let total_act: f64 = layers.iter().map(|l| l.points[0].act_bytes).sum();
                let cap = cap_frac * (total_state + m as f64 * total_act) / p as f64 + GIB;
                let in_flight: Vec<f64> = (0..chunks).map(|c| 1.0 + (inflight[c] * m as f64).floor()).collect();
                // as under ZB-H1: fewer microbatches between a forward and its B than to its W
                let kept_flight = to_b.map_or(Vec::new(), |k| (0..chunks).map(|c| 1.0 + (k[c] * (in_flight[c] - 1.0)).floor()).collect());
                Some(Instance(PipelineProblem {
                    layers,
                    devices: p,
                    virtual_stages: v,
                    microbatches: m,
                    in_flight,
                    kept_flight,
                    moments: Vec::new(),
                    bubble_coeff: [1.0, 0.5, 1.0 / 3.0][coeff],
                    memory_cap: cap,
                    workspace: 0.5 * GIB,
                    gathered: 0.0,
                    transfer_s_per_byte: beta[..chunks - 1].iter().map(|b| b / GIB).collect(),
                    checkpoint: [CheckpointRule::Auto, CheckpointRule::Never, CheckpointRule::Always][rule],
                    offload,
                    loading_horizon: horizon as f64,
                    fixed_chunks: None,
                    fixed_checkpoints: None,
                    objective: if memory_obj { PipelineObjective::PeakMemory { max_step_s: 0.0 } } else { PipelineObjective::StepTime },
                }))
            },
        )
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1.0)
}

proptest! {
    // Fixed seed so CI is reproducible. A random seed found two wrong answers, both caused by
    // the MIP start the pipeline ILP used to get (now removed); tests/solver_regressions.rs pins them.
    #![proptest_config(ProptestConfig { cases: 240, rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed_2026), ..ProptestConfig::default() })]

    #[test]
    fn pipeline_ilp_equals_brute_force(inst in instance()) {
        let mut p = inst.0;
        if let PipelineObjective::PeakMemory { .. } = p.objective {
            // Least memory within 5 % of the fastest step, as `--optimize memory` asks.
            let speed = PipelineProblem { objective: PipelineObjective::StepTime, ..p.clone() };
            match brute_force_pipeline(&speed) {
                Some((best, _, _)) => p.objective = PipelineObjective::PeakMemory { max_step_s: best * 1.05 },
                None => p.objective = PipelineObjective::StepTime,
            }
        }
        let bf = brute_force_pipeline(&p);
        let sol = p.solve(&SolverOptions::default()).unwrap();
        match bf {
            None => prop_assert_eq!(sol.report.status, SolveStatus::Infeasible),
            Some((obj, _, _)) => {
                prop_assert_eq!(sol.report.status, SolveStatus::Optimal);
                prop_assert!(close(sol.report.objective, obj), "ILP {} vs brute force {}", sol.report.objective, obj);
                prop_assert!(sol.report.gap <= 1e-6, "gap {}", sol.report.gap);
                let e = sol.eval.clone().unwrap();
                prop_assert!(p.feasible(&e));
                prop_assert!(close(p.objective_value(&e), obj), "decoded {} vs {}", p.objective_value(&e), obj);
                if p.objective == PipelineObjective::StepTime && p.offload == OffloadRule::Auto {
                    // offloading only where memory needs it
                    for l in 0..sol.choices.len() {
                        let mut fewer = sol.choices.clone();
                        if fewer[l].offload {
                            fewer[l].offload = false;
                            prop_assert!(!p.feasible(&p.evaluate(&fewer).unwrap()), "layer {} offloaded without need", l);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn search_bounds_and_quick_layouts_bracket_the_optimum(inst in instance()) {
        // The outer search prunes by `bounds` and starts from `incumbent`: the first must
        // never exceed the optimum, the second must be a feasible layout (so never below it).
        let p = PipelineProblem { objective: PipelineObjective::StepTime, ..inst.0 };
        let bf = brute_force_pipeline(&p);
        let (lb, mem_lb) = bounds(&p);
        let quick = incumbent(&p);
        match bf {
            None => prop_assert!(quick.is_none(), "a quick layout where brute force finds none"),
            Some((obj, _, e)) => {
                prop_assert!(lb <= obj * (1.0 + 1e-9) + 1e-12, "bound {} above the optimum {}", lb, obj);
                // The interleaved pruning bound: never looser than the order's, never above the optimum.
                let tight = pruning_bound(&p);
                prop_assert!(tight >= lb && tight <= obj * (1.0 + 1e-9) + 1e-12, "pruning bound {} vs bound {} and optimum {}", tight, lb, obj);
                let peak = e.total_bytes.iter().cloned().fold(0.0, f64::max);
                prop_assert!(mem_lb <= peak * (1.0 + 1e-9) + 1e-6, "memory bound {} above {}", mem_lb, peak);
                if let Some((choices, e)) = quick {
                    prop_assert!(p.feasible(&e));
                    let again = p.evaluate(&choices).unwrap();
                    prop_assert!(close(again.step_s, e.step_s));
                    prop_assert!(e.step_s >= obj * (1.0 - 1e-9), "quick {} below the optimum {}", e.step_s, obj);
                }
            }
        }
    }

    #[test]
    fn ilp_below_a_cutoff_finds_the_optimum_or_proves_none(inst in instance(), above in any::<bool>()) {
        // The search hands each ILP its incumbent as a cutoff row: just above the optimum the
        // ILP must still find it; just below it the ILP must report that nothing fits.
        let p = PipelineProblem { objective: PipelineObjective::StepTime, ..inst.0 };
        let Some((obj, _, _)) = brute_force_pipeline(&p) else { return Ok(()) };
        let cutoff = if above { obj * (1.0 + 1e-6) } else { obj * (1.0 - 1e-4) };
        let sol = p.solve_below(&SolverOptions::default(), Some(cutoff)).unwrap();
        if above {
            prop_assert_eq!(sol.report.status, SolveStatus::Optimal);
            prop_assert!(close(sol.report.objective, obj), "ILP {} vs brute force {}", sol.report.objective, obj);
            let e = sol.eval.clone().unwrap();
            prop_assert!(p.feasible(&e) && close(e.step_s, obj));
        } else {
            prop_assert_eq!(sol.report.status, SolveStatus::Infeasible, "found {} below the optimum {}", sol.report.objective, obj);
        }
    }

    #[test]
    fn spread_bound_never_exceeds_the_best_assignment(times in prop::collection::vec(0.0f64..5.0, 1..=8), bins in 1usize..=4) {
        // Brute force: every assignment of the items to bins, contiguous or not.
        let n = times.len();
        let mut best = f64::INFINITY;
        for code in 0..bins.pow(n as u32) {
            let mut load = vec![0.0; bins];
            let mut c = code;
            for &t in &times {
                load[c % bins] += t;
                c /= bins;
            }
            best = best.min(load.iter().cloned().fold(0.0, f64::max));
        }
        let lb = spread_lower_bound(&times, bins);
        prop_assert!(lb <= best * (1.0 + 1e-12), "spread bound {} above the best assignment {}", lb, best);
        prop_assert!(lb >= times.iter().cloned().fold(0.0, f64::max), "spread bound {} below the largest item", lb);
    }

    #[test]
    fn pure_cut_ilp_equals_dp(times in prop::collection::vec(0.01f64..5.0, 2..=14), p in 1usize..=5, m in 2usize..=16) {
        prop_assume!(times.len() >= p);
        let layers = times.iter().map(|&t| PipelineLayer {
            tied: Vec::new(),
            points: vec![ParetoPoint { fwd_s: t / 3.0, bwd_s: 2.0 * t / 3.0, state_bytes: 0.0, act_bytes: 0.0, input_bytes: 0.0, offload_bytes: 0.0, sync_s: 0.0, grad_scatter_s: 0.0, choice: 0, host_s: 0.0, shared_bytes: 0.0, gathered_bytes: 0.0, selective_bytes: 0.0, all_to_all_hidden_s: 0.0, gather_fwd_s: 0.0, loss_bytes: 0.0, loss_kept_bytes: 0.0 }],
            output_bytes: 0.0,
        }).collect();
        let prob = PipelineProblem {
            layers, devices: p, virtual_stages: 1, microbatches: m, in_flight: vec![1.0; p], kept_flight: vec![], moments: vec![], bubble_coeff: 1.0,
            memory_cap: f64::INFINITY, workspace: 0.0, gathered: 0.0, transfer_s_per_byte: vec![0.0; p - 1],
            checkpoint: CheckpointRule::Never, offload: OffloadRule::Never, loading_horizon: 4.0, fixed_chunks: None, fixed_checkpoints: None,
            objective: PipelineObjective::StepTime,
        };
        let (dp, _) = min_max_cuts(&times, p).unwrap();
        let fast = min_max_lower_bound(&times, p);
        prop_assert!(fast <= dp * (1.0 + 1e-12) && fast >= dp * (1.0 - 1e-9), "bisection {} vs DP {}", fast, dp);
        let sol = prob.solve(&SolverOptions::default()).unwrap();
        prop_assert_eq!(sol.report.status, SolveStatus::Optimal);
        let total: f64 = times.iter().sum();
        let ilp_max = (sol.report.objective - total) / (m as f64 - 1.0);
        prop_assert!(close(ilp_max, dp), "ILP max stage {} vs DP {}", ilp_max, dp);
    }

    #[test]
    fn intra_ilp_equals_brute_force(
        n in 2usize..=5,
        opts in prop::collection::vec(prop::collection::vec((0.0f64..1.0, 0.0f64..1.0, 0.0f64..4.0, 0.0f64..4.0), 1..=3), 5),
        edges in prop::collection::vec((0usize..5, 0usize..5, prop::collection::vec(0.0f64..0.5, 9), prop::collection::vec(0.0f64..1.0, 9)), 0..6),
        cap in prop::option::of(0.0f64..16.0),
    ) {
        let nodes: Vec<IntraNode> = (0..n).map(|i| IntraNode {
            name: format!("n{i}"),
            options: opts[i].iter().map(|&(f, b, pb, ab)| NodeOption { name: "k".into(), fwd_s: f, bwd_s: b, param_bytes: pb, act_bytes: ab, sync_s: 0.0 }).collect(),
        }).collect();
        // Some option pairs forbidden (as codegen forbids column → column), so some instances
        // have no feasible assignment at all.
        let edges: Vec<IntraEdge> = edges.iter().filter(|(a, b, _, _)| a < b && *b < n).map(|(a, b, c, f)| {
            let (ka, kb) = (nodes[*a].options.len(), nodes[*b].options.len());
            let m: Vec<Vec<f64>> = (0..ka).map(|i| (0..kb).map(|j| c[i * 3 + j]).collect()).collect();
            let forbidden = (0..ka).flat_map(|i| (0..kb).map(move |j| (i, j))).filter(|&(i, j)| f[i * 3 + j] < 0.25).collect();
            IntraEdge { from: *a, to: *b, fwd_s: m.clone(), bwd_s: m, forbidden }
        }).collect();
        let prob = IntraLayerProblem { nodes, edges, memory_cap: cap, act_weight: 1.5 };
        let bf = brute_force_intra(&prob);
        let (report, sol) = prob.solve(false, None, &SolverOptions::default()).unwrap();
        match bf {
            None => prop_assert_eq!(report.status, SolveStatus::Infeasible),
            Some((t, _)) => {
                prop_assert_eq!(report.status, SolveStatus::Optimal);
                prop_assert!(close(report.objective, t), "ILP {} vs brute force {}", report.objective, t);
                let s = sol.unwrap();
                prop_assert!(close(s.fwd_s + s.bwd_s, t));
            }
        }
    }
}

/// GPT-3's 96 equal blocks with a lighter head and embedding on 8 devices: some device holds
/// 12 blocks and the head (or 13 blocks), above the mean load of 12.05 blocks that the
/// interleaved bound used alone.
#[test]
fn spread_bound_sees_the_head_beside_twelve_blocks() {
    let mut times = vec![0.03];
    times.extend(std::iter::repeat_n(1.0, 96));
    times.push(0.4);
    let lb = spread_lower_bound(&times, 8);
    assert!((lb - 12.4).abs() < 1e-9, "{lb}");
}

/// The pruning bound splits the stages with their memory: three 1F1B stages keep 3, 2 and 1
/// microbatches, and six equal layers balance 2-2-2 by time (each stage 6 s), but the first
/// stage holds two layers only by recomputing one (its forward, 1 s, added): the busiest stage
/// takes at least 7 s, which the order's bound (6 s) does not see. Brute force is the oracle.
#[test]
fn pruning_bound_splits_the_stages_with_their_memory() {
    let pt = ParetoPoint {
        fwd_s: 1.0,
        bwd_s: 2.0,
        state_bytes: GIB,
        act_bytes: GIB,
        input_bytes: 0.25 * GIB,
        offload_bytes: 0.0,
        sync_s: 0.0,
        grad_scatter_s: 0.0,
        choice: 0,
        host_s: 0.0,
        shared_bytes: 0.0,
        gathered_bytes: 0.0,
        selective_bytes: 0.0,
        all_to_all_hidden_s: 0.0,
        gather_fwd_s: 0.0,
        loss_bytes: 0.0,
        loss_kept_bytes: 0.0,
    };
    let layer = PipelineLayer { points: vec![pt], output_bytes: 0.0, tied: Vec::new() };
    let p = PipelineProblem {
        layers: vec![layer; 6],
        devices: 3,
        virtual_stages: 1,
        microbatches: 6,
        in_flight: vec![3.0, 2.0, 1.0],
        kept_flight: vec![],
        moments: vec![],
        bubble_coeff: 1.0,
        memory_cap: 7.5 * GIB,
        workspace: 0.5 * GIB,
        gathered: 0.0,
        transfer_s_per_byte: vec![0.0; 2],
        checkpoint: CheckpointRule::Auto,
        offload: OffloadRule::Never,
        loading_horizon: 1.0,
        fixed_chunks: None,
        fixed_checkpoints: None,
        objective: PipelineObjective::StepTime,
    };
    let (order, _) = bounds(&p);
    let tight = pruning_bound(&p);
    let (opt, _, _) = brute_force_pipeline(&p).expect("2-2-2 with one layer recomputed fits");
    // busy 18 s; the busiest stage 6 s by time alone, 7 s with memory; 5 more microbatches
    assert!(close(order, 18.0 + 5.0 * 6.0), "order bound {order}");
    assert!(close(tight, 18.0 + 5.0 * 7.0), "pruning bound {tight}");
    assert!(tight <= opt * (1.0 + 1e-9), "pruning bound {tight} above the optimum {opt}");
    // a cap that no split meets: the first stage alone cannot hold its share
    let tiny = PipelineProblem { memory_cap: 2.0 * GIB, ..p.clone() };
    assert!(brute_force_pipeline(&tiny).is_none());
    assert!(pruning_bound(&tiny).is_infinite());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed_0039), ..ProptestConfig::default() })]

    /// Under interleaving, the activations the plan reports per device are the most the device
    /// holds at any moment of its schedule (the schedule's own actions replayed: each chunk's
    /// bytes grow with the microbatches it holds), never more than the search's bound (each
    /// chunk at its own most), and the bound itself with one chunk per device.
    #[test]
    fn reported_interleaved_peak_is_the_schedules_largest_moment(inst in instance(), p in 1usize..=4, m in 1usize..=12, v in 1usize..=3, ck in prop::collection::vec(any::<bool>(), 7)) {
        use smp_partition::ir::schedule::{ActionKind, compute_actions};
        use smp_partition::ir::ScheduleKind;
        use smp_partition::solve::problem::LayerChoice;
        let kind = if v == 1 { ScheduleKind::OneFOneB } else { ScheduleKind::Interleaved { virtual_stages: v } };
        let Ok(ranks) = compute_actions(kind, p, m) else { return Ok(()) };
        let chunks = p * v;
        let mut prob = inst.0;
        prop_assume!(prob.layers.len() >= chunks);
        prob.devices = p;
        prob.virtual_stages = v;
        prob.microbatches = m;
        prob.in_flight = smp_partition::cost::stage_in_flights(kind, p, m);
        prob.kept_flight = Vec::new();
        prob.offload = OffloadRule::Never;
        prob.moments = if v > 1 { smp_partition::cost::rank_moments(kind, p, m) } else { Vec::new() };
        let n = prob.layers.len();
        let choices: Vec<LayerChoice> = (0..n).map(|l| LayerChoice { chunk: l * chunks / n, point: 0, checkpoint: ck[l], offload: false }).collect();
        let (bound, peak) = (prob.bound_chunk_activations(&choices), prob.peak_chunk_activations(&choices));
        for (r, actions) in ranks.iter().enumerate() {
            // bytes per microbatch held of each chunk
            let per: Vec<f64> = (0..chunks).map(|c| if prob.in_flight[c] > 0.0 { bound[c] / prob.in_flight[c] } else { 0.0 }).collect();
            let mut alive = vec![0.0f64; chunks];
            let mut most = 0.0f64;
            for a in actions.iter().filter(|a| a.stage % p == r) {
                match a.kind {
                    ActionKind::Forward => {
                        alive[a.stage] += 1.0;
                        most = most.max((0..chunks).filter(|c| c % p == r).map(|c| alive[c] * per[c]).sum());
                    }
                    ActionKind::Backward => alive[a.stage] -= 1.0,
                    _ => {}
                }
            }
            let reported: f64 = (0..chunks).filter(|c| c % p == r).map(|c| peak[c]).sum();
            let bounded: f64 = (0..chunks).filter(|c| c % p == r).map(|c| bound[c]).sum();
            prop_assert!(close(reported, most), "rank {r}: reported {reported}, the schedule's largest moment {most}");
            prop_assert!(reported <= bounded * (1.0 + 1e-9));
            if v == 1 {
                prop_assert!(close(reported, bounded));
            }
        }
    }
}
