//! The outer search (docs/planner.md §3): enumerate parallel configurations cheaply, bound each
//! (compute with perfect balance plus the schedule's bubble plus data-parallel sync), drop the
//! ones whose memory cannot fit, solve the pipeline ILP in bound order and stop when the next
//! bound reaches the incumbent.

use std::time::Instant;

use crate::cost::{ClusterSpec, GroupSpan, in_flight, kept_in_flight};
use crate::ir::{LayeredGraph, OffloadRule, Parallelism, ScheduleKind, limits};

use super::ilp::{SolveReport, SolveStatus, SolverOptions};
use super::layer_cost::{CostContext, LayerConfig, tensor_split_divisor};
use super::heuristic::incumbent;
use super::oracle::min_max_lower_bound;
use super::pipeline::PipelineSolution;
use super::problem::{CheckpointRule, PipelineLayer, PipelineObjective, PipelineProblem};
use super::{
    AxisReport, LayerDecision, MeshAxis, Optimize, PlanDecision, PlanOptions, Placement, Predicted, Progress, SolveError, StageDecision,
    StageMemory,
};

/// Default budget for a whole search when none is given, seconds.
pub const DEFAULT_TIME_LIMIT_S: f64 = 60.0;

/// One point of the configuration space: a parallel configuration and its microbatch size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Degrees, ZeRO, microbatches, schedule, checkpointing rule and placement (sequence
    /// parallelism false at t = 1).
    pub parallel: Parallelism,
    /// Samples per microbatch.
    pub microbatch_size: usize,
}

/// A candidate with its flat problem and bounds.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The configuration.
    pub cand: Candidate,
    /// Its pipeline problem; its `layers` are filled from `table` only when the search
    /// looks at the candidate beyond its bounds ([`Prepared::materialize`]).
    pub problem: PipelineProblem,
    /// The layer table, shared with every candidate of the same layer configuration.
    pub table: std::rc::Rc<Vec<PipelineLayer>>,
    /// Lower bound on its step time.
    pub lb: f64,
    /// Lower bound on its peak memory per device.
    pub mem_lb: f64,
}

impl Prepared {
    /// Fills the problem's layers from the shared table (once).
    pub fn materialize(&mut self) -> &PipelineProblem {
        if self.problem.layers.len() != self.table.len() {
            self.problem.layers = (*self.table).clone();
        }
        &self.problem
    }
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

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

/// The global batch [`super::plan`] resolved (0 when none is set, which enumerate refuses).
fn global_batch(cfg: &PlanOptions) -> usize {
    cfg.global_batch.map_or(0, |b| b as usize)
}

/// Enumerates the candidates `cfg` allows on `spec`.
pub fn enumerate(lg: &LayeredGraph, spec: &ClusterSpec, cfg: &PlanOptions) -> Result<Vec<Candidate>, SolveError> {
    let c = cfg;
    let devices = spec.devices;
    let layers = lg.layers.len();
    let batch = global_batch(cfg);
    if batch == 0 {
        return Err(SolveError::Setting("--global-batch must be at least 1".into()));
    }
    if layers == 0 {
        return Err(SolveError::Setting("the model has no layers to place".into()));
    }
    let fixed_v = c.schedule.map(|s| s.virtual_stages()).unwrap_or(1);
    let layout_pp = c.layout.as_ref().map(|l| l.stages() / fixed_v.max(1));
    if let (Some(a), Some(b)) = (c.pp, layout_pp)
        && a != b
    {
        return Err(SolveError::Setting(format!(
            "--pp {a} conflicts with --layout, which has {} stages",
            c.layout.as_ref().map_or(0, |l| l.stages())
        )));
    }
    let pp_fixed = c.pp.or(layout_pp);
    let split_divisor = tensor_split_divisor(lg);
    let axes = AxisLimits::of(lg, spec, cfg)?;
    let mut out = Vec::new();
    for pp in divisors(devices) {
        if pp_fixed.is_some_and(|f| f != pp) || pp > layers {
            continue;
        }
        for tp in divisors(devices / pp) {
            if c.tp.is_some_and(|f| f != tp) {
                continue;
            }
            if c.tp.is_none() && (tp > spec.devices_per_node.max(1) || (split_divisor > 0 && split_divisor % tp as u64 != 0)) {
                continue;
            }
          for cp in divisors(devices / pp / tp) {
            if !axes.context_allowed(cp, tp) {
                continue;
            }
            let dp = devices / pp / tp / cp;
            if c.dp.is_some_and(|f| f != dp) || batch % dp != 0 {
                continue;
            }
          for ep in axes.expert_degrees(dp) {
            let per_replica = batch / dp;
            let zeros: Vec<u8> = match (c.zero, c.sharded_dp) {
                (_, Some(_)) => vec![3],
                (Some(z), None) => vec![z.min(3)],
                (None, None) if dp * cp == 1 => vec![0],
                (None, None) => vec![0, 1, 2, 3],
            };
            if let Some(s) = c.sharded_dp
                && dp % s != 0
            {
                if c.dp.is_some() || c.pp.is_some() && c.tp.is_some() {
                    return Err(SolveError::Setting(format!("--sharded-dp {s} does not divide the data-parallel degree {dp}")));
                }
                continue;
            }
            let ms: Vec<usize> = match c.microbatches {
                Some(m) if per_replica % m == 0 => vec![m],
                Some(_) => continue,
                None => divisors(per_replica),
            };
            for m in ms {
                let b = per_replica / m;
                if lg.dims.fixed_batch && !lg.dims.batch_rebinds && b as i64 != lg.dims.graph_batch {
                    continue;
                }
                // Dominated: c·d replicas of b/c samples each run the same tokens per rank,
                // microbatches, groups and state without the K/V exchange.
                if cp > 1 && c.cp.is_none() && c.dp.is_none() && b.is_multiple_of(cp) && !lg.dims.fixed_batch {
                    continue;
                }
                let schedules: Vec<ScheduleKind> = match c.schedule {
                    Some(s) => vec![s],
                    None if pp == 1 => vec![ScheduleKind::OneFOneB],
                    None => {
                        let mut v = vec![ScheduleKind::OneFOneB, ScheduleKind::ZbH1, ScheduleKind::GPipe];
                        if layers >= 2 * pp && m >= pp && m % pp == 0 {
                            v.push(ScheduleKind::Interleaved { virtual_stages: 2 });
                        }
                        v
                    }
                };
                let multi = [dp * cp, pp, tp].iter().filter(|&&x| x > 1).count() >= 2;
                let placements: Vec<Placement> = match c.placement {
                    Some(p) => vec![p],
                    None if multi => vec![Placement::CLUSTER, Placement::SPREAD],
                    None => vec![Placement::CLUSTER],
                };
                // Searched on tensor-parallel candidates unless fixed; meaningless at t = 1.
                let sps: &[bool] = match c.sequence_parallel {
                    _ if tp == 1 => &[false],
                    Some(true) => &[true],
                    Some(false) => &[false],
                    None => &[false, true],
                };
                for &schedule in &schedules {
                    if pp * schedule.virtual_stages() > layers {
                        continue;
                    }
                    // the schedule's size a plan may hold (`ir::limits`)
                    if pp.saturating_mul(schedule.virtual_stages()).saturating_mul(m) > limits::MAX_STAGE_MICROBATCHES {
                        continue;
                    }
                    for &placement in &placements {
                        for (&zero, &sequence_parallel) in zeros.iter().flat_map(|z| sps.iter().map(move |s| (z, s))) {
                            out.push(Candidate {
                                parallel: Parallelism {
                                    pp,
                                    tp,
                                    dp,
                                    cp,
                                    ep,
                                    zero,
                                    sharded_dp: c.sharded_dp,
                                    microbatches: m,
                                    active_microbatches: c.active_microbatches,
                                    schedule,
                                    checkpointing: c.checkpointing.unwrap_or(CheckpointRule::Auto),
                                    placement,
                                    sequence_parallel,
                                    precision: c.precision_for(spec),
                                    offload: c.offload_for(spec),
                                    loading_horizon: c
                                        .loading_horizon
                                        .unwrap_or(OffloadRule::DEFAULT_HORIZON)
                                        .min(limits::max_loading_horizon(m, schedule.virtual_stages())),
                                },
                                microbatch_size: b,
                            });
                        }
                    }
                }
            }
          }
          }
        }
    }
    if out.is_empty() {
        return Err(SolveError::Setting(format!(
            "no parallel configuration satisfies the fixed settings on {devices} devices with global batch {batch} \
             (pp·tp·cp·dp must equal the device count, dp must divide the batch, ep must divide dp and the experts, \
             2·cp must divide the sequence{}; unless fixed, tp ≤ {} and divides the blocks' weight dimensions){}",
            axes.seq.map_or(String::new(), |s| format!(" of {s}")),
            spec.devices_per_node,
            if lg.dims.fixed_batch && !lg.dims.batch_rebinds {
                format!(
                    "; the model's batch is fixed at {} and rebinding it is not proven, so microbatches must hold exactly \
                     {} samples (re-export with a dynamic batch: dynamic_shapes=({{0: torch.export.Dim(\"batch\")}},))",
                    lg.dims.graph_batch, lg.dims.graph_batch
                )
            } else {
                String::new()
            }
        )));
    }
    Ok(out)
}

/// What bounds the context and expert degrees of a model on a cluster.
#[derive(Clone, Debug)]
pub struct AxisLimits {
    /// The sequence length, where known.
    pub seq: Option<u64>,
    /// Bytes of one sample's layer inputs over the whole model, training dtype: what full
    /// recomputation keeps of it (the first rank of a 1F1B pipeline holds p microbatches of
    /// 1/p of the layers, one sample's worth, at t = 1).
    pub sample_bytes: f64,
    /// Usable device memory, bytes.
    pub cap: f64,
    /// Expert counts of the mixture-of-experts layers (empty for a dense model).
    pub experts: Vec<usize>,
    /// The forced degrees.
    pub cp: Option<usize>,
    /// The forced expert degree.
    pub ep: Option<usize>,
}

impl AxisLimits {
    /// Reads the model's sequence, activations and experts; errors on a forced degree the
    /// model cannot take.
    pub fn of(lg: &LayeredGraph, spec: &ClusterSpec, cfg: &PlanOptions) -> Result<AxisLimits, SolveError> {
        let seq = cfg.seq_len.or_else(|| {
            let g = &lg.graph;
            g.inputs.iter().find_map(|&v| {
                let shape = g.value(v).ty.as_ref()?.shape.as_ref()?;
                (shape.rank() == 2).then(|| shape.0[1].known()).flatten().map(|s| s as u64)
            })
        });
        let dtype = cfg.precision_for(spec).compute_dtype();
        let scale = crate::cost::compute::bytes_scale(crate::cost::compute::graph_float_dtype(&lg.graph), dtype);
        let sample_bytes = lg.layers.iter().map(|l| l.input_bytes).sum::<f64>() * scale;
        let experts: Vec<usize> = lg
            .layers
            .iter()
            .flat_map(|l| l.nodes.iter())
            .filter_map(|&id| lg.graph.try_node(id))
            .filter(|n| n.op.is(crate::ir::OpKind::MixtureOfExperts))
            .map(|n| n.attrs.int("experts", 0).max(1) as usize)
            .collect();
        if let Some(e) = cfg.ep.filter(|&e| e > 1) {
            if experts.is_empty() {
                return Err(SolveError::Setting(format!("--ep {e}: the model has no mixture-of-experts layer to split over an expert group; drop --ep")));
            }
            if let Some(n) = experts.iter().find(|&&n| n % e != 0) {
                return Err(SolveError::Setting(format!("--ep {e} does not divide the {n} experts of a mixture-of-experts layer")));
            }
        }
        if let Some(c) = cfg.cp.filter(|&c| c > 1)
            && seq.is_none()
        {
            return Err(SolveError::Setting(format!(
                "--cp {c}: the model reads no token sequence (no [batch, seq] input), and context parallelism splits sequences; drop --cp"
            )));
        }
        if let Some(c) = cfg.cp.filter(|&c| c > 1)
            && let Some(s) = seq
            && s % (2 * c as u64) != 0
        {
            return Err(SolveError::Setting(format!(
                "--cp {c}: the sequence of {s} tokens does not split into 2·{c} equal chunks (a front and a back chunk per context rank); choose a degree whose double divides it"
            )));
        }
        let cap = cfg.memory_limit_bytes().unwrap_or(spec.memory_bytes) as f64;
        Ok(AxisLimits { seq, sample_bytes, cap, experts, cp: cfg.cp, ep: cfg.ep })
    }

    /// Whether the search tries context degree `c`: forced, or 1, or a sequence that splits
    /// into 2c chunks where memory needs it — c only up to what memory needs: one sample's
    /// checkpointed activations (its layers' inputs, what full recomputation keeps) split over
    /// c/2 context ranks would still take more than half a device. Below that the sequence is
    /// short enough that tensor, pipeline and data parallelism hold its tokens without an
    /// exchange of K/V in every layer. (The rule reads the sequence alone, not the tensor
    /// degree, so every t meets the same context degrees.)
    pub fn context_allowed(&self, c: usize, _tp: usize) -> bool {
        match self.cp {
            Some(f) => f == c,
            None if c == 1 => true,
            None => self.seq.is_some_and(|s| s % (2 * c as u64) == 0) && self.sample_bytes / (c as f64 / 2.0) > self.cap / 2.0,
        }
    }

    /// The expert degrees tried with `dp` data-parallel ranks: those dividing dp and every
    /// layer's expert count (only 1 for a dense model).
    pub fn expert_degrees(&self, dp: usize) -> Vec<usize> {
        if self.experts.is_empty() {
            return if self.ep.is_none_or(|e| e == 1) { vec![1] } else { Vec::new() };
        }
        divisors(dp)
            .into_iter()
            .filter(|&e| self.experts.iter().all(|&n| n % e == 0))
            .filter(|&e| self.ep.is_none_or(|f| f == e))
            .collect()
    }
}

/// Turns a manual layout (`[first, last]` per chunk) into the chunk of every layer.
pub fn layout_chunks(layout: &[[usize; 2]], layers: usize) -> Result<Vec<usize>, SolveError> {
    let mut chunks = Vec::with_capacity(layers);
    let mut next = 0;
    for (c, &[first, last]) in layout.iter().enumerate() {
        if first != next || last < first {
            return Err(SolveError::Setting(format!(
                "--layout stage {c} is {first}-{last}; it must start at layer {next} and not end before it starts"
            )));
        }
        for _ in first..=last {
            chunks.push(c);
        }
        next = last + 1;
    }
    if next != layers {
        return Err(SolveError::Setting(format!("--layout covers layers 0-{} but the model has {layers}", next.saturating_sub(1))));
    }
    Ok(chunks)
}

/// The layer-cost configuration of a candidate (groups laid out by its placement).
pub fn layer_config(spec: &ClusterSpec, cand: &Candidate) -> LayerConfig {
    let dpn = spec.devices_per_node.max(1);
    let par = &cand.parallel;
    let deg = par.placed_degrees();
    let d_stride = par.placement.stride(MeshAxis::D, deg);
    let t_stride = par.placement.stride(MeshAxis::T, deg);
    let (dp, cp, ep) = (par.dp.max(1), par.cp.max(1), par.ep.max(1));
    let zg = par.zero_group().min(dp).max(1);
    // D positions d·c + k lie d_stride ranks apart; expert groups are runs of e data-parallel
    // indices at one context rank, and the ranks holding the same experts the rest of D.
    let at = |d: usize, k: usize| (d * cp + k) * d_stride;
    let same_experts = |replicas: usize| -> Vec<usize> { (0..(replicas / ep).max(1)).flat_map(|j| (0..cp).map(move |k| at(j * ep, k))).collect() };
    LayerConfig {
        tp: par.tp,
        microbatch: cand.microbatch_size,
        zero: par.zero,
        zero_group: GroupSpan::strided(0, zg * cp, d_stride, dpn),
        dp_group: GroupSpan::strided(0, dp * cp, d_stride, dpn),
        tp_group: GroupSpan::strided(0, par.tp, t_stride, dpn),
        sequence_parallel: par.sequence_parallel && par.tp > 1,
        cp,
        cp_group: GroupSpan::strided(0, cp, d_stride, dpn),
        ep,
        ep_group: GroupSpan::strided(0, ep, d_stride * cp, dpn),
        expert_dp_group: GroupSpan::of_ranks(&same_experts(dp), dpn),
        expert_zero_group: GroupSpan::of_ranks(&same_experts(zg), dpn),
    }
}

/// Builds the pipeline problem of a candidate.
pub fn prepare(
    ctx: &mut CostContext<'_>,
    cand: &Candidate,
    memory_cap: f64,
    active: Option<usize>,
    fixed_chunks: Option<Vec<usize>>,
    fixed_checkpoints: Option<Vec<bool>>,
) -> Prepared {
    let spec = ctx.spec;
    let rank = |d: usize, p: usize, t: usize| cand.parallel.rank_of(d, 0, p, t);
    let lc = layer_config(spec, cand);
    let table = ctx.layers(&lc);
    let v = cand.parallel.schedule.virtual_stages();
    let chunks = cand.parallel.pp * v;
    let beta: Vec<f64> = (0..chunks.saturating_sub(1))
        .map(|c| {
            let kind = ctx.comm.link_between(rank(0, c % cand.parallel.pp, 0), rank(0, (c + 1) % cand.parallel.pp, 0));
            1.0 / ctx.comm.link(kind).bandwidth
        })
        .collect();
    let flight: Vec<f64> = (0..chunks)
        .map(|c| {
            let f = in_flight(cand.parallel.schedule, cand.parallel.pp, cand.parallel.microbatches, c % cand.parallel.pp + 1);
            match active {
                Some(a) => f.min(a as f64),
                None => f,
            }
        })
        .collect();
    let kept_flight: Vec<f64> = (0..chunks)
        .map(|c| {
            let f = kept_in_flight(cand.parallel.schedule, cand.parallel.pp, cand.parallel.microbatches, c % cand.parallel.pp + 1);
            active.map_or(f, |a| f.min(a as f64))
        })
        .collect();
    let problem = PipelineProblem {
        layers: Vec::new(),
        devices: cand.parallel.pp,
        virtual_stages: v,
        microbatches: cand.parallel.microbatches,
        in_flight: flight,
        kept_flight,
        bubble_coeff: bubble_coeff(cand.parallel.schedule, cand.parallel.pp, cand.parallel.microbatches),
        memory_cap,
        workspace: spec.workspace_bytes as f64,
        transfer_s_per_byte: beta,
        checkpoint: cand.parallel.checkpointing,
        offload: cand.parallel.offload,
        loading_horizon: cand.parallel.loading_horizon as f64,
        fixed_chunks,
        fixed_checkpoints,
        objective: PipelineObjective::StepTime,
    };
    let (lb, mem_lb) = bounds_with(&problem, &table);
    Prepared { cand: *cand, problem, table, lb, mem_lb }
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
fn bounds_with(p: &PipelineProblem, layers: &[PipelineLayer]) -> (f64, f64) {
    let devices = p.devices.max(1);
    let chunks = p.chunks();
    let c = p.bubble_coeff;
    let m = p.microbatches as f64;
    let fold_min = |it: &mut dyn Iterator<Item = f64>| it.fold(f64::INFINITY, f64::min);
    let l_n = layers.len();
    let mut tmin = Vec::with_capacity(l_n);
    let mut smin = Vec::with_capacity(l_n);
    let (mut state, mut act_total, mut kept_min) = (0.0, 0.0, 0.0);
    // (recompute seconds, bytes it frees) per layer, for the knapsack.
    let mut items: Vec<(f64, f64)> = Vec::new();
    let min_flight = p.in_flight.iter().cloned().fold(f64::INFINITY, f64::min);
    let max_flight = p.in_flight.iter().cloned().fold(0.0, f64::max);
    // An offloaded layer keeps at least this share of its own inputs' in-flight bytes on the device.
    let offloaded = if p.offload == OffloadRule::Never || p.checkpoint == CheckpointRule::Never {
        1.0
    } else {
        (p.loading_horizon / max_flight.max(1e-12)).min(1.0)
    };
    for (i, l) in layers.iter().enumerate() {
        let pts = &l.points;
        let rule = p.checkpoint_of(i);
        let always = rule == CheckpointRule::Always;
        tmin.push(fold_min(&mut pts.iter().map(|q| q.fwd_s + q.bwd_s + if always { q.fwd_s } else { 0.0 })));
        smin.push(fold_min(&mut pts.iter().map(|q| q.sync_s)));
        state += fold_min(&mut pts.iter().map(|q| q.state_bytes));
        let act = fold_min(&mut pts.iter().map(|q| q.act_bytes));
        let input = fold_min(&mut pts.iter().map(|q| q.input_bytes)).min(act);
        // offloading costs no time in this bound: it frees bytes (the layer's own inputs) for free
        let movable = pts.iter().map(|q| q.offload_bytes).fold(0.0, f64::max).min(input);
        let least = input - movable * (1.0 - offloaded);
        let kept = match rule {
            CheckpointRule::Never => act,
            CheckpointRule::Always => least,
            CheckpointRule::Auto => {
                items.push((fold_min(&mut pts.iter().map(|q| q.fwd_s)), act - least));
                act
            }
        };
        act_total += kept;
        kept_min += if rule == CheckpointRule::Never { act } else { input };
    }
    let t_sum: f64 = tmin.iter().sum();
    let s_sum: f64 = smin.iter().sum();
    let kept_flight = if offloaded < 1.0 { min_flight.min(p.loading_horizon) } else { min_flight };
    let mem_lb = (state + kept_min * kept_flight) / devices as f64 + p.workspace;
    // Device d keeps at most (cap − workspace − state_d) / (least in-flight count of its
    // chunks) bytes per microbatch; summed over devices with Σ state_d = state.
    let mut f_dev = vec![f64::INFINITY; devices];
    for (ch, &f) in p.in_flight.iter().enumerate() {
        f_dev[ch % devices] = f_dev[ch % devices].min(f.max(1e-12));
    }
    let room = p.memory_cap - p.workspace;
    let f_max = f_dev.iter().cloned().fold(0.0, f64::max);
    let keep_cap = f_dev.iter().map(|f| room / f).sum::<f64>() - state / f_max;
    let mut need = act_total - keep_cap;
    let mut recompute = 0.0;
    if need > 0.0 {
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
            let tau = min_max_lower_bound(&tmin, chunks);
            let sigma = if p.virtual_stages == 1 {
                min_max_lower_bound(&smin, devices)
            } else {
                (s_sum / devices as f64).max(smin.iter().cloned().fold(0.0, f64::max))
            };
            (tau, sigma)
        }
    };
    let transfer = match &p.fixed_chunks {
        Some(f) => (0..l_n.saturating_sub(1))
            .filter(|&l| f[l] != f[l + 1])
            .map(|l| 2.0 * layers[l].output_bytes * p.transfer_s_per_byte[f[l]])
            .sum(),
        None => {
            let least_out =
                layers[..l_n.saturating_sub(1)].iter().map(|l| l.output_bytes).fold(f64::INFINITY, f64::min);
            if least_out.is_finite() { p.transfer_s_per_byte.iter().map(|b| 2.0 * least_out * b).sum() } else { 0.0 }
        }
    };
    let lb = c * busy + (m - c) * tau.max(busy / devices as f64) + transfer + sigma;
    (lb, mem_lb)
}

/// Solves the given candidates in bound order; `fixed(cand, layers)` may impose a layout.
/// `seed`, a plan found elsewhere (the Megatron baseline), is an incumbent from the start and
/// is returned when nothing here is faster.
#[allow(clippy::too_many_arguments)]
pub fn run(
    lg: &LayeredGraph,
    spec: &ClusterSpec,
    cfg: &PlanOptions,
    cands: Vec<Candidate>,
    fixed: &dyn Fn(&Candidate, &CostContext<'_>) -> Option<Vec<usize>>,
    seed: Option<PlanDecision>,
    progress: &mut dyn FnMut(Progress),
) -> Result<PlanDecision, SolveError> {
    let seed_obj = seed.as_ref().map_or(f64::INFINITY, |s| s.predicted.step_time_s);
    // The least objective found so far, the seed's included.
    let inc_of = |best: &Option<(usize, PipelineSolution)>| {
        let b = best.as_ref().map_or(f64::INFINITY, |b| b.1.report.objective);
        let m = b.min(seed_obj);
        m.is_finite().then_some(m)
    };
    let start = Instant::now();
    let c = cfg;
    let limit = c.time_limit_s.unwrap_or(DEFAULT_TIME_LIMIT_S);
    let cap = c.memory_limit_bytes().map_or(spec.memory_bytes, |m| m.min(u64::MAX)) as f64;
    let layout = match &c.layout {
        Some(l) => Some(layout_chunks(&l.0, lg.layers.len())?),
        None => None,
    };
    let mut ctx = cost_context(lg, spec, cfg);
    let total = cands.len() as u64;
    let mut prepared: Vec<Prepared> = cands
        .iter()
        .map(|cand| {
            let f = layout.clone().or_else(|| fixed(cand, &ctx));
            prepare(&mut ctx, cand, cap, c.active_microbatches, f, c.checkpoint_flags(lg.layers.len()))
        })
        .collect();
    tracing::debug!("prepared {} candidates in {:.3} s", prepared.len(), start.elapsed().as_secs_f64());
    // Per context and expert degree, the least bound of its configurations that fit.
    let alternatives = |degree: fn(&Candidate) -> usize| -> Vec<(usize, Option<f64>)> {
        let mut by: std::collections::BTreeMap<usize, Option<f64>> = Default::default();
        for p in &prepared {
            let e = by.entry(degree(&p.cand)).or_insert(None);
            if p.mem_lb <= cap && p.lb.is_finite() {
                *e = Some(e.map_or(p.lb, |x: f64| x.min(p.lb)));
            }
        }
        by.into_iter().collect()
    };
    let cp_alternatives = alternatives(|c| c.parallel.cp);
    let ep_alternatives = alternatives(|c| c.parallel.ep);
    let min_mem = prepared.iter().map(|p| p.mem_lb).fold(f64::INFINITY, f64::min);
    let (mut fit, unfit): (Vec<Prepared>, Vec<Prepared>) =
        prepared.drain(..).partition(|p| p.mem_lb <= cap && p.lb.is_finite());
    let mut skipped = unfit.len() as u64;
    fit.sort_by(|a, b| a.lb.total_cmp(&b.lb));
    // HiGHS single-threaded, so ties resolve the same way every run.
    let opts = |remaining: f64| SolverOptions { time_limit_s: Some(remaining.max(0.05)), threads: Some(1), mip_rel_gap: 0.0 };
    // Quick layouts first, in bound order while a bound can still beat the best of them: an
    // incumbent before any ILP, and the guarantee that the answer is no worse than any of
    // them (equal layer counts included, whatever the time limit).
    let mut quick: Vec<Option<PipelineSolution>> = vec![None; fit.len()];
    let mut best: Option<(usize, PipelineSolution)> = None;
    for i in 0..fit.len() {
        if inc_of(&best).is_some_and(|inc| fit[i].lb >= inc * (1.0 - 1e-9)) {
            break;
        }
        fit[i].materialize();
        let p = &fit[i];
        let Some((choices, eval)) = incumbent(&p.problem) else { continue };
        let objective = eval.step_s;
        let proven = objective <= p.lb * (1.0 + 1e-9);
        let report = SolveReport {
            status: if proven { SolveStatus::Optimal } else { SolveStatus::Feasible },
            objective,
            bound: if proven { objective } else { p.lb },
            gap: if proven || objective <= 0.0 { 0.0 } else { (objective - p.lb) / objective },
            wall_s: 0.0,
        };
        let sol = PipelineSolution { report, choices, eval: Some(eval) };
        if best.as_ref().is_none_or(|b| objective < b.1.report.objective) {
            best = Some((i, sol.clone()));
        }
        quick[i] = Some(sol);
    }
    tracing::debug!("quick layouts done at {:.3} s, incumbent {:?}", start.elapsed().as_secs_f64(), best.as_ref().map(|b| b.1.report.objective));
    let mut solved = 0u64;
    let mut open_bound = f64::INFINITY; // least bound among candidates not proven
    let mut done = skipped;
    let mut i = 0;
    while i < fit.len() {
        fit[i].materialize();
        let p = &fit[i];
        if quick[i].as_ref().is_some_and(|q| q.report.status == SolveStatus::Optimal) {
            // Its quick layout meets its bound: solved, without an ILP.
            solved += 1;
            done += 1;
            i += 1;
            continue;
        }
        let incumbent = inc_of(&best);
        if incumbent.is_some_and(|inc| p.lb >= inc * (1.0 - 1e-9)) {
            break;
        }
        let remaining = limit - start.elapsed().as_secs_f64();
        if remaining <= 0.0 && incumbent.is_some() {
            open_bound = open_bound.min(p.lb);
            break;
        }
        // One ILP may use a fifth of the budget, so several candidates get a look.
        let sol = p.problem.solve_below(&opts(remaining.min((limit / 5.0).max(0.2))), incumbent)?;
        solved += 1;
        done += 1;
        tracing::debug!(
            "solved {:?} lb {:.4} -> {:?} {:.4} bound {:.4} in {:.3} s",
            p.cand,
            p.lb,
            sol.report.status,
            sol.report.objective,
            sol.report.bound,
            sol.report.wall_s
        );
        match sol.report.status {
            SolveStatus::Optimal | SolveStatus::Feasible => {
                if sol.report.status == SolveStatus::Feasible {
                    open_bound = open_bound.min(sol.report.bound.max(p.lb));
                }
                // The ILP's proof replaces this candidate's own quick layout.
                let same = best.as_ref().is_some_and(|b| b.0 == i) && sol.report.status == SolveStatus::Optimal;
                if same || incumbent.is_none_or(|inc| sol.report.objective < inc) {
                    best = Some((i, sol));
                }
            }
            SolveStatus::TimeLimit => open_bound = open_bound.min(sol.report.bound.max(p.lb)),
            SolveStatus::Infeasible => {
                // Nothing in this candidate beats the incumbent: when the incumbent is this
                // candidate's own quick layout, that layout is its optimum.
                if let Some((bi, b)) = best.as_mut()
                    && *bi == i
                    && b.report.objective <= seed_obj
                {
                    b.report.status = SolveStatus::Optimal;
                    b.report.bound = b.report.objective;
                    b.report.gap = 0.0;
                }
            }
        }
        progress(Progress { done, total, best_step_s: best.as_ref().map(|b| b.1.report.objective) });
        i += 1;
    }
    skipped += (fit.len() - i) as u64;
    progress(Progress { done: total, total, best_step_s: inc_of(&best) });
    if let Some(mut s) = seed
        && best.as_ref().is_none_or(|b| seed_obj <= b.1.report.objective)
    {
        // Nothing searched beats the seed: it is the answer, with this search's bound.
        let bound = open_bound.min(seed_obj);
        let gap = if seed_obj > 0.0 { ((seed_obj - bound) / seed_obj).max(0.0) } else { 0.0 };
        s.solver = SolveReport {
            status: if gap <= 1e-6 { SolveStatus::Optimal } else { SolveStatus::Feasible },
            objective: seed_obj,
            bound,
            gap,
            wall_s: start.elapsed().as_secs_f64(),
        };
        s.candidates_solved += solved;
        s.candidates_skipped += skipped;
        return Ok(s);
    }
    let Some((bi, mut sol)) = best else {
        return Err(infeasible(lg, spec, cfg, cap, min_mem));
    };
    let mut chosen = fit[bi].clone();
    if c.optimize.unwrap_or_default() == Optimize::Memory {
        let max_step = sol.report.objective * 1.05;
        let mut best_mem = sol.eval.as_ref().map_or(f64::INFINITY, |e| e.total_bytes.iter().cloned().fold(0.0, f64::max));
        for p in fit.iter_mut().filter(|p| p.lb <= max_step) {
            p.materialize();
            let p = &*p;
            let remaining = limit - start.elapsed().as_secs_f64();
            if remaining <= 0.0 {
                break;
            }
            let prob = PipelineProblem { objective: PipelineObjective::PeakMemory { max_step_s: max_step }, ..p.problem.clone() };
            let s = prob.solve(&opts(remaining))?;
            solved += 1;
            if matches!(s.report.status, SolveStatus::Optimal | SolveStatus::Feasible) && s.report.objective < best_mem {
                best_mem = s.report.objective;
                chosen = Prepared { problem: prob, ..p.clone() };
                sol = s;
            }
        }
    }
    let objective = sol.report.objective;
    let bound = match c.optimize.unwrap_or_default() {
        Optimize::Speed => open_bound.min(objective).min(sol.report.bound.max(chosen.lb)),
        Optimize::Memory => sol.report.bound,
    };
    let gap = if objective > 0.0 { ((objective - bound) / objective).max(0.0) } else { 0.0 };
    let report = SolveReport {
        status: if gap <= 1e-6 && sol.report.status == SolveStatus::Optimal { SolveStatus::Optimal } else { SolveStatus::Feasible },
        objective,
        bound,
        gap,
        wall_s: start.elapsed().as_secs_f64(),
    };
    let mut d = decision(&ctx, cfg, &chosen, sol, report, solved, skipped, cap)?;
    d.axes.cp_alternatives = cp_alternatives;
    d.axes.sample_input_bytes = AxisLimits::of(lg, spec, cfg).map_or(0.0, |a| if a.seq.is_some() { a.sample_bytes } else { 0.0 });
    d.axes.ep_alternatives = ep_alternatives;
    Ok(d)
}

/// What the context and expert axes cost and save in a solved candidate, on its busiest
/// pipeline rank.
fn axis_report(ctx: &CostContext<'_>, cand: &Candidate, prob: &PipelineProblem, choices: &[super::problem::LayerChoice], eval: &super::problem::PipelineEval) -> AxisReport {
    let lc = layer_config(ctx.spec, cand);
    let p = prob.devices.max(1);
    let busiest = (0..p).max_by(|&a, &b| (eval.fwd_s[a] + eval.bwd_s[a]).total_cmp(&(eval.fwd_s[b] + eval.bwd_s[b]))).unwrap_or(0);
    let peak = (0..p).max_by(|&a, &b| eval.total_bytes[a].total_cmp(&eval.total_bytes[b])).unwrap_or(0);
    let m = cand.parallel.microbatches as f64;
    let mut r = AxisReport {
        activation_bytes: eval.act_bytes.get(peak).copied().unwrap_or(0.0),
        state_bytes: eval.state_bytes.get(peak).copied().unwrap_or(0.0),
        ..Default::default()
    };
    r.state_bytes_without_ep = r.state_bytes;
    let t = cand.parallel.tp.max(1) as f64;
    for (l, ch) in choices.iter().enumerate() {
        let d = ch.chunk % p;
        if d == busiest {
            let ax = ctx.axis_times(l, &lc);
            r.kv_transfer_s += m * ax.kv_transfer_s;
            r.kv_exposed_s += m * (ax.kv_exposed_fwd_s + ax.kv_exposed_bwd_s);
            r.all_to_all_s += m * (ax.all_to_all_fwd_s + ax.all_to_all_bwd_s);
            r.imbalance_s += m * 3.0 * ax.imbalance_fwd_s;
        }
        let ex = ctx.experts.get(l).copied().unwrap_or_default();
        if d == peak && cand.parallel.ep > 1 && ex.experts > 0 {
            let held = ex.params / t;
            let trained = held * ctx.shapes[l].trained_fraction();
            let at = |e: f64, group: usize| crate::cost::model_state(held / e, trained / e, lc.zero, group, ctx.precision).total();
            r.state_bytes_without_ep += at(1.0, lc.zero_group.size) - at(cand.parallel.ep as f64, lc.expert_zero_group.size);
        }
    }
    r
}

/// The cost context of a search under `cfg` (its precision, baseline and expert imbalance).
pub fn cost_context<'a>(lg: &'a LayeredGraph, spec: &'a ClusterSpec, cfg: &PlanOptions) -> CostContext<'a> {
    let mut ctx = CostContext::new(lg, spec, cfg.precision_for(spec));
    ctx.megatron_only = cfg.baseline == Some(super::Baseline::Megatron) || cfg.megatron_split;
    ctx.expert_imbalance = cfg.expert_imbalance.unwrap_or(super::options::DEFAULT_EXPERT_IMBALANCE);
    ctx
}

/// The least context degree above the forced one at which some configuration's memory
/// lower bound fits `cap`, if any.
pub fn min_fitting_cp(lg: &LayeredGraph, spec: &ClusterSpec, cfg: &PlanOptions, cap: f64) -> Option<usize> {
    let forced = cfg.cp?;
    let mut ctx = cost_context(lg, spec, cfg);
    divisors(spec.devices).into_iter().filter(|&c| c > forced).find(|&c| {
        let try_cfg = PlanOptions { cp: Some(c), ..cfg.clone() };
        let Ok(cands) = enumerate(lg, spec, &try_cfg) else { return false };
        cands.iter().any(|cand| {
            let p = prepare(&mut ctx, cand, cap, cfg.active_microbatches, None, cfg.checkpoint_flags(lg.layers.len()));
            p.mem_lb <= cap && p.lb.is_finite()
        })
    })
}

fn infeasible(lg: &LayeredGraph, spec: &ClusterSpec, cfg: &PlanOptions, cap: f64, min_mem: f64) -> SolveError {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let mut fix = format!("needs at least {:.1} GiB per device", gib(min_mem));
    if let (Some(forced), Some(c)) = (cfg.cp, min_fitting_cp(lg, spec, cfg, cap)) {
        fix.push_str(&format!(
            " at context-parallel degree {forced}; --cp {c} fits (the least context degree that does: it divides each rank's activations by {c})"
        ));
        return SolveError::Infeasible {
            reason: format!(
                "every configuration with --cp {forced} needs more than the {:.1} GiB per device available ({} devices of {})",
                gib(cap),
                spec.devices,
                spec.device
            ),
            fix,
        };
    }
    // The smallest device count (whole nodes) whose memory lower bound fits.
    let mut devices = spec.devices;
    for _ in 0..8 {
        devices *= 2;
        let bigger = ClusterSpec { devices, ..spec.clone() };
        let Ok(cands) = enumerate(lg, &bigger, cfg) else { continue };
        let mut ctx = cost_context(lg, &bigger, cfg);
        let fits = cands.iter().any(|cand| prepare(&mut ctx, cand, cap, cfg.active_microbatches, None, cfg.checkpoint_flags(lg.layers.len())).mem_lb <= cap);
        if fits {
            fix.push_str(&format!(", or about {devices} devices of this kind"));
            break;
        }
    }
    SolveError::Infeasible {
        reason: format!(
            "every configuration needs more than the {:.1} GiB per device available ({} devices of {})",
            gib(cap),
            spec.devices,
            spec.device
        ),
        fix: if min_mem.is_finite() && min_mem > cap {
            format!("{fix} (raise --memory-limit or use a larger cluster)")
        } else {
            format!("{fix}: checkpointing and memory did not fit together; try --checkpointing auto or more devices")
        },
    }
}

/// Builds the decision record from a solved candidate.
#[allow(clippy::too_many_arguments)]
pub fn decision(
    ctx: &CostContext<'_>,
    cfg: &PlanOptions,
    chosen: &Prepared,
    sol: PipelineSolution,
    report: SolveReport,
    solved: u64,
    skipped: u64,
    cap: f64,
) -> Result<PlanDecision, SolveError> {
    let cand = chosen.cand;
    let prob = &chosen.problem;
    let eval = sol.eval.clone().ok_or_else(|| SolveError::Solver("the ILP's solution does not decode to a layout".into()))?;
    let lg = ctx.lg;
    let spec = ctx.spec;
    let chunks = prob.chunks();
    let lc = layer_config(spec, &cand);
    let mut stages = Vec::with_capacity(chunks);
    // tied weights' copies, each counted once per device, in its first chunk reading it
    let mut copies_held = std::collections::BTreeSet::new();
    for c in 0..chunks {
        let members: Vec<usize> = (0..sol.choices.len()).filter(|&l| sol.choices[l].chunk == c).collect();
        let (first, last) = (members.first().copied().unwrap_or(0), members.last().copied().unwrap_or(0));
        let pp_rank = c % cand.parallel.pp;
        let ranks = cand.parallel.stage_ranks(pp_rank);
        let (mut expert, mut expert_trained) = (0.0, 0.0);
        let (mut fwd, mut bwd, mut params, mut trained, mut kept, mut rec) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0f64);
        let (mut ckpt, mut offloaded, mut host) = (Vec::new(), Vec::new(), 0.0);
        for &l in &members {
            let ch = sol.choices[l];
            let pt = &prob.layers[l].points[ch.point];
            let (f, b) = PipelineProblem::layer_times(pt, ch.checkpoint, ch.offload);
            fwd += f;
            bwd += b;
            // The layer's own count, plus what its assignment replicates beyond the split.
            let extra = match (ctx.detail(l, &lc, pt.choice), ctx.detail(l, &lc, 0)) {
                (Some(d), Some(m)) => d.param_elems - m.param_elems,
                _ => 0.0,
            };
            let held = ctx.shapes[l].params / cand.parallel.tp.max(1) as f64 + extra;
            params += held;
            trained += held * ctx.shapes[l].trained_fraction();
            if cand.parallel.ep > 1 {
                let ex = ctx.experts[l].params / cand.parallel.tp.max(1) as f64;
                expert += ex;
                expert_trained += ex * ctx.shapes[l].trained_fraction();
            }
            for tc in &prob.layers[l].tied {
                let owner_rank = sol.choices.get(tc.owner).map(|o| o.chunk % cand.parallel.pp);
                if owner_rank != Some(pp_rank) && copies_held.insert((pp_rank, tc.weight)) {
                    params += tc.elems;
                    trained += tc.trained;
                }
            }
            kept += prob.kept_bytes(c, pt, ch.checkpoint, ch.offload);
            if ch.checkpoint {
                rec = rec.max(pt.act_bytes - pt.input_bytes);
                ckpt.push(l);
            }
            if ch.offload {
                host += prob.offloaded_bytes(c, pt);
                offloaded.push(l);
            }
        }
        let t = cand.parallel.tp.max(1) as f64;
        let st = ctx.state_split(params * t, trained * t, expert * t, expert_trained * t, &lc);
        let activations = kept + rec;
        let workspace = if c < cand.parallel.pp { prob.workspace } else { 0.0 };
        let comm_s = if c + 1 < chunks { 2.0 * prob.layers[last].output_bytes * prob.transfer_s_per_byte[c] } else { 0.0 };
        stages.push(StageDecision {
            index: c,
            pp_rank,
            layers: [first, last],
            ranks,
            forward_s: fwd,
            backward_s: bwd,
            comm_s,
            memory: StageMemory {
                params: st.params,
                grads: st.grads,
                optimizer: st.optimizer,
                activations,
                workspace,
                total: st.total() + activations + workspace,
            },
            checkpointed_layers: ckpt,
            offloaded_layers: offloaded,
            offloaded_bytes: host,
        });
    }
    let fallback = if cand.parallel.tp > 1 { format!("megatron-tp{}", cand.parallel.tp) } else { "replicate".to_string() };
    let layers = sol
        .choices
        .iter()
        .enumerate()
        .map(|(l, ch)| {
            let choice = prob.layers[l].points.get(ch.point).map_or(0, |p| p.choice);
            let (strategy, nodes) = match ctx.detail(l, &lc, choice) {
                // Identical layers share the representative's detail: name this layer's nodes.
                Some(d) => {
                    let names = lg.layers[l].nodes.iter().map(|&id| lg.graph.try_node(id).map(|n| n.name.clone()).unwrap_or_default());
                    (d.name.clone(), names.zip(&d.nodes).map(|(n, (_, s))| (n, s.clone())).collect())
                }
                None => (fallback.clone(), Vec::new()),
            };
            LayerDecision { layer: l, strategy, nodes, checkpoint: ch.checkpoint, offload: ch.offload }
        })
        .collect();
    let step = eval.step_s;
    let t: Vec<f64> = (0..cand.parallel.pp).map(|d| eval.fwd_s[d] + eval.bwd_s[d]).collect();
    let mean = t.iter().sum::<f64>() / cand.parallel.pp as f64;
    let tmax = t.iter().cloned().fold(0.0, f64::max);
    let m = cand.parallel.microbatches as f64;
    let pipe = prob.bubble_coeff * t.iter().sum::<f64>() + (m - prob.bubble_coeff) * tmax;
    let bubble = if mean > 0.0 { (pipe - m * mean) / (m * mean) } else { 0.0 };
    let batch = global_batch(cfg) as f64;
    let peak = spec.peak_flops(ctx.dtype) * spec.devices as f64;
    let mfu = if step > 0.0 { 3.0 * lg.flops_per_sample * batch / (step * peak) } else { 0.0 };
    // Recomputed layers run their forward pass twice.
    let recomputed: f64 = sol
        .choices
        .iter()
        .enumerate()
        .filter(|(_, ch)| ch.checkpoint)
        .map(|(l, _)| lg.layers[l].nodes.iter().map(|&id| lg.node_figures(id).flops).sum::<f64>())
        .sum();
    let hfu = if step > 0.0 { (3.0 * lg.flops_per_sample + recomputed) * batch / (step * peak) } else { 0.0 };
    let axes = axis_report(ctx, &cand, prob, &sol.choices, &eval);
    Ok(PlanDecision {
        axes,
        parallel: Parallelism { sequence_parallel: cand.parallel.sequence_parallel && cand.parallel.tp > 1, ..cand.parallel },
        microbatch_size: cand.microbatch_size,
        stages,
        layers,
        predicted: Predicted {
            step_time_s: step,
            samples_per_s: if step > 0.0 { batch / step } else { 0.0 },
            bubble_ratio: bubble,
            peak_memory_bytes: eval.total_bytes.iter().cloned().fold(0.0, f64::max),
            mfu,
            hfu,
        },
        memory_limit_bytes: cap,
        solver: report,
        candidates_solved: solved,
        candidates_skipped: skipped,
        problem: prob.clone(),
        choices: sol.choices,
    })
}
