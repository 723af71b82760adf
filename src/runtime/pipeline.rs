//! One rank of a plan: stage subgraphs of the model, the rank's program (forward, backward,
//! weight-gradient, sends, receives, collectives, optimizer step) executed in order, with
//! autograd across stage boundaries, data-parallel gradient sums (bucketed), ZeRO-sharded
//! AdamW and tied-weight gradient sums.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::RuntimeError;
use super::dist::{Backend, DistError, ProcessGroup, RankEnv, Store, Work};
use super::executor::Executor;
use super::train::{self, AdamW, AdamWConfig, Batch, LossKind, StepRecord};
use super::weights::is_trainable;
use crate::codegen::{Instr, LowerOptions, Payload, RankProgram, lower_schedule};
use crate::ir::{Graph, NodeId, ScheduleKind, ValueId, ValueKind};
use crate::passes::{self, AnalyzeOptions};
use crate::plan::Plan;

impl From<DistError> for RuntimeError {
    fn from(e: DistError) -> Self {
        RuntimeError::Train(e.to_string())
    }
}

fn terr(m: impl Into<String>) -> RuntimeError {
    RuntimeError::Train(m.into())
}

/// Which nodes and values each (global) stage of a plan owns.
#[derive(Clone, Debug)]
pub struct StageLayout {
    /// Nodes of each stage, in execution order.
    pub nodes: Vec<Vec<NodeId>>,
    /// `crossing[s]`: values made by stages ≤ s and read by stages > s (what stage s sends).
    pub crossing: Vec<Vec<ValueId>>,
    /// Trainable initializers each stage reads.
    pub params: Vec<Vec<ValueId>>,
    /// Stages whose forward is recomputed in the backward.
    pub recompute: Vec<bool>,
}

/// Assigns the nodes of `graph` (as imported) to the plan's stages by their layers: layers
/// come from the same analysis the planner ran; nodes the analysis folded away go with their
/// first consumer.
pub fn stage_layout(plan: &Plan, graph: &Graph) -> Result<StageLayout, RuntimeError> {
    let opts = AnalyzeOptions { seq_len: plan.seq_len.map(|s| s as i64), dims: plan.dims.clone() };
    let lg = passes::analyze(graph.clone(), &opts).map_err(|e| terr(format!("analysing the model for its layers: {e}")))?;
    let stages = plan.stages.len();
    let mut layer_stage = vec![None; lg.layers.len()];
    for (s, st) in plan.stages.iter().enumerate() {
        if st.index != s {
            return Err(terr(format!("plan stage {s} has index {}; stages must be listed in order", st.index)));
        }
        for l in st.layers[0]..=st.layers[1] {
            let slot = layer_stage
                .get_mut(l)
                .ok_or_else(|| terr(format!("stage {s} names layer {l}, but the model has {} layers", lg.layers.len())))?;
            *slot = Some(s);
        }
    }
    let mut by_name: HashMap<&str, usize> = HashMap::new();
    for (l, layer) in lg.layers.iter().enumerate() {
        let s = layer_stage[l].ok_or_else(|| terr(format!("layer {l} (`{}`) is in no stage of the plan", layer.name)))?;
        for &n in &layer.nodes {
            by_name.insert(lg.graph.node(n).name.as_str(), s);
        }
    }
    let order = graph.topo_order()?;
    let uses = graph.uses();
    let mut stage_of: HashMap<NodeId, usize> = HashMap::new();
    for &n in &order {
        if let Some(&s) = by_name.get(graph.node(n).name.as_str()) {
            stage_of.insert(n, s);
        }
    }
    // folded helpers: the earliest stage among their consumers
    for &n in order.iter().rev() {
        if stage_of.contains_key(&n) {
            continue;
        }
        let s = graph
            .node(n)
            .outputs
            .iter()
            .flat_map(|o| uses[o.index()].iter())
            .filter_map(|u| stage_of.get(u).copied())
            .min()
            .unwrap_or(stages - 1);
        stage_of.insert(n, s);
    }
    let mut nodes = vec![Vec::new(); stages];
    for &n in &order {
        nodes[stage_of[&n]].push(n);
    }
    let mut made_in: HashMap<ValueId, usize> = HashMap::new();
    for &n in &order {
        for &o in &graph.node(n).outputs {
            made_in.insert(o, stage_of[&n]);
        }
    }
    let mut crossing: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); stages.saturating_sub(1)];
    let mut params: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); stages];
    for &n in &order {
        let s = stage_of[&n];
        for &v in graph.node(n).inputs.iter().flatten() {
            if let Some(&from) = made_in.get(&v) {
                if from > s {
                    return Err(terr(format!(
                        "node `{}` in stage {s} reads `{}` made in the later stage {from}",
                        graph.node(n).name,
                        graph.value(v).name
                    )));
                }
                for c in crossing.iter_mut().take(s).skip(from) {
                    c.insert(v);
                }
            } else if graph.value(v).kind != ValueKind::Input && is_trainable(graph, v) {
                params[s].insert(v);
            }
        }
    }
    for &o in &graph.outputs {
        if let Some(&from) = made_in.get(&o) {
            for c in crossing.iter_mut().skip(from) {
                c.insert(o);
            }
        }
    }
    let full = plan.parallel.checkpointing == "full";
    let recompute = plan.stages.iter().map(|s| full || !s.checkpointed_layers.is_empty()).collect();
    Ok(StageLayout {
        nodes,
        crossing: crossing.into_iter().map(|c| c.into_iter().collect()).collect(),
        params: params.into_iter().map(|c| c.into_iter().collect()).collect(),
        recompute,
    })
}

/// Where each global rank sits: its pipeline rank and data-parallel index.
#[derive(Clone, Debug)]
pub struct Placement {
    /// Pipeline ranks.
    pub pp: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// `ranks[q][d]`: the global rank of pipeline rank q in replica d.
    pub ranks: Vec<Vec<usize>>,
}

impl Placement {
    /// From the plan's stage rank lists.
    pub fn of(plan: &Plan) -> Result<Placement, RuntimeError> {
        let p = plan.parallel.pp.max(1);
        let dp = plan.parallel.dp.max(1);
        if plan.parallel.tp > 1 {
            return Err(terr(format!(
                "the plan uses tensor parallelism (tp = {}); this runner executes pipeline and data parallelism only — re-plan with --tp 1",
                plan.parallel.tp
            )));
        }
        let mut ranks = vec![Vec::new(); p];
        for st in &plan.stages {
            let q = st.pp_rank;
            if q >= p {
                return Err(terr(format!("stage {} sits on pipeline rank {q}, but pp = {p}", st.index)));
            }
            if st.ranks.len() != dp {
                return Err(terr(format!("stage {} lists {} ranks; with tp = 1 it needs dp = {dp}", st.index, st.ranks.len())));
            }
            if ranks[q].is_empty() {
                ranks[q] = st.ranks.clone();
            } else if ranks[q] != st.ranks {
                return Err(terr(format!("stages of pipeline rank {q} list different ranks")));
            }
        }
        if ranks.iter().any(Vec::is_empty) {
            return Err(terr("a pipeline rank has no stage"));
        }
        Ok(Placement { pp: p, dp, ranks })
    }

    /// (pipeline rank, replica) of a global rank.
    pub fn locate(&self, rank: usize) -> Option<(usize, usize)> {
        self.ranks.iter().enumerate().find_map(|(q, rs)| rs.iter().position(|&r| r == rank).map(|d| (q, d)))
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.pp * self.dp
    }
}

/// The schedule a plan names.
pub fn schedule_of(plan: &Plan) -> Result<ScheduleKind, RuntimeError> {
    let v = plan.parallel.virtual_stages.max(1);
    let name = if plan.parallel.schedule == "interleaved" { format!("interleaved:{v}") } else { plan.parallel.schedule.clone() };
    name.parse::<ScheduleKind>().map_err(|e| terr(format!("plan schedule: {e}")))
}

/// Every rank's program. The plan's own per-rank programs replace this once codegen writes
/// them; until then they are lowered here from the plan's schedule, with the epilogue of
/// gradient collectives the plan's parallel configuration implies.
pub fn rank_programs(plan: &Plan, layout: &StageLayout, graph: &Graph) -> Result<Vec<RankProgram>, RuntimeError> {
    let place = Placement::of(plan)?;
    let kind = schedule_of(plan)?;
    let stages = kind.stages(place.pp);
    if stages != plan.stages.len() {
        return Err(terr(format!("schedule {kind} on pp = {} has {stages} stages; the plan lists {}", place.pp, plan.stages.len())));
    }
    let m = plan.parallel.microbatches.max(1);
    let zero = plan.parallel.zero;
    let boundary: Vec<u64> = plan.stages.iter().map(|s| s.output_bytes).collect();
    let mut programs = Vec::with_capacity(place.world());
    // tied weights: initializers read on several pipeline ranks
    let mut holders: HashMap<ValueId, BTreeSet<usize>> = HashMap::new();
    for (s, ps) in layout.params.iter().enumerate() {
        for &p in ps {
            holders.entry(p).or_default().insert(kind.rank_of_stage(s, place.pp));
        }
    }
    let mut tied: Vec<(ValueId, Vec<usize>)> = holders.into_iter().filter(|(_, q)| q.len() > 1).map(|(v, q)| (v, q.into_iter().collect())).collect();
    tied.sort();
    for d in 0..place.dp {
        let ranks: Vec<usize> = (0..place.pp).map(|q| place.ranks[q][d]).collect();
        let mut epilogue = vec![Vec::new(); place.pp];
        for (v, qs) in &tied {
            let group: Vec<usize> = qs.iter().map(|&q| ranks[q]).collect();
            for &q in qs {
                epilogue[q].push(Instr::AllReduce { group: group.clone(), bytes: 0, tag: format!("tied:{}", graph.value(*v).name) });
            }
        }
        if place.dp > 1 {
            for (q, e) in epilogue.iter_mut().enumerate() {
                let group = place.ranks[q].clone();
                let tag = format!("dp-grads:pp{q}");
                e.push(if zero >= 2 {
                    Instr::ReduceScatter { group, bytes: 0, tag }
                } else {
                    Instr::AllReduce { group, bytes: 0, tag }
                });
            }
        }
        let opts = LowerOptions { ranks: ranks.clone(), boundary_bytes: boundary.clone(), epilogue };
        let mut progs = lower_schedule(kind, place.pp, m, &opts).map_err(|e| terr(format!("lowering the schedule: {e}")))?;
        if place.dp > 1 && zero >= 1 {
            for (q, p) in progs.iter_mut().enumerate() {
                p.instrs.push(Instr::AllGather { group: place.ranks[q].clone(), bytes: 0, tag: format!("zero-params:pp{q}") });
            }
        }
        programs.extend(progs);
    }
    programs.sort_by_key(|p| p.rank);
    Ok(programs)
}

/// Settings of a distributed run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// What is minimised.
    pub loss: LossKind,
    /// Optimizer settings.
    pub adamw: AdamWConfig,
    /// Global gradient-norm limit.
    pub clip: Option<f64>,
    /// Timeout of every collective and receive.
    pub timeout: Duration,
    /// Data-parallel all-reduce bucket size.
    pub bucket_bytes: usize,
    /// Print `[rank R] step N` on stderr after every step.
    pub progress: bool,
}

/// What one rank measured.
#[derive(Clone, Debug)]
pub struct RankReport {
    /// Per step: the global mean loss (identical on every rank) and this rank's step time.
    pub steps: Vec<StepRecord>,
    /// Every rank's mean step time (first step excluded) and peak RSS, by global rank.
    pub ranks: Vec<(f64, u64)>,
}

struct MbState {
    inputs: Vec<(ValueId, Tensor)>,
    outputs: Vec<(ValueId, Tensor)>,
    loss: Option<Tensor>,
    /// The backward's root, kept between a split B and its W.
    root: Option<Tensor>,
}

const META: usize = 10;

fn kind_code(k: Kind) -> Result<i64, RuntimeError> {
    Ok(match k {
        Kind::Float => 0,
        Kind::Double => 1,
        Kind::Int64 => 2,
        Kind::Int => 3,
        Kind::Bool => 4,
        Kind::Half => 5,
        Kind::BFloat16 => 6,
        Kind::Uint8 => 7,
        Kind::Int8 => 8,
        other => return Err(terr(format!("cannot send tensors of kind {other:?}"))),
    })
}

fn code_kind(c: i64) -> Result<Kind, RuntimeError> {
    Ok(match c {
        0 => Kind::Float,
        1 => Kind::Double,
        2 => Kind::Int64,
        3 => Kind::Int,
        4 => Kind::Bool,
        5 => Kind::Half,
        6 => Kind::BFloat16,
        7 => Kind::Uint8,
        8 => Kind::Int8,
        _ => return Err(terr(format!("received an unknown tensor kind code {c}"))),
    })
}

fn tag(what: Payload, stage: usize, mb: usize, j: usize) -> u32 {
    let w = usize::from(what == Payload::Gradient);
    ((((w * 64 + stage % 64) * 1024 + mb % 1024) * 1024) + j % 1024) as u32
}

fn is_float(t: &Tensor) -> bool {
    matches!(t.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}

/// Runs this rank's part of `plan` for `cfg.steps` steps on `batch` (the global batch; every
/// rank holds it and takes its replica's share).
pub fn run_rank(
    plan: &Plan,
    exec: &Executor,
    batch: &Batch,
    cfg: &RunConfig,
    env: &RankEnv,
) -> Result<RankReport, RuntimeError> {
    let graph = exec.graph();
    let layout = stage_layout(plan, graph)?;
    let place = Placement::of(plan)?;
    if env.world != place.world() {
        return Err(terr(format!(
            "the plan needs {} ranks (pp {} × dp {}), WORLD_SIZE is {}; launch with --nproc {}",
            place.world(),
            place.pp,
            place.dp,
            env.world,
            place.world()
        )));
    }
    let programs = rank_programs(plan, &layout, graph)?;
    let kind = schedule_of(plan)?;
    let me = env.rank;
    let (q, d) = place.locate(me).ok_or_else(|| terr(format!("rank {me} runs no stage of the plan")))?;
    let program = programs.iter().find(|p| p.rank == me).ok_or_else(|| terr(format!("no program for rank {me}")))?;
    let m = plan.parallel.microbatches.max(1);
    let zero = plan.parallel.zero;
    let dp = place.dp;

    // groups: every distinct member list in any program, plus the world, created in one global
    // order by their members (creation is a rendezvous)
    let store: Arc<Store> = Store::connect(env, cfg.timeout)?;
    let world: Vec<usize> = (0..env.world).collect();
    let mut lists: BTreeSet<Vec<usize>> = BTreeSet::new();
    lists.insert(world.clone());
    for p in &programs {
        for i in &p.instrs {
            if let Some((g, _)) = i.collective() {
                lists.insert(g.to_vec());
            }
        }
    }
    let mut groups: HashMap<Vec<usize>, ProcessGroup> = HashMap::new();
    for g in lists {
        if g.contains(&me) {
            let pg = ProcessGroup::new(&store, &g, me, cfg.timeout, Backend::Gloo)?;
            groups.insert(g, pg);
        }
    }
    let world_pg = &groups[&world];

    // this rank's parameters (union over its stages) and the ones whose norm it counts
    let my_stages: Vec<usize> = (0..plan.stages.len()).filter(|&s| kind.rank_of_stage(s, place.pp) == q).collect();
    let mut param_ids: BTreeSet<ValueId> = BTreeSet::new();
    for &s in &my_stages {
        param_ids.extend(layout.params[s].iter().copied());
    }
    let param_ids: Vec<ValueId> = param_ids.into_iter().collect();
    let first_holder = |v: ValueId| (0..plan.stages.len()).find(|&s| layout.params[s].contains(&v)).map(|s| kind.rank_of_stage(s, place.pp));
    let counted: Vec<bool> = param_ids.iter().map(|&v| first_holder(v) == Some(q)).collect();
    let params: Vec<Tensor> = param_ids
        .iter()
        .map(|v| exec.weights.get(v).map(Tensor::shallow_clone).ok_or_else(|| terr(format!("no weight for `{}`", graph.value(*v).name))))
        .collect::<Result<_, _>>()?;
    let numels: Vec<i64> = params.iter().map(|p| p.numel() as i64).collect();
    let total: i64 = numels.iter().sum();
    let shard = (total + dp as i64 - 1) / dp as i64;
    let padded = shard * dp as i64;
    let float_kind = params.first().map_or(Kind::Float, Tensor::kind);
    let opts = (float_kind, tch::Device::Cpu);
    let flatten = |ts: &[Tensor]| -> Result<Tensor, RuntimeError> {
        let mut parts: Vec<Tensor> = ts.iter().map(|t| t.f_detach().and_then(|t| t.f_reshape([-1]))).collect::<Result<_, _>>()?;
        if padded > total {
            parts.push(Tensor::f_zeros([padded - total], opts)?);
        }
        if parts.is_empty() {
            return Ok(Tensor::f_zeros([0], opts)?);
        }
        Ok(Tensor::f_cat(&parts, 0)?)
    };
    let sharded = dp > 1 && zero >= 1;
    let mut opt = if sharded {
        let p0 = flatten(&params)?.f_narrow(0, d as i64 * shard, shard)?.f_contiguous()?;
        (AdamW::new(&[p0], cfg.adamw)?, true)
    } else {
        (AdamW::new(&params, cfg.adamw)?, false)
    };
    // norm mask over the flat buffer: 1 where this rank counts the element
    let mask = {
        let parts: Vec<Tensor> = counted
            .iter()
            .zip(&numels)
            .map(|(&c, &n)| Tensor::f_full([n], if c { 1.0 } else { 0.0 }, opts))
            .collect::<Result<_, _>>()?;
        let mut parts = parts;
        if padded > total {
            parts.push(Tensor::f_zeros([padded - total], opts)?);
        }
        if parts.is_empty() { Tensor::f_zeros([0], opts)? } else { Tensor::f_cat(&parts, 0)? }
    };

    // this replica's microbatches: replica d takes the d-th contiguous share of the batch
    let replica: Batch = {
        let mut out = Vec::new();
        for (name, t) in batch {
            let b = t.size().first().copied().unwrap_or(0);
            if b % (dp * m) as i64 != 0 {
                return Err(terr(format!("array `{name}` has batch {b}, not divisible into dp {dp} × {m} microbatches")));
            }
            out.push((name.clone(), t.f_narrow(0, d as i64 * (b / dp as i64), b / dp as i64)?));
        }
        out
    };
    let micro = train::split_batch(&replica, m)?;
    let input_names: Vec<String> = graph.inputs.iter().map(|&v| graph.value(v).name.clone()).collect();
    let feeds_of: Vec<HashMap<ValueId, Tensor>> = micro
        .iter()
        .map(|mb| {
            let f: Vec<(String, Tensor)> =
                mb.iter().filter(|(n, _)| input_names.contains(n)).map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
            exec.bind_inputs(f)
        })
        .collect::<Result<_, _>>()?;
    let last_stage = plan.stages.len() - 1;
    let weight = 1.0 / (m * dp) as f64;
    let split_w: BTreeSet<(usize, usize)> =
        program.instrs.iter().filter_map(|i| if let Instr::BackwardWeight { stage, mb } = i { Some((*stage, *mb)) } else { None }).collect();

    let mut records = Vec::with_capacity(cfg.steps);
    for step in 1..=cfg.steps {
        let t0 = Instant::now();
        let mut grads: Vec<Option<Tensor>> = (0..params.len()).map(|_| None).collect();
        let mut grad_shard: Option<Tensor> = None;
        let mut state: HashMap<(usize, usize), MbState> = HashMap::new();
        let mut act_in: HashMap<(usize, usize), Vec<Tensor>> = HashMap::new();
        let mut grad_for: HashMap<(usize, usize), Vec<Tensor>> = HashMap::new();
        let mut pending: Vec<Work> = Vec::new();
        let mut loss_sum = 0.0;
        let pos_of: HashMap<ValueId, usize> = param_ids.iter().enumerate().map(|(i, v)| (*v, i)).collect();

        let forward = |s: usize, mb: usize, inputs: &[(ValueId, Tensor)], grad: bool| -> Result<(Vec<(ValueId, Tensor)>, Option<Tensor>), RuntimeError> {
            let mut feeds: HashMap<ValueId, Tensor> = feeds_of[mb].iter().map(|(k, v)| (*k, v.shallow_clone())).collect();
            for (v, t) in inputs {
                feeds.insert(*v, t.shallow_clone());
            }
            let keep: Vec<ValueId> = if s == last_stage { graph.outputs.clone() } else { layout.crossing[s].clone() };
            let run = || exec.run_nodes(&layout.nodes[s], &feeds, &keep);
            let outs = if grad { run()? } else { tch::no_grad(run)? };
            if s == last_stage {
                let outs: Vec<Tensor> = keep.iter().map(|v| outs[v].shallow_clone()).collect();
                let loss = train::loss_of(exec, cfg.loss, &micro[mb], &outs)?.f_mul_scalar(weight)?;
                Ok((Vec::new(), Some(loss)))
            } else {
                Ok((keep.iter().map(|v| (*v, outs[v].shallow_clone())).collect(), None))
            }
        };

        for instr in &program.instrs {
            match instr {
                Instr::Forward { stage: s, mb } => {
                    let (s, mb) = (*s, *mb);
                    let raw: Vec<Tensor> = if s == 0 {
                        Vec::new()
                    } else if let Some(t) = act_in.remove(&(s, mb)) {
                        t
                    } else {
                        let prev = state.get(&(s - 1, mb)).ok_or_else(|| terr(format!("stage {s} mb {mb}: no input from stage {}", s - 1)))?;
                        prev.outputs.iter().map(|(_, t)| t.shallow_clone()).collect()
                    };
                    let ids: &[ValueId] = if s == 0 { &[] } else { &layout.crossing[s - 1] };
                    if raw.len() != ids.len() {
                        return Err(terr(format!("stage {s} mb {mb}: {} inputs arrived, {} expected", raw.len(), ids.len())));
                    }
                    let inputs: Vec<(ValueId, Tensor)> = ids
                        .iter()
                        .zip(raw)
                        .map(|(v, t)| Ok((*v, if is_float(&t) { t.f_detach()?.f_set_requires_grad(true)? } else { t })))
                        .collect::<Result<_, RuntimeError>>()?;
                    let recompute = layout.recompute[s];
                    let (outputs, loss) = forward(s, mb, &inputs, !recompute)?;
                    if let Some(l) = &loss {
                        loss_sum += l.f_double_value(&[])?;
                    }
                    state.insert((s, mb), MbState { inputs, outputs, loss, root: None });
                }
                Instr::Backward { stage: s, mb } => {
                    let (s, mb) = (*s, *mb);
                    let mut st = state.remove(&(s, mb)).ok_or_else(|| terr(format!("backward of stage {s} mb {mb} before its forward")))?;
                    if layout.recompute[s] {
                        let (outputs, loss) = forward(s, mb, &st.inputs, true)?;
                        st.outputs = outputs;
                        st.loss = loss;
                    }
                    let mut root: Option<Tensor> = st.loss.take();
                    if s != last_stage {
                        let gs = grad_for.remove(&(s, mb)).unwrap_or_default();
                        let floats: Vec<&Tensor> = st.outputs.iter().map(|(_, t)| t).filter(|t| is_float(t)).collect();
                        if gs.len() != floats.len() {
                            return Err(terr(format!("stage {s} mb {mb}: {} gradients for {} outputs", gs.len(), floats.len())));
                        }
                        for (o, g) in floats.into_iter().zip(&gs) {
                            if o.requires_grad() {
                                let term = o.f_mul(g)?.f_sum(o.kind())?;
                                root = Some(match root {
                                    Some(r) => r.f_add(&term)?,
                                    None => term,
                                });
                            }
                        }
                    }
                    let leaves: Vec<Tensor> = st.inputs.iter().map(|(_, t)| t).filter(|t| is_float(t)).map(Tensor::shallow_clone).collect();
                    let mine: Vec<usize> = layout.params[s].iter().filter_map(|v| pos_of.get(v).copied()).collect();
                    let split = split_w.contains(&(s, mb));
                    let root_req = root.as_ref().filter(|r| r.requires_grad());
                    let mut in_grads: Vec<Tensor> = Vec::new();
                    if let Some(r) = root_req {
                        let grad_leaves: Vec<&Tensor> = leaves.iter().filter(|t| t.requires_grad()).collect();
                        let mut inputs: Vec<&Tensor> = grad_leaves.clone();
                        if !split {
                            inputs.extend(mine.iter().map(|&i| &params[i]));
                        }
                        let got = if inputs.is_empty() { Vec::new() } else { Tensor::f_run_backward(&[r], &inputs, split, false)? };
                        let (gin, gp) = got.split_at(grad_leaves.len());
                        let mut it = gin.iter();
                        for t in &leaves {
                            let g = if t.requires_grad() { it.next().map(Tensor::shallow_clone) } else { None };
                            in_grads.push(match g.filter(Tensor::defined) {
                                Some(g) => g,
                                None => t.f_zeros_like()?,
                            });
                        }
                        for (&i, g) in mine.iter().zip(gp) {
                            accumulate(&mut grads[i], g)?;
                        }
                    } else {
                        for t in &leaves {
                            in_grads.push(t.f_zeros_like()?);
                        }
                    }
                    if split {
                        st.root = root;
                        state.insert((s, mb), st);
                    }
                    if s > 0 {
                        grad_for.insert((s - 1, mb), in_grads);
                    }
                }
                Instr::BackwardWeight { stage: s, mb } => {
                    let (s, mb) = (*s, *mb);
                    let st = state.remove(&(s, mb)).ok_or_else(|| terr(format!("weight gradient of stage {s} mb {mb} before its backward")))?;
                    if let Some(r) = st.root.filter(|r| r.requires_grad()) {
                        let mine: Vec<usize> = layout.params[s].iter().filter_map(|v| pos_of.get(v).copied()).collect();
                        let inputs: Vec<&Tensor> = mine.iter().map(|&i| &params[i]).collect();
                        if !inputs.is_empty() {
                            let got = Tensor::f_run_backward(&[&r], &inputs, false, false)?;
                            for (&i, g) in mine.iter().zip(&got) {
                                accumulate(&mut grads[i], g)?;
                            }
                        }
                    }
                }
                Instr::Send { peer, what, stage: s, mb, .. } => {
                    let (s, mb) = (*s, *mb);
                    let ts: Vec<Tensor> = match what {
                        Payload::Activation => state
                            .get(&(s, mb))
                            .ok_or_else(|| terr(format!("send of stage {s} mb {mb} before its forward")))?
                            .outputs
                            .iter()
                            .map(|(_, t)| t.shallow_clone())
                            .collect(),
                        Payload::Gradient => grad_for
                            .remove(&(s - 1, mb))
                            .ok_or_else(|| terr(format!("gradient send of stage {s} mb {mb} before its backward")))?,
                    };
                    for (j, t) in ts.iter().enumerate() {
                        let t = t.f_detach()?.f_contiguous()?;
                        let mut meta = vec![0i64; META];
                        let size = t.size();
                        if size.len() > META - 2 {
                            return Err(terr(format!("cannot send a rank-{} tensor", size.len())));
                        }
                        meta[0] = size.len() as i64;
                        meta[1..=size.len()].copy_from_slice(&size);
                        meta[META - 1] = kind_code(t.kind())?;
                        let meta = Tensor::from_slice(&meta);
                        pending.push(world_pg.isend(&meta, *peer, tag(*what, s, mb, 2 * j))?);
                        pending.push(world_pg.isend(&t, *peer, tag(*what, s, mb, 2 * j + 1))?);
                    }
                }
                Instr::Recv { peer, what, stage: s, mb, .. } => {
                    let (s, mb) = (*s, *mb);
                    // the sender tags with its own stage
                    let (from, count) = match what {
                        Payload::Activation => (s - 1, layout.crossing[s - 1].len()),
                        Payload::Gradient => {
                            let st = state.get(&(s, mb)).ok_or_else(|| terr(format!("gradient for stage {s} mb {mb} before its forward")))?;
                            let n = if layout.recompute[s] {
                                // outputs are recomputed; the count follows the crossing values' kinds
                                st.outputs.iter().filter(|(_, t)| is_float(t)).count()
                            } else {
                                st.outputs.iter().filter(|(_, t)| is_float(t)).count()
                            };
                            (s + 1, n)
                        }
                    };
                    let mut got = Vec::with_capacity(count);
                    for j in 0..count {
                        let meta = Tensor::f_zeros([META as i64], (Kind::Int64, tch::Device::Cpu))?;
                        let meta = world_pg.irecv(&meta, *peer, tag(*what, from, mb, 2 * j))?.wait()?;
                        let meta: Vec<i64> = Vec::<i64>::try_from(&meta).map_err(|e| terr(e.to_string()))?;
                        let rank = meta[0] as usize;
                        let buf = Tensor::f_zeros(&meta[1..=rank], (code_kind(meta[META - 1])?, tch::Device::Cpu))?;
                        got.push(world_pg.irecv(&buf, *peer, tag(*what, from, mb, 2 * j + 1))?.wait()?);
                    }
                    match what {
                        Payload::Activation => {
                            act_in.insert((s, mb), got);
                        }
                        Payload::Gradient => {
                            grad_for.insert((s, mb), got);
                        }
                    }
                }
                Instr::AllReduce { group, tag: t, .. } => {
                    let pg = &groups[group];
                    if let Some(name) = t.strip_prefix("tied:") {
                        let v = graph.value_by_name(name).ok_or_else(|| terr(format!("tied weight `{name}` is not in the model")))?;
                        let i = *pos_of.get(&v).ok_or_else(|| terr(format!("tied weight `{name}` is not on rank {me}")))?;
                        let g = match grads[i].take() {
                            Some(g) => g.f_contiguous()?,
                            None => params[i].f_zeros_like()?,
                        };
                        pg.all_reduce_sum(&g)?;
                        grads[i] = Some(g);
                    } else if t.starts_with("dp-grads") {
                        let full: Vec<Tensor> = grads
                            .iter()
                            .zip(&params)
                            .map(|(g, p)| match g {
                                Some(g) => Ok(g.shallow_clone()),
                                None => p.f_zeros_like(),
                            })
                            .collect::<Result<_, _>>()?;
                        if sharded {
                            let flat = flatten(&full)?;
                            pg.all_reduce_sum(&flat)?;
                            grad_shard = Some(flat.f_narrow(0, d as i64 * shard, shard)?.f_contiguous()?);
                        } else {
                            grads = all_reduce_bucketed(pg, full, cfg.bucket_bytes)?.into_iter().map(Some).collect();
                        }
                    } else {
                        return Err(terr(format!("all-reduce with unknown tag `{t}`")));
                    }
                }
                Instr::ReduceScatter { group, tag: t, .. } => {
                    if !t.starts_with("dp-grads") {
                        return Err(terr(format!("reduce-scatter with unknown tag `{t}`")));
                    }
                    let full: Vec<Tensor> = grads
                        .iter()
                        .zip(&params)
                        .map(|(g, p)| match g {
                            Some(g) => Ok(g.shallow_clone()),
                            None => p.f_zeros_like(),
                        })
                        .collect::<Result<_, _>>()?;
                    let flat = flatten(&full)?;
                    let out = Tensor::f_zeros([shard], opts)?;
                    groups[group].reduce_scatter_sum(&out, &flat)?;
                    grads = (0..params.len()).map(|_| None).collect();
                    grad_shard = Some(out);
                }
                Instr::OptimizerStep => {
                    for w in pending.drain(..) {
                        let _ = w.wait()?;
                    }
                    let _guard = tch::no_grad_guard();
                    // squared norm of the gradients this rank counts, and its loss share
                    let sq = if let Some(gs) = &grad_shard {
                        let mk = mask.f_narrow(0, d as i64 * shard, shard)?;
                        gs.f_mul(&mk)?.f_square()?.f_sum(Kind::Double)?.f_double_value(&[])?
                    } else if d == 0 {
                        let mut acc = 0.0;
                        for (g, &c) in grads.iter().zip(&counted) {
                            if let (Some(g), true) = (g, c) {
                                let n = g.f_norm()?.f_double_value(&[])?;
                                acc += n * n;
                            }
                        }
                        acc
                    } else {
                        0.0
                    };
                    let both = Tensor::from_slice(&[sq, loss_sum]);
                    world_pg.all_reduce_sum(&both)?;
                    let both: Vec<f64> = Vec::<f64>::try_from(&both).map_err(|e| terr(e.to_string()))?;
                    loss_sum = both[1];
                    if let Some(c) = cfg.clip {
                        let norm = both[0].sqrt();
                        let coef = (c / (norm + 1e-6)).min(1.0);
                        for g in grads.iter_mut().flatten() {
                            let _ = g.f_mul_scalar_(coef)?;
                        }
                        if let Some(g) = &mut grad_shard {
                            let _ = g.f_mul_scalar_(coef)?;
                        }
                    }
                    if opt.1 {
                        let gs = match grad_shard.take() {
                            Some(g) => g,
                            None => return Err(terr("ZeRO optimizer step without a reduced gradient shard")),
                        };
                        let ps = flatten(&params)?.f_narrow(0, d as i64 * shard, shard)?.f_contiguous()?;
                        opt.0.step_with(&[ps.shallow_clone()], &[gs])?;
                        grad_shard = Some(ps);
                    } else {
                        let gs: Vec<Tensor> = grads.iter().map(|g| g.as_ref().map_or_else(Tensor::new, Tensor::shallow_clone)).collect();
                        opt.0.step_with(&params, &gs)?;
                    }
                }
                Instr::AllGather { group, tag: t, .. } => {
                    if !t.starts_with("zero-params") {
                        return Err(terr(format!("all-gather with unknown tag `{t}`")));
                    }
                    // after the step grad_shard holds the updated parameter shard
                    let ps = grad_shard.take().ok_or_else(|| terr("parameter all-gather without an updated shard"))?;
                    let out = Tensor::f_zeros([padded], opts)?;
                    groups[group].all_gather(&out, &ps)?;
                    let _guard = tch::no_grad_guard();
                    let mut off = 0;
                    for (p, &n) in params.iter().zip(&numels) {
                        let mut p = p.shallow_clone();
                        p.f_copy_(&out.f_narrow(0, off, n)?.f_view_as(&p)?)?;
                        off += n;
                    }
                }
            }
        }
        for w in pending.drain(..) {
            let _ = w.wait()?;
        }
        records.push(StepRecord { step, loss: loss_sum, time_s: t0.elapsed().as_secs_f64() });
        if cfg.progress {
            eprintln!("[rank {me}] step {step} loss {loss_sum:.6}");
        }
    }
    let timed: Vec<f64> = records.iter().skip(usize::from(records.len() > 1)).map(|s| s.time_s).collect();
    let mean = timed.iter().sum::<f64>() / timed.len().max(1) as f64;
    let mine = Tensor::from_slice(&[mean, peak_rss_bytes() as f64]);
    let all = Tensor::f_zeros([2 * env.world as i64], (Kind::Double, tch::Device::Cpu))?;
    world_pg.all_gather(&all, &mine)?;
    let all: Vec<f64> = Vec::<f64>::try_from(&all).map_err(|e| terr(e.to_string()))?;
    let ranks = all.chunks(2).map(|c| (c[0], c[1] as u64)).collect();
    world_pg.barrier()?;
    Ok(RankReport { steps: records, ranks })
}

fn accumulate(slot: &mut Option<Tensor>, g: &Tensor) -> Result<(), RuntimeError> {
    if !g.defined() {
        return Ok(());
    }
    match slot {
        Some(acc) => {
            let _ = acc.f_add_(g)?;
        }
        None => *slot = Some(g.f_detach()?.f_mul_scalar(1.0)?),
    }
    Ok(())
}

/// Sums gradients over `pg` in buckets of about `bucket_bytes`, in parameter order.
fn all_reduce_bucketed(pg: &ProcessGroup, grads: Vec<Tensor>, bucket_bytes: usize) -> Result<Vec<Tensor>, RuntimeError> {
    let mut out: Vec<Tensor> = Vec::with_capacity(grads.len());
    let mut start = 0;
    while start < grads.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < grads.len() && (end == start || bytes + grads[end].numel() * grads[end].kind().elt_size_in_bytes() <= bucket_bytes) {
            bytes += grads[end].numel() * grads[end].kind().elt_size_in_bytes();
            end += 1;
        }
        let flat: Vec<Tensor> = grads[start..end].iter().map(|g| g.f_reshape([-1])).collect::<Result<_, _>>()?;
        let flat = Tensor::f_cat(&flat, 0)?;
        pg.all_reduce_sum(&flat)?;
        let mut off = 0;
        for g in &grads[start..end] {
            let n = g.numel() as i64;
            out.push(flat.f_narrow(0, off, n)?.f_view_as(g)?);
            off += n;
        }
        start = end;
    }
    Ok(out)
}

/// Peak resident memory of this process (bytes), from /proc.
pub fn peak_rss_bytes() -> u64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
