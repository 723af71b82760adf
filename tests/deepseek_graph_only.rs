//! The graph-only DeepSeek-V3 (`scripts/make_graph_only.py`: 61 layers, hidden 7168, 128
//! heads of multi-head latent attention, the first 3 MLPs dense, then 256 routed experts top 8
//! beside one shared expert; 671.03B parameters) planned on 256 H100s: the solver proves its
//! plan optimal and `inspect` names the expert-parallel choice and, per layer, the attention
//! and expert choices (snapshots of its `choices` lines). Under Megatron's tensor split
//! the latent attention splits by heads: the up-projections `q_b_proj` and `kv_b_proj` by
//! columns, the attention core by heads (the rotary key, one head expanded over all of them,
//! expanded over each rank's heads only), `o_proj` by rows, and the low-rank down-projections
//! `q_a_proj` and `kv_a_proj_with_mqa` whole.

use std::path::Path;
use std::process::{Command, Output};

fn smp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(args).output().unwrap()
}

fn model() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/deepseek-v3.onnx").display().to_string()
}

fn plan_json(args: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let m = model();
    let mut all = vec![m.as_str(), "-o", out.to_str().unwrap()];
    all.extend_from_slice(args);
    let o = smp(&all);
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let i = smp(&["inspect", out.to_str().unwrap()]);
    assert_eq!(i.status.code(), Some(0));
    serde_json::json!({ "plan": plan, "inspect": String::from_utf8_lossy(&i.stdout) })
}

#[test]
fn deepseek_v3_on_256_h100s_is_planned_optimal_with_its_experts_split() {
    let r = plan_json(&["--cluster", "h100-80gb:256", "--global-batch", "1024"]);
    let (plan, text) = (&r["plan"], r["inspect"].as_str().unwrap());
    assert_eq!(plan["solver"]["status"].as_str(), Some("optimal"), "{}", plan["solver"]);
    let ep = plan["parallel"]["ep"].as_u64().unwrap();
    assert!(ep > 1, "{}", plan["parallel"]);
    // every MoE layer's routed experts are one fused op
    let fused = plan["codegen"]["fused"].as_array().unwrap();
    let moe = fused.iter().filter(|f| f["op"].get("mixture_of_experts").is_some()).count();
    assert_eq!(moe, 58, "{fused:?}");
    assert!(text.contains("671.03B params, 63 layers"), "{text}");
    assert!(text.contains(&format!("experts e = {ep}:")) && text.contains("optimal:"), "{text}");
    // the model state reported is the fullest rank's, and at e = 1 it would not fit the device
    let state = |s: &serde_json::Value| ["params", "grads", "optimizer"].iter().map(|k| s["memory_bytes"][k].as_u64().unwrap()).sum::<u64>();
    let fullest = plan["stages"].as_array().unwrap().iter().map(state).max().unwrap();
    let axes = &plan["axes"];
    assert_eq!(axes["state_bytes"].as_u64(), Some(fullest), "{axes}");
    assert!(axes["state_bytes_without_ep"].as_u64().unwrap() > plan["cluster"]["memory_limit_bytes"].as_u64().unwrap(), "{axes}");
    insta::assert_snapshot!("deepseek_v3_h100x256_choices", choices(text));
}

/// `inspect`'s per-layer lines naming the attention and expert choices.
fn choices(text: &str) -> String {
    text.lines().filter(|l| l.starts_with("choices ")).collect::<Vec<_>>().join("\n")
}

#[test]
fn deepseek_v3_latent_attention_splits_by_heads_under_megatron_tp() {
    // Megatron-LM's equal blocks per stage: one block per stage
    let r = plan_json(&["--cluster", "h100-80gb:488", "--global-batch", "61", "--baseline", "megatron", "--tp", "8", "--pp", "61", "--dp", "1"]);
    let plan = &r["plan"];
    let mut blocks = 0;
    for l in plan["layer_strategies"].as_array().unwrap() {
        let nodes = l["nodes"].as_array().unwrap();
        if !l["name"].as_str().unwrap().starts_with("layers.") {
            continue;
        }
        blocks += 1;
        // the matmuls of the attention, in order: q_a, q_b, kv_a, kv_b, scores, context, o
        let att: Vec<String> = nodes
            .iter()
            .filter(|n| n[0].as_str().unwrap().contains("self_attn") && n[0].as_str().unwrap().contains("MatMul"))
            .map(|n| n[1].as_str().unwrap().to_string())
            .collect();
        assert_eq!(att, ["replicate", "column", "replicate", "column", "heads", "heads", "row"], "{}: {nodes:?}", l["name"]);
    }
    assert_eq!(blocks, 61);
    insta::assert_snapshot!("deepseek_v3_megatron_tp8_choices", choices(r["inspect"].as_str().unwrap()));
}
