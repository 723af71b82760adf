//! A hand-made plan shared by the plan tests.
#![allow(dead_code)]

use smp_partition::cost::LinkKind;
use smp_partition::plan::schema::*;

pub const GIB: u64 = 1 << 30;

fn memory(params: u64, activations: u64) -> StageMemory {
    let m = StageMemory {
        params,
        grads: params,
        optimizer: 6 * params,
        activations,
        recompute: 0,
        loss: 0,
        workspace: GIB / 4,
        total: 0,
    };
    StageMemory { total: m.sum_of_parts(), ..m }
}

/// pp 2 · tp 2 · dp 1 over 6 layers on 4 devices.
pub fn fixture() -> Plan {
    let stages = vec![
        Stage {
            index: 0,
            pp_rank: 0,
            layers: [0, 2],
            ranks: vec![0, 1],
            tp: 2,
            dp: 1,
            forward_s: 0.010,
            backward_s: 0.020,
            comm_s: 0.002,
            output_bytes: 1 << 20,
            memory_bytes: memory(GIB, 2 * GIB),
            checkpointed_layers: vec![],
            selective_layers: Vec::new(),
            offloaded_layers: vec![],
            offloaded_bytes: 0,
        },
        Stage {
            index: 1,
            pp_rank: 1,
            layers: [3, 5],
            ranks: vec![2, 3],
            tp: 2,
            dp: 1,
            forward_s: 0.012,
            backward_s: 0.024,
            comm_s: 0.001,
            output_bytes: 0,
            memory_bytes: memory(GIB, GIB),
            checkpointed_layers: vec![4],
            selective_layers: Vec::new(),
            offloaded_layers: vec![],
            offloaded_bytes: 0,
        },
    ];
    let mut plan = Plan {
        version: PLAN_VERSION,
        model: ModelInfo {
            path: "models/tiny.onnx".into(),
            sha256: "00".repeat(32),
            params: 124_000_000,
            layers: 6,
        },
        cluster: ClusterInfo {
            preset: "a100-40gb".into(),
            devices: 4,
            devices_per_node: 4,
            memory_limit_bytes: 40 * GIB,
            machine: None,
        },
        parallel: smp_partition::ir::Parallelism {
            pp: 2,
            tp: 2,
            dp: 1,
            cp: 1,
            ep: 1,
            etp: 2,
            zero: 0,
            sharded_dp: None,
            microbatches: 4,
            active_microbatches: None,
            schedule: smp_partition::ir::ScheduleKind::OneFOneB,
            checkpointing: smp_partition::solve::CheckpointRule::Auto,
            selective_policy: Default::default(),
            placement: smp_partition::solve::Placement::CLUSTER,
            sequence_parallel: false,
            precision: smp_partition::ir::Precision::Bf16Mixed,
            offload: smp_partition::ir::OffloadRule::Auto,
            loading_horizon: smp_partition::ir::OffloadRule::DEFAULT_HORIZON,
            fp32_main_grads: false,
            expert_overlap: false,
            grad_overlap: false,
            float8_linears: false,
        },
        stages,
        layer_strategies: vec![LayerStrategy {
            layer: 1,
            name: "h.0".into(),
            strategy: "megatron".into(),
            nodes: vec![("h.0.attn.qkv".into(), smp_partition::split::Strategy::Column), ("h.0.attn.proj".into(), smp_partition::split::Strategy::Row)],
            parts: vec![],
        }],
        communication: vec![
            CommVolume { kind: Traffic::Tensor, link: LinkKind::IntraNode, bytes: 3.0e8, time_s: 0.012 },
            CommVolume { kind: Traffic::Pipeline, link: LinkKind::IntraNode, bytes: 1.0e7, time_s: 0.001 },
        ],
        predicted: Predicted {
            step_time_s: 0.185,
            samples_per_s: 43.2,
            bubble_ratio: 0.25,
            peak_memory_bytes: 0,
            mfu: 0.31,
            hfu: 0.31,
        },
        solver: SolverInfo {
            status: PlanStatus::Solved(smp_partition::solve::SolveStatus::Optimal),
            objective: 0.185,
            bound: 0.185,
            gap: 0.0,
            wall_s: 0.0,
            candidates: Candidates { solved: 3, skipped: 9 },
        },
        global_batch: 8,
        seq_len: Some(128),
        dims: Default::default(),
        trainable: Vec::new(),
        frozen: Vec::new(),
        batch_statistics: None,
        request: None,
        codegen: None,
        axes: None,
    };
    plan.predicted.peak_memory_bytes = plan.rank_memory(0).total.max(plan.rank_memory(1).total);
    plan
}
