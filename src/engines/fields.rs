//! What the engines share: their names, the plan fields an engine configuration carries, the
//! line that says what an engine cannot express ([`Gap`]) with the typed change that gives the
//! nearest configuration it can run ([`Change`]), and the planner's request that reproduces a
//! plan exactly ([`exact_request`]), which the engines' nearest requests start from.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use crate::ir::{OffloadRule, Placement, Precision, ScheduleKind};
use crate::passes::params::ParamOptions;
use crate::plan::Plan;
use crate::solve::{Layout, PlanOptions};

/// A training engine whose configuration a plan is written to and read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Engine {
    /// Megatron-LM's `pretrain_gpt.py` (Megatron-Core): its argument list.
    Megatron,
    /// torchtitan: a job TOML of its configuration sections, and its command line.
    Torchtitan,
    /// DeepSpeed: `ds_config.json`, the pipeline module and the launcher line.
    DeepSpeed,
    /// SageMaker model parallelism: SMP v2's `smp.init` configuration, or SMP v1's
    /// `smdistributed.modelparallel` parameters for pipelined plans.
    Smp,
}

impl Engine {
    /// Every engine, in the order the CLI lists them.
    pub const ALL: [Engine; 4] = [Engine::Megatron, Engine::Torchtitan, Engine::DeepSpeed, Engine::Smp];

    /// The name the CLI uses: `megatron`, `torchtitan`, `deepspeed`, `smp`.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Megatron => "megatron",
            Engine::Torchtitan => "torchtitan",
            Engine::DeepSpeed => "deepspeed",
            Engine::Smp => "smp",
        }
    }

    /// The engine as its users call it.
    pub fn title(self) -> &'static str {
        match self {
            Engine::Megatron => "Megatron-LM",
            Engine::Torchtitan => "torchtitan",
            Engine::DeepSpeed => "DeepSpeed",
            Engine::Smp => "SMP",
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.title())
    }
}

impl FromStr for Engine {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Engine::ALL.into_iter().find(|e| e.name() == s).ok_or_else(|| format!("`{s}`: expected megatron, torchtitan, deepspeed or smp"))
    }
}

/// A field of a plan that an engine configuration carries, or cannot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PlanField {
    /// `parallel.pp`.
    Pipeline,
    /// `parallel.schedule` and `virtual_stages`.
    Schedule,
    /// The stages' `layers`: where the pipeline is cut.
    Cuts,
    /// `parallel.tp`.
    Tensor,
    /// `layer_strategies`: how each layer is split over the tensor ranks.
    TensorSplit,
    /// `parallel.sequence_parallel`.
    SequenceParallel,
    /// `parallel.cp`.
    Context,
    /// `parallel.ep`.
    Expert,
    /// `parallel.dp`.
    Data,
    /// `parallel.zero`.
    Zero,
    /// `parallel.sharded_dp`.
    ShardedData,
    /// `global_batch`, `parallel.microbatches`.
    Batch,
    /// The stages' `checkpointed_layers`.
    Recompute,
    /// The stages' `offloaded_layers`.
    Offload,
    /// `parallel.activation_loading_horizon`.
    LoadingHorizon,
    /// `parallel.precision`.
    Precision,
    /// `parallel.placement`.
    Placement,
    /// `parallel.active_microbatches`.
    InFlight,
    /// `parallel.expert_comm_overlap`.
    ExpertOverlap,
    /// `parallel.grad_sync_overlap`.
    GradOverlap,
    /// `parallel.float8_linears`.
    Float8,
}

impl PlanField {
    /// Every field, in the order of docs/engines.md's tables.
    pub const ALL: [PlanField; 21] = [
        PlanField::Pipeline,
        PlanField::Schedule,
        PlanField::Cuts,
        PlanField::Tensor,
        PlanField::TensorSplit,
        PlanField::SequenceParallel,
        PlanField::Context,
        PlanField::Expert,
        PlanField::Data,
        PlanField::Zero,
        PlanField::ShardedData,
        PlanField::Batch,
        PlanField::Recompute,
        PlanField::Offload,
        PlanField::LoadingHorizon,
        PlanField::Precision,
        PlanField::Placement,
        PlanField::InFlight,
        PlanField::ExpertOverlap,
        PlanField::GradOverlap,
        PlanField::Float8,
    ];

    /// The plan file's spelling (docs/plan-format.md).
    pub fn plan_key(self) -> &'static str {
        match self {
            PlanField::Pipeline => "parallel.pp",
            PlanField::Schedule => "parallel.schedule, virtual_stages",
            PlanField::Cuts => "stages[].layers",
            PlanField::Tensor => "parallel.tp",
            PlanField::TensorSplit => "layer_strategies",
            PlanField::SequenceParallel => "parallel.sequence_parallel",
            PlanField::Context => "parallel.cp",
            PlanField::Expert => "parallel.ep",
            PlanField::Data => "parallel.dp",
            PlanField::Zero => "parallel.zero",
            PlanField::ShardedData => "parallel.sharded_dp",
            PlanField::Batch => "global_batch, parallel.microbatches",
            PlanField::Recompute => "stages[].checkpointed_layers",
            PlanField::Offload => "stages[].offloaded_layers",
            PlanField::LoadingHorizon => "parallel.activation_loading_horizon",
            PlanField::Precision => "parallel.precision",
            PlanField::Placement => "parallel.placement",
            PlanField::InFlight => "parallel.active_microbatches",
            PlanField::ExpertOverlap => "parallel.expert_comm_overlap",
            PlanField::GradOverlap => "parallel.grad_sync_overlap",
            PlanField::Float8 => "parallel.float8_linears",
        }
    }
}

/// A change to the planner's request that turns a plan into the nearest one an engine can run.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Another pipeline schedule.
    Schedule(ScheduleKind),
    /// Other pipeline cuts.
    Layout(Layout),
    /// Another ZeRO stage.
    Zero(u8),
    /// No sharded-data-parallel groups (ZeRO 3 over all replicas).
    WholeShardGroups,
    /// Exactly these layers recomputed.
    Recompute(BTreeSet<usize>),
    /// Another recompute rule for every layer (`selective`: each rebuilds its norms' and
    /// activation functions' outputs).
    Checkpointing(crate::solve::CheckpointRule),
    /// Another offloading rule.
    Offload(OffloadRule),
    /// Another loading horizon.
    LoadingHorizon(usize),
    /// Another training precision.
    Precision(Precision),
    /// Sequence parallelism on or off.
    SequenceParallel(bool),
    /// Megatron's tensor split in every layer.
    MegatronSplit,
    /// Another mesh order.
    Placement(Placement),
    /// No cap on the microbatches in flight.
    NoInFlightCap,
    /// The mixed precision's gradients accumulated and reduced in fp32
    /// ([`crate::ir::MixedRecipe::LowModelFp32Grads`]).
    Fp32Gradients,
    /// The mixed precision's gradients kept in the model's type (the cluster's default recipe,
    /// which has no fp32 main grads).
    ModelTypeGradients,
    /// The expert groups folded over tensor × data ranks with whole experts (expert-TP 1).
    FoldedExperts,
    /// The expert all-to-alls overlapped with another microbatch's compute (combined 1F1B), or
    /// run in turn.
    ExpertOverlap(bool),
    /// The gradients reduced beside the backward, or after it.
    GradOverlap(bool),
    /// The blocks' linears in fp8, or in 16 bits.
    Float8(bool),
    /// Another expert-parallel degree, each expert split over the tensor ranks (expert-tensor =
    /// tensor degree).
    ExpertDegree(usize),
}

impl Change {
    /// Applies the change to a request.
    pub fn apply(&self, req: &mut PlanOptions) {
        match self {
            Change::Schedule(s) => {
                // other virtual stages take other cuts: the planner chooses them
                if req.schedule.map_or(1, |r| r.virtual_stages()) != s.virtual_stages() {
                    req.layout = None;
                }
                req.schedule = Some(*s);
            }
            Change::Layout(l) => req.layout = Some(l.clone()),
            Change::Zero(z) => req.zero = Some(*z),
            Change::WholeShardGroups => req.sharded_dp = None,
            Change::Recompute(set) => {
                req.checkpointed_layers = Some(set.clone());
                req.selective_layers = None;
                req.selective_policy = None;
                if set.is_empty() && req.offload == Some(OffloadRule::Always) {
                    req.offload = Some(OffloadRule::Never);
                }
            }
            Change::Checkpointing(rule) => {
                req.checkpointing = Some(*rule);
                req.checkpointed_layers = None;
                req.selective_layers = None;
                req.selective_policy = None;
            }
            Change::Offload(o) => req.offload = Some(*o),
            Change::LoadingHorizon(h) => req.loading_horizon = Some(*h),
            Change::Precision(p) => req.precision = Some(*p),
            Change::SequenceParallel(on) => req.sequence_parallel = Some(*on),
            Change::MegatronSplit => req.megatron_split = true,
            Change::FoldedExperts => req.etp = Some(1),
            Change::ExpertOverlap(on) => req.expert_overlap = Some(*on),
            Change::GradOverlap(on) => req.grad_overlap = Some(*on),
            Change::Float8(on) => req.float8_linears = Some(*on),
            Change::ExpertDegree(e) => {
                req.ep = Some(*e);
                req.etp = None;
            }
            Change::Placement(p) => req.placement = Some(*p),
            Change::NoInFlightCap => req.active_microbatches = None,
            Change::Fp32Gradients => req.mixed_recipe = Some(crate::ir::MixedRecipe::LowModelFp32Grads),
            Change::ModelTypeGradients => req.mixed_recipe = None,
        }
    }
}

/// One line of what an engine cannot express: what the plan chose, why the engine cannot say
/// it, and what its configuration says instead. `change` gives the nearest request; `None`
/// when the difference is named but not priced (the planner has no model of what the engine
/// does instead).
#[derive(Clone, Debug, PartialEq)]
pub struct Gap {
    /// The engine.
    pub engine: Engine,
    /// The plan field concerned.
    pub field: PlanField,
    /// What the plan chose, in words.
    pub chose: String,
    /// Why the engine cannot say it.
    pub why: String,
    /// What the configuration says instead, in words.
    pub nearest: String,
    /// The request change that prices the nearest configuration.
    pub change: Option<Change>,
}

impl fmt::Display for Gap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} cannot express {} ({}); nearest: {}", self.engine, self.chose, self.why, self.nearest)
    }
}

/// The planner's request that reproduces `plan`: its degrees, schedule, microbatches, cuts,
/// recompute, precision, offloading, placement and batch, all fixed. `megatron_split` is set
/// when every layer has Megatron's tensor split (the engines' only split).
pub fn exact_request(plan: &Plan) -> PlanOptions {
    let p = &plan.parallel;
    let checkpointed: BTreeSet<usize> = plan.stages.iter().flat_map(|s| s.checkpointed_layers.iter().copied()).collect();
    let offloaded: BTreeSet<usize> = plan.stages.iter().flat_map(|s| s.offloaded_layers.iter().copied()).collect();
    let offload = if offloaded.is_empty() {
        OffloadRule::Never
    } else if offloaded == checkpointed {
        OffloadRule::Always
    } else {
        OffloadRule::Auto
    };
    let layout = Layout(plan.stages.iter().map(|s| s.layers).collect());
    PlanOptions {
        global_batch: Some(plan.global_batch),
        seq_len: plan.seq_len,
        dims: plan.dims.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        pp: Some(p.pp),
        tp: Some(p.tp),
        dp: Some(p.dp),
        cp: Some(p.cp),
        ep: Some(p.ep),
        etp: Some(p.etp),
        zero: Some(p.zero),
        sharded_dp: p.sharded_dp,
        microbatches: Some(p.microbatches),
        active_microbatches: p.active_microbatches,
        schedule: Some(p.schedule),
        checkpointed_layers: Some(checkpointed),
        selective_layers: Some(selective(plan)).filter(|s| !s.is_empty()),
        selective_policy: Some(p.selective_policy),
        megatron_split: megatron_split(plan),
        placement: Some(p.placement),
        layout: (p.pp > 1 || p.schedule.virtual_stages() > 1).then_some(layout),
        memory_limit_gib: Some(plan.cluster.memory_limit_bytes as f64 / (1u64 << 30) as f64),
        sequence_parallel: Some(p.sequence_parallel && p.tp > 1),
        precision: Some(p.precision),
        offload: Some(offload),
        loading_horizon: Some(p.loading_horizon),
        mixed_recipe: p.fp32_main_grads.then_some(crate::ir::MixedRecipe::LowModelFp32Grads),
        expert_overlap: Some(p.expert_overlap),
        grad_overlap: Some(p.grad_overlap),
        float8_linears: Some(p.float8_linears),
        params: ParamOptions { trainable: plan.trainable.clone(), frozen: plan.frozen.clone() },
        cluster_flag: Some(format!("{}:{}", plan.cluster.preset, plan.cluster.devices)),
        ..PlanOptions::default()
    }
}

/// Whether every layer of `plan` has Megatron's tensor split (or none, at tp 1).
pub fn megatron_split(plan: &Plan) -> bool {
    let p = &plan.parallel;
    p.tp == 1 || plan.layer_strategies.iter().all(|s| s.strategy == format!("megatron-tp{}", p.tp))
}

/// The layers `plan` recomputes.
pub fn checkpointed(plan: &Plan) -> BTreeSet<usize> {
    plan.stages.iter().flat_map(|s| s.checkpointed_layers.iter().copied()).collect()
}

/// The layers `plan` recomputes selectively (their norms' and activation functions' outputs).
pub fn selective(plan: &Plan) -> BTreeSet<usize> {
    plan.stages.iter().flat_map(|s| s.selective_layers.iter().copied()).collect()
}

/// For an engine that rebuilds no norm or activation alone: what the plan chose and the nearest
/// request (its checkpointed layers exactly, every other layer keeping its activations), when
/// the plan recomputes any layer selectively.
pub fn selective_unexpressed(plan: &Plan) -> Option<(String, Change)> {
    let layers = selective(plan);
    let what = match plan.parallel.selective_policy {
        crate::ir::SelectivePolicy::Pointwise => "norms and activation functions",
        crate::ir::SelectivePolicy::Ops => "ops by torchtitan's per-op policy",
    };
    (!layers.is_empty()).then(|| (format!("selective recompute of {} layers' {what}", layers.len()), Change::Recompute(checkpointed(plan))))
}

/// For an engine without Megatron-Core's combined 1F1B: the gap when `plan` priced the expert
/// all-to-alls overlapped with another microbatch's compute.
pub fn expert_overlap_unexpressed(engine: Engine, plan: &Plan) -> Option<Gap> {
    plan.parallel.expert_overlap.then(|| Gap {
        engine,
        field: PlanField::ExpertOverlap,
        chose: "the expert all-to-alls overlapped with another microbatch's compute (Megatron-Core's combined 1F1B)".into(),
        why: "it runs each microbatch's all-to-alls in turn with its own compute".into(),
        nearest: "the all-to-alls in turn".into(),
        change: Some(Change::ExpertOverlap(false)),
    })
}

/// The gap of an engine whose configuration cannot turn Float8 linears on (`why`), where
/// `plan` priced them.
pub fn float8_unexpressed(engine: Engine, plan: &Plan, why: &str) -> Option<Gap> {
    plan.parallel.float8_linears.then(|| Gap {
        engine,
        field: PlanField::Float8,
        chose: "the blocks' linear layers in fp8 (Float8 linears)".into(),
        why: why.into(),
        nearest: "the linears in 16 bits".into(),
        change: Some(Change::Float8(false)),
    })
}

/// The layers `plan` offloads.
pub fn offloaded(plan: &Plan) -> BTreeSet<usize> {
    plan.stages.iter().flat_map(|s| s.offloaded_layers.iter().copied()).collect()
}

/// Whether two rank orders place every rank of `p`'s mesh alike (they differ only in axes of
/// one position: at pp 1, `DPT` and `PDT` are the same mesh).
pub fn same_ranks(a: Placement, b: Placement, p: &crate::ir::Parallelism) -> bool {
    same_mesh(a, b, p.placed_degrees())
}

/// Whether two rank orders place every rank of a mesh of `deg` = (D, P, T) alike.
pub fn same_mesh(a: Placement, b: Placement, deg: [usize; 3]) -> bool {
    if a == b {
        return true;
    }
    (0..deg[0]).all(|d| (0..deg[1]).all(|q| (0..deg[2]).all(|t| a.rank([d, q, t], deg) == b.rank([d, q, t], deg))))
}

/// The rank order a reader records for an engine's order on a mesh of `deg` = (D, P, T): the
/// planner's default (`DPT`) where it is the same mesh, else the engine's.
pub fn reader_order(engine_order: Placement, deg: [usize; 3]) -> Placement {
    if same_mesh(engine_order, Placement::CLUSTER, deg) { Placement::CLUSTER } else { engine_order }
}
