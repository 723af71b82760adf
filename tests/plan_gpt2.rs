//! Snapshots of the GPT-2 export's plan on `cpu:4` and of its inspect table, through the CLI.
//! Redacted: wall times and the model hash. The machine is the fixed one of
//! `tests/data/cpu.toml` (no host fact enters), the memory limit is given; HiGHS runs
//! single-threaded (the CLI's default), so ties resolve the same way.

use std::path::Path;
use std::process::{Command, Output};

const MODEL: &str = "models/gpt2.onnx";

fn smp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap()
}

fn plan_gpt2(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        MODEL,
        "--cluster",
        "tests/data/cpu.toml:4",
        "--seq-len",
        "64",
        "--global-batch",
        "8",
        "--memory-limit",
        "4",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = smp(&args);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("--json prints one JSON object");
    v["solver"]["wall_s"] = 0.0.into();
    v["model"]["sha256"] = "<sha256>".into();
    round_floats(&mut v);
    v
}

/// Ten significant digits, and gaps below 1e-9 as 0: HiGHS's bound moves in the last bits.
fn round_floats(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(0.0);
            let r = if x.abs() < 1e-9 { 0.0 } else { format!("{x:.9e}").parse::<f64>().unwrap_or(x) };
            *v = serde_json::json!(r);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(round_floats),
        serde_json::Value::Object(o) => o.values_mut().for_each(round_floats),
        _ => {}
    }
}

#[test]
fn gpt2_cpu4_plan_json() {
    if !Path::new(env!("CARGO_MANIFEST_DIR")).join(MODEL).exists() {
        panic!("{MODEL} is missing: run scripts/export_models.py");
    }
    let v = plan_gpt2(&[]);
    // The plan is valid by the library's own loader.
    smp_partition::plan::io::from_json(&v.to_string(), Path::new("stdout")).unwrap();
    insta::assert_json_snapshot!(v);
}

/// `inspect --dot` draws what the ranks run: under tensor and context parallelism, each stage's
/// subgraph with the collectives and token gathers codegen inserted.
#[test]
fn the_dot_view_draws_the_collectives_a_rank_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2-cp2-tp2.plan.json");
    let v = plan_gpt2(&["--cp", "2", "--tp", "2", "--pp", "1", "--dp", "1"]);
    std::fs::write(&path, v.to_string()).unwrap();
    let dot = dir.path().join("g.dot");
    let o = smp(&["inspect", path.to_str().unwrap(), "--dot", dot.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let dot = std::fs::read_to_string(dot).unwrap();
    assert!(dot.contains("TokenGather") && dot.contains("AllReduce"), "no context gather or tensor all-reduce drawn");
}

#[test]
fn gpt2_cpu4_inspect_table() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt2.plan.json");
    let v = plan_gpt2(&[]);
    std::fs::write(&path, v.to_string()).unwrap();
    let o = smp(&["inspect", path.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    insta::assert_snapshot!(String::from_utf8_lossy(&o.stdout));

    // --dot and --trace write what they claim.
    let dot = dir.path().join("g.dot");
    let trace = dir.path().join("t.json");
    let o = smp(&[
        "inspect",
        path.to_str().unwrap(),
        "--dot",
        dot.to_str().unwrap(),
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let dot = std::fs::read_to_string(dot).unwrap();
    let stages = v["stages"].as_array().unwrap().len();
    assert_eq!(dot.matches("subgraph cluster_stage").count(), stages);
    // every node of the graph the plan runs (rebuilt from the model as the runner does), once
    let plan = smp_partition::plan::io::load(&path).unwrap();
    let planned = smp_partition::load_planned(&plan, &path).unwrap();
    assert_eq!(dot.matches(" [label=").count(), planned.graph.node_ids().count());
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(trace).unwrap()).unwrap();
    assert!(trace["traceEvents"].as_array().is_some_and(|e| !e.is_empty()));
}

#[test]
fn manual_settings_are_honoured() {
    let v = plan_gpt2(&[
        "--pp",
        "2",
        "--tp",
        "1",
        "--microbatches",
        "4",
        "--schedule",
        "1f1b",
        "--layout",
        "0-2|3-5",
    ]);
    assert_eq!((v["parallel"]["pp"].as_u64(), v["parallel"]["dp"].as_u64()), (Some(2), Some(2)));
    assert_eq!(v["parallel"]["microbatches"], 4);
    assert_eq!(v["parallel"]["schedule"], "1f1b");
    assert_eq!(v["stages"][0]["layers"], serde_json::json!([0, 2]));
    assert_eq!(v["stages"][1]["layers"], serde_json::json!([3, 5]));
    // dp = 2 replicas of each stage: ranks per stage = tp·dp.
    assert_eq!(v["stages"][0]["ranks"].as_array().map(Vec::len), Some(2));
}

#[test]
fn smp_config_file_is_honoured() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("smp.json");
    std::fs::write(&cfg, r#"{"partitions": 2, "microbatches": 2, "pipeline": "simple", "ddp": true}"#)
        .unwrap();
    let v = plan_gpt2(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(v["parallel"]["pp"], 2);
    assert_eq!(v["parallel"]["microbatches"], 2);
    assert_eq!(v["parallel"]["schedule"], "gpipe");
}

#[test]
fn layout_not_covering_the_model_is_a_user_error() {
    let o = smp(&[MODEL, "--cluster", "tests/data/cpu.toml:4", "--seq-len", "64", "--layout", "0-1|2-3"]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("--layout 0-1|2-3") && e.contains("6 layers"), "{e}");
}
