//! Stragglers: ranks that compute slower than the others. In a synchronous step every rank
//! takes the same wall time (the fast ones wait in collectives for the slow one), so a rank is
//! judged by its *busy* time: the step's wall time less the time it waited on peers. Over each
//! window of steps the ranks all-gather their mean busy and wait times; a rank whose busy time,
//! relative to the compute the plan predicts for its stages (so unequal pipeline stages do not
//! count), exceeds the median rank's by `factor` is named. Every rank computes the same answer
//! from the same gathered figures, so with `--drop-stragglers N` (under `launch --elastic`)
//! all agree when a rank named N windows in a row leaves the job.

use tch::{Kind, Tensor};

use crate::runtime::RuntimeError;
use crate::runtime::comm::ProcessGroup;
use crate::runtime::terr;
use crate::runtime::train::{Leave, StragglerRecord};

/// The environment variable by which `launch --elastic --drop-stragglers N` tells the ranks N.
pub const DROP_STRAGGLERS_ENV: &str = "SMP_DROP_STRAGGLERS";

/// Below this many seconds per step of excess busy time a rank is never named (timer noise
/// on a small model).
const MIN_EXCESS_S: f64 = 0.005;

/// How stragglers are found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StragglerOptions {
    /// A rank is named when its relative busy time exceeds the median's by this factor
    /// (`--straggler-factor`).
    pub factor: f64,
    /// Steps per window (`--straggler-window`).
    pub window: usize,
    /// Under `launch --elastic --drop-stragglers N`: windows in a row after which a named rank
    /// leaves the job.
    pub drop_after: Option<usize>,
}

impl Default for StragglerOptions {
    fn default() -> Self {
        StragglerOptions { factor: 1.5, window: 5, drop_after: None }
    }
}

/// One rank's figures over a window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Figures {
    /// Mean busy seconds per step.
    pub busy_s: f64,
    /// Mean seconds per step waiting on peers.
    pub wait_s: f64,
    /// The compute the plan predicts for the rank's stages per step (0: none predicted).
    pub predicted_s: f64,
}

/// The ranks named over one window of `first..=last`, given every rank's figures (by global
/// rank) and how many windows in a row each was named before; updates `in_a_row`.
pub(super) fn judge(all: &[Figures], factor: f64, (first, last): (usize, usize), in_a_row: &mut [usize]) -> Vec<StragglerRecord> {
    let relative: Vec<f64> = all.iter().map(|f| if f.predicted_s > 0.0 { f.busy_s / f.predicted_s } else { f.busy_s }).collect();
    let mut sorted: Vec<f64> = relative.iter().copied().filter(|x| x.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let median = match sorted.len() {
        0 => return Vec::new(),
        n if n % 2 == 1 => sorted[n / 2],
        n => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    };
    let mut out = Vec::new();
    for (rank, (f, rel)) in all.iter().zip(&relative).enumerate() {
        // what the rank would take at the median's pace
        let expected = if f.predicted_s > 0.0 { median * f.predicted_s } else { median };
        let named = median > 0.0 && *rel > factor * median && f.busy_s - expected > MIN_EXCESS_S;
        in_a_row[rank] = if named { in_a_row[rank] + 1 } else { 0 };
        if named {
            out.push(StragglerRecord {
                rank,
                steps: [first, last],
                compute_s: f.busy_s,
                wait_s: f.wait_s,
                median_compute_s: expected,
                ratio: rel / median,
                windows_in_a_row: in_a_row[rank],
            });
        }
    }
    out
}

/// A rank's straggler watch over the run.
pub(super) struct Stragglers {
    opts: StragglerOptions,
    predicted_s: f64,
    busy: f64,
    wait: f64,
    steps: usize,
    first: usize,
    /// The run's first step (warm-up, slow everywhere) is not judged.
    warmed: bool,
    in_a_row: Vec<usize>,
    /// Every rank named so far, window by window.
    pub named: Vec<StragglerRecord>,
    /// The ranks that leave the job (`drop_after` windows in a row), once some must.
    pub leave: Option<Leave>,
}

impl Stragglers {
    /// The watch of a rank among `world` whose stages the plan predicts to compute for
    /// `predicted_s` per step.
    pub fn new(opts: StragglerOptions, world: usize, predicted_s: f64) -> Stragglers {
        Stragglers { opts, predicted_s, busy: 0.0, wait: 0.0, steps: 0, first: 0, warmed: false, in_a_row: vec![0; world], named: Vec::new(), leave: None }
    }

    /// Counts a step (`step_s` wall seconds, `wait_s` of them waiting on peers); at a window's
    /// end gathers every rank's figures over `world` (a collective: every rank calls this after
    /// every step) and returns the ranks named.
    pub fn after_step(&mut self, world: &ProcessGroup, step: usize, step_s: f64, wait_s: f64) -> Result<Vec<StragglerRecord>, RuntimeError> {
        if self.opts.window == 0 || world.size() < 2 || !std::mem::replace(&mut self.warmed, true) {
            return Ok(Vec::new());
        }
        if self.steps == 0 {
            self.first = step;
        }
        self.busy += (step_s - wait_s).max(0.0);
        self.wait += wait_s;
        self.steps += 1;
        if self.steps < self.opts.window {
            return Ok(Vec::new());
        }
        let n = self.steps as f64;
        let mine = Tensor::from_slice(&[self.busy / n, self.wait / n, self.predicted_s]);
        let all = Tensor::f_zeros([3 * world.size() as i64], (Kind::Double, tch::Device::Cpu))?;
        world.all_gather(&all, &mine)?;
        let all: Vec<f64> = Vec::<f64>::try_from(&all).map_err(|e| terr(e.to_string()))?;
        let figures: Vec<Figures> = all.chunks(3).map(|c| Figures { busy_s: c[0], wait_s: c[1], predicted_s: c[2] }).collect();
        let named = judge(&figures, self.opts.factor, (self.first, step), &mut self.in_a_row);
        (self.busy, self.wait, self.steps) = (0.0, 0.0, 0);
        if let Some(n) = self.opts.drop_after.filter(|_| self.leave.is_none()) {
            let ranks: Vec<usize> = named.iter().filter(|s| s.windows_in_a_row >= n).map(|s| s.rank).collect();
            if !ranks.is_empty() {
                let why = format!("named a straggler {n} windows in a row (--drop-stragglers {n})");
                self.leave = Some(Leave { ranks, why, step });
            }
        }
        self.named.extend(named.iter().cloned());
        Ok(named)
    }
}

/// The progress line of a rank named a straggler.
pub(super) fn describe(s: &StragglerRecord) -> String {
    format!(
        "straggler: rank {} over steps {}-{}: computes {:.3} s/step, {:.1}× the median rank's pace ({:.3} s), waits {:.3} s/step",
        s.rank, s.steps[0], s.steps[1], s.compute_s, s.ratio, s.median_compute_s, s.wait_s
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(busy_s: f64, predicted_s: f64) -> Figures {
        Figures { busy_s, wait_s: 0.01, predicted_s }
    }

    #[test]
    fn the_slow_rank_is_named_relative_to_its_predicted_work() {
        let mut row = vec![0; 4];
        // equal work: rank 2 computes twice as long
        let named = judge(&[f(0.10, 1.0), f(0.11, 1.0), f(0.20, 1.0), f(0.10, 1.0)], 1.5, (2, 6), &mut row);
        assert_eq!(named.iter().map(|s| s.rank).collect::<Vec<_>>(), vec![2]);
        assert_eq!(named[0].steps, [2, 6]);
        assert!((named[0].ratio - 0.20 / 0.105).abs() < 1e-9, "{:?}", named[0]);
        assert_eq!(row, vec![0, 0, 1, 0]);
        // unequal pipeline stages as predicted: nobody is slow
        assert!(judge(&[f(0.10, 1.0), f(0.20, 2.0), f(0.10, 1.0), f(0.21, 2.0)], 1.5, (7, 11), &mut row).is_empty());
        assert_eq!(row, vec![0; 4]);
        // twice in a row
        judge(&[f(0.1, 0.0), f(0.1, 0.0), f(0.5, 0.0)], 1.5, (1, 5), &mut row[..3]);
        let again = judge(&[f(0.1, 0.0), f(0.1, 0.0), f(0.5, 0.0)], 1.5, (6, 10), &mut row[..3]);
        assert_eq!(again[0].windows_in_a_row, 2);
        // within timer noise: nobody
        assert!(judge(&[f(0.001, 1.0), f(0.004, 1.0), f(0.001, 1.0)], 1.5, (1, 5), &mut row[..3]).is_empty());
    }
}
