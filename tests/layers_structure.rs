//! Graphs without module metadata are cut into layers from their structure: the onnx wheel's
//! `light_*` CNNs (opset 9, batch fixed at 1, no namespaces, no numbered names) each come out
//! as at least four layers of balanced forward FLOPs and pipeline over 2 and 4 stages.

mod common;

use std::path::PathBuf;

use common::machine::{CPU2, CPU4};
use smp_partition::compile;
use smp_partition::cost::ClusterSpec;
use smp_partition::ir::LayerKind;
use smp_partition::load_and_analyze;
use smp_partition::passes::AnalyzeOptions;
use smp_partition::solve::PlanOptions;

fn light_models() -> Vec<PathBuf> {
    let dir = match std::env::var_os("SMP_ONNX_DATA") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/lib/python3.11/site-packages/onnx/backend/test/data"),
    }
    .join("light");
    let mut models: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}; run `make venv` (or set SMP_ONNX_DATA)", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("light_") && n.ends_with(".onnx")))
        .collect();
    models.sort();
    assert!(models.len() >= 9, "expected the onnx wheel's light_* models in {}", dir.display());
    models
}

/// What the onnx package reports for each model (`scripts/onnx_model_stats.py`).
fn onnx_stats(models: &[PathBuf]) -> serde_json::Value {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo.join(".venv/bin/python"));
    let out = std::process::Command::new(&python)
        .arg(repo.join("scripts/onnx_model_stats.py"))
        .args(models)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}; run `make venv`", python.display()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The light models build their weights with `ConstantOfShape` instead of storing them: those
/// count as parameters, as many elements as onnx's shape inference gives them, plus the float
/// initializers (AlexNet is not a 0-parameter model).
#[test]
fn weights_built_by_constant_subgraphs_count_as_parameters() {
    let models = light_models();
    let oracle = onnx_stats(&models);
    for path in &models {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let model = load_and_analyze(path, &AnalyzeOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = oracle[&name]["built_weight_elems"].as_u64().unwrap() + oracle[&name]["float_initializer_elems"].as_u64().unwrap();
        assert!(want > 1_000_000, "{name}: the oracle found {want} weights");
        assert_eq!(model.lg.params, want, "{name}: parameters");
    }
}

#[test]
fn light_models_have_balanced_layers_and_pipeline() {
    for path in light_models() {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let model = load_and_analyze(&path, &AnalyzeOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let layers = &model.lg.layers;
        let flops: Vec<f64> = layers.iter().map(|l| l.figures.flops).collect();
        let mean = flops.iter().sum::<f64>() / flops.len() as f64;
        assert!(layers.len() >= 4, "{name}: {} layers", layers.len());
        assert!(flops.iter().all(|&f| f <= 2.0 * mean), "{name}: layer FLOPs {flops:?} exceed twice the mean {mean}");
        assert!(layers.iter().all(|l| l.kind != LayerKind::Embedding), "{name}: a CNN layer called an embedding");
        for (cluster, pp) in [(CPU2, 2), (CPU4, 4)] {
            let cluster = ClusterSpec::parse(cluster).unwrap();
            let opts = PlanOptions { pp: Some(pp), ..Default::default() };
            let plan = compile(&model, &cluster, &opts).unwrap_or_else(|e| panic!("{name} --pp {pp}: {e}"));
            assert_eq!(plan.parallel.pp, pp, "{name} --pp {pp}");
            // Every pipeline rank runs layers, and together they run each layer once.
            let ranks: std::collections::BTreeSet<usize> = plan.stages.iter().map(|s| s.pp_rank).collect();
            assert_eq!(ranks.len(), pp, "{name} --pp {pp}");
            let run: usize = plan.stages.iter().map(|s| s.layers[1] + 1 - s.layers[0]).sum();
            assert_eq!(run, layers.len(), "{name} --pp {pp}");
        }
    }
}
