//! Real data: a byte-level GPT (6 blocks × 256 by default, `real_data_model.py`) trained on the
//! Python standard library's `.py` files, 5 % of the files held out by `prepare-data`'s rule
//! (every 20th by sorted path), under the planner's `cpu:4` plan and on one rank beside it:
//! same seed, sample order, schedule and settings. Prints both validation curves as a markdown
//! table with their relative difference (goal: within 1 % at every evaluation point) and draws
//! them (plotters) to `target/real-data/validation.svg`.
//!
//!     cargo test --features runner --bench real_data -- [STEPS [EVAL_EVERY [BATCH [SEQ [LAYERS [HIDDEN]]]]]]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use plotters::prelude::*;

fn output(cmd: &mut Command, what: &str) -> Vec<u8> {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

/// (step, validation loss) of a `--json` report.
fn evals(report: &serde_json::Value) -> Vec<(usize, f64)> {
    let list = report["eval"].as_array().unwrap_or_else(|| panic!("no `eval` in {report}"));
    list.iter().map(|e| (e["step"].as_u64().expect("step") as usize, e["loss"].as_f64().expect("loss"))).collect()
}

fn draw(svg: &Path, curves: &[(&str, &[(usize, f64)], RGBColor)]) -> Result<(), Box<dyn std::error::Error>> {
    let steps = curves.iter().flat_map(|c| c.1.iter().map(|p| p.0)).max().unwrap_or(1);
    let (lo, hi) = curves
        .iter()
        .flat_map(|c| c.1.iter().map(|p| p.1))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)));
    let root = SVGBackend::new(svg, (720, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Validation loss, byte-level GPT on the Python standard library", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0..steps, (lo * 0.97)..(hi * 1.02))?;
    chart.configure_mesh().x_desc("optimizer step").y_desc("loss (nats/byte)").draw()?;
    for &(name, points, color) in curves {
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (steps, every, batch, seq, layers, hidden) = (arg(0, 300), arg(1, 25), arg(2, 8), arg(3, 128), arg(4, 6), arg(5, 256));
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = repo.join("target/real-data");
    std::fs::create_dir_all(&dir).expect("create target/real-data");
    let python = std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo.join(".venv/bin/python"));
    let (runner, planner) = (env!("CARGO_BIN_EXE_smp-runner"), env!("CARGO_BIN_EXE_smp-partition"));

    let model = dir.join(format!("gpt-bytes-{layers}x{hidden}-s{seq}.onnx"));
    if !model.exists() {
        let heads = (hidden / 32).max(1).to_string();
        let mut c = Command::new(&python);
        c.arg(repo.join("benches/real_data_model.py")).arg(&model).args([layers.to_string(), hidden.to_string(), heads, seq.to_string()]);
        output(&mut c, "exporting the byte-level GPT");
    }
    let data = dir.join("stdlib.bin");
    let mut c = Command::new(runner);
    c.args(["prepare-data", "/usr/lib/python3.11", "--ext", "py", "--val-fraction", "0.05", "-o"]).arg(&data);
    output(&mut c, "prepare-data");
    let val = dir.join("stdlib.val.bin");
    let plan = dir.join("cpu4.json");
    let (b, s) = (batch.to_string(), seq.to_string());
    let mut c = Command::new(planner);
    c.arg(&model).args(["--cluster", "cpu:4", "--global-batch", &b, "--seq-len", &s, "-o"]).arg(&plan);
    output(&mut c, "planning cpu:4");
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).expect("read the plan")).expect("plan JSON");
    let par = &p["parallel"];
    let m = par["microbatches"].as_u64().unwrap_or(1).to_string();
    let mesh = format!(
        "pp {} · tp {} · dp {}, ZeRO {}, {} microbatches, {}",
        par["pp"], par["tp"], par["dp"], par["zero"], m, par["schedule"].as_str().unwrap_or("?")
    );
    let (n, e) = (steps.to_string(), every.to_string());
    let common = [
        "--data", data.to_str().unwrap(), "--eval-data", val.to_str().unwrap(), "--eval-every", &e, "--eval-batches", "4",
        "--steps", &n, "--lr", "1e-3", "--lr-schedule", "cosine", "--warmup-steps", "20", "--min-lr", "1e-4",
        "--seed", "1", "--threads", "1", "--json",
    ];
    let ranks = ["pp", "tp", "dp"].iter().map(|k| par[*k].as_u64().unwrap_or(1)).product::<u64>().to_string();
    let t0 = Instant::now();
    let mut c = Command::new(runner);
    c.args(["launch", "--nproc", &ranks]).arg(&plan).args(common);
    let four: serde_json::Value = serde_json::from_slice(&output(&mut c, "the cpu:4 plan")).expect("report");
    let t_four = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let mut c = Command::new(runner);
    c.arg("train").arg(&model).args(["--batch", &b, "--seq-len", &s, "--microbatches", &m]).args(common);
    let one: serde_json::Value = serde_json::from_slice(&output(&mut c, "one rank")).expect("report");
    let t_one = t0.elapsed().as_secs_f64();

    let (a, z) = (evals(&four), evals(&one));
    assert_eq!(a.iter().map(|p| p.0).collect::<Vec<_>>(), z.iter().map(|p| p.0).collect::<Vec<_>>(), "evaluation steps differ");
    let side: serde_json::Value = serde_json::from_slice(&std::fs::read(repo.join("target/real-data/stdlib.bin.json")).expect("sidecar")).expect("json");
    let vside: serde_json::Value = serde_json::from_slice(&std::fs::read(repo.join("target/real-data/stdlib.val.bin.json")).expect("sidecar")).expect("json");
    println!(
        "{layers} blocks × {hidden}, batch {batch} × {seq}, {steps} steps; train {} tokens ({} files), validation {} tokens ({} files)",
        side["tokens"],
        side["files"].as_array().map_or(0, Vec::len),
        vside["tokens"],
        vside["files"].as_array().map_or(0, Vec::len)
    );
    println!("cpu:4 plan: {mesh}; wall {t_four:.0} s (4 ranks) vs {t_one:.0} s (1 rank)\n");
    println!("| step | cpu:4 plan | 1 rank | relative difference |\n|---:|---:|---:|---:|");
    let mut worst = 0.0f64;
    for (&(step, x), &(_, y)) in a.iter().zip(&z) {
        let rel = (x - y).abs() / y.abs();
        worst = worst.max(rel);
        println!("| {step} | {x:.4} | {y:.4} | {:.2e} |", rel);
    }
    println!("\nlargest relative difference {worst:.2e} (goal ≤ 1e-2: {})", if worst <= 1e-2 { "met" } else { "not met" });
    let svg = dir.join("validation.svg");
    let label4 = format!("cpu:4 plan ({mesh})");
    draw(&svg, &[(label4.as_str(), &a, RGBColor(31, 119, 180)), ("1 rank", &z, RGBColor(255, 127, 14))]).expect("draw the SVG");
    println!("wrote {}", svg.display());
}
