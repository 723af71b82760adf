//! `smp-partition sweep`: the graph-only GPT-3 175B over six clusters writes the table and a
//! well-formed SVG chart, and every row equals a single `smp-partition` plan of that cluster.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use smp_partition::cost::list_price;

const CLUSTERS: [&str; 2] = ["a100-80gb:256,512,1024", "h100-80gb:256,512,1024"];
const FLAGS: [&str; 4] = ["--global-batch", "1536", "--seq-len", "2048"];

fn smp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(args).output().unwrap()
}

fn ok(o: &Output, what: &str) -> String {
    assert!(o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn model() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/gpt3-175b.onnx").display().to_string()
}

fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-9 * b.abs().max(1e-12), "{what}: {a} vs {b}");
}

#[test]
fn gpt3_sweep_matches_single_plans_and_draws_the_chart() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("sweep.svg");
    let model = model();
    let mut args = vec!["sweep", model.as_str(), "--clusters", CLUSTERS[0], CLUSTERS[1]];
    args.extend(FLAGS);
    let svg_arg = svg.display().to_string();
    args.extend(["-o", svg_arg.as_str(), "--json"]);
    let sweep: Value = serde_json::from_str(&ok(&smp(&args), "sweep")).unwrap();
    let rows = sweep["rows"].as_array().unwrap();
    let expected = ["a100-80gb:256", "a100-80gb:512", "a100-80gb:1024", "h100-80gb:256", "h100-80gb:512", "h100-80gb:1024"];
    assert_eq!(rows.iter().map(|r| r["cluster"].as_str().unwrap()).collect::<Vec<_>>(), expected);

    // the oracle: one `smp-partition MODEL --cluster C` per row
    for row in rows {
        let cluster = row["cluster"].as_str().unwrap();
        assert!(row["error"].is_null(), "{cluster}: {}", row["error"]);
        let mut single = vec![model.as_str(), "--cluster", cluster, "--json"];
        single.extend(FLAGS);
        let plan: Value = serde_json::from_str(&ok(&smp(&single), cluster)).unwrap();
        for key in ["pp", "tp", "dp", "zero", "microbatches", "schedule"] {
            assert_eq!(row[key], plan["parallel"][key], "{cluster}: {key}");
        }
        let p = &plan["predicted"];
        let step = p["step_time_s"].as_f64().unwrap();
        close(row["step_time_s"].as_f64().unwrap(), step, cluster);
        close(row["samples_per_s"].as_f64().unwrap(), p["samples_per_s"].as_f64().unwrap(), cluster);
        close(row["mfu"].as_f64().unwrap(), p["mfu"].as_f64().unwrap(), cluster);
        assert_eq!(row["peak_memory_bytes"], p["peak_memory_bytes"], "{cluster}");
        close(row["tokens_per_s"].as_f64().unwrap(), p["samples_per_s"].as_f64().unwrap() * 2048.0, cluster);
        // cost from the preset's list price, computed here independently
        let (preset, n) = cluster.split_once(':').unwrap();
        let devices: f64 = n.parse().unwrap();
        let price = list_price(preset).unwrap();
        let per_step = price * devices * step / 3600.0;
        close(row["cost_per_step_usd"].as_f64().unwrap(), per_step, cluster);
        close(row["cost_per_million_tokens_usd"].as_f64().unwrap(), per_step / (1536.0 * 2048.0) * 1e6, cluster);
    }

    // the table: a header, one line per cluster, the prices used
    let table = sweep["table"].as_str().unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("cluster") && lines[0].contains("tokens/s") && lines[0].contains("$/1M tokens"), "{table}");
    for (line, cluster) in lines[1..].iter().zip(expected) {
        assert!(line.starts_with(cluster), "{table}");
    }
    assert!(lines[7].starts_with("prices: a100-80gb $5.121/device-hour, h100-80gb $12.290/device-hour"), "{table}");

    // the chart: well-formed SVG, one line per device kind and panel, its labels as text
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("well-formed SVG");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<String> = doc.descendants().filter(|n| n.has_tag_name("text")).filter_map(|n| n.text()).map(String::from).collect();
    for label in ["a100-80gb", "h100-80gb", "devices", "tokens/s", "USD per 1M tokens"] {
        assert!(texts.iter().any(|t| t.contains(label)), "no `{label}` in the chart's text: {texts:?}");
    }
    let lines = doc.descendants().filter(|n| n.has_tag_name("polyline")).count();
    assert!(lines >= 4, "{lines} polylines: two series in each of two panels");
    let points = doc.descendants().filter(|n| n.has_tag_name("circle")).count();
    assert_eq!(points, 12, "6 clusters × 2 panels");
}

#[test]
fn sweep_prints_the_table_and_names_bad_counts() {
    let model = model();
    let out = ok(&smp(&["sweep", model.as_str(), "--clusters", "h100-80gb:64", "--global-batch", "512", "--seq-len", "2048"]), "sweep");
    assert!(out.lines().next().unwrap().starts_with("cluster"), "{out}");
    assert!(out.lines().nth(1).unwrap().starts_with("h100-80gb:64"), "{out}");
    let o = smp(&["sweep", model.as_str(), "--clusters", "h100-80gb:64,x"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("`x`"));
}
