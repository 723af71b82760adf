//! The pipeline ILP (docs/planner.md §2): contiguous chunks, one Pareto point, a checkpoint flag
//! and an offload flag per layer, per-device memory with the schedule's in-flight microbatches, boundary
//! transfers, the schedule's step time as objective.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use good_lp::Expression;
use serde::{Deserialize, Serialize};

use super::SolveError;
use super::ilp::{Col, Milp, SolveReport, SolverOptions, value};
use super::oracle::min_max_cuts;
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
        if let Some(fixed) = &self.fixed_checkpoints
            && fixed.len() != self.layers.len()
        {
            return Err(SolveError::Problem(format!(
                "fixed recompute names {} layers, the model has {}",
                fixed.len(),
                self.layers.len()
            )));
        }
        Ok(())
    }

    /// Lower bounds on the largest device time and sync time: the min-max split of the
    /// layers' least figures (or the manual layout's device sums).
    pub fn dp_bounds(&self) -> (f64, f64) {
        let p = self.devices;
        let v_n = self.chunks();
        let tmin: Vec<f64> = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let always = self.checkpoint_of(i) == CheckpointRule::Always;
                l.points.iter().map(|q| q.fwd_s + q.bwd_s + if always { q.recompute_s() } else { 0.0 }).fold(f64::INFINITY, f64::min)
            })
            .collect();
        let smin: Vec<f64> = self.layers.iter().map(|l| l.points.iter().map(|q| self.sync_of(q)).fold(f64::INFINITY, f64::min)).collect();
        if let Some(f) = &self.fixed_chunks {
            let mut t = vec![0.0; p];
            let mut s = vec![0.0; p];
            for (l, &c) in f.iter().enumerate() {
                t[c % p] += tmin[l];
                s[c % p] += smin[l];
            }
            return (t.iter().cloned().fold(0.0, f64::max), s.iter().cloned().fold(0.0, f64::max));
        }
        let Some((tau, _)) = min_max_cuts(&tmin, v_n) else { return (0.0, 0.0) };
        let sigma = if self.virtual_stages == 1 { min_max_cuts(&smin, p).map_or(0.0, |s| s.0) } else { 0.0 };
        (tau, sigma)
    }

    /// Maximal runs of consecutive identical layers (and, with a manual layout, the same
    /// chunk): `(first layer, length)`. A layer owning a tied weight is a run alone, so the
    /// model knows its device.
    pub fn runs(&self) -> Vec<(usize, usize)> {
        let owners: BTreeSet<usize> = self.layers.iter().flat_map(|l| l.tied.iter().map(|t| t.owner)).collect();
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for l in 0..self.layers.len() {
            let same = l > 0
                && self.layers[l] == self.layers[l - 1]
                && !owners.contains(&l)
                && !owners.contains(&(l - 1))
                && self.fixed_chunks.as_ref().is_none_or(|f| f[l] == f[l - 1])
                && self.checkpoint_of(l) == self.checkpoint_of(l - 1);
            match runs.last_mut() {
                Some(r) if same => r.1 += 1,
                _ => runs.push((l, 1)),
            }
        }
        runs
    }

    /// Solves the ILP with HiGHS.
    ///
    /// Identical neighbouring layers are interchangeable inside a chunk, so the model counts
    /// them: `n[r][c][o]` layers of run r sit on chunk c with option o (point × checkpoint
    /// flag). Chunks take the layers in order: `h[r][c]` = some of run r lies in chunks ≤ c,
    /// `z[r][c]` = all of it does, and `h[r+1][c] ≤ z[r][c]` makes every chunk prefix a model
    /// prefix. A 96-block model then has a handful of integers per chunk, not 96 × chunks
    /// binaries and their symmetry.
    pub fn solve(&self, opts: &SolverOptions) -> Result<PipelineSolution, SolveError> {
        self.solve_below(opts, None)
    }

    /// [`solve`](Self::solve) with the step time constrained to at most `cutoff` (an
    /// incumbent from elsewhere): `Infeasible` then means no layout of this problem beats it.
    /// A plain constraint, so HiGHS prunes by it like by any other row.
    pub fn solve_below(&self, opts: &SolverOptions, cutoff: Option<f64>) -> Result<PipelineSolution, SolveError> {
        self.validate()?;
        let runs = self.runs();
        let mut milp = Milp::new();
        let n = self.counts(&mut milp, &runs);
        let (h, z) = self.chunk_order(&mut milp, &runs, &n);
        let mut dev = self.device_sums(&mut milp, &runs, &n);
        self.tied_copies(&mut milp, &runs, &n, &mut dev.mem);
        self.chunk_extras(&mut milp, &runs, &n, &h, &z, &mut dev.mem);
        self.cap_memory(&mut milp, &mut dev);
        let transfer = self.transfer(&runs, &h);
        let step = self.step_time(&mut milp, &dev, transfer);
        let (report, values) = match self.objective {
            PipelineObjective::StepTime => {
                if let Some(u) = cutoff {
                    milp.constrain(step.clone().leq(u));
                }
                milp.minimise(step, 0.0, opts)?
            }
            PipelineObjective::PeakMemory { max_step_s } => {
                milp.constrain(step.leq(max_step_s));
                let peak = milp.continuous(0.0, f64::INFINITY);
                for d in 0..self.devices {
                    milp.constrain(Expression::from(peak.v()).geq(dev.mem[d].clone()));
                }
                let (mut r, v) = milp.minimise(Expression::from(peak.v()), self.reserved() / GIB, opts)?;
                r.objective *= GIB;
                r.bound *= GIB;
                (r, v)
            }
        };
        if values.is_empty() {
            return Ok(PipelineSolution { report, choices: Vec::new(), eval: None });
        }
        let mut choices = decode(&values, &runs, &n)?;
        // a run's layers are interchangeable: offload only those memory needs
        self.trim_offload(&mut choices);
        let eval = self.evaluate(&choices);
        Ok(PipelineSolution { report, choices, eval })
    }

    /// The count columns `n[r][c]`: layers of run r on chunk c with each option (point ×
    /// checkpoint and offload flags); empty where chunk c cannot hold run r.
    fn counts(&self, milp: &mut Milp, runs: &[(usize, usize)]) -> Counts {
        let (l_n, v_n) = (self.layers.len(), self.chunks());
        // options of a run: (point, (checkpoint, offload)); a run's layers share their rule
        let options = |r: usize| -> Vec<(usize, (bool, bool))> {
            let lay = &self.layers[runs[r].0];
            let flags = self.flag_options(runs[r].0);
            (0..lay.points.len()).flat_map(|j| flags.iter().filter(move |k| self.combines(runs[r].0, j, k.0)).map(move |&k| (j, k))).collect()
        };
        let mut n: Counts = Vec::with_capacity(runs.len());
        for (r, &(first, len)) in runs.iter().enumerate() {
            let (lo, hi) = match &self.fixed_chunks {
                Some(f) => (f[first], f[first]),
                None => ((first).saturating_sub(l_n - v_n), (first + len - 1).min(v_n - 1)),
            };
            let mut per_chunk = Vec::with_capacity(v_n);
            for c in 0..v_n {
                if c < lo || c > hi {
                    per_chunk.push(Vec::new());
                    continue;
                }
                per_chunk.push(options(r).into_iter().map(|o| (o, if len == 1 { milp.binary() } else { milp.integer(0.0, len as f64) })).collect());
            }
            n.push(per_chunk);
        }
        n
    }

    /// Every run placed whole, every chunk non-empty, and chunks taking the layers in order:
    /// `h[r][c]` = some of run r lies in chunks ≤ c, `z[r][c]` = all of it does, and
    /// `h[r+1][c] ≤ z[r][c]`. Returns h and z.
    fn chunk_order(&self, milp: &mut Milp, runs: &[(usize, usize)], n: &Counts) -> (Vec<Vec<Expression>>, Vec<Vec<Expression>>) {
        let v_n = self.chunks();
        for (r, &(_, len)) in runs.iter().enumerate() {
            milp.constrain(cum(n, r, v_n - 1).eq(len as f64));
        }
        for c in 0..v_n {
            let mut e = Expression::default();
            for r in 0..runs.len() {
                e += count(n, r, c);
            }
            milp.constrain(e.geq(1.0));
        }
        // h[r][c], z[r][c] for c < v_n − 1.
        let mut h: Vec<Vec<Expression>> = Vec::with_capacity(runs.len());
        let mut z: Vec<Vec<Expression>> = Vec::with_capacity(runs.len());
        for (r, &(_, len)) in runs.iter().enumerate() {
            let mut hr = Vec::with_capacity(v_n);
            let mut zr = Vec::with_capacity(v_n);
            for c in 0..v_n.saturating_sub(1) {
                let u = cum(n, r, c);
                let hc = milp.binary();
                milp.constrain(u.clone().leq(len as f64 * hc.v()));
                milp.constrain(u.clone().geq(hc.v()));
                hr.push(Expression::from(hc.v()));
                if len == 1 {
                    zr.push(Expression::from(hc.v()));
                } else {
                    let zc = milp.binary();
                    milp.constrain(u.geq(len as f64 * zc.v()));
                    zr.push(Expression::from(zc.v()));
                }
            }
            h.push(hr);
            z.push(zr);
        }
        for r in 0..runs.len().saturating_sub(1) {
            for c in 0..v_n.saturating_sub(1) {
                milp.constrain(h[r + 1][c].clone().leq(z[r][c].clone()));
            }
        }
        (h, z)
    }

    /// [`PipelineProblem::chunk_extra_bytes`] in the model: chunk c holds the largest shared
    /// input of the runs it meets (run r meets chunk c exactly when h[r][c] − z[r][c−1] is 1,
    /// with h[r][last] = 1 and z[r][−1] = 0), for its in-flight microbatches; under ZB-H1,
    /// where only checkpointed layers of the run sit in chunk c, for those to their B (a binary
    /// per such run and chunk says some layer there keeps its activations).
    fn chunk_extras(&self, milp: &mut Milp, runs: &[(usize, usize)], n: &Counts, h: &[Vec<Expression>], z: &[Vec<Expression>], mem: &mut [Expression]) {
        let (p, v_n) = (self.devices, self.chunks());
        let h_at = |r: usize, c: usize| if c + 1 < v_n { h[r][c].clone() } else { Expression::from(1.0) };
        for c in 0..v_n {
            let (f, k) = (self.in_flight[c], self.kept_flight(c));
            let mut held: Option<Col> = None;
            for (r, &(first, len)) in runs.iter().enumerate() {
                let shared = self.layers[first].points.iter().map(|q| q.shared_bytes).fold(0.0, f64::max);
                if shared > 0.0 {
                    let y = *held.get_or_insert_with(|| milp.continuous(0.0, f64::INFINITY));
                    let meets = if c == 0 { h_at(r, c) } else { h_at(r, c) - z[r][c - 1].clone() };
                    let may_checkpoint = n[r][c].iter().any(|&((_, (ck, _)), _)| ck);
                    if k < f && may_checkpoint {
                        milp.constrain(Expression::from(y.v()).geq((k * shared / GIB) * meets));
                        // where some option keeps activations (not under an `Always` rule)
                        if n[r][c].iter().any(|&((_, (ck, _)), _)| !ck) {
                            let mut keeping = Expression::default();
                            for &((_, (ck, _)), col) in &n[r][c] {
                                if !ck {
                                    keeping.add_mul(1.0, col.v());
                                }
                            }
                            let some = milp.binary();
                            milp.constrain(keeping.leq(len as f64 * some.v()));
                            milp.constrain(Expression::from(y.v()).geq(Expression::from(some.v()) * (f * shared / GIB)));
                        }
                    } else {
                        milp.constrain(Expression::from(y.v()).geq((f * shared / GIB) * meets));
                    }
                }
            }
            if let Some(y) = held {
                mem[c % p].add_mul(1.0, y.v());
            }
        }
    }

    /// Per device: compute time, sync time, memory, and the recompute buffers it may need.
    fn device_sums(&self, milp: &mut Milp, runs: &[(usize, usize)], n: &Counts) -> DeviceSums {
        let p = self.devices;
        let mut s = DeviceSums {
            time: vec![Expression::default(); p],
            sync: vec![Expression::default(); p],
            mem: vec![Expression::default(); p],
            recompute: vec![Vec::new(); p],
        };
        for (r, &(first, len)) in runs.iter().enumerate() {
            let lay = &self.layers[first];
            for c in 0..self.chunks() {
                let d = c % p;
                for &((j, (k, o)), col) in &n[r][c] {
                    let pt = &lay.points[j];
                    let (f, b) = Self::layer_times(pt, k, o);
                    s.time[d].add_mul(f + b, col.v());
                    s.sync[d].add_mul(self.sync_of(pt), col.v());
                    s.mem[d].add_mul((pt.state_bytes + self.kept_bytes(c, pt, k, o)) / GIB, col.v());
                    if pt.transient_bytes(k) > 0.0 {
                        let used = if len == 1 {
                            Expression::from(col.v())
                        } else {
                            let w = milp.binary();
                            milp.constrain(Expression::from(col.v()).leq(len as f64 * w.v()));
                            Expression::from(w.v())
                        };
                        s.recompute[d].push((pt.transient_bytes(k) / GIB, used));
                    }
                }
            }
        }
        s
    }

    /// A tied weight's copy: held on device d when a reader is there and its owner is not.
    fn tied_copies(&self, milp: &mut Milp, runs: &[(usize, usize)], n: &Counts, mem: &mut [Expression]) {
        let (p, v_n) = (self.devices, self.chunks());
        let run_of = |l: usize| runs.iter().position(|&(f, len)| l >= f && l < f + len);
        let mut on_device: HashMap<(usize, usize), Expression> = HashMap::new();
        let mut on = |milp: &mut Milp, r: usize, d: usize| -> Expression {
            if let Some(e) = on_device.get(&(r, d)) {
                return e.clone();
            }
            let len = runs[r].1;
            let mut e = Expression::default();
            if len == 1 {
                for c in (d..v_n).step_by(p) {
                    e += count(n, r, c);
                }
            } else {
                let u = milp.binary();
                for c in (d..v_n).step_by(p) {
                    milp.constrain(count(n, r, c).leq(len as f64 * u.v()));
                }
                e = Expression::from(u.v());
            }
            on_device.insert((r, d), e.clone());
            e
        };
        let mut copies: BTreeMap<usize, Vec<(usize, usize, f64)>> = BTreeMap::new();
        for (r, &(first, _)) in runs.iter().enumerate() {
            for tc in &self.layers[first].tied {
                if let Some(ro) = run_of(tc.owner) {
                    copies.entry(tc.weight).or_default().push((r, ro, tc.state_bytes));
                }
            }
        }
        for readers in copies.values() {
            for (d, mem_d) in mem.iter_mut().enumerate() {
                let y = milp.continuous(0.0, f64::INFINITY);
                for &(r, ro, bytes) in readers {
                    let gap = on(milp, r, d) - on(milp, ro, d);
                    milp.constrain(Expression::from(y.v()).geq(bytes / GIB * gap));
                }
                mem_d.add_mul(1.0, y.v());
            }
        }
    }

    /// Each device's memory, its largest recompute buffer added, under the cap.
    fn cap_memory(&self, milp: &mut Milp, dev: &mut DeviceSums) {
        for d in 0..self.devices {
            if !dev.recompute[d].is_empty() {
                let rb = milp.continuous(0.0, f64::INFINITY);
                for (bytes, used) in &dev.recompute[d] {
                    milp.constrain(Expression::from(rb.v()).geq(*bytes * used.clone()));
                }
                dev.mem[d].add_mul(1.0, rb.v());
            }
            milp.constrain(dev.mem[d].clone().leq((self.memory_cap - self.reserved()) / GIB));
        }
    }

    /// The boundary transfers: boundary c carries the output of the run holding chunk c's
    /// last layer, and h[r][c] − h[r+1][c] is exactly "chunk c ends inside run r".
    fn transfer(&self, runs: &[(usize, usize)], h: &[Vec<Expression>]) -> Expression {
        let mut transfer = Expression::default();
        for c in 0..self.chunks().saturating_sub(1) {
            for (r, &(first, _)) in runs.iter().enumerate() {
                let w = 2.0 * self.layers[first].output_bytes * self.transfer_s_per_byte[c];
                if w != 0.0 {
                    transfer += w * h[r][c].clone();
                    if r + 1 < runs.len() {
                        transfer -= w * h[r + 1][c].clone();
                    }
                }
            }
        }
        transfer
    }

    /// The schedule's step time: c·Σ T + (m − c)·max T + transfers + max sync.
    fn step_time(&self, milp: &mut Milp, dev: &DeviceSums, transfer: Expression) -> Expression {
        let tmax = milp.continuous(0.0, f64::INFINITY);
        let smax = milp.continuous(0.0, f64::INFINITY);
        for d in 0..self.devices {
            milp.constrain(Expression::from(tmax.v()).geq(dev.time[d].clone()));
            milp.constrain(Expression::from(smax.v()).geq(dev.sync[d].clone()));
        }
        // Integrality cuts the LP cannot see: no layout beats the min-max split of the
        // layers' least times (PipeDream's DP), nor of their least sync times.
        // The DP's layout is not handed to HiGHS as a MIP start: with one, HiGHS returned
        // layouts whose own objective it mis-stated (tests/solver_known_bugs.rs).
        let (tau, sigma) = self.dp_bounds();
        milp.constrain(Expression::from(tmax.v()).geq(tau));
        milp.constrain(Expression::from(smax.v()).geq(sigma));
        let c = self.bubble_coeff;
        let mut step = Expression::default();
        for t in &dev.time {
            step += c * t.clone();
        }
        step += (self.microbatches as f64 - c) * tmax.v();
        step += transfer;
        step += smax.v();
        step
    }
}

/// Count columns per run, per chunk: (option, column).
type Counts = Vec<Vec<Vec<((usize, (bool, bool)), Col)>>>;

/// Per-device sums of the pipeline ILP.
struct DeviceSums {
    time: Vec<Expression>,
    sync: Vec<Expression>,
    mem: Vec<Expression>,
    /// (bytes in GiB, whether used) of each recompute buffer a device may need.
    recompute: Vec<Vec<(f64, Expression)>>,
}

/// Layers of run r on chunk c.
fn count(n: &Counts, r: usize, c: usize) -> Expression {
    let mut e = Expression::default();
    for &(_, col) in &n[r][c] {
        e.add_mul(1.0, col.v());
    }
    e
}

/// Layers of run r on chunks ≤ c.
fn cum(n: &Counts, r: usize, c: usize) -> Expression {
    let mut e = Expression::default();
    for cc in 0..=c {
        e += count(n, r, cc);
    }
    e
}

/// The layer choices of a solution, run by run.
fn decode(values: &[f64], runs: &[(usize, usize)], n: &Counts) -> Result<Vec<LayerChoice>, SolveError> {
    let mut choices: Vec<LayerChoice> = Vec::with_capacity(runs.iter().map(|r| r.1).sum());
    for (r, &(_, len)) in runs.iter().enumerate() {
        let before = choices.len();
        for (c, opts_c) in n[r].iter().enumerate() {
            for &((j, (k, o)), col) in opts_c {
                let k_count = value(values, col).round().max(0.0) as usize;
                for _ in 0..k_count {
                    choices.push(LayerChoice { chunk: c, point: j, checkpoint: k, offload: o });
                }
            }
        }
        if choices.len() - before != len {
            return Err(SolveError::Solver(format!(
                "HiGHS returned {} layers for a run of {len}; numerical trouble",
                choices.len() - before
            )));
        }
    }
    Ok(choices)
}
