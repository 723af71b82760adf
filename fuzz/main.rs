//! smp-partition's fuzzing harness (docs/fuzzing.md): an in-process mutation fuzzer on the
//! stable toolchain. For each target (`fuzz/targets.rs`) a worker process mutates the
//! target's corpus with structure-aware mutators (`fuzz/mutate.rs`) and feeds the results to
//! the library's entry points; every input must be accepted or refused with an error. A
//! panic, an abort, an input running past the time bound, or an allocation past the memory
//! bound is a crash, saved under `target/fuzz/crashes/TARGET/`. Without coverage
//! instrumentation (which needs nightly), a mutant joins the corpus when it is accepted, or
//! refused with a message not seen before (numbers and quoted parts aside); see [`Corpus`].
//!
//! ```text
//! fuzz [--seconds N] [--targets a,b] [--jobs J]   every target, N seconds in all
//! fuzz replay TARGET FILE...                     runs inputs once, in this process
//! fuzz list                                      the targets
//! ```

mod case;
mod mutate;
mod targets;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use case::Case;
use mutate::{Dict, Rng};
use targets::{Env, TARGETS, Target};

// ---- bounds --------------------------------------------------------------------------------

/// The allocation bound of one input: [`ALLOC_FLOOR`] or [`ALLOC_PER_BYTE`] × its size,
/// whichever is larger (live bytes the input adds, Rust allocations).
const ALLOC_FLOOR: usize = 64 << 20;
const ALLOC_PER_BYTE: usize = 1000;

/// The time bound of one input: [`TIME_FLOOR`] plus [`TIME_PER_MIB`] per MiB of input.
const TIME_FLOOR: Duration = Duration::from_secs(10);
const TIME_PER_MIB: Duration = Duration::from_secs(2);

/// Counts live bytes and refuses an allocation that would pass the bound of the input being
/// run (`LIMIT`); the refused size is kept in `OVER`.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
static OVER: AtomicUsize = AtomicUsize::new(0);

impl Counting {
    fn admit(size: usize) -> bool {
        let live = LIVE.fetch_add(size, Relaxed).saturating_add(size);
        if live > LIMIT.load(Relaxed) {
            LIVE.fetch_sub(size, Relaxed);
            OVER.store(size, Relaxed);
            return false;
        }
        true
    }

    /// `alloc` for `size` bytes if the bound admits them (counted unless it fails).
    fn counted(size: usize, alloc: impl FnOnce() -> *mut u8) -> *mut u8 {
        if !Counting::admit(size) {
            return std::ptr::null_mut();
        }
        let p = alloc();
        if p.is_null() {
            LIVE.fetch_sub(size, Relaxed);
        }
        p
    }
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller's contract.
        Counting::counted(layout.size(), || unsafe { System.alloc(layout) })
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as the caller's contract.
        Counting::counted(layout.size(), || unsafe { System.alloc_zeroed(layout) })
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as the caller's contract.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !Counting::admit(new_size - old) {
            return std::ptr::null_mut();
        }
        // SAFETY: as the caller's contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            if new_size > old {
                LIVE.fetch_sub(new_size - old, Relaxed);
            }
        } else if new_size < old {
            LIVE.fetch_sub(old - new_size, Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// When the running input started (ms since the epoch; 0: none runs) and its time bound.
static STARTED_MS: AtomicU64 = AtomicU64::new(0);
static BOUND_MS: AtomicU64 = AtomicU64::new(u64::MAX);

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Aborts the worker when an input runs past its bound (the supervisor saves the input).
fn start_watchdog() {
    std::thread::spawn(|| {
        loop {
            std::thread::sleep(Duration::from_millis(50));
            let started = STARTED_MS.load(Relaxed);
            if started != 0 && now_ms().saturating_sub(started) > BOUND_MS.load(Relaxed) {
                eprintln!("[fuzz] hang: the input ran past its bound of {} ms", BOUND_MS.load(Relaxed));
                std::process::abort();
            }
        }
    });
}

// ---- running one input ---------------------------------------------------------------------

/// How one input ended.
#[derive(Debug)]
enum Ending {
    Accepted,
    Refused(String),
    /// A defect: panic or allocation past the bound (kind, message).
    Crash(&'static str, String),
}

thread_local! {
    static PANIC: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Panics are caught per input; the hook keeps the message and place instead of printing.
fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        // the trace below allocates (symbols); the input's bound is over once it panicked
        LIMIT.store(usize::MAX, Relaxed);
        let msg = info.payload().downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| info.payload().downcast_ref::<String>().cloned()).unwrap_or_default();
        let at = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
        // where in this repository's code it happened (the panic itself may be in std)
        let trace = std::backtrace::Backtrace::force_capture().to_string();
        let ours: Vec<&str> = trace.lines().map(str::trim).filter(|l| l.starts_with("at ./") || l.starts_with("at src/") || l.contains("/wt-") || l.contains("smp-partition/src")).take(6).collect();
        PANIC.with(|p| *p.borrow_mut() = Some(format!("panicked at {at}: {msg}\n  {}", ours.join("\n  "))));
    }));
}

/// Runs `case` through `target` under the bounds.
fn run_one(env: &mut Env, target: &Target, case: &Case) -> Ending {
    let size = case.len();
    let alloc_bound = ALLOC_FLOOR.max(size.saturating_mul(ALLOC_PER_BYTE));
    let time_bound = TIME_FLOOR + TIME_PER_MIB * (size >> 20) as u32;
    OVER.store(0, Relaxed);
    LIMIT.store(LIVE.load(Relaxed).saturating_add(alloc_bound), Relaxed);
    BOUND_MS.store(time_bound.as_millis() as u64, Relaxed);
    STARTED_MS.store(now_ms(), Relaxed);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (target.run)(env, case)));
    STARTED_MS.store(0, Relaxed);
    LIMIT.store(usize::MAX, Relaxed);
    let over = OVER.load(Relaxed);
    if over > 0 {
        return Ending::Crash("alloc", format!("an allocation of {over} bytes would pass the bound of {alloc_bound} bytes for a {size}-byte input"));
    }
    match result {
        Ok(Ok(())) => Ending::Accepted,
        Ok(Err(msg)) => Ending::Refused(msg),
        Err(_) => Ending::Crash("panic", PANIC.with(|p| p.borrow_mut().take()).unwrap_or_else(|| "panicked".into())),
    }
}

/// A refusal's message without the parts that differ between inputs of one kind: numbers, and
/// anything quoted or bracketed (names, values, shapes, the text of the input).
fn signature(msg: &str) -> String {
    let mut out = String::with_capacity(120);
    let mut closing: Vec<char> = Vec::new();
    let mut last_digit = false;
    for c in msg.chars().take(400) {
        if closing.last() == Some(&c) {
            closing.pop();
            continue;
        }
        let close = match c {
            '`' => Some('`'),
            '"' => Some('"'),
            '(' => Some(')'),
            '[' => Some(']'),
            '{' => Some('}'),
            _ => None,
        };
        if let Some(close) = close {
            if closing.is_empty() {
                out.push_str("_");
            }
            if closing.len() < 8 {
                closing.push(close);
            }
            continue;
        }
        if !closing.is_empty() {
            continue;
        }
        if c.is_ascii_digit() {
            if !last_digit {
                out.push('#');
            }
        } else {
            out.push(c);
        }
        last_digit = c.is_ascii_digit();
    }
    out
}

// ---- corpus --------------------------------------------------------------------------------

/// The repository (the example is built from it).
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where seeds, crashes and the worker's state live.
fn work_dir() -> PathBuf {
    repo().join("target/fuzz")
}

/// Seeds of `target`: the committed corpus, the generated seeds (`fuzz/make-seeds.sh`), the
/// regression files, and real files of the repository.
fn seeds(target: &Target) -> Vec<Case> {
    let r = repo();
    let mut dirs = vec![r.join("fuzz/corpus").join(target.name), work_dir().join("seeds").join(target.name), r.join("tests/data/fuzz-regressions").join(target.name)];
    let mut out = Vec::new();
    let mut extra: Vec<(PathBuf, &str)> = Vec::new();
    match target.name {
        "onnx" => {
            for d in ["models", "models/keras"] {
                for e in std::fs::read_dir(r.join(d)).into_iter().flatten().flatten() {
                    if e.path().extension().is_some_and(|x| x == "onnx") {
                        extra.push((e.path(), "model.onnx"));
                    }
                }
            }
            // the ONNX operator conformance cases (`make onnx-cases`), one model per op case
            for e in std::fs::read_dir(r.join("tests/data/onnx-cases/node")).into_iter().flatten().flatten() {
                extra.push((e.path().join("model.onnx"), "model.onnx"));
            }
        }
        "cluster" => {
            extra.push((r.join("tests/data/cpu.toml"), "cluster.toml"));
            // every preset written out, so the file's fields follow the spec's
            for p in smp_partition::cost::PRESETS {
                if let Ok(spec) = smp_partition::cost::ClusterSpec::preset(p) {
                    out.push(Case::single("cluster.toml", spec.to_toml().into_bytes()));
                }
            }
        }
        "batch" => {
            for e in std::fs::read_dir(r.join("models")).into_iter().flatten().flatten() {
                if e.path().to_string_lossy().ends_with(".io.npz") {
                    extra.push((e.path(), "batch.npz"));
                }
            }
        }
        _ => {}
    }
    for d in dirs.drain(..) {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&d).into_iter().flatten().flatten().map(|e| e.path()).collect();
        paths.sort();
        out.extend(paths.iter().filter(|p| !p.to_string_lossy().ends_with(".expect")).filter_map(|p| Case::read(p, target.default_file)));
    }
    for (path, name) in extra {
        if let Ok(bytes) = std::fs::read(&path) {
            out.push(Case::single(name, bytes));
        }
    }
    out
}

/// Words a target's mutators insert besides those of its corpus.
fn dictionary(target: &Target, corpus: &[Case]) -> Dict {
    let mut d = Dict::default();
    let fixed: &[&str] = match target.name {
        "config" => &["smdistributed", "modelparallel", "parameters", "simple", "interleaved", "cluster", "spread", "speed", "memory", "DPT", "TPD"],
        "tokens" => &["uint16", "uint32", "int32", "uint8", "dtype", "tokens", "vocab_size", "tokenizer", "files", "data.bin", "data.bin.json"],
        "checkpoint" => &["param", "exp_avg", "exp_avg_sq", "buffer", "F32", "F64", "BF16", "I64", "BOOL", "U8", "F8_E4M3", "manifest.json", "rank-00001.safetensors", "axis", "ranges", "flat"],
        "batch" => &["F32", "I64", "BOOL", "input_ids", "labels", "attention_mask", "__metadata__", "dtype", "shape", "data_offsets"],
        "plan" => &["gpipe", "1f1b", "interleaved:2", "zb-h1", "auto", "none", "full", "DPT", "TPD", "models/gpt2.onnx", "models/llama.onnx"],
        "cluster" => &["cpu", "h100-80gb", "a100-40gb", "machine", "calibration", "concurrent", "collectives", "efficiency", "cal.toml"],
        _ => &["w.bin", "model.onnx_data", "data", "location", "offset", "length"],
    };
    d.extend(fixed.iter().map(|s| s.to_string()));
    if target.name == "config" {
        let keys = smp_partition::solve::smp_config::SMP_KEYS.iter().chain(smp_partition::solve::smp_config::SMP_IGNORED_KEYS);
        d.extend(keys.map(|s| s.to_string()));
    }
    for c in corpus.iter().take(200) {
        for (name, bytes) in &c.files {
            if bytes.len() <= 4 << 20 {
                d.extend(mutate::harvest(name, bytes));
            }
        }
    }
    d
}

// ---- worker --------------------------------------------------------------------------------

/// What a worker mutates: its seeds, accepted mutants (the deepest inputs it has), and
/// mutants refused in a way not seen before.
struct Corpus {
    seeds: Vec<Case>,
    accepted: Vec<Case>,
    novel: Vec<Case>,
}

impl Corpus {
    fn len(&self) -> usize {
        self.seeds.len() + self.accepted.len() + self.novel.len()
    }

    /// The input to mutate next: a seed 40 % of the time, an accepted mutant 30 %, a novel
    /// refusal 30 % (so refusals, which lead away from what parses, never take over).
    fn parent(&self, rng: &mut Rng) -> &Case {
        let r = rng.below(10);
        let pool = if r < 4 || (self.accepted.is_empty() && self.novel.is_empty()) {
            &self.seeds
        } else if r < 7 && !self.accepted.is_empty() || self.novel.is_empty() {
            &self.accepted
        } else {
            &self.novel
        };
        &pool[rng.below(pool.len())]
    }

    /// An input to splice from: a seed or an accepted mutant.
    fn donor(&self, rng: &mut Rng) -> &Case {
        let k = rng.below(self.seeds.len() + self.accepted.len());
        self.seeds.get(k).unwrap_or_else(|| &self.accepted[k - self.seeds.len()])
    }

    /// Adds `case` to `pool`, replacing a random entry once it holds `cap`.
    fn keep(rng: &mut Rng, pool: &mut Vec<Case>, case: Case, cap: usize) {
        if pool.len() < cap {
            pool.push(case);
        } else {
            let k = rng.below(cap);
            pool[k] = case;
        }
    }
}

/// The input being run, kept in a memory-mapped file so that the supervisor can save it when
/// the worker dies: its length (u64, little-endian), then its bytes.
struct Current {
    file: std::fs::File,
    map: memmap2::MmapMut,
}

impl Current {
    fn create(path: &Path) -> std::io::Result<Current> {
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        file.set_len(1 << 20)?;
        // SAFETY: the file is this worker's; the supervisor reads it only after the worker ended
        let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
        Ok(Current { file, map })
    }

    fn set(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if bytes.len() + 8 > self.map.len() {
            self.file.set_len((bytes.len() as u64 + 8).next_power_of_two())?;
            // SAFETY: as in `create`
            self.map = unsafe { memmap2::MmapMut::map_mut(&self.file)? };
        }
        self.map[..8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
        self.map[8..8 + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// The input a dead worker was running.
    fn read(path: &Path) -> Vec<u8> {
        let all = std::fs::read(path).unwrap_or_default();
        let n = all.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()) as usize).unwrap_or(0);
        all.get(8..8usize.saturating_add(n)).map(<[u8]>::to_vec).unwrap_or_default()
    }
}

/// What a worker did, written to its state file as it goes (the supervisor reads it if the
/// worker dies).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct Stats {
    inputs: u64,
    accepted: u64,
    refused: u64,
    crashes: u64,
    corpus: u64,
    signatures: u64,
    seconds: f64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.inputs += o.inputs;
        self.accepted += o.accepted;
        self.refused += o.refused;
        self.crashes += o.crashes;
        self.corpus = self.corpus.max(o.corpus);
        self.signatures = self.signatures.max(o.signatures);
        self.seconds += o.seconds;
    }
}

/// FNV-1a of an input's bytes, naming saved crashes and inputs to skip.
fn hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Saves a crashing input with what happened; returns its path.
fn save_crash(target: &Target, kind: &str, message: &str, bytes: &[u8]) -> PathBuf {
    let dir = work_dir().join("crashes").join(target.name);
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{kind}-{:016x}", hash(bytes)));
    let _ = std::fs::write(&path, bytes);
    let _ = std::fs::write(path.with_extension("txt"), format!("{kind}: {message}\n"));
    path
}

fn worker(name: &str, until_ms: u64, seed: u64, state: &Path) -> ExitCode {
    let Some(target) = targets::target(name) else {
        eprintln!("no target `{name}`");
        return ExitCode::from(2);
    };
    quiet_panics();
    start_watchdog();
    let scratch = std::env::temp_dir().join(format!("smp-fuzz-{}-{}", name, std::process::id()));
    let shm = Path::new("/dev/shm");
    let scratch = if shm.is_dir() { shm.join(scratch.file_name().unwrap_or_default()) } else { scratch };
    let mut env = Env::new(&repo(), &scratch);
    if let Err(e) = env.prepare(target) {
        eprintln!("[fuzz] {name}: cannot prepare: {e}");
        return ExitCode::from(2);
    }
    let mut seeds = seeds(target);
    if seeds.is_empty() {
        seeds.push(Case::single(target.default_file, Vec::new()));
    }
    let dict = dictionary(target, &seeds);
    let mut corpus = Corpus { seeds, accepted: Vec::new(), novel: Vec::new() };
    let current_path = state.with_extension("current");
    let mut current = match Current::create(&current_path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("[fuzz] {name}: {}: {e}", current_path.display());
            return ExitCode::from(2);
        }
    };
    let mut bytes: Vec<u8> = Vec::new();
    // seeds that killed an earlier worker of this run
    let skip: HashSet<u64> = std::fs::read_to_string(state.with_extension("skip")).unwrap_or_default().lines().filter_map(|l| u64::from_str_radix(l, 16).ok()).collect();
    let started = Instant::now();
    let mut stats = Stats::default();
    let mut seen: HashSet<String> = HashSet::new();
    let mut crashed: HashSet<String> = HashSet::new();
    let mut rng = Rng::new(seed ^ now_ms());
    let seeds_n = corpus.seeds.len();
    // SMP_FUZZ_PROFILE=1: where the time goes, by outcome
    let profile = std::env::var_os("SMP_FUZZ_PROFILE").is_some();
    let mut time_by_sig: BTreeMap<String, (u64, f64)> = BTreeMap::new();
    let mut last_state = Instant::now();
    let mut i = 0usize;
    loop {
        // every seed once, then mutations
        let case = if i < seeds_n {
            corpus.seeds[i].clone()
        } else {
            if now_ms() >= until_ms {
                break;
            }
            let mut c = corpus.parent(&mut rng).clone();
            let other = corpus.donor(&mut rng);
            mutate::mutate_case(&mut rng, &mut c, other, &dict);
            c
        };
        i += 1;
        bytes.clear();
        case.encode_into(target.default_file, &mut bytes);
        if i <= seeds_n && skip.contains(&hash(&bytes)) {
            continue;
        }
        let _ = current.set(&bytes);
        let t0 = Instant::now();
        let ending = run_one(&mut env, target, &case);
        let took = t0.elapsed().as_secs_f64();
        stats.inputs += 1;
        let sig = match &ending {
            Ending::Accepted => {
                stats.accepted += 1;
                if i > seeds_n && bytes.len() <= 16 << 20 {
                    Corpus::keep(&mut rng, &mut corpus.accepted, case.clone(), 1000);
                }
                "ok".to_string()
            }
            Ending::Refused(m) => {
                stats.refused += 1;
                signature(m)
            }
            Ending::Crash(kind, m) => {
                stats.crashes += 1;
                let key = format!("{kind}: {}", signature(m));
                if crashed.insert(key) {
                    let path = save_crash(target, kind, m, &bytes);
                    eprintln!("[fuzz] {name}: {kind}: {m}\n[fuzz]   input saved as {}", path.display());
                }
                continue;
            }
        };
        if profile {
            let e = time_by_sig.entry(sig.chars().take(100).collect()).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += took;
        }
        let new_outcome = seen.len() < 1_000_000 && seen.insert(sig);
        if new_outcome && i > seeds_n && bytes.len() <= 16 << 20 {
            Corpus::keep(&mut rng, &mut corpus.novel, case, 3000);
        }
        if last_state.elapsed() > Duration::from_secs(1) {
            stats.corpus = corpus.len() as u64;
            stats.signatures = seen.len() as u64;
            stats.seconds = started.elapsed().as_secs_f64();
            let _ = std::fs::write(state, serde_json::to_vec(&stats).unwrap_or_default());
            last_state = Instant::now();
        }
    }
    stats.corpus = corpus.len() as u64;
    stats.signatures = seen.len() as u64;
    stats.seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::write(state, serde_json::to_vec(&stats).unwrap_or_default());
    drop(current);
    let _ = std::fs::remove_file(&current_path);
    let _ = std::fs::remove_dir_all(&scratch);
    if profile {
        let mut v: Vec<_> = time_by_sig.into_iter().collect();
        v.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        for (sig, (n, t)) in v.iter().take(15) {
            eprintln!("[fuzz] profile {name}: {n:>7} inputs {t:>8.2} s  {sig}");
        }
    }
    ExitCode::SUCCESS
}

// ---- supervisor ----------------------------------------------------------------------------

/// Runs `target`'s workers until `until_ms`, restarting a worker that dies (saving the input
/// it died on).
fn supervise(target: &Target, until_ms: u64, seed: u64) -> Stats {
    let dir = work_dir().join("state");
    let _ = std::fs::create_dir_all(&dir);
    let state = dir.join(format!("{}.json", target.name));
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("fuzz"));
    let mut total = Stats::default();
    let _ = std::fs::remove_file(state.with_extension("skip"));
    for restart in 0..20u64 {
        let _ = std::fs::remove_file(&state);
        let child = Command::new(&exe)
            .args(["worker", target.name, &until_ms.to_string(), &(seed + restart).to_string(), &state.display().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        let Ok(mut child) = child else {
            eprintln!("[fuzz] {}: cannot start a worker", target.name);
            break;
        };
        let mut stderr = String::new();
        if let Some(mut e) = child.stderr.take() {
            let mut buf = Vec::new();
            let _ = e.read_to_end(&mut buf);
            stderr = String::from_utf8_lossy(&buf).into_owned();
        }
        let status = child.wait();
        for line in stderr.lines().filter(|l| l.starts_with("[fuzz]")) {
            eprintln!("{line}");
        }
        if let Some(s) = std::fs::read(&state).ok().and_then(|b| serde_json::from_slice::<Stats>(&b).ok()) {
            total.add(&s);
        }
        match status {
            Ok(s) if s.success() => break,
            Ok(s) if s.code() == Some(2) => {
                eprintln!("[fuzz] {}: worker could not start: {}", target.name, stderr.trim());
                break;
            }
            _ => {
                // the worker died on the input it was running
                let bytes = Current::read(&state.with_extension("current"));
                let tail: String = stderr.lines().rev().take(6).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
                let kind = if stderr.contains("[fuzz] hang") {
                    "hang"
                } else if stderr.contains("memory allocation of") {
                    "alloc"
                } else {
                    "abort"
                };
                let path = save_crash(target, kind, &format!("{status:?}\n{tail}"), &bytes);
                let mut skip = std::fs::read_to_string(state.with_extension("skip")).unwrap_or_default();
                skip.push_str(&format!("{:016x}\n", hash(&bytes)));
                let _ = std::fs::write(state.with_extension("skip"), skip);
                eprintln!("[fuzz] {}: worker died ({kind}); input saved as {}", target.name, path.display());
                total.inputs += 1;
                total.crashes += 1;
                if now_ms() >= until_ms {
                    break;
                }
            }
        }
    }
    total
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let _ = std::env::set_current_dir(repo());
    match args.first().map(String::as_str) {
        Some("worker") => {
            let [_, name, until, seed, state] = args.as_slice() else { return ExitCode::from(2) };
            worker(name, until.parse().unwrap_or(0), seed.parse().unwrap_or(1), Path::new(state))
        }
        Some("list") => {
            for t in TARGETS {
                println!("{:<11} {}", t.name, t.about);
            }
            ExitCode::SUCCESS
        }
        Some("replay") => replay(&args[1..]),
        _ => run_all(&args),
    }
}

/// `replay TARGET FILE...`: each input once, in this process.
fn replay(args: &[String]) -> ExitCode {
    let Some(target) = args.first().and_then(|n| targets::target(n)) else {
        eprintln!("usage: fuzz replay TARGET FILE...");
        return ExitCode::from(2);
    };
    quiet_panics();
    let scratch = std::env::temp_dir().join(format!("smp-fuzz-replay-{}", std::process::id()));
    let mut env = Env::new(&repo(), &scratch);
    let mut failed = false;
    for f in &args[1..] {
        let Some(case) = Case::read(Path::new(f), target.default_file) else {
            eprintln!("{f}: unreadable");
            failed = true;
            continue;
        };
        match run_one(&mut env, target, &case) {
            Ending::Accepted => println!("{f}: accepted"),
            Ending::Refused(m) => println!("{f}: refused: {m}"),
            Ending::Crash(kind, m) => {
                println!("{f}: CRASH ({kind}): {m}");
                failed = true;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

/// Every target (or `--targets a,b`) for `--seconds N` in all (split evenly; `--jobs J`
/// targets at once); prints inputs per target and crashes; exit status 1 on a crash.
fn run_all(args: &[String]) -> ExitCode {
    let seconds: u64 = flag(args, "--seconds").and_then(|s| s.parse().ok()).unwrap_or(60);
    let jobs: usize = flag(args, "--jobs").and_then(|s| s.parse().ok()).unwrap_or(1).max(1);
    let chosen: Vec<&Target> = match flag(args, "--targets") {
        Some(list) => list.split(',').filter_map(targets::target).collect(),
        None => TARGETS.iter().collect(),
    };
    if chosen.is_empty() {
        eprintln!("no such target; `fuzz list` names them");
        return ExitCode::from(2);
    }
    let rounds = chosen.len().div_ceil(jobs) as u64;
    let per_target_ms = seconds * 1000 / rounds.max(1);
    eprintln!("[fuzz] {} targets, {} s each, {jobs} at a time; crashes go to {}", chosen.len(), per_target_ms / 1000, work_dir().join("crashes").display());
    let mut results: BTreeMap<&str, Stats> = BTreeMap::new();
    for group in chosen.chunks(jobs) {
        let until = now_ms() + per_target_ms;
        let stats: Vec<(&str, Stats)> = std::thread::scope(|s| {
            let handles: Vec<_> = group.iter().enumerate().map(|(k, t)| s.spawn(move || (t.name, supervise(t, until, now_ms() ^ k as u64)))).collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        results.extend(stats);
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{:<11} {:>10} {:>10} {:>10} {:>8} {:>8} {:>10}", "target", "inputs", "accepted", "refused", "crashes", "corpus", "inputs/s");
    let mut total = Stats::default();
    for t in &chosen {
        let s = results.get(t.name).cloned().unwrap_or_default();
        let rate = if s.seconds > 0.0 { s.inputs as f64 / s.seconds } else { 0.0 };
        let _ = writeln!(out, "{:<11} {:>10} {:>10} {:>10} {:>8} {:>8} {:>10.0}", t.name, s.inputs, s.accepted, s.refused, s.crashes, s.corpus, rate);
        total.inputs += s.inputs;
        total.accepted += s.accepted;
        total.refused += s.refused;
        total.crashes += s.crashes;
    }
    let _ = writeln!(out, "{:<11} {:>10} {:>10} {:>10} {:>8}", "total", total.inputs, total.accepted, total.refused, total.crashes);
    if total.crashes > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}
