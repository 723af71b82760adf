//! Quick feasible layouts of a pipeline problem, evaluated exactly under its model: upper
//! bounds for the outer search. They cost O(layers) each, so every promising candidate gets
//! one before any ILP runs; the search's answer is then never worse than the best of them —
//! in particular never worse than Megatron's equal layer counts with no or full recompute.

use super::chunks::uniform_chunks;
use super::oracle::min_max_lower_bound;
use super::problem::{CheckpointRule, LayerChoice, OffloadRule, PipelineEval, PipelineObjective, PipelineProblem};

/// Chunks of a greedy split of `times` into exactly `chunks` non-empty contiguous parts whose
/// largest sum is at most (about) the min-max optimum.
pub fn greedy_min_max_chunks(times: &[f64], chunks: usize) -> Option<Vec<usize>> {
    let n = times.len();
    if chunks == 0 || chunks > n {
        return None;
    }
    // The bound is the largest cap proven too small; a hair above it the greedy fits.
    let lo = min_max_lower_bound(times, chunks);
    let total: f64 = times.iter().sum();
    let mut cap = lo.max(total / chunks as f64) * (1.0 + 1e-9) + 1e-15;
    for _ in 0..64 {
        if let Some(c) = greedy(times, chunks, cap) {
            return Some(c);
        }
        cap *= 1.0 + 1e-6;
    }
    Some(uniform_chunks(n, chunks))
}

/// Greedy fill up to `cap`, then split the last parts so exactly `chunks` are used.
fn greedy(times: &[f64], chunks: usize, cap: f64) -> Option<Vec<usize>> {
    let n = times.len();
    let mut out = Vec::with_capacity(n);
    let mut c = 0usize;
    let mut acc = 0.0;
    for (l, &t) in times.iter().enumerate() {
        // Layers left must still fill the chunks left.
        let must_open = n - l == chunks - c - 1;
        if l > 0 && (acc + t > cap || must_open) && c + 1 < chunks {
            c += 1;
            acc = 0.0;
        }
        if t > cap {
            return None;
        }
        acc += t;
        if acc > cap {
            return None;
        }
        out.push(c);
    }
    (c + 1 == chunks).then_some(out)
}

/// The best of a few quick layouts (the manual one if fixed; otherwise equal layer counts and
/// the greedy min-max split), each with no recompute, full recompute and a greedy recompute
/// that fits memory per device, and each of those with the offloading memory needs. `None` when none fits or the problem minimises memory.
pub fn incumbent(p: &PipelineProblem) -> Option<(Vec<LayerChoice>, PipelineEval)> {
    if p.objective != PipelineObjective::StepTime || p.validate().is_err() {
        return None;
    }
    let chunks = p.chunks();
    let l_n = p.layers.len();
    let always = |i: usize| p.checkpoint_of(i) == CheckpointRule::Always;
    // The fastest point of each layer.
    let point: Vec<usize> = p
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let always = always(i);
            (0..l.points.len())
                .min_by(|&a, &b| {
                    let t = |j: usize| l.points[j].fwd_s + l.points[j].bwd_s + if always { l.points[j].recompute_s() } else { 0.0 };
                    t(a).total_cmp(&t(b))
                })
                .unwrap_or(0)
        })
        .collect();
    let mut layouts: Vec<Vec<usize>> = Vec::new();
    match &p.fixed_chunks {
        Some(f) => layouts.push(f.clone()),
        None => {
            layouts.push(uniform_chunks(l_n, chunks));
            let times: Vec<f64> = (0..l_n)
                .map(|l| {
                    let q = &p.layers[l].points[point[l]];
                    q.fwd_s + q.bwd_s + if always(l) { q.recompute_s() } else { 0.0 }
                })
                .collect();
            if let Some(g) = greedy_min_max_chunks(&times, chunks)
                && !layouts.contains(&g)
            {
                layouts.push(g);
            }
        }
    }
    let mut best: Option<(Vec<LayerChoice>, PipelineEval)> = None;
    let mut consider = |choices: Vec<LayerChoice>| {
        if let Some(e) = p.evaluate(&choices)
            && p.feasible(&e)
            && best.as_ref().is_none_or(|b| e.step_s < b.1.step_s)
        {
            best = Some((choices, e));
        }
    };
    for layout in layouts {
        let with = |flag: &dyn Fn(usize) -> bool| -> Vec<LayerChoice> {
            (0..l_n).map(|l| p.choice(l, layout[l], point[l], flag(l))).collect()
        };
        let mut tries = Vec::new();
        match p.checkpoint {
            CheckpointRule::Never | CheckpointRule::Selective => tries.push(with(&|_| false)),
            CheckpointRule::Always => tries.push(with(&|_| true)),
            CheckpointRule::Auto | CheckpointRule::AutoSelective => {
                tries.push(with(&|_| false));
                tries.push(with(&|_| true));
                if let Some(c) = fit_by_recompute(p, with(&|_| false)) {
                    tries.push(c);
                }
            }
        }
        for c in tries {
            if let Some(o) = fit_by_offload(p, &c) {
                consider(o);
            }
            consider(c);
        }
    }
    best
}

/// Under the `Auto` offloading rule, `choices` with every checkpointed layer offloaded, then
/// offloading trimmed back to what memory needs; `None` when that changes nothing.
fn fit_by_offload(p: &PipelineProblem, choices: &[LayerChoice]) -> Option<Vec<LayerChoice>> {
    if p.offload != OffloadRule::Auto || !choices.iter().any(|c| c.checkpoint && !c.offload) {
        return None;
    }
    let mut c: Vec<LayerChoice> = choices.iter().map(|&c| LayerChoice { offload: c.checkpoint, ..c }).collect();
    p.trim_offload(&mut c);
    c.iter().any(|c| c.offload).then_some(c)
}

/// Checkpoints layers device by device, most bytes freed per second of recompute first, until
/// each device fits its memory.
fn fit_by_recompute(p: &PipelineProblem, mut choices: Vec<LayerChoice>) -> Option<Vec<LayerChoice>> {
    let e = p.evaluate(&choices)?;
    let cap = p.memory_cap - p.reserved();
    for d in 0..p.devices {
        let mut over = e.state_bytes[d] + e.act_bytes[d] - cap;
        if over <= 0.0 {
            continue;
        }
        let mut order: Vec<(f64, usize)> = (0..choices.len())
            .filter(|&l| choices[l].chunk % p.devices == d && matches!(p.checkpoint_of(l), CheckpointRule::Auto | CheckpointRule::AutoSelective | CheckpointRule::Always))
            .filter_map(|l| {
                let q = &p.layers[l].points[choices[l].point];
                let freed = p.kept_bytes(choices[l].chunk, q, false, false) - p.kept_bytes(choices[l].chunk, q, true, false);
                (freed > 0.0).then_some((freed / q.recompute_s().max(1e-30), l))
            })
            .collect();
        order.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut rec: f64 = 0.0;
        for (_, l) in order {
            let q = &p.layers[l].points[choices[l].point];
            let freed = p.kept_bytes(choices[l].chunk, q, false, false) - p.kept_bytes(choices[l].chunk, q, true, false);
            let new_rec = rec.max(q.act_bytes - q.input_bytes);
            over -= freed - (new_rec - rec);
            rec = new_rec;
            choices[l] = p.choice(l, choices[l].chunk, choices[l].point, true);
            if over <= 0.0 {
                break;
            }
        }
    }
    Some(choices)
}
