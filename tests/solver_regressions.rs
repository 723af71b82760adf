//! Cases where the pipeline ILP once answered wrongly, kept as regression tests.

use smp_partition::solve::ilp::SolverOptions;
use smp_partition::solve::oracle::brute_force_pipeline;
use smp_partition::solve::problem::*;

/// Found by `solver_props` with a random seed: interleaved (p 2, v 2), a first layer with
/// zero output bytes followed by a run of four identical layers. With the DP layout given to
/// HiGHS as a MIP start, its objective equalled brute force (7.385) but the layout it returned
/// evaluated to 7.632 (a boundary transfer of 0.247 s unaccounted).
#[test]
fn interleaved_decode_counts_the_boundary_transfer() {
    let first = ParetoPoint { fwd_s: 0.05, bwd_s: 0.05, state_bytes: 0.0, act_bytes: 0.0, input_bytes: 0.0, offload_bytes: 0.0, sync_s: 0.28576900508164865, grad_scatter_s: 0.0, choice: 0, host_s: 0.0, shared_bytes: 0.0, gathered_bytes: 0.0, selective_bytes: 0.0, all_to_all_hidden_s: 0.0, gather_fwd_s: 0.0, loss_bytes: 0.0, loss_kept_bytes: 0.0 };
    let block = ParetoPoint { fwd_s: 0.05, bwd_s: 1.0998967206222787, state_bytes: 0.0, act_bytes: 0.0, input_bytes: 0.0, offload_bytes: 0.0, sync_s: 0.0, grad_scatter_s: 0.0, choice: 0, host_s: 0.0, shared_bytes: 0.0, gathered_bytes: 0.0, selective_bytes: 0.0, all_to_all_hidden_s: 0.0, gather_fwd_s: 0.0, loss_bytes: 0.0, loss_kept_bytes: 0.0 };
    let mut layers = vec![PipelineLayer { points: vec![first], output_bytes: 0.0, tied: Vec::new() }];
    for _ in 0..4 {
        layers.push(PipelineLayer { points: vec![block.clone()], output_bytes: 574109555.0632125, tied: Vec::new() });
    }
    let p = PipelineProblem {
        layers,
        devices: 2,
        virtual_stages: 2,
        microbatches: 2,
        in_flight: vec![1.0; 4], kept_flight: vec![], moments: vec![],
        bubble_coeff: 1.0,
        memory_cap: 1073741824.0,
        workspace: 536870912.0,
        gathered: 0.0,
        transfer_s_per_byte: vec![2.1513388596164551e-10, 0.0, 0.0],
        checkpoint: CheckpointRule::Auto,
        offload: OffloadRule::Never,
        loading_horizon: 4.0,
        fixed_chunks: None,
        fixed_checkpoints: None,
        objective: PipelineObjective::StepTime,
    };
    let (best, _, _) = brute_force_pipeline(&p).expect("feasible");
    let sol = p.solve(&SolverOptions::default()).expect("solves");
    let decoded = sol.eval.expect("a layout").step_s;
    assert!((decoded - best).abs() <= 1e-6 * best, "decoded {decoded} vs brute force {best}");
}

/// Found by `solver_props` (pure cuts, p 4, m 2): with the MIP start, the ILP claimed a max
/// stage of 2.839 s although one layer alone takes 3.315 s.
#[test]
fn pure_cut_max_stage_is_at_least_the_largest_layer() {
    let times = [0.01, 3.3147542006886694, 0.01, 0.4756540626892504, 0.01, 0.01, 0.01];
    let layers = times
        .iter()
        .map(|&t| PipelineLayer {
            tied: Vec::new(),
            points: vec![ParetoPoint { fwd_s: t / 3.0, bwd_s: 2.0 * t / 3.0, state_bytes: 0.0, act_bytes: 0.0, input_bytes: 0.0, offload_bytes: 0.0, sync_s: 0.0, grad_scatter_s: 0.0, choice: 0, host_s: 0.0, shared_bytes: 0.0, gathered_bytes: 0.0, selective_bytes: 0.0, all_to_all_hidden_s: 0.0, gather_fwd_s: 0.0, loss_bytes: 0.0, loss_kept_bytes: 0.0 }],
            output_bytes: 0.0,
        })
        .collect();
    let p = PipelineProblem {
        layers,
        devices: 4,
        virtual_stages: 1,
        microbatches: 2,
        in_flight: vec![1.0; 4], kept_flight: vec![], moments: vec![],
        bubble_coeff: 1.0,
        memory_cap: f64::INFINITY,
        workspace: 0.0,
        gathered: 0.0,
        transfer_s_per_byte: vec![0.0; 3],
        checkpoint: CheckpointRule::Never,
        offload: OffloadRule::Never,
        loading_horizon: 4.0,
        fixed_chunks: None,
        fixed_checkpoints: None,
        objective: PipelineObjective::StepTime,
    };
    let (dp, _) = smp_partition::solve::oracle::min_max_cuts(&times, 4).expect("cuts");
    let sol = p.solve(&SolverOptions::default()).expect("solves");
    let total: f64 = times.iter().sum();
    let ilp_max = (sol.report.objective - total) / (2.0 - 1.0);
    assert!((ilp_max - dp).abs() <= 1e-6 * dp, "ILP max stage {ilp_max} vs DP {dp}");
}

/// A tied weight's copy (owner layer 1, read again by the last layer): the balanced cut
/// 0-1 | 2-3 would hold the copy beside the owner's device and does not fit; 0 | 1-3 keeps
/// owner and reader on one device, so no copy, and fits; 0-2 | 3 fits too but is slower. An
/// ILP that ignored the copy would choose the first, one that always charged it the third.
#[test]
fn a_tied_copy_is_charged_only_where_the_owner_is_not() {
    const GIB: f64 = (1u64 << 30) as f64;
    let layer = |t: f64, tied: Vec<TiedCopy>| PipelineLayer {
        points: vec![ParetoPoint { fwd_s: t / 3.0, bwd_s: 2.0 * t / 3.0, state_bytes: GIB, act_bytes: 0.0, input_bytes: 0.0, offload_bytes: 0.0, sync_s: 0.0, grad_scatter_s: 0.0, choice: 0, host_s: 0.0, shared_bytes: 0.0, gathered_bytes: 0.0, selective_bytes: 0.0, all_to_all_hidden_s: 0.0, gather_fwd_s: 0.0, loss_bytes: 0.0, loss_kept_bytes: 0.0 }],
        output_bytes: 0.0,
        tied,
    };
    let copy = TiedCopy { weight: 0, owner: 1, elems: 0.0, trained: 0.0, state_bytes: 2.0 * GIB };
    let p = PipelineProblem {
        layers: vec![layer(1.0, vec![]), layer(1.0, vec![]), layer(1.0, vec![]), layer(0.5, vec![copy])],
        devices: 2,
        virtual_stages: 1,
        microbatches: 4,
        in_flight: vec![1.0; 2], kept_flight: vec![], moments: vec![],
        bubble_coeff: 1.0,
        memory_cap: 3.5 * GIB,
        workspace: 0.0,
        gathered: 0.0,
        transfer_s_per_byte: vec![0.0],
        checkpoint: CheckpointRule::Never,
        offload: OffloadRule::Never,
        loading_horizon: 4.0,
        fixed_chunks: None,
        fixed_checkpoints: None,
        objective: PipelineObjective::StepTime,
    };
    let (best, bf_choices, _) = brute_force_pipeline(&p).expect("feasible");
    let sol = p.solve(&SolverOptions::default()).expect("solves");
    let chunks: Vec<usize> = sol.choices.iter().map(|c| c.chunk).collect();
    assert_eq!(chunks, vec![0, 1, 1, 1], "the cut that keeps the owner with its reader");
    assert_eq!(bf_choices.iter().map(|c| c.chunk).collect::<Vec<_>>(), chunks);
    let eval = sol.eval.expect("a layout");
    assert!((eval.step_s - best).abs() <= 1e-9 * best, "ILP {} vs brute force {best}", eval.step_s);
    assert_eq!(eval.state_bytes, vec![GIB, 3.0 * GIB], "no copy beside its owner");
    // the balanced cut holds the copy on device 1
    let balanced: Vec<LayerChoice> = [0, 0, 1, 1].iter().map(|&chunk| LayerChoice { chunk, point: 0, checkpoint: false, offload: false }).collect();
    assert_eq!(p.evaluate(&balanced).expect("valid").state_bytes, vec![2.0 * GIB, 4.0 * GIB]);
}

/// Four identical blocks (1 GiB of their own activations each) reading one 2 GiB mask, over 2
/// devices: each device holds the mask once, not once per block. Only the balanced cut fits
/// 4.5 GiB (4.0 GiB on each device; 1 | 3 and 3 | 1 need 5.0); a mask counted per block
/// (6 GiB a device) fits nothing.
#[test]
fn a_shared_mask_is_held_once_per_chunk() {
    const GIB: f64 = (1u64 << 30) as f64;
    let block = PipelineLayer {
        points: vec![ParetoPoint { fwd_s: 1.0 / 3.0, bwd_s: 2.0 / 3.0, state_bytes: 0.0, act_bytes: GIB, input_bytes: 0.25 * GIB, offload_bytes: 0.0, sync_s: 0.0, grad_scatter_s: 0.0, choice: 0, host_s: 0.0, shared_bytes: 2.0 * GIB, gathered_bytes: 0.0, selective_bytes: 0.0, all_to_all_hidden_s: 0.0, gather_fwd_s: 0.0, loss_bytes: 0.0, loss_kept_bytes: 0.0 }],
        output_bytes: 0.5 * GIB,
        tied: Vec::new(),
    };
    let problem = |cap: f64, objective: PipelineObjective| PipelineProblem {
        layers: vec![block.clone(); 4],
        devices: 2,
        virtual_stages: 1,
        microbatches: 4,
        in_flight: vec![1.0; 2],
        kept_flight: vec![], moments: vec![],
        bubble_coeff: 1.0,
        memory_cap: cap,
        workspace: 0.0,
        gathered: 0.0,
        transfer_s_per_byte: vec![0.0],
        checkpoint: CheckpointRule::Never,
        offload: OffloadRule::Never,
        loading_horizon: 4.0,
        fixed_chunks: None,
        fixed_checkpoints: None,
        objective,
    };
    let balanced: Vec<LayerChoice> = [0, 0, 1, 1].iter().map(|&chunk| LayerChoice { chunk, point: 0, checkpoint: false, offload: false }).collect();
    let p = problem(4.5 * GIB, PipelineObjective::StepTime);
    assert_eq!(p.evaluate(&balanced).expect("valid").act_bytes, vec![4.0 * GIB, 4.0 * GIB]);
    let sol = p.solve(&SolverOptions::default()).expect("solves");
    assert_eq!(sol.choices.iter().map(|c| c.chunk).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
    assert_eq!(sol.eval.expect("a layout").act_bytes, vec![4.0 * GIB, 4.0 * GIB]);
    // the ILP's own memory rows agree with the evaluation
    let peak = problem(f64::INFINITY, PipelineObjective::PeakMemory { max_step_s: 1e9 }).solve(&SolverOptions::default()).expect("solves");
    assert!((peak.report.objective - 4.0 * GIB).abs() < 1e-6 * GIB, "least peak {} GiB", peak.report.objective / GIB);
    let tight = problem(3.9 * GIB, PipelineObjective::StepTime).solve(&SolverOptions::default()).expect("solves");
    assert!(tight.choices.is_empty(), "fits 3.9 GiB: {:?}", tight.choices);
    // checkpointed, each block keeps its own input and the mask stays held once
    let ck: Vec<LayerChoice> = balanced.iter().map(|c| LayerChoice { checkpoint: true, ..*c }).collect();
    let mut q = problem(f64::INFINITY, PipelineObjective::StepTime);
    q.checkpoint = CheckpointRule::Always;
    assert_eq!(q.evaluate(&ck).expect("valid").act_bytes, vec![(2.0 * 0.25 + 2.0 + 0.75) * GIB; 2]);
}
