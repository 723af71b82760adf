//! `smp-runner launch`: N local ranks of `smp-runner run` with torchrun's environment, on one
//! host or as one node of several (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`,
//! as torchrun's static rendezvous). Forwards SIGINT/SIGTERM, and when a rank fails names it,
//! stops the others and waits for all.
//!
//! With `--max-restarts N` (torchrun's name) a run that fails after it started training (a rank
//! killed by a signal, crashed, or lost a peer: any exit but 0, 1 and 2) starts again, every
//! rank, from the newest complete checkpoint under its `--checkpoint-dir` (from the start
//! without one), after a short back-off, up to N times. Exit 1 is a user error found before
//! the first step (a bad flag, file or plan) and exit 2 a usage error: neither is retried. The
//! launchers of several hosts agree on each restart through node 0's [`coordinator`].

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use super::coordinator::{self, Client, RoundFailure};
use crate::runtime::RuntimeError;
use crate::runtime::session::report::restarts_env_value;
use crate::runtime::session::{RESTARTS_ENV, RestartRecord};
use crate::runtime::state::checkpoint;

const SIGINT: i32 = 2;
const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;

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

/// Restarts of a failed run.
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
}

impl Default for Restarts {
    fn default() -> Self {
        Restarts { max: 0, backoff: Duration::from_secs(3), agree_timeout: Duration::from_secs(600), port: None }
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
    let mut all: Vec<OsString> = vec!["run".into(), plan.as_os_str().to_owned()];
    all.extend(args.iter().map(OsString::from));
    launch_nodes(exe, nproc, nodes, restarts, &all)
}

/// Runs `exe ARGS` as ranks 0..nproc with torchrun's environment, never restarted; exit code
/// as [`launch`].
pub fn launch_args(exe: &Path, nproc: usize, args: &[OsString]) -> Result<i32, RuntimeError> {
    launch_nodes(exe, nproc, &Nodes::default(), &Restarts::default(), args)
}

/// Runs `exe ARGS` as this node's `nproc` ranks of `nodes`, restarted as `restarts` says;
/// exit code as [`launch`].
pub fn launch_nodes(exe: &Path, nproc: usize, nodes: &Nodes, restarts: &Restarts, args: &[OsString]) -> Result<i32, RuntimeError> {
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
    let addr = nodes.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into());
    // SAFETY: installs an async-signal-safe handler (one atomic store).
    unsafe {
        signal(SIGINT, on_signal as *const () as usize);
        signal(SIGTERM, on_signal as *const () as usize);
    }
    let store = if nodes.nnodes > 1 && restarts.max > 0 {
        let store_port = restarts.port.unwrap_or(port.wrapping_add(1));
        if nodes.node_rank == 0 {
            coordinator::serve(store_port, nodes.nnodes)?;
        }
        Some(Client::new(&addr, store_port))
    } else {
        None
    };
    let job = Job { exe, nproc, nodes, addr, port, store };
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
            eprintln!("smp-runner launch: restart {round} of {}: {}; resuming from {from}", restarts.max, last.cause);
        }
        if let Some(store) = &job.store {
            agree(store, round, nodes.node_rank, restarts.agree_timeout)?;
        }
        let records = restarts_env_value(&history);
        match job.round(round, &round_args, &records)? {
            Outcome::Done => return Ok(0),
            Outcome::Signalled(sig) => {
                eprintln!("smp-runner launch: stopped by signal {sig}");
                return Ok(128 + sig);
            }
            Outcome::Failed(f) => {
                eprintln!("smp-runner launch: {}; the other ranks were stopped", f.what);
                if f.fatal || round as usize == restarts.max {
                    return Ok(1);
                }
                history.push(RestartRecord { attempt: round as usize + 1, cause: f.what, resumed_from_step: None, checkpoint: None });
                std::thread::sleep(restarts.backoff);
            }
        }
    }
    Ok(1)
}

/// How one start of every rank ended.
enum Outcome {
    /// Every rank (of this host) succeeded.
    Done,
    /// A rank failed (here or on another host).
    Failed(RoundFailure),
    /// The launcher was asked to stop.
    Signalled(i32),
}

/// What every round of this host starts.
struct Job<'a> {
    exe: &'a Path,
    nproc: usize,
    nodes: &'a Nodes,
    addr: String,
    port: u16,
    store: Option<Client>,
}

impl Job<'_> {
    /// Starts this host's ranks with `args` and watches them until all have ended.
    fn round(&self, round: u32, args: &[OsString], restarts_json: &str) -> Result<Outcome, RuntimeError> {
        let (nodes, nproc) = (self.nodes, self.nproc);
        let world = nodes.nnodes * nproc;
        let mut children: Vec<Option<Child>> = Vec::with_capacity(nproc);
        for r in 0..nproc {
            let rank = nodes.node_rank * nproc + r;
            let spawned = Command::new(self.exe)
                .args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", nproc.to_string())
                .env("MASTER_ADDR", &self.addr)
                .env("MASTER_PORT", self.port.to_string())
                .env(RESTARTS_ENV, restarts_json)
                .spawn();
            match spawned {
                Ok(c) => {
                    eprintln!("smp-runner launch: rank {rank}: pid {}", c.id());
                    children.push(Some(c));
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
        let mut failed: Option<RoundFailure> = None;
        let mut told = false;
        let mut stop_sent: Option<Instant> = None;
        let mut forwarded = 0;
        let mut last_poll = Instant::now();
        loop {
            let sig = CAUGHT.load(Ordering::SeqCst);
            if sig != 0 && sig != forwarded {
                forwarded = sig;
                for c in children.iter().flatten() {
                    send(c, sig);
                }
                stop_sent.get_or_insert_with(Instant::now);
            }
            let mut running = 0;
            for (r, slot) in children.iter_mut().enumerate() {
                let Some(c) = slot else { continue };
                match c.try_wait() {
                    Ok(Some(status)) => {
                        if !status.success() && failed.is_none() && forwarded == 0 {
                            let rank = nodes.node_rank * nproc + r;
                            failed = Some(RoundFailure { fatal: fatal(status), what: format!("rank {rank} {} first", describe(status)) });
                        }
                        *slot = None;
                    }
                    Ok(None) => running += 1,
                    Err(_) => *slot = None,
                }
            }
            if let Some(store) = &self.store {
                // tell the other hosts (again, until the store hears it), or hear from them
                if let (Some(f), false) = (&failed, told) {
                    told = store.fail(round, f);
                }
                if failed.is_none() && last_poll.elapsed() > Duration::from_millis(250) {
                    last_poll = Instant::now();
                    failed = store.failure(round);
                    told = failed.is_some();
                }
            }
            if running == 0 {
                if let (Some(store), Some(f), false) = (&self.store, &failed, told) {
                    // the others must hear of it before they can agree on what comes next
                    let deadline = Instant::now() + Duration::from_secs(600);
                    while !store.fail(round, f) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
                break;
            }
            if failed.is_some() && stop_sent.is_none() {
                for c in children.iter().flatten() {
                    send(c, SIGTERM);
                }
                stop_sent = Some(Instant::now());
            }
            if stop_sent.is_some_and(|t| t.elapsed() > Duration::from_secs(5)) {
                for c in children.iter().flatten() {
                    send(c, SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(match (failed, forwarded) {
            (_, sig) if sig != 0 => Outcome::Signalled(sig),
            (Some(f), _) => Outcome::Failed(f),
            (None, _) => Outcome::Done,
        })
    }
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

/// The arguments of a restart: `--resume` set to the run's `--checkpoint-dir` when it holds a
/// complete checkpoint (its newest is resumed), with that checkpoint's step and directory.
fn resume_args(args: &[OsString]) -> (Vec<OsString>, Option<(usize, PathBuf)>) {
    let text: Vec<String> = args.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let value_of = |flag: &str| -> Option<String> {
        text.iter().enumerate().find_map(|(i, a)| {
            if a == flag {
                text.get(i + 1).cloned()
            } else {
                a.strip_prefix(&format!("{flag}=")).map(str::to_string)
            }
        })
    };
    let Some(root) = value_of("--checkpoint-dir").map(PathBuf::from) else { return (args.to_vec(), None) };
    let Some((step, dir)) = checkpoint::complete(&root).pop() else { return (args.to_vec(), None) };
    let mut out: Vec<OsString> = Vec::with_capacity(args.len() + 2);
    let mut skip = false;
    for (i, a) in args.iter().enumerate() {
        if skip {
            skip = false;
            continue;
        }
        if text[i] == "--resume" {
            skip = true;
            continue;
        }
        if text[i].starts_with("--resume=") {
            continue;
        }
        out.push(a.clone());
    }
    out.push("--resume".into());
    out.push(dir.clone().into_os_string());
    (out, Some((step, dir)))
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

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("smp-resume-args-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
