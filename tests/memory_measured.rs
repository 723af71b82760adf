//! Memory predicted against measured, by part: plans of the bundled Llama (and
//! tests/moe_oracle.py's small Mixtral) at a sequence where activations dominate, each run 2 steps
//! by `smp-runner launch`; every rank's `--json` entry carries the plan's figures for its pipeline
//! rank and the bytes of the tensors it held at its peak (a counting CPU allocator), by part. The
//! oracle is the measurement: each part and the rank's total (predicted: less its transients)
//! must be within 10 % of what the rank measured (the first step, a warm-up, is not
//! counted). Cases not yet within 10 % are listed in `KNOWN_GAPS` with their cause; a listed gap
//! that closes fails the test too, so the list stays honest.
//!
//! The plan prices one transient, the recompute working set (a checkpointed layer's activations,
//! rebuilt and freed inside its backward), and reserves its preset's fixed workspace margin for
//! the rest (256 MiB on `cpu`), so `temporaries` is only held to not exceeding the two, and the
//! totals compared are what the rank holds beside transients: the predicted total without them
//! against the measured one without the peak instruction's temporaries.
#![cfg(feature = "runner")]

mod common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use common::runner::{json, ok, plan_into, runner};

/// The parts compared, in the report's order (`total`: what the rank holds beside transients,
/// the predicted one less the workspace margin and the measured one less its temporaries).
const PARTS: [&str; 6] = ["params", "grads", "optimizer", "activations", "offloaded", "total"];

/// Relative bound on every part and the held total.
const BOUND: f64 = 0.10;

/// Parts smaller than this share of the rank's measured total are compared against it instead.
const FLOOR: f64 = 0.01;

/// A plan of the matrix on 2 ranks: its name, model and planner flags (beside the shared ones;
/// a one-rank plan runs as one process, which reports no parts).
struct Case {
    name: &'static str,
    model: &'static str,
    flags: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case { name: "pp2-gpipe", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "gpipe", "--checkpointing", "none"] },
    Case { name: "pp2-1f1b", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "none"] },
    // more microbatches than 1F1B keeps in flight: what finished sends held stays bounded
    Case { name: "pp2-1f1b-m4", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4", "--checkpointing", "none"] },
    Case { name: "pp2-1f1b-m4-full", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4", "--checkpointing", "full"] },
    Case { name: "pp2-interleaved", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "interleaved:2", "--microbatches", "4", "--checkpointing", "none"] },
    Case { name: "pp2-zb-h1", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "zb-h1", "--checkpointing", "none"] },
    Case { name: "pp2-zb-h1-full", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "zb-h1", "--checkpointing", "full"] },
    // one layer of each stage recomputed: the others keep the mask to their W
    Case { name: "pp2-zb-h1-some", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "zb-h1", "--recompute-layers", "1,4"] },
    Case { name: "tp2", model: "llama", flags: &["--pp", "1", "--tp", "2", "--dp", "1", "--no-sequence-parallel", "--checkpointing", "none"] },
    Case { name: "tp2-sp", model: "llama", flags: &["--pp", "1", "--tp", "2", "--dp", "1", "--sequence-parallel", "--checkpointing", "none"] },
    Case { name: "cp2", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "1", "--cp", "2", "--checkpointing", "none"] },
    Case { name: "cp2-full", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "1", "--cp", "2", "--checkpointing", "full"] },
    Case { name: "cp2-selective", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "1", "--cp", "2", "--checkpointing", "selective"] },
    Case { name: "dp2-zero1", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "1", "--checkpointing", "none"] },
    Case { name: "dp2-zero2", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "2", "--checkpointing", "none"] },
    Case { name: "dp2-zero3", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "3", "--checkpointing", "none"] },
    Case { name: "dp2-recompute-none", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "0", "--checkpointing", "none"] },
    Case { name: "dp2-recompute-selective", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "0", "--recompute-layers", "1-2"] },
    Case { name: "dp2-recompute-modules", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "0", "--checkpointing", "selective"] },
    Case { name: "pp2-1f1b-modules", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "selective"] },
    // torchtitan's per-op policy: attention's and every other product's outputs kept, the rest rebuilt
    Case { name: "pp2-1f1b-op", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "selective", "--selective-policy", "op"] },
    Case { name: "dp2-recompute-full", model: "llama", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "0", "--checkpointing", "full"] },
    Case { name: "pp2-offload", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "full", "--offload-activations", "on", "--activation-loading-horizon", "1"] },
    Case { name: "pp2-bf16-mixed", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "none", "--precision", "bf16-mixed"] },
    Case { name: "pp2-fp16-mixed", model: "llama", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--checkpointing", "none", "--precision", "fp16-mixed"] },
    Case { name: "mixtral-dp2-ep2", model: "mixtral", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--ep", "2", "--checkpointing", "none"] },
    // a stage of the embedding alone, whose masks and rotary tables go to the next stage
    Case { name: "mixtral-pp2-interleaved", model: "mixtral", flags: &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "interleaved:2", "--checkpointing", "none"] },
    // the expert group folded over the two tensor ranks (expert-TP 1): whole experts, half each
    Case { name: "mixtral-tp2-ep2-folded", model: "mixtral", flags: &["--pp", "1", "--tp", "2", "--dp", "1", "--ep", "2", "--etp", "1", "--no-sequence-parallel", "--checkpointing", "none"] },
    // the norms, activation functions and the experts' activations rebuilt
    Case { name: "mixtral-dp2-ep2-modules", model: "mixtral", flags: &["--pp", "1", "--tp", "1", "--dp", "2", "--ep", "2", "--checkpointing", "selective"] },
];

/// A (case, part) not yet within the bound, with why (ratios: predicted / measured, per rank).
struct Gap {
    case: &'static str,
    part: &'static str,
    cause: &'static str,
}

/// Parts that may land either side of the bound: ratios at the bound itself, whose cause is
/// stated. (case, part, the looser bound it is held to instead, if any, why)
const UNSTEADY: &[(&str, &str, Option<f64>, &str)] = &[];

const KNOWN_GAPS: &[Gap] = &[];

/// The bundled model `name`, or the small Mixtral of tests/moe_oracle.py.
fn model(name: &str) -> PathBuf {
    if name == "mixtral" {
        return common::moe::case(name).onnx.clone();
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models").join(format!("{name}.onnx"))
}

/// Part `part` of a `memory.predicted` object (`total` without the transients: the workspace
/// margin and the recompute working set).
fn predicted(m: &serde_json::Value, part: &str) -> f64 {
    let get = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {m}"));
    if part == "total" { get("total") - get("temporaries") } else { get(part) }
}

/// Part `part` of a `memory.measured` object (`total` without the temporaries).
fn measured(m: &serde_json::Value, part: &str) -> f64 {
    let get = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {m}"));
    if part == "total" { get("total") - get("temporaries") } else { get(part) }
}

/// Runs `case` for 2 steps; per rank, its `memory` object.
fn measure(case: &Case, dir: &Path) -> Vec<serde_json::Value> {
    let mut args: Vec<&str> = vec!["--seq-len", "512", "--global-batch", "4"];
    if !case.flags.contains(&"--microbatches") {
        args.extend_from_slice(&["--microbatches", "2"]);
    }
    args.extend_from_slice(case.flags);
    let plan = plan_into(&model(case.model), "cpu:2", &args, &dir.join(format!("{}.json", case.name)));
    let r = runner()
        .args(["launch", "--nproc", "2", plan.to_str().unwrap(), "--steps", "2", "--threads", "1", "--json", "--timeout", "300"])
        .output()
        .unwrap();
    let report = json(&ok(&format!("launching {}", case.name), r));
    report["ranks"].as_array().unwrap().iter().map(|r| r["memory"].clone()).collect()
}

#[test]
fn every_rank_holds_the_memory_its_plan_predicts_by_part() {
    for g in KNOWN_GAPS {
        assert!(CASES.iter().any(|c| c.name == g.case) && PARTS.contains(&g.part), "known gap {} {}: no such case or part", g.case, g.part);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut table = String::from("| case | rank | params | grads | optimizer | activations | offloaded | total (held beside transients) | temporaries (measured / margin + recompute) |\n|---|---|---|---|---|---|---|---|---|\n");
    let mut failures = Vec::new();
    let mut outside = String::new();
    let mib = |b: f64| b / (1u64 << 20) as f64;
    // per case, the most any rank held at its peak, transients included
    let mut peaks: std::collections::HashMap<&str, f64> = Default::default();
    for case in CASES {
        let ranks = measure(case, dir.path());
        let peak = ranks.iter().map(|m| m["measured"]["total"].as_f64().unwrap_or(0.0)).fold(0.0, f64::max);
        peaks.insert(case.name, peak);
        // per part: whether every rank is within the bound
        let mut within = [true; PARTS.len()];
        // per part: whether every rank is within an unsteady part's looser bound
        let mut loosely = [true; PARTS.len()];
        for (rank, m) in ranks.iter().enumerate() {
            let (pred, meas) = (&m["predicted"], &m["measured"]);
            assert!(meas.is_object(), "{} rank {rank}: nothing measured ({m})", case.name);
            let total = measured(meas, "total");
            let _ = write!(table, "| {} | {rank} |", case.name);
            for (i, p) in PARTS.iter().enumerate() {
                let (want, got) = (predicted(pred, p), measured(meas, p));
                let near = |bound: f64| (want - got).abs() <= (bound * got).max(FLOOR * total);
                within[i] &= near(BOUND);
                if let Some(&(.., Some(loose), _)) = UNSTEADY.iter().find(|&&(c, part, ..)| c == case.name && part == *p) {
                    loosely[i] &= near(loose);
                }
                let ratio = if got > 0.0 { format!("{:.2}×", want / got) } else if want == 0.0 { "=".into() } else { "∞".into() };
                let _ = write!(table, " {:.2} / {:.2} ({ratio}) |", mib(want), mib(got));
            }
            let (margin, temp) = (predicted(pred, "temporaries"), measured(meas, "temporaries"));
            let _ = writeln!(table, " {:.2} / {:.0} |", mib(temp), mib(margin));
            if temp > margin {
                failures.push(format!("{} rank {rank}: a transient of {:.2} MiB exceeds the plan's margin and recompute working set {:.0} MiB", case.name, mib(temp), mib(margin)));
            }
        }
        for (i, p) in PARTS.iter().enumerate() {
            let listed = KNOWN_GAPS.iter().any(|g| g.case == case.name && g.part == *p);
            if let Some(&(.., loose, _)) = UNSTEADY.iter().find(|&&(c, part, ..)| c == case.name && part == *p) {
                if !loosely[i] {
                    failures.push(format!("{} {p}: outside even its unsteady bound of {:.0} % on some rank", case.name, loose.unwrap_or(0.0) * 100.0));
                }
                continue;
            }
            if !within[i] {
                let _ = writeln!(outside, "    Gap {{ case: \"{}\", part: \"{p}\", cause: \"\" }},", case.name);
            }
            match (within[i], listed) {
                (false, false) => failures.push(format!("{} {p}: outside {:.0} % on some rank and not a known gap", case.name, BOUND * 100.0)),
                (true, true) => failures.push(format!("{} {p}: listed as a known gap but now within {:.0} %: remove it from KNOWN_GAPS", case.name, BOUND * 100.0)),
                _ => {}
            }
        }
    }
    eprintln!("memory: predicted / measured MiB (ratio)\n{table}\nparts outside {:.0} % on some rank:\n{outside}", BOUND * 100.0);
    for g in KNOWN_GAPS {
        eprintln!("known gap: {} {}: {}", g.case, g.part, g.cause);
    }
    // recompute exists to hold less: a recomputed layer's backward must not outgrow what keeping
    // every activation holds (a mask made a gradient leaf once sent recomputed attention down its
    // math path, which keeps the s × s probabilities: full recompute peaked above none)
    // (and under ZB-H1, whose W once kept each recomputed layer's rebuilt activations from its
    // B: full recompute then peaked above none)
    for (lighter, heavier) in [("dp2-recompute-selective", "dp2-recompute-none"), ("dp2-recompute-full", "dp2-recompute-none"), ("pp2-zb-h1-full", "pp2-zb-h1"), ("cp2-full", "cp2"), ("cp2-selective", "cp2"), ("mixtral-dp2-ep2-modules", "mixtral-dp2-ep2")] {
        let (got, none) = (peaks[lighter], peaks[heavier]);
        if got >= none {
            failures.push(format!("{lighter}: its peak {:.2} MiB is not below {heavier}'s {:.2} MiB", mib(got), mib(none)));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
