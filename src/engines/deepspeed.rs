//! DeepSpeed (0.19): a plan as `ds_config.json` (batch, ZeRO, precision, activation
//! checkpointing, the `pipeline` section with the stage count, the partition and the
//! checkpoint interval, AutoTP's and AutoEP's degrees), the pipeline module built from it and
//! the launcher line; what DeepSpeed cannot say; and a `ds_config.json` read back into the
//! planner's request, refused where DeepSpeed refuses it (its batch assertion, ZeRO with the
//! pipeline engine, fp16 with bf16).

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use crate::ir::{OffloadRule, Placement, Precision, ScheduleKind};
use crate::plan::Plan;
use crate::solve::{PlanOptions, Setting, Source};

use super::config::{EmittedFile, Launcher, Origin, Reading, Unpriced, Written, split_words};
use super::error::EngineError;
use super::fields::{Change, Engine, Gap, PlanField, checkpointed, megatron_split, offloaded, reader_order, same_ranks, selective_unexpressed, expert_overlap_unexpressed};
use super::shape::ModelShape;
use super::stages::{all_blocks, stage_roles, units_whole, whole_units_layout};

const ENGINE: Engine = Engine::DeepSpeed;

/// DeepSpeed's topology with a pipeline, `pipe, data, model`: pipeline outermost, tensor
/// (model) innermost.
pub const TOPOLOGY: Placement = Placement([crate::ir::MeshAxis::P, crate::ir::MeshAxis::D, crate::ir::MeshAxis::T]);

fn gap(field: PlanField, chose: impl Into<String>, why: impl Into<String>, nearest: impl Into<String>, change: Option<Change>) -> Gap {
    Gap { engine: ENGINE, field, chose: chose.into(), why: why.into(), nearest: nearest.into(), change }
}

/// DeepSpeed's `partition_uniform`: stage boundaries of `items` layers over `parts` stages.
pub fn partition_uniform(items: usize, parts: usize) -> Vec<usize> {
    if items <= parts {
        return (0..=parts).map(|p| p.min(items)).collect();
    }
    let chunk = items / parts;
    let residual = items - chunk * parts;
    let mut out: Vec<usize> = (0..=parts).map(|p| p * chunk).collect();
    for i in 0..residual {
        for x in out.iter_mut().skip(i + 1) {
            *x += 1;
        }
    }
    out
}

/// DeepSpeed's `partition_balanced`: the linear partition of `weights` into `parts` contiguous
/// stages that minimises the spread between the heaviest and the lightest, ties to the later
/// split point, as its dynamic programme breaks them.
pub fn partition_balanced(weights: &[f64], parts: usize) -> Vec<usize> {
    let n = weights.len();
    let m = parts;
    if n <= m {
        return partition_uniform(n, m);
    }
    let inf = f64::INFINITY;
    let mut dp_max = vec![vec![inf; m + 1]; n + 1];
    let mut dp_min = vec![vec![inf; m + 1]; n + 1];
    let mut dp_cost = vec![vec![inf; m + 1]; n + 1];
    let mut position = vec![vec![0usize; m + 1]; n + 1];
    let mut prefix = vec![0.0; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + weights[i];
    }
    dp_max[0][0] = 0.0;
    dp_cost[0][0] = 0.0;
    for i in 1..=n {
        for j in 1..=i.min(m) {
            for k in 0..i {
                let max_sum = dp_max[k][j - 1].max(prefix[i] - prefix[k]);
                let min_sum = dp_min[k][j - 1].min(prefix[i] - prefix[k]);
                let cost = max_sum - min_sum;
                if dp_cost[i][j] >= cost {
                    dp_cost[i][j] = cost;
                    dp_max[i][j] = max_sum;
                    dp_min[i][j] = min_sum;
                    position[i][j] = k;
                }
            }
        }
    }
    let mut out = vec![n];
    for i in (1..=m).rev() {
        let last = *out.last().unwrap_or(&0);
        out.push(position[last][i]);
    }
    out.reverse();
    out
}

/// What DeepSpeed cannot express of `plan`, each with the nearest setting it can run.
pub fn gaps(plan: &Plan, shape: &ModelShape) -> Result<Vec<Gap>, String> {
    let p = &plan.parallel;
    let stages = stage_roles(plan, shape)?;
    let mut out = Vec::new();
    out.extend(expert_overlap_unexpressed(Engine::DeepSpeed, plan));
    out.extend(super::fields::float8_unexpressed(Engine::DeepSpeed, plan, "its configuration has no fp8 setting (fp8 comes from the model's own Transformer Engine layers)"));
    if p.grad_overlap && (p.zero == 0 || p.pp > 1) {
        let why = if p.pp > 1 { "its pipeline engine reduces the gradients after the last backward" } else { "without ZeRO it all-reduces the gradients after the backward (overlap_comm is a ZeRO setting)" };
        out.push(gap(PlanField::GradOverlap, "the gradients reduced beside the backward", why, "reduced after the backward", Some(Change::GradOverlap(false))));
    }
    if p.ep > 1 && p.tp > 1 {
        // AutoEP under AutoTP folds the expert group over a stage's ranks, experts whole, and
        // only without a pipeline
        if p.pp > 1 {
            out.push(gap(
                PlanField::Expert,
                format!("expert parallelism {} beside tensor parallelism {} in a {}-stage pipeline", p.ep, p.tp, p.pp),
                "AutoEP with AutoTP (its folding) runs without a pipeline only",
                "no AutoEP: every replica holds every expert, split over the tensor ranks",
                Some(Change::ExpertDegree(1)),
            ));
        } else if p.etp != 1 {
            out.push(gap(
                PlanField::Expert,
                format!("each expert split over {} tensor ranks", p.etp),
                "AutoEP under AutoTP keeps each expert whole (expert_tensor_parallel_size 1), the expert group folded over the stage's ranks",
                "the experts whole, folded over tensor × data ranks",
                Some(Change::FoldedExperts),
            ));
        }
    }
    if p.pp > 1 && p.schedule != ScheduleKind::OneFOneB {
        out.push(gap(PlanField::Schedule, p.schedule.to_string(), "its pipeline engine runs 1F1B only", "1F1B", Some(Change::Schedule(ScheduleKind::OneFOneB))));
    }
    if !units_whole(&stages, shape) {
        out.push(gap(
            PlanField::Cuts,
            "a cut inside the embedding or the head",
            "the pipeline module's layers are the embedding, the blocks and the head",
            "the embedding with the first stage, the head with the last",
            whole_units_layout(&stages, shape).map(Change::Layout),
        ));
    }
    if p.pp > 1 && p.zero >= 2 {
        out.push(gap(
            PlanField::Zero,
            format!("ZeRO {} with pipeline parallelism", p.zero),
            "ZeRO-2 and ZeRO-3 are incompatible with its pipeline parallelism",
            "ZeRO 1",
            Some(Change::Zero(1)),
        ));
    }
    if let Some(s) = p.sharded_dp {
        out.push(gap(PlanField::ShardedData, format!("ZeRO 3 over groups of {s} replicas"), "MiCS, its sharding over groups, was removed", "ZeRO 3 over all replicas", Some(Change::WholeShardGroups)));
    }
    let set = checkpointed(plan);
    let blocks = all_blocks(shape);
    if !set.is_empty() && set != blocks {
        out.push(gap(
            PlanField::Recompute,
            format!("recompute of {} of {} layers, chosen one by one", set.len(), shape.kinds.len()),
            "activation_checkpoint_interval checkpoints every transformer layer or none",
            "activation_checkpoint_interval 1 (every transformer layer)",
            Some(Change::Recompute(blocks.clone())),
        ));
    } else if let Some((chose, change)) = selective_unexpressed(plan) {
        out.push(gap(PlanField::Recompute, chose, "its activation checkpointing recomputes whole layers", "those layers keep their activations", Some(change)));
    }
    let off = offloaded(plan);
    if !off.is_empty() {
        if off != set {
            out.push(gap(
                PlanField::Offload,
                format!("offloading {} of {} recomputed layers", off.len(), set.len()),
                "cpu_checkpointing moves every checkpoint to host memory or none",
                "cpu_checkpointing (every checkpoint)",
                Some(Change::Offload(OffloadRule::Always)),
            ));
        }
        if p.loading_horizon != 1 {
            out.push(gap(
                PlanField::LoadingHorizon,
                format!("{} microbatches of offloaded inputs back ahead of their backward", p.loading_horizon),
                "it brings each checkpoint back when its layer recomputes",
                "a loading horizon of 1",
                Some(Change::LoadingHorizon(1)),
            ));
        }
    }
    if p.tp > 1 && p.sequence_parallel {
        out.push(gap(PlanField::SequenceParallel, "sequence parallelism in tensor-parallel layers", "AutoTP has none", "plain tensor parallelism", Some(Change::SequenceParallel(false))));
    }
    if p.cp > 1 {
        out.push(gap(
            PlanField::Context,
            format!("context parallelism {} (all-gathered keys and values)", p.cp),
            "its sequence parallelism (Ulysses) exchanges heads by all-to-all instead",
            format!("sequence_parallel_size {} (not priced: the planner prices its own all-gather)", p.cp),
            None,
        ));
    }
    if !megatron_split(plan) {
        out.push(gap(PlanField::TensorSplit, "a tensor split other than Megatron's in some layers", "AutoTP splits every linear layer by columns then rows", "Megatron's split in every layer", Some(Change::MegatronSplit)));
    }
    if p.fp32_main_grads && p.precision.is_mixed() && !(p.precision == Precision::Bf16Mixed && p.zero == 1) {
        out.push(gap(
            PlanField::Precision,
            format!("{} with fp32 gradients at ZeRO {}", p.precision, p.zero),
            "data_types.grad_accum_dtype = fp32 takes effect under bf16 at ZeRO 1 alone (its BF16 optimizer): ZeRO 2 and 3 keep the gradients in the model's type and no ZeRO refuses the mix",
            "gradients in the model's type",
            Some(Change::ModelTypeGradients),
        ));
    }
    if p.precision == Precision::Bf16 {
        out.push(gap(PlanField::Precision, "pure bf16 (no fp32 master weights)", "its bf16 mode keeps fp32 master weights", "bf16 mixed precision", Some(Change::Precision(Precision::Bf16Mixed))));
    }
    if !same_ranks(p.placement, TOPOLOGY, p) {
        out.push(gap(PlanField::Placement, format!("rank order {}", p.placement), "its topology is pipe, data, model from the outside in", "PDT", Some(Change::Placement(TOPOLOGY))));
    }
    if let Some(a) = p.active_microbatches {
        out.push(gap(PlanField::InFlight, format!("at most {a} microbatches in flight"), "it has no such cap", "no cap", Some(Change::NoInFlightCap)));
    }
    Ok(out)
}

/// The stage boundaries of `plan` in the pipeline module's layer indices (one per layer of
/// `graph`).
fn parts(plan: &Plan) -> Vec<usize> {
    let mut stages: Vec<&crate::plan::schema::Stage> = plan.stages.iter().collect();
    stages.sort_by_key(|s| s.index);
    let mut out: Vec<usize> = stages.iter().map(|s| s.layers[0]).collect();
    out.push(stages.last().map_or(0, |s| s.layers[1] + 1));
    out
}

/// `ds_config.json` for `plan` (which must have no [`gaps`] with a change), the pipeline
/// module's construction, and the launcher line.
pub fn write(plan: &Plan, shape: &ModelShape) -> Result<Written, String> {
    let p = &plan.parallel;
    stage_roles(plan, shape)?;
    let dp = p.dp.max(1) as u64;
    let m = p.microbatches.max(1) as u64;
    let mbs = plan.global_batch / (dp * m);
    let mut cfg = Map::new();
    cfg.insert("train_batch_size".into(), json!(plan.global_batch));
    cfg.insert("train_micro_batch_size_per_gpu".into(), json!(mbs));
    cfg.insert("gradient_accumulation_steps".into(), json!(m));
    // overlap_comm said either way: its default is on at stage 3 alone
    let overlap = p.grad_overlap && p.zero >= 1 && p.pp == 1;
    cfg.insert("zero_optimization".into(), if p.zero >= 1 { json!({ "stage": p.zero, "overlap_comm": overlap }) } else { json!({ "stage": p.zero }) });
    if p.fp32_main_grads && p.precision == Precision::Bf16Mixed && p.zero == 1 {
        cfg.insert("data_types".into(), json!({ "grad_accum_dtype": "fp32" }));
    }
    match p.precision {
        Precision::Bf16Mixed | Precision::Bf16 => {
            cfg.insert("bf16".into(), json!({ "enabled": true }));
        }
        Precision::Fp16Mixed => {
            cfg.insert("fp16".into(), json!({ "enabled": true, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1 }));
        }
        Precision::F32 => {}
    }
    let recompute = !checkpointed(plan).is_empty();
    let offload = !offloaded(plan).is_empty();
    cfg.insert(
        "activation_checkpointing".into(),
        json!({ "partition_activations": false, "cpu_checkpointing": offload, "contiguous_memory_optimization": false, "synchronize_checkpoint_boundary": false }),
    );
    let layers = shape.kinds.len();
    let bounds = parts(plan);
    let partition = if p.pp == 1 || bounds == partition_uniform(layers, p.pp) {
        json!("uniform")
    } else {
        let weights: Vec<f64> = shape.layer_params.iter().map(|&x| x as f64).collect();
        if bounds == partition_balanced(&weights, p.pp) { json!("parameters") } else { json!(bounds) }
    };
    cfg.insert("pipeline".into(), json!({ "stages": p.pp, "partition": partition, "activation_checkpoint_interval": usize::from(recompute) }));
    if p.tp > 1 {
        cfg.insert("tensor_parallel".into(), json!({ "autotp_size": p.tp }));
    }
    if p.ep > 1 {
        cfg.insert("expert_parallel".into(), json!({ "enabled": true, "autoep_size": p.ep }));
    }
    if p.cp > 1 {
        // deepspeed.initialize builds its (data, sequence) mesh from both
        cfg.insert("sequence_parallel_size".into(), json!(p.cp));
        cfg.insert("data_parallel_size".into(), json!(p.dp));
    }
    let text = serde_json::to_string_pretty(&Value::Object(cfg)).map_err(|e| e.to_string())? + "\n";
    let per_node = plan.cluster.devices_per_node.max(1).min(plan.cluster.devices.max(1));
    let nodes = plan.cluster.devices.div_ceil(per_node);
    let module = PIPELINE_MODULE.replace("{BLOCK}", "TransformerBlock");
    Ok(Written {
        files: vec![EmittedFile { name: "ds_config.json".into(), text }, EmittedFile { name: "deepspeed_pipeline.py".into(), text: module }],
        launch: format!("deepspeed --num_nodes {nodes} --num_gpus {per_node} train.py --deepspeed --deepspeed_config ds_config.json"),
        notes: vec![
            "deepspeed_pipeline.py builds the PipelineModule from ds_config.json's pipeline section; list your model's layers (embedding, blocks, head) in `layers`".into(),
            "the optimizer, scheduler and data are yours to add".into(),
        ],
    })
}

/// The pipeline module built from `ds_config.json`'s `pipeline` section.
const PIPELINE_MODULE: &str = r#"# The pipeline module of the plan, built from ds_config.json's "pipeline" section:
# its stage count, partition ("uniform", "parameters" or the stage boundaries in layer indices)
# and activation-checkpoint interval. `layers` are the model's layers in order, one per layer
# of `smp-partition graph` (embedding, transformer blocks, head).
import json

from deepspeed.pipe import PipelineModule


class PlannedPipeline(PipelineModule):
    """A PipelineModule whose stage boundaries may be given as a list."""

    def __init__(self, layers, ds_config="ds_config.json", **kwargs):
        pipe = json.load(open(ds_config))["pipeline"]
        self._planned_parts = pipe["partition"] if isinstance(pipe["partition"], list) else None
        method = "uniform" if self._planned_parts else pipe["partition"]
        super().__init__(layers=layers, num_stages=pipe["stages"], partition_method=method,
                         activation_checkpoint_interval=pipe["activation_checkpoint_interval"],
                         checkpointable_layers=["{BLOCK}"], **kwargs)

    def _partition_layers(self, method="uniform"):
        if self._planned_parts is None:
            return super()._partition_layers(method)
        self.parts = list(self._planned_parts)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])
"#;

/// Keys that decide nothing a plan prices.
const NO_EFFECT: &[&str] = &[
    "steps_per_print", "wall_clock_breakdown", "gradient_clipping", "optimizer", "scheduler", "communication_data_type", "prescale_gradients",
    "dump_state", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger", "seed", "checkpoint", "memory_breakdown",
];

fn int_of(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
}

/// Reads `ds_config.json` (and, after a comma in the `--from-engine` argument, the launcher
/// line) into the planner's request for a model of `shape` on `devices` devices.
pub fn read(text: &str, origin: Origin, shape: &ModelShape, devices: Option<usize>) -> Result<(Reading, Option<usize>), EngineError> {
    let (cfg, world) = config_and_world(text, &origin, devices)?;
    let mut r = DsReading { cfg, used: BTreeSet::new(), origin, shape, o: PlanOptions { megatron_split: true, ..PlanOptions::default() }, reading: Reading::default() };
    let pipe = r.get("pipeline").unwrap_or(Value::Null);
    let d = r.topology(world, &pipe)?;
    r.batch(d.dp)?;
    r.zero(&d)?;
    r.precision()?;
    r.cuts(d.pp, &pipe)?;
    r.checkpointing(&pipe)?;
    r.o.sequence_parallel = Some(false);
    r.o.placement = Some(reader_order(TOPOLOGY, [d.dp * d.cp, d.pp, d.tp]));
    r.leftovers();
    r.reading.options = r.o;
    Ok((r.reading, Some(world)))
}

/// A refusal by DeepSpeed's `check`.
fn refuse(check: &str, why: String) -> EngineError {
    EngineError::Refused { engine: ENGINE, check: check.into(), why }
}

/// A syntax error in the configuration `origin` names.
fn syntax(origin: &Origin, why: String) -> EngineError {
    EngineError::Syntax { engine: ENGINE, what: origin.name(), why }
}

/// The JSON object (and the launcher line after it, if any) and the device count: given, or
/// the launcher's.
fn config_and_world(text: &str, origin: &Origin, devices: Option<usize>) -> Result<(Map<String, Value>, usize), EngineError> {
    let (json_text, launcher_text) = split_json(text).map_err(|why| syntax(origin, why))?;
    let launcher = match launcher_text {
        Some(l) => Launcher::read(&split_words(l).map_err(|why| syntax(origin, why))?).map_err(|why| syntax(origin, why))?.0,
        None => Launcher::default(),
    };
    let cfg: Map<String, Value> = match serde_json::from_str(json_text).map_err(|e| syntax(origin, e.to_string()))? {
        Value::Object(m) => m,
        _ => return Err(syntax(origin, "not a JSON object".into())),
    };
    let world = match (devices, launcher.devices()) {
        (Some(d), Some(l)) if d != l => return Err(EngineError::Missing { engine: ENGINE, why: format!("the launcher starts {l} processes but --cluster has {d} devices; give --cluster PRESET:{l}") }),
        (Some(d), _) | (None, Some(d)) => d,
        (None, None) => return Err(EngineError::Missing { engine: ENGINE, why: "no device count: give --cluster PRESET:N or the launcher line after the file (deepspeed:ds_config.json,\"deepspeed --num_nodes N --num_gpus G …\")".into() }),
    };
    Ok((cfg, world))
}

/// The topology's degrees.
struct Topology {
    pp: usize,
    tp: usize,
    cp: usize,
    dp: usize,
}

/// A `ds_config.json` being read: the keys read so far, the request, and what is not priced.
struct DsReading<'s> {
    cfg: Map<String, Value>,
    used: BTreeSet<&'static str>,
    origin: Origin,
    shape: &'s ModelShape,
    o: PlanOptions,
    reading: Reading,
}

impl DsReading<'_> {
    /// A top-level key's value, marked read.
    fn get(&mut self, k: &'static str) -> Option<Value> {
        self.used.insert(k);
        self.cfg.get(k).cloned()
    }

    /// Pipeline stages, AutoTP, AutoEP and sequence parallelism on `world` ranks; the data
    /// parallelism left.
    fn topology(&mut self, world: usize, pipe: &Value) -> Result<Topology, EngineError> {
        let pp = match pipe.get("stages") {
            None | Some(Value::Null) => 1,
            Some(Value::String(s)) if s == "auto" => 1,
            Some(v) => int_of(v).filter(|&x| x >= 1).ok_or_else(|| syntax(&self.origin, format!("pipeline.stages = {v}: expected a stage count")))? as usize,
        };
        let tp = match self.get("tensor_parallel") {
            Some(t) => t.get("autotp_size").and_then(int_of).filter(|&x| x >= 1).unwrap_or(1) as usize,
            None => 1,
        };
        let experts = self.get("expert_parallel").unwrap_or(Value::Null);
        let enabled = experts.get("enabled").and_then(Value::as_bool).unwrap_or(false);
        let ep = if enabled { experts.get("autoep_size").and_then(int_of).filter(|&x| x >= 1).unwrap_or(1) as usize } else { 1 };
        let cp = self.get("sequence_parallel_size").as_ref().and_then(int_of).filter(|&x| x >= 1).unwrap_or(1) as usize;
        if world % (pp * tp * cp) != 0 {
            return Err(refuse("process topology", format!("world size {world} is not divisible by pipeline stages {pp} × AutoTP size {tp} × sequence-parallel size {cp}")));
        }
        let dp = world / (pp * tp * cp);
        if let Some(given) = self.get("data_parallel_size").as_ref().and_then(int_of)
            && given != dp as i64
        {
            return Err(refuse("initialize_mesh_device", format!("data_parallel_size {given} × sequence_parallel_size {cp} does not make the {} ranks left of {world} after pipeline {pp} × AutoTP {tp}", world / (pp * tp))));
        }
        let (o, origin) = (&mut self.o, &self.origin);
        o.pp = Some(pp);
        o.tp = Some(tp);
        o.cp = Some(cp);
        o.dp = Some(dp);
        o.sources.insert(Setting::Pp, origin.source("pipeline.stages", pp));
        o.sources.insert(Setting::Tp, origin.source("tensor_parallel.autotp_size", tp));
        o.sources.insert(Setting::Cp, origin.source("sequence_parallel_size", cp));
        o.sources.insert(Setting::Dp, Source::Implied(format!("data parallel {dp} = {world} ranks / (pp {pp} · tp {tp} · sp {cp})")));
        if cp > 1 {
            self.reading.unpriced.push(Unpriced { setting: format!("sequence_parallel_size {cp}"), why: "DeepSpeed-Ulysses' all-to-all is priced as the planner's context parallelism (all-gathered keys and values)".into() });
        }
        if ep > 1 || self.shape.experts.is_some() {
            let etp = experts.get("expert_tensor_parallel_size").and_then(int_of).unwrap_or(1);
            let (o, origin) = (&mut self.o, &self.origin);
            if enabled && tp > 1 {
                // AutoEP under AutoTP folds the expert group over a stage's tp · dp ranks with
                // whole experts (deepspeed/module_inject/auto_ep_folding.py)
                let fold = |why: String| refuse("AutoEP+AutoTP folding", why);
                if ep == 1 {
                    return Err(fold("AutoEP+AutoTP folding requires expert_parallel.autoep_size > 1".into()));
                }
                if pp > 1 {
                    return Err(fold(format!("AutoEP+AutoTP folding currently supports pp_size=1 only; got pp_size={pp}")));
                }
                if cp > 1 {
                    return Err(fold(format!("tensor_parallel.autotp_size and Ulysses sequence parallelism are mutually exclusive for AutoEP folding (autotp_size={tp}, sp_size={cp})")));
                }
                if etp != 1 {
                    return Err(fold(format!("expert_parallel.expert_tensor_parallel_size={etp} is reserved for expert-internal tensor parallelism and is not supported yet")));
                }
                if (tp * dp) % ep != 0 {
                    return Err(fold(format!("expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size ({ep} * 1) must divide the stage size ({})", tp * dp)));
                }
                o.etp = Some(1);
                o.sources.insert(Setting::Etp, Source::Implied(format!("expert-tensor 1: autoep_size {ep} under autotp_size {tp} folds the expert group over the stage's ranks, experts whole")));
            } else if ep > 1 && dp % ep != 0 {
                return Err(refuse("AutoEP", format!("autoep_size {ep} must divide the data-parallel size {dp}")));
            }
            o.ep = Some(ep);
            o.sources.insert(Setting::Ep, origin.source("expert_parallel.autoep_size", ep));
        }
        Ok(Topology { pp, tp, cp, dp })
    }

    /// The batch, as DeepSpeed's `_configure_train_batch_size` completes it from any two.
    fn batch(&mut self, dp: usize) -> Result<(), EngineError> {
        let tbs = self.get("train_batch_size").as_ref().and_then(int_of);
        let mbs = self.get("train_micro_batch_size_per_gpu").as_ref().and_then(int_of);
        let gas = self.get("gradient_accumulation_steps").as_ref().and_then(int_of);
        let d = dp as i64;
        let (tbs, mbs, gas) = match (tbs, mbs, gas) {
            (Some(t), Some(m), Some(g)) => (t, m, g),
            (Some(t), Some(m), None) => (t, m, t / (m * d).max(1)),
            (Some(t), None, Some(g)) => (t, t / (g * d).max(1), g),
            (None, Some(m), Some(g)) => (m * g * d, m, g),
            (Some(t), None, None) => (t, t / d.max(1), 1),
            (None, Some(m), None) => (m * d, m, 1),
            _ => return Err(refuse("_configure_train_batch_size", "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided".into())),
        };
        if tbs < 1 || mbs < 1 || gas < 1 || tbs != mbs * gas * d {
            return Err(refuse(
                "_batch_assertion",
                format!("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size {tbs} != {mbs} * {gas} * {d}"),
            ));
        }
        let o = &mut self.o;
        o.global_batch = Some(tbs as u64);
        o.microbatches = Some(gas as usize);
        o.sources.insert(Setting::GlobalBatch, self.origin.source("train_batch_size", tbs));
        o.sources.insert(Setting::Microbatches, self.origin.source("gradient_accumulation_steps", gas));
        Ok(())
    }

    /// The ZeRO stage (none above 1 with a pipeline), its offloading, and whether it reduces
    /// the gradients beside the backward (`overlap_comm`, on by default at stage 3).
    fn zero(&mut self, d: &Topology) -> Result<(), EngineError> {
        let pp = d.pp;
        let zero_cfg = self.get("zero_optimization").unwrap_or(Value::Null);
        let zero = zero_cfg.get("stage").and_then(int_of).unwrap_or(0);
        if !(0..=3).contains(&zero) {
            return Err(refuse("DeepSpeedZeroConfig", format!("zero_optimization.stage = {zero}: stages are 0 to 3")));
        }
        if pp > 1 && zero >= 2 {
            return Err(refuse("PipelineEngine.__init__", "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism".into()));
        }
        self.o.zero = Some(zero as u8);
        self.o.sources.insert(Setting::Zero, self.origin.source("zero_optimization.stage", zero));
        let given = zero_cfg.get("overlap_comm").and_then(Value::as_bool);
        if given.unwrap_or(zero == 3) && zero >= 1 && d.dp * d.cp > 1 {
            if pp > 1 {
                // PipelineEngine reduces the gradients after its last backward
                self.reading.no_effect.push("zero_optimization.overlap_comm (the pipeline engine reduces the gradients after its last backward)".into());
            } else {
                self.o.grad_overlap = Some(true);
                let source = if given.is_some() { self.origin.source("zero_optimization.overlap_comm", true) } else { Source::Implied("zero_optimization.overlap_comm: on by default at stage 3".into()) };
                self.o.sources.insert(Setting::GradOverlap, source);
            }
        }
        for key in ["offload_optimizer", "offload_param"] {
            if let Some(v) = zero_cfg.get(key)
                && v.get("device").and_then(Value::as_str).is_some_and(|d| d != "none")
            {
                self.reading.unpriced.push(Unpriced { setting: format!("zero_optimization.{key} = {v}"), why: "offloading optimizer state or parameters is not priced".into() });
            }
        }
        Ok(())
    }

    /// bf16, fp16 (not both) or f32.
    fn precision(&mut self) -> Result<(), EngineError> {
        let enabled = |v: Option<Value>| v.and_then(|x| x.get("enabled").and_then(Value::as_bool)).unwrap_or(false);
        let bf16 = enabled(self.get("bf16"));
        let fp16 = enabled(self.get("fp16"));
        if bf16 && fp16 {
            return Err(refuse("DeepSpeedConfig._initialize_params", "bfloat16 and fp16 modes cannot be simultaneously enabled".into()));
        }
        self.o.precision = Some(if bf16 {
            Precision::Bf16Mixed
        } else if fp16 {
            Precision::Fp16Mixed
        } else {
            Precision::F32
        });
        for (section, on) in [("bf16", bf16), ("fp16", fp16)] {
            let Some(Value::Object(keys)) = self.cfg.get(section).cloned() else { continue };
            for (k, v) in keys.iter().filter(|(k, _)| k.as_str() != "enabled") {
                let setting = format!("{section}.{k} = {v}");
                match k.as_str() {
                    // the 16-bit masters, gradients and moments change the model state's bytes
                    "bf16_master_weights_and_grads" | "bf16_optimizer_states" | "fp16_master_weights_and_grads" if on && v.as_bool() == Some(true) => {
                        self.reading.unpriced.push(Unpriced { setting, why: "16-bit master weights, gradients or optimizer state are not priced (the plan prices fp32 masters and moments)".into() })
                    }
                    _ => self.reading.no_effect.push(setting),
                }
            }
        }
        self.gradient_type(if bf16 { "bf16" } else if fp16 { "fp16" } else { "fp32" })
    }

    /// `data_types.grad_accum_dtype` as `DeepSpeedEngine._do_optimizer_sanity_check` takes it:
    /// the model's type when unset; fp32 under bf16 at ZeRO 1 (no CPU offload) is its BF16
    /// optimizer with fp32 gradients ([`crate::ir::MixedRecipe::LowModelFp32Grads`]); ZeRO 2
    /// and 3 ignore it; without ZeRO any type but the model's is refused.
    fn gradient_type(&mut self, model: &'static str) -> Result<(), EngineError> {
        let Some(types) = self.get("data_types") else { return Ok(()) };
        let Some(raw) = types.get("grad_accum_dtype").filter(|v| !v.is_null()) else { return Ok(()) };
        let name = raw.as_str().unwrap_or_default().trim_start_matches("torch.");
        let accum = match name {
            "fp32" | "float32" | "float" => "fp32",
            "fp16" | "float16" | "half" => "fp16",
            "bf16" | "bfloat16" | "bfloat" => "bf16",
            _ => return Err(refuse("DtypeEnum", format!("data_types.grad_accum_dtype = {raw}: expected fp32, fp16 or bf16"))),
        };
        let setting = format!("data_types.grad_accum_dtype = {raw}");
        let zero = self.o.zero.unwrap_or(0);
        let cpu_offload = self.cfg.get("zero_optimization").and_then(|z| z.get("offload_optimizer")).and_then(|o| o.get("device")).and_then(Value::as_str) == Some("cpu");
        if accum == model {
            self.reading.no_effect.push(format!("{setting} (the model's type, the default)"));
        } else if zero == 0 {
            return Err(refuse("DeepSpeedEngine._do_optimizer_sanity_check", format!("unsupported mix of model_dtype={model} and grad_accum_dtype={accum} without ZeRO")));
        } else if model == "bf16" && accum == "fp32" && zero == 1 && !cpu_offload {
            self.o.mixed_recipe = Some(crate::ir::MixedRecipe::LowModelFp32Grads);
        } else {
            self.reading.no_effect.push(format!("{setting} (ZeRO {zero}'s optimizer keeps the gradients in the model's type, {model})"));
        }
        Ok(())
    }

    /// The pipeline's stage boundaries (`pipeline.partition`) and its schedule.
    fn cuts(&mut self, pp: usize, pipe: &Value) -> Result<(), EngineError> {
        let (shape, origin, o) = (self.shape, &self.origin, &mut self.o);
        let layers = shape.kinds.len();
        if pp > 1 {
            let bounds: Vec<usize> = match pipe.get("partition") {
                None | Some(Value::Null) => partition_balanced(&shape.layer_params.iter().map(|&x| x as f64).collect::<Vec<_>>(), pp),
                Some(Value::String(s)) if s == "uniform" => partition_uniform(layers, pp),
                Some(Value::String(s)) if s == "parameters" || s == "best" => partition_balanced(&shape.layer_params.iter().map(|&x| x as f64).collect::<Vec<_>>(), pp),
                Some(Value::Array(a)) => a.iter().map(|v| int_of(v).filter(|&x| x >= 0).map(|x| x as usize)).collect::<Option<Vec<_>>>().ok_or_else(|| syntax(origin, "pipeline.partition: expected stage boundaries (layer indices)".into()))?,
                Some(other) => return Err(syntax(origin, format!("pipeline.partition = {other}: expected \"uniform\", \"parameters\" or the stage boundaries"))),
            };
            if bounds.len() != pp + 1 || bounds[0] != 0 || bounds[pp] != layers || bounds.windows(2).any(|w| w[1] <= w[0]) {
                return Err(refuse("PipelineModule._partition_layers", format!("stage boundaries {bounds:?} must rise from 0 to the {layers} layers in {pp} non-empty stages")));
            }
            let layout = crate::solve::Layout(bounds.windows(2).map(|w| [w[0], w[1] - 1]).collect());
            o.sources.insert(Setting::Layout, origin.source("pipeline.partition", format!("{bounds:?}")));
            o.layout = Some(layout);
            o.schedule = Some(ScheduleKind::OneFOneB);
            o.sources.insert(Setting::Schedule, Source::Implied("1F1B (DeepSpeed's pipeline schedule)".into()));
        }
        Ok(())
    }

    /// Activation checkpointing (the pipeline's interval) and its CPU offloading.
    fn checkpointing(&mut self, pipe: &Value) -> Result<(), EngineError> {
        let interval = pipe.get("activation_checkpoint_interval").and_then(int_of).unwrap_or(0);
        let set = match interval {
            0 => BTreeSet::new(),
            1 => all_blocks(self.shape),
            k if k > 1 => {
                self.reading.unpriced.push(Unpriced { setting: format!("pipeline.activation_checkpoint_interval {k}"), why: format!("one checkpoint per {k} layers is priced as every transformer layer recomputed, each keeping its input") });
                all_blocks(self.shape)
            }
            k => return Err(syntax(&self.origin, format!("pipeline.activation_checkpoint_interval = {k} must be ≥ 0"))),
        };
        self.o.sources.insert(Setting::CheckpointedLayers, self.origin.source("pipeline.activation_checkpoint_interval", interval));
        let act = self.get("activation_checkpointing").unwrap_or(Value::Null);
        let cpu = act.get("cpu_checkpointing").and_then(Value::as_bool).unwrap_or(false);
        if act.get("partition_activations").and_then(Value::as_bool).unwrap_or(false) {
            self.reading.unpriced.push(Unpriced { setting: "activation_checkpointing.partition_activations".into(), why: "partitioning checkpoints over the tensor ranks is not priced".into() });
        }
        let o = &mut self.o;
        o.offload = Some(if cpu && !set.is_empty() { OffloadRule::Always } else { OffloadRule::Never });
        if cpu {
            o.loading_horizon = Some(1);
            o.sources.insert(Setting::Offload, self.origin.source("activation_checkpointing.cpu_checkpointing", cpu));
        }
        o.checkpointed_layers = Some(set);
        Ok(())
    }

    /// The keys no step read: of no effect, or not priced.
    fn leftovers(&mut self) {
        for (k, v) in &self.cfg {
            if self.used.contains(k.as_str()) {
                continue;
            }
            if NO_EFFECT.contains(&k.as_str()) {
                self.reading.no_effect.push(format!("{k} = {v}"));
            } else {
                self.reading.unpriced.push(Unpriced { setting: format!("{k} = {v}"), why: "not a setting the planner knows; not priced".into() });
            }
        }
    }
}

/// A JSON object, then optionally the launcher line after it (`{…},deepspeed --num_gpus 8 …`
/// or on the lines after the closing brace).
fn split_json(text: &str) -> Result<(&str, Option<&str>), String> {
    let start = text.find('{').ok_or("no JSON object")?;
    let mut depth = 0i32;
    let mut in_str = false;
    let mut escape = false;
    for (i, c) in text.char_indices().skip_while(|(i, _)| *i < start) {
        if in_str {
            match (escape, c) {
                (true, _) => escape = false,
                (false, '\\') => escape = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    let rest = text[i + 1..].trim().trim_start_matches(',').trim();
                    return Ok((&text[start..=i], (!rest.is_empty()).then_some(rest)));
                }
            }
            _ => {}
        }
    }
    Err("an unclosed JSON object".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_match_deepspeeds() {
        assert_eq!(partition_uniform(10, 4), [0, 3, 6, 8, 10]);
        assert_eq!(partition_uniform(3, 4), [0, 1, 2, 3, 3]);
        assert_eq!(partition_balanced(&[1.0, 1.0, 1.0, 1.0], 2), [0, 2, 4]);
        assert_eq!(partition_balanced(&[5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2), [0, 1, 6]);
    }

    #[test]
    fn json_and_launcher_split() {
        let (j, l) = split_json("{\"a\": {\"b\": \"}\"}},deepspeed --num_gpus 8 train.py").unwrap();
        assert_eq!(j, "{\"a\": {\"b\": \"}\"}}");
        assert_eq!(l, Some("deepspeed --num_gpus 8 train.py"));
        assert_eq!(split_json("{}").unwrap(), ("{}", None));
    }
}
