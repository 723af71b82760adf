//! The one report of a run (`--json`): its steps, validations and checkpoints, throughput, and
//! what each rank measured.

use serde::{Deserialize, Serialize};

use crate::plan::Plan;
use crate::runtime::rank::{MemoryParts, PhaseTimes, RankStats, StateBytes};
use crate::runtime::train::{CheckpointRecord, EvalRecord, FailedCheckpoint, StepRecord, StragglerRecord};

/// What a run did and measured (the runner's `--json` object).
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// One record per step run (global mean loss).
    pub steps: Vec<StepRecord>,
    /// Global samples over the measured step time.
    pub samples_per_s: f64,
    /// The step time: the mean over steps after the first, on the slowest rank.
    pub measured_step_time_s: f64,
    /// The plan's prediction, for a plan's run.
    pub predicted_step_time_s: Option<f64>,
    /// Wall time of the training loop.
    pub wall_s: f64,
    /// Every rank's measurements.
    pub ranks: Vec<RankEntry>,
    /// Validations.
    pub eval: Vec<EvalRecord>,
    /// Checkpoints completed.
    pub checkpoints: Vec<CheckpointRecord>,
    /// Checkpoints the run went on without (`--on-checkpoint-error continue`).
    pub failed_checkpoints: Vec<FailedCheckpoint>,
    /// The checkpoint the run resumed from.
    pub resumed_from: Option<String>,
    /// The restarts `smp-runner launch --max-restarts` made before this run (its failures),
    /// and under `--elastic` each change of the job's devices.
    pub restarts: Vec<RestartRecord>,
    /// Ranks named stragglers, one entry per rank and window of steps.
    pub stragglers: Vec<StragglerRecord>,
    /// Where the trained weights were written (`--save-weights`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saved_weights: Option<String>,
}

/// One rank's line of the report.
#[derive(Clone, Debug, Serialize)]
pub struct RankEntry {
    /// Global rank.
    pub rank: usize,
    /// Mean step time after the first step.
    pub step_time_s: f64,
    /// Peak resident memory of the process.
    pub peak_memory_bytes: u64,
    /// What a rank of a multi-rank plan measured beside.
    #[serde(flatten)]
    pub detail: Option<RankDetail>,
}

/// What a rank of a plan measured beside its time and peak memory.
#[derive(Clone, Debug, Serialize)]
pub struct RankDetail {
    /// The planner's memory for this rank's pipeline rank.
    pub predicted_memory_bytes: Option<u64>,
    /// Parameters, gradients and optimizer state held at the state's peak.
    pub peak_state_bytes: u64,
    /// That peak by kind.
    pub peak_state: StateEntry,
    /// The most parameter bytes held at any point.
    pub peak_param_bytes: u64,
    /// Parameter bytes held between steps.
    pub resident_param_bytes: u64,
    /// Weight bytes read (trained parameters, everything else).
    pub weight_bytes_read: ReadEntry,
    /// Mean CPU time per step.
    pub cpu_time_s: f64,
    /// Where the mean step's wall time went.
    pub phases: PhaseEntry,
    /// The most bytes of recomputed stages' kept inputs on the device (the accounted device
    /// pool of activation offloading).
    pub peak_kept_activation_bytes: u64,
    /// The most bytes of kept inputs offloaded to host memory.
    pub peak_offloaded_activation_bytes: u64,
    /// Context-parallel all-gathers in one forward of the rank's stages (keys and values).
    pub context_gathers: u64,
    /// The rank's memory by part: what the plan predicts and what the rank measured.
    pub memory: MemoryReport,
}

/// A rank's memory by part, predicted and measured (bytes).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct MemoryReport {
    /// The plan's figures for the rank's pipeline rank (the sum of its stages').
    pub predicted: Option<MemoryEntry>,
    /// The bytes of the tensors the rank held at its peak (a counting CPU allocator; absent on
    /// a GPU).
    pub measured: Option<MemoryEntry>,
}

/// Memory by part (bytes): `total` is what the device holds, every part but `offloaded`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryEntry {
    /// Parameters.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state (moments, master weights).
    pub optimizer: u64,
    /// Kept activations (checkpointed inputs, microbatches in flight, received values).
    pub activations: u64,
    /// Kept inputs in host memory (activation offloading).
    pub offloaded: u64,
    /// Transient bytes at the peak (predicted: the plan's workspace margin and the larger of its
    /// recompute working set, which the backward that rebuilds it frees, and the loss's working
    /// copies).
    pub temporaries: u64,
    /// Tensors held through a step that are no part above (data batches, constants, buffers);
    /// the plan predicts none.
    pub other: u64,
    /// The device's bytes at the peak.
    pub total: u64,
}

impl MemoryEntry {
    /// The plan's figures for pipeline rank `pp`.
    pub fn predicted(plan: &Plan, pp: usize) -> MemoryEntry {
        let m = plan.rank_memory(pp);
        let offloaded = plan.stages_of_rank(pp).map(|s| s.offloaded_bytes).fold(0u64, u64::saturating_add);
        // each stage's larger transient, as its total counts it
        let transients = plan.stages_of_rank(pp).map(|s| s.memory_bytes.recompute.max(s.memory_bytes.loss)).fold(0u64, u64::saturating_add);
        MemoryEntry { params: m.params, grads: m.grads, optimizer: m.optimizer, activations: m.activations, offloaded, temporaries: m.workspace.saturating_add(transients), other: 0, total: m.total }
    }

    /// What a rank measured.
    pub fn measured(m: &MemoryParts) -> MemoryEntry {
        let MemoryParts { params, grads, optimizer, activations, offloaded, temporaries, other, total } = *m;
        MemoryEntry { params, grads, optimizer, activations, offloaded, temporaries, other, total }
    }
}

/// Trained state bytes by kind.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct StateEntry {
    /// Parameters.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer moments.
    pub optimizer: u64,
}

/// Weight bytes read.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ReadEntry {
    /// Trained parameters.
    pub params: u64,
    /// Everything else.
    pub other: u64,
}

/// A step's wall time by kind of work.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct PhaseEntry {
    /// Passes (recomputation included).
    pub compute_s: f64,
    /// Sends.
    pub send_s: f64,
    /// Receive waits.
    pub recv_s: f64,
    /// Collectives.
    pub collective_s: f64,
    /// Clipping and the optimizer.
    pub optimizer_s: f64,
}

impl RankDetail {
    /// The detail of `st`, with the plan's prediction for its rank.
    pub fn of(st: &RankStats, predicted: Option<MemoryEntry>) -> RankDetail {
        let predicted_memory_bytes = predicted.map(|p| p.total);
        let StateBytes { params, grads, optimizer } = st.peak_state;
        let PhaseTimes { compute_s, send_s, recv_s, collective_s, optimizer_s } = st.phases;
        RankDetail {
            predicted_memory_bytes,
            peak_state_bytes: st.peak_state.total(),
            peak_state: StateEntry { params, grads, optimizer },
            peak_param_bytes: st.peak_param_bytes,
            resident_param_bytes: st.resident_param_bytes,
            weight_bytes_read: ReadEntry { params: st.weight_bytes_read.params, other: st.weight_bytes_read.other },
            cpu_time_s: st.cpu_time_s,
            phases: PhaseEntry { compute_s, send_s, recv_s, collective_s, optimizer_s },
            peak_kept_activation_bytes: st.peak_kept_bytes,
            peak_offloaded_activation_bytes: st.peak_offloaded_bytes,
            context_gathers: st.context_gathers,
            memory: MemoryReport { predicted, measured: st.memory.as_ref().map(MemoryEntry::measured) },
        }
    }
}

/// The environment variable through which `smp-runner launch` tells the ranks of a restarted
/// run what failed before (a JSON list of [`RestartRecord`]s).
pub const RESTARTS_ENV: &str = "SMP_RESTARTS";

/// One restart of a run (the `--json` report's `restarts` entries).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RestartRecord {
    /// Which start this restart was (1: the first restart).
    pub attempt: usize,
    /// What failed: the rank and its cause (or, growing, the hosts that joined).
    pub cause: String,
    /// The step of the checkpoint the restart resumed (none: from the start).
    pub resumed_from_step: Option<usize>,
    /// That checkpoint's directory.
    pub checkpoint: Option<String>,
    /// Under `launch --elastic`, the change of the job's devices this restart made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership: Option<MembershipChange>,
    /// When the launcher saw the fault (or decided to grow), in seconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_at_unix_s: Option<f64>,
    /// Seconds from then to the end of the first step after the restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault_to_first_step_s: Option<f64>,
}

/// A change of an elastic job's devices: who left or joined, and the plans before and after.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MembershipChange {
    /// Hosts or devices lost (`host 1`, `host 0 device 1`).
    pub lost: Vec<String>,
    /// Hosts or devices that joined.
    pub joined: Vec<String>,
    /// Devices before and after.
    pub devices: [usize; 2],
    /// The plan files before and after (the new one kept beside the checkpoints).
    pub plans: [String; 2],
    /// Their meshes (`pp2 dp2 tp1 zero0`).
    pub meshes: [String; 2],
    /// Their predicted step times.
    pub predicted_step_time_s: [f64; 2],
}

/// The value of [`RESTARTS_ENV`] that tells a restarted run's ranks what failed before.
pub fn restarts_env_value(history: &[RestartRecord]) -> String {
    serde_json::to_string(history).unwrap_or_else(|_| "[]".into())
}

/// The restarts the launcher recorded for this run ([`RESTARTS_ENV`]; none when unset or
/// unreadable).
pub fn restarts_from_env() -> Vec<RestartRecord> {
    std::env::var(RESTARTS_ENV).ok().and_then(|v| serde_json::from_str(&v).ok()).unwrap_or_default()
}

/// The restarts of this run ([`restarts_from_env`]) with the time from the latest fault to the
/// end of this run's first step (`first_step_unix_s`), when it ran one.
pub fn restarts_with_first_step(first_step_unix_s: Option<f64>) -> Vec<RestartRecord> {
    let mut all = restarts_from_env();
    if let (Some(last), Some(t)) = (all.last_mut(), first_step_unix_s) {
        if let (None, Some(fault)) = (last.fault_to_first_step_s, last.fault_at_unix_s) {
            last.fault_to_first_step_s = Some((t - fault).max(0.0));
        }
    }
    all
}

/// The losses of a run's `--json` report (the last JSON object in `stdout`), in step order.
pub fn losses_of_report(stdout: &str) -> Option<Vec<f64>> {
    let report: serde_json::Value = stdout.lines().rev().filter(|l| l.trim_start().starts_with('{')).find_map(|l| serde_json::from_str(l).ok())?;
    report.get("steps")?.as_array()?.iter().map(|s| s.get("loss")?.as_f64()).collect()
}

/// The worst difference of one kind between a plan's run and one process's.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyDiff {
    /// The tensor (module name) or step.
    pub name: String,
    /// Relative difference (norm-relative for tensors).
    pub rel: f64,
}

/// What `smp-runner launch --verify` found (its `--json` object).
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    /// Steps each side trained, in f64.
    pub steps: usize,
    /// The largest difference f64 rounding explains.
    pub tolerance: f64,
    /// The plan's losses.
    pub plan_losses: Vec<f64>,
    /// One process's losses.
    pub one_process_losses: Vec<f64>,
    /// The worst step's loss.
    pub loss: Option<VerifyDiff>,
    /// The worst parameter.
    pub parameters: Option<VerifyDiff>,
    /// The worst buffer (running statistics).
    pub buffers: Option<VerifyDiff>,
    /// Tensors compared.
    pub tensors: usize,
    /// Every difference within `tolerance`.
    pub passed: bool,
    /// What the plan says makes it differ from one process (BatchNorm statistics per
    /// microbatch or replica), where it does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected_difference: Option<String>,
    /// The model's own sensitivity to f32 rounding: one process's losses over the same steps in
    /// f32 against its f64 ones, the worst step (relative). Two f32 runs that round differently
    /// (a plan's and PyTorch's, or two plans') differ by about as much.
    pub f32_drift: Option<VerifyDiff>,
    /// The same run's parameters, f32 against f64, all together (norm-relative).
    pub f32_parameter_drift: Option<VerifyDiff>,
}

/// An f32 loss drift past this (relative, over the check's steps) makes f32 comparisons of the
/// model's runs at the usual 1e-5 meaningless: compare in f64.
pub const F32_SENSITIVE: f64 = 1e-5;

impl VerifyReport {
    /// The report as lines for a person.
    pub fn lines(&self) -> Vec<String> {
        let show = |what: &str, d: &Option<VerifyDiff>| match d {
            Some(d) => format!("{what}: largest difference {:.2e} ({})", d.rel, d.name),
            None => format!("{what}: none"),
        };
        let mut out = vec![
            format!("verified {} f64 steps of the plan against one process ({} tensors)", self.steps, self.tensors),
            show("losses", &self.loss),
            show("parameters", &self.parameters),
            show("buffers", &self.buffers),
        ];
        if let Some(d) = &self.f32_drift {
            let weights = self.f32_parameter_drift.as_ref().map_or(String::new(), |w| format!(", its weights by {:.2e} ({})", w.rel, w.name));
            out.push(format!("f32 rounding: one process's f32 losses differ from its f64 losses by {:.2e} ({}){weights}", d.rel, d.name));
            if d.rel > F32_SENSITIVE {
                out.push(format!(
                    "the model is sensitive to f32 rounding: any two f32 runs of it that round differently (a plan's and PyTorch's, or two plans') differ in loss by about {:.0e} within {} steps; compare them in f64, as this check does",
                    d.rel, self.steps
                ));
            }
        }
        out.push(if self.passed {
            format!("the plan trains as one process does (every difference ≤ {:.0e})", self.tolerance)
        } else {
            match &self.expected_difference {
                Some(why) => format!("the plan differs from one process beyond {:.0e}, as it says it will: {why}", self.tolerance),
                None => format!("the plan differs from one process beyond {:.0e}: this plan does not train the model right; please report it with the plan and model", self.tolerance),
            }
        });
        out
    }
}
