//! Peers' ways of planning, for comparison: Megatron-LM's rule and DeepSpeed's `uniform` and
//! `parameters` partition methods. They reuse the search with a fixed layout per candidate.

use crate::cost::ClusterSpec;
use crate::ir::{LayeredGraph, ScheduleKind};

use super::chunks::{parameter_chunks, uniform_chunks};
use super::layer_cost::CostContext;
use super::problem::CheckpointRule;
use super::search::{Candidate, enumerate, run};
use super::{Baseline, PlanDecision, PlanOptions, Progress, SolveError};

/// Plans as the baseline would; fixed degrees in `cfg` are honoured.
pub fn plan_baseline(
    lg: &LayeredGraph,
    spec: &ClusterSpec,
    cfg: &PlanOptions,
    which: Baseline,
    progress: &mut dyn FnMut(Progress),
) -> Result<PlanDecision, SolveError> {
    let layers = lg.layers.len();
    let fixed: Box<dyn Fn(&Candidate, &CostContext<'_>) -> Option<Vec<usize>>> = match which {
        Baseline::Megatron | Baseline::Uniform => {
            Box::new(move |c: &Candidate, _: &CostContext<'_>| Some(uniform_chunks(layers, c.pp * c.schedule.virtual_stages())))
        }
        Baseline::Parameters => Box::new(move |c: &Candidate, ctx: &CostContext<'_>| {
            // Parameters per layer, with a tiny weight so parameter-free layers still count.
            let params: Vec<f64> = ctx.shapes.iter().map(|s| s.params + 1.0).collect();
            parameter_chunks(&params, c.pp * c.schedule.virtual_stages())
        }),
    };
    let mut cfg = cfg.clone();
    if which != Baseline::Megatron {
        let cands = enumerate(lg, spec, &cfg)?;
        return run(lg, spec, &cfg, cands, &*fixed, progress);
    }
    // Megatron: t = GPUs per node (unless fixed), 1F1B, microbatch size 1, no ZeRO; p as
    // small as fits, d the rest; recompute only when memory needs it.
    let c = &mut cfg;
    if c.tp.is_none() {
        let mut t = spec.devices_per_node.max(1).min(spec.devices);
        while spec.devices % t != 0 {
            t -= 1;
        }
        c.tp = Some(t);
    }
    c.schedule.get_or_insert(ScheduleKind::OneFOneB);
    c.zero.get_or_insert(0);
    c.placement.get_or_insert(super::Placement::CLUSTER);
    let user_ckpt = c.checkpointing;
    let mut cands = enumerate(lg, spec, &cfg)?;
    if cfg.microbatches.is_none() {
        let ones: Vec<Candidate> = cands.iter().copied().filter(|c| c.microbatch_size == 1).collect();
        if !ones.is_empty() {
            cands = ones;
        }
    }
    let mut pps: Vec<usize> = cands.iter().map(|c| c.pp).collect();
    pps.sort_unstable();
    pps.dedup();
    let mut last_err = None;
    for pp in pps {
        for rule in [CheckpointRule::Never, CheckpointRule::Always] {
            if user_ckpt.is_some_and(|u| u != CheckpointRule::Auto && u != rule) {
                continue;
            }
            let these: Vec<Candidate> =
                cands.iter().filter(|c| c.pp == pp).map(|c| Candidate { checkpoint: rule, ..*c }).collect();
            match run(lg, spec, &cfg, these, &*fixed, progress) {
                Ok(d) => return Ok(d),
                Err(e @ SolveError::Infeasible { .. }) => last_err = Some(e),
                Err(e) => return Err(e),
            }
        }
    }
    Err(last_err.unwrap_or_else(|| SolveError::Setting("the Megatron rule found no configuration".into())))
}
