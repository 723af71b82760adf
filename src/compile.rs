//! File → plan in one call, as a pass list: import → analyze → solve → assemble → codegen →
//! validate, with a check between stages (as [`crate::passes::analyze`] verifies the graph
//! between passes). The plan is assembled before codegen because codegen reads its input from
//! the plan ([`Plan::codegen_input`]); its section is attached to that plan.
//!
//! Binaries, end-to-end tests and benches plan through [`compile`]; unit tests of one stage
//! call that stage.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::codegen::stage_graph::StageGraphError;
use crate::codegen::{self, EncodeError};
use crate::cost::ClusterSpec;
use crate::frontend::onnx::{self, ImportError};
use crate::ir::{DimBindings, Graph, LayeredGraph};
pub use crate::passes::AnalyzeOptions;
pub use crate::passes::params::ParamOptions;
use crate::passes::{self, PassError};
use crate::plan::build::{self, ModelRef};
use crate::plan::estimate::Estimate;
use crate::plan::{Plan, PlanInvalid, validate};
use crate::solve::{self, ConfigError, PlanOptions, Progress, SolveError};

/// The stages of [`compile`], in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// ONNX → IR graph.
    Import,
    /// Shapes, figures, layers.
    Analyze,
    /// The parallel configuration (search or baseline).
    Solve,
    /// The plan file from the solver's decision.
    Assemble,
    /// Shards and per-rank programs (the plan's codegen section).
    Codegen,
    /// The whole plan's structural checks.
    Validate,
}

/// Errors of [`compile`]; each names its stage, and its message names the file, setting or
/// layer concerned.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The ONNX file could not be imported.
    #[error("cannot import {}", .path.display())]
    Import {
        /// The model file.
        path: PathBuf,
        /// Why.
        #[source]
        source: ImportError,
    },
    /// The passes failed.
    #[error("cannot analyse {}", .path.display())]
    Analyze {
        /// The model file.
        path: PathBuf,
        /// Why.
        #[source]
        source: PassError,
    },
    /// The model has ops the runner has no kernel for: refused before planning, since no plan
    /// of it could run.
    #[error("{model} has ops the runner cannot execute: {ops}; a plan of it could not run. {fix}")]
    NotExecutable {
        /// The model, as named.
        model: String,
        /// Each op with its node count, first node and its module (`com.microsoft.FusedMatMul
        /// (2 nodes, first `n` in module `m`)`).
        ops: String,
        /// What to do: for ops whose output shape depends on the values, how to write the module
        /// without them; otherwise re-exporting with ops the runner executes.
        fix: String,
    },
    /// The options conflict with the cluster or the model.
    #[error(transparent)]
    Options(#[from] ConfigError),
    /// The planner found no plan, or a fixed setting cannot be honoured.
    #[error("planning {model} on {cluster}")]
    Solve {
        /// The model, as named.
        model: String,
        /// The cluster, as named.
        cluster: String,
        /// Why.
        #[source]
        source: SolveError,
    },
    /// The assembled plan does not describe a codegen input.
    #[error("the planner produced an inconsistent plan (a bug)")]
    Assemble(#[source] EncodeError),
    /// Codegen realises another tensor strategy for a node than the solver chose.
    #[error(
        "planner bug: code generation for {model} (pp={pp}, tp={tp}, dp={dp}): layer {layer} (`{name}`), node `{node}` realises `{realised}` where `{chosen}` was chosen; the solver must offer only what codegen emits"
    )]
    Realised {
        /// The model, as named.
        model: String,
        /// Pipeline degree.
        pp: usize,
        /// Tensor degree.
        tp: usize,
        /// Data-parallel degree.
        dp: usize,
        /// Layer index.
        layer: usize,
        /// Layer name.
        name: String,
        /// Node name.
        node: String,
        /// The solver's strategy.
        chosen: crate::split::Strategy,
        /// What codegen realises.
        realised: crate::split::Strategy,
    },
    /// Codegen cannot emit what the solver chose.
    #[error("planner bug: code generation for {model} (pp={pp}, tp={tp}, dp={dp}): the planner chose a split codegen cannot emit")]
    Codegen {
        /// The model, as named.
        model: String,
        /// Pipeline degree.
        pp: usize,
        /// Tensor degree.
        tp: usize,
        /// Data-parallel degree.
        dp: usize,
        /// Why.
        #[source]
        source: EncodeError,
    },
    /// Context parallelism cannot split the model as planned: found when the plan is made,
    /// not when it runs.
    #[error("{model} cannot run under context parallelism {cp} as planned: {reason}")]
    Context {
        /// The model, as named.
        model: String,
        /// The context degree.
        cp: usize,
        /// Why, naming the value or node and the fix.
        reason: StageGraphError,
    },
    /// A plan's model does not rebuild the graph the plan was made for.
    #[error("{} does not rebuild the graph the plan was made for: {reason}; re-plan it with this smp-partition", .path.display())]
    Planned {
        /// The model file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The finished plan fails its checks.
    #[error("the planner produced an inconsistent plan (a bug)")]
    Validate(#[source] PlanInvalid),
}

impl CompileError {
    /// The stage that failed (options conflicts are found before solving).
    pub fn stage(&self) -> Stage {
        match self {
            CompileError::Import { .. } => Stage::Import,
            CompileError::Analyze { .. } | CompileError::NotExecutable { .. } => Stage::Analyze,
            CompileError::Options(_) | CompileError::Solve { .. } => Stage::Solve,
            CompileError::Assemble(_) => Stage::Assemble,
            CompileError::Realised { .. } | CompileError::Codegen { .. } | CompileError::Context { .. } | CompileError::Planned { .. } => Stage::Codegen,
            CompileError::Validate(_) => Stage::Validate,
        }
    }
}

/// Watches [`compile`]: stage starts, search progress, notes for the user. Every method
/// defaults to doing nothing.
pub trait Observer {
    /// `stage` begins.
    fn stage(&mut self, _stage: Stage) {}
    /// The search advanced.
    fn progress(&mut self, _progress: Progress) {}
    /// Something the user should know that is not an error (the CLI prints `note: …`).
    fn note(&mut self, _note: &str) {}
}

/// Observes nothing.
impl Observer for () {}

/// An imported and analysed model.
#[derive(Clone, Debug)]
pub struct Analysed {
    /// The graph with layers and figures.
    pub lg: LayeredGraph,
    /// Where the model came from (path as given, SHA-256).
    pub model: ModelRef,
    /// Import warnings.
    pub warnings: Vec<String>,
}

/// What to compile.
#[derive(Clone, Copy, Debug)]
pub enum Model<'a> {
    /// An ONNX file, imported and analysed with the options' `seq_len` and `dims`.
    Onnx(&'a Path),
    /// A model already analysed (with the options' `seq_len` and `dims`, which the plan
    /// records): for planning one model many ways, or a synthetic graph.
    Analysed(&'a Analysed),
}

impl<'a> From<&'a Path> for Model<'a> {
    fn from(p: &'a Path) -> Self {
        Model::Onnx(p)
    }
}

impl<'a> From<&'a PathBuf> for Model<'a> {
    fn from(p: &'a PathBuf) -> Self {
        Model::Onnx(p.as_path())
    }
}

impl<'a> From<&'a Analysed> for Model<'a> {
    fn from(a: &'a Analysed) -> Self {
        Model::Analysed(a)
    }
}

/// The analysis options `opts` asks for (`seq_len`, `dims`).
pub fn analyze_options(opts: &PlanOptions) -> AnalyzeOptions {
    AnalyzeOptions { seq_len: opts.seq_len.map(|s| s as i64), dims: opts.dims.iter().cloned().collect::<BTreeMap<_, _>>() }
}

/// A plan's model, rebuilt as the runner rebuilds it.
#[derive(Debug)]
pub struct PlannedModel {
    /// The model file ([`Plan::model_file`]).
    pub path: PathBuf,
    /// Whether it is the file the plan was made for (same SHA-256).
    pub same_file: bool,
    /// The planned graph: the ids the plan's codegen section lists.
    pub graph: Graph,
    /// Its dim bindings.
    pub dims: DimBindings,
}

/// The graph `plan` (read from `plan_file`) was made for, rebuilt from its model file with the
/// plan's parameter patterns, dims and records, as the runner rebuilds it
/// ([`codegen::stage_graph::planned_graph`]); no analysis or search runs again.
pub fn load_planned(plan: &Plan, plan_file: &Path) -> Result<PlannedModel, CompileError> {
    let path = plan.model_file(plan_file);
    let imported = onnx::load_model(&path).map_err(|source| CompileError::Import { path: path.clone(), source })?;
    let refuse = |reason: String| CompileError::Planned { path: path.clone(), reason };
    let section = plan.codegen.as_ref().ok_or_else(|| refuse("the plan has no codegen section".into()))?;
    let mut graph = imported.graph;
    let params = ParamOptions { trainable: plan.trainable.clone(), frozen: plan.frozen.clone() };
    passes::params::decide(&mut graph, &params).map_err(|e| refuse(e.to_string()))?;
    let (graph, dims) = codegen::stage_graph::planned_graph(graph, section, (plan.seq_len.map(|s| s as i64), &plan.dims)).map_err(|e| refuse(e.to_string()))?;
    Ok(PlannedModel { same_file: imported.sha256 == plan.model.sha256, path, graph, dims })
}

/// Import → analyze: the graph with shapes, figures and layers. Import warnings are logged
/// (`tracing::warn`) and returned.
pub fn load_and_analyze(path: &Path, opts: &AnalyzeOptions) -> Result<Analysed, CompileError> {
    import_and_analyze(path, opts, &ParamOptions::default(), &mut (), false)
}

/// Import → analyze as `compile` does for `options` (their sequence length, dims and trained
/// parameters): a model analysed once for compiling several requests.
pub fn analyze_for(path: &Path, options: &PlanOptions) -> Result<Analysed, CompileError> {
    import_and_analyze(path, &analyze_options(options), &options.params, &mut (), false)
}

fn import_and_analyze(
    path: &Path,
    opts: &AnalyzeOptions,
    params: &ParamOptions,
    observer: &mut dyn Observer,
    executable: bool,
) -> Result<Analysed, CompileError> {
    observer.stage(Stage::Import);
    let imported = onnx::load_model(path).map_err(|source| CompileError::Import { path: path.to_path_buf(), source })?;
    if executable {
        // before analysis, which cannot see into them either
        check_executable(&imported.graph, &path.display().to_string())?;
    }
    let warnings: Vec<String> = imported.warnings.iter().map(|w| w.to_string()).collect();
    for w in &warnings {
        tracing::warn!("{}: {w}", path.display());
    }
    observer.stage(Stage::Analyze);
    let lg = passes::analyze_with(imported.graph, opts, params).map_err(|source| CompileError::Analyze { path: path.to_path_buf(), source })?;
    Ok(Analysed { lg, model: ModelRef { path: path.display().to_string(), sha256: imported.sha256 }, warnings })
}

/// Compiles `model` for `cluster` as `options` ask: the plan with its codegen section,
/// validated.
pub fn compile<'a>(model: impl Into<Model<'a>>, cluster: &ClusterSpec, options: &PlanOptions) -> Result<Plan, CompileError> {
    compile_observed(model, cluster, options, &mut ())
}

/// [`compile`], telling `observer` what happens.
pub fn compile_observed<'a>(
    model: impl Into<Model<'a>>,
    cluster: &ClusterSpec,
    options: &PlanOptions,
    observer: &mut dyn Observer,
) -> Result<Plan, CompileError> {
    let started = Instant::now();
    let cluster_name = options.cluster_flag.clone().unwrap_or_else(|| format!("{}:{}", cluster.name, cluster.devices));
    options.check_devices(cluster.devices, &cluster_name)?;
    options.check_host_link(cluster, &cluster_name)?;
    let loaded;
    let analysed = match model.into() {
        Model::Analysed(a) => a,
        Model::Onnx(path) => {
            loaded = import_and_analyze(path, &analyze_options(options), &options.params, observer, true)?;
            &loaded
        }
    };
    let lg = &analysed.lg;
    let model_name = &analysed.model.path;
    check_executable(&lg.graph, model_name)?;
    options.check_layers(lg.layers.len(), model_name)?;
    if options.global_batch.is_none() {
        let batch = options.global_batch_for(lg, cluster);
        observer.note(&format!("--global-batch not given; planning for {batch} samples per step"));
    }

    observer.stage(Stage::Solve);
    let decision = solve::plan(lg, cluster, options, &mut |p| observer.progress(p))
        .map_err(|source| CompileError::Solve { model: model_name.clone(), cluster: cluster_name.clone(), source })?;

    observer.stage(Stage::Assemble);
    let mut plan = build::from_decision(&decision, lg, cluster, options, &analysed.model, started.elapsed().as_secs_f64());
    let input = plan.codegen_input().map_err(CompileError::Assemble)?;

    observer.stage(Stage::Codegen);
    let mut section = codegen::encode::build(lg, &input).map_err(|e| codegen_error(e, model_name, &plan))?;
    if options.sequence_parallel == Some(true) && plan.parallel.tp == 1 {
        observer.note("--sequence-parallel has no effect at tp = 1");
    }
    // the stages each rank will run, split over its context group: a refusal is the planner's,
    // and what crosses each stage boundary is recorded for the runner
    codegen::stage_graph::plan_context(lg, &mut section, &plan.mesh(), &plan.parallel)
        .map_err(|reason| CompileError::Context { model: model_name.clone(), cp: plan.parallel.cp, reason })?;
    plan.codegen = Some(section);

    observer.stage(Stage::Validate);
    validate(&plan).map_err(CompileError::Validate)?;
    Ok(plan)
}

/// Memory per device a configuration is priced under when it does not fit the real one
/// (GiB): so that `estimate` still prices it and says by how much it is over.
const UNLIMITED_GIB: f64 = 1.0e9;

/// Prices the one configuration `options` give (`--estimate`): every setting the search would
/// choose is fixed ([`PlanOptions::pinned_for_estimate`]), the plan is compiled under the
/// device's memory and, where it does not fit, again without the limit so that its memory is
/// still known. Settings the model or cluster cannot honour are errors naming the setting.
pub fn estimate<'a>(
    model: impl Into<Model<'a>>,
    cluster: &ClusterSpec,
    options: &PlanOptions,
    observer: &mut dyn Observer,
) -> Result<Estimate, CompileError> {
    let cluster_name = options.cluster_flag.clone().unwrap_or_else(|| format!("{}:{}", cluster.name, cluster.devices));
    options.check_devices(cluster.devices, &cluster_name)?;
    let pinned = options.clone().pinned_for_estimate(cluster.devices, &cluster_name)?;
    pinned.check_devices(cluster.devices, &cluster_name)?;
    let loaded;
    let analysed = match model.into() {
        Model::Analysed(a) => a,
        Model::Onnx(path) => {
            loaded = import_and_analyze(path, &analyze_options(&pinned), &pinned.params, observer, true)?;
            &loaded
        }
    };
    let lg = &analysed.lg;
    pinned.check_microbatches(pinned.global_batch_for(lg, cluster))?;
    let capacity_bytes = pinned.memory_limit_bytes().unwrap_or(cluster.memory_bytes);
    let plan = match compile_observed(analysed, cluster, &pinned, observer) {
        Ok(plan) => plan,
        Err(CompileError::Solve { source: SolveError::Infeasible { .. }, .. }) => {
            let unlimited = PlanOptions { memory_limit_gib: Some(UNLIMITED_GIB), ..pinned.clone() };
            let mut plan = compile_observed(analysed, cluster, &unlimited, observer)?;
            plan.cluster.memory_limit_bytes = capacity_bytes;
            plan
        }
        Err(e) => return Err(e),
    };
    Ok(Estimate { plan, capacity_bytes, cuts_chosen: pinned.layout.is_none() })
}

/// Refuses a graph holding ops the IR does not know (kept as placeholders by the importer):
/// the runner executes every op the IR knows and no other, so no plan of it could run.
pub fn check_executable(graph: &crate::ir::Graph, model: &str) -> Result<(), CompileError> {
    // ONNX ops whose output shape is a function of the input values
    const VALUE_SHAPED: [&str; 4] = ["NonZero", "Unique", "Compress", "NonMaxSuppression"];
    let mut unknown: BTreeMap<String, (usize, String)> = BTreeMap::new();
    let mut value_shaped: Vec<String> = Vec::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        if let crate::ir::Op::Placeholder { op_type, domain } = &node.op {
            let name = if domain.is_empty() { op_type.clone() } else { format!("{domain}.{op_type}") };
            if domain.is_empty() && VALUE_SHAPED.contains(&op_type.as_str()) && !value_shaped.contains(&name) {
                value_shaped.push(name.clone());
            }
            let first = || match node.namespace.as_deref().and_then(crate::passes::layers::innermost_module) {
                Some(m) => format!("`{}` in module `{m}`", node.name),
                None => format!("`{}`", node.name),
            };
            unknown.entry(name).or_insert_with(|| (0, first())).0 += 1;
        }
    }
    if unknown.is_empty() {
        return Ok(());
    }
    let ops = unknown.iter().map(|(op, (n, first))| format!("{op} ({n} node{}, first {first})", if *n == 1 { "" } else { "s" })).collect::<Vec<_>>().join(", ");
    let fix = if value_shaped.is_empty() {
        "Re-export the model with ops the runner executes (docs/conformance.md lists them), e.g. with another opset or without custom-domain fusions".to_string()
    } else {
        format!(
            "{} give outputs whose shape depends on the values (boolean indexing, `nonzero()`, `unique()`), and a plan needs every shape before it runs: \
             write that module with a mask (`torch.where`) or indices of a fixed size instead",
            value_shaped.join(", ")
        )
    };
    Err(CompileError::NotExecutable { model: model.to_string(), ops, fix })
}

/// A codegen failure on a plan the solver made: the solver offered what codegen cannot emit.
fn codegen_error(e: EncodeError, model: &str, plan: &Plan) -> CompileError {
    let (model, pp, tp, dp) = (model.to_string(), plan.parallel.pp, plan.parallel.tp, plan.parallel.dp);
    match e {
        EncodeError::StrategyMismatch { layer, name, node, chosen, realised } => {
            CompileError::Realised { model, pp, tp, dp, layer, name, node, chosen, realised }
        }
        source => CompileError::Codegen { model, pp, tp, dp, source },
    }
}
