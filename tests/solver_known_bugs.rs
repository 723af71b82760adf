//! Known solver bugs, pinned as failing cases until fixed (run with `cargo test -- --ignored`).

use smp_partition::solve::ilp::SolverOptions;
use smp_partition::solve::oracle::brute_force_pipeline;
use smp_partition::solve::problem::*;

/// Found by `solver_props` with a random seed: interleaved (p 2, v 2), a first layer with
/// zero output bytes followed by a run of four identical layers. HiGHS's objective equals brute
/// force (7.385), but the decoded layout puts two layers in chunk 0 and evaluates to 7.632: the
/// boundary-0 transfer (0.247 s) is missing from the ILP's own accounting of that layout.
#[test]
#[ignore = "known bug: pipeline ILP decode misses a boundary transfer (see doc comment)"]
fn interleaved_decode_counts_the_boundary_transfer() {
    let first = ParetoPoint { fwd_s: 0.05, bwd_s: 0.05, state_bytes: 0.0, act_bytes: 0.0, input_bytes: 0.0, sync_s: 0.28576900508164865, choice: 0 };
    let block = ParetoPoint { fwd_s: 0.05, bwd_s: 1.0998967206222787, state_bytes: 0.0, act_bytes: 0.0, input_bytes: 0.0, sync_s: 0.0, choice: 0 };
    let mut layers = vec![PipelineLayer { points: vec![first], output_bytes: 0.0 }];
    for _ in 0..4 {
        layers.push(PipelineLayer { points: vec![block.clone()], output_bytes: 574109555.0632125 });
    }
    let p = PipelineProblem {
        layers,
        devices: 2,
        virtual_stages: 2,
        microbatches: 2,
        in_flight: vec![1.0; 4],
        bubble_coeff: 1.0,
        memory_cap: 1073741824.0,
        workspace: 536870912.0,
        transfer_s_per_byte: vec![2.1513388596164551e-10, 0.0, 0.0],
        checkpoint: CheckpointRule::Auto,
        fixed_chunks: None,
        objective: PipelineObjective::StepTime,
    };
    let (best, _, _) = brute_force_pipeline(&p).expect("feasible");
    let sol = p.solve(&SolverOptions::default()).expect("solves");
    let decoded = sol.eval.expect("a layout").step_s;
    assert!((decoded - best).abs() <= 1e-6 * best, "decoded {decoded} vs brute force {best}");
}
