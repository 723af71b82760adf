//! `smp-runner launch --elastic MIN:MAX`: a job whose devices may change. When a host is lost
//! (its launcher does not come back within `--rejoin-timeout`) or a rank is (found hung, or a
//! straggler dropped), the surviving launchers agree on the new membership through node 0's
//! store ([`coordinator`]); node 0 plans the model again for the devices left with the plan's
//! own planning request ([`Replanner`]: the binary's planner, since the runtime does not plan),
//! keeps the plan beside the checkpoints (`--checkpoint-dir`/plans), and every survivor resumes
//! the newest complete checkpoint on it (resharded as any resume across plans is). The global
//! batch stays; microbatches and the data-parallel degree change, and the data stream resumes
//! at the checkpoint's step, that is at the same sample. A launcher started later joins: node 0
//! ends the round after the next checkpoint and the job grows the same way, up to MAX devices.
//! With fewer than MIN devices left the job stops, naming how many remain and the fewest the
//! planner needs. Node 0's host holds the store and rank 0: it must survive.
//!
//! A failure that changes no device (a rank killed, a lost link that comes back in time) is a
//! restart as without `--elastic`, counted against `--max-restarts`; changes of the devices are
//! not counted.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::coordinator::{self, Client, ElasticRules, Members, Membership, RoundFailure, RoundState};
use crate::runtime::heartbeat;
use super::launcher::{GrowWatch, Job, Nodes, Outcome, Restarts, RoundEnd, RoundSpec, catch_signals, caught, flag_value, rendezvous, run_args, with_resume};
use crate::plan::Plan;
use crate::runtime::RuntimeError;
use crate::runtime::rank::DROP_STRAGGLERS_ENV;
use crate::runtime::session::report::restarts_env_value;
use crate::runtime::session::{MembershipChange, RestartRecord};
use crate::runtime::state::checkpoint;

/// Plans a model again for another device count: the binary's planner (the runtime does not
/// plan).
pub trait Replanner {
    /// `plan` (read from `path`) made again for `devices` devices with the planning request it
    /// records, its global batch kept.
    fn replan(&self, plan: &Plan, path: &Path, devices: usize) -> Result<Plan, String>;
    /// The fewest devices, up to `most`, for which the planner finds a plan of `plan`'s model
    /// with its request (none: not even `most`).
    fn least_devices(&self, plan: &Plan, path: &Path, most: usize) -> Option<usize>;
}

/// `--elastic MIN:MAX` and its companions.
pub struct Elastic<'a> {
    /// The fewest devices the job goes on with.
    pub min: usize,
    /// The most devices it grows to.
    pub max: usize,
    /// How long the survivors wait for a lost host to come back (`--rejoin-timeout`).
    pub rejoin_timeout: Duration,
    /// Drop a rank named a straggler this many windows in a row (`--drop-stragglers`).
    pub drop_stragglers: Option<usize>,
    /// Plans the model for the devices left.
    pub replanner: &'a dyn Replanner,
}

/// What node 0 decided a round runs.
#[derive(Clone, Debug, PartialEq)]
enum Decision {
    /// Every member starts its ranks of `plan`: node → (first global rank, ranks), resuming
    /// the checkpoint of step `resume` under the checkpoint directory, if any.
    Go { sha: String, world: usize, ranges: BTreeMap<usize, (usize, usize)>, resume: Option<usize>, plan: PathBuf },
    /// The job ends, for this reason.
    Stop(String),
}

impl Decision {
    fn words(&self) -> String {
        match self {
            Decision::Go { sha, world, ranges, resume, plan } => {
                let r: Vec<String> = ranges.iter().map(|(n, (f, c))| format!("{n}:{f}:{c}")).collect();
                let resume = resume.map_or("-".to_string(), |s| s.to_string());
                format!("GO {sha} {world} {} {resume} {}", r.join(","), plan.display())
            }
            Decision::Stop(why) => format!("STOP {why}"),
        }
    }

    fn parse(text: &str) -> Option<Decision> {
        if let Some(why) = text.strip_prefix("STOP ") {
            return Some(Decision::Stop(why.to_string()));
        }
        let mut w = text.strip_prefix("GO ")?.splitn(5, ' ');
        let sha = w.next()?.to_string();
        let world = w.next()?.parse().ok()?;
        let ranges = w
            .next()?
            .split(',')
            .map(|r| {
                let mut p = r.split(':').map(|x| x.parse::<usize>().ok());
                Some((p.next()??, (p.next()??, p.next()??)))
            })
            .collect::<Option<BTreeMap<_, _>>>()?;
        let resume = match w.next()? {
            "-" => None,
            s => Some(s.parse().ok()?),
        };
        Some(Decision::Go { sha, world, ranges, resume, plan: PathBuf::from(w.next()?) })
    }
}

/// The ranks of each member when a plan of `world` devices runs on `members`: in node order,
/// each host's devices in turn until the plan has its ranks.
fn ranges(members: &Members, world: usize) -> BTreeMap<usize, (usize, usize)> {
    let mut next = 0;
    members
        .iter()
        .map(|(&n, &d)| {
            let take = d.min(world - next);
            let r = (n, (next, take));
            next += take;
            r
        })
        .collect()
}

fn sha256_file(path: &Path) -> Result<String, RuntimeError> {
    use sha2::Digest;
    let bytes = std::fs::read(path).map_err(|e| RuntimeError::File { path: path.display().to_string(), message: format!("cannot read the plan: {e}") })?;
    Ok(sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect())
}

fn mesh_of(plan: &Plan) -> String {
    let p = &plan.parallel;
    format!("pp{} dp{} tp{} zero{}", p.pp, p.dp, p.tp, p.zero)
}

/// The round node 0 runs now, for the next decision.
struct Current {
    members: Members,
    plan: Plan,
    path: PathBuf,
}

/// Node 0's part: decides each round's plan and keeps the restart records.
struct Planner<'e> {
    elastic: &'e Elastic<'e>,
    root: PathBuf,
    max_restarts: usize,
    restarts_used: usize,
    current: Option<Current>,
    history: Vec<RestartRecord>,
}

impl Planner<'_> {
    fn stop_fewer(&self, cur: &Current, members: &Members, devices: usize) -> Decision {
        let hosts: Vec<String> = members.iter().map(|(n, d)| format!("host {n}: {d}")).collect();
        let least = match self.elastic.replanner.least_devices(&cur.plan, &cur.path, self.elastic.max) {
            Some(l) => format!("the model needs at least {l} device{} (the planner's least for it)", if l == 1 { "" } else { "s" }),
            None => format!("the planner finds no plan of the model on up to {} devices", self.elastic.max),
        };
        let ckpt = match checkpoint::complete(&self.root).pop() {
            Some((step, dir)) => format!("the newest complete checkpoint, step {step} ({}), resumes on any plan", dir.display()),
            None => "no checkpoint was completed".into(),
        };
        Decision::Stop(format!(
            "the job stops: {devices} device{} left ({}), fewer than --elastic's least of {}; {least}; {ckpt}",
            if devices == 1 { "" } else { "s" },
            hosts.join(", "),
            self.elastic.min
        ))
    }

    /// The decision of `round` for `members`, after `failure` ended the last one.
    fn decide(&mut self, round: u32, members: &Members, failure: Option<RoundFailure>, first_plan: &Path) -> Result<Decision, RuntimeError> {
        let devices: usize = members.values().sum();
        let Some(cur) = self.current.as_ref() else {
            let plan = crate::plan::load(first_plan).map_err(|e| RuntimeError::Train(e.to_string()))?;
            let world = plan.parallel.devices();
            if world != devices {
                return Ok(Decision::Stop(format!("plan `{}` runs {world} ranks, but the hosts have {devices} devices; give each host --nproc so that they sum to {world}", first_plan.display())));
            }
            let plans = self.root.join("plans");
            std::fs::create_dir_all(&plans).map_err(|e| RuntimeError::File { path: plans.display().to_string(), message: format!("cannot create the plans' directory: {e}") })?;
            let _ = std::fs::copy(first_plan, plans.join(format!("round-0-{world}-devices.json")));
            let d = Decision::Go { sha: sha256_file(first_plan)?, world, ranges: ranges(members, world), resume: None, plan: first_plan.to_path_buf() };
            self.current = Some(Current { members: members.clone(), plan, path: first_plan.to_path_buf() });
            return Ok(d);
        };
        let f = failure.unwrap_or_else(|| RoundFailure::new(false, "the round ended"));
        let resume = checkpoint::complete(&self.root).pop();
        let from = match &resume {
            Some((step, dir)) => format!("step {step} ({})", dir.display()),
            None => "the start (no complete checkpoint)".into(),
        };
        let mut record = RestartRecord {
            attempt: round as usize,
            cause: f.what.clone(),
            resumed_from_step: resume.as_ref().map(|(s, _)| *s),
            checkpoint: resume.as_ref().map(|(_, d)| d.display().to_string()),
            membership: None,
            fault_at_unix_s: Some(f.at_unix_s),
            fault_to_first_step_s: None,
        };
        if *members == cur.members {
            // the same devices: a restart as without --elastic
            self.restarts_used += 1;
            if self.restarts_used > self.max_restarts {
                return Ok(Decision::Stop(format!("{}; no restarts left (--max-restarts {})", f.what, self.max_restarts)));
            }
            crate::logging::say!("smp-runner launch: restart {} of {}: {}; resuming from {from}", self.restarts_used, self.max_restarts, f.what);
            self.history.push(record);
            let world = cur.plan.parallel.devices();
            return Ok(Decision::Go { sha: sha256_file(&cur.path)?, world, ranges: ranges(members, world), resume: resume.map(|(s, _)| s), plan: cur.path.clone() });
        }
        if !members.contains_key(&0) {
            return Ok(Decision::Stop("host 0, which holds the rendezvous and rank 0, has no device left".into()));
        }
        if devices < self.elastic.min {
            return Ok(self.stop_fewer(cur, members, devices));
        }
        // the most devices of those left that the planner finds a plan for
        let mut last_err = String::new();
        let t0 = Instant::now();
        let mut found = None;
        for n in (self.elastic.min..=devices).rev() {
            match self.elastic.replanner.replan(&cur.plan, &cur.path, n) {
                Ok(p) => {
                    found = Some((n, p));
                    break;
                }
                Err(e) => last_err = e,
            }
        }
        let Some((n, plan)) = found else {
            return Ok(Decision::Stop(format!("the job stops: the planner finds no plan of the model on {}..{devices} devices: {last_err}", self.elastic.min)));
        };
        let path = self.root.join("plans").join(format!("round-{round}-{n}-devices.json"));
        crate::plan::save(&plan, &path).map_err(|e| RuntimeError::Train(format!("cannot keep the new plan: {e}")))?;
        let old_devices: usize = cur.members.values().sum();
        let mut lost: Vec<String> = cur.members.keys().filter(|h| !members.contains_key(h)).map(|h| format!("host {h}")).collect();
        lost.extend(f.lost.iter().filter(|(h, _)| members.contains_key(h)).map(|(h, s)| format!("host {h} device {s}")));
        let joined: Vec<String> = members
            .iter()
            .filter_map(|(h, d)| match cur.members.get(h) {
                None => Some(format!("host {h}")),
                Some(before) if d > before => Some(format!("host {h} ({} more devices)", d - before)),
                Some(_) => None,
            })
            .collect();
        let change = MembershipChange {
            lost: lost.clone(),
            joined: joined.clone(),
            devices: [cur.plan.parallel.devices(), n],
            plans: [cur.path.display().to_string(), path.display().to_string()],
            meshes: [mesh_of(&cur.plan), mesh_of(&plan)],
            predicted_step_time_s: [cur.plan.predicted.step_time_s, plan.predicted.step_time_s],
        };
        if f.grow {
            record.cause = format!("{} joined", joined.join(", "));
        }
        let who = match (lost.is_empty(), joined.is_empty()) {
            (false, true) => format!("lost {}", lost.join(", ")),
            (true, false) => format!("{} joined", joined.join(", ")),
            _ => format!("lost {}; {} joined", lost.join(", "), joined.join(", ")),
        };
        crate::logging::say!(
            "smp-runner launch: the job's devices change after {}: {who}; {old_devices} → {devices} devices; re-planned in {:.1} s: {} ({:.4} s/step predicted) → {} on {n} ({:.4} s/step), kept as {}; resuming from {from}",
            if f.grow { "a checkpoint".to_string() } else { format!("a fault ({})", f.what) },
            t0.elapsed().as_secs_f64(),
            change.meshes[0],
            change.predicted_step_time_s[0],
            change.meshes[1],
            change.predicted_step_time_s[1],
            path.display()
        );
        record.membership = Some(change);
        self.history.push(record);
        let d = Decision::Go { sha: sha256_file(&path)?, world: n, ranges: ranges(members, n), resume: resume.map(|(s, _)| s), plan: path.clone() };
        self.current = Some(Current { members: members.clone(), plan, path });
        Ok(d)
    }
}

/// Runs `exe run PLAN ARGS` as this node's `nproc` ranks of an elastic job; exit code as
/// [`super::launcher::launch`].
pub fn launch_elastic(exe: &Path, nproc: usize, nodes: &Nodes, restarts: &Restarts, elastic: &Elastic<'_>, plan: &Path, args: &[String]) -> Result<i32, RuntimeError> {
    let (addr, port) = rendezvous(nproc, nodes)?;
    let (root, first_plan, base) = elastic_paths(nproc, nodes, elastic, plan, args)?;
    catch_signals();
    // one host: any free port; several: one every launcher knows
    let store_port = match (restarts.port, nodes.nnodes) {
        (Some(p), _) => p,
        (None, 1) => loop {
            let p = super::launcher::free_port()?;
            if p != port {
                break p;
            }
        },
        (None, _) => port.wrapping_add(1),
    };
    let node = nodes.node_rank;
    if node == 0 {
        coordinator::serve(store_port, nodes.nnodes, Some(ElasticRules { max_devices: elastic.max, rejoin_timeout: elastic.rejoin_timeout }))?;
    }
    let store = Client::new(&addr, store_port);
    let job = Job::new(exe, nodes, addr, port, Some(store.clone()), restarts.timeouts)?;
    let mut env: Vec<(String, String)> = Vec::new();
    if let Some(n) = elastic.drop_stragglers {
        env.push((DROP_STRAGGLERS_ENV.to_string(), n.to_string()));
    }
    let mut run = ElasticRun {
        node,
        store,
        instance: format!("{}-{}", std::process::id(), heartbeat::unix_now_s()),
        slots: (0..nproc).collect(),
        planner: Planner { elastic, root: root.clone(), max_restarts: restarts.max, restarts_used: 0, current: None, history: Vec::new() },
        last_failure: None,
        env,
        round: 0,
        restarts,
        elastic,
        root,
        first_plan,
        base,
        args,
    };
    loop {
        if let ControlFlow::Break(code) = run.next_round(&job)? {
            return Ok(code);
        }
    }
}

/// `--elastic`'s checks; the checkpoint directory and the first plan as absolute paths, and
/// the ranks' arguments.
fn elastic_paths(nproc: usize, nodes: &Nodes, elastic: &Elastic<'_>, plan: &Path, args: &[String]) -> Result<(PathBuf, PathBuf, Vec<OsString>), RuntimeError> {
    if elastic.min == 0 || elastic.min > elastic.max {
        return Err(RuntimeError::Train(format!("--elastic {}:{}: give MIN:MAX devices with 1 ≤ MIN ≤ MAX", elastic.min, elastic.max)));
    }
    if nodes.nnodes * nproc > elastic.max {
        return Err(RuntimeError::Train(format!(
            "--elastic {}:{}: the job starts with {} devices ({} hosts × --nproc {nproc}), more than its most",
            elastic.min,
            elastic.max,
            nodes.nnodes * nproc,
            nodes.nnodes
        )));
    }
    let base: Vec<OsString> = args.iter().map(OsString::from).collect();
    let Some(root) = flag_value(&base, "--checkpoint-dir").map(PathBuf::from) else {
        return Err(RuntimeError::Train(
            "--elastic needs the ranks' --checkpoint-dir, on storage every host reads: the survivors of a loss resume its newest checkpoint, and the new plans are kept there".into(),
        ));
    };
    // a path every host and the re-planned plans agree on
    let root = if root.is_relative() { std::env::current_dir().map(|d| d.join(&root)).unwrap_or(root) } else { root };
    let first_plan = if plan.is_relative() { std::env::current_dir().map(|d| d.join(plan)).unwrap_or_else(|_| plan.to_path_buf()) } else { plan.to_path_buf() };
    Ok((root, first_plan, base))
}

/// This host's launcher across the rounds of an elastic job.
struct ElasticRun<'r> {
    node: usize,
    store: Client,
    /// This launcher's name in the store (pid and start time).
    instance: String,
    /// This host's device slots still in the job.
    slots: Vec<usize>,
    planner: Planner<'r>,
    last_failure: Option<RoundFailure>,
    /// More environment for every rank.
    env: Vec<(String, String)>,
    round: u32,
    restarts: &'r Restarts,
    elastic: &'r Elastic<'r>,
    root: PathBuf,
    first_plan: PathBuf,
    /// The ranks' arguments.
    base: Vec<OsString>,
    args: &'r [String],
}

impl ElasticRun<'_> {
    /// One round: its members, node 0's decision, this host's ranks, and how it ended; breaks
    /// with the launcher's exit code when the job ends.
    fn next_round(&mut self, job: &Job<'_>) -> Result<ControlFlow<i32>, RuntimeError> {
        let (node, round) = (self.node, self.round);
        if node == 0 && self.slots.is_empty() {
            // rank 0 and the store live here: the job cannot go on
            let why = "the job stops: host 0, which holds the rendezvous and rank 0, has no device left";
            let _ = self.store.publish(round, &Decision::Stop(why.into()).words());
            crate::logging::say!("smp-runner launch: {why}");
            std::thread::sleep(Duration::from_secs(2));
            return Ok(ControlFlow::Break(1));
        }
        let members = match self.members()? {
            ControlFlow::Continue(m) => m,
            ControlFlow::Break(code) => return Ok(ControlFlow::Break(code)),
        };
        let round = self.round;
        let decision = match self.decision(&members)? {
            ControlFlow::Continue(d) => d,
            ControlFlow::Break(code) => return Ok(ControlFlow::Break(code)),
        };
        let (sha, world, assigned, resume, plan_path) = match decision {
            Decision::Go { sha, world, ranges, resume, plan } => (sha, world, ranges, resume, plan),
            Decision::Stop(why) => {
                crate::logging::say!("smp-runner launch: {why}");
                return Ok(ControlFlow::Break(1));
            }
        };
        if node != 0 && sha256_file(&plan_path).ok().as_deref() != Some(sha.as_str()) {
            return Err(RuntimeError::Train(format!(
                "node 0's plan for start {round} is not at `{}` on this host: --checkpoint-dir must be storage every host shares",
                plan_path.display()
            )));
        }
        let (first_rank, count) = assigned.get(&node).copied().unwrap_or((0, 0));
        let end = self.run_ranks(job, &plan_path, resume, world, first_rank, count)?;
        Ok(self.ended(end))
    }

    /// The round's members: waits for the others, or to join a later round (which moves
    /// `round` on).
    fn members(&mut self) -> Result<ControlFlow<i32, Members>, RuntimeError> {
        let node = self.node;
        let started = Instant::now();
        let mut joining = false;
        let mut heard = Instant::now();
        loop {
            let sig = caught();
            if sig != 0 {
                crate::logging::say!("smp-runner launch: stopped by signal {sig}");
                return Ok(ControlFlow::Break(128 + sig));
            }
            let reply = self.store.ready_with(self.round, node, self.slots.len(), &self.instance);
            if reply.is_some() {
                heard = Instant::now();
            } else if joining && heard.elapsed() > Duration::from_secs(60) {
                crate::logging::say!("smp-runner launch: node 0's launcher has been unreachable for 60 s: the job ended or failed before host {node} could join");
                return Ok(ControlFlow::Break(1));
            }
            match reply {
                Some(Membership::Members(m)) => return Ok(ControlFlow::Continue(m)),
                Some(Membership::Late(current)) => {
                    if !joining {
                        crate::logging::say!("smp-runner launch: host {node} waits to join the job (its round {current} runs without it)");
                        joining = true;
                    }
                    self.round = current + 1;
                    continue;
                }
                Some(Membership::Done) => {
                    crate::logging::say!("smp-runner launch: the job ended before host {node} could join");
                    return Ok(ControlFlow::Break(0));
                }
                Some(Membership::Wait) | None => {}
            }
            if let (true, Some(Decision::Stop(why))) = (node != 0, self.store.decision(self.round).as_deref().and_then(Decision::parse)) {
                crate::logging::say!("smp-runner launch: {why}");
                return Ok(ControlFlow::Break(1));
            }
            if !joining && started.elapsed() > self.restarts.agree_timeout {
                let round = self.round;
                return Err(RuntimeError::Train(format!(
                    "the launchers did not agree on start {round} within {} s: node 0's launcher is gone or unreachable",
                    self.restarts.agree_timeout.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The round's decision: node 0 makes and publishes it, the others read it.
    fn decision(&mut self, members: &Members) -> Result<ControlFlow<i32, Decision>, RuntimeError> {
        let (store, round) = (&self.store, self.round);
        if self.node == 0 {
            // the failure as every host has reported it by now (each reports before it is ready)
            let mut failure = self.last_failure.take();
            if let (Some(f), Some(all)) = (failure.as_mut(), round.checked_sub(1).and_then(|r| store.failure(r))) {
                // the store's cause: a hang reported anywhere, over the exit of a peer it brought
                if !all.what.is_empty() {
                    f.what = all.what;
                }
                f.lost = all.lost;
                f.grow = all.grow;
                f.at_unix_s = f.at_unix_s.min(all.at_unix_s);
            }
            let d = self.planner.decide(round, members, failure, &self.first_plan)?;
            let text = d.words();
            while !store.publish(round, &text) {
                std::thread::sleep(Duration::from_millis(200));
            }
            return Ok(ControlFlow::Continue(d));
        }
        loop {
            if let Some(d) = store.decision(round).as_deref().and_then(Decision::parse) {
                return Ok(ControlFlow::Continue(d));
            }
            if caught() != 0 {
                return Ok(ControlFlow::Break(128 + caught()));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs this host's `count` ranks (from global rank `first_rank`) of the plan at
    /// `plan_path` on `world` devices, resuming step `resume`; none: it sits the round out.
    fn run_ranks(&mut self, job: &Job<'_>, plan_path: &Path, resume: Option<usize>, world: usize, first_rank: usize, count: usize) -> Result<RoundEnd, RuntimeError> {
        let (node, round, root) = (self.node, self.round, &self.root);
        let mut round_args = run_args(plan_path, self.args);
        if let Some(step) = resume {
            round_args = with_resume(&round_args, &checkpoint::step_dir(root, step));
        }
        let records = restarts_env_value(&self.planner.history);
        let fault_at = self.planner.history.last().filter(|_| round > 0).and_then(|r| r.fault_at_unix_s);
        let last_step = flag_value(&self.base, "--steps").and_then(|s| s.parse().ok());
        let grow = (node == 0).then(|| GrowWatch { root, devices: world, max: self.elastic.max, last_step });
        let spec = RoundSpec { round, args: &round_args, restarts_json: &records, world, first_rank, slots: &self.slots[..count.min(self.slots.len())], env: &self.env, grow, fault_at_unix_s: fault_at };
        let end = if count == 0 {
            // a plan of fewer devices than the members have: this host sits the round out
            crate::logging::say!("smp-runner launch: host {node} runs no rank of start {round} (its plan uses {world} devices)");
            idle_round(&self.store, round)
        } else {
            job.round(&spec)?
        };
        if let (Some(last), Some(t)) = (self.planner.history.last_mut().filter(|_| round > 0), end.first_step_unix_s) {
            last.fault_to_first_step_s = last.fault_at_unix_s.map(|f| (t - f).max(0.0));
        }
        Ok(end)
    }

    /// What follows a round's end: the job done, stopped, or the next round without the
    /// devices lost.
    fn ended(&mut self, end: RoundEnd) -> ControlFlow<i32> {
        match end.outcome {
            Outcome::Done => {
                if self.node == 0 {
                    // launchers waiting to join, or sitting the round out, hear that it ended
                    let _ = self.store.done(self.round);
                    std::thread::sleep(Duration::from_secs(1));
                }
                ControlFlow::Break(0)
            }
            Outcome::Signalled(sig) => {
                crate::logging::say!("smp-runner launch: stopped by signal {sig}");
                ControlFlow::Break(128 + sig)
            }
            Outcome::Failed(f) => {
                self.slots.retain(|s| !end.lost_slots.contains(s));
                if f.grow {
                    crate::logging::say!("smp-runner launch: the ranks were stopped after the checkpoint to take in the hosts waiting to join");
                } else {
                    crate::logging::say!("smp-runner launch: {}; the other ranks were stopped", f.what);
                    if f.fatal {
                        return ControlFlow::Break(1);
                    }
                    std::thread::sleep(self.restarts.backoff);
                }
                self.last_failure = Some(f);
                self.round += 1;
                ControlFlow::Continue(())
            }
        }
    }
}

/// A round this host runs no rank of: it ends when the store says so (a failure elsewhere, a
/// growth, the job done), or when node 0 is gone for a minute.
fn idle_round(store: &Client, round: u32) -> RoundEnd {
    let mut heard = Instant::now();
    loop {
        let outcome = match store.poll(round) {
            Some(RoundState::Failed(f)) => Outcome::Failed(f),
            Some(RoundState::Done) => Outcome::Done,
            Some(RoundState::Running { .. }) => {
                heard = Instant::now();
                if caught() != 0 {
                    Outcome::Signalled(caught())
                } else {
                    std::thread::sleep(Duration::from_millis(250));
                    continue;
                }
            }
            None if heard.elapsed() > Duration::from_secs(60) => Outcome::Failed(RoundFailure::new(true, "node 0's launcher has been unreachable for 60 s")),
            None => {
                std::thread::sleep(Duration::from_millis(250));
                continue;
            }
        };
        return RoundEnd { outcome, lost_slots: Vec::new(), first_step_unix_s: None, port_taken: false };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_reads_back_and_ranks_go_in_node_order() {
        let m: Members = [(0, 2), (1, 2)].into_iter().collect();
        assert_eq!(ranges(&m, 4), [(0, (0, 2)), (1, (2, 2))].into_iter().collect());
        // a plan of 3 on 4 devices leaves the last one idle
        assert_eq!(ranges(&m, 3), [(0, (0, 2)), (1, (2, 1))].into_iter().collect());
        for d in [
            Decision::Go { sha: "ab12".into(), world: 3, ranges: ranges(&m, 3), resume: Some(4), plan: PathBuf::from("/ck pt/plans/round-1-3-devices.json") },
            Decision::Go { sha: "ab12".into(), world: 4, ranges: ranges(&m, 4), resume: None, plan: PathBuf::from("p.json") },
            Decision::Stop("the job stops: 1 device left".into()),
        ] {
            assert_eq!(Decision::parse(&d.words()), Some(d.clone()), "{}", d.words());
        }
    }
}
