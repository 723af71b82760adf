//! Signs of life from each rank to its launcher. A thread of the rank rewrites a small file
//! (named by [`HEARTBEAT_ENV`]) twice a second: a counter, the phase the rank is in (start-up,
//! step N, validation, checkpoint, finishing) and for how long, and the collective or message
//! it waits on, if any. The launcher reads it ([`Watch`]) to find a rank that is hung (no sign
//! of life, or a phase past its timeout without waiting on anyone) and what the others wait on.
//!
//! The file is one line of `key=value` words, the wait last (it holds spaces):
//! `beat=12 phase=step step=4 phase_s=1.250 waited_s=0.500 wait=all_reduce over ranks [0, 1]`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::runtime::comm::{self, Waiting};

/// The environment variable naming the file a rank's heartbeat goes to (set by the launcher).
pub const HEARTBEAT_ENV: &str = "SMP_HEARTBEAT";

/// How often a rank rewrites its heartbeat.
pub const INTERVAL: Duration = Duration::from_millis(500);

/// What a rank is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Loading the plan, the model and the checkpoint, and joining the process groups.
    Startup,
    /// Running step N.
    Step(usize),
    /// Validating after step N.
    Eval(usize),
    /// Writing the checkpoint of step N.
    Checkpoint(usize),
    /// After the last step: the report and the final weights.
    Finish,
}

impl Phase {
    fn words(self) -> (&'static str, Option<usize>) {
        match self {
            Phase::Startup => ("startup", None),
            Phase::Step(n) => ("step", Some(n)),
            Phase::Eval(n) => ("eval", Some(n)),
            Phase::Checkpoint(n) => ("checkpoint", Some(n)),
            Phase::Finish => ("finish", None),
        }
    }

    fn parse(name: &str, step: Option<usize>) -> Option<Phase> {
        Some(match (name, step) {
            ("startup", _) => Phase::Startup,
            ("step", Some(n)) => Phase::Step(n),
            ("eval", Some(n)) => Phase::Eval(n),
            ("checkpoint", Some(n)) => Phase::Checkpoint(n),
            ("finish", _) => Phase::Finish,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::Startup => f.write_str("start-up"),
            Phase::Step(n) => write!(f, "step {n}"),
            Phase::Eval(n) => write!(f, "the validation after step {n}"),
            Phase::Checkpoint(n) => write!(f, "the checkpoint of step {n}"),
            Phase::Finish => f.write_str("the end of the run"),
        }
    }
}

/// One heartbeat.
#[derive(Clone, Debug, PartialEq)]
pub struct Beat {
    /// Counts up with every beat.
    pub count: u64,
    /// The phase.
    pub phase: Phase,
    /// Seconds the phase has lasted.
    pub phase_s: f64,
    /// When the run's first step ended (seconds since the Unix epoch), once it has.
    pub first_step_unix_s: Option<f64>,
    /// The wait the rank is in, if any.
    pub waiting: Option<Waiting>,
}

impl Beat {
    /// The beat's line.
    pub fn render(&self) -> String {
        let (name, step) = self.phase.words();
        let mut s = format!("beat={} phase={name}", self.count);
        if let Some(n) = step {
            s += &format!(" step={n}");
        }
        s += &format!(" phase_s={:.3}", self.phase_s);
        if let Some(t) = self.first_step_unix_s {
            s += &format!(" first_step_unix_s={t:.3}");
        }
        if let Some(w) = &self.waiting {
            s += &format!(" waited_s={:.3} wait={}", w.waited_s, w.what);
        }
        s
    }

    /// A beat's line read back (none when it is not one).
    pub fn parse(line: &str) -> Option<Beat> {
        let line = line.trim_end();
        let (head, what) = match line.split_once(" wait=") {
            Some((h, w)) => (h, Some(w.to_string())),
            None => (line, None),
        };
        let mut count = None;
        let mut phase = None;
        let mut step = None;
        let mut phase_s = None;
        let mut waited_s = None;
        let mut first_step_unix_s = None;
        for word in head.split(' ') {
            let (k, v) = word.split_once('=')?;
            match k {
                "beat" => count = v.parse().ok(),
                "phase" => phase = Some(v),
                "step" => step = v.parse().ok(),
                "phase_s" => phase_s = v.parse::<f64>().ok().filter(|s| s.is_finite()),
                "waited_s" => waited_s = v.parse::<f64>().ok().filter(|s| s.is_finite()),
                "first_step_unix_s" => first_step_unix_s = v.parse::<f64>().ok().filter(|s| s.is_finite()),
                _ => {}
            }
        }
        let waiting = match (what, waited_s) {
            (Some(what), Some(waited_s)) => Some(Waiting { what, waited_s }),
            _ => None,
        };
        Some(Beat { count: count?, phase: Phase::parse(phase?, step)?, phase_s: phase_s?, first_step_unix_s, waiting })
    }
}

static PHASE: Mutex<Option<(Phase, Instant)>> = Mutex::new(None);
static FIRST_STEP: Mutex<Option<f64>> = Mutex::new(None);
/// Wakes the heartbeat thread for a beat now (the first step's end is news to the launcher).
static NUDGE: (Mutex<bool>, std::sync::Condvar) = (Mutex::new(false), std::sync::Condvar::new());

/// Seconds since the Unix epoch now.
pub fn unix_now_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// When the run's first step ended (seconds since the Unix epoch), once it has.
pub fn first_step_at() -> Option<f64> {
    FIRST_STEP.lock().ok().and_then(|t| *t)
}

/// Records that the run's first step ended now (the first call counts); returns when.
pub fn first_step_done() -> f64 {
    let t = match FIRST_STEP.lock() {
        Ok(mut t) => *t.get_or_insert_with(unix_now_s),
        Err(_) => unix_now_s(),
    };
    if let Ok(mut n) = NUDGE.0.lock() {
        *n = true;
        NUDGE.1.notify_all();
    }
    t
}

/// Records the phase this rank enters (read by its heartbeat thread).
pub fn set_phase(phase: Phase) {
    if let Ok(mut p) = PHASE.lock() {
        *p = Some((phase, Instant::now()));
    }
}

/// Starts this process's heartbeat thread when the launcher asked for one ([`HEARTBEAT_ENV`]);
/// the phase is start-up until [`set_phase`] says otherwise. Once per process.
pub fn start_from_env() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    let Some(path) = std::env::var_os(HEARTBEAT_ENV).map(PathBuf::from) else { return };
    STARTED.call_once(|| {
        if let Ok(mut p) = PHASE.lock() {
            p.get_or_insert((Phase::Startup, Instant::now()));
        }
        let _ = std::thread::Builder::new().name("heartbeat".into()).spawn(move || beat_forever(&path));
    });
}

fn beat_forever(path: &Path) {
    let tmp = path.with_extension("tmp");
    for count in 1u64.. {
        let (phase, since) = PHASE.lock().ok().and_then(|p| *p).unwrap_or((Phase::Startup, Instant::now()));
        let first_step_unix_s = FIRST_STEP.lock().ok().and_then(|t| *t);
        let beat = Beat { count, phase, phase_s: since.elapsed().as_secs_f64(), first_step_unix_s, waiting: comm::waiting() };
        // a torn read is impossible: the launcher reads whole files, renamed into place
        if std::fs::write(&tmp, beat.render()).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
        // the interval, or less when nudged
        if let Ok(n) = NUDGE.0.lock() {
            if let Ok(mut n) = NUDGE.1.wait_timeout_while(n, INTERVAL, |n| !*n).map(|(n, _)| n) {
                *n = false;
            }
        }
    }
}

/// The phase timeouts: how long a rank may spend in each phase, and go without a sign of
/// life in it, before it counts as hung.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// From the rank's start to its first step (`--startup-timeout`).
    pub startup: Duration,
    /// One step, or one validation (`--step-timeout`).
    pub step: Duration,
    /// Writing a checkpoint, or the end of the run (`--checkpoint-timeout`).
    pub checkpoint: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { startup: Duration::from_secs(600), step: Duration::from_secs(300), checkpoint: Duration::from_secs(600) }
    }
}

impl Timeouts {
    /// The limit of `phase`, with the flag that sets it.
    pub fn of(&self, phase: Phase) -> (Duration, &'static str) {
        match phase {
            Phase::Startup => (self.startup, "--startup-timeout"),
            Phase::Step(_) | Phase::Eval(_) => (self.step, "--step-timeout"),
            Phase::Checkpoint(_) | Phase::Finish => (self.checkpoint, "--checkpoint-timeout"),
        }
    }
}

/// What a launcher makes of a rank's heartbeat.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Alive, within its phase's timeout.
    Fine,
    /// Hung: no sign of life for the step's timeout (start-up's before its first beat), or in
    /// its phase past the phase's timeout without waiting on any peer. The text says where it
    /// was.
    Hung(String),
    /// Alive and waiting on peers past its phase's timeout: the text names the collective or
    /// message and its group.
    Waits(String),
    /// Alive, past its phase's timeout without waiting on any peer: stuck computing (or ending
    /// after an error); hung if it stays so.
    Stuck(String),
}

/// A launcher's view of one rank's heartbeat file.
#[derive(Debug)]
pub struct Watch {
    path: PathBuf,
    /// The latest beat read, and when it was first seen.
    last: Option<(Beat, Instant)>,
    started: Instant,
}

fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 { format!("{s:.0}") } else { format!("{s:.1}") }
}

impl Watch {
    /// The rank whose heartbeat goes to `path`, started now.
    pub fn new(path: PathBuf) -> Watch {
        let _ = std::fs::remove_file(&path);
        Watch { path, last: None, started: Instant::now() }
    }

    /// The file the rank writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the file; keeps the beat if it is new.
    pub fn poll(&mut self) {
        let Some(beat) = std::fs::read_to_string(&self.path).ok().as_deref().and_then(Beat::parse) else { return };
        if self.last.as_ref().is_none_or(|(b, _)| b.count != beat.count) {
            self.last = Some((beat, Instant::now()));
        }
    }

    /// The latest beat.
    pub fn beat(&self) -> Option<&Beat> {
        self.last.as_ref().map(|(b, _)| b)
    }

    /// When the rank last gave a sign of life (its start before its first beat).
    pub fn last_alive(&self) -> Instant {
        self.last.as_ref().map_or(self.started, |(_, t)| *t)
    }

    /// The rank judged against `timeouts` now.
    pub fn verdict(&self, timeouts: &Timeouts) -> Verdict {
        self.verdict_at(timeouts, Instant::now())
    }

    fn verdict_at(&self, timeouts: &Timeouts, now: Instant) -> Verdict {
        let silent = now.saturating_duration_since(self.last_alive());
        let (phase, phase_age, waiting) = match &self.last {
            Some((b, seen)) => (b.phase, Duration::from_secs_f64(b.phase_s) + now.saturating_duration_since(*seen), b.waiting.as_ref()),
            None => (Phase::Startup, silent, None),
        };
        let (limit, flag) = timeouts.of(phase);
        let doing = match waiting {
            Some(w) => format!("waiting in {}", w.what),
            None if phase == Phase::Startup => "starting".to_string(),
            None => "computing".to_string(),
        };
        // a live rank beats twice a second in every phase: silence is judged by the step's
        // timeout once it beats (start-up's before its first beat)
        let (quiet, quiet_flag) = if self.last.is_some() { timeouts.of(Phase::Step(0)) } else { (limit, flag) };
        if silent > quiet {
            return Verdict::Hung(format!("no sign of life for {} s in {phase} ({quiet_flag} {}); it was {doing}", secs(silent), secs(quiet)));
        }
        if phase_age <= limit {
            return Verdict::Fine;
        }
        match waiting {
            Some(w) => Verdict::Waits(format!("has waited {} s in {} in {phase} ({flag} {})", secs(Duration::from_secs_f64(w.waited_s)), w.what, secs(limit))),
            None => Verdict::Stuck(format!("has spent {} s in {phase} without waiting on any peer ({flag} {})", secs(phase_age), secs(limit))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_reads_back_as_written() {
        for beat in [
            Beat { count: 1, phase: Phase::Startup, phase_s: 0.25, first_step_unix_s: None, waiting: None },
            Beat { count: 7, phase: Phase::Step(4), phase_s: 1.5, first_step_unix_s: Some(1_700_000_000.25), waiting: Some(Waiting { what: "all_reduce over ranks [0, 1]".into(), waited_s: 0.75 }) },
            Beat { count: 9, phase: Phase::Checkpoint(6), phase_s: 2.0, first_step_unix_s: None, waiting: Some(Waiting { what: "recv from rank 3".into(), waited_s: 0.5 }) },
            Beat { count: 10, phase: Phase::Eval(2), phase_s: 0.0, first_step_unix_s: None, waiting: None },
            Beat { count: 11, phase: Phase::Finish, phase_s: 3.125, first_step_unix_s: Some(2.5), waiting: None },
        ] {
            assert_eq!(Beat::parse(&beat.render()), Some(beat.clone()), "{}", beat.render());
        }
        for bad in ["", "beat=x phase=step step=1 phase_s=0", "beat=1 phase=step phase_s=0", "beat=1 phase=nap phase_s=0", "phase=finish phase_s=1"] {
            assert_eq!(Beat::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_rank_is_hung_when_silent_or_idle_past_its_phase_timeout_and_waits_when_waiting() {
        let t = Timeouts { startup: Duration::from_secs(20), step: Duration::from_secs(5), checkpoint: Duration::from_secs(10) };
        let start = Instant::now();
        let mut w = Watch { path: PathBuf::new(), last: None, started: start };
        // before its first beat: start-up's limit
        assert_eq!(w.verdict_at(&t, start + Duration::from_secs(19)), Verdict::Fine);
        match w.verdict_at(&t, start + Duration::from_secs(21)) {
            Verdict::Hung(m) => assert!(m.contains("start-up") && m.contains("--startup-timeout 20"), "{m}"),
            v => panic!("{v:?}"),
        }
        // silent in a step past the step timeout: hung, naming what it waited on
        let waiting = Some(Waiting { what: "all_reduce over ranks [0, 1]".into(), waited_s: 1.0 });
        w.last = Some((Beat { count: 3, phase: Phase::Step(4), phase_s: 1.0, first_step_unix_s: None, waiting: waiting.clone() }, start));
        assert_eq!(w.verdict_at(&t, start + Duration::from_secs(3)), Verdict::Fine);
        match w.verdict_at(&t, start + Duration::from_secs(6)) {
            Verdict::Hung(m) => assert!(m.contains("no sign of life for 6 s in step 4") && m.contains("all_reduce over ranks [0, 1]") && m.contains("--step-timeout 5"), "{m}"),
            v => panic!("{v:?}"),
        }
        // alive, waiting past the timeout: waits, naming the collective and its group
        w.last = Some((Beat { count: 4, phase: Phase::Step(4), phase_s: 6.0, first_step_unix_s: None, waiting }, start));
        match w.verdict_at(&t, start + Duration::from_secs(1)) {
            Verdict::Waits(m) => assert!(m.contains("all_reduce over ranks [0, 1]") && m.contains("step 4"), "{m}"),
            v => panic!("{v:?}"),
        }
        // alive, computing past the timeout: stuck
        w.last = Some((Beat { count: 5, phase: Phase::Step(4), phase_s: 6.0, first_step_unix_s: None, waiting: None }, start));
        assert!(matches!(w.verdict_at(&t, start + Duration::from_secs(1)), Verdict::Stuck(m) if m.contains("without waiting")));
        // a checkpoint has its own limit, but silence in it is judged as in a step
        w.last = Some((Beat { count: 6, phase: Phase::Checkpoint(4), phase_s: 6.0, first_step_unix_s: None, waiting: None }, start));
        assert_eq!(w.verdict_at(&t, start + Duration::from_secs(1)), Verdict::Fine);
        match w.verdict_at(&t, start + Duration::from_secs(6)) {
            Verdict::Hung(m) => assert!(m.contains("no sign of life for 6 s in the checkpoint of step 4") && m.contains("--step-timeout 5"), "{m}"),
            v => panic!("{v:?}"),
        }
    }
}
