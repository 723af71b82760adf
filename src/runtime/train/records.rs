//! What a run reports as it goes: each step's and validation's record, the observer that sees
//! them, and when validation is due.

use std::path::Path;

/// One step's record (the contract's `steps` entries).
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepRecord {
    /// Step number, from 1.
    pub step: usize,
    /// Mean loss over the global batch, before the update.
    pub loss: f64,
    /// Wall time of the step in seconds.
    pub time_s: f64,
    /// CPU time (user + system, all threads) this process spent in the step, in seconds
    /// (10 ms resolution; 0 where `/proc` is not readable). On a loaded machine it follows
    /// the work done better than the wall time.
    pub cpu_s: f64,
    /// Learning rate of the step's update.
    pub lr: f64,
    /// fp16 mixed precision: the scale the step's loss was multiplied by before backward.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// The step's gradients held inf or NaN somewhere, so no rank updated (fp16 loss scaling).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
}

/// CPU time (user + system) of this process so far, in seconds, from `/proc/self/stat`
/// (clock ticks of 1/100 s); 0 where it cannot be read.
pub fn process_cpu_s() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    // fields after the command name (which may hold spaces) in parentheses
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    (tick(11) + tick(12)) as f64 / 100.0
}

/// A rank named a straggler over a window of steps (the `--json` report's `stragglers`
/// entries): its busy time (the step less its waits on peers) against the median rank's.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StragglerRecord {
    /// Global rank.
    pub rank: usize,
    /// The window's first and last step.
    pub steps: [usize; 2],
    /// Its mean busy seconds per step.
    pub compute_s: f64,
    /// Its mean seconds per step waiting on peers.
    pub wait_s: f64,
    /// What it would compute per step at the median rank's pace (the median's busy time
    /// relative to the plan's prediction, times this rank's prediction).
    pub median_compute_s: f64,
    /// Its pace over the median's.
    pub ratio: f64,
    /// Windows in a row it has been named, this one included.
    pub windows_in_a_row: usize,
}

/// One validation result (the `--json` contract's `eval` entries).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct EvalRecord {
    /// Optimizer steps taken before it (0: the initial weights).
    pub step: usize,
    /// Mean loss over the validation batches (forward only).
    pub loss: f64,
}


/// Sees each step and validation as it completes (the CLI draws its progress from it).
pub trait TrainObserver {
    /// Training starts, with `tokens_per_step` tokens in each global batch.
    fn on_start(&mut self, _tokens_per_step: i64) {}
    /// Step `rec.step` is done (its loss is the global mean).
    fn on_step(&mut self, _rec: &StepRecord) {}
    /// A validation is done.
    fn on_eval(&mut self, _rec: &EvalRecord) {}
    /// A checkpoint is complete: its manifest was written to `manifest`.
    fn on_checkpoint(&mut self, _step: usize, _manifest: &Path) {}
    /// The checkpoint of `step` could not be written, and the run goes on without it.
    fn on_checkpoint_failed(&mut self, _step: usize, _error: &str) {}
}

/// An observer that ignores everything.
pub struct Quiet;

impl TrainObserver for Quiet {}

/// When validation runs: before the first step and after every `every`-th, on `batches`
/// batches of the validation data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvalConfig {
    /// Steps between evaluations.
    pub every: usize,
    /// Batches per evaluation.
    pub batches: usize,
}

impl EvalConfig {
    /// Whether validation runs after step `step` (0: before training).
    pub fn due(&self, step: usize) -> bool {
        self.every > 0 && step % self.every == 0
    }
}


/// The mean step time of `steps`, the first (which pays one-time costs) left out when there
/// are others.
pub fn mean_step_time(steps: &[StepRecord]) -> f64 {
    let timed: Vec<f64> = steps.iter().skip(usize::from(steps.len() > 1)).map(|s| s.time_s).collect();
    timed.iter().sum::<f64>() / timed.len().max(1) as f64
}
