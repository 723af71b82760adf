//! Per-layer figures under a parallel configuration: the Pareto points the pipeline problem
//! chooses from, from the cost model (roofline compute, alpha-beta collectives, ZeRO state).
//!
//! Tensor parallelism follows Megatron-LM's split of a layer: matmuls with a weight operand
//! alternate column and row splits (one all-reduce per pair, forward and backward), embedding
//! lookups split the vocabulary (one all-reduce forward), and the other ops run sharded
//! (sequence parallel), so compute, parameters and saved activations divide by t.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cost::{ClusterSpec, CommModel, GroupSpan, StatePrecision, model_state};
use crate::cost::TrainingBytes;
use crate::cost::compute::{SplitDim, layer_saved_bytes, layer_times_with, node_time, split};
use crate::ir::{CheckpointRule, DType, LayerKind, LayeredGraph, NodeFigures, OpKind, Precision, ValueId, ValueKind};

use super::hash::FastMap;
use super::ilp::{IntraSolution, SolverOptions};
use super::problem::{ParetoPoint, PipelineLayer, TiedCopy};
use super::strategy::{self, StrategyInputs};
use crate::split::{Engine, Strategy};

/// One tensor-strategy assignment of a layer, summarised (before ZeRO and data parallelism).
#[derive(Clone, Debug, PartialEq)]
pub struct StrategyDetail {
    /// Name of the assignment (`megatron-tp4`, `ilp-tp4`, `replicate`).
    pub name: String,
    /// Strategy per node of the layer: (node name, strategy).
    pub nodes: Vec<(String, Strategy)>,
    /// Forward time per microbatch incl. tensor collectives, seconds.
    pub fwd_s: f64,
    /// Backward time per microbatch incl. tensor collectives, seconds.
    pub bwd_s: f64,
    /// Parameter elements per device.
    pub param_elems: f64,
    /// Saved-activation bytes per microbatch.
    pub act_bytes: f64,
    /// Input bytes per microbatch.
    pub input_bytes: f64,
    /// Of them, the bytes offloading moves (`Layer::offload_bytes`) per microbatch.
    pub offload_bytes: f64,
}

/// The greatest common divisor of the known dimensions of the repeated blocks' weight
/// matrices and of their attention heads (the third axis of 4-D reshapes, [b, s, heads, d]);
/// 0 when there are none. A searched tensor degree must divide it, so the column and row
/// splits and the heads (KV heads for grouped-query attention) come out even.
/// Embedding and head tables are left out (their vocabulary is padded to a multiple of t).
pub fn tensor_split_divisor(lg: &LayeredGraph) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    let g = &lg.graph;
    let mut d = 0u64;
    for layer in lg.layers.iter().filter(|l| l.kind == LayerKind::Block) {
        for &id in &layer.nodes {
            let Some(n) = g.try_node(id) else { continue };
            if n.op.kind() == Some(OpKind::Reshape) {
                // [batch, seq, heads, head_dim]: the heads (KV heads too) must split evenly.
                let out = n.outputs.first().map(|&v| g.value(v));
                if let Some(shape) = out.and_then(|v| v.ty.as_ref()).and_then(|t| t.shape.as_ref())
                    && shape.rank() == 4
                    && let Some(heads) = shape.0[2].known()
                {
                    d = gcd(d, heads.unsigned_abs());
                }
                continue;
            }
            if !matches!(n.op.kind(), Some(OpKind::MatMul | OpKind::Gemm)) {
                continue;
            }
            let Some(w) = n.inputs.get(1).copied().flatten() else { continue };
            let val = g.value(w);
            if val.kind != ValueKind::Initializer {
                continue;
            }
            let dims = val.ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(|s| s.known()).unwrap_or_default();
            if dims.len() == 2 {
                for x in dims {
                    d = gcd(d, x.unsigned_abs());
                }
            }
        }
    }
    d
}

/// What the tensor split of a layer needs, read once from the IR.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerShape {
    /// Matmuls whose second operand is a parameter.
    pub weight_matmuls: usize,
    /// Gathers from a parameter table (embeddings).
    pub embeddings: usize,
    /// Parameter elements first read here.
    pub params: f64,
    /// Those of them that are trained.
    pub trained: f64,
}

impl LayerShape {
    /// The trained share of the layer's parameters (1 without parameters). A tensor split
    /// divides trained and frozen parameters alike in this model.
    pub fn trained_fraction(&self) -> f64 {
        if self.params > 0.0 { (self.trained / self.params).clamp(0.0, 1.0) } else { 1.0 }
    }
}

/// The configuration-dependent inputs of a layer's cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerConfig {
    /// Tensor degree.
    pub tp: usize,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// ZeRO stage.
    pub zero: u8,
    /// Replicas the ZeRO state is divided over.
    pub zero_group: GroupSpan,
    /// The data-parallel group gradients are reduced over.
    pub dp_group: GroupSpan,
    /// The tensor-parallel group.
    pub tp_group: GroupSpan,
    /// Sequence parallelism: norms and elementwise ops run on each tensor rank's tokens (÷t)
    /// instead of replicated (what codegen's plain tensor parallelism emits).
    pub sequence_parallel: bool,
    /// Context-parallel degree c: each rank runs 1/c of every sequence (a front and a back
    /// chunk), K/V circulating over the context group.
    pub cp: usize,
    /// The context group (K/V ring).
    pub cp_group: GroupSpan,
    /// Expert-parallel degree e: a mixture of experts' experts split over e data-parallel
    /// ranks, tokens sent to them and back by all-to-all.
    pub ep: usize,
    /// Expert-tensor degree: ranks each expert's weights split over (`tp`, or below it when
    /// expert groups fold over tensor × data ranks and each tensor rank routes its own tokens).
    pub etp: usize,
    /// The share of a rank's forwards merged with another microbatch's backward, whose expert
    /// all-to-alls overlap the other's compute (Megatron-Core's combined 1F1B,
    /// [`crate::ir::ScheduleKind::merged_share`]); 0 where they run in turn.
    pub merged_share: f64,
    /// Whether each layer's gradient reduction runs beside the rest of the backward
    /// ([`crate::ir::Parallelism::grad_overlap`]) instead of after it.
    pub grad_overlap: bool,
    /// The expert group (the all-to-alls).
    pub ep_group: GroupSpan,
    /// The ranks holding the same experts, over which expert gradients reduce (d·c / e).
    pub expert_dp_group: GroupSpan,
    /// The ranks the experts' ZeRO state is divided over.
    pub expert_zero_group: GroupSpan,
}

impl LayerConfig {
    /// A configuration without context or expert parallelism (c = e = 1), the groups of
    /// experts those of the dense weights.
    pub fn dense(tp: usize, microbatch: usize, zero: u8, zero_group: GroupSpan, dp_group: GroupSpan, tp_group: GroupSpan, sequence_parallel: bool) -> LayerConfig {
        let one = GroupSpan { size: 1, per_node: 1 };
        LayerConfig {
            tp,
            microbatch,
            zero,
            zero_group,
            dp_group,
            tp_group,
            sequence_parallel,
            cp: 1,
            cp_group: one,
            ep: 1,
            etp: tp,
            merged_share: 0.0,
            grad_overlap: false,
            ep_group: one,
            expert_dp_group: dp_group,
            expert_zero_group: zero_group,
        }
    }
}

/// What context parallelism exchanges in a layer: the attention's K and V, and the attention
/// compute a ring transfer overlaps with.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionFacts {
    /// K and V bytes per sample as the layer produces them (before grouped-query attention's
    /// repetition to every head), graph dtype.
    pub kv_bytes: f64,
    /// K and V bytes per sample as attention keeps them for its backward (after the
    /// repetition), graph dtype: whole over the sequence on every context rank.
    pub kv_saved_bytes: f64,
    /// Forward FLOPs per sample of the score and value products (and the fused kernel's).
    pub flops: f64,
}

/// Per microbatch and rank, what the context and expert axes add to a layer, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AxisTimes {
    /// K/V ring transfers, forward and backward (whether hidden or not).
    pub kv_transfer_s: f64,
    /// The forward's transfers attention compute does not hide.
    pub kv_exposed_fwd_s: f64,
    /// The backward's.
    pub kv_exposed_bwd_s: f64,
    /// Dispatch and combine all-to-alls of the forward.
    pub all_to_all_fwd_s: f64,
    /// Those of the backward.
    pub all_to_all_bwd_s: f64,
    /// The busiest expert rank's extra forward compute (twice that backward).
    pub imbalance_fwd_s: f64,
}

/// A layer's mixture of experts, for expert parallelism.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertFacts {
    /// Experts E (0: the layer has no mixture of experts).
    pub experts: usize,
    /// Expert parameter elements (every expert's `gate_up` and `down`).
    pub params: f64,
    /// Bytes per sample of the routed tokens' hidden vectors (tokens · k · H), graph dtype:
    /// what one all-to-all moves.
    pub routed_bytes: f64,
    /// Experts each token is routed to (top-k).
    pub top_k: usize,
    /// The experts' figures per sample (their compute, for the imbalance).
    pub figures: NodeFigures,
}

/// Reads the attention and expert facts of every layer.
/// The byte figures of `lg` trained in `precision`: under [`crate::ir::MixedRecipe::Autocast`] a
/// mixed mode's are an autocast run's (`passes::autocast`'s types, by a second figures pass:
/// once per plan, not per candidate); otherwise the graph's at the compute type's width.
pub fn training_bytes(lg: &LayeredGraph, precision: Precision, recipe: crate::ir::MixedRecipe) -> TrainingBytes {
    let dtype = precision.compute_dtype();
    if precision.is_mixed() && recipe == crate::ir::MixedRecipe::Autocast {
        match crate::passes::figures::compute_at(&lg.graph, &lg.dims, Some(dtype)) {
            Ok(fig) => return TrainingBytes { layers: crate::passes::layers::layer_bytes(&lg.graph, &fig, &lg.layers), nodes: fig.per_node },
            // the graph was analysed once already; should it fail now, price one type throughout
            Err(e) => tracing::warn!(%e, "autocast figures failed; activations priced at {dtype}"),
        }
    }
    let loss_width = if precision.is_mixed() { 4 } else { dtype.size_bytes() };
    TrainingBytes::scaled_with_loss(lg, dtype, loss_width)
}

/// How many ways assignment `d` splits `node`'s output over the tensor ranks: a replicated node
/// and a normalisation outside sequence parallelism are whole.
fn output_split(d: &StrategyDetail, node: &crate::ir::Node, cfg: &LayerConfig) -> f64 {
    let t = cfg.tp.max(1) as f64;
    let strategy = d.nodes.iter().find(|(name, _)| *name == node.name).map(|(_, s)| *s);
    let norm = matches!(node.op.kind(), Some(OpKind::LayerNormalization | OpKind::RMSNormalization));
    match strategy {
        _ if t <= 1.0 => 1.0,
        Some(Strategy::Replicate) => 1.0,
        Some(Strategy::Sequence) => t,
        _ if norm => if cfg.sequence_parallel { t } else { 1.0 },
        _ => t,
    }
}

/// Per layer of `lg`, the bytes per sample of its inputs in an autocast run computing in `low`
/// (`input_bytes` at `passes::autocast`'s types; one pass over the graph, no figures).
pub fn autocast_input_bytes(lg: &LayeredGraph, low: crate::ir::DType) -> Result<Vec<f64>, crate::passes::PassError> {
    let order = lg.graph.topo_order()?;
    let dtypes = crate::passes::autocast::dtypes(&lg.graph, &order, low);
    let sz = crate::passes::figures::Sizes { graph: &lg.graph, dims: &lg.dims.values, dtypes: &dtypes, low: Some(low) };
    let batch = lg.dims.graph_batch.max(1) as f64;
    Ok(lg.layers.iter().map(|l| l.inputs.iter().map(|&v| sz.bytes(v)).sum::<f64>() / batch).collect())
}

fn axis_facts(lg: &LayeredGraph, bytes: &TrainingBytes) -> (Vec<AttentionFacts>, Vec<ExpertFacts>) {
    let g = &lg.graph;
    // Bytes per sample of a value: its producer's output bytes, shared among its outputs.
    let bytes_of = |v: ValueId| -> f64 {
        match g.value(v).producer.and_then(|id| g.try_node(id).map(|p| (id, p))) {
            Some((id, p)) => bytes.node(id).output_bytes / p.outputs.len().max(1) as f64,
            None => 0.0,
        }
    };
    // The smallest form of an operand along its chain of views (K before grouped-query
    // attention repeats it).
    let smallest = |v: ValueId| -> f64 {
        let (mut v, mut best) = (v, bytes_of(v));
        for _ in 0..8 {
            let Some(p) = g.value(v).producer.and_then(|p| g.try_node(p)) else { break };
            if !p.op.kind().is_some_and(|k| matches!(k, OpKind::Reshape | OpKind::Transpose | OpKind::Expand | OpKind::Unsqueeze | OpKind::Squeeze | OpKind::Identity)) {
                break;
            }
            let Some(src) = p.inputs.first().copied().flatten() else { break };
            let b = bytes_of(src);
            if b > 0.0 {
                best = best.min(b);
            }
            v = src;
        }
        best
    };
    let is_activation = |v: Option<ValueId>| v.is_some_and(|v| g.value(v).kind != ValueKind::Initializer && g.value(v).producer.is_some());
    let mut att = Vec::with_capacity(lg.layers.len());
    let mut exp = Vec::with_capacity(lg.layers.len());
    for l in &lg.layers {
        let (mut a, mut e) = (AttentionFacts::default(), ExpertFacts::default());
        for &id in &l.nodes {
            let Some(n) = g.try_node(id) else { continue };
            let fig = bytes.node(id);
            match n.op.kind() {
                Some(OpKind::ScaledDotProductAttention) => {
                    for i in [1, 2] {
                        if let Some(v) = n.inputs.get(i).copied().flatten() {
                            a.kv_bytes += smallest(v);
                            a.kv_saved_bytes += bytes_of(v);
                        }
                    }
                    a.flops += fig.flops;
                }
                // Q·Kᵀ and P·V of an unfused attention: matmuls of two activations touching scores.
                Some(OpKind::MatMul) if fig.score_bytes > 0.0 && is_activation(n.inputs.first().copied().flatten()) && is_activation(n.inputs.get(1).copied().flatten()) => {
                    if let Some(v) = n.inputs.get(1).copied().flatten() {
                        a.kv_bytes += smallest(v);
                        a.kv_saved_bytes += bytes_of(v);
                    }
                    a.flops += fig.flops;
                }
                Some(OpKind::MixtureOfExperts) => {
                    let k = n.inputs.get(1).copied().flatten().and_then(|w| g.value(w).ty.as_ref()).and_then(|t| t.shape.as_ref()).and_then(|s| s.0.get(1).and_then(|d| d.known())).unwrap_or(1).max(1) as f64;
                    let x = n.inputs.first().copied().flatten().map_or(0.0, bytes_of);
                    e = ExpertFacts { experts: n.attrs.int("experts", 0).max(0) as usize, params: fig.param_elems as f64, routed_bytes: x * k, top_k: k as usize, figures: fig };
                }
                _ => {}
            }
        }
        att.push(a);
        exp.push(e);
    }
    (att, exp)
}

/// The intra-layer ILP's fastest assignment of `ls`; `None` when the solve fails or finds
/// none, which leaves the Megatron split (always valid). The fastest only: the smallest is the
/// all-split one, which Megatron's split already is, so further Pareto solves would only cost
/// time.
/// A problem with one option per node has one assignment, the ILP's answer when it is
/// allowed: read without building the ILP.
fn fastest(ls: &strategy::LayerStrategies) -> Option<IntraSolution> {
    let p = &ls.problem;
    if p.memory_cap.is_none() && p.nodes.iter().all(|n| n.options.len() == 1) {
        return p.validate().ok().and_then(|_| p.evaluate(&vec![0; p.nodes.len()]));
    }
    p.solve(false, None, &SolverOptions::default()).ok().and_then(|(_, s)| s)
}

/// Seconds a layer's forward and another microbatch's backward save when Megatron-Core's
/// combined 1F1B merges them (`TransformerLayerSchedulePlan.run`): two streams, compute running
/// the forward's attention, the backward's experts (input, then weight gradients), the
/// forward's experts and the backward's attention; communication the backward's combine, the
/// forward's dispatch, the backward's dispatch and the forward's combine; each waits for what
/// it reads. `fwd` and `bwd` are the passes' compute, `experts` the experts' share of the
/// forward (twice it in the backward, "attention" being all the rest), each all-to-all half of
/// `ax`'s per pass. In turn the pair takes the sum of all eight.
fn merged_saving_s(fwd: f64, bwd: f64, experts: f64, ax: &AxisTimes) -> f64 {
    let (a2a_f, a2a_b) = (ax.all_to_all_fwd_s / 2.0, ax.all_to_all_bwd_s / 2.0);
    if a2a_f + a2a_b <= 0.0 {
        return 0.0;
    }
    let experts = experts.clamp(0.0, fwd);
    let (attn_f, attn_b) = (fwd - experts, (bwd - 2.0 * experts).max(0.0));
    let combine_b = a2a_b;
    let experts_b = attn_f.max(combine_b) + experts;
    let dispatch_f = attn_f.max(combine_b) + a2a_f;
    let experts_w = experts_b + experts;
    let dispatch_b = dispatch_f.max(experts_b) + a2a_b;
    let experts_f = experts_w.max(dispatch_f) + experts;
    let combine_f = experts_f.max(dispatch_b) + a2a_f;
    let attention_b = experts_f.max(dispatch_b) + attn_b;
    let merged = combine_f.max(attention_b);
    (fwd + bwd + ax.all_to_all_fwd_s + ax.all_to_all_bwd_s - merged).max(0.0)
}

/// A layer configuration as a cache key (the layer's representative first; `usize::MAX` for
/// the whole model).
type LayerKey = (usize, usize, usize, u8, [GroupSpan; 7], bool, usize, usize, usize, u64, bool);

fn layer_key(rep: usize, cfg: &LayerConfig) -> LayerKey {
    let groups = [cfg.zero_group, cfg.dp_group, cfg.tp_group, cfg.cp_group, cfg.ep_group, cfg.expert_dp_group, cfg.expert_zero_group];
    (rep, cfg.tp, cfg.microbatch, cfg.zero, groups, cfg.sequence_parallel, cfg.cp, cfg.ep, cfg.etp, cfg.merged_share.to_bits(), cfg.grad_overlap)
}

/// Each distinct layer's points under one configuration, and which of them every layer
/// takes: all a candidate's bounds read. The per-layer table ([`CostContext::layers`]) is
/// built only for the candidates the search looks at beyond their bounds.
#[derive(Clone, Debug)]
pub struct CompactTable {
    /// The points of each distinct layer (identical layers share one entry; no tied copies).
    pub distinct: Vec<PipelineLayer>,
    /// For every layer, its entry in `distinct`.
    pub of_layer: Arc<Vec<usize>>,
}

impl CompactTable {
    /// The table with only each layer's first point (its Megatron split).
    pub fn first_points(&self) -> CompactTable {
        let distinct = self.distinct.iter().map(|l| PipelineLayer { points: l.points.iter().take(1).cloned().collect(), ..l.clone() }).collect();
        CompactTable { distinct, of_layer: self.of_layer.clone() }
    }
}

/// Which points selective recompute (a layer's normalisations and activation functions rebuilt
/// in its backward) gives a layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SelectivePoints {
    /// None: every point keeps what its ops save.
    #[default]
    None,
    /// Each point and its selective twin (the planner chooses).
    Also,
    /// Each point selective where that frees anything.
    Only,
}

impl SelectivePoints {
    /// The points a checkpointing rule allows: its own choice under `auto-selective`, every
    /// layer under `selective`; where the recompute is fixed layer by layer (`fixed`), both where some
    /// layer is fixed selective (the pipeline problem keeps each layer to its kind), else none.
    pub fn of(rule: CheckpointRule, fixed: Option<&[CheckpointRule]>) -> SelectivePoints {
        match (fixed, rule) {
            (Some(f), _) if f.contains(&CheckpointRule::Selective) => SelectivePoints::Also,
            (Some(_), _) => SelectivePoints::None,
            (None, CheckpointRule::Selective) => SelectivePoints::Only,
            (None, CheckpointRule::AutoSelective) => SelectivePoints::Also,
            (None, _) => SelectivePoints::None,
        }
    }
}

/// Figures of a model on a cluster, with a cache of layer points.
pub struct CostContext<'a> {
    /// The model.
    pub lg: &'a LayeredGraph,
    /// The cluster.
    pub spec: &'a ClusterSpec,
    /// Link model.
    pub comm: CommModel,
    /// The dtype compute runs in under the plan's precision (its rate, its activation bytes).
    pub dtype: DType,
    /// The model's byte figures at the plan's precision (an autocast run's in the mixed modes).
    pub bytes: TrainingBytes,
    /// State bytes per parameter under the plan's precision.
    pub precision: StatePrecision,
    /// Per-layer shape facts.
    pub shapes: Vec<LayerShape>,
    /// Use only the Megatron split (the `megatron` baseline), not the intra-layer ILP.
    pub megatron_only: bool,
    /// Intra-layer ILPs solved (one per distinct layer, t, microbatch and tensor group).
    pub intra_solves: usize,
    /// Per layer: what context parallelism exchanges.
    pub attention: Vec<AttentionFacts>,
    /// Per layer: its mixture of experts, if any.
    pub experts: Vec<ExpertFacts>,
    /// The busiest expert rank's routed tokens over the mean under expert parallelism.
    pub expert_imbalance: f64,
    /// How routed tokens reach their experts.
    pub expert_dispatch: crate::ir::ExpertDispatch,
    /// Which points selective recompute adds to a layer's.
    pub selective: SelectivePoints,
    /// What those points rebuild.
    pub selective_policy: crate::ir::SelectivePolicy,
    cache: FastMap<LayerKey, PipelineLayer>,
    facts: Option<strategy::GraphFacts>,
    splits: HashMap<usize, strategy::SplitGraph>,
    /// The tensor-split engines without and with sequence parallelism (`None` inside when
    /// shape inference fails: offers unchecked).
    engines: [Option<Option<Engine<'a>>>; 2],
    /// Offers emission does not realise, per (layer, t, sequence parallel): (problem node,
    /// strategy).
    withdrawn: HashMap<(usize, usize, bool), Vec<(usize, Strategy)>>,
    /// Whether a weight tied across layers is split, per (weight, t, sequence parallel).
    tied_split: HashMap<(ValueId, usize, bool), bool>,
    /// Weights more than one layer reads (another layer's `shared_params`).
    tied: std::collections::HashSet<ValueId>,
    details: FastMap<(usize, usize, usize, GroupSpan, bool), Vec<StrategyDetail>>,
    model_cache: FastMap<LayerKey, Arc<Vec<PipelineLayer>>>,
    compact_cache: FastMap<LayerKey, Arc<CompactTable>>,
    /// Per layer, the first layer of its signature (its representative).
    sig_index: Vec<usize>,
    /// The representatives in layer order, and every layer's position among them.
    reps: Vec<usize>,
    rep_slot: Arc<Vec<usize>>,
}

impl<'a> CostContext<'a> {
    /// Reads the layer facts of `lg`, for a plan training in `precision` (its compute rate,
    /// activation bytes and model-state bytes), a mixed precision priced as `spec`'s default
    /// recipe ([`super::PlanOptions::mixed_recipe_for`]).
    pub fn new(lg: &'a LayeredGraph, spec: &'a ClusterSpec, precision: Precision) -> CostContext<'a> {
        let recipe = super::PlanOptions::default().mixed_recipe_for(spec);
        CostContext::with_recipe(lg, spec, precision, recipe)
    }

    /// [`Self::new`] with a mixed precision kept as `recipe` does.
    pub fn with_recipe(lg: &'a LayeredGraph, spec: &'a ClusterSpec, precision: Precision, recipe: crate::ir::MixedRecipe) -> CostContext<'a> {
        let dtype = precision.compute_dtype();
        let g = &lg.graph;
        let is_param = |v: Option<crate::ir::ValueId>| {
            v.is_some_and(|v| {
                let val = g.value(v);
                val.kind == ValueKind::Initializer && val.ty.as_ref().is_some_and(|t| t.dtype.is_float())
            })
        };
        let shapes = lg
            .layers
            .iter()
            .map(|l| {
                let mut s = LayerShape {
                    params: l.figures.param_elems as f64,
                    trained: l.figures.param_elems.saturating_sub(l.figures.frozen_elems) as f64,
                    ..Default::default()
                };
                for &id in &l.nodes {
                    let Some(n) = g.try_node(id) else { continue };
                    match n.op.kind() {
                        Some(OpKind::MatMul | OpKind::Gemm) if is_param(n.inputs.get(1).copied().flatten()) => {
                            s.weight_matmuls += 1
                        }
                        Some(OpKind::Gather) if is_param(n.inputs.first().copied().flatten()) => s.embeddings += 1,
                        _ => {}
                    }
                }
                s
            })
            .collect();
        let mut sigs: HashMap<&str, usize> = HashMap::new();
        let sig_index: Vec<usize> = lg
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| *sigs.entry(l.signature.as_str()).or_insert(i))
            .collect();
        let bytes = training_bytes(lg, precision, recipe);
        let (attention, experts) = axis_facts(lg, &bytes);
        let mut reps: Vec<usize> = Vec::new();
        let rep_slot = sig_index
            .iter()
            .map(|&r| match reps.iter().position(|&x| x == r) {
                Some(i) => i,
                None => {
                    reps.push(r);
                    reps.len() - 1
                }
            })
            .collect();
        CostContext {
            lg,
            attention,
            experts,
            expert_imbalance: super::options::DEFAULT_EXPERT_IMBALANCE,
            expert_dispatch: crate::ir::ExpertDispatch::default(),
            selective: SelectivePoints::None,
            selective_policy: crate::ir::SelectivePolicy::Pointwise,
            spec,
            comm: CommModel::new(spec),
            dtype,
            bytes,
            precision: StatePrecision::of_recipe(precision, recipe),
            shapes,
            megatron_only: false,
            intra_solves: 0,
            cache: FastMap::default(),
            facts: None,
            splits: HashMap::new(),
            engines: [None, None],
            withdrawn: HashMap::new(),
            tied_split: HashMap::new(),
            tied: lg.layers.iter().flat_map(|l| l.shared_params.iter().copied()).collect(),
            details: FastMap::default(),
            model_cache: FastMap::default(),
            compact_cache: FastMap::default(),
            sig_index,
            reps,
            rep_slot: Arc::new(rep_slot),
        }
    }

    /// Every layer's points under `cfg` (cached per configuration, shared by the candidates
    /// that differ only in microbatch count, schedule or placement of equal groups).
    pub fn layers(&mut self, cfg: &LayerConfig) -> Arc<Vec<PipelineLayer>> {
        let key = layer_key(usize::MAX, cfg);
        if let Some(v) = self.model_cache.get(&key) {
            return v.clone();
        }
        let c = self.compact(cfg);
        let v: Vec<PipelineLayer> =
            (0..self.lg.layers.len()).map(|l| PipelineLayer { tied: self.tied_copies(l, cfg), ..c.distinct[c.of_layer[l]].clone() }).collect();
        let v = Arc::new(v);
        self.model_cache.insert(key, v.clone());
        v
    }

    /// Each distinct layer's points under `cfg` (cached per configuration): identical
    /// layers share their representative's.
    pub fn compact(&mut self, cfg: &LayerConfig) -> Arc<CompactTable> {
        let key = layer_key(usize::MAX, cfg);
        if let Some(v) = self.compact_cache.get(&key) {
            return v.clone();
        }
        let distinct = (0..self.reps.len()).map(|i| self.rep_layer(self.reps[i], cfg)).collect();
        let v = Arc::new(CompactTable { distinct, of_layer: self.rep_slot.clone() });
        self.compact_cache.insert(key, v.clone());
        v
    }

    /// Whether the model has a mixture of experts (and how many experts its layers hold in
    /// common: expert parallelism must divide each).
    pub fn expert_counts(&self) -> Vec<usize> {
        self.experts.iter().filter(|e| e.experts > 0).map(|e| e.experts).collect()
    }

    /// The layer's Pareto points (one tensor assignment here) under `cfg`; identical layers
    /// (same signature) share one computation.
    pub fn layer(&mut self, layer: usize, cfg: &LayerConfig) -> PipelineLayer {
        let mut l = self.rep_layer(self.sig_index[layer], cfg);
        l.tied = self.tied_copies(layer, cfg);
        l
    }

    /// The points of representative layer `rep` under `cfg` (cached), without tied copies.
    fn rep_layer(&mut self, rep: usize, cfg: &LayerConfig) -> PipelineLayer {
        let key = layer_key(rep, cfg);
        match self.cache.get(&key) {
            Some(l) => l.clone(),
            None => {
                let l = self.compute(rep, cfg);
                self.cache.insert(key, l.clone());
                l
            }
        }
    }

    /// The weights `layer` reads that another layer owns, with the model-state bytes a copy
    /// of each takes on the reader's device (split like its readers split it).
    fn tied_copies(&mut self, layer: usize, cfg: &LayerConfig) -> Vec<TiedCopy> {
        let lg = self.lg;
        let mut out = Vec::new();
        for &w in &lg.layers[layer].shared_params {
            let Some(owner) = lg.layers.iter().position(|l| l.params.contains(&w)) else { continue };
            if owner == layer {
                continue;
            }
            let split = cfg.tp > 1 && self.tied_is_split(w, cfg);
            let elems = crate::passes::figures::param_elems(&lg.graph, w).0 as f64 / if split { cfg.tp as f64 } else { 1.0 };
            let trained = if crate::passes::figures::is_trainable(&lg.graph, w) { elems } else { 0.0 };
            let state = model_state(elems, trained, cfg.zero, cfg.zero_group.size, self.precision);
            out.push(TiedCopy { weight: w.index(), owner, elems, trained, state_bytes: state.total() });
        }
        out
    }

    /// The layer's tensor-strategy assignments under `cfg`: the Megatron split first, then
    /// the intra-layer ILP's fastest assignment when it differs from it and is not dominated (cached per signature, t,
    /// microbatch and tensor group; identical blocks share one solve).
    pub fn details(&mut self, layer: usize, cfg: &LayerConfig) -> &[StrategyDetail] {
        let rep = self.sig_index[layer];
        let key = (rep, cfg.tp, cfg.microbatch, cfg.tp_group, cfg.sequence_parallel);
        if !self.details.contains_key(&key) {
            let d = self.solve_details(rep, cfg);
            self.details.insert(key, d);
        }
        self.details.get(&key).map_or(&[], |v| v.as_slice())
    }

    /// The assignment behind point `choice` of `layer` under `cfg`, if computed.
    pub fn detail(&self, layer: usize, cfg: &LayerConfig, choice: usize) -> Option<&StrategyDetail> {
        self.detail_list(layer, cfg).get(choice)
    }

    /// The assignments of `layer` under `cfg` computed so far (empty before [`Self::details`]).
    fn detail_list(&self, layer: usize, cfg: &LayerConfig) -> &[StrategyDetail] {
        let Some(&rep) = self.sig_index.get(layer) else { return &[] };
        self.details.get(&(rep, cfg.tp, cfg.microbatch, cfg.tp_group, cfg.sequence_parallel)).map_or(&[], |v| v.as_slice())
    }

    fn megatron_detail(&self, layer: usize, cfg: &LayerConfig) -> StrategyDetail {
        let shape = self.shapes[layer];
        let t = cfg.tp.max(1) as f64;
        let b = cfg.microbatch as f64;
        let times = layer_times_with(self.lg, layer, self.spec, self.dtype, b, cfg.tp, |id| self.bytes.node(id));
        let lb = self.bytes.layer(layer);
        let hidden = lb.input_bytes.max(lb.output_bytes) * b;
        let ar = self.comm.all_reduce(hidden, &cfg.tp_group);
        let pairs = shape.weight_matmuls.div_ceil(2) as f64;
        let tp_fwd = if cfg.tp > 1 { (pairs + shape.embeddings as f64) * ar } else { 0.0 };
        let tp_bwd = if cfg.tp > 1 { pairs * ar } else { 0.0 };
        StrategyDetail {
            name: if cfg.tp > 1 { format!("megatron-tp{}", cfg.tp) } else { "replicate".to_string() },
            nodes: Vec::new(),
            fwd_s: times.fwd + tp_fwd,
            bwd_s: times.bwd + tp_bwd,
            param_elems: shape.params / t,
            // the weight copies autocast's products keep split with the weights
            act_bytes: (layer_saved_bytes(&lb, self.spec).max(lb.input_bytes) * b + lb.weight_copy_bytes) / t,
            // Without sequence parallelism the layer's input is whole on every tensor rank.
            input_bytes: lb.input_bytes * b / if cfg.sequence_parallel { t } else { 1.0 },
            offload_bytes: lb.offload_bytes * b / if cfg.sequence_parallel { t } else { 1.0 },
        }
    }

    /// What the tensor-split engine offers `layer` at `cfg.tp`, less what emission does not
    /// realise (checked once per layer and t).
    fn layer_offers(&mut self, layer: usize, cfg: &LayerConfig) -> crate::split::LayerOffers {
        let inputs = StrategyInputs {
            spec: self.spec,
            comm: &self.comm,
            dtype: self.dtype,
            bytes: &self.bytes,
            tp: cfg.tp,
            microbatch: cfg.microbatch as f64,
            tp_group: cfg.tp_group,
            state_bytes_per_param: self.precision.weight as f64
                + self.shapes[layer].trained_fraction() * (self.precision.grad as f64 + self.precision.optimizer as f64),
            grad_bytes_per_param: self.precision.grad as f64,
            sequence_parallel: cfg.sequence_parallel,
        };
        // The split structure is the same at every t: analyse each distinct layer once.
        let lg = self.lg;
        let facts = self.facts.get_or_insert_with(|| strategy::GraphFacts::new(lg));
        let sg = self.splits.entry(layer).or_insert_with(|| strategy::analyse(lg, layer, facts));
        let mut offers = crate::split::offers_from(lg, layer, sg, &inputs);
        // Only what emission realises is offered (checked once per layer and t).
        let sp = cfg.sequence_parallel;
        let withdrawn = match self.withdrawn.get(&(layer, cfg.tp, sp)) {
            Some(w) => w.clone(),
            None => {
                let engine =
                    self.engines[usize::from(sp)].get_or_insert_with(|| Engine::new(lg).ok().map(|e| e.with_sequence_parallel(sp)));
                let w = engine.as_ref().map(|e| e.check_offers(layer, cfg.tp, &mut offers.clone())).unwrap_or_default();
                self.withdrawn.insert((layer, cfg.tp, sp), w.clone());
                w
            }
        };
        for (k, s) in withdrawn {
            offers.nodes[k].options.retain(|x| x.strategy != s);
        }
        offers
    }

    /// Weights tied across layers that node `i` (in `layer`'s node list) reads, directly or
    /// through views of them (`Transpose(lm_head.weight)`).
    fn tied_read_by(&self, layer: usize, i: usize) -> Vec<ValueId> {
        let lg = self.lg;
        let g = &lg.graph;
        let Some(node) = lg.layers[layer].nodes.get(i).and_then(|&n| g.try_node(n)) else { return Vec::new() };
        let mut out = Vec::new();
        for &v in node.inputs.iter().flatten() {
            let mut v = v;
            // Views of a weight have it as their first input.
            for _ in 0..8 {
                if self.tied.contains(&v) {
                    out.push(v);
                    break;
                }
                match g.value(v).producer.map(|p| g.node(p)) {
                    Some(p) if p.op.kind().is_some_and(|k| k.is_view()) => match p.inputs.first().copied().flatten() {
                        Some(src) => v = src,
                        None => break,
                    },
                    _ => break,
                }
            }
        }
        out
    }

    /// Whether the Megatron split of every layer reading the tied weight `w` splits it at
    /// degree `cfg.tp`.
    fn tied_is_split(&mut self, w: ValueId, cfg: &LayerConfig) -> bool {
        if let Some(&split) = self.tied_split.get(&(w, cfg.tp, cfg.sequence_parallel)) {
            return split;
        }
        let lg = self.lg;
        let readers: Vec<usize> = (0..lg.layers.len()).filter(|&l| lg.layers[l].params.contains(&w) || lg.layers[l].shared_params.contains(&w)).collect();
        let mut split = true;
        for l in readers {
            let ls = strategy::from_offers(self.layer_offers(l, cfg));
            for (k, members) in ls.members.iter().enumerate() {
                if !members.iter().any(|&i| self.tied_read_by(l, i).contains(&w)) {
                    continue;
                }
                // A strategy, not parameter elements: a MatMul reading Transpose(wte) holds none.
                let chosen = ls.megatron.get(k).and_then(|&m| ls.strategy(k, m));
                split &= chosen.is_some_and(|s| matches!(s, Strategy::Column | Strategy::Row | Strategy::Vocab | Strategy::Heads | Strategy::Experts));
            }
        }
        self.tied_split.insert((w, cfg.tp, cfg.sequence_parallel), split);
        split
    }

    fn solve_details(&mut self, layer: usize, cfg: &LayerConfig) -> Vec<StrategyDetail> {
        let (out, ls) = self.start_details(layer, cfg);
        let Some(ls) = ls else { return out };
        self.intra_solves += 1;
        let sol = fastest(&ls);
        self.finish_details(layer, cfg, out, &ls, sol)
    }

    /// Solves, on up to `threads` threads, the intra-layer ILPs that the tables of `cfgs`
    /// need and the cache lacks (one per layer representative and configuration), so that
    /// building those tables solves none. The results are those of solving them one by one:
    /// each ILP is solved alone on one HiGHS thread, and taken in the order they were met.
    pub fn prefetch_details(&mut self, cfgs: &[LayerConfig], threads: usize) {
        let reps = self.reps.clone();
        let mut seen = std::collections::HashSet::new();
        let mut jobs = Vec::new();
        for cfg in cfgs {
            for &rep in &reps {
                let key = (rep, cfg.tp, cfg.microbatch, cfg.tp_group, cfg.sequence_parallel);
                if self.details.contains_key(&key) || !seen.insert(key) {
                    continue;
                }
                match self.start_details(rep, cfg) {
                    (out, Some(ls)) => jobs.push((key, *cfg, out, ls)),
                    (out, None) => {
                        self.details.insert(key, out);
                    }
                }
            }
        }
        let sols = crate::parallel::map(&jobs, threads, |(_, _, _, ls)| fastest(ls));
        for ((key, cfg, out, ls), sol) in jobs.into_iter().zip(sols) {
            self.intra_solves += 1;
            let d = self.finish_details(key.0, &cfg, out, &ls, sol);
            self.details.insert(key, d);
        }
    }

    /// The serial part of a layer's details: the Megatron split, and the intra-layer problem
    /// whose fastest assignment may add a point (`None` when there is none to solve).
    fn start_details(&mut self, layer: usize, cfg: &LayerConfig) -> (Vec<StrategyDetail>, Option<strategy::LayerStrategies>) {
        let mut megatron = self.megatron_detail(layer, cfg);
        let lay = &self.lg.layers[layer];
        if cfg.tp <= 1 {
            let g = &self.lg.graph;
            megatron.nodes = lay
                .nodes
                .iter()
                .map(|&id| (g.try_node(id).map(|n| n.name.clone()).unwrap_or_default(), Strategy::Replicate))
                .collect();
            return (vec![megatron], None);
        }
        let mut offers = self.layer_offers(layer, cfg);
        let mut ls = strategy::from_offers(offers.clone());
        // A weight tied across layers (GPT-2's wte and lm_head) must be sliced alike wherever
        // it is read, or its gradients cannot be summed: its readers keep the Megatron split
        // when that splits it in every layer reading it, and replicate it otherwise.
        let mut pinned: Vec<(usize, Strategy)> = Vec::new();
        for k in 0..ls.members.len() {
            let tied: Vec<ValueId> = ls.members[k].iter().flat_map(|&i| self.tied_read_by(layer, i)).collect();
            if tied.is_empty() {
                continue;
            }
            let split = tied.into_iter().all(|w| self.tied_is_split(w, cfg));
            let keep = if split { ls.megatron.get(k).and_then(|&m| ls.strategy(k, m)) } else { Some(Strategy::Replicate) };
            if let Some(keep) = keep.filter(|&s| offers.nodes[k].options.iter().any(|x| x.strategy == s)) {
                pinned.push((k, keep));
            }
        }
        if pinned.iter().any(|&(k, _)| offers.nodes[k].options.len() > 1) {
            for &(k, s) in &pinned {
                offers.nodes[k].options.retain(|x| x.strategy == s);
            }
            ls = strategy::from_offers(offers);
        }
        megatron.nodes = ls.node_names(self.lg, layer, &ls.megatron);
        // The Megatron point is the problem's most-split assignment (what codegen emits by
        // default), so it is exactly one point of the intra-layer problem.
        if let Some(m) = ls.problem.evaluate(&ls.megatron) {
            megatron.fwd_s = m.fwd_s;
            megatron.bwd_s = m.bwd_s;
            megatron.param_elems = ls.params_of(&ls.megatron);
            megatron.act_bytes = m.act_bytes.max(megatron.input_bytes);
        }
        let out = vec![megatron];
        if self.megatron_only {
            return (out, None);
        }
        (out, Some(ls))
    }

    /// The details from the Megatron split `out` and the intra-layer ILP's fastest assignment
    /// `sol` of `ls`: that assignment is added where it differs and is not dominated.
    fn finish_details(&self, layer: usize, cfg: &LayerConfig, mut out: Vec<StrategyDetail>, ls: &strategy::LayerStrategies, sols: Option<IntraSolution>) -> Vec<StrategyDetail> {
        let (input_bytes, offload_bytes) = (out[0].input_bytes, out[0].offload_bytes);
        if let Some(s) = sols.filter(|s| s.choice != ls.megatron) {
            let d = StrategyDetail {
                name: format!("ilp-tp{}", cfg.tp),
                nodes: ls.node_names(self.lg, layer, &s.choice),
                fwd_s: s.fwd_s,
                bwd_s: s.bwd_s,
                param_elems: ls.params_of(&s.choice),
                act_bytes: s.act_bytes.max(input_bytes),
                input_bytes,
                offload_bytes,
            };
            let dominated = out.iter().any(|o| {
                o.fwd_s + o.bwd_s <= d.fwd_s + d.bwd_s && o.param_elems <= d.param_elems && o.act_bytes <= d.act_bytes
            });
            if !dominated {
                out.push(d);
            }
        }
        out
    }

    fn compute(&mut self, layer: usize, cfg: &LayerConfig) -> PipelineLayer {
        self.details(layer, cfg);
        let details = self.detail_list(layer, cfg);
        let lay = &self.lg.layers[layer];
        let b = cfg.microbatch as f64;
        let mut points: Vec<ParetoPoint> = details.iter().enumerate().map(|(i, d)| self.point(layer, d, i, cfg)).collect();
        if self.selective != SelectivePoints::None {
            let rebuilt: Vec<Option<ParetoPoint>> = points.iter().zip(details).map(|(pt, d)| self.selective_point(layer, d, pt, cfg)).collect();
            if self.selective == SelectivePoints::Only {
                for (pt, sel) in points.iter_mut().zip(rebuilt) {
                    *pt = sel.unwrap_or_else(|| pt.clone());
                }
            } else {
                points.extend(rebuilt.into_iter().flatten());
            }
        }
        PipelineLayer { points, output_bytes: self.bytes.layer(lay.index).output_bytes * b / cfg.cp.max(1) as f64, tied: Vec::new() }
    }

    fn point(&self, layer: usize, d: &StrategyDetail, choice: usize, cfg: &LayerConfig) -> ParetoPoint {
        let params = d.param_elems;
        let fraction = self.shapes[layer].trained_fraction();
        // Expert weights split over the expert group (its own ZeRO and gradient groups).
        let ex = self.experts[layer];
        let folded = cfg.etp != cfg.tp && ex.experts > 0;
        // expert ops the assignment splits over the tensor ranks
        let split_experts = d.nodes.iter().filter(|(_, s)| *s == crate::split::Strategy::Experts).count();
        let (in_detail, experts) = self.experts_held(layer, Some(d), cfg);
        let dense = params - in_detail.min(params);
        let mut gathers = 0.0;
        let mut state = 0.0;
        // the gradients' reduction at the step's end, and the updated weights' gather after it
        let (mut sync, mut param_sync) = (0.0, 0.0);
        let mut grad_scatter = 0.0;
        for (held, zero_group, dp_group) in [(dense, cfg.zero_group, cfg.dp_group), (experts, cfg.expert_zero_group, cfg.expert_dp_group)] {
            if held <= 0.0 && experts > 0.0 {
                continue;
            }
            let trained = held * fraction;
            state += model_state(held, trained, cfg.zero, zero_group.size, self.precision).total();
            let weight_bytes = held * self.precision.weight as f64;
            let grad_bytes = trained * self.precision.grad as f64;
            let outer = |grad: f64| self.outer_reduce(grad, &zero_group, &dp_group);
            if matches!(cfg.zero, 1 | 2) {
                param_sync += self.comm.all_gather(weight_bytes, &zero_group);
            }
            sync += match cfg.zero {
                0 => self.comm.all_reduce(grad_bytes, &dp_group),
                1 => self.comm.reduce_scatter(grad_bytes, &zero_group) + outer(grad_bytes),
                2 => {
                    // ZeRO 2 and 3 also reduce-scatter after every backward but the last
                    grad_scatter += self.comm.reduce_scatter(grad_bytes, &zero_group);
                    self.comm.reduce_scatter(grad_bytes, &zero_group) + outer(grad_bytes)
                }
                _ => {
                    // ZeRO-3 gathers the weights before every forward and backward
                    gathers += self.comm.all_gather(weight_bytes, &zero_group);
                    grad_scatter += self.comm.reduce_scatter(grad_bytes, &zero_group);
                    self.comm.reduce_scatter(grad_bytes, &zero_group) + outer(grad_bytes)
                }
            };
            if experts <= 0.0 {
                break;
            }
        }
        let c = cfg.cp.max(1) as f64;
        // Every per-token cost runs on the rank's 1/c of the sequence (causal load balancing
        // gives each rank a front and a back chunk, so attention's work divides by c too).
        let (mut fwd, mut bwd) = (d.fwd_s / c, d.bwd_s / c);
        if cfg.cp > 1 {
            // A matmul of f/c FLOPs takes (f/c + f½)/rate on the roofline's efficiency curve,
            // not (f + f½)/(c·rate): each of the layer's GEMMs (its weight matmuls, attention's
            // two products) pays the half-efficiency size again on its smaller chunk.
            let gemms = self.shapes[layer].weight_matmuls as f64 + if self.attention[layer].kv_bytes > 0.0 { 2.0 } else { 0.0 };
            let eff = &self.spec.efficiency;
            let per_gemm = eff.half_flops.max(0.0) * (1.0 - 1.0 / c) / (self.spec.peak_flops(self.dtype) * eff.peak.max(1e-9));
            fwd += gemms * per_gemm;
            bwd += 2.0 * gemms * per_gemm;
        }
        // Folded with the experts whole in the assignment (it priced every tensor rank running
        // every token through them): each tensor rank runs its 1/t of the tokens and keeps
        // their activations alone; without sequence parallelism the outputs and the tokens'
        // gradients are all-gathered over the tensor ranks.
        let fold_rows = folded && split_experts == 0 && cfg.tp > 1;
        let mut folded_saved = 0.0;
        if fold_rows {
            let (b, t) = (cfg.microbatch as f64 / c, cfg.tp as f64);
            let delta = node_time(&split(&ex.figures, b, t, SplitDim::Rows), self.dtype, self.spec) - node_time(&split(&ex.figures, b, 1.0, SplitDim::Rows), self.dtype, self.spec);
            let lb = self.bytes.layer(layer);
            let ag = if cfg.sequence_parallel { 0.0 } else { self.comm.all_gather(lb.input_bytes.max(lb.output_bytes) * b, &cfg.tp_group) };
            fwd = (fwd + delta + ag).max(0.0);
            bwd = (bwd + 2.0 * delta + ag).max(0.0);
            folded_saved = ex.figures.saved_bytes * b * (1.0 - 1.0 / t);
        }
        // the experts' forward on this rank at the rows their group gathers
        let mut experts_fwd = 0.0;
        if cfg.ep > 1 && ex.experts > 0 && ex.figures.gemms[0].share > 0.0 {
            // Each expert runs the routed tokens of its group's e ranks: e times the rows per
            // expert the assignment priced (the rank's FLOPs are the same), its GEMMs larger.
            let (tt, dim) = match (fold_rows, split_experts > 0) {
                (true, _) => (cfg.tp.max(1) as f64, SplitDim::Rows),
                (false, true) => (cfg.tp.max(1) as f64, SplitDim::Inner),
                (false, false) => (1.0, SplitDim::Rows),
            };
            let priced = split(&ex.figures, cfg.microbatch as f64 / c, tt, dim);
            let mut grouped = priced;
            for g in &mut grouped.gemms {
                g.rows *= cfg.ep as f64;
            }
            experts_fwd = node_time(&grouped, self.dtype, self.spec);
            let delta = experts_fwd - node_time(&priced, self.dtype, self.spec);
            fwd = (fwd + delta).max(0.0);
            bwd = (bwd + 2.0 * delta).max(0.0);
        }
        if folded && split_experts > 0 {
            // The assignment priced the experts split over the tensor ranks with their tensor
            // collectives (the partial output reduced, the tokens' gradient all-reduced); folded,
            // each tensor rank runs its own tokens: nothing under sequence parallelism (the tokens
            // are already the rank's), else the outputs and the tokens' gradients all-gathered.
            let lb = self.bytes.layer(layer);
            let hidden = lb.input_bytes.max(lb.output_bytes) * cfg.microbatch as f64 / c;
            let (ar, ag) = (self.comm.all_reduce(hidden, &cfg.tp_group), self.comm.all_gather(hidden, &cfg.tp_group));
            let (rs, n) = (self.comm.reduce_scatter(hidden, &cfg.tp_group), split_experts as f64);
            let (was_fwd, was_bwd) = if cfg.sequence_parallel { (rs + ag, ar + ag) } else { (ar, ar) };
            let (now_fwd, now_bwd) = if cfg.sequence_parallel { (0.0, 0.0) } else { (ag, ag) };
            fwd = (fwd + n * (now_fwd - was_fwd)).max(0.0);
            bwd = (bwd + n * (now_bwd - was_bwd)).max(0.0);
        }
        let ax = self.axis_times(layer, cfg);
        fwd += ax.kv_exposed_fwd_s + ax.imbalance_fwd_s;
        bwd += ax.kv_exposed_bwd_s + 2.0 * ax.imbalance_fwd_s;
        let hidden = cfg.merged_share * merged_saving_s(fwd, bwd, experts_fwd + ax.imbalance_fwd_s, &ax);
        // compute beside a hidden all-to-all runs on the SMs its kernels leave (DeepEP's hold
        // a fixed number; NCCL's all-to-all is not priced so)
        let beside = match self.expert_dispatch {
            crate::ir::ExpertDispatch::PerNode => hidden * self.spec.compute_share_beside(crate::cost::comm::DEEPEP_SMS),
            crate::ir::ExpertDispatch::AllToAll => 0.0,
        };
        fwd += ax.all_to_all_fwd_s - (hidden - beside) / 2.0;
        bwd += ax.all_to_all_bwd_s - (hidden - beside) / 2.0;
        // A mask or rotary table every layer reads is one tensor, held whole on every tensor
        // rank, per chunk: taken out of the layer's bytes (which split it like the layer).
        let lay = self.bytes.layer(layer);
        let b = cfg.microbatch as f64;
        let t = cfg.tp.max(1) as f64;
        let shared = lay.shared_input_bytes * b / c;
        let input_bytes = (d.input_bytes / c - shared / if cfg.sequence_parallel { t } else { 1.0 }).max(0.0);
        // the K and V attention keeps were gathered over the context group: whole, not ÷c
        let kv_whole = self.attention[layer].kv_saved_bytes * b / t * (1.0 - 1.0 / c);
        // the loss keeps its log-probabilities outside the layer: checkpointing it keeps them too
        let (loss_kept, loss_work) = self.loss_point_bytes(layer, d, cfg);
        let input_bytes = input_bytes + loss_kept;
        let act_bytes = (d.act_bytes / c - lay.shared_saved_bytes * b / c / t + kv_whole - folded_saved).max(input_bytes);
        // Prefetched beside the layer before, whose pass stands in for this one's (the same
        // blocks): only what exceeds it is paid, where the device overlaps them at all.
        let exposed = |pass: f64| if self.spec.overlapped_gathers { (gathers - pass).max(0.0) } else { gathers };
        // Reduced beside the backward (`grad_overlap`): what the backward's compute leaves
        // after its own gathers hides each reduction of the layer's gradients.
        let beside = |reduce: f64| if cfg.grad_overlap { (reduce - (bwd - if self.spec.overlapped_gathers { gathers } else { 0.0 }).max(0.0)).max(0.0) } else { reduce };
        ParetoPoint {
            gather_fwd_s: exposed(fwd),
            fwd_s: fwd + exposed(fwd),
            bwd_s: bwd + exposed(bwd),
            state_bytes: state,
            act_bytes,
            input_bytes,
            shared_bytes: shared,
            offload_bytes: d.offload_bytes / c,
            sync_s: beside(sync) + param_sync,
            grad_scatter_s: beside(grad_scatter),
            choice,
            host_s: self.spec.host_bandwidth.map_or(0.0, |bw| d.offload_bytes / c / bw),
            // the runner gathers what ZeRO shards: all but the experts held in part
            gathered_bytes: if cfg.zero >= 3 { dense * self.precision.weight as f64 } else { 0.0 },
            selective_bytes: 0.0,
            all_to_all_hidden_s: hidden,
            loss_bytes: loss_kept + loss_work,
            loss_kept_bytes: loss_kept,
        }
    }

    /// `pt` (of assignment `d`) with the layer's normalisations and activation functions (the
    /// experts' too) rebuilt in the backward instead of kept (`Layer::selective_nodes`): its
    /// kept bytes less
    /// their outputs (each split as its node is; under context parallelism each rank's tokens),
    /// its backward longer by their forwards. `None` where nothing would be freed.
    fn selective_point(&self, layer: usize, d: &StrategyDetail, pt: &ParetoPoint, cfg: &LayerConfig) -> Option<ParetoPoint> {
        let lay = self.lg.layers.get(layer)?;
        let bytes = self.bytes.layer(layer);
        // the rebuilt nodes; of their outputs, what the backward keeps (freed), and what the
        // policy holds beyond that
        let (nodes, kept, held) = match self.selective_policy {
            crate::ir::SelectivePolicy::Pointwise => (&lay.selective_nodes, bytes.selective_bytes, 0.0),
            crate::ir::SelectivePolicy::Ops => (&lay.op_selective.rebuilt, bytes.op_freed_bytes, bytes.op_held_bytes),
        };
        let (b, c, t) = (cfg.microbatch as f64, cfg.cp.max(1) as f64, cfg.tp.max(1) as f64);
        let (mut whole, mut freed, mut time) = (0.0, 0.0, 0.0);
        for &n in nodes {
            let node = self.lg.graph.try_node(n)?;
            let split_by = output_split(d, node, cfg);
            let fig = self.bytes.node(n);
            if fig.experts_activation_bytes > 0.0 {
                // its experts' activations, rebuilt from the kept gate and up halves (read
                // twice, written once); a folded expert group's tensor ranks route their own
                // tokens, so its pairs split over them as an expert split's widths do
                let split_by = if cfg.etp != cfg.tp { t } else { split_by };
                let act = fig.experts_activation_bytes;
                whole += act;
                freed += act * b / c / split_by;
                let rebuild = NodeFigures { memory_bytes: 2.0 * act, ..Default::default() };
                time += node_time(&split(&rebuild, b / c, split_by, SplitDim::Columns), self.dtype, self.spec);
                continue;
            }
            whole += fig.output_bytes;
            freed += fig.output_bytes * b / c / split_by;
            // a rebuilt weight product at the rate its forward ran (fp8 under Float8 linears)
            let dtype = crate::cost::compute::product_dtype(&node.op, &fig, lay.kind, self.dtype, self.spec);
            time += node_time(&split(&fig, b / c, split_by, SplitDim::Columns), dtype, self.spec);
        }
        // only what the run's precision keeps of them (an autocast product keeps its own copy);
        // what the policy holds, split as the rebuilt outputs are
        let per_whole = if whole > 0.0 { freed / whole } else { 0.0 };
        let rebuilt = freed;
        let freed = freed * if whole > 0.0 { (kept / whole).clamp(0.0, 1.0) } else { 0.0 };
        let net = (freed - held * per_whole).min(pt.act_bytes - pt.input_bytes);
        // everything rebuilt lives through the layer's backward (the pointwise outputs are all kept ones)
        let transient = match self.selective_policy {
            crate::ir::SelectivePolicy::Pointwise => freed,
            crate::ir::SelectivePolicy::Ops => rebuilt.max(freed),
        };
        (freed > 0.0 && net > 0.0).then(|| ParetoPoint { act_bytes: pt.act_bytes - net, bwd_s: pt.bwd_s + time, selective_bytes: transient, ..pt.clone() })
    }

    /// What the loss keeps (its log-probabilities, `LayerBytes::loss_kept_bytes`) and its
    /// working copies beside them at its backward, per microbatch, in the layer making its
    /// input: each context rank's tokens, split over the tensor ranks as the loss's input is (a
    /// vocabulary-split head's logits: the loss runs on each rank's columns, as torchtitan's loss
    /// parallel and Megatron's vocabulary-parallel cross entropy do).
    fn loss_point_bytes(&self, layer: usize, d: &StrategyDetail, cfg: &LayerConfig) -> (f64, f64) {
        let kept = self.bytes.layer(layer).loss_kept_bytes;
        let Some(node) = self.lg.loss.filter(|_| kept > 0.0).and_then(|l| self.lg.graph.try_node(l.node)) else { return (0.0, 0.0) };
        let kept = kept * cfg.microbatch as f64 / cfg.cp.max(1) as f64 / output_split(d, node, cfg);
        (kept, kept * crate::ir::LossFigures::WORKING_COPIES)
    }

    /// What context and expert parallelism add to one microbatch of `layer` on a rank under
    /// `cfg` (zero at c = e = 1).
    pub fn axis_times(&self, layer: usize, cfg: &LayerConfig) -> AxisTimes {
        let mut out = AxisTimes::default();
        let c = cfg.cp.max(1) as f64;
        let b = cfg.microbatch as f64;
        let t = cfg.tp.max(1) as f64;
        let att = self.attention[layer];
        if cfg.cp > 1 && att.kv_bytes > 0.0 {
            // All-gather of K and V over the context group before attention (Llama 3's
            // scheme: with grouped-query attention K/V are a small fraction of the tokens'
            // activations, and every rank then attends its front and back chunks to the whole
            // sequence); the backward gathers them again and reduce-scatters their gradients.
            // Priced exposed: the runner overlaps them with the queries' projection and rotary
            // (forward) and their backward, which this does not count (an upper bound).
            let kv = att.kv_bytes * b / t;
            let gather = self.comm.all_gather(kv, &cfg.cp_group);
            let scatter = self.comm.reduce_scatter(kv, &cfg.cp_group);
            out.kv_transfer_s = 2.0 * gather + scatter;
            out.kv_exposed_fwd_s = gather;
            out.kv_exposed_bwd_s = gather + scatter;
        }
        let ex = self.experts[layer];
        if (cfg.ep > 1 || cfg.etp != cfg.tp) && ex.experts > 0 {
            // Dispatch and combine: two all-to-alls forward, two backward, of the routed
            // tokens' hidden vectors ((e − 1)/e of them leave the rank); the busiest rank of
            // the group runs `expert_imbalance` times the mean routed tokens.
            // each rank sends its own tokens: its sequence-parallel chunk, or, folded, its
            // expert-tensor group's share of the tensor group's tokens
            let tokens_split = if cfg.sequence_parallel { t } else { t / cfg.etp.clamp(1, cfg.tp.max(1)) as f64 };
            let routed = ex.routed_bytes * b / c / tokens_split;
            let a2a = match self.expert_dispatch {
                crate::ir::ExpertDispatch::AllToAll => self.comm.all_to_all(routed, &cfg.ep_group),
                crate::ir::ExpertDispatch::PerNode => self.comm.per_node_dispatch(routed / ex.top_k.max(1) as f64, ex.experts, ex.top_k, &cfg.ep_group),
            };
            let f = crate::cost::compute::scaled(&ex.figures, b / t / c);
            let run = crate::cost::compute::node_time(&f, self.dtype, self.spec);
            out.all_to_all_fwd_s = 2.0 * a2a;
            out.all_to_all_bwd_s = 2.0 * a2a;
            out.imbalance_fwd_s = (self.expert_imbalance - 1.0).max(0.0) * run;
        }
        out
    }

    /// Gradient all-reduce across sharded groups when ZeRO covers only part of the replicas.
    fn outer_reduce(&self, grad_bytes: f64, zero_group: &GroupSpan, dp_group: &GroupSpan) -> f64 {
        let outer = dp_group.size / zero_group.size.max(1);
        if outer <= 1 {
            return 0.0;
        }
        let span = GroupSpan { size: outer, per_node: 1 };
        self.comm.all_reduce(grad_bytes / zero_group.size.max(1) as f64, &span)
    }

    /// Model state of a rank holding `dense` parameters outside the experts (`dense_trained` of
    /// them trained), ZeRO-sharded over the data-parallel group, and `experts` expert weights
    /// (`experts_trained` trained), ZeRO-sharded over the expert group's own; both per rank,
    /// after the tensor, expert-tensor and expert splits.
    pub fn state_split(&self, (dense, dense_trained): (f64, f64), (experts, experts_trained): (f64, f64), cfg: &LayerConfig) -> crate::cost::ModelState {
        let d = model_state(dense, dense_trained, cfg.zero, cfg.zero_group.size, self.precision);
        if experts <= 0.0 {
            return d;
        }
        let ex = model_state(experts, experts_trained, cfg.zero, cfg.expert_zero_group.size, self.precision);
        crate::cost::ModelState { params: d.params + ex.params, grads: d.grads + ex.grads, optimizer: d.optimizer + ex.optimizer }
    }

    /// The expert weights of `layer` a rank holds under `cfg` whose tensor assignment is
    /// `detail`: those inside the assignment's own count (split over the tensor ranks where
    /// it splits the experts, else whole) and those the rank keeps after the expert group
    /// divides them (folded: each expert over its expert-tensor ranks only).
    pub fn experts_held(&self, layer: usize, detail: Option<&StrategyDetail>, cfg: &LayerConfig) -> (f64, f64) {
        let ex = self.experts[layer];
        let folded = cfg.etp != cfg.tp;
        if ex.experts == 0 || (cfg.ep <= 1 && !folded) {
            return (0.0, 0.0);
        }
        let split = detail.is_none_or(|d| d.nodes.iter().any(|(_, s)| *s == crate::split::Strategy::Experts));
        let in_detail = if split { ex.params / cfg.tp.max(1) as f64 } else { ex.params };
        let held = if folded { ex.params / cfg.etp.max(1) as f64 } else { in_detail } / cfg.ep.max(1) as f64;
        (in_detail, held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The merged pair run by a list scheduler over two in-order streams: each task starts when
    /// its stream is free and what it reads is done (Megatron-Core's order and dependencies,
    /// written as data).
    fn simulated_pair(attn_f: f64, experts: f64, attn_b: f64, a2a_f: f64, a2a_b: f64) -> f64 {
        // (stream: 0 compute, 1 communication; seconds; tasks it waits for)
        let tasks: [(usize, f64, &[usize]); 9] = [
            (1, a2a_b, &[]),     // 0 combine, backward
            (0, attn_f, &[]),    // 1 attention, forward
            (0, experts, &[0]),  // 2 experts' input gradients
            (1, a2a_f, &[1]),    // 3 dispatch, forward
            (0, experts, &[2]),  // 4 experts' weight gradients
            (1, a2a_b, &[2]),    // 5 dispatch, backward
            (0, experts, &[3]),  // 6 experts, forward
            (1, a2a_f, &[6]),    // 7 combine, forward
            (0, attn_b, &[5]),   // 8 attention, backward
        ];
        let mut free = [0.0f64; 2];
        let mut end = [0.0f64; 9];
        for (i, &(stream, secs, after)) in tasks.iter().enumerate() {
            let start = after.iter().map(|&j| end[j]).fold(free[stream], f64::max);
            end[i] = start + secs;
            free[stream] = end[i];
        }
        end.iter().copied().fold(0.0, f64::max)
    }

    proptest! {
        /// The merged pair saves what the list scheduler says, never more than the shorter of
        /// the two streams' work.
        #[test]
        fn a_merged_pair_saves_what_two_streams_overlap(attn in 0.0f64..5.0, experts in 0.0f64..5.0, attn_b in 0.0f64..10.0, a2a in 0.0f64..5.0) {
            let (fwd, bwd) = (attn + experts, attn_b + 2.0 * experts);
            let ax = AxisTimes { all_to_all_fwd_s: 2.0 * a2a, all_to_all_bwd_s: 2.0 * a2a, ..AxisTimes::default() };
            let saved = merged_saving_s(fwd, bwd, experts, &ax);
            let apart = fwd + bwd + 4.0 * a2a;
            let sim = simulated_pair(attn, experts, attn_b, a2a, a2a);
            prop_assert!((apart - saved - sim).abs() < 1e-9, "saved {saved}, simulated {sim}, apart {apart}");
            prop_assert!(saved >= 0.0 && saved <= (4.0 * a2a).min(fwd + bwd) + 1e-9);
        }
    }

    #[test]
    fn without_all_to_alls_nothing_is_saved_and_short_ones_hide_whole() {
        let none = AxisTimes::default();
        assert_eq!(merged_saving_s(3.0, 6.0, 1.0, &none), 0.0);
        // each all-to-all shorter than the compute beside it: all four hidden
        let short = AxisTimes { all_to_all_fwd_s: 0.2, all_to_all_bwd_s: 0.2, ..AxisTimes::default() };
        assert!((merged_saving_s(3.0, 6.0, 1.0, &short) - 0.4).abs() < 1e-12);
    }
}
