//! Memory predicted against measured, by part: plans of the bundled Llama (and GPT-2) at a
//! sequence where activations dominate, each run 2 steps by `smp-runner launch`; every rank's
//! `--json` entry carries the plan's figures for its pipeline rank and the bytes of the tensors it
//! held at its peak (a counting CPU allocator), by part. The oracle is the measurement: each part
//! and the rank's held total (every part but the transient) must be within 10 % of what the rank
//! measured. Cases not yet within 10 % are listed in `KNOWN_GAPS` with their cause; a listed gap
//! that closes fails the test too, so the list stays honest.
//!
//! The plan prices no transient: it reserves its preset's fixed workspace margin instead (256 MiB
//! on `cpu`), so `temporaries` is only held to not exceeding that margin.
#![cfg(feature = "runner")]

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use common::runner::{json, ok, plan_into, runner};

/// The parts compared, in the report's order (`held` is `total − temporaries`).
const PARTS: [&str; 6] = ["params", "grads", "optimizer", "activations", "offloaded", "held"];

/// Relative bound on every part and the held total.
const BOUND: f64 = 0.10;

/// Parts smaller than this share of the rank's measured total are compared against it instead.
const FLOOR: f64 = 0.01;

/// A plan of the matrix: its name, model, ranks and planner flags (beside the shared ones).
struct Case {
    name: &'static str,
    model: &'static str,
    nproc: usize,
    flags: &'static [&'static str],
}

const ONE: [&str; 6] = ["--pp", "1", "--tp", "1", "--dp", "1"];

const CASES: &[Case] = &[
    Case { name: "pp2-gpipe", model: "llama", nproc: 2, flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "gpipe", "--checkpointing", "none"] },
    Case { name: "pp2-1f1b", model: "llama", nproc: 2, flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "none"] },
    Case { name: "pp2-interleaved", model: "llama", nproc: 2, flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "interleaved:2", "--microbatches", "4", "--checkpointing", "none"] },
    Case { name: "pp2-zb-h1", model: "llama", nproc: 2, flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "zb-h1", "--checkpointing", "none"] },
    Case { name: "tp2", model: "llama", nproc: 2, flags: &["--pp", "1", "--tp", "2", "--dp", "1", "--no-sequence-parallel", "--checkpointing", "none"] },
    Case { name: "tp2-sp", model: "llama", nproc: 2, flags: &["--pp", "1", "--tp", "2", "--dp", "1", "--sequence-parallel", "--checkpointing", "none"] },
    Case { name: "cp2", model: "llama", nproc: 2, flags: &["--pp", "1", "--tp", "1", "--dp", "1", "--cp", "2", "--checkpointing", "none"] },
    Case { name: "dp2-zero1", model: "llama", nproc: 2, flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "1", "--checkpointing", "none"] },
    Case { name: "dp2-zero2", model: "llama", nproc: 2, flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "2", "--checkpointing", "none"] },
    Case { name: "dp2-zero3", model: "llama", nproc: 2, flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "3", "--checkpointing", "none"] },
    Case { name: "one-recompute-none", model: "llama", nproc: 1, flags: &["--checkpointing", "none"] },
    Case { name: "one-recompute-selective", model: "llama", nproc: 1, flags: &["--recompute-layers", "1-2"] },
    Case { name: "one-recompute-full", model: "llama", nproc: 1, flags: &["--checkpointing", "full"] },
    Case { name: "pp2-offload", model: "llama", nproc: 2, flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "full", "--offload-activations", "on", "--activation-loading-horizon", "1"] },
    Case { name: "pp2-bf16-mixed", model: "llama", nproc: 2, flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "none", "--precision", "bf16-mixed"] },
    Case { name: "pp2-fp16-mixed", model: "llama", nproc: 2, flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "none", "--precision", "fp16-mixed"] },
    Case { name: "gpt2-pp2-1f1b", model: "gpt2", nproc: 2, flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "none"] },
];

/// A (case, part) not yet within the bound, with why (ratios: predicted / measured, per rank).
struct Gap {
    case: &'static str,
    part: &'static str,
    cause: &'static str,
}

const KNOWN_GAPS: &[Gap] = &[];

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models").join(format!("{name}.onnx"))
}

/// Part `part` of a `memory.predicted` or `memory.measured` object.
fn part(m: &serde_json::Value, part: &str) -> f64 {
    let get = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {m}"));
    if part == "held" { get("total") - get("temporaries") } else { get(part) }
}

/// Runs `case` for 2 steps; per rank, its `memory` object.
fn measure(case: &Case, dir: &Path) -> Vec<serde_json::Value> {
    let mut args: Vec<&str> = vec!["--seq-len", "512", "--global-batch", "4"];
    if !case.flags.contains(&"--microbatches") {
        args.extend_from_slice(&["--microbatches", "2"]);
    }
    if case.nproc == 1 {
        args.extend_from_slice(&ONE);
    }
    args.extend_from_slice(case.flags);
    let plan = plan_into(&model(case.model), &format!("cpu:{}", case.nproc), &args, &dir.join(format!("{}.json", case.name)));
    let r = runner()
        .args(["launch", "--nproc", &case.nproc.to_string(), plan.to_str().unwrap(), "--steps", "2", "--threads", "1", "--json", "--timeout", "300"])
        .output()
        .unwrap();
    let report = json(&ok(&format!("launching {}", case.name), r));
    report["ranks"].as_array().unwrap().iter().map(|r| r["memory"].clone()).collect()
}

#[test]
fn every_rank_holds_the_memory_its_plan_predicts_by_part() {
    let dir = tempfile::tempdir().unwrap();
    let mut table = String::from("| case | rank | params | grads | optimizer | activations | offloaded | held total | temporaries (measured / margin) |\n|---|---|---|---|---|---|---|---|---|\n");
    let mut failures = Vec::new();
    let mib = |b: f64| b / (1u64 << 20) as f64;
    for case in CASES {
        let ranks = measure(case, dir.path());
        // per part: whether every rank is within the bound
        let mut within = [true; PARTS.len()];
        for (rank, m) in ranks.iter().enumerate() {
            let (pred, meas) = (&m["predicted"], &m["measured"]);
            assert!(meas.is_object(), "{} rank {rank}: nothing measured ({m})", case.name);
            let total = part(meas, "total");
            let _ = write!(table, "| {} | {rank} |", case.name);
            for (i, p) in PARTS.iter().enumerate() {
                let (want, got) = (part(pred, p), part(meas, p));
                let ok = (want - got).abs() <= (BOUND * got).max(FLOOR * total);
                within[i] &= ok;
                let ratio = if got > 0.0 { format!("{:.2}×", want / got) } else if want == 0.0 { "=".into() } else { "∞".into() };
                let _ = write!(table, " {:.2} / {:.2} ({ratio}) |", mib(want), mib(got));
            }
            let (margin, temp) = (part(pred, "temporaries"), part(meas, "temporaries"));
            let _ = writeln!(table, " {:.2} / {:.0} |", mib(temp), mib(margin));
            if temp > margin {
                failures.push(format!("{} rank {rank}: a transient of {:.2} MiB exceeds the plan's margin {:.0} MiB", case.name, mib(temp), mib(margin)));
            }
        }
        for (i, p) in PARTS.iter().enumerate() {
            let listed = KNOWN_GAPS.iter().any(|g| g.case == case.name && g.part == *p);
            match (within[i], listed) {
                (false, false) => failures.push(format!("{} {p}: outside {:.0} % on some rank and not a known gap", case.name, BOUND * 100.0)),
                (true, true) => failures.push(format!("{} {p}: listed as a known gap but now within {:.0} %: remove it from KNOWN_GAPS", case.name, BOUND * 100.0)),
                _ => {}
            }
        }
    }
    eprintln!("memory: predicted / measured MiB (ratio)\n{table}");
    for g in KNOWN_GAPS {
        eprintln!("known gap: {} {}: {}", g.case, g.part, g.cause);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
