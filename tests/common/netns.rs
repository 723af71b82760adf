//! Two hosts for multi-host tests: two Linux network namespaces joined by a veth pair (each
//! sees only its own loopback and its end of the link). Needs root and iproute2, as CI runs.

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

/// Runs `ip ARGS`.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let r = Command::new("ip").args(args).output().map_err(|e| format!("cannot run `ip` ({e})"))?;
    if r.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&r.stderr).trim()))
    }
}

/// Two namespaces joined by a veth pair, removed on drop.
pub struct Hosts {
    /// The namespaces' names.
    pub names: [String; 2],
    /// Each one's address on the link.
    pub addrs: [String; 2],
}

impl Hosts {
    /// Two fresh namespaces (unique names: the tests of a file run in parallel in one process).
    pub fn new() -> Result<Hosts, String> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let id = format!("{}n{}", std::process::id(), NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let names = [format!("smp{id}a"), format!("smp{id}b")];
        // each namespace has its own addresses: fixed ones cannot collide with other tests'
        let addrs = ["10.200.0.1".to_string(), "10.200.0.2".to_string()];
        ip(&["netns", "add", &names[0]])?;
        let hosts = Hosts { names: names.clone(), addrs: addrs.clone() };
        ip(&["netns", "add", &names[1]])?;
        ip(&["link", "add", "veth0", "netns", &names[0], "type", "veth", "peer", "name", "veth1", "netns", &names[1]])?;
        for (i, dev) in ["veth0", "veth1"].iter().enumerate() {
            ip(&["-n", &names[i], "addr", "add", &format!("{}/30", addrs[i]), "dev", dev])?;
            ip(&["-n", &names[i], "link", "set", dev, "up"])?;
            ip(&["-n", &names[i], "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// The hosts, or a failure saying what the test needs.
    pub fn needed() -> Hosts {
        Hosts::new().unwrap_or_else(|why| panic!("two network namespaces joined by a veth pair are needed (root and iproute2, as CI runs): {why}"))
    }

    /// The processes in host `i`'s namespace.
    pub fn pids(&self, i: usize) -> Vec<i32> {
        let out = Command::new("ip").args(["netns", "pids", &self.names[i]]).output().map(|o| o.stdout).unwrap_or_default();
        String::from_utf8_lossy(&out).split_whitespace().filter_map(|p| p.parse().ok()).collect()
    }

    /// The host lost: every process in its namespace SIGKILLed; returns how many.
    pub fn kill_all(&self, i: usize) -> usize {
        let pids = self.pids(i);
        for p in &pids {
            let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
        }
        pids.len()
    }

    /// Starts `smp-runner launch` (with `launch` flags, then the plan and the ranks' `run`
    /// arguments) in host `i` as node `i` of `nnodes`, its stderr read line by line into `tx`.
    pub fn start(&self, i: usize, nnodes: usize, port: u16, launch: &[&str], plan: &Path, run: &[String], tx: &Sender<(usize, String)>) -> Child {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.names[i], env!("CARGO_BIN_EXE_smp-runner"), "launch", "--nnodes", &nnodes.to_string()])
            .args(["--node-rank", &i.to_string(), "--master-addr", &self.addrs[0], "--master-port", &port.to_string()])
            .args(launch)
            .arg(plan)
            .args(run)
            .env_remove("GLOO_SOCKET_IFNAME")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send((i, line));
            }
        });
        child
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for i in 0..2 {
            self.kill_all(i);
        }
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

/// Lines of `rx` until one for which `until` holds (or `limit` passes); returns every line
/// seen, that one last.
pub fn lines_until(rx: &Receiver<(usize, String)>, limit: Duration, until: impl Fn(&(usize, String)) -> bool) -> Vec<(usize, String)> {
    let t0 = Instant::now();
    let mut seen = Vec::new();
    while let Some(left) = limit.checked_sub(t0.elapsed()) {
        match rx.recv_timeout(left) {
            Ok(l) => {
                let done = until(&l);
                seen.push(l);
                if done {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    seen
}

/// The step of a rank's progress line (`[rank R] step N loss …`), if it is one.
pub fn step_of(line: &str) -> Option<u64> {
    line.split("] step ").nth(1).and_then(|t| t.split(' ').next()?.parse::<u64>().ok())
}
