//! `smp-partition MODEL --estimate`: one configuration priced without searching others. The
//! oracle is the planner itself: the configuration a full plan chooses, given back to
//! `--estimate`, is priced at the plan's own step time and memory.

use std::process::{Command, Output};

const MODEL: &str = "models/gpt2.onnx";
const BASE: [&str; 8] = [MODEL, "--cluster", "tests/data/cpu.toml:4", "--seq-len", "64", "--global-batch", "8", "--estimate"];

fn smp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap()
}

fn ok(args: &[&str]) -> String {
    let o = smp(args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn estimate(extra: &[&str]) -> Output {
    let mut args = BASE.to_vec();
    args.extend_from_slice(extra);
    smp(&args)
}

fn estimate_json(extra: &[&str]) -> serde_json::Value {
    let mut args = BASE.to_vec();
    args.extend_from_slice(extra);
    args.push("--json");
    serde_json::from_str(&ok(&args)).expect("--estimate --json prints one JSON object")
}

/// The flags that pin the configuration `plan` chose.
fn flags_of(plan: &serde_json::Value) -> Vec<String> {
    let p = &plan["parallel"];
    let n = |k: &str| p[k].as_u64().unwrap().to_string();
    let mut f: Vec<String> = Vec::new();
    for k in ["pp", "tp", "dp", "cp", "ep", "zero", "microbatches"] {
        f.extend([format!("--{k}"), n(k)]);
    }
    let schedule = p["schedule"].as_str().unwrap();
    let schedule = if schedule == "interleaved" { format!("interleaved:{}", n("virtual_stages")) } else { schedule.to_string() };
    f.extend(["--schedule".into(), schedule]);
    f.extend(["--placement".into(), p["placement"].as_str().unwrap().to_string()]);
    f.extend(["--precision".into(), p["precision"].as_str().unwrap().to_string()]);
    f.push(if p["sequence_parallel"].as_bool().unwrap_or(false) { "--sequence-parallel" } else { "--no-sequence-parallel" }.into());
    let stages = plan["stages"].as_array().unwrap();
    let layers: Vec<String> = stages.iter().map(|s| format!("{}-{}", s["layers"][0], s["layers"][1])).collect();
    f.extend(["--layout".into(), layers.join("|")]);
    let recomputed: Vec<String> =
        stages.iter().flat_map(|s| s["checkpointed_layers"].as_array().unwrap().iter().map(|l| l.to_string())).collect();
    f.extend(["--recompute-layers".into(), if recomputed.is_empty() { "none".into() } else { recomputed.join(",") }]);
    let selective: Vec<String> =
        stages.iter().flat_map(|s| s.get("selective_layers").and_then(|l| l.as_array()).into_iter().flatten().map(|l| l.to_string())).collect();
    if !selective.is_empty() {
        f.extend(["--selective-layers".into(), selective.join(",")]);
    }
    let offloads = stages.iter().any(|s| s.get("offloaded_layers").is_some_and(|l| !l.as_array().unwrap().is_empty()));
    f.extend(["--offload-activations".into(), if offloads { "on" } else { "off" }.into()]);
    f
}

#[test]
fn the_estimate_of_a_planned_configuration_is_the_plans_prediction() {
    // roomy; and tight enough that the planner picks ZeRO 2 and recomputes layers
    for (seq, batch, limit) in [("64", "8", "4"), ("256", "32", "0.27")] {
        let common = [MODEL, "--cluster", "tests/data/cpu.toml:4", "--seq-len", seq, "--global-batch", batch, "--memory-limit", limit, "--json"];
        let plan: serde_json::Value = serde_json::from_str(&ok(&common)).unwrap();
        let flags = flags_of(&plan);
        let mut args = common.to_vec();
        args.push("--estimate");
        args.extend(flags.iter().map(String::as_str));
        let e: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
        let (planned, estimated) = (plan["predicted"]["step_time_s"].as_f64().unwrap(), e["step_time_s"].as_f64().unwrap());
        assert!((planned - estimated).abs() <= 1e-9 * planned, "limit {limit}: step {estimated} s estimated, {planned} s planned ({flags:?})");
        // the plan records its offloading rule (`auto`), the estimate what it pins (`off`/`on`)
        let rule = |v: &serde_json::Value| {
            let mut p = v["parallel"].clone();
            p.as_object_mut().unwrap().remove("offload_activations");
            p
        };
        assert_eq!(rule(&e), rule(&plan), "limit {limit}");
        let pp = plan["parallel"]["pp"].as_u64().unwrap() as usize;
        let ranks = e["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), pp);
        for r in ranks {
            let rank = r["pp_rank"].as_u64().unwrap();
            let mut want = [0u64; 5];
            for s in plan["stages"].as_array().unwrap().iter().filter(|s| s["pp_rank"].as_u64() == Some(rank)) {
                for (i, k) in ["params", "grads", "optimizer", "activations", "total"].iter().enumerate() {
                    want[i] += s["memory_bytes"][k].as_u64().unwrap();
                }
            }
            let m = &r["memory"];
            let got = ["params", "grads", "optimizer", "activations", "total"].map(|k| m[k].as_u64().unwrap());
            assert_eq!(got, want, "limit {limit}, pp rank {rank}: memory by part");
        }
        assert_eq!(e["fits"], true, "limit {limit}: the planner's own choice fits");
    }
}

#[test]
fn the_table_says_whether_it_fits() {
    let table = ok(&[&BASE[..], &["--pp", "2", "--microbatches", "2", "--memory-limit", "4"]].concat());
    insta::assert_snapshot!(table);
    // Over the capacity: priced all the same, and by how much it is over.
    let e = estimate_json(&["--tp", "2", "--memory-limit", "0.1"]);
    assert_eq!(e["fits"], false);
    let fullest = e["ranks"].as_array().unwrap().iter().map(|r| r["memory"]["total"].as_u64().unwrap()).max().unwrap();
    assert_eq!(e["over_by_bytes"].as_u64().unwrap(), fullest - (0.1 * (1u64 << 30) as f64) as u64);
    assert!(e["table"].as_str().unwrap().contains("does not fit by"), "{}", e["table"]);
    // Defaults: dp takes the devices left, no pipeline, no recompute.
    assert_eq!((e["parallel"]["dp"].as_u64(), e["parallel"]["pp"].as_u64(), e["parallel"]["checkpointing"].as_str()), (Some(2), Some(1), Some("none")));
}

#[test]
fn configurations_that_cannot_be_expressed_name_the_setting_and_the_fix() {
    let cases: [(&[&str], &[&str]); 6] = [
        (&["--pp", "2"], &["--pp 2", "--microbatches"]),
        (&["--pp", "2", "--tp", "2", "--dp", "2"], &["--pp 2", "--dp 2", "the degrees need 8 devices"]),
        (&["--pp", "2", "--dp", "1", "--microbatches", "2"], &["--dp 1", "must equal the device count"]),
        (&["--tp", "3"], &["--cluster", "3 does not divide the 4 devices"]),
        (&["--checkpointing", "auto"], &["--checkpointing auto", "--recompute-layers"]),
        (&["--microbatches", "4"], &["--microbatches 4", "2 samples per data-parallel replica", "divide"]),
    ];
    for (extra, needles) in cases {
        let o = estimate(extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "{extra:?}: `{n}` missing from: {err}");
        }
    }
    // A tensor degree that splits none of gpt2's heads (4) is planned, its layers kept whole,
    // and the estimate prices that same plan rather than refusing what planning accepts.
    let common = [MODEL, "--cluster", "tests/data/cpu.toml:3", "--seq-len", "64", "--global-batch", "6", "--tp", "3", "--json"];
    let plan: serde_json::Value = serde_json::from_str(&ok(&common)).unwrap();
    let flags = flags_of(&plan);
    let mut args = vec![MODEL, "--cluster", "tests/data/cpu.toml:3", "--seq-len", "64", "--global-batch", "6", "--json", "--estimate"];
    args.extend(flags.iter().map(String::as_str));
    let e: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
    let (planned, estimated) = (plan["predicted"]["step_time_s"].as_f64().unwrap(), e["step_time_s"].as_f64().unwrap());
    assert!((planned - estimated).abs() <= 1e-9 * planned, "--tp 3: step {estimated} s estimated, {planned} s planned");
    assert_eq!(e["parallel"]["tp"], 3);
}
