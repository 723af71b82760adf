//! The plan's codegen section: layer shards stored once per (layer, tensor rank), what crosses
//! each stage boundary, tied weights, and one program template per pipeline rank. Programs of
//! the tensor and data-parallel ranks of a pipeline rank are identical up to rank renaming, so
//! a template names peers by pipeline rank and groups by kind; [`RankView`] instantiates the
//! concrete program of one global rank from the template and the plan's mesh.
//!
//! Gradient synchronisation (the epilogue after a rank's last compute):
//! - tied weights used by stages on different pipeline ranks: all-reduce over those ranks
//!   (same data-parallel and tensor rank), before data-parallel synchronisation;
//! - ZeRO 0: all-reduce of each stage's gradients over the data-parallel group;
//! - ZeRO 1: the same all-reduce, the optimizer step on this rank's 1/dp of the state, then an
//!   all-gather of the updated parameters;
//! - ZeRO 2: reduce-scatter of the gradients instead of the all-reduce, then as ZeRO 1;
//! - ZeRO 3: parameters stay sharded: all-gathered before each forward and backward of a stage,
//!   gradients reduce-scattered, no gather after the step. With `sharded_dp = n` the sharding
//!   group is n consecutive replicas and the reduced shards are all-reduced across groups.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::lower::{LowerError, LowerOptions, lower};
use super::program::{Instr, Purpose, RankProgram};
use super::shard::{CodegenError, LayerShard, Sharder, apply_shard};
use crate::ir::{FusedOp, Graph, LayeredGraph, NodeId, OpKind, Parallelism, ScheduleError, SelectivePolicy, ValueKind, compute_actions};
use crate::passes::figures::is_trainable;
use crate::solve::Placement as AxisOrder;
use crate::split::Strategy;

/// Version of the codegen section's layout (bumped on incompatible changes). 3: the graph the
/// plan addresses has its GELU chains fused, listed in `fused`. 4: attention chains too, and a
/// fused node lists its `inputs` (several). 5: mixture-of-experts chains too, and layer
/// strategies may be `experts`. 7: RMSNorm and SwiGLU chains too.
pub const CODEGEN_VERSION: u32 = 7;

/// What codegen needs of a plan: degrees, schedule and the stages' layer ranges.
#[derive(Clone, Debug, PartialEq)]
pub struct CodegenInput {
    /// Degrees, ZeRO, microbatches and schedule of the plan.
    pub parallel: Parallelism,
    /// Stages in order.
    pub stages: Vec<StageInput>,
    /// Layers whose strategy is `replicate`: kept whole where they do not divide `tp` ways
    /// (any other layer that does not divide is an error).
    pub replicated_layers: Vec<usize>,
    /// The plan's strategy per node, per layer (`[layer][i] = (node, strategy)`); empty when
    /// the plan has none. Matmuls and lookups marked `replicate` keep their weights whole, and
    /// every choosing node's realised strategy must equal the plan's.
    pub node_strategies: Vec<Vec<(String, Strategy)>>,
    /// Samples per microbatch, if known: a graph whose batch is fixed at another size is
    /// rebound to it ([`super::rebatch`]).
    pub microbatch_size: Option<i64>,
}

/// One stage as codegen sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct StageInput {
    /// First and last layer, inclusive.
    pub layers: [usize; 2],
    /// Layers recomputed in the backward pass.
    pub checkpointed_layers: Vec<usize>,
    /// Layers that rebuild their normalisations' and activation functions' outputs in the
    /// backward (selective recompute).
    pub selective_layers: Vec<usize>,
    /// Bytes per microbatch sent to the next stage.
    pub output_bytes: u64,
}

/// The codegen section of a plan file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodegenSection {
    /// Layout version ([`CODEGEN_VERSION`]).
    pub version: u32,
    /// Tensor-parallel degree the shards are for.
    pub tp: usize,
    /// `shards[layer][tensor rank]`; empty when tp = 1 (every rank runs the whole layer).
    #[serde(default)]
    pub shards: Vec<Vec<LayerShard>>,
    /// Dims of every sliced initializer, so slices can be checked without the model.
    #[serde(default)]
    pub weight_dims: BTreeMap<String, Vec<i64>>,
    /// Per stage: boundary tensors, recompute points, parameter bytes.
    pub stages: Vec<StageCode>,
    /// Trained weights read by stages on different pipeline ranks (gradients summed).
    #[serde(default)]
    pub tied_weights: Vec<TiedWeight>,
    /// One program per pipeline rank, shared by its tensor and data-parallel ranks.
    pub templates: Vec<ProgramTemplate>,
    /// The model's fixed batch rebound to the plan's microbatch size, if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<super::rebatch::BatchRebind>,
    /// The op chains analysis fused into one op, in the order applied: the graph every id and
    /// name of this section addresses is the model specialised (`passes::specialise`) with
    /// these applied (`passes::fuse::apply`), then its batch rebound.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fused: Vec<FusedNode>,
}

/// One fused op of the plan's graph: a chain of the model's nodes computed by one op.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FusedNode {
    /// Id of the fused node (the chain's last node, whose id and output it keeps).
    pub node: usize,
    /// Its op (`{"gelu": {"approximate": "tanh"}}`,
    /// `{"attention": {"scale": 0.25, "mask": "additive"}}`,
    /// `{"mixture_of_experts": {"experts": 8, "activation": "silu"}}`).
    pub op: FusedOp,
    /// The values it reads, in the op's order (a GELU's one input; an attention's q, kᵀ, v and
    /// mask, if it has one; a mixture of experts' x, weights, indices, gate_up and down).
    pub inputs: Vec<String>,
    /// The value it makes: the chain's output.
    pub output: String,
    /// Ids of every node of the chain, `node` included, ascending; all but `node` are removed.
    pub replaces: Vec<usize>,
}

/// What one stage exchanges and keeps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageCode {
    /// Stage index.
    pub stage: usize,
    /// First and last layer, inclusive.
    pub layers: [usize; 2],
    /// The model nodes of those layers, by id (the model's ids as imported, which analysis
    /// keeps), as half-open ranges `[first, end)`. Nodes analysis folded into constants are
    /// not listed.
    #[serde(default)]
    pub nodes: Vec<[usize; 2]>,
    /// Model values this stage sends to the next per microbatch (its activations; values an
    /// earlier stage produced for a later one pass through), in this order.
    #[serde(default)]
    pub outputs_to_next: Vec<String>,
    /// The floating-point subset of `outputs_to_next`: the gradients the next stage sends back.
    #[serde(default)]
    pub gradients_from_next: Vec<String>,
    /// Graph inputs this stage reads from the data (token ids, labels, pixels).
    #[serde(default)]
    pub data_inputs: Vec<String>,
    /// Layers whose activations are recomputed in the backward pass.
    #[serde(default)]
    pub checkpointed_layers: Vec<usize>,
    /// Nodes whose outputs this stage frees after each forward and rebuilds before the
    /// backward (its selectively recomputed layers' normalisations and activation functions).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub selective_nodes: Vec<String>,
    /// Nodes of those layers whose outputs this stage holds from each forward to its backward
    /// though no backward reads them (torchtitan's per-op policy keeps them: attention and every
    /// other weight product).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub selective_kept: Vec<String>,
    /// Trained parameters this stage holds (its own and tied replicas), unsharded names.
    #[serde(default)]
    pub params: Vec<String>,
    /// Bytes of those parameters on one tensor rank (what data-parallel sync moves).
    pub param_bytes: u64,
    /// Under context parallelism with several stages: how the split of the whole model holds
    /// what crosses this stage's boundary, which the stage's own split starts from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<StageContext>,
}

/// What a stage's context split is told of the values it receives and yields (the split of the
/// whole model, done once when planning).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageContext {
    /// Values a rank holds its tokens of (received, or checked when yielded), by name; the
    /// others are whole.
    #[serde(default)]
    pub tokens: BTreeMap<String, TokenAxis>,
    /// Small integer values computed upstream that the stage reads (shapes), by name.
    #[serde(default)]
    pub ints: BTreeMap<String, IntValue>,
}

/// A value's token axis under context parallelism (`split::context::Tokens::Local`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenAxis {
    /// The axis.
    pub axis: usize,
    /// Sequence blocks along it (the batch, when the tokens are flattened with it).
    pub outer: i64,
}

/// A small integer tensor: its dims and elements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntValue {
    /// Dims.
    pub dims: Vec<i64>,
    /// Elements, row-major.
    pub values: Vec<i64>,
}

/// A weight whose gradient is summed across the stages that read it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TiedWeight {
    /// Initializer name.
    pub weight: String,
    /// Stages reading it.
    pub stages: Vec<usize>,
    /// Their pipeline ranks (distinct, ascending): the all-reduce group along the pipeline.
    pub pp_ranks: Vec<usize>,
    /// Bytes of the weight on one tensor rank.
    pub bytes: u64,
}

/// Which process group a template collective runs over, relative to the executing rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupRef {
    /// The tensor-parallel ranks of this rank's stage and replica.
    Tensor,
    /// All data-parallel replicas of this (pipeline, tensor) rank.
    Data,
    /// The replicas of this rank's ZeRO-3 sharding group (`sharded_dp` consecutive replicas).
    ShardGroup,
    /// The replicas holding the same ZeRO-3 shard in the other sharding groups.
    ShardPeers,
    /// The pipeline ranks sharing tied weight `index` (same data-parallel and tensor rank).
    Tied(usize),
}

/// One instruction of a program template: peers are pipeline ranks (the same tensor and
/// data-parallel rank of pipeline rank `to` / `from`), groups are [`GroupRef`]s.
pub type Step = Instr<usize, GroupRef>;

/// The program of every rank of one pipeline rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgramTemplate {
    /// Pipeline rank.
    pub pp_rank: usize,
    /// Stages it runs, in order.
    pub stages: Vec<usize>,
    /// Instructions in order.
    pub steps: Vec<Step>,
}

/// The device mesh: global ranks by mesh coordinates (pipeline rank, replica, tensor rank),
/// from the plan's stages, where the placement's axis order is already applied
/// ([`crate::plan::Plan::mesh`]). The one mesh type of codegen, the plan, the simulator and
/// the runtime. Its degrees are the shape of the table, not a second copy of
/// [`crate::ir::Parallel`]'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// `ranks[pp][dp][tp_rank]` = global rank.
    pub ranks: Vec<Vec<Vec<usize>>>,
}

/// Mesh coordinates of a global rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coord {
    /// Pipeline rank.
    pub pp: usize,
    /// Data-parallel rank.
    pub dp: usize,
    /// Tensor rank.
    pub tp: usize,
}

impl Mesh {
    /// The mesh of degrees (pp, tp, dp) with ranks numbered in the axis order `order`
    /// (`--placement`; the planner numbers the plan's stages this way).
    pub fn numbered(order: AxisOrder, pp: usize, tp: usize, dp: usize) -> Mesh {
        Mesh::from_rows((0..pp).map(|p| order.stage_ranks(p, [dp, pp, tp])).collect(), tp)
    }

    /// The mesh whose pipeline rank `p` holds `rows[p]`: a stage's rank list (replica-major,
    /// `tp` consecutive tensor ranks per replica).
    pub fn from_rows(rows: Vec<Vec<usize>>, tp: usize) -> Mesh {
        let tp = tp.max(1);
        Mesh { ranks: rows.into_iter().map(|r| r.chunks(tp).map(<[usize]>::to_vec).collect()).collect() }
    }

    /// Pipeline ranks.
    pub fn pp(&self) -> usize {
        self.ranks.len()
    }

    /// Data-parallel degree (replicas per pipeline rank).
    pub fn dp(&self) -> usize {
        self.ranks.first().map_or(0, Vec::len)
    }

    /// Tensor-parallel degree.
    pub fn tp(&self) -> usize {
        self.ranks.first().and_then(|r| r.first()).map_or(0, Vec::len)
    }

    /// Global rank at `c` (None outside the mesh).
    pub fn rank(&self, c: Coord) -> Option<usize> {
        self.ranks.get(c.pp)?.get(c.dp)?.get(c.tp).copied()
    }

    /// Coordinates of global rank `rank`.
    pub fn coord(&self, rank: usize) -> Option<Coord> {
        self.ranks.iter().enumerate().find_map(|(pp, replicas)| {
            replicas.iter().enumerate().find_map(|(dp, group)| group.iter().position(|&r| r == rank).map(|tp| Coord { pp, dp, tp }))
        })
    }

    /// Number of ranks (pp · dp · tp).
    pub fn world(&self) -> usize {
        self.ranks.iter().flatten().map(Vec::len).sum()
    }

    /// The tensor-parallel groups (global ranks in tensor-rank order), one per pipeline rank
    /// and replica.
    pub fn tensor_groups(&self) -> Vec<Vec<usize>> {
        self.ranks.iter().flatten().cloned().collect()
    }

    /// The ranks at pipeline rank `pp` and tensor rank `tp` of every replica, replica 0 first.
    pub fn replica_group(&self, pp: usize, tp: usize) -> Vec<usize> {
        self.ranks.get(pp).map_or_else(Vec::new, |replicas| replicas.iter().filter_map(|g| g.get(tp).copied()).collect())
    }

    /// Every global rank, ascending.
    pub fn all_ranks(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.ranks.iter().flatten().flatten().copied().collect();
        v.sort_unstable();
        v
    }
}

/// Errors of building or reading the codegen section.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// A layer could not be sharded (names the layer and node).
    #[error(transparent)]
    Shard(#[from] CodegenError),
    /// The schedule could not be lowered.
    #[error("lowering the schedule: {0}")]
    Lower(#[from] LowerError),
    /// The schedule is invalid.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The model's fixed batch cannot be rebound to the plan's microbatch size.
    #[error(transparent)]
    Batch(#[from] crate::passes::PassError),
    /// The graph's order, needed to find which boundary values carry gradients, is broken.
    #[error("finding which values between stages carry gradients: {0}")]
    Gradients(#[source] crate::passes::PassError),
    /// The input or section is inconsistent.
    #[error("codegen: {0}")]
    Inconsistent(String),
    /// Sharding realised another strategy for a node than the plan chose.
    #[error("layer {layer} (`{name}`), node `{node}`: the plan chose strategy `{chosen}` but codegen realises `{realised}`; plan again (the planner offers only what codegen emits, so this is a planner bug) or fix the plan's `layer_strategies`")]
    StrategyMismatch {
        /// Layer index.
        layer: usize,
        /// Layer name.
        name: String,
        /// Node name.
        node: String,
        /// The plan's strategy.
        chosen: Strategy,
        /// What the shards do (`follow`: no per-node strategy realised).
        realised: Strategy,
    },
    /// A rank outside the plan's mesh.
    #[error("rank {rank} is not in the plan (world size {world})")]
    NoRank {
        /// Asked for.
        rank: usize,
        /// Ranks in the plan.
        world: usize,
    },
}

/// Every choosing node's realised strategy equals the plan's (the others, `follow` or
/// `sequence`, follow their inputs).
fn check_realised(lg: &LayeredGraph, layer: usize, chosen: &[(String, Strategy)], realised: &[(String, Strategy)]) -> Result<(), EncodeError> {
    for (node, want) in chosen.iter().filter(|(_, s)| s.is_choosing()) {
        let got = realised.iter().find(|(n, _)| n == node).map_or(Strategy::Follow, |(_, s)| *s);
        if got != *want {
            return Err(EncodeError::StrategyMismatch {
                layer,
                name: lg.layers[layer].name.clone(),
                node: node.clone(),
                chosen: *want,
                realised: got,
            });
        }
    }
    Ok(())
}

/// Builds the codegen section for `input` on the analysed model `lg`.
pub fn build(lg: &LayeredGraph, input: &CodegenInput) -> Result<CodegenSection, EncodeError> {
    let rebound = match input.microbatch_size {
        Some(b) => super::rebatch::rebind(lg, b)?,
        None => None,
    };
    let batch = rebound.as_ref().map(|(_, r)| *r);
    let lg = rebound.as_ref().map_or(lg, |(l, _)| l);
    let g = &lg.graph;
    let n_layers = lg.layers.len();
    let bad = |m: String| EncodeError::Inconsistent(m);
    if input.stages.len() != input.parallel.schedule.stages(input.parallel.pp) {
        return Err(bad(format!(
            "{} stages, but schedule {} on {} pipeline ranks has {}",
            input.stages.len(),
            input.parallel.schedule,
            input.parallel.pp,
            input.parallel.schedule.stages(input.parallel.pp)
        )));
    }
    let mut stage_of_layer = vec![usize::MAX; n_layers];
    for (s, st) in input.stages.iter().enumerate() {
        for l in st.layers[0]..=st.layers[1] {
            let slot = stage_of_layer.get_mut(l).ok_or_else(|| bad(format!("stage {s} names layer {l}; the model has {n_layers}")))?;
            *slot = s;
        }
    }
    if let Some(l) = stage_of_layer.iter().position(|&s| s == usize::MAX) {
        return Err(bad(format!("layer {l} is in no stage")));
    }

    let shards = layer_shards(lg, input)?;
    let mut weight_dims = BTreeMap::new();
    for w in shards.iter().flatten().flat_map(|s| &s.weight_slices) {
        if !weight_dims.contains_key(&w.initializer)
            && let Some(v) = g.value_by_name(&w.initializer)
        {
            let val = g.value(v);
            let dims = val.data.as_ref().map(|t| t.dims.clone()).or_else(|| val.ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(|s| s.known()));
            if let Some(d) = dims {
                weight_dims.insert(w.initializer.clone(), d);
            }
        }
    }
    // Bytes of a trained weight on tensor rank 0 of layer `l`.
    let weight_bytes = |v: crate::ir::ValueId, l: usize| -> u64 {
        let val = g.value(v);
        let (numel, size) = match (&val.data, &val.ty) {
            (Some(t), _) => (t.numel(), t.dtype.size_bytes()),
            (None, Some(ty)) => (ty.shape.as_ref().and_then(|s| s.numel()).unwrap_or(0), ty.dtype.size_bytes()),
            _ => (0, 0),
        };
        let full = numel * size;
        let slice = shards.get(l).and_then(|s| s.first()).and_then(|s| s.weight_slices.iter().find(|w| w.initializer == val.name));
        match (slice, weight_dims.get(&val.name)) {
            (Some(w), Some(dims)) if dims.get(w.axis).is_some_and(|&d| d > 0) => full / dims[w.axis] as u64 * w.len(),
            _ => full,
        }
    };

    let (mut outputs_to_next, mut gradients_from_next, mut data_inputs) = boundaries(lg, input, &stage_of_layer)?;

    // Parameters per stage, and tied weights.
    let mut stage_params: Vec<BTreeMap<String, u64>> = vec![BTreeMap::new(); input.stages.len()];
    let mut readers: BTreeMap<String, (BTreeSet<usize>, u64)> = BTreeMap::new();
    for (li, layer) in lg.layers.iter().enumerate() {
        let s = stage_of_layer[li];
        for &v in layer.params.iter().chain(&layer.shared_params) {
            if !is_trainable(g, v) {
                continue;
            }
            let bytes = weight_bytes(v, li);
            let name = g.value(v).name.clone();
            stage_params[s].entry(name.clone()).or_insert(bytes);
            let e = readers.entry(name).or_insert((BTreeSet::new(), bytes));
            e.0.insert(s);
        }
    }
    let mut tied_weights = Vec::new();
    for (weight, (stages, bytes)) in readers {
        let pp_ranks: BTreeSet<usize> = stages.iter().map(|&s| input.parallel.schedule.rank_of_stage(s, input.parallel.pp)).collect();
        if pp_ranks.len() < 2 {
            continue;
        }
        let per_stage: BTreeSet<u64> = stages.iter().map(|&s| stage_params[s][&weight]).collect();
        if per_stage.len() > 1 {
            return Err(bad(format!("tied weight `{weight}` is sliced differently by stages {stages:?}; its gradients cannot be summed")));
        }
        tied_weights.push(TiedWeight { weight, stages: stages.into_iter().collect(), pp_ranks: pp_ranks.into_iter().collect(), bytes });
    }

    /// The names of the nodes `of` each of `layers` gives.
    fn selective_names(lg: &LayeredGraph, layers: &[usize], of: impl Fn(&crate::ir::Layer) -> &[NodeId]) -> Vec<String> {
        layers.iter().filter_map(|&l| lg.layers.get(l)).flat_map(|l| of(l).iter().map(|&n| lg.graph.node(n).name.clone())).collect()
    }
    let stages: Vec<StageCode> = input
        .stages
        .iter()
        .enumerate()
        .map(|(s, st)| StageCode {
            stage: s,
            layers: st.layers,
            nodes: id_ranges((st.layers[0]..=st.layers[1]).flat_map(|l| lg.layers[l].nodes.iter().map(|n| n.index()))),
            outputs_to_next: std::mem::take(&mut outputs_to_next[s]),
            gradients_from_next: std::mem::take(&mut gradients_from_next[s]),
            data_inputs: std::mem::take(&mut data_inputs[s]).into_iter().collect(),
            checkpointed_layers: st.checkpointed_layers.clone(),
            selective_nodes: selective_names(lg, &st.selective_layers, |l| match input.parallel.selective_policy {
                SelectivePolicy::Pointwise => &l.selective_nodes,
                SelectivePolicy::Ops => &l.op_selective.rebuilt,
            }),
            selective_kept: selective_names(lg, &st.selective_layers, |l| match input.parallel.selective_policy {
                SelectivePolicy::Pointwise => &[],
                SelectivePolicy::Ops => &l.op_selective.kept,
            }),
            params: stage_params[s].keys().cloned().collect(),
            param_bytes: stage_params[s].values().sum(),
            context: None,
        })
        .collect();

    let templates = templates(input, &stages, &tied_weights)?;
    let fused = lg
        .fused
        .iter()
        .map(|f| FusedNode {
            node: f.node.index(),
            op: f.op,
            inputs: f.inputs.iter().map(|&v| g.value(v).name.clone()).collect(),
            output: g.value(f.output).name.clone(),
            replaces: f.replaces.iter().map(|n| n.index()).collect(),
        })
        .collect();
    Ok(CodegenSection { version: CODEGEN_VERSION, tp: input.parallel.tp, shards, weight_dims, stages, tied_weights, templates, batch, fused })
}

/// The shards of every layer at tp > 1 (none at tp = 1): as the solver chose per node where it
/// chose, whole where it replicated the layer, else strict (a weight that does not divide is an
/// error).
fn layer_shards(lg: &LayeredGraph, input: &CodegenInput) -> Result<Vec<Vec<LayerShard>>, EncodeError> {
    if input.parallel.tp <= 1 {
        return Ok(Vec::new());
    }
    let sharder = Sharder::new(lg)?.with_sequence_parallel(input.parallel.sequence_parallel);
    // Folded expert groups (expert-TP 1): every tensor rank holds its experts whole and routes
    // its own share of the tokens, so the mixtures of experts are not split over the tensor ranks.
    let folded = input.parallel.experts_folded();
    let experts_of = |l: usize| -> Vec<String> {
        lg.layers[l].nodes.iter().map(|&n| lg.graph.node(n)).filter(|n| folded && n.op.is(OpKind::MixtureOfExperts)).map(|n| n.name.clone()).collect()
    };
    let shard = |&l: &usize| -> Result<Vec<LayerShard>, EncodeError> {
        let chosen = input.node_strategies.get(l).filter(|c| !c.is_empty());
        let whole_experts = experts_of(l);
        Ok(match chosen {
            Some(chosen) => {
                let mut keep: Vec<String> = chosen.iter().filter(|(_, s)| *s == Strategy::Replicate).map(|(n, _)| n.clone()).collect();
                keep.extend(whole_experts.iter().cloned());
                let (shards, realised) = sharder.shard_layer_keeping(l, input.parallel.tp, &keep)?;
                let chosen: Vec<(String, Strategy)> = chosen.iter().filter(|(n, _)| !whole_experts.contains(n)).cloned().collect();
                check_realised(lg, l, &chosen, &realised)?;
                shards
            }
            None if !whole_experts.is_empty() => sharder.shard_layer_keeping(l, input.parallel.tp, &whole_experts)?.0,
            None if input.replicated_layers.contains(&l) => sharder.shard_layer(l, input.parallel.tp)?,
            None => sharder.shard_layer_strict(l, input.parallel.tp)?,
        })
    };
    // Layer by layer on every core; the first error in layer order, as one by one.
    let layers: Vec<usize> = (0..lg.layers.len()).collect();
    crate::parallel::map(&layers, crate::parallel::threads(), shard).into_iter().collect()
}

/// Per stage, what crosses its boundaries: the values it sends to the next stage, the subset
/// whose gradients come back, and the graph inputs it reads. A value produced in stage a and
/// read in stage b > a crosses every boundary from a to b.
#[allow(clippy::type_complexity)]
fn boundaries(lg: &LayeredGraph, input: &CodegenInput, stage_of_layer: &[usize]) -> Result<(Vec<Vec<String>>, Vec<Vec<String>>, Vec<BTreeSet<String>>), EncodeError> {
    let g = &lg.graph;
    let mut producer_stage = vec![usize::MAX; g.value_count()];
    for (li, layer) in lg.layers.iter().enumerate() {
        for &n in &layer.nodes {
            for &o in &g.node(n).outputs {
                producer_stage[o.index()] = stage_of_layer[li];
            }
        }
    }
    let mut last_reader = vec![0usize; g.value_count()];
    let mut data_inputs: Vec<BTreeSet<String>> = vec![BTreeSet::new(); input.stages.len()];
    for (li, layer) in lg.layers.iter().enumerate() {
        let s = stage_of_layer[li];
        for &n in &layer.nodes {
            for v in g.node(n).inputs.iter().flatten() {
                let val = g.value(*v);
                if val.kind == ValueKind::Input {
                    data_inputs[s].insert(val.name.clone());
                } else if producer_stage[v.index()] != usize::MAX {
                    last_reader[v.index()] = last_reader[v.index()].max(s);
                }
            }
        }
    }
    // the last stage computes the loss from the graph's outputs
    for &o in &g.outputs {
        if producer_stage[o.index()] != usize::MAX {
            last_reader[o.index()] = last_reader[o.index()].max(input.stages.len().saturating_sub(1));
        }
    }
    let mut outputs_to_next: Vec<Vec<String>> = vec![Vec::new(); input.stages.len()];
    let mut gradients_from_next: Vec<Vec<String>> = vec![Vec::new(); input.stages.len()];
    // only values computed from trained parameters get a gradient back (not masks or positions)
    let carries = crate::passes::params::carries_gradient(g).map_err(EncodeError::Gradients)?;
    for v in g.value_ids() {
        let (a, b) = (producer_stage[v.index()], last_reader[v.index()]);
        if a == usize::MAX || b <= a {
            continue;
        }
        let val = g.value(v);
        for s in a..b {
            outputs_to_next[s].push(val.name.clone());
            if carries[v.index()] {
                gradients_from_next[s].push(val.name.clone());
            }
        }
    }
    Ok((outputs_to_next, gradients_from_next, data_inputs))
}

/// Ids as sorted half-open ranges of consecutive ids.
fn id_ranges(ids: impl Iterator<Item = usize>) -> Vec<[usize; 2]> {
    let ids: BTreeSet<usize> = ids.collect();
    let mut out: Vec<[usize; 2]> = Vec::new();
    for i in ids {
        match out.last_mut() {
            Some(r) if r[1] == i => r[1] = i + 1,
            _ => out.push([i, i + 1]),
        }
    }
    out
}

impl StageCode {
    /// Ids of the model nodes the stage runs, ascending.
    pub fn node_ids(&self) -> impl Iterator<Item = usize> + '_ {
        self.nodes.iter().flat_map(|r| r[0]..r[1])
    }

    /// Whether the stage runs node `id` (without listing its ids, which a damaged plan may
    /// give as a range of billions).
    pub fn runs(&self, id: usize) -> bool {
        self.nodes.iter().any(|r| r[0] <= id && id < r[1])
    }

    /// How many nodes the stage runs.
    pub fn node_count(&self) -> usize {
        self.nodes.iter().fold(0usize, |n, r| n.saturating_add(r[1].saturating_sub(r[0])))
    }
}

/// The program templates: the schedule lowered with pipeline ranks as peers, plus the
/// gradient-synchronisation epilogue and ZeRO gathers.
fn templates(input: &CodegenInput, stages: &[StageCode], tied: &[TiedWeight]) -> Result<Vec<ProgramTemplate>, EncodeError> {
    let p = input.parallel.pp;
    let actions = compute_actions(input.parallel.schedule, p, input.parallel.microbatches)?;
    let opts = LowerOptions {
        ranks: Vec::new(),
        boundary_bytes: input.stages.iter().map(|s| s.output_bytes).collect(),
        epilogue: Vec::new(),
    };
    let lowered = lower(input.parallel.schedule, &actions, &opts)?;
    // gradients reduce, and ZeRO shards, over the whole data axis: data × context ranks
    let mesh_parallel = input.parallel.over_data_axis();
    let (dp, zero) = (mesh_parallel.dp, mesh_parallel.zero);
    let shard_n = (mesh_parallel.zero_group() < dp).then(|| mesh_parallel.zero_group());
    let gather_group = if shard_n.is_some() { GroupRef::ShardGroup } else { GroupRef::Data };
    let zero3 = mesh_parallel.params_sharded();
    let mut out = Vec::with_capacity(p);
    for (r, prog) in lowered.into_iter().enumerate() {
        let my_stages: Vec<usize> = (0..stages.len()).filter(|&s| input.parallel.schedule.rank_of_stage(s, p) == r).collect();
        let mut steps = Vec::with_capacity(prog.instrs.len() + 4 * my_stages.len());
        let gather = |s: usize| Step::AllGather { group: gather_group, bytes: stages[s].param_bytes, purpose: Purpose::Zero3Params { stage: s } };
        // ZeRO 2 and 3: the gradients of every backward but a stage's last of the step are
        // reduce-scattered into the rank's block as soon as they are complete
        let scatter_each = dp > 1 && (zero >= 2 || shard_n.is_some());
        let (split, last) = last_gradient_instrs(&prog.instrs);
        for (at, i) in prog.instrs.into_iter().enumerate() {
            match i {
                Instr::Forward { stage, .. } | Instr::Backward { stage, .. } if zero3 => steps.push(gather(stage)),
                Instr::OptimizerStep => {
                    epilogue(&mut steps, r, &my_stages, stages, tied, dp, zero, shard_n);
                    continue;
                }
                _ => {}
            }
            let grads_done = gradient_instr_stage(&i, &split);
            // Lowering without global ranks names peers by pipeline rank, as templates do.
            let step = i.map(Ok, |g| Err(EncodeError::Inconsistent(format!("lowering produced a collective over {g:?} before the epilogue"))))?;
            steps.push(step);
            if let Some(s) = grads_done
                && scatter_each
                && stages[s].param_bytes > 0
                && last.get(&s) != Some(&at)
            {
                steps.push(Step::ReduceScatter { group: gather_group, bytes: stages[s].param_bytes, purpose: Purpose::MicrobatchGrads { stage: s } });
            }
        }
        out.push(ProgramTemplate { pp_rank: r, stages: my_stages, steps });
    }
    Ok(out)
}

/// The (stage, microbatch) pairs whose backward is split (a `BackwardWeight` follows), and
/// per stage the position of the instruction that completes its last gradients of the step.
fn last_gradient_instrs<P, G>(instrs: &[Instr<P, G>]) -> (BTreeSet<(usize, usize)>, BTreeMap<usize, usize>) {
    let split: BTreeSet<(usize, usize)> = instrs
        .iter()
        .filter_map(|i| match *i {
            Instr::BackwardWeight { stage, mb } => Some((stage, mb)),
            _ => None,
        })
        .collect();
    let mut last = BTreeMap::new();
    for (at, i) in instrs.iter().enumerate() {
        if let Some(s) = gradient_instr_stage(i, &split) {
            last.insert(s, at);
        }
    }
    (split, last)
}

/// The stage whose parameter gradients for a microbatch instruction `i` completes: a
/// `BackwardWeight`, or a `Backward` not split.
fn gradient_instr_stage<P, G>(i: &Instr<P, G>, split: &BTreeSet<(usize, usize)>) -> Option<usize> {
    match *i {
        Instr::BackwardWeight { stage, .. } => Some(stage),
        Instr::Backward { stage, mb } if !split.contains(&(stage, mb)) => Some(stage),
        _ => None,
    }
}

#[allow(clippy::too_many_arguments)]
fn epilogue(
    steps: &mut Vec<Step>,
    r: usize,
    my_stages: &[usize],
    stages: &[StageCode],
    tied: &[TiedWeight],
    dp: usize,
    zero: u8,
    shard_n: Option<usize>,
) {
    for (i, t) in tied.iter().enumerate() {
        if t.pp_ranks.contains(&r) {
            steps.push(Step::AllReduce { group: GroupRef::Tied(i), bytes: t.bytes, purpose: Purpose::TiedGrad { weight: t.weight.clone() } });
        }
    }
    let zero3 = dp > 1 && (zero >= 3 || shard_n.is_some());
    for &s in my_stages {
        let bytes = stages[s].param_bytes;
        if dp <= 1 || bytes == 0 {
            continue;
        }
        let purpose = Purpose::DpGrads { stage: s };
        if let Some(n) = shard_n {
            steps.push(Step::ReduceScatter { group: GroupRef::ShardGroup, bytes, purpose: purpose.clone() });
            steps.push(Step::AllReduce { group: GroupRef::ShardPeers, bytes: bytes.div_ceil(n as u64), purpose });
        } else if zero >= 2 {
            steps.push(Step::ReduceScatter { group: GroupRef::Data, bytes, purpose });
        } else {
            steps.push(Step::AllReduce { group: GroupRef::Data, bytes, purpose });
        }
    }
    steps.push(Step::OptimizerStep);
    if dp > 1 && (zero == 1 || zero == 2) && !zero3 {
        for &s in my_stages {
            let bytes = stages[s].param_bytes;
            if bytes > 0 {
                steps.push(Step::AllGather { group: GroupRef::Data, bytes, purpose: Purpose::ZeroParams { stage: s } });
            }
        }
    }
}

impl CodegenSection {
    /// The shard of `layer` on tensor rank `tp_rank` (the whole layer when tp = 1).
    pub fn shard(&self, layer: usize, tp_rank: usize) -> Option<Cow<'_, LayerShard>> {
        if self.tp <= 1 {
            return Some(Cow::Owned(LayerShard::whole(layer)));
        }
        self.shards.get(layer)?.get(tp_rank).map(Cow::Borrowed)
    }

    /// The process group `g` of the rank at `c`, as global ranks.
    pub fn group(&self, mesh: &Mesh, c: Coord, g: GroupRef, sharded_dp: Option<usize>) -> Option<Vec<usize>> {
        let n = sharded_dp.filter(|&n| n > 1 && n < mesh.dp()).unwrap_or(mesh.dp()).max(1);
        let at = |pp: usize, dp: usize, tp: usize| mesh.rank(Coord { pp, dp, tp });
        match g {
            GroupRef::Tensor => (0..mesh.tp()).map(|t| at(c.pp, c.dp, t)).collect(),
            GroupRef::Data => (0..mesh.dp()).map(|d| at(c.pp, d, c.tp)).collect(),
            GroupRef::ShardGroup => {
                let first = c.dp / n * n;
                (first..(first + n).min(mesh.dp())).map(|d| at(c.pp, d, c.tp)).collect()
            }
            GroupRef::ShardPeers => (c.dp % n..mesh.dp()).step_by(n).map(|d| at(c.pp, d, c.tp)).collect(),
            GroupRef::Tied(i) => self.tied_weights.get(i)?.pp_ranks.iter().map(|&p| at(p, c.dp, c.tp)).collect(),
        }
    }

    /// The concrete program of the rank at `c`.
    pub fn program(&self, mesh: &Mesh, c: Coord, sharded_dp: Option<usize>) -> Result<RankProgram, EncodeError> {
        let rank = mesh.rank(c).ok_or_else(|| {
            EncodeError::Inconsistent(format!("pipeline rank {}, replica {}, tensor rank {} is outside the mesh (pp {}, dp {}, tp {})", c.pp, c.dp, c.tp, mesh.pp(), mesh.dp(), mesh.tp()))
        })?;
        let t = self
            .templates
            .iter()
            .find(|t| t.pp_rank == c.pp)
            .ok_or_else(|| EncodeError::Inconsistent(format!("no program template for pipeline rank {}", c.pp)))?;
        let peer = |pp: usize| {
            mesh.rank(Coord { pp, ..c })
                .ok_or_else(|| EncodeError::Inconsistent(format!("rank {rank}: pipeline rank {pp} is outside the mesh (pp = {})", mesh.pp())))
        };
        let group = |g: GroupRef| {
            self.group(mesh, c, g, sharded_dp)
                .ok_or_else(|| EncodeError::Inconsistent(format!("rank {rank}: group {g:?} does not resolve in the mesh")))
        };
        let instrs = t.steps.iter().map(|s| s.clone().map(&peer, &group)).collect::<Result<Vec<_>, _>>()?;
        Ok(RankProgram { rank, instrs })
    }

    /// What global rank `rank` runs: its coordinates, stages with their shards, and program.
    pub fn rank_view<'a>(&'a self, mesh: &Mesh, rank: usize, sharded_dp: Option<usize>) -> Result<RankView<'a>, EncodeError> {
        let coord = mesh.coord(rank).ok_or(EncodeError::NoRank { rank, world: mesh.all_ranks().len() })?;
        let program = self.program(mesh, coord, sharded_dp)?;
        let stage_ids = self.templates.iter().find(|t| t.pp_rank == coord.pp).map(|t| t.stages.clone()).unwrap_or_default();
        let mut stages = Vec::with_capacity(stage_ids.len());
        for s in stage_ids {
            let code = self.stages.get(s).ok_or_else(|| EncodeError::Inconsistent(format!("template of pipeline rank {} names stage {s}", coord.pp)))?;
            let shards = (code.layers[0]..=code.layers[1])
                .map(|l| {
                    self.shard(l, coord.tp)
                        .ok_or_else(|| EncodeError::Inconsistent(format!("no shard for layer {l}, tensor rank {}", coord.tp)))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let inputs_from_previous = s.checked_sub(1).and_then(|p| self.stages.get(p)).map_or(&[][..], |p| &p.outputs_to_next[..]);
            stages.push(StageView { code, inputs_from_previous, shards });
        }
        let tied = self
            .tied_weights
            .iter()
            .enumerate()
            .filter(|(_, t)| t.pp_ranks.contains(&coord.pp))
            .filter_map(|(i, t)| Some((t.weight.as_str(), self.group(mesh, coord, GroupRef::Tied(i), sharded_dp)?)))
            .collect();
        Ok(RankView {
            rank,
            coord,
            tensor_group: self.group(mesh, coord, GroupRef::Tensor, sharded_dp).unwrap_or_default(),
            data_group: self.group(mesh, coord, GroupRef::Data, sharded_dp).unwrap_or_default(),
            stages,
            tied,
            program,
        })
    }

    /// The programs of every rank of the mesh.
    pub fn all_programs(&self, mesh: &Mesh, sharded_dp: Option<usize>) -> Result<Vec<RankProgram>, EncodeError> {
        let mut out = Vec::new();
        for pp in 0..mesh.pp() {
            for dp in 0..mesh.dp() {
                for tp in 0..mesh.tp() {
                    out.push(self.program(mesh, Coord { pp, dp, tp }, sharded_dp)?);
                }
            }
        }
        Ok(out)
    }
}

/// Everything one global rank executes, for the runner.
#[derive(Clone, Debug)]
pub struct RankView<'a> {
    /// Global rank.
    pub rank: usize,
    /// Its mesh coordinates.
    pub coord: Coord,
    /// Its tensor-parallel group (global ranks, tensor-rank order): the group of the shards'
    /// inserted collectives.
    pub tensor_group: Vec<usize>,
    /// Its data-parallel group (global ranks, replica order).
    pub data_group: Vec<usize>,
    /// The stages it runs, in order.
    pub stages: Vec<StageView<'a>>,
    /// Tied weights it holds, with the group its gradient is all-reduced over.
    pub tied: Vec<(&'a str, Vec<usize>)>,
    /// The program.
    pub program: RankProgram,
}

/// One stage as a rank runs it.
#[derive(Clone, Debug)]
pub struct StageView<'a> {
    /// The stage's boundary, recompute points and parameters.
    pub code: &'a StageCode,
    /// Tensors received from the previous stage per microbatch (in this order).
    pub inputs_from_previous: &'a [String],
    /// The rank's shard of each of the stage's layers, first layer first.
    pub shards: Vec<Cow<'a, LayerShard>>,
}

impl StageView<'_> {
    /// Stage index.
    pub fn stage(&self) -> usize {
        self.code.stage
    }

    /// The subgraph this rank runs for the stage: its layers with their shards applied
    /// (weights sliced, constants rewritten, collectives inserted), shape-inferred. Its inputs
    /// are `inputs_from_previous`, `data_inputs` and integer shape values; its outputs include
    /// `outputs_to_next`.
    pub fn subgraph(&self, lg: &LayeredGraph) -> Result<Graph, CodegenError> {
        let [first, last] = self.code.layers;
        let mut nodes = Vec::new();
        for l in first..=last {
            let layer = lg.layers.get(l).ok_or(CodegenError::NoLayer { layer: l, layers: lg.layers.len() })?;
            nodes.extend_from_slice(&layer.nodes);
        }
        apply_shard(&lg.graph, &nodes, &self.merged_shard(), &lg.dims)
    }

    /// The rank's shards of the stage's layers as one shard of the whole stage.
    pub fn merged_shard(&self) -> LayerShard {
        let mut merged = LayerShard::whole(self.code.layers[0]);
        for s in &self.shards {
            merged.tp = s.tp;
            merged.rank = s.rank;
            for w in &s.weight_slices {
                if !merged.weight_slices.contains(w) {
                    merged.weight_slices.push(w.clone());
                }
            }
            merged.constant_rewrites.extend(s.constant_rewrites.iter().cloned());
            merged.rewrites.extend(s.rewrites.iter().cloned());
            merged.collectives.extend(s.collectives.iter().cloned());
            merged.partial_gradients.extend(s.partial_gradients.iter().cloned());
        }
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranks numbered as the DPT placement does: d·(pp·tp) + p·tp + t.
    fn mesh(pp: usize, tp: usize, dp: usize) -> Mesh {
        let m = Mesh::numbered(AxisOrder::CLUSTER, pp, tp, dp);
        let by_hand: Vec<Vec<Vec<usize>>> = (0..pp).map(|p| (0..dp).map(|d| (0..tp).map(|t| d * pp * tp + p * tp + t).collect()).collect()).collect();
        assert_eq!(m.ranks, by_hand);
        m
    }

    #[test]
    fn groups_resolve_by_mesh_coordinates() {
        let m = mesh(2, 2, 4);
        let section = CodegenSection {
            version: CODEGEN_VERSION,
            tp: 2,
            shards: Vec::new(),
            weight_dims: BTreeMap::new(),
            stages: Vec::new(),
            tied_weights: vec![TiedWeight { weight: "wte".into(), stages: vec![0, 1], pp_ranks: vec![0, 1], bytes: 4 }],
            templates: Vec::new(),
            batch: None,
            fused: Vec::new(),
        };
        let c = Coord { pp: 1, dp: 3, tp: 1 };
        let rank = |pp: usize, dp: usize, tp: usize| dp * 4 + pp * 2 + tp;
        assert_eq!(m.rank(c), Some(rank(1, 3, 1)));
        assert_eq!(m.coord(rank(1, 3, 1)), Some(c));
        let g = |r| section.group(&m, c, r, Some(2)).unwrap();
        assert_eq!(g(GroupRef::Tensor), vec![rank(1, 3, 0), rank(1, 3, 1)]);
        assert_eq!(g(GroupRef::Data), (0..4).map(|d| rank(1, d, 1)).collect::<Vec<_>>());
        assert_eq!(g(GroupRef::ShardGroup), vec![rank(1, 2, 1), rank(1, 3, 1)]);
        assert_eq!(g(GroupRef::ShardPeers), vec![rank(1, 1, 1), rank(1, 3, 1)]);
        assert_eq!(g(GroupRef::Tied(0)), vec![rank(0, 3, 1), rank(1, 3, 1)]);
        assert!(section.group(&m, c, GroupRef::Tied(1), None).is_none());
    }
}
