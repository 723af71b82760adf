//! Lower bounds on a candidate's step time and peak memory without an ILP (docs/planner.md
//! §3): what the outer search sorts and prunes its candidates by.

use std::sync::{Arc, Mutex, PoisonError};

use crate::ir::{OffloadRule, ScheduleKind};

use super::hash::FastMap;
use super::layer_cost::CompactTable;
use super::oracle::{bisect_infeasible, min_max_lower_bound};
use super::problem::{CheckpointRule, PipelineLayer, PipelineProblem};

/// Bubble weight c of Σ T[d] in the step time c·Σ T + (m − c)·max T (see
/// `PipelineProblem`) for `p` pipeline ranks and `m` microbatches.
///
/// GPipe and 1F1B: c = 1, so equal stages give (m + p − 1)·T — a bubble of (p − 1)/m for
/// every m, m < p included (Narayanan et al. 2021). Interleaved: 1/v. ZB-H1 (Qi et al. 2024,
/// F = B = W = T/3): c = 1/3 when m ≥ p; with fewer microbatches the backward chain of the
/// last one cannot overlap, and the schedule takes (2p + 2m − 1)·T/3 on equal stages, so
/// c = (2p − m − 1) / (3(p − 1)) (2/3 for one microbatch, 1/3 at m = p).
pub fn bubble_coeff(kind: ScheduleKind, p: usize, m: usize) -> f64 {
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => 1.0,
        ScheduleKind::Interleaved { virtual_stages } => 1.0 / virtual_stages.max(1) as f64,
        ScheduleKind::ZbH1 if m >= p || p < 2 => 1.0 / 3.0,
        ScheduleKind::ZbH1 => (2 * p - m - 1) as f64 / (3 * (p - 1)) as f64,
    }
}

/// Lower bounds on the step time and the peak memory of any solution of `p`.
///
/// Step time: the schedule's bubble with perfectly balanced devices over the least layer
/// times, plus the recompute that memory forces (a fractional knapsack over the activation
/// bytes the devices cannot hold), plus the cheapest transfer at every boundary, plus the
/// min-max split of the least sync times. Infinite when memory cannot fit even so.
pub fn bounds(p: &PipelineProblem) -> (f64, f64) {
    bounds_with(p, &p.layers)
}

/// [`bounds`] of `p` with `layers` in place of its own.
pub(super) fn bounds_with(p: &PipelineProblem, layers: &[PipelineLayer]) -> (f64, f64) {
    bounds_spread(p, &table_facts(layers), None, false)
}

/// What the bounds read of one layer: its least figures over its points.
#[derive(Clone, Copy, Debug)]
struct LayerFacts {
    /// Least forward + backward time, and with the recompute of a layer always checkpointed.
    t: f64,
    t_always: f64,
    /// Least sync time (and of it, least reduce-scatter paid again after each backward but the
    /// last under ZeRO 2 and 3), model-state bytes, saved-activation bytes, input bytes (at most
    /// `act`), forward time.
    s: f64,
    s_scatter: f64,
    state: f64,
    act: f64,
    input: f64,
    fwd: f64,
    /// The most bytes offloading may move (at most `input`).
    movable: f64,
    /// Bytes a cut after it sends.
    out: f64,
    /// The least transient its device holds beside it whatever is recomputed (the loss's
    /// working copies beyond the log-probabilities its kept bytes count).
    transient: f64,
}

fn table_facts(layers: &[PipelineLayer]) -> Vec<LayerFacts> {
    let fold_min = |it: &mut dyn Iterator<Item = f64>| it.fold(f64::INFINITY, f64::min);
    layers
        .iter()
        .map(|l| {
            let pts = &l.points;
            let act = fold_min(&mut pts.iter().map(|q| q.act_bytes));
            let input = fold_min(&mut pts.iter().map(|q| q.input_bytes)).min(act);
            LayerFacts {
                t: fold_min(&mut pts.iter().map(|q| q.fwd_s + q.bwd_s + 0.0)),
                t_always: fold_min(&mut pts.iter().map(|q| q.fwd_s + q.bwd_s + q.recompute_s())),
                s: fold_min(&mut pts.iter().map(|q| q.sync_s)),
                s_scatter: fold_min(&mut pts.iter().map(|q| q.grad_scatter_s)),
                state: fold_min(&mut pts.iter().map(|q| q.state_bytes)),
                act,
                input,
                fwd: fold_min(&mut pts.iter().map(|q| q.fwd_s)),
                movable: pts.iter().map(|q| q.offload_bytes).fold(0.0, f64::max).min(input),
                out: l.output_bytes,
                transient: fold_min(&mut pts.iter().map(|q| q.loss_bytes - q.loss_kept_bytes)),
            }
        })
        .collect()
}

/// A table's facts per layer, with the table kept alive so its address names it for the
/// memo's lifetime, and the min-max splits of its least compute and sync times by part count.
struct SharedFacts {
    _table: Arc<CompactTable>,
    layers: Vec<LayerFacts>,
    compute: FastMap<usize, f64>,
    sync: FastMap<usize, f64>,
}

/// Where [`bounds_spread`] remembers min-max splits: per table (by part count) and shared by
/// the tables with equal times.
struct SplitMemo<'m> {
    compute: &'m mut FastMap<usize, f64>,
    sync: &'m mut FastMap<usize, f64>,
    shared: &'m Mutex<Splits>,
}

/// Min-max splits already computed, by the times' bits and the part count.
type Splits = FastMap<(Vec<u64>, usize), f64>;

/// [`Splits`] shared by the memos of several threads.
#[derive(Clone, Default)]
pub struct SharedSplits(Arc<Mutex<Splits>>);

/// The bounds' work shared by the candidates of one search: each layer table's least
/// figures, computed once per table, and the min-max splits of least times, computed once
/// per distinct times and part count (tables differing only in ZeRO or data-parallel groups
/// share their times). The bounds are the same numbers [`bounds`] gives. Also each
/// schedule's in-flight counts, which candidates of one (schedule, p, m) share (an interleaved
/// schedule's are read off its p·m·v actions).
#[derive(Default)]
pub struct BoundMemo {
    tables: FastMap<*const CompactTable, SharedFacts>,
    splits: SharedSplits,
    flights: FastMap<(ScheduleKind, usize, usize), Arc<Vec<f64>>>,
}

impl BoundMemo {
    /// A memo of its own tables whose min-max splits by times are `splits` (another thread's
    /// memo may share them).
    pub(super) fn sharing(splits: SharedSplits) -> BoundMemo {
        BoundMemo { splits, ..Default::default() }
    }

    /// [`crate::cost::stage_in_flights`], computed once per (schedule, p, m).
    pub(super) fn stage_in_flights(&mut self, kind: ScheduleKind, p: usize, m: usize) -> Arc<Vec<f64>> {
        self.flights.entry((kind, p, m)).or_insert_with(|| Arc::new(crate::cost::stage_in_flights(kind, p, m))).clone()
    }
}

/// [`bounds_with`] over the layers of a shared compact `table`, with the work shared
/// through `memo`.
pub(super) fn bounds_shared(p: &PipelineProblem, table: &Arc<CompactTable>, memo: &mut BoundMemo) -> (f64, f64) {
    let shared = memo.tables.entry(Arc::as_ptr(table)).or_insert_with(|| {
        let distinct = table_facts(&table.distinct);
        let layers = table.of_layer.iter().map(|&i| distinct[i]).collect();
        SharedFacts { _table: table.clone(), layers, compute: FastMap::default(), sync: FastMap::default() }
    });
    let splits = SplitMemo { compute: &mut shared.compute, sync: &mut shared.sync, shared: &memo.splits.0 };
    bounds_spread(p, &shared.layers, Some(splits), false)
}

/// The step-time bound of `p`, tightened for interleaved schedules by [`spread_lower_bound`]
/// (a device's chunks need not be neighbours, so the contiguous split of [`bounds`] says little
/// there) and for one stage per device by [`memory_stage_bound`] (the busiest stage split with
/// each stage's memory). What the search prunes by once an incumbent exists, before an ILP; it
/// orders candidates by [`bounds`] alone, so ties resolve as before.
pub fn pruning_bound(p: &PipelineProblem) -> f64 {
    pruning_bound_with(p, &p.layers)
}

/// [`pruning_bound`] of `p` with `layers` in place of its own.
pub(super) fn pruning_bound_with(p: &PipelineProblem, layers: &[PipelineLayer]) -> f64 {
    bounds_spread(p, &table_facts(layers), None, true).0
}

/// The least possible load of the busiest of `bins` bins holding `times`, however they are
/// spread (contiguous or not): of the k·bins + 1 largest items, some bin holds k + 1, so its
/// load is at least the k + 1 smallest of them, for every k with k·bins < n.
pub fn spread_lower_bound(times: &[f64], bins: usize) -> f64 {
    if bins == 0 || times.is_empty() {
        return 0.0;
    }
    let mut sorted = times.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut best = 0.0f64;
    let mut k = 0;
    while k * bins < sorted.len() {
        let top = k * bins;
        best = best.max(sorted[top - k..=top].iter().sum());
        k += 1;
    }
    best
}

/// [`bounds_with`] from the layers' `facts`, with the spread bound on the busiest device's
/// compute and sync under an interleaved schedule when `spread`; `splits` remembers the
/// min-max splits of the table's least times where they depend on the table alone.
fn bounds_spread(p: &PipelineProblem, facts: &[LayerFacts], mut splits: Option<SplitMemo<'_>>, spread: bool) -> (f64, f64) {
    let devices = p.devices.max(1);
    let chunks = p.chunks();
    let c = p.bubble_coeff;
    let m = p.microbatches as f64;
    let l_n = facts.len();
    let mut tmin = Vec::with_capacity(l_n);
    let mut smin = Vec::with_capacity(l_n);
    let (mut state, mut act_total, mut kept_min) = (0.0, 0.0, 0.0);
    let mut any_always = false;
    // the sync times depend on m where gradients are scattered after each backward
    let mut any_scatter = false;
    let max_flight = p.in_flight.iter().cloned().fold(0.0, f64::max);
    // A checkpointed layer's inputs are held to the B, for at least this share of its chunk's
    // in-flight microbatches (under 1 only under ZB-H1).
    let to_b = (0..chunks).map(|c| p.kept_flight(c) / p.in_flight[c].max(1e-12)).fold(1.0, f64::min);
    let min_kept = (0..chunks).map(|c| p.kept_flight(c)).fold(f64::INFINITY, f64::min);
    // An offloaded layer keeps at least this share of its own inputs' in-flight bytes on the device.
    let offloaded = if p.offload == OffloadRule::Never || matches!(p.checkpoint, CheckpointRule::Never | CheckpointRule::Selective) {
        1.0
    } else {
        (p.resident_microbatches() / max_flight.max(1e-12)).min(1.0)
    };
    for (i, f) in facts.iter().enumerate() {
        let rule = p.checkpoint_of(i);
        let always = rule == CheckpointRule::Always;
        any_always |= always;
        tmin.push(if always { f.t_always } else { f.t });
        smin.push(f.s + (m - 1.0).max(0.0) * f.s_scatter);
        any_scatter |= f.s_scatter > 0.0 && m > 1.0;
        state += f.state;
        let (act, input) = (f.act, f.input);
        // offloading costs no time in this bound: it frees bytes (the layer's own inputs) for free
        let least = to_b * (input - f.movable * (1.0 - offloaded));
        let kept = match rule {
            CheckpointRule::Never | CheckpointRule::Selective => act,
            CheckpointRule::Always => least,
            CheckpointRule::Auto | CheckpointRule::AutoSelective => act,
        };
        act_total += kept;
        kept_min += if matches!(rule, CheckpointRule::Never | CheckpointRule::Selective) { act } else { input };
    }
    // The table's own memo where the times are its least times as they are (the sync times
    // unless they grow with m; the compute times unless a layer is always recomputed), else the
    // shared one.
    let mut split = |parts: usize, times: &[f64], sync: bool| match splits.as_mut() {
        Some(memo) => {
            let own = if sync {
                (!any_scatter).then_some(&mut *memo.sync)
            } else if any_always {
                None
            } else {
                Some(&mut *memo.compute)
            };
            if let Some(&v) = own.as_ref().and_then(|o| o.get(&parts)) {
                return v;
            }
            let key: (Vec<u64>, usize) = (times.iter().map(|t| t.to_bits()).collect(), parts);
            let known = memo.shared.lock().unwrap_or_else(PoisonError::into_inner).get(&key).copied();
            let v = known.unwrap_or_else(|| {
                let v = min_max_lower_bound(times, parts);
                memo.shared.lock().unwrap_or_else(PoisonError::into_inner).insert(key, v);
                v
            });
            if let Some(o) = own {
                o.insert(parts, v);
            }
            v
        }
        None => min_max_lower_bound(times, parts),
    };
    let t_sum: f64 = tmin.iter().sum();
    let s_sum: f64 = smin.iter().sum();
    let kept_flight = if offloaded < 1.0 { min_kept.min(p.resident_microbatches()) } else { min_kept };
    // some device holds the largest transient beside its share
    let transient = facts.iter().map(|f| f.transient).fold(0.0, f64::max);
    let mem_lb = (state + kept_min * kept_flight + transient) / devices as f64 + p.reserved();
    // Device d keeps at most (cap − workspace − state_d) / (least in-flight count of its
    // chunks) bytes per microbatch; summed over devices with Σ state_d = state.
    let mut f_dev = vec![f64::INFINITY; devices];
    for (ch, &f) in p.in_flight.iter().enumerate() {
        f_dev[ch % devices] = f_dev[ch % devices].min(f.max(1e-12));
    }
    let room = p.memory_cap - p.reserved();
    let f_max = f_dev.iter().cloned().fold(0.0, f64::max);
    let keep_cap = f_dev.iter().map(|f| room / f).sum::<f64>() - state / f_max;
    let mut need = act_total - keep_cap;
    let mut recompute = 0.0;
    if need > 0.0 {
        // (recompute seconds, bytes it frees) per layer the rule lets recompute, for the knapsack.
        let mut items: Vec<(f64, f64)> = (0..l_n)
            .filter(|&i| matches!(p.checkpoint_of(i), CheckpointRule::Auto | CheckpointRule::AutoSelective))
            .map(|i| (facts[i].fwd, facts[i].act - to_b * (facts[i].input - facts[i].movable * (1.0 - offloaded))))
            .collect();
        items.sort_by(|a, b| (a.0 * b.1).total_cmp(&(b.0 * a.1)));
        for (t, bytes) in items {
            if need <= 0.0 {
                break;
            }
            if bytes <= 0.0 {
                continue;
            }
            let take = (need / bytes).min(1.0);
            recompute += take * t;
            need -= take * bytes;
        }
        if need > 1e-9 * act_total.max(1.0) {
            return (f64::INFINITY, mem_lb);
        }
    }
    if !fits_per_device(p, facts, offloaded < 1.0) {
        return (f64::INFINITY, mem_lb);
    }
    let busy = t_sum + recompute;
    let (tau, sigma) = match &p.fixed_chunks {
        Some(f) => {
            let mut t = vec![0.0; devices];
            let mut s = vec![0.0; devices];
            for (l, &ch) in f.iter().enumerate() {
                t[ch % devices] += tmin[l];
                s[ch % devices] += smin[l];
            }
            (t.iter().cloned().fold(0.0, f64::max), s.iter().cloned().fold(0.0, f64::max))
        }
        None => {
            let tau = split(chunks, &tmin, false);
            let sigma = if p.virtual_stages == 1 {
                split(devices, &smin, true)
            } else {
                (s_sum / devices as f64).max(smin.iter().cloned().fold(0.0, f64::max))
            };
            if spread && p.virtual_stages > 1 {
                (tau.max(spread_lower_bound(&tmin, devices)), sigma.max(spread_lower_bound(&smin, devices)))
            } else if spread {
                (memory_stage_bound(p, facts, &tmin, offloaded < 1.0, tau), sigma)
            } else {
                (tau, sigma)
            }
        }
    };
    let transfer = match &p.fixed_chunks {
        Some(f) => (0..l_n.saturating_sub(1))
            .filter(|&l| f[l] != f[l + 1])
            .map(|l| 2.0 * facts[l].out * p.transfer_s_per_byte[f[l]])
            .sum(),
        None => {
            let least_out = facts[..l_n.saturating_sub(1)].iter().map(|l| l.out).fold(f64::INFINITY, f64::min);
            if least_out.is_finite() { p.transfer_s_per_byte.iter().map(|b| 2.0 * least_out * b).sum() } else { 0.0 }
        }
    };
    let lb = c * busy + (m - c) * tau.max(busy / devices as f64) + transfer + sigma;
    (lb, mem_lb)
}

/// A layer's bytes on a device running chunk `chunk`, per microbatch rule: (without recompute,
/// at its least, freed by recompute). Least state; kept bytes for the chunk's in-flight
/// microbatches, offloading moving the layer's own inputs of those beyond the resident ones.
fn layer_bytes(p: &PipelineProblem, fa: &LayerFacts, rule: CheckpointRule, chunk: usize, may_offload: bool) -> (f64, f64, f64) {
    let (f, k) = (p.in_flight[chunk], p.kept_flight(chunk));
    let away = if may_offload { k - k.min(p.resident_microbatches()) } else { 0.0 };
    let least = (k * fa.input - away * fa.movable).max((k - away) * fa.input);
    let whole = f * fa.act;
    match rule {
        CheckpointRule::Never | CheckpointRule::Selective => (fa.state + whole, fa.state + whole, 0.0),
        CheckpointRule::Always => (fa.state + least, fa.state + least, 0.0),
        CheckpointRule::Auto | CheckpointRule::AutoSelective => (fa.state + whole, fa.state + least.min(whole), (whole - least).max(0.0)),
    }
}

/// Whether the layers, each at its least bytes on the device, can be split so that every
/// device stays under the cap. The sum over devices in [`bounds_spread`] cannot see one device
/// overfull while another has room (a 1F1B pipeline's first stage keeps p microbatches, its
/// last one). One stage per device: the stages filled in order, each with as many layers as
/// fit, which fits whenever any contiguous split does (a layer's bytes are non-negative, so a
/// longer prefix in an earlier stage leaves a shorter suffix). Fixed chunks: their sums.
/// Interleaved chunks are not checked.
fn fits_per_device(p: &PipelineProblem, facts: &[LayerFacts], may_offload: bool) -> bool {
    let room = p.memory_cap - p.reserved();
    if !room.is_finite() {
        return true;
    }
    let least = |l: usize, chunk: usize| layer_bytes(p, &facts[l], p.checkpoint_of(l), chunk, may_offload).1;
    let slack = 1e-9 * room.abs().max(1.0);
    match &p.fixed_chunks {
        Some(fixed) => {
            let n = p.devices.max(1);
            let mut used = vec![0.0; n];
            for (l, &c) in fixed.iter().enumerate().take(facts.len()) {
                used[c % n] += least(l, c);
            }
            used.iter().all(|&u| u <= room + slack)
        }
        None if p.chunks() == p.devices.max(1) => {
            let mut l = 0;
            for c in 0..p.chunks() {
                let mut used = 0.0;
                while l < facts.len() && used + least(l, c) <= room + slack {
                    used += least(l, c);
                    l += 1;
                }
            }
            l == facts.len()
        }
        None => true,
    }
}

/// A lower bound on the busiest stage's time (its compute and the recompute its memory forces)
/// over the contiguous splits of the layers into one stage per device, at least `lo`: what a
/// split balanced by time alone misses when the stages keeping more microbatches must hold
/// fewer layers. Bisection on the stage time with the greedy check of [`fits_per_device`],
/// a stage's recompute priced at its least seconds per freed byte (so a segment's feasibility
/// only grows as layers leave it, and the greedy stays exact for the relaxation).
fn memory_stage_bound(p: &PipelineProblem, facts: &[LayerFacts], tmin: &[f64], may_offload: bool, lo: f64) -> f64 {
    let room = p.memory_cap - p.reserved();
    let stages = p.chunks();
    if !room.is_finite() || stages != p.devices.max(1) || p.fixed_chunks.is_some() || facts.is_empty() {
        return lo;
    }
    // per stage and layer: (bytes without recompute, bytes recompute may free)
    let fig: Vec<Vec<(f64, f64)>> = (0..stages)
        .map(|c| {
            (0..facts.len())
                .map(|l| {
                    let (whole, _, freed) = layer_bytes(p, &facts[l], p.checkpoint_of(l), c, may_offload);
                    (whole, freed)
                })
                .collect()
        })
        .collect();
    // Per stage, over the layers recompute may free bytes of and that some split puts there
    // (layer l on stage c needs c layers before it and stages − 1 − c after it: the embedding is
    // never on a later stage, where under ZB-H1 its inputs, kept to the B, would look free to
    // recompute): the least seconds per freed byte, the most bytes one layer frees, its least
    // forward, and the least recompute buffer (one microbatch's activations beyond its inputs,
    // held while a recomputed layer's backward runs).
    let layers = facts.len();
    let recompute: Vec<(f64, f64, f64, f64)> = (0..stages)
        .map(|c| {
            let free: Vec<usize> = (c..(layers + c + 1).saturating_sub(stages)).filter(|&l| fig[c][l].1 > 0.0).collect();
            let least = |it: &mut dyn Iterator<Item = f64>| it.fold(f64::INFINITY, f64::min);
            (
                least(&mut free.iter().map(|&l| facts[l].fwd / fig[c][l].1)),
                free.iter().map(|&l| fig[c][l].1).fold(0.0, f64::max),
                least(&mut free.iter().map(|&l| facts[l].fwd)),
                least(&mut free.iter().map(|&l| (facts[l].act - facts[l].input).max(0.0))),
            )
        })
        .collect();
    // The least seconds of whole-layer recompute that free `need` bytes on stage c: at least
    // the best rate's, and at least as many layers' least forward as the most one layer frees
    // allows.
    let recompute_s = |c: usize, need: f64| {
        let (rate, most, fwd, buffer) = recompute[c];
        let need = need + buffer;
        let layers = (need / most * (1.0 - 1e-12)).ceil();
        (need * rate).max(layers * fwd)
    };
    let fits = |cap: f64| {
        let mut l = 0;
        for c in 0..stages {
            let (mut t, mut bytes, mut freeable) = (0.0, 0.0, 0.0);
            while l < facts.len() {
                let (lb, lf) = fig[c][l];
                let (t2, b2, f2) = (t + tmin[l], bytes + lb, freeable + lf);
                let need = (b2 - room).max(0.0);
                let extra = if need > 0.0 { if need > f2 * (1.0 + 1e-12) { f64::INFINITY } else { recompute_s(c, need) } } else { 0.0 };
                if t2 + extra > cap {
                    break;
                }
                (t, bytes, freeable) = (t2, b2, f2);
                l += 1;
            }
        }
        l == facts.len()
    };
    let given = lo;
    let lo = lo * (1.0 - 1e-12);
    if fits(lo) {
        return given;
    }
    let hi = tmin.iter().sum::<f64>() + facts.iter().map(|f| f.fwd).sum::<f64>();
    if !fits(hi) {
        return f64::INFINITY;
    }
    bisect_infeasible(lo, hi, 50, fits).max(given)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{BoundMemo, bounds_shared, bounds_with};
    use crate::ir::{OffloadRule, ScheduleKind};
    use crate::solve::layer_cost::CompactTable;
    use crate::solve::problem::{CheckpointRule, ParetoPoint, PipelineLayer, PipelineObjective, PipelineProblem};

    fn point(t: f64, state: f64, act: f64) -> ParetoPoint {
        ParetoPoint {
            fwd_s: t,
            bwd_s: 2.0 * t,
            state_bytes: state,
            act_bytes: act,
            input_bytes: act / 4.0,
            shared_bytes: 0.0,
            offload_bytes: act / 8.0,
            sync_s: state * 1e-12,
            grad_scatter_s: 0.0,
            choice: 0,
            host_s: 0.0,
            gathered_bytes: 0.0,
            selective_bytes: 0.0,
            all_to_all_hidden_s: 0.0,
            gather_fwd_s: 0.0,
            loss_bytes: 0.0,
            loss_kept_bytes: 0.0,
        }
    }

    /// Three distinct layers (embedding, block, head) over `n` layers; `scale` the states.
    fn table(n: usize, scale: f64) -> Arc<CompactTable> {
        let layer = |pts: Vec<ParetoPoint>, out: f64| PipelineLayer { points: pts, output_bytes: out, tied: Vec::new() };
        let distinct = vec![
            layer(vec![point(1e-3, 4e9 * scale, 1e9)], 2e7),
            layer(vec![point(5e-3, 2e9 * scale, 3e9), point(4e-3, 3e9 * scale, 4e9)], 2e7),
            layer(vec![point(2e-3, 4e9 * scale, 2e9)], 0.0),
        ];
        let of_layer = (0..n).map(|l| if l == 0 { 0 } else if l + 1 == n { 2 } else { 1 }).collect();
        Arc::new(CompactTable { distinct, of_layer: Arc::new(of_layer) })
    }

    fn problem(devices: usize, v: usize, m: usize, cap: f64, checkpoint: CheckpointRule, fixed: Option<Vec<CheckpointRule>>) -> PipelineProblem {
        let chunks = devices * v;
        let kind = if v > 1 { ScheduleKind::Interleaved { virtual_stages: v } } else { ScheduleKind::OneFOneB };
        PipelineProblem {
            layers: Vec::new(),
            devices,
            virtual_stages: v,
            microbatches: m,
            in_flight: (0..chunks).map(|c| (devices - c % devices) as f64).collect(),
            kept_flight: (0..chunks).map(|c| (devices - c % devices) as f64).collect(),
            moments: Vec::new(),
            bubble_coeff: super::bubble_coeff(kind, devices, m),
            memory_cap: cap,
            workspace: 1e9,
            gathered: 0.0,
            transfer_s_per_byte: vec![1e-11; chunks.saturating_sub(1)],
            checkpoint,
            offload: OffloadRule::Auto,
            loading_horizon: 1.0,
            fixed_chunks: None,
            fixed_checkpoints: fixed,
            objective: PipelineObjective::StepTime,
        }
    }

    /// The memo's bounds (one memo over many problems and tables, each problem twice) are
    /// those computed from scratch on the full per-layer tables.
    #[test]
    fn shared_bounds_equal_bounds_from_scratch() {
        let n = 12;
        let tables = [table(n, 1.0), table(n, 2.0), table(n, 1.0)];
        let mut memo = BoundMemo::default();
        let mut finite = 0;
        for _ in 0..2 {
            for t in &tables {
                let full: Vec<PipelineLayer> = (0..n).map(|l| t.distinct[t.of_layer[l]].clone()).collect();
                for (devices, v) in [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2)] {
                    for cap in [80e9, 40e9, 20e9] {
                        let mut every = vec![CheckpointRule::Never; n];
                        every[3] = CheckpointRule::Always;
                        for (rule, fixed) in [
                            (CheckpointRule::Auto, None),
                            (CheckpointRule::Never, None),
                            (CheckpointRule::Always, None),
                            (CheckpointRule::Auto, Some(every)),
                        ] {
                            let p = problem(devices, v, 8, cap, rule, fixed);
                            let shared = bounds_shared(&p, t, &mut memo);
                            let scratch = bounds_with(&p, &full);
                            assert_eq!(shared.0.to_bits(), scratch.0.to_bits(), "p {devices} v {v} cap {cap} {rule:?}");
                            assert_eq!(shared.1.to_bits(), scratch.1.to_bits());
                            finite += usize::from(shared.0.is_finite());
                        }
                    }
                }
            }
        }
        assert!(finite > 0, "some problems must fit");
    }
}
