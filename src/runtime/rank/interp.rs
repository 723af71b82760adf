//! The interpreter of a rank's program: one method per instruction, over the state of one
//! training step (microbatch activations, received tensors, accumulated gradients, messages in
//! flight) and the rank's ZeRO state.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Instant;

use tch::{Kind, Tensor};

use crate::runtime::RuntimeError;
use crate::runtime::comm::Work;
use crate::runtime::kernels::ops::{DropoutKey, NormStats};
use crate::runtime::terr;
use super::setup::Rank;
use crate::runtime::kernels::grad;
use crate::runtime::kernels::executor::Executor;
use super::report::{PhaseTimes, Tally, bytes_of};
use crate::runtime::data::DataSource;
use crate::runtime::data::Batch;
use crate::runtime::state::checkpoint::{self, Piece, RunState};
use crate::runtime::state::slice::{Slice, is_transposed, param_name};
use crate::runtime::train::{self, Leave, LossScaler, OptimizerProgress, StepRecord, StepRunner};
use super::zero::{Restore, Zero};
use super::memory;
use super::offload::Offload;
use super::straggler::{self, Stragglers};
use crate::codegen::{Instr, Payload, Purpose};
use crate::ir::{NodeId, ValueId};
use crate::runtime::kernels::ops::moe::ExpertActivationParts;

/// One microbatch of one stage between its forward and its backward.
#[derive(Default)]
struct MbState {
    inputs: Vec<(ValueId, Tensor)>,
    outputs: Vec<(ValueId, Tensor)>,
    loss: Option<Tensor>,
    /// The backward's roots, kept between a split B and its W.
    roots: Vec<Tensor>,
    /// In a segmented stage, the segment of each root (its W runs segment by segment).
    root_segments: Vec<usize>,
    /// A recomputed stage's segments that kept their activations (`None` for checkpointed
    /// ones), and on the last stage the loss taken from the graph's outputs.
    parts: Vec<Option<Part>>,
    loss_part: Option<Part>,
    /// On the last stage, the segment that makes every graph output: the loss's backward runs
    /// with that segment's (a checkpointed one recomputes the loss with itself, so nothing of
    /// the loss is kept from the forward; another's loss continues its graph).
    loss_in_segment: Option<usize>,
    /// A recomputed stage's received values, as shapes (their gradients' zeros when none flows).
    received: Vec<(ValueId, Vec<i64>, Kind, tch::Device)>,
    /// Of them, those the previous stage wants no gradient of (plain tensors, not leaves), in
    /// the ids of the graph that runs the stage.
    plain: BTreeSet<ValueId>,
}

/// One segment of a recomputed stage with its autograd graph: its inputs as gradient leaves
/// and the outputs made from them, in the ids of the graph that ran it.
struct Part {
    inputs: Vec<(ValueId, Tensor)>,
    outputs: Vec<(ValueId, Tensor)>,
    /// Outputs selective recompute freed after the forward, rebuilt before the backward.
    rebuilt: Vec<Rebuilt>,
    /// Experts' activations inside its mixtures of experts, the same.
    experts: Vec<ExpertActivationParts>,
    /// Outputs held until the backward though none of it reads them ([`Segment::held`]).
    _held: Vec<Tensor>,
}

/// An output freed after its segment's forward (selective recompute): the node that made it,
/// what that node reads, and the tensor whose storage the rebuild fills again.
struct Rebuilt {
    node: NodeId,
    inputs: HashMap<ValueId, Tensor>,
    output: (ValueId, Tensor),
}

/// Frees the storage of the outputs of `nodes` (a kept segment's [`Segment::rebuilt`]) among
/// `outs`, keeping what rebuilding each needs; an output whose storage another value in
/// `keep` views stays (freeing it would free that value too).
fn set_aside(graph: &crate::ir::Graph, nodes: &[NodeId], outs: &HashMap<ValueId, Tensor>, keep: &[ValueId]) -> Result<Vec<Rebuilt>, RuntimeError> {
    let span = |t: &Tensor| {
        let at = t.data_ptr() as usize;
        (at, at + t.numel() * t.kind().elt_size_in_bytes())
    };
    let mut out = Vec::with_capacity(nodes.len());
    for &n in nodes {
        let node = graph.node(n);
        if rebuilt_inside(node) {
            continue;
        }
        let Some((&v, t)) = node.outputs.first().and_then(|v| outs.get_key_value(v)) else { continue };
        let (lo, hi) = span(t);
        let viewed = keep.iter().filter(|&&k| k != v).filter_map(|k| outs.get(k)).any(|o| (lo..hi.max(lo + 1)).contains(&(o.data_ptr() as usize)));
        // an output that views what the node reads (a reshape that did not copy) is that
        // tensor's storage: freeing it would free the input
        let overlaps = |o: &Tensor| {
            let (a, b) = span(o);
            a < hi && lo < b
        };
        let views_input = node.inputs.iter().flatten().filter_map(|i| outs.get(i)).any(overlaps);
        if viewed || views_input || t.numel() == 0 {
            continue;
        }
        let inputs = node.inputs.iter().flatten().filter_map(|i| outs.get(i).map(|x| (*i, x.shallow_clone()))).collect();
        crate::runtime::kernels::storage::free(t)?;
        out.push(Rebuilt { node: n, inputs, output: (v, t.shallow_clone()) });
    }
    Ok(out)
}

/// Whether selective recompute rebuilds what `node` makes inside it rather than its output
/// ([`crate::ir::OpKind::recomputed_inside`]).
fn rebuilt_inside(node: &crate::ir::Node) -> bool {
    node.op.kind().is_some_and(crate::ir::OpKind::recomputed_inside)
}

/// Runs each of `rebuilt`'s nodes again without autograd and moves the result into the storage
/// its forward freed, where autograd's saved references read it.
fn rebuild(ex: &Executor<'_>, rebuilt: &[Rebuilt]) -> Result<(), RuntimeError> {
    for r in rebuilt {
        let (v, t) = &r.output;
        let fresh = tch::no_grad(|| ex.run_nodes(&[r.node], &r.inputs, &[*v]))?;
        let made = fresh.get(v).ok_or_else(|| terr(format!("rebuilding `{}`: not computed", ex.graph().value(*v).name)))?;
        crate::runtime::kernels::storage::take(t, made)?;
    }
    Ok(())
}

/// Executes a rank's program, step after step.
pub(super) struct Interp<'r, 'a> {
    rank: &'r Rank<'a>,
    zero: Zero,
    /// Peaks of the held state.
    pub tally: Tally,
    // the step in progress
    /// Accumulated gradients of the parameters in no ZeRO shard (all of them before the
    /// data-parallel synchronisation), by position.
    grads: Vec<Option<Tensor>>,
    state: HashMap<(usize, usize), MbState>,
    /// Activations received for (stage, microbatch).
    act_in: HashMap<(usize, usize), Vec<Tensor>>,
    /// Gradients of (stage, microbatch)'s outputs: received, or computed for the previous stage.
    grad_for: HashMap<(usize, usize), Vec<Tensor>>,
    /// Sends in flight.
    /// Sends in flight, with the index of the instruction that posted them.
    pending: Vec<(usize, Work)>,
    /// The index of the instruction running.
    at: usize,
    /// Header receives posted at the start of the pass, by (payload, receiving stage, microbatch).
    headers: HashMap<(Payload, usize, usize), Work>,
    /// This rank's share of the step's loss (the global mean after the optimizer step).
    loss_sum: f64,
    /// 1 / the counted targets of the current global batch (on the last stage; 0 elsewhere).
    loss_scale: f64,
    /// Split backwards whose weight gradient is still to come (they keep ZeRO-3 stages).
    pending_w: BTreeSet<(usize, usize)>,
    /// Shared KV slices' gradients summed this step.
    kv_done: bool,
    /// The step in progress (from 1).
    step: usize,
    /// This rank's microbatches of the step's batch, and their graph-input feeds.
    micro: Vec<Batch>,
    feeds: Vec<HashMap<ValueId, Tensor>>,
    /// A forward-only pass (validation): no autograd, no backward.
    eval: bool,
    /// Where the step in progress spent its wall time.
    phases: PhaseTimes,
    /// Training steps run by this interpreter.
    steps_run: usize,
    /// AdamW updates taken over the run (fp16 steps with inf/NaN take none).
    adamw_steps: usize,
    /// The loss scale of an fp16 mixed-precision run (the same on every rank).
    scaler: Option<LossScaler>,
    /// The step in progress found inf/NaN and took no update.
    skipped: bool,
    /// Recomputed stages' kept inputs, offloaded where the plan says.
    offload: Offload,
    /// Ranks slower than the others, window by window.
    pub stragglers: Stragglers,
}

impl<'r, 'a> Interp<'r, 'a> {
    /// The interpreter of `rank`, before its first step.
    /// With `resumed`, the run state of the checkpoint it continues.
    pub fn new(rank: &'r Rank<'a>, restore: Option<Restore>, resumed: Option<&RunState>) -> Result<Interp<'r, 'a>, RuntimeError> {
        let cfg = rank.cfg;
        let scaler = cfg.autocast.filter(|a| a.scales_loss()).map(|_| LossScaler::new(cfg.loss_scale, resumed.and_then(|s| s.loss_scale)));
        Ok(Interp {
            rank,
            zero: Zero::new(rank, restore)?,
            tally: Tally::new(rank.context_gathers(), rank.params.opts.1.is_cuda()),
            grads: Vec::new(),
            state: HashMap::new(),
            act_in: HashMap::new(),
            grad_for: HashMap::new(),
            pending: Vec::new(),
            at: 0,
            headers: HashMap::new(),
            loss_sum: 0.0,
            loss_scale: 0.0,
            pending_w: BTreeSet::new(),
            kv_done: true,
            step: 0,
            micro: Vec::new(),
            feeds: Vec::new(),
            eval: false,
            phases: PhaseTimes::default(),
            steps_run: 0,
            adamw_steps: resumed.map_or(0, |s| s.adamw_step),
            scaler,
            skipped: false,
            offload: {
                let order = rank.program.instrs.iter().filter_map(|i| match *i {
                    Instr::Backward { stage, mb } if rank.layout.recompute[stage] => Some((stage, mb)),
                    _ => None,
                });
                Offload::new(rank.offloaded.clone(), rank.parallel.loading_horizon, order.collect())
            },
            stragglers: Stragglers::new(rank.opts.stragglers, rank.world, rank.predicted_compute_s),
        })
    }




    /// Gives every replica replica 0's buffers (BatchNorm running statistics), as PyTorch DDP
    /// does before each forward (`broadcast_buffers`): before each step and each validation.
    /// Replica 0's own statistics follow only its own microbatches, as under DDP.
    fn broadcast_buffers(&self) -> Result<(), RuntimeError> {
        let r = self.rank;
        let Some(members) = r.replica_group.as_ref().filter(|_| !r.norm_buffers.is_empty()) else { return Ok(()) };
        let pg = r.groups.get(members)?;
        for t in &r.norm_buffers {
            pg.broadcast(t, members[0])?;
        }
        Ok(())
    }

    /// The loss weight of global batch `k` of `data`: 1 / its counted targets over every
    /// replica and microbatch on a rank that computes the loss, so the step's loss is the
    /// global batch's mean whatever the microbatch and replica counts.
    fn loss_scale_of(&self, data: &DataSource, k: usize) -> Result<f64, RuntimeError> {
        let r = self.rank;
        if !r.my_stages.contains(&r.last_stage()) {
            return Ok(0.0);
        }
        Ok(1.0 / train::global_target_count(r.exec, r.cfg.loss, data, k)?)
    }

    /// Executes one instruction.
    fn exec(&mut self, instr: &Instr) -> Result<(), RuntimeError> {
        self.run_instr(instr).map_err(|e| match e {
            // a message or collective that failed names what it waited on: a cut link or a dead
            // peer shows here as a timeout or a closed connection
            RuntimeError::Train(m) => match instr {
                Instr::Send { to, .. } => terr(format!("{instr} to rank {to}: {m}")),
                Instr::Recv { from, .. } => terr(format!("{instr} from rank {from}: {m}")),
                Instr::AllReduce { group, .. } | Instr::ReduceScatter { group, .. } | Instr::AllGather { group, .. } => {
                    terr(format!("{instr} over ranks {group:?}: {m}"))
                }
                _ => terr(format!("{instr}: {m}")),
            },
            e => e,
        })
    }

    fn run_instr(&mut self, instr: &Instr) -> Result<(), RuntimeError> {
        match instr {
            Instr::Forward { stage, mb } => self.forward(*stage, *mb),
            Instr::Backward { stage, mb } => self.backward(*stage, *mb),
            Instr::BackwardWeight { stage, mb } => self.backward_weight(*stage, *mb),
            Instr::Send { to, what, stage, mb, .. } => self.send(*to, *what, *stage, *mb),
            Instr::Recv { from, what, stage, mb, .. } => self.recv(*from, *what, *stage, *mb),
            Instr::AllReduce { group, purpose, .. } => self.all_reduce(group, purpose),
            Instr::ReduceScatter { group, purpose, .. } => self.reduce_scatter(group, purpose),
            Instr::AllGather { group, purpose, .. } => self.all_gather(group, purpose),
            Instr::OptimizerStep => self.optimizer_step(),
        }
    }

    /// Counts the state held now towards the peaks.
    fn observe(&mut self) {
        self.tally.observe(self.zero.held(&self.rank.params, &self.grads));
    }

    /// Counts the state held now plus `extra_grads` bytes of fresh gradients.
    fn observe_with_grads(&mut self, extra_grads: u64) {
        let mut now = self.zero.held(&self.rank.params, &self.grads);
        now.grads += extra_grads;
        self.tally.observe(now);
    }

    /// Microbatch `mb`'s loss from the graph's outputs `outs` (with autograd or not, as the
    /// caller runs it).
    fn microbatch_loss(&self, mb: usize, outs: &[Tensor]) -> Result<Tensor, RuntimeError> {
        scaled_loss(self.rank, &self.micro[mb], outs, self.loss_scale)
    }

    /// Adds a microbatch's loss to the rank's share of the step's (once per tensor group).
    fn count_loss(&mut self, loss: &Tensor) -> Result<(), RuntimeError> {
        if self.rank.tensor_rank == 0 {
            self.loss_sum += loss.f_double_value(&[])?;
        }
        Ok(())
    }

    /// What backward starts from: the loss, times the fp16 loss scale if any (GradScaler.scale).
    fn backward_root(&self, loss: Tensor) -> Result<Tensor, RuntimeError> {
        Ok(match &self.scaler {
            Some(sc) => loss.f_mul_scalar(sc.scale())?,
            None => loss,
        })
    }

    fn wait_sends(&mut self) -> Result<(), RuntimeError> {
        for (_, w) in self.pending.drain(..) {
            let _ = w.wait()?;
        }
        Ok(())
    }

    /// After receive `k` of the program: waits for the sends it proves complete (their peer has
    /// received them, so this does not block) and drops them, with the tensors they held (a
    /// stage's outputs with what the next stage reads of its inputs, a gradient): kept to the
    /// step's end, every microbatch's would stay on the device, however few the schedule keeps
    /// in flight.
    fn reap_sends(&mut self, k: usize) -> Result<(), RuntimeError> {
        let done_at = &self.rank.sends_done_at;
        if self.pending.iter().any(|(i, _)| done_at.get(i) == Some(&k)) {
            let (done, open): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending).into_iter().partition(|(i, _)| done_at.get(i) == Some(&k));
            self.pending = open;
            for (_, w) in done {
                let _ = w.wait()?;
            }
        }
        Ok(())
    }

    /// Grouped-query KV slices held by several tensor ranks: each computed part of the
    /// gradient; summed over them before any other synchronisation.
    fn sum_kv_slices(&mut self) -> Result<(), RuntimeError> {
        let r = self.rank;
        for (i, members) in &r.kv_groups {
            let g = match self.grads[*i].take() {
                Some(g) => g.f_contiguous()?,
                None => r.params.zeros(*i)?,
            };
            r.groups.get(members)?.all_reduce_sum(&g)?;
            self.grads[*i] = Some(g);
        }
        self.kv_done = true;
        Ok(())
    }

    fn forward(&mut self, s: usize, mb: usize) -> Result<(), RuntimeError> {
        let r = self.rank;
        let raw: Vec<Tensor> = if s == 0 {
            Vec::new()
        } else if let Some(t) = self.act_in.remove(&(s, mb)) {
            t
        } else {
            let prev = self.state.get(&(s - 1, mb)).ok_or_else(|| terr(format!("stage {s} mb {mb}: no input from stage {}", s - 1)))?;
            prev.outputs.iter().map(|(_, t)| t.shallow_clone()).collect()
        };
        let ids: &[ValueId] = if s == 0 { &[] } else { &r.layout.outputs_to_next[s - 1] };
        if raw.len() != ids.len() {
            return Err(terr(format!("stage {s} mb {mb}: {} inputs arrived, {} expected", raw.len(), ids.len())));
        }
        // gradients flow back only into what the previous stage wants them for
        let back: &[ValueId] = if s == 0 { &[] } else { &r.layout.gradients_from_next[s - 1] };
        let inputs: Vec<(ValueId, Tensor)> = ids
            .iter()
            .zip(raw)
            .map(|(v, t)| Ok((*v, if is_float(&t) && back.contains(v) { t.f_detach()?.f_set_requires_grad(true)? } else { t })))
            .collect::<Result<_, RuntimeError>>()?;
        if !self.eval && r.segments.contains_key(&s) {
            return self.forward_segments(s, mb, inputs);
        }
        self.zero.ensure(r, s)?;
        let grad = !self.eval;
        let norm = if self.eval { NormStats::Running } else { NormStats::Batch { update: true } };
        let dropout = (!self.eval).then(|| self.dropout_key(mb));
        let (outputs, loss) = run_stage(r, s, &inputs, grad, norm, dropout, &self.micro[mb], &self.feeds[mb], self.loss_scale)?;
        if let Some(l) = &loss {
            self.count_loss(l)?;
        }
        self.state.insert((s, mb), MbState { inputs, outputs, loss, ..MbState::default() });
        Ok(())
    }

    /// The executor of stage `s` (its shard subgraph's under tensor parallelism) and the id
    /// there of each model value.
    fn stage_exec(&self, s: usize) -> (&'r Executor<'a>, impl Fn(ValueId) -> Result<ValueId, RuntimeError> + 'r) {
        let r = self.rank;
        let model = r.graph();
        let ex: &'r Executor<'a> = r.stage_execs.get(&s).unwrap_or(r.exec);
        let shard = r.stage_execs.contains_key(&s);
        let local = move |v: ValueId| {
            if !shard {
                return Ok(v);
            }
            let name = &model.value(v).name;
            ex.graph().value_by_name(name).ok_or_else(|| terr(format!("stage {s}'s shard subgraph has no value `{name}`")))
        };
        (ex, local)
    }

    /// The forward of a recomputed stage, segment by segment (per-layer recompute): a
    /// checkpointed layer runs without autograd and keeps its inputs (offloaded where the plan
    /// says), the other layers keep their autograd graphs.
    fn forward_segments(&mut self, s: usize, mb: usize, inputs: Vec<(ValueId, Tensor)>) -> Result<(), RuntimeError> {
        let r = self.rank;
        let segs = r.segments.get(&s).ok_or_else(|| terr(format!("stage {s}: recomputed, but no segments were laid out for it")))?;
        let (ex, local) = self.stage_exec(s);
        let back: Vec<ValueId> = if s == 0 { Vec::new() } else { r.layout.gradients_from_next[s - 1].iter().map(|&v| local(v)).collect::<Result<_, _>>()? };
        let mut received = Vec::new();
        let mut env: HashMap<ValueId, Tensor> = HashMap::new();
        for (v, t) in &inputs {
            received.push((*v, t.size(), t.kind(), t.device()));
            env.insert(local(*v)?, t.shallow_clone());
        }
        // a segment reads only its own inputs from outside it, so one map serves them all
        let mut feeds = self.local_feeds(mb, &local);
        ex.set_norm_stats(NormStats::Batch { update: true });
        ex.set_dropout_key(Some(self.dropout_key(mb)));
        // received values the previous stage wants no gradient of stay plain tensors
        let plain: BTreeSet<ValueId> = env.keys().copied().filter(|v| !back.contains(v)).collect();
        let mut parts = Vec::with_capacity(segs.segments.len());
        let mut kept_ids = BTreeSet::new();
        for (k, seg) in segs.segments.iter().enumerate() {
            let peak = memory::window_peak();
            self.zero.for_segment(r, s, k, Some(k + 1).filter(|&j| j < segs.segments.len()))?;
            let ins = segment_leaves(&env, &seg.inputs, |v| plain.contains(&v) || segs.no_gradient.contains(&v))?;
            feeds.extend(ins.iter().map(|(v, t)| (*v, t.shallow_clone())));
            if seg.checkpointed {
                let (mut stay, mut movable) = (Vec::new(), Vec::new());
                for (v, t) in ins.iter().filter(|(v, _)| kept_ids.insert(*v)) {
                    let d = t.f_detach()?;
                    if segs.movable.contains(v) { movable.push((*v, d)) } else { stay.push((*v, d)) }
                }
                self.offload.keep(s, mb, stay, movable)?;
                env.extend(tch::no_grad(|| ex.run_nodes(&seg.nodes, &feeds, &seg.outputs))?);
                parts.push(None);
            } else {
                // what rebuilding the selectively recomputed outputs reads is kept with them
                let mut keep = seg.outputs.clone();
                for &n in &seg.held {
                    keep.extend(ex.graph().node(n).outputs.iter().copied().filter(|v| !seg.outputs.contains(v)));
                }
                let mut inside = HashSet::new();
                // torchtitan's per-op policy rebuilds what a fused op keeps inside it with its output
                let per_op = r.parallel.selective_policy == crate::ir::SelectivePolicy::Ops;
                for &n in &seg.rebuilt {
                    let node = ex.graph().node(n);
                    if rebuilt_inside(node) {
                        inside.insert(node.name.clone());
                        continue;
                    }
                    if per_op && node.op.kind().is_some_and(crate::ir::OpKind::keeps_inside) {
                        inside.insert(node.name.clone());
                    }
                    for v in node.outputs.iter().chain(node.inputs.iter().flatten()) {
                        if !keep.contains(v) {
                            keep.push(*v);
                        }
                    }
                }
                let (outs, experts) = ex.setting_aside_experts(inside, || ex.run_nodes(&seg.nodes, &feeds, &keep));
                let mut outs = outs?;
                let rebuilt = set_aside(ex.graph(), &seg.rebuilt, &outs, &seg.outputs)?;
                for e in &experts {
                    e.free()?;
                }
                let held: Vec<Tensor> = seg.held.iter().flat_map(|&n| ex.graph().node(n).outputs.iter()).filter_map(|v| outs.get(v).map(Tensor::shallow_clone)).collect();
                outs.retain(|v, _| seg.outputs.contains(v));
                let outputs: Vec<(ValueId, Tensor)> = seg.outputs.iter().filter_map(|v| outs.get(v).map(|t| (*v, t.shallow_clone()))).collect();
                env.extend(outs);
                parts.push(Some(Part { inputs: ins, outputs, rebuilt, experts, _held: held }));
            }
            self.zero.note_peak(peak);
        }
        self.offload.end_forward(s, mb)?;
        let mut loss_in_segment = None;
        let (outputs, loss, loss_part) = if s == r.last_stage() {
            let ids = r.graph().outputs.iter().map(|&v| local(v)).collect::<Result<Vec<_>, _>>()?;
            loss_in_segment = segs.segments.iter().position(|seg| ids.iter().all(|v| seg.outputs.contains(v)));
            match loss_in_segment {
                Some(k) => {
                    let outs = ids.iter().map(|v| env.get(v).map(Tensor::shallow_clone).ok_or_else(|| terr(format!("stage {s} mb {mb}: a graph output was not computed")))).collect::<Result<Vec<_>, _>>()?;
                    let checkpointed = segs.segments[k].checkpointed;
                    let loss = if checkpointed {
                        // the loss's value alone: its backward recomputes it with the segment
                        tch::no_grad(|| self.microbatch_loss(mb, &outs))?
                    } else {
                        // the loss's graph continues the segment's: the outputs themselves are
                        // kept only where the loss's backward needs them
                        if let Some(Some(part)) = parts.get_mut(k) {
                            part.outputs.retain(|(v, _)| !ids.contains(v));
                        }
                        self.microbatch_loss(mb, &outs)?
                    };
                    self.count_loss(&loss)?;
                    (Vec::new(), (!checkpointed).then_some(loss), None)
                }
                None => {
                    let leaves = segment_leaves(&env, &ids, |_| false)?;
                    let outs: Vec<Tensor> = leaves.iter().map(|(_, t)| t.shallow_clone()).collect();
                    let loss = self.microbatch_loss(mb, &outs)?;
                    self.count_loss(&loss)?;
                    (Vec::new(), Some(loss), Some(Part { inputs: leaves, outputs: Vec::new(), rebuilt: Vec::new(), experts: Vec::new(), _held: Vec::new() }))
                }
            }
        } else {
            let outputs = r.layout.outputs_to_next[s]
                .iter()
                .map(|&v| {
                    let l = local(v)?;
                    env.get(&l).map(|t| (v, t.shallow_clone())).ok_or_else(|| terr(format!("stage {s} mb {mb}: `{}` was not computed", r.graph().value(v).name)))
                })
                .collect::<Result<_, RuntimeError>>()?;
            (outputs, None, None)
        };
        self.state.insert((s, mb), MbState { outputs, loss, parts, loss_part, loss_in_segment, received, plain, ..MbState::default() });
        Ok(())
    }

    /// Microbatch `mb`'s graph-input feeds in the ids `local` gives.
    fn local_feeds(&self, mb: usize, local: &impl Fn(ValueId) -> Result<ValueId, RuntimeError>) -> HashMap<ValueId, Tensor> {
        self.feeds[mb].iter().filter_map(|(v, t)| local(*v).ok().map(|l| (l, t.shallow_clone()))).collect()
    }

    /// The Dropout key of microbatch `mb` of this step: its first sample's index in the global
    /// batch, as one process numbers it.
    fn dropout_key(&self, mb: usize) -> DropoutKey {
        let r = self.rank;
        let share = r.data.global_batch() / r.data_dp as i64;
        let per = share / r.parallel.microbatches.max(1) as i64;
        DropoutKey { seed: r.cfg.seed, step: self.step as i64, first_sample: r.data_replica as i64 * share + mb as i64 * per }
    }

    fn backward(&mut self, s: usize, mb: usize) -> Result<(), RuntimeError> {
        let r = self.rank;
        let mut st = self.state.remove(&(s, mb)).ok_or_else(|| terr(format!("backward of stage {s} mb {mb} before its forward")))?;
        if r.segments.contains_key(&s) {
            return self.backward_segments(s, mb, st);
        }
        self.zero.ensure(r, s)?;
        let mut root: Option<Tensor> = st.loss.take().map(|l| self.backward_root(l)).transpose()?;
        if s != r.last_stage() {
            let gs = self.grad_for.remove(&(s, mb)).unwrap_or_default();
            // the plan's gradients_from_next: the floating-point values it sent, in order
            let want = &r.layout.gradients_from_next[s];
            let floats: Vec<&Tensor> = st.outputs.iter().filter(|(v, _)| want.contains(v)).map(|(_, t)| t).collect();
            if gs.len() != floats.len() {
                return Err(terr(format!("stage {s} mb {mb}: {} gradients for {} outputs", gs.len(), floats.len())));
            }
            for (o, g) in floats.into_iter().zip(&gs) {
                if o.requires_grad() {
                    let term = o.f_mul(g)?.f_sum(o.kind())?;
                    root = Some(match root {
                        Some(acc) => acc.f_add(&term)?,
                        None => term,
                    });
                }
            }
        }
        // the gradients this stage sends back: the previous stage's gradients_from_next
        let back: &[ValueId] = if s == 0 { &[] } else { &r.layout.gradients_from_next[s - 1] };
        let leaves: Vec<Tensor> = st.inputs.iter().filter(|(v, _)| back.contains(v)).map(|(_, t)| t.shallow_clone()).collect();
        let split = r.split_w.contains(&(s, mb));
        let mut in_grads: Vec<Tensor> = Vec::new();
        if let Some(root) = root.as_ref().filter(|t| t.requires_grad()) {
            let grad_leaves: Vec<&Tensor> = leaves.iter().filter(|t| t.requires_grad()).collect();
            let got: Vec<Option<Tensor>> = if split {
                // B of a split backward: the inputs' gradients alone; the graph stays for its W
                let got = if grad_leaves.is_empty() { Vec::new() } else { Tensor::f_run_backward(&[root], &grad_leaves, true, false)? };
                got.into_iter().map(|g| g.defined().then_some(g)).collect()
            } else {
                // the weights' gradients go into the accumulated ones as they are produced
                self.backward_into_params(&r.params.read[s], root, &grad_leaves)?;
                grad_leaves.iter().map(|t| grad::take_grad(t)).collect::<Result<_, _>>()?
            };
            let mut it = got.into_iter();
            for t in &leaves {
                let g = if t.requires_grad() { it.next().flatten() } else { None };
                in_grads.push(match g {
                    Some(g) => g,
                    None => t.f_zeros_like()?,
                });
            }
        } else {
            for t in &leaves {
                in_grads.push(t.f_zeros_like()?);
            }
        }
        if split {
            st.roots = root.into_iter().collect();
            self.state.insert((s, mb), st);
            self.pending_w.insert((s, mb));
        }
        if s > 0 {
            self.grad_for.insert((s - 1, mb), in_grads);
        }
        Ok(())
    }

    fn backward_weight(&mut self, s: usize, mb: usize) -> Result<(), RuntimeError> {
        let r = self.rank;
        let st = self.state.remove(&(s, mb)).ok_or_else(|| terr(format!("weight gradient of stage {s} mb {mb} before its backward")))?;
        self.pending_w.remove(&(s, mb));
        if let Some(segs) = r.segments.get(&s).filter(|_| st.root_segments.len() == st.roots.len()) {
            // segment by segment, as the B ran them: each with only its own layers gathered
            for (j, (root, &k)) in st.roots.iter().zip(&st.root_segments).enumerate() {
                self.zero.for_segment(r, s, k, st.root_segments.get(j + 1).copied())?;
                if root.requires_grad() {
                    self.backward_into_params(&segs.segments[k].params, root, &[])?;
                }
            }
            return Ok(());
        }
        self.zero.ensure(r, s)?;
        for root in st.roots.iter().filter(|t| t.requires_grad()) {
            self.backward_into_params(&r.params.read[s], root, &[])?;
        }
        Ok(())
    }

    /// The backward of a recomputed stage, segment by segment from the last: a checkpointed
    /// segment is recomputed from its kept inputs first; each segment's inputs' gradients go to
    /// the segments that made them, the received ones' back to the previous stage. Under a
    /// split backward (ZB-H1) only the inputs' gradients are taken, each segment's root kept
    /// for the W, except in a checkpointed segment, whose whole backward runs in the B.
    fn backward_segments(&mut self, s: usize, mb: usize, mut st: MbState) -> Result<(), RuntimeError> {
        let r = self.rank;
        let segs = r.segments.get(&s).ok_or_else(|| terr(format!("stage {s}: recomputed, but no segments were laid out for it")))?;
        let (ex, local) = self.stage_exec(s);
        let recomputes = segs.segments.iter().any(|seg| seg.checkpointed);
        let kept: HashMap<ValueId, Tensor> = if recomputes { self.offload.take(s, mb)?.into_iter().collect() } else { HashMap::new() };
        let split = r.split_w.contains(&(s, mb));
        let mut grads: HashMap<ValueId, Tensor> = HashMap::new();
        let mut roots = Vec::new();
        let mut root_segments = Vec::new();
        if let Some(part) = st.loss_part.take() {
            let root = st.loss.take().map(|l| self.backward_root(l)).transpose()?;
            // the loss reads no parameter: nothing of it waits for a W
            self.segment_backward(root, (&part.inputs, &[]), split, &mut grads, &mut Vec::new())?;
        }
        if s != r.last_stage() {
            let gs = self.grad_for.remove(&(s, mb)).unwrap_or_default();
            let want = &r.layout.gradients_from_next[s];
            if gs.len() != want.len() {
                return Err(terr(format!("stage {s} mb {mb}: {} gradients for {} outputs", gs.len(), want.len())));
            }
            for (v, g) in want.iter().zip(gs) {
                add_grad(&mut grads, local(*v)?, g)?;
            }
        }
        let mut feeds = self.local_feeds(mb, &local);
        ex.set_norm_stats(NormStats::Batch { update: false });
        ex.set_dropout_key(Some(self.dropout_key(mb)));
        for (i, seg) in segs.segments.iter().enumerate().rev() {
            let peak = memory::window_peak();
            self.zero.for_segment(r, s, i, i.checked_sub(1))?;
            let part = match st.parts.get_mut(i).and_then(Option::take) {
                Some(p) => p,
                None => {
                    let ins = segment_leaves(&kept, &seg.inputs, |v| st.plain.contains(&v) || segs.no_gradient.contains(&v))?;
                    feeds.extend(ins.iter().map(|(v, t)| (*v, t.shallow_clone())));
                    let outs = ex.run_nodes(&seg.nodes, &feeds, &seg.outputs)?;
                    let outputs = seg.outputs.iter().filter_map(|v| outs.get(v).map(|t| (*v, t.shallow_clone()))).collect();
                    Part { inputs: ins, outputs, rebuilt: Vec::new(), experts: Vec::new(), _held: Vec::new() }
                }
            };
            rebuild(ex, &part.rebuilt)?;
            for e in &part.experts {
                e.rebuild()?;
            }
            let mut root: Option<Tensor> = None;
            if st.loss_in_segment == Some(i) {
                let loss = match st.loss.take() {
                    // taken with its graph in the forward
                    Some(l) => l,
                    None => {
                        let ids = r.graph().outputs.iter().map(|&v| local(v)).collect::<Result<Vec<_>, _>>()?;
                        let outs = ids
                            .iter()
                            .map(|v| part.outputs.iter().find(|(w, _)| w == v).map(|(_, t)| t.shallow_clone()).ok_or_else(|| terr(format!("stage {s} mb {mb}: a graph output was not recomputed"))))
                            .collect::<Result<Vec<_>, _>>()?;
                        self.microbatch_loss(mb, &outs)?
                    }
                };
                root = Some(self.backward_root(loss)?);
            }
            for (v, o) in part.outputs.iter().filter(|(_, o)| o.requires_grad()) {
                if let Some(g) = grads.remove(v) {
                    let term = o.f_mul(&g)?.f_sum(o.kind())?;
                    root = Some(match root {
                        Some(acc) => acc.f_add(&term)?,
                        None => term,
                    });
                }
            }
            // A recomputed segment's weight gradients are taken in its B, not left for the W:
            // its recomputed activations would otherwise live to the W, where the plan counts
            // its inputs alone (and they free as this B ends).
            let kept = roots.len();
            self.segment_backward(root, (&part.inputs, &seg.params), split && !seg.checkpointed, &mut grads, &mut roots)?;
            root_segments.extend(std::iter::repeat_n(i, roots.len() - kept));
            self.zero.note_peak(peak);
        }
        // the recompute has read its kept inputs
        drop(kept);
        if recomputes {
            self.offload.release_taken();
        }
        let mut in_grads = Vec::new();
        if s > 0 {
            for &v in &r.layout.gradients_from_next[s - 1] {
                let (_, shape, kind, device) = st.received.iter().find(|(w, ..)| *w == v).ok_or_else(|| terr(format!("stage {s} mb {mb}: `{}` was not received", r.graph().value(v).name)))?;
                in_grads.push(match grads.remove(&local(v)?) {
                    Some(g) => g,
                    None => Tensor::f_zeros(shape.as_slice(), (*kind, *device))?,
                });
            }
            self.grad_for.insert((s - 1, mb), in_grads);
        }
        if split {
            self.state.insert((s, mb), MbState { roots, root_segments, ..MbState::default() });
            self.pending_w.insert((s, mb));
        }
        Ok(())
    }

    /// One segment's backward from `root` (if any flows): its inputs' gradients added into
    /// `grads`; the gradients of the parameters it reads (positions `params`) accumulated too,
    /// or under a split backward `root` kept in `roots` for the W.
    fn segment_backward(&mut self, root: Option<Tensor>, (inputs, params): (&[(ValueId, Tensor)], &[usize]), split: bool, grads: &mut HashMap<ValueId, Tensor>, roots: &mut Vec<Tensor>) -> Result<(), RuntimeError> {
        let Some(root) = root.filter(|t| t.requires_grad()) else { return Ok(()) };
        let leaves: Vec<(ValueId, &Tensor)> = inputs.iter().filter(|(_, t)| t.requires_grad()).map(|(v, t)| (*v, t)).collect();
        let refs: Vec<&Tensor> = leaves.iter().map(|(_, t)| *t).collect();
        let got: Vec<Option<Tensor>> = if split {
            let got = if refs.is_empty() { Vec::new() } else { Tensor::f_run_backward(&[&root], &refs, true, false)? };
            roots.push(root);
            got.into_iter().map(|g| g.defined().then_some(g)).collect()
        } else {
            self.backward_into_params(params, &root, &refs)?;
            refs.iter().map(|t| grad::take_grad(t)).collect::<Result<_, _>>()?
        };
        for ((v, _), g) in leaves.iter().zip(got) {
            if let Some(g) = g {
                add_grad(grads, *v, g)?;
            }
        }
        Ok(())
    }

    /// Backward from `root` into the leaves `extra` (left in their `.grad`) and the parameters
    /// at positions `mine`, whose gradients accumulate in place into `self.grads`: each accumulated
    /// gradient is made its parameter's `.grad` for the pass (moved, not copied), so autograd
    /// adds each fresh gradient into it as soon as it is produced and frees it (PyTorch's
    /// AccumulateGrad: later ones are added in place), then taken back. A parameter's first
    /// gradient of the step goes into its storage from the last step, zeroed (kept in the
    /// pool meanwhile), or is kept as produced on the first step. The stage holds one copy of
    /// its gradients, plus one fresh parameter gradient in flight.
    fn backward_into_params(&mut self, mine: &[usize], root: &Tensor, extra: &[&Tensor]) -> Result<(), RuntimeError> {
        let r = self.rank;
        let mut in_flight = 0;
        // pooled storage lent as a `.grad` this pass, with its version once zeroed
        let mut lent: Vec<(usize, Tensor, i64)> = Vec::new();
        for &i in mine {
            let p = &r.params.tensors[i];
            let g = match self.grads[i].take() {
                Some(g) => Some(g),
                None => self.zero.pooled_grad(i)?.map(|g| -> Result<Tensor, RuntimeError> {
                    lent.push((i, g.shallow_clone(), g.f_internal_version()?));
                    Ok(g)
                }).transpose()?,
            };
            if let Some(g) = &g {
                in_flight = in_flight.max(bytes_of(g));
            }
            grad::set_grad(p, g.as_ref())?;
        }
        let mut inputs: Vec<&Tensor> = extra.to_vec();
        inputs.extend(mine.iter().map(|&i| &r.params.tensors[i]));
        let done = grad::backward_into(root, &inputs, false);
        // the gradients come back to the store even when the pass failed
        for &i in mine {
            self.grads[i] = grad::take_grad(&r.params.tensors[i])?;
        }
        // lent storage that no gradient reached (same tensor, unchanged since zeroed) goes
        // back to the pool: the parameter still has no gradient this step, as in PyTorch
        for (i, g, version) in lent {
            let untouched = match &self.grads[i] {
                Some(now) => now.data_ptr() == g.data_ptr() && now.f_internal_version()? == version,
                None => false,
            };
            if untouched {
                self.grads[i] = None;
                self.zero.return_grad(i, g);
            }
        }
        done?;
        // a fresh gradient beside the accumulated ones, one parameter at a time
        self.observe_with_grads(in_flight);
        Ok(())
    }

    fn send(&mut self, peer: usize, what: Payload, s: usize, mb: usize) -> Result<(), RuntimeError> {
        let world = &self.rank.groups.world;
        let ts: Vec<Tensor> = match what {
            Payload::Activation => self
                .state
                .get(&(s, mb))
                .ok_or_else(|| terr(format!("send of stage {s} mb {mb} before its forward")))?
                .outputs
                .iter()
                .map(|(_, t)| t.shallow_clone())
                .collect(),
            Payload::Gradient => {
                self.grad_for.remove(&(s - 1, mb)).ok_or_else(|| terr(format!("gradient send of stage {s} mb {mb} before its backward")))?
            }
        };
        // one header describing every tensor, then the tensors: the receiver posts all of their
        // receives at once, so the message costs one round trip, not one per tensor
        let ts: Vec<Tensor> = ts.iter().map(|t| t.f_detach()?.f_contiguous()).collect::<Result<_, _>>()?;
        let mut header = vec![0i64; header_len(ts.len())];
        header[0] = ts.len() as i64;
        for (j, t) in ts.iter().enumerate() {
            let size = t.size();
            if size.len() > MAX_RANK {
                return Err(terr(format!("cannot send a rank-{} tensor (at most {MAX_RANK} axes)", size.len())));
            }
            let w = &mut header[1 + j * WORDS..1 + (j + 1) * WORDS];
            w[0] = kind_code(t.kind())?;
            w[1] = size.len() as i64;
            w[2..2 + size.len()].copy_from_slice(&size);
        }
        let at = self.at;
        self.pending.push((at, world.isend(&Tensor::from_slice(&header), peer, tag(what, s, mb, 0))?));
        for (j, t) in ts.iter().enumerate() {
            self.pending.push((at, world.isend(t, peer, tag(what, s, mb, j + 1))?));
        }
        if what == Payload::Activation
            && let Some(st) = self.state.get_mut(&(s, mb))
        {
            if self.rank.segments.contains_key(&s) {
                // a segmented stage's backward reads its outputs' gradients, never the outputs:
                // the send holds them until its peer has them
                st.outputs.clear();
            } else {
                // the backward starts from the outputs whose gradients come back; the others
                // (masks, positions, rotary tables) are the peer's once sent
                let back = &self.rank.layout.gradients_from_next[s];
                st.outputs.retain(|(v, _)| back.contains(v));
            }
        }
        Ok(())
    }

    /// The stage whose message a Recv of `what` for stage `s` takes (the sender tags with its
    /// own stage), and how many tensors it holds.
    fn message_of(&self, what: Payload, s: usize) -> (usize, usize) {
        let layout = &self.rank.layout;
        match what {
            Payload::Activation => (s - 1, layout.outputs_to_next[s - 1].len()),
            Payload::Gradient => (s + 1, layout.gradients_from_next[s].len()),
        }
    }

    /// Posts the header receive of every message the program receives in this pass (`eval`:
    /// activations only), so each header lands as soon as its sender posts it.
    fn post_headers(&mut self, forward_only: bool) -> Result<(), RuntimeError> {
        let r = self.rank;
        self.headers.clear();
        for instr in &r.program.instrs {
            if let Instr::Recv { from: peer, what, stage, mb, .. } = *instr {
                if forward_only && what != Payload::Activation {
                    continue;
                }
                let (from, count) = self.message_of(what, stage);
                let buf = Tensor::f_zeros([header_len(count) as i64], (Kind::Int64, tch::Device::Cpu))?;
                let work = r.groups.world.irecv(&buf, peer, tag(what, from, mb, 0))?;
                self.headers.insert((what, stage, mb), work);
            }
        }
        Ok(())
    }

    fn recv(&mut self, peer: usize, what: Payload, s: usize, mb: usize) -> Result<(), RuntimeError> {
        let r = self.rank;
        if what == Payload::Gradient {
            self.state.get(&(s, mb)).ok_or_else(|| terr(format!("gradient for stage {s} mb {mb} before its forward")))?;
        }
        let (from, count) = self.message_of(what, s);
        let world = &r.groups.world;
        // posted when the pass started (`post_headers`), like every receive of the program
        let header = self.headers.remove(&(what, s, mb)).ok_or_else(|| terr(format!("stage {s} mb {mb}: a second receive of the same {what:?} message")))?;
        let header: Vec<i64> = Vec::<i64>::try_from(&header.wait()?).map_err(|e| terr(e.to_string()))?;
        if header[0] != count as i64 {
            return Err(terr(format!("stage {s} mb {mb}: a message of {} tensors arrived from stage {from}, {count} expected", header[0])));
        }
        let mut works = Vec::with_capacity(count);
        for j in 0..count {
            let w = &header[1 + j * WORDS..1 + (j + 1) * WORDS];
            let rank = w[1].clamp(0, MAX_RANK as i64) as usize;
            // on the rank's device (a GPU's tensors travel through host copies)
            let buf = Tensor::f_empty(&w[2..2 + rank], (code_kind(w[0])?, r.params.opts.1))?;
            works.push(world.irecv(&buf, peer, tag(what, from, mb, j + 1))?);
        }
        let got = works.into_iter().map(|w| w.wait()).collect::<Result<Vec<_>, _>>()?;
        match what {
            Payload::Activation => self.act_in.insert((s, mb), got),
            Payload::Gradient => self.grad_for.insert((s, mb), got),
        };
        Ok(())
    }

    /// Sums a tied weight's gradient over the pipeline ranks reading it, or a stage's
    /// gradients over its data-parallel group.
    fn all_reduce(&mut self, g: &[usize], purpose: &Purpose) -> Result<(), RuntimeError> {
        let r = self.rank;
        let pg = r.groups.get(g)?;
        match purpose {
            Purpose::TiedGrad { weight } => {
                let v = r.graph().value_by_name(weight).ok_or_else(|| terr(format!("tied weight `{weight}` is not in the model")))?;
                let i = *r.params.pos_of.get(&v).ok_or_else(|| terr(format!("tied weight `{weight}` is not on rank {}", r.global_rank)))?;
                let g = match self.grads[i].take() {
                    Some(g) => g.f_contiguous()?,
                    None => r.params.zeros(i)?,
                };
                pg.all_reduce_sum(&g)?;
                self.grads[i] = Some(g);
                Ok(())
            }
            Purpose::DpGrads { .. } => {
                let s = r.stage_of(purpose)?;
                self.zero.all_reduce_grads(r, pg, s, &mut self.grads, &mut self.tally)
            }
            _ => Err(terr(format!("all-reduce for `{purpose}`, which is no all-reduce"))),
        }
    }

    /// Reduce-scatters a stage's gradients over its data-parallel (or sharding) group: at the
    /// step's end, or those of the microbatches so far after a backward.
    fn reduce_scatter(&mut self, g: &[usize], purpose: &Purpose) -> Result<(), RuntimeError> {
        let r = self.rank;
        let step_end = match purpose {
            Purpose::DpGrads { .. } => true,
            Purpose::MicrobatchGrads { .. } => false,
            _ => return Err(terr(format!("reduce-scatter for `{purpose}`, which is no reduce-scatter"))),
        };
        let s = r.stage_of(purpose)?;
        let pg = r.groups.get(g)?;
        if step_end {
            self.zero.reduce_scatter_grads(r, pg, s, &mut self.grads, &mut self.tally)
        } else {
            self.zero.reduce_scatter_microbatch(r, pg, s, &mut self.grads, &mut self.tally)
        }
    }

    /// Gathers a stage's ZeRO-3 parameters before its use, or its updated ZeRO-1/2 blocks
    /// after the optimizer step.
    fn all_gather(&mut self, g: &[usize], purpose: &Purpose) -> Result<(), RuntimeError> {
        let r = self.rank;
        match purpose {
            Purpose::Zero3Params { .. } => {
                let s = r.stage_of(purpose)?;
                // a segmented stage's passes gather each layer's parameters for its segment
                if self.eval || !r.segments.contains_key(&s) { self.zero.ensure(r, s) } else { Ok(()) }
            }
            Purpose::ZeroParams { .. } => {
                let s = r.stage_of(purpose)?;
                self.zero.gather_params(r, r.groups.get(g)?, s, &self.grads, &mut self.tally)
            }
            _ => Err(terr(format!("all-gather for `{purpose}`, which is no all-gather"))),
        }
    }

    /// Waits for the sends, sums the squared gradient norm and the loss over the world,
    /// clips, and steps every optimizer.
    fn optimizer_step(&mut self) -> Result<(), RuntimeError> {
        let r = self.rank;
        self.wait_sends()?;
        let _guard = tch::no_grad_guard();
        for &s in &r.experts_summed_at_step {
            super::zero::reduce_experts(r, s, &mut self.grads)?;
        }
        // fp16: gradients unscaled before the norm; inf/NaN on any rank skips the step on all
        let mut found_inf = false;
        if let Some(sc) = &self.scaler {
            let held: Vec<Tensor> = self.grads.iter().flatten().map(Tensor::shallow_clone).collect();
            found_inf = train::amp::unscale(&held, sc.scale())?;
            found_inf |= self.zero.unscale_grads(sc.scale())?;
        }
        // squared norm of the gradients this rank counts, and its loss share
        let mut sq = self.zero.grad_sq(r)?;
        for (i, (g, &c)) in self.grads.iter().zip(&r.params.counted).enumerate() {
            if let (Some(g), true) = (g, c && r.writes_replica(i)) {
                let n = g.f_norm()?.f_double_value(&[])?;
                sq += n * n;
            }
        }
        let both = Tensor::from_slice(&[if found_inf { 0.0 } else { sq }, self.loss_sum, if found_inf { 1.0 } else { 0.0 }]);
        r.groups.world.all_reduce_sum(&both)?;
        let both: Vec<f64> = Vec::<f64>::try_from(&both).map_err(|e| terr(e.to_string()))?;
        self.loss_sum = both[1];
        if let Some(sc) = self.scaler.as_mut() {
            let found_inf = both[2] > 0.0;
            sc.update(found_inf);
            if found_inf {
                // GradScaler.step: no update on any rank
                self.skipped = true;
                self.zero.drop_grads();
                return Ok(());
            }
        }
        let coef = r.cfg.clip.map(|c| (c / (both[0].sqrt() + 1e-6)).min(1.0));
        if let Some(c) = coef {
            for g in self.grads.iter_mut().flatten() {
                let _ = g.f_mul_scalar_(c)?;
            }
        }
        self.adamw_steps += 1;
        self.zero.step(r, &self.grads, coef, r.cfg.schedule.lr(self.step))
    }
}
/// The rank's step in the one training loop: its program run once, forward-only passes for
/// validation, and its part of each checkpoint.
impl StepRunner for Interp<'_, '_> {
    /// Runs the program once: one training step.
    fn run_step(&mut self, step: usize) -> Result<StepRecord, RuntimeError> {
        let r = self.rank;
        let t0 = Instant::now();
        let c0 = train::process_cpu_s();
        let waited0 = crate::runtime::comm::wait_s();
        self.step = step;
        self.skipped = false;
        let loss_scale = self.scaler.as_ref().map(LossScaler::scale);
        self.broadcast_buffers()?;
        (self.micro, self.feeds) = r.batches(r.data, step)?;
        self.loss_scale = self.loss_scale_of(r.data, step)?;
        self.zero.pool_grads(&mut self.grads, r.params.tensors.len());
        self.state.clear();
        self.act_in.clear();
        self.grad_for.clear();
        self.loss_sum = 0.0;
        self.pending_w.clear();
        self.offload.start_step();
        self.kv_done = r.kv_groups.is_empty();
        self.phases = PhaseTimes::default();
        self.post_headers(false)?;
        self.observe();
        if self.steps_run == 1 {
            // the first step (warm-up: the optimizer's moments are made in its update) is not
            // counted when later steps run, as in the step times
            self.tally.memory = memory::PeakTracker::default();
        }
        // the state held now (summing it walks every tensor: once per instruction)
        let mut held = self.zero.held(&r.params, &self.grads);
        self.tally.memory.start_step(held, self.offload.pool.host);
        for (k, instr) in r.program.instrs.iter().enumerate() {
            self.at = k;
            if !self.kv_done && matches!(instr, Instr::AllReduce { .. } | Instr::ReduceScatter { .. } | Instr::OptimizerStep) {
                let t = Instant::now();
                self.sum_kv_slices()?;
                self.phases.collective_s += t.elapsed().as_secs_f64();
                held = self.zero.held(&r.params, &self.grads);
            }
            let (t, waited) = (Instant::now(), crate::runtime::comm::wait_s());
            let opened = held;
            self.zero.gathered_at_peak = 0;
            let live_before = memory::Window::open();
            self.exec(instr)?;
            if instr.is_compute() {
                r.wait_for_device();
            }
            if matches!(instr, Instr::Recv { .. }) {
                self.reap_sends(k)?;
            }
            let mut spent = t.elapsed().as_secs_f64();
            let p = &mut self.phases;
            if instr.is_compute() {
                // tensor-parallel collectives and ZeRO-3 gathers inside the passes
                let in_collectives = (crate::runtime::comm::wait_s() - waited).min(spent);
                p.collective_s += in_collectives;
                spent -= in_collectives;
            }
            *match instr {
                Instr::Forward { .. } | Instr::Backward { .. } | Instr::BackwardWeight { .. } => &mut p.compute_s,
                Instr::Send { .. } => &mut p.send_s,
                Instr::Recv { .. } => &mut p.recv_s,
                Instr::AllReduce { .. } | Instr::ReduceScatter { .. } | Instr::AllGather { .. } => &mut p.collective_s,
                Instr::OptimizerStep => &mut p.optimizer_s,
            } += spent;
            let window = memory::Window::close(live_before);
            held = self.zero.held(&r.params, &self.grads);
            self.tally.observe(held);
            // the ZeRO-3 units gathered inside the instruction's passes when its peak rose
            let at_peak = self.zero.gathered_at_peak;
            let gathered = |mut b: super::report::StateBytes| {
                b.params += at_peak;
                b
            };
            self.tally.memory.observe(window, self.offload.pool.host, (gathered(opened), gathered(held)));
            if r.parallel.params_sharded() && instr.is_compute() {
                // release what no pending weight gradient still needs
                self.zero.release(r)?;
                held = self.zero.held(&r.params, &self.grads);
            }
        }
        let t = Instant::now();
        self.wait_sends()?;
        self.phases.send_s += t.elapsed().as_secs_f64();
        // the first step (warm-up) is not counted, as in the step times
        if self.steps_run > 0 {
            self.tally.phases.add(&self.phases);
        }
        self.steps_run += 1;
        self.tally.kept = self.offload.pool;
        self.zero.release(r)?;
        self.tally.resident = self.zero.held(&r.params, &[]).params;
        let loss = self.loss_sum;
        let time_s = t0.elapsed().as_secs_f64();
        let cpu_s = train::process_cpu_s() - c0;
        let named = self.stragglers.after_step(&r.groups.world, step, time_s, crate::runtime::comm::wait_s() - waited0)?;
        let mut line = String::new();
        if r.opts.progress {
            line += &format!("[rank {}] step {step} loss {loss:.6}\n", r.global_rank);
        }
        if r.global_rank == 0 {
            // named in the progress line, with or without --progress
            for s in &named {
                line += &format!("[rank {}] step {step} {}\n", r.global_rank, straggler::describe(s));
            }
        }
        if !line.is_empty() {
            // one write: ranks share the launcher's stderr
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        }
        Ok(StepRecord { step, loss, time_s, cpu_s, lr: r.cfg.schedule.lr(step), loss_scale, skipped: self.skipped })
    }

    /// The mean loss over the world of `batches` batches of `data`, forward only: the
    /// program's forwards, activation messages and ZeRO-3 gathers, in program order.
    fn run_eval(&mut self, data: &DataSource, batches: usize) -> Result<f64, RuntimeError> {
        let r = self.rank;
        self.eval = true;
        let mut sum = 0.0;
        self.broadcast_buffers()?;
        let result = (|| {
            for k in 1..=batches {
                (self.micro, self.feeds) = r.batches(data, k)?;
                self.loss_scale = self.loss_scale_of(data, k)?;
                self.state.clear();
                self.act_in.clear();
                self.loss_sum = 0.0;
                self.post_headers(true)?;
                for (k, instr) in r.program.instrs.iter().enumerate() {
                    self.at = k;
                    let forward_only = match instr {
                        Instr::Forward { .. } => true,
                        Instr::Send { what, .. } | Instr::Recv { what, .. } => *what == Payload::Activation,
                        Instr::AllGather { purpose, .. } => matches!(purpose, Purpose::Zero3Params { .. }),
                        _ => false,
                    };
                    if !forward_only {
                        continue;
                    }
                    self.exec(instr)?;
                    if r.parallel.params_sharded() && instr.is_compute() {
                        self.zero.release(r)?;
                    }
                }
                self.wait_sends()?;
                sum += self.loss_sum;
            }
            self.zero.release(r)?;
            Ok::<(), RuntimeError>(())
        })();
        self.eval = false;
        self.state.clear();
        result?;
        let total = Tensor::from_slice(&[sum]);
        r.groups.world.all_reduce_sum(&total)?;
        Ok(total.f_double_value(&[0])? / batches.max(1) as f64)
    }

    /// This rank's parameters and moments (its tensor-parallel cut, or its ZeRO block) with
    /// where each lies in the whole tensor, and the module buffers whose live copy it holds.
    fn checkpoint_pieces(&self) -> Result<Vec<Piece>, RuntimeError> {
        let rank = self.rank;
        let graph = rank.graph();
        let ids = rank.param_ids();
        let mut pieces = Vec::new();
        for lp in self.zero.pieces(rank)? {
            let v = ids[lp.pos];
            let val = graph.value(v);
            let shape = val.data.as_ref().map(|d| d.dims.clone()).ok_or_else(|| terr(format!("parameter `{}` has no data to checkpoint", val.name)))?;
            let slice = Slice { flat: lp.flat, ..rank.part_of(v) };
            pieces.push(Piece { name: param_name(graph, v), role: lp.role, shape, transposed: is_transposed(graph, v), slice, tensor: lp.tensor });
        }
        pieces.extend(checkpoint::buffer_pieces(graph, |v| rank.live_buffer(v))?);
        Ok(pieces)
    }

    fn rank(&self) -> usize {
        self.rank.global_rank
    }

    fn world(&self) -> usize {
        self.rank.world
    }

    fn barrier(&self) -> Result<(), RuntimeError> {
        Ok(self.rank.groups.world.barrier()?)
    }

    fn optimizer_progress(&self, _step: usize) -> OptimizerProgress {
        OptimizerProgress { adamw_steps: self.adamw_steps, loss_scale: self.scaler.as_ref().map(LossScaler::state) }
    }

    fn leaving(&self) -> Option<Leave> {
        self.stragglers.leave.clone()
    }

    fn agree(&self, ok: bool) -> Result<bool, RuntimeError> {
        let failed = Tensor::from_slice(&[if ok { 0.0f64 } else { 1.0 }]);
        self.rank.groups.world.all_reduce_sum(&failed)?;
        Ok(failed.f_double_value(&[0])? == 0.0)
    }
}


/// Runs stage `s` on one microbatch with `inputs` from the previous stage (autograd on when
/// `grad`), the microbatch's arrays `batch` and graph-input feeds `given`: its outputs to the
/// next stage, or on the last stage the loss summed over the microbatch's targets times
/// `loss_scale`. BatchNormalization uses the statistics `norm` says.
#[allow(clippy::too_many_arguments)]
fn run_stage(
    r: &Rank<'_>,
    s: usize,
    inputs: &[(ValueId, Tensor)],
    grad: bool,
    norm: NormStats,
    dropout: Option<DropoutKey>,
    batch: &Batch,
    given: &HashMap<ValueId, Tensor>,
    loss_scale: f64,
) -> Result<(Vec<(ValueId, Tensor)>, Option<Tensor>), RuntimeError> {
    let graph = r.graph();
    let mut feeds: HashMap<ValueId, Tensor> = given.iter().map(|(k, v)| (*k, v.shallow_clone())).collect();
    for (v, t) in inputs {
        feeds.insert(*v, t.shallow_clone());
    }
    let last = s == r.last_stage();
    let keep: Vec<ValueId> = if last { graph.outputs.clone() } else { r.layout.outputs_to_next[s].clone() };
    let outs = match r.stage_execs.get(&s) {
        None => {
            r.exec.set_norm_stats(norm);
            r.exec.set_dropout_key(dropout);
            let run = || r.exec.run_nodes(&r.layout.nodes[s], &feeds, &keep);
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
            se.set_norm_stats(norm);
            se.set_dropout_key(dropout);
            let run = || se.run_nodes(&order, &feeds, &lkeep);
            let outs = if grad { run()? } else { tch::no_grad(run)? };
            keep.iter().zip(&lkeep).map(|(v, l)| (*v, outs[l].shallow_clone())).collect()
        }
    };
    if last {
        let outs: Vec<Tensor> = keep.iter().map(|v| outs[v].shallow_clone()).collect();
        Ok((Vec::new(), Some(scaled_loss(r, batch, &outs, loss_scale)?)))
    } else {
        Ok((keep.iter().map(|v| (*v, outs[v].shallow_clone())).collect(), None))
    }
}

/// A microbatch's summed loss over `batch` from the graph's outputs `outs`, weighted by the
/// step's `loss_scale` (1 / its counted targets).
fn scaled_loss(r: &Rank<'_>, batch: &Batch, outs: &[Tensor], loss_scale: f64) -> Result<Tensor, RuntimeError> {
    Ok(train::loss_sum_of(r.exec, r.cfg.loss, batch, outs)?.f_mul_scalar(loss_scale)?)
}

/// Adds `g` into the gradient of `v`.
fn add_grad(grads: &mut HashMap<ValueId, Tensor>, v: ValueId, g: Tensor) -> Result<(), RuntimeError> {
    let sum = match grads.remove(&v) {
        Some(acc) => acc.f_add(&g)?,
        None => g,
    };
    grads.insert(v, sum);
    Ok(())
}

/// `ids`' tensors in `env` as fresh autograd leaves: floating-point ones require gradients
/// unless `plain` says otherwise.
fn segment_leaves(env: &HashMap<ValueId, Tensor>, ids: &[ValueId], plain: impl Fn(ValueId) -> bool) -> Result<Vec<(ValueId, Tensor)>, RuntimeError> {
    ids.iter()
        .map(|&v| {
            let t = env.get(&v).ok_or_else(|| terr(format!("a recomputed segment reads value {v:?}, which no earlier segment made")))?;
            let leaf = t.f_detach()?;
            let leaf = if is_float(&leaf) && !plain(v) { leaf.f_set_requires_grad(true)? } else { leaf };
            Ok((v, leaf))
        })
        .collect()
}

/// The most axes a sent tensor may have.
const MAX_RANK: usize = 8;
/// Header words per tensor of a message: kind code, rank, dims (padded to [`MAX_RANK`]).
const WORDS: usize = 2 + MAX_RANK;

/// Header length of a message of `count` tensors: the count, then each tensor's words.
fn header_len(count: usize) -> usize {
    1 + count * WORDS
}

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

/// The message tag of part `j` of a payload of `stage`'s microbatch `mb`: 0 the header, then
/// the tensors from 1.
fn tag(what: Payload, stage: usize, mb: usize, j: usize) -> u32 {
    let w = usize::from(what == Payload::Gradient);
    ((((w * 64 + stage % 64) * 1024 + mb % 1024) * 1024) + j % 1024) as u32
}

fn is_float(t: &Tensor) -> bool {
    matches!(t.kind(), Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16)
}
