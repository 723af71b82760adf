//! Setting up one rank of a plan: its place in the mesh and program, its parameters, the
//! executors of its stages (tensor-parallel shards), its process groups and its share of the
//! batch. Everything here is fixed for the whole run.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tch::{Kind, Tensor};

use crate::runtime::comm::{Backend, ProcessGroup, RankEnv, Store};
use crate::runtime::kernels::executor::Executor;
use crate::runtime::kernels::experts::ExpertRouting;
use super::experts::Experts;
use super::layout::{self, REPLAN, StageLayout};
use crate::runtime::terr;
use crate::runtime::train::TrainConfig;
use super::params::Params;
use super::segments::{self, StageSegments};
use crate::runtime::data::DataSource;
use crate::runtime::data::Batch;
use crate::passes::figures::is_trainable;
use crate::runtime::state::weights::{Slice, Source};
use crate::runtime::{ExecOptions, RuntimeError, Weights};
use crate::codegen::stage_graph::{self, StageGraphError, runs_stage_subgraphs};
use crate::codegen::{Coord, Instr, Mesh, Payload, Purpose, RankProgram, WeightSlice};
use crate::ir::{DimBindings, Graph, Op, OpKind, Parallelism, ValueId, ValueKind};
use crate::plan::Plan;

/// How a rank of a plan runs, beside what it trains.
#[derive(Clone, Debug)]
pub struct RankOptions {
    /// Timeout of every collective and receive.
    pub timeout: Duration,
    /// Data-parallel all-reduce bucket size, bytes.
    pub bucket_bytes: usize,
    /// Print `[rank R] step N` on stderr after every step.
    pub progress: bool,
    /// The process groups' backends: NCCL for GPU tensors' collectives, or Gloo alone.
    pub backend: Backend,
    /// How stragglers are found.
    pub stragglers: super::straggler::StragglerOptions,
}

/// The process groups this rank is in, by member list.
pub(super) struct Groups {
    me: usize,
    by_members: HashMap<Vec<usize>, Arc<ProcessGroup>>,
    /// Every rank.
    pub world: Arc<ProcessGroup>,
}

impl Groups {
    /// The group of exactly `members`.
    pub fn get(&self, members: &[usize]) -> Result<&ProcessGroup, RuntimeError> {
        self.by_members.get(members).map(|g| &**g).ok_or_else(|| terr(format!("rank {} is not in group {members:?}", self.me)))
    }
}

/// With tensor parallelism, the subgraphs a rank runs: per stage, the stage's nodes with the
/// rank's shards applied.
#[derive(Default)]
pub(super) struct Shards {
    /// This rank's stages, in order (empty without tensor parallelism).
    pub stages: Vec<StageShard>,
    /// Weights whose slice several tensor ranks share, with the ranks sharing this rank's.
    pub kv_groups: Vec<(String, Vec<usize>)>,
}

/// One stage's subgraph on one tensor rank.
pub(super) struct StageShard {
    /// Global stage index.
    pub stage: usize,
    /// The subgraph.
    pub graph: Graph,
    /// The weights it slices.
    pub slices: Vec<WeightSlice>,
}

impl Shards {
    /// The subgraphs rank `me` of `plan` runs on `graph`, the graph the plan was made for
    /// ([`layout::planned_graph`], with its `dims`), as codegen builds them
    /// ([`crate::codegen::stage_graph`]); none when its stages run on the model's executor.
    pub fn new(plan: &Plan, graph: &Graph, dims: &DimBindings, me: usize) -> Result<Shards, RuntimeError> {
        let mesh = plan.mesh();
        if !runs_stage_subgraphs(&plan.parallel) {
            return Ok(Shards::default());
        }
        mesh.coord(me).ok_or_else(|| terr(format!("rank {me} runs no stage of the plan")))?;
        let view = plan.rank_view(me).map_err(|e| terr(e.to_string()))?;
        let built = stage_graph::rank_graphs(&view, graph, dims, (&mesh, &plan.parallel, plan.stages.len())).map_err(|e| match e {
            StageGraphError::Nodes { .. } | StageGraphError::NoContextRecord { .. } => terr(format!("{e}; {REPLAN}")),
            e => terr(format!("rank {me}: {e}")),
        })?;
        let conversions: usize = built.stages.iter().map(|s| s.context_conversions).sum();
        // the first stage reads the token ids: a split there always cuts something
        if plan.parallel.cp > 1 && conversions == 0 && view.stages.iter().any(|sv| sv.stage() == 0) {
            tracing::warn!(cp = plan.parallel.cp, rank = me, "context parallelism found no token ids to split (an integer [batch, seq] input read by an embedding lookup): this rank computes whole sequences");
        }
        let stages = built.stages.into_iter().map(|s| StageShard { stage: s.stage, graph: s.graph, slices: s.slices }).collect();
        Ok(Shards { stages, kv_groups: built.kv_groups })
    }
}

/// One rank of a plan, set up for the run.
pub(super) struct Rank<'a> {
    /// The model's executor (stages without tensor parallelism run its nodes).
    pub exec: &'a Executor<'a>,
    /// Where the rank reads the parts of weights it holds.
    pub source: &'a Source<'a>,
    /// What is trained and how (loss, optimizer, schedule, clipping, seed).
    pub cfg: &'a TrainConfig,
    /// How the rank runs (timeouts, buckets, progress lines).
    pub opts: &'a RankOptions,
    /// Stages' nodes, boundary values and parameters.
    pub layout: StageLayout,
    /// Global rank.
    pub global_rank: usize,
    /// Ranks in the world.
    pub world: usize,
    /// Position on the mesh's data axis (data-parallel index times cp, plus the context
    /// index): what ZeRO shards and checkpoint writes go by.
    pub replica: usize,
    /// The data replica whose samples this rank reads (the context group's ranks read the
    /// same samples, each its tokens of them).
    pub data_replica: usize,
    /// Data replicas (the plan's dp).
    pub data_dp: usize,
    /// Tensor-parallel rank.
    pub tensor_rank: usize,
    /// Stages of the plan.
    pub n_stages: usize,
    /// The stages this rank runs.
    pub my_stages: Vec<usize>,
    /// The plan's parallel configuration (degrees, ZeRO, microbatches, schedule).
    pub parallel: Parallelism,
    /// The rank's program.
    pub program: RankProgram,
    /// Stages whose backward is split into B and W in the program.
    pub split_w: BTreeSet<(usize, usize)>,
    /// By the index of a send in this rank's program: the index of the receive after which it
    /// has certainly completed (its peer has since sent a message it posts only after receiving
    /// this one). Sends not here complete at the step's end.
    pub sends_done_at: HashMap<usize, usize>,
    /// By global stage: whether the plan offloads kept inputs of its layers (`offloaded_layers`).
    pub offloaded: Vec<bool>,
    /// This rank's recomputed stages as segments (per-layer recompute), by global stage.
    pub segments: HashMap<usize, StageSegments>,
    /// Parameters.
    pub params: Params,
    /// Grouped-query KV slices several tensor ranks hold: (parameter position, the ranks).
    pub kv_groups: Vec<(usize, Vec<usize>)>,
    /// With tensor parallelism, the executor of each stage's shard subgraph.
    pub stage_execs: HashMap<usize, Executor<'a>>,
    /// Process groups.
    pub groups: Groups,
    /// Running statistics of the BatchNormalization nodes of this rank's stages (buffers, never
    /// trained).
    pub norm_buffers: Vec<Tensor>,
    /// The ranks holding the same stages and shards in every replica (this one included), when
    /// there are several replicas: replica 0's buffers are broadcast over it.
    pub replica_group: Option<Vec<usize>>,
    /// The training data.
    pub data: &'a DataSource,
    /// Whether this rank reads data: its stages read a graph input, or it computes the loss.
    pub reads_data: bool,
    /// With tensor parallelism, this rank's cut of each weight its shards slice, by
    /// initializer name.
    pub slices: HashMap<String, WeightSlice>,
    /// With expert parallelism, the experts this rank holds.
    pub experts: Experts,
    /// With expert parallelism, the ranks holding this rank's experts (when more than it):
    /// its experts' gradients are summed over them.
    pub expert_replicas: Option<Vec<usize>>,
    /// This rank's stages whose experts are summed over `expert_replicas` before the optimizer
    /// step because no data-parallel sync of theirs does it.
    pub experts_summed_at_step: Vec<usize>,
    /// The forward and backward seconds the plan predicts for this rank's stages (what its
    /// busy time is judged against for stragglers).
    pub predicted_compute_s: f64,
}

impl<'a> Rank<'a> {
    /// Sets up rank `env.rank` of `plan` on the model of `exec`, training on `data`.
    pub fn new(
        plan: &Plan,
        exec: &'a Executor<'a>,
        source: &'a Source<'a>,
        shards: &'a Shards,
        data: &'a DataSource,
        (cfg, opts): (&'a TrainConfig, &'a RankOptions),
        env: &RankEnv,
    ) -> Result<Rank<'a>, RuntimeError> {
        let graph = exec.graph();
        let section = layout::codegen_section(plan)?;
        let layout = layout::stage_layout(section, graph)?;
        let mesh = plan.mesh();
        check_world(plan, env)?;
        let programs = layout::rank_programs(plan, section)?;
        let me = env.rank;
        let Coord { pp: q, dp: d, tp: t } = mesh.coord(me).ok_or_else(|| terr(format!("rank {me} runs no stage of the plan")))?;
        let program = programs.iter().find(|p| p.rank == me).ok_or_else(|| terr(format!("no program for rank {me}")))?.clone();
        let m = plan.parallel.microbatches.max(1);
        check_program(&program, plan.stages.len(), m)?;
        let dp = mesh.dp();
        let n_stages = plan.stages.len();
        let my_stages: Vec<usize> = (0..n_stages).filter(|&s| plan.stages[s].pp_rank == q).collect();

        let cp = plan.parallel.cp.max(1);
        let experts = Experts::of(graph, &plan.parallel, (d, t))?;
        let groups = connect_groups(env, opts, &mesh, &programs, &shards.kv_groups, (&plan.parallel, cp))?;
        let tensor_pg = groups.by_members.get(&mesh.tensor_groups().into_iter().find(|g| g.contains(&me)).unwrap_or_default()).cloned();
        let expert_group = Experts::group(&mesh, &plan.parallel, (q, d, t));
        let expert_pg = (expert_group.len() > 1).then(|| groups.by_members.get(&expert_group).cloned()).flatten();
        // folded groups: each tensor rank routes its own share of the tokens
        let routing = ExpertRouting { group: expert_pg, tokens_over: tensor_pg.clone().filter(|_| experts.folded) };
        if routing.leaves_the_rank() {
            exec.set_expert_routing(routing.clone());
        }
        let expert_replicas = Some(Experts::replicas(&mesh, &plan.parallel, (q, d, t))).filter(|g| experts.in_part() && g.len() > 1);
        let lazy = lazy_params(plan, &layout, &program, &my_stages, (graph, &experts));
        let (stage_execs, by_name) = stage_executors(exec, source, shards, (tensor_pg.as_ref(), &routing), &lazy, &experts)?;
        if cp > 1 {
            let pg = groups.by_members.get(&context_group(&mesh, cp, (q, d, t))).cloned().ok_or_else(|| terr(format!("rank {me} has no context group")))?;
            exec.set_context_group(pg.clone());
            for e in stage_execs.values() {
                e.set_context_group(pg.clone());
            }
        }
        let sliced: HashMap<&str, &WeightSlice> = shards.stages.iter().flat_map(|sh| sh.slices.iter()).map(|w| (w.initializer.as_str(), w)).collect();
        let (params, kv_groups) = own_params(plan, exec, &layout, &my_stages, (me, q, t), (&sliced, &experts), &by_name, &shards.kv_groups)?;
        // a stage reads the graph inputs the plan lists; the last one also the loss's labels
        let reads_input = my_stages.iter().any(|&s| !layout.data_inputs[s].is_empty());
        let reads_data = reads_input || my_stages.contains(&(n_stages - 1));
        let norm_buffers = norm_buffers(exec, &stage_execs, &layout, &my_stages);
        let replica_group = (dp > 1).then(|| mesh.replica_group(q, t));
        let gathered = zero3_stages(plan, &program);
        let mut segments = recompute_segments(plan, exec, &stage_execs, &layout, &my_stages, &gathered)?;
        segment_params(&params, exec.graph(), &stage_execs, &mut segments);
        let mut params = params;
        split_gather_units(&mut params, &segments, &gathered);
        let sends_done_at = sends_done_at(&programs, me);
        // stages with no data-parallel sync (one replica) whose experts several ranks hold
        // (folded groups: the tensor ranks of one replica) sum them before the optimizer step
        let synced = |s: usize| program.instrs.iter().any(|i| matches!(i.collective(), Some((_, Purpose::DpGrads { stage })) if *stage == s));
        let experts_summed_at_step = if expert_replicas.is_some() { my_stages.iter().copied().filter(|&s| !synced(s)).collect() } else { Vec::new() };
        let split_w = program.instrs.iter().filter_map(|i| if let Instr::BackwardWeight { stage, mb } = i { Some((*stage, *mb)) } else { None }).collect();
        Ok(Rank {
            exec,
            source,
            cfg,
            opts,
            layout,
            global_rank: me,
            world: env.world,
            replica: d,
            data_replica: d / cp,
            data_dp: plan.parallel.dp.max(1),
            tensor_rank: t,
            n_stages,
            my_stages,
            parallel: plan.parallel.over_data_axis(),
            program,
            split_w,
            sends_done_at,
            offloaded: plan.stages.iter().map(|st| !st.offloaded_layers.is_empty()).collect(),
            segments,
            params,
            kv_groups,
            stage_execs,
            groups,
            norm_buffers,
            replica_group,
            data,
            reads_data,
            slices: shards.stages.iter().flat_map(|sh| sh.slices.iter()).map(|w| (w.initializer.clone(), w.clone())).collect(),
            experts,
            expert_replicas,
            experts_summed_at_step,
            predicted_compute_s: plan.stages_of_rank(q).map(|s| s.forward_s + s.backward_s).filter(|x| x.is_finite()).sum(),
        })
    }

    /// Context-parallel all-gathers in one forward of this rank's stages.
    pub fn context_gathers(&self) -> u64 {
        let gathers = |g: &Graph| g.node_ids().filter(|&n| crate::split::context::is_token_gather(&g.node(n).op)).count();
        self.stage_execs.values().map(|e| gathers(e.graph()) as u64).sum()
    }

    /// The model graph.
    pub fn graph(&self) -> &'a Graph {
        self.exec.graph()
    }

    /// The value id of each parameter position.
    pub fn param_ids(&self) -> Vec<ValueId> {
        let mut ids: Vec<(usize, ValueId)> = self.params.pos_of.iter().map(|(&v, &i)| (i, v)).collect();
        ids.sort();
        ids.into_iter().map(|(_, v)| v).collect()
    }

    /// The part of weight `v` this rank holds: its experts (expert parallelism) and its
    /// tensor-parallel cut, or all of it.
    pub fn part_of(&self, v: ValueId) -> Slice {
        let name = &self.graph().value(v).name;
        let part = match self.slices.get(name) {
            Some(sl) => Slice { axis: Some(sl.axis), ranges: sl.ranges.clone(), ..Slice::whole() },
            None => Slice::whole(),
        };
        self.experts.narrow(name, part)
    }

    /// Whether this rank counts parameter position `i` in the gradient norm and writes it to
    /// checkpoints among the replicas: replica 0, or for experts held in part the first
    /// expert group (with folded groups, tensor ranks may hold the same experts too).
    pub fn writes_replica(&self, i: usize) -> bool {
        if self.params.expert[i] { self.experts.first_group() } else { self.replica == 0 }
    }

    /// Block `index` of `parts` of stage `s`'s flat parameter vector (ZeRO 3), read from the
    /// source: only the elements of the block, never a whole parameter.
    pub fn read_block(&self, s: usize, parts: i64, index: i64) -> Result<Tensor, RuntimeError> {
        self.read_block_with(s, parts, index, |v, part| self.source.read(v, part))
    }

    /// Block `index` of `parts` of stage `s`'s flat vector of per-parameter tensors shaped as
    /// the parameters (values or moments), each piece read by `read` (parameter, its part with
    /// the flat range wanted); the padding past the last parameter is zeros.
    pub fn read_block_with(&self, s: usize, parts: i64, index: i64, read: impl Fn(ValueId, &Slice) -> Result<Tensor, RuntimeError>) -> Result<Tensor, RuntimeError> {
        let p = &self.params;
        let ids = self.param_ids();
        p.assemble(s, parts, index, |pc| {
            let mut part = self.part_of(ids[pc.pos]);
            part.flat = Some([pc.from as u64, pc.to as u64]);
            Ok(read(ids[pc.pos], &part)?.f_to_kind(p.opts.0)?.f_to_device(p.opts.1)?.f_reshape([-1])?)
        })
    }

    /// The stage whose state a collective moves, one of this rank's.
    pub fn stage_of(&self, purpose: &Purpose) -> Result<usize, RuntimeError> {
        purpose
            .stage()
            .filter(|s| self.my_stages.contains(s))
            .ok_or_else(|| terr(format!("collective `{purpose}` names no stage of rank {}", self.global_rank)))
    }

    /// The tensor of buffer `v` that training updates and the part of `v` it is, if this rank
    /// writes it to checkpoints: replica 0's tensor rank 0 of the first stage that reads `v`
    /// (its executor's copy), or every tensor rank of it when tensor parallelism cut `v`.
    pub fn live_buffer(&self, v: ValueId) -> Option<(Tensor, Slice)> {
        // a buffer tensor parallelism cut (BART's `final_logits_bias`, added to vocabulary-
        // parallel logits) is written by every tensor rank, each its part
        let part = self.part_of(v);
        if self.replica != 0 || (self.tensor_rank != 0 && part.axis.is_none()) {
            return None;
        }
        let graph = self.graph();
        let first = (0..self.n_stages).find(|&s| self.layout.nodes[s].iter().any(|&n| graph.node(n).inputs.contains(&Some(v))))?;
        if !self.my_stages.contains(&first) {
            return None;
        }
        let live = match self.stage_execs.get(&first) {
            Some(se) => se.graph().value_by_name(&graph.value(v).name).and_then(|l| se.weights.get(&l)).map(Tensor::shallow_clone),
            None => self.exec.weights.get(&v).map(Tensor::shallow_clone),
        };
        live.map(|t| (t, part))
    }

    /// On a GPU, waits until the work queued so far is done, so a pass is timed as the time its
    /// kernels ran (nothing to wait for on the CPU).
    pub fn wait_for_device(&self) {
        if let tch::Device::Cuda(i) = self.params.opts.1 {
            tch::Cuda::synchronize(i as i64);
        }
    }

    /// The last stage (it computes the loss).
    pub fn last_stage(&self) -> usize {
        self.n_stages - 1
    }

    /// This replica's microbatches of batch `k` (from 1) of `data`, with their graph-input
    /// feeds; empty when the rank reads no data.
    pub fn batches(&self, data: &DataSource, k: usize) -> Result<(Vec<Batch>, Vec<HashMap<ValueId, Tensor>>), RuntimeError> {
        if !self.reads_data {
            return Ok(((0..self.parallel.microbatches.max(1)).map(|_| Vec::new()).collect(), (0..self.parallel.microbatches.max(1)).map(|_| HashMap::new()).collect()));
        }
        let micro = data.replica_microbatches(k, self.data_replica, self.data_dp, self.parallel.microbatches.max(1))?;
        let feeds = micro.iter().map(|mb| input_feeds(self.exec, mb)).collect::<Result<_, _>>()?;
        Ok((micro, feeds))
    }
}

/// The executors of a rank's shard subgraphs, by stage, sharing one tensor per trained weight
/// that several of them read; with those tensors by name.
#[allow(clippy::type_complexity)]
/// For rank `me`'s program among `programs`: each send's index, with the index of its first
/// later receive from the same peer that the peer sends after its own receive of that send
/// (blocking, so the send had completed by then).
fn sends_done_at(programs: &[RankProgram], me: usize) -> HashMap<usize, usize> {
    let mut out = HashMap::new();
    let Some(mine) = programs.iter().find(|p| p.rank == me) else { return out };
    // a message as its receiver names it: (sender, what, receiving stage, microbatch)
    let received = |x: &Instr| match *x {
        Instr::Recv { from, what, stage, mb, .. } => Some((from, what, stage, mb)),
        _ => None,
    };
    for (i, instr) in mine.instrs.iter().enumerate() {
        let Instr::Send { to, what, stage, mb, .. } = *instr else { continue };
        let Some(peer) = programs.iter().find(|p| p.rank == to) else { continue };
        let Some(at) = peer.instrs.iter().position(|x| received(x) == Some((me, what, what.receiver(stage).unwrap_or(usize::MAX), mb))) else { continue };
        // what the peer sends back to us after its receive of this one
        let later: Vec<(usize, Payload, usize, usize)> = peer.instrs[at + 1..]
            .iter()
            .filter_map(|x| match *x {
                Instr::Send { to: r, what, stage, mb, .. } if r == me => what.receiver(stage).map(|lands| (to, what, lands, mb)),
                _ => None,
            })
            .collect();
        if let Some(k) = (i + 1..mine.instrs.len()).find(|&k| received(&mine.instrs[k]).is_some_and(|m| later.contains(&m))) {
            out.insert(i, k);
        }
    }
    out
}

/// The stages of `program` whose parameters ZeRO 3 gathers.
fn zero3_stages(plan: &Plan, program: &RankProgram) -> HashSet<usize> {
    if !plan.parallel.over_data_axis().params_sharded() {
        return HashSet::new();
    }
    program
        .instrs
        .iter()
        .filter_map(|i| match i {
            Instr::AllGather { purpose: purpose @ Purpose::Zero3Params { .. }, .. } => purpose.stage(),
            _ => None,
        })
        .collect()
}

/// Fills each segment's parameters (the positions its nodes read, by name: a shard
/// subgraph's weights carry the model's names).
fn segment_params(params: &Params, model: &Graph, stage_execs: &HashMap<usize, Executor<'_>>, segments: &mut HashMap<usize, StageSegments>) {
    for (s, segs) in segments.iter_mut() {
        let graph = stage_execs.get(s).map_or(model, |e| e.graph());
        for seg in &mut segs.segments {
            let mut mine = Vec::new();
            for &n in &seg.nodes {
                for &v in graph.node(n).inputs.iter().flatten() {
                    if let Some(&i) = model.value_by_name(&graph.value(v).name).and_then(|m| params.pos_of.get(&m))
                        && !mine.contains(&i)
                    {
                        mine.push(i);
                    }
                }
            }
            seg.params = mine;
        }
    }
}

/// Cuts each ZeRO-3 stage's parameters into gather units, one per segment: a parameter's
/// unit is the first segment reading it.
fn split_gather_units(params: &mut Params, segments: &HashMap<usize, StageSegments>, gathered: &HashSet<usize>) {
    for &s in gathered {
        let Some(segs) = segments.get(&s) else { continue };
        let mut first: HashMap<usize, usize> = HashMap::new();
        for (k, seg) in segs.segments.iter().enumerate() {
            for &i in &seg.params {
                first.entry(i).or_insert(k);
            }
        }
        if s < params.sharded.len() {
            params.split_units(s, |i| first.get(&i).copied().unwrap_or(usize::MAX));
        }
    }
}

/// The segments of each of `my_stages` the plan recomputes or ZeRO 3 gathers (`gathered`: one
/// segment per layer), in the ids of the graph that runs it: the plan's `layer_strategies`
/// name each node's layer, its stages which are checkpointed and offloaded.
fn recompute_segments(
    plan: &Plan,
    exec: &Executor<'_>,
    stage_execs: &HashMap<usize, Executor<'_>>,
    layout: &StageLayout,
    my_stages: &[usize],
    gathered: &HashSet<usize>,
) -> Result<HashMap<usize, StageSegments>, RuntimeError> {
    let layer_of: HashMap<&str, usize> = plan.layer_strategies.iter().flat_map(|l| l.nodes.iter().map(move |(n, _)| (n.as_str(), l.layer))).collect();
    let model = exec.graph();
    let shared = segments::shared_inputs(model, &layer_of);
    let carries = crate::passes::params::carries_gradient(model).map_err(|e| terr(format!("laying out recomputed segments: {e}")))?;
    let mut out = HashMap::new();
    for &s in my_stages.iter().filter(|&&s| layout.recompute[s] || gathered.contains(&s)) {
        let selective = &layout.selective[s];
        let per_layer = gathered.contains(&s) || !selective.is_empty();
        let st = &plan.stages[s];
        let checkpointed: BTreeSet<usize> = st.checkpointed_layers.iter().copied().collect();
        let offloaded: BTreeSet<usize> = st.offloaded_layers.iter().copied().collect();
        let received: Vec<ValueId> = if s == 0 { Vec::new() } else { layout.outputs_to_next[s - 1].clone() };
        let yields: Vec<ValueId> = if s + 1 == layout.nodes.len() { model.outputs.clone() } else { layout.outputs_to_next[s].clone() };
        let (mut segs, graph) = match stage_execs.get(&s) {
            None => (segments::stage_segments(model, &layout.nodes[s], &layer_of, (&checkpointed, &offloaded), (&received.into_iter().collect(), &yields), &shared, per_layer, selective), model),
            Some(se) => {
                let sg = se.graph();
                let local = |v: &ValueId| sg.value_by_name(&model.value(*v).name);
                let order = sg.topo_order().map_err(|e| terr(format!("stage {s}'s shard subgraph: {e}")))?;
                let received = received.iter().filter_map(local).collect();
                let yields: Vec<ValueId> = yields.iter().filter_map(local).collect();
                (segments::stage_segments(sg, &order, &layer_of, (&checkpointed, &offloaded), (&received, &yields), &shared, per_layer, selective), sg)
            }
        };
        let carries = shard_carries(model, &carries, graph).map_err(|e| terr(format!("stage {s}'s shard subgraph: {e}")))?;
        segs.no_gradient = segs.segments.iter().flat_map(|seg| seg.inputs.iter().copied()).filter(|&v| !carries[v.index()]).collect();
        out.insert(s, segs);
    }
    Ok(out)
}

/// Which values of `graph` (the model, or a stage's shard subgraph of it) carry a gradient: a
/// value named in the model as the model's `carries` says; one the split added (a collective's
/// output, a cut mask or rotary table) where a value it is made from carries one.
fn shard_carries(model: &Graph, carries: &[bool], graph: &Graph) -> Result<Vec<bool>, crate::ir::GraphError> {
    let mut out: Vec<Option<bool>> = vec![None; graph.value_count()];
    for v in graph.value_ids() {
        out[v.index()] = model.value_by_name(&graph.value(v).name).map(|m| carries[m.index()]);
    }
    for n in graph.topo_order()? {
        let node = graph.node(n);
        let any = node.inputs.iter().flatten().any(|v| out[v.index()] == Some(true));
        for &o in &node.outputs {
            if out[o.index()].is_none() {
                out[o.index()] = Some(any && graph.value(o).ty.as_ref().is_some_and(|t| t.dtype.is_float()));
            }
        }
    }
    Ok(out.into_iter().map(|c| c.unwrap_or(false)).collect())
}

fn stage_executors<'a>(
    exec: &Executor<'_>,
    source: &Source<'_>,
    shards: &'a Shards,
    (tensor_pg, routing): (Option<&Arc<ProcessGroup>>, &ExpertRouting),
    lazy: &HashSet<ValueId>,
    experts: &Experts,
) -> Result<(HashMap<usize, Executor<'a>>, HashMap<String, Tensor>), RuntimeError> {
    let mut stage_execs: HashMap<usize, Executor<'a>> = HashMap::new();
    let mut by_name: HashMap<String, Tensor> = HashMap::new();
    for sh in &shards.stages {
        let sub = &sh.graph;
        let slices: HashMap<&str, &WeightSlice> = sh.slices.iter().map(|w| (w.initializer.as_str(), w)).collect();
        let tensors = stage_weights(exec, source, sub, &slices, lazy, experts)?;
        let mut e = Executor::new_on(sub, Weights { tensors }, ExecOptions { float_kind: exec.float_kind(), training: true, autocast: exec.autocast() }, exec.device())?;
        e.tensor_group = tensor_pg.cloned();
        if routing.leaves_the_rank() {
            e.set_expert_routing(routing.clone());
        }
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
        stage_execs.insert(sh.stage, e);
    }
    Ok((stage_execs, by_name))
}

/// This rank's parameters (each belongs to the first of the rank's stages reading it), with
/// the positions of the KV slices in `kv_names` (name, the tensor ranks sharing it). `(me, q,
/// t)`: the global rank, its pipeline and tensor rank; `sliced`: the weights its shards slice; `by_name`: the
/// shards' weight tensors (with tensor parallelism).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn own_params(
    plan: &Plan,
    exec: &Executor,
    layout: &StageLayout,
    my_stages: &[usize],
    (me, q, t): (usize, usize, usize),
    (sliced, experts): (&HashMap<&str, &WeightSlice>, &Experts),
    by_name: &HashMap<String, Tensor>,
    kv_names: &[(String, Vec<usize>)],
) -> Result<(Params, Vec<(usize, Vec<usize>)>), RuntimeError> {
    let graph = exec.graph();
    let subgraphs = runs_stage_subgraphs(&plan.parallel);
    let n_stages = layout.params.len();
    let mut ids: Vec<ValueId> = Vec::new();
    let mut owned: Vec<Vec<usize>> = vec![Vec::new(); n_stages];
    for &s in my_stages {
        for &v in &layout.params[s] {
            if !ids.contains(&v) {
                owned[s].push(ids.len());
                ids.push(v);
            }
        }
    }
    let pos_of: HashMap<ValueId, usize> = ids.iter().enumerate().map(|(i, v)| (*v, i)).collect();
    let read: Vec<Vec<usize>> = layout.params.iter().map(|ps| ps.iter().filter_map(|v| pos_of.get(v).copied()).collect()).collect();
    let first_holder = |v: ValueId| (0..n_stages).find(|&s| layout.params[s].contains(&v)).map(|s| plan.stages[s].pp_rank);
    // norms count each element once: tied weights on their first pipeline rank, replicated
    // gradients on the first replica (or shard group); with tensor parallelism, sliced
    // weights on every tensor rank, replicated ones on tensor rank 0, and a slice shared by
    // tensor ranks on the first of them
    let counted: Vec<bool> = ids
        .iter()
        .map(|&v| {
            let name = graph.value(v).name.as_str();
            let shared = kv_names.iter().find(|(n, _)| n == name).map(|(_, g)| g.len());
            // folded expert groups: the tensor ranks hold different experts
            let own_experts = experts.folded && experts.held(name).is_some();
            first_holder(v) == Some(q) && (own_experts || shared.map_or(t == 0 || sliced.contains_key(name), |r| t % r == 0))
        })
        .collect();
    let tensors: Vec<Tensor> = ids
        .iter()
        .map(|v| {
            let w = if subgraphs { by_name.get(&graph.value(*v).name) } else { exec.weights.get(v) };
            w.map(Tensor::shallow_clone).ok_or_else(|| terr(format!("no weight for `{}` on rank {me}", graph.value(*v).name)))
        })
        .collect::<Result<_, _>>()?;
    // the loaded weights of other pipeline ranks' stages (and with tensor parallelism the
    // unsliced model the shards were cut from) are never read on this rank again
    for (id, w) in &exec.weights {
        if is_trainable(graph, *id) && (subgraphs || !pos_of.contains_key(id)) {
            w.shallow_clone().f_set_data(&Tensor::f_empty([0], (w.kind(), w.device()))?)?;
        }
    }
    let kv_groups = kv_names
        .iter()
        .map(|(name, members)| {
            let i = graph
                .value_by_name(name)
                .and_then(|v| pos_of.get(&v).copied())
                .ok_or_else(|| terr(format!("shared KV slice `{name}` is not a parameter of rank {me}")))?;
            Ok((i, members.clone()))
        })
        .collect::<Result<_, RuntimeError>>()?;
    let float_kind = tensors.first().map_or(Kind::Float, Tensor::kind);
    // shapes from the model and the cuts (ZeRO-3 parameters are not loaded whole)
    let shapes = ids
        .iter()
        .map(|&v| {
            let val = graph.value(v);
            let mut dims = val.data.as_ref().map(|d| d.dims.clone()).ok_or_else(|| terr(format!("parameter `{}` has no data", val.name)))?;
            if let Some(sl) = sliced.get(val.name.as_str()) {
                dims[sl.axis] = sl.len() as i64;
            }
            if let (Some([a, b]), Some(d)) = (experts.held(&val.name), dims.first_mut()) {
                *d = (b - a) as i64;
            }
            Ok(dims)
        })
        .collect::<Result<_, RuntimeError>>()?;
    let expert: Vec<bool> = ids.iter().map(|&v| experts.held(&graph.value(v).name).is_some()).collect();
    let sharded = owned.iter().map(|o| o.iter().copied().filter(|&i| !expert[i]).collect()).collect();
    let params = Params { tensors, shapes, owned, sharded, units: Vec::new(), read, counted, expert, pos_of, opts: (float_kind, exec.device()) };
    Ok((params, kv_groups))
}

/// The graph-input feeds of microbatch `mb` (its arrays that are inputs of the model).
fn input_feeds(exec: &Executor, mb: &Batch) -> Result<HashMap<ValueId, Tensor>, RuntimeError> {
    exec.bind_batch(mb)
}

/// The process groups of rank `env.rank`: every distinct member list in any program, the
/// tensor groups, the KV-slice groups and the world, created in one global order by their
/// members (creation is a rendezvous).
fn connect_groups(
    env: &RankEnv,
    opts: &RankOptions,
    mesh: &Mesh,
    programs: &[RankProgram],
    kv_groups: &[(String, Vec<usize>)],
    (par, cp): (&Parallelism, usize),
) -> Result<Groups, RuntimeError> {
    let me = env.rank;
    let store: Arc<Store> = Store::connect(env, opts.timeout)?;
    let world: Vec<usize> = (0..env.world).collect();
    let mut lists: BTreeSet<Vec<usize>> = BTreeSet::new();
    lists.insert(world.clone());
    if mesh.tp() > 1 {
        lists.extend(mesh.tensor_groups());
    }
    if mesh.dp() > 1 {
        for q in 0..mesh.pp() {
            for t in 0..mesh.tp().max(1) {
                lists.insert(mesh.replica_group(q, t));
            }
        }
    }
    lists.extend(kv_groups.iter().map(|(_, g)| g.clone()));
    lists.extend(Experts::all_groups(mesh, par));
    if cp > 1 {
        for q in 0..mesh.pp() {
            for d in (0..mesh.dp()).step_by(cp) {
                for t in 0..mesh.tp().max(1) {
                    lists.insert(context_group(mesh, cp, (q, d, t)));
                }
            }
        }
    }
    for p in programs {
        for i in &p.instrs {
            if let Some((g, _)) = i.collective() {
                lists.insert(g.to_vec());
            }
        }
    }
    let mut by_members: HashMap<Vec<usize>, Arc<ProcessGroup>> = HashMap::new();
    for g in lists {
        if g.contains(&me) {
            let pg = ProcessGroup::new(&store, &g, me, opts.timeout, opts.backend)?;
            by_members.insert(g, Arc::new(pg));
        }
    }
    let world = by_members[&world].clone();
    Ok(Groups { me, by_members, world })
}

/// The context group of the rank at (pipeline rank, data position, tensor rank): the `cp`
/// consecutive data positions of its data replica.
fn context_group(mesh: &Mesh, cp: usize, (q, d, t): (usize, usize, usize)) -> Vec<usize> {
    let first = d - d % cp;
    (first..first + cp).map(|dd| mesh.ranks[q][dd][t]).collect()
}

/// Rejects a world size other than the plan's.
pub(super) fn check_world(plan: &Plan, env: &RankEnv) -> Result<(), RuntimeError> {
    let mesh = plan.mesh();
    let world = mesh.world();
    if env.world != world {
        return Err(terr(format!(
            "the plan needs {world} ranks (pp {} × dp {} × tp {}), WORLD_SIZE is {}; launch with --nproc {world}",
            mesh.pp(), mesh.dp(), mesh.tp(), env.world,
        )));
    }
    Ok(())
}

/// The running-statistics inputs (mean, variance) of the BatchNormalization nodes in `stages`,
/// as the tensors the executors running those stages hold.
fn norm_buffers(exec: &Executor<'_>, stage_execs: &HashMap<usize, Executor<'_>>, layout: &StageLayout, stages: &[usize]) -> Vec<Tensor> {
    let graph = exec.graph();
    let mut out = Vec::new();
    for &s in stages {
        for &n in &layout.nodes[s] {
            let node = graph.node(n);
            if node.op != Op::Known(OpKind::BatchNormalization) {
                continue;
            }
            for v in node.inputs.iter().skip(3).take(2).flatten() {
                let held = match stage_execs.get(&s) {
                    Some(se) => se.graph().value_by_name(&graph.value(*v).name).and_then(|l| se.weights.get(&l)),
                    None => exec.weights.get(v),
                };
                if let Some(t) = held {
                    out.push(t.shallow_clone());
                }
            }
        }
    }
    out
}

/// Rejects instructions that name stages or microbatches outside the plan, or messages that
/// cross a boundary the pipeline does not have.
fn check_program(p: &RankProgram, stages: usize, m: usize) -> Result<(), RuntimeError> {
    use crate::codegen::Payload;
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

/// The tensors of a shard subgraph's initializers and constants: this rank's slice of the
/// model's weight where the shard slices it, the model's tensor where it is replicated, and
/// the subgraph's own data for constants the shard made.
fn stage_weights(
    exec: &Executor<'_>,
    source: &Source<'_>,
    sub: &Graph,
    slices: &HashMap<&str, &crate::codegen::WeightSlice>,
    lazy: &HashSet<ValueId>,
    experts: &Experts,
) -> Result<HashMap<ValueId, Tensor>, RuntimeError> {
    let main = exec.graph();
    let mut out = HashMap::new();
    for id in sub.value_ids() {
        let v = sub.value(id);
        if !matches!(v.kind, ValueKind::Initializer | ValueKind::Constant) {
            continue;
        }
        // the model's weight, read in the part this rank holds (ZeRO-3 parameters not at all:
        // their blocks are read when the shards are made)
        let model = main.value_by_name(&v.name).filter(|&m| main.value(m).data.is_some());
        let t = match (model, slices.get(v.name.as_str())) {
            (Some(m), _) if lazy.contains(&m) => placeholder(main, m, exec.float_kind(), exec.device())?,
            (Some(m), Some(sl)) => source.read(m, &experts.narrow(&v.name, Slice { axis: Some(sl.axis), ranges: sl.ranges.clone(), ..Slice::whole() }))?,
            (Some(m), None) => source.read(m, &experts.narrow(&v.name, Slice::whole()))?,
            (None, _) => {
                let Some(data) = &v.data else { continue };
                let crate::ir::Storage::Raw(bytes) = &data.storage else {
                    return Err(terr(format!("shard constant `{}` has no inline data", v.name)));
                };
                let t = crate::runtime::kernels::tensor::from_bytes(data.dtype, &data.dims, bytes).map_err(|m| RuntimeError::Weight { name: v.name.clone(), message: m })?;
                match exec.float_kind() {
                    Some(k) if crate::runtime::kernels::tensor::is_float_kind(t.kind()) && t.kind() != k => t.f_to_kind(k)?,
                    _ => t,
                }
            }
        };
        out.insert(id, t);
    }
    Ok(out)
}

/// An empty stand-in for ZeRO-3 parameter `v` on `device` (its storage is swapped in when
/// gathered).
pub(super) fn placeholder(graph: &Graph, v: ValueId, float_kind: Option<Kind>, device: tch::Device) -> Result<Tensor, RuntimeError> {
    let dtype = graph.value(v).data.as_ref().map_or(crate::ir::DType::F32, |d| d.dtype);
    let kind = match float_kind {
        Some(k) => k,
        None => crate::runtime::kernels::tensor::kind_of(dtype).map_err(|m| RuntimeError::Weight { name: graph.value(v).name.clone(), message: m })?,
    };
    Ok(Tensor::f_empty([0], (kind, device))?)
}

/// The trained parameters of rank `(plan, program)` that stay sharded from the start (ZeRO 3):
/// those owned by a stage whose parameters the program gathers. They are never loaded whole;
/// each rank reads its block.
/// Experts held in part (expert parallelism) are loaded as their parts: ZeRO does not shard them.
pub(super) fn lazy_params(plan: &Plan, layout: &StageLayout, program: &RankProgram, my_stages: &[usize], (graph, experts): (&Graph, &Experts)) -> HashSet<ValueId> {
    let mut out = HashSet::new();
    let gathered = zero3_stages(plan, program);
    let mut seen: HashSet<ValueId> = HashSet::new();
    for &s in my_stages {
        for &v in &layout.params[s] {
            if seen.insert(v) && gathered.contains(&s) && experts.held(&graph.value(v).name).is_none() {
                out.insert(v);
            }
        }
    }
    out
}

/// The whole weights the model's executor of rank `me` needs: the initializers and constants
/// its stages read, without the parameters that tensor-parallel shards slice (their stage
/// executors read their own parts) or that ZeRO 3 shards (empty stand-ins). Nothing of other
/// pipeline ranks' stages is read.
pub fn rank_weights(plan: &Plan, source: &Source<'_>, me: usize) -> Result<Weights, RuntimeError> {
    let graph = source.graph();
    let section = layout::codegen_section(plan)?;
    let layout = layout::stage_layout(section, graph)?;
    let mesh = plan.mesh();
    let Coord { pp: q, dp: d, tp: t } = mesh.coord(me).ok_or_else(|| terr(format!("rank {me} runs no stage of the plan")))?;
    let mut tensors = HashMap::new();
    if runs_stage_subgraphs(&plan.parallel) {
        return Ok(Weights { tensors });
    }
    let experts = Experts::of(graph, &plan.parallel, (d, t))?;
    let programs = layout::rank_programs(plan, section)?;
    let program = programs.iter().find(|p| p.rank == me).ok_or_else(|| terr(format!("no program for rank {me}")))?;
    let my_stages: Vec<usize> = (0..plan.stages.len()).filter(|&s| plan.stages[s].pp_rank == q).collect();
    let lazy = lazy_params(plan, &layout, program, &my_stages, (graph, &experts));
    for &s in &my_stages {
        for &n in &layout.nodes[s] {
            for &v in graph.node(n).inputs.iter().flatten() {
                if tensors.contains_key(&v) || graph.value(v).data.is_none() {
                    continue;
                }
                let t = if lazy.contains(&v) {
                    placeholder(graph, v, source.float_kind(), source.device())?
                } else {
                    source.read(v, &experts.narrow(&graph.value(v).name, Slice::whole()))?
                };
                tensors.insert(v, t);
            }
        }
    }
    Ok(Weights { tensors })
}
