//! Structural validation of a plan: what must hold whatever the solver decided.

use std::collections::{BTreeMap, BTreeSet};

use super::schema::Plan;
use crate::codegen::validate::{Invalid, ValidationErrors, validate_section};
use crate::ir::OffloadRule;
use crate::ir::limits::{MAX_DEVICES, MAX_DIM, MAX_GLOBAL_BATCH, MAX_LAYERS, MAX_STAGE_MICROBATCHES, max_loading_horizon};

/// A structural inconsistency in a plan.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanInvalid {
    /// No stages at all.
    #[error("the plan has no stages")]
    NoStages,
    /// A degree is zero or out of range.
    #[error("parallel.{field} = {value} is out of range ({expected})")]
    Degree { field: &'static str, value: u64, expected: &'static str },
    /// pp·tp·cp·dp exceeds the cluster.
    #[error("pp·tp·cp·dp = {pp}·{tp}·{cp}·{dp} = {product} ranks but the cluster has {devices} devices")]
    TooManyRanks { pp: usize, tp: usize, cp: usize, dp: usize, product: usize, devices: usize },
    /// pp·tp·cp·dp does not fit in a machine word.
    #[error("pp·tp·cp·dp = {pp}·{tp}·{cp}·{dp} overflows: no cluster has that many devices")]
    RankOverflow { pp: usize, tp: usize, cp: usize, dp: usize },
    /// Stage count disagrees with pp · virtual_stages.
    #[error("{found} stages, but pp·virtual_stages = {pp}·{v} = {expected}")]
    StageCount { found: usize, pp: usize, v: usize, expected: usize },
    /// A stage's `index` is not its position.
    #[error("stage at position {position} has index {index}")]
    StageIndex { position: usize, index: usize },
    /// A stage's pipeline rank is wrong.
    #[error("stage {stage}: pp_rank {pp_rank}, expected {expected} (stage index mod pp)")]
    PpRank { stage: usize, pp_rank: usize, expected: usize },
    /// Layers not contiguous or not covering the model.
    #[error("stage {stage}: layers [{first}, {last}], expected to start at layer {expected_first}")]
    LayerGap { stage: usize, first: usize, last: usize, expected_first: usize },
    /// A stage's layer range is reversed.
    #[error("stage {stage}: layers [{first}, {last}] is empty (first > last)")]
    LayerRange { stage: usize, first: usize, last: usize },
    /// Layers past the end of the model, or the last layers not covered.
    #[error("stages cover layers 0..={covered_last}, but the model has {layers} layers (0..={})", layers.saturating_sub(1))]
    LayerCoverage { covered_last: usize, layers: usize },
    /// A checkpointed or selectively recomputed layer outside the stage.
    #[error("stage {stage}: recomputed layer {layer} is not among its layers [{first}, {last}]")]
    CheckpointOutside { stage: usize, layer: usize, first: usize, last: usize },
    /// A layer both recomputed whole and selectively.
    #[error("stage {stage}: layer {layer} is both checkpointed and selectively recomputed (a checkpointed layer rebuilds everything); re-plan the model")]
    SelectiveCheckpointed { stage: usize, layer: usize },
    /// An offloaded layer that the stage does not checkpoint.
    #[error("stage {stage}: layer {layer} is offloaded but not checkpointed (offloading moves what a checkpointed layer keeps); re-plan the model")]
    OffloadNotCheckpointed { stage: usize, layer: usize },
    /// A stage's tp or dp disagrees with `parallel`.
    #[error("stage {stage}: {field} = {found}, but parallel.{field} = {expected}")]
    StageDegree { stage: usize, field: &'static str, found: usize, expected: usize },
    /// A stage has the wrong number of ranks.
    #[error("stage {stage}: {found} ranks, expected tp·cp·dp = {expected}")]
    RankCount { stage: usize, found: usize, expected: usize },
    /// A rank outside 0..pp·tp·dp.
    #[error("stage {stage}: rank {rank} is outside 0..{world}")]
    RankRange { stage: usize, rank: usize, world: usize },
    /// A rank used by two pipeline ranks.
    #[error("stage {stage}: rank {rank} also runs a stage of pipeline rank {other_pp_rank}")]
    RankShared { stage: usize, rank: usize, other_pp_rank: usize },
    /// Virtual stages of one pipeline rank on different ranks.
    #[error("stage {stage}: ranks differ from those of stage {first} on the same pipeline rank {pp_rank}")]
    VirtualRanks { stage: usize, first: usize, pp_rank: usize },
    /// Memory parts do not add up.
    #[error("stage {stage}: memory_bytes.total = {total}, but its parts sum to {sum} (the larger of recompute and loss counted)")]
    MemorySum { stage: usize, total: u64, sum: u64 },
    /// The peak memory is not the largest device's memory.
    #[error(
        "predicted.peak_memory_bytes = {found}, but the largest device (pipeline rank {pp_rank}) needs {expected}"
    )]
    PeakMemory { found: u64, expected: u64, pp_rank: usize },
    /// The codegen section disagrees with itself or the plan (each problem names the rank and
    /// the action or weight).
    #[error("codegen section: {0}")]
    Codegen(ValidationErrors),
    /// A negative or non-finite time or ratio.
    #[error("{field} = {value} is not a finite non-negative number")]
    BadNumber { field: String, value: f64 },
    /// A count the file sets is past what the plan's other figures allow.
    #[error("{field} = {value} is out of range: {bound}")]
    Count { field: String, value: String, bound: String },
    /// The global batch does not split into whole samples per replica and microbatch.
    #[error(
        "global_batch = {global_batch} does not split into parallel.dp = {dp} replicas × parallel.microbatches = {microbatches} microbatches of whole samples; re-plan the model"
    )]
    BatchSplit { global_batch: u64, dp: usize, microbatches: usize },
}

fn count(field: impl Into<String>, value: impl std::fmt::Display, bound: impl Into<String>) -> PlanInvalid {
    PlanInvalid::Count { field: field.into(), value: value.to_string(), bound: bound.into() }
}

/// Checks the invariants every plan must satisfy; the error names the stage concerned.
pub fn validate(plan: &Plan) -> Result<(), PlanInvalid> {
    let par = &plan.parallel;
    for (field, value) in [
        ("pp", par.pp),
        ("tp", par.tp),
        ("dp", par.dp),
        ("cp", par.cp),
        ("ep", par.ep),
        ("microbatches", par.microbatches),
    ] {
        if value == 0 {
            return Err(PlanInvalid::Degree { field, value: 0, expected: "at least 1" });
        }
    }
    if par.etp == 0 || par.tp % par.etp != 0 {
        return Err(PlanInvalid::Degree { field: "etp", value: par.etp as u64, expected: "a divisor of parallel.tp" });
    }
    if !par.experts_folded() && par.dp % par.ep != 0 {
        return Err(PlanInvalid::Degree { field: "ep", value: par.ep as u64, expected: "a divisor of parallel.dp (expert groups are carved from the data-parallel ranks; with parallel.etp below parallel.tp they fold over tensor × data ranks)" });
    }
    if par.experts_folded() && ((par.tp * par.dp) % (par.ep * par.etp) != 0 || par.cp > 1) {
        return Err(PlanInvalid::Degree { field: "ep", value: par.ep as u64, expected: "with parallel.ep · parallel.etp dividing parallel.tp · parallel.dp and parallel.cp 1 (folded expert groups)" });
    }
    if par.zero > 3 {
        return Err(PlanInvalid::Degree { field: "zero", value: par.zero.into(), expected: "0..=3" });
    }
    let world = par.pp.checked_mul(par.tp).and_then(|w| w.checked_mul(par.dp)).and_then(|w| w.checked_mul(par.cp));
    let world = world.ok_or(PlanInvalid::RankOverflow { pp: par.pp, tp: par.tp, cp: par.cp, dp: par.dp })?;
    if world > plan.cluster.devices {
        return Err(PlanInvalid::TooManyRanks {
            pp: par.pp,
            tp: par.tp,
            cp: par.cp,
            dp: par.dp,
            product: world,
            devices: plan.cluster.devices,
        });
    }
    check_counts(plan)?;
    if plan.stages.is_empty() {
        return Err(PlanInvalid::NoStages);
    }
    let expected = par.schedule.stages(par.pp);
    if plan.stages.len() != expected {
        return Err(PlanInvalid::StageCount {
            found: plan.stages.len(),
            pp: par.pp,
            v: par.schedule.virtual_stages(),
            expected,
        });
    }

    let mut next_layer = 0usize;
    // Ranks of the first stage seen on each pipeline rank.
    let mut rank_sets: Vec<Option<(usize, BTreeSet<usize>)>> = vec![None; par.pp];
    // the pipeline rank owning each global rank (a map: `world` comes from the file)
    let mut owner: BTreeMap<usize, usize> = BTreeMap::new();
    for (position, s) in plan.stages.iter().enumerate() {
        let stage = s.index;
        if s.index != position {
            return Err(PlanInvalid::StageIndex { position, index: s.index });
        }
        if s.pp_rank != position % par.pp {
            return Err(PlanInvalid::PpRank { stage, pp_rank: s.pp_rank, expected: position % par.pp });
        }
        let [first, last] = s.layers;
        if first > last {
            return Err(PlanInvalid::LayerRange { stage, first, last });
        }
        if first != next_layer {
            return Err(PlanInvalid::LayerGap { stage, first, last, expected_first: next_layer });
        }
        next_layer = last.checked_add(1).ok_or(PlanInvalid::LayerRange { stage, first, last })?;
        for &layer in s.checkpointed_layers.iter().chain(&s.selective_layers) {
            if layer < first || layer > last {
                return Err(PlanInvalid::CheckpointOutside { stage, layer, first, last });
            }
        }
        if let Some(&layer) = s.selective_layers.iter().find(|l| s.checkpointed_layers.contains(l)) {
            return Err(PlanInvalid::SelectiveCheckpointed { stage, layer });
        }
        if let Some(&layer) = s.offloaded_layers.iter().find(|l| !s.checkpointed_layers.contains(l)) {
            return Err(PlanInvalid::OffloadNotCheckpointed { stage, layer });
        }
        for (field, found, expected) in [("tp", s.tp, par.tp), ("dp", s.dp, par.dp)] {
            if found != expected {
                return Err(PlanInvalid::StageDegree { stage, field, found, expected });
            }
        }
        let per_stage = par.tp.saturating_mul(par.dp).saturating_mul(par.cp);
        if s.ranks.len() != per_stage {
            return Err(PlanInvalid::RankCount { stage, found: s.ranks.len(), expected: per_stage });
        }
        let set: BTreeSet<usize> = s.ranks.iter().copied().collect();
        if set.len() != s.ranks.len() {
            return Err(PlanInvalid::RankCount { stage, found: set.len(), expected: per_stage });
        }
        for &rank in &s.ranks {
            if rank >= world {
                return Err(PlanInvalid::RankRange { stage, rank, world });
            }
            if let Some(&other) = owner.get(&rank).filter(|&&o| o != s.pp_rank) {
                return Err(PlanInvalid::RankShared { stage, rank, other_pp_rank: other });
            }
            owner.insert(rank, s.pp_rank);
        }
        match &rank_sets[s.pp_rank] {
            Some((first_stage, ranks)) if *ranks != set => {
                return Err(PlanInvalid::VirtualRanks { stage, first: *first_stage, pp_rank: s.pp_rank });
            }
            Some(_) => {}
            None => rank_sets[s.pp_rank] = Some((stage, set)),
        }
        let m = s.memory_bytes;
        if m.total != m.sum_of_parts() {
            return Err(PlanInvalid::MemorySum { stage, total: m.total, sum: m.sum_of_parts() });
        }
        for (name, v) in [("forward_s", s.forward_s), ("backward_s", s.backward_s), ("comm_s", s.comm_s)] {
            check_number(format!("stage {stage}: {name}"), v)?;
        }
    }
    if next_layer != plan.model.layers {
        return Err(PlanInvalid::LayerCoverage {
            covered_last: next_layer.saturating_sub(1),
            layers: plan.model.layers,
        });
    }

    let pr = &plan.predicted;
    for (name, v) in [
        ("predicted.step_time_s", pr.step_time_s),
        ("predicted.samples_per_s", pr.samples_per_s),
        ("predicted.bubble_ratio", pr.bubble_ratio),
        ("predicted.mfu", pr.mfu),
        ("predicted.hfu", pr.hfu),
    ] {
        check_number(name.to_string(), v)?;
    }
    let (pp_rank, expected) = (0..par.pp)
        .map(|r| (r, plan.rank_memory(r).total))
        .max_by_key(|&(r, t)| (t, std::cmp::Reverse(r)))
        .unwrap_or((0, 0));
    if pr.peak_memory_bytes != expected {
        return Err(PlanInvalid::PeakMemory { found: pr.peak_memory_bytes, expected, pp_rank });
    }
    if let Some(section) = &plan.codegen {
        validate_codegen(plan, section)?;
    }
    Ok(())
}

/// The counts the file sets that nothing else bounds, each against what bounds it: the
/// cluster's devices, the global batch against its replicas and microbatches, the schedule's
/// size, the loading horizon, the bound dims and the layers.
fn check_counts(plan: &Plan) -> Result<(), PlanInvalid> {
    let par = &plan.parallel;
    let c = &plan.cluster;
    if c.devices == 0 || c.devices > MAX_DEVICES {
        return Err(count("cluster.devices", c.devices, format!("1..={MAX_DEVICES}")));
    }
    if c.devices_per_node == 0 || c.devices_per_node > c.devices {
        return Err(count("cluster.devices_per_node", c.devices_per_node, format!("1..=cluster.devices ({})", c.devices)));
    }
    if plan.global_batch == 0 || plan.global_batch > MAX_GLOBAL_BATCH {
        return Err(count("global_batch", plan.global_batch, format!("1..={MAX_GLOBAL_BATCH} samples")));
    }
    // every replica's microbatches hold whole samples, as the planner splits them
    let per_replica = plan.global_batch / par.dp as u64;
    if plan.global_batch % par.dp as u64 != 0 || per_replica % par.microbatches as u64 != 0 {
        return Err(PlanInvalid::BatchSplit { global_batch: plan.global_batch, dp: par.dp, microbatches: par.microbatches });
    }
    let v = par.schedule.virtual_stages();
    let stage_microbatches = par.pp.saturating_mul(v).saturating_mul(par.microbatches);
    if stage_microbatches > MAX_STAGE_MICROBATCHES {
        return Err(count(
            "parallel.microbatches",
            par.microbatches,
            format!(
                "pp·virtual_stages·microbatches = {}·{v}·{} stage-microbatches per step is past the most a schedule may run ({MAX_STAGE_MICROBATCHES})",
                par.pp, par.microbatches
            ),
        ));
    }
    if let Some(a) = par.active_microbatches
        && (a == 0 || a > par.microbatches)
    {
        return Err(count("parallel.active_microbatches", a, format!("1..=parallel.microbatches ({})", par.microbatches)));
    }
    if let Some(s) = par.sharded_dp
        && (s == 0 || par.dp % s != 0)
    {
        return Err(count("parallel.sharded_dp", s, format!("a divisor of parallel.dp ({})", par.dp)));
    }
    let horizon = max_loading_horizon(par.microbatches, v);
    if par.loading_horizon > horizon {
        return Err(count(
            "parallel.activation_loading_horizon",
            par.loading_horizon,
            format!("at most the {horizon} backwards a rank runs per step (microbatches · virtual stages, or the default {})", OffloadRule::DEFAULT_HORIZON),
        ));
    }
    if plan.model.layers == 0 || plan.model.layers > MAX_LAYERS {
        return Err(count("model.layers", plan.model.layers, format!("1..={MAX_LAYERS}")));
    }
    if let Some(l) = plan.layer_strategies.iter().find(|l| l.layer >= plan.model.layers) {
        return Err(count("layer_strategies[].layer", l.layer, format!("below model.layers ({})", plan.model.layers)));
    }
    if let Some(s) = plan.seq_len.filter(|&s| s == 0 || s > MAX_DIM) {
        return Err(count("seq_len", s, format!("1..={MAX_DIM}")));
    }
    if let Some((name, &v)) = plan.dims.iter().find(|&(_, &v)| v < 1 || v as u64 > MAX_DIM) {
        return Err(count(format!("dims.{name}"), v, format!("1..={MAX_DIM}")));
    }
    if let Some(b) = plan.batch_statistics.as_ref().filter(|b| b.samples == 0 || b.samples > plan.global_batch) {
        return Err(count("batch_statistics.samples", b.samples, format!("1..=global_batch ({})", plan.global_batch)));
    }
    Ok(())
}

fn validate_codegen(plan: &Plan, section: &crate::codegen::CodegenSection) -> Result<(), PlanInvalid> {
    let one = |rank: usize, what: String| PlanInvalid::Codegen(ValidationErrors(vec![Invalid { rank, what }]));
    if section.stages.len() != plan.stages.len() {
        return Err(one(0, format!("{} stages in the codegen section, {} in the plan", section.stages.len(), plan.stages.len())));
    }
    for (c, s) in section.stages.iter().zip(&plan.stages) {
        if c.layers != s.layers {
            let rank = s.ranks.first().copied().unwrap_or(0);
            return Err(one(rank, format!("stage {}: codegen has layers {:?}, the plan {:?}", s.index, c.layers, s.layers)));
        }
    }
    validate_section(section, &plan.mesh(), plan.parallel.microbatches, plan.parallel.sharded_dp).map_err(PlanInvalid::Codegen)
}

fn check_number(field: String, value: f64) -> Result<(), PlanInvalid> {
    if value.is_finite() && value >= 0.0 { Ok(()) } else { Err(PlanInvalid::BadNumber { field, value }) }
}
