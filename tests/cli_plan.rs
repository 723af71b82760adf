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
    v["version"] = 5.into();
    std::fs::write(&path, v.to_string()).unwrap();
    let o = smp(&["inspect", path.to_str().unwrap()]);
    assert_eq!(code(&o), 1);
    let e = stderr(&o);
    assert!(e.contains("plan.json") && e.contains("version 5") && e.contains("version 4"), "{e}");
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

/// A tiny CNN with one BatchNormalization (`bn`): `x` [8, 3, 4, 4] → 1×1 Conv → BatchNorm →
/// Relu → GlobalAveragePool → Flatten → MatMul → `y` [8, 5].
fn batchnorm_model(dir: &std::path::Path) -> std::path::PathBuf {
    use prost::Message;
    use smp_partition::frontend::onnx::proto::{
        GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
        tensor_shape_proto, type_proto,
    };
    let info = |name: &str, dims: &[i64]| ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(1),
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| tensor_shape_proto::Dimension { value: Some(tensor_shape_proto::dimension::Value::DimValue(d)), ..Default::default() })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let node = |op: &str, name: &str, inputs: &[&str], output: &str| NodeProto {
        op_type: Some(op.into()),
        name: Some(name.into()),
        input: inputs.iter().map(|s| (*s).into()).collect(),
        output: vec![output.into()],
        ..Default::default()
    };
    // varied values (1.0 for the variance), so no initializer looks like another
    let init = |name: &str, dims: &[i64], one: bool| {
        let n: i64 = dims.iter().product();
        let raw: Vec<u8> = (0..n).flat_map(|i| if one { 1.0f32 } else { 0.1 + 0.01 * i as f32 }.to_le_bytes()).collect();
        TensorProto { name: Some(name.into()), data_type: Some(1), dims: dims.to_vec(), raw_data: Some(raw.into()), ..Default::default() }
    };
    let model = ModelProto {
        ir_version: Some(10),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(18) }],
        graph: Some(GraphProto {
            name: Some("cnn".into()),
            node: vec![
                node("Conv", "conv", &["x", "w"], "c"),
                node("BatchNormalization", "bn", &["c", "gamma", "beta", "mean", "var"], "n"),
                node("Relu", "relu", &["n"], "r"),
                node("GlobalAveragePool", "pool", &["r"], "p"),
                node("Flatten", "flatten", &["p"], "f"),
                node("MatMul", "head", &["f", "w2"], "y"),
            ],
            initializer: vec![
                init("w", &[4, 3, 1, 1], false),
                init("gamma", &[4], false),
                init("beta", &[4], false),
                init("mean", &[4], false),
                init("var", &[4], true),
                init("w2", &[4, 5], false),
            ],
            input: vec![info("x", &[8, 3, 4, 4])],
            output: vec![info("y", &[8, 5])],
            ..Default::default()
        }),
        ..Default::default()
    };
    let path = dir.join("cnn.onnx");
    std::fs::write(&path, model.encode_to_vec()).unwrap();
    path
}

#[test]
fn batchnorm_statistics_per_microbatch_are_recorded_and_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let model = batchnorm_model(dir.path());
    let cpu1 = common::cluster_arg("cpu:1");
    let plan = |microbatches: &str| {
        let args = [model.to_str().unwrap(), "--cluster", &cpu1, "--global-batch", "8", "--microbatches", microbatches, "--json"];
        let o = smp(&args);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON value");
        (v, stderr(&o))
    };
    // 4 microbatches of 2 samples: recorded, and a warning naming the node and the fix
    let (v, err) = plan("4");
    assert_eq!(v["batch_statistics"], serde_json::json!({"nodes": ["bn"], "samples": 2}));
    for needle in ["warning: BatchNorm statistics are per microbatch", "(`bn`)", "each microbatch of 2 samples", "global batch 8 = 4 microbatches of 2", "--microbatches 1"] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    // one microbatch: statistics over the whole batch, as PyTorch's; recorded, no warning
    let (v, err) = plan("1");
    assert_eq!(v["batch_statistics"], serde_json::json!({"nodes": ["bn"], "samples": 8}));
    assert!(!err.contains("BatchNorm"), "{err}");
    // the report says it too
    let path = dir.path().join("plan.json");
    let o = smp(&[model.to_str().unwrap(), "--cluster", &cpu1, "--global-batch", "8", "--microbatches", "2", "-o", path.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = smp(&["inspect", path.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("batchnorm 1 BatchNormalization node(s) normalise by the statistics of each microbatch of 4 samples"), "{text}");
}

/// `--cp`, `--ep` and `--expert-imbalance` reach the planner: a forced `--cp 1` that cannot
/// fit names the least context degree that does, `--ep` on a dense model is refused by name,
/// an imbalance below 1 is refused, and `--cp 2 --ep 4` plan what they force.
#[test]
fn context_and_expert_flags_reach_the_planner() {
    let root = env!("CARGO_MANIFEST_DIR");
    let llama = format!("{root}/models/llama3-70b-128k.onnx");
    let o = smp(&[&llama, "--cluster", "h100-80gb:64", "--global-batch", "8", "--seq-len", "131072", "--cp", "1", "--memory-limit", "32", "--offload-activations", "off"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    // which degree is the least that fits is held by plan_axes; here, that one is named
    let named = stderr(&o).split("; --cp ").nth(1).and_then(|t| t.split_whitespace().next()).and_then(|c| c.parse::<usize>().ok());
    assert!(named.is_some_and(|c| c > 1) && stderr(&o).contains("fits (the least context degree that does"), "{}", stderr(&o));
    let dense = format!("{root}/models/llama3-8b.onnx");
    let o = smp(&[&dense, "--cluster", "h100-80gb:64", "--global-batch", "512", "--ep", "2"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("--ep 2: the model has no mixture-of-experts layer"), "{}", stderr(&o));
    let mixtral = format!("{root}/models/mixtral-8x7b.onnx");
    let o = smp(&[&mixtral, "--cluster", "h100-80gb:32", "--global-batch", "128", "--expert-imbalance", "0.9"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("--expert-imbalance 0.9"), "{}", stderr(&o));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.json");
    let o = smp(&[&mixtral, "--cluster", "h100-80gb:32", "--global-batch", "128", "--cp", "2", "--ep", "4", "-o", out.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!((plan["parallel"]["cp"].as_u64(), plan["parallel"]["ep"].as_u64()), (Some(2), Some(4)));
    let o = smp(&["inspect", out.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("cp 2") && text.contains("ep 4") && text.contains("experts e = 4:"), "{text}");
    // combined 1F1B: priced and reported where the schedule merges passes, else said to do nothing
    let o = smp(&[&mixtral, "--cluster", "h100-80gb:32", "--global-batch", "128", "--pp", "2", "--ep", "4", "--microbatches", "4", "--schedule", "interleaved:2", "--overlap-expert-comm"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("(expert all-to-alls overlapped: combined 1F1B)") && text.contains("of it beside another microbatch's compute"), "{text}");
    let o = smp(&[&mixtral, "--cluster", "h100-80gb:32", "--global-batch", "128", "--pp", "2", "--ep", "4", "--schedule", "1f1b", "--overlap-expert-comm"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("warning: --overlap-expert-comm had no effect"), "{}", stderr(&o));
    let o = smp(&[&dense, "--cluster", "h100-80gb:64", "--global-batch", "512", "--overlap-expert-comm"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("--overlap-expert-comm: the model has no mixture-of-experts layer"), "{}", stderr(&o));
}

/// `--etp` (Megatron-Core's expert-tensor-parallel size) folds the expert group over tensor ×
/// data ranks: ep 4 over tp 2 × dp 2 is refused without it (naming `--etp 1` as the fix) and
/// planned with it; an expert-tensor degree not dividing tp is refused; and the folded plan
/// holds each expert on etp · ep = 4 ranks, so its stages' model state equals the unfolded
/// ep 2 (experts split over tp 2) plan's, byte for byte.
#[test]
fn expert_tensor_flag_folds_expert_groups_over_tensor_and_data_ranks() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mixtral = format!("{root}/models/mixtral-8x7b.onnx");
    let dir = tempfile::tempdir().unwrap();
    let base = ["--cluster", "h100-80gb:32", "--global-batch", "128", "--pp", "8", "--tp", "2", "--dp", "2", "--microbatches", "16", "--baseline", "megatron"];
    let run = |extra: &[&str]| {
        let mut args = vec![mixtral.as_str()];
        args.extend(base);
        args.extend(extra);
        smp(&args)
    };
    let o = run(&["--ep", "4"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("must divide the data-parallel degree 2") && stderr(&o).contains("--etp 1"), "{}", stderr(&o));
    let o = run(&["--ep", "4", "--etp", "3"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("`--etp 3` conflicts with `--tp 2`"), "{}", stderr(&o));
    let plan_of = |extra: &[&str], name: &str| -> serde_json::Value {
        let out = dir.path().join(name);
        let mut args = extra.to_vec();
        args.extend(["-o", out.to_str().unwrap()]);
        let o = run(&args);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
    };
    let folded = plan_of(&["--ep", "4", "--etp", "1"], "folded.json");
    let unfolded = plan_of(&["--ep", "2"], "unfolded.json");
    assert_eq!((folded["parallel"]["ep"].as_u64(), folded["parallel"]["etp"].as_u64()), (Some(4), Some(1)));
    assert_eq!((folded["request"]["etp"].as_u64(), unfolded["parallel"].get("etp")), (Some(1), None));
    for s in 0..8 {
        for part in ["params", "grads", "optimizer"] {
            assert_eq!(folded["stages"][s]["memory_bytes"][part], unfolded["stages"][s]["memory_bytes"][part], "stage {s} {part}");
        }
    }
    let o = smp(&["inspect", dir.path().join("folded.json").to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("ep 4 · etp 1 over tp × dp") && text.contains("ep 4 folded over tensor × data ranks (expert-tensor 1"), "{text}");
    // written as Megatron-LM arguments and read back: the same folded degrees
    let emitted = dir.path().join("emitted");
    let o = smp(&["emit", dir.path().join("folded.json").to_str().unwrap(), "--engine", "megatron", "-o", emitted.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let args = std::fs::read_to_string(emitted.join("megatron.args")).unwrap();
    assert!(args.contains("--expert-model-parallel-size 4") && args.contains("--expert-tensor-parallel-size 1"), "{args}");
    let back = dir.path().join("back.json");
    let from = format!("megatron:{}", emitted.join("megatron.args").display());
    let o = smp(&[&mixtral, "--cluster", "h100-80gb:32", "--from-engine", &from, "-o", back.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&back).unwrap()).unwrap();
    assert_eq!((back["parallel"]["tp"].as_u64(), back["parallel"]["ep"].as_u64(), back["parallel"]["etp"].as_u64()), (Some(2), Some(4), Some(1)));
}

/// The plan file of `args` planned on `threads` threads, without its planning time.
fn plan_on_threads(args: &[&str], threads: &str, out: &std::path::Path) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args(args)
        .args(["-o", out.to_str().unwrap()])
        .env("SMP_PLANNER_THREADS", threads)
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{args:?} on {threads} threads: {}", stderr(&o));
    let mut plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    plan["solver"].as_object_mut().unwrap().remove("wall_s");
    plan
}

/// The intra-layer ILPs, the candidates' bounds and the layers' shards run on every core:
/// the plan is the same on one thread as on several.
#[test]
fn plans_do_not_depend_on_the_thread_count() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = tempfile::tempdir().unwrap();
    let gpt2 = format!("{root}/models/gpt2.onnx");
    let llama = format!("{root}/models/llama3-8b.onnx");
    for args in [
        vec![gpt2.as_str(), "--cluster", "a100-80gb:64", "--global-batch", "512", "--seq-len", "1024"],
        vec![llama.as_str(), "--cluster", "h100-80gb:32", "--global-batch", "256", "--seq-len", "8192"],
    ] {
        let one = plan_on_threads(&args, "1", &dir.path().join("one.json"));
        let three = plan_on_threads(&args, "3", &dir.path().join("three.json"));
        assert!(one == three, "{args:?}: the plans differ between 1 and 3 threads");
        assert!(one["solver"]["candidates"]["skipped"].as_u64().unwrap() > 100, "{args:?}: a search worth spreading");
    }
}

/// Under `--optimize memory` the solver line's objective and bound are the peak memory it
/// minimised, printed as bytes (they were printed as seconds), equal to the plan's predicted peak.
#[test]
fn the_memory_objective_prints_as_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let gpt2 = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2.onnx");
    let o = smp(&[gpt2, "--cluster", "a100-80gb:8", "--seq-len", "1024", "--global-batch", "64", "--optimize", "memory", "-o", out.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    let solver = text.lines().find(|l| l.starts_with("solver")).unwrap_or_else(|| panic!("no solver line: {text}"));
    let peak = text.lines().find(|l| l.starts_with("predicted")).and_then(|l| l.split("peak memory ").nth(1)).and_then(|r| r.split(',').next()).unwrap_or_else(|| panic!("no peak: {text}"));
    assert!(solver.contains(&format!("objective {peak},")), "{solver} / peak {peak}");
    assert!(peak.ends_with("iB"), "{peak}");
}

/// Under a memory limit that no layer keeping everything fits, `auto-selective` rebuilds
/// layers' norms and activation functions (selective recompute) before it recomputes whole
/// layers, which `auto` (whole layers or nothing) must: the same limit costs it more time. Fixing the
/// plan's choice layer by layer (`--recompute-layers`, `--selective-layers`) gives the same plan.
#[test]
fn auto_recomputes_norms_and_activations_before_whole_layers() {
    let dir = tempfile::tempdir().unwrap();
    let plan_with = |name: &str, extra: &[&str]| -> serde_json::Value {
        let out = dir.path().join(format!("{name}.json"));
        let mut args = vec!["models/llama.onnx", "--cluster", "cpu:2", "--seq-len", "512", "--global-batch", "4", "--microbatches", "2"];
        args.extend_from_slice(&["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "0", "-o", out.to_str().unwrap()]);
        args.extend_from_slice(extra);
        let o = smp(&args);
        assert_eq!(code(&o), 0, "{name}: {}", stderr(&o));
        serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap()
    };
    let total = |p: &serde_json::Value| p["stages"][0]["memory_bytes"]["total"].as_u64().unwrap();
    let layers = |p: &serde_json::Value, key: &str| -> Vec<u64> { p["stages"][0].get(key).and_then(|v| v.as_array()).map(|a| a.iter().map(|l| l.as_u64().unwrap()).collect()).unwrap_or_default() };
    let step = |p: &serde_json::Value| p["predicted"]["step_time_s"].as_f64().unwrap();
    let (none, selective) = (plan_with("none", &["--checkpointing", "none"]), plan_with("selective", &["--checkpointing", "selective"]));
    assert!(total(&selective) < total(&none) && step(&selective) > step(&none));
    // a limit between the two: selective fits, keeping everything does not
    let limit = format!("{}", (total(&none) + total(&selective)) as f64 / 2.0 / (1u64 << 30) as f64);
    let auto = plan_with("auto-selective", &["--checkpointing", "auto-selective", "--memory-limit", &limit]);
    let whole = plan_with("auto", &["--checkpointing", "auto", "--memory-limit", &limit]);
    assert!(!layers(&auto, "selective_layers").is_empty() && layers(&auto, "checkpointed_layers").is_empty(), "{}", auto["stages"][0]);
    assert!(!layers(&whole, "checkpointed_layers").is_empty() && layers(&whole, "selective_layers").is_empty(), "{}", whole["stages"][0]);
    assert!(step(&auto) < step(&whole), "auto {} s, layers {} s", step(&auto), step(&whole));
    let list = |v: Vec<u64>| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let fixed = plan_with("fixed", &["--recompute-layers", "none", "--selective-layers", &list(layers(&auto, "selective_layers")), "--memory-limit", &limit]);
    assert_eq!(layers(&fixed, "selective_layers"), layers(&auto, "selective_layers"));
    assert!((step(&fixed) - step(&auto)).abs() <= 1e-12 * step(&auto) && total(&fixed) == total(&auto));
    // under context parallelism too (each rank rebuilds its own tokens' outputs)
    let out = dir.path().join("cp.json");
    let o = smp(&["models/llama.onnx", "--cluster", "cpu:2", "--seq-len", "512", "--global-batch", "4", "--microbatches", "2", "--cp", "2", "--dp", "1", "--checkpointing", "selective", "-o", out.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "cp: {}", stderr(&o));
    let cp: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert!(layers(&cp, "selective_layers").len() >= 4 && layers(&cp, "checkpointed_layers").is_empty(), "{}", cp["stages"][0]);
    // under ZB-H1 the rebuilt outputs would wait for the W: refused, naming both settings
    let o = smp(&["models/llama.onnx", "--cluster", "cpu:2", "--pp", "2", "--schedule", "zb-h1", "--checkpointing", "selective"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("--checkpointing selective") && stderr(&o).contains("--schedule zb-h1"), "{}", stderr(&o));
    // a layer in both lists, or a list beside a rule, is refused naming the settings
    let o = smp(&["models/llama.onnx", "--cluster", "cpu:2", "--recompute-layers", "1,2", "--selective-layers", "2,3"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("layer 2 is both") && stderr(&o).contains("--selective-layers 2-3"), "{}", stderr(&o));
    // a selective policy where nothing is selective is refused, naming the fix
    let o = smp(&["models/llama.onnx", "--cluster", "cpu:2", "--selective-policy", "op"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("--selective-policy op") && stderr(&o).contains("--checkpointing selective"), "{}", stderr(&o));
}
