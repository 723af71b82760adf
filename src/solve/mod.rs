//! The planner: flat problems, the intra-layer and pipeline ILPs, per-layer costs under a
//! parallel configuration, the pruned outer search and the baselines.
//!
//! Entry point: [`plan`].

pub mod baseline;
pub mod chunks;
pub mod heuristic;
pub mod ilp;
pub mod layer_cost;
pub mod options;
pub mod oracle;
pub mod pipeline;
pub mod problem;
pub mod search;
pub mod smp_config;
pub mod strategy;

use std::fmt;
use std::str::FromStr;

use crate::cost::ClusterSpec;
use crate::ir::{LayeredGraph, ScheduleKind};

pub use ilp::{SolveReport, SolveStatus, SolverOptions};
pub use options::{ConfigError, Layout, PlanOptions, Setting, Source, Sourced};
pub use problem::CheckpointRule;
pub use smp_config::SmpConfig;

/// Errors of the planner.
#[derive(Debug, thiserror::Error)]
pub enum SolveError {
    /// A flat problem is malformed.
    #[error("solver problem: {0}")]
    Problem(String),
    /// HiGHS failed.
    #[error("ILP solver: {0}")]
    Solver(String),
    /// A fixed setting cannot be honoured (names the setting and the fix).
    #[error("{0}")]
    Setting(String),
    /// Nothing fits; says what would.
    #[error("no plan fits: {reason}; {fix}")]
    Infeasible {
        /// Why (memory per device needed vs available, or too few devices).
        reason: String,
        /// What would fit: the smallest memory per device or device count.
        fix: String,
    },
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
    fn index(self) -> usize {
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

/// `--optimize`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Optimize {
    /// Shortest step time.
    #[default]
    Speed,
    /// Least peak memory among plans within 5 % of the fastest step.
    Memory,
}

impl Optimize {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Optimize::Speed => "speed",
            Optimize::Memory => "memory",
        }
    }
}

impl fmt::Display for Optimize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Optimize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "speed" => Ok(Optimize::Speed),
            "memory" => Ok(Optimize::Memory),
            _ => Err(format!("`{s}`: expected speed or memory")),
        }
    }
}

/// A peer's way of planning, for comparison (`--baseline`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Baseline {
    /// Megatron-LM as Narayanan et al. (2021) ran Table 1: t = GPUs per node, p the smallest
    /// that fits and divides the blocks, d the rest; equal blocks per stage with the embedding
    /// on the first and the head on the last; 1F1B (interleaved when `--schedule` says so),
    /// microbatch size 1, full recompute, no ZeRO, Megatron's tensor split (docs/baselines.md).
    Megatron,
    /// DeepSpeed `partition_method=uniform`: equal layer counts per stage.
    Uniform,
    /// DeepSpeed `partition_method=parameters`: stages balanced by parameter count.
    Parameters,
}

impl Baseline {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Megatron => "megatron",
            Baseline::Uniform => "uniform",
            Baseline::Parameters => "parameters",
        }
    }
}

impl fmt::Display for Baseline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Baseline {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "megatron" => Ok(Baseline::Megatron),
            "uniform" => Ok(Baseline::Uniform),
            "parameters" => Ok(Baseline::Parameters),
            _ => Err(format!("`{s}`: expected megatron, uniform or parameters")),
        }
    }
}

/// Memory of one stage per device, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageMemory {
    /// Weights.
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer state.
    pub optimizer: f64,
    /// Activations at the peak (in-flight microbatches and the recompute buffer).
    pub activations: f64,
    /// Workspace margin (counted once per device, on its first stage).
    pub workspace: f64,
    /// Sum.
    pub total: f64,
}

/// One (virtual) stage of the chosen plan.
#[derive(Clone, Debug, PartialEq)]
pub struct StageDecision {
    /// Stage index (chunk; `c·p + r` is chunk c of pipeline rank r).
    pub index: usize,
    /// Pipeline rank running it.
    pub pp_rank: usize,
    /// First and last layer (inclusive).
    pub layers: [usize; 2],
    /// Global ranks holding it: `ranks[d·tp + t]`.
    pub ranks: Vec<usize>,
    /// Forward time per microbatch, seconds.
    pub forward_s: f64,
    /// Backward time per microbatch (recompute included), seconds.
    pub backward_s: f64,
    /// Time of the boundary transfer after it per microbatch (forward + backward), seconds.
    pub comm_s: f64,
    /// Memory per device.
    pub memory: StageMemory,
    /// Layers recomputed in the backward pass.
    pub checkpointed_layers: Vec<usize>,
}

/// The tensor strategy chosen for one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerDecision {
    /// Layer index.
    pub layer: usize,
    /// Strategy name of the layer's assignment.
    pub strategy: String,
    /// Per node: (node name, strategy).
    pub nodes: Vec<(String, crate::split::Strategy)>,
    /// Whether it is checkpointed.
    pub checkpoint: bool,
}

/// Predicted figures of the plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Predicted {
    /// Step time, seconds.
    pub step_time_s: f64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Pipeline idle time over ideal compute time.
    pub bubble_ratio: f64,
    /// Largest per-device memory, bytes.
    pub peak_memory_bytes: f64,
    /// Model FLOPs utilisation (3× forward FLOPs per sample, recompute not counted).
    pub mfu: f64,
    /// Hardware FLOPs utilisation: [`Predicted::mfu`]'s FLOPs plus the forward FLOPs of the
    /// recomputed layers (Megatron-LM's equation 3 counts this way: 4× forward with full
    /// recompute).
    pub hfu: f64,
}

/// The planner's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanDecision {
    /// Pipeline degree.
    pub pp: usize,
    /// Tensor degree.
    pub tp: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// ZeRO stage.
    pub zero: u8,
    /// Sharded data-parallel group size, when that was asked for.
    pub sharded_dp: Option<usize>,
    /// Microbatches per step.
    pub microbatches: usize,
    /// Samples per microbatch.
    pub microbatch_size: usize,
    /// Schedule.
    pub schedule: ScheduleKind,
    /// Checkpointing rule the search ran under.
    pub checkpointing: CheckpointRule,
    /// Sequence parallelism in the tensor-parallel layers (searched unless fixed).
    pub sequence_parallel: bool,
    /// Placement.
    pub placement: Placement,
    /// Stages in chunk order.
    pub stages: Vec<StageDecision>,
    /// One entry per layer.
    pub layers: Vec<LayerDecision>,
    /// Predictions.
    pub predicted: Predicted,
    /// Memory limit planned against, bytes.
    pub memory_limit_bytes: f64,
    /// Proof of the chosen candidate's ILP, with search-wide bound and gap.
    pub solver: SolveReport,
    /// Candidates solved exactly (by their ILP, or by a quick layout meeting their bound).
    pub candidates_solved: u64,
    /// Candidates skipped by bounds or memory.
    pub candidates_skipped: u64,
    /// The pipeline problem of the chosen candidate (dumpable, re-solvable alone).
    pub problem: problem::PipelineProblem,
    /// Its solution per layer.
    pub choices: Vec<problem::LayerChoice>,
}

/// Search progress for a progress bar.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Progress {
    /// Candidates handled (solved or skipped).
    pub done: u64,
    /// Candidates in total.
    pub total: u64,
    /// Best step time so far.
    pub best_step_s: Option<f64>,
}

/// Plans `model` on `cluster`: searches (pp, tp, dp, ZeRO, microbatches, schedule,
/// placement, checkpointing) within what `opts` fixes, solves the pipeline ILP of the
/// promising candidates and returns the best plan with its proof. Without a global batch,
/// one graph batch per device is planned for.
pub fn plan(
    model: &LayeredGraph,
    cluster: &ClusterSpec,
    opts: &PlanOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<PlanDecision, SolveError> {
    let mut opts = opts.clone();
    opts.global_batch = Some(opts.global_batch_for(model, cluster));
    match opts.baseline {
        Some(b) => baseline::plan_baseline(model, cluster, &opts, b, progress),
        None => search::search(model, cluster, &opts, progress),
    }
}
