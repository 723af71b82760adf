//! `smp-partition sweep` of the graph-only GPT-3 175B over six clusters (a100-80gb and
//! h100-80gb at 256, 512 and 1024 devices; batch 1536, seq 2048), end to end as a user runs it
//! (the binary: import, analysis, six plans, table, SVG chart). Goal: ≤ 10 s.
//!
//! Peer, measured side by side in the same run: the six single `smp-partition MODEL --cluster
//! C` plans one after the other, as a user would without `sweep`.
//!
//! Run: `cargo bench --features runner --profile dev --bench sweep`. Prints a markdown table
//! for BENCHMARKS.md.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

const CLUSTERS: [&str; 6] = ["a100-80gb:256", "a100-80gb:512", "a100-80gb:1024", "h100-80gb:256", "h100-80gb:512", "h100-80gb:1024"];
const FLAGS: [&str; 4] = ["--global-batch", "1536", "--seq-len", "2048"];

fn timed(args: &[&str]) -> f64 {
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(args).output().expect("smp-partition runs");
    let wall = t.elapsed().as_secs_f64();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    wall
}

fn main() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/gpt3-175b.onnx").display().to_string();
    let dir = std::env::temp_dir().join(format!("smp-sweep-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let svg = dir.join("sweep.svg").display().to_string();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);

    let mut sweep_args = vec!["sweep", model.as_str(), "--clusters", "a100-80gb:256,512,1024", "h100-80gb:256,512,1024", "-o", svg.as_str()];
    sweep_args.extend(FLAGS);
    let sweep = timed(&sweep_args);
    let mut singles = Vec::new();
    for c in CLUSTERS {
        let mut args = vec![model.as_str(), "--cluster", c];
        args.extend(FLAGS);
        singles.push(timed(&args));
    }
    let peer: f64 = singles.iter().sum();
    let _ = std::fs::remove_dir_all(&dir);

    println!("| case | wall (s) | goal |");
    println!("|---|---|---|");
    println!("| `sweep` GPT-3 175B, 6 clusters ({cores} cores) | {sweep:.2} | ≤ 10 s: {} |", if sweep <= 10.0 { "met" } else { "missed" });
    println!("| peer: 6 single plans in a row | {peer:.2} | |");
    for (c, s) in CLUSTERS.iter().zip(&singles) {
        println!("|   {c} | {s:.2} | |");
    }
    println!("| ratio sweep / peer | {:.2}× | |", sweep / peer);
}
