//! The `smp-partition` binary: exit codes (0, 1 user error, 2 usage) and `--json` output.

use std::process::{Command, Output};

mod common;

fn smp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(args).output().unwrap()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &[][..],
        &["m.onnx", "--schedule", "round-robin"],
        &["m.onnx", "--zero", "4"],
        &["m.onnx", "--placement", "DDT"],
        &["m.onnx", "--layout", "0-3|5-7"],
        &["m.onnx", "--dim", "batch"],
        &["m.onnx", "--precision", "fp8"],
        &["m.onnx", "--offload-activations", "maybe"],
        &["m.onnx", "--no-such-flag"],
        &["inspect"],
    ] {
        let o = smp(args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(o.stdout.is_empty(), "{args:?}");
    }
    assert_eq!(code(&smp(&["--help"])), 0);
}

#[test]
fn user_errors_exit_1_naming_the_cause() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("smp.json");
    std::fs::write(&cfg, r#"{"partitions": 2, "colour": "red"}"#).unwrap();
    let cfg = cfg.to_str().unwrap();
    let half = dir.path().join("half.json");
    std::fs::write(&half, r#"{"fp16": true}"#).unwrap();
    let half = half.to_str().unwrap();
    let offload = dir.path().join("offload.json");
    std::fs::write(&offload, r#"{"offload_activations": true}"#).unwrap();
    let offload = offload.to_str().unwrap();
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["m.onnx", "--sharded-dp", "2", "--zero", "1"], vec!["--sharded-dp 2", "--zero 1"]),
        (vec!["m.onnx", "--layout", "0-3|4-7", "--pp", "3"], vec!["--layout", "--pp 3"]),
        (vec!["m.onnx", "--config", cfg], vec!["smp.json", "colour"]),
        (vec!["m.onnx", "--config", "/nonexistent/smp.json"], vec!["/nonexistent/smp.json"]),
        (vec!["m.onnx", "--precision", "bf16-mixed", "--config", half], vec!["--precision bf16-mixed", "\"fp16\": true", "half.json"]),
        (
            vec!["m.onnx", "--offload-activations", "on", "--checkpointing", "none"],
            vec!["--offload-activations on", "--checkpointing none"],
        ),
        (
            vec!["m.onnx", "--offload-activations", "off", "--config", offload],
            vec!["--offload-activations off", "\"offload_activations\": true", "offload.json"],
        ),
        (vec!["/nonexistent/m.onnx", "--json"], vec!["/nonexistent/m.onnx"]),
        (vec!["inspect", "/nonexistent/plan.json"], vec!["/nonexistent/plan.json"]),
    ];
    for (args, needles) in cases {
        let o = smp(&args);
        assert_eq!(code(&o), 1, "{args:?}: {}", stderr(&o));
        assert!(o.stdout.is_empty(), "{args:?}");
        let e = stderr(&o);
        for n in needles {
            assert!(e.contains(n), "{args:?}: `{n}` not in {e}");
        }
    }
}

#[test]
fn inspect_refuses_newer_plans() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.json");
    let mut v = serde_json::to_value(common::fixture()).unwrap();
    v["version"] = 4.into();
    std::fs::write(&path, v.to_string()).unwrap();
    let o = smp(&["inspect", path.to_str().unwrap()]);
    assert_eq!(code(&o), 1);
    let e = stderr(&o);
    assert!(e.contains("plan.json") && e.contains("version 4") && e.contains("version 3"), "{e}");
}

#[test]
fn inspect_refuses_version_1_plans_with_the_replan_message() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.json");
    let mut v = serde_json::to_value(common::fixture()).unwrap();
    v["version"] = 1.into();
    v["parallel"].as_object_mut().unwrap().remove("precision");
    std::fs::write(&path, v.to_string()).unwrap();
    let o = smp(&["inspect", path.to_str().unwrap()]);
    assert_eq!(code(&o), 1);
    let e = stderr(&o);
    assert!(e.contains("old.json") && e.contains("version 1") && e.contains("re-plan"), "{e}");
}

#[test]
fn inspect_json_is_one_object() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.json");
    smp_partition::plan::save(&common::fixture(), &path).unwrap();
    let o = smp(&["inspect", path.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON value");
    assert!(v.is_object());
    assert_eq!(v["stages"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["inspect"]["bottleneck"]["stages"], serde_json::json!([1]));

    let o = smp(&["inspect", path.to_str().unwrap()]);
    assert_eq!(code(&o), 0);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("bottleneck  stage 1"), "{text}");
}
