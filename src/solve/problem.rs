//! Flat numeric problems: everything the ILPs need, nothing from the IR. Serde so a problem can
//! be dumped to JSON and re-solved alone.

use serde::{Deserialize, Serialize};

pub use crate::ir::{CheckpointRule, OffloadRule};

/// One sharding choice of one node inside a layer (intra-layer problem).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeOption {
    /// Strategy name (`replicate`, `column`, `row`, ...), for the decision record.
    pub name: String,
    /// Forward time per microbatch (compute plus the strategy's own forward collective), seconds.
    pub fwd_s: f64,
    /// Backward time per microbatch (compute plus the strategy's own backward collective).
    pub bwd_s: f64,
    /// Parameter bytes held per device under this strategy.
    pub param_bytes: f64,
    /// Bytes kept for the backward pass per microbatch.
    pub act_bytes: f64,
    /// Data-parallel gradient synchronisation time of this node's parameters, seconds.
    pub sync_s: f64,
}

/// A node of the intra-layer problem with its options.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IntraNode {
    /// Node name (for messages and dumps).
    pub name: String,
    /// Its strategies; at least one.
    pub options: Vec<NodeOption>,
}

/// A data edge between two nodes of the layer with its resharding costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IntraEdge {
    /// Producer (index into `nodes`).
    pub from: usize,
    /// Consumer (index into `nodes`).
    pub to: usize,
    /// `fwd_s[k][k2]`: forward resharding time when `from` uses option k and `to` option k2.
    pub fwd_s: Vec<Vec<f64>>,
    /// Same for the backward pass (the gradient's resharding).
    pub bwd_s: Vec<Vec<f64>>,
    /// Option pairs `(k, k2)` that cannot occur together (codegen cannot emit them).
    #[serde(default)]
    pub forbidden: Vec<(usize, usize)>,
}

/// Alpa-style intra-layer problem for one distinct layer at one tensor degree.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IntraLayerProblem {
    /// Nodes with options.
    pub nodes: Vec<IntraNode>,
    /// Edges with cost matrices.
    pub edges: Vec<IntraEdge>,
    /// Optional cap on parameter + activation bytes (memory-constrained variant).
    pub memory_cap: Option<f64>,
    /// Weight of per-microbatch activation bytes against parameter bytes in the memory
    /// measure (typically the in-flight microbatch count).
    pub act_weight: f64,
}

/// Layers a ZeRO-3 rank holds gathered whole at once: the one computing and the next, whose
/// gather is started beside it (FSDP's prefetch, the runner's too).
pub const ZERO3_GATHERED_LAYERS: f64 = 2.0;

/// A Pareto point of one layer: a tensor-strategy assignment, summarised.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParetoPoint {
    /// Forward time per microbatch, seconds.
    pub fwd_s: f64,
    /// Backward time per microbatch, seconds.
    pub bwd_s: f64,
    /// Model-state bytes per device (params, grads, optimizer; after ZeRO division).
    pub state_bytes: f64,
    /// Saved-activation bytes per microbatch (includes the layer's input), less `shared_bytes`.
    pub act_bytes: f64,
    /// Input bytes per microbatch (what checkpointing keeps: with the layer's input, what the
    /// training loss keeps of its output, outside it), less `shared_bytes`.
    pub input_bytes: f64,
    /// Bytes per microbatch of the inputs other layers read too (an attention mask, rotary
    /// tables): held once per chunk, not once per layer ([`PipelineProblem::chunk_extra_bytes`]).
    #[serde(default)]
    pub shared_bytes: f64,
    /// Of them, the bytes offloading moves to host memory: the inputs no other layer reads.
    #[serde(default)]
    pub offload_bytes: f64,
    /// Data-parallel synchronisation time of this layer's gradients, seconds.
    pub sync_s: f64,
    /// Under ZeRO 2 and 3: the reduce-scatter of this layer's gradients after each backward
    /// but a stage's last of the step (paid `microbatches − 1` times beside `sync_s`), seconds.
    #[serde(default)]
    pub grad_scatter_s: f64,
    /// Index of the strategy assignment this point stands for (into the layer's choices).
    pub choice: usize,
    /// Time to copy the offloaded input (`offload_bytes`) over the host link one way, seconds: what
    /// offloading a checkpointed layer moves out after its forward and back before its
    /// backward.
    #[serde(default)]
    pub host_s: f64,
    /// Under ZeRO 3: the bytes of the layer's parameters gathered whole for each of its
    /// passes, beside the rank's block (a transient, one layer at a time), else 0.
    #[serde(default)]
    pub gathered_bytes: f64,
    /// Bytes per microbatch selective recompute frees at this point (its normalisations' and
    /// activation functions' outputs, rebuilt in the backward, whose time `bwd_s` includes);
    /// 0 at a point that keeps them.
    #[serde(default)]
    pub selective_bytes: f64,
    /// Seconds per microbatch of the expert all-to-alls that run beside another microbatch's
    /// compute under combined 1F1B (taken out of `fwd_s` and `bwd_s`); 0 where they run in turn.
    #[serde(default)]
    pub all_to_all_hidden_s: f64,
    /// Seconds of `fwd_s` spent waiting for ZeRO-3's gather of the layer's parameters (what
    /// prefetching does not hide); 0 without ZeRO 3.
    #[serde(default)]
    pub gather_fwd_s: f64,
    /// Bytes per microbatch of the training loss's copies at its backward, in the layer making
    /// its input (0 elsewhere): the log-probabilities it keeps and their two gradients beside
    /// them. A transient at the loss, beside the other microbatches' kept activations.
    #[serde(default)]
    pub loss_bytes: f64,
    /// Of `act_bytes` (and `input_bytes`), the loss's log-probabilities per microbatch: kept from
    /// the loss's forward to its backward, which is its microbatch's first, so at any rebuild of
    /// that microbatch they are freed; counted for the microbatch at the loss in `loss_bytes`
    /// and for the others in flight as kept activations.
    #[serde(default)]
    pub loss_kept_bytes: f64,
}

impl ParetoPoint {
    /// The forward a checkpointed layer runs again in its backward: its compute alone, the
    /// parameters ZeRO 3 gathers for the backward serving it (as `smp-runner`, FSDP and
    /// Megatron-FSDP run it: one gather for the rerun and the backward).
    pub fn recompute_s(&self) -> f64 {
        (self.fwd_s - self.gather_fwd_s).max(0.0)
    }

    /// Whether this point rebuilds its normalisations and activation functions in the backward.
    pub fn is_selective(&self) -> bool {
        self.selective_bytes > 0.0
    }

    /// What the layer rebuilds inside its backward, a transient beside the kept activations:
    /// checkpointed, all it saves but its inputs; else what selective recompute frees.
    pub fn rebuilt_bytes(&self, checkpoint: bool) -> f64 {
        if checkpoint { (self.act_bytes - self.input_bytes).max(0.0) } else { self.selective_bytes }
    }

    /// The layer's largest transient beside the kept activations: its rebuild, or the loss's
    /// copies (at the loss, before the layer's backward starts, and freed by then: never both
    /// at once).
    pub fn transient_bytes(&self, checkpoint: bool) -> f64 {
        self.rebuilt_bytes(checkpoint).max(self.loss_bytes)
    }
}

/// A layer of the pipeline problem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineLayer {
    /// Its Pareto points; at least one.
    pub points: Vec<ParetoPoint>,
    /// Bytes per microbatch a cut after this layer sends forward (and receives as gradient).
    pub output_bytes: f64,
    /// Weights another layer owns that this layer reads (a tied LM head reading the
    /// embedding): each is held again on this layer's device when its owner runs elsewhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tied: Vec<TiedCopy>,
}

impl PipelineLayer {
    /// The point of the same strategy assignment as `point` that keeps its activations (itself
    /// unless selective).
    pub fn plain_point(&self, point: usize) -> usize {
        let Some(pt) = self.points.get(point).filter(|p| p.is_selective()) else { return point };
        self.points.iter().position(|q| q.choice == pt.choice && !q.is_selective()).unwrap_or(point)
    }
}

/// A copy of a weight tied across layers, held by a reading layer's device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TiedCopy {
    /// The weight, as an index among the problem's tied weights (copies of one weight on one
    /// device are held once).
    pub weight: usize,
    /// The layer owning the weight, whose points count it.
    pub owner: usize,
    /// Elements of the copy on one device (after the tensor split), and how many are trained.
    pub elems: f64,
    /// Trained elements of the copy.
    pub trained: f64,
    /// Model-state bytes of the copy on the reader's device (parameters, gradients, optimizer
    /// state, after the tensor split and ZeRO).
    pub state_bytes: f64,
}

/// What the pipeline ILP minimises.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum PipelineObjective {
    /// The step time.
    StepTime,
    /// The peak memory of any device, with the step time at most `max_step_s`.
    PeakMemory {
        /// Upper bound on the step time.
        max_step_s: f64,
    },
}

/// The pipeline problem for one candidate configuration (docs/planner.md §2).
///
/// Chunks (virtual stages) `c = 0..devices·virtual_stages` hold contiguous layer ranges, every
/// chunk non-empty; chunk c runs on pipeline device `c % devices`. The step time is
/// `bubble_coeff·Σ_d T[d] + (m − bubble_coeff)·max_d T[d] + Σ_b 2·out_b·β_b + max_d S[d]`, with
/// `T[d]` the forward+backward(+recompute) time per microbatch of device d and `S[d]` its
/// data-parallel sync time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineProblem {
    /// Layers in execution order.
    pub layers: Vec<PipelineLayer>,
    /// Pipeline devices p.
    pub devices: usize,
    /// Virtual stages per device v (1 unless interleaved).
    pub virtual_stages: usize,
    /// Microbatches m.
    pub microbatches: usize,
    /// Microbatches in flight per chunk (len devices·virtual_stages): from a forward to the
    /// end of its backward (its W under ZB-H1).
    pub in_flight: Vec<f64>,
    /// Microbatches per chunk between a forward and its backward's B, where that is fewer
    /// (ZB-H1): what an offloaded layer's inputs wait in host memory for. Empty: `in_flight`.
    #[serde(default)]
    pub kept_flight: Vec<f64>,
    /// Per device, the moments of its schedule that may be its activation peak, each the
    /// microbatches its chunks (d, d + p, …) hold then ([`crate::cost::rank_moments`]); empty
    /// where every device runs one chunk. The search holds a device to the sum of its chunks'
    /// own most (`in_flight`: a bound, exact for one chunk per device); the plan reports the
    /// largest moment ([`Self::peak_chunk_activations`]).
    #[serde(default)]
    pub moments: Vec<Vec<Vec<f64>>>,
    /// Weight of Σ T[d] in the step time (1 for GPipe/1F1B, 1/v interleaved, ~1/3 ZB-H1).
    pub bubble_coeff: f64,
    /// Device memory available, bytes.
    pub memory_cap: f64,
    /// Workspace reserved per device, bytes.
    pub workspace: f64,
    /// Under ZeRO 3: the most bytes any layer's parameters take gathered whole (its points'
    /// `gathered_bytes`), reserved per device beside the workspace; else 0.
    #[serde(default)]
    pub gathered: f64,
    /// Seconds per byte across each chunk boundary (len chunks − 1).
    pub transfer_s_per_byte: Vec<f64>,
    /// Checkpointing rule.
    pub checkpoint: CheckpointRule,
    /// Offloading rule for checkpointed layers' kept inputs (`Never` where the cluster has no
    /// host link).
    #[serde(default = "offload_never")]
    pub offload: OffloadRule,
    /// Microbatches of an offloaded layer's inputs back on the device at a time (SMP's
    /// `activation_loading_horizon`).
    #[serde(default = "default_horizon")]
    pub loading_horizon: f64,
    /// Manual layout: the chunk of every layer, if fixed.
    pub fixed_chunks: Option<Vec<usize>>,
    /// Fixed recompute: each layer's rule (`Never`, `Selective` or `Always`), if fixed
    /// (overrides `checkpoint` layer by layer: an engine's configuration read back names
    /// exactly the layers it recomputes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixed_checkpoints: Option<Vec<CheckpointRule>>,
    /// What to minimise.
    pub objective: PipelineObjective,
}

fn offload_never() -> OffloadRule {
    OffloadRule::Never
}

fn default_horizon() -> f64 {
    OffloadRule::DEFAULT_HORIZON as f64
}

impl PipelineProblem {
    /// Bytes reserved per device beside the layers' state and activations: the workspace and
    /// the largest layer gathered whole under ZeRO 3.
    pub fn reserved(&self) -> f64 {
        self.workspace + self.gathered
    }

    /// A point's data-parallel synchronisation per step: the step's own, and under ZeRO 2 and 3
    /// one reduce-scatter after every backward but the last.
    pub fn sync_of(&self, pt: &ParetoPoint) -> f64 {
        pt.sync_s + self.microbatches.saturating_sub(1) as f64 * pt.grad_scatter_s
    }

    /// Number of chunks (virtual stages over all devices).
    pub fn chunks(&self) -> usize {
        self.devices * self.virtual_stages
    }

    /// The checkpointing rule of layer `l`: its fixed flag where recompute is fixed, else the
    /// problem's rule.
    pub fn checkpoint_of(&self, l: usize) -> CheckpointRule {
        self.fixed_checkpoints.as_ref().and_then(|f| f.get(l).copied()).unwrap_or(self.checkpoint)
    }

    /// The `(checkpoint, offload)` flags layer `l` may take under the rules: offloading moves
    /// what a checkpointed layer keeps, so it comes only with checkpointing.
    pub fn flag_options(&self, l: usize) -> Vec<(bool, bool)> {
        let checkpoint: &[bool] = match self.checkpoint_of(l) {
            CheckpointRule::Auto | CheckpointRule::AutoSelective => &[false, true],
            CheckpointRule::Never | CheckpointRule::Selective => &[false],
            CheckpointRule::Always => &[true],
        };
        let mut out = Vec::with_capacity(3);
        for &k in checkpoint {
            match (k, self.offload) {
                (false, _) => out.push((false, false)),
                (true, OffloadRule::Never) => out.push((true, false)),
                (true, OffloadRule::Always) => out.push((true, true)),
                (true, OffloadRule::Auto) => out.extend([(true, false), (true, true)]),
            }
        }
        out
    }

    /// Layer `l`'s choice with the offload flag the rule forces for `checkpoint` (on under
    /// `Always`, off otherwise); a fixed recompute flag overrides `checkpoint`. A checkpointed
    /// layer rebuilds everything: a selective point becomes its assignment's plain one.
    pub fn choice(&self, l: usize, chunk: usize, point: usize, checkpoint: bool) -> LayerChoice {
        let checkpoint = match self.checkpoint_of(l) {
            CheckpointRule::Always => true,
            CheckpointRule::Never | CheckpointRule::Selective => false,
            CheckpointRule::Auto | CheckpointRule::AutoSelective => checkpoint,
        };
        let point = if checkpoint { self.layers.get(l).map_or(point, |lay| lay.plain_point(point)) } else { point };
        LayerChoice { chunk, point, checkpoint, offload: checkpoint && self.offload == OffloadRule::Always }
    }

    /// Whether point `point` of layer `l` may take checkpoint flag `checkpoint`: a selective
    /// point never is checkpointed (its plain twin is, at less time); a layer fixed to keep its
    /// activations takes no selective point, one fixed selective its selective point (where it
    /// has one).
    pub fn combines(&self, l: usize, point: usize, checkpoint: bool) -> bool {
        let Some(lay) = self.layers.get(l) else { return false };
        let selective = lay.points.get(point).is_some_and(ParetoPoint::is_selective);
        match self.checkpoint_of(l) {
            CheckpointRule::Never => !selective,
            CheckpointRule::Selective => selective || !lay.points.iter().any(ParetoPoint::is_selective),
            _ => !checkpoint || !selective,
        }
    }

    /// Microbatches of chunk `chunk` between a forward and its B (at most its in-flight count).
    pub fn kept_flight(&self, chunk: usize) -> f64 {
        self.kept_flight.get(chunk).copied().unwrap_or(self.in_flight[chunk]).min(self.in_flight[chunk])
    }

    /// Device bytes a layer at point `pt` keeps for its backward over the microbatches chunk
    /// `chunk` holds at its peak (its shared inputs apart: [`Self::chunk_extra_bytes`]): every
    /// saved activation, or only its inputs when checkpointed, less what an offloaded layer has
    /// in host memory ([`Self::offloaded_bytes`]). A checkpointed layer runs its whole backward,
    /// weight gradients too, in the B (under ZB-H1 its W is empty), so its inputs are held for
    /// the microbatches between a forward and its B.
    pub fn kept_bytes(&self, chunk: usize, pt: &ParetoPoint, checkpoint: bool, offload: bool) -> f64 {
        self.kept_bytes_at(chunk, self.in_flight[chunk], pt, checkpoint, offload)
    }

    /// [`Self::kept_bytes`] at a moment chunk `chunk` holds `count` microbatches (at most its
    /// in-flight count), less the log-probabilities of the microbatch at the loss or rebuilding
    /// (`ParetoPoint::loss_kept_bytes`).
    fn kept_bytes_at(&self, chunk: usize, count: f64, pt: &ParetoPoint, checkpoint: bool, offload: bool) -> f64 {
        let to_b = self.kept_flight(chunk).min(count);
        let kept = if offload {
            to_b * pt.input_bytes - self.offloaded_at(to_b, pt)
        } else if checkpoint {
            to_b * pt.input_bytes
        } else {
            count * pt.act_bytes
        };
        (kept - pt.loss_kept_bytes).max(0.0)
    }

    /// Per chunk, the bytes its layers' own points do not count: the inputs several of its
    /// layers read (a mask, rotary tables), held once (the largest layer's `shared_bytes`), for
    /// the chunk's in-flight microbatches; where only checkpointed layers read them, to their
    /// B ([`Self::kept_flight`]: under ZB-H1 those layers leave nothing for the W).
    pub fn chunk_extra_bytes(&self, choices: &[LayerChoice]) -> Vec<f64> {
        let shared = self.shared_inputs(choices);
        (0..self.chunks()).map(|c| self.extra_at(c, self.in_flight[c], shared[c])).collect()
    }

    /// Per chunk, the largest shared input of any of its layers, and of a layer keeping its
    /// activations.
    fn shared_inputs(&self, choices: &[LayerChoice]) -> Vec<(f64, f64)> {
        let mut out = vec![(0.0f64, 0.0f64); self.chunks()];
        for (l, c) in choices.iter().enumerate() {
            let Some(pt) = self.layers.get(l).and_then(|x| x.points.get(c.point)) else { continue };
            if let Some((shared, kept)) = out.get_mut(c.chunk) {
                *shared = shared.max(pt.shared_bytes);
                if !c.checkpoint {
                    *kept = kept.max(pt.shared_bytes);
                }
            }
        }
        out
    }

    /// [`Self::chunk_extra_bytes`] of chunk `chunk` holding `count` microbatches, from its
    /// [`Self::shared_inputs`].
    fn extra_at(&self, chunk: usize, count: f64, (shared, kept): (f64, f64)) -> f64 {
        (count * kept).max(self.kept_flight(chunk).min(count) * shared)
    }

    /// Per chunk, its kept activations (its layers' [`Self::kept_bytes_at`] and its shared
    /// inputs) when it holds `counts[c]` microbatches.
    fn chunk_activations_at(&self, choices: &[LayerChoice], counts: &[f64]) -> Vec<f64> {
        let shared = self.shared_inputs(choices);
        let mut out: Vec<f64> = (0..self.chunks()).map(|c| self.extra_at(c, counts[c], shared[c])).collect();
        for (l, c) in choices.iter().enumerate() {
            let Some(pt) = self.layers.get(l).and_then(|x| x.points.get(c.point)) else { continue };
            if let Some(bytes) = out.get_mut(c.chunk) {
                *bytes += self.kept_bytes_at(c.chunk, counts[c.chunk], pt, c.checkpoint, c.offload);
            }
        }
        out
    }

    /// Per chunk, its kept activations as the search counts them: at its own most in-flight
    /// microbatches (its layers' [`Self::kept_bytes`] and [`Self::chunk_extra_bytes`]).
    pub fn bound_chunk_activations(&self, choices: &[LayerChoice]) -> Vec<f64> {
        self.chunk_activations_at(choices, &self.in_flight)
    }

    /// Per chunk, its kept activations at the moment of its device's schedule that holds the
    /// most of all the device's chunks together ([`Self::moments`]): the device's peak is their
    /// sum, at most [`Self::bound_chunk_activations`]'s (equal with one chunk per device).
    pub fn peak_chunk_activations(&self, choices: &[LayerChoice]) -> Vec<f64> {
        let (p, chunks) = (self.devices.max(1), self.chunks());
        let mut out = self.bound_chunk_activations(choices);
        for (d, moments) in self.moments.iter().enumerate().take(p) {
            let mine = |acts: &[f64]| (d..chunks).step_by(p).map(|c| acts[c]).sum::<f64>();
            let mut best: Option<(f64, Vec<f64>)> = None;
            for moment in moments {
                let mut counts = self.in_flight.clone();
                for (j, &count) in moment.iter().enumerate() {
                    if let Some(n) = counts.get_mut(d + j * p) {
                        *n = count.min(*n);
                    }
                }
                let acts = self.chunk_activations_at(choices, &counts);
                let total = mine(&acts);
                if best.as_ref().is_none_or(|(b, _)| total > *b) {
                    best = Some((total, acts));
                }
            }
            for c in (d..chunks).step_by(p) {
                if let Some((_, acts)) = &best {
                    out[c] = acts[c];
                }
            }
        }
        out
    }

    /// Per device, its bytes as the plan reports them: [`Self::evaluate`]'s, with its chunks'
    /// activations at their peak moment (`peak`, [`Self::peak_chunk_activations`]) in place of
    /// the search's bound.
    pub fn reported_device_bytes(&self, choices: &[LayerChoice], eval: &PipelineEval, peak: &[f64]) -> Vec<f64> {
        let p = self.devices.max(1);
        let mut out = eval.total_bytes.clone();
        for (c, (b, k)) in self.bound_chunk_activations(choices).iter().zip(peak).enumerate() {
            if let Some(d) = out.get_mut(c % p) {
                *d += k - b;
            }
        }
        out
    }

    /// Microbatches whose offloaded inputs are on the device as a backward starts: its own,
    /// which its recompute reads, and the `loading_horizon` brought back ahead of theirs.
    pub fn resident_microbatches(&self) -> f64 {
        self.loading_horizon + 1.0
    }

    /// Bytes an offloaded layer keeps in host memory instead of on the device at the peak: its
    /// own inputs (`offload_bytes`) of the microbatches between a forward and its B beyond
    /// those resident as a backward starts ([`Self::resident_microbatches`]; under ZB-H1 the
    /// inputs leave with the B).
    pub fn offloaded_bytes(&self, chunk: usize, pt: &ParetoPoint) -> f64 {
        self.offloaded_at(self.kept_flight(chunk), pt)
    }

    /// [`Self::offloaded_bytes`] when `to_b` microbatches are between a forward and its B.
    fn offloaded_at(&self, to_b: f64, pt: &ParetoPoint) -> f64 {
        (to_b - to_b.min(self.resident_microbatches())) * pt.offload_bytes
    }

    /// Forward and backward time per microbatch of a layer at point `pt`: a checkpointed
    /// layer runs its forward again in the backward; an offloaded one's copies overlap its
    /// compute (out during its forward, back during its recompute and backward), so only what
    /// that compute does not hide costs time.
    pub fn layer_times(pt: &ParetoPoint, checkpoint: bool, offload: bool) -> (f64, f64) {
        let recompute = if checkpoint { pt.recompute_s() } else { 0.0 };
        let (out, back) = if offload {
            ((pt.host_s - pt.fwd_s).max(0.0), (pt.host_s - pt.fwd_s - recompute - pt.bwd_s).max(0.0))
        } else {
            (0.0, 0.0)
        };
        (pt.fwd_s + out, pt.bwd_s + recompute + back)
    }

    /// Turns offloading off on every layer that fits without it (step time never grows by
    /// it), so a plan offloads only what memory needs. Only under the `Auto` rule and the
    /// step-time objective.
    pub fn trim_offload(&self, choices: &mut [LayerChoice]) {
        if self.offload != OffloadRule::Auto || self.objective != PipelineObjective::StepTime {
            return;
        }
        for l in 0..choices.len() {
            if !choices[l].offload {
                continue;
            }
            choices[l].offload = false;
            if !self.evaluate(choices).is_some_and(|e| self.feasible(&e)) {
                choices[l].offload = true;
            }
        }
    }
}

/// One layer's decision in a pipeline solution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerChoice {
    /// Chunk (virtual stage) holding the layer.
    pub chunk: usize,
    /// Pareto point chosen.
    pub point: usize,
    /// Whether the layer is recomputed in the backward pass.
    pub checkpoint: bool,
    /// Whether its kept inputs wait in host memory between its forward and backward.
    #[serde(default)]
    pub offload: bool,
}

/// A pipeline solution evaluated under the problem's model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineEval {
    /// Step time, seconds.
    pub step_s: f64,
    /// Per device: forward time per microbatch.
    pub fwd_s: Vec<f64>,
    /// Per device: backward time per microbatch, recompute included.
    pub bwd_s: Vec<f64>,
    /// Per device: model-state bytes.
    pub state_bytes: Vec<f64>,
    /// Per device: activation bytes at the peak (in-flight microbatches, recompute buffer).
    pub act_bytes: Vec<f64>,
    /// Per device: total bytes including workspace.
    pub total_bytes: Vec<f64>,
    /// Transfer time on the critical path, seconds.
    pub transfer_s: f64,
    /// Exposed data-parallel sync, seconds.
    pub sync_s: f64,
}

impl PipelineProblem {
    /// Evaluates an assignment (one choice per layer) under the model; `None` when it is not
    /// a valid layout (non-contiguous, empty chunk, rule broken). Memory is not checked here:
    /// compare `total_bytes` with `memory_cap`.
    pub fn evaluate(&self, choices: &[LayerChoice]) -> Option<PipelineEval> {
        let chunks = self.chunks();
        if choices.len() != self.layers.len() || chunks == 0 {
            return None;
        }
        let mut prev = 0usize;
        let mut count = vec![0usize; chunks];
        for (l, c) in choices.iter().enumerate() {
            if c.chunk >= chunks || c.chunk < prev || c.point >= self.layers[l].points.len() {
                return None;
            }
            if let Some(fixed) = &self.fixed_chunks
                && fixed.get(l) != Some(&c.chunk)
            {
                return None;
            }
            match self.checkpoint_of(l) {
                CheckpointRule::Never | CheckpointRule::Selective if c.checkpoint => return None,
                _ if !self.combines(l, c.point, c.checkpoint) => return None,
                CheckpointRule::Always if !c.checkpoint => return None,
                _ => {}
            }
            match self.offload {
                _ if c.offload && !c.checkpoint => return None,
                OffloadRule::Never if c.offload => return None,
                OffloadRule::Always if c.checkpoint && !c.offload => return None,
                _ => {}
            }
            prev = c.chunk;
            count[c.chunk] += 1;
        }
        if count.iter().any(|&n| n == 0) {
            return None;
        }
        let p = self.devices;
        let mut fwd = vec![0.0; p];
        let mut bwd = vec![0.0; p];
        let mut state = vec![0.0; p];
        let mut act = vec![0.0; p];
        let mut recompute = vec![0.0f64; p];
        let mut sync = vec![0.0; p];
        for (l, c) in choices.iter().enumerate() {
            let pt = &self.layers[l].points[c.point];
            let d = c.chunk % p;
            let (f, b) = Self::layer_times(pt, c.checkpoint, c.offload);
            fwd[d] += f;
            bwd[d] += b;
            state[d] += pt.state_bytes;
            sync[d] += self.sync_of(pt);
            act[d] += self.kept_bytes(c.chunk, pt, c.checkpoint, c.offload);
            recompute[d] = recompute[d].max(pt.transient_bytes(c.checkpoint));
        }
        for (d, bytes) in self.tied_copy_bytes(choices).into_iter().enumerate() {
            state[d] += bytes;
        }
        for (c, bytes) in self.chunk_extra_bytes(choices).into_iter().enumerate() {
            act[c % p] += bytes;
        }
        let mut transfer = 0.0;
        for l in 0..choices.len().saturating_sub(1) {
            if choices[l].chunk != choices[l + 1].chunk {
                transfer += 2.0 * self.layers[l].output_bytes * self.transfer_s_per_byte[choices[l].chunk];
            }
        }
        let t: Vec<f64> = (0..p).map(|d| fwd[d] + bwd[d]).collect();
        let tmax = t.iter().cloned().fold(0.0, f64::max);
        let smax = sync.iter().cloned().fold(0.0, f64::max);
        let c = self.bubble_coeff;
        let step = c * t.iter().sum::<f64>() + (self.microbatches as f64 - c) * tmax + transfer + smax;
        let act_total: Vec<f64> = (0..p).map(|d| act[d] + recompute[d]).collect();
        let total = (0..p).map(|d| state[d] + act_total[d] + self.reserved()).collect();
        Some(PipelineEval {
            step_s: step,
            fwd_s: fwd,
            bwd_s: bwd,
            state_bytes: state,
            act_bytes: act_total,
            total_bytes: total,
            transfer_s: transfer,
            sync_s: smax,
        })
    }

    /// Per device, the model-state bytes of tied weights' copies an assignment places there: a
    /// weight read on a device other than its owner's is held there once.
    pub fn tied_copy_bytes(&self, choices: &[LayerChoice]) -> Vec<f64> {
        let p = self.devices.max(1);
        let mut held: std::collections::BTreeMap<(usize, usize), f64> = std::collections::BTreeMap::new();
        for (l, c) in choices.iter().enumerate() {
            let d = c.chunk % p;
            for tc in &self.layers[l].tied {
                let owner_d = choices.get(tc.owner).map(|o| o.chunk % p);
                if owner_d != Some(d) {
                    let e = held.entry((d, tc.weight)).or_insert(0.0);
                    *e = e.max(tc.state_bytes);
                }
            }
        }
        let mut out = vec![0.0; p];
        for ((d, _), b) in held {
            out[d] += b;
        }
        out
    }

    /// True when every device's total bytes fit the cap and, for the memory objective, the
    /// step time is within its bound (both with a small relative tolerance).
    pub fn feasible(&self, eval: &PipelineEval) -> bool {
        let fits = eval.total_bytes.iter().all(|&b| b <= self.memory_cap * (1.0 + 1e-9) + 1e-6);
        match self.objective {
            PipelineObjective::StepTime => fits,
            PipelineObjective::PeakMemory { max_step_s } => fits && eval.step_s <= max_step_s * (1.0 + 1e-9),
        }
    }

    /// The value the ILP minimises for this evaluation.
    pub fn objective_value(&self, eval: &PipelineEval) -> f64 {
        match self.objective {
            PipelineObjective::StepTime => eval.step_s,
            PipelineObjective::PeakMemory { .. } => eval.total_bytes.iter().cloned().fold(0.0, f64::max),
        }
    }
}
