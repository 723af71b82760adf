//! How the launchers of a job agree on restarts and, under `--elastic`, on the job's devices.
//! Node 0's launcher serves a small store of its own (rank 0's TCPStore dies with rank 0): one
//! text line per request over a fresh TCP connection, so a launcher whose link dropped simply
//! asks again once it is back.
//!
//! ```text
//! READY <round> <node>                       → GO | WAIT
//! READY <round> <node> <devices> <instance>  → MEMBERS <node>:<devices>,… | WAIT | LATE <round>
//! FAIL <round> <final> <at> <lost> <text>    → OK      a local rank failed; lost: node:slot,… or -
//! GROW <round> <at>                          → OK      node 0 ends the round to take in joiners
//! POLL <round>                               → RUNNING <joining devices> | FAILED <final> <at> <grow> <lost> <text>
//! PLAN <round> <decision>                    → OK      node 0 publishes the round's plan
//! PLAN? <round>                              → WAIT | <decision>
//! DONE <round>                               → OK      node 0: the job ended well in this round
//! ```
//!
//! Once the job is done, `POLL` and `READY` of any later round answer `DONE`. Under
//! `--elastic`, a round whose first failure loses no device (a peer's exit, which a hung rank
//! may have brought) is told to the others one heartbeat later, or at once when a report that
//! loses a device comes first: that one is then the round's cause.
//!
//! A round is one start of every rank; it ends for everyone at the first failure any launcher
//! reports. Without `--elastic` it begins once every launcher is READY. Under `--elastic` the
//! READY requests carry the devices each launcher has left, and the store decides the round's
//! members: every member of the last round and every launcher waiting to join, once all are
//! ready, or after the rejoin timeout those that are (up to the most devices allowed). A
//! launcher that asks too late, or a new one (another instance) for a round that has begun,
//! hears `LATE` and waits to join a later round; node 0 sees the devices waiting (`POLL`) and
//! ends a round for them at the next checkpoint (`GROW`). Node 0 then plans the round
//! (`PLAN`), and the others read it (`PLAN?`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::runtime::RuntimeError;

/// A failure of a round, as the launchers share it.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundFailure {
    /// Whether the run must not be restarted (a user error).
    pub fatal: bool,
    /// What failed, in words (the rank and its cause).
    pub what: String,
    /// When the fault happened, as the launcher that saw it best knows (seconds since the Unix
    /// epoch: a hung rank's last sign of life).
    pub at_unix_s: f64,
    /// Devices lost: (node, local device slot) of ranks found hung or dropped.
    pub lost: Vec<(usize, usize)>,
    /// The round ended to take in joining hosts, not for a fault.
    pub grow: bool,
}

impl RoundFailure {
    /// A failure `what` seen now, losing no device.
    pub fn new(fatal: bool, what: impl Into<String>) -> RoundFailure {
        RoundFailure { fatal, what: what.into(), at_unix_s: crate::runtime::heartbeat::unix_now_s(), lost: Vec::new(), grow: false }
    }
}

fn lost_words(lost: &[(usize, usize)]) -> String {
    if lost.is_empty() {
        return "-".into();
    }
    lost.iter().map(|(n, s)| format!("{n}:{s}")).collect::<Vec<_>>().join(",")
}

fn parse_lost(w: &str) -> Vec<(usize, usize)> {
    w.split(',').filter_map(|p| p.split_once(':')).filter_map(|(n, s)| Some((n.parse().ok()?, s.parse().ok()?))).collect()
}

/// Hosts and their devices, by node (a round's members).
pub type Members = BTreeMap<usize, usize>;

fn members_words(m: &Members) -> String {
    m.iter().map(|(n, d)| format!("{n}:{d}")).collect::<Vec<_>>().join(",")
}

fn parse_members(w: &str) -> Members {
    w.split(',').filter_map(|p| p.split_once(':')).filter_map(|(n, d)| Some((n.parse().ok()?, d.parse().ok()?))).collect()
}

/// The store's elastic rules.
#[derive(Clone, Copy, Debug)]
pub struct ElasticRules {
    /// The most devices a round may have.
    pub max_devices: usize,
    /// How long the members of a round wait for a missing one before going on without it.
    pub rejoin_timeout: Duration,
}

#[derive(Default)]
struct State {
    /// Per round, the launchers ready for it: node → (devices, instance).
    ready: BTreeMap<u32, BTreeMap<usize, (usize, String)>>,
    /// Per round once decided, its members with their instances.
    decided: BTreeMap<u32, BTreeMap<usize, (usize, String)>>,
    failed: BTreeMap<u32, RoundFailure>,
    /// When each round's failure was first reported.
    failed_at: BTreeMap<u32, Instant>,
    /// Under `--elastic`, per round whose first failure lost no device (a peer's exit, perhaps
    /// brought by a hang): until when the others are not told of it, so that a hang their
    /// launchers find meanwhile becomes the round's cause. Ends early at a report losing a
    /// device.
    held: BTreeMap<u32, Instant>,
    plans: BTreeMap<u32, String>,
    /// The newest decided round.
    current: Option<u32>,
    /// The round in which the job ended well.
    done: Option<u32>,
}

impl State {
    /// Whether round `r` can be decided now under `rules`, for `nnodes` launchers at the
    /// start; decides it if so.
    fn try_decide(&mut self, r: u32, rules: &ElasticRules, nnodes: usize) {
        if self.decided.contains_key(&r) {
            return;
        }
        let ready = self.ready.get(&r).cloned().unwrap_or_default();
        let expected: BTreeSet<usize> = match r.checked_sub(1).and_then(|p| self.decided.get(&p)) {
            None => (0..nnodes).collect(),
            // the last round's members, and launchers waiting to join (ready for r already)
            Some(prev) => prev.keys().copied().chain(ready.keys().copied()).collect(),
        };
        let all_here = expected.iter().all(|n| ready.contains_key(n));
        let waited_out = r > 0 && self.failed_at.get(&(r - 1)).is_some_and(|t| t.elapsed() > rules.rejoin_timeout);
        if !(all_here || waited_out) || !ready.contains_key(&0) {
            return;
        }
        // the last round's members first (node order), then joiners, up to the most devices
        let prev: BTreeSet<usize> = r.checked_sub(1).and_then(|p| self.decided.get(&p)).map(|m| m.keys().copied().collect()).unwrap_or_default();
        let mut order: Vec<usize> = ready.keys().copied().filter(|n| prev.contains(n) || r == 0).collect();
        order.extend(ready.keys().copied().filter(|n| !prev.contains(n) && r > 0));
        let mut total = 0;
        let mut members = BTreeMap::new();
        for n in order {
            let (d, inst) = &ready[&n];
            if *d > 0 && (total + d <= rules.max_devices.max(1) || n == 0) {
                total += d;
                members.insert(n, (*d, inst.clone()));
            }
        }
        self.decided.insert(r, members);
        self.current = Some(self.current.map_or(r, |c| c.max(r)));
    }

    /// Whether round `r`'s failure is still held from the others at `now`.
    fn held(&self, r: u32, now: Instant) -> bool {
        self.held.get(&r).is_some_and(|&until| now < until)
    }

    /// Devices of launchers waiting to join the round after `r`.
    fn joining(&self, r: u32) -> usize {
        let members = self.decided.get(&r);
        self.ready.get(&(r + 1)).map_or(0, |m| m.iter().filter(|(n, _)| members.is_none_or(|mm| !mm.contains_key(n))).map(|(_, (d, _))| d).sum())
    }
}

/// Node 0's side: serves the store on `port` for `nnodes` launchers (with `elastic` rules
/// under `--elastic`), until the process ends.
pub fn serve(port: u16, nnodes: usize, elastic: Option<ElasticRules>) -> Result<(), RuntimeError> {
    let listener = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| RuntimeError::Train(format!("the launchers' store cannot listen on port {port}: {e}; pass a free --restart-port")))?;
    let state = Arc::new(Mutex::new(State::default()));
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let state = state.clone();
            std::thread::spawn(move || {
                let _ = answer(conn, &state, nnodes, elastic.as_ref());
            });
        }
    });
    Ok(())
}

fn answer(conn: TcpStream, state: &Mutex<State>, nnodes: usize, elastic: Option<&ElasticRules>) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    let reply = respond(line.trim_end(), state, nnodes, elastic).map_err(std::io::Error::other)?;
    (&conn).write_all(format!("{reply}\n").as_bytes())
}

fn respond(line: &str, state: &Mutex<State>, nnodes: usize, elastic: Option<&ElasticRules>) -> Result<String, String> {
    let mut s = state.lock().map_err(|_| "poisoned".to_string())?;
    let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
    let (round, rest) = rest.split_once(' ').unwrap_or((rest, ""));
    let Ok(r) = round.parse::<u32>() else { return Ok("ERROR unknown request".into()) };
    let words: Vec<&str> = rest.split(' ').collect();
    if s.done.is_some_and(|d| r >= d) && matches!(verb, "READY" | "POLL") {
        return Ok("DONE".into());
    }
    Ok(match (verb, elastic) {
        ("READY", None) => {
            let node = words.first().and_then(|n| n.parse::<usize>().ok()).unwrap_or(usize::MAX);
            let ready = s.ready.entry(r).or_default();
            ready.insert(node, (0, String::new()));
            if ready.len() >= nnodes { "GO".into() } else { "WAIT".into() }
        }
        ("READY", Some(rules)) => {
            let (Some(node), Some(devices), Some(instance)) = (words.first().and_then(|n| n.parse::<usize>().ok()), words.get(1).and_then(|d| d.parse::<usize>().ok()), words.get(2)) else {
                return Ok("ERROR READY needs a node, devices and an instance".into());
            };
            // a member of r - 1 ready for r knows how r - 1 ended: no need to hold it longer
            if let Some(p) = r.checked_sub(1)
                && s.decided.get(&p).is_some_and(|m| m.get(&node).is_some_and(|(_, i)| i == instance))
            {
                s.held.remove(&p);
            }
            if let Some(current) = s.current.filter(|&c| r < c) {
                return Ok(format!("LATE {current}"));
            }
            if let Some(m) = s.decided.get(&r) {
                return Ok(match m.get(&node) {
                    Some((_, inst)) if inst == instance => format!("MEMBERS {}", members_words(&m.iter().map(|(n, (d, _))| (*n, *d)).collect())),
                    _ => format!("LATE {r}"),
                });
            }
            s.ready.entry(r).or_default().insert(node, (devices, instance.to_string()));
            s.try_decide(r, rules, nnodes);
            match s.decided.get(&r) {
                Some(m) if m.get(&node).is_some_and(|(_, i)| i == instance) => format!("MEMBERS {}", members_words(&m.iter().map(|(n, (d, _))| (*n, *d)).collect())),
                Some(_) => format!("LATE {r}"),
                None => "WAIT".into(),
            }
        }
        ("FAIL", _) => {
            // FAIL <round> <final> <at> <lost> <text>
            let fatal = words.first() == Some(&"1");
            let at = words.get(1).and_then(|t| t.parse::<f64>().ok()).unwrap_or(0.0);
            let lost = words.get(2).map(|w| parse_lost(w)).unwrap_or_default();
            let what = words.get(3..).map(|w| w.join(" ")).unwrap_or_default();
            s.failed_at.entry(r).or_insert_with(Instant::now);
            if elastic.is_some() && !fatal && lost.is_empty() && !s.failed.contains_key(&r) {
                // a peer's exit first: a hang may have brought it, its report one beat away
                s.held.insert(r, Instant::now() + crate::runtime::heartbeat::INTERVAL);
            }
            if !lost.is_empty() {
                s.held.remove(&r);
            }
            let f = s.failed.entry(r).or_insert(RoundFailure { fatal, what: what.clone(), at_unix_s: at, lost: Vec::new(), grow: false });
            // a failure that lost a device (a hung rank) is the cause of the others it brings
            if f.lost.is_empty() && !lost.is_empty() {
                f.what = what;
            }
            f.fatal |= fatal;
            f.at_unix_s = f.at_unix_s.min(at);
            for l in lost {
                if !f.lost.contains(&l) {
                    f.lost.push(l);
                }
            }
            "OK".into()
        }
        ("GROW", _) => {
            let at = words.first().and_then(|t| t.parse::<f64>().ok()).unwrap_or(0.0);
            s.failed_at.entry(r).or_insert_with(Instant::now);
            s.failed.entry(r).or_insert(RoundFailure { fatal: false, what: "hosts join the job".into(), at_unix_s: at, lost: Vec::new(), grow: true });
            "OK".into()
        }
        ("POLL", _) => {
            if let Some(rules) = elastic {
                // a round waiting for a member decides when the rejoin timeout passes
                s.try_decide(r + 1, rules, nnodes);
            }
            match s.failed.get(&r).filter(|_| !s.held(r, Instant::now())) {
                Some(f) => format!("FAILED {} {} {} {} {}", u8::from(f.fatal), f.at_unix_s, u8::from(f.grow), lost_words(&f.lost), f.what),
                None => format!("RUNNING {}", s.joining(r)),
            }
        }
        ("PLAN", _) => {
            s.plans.entry(r).or_insert_with(|| rest.to_string());
            "OK".into()
        }
        ("PLAN?", _) => s.plans.get(&r).cloned().unwrap_or_else(|| "WAIT".into()),
        ("DONE", _) => {
            s.done = Some(r);
            "OK".into()
        }
        _ => "ERROR unknown request".into(),
    })
}

fn parse_poll(reply: &str) -> Option<RoundState> {
    if reply == "DONE" {
        return Some(RoundState::Done);
    }
    if let Some(j) = reply.strip_prefix("RUNNING") {
        return Some(RoundState::Running { joining: j.trim().parse().unwrap_or(0) });
    }
    let rest = reply.strip_prefix("FAILED ")?;
    let mut w = rest.splitn(5, ' ');
    let fatal = w.next()? == "1";
    let at_unix_s = w.next()?.parse().ok()?;
    let grow = w.next()? == "1";
    let lost = parse_lost(w.next()?);
    let what = w.next().unwrap_or("").to_string();
    Some(RoundState::Failed(RoundFailure { fatal, what, at_unix_s, lost, grow }))
}

/// A launcher's side: asks node 0's store.
#[derive(Clone, Debug)]
pub struct Client {
    addr: String,
    port: u16,
}

/// What the store says of a round under `--elastic`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Membership {
    /// Not decided yet.
    Wait,
    /// The round's members (this launcher among them).
    Members(Members),
    /// This launcher is not in the round; the newest decided round is this one.
    Late(u32),
    /// The job has ended.
    Done,
}

/// What the store says of a round in progress.
#[derive(Clone, Debug, PartialEq)]
pub enum RoundState {
    /// Running, with the devices of launchers waiting to join.
    Running { joining: usize },
    /// Ended by a failure (or to grow).
    Failed(RoundFailure),
    /// The job ended well.
    Done,
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

    /// Under `--elastic`: this launcher (`instance`) of `node` is ready for `round` with
    /// `devices`; what the store decided (none when it cannot be reached).
    pub fn ready_with(&self, round: u32, node: usize, devices: usize, instance: &str) -> Option<Membership> {
        let reply = self.ask(&format!("READY {round} {node} {devices} {instance}"))?;
        Some(if let Some(m) = reply.strip_prefix("MEMBERS ") {
            Membership::Members(parse_members(m))
        } else if let Some(c) = reply.strip_prefix("LATE ") {
            Membership::Late(c.trim().parse().ok()?)
        } else if reply == "DONE" {
            Membership::Done
        } else {
            Membership::Wait
        })
    }

    /// Tells the others that `round` failed; false when the store cannot be reached.
    pub fn fail(&self, round: u32, f: &RoundFailure) -> bool {
        let what = f.what.replace('\n', " ");
        self.ask(&format!("FAIL {round} {} {} {} {what}", u8::from(f.fatal), f.at_unix_s, lost_words(&f.lost))).is_some_and(|r| r == "OK")
    }

    /// Node 0: ends `round` to take in the launchers waiting to join.
    pub fn grow(&self, round: u32, at_unix_s: f64) -> bool {
        self.ask(&format!("GROW {round} {at_unix_s}")).is_some_and(|r| r == "OK")
    }

    /// How `round` stands (none when the store cannot be reached).
    pub fn poll(&self, round: u32) -> Option<RoundState> {
        parse_poll(&self.ask(&format!("POLL {round}"))?)
    }

    /// The failure of `round` some launcher reported, if any (none also when unreachable).
    pub fn failure(&self, round: u32) -> Option<RoundFailure> {
        match self.poll(round)? {
            RoundState::Failed(f) => Some(f),
            RoundState::Running { .. } | RoundState::Done => None,
        }
    }

    /// Node 0: publishes the plan decision of `round` (one line).
    pub fn publish(&self, round: u32, decision: &str) -> bool {
        self.ask(&format!("PLAN {round} {}", decision.replace('\n', " "))).is_some_and(|r| r == "OK")
    }

    /// Node 0: the job ended well in `round`.
    pub fn done(&self, round: u32) -> bool {
        self.ask(&format!("DONE {round}")).is_some_and(|r| r == "OK")
    }

    /// The plan decision of `round`, once node 0 has published it.
    pub fn decision(&self, round: u32) -> Option<String> {
        self.ask(&format!("PLAN? {round}")).filter(|r| r != "WAIT")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(s: &Mutex<State>, rules: &ElasticRules, line: &str) -> String {
        respond(line, s, 2, Some(rules)).unwrap()
    }

    #[test]
    fn the_survivors_go_on_after_the_rejoin_timeout_and_a_new_launcher_joins_later() {
        let rules = ElasticRules { max_devices: 4, rejoin_timeout: Duration::from_millis(50) };
        let s = Mutex::new(State::default());
        // round 0: both hosts
        assert_eq!(ask(&s, &rules, "READY 0 0 2 a"), "WAIT");
        assert_eq!(ask(&s, &rules, "READY 0 1 2 b"), "MEMBERS 0:2,1:2");
        assert_eq!(ask(&s, &rules, "READY 0 0 2 a"), "MEMBERS 0:2,1:2");
        assert_eq!(ask(&s, &rules, "POLL 0"), "RUNNING 0");
        // host 1 dies: host 0's rank fails; host 0 waits for host 1 until the rejoin timeout
        assert_eq!(ask(&s, &rules, "FAIL 0 0 100.5 - rank 0 exited with status 3 first"), "OK");
        // held from the others a beat (it lost no device), until host 0 is ready for round 1
        assert_eq!(ask(&s, &rules, "POLL 0"), "RUNNING 0");
        assert_eq!(ask(&s, &rules, "READY 1 0 2 a"), "WAIT");
        assert!(ask(&s, &rules, "POLL 0").starts_with("FAILED 0 100.5 0 - rank 0 exited"));
        std::thread::sleep(Duration::from_millis(80));
        assert_eq!(ask(&s, &rules, "READY 1 0 2 a"), "MEMBERS 0:2");
        // host 1's old launcher, back too late; a new one for round 0 is late as well
        assert_eq!(ask(&s, &rules, "READY 1 1 2 b"), "LATE 1");
        assert_eq!(ask(&s, &rules, "READY 0 1 2 c"), "LATE 1");
        // the new launcher waits for round 2: node 0 sees it, ends round 1 at a checkpoint
        assert_eq!(ask(&s, &rules, "READY 2 1 2 c"), "WAIT");
        assert_eq!(ask(&s, &rules, "POLL 1"), "RUNNING 2");
        assert_eq!(ask(&s, &rules, "GROW 1 200"), "OK");
        assert!(ask(&s, &rules, "POLL 1").starts_with("FAILED 0 200 1 - "));
        assert_eq!(ask(&s, &rules, "READY 2 0 2 a"), "MEMBERS 0:2,1:2");
        assert_eq!(ask(&s, &rules, "READY 2 1 2 c"), "MEMBERS 0:2,1:2");
        // plans
        assert_eq!(ask(&s, &rules, "PLAN? 2"), "WAIT");
        assert_eq!(ask(&s, &rules, "PLAN 2 GO abc 4 0:0:2,1:2:2 - /x/plan.json"), "OK");
        assert_eq!(ask(&s, &rules, "PLAN? 2"), "GO abc 4 0:0:2,1:2:2 - /x/plan.json");
        // the job ends: a launcher waiting for a later round hears it
        assert_eq!(ask(&s, &rules, "DONE 2"), "OK");
        assert_eq!(ask(&s, &rules, "READY 3 1 2 d"), "DONE");
        assert_eq!(ask(&s, &rules, "POLL 2"), "DONE");
    }

    #[test]
    fn a_peer_s_exit_is_held_a_heartbeat_so_that_a_hang_found_meanwhile_is_the_cause() {
        let rules = ElasticRules { max_devices: 4, rejoin_timeout: Duration::from_secs(60) };
        let s = Mutex::new(State::default());
        ask(&s, &rules, "READY 0 0 2 a");
        assert_eq!(ask(&s, &rules, "READY 0 1 2 b"), "MEMBERS 0:2,1:2");
        // host 0's rank exits on a collective timeout: the others are not told yet
        assert_eq!(ask(&s, &rules, "FAIL 0 0 60 - rank 0 exited with status 1 first"), "OK");
        assert_eq!(ask(&s, &rules, "POLL 0"), "RUNNING 0");
        // host 1 finds the rank that brought it hung: told at once, the hang the cause
        assert_eq!(ask(&s, &rules, "FAIL 0 0 55 1:1 rank 3 is hung"), "OK");
        match parse_poll(&ask(&s, &rules, "POLL 0")) {
            Some(RoundState::Failed(f)) => assert_eq!((f.what.as_str(), f.lost, f.at_unix_s), ("rank 3 is hung", vec![(1, 1)], 55.0)),
            other => panic!("{other:?}"),
        }
        // no hang reported: the exit is told once the beat has passed
        assert_eq!(ask(&s, &rules, "FAIL 1 0 70 - rank 1 exited with status 1 first"), "OK");
        assert_eq!(ask(&s, &rules, "POLL 1"), "RUNNING 0");
        let until = s.lock().unwrap().held[&1];
        assert!(until <= Instant::now() + crate::runtime::heartbeat::INTERVAL);
        assert!(s.lock().unwrap().held(1, until - Duration::from_millis(1)));
        assert!(!s.lock().unwrap().held(1, until));
        s.lock().unwrap().held.insert(1, Instant::now());
        assert!(ask(&s, &rules, "POLL 1").starts_with("FAILED 0 70 0 - rank 1 exited"));
        // a member ready for the next round knows this one failed: the hold ends (a launcher
        // waiting to join does not end it)
        let t = Mutex::new(State::default());
        ask(&t, &rules, "READY 0 0 2 a");
        assert_eq!(ask(&t, &rules, "READY 0 1 2 b"), "MEMBERS 0:2,1:2");
        assert_eq!(ask(&t, &rules, "FAIL 0 0 75 - rank 0 exited with status 1 first"), "OK");
        t.lock().unwrap().held.insert(0, Instant::now() + Duration::from_secs(60));
        assert_eq!(ask(&t, &rules, "POLL 0"), "RUNNING 0");
        assert_eq!(ask(&t, &rules, "READY 1 2 2 c"), "WAIT");
        assert_eq!(ask(&t, &rules, "POLL 0"), "RUNNING 2");
        assert_eq!(ask(&t, &rules, "READY 1 1 2 b"), "WAIT");
        assert!(ask(&t, &rules, "POLL 0").starts_with("FAILED 0 75 0 - rank 0 exited"));
        // a user error, and any failure without --elastic, is told at once
        assert_eq!(ask(&s, &rules, "FAIL 2 1 80 - rank 0 exited with status 1 first"), "OK");
        assert!(ask(&s, &rules, "POLL 2").starts_with("FAILED 1 80"));
        assert_eq!(respond("FAIL 3 0 90 - rank 0 exited with status 3 first", &s, 2, None).unwrap(), "OK");
        assert!(respond("POLL 3", &s, 2, None).unwrap().starts_with("FAILED 0 90"));
    }

    #[test]
    fn lost_devices_accumulate_and_joiners_stop_at_the_most_devices() {
        let rules = ElasticRules { max_devices: 3, rejoin_timeout: Duration::from_secs(60) };
        let s = Mutex::new(State::default());
        ask(&s, &rules, "READY 0 0 2 a");
        assert_eq!(ask(&s, &rules, "READY 0 1 1 b"), "MEMBERS 0:2,1:1");
        ask(&s, &rules, "FAIL 0 0 50 0:1 rank 1 is hung");
        ask(&s, &rules, "FAIL 0 0 40 1:0 rank 2 is hung");
        match parse_poll(&ask(&s, &rules, "POLL 0")) {
            Some(RoundState::Failed(f)) => {
                assert_eq!(f.lost, vec![(0, 1), (1, 0)]);
                assert_eq!(f.at_unix_s, 40.0);
                assert_eq!(f.what, "rank 1 is hung");
            }
            other => panic!("{other:?}"),
        }
        // a rank failing on a peer reported before the hung peer: the hung one is the cause
        ask(&s, &rules, "FAIL 5 0 60 - rank 0 exited with status 3 first");
        ask(&s, &rules, "FAIL 5 0 55 1:1 rank 3 is hung");
        match parse_poll(&ask(&s, &rules, "POLL 5")) {
            Some(RoundState::Failed(f)) => assert_eq!((f.what.as_str(), f.lost, f.at_unix_s), ("rank 3 is hung", vec![(1, 1)], 55.0)),
            other => panic!("{other:?}"),
        }
        // a third host would pass the most devices: left out; a host without devices too
        ask(&s, &rules, "READY 1 2 3 c");
        ask(&s, &rules, "READY 1 1 0 b");
        assert_eq!(ask(&s, &rules, "READY 1 0 1 a"), "MEMBERS 0:1");
        assert_eq!(ask(&s, &rules, "READY 1 2 3 c"), "LATE 1");
        assert_eq!(ask(&s, &rules, "READY 1 1 0 b"), "LATE 1");
    }
}
