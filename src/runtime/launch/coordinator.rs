//! How the launchers of a job on several hosts agree on a restart. Node 0's launcher serves a
//! small store of its own (rank 0's TCPStore dies with rank 0): one text line per request over
//! a fresh TCP connection, so a launcher whose link dropped simply asks again once it is back.
//!
//! ```text
//! READY <round> <node>          → GO | WAIT      every launcher, before it starts a round
//! FAIL <round> <final> <text>   → OK             a local rank failed (final: not to retry)
//! POLL <round>                  → RUNNING | FAILED <final> <text>
//! ```
//!
//! A round is one start of every rank; it begins on every host once all launchers are READY
//! for it, and ends for everyone at the first failure any launcher reports.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::runtime::RuntimeError;

/// A failure of a round, as the launchers share it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoundFailure {
    /// Whether the run must not be restarted (a user error).
    pub fatal: bool,
    /// What failed, in words (the rank and its cause).
    pub what: String,
}

#[derive(Default)]
struct State {
    ready: BTreeMap<u32, BTreeSet<usize>>,
    failed: BTreeMap<u32, RoundFailure>,
}

/// Node 0's side: serves the store on `port` for `nnodes` launchers, until the process ends.
pub fn serve(port: u16, nnodes: usize) -> Result<(), RuntimeError> {
    let listener = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| RuntimeError::Train(format!("the launchers' store cannot listen on port {port}: {e}; pass a free --restart-port")))?;
    let state = Arc::new(Mutex::new(State::default()));
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let state = state.clone();
            std::thread::spawn(move || {
                let _ = answer(conn, &state, nnodes);
            });
        }
    });
    Ok(())
}

fn answer(conn: TcpStream, state: &Mutex<State>, nnodes: usize) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    let mut words = line.trim_end().splitn(4, ' ');
    let (verb, round) = (words.next().unwrap_or(""), words.next().and_then(|r| r.parse::<u32>().ok()));
    let reply = match (verb, round) {
        ("READY", Some(r)) => {
            let node = words.next().and_then(|n| n.parse::<usize>().ok()).unwrap_or(usize::MAX);
            let mut s = state.lock().map_err(|_| std::io::Error::other("poisoned"))?;
            let ready = s.ready.entry(r).or_default();
            ready.insert(node);
            if ready.len() >= nnodes { "GO".to_string() } else { "WAIT".to_string() }
        }
        ("FAIL", Some(r)) => {
            let fatal = words.next() == Some("1");
            let what = words.next().unwrap_or("").to_string();
            let mut s = state.lock().map_err(|_| std::io::Error::other("poisoned"))?;
            s.failed.entry(r).or_insert(RoundFailure { fatal, what });
            "OK".to_string()
        }
        ("POLL", Some(r)) => {
            let s = state.lock().map_err(|_| std::io::Error::other("poisoned"))?;
            match s.failed.get(&r) {
                Some(f) => format!("FAILED {} {}", u8::from(f.fatal), f.what),
                None => "RUNNING".to_string(),
            }
        }
        _ => "ERROR unknown request".to_string(),
    };
    (&conn).write_all(format!("{reply}\n").as_bytes())
}

/// A launcher's side: asks node 0's store.
#[derive(Clone, Debug)]
pub struct Client {
    addr: String,
    port: u16,
}

impl Client {
    /// The store of node 0 at `addr:port`.
    pub fn new(addr: &str, port: u16) -> Client {
        Client { addr: addr.to_string(), port }
    }

    fn ask(&self, request: &str) -> Option<String> {
        let addrs: Vec<SocketAddr> = (self.addr.as_str(), self.port).to_socket_addrs().ok()?.collect();
        let conn = addrs.iter().find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).ok())?;
        conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        (&conn).write_all(format!("{request}\n").as_bytes()).ok()?;
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line).ok()?;
        Some(line.trim_end().to_string())
    }

    /// Whether every launcher is ready for `round` (none when the store cannot be reached).
    pub fn ready(&self, round: u32, node: usize) -> Option<bool> {
        self.ask(&format!("READY {round} {node}")).map(|r| r == "GO")
    }

    /// Tells the others that `round` failed; false when the store cannot be reached.
    pub fn fail(&self, round: u32, f: &RoundFailure) -> bool {
        let what = f.what.replace('\n', " ");
        self.ask(&format!("FAIL {round} {} {what}", u8::from(f.fatal))).is_some_and(|r| r == "OK")
    }

    /// The failure of `round` some launcher reported, if any (none also when unreachable).
    pub fn failure(&self, round: u32) -> Option<RoundFailure> {
        let reply = self.ask(&format!("POLL {round}"))?;
        let rest = reply.strip_prefix("FAILED ")?;
        let (fatal, what) = rest.split_once(' ').unwrap_or((rest, ""));
        Some(RoundFailure { fatal: fatal == "1", what: what.to_string() })
    }
}
