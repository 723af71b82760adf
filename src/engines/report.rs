//! A team's configuration beside the automatic plan, under the same cost model: the table
//! `--from-engine` prints and the one-line summary of what differs.

use crate::plan::Plan;

use super::config::Reading;
use super::fields::{Engine, checkpointed, offloaded};

const GIB: f64 = (1u64 << 30) as f64;

/// One column of the comparison.
pub struct Column<'a> {
    /// Its heading.
    pub title: String,
    /// The plan.
    pub plan: &'a Plan,
    /// Its peak bytes per device when the devices' memory does not hold it.
    pub over_memory: Option<u64>,
}

fn schedule(p: &Plan) -> String {
    let par = &p.parallel;
    if par.pp == 1 { "no pipeline".to_string() } else { format!("pp {}, {}", par.pp, par.schedule) }
}

fn recompute(p: &Plan) -> String {
    let n = checkpointed(p).len();
    let selective = p.stages.iter().map(|s| s.selective_layers.len()).sum::<usize>();
    let whole = match n {
        0 if selective > 0 => String::new(),
        0 => "none".to_string(),
        n if n == p.model.layers => "every layer".to_string(),
        n => format!("{n} of {} layers", p.model.layers),
    };
    let policy = if p.parallel.selective_policy == crate::ir::SelectivePolicy::Ops { " (per op)" } else { "" };
    match (selective, whole.is_empty()) {
        (0, _) => whole,
        (s, true) => format!("selective{policy} in {s} layers"),
        (s, false) => format!("{whole}, selective{policy} in {s}"),
    }
}

/// Peak memory per device of each pipeline rank, GiB.
fn stage_memory(p: &Plan) -> Vec<f64> {
    (0..p.parallel.pp).map(|r| p.rank_memory(r).total as f64 / GIB).collect()
}

/// The pipeline rank with the most memory and its GiB.
fn peak_stage(p: &Plan) -> (usize, f64) {
    stage_memory(p).into_iter().enumerate().fold((0, 0.0), |best, (r, m)| if m > best.1 { (r, m) } else { best })
}

fn rows(p: &Plan) -> Vec<(&'static str, String)> {
    let par = &p.parallel;
    let dp = par.dp.max(1) as u64;
    let mbs = p.global_batch / (dp * par.microbatches.max(1) as u64);
    let (stage, peak) = peak_stage(p);
    let mem: Vec<String> = stage_memory(p).iter().map(|m| format!("{m:.1}")).collect();
    let mem = if mem.len() > 8 { format!("{} … {} GiB", mem[..4].join(" "), mem[mem.len() - 2..].join(" ")) } else { format!("{} GiB", mem.join(" ")) };
    vec![
        ("pipeline", schedule(p)),
        ("tensor", if par.tp > 1 { format!("tp {}{}", par.tp, if par.sequence_parallel { ", sequence parallel" } else { "" }) } else { "tp 1".into() }),
        ("context, experts", format!("cp {}, ep {}", par.cp, par.ep)),
        ("data", format!("dp {}, ZeRO {}{}", par.dp, par.zero, par.sharded_dp.map(|s| format!(" over groups of {s}")).unwrap_or_default())),
        ("batch", format!("{} = {} replicas × {} microbatches × {}", p.global_batch, par.dp, par.microbatches, mbs)),
        ("recompute", recompute(p)),
        ("offload", if offloaded(p).is_empty() { "none".into() } else { format!("{} layers", offloaded(p).len()) }),
        ("precision", par.precision.to_string()),
        ("step time", format!("{:.3} s", p.predicted.step_time_s)),
        ("MFU", format!("{:.1} %", p.predicted.mfu * 100.0)),
        ("peak memory", format!("{peak:.1} GiB (stage {stage})")),
        ("memory per stage", mem),
    ]
}

/// The side-by-side table of `columns` (the first is the team's configuration).
pub fn side_by_side(columns: &[Column<'_>]) -> String {
    let cols: Vec<Vec<(&str, String)>> = columns.iter().map(|c| rows(c.plan)).collect();
    let label = cols.first().map_or(0, |r| r.iter().map(|(l, _)| l.len()).max().unwrap_or(0));
    let widths: Vec<usize> = columns
        .iter()
        .zip(&cols)
        .map(|(c, r)| r.iter().map(|(_, v)| v.chars().count()).max().unwrap_or(0).max(c.title.chars().count()))
        .collect();
    let mut out = String::new();
    out.push_str(&format!("{:label$}", ""));
    for (c, w) in columns.iter().zip(&widths) {
        out.push_str(&format!("   {:w$}", c.title));
    }
    out.push('\n');
    for i in 0..cols.first().map_or(0, Vec::len) {
        out.push_str(&format!("{:label$}", cols[0][i].0));
        for (r, w) in cols.iter().zip(&widths) {
            out.push_str(&format!("   {:w$}", r[i].1));
        }
        out.push('\n');
    }
    if let [yours, ours, ..] = columns {
        let (a, b) = (yours.plan.predicted.step_time_s, ours.plan.predicted.step_time_s);
        out.push_str(&format!("step time: ours {:+.1} % against yours ({:.2}× the samples per second)\n", (b / a - 1.0) * 100.0, a / b));
    }
    for c in columns {
        if let Some(peak) = c.over_memory {
            out.push_str(&format!(
                "{}: does not fit the devices' memory: {:.1} GiB at its peak per device\n",
                c.title,
                peak as f64 / GIB
            ));
        }
    }
    out
}

/// One line per plan: "yours: pp 16, no CP, full recompute, 41 % MFU, stage 0 at 79.1 GiB".
pub fn summary(name: &str, p: &Plan) -> String {
    let par = &p.parallel;
    let (stage, peak) = peak_stage(p);
    let cp = if par.cp > 1 { format!("cp {}", par.cp) } else { "no CP".into() };
    let rec = match recompute(p).as_str() {
        "none" => "no recompute".to_string(),
        "every layer" => "full recompute".to_string(),
        r => format!("recompute {r}"),
    };
    format!("{name}: {}, tp {}, {cp}, dp {}, {rec}, {:.0} % MFU, stage {stage} at {peak:.1} GiB", schedule(p), par.tp, par.dp, p.predicted.mfu * 100.0)
}

/// What `--from-engine` read but cannot price, and what it read without effect, as lines.
pub fn reading_lines(engine: Engine, reading: &Reading) -> Vec<String> {
    let mut out: Vec<String> = reading.unpriced.iter().map(|u| format!("not priced: {} ({engine}): {}", u.setting, u.why)).collect();
    if !reading.no_effect.is_empty() {
        out.push(format!("read without effect on the plan: {}", reading.no_effect.join(", ")));
    }
    out
}
