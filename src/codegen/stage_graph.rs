//! Each rank's planned graph. The planned graph is the imported model as the planner analysed
//! it: specialised ([`passes::specialise`]: dims bound, shape arithmetic folded, dead nodes
//! removed, ids kept), the plan's fused ops applied ([`passes::fuse::apply`]) and its fixed
//! batch rebound ([`super::rebatch`]): [`planned_graph`], which the runner calls on the model it
//! loads. A rank runs its stages as subgraphs of it with the rank's tensor shards applied
//! (Megatron's *f* before each partial gradient, the values a stage passes on added) and, under
//! context parallelism, split over the rank's context group ([`crate::split::context`]).
//!
//! The planner splits every stage when it plans ([`plan_context`]), so a model the split
//! refuses is its error, naming the value or node, and it records what crosses each stage's
//! boundary (the split of the whole model, done once); the runner builds its subgraphs from the
//! plan ([`rank_graphs`]) without splitting the whole model again.

use std::collections::{BTreeMap, HashMap, HashSet};

use thiserror::Error;

use super::encode::{CodegenSection, EncodeError, FusedNode, IntValue, Mesh, RankView, StageContext, StageView, TokenAxis};
use super::shard::{CodegenError, PartialGradient, WeightSlice, apply_shard};
use crate::ir::{Attrs, CollectiveKind, DimBindings, Fusion, Graph, GraphError, GroupKind, LayeredGraph, Node, NodeId, Op, Parallelism, ValueKind};
use crate::passes::{self, AnalyzeOptions, PassError};
use crate::split::context::{Boundary, ContextError, Tokens, split_context};

/// Why the planned graph cannot be rebuilt from a model: the plan was made for another model
/// (or another version of it), and must be made again.
#[derive(Debug, Error)]
pub enum PlannedGraphError {
    /// Specialisation failed.
    #[error("specialising the model as the planner did (dims bound, shape arithmetic folded): {0}")]
    Specialise(#[source] PassError),
    /// A fused op of the plan does not fit.
    #[error("the plan's fused op at node {node} ({op}) does not fit the model: {reason}")]
    Fused {
        /// The fused node's id.
        node: usize,
        /// Its op.
        op: String,
        /// What does not fit.
        reason: String,
    },
    /// The fixed batch cannot be rebound.
    #[error("rebinding the model's fixed batch to the plan's microbatch of {microbatch}: {source}")]
    Rebind {
        /// The plan's microbatch size.
        microbatch: i64,
        /// Why.
        #[source]
        source: PassError,
    },
    /// The model's fixed batch is not the one the plan rebinds.
    #[error("the plan rebinds a fixed batch of {fixed} to {microbatch}, but the model's batch is {found}")]
    Batch {
        /// The batch the plan says the model fixes.
        fixed: i64,
        /// The plan's microbatch size.
        microbatch: i64,
        /// The model's batch (`not fixed` when it is free).
        found: String,
    },
}

/// The graph a plan with codegen section `section` was made for, from the model `graph` as
/// imported (parameters decided) at the plan's sequence length and dims: specialised, the
/// plan's fused ops applied (a record that does not fit is refused), its fixed batch rebound.
/// Its node and value ids are those the section lists.
pub fn planned_graph(graph: Graph, section: &CodegenSection, (seq_len, dims): (Option<i64>, &BTreeMap<String, i64>)) -> Result<(Graph, DimBindings), PlannedGraphError> {
    let opts = AnalyzeOptions { seq_len, dims: dims.clone() };
    let (mut g, mut dims) = passes::specialise(graph, &opts).map_err(PlannedGraphError::Specialise)?;
    for f in &section.fused {
        apply_fused(&mut g, f)?;
    }
    if let Some(b) = section.batch {
        let done = super::rebatch::rebind_graph(&mut g, &mut dims, b.microbatch).map_err(|source| PlannedGraphError::Rebind { microbatch: b.microbatch, source })?;
        if done.map(|d| d.fixed) != Some(b.fixed) {
            let found = passes::rebatch::fixed_batch(&g).map_or("not fixed".to_string(), |(_, f)| f.to_string());
            return Err(PlannedGraphError::Batch { fixed: b.fixed, microbatch: b.microbatch, found });
        }
    }
    Ok((g, dims))
}

/// Applies one fused op of a plan to `g`.
fn apply_fused(g: &mut Graph, f: &FusedNode) -> Result<(), PlannedGraphError> {
    let refuse = |reason: String| PlannedGraphError::Fused { node: f.node, op: f.op.to_string(), reason };
    let by_id: HashMap<usize, NodeId> = g.node_ids().map(|n| (n.index(), n)).collect();
    let node = |i: usize| by_id.get(&i).copied().ok_or_else(|| refuse(format!("the model as planned has no node {i}")));
    let value = |name: &str| g.value_by_name(name).ok_or_else(|| refuse(format!("the model has no value `{name}`")));
    let fusion = Fusion {
        node: node(f.node)?,
        op: f.op,
        inputs: f.inputs.iter().map(|i| value(i)).collect::<Result<_, _>>()?,
        output: value(&f.output)?,
        replaces: f.replaces.iter().map(|&i| node(i)).collect::<Result<_, _>>()?,
    };
    passes::fuse::apply(g, &fusion).map_err(|e| refuse(e.to_string()))
}

/// Rewrites op chains into fused ops as analysis does ([`passes::fuse`]), for a model run
/// without a plan; returns the fused ops' summary (empty when nothing fused).
pub fn fuse_unplanned(graph: &mut Graph) -> String {
    let fused = passes::fuse::Fused::of(&passes::fuse::fuse(graph));
    if fused.total() > 0 { fused.to_string() } else { String::new() }
}

/// Why a rank's stage subgraphs cannot be built.
#[derive(Debug, Error)]
pub enum StageGraphError {
    /// The plan lists nodes the graph does not have.
    #[error("stage {stage} runs nodes the planned graph does not have")]
    Nodes {
        /// The stage.
        stage: usize,
    },
    /// A shard does not apply.
    #[error("stage {stage} shard of rank {rank}: {source}")]
    Shard {
        /// The stage.
        stage: usize,
        /// Global rank.
        rank: usize,
        /// Why.
        #[source]
        source: CodegenError,
    },
    /// A weight slice is shared by a number of tensor ranks that does not divide tp.
    #[error("stage {stage}: weight `{weight}` is shared by {replicas} tensor ranks, which does not divide tp {tp}")]
    SharedSlice {
        /// The stage.
        stage: usize,
        /// The initializer.
        weight: String,
        /// Ranks sharing its slice.
        replicas: usize,
        /// Tensor degree.
        tp: usize,
    },
    /// A partial gradient names an input the shard does not have.
    #[error("partial gradient at input {input} of node `{node}`: {msg}")]
    PartialGradient {
        /// The reading node.
        node: String,
        /// Its input slot.
        input: usize,
        /// What is missing.
        msg: &'static str,
    },
    /// Context parallelism refuses the model (the split of the whole model, which says what
    /// crosses each stage boundary).
    #[error("the model under cp {cp}: {source}")]
    ModelContext {
        /// Context degree.
        cp: usize,
        /// Why.
        #[source]
        source: ContextError,
    },
    /// A plan with several stages under context parallelism lacks the record of what crosses a
    /// stage's boundary.
    #[error("stage {stage} has no record of the tokens crossing its boundary under context parallelism")]
    NoContextRecord {
        /// The stage.
        stage: usize,
    },
    /// Context parallelism refuses a stage's subgraph.
    #[error("stage {stage} under cp {cp}: {source}")]
    Context {
        /// The stage.
        stage: usize,
        /// Context degree.
        cp: usize,
        /// Why.
        #[source]
        source: ContextError,
    },
    /// The plan's codegen section does not resolve a rank.
    #[error(transparent)]
    View(#[from] EncodeError),
    /// The model's fixed batch cannot be rebound to the plan's microbatch.
    #[error(transparent)]
    Rebind(#[from] PassError),
    /// Building a subgraph failed.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// One stage's subgraph on one rank.
#[derive(Debug)]
pub struct StageGraph {
    /// Global stage index.
    pub stage: usize,
    /// The subgraph.
    pub graph: Graph,
    /// The weights it slices.
    pub slices: Vec<WeightSlice>,
    /// Context-parallel conversions (gathers and cuts) the split inserted.
    pub context_conversions: usize,
}

/// The stage subgraphs of one rank.
#[derive(Debug, Default)]
pub struct RankGraphs {
    /// The rank's stages, in order (empty when its stages run on the model's executor).
    pub stages: Vec<StageGraph>,
    /// Weights whose slice several tensor ranks share, with the ranks sharing this rank's.
    pub kv_groups: Vec<(String, Vec<usize>)>,
}

/// Whether a rank runs its stages as subgraphs of their own (tensor-parallel shards, or
/// context-parallel splits) rather than the model executor's nodes.
pub fn runs_stage_subgraphs(p: &Parallelism) -> bool {
    p.tp > 1 || p.cp > 1
}

/// The stage subgraphs rank `view.rank` runs on `graph`, the planned graph (with its `dims`),
/// under `parallel` on `mesh`. Each stage's context split starts from the boundary the plan
/// records (`StageCode::context`, required with several stages); `stages` is the plan's stage
/// count. Empty where the rank's stages run on the model's executor
/// ([`runs_stage_subgraphs`]).
pub fn rank_graphs(view: &RankView<'_>, graph: &Graph, dims: &DimBindings, (mesh, parallel, stages): (&Mesh, &Parallelism, usize)) -> Result<RankGraphs, StageGraphError> {
    let mut out = RankGraphs::default();
    if !runs_stage_subgraphs(parallel) {
        return Ok(out);
    }
    let cp = parallel.cp.max(1);
    for sv in &view.stages {
        let sub = stage_subgraph(sv, graph, dims, (mesh, view), &mut out.kv_groups)?;
        let boundary = match &sv.code.context {
            Some(c) => boundary_of(c),
            None if cp > 1 && stages > 1 => return Err(StageGraphError::NoContextRecord { stage: sv.stage() }),
            None => Boundary::default(),
        };
        out.stages.push(context_split(sv, sub, dims, cp, &boundary)?);
    }
    Ok(out)
}

/// Splits, when planning under context parallelism, the stages of the ranks of each pipeline
/// rank (tensor rank 0, data replica 0: the others differ only in their weights' ranges) as the
/// runner will: a model the split refuses is found here, the error naming the value or node and
/// the fix. With several stages, the split of the whole model says what crosses each stage's
/// boundary, and `section` records it per stage for the runner. `lg` is the analysed model.
pub fn plan_context(lg: &LayeredGraph, section: &mut CodegenSection, mesh: &Mesh, parallel: &Parallelism) -> Result<(), StageGraphError> {
    let cp = parallel.cp.max(1);
    if cp == 1 {
        return Ok(());
    }
    let rebound = match section.batch {
        Some(b) => super::rebatch::rebind(lg, b.microbatch)?,
        None => None,
    };
    let lg = rebound.as_ref().map_or(lg, |(l, _)| l);
    let model = if section.stages.len() > 1 { Some(model_boundary(&lg.graph, &lg.dims, cp)?) } else { None };
    let mut records = Vec::new();
    for q in 0..mesh.pp() {
        let Some(&rank) = mesh.ranks.get(q).and_then(|r| r.first()).and_then(|r| r.first()) else { continue };
        let view = section.rank_view(mesh, rank, parallel.sharded_dp)?;
        let mut kv_groups = Vec::new();
        for sv in &view.stages {
            let sub = stage_subgraph(sv, &lg.graph, &lg.dims, (mesh, &view), &mut kv_groups)?;
            let boundary = model.as_ref().map(|m| stage_boundary(&sub, m)).unwrap_or_default();
            context_split(sv, sub, &lg.dims, cp, &boundary)?;
            if model.is_some() {
                records.push((sv.stage(), record_of(&boundary)));
            }
        }
    }
    for (s, record) in records {
        if let Some(st) = section.stages.get_mut(s) {
            st.context = Some(record);
        }
    }
    Ok(())
}

/// Stage `sv`'s subgraph split over its context group of `cp` (unchanged at cp 1), starting
/// from `boundary`.
fn context_split(sv: &StageView<'_>, sub: Graph, dims: &DimBindings, cp: usize, boundary: &Boundary) -> Result<StageGraph, StageGraphError> {
    let slices = sv.shards.iter().flat_map(|sh| sh.weight_slices.iter().cloned()).collect();
    if cp == 1 {
        return Ok(StageGraph { stage: sv.stage(), graph: sub, slices, context_conversions: 0 });
    }
    let split = split_context(&sub, dims, cp, boundary).map_err(|source| StageGraphError::Context { stage: sv.stage(), cp, source })?;
    Ok(StageGraph { stage: sv.stage(), graph: split.graph, slices, context_conversions: split.gathers + split.localizes })
}

/// What of the whole model's split `model` a stage's subgraph `sub` receives and yields.
fn stage_boundary(sub: &Graph, model: &Boundary) -> Boundary {
    let ends = sub.inputs.iter().chain(&sub.outputs).filter_map(|&v| {
        let name = &sub.value(v).name;
        model.tokens.get(name).map(|t: &Tokens| (name.clone(), *t))
    });
    let ints = sub.inputs.iter().filter_map(|&v| {
        let name = &sub.value(v).name;
        model.ints.get(name).map(|i| (name.clone(), i.clone()))
    });
    Boundary { tokens: ends.collect(), ints: ints.collect() }
}

/// The plan's record of a stage boundary.
fn record_of(b: &Boundary) -> StageContext {
    let tokens = b.tokens.iter().filter_map(|(n, t)| match *t {
        Tokens::Local { axis, outer } => Some((n.clone(), TokenAxis { axis, outer })),
        Tokens::Whole => None,
    });
    let ints = b.ints.iter().map(|(n, (dims, values))| (n.clone(), IntValue { dims: dims.clone(), values: values.clone() }));
    StageContext { tokens: tokens.collect(), ints: ints.collect() }
}

/// The stage boundary a plan records.
fn boundary_of(c: &StageContext) -> Boundary {
    let tokens = c.tokens.iter().map(|(n, t)| (n.clone(), Tokens::Local { axis: t.axis, outer: t.outer }));
    let ints = c.ints.iter().map(|(n, i)| (n.clone(), (i.dims.clone(), i.values.clone())));
    Boundary { tokens: tokens.collect(), ints: ints.collect() }
}

/// With several stages, the split of the whole model says which tokens cross each stage
/// boundary (the data inputs are whole: each stage cuts its own).
fn model_boundary(graph: &Graph, dims: &DimBindings, cp: usize) -> Result<Boundary, StageGraphError> {
    let split = split_context(graph, dims, cp, &Boundary::default()).map_err(|source| StageGraphError::ModelContext { cp, source })?;
    let data: HashSet<&str> = graph.inputs.iter().map(|&v| graph.value(v).name.as_str()).collect();
    Ok(Boundary { tokens: split.tokens.into_iter().filter(|(n, _)| !data.contains(n.as_str())).collect(), ints: split.ints })
}

/// Stage `sv`'s nodes of `model` with the rank's shards applied and the values it passes on
/// added; the groups of tensor ranks sharing a slice (grouped-query KV heads) are added to
/// `kv_groups`.
fn stage_subgraph(sv: &StageView<'_>, model: &Graph, dims: &DimBindings, (mesh, view): (&Mesh, &RankView<'_>), kv_groups: &mut Vec<(String, Vec<usize>)>) -> Result<Graph, StageGraphError> {
    let stage = sv.stage();
    let nodes: Vec<NodeId> = model.topo_order()?.into_iter().filter(|n| sv.code.runs(n.index())).collect();
    if nodes.len() != sv.code.node_count() {
        return Err(StageGraphError::Nodes { stage });
    }
    let mut sub = apply_shard(model, &nodes, &sv.merged_shard(), dims).map_err(|source| StageGraphError::Shard { stage, rank: view.rank, source })?;
    let (q, d, t) = (view.coord.pp, view.coord.dp, view.coord.tp);
    for sh in &sv.shards {
        // a slice shared by several tensor ranks (grouped-query KV heads): its gradient is
        // summed over the consecutive tensor ranks holding it
        for w in sh.weight_slices.iter().filter(|w| w.replicas > 1) {
            let r = w.replicas as usize;
            if r > mesh.tp() || mesh.tp() % r != 0 {
                return Err(StageGraphError::SharedSlice { stage, weight: w.initializer.clone(), replicas: r, tp: mesh.tp() });
            }
            let first = t - t % r;
            let members: Vec<usize> = (first..first + r).map(|tt| mesh.ranks[q][d][tt]).collect();
            if !kv_groups.iter().any(|(n, _)| n == &w.initializer) {
                kv_groups.push((w.initializer.clone(), members));
            }
        }
        for pg in &sh.partial_gradients {
            insert_copy_to_tensor_region(&mut sub, pg)?;
        }
    }
    pass_through(&mut sub, model, &sv.code.outputs_to_next)?;
    Ok(sub)
}

/// Adds to a stage's subgraph the values it passes on without reading (an interleaved
/// schedule's later stages read what an earlier one made): inputs that are also outputs.
fn pass_through(sub: &mut Graph, model: &Graph, names: &[String]) -> Result<(), StageGraphError> {
    for name in names {
        if sub.value_by_name(name).is_some() {
            continue;
        }
        let ty = model.value_by_name(name).and_then(|v| model.value(v).ty.clone());
        let v = sub.add_value(name.clone(), ValueKind::Input, ty, None)?;
        sub.inputs.push(v);
        sub.outputs.push(v);
    }
    Ok(())
}

/// Puts Megatron's *f* before `pg.node`'s input `pg.input`: the forward reads the value
/// unchanged, the backward all-reduces its gradient over the tensor group.
fn insert_copy_to_tensor_region(g: &mut Graph, pg: &PartialGradient) -> Result<(), StageGraphError> {
    let missing = |msg| StageGraphError::PartialGradient { node: pg.node.clone(), input: pg.input, msg };
    let node = g.node_ids().find(|&n| g.node(n).name == pg.node).ok_or_else(|| missing("the shard has no such node"))?;
    let v = g.node(node).inputs.get(pg.input).copied().flatten().ok_or_else(|| missing("the node has no such input"))?;
    let ty = g.value(v).ty.clone();
    let name = format!("{}.f.{}.{}", g.value(v).name, pg.node, pg.input);
    let out = g.add_value(name.clone(), ValueKind::Intermediate, ty, None)?;
    let order = g.node(node).order;
    g.add_node(Node {
        name,
        op: Op::Collective { kind: CollectiveKind::CopyToRegion, group: GroupKind::Tensor },
        attrs: Attrs::default(),
        inputs: vec![Some(v)],
        outputs: vec![out],
        namespace: None,
        order,
    })?;
    g.set_input(node, pg.input, Some(out));
    Ok(())
}
