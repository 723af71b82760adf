//! What the user asks of the planner, as one typed struct: the command line builds a
//! [`PlanOptions`], an SMP-style `--config` JSON ([`SmpConfig`]) merges into it
//! ([`PlanOptions::resolve`]), and the search reads it. Every conflict is an error naming both
//! settings and where each came from.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

use crate::cost::ClusterSpec;
use crate::ir::{ExpertDispatch, LayeredGraph, OffloadRule, Precision, ScheduleKind, SelectivePolicy, limits};

pub use super::smp_config::{ConfigError, SmpConfig, Source, Sourced};
use super::smp_config::conflict;
use super::{Baseline, CheckpointRule, Optimize, Placement};

/// Everything the planner may be told; `None` = searched (or the default named on the field).
/// Built by the CLI from its flags, by tests and benches directly.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanOptions {
    /// Samples per optimizer step over all replicas (default: devices × the graph's batch).
    pub global_batch: Option<u64>,
    /// Binds the symbolic sequence dimension (analysis).
    pub seq_len: Option<u64>,
    /// Binds other symbolic dimensions by name (analysis).
    pub dims: Vec<(String, i64)>,
    /// Pipeline-parallel degree.
    pub pp: Option<usize>,
    /// Tensor-parallel degree.
    pub tp: Option<usize>,
    /// Data-parallel degree.
    pub dp: Option<usize>,
    /// Context-parallel degree (`--cp`, SMP's `context_parallel_degree`): ranks each
    /// microbatch's sequence is split over.
    pub cp: Option<usize>,
    /// Expert-parallel degree (`--ep`, SMP's `expert_parallel_degree`): ranks a mixture of
    /// experts' experts are split over, carved from the data-parallel ranks (or folded over
    /// tensor × data ranks when `etp` is below `tp`).
    pub ep: Option<usize>,
    /// Expert-tensor-parallel degree (`--etp`, Megatron-Core's `--expert-tensor-parallel-size`):
    /// ranks each expert's weights are split over (default: `tp`); `ep · etp` divides `tp · dp`.
    pub etp: Option<usize>,
    /// Load imbalance of expert parallelism (`--expert-imbalance`): the busiest rank of an
    /// expert group runs this many times the mean routed tokens (default
    /// [`DEFAULT_EXPERT_IMBALANCE`]).
    pub expert_imbalance: Option<f64>,
    /// How routed tokens reach their experts (default: all-to-all, as `smp-runner` sends
    /// them); `per-node` prices an engine's DeepEP dispatcher.
    pub expert_dispatch: Option<ExpertDispatch>,
    /// Price the expert all-to-alls of each merged forward–backward pair beside the other's
    /// compute, as Megatron-Core's combined 1F1B runs them (`--overlap-moe-expert-parallel-comm`;
    /// default off, as `smp-runner` runs them): where expert parallelism is on and the schedule
    /// merges passes (no pipeline, or interleaved).
    pub expert_overlap: Option<bool>,
    /// Price the blocks' linear layers in fp8 with per-tensor dynamic scaling, as torchao's
    /// `Float8Linear` and Transformer Engine's fp8 recipes run them (`--float8-linears`;
    /// default off, as `smp-runner` runs them in 16 bits): their products at the device's
    /// fp8 rate, beside their operands' casts. Refused on devices without one.
    pub float8_linears: Option<bool>,
    /// Price each layer's gradient reduction beside the rest of the backward, as the engines'
    /// bucketed reductions run it (Megatron's `--overlap-grad-reduce`, Megatron-FSDP; default
    /// off, as `smp-runner` reduces after the backward).
    pub grad_overlap: Option<bool>,
    /// ZeRO stage 0..=3.
    pub zero: Option<u8>,
    /// Sharded data parallel: ZeRO-3 over groups of this many replicas.
    pub sharded_dp: Option<usize>,
    /// Microbatches per step.
    pub microbatches: Option<usize>,
    /// Cap on microbatches in flight per stage (SMP's `active_microbatches`).
    pub active_microbatches: Option<usize>,
    /// Pipeline schedule.
    pub schedule: Option<ScheduleKind>,
    /// Checkpointing rule (default: the solver chooses per layer).
    pub checkpointing: Option<CheckpointRule>,
    /// Fixed recompute (`--recompute-layers`): exactly these layers (`graph`'s indices) are
    /// checkpointed, the others not, as an engine's configuration names them; excludes
    /// `checkpointing`.
    pub checkpointed_layers: Option<BTreeSet<usize>>,
    /// Fixed selective recompute (`--selective-layers`): these layers rebuild their norms' and
    /// activation functions' outputs, the others not (beside `checkpointed_layers`, disjoint
    /// from it; excludes `checkpointing`).
    pub selective_layers: Option<BTreeSet<usize>>,
    /// What a selectively recomputed layer rebuilds (`--selective-policy`; default: its
    /// norms' and activation functions' outputs).
    pub selective_policy: Option<SelectivePolicy>,
    /// Every layer split as Megatron-LM splits it (columns then rows, the vocabulary of the
    /// embedding and head), as the engines' tensor parallelism does, instead of the intra-layer
    /// ILP's choice.
    pub megatron_split: bool,
    /// Objective (default: speed).
    pub optimize: Option<Optimize>,
    /// Mesh axis order.
    pub placement: Option<Placement>,
    /// Manual pipeline cuts (per virtual stage when interleaved).
    pub layout: Option<Layout>,
    /// Memory per device to plan for, GiB (default: the device's).
    pub memory_limit_gib: Option<f64>,
    /// Wall-clock budget for the whole search, seconds.
    pub time_limit_s: Option<f64>,
    /// Plan as a peer would instead of searching.
    pub baseline: Option<Baseline>,
    /// Sequence parallelism in tensor-parallel layers (norms and elementwise ops on token
    /// chunks, with the all-gathers codegen adds): `None` = searched (every tensor-parallel
    /// candidate is priced with and without it), `Some(true)` forced on, `Some(false)` off.
    pub sequence_parallel: Option<bool>,
    /// Training precision (`--precision`, SMP's `fp16`/`bf16`/`fp16_params`); default: the
    /// cluster's ([`ClusterSpec::default_precision`]: bf16-mixed on GPUs, f32 on `cpu`).
    pub precision: Option<Precision>,
    /// How the mixed precisions are priced; default: the cluster's
    /// ([`PlanOptions::mixed_recipe_for`]).
    pub mixed_recipe: Option<crate::ir::MixedRecipe>,
    /// Activation offloading of checkpointed layers (`--offload-activations`, SMP's
    /// `offload_activations` / `sm_activation_offloading`); default: `auto` (the solver
    /// offloads where memory needs it) on clusters with a host link.
    pub offload: Option<OffloadRule>,
    /// Microbatches of offloaded inputs back on the device ahead of their backward (SMP's
    /// `activation_loading_horizon`; default [`OffloadRule::DEFAULT_HORIZON`]).
    pub loading_horizon: Option<usize>,
    /// What is trained beyond the model's own record or rules (`--trainable`/`--frozen`); the
    /// plan records them and the runner trains by them.
    pub params: crate::passes::params::ParamOptions,
    /// The cluster as the user named it (`--cluster` text), for messages; default: the spec's
    /// name and device count.
    pub cluster_flag: Option<String>,
    /// Where settings not given as flags came from (config keys, implications); a setting
    /// without an entry is a flag.
    pub sources: BTreeMap<Setting, Source>,
    /// Config keys read but without effect on planning.
    pub ignored_config_keys: Vec<String>,
}

/// Default of `--expert-imbalance`: with the router's auxiliary load-balancing loss, the
/// busiest rank of an expert group takes about 10 % more routed tokens than the mean
/// (dropless MoE training as Megatron-Core and DeepSpeed-MoE report it).
pub const DEFAULT_EXPERT_IMBALANCE: f64 = 1.1;

/// A setting of [`PlanOptions`] that can conflict with another, for provenance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Setting {
    /// `--global-batch`.
    GlobalBatch,
    /// `--seq-len`.
    SeqLen,
    /// `--pp`.
    Pp,
    /// `--tp`.
    Tp,
    /// `--dp`.
    Dp,
    /// `--cp`.
    Cp,
    /// `--ep`.
    Ep,
    /// `--etp`.
    Etp,
    /// `--zero`.
    Zero,
    /// `--sharded-dp`.
    ShardedDp,
    /// `--microbatches`.
    Microbatches,
    /// SMP's `active_microbatches`.
    ActiveMicrobatches,
    /// `--schedule`.
    Schedule,
    /// `--optimize`.
    Optimize,
    /// `--placement`.
    Placement,
    /// `--layout`.
    Layout,
    /// `--precision`.
    Precision,
    /// `--offload-activations`.
    Offload,
    /// `--activation-loading-horizon`.
    LoadingHorizon,
    /// `--checkpointing`.
    Checkpointing,
    /// `--recompute-layers`.
    CheckpointedLayers,
    /// `--selective-layers`.
    SelectiveLayers,
    /// `--selective-policy`.
    SelectivePolicy,
    /// `--overlap-expert-comm`.
    ExpertOverlap,
    /// `--overlap-grad-sync`.
    GradOverlap,
    /// `--float8-linears`.
    Float8Linears,
    /// `--expert-imbalance`.
    ExpertImbalance,
}

impl Setting {
    /// The command-line flag, without dashes.
    pub fn flag(self) -> &'static str {
        match self {
            Setting::GlobalBatch => "global-batch",
            Setting::SeqLen => "seq-len",
            Setting::Pp => "pp",
            Setting::Tp => "tp",
            Setting::Dp => "dp",
            Setting::Cp => "cp",
            Setting::Ep => "ep",
            Setting::Etp => "etp",
            Setting::Zero => "zero",
            Setting::ShardedDp => "sharded-dp",
            Setting::Microbatches => "microbatches",
            Setting::ActiveMicrobatches => "active-microbatches",
            Setting::Schedule => "schedule",
            Setting::Optimize => "optimize",
            Setting::Placement => "placement",
            Setting::Layout => "layout",
            Setting::Precision => "precision",
            Setting::Offload => "offload-activations",
            Setting::LoadingHorizon => "activation-loading-horizon",
            Setting::Checkpointing => "checkpointing",
            Setting::CheckpointedLayers => "recompute-layers",
            Setting::SelectiveLayers => "selective-layers",
            Setting::SelectivePolicy => "selective-policy",
            Setting::ExpertOverlap => "overlap-expert-comm",
            Setting::GradOverlap => "overlap-grad-sync",
            Setting::Float8Linears => "float8-linears",
            Setting::ExpertImbalance => "expert-imbalance",
        }
    }
}

/// `interleaved:V|gpipe|1f1b|zb-h1` for `--schedule` (interleaving needs V ≥ 2).
pub fn parse_schedule(s: &str) -> Result<ScheduleKind, String> {
    match s {
        "gpipe" => Ok(ScheduleKind::GPipe),
        "1f1b" => Ok(ScheduleKind::OneFOneB),
        "zb-h1" => Ok(ScheduleKind::ZbH1),
        _ => match s.strip_prefix("interleaved:") {
            Some(v) => match v.parse::<usize>() {
                Ok(v) if v >= 2 => Ok(ScheduleKind::Interleaved { virtual_stages: v }),
                _ => Err(format!("`{s}`: interleaved:V needs V ≥ 2 virtual stages per rank")),
            },
            None => Err(format!("`{s}`: expected gpipe, 1f1b, interleaved:V or zb-h1")),
        },
    }
}

/// `auto|none|selective|full` for `--checkpointing`.
pub fn parse_checkpointing(s: &str) -> Result<CheckpointRule, String> {
    s.parse()
}

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
                return Err(format!("stage {i} `{part}`: expected FIRST-LAST layer indices, e.g. \"0-11|12-23\""));
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

/// `"1-7,9"` for `--recompute-layers`: layer indices and inclusive ranges, comma-separated;
/// `none` (or an empty string) is no layer.
pub fn parse_layer_set(s: &str) -> Result<BTreeSet<usize>, String> {
    let mut out = BTreeSet::new();
    let s = s.trim();
    if s.is_empty() || s == "none" {
        return Ok(out);
    }
    for part in s.split(',') {
        let part = part.trim();
        let range = match part.split_once('-') {
            Some((a, b)) => a.trim().parse::<usize>().ok().zip(b.trim().parse::<usize>().ok()),
            None => part.parse::<usize>().ok().map(|a| (a, a)),
        };
        match range {
            Some((a, b)) if a <= b => out.extend(a..=b),
            _ => return Err(format!("`{part}`: expected a layer index or FIRST-LAST, e.g. \"1-7,9\"")),
        }
    }
    Ok(out)
}

/// A layer set in the form [`parse_layer_set`] reads (`1-7,9`; `none` when empty).
pub fn format_layer_set(set: &BTreeSet<usize>) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut it = set.iter().copied().peekable();
    while let Some(a) = it.next() {
        let mut b = a;
        while it.peek() == Some(&(b + 1)) {
            b += 1;
            it.next();
        }
        parts.push(if a == b { a.to_string() } else { format!("{a}-{b}") });
    }
    if parts.is_empty() { "none".to_string() } else { parts.join(",") }
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

impl PlanOptions {
    /// Where `setting` came from: its recorded source, else the flag that gave it.
    pub fn source(&self, setting: Setting) -> Source {
        if let Some(s) = self.sources.get(&setting) {
            return s.clone();
        }
        let value = match setting {
            Setting::GlobalBatch => self.global_batch.map(|v| v.to_string()),
            Setting::SeqLen => self.seq_len.map(|v| v.to_string()),
            Setting::Pp => self.pp.map(|v| v.to_string()),
            Setting::Tp => self.tp.map(|v| v.to_string()),
            Setting::Dp => self.dp.map(|v| v.to_string()),
            Setting::Cp => self.cp.map(|v| v.to_string()),
            Setting::Ep => self.ep.map(|v| v.to_string()),
            Setting::Etp => self.etp.map(|v| v.to_string()),
            Setting::Zero => self.zero.map(|v| v.to_string()),
            Setting::ShardedDp => self.sharded_dp.map(|v| v.to_string()),
            Setting::Microbatches => self.microbatches.map(|v| v.to_string()),
            Setting::ActiveMicrobatches => self.active_microbatches.map(|v| v.to_string()),
            Setting::Schedule => self.schedule.map(|v| v.to_string()),
            Setting::Optimize => self.optimize.map(|v| v.to_string()),
            Setting::Placement => self.placement.map(|v| v.to_string()),
            Setting::Layout => self.layout.as_ref().map(|v| v.to_string()),
            Setting::Precision => self.precision.map(|v| v.to_string()),
            Setting::Offload => self.offload.map(|v| v.to_string()),
            Setting::LoadingHorizon => self.loading_horizon.map(|v| v.to_string()),
            Setting::Checkpointing => self.checkpointing.map(|v| v.to_string()),
            Setting::CheckpointedLayers => self.checkpointed_layers.as_ref().map(|v| format_layer_set(v)),
            Setting::SelectiveLayers => self.selective_layers.as_ref().map(|v| format_layer_set(v)),
            Setting::SelectivePolicy => self.selective_policy.map(|v| v.to_string()),
            Setting::ExpertImbalance => self.expert_imbalance.map(|v| v.to_string()),
            Setting::ExpertOverlap | Setting::GradOverlap | Setting::Float8Linears => None,
        };
        Source::Flag(format!("--{} {}", setting.flag(), value.unwrap_or_default()))
    }

    /// The training precision on `cluster`: as given, else the cluster's default (bf16-mixed
    /// on GPUs, f32 on `cpu`).
    pub fn precision_for(&self, cluster: &ClusterSpec) -> Precision {
        self.precision.unwrap_or_else(|| cluster.default_precision())
    }

    /// How the mixed precisions are priced on `cluster`: as given, else `Autocast` on `cpu`
    /// (what the runner executes and holds there) and `LowModel` on GPUs (the 16-bit model
    /// beside fp32 masters that Megatron-LM, DeepSpeed and FSDP keep, and that the published
    /// runs were trained with; docs/precision.md says what the runner holds on GPUs).
    pub fn mixed_recipe_for(&self, cluster: &ClusterSpec) -> crate::ir::MixedRecipe {
        self.mixed_recipe.unwrap_or(if cluster.is_cpu() { crate::ir::MixedRecipe::Autocast } else { crate::ir::MixedRecipe::LowModel })
    }

    /// Whether the plan's mixed precision keeps its gradients in fp32 beside a 16-bit model
    /// ([`crate::ir::MixedRecipe::LowModelFp32Grads`]) on `cluster`: `Parallelism::fp32_main_grads`.
    pub fn fp32_main_grads_for(&self, cluster: &ClusterSpec) -> bool {
        self.precision_for(cluster).is_mixed() && self.mixed_recipe_for(cluster) == crate::ir::MixedRecipe::LowModelFp32Grads
    }

    /// The offloading rule on `cluster`: as given (default `auto`), but never where the
    /// cluster has no host link ([`PlanOptions::check_host_link`] refuses a forced `on` there).
    pub fn offload_for(&self, cluster: &ClusterSpec) -> OffloadRule {
        match self.offload.unwrap_or_default() {
            _ if cluster.host_bandwidth.is_none() => OffloadRule::Never,
            rule => rule,
        }
    }

    /// Offloading forced on needs a host link to move the activations over.
    pub fn check_host_link(&self, cluster: &ClusterSpec, name: &str) -> Result<(), ConfigError> {
        if self.offload == Some(OffloadRule::Always) && cluster.host_bandwidth.is_none() {
            return Err(conflict(
                self.source(Setting::Offload),
                Source::Flag(format!("--cluster {name}")),
                "the cluster states no host link to offload over; set `host_bandwidth` (bytes/s per direction) in its cluster file",
            ));
        }
        Ok(())
    }

    /// Whether some layer may rebuild its norms' and activation functions' outputs (the
    /// `selective` and `auto-selective` rules, or selective layers given).
    pub fn rebuilds_selectively(&self) -> bool {
        matches!(self.checkpointing, Some(CheckpointRule::Selective | CheckpointRule::AutoSelective)) || self.selective_layers.as_ref().is_some_and(|s| !s.is_empty())
    }

    /// The fixed recompute as one rule per layer of a model of `layers` layers, if fixed:
    /// `Always` for the checkpointed layers, `Selective` for the selective ones, `Never` for the
    /// others.
    pub fn checkpoint_flags(&self, layers: usize) -> Option<Vec<CheckpointRule>> {
        if self.checkpointed_layers.is_none() && self.selective_layers.is_none() {
            return None;
        }
        let has = |set: &Option<BTreeSet<usize>>, l: usize| set.as_ref().is_some_and(|s| s.contains(&l));
        Some(
            (0..layers)
                .map(|l| match (has(&self.checkpointed_layers, l), has(&self.selective_layers, l)) {
                    (true, _) => CheckpointRule::Always,
                    (false, true) => CheckpointRule::Selective,
                    (false, false) => CheckpointRule::Never,
                })
                .collect(),
        )
    }

    /// The per-device memory limit in bytes, when one is given.
    pub fn memory_limit_bytes(&self) -> Option<u64> {
        self.memory_limit_gib.map(|g| (g * (1u64 << 30) as f64) as u64)
    }

    /// The global batch: as given, else one graph batch per device.
    pub fn global_batch_for(&self, lg: &LayeredGraph, cluster: &ClusterSpec) -> u64 {
        self.global_batch.unwrap_or(cluster.devices as u64 * lg.dims.graph_batch.max(1) as u64)
    }

    /// Takes a config key's value for `setting` unless a flag gave it: equal values merge,
    /// different ones conflict.
    fn merge<T: PartialEq + Clone>(
        &mut self,
        setting: Setting,
        field: fn(&mut PlanOptions) -> &mut Option<T>,
        config: Option<Sourced<T>>,
        what: &str,
    ) -> Result<(), ConfigError> {
        let Some(c) = config else { return Ok(()) };
        match field(self).clone() {
            Some(f) if f != c.value => Err(conflict(self.source(setting), c.source, format!("both set {what}"))),
            Some(_) => Ok(()),
            None => {
                *field(self) = Some(c.value);
                self.sources.insert(setting, c.source);
                Ok(())
            }
        }
    }

    /// Sets a value implied by other settings, with its description.
    fn imply<T>(&mut self, setting: Setting, field: fn(&mut PlanOptions) -> &mut Option<T>, value: T, why: String) {
        *field(self) = Some(value);
        self.sources.insert(setting, Source::Implied(why));
    }

    /// Merges an optional SMP config into the flags and checks everything that needs neither
    /// the model nor the cluster.
    pub fn resolve(mut self, config: Option<SmpConfig>) -> Result<PlanOptions, ConfigError> {
        let cfg = config.unwrap_or_default();
        self.merge(Setting::Pp, |o| &mut o.pp, cfg.pp, "the pipeline-parallel degree")?;
        self.merge(Setting::Tp, |o| &mut o.tp, cfg.tp, "the tensor-parallel degree")?;
        self.merge(Setting::Cp, |o| &mut o.cp, cfg.cp, "the context-parallel degree")?;
        self.merge(Setting::Ep, |o| &mut o.ep, cfg.ep, "the expert-parallel degree")?;
        self.merge(Setting::ShardedDp, |o| &mut o.sharded_dp, cfg.sharded_dp, "the sharded-data-parallel degree")?;
        self.merge(Setting::Microbatches, |o| &mut o.microbatches, cfg.microbatches, "the microbatch count")?;
        self.merge(Setting::ActiveMicrobatches, |o| &mut o.active_microbatches, cfg.active_microbatches, "the in-flight cap")?;
        self.merge(Setting::Schedule, |o| &mut o.schedule, cfg.schedule, "the pipeline schedule")?;
        self.merge(Setting::Optimize, |o| &mut o.optimize, cfg.optimize, "the objective")?;
        self.merge(Setting::Placement, |o| &mut o.placement, cfg.placement, "the placement")?;
        self.merge(Setting::Precision, |o| &mut o.precision, cfg.precision, "the training precision")?;
        self.merge(Setting::Offload, |o| &mut o.offload, cfg.offload, "activation offloading")?;
        self.merge(Setting::LoadingHorizon, |o| &mut o.loading_horizon, cfg.loading_horizon, "the activation loading horizon")?;
        self.ignored_config_keys.extend(cfg.ignored);
        self.check_ranges()?;
        self.check_sharded_dp()?;
        self.apply_auto_partition(cfg.auto_partition, cfg.default_partition)?;
        self.check_layout()?;
        if let (Some(ScheduleKind::Interleaved { .. }), Some(1)) = (self.schedule, self.pp) {
            return Err(conflict(
                self.source(Setting::Schedule),
                self.source(Setting::Pp),
                "interleaving needs at least 2 pipeline stages",
            ));
        }
        self.check_batch()?;
        self.check_recompute()?;
        self.check_offload()?;
        Ok(self)
    }

    /// The recompute rule or the layer lists, not both; a layer in one list; no selective
    /// recompute under ZB-H1, whose rebuilt outputs would wait from the B to the W.
    fn check_recompute(&self) -> Result<(), ConfigError> {
        for (given, setting, what) in [(&self.checkpointed_layers, Setting::CheckpointedLayers, "recomputed"), (&self.selective_layers, Setting::SelectiveLayers, "selectively recomputed")] {
            if let (Some(rule), Some(_)) = (self.checkpointing, given) {
                return Err(conflict(self.source(setting), self.source(Setting::Checkpointing), format!("the {what} layers are given one by one; drop the `{rule}` rule")));
            }
        }
        if let (Some(full), Some(sel)) = (&self.checkpointed_layers, &self.selective_layers)
            && let Some(both) = full.intersection(sel).next()
        {
            return Err(conflict(
                self.source(Setting::SelectiveLayers),
                self.source(Setting::CheckpointedLayers),
                format!("layer {both} is both recomputed whole and selectively; a recomputed layer rebuilds everything, so name it in one list"),
            ));
        }
        if self.selective_policy.is_some_and(|p| p != SelectivePolicy::default()) && !self.rebuilds_selectively() {
            return Err(ConfigError::Invalid {
                setting: self.source(Setting::SelectivePolicy),
                why: "says what selectively recomputed layers rebuild, and no layer is: give --checkpointing selective or auto-selective, or --selective-layers".into(),
            });
        }
        if self.schedule == Some(ScheduleKind::ZbH1) && self.rebuilds_selectively() {
            let which = if self.selective_layers.is_some() { Setting::SelectiveLayers } else { Setting::Checkpointing };
            return Err(conflict(
                self.source(which),
                self.source(Setting::Schedule),
                "under ZB-H1 a layer's rebuilt norms and activations would wait from its B to its W, so selective recompute saves nothing there; choose another schedule, or --checkpointing auto",
            ));
        }
        Ok(())
    }

    /// Offloading moves what checkpointed layers keep: forcing it on needs checkpointing.
    fn check_offload(&self) -> Result<(), ConfigError> {
        let none_checkpointed = matches!(self.checkpointing, Some(CheckpointRule::Never | CheckpointRule::Selective)) || self.checkpointed_layers.as_ref().is_some_and(BTreeSet::is_empty);
        if self.offload == Some(OffloadRule::Always) && none_checkpointed {
            let which = if self.checkpointed_layers.is_some() { Setting::CheckpointedLayers } else { Setting::Checkpointing };
            return Err(conflict(
                self.source(Setting::Offload),
                self.source(which),
                "offloading moves the inputs checkpointed layers keep, and no layer is checkpointed; \
                 give --checkpointing auto or full, or drop the offloading",
            ));
        }
        Ok(())
    }

    /// Positive degrees, ZeRO stages, limits.
    fn check_ranges(&self) -> Result<(), ConfigError> {
        let positive = [
            (Setting::Pp, self.pp.map(|v| v as u64)),
            (Setting::Tp, self.tp.map(|v| v as u64)),
            (Setting::Dp, self.dp.map(|v| v as u64)),
            (Setting::Cp, self.cp.map(|v| v as u64)),
            (Setting::Ep, self.ep.map(|v| v as u64)),
            (Setting::Etp, self.etp.map(|v| v as u64)),
            (Setting::ShardedDp, self.sharded_dp.map(|v| v as u64)),
            (Setting::Microbatches, self.microbatches.map(|v| v as u64)),
            (Setting::ActiveMicrobatches, self.active_microbatches.map(|v| v as u64)),
            (Setting::GlobalBatch, self.global_batch),
            (Setting::SeqLen, self.seq_len),
            (Setting::LoadingHorizon, self.loading_horizon.map(|v| v as u64)),
        ];
        if let Some((s, _)) = positive.iter().find(|(_, v)| *v == Some(0)) {
            return Err(ConfigError::Invalid { setting: self.source(*s), why: "must be at least 1".into() });
        }
        if self.zero.is_some_and(|z| z > 3) {
            return Err(ConfigError::Invalid { setting: self.source(Setting::Zero), why: "ZeRO stages are 0, 1, 2 and 3".into() });
        }
        let too_large = [
            (Setting::GlobalBatch, self.global_batch, limits::MAX_GLOBAL_BATCH, "samples per step"),
            (Setting::SeqLen, self.seq_len, limits::MAX_DIM, "tokens"),
            (Setting::Microbatches, self.microbatches.map(|m| m as u64), limits::MAX_STAGE_MICROBATCHES as u64, "microbatches per step"),
        ];
        if let Some((s, _, max, what)) = too_large.iter().find(|(_, v, max, _)| v.is_some_and(|v| v > *max)) {
            return Err(ConfigError::Invalid { setting: self.source(*s), why: format!("must be at most {max} {what}") });
        }
        if let Some((name, v)) = self.dims.iter().find(|(_, v)| *v < 1 || *v as u64 > limits::MAX_DIM) {
            return Err(ConfigError::Invalid { setting: Source::Flag(format!("--dim {name}={v}")), why: format!("must be in 1..={}", limits::MAX_DIM) });
        }
        if let Some(g) = self.memory_limit_gib
            && !(g.is_finite() && g > 0.0)
        {
            return Err(ConfigError::Invalid {
                setting: Source::Flag(format!("--memory-limit {g}")),
                why: "must be a positive number of GiB".into(),
            });
        }
        if let Some(f) = self.expert_imbalance
            && !(f.is_finite() && f >= 1.0)
        {
            return Err(ConfigError::Invalid {
                setting: Source::Flag(format!("--expert-imbalance {f}")),
                why: "must be a number ≥ 1 (the busiest expert rank's routed tokens over the mean)".into(),
            });
        }
        if let (Some(etp), Some(tp)) = (self.etp, self.tp)
            && tp % etp != 0
        {
            return Err(conflict(
                self.source(Setting::Etp),
                self.source(Setting::Tp),
                format!("the expert-tensor degree {etp} must divide the tensor degree {tp} (give --etp 1 or --etp {tp})"),
            ));
        }
        let folded = self.etp.is_some_and(|e| self.tp.is_none_or(|t| t != e));
        if folded
            && let Some(cp) = self.cp.filter(|&c| c > 1)
        {
            return Err(conflict(
                self.source(Setting::Etp),
                self.source(Setting::Cp),
                format!("expert groups folded over tensor × data ranks are not built with context parallelism ({cp}); drop --etp or give --cp 1"),
            ));
        }
        match (self.ep, self.dp, self.tp) {
            (Some(ep), Some(dp), tp) if !folded && dp % ep != 0 => {
                let hint = tp.filter(|&t| t > 1 && (t * dp) % ep == 0).map_or(String::new(), |_| "; or fold the groups over the tensor ranks too with --etp 1".to_string());
                return Err(conflict(
                    self.source(Setting::Ep),
                    self.source(Setting::Dp),
                    format!("expert groups are carved from the data-parallel ranks at --etp = --tp: the expert-parallel degree {ep} must divide the data-parallel degree {dp}{hint}"),
                ));
            }
            (Some(ep), Some(dp), Some(tp)) if folded => {
                let etp = self.etp.unwrap_or(tp);
                if (tp * dp) % (ep * etp) != 0 {
                    return Err(conflict(
                        self.source(Setting::Ep),
                        self.source(Setting::Etp),
                        format!("folded expert groups re-factor a stage's tp · dp = {} ranks as expert-tensor × expert-parallel × expert-data: ep · etp = {ep} · {etp} must divide them", tp * dp),
                    ));
                }
            }
            _ => {}
        }
        if let Some(t) = self.time_limit_s
            && !(t.is_finite() && t > 0.0)
        {
            return Err(ConfigError::Invalid {
                setting: Source::Flag(format!("--time-limit {t}")),
                why: "must be a positive number of seconds".into(),
            });
        }
        Ok(())
    }

    /// Sharded data parallelism is ZeRO-3 over groups of replicas.
    fn check_sharded_dp(&mut self) -> Result<(), ConfigError> {
        let Some(sdp) = self.sharded_dp else { return Ok(()) };
        if sdp == 1 {
            // SMP's degree 1: sharded data parallelism is off
            self.sharded_dp = None;
            return Ok(());
        }
        let sdp_src = self.source(Setting::ShardedDp);
        match self.zero {
            Some(z) if z != 3 => {
                return Err(conflict(
                    sdp_src,
                    self.source(Setting::Zero),
                    "sharded data parallelism is ZeRO stage 3; drop --zero or give --zero 3",
                ));
            }
            Some(_) => {}
            None => self.imply(Setting::Zero, |o| &mut o.zero, 3, format!("ZeRO 3 (implied by {sdp_src})")),
        }
        if let Some(dp) = self.dp
            && dp % sdp != 0
        {
            return Err(conflict(
                sdp_src,
                self.source(Setting::Dp),
                format!("the sharded group size {sdp} must divide the data-parallel degree {dp}"),
            ));
        }
        Ok(())
    }

    /// SMP's `auto_partition: false` puts every layer on `default_partition` unless `--layout`
    /// cuts.
    fn apply_auto_partition(
        &mut self,
        auto_partition: Option<Sourced<bool>>,
        default_partition: Option<Sourced<usize>>,
    ) -> Result<(), ConfigError> {
        let Some(ap) = auto_partition.filter(|ap| !ap.value) else { return Ok(()) };
        if self.layout.is_some() {
            return Ok(());
        }
        let stage = default_partition.as_ref().map_or(0, |d| d.value);
        let why_source = default_partition.as_ref().map_or(ap.source.clone(), |d| d.source.clone());
        match self.pp {
            Some(pp) if pp > 1 || stage > 0 => Err(conflict(
                ap.source,
                self.source(Setting::Pp),
                format!(
                    "without --layout every layer goes on stage {stage}, leaving the other stages of {pp} empty; give --layout \"FIRST-LAST|...\" with {pp} stages"
                ),
            )),
            Some(_) => Ok(()),
            None if stage > 0 => Err(ConfigError::Invalid {
                setting: why_source,
                why: format!("every layer on stage {stage} leaves stages 0..{stage} empty; give --layout for manual cuts"),
            }),
            None => {
                self.imply(Setting::Pp, |o| &mut o.pp, 1, format!("one stage (implied by {})", ap.source));
                Ok(())
            }
        }
    }

    /// A manual layout excludes a baseline and fixes pp · V.
    fn check_layout(&mut self) -> Result<(), ConfigError> {
        let Some(layout) = &self.layout else { return Ok(()) };
        let layout_src = self.source(Setting::Layout);
        if let Some(b) = self.baseline {
            return Err(conflict(layout_src, Source::Flag(format!("--baseline {b}")), "a baseline chooses its own cuts"));
        }
        let v = self.schedule.map_or(1, |s| s.virtual_stages());
        let n = layout.stages();
        match self.pp {
            Some(pp) if pp * v != n => {
                let why = if v > 1 {
                    format!("the layout has {n} stages but pp·V = {pp}·{v} = {} virtual stages", pp * v)
                } else {
                    format!("the layout has {n} stages but the pipeline-parallel degree is {pp}")
                };
                Err(conflict(layout_src, self.source(Setting::Pp), why))
            }
            Some(_) => Ok(()),
            None if n % v != 0 => {
                let sched = if self.schedule.is_some() { self.source(Setting::Schedule) } else { Source::Implied(String::new()) };
                Err(conflict(layout_src, sched, format!("{n} stages are not a multiple of {v} virtual stages per rank")))
            }
            None => {
                self.imply(Setting::Pp, |o| &mut o.pp, n / v, format!("{} stages (from {layout_src})", n / v));
                Ok(())
            }
        }
    }

    /// The global batch divides over replicas and microbatches.
    fn check_batch(&self) -> Result<(), ConfigError> {
        if let Some(gb) = self.global_batch {
            if let Some(dp) = self.dp
                && gb % dp as u64 != 0
            {
                return Err(conflict(
                    self.source(Setting::GlobalBatch),
                    self.source(Setting::Dp),
                    format!("the global batch {gb} is not divisible by {dp} data-parallel replicas"),
                ));
            }
            if let Some(m) = self.microbatches {
                let per_replica = gb / self.dp.map_or(1, |d| d as u64);
                if per_replica % m as u64 != 0 {
                    let why = match self.dp {
                        Some(d) => format!("each of {d} replicas gets {per_replica} samples, not divisible into {m} microbatches"),
                        None => format!("{gb} samples are not divisible into {m} microbatches"),
                    };
                    return Err(conflict(self.source(Setting::Microbatches), self.source(Setting::GlobalBatch), why));
                }
            }
        }
        if let (Some(a), Some(m)) = (self.active_microbatches, self.microbatches)
            && a > m
        {
            return Err(conflict(
                self.source(Setting::ActiveMicrobatches),
                self.source(Setting::Microbatches),
                "more microbatches in flight than there are",
            ));
        }
        Ok(())
    }

    /// The one configuration `--estimate` prices: every setting the search would choose is
    /// fixed, as given or at its default (pp, tp, cp, ep 1; dp the devices left; ZeRO 0; one
    /// microbatch without a pipeline; 1F1B; no recompute; no offloading; no sequence
    /// parallelism; the `cluster` placement). Only the pipeline cuts are left to the planner
    /// when `--layout` is not given. Errors name the setting and the fix.
    pub fn pinned_for_estimate(mut self, devices: usize, cluster: &str) -> Result<PlanOptions, ConfigError> {
        let estimate = || Source::Flag("--estimate".to_string());
        let refuse = |setting: Source, why: String| Err(conflict(setting, estimate(), why));
        if let Some(b) = self.baseline {
            return refuse(Source::Flag(format!("--baseline {b}")), "an estimate prices the configuration you give; drop --baseline".into());
        }
        if matches!(self.checkpointing, Some(CheckpointRule::Auto | CheckpointRule::AutoSelective)) {
            return refuse(
                self.source(Setting::Checkpointing),
                "`auto` and `auto-selective` leave recompute to the search; say --checkpointing none|selective|full or --recompute-layers LIST".into(),
            );
        }
        if self.offload == Some(OffloadRule::Auto) {
            return refuse(self.source(Setting::Offload), "`auto` leaves offloading to the search; say --offload-activations on|off".into());
        }
        let (pp, tp, cp) = (self.pp.unwrap_or(1), self.tp.unwrap_or(1), self.cp.unwrap_or(1));
        let model_ranks = pp.saturating_mul(tp).saturating_mul(cp).max(1);
        let dp = match self.dp {
            Some(dp) => dp,
            None if devices % model_ranks == 0 => devices / model_ranks,
            None => {
                return Err(conflict(
                    Source::Implied(format!("pp·tp·cp = {pp}·{tp}·{cp} = {model_ranks}")),
                    Source::Flag(format!("--cluster {cluster} ({devices} devices)")),
                    format!("{model_ranks} does not divide the {devices} devices; give degrees whose product divides them"),
                ));
            }
        };
        (self.pp, self.tp, self.cp, self.dp) = (Some(pp), Some(tp), Some(cp), Some(dp));
        self.ep.get_or_insert(1);
        self.etp.get_or_insert(tp);
        if self.sharded_dp.is_none() {
            self.zero.get_or_insert(0);
        }
        if self.microbatches.is_none() {
            if pp > 1 {
                return refuse(
                    self.source(Setting::Pp),
                    format!("a pipeline of {pp} stages needs its microbatches per step: add --microbatches M (M ≥ {pp} keeps every stage busy)"),
                );
            }
            self.microbatches = Some(1);
        }
        self.schedule.get_or_insert(ScheduleKind::OneFOneB);
        if self.checkpointed_layers.is_none() && self.selective_layers.is_none() {
            self.checkpointing.get_or_insert(CheckpointRule::Never);
        }
        self.offload.get_or_insert(OffloadRule::Never);
        self.sequence_parallel.get_or_insert(false);
        self.placement.get_or_insert(Placement::CLUSTER);
        self.optimize.get_or_insert(Optimize::Speed);
        Ok(self)
    }

    /// `--microbatches` against the batch each replica runs, for `--estimate`'s message.
    pub fn check_microbatches(&self, batch: u64) -> Result<(), ConfigError> {
        let (Some(m), Some(dp)) = (self.microbatches, self.dp) else { return Ok(()) };
        let per_replica = batch / dp.max(1) as u64;
        if batch % dp.max(1) as u64 != 0 {
            return Err(conflict(
                self.source(Setting::Dp),
                Source::Implied(format!("global batch {batch}")),
                "the data-parallel degree must divide the global batch; change --global-batch or --dp",
            ));
        }
        if m == 0 || per_replica % m as u64 != 0 {
            return Err(conflict(
                self.source(Setting::Microbatches),
                Source::Implied(format!("{per_replica} samples per data-parallel replica (global batch {batch} / dp {dp})")),
                "the microbatch count must divide each replica's samples; give a divisor, or change --global-batch",
            ));
        }
        Ok(())
    }

    /// Checks the degrees against the cluster's device count, described by `cluster` (`--cluster
    /// h100-80gb:8`).
    pub fn check_devices(&self, devices: usize, cluster: &str) -> Result<(), ConfigError> {
        let cluster_src = || Source::Flag(format!("--cluster {cluster} ({devices} devices)"));
        if devices > limits::MAX_DEVICES {
            return Err(ConfigError::Invalid { setting: cluster_src(), why: format!("plans are made for at most {} devices", limits::MAX_DEVICES) });
        }
        let mut product = 1usize;
        let mut given: Vec<Source> = Vec::new();
        for (s, v) in [(Setting::Pp, self.pp), (Setting::Tp, self.tp), (Setting::Cp, self.cp), (Setting::Dp, self.dp)] {
            if let Some(v) = v {
                product = product.saturating_mul(v);
                given.push(self.source(s));
            }
        }
        let names = || given.iter().map(ToString::to_string).collect::<Vec<_>>().join(" · ");
        if product > devices || devices % product != 0 {
            let first = match given.as_slice() {
                [one] => one.clone(),
                _ => Source::Implied(names()),
            };
            let why = if product > devices {
                format!("the degrees need {product} devices")
            } else {
                format!("{product} does not divide the {devices} devices")
            };
            return Err(conflict(first, cluster_src(), why));
        }
        // pp, tp and dp given leave no room for a searched context degree: it counts 1.
        let complete = given.len() == 4 || (self.cp.is_none() && self.pp.is_some() && self.tp.is_some() && self.dp.is_some());
        if complete && product != devices {
            let what = if self.cp.is_some() { "pp·tp·cp·dp" } else { "pp·tp·dp" };
            return Err(conflict(
                Source::Implied(names()),
                cluster_src(),
                format!("{what} = {product} must equal the device count; omit one to have it derived"),
            ));
        }
        if let Some(sdp) = self.sharded_dp {
            let dp_max = devices / self.pp.unwrap_or(1) / self.tp.unwrap_or(1) / self.cp.unwrap_or(1);
            if sdp > dp_max {
                return Err(conflict(
                    self.source(Setting::ShardedDp),
                    cluster_src(),
                    format!("at most {dp_max} data-parallel replicas fit"),
                ));
            }
        }
        Ok(())
    }

    /// Checks the manual layout and the recomputed layers against the model's layer count.
    pub fn check_layers(&self, layers: usize, model: &str) -> Result<(), ConfigError> {
        let last = layers.saturating_sub(1);
        for (set, setting) in [(&self.checkpointed_layers, Setting::CheckpointedLayers), (&self.selective_layers, Setting::SelectiveLayers)] {
            if let Some(beyond) = set.as_ref().and_then(|s| s.iter().find(|&&l| l >= layers)) {
                return Err(conflict(self.source(setting), Source::Implied(format!("{model} ({layers} layers, 0..={last})")), format!("layer {beyond} does not exist")));
            }
        }
        if let Some(l) = &self.layout
            && l.last_layer() + 1 != layers
        {
            return Err(conflict(
                self.source(Setting::Layout),
                Source::Implied(format!("{model} ({layers} layers, 0..={last})")),
                format!("the layout covers layers 0..={}; it must end at layer {last}", l.last_layer()),
            ));
        }
        if let Some(pp) = self.pp
            && self.layout.is_none()
            && pp * self.schedule.map_or(1, |s| s.virtual_stages()) > layers
        {
            return Err(conflict(
                self.source(Setting::Pp),
                Source::Implied(format!("{model} ({layers} layers)")),
                "every stage needs at least one layer",
            ));
        }
        Ok(())
    }
}
