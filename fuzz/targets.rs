//! The fuzzing targets: one per kind of file a user hands the tools, each running the library
//! entry points the binaries run on that file. A target returns `Ok` when the input is
//! accepted and `Err(message)` when it is refused; anything else (a panic, an abort, a hang,
//! an allocation past the bound) is a defect. Shared by the fuzzer (`fuzz/main.rs`) and the
//! regression replay (`tests/fuzz_regressions.rs`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use smp_partition::cost::{ClusterSpec, CommModel, FactSource, MachineFacts};
use smp_partition::frontend::onnx::load_model;
use smp_partition::passes::params::{ParamOptions, decide};
use smp_partition::passes::{AnalyzeOptions, PassError};
use smp_partition::runtime::rank;
use smp_partition::runtime::state::checkpoint::{Loaded, Role};
use smp_partition::runtime::state::export;
use smp_partition::runtime::state::slice::Slice;
use smp_partition::runtime::data::{DataSource, Order, TokenFile, TokenStream, open_data};
use smp_partition::runtime::state::weights::Source;
use smp_partition::runtime::{ExecOptions, Executor, InitMode, Weights};
use smp_partition::solve::{PlanOptions, SmpConfig};
use smp_partition::{Analysed, compile, load_and_analyze};

use crate::case::Case;

/// What a target does with an input: accept it, or refuse it with a message.
pub type Outcome = Result<(), String>;

/// One input format.
pub struct Target {
    /// Its name (`fuzz/corpus/NAME`, `tests/data/fuzz-regressions/NAME`).
    pub name: &'static str,
    /// The file name of a one-file case.
    pub default_file: &'static str,
    /// What it feeds, for `--list` and docs/fuzzing.md.
    pub about: &'static str,
    /// Runs one input.
    pub run: fn(&mut Env, &Case) -> Outcome,
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target {
        name: "onnx",
        default_file: "model.onnx",
        about: "an ONNX model and its external data: protobuf decode, import, analysis (unbound dims bound as the error says), every initializer read",
        run: onnx,
    },
    Target {
        name: "plan",
        default_file: "plan.json",
        about: "a plan file: load (version gate, validation), report, schedule lowering, then the runner's checks of every rank against the model it names and the rank's weights",
        run: plan,
    },
    Target {
        name: "config",
        default_file: "smp.json",
        about: "an SMP config (`--config`): parse, merge into the plan options, check against 8 devices and the model's layers, plan gpt2",
        run: config,
    },
    Target {
        name: "cluster",
        default_file: "cluster.toml",
        about: "a cluster file (`--cluster FILE.toml[:N]`, and the calibration file it names): parse, validate, the link model, plan gpt2",
        run: cluster,
    },
    Target {
        name: "tokens",
        default_file: "data.bin",
        about: "a token file and its `.bin.json` sidecar: open, windows for gpt2, replica microbatches",
        run: tokens,
    },
    Target {
        name: "checkpoint",
        default_file: "manifest.json",
        about: "a checkpoint (manifest and safetensors shards under `step-N/`): open, assemble and read parts of every tensor, restore gpt2 from it, export its module tensors",
        run: checkpoint,
    },
    Target {
        name: "batch",
        default_file: "batch.npz",
        about: "a fixed batch (`--data` / `eval --inputs`: .npz, .npy or .safetensors): read, bind to gpt2's inputs, split into replica microbatches",
        run: batch,
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// The model most targets pair their input with (the runner reads data, checkpoints and
/// configs for a model).
pub const MODEL: &str = "models/gpt2.onnx";

/// What the targets share across inputs: a scratch directory for each case's files, and
/// models loaded once.
pub struct Env {
    /// The repository (plans name their models relative to it).
    pub repo: PathBuf,
    scratch: PathBuf,
    /// What was last written under each scratch subdirectory.
    written: HashMap<String, Vec<(String, crate::case::Bytes)>>,
    imported: HashMap<PathBuf, (smp_partition::ir::Graph, String)>,
    analysed: Option<Analysed>,
    exec: Option<&'static Executor<'static>>,
    host: MachineFacts,
}

impl Env {
    /// An environment writing cases under `scratch`.
    pub fn new(repo: &Path, scratch: &Path) -> Env {
        // a fixed machine (as tests/data/cpu.toml), so no outcome depends on the host
        let host = MachineFacts { memory_bytes: 24 << 30, cores: 2, calibration: None, source: FactSource::Host };
        Env { repo: repo.to_path_buf(), scratch: scratch.to_path_buf(), written: HashMap::new(), imported: HashMap::new(), analysed: None, exec: None, host }
    }

    /// Loads what `target` pairs its inputs with, so that no input pays for it.
    pub fn prepare(&mut self, target: &Target) -> Result<(), String> {
        match target.name {
            "plan" => {
                for m in ["models/gpt2.onnx", "models/llama.onnx", "models/bert.onnx"] {
                    self.imported_model(Path::new(m))?;
                }
            }
            "config" | "cluster" => {
                self.analysed_model()?;
            }
            "tokens" | "batch" | "checkpoint" => {
                self.executor()?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Writes `case` to the directory `sub` of the scratch directory (which then holds just
    /// its files) and returns that directory.
    fn case_dir(&mut self, case: &Case, sub: &str) -> Result<PathBuf, String> {
        let dir = self.scratch.join(sub);
        case.write_to(&dir, self.written.entry(sub.to_string()).or_default())?;
        Ok(dir)
    }

    /// The graph and sha256 of model `path` (relative to the repository), loaded once.
    fn imported_model(&mut self, path: &Path) -> Result<(smp_partition::ir::Graph, String), String> {
        if let Some((g, sha)) = self.imported.get(path) {
            return Ok((g.clone(), sha.clone()));
        }
        let m = load_model(&self.repo.join(path)).map_err(|e| e.to_string())?;
        self.imported.insert(path.to_path_buf(), (m.graph.clone(), m.sha256.clone()));
        Ok((m.graph, m.sha256))
    }

    fn analysed_model(&mut self) -> Result<&Analysed, String> {
        if self.analysed.is_none() {
            let opts = AnalyzeOptions { seq_len: Some(16), ..Default::default() };
            self.analysed = Some(load_and_analyze(&self.repo.join(MODEL), &opts).map_err(|e| e.to_string())?);
        }
        self.analysed.as_ref().ok_or_else(|| "no model".to_string())
    }

    /// An executor of [`MODEL`] (kept for the process's life).
    fn executor(&mut self) -> Result<&'static Executor<'static>, String> {
        if let Some(e) = self.exec {
            return Ok(e);
        }
        let (graph, _) = self.imported_model(Path::new(MODEL))?;
        let graph: &'static smp_partition::ir::Graph = Box::leak(Box::new(graph));
        let weights = Weights::load(graph, InitMode::Load, None).map_err(|e| e.to_string())?;
        let exec = Executor::new(graph, weights, ExecOptions { float_kind: None, training: false, autocast: None }).map_err(|e| e.to_string())?;
        let exec: &'static Executor<'static> = Box::leak(Box::new(exec));
        self.exec = Some(exec);
        Ok(exec)
    }
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The case's file the tool is handed: `default` if the case has it, else its first file with
/// extension `ext`, else its first file.
fn main_file(dir: &Path, case: &Case, default: &str, ext: &str) -> Result<PathBuf, String> {
    let names = || case.files.iter().map(|(n, _)| n);
    let name = names().find(|n| *n == default).or_else(|| names().find(|n| n.ends_with(ext))).or_else(|| names().next());
    name.map(|n| dir.join(n)).ok_or_else(|| "the case has no file".into())
}

/// Bytes of initializers read into tensors at most (the runner reads them all; the fuzzer
/// skips larger models to keep its pace).
const READ_LIMIT_BYTES: u64 = 64 << 20;

fn onnx(env: &mut Env, case: &Case) -> Outcome {
    let dir = env.case_dir(case, "onnx")?;
    let path = main_file(&dir, case, "model.onnx", ".onnx")?;
    let imported = load_model(&path).map_err(err)?;
    for w in &imported.warnings {
        let _ = w.to_string();
    }
    // analysis, binding each unbound dim as its error says (as a user would)
    let mut opts = AnalyzeOptions::default();
    let analysed = loop {
        match smp_partition::passes::analyze(imported.graph.clone(), &opts) {
            Err(PassError::UnboundDim { dim, .. }) if opts.dims.len() < 4 && !opts.dims.contains_key(&dim) => {
                opts.dims.insert(dim, 3);
            }
            other => break other,
        }
    };
    analysed.map_err(err)?;
    let bytes: u64 = imported.graph.initializers().filter_map(|v| imported.graph.value(v).data.as_ref()).fold(0u64, |n, t| n.saturating_add(t.nbytes()));
    if bytes <= READ_LIMIT_BYTES {
        Weights::load(&imported.graph, InitMode::Load, None).map_err(err)?;
    }
    Ok(())
}

fn plan(env: &mut Env, case: &Case) -> Outcome {
    let dir = env.case_dir(case, "plan")?;
    let path = main_file(&dir, case, "plan.json", ".json")?;
    let plan = smp_partition::plan::io::load(&path).map_err(err)?;
    let _ = smp_partition::plan::report::render(&plan);
    let _ = smp_partition::plan::report::to_json_with_report(&plan);
    // `inspect --trace` lowers the plan's schedule for one replica
    let (p, m) = (plan.parallel.pp, plan.parallel.microbatches);
    let ranks = (0..p).map(|r| plan.stages_of_rank(r).next().and_then(|s| s.ranks.first().copied()).unwrap_or(r)).collect();
    let lower = smp_partition::codegen::lower::LowerOptions {
        ranks,
        boundary_bytes: plan.stages.iter().map(|s| s.output_bytes).collect(),
        epilogue: Vec::new(),
    };
    smp_partition::codegen::lower::lower_schedule(plan.parallel.schedule, p, m, &lower).map_err(err)?;
    // the runner: the plan's codegen section, its model (the file it names, as the runner
    // resolves it), then every rank's checks and weights
    rank::codegen_section(&plan).map_err(err)?;
    let given = PathBuf::from(&plan.model.path);
    let (graph, sha) = if env.imported.contains_key(&given) {
        env.imported_model(&given)?
    } else {
        let model = if given.is_relative() && !env.repo.join(&given).exists() { dir.join(&given) } else { env.repo.join(&given) };
        let m = load_model(&model).map_err(err)?;
        (m.graph, m.sha256)
    };
    if sha != plan.model.sha256 {
        return Err(format!("model `{}` is not the one the plan was made for", plan.model.path));
    }
    let mut graph = graph;
    decide(&mut graph, &ParamOptions { trainable: plan.trainable.clone(), frozen: plan.frozen.clone() }).map_err(err)?;
    let (graph, dims) = rank::planned_graph(&plan, graph).map_err(err)?;
    let mesh = plan.mesh();
    let world = mesh.world();
    let source = Source::new(&graph, InitMode::Load, None);
    for rank in 0..world.min(16) {
        rank::check_rank(&plan, &graph, &dims, rank).map_err(err)?;
        rank::rank_weights(&plan, &source, rank).map_err(err)?;
    }
    Ok(())
}

/// Planning options that keep one plan of gpt2 quick.
fn quick(mut options: PlanOptions) -> PlanOptions {
    options.time_limit_s = Some(2.0);
    options.seq_len.get_or_insert(16);
    options
}

fn config(env: &mut Env, case: &Case) -> Outcome {
    let dir = env.case_dir(case, "config")?;
    let path = main_file(&dir, case, "smp.json", ".json")?;
    let cfg = SmpConfig::load(&path).map_err(err)?;
    let options = PlanOptions::default().resolve(Some(cfg)).map_err(err)?;
    options.check_devices(8, "cpu:8").map_err(err)?;
    let model = env.analysed_model()?;
    options.check_layers(model.lg.layers.len(), MODEL).map_err(err)?;
    let cluster = ClusterSpec::cpu(&env.host, Some(8)).map_err(err)?;
    compile(env.analysed_model()?, &cluster, &quick(options)).map_err(err)?;
    Ok(())
}

fn cluster(env: &mut Env, case: &Case) -> Outcome {
    let dir = env.case_dir(case, "cluster")?;
    let path = main_file(&dir, case, "cluster.toml", ".toml")?;
    let spec = path.display().to_string();
    // as `--cluster FILE.toml` and `--cluster FILE.toml:4`
    let whole = ClusterSpec::parse_on(&spec, &env.host).map_err(err)?;
    let four = ClusterSpec::parse_on(&format!("{spec}:4"), &env.host).map_err(err)?;
    for c in [&whole, &four] {
        let _ = CommModel::new(c);
        let _ = c.to_toml();
    }
    compile(env.analysed_model()?, &four, &quick(PlanOptions::default())).map_err(err)?;
    Ok(())
}

fn tokens(env: &mut Env, case: &Case) -> Outcome {
    let exec = env.executor()?;
    let dir = env.case_dir(case, "tokens")?;
    let path = main_file(&dir, case, "data.bin", ".bin")?;
    let file = TokenFile::open(&path).map_err(err)?;
    let _ = (file.len(), file.dtype(), file.vocab_size());
    for order in [Order::Sequential, Order::Shuffled { seed: 7 }] {
        let file = TokenFile::open(&path).map_err(err)?;
        let stream = TokenStream::new(file, exec, 16, 4, order).map_err(err)?;
        let data = DataSource::Tokens(stream);
        for k in 1..=2 {
            data.replica_microbatches(k, 1, 2, 2).map_err(err)?;
        }
    }
    Ok(())
}

fn checkpoint(env: &mut Env, case: &Case) -> Outcome {
    let exec = env.executor()?;
    let root = env.case_dir(case, "checkpoint/step-00000002")?.parent().map(Path::to_path_buf).ok_or("no root")?;
    let loaded = Loaded::open(&root).map_err(err)?;
    for role in [Role::Param, Role::ExpAvg, Role::ExpAvgSq, Role::Buffer] {
        for (name, (dims, _)) in loaded.names(role) {
            let _ = loaded.assemble(&name, role).map_err(err)?;
            let _ = loaded.read_part(&name, role, &dims, &Slice::whole()).map_err(err)?;
            if let Some(&rows) = dims.first().filter(|&&d| d >= 2) {
                let half = Slice { axis: Some(0), ranges: vec![[0, rows as u64 / 2]], flat: Some([0, 1]), experts: None };
                let _ = loaded.read_part(&name, role, &dims, &half).map_err(err)?;
            }
        }
    }
    let trained = export::trained_executor(&loaded, exec.graph()).map_err(err)?;
    export::module_tensors(&trained).map_err(err)?;
    Ok(())
}

fn batch(env: &mut Env, case: &Case) -> Outcome {
    let exec = env.executor()?;
    let dir = env.case_dir(case, "batch")?;
    let path = dir.join(&case.files.first().ok_or("the case has no file")?.0);
    let data = open_data(exec, &path, 16, 4, Order::Sequential).map_err(err)?;
    let b = data.global_batch();
    let _ = data.tokens_per_batch();
    // the whole batch, and the second of two replicas when the batch divides
    let halves = if b % 2 == 0 { (1, 2, 1) } else { (0, 1, 1) };
    for (d, dp, m) in [(0, 1, 1), halves] {
        for mb in data.replica_microbatches(1, d, dp, m).map_err(err)? {
            exec.bind_inputs(mb).map_err(err)?;
        }
    }
    Ok(())
}
