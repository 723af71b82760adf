//! The planner's answer: the chosen configuration, its stages and layers, the predictions and
//! the proof; and the search's progress.

use crate::ir::Parallelism;

use super::ilp::SolveReport;
use super::problem;

/// Memory of one stage per device, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StageMemory {
    /// Weights.
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer state.
    pub optimizer: f64,
    /// Kept activations at the peak (the in-flight microbatches').
    pub activations: f64,
    /// The largest recompute working set among the stage's checkpointed layers: a layer's
    /// activations rebuilt inside its backward and freed after it (a transient, apart from the
    /// kept activations).
    pub recompute: f64,
    /// The training loss's copies at its backward on the stage computing it: the
    /// log-probabilities of the microbatch at the loss and their two gradients (the other
    /// microbatches' are in `activations`). A transient, never at once with a rebuild.
    pub loss: f64,
    /// Workspace margin (counted once per device, on its first stage).
    pub workspace: f64,
    /// Sum of the parts, the larger of `recompute` and `loss` counted.
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
    /// Layers that rebuild only their normalisations' and activation functions' outputs in
    /// the backward (selective recompute).
    pub selective_layers: Vec<usize>,
    /// Checkpointed layers whose kept inputs wait in host memory between forward and backward.
    pub offloaded_layers: Vec<usize>,
    /// Activation bytes per device in host memory instead of on the device at the peak.
    pub offloaded_bytes: f64,
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
    /// Whether its kept inputs are offloaded to host memory.
    pub offload: bool,
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
    /// The chosen parallel configuration (sequence parallelism only where tp > 1).
    pub parallel: Parallelism,
    /// Samples per microbatch.
    pub microbatch_size: usize,
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
    /// Why the context and expert degrees are what they are.
    pub axes: AxisReport,
}

/// Why the search chose its context and expert degrees: what each costs and saves in the
/// chosen plan, and the best any other degree could do.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AxisReport {
    /// Peak activation bytes per rank of the chosen plan (busiest pipeline rank).
    pub activation_bytes: f64,
    /// K/V ring transfer time per step on the busiest pipeline rank, forward and backward.
    pub kv_transfer_s: f64,
    /// The part of it attention compute does not hide.
    pub kv_exposed_s: f64,
    /// Dispatch and combine all-to-all time per step on the busiest pipeline rank.
    pub all_to_all_s: f64,
    /// The part of it run beside another microbatch's compute (combined 1F1B).
    pub all_to_all_hidden_s: f64,
    /// Expert-imbalance compute per step on the busiest pipeline rank.
    pub imbalance_s: f64,
    /// Model-state bytes of the chosen plan's pipeline rank holding the most.
    pub state_bytes: f64,
    /// The same rank's model-state bytes at e = 1, same plan otherwise (equal at e = 1).
    pub state_bytes_without_ep: f64,
    /// One sample's checkpointed activations over the whole model (its layers' inputs),
    /// bytes: what decides whether context degrees above 1 are searched.
    pub sample_input_bytes: f64,
    /// Per context degree searched: the least step-time lower bound of its configurations
    /// that fit memory (`None`: none fit).
    pub cp_alternatives: Vec<(usize, Option<f64>)>,
    /// Per expert degree searched, the same.
    pub ep_alternatives: Vec<(usize, Option<f64>)>,
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
