//! SageMaker model-parallel parameters (`--config SMP.json`), read at the file edge into
//! settings that each remember where they came from (flag, config key, implication), and the
//! error of conflicting settings; [`super::options::PlanOptions::resolve`] merges them with the
//! flags.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::ir::{OffloadRule, Precision, ScheduleKind};

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

/// SMP parameter names that change nothing in a plan (DDP plumbing, tracing); read and
/// reported as ignored.
pub const SMP_IGNORED_KEYS: &[&str] = &[
    "ddp",
    "ddp_port",
    "ddp_dist_backend",
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
    "context_parallel_degree",
    "expert_parallel_degree",
    "sharded_data_parallel_degree",
    "microbatches",
    "pipeline",
    "placement_strategy",
    "optimize",
    "auto_partition",
    "default_partition",
    "active_microbatches",
    "fp16",
    "bf16",
    "fp16_params",
    "offload_activations",
    "sm_activation_offloading",
    "activation_loading_horizon",
];

/// The settings an SMP config file gives, each with its source.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SmpConfig {
    /// `pipeline_parallel_degree` / `partitions`.
    pub pp: Option<Sourced<usize>>,
    /// `tensor_parallel_degree`.
    pub tp: Option<Sourced<usize>>,
    /// `context_parallel_degree`.
    pub cp: Option<Sourced<usize>>,
    /// `expert_parallel_degree`.
    pub ep: Option<Sourced<usize>>,
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
    /// `fp16` / `fp16_params` (fp16-mixed) and `bf16` (bf16-mixed); all of those given false:
    /// f32, as SMP trains without them.
    pub precision: Option<Sourced<Precision>>,
    /// `offload_activations` (SMP v1) / `sm_activation_offloading` (v2): true forces
    /// offloading on for every checkpointed layer, false off.
    pub offload: Option<Sourced<OffloadRule>>,
    /// `activation_loading_horizon`.
    pub loading_horizon: Option<Sourced<usize>>,
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
        // `fp16`, `fp16_params`, `bf16` as given: (key, on, source)
        let mut precision_keys: Vec<(String, bool, Source)> = Vec::new();
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
                "context_parallel_degree" => cfg.cp = Some(positive()?),
                "expert_parallel_degree" => cfg.ep = Some(positive()?),
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
                "offload_activations" | "sm_activation_offloading" => {
                    let on = v.as_bool().ok_or_else(|| bad(format!("expected true or false, found {v}")))?;
                    let new = Sourced { value: if on { OffloadRule::Always } else { OffloadRule::Never }, source: src(v) };
                    if let Some(old) = &cfg.offload
                        && old.value != new.value
                    {
                        return Err(conflict(
                            old.source.clone(),
                            new.source,
                            "`sm_activation_offloading` is SMP v2's name for `offload_activations`: give one of them, or both alike",
                        ));
                    }
                    cfg.offload = Some(new);
                }
                "activation_loading_horizon" => cfg.loading_horizon = Some(positive()?),
                "fp16" | "bf16" | "fp16_params" => match v.as_bool() {
                    Some(b) => precision_keys.push((key.clone(), b, src(v))),
                    None => return Err(bad(format!("expected true or false, found {v}"))),
                },
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
        cfg.precision = precision_of(&precision_keys)?;
        Ok(cfg)
    }
}

/// The training precision SMP's `fp16`, `fp16_params` and `bf16` keys ask for: a key set true
/// turns on its mixed mode (`fp16_params` is SMP's older name for `fp16`); keys all false ask
/// for f32, what SMP trains in without them. Keys that disagree are a conflict naming both.
fn precision_of(keys: &[(String, bool, Source)]) -> Result<Option<Sourced<Precision>>, ConfigError> {
    let mode = |key: &str| if key == "bf16" { Precision::Bf16Mixed } else { Precision::Fp16Mixed };
    // fp16 and fp16_params name one switch: they must agree
    let fp16: Vec<&(String, bool, Source)> = keys.iter().filter(|(k, _, _)| k != "bf16").collect();
    if let [a, b] = fp16.as_slice()
        && a.1 != b.1
    {
        return Err(conflict(
            a.2.clone(),
            b.2.clone(),
            "`fp16_params` is SMP's older name for `fp16`: give one of them, or both alike",
        ));
    }
    let on: Vec<&(String, bool, Source)> = keys.iter().filter(|(_, b, _)| *b).collect();
    if let Some(a) = on.first()
        && let Some(b) = on.iter().find(|b| mode(&b.0) != mode(&a.0))
    {
        return Err(conflict(
            a.2.clone(),
            b.2.clone(),
            format!(
                "fp16 and bf16 mixed precision cannot both be on: keep one (`--precision {}` or `--precision {}`)",
                mode(&a.0),
                mode(&b.0)
            ),
        ));
    }
    Ok(match (on.first(), keys.first()) {
        (Some(k), _) => Some(Sourced { value: mode(&k.0), source: k.2.clone() }),
        (None, Some(k)) => Some(Sourced { value: Precision::F32, source: k.2.clone() }),
        (None, None) => None,
    })
}

fn as_object(v: &Value) -> Option<&Map<String, Value>> {
    v.as_object()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<SmpConfig, ConfigError> {
        SmpConfig::parse(json, Path::new("smp.json"))
    }

    fn precision(json: &str) -> Option<Precision> {
        parse(json).unwrap().precision.map(|p| p.value)
    }

    #[test]
    fn precision_keys_map_onto_the_mode() {
        assert_eq!(precision(r#"{"fp16": true}"#), Some(Precision::Fp16Mixed));
        assert_eq!(precision(r#"{"fp16_params": true}"#), Some(Precision::Fp16Mixed));
        assert_eq!(precision(r#"{"fp16": true, "fp16_params": true}"#), Some(Precision::Fp16Mixed));
        assert_eq!(precision(r#"{"bf16": true}"#), Some(Precision::Bf16Mixed));
        assert_eq!(precision(r#"{"bf16": true, "fp16": false}"#), Some(Precision::Bf16Mixed));
        assert_eq!(precision(r#"{"fp16": false}"#), Some(Precision::F32));
        assert_eq!(precision(r#"{"fp16": false, "bf16": false}"#), Some(Precision::F32));
        assert_eq!(precision(r#"{"pipeline_parallel_degree": 2}"#), None);
        // wrapped as SageMaker's distribution argument too
        assert_eq!(
            precision(r#"{"smdistributed": {"modelparallel": {"parameters": {"bf16": true}}}}"#),
            Some(Precision::Bf16Mixed)
        );
        // the source names the key
        let p = parse(r#"{"bf16": true}"#).unwrap().precision.unwrap();
        assert_eq!(p.source.to_string(), "`\"bf16\": true` in smp.json");
    }

    #[test]
    fn precision_keys_are_no_longer_ignored() {
        for key in ["fp16", "bf16", "fp16_params"] {
            assert!(!SMP_IGNORED_KEYS.contains(&key) && SMP_KEYS.contains(&key), "{key}");
            let cfg = parse(&format!(r#"{{"{key}": true}}"#)).unwrap();
            assert!(cfg.ignored.is_empty(), "{key}");
        }
    }

    #[test]
    fn offload_keys_map_onto_the_rule() {
        let offload = |json: &str| parse(json).unwrap().offload.map(|o| o.value);
        assert_eq!(offload(r#"{"offload_activations": true}"#), Some(OffloadRule::Always));
        assert_eq!(offload(r#"{"sm_activation_offloading": true}"#), Some(OffloadRule::Always));
        assert_eq!(offload(r#"{"offload_activations": false}"#), Some(OffloadRule::Never));
        assert_eq!(offload(r#"{"offload_activations": true, "sm_activation_offloading": true}"#), Some(OffloadRule::Always));
        assert_eq!(offload(r#"{"microbatches": 2}"#), None);
        let h = parse(r#"{"activation_loading_horizon": 2}"#).unwrap().loading_horizon.unwrap();
        assert_eq!(h.value, 2);
        for key in ["offload_activations", "sm_activation_offloading", "activation_loading_horizon"] {
            assert!(!SMP_IGNORED_KEYS.contains(&key) && SMP_KEYS.contains(&key), "{key}");
        }
        let e = parse(r#"{"offload_activations": true, "sm_activation_offloading": false}"#).unwrap_err().to_string();
        assert!(e.contains("\"offload_activations\": true") && e.contains("\"sm_activation_offloading\": false"), "{e}");
        let e = parse(r#"{"activation_loading_horizon": 0}"#).unwrap_err().to_string();
        assert!(e.contains("activation_loading_horizon") && e.contains("positive integer"), "{e}");
        let e = parse(r#"{"offload_activations": "yes"}"#).unwrap_err().to_string();
        assert!(e.contains("`offload_activations`") && e.contains("true or false"), "{e}");
    }

    #[test]
    fn contradictory_precision_keys_are_refused_naming_both() {
        let e = parse(r#"{"fp16": true, "bf16": true}"#).unwrap_err().to_string();
        assert!(e.contains("\"fp16\": true") && e.contains("\"bf16\": true") && e.contains("--precision"), "{e}");
        let e = parse(r#"{"fp16_params": true, "bf16": true}"#).unwrap_err().to_string();
        assert!(e.contains("fp16_params") && e.contains("bf16"), "{e}");
        let e = parse(r#"{"fp16": true, "fp16_params": false}"#).unwrap_err().to_string();
        assert!(e.contains("\"fp16\": true") && e.contains("\"fp16_params\": false") && e.contains("older name"), "{e}");
        let e = parse(r#"{"bf16": "yes"}"#).unwrap_err().to_string();
        assert!(e.contains("`bf16`") && e.contains("true or false"), "{e}");
    }
}
