//! The configuration space of the outer search (docs/planner.md §3): the degree grid a model
//! can take on a cluster, expanded into candidates by a rule (the search's settings or
//! Megatron-LM's), the bounds on the context and expert degrees, manual layouts, and the
//! layer-cost configuration of a candidate.

use crate::cost::{ClusterSpec, GroupSpan};
use crate::ir::{LayeredGraph, OffloadRule, Parallelism, ScheduleKind, limits};

use super::layer_cost::{LayerConfig, tensor_split_divisor};
use super::problem::CheckpointRule;
use super::{MeshAxis, PlanOptions, Placement, SolveError};

/// One point of the configuration space: a parallel configuration and its microbatch size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Degrees, ZeRO, microbatches, schedule, checkpointing rule and placement (sequence
    /// parallelism false at t = 1).
    pub parallel: Parallelism,
    /// Samples per microbatch.
    pub microbatch_size: usize,
}

pub(super) fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

/// The global batch [`super::plan`] resolved (0 when none is set, which enumerate refuses).
pub(super) fn global_batch(cfg: &PlanOptions) -> usize {
    cfg.global_batch.map_or(0, |b| b as usize)
}

/// Enumerates the candidates `cfg` allows on `spec`.
pub fn enumerate(lg: &LayeredGraph, spec: &ClusterSpec, cfg: &PlanOptions) -> Result<Vec<Candidate>, SolveError> {
    Grid::of(lg, spec, cfg)?.candidates(cfg)
}

/// One point of the degree grid.
#[derive(Clone, Copy, Debug)]
struct Degrees {
    pp: usize,
    tp: usize,
    cp: usize,
    dp: usize,
    ep: usize,
    etp: usize,
}

/// The degrees a model can take on a cluster: every (pp, tp, cp, dp, ep) that the fixed
/// pipeline, context, data and expert degrees, the batch and the model allow. A rule (the
/// search's settings, or Megatron-LM's) expands it into candidates with
/// [`Grid::candidates`]; the search and its Megatron-LM seed read one grid.
pub struct Grid<'a> {
    lg: &'a LayeredGraph,
    spec: &'a ClusterSpec,
    batch: usize,
    split_divisor: u64,
    axes: AxisLimits,
    degrees: Vec<Degrees>,
}

impl<'a> Grid<'a> {
    /// The grid of `lg` on `spec` under the degrees `cfg` fixes; errors on settings that
    /// contradict each other or the model.
    pub fn of(lg: &'a LayeredGraph, spec: &'a ClusterSpec, cfg: &PlanOptions) -> Result<Grid<'a>, SolveError> {
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
        let axes = AxisLimits::of(lg, spec, cfg)?;
        let mut degrees = Vec::new();
        for pp in divisors(devices) {
            if pp_fixed.is_some_and(|f| f != pp) || pp > layers {
                continue;
            }
            for tp in divisors(devices / pp) {
                for cp in divisors(devices / pp / tp) {
                    let dp = devices / pp / tp / cp;
                    if !axes.context_allowed(cp, tp) || c.dp.is_some_and(|f| f != dp) || batch % dp != 0 {
                        continue;
                    }
                    degrees.extend(axes.expert_degrees(dp, tp, cp).into_iter().map(|(ep, etp)| Degrees { pp, tp, cp, dp, ep, etp }));
                }
            }
        }
        Ok(Grid { lg, spec, batch, split_divisor: tensor_split_divisor(lg), axes, degrees })
    }

    /// The candidates the settings `c` allow, in grid order: ZeRO stages, microbatch counts,
    /// schedules, placements and sequence parallelism as `c` fixes or leaves them open.
    /// Errors when none is left or a setting contradicts a degree.
    pub fn candidates(&self, c: &PlanOptions) -> Result<Vec<Candidate>, SolveError> {
        let mut out = Vec::new();
        for d in &self.degrees {
            if self.tensor_allowed(c, d.tp) {
                self.expand(c, d, &mut out)?;
            }
        }
        if out.is_empty() {
            return Err(self.none_left());
        }
        Ok(out)
    }

    /// Tensor degree `tp` under `c`: the fixed one, else within a node and dividing the
    /// blocks' weight dimensions.
    fn tensor_allowed(&self, c: &PlanOptions, tp: usize) -> bool {
        match c.tp {
            Some(f) => f == tp,
            None => tp <= self.spec.devices_per_node.max(1) && (self.split_divisor == 0 || self.split_divisor % tp as u64 == 0),
        }
    }

    /// Pushes the candidates of one grid point under `c`.
    fn expand(&self, c: &PlanOptions, d: &Degrees, out: &mut Vec<Candidate>) -> Result<(), SolveError> {
        let Degrees { pp, tp, cp, dp, ep, etp } = *d;
        let (lg, spec) = (self.lg, self.spec);
        let layers = lg.layers.len();
        let per_replica = self.batch / dp;
        let fp32_main_grads = c.fp32_main_grads_for(spec);
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
            return Ok(());
        }
        let ms: Vec<usize> = match c.microbatches {
            Some(m) if per_replica % m == 0 => vec![m],
            Some(_) => return Ok(()),
            None => divisors(per_replica),
        };
        for m in ms {
            let b = per_replica / m;
            if lg.dims.fixed_batch && !lg.dims.batch_rebinds && b as i64 != lg.dims.graph_batch {
                continue;
            }
            if lg.dims.batch_group > 1 && b as i64 % lg.dims.batch_group != 0 {
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
                    // a selective layer's rebuilt outputs would wait from its B to its W
                    let mut v = vec![ScheduleKind::OneFOneB, ScheduleKind::GPipe];
                    if !c.rebuilds_selectively() {
                        v.insert(1, ScheduleKind::ZbH1);
                    }
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
                        let parallel = Parallelism {
                            pp,
                            tp,
                            dp,
                            cp,
                            ep,
                            etp,
                            zero,
                            sharded_dp: c.sharded_dp,
                            microbatches: m,
                            active_microbatches: c.active_microbatches,
                            schedule,
                            checkpointing: c.checkpointing.unwrap_or(CheckpointRule::Auto),
                            selective_policy: c.selective_policy.unwrap_or_default(),
                            placement,
                            sequence_parallel,
                            precision: c.precision_for(spec),
                            offload: c.offload_for(spec),
                            loading_horizon: c
                                .loading_horizon
                                .unwrap_or(OffloadRule::DEFAULT_HORIZON)
                                .min(limits::max_loading_horizon(m, schedule.virtual_stages())),
                            fp32_main_grads,
                            expert_overlap: c.expert_overlap == Some(true) && ep > 1 && schedule.merged_share(pp, m) > 0.0,
                            grad_overlap: c.grad_overlap == Some(true) && dp * cp > 1,
                            float8_linears: c.float8_linears == Some(true),
                        };
                        out.push(Candidate { parallel, microbatch_size: b });
                    }
                }
            }
        }
        Ok(())
    }

    /// The error when no candidate is left: what the degrees must satisfy.
    fn none_left(&self) -> SolveError {
        let (lg, spec) = (self.lg, self.spec);
        SolveError::Setting(format!(
            "no parallel configuration satisfies the fixed settings on {} devices with global batch {} \
             (pp·tp·cp·dp must equal the device count, dp must divide the batch, ep must divide the experts and dp (tp·dp/etp with --etp below tp), \
             2·cp must divide the sequence{}, pp (times the interleaved chunks) must not exceed the model's {} layer{}; unless fixed, \
             tp ≤ {} and divides the blocks' weight dimensions){}",
            spec.devices,
            self.batch,
            self.axes.seq.map_or(String::new(), |s| format!(" of {s}")),
            lg.layers.len(),
            if lg.layers.len() == 1 { "" } else { "s" },
            spec.devices_per_node,
            if lg.dims.fixed_batch && !lg.dims.batch_rebinds {
                format!(
                    "; the model's batch is fixed at {} and rebinding it is not proven, so microbatches must hold exactly \
                     {} samples (re-export with a dynamic batch: dynamic_shapes=({{0: torch.export.Dim(\"batch\")}},))",
                    lg.dims.graph_batch, lg.dims.graph_batch
                )
            } else if lg.dims.batch_group > 1 {
                format!(
                    "; the model reads its batch axis in groups of {g} rows (one row does not reshape), so every microbatch \
                     must hold a multiple of {g} rows: make the global batch a multiple of {g}·dp·microbatches",
                    g = lg.dims.batch_group
                )
            } else {
                String::new()
            }
        ))
    }
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
    /// The forced expert-tensor degree.
    pub etp: Option<usize>,
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
        let precision = cfg.precision_for(spec);
        let dtype = precision.compute_dtype();
        let scale = crate::cost::compute::bytes_scale(crate::cost::compute::graph_float_dtype(&lg.graph), dtype);
        let graph_types = || lg.layers.iter().map(|l| l.input_bytes).sum::<f64>() * scale;
        // in the mixed modes, the inputs in autocast's types
        let sample_bytes = if precision.is_mixed() && cfg.mixed_recipe_for(spec) == crate::ir::MixedRecipe::Autocast {
            super::layer_cost::autocast_input_bytes(lg, dtype).map_or_else(|_| graph_types(), |b| b.iter().sum())
        } else {
            graph_types()
        };
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
        if cfg.expert_overlap == Some(true) && experts.is_empty() {
            return Err(SolveError::Setting("--overlap-expert-comm: the model has no mixture-of-experts layer, so no all-to-all to overlap; drop --overlap-expert-comm".into()));
        }
        if cfg.expert_overlap == Some(true) && cfg.ep == Some(1) {
            return Err(SolveError::Setting("--overlap-expert-comm with --ep 1: without expert parallelism there is no all-to-all to overlap; drop one of them".into()));
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
        Ok(AxisLimits { seq, sample_bytes, cap, experts, cp: cfg.cp, ep: cfg.ep, etp: cfg.etp })
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

    /// The (expert, expert-tensor) degrees tried with `dp` data-parallel and `tp` tensor ranks:
    /// the expert-tensor degree as forced (else `tp`), the expert degrees dividing every layer's
    /// expert count and `tp · dp / etp` (that is dp at etp = tp); only (1, tp) for a dense
    /// model. Folded groups (etp < tp) are not built with context parallelism.
    pub fn expert_degrees(&self, dp: usize, tp: usize, cp: usize) -> Vec<(usize, usize)> {
        let etp = self.etp.unwrap_or(tp);
        if tp % etp.max(1) != 0 || (etp != tp && cp > 1) {
            return Vec::new();
        }
        if self.experts.is_empty() {
            return if self.ep.is_none_or(|e| e == 1) { vec![(1, etp)] } else { Vec::new() };
        }
        divisors(tp * dp / etp)
            .into_iter()
            .filter(|&e| self.experts.iter().all(|&n| n % e == 0))
            .filter(|&e| self.ep.is_none_or(|f| f == e))
            .map(|e| (e, etp))
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
    let (ep_group, expert_dp_group, expert_zero_group) = if par.experts_folded() {
        // Folded over a stage's tp · dp ranks (context degree 1): the expert group of the
        // first expert-tensor rank and replica of experts, and the replicas holding its experts.
        let rank = |(d, t): (usize, usize)| par.rank_of(d, 0, 0, t);
        let edp = (par.tp * dp / (par.etp.max(1) * ep)).max(1);
        let group: Vec<usize> = (0..ep).map(|e| rank(par.expert_member(0, e, 0))).collect();
        let same = |n: usize| -> Vec<usize> { (0..n.max(1)).map(|j| rank(par.expert_member(0, 0, j))).collect() };
        (GroupSpan::of_ranks(&group, dpn), GroupSpan::of_ranks(&same(edp), dpn), GroupSpan::of_ranks(&same(edp * zg / dp), dpn))
    } else {
        (GroupSpan::strided(0, ep, d_stride * cp, dpn), GroupSpan::of_ranks(&same_experts(dp), dpn), GroupSpan::of_ranks(&same_experts(zg), dpn))
    };
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
        etp: par.etp.max(1),
        merged_share: if par.expert_overlap { par.schedule.merged_share(par.pp, par.microbatches) } else { 0.0 },
        grad_overlap: par.grad_overlap,
        ep_group,
        expert_dp_group,
        expert_zero_group,
    }
}

