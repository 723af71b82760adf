//! `smp-partition sweep MODEL --clusters a100-80gb:256,512 h100-80gb:256,512 -o sweep.svg`:
//! "what should I rent?" The model is analysed once and planned on every cluster through the
//! one entry point ([`smp_partition::compile`]); a table of predicted step time, throughput,
//! memory and cost is printed, and an SVG chart of throughput and cost against device count
//! (one series per device kind) is drawn.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;

use smp_partition::compile::{Model, Observer, analyze_options};
use smp_partition::cost::ClusterSpec;
use smp_partition::plan::{Plan, io};
use smp_partition::solve::PlanOptions;

use crate::plan_cmd::PlanFlags;

/// Options of `sweep`.
#[derive(Args, Debug)]
pub struct SweepArgs {
    /// The ONNX model to plan.
    #[arg(value_name = "MODEL.onnx")]
    pub model: PathBuf,
    /// Clusters to plan on: a preset or cluster file with device counts, `PRESET:N,N,...`
    /// (several, space-separated), e.g. `a100-80gb:256,512,1024 h100-80gb:256,512,1024`.
    #[arg(long, required = true, num_args = 1.., value_name = "PRESET:N,N,...")]
    pub clusters: Vec<String>,
    #[command(flatten)]
    pub flags: PlanFlags,
    /// Draw the chart (throughput and cost against devices) into this SVG file.
    #[arg(short = 'o', long = "output", value_name = "SWEEP.svg")]
    pub output: Option<PathBuf>,
    /// Also write each cluster's plan into this directory (`PRESET-N.plan.json`).
    #[arg(long, value_name = "DIR")]
    pub plans_dir: Option<PathBuf>,
    /// Print the table as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// One cluster of the sweep and what planning on it gave.
struct Row {
    /// The cluster as the user would write it for `--cluster` (`a100-80gb:256`).
    flag: String,
    /// The preset or file the cluster comes from (the chart's series).
    kind: String,
    spec: ClusterSpec,
    outcome: Result<Plan, String>,
}

/// Figures of a planned row.
struct Figures {
    tokens_per_s: Option<f64>,
    cost_per_step: Option<f64>,
    cost_per_million_tokens: Option<f64>,
}

impl Row {
    fn figures(&self, plan: &Plan) -> Figures {
        let tokens_per_step = plan.seq_len.map(|s| (s * plan.global_batch) as f64);
        let cost_per_step = self
            .spec
            .price_per_device_hour
            .map(|p| p * self.spec.devices as f64 * plan.predicted.step_time_s / 3600.0);
        Figures {
            tokens_per_s: plan.seq_len.map(|s| plan.predicted.samples_per_s * s as f64),
            cost_per_step,
            cost_per_million_tokens: match (cost_per_step, tokens_per_step) {
                (Some(c), Some(t)) if t > 0.0 => Some(c / t * 1e6),
                _ => None,
            },
        }
    }
}

/// Expands `PRESET:N,N,...` (or a bare `PRESET`, `FILE.toml:N,...`) into one spec string per
/// count.
fn expand(arg: &str) -> Result<Vec<(String, String)>> {
    let arg = arg.trim();
    let (base, counts) = match arg.rsplit_once(':') {
        Some((b, c)) if !c.contains('/') && !c.contains(".toml") => (b, Some(c)),
        _ => (arg, None),
    };
    let kind = std::path::Path::new(base)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| base.to_string());
    let Some(counts) = counts else {
        return Ok(vec![(arg.to_string(), kind)]);
    };
    let mut out = Vec::new();
    for c in counts.split(',').map(str::trim) {
        match c.parse::<usize>() {
            Ok(n) if n > 0 => out.push((format!("{base}:{n}"), kind.clone())),
            _ => bail!("--clusters {arg}: `{c}` is not a positive device count (write PRESET:N,N,..., e.g. a100-80gb:256,512)"),
        }
    }
    Ok(out)
}

/// Collects a compile's notes (printed once per sweep).
#[derive(Default)]
struct Notes(Vec<String>);

impl Observer for Notes {
    fn note(&mut self, note: &str) {
        self.0.push(note.to_string());
    }
}

/// Runs `sweep`.
pub fn run(args: &SweepArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let host = smp_partition::host::machine_facts()?;
    let mut wanted = Vec::new();
    for arg in &args.clusters {
        wanted.extend(expand(arg)?);
    }
    let mut rows = Vec::new();
    for (flag, kind) in wanted {
        let spec = ClusterSpec::parse_on(&flag, &host).with_context(|| format!("--clusters {flag}"))?;
        rows.push((flag, kind, spec));
    }
    // The options are checked once (the cluster only names messages), the model analysed once.
    let base = args.flags.options(&rows[0].0)?;
    let analysed = smp_partition::compile::load_and_analyze(&args.model, &analyze_options(&base))?;
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(rows.len()).max(1);
    let plan_one = |flag: &str, spec: &ClusterSpec| -> (Result<Plan, String>, Vec<String>) {
        let opts = PlanOptions { cluster_flag: Some(flag.to_string()), ..base.clone() };
        let mut notes = Notes::default();
        let plan = smp_partition::compile_observed(Model::Analysed(&analysed), spec, &opts, &mut notes);
        (plan.map_err(|e| error_chain(&e)), notes.0)
    };
    // Clusters are planned side by side, `threads` at a time, in the order given.
    let mut outcomes: Vec<Option<(Result<Plan, String>, Vec<String>)>> = (0..rows.len()).map(|_| None).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(&mut outcomes);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((flag, _, spec)) = rows.get(i) else { break };
                    let r = plan_one(flag, spec);
                    if let Ok(mut guard) = results.lock() {
                        guard[i] = Some(r);
                    }
                }
            });
        }
    });
    let mut seen_notes = std::collections::BTreeSet::new();
    let mut table = Vec::new();
    for ((flag, kind, spec), outcome) in rows.into_iter().zip(outcomes) {
        let (outcome, notes) = outcome.ok_or_else(|| anyhow!("planning on {flag} did not finish"))?;
        for n in notes {
            if seen_notes.insert(n.clone()) {
                eprintln!("note: {n}");
            }
        }
        table.push(Row { flag, kind, spec, outcome });
    }
    if let Some(dir) = &args.plans_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for row in &table {
            if let Ok(plan) = &row.outcome {
                let path = dir.join(format!("{}.plan.json", row.flag.replace(':', "-").replace('/', "_")));
                io::save(plan, &path).with_context(|| format!("writing {}", path.display()))?;
            }
        }
    }
    if let Some(path) = &args.output {
        let svg = chart(&table, &args.model.display().to_string())?;
        std::fs::write(path, svg).with_context(|| format!("writing the chart to {}", path.display()))?;
    }
    let wall_s = started.elapsed().as_secs_f64();
    if args.json {
        println!("{}", json(&table, &args.model.display().to_string(), wall_s));
    } else {
        print!("{}", render(&table));
        if let Some(path) = &args.output {
            println!("chart written to {}", path.display());
        }
        println!("{} clusters planned in {wall_s:.2} s", table.len());
    }
    Ok(if table.iter().any(|r| r.outcome.is_ok()) { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// An error with its causes, as the CLI prints them.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map(f).unwrap_or_else(|| "-".to_string())
}

/// The text table.
fn render(rows: &[Row]) -> String {
    let header = [
        "cluster", "devices", "pp", "tp", "dp", "zero", "mb", "step s", "tokens/s", "samples/s", "MFU", "peak mem GiB", "$/step",
        "$/1M tokens",
    ];
    let mut cells: Vec<Vec<String>> = Vec::new();
    let mut errors = Vec::new();
    for row in rows {
        match &row.outcome {
            Ok(plan) => {
                let f = row.figures(plan);
                let p = &plan.parallel;
                cells.push(vec![
                    row.flag.clone(),
                    row.spec.devices.to_string(),
                    p.pp.to_string(),
                    p.tp.to_string(),
                    p.dp.to_string(),
                    p.zero.to_string(),
                    p.microbatches.to_string(),
                    format!("{:.3}", plan.predicted.step_time_s),
                    opt(f.tokens_per_s, |t| format!("{t:.0}")),
                    format!("{:.2}", plan.predicted.samples_per_s),
                    format!("{:.1} %", plan.predicted.mfu * 100.0),
                    format!("{:.1}", plan.predicted.peak_memory_bytes as f64 / (1u64 << 30) as f64),
                    opt(f.cost_per_step, |c| format!("{c:.3}")),
                    opt(f.cost_per_million_tokens, |c| format!("{c:.3}")),
                ]);
            }
            Err(e) => {
                let mut r = vec![row.flag.clone(), row.spec.devices.to_string()];
                r.extend(std::iter::repeat_n("-".to_string(), header.len() - 2));
                cells.push(r);
                errors.push(format!("{}: no plan: {e}", row.flag));
            }
        }
    }
    let widths: Vec<usize> =
        (0..header.len()).map(|c| cells.iter().map(|r| r[c].len()).chain([header[c].len()]).max().unwrap_or(0)).collect();
    let line = |r: &[String]| -> String {
        let parts: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(c, v)| if c == 0 { format!("{v:<w$}", w = widths[c]) } else { format!("{v:>w$}", w = widths[c]) })
            .collect();
        format!("{}\n", parts.join("  ").trim_end())
    };
    let mut out = line(&header.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    for r in &cells {
        out.push_str(&line(r));
    }
    let mut prices: BTreeMap<&str, Option<f64>> = BTreeMap::new();
    for row in rows {
        prices.insert(&row.kind, row.spec.price_per_device_hour);
    }
    let priced: Vec<String> = prices
        .iter()
        .map(|(k, p)| format!("{k} {}", opt(*p, |p| format!("${p:.3}/device-hour"))))
        .collect();
    out.push_str(&format!("prices: {} (edit: price_per_device_hour in a cluster file)\n", priced.join(", ")));
    for e in errors {
        out.push_str(&e);
        out.push('\n');
    }
    out
}

/// The table as one JSON object.
fn json(rows: &[Row], model: &str, wall_s: f64) -> String {
    let json_rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| match &row.outcome {
            Ok(plan) => {
                let f = row.figures(plan);
                let p = &plan.parallel;
                // the schedule as the plan file writes it
                let schedule = p.schedule.name();
                serde_json::json!({
                    "cluster": row.flag, "kind": row.kind, "device": row.spec.device, "devices": row.spec.devices,
                    "pp": p.pp, "tp": p.tp, "dp": p.dp, "zero": p.zero, "microbatches": p.microbatches,
                    "schedule": schedule, "global_batch": plan.global_batch, "seq_len": plan.seq_len,
                    "step_time_s": plan.predicted.step_time_s, "samples_per_s": plan.predicted.samples_per_s,
                    "tokens_per_s": f.tokens_per_s, "mfu": plan.predicted.mfu,
                    "peak_memory_bytes": plan.predicted.peak_memory_bytes,
                    "price_per_device_hour": row.spec.price_per_device_hour,
                    "cost_per_step_usd": f.cost_per_step, "cost_per_million_tokens_usd": f.cost_per_million_tokens,
                    "status": plan.solver.status.to_string(), "error": null,
                })
            }
            Err(e) => serde_json::json!({
                "cluster": row.flag, "kind": row.kind, "device": row.spec.device, "devices": row.spec.devices,
                "price_per_device_hour": row.spec.price_per_device_hour, "error": e,
            }),
        })
        .collect();
    serde_json::json!({ "model": model, "rows": json_rows, "table": render(rows), "wall_s": wall_s }).to_string()
}

/// Series colours, one per device kind.
const COLOURS: [plotters::style::RGBColor; 6] = [
    plotters::style::RGBColor(31, 119, 180),
    plotters::style::RGBColor(214, 39, 40),
    plotters::style::RGBColor(44, 160, 44),
    plotters::style::RGBColor(148, 103, 189),
    plotters::style::RGBColor(255, 127, 14),
    plotters::style::RGBColor(140, 86, 75),
];

/// The SVG chart: throughput (left) and cost per 1M tokens, or per step where the model has
/// no sequence (right), against device count, one series per device kind. Text is SVG
/// `<text>`, rendered by the viewer: no font files are read.
fn chart(rows: &[Row], model: &str) -> Result<String> {
    use plotters::prelude::*;

    let mut series: BTreeMap<&str, Vec<(f64, f64, Option<f64>)>> = BTreeMap::new();
    let tokens = rows.iter().filter_map(|r| r.outcome.as_ref().ok()).all(|p| p.seq_len.is_some());
    for row in rows {
        if let Ok(plan) = &row.outcome {
            let f = row.figures(plan);
            let rate = if tokens { f.tokens_per_s.unwrap_or(0.0) } else { plan.predicted.samples_per_s };
            let cost = if tokens { f.cost_per_million_tokens } else { f.cost_per_step };
            series.entry(&row.kind).or_default().push((row.spec.devices as f64, rate, cost));
        }
    }
    for pts in series.values_mut() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let all: Vec<&(f64, f64, Option<f64>)> = series.values().flatten().collect();
    let (x_min, x_max) = bounds(all.iter().map(|p| p.0));
    let (_, rate_max) = bounds(all.iter().map(|p| p.1));
    let (_, cost_max) = bounds(all.iter().filter_map(|p| p.2));
    let (rate_label, cost_label) =
        if tokens { ("tokens/s", "USD per 1M tokens") } else { ("samples/s", "USD per step") };

    let mut svg = String::new();
    {
        let err = |e: &dyn std::fmt::Display| anyhow!("drawing the chart: {e}");
        let root = SVGBackend::with_string(&mut svg, (1200, 520)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let root = root.titled(&format!("{model}: predicted throughput and cost"), ("sans-serif", 22)).map_err(|e| err(&e))?;
        let panels = root.split_evenly((1, 2));
        let x_pad = ((x_max - x_min) * 0.05).max(1.0);
        for (panel, (label, pick)) in panels.iter().zip([
            (rate_label, (|p: &(f64, f64, Option<f64>)| Some(p.1)) as fn(&(f64, f64, Option<f64>)) -> Option<f64>),
            (cost_label, |p: &(f64, f64, Option<f64>)| p.2),
        ]) {
            let y_max = if label == rate_label { rate_max } else { cost_max };
            let mut chart = ChartBuilder::on(panel)
                .margin(16)
                .caption(format!("{label} against devices"), ("sans-serif", 18))
                .x_label_area_size(40)
                .y_label_area_size(80)
                .build_cartesian_2d((x_min - x_pad)..(x_max + x_pad), 0.0..(y_max * 1.1).max(1e-9))
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .x_desc("devices")
                .x_label_formatter(&|v| format!("{v:.0}"))
                .y_desc(label)
                .y_label_formatter(&|v| short(*v))
                .draw()
                .map_err(|e| err(&e))?;
            for (i, (kind, pts)) in series.iter().enumerate() {
                let colour = COLOURS[i % COLOURS.len()];
                let xy: Vec<(f64, f64)> = pts.iter().filter_map(|p| pick(p).map(|y| (p.0, y))).collect();
                chart
                    .draw_series(LineSeries::new(xy.clone(), colour.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(kind.to_string())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
                chart
                    .draw_series(xy.iter().map(|&(x, y)| Circle::new((x, y), 4, colour.filled())))
                    .map_err(|e| err(&e))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

/// Smallest and largest of `values` (0..1 when there are none).
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) }
}

/// 1234567 → "1.23M".
fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_lists_expand_per_count() {
        let got = expand("a100-80gb:256,512").unwrap();
        assert_eq!(got, vec![("a100-80gb:256".into(), "a100-80gb".into()), ("a100-80gb:512".into(), "a100-80gb".into())]);
        assert_eq!(expand("h200").unwrap(), vec![("h200".into(), "h200".into())]);
        assert_eq!(expand("dir/my.toml:8").unwrap(), vec![("dir/my.toml:8".into(), "my".into())]);
        let e = expand("h100-80gb:8,x").unwrap_err().to_string();
        assert!(e.contains("`x`"), "{e}");
        assert_eq!(short(1_234_567.0), "1.23M");
    }
}
