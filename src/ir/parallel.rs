//! The parallel configuration, one type for every stage ([`Parallelism`]: degrees, ZeRO,
//! microbatches, schedule, checkpointing, placement, precision), with its vocabulary: the mesh
//! axes and their rank order (placement), the checkpointing and offloading policies and the
//! training precision.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{DType, ScheduleKind};

/// Bounds on the counts of a step, held by the planner (which searches nothing past them) and by
/// a plan file's validation (which refuses a file past them before anything is allocated from
/// its counts).
pub mod limits {
    /// The most devices a cluster may have (a million: 60 times the largest training runs
    /// published). Every rank list, mesh and per-device table is bounded by it.
    pub const MAX_DEVICES: usize = 1 << 20;
    /// The most samples a step may hold (the global batch).
    pub const MAX_GLOBAL_BATCH: u64 = 1 << 31;
    /// The most layers a model may have.
    pub const MAX_LAYERS: usize = 1 << 20;
    /// The most stage-microbatches a step may run: stages (pp · virtual stages) times
    /// microbatches. Each is a forward and a backward action of the lowered schedule with their
    /// sends and receives, so this bounds the programs a schedule lowers to.
    pub const MAX_STAGE_MICROBATCHES: usize = 1 << 16;
    /// The most a bound dim (the sequence length, `--dim NAME=V`) may be.
    pub const MAX_DIM: u64 = 1 << 31;

    /// The largest activation loading horizon worth recording for `microbatches` microbatches
    /// of `virtual_stages` chunks per rank: a rank runs microbatches · virtual stages
    /// backwards per step and a larger horizon means the same; the default is always allowed.
    pub fn max_loading_horizon(microbatches: usize, virtual_stages: usize) -> usize {
        microbatches.saturating_mul(virtual_stages).max(super::OffloadRule::DEFAULT_HORIZON)
    }
}

/// A plan's parallel configuration: what the planner chose (or was told), what codegen lowers,
/// the plan file records (its `parallel` object, through the plan's own spelling) and the
/// runner executes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Parallelism {
    /// Pipeline-parallel degree (devices along a pipeline).
    pub pp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Context-parallel degree: ranks the sequence of every microbatch is split over (each a
    /// front and a back chunk). The mesh's D axis holds `dp · cp` positions, context groups are
    /// runs of `cp` consecutive positions; weight gradients reduce over all of them.
    pub cp: usize,
    /// Expert-parallel degree: ranks a mixture-of-experts layer's experts are split over.
    /// With `etp == tp` carved from the data-parallel ranks (divides `dp`; expert groups are
    /// runs of `ep` consecutive data-parallel indices at one tensor rank); with `etp < tp` folded
    /// over tensor × data ranks as Megatron-Core does (see [`Parallelism::expert_position`]).
    pub ep: usize,
    /// Expert-tensor-parallel degree (Megatron-Core's `--expert-tensor-parallel-size`): ranks
    /// each expert's weights are split over, `tp` unless folded; `ep · etp` divides `tp · dp`.
    pub etp: usize,
    /// ZeRO stage (0..=3).
    pub zero: u8,
    /// Sharded-data-parallel group size (ZeRO 3 over groups of that many replicas), if used.
    pub sharded_dp: Option<usize>,
    /// Microbatches per step and pipeline.
    pub microbatches: usize,
    /// Cap on microbatches in flight (SMP's `active_microbatches`), if set.
    pub active_microbatches: Option<usize>,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Checkpointing policy as requested.
    pub checkpointing: CheckpointRule,
    /// What a selectively recomputed layer rebuilds ([`SelectivePolicy`]).
    pub selective_policy: SelectivePolicy,
    /// Mesh axis order, outermost first.
    pub placement: Placement,
    /// Sequence parallelism within each tensor-parallel group (Megatron-LM's): row-parallel
    /// outputs reduce-scattered over the tokens, norms and residuals on token chunks.
    pub sequence_parallel: bool,
    /// The training precision: the types of weights, activations, gradients and optimizer
    /// state the cost model prices and the runner executes.
    pub precision: Precision,
    /// Activation offloading policy as requested: whether checkpointed layers' kept inputs
    /// may move to host memory between their forward and backward.
    pub offload: OffloadRule,
    /// Microbatches whose offloaded inputs are back on the device ahead of their backward
    /// (SMP's `activation_loading_horizon`).
    pub loading_horizon: usize,
    /// Whether a mixed precision's 16-bit model accumulates and reduces its gradients in fp32
    /// ([`MixedRecipe::LowModelFp32Grads`]: Megatron-LM's main grads, FSDP's fp32 reduction), as
    /// the plan priced it.
    pub fp32_main_grads: bool,
    /// Whether each forward that follows a backward in the steady phase runs merged with it, one
    /// microbatch's expert all-to-alls beside the other's compute (Megatron-Core's combined
    /// 1F1B, `--overlap-moe-expert-parallel-comm`), as the plan priced it: only with expert
    /// parallelism and without a pipeline or interleaved. `smp-runner` runs them in turn.
    pub expert_overlap: bool,
    /// Whether each layer's gradient reduction (the data-parallel all-reduce or reduce-scatter,
    /// ZeRO 2 and 3's after every backward) runs beside the rest of the backward, sharing the
    /// link with ZeRO 3's gathers, as the engines' bucketed reductions run it (Megatron's
    /// `--overlap-grad-reduce`, Megatron-FSDP), as the plan priced it. `smp-runner` reduces
    /// after the backward.
    pub grad_overlap: bool,
    /// Whether the blocks' linear layers were priced in fp8 with per-tensor scaling (torchao's
    /// `Float8Linear`, Transformer Engine's fp8 recipes). `smp-runner` runs them in 16 bits.
    pub float8_linears: bool,
}

impl Parallelism {
    /// The degrees `pp`, `tp` and `dp` alone, every other setting at its default: no context,
    /// expert or ZeRO sharding, one microbatch under 1F1B, `cluster` placement, f32, automatic
    /// checkpointing and offloading.
    pub fn of_degrees(pp: usize, tp: usize, dp: usize) -> Parallelism {
        Parallelism {
            pp,
            tp,
            dp,
            cp: 1,
            ep: 1,
            etp: tp,
            zero: 0,
            sharded_dp: None,
            microbatches: 1,
            active_microbatches: None,
            schedule: ScheduleKind::OneFOneB,
            checkpointing: CheckpointRule::Auto,
            selective_policy: SelectivePolicy::Pointwise,
            placement: Placement::CLUSTER,
            sequence_parallel: false,
            precision: Precision::F32,
            offload: OffloadRule::Auto,
            loading_horizon: OffloadRule::DEFAULT_HORIZON,
            fp32_main_grads: false,
            expert_overlap: false,
            grad_overlap: false,
            float8_linears: false,
        }
    }

    /// Devices of the mesh: pp · tp · cp · dp.
    pub fn devices(&self) -> usize {
        self.pp * self.tp * self.cp * self.dp
    }

    /// The parallelism as the mesh runs it: its data axis holds dp · cp positions (every
    /// context rank of every replica), so gradients reduce, and ZeRO shards, over all of them.
    pub fn over_data_axis(&self) -> Parallelism {
        Parallelism { dp: self.dp.max(1) * self.cp.max(1), ..*self }
    }

    /// Replicas each ZeRO shard is spread over: the sharded-data-parallel group where it is a
    /// proper part of the replicas, else all of them.
    pub fn zero_group(&self) -> usize {
        self.sharded_dp.filter(|&n| n > 1 && n < self.dp).unwrap_or(self.dp)
    }

    /// Parameters stay sharded between uses (ZeRO 3, or sharded data parallelism).
    pub fn params_sharded(&self) -> bool {
        self.dp > 1 && (self.zero >= 3 || self.zero_group() < self.dp)
    }

    /// Expert groups folded over tensor × data ranks: the expert-tensor degree differs from the
    /// tensor degree, so a stage's `dp · tp` ranks are re-factored as `etp × ep × expert-dp`.
    pub fn experts_folded(&self) -> bool {
        self.etp != self.tp
    }

    /// Where data-parallel index `d` and tensor rank `t` sit in the folded expert mesh of a
    /// stage (context degree 1): `(etp rank, ep rank, expert-dp index)`. The stage's positions
    /// `i = d · tp + t` are taken expert-tensor rank fastest, then expert rank, then the
    /// replicas holding the same experts (Megatron-Core's order).
    pub fn expert_position(&self, d: usize, t: usize) -> (usize, usize, usize) {
        let (etp, ep) = (self.etp.max(1), self.ep.max(1));
        let i = d * self.tp.max(1) + t;
        (i % etp, (i / etp) % ep, i / (etp * ep))
    }

    /// The (data-parallel index, tensor rank) of a folded expert-mesh position.
    pub fn expert_member(&self, etp_rank: usize, ep_rank: usize, edp: usize) -> (usize, usize) {
        let (etp, ep, tp) = (self.etp.max(1), self.ep.max(1), self.tp.max(1));
        let i = etp_rank + etp * (ep_rank + ep * edp);
        (i / tp, i % tp)
    }

    /// Degrees as (dp, pp, tp), the order [`Placement`] takes them.
    pub fn mesh_degrees(&self) -> [usize; 3] {
        [self.dp, self.pp, self.tp]
    }

    /// Degrees of the placed mesh as (D, P, T): the D axis holds `dp · cp` positions, the
    /// context ranks of a replica consecutive on it (position `d · cp + c`).
    pub fn placed_degrees(&self) -> [usize; 3] {
        [self.dp * self.cp.max(1), self.pp, self.tp]
    }

    /// Global rank of data-parallel index `d`, context rank `c`, pipeline rank `p` and tensor
    /// rank `t`: the placement's order with context inside D.
    pub fn rank_of(&self, d: usize, c: usize, p: usize, t: usize) -> usize {
        self.placement.rank([d * self.cp.max(1) + c, p, t], self.placed_degrees())
    }

    /// Ranks of pipeline rank `p`: data-parallel index major, then context rank, then tensor
    /// rank (`dp · cp · tp` of them).
    pub fn stage_ranks(&self, p: usize) -> Vec<usize> {
        self.placement.stage_ranks(p, self.placed_degrees())
    }
}

/// One axis of the device mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MeshAxis {
    /// Data parallel.
    D,
    /// Pipeline parallel.
    P,
    /// Tensor parallel.
    T,
}

impl MeshAxis {
    /// Position of the axis in `(d, p, t)` triples.
    pub fn index(self) -> usize {
        match self {
            MeshAxis::D => 0,
            MeshAxis::P => 1,
            MeshAxis::T => 2,
        }
    }
}

/// Rank order of the mesh, outermost axis first: the last axis gets consecutive ranks (the
/// fastest, innermost link). SMP's `cluster` = DPT, `spread` = TPD.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Placement(pub [MeshAxis; 3]);

impl Placement {
    /// SMP's `cluster`: D outermost, T innermost (tensor groups inside a node).
    pub const CLUSTER: Placement = Placement([MeshAxis::D, MeshAxis::P, MeshAxis::T]);
    /// SMP's `spread`: T outermost, D innermost (data-parallel groups inside a node).
    pub const SPREAD: Placement = Placement([MeshAxis::T, MeshAxis::P, MeshAxis::D]);

    /// Global rank of mesh coordinates (d, p, t) for degrees (dp, pp, tp).
    pub fn rank(&self, coord: [usize; 3], degrees: [usize; 3]) -> usize {
        self.0.iter().fold(0, |r, &a| r * degrees[a.index()] + coord[a.index()])
    }

    /// Rank distance between neighbours along `axis` for degrees (dp, pp, tp).
    pub fn stride(&self, axis: MeshAxis, degrees: [usize; 3]) -> usize {
        let pos = self.0.iter().position(|&a| a == axis).unwrap_or(0);
        self.0[pos + 1..].iter().map(|&a| degrees[a.index()]).product()
    }

    /// Ranks of pipeline rank `p`, data-replica-major then tensor rank (`tp · dp` of them).
    pub fn stage_ranks(&self, p: usize, [dp, pp, tp]: [usize; 3]) -> Vec<usize> {
        (0..dp).flat_map(|d| (0..tp).map(move |t| self.rank([d, p, t], [dp, pp, tp]))).collect()
    }

    /// `DPT`-style text.
    pub fn name(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for a in self.0 {
            write!(f, "{a:?}")?;
        }
        Ok(())
    }
}

impl FromStr for Placement {
    type Err = String;
    /// `cluster`, `spread` or a permutation of D, P, T (any case).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cluster" => return Ok(Placement::CLUSTER),
            "spread" => return Ok(Placement::SPREAD),
            _ => {}
        }
        let axes: Vec<MeshAxis> = s
            .chars()
            .map(|c| match c.to_ascii_uppercase() {
                'D' => Some(MeshAxis::D),
                'P' => Some(MeshAxis::P),
                'T' => Some(MeshAxis::T),
                _ => None,
            })
            .collect::<Option<_>>()
            .unwrap_or_default();
        let perm = axes.len() == 3 && [MeshAxis::D, MeshAxis::P, MeshAxis::T].iter().all(|a| axes.contains(a));
        if perm {
            Ok(Placement([axes[0], axes[1], axes[2]]))
        } else {
            Err(format!("`{s}`: expected cluster, spread or a permutation of D, P, T (e.g. DPT)"))
        }
    }
}

/// Whether layers may be checkpointed (recomputed in the backward pass): the one
/// checkpointing policy of the CLI (`--checkpointing auto|auto-selective|none|selective|full`), the SMP config, the
/// search and the plan file (`parallel.checkpointing`), which spell it by [`CheckpointRule::name`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CheckpointRule {
    /// The solver chooses per layer between none and full (`auto`).
    #[default]
    Auto,
    /// The solver chooses per layer among none, selective and full (`auto-selective`: a larger
    /// search, memory-bound candidates' ILPs take longer).
    AutoSelective,
    /// No layer is checkpointed (`none`).
    Never,
    /// Every layer is checkpointed (`full`).
    Always,
    /// No layer is checkpointed whole; every layer rebuilds its normalisations' and activation
    /// functions' outputs in its backward instead of keeping them (`selective`).
    Selective,
}

impl CheckpointRule {
    /// The name the CLI and the plan file use: `auto`, `auto-selective`, `none`, `selective` or `full`.
    pub fn name(self) -> &'static str {
        match self {
            CheckpointRule::Auto => "auto",
            CheckpointRule::AutoSelective => "auto-selective",
            CheckpointRule::Never => "none",
            CheckpointRule::Always => "full",
            CheckpointRule::Selective => "selective",
        }
    }
}

impl std::fmt::Display for CheckpointRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CheckpointRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(CheckpointRule::Auto),
            "auto-selective" => Ok(CheckpointRule::AutoSelective),
            "none" => Ok(CheckpointRule::Never),
            "full" => Ok(CheckpointRule::Always),
            "selective" => Ok(CheckpointRule::Selective),
            _ => Err(format!("`{s}`: expected auto, auto-selective, none, selective or full")),
        }
    }
}

/// What selective recompute rebuilds in a layer's backward instead of keeping from its forward
/// (`--selective-policy`, plan field `parallel.selective_policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SelectivePolicy {
    /// Its normalisations' and activation functions' outputs, as Megatron-Core's
    /// `--recompute-modules layernorm mlp_act` (`pointwise`).
    #[default]
    Pointwise,
    /// torchtitan's per-op policy (`selective_ac_option = "op"`): the outputs of attention and of
    /// every other weight product (the first, third, … in the layer's order) are kept, whatever
    /// reads them; everything else the backward needs is rebuilt from them and the layer's
    /// inputs (`op`).
    Ops,
}

impl SelectivePolicy {
    /// The name the CLI and the plan file use: `pointwise` or `op`.
    pub fn name(self) -> &'static str {
        match self {
            SelectivePolicy::Pointwise => "pointwise",
            SelectivePolicy::Ops => "op",
        }
    }
}

impl std::fmt::Display for SelectivePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SelectivePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "pointwise" => Ok(SelectivePolicy::Pointwise),
            "op" => Ok(SelectivePolicy::Ops),
            _ => Err(format!("`{s}`: expected pointwise or op")),
        }
    }
}

/// How a mixture of experts' routed tokens reach the ranks holding their experts, as the
/// engine that runs the plan dispatches them: `smp-runner` and Megatron-Core's `alltoall`
/// dispatcher send every token–expert pair (`all-to-all`); DeepEP (Megatron-Core's `flex`
/// dispatcher) sends a token once to each node holding one of its experts and forwards it over
/// NVLink inside the node (`per-node`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExpertDispatch {
    /// One copy per token–expert pair (`all-to-all`).
    #[default]
    AllToAll,
    /// One copy per token and destination node (`per-node`).
    PerNode,
}

impl ExpertDispatch {
    /// The name the plan file uses: `all-to-all` or `per-node`.
    pub fn name(self) -> &'static str {
        match self {
            ExpertDispatch::AllToAll => "all-to-all",
            ExpertDispatch::PerNode => "per-node",
        }
    }
}

impl std::fmt::Display for ExpertDispatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ExpertDispatch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all-to-all" => Ok(ExpertDispatch::AllToAll),
            "per-node" => Ok(ExpertDispatch::PerNode),
            _ => Err(format!("`{s}`: expected all-to-all or per-node")),
        }
    }
}

/// Whether checkpointed layers' kept inputs move to host memory between their forward and
/// backward: the one offloading policy of the CLI (`--offload-activations auto|on|off`), the
/// SMP config (`offload_activations`, `sm_activation_offloading`) and the plan file
/// (`parallel.offload_activations`), spelt by [`OffloadRule::name`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OffloadRule {
    /// The solver chooses per checkpointed layer, only where it makes the plan fit or faster
    /// (`auto`).
    #[default]
    Auto,
    /// No layer is offloaded (`off`).
    Never,
    /// Every checkpointed layer is offloaded (`on`).
    Always,
}

impl OffloadRule {
    /// SMP's default `activation_loading_horizon`.
    pub const DEFAULT_HORIZON: usize = 4;

    /// The name the CLI and the plan file use: `auto`, `on` or `off`.
    pub fn name(self) -> &'static str {
        match self {
            OffloadRule::Auto => "auto",
            OffloadRule::Never => "off",
            OffloadRule::Always => "on",
        }
    }
}

impl fmt::Display for OffloadRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OffloadRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(OffloadRule::Auto),
            "off" => Ok(OffloadRule::Never),
            "on" => Ok(OffloadRule::Always),
            _ => Err(format!("`{s}`: expected auto, on or off")),
        }
    }
}

/// The training precision of a plan (`--precision`, SMP's `fp16`/`bf16`/`fp16_params`, the
/// plan file's `parallel.precision`): what type weights, activations, gradients, master weights
/// and optimizer state are kept in (docs/precision.md has the table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in fp32 (`f32`): weights, activations, gradients, AdamW moments; no master copy.
    F32,
    /// Everything in bf16 (`bf16`): weights, activations, gradients and AdamW moments in bf16,
    /// no fp32 master copy (PyTorch's AdamW on bf16 parameters keeps its moments in their dtype).
    Bf16,
    /// bf16 mixed precision (`bf16-mixed`): bf16 weights, activations and gradients for
    /// compute, fp32 master weights and fp32 AdamW moments.
    Bf16Mixed,
    /// fp16 mixed precision (`fp16-mixed`): as `bf16-mixed` in fp16, with loss scaling.
    Fp16Mixed,
}

impl Precision {
    /// Every mode, in the order the CLI lists them.
    pub const ALL: [Precision; 4] = [Precision::F32, Precision::Bf16, Precision::Bf16Mixed, Precision::Fp16Mixed];

    /// The name the CLI, the SMP mapping and the plan file use: `f32`, `bf16`, `bf16-mixed`,
    /// `fp16-mixed`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::Fp16Mixed => "fp16-mixed",
        }
    }

    /// The default of a cluster: bf16 mixed precision on GPUs, f32 on CPUs (`cpu` = true).
    pub fn default_for(cpu: bool) -> Precision {
        if cpu { Precision::F32 } else { Precision::Bf16Mixed }
    }

    /// The type compute runs in (matmuls, activations kept for backward): fp32 for `f32`, bf16
    /// for `bf16` and `bf16-mixed`, fp16 for `fp16-mixed`.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 | Precision::Bf16Mixed => DType::BF16,
            Precision::Fp16Mixed => DType::F16,
        }
    }

    /// Whether an fp32 master copy of the weights backs low-precision compute.
    pub fn is_mixed(self) -> bool {
        matches!(self, Precision::Bf16Mixed | Precision::Fp16Mixed)
    }
}

/// How a mixed precision (`bf16-mixed`, `fp16-mixed`) keeps its state and activations: what
/// the cost model prices for a plan.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MixedRecipe {
    /// `torch.autocast`, as the runner executes plans: fp32 weights (the masters), fp32
    /// gradients and moments, each value in the type autocast gives it (products' outputs low,
    /// norms and residual sums fp32), products keeping low-type casts of their inputs.
    #[default]
    Autocast,
    /// Megatron-LM's, DeepSpeed's and FSDP's: the model in the low type throughout (weights,
    /// gradients, every activation) beside an fp32 master copy and fp32 moments: what checks
    /// against those engines' published runs price.
    LowModel,
    /// [`MixedRecipe::LowModel`] with the gradients accumulated and reduced in fp32 buffers:
    /// Megatron-LM's default under `--bf16` (its fp32 "main grads", unless
    /// `--grad-reduce-in-bf16`) and FSDP2's under torchtitan (`mixed_precision_reduce =
    /// float32`, its only choice), 2 + 4 + 12 bytes per parameter, the gradient collectives
    /// moving 4 bytes each.
    LowModelFp32Grads,
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = String;
    /// `f32`, `bf16`, `bf16-mixed` or `fp16-mixed`.
    fn from_str(s: &str) -> Result<Self, String> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("`{s}`: expected f32, bf16, bf16-mixed or fp16-mixed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_names_round_trip() {
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>(), Ok(p));
        }
        assert!("fp16".parse::<Precision>().unwrap_err().contains("fp16-mixed"));
        assert_eq!(Precision::default_for(true), Precision::F32);
        assert_eq!(Precision::default_for(false), Precision::Bf16Mixed);
    }

    #[test]
    fn offload_names_round_trip() {
        for r in [OffloadRule::Auto, OffloadRule::Never, OffloadRule::Always] {
            assert_eq!(r.name().parse::<OffloadRule>(), Ok(r));
        }
        assert!("yes".parse::<OffloadRule>().unwrap_err().contains("auto, on or off"));
    }
}
