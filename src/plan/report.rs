//! What `smp-partition inspect` says about a plan: the stage table, the bottleneck and why,
//! communication, the prediction and the solver's proof.

use std::fmt::Write as _;

use serde::Serialize;

use super::schema::Plan;
use crate::solve::{CheckpointRule, Optimize};

/// Why the bottleneck stage is the slowest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// Its forward and backward compute dominate.
    Compute,
    /// Its communication not hidden behind compute dominates.
    Communication,
    /// It is at its memory limit, which forced recomputation or a costlier split.
    Memory,
}

/// The slowest pipeline rank and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Bottleneck {
    /// The pipeline rank.
    pub pp_rank: usize,
    /// Its stages (several when interleaved).
    pub stages: Vec<usize>,
    /// Time per microbatch: forward + backward + exposed communication (seconds).
    pub time_s: f64,
    /// Compute part (seconds).
    pub compute_s: f64,
    /// Exposed communication part (seconds).
    pub comm_s: f64,
    /// Memory over the limit (0..1).
    pub memory_fraction: f64,
    /// The verdict.
    pub reason: Reason,
    /// One sentence explaining it.
    pub explanation: String,
}

/// Fraction of the memory limit above which memory is called the cause.
const MEMORY_PRESSURE: f64 = 0.9;

/// Finds the slowest pipeline rank and classifies the cause.
pub fn bottleneck(plan: &Plan) -> Option<Bottleneck> {
    let limit = plan.cluster.memory_limit_bytes as f64;
    (0..plan.parallel.pp)
        .map(|r| {
            let stages: Vec<_> = plan.stages_of_rank(r).collect();
            let compute_s: f64 = stages.iter().map(|s| s.forward_s + s.backward_s).sum();
            let comm_s: f64 = stages.iter().map(|s| s.comm_s).sum();
            let recomputed: usize = stages.iter().map(|s| s.checkpointed_layers.len()).sum();
            let memory = plan.rank_memory(r).total as f64;
            let memory_fraction = if limit > 0.0 { memory / limit } else { 0.0 };
            let (reason, explanation) = if comm_s > compute_s {
                (
                    Reason::Communication,
                    format!("exposed communication ({}) exceeds compute ({}) per microbatch", ms(comm_s), ms(compute_s)),
                )
            } else if memory_fraction >= MEMORY_PRESSURE && recomputed > 0 {
                (
                    Reason::Memory,
                    format!(
                        "at {:.0}% of the memory limit it recomputes {recomputed} layer(s), adding their forward to the backward",
                        memory_fraction * 100.0
                    ),
                )
            } else {
                (
                    Reason::Compute,
                    format!("forward + backward compute ({}) dominates communication ({}) per microbatch", ms(compute_s), ms(comm_s)),
                )
            };
            Bottleneck {
                pp_rank: r,
                stages: stages.iter().map(|s| s.index).collect(),
                time_s: compute_s + comm_s,
                compute_s,
                comm_s,
                memory_fraction,
                reason,
                explanation,
            }
        })
        // First of equals wins, so ties report the earliest rank.
        .fold(None, |best: Option<Bottleneck>, b| match best {
            Some(x) if x.time_s >= b.time_s => Some(x),
            _ => Some(b),
        })
}

/// The plan as JSON with the inspect findings added under `"inspect"`.
pub fn to_json_with_report(plan: &Plan) -> serde_json::Value {
    let mut v = serde_json::to_value(plan).unwrap_or(serde_json::Value::Null);
    if let Some(obj) = v.as_object_mut() {
        obj.insert("inspect".into(), serde_json::json!({ "bottleneck": bottleneck(plan) }));
    }
    v
}

/// Seconds as `1.234 s` or `12.345 ms`.
pub(super) fn ms(s: f64) -> String {
    if s >= 1.0 { format!("{s:.3} s") } else { format!("{:.3} ms", s * 1e3) }
}

/// Bytes in binary units.
pub fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{v:.0} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

fn count(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}K", n / 1e3)
    } else {
        format!("{n}")
    }
}

fn ranks(r: &[usize]) -> String {
    // Runs of consecutive ranks as a-b.
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < r.len() {
        let mut j = i;
        while j + 1 < r.len() && r[j + 1] == r[j] + 1 {
            j += 1;
        }
        out.push(if j > i + 1 {
            format!("{}-{}", r[i], r[j])
        } else if j == i + 1 {
            format!("{},{}", r[i], r[j])
        } else {
            r[i].to_string()
        });
        i = j + 1;
    }
    // Thousands of ranks: the first runs and the count.
    if out.len() > 3 { format!("{},{},… ({} ranks)", out[0], out[1], r.len()) } else { out.join(",") }
}

/// Renders a table as aligned columns (first column left, the rest right).
pub(super) fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            let pad = widths[c] - cell.chars().count();
            if c == 0 {
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            } else {
                line.push_str("  ");
                line.push_str(&" ".repeat(pad));
                line.push_str(cell);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The machine facts a `cpu` plan assumed, in one line.
pub fn machine_line(m: &crate::cost::MachineFacts) -> String {
    use crate::cost::FactSource;
    let source = match &m.source {
        FactSource::Host => "read from the planning host".to_string(),
        FactSource::ClusterFile(f) => format!("stated in {f}"),
    };
    let calibration = match &m.calibration {
        Some(c) => format!("calibration {} (sha256 {})", c.path, &c.sha256[..c.sha256.len().min(12)]),
        None => "uncalibrated (preset defaults)".to_string(),
    };
    format!("{} memory, {} cores, {calibration}; {source}", bytes(m.memory_bytes as f64), m.cores)
}

/// The degrees searched, as `1: 2.345 s, 2: none fits`.
fn searched(alts: &[(usize, Option<f64>)]) -> String {
    alts.iter().map(|(d, lb)| format!("{d}: {}", lb.map_or("none fits".to_string(), |b| format!("≥ {}", ms(b))))).collect::<Vec<_>>().join(", ")
}

/// Why the context and expert degrees are what they are, one line each.
pub fn axes_lines(plan: &Plan, a: &super::schema::AxesInfo) -> Vec<String> {
    let par = &plan.parallel;
    let mut out = Vec::new();
    if a.cp_searched.len() > 1 || par.cp > 1 || a.sample_input_bytes > 0 {
        let c = par.cp.max(1);
        let why = if c > 1 {
            let hidden = a.kv_transfer_s - a.kv_exposed_s;
            format!(
                "activations {} per rank, {} at c = 1; K/V all-gathers and gradient reduce-scatters {} per step, {} exposed{}",
                bytes(a.activation_bytes as f64),
                bytes(a.activation_bytes as f64 * c as f64),
                ms(a.kv_transfer_s),
                ms(a.kv_exposed_s),
                if hidden > 0.0 { format!(" ({} hidden)", ms(hidden)) } else { String::new() }
            )
        } else if a.cp_searched.len() > 1 {
            format!("activations {} per rank fit without splitting the sequence, and no split repays its exposed K/V exchange", bytes(a.activation_bytes as f64))
        } else {
            format!(
                "one sample's checkpointed activations ({}) take under half a device, so memory needs no split of the sequence (c > 1 not searched)",
                bytes(a.sample_input_bytes as f64)
            )
        };
        out.push(format!("context c = {c}: {why}; step-time bound per degree searched: {}", searched(&a.cp_searched)));
    }
    if a.ep_searched.len() > 1 || par.ep > 1 {
        let e = par.ep.max(1);
        let why = if e > 1 {
            format!(
                "model state {} per rank, {} at e = 1; all-to-alls {} per step{}, load imbalance {} per step",
                bytes(a.state_bytes as f64),
                bytes(a.state_bytes_without_ep as f64),
                ms(a.all_to_all_s),
                if a.all_to_all_hidden_s > 0.0 { format!(" ({} of it beside another microbatch's compute)", ms(a.all_to_all_hidden_s)) } else { String::new() },
                ms(a.imbalance_s)
            )
        } else {
            format!("model state {} per rank fits with every expert on every rank, so no all-to-all is worth paying", bytes(a.state_bytes as f64))
        };
        out.push(format!("experts e = {e}: {why}; step-time bound per degree searched: {}", searched(&a.ep_searched)));
    }
    out
}

/// The readable report printed by `inspect` (and after planning).
pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    header(plan, &mut out);
    stage_table(plan, &mut out);
    for line in choice_lines(plan) {
        let _ = writeln!(out, "{line}");
    }
    summary(plan, &mut out);
    out
}

/// What each layer's attention and experts are and how the plan runs them, runs of layers
/// alike in one line: `choices layers 4-61 (layers.3 … layers.60): attention: latent (MLA),
/// 128 heads, split by heads 8 ways; experts: 256 routed top 8 + 1 shared, ep 2`.
pub fn choice_lines(plan: &Plan) -> Vec<String> {
    let mut runs: Vec<(usize, usize, &str, &str, String)> = Vec::new();
    for l in &plan.layer_strategies {
        if l.parts.is_empty() {
            continue;
        }
        let text = l.parts.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
        match runs.last_mut() {
            Some(r) if r.4 == text && r.1 + 1 == l.layer => {
                r.1 = l.layer;
                r.3 = &l.name;
            }
            _ => runs.push((l.layer, l.layer, &l.name, &l.name, text)),
        }
    }
    runs.into_iter()
        .map(|(a, b, first, last, text)| {
            if a == b {
                format!("choices layer {a} ({first}): {text}")
            } else {
                format!("choices layers {a}-{b} ({first} … {last}): {text}")
            }
        })
        .collect()
}

/// The memory of each stage by the parts a run's `--json` report measures (`inspect`):
/// parameters, gradients, optimizer state, kept activations, the recompute working set, the
/// loss's working copies, bytes offloaded to host memory (not in the total), the workspace
/// margin the plan reserves for temporaries, and the total.
pub fn memory_parts(plan: &Plan) -> String {
    let mut rows = vec![["stage", "pp", "params", "grads", "optimizer", "activations", "recompute", "loss", "offloaded", "temporaries", "total"].map(String::from).to_vec()];
    for s in &plan.stages {
        let m = s.memory_bytes;
        let cells = [m.params, m.grads, m.optimizer, m.activations, m.recompute, m.loss, s.offloaded_bytes, m.workspace, m.total].map(|b| bytes(b as f64));
        rows.push([s.index.to_string(), s.pp_rank.to_string()].into_iter().chain(cells).collect());
    }
    let gathered = if plan.parallel.params_sharded() { "params: the rank's ZeRO-3 block and its largest layer gathered whole twice, the one computing and the next prefetched; " } else { "" };
    format!("memory per device by part ({gathered}recompute: a checkpointed layer's activations rebuilt inside its backward, a transient; loss: the loss's log-probabilities and their gradients at its backward, a transient at another moment (the total counts the larger); temporaries: the workspace margin reserved; offloaded: host memory, not in the total)\n{}\n", table(&rows))
}

/// The model, cluster, parallel configuration and batch lines.
pub(super) fn header(plan: &Plan, out: &mut String) {
    let par = &plan.parallel;
    let _ = writeln!(
        out,
        "model   {} — {} params, {} layers",
        plan.model.path,
        count(plan.model.params),
        plan.model.layers
    );
    let _ = writeln!(
        out,
        "cluster {} — {} devices, {} per node, memory limit {}",
        plan.cluster.preset,
        plan.cluster.devices,
        plan.cluster.devices_per_node,
        bytes(plan.cluster.memory_limit_bytes as f64)
    );
    if let Some(m) = &plan.cluster.machine {
        let _ = writeln!(out, "machine {}", machine_line(m));
    }
    let mut parallel = if par.experts_folded() {
        format!("pp {} · tp {} · cp {} · dp {} (ep {} · etp {} over tp × dp), ZeRO {}", par.pp, par.tp, par.cp, par.dp, par.ep, par.etp, par.zero)
    } else if plan.axes.is_some() || par.cp > 1 || par.ep > 1 {
        format!("pp {} · tp {} · cp {} · dp {} (ep {}), ZeRO {}", par.pp, par.tp, par.cp, par.dp, par.ep, par.zero)
    } else {
        format!("pp {} · tp {} · dp {}, ZeRO {}", par.pp, par.tp, par.dp, par.zero)
    };
    if let Some(s) = par.sharded_dp {
        let _ = write!(parallel, " (sharded over groups of {s})");
    }
    let sched = par.schedule;
    let _ = write!(parallel, ", {} microbatches, {sched}", par.microbatches);
    if let Some(a) = par.active_microbatches {
        let _ = write!(parallel, " (≤ {a} in flight)");
    }
    if par.expert_overlap {
        let _ = write!(parallel, " (expert all-to-alls overlapped: combined 1F1B)");
    }
    if par.grad_overlap {
        let _ = write!(parallel, " (gradients reduced beside the backward)");
    }
    let grads = match (par.fp32_main_grads, par.float8_linears) {
        (false, false) => "",
        (true, false) => " (fp32 main grads)",
        (false, true) => " (Float8 linears)",
        (true, true) => " (fp32 main grads, Float8 linears)",
    };
    let _ = writeln!(
        out,
        "parallel {parallel}, checkpointing {}, placement {}, precision {}{grads}",
        recompute_said(plan), par.placement, par.precision
    );
    let seq = plan.seq_len.map_or(String::new(), |s| format!(", sequence {s}"));
    let _ = writeln!(out, "batch   {} per step{seq}", plan.global_batch);
    if let Some(line) = fused_line(plan) {
        let _ = writeln!(out, "fused   {line}");
    }
    if let Some(a) = &plan.axes {
        for line in axes_lines(plan, a) {
            let _ = writeln!(out, "{line}");
        }
    }
    if let Some(b) = &plan.batch_statistics {
        let over = if b.samples >= plan.global_batch { "the whole batch".to_string() } else { format!("each microbatch of {} samples, not the whole batch", b.samples) };
        let _ = writeln!(out, "batchnorm {} BatchNormalization node(s) normalise by the statistics of {over}", b.nodes.len());
    }
    out.push('\n');

}

/// The recompute as the header says it: the rule asked for, or, where the layers were fixed one
/// by one and the rule does not say what they do (an engine's configuration), what the stages
/// recompute.
fn recompute_said(plan: &Plan) -> String {
    let par = &plan.parallel;
    let layers: usize = plan.stages.iter().map(|s| s.layers[1] + 1 - s.layers[0]).sum();
    let whole: usize = plan.stages.iter().map(|s| s.checkpointed_layers.len()).sum();
    let selective: usize = plan.stages.iter().map(|s| s.selective_layers.len()).sum();
    let policy = if par.selective_policy == crate::ir::SelectivePolicy::Ops { " (per op)" } else { "" };
    let said = match par.checkpointing {
        CheckpointRule::Always if whole < layers => None,
        CheckpointRule::Never if whole + selective > 0 => None,
        CheckpointRule::Selective if whole > 0 || selective == 0 => None,
        rule => Some(format!("{rule}{}", if rule == CheckpointRule::Selective { policy } else { "" })),
    };
    said.unwrap_or_else(|| match (whole, selective) {
        (0, 0) => "none".into(),
        (w, 0) => format!("{w} of {layers} layers"),
        (0, s) => format!("selective{policy} in {s} of {layers} layers"),
        (w, s) => format!("{w} of {layers} layers, selective{policy} in {s}"),
    })
}

/// The op chains the plan's graph runs as one fused op each, counted by op
/// (`4 ScaledDotProductAttention, 9 RMSNormalization, 4 SwiGlu`), mixtures of experts by their
/// whole form (`2 MixtureOfExperts(experts = 4, activation = clamped_swish(..), biases)`: what
/// the kernel computes is what a user checks); None when there are none.
fn fused_line(plan: &Plan) -> Option<String> {
    let fused = &plan.codegen.as_ref()?.fused;
    let mut counts: Vec<(String, usize)> = Vec::new();
    for f in fused {
        let k = match f.op {
            crate::ir::FusedOp::MixtureOfExperts { .. } => f.op.to_string(),
            _ => f.op.op_kind().to_string(),
        };
        match counts.iter_mut().find(|(c, _)| *c == k) {
            Some((_, n)) => *n += 1,
            None => counts.push((k, 1)),
        }
    }
    (!counts.is_empty()).then(|| counts.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", ") + " (op chains run as one kernel each)")
}

/// One row per stage (times and memory), then the stages that offload.
fn stage_table(plan: &Plan, out: &mut String) {
    let par = &plan.parallel;
    let limit = plan.cluster.memory_limit_bytes as f64;
    let mut rows = vec![
        [
            "stage",
            "pp",
            "layers",
            "ranks",
            "t",
            "d",
            "fwd",
            "bwd",
            "comm",
            "recompute",
            "params",
            "grads",
            "optim",
            "activ",
            "total",
            "of limit",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for s in &plan.stages {
        let m = s.memory_bytes;
        rows.push(vec![
            s.index.to_string(),
            s.pp_rank.to_string(),
            format!("{}-{}", s.layers[0], s.layers[1]),
            ranks(&s.ranks),
            s.tp.to_string(),
            s.dp.to_string(),
            ms(s.forward_s),
            ms(s.backward_s),
            ms(s.comm_s),
            s.checkpointed_layers.len().to_string(),
            bytes(m.params as f64),
            bytes(m.grads as f64),
            bytes(m.optimizer as f64),
            bytes(m.activations as f64),
            bytes(m.total as f64),
            if limit > 0.0 { format!("{:.0}%", m.total as f64 / limit * 100.0) } else { "-".into() },
        ]);
    }
    out.push_str(&table(&rows));
    out.push('\n');
    for st in plan.stages.iter().filter(|st| !st.offloaded_layers.is_empty()) {
        let _ = writeln!(
            out,
            "offload stage {}: {} checkpointed layer(s) keep their inputs in host memory ({} per device at the peak, {} microbatches back ahead of their backward)",
            st.index,
            st.offloaded_layers.len(),
            bytes(st.offloaded_bytes as f64),
            par.loading_horizon
        );
    }
    let rebuilt = match par.selective_policy {
        crate::ir::SelectivePolicy::Pointwise => "rebuild their norms' and activation functions' outputs in the backward instead of keeping them",
        crate::ir::SelectivePolicy::Ops => "keep attention's and every other weight product's outputs and rebuild the rest in the backward (torchtitan's per-op policy)",
    };
    for st in plan.stages.iter().filter(|st| !st.selective_layers.is_empty()) {
        let _ = writeln!(out, "selective stage {}: {} layer(s) {rebuilt}", st.index, st.selective_layers.len());
    }

}

/// The bottleneck, bubble, communication, prediction and solver lines.
fn summary(plan: &Plan, out: &mut String) {
    if let Some(b) = bottleneck(plan) {
        let which = if b.stages.len() == 1 {
            format!("stage {}", b.stages[0])
        } else {
            format!("pipeline rank {} (stages {:?})", b.pp_rank, b.stages)
        };
        let reason = match b.reason {
            Reason::Compute => "compute",
            Reason::Communication => "communication",
            Reason::Memory => "memory",
        };
        let _ = writeln!(
            out,
            "bottleneck  {which}, {} per microbatch — {reason}: {}",
            ms(b.time_s),
            b.explanation
        );
    }
    let _ = writeln!(
        out,
        "bubble      {:.3} (pipeline idle time over ideal compute time)",
        plan.predicted.bubble_ratio
    );
    if !plan.communication.is_empty() {
        let _ = writeln!(out, "communication per device and step:");
        let mut rows = vec![["  kind", "link", "volume", "time"].map(String::from).to_vec()];
        for c in &plan.communication {
            rows.push(vec![format!("  {}", c.kind), c.link.name().to_string(), bytes(c.bytes), ms(c.time_s)]);
        }
        out.push_str(&table(&rows));
    }
    let p = &plan.predicted;
    let _ = writeln!(
        out,
        "predicted   step {}, {:.2} samples/s, peak memory {}, MFU {:.1}%, HFU {:.1}%",
        ms(p.step_time_s),
        p.samples_per_s,
        bytes(p.peak_memory_bytes as f64),
        p.mfu * 100.0,
        p.hfu * 100.0
    );
    let sv = &plan.solver;
    // under `--optimize memory` the objective and its bound are a peak in bytes, not a step
    let memory = plan.request.as_ref().and_then(|r| r.optimize.as_deref()).and_then(|o| o.parse::<Optimize>().ok()) == Some(Optimize::Memory);
    let objective = |v: f64| if memory { bytes(v) } else { ms(v) };
    let _ = writeln!(
        out,
        "solver      {}: objective {}, bound {}, gap {:.2}%; {} candidates solved, {} skipped by bound; {:.2} s",
        sv.status,
        objective(sv.objective),
        objective(sv.bound),
        sv.gap * 100.0,
        sv.candidates.solved,
        sv.candidates.skipped,
        sv.wall_s
    );
}
