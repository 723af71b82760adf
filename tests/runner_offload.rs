//! Activation offloading executed: plans of the GPT-2 export with full recompute, run by
//! `smp-runner launch` with offloading off and on (horizon 1), in f64. The oracle is the run
//! with offloading off: every loss equal within 1e-12 relative. The runner recomputes layer by
//! layer and keeps what each checkpointed layer's recompute starts from, its inputs, in an
//! accounted device pool (a backward's own inputs counted until its recompute has read them):
//! with offloading on, its peak must drop by the plan's `offloaded_bytes` (within 10 %; none
//! where the plan counts none) on every stage with offloaded layers.
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};

use common::runner::{field, json, ok, plan_into, runner};

const STEPS: &str = "5";

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx")
}

/// Plans `flags` with offloading `rule` (horizon 1) and full recompute; the plan's JSON.
fn plan(dir: &Path, name: &str, pp: usize, flags: &[&str], rule: &str) -> (PathBuf, serde_json::Value) {
    let base = ["--seq-len", "16", "--global-batch", "8", "--microbatches", "4", "--tp", "1", "--dp", "1", "--checkpointing", "full"];
    let pp = pp.to_string();
    let args: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--pp", &pp, "--offload-activations", rule, "--activation-loading-horizon", "1"])
        .chain(flags.iter().copied())
        .collect();
    let path = plan_into(&model(), &format!("cpu:{pp}"), &args, &dir.join(format!("{name}-{rule}.json")));
    let v = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    (path, v)
}

fn launch(nproc: usize, plan: &Path) -> serde_json::Value {
    let r = runner()
        .args(["launch", "--nproc", &nproc.to_string(), plan.to_str().unwrap()])
        .args(["--steps", STEPS, "--dtype", "f64", "--threads", "1", "--json", "--timeout", "120"])
        .output()
        .unwrap();
    json(&ok(&format!("launch of {}", plan.display()), r))
}

/// Per rank: (peak kept bytes on the device, peak bytes offloaded to host).
fn pools(report: &serde_json::Value) -> Vec<(f64, f64)> {
    field(report, "ranks", "peak_kept_activation_bytes").into_iter().zip(field(report, "ranks", "peak_offloaded_activation_bytes")).collect()
}

/// Runs `name` off and on; asserts equal losses; returns the plans and per-rank pools.
fn off_and_on(name: &str, pp: usize, flags: &[&str]) -> [(serde_json::Value, Vec<(f64, f64)>); 2] {
    let dir = tempfile::tempdir().unwrap();
    let runs = ["off", "on"].map(|rule| {
        let (path, v) = plan(dir.path(), name, pp, flags, rule);
        let report = launch(pp, &path);
        (v, report)
    });
    let (off, on) = (field(&runs[0].1, "steps", "loss"), field(&runs[1].1, "steps", "loss"));
    assert_eq!(off.len(), on.len());
    let worst = off.iter().zip(&on).map(|(a, b)| ((a - b) / a).abs()).fold(0.0, f64::max);
    eprintln!("{name}: offloading on vs off, max relative loss difference {worst:.3e} over {} steps", on.len());
    assert!(worst <= 1e-12, "{name}: losses with offloading {on:?} vs without {off:?} (max rel {worst:.3e})");
    runs.map(|(v, report)| {
        let p = pools(&report);
        (v, p)
    })
}

/// The plan of the f32 `cpu` precision prices 4-byte activations; the f64 run holds 8.
const F64_OVER_PLAN: f64 = 2.0;

/// On every stage with offloaded layers, the measured drop of the device pool's peak against
/// the plan's `offloaded_bytes` (within 10 %; exactly none where it plans none); returns how
/// many stages were compared.
fn drops_match_the_plan(name: &str, runs: &[(serde_json::Value, Vec<(f64, f64)>); 2]) -> usize {
    let (plan, off, on) = (&runs[1].0, &runs[0].1, &runs[1].1);
    let mut compared = 0;
    for st in plan["stages"].as_array().unwrap() {
        let index = st["index"].as_u64().unwrap() as usize;
        let planned = st["offloaded_bytes"].as_f64().unwrap_or(0.0) * F64_OVER_PLAN;
        if st["offloaded_layers"].as_array().is_none_or(|l| l.is_empty()) {
            continue;
        }
        let rank = st["ranks"][0].as_u64().unwrap() as usize;
        let measured = off[rank].0 - on[rank].0;
        eprintln!(
            "{name} stage {index} (layers {}): device pool peak {} → {} B, measured drop {measured} B, planned {planned} B; {} B in host memory at the peak",
            st["layers"], off[rank].0, on[rank].0, on[rank].1
        );
        assert!((measured - planned).abs() <= 0.1 * planned, "{name} stage {index}: dropped {measured} B, planned {planned} B");
        compared += 1;
    }
    compared
}

/// The acceptance's plans: pp 2 under 1F1B and ZB-H1, every layer checkpointed, horizon 1; the
/// layers' kept inputs go to host memory between their forward and the loading window, and the
/// device pool's peak drops by what the plan counts in host memory at the peak: nothing, since
/// as a backward starts its own microbatch and the horizon's are back (two, as many as are in
/// flight on the first stage).
#[test]
fn pp2_1f1b_and_zb_h1_offload_the_planned_bytes() {
    for schedule in ["1f1b", "zb-h1"] {
        let name = format!("pp2-{schedule}");
        let runs = off_and_on(&name, 2, &["--schedule", schedule]);
        assert!(runs[1].1.iter().any(|&(_, host)| host > 0.0), "{name}: nothing went to host memory");
        let compared = drops_match_the_plan(&name, &runs);
        assert!(compared > 0, "{name}: the plan offloads nothing");
    }
}

/// Where the runner keeps several microbatches' inputs: both stages of pp 3 under 1F1B and
/// ZB-H1 (three and two in flight between a forward and its B) and of a pp 2 GPipe (all four).
#[test]
fn offloaded_inputs_leave_the_device_pool_by_the_planned_amount() {
    let cases: [(&str, usize, &[&str]); 3] = [
        ("pp3-1f1b", 3, &["--schedule", "1f1b", "--layout", "0-3|4-4|5-5"]),
        ("pp2-gpipe", 2, &["--schedule", "gpipe", "--layout", "0-4|5-5"]),
        ("pp3-zb-h1", 3, &["--schedule", "zb-h1", "--layout", "0-3|4-4|5-5"]),
    ];
    for (name, pp, flags) in cases {
        let runs = off_and_on(name, pp, flags);
        assert!(runs[1].1.iter().any(|&(_, host)| host > 0.0), "{name}: nothing went to host memory");
        assert!(runs[0].1.iter().all(|&(_, host)| host == 0.0), "{name}: offloading off moved bytes");
        for (rank, (off, on)) in runs[0].1.iter().zip(&runs[1].1).enumerate() {
            assert!(on.0 <= off.0, "{name} rank {rank}: the device pool grew with offloading ({} → {} B)", off.0, on.0);
        }
        let compared = drops_match_the_plan(name, &runs);
        assert!(compared > 0, "{name}: no stage to compare");
    }
}
