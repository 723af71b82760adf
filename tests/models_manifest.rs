//! models/manifest.json against the files it describes and against published model sizes
//! (Megatron-LM Table 1, GPT-3, Llama-3), so a stale or wrong manifest fails here.

use std::path::{Path, PathBuf};

use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn manifest() -> serde_json::Map<String, Value> {
    let path = repo().join("models/manifest.json");
    let text = std::fs::read_to_string(&path).unwrap();
    match serde_json::from_str(&text).unwrap() {
        Value::Object(map) => map,
        other => panic!("{}: not an object: {other}", path.display()),
    }
}

fn int(entry: &Value, key: &str) -> u64 {
    entry[key].as_u64().unwrap_or_else(|| panic!("missing integer {key} in {entry}"))
}

#[test]
fn every_entry_matches_its_file() {
    let models = manifest();
    assert!(models.len() >= 18, "expected 4 exports and 14 graph-only models");
    for (name, entry) in &models {
        let file = repo().join(entry["file"].as_str().unwrap());
        let size = std::fs::metadata(&file)
            .unwrap_or_else(|e| panic!("{name}: {}: {e}", file.display()))
            .len();
        assert_eq!(size, int(entry, "file_bytes"), "{name}: manifest is stale; run make models");
        // Qwen3-235B-A22B (94 MoE layers with per-head norms) is the largest, 2.8 MB.
        assert!(size < 3_000_000, "{name}: {size} bytes, models must stay small");
        if entry["graph_only"].as_bool().unwrap() {
            let weights = file.with_file_name(format!(
                "{}.weights",
                file.file_stem().unwrap().to_str().unwrap()
            ));
            assert!(!weights.exists(), "{name}: graph-only weights must never be written");
            // Trained parameters plus the constants (RoPE tables, scalars) are the float
            // initializers.
            assert_eq!(
                int(entry, "float_initializer_elements"),
                int(entry, "formula_params") + int(entry, "constant_float_elements"),
                "{name}"
            );
        } else {
            let reference = repo().join(entry["reference"].as_str().unwrap());
            assert!(Path::new(&reference).exists(), "{name}: {} missing", reference.display());
            // At HF's default init the exporter stores equal-valued parameters once; untied by
            // the parameter record, the file holds the module's parameters plus the exporter's
            // scalar constants (and Llama's inv_freq buffer).
            let floats = int(entry, "float_initializer_elements");
            let untied = int(entry, "untied_float_elements");
            let torch = int(entry, "torch_parameters");
            assert!(floats <= untied, "{name}: {floats} stored vs {untied} untied");
            assert!(untied >= torch && untied - torch < 64, "{name}: {untied} untied vs torch {torch}");
        }
    }
}

/// Megatron-LM's closed form 12·l·h²·(1 + 13/(12h) + (V+s)/(12lh)), plus the final norm.
fn megatron_params(layers: u64, hidden: u64, seq: u64, vocab: u64) -> u64 {
    12 * layers * hidden * hidden + 13 * layers * hidden + (vocab + seq) * hidden + 2 * hidden
}

#[test]
fn graph_only_sizes_match_published_figures() {
    let models = manifest();
    // (manifest key, published parameters in billions, decimals the publication gives)
    let published = [
        ("megatron/gpt-1.7B", 1.7, 1),
        ("megatron/gpt-3.6B", 3.6, 1),
        ("megatron/gpt-7.5B", 7.5, 1),
        ("megatron/gpt-18.4B", 18.4, 1),
        ("megatron/gpt-39.1B", 39.1, 1),
        ("megatron/gpt-76.1B", 76.1, 1),
        ("megatron/gpt-145.6B", 145.6, 1),
        ("megatron/gpt-310.1B", 310.1, 1),
        ("megatron/gpt-529.6B", 529.6, 1),
        ("megatron/gpt-1008B", 1008.0, 0),
        ("gpt3-175b", 175.0, 0),
        ("gpt-1t", 1008.0, 0),
        ("llama3-8b", 8.0, 0),
        ("llama3-70b", 70.6, 1),
        ("llama3-70b-8k", 70.6, 1),
        ("llama3-70b-128k", 70.6, 1),
        ("mixtral-8x7b", 46.7, 1),
        ("deepseek-v3", 671.0, 0),
        ("qwen3-235b-a22b", 235.0, 0),
    ];
    for (key, billions, decimals) in published {
        let entry = &models[key];
        let params = int(entry, "formula_params");
        let scale = 10f64.powi(decimals);
        let rounded = (params as f64 / 1e9 * scale).round() / scale;
        assert_eq!(rounded, billions, "{key}: {params} parameters");
        if entry["kind"] == "gpt" {
            let (l, h) = (int(entry, "layers"), int(entry, "hidden"));
            let expect = megatron_params(l, h, int(entry, "seq"), int(entry, "vocab"));
            assert_eq!(params, expect, "{key}");
        }
    }
}
