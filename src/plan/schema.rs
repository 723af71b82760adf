//! The plan file: the versioned on-disk contract between `smp-partition`, `inspect`, the
//! simulator and `smp-runner`. Fields are described in docs/plan-format.md.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::cost::{LinkKind, MachineFacts};

use super::request::PlanRequest;
use crate::codegen::encode::{CodegenInput, CodegenSection, Mesh, RankView, StageInput};
use crate::codegen::EncodeError;
use crate::ir::{ScheduleKind, SelectivePolicy};
use crate::ir::{CheckpointRule, OffloadRule, Parallelism, Placement as AxisOrder, Precision};
use crate::solve::{Baseline, SolveStatus};
use crate::split::Strategy;

/// The plan format version this build writes and reads.
///
/// Version 2 added `parallel.precision` (the training precision the plan was priced for and
/// the runner executes); version 3 `parallel.offload_activations`,
/// `parallel.activation_loading_horizon` and each stage's `offloaded_layers` and
/// `offloaded_bytes`; version 4 `parallel.cp` and `parallel.ep` (context- and
/// expert-parallel degrees). Older plans are refused with the re-plan message.
pub const PLAN_VERSION: u32 = 4;

/// A partitioned execution plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Format version ([`PLAN_VERSION`]).
    pub version: u32,
    /// The model the plan is for.
    pub model: ModelInfo,
    /// The cluster it was planned on.
    pub cluster: ClusterInfo,
    /// The parallel configuration chosen.
    #[serde(with = "parallel_file")]
    pub parallel: Parallelism,
    /// Pipeline stages in execution order (one entry per virtual stage when interleaved).
    pub stages: Vec<Stage>,
    /// The tensor-split strategy chosen for each layer's nodes.
    #[serde(default)]
    pub layer_strategies: Vec<LayerStrategy>,
    /// Communication volume per step, per kind of traffic and link.
    #[serde(default)]
    pub communication: Vec<CommVolume>,
    /// What the cost model predicts for one training step.
    pub predicted: Predicted,
    /// How the solver reached the plan, and its proof.
    pub solver: SolverInfo,
    /// Samples per optimizer step, over all data-parallel replicas.
    pub global_batch: u64,
    /// Sequence length the plan was made for, when the model has one.
    #[serde(default)]
    pub seq_len: Option<u64>,
    /// Other symbolic dims bound when planning (`--dim NAME=V`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dims: BTreeMap<String, i64>,
    /// `--trainable` patterns the plan was made with: initializers the rules would freeze that
    /// are trained (the runner trains by the plan's patterns).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trainable: Vec<String>,
    /// `--frozen` patterns the plan was made with: initializers never trained.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen: Vec<String>,
    /// The nodes that train on statistics of the samples they are given (BatchNormalization)
    /// and how many samples that is; absent for models without them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_statistics: Option<BatchStatistics>,
    /// What each rank executes: shards, boundary tensors, program templates (absent in plans
    /// written before codegen; see docs/plan-format.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codegen: Option<CodegenSection>,
    /// Why the planner chose the context- and expert-parallel degrees (absent in plans written
    /// before they were searched).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axes: Option<AxesInfo>,
    /// What the plan was asked for: the planner's options and the cluster as named, so it can
    /// be made again for another device count (absent in plans written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<PlanRequest>,
}

/// What the context and expert axes cost and save in the chosen plan (busiest pipeline rank,
/// per step), and the least step-time bound of the other degrees searched.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AxesInfo {
    /// Peak activation bytes per rank.
    pub activation_bytes: u64,
    /// K/V ring transfers per step (forward and backward), seconds.
    pub kv_transfer_s: f64,
    /// The part of them attention compute does not hide, seconds.
    pub kv_exposed_s: f64,
    /// Dispatch and combine all-to-alls per step, seconds.
    pub all_to_all_s: f64,
    /// The part of them run beside another microbatch's compute (combined 1F1B), seconds.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub all_to_all_hidden_s: f64,
    /// The busiest expert rank's extra compute per step, seconds.
    pub imbalance_s: f64,
    /// Model-state bytes of the pipeline rank holding the most.
    pub state_bytes: u64,
    /// That rank's model-state bytes in the same plan at expert degree 1.
    pub state_bytes_without_ep: u64,
    /// One sample's checkpointed activations (its layers' inputs) over the whole model: above
    /// half a device, context degrees up to what memory needs are searched.
    pub sample_input_bytes: u64,
    /// Per context degree searched: `[degree, least bound in seconds or null when nothing fits]`.
    pub cp_searched: Vec<(usize, Option<f64>)>,
    /// Per expert degree searched, the same.
    pub ep_searched: Vec<(usize, Option<f64>)>,
}

/// Nodes whose training result for a sample depends on the samples beside it
/// ([`crate::ir::OpKind::mixes_samples`]: BatchNormalization's batch statistics). Each
/// forward pass sees one microbatch of one data-parallel replica, so the statistics are over
/// `samples` = global batch / (dp · microbatches), not over the whole batch one PyTorch
/// forward sees (PyTorch's pipelines and DDP without SyncBatchNorm do the same).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchStatistics {
    /// The nodes, by name, in graph order.
    pub nodes: Vec<String>,
    /// Samples each forward pass computes their statistics over.
    pub samples: u64,
}

impl BatchStatistics {
    /// The nodes of `graph` that mix samples, run on microbatches of `samples`; `None` if it
    /// has none.
    pub fn of(graph: &crate::ir::Graph, samples: u64) -> Option<BatchStatistics> {
        let order = graph.topo_order().unwrap_or_else(|_| graph.node_ids().collect());
        let nodes: Vec<String> = order
            .into_iter()
            .filter(|&n| graph.node(n).op.kind().is_some_and(crate::ir::OpKind::mixes_samples))
            .map(|n| graph.node(n).name.clone())
            .collect();
        (!nodes.is_empty()).then_some(BatchStatistics { nodes, samples })
    }

    /// The warning for a run of `global_batch` samples per step in `dp` replicas of
    /// `microbatches` each, when the statistics are not over the whole batch; `how` says how to
    /// get whole-batch statistics.
    pub fn warning(&self, global_batch: u64, dp: usize, microbatches: usize, how: &str) -> Option<String> {
        if self.samples >= global_batch {
            return None;
        }
        const SHOWN: usize = 3;
        let mut names: Vec<String> = self.nodes.iter().take(SHOWN).map(|n| format!("`{n}`")).collect();
        if self.nodes.len() > SHOWN {
            names.push(format!("and {} more", self.nodes.len() - SHOWN));
        }
        let split = match (dp, microbatches) {
            (1, m) => format!("{m} microbatches"),
            (d, 1) => format!("{d} data-parallel replicas"),
            (d, m) => format!("{d} data-parallel replicas × {m} microbatches"),
        };
        Some(format!(
            "BatchNorm statistics are per microbatch: {} BatchNormalization node(s) ({}) normalise each microbatch of {} samples by its own mean and variance (global batch {global_batch} = {split} of {}), not the whole batch of {global_batch} one PyTorch forward sees, so training differs from it from the first step; {how}",
            self.nodes.len(),
            names.join(", "),
            self.samples,
            self.samples,
        ))
    }
}

/// The model a plan partitions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    /// Path of the ONNX file as given when planning.
    pub path: String,
    /// SHA-256 of the ONNX file (hex), to catch a plan used with another model.
    pub sha256: String,
    /// Elements of floating-point initializers, each counted once.
    pub params: u64,
    /// Number of layers (`graph`'s layers, 0 first).
    pub layers: usize,
}

/// The cluster a plan targets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterInfo {
    /// Preset name (`h100-80gb`) or the cluster file's path.
    pub preset: String,
    /// Devices in all.
    pub devices: usize,
    /// Devices that share the fast intra-node link.
    pub devices_per_node: usize,
    /// Memory a device may use, after `--memory-limit` (bytes).
    pub memory_limit_bytes: u64,
    /// For `cpu` plans, the machine they assumed: its memory, cores and calibration file (with
    /// its hash), and whether these were read from the host or stated in a cluster file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<MachineFacts>,
}

/// The plan file's spelling of the parallel configuration ([`Parallelism`]): the schedule,
/// checkpointing policy and placement are typed in the IR and spelt as strings in the file
/// (`"schedule": "interleaved", "virtual_stages": 2`, `"checkpointing": "auto"`,
/// `"placement": "DPT"`, `"precision": "bf16-mixed"`, `"offload_activations": "auto"`), parsed
/// once when the plan is read.
mod parallel_file {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{AxisOrder, CheckpointRule, OffloadRule, Parallelism, Precision, ScheduleKind, SelectivePolicy, is_false};

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct ParallelFile {
        pp: usize,
        tp: usize,
        dp: usize,
        cp: usize,
        ep: usize,
        /// The expert-tensor degree where it differs from `tp` (folded expert groups).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        etp: Option<usize>,
        zero: u8,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sharded_dp: Option<usize>,
        microbatches: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        active_microbatches: Option<usize>,
        schedule: String,
        virtual_stages: usize,
        checkpointing: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        selective_policy: Option<String>,
        placement: String,
        #[serde(default, skip_serializing_if = "is_false")]
        sequence_parallel: bool,
        precision: String,
        offload_activations: String,
        activation_loading_horizon: usize,
        #[serde(default, skip_serializing_if = "is_false")]
        fp32_main_grads: bool,
        #[serde(default, skip_serializing_if = "is_false")]
        expert_comm_overlap: bool,
        #[serde(default, skip_serializing_if = "is_false")]
        grad_sync_overlap: bool,
        #[serde(default, skip_serializing_if = "is_false")]
        float8_linears: bool,
    }

    pub fn serialize<S: Serializer>(p: &Parallelism, s: S) -> Result<S::Ok, S::Error> {
        ParallelFile {
            pp: p.pp,
            tp: p.tp,
            dp: p.dp,
            cp: p.cp,
            ep: p.ep,
            etp: p.experts_folded().then_some(p.etp),
            zero: p.zero,
            sharded_dp: p.sharded_dp,
            microbatches: p.microbatches,
            active_microbatches: p.active_microbatches,
            schedule: p.schedule.name().to_string(),
            virtual_stages: p.schedule.virtual_stages(),
            checkpointing: p.checkpointing.name().to_string(),
            selective_policy: (p.selective_policy != SelectivePolicy::default()).then(|| p.selective_policy.name().to_string()),
            placement: p.placement.to_string(),
            sequence_parallel: p.sequence_parallel,
            precision: p.precision.name().to_string(),
            offload_activations: p.offload.name().to_string(),
            activation_loading_horizon: p.loading_horizon,
            fp32_main_grads: p.fp32_main_grads,
            expert_comm_overlap: p.expert_overlap,
            grad_sync_overlap: p.grad_overlap,
            float8_linears: p.float8_linears,
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Parallelism, D::Error> {
        let f = ParallelFile::deserialize(d)?;
        let bad = serde::de::Error::custom;
        let schedule = ScheduleKind::from_parts(&f.schedule, f.virtual_stages)
            .map_err(|e| bad(format!("parallel.schedule `{}` with virtual_stages {}: {e}", f.schedule, f.virtual_stages)))?;
        let checkpointing = f.checkpointing.parse::<CheckpointRule>().map_err(|e| bad(format!("parallel.checkpointing {e}")))?;
        let selective_policy = match &f.selective_policy {
            Some(text) => text.parse::<SelectivePolicy>().map_err(|e| bad(format!("parallel.selective_policy {e}")))?,
            None => SelectivePolicy::default(),
        };
        let placement = f.placement.parse::<AxisOrder>().map_err(|e| bad(format!("parallel.placement {e}")))?;
        let precision = f.precision.parse::<Precision>().map_err(|e| bad(format!("parallel.precision {e}")))?;
        let offload =
            f.offload_activations.parse::<OffloadRule>().map_err(|e| bad(format!("parallel.offload_activations {e}")))?;
        if f.activation_loading_horizon == 0 {
            return Err(bad("parallel.activation_loading_horizon must be at least 1".to_string()));
        }
        Ok(Parallelism {
            pp: f.pp,
            tp: f.tp,
            dp: f.dp,
            cp: f.cp,
            ep: f.ep,
            etp: f.etp.unwrap_or(f.tp),
            zero: f.zero,
            sharded_dp: f.sharded_dp,
            microbatches: f.microbatches,
            active_microbatches: f.active_microbatches,
            schedule,
            checkpointing,
            selective_policy,
            placement,
            sequence_parallel: f.sequence_parallel,
            precision,
            offload,
            loading_horizon: f.activation_loading_horizon,
            fp32_main_grads: f.fp32_main_grads,
            expert_overlap: f.expert_comm_overlap,
            grad_overlap: f.grad_sync_overlap,
            float8_linears: f.float8_linears,
        })
    }
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One pipeline stage (or virtual stage).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// Position in the pipeline's layer order (0 first).
    pub index: usize,
    /// The pipeline rank that runs it (differs from `index` when interleaved).
    pub pp_rank: usize,
    /// First and last layer, inclusive.
    pub layers: [usize; 2],
    /// Global ranks running this stage (tp · dp of them).
    pub ranks: Vec<usize>,
    /// Tensor-parallel degree of the stage.
    pub tp: usize,
    /// Data-parallel degree of the stage.
    pub dp: usize,
    /// Forward time of one microbatch (seconds).
    pub forward_s: f64,
    /// Backward time of one microbatch, recompute included (seconds).
    pub backward_s: f64,
    /// Communication time per microbatch not hidden behind compute (seconds).
    #[serde(default)]
    pub comm_s: f64,
    /// Bytes per microbatch sent to the next stage (its gradient comes back); 0 for the last.
    #[serde(default)]
    pub output_bytes: u64,
    /// Peak memory per device of this stage.
    pub memory_bytes: StageMemory,
    /// Layers whose activations are recomputed in the backward pass.
    #[serde(default)]
    pub checkpointed_layers: Vec<usize>,
    /// Layers that rebuild only their normalisations' and activation functions' outputs in
    /// the backward instead of keeping them (selective recompute).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub selective_layers: Vec<usize>,
    /// Checkpointed layers whose kept inputs wait in host memory between their forward and
    /// backward (activation offloading).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub offloaded_layers: Vec<usize>,
    /// Activation bytes per device held in host memory instead of device memory at the
    /// stage's peak (not part of `memory_bytes`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offloaded_bytes: u64,
}

fn is_zero(b: &u64) -> bool {
    *b == 0
}

/// Memory per device of one stage, split by kind (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageMemory {
    /// Weights.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Saved activations of the microbatches in flight.
    pub activations: u64,
    /// The largest recompute working set of the stage's checkpointed layers: activations
    /// rebuilt inside a backward and freed after it (0 without checkpointing; absent in plans
    /// written before it was its own part, whose `activations` include it).
    #[serde(default)]
    pub recompute: u64,
    /// The training loss's copies at its backward on the stage computing it: the
    /// log-probabilities of the microbatch at the loss and the gradients of them and of the
    /// logits (the other microbatches' log-probabilities are in `activations`). A transient,
    /// never at once with a rebuild (0 elsewhere; absent in plans written before it was priced).
    #[serde(default)]
    pub loss: u64,
    /// Workspace margin.
    #[serde(default)]
    pub workspace: u64,
    /// Sum of the above, the larger of `recompute` and `loss` counted (two transients at
    /// different moments).
    pub total: u64,
}

impl StageMemory {
    /// The sum of the parts (what `total` must equal), the larger of the two transients
    /// counted, saturating at `u64::MAX`.
    pub fn sum_of_parts(&self) -> u64 {
        [self.grads, self.optimizer, self.activations, self.recompute.max(self.loss), self.workspace].iter().fold(self.params, |a, &b| a.saturating_add(b))
    }
}

/// The split chosen for each node of one layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerStrategy {
    /// Layer index.
    pub layer: usize,
    /// Layer name (`h.3`).
    pub name: String,
    /// Name of the layer's strategy assignment (`megatron`, `replicate`, ...).
    pub strategy: String,
    /// Strategy per node, in the layer's node order: `[node, strategy]`.
    pub nodes: Vec<(String, Strategy)>,
    /// The layer's attention cores and mixtures of experts and how this plan runs each (what
    /// `inspect` names per layer); absent when it has none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<LayerPart>,
}

/// An attention core or a mixture of experts of a layer, and how the plan runs it. The plan
/// file spells it `{"attention": {"form": "latent", "heads": 128, "split": 8}}`,
/// `{"attention": {"form": "grouped_query", "heads": 64, "kv_heads": 8, "split": 1, "whole_because": "…"}}` or
/// `{"experts": {"routed": 256, "top_k": 8, "shared": 1, "ep": 8, "split": 1}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum LayerPart {
    /// An attention core.
    Attention {
        /// What it is.
        form: AttentionKind,
        /// Query heads, where known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        heads: Option<i64>,
        /// Key and value heads of grouped-query attention.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kv_heads: Option<i64>,
        /// Ways its heads are split over the tensor ranks (1: whole).
        split: usize,
        /// Why it is whole on every tensor rank, when it is.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        whole_because: Option<String>,
    },
    /// A mixture of experts.
    Experts {
        /// Routed experts.
        routed: usize,
        /// Experts each token is routed to, where known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        top_k: Option<i64>,
        /// Shared experts beside the routed ones.
        #[serde(default)]
        shared: i64,
        /// Ranks its routed experts are spread over (expert parallelism).
        ep: usize,
        /// Ways each expert's MLP is split by its intermediate dim over the tensor ranks (the
        /// expert-tensor degree).
        split: usize,
        /// The expert group folds over tensor × data ranks (expert-tensor degree below the
        /// tensor degree): each tensor rank routes its own tokens.
        #[serde(default, skip_serializing_if = "is_false")]
        folded: bool,
    },
}

/// The kind of an attention core, as the plan file spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Every head with its own key and value.
    MultiHead,
    /// Groups of query heads sharing a key and value head (`kv_heads` of them).
    GroupedQuery,
    /// Latent attention (DeepSeek's MLA): a shared latent, one rotary key over every head.
    Latent,
}

impl fmt::Display for LayerPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerPart::Attention { form, heads, kv_heads, split, whole_because } => {
                f.write_str("attention: ")?;
                f.write_str(match (form, kv_heads) {
                    (AttentionKind::MultiHead, _) => "multi-head",
                    (AttentionKind::GroupedQuery, Some(1)) => "multi-query",
                    (AttentionKind::GroupedQuery, _) => "grouped-query",
                    (AttentionKind::Latent, _) => "latent (MLA)",
                })?;
                if let Some(h) = heads {
                    write!(f, ", {h} heads")?;
                }
                if let (AttentionKind::GroupedQuery, Some(kv)) = (form, kv_heads)
                    && *kv > 1
                {
                    write!(f, " sharing {kv} KV heads")?;
                }
                match (split, whole_because) {
                    (s, _) if *s > 1 => write!(f, ", split by heads {s} ways"),
                    (_, Some(why)) => write!(f, ", kept whole: {why}"),
                    _ => f.write_str(", whole"),
                }
            }
            LayerPart::Experts { routed, top_k, shared, ep, split, folded } => {
                write!(f, "experts: {routed} routed")?;
                if let Some(k) = top_k {
                    write!(f, " top {k}")?;
                }
                if *shared > 0 {
                    write!(f, " + {shared} shared")?;
                }
                write!(f, ", ep {ep}")?;
                if *folded {
                    write!(f, " folded over tensor × data ranks (expert-tensor {split}, each tensor rank routing its own tokens)")?;
                } else if *split > 1 {
                    write!(f, ", each expert split {split} ways by its intermediate dim")?;
                }
                Ok(())
            }
        }
    }
}

/// What a traffic entry of the plan carries (spelled `tensor`, `pipeline`, `data`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Traffic {
    /// Tensor-parallel collectives.
    Tensor,
    /// Sends between pipeline stages.
    Pipeline,
    /// Data-parallel gradient synchronisation.
    Data,
}

impl fmt::Display for Traffic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Traffic::Tensor => "tensor",
            Traffic::Pipeline => "pipeline",
            Traffic::Data => "data",
        })
    }
}

/// Bytes moved per step by one kind of traffic over one kind of link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommVolume {
    /// What the traffic is for.
    pub kind: Traffic,
    /// The link it crosses.
    pub link: LinkKind,
    /// Bytes per device per step.
    pub bytes: f64,
    /// Time per step spent on it, hidden or not (seconds).
    pub time_s: f64,
}

/// The cost model's prediction for one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Predicted {
    /// Seconds per optimizer step.
    pub step_time_s: f64,
    /// Samples per second (global batch over step time).
    pub samples_per_s: f64,
    /// Pipeline idle time over ideal compute time ((p−1)/m for 1F1B on equal stages).
    pub bubble_ratio: f64,
    /// Largest memory of any device (bytes).
    pub peak_memory_bytes: u64,
    /// Model FLOPs utilisation (training FLOPs = 3 × forward, over peak rate).
    pub mfu: f64,
    /// Hardware FLOPs utilisation: the model FLOPs plus the recomputed forward passes
    /// (Megatron-LM's equation 3 counts this way). Absent in older plan files (read as 0).
    #[serde(default)]
    pub hfu: f64,
}

/// The solver's account: status and proof.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SolverInfo {
    /// `optimal` (proven), `feasible` (time limit hit; see gap), `fixed` (all given by hand),
    /// or `baseline:NAME`.
    pub status: PlanStatus,
    /// Objective value of the plan (predicted step time, seconds).
    pub objective: f64,
    /// Best proven lower bound on the objective.
    pub bound: f64,
    /// Relative gap (objective − bound) / objective.
    pub gap: f64,
    /// Wall time of planning (seconds).
    pub wall_s: f64,
    /// Candidate configurations solved and skipped by bound.
    pub candidates: Candidates,
}

/// How the plan was reached (file: `optimal`, `feasible`, `fixed` or `baseline:NAME`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PlanStatus {
    /// The solver's own status (`optimal`, or `feasible` when the time limit struck).
    Solved(SolveStatus),
    /// Every setting was given by hand.
    Fixed,
    /// Planned as a peer would (`--baseline NAME`).
    Baseline(Baseline),
}

impl fmt::Display for PlanStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanStatus::Solved(s) => f.write_str(s.name()),
            PlanStatus::Fixed => f.write_str("fixed"),
            PlanStatus::Baseline(b) => write!(f, "baseline:{b}"),
        }
    }
}

impl FromStr for PlanStatus {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "fixed" {
            return Ok(PlanStatus::Fixed);
        }
        if let Some(b) = s.strip_prefix("baseline:") {
            return b.parse().map(PlanStatus::Baseline).map_err(|e| format!("solver.status: {e}"));
        }
        [SolveStatus::Optimal, SolveStatus::Feasible, SolveStatus::Infeasible, SolveStatus::TimeLimit]
            .into_iter()
            .find(|k| k.name() == s)
            .map(PlanStatus::Solved)
            .ok_or_else(|| format!("solver.status `{s}`: expected optimal, feasible, fixed or baseline:NAME"))
    }
}

impl TryFrom<String> for PlanStatus {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<PlanStatus> for String {
    fn from(s: PlanStatus) -> String {
        s.to_string()
    }
}

/// Outer-search bookkeeping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Candidates {
    /// Candidates whose ILP was solved.
    pub solved: u64,
    /// Candidates skipped because their lower bound could not beat the incumbent.
    pub skipped: u64,
}

impl Plan {
    /// Stages run by one pipeline rank, in order.
    pub fn stages_of_rank(&self, pp_rank: usize) -> impl Iterator<Item = &Stage> {
        self.stages.iter().filter(move |s| s.pp_rank == pp_rank)
    }

    /// Memory per device of a pipeline rank: the sum of its (virtual) stages (saturating).
    pub fn rank_memory(&self, pp_rank: usize) -> StageMemory {
        let mut m = StageMemory::default();
        for s in self.stages_of_rank(pp_rank) {
            let b = s.memory_bytes;
            m.params = m.params.saturating_add(b.params);
            m.grads = m.grads.saturating_add(b.grads);
            m.optimizer = m.optimizer.saturating_add(b.optimizer);
            m.activations = m.activations.saturating_add(b.activations);
            m.recompute = m.recompute.saturating_add(b.recompute);
            m.loss = m.loss.saturating_add(b.loss);
            m.workspace = m.workspace.saturating_add(b.workspace);
            m.total = m.total.saturating_add(b.total);
        }
        m
    }

    /// The warning when the plan's BatchNorm statistics are not over the whole batch
    /// ([`BatchStatistics::warning`]).
    pub fn batch_statistics_warning(&self) -> Option<String> {
        let p = &self.parallel;
        let flags: Vec<&str> = [(p.microbatches > 1, "--microbatches 1"), (p.dp > 1, "--dp 1")].into_iter().filter_map(|(on, f)| on.then_some(f)).collect();
        let how = format!("re-plan with `{}` for whole-batch statistics", flags.join(" "));
        self.batch_statistics.as_ref()?.warning(self.global_batch, p.dp, p.microbatches, &how)
    }
}

impl Plan {
    /// The model file this plan was made for, located from `plan_file` (the plan's own path):
    /// the recorded path where it exists or is absolute, else that path in the plan's folder
    /// when the model is there (a plan moved with its model). The one rule for every reader.
    pub fn model_file(&self, plan_file: &Path) -> PathBuf {
        let recorded = PathBuf::from(&self.model.path);
        if recorded.exists() || recorded.is_absolute() {
            return recorded;
        }
        plan_file.parent().map(|d| d.join(&recorded)).filter(|m| m.exists()).unwrap_or(recorded)
    }

    /// What codegen needs of this plan.
    pub fn codegen_input(&self) -> Result<CodegenInput, EncodeError> {
        let p = &self.parallel;
        Ok(CodegenInput {
            parallel: *p,
            stages: self
                .stages
                .iter()
                .map(|s| StageInput { layers: s.layers, checkpointed_layers: s.checkpointed_layers.clone(), selective_layers: s.selective_layers.clone(), output_bytes: s.output_bytes })
                .collect(),
            replicated_layers: self.layer_strategies.iter().filter(|s| s.strategy == "replicate").map(|s| s.layer).collect(),
            node_strategies: {
                let n = self.layer_strategies.iter().map(|s| s.layer + 1).max().unwrap_or(0);
                let mut v = vec![Vec::new(); n];
                for s in &self.layer_strategies {
                    v[s.layer] = s.nodes.clone();
                }
                v
            },
            microbatch_size: Some((self.global_batch / (p.dp.max(1) * p.microbatches.max(1)) as u64) as i64),
        })
    }

    /// Global ranks by mesh coordinates: `ranks[pp][dp][tp_rank]`, from the first stage
    /// of each pipeline rank (the placement's axis order is already applied there).
    pub fn mesh(&self) -> Mesh {
        let p = &self.parallel;
        let ranks = (0..p.pp).map(|r| self.stages_of_rank(r).next().map(|s| s.ranks.clone()).unwrap_or_default()).collect();
        Mesh::from_rows(ranks, p.tp)
    }

    /// What global rank `rank` executes: its stages with their layer shards, boundary tensors,
    /// recompute points and its concrete program. The runner's entry point.
    pub fn rank_view(&self, rank: usize) -> Result<RankView<'_>, EncodeError> {
        let section = self
            .codegen
            .as_ref()
            .ok_or_else(|| EncodeError::Inconsistent("the plan has no codegen section; re-plan it with this smp-partition".into()))?;
        section.rank_view(&self.mesh(), rank, self.parallel.sharded_dp)
    }
}
