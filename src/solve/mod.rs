//! The planner: flat problems, the intra-layer and pipeline ILPs, per-layer costs under a
//! parallel configuration, the pruned outer search and the baselines.
//!
//! Entry point: [`plan`].

pub mod baseline;
mod bounds;
mod candidates;
pub mod chunks;
mod decision;
mod error;
mod hash;
pub mod heuristic;
pub mod ilp;
pub mod layer_cost;
mod objective;
pub mod options;
pub mod oracle;
pub mod pipeline;
pub mod problem;
pub mod search;
pub mod smp_config;
pub mod strategy;

use std::time::Instant;

use crate::cost::ClusterSpec;
use crate::ir::LayeredGraph;

pub use ilp::{SolveReport, SolveStatus, SolverOptions};
pub use options::{ConfigError, Layout, PlanOptions, Setting, Source, Sourced};
pub use problem::CheckpointRule;
pub use smp_config::SmpConfig;
pub use crate::ir::{MeshAxis, Placement};
pub use decision::{AxisReport, LayerDecision, PlanDecision, Predicted, Progress, StageDecision, StageMemory};
pub use error::SolveError;
pub use objective::{Baseline, Optimize};

/// Plans `model` on `cluster`: searches (pp, tp, dp, ZeRO, microbatches, schedule,
/// placement, checkpointing) within what `opts` fixes, solves the pipeline ILP of the
/// promising candidates and returns the best plan with its proof. Without a global batch,
/// one graph batch per device is planned for.
pub fn plan(
    model: &LayeredGraph,
    cluster: &ClusterSpec,
    opts: &PlanOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<PlanDecision, SolveError> {
    let mut opts = opts.clone();
    opts.global_batch = Some(opts.global_batch_for(model, cluster));
    // Float8 linears are how the job runs its kernels: priced through the spec, as fused ones are
    let float8;
    let cluster = if opts.float8_linears == Some(true) {
        float8 = cluster.with_float8_linears().map_err(|e| SolveError::Setting(format!("--float8-linears: {e}")))?;
        &float8
    } else {
        cluster
    };
    match opts.baseline {
        Some(b) => baseline::plan_baseline(model, cluster, &opts, b, progress),
        None => search_seeded(model, cluster, &opts, progress),
    }
}

/// The search, seeded with the faithful Megatron-LM plan under the same fixed settings as the
/// first incumbent, so the answer is never slower than it (docs/baselines.md). The seed is
/// skipped where it cannot apply. Both run on one [`search::Search`] over one enumeration:
/// the seed's candidates are the grid's under Megatron-LM's rule, its layer tables the
/// search's own cut to each layer's Megatron split.
fn search_seeded(lg: &LayeredGraph, spec: &ClusterSpec, cfg: &PlanOptions, progress: &mut dyn FnMut(Progress)) -> Result<PlanDecision, SolveError> {
    let mut search = search::Search::new(lg, spec, cfg);
    let grid = search.grid()?;
    let cands = grid.candidates(cfg)?;
    let t0 = Instant::now();
    let seed = if cfg.layout.is_none() && cfg.optimize.unwrap_or_default() == Optimize::Speed {
        search.explain = false;
        let seed = baseline::megatron(&mut search, Some(&grid), &mut |_| {}).ok();
        search.explain = true;
        seed
    } else {
        None
    };
    let seed_s = t0.elapsed().as_secs_f64();
    tracing::debug!("megatron seed {:?} in {seed_s:.3} s", seed.as_ref().map(|s| s.predicted.step_time_s));
    let mut d = search.solve(cands, &|_, _| None, seed, progress)?;
    d.solver.wall_s += seed_s;
    Ok(d)
}
