//! Peers' ways of planning, for comparison: Megatron-LM's rule and DeepSpeed's `uniform` and
//! `parameters` partition methods. They reuse the search with a fixed layout per candidate;
//! Megatron-LM's rule also seeds the search, on the search's own enumeration and layer tables.
//! docs/baselines.md sets each choice against the paper and the peers' code.

use crate::cost::ClusterSpec;
use crate::ir::{LayerKind, LayeredGraph, ScheduleKind};

use super::chunks::{parameter_chunks, uniform_chunks};
use super::layer_cost::CostContext;
use super::problem::CheckpointRule;
use super::search::{Candidate, Grid, Search};
use super::{Baseline, PlanDecision, PlanOptions, Progress, SolveError};

/// Megatron-LM's placement over `chunks` (virtual) stages: `blocks / chunks` consecutive
/// blocks per chunk; the layers before the first block (embedding) go with chunk 0, those after
/// the last block (final norm, head, loss) with the last chunk, and a non-block layer between
/// blocks stays with the block before it. Like Megatron-LM, a block count that `chunks` does
/// not divide is refused (the error says which counts would work).
pub fn megatron_chunks(kinds: &[LayerKind], chunks: usize) -> Result<Vec<usize>, SolveError> {
    let chunks = chunks.max(1);
    let blocks = kinds.iter().filter(|&&k| k == LayerKind::Block).count();
    if chunks == 1 {
        return Ok(vec![0; kinds.len()]);
    }
    if blocks == 0 || blocks % chunks != 0 {
        let ok: Vec<String> = (1..=blocks).filter(|d| blocks % d == 0).map(|d| d.to_string()).collect();
        return Err(SolveError::Setting(format!(
            "--baseline megatron: the model has {blocks} transformer blocks, which {chunks} pipeline stages (pp × virtual \
             stages) do not divide; Megatron-LM requires equal blocks per stage. Use a pipeline degree times virtual \
             stages among {{{}}}",
            ok.join(", ")
        )));
    }
    let per = blocks / chunks;
    let mut out = Vec::with_capacity(kinds.len());
    let mut seen = 0usize;
    for &k in kinds {
        if k == LayerKind::Block {
            out.push(seen / per);
            seen += 1;
        } else {
            // Before the first block: chunk 0; after it: the chunk of the last block seen.
            out.push(seen.saturating_sub(1) / per);
        }
    }
    Ok(out)
}

/// Plans as the baseline would; fixed degrees in `cfg` are honoured.
pub fn plan_baseline(
    lg: &LayeredGraph,
    spec: &ClusterSpec,
    cfg: &PlanOptions,
    which: Baseline,
    progress: &mut dyn FnMut(Progress),
) -> Result<PlanDecision, SolveError> {
    let mut search = Search::new(lg, spec, cfg);
    let layers = lg.layers.len();
    let fixed: Box<dyn Fn(&Candidate, &CostContext<'_>) -> Option<Vec<usize>>> = match which {
        Baseline::Megatron => return megatron(&mut search, None, progress),
        Baseline::Uniform => {
            Box::new(move |c: &Candidate, _: &CostContext<'_>| Some(uniform_chunks(layers, c.parallel.pp * c.parallel.schedule.virtual_stages())))
        }
        Baseline::Parameters => Box::new(move |c: &Candidate, ctx: &CostContext<'_>| {
            // Parameters per layer, with a tiny weight so parameter-free layers still count.
            let params: Vec<f64> = ctx.shapes.iter().map(|s| s.params + 1.0).collect();
            parameter_chunks(&params, c.parallel.pp * c.parallel.schedule.virtual_stages())
        }),
    };
    let cands = search.grid()?.candidates(cfg)?;
    search.solve(cands, &*fixed, None, progress)
}

/// Megatron-LM as Table 1 of Narayanan et al. (2021) ran it, where `cfg` leaves a setting
/// open: t = GPUs per node, 1F1B unless an interleaved schedule is given, no ZeRO, full
/// recompute of every block, the cluster placement, no sequence parallelism.
fn megatron_settings(cfg: &PlanOptions, spec: &ClusterSpec) -> Result<PlanOptions, SolveError> {
    if cfg.layout.is_some() {
        return Err(SolveError::Setting(
            "--baseline megatron places the layers itself; drop --layout (or drop --baseline to use the layout)".into(),
        ));
    }
    let mut c = PlanOptions { baseline: Some(Baseline::Megatron), ..cfg.clone() };
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
    c.checkpointing.get_or_insert(CheckpointRule::Always);
    // Sequence parallelism came after the paper (Korthikanti et al. 2022): off unless forced.
    c.sequence_parallel.get_or_insert(false);
    Ok(c)
}

/// Megatron-LM's plan under the search's fixed settings, on the search's cost context and
/// layer tables (each layer's Megatron split): microbatch size 1 unless the microbatches are
/// fixed, p the smallest that fits among those dividing the blocks, d the rest. Its
/// candidates come from `grid` (the search's own enumeration) when given. The
/// `--baseline megatron` plan, and the search's first incumbent.
pub fn megatron(search: &mut Search<'_>, grid: Option<&Grid<'_>>, progress: &mut dyn FnMut(Progress)) -> Result<PlanDecision, SolveError> {
    let (lg, spec) = (search.model(), search.cluster());
    let cfg = megatron_settings(search.settings(), spec)?;
    let kinds: Vec<LayerKind> = lg.layers.iter().map(|l| l.kind).collect();
    let v = cfg.schedule.map_or(1, |s| s.virtual_stages());
    if let Some(pp) = cfg.pp {
        // Refuse a block count the fixed degree does not divide, as Megatron-LM does.
        megatron_chunks(&kinds, pp * v)?;
    }
    let enumerated = match grid {
        Some(g) => g.candidates(&cfg)?,
        None => Grid::of(lg, spec, &cfg)?.candidates(&cfg)?,
    };
    let mut cands: Vec<Candidate> = enumerated.into_iter().filter(|c| megatron_chunks(&kinds, c.parallel.pp * v).is_ok()).collect();
    if cands.is_empty() {
        return Err(megatron_chunks(&kinds, spec.devices.max(2)).err().unwrap_or_else(|| {
            SolveError::Setting("--baseline megatron: no pipeline degree divides the model's blocks".into())
        }));
    }
    if cfg.microbatches.is_none() {
        let ones: Vec<Candidate> = cands.iter().copied().filter(|c| c.microbatch_size == 1).collect();
        if !ones.is_empty() {
            cands = ones;
        }
    }
    let mut pps: Vec<usize> = cands.iter().map(|c| c.parallel.pp).collect();
    pps.sort_unstable();
    pps.dedup();
    // Candidates are filtered to divisible chunk counts above, so this never fails.
    let fixed = |c: &Candidate, _: &CostContext<'_>| megatron_chunks(&kinds, c.parallel.pp * c.parallel.schedule.virtual_stages()).ok();
    search.with_rule(cfg, true, |search| {
        let mut last_err = None;
        for pp in pps {
            let these: Vec<Candidate> = cands.iter().copied().filter(|c| c.parallel.pp == pp).collect();
            match search.solve(these, &fixed, None, progress) {
                Ok(d) => return Ok(d),
                Err(e @ SolveError::Infeasible { .. }) => last_err = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_err.unwrap_or_else(|| SolveError::Setting("the Megatron rule found no configuration".into())))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayerKind::{Block as B, Embedding as E, Head as H};

    #[test]
    fn megatron_places_equal_blocks_with_embedding_first_and_head_last() {
        // 1 + 128 + 1 layers on 64 stages: two blocks per stage, as the 1008B row runs.
        let mut kinds = vec![E];
        kinds.extend(std::iter::repeat_n(B, 128));
        kinds.push(H);
        let ch = megatron_chunks(&kinds, 64).unwrap();
        assert_eq!(ch[0], 0);
        assert_eq!(&ch[1..3], &[0, 0]);
        assert_eq!(&ch[3..5], &[1, 1]);
        assert_eq!(ch[129], 63);
        for c in 0..64 {
            let blocks = (0..130).filter(|&l| kinds[l] == B && ch[l] == c).count();
            assert_eq!(blocks, 2, "chunk {c}");
        }
    }

    #[test]
    fn megatron_refuses_blocks_the_stages_do_not_divide() {
        let mut kinds = vec![E];
        kinds.extend(std::iter::repeat_n(B, 6));
        kinds.push(H);
        let msg = megatron_chunks(&kinds, 4).unwrap_err().to_string();
        assert!(msg.contains("6 transformer blocks") && msg.contains("4 pipeline stages") && msg.contains("1, 2, 3, 6"), "{msg}");
        assert_eq!(megatron_chunks(&kinds, 3).unwrap(), vec![0, 0, 0, 1, 1, 2, 2, 2]);
    }
}
