//! A plan's timeline from the plan file alone: its schedule lowered for one data-parallel
//! replica and tensor rank, replayed with the plan's stage times and its cluster's links (what
//! `inspect --trace` draws).

use super::{CostTable, SimResult, simulate};
use crate::codegen::lower::{LowerOptions, lower_schedule};
use crate::cost::{ClusterSpec, CommModel, stage_in_flights};
use crate::ir::ScheduleKind;
use crate::plan::Plan;

/// Why a plan's timeline could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TimelineError {
    /// The plan's schedule does not lower for its degrees.
    #[error("lowering the plan's schedule: {0}")]
    Lower(String),
    /// The replay failed.
    #[error("simulating the plan: {0}")]
    Replay(#[from] super::SimError),
}

/// The simulated step of `plan`: one pipeline of it (one replica, one tensor rank) replayed
/// with the plan's forward and backward times, its activation bytes in flight, and the links
/// of the cluster it names (a cluster file that has moved makes communication free).
pub fn plan_timeline(plan: &Plan) -> Result<SimResult, TimelineError> {
    let kind = plan.parallel.schedule;
    let (p, m) = (plan.parallel.pp, plan.parallel.microbatches);
    let ranks: Vec<usize> = (0..p).map(|r| plan.stages_of_rank(r).next().and_then(|s| s.ranks.first().copied()).unwrap_or(r)).collect();
    let opts = LowerOptions { ranks, boundary_bytes: plan.stages.iter().map(|s| s.output_bytes).collect(), epilogue: Vec::new() };
    let programs = lower_schedule(kind, p, m, &opts).map_err(|e| TimelineError::Lower(e.to_string()))?;
    // the plan names a preset, or records the machine of a `cpu` plan
    let cluster = match &plan.cluster.machine {
        Some(machine) => ClusterSpec::cpu(machine, Some(plan.cluster.devices)).ok(),
        None => ClusterSpec::parse(&format!("{}:{}", plan.cluster.preset, plan.cluster.devices)).ok(),
    };
    let comm = cluster.map(|c| CommModel::new(&c));
    let weight_share = if matches!(kind, ScheduleKind::ZbH1) { 0.5 } else { 0.0 };
    let flights = stage_in_flights(kind, p, m);
    let costs = CostTable {
        forward: plan.stages.iter().map(|s| s.forward_s).collect(),
        backward_input: plan.stages.iter().map(|s| s.backward_s * (1.0 - weight_share)).collect(),
        backward_weight: plan.stages.iter().map(|s| s.backward_s * weight_share).collect(),
        activation_bytes: plan.stages.iter().map(|s| s.memory_bytes.activations as f64 / flights.get(s.index).copied().unwrap_or(1.0).max(1.0)).collect(),
        comm,
        optimizer: 0.0,
    };
    Ok(simulate(&programs, &costs)?)
}
