//! `smp-partition graph MODEL.onnx`: layers with parameters, FLOPs and activations.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use serde_json::json;
use smp_partition::Analysed;
use smp_partition::ir::{self, LayerKind};
use smp_partition::compile::AnalyzeOptions;
use smp_partition::solve::options::parse_dim;

/// Options of `graph`.
#[derive(clap::Args, Debug)]
pub struct GraphArgs {
    /// The ONNX model.
    pub model: PathBuf,
    #[command(flatten)]
    pub dims: DimArgs,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Batch and dim bindings of `graph`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DimArgs {
    /// Samples per training step (figures are then given per global batch).
    #[arg(long, value_name = "B")]
    pub global_batch: Option<u64>,
    /// Binds the symbolic sequence dim of the token input.
    #[arg(long, value_name = "S")]
    pub seq_len: Option<i64>,
    /// Binds a symbolic dim by name (repeatable).
    #[arg(long = "dim", value_name = "NAME=V", value_parser = parse_dim)]
    pub dims: Vec<(String, i64)>,
}

impl DimArgs {
    /// The pass options these flags ask for.
    pub fn analyze_options(&self) -> AnalyzeOptions {
        AnalyzeOptions { seq_len: self.seq_len, dims: self.dims.iter().cloned().collect::<BTreeMap<_, _>>() }
    }
}

/// Runs `graph`.
pub fn run(args: &GraphArgs) -> Result<()> {
    if args.dims.global_batch == Some(0) {
        bail!("--global-batch must be at least 1");
    }
    let a = smp_partition::load_and_analyze(&args.model, &args.dims.analyze_options())?;
    if let Some(b) = args.dims.global_batch
        && a.lg.dims.fixed_batch
        && b % a.lg.dims.graph_batch as u64 != 0
    {
        tracing::warn!(
            "the graph's batch is fixed at {}; --global-batch {b} is not a multiple of it",
            a.lg.dims.graph_batch
        );
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&args.model, &a, args.dims.global_batch))?);
    } else {
        print!("{}", table(&args.model, &a.lg, args.dims.global_batch));
    }
    Ok(())
}

/// Runs of consecutive block layers with one signature: (signature, first, last).
pub fn repeated_blocks(lg: &ir::LayeredGraph) -> Vec<(String, usize, usize)> {
    let mut runs: Vec<(String, usize, usize)> = Vec::new();
    for l in lg.layers.iter().filter(|l| l.kind == LayerKind::Block) {
        match runs.last_mut() {
            Some(r) if r.0 == l.signature && r.2 + 1 == l.index => r.2 = l.index,
            _ => runs.push((l.signature.clone(), l.index, l.index)),
        }
    }
    runs.retain(|r| r.2 > r.1);
    runs
}

fn to_json(path: &Path, a: &Analysed, global_batch: Option<u64>) -> serde_json::Value {
    let lg = &a.lg;
    let g = &lg.graph;
    let layers: Vec<_> = lg
        .layers
        .iter()
        .map(|l| {
            json!({
                "index": l.index,
                "name": l.name,
                "kind": l.kind.name(),
                "nodes": l.nodes.len(),
                "params": l.figures.param_elems,
                "param_bytes": l.figures.param_bytes,
                "shared_params": l.shared_params.iter().map(|&v| g.value(v).name.clone()).collect::<Vec<_>>(),
                "flops": l.figures.flops,
                "activation_bytes": l.figures.saved_bytes,
                "input_bytes": l.input_bytes,
                "output_bytes": l.output_bytes,
                "shared_inputs": l.inputs.iter().filter(|v| lg.layers.iter().filter(|o| o.inputs.contains(v)).count() > 1).map(|&v| g.value(v).name.clone()).collect::<Vec<_>>(),
                "shared_input_bytes": l.shared_input_bytes,
                "shared_saved_bytes": l.shared_saved_bytes,
                "signature": l.signature,
            })
        })
        .collect();
    let blocks: Vec<_> =
        repeated_blocks(lg).into_iter().map(|(s, f, l)| json!({"signature": s, "count": l - f + 1, "first": f, "last": l})).collect();
    let mut out = json!({
        "model": {"path": path.display().to_string(), "sha256": a.model.sha256},
        "params": lg.params,
        "param_bytes": lg.layers.iter().map(|l| l.figures.param_bytes).sum::<u64>(),
        "flops_per_sample": lg.flops_per_sample,
        "activation_bytes_per_sample": lg.layers.iter().map(|l| l.figures.saved_bytes).sum::<f64>(),
        "nodes": g.node_count(),
        "dims": {
            "values": lg.dims.values,
            "batch_symbol": lg.dims.batch_symbol,
            "graph_batch": lg.dims.graph_batch,
            "fixed_batch": lg.dims.fixed_batch,
        },
        "layers": layers,
        "repeated_blocks": blocks,
        "warnings": a.warnings,
    });
    if let Some(b) = global_batch {
        out["global_batch"] = json!(b);
        out["flops_per_batch"] = json!(lg.flops_per_sample * b as f64);
    }
    out
}

/// `1.2 G`-style numbers (decimal prefixes).
pub fn human(x: f64) -> String {
    let units = ["", " k", " M", " G", " T", " P", " E"];
    let mut v = x;
    let mut i = 0;
    while v.abs() >= 1000.0 && i + 1 < units.len() {
        v /= 1000.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.0}{}", units[i])
    } else {
        format!("{v:.1}{}", units[i])
    }
}

/// `350 MB`-style byte counts.
pub fn human_bytes(x: f64) -> String {
    let s = human(x);
    if s.ends_with(|c: char| c.is_ascii_digit()) { format!("{s} B") } else { format!("{s}B") }
}

fn table(path: &Path, lg: &ir::LayeredGraph, global_batch: Option<u64>) -> String {
    use std::fmt::Write as _;
    let scale = global_batch.unwrap_or(1) as f64;
    let per = match global_batch {
        Some(b) => format!("per global batch of {b}"),
        None => "per sample".to_string(),
    };
    let mut s = String::new();
    let d = &lg.dims;
    let dims: Vec<String> = d.values.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let _ = writeln!(
        s,
        "{}: {} nodes, {} layers; dims {}{}",
        path.display(),
        lg.graph.node_count(),
        lg.layers.len(),
        if dims.is_empty() { "fixed".to_string() } else { dims.join(", ") },
        if d.fixed_batch { format!(" (batch fixed at {})", d.graph_batch) } else { String::new() }
    );
    let _ = writeln!(s, "FLOPs (forward) and activations (saved for backward) {per}\n");
    let name_w = lg.layers.iter().map(|l| l.name.len()).max().unwrap_or(5).max(5);
    let _ = writeln!(s, "{:>4}  {:<name_w$}  {:<9}  {:>6}  {:>9}  {:>9}  {:>11}", "#", "layer", "kind", "nodes", "params", "FLOPs", "activations");
    for l in &lg.layers {
        let _ = writeln!(
            s,
            "{:>4}  {:<name_w$}  {:<9}  {:>6}  {:>9}  {:>9}  {:>11}",
            l.index,
            l.name,
            l.kind.name(),
            l.nodes.len(),
            human(l.figures.param_elems as f64),
            human(l.figures.flops * scale),
            human_bytes(l.figures.saved_bytes * scale),
        );
    }
    let acts: f64 = lg.layers.iter().map(|l| l.figures.saved_bytes).sum();
    let pbytes: u64 = lg.layers.iter().map(|l| l.figures.param_bytes).sum();
    let _ = writeln!(
        s,
        "{:>4}  {:<name_w$}  {:<9}  {:>6}  {:>9}  {:>9}  {:>11}",
        "",
        "total",
        "",
        lg.graph.node_count(),
        human(lg.params as f64),
        human(lg.flops_per_sample * scale),
        human_bytes(acts * scale),
    );
    let _ = writeln!(s, "\nparameters: {} ({}), counted once", human(lg.params as f64), human_bytes(pbytes as f64));
    for (sig, f, l) in repeated_blocks(lg) {
        let _ = writeln!(s, "repeated blocks: {} × signature {sig} (layers {f}-{l})", l - f + 1);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_numbers() {
        assert_eq!(human(999.0), "999");
        assert_eq!(human(1234.0), "1.2 k");
        assert_eq!(human(1.75e11), "175 G");
        assert_eq!(human_bytes(350e6), "350 MB");
        assert_eq!(human_bytes(12.0), "12 B");
    }
}
