//! `smp-runner launch`: N local ranks of `smp-runner run` with torchrun's environment, on one
//! host or as one node of several (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`,
//! as torchrun's static rendezvous). Forwards SIGINT/SIGTERM, and when a rank fails names it,
//! stops the others and waits for all.
//!
//! Every rank sends its launcher signs of life ([`heartbeat`]); a rank silent past its phase's
//! timeout (start-up, step, checkpoint), or in a phase past it without waiting on any peer, is
//! hung: the launcher names it, with what its peers wait on, kills it and ends the run as for
//! a failure. A rank alive but waiting on peers past the timeout ends the run naming the
//! collective or message and its group.
//!
//! With `--max-restarts N` (torchrun's name) a run that fails after it started training (a rank
//! killed by a signal, crashed, hung or lost a peer: any exit but 0, 1 and 2) starts again,
//! every rank, from the newest complete checkpoint under its `--checkpoint-dir` (from the start
//! without one), after a short back-off, up to N times. Exit 1 is a user error found before
//! the first step (a bad flag, file or plan) and exit 2 a usage error: neither is retried. The
//! launchers of several hosts agree on each restart through node 0's [`coordinator`]. Under
//! `--elastic` ([`super::elastic`]) the launchers also agree on the job's devices.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use super::coordinator::{self, Client, RoundFailure, RoundState};
use crate::runtime::heartbeat::{self, HEARTBEAT_ENV, Verdict, Watch};
pub use crate::runtime::heartbeat::Timeouts;
use crate::runtime::RuntimeError;
use crate::runtime::session::report::restarts_env_value;
use crate::runtime::session::{RESTARTS_ENV, RestartRecord};
use crate::runtime::state::checkpoint;

const SIGINT: i32 = 2;
const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;

/// A rank's exit status when it leaves the job (dropped as a straggler under `--elastic`).
pub const EXIT_LEFT: i32 = 4;
/// A rank's exit status when it stopped because others leave the job.
pub const EXIT_STOPPED: i32 = 5;
/// Rank 0's exit status when it could not listen on the rendezvous port: another process took
/// it between the launcher's choice and the store's bind. A launcher that chose the port
/// itself picks another and starts the round again.
pub const EXIT_PORT_IN_USE: i32 = 6;
/// How many times a launcher that chose the rendezvous port picks another one when it is taken.
const PORT_RETRIES: usize = 3;

static CAUGHT: AtomicI32 = AtomicI32::new(0);

unsafe extern "C" {
    fn signal(signum: i32, handler: usize) -> usize;
    fn kill(pid: i32, sig: i32) -> i32;
}

extern "C" fn on_signal(sig: i32) {
    CAUGHT.store(sig, Ordering::SeqCst);
}

fn send(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        kill(child.id() as i32, sig);
    }
}

/// Installs the launcher's SIGINT/SIGTERM handler (forwarded to the ranks).
pub(super) fn catch_signals() {
    // SAFETY: installs an async-signal-safe handler (one atomic store).
    unsafe {
        signal(SIGINT, on_signal as *const () as usize);
        signal(SIGTERM, on_signal as *const () as usize);
    }
}

/// The signal the launcher was asked to stop by, if any.
pub(super) fn caught() -> i32 {
    CAUGHT.load(Ordering::SeqCst)
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(9)) => "was killed by SIGKILL".into(),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => format!("ended ({status})"),
    }
}

/// Whether a rank's exit means the run must not be started again: a user error found before
/// training (exit 1) or a usage error (exit 2).
fn fatal(status: ExitStatus) -> bool {
    matches!(status.code(), Some(1 | 2))
}

/// A free TCP port on the loopback interface for the rendezvous store.
pub fn free_port() -> Result<u16, RuntimeError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| RuntimeError::Train(format!("cannot find a free port: {e}")))?;
    Ok(l.local_addr().map_err(|e| RuntimeError::Train(e.to_string()))?.port())
}

/// This host's place among the hosts of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nodes {
    /// Hosts (each runs one launcher).
    pub nnodes: usize,
    /// This host's index; its ranks are `node_rank·nproc ..`.
    pub node_rank: usize,
    /// Rank 0's address (default: loopback, one host only).
    pub master_addr: Option<String>,
    /// The rendezvous port (default: a free one, one host only).
    pub master_port: Option<u16>,
}

impl Default for Nodes {
    fn default() -> Self {
        Nodes { nnodes: 1, node_rank: 0, master_addr: None, master_port: None }
    }
}

/// Restarts of a failed run, and when a rank counts as hung.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restarts {
    /// Starts after the first, at most (`--max-restarts`).
    pub max: usize,
    /// The pause before each restart.
    pub backoff: Duration,
    /// How long a launcher waits for the others to agree on a restart (several hosts).
    pub agree_timeout: Duration,
    /// Node 0's port for the launchers' own store (default: the rendezvous port + 1).
    pub port: Option<u16>,
    /// The phase timeouts past which a rank is hung.
    pub timeouts: Timeouts,
}

impl Default for Restarts {
    fn default() -> Self {
        Restarts { max: 0, backoff: Duration::from_secs(3), agree_timeout: Duration::from_secs(600), port: None, timeouts: Timeouts::default() }
    }
}

/// Runs `exe run PLAN ARGS` as ranks 0..nproc; returns the exit code for the launcher: 0 if
/// every rank succeeded, else 1 (the failing rank is named on stderr).
pub fn launch(exe: &Path, nproc: usize, plan: &Path, args: &[String]) -> Result<i32, RuntimeError> {
    launch_on(exe, nproc, &Nodes::default(), &Restarts::default(), plan, args)
}

/// Runs `exe run PLAN ARGS` as this node's `nproc` ranks of `nodes`, restarting as `restarts`
/// says; exit code as [`launch`].
pub fn launch_on(exe: &Path, nproc: usize, nodes: &Nodes, restarts: &Restarts, plan: &Path, args: &[String]) -> Result<i32, RuntimeError> {
    launch_nodes(exe, nproc, nodes, restarts, &run_args(plan, args))
}

/// `run PLAN ARGS` as arguments of `exe`.
pub(super) fn run_args(plan: &Path, args: &[String]) -> Vec<OsString> {
    let mut all: Vec<OsString> = vec!["run".into(), plan.as_os_str().to_owned()];
    all.extend(args.iter().map(OsString::from));
    all
}

/// Runs `exe ARGS` as ranks 0..nproc with torchrun's environment, never restarted; exit code
/// as [`launch`].
pub fn launch_args(exe: &Path, nproc: usize, args: &[OsString]) -> Result<i32, RuntimeError> {
    launch_nodes(exe, nproc, &Nodes::default(), &Restarts::default(), args)
}

/// Checks `nproc` and `nodes`; the rendezvous address and port.
pub(super) fn rendezvous(nproc: usize, nodes: &Nodes) -> Result<(String, u16), RuntimeError> {
    if nproc == 0 {
        return Err(RuntimeError::Train("--nproc must be at least 1".into()));
    }
    if nodes.nnodes == 0 || nodes.node_rank >= nodes.nnodes {
        return Err(RuntimeError::Train(format!("--node-rank {} must be below --nnodes {}", nodes.node_rank, nodes.nnodes)));
    }
    if nodes.nnodes > 1 && (nodes.master_addr.is_none() || nodes.master_port.is_none()) {
        return Err(RuntimeError::Train(format!(
            "--nnodes {} needs --master-addr (node 0's address, reachable from every node) and --master-port (the same on every node)",
            nodes.nnodes
        )));
    }
    let port = match nodes.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    Ok((nodes.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into()), port))
}

/// Runs `exe ARGS` as this node's `nproc` ranks of `nodes`, restarted as `restarts` says;
/// exit code as [`launch`].
pub fn launch_nodes(exe: &Path, nproc: usize, nodes: &Nodes, restarts: &Restarts, args: &[OsString]) -> Result<i32, RuntimeError> {
    let (addr, port) = rendezvous(nproc, nodes)?;
    catch_signals();
    let store = if nodes.nnodes > 1 && restarts.max > 0 {
        let store_port = restarts.port.unwrap_or(port.wrapping_add(1));
        if nodes.node_rank == 0 {
            coordinator::serve(store_port, nodes.nnodes, None)?;
        }
        Some(Client::new(&addr, store_port))
    } else {
        None
    };
    let chose_port = nodes.master_port.is_none() && nodes.nnodes == 1;
    let mut job = Job::new(exe, nodes, addr, port, store, restarts.timeouts)?;
    let mut port_retries = 0;
    let slots: Vec<usize> = (0..nproc).collect();
    let mut history: Vec<RestartRecord> = Vec::new();
    for round in 0..=restarts.max as u32 {
        let (round_args, resumed) = if round == 0 { (args.to_vec(), None) } else { resume_args(args) };
        if let Some(last) = history.last_mut() {
            last.resumed_from_step = resumed.as_ref().map(|(s, _)| *s);
            last.checkpoint = resumed.as_ref().map(|(_, p)| p.display().to_string());
            let from = match &resumed {
                Some((step, dir)) => format!("step {step} ({})", dir.display()),
                None => "the start (no complete checkpoint)".into(),
            };
            crate::logging::say!("smp-runner launch: restart {round} of {}: {}; resuming from {from}", restarts.max, last.cause);
        }
        if let Some(store) = &job.store {
            agree(store, round, nodes.node_rank, restarts.agree_timeout)?;
        }
        let records = restarts_env_value(&history);
        let spec = RoundSpec { round, args: &round_args, restarts_json: &records, world: nodes.nnodes * nproc, first_rank: nodes.node_rank * nproc, slots: &slots, env: &[], grow: None, fault_at_unix_s: None };
        let end = loop {
            let end = job.round(&spec)?;
            if !(end.port_taken && chose_port && port_retries < PORT_RETRIES) {
                break end;
            }
            // the free port was taken before rank 0 listened on it: not a fault of the run
            port_retries += 1;
            let taken = std::mem::replace(&mut job.port, free_port()?);
            crate::logging::say!("smp-runner launch: the rendezvous port {taken} was taken before rank 0 listened on it; starting again on port {}", job.port);
        };
        match end.outcome {
            Outcome::Done => return Ok(0),
            Outcome::Signalled(sig) => {
                crate::logging::say!("smp-runner launch: stopped by signal {sig}");
                return Ok(128 + sig);
            }
            Outcome::Failed(f) => {
                crate::logging::say!("smp-runner launch: {}; the other ranks were stopped", f.what);
                if f.fatal || round as usize == restarts.max {
                    return Ok(1);
                }
                history.push(RestartRecord {
                    attempt: round as usize + 1,
                    cause: f.what,
                    resumed_from_step: None,
                    checkpoint: None,
                    membership: None,
                    fault_at_unix_s: Some(f.at_unix_s),
                    fault_to_first_step_s: None,
                });
                std::thread::sleep(restarts.backoff);
            }
        }
    }
    Ok(1)
}

/// How one start of every rank ended.
pub(super) enum Outcome {
    /// Every rank (of this host) succeeded.
    Done,
    /// A rank failed (here or on another host), or the round ended to grow the job.
    Failed(RoundFailure),
    /// The launcher was asked to stop.
    Signalled(i32),
}

/// A round's end: how, and what this host saw of it.
pub(super) struct RoundEnd {
    /// How it ended.
    pub outcome: Outcome,
    /// This host's device slots whose ranks were found hung or left the job.
    pub lost_slots: Vec<usize>,
    /// When global rank 0 (if it ran here) ended its first step, in seconds since the Unix epoch.
    pub first_step_unix_s: Option<f64>,
    /// Whether the round failed because rank 0 found the rendezvous port taken.
    pub port_taken: bool,
}

/// Node 0 under `--elastic`: what it watches to grow the job at the next checkpoint.
pub(super) struct GrowWatch<'s> {
    /// The checkpoint directory.
    pub root: &'s Path,
    /// The job's devices now.
    pub devices: usize,
    /// The most it may have.
    pub max: usize,
    /// The run's last step (`--steps`): a checkpoint of it ends the run, not the round.
    pub last_step: Option<usize>,
}

/// One start of this host's ranks.
pub(super) struct RoundSpec<'s> {
    /// The round (0: the first start).
    pub round: u32,
    /// Every rank's arguments (`run PLAN …`).
    pub args: &'s [OsString],
    /// The restarts so far, for the ranks' report ([`RESTARTS_ENV`]).
    pub restarts_json: &'s str,
    /// Ranks in the job.
    pub world: usize,
    /// This host's first global rank.
    pub first_rank: usize,
    /// This host's device slots, one rank each (local rank i on slot `slots[i]`).
    pub slots: &'s [usize],
    /// More environment for every rank.
    pub env: &'s [(String, String)],
    /// Under `--elastic`, node 0: grow at the next checkpoint when hosts wait to join.
    pub grow: Option<GrowWatch<'s>>,
    /// The fault this round recovers from, for the line naming its first step.
    pub fault_at_unix_s: Option<f64>,
}

/// What every round of this host starts.
pub(super) struct Job<'a> {
    exe: &'a Path,
    nodes: &'a Nodes,
    addr: String,
    port: u16,
    /// Node 0's store, when the launchers agree through one.
    pub store: Option<Client>,
    timeouts: Timeouts,
    /// Where the ranks' heartbeats go (removed with the job).
    beats: PathBuf,
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.beats);
    }
}

impl<'a> Job<'a> {
    /// The job of this host: ranks of `exe`, rendezvous at `addr:port`.
    pub fn new(exe: &'a Path, nodes: &'a Nodes, addr: String, port: u16, store: Option<Client>, timeouts: Timeouts) -> Result<Job<'a>, RuntimeError> {
        let beats = std::env::temp_dir().join(format!("smp-launch-{}-{}", std::process::id(), nodes.node_rank));
        std::fs::create_dir_all(&beats).map_err(|e| RuntimeError::File { path: beats.display().to_string(), message: format!("cannot create the heartbeat directory: {e}") })?;
        Ok(Job { exe, nodes, addr, port, store, timeouts, beats })
    }

    /// Starts this host's ranks as `spec` says and watches them until all have ended.
    pub fn round(&self, spec: &RoundSpec<'_>) -> Result<RoundEnd, RuntimeError> {
        let n = spec.slots.len();
        let (children, watches) = self.spawn(spec)?;
        let mut w = RoundWatch {
            children,
            watches,
            failed: None,
            told: false,
            untold_lost: Vec::new(),
            untold_hang: None,
            lost_slots: Vec::new(),
            stop_sent: None,
            forwarded: 0,
            stopping_since: None,
            last_poll: Instant::now(),
            last_watch: Instant::now(),
            waits_since: vec![None; n],
            first_step: None,
            grow_from: None,
            succeeded: 0,
            last_grow_check: Instant::now(),
            port_taken: false,
        };
        loop {
            w.forward_signal();
            let running = w.reap(spec, self.nodes.node_rank);
            if w.last_watch.elapsed() > Duration::from_millis(250) && w.forwarded == 0 {
                w.last_watch = Instant::now();
                self.look(spec, &mut w);
            }
            if let (Some(g), Some(store), None, true) = (&spec.grow, &self.store, &w.failed, running == n) {
                if w.last_grow_check.elapsed() > Duration::from_millis(250) {
                    w.last_grow_check = Instant::now();
                    grow_when_due(store, spec.round, g, &mut w.grow_from);
                }
            }
            if let Some(store) = &self.store {
                w.exchange(store, spec.round);
            }
            if w.stopping_since.is_some_and(|t| t.elapsed() > Duration::from_secs(10)) && w.failed.is_none() {
                // ranks stopped for others leaving, and no word of who: end the round anyway
                w.failed = Some(RoundFailure::new(false, "ranks stopped for a change of the job's devices"));
            }
            if running == 0 && (w.failed.is_some() || w.stopping_since.is_none() || w.forwarded != 0) {
                if let (Some(store), Some(f), false) = (&self.store, &w.failed, w.told) {
                    // the others must hear of it before they can agree on what comes next
                    let deadline = Instant::now() + Duration::from_secs(600);
                    while !store.fail(spec.round, f) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
                break;
            }
            w.stop_children();
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(self.end_of(spec, w))
    }

    /// Starts this host's ranks: their processes and their heartbeat watches; none left
    /// running if one cannot start.
    fn spawn(&self, spec: &RoundSpec<'_>) -> Result<(Vec<Option<Child>>, Vec<Watch>), RuntimeError> {
        let n = spec.slots.len();
        let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
        let mut watches: Vec<Watch> = Vec::with_capacity(n);
        let visible = visible_devices(spec.slots);
        for (r, _) in spec.slots.iter().enumerate() {
            let rank = spec.first_rank + r;
            let watch = Watch::new(self.beats.join(format!("round-{}-rank-{rank}", spec.round)));
            let mut cmd = Command::new(self.exe);
            cmd.args(spec.args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", spec.world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", &self.addr)
                .env("MASTER_PORT", self.port.to_string())
                .env(RESTARTS_ENV, spec.restarts_json)
                .env(HEARTBEAT_ENV, watch.path());
            if let Some(v) = &visible {
                cmd.env("CUDA_VISIBLE_DEVICES", v);
            }
            for (k, v) in spec.env {
                cmd.env(k, v);
            }
            match cmd.spawn() {
                Ok(c) => {
                    crate::logging::say!("smp-runner launch: rank {rank}: pid {}", c.id());
                    children.push(Some(c));
                    watches.push(watch);
                }
                Err(e) => {
                    for c in children.iter_mut().flatten() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    return Err(RuntimeError::Train(format!("cannot start rank {rank} (`{}`): {e}", self.exe.display())));
                }
            }
        }
        Ok((children, watches))
    }

    /// Reads the heartbeats: rank 0's first step, then the verdict on each rank.
    fn look(&self, spec: &RoundSpec<'_>, w: &mut RoundWatch) {
        for watch in &mut w.watches {
            watch.poll();
        }
        if w.first_step.is_none() && spec.first_rank == 0 {
            w.first_step = w.watches.first().and_then(|b| b.beat()).and_then(|b| b.first_step_unix_s);
            if let (Some(t), Some(fault)) = (w.first_step, spec.fault_at_unix_s) {
                crate::logging::say!("smp-runner launch: the first step after the restart ended {:.1} s after the fault", (t - fault).max(0.0));
            }
        }
        self.judge(spec, w);
    }

    /// How the round ended, with the failure as every host reported it.
    fn end_of(&self, spec: &RoundSpec<'_>, mut w: RoundWatch) -> RoundEnd {
        // the last beats: rank 0 may have ended its first step since the last look
        if w.first_step.is_none() && spec.first_rank == 0 {
            if let Some(first) = w.watches.first_mut() {
                first.poll();
                w.first_step = first.beat().and_then(|b| b.first_step_unix_s);
            }
        }
        // the failure as every host reported it (devices lost elsewhere included)
        if let (Some(store), Some(f)) = (&self.store, &mut w.failed) {
            if let Some(RoundState::Failed(all)) = store.poll(spec.round) {
                f.lost = all.lost;
                f.at_unix_s = f.at_unix_s.min(all.at_unix_s);
                f.grow = all.grow;
            }
        }
        let outcome = match (w.failed, w.forwarded) {
            (_, sig) if sig != 0 => Outcome::Signalled(sig),
            // the run ended here as the others were told to grow: it is done
            (Some(f), _) if f.grow && w.succeeded == spec.slots.len() => Outcome::Done,
            (Some(f), _) => Outcome::Failed(f),
            (None, _) => Outcome::Done,
        };
        RoundEnd { outcome, lost_slots: w.lost_slots, first_step_unix_s: w.first_step, port_taken: w.port_taken }
    }

    /// Judges the running ranks by their heartbeats: a hung one is killed and its device lost;
    /// one waiting on peers past its timeout (beyond a grace in which the hung peer's own
    /// launcher may name it) ends the round.
    fn judge(&self, spec: &RoundSpec<'_>, w: &mut RoundWatch) {
        let RoundWatch { children, watches, waits_since, failed, lost_slots, untold_lost, untold_hang, .. } = w;
        let watches: &[Watch] = watches;
        let node = self.nodes.node_rank;
        let verdicts: Vec<Verdict> = watches.iter().map(|w| w.verdict(&self.timeouts)).collect();
        // what the others here wait on, named beside a hung rank
        let waiters: Vec<String> = children
            .iter()
            .zip(watches)
            .enumerate()
            .filter(|(_, (c, _))| c.is_some())
            .filter_map(|(r, (_, w))| Some(format!("rank {} waits in {}", spec.first_rank + r, w.beat()?.waiting.as_ref()?.what)))
            .collect();
        for (r, v) in verdicts.into_iter().enumerate() {
            let Some(child) = children[r].as_mut() else { continue };
            let rank = spec.first_rank + r;
            // stuck computing past the timeout, and still so after the grace in which a
            // failure elsewhere ends the round: hung
            let grace = (self.timeouts.step / 2).max(Duration::from_secs(2));
            let v = match v {
                Verdict::Stuck(why) if failed.is_none() && waits_since[r].get_or_insert_with(Instant::now).elapsed() > grace => Verdict::Hung(why),
                v => v,
            };
            match v {
                Verdict::Fine => waits_since[r] = None,
                Verdict::Stuck(_) => {}
                Verdict::Hung(why) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    children[r] = None;
                    let others: Vec<&String> = waiters.iter().filter(|w| !w.starts_with(&format!("rank {rank} "))).collect();
                    let peers = if others.is_empty() { String::new() } else { format!("; {}", others.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")) };
                    let what = format!("rank {rank} is hung: {why}{peers}");
                    crate::logging::say!("smp-runner launch: {what}; it was killed");
                    let at = heartbeat::unix_now_s() - watches[r].last_alive().elapsed().as_secs_f64();
                    lost_slots.push(spec.slots[r]);
                    untold_lost.push((node, spec.slots[r]));
                    if failed.is_some() {
                        // the round had failed already: its devices lost are told with the hang
                        untold_hang.get_or_insert_with(|| what.clone());
                    }
                    let f = failed.get_or_insert_with(|| RoundFailure { at_unix_s: at, ..RoundFailure::new(false, what) });
                    if !f.lost.contains(&(node, spec.slots[r])) {
                        f.lost.push((node, spec.slots[r]));
                    }
                }
                Verdict::Waits(why) => {
                    let since = *waits_since[r].get_or_insert_with(Instant::now);
                    if since.elapsed() > grace && failed.is_none() {
                        *failed = Some(RoundFailure::new(false, format!("rank {rank} {why}")));
                    }
                }
            }
        }
    }
}

/// What a launcher knows of a round while it watches this host's ranks.
struct RoundWatch {
    /// The ranks' processes; none once ended.
    children: Vec<Option<Child>>,
    watches: Vec<Watch>,
    failed: Option<RoundFailure>,
    /// Whether the store has heard of `failed`.
    told: bool,
    /// Devices lost here after the store heard of the failure.
    untold_lost: Vec<(usize, usize)>,
    /// The first hang found here after the round failed: what the devices lost are told with.
    untold_hang: Option<String>,
    lost_slots: Vec<usize>,
    stop_sent: Option<Instant>,
    /// The signal forwarded to the ranks (0: none).
    forwarded: i32,
    /// When a rank first stopped for others leaving.
    stopping_since: Option<Instant>,
    last_poll: Instant,
    last_watch: Instant,
    waits_since: Vec<Option<Instant>>,
    first_step: Option<f64>,
    grow_from: Option<usize>,
    succeeded: usize,
    last_grow_check: Instant,
    /// Whether rank 0 exited for the rendezvous port being taken ([`EXIT_PORT_IN_USE`]).
    port_taken: bool,
}

impl RoundWatch {
    /// Forwards a newly caught signal to every rank.
    fn forward_signal(&mut self) {
        let sig = caught();
        if sig != 0 && sig != self.forwarded {
            self.forwarded = sig;
            for c in self.children.iter().flatten() {
                send(c, sig);
            }
            self.stop_sent.get_or_insert_with(Instant::now);
        }
    }

    /// Collects the ranks that ended, noting the first failure and devices left; the number
    /// still running.
    fn reap(&mut self, spec: &RoundSpec<'_>, node: usize) -> usize {
        let mut running = 0;
        for (r, slot) in self.children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            match c.try_wait() {
                Ok(Some(status)) => {
                    let rank = spec.first_rank + r;
                    self.succeeded += usize::from(status.success());
                    if !status.success() && self.forwarded == 0 && self.stop_sent.is_none() {
                        match status.code() {
                            Some(EXIT_LEFT) => {
                                self.lost_slots.push(spec.slots[r]);
                                self.untold_lost.push((node, spec.slots[r]));
                                let f = self.failed.get_or_insert_with(|| RoundFailure::new(false, format!("rank {rank} left the job (see its error above)")));
                                f.lost.push((node, spec.slots[r]));
                            }
                            Some(EXIT_STOPPED) => {
                                self.stopping_since.get_or_insert_with(Instant::now);
                            }
                            Some(EXIT_PORT_IN_USE) if self.failed.is_none() => {
                                self.port_taken = true;
                                self.failed = Some(RoundFailure::new(false, format!("rank {rank} found the rendezvous port taken")));
                            }
                            _ if self.failed.is_none() => self.failed = Some(RoundFailure::new(fatal(status), format!("rank {rank} {} first", describe(status)))),
                            _ => {}
                        }
                    }
                    *slot = None;
                }
                Ok(None) => running += 1,
                Err(_) => *slot = None,
            }
        }
        running
    }

    /// Tells the other hosts of the failure (again, until the store hears it) and of devices
    /// lost since, or hears of theirs.
    fn exchange(&mut self, store: &Client, round: u32) {
        if let (Some(f), false) = (&self.failed, self.told) {
            self.told = store.fail(round, f);
            if self.told {
                self.untold_lost.clear();
                self.untold_hang = None;
            }
        }
        if self.told && !self.untold_lost.is_empty() {
            let what = self.untold_hang.clone().unwrap_or_else(|| "devices lost".into());
            let more = RoundFailure { lost: self.untold_lost.clone(), ..RoundFailure::new(false, what) };
            if store.fail(round, &more) {
                self.untold_lost.clear();
                self.untold_hang = None;
            }
        }
        if self.failed.is_none() && self.last_poll.elapsed() > Duration::from_millis(250) {
            self.last_poll = Instant::now();
            if let Some(RoundState::Failed(f)) = store.poll(round) {
                self.failed = Some(f);
                self.told = true;
            }
        }
    }

    /// After a failure, asks the ranks to stop, then kills them 5 s later.
    fn stop_children(&mut self) {
        if self.failed.is_some() && self.stop_sent.is_none() {
            for c in self.children.iter().flatten() {
                send(c, SIGTERM);
            }
            self.stop_sent = Some(Instant::now());
        }
        if self.stop_sent.is_some_and(|t| t.elapsed() > Duration::from_secs(5)) {
            for c in self.children.iter().flatten() {
                send(c, SIGKILL);
            }
        }
    }
}

/// Node 0 under `--elastic`: once launchers wait to join (and the job has room), the round ends
/// after the next checkpoint completes.
fn grow_when_due(store: &Client, round: u32, g: &GrowWatch<'_>, grow_from: &mut Option<usize>) {
    let newest = checkpoint::complete(g.root).last().map_or(0, |(s, _)| *s);
    if g.last_step.is_some_and(|last| newest >= last) {
        return;
    }
    match grow_from {
        None => {
            if g.devices < g.max && matches!(store.poll(round), Some(RoundState::Running { joining }) if joining > 0) {
                crate::logging::say!("smp-runner launch: hosts wait to join; the job grows after the next checkpoint");
                *grow_from = Some(newest);
            }
        }
        Some(from) if newest > *from => {
            let _ = store.grow(round, heartbeat::unix_now_s());
        }
        Some(_) => {}
    }
}

/// `CUDA_VISIBLE_DEVICES` for ranks on device `slots` (local rank i sees slot i as its GPU 0..),
/// when some device was dropped; none while the slots are 0..n.
fn visible_devices(slots: &[usize]) -> Option<String> {
    if slots.iter().enumerate().all(|(i, &s)| i == s) {
        return None;
    }
    let base: Option<Vec<String>> = std::env::var("CUDA_VISIBLE_DEVICES").ok().map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let names: Vec<String> = slots.iter().map(|&s| base.as_ref().and_then(|b| b.get(s).cloned()).unwrap_or_else(|| s.to_string())).collect();
    Some(names.join(","))
}

/// Waits until every host's launcher is ready for `round` (a host whose link is down keeps
/// asking until it is back), at most `timeout`.
fn agree(store: &Client, round: u32, node: usize, timeout: Duration) -> Result<(), RuntimeError> {
    let start = Instant::now();
    loop {
        if store.ready(round, node) == Some(true) {
            return Ok(());
        }
        if start.elapsed() > timeout {
            return Err(RuntimeError::Train(format!(
                "the launchers did not agree on start {round} within {} s: a host's launcher is gone or unreachable",
                timeout.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The value of `flag` in `args` (`--flag V` or `--flag=V`).
pub(super) fn flag_value(args: &[OsString], flag: &str) -> Option<String> {
    let text: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    text.iter().enumerate().find_map(|(i, a)| if a == flag { text.get(i + 1).cloned() } else { a.strip_prefix(&format!("{flag}=")).map(str::to_string) })
}

/// `args` with `--resume DIR` (any earlier `--resume` dropped).
pub(super) fn with_resume(args: &[OsString], dir: &Path) -> Vec<OsString> {
    let mut out: Vec<OsString> = Vec::with_capacity(args.len() + 2);
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
            continue;
        }
        let t = a.to_string_lossy();
        if t == "--resume" {
            skip = true;
            continue;
        }
        if t.starts_with("--resume=") {
            continue;
        }
        out.push(a.clone());
    }
    out.push("--resume".into());
    out.push(dir.as_os_str().to_owned());
    out
}

/// The arguments of a restart: `--resume` set to the run's `--checkpoint-dir` when it holds a
/// complete checkpoint (its newest is resumed), with that checkpoint's step and directory.
fn resume_args(args: &[OsString]) -> (Vec<OsString>, Option<(usize, PathBuf)>) {
    let Some(root) = flag_value(args, "--checkpoint-dir").map(PathBuf::from) else { return (args.to_vec(), None) };
    let Some((step, dir)) = checkpoint::complete(&root).pop() else { return (args.to_vec(), None) };
    (with_resume(args, &dir), Some((step, dir)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_resumes_the_newest_complete_checkpoint_of_the_run() {
        let root = tempfile_dir();
        for (step, complete) in [(2, true), (4, true), (6, false)] {
            let d = root.join(format!("step-{step}"));
            std::fs::create_dir_all(&d).unwrap();
            if complete {
                std::fs::write(d.join(checkpoint::MANIFEST), "{}").unwrap();
            }
        }
        let args: Vec<OsString> = ["run", "p.json", "--checkpoint-dir", root.to_str().unwrap(), "--resume", "old", "--steps", "9"].iter().map(OsString::from).collect();
        let (out, resumed) = resume_args(&args);
        assert_eq!(resumed, Some((4, root.join("step-4"))));
        let out: Vec<String> = out.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert!(!out.contains(&"old".to_string()), "{out:?}");
        assert_eq!(out[out.len() - 2..], ["--resume".to_string(), root.join("step-4").display().to_string()]);
        // no checkpoint directory: the arguments as given
        let plain: Vec<OsString> = ["run", "p.json"].iter().map(OsString::from).collect();
        assert_eq!(resume_args(&plain), (plain.clone(), None));
        let _ = std::fs::remove_dir_all(&root);
    }

    /// A rank program that, as rank 0 of the first start, exits as finding the rendezvous port
    /// taken, and otherwise succeeds; every rank's MASTER_PORT goes to `ports`, one per line.
    fn port_script(dir: &Path) -> (PathBuf, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let (script, ports, marker) = (dir.join("rank.sh"), dir.join("ports"), dir.join("taken"));
        let body = format!(
            "#!/bin/sh\necho \"$RANK $MASTER_PORT\" >> '{p}'\nif [ \"$RANK\" = 0 ] && [ ! -e '{m}' ]; then touch '{m}'; exit {EXIT_PORT_IN_USE}; fi\nexit 0\n",
            p = ports.display(),
            m = marker.display()
        );
        std::fs::write(&script, body).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        (script, ports)
    }

    #[test]
    fn a_rendezvous_port_taken_before_rank_0_listens_is_chosen_again() {
        let dir = tempfile::tempdir().unwrap();
        let (script, ports) = port_script(dir.path());
        assert_eq!(launch_nodes(&script, 2, &Nodes::default(), &Restarts::default(), &[]).unwrap(), 0, "the second start succeeds");
        let seen: Vec<(String, String)> =
            std::fs::read_to_string(&ports).unwrap().lines().map(|l| l.split_once(' ').map(|(r, p)| (r.to_string(), p.to_string())).unwrap()).collect();
        let first = seen.iter().find(|(r, _)| r == "0").map(|(_, p)| p.clone()).unwrap();
        let again: Vec<&String> = seen.iter().filter(|(_, p)| *p != first).map(|(_, p)| p).collect();
        assert_eq!(again.len(), 2, "both ranks started again on another port: {seen:?}");
        assert_eq!(again[0], again[1]);
        // a port the user gave is not replaced: the launch fails, restarts or not
        let dir = tempfile::tempdir().unwrap();
        let (script, _) = port_script(dir.path());
        let given = Nodes { master_port: Some(free_port().unwrap()), ..Nodes::default() };
        let restarts = Restarts { max: 1, backoff: Duration::from_millis(1), ..Restarts::default() };
        assert_eq!(launch_nodes(&script, 2, &given, &Restarts::default(), &[]).unwrap(), 1);
        let dir = tempfile::tempdir().unwrap();
        let (script, ports) = port_script(dir.path());
        // with a restart, the run starts again on the port given (and succeeds: the script takes it once)
        assert_eq!(launch_nodes(&script, 2, &given, &restarts, &[]).unwrap(), 0);
        let text = std::fs::read_to_string(&ports).unwrap();
        assert!(text.lines().all(|l| l.ends_with(&given.master_port.unwrap().to_string())), "{text}");
    }

    #[test]
    fn ranks_on_dropped_devices_see_the_others() {
        assert_eq!(visible_devices(&[0, 1]), None);
        // SAFETY-free: the variable is read, not set, here
        if std::env::var("CUDA_VISIBLE_DEVICES").is_err() {
            assert_eq!(visible_devices(&[0, 2, 3]).as_deref(), Some("0,2,3"));
        }
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("smp-resume-args-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
