//! A thin MILP builder on good_lp, solved through the `highs` crate so the proof (bound, gap)
//! comes back (docs/planner.md §4); and the intra-layer ILP (docs/planner.md §1).

use std::time::Instant;

use good_lp::solvers::highs::highs;
use good_lp::{Constraint, Expression, ProblemVariables, SolverModel, Variable, variable};
use highs::{HighsModelStatus, HighsSolutionStatus};
use serde::{Deserialize, Serialize};

use super::SolveError;
use super::problem::{IntraLayerProblem, NodeOption};

/// How a solve ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolveStatus {
    /// Proven optimal (gap within the tolerance asked for, 0 by default).
    Optimal,
    /// A solution, not proven optimal (time limit).
    Feasible,
    /// No solution exists.
    Infeasible,
    /// The time limit struck before any solution was found.
    TimeLimit,
}

impl SolveStatus {
    /// Lower-case name as in the plan file.
    pub fn name(self) -> &'static str {
        match self {
            SolveStatus::Optimal => "optimal",
            SolveStatus::Feasible => "feasible",
            SolveStatus::Infeasible => "infeasible",
            SolveStatus::TimeLimit => "time_limit",
        }
    }
}

/// The proof of one solve.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SolveReport {
    /// Outcome.
    pub status: SolveStatus,
    /// Objective of the solution found (NaN when none).
    pub objective: f64,
    /// Best proven lower bound.
    pub bound: f64,
    /// Relative gap (objective − bound) / objective.
    pub gap: f64,
    /// Wall time, seconds.
    pub wall_s: f64,
}

/// HiGHS settings for one solve.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SolverOptions {
    /// Time limit, seconds.
    pub time_limit_s: Option<f64>,
    /// HiGHS threads (1 makes ties resolve the same way every run).
    pub threads: Option<u32>,
    /// Relative gap at which HiGHS stops (0 = prove optimality).
    pub mip_rel_gap: f64,
}

impl Default for SolverOptions {
    fn default() -> Self {
        SolverOptions { time_limit_s: None, threads: Some(1), mip_rel_gap: 0.0 }
    }
}

/// A column handle: the good_lp variable and its column index in HiGHS.
#[derive(Clone, Copy, Debug)]
pub struct Col {
    var: Variable,
    index: usize,
}

impl Col {
    /// The good_lp variable, for expressions.
    pub fn v(self) -> Variable {
        self.var
    }
}

/// A MILP under construction. Variables get consecutive column indices in creation order,
/// which is how good_lp hands them to HiGHS.
pub struct Milp {
    vars: ProblemVariables,
    count: usize,
    integers: usize,
    constraints: Vec<Constraint>,
}

impl Default for Milp {
    fn default() -> Self {
        Milp::new()
    }
}

impl Milp {
    /// An empty model.
    pub fn new() -> Milp {
        Milp { vars: ProblemVariables::new(), count: 0, integers: 0, constraints: Vec::new() }
    }

    /// A binary variable.
    pub fn binary(&mut self) -> Col {
        self.integers += 1;
        self.add(variable().binary())
    }

    /// An integer variable in [min, max].
    pub fn integer(&mut self, min: f64, max: f64) -> Col {
        self.integers += 1;
        self.add(variable().integer().min(min).max(max))
    }

    /// A continuous variable in [min, max].
    pub fn continuous(&mut self, min: f64, max: f64) -> Col {
        self.add(variable().min(min).max(max))
    }

    fn add(&mut self, def: good_lp::VariableDefinition) -> Col {
        let var = self.vars.add(def);
        let index = self.count;
        self.count += 1;
        Col { var, index }
    }

    /// Adds a constraint.
    pub fn constrain(&mut self, c: Constraint) {
        self.constraints.push(c);
    }

    /// Number of columns.
    pub fn columns(&self) -> usize {
        self.count
    }

    /// Minimises `objective + constant`; returns the report and the column values (empty when
    /// no solution was found).
    pub fn minimise(
        self,
        objective: Expression,
        constant: f64,
        opts: &SolverOptions,
    ) -> Result<(SolveReport, Vec<f64>), SolveError> {
        let start = Instant::now();
        let count = self.count;
        let has_integers = self.integers > 0;
        // good_lp's HiGHS adapter drops the objective's constant: add it back ourselves.
        let mut problem = self.vars.minimise(objective).using(highs);
        for c in self.constraints {
            problem.add_constraint(c);
        }
        let mut model = problem.try_into_inner().map_err(|e| SolveError::Solver(e.to_string()))?;
        model.make_quiet();
        set_option(&mut model, "mip_rel_gap", opts.mip_rel_gap)?;
        set_option(&mut model, "mip_abs_gap", 0.0)?;
        set_option(&mut model, "mip_pool_soft_limit", CUT_POOL_SOFT_LIMIT)?;
        if let Some(t) = opts.time_limit_s {
            set_option(&mut model, "time_limit", t.max(0.0))?;
        }
        if let Some(t) = opts.threads {
            set_option(&mut model, "threads", t.max(1) as i32)?;
        }
        let solved = model.try_solve().map_err(|e| SolveError::Solver(format!("HiGHS failed: {e:?}")))?;
        let wall_s = start.elapsed().as_secs_f64();
        let status = solved.status();
        let has_solution = solved.primal_solution_status() == HighsSolutionStatus::Feasible;
        let infeasible = |wall_s| {
            Ok((
                SolveReport { status: SolveStatus::Infeasible, objective: f64::NAN, bound: f64::INFINITY, gap: f64::NAN, wall_s },
                Vec::new(),
            ))
        };
        match status {
            HighsModelStatus::Infeasible | HighsModelStatus::UnboundedOrInfeasible => return infeasible(wall_s),
            HighsModelStatus::Optimal
            | HighsModelStatus::ReachedTimeLimit
            | HighsModelStatus::ReachedIterationLimit
            | HighsModelStatus::ReachedSolutionLimit
            | HighsModelStatus::ReachedInterrupt
            | HighsModelStatus::ReachedMemoryLimit
            | HighsModelStatus::ObjectiveBound
            | HighsModelStatus::ObjectiveTarget => {}
            other => return Err(SolveError::Solver(format!("HiGHS ended with status {other:?}"))),
        }
        if !has_solution {
            let bound = if has_integers {
                solved.double_info_value(c"mip_dual_bound").unwrap_or(f64::NEG_INFINITY) + constant
            } else {
                f64::NEG_INFINITY
            };
            let st = if status == HighsModelStatus::Optimal { SolveStatus::Infeasible } else { SolveStatus::TimeLimit };
            return Ok((SolveReport { status: st, objective: f64::NAN, bound, gap: f64::NAN, wall_s }, Vec::new()));
        }
        let objective = solved.objective_value() + constant;
        let bound = if has_integers {
            solved.double_info_value(c"mip_dual_bound").map(|b| b + constant).unwrap_or(objective)
        } else {
            objective
        };
        let bound = if bound.is_finite() { bound.min(objective) } else { bound };
        let gap = if objective.abs() > 0.0 && bound.is_finite() {
            ((objective - bound) / objective.abs()).max(0.0)
        } else if bound.is_finite() {
            0.0
        } else {
            f64::INFINITY
        };
        let st = if status == HighsModelStatus::Optimal { SolveStatus::Optimal } else { SolveStatus::Feasible };
        let values = solved.get_solution().columns().to_vec();
        debug_assert_eq!(values.len(), count);
        Ok((SolveReport { status: st, objective, bound, gap, wall_s }, values))
    }
}

/// HiGHS's soft limit on its cut pool (default 10,000). The pipeline ILPs are small and their
/// branch and bound long: a small pool keeps each node's LP small. Measured on the bench cases
/// (BENCHMARKS.md "Planner: ZB-H1's recomputed inputs to the B"): a pp 8 · tp 2 ZB-H1 Llama 3
/// 70B candidate proven in 4.7 s instead of a 0.93 % gap at 12 s, the 1T model's one slow ILP
/// 0.39 → 0.03 s; no case slower.
const CUT_POOL_SOFT_LIMIT: i32 = 10;

fn set_option<V: highs::HighsOptionValue>(model: &mut highs::Model, name: &str, v: V) -> Result<(), SolveError> {
    model
        .try_set_option(name, v)
        .map_err(|_| SolveError::Solver(format!("HiGHS rejected option `{name}`")))
}


/// Reads a column's value from a solution vector.
pub fn value(values: &[f64], c: Col) -> f64 {
    values.get(c.index).copied().unwrap_or(0.0)
}

/// A solution of the intra-layer problem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IntraSolution {
    /// Chosen option per node.
    pub choice: Vec<usize>,
    /// Forward time incl. resharding, seconds.
    pub fwd_s: f64,
    /// Backward time incl. resharding, seconds.
    pub bwd_s: f64,
    /// Parameter bytes per device.
    pub param_bytes: f64,
    /// Saved-activation bytes per microbatch.
    pub act_bytes: f64,
    /// Data-parallel sync time of the layer's gradients.
    pub sync_s: f64,
}

impl IntraLayerProblem {
    /// Time and memory figures of an assignment (`None` if an index is out of range or an
    /// edge forbids the pair).
    pub fn evaluate(&self, choice: &[usize]) -> Option<IntraSolution> {
        if choice.len() != self.nodes.len() {
            return None;
        }
        let mut s = IntraSolution { choice: choice.to_vec(), fwd_s: 0.0, bwd_s: 0.0, param_bytes: 0.0, act_bytes: 0.0, sync_s: 0.0 };
        for (n, &k) in self.nodes.iter().zip(choice) {
            let o: &NodeOption = n.options.get(k)?;
            s.fwd_s += o.fwd_s;
            s.bwd_s += o.bwd_s;
            s.param_bytes += o.param_bytes;
            s.act_bytes += o.act_bytes;
            s.sync_s += o.sync_s;
        }
        for e in &self.edges {
            let (a, b) = (*choice.get(e.from)?, *choice.get(e.to)?);
            if e.forbidden.contains(&(a, b)) {
                return None;
            }
            s.fwd_s += *e.fwd_s.get(a)?.get(b)?;
            s.bwd_s += *e.bwd_s.get(a)?.get(b)?;
        }
        Some(s)
    }

    /// The memory measure the cap applies to.
    pub fn memory_of(&self, s: &IntraSolution) -> f64 {
        s.param_bytes + self.act_weight * s.act_bytes
    }

    /// Checks indices and matrix sizes; names the offending node or edge.
    pub fn validate(&self) -> Result<(), SolveError> {
        for n in &self.nodes {
            if n.options.is_empty() {
                return Err(SolveError::Problem(format!("node `{}` has no sharding option", n.name)));
            }
        }
        for e in &self.edges {
            let (Some(a), Some(b)) = (self.nodes.get(e.from), self.nodes.get(e.to)) else {
                return Err(SolveError::Problem(format!("edge {}→{} names a missing node", e.from, e.to)));
            };
            let ok = |m: &Vec<Vec<f64>>| m.len() == a.options.len() && m.iter().all(|r| r.len() == b.options.len());
            if e.forbidden.iter().any(|&(x, y)| x >= a.options.len() || y >= b.options.len()) {
                return Err(SolveError::Problem(format!("edge `{}`→`{}` forbids a pair of options it does not have", a.name, b.name)));
            }
            if !ok(&e.fwd_s) || !ok(&e.bwd_s) {
                return Err(SolveError::Problem(format!(
                    "edge `{}`→`{}`: resharding matrix is not {}×{}",
                    a.name,
                    b.name,
                    a.options.len(),
                    b.options.len()
                )));
            }
        }
        Ok(())
    }

    /// Solves the intra-layer ILP: least fwd+bwd time (or least memory when `min_memory`),
    /// within `memory_cap` if set, and optionally within `time_cap`.
    pub fn solve(
        &self,
        min_memory: bool,
        time_cap: Option<f64>,
        opts: &SolverOptions,
    ) -> Result<(SolveReport, Option<IntraSolution>), SolveError> {
        self.validate()?;
        let mut milp = Milp::new();
        let s: Vec<Vec<Col>> = self.nodes.iter().map(|n| n.options.iter().map(|_| milp.binary()).collect()).collect();
        let mut time = Expression::default();
        let mut memory = Expression::default();
        for (v, n) in self.nodes.iter().enumerate() {
            let mut one = Expression::default();
            for (k, o) in n.options.iter().enumerate() {
                one.add_mul(1.0, s[v][k].v());
                time.add_mul(o.fwd_s + o.bwd_s, s[v][k].v());
                memory.add_mul(o.param_bytes + self.act_weight * o.act_bytes, s[v][k].v());
            }
            milp.constrain(one.eq(1.0));
        }
        for e in &self.edges {
            let (ka, kb) = (self.nodes[e.from].options.len(), self.nodes[e.to].options.len());
            // With one option on either side the edge cost is fixed by the other side's choice.
            let ev: Vec<Vec<Col>> = (0..ka)
                .map(|a| (0..kb).map(|b| milp.continuous(0.0, if e.forbidden.contains(&(a, b)) { 0.0 } else { 1.0 })).collect())
                .collect();
            for a in 0..ka {
                let mut row = Expression::default();
                for b in 0..kb {
                    row.add_mul(1.0, ev[a][b].v());
                    time.add_mul(e.fwd_s[a][b] + e.bwd_s[a][b], ev[a][b].v());
                }
                milp.constrain(row.eq(Expression::from(s[e.from][a].v())));
            }
            for b in 0..kb {
                let mut col = Expression::default();
                for row in ev.iter() {
                    col.add_mul(1.0, row[b].v());
                }
                milp.constrain(col.eq(Expression::from(s[e.to][b].v())));
            }
        }
        if let Some(cap) = self.memory_cap {
            milp.constrain(memory.clone().leq(cap));
        }
        if let Some(cap) = time_cap {
            milp.constrain(time.clone().leq(cap));
        }
        let objective = if min_memory { memory } else { time };
        let (report, values) = milp.minimise(objective, 0.0, opts)?;
        if values.is_empty() {
            return Ok((report, None));
        }
        let choice: Vec<usize> = s
            .iter()
            .map(|opts| {
                opts.iter()
                    .enumerate()
                    .max_by(|a, b| value(&values, *a.1).total_cmp(&value(&values, *b.1)))
                    .map(|(k, _)| k)
                    .unwrap_or(0)
            })
            .collect();
        Ok((report, self.evaluate(&choice)))
    }

    /// A Pareto set of (time, memory) solutions: the fastest, the smallest, and `steps`
    /// memory caps in between; dominated points removed, fastest first.
    pub fn pareto(&self, steps: usize, opts: &SolverOptions) -> Result<Vec<IntraSolution>, SolveError> {
        let (_, fast) = self.solve(false, None, opts)?;
        let Some(fast) = fast else {
            return Ok(Vec::new());
        };
        let mut points = vec![fast.clone()];
        let (_, small) = self.solve(true, None, opts)?;
        if let Some(small) = small {
            let min_mem = self.memory_of(&small);
            // Fastest among the smallest.
            let capped = IntraLayerProblem { memory_cap: Some(min_mem * (1.0 + 1e-9) + 1e-9), ..self.clone() };
            let best_small = capped.solve(false, None, opts)?.1.unwrap_or(small);
            let max_mem = self.memory_of(&fast);
            for i in 1..=steps {
                let cap = min_mem + (max_mem - min_mem) * i as f64 / (steps + 1) as f64;
                let capped = IntraLayerProblem { memory_cap: Some(cap), ..self.clone() };
                if let (_, Some(s)) = capped.solve(false, None, opts)? {
                    points.push(s);
                }
            }
            points.push(best_small);
        }
        Ok(pareto_filter(points, |s| (s.fwd_s + s.bwd_s, self.memory_of(s))))
    }
}

/// Keeps the points not dominated in (time, memory), sorted by time; drops duplicates.
pub fn pareto_filter<T, F: Fn(&T) -> (f64, f64)>(mut points: Vec<T>, key: F) -> Vec<T> {
    points.sort_by(|a, b| {
        let (ta, ma) = key(a);
        let (tb, mb) = key(b);
        ta.total_cmp(&tb).then(ma.total_cmp(&mb))
    });
    let mut out: Vec<T> = Vec::new();
    let mut best_mem = f64::INFINITY;
    for p in points {
        let (_, m) = key(&p);
        if m < best_mem * (1.0 - 1e-9) {
            best_mem = m;
            out.push(p);
        }
    }
    out
}
