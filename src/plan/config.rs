//! From what the user asked (flags and an SMP-style `--config` JSON) to validated planning
//! constraints. Every conflict is an error naming both settings.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde_json::{Map, Value};

use crate::solve;

// The schedule and the checkpointing policy are the IR's and the solver's own types, under
// the CLI's names (one enum each, from the flags to the plan file).
pub use crate::ir::ScheduleKind as Schedule;
pub use crate::solve::CheckpointRule as Checkpointing;

// Optimize, Baseline and Placement are the solver's own types, re-exported here for the CLI.
pub use crate::solve::{Baseline, MeshAxis as Axis, Optimize, Placement};

/// Manual pipeline cuts: per stage, its first and last layer (inclusive).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout(pub Vec<[usize; 2]>);

impl Layout {
    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.0.len()
    }
    /// Index of the last layer covered.
    pub fn last_layer(&self) -> usize {
        self.0.last().map_or(0, |r| r[1])
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, [a, b]) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("|")?;
            }
            write!(f, "{a}-{b}")?;
        }
        Ok(())
    }
}

impl FromStr for Layout {
    type Err = String;
    /// `"0-11|12-23"`; a single index (`"5"`) is a one-layer stage.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut stages = Vec::new();
        let mut next = 0usize;
        for (i, part) in s.split('|').enumerate() {
            let part = part.trim();
            let range = match part.split_once('-') {
                Some((a, b)) => a.trim().parse::<usize>().ok().zip(b.trim().parse::<usize>().ok()),
                None => part.parse::<usize>().ok().map(|a| (a, a)),
            };
            let Some((first, last)) = range else {
                return Err(format!(
                    "stage {i} `{part}`: expected FIRST-LAST layer indices, e.g. \"0-11|12-23\""
                ));
            };
            if first > last {
                return Err(format!("stage {i} `{part}`: first layer {first} is after last layer {last}"));
            }
            if first != next {
                return Err(format!(
                    "stage {i} `{part}` starts at layer {first}, but stages must be contiguous from layer 0: expected {next}"
                ));
            }
            next = last + 1;
            stages.push([first, last]);
        }
        Ok(Layout(stages))
    }
}

/// `NAME=V` for `--dim`.
pub fn parse_dim(s: &str) -> Result<(String, i64), String> {
    match s.split_once('=') {
        Some((n, v)) if !n.trim().is_empty() => match v.trim().parse::<i64>() {
            Ok(v) if v > 0 => Ok((n.trim().to_string(), v)),
            _ => Err(format!("`{s}`: the value of {n} must be a positive integer")),
        },
        _ => Err(format!("`{s}`: expected NAME=V, e.g. batch=8")),
    }
}

/// What the user asked for on the command line; `None` = not given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanRequest {
    /// `--global-batch`.
    pub global_batch: Option<u64>,
    /// `--seq-len`.
    pub seq_len: Option<u64>,
    /// `--pp`.
    pub pp: Option<usize>,
    /// `--tp`.
    pub tp: Option<usize>,
    /// `--dp`.
    pub dp: Option<usize>,
    /// `--zero`.
    pub zero: Option<u8>,
    /// `--sharded-dp`.
    pub sharded_dp: Option<usize>,
    /// `--microbatches`.
    pub microbatches: Option<usize>,
    /// `--schedule`.
    pub schedule: Option<Schedule>,
    /// `--checkpointing`.
    pub checkpointing: Option<Checkpointing>,
    /// `--optimize`.
    pub optimize: Option<Optimize>,
    /// `--placement`.
    pub placement: Option<Placement>,
    /// `--layout`.
    pub layout: Option<Layout>,
    /// `--memory-limit` in GiB.
    pub memory_limit_gib: Option<f64>,
    /// `--time-limit` in seconds.
    pub time_limit_s: Option<f64>,
    /// `--baseline`.
    pub baseline: Option<Baseline>,
}

/// Where a setting came from, for error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag, written as the user would (`--pp 4`).
    Flag(String),
    /// A key of the `--config` file (`pipeline_parallel_degree: 4` in smp.json).
    Config { file: PathBuf, key: String, value: String },
    /// Implied by another setting, described.
    Implied(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(s) => write!(f, "`{s}`"),
            Source::Config { file, key, value } => {
                write!(f, "`\"{key}\": {value}` in {}", file.display())
            }
            Source::Implied(s) => f.write_str(s),
        }
    }
}

/// A setting with where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Sourced<T> {
    /// The value.
    pub value: T,
    /// Its origin.
    pub source: Source,
}

/// Errors of reading `--config` or of conflicting settings.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("{file}: {message}")]
    Read { file: PathBuf, message: String },
    /// Not valid JSON or not an object.
    #[error("{file}: not an SMP config: {message}")]
    Parse { file: PathBuf, message: String },
    /// A key this tool does not know.
    #[error("{file}: unknown key `{key}` (known: {known})")]
    UnknownKey { file: PathBuf, key: String, known: String },
    /// A key with a value of the wrong type or range.
    #[error("{file}: `{key}`: {message}")]
    BadValue { file: PathBuf, key: String, message: String },
    /// Two settings that cannot both hold.
    #[error("{first} conflicts with {second}: {why}")]
    Conflict { first: Source, second: Source, why: String },
    /// A setting out of range.
    #[error("{setting}: {why}")]
    Invalid { setting: Source, why: String },
}

/// SMP parameter names that change nothing in a plan (precision, DDP plumbing, tracing); read
/// and reported as ignored.
pub const SMP_IGNORED_KEYS: &[&str] = &[
    "ddp",
    "ddp_port",
    "ddp_dist_backend",
    "fp16",
    "bf16",
    "fp16_params",
    "delayed_parameter_initialization",
    "skip_tracing",
    "horovod",
    "memory_weight",
    "contiguous",
    "prescaled_batch",
];

/// SMP parameter names that map to planning settings.
pub const SMP_KEYS: &[&str] = &[
    "pipeline_parallel_degree",
    "partitions",
    "tensor_parallel_degree",
    "sharded_data_parallel_degree",
    "microbatches",
    "pipeline",
    "placement_strategy",
    "optimize",
    "auto_partition",
    "default_partition",
    "active_microbatches",
];

/// The settings an SMP config file gives, each with its source.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SmpConfig {
    /// `pipeline_parallel_degree` / `partitions`.
    pub pp: Option<Sourced<usize>>,
    /// `tensor_parallel_degree`.
    pub tp: Option<Sourced<usize>>,
    /// `sharded_data_parallel_degree`.
    pub sharded_dp: Option<Sourced<usize>>,
    /// `microbatches`.
    pub microbatches: Option<Sourced<usize>>,
    /// `pipeline`.
    pub schedule: Option<Sourced<Schedule>>,
    /// `placement_strategy`.
    pub placement: Option<Sourced<Placement>>,
    /// `optimize`.
    pub optimize: Option<Sourced<Optimize>>,
    /// `auto_partition`.
    pub auto_partition: Option<Sourced<bool>>,
    /// `default_partition`.
    pub default_partition: Option<Sourced<usize>>,
    /// `active_microbatches`.
    pub active_microbatches: Option<Sourced<usize>>,
    /// Keys read but without effect on planning.
    pub ignored: Vec<String>,
}

impl SmpConfig {
    /// Reads an SMP config file.
    pub fn load(path: &Path) -> Result<SmpConfig, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { file: path.to_path_buf(), message: e.to_string() })?;
        SmpConfig::parse(&text, path)
    }

    /// Parses SMP config JSON: the `parameters` object itself, or wrapped as SageMaker's
    /// `distribution` argument (`{"smdistributed": {"modelparallel": {"parameters": {...}}}}`)
    /// or as `{"parameters": {...}}`.
    pub fn parse(text: &str, file: &Path) -> Result<SmpConfig, ConfigError> {
        let file_buf = || file.to_path_buf();
        let value: Value = serde_json::from_str(text)
            .map_err(|e| ConfigError::Parse { file: file_buf(), message: e.to_string() })?;
        let mut obj = as_object(&value).ok_or_else(|| ConfigError::Parse {
            file: file_buf(),
            message: "expected a JSON object".into(),
        })?;
        if let Some(mp) = obj
            .get("smdistributed")
            .and_then(as_object)
            .and_then(|o| o.get("modelparallel"))
            .and_then(as_object)
        {
            obj = mp;
        }
        if let Some(params) = obj.get("parameters").and_then(as_object) {
            obj = params;
        }
        let mut cfg = SmpConfig::default();
        for (key, v) in obj {
            let src = |v: &Value| Source::Config { file: file_buf(), key: key.clone(), value: v.to_string() };
            let bad = |message: String| ConfigError::BadValue { file: file_buf(), key: key.clone(), message };
            let positive = || -> Result<Sourced<usize>, ConfigError> {
                match v.as_u64() {
                    Some(n) if n >= 1 => Ok(Sourced { value: n as usize, source: src(v) }),
                    _ => Err(bad(format!("expected a positive integer, found {v}"))),
                }
            };
            let string = || -> Result<&str, ConfigError> {
                v.as_str().ok_or_else(|| bad(format!("expected a string, found {v}")))
            };
            match key.as_str() {
                "pipeline_parallel_degree" | "partitions" => {
                    let new = positive()?;
                    if let Some(old) = &cfg.pp
                        && old.value != new.value
                    {
                        return Err(ConfigError::Conflict {
                            first: old.source.clone(),
                            second: new.source,
                            why: "both set the pipeline-parallel degree".into(),
                        });
                    }
                    cfg.pp = Some(new);
                }
                "tensor_parallel_degree" => cfg.tp = Some(positive()?),
                "sharded_data_parallel_degree" => cfg.sharded_dp = Some(positive()?),
                "microbatches" => cfg.microbatches = Some(positive()?),
                "active_microbatches" => cfg.active_microbatches = Some(positive()?),
                "default_partition" => match v.as_u64() {
                    Some(n) => cfg.default_partition = Some(Sourced { value: n as usize, source: src(v) }),
                    None => return Err(bad(format!("expected a stage index (integer ≥ 0), found {v}"))),
                },
                "auto_partition" => match v.as_bool() {
                    Some(b) => cfg.auto_partition = Some(Sourced { value: b, source: src(v) }),
                    None => return Err(bad(format!("expected true or false, found {v}"))),
                },
                "pipeline" => {
                    let schedule = match string()? {
                        "simple" => Schedule::GPipe,
                        // SMP's "interleaved" is 1F1B; Megatron's interleaving is `interleaved:V`.
                        "interleaved" => Schedule::OneFOneB,
                        other => return Err(bad(format!("`{other}`: expected simple or interleaved"))),
                    };
                    cfg.schedule = Some(Sourced { value: schedule, source: src(v) });
                }
                "placement_strategy" => {
                    let p = string()?.parse::<Placement>().map_err(bad)?;
                    cfg.placement = Some(Sourced { value: p, source: src(v) });
                }
                "optimize" => {
                    let o = string()?.parse::<Optimize>().map_err(bad)?;
                    cfg.optimize = Some(Sourced { value: o, source: src(v) });
                }
                k if SMP_IGNORED_KEYS.contains(&k) => cfg.ignored.push(key.clone()),
                _ => {
                    return Err(ConfigError::UnknownKey {
                        file: file_buf(),
                        key: key.clone(),
                        known: SMP_KEYS
                            .iter()
                            .chain(SMP_IGNORED_KEYS)
                            .copied()
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
            }
        }
        Ok(cfg)
    }
}

fn as_object(v: &Value) -> Option<&Map<String, Value>> {
    v.as_object()
}

/// Validated planning constraints: every field `None` is left to the search.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Constraints {
    /// Samples per step.
    pub global_batch: Option<Sourced<u64>>,
    /// Sequence length.
    pub seq_len: Option<Sourced<u64>>,
    /// Pipeline-parallel degree.
    pub pp: Option<Sourced<usize>>,
    /// Tensor-parallel degree.
    pub tp: Option<Sourced<usize>>,
    /// Data-parallel degree.
    pub dp: Option<Sourced<usize>>,
    /// ZeRO stage.
    pub zero: Option<Sourced<u8>>,
    /// Sharded-data-parallel group size (implies ZeRO 3).
    pub sharded_dp: Option<Sourced<usize>>,
    /// Microbatches.
    pub microbatches: Option<Sourced<usize>>,
    /// In-flight microbatch cap.
    pub active_microbatches: Option<Sourced<usize>>,
    /// Schedule.
    pub schedule: Option<Sourced<Schedule>>,
    /// Checkpointing policy (default auto).
    pub checkpointing: Checkpointing,
    /// Objective (default speed).
    pub optimize: Optimize,
    /// Mesh axis order; `None` = searched.
    pub placement: Option<Sourced<Placement>>,
    /// Manual cuts.
    pub layout: Option<Sourced<Layout>>,
    /// Per-device memory limit (bytes).
    pub memory_limit_bytes: Option<u64>,
    /// Solver time limit (seconds).
    pub time_limit_s: Option<f64>,
    /// Plan as a peer would.
    pub baseline: Option<Baseline>,
    /// Config keys read but ignored.
    pub ignored_config_keys: Vec<String>,
}

fn flag<T: fmt::Display>(name: &str, v: Option<T>) -> Option<Sourced<T>> {
    v.map(|value| {
        let source = Source::Flag(format!("--{name} {value}"));
        Sourced { value, source }
    })
}

/// A flag and a config key for the same setting: equal values merge, different ones conflict.
fn merge<T: PartialEq>(
    flag: Option<Sourced<T>>,
    config: Option<Sourced<T>>,
    what: &str,
) -> Result<Option<Sourced<T>>, ConfigError> {
    match (flag, config) {
        (Some(f), Some(c)) if f.value != c.value => {
            Err(ConfigError::Conflict { first: f.source, second: c.source, why: format!("both set {what}") })
        }
        (Some(f), _) => Ok(Some(f)),
        (None, c) => Ok(c),
    }
}

fn positive<T: PartialEq + Default + fmt::Display>(s: &Option<Sourced<T>>) -> Result<(), ConfigError> {
    match s {
        Some(x) if x.value == T::default() => {
            Err(ConfigError::Invalid { setting: x.source.clone(), why: "must be at least 1".into() })
        }
        _ => Ok(()),
    }
}

impl Constraints {
    /// Merges flags and an optional config file, checking everything that needs neither the
    /// model nor the cluster.
    pub fn resolve(req: &PlanRequest, config: Option<SmpConfig>) -> Result<Constraints, ConfigError> {
        let cfg = config.unwrap_or_default();
        let mut c = Constraints {
            global_batch: flag("global-batch", req.global_batch),
            seq_len: flag("seq-len", req.seq_len),
            pp: merge(flag("pp", req.pp), cfg.pp, "the pipeline-parallel degree")?,
            tp: merge(flag("tp", req.tp), cfg.tp, "the tensor-parallel degree")?,
            dp: flag("dp", req.dp),
            zero: flag("zero", req.zero),
            sharded_dp: merge(
                flag("sharded-dp", req.sharded_dp),
                cfg.sharded_dp,
                "the sharded-data-parallel degree",
            )?,
            microbatches: merge(
                flag("microbatches", req.microbatches),
                cfg.microbatches,
                "the microbatch count",
            )?,
            active_microbatches: cfg.active_microbatches,
            schedule: merge(flag("schedule", req.schedule), cfg.schedule, "the pipeline schedule")?,
            checkpointing: req.checkpointing.unwrap_or(Checkpointing::Auto),
            optimize: merge(flag("optimize", req.optimize), cfg.optimize, "the objective")?
                .map_or(Optimize::Speed, |o| o.value),
            placement: merge(flag("placement", req.placement), cfg.placement, "the placement")?,
            layout: flag("layout", req.layout.clone()),
            memory_limit_bytes: None,
            time_limit_s: req.time_limit_s,
            baseline: req.baseline,
            ignored_config_keys: cfg.ignored,
        };
        for s in [&c.pp, &c.tp, &c.dp, &c.sharded_dp, &c.microbatches, &c.active_microbatches] {
            positive(s)?;
        }
        positive(&c.global_batch)?;
        positive(&c.seq_len)?;
        if let Some(z) = &c.zero
            && z.value > 3
        {
            return Err(ConfigError::Invalid {
                setting: z.source.clone(),
                why: "ZeRO stages are 0, 1, 2 and 3".into(),
            });
        }
        if let Some(g) = req.memory_limit_gib {
            if !(g.is_finite() && g > 0.0) {
                return Err(ConfigError::Invalid {
                    setting: Source::Flag(format!("--memory-limit {g}")),
                    why: "must be a positive number of GiB".into(),
                });
            }
            c.memory_limit_bytes = Some((g * (1u64 << 30) as f64) as u64);
        }
        if let Some(t) = req.time_limit_s
            && !(t.is_finite() && t > 0.0)
        {
            return Err(ConfigError::Invalid {
                setting: Source::Flag(format!("--time-limit {t}")),
                why: "must be a positive number of seconds".into(),
            });
        }

        // Sharded data parallelism is ZeRO-3 over groups of replicas.
        if let Some(sdp) = &c.sharded_dp {
            match &c.zero {
                Some(z) if z.value != 3 => {
                    return Err(ConfigError::Conflict {
                        first: sdp.source.clone(),
                        second: z.source.clone(),
                        why: "sharded data parallelism is ZeRO stage 3; drop --zero or give --zero 3".into(),
                    });
                }
                Some(_) => {}
                None => {
                    c.zero = Some(Sourced {
                        value: 3,
                        source: Source::Implied(format!("ZeRO 3 (implied by {})", sdp.source)),
                    })
                }
            }
            if let Some(dp) = &c.dp
                && dp.value % sdp.value != 0
            {
                return Err(ConfigError::Conflict {
                    first: sdp.source.clone(),
                    second: dp.source.clone(),
                    why: format!(
                        "the sharded group size {} must divide the data-parallel degree {}",
                        sdp.value, dp.value
                    ),
                });
            }
        }

        // SMP's auto_partition: false puts every layer on default_partition unless --layout cuts.
        if let Some(ap) = &cfg.auto_partition
            && !ap.value
            && c.layout.is_none()
        {
            let stage = cfg.default_partition.as_ref().map_or(0, |d| d.value);
            let why_source = cfg.default_partition.as_ref().map_or(ap.source.clone(), |d| d.source.clone());
            match &c.pp {
                Some(pp) if pp.value > 1 || stage > 0 => {
                    return Err(ConfigError::Conflict {
                        first: ap.source.clone(),
                        second: pp.source.clone(),
                        why: format!(
                            "without --layout every layer goes on stage {stage}, leaving the other stages of {} empty; give --layout \"FIRST-LAST|...\" with {} stages",
                            pp.value, pp.value
                        ),
                    });
                }
                Some(_) => {}
                None if stage > 0 => {
                    return Err(ConfigError::Invalid {
                        setting: why_source,
                        why: format!(
                            "every layer on stage {stage} leaves stages 0..{stage} empty; give --layout for manual cuts"
                        ),
                    });
                }
                None => {
                    c.pp = Some(Sourced {
                        value: 1,
                        source: Source::Implied(format!("one stage (implied by {})", ap.source)),
                    })
                }
            }
        }

        if let Some(layout) = &c.layout {
            if let Some(b) = c.baseline {
                return Err(ConfigError::Conflict {
                    first: layout.source.clone(),
                    second: Source::Flag(format!("--baseline {b}")),
                    why: "a baseline chooses its own cuts".into(),
                });
            }
            let v = c.schedule.as_ref().map_or(1, |s| s.value.virtual_stages());
            let n = layout.value.stages();
            match &c.pp {
                Some(pp) if pp.value * v != n => {
                    let why = if v > 1 {
                        format!(
                            "the layout has {n} stages but pp·V = {}·{v} = {} virtual stages",
                            pp.value,
                            pp.value * v
                        )
                    } else {
                        format!("the layout has {n} stages but the pipeline-parallel degree is {}", pp.value)
                    };
                    return Err(ConfigError::Conflict {
                        first: layout.source.clone(),
                        second: pp.source.clone(),
                        why,
                    });
                }
                Some(_) => {}
                None if n % v != 0 => {
                    let sched = c
                        .schedule
                        .as_ref()
                        .map(|s| s.source.clone())
                        .unwrap_or(Source::Implied(String::new()));
                    return Err(ConfigError::Conflict {
                        first: layout.source.clone(),
                        second: sched,
                        why: format!("{n} stages are not a multiple of {v} virtual stages per rank"),
                    });
                }
                None => {
                    c.pp = Some(Sourced {
                        value: n / v,
                        source: Source::Implied(format!("{} stages (from {})", n / v, layout.source)),
                    })
                }
            }
        }

        if let (Some(sched), Some(pp)) = (&c.schedule, &c.pp)
            && pp.value == 1
            && matches!(sched.value, Schedule::Interleaved { .. })
        {
            return Err(ConfigError::Conflict {
                first: sched.source.clone(),
                second: pp.source.clone(),
                why: "interleaving needs at least 2 pipeline stages".into(),
            });
        }

        // Batch arithmetic.
        if let Some(gb) = &c.global_batch {
            if let Some(dp) = &c.dp
                && gb.value % dp.value as u64 != 0
            {
                return Err(ConfigError::Conflict {
                    first: gb.source.clone(),
                    second: dp.source.clone(),
                    why: format!(
                        "the global batch {} is not divisible by {} data-parallel replicas",
                        gb.value, dp.value
                    ),
                });
            }
            if let Some(m) = &c.microbatches {
                let per_replica = gb.value / c.dp.as_ref().map_or(1, |d| d.value as u64);
                if per_replica % m.value as u64 != 0 {
                    let why = match &c.dp {
                        Some(d) => format!(
                            "each of {} replicas gets {per_replica} samples, not divisible into {} microbatches",
                            d.value, m.value
                        ),
                        None => {
                            format!("{} samples are not divisible into {} microbatches", gb.value, m.value)
                        }
                    };
                    return Err(ConfigError::Conflict {
                        first: m.source.clone(),
                        second: gb.source.clone(),
                        why,
                    });
                }
            }
        }
        if let (Some(a), Some(m)) = (&c.active_microbatches, &c.microbatches)
            && a.value > m.value
        {
            return Err(ConfigError::Conflict {
                first: a.source.clone(),
                second: m.source.clone(),
                why: "more microbatches in flight than there are".into(),
            });
        }
        Ok(c)
    }

    /// Checks the degrees against the cluster's device count, described by `cluster` (`--cluster
    /// h100-80gb:8`).
    pub fn check_devices(&self, devices: usize, cluster: &str) -> Result<(), ConfigError> {
        let cluster_src = || Source::Flag(format!("--cluster {cluster} ({devices} devices)"));
        let mut product = 1usize;
        let mut given: Vec<&Sourced<usize>> = Vec::new();
        for s in [&self.pp, &self.tp, &self.dp].into_iter().flatten() {
            product = product.saturating_mul(s.value);
            given.push(s);
        }
        let names = || given.iter().map(|s| s.source.to_string()).collect::<Vec<_>>().join(" · ");
        if product > devices || devices % product != 0 {
            let first = match given.as_slice() {
                [one] => one.source.clone(),
                _ => Source::Implied(names()),
            };
            return Err(ConfigError::Conflict {
                first,
                second: cluster_src(),
                why: if product > devices {
                    format!("the degrees need {product} devices")
                } else {
                    format!("{product} does not divide the {devices} devices")
                },
            });
        }
        if given.len() == 3 && product != devices {
            return Err(ConfigError::Conflict {
                first: Source::Implied(names()),
                second: cluster_src(),
                why: format!("pp·tp·dp = {product} must equal the device count; omit one to have it derived"),
            });
        }
        if let Some(sdp) = &self.sharded_dp {
            let dp_max =
                devices / self.pp.as_ref().map_or(1, |p| p.value) / self.tp.as_ref().map_or(1, |t| t.value);
            if sdp.value > dp_max {
                return Err(ConfigError::Conflict {
                    first: sdp.source.clone(),
                    second: cluster_src(),
                    why: format!("at most {dp_max} data-parallel replicas fit"),
                });
            }
        }
        Ok(())
    }

    /// Checks the manual layout against the model's layer count.
    pub fn check_layers(&self, layers: usize, model: &str) -> Result<(), ConfigError> {
        if let Some(l) = &self.layout
            && l.value.last_layer() + 1 != layers
        {
            return Err(ConfigError::Conflict {
                first: l.source.clone(),
                second: Source::Implied(format!(
                    "{model} ({layers} layers, 0..={})",
                    layers.saturating_sub(1)
                )),
                why: format!(
                    "the layout covers layers 0..={}; it must end at layer {}",
                    l.value.last_layer(),
                    layers.saturating_sub(1)
                ),
            });
        }
        if let Some(pp) = &self.pp
            && self.layout.is_none()
            && pp.value * self.schedule.as_ref().map_or(1, |s| s.value.virtual_stages()) > layers
        {
            return Err(ConfigError::Conflict {
                first: pp.source.clone(),
                second: Source::Implied(format!("{model} ({layers} layers)")),
                why: "every stage needs at least one layer".into(),
            });
        }
        Ok(())
    }
}

impl Constraints {
    /// The solver's configuration; `default_global_batch` is used when `--global-batch` was
    /// not given. HiGHS runs single-threaded so ties resolve the same way every run.
    pub fn to_plan_config(&self, default_global_batch: u64) -> solve::PlanConfig {
        let v = |s: &Option<Sourced<usize>>| s.as_ref().map(|x| x.value);
        let global_batch = self.global_batch.as_ref().map_or(default_global_batch, |g| g.value);
        let mut cfg = solve::PlanConfig::new(global_batch as usize);
        cfg.constraints = solve::SearchConstraints {
            pp: v(&self.pp),
            tp: v(&self.tp),
            dp: v(&self.dp),
            zero: self.zero.as_ref().map(|z| z.value),
            sharded_dp: v(&self.sharded_dp),
            microbatches: v(&self.microbatches),
            active_microbatches: v(&self.active_microbatches),
            schedule: self.schedule.as_ref().map(|s| s.value),
            checkpointing: Some(self.checkpointing),
            placement: self.placement.as_ref().map(|p| p.value),
            layout: self.layout.as_ref().map(|l| l.value.0.clone()),
            memory_limit: self.memory_limit_bytes,
            time_limit_s: self.time_limit_s,
            optimize: self.optimize,
        };
        cfg.baseline = self.baseline;
        cfg.threads = Some(1);
        cfg
    }
}
