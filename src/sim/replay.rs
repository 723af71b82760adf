//! Discrete-event replay of per-rank programs.
//!
//! Semantics (the same the runner implements):
//! - compute (F, B, W, optimizer step) runs one at a time per rank, for the duration given;
//! - a `Send` is posted without blocking the rank; its message arrives `duration(Send)` later
//!   (no link contention is modelled; outstanding sends are unbounded and reported per rank);
//! - a `Recv` blocks until its message has arrived;
//! - a collective starts when the last member of its group reaches it and ends
//!   `duration` later on every member (members match by tag, group and order of occurrence);
//! - `F(s, mb)` for s > 0 needs the activation of stage s, from a `Recv` or from `F(s−1, mb)`
//!   on the same rank; `B(s, mb)` needs `F(s, mb)` and, unless s is the last stage, the
//!   gradient from a `Recv` or from `B(s+1, mb)` on the same rank; `W(s, mb)` needs `B(s, mb)`.
//! - `B` is the input-gradient half when the rank's program has a `W` for the same stage and
//!   microbatch; otherwise it is the whole backward and lasts `duration(B) + duration(W)`.
//! - activations: `activation_bytes(rank, stage)` is allocated when `F` starts and freed when
//!   `W` (or, without a `W`, `B`) ends.
//!
//! Times are a pure function of the programs and durations (dataflow), independent of the
//! order the simulator visits ranks in.

use std::collections::{HashMap, HashSet};

use crate::codegen::{Instr, Payload, Purpose, RankProgram};
use crate::cost::{CommModel, GroupSpan};

/// Durations (seconds) and activation sizes the simulator uses.
pub trait Durations {
    /// How long `instr` takes on `rank` (for `Send`: until the message arrives).
    fn duration(&self, rank: usize, instr: &Instr) -> f64;
    /// Activation bytes one microbatch of `stage` keeps on `rank` (default 1: counts).
    fn activation_bytes(&self, _rank: usize, _stage: usize) -> f64 {
        1.0
    }
}

impl<F: Fn(usize, &Instr) -> f64> Durations for F {
    fn duration(&self, rank: usize, instr: &Instr) -> f64 {
        self(rank, instr)
    }
}

/// A cost table: per-stage compute times and activation sizes, messages and collectives
/// priced by the alpha-beta model.
#[derive(Clone, Debug, PartialEq)]
pub struct CostTable {
    /// Forward time per stage for one microbatch.
    pub forward: Vec<f64>,
    /// Input-gradient backward time per stage (the whole backward minus `backward_weight`).
    pub backward_input: Vec<f64>,
    /// Weight-gradient backward time per stage.
    pub backward_weight: Vec<f64>,
    /// Activation bytes per stage and microbatch.
    pub activation_bytes: Vec<f64>,
    /// Link model for sends and collectives; `None` makes communication free.
    pub comm: Option<CommModel>,
    /// Optimizer step time.
    pub optimizer: f64,
}

impl CostTable {
    /// Equal stages: every stage takes `f`, `b_input`, `b_weight` and keeps 1 unit of
    /// activations; communication free.
    pub fn uniform(stages: usize, f: f64, b_input: f64, b_weight: f64) -> CostTable {
        CostTable {
            forward: vec![f; stages],
            backward_input: vec![b_input; stages],
            backward_weight: vec![b_weight; stages],
            activation_bytes: vec![1.0; stages],
            comm: None,
            optimizer: 0.0,
        }
    }
}

impl Durations for CostTable {
    fn duration(&self, rank: usize, instr: &Instr) -> f64 {
        let at = |v: &Vec<f64>, s: usize| v.get(s).copied().unwrap_or(0.0);
        match instr {
            Instr::Forward { stage, .. } => at(&self.forward, *stage),
            Instr::Backward { stage, .. } => at(&self.backward_input, *stage),
            Instr::BackwardWeight { stage, .. } => at(&self.backward_weight, *stage),
            Instr::Send { to: peer, bytes, .. } => match &self.comm {
                Some(c) => c.p2p(*bytes as f64, c.link_between(rank, *peer)),
                None => 0.0,
            },
            Instr::Recv { .. } => 0.0,
            Instr::AllReduce { group, bytes, .. } => self.collective(group, |c, g| c.all_reduce(*bytes as f64, g)),
            Instr::ReduceScatter { group, bytes, .. } => {
                self.collective(group, |c, g| c.reduce_scatter(*bytes as f64, g))
            }
            Instr::AllGather { group, bytes, .. } => self.collective(group, |c, g| c.all_gather(*bytes as f64, g)),
            Instr::OptimizerStep => self.optimizer,
        }
    }

    fn activation_bytes(&self, _rank: usize, stage: usize) -> f64 {
        self.activation_bytes.get(stage).copied().unwrap_or(0.0)
    }
}

impl CostTable {
    fn collective(&self, group: &[usize], f: impl Fn(&CommModel, &GroupSpan) -> f64) -> f64 {
        match &self.comm {
            Some(c) => f(c, &GroupSpan::of_ranks(group, c.devices_per_node)),
            None => 0.0,
        }
    }
}

/// What an event on the timeline is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// Forward.
    Forward,
    /// Backward (whole, or input-gradient half).
    Backward,
    /// Weight-gradient backward.
    BackwardWeight,
    /// A message in flight (from the send to its arrival).
    Transfer,
    /// A collective.
    Collective,
    /// The optimizer step.
    Optimizer,
}

impl EventKind {
    /// Category name for traces.
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Forward => "forward",
            EventKind::Backward => "backward",
            EventKind::BackwardWeight => "backward_weight",
            EventKind::Transfer => "transfer",
            EventKind::Collective => "collective",
            EventKind::Optimizer => "optimizer",
        }
    }

    /// True for F, B and W.
    pub fn is_compute(self) -> bool {
        matches!(self, EventKind::Forward | EventKind::Backward | EventKind::BackwardWeight)
    }
}

/// One interval on a rank's timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct SimEvent {
    /// Global rank.
    pub rank: usize,
    /// The instruction's text (`1F0`, `0SEND_F3`, `ALL_REDUCE(dp)`).
    pub name: String,
    /// What it is.
    pub kind: EventKind,
    /// Stage and microbatch, for pipeline instructions.
    pub stage_mb: Option<(usize, usize)>,
    /// Start, seconds from the step's start.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
}

/// Per-rank figures of a replay.
#[derive(Clone, Debug, PartialEq)]
pub struct RankStats {
    /// Global rank.
    pub rank: usize,
    /// Time spent in F, B and W.
    pub busy: f64,
    /// Step time minus `busy`.
    pub idle: f64,
    /// When the rank's last instruction ended.
    pub finish: f64,
    /// Peak live activation bytes (sum of `activation_bytes` over live (stage, microbatch)).
    pub peak_activation_bytes: f64,
    /// Peak number of live (stage, microbatch) activations.
    pub peak_in_flight: usize,
    /// Most sends posted but not yet received at once.
    pub max_outstanding_sends: usize,
}

/// The outcome of a replay.
#[derive(Clone, Debug, PartialEq)]
pub struct SimResult {
    /// When the last rank finished.
    pub step_time: f64,
    /// Per rank, in program order.
    pub ranks: Vec<RankStats>,
    /// Pipeline idle time over ideal compute time (Megatron's definition): (span of the
    /// compute − the busiest rank's compute) / the busiest rank's compute.
    pub bubble_ratio: f64,
    /// Largest per-rank peak activation bytes.
    pub peak_activation_bytes: f64,
    /// Timeline, in the order things happened per rank.
    pub events: Vec<SimEvent>,
}

/// One rank stuck in a deadlock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stuck {
    /// Global rank.
    pub rank: usize,
    /// The instruction it waits at (`1RECV_F3`).
    pub at: String,
    /// Why it cannot proceed.
    pub reason: String,
    /// The stuck rank it waits on, when its wait is a consequence of another's.
    pub waits_on: Option<usize>,
}

/// Why a replay failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SimError {
    /// No rank can make progress.
    #[error("deadlock: {}", describe(.stuck))]
    Deadlock {
        /// Every stuck rank.
        stuck: Vec<Stuck>,
    },
    /// Programs finished with a message nobody received.
    #[error("rank {rank}'s {at} to rank {peer} is never received (no matching receive on rank {peer})")]
    UnreceivedSend {
        /// Sending rank.
        rank: usize,
        /// The send.
        at: String,
        /// The receiver.
        peer: usize,
    },
    /// A collective's group does not contain the rank running it.
    #[error("rank {rank} runs {at} but is not in its group {group:?}")]
    NotInGroup {
        /// The rank.
        rank: usize,
        /// The collective.
        at: String,
        /// Its group.
        group: Vec<usize>,
    },
    /// Two programs claim one rank.
    #[error("two programs are for rank {0}")]
    DuplicateRank(usize),
}

fn describe(stuck: &[Stuck]) -> String {
    let roots: Vec<&Stuck> = stuck.iter().filter(|s| s.waits_on.is_none()).collect();
    let shown = if roots.is_empty() { stuck.iter().collect() } else { roots };
    let mut parts: Vec<String> =
        shown.iter().take(4).map(|s| format!("rank {} waits at {}, {}", s.rank, s.at, s.reason)).collect();
    if shown.len() > 4 {
        parts.push(format!("and {} more such ranks", shown.len() - 4));
    }
    let rest = stuck.len() - shown.len();
    if rest > 0 {
        parts.push(format!("{rest} other ranks wait on these"));
    }
    parts.join("; ")
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Token {
    Act,
    Grad,
}

type MsgKey = (usize, usize, Payload, usize, usize); // from, to, what, sending stage, mb
type CollKey = (Purpose, Vec<usize>, usize);

/// Replays `programs` with `durations`; fails on deadlock naming the stuck ranks.
pub fn simulate(programs: &[RankProgram], durations: &dyn Durations) -> Result<SimResult, SimError> {
    let mut s = Replay::new(programs, durations)?;
    // Worklist: a rank runs until it blocks; sending to a rank or arriving at a collective
    // wakes the ranks that may be waiting for it.
    while let Some(r) = s.queue.pop_front() {
        s.queued[r] = false;
        while let Some(instr) = programs[r].instrs.get(s.pc[r]) {
            if !s.step(r, instr)? {
                break;
            }
            s.pc[r] += 1;
        }
    }
    s.finish()
}

/// The replay's state, per rank by index into the programs.
struct Replay<'p> {
    programs: &'p [RankProgram],
    durations: &'p dyn Durations,
    index_of: HashMap<usize, usize>,
    last_stage: usize,
    /// (stage, microbatch) pairs whose weight gradient runs apart (`W`).
    has_w: Vec<HashSet<(usize, usize)>>,
    pc: Vec<usize>,
    now: Vec<f64>,
    busy: Vec<f64>,
    live_bytes: Vec<f64>,
    live_count: Vec<usize>,
    peak_bytes: Vec<f64>,
    peak_count: Vec<usize>,
    outstanding: Vec<usize>,
    max_outstanding: Vec<usize>,
    tokens: Vec<HashMap<(Token, usize, usize), f64>>,
    forward_done: Vec<HashSet<(usize, usize)>>,
    backward_done: Vec<HashSet<(usize, usize)>>,
    messages: HashMap<MsgKey, f64>,
    coll_seen: Vec<HashMap<(Purpose, Vec<usize>), usize>>,
    coll_arrivals: HashMap<CollKey, Vec<(usize, f64, f64)>>,
    coll_registered: Vec<bool>,
    events: Vec<SimEvent>,
    queued: Vec<bool>,
    queue: std::collections::VecDeque<usize>,
}

impl<'p> Replay<'p> {
    fn new(programs: &'p [RankProgram], durations: &'p dyn Durations) -> Result<Replay<'p>, SimError> {
        let n = programs.len();
        let mut index_of: HashMap<usize, usize> = HashMap::new();
        for (i, p) in programs.iter().enumerate() {
            if index_of.insert(p.rank, i).is_some() {
                return Err(SimError::DuplicateRank(p.rank));
            }
        }
        let last_stage = programs
            .iter()
            .flat_map(|p| p.instrs.iter())
            .filter_map(|i| match i {
                Instr::Forward { stage, .. } | Instr::Backward { stage, .. } | Instr::BackwardWeight { stage, .. } => Some(*stage),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let has_w = programs
            .iter()
            .map(|p| {
                p.instrs
                    .iter()
                    .filter_map(|i| match i {
                        Instr::BackwardWeight { stage, mb } => Some((*stage, *mb)),
                        _ => None,
                    })
                    .collect()
            })
            .collect();
        Ok(Replay {
            programs,
            durations,
            index_of,
            last_stage,
            has_w,
            pc: vec![0; n],
            now: vec![0.0; n],
            busy: vec![0.0; n],
            live_bytes: vec![0.0; n],
            live_count: vec![0; n],
            peak_bytes: vec![0.0; n],
            peak_count: vec![0; n],
            outstanding: vec![0; n],
            max_outstanding: vec![0; n],
            tokens: vec![HashMap::new(); n],
            forward_done: vec![HashSet::new(); n],
            backward_done: vec![HashSet::new(); n],
            messages: HashMap::new(),
            coll_seen: vec![HashMap::new(); n],
            coll_arrivals: HashMap::new(),
            coll_registered: vec![false; n],
            events: Vec::new(),
            queued: vec![true; n],
            queue: (0..n).collect(),
        })
    }

    /// Queues the program of global rank `rank`, unless it is queued already.
    fn wake(&mut self, rank: usize) {
        if let Some(&i) = self.index_of.get(&rank)
            && !self.queued[i]
        {
            self.queued[i] = true;
            self.queue.push_back(i);
        }
    }

    /// Runs `instr`, the next instruction of program `r`; false when it must wait.
    fn step(&mut self, r: usize, instr: &Instr) -> Result<bool, SimError> {
        let rank = self.programs[r].rank;
        let t = self.now[r];
        match instr {
            Instr::Forward { stage, mb } => {
                let (s, mb) = (*stage, *mb);
                let ready = if s == 0 { Some(t) } else { self.tokens[r].get(&(Token::Act, s, mb)).copied() };
                let Some(ready) = ready else { return Ok(false) };
                let start = t.max(ready);
                let end = start + self.durations.duration(rank, instr);
                self.live_bytes[r] += self.durations.activation_bytes(rank, s);
                self.live_count[r] += 1;
                self.peak_bytes[r] = self.peak_bytes[r].max(self.live_bytes[r]);
                self.peak_count[r] = self.peak_count[r].max(self.live_count[r]);
                self.busy[r] += end - start;
                self.forward_done[r].insert((s, mb));
                self.tokens[r].insert((Token::Act, s + 1, mb), end);
                self.compute(r, instr, EventKind::Forward, Some((s, mb)), (start, end));
            }
            Instr::Backward { stage, mb } => return Ok(self.backward(r, instr, (*stage, *mb))),
            Instr::BackwardWeight { stage, mb } => {
                let (s, mb) = (*stage, *mb);
                if !self.backward_done[r].contains(&(s, mb)) {
                    return Ok(false);
                }
                let end = t + self.durations.duration(rank, instr);
                self.busy[r] += end - t;
                self.live_bytes[r] -= self.durations.activation_bytes(rank, s);
                self.live_count[r] = self.live_count[r].saturating_sub(1);
                self.compute(r, instr, EventKind::BackwardWeight, Some((s, mb)), (t, end));
            }
            Instr::Send { to: peer, what, stage, mb, .. } => {
                let arrival = t + self.durations.duration(rank, instr);
                self.messages.insert((rank, *peer, *what, *stage, *mb), arrival);
                self.wake(*peer);
                self.outstanding[r] += 1;
                self.max_outstanding[r] = self.max_outstanding[r].max(self.outstanding[r]);
                self.events.push(SimEvent { rank, name: instr.to_string(), kind: EventKind::Transfer, stage_mb: Some((*stage, *mb)), start: t, end: arrival });
            }
            Instr::Recv { from: peer, what, stage, mb, .. } => {
                let sender_stage = match what {
                    Payload::Activation => stage.wrapping_sub(1),
                    Payload::Gradient => stage + 1,
                };
                let Some(arrival) = self.messages.remove(&(*peer, rank, *what, sender_stage, *mb)) else { return Ok(false) };
                if let Some(&si) = self.index_of.get(peer) {
                    self.outstanding[si] = self.outstanding[si].saturating_sub(1);
                }
                let end = t.max(arrival);
                let token = match what {
                    Payload::Activation => Token::Act,
                    Payload::Gradient => Token::Grad,
                };
                self.tokens[r].insert((token, *stage, *mb), end);
                self.now[r] = end;
            }
            Instr::AllReduce { group, purpose, .. } | Instr::ReduceScatter { group, purpose, .. } | Instr::AllGather { group, purpose, .. } => {
                return self.collective(r, instr, (purpose, group));
            }
            Instr::OptimizerStep => {
                let end = t + self.durations.duration(rank, instr);
                self.compute(r, instr, EventKind::Optimizer, None, (t, end));
            }
        }
        Ok(true)
    }

    /// Records a compute event of program `r` from `start` to `end`, where the rank now is.
    fn compute(&mut self, r: usize, instr: &Instr, kind: EventKind, stage_mb: Option<(usize, usize)>, (start, end): (f64, f64)) {
        self.events.push(SimEvent { rank: self.programs[r].rank, name: instr.to_string(), kind, stage_mb, start, end });
        self.now[r] = end;
    }

    /// `B(s, mb)` of program `r`: after its forward and the gradient from the next stage (the
    /// whole backward when the program has no `W` for it); false when it must wait.
    fn backward(&mut self, r: usize, instr: &Instr, (s, mb): (usize, usize)) -> bool {
        let rank = self.programs[r].rank;
        let t = self.now[r];
        if !self.forward_done[r].contains(&(s, mb)) {
            return false;
        }
        let ready = if s == self.last_stage { Some(t) } else { self.tokens[r].get(&(Token::Grad, s, mb)).copied() };
        let Some(ready) = ready else { return false };
        let start = t.max(ready);
        let mut dur = self.durations.duration(rank, instr);
        if !self.has_w[r].contains(&(s, mb)) {
            dur += self.durations.duration(rank, &Instr::BackwardWeight { stage: s, mb });
            self.live_bytes[r] -= self.durations.activation_bytes(rank, s);
            self.live_count[r] = self.live_count[r].saturating_sub(1);
        }
        let end = start + dur;
        self.busy[r] += dur;
        self.backward_done[r].insert((s, mb));
        if s > 0 {
            self.tokens[r].insert((Token::Grad, s - 1, mb), end);
        }
        self.compute(r, instr, EventKind::Backward, Some((s, mb)), (start, end));
        true
    }

    /// A collective of program `r` over `group`: it arrives (waking the other members), and
    /// runs when the last member has; false until then.
    fn collective(&mut self, r: usize, instr: &Instr, (tag, group): (&Purpose, &Vec<usize>)) -> Result<bool, SimError> {
        let rank = self.programs[r].rank;
        if !group.contains(&rank) {
            return Err(SimError::NotInGroup { rank, at: instr.to_string(), group: group.clone() });
        }
        let seen = self.coll_seen[r].get(&(tag.clone(), group.clone())).copied().unwrap_or(0);
        let key = (tag.clone(), group.clone(), seen);
        if !self.coll_registered[r] {
            let arrival = (rank, self.now[r], self.durations.duration(rank, instr));
            self.coll_arrivals.entry(key.clone()).or_default().push(arrival);
            self.coll_registered[r] = true;
            for &member in group.iter().filter(|&&m| m != rank) {
                self.wake(member);
            }
        }
        let arrivals = &self.coll_arrivals[&key];
        if arrivals.len() < group.len() {
            return Ok(false);
        }
        let start = arrivals.iter().map(|a| a.1).fold(0.0, f64::max);
        let end = start + arrivals.iter().map(|a| a.2).fold(0.0, f64::max);
        self.coll_registered[r] = false;
        *self.coll_seen[r].entry((tag.clone(), group.clone())).or_default() += 1;
        self.events.push(SimEvent { rank, name: instr.to_string(), kind: EventKind::Collective, stage_mb: None, start, end });
        self.now[r] = end;
        Ok(true)
    }

    /// The result once every rank has run as far as it can: a deadlock or an unreceived send
    /// is an error.
    fn finish(self) -> Result<SimResult, SimError> {
        let programs = self.programs;
        if self.pc.iter().zip(programs).any(|(&i, p)| i < p.instrs.len()) {
            return Err(SimError::Deadlock { stuck: explain(programs, &self.pc, &self.messages, &self.coll_arrivals, &self.coll_seen) });
        }
        if let Some(((from, to, what, stage, mb), _)) = self.messages.iter().min_by_key(|(k, _)| (k.0, k.3, k.4)) {
            let at = Instr::<usize, Vec<usize>>::Send { to: *to, what: *what, stage: *stage, mb: *mb, bytes: 0 }.to_string();
            return Err(SimError::UnreceivedSend { rank: *from, at, peer: *to });
        }
        let step_time = self.now.iter().copied().fold(0.0, f64::max);
        let compute_end = self.events.iter().filter(|e| e.kind.is_compute()).map(|e| e.end).fold(0.0, f64::max);
        let ideal = self.busy.iter().copied().fold(0.0, f64::max);
        let bubble_ratio = if ideal > 0.0 { (compute_end - ideal) / ideal } else { 0.0 };
        let ranks = programs
            .iter()
            .enumerate()
            .map(|(r, p)| RankStats {
                rank: p.rank,
                busy: self.busy[r],
                idle: step_time - self.busy[r],
                finish: self.now[r],
                peak_activation_bytes: self.peak_bytes[r],
                peak_in_flight: self.peak_count[r],
                max_outstanding_sends: self.max_outstanding[r],
            })
            .collect();
        Ok(SimResult { step_time, ranks, bubble_ratio, peak_activation_bytes: self.peak_bytes.iter().copied().fold(0.0, f64::max), events: self.events })
    }
}

fn explain(
    programs: &[RankProgram],
    pc: &[usize],
    messages: &HashMap<MsgKey, f64>,
    coll_arrivals: &HashMap<CollKey, Vec<(usize, f64, f64)>>,
    coll_seen: &[HashMap<(Purpose, Vec<usize>), usize>],
) -> Vec<Stuck> {
    let pending_send = |from: usize, to: usize, what: Payload, stage: usize, mb: usize| -> Option<usize> {
        let p = programs.iter().position(|p| p.rank == from)?;
        programs[p].instrs[pc[p].min(programs[p].instrs.len())..]
            .iter()
            .any(|i| matches!(i, Instr::Send { to: peer, what: w, stage: s, mb: m, .. } if *peer == to && *w == what && *s == stage && *m == mb))
            .then_some(p)
    };
    let at_of = |p: usize| programs[p].instrs.get(pc[p]).map(|i| i.to_string()).unwrap_or_else(|| "its end".into());
    let mut stuck = Vec::new();
    for (r, prog) in programs.iter().enumerate() {
        let Some(instr) = prog.instrs.get(pc[r]) else { continue };
        let rank = prog.rank;
        let mut waits_on = None;
        let reason = match instr {
            Instr::Recv { from: peer, what, stage, mb, .. } => {
                let sender_stage = match what {
                    Payload::Activation => stage.wrapping_sub(1),
                    Payload::Gradient => stage + 1,
                };
                match pending_send(*peer, rank, *what, sender_stage, *mb) {
                    Some(p) => {
                        waits_on = Some(*peer);
                        format!("rank {peer} sends it only after {} where it is itself stuck", at_of(p))
                    }
                    None if messages.keys().any(|k| k.1 == rank && k.2 == *what && k.4 == *mb) => {
                        format!("nothing sends it from rank {peer} (a message for another stage or rank is waiting)")
                    }
                    None => "nothing sends it".to_string(),
                }
            }
            Instr::Forward { stage, mb } => {
                format!("its input activation of stage {stage} microbatch {mb} never arrives (no {stage}RECV_F{mb} before it and no local {}F{mb})", stage.wrapping_sub(1))
            }
            Instr::Backward { stage, mb } => {
                format!("it needs {stage}F{mb} before it and the gradient of stage {stage} microbatch {mb} (a {stage}RECV_B{mb} or a local {}B{mb})", stage + 1)
            }
            Instr::BackwardWeight { stage, mb } => format!("{stage}B{mb} does not run before it"),
            Instr::AllReduce { group, purpose: tag, .. } | Instr::ReduceScatter { group, purpose: tag, .. } | Instr::AllGather { group, purpose: tag, .. } => {
                let seen = coll_seen[r].get(&(tag.clone(), group.clone())).copied().unwrap_or(0);
                let arrived: Vec<usize> = coll_arrivals
                    .get(&(tag.clone(), group.clone(), seen))
                    .map(|a| a.iter().map(|x| x.0).collect())
                    .unwrap_or_default();
                let missing: Vec<usize> = group.iter().copied().filter(|g| !arrived.contains(g)).collect();
                waits_on = missing
                    .iter()
                    .copied()
                    .find(|m| programs.iter().position(|p| p.rank == *m).is_some_and(|p| pc[p] < programs[p].instrs.len()));
                format!("ranks {missing:?} of its group never reach it")
            }
            _ => "it cannot proceed".to_string(),
        };
        stuck.push(Stuck { rank, at: instr.to_string(), reason, waits_on });
    }
    stuck.sort_by_key(|s| s.waits_on.is_some());
    stuck
}
