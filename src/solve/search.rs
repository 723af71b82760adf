//! The outer search (docs/planner.md §3): enumerate parallel configurations cheaply, bound each
//! (compute with perfect balance plus the schedule's bubble plus data-parallel sync), drop the
//! ones whose memory cannot fit, solve the pipeline ILP in bound order and stop when the next
//! bound reaches the incumbent. The candidates come from `candidates.rs`, their bounds from
//! `bounds.rs`; [`Search`] holds one search's phases.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::cost::{ClusterSpec, CommModel, kept_in_flight};
use crate::ir::{CheckpointRule, LayeredGraph, Parallelism, ScheduleKind};

use super::bounds::{BoundMemo, SharedSplits, bounds_shared};
use super::candidates::{divisors, global_batch};
use super::heuristic::incumbent;
use super::ilp::{SolveReport, SolveStatus, SolverOptions};
use super::layer_cost::{CompactTable, CostContext, LayerConfig};
use super::pipeline::PipelineSolution;
use super::problem::{LayerChoice, PipelineEval, PipelineLayer, PipelineObjective, PipelineProblem, ZERO3_GATHERED_LAYERS};
use super::{
    AxisReport, LayerDecision, Optimize, PlanDecision, PlanOptions, Predicted, Progress, SolveError, StageDecision, StageMemory,
};

pub use super::bounds::{bounds, bubble_coeff, pruning_bound, spread_lower_bound};
pub use super::candidates::{AxisLimits, Candidate, Grid, enumerate, layer_config, layout_chunks};

/// Default budget for a whole search when none is given, seconds.
pub const DEFAULT_TIME_LIMIT_S: f64 = 60.0;

/// A candidate with its flat problem and bounds.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The configuration.
    pub cand: Candidate,
    /// Its pipeline problem; its `layers` stay empty until the search looks at the
    /// candidate beyond its bounds (`Search::materialize`), the bounds reading the compact
    /// table its layer configuration shares with other candidates.
    pub problem: PipelineProblem,
    /// Its layer configuration, which names that table.
    pub config: LayerConfig,
    /// Lower bound on its step time.
    pub lb: f64,
    /// Lower bound on its peak memory per device.
    pub mem_lb: f64,
}

/// Builds the pipeline problem of a candidate.
pub fn prepare(
    ctx: &mut CostContext<'_>,
    cand: &Candidate,
    memory_cap: f64,
    active: Option<usize>,
    fixed_chunks: Option<Vec<usize>>,
    fixed_checkpoints: Option<Vec<CheckpointRule>>,
) -> Prepared {
    let config = layer_config(ctx.spec, cand);
    let table = ctx.compact(&config);
    let links = Links { spec: ctx.spec, comm: ctx.comm };
    let mut p = prepare_on(&links, cand, memory_cap, active, (fixed_chunks, fixed_checkpoints), (config, &table), &mut BoundMemo::default());
    p.problem.layers = (*ctx.layers(&config)).clone();
    p
}

/// What preparing a candidate reads of the cluster (shared by the threads preparing them).
struct Links<'a> {
    spec: &'a ClusterSpec,
    comm: CommModel,
}

/// [`prepare`] of the configuration `config` over its compact `table`, with the fixed chunks
/// and recompute flags (the problem's layers left empty).
fn prepare_on(
    ctx: &Links<'_>,
    cand: &Candidate,
    memory_cap: f64,
    active: Option<usize>,
    (fixed_chunks, fixed_checkpoints): (Option<Vec<usize>>, Option<Vec<CheckpointRule>>),
    (config, table): (LayerConfig, &Arc<CompactTable>),
    memo: &mut BoundMemo,
) -> Prepared {
    let spec = ctx.spec;
    let rank = |d: usize, p: usize, t: usize| cand.parallel.rank_of(d, 0, p, t);
    let v = cand.parallel.schedule.virtual_stages();
    let chunks = cand.parallel.pp * v;
    let beta: Vec<f64> = (0..chunks.saturating_sub(1))
        .map(|c| {
            let kind = ctx.comm.link_between(rank(0, c % cand.parallel.pp, 0), rank(0, (c + 1) % cand.parallel.pp, 0));
            1.0 / ctx.comm.link(kind).bandwidth
        })
        .collect();
    let (kind, pp, m) = (cand.parallel.schedule, cand.parallel.pp, cand.parallel.microbatches);
    let stage_flight = memo.stage_in_flights(kind, pp, m);
    let flight: Vec<f64> = (0..chunks).map(|c| active.map_or(stage_flight[c], |a| stage_flight[c].min(a as f64))).collect();
    let kept_flight: Vec<f64> = (0..chunks)
        .map(|c| {
            let f = if kind == ScheduleKind::ZbH1 { kept_in_flight(kind, pp, m, c % pp + 1) } else { stage_flight[c] };
            active.map_or(f, |a| f.min(a as f64))
        })
        .collect();
    let problem = PipelineProblem {
        layers: Vec::new(),
        devices: cand.parallel.pp,
        virtual_stages: v,
        microbatches: cand.parallel.microbatches,
        in_flight: flight,
        kept_flight,
        moments: Vec::new(),
        bubble_coeff: bubble_coeff(cand.parallel.schedule, cand.parallel.pp, cand.parallel.microbatches),
        memory_cap,
        workspace: spec.workspace_bytes as f64,
        gathered: ZERO3_GATHERED_LAYERS * table.distinct.iter().flat_map(|l| &l.points).map(|pt| pt.gathered_bytes).fold(0.0, f64::max),
        transfer_s_per_byte: beta,
        checkpoint: cand.parallel.checkpointing,
        offload: cand.parallel.offload,
        loading_horizon: cand.parallel.loading_horizon as f64,
        fixed_chunks,
        fixed_checkpoints,
        objective: PipelineObjective::StepTime,
    };
    let (lb, mem_lb) = bounds_shared(&problem, table, memo);
    Prepared { cand: *cand, problem, config, lb, mem_lb }
}

/// A layout rule: the chunk of every layer a candidate must take, where the rule fixes one.
pub type LayoutRule<'r> = &'r dyn Fn(&Candidate, &CostContext<'_>) -> Option<Vec<usize>>;

/// The search of one model on one cluster: its settings, cost context and layer tables,
/// shared by every phase — preparing candidates, quick layouts, branch and bound in bound
/// order, the least-memory pass and the decision — and by the Megatron-LM seed, which runs
/// under its own rule ([`Search::with_rule`]) on the same tables.
pub struct Search<'a> {
    lg: &'a LayeredGraph,
    spec: &'a ClusterSpec,
    /// The settings in force (the Megatron-LM rule's while it seeds the search).
    cfg: PlanOptions,
    ctx: CostContext<'a>,
    /// Usable memory per device, bytes.
    cap: f64,
    /// Whether tables keep only each layer's first point, the Megatron split (the Megatron
    /// rule on a context that also holds the intra-layer assignments).
    megatron_view: bool,
    /// Those tables, by the full table they cut down; and the compact ones.
    megatron_tables: HashMap<*const Vec<PipelineLayer>, Arc<Vec<PipelineLayer>>>,
    megatron_compact: HashMap<*const CompactTable, Arc<CompactTable>>,
    /// Threads the intra-layer ILPs and the bounds run on ([`crate::parallel::threads`]).
    pub threads: usize,
    /// Whether a search nothing fits in works out the fix (an unused seed's failure is
    /// dropped unread).
    pub explain: bool,
}

/// What branch and bound carries between phases.
struct Frontier {
    /// The candidates whose bounds fit, in bound order.
    fit: Vec<Prepared>,
    /// Their quick layouts, where computed.
    quick: Vec<Option<PipelineSolution>>,
    /// The best solution found and its candidate.
    best: Option<(usize, PipelineSolution)>,
    /// The seed's step time (∞ without one).
    seed_obj: f64,
    solved: u64,
    skipped: u64,
    done: u64,
    total: u64,
    /// The least bound among candidates not proven.
    open_bound: f64,
}

/// HiGHS single-threaded, so ties resolve the same way every run.
fn ilp_options(remaining: f64) -> SolverOptions {
    SolverOptions { time_limit_s: Some(remaining.max(0.05)), threads: Some(1), mip_rel_gap: 0.0 }
}

/// Per context or expert degree, the least bound of its configurations that fit.
fn alternatives(prepared: &[Prepared], cap: f64, degree: fn(&Candidate) -> usize) -> Vec<(usize, Option<f64>)> {
    let mut by: std::collections::BTreeMap<usize, Option<f64>> = Default::default();
    for p in prepared {
        let e = by.entry(degree(&p.cand)).or_insert(None);
        if p.mem_lb <= cap && p.lb.is_finite() {
            *e = Some(e.map_or(p.lb, |x: f64| x.min(p.lb)));
        }
    }
    by.into_iter().collect()
}

impl Frontier {
    /// Splits `prepared` into those whose bounds fit (sorted by bound) and the skipped rest.
    fn new(mut prepared: Vec<Prepared>, cap: f64, seed_obj: f64) -> Frontier {
        let total = prepared.len() as u64;
        let (fit, unfit): (Vec<Prepared>, Vec<Prepared>) = prepared.drain(..).partition(|p| p.mem_lb <= cap && p.lb.is_finite());
        // A stable sort of their indices by bound (ties in enumeration order), then each moved
        // once: sorting the large records themselves moved each many times.
        let mut order: Vec<usize> = (0..fit.len()).collect();
        order.sort_by(|&a, &b| fit[a].lb.total_cmp(&fit[b].lb));
        let mut slots: Vec<Option<Prepared>> = fit.into_iter().map(Some).collect();
        let fit: Vec<Prepared> = order.into_iter().filter_map(|i| slots[i].take()).collect();
        let skipped = unfit.len() as u64;
        Frontier { quick: vec![None; fit.len()], fit, best: None, seed_obj, solved: 0, skipped, done: skipped, total, open_bound: f64::INFINITY }
    }

    /// The least objective found so far, the seed's included.
    fn incumbent(&self) -> Option<f64> {
        let b = self.best.as_ref().map_or(f64::INFINITY, |b| b.1.report.objective);
        let m = b.min(self.seed_obj);
        m.is_finite().then_some(m)
    }

    fn progress(&self) -> Progress {
        Progress { done: self.done, total: self.total, best_step_s: self.best.as_ref().map(|b| b.1.report.objective) }
    }

    /// Quick layouts first, in bound order while a bound can still beat the best of them: an
    /// incumbent before any ILP, and the guarantee that the answer is no worse than any of
    /// them (equal layer counts included, whatever the time limit).
    fn quick_layouts(&mut self, materialize: &mut dyn FnMut(&mut Prepared)) {
        for i in 0..self.fit.len() {
            if self.incumbent().is_some_and(|inc| self.fit[i].lb >= inc * (1.0 - 1e-9)) {
                break;
            }
            materialize(&mut self.fit[i]);
            let p = &self.fit[i];
            let Some((choices, eval)) = incumbent(&p.problem) else { continue };
            let objective = eval.step_s;
            let proven = objective <= p.lb * (1.0 + 1e-9);
            let report = SolveReport {
                status: if proven { SolveStatus::Optimal } else { SolveStatus::Feasible },
                objective,
                bound: if proven { objective } else { p.lb },
                gap: if proven || objective <= 0.0 { 0.0 } else { (objective - p.lb) / objective },
                wall_s: 0.0,
            };
            let sol = PipelineSolution { report, choices, eval: Some(eval) };
            if self.best.as_ref().is_none_or(|b| objective < b.1.report.objective) {
                self.best = Some((i, sol.clone()));
            }
            self.quick[i] = Some(sol);
        }
    }

    /// The pipeline ILP of each candidate in bound order until the next bound reaches the
    /// incumbent or the time runs out. Before its ILP a candidate's pruning bound is taken: one
    /// above the incumbent is skipped, one above the next candidate's bound waits in a second
    /// queue until the candidates in order reach it (best-first on the tighter bound).
    fn branch_and_bound(
        &mut self,
        start: Instant,
        limit: f64,
        materialize: &mut dyn FnMut(&mut Prepared),
        progress: &mut dyn FnMut(Progress),
    ) -> Result<(), SolveError> {
        let mut i = 0;
        // (pruning bound, index) of the candidates put back, in the order they were put back
        let mut waiting: Vec<(f64, usize)> = Vec::new();
        loop {
            let next_lb = self.fit.get(i).map_or(f64::INFINITY, |p| p.lb);
            let least_waiting = waiting.iter().enumerate().min_by(|a, b| a.1.0.total_cmp(&b.1.0)).map(|(w, &(pb, _))| (w, pb));
            let (k, lb, pruned) = match least_waiting {
                Some((w, pb)) if pb <= next_lb => (waiting.remove(w).1, pb, true),
                _ if i < self.fit.len() => {
                    i += 1;
                    (i - 1, next_lb, false)
                }
                _ => break,
            };
            materialize(&mut self.fit[k]);
            if self.quick[k].as_ref().is_some_and(|q| q.report.status == SolveStatus::Optimal) {
                // Its quick layout meets its bound: solved, without an ILP.
                self.solved += 1;
                self.done += 1;
                continue;
            }
            let p = &self.fit[k];
            let incumbent = self.incumbent();
            if incumbent.is_some_and(|inc| lb >= inc * (1.0 - 1e-9)) {
                // every candidate left has a bound at least this one's
                waiting.push((lb, k));
                break;
            }
            if !pruned && let Some(inc) = incumbent {
                // The pruning bound, tighter than the order's (interleaved chunks spread, stages
                // split with their memory): a candidate it puts above the incumbent cannot beat
                // it (the margin covers the ILP's rounding), so its ILP would only prove that.
                let pb = pruning_bound(&p.problem);
                if pb >= inc * (1.0 + 1e-6) {
                    self.skipped += 1;
                    self.done += 1;
                    continue;
                }
                let after = self.fit.get(i).map_or(f64::INFINITY, |q| q.lb);
                if pb > after * (1.0 + 1e-9) {
                    waiting.push((pb, k));
                    continue;
                }
            }
            let remaining = limit - start.elapsed().as_secs_f64();
            if remaining <= 0.0 && incumbent.is_some() {
                self.open_bound = self.open_bound.min(lb);
                waiting.push((lb, k));
                break;
            }
            // One ILP may use a fifth of the budget, so several candidates get a look.
            let sol = p.problem.solve_below(&ilp_options(remaining.min((limit / 5.0).max(0.2))), incumbent)?;
            self.solved += 1;
            self.done += 1;
            tracing::debug!(
                "solved {:?} lb {:.4} -> {:?} {:.4} bound {:.4} in {:.3} s",
                p.cand,
                lb,
                sol.report.status,
                sol.report.objective,
                sol.report.bound,
                sol.report.wall_s
            );
            self.take(k, sol, incumbent);
            progress(self.progress());
        }
        self.skipped += (self.fit.len() - i + waiting.len()) as u64;
        Ok(())
    }

    /// Records candidate `i`'s ILP solution against the incumbent it was solved below.
    fn take(&mut self, i: usize, sol: PipelineSolution, incumbent: Option<f64>) {
        let lb = self.fit[i].lb;
        match sol.report.status {
            SolveStatus::Optimal | SolveStatus::Feasible => {
                if sol.report.status == SolveStatus::Feasible {
                    self.open_bound = self.open_bound.min(sol.report.bound.max(lb));
                }
                // The ILP's proof replaces this candidate's own quick layout.
                let same = self.best.as_ref().is_some_and(|b| b.0 == i) && sol.report.status == SolveStatus::Optimal;
                if same || incumbent.is_none_or(|inc| sol.report.objective < inc) {
                    self.best = Some((i, sol));
                }
            }
            SolveStatus::TimeLimit => self.open_bound = self.open_bound.min(sol.report.bound.max(lb)),
            SolveStatus::Infeasible => {
                // Nothing in this candidate beats the incumbent: when the incumbent is this
                // candidate's own quick layout, that layout is its optimum.
                if let Some((bi, b)) = self.best.as_mut()
                    && *bi == i
                    && b.report.objective <= self.seed_obj
                {
                    b.report.status = SolveStatus::Optimal;
                    b.report.bound = b.report.objective;
                    b.report.gap = 0.0;
                }
            }
        }
    }

    /// The seed as the answer, with this search's bound and counts.
    fn seed_answer(&self, mut s: PlanDecision, start: Instant) -> PlanDecision {
        let seed_obj = self.seed_obj;
        let bound = self.open_bound.min(seed_obj);
        let gap = if seed_obj > 0.0 { ((seed_obj - bound) / seed_obj).max(0.0) } else { 0.0 };
        s.solver = SolveReport {
            status: if gap <= 1e-6 { SolveStatus::Optimal } else { SolveStatus::Feasible },
            objective: seed_obj,
            bound,
            gap,
            wall_s: start.elapsed().as_secs_f64(),
        };
        s.candidates_solved += self.solved;
        s.candidates_skipped += self.skipped;
        s
    }

    /// The proof of the chosen solution under objective `optimize`.
    fn report(&self, chosen: &Prepared, sol: &PipelineSolution, optimize: Optimize, start: Instant) -> SolveReport {
        let objective = sol.report.objective;
        let bound = match optimize {
            Optimize::Speed => self.open_bound.min(objective).min(sol.report.bound.max(chosen.lb)),
            Optimize::Memory => sol.report.bound,
        };
        let gap = if objective > 0.0 { ((objective - bound) / objective).max(0.0) } else { 0.0 };
        SolveReport {
            status: if gap <= 1e-6 && sol.report.status == SolveStatus::Optimal { SolveStatus::Optimal } else { SolveStatus::Feasible },
            objective,
            bound,
            gap,
            wall_s: start.elapsed().as_secs_f64(),
        }
    }
}

impl<'a> Search<'a> {
    /// A search of `lg` on `spec` under `cfg`.
    pub fn new(lg: &'a LayeredGraph, spec: &'a ClusterSpec, cfg: &PlanOptions) -> Search<'a> {
        Search {
            lg,
            spec,
            cfg: cfg.clone(),
            ctx: cost_context(lg, spec, cfg),
            cap: cfg.memory_limit_bytes().unwrap_or(spec.memory_bytes) as f64,
            megatron_view: false,
            megatron_tables: HashMap::new(),
            megatron_compact: HashMap::new(),
            threads: crate::parallel::threads(),
            explain: true,
        }
    }

    /// The model searched.
    pub fn model(&self) -> &'a LayeredGraph {
        self.lg
    }

    /// The cluster searched.
    pub fn cluster(&self) -> &'a ClusterSpec {
        self.spec
    }

    /// The settings in force.
    pub fn settings(&self) -> &PlanOptions {
        &self.cfg
    }

    /// The degree grid under the settings in force.
    pub fn grid(&self) -> Result<Grid<'a>, SolveError> {
        Grid::of(self.lg, self.spec, &self.cfg)
    }

    /// Runs `f` under the rule `cfg` (Megatron-LM's when `megatron`: each layer's Megatron
    /// split only), on this search's cost context and tables; the settings in force return
    /// afterwards.
    pub fn with_rule<T>(&mut self, cfg: PlanOptions, megatron: bool, f: impl FnOnce(&mut Self) -> T) -> T {
        let outer = std::mem::replace(&mut self.cfg, cfg);
        let view = std::mem::replace(&mut self.megatron_view, megatron && !self.ctx.megatron_only);
        let out = f(self);
        self.cfg = outer;
        self.megatron_view = view;
        out
    }

    /// The layer table of a layer configuration under the rule in force.
    fn table(&mut self, lc: &LayerConfig) -> Arc<Vec<PipelineLayer>> {
        let full = self.ctx.layers(lc);
        if !self.megatron_view {
            return full;
        }
        self.megatron_tables
            .entry(Arc::as_ptr(&full))
            .or_insert_with(|| {
                Arc::new(full.iter().map(|l| PipelineLayer { points: l.points.iter().take(1).cloned().collect(), ..l.clone() }).collect())
            })
            .clone()
    }

    /// The compact layer table of a layer configuration under the rule in force.
    fn compact(&mut self, lc: &LayerConfig) -> Arc<CompactTable> {
        let full = self.ctx.compact(lc);
        if !self.megatron_view {
            return full;
        }
        self.megatron_compact.entry(Arc::as_ptr(&full)).or_insert_with(|| Arc::new(full.first_points())).clone()
    }

    /// Fills a candidate's problem's layers from its layer table under the rule in force
    /// (once).
    fn materialize(&mut self, p: &mut Prepared) {
        if p.problem.layers.len() != self.lg.layers.len() {
            p.problem.layers = (*self.table(&p.config)).clone();
        }
    }

    /// Every candidate's problem and bounds; a manual layout, else `fixed`, places the layers.
    /// The intra-layer ILPs and the bounds run on [`Self::threads`] threads; the layer tables
    /// are built in between, one by one from the caches the ILPs filled.
    fn prepare_all(&mut self, cands: &[Candidate], fixed: LayoutRule<'_>) -> Result<Vec<Prepared>, SolveError> {
        let layout = match &self.cfg.layout {
            Some(l) => Some(layout_chunks(&l.0, self.lg.layers.len())?),
            None => None,
        };
        let configs: Vec<LayerConfig> = cands.iter().map(|c| layer_config(self.spec, c)).collect();
        self.ctx.prefetch_details(&configs, self.threads);
        let jobs: Vec<_> = cands
            .iter()
            .zip(&configs)
            .map(|(cand, lc)| (cand, *lc, layout.clone().or_else(|| fixed(cand, &self.ctx)), self.compact(lc)))
            .collect();
        let checkpoints = self.cfg.checkpoint_flags(self.lg.layers.len());
        let (cap, active) = (self.cap, self.cfg.active_microbatches);
        let links = Links { spec: self.spec, comm: self.ctx.comm };
        // Runs of neighbours (which mostly share their tables) per thread, each with its memo.
        let runs: Vec<_> = jobs.chunks(jobs.len().div_ceil(4 * self.threads).max(64)).collect();
        let splits = SharedSplits::default();
        let prepared = crate::parallel::map(&runs, self.threads, |run| {
            let mut memo = BoundMemo::sharing(splits.clone());
            run.iter()
                .map(|(cand, lc, f, table)| prepare_on(&links, cand, cap, active, (f.clone(), checkpoints.clone()), (*lc, table), &mut memo))
                .collect::<Vec<_>>()
        });
        Ok(prepared.into_iter().flatten().collect())
    }

    /// Solves `cands` in bound order; `fixed(cand, ctx)` may impose a layout. `seed`, a plan
    /// found under another rule (the Megatron baseline), is an incumbent from the start and
    /// is returned when nothing here is faster.
    pub fn solve(&mut self, cands: Vec<Candidate>, fixed: LayoutRule<'_>, seed: Option<PlanDecision>, progress: &mut dyn FnMut(Progress)) -> Result<PlanDecision, SolveError> {
        let start = Instant::now();
        let limit = self.cfg.time_limit_s.unwrap_or(DEFAULT_TIME_LIMIT_S);
        let prepared = self.prepare_all(&cands, fixed)?;
        tracing::debug!(
            "prepared {} candidates in {:.3} s ({} intra-layer ILPs so far, {} threads)",
            prepared.len(),
            start.elapsed().as_secs_f64(),
            self.ctx.intra_solves,
            self.threads
        );
        let cp_alternatives = alternatives(&prepared, self.cap, |c| c.parallel.cp);
        let ep_alternatives = alternatives(&prepared, self.cap, |c| c.parallel.ep);
        let min_mem = prepared.iter().map(|p| p.mem_lb).fold(f64::INFINITY, f64::min);
        let seed_obj = seed.as_ref().map_or(f64::INFINITY, |s| s.predicted.step_time_s);
        let mut st = Frontier::new(prepared, self.cap, seed_obj);
        st.quick_layouts(&mut |p| self.materialize(p));
        tracing::debug!("quick layouts done at {:.3} s, incumbent {:?}", start.elapsed().as_secs_f64(), st.best.as_ref().map(|b| b.1.report.objective));
        st.branch_and_bound(start, limit, &mut |p| self.materialize(p), progress)?;
        progress(Progress { done: st.total, total: st.total, best_step_s: st.incumbent() });
        if let Some(s) = seed
            && st.best.as_ref().is_none_or(|b| seed_obj <= b.1.report.objective)
        {
            // Nothing searched beats the seed: it is the answer, with this search's bound.
            return Ok(st.seed_answer(s, start));
        }
        let Some((bi, sol)) = st.best.take() else {
            return Err(self.infeasible(min_mem));
        };
        let optimize = self.cfg.optimize.unwrap_or_default();
        let (chosen, sol) = match optimize {
            Optimize::Memory => self.least_memory(&mut st, bi, sol, start, limit)?,
            Optimize::Speed => (st.fit[bi].clone(), sol),
        };
        let report = st.report(&chosen, &sol, optimize, start);
        let mut d = self.decision(&chosen, sol, report, st.solved, st.skipped)?;
        d.axes.cp_alternatives = cp_alternatives;
        d.axes.sample_input_bytes = AxisLimits::of(self.lg, self.spec, &self.cfg).map_or(0.0, |a| if a.seq.is_some() { a.sample_bytes } else { 0.0 });
        d.axes.ep_alternatives = ep_alternatives;
        Ok(d)
    }

    /// `--optimize memory`: the least peak memory within 5 % of the fastest step, over the
    /// candidates whose bound allows it.
    fn least_memory(&mut self, st: &mut Frontier, bi: usize, mut sol: PipelineSolution, start: Instant, limit: f64) -> Result<(Prepared, PipelineSolution), SolveError> {
        let mut chosen = st.fit[bi].clone();
        let max_step = sol.report.objective * 1.05;
        let mut best_mem = sol.eval.as_ref().map_or(f64::INFINITY, |e| e.total_bytes.iter().cloned().fold(0.0, f64::max));
        for p in st.fit.iter_mut().filter(|p| p.lb <= max_step) {
            self.materialize(p);
            let p = &*p;
            let remaining = limit - start.elapsed().as_secs_f64();
            if remaining <= 0.0 {
                break;
            }
            let prob = PipelineProblem { objective: PipelineObjective::PeakMemory { max_step_s: max_step }, ..p.problem.clone() };
            let s = prob.solve(&ilp_options(remaining))?;
            st.solved += 1;
            if matches!(s.report.status, SolveStatus::Optimal | SolveStatus::Feasible) && s.report.objective < best_mem {
                best_mem = s.report.objective;
                chosen = Prepared { problem: prob, ..p.clone() };
                sol = s;
            }
        }
        Ok((chosen, sol))
    }

    /// Why nothing fits, with the fix (or, for an unused seed, the bare fact).
    fn infeasible(&self, min_mem: f64) -> SolveError {
        if self.explain {
            return infeasible(self.lg, self.spec, &self.cfg, self.cap, min_mem);
        }
        SolveError::Infeasible { reason: "no configuration of this rule fits".into(), fix: String::new() }
    }
}

/// What the context and expert axes cost and save in a solved candidate, on its busiest
/// pipeline rank.
fn axis_report(ctx: &CostContext<'_>, cand: &Candidate, prob: &PipelineProblem, choices: &[LayerChoice], eval: &PipelineEval) -> AxisReport {
    let lc = layer_config(ctx.spec, cand);
    let p = prob.devices.max(1);
    let busiest = (0..p).max_by(|&a, &b| (eval.fwd_s[a] + eval.bwd_s[a]).total_cmp(&(eval.fwd_s[b] + eval.bwd_s[b]))).unwrap_or(0);
    let peak = (0..p).max_by(|&a, &b| eval.total_bytes[a].total_cmp(&eval.total_bytes[b])).unwrap_or(0);
    // the model state is reported where it is largest: the rank whose whole memory peaks may
    // hold no experts (a last stage of the head alone)
    let fullest = (0..p).max_by(|&a, &b| eval.state_bytes[a].total_cmp(&eval.state_bytes[b])).unwrap_or(0);
    let m = cand.parallel.microbatches as f64;
    let mut r = AxisReport {
        activation_bytes: eval.act_bytes.get(peak).copied().unwrap_or(0.0),
        state_bytes: eval.state_bytes.get(fullest).copied().unwrap_or(0.0),
        ..Default::default()
    };
    r.state_bytes_without_ep = r.state_bytes;
    let t = cand.parallel.tp.max(1) as f64;
    for (l, ch) in choices.iter().enumerate() {
        let d = ch.chunk % p;
        if d == busiest {
            let ax = ctx.axis_times(l, &lc);
            r.kv_transfer_s += m * ax.kv_transfer_s;
            r.kv_exposed_s += m * (ax.kv_exposed_fwd_s + ax.kv_exposed_bwd_s);
            r.all_to_all_s += m * (ax.all_to_all_fwd_s + ax.all_to_all_bwd_s);
            r.all_to_all_hidden_s += m * prob.layers.get(l).and_then(|pl| pl.points.get(ch.point)).map_or(0.0, |pt| pt.all_to_all_hidden_s);
            r.imbalance_s += m * 3.0 * ax.imbalance_fwd_s;
        }
        let ex = ctx.experts.get(l).copied().unwrap_or_default();
        if d == fullest && (cand.parallel.ep > 1 || cand.parallel.experts_folded()) && ex.experts > 0 {
            let held = ex.params / t;
            let trained = held * ctx.shapes[l].trained_fraction();
            let at = |e: f64, group: usize| crate::cost::model_state(held / e, trained / e, lc.zero, group, ctx.precision).total();
            // experts split over ep · etp ranks where `held` counts them split over tp
            let e = cand.parallel.ep as f64 * cand.parallel.etp.max(1) as f64 / cand.parallel.tp.max(1) as f64;
            r.state_bytes_without_ep += at(1.0, lc.zero_group.size) - at(e, lc.expert_zero_group.size);
        }
    }
    r
}

/// The cost context of a search under `cfg` (its precision, baseline and expert imbalance).
pub fn cost_context<'a>(lg: &'a LayeredGraph, spec: &'a ClusterSpec, cfg: &PlanOptions) -> CostContext<'a> {
    let mut ctx = CostContext::with_recipe(lg, spec, cfg.precision_for(spec), cfg.mixed_recipe_for(spec));
    ctx.megatron_only = cfg.baseline == Some(super::Baseline::Megatron) || cfg.megatron_split;
    ctx.expert_imbalance = cfg.expert_imbalance.unwrap_or(super::options::DEFAULT_EXPERT_IMBALANCE);
    ctx.expert_dispatch = cfg.expert_dispatch.unwrap_or_default();
    ctx.selective = super::layer_cost::SelectivePoints::of(cfg.checkpointing.unwrap_or_default(), cfg.checkpoint_flags(lg.layers.len()).as_deref());
    ctx.selective_policy = cfg.selective_policy.unwrap_or_default();
    ctx
}

/// The least context degree above the forced one at which some configuration fits `cap`, if
/// any: the degrees whose memory lower bound fits, each solved in turn (without a fix of its
/// own) until one has a plan.
pub fn min_fitting_cp(lg: &LayeredGraph, spec: &ClusterSpec, cfg: &PlanOptions, cap: f64) -> Option<usize> {
    let forced = cfg.cp?;
    let mut ctx = cost_context(lg, spec, cfg);
    divisors(spec.devices).into_iter().filter(|&c| c > forced).find(|&c| {
        let try_cfg = PlanOptions { cp: Some(c), ..cfg.clone() };
        let Ok(cands) = enumerate(lg, spec, &try_cfg) else { return false };
        let bound_fits = cands.iter().any(|cand| {
            let p = prepare(&mut ctx, cand, cap, cfg.active_microbatches, None, cfg.checkpoint_flags(lg.layers.len()));
            p.mem_lb <= cap && p.lb.is_finite()
        });
        bound_fits && {
            let mut search = Search::new(lg, spec, &try_cfg);
            search.explain = false;
            let cands = search.grid().and_then(|g| g.candidates(&try_cfg));
            cands.is_ok_and(|cands| search.solve(cands, &|_, _| None, None, &mut |_| {}).is_ok())
        }
    })
}

fn infeasible(lg: &LayeredGraph, spec: &ClusterSpec, cfg: &PlanOptions, cap: f64, min_mem: f64) -> SolveError {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let mut fix = format!("needs at least {:.1} GiB per device", gib(min_mem));
    if let (Some(forced), Some(c)) = (cfg.cp, min_fitting_cp(lg, spec, cfg, cap)) {
        fix.push_str(&format!(
            " at context-parallel degree {forced}; --cp {c} fits (the least context degree that does: it divides each rank's activations by {c})"
        ));
        return SolveError::Infeasible {
            reason: format!(
                "every configuration with --cp {forced} needs more than the {:.1} GiB per device available ({} devices of {})",
                gib(cap),
                spec.devices,
                spec.device
            ),
            fix,
        };
    }
    // The smallest device count (whole nodes) whose memory lower bound fits.
    let mut devices = spec.devices;
    for _ in 0..8 {
        devices *= 2;
        let bigger = ClusterSpec { devices, ..spec.clone() };
        let Ok(cands) = enumerate(lg, &bigger, cfg) else { continue };
        let mut ctx = cost_context(lg, &bigger, cfg);
        let fits = cands.iter().any(|cand| prepare(&mut ctx, cand, cap, cfg.active_microbatches, None, cfg.checkpoint_flags(lg.layers.len())).mem_lb <= cap);
        if fits {
            fix.push_str(&format!(", or about {devices} devices of this kind"));
            break;
        }
    }
    SolveError::Infeasible {
        reason: format!(
            "every configuration needs more than the {:.1} GiB per device available ({} devices of {})",
            gib(cap),
            spec.devices,
            spec.device
        ),
        fix: if min_mem.is_finite() && min_mem > cap {
            format!("{fix} (raise --memory-limit or use a larger cluster)")
        } else {
            format!("{fix}: checkpointing and memory did not fit together; try --checkpointing auto or more devices")
        },
    }
}

impl Search<'_> {
    /// Builds the decision record from a solved candidate.
    fn decision(&self, chosen: &Prepared, sol: PipelineSolution, report: SolveReport, solved: u64, skipped: u64) -> Result<PlanDecision, SolveError> {
        let ctx = &self.ctx;
        let cand = chosen.cand;
        let mut prob = chosen.problem.clone();
        if prob.virtual_stages > 1 {
            // a rank running several chunks peaks at one moment of them: reported, not searched
            let p = &cand.parallel;
            prob.moments = crate::cost::rank_moments(p.schedule, p.pp, p.microbatches);
        }
        let prob = &prob;
        let mut eval = sol.eval.clone().ok_or_else(|| SolveError::Solver("the ILP's solution does not decode to a layout".into()))?;
        let activations = prob.peak_chunk_activations(&sol.choices);
        if !prob.moments.is_empty() {
            for (d, bytes) in prob.reported_device_bytes(&sol.choices, &eval, &activations).into_iter().enumerate() {
                eval.act_bytes[d] += bytes - eval.total_bytes[d];
                eval.total_bytes[d] = bytes;
            }
        }
        let stages = self.stage_decisions(&cand, prob, &sol.choices, &activations);
        let layers = self.layer_decisions(&cand, prob, &sol.choices);
        let predicted = self.predicted(&cand, prob, &sol.choices, &eval);
        let axes = axis_report(ctx, &cand, prob, &sol.choices, &eval);
        Ok(PlanDecision {
            axes,
            parallel: Parallelism { sequence_parallel: cand.parallel.sequence_parallel && cand.parallel.tp > 1, ..cand.parallel },
            microbatch_size: cand.microbatch_size,
            stages,
            layers,
            predicted,
            memory_limit_bytes: self.cap,
            solver: report,
            candidates_solved: solved,
            candidates_skipped: skipped,
            problem: prob.clone(),
            choices: sol.choices,
        })
    }

    /// Each chunk's layers, ranks, times and memory.
    /// `chunk_activations`: each chunk's kept activations as reported
    /// ([`PipelineProblem::peak_chunk_activations`]).
    fn stage_decisions(&self, cand: &Candidate, prob: &PipelineProblem, choices: &[LayerChoice], chunk_activations: &[f64]) -> Vec<StageDecision> {
        let ctx = &self.ctx;
        let chunks = prob.chunks();
        let lc = layer_config(self.spec, cand);
        let mut stages = Vec::with_capacity(chunks);
        // tied weights' copies, each counted once per device, in its first chunk reading it
        let mut copies_held = std::collections::BTreeSet::new();
        for c in 0..chunks {
            let members: Vec<usize> = (0..choices.len()).filter(|&l| choices[l].chunk == c).collect();
            let (first, last) = (members.first().copied().unwrap_or(0), members.last().copied().unwrap_or(0));
            let pp_rank = c % cand.parallel.pp;
            let ranks = cand.parallel.stage_ranks(pp_rank);
            // the experts inside the assignments' counts, and what the expert groups leave a rank
            let (mut in_details, mut in_details_trained, mut expert, mut expert_trained) = (0.0, 0.0, 0.0, 0.0);
            let (mut fwd, mut bwd, mut params, mut trained, mut rec) = (0.0, 0.0, 0.0, 0.0, 0.0f64);
            // ZeRO 3: the largest of its layers, gathered whole
            let mut gathered = 0.0f64;
            let mut loss = 0.0f64;
            let (mut ckpt, mut offloaded, mut host) = (Vec::new(), Vec::new(), 0.0);
            let mut selective = Vec::new();
            for &l in &members {
                let ch = choices[l];
                let pt = &prob.layers[l].points[ch.point];
                let (f, b) = PipelineProblem::layer_times(pt, ch.checkpoint, ch.offload);
                gathered = gathered.max(pt.gathered_bytes);
                fwd += f;
                bwd += b;
                // The layer's own count, plus what its assignment replicates beyond the split.
                let chosen = ctx.detail(l, &lc, pt.choice);
                let extra = match (chosen, ctx.detail(l, &lc, 0)) {
                    (Some(d), Some(m)) => d.param_elems - m.param_elems,
                    _ => 0.0,
                };
                let held = ctx.shapes[l].params / cand.parallel.tp.max(1) as f64 + extra;
                let fraction = ctx.shapes[l].trained_fraction();
                params += held;
                trained += held * fraction;
                let (inside, kept) = ctx.experts_held(l, chosen, &lc);
                let inside = inside.min(held);
                in_details += inside;
                in_details_trained += inside * fraction;
                expert += kept;
                expert_trained += kept * fraction;
                for tc in &prob.layers[l].tied {
                    let owner_rank = choices.get(tc.owner).map(|o| o.chunk % cand.parallel.pp);
                    if owner_rank != Some(pp_rank) && copies_held.insert((pp_rank, tc.weight)) {
                        params += tc.elems;
                        trained += tc.trained;
                    }
                }
                rec = rec.max(pt.rebuilt_bytes(ch.checkpoint));
                loss = loss.max(pt.loss_bytes);
                if ch.checkpoint {
                    ckpt.push(l);
                } else if pt.is_selective() {
                    selective.push(l);
                }
                if ch.offload {
                    host += prob.offloaded_bytes(c, pt);
                    offloaded.push(l);
                }
            }
            let st = ctx.state_split((params - in_details, trained - in_details_trained), (expert, expert_trained), &lc);
            let activations = chunk_activations[c];
            let workspace = if c < cand.parallel.pp { prob.workspace } else { 0.0 };
            let comm_s = if c + 1 < chunks { 2.0 * prob.layers[last].output_bytes * prob.transfer_s_per_byte[c] } else { 0.0 };
            stages.push(StageDecision {
                index: c,
                pp_rank,
                layers: [first, last],
                ranks,
                forward_s: fwd,
                backward_s: bwd,
                comm_s,
                memory: StageMemory {
                    params: st.params + ZERO3_GATHERED_LAYERS * gathered,
                    grads: st.grads,
                    optimizer: st.optimizer,
                    activations,
                    recompute: rec,
                    loss,
                    workspace,
                    total: st.total() + ZERO3_GATHERED_LAYERS * gathered + activations + rec.max(loss) + workspace,
                },
                checkpointed_layers: ckpt,
                selective_layers: selective,
                offloaded_layers: offloaded,
                offloaded_bytes: host,
            });
        }
        stages
    }

    /// Each layer's strategy, node by node, and its checkpoint and offload flags.
    fn layer_decisions(&self, cand: &Candidate, prob: &PipelineProblem, choices: &[LayerChoice]) -> Vec<LayerDecision> {
        let (ctx, lg) = (&self.ctx, self.lg);
        let lc = layer_config(self.spec, cand);
        let fallback = if cand.parallel.tp > 1 { format!("megatron-tp{}", cand.parallel.tp) } else { "replicate".to_string() };
        choices
            .iter()
            .enumerate()
            .map(|(l, ch)| {
                let choice = prob.layers[l].points.get(ch.point).map_or(0, |p| p.choice);
                let (strategy, nodes) = match ctx.detail(l, &lc, choice) {
                    // Identical layers share the representative's detail: name this layer's nodes.
                    Some(d) => {
                        let names = lg.layers[l].nodes.iter().map(|&id| lg.graph.try_node(id).map(|n| n.name.clone()).unwrap_or_default());
                        (d.name.clone(), names.zip(&d.nodes).map(|(n, (_, s))| (n, s.clone())).collect())
                    }
                    None => (fallback.clone(), Vec::new()),
                };
                LayerDecision { layer: l, strategy, nodes, checkpoint: ch.checkpoint, offload: ch.offload }
            })
            .collect()
    }

    /// The step time, throughput, bubble, peak memory and utilisation of a solution.
    fn predicted(&self, cand: &Candidate, prob: &PipelineProblem, choices: &[LayerChoice], eval: &PipelineEval) -> Predicted {
        let (lg, spec) = (self.lg, self.spec);
        let step = eval.step_s;
        let t: Vec<f64> = (0..cand.parallel.pp).map(|d| eval.fwd_s[d] + eval.bwd_s[d]).collect();
        let mean = t.iter().sum::<f64>() / cand.parallel.pp as f64;
        let tmax = t.iter().cloned().fold(0.0, f64::max);
        let m = cand.parallel.microbatches as f64;
        let pipe = prob.bubble_coeff * t.iter().sum::<f64>() + (m - prob.bubble_coeff) * tmax;
        let bubble = if mean > 0.0 { (pipe - m * mean) / (m * mean) } else { 0.0 };
        let batch = global_batch(&self.cfg) as f64;
        let peak = spec.peak_flops(self.ctx.dtype) * spec.devices as f64;
        let mfu = if step > 0.0 { 3.0 * lg.flops_per_sample * batch / (step * peak) } else { 0.0 };
        // Recomputed layers run their forward pass twice.
        let recomputed: f64 = choices
            .iter()
            .enumerate()
            .filter(|(_, ch)| ch.checkpoint)
            .map(|(l, _)| lg.layers[l].nodes.iter().map(|&id| lg.node_figures(id).flops).sum::<f64>())
            .sum();
        let hfu = if step > 0.0 { (3.0 * lg.flops_per_sample + recomputed) * batch / (step * peak) } else { 0.0 };
        Predicted {
            step_time_s: step,
            samples_per_s: if step > 0.0 { batch / step } else { 0.0 },
            bubble_ratio: bubble,
            peak_memory_bytes: eval.total_bytes.iter().cloned().fold(0.0, f64::max),
            mfu,
            hfu,
        }
    }
}
