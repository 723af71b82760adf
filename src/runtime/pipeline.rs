//! One rank of a plan: stage subgraphs of the model, the rank's program (forward, backward,
//! weight-gradient, sends, receives, collectives, optimizer step) executed in order, with
//! autograd across stage boundaries, data-parallel gradient sums (bucketed), ZeRO-sharded
//! AdamW and tied-weight gradient sums.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use super::RuntimeError;
use super::dist::{Backend, DistError, ProcessGroup, RankEnv, Store, Work};
use super::executor::Executor;
use super::train::{self, AdamW, AdamWConfig, Batch, LossKind, StepRecord};
use super::weights::is_trainable;
use crate::codegen::{Instr, Payload, Purpose, RankProgram};
use crate::ir::{Graph, LayeredGraph, NodeId, ScheduleKind, ValueId, ValueKind};
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
pub fn stage_layout(plan: &Plan, graph: &Graph, lg: &LayeredGraph) -> Result<StageLayout, RuntimeError> {
    let stages = plan.stages.len();
    if stages == 0 {
        return Err(terr("the plan has no stages"));
    }
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

/// Where each global rank sits: its pipeline rank, data-parallel index and tensor rank.
#[derive(Clone, Debug)]
pub struct Placement {
    /// Pipeline ranks.
    pub pp: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// `ranks[q][d · tp + t]`: the global rank of pipeline rank q, replica d, tensor rank t.
    pub ranks: Vec<Vec<usize>>,
}

impl Placement {
    /// From the plan's stage rank lists.
    pub fn of(plan: &Plan) -> Result<Placement, RuntimeError> {
        let p = plan.parallel.pp.max(1);
        let dp = plan.parallel.dp.max(1);
        let tp = plan.parallel.tp.max(1);
        let mut ranks = vec![Vec::new(); p];
        for st in &plan.stages {
            let q = st.pp_rank;
            if q >= p {
                return Err(terr(format!("stage {} sits on pipeline rank {q}, but pp = {p}", st.index)));
            }
            if st.ranks.len() != dp * tp {
                return Err(terr(format!("stage {} lists {} ranks; it needs dp {dp} × tp {tp}", st.index, st.ranks.len())));
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
        Ok(Placement { pp: p, dp, tp, ranks })
    }

    /// (pipeline rank, replica, tensor rank) of a global rank.
    pub fn locate(&self, rank: usize) -> Option<(usize, usize, usize)> {
        self.ranks.iter().enumerate().find_map(|(q, rs)| rs.iter().position(|&r| r == rank).map(|i| (q, i / self.tp, i % self.tp)))
    }

    /// The tensor-parallel groups (global ranks), one per pipeline rank and replica.
    pub fn tensor_groups(&self) -> Vec<Vec<usize>> {
        self.ranks.iter().flat_map(|rs| rs.chunks(self.tp).map(<[usize]>::to_vec)).collect()
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.pp * self.dp * self.tp
    }
}

/// The schedule a plan names.
pub fn schedule_of(plan: &Plan) -> Result<ScheduleKind, RuntimeError> {
    let v = plan.parallel.virtual_stages.max(1);
    let name = if plan.parallel.schedule == "interleaved" { format!("interleaved:{v}") } else { plan.parallel.schedule.clone() };
    name.parse::<ScheduleKind>().map_err(|e| terr(format!("plan schedule: {e}")))
}

/// Every rank's program, as codegen emitted them into the plan (plans written before the
/// codegen section get it built here from the same analysis).
pub fn rank_programs(plan: &Plan, lg: &LayeredGraph) -> Result<Vec<RankProgram>, RuntimeError> {
    let built;
    let section = match &plan.codegen {
        Some(c) => c,
        None => {
            let input = plan.codegen_input().map_err(|e| terr(e.to_string()))?;
            built = crate::codegen::encode::build(lg, &input).map_err(|e| terr(e.to_string()))?;
            &built
        }
    };
    let mut programs = section.all_programs(&plan.mesh(), plan.parallel.sharded_dp).map_err(|e| terr(e.to_string()))?;
    programs.sort_by_key(|p| p.rank);
    Ok(programs)
}

/// Runs the planner's analysis of the model (layers as the plan numbers them).
pub fn analyse(plan: &Plan, graph: &Graph) -> Result<LayeredGraph, RuntimeError> {
    let opts = AnalyzeOptions { seq_len: plan.seq_len.map(|s| s as i64), dims: plan.dims.clone() };
    passes::analyze(graph.clone(), &opts).map_err(|e| terr(format!("analysing the model for its layers: {e}")))
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

/// Bytes of trained state: parameters (full tensors, ZeRO blocks), gradients, optimizer moments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// Parameters.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
}

impl StateBytes {
    /// The sum of the three.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// What one rank measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankStats {
    /// Mean step time (first step excluded), seconds.
    pub step_time_s: f64,
    /// Peak resident memory of the process.
    pub peak_rss_bytes: u64,
    /// The trained state held when its total peaked (counted between instructions and around
    /// collectives' buffers, as tensors are allocated and released).
    pub peak_state: StateBytes,
    /// The most parameter bytes held at any point (gathered ZeRO-3 stages included).
    pub peak_param_bytes: u64,
    /// Parameter bytes held between uses (after the last step).
    pub resident_param_bytes: u64,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct RankReport {
    /// Per step: the global mean loss (identical on every rank) and this rank's step time.
    pub steps: Vec<StepRecord>,
    /// Every rank's measurements, by global rank.
    pub ranks: Vec<RankStats>,
}

fn bytes_of(t: &Tensor) -> u64 {
    if t.defined() { (t.numel() * t.kind().elt_size_in_bytes()) as u64 } else { 0 }
}

/// The trained state this rank holds now.
fn held(params: &[Tensor], grads: &[Option<Tensor>], shards: &[Option<Shard>], full_opt: Option<&AdamW>) -> StateBytes {
    let mut b = StateBytes {
        params: params.iter().map(bytes_of).sum(),
        grads: grads.iter().flatten().map(bytes_of).sum(),
        optimizer: full_opt.map_or(0, AdamW::state_bytes),
    };
    for sh in shards.iter().flatten() {
        b.params += sh.master.as_ref().map_or(0, bytes_of) + sh.updated.as_ref().map_or(0, bytes_of);
        b.grads += sh.grad.as_ref().map_or(0, bytes_of);
        b.optimizer += sh.opt.as_ref().map_or(0, AdamW::state_bytes);
    }
    b
}

/// Peaks of the held state.
#[derive(Default)]
struct Tally {
    peak: StateBytes,
    peak_params: u64,
}

impl Tally {
    fn observe(&mut self, now: StateBytes) {
        if now.total() > self.peak.total() {
            self.peak = now;
        }
        self.peak_params = self.peak_params.max(now.params);
    }
}

/// A copy of `t` in its own storage (a narrowed view would keep the whole buffer alive).
fn owned_copy(t: &Tensor) -> Result<Tensor, RuntimeError> {
    let mut c = t.f_empty_like()?;
    let _ = c.f_copy_(t)?;
    Ok(c)
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

/// One stage's ZeRO shard of its parameters: the flat parameter vector cut into `parts`
/// blocks, this rank holding block `index`.
struct Shard {
    parts: i64,
    index: i64,
    len: i64,
    grad: Option<Tensor>,
    /// Updated parameter block awaiting its all-gather.
    updated: Option<Tensor>,
    opt: Option<AdamW>,
    /// ZeRO 3: the only copy of this rank's block between uses (AdamW updates it), and the
    /// group that gathers the blocks.
    master: Option<Tensor>,
    members: Vec<usize>,
}

/// Runs this rank's part of `plan` for `cfg.steps` steps on `batch` (the global batch; every
/// rank holds it and takes its replica's share).
pub fn run_rank(plan: &Plan, exec: &Executor, batch: &Batch, cfg: &RunConfig, env: &RankEnv) -> Result<RankReport, RuntimeError> {
    let graph = exec.graph();
    let lg = analyse(plan, graph)?;
    let layout = stage_layout(plan, graph, &lg)?;
    let place = Placement::of(plan)?;
    if env.world != place.world() {
        return Err(terr(format!(
            "the plan needs {} ranks (pp {} × dp {} × tp {}), WORLD_SIZE is {}; launch with --nproc {}",
            place.world(),
            place.pp,
            place.dp,
            place.tp,
            env.world,
            place.world()
        )));
    }
    let programs = rank_programs(plan, &lg)?;
    let kind = schedule_of(plan)?;
    let me = env.rank;
    let (q, d, t) = place.locate(me).ok_or_else(|| terr(format!("rank {me} runs no stage of the plan")))?;
    let program = programs.iter().find(|p| p.rank == me).ok_or_else(|| terr(format!("no program for rank {me}")))?;
    let m = plan.parallel.microbatches.max(1);
    check_program(program, plan.stages.len(), m)?;
    let dp = place.dp;
    let shard_group = plan.parallel.sharded_dp.filter(|&n| n > 1 && n < dp).unwrap_or(dp);

    // this rank's parameters; each belongs to the first of this rank's stages reading it
    let n_stages = plan.stages.len();
    let my_stages: Vec<usize> = (0..n_stages).filter(|&s| kind.rank_of_stage(s, place.pp) == q).collect();
    let mut param_ids: Vec<ValueId> = Vec::new();
    let mut owned: Vec<Vec<usize>> = vec![Vec::new(); n_stages];
    for &s in &my_stages {
        for &v in &layout.params[s] {
            if !param_ids.contains(&v) {
                owned[s].push(param_ids.len());
                param_ids.push(v);
            }
        }
    }
    // tensor parallelism: each stage runs its shard subgraph with its own executor
    let view = if place.tp > 1 { Some(plan.rank_view(me).map_err(|e| terr(e.to_string()))?) } else { None };
    let mut subs: Vec<(usize, Graph, HashSet<String>)> = Vec::new();
    // weights whose slice several tensor ranks share, and the ranks sharing this rank's
    let mut kv_groups: Vec<(String, Vec<usize>)> = Vec::new();
    if let Some(view) = &view {
        for sv in &view.stages {
            let mut sub = sv.subgraph(&lg).map_err(|e| terr(format!("stage {} shard of rank {me}: {e}", sv.stage())))?;
            let mut sliced = HashSet::new();
            for sh in &sv.shards {
                // a slice shared by several tensor ranks (grouped-query KV heads): its
                // gradient is summed over the consecutive tensor ranks holding it
                for w in sh.weight_slices.iter().filter(|w| w.replicas > 1) {
                    let r = w.replicas as usize;
                    if r > place.tp || place.tp % r != 0 {
                        return Err(terr(format!(
                            "stage {}: weight `{}` is shared by {r} tensor ranks, which does not divide tp {}",
                            sv.stage(),
                            w.initializer,
                            place.tp
                        )));
                    }
                    let first = t - t % r;
                    let members: Vec<usize> = (first..first + r).map(|tt| place.ranks[q][d * place.tp + tt]).collect();
                    if !kv_groups.iter().any(|(n, _)| n == &w.initializer) {
                        kv_groups.push((w.initializer.clone(), members));
                    }
                }
                sliced.extend(sh.weight_slices.iter().map(|w| w.initializer.clone()));
                for pg in &sh.partial_gradients {
                    insert_copy_to_tensor_region(&mut sub, pg)?;
                }
            }
            subs.push((sv.stage(), sub, sliced));
        }
    }
    drop(lg);
    // groups: every distinct member list in any program, plus the world, created in one global
    // order by their members (creation is a rendezvous)
    let store: Arc<Store> = Store::connect(env, cfg.timeout)?;
    let world: Vec<usize> = (0..env.world).collect();
    let mut lists: BTreeSet<Vec<usize>> = BTreeSet::new();
    lists.insert(world.clone());
    if place.tp > 1 {
        lists.extend(place.tensor_groups());
    }
    lists.extend(kv_groups.iter().map(|(_, g)| g.clone()));
    for p in &programs {
        for i in &p.instrs {
            if let Some((g, _)) = i.collective() {
                lists.insert(g.to_vec());
            }
        }
    }
    let mut groups: HashMap<Vec<usize>, Arc<ProcessGroup>> = HashMap::new();
    for g in lists {
        if g.contains(&me) {
            let pg = ProcessGroup::new(&store, &g, me, cfg.timeout, Backend::Gloo)?;
            groups.insert(g, Arc::new(pg));
        }
    }
    let world_pg = &groups[&world];
    let group = |g: &Vec<usize>| groups.get(g).ok_or_else(|| terr(format!("rank {me} is not in group {g:?}")));

    let tensor_pg = groups.get(&place.tensor_groups().into_iter().find(|g| g.contains(&me)).unwrap_or_default()).cloned();
    let mut stage_execs: HashMap<usize, Executor> = HashMap::new();
    let mut by_name: HashMap<String, Tensor> = HashMap::new();
    for (s, sub, _) in &subs {
        let view = view.as_ref().ok_or_else(|| terr("no rank view"))?;
        let sv = view.stages.iter().find(|v| v.stage() == *s).ok_or_else(|| terr(format!("no view of stage {s}")))?;
        let slices: HashMap<&str, &crate::codegen::WeightSlice> =
            sv.shards.iter().flat_map(|sh| sh.weight_slices.iter()).map(|w| (w.initializer.as_str(), w)).collect();
        let tensors = stage_weights(exec, sub, &slices)?;
        let mut e = Executor::new(sub, super::Weights { tensors }, super::ExecOptions { float_kind: exec.float_kind(), training: true })?;
        e.tensor_group = tensor_pg.clone();
        // a weight read by several of this rank's stages is one tensor
        for (id, w) in e.weights.iter_mut() {
            if is_trainable(sub, *id) {
                let name = sub.value(*id).name.clone();
                match by_name.get(&name) {
                    Some(first) => *w = first.shallow_clone(),
                    None => {
                        by_name.insert(name, w.shallow_clone());
                    }
                }
            }
        }
        stage_execs.insert(*s, e);
    }
    let is_sliced = |v: ValueId| subs.iter().any(|(_, _, sl)| sl.contains(&graph.value(v).name));
    let first_holder = |v: ValueId| (0..n_stages).find(|&s| layout.params[s].contains(&v)).map(|s| kind.rank_of_stage(s, place.pp));
    // norms count each element once: tied weights on their first pipeline rank, replicated
    // gradients on the first replica (or shard group)
    // with tensor parallelism, sliced weights count on every tensor rank, replicated ones on
    // tensor rank 0
    // and a slice shared by tensor ranks on the first of them
    let counted: Vec<bool> = param_ids
        .iter()
        .map(|&v| {
            let shared = kv_groups.iter().find(|(n, _)| *n == graph.value(v).name).map(|(_, g)| g.len());
            first_holder(v) == Some(q) && shared.map_or(t == 0 || is_sliced(v), |r| t % r == 0)
        })
        .collect();
    let params: Vec<Tensor> = param_ids
        .iter()
        .map(|v| {
            let w = if place.tp > 1 { by_name.get(&graph.value(*v).name) } else { exec.weights.get(v) };
            w.map(Tensor::shallow_clone).ok_or_else(|| terr(format!("no weight for `{}` on rank {me}", graph.value(*v).name)))
        })
        .collect::<Result<_, _>>()?;
    let pos_of: HashMap<ValueId, usize> = param_ids.iter().enumerate().map(|(i, v)| (*v, i)).collect();
    // the loaded weights of other pipeline ranks' stages (and with tensor parallelism the
    // unsliced model the shards were cut from) are never read on this rank again
    for (id, w) in &exec.weights {
        if is_trainable(graph, *id) && (place.tp > 1 || !pos_of.contains_key(id)) {
            w.shallow_clone().f_set_data(&Tensor::f_empty([0], (w.kind(), w.device()))?)?;
        }
    }
    let float_kind = params.first().map_or(Kind::Float, Tensor::kind);
    let opts = (float_kind, tch::Device::Cpu);
    // shapes as loaded: ZeRO 3 releases the tensors between uses
    let shapes: Vec<Vec<i64>> = params.iter().map(Tensor::size).collect();
    let numel_of = |i: usize| shapes[i].iter().product::<i64>();
    let zeros_of = |i: usize| Tensor::f_zeros(shapes[i].as_slice(), opts);
    // the flat vector of stage s's parameters (or their gradients), padded to `parts` blocks
    let flat = |s: usize, ts: &[Tensor], parts: i64| -> Result<(Tensor, i64), RuntimeError> {
        let mut v: Vec<Tensor> = owned[s].iter().map(|&i| ts[i].f_detach().and_then(|t| t.f_reshape([-1]))).collect::<Result<_, _>>()?;
        let total: i64 = owned[s].iter().map(|&i| numel_of(i)).sum();
        let len = (total + parts - 1) / parts.max(1);
        if len * parts > total {
            v.push(Tensor::f_zeros([len * parts - total], opts)?);
        }
        Ok((if v.is_empty() { Tensor::f_zeros([0], opts)? } else { Tensor::f_cat(&v, 0)? }, len))
    };
    let mask_of = |s: usize, sh: &Shard| -> Result<Tensor, RuntimeError> {
        let ones: Vec<Tensor> =
            (0..params.len()).map(|i| Tensor::f_full(shapes[i].as_slice(), if counted[i] { 1.0 } else { 0.0 }, opts)).collect::<Result<_, _>>()?;
        Ok(flat(s, &ones, sh.parts)?.0.f_narrow(0, sh.index * sh.len, sh.len)?)
    };
    let mut shards: Vec<Option<Shard>> = (0..n_stages).map(|_| None).collect();
    let mut full_opt: Option<AdamW> = None;

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
    let last_stage = n_stages - 1;
    let weight = 1.0 / (m * dp) as f64;
    let split_w: BTreeSet<(usize, usize)> =
        program.instrs.iter().filter_map(|i| if let Instr::BackwardWeight { stage, mb } = i { Some((*stage, *mb)) } else { None }).collect();
    let stage_of_tag = |t: &Purpose| -> Result<usize, RuntimeError> {
        t.stage().filter(|s| my_stages.contains(s)).ok_or_else(|| terr(format!("collective `{t}` names no stage of rank {me}")))
    };

    // ZeRO 3: each stage's flat parameter vector is cut into blocks over the group that
    // gathers it; this rank keeps only its block (the master AdamW updates) and releases the
    // parameter tensors, which stay the same autograd leaves: their storage is swapped by
    // set_data (gathered before each Forward and Backward, released after it)
    let zero3 = dp > 1 && (plan.parallel.zero >= 3 || shard_group < dp);
    if zero3 {
        let _guard = tch::no_grad_guard();
        for instr in &program.instrs {
            let Instr::AllGather { group: g, purpose: tg, .. } = instr else { continue };
            if !matches!(tg, Purpose::Zero3Params { .. }) {
                continue;
            }
            let s = stage_of_tag(tg)?;
            if shards[s].is_some() || owned[s].is_empty() {
                continue;
            }
            let pg = group(g)?;
            let parts = pg.size() as i64;
            let index = pg.index() as i64;
            let (f, len) = flat(s, &params, parts)?;
            let master = owned_copy(&f.f_narrow(0, index * len, len)?)?;
            let empty = Tensor::f_empty([0], opts)?;
            for &i in &owned[s] {
                params[i].shallow_clone().f_set_data(&empty)?;
            }
            shards[s] = Some(Shard { parts, index, len, grad: None, updated: None, opt: None, master: Some(master), members: g.clone() });
        }
    }
    // the ZeRO-3 stages whose parameters stage s reads (its own, or a weight it shares with
    // another stage of this rank)
    let need: Vec<Vec<usize>> = (0..n_stages)
        .map(|s| {
            (0..n_stages)
                .filter(|&o| {
                    shards[o].as_ref().is_some_and(|sh| sh.master.is_some())
                        && owned[o].iter().any(|&i| layout.params[s].contains(&param_ids[i]))
                })
                .collect()
        })
        .collect();
    let mut live = vec![false; n_stages];
    let materialise = |o: usize, sh: &Shard| -> Result<Tensor, RuntimeError> {
        let master = sh.master.as_ref().ok_or_else(|| terr(format!("stage {o} has no ZeRO-3 block")))?;
        let out = Tensor::f_empty([sh.len * sh.parts], opts)?;
        group(&sh.members)?.all_gather(&out, master)?;
        let _guard = tch::no_grad_guard();
        let mut off = 0;
        for &i in &owned[o] {
            let n = numel_of(i);
            params[i].shallow_clone().f_set_data(&out.f_narrow(0, off, n)?.f_view(shapes[i].as_slice())?)?;
            off += n;
        }
        Ok(out)
    };
    let release = |o: usize| -> Result<(), RuntimeError> {
        let empty = Tensor::f_empty([0], opts)?;
        for &i in &owned[o] {
            params[i].shallow_clone().f_set_data(&empty)?;
        }
        Ok(())
    };
    let ensure = |s: usize, live: &mut [bool], shards: &[Option<Shard>]| -> Result<(), RuntimeError> {
        for &o in &need[s] {
            if !live[o] {
                if let Some(sh) = &shards[o] {
                    let _ = materialise(o, sh)?;
                }
                live[o] = true;
            }
        }
        Ok(())
    };
    let mut tally = Tally::default();
    let mut resident = 0u64;

    let mut records = Vec::with_capacity(cfg.steps);
    for step in 1..=cfg.steps {
        let t0 = Instant::now();
        let mut grads: Vec<Option<Tensor>> = (0..params.len()).map(|_| None).collect();
        let mut state: HashMap<(usize, usize), MbState> = HashMap::new();
        let mut act_in: HashMap<(usize, usize), Vec<Tensor>> = HashMap::new();
        let mut grad_for: HashMap<(usize, usize), Vec<Tensor>> = HashMap::new();
        let mut pending: Vec<Work> = Vec::new();
        let mut loss_sum = 0.0;
        // split backwards whose weight gradient is still to come (they keep ZeRO-3 stages)
        let mut pending_w: BTreeSet<(usize, usize)> = BTreeSet::new();
        let mut kv_done = kv_groups.is_empty();
        tally.observe(held(&params, &grads, &shards, full_opt.as_ref()));
        let full_grads = |grads: &[Option<Tensor>]| -> Result<Vec<Tensor>, RuntimeError> {
            grads
                .iter()
                .enumerate()
                .map(|(i, g)| match g {
                    Some(g) => Ok(g.shallow_clone()),
                    None => Ok(zeros_of(i)?),
                })
                .collect()
        };

        let forward = |s: usize, mb: usize, inputs: &[(ValueId, Tensor)], grad: bool| -> Result<(Vec<(ValueId, Tensor)>, Option<Tensor>), RuntimeError> {
            let mut feeds: HashMap<ValueId, Tensor> = feeds_of[mb].iter().map(|(k, v)| (*k, v.shallow_clone())).collect();
            for (v, t) in inputs {
                feeds.insert(*v, t.shallow_clone());
            }
            let keep: Vec<ValueId> = if s == last_stage { graph.outputs.clone() } else { layout.crossing[s].clone() };
            let outs = match stage_execs.get(&s) {
                None => {
                    let run = || exec.run_nodes(&layout.nodes[s], &feeds, &keep);
                    if grad { run()? } else { tch::no_grad(run)? }
                }
                Some(se) => {
                    // the shard subgraph names values as the model does
                    let sg = se.graph();
                    let local = |v: ValueId| sg.value_by_name(&graph.value(v).name);
                    let feeds: HashMap<ValueId, Tensor> =
                        feeds.iter().filter_map(|(v, t)| local(*v).filter(|l| sg.inputs.contains(l)).map(|l| (l, t.shallow_clone()))).collect();
                    let lkeep: Vec<ValueId> = keep
                        .iter()
                        .map(|v| local(*v).ok_or_else(|| terr(format!("stage {s} shard does not produce `{}`", graph.value(*v).name))))
                        .collect::<Result<_, _>>()?;
                    let order = sg.topo_order()?;
                    let run = || se.run_nodes(&order, &feeds, &lkeep);
                    let outs = if grad { run()? } else { tch::no_grad(run)? };
                    keep.iter().zip(&lkeep).map(|(v, l)| (*v, outs[l].shallow_clone())).collect()
                }
            };
            if s == last_stage {
                let outs: Vec<Tensor> = keep.iter().map(|v| outs[v].shallow_clone()).collect();
                let loss = train::loss_of(exec, cfg.loss, &micro[mb], &outs)?.f_mul_scalar(weight)?;
                Ok((Vec::new(), Some(loss)))
            } else {
                Ok((keep.iter().map(|v| (*v, outs[v].shallow_clone())).collect(), None))
            }
        };

        for instr in &program.instrs {
            if !kv_done && matches!(instr, Instr::AllReduce { .. } | Instr::ReduceScatter { .. } | Instr::OptimizerStep) {
                // grouped-query KV slices held by several tensor ranks: each computed part of
                // the gradient; summed over them before any other synchronisation
                for (name, members) in &kv_groups {
                    let i = graph
                        .value_by_name(name)
                        .and_then(|v| pos_of.get(&v).copied())
                        .ok_or_else(|| terr(format!("shared KV slice `{name}` is not a parameter of rank {me}")))?;
                    let g = match grads[i].take() {
                        Some(g) => g.f_contiguous()?,
                        None => zeros_of(i)?,
                    };
                    group(members)?.all_reduce_sum(&g)?;
                    grads[i] = Some(g);
                }
                kv_done = true;
            }
            match instr {
                Instr::Forward { stage: s, mb } => {
                    let (s, mb) = (*s, *mb);
                    ensure(s, &mut live, &shards)?;
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
                    let (outputs, loss) = forward(s, mb, &inputs, !layout.recompute[s])?;
                    if let Some(l) = loss.as_ref().filter(|_| t == 0) {
                        loss_sum += l.f_double_value(&[])?;
                    }
                    state.insert((s, mb), MbState { inputs, outputs, loss, root: None });
                }
                Instr::Backward { stage: s, mb } => {
                    let (s, mb) = (*s, *mb);
                    let mut st = state.remove(&(s, mb)).ok_or_else(|| terr(format!("backward of stage {s} mb {mb} before its forward")))?;
                    ensure(s, &mut live, &shards)?;
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
                    let mut in_grads: Vec<Tensor> = Vec::new();
                    if let Some(r) = root.as_ref().filter(|r| r.requires_grad()) {
                        let grad_leaves: Vec<&Tensor> = leaves.iter().filter(|t| t.requires_grad()).collect();
                        let mut inputs: Vec<&Tensor> = grad_leaves.clone();
                        if !split {
                            inputs.extend(mine.iter().map(|&i| &params[i]));
                        }
                        // B of a split backward keeps the graph for its W
                        let got = if inputs.is_empty() { Vec::new() } else { Tensor::f_run_backward(&[r], &inputs, split, false)? };
                        let (gin, gp) = got.split_at(grad_leaves.len());
                        // autograd's fresh weight gradients live beside the accumulated ones
                        let mut now = held(&params, &grads, &shards, full_opt.as_ref());
                        now.grads += gp.iter().map(bytes_of).sum::<u64>();
                        tally.observe(now);
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
                        pending_w.insert((s, mb));
                    }
                    if s > 0 {
                        grad_for.insert((s - 1, mb), in_grads);
                    }
                }
                Instr::BackwardWeight { stage: s, mb } => {
                    let (s, mb) = (*s, *mb);
                    let st = state.remove(&(s, mb)).ok_or_else(|| terr(format!("weight gradient of stage {s} mb {mb} before its backward")))?;
                    ensure(s, &mut live, &shards)?;
                    pending_w.remove(&(s, mb));
                    if let Some(r) = st.root.filter(|r| r.requires_grad()) {
                        let mine: Vec<usize> = layout.params[s].iter().filter_map(|v| pos_of.get(v).copied()).collect();
                        let inputs: Vec<&Tensor> = mine.iter().map(|&i| &params[i]).collect();
                        if !inputs.is_empty() {
                            let got = Tensor::f_run_backward(&[&r], &inputs, false, false)?;
                            let mut now = held(&params, &grads, &shards, full_opt.as_ref());
                            now.grads += got.iter().map(bytes_of).sum::<u64>();
                            tally.observe(now);
                            for (&i, g) in mine.iter().zip(&got) {
                                accumulate(&mut grads[i], g)?;
                            }
                        }
                    }
                }
                Instr::Send { to: peer, what, stage: s, mb, .. } => {
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
                Instr::Recv { from: peer, what, stage: s, mb, .. } => {
                    let (s, mb) = (*s, *mb);
                    // the sender tags with its own stage
                    let (from, count) = match what {
                        Payload::Activation => (s - 1, layout.crossing[s - 1].len()),
                        Payload::Gradient => {
                            let st = state.get(&(s, mb)).ok_or_else(|| terr(format!("gradient for stage {s} mb {mb} before its forward")))?;
                            (s + 1, st.outputs.iter().filter(|(_, t)| is_float(t)).count())
                        }
                    };
                    let mut got = Vec::with_capacity(count);
                    for j in 0..count {
                        let meta = Tensor::f_zeros([META as i64], (Kind::Int64, tch::Device::Cpu))?;
                        let meta = world_pg.irecv(&meta, *peer, tag(*what, from, mb, 2 * j))?.wait()?;
                        let meta: Vec<i64> = Vec::<i64>::try_from(&meta).map_err(|e| terr(e.to_string()))?;
                        let rank = meta[0].clamp(0, META as i64 - 2) as usize;
                        let buf = Tensor::f_zeros(&meta[1..=rank], (code_kind(meta[META - 1])?, tch::Device::Cpu))?;
                        got.push(world_pg.irecv(&buf, *peer, tag(*what, from, mb, 2 * j + 1))?.wait()?);
                    }
                    match what {
                        Payload::Activation => act_in.insert((s, mb), got),
                        Payload::Gradient => grad_for.insert((s, mb), got),
                    };
                }
                Instr::AllReduce { group: g, purpose: t, .. } => {
                    let pg = group(g)?;
                    if let Purpose::TiedGrad { weight: name } = t {
                        let v = graph.value_by_name(name).ok_or_else(|| terr(format!("tied weight `{name}` is not in the model")))?;
                        let i = *pos_of.get(&v).ok_or_else(|| terr(format!("tied weight `{name}` is not on rank {me}")))?;
                        let g = match grads[i].take() {
                            Some(g) => g.f_contiguous()?,
                            None => zeros_of(i)?,
                        };
                        pg.all_reduce_sum(&g)?;
                        grads[i] = Some(g);
                    } else if matches!(t, Purpose::DpGrads { .. }) {
                        let s = stage_of_tag(t)?;
                        if let Some(sh) = shards[s].as_mut().filter(|sh| sh.grad.is_some()) {
                            // sharded data parallelism: the reduced shard summed across groups
                            if let Some(gs) = &sh.grad {
                                pg.all_reduce_sum(gs)?;
                            }
                        } else if plan.parallel.zero >= 1 {
                            // ZeRO 1: full all-reduce, then this rank's block
                            let parts = pg.size() as i64;
                            let (f, len) = flat(s, &full_grads(&grads)?, parts)?;
                            // the flat copy is all that is left of them
                            for &i in &owned[s] {
                                grads[i] = None;
                            }
                            pg.all_reduce_sum(&f)?;
                            let mut now = held(&params, &grads, &shards, full_opt.as_ref());
                            now.grads += bytes_of(&f);
                            tally.observe(now);
                            let index = pg.index() as i64;
                            let sh = shards[s].get_or_insert_with(|| Shard { parts, index, len, grad: None, updated: None, opt: None, master: None, members: Vec::new() });
                            sh.grad = Some(owned_copy(&f.f_narrow(0, index * len, len)?)?);
                        } else {
                            let mine: Vec<Tensor> = owned[s].iter().map(|&i| grads[i].as_ref().map_or_else(|| zeros_of(i), |g| Ok(g.shallow_clone()))).collect::<Result<_, _>>()?;
                            let reduced = all_reduce_bucketed(pg, mine, cfg.bucket_bytes)?;
                            for (&i, g) in owned[s].iter().zip(reduced) {
                                grads[i] = Some(g);
                            }
                        }
                    } else {
                        return Err(terr(format!("all-reduce for `{t}`, which is no all-reduce")));
                    }
                }
                Instr::ReduceScatter { group: g, purpose: t, .. } => {
                    if !matches!(t, Purpose::DpGrads { .. }) {
                        return Err(terr(format!("reduce-scatter for `{t}`, which is no reduce-scatter")));
                    }
                    let s = stage_of_tag(t)?;
                    let pg = group(g)?;
                    let parts = pg.size() as i64;
                    let (f, len) = flat(s, &full_grads(&grads)?, parts)?;
                    for &i in &owned[s] {
                        grads[i] = None;
                    }
                    let out = Tensor::f_zeros([len], opts)?;
                    pg.reduce_scatter_sum(&out, &f)?;
                    let mut now = held(&params, &grads, &shards, full_opt.as_ref());
                    now.grads += bytes_of(&f) + bytes_of(&out);
                    tally.observe(now);
                    let index = pg.index() as i64;
                    let sh = shards[s].get_or_insert_with(|| Shard { parts, index, len, grad: None, updated: None, opt: None, master: None, members: Vec::new() });
                    if (sh.parts, sh.index, sh.len) != (parts, index, len) {
                        return Err(terr(format!(
                            "stage {s}: gradients are reduce-scattered over {g:?}, but its ZeRO-3 parameters are gathered over {:?}",
                            sh.members
                        )));
                    }
                    sh.grad = Some(out);
                }
                Instr::OptimizerStep => {
                    for w in pending.drain(..) {
                        let _ = w.wait()?;
                    }
                    let _guard = tch::no_grad_guard();
                    // squared norm of the gradients this rank counts, and its loss share
                    let mut sq = 0.0;
                    for (s, sh) in shards.iter().enumerate() {
                        if let Some(sh) = sh {
                            if let (Some(g), true) = (&sh.grad, d < shard_group) {
                                sq += g.f_mul(&mask_of(s, sh)?)?.f_square()?.f_sum(Kind::Double)?.f_double_value(&[])?;
                            }
                        }
                    }
                    if d == 0 {
                        for (g, &c) in grads.iter().zip(&counted) {
                            if let (Some(g), true) = (g, c) {
                                let n = g.f_norm()?.f_double_value(&[])?;
                                sq += n * n;
                            }
                        }
                    }
                    let both = Tensor::from_slice(&[sq, loss_sum]);
                    world_pg.all_reduce_sum(&both)?;
                    let both: Vec<f64> = Vec::<f64>::try_from(&both).map_err(|e| terr(e.to_string()))?;
                    loss_sum = both[1];
                    let coef = cfg.clip.map_or(1.0, |c| (c / (both[0].sqrt() + 1e-6)).min(1.0));
                    if cfg.clip.is_some() {
                        for g in grads.iter_mut().flatten() {
                            let _ = g.f_mul_scalar_(coef)?;
                        }
                    }
                    for (s, sh) in shards.iter_mut().enumerate() {
                        let Some(sh) = sh else { continue };
                        let Some(mut g) = sh.grad.take() else { continue };
                        if cfg.clip.is_some() {
                            let _ = g.f_mul_scalar_(coef)?;
                        }
                        if let Some(master) = sh.master.as_ref().map(Tensor::shallow_clone) {
                            // ZeRO 3: the block is the parameters' only copy
                            let opt = match &mut sh.opt {
                                Some(o) => o,
                                None => sh.opt.insert(AdamW::new(&[master.shallow_clone()], cfg.adamw)?),
                            };
                            opt.step_with(&[master], &[g])?;
                            continue;
                        }
                        let block = owned_copy(&flat(s, &params, sh.parts)?.0.f_narrow(0, sh.index * sh.len, sh.len)?)?;
                        let opt = match &mut sh.opt {
                            Some(o) => o,
                            None => sh.opt.insert(AdamW::new(&[block.shallow_clone()], cfg.adamw)?),
                        };
                        opt.step_with(&[block.shallow_clone()], &[g])?;
                        sh.updated = Some(block);
                    }
                    // parameters not in any shard: the plain (replicated) AdamW
                    let plain: Vec<usize> = (0..params.len()).filter(|i| grads[*i].is_some()).collect();
                    if !plain.is_empty() {
                        let opt = match &mut full_opt {
                            Some(o) => o,
                            None => full_opt.insert(AdamW::new(&params, cfg.adamw)?),
                        };
                        let gs: Vec<Tensor> = grads.iter().map(|g| g.as_ref().map_or_else(Tensor::new, Tensor::shallow_clone)).collect();
                        opt.step_with(&params, &gs)?;
                    }
                }
                Instr::AllGather { group: g, purpose: t, .. } => {
                    if matches!(t, Purpose::Zero3Params { .. }) {
                        ensure(stage_of_tag(t)?, &mut live, &shards)?;
                    } else if matches!(t, Purpose::ZeroParams { .. }) {
                        let s = stage_of_tag(t)?;
                        let pg = group(g)?;
                        let parts = pg.size() as i64;
                        let index = pg.index() as i64;
                        let total: i64 = owned[s].iter().map(|&i| numel_of(i)).sum();
                        let len = (total + parts - 1) / parts.max(1);
                        let sh = shards[s].get_or_insert_with(|| Shard { parts, index, len, grad: None, updated: None, opt: None, master: None, members: Vec::new() });
                        // gathered every time the program says so; written into the weights
                        // only when an update is pending (never under a live autograd graph)
                        let (block, write) = match sh.updated.take() {
                            Some(b) => (b, true),
                            None => (owned_copy(&flat(s, &params, parts)?.0.f_narrow(0, index * len, len)?)?, false),
                        };
                        let out = Tensor::f_empty([len * parts], opts)?;
                        pg.all_gather(&out, &block)?;
                        let mut now = held(&params, &grads, &shards, full_opt.as_ref());
                        now.params += bytes_of(&out) + bytes_of(&block);
                        tally.observe(now);
                        if write {
                            let _guard = tch::no_grad_guard();
                            let mut off = 0;
                            for &i in &owned[s] {
                                let mut p = params[i].shallow_clone();
                                let n = numel_of(i);
                                p.f_copy_(&out.f_narrow(0, off, n)?.f_view_as(&p)?)?;
                                off += n;
                            }
                        }
                    } else {
                        return Err(terr(format!("all-gather for `{t}`, which is no all-gather")));
                    }
                }
            }
            tally.observe(held(&params, &grads, &shards, full_opt.as_ref()));
            if zero3 && matches!(instr, Instr::Forward { .. } | Instr::Backward { .. } | Instr::BackwardWeight { .. }) {
                // release what no pending weight gradient still needs
                let pinned: BTreeSet<usize> = pending_w.iter().flat_map(|(s, _)| need[*s].iter().copied()).collect();
                for o in 0..n_stages {
                    if live[o] && !pinned.contains(&o) {
                        release(o)?;
                        live[o] = false;
                    }
                }
            }
        }
        for w in pending.drain(..) {
            let _ = w.wait()?;
        }
        for o in 0..n_stages {
            if live[o] {
                release(o)?;
                live[o] = false;
            }
        }
        resident = held(&params, &[], &shards, full_opt.as_ref()).params;
        records.push(StepRecord { step, loss: loss_sum, time_s: t0.elapsed().as_secs_f64() });
        if cfg.progress {
            // one write per line: ranks share the launcher's stderr
            let line = format!("[rank {me}] step {step} loss {loss_sum:.6}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        }
    }
    let timed: Vec<f64> = records.iter().skip(usize::from(records.len() > 1)).map(|s| s.time_s).collect();
    let mean = timed.iter().sum::<f64>() / timed.len().max(1) as f64;
    const STATS: usize = 7;
    let p = tally.peak;
    let mine = Tensor::from_slice(&[
        mean,
        peak_rss_bytes() as f64,
        p.params as f64,
        p.grads as f64,
        p.optimizer as f64,
        tally.peak_params as f64,
        resident as f64,
    ]);
    let all = Tensor::f_zeros([(STATS * env.world) as i64], (Kind::Double, tch::Device::Cpu))?;
    world_pg.all_gather(&all, &mine)?;
    let all: Vec<f64> = Vec::<f64>::try_from(&all).map_err(|e| terr(e.to_string()))?;
    let ranks = all
        .chunks(STATS)
        .map(|c| RankStats {
            step_time_s: c[0],
            peak_rss_bytes: c[1] as u64,
            peak_state: StateBytes { params: c[2] as u64, grads: c[3] as u64, optimizer: c[4] as u64 },
            peak_param_bytes: c[5] as u64,
            resident_param_bytes: c[6] as u64,
        })
        .collect();
    world_pg.barrier()?;
    Ok(RankReport { steps: records, ranks })
}

/// Rejects instructions that name stages or microbatches outside the plan, or messages that
/// cross a boundary the pipeline does not have.
fn check_program(p: &RankProgram, stages: usize, m: usize) -> Result<(), RuntimeError> {
    for i in &p.instrs {
        let (stage, mb) = match i {
            Instr::Forward { stage, mb } | Instr::Backward { stage, mb } | Instr::BackwardWeight { stage, mb } => (*stage, *mb),
            Instr::Send { stage, mb, .. } | Instr::Recv { stage, mb, .. } => (*stage, *mb),
            _ => continue,
        };
        let bad = stage >= stages
            || mb >= m
            || match i {
                Instr::Send { what: Payload::Activation, .. } | Instr::Recv { what: Payload::Gradient, .. } => stage + 1 >= stages,
                Instr::Send { what: Payload::Gradient, .. } | Instr::Recv { what: Payload::Activation, .. } => stage == 0,
                _ => false,
            };
        if bad {
            return Err(terr(format!(
                "rank {}: instruction {i} does not fit the plan ({stages} stages, {m} microbatches)",
                p.rank
            )));
        }
    }
    Ok(())
}

/// Puts Megatron's *f* before `pg.node`'s input `pg.input`: the forward reads the value
/// unchanged, the backward all-reduces its gradient over the tensor group.
fn insert_copy_to_tensor_region(g: &mut Graph, pg: &crate::codegen::shard::PartialGradient) -> Result<(), RuntimeError> {
    let node = g
        .node_ids()
        .find(|&n| g.node(n).name == pg.node)
        .ok_or_else(|| terr(format!("partial gradient names node `{}`, which the shard does not have", pg.node)))?;
    let v = g
        .node(node)
        .inputs
        .get(pg.input)
        .copied()
        .flatten()
        .ok_or_else(|| terr(format!("partial gradient: node `{}` has no input {}", pg.node, pg.input)))?;
    let ty = g.value(v).ty.clone();
    let name = format!("{}.f.{}.{}", g.value(v).name, pg.node, pg.input);
    let out = g.add_value(name.clone(), ValueKind::Intermediate, ty, None)?;
    let order = g.node(node).order;
    let mut attrs = crate::ir::Attrs::default();
    attrs.set("group", crate::ir::Attr::Str("tensor".into()));
    g.add_node(crate::ir::Node {
        name,
        op: crate::ir::Op::Placeholder { op_type: super::executor::COPY_TO_TENSOR_REGION.into(), domain: crate::codegen::collectives::SMP_DOMAIN.into() },
        attrs,
        inputs: vec![Some(v)],
        outputs: vec![out],
        namespace: None,
        order,
    })?;
    g.set_input(node, pg.input, Some(out));
    Ok(())
}

/// The tensors of a shard subgraph's initializers and constants: this rank's slice of the
/// model's weight where the shard slices it, the model's tensor where it is replicated, and
/// the subgraph's own data for constants the shard made.
fn stage_weights(
    exec: &Executor,
    sub: &Graph,
    slices: &HashMap<&str, &crate::codegen::WeightSlice>,
) -> Result<HashMap<ValueId, Tensor>, RuntimeError> {
    let main = exec.graph();
    let mut out = HashMap::new();
    for id in sub.value_ids() {
        let v = sub.value(id);
        if !matches!(v.kind, ValueKind::Initializer | ValueKind::Constant) {
            continue;
        }
        let full = main.value_by_name(&v.name).and_then(|m| exec.weights.get(&m));
        let t = match (full, slices.get(v.name.as_str())) {
            (Some(full), Some(sl)) => {
                let parts: Vec<Tensor> = sl
                    .ranges
                    .iter()
                    .map(|r| full.f_detach()?.f_narrow(sl.axis as i64, r[0] as i64, (r[1] - r[0]) as i64))
                    .collect::<Result<_, _>>()?;
                Tensor::f_cat(&parts, sl.axis as i64)?.f_contiguous()?
            }
            (Some(full), None) => full.f_detach()?,
            (None, _) => {
                let Some(data) = &v.data else { continue };
                let crate::ir::Storage::Raw(bytes) = &data.storage else {
                    return Err(terr(format!("shard constant `{}` has no inline data", v.name)));
                };
                let t = super::tensor::from_bytes(data.dtype, &data.dims, bytes).map_err(|m| RuntimeError::Weight { name: v.name.clone(), message: m })?;
                match exec.float_kind() {
                    Some(k) if super::tensor::is_float_kind(t.kind()) && t.kind() != k => t.f_to_kind(k)?,
                    _ => t,
                }
            }
        };
        out.insert(id, t);
    }
    Ok(out)
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
