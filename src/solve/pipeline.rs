//! The pipeline ILP (PLANNER.md §2): contiguous chunks, one Pareto point and a checkpoint flag
//! per layer, per-device memory with the schedule's in-flight microbatches, boundary
//! transfers, the schedule's step time as objective.

use good_lp::Expression;
use serde::{Deserialize, Serialize};

use super::SolveError;
use super::ilp::{Col, Milp, SolveReport, SolverOptions, value};
use super::problem::{CheckpointRule, LayerChoice, PipelineEval, PipelineObjective, PipelineProblem};

/// Bytes are scaled to GiB inside the ILP to keep coefficients near 1.
const GIB: f64 = (1u64 << 30) as f64;

/// The solved pipeline problem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineSolution {
    /// The proof.
    pub report: SolveReport,
    /// One choice per layer (empty when no solution).
    pub choices: Vec<LayerChoice>,
    /// The choices evaluated under the model (`None` when no solution).
    pub eval: Option<PipelineEval>,
}

impl PipelineProblem {
    /// Checks sizes and ranges; names what is wrong.
    pub fn validate(&self) -> Result<(), SolveError> {
        let chunks = self.chunks();
        if self.devices == 0 || self.virtual_stages == 0 || self.microbatches == 0 {
            return Err(SolveError::Problem("pipeline problem needs devices, virtual stages and microbatches ≥ 1".into()));
        }
        if self.layers.len() < chunks {
            return Err(SolveError::Problem(format!(
                "{} layers cannot fill {} pipeline stages (each stage needs a layer); lower --pp",
                self.layers.len(),
                chunks
            )));
        }
        if self.in_flight.len() != chunks {
            return Err(SolveError::Problem(format!("in_flight has {} entries, expected {chunks}", self.in_flight.len())));
        }
        if self.transfer_s_per_byte.len() + 1 != chunks {
            return Err(SolveError::Problem(format!(
                "transfer_s_per_byte has {} entries, expected {}",
                self.transfer_s_per_byte.len(),
                chunks - 1
            )));
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.points.is_empty() {
                return Err(SolveError::Problem(format!("layer {i} has no Pareto point")));
            }
        }
        if let Some(fixed) = &self.fixed_chunks {
            if fixed.len() != self.layers.len() {
                return Err(SolveError::Problem(format!(
                    "manual layout names {} layers, the model has {}",
                    fixed.len(),
                    self.layers.len()
                )));
            }
            if fixed.windows(2).any(|w| w[1] < w[0]) || fixed.iter().any(|&c| c >= chunks) {
                return Err(SolveError::Problem("manual layout is not contiguous over the stages".into()));
            }
        }
        Ok(())
    }

    fn flags(&self) -> &'static [bool] {
        match self.checkpoint {
            CheckpointRule::Auto => &[false, true],
            CheckpointRule::Never => &[false],
            CheckpointRule::Always => &[true],
        }
    }

    /// Solves the ILP with HiGHS.
    pub fn solve(&self, opts: &SolverOptions) -> Result<PipelineSolution, SolveError> {
        self.validate()?;
        let l_n = self.layers.len();
        let v_n = self.chunks();
        let p = self.devices;
        let flags = self.flags();
        let mut milp = Milp::new();

        // y[l] = list of (chunk, point, checkpoint, col)
        let mut y: Vec<Vec<(usize, usize, bool, Col)>> = Vec::with_capacity(l_n);
        for l in 0..l_n {
            let (lo, hi) = match &self.fixed_chunks {
                Some(f) => (f[l], f[l]),
                None => (l.saturating_sub(l_n - v_n), l.min(v_n - 1)),
            };
            let mut opts_l = Vec::new();
            for c in lo..=hi {
                for j in 0..self.layers[l].points.len() {
                    for &k in flags {
                        opts_l.push((c, j, k, milp.binary()));
                    }
                }
            }
            y.push(opts_l);
        }
        // X[l][c] = Σ_{c' ≤ c} x[l][c'] (cumulative assignment).
        let cum = |l: usize, c: usize| -> Expression {
            let mut e = Expression::default();
            for &(cc, _, _, col) in &y[l] {
                if cc <= c {
                    e.add_mul(1.0, col.v());
                }
            }
            e
        };
        for opts_l in &y {
            let mut one = Expression::default();
            for &(_, _, _, col) in opts_l {
                one.add_mul(1.0, col.v());
            }
            milp.constrain(one.eq(1.0));
        }
        for l in 0..l_n.saturating_sub(1) {
            for c in 0..v_n - 1 {
                milp.constrain(cum(l + 1, c).leq(cum(l, c)));
            }
        }
        for c in 0..v_n {
            let mut e = Expression::default();
            for opts_l in &y {
                for &(cc, _, _, col) in opts_l {
                    if cc == c {
                        e.add_mul(1.0, col.v());
                    }
                }
            }
            milp.constrain(e.geq(1.0));
        }
        // Per device time, sync, memory.
        let mut time = vec![Expression::default(); p];
        let mut sync = vec![Expression::default(); p];
        let mut mem = vec![Expression::default(); p];
        let mut has_ckpt = vec![false; p];
        for (l, opts_l) in y.iter().enumerate() {
            for &(c, j, k, col) in opts_l {
                let pt = &self.layers[l].points[j];
                let d = c % p;
                time[d].add_mul(pt.fwd_s + pt.bwd_s + if k { pt.fwd_s } else { 0.0 }, col.v());
                sync[d].add_mul(pt.sync_s, col.v());
                let kept = if k { pt.input_bytes } else { pt.act_bytes };
                mem[d].add_mul((pt.state_bytes + self.in_flight[c] * kept) / GIB, col.v());
                has_ckpt[d] |= k;
            }
        }
        for d in 0..p {
            if has_ckpt[d] {
                let r = milp.continuous(0.0, f64::INFINITY);
                for (l, opts_l) in y.iter().enumerate() {
                    for &(c, j, k, col) in opts_l {
                        let pt = &self.layers[l].points[j];
                        if k && c % p == d && pt.act_bytes > pt.input_bytes {
                            milp.constrain(Expression::from(r.v()).geq(((pt.act_bytes - pt.input_bytes) / GIB) * col.v()));
                        }
                    }
                }
                mem[d].add_mul(1.0, r.v());
            }
            milp.constrain(mem[d].clone().leq((self.memory_cap - self.workspace) / GIB));
        }
        // Symmetry: identical neighbours in one chunk take options in a fixed order.
        for l in 0..l_n.saturating_sub(1) {
            if self.fixed_chunks.is_none() && self.layers[l] == self.layers[l + 1] {
                let rank = |l: usize| -> Expression {
                    let mut e = Expression::default();
                    for &(_, j, k, col) in &y[l] {
                        e.add_mul((2 * j + k as usize) as f64, col.v());
                    }
                    e
                };
                let big = (2 * self.layers[l].points.len()) as f64;
                let mut last = Expression::default();
                for c in 0..v_n - 1 {
                    last += cum(l, c) - cum(l + 1, c);
                }
                milp.constrain(rank(l).leq(rank(l + 1) + big * last));
            }
        }
        let mut transfer = Expression::default();
        for c in 0..v_n - 1 {
            for l in 0..l_n - 1 {
                let w = 2.0 * self.layers[l].output_bytes * self.transfer_s_per_byte[c];
                if w != 0.0 {
                    transfer += w * (cum(l, c) - cum(l + 1, c));
                }
            }
        }
        let tmax = milp.continuous(0.0, f64::INFINITY);
        let smax = milp.continuous(0.0, f64::INFINITY);
        for d in 0..p {
            milp.constrain(Expression::from(tmax.v()).geq(time[d].clone()));
            milp.constrain(Expression::from(smax.v()).geq(sync[d].clone()));
        }
        let c = self.bubble_coeff;
        let mut step = Expression::default();
        for t in &time {
            step += c * t.clone();
        }
        step += (self.microbatches as f64 - c) * tmax.v();
        step += transfer;
        step += smax.v();
        let (report, values) = match self.objective {
            PipelineObjective::StepTime => milp.minimise(step, 0.0, opts)?,
            PipelineObjective::PeakMemory { max_step_s } => {
                milp.constrain(step.leq(max_step_s));
                let peak = milp.continuous(0.0, f64::INFINITY);
                for d in 0..p {
                    milp.constrain(Expression::from(peak.v()).geq(mem[d].clone()));
                }
                let (mut r, v) = milp.minimise(Expression::from(peak.v()), self.workspace / GIB, opts)?;
                r.objective *= GIB;
                r.bound *= GIB;
                (r, v)
            }
        };
        if values.is_empty() {
            return Ok(PipelineSolution { report, choices: Vec::new(), eval: None });
        }
        let choices: Vec<LayerChoice> = y
            .iter()
            .map(|opts_l| {
                let best = opts_l
                    .iter()
                    .max_by(|a, b| value(&values, a.3).total_cmp(&value(&values, b.3)))
                    .map(|&(c, j, k, _)| LayerChoice { chunk: c, point: j, checkpoint: k });
                best.unwrap_or(LayerChoice { chunk: 0, point: 0, checkpoint: false })
            })
            .collect();
        let eval = self.evaluate(&choices);
        Ok(PipelineSolution { report, choices, eval })
    }
}
