//! `smp-partition graph`: the table, the JSON contract and exit codes.

use std::process::{Command, Output};

fn smp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn json_is_one_object_with_the_contract_fields() {
    let o = smp(&["graph", "models/gpt2.onnx", "--seq-len", "32", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("stdout is one JSON object");
    assert_eq!(v["params"].as_u64(), Some(224_648));
    assert!(v["flops_per_sample"].as_f64().unwrap() > 0.0);
    assert!(v["nodes"].as_u64().unwrap() > 0);
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 6);
    for l in layers {
        for key in ["name", "kind", "nodes", "params", "flops", "activation_bytes", "signature"] {
            assert!(!l[key].is_null(), "layer lacks {key}: {l}");
        }
    }
    let sum: u64 = layers.iter().map(|l| l["params"].as_u64().unwrap()).sum();
    // every float initializer element, less the 5 scalar constants of the GELU chains analysis
    // fuses into `Gelu` and the attention scale (one constant, 0.25, for the 4 blocks) it
    // fuses into `ScaledDotProductAttention`'s attribute, which no layer reads any more
    assert_eq!(sum, 224_648 - 5 - 1);
    let blocks: Vec<_> = layers.iter().filter(|l| l["kind"] == "block").collect();
    assert_eq!(blocks.len(), 4);
    assert!(blocks.iter().all(|b| b["signature"] == blocks[0]["signature"]));
}

#[test]
fn table_names_its_unit_and_the_repeated_blocks() {
    let o = smp(&["graph", "models/gpt2.onnx", "--seq-len", "32", "--global-batch", "8"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("per global batch of 8"), "{out}");
    assert!(out.contains("repeated blocks: 4 ×"), "{out}");
    let per_sample = stdout(&smp(&["graph", "models/gpt2.onnx", "--dim", "seq=32"]));
    assert!(per_sample.contains("per sample"), "{per_sample}");
}

#[test]
fn global_batch_scales_json_flops() {
    let o = smp(&["graph", "models/gpt2.onnx", "--seq-len", "32", "--global-batch", "8", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let per = v["flops_per_sample"].as_f64().unwrap();
    assert_eq!(v["flops_per_batch"].as_f64().unwrap(), per * 8.0);
}

#[test]
fn user_errors_exit_1_naming_the_cause() {
    let o = smp(&["graph", "models/gpt2.onnx"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--seq-len"), "{}", stderr(&o));

    let o = smp(&["graph", "models/vit.onnx", "--seq-len", "64"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("fixed at 3"), "{}", stderr(&o));

    let o = smp(&["graph", "models/does-not-exist.onnx"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("does-not-exist.onnx"), "{}", stderr(&o));

    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.onnx");
    std::fs::write(&junk, b"\xff\xfe not a model at all \x00\x01").unwrap();
    let o = smp(&["graph", junk.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("junk.onnx"), "{}", stderr(&o));
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(smp(&["graph"]).status.code(), Some(2));
    assert_eq!(smp(&["graph", "models/gpt2.onnx", "--dim", "seq"]).status.code(), Some(2));
    assert_eq!(smp(&["graph", "models/gpt2.onnx", "--bogus"]).status.code(), Some(2));
}
