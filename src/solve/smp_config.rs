//! SageMaker model-parallel parameters (`--config SMP.json`), read at the file edge into
//! settings that each remember where they came from (flag, config key, implication), and the
//! error of conflicting settings; [`super::options::PlanOptions::resolve`] merges them with the
//! flags.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::ir::ScheduleKind;

use super::{Optimize, Placement};

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

/// Two settings that cannot both hold.
pub(crate) fn conflict(first: Source, second: Source, why: impl Into<String>) -> ConfigError {
    ConfigError::Conflict { first, second, why: why.into() }
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
    pub schedule: Option<Sourced<ScheduleKind>>,
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
                        "simple" => ScheduleKind::GPipe,
                        // SMP's "interleaved" is 1F1B; Megatron's interleaving is `interleaved:V`.
                        "interleaved" => ScheduleKind::OneFOneB,
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
