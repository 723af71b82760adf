//! torchtitan (0.3): a plan as the job sections of torchtitan's configuration
//! (`[parallelism]`, `[training]`, `[activation_checkpoint]`, written as a TOML file) and as
//! the command line torchtitan 0.3's config manager reads (`--module … --config …` and one
//! `--section.key value` per entry); what they cannot say; and either form read back into the
//! planner's request, refused where torchtitan refuses it (`ParallelDims`, the pipeline
//! set-up, the batch checks).

use std::collections::{BTreeMap, BTreeSet};

use crate::ir::{OffloadRule, Placement, Precision, ScheduleKind};
use crate::plan::Plan;
use crate::solve::{PlanOptions, Setting, Source};

use super::config::{EmittedFile, Launcher, Origin, Reading, Unpriced, Written, shell_quote, split_words};
use super::error::EngineError;
use super::fields::{Change, Engine, Gap, PlanField, checkpointed, megatron_split, offloaded, reader_order, same_ranks, selective_unexpressed, expert_overlap_unexpressed, float8_unexpressed};
use super::shape::ModelShape;
use super::stages::{StageRoles, all_blocks, stage_roles, units_whole, whole_units_layout};

const ENGINE: Engine = Engine::Torchtitan;

/// torchtitan's device mesh, `pp, dp_replicate, dp_shard, cp, tp`: pipeline outermost,
/// tensor innermost.
pub const MESH_ORDER: Placement = Placement([crate::ir::MeshAxis::P, crate::ir::MeshAxis::D, crate::ir::MeshAxis::T]);

fn gap(field: PlanField, chose: impl Into<String>, why: impl Into<String>, nearest: impl Into<String>, change: Option<Change>) -> Gap {
    Gap { engine: ENGINE, field, chose: chose.into(), why: why.into(), nearest: nearest.into(), change }
}

/// The data-parallel degrees torchtitan runs a plan with: (replicate, shard).
fn dp_degrees(plan: &Plan) -> (usize, usize) {
    let p = &plan.parallel;
    match (p.zero, p.sharded_dp) {
        (0, _) => (p.dp, 1),
        (_, Some(s)) if s > 1 && s < p.dp => (p.dp / s, s),
        _ => (1, p.dp),
    }
}

/// What torchtitan cannot express of `plan`, each with the nearest setting it can run.
pub fn gaps(plan: &Plan, shape: &ModelShape) -> Result<Vec<Gap>, String> {
    let p = &plan.parallel;
    let stages = stage_roles(plan, shape)?;
    let mut out = Vec::new();
    out.extend(expert_overlap_unexpressed(Engine::Torchtitan, plan));
    out.extend(float8_unexpressed(Engine::Torchtitan, plan, "torchtitan 0.3 turns Float8 on in a model's config registry (Float8LinearConverter), which its command line cannot name"));
    if !p.grad_overlap && p.dp * p.cp > 1 {
        out.push(gap(
            PlanField::GradOverlap,
            "the gradients reduced after the backward",
            "FSDP and DDP reduce each block's gradients beside the rest of the backward",
            "reduced beside the backward",
            Some(Change::GradOverlap(true)),
        ));
    }
    if p.schedule == ScheduleKind::ZbH1 {
        out.push(gap(
            PlanField::Schedule,
            "ZB-H1",
            "its zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble) run two or more stages per rank",
            "1F1B",
            Some(Change::Schedule(ScheduleKind::OneFOneB)),
        ));
    }
    if !units_whole(&stages, shape) {
        out.push(gap(
            PlanField::Cuts,
            "a cut inside the embedding or the head",
            "module_fqns_per_model_part names tok_embeddings, layers.N, norm and lm_head",
            "the embedding with the first stage, the head with the last",
            whole_units_layout(&stages, shape).map(Change::Layout),
        ));
    }
    let set = checkpointed(plan);
    let blocks = all_blocks(shape);
    if !set.is_empty() && set != blocks {
        out.push(gap(
            PlanField::Recompute,
            format!("recompute of {} of {} layers, chosen one by one", set.len(), shape.kinds.len()),
            "its activation checkpointing is per op (selective) or of every transformer layer (full)",
            "[activation_checkpoint] mode = \"full\"",
            Some(Change::Recompute(blocks)),
        ));
    } else if let Some((chose, change)) = selective_unexpressed(plan).filter(|_| !per_op_everywhere(plan, shape)) {
        out.push(gap(PlanField::Recompute, chose, "its selective checkpointing is its per-op policy in every transformer block, never a norm's output alone", "those layers keep their activations", Some(change)));
    }
    if !offloaded(plan).is_empty() {
        out.push(gap(PlanField::Offload, "offloading recomputed layers' inputs to host memory", "it offloads no activations", "no offloading", Some(Change::Offload(OffloadRule::Never))));
    }
    if !megatron_split(plan) {
        out.push(gap(PlanField::TensorSplit, "a tensor split other than Megatron's in some layers", "its tensor-parallel plan splits every layer one way (Megatron's)", "Megatron's split in every layer", Some(Change::MegatronSplit)));
    }
    // Under its pipeline schedules FSDP reduce-scatters the gradients once, after the step's
    // last backward (torch.distributed.pipelining turns gradient sync off for the others), and
    // holds them whole until then: ZeRO 1's layout. Without a pipeline it shards them: ZeRO 2.
    let fsdp = if p.pp > 1 { 1 } else { 2 };
    let fsdp_name = if p.pp > 1 { "FSDP under its pipeline, gradients reduce-scattered once per step (ZeRO 1)" } else { "FSDP without resharding after forward (ZeRO 2)" };
    if p.zero == 1 && p.dp * p.cp > 1 && p.pp == 1 {
        out.push(gap(PlanField::Zero, "ZeRO 1", "FSDP shards gradients with the optimizer state", fsdp_name, Some(Change::Zero(2))));
    } else if p.zero == 2 && p.dp * p.cp > 1 && p.pp > 1 {
        out.push(gap(
            PlanField::Zero,
            "ZeRO 2 with pipeline parallelism",
            "its pipeline schedules turn FSDP's gradient reduce-scatter off until the step's last backward, so gradients are held whole",
            fsdp_name,
            Some(Change::Zero(1)),
        ));
    } else if p.zero == 0 && p.cp > 1 {
        out.push(gap(PlanField::Zero, "no ZeRO with context parallelism", "it applies FSDP over the context ranks", fsdp_name, Some(Change::Zero(fsdp))));
    }
    if p.sharded_dp.is_some() && p.cp > 1 {
        out.push(gap(PlanField::ShardedData, "sharded groups with context parallelism", "its FSDP groups span the context ranks", "sharding over all data ranks", Some(Change::WholeShardGroups)));
    }
    if p.ep > 1 {
        let (_, shard) = dp_degrees(plan);
        if (shard * p.cp * p.tp) % p.ep != 0 {
            out.push(gap(
                PlanField::Expert,
                format!("expert parallelism {} over replicated data ranks", p.ep),
                "expert parallelism borrows the FSDP-sharded ranks",
                "FSDP with the experts over the sharded ranks",
                Some(Change::Zero(fsdp)),
            ));
        }
        if p.etp > 1 {
            // torchtitan's sparse mesh (pp, dp_replicate, efsdp, ep) unflattens the dense one's
            // (dp_shard · cp, tp) ranks with ep innermost: whole experts, the group over the
            // tensor ranks first, as a fold at expert-TP 1 (which has no context ranks)
            out.push(gap(
                PlanField::Expert,
                format!("experts split over the {} tensor ranks", p.etp),
                "its experts are not tensor-split: expert parallelism borrows the tensor ranks instead",
                if p.cp > 1 { "torchtitan's expert placement over tensor and context ranks (not priced)" } else { "expert groups folded over tensor × data ranks with whole experts (etp 1)" },
                (p.cp <= 1).then_some(Change::FoldedExperts),
            ));
        }
    }
    if p.precision == Precision::Fp16Mixed {
        out.push(gap(PlanField::Precision, "fp16 mixed precision", "it trains in bfloat16 or float32", "bfloat16 mixed precision", Some(Change::Precision(Precision::Bf16Mixed))));
    }
    // A GPU plan prices the mixed modes' gradients 16-bit (a `cpu` one as autocast: fp32);
    // FSDP under a pipeline accumulates them whole in its fp32 reduce dtype.
    let fsdp_applied = (p.zero >= 1 && p.dp * p.cp > 1) || p.cp > 1;
    if p.precision.is_mixed() && !p.fp32_main_grads && plan.cluster.machine.is_none() && fsdp_applied && p.pp > 1 {
        out.push(gap(
            PlanField::Precision,
            "gradients accumulated and reduced in bfloat16",
            "FSDP under its pipeline accumulates them whole in float32 (training.mixed_precision_reduce, its only choice)",
            "float32 gradients",
            Some(Change::Fp32Gradients),
        ));
    }
    if !same_ranks(p.placement, MESH_ORDER, p) {
        out.push(gap(PlanField::Placement, format!("rank order {}", p.placement), "its mesh is pp, dp, cp, tp from the outside in", "PDT", Some(Change::Placement(MESH_ORDER))));
    }
    if let Some(a) = p.active_microbatches {
        out.push(gap(PlanField::InFlight, format!("at most {a} microbatches in flight"), "it has no such cap", "no cap", Some(Change::NoInFlightCap)));
    }
    Ok(out)
}

/// torchtitan's schedule name for a plan's schedule.
fn schedule_name(s: ScheduleKind) -> &'static str {
    match s {
        ScheduleKind::GPipe => "GPipe",
        ScheduleKind::OneFOneB | ScheduleKind::ZbH1 => "1F1B",
        ScheduleKind::Interleaved { .. } => "Interleaved1F1B",
    }
}

/// The module names of a stage: `tok_embeddings`, `layers.N`, `norm` and `lm_head`.
fn stage_fqns(s: &StageRoles) -> Vec<String> {
    let mut out = Vec::new();
    if s.embedding {
        out.push("tok_embeddings".to_string());
    }
    out.extend((s.first_block..s.first_block + s.blocks).map(|b| format!("layers.{b}")));
    if s.head {
        out.push("norm".to_string());
        out.push("lm_head".to_string());
    }
    out
}

/// torchtitan's registered model configuration for a model of this shape, if it has one.
fn registered(shape: &ModelShape) -> Option<(&'static str, &'static str)> {
    let key = (shape.hidden?, shape.blocks, shape.heads?, shape.kv_heads?, shape.vocab?);
    match key {
        (4096, 32, 32, 8, 128256) => Some(("llama3", "llama3_8b")),
        (8192, 80, 64, 8, 128256) => Some(("llama3", "llama3_70b")),
        (16384, 126, 128, 8, 128256) => Some(("llama3", "llama3_405b")),
        _ => None,
    }
}

/// One configuration entry: section, key, value.
type Entry = (&'static str, &'static str, toml::Value);

fn entries(plan: &Plan, shape: &ModelShape) -> Result<Vec<Entry>, String> {
    let p = &plan.parallel;
    let stages = stage_roles(plan, shape)?;
    let (replicate, shard) = dp_degrees(plan);
    let int = |v: usize| toml::Value::Integer(v as i64);
    let mut e: Vec<Entry> = vec![
        ("parallelism", "data_parallel_replicate_degree", int(replicate)),
        ("parallelism", "data_parallel_shard_degree", int(shard)),
    ];
    if shard * p.cp > 1 {
        let reshard = if p.zero >= 3 { "always" } else { "never" };
        e.push(("parallelism", "fsdp_reshard_after_forward", toml::Value::String(reshard.into())));
    }
    e.push(("parallelism", "tensor_parallel_degree", int(p.tp)));
    if p.tp > 1 {
        e.push(("parallelism", "enable_sequence_parallel", toml::Value::Boolean(p.sequence_parallel)));
    }
    e.push(("parallelism", "pipeline_parallel_degree", int(p.pp)));
    let dp = p.dp.max(1) as u64;
    let local = plan.global_batch / dp;
    let mbs = local / p.microbatches.max(1) as u64;
    if p.pp > 1 {
        e.push(("parallelism", "pipeline_parallel_schedule", toml::Value::String(schedule_name(p.schedule).into())));
        e.push(("parallelism", "pipeline_parallel_microbatch_size", int(mbs as usize)));
        let parts: Vec<toml::Value> = stages.iter().map(|s| toml::Value::Array(stage_fqns(s).into_iter().map(toml::Value::String).collect())).collect();
        e.push(("parallelism", "module_fqns_per_model_part", toml::Value::Array(parts)));
    }
    e.push(("parallelism", "context_parallel_degree", int(p.cp)));
    e.push(("parallelism", "expert_parallel_degree", int(p.ep)));
    // with pipelining the local batch is split into microbatches; without it, microbatches
    // are gradient-accumulation steps of the local batch
    let local_batch = if p.pp > 1 { local } else { mbs };
    e.push(("training", "local_batch_size", int(local_batch as usize)));
    e.push(("training", "global_batch_size", int(plan.global_batch as usize)));
    e.push(("training", "seq_len", int(plan.seq_len.or(shape.seq).unwrap_or(0) as usize)));
    // its trainer refuses CUDA graphs with pipelining and with expert parallelism's default dispatcher
    if p.pp > 1 || p.ep > 1 {
        e.push(("training", "disable_cuda_graphs", toml::Value::Boolean(true)));
    }
    match p.precision {
        Precision::Bf16 => e.push(("training", "dtype", toml::Value::String("bfloat16".into()))),
        Precision::F32 => e.push(("training", "mixed_precision_param", toml::Value::String("float32".into()))),
        Precision::Bf16Mixed | Precision::Fp16Mixed => e.push(("training", "mixed_precision_param", toml::Value::String("bfloat16".into()))),
    }
    if per_op_everywhere(plan, shape) {
        e.push(("activation_checkpoint", "mode", toml::Value::String("selective".into())));
        e.push(("activation_checkpoint", "selective_ac_option", toml::Value::String("op".into())));
    } else {
        let mode = if checkpointed(plan).is_empty() { "none" } else { "full" };
        e.push(("activation_checkpoint", "mode", toml::Value::String(mode.into())));
    }
    Ok(e)
}

/// Whether `plan` recomputes every transformer block by torchtitan's per-op policy and nothing
/// else: its `mode = "selective"` (with `selective_ac_option = "op"` before 0.3).
fn per_op_everywhere(plan: &Plan, shape: &ModelShape) -> bool {
    plan.parallel.selective_policy == crate::ir::SelectivePolicy::Ops && checkpointed(plan).is_empty() && super::fields::selective(plan) == all_blocks(shape)
}

/// The job TOML and torchtitan 0.3's command line for `plan` (which must have no [`gaps`]).
pub fn write(plan: &Plan, shape: &ModelShape) -> Result<Written, String> {
    let e = entries(plan, shape)?;
    let mut doc = toml::Table::new();
    for (section, key, value) in &e {
        let t = doc.entry(section.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(t) = t {
            t.insert(key.to_string(), value.clone());
        }
    }
    let toml_text = toml::to_string(&doc).map_err(|e| e.to_string())?;
    let (module, config) = registered(shape).unwrap_or(("MODULE", "CONFIG"));
    let per_node = plan.cluster.devices_per_node.max(1).min(plan.cluster.devices.max(1));
    let nodes = plan.cluster.devices.div_ceil(per_node);
    let mut words = vec![format!("--module {module} --config {config}")];
    words.extend(cli_args(&e));
    let launch = format!("torchrun --nnodes {nodes} --nproc-per-node {per_node} -m torchtitan.train {}", words.join(" "));
    let mut notes = vec!["torchtitan 0.3 reads its configuration from a registered config and command-line overrides; the launch line passes torchtitan.toml's entries as overrides (older torchtitan reads the TOML itself with --job.config_file)".to_string()];
    if registered(shape).is_none() {
        notes.push("torchtitan has no registered model of this shape: replace MODULE and CONFIG with the module and config your model is registered under".into());
    }
    Ok(Written { files: vec![EmittedFile { name: "torchtitan.toml".into(), text: toml_text }], launch, notes })
}

/// The command-line overrides of torchtitan 0.3 for configuration entries.
fn cli_args(entries: &[Entry]) -> Vec<String> {
    let mut out = Vec::new();
    let mut subcommand = None;
    for (section, key, value) in entries {
        if *section == "activation_checkpoint" && *key == "mode" {
            subcommand = value.as_str().map(|m| format!("activation-checkpoint:{m}"));
            continue;
        }
        // 0.3's selective mode is the per-op policy, with no option
        if *section == "activation_checkpoint" && *key == "selective_ac_option" {
            continue;
        }
        let flag = format!("--{section}.{}", key.replace('_', "-"));
        let v = match value {
            toml::Value::Boolean(true) => String::new(),
            toml::Value::Boolean(false) => {
                out.push(format!("--{section}.no-{}", key.replace('_', "-")));
                continue;
            }
            toml::Value::Array(parts) => parts
                .iter()
                .map(|p| shell_quote(&p.as_array().map(|a| a.iter().filter_map(|s| s.as_str()).collect::<Vec<_>>().join(",")).unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(" "),
            toml::Value::String(s) => shell_quote(s),
            other => other.to_string(),
        };
        out.push(if v.is_empty() { flag } else { format!("{flag} {v}") });
    }
    out.extend(subcommand);
    out
}

/// A configuration value read from a TOML or a command line.
#[derive(Clone, Debug, PartialEq)]
enum Val {
    Toml(toml::Value),
    Words(Vec<String>),
    Flag(bool),
}

/// The entries of a job TOML or a torchtitan command line, as `section.key` → value.
/// A section's entries as `section.key`, nested sections (`[quantize.linear.float8]`) as
/// dotted paths: torchtitan's configuration is dataclasses within dataclasses, never a
/// table-valued field.
fn flatten(prefix: &str, table: toml::Table, out: &mut BTreeMap<String, Val>) {
    for (k, v) in table {
        let key = format!("{prefix}.{k}");
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            v => {
                out.insert(key, Val::Toml(v));
            }
        }
    }
}

fn entries_of(text: &str, origin: &Origin) -> Result<(BTreeMap<String, Val>, Launcher), EngineError> {
    let syntax = |why: String| EngineError::Syntax { engine: ENGINE, what: origin.name(), why };
    let looks_toml = text.lines().any(|l| l.trim_start().starts_with('['));
    let mut out = BTreeMap::new();
    if looks_toml {
        let doc: toml::Table = toml::from_str(text).map_err(|e| syntax(e.to_string()))?;
        for (section, v) in doc {
            let toml::Value::Table(t) = v else { return Err(syntax(format!("`{section}` is not a [section]"))) };
            flatten(&section, t, &mut out);
        }
        return Ok((out, Launcher::default()));
    }
    let words = split_words(text).map_err(syntax)?;
    let (launcher, words) = if words.first().is_some_and(|w| !w.starts_with("--")) {
        Launcher::read(&words).map_err(syntax)?
    } else {
        (Launcher::default(), words)
    };
    let mut i = 0;
    while i < words.len() {
        let w = &words[i];
        if let Some(mode) = w.strip_prefix("activation-checkpoint:") {
            out.insert("activation_checkpoint.mode".into(), Val::Toml(toml::Value::String(mode.to_string())));
            i += 1;
            continue;
        }
        let Some(flag) = w.strip_prefix("--") else { return Err(syntax(format!("`{w}` is not a `--section.key` override"))) };
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (flag.to_string(), None),
        };
        let key = flag.replace('-', "_");
        let mut values: Vec<String> = inline.into_iter().collect();
        let mut j = i + 1;
        if values.is_empty() {
            while j < words.len() && !words[j].starts_with("--") && !words[j].starts_with("activation-checkpoint:") {
                values.push(words[j].clone());
                j += 1;
            }
        }
        i = j;
        match (key.split_once('.'), values.is_empty()) {
            (Some((s, k)), true) => {
                let (k, on) = match k.strip_prefix("no_") {
                    Some(k) => (k, false),
                    None => (k, true),
                };
                out.insert(format!("{s}.{k}"), Val::Flag(on));
            }
            (_, _) if key == "module" || key == "config" => {
                out.insert(key.clone(), Val::Words(values));
            }
            (Some(_), false) => {
                out.insert(key, Val::Words(values));
            }
            (None, _) => {
                out.insert(key, Val::Words(values));
            }
        }
    }
    Ok((out, launcher))
}

struct Entries {
    origin: Origin,
    map: BTreeMap<String, Val>,
    used: BTreeSet<String>,
}

impl Entries {
    fn syntax(&self, why: String) -> EngineError {
        EngineError::Syntax { engine: ENGINE, what: self.origin.name(), why }
    }

    fn get(&mut self, key: &str) -> Option<Val> {
        let v = self.map.get(key).cloned();
        if v.is_some() {
            self.used.insert(key.to_string());
        }
        v
    }

    fn int(&mut self, key: &str) -> Result<Option<i64>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Val::Toml(toml::Value::Integer(i))) => Ok(Some(i)),
            Some(Val::Words(w)) if w.len() == 1 => w[0].parse::<i64>().map(Some).map_err(|_| self.syntax(format!("`{key}`: `{}` is not an integer", w[0]))),
            Some(other) => Err(self.syntax(format!("`{key}`: expected an integer, got {other:?}"))),
        }
    }

    fn count(&mut self, key: &str, default: usize) -> Result<usize, EngineError> {
        match self.int(key)? {
            None => Ok(default),
            Some(v) if v >= 1 => Ok(v as usize),
            Some(v) => Err(EngineError::Refused { engine: ENGINE, check: "ParallelDims._validate".into(), why: format!("{key} = {v}: parallelism degrees must be >= 1") }),
        }
    }

    fn text(&mut self, key: &str) -> Result<Option<String>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Val::Toml(toml::Value::String(s))) => Ok(Some(s)),
            Some(Val::Words(w)) if w.len() == 1 => Ok(Some(w[0].clone())),
            Some(other) => Err(self.syntax(format!("`{key}`: expected a string, got {other:?}"))),
        }
    }

    fn flag(&mut self, key: &str) -> Result<Option<bool>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Val::Toml(toml::Value::Boolean(b))) | Some(Val::Flag(b)) => Ok(Some(b)),
            Some(Val::Words(w)) if w.len() == 1 && (w[0] == "true" || w[0] == "false") => Ok(Some(w[0] == "true")),
            Some(other) => Err(self.syntax(format!("`{key}`: expected true or false, got {other:?}"))),
        }
    }

    /// A list of names: a TOML array of strings, or comma-separated words.
    fn names(&mut self, key: &str) -> Result<Option<Vec<String>>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Val::Toml(toml::Value::Array(a))) => a.iter().map(|v| v.as_str().map(str::to_string).ok_or_else(|| self.syntax(format!("`{key}`: expected a list of names")))).collect::<Result<Vec<_>, _>>().map(Some),
            Some(Val::Toml(toml::Value::String(s))) => Ok(Some(s.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect())),
            Some(Val::Words(w)) => Ok(Some(w.iter().flat_map(|p| p.split(',')).map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect())),
            Some(other) => Err(self.syntax(format!("`{key}`: expected a list of names, got {other:?}"))),
        }
    }

    fn parts(&mut self, key: &str) -> Result<Option<Vec<Vec<String>>>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(Val::Toml(toml::Value::Array(parts))) => parts
                .iter()
                .map(|p| p.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()).ok_or_else(|| self.syntax(format!("`{key}`: expected a list of lists of module names"))))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(Val::Words(w)) => Ok(Some(w.iter().map(|p| p.split(',').map(str::to_string).collect()).collect())),
            Some(other) => Err(self.syntax(format!("`{key}`: expected module names, got {other:?}"))),
        }
    }

    fn source(&self, key: &str, v: impl ToString) -> Source {
        self.origin.source(key, v)
    }
}

/// Keys that decide nothing a plan prices.
const NO_EFFECT: &[&str] = &[
    "module", "config", "hf_assets_path", "dump_folder", "model.name", "model.flavor", "model.hf_assets_path", "model.tokenizer_path",
    "model.print_after_conversion", "optimizer.eps", "optimizer.weight_decay", "optimizer.beta1", "optimizer.beta2", "optimizer.implementation",
    "training.dataset", "training.dataset_path", "training.seed", "training.deterministic", "training.warmup_steps", "training.steps", "training.max_norm", "training.gc_freq", "training.gc_debug",
    "training.disable_cuda_graphs", "parallelism.spmd_backend", "parallelism.enable_fsdp_symm_mem",
    "parallelism.context_parallel_load_balancer", "parallelism.pipeline_parallel_schedule_csv", "compile.enable", "compile.components",
    "metrics.log_freq", "metrics.enable_tensorboard", "checkpoint.enable", "checkpoint.interval",
    "checkpoint.folder", "profiler.enable_profiling", "profiler.profile_freq", "optimizer.lr", "optimizer.name", "lr_scheduler.warmup_steps",
    "dataloader.dataset", "validator.enable", "validator.freq", "validator.steps", "debug.seed", "comm.init_timeout_seconds",
    "comm.train_timeout_seconds",
];

/// Sections none of whose keys decide anything a plan prices (logging, checkpoints,
/// validation, the learning rate's schedule, the model's name: the ONNX model is the model).
const NO_EFFECT_SECTIONS: &[&str] = &[
    "job", "profiling", "profiler", "metrics", "checkpoint", "validation", "validator", "lr_scheduler", "comm", "fault_tolerance", "memory_estimation",
    // the quantization converters' settings, of no effect unless `model.converters` names them
    // (whose effect is read there)
    "quantize", "float8",
];

/// torchtitan's `_generate_llm_fqn_per_model_part` as blocks per stage, for stages
/// generated from the layer count and the first and last stages' weights.
pub fn generated_blocks(stages: usize, layers: usize, input_weight: usize, output_weight: usize) -> Result<Vec<usize>, String> {
    if stages == 0 {
        return Err("Number of stages must be at least 1".into());
    }
    if stages == 1 {
        return Ok(vec![layers]);
    }
    let effective = layers + input_weight + output_weight;
    if stages > effective {
        return Err(format!("Number of stages ({stages}) cannot be greater than effective layers ({effective})"));
    }
    let per = effective / stages;
    let extra = effective % stages;
    if per == 0 {
        return Err(format!("Configuration would result in empty stages. With {stages} stages and {effective} effective layers"));
    }
    if input_weight > per {
        return Err(format!("input_weight ({input_weight}) exceeds minimum layers per stage ({per})."));
    }
    if output_weight > per {
        return Err(format!("output_weight ({output_weight}) exceeds minimum layers per stage ({per})."));
    }
    let mut out = Vec::with_capacity(stages);
    let mut current = 0usize;
    for s in 0..stages {
        let eff = per + usize::from(s < extra);
        let take = if s == 0 {
            eff - input_weight
        } else if s == stages - 1 {
            eff - output_weight
        } else {
            eff
        };
        let n = take.min(layers - current);
        current += n;
        out.push(n);
    }
    Ok(out)
}

/// Reads a job TOML or a torchtitan command line into the planner's request for a model of
/// `shape` on `devices` devices (`None`: from the launcher line).
pub fn read(text: &str, origin: Origin, shape: &ModelShape, devices: Option<usize>) -> Result<(Reading, Option<usize>), EngineError> {
    let (map, launcher) = entries_of(text, &origin)?;
    let e = Entries { origin: origin.clone(), map, used: BTreeSet::new() };
    let world = match (devices, launcher.devices()) {
        (Some(d), Some(l)) if d != l => return Err(EngineError::Missing { engine: ENGINE, why: format!("the launcher starts {l} processes but --cluster has {d} devices; give --cluster PRESET:{l}") }),
        (Some(d), _) | (None, Some(d)) => d,
        (None, None) => return Err(EngineError::Missing { engine: ENGINE, why: "no device count: give --cluster PRESET:N or the launcher line (torchrun --nnodes … --nproc-per-node …)".into() }),
    };
    let mut r = JobReading { e, shape, o: PlanOptions { megatron_split: true, ..PlanOptions::default() }, reading: Reading::default() };
    let dims = r.dims(world)?;
    r.sharding(&dims)?;
    let batch = r.batch(&dims)?;
    r.pipeline(&dims, &batch)?;
    r.precision()?;
    r.float8()?;
    r.checkpointing()?;
    // FSDP's post-backward hooks reduce-scatter (and DDP's buckets all-reduce) each unit's
    // gradients as its backward ends, beside the rest of it
    if dims.dp * dims.cp > 1 {
        r.o.grad_overlap = Some(true);
        r.o.sources.insert(Setting::GradOverlap, Source::Implied("FSDP and DDP reduce each block's gradients beside the rest of the backward".into()));
    }
    r.o.placement = Some(reader_order(MESH_ORDER, [dims.dp * dims.cp, dims.pp, dims.tp]));
    r.leftovers();
    r.reading.options = r.o;
    Ok((r.reading, Some(world)))
}

/// The blocks torchtitan before 0.3 checkpoints under `mode = "selective"` with a layer count
/// `every` (`selective_ac_option`): each rank counts the blocks of its model parts (its stages
/// of `layout` in order, all blocks without one) from 1 and wraps those whose count `every`
/// divides, every block at 0 (`_apply_ac_to_transformer_block`'s process-wide counter).
fn every_nth_block(every: usize, layout: Option<&crate::solve::Layout>, pp: usize, shape: &ModelShape) -> BTreeSet<usize> {
    let blocks = all_blocks(shape);
    let stages: Vec<[usize; 2]> = layout.map_or_else(|| vec![[0, shape.kinds.len().saturating_sub(1)]], |l| l.0.clone());
    let pp = pp.max(1);
    let mut out = BTreeSet::new();
    for rank in 0..pp {
        let mut count = 0;
        for [first, last] in stages.iter().enumerate().filter(|(s, _)| layout.is_none() || s % pp == rank).map(|(_, r)| *r) {
            for l in (first..=last).filter(|l| blocks.contains(l)) {
                count += 1;
                if every == 0 || count % every == 0 {
                    out.insert(l);
                }
            }
        }
        if layout.is_none() {
            break;
        }
    }
    out
}

/// A refusal by torchtitan's `check`.
fn refuse(check: &str, why: String) -> EngineError {
    EngineError::Refused { engine: ENGINE, check: check.into(), why }
}

/// The parallel degrees a job sets.
struct Dims {
    replicate: usize,
    shard: usize,
    tp: usize,
    pp: usize,
    cp: usize,
    dp: usize,
}

/// The batch a job sets: per rank, in all, and the gradient-accumulation steps between them.
#[derive(Clone, Copy)]
struct Batch {
    local: usize,
    global: usize,
    accumulation: usize,
}

/// A job's entries being read: the request so far, and what is not priced.
struct JobReading<'s> {
    e: Entries,
    shape: &'s ModelShape,
    o: PlanOptions,
    reading: Reading,
}

impl JobReading<'_> {
    /// The mesh's degrees on `world` ranks, checked as `ParallelDims` checks them.
    fn dims(&mut self, world: usize) -> Result<Dims, EngineError> {
        let (e, o, reading) = (&mut self.e, &mut self.o, &mut self.reading);
        let replicate = e.count("parallelism.data_parallel_replicate_degree", 1)?;
        let shard_raw = e.int("parallelism.data_parallel_shard_degree")?.unwrap_or(-1);
        let tp = e.count("parallelism.tensor_parallel_degree", 1)?;
        let pp = e.count("parallelism.pipeline_parallel_degree", 1)?;
        let cp = e.count("parallelism.context_parallel_degree", 1)?;
        let ep = e.count("parallelism.expert_parallel_degree", 1)?;
        let etp = e.count("parallelism.expert_tensor_parallel_degree", 1)?;
        if ep > 1 && etp != 1 && etp != tp {
            return Err(refuse("ParallelDims", format!("expert_tensor_parallel_degree ({etp}): only ETP = TP ({tp}) or ETP = 1 is supported")));
        }
        // with ETP = TP the experts split over the tensor ranks and expert parallelism borrows
        // only the sharded data and context ranks
        let experts_split = etp == tp && tp > 1;
        // async tensor parallelism: in [parallelism] since 0.2, in [compile] before
        for key in ["parallelism.enable_async_tensor_parallel", "compile.enable_async_tensor_parallel"] {
            if e.flag(key)? == Some(true) && tp > 1 {
                reading.unpriced.push(Unpriced {
                    setting: format!("{key} = true"),
                    why: "async tensor parallelism (the tensor collectives overlapped with their products) is not priced: the step is overstated by up to their time".into(),
                });
            }
        }
        if shard_raw != -1 && shard_raw < 1 {
            return Err(refuse("ParallelDims._validate", "dp_shard must -1 or >=1.".into()));
        }
        let shard = if shard_raw < 0 { world / (replicate * cp * tp * pp) } else { shard_raw as usize };
        if shard < 1 || replicate * shard * cp * tp * pp != world {
            return Err(refuse(
                "ParallelDims._validate",
                format!("Invalid parallel dims: dp_replicate({replicate}) * dp_shard({shard}) * cp({cp}) * tp({tp}) * pp({pp}) != WORLD_SIZE({world})"),
            ));
        }
        if ep > 1 && !experts_split && (shard * cp * tp) % ep != 0 {
            return Err(refuse("ParallelDims (expert mesh)", format!("the dense region dp_shard({shard}) * cp({cp}) * tp({tp}) is not divisible by ep({ep})")));
        }
        if ep > 1 && experts_split && (shard * cp) % ep != 0 {
            return Err(refuse("ParallelDims (expert mesh)", format!("with ETP = TP, dp_shard({shard}) * cp({cp}) is not divisible by ep({ep})")));
        }
        let dp = replicate * shard;
        o.pp = Some(pp);
        o.tp = Some(tp);
        o.cp = Some(cp);
        o.dp = Some(dp);
        o.sources.insert(Setting::Pp, e.source("parallelism.pipeline_parallel_degree", pp));
        o.sources.insert(Setting::Tp, e.source("parallelism.tensor_parallel_degree", tp));
        o.sources.insert(Setting::Cp, e.source("parallelism.context_parallel_degree", cp));
        o.sources.insert(Setting::Dp, Source::Implied(format!("data parallel {dp} = data_parallel_replicate_degree {replicate} × data_parallel_shard_degree {shard}")));
        if ep > 1 || self.shape.experts.is_some() {
            // Its experts are never tensor-split under expert parallelism: the sparse mesh
            // (pp, dp_replicate, efsdp, ep) re-factors the dense ranks with ep innermost, tensor
            // ranks first, which is the planner's fold at expert-TP 1 (context degree 1).
            let folded = ep > 1 && tp > 1 && !experts_split;
            if folded && cp > 1 {
                return Err(EngineError::Missing { engine: ENGINE, why: format!("expert parallelism {ep} borrows tensor and context ranks here (tp {tp}, cp {cp}); the planner folds expert groups over tensor × data ranks only") });
            }
            if ep > 1 && !folded && dp % ep != 0 {
                return Err(EngineError::Missing { engine: ENGINE, why: format!("expert parallelism {ep} borrows context ranks here; the planner carves expert groups from the {dp} data-parallel ranks (ep must divide it)") });
            }
            o.ep = Some(ep);
            o.sources.insert(Setting::Ep, e.source("parallelism.expert_parallel_degree", ep));
            if folded {
                o.etp = Some(1);
                o.sources.insert(Setting::Etp, Source::Implied(format!("expert-tensor 1: expert_parallel_degree {ep} with tensor_parallel_degree {tp} and expert_tensor_parallel_degree 1 borrows the tensor ranks")));
            } else if ep > 1 && experts_split {
                o.etp = Some(tp);
                o.sources.insert(Setting::Etp, e.source("parallelism.expert_tensor_parallel_degree", etp));
            }
            // moe.py's round-robin routing under it: every expert gets the same pairs
            if e.flag("debug.moe_force_load_balance")? == Some(true) {
                o.expert_imbalance = Some(1.0);
                o.sources.insert(Setting::ExpertImbalance, e.source("debug.moe_force_load_balance", "true: round-robin routing, every rank the mean"));
            }
        }
        Ok(Dims { replicate, shard, tp, pp, cp, dp })
    }

    /// FSDP's resharding as a ZeRO stage (HSDP's shard groups), and sequence parallelism.
    fn sharding(&mut self, d: &Dims) -> Result<(), EngineError> {
        let (e, o) = (&mut self.e, &mut self.o);
        let reshard = e.text("parallelism.fsdp_reshard_after_forward")?.unwrap_or_else(|| "default".into());
        let sharded = d.shard > 1 || d.cp > 1;
        let zero = match (sharded, reshard.as_str()) {
            (false, _) => 0,
            (true, "always") => 3,
            // under a pipeline FSDP reduce-scatters gradients once per step, held whole until
            // then (torch.distributed.pipelining defers gradient sync): ZeRO 1's layout
            (true, "never" | "default") if d.pp > 1 => 1,
            (true, "never") => 2,
            (true, "default") => 3,
            (true, other) => return Err(refuse("config parsing", format!("parallelism.fsdp_reshard_after_forward = {other}: expected default, always or never"))),
        };
        o.zero = Some(zero);
        o.sources.insert(Setting::Zero, e.source("parallelism.fsdp_reshard_after_forward", &reshard));
        if d.replicate > 1 && d.shard > 1 {
            if zero < 3 {
                let setting = if zero == 1 { "HSDP under a pipeline" } else { "HSDP without resharding after forward" };
                self.reading.unpriced.push(Unpriced { setting: setting.into(), why: "priced as ZeRO 3 over the shard groups".into() });
                o.zero = Some(3);
            }
            o.sharded_dp = Some(d.shard);
            o.sources.insert(Setting::ShardedDp, e.source("parallelism.data_parallel_shard_degree", d.shard));
        }
        let sp = e.flag("parallelism.enable_sequence_parallel")?.unwrap_or(true);
        o.sequence_parallel = Some(sp && d.tp > 1);
        Ok(())
    }

    /// The batch and the sequence length.
    fn batch(&mut self, d: &Dims) -> Result<Batch, EngineError> {
        let (e, o, dp) = (&mut self.e, &mut self.o, d.dp);
        let local = e.int("training.local_batch_size")?.unwrap_or(8);
        let global = e.int("training.global_batch_size")?.unwrap_or(-1);
        if local < 1 {
            return Err(refuse("TrainingConfig", format!("training.local_batch_size = {local} must be >= 1")));
        }
        let local = local as usize;
        let global = if global < 0 { local * dp } else { global as usize };
        if global % (local * dp) != 0 {
            return Err(refuse("Trainer (gradient accumulation)", format!("global batch size {global} must be a multiple of local batch size {local} times data-parallel degree {dp}")));
        }
        let accumulation = global / (local * dp);
        o.global_batch = Some(global as u64);
        o.sources.insert(Setting::GlobalBatch, e.source("training.global_batch_size", global));
        let seq = e.int("training.seq_len")?.unwrap_or(2048);
        o.seq_len = Some(seq as u64);
        o.sources.insert(Setting::SeqLen, e.source("training.seq_len", seq));
        Ok(Batch { local, global, accumulation })
    }

    /// The pipeline: its schedule, its stages' layers and the microbatches.
    fn pipeline(&mut self, d: &Dims, b: &Batch) -> Result<(), EngineError> {
        let (e, shape, pp) = (&mut self.e, self.shape, d.pp);
        let Batch { local, global, accumulation } = *b;
        let schedule_name = e.text("parallelism.pipeline_parallel_schedule")?.unwrap_or_else(|| "1F1B".into());
        let mbs = e.count("parallelism.pipeline_parallel_microbatch_size", 1)?;
        let fqns = e.parts("parallelism.module_fqns_per_model_part")?;
        let layers_per_stage = e.int("parallelism.pipeline_parallel_layers_per_stage")?;
        let first_less = e.count("parallelism.pipeline_parallel_first_stage_less_layers", 1)?;
        let last_less = e.count("parallelism.pipeline_parallel_last_stage_less_layers", 1)?;
        let o = &mut self.o;
        if pp > 1 {
            if local % mbs != 0 {
                return Err(refuse("pipeline schedule set-up", format!("Batch size {local} must be divisible by microbatch_size {mbs}.")));
            }
            let single = matches!(schedule_name.as_str(), "1F1B" | "GPipe");
            let multi = matches!(schedule_name.as_str(), "Interleaved1F1B" | "LoopedBFS" | "InterleavedZeroBubble" | "ZBVZeroBubble" | "DualPipeV");
            if !single && !multi {
                return Err(refuse("torch.distributed.pipelining.get_schedule_class", format!("Unknown schedule type {schedule_name}")));
            }
            let blocks_per_stage: Vec<usize> = match &fqns {
                Some(parts) => blocks_from_fqns(parts, shape).map_err(|why| refuse("pipeline module split", why))?,
                None => {
                    let stages = match layers_per_stage {
                        Some(k) if k >= 1 => (shape.blocks + first_less + last_less).div_ceil(k as usize),
                        Some(k) => return Err(refuse("config", format!("pipeline_parallel_layers_per_stage = {k} must be >= 1"))),
                        None => pp * if single { 1 } else { 2 },
                    };
                    generated_blocks(stages, shape.blocks, first_less, last_less).map_err(|why| refuse("_generate_llm_fqn_per_model_part", why))?
                }
            };
            let n = blocks_per_stage.len();
            if n % pp != 0 {
                return Err(refuse("_get_pipeline_metadata", format!("Number of virtual stages ({n}) must be divisible by pipeline parallel size ({pp})")));
            }
            let v = n / pp;
            if single && v != 1 {
                return Err(refuse("_get_pipeline_metadata", format!("Single stage schedule requires exactly 1 stage per rank, but got {v} stages per rank")));
            }
            if multi && v < 2 {
                return Err(refuse("_get_pipeline_metadata", format!("Multi-stage schedule requires at least 2 stages per rank, but got {v} stages per rank")));
            }
            let schedule = match schedule_name.as_str() {
                "1F1B" => ScheduleKind::OneFOneB,
                "GPipe" => ScheduleKind::GPipe,
                other => {
                    if other != "Interleaved1F1B" {
                        self.reading.unpriced.push(Unpriced {
                            setting: format!("pipeline_parallel_schedule = \"{other}\""),
                            why: format!("the planner has no model of {other}; priced as interleaved 1F1B with {v} stages per rank"),
                        });
                    }
                    ScheduleKind::Interleaved { virtual_stages: v }
                }
            };
            o.schedule = Some(schedule);
            o.sources.insert(Setting::Schedule, e.source("parallelism.pipeline_parallel_schedule", &schedule_name));
            let layout = super::stages::layout_from_blocks(&blocks_per_stage, shape).ok_or_else(|| refuse("pipeline module split", format!("stages {blocks_per_stage:?} leave a stage without layers")))?;
            o.sources.insert(Setting::Layout, e.source("parallelism.module_fqns_per_model_part", format!("{blocks_per_stage:?} layers per stage")));
            o.layout = Some(layout);
            let m = local / mbs * accumulation;
            if accumulation > 1 {
                self.reading.unpriced.push(Unpriced {
                    setting: format!("{accumulation} gradient-accumulation steps of the pipeline"),
                    why: format!("priced as one pipeline flush of all {m} microbatches"),
                });
            }
            o.microbatches = Some(m);
        } else {
            o.microbatches = Some(accumulation);
        }
        o.sources.insert(Setting::Microbatches, Source::Implied(format!("{} microbatches (training.local_batch_size {local}, global_batch_size {global})", o.microbatches.unwrap_or(1))));
        Ok(())
    }

    /// The training dtype and mixed precision.
    fn precision(&mut self) -> Result<(), EngineError> {
        let (e, o) = (&mut self.e, &mut self.o);
        let dtype = e.text("training.dtype")?.unwrap_or_else(|| "float32".into());
        let mixed = e.text("training.mixed_precision_param")?.unwrap_or_else(|| "bfloat16".into());
        o.precision = Some(match (dtype.as_str(), mixed.as_str()) {
            ("bfloat16", _) => Precision::Bf16,
            ("float32", "float32") => Precision::F32,
            ("float32", "bfloat16") => Precision::Bf16Mixed,
            (d, m) => return Err(refuse("config parsing", format!("training.dtype = {d}, mixed_precision_param = {m}: expected bfloat16 or float32"))),
        });
        o.sources.insert(Setting::Precision, e.source("training.mixed_precision_param", &mixed));
        // FSDP2 reduces in the reduce dtype, float32 the only one torchtitan takes. Under a
        // pipeline (ZeRO 1's layout) the whole gradients accumulate in it too: 2 + 4 + 12/d
        // bytes a parameter. Sharding them (ZeRO 3) it keeps an fp32 shard that is the master,
        // 4 + 4 + 8 over d: the 16 bytes the 16-bit recipe prices (its reduction priced 16-bit).
        let reduce = e.text("training.mixed_precision_reduce")?.unwrap_or_else(|| "float32".into());
        if reduce != "float32" {
            return Err(refuse("config parsing", format!("training.mixed_precision_reduce = {reduce}: expected float32")));
        }
        if o.precision == Some(Precision::Bf16Mixed) && o.zero == Some(1) {
            o.mixed_recipe = Some(crate::ir::MixedRecipe::LowModelFp32Grads);
        }
        Ok(())
    }

    /// Float8 training: the model converters torchtitan applies (`model.converters`: 0.2's
    /// registry names, `float8` before it) or the 2024 `[float8]` section.
    fn float8(&mut self) -> Result<(), EngineError> {
        let (e, o, reading) = (&mut self.e, &mut self.o, &mut self.reading);
        let converters = e.names("model.converters")?.unwrap_or_default();
        let old_section = e.flag("float8.enable_float8_linear")?;
        let mut linears = old_section == Some(true);
        for c in &converters {
            match c.as_str() {
                "quantize.linear.float8" | "float8" => linears = true,
                "quantize.grouped_mm.float8" | "quantize.grouped_mm.mx" => reading.unpriced.push(Unpriced { setting: format!("model.converters {c}"), why: "the routed experts' grouped products in 8 bits are not priced: priced in 16 bits".into() }),
                "quantize.linear.mx" | "mx" => reading.unpriced.push(Unpriced { setting: format!("model.converters {c}"), why: "MX block-scaled linears (Blackwell) are not priced: priced in 16 bits".into() }),
                other => reading.unpriced.push(Unpriced { setting: format!("model.converters {other}"), why: "not a converter the planner knows; not priced".into() }),
            }
        }
        if !linears {
            return Ok(());
        }
        o.float8_linears = Some(true);
        let said = if old_section == Some(true) { ("float8.enable_float8_linear", "true".to_string()) } else { ("model.converters", converters.join(", ")) };
        o.sources.insert(Setting::Float8Linears, e.source(said.0, said.1));
        // the output projection is converted unless filtered out; the planner keeps the head in 16 bits
        let filtered = match e.names("quantize.linear.float8.filter_fqns")? {
            Some(f) => f,
            None => e.names("float8.filter_fqns")?.unwrap_or_default(),
        };
        let head_kept = filtered.iter().any(|f| f == "output" || f == "lm_head");
        let others: Vec<&String> = filtered.iter().filter(|f| !matches!(f.as_str(), "output" | "lm_head" | "router.gate")).collect();
        if !head_kept {
            reading.unpriced.push(Unpriced { setting: "the output projection in float8 (not in filter_fqns)".into(), why: "the head is priced in 16 bits".into() });
        }
        if !others.is_empty() {
            let names: Vec<&str> = others.iter().map(|s| s.as_str()).collect();
            reading.unpriced.push(Unpriced { setting: format!("filter_fqns {}", names.join(", ")), why: "every linear of the blocks is priced in fp8".into() });
        }
        if o.zero == Some(3) && (e.flag("quantize.linear.float8.enable_fsdp_float8_all_gather")? == Some(true) || e.flag("float8.enable_fsdp_float8_all_gather")? == Some(true)) {
            reading.unpriced.push(Unpriced { setting: "enable_fsdp_float8_all_gather".into(), why: "FSDP's weight gathers are priced in 16 bits".into() });
        }
        Ok(())
    }

    /// Activation checkpointing and CPU offloading.
    fn checkpointing(&mut self) -> Result<(), EngineError> {
        let (e, o, reading) = (&mut self.e, &mut self.o, &mut self.reading);
        // a job TOML is read by torchtitan before 0.3, whose selective mode (the default)
        // checkpoints every Nth block unless its option says "op"
        let toml = e.map.values().any(|v| matches!(v, Val::Toml(_)));
        let given = e.text("activation_checkpoint.mode")?;
        let mode = given.clone().or_else(|| toml.then(|| "selective".to_string()));
        let option = if toml { e.text("activation_checkpoint.selective_ac_option")? } else { None };
        let layer_sac = toml && mode.as_deref() == Some("selective") && option.as_deref().is_none_or(|o| o.chars().all(|c| c.is_ascii_digit()));
        // its per-op policy: `selective_ac_option = "op"` before 0.3, the selective mode's only form since
        let op_sac = mode.as_deref() == Some("selective") && !layer_sac;
        if op_sac {
            let forced = e.names("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns")?;
            if let Some(names) = forced.filter(|f| f.as_slice() != ["moe.router.gate"]) {
                reading.unpriced.push(Unpriced { setting: format!("per_op_sac_force_recompute_mm_shapes_by_fqns {}", names.join(", ")), why: "priced as its default: the router's products recomputed, every other product counted".into() });
            }
            o.selective_layers = Some(all_blocks(self.shape));
            o.selective_policy = Some(crate::ir::SelectivePolicy::Ops);
        }
        let set = match mode.as_deref() {
            _ if layer_sac => {
                let text = option.clone().unwrap_or_else(|| "2".into());
                let every = text.parse::<usize>().map_err(|_| e.syntax(format!("`activation_checkpoint.selective_ac_option`: `{text}` is not a layer count")))?;
                every_nth_block(every, o.layout.as_ref(), o.pp.unwrap_or(1), self.shape)
            }
            Some("full") => all_blocks(self.shape),
            Some("none") => BTreeSet::new(),
            Some("selective") => BTreeSet::new(),
            Some(m @ ("memory-budget" | "memory_budget")) => {
                reading.unpriced.push(Unpriced { setting: format!("activation_checkpoint {m}"), why: "the recompute its partitioner fits to the budget is not priced; priced as no recompute, so memory is overstated".into() });
                BTreeSet::new()
            }
            Some(other) => return Err(refuse("config parsing", format!("activation_checkpoint mode `{other}`: expected selective, full, memory-budget or none"))),
            None => {
                reading.unpriced.push(Unpriced { setting: "activation_checkpoint not given".into(), why: "your --config's policy applies; priced as no recompute".into() });
                BTreeSet::new()
            }
        };
        o.checkpointed_layers = Some(set);
        let said = match (given, layer_sac) {
            (m, true) => format!("{} (every {} blocks)", m.unwrap_or_else(|| "selective, the default".into()), option.unwrap_or_else(|| "2, the default,".into())),
            (Some(m), false) if op_sac => format!("{m} (per op{})", option.map(|o| format!(", selective_ac_option {o}")).unwrap_or_default()),
            (Some(m), false) => m,
            (None, false) => mode.map_or_else(|| "(not given)".into(), |m| format!("{m}, the default")),
        };
        let source = e.source("activation_checkpoint.mode", said);
        if op_sac {
            o.sources.insert(Setting::SelectiveLayers, source.clone());
            o.sources.insert(Setting::SelectivePolicy, source.clone());
        }
        o.sources.insert(Setting::CheckpointedLayers, source);
        o.offload = Some(OffloadRule::Never);
        if e.flag("training.enable_cpu_offload")? == Some(true) {
            reading.unpriced.push(Unpriced { setting: "training.enable_cpu_offload = true".into(), why: "FSDP's CPU offloading of parameters, gradients and optimizer state is not priced".into() });
        }
        Ok(())
    }

    /// The entries no step read: of no effect, or not priced.
    fn leftovers(&mut self) {
        let e = &self.e;
        let unused: Vec<(String, Val)> = e.map.iter().filter(|(k, _)| !e.used.contains(*k)).map(|(k, v)| (k.clone(), v.clone())).collect();
        for (k, v) in unused {
            let text = format!("{k} = {}", match v {
                Val::Toml(t) => t.to_string(),
                Val::Words(w) => w.join(" "),
                Val::Flag(b) => b.to_string(),
            });
            if NO_EFFECT.contains(&k.as_str()) || NO_EFFECT_SECTIONS.iter().any(|s| k.strip_prefix(s).is_some_and(|rest| rest.starts_with('.'))) {
                self.reading.no_effect.push(text);
            } else {
                self.reading.unpriced.push(Unpriced { setting: text, why: "not a setting the planner knows; not priced".into() });
            }
        }
    }
}

/// Blocks per stage from `module_fqns_per_model_part`, checking the parts cover the model's
/// modules in order, each once.
fn blocks_from_fqns(parts: &[Vec<String>], shape: &ModelShape) -> Result<Vec<usize>, String> {
    let mut next = 0usize;
    let mut seen_embedding = false;
    let mut seen_head = 0usize;
    let mut out = Vec::with_capacity(parts.len());
    for (i, part) in parts.iter().enumerate() {
        let mut blocks = 0usize;
        for name in part {
            match name.as_str() {
                "tok_embeddings" => {
                    if i != 0 || seen_embedding || next > 0 {
                        return Err("tok_embeddings must come first, in the first part".into());
                    }
                    seen_embedding = true;
                }
                "norm" | "lm_head" | "output" => {
                    if next != shape.blocks {
                        return Err(format!("`{name}` in part {i} comes before the last transformer layer"));
                    }
                    seen_head += 1;
                }
                other => {
                    let Some(b) = other.strip_prefix("layers.").and_then(|b| b.parse::<usize>().ok()) else {
                        return Err(format!("`{other}` in part {i}: expected tok_embeddings, layers.N, norm or lm_head"));
                    };
                    if b != next || seen_head > 0 {
                        return Err(format!("part {i} names layers.{b} where layers.{next} comes next"));
                    }
                    next += 1;
                    blocks += 1;
                }
            }
        }
        out.push(blocks);
    }
    if next != shape.blocks {
        return Err(format!("the parts name {next} transformer layers; the model has {}", shape.blocks));
    }
    if !seen_embedding || seen_head == 0 {
        return Err("the parts must name tok_embeddings and the head (norm, lm_head)".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_stages_match_torchtitans_split() {
        // torchtitan's docstring example: 2 stages, 3 layers, weights 2 and 2 → 7 effective
        assert_eq!(generated_blocks(2, 3, 2, 2).unwrap(), [2, 1]);
        assert_eq!(generated_blocks(4, 126, 1, 1).unwrap(), [31, 32, 32, 31]);
        assert_eq!(generated_blocks(1, 8, 1, 1).unwrap(), [8]);
        assert!(generated_blocks(9, 4, 1, 1).unwrap_err().contains("cannot be greater"));
    }
}
