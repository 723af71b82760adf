//! The engines as backends: a plan written as the configuration of Megatron-LM, torchtitan,
//! DeepSpeed or SMP ([`emit`]), and an engine configuration read back into the planner's
//! request ([`read`]), planned and priced by [`crate::compile`] like any other request.
//!
//! Each engine says what it cannot express of a plan, line by line ([`Gap`]), and the
//! configuration written is the nearest one it can run, priced: the request that reproduces
//! the plan ([`fields::exact_request`]) with each gap's [`Change`] applied, compiled. Reading
//! gives a request with every setting fixed and its source named; what the planner cannot
//! price is named ([`Unpriced`]); a configuration the engine itself would refuse is refused,
//! naming the engine's check. docs/engines.md has the tables.

mod config;
mod deepspeed;
mod error;
mod fields;
mod megatron;
mod report;
mod shape;
mod smp;
mod stages;
mod torchtitan;

use crate::compile::{Analysed, CompileError, compile};
use crate::cost::ClusterSpec;
use crate::plan::Plan;
use crate::solve::{PlanOptions, SolveError};

pub use config::{EmittedFile, Launcher, Origin, Reading, Unpriced, Written, split_words};
pub use error::EngineError;
pub use fields::{Change, Engine, Gap, PlanField, checkpointed, exact_request, same_ranks};
pub use report::{Column, reading_lines, side_by_side, summary};
pub use shape::{Mlp, ModelShape, Norm, Positions};

/// Memory per device, GiB, that prices a configuration the device's memory does not hold.
const UNLIMITED_GIB: f64 = 1.0e9;

/// What `engine` cannot express of `plan`, in order.
pub fn gaps(engine: Engine, plan: &Plan, shape: &ModelShape) -> Result<Vec<Gap>, EngineError> {
    let structure = |why: String| EngineError::Structure { engine, model: plan.model.path.clone(), why };
    match engine {
        Engine::Megatron => megatron::gaps(plan, shape).map_err(structure),
        Engine::Torchtitan => torchtitan::gaps(plan, shape).map_err(structure),
        Engine::DeepSpeed => deepspeed::gaps(plan, shape).map_err(structure),
        Engine::Smp => Ok(smp::gaps(plan)),
    }
}

/// `engine`'s configuration of `plan`, which must have no [`gaps`] with a change.
pub fn write(engine: Engine, plan: &Plan, shape: &ModelShape) -> Result<Written, EngineError> {
    let structure = |why: String| EngineError::Structure { engine, model: plan.model.path.clone(), why };
    match engine {
        Engine::Megatron => megatron::write(plan, shape).map_err(structure),
        Engine::Torchtitan => torchtitan::write(plan, shape).map_err(structure),
        Engine::DeepSpeed => deepspeed::write(plan, shape).map_err(structure),
        Engine::Smp => smp::write(plan).map_err(structure),
    }
}

/// Reads `engine`'s configuration `text` into the planner's request for a model of `shape`.
/// `devices` is the cluster's device count when the user gave one; a launcher line in `text`
/// gives it otherwise. Returns the reading and the device count it is for.
pub fn read(engine: Engine, text: &str, origin: Origin, shape: &ModelShape, devices: Option<usize>) -> Result<(Reading, usize), EngineError> {
    let (reading, world) = match engine {
        Engine::Megatron => megatron::read(text, origin, shape, devices)?,
        Engine::Torchtitan => torchtitan::read(text, origin, shape, devices)?,
        Engine::DeepSpeed => deepspeed::read(text, origin, shape, devices)?,
        Engine::Smp => {
            return Err(EngineError::Missing { engine, why: "SMP parameters are read by --config SMP.json (with --layout for manual cuts)".into() });
        }
    };
    let world = world.or(devices).ok_or_else(|| EngineError::Missing { engine, why: "no device count: give --cluster PRESET:N".into() })?;
    Ok((reading, world))
}

/// The sequence length a configuration states (Megatron-LM's `--seq-length`, torchtitan's
/// `training.seq_len`), read before the model is: a graph whose sequence is symbolic is
/// analysed at it.
pub fn sequence_length(engine: Engine, text: &str) -> Option<u64> {
    let flag_value = |flags: &[&str]| -> Option<u64> {
        let words = split_words(text).ok()?;
        words.iter().enumerate().rev().find_map(|(i, w)| {
            flags.iter().find_map(|f| match w.strip_prefix(f) {
                Some("") => words.get(i + 1)?.parse().ok(),
                Some(rest) => rest.strip_prefix('=')?.parse().ok(),
                None => None,
            })
        })
    };
    match engine {
        Engine::Megatron => flag_value(&["--seq-length"]),
        Engine::Torchtitan => {
            if text.lines().any(|l| l.trim_start().starts_with('[')) {
                let doc: toml::Table = toml::from_str(text).ok()?;
                doc.get("training")?.get("seq_len")?.as_integer().and_then(|v| u64::try_from(v).ok())
            } else {
                flag_value(&["--training.seq-len", "--training.seq_len"])
            }
        }
        Engine::DeepSpeed | Engine::Smp => None,
    }
}

/// A gap with the step time of the plan changed only by it.
#[derive(Clone, Debug)]
pub struct PricedGap {
    /// The gap.
    pub gap: Gap,
    /// Predicted step time of the plan with only this change, seconds (`None`: not priced).
    pub step_s: Option<f64>,
}

/// A plan as an engine's configuration: what the engine cannot express, priced, and the
/// configuration of the nearest plan it can run.
#[derive(Clone, Debug)]
pub struct Emission {
    /// The engine.
    pub engine: Engine,
    /// What it cannot express, each priced alone.
    pub gaps: Vec<PricedGap>,
    /// The plan's predicted step time, seconds.
    pub plan_step_s: f64,
    /// The plan the configuration runs, when it is not the plan itself (some gap changed it).
    pub nearest: Option<Plan>,
    /// The nearest plan does not fit the devices' memory: its peak bytes per device and the
    /// memory a device has.
    pub over_memory: Option<(u64, u64)>,
    /// The configuration.
    pub written: Written,
}

impl Emission {
    /// The predicted step of what the configuration runs.
    pub fn step_s(&self) -> f64 {
        self.nearest.as_ref().map_or(self.plan_step_s, |p| p.predicted.step_time_s)
    }

    /// The lines `emit` prints about what the engine cannot express, each priced.
    pub fn gap_lines(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .gaps
            .iter()
            .map(|g| match (g.step_s, &g.gap.change) {
                (Some(s), _) => format!("{}, predicted {} against the plan's {}", g.gap, secs(s), secs(self.plan_step_s)),
                (None, Some(_)) => format!("{} (priced with the others below)", g.gap),
                (None, None) => format!("{} (not priced)", g.gap),
            })
            .collect();
        if let Some(n) = &self.nearest
            && (self.gaps.iter().filter(|g| g.gap.change.is_some()).count() > 1 || self.gaps.iter().any(|g| g.step_s.is_none() && g.gap.change.is_some()))
        {
            out.push(format!(
                "all together: predicted {} against the plan's {} ({:+.1} %)",
                secs(n.predicted.step_time_s),
                secs(self.plan_step_s),
                (n.predicted.step_time_s / self.plan_step_s - 1.0) * 100.0
            ));
        }
        if let Some((peak, limit)) = self.over_memory {
            out.push(format!(
                "the nearest configuration does not fit: {:.1} GiB per device at its peak, {:.1} GiB available",
                peak as f64 / (1u64 << 30) as f64,
                limit as f64 / (1u64 << 30) as f64
            ));
        }
        out
    }
}

/// Seconds as the CLI prints step times.
fn secs(s: f64) -> String {
    if s >= 10.0 { format!("{s:.1} s") } else if s >= 0.1 { format!("{s:.2} s") } else { format!("{:.2} ms", s * 1e3) }
}

/// Writes `plan` as `engine`'s configuration: the gaps, each priced alone by compiling the
/// plan's exact request with its change, and the configuration of the nearest plan (all
/// changes) the engine can run. `analysed` is the plan's model, `cluster` its cluster.
pub fn emit(engine: Engine, plan: &Plan, analysed: &Analysed, cluster: &ClusterSpec) -> Result<Emission, EngineError> {
    let shape = ModelShape::of(&analysed.lg);
    let found = gaps(engine, plan, &shape)?;
    let exact = exact_request(plan);
    let price = |req: &PlanOptions| -> Result<(Plan, Option<u64>), EngineError> { price(engine, analysed, cluster, req) };
    let mut priced = Vec::with_capacity(found.len());
    let mut nearest_req = exact.clone();
    for g in &found {
        let step_s = match &g.change {
            Some(change) => {
                let mut req = exact.clone();
                change.apply(&mut req);
                change.apply(&mut nearest_req);
                Some(price(&req)?.0.predicted.step_time_s)
            }
            None => None,
        };
        priced.push(PricedGap { gap: g.clone(), step_s });
    }
    let changed = found.iter().any(|g| g.change.is_some());
    let limit = nearest_req.memory_limit_bytes().unwrap_or(cluster.memory_bytes);
    let (mut nearest, mut over_memory) = (None, None);
    if changed {
        let (p, over) = price(&nearest_req)?;
        nearest = Some(p);
        over_memory = over.map(|peak| (peak, limit));
    }
    // a change can make another (new cuts after a schedule change): apply until none is left
    for _ in 0..3 {
        let Some(n) = &nearest else { break };
        let more: Vec<Gap> = gaps(engine, n, &shape)?.into_iter().filter(|g| g.change.is_some()).collect();
        if more.is_empty() {
            break;
        }
        for g in more {
            if let Some(c) = &g.change {
                c.apply(&mut nearest_req);
            }
            priced.push(PricedGap { gap: g, step_s: None });
        }
        let (p, over) = price(&nearest_req)?;
        nearest = Some(p);
        over_memory = over.map(|peak| (peak, limit));
    }
    let target = nearest.as_ref().unwrap_or(plan);
    // the nearest plan is one the engine can express
    let left: Vec<Gap> = gaps(engine, target, &shape)?.into_iter().filter(|g| g.change.is_some()).collect();
    if let Some(g) = left.first() {
        return Err(EngineError::Structure { engine, model: plan.model.path.clone(), why: format!("the nearest configuration still cannot be expressed ({g}); a planner bug") });
    }
    let mut written = write(engine, target, &shape)?;
    written.notes.push(checked_note(engine).into());
    Ok(Emission { engine, gaps: priced, plan_step_s: plan.predicted.step_time_s, nearest, over_memory, written })
}

/// What has checked an engine's configurations, and what has not been done with them yet
/// (docs/engines.md, "What you cannot do yet").
fn checked_note(engine: Engine) -> &'static str {
    match engine {
        Engine::Megatron => "written for Megatron-Core 0.16's pretrain_gpt.py and accepted by Megatron-Core's own configuration checks (TransformerConfig, its pipeline layout; Megatron-LM's script checks are not run); not yet run on GPUs from smp-partition (docs/engines.md)",
        Engine::Torchtitan => "written for torchtitan 0.3 and accepted by its config manager and ParallelDims; not yet run on GPUs from smp-partition (docs/engines.md)",
        Engine::DeepSpeed => "written for DeepSpeed 0.19 and accepted by its config class; its pipeline trained a tiny model on CPUs as smp-runner does, not yet run on GPUs from smp-partition (docs/engines.md)",
        Engine::Smp => "SMP's parameters as --config reads them; SMP's own code has not checked them (SageMaker's containers ship it; no package registry has it) (docs/engines.md)",
    }
}

/// Compiles a fully fixed request; where the devices' memory does not hold it, compiles it
/// without the limit and returns its peak bytes per device as well.
pub fn price(engine: Engine, analysed: &Analysed, cluster: &ClusterSpec, req: &PlanOptions) -> Result<(Plan, Option<u64>), EngineError> {
    match compile(analysed, cluster, req) {
        Ok(p) => Ok((p, None)),
        Err(CompileError::Solve { source: SolveError::Infeasible { .. }, .. }) => {
            let unlimited = PlanOptions { memory_limit_gib: Some(UNLIMITED_GIB), ..req.clone() };
            let p = compile(analysed, cluster, &unlimited).map_err(|e| EngineError::Compile { engine, source: Box::new(e) })?;
            let peak = p.predicted.peak_memory_bytes;
            Ok((p, Some(peak)))
        }
        Err(e) => Err(EngineError::Compile { engine, source: Box::new(e) }),
    }
}
