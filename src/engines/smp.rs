//! SageMaker model parallelism: a plan without pipeline as SMP v2's `smp.init` configuration
//! (tensor, context and expert degrees, the hybrid-shard degree of its FSDP, activation
//! offloading and its loading horizon), a pipelined plan as SMP v1's
//! `smdistributed.modelparallel` parameters; what they cannot say. Both are read back by
//! `--config` (with `--layout` for SMP v1's manual partition).

use serde_json::{Map, Value, json};

use crate::ir::{Placement, Precision, ScheduleKind};
use crate::plan::Plan;

use super::config::{EmittedFile, Written};
use super::fields::{Change, Engine, Gap, PlanField, checkpointed, megatron_split, offloaded, selective_unexpressed, expert_overlap_unexpressed};

const ENGINE: Engine = Engine::Smp;

fn gap(field: PlanField, chose: impl Into<String>, why: impl Into<String>, nearest: impl Into<String>, change: Option<Change>) -> Gap {
    Gap { engine: ENGINE, field, chose: chose.into(), why: why.into(), nearest: nearest.into(), change }
}

/// What SMP cannot express of `plan`: SMP v2 has no pipeline; SMP v1 has no context or expert
/// parallelism, no virtual stages, and shards only the optimizer state next to a pipeline.
pub fn gaps(plan: &Plan) -> Vec<Gap> {
    let p = &plan.parallel;
    let mut out = Vec::new();
    out.extend(expert_overlap_unexpressed(Engine::Smp, plan));
    out.extend(super::fields::float8_unexpressed(Engine::Smp, plan, "its parameters have no fp8 setting"));
    if p.grad_overlap {
        out.push(gap(PlanField::GradOverlap, "the gradients reduced beside the backward", "its parameters do not say how its data parallelism reduces them", "reduced after the backward", Some(Change::GradOverlap(false))));
    }
    if !megatron_split(plan) {
        out.push(gap(PlanField::TensorSplit, "a tensor split other than Megatron's in some layers", "its tensor parallelism splits every transformer layer one way", "Megatron's split in every layer", Some(Change::MegatronSplit)));
    }
    if let Some((chose, change)) = selective_unexpressed(plan) {
        out.push(gap(PlanField::Recompute, chose, "its activation checkpointing recomputes whole modules", "those layers keep their activations", Some(change)));
    }
    if p.pp == 1 {
        // SMP v2: FSDP
        if p.dp * p.cp > 1 && (p.zero == 1 || p.zero == 2) {
            out.push(gap(PlanField::Zero, format!("ZeRO {}", p.zero), "SMP v2 shards with FSDP: weights, gradients and optimizer state (ZeRO 3) or nothing", "ZeRO 3", Some(Change::Zero(3))));
        }
        if p.precision == Precision::Fp16Mixed {
            out.push(gap(PlanField::Precision, "fp16 mixed precision", "SMP v2 trains in bf16 or fp32 (FSDP mixed precision)", "bf16 mixed precision", Some(Change::Precision(Precision::Bf16Mixed))));
        }
        return out;
    }
    // SMP v1
    match p.schedule {
        ScheduleKind::Interleaved { .. } | ScheduleKind::ZbH1 => out.push(gap(
            PlanField::Schedule,
            p.schedule.to_string(),
            "SMP v1's pipelines are simple (GPipe) and interleaved (1F1B), one stage per rank",
            "1F1B (SMP's `interleaved`)",
            Some(Change::Schedule(ScheduleKind::OneFOneB)),
        )),
        _ => {}
    }
    if p.cp > 1 {
        out.push(gap(PlanField::Context, format!("context parallelism {} with a pipeline", p.cp), "SMP v1 has no context parallelism and SMP v2 no pipeline", "none (not priced)", None));
    }
    if p.ep > 1 {
        out.push(gap(PlanField::Expert, format!("expert parallelism {} with a pipeline", p.ep), "SMP v1 has no expert parallelism and SMP v2 no pipeline", "none (not priced)", None));
    }
    if p.zero >= 2 && p.dp > 1 {
        out.push(gap(PlanField::Zero, format!("ZeRO {} with a pipeline", p.zero), "SMP v1 shards only the optimizer state next to a pipeline (shard_optimizer_state)", "ZeRO 1", Some(Change::Zero(1))));
    }
    if p.tp > 1 && p.sequence_parallel {
        out.push(gap(PlanField::SequenceParallel, "sequence parallelism", "SMP v1's tensor parallelism has none", "plain tensor parallelism", Some(Change::SequenceParallel(false))));
    }
    if p.precision == Precision::Bf16 {
        out.push(gap(PlanField::Precision, "pure bf16 (no fp32 master weights)", "SMP v1's bf16 keeps fp32 master weights", "bf16 mixed precision", Some(Change::Precision(Precision::Bf16Mixed))));
    }
    out
}

/// SMP's configuration for `plan` (which must have no [`gaps`] with a change).
pub fn write(plan: &Plan) -> Result<Written, String> {
    let p = &plan.parallel;
    let mut cfg = Map::new();
    let ckpt = checkpointed(plan);
    let mut notes = Vec::new();
    if !ckpt.is_empty() {
        let list: Vec<String> = ckpt.iter().map(usize::to_string).collect();
        notes.push(format!("checkpoint these layers of `smp-partition graph` (and only these): {}", list.join(", ")));
    }
    let offload = !offloaded(plan).is_empty();
    if p.pp == 1 {
        cfg.insert("tensor_parallel_degree".into(), json!(p.tp));
        if p.cp > 1 {
            cfg.insert("context_parallel_degree".into(), json!(p.cp));
        }
        if p.ep > 1 {
            cfg.insert("expert_parallel_degree".into(), json!(p.ep));
        }
        let hybrid = match (p.zero, p.sharded_dp) {
            (3, Some(s)) => s,
            (3, None) => 0,
            _ => 1,
        };
        cfg.insert("hybrid_shard_degree".into(), json!(hybrid));
        cfg.insert("sm_activation_offloading".into(), json!(offload));
        if offload {
            cfg.insert("activation_loading_horizon".into(), json!(p.loading_horizon));
        }
        notes.push(match p.precision {
            Precision::Bf16Mixed => "train with FSDP's MixedPrecision(param_dtype=torch.bfloat16) (bf16-mixed)".into(),
            Precision::Bf16 => "keep the model in torch.bfloat16 (pure bf16)".into(),
            _ => "train in float32".into(),
        });
        let text = serde_json::to_string_pretty(&Value::Object(cfg)).map_err(|e| e.to_string())? + "\n";
        return Ok(Written {
            files: vec![EmittedFile { name: "smp_config.json".into(), text }],
            launch: format!("torchrun --nnodes {} --nproc-per-node {} train.py  # train.py: torch.sagemaker.init(\"smp_config.json\")", nodes(plan), per_node(plan)),
            notes,
        });
    }
    cfg.insert("pipeline_parallel_degree".into(), json!(p.pp));
    cfg.insert("microbatches".into(), json!(p.microbatches));
    cfg.insert("pipeline".into(), json!(if p.schedule == ScheduleKind::GPipe { "simple" } else { "interleaved" }));
    cfg.insert("tensor_parallel_degree".into(), json!(p.tp));
    cfg.insert("ddp".into(), json!(true));
    if p.zero == 1 && p.dp > 1 {
        cfg.insert("shard_optimizer_state".into(), json!(true));
    }
    let placement = if p.placement == Placement::CLUSTER {
        "cluster".to_string()
    } else if p.placement == Placement::SPREAD {
        "spread".to_string()
    } else {
        p.placement.to_string()
    };
    cfg.insert("placement_strategy".into(), json!(placement));
    if let Some(a) = p.active_microbatches {
        cfg.insert("active_microbatches".into(), json!(a));
    }
    cfg.insert("auto_partition".into(), json!(false));
    cfg.insert("default_partition".into(), json!(0));
    match p.precision {
        Precision::Bf16Mixed | Precision::Bf16 => {
            cfg.insert("bf16".into(), json!(true));
        }
        Precision::Fp16Mixed => {
            cfg.insert("fp16".into(), json!(true));
        }
        Precision::F32 => {}
    }
    cfg.insert("offload_activations".into(), json!(offload));
    if offload {
        cfg.insert("activation_loading_horizon".into(), json!(p.loading_horizon));
    }
    let mut stages: Vec<&crate::plan::schema::Stage> = plan.stages.iter().collect();
    stages.sort_by_key(|s| s.index);
    let layout: Vec<String> = stages.iter().map(|s| format!("{}-{}", s.layers[0], s.layers[1])).collect();
    notes.push(format!("place the layers with `with smp.partition(i):` as the plan cuts them ({}); smp-partition reads it back with --config smp_config.json --layout \"{}\"", layout.join(" | "), layout.join("|")));
    let text = serde_json::to_string_pretty(&Value::Object(cfg)).map_err(|e| e.to_string())? + "\n";
    Ok(Written {
        files: vec![EmittedFile { name: "smp_config.json".into(), text }],
        launch: format!("mpirun -np {} python train.py  # train.py: smp.init(json.load(open(\"smp_config.json\")))", plan.cluster.devices),
        notes,
    })
}

fn per_node(plan: &Plan) -> usize {
    plan.cluster.devices_per_node.max(1).min(plan.cluster.devices.max(1))
}

fn nodes(plan: &Plan) -> usize {
    plan.cluster.devices.div_ceil(per_node(plan))
}
