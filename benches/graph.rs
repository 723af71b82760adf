//! Speed of the `graph` pipeline on the graph-only GPT-3 175B (`models/gpt3-175b.onnx`):
//! import, then analyze (shape inference, folding, DCE, figures, layers), and the whole
//! `smp-partition graph` command as a process. Goal: the command in ≤ 0.5 s.
//!
//! Run: `cargo bench --bench graph` (release). Prints numbers.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use smp_partition::frontend::onnx::load_model;
use smp_partition::passes::{AnalyzeOptions, analyze};

const MODEL: &str = "models/gpt3-175b.onnx";
const RUNS: usize = 10;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    if !Path::new(MODEL).exists() {
        eprintln!("{MODEL} is missing; run `make models`");
        std::process::exit(1);
    }
    let (mut import, mut passes) = (Vec::new(), Vec::new());
    let mut summary = String::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        let m = load_model(Path::new(MODEL)).expect("import");
        import.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let lg = analyze(m.graph, &AnalyzeOptions::default()).expect("analyze");
        passes.push(t.elapsed().as_secs_f64());
        summary = format!("{} nodes, {} layers, {} params", lg.graph.node_count(), lg.layers.len(), lg.params);
    }
    println!("graph on {MODEL}: {summary}");
    println!("  import   median {:7.1} ms over {RUNS} runs", median(import) * 1e3);
    println!("  analyze  median {:7.1} ms over {RUNS} runs", median(passes) * 1e3);

    // The whole command, as users run it (release binary beside this bench).
    let exe = std::env::current_exe().ok().and_then(|p| p.parent()?.parent().map(|d| d.join("smp-partition")));
    match exe.filter(|p| p.exists()) {
        Some(exe) => {
            let mut wall = Vec::new();
            for _ in 0..RUNS {
                let t = Instant::now();
                let out = Command::new(&exe).args(["graph", MODEL, "--json"]).output().expect("run smp-partition");
                wall.push(t.elapsed().as_secs_f64());
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            }
            let m = median(wall);
            println!("  `smp-partition graph --json` median {:7.1} ms over {RUNS} runs (goal ≤ 500 ms: {})", m * 1e3, if m <= 0.5 { "met" } else { "NOT met" });
        }
        None => println!("  (build the binary with `cargo build --release` to time the whole command)"),
    }
}
