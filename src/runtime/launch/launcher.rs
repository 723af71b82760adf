//! `smp-runner launch`: N local ranks of `smp-runner run` with torchrun's environment, on one
//! host or as one node of several (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`,
//! as torchrun's static rendezvous). Forwards SIGINT/SIGTERM, and when a rank fails names it,
//! stops the others and waits for all.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use crate::runtime::RuntimeError;

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

/// Runs `exe run PLAN ARGS` as ranks 0..nproc; returns the exit code for the launcher: 0 if
/// every rank succeeded, else 1 (the failing rank is named on stderr).
pub fn launch(exe: &Path, nproc: usize, plan: &Path, args: &[String]) -> Result<i32, RuntimeError> {
    launch_on(exe, nproc, &Nodes::default(), plan, args)
}

/// Runs `exe run PLAN ARGS` as this node's `nproc` ranks of `nodes`; exit code as [`launch`].
pub fn launch_on(exe: &Path, nproc: usize, nodes: &Nodes, plan: &Path, args: &[String]) -> Result<i32, RuntimeError> {
    let mut all: Vec<OsString> = vec!["run".into(), plan.as_os_str().to_owned()];
    all.extend(args.iter().map(OsString::from));
    launch_nodes(exe, nproc, nodes, &all)
}

/// Runs `exe ARGS` as ranks 0..nproc with torchrun's environment; exit code as [`launch`].
pub fn launch_args(exe: &Path, nproc: usize, args: &[OsString]) -> Result<i32, RuntimeError> {
    launch_nodes(exe, nproc, &Nodes::default(), args)
}

/// Runs `exe ARGS` as this node's `nproc` ranks of `nodes`; exit code as [`launch`].
pub fn launch_nodes(exe: &Path, nproc: usize, nodes: &Nodes, args: &[OsString]) -> Result<i32, RuntimeError> {
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
    let world = nodes.nnodes * nproc;
    // SAFETY: installs an async-signal-safe handler (one atomic store).
    unsafe {
        signal(SIGINT, on_signal as *const () as usize);
        signal(SIGTERM, on_signal as *const () as usize);
    }
    let mut children: Vec<Option<Child>> = Vec::with_capacity(nproc);
    for r in 0..nproc {
        let rank = nodes.node_rank * nproc + r;
        let spawned = Command::new(exe)
            .args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string())
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
                return Err(RuntimeError::Train(format!("cannot start rank {rank} (`{}`): {e}", exe.display())));
            }
        }
    }
    let mut failed: Option<(usize, String)> = None;
    let mut stop_sent: Option<Instant> = None;
    let mut forwarded = 0;
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
                        failed = Some((nodes.node_rank * nproc + r, describe(status)));
                    }
                    *slot = None;
                }
                Ok(None) => running += 1,
                Err(_) => *slot = None,
            }
        }
        if running == 0 {
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
    if let Some((r, how)) = failed {
        eprintln!("smp-runner launch: rank {r} {how} first; the other ranks were stopped");
        return Ok(1);
    }
    if forwarded != 0 {
        eprintln!("smp-runner launch: stopped by signal {forwarded}");
        return Ok(128 + forwarded);
    }
    Ok(0)
}
