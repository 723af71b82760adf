//! What a plan was asked for (the plan file's optional `request` object): the planner's options
//! as the user gave them, after `--config` was merged, and the cluster as named. A plan can then
//! be made again for another device count with the same options (elastic training re-plans
//! with it on the devices left). The spellings are the CLI's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::solve::options::{Layout, parse_checkpointing, parse_schedule};
use crate::solve::PlanOptions;

/// The planning request a plan records (absent in plans written before it was recorded).
/// Every option left out was searched or took its default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    /// The cluster as named (`--cluster`: `PRESET[:N]` or `FILE.toml[:N]`).
    pub cluster: String,
    /// `--global-batch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<u64>,
    /// `--seq-len`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<u64>,
    /// `--dim NAME=V`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dims: BTreeMap<String, i64>,
    /// `--pp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp: Option<usize>,
    /// `--tp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<usize>,
    /// `--dp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp: Option<usize>,
    /// `--cp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cp: Option<usize>,
    /// `--ep`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ep: Option<usize>,
    /// `--etp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etp: Option<usize>,
    /// `--expert-imbalance`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_imbalance: Option<f64>,
    /// How routed tokens reach their experts (`all-to-all`, `per-node`), where an engine's
    /// configuration set it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_dispatch: Option<String>,
    /// `--overlap-expert-comm`: the expert all-to-alls priced overlapped as combined 1F1B runs
    /// them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub expert_overlap: bool,
    /// `--overlap-grad-sync`: each layer's gradient reduction priced beside the backward.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grad_overlap: bool,
    /// `--float8-linears`: the blocks' linear layers priced in fp8.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub float8_linears: bool,
    /// `--zero`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero: Option<u8>,
    /// `--sharded-dp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharded_dp: Option<usize>,
    /// `--microbatches`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatches: Option<usize>,
    /// SMP's `active_microbatches`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_microbatches: Option<usize>,
    /// `--schedule` (`gpipe`, `1f1b`, `interleaved:V`, `zb-h1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// `--checkpointing` (`auto`, `none`, `full`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpointing: Option<String>,
    /// `--selective-policy` (`pointwise`, `op`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selective_policy: Option<String>,
    /// `--optimize` (`speed`, `memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimize: Option<String>,
    /// `--placement` (an axis order such as `DPT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    /// `--layout` (`0-11|12-23`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// `--memory-limit` in GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit_gib: Option<f64>,
    /// `--time-limit` in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_limit_s: Option<f64>,
    /// `--baseline`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// `--sequence-parallel` (true) or `--no-sequence-parallel` (false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence_parallel: Option<bool>,
    /// `--precision`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<String>,
    /// `--offload-activations` (`auto`, `on`, `off`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offload_activations: Option<String>,
    /// `--activation-loading-horizon`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_loading_horizon: Option<usize>,
    /// The mixed precision's gradients accumulated and reduced in fp32 (a request read from
    /// Megatron-LM's or torchtitan's configuration: `MixedRecipe::LowModelFp32Grads`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fp32_main_grads: bool,
    /// `--trainable` patterns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trainable: Vec<String>,
    /// `--frozen` patterns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen: Vec<String>,
}

/// A request whose recorded option does not read back.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("request.{field} `{value}`: {why}")]
pub struct RequestError {
    /// The request's field.
    pub field: &'static str,
    /// Its value.
    pub value: String,
    /// Why it does not read.
    pub why: String,
}

fn read<T>(field: &'static str, value: &Option<String>, parse: impl Fn(&str) -> Result<T, String>) -> Result<Option<T>, RequestError> {
    value.as_deref().map(|v| parse(v).map_err(|why| RequestError { field, value: v.to_string(), why })).transpose()
}

impl PlanRequest {
    /// The request of `options` on the cluster named `cluster`.
    pub fn of(options: &PlanOptions, cluster: &str) -> PlanRequest {
        PlanRequest {
            cluster: options.cluster_flag.clone().unwrap_or_else(|| cluster.to_string()),
            global_batch: options.global_batch,
            seq_len: options.seq_len,
            dims: options.dims.iter().cloned().collect(),
            pp: options.pp,
            tp: options.tp,
            dp: options.dp,
            cp: options.cp,
            ep: options.ep,
            etp: options.etp,
            expert_imbalance: options.expert_imbalance,
            expert_dispatch: options.expert_dispatch.map(|d| d.name().to_string()),
            expert_overlap: options.expert_overlap == Some(true),
            grad_overlap: options.grad_overlap == Some(true),
            float8_linears: options.float8_linears == Some(true),
            zero: options.zero,
            sharded_dp: options.sharded_dp,
            microbatches: options.microbatches,
            active_microbatches: options.active_microbatches,
            schedule: options.schedule.map(|s| s.to_string()),
            checkpointing: options.checkpointing.map(|c| c.name().to_string()),
            selective_policy: options.selective_policy.map(|p| p.name().to_string()),
            optimize: options.optimize.map(|o| o.to_string()),
            placement: options.placement.map(|p| p.to_string()),
            layout: options.layout.as_ref().map(ToString::to_string),
            memory_limit_gib: options.memory_limit_gib,
            time_limit_s: options.time_limit_s,
            baseline: options.baseline.map(|b| b.to_string()),
            sequence_parallel: options.sequence_parallel,
            precision: options.precision.map(|p| p.name().to_string()),
            offload_activations: options.offload.map(|o| o.name().to_string()),
            activation_loading_horizon: options.loading_horizon,
            fp32_main_grads: options.mixed_recipe == Some(crate::ir::MixedRecipe::LowModelFp32Grads),
            trainable: options.params.trainable.clone(),
            frozen: options.params.frozen.clone(),
        }
    }

    /// The planner's options this request records (provenance aside: every setting reads as a
    /// flag).
    pub fn options(&self) -> Result<PlanOptions, RequestError> {
        let mut options = PlanOptions {
            global_batch: self.global_batch,
            seq_len: self.seq_len,
            dims: self.dims.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            pp: self.pp,
            tp: self.tp,
            dp: self.dp,
            cp: self.cp,
            ep: self.ep,
            etp: self.etp,
            expert_imbalance: self.expert_imbalance,
            expert_dispatch: read("expert_dispatch", &self.expert_dispatch, |s| s.parse())?,
            expert_overlap: self.expert_overlap.then_some(true),
            grad_overlap: self.grad_overlap.then_some(true),
            float8_linears: self.float8_linears.then_some(true),
            zero: self.zero,
            sharded_dp: self.sharded_dp,
            microbatches: self.microbatches,
            active_microbatches: self.active_microbatches,
            schedule: read("schedule", &self.schedule, parse_schedule)?,
            checkpointing: read("checkpointing", &self.checkpointing, parse_checkpointing)?,
            selective_policy: read("selective_policy", &self.selective_policy, |s| s.parse())?,
            optimize: read("optimize", &self.optimize, |s| s.parse())?,
            placement: read("placement", &self.placement, |s| s.parse())?,
            layout: read("layout", &self.layout, |s| s.parse::<Layout>())?,
            memory_limit_gib: self.memory_limit_gib,
            time_limit_s: self.time_limit_s,
            baseline: read("baseline", &self.baseline, |s| s.parse())?,
            sequence_parallel: self.sequence_parallel,
            precision: read("precision", &self.precision, |s| s.parse())?,
            offload: read("offload_activations", &self.offload_activations, |s| s.parse())?,
            loading_horizon: self.activation_loading_horizon,
            mixed_recipe: self.fp32_main_grads.then_some(crate::ir::MixedRecipe::LowModelFp32Grads),
            cluster_flag: Some(self.cluster.clone()),
            ..PlanOptions::default()
        };
        options.params.trainable = self.trainable.clone();
        options.params.frozen = self.frozen.clone();
        Ok(options)
    }

    /// The request's cluster with `devices` devices: its preset or file with the count replaced.
    pub fn cluster_with(&self, devices: usize) -> String {
        let base = match self.cluster.trim().rsplit_once(':') {
            Some((b, c)) if !c.contains('/') && !c.contains('.') => b,
            _ => self.cluster.trim(),
        };
        format!("{base}:{devices}")
    }
}
