//! `smp-partition MODEL --estimate`: one configuration the user gives, priced without searching
//! others — memory per device by part against the device's capacity, and the step time.

use std::fmt::Write as _;

use serde::Serialize;

use super::report::{bytes, header, ms, table};
use super::schema::Plan;

/// One configuration priced: the plan the planner makes for it, and the capacity it is held
/// against (the plan itself was priced without a memory limit, so that a configuration that
/// does not fit is still priced).
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// The plan of the configuration.
    pub plan: Plan,
    /// Memory per device the configuration must fit in (the device's, or `--memory-limit`).
    pub capacity_bytes: u64,
    /// Whether the planner placed the pipeline cuts (no `--layout` given).
    pub cuts_chosen: bool,
}

/// The memory one device of a pipeline rank holds, by part (bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceMemory {
    /// Weights.
    pub params: u64,
    /// Gradients.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Kept activations of the microbatches in flight.
    pub activations: u64,
    /// The recompute working set: a checkpointed layer's activations rebuilt inside its backward.
    pub recompute: u64,
    /// The loss's copies at its backward on the rank computing it (log-probabilities and their
    /// gradients; a transient at another moment than the rebuild: `total` counts the larger).
    pub loss: u64,
    /// Activations held in host memory instead (not part of `total`).
    pub offloaded: u64,
    /// Temporaries: the workspace margin the cost model charges.
    pub temporaries: u64,
    /// Device bytes: params + grads + optimizer + activations + the larger of recompute and loss
    /// + temporaries.
    pub total: u64,
}

/// One pipeline rank's devices: their stages, layers and memory.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankEstimate {
    /// The pipeline rank.
    pub pp_rank: usize,
    /// Its stages (several when interleaved).
    pub stages: Vec<usize>,
    /// Its layers, `[first, last]` per stage.
    pub layers: Vec<[usize; 2]>,
    /// Memory per device.
    pub memory: DeviceMemory,
    /// Capacity minus total (negative: over by that much).
    pub headroom_bytes: i64,
}

/// What `--estimate --json` prints.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EstimateReport {
    /// The model file.
    pub model: String,
    /// The cluster preset and device count.
    pub cluster: String,
    /// The configuration as the plan file spells it.
    pub parallel: serde_json::Value,
    /// Samples per step.
    pub global_batch: u64,
    /// The bound sequence length.
    pub seq_len: Option<u64>,
    /// Memory per device the configuration must fit in.
    pub capacity_bytes: u64,
    /// Whether every device's total fits its capacity.
    pub fits: bool,
    /// How far the fullest device is over its capacity (0 when it fits).
    pub over_by_bytes: u64,
    /// Per pipeline rank.
    pub ranks: Vec<RankEstimate>,
    /// Predicted step time, seconds.
    pub step_time_s: f64,
    /// Samples per second.
    pub samples_per_s: f64,
    /// Model FLOPs utilisation.
    pub mfu: f64,
    /// Pipeline idle time over ideal compute time.
    pub bubble_ratio: f64,
    /// Whether the planner placed the pipeline cuts.
    pub cuts_chosen: bool,
    /// The table the command prints without `--json`.
    pub table: String,
}

impl Estimate {
    /// Per pipeline rank: stages, layers and memory by part.
    pub fn ranks(&self) -> Vec<RankEstimate> {
        (0..self.plan.parallel.pp)
            .map(|r| {
                let stages: Vec<_> = self.plan.stages_of_rank(r).collect();
                let m = self.plan.rank_memory(r);
                let offloaded = stages.iter().fold(0u64, |a, s| a.saturating_add(s.offloaded_bytes));
                let memory = DeviceMemory {
                    params: m.params,
                    grads: m.grads,
                    optimizer: m.optimizer,
                    activations: m.activations,
                    recompute: m.recompute,
                    loss: m.loss,
                    offloaded,
                    temporaries: m.workspace,
                    total: m.total,
                };
                let headroom_bytes = i64::try_from(self.capacity_bytes).unwrap_or(i64::MAX).saturating_sub(i64::try_from(m.total).unwrap_or(i64::MAX));
                RankEstimate { pp_rank: r, stages: stages.iter().map(|s| s.index).collect(), layers: stages.iter().map(|s| s.layers).collect(), memory, headroom_bytes }
            })
            .collect()
    }

    /// The bytes the fullest device is over its capacity (0 when every device fits).
    pub fn over_by_bytes(&self) -> u64 {
        self.ranks().iter().map(|r| r.memory.total.saturating_sub(self.capacity_bytes)).max().unwrap_or(0)
    }

    /// Whether every device holds its memory.
    pub fn fits(&self) -> bool {
        self.over_by_bytes() == 0
    }

    /// The estimate as `--json` prints it.
    pub fn report(&self) -> EstimateReport {
        let p = &self.plan;
        let parallel = serde_json::to_value(p).ok().and_then(|v| v.get("parallel").cloned()).unwrap_or(serde_json::Value::Null);
        EstimateReport {
            model: p.model.path.clone(),
            cluster: format!("{}:{}", p.cluster.preset, p.cluster.devices),
            parallel,
            global_batch: p.global_batch,
            seq_len: p.seq_len,
            capacity_bytes: self.capacity_bytes,
            fits: self.fits(),
            over_by_bytes: self.over_by_bytes(),
            ranks: self.ranks(),
            step_time_s: p.predicted.step_time_s,
            samples_per_s: p.predicted.samples_per_s,
            mfu: p.predicted.mfu,
            bubble_ratio: p.predicted.bubble_ratio,
            cuts_chosen: self.cuts_chosen,
            table: self.render(),
        }
    }

    /// The table `--estimate` prints.
    pub fn render(&self) -> String {
        let mut out = String::new();
        header(&self.plan, &mut out);
        let mut rows = vec![
            ["pp", "stages", "layers", "params", "grads", "optim", "activ", "recompute", "loss", "offloaded", "temps", "total", "of capacity"]
                .map(String::from)
                .to_vec(),
        ];
        let ranks = self.ranks();
        for r in &ranks {
            let m = &r.memory;
            rows.push(vec![
                r.pp_rank.to_string(),
                r.stages.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                r.layers.iter().map(|l| format!("{}-{}", l[0], l[1])).collect::<Vec<_>>().join(","),
                bytes(m.params as f64),
                bytes(m.grads as f64),
                bytes(m.optimizer as f64),
                bytes(m.activations as f64),
                bytes(m.recompute as f64),
                bytes(m.loss as f64),
                bytes(m.offloaded as f64),
                bytes(m.temporaries as f64),
                bytes(m.total as f64),
                if self.capacity_bytes > 0 { format!("{:.0}%", m.total as f64 / self.capacity_bytes as f64 * 100.0) } else { "-".into() },
            ]);
        }
        out.push_str(&table(&rows));
        out.push('\n');
        let fullest = ranks.iter().max_by_key(|r| r.memory.total);
        let cap = bytes(self.capacity_bytes as f64);
        match fullest {
            Some(r) if self.fits() => {
                let _ = writeln!(out, "memory      fits: the fullest device (pp rank {}) holds {} of {cap}, {} free", r.pp_rank, bytes(r.memory.total as f64), bytes(r.headroom_bytes as f64));
            }
            Some(r) => {
                let _ = writeln!(
                    out,
                    "memory      does not fit by {:.2} GiB: pp rank {} needs {} of {cap}",
                    self.over_by_bytes() as f64 / (1u64 << 30) as f64,
                    r.pp_rank,
                    bytes(r.memory.total as f64)
                );
            }
            None => {}
        }
        let p = &self.plan.predicted;
        let tokens = self.plan.seq_len.map_or(String::new(), |s| format!(", {:.0} tokens/s", p.samples_per_s * s as f64));
        let _ = writeln!(
            out,
            "predicted   step {}, {:.2} samples/s{tokens}, MFU {:.1}%, bubble {:.3}",
            ms(p.step_time_s),
            p.samples_per_s,
            p.mfu * 100.0,
            p.bubble_ratio
        );
        if self.cuts_chosen && self.plan.parallel.pp > 1 {
            let _ = writeln!(out, "note        the pipeline cuts above are the planner's for this configuration; --layout pins others");
        }
        out
    }
}
