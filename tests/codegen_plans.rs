//! The planner offers only tensor strategies codegen realises: every feasible assignment of
//! every layer's intra-layer problem, sharded with its replicated nodes kept whole, realises
//! exactly the chosen strategy per node; and every models/ export plans and code-generates.

use std::collections::BTreeMap;
use std::path::Path;

use smp_partition::codegen::{Sharder, encode};
use smp_partition::cost::{ClusterSpec, GroupSpan};
use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::LayeredGraph;
use smp_partition::passes::{AnalyzeOptions, analyze};
use smp_partition::plan::build::{ModelRef, from_decision};
use smp_partition::solve::layer_cost::CostContext;
use smp_partition::solve::problem::IntraLayerProblem;
use smp_partition::solve::strategy::{CHOOSING, LayerStrategies, StrategyInputs, build};
use smp_partition::solve::{PlanConfig, plan};

const MODELS: [&str; 4] = ["bert", "gpt2", "llama", "vit"];

fn model(name: &str) -> LayeredGraph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(format!("{name}.onnx"));
    let m = load_model(&path).unwrap();
    let opts = AnalyzeOptions { seq_len: (name != "vit").then_some(16), dims: BTreeMap::from([("batch".to_string(), 2)]) };
    analyze(m.graph, &opts).unwrap()
}

/// Every assignment the problem allows (no forbidden edge pair), up to `cap`.
fn feasible(p: &IntraLayerProblem, cap: usize) -> Vec<Vec<usize>> {
    let n = p.nodes.len();
    let mut idx = vec![0usize; n];
    let mut out = Vec::new();
    loop {
        if p.evaluate(&idx).is_some() {
            out.push(idx.clone());
            if out.len() >= cap {
                return out;
            }
        }
        let mut v = 0;
        while v < n {
            idx[v] += 1;
            if idx[v] < p.nodes[v].options.len() {
                break;
            }
            idx[v] = 0;
            v += 1;
        }
        if v == n {
            return out;
        }
    }
}

fn strategies(lg: &LayeredGraph, layer: usize, tp: usize) -> LayerStrategies {
    let spec = ClusterSpec::parse("h100-80gb:8").unwrap();
    let ctx = CostContext::new(lg, &spec);
    let x = StrategyInputs {
        spec: &spec,
        comm: &ctx.comm,
        dtype: ctx.dtype,
        bytes_scale: ctx.bytes_scale,
        tp,
        microbatch: 2.0,
        tp_group: GroupSpan { size: tp, per_node: tp },
        state_bytes_per_param: 16.0,
        sequence_parallel: false,
    };
    build(lg, layer, &x)
}

/// Shards `layer` keeping the assignment's replicated nodes whole; asserts realised == chosen
/// on every choosing node.
fn check_assignment(name: &str, lg: &LayeredGraph, sharder: &Sharder<'_>, ls: &LayerStrategies, layer: usize, tp: usize, choice: &[usize]) {
    let chosen = ls.node_names(lg, layer, choice);
    let keep: Vec<String> = chosen.iter().filter(|(_, s)| s == "replicate").map(|(n, _)| n.clone()).collect();
    let (_, realised) = sharder
        .shard_layer_keeping(layer, tp, &keep)
        .unwrap_or_else(|e| panic!("{name} t={tp} layer {layer} {chosen:?}: {e}"));
    for (node, want) in chosen.iter().filter(|(_, s)| CHOOSING.contains(&s.as_str())) {
        let got = realised.iter().find(|(n, _)| n == node).map_or("follow", |(_, s)| s.as_str());
        assert_eq!(got, want, "{name} t={tp} layer {layer} node {node}: chosen {want}, realised {got}; assignment {chosen:?}");
    }
}

#[test]
fn every_offered_assignment_is_realised_by_codegen() {
    for name in MODELS {
        let lg = model(name);
        let sharder = Sharder::new(&lg).unwrap();
        for tp in [2, 4] {
            let mut seen = std::collections::HashSet::new();
            for layer in 0..lg.layers.len() {
                if !seen.insert(lg.layers[layer].signature.clone()) {
                    continue;
                }
                let ls = strategies(&lg, layer, tp);
                assert!(ls.problem.evaluate(&ls.megatron).is_some(), "{name} t={tp} layer {layer}: Megatron assignment infeasible");
                let all = feasible(&ls.problem, 400);
                assert!(all.contains(&ls.megatron));
                for choice in &all {
                    check_assignment(name, &lg, &sharder, &ls, layer, tp, choice);
                }
            }
        }
    }
}

#[test]
fn transformer_blocks_offer_the_megatron_split() {
    // The blocks of every text model split fully at t = 2 (column/heads/row), so the Megatron
    // assignment there has no replicated matmul.
    for name in ["bert", "gpt2", "llama"] {
        let lg = model(name);
        let block = lg.layers.iter().position(|l| l.kind == smp_partition::ir::LayerKind::Block).unwrap();
        let ls = strategies(&lg, block, 2);
        let names = ls.node_names(&lg, block, &ls.megatron);
        let used: Vec<&str> = names.iter().map(|(_, s)| s.as_str()).filter(|s| *s != "follow").collect();
        for s in ["column", "heads", "row"] {
            assert!(used.contains(&s), "{name}: {used:?}");
        }
        assert!(!used.contains(&"replicate"), "{name}: {used:?}");
    }
}

#[test]
fn every_model_plans_and_code_generates() {
    for name in MODELS {
        let lg = model(name);
        for (cluster, tps) in [("cpu:2", vec![None, Some(2)]), ("cpu:4", vec![None, Some(2), Some(4)]), ("h100-80gb:8", vec![None, Some(2), Some(4)])] {
            let spec = ClusterSpec::parse(cluster).unwrap();
            for tp in tps {
                let mut cfg = PlanConfig::new(spec.devices * 2);
                cfg.constraints.tp = tp;
                let what = format!("{name} on {cluster} tp {tp:?}");
                let d = plan(&lg, &spec, &cfg, &mut |_| {}).unwrap_or_else(|e| panic!("{what}: {e}"));
                let model_ref = ModelRef { path: format!("models/{name}.onnx"), sha256: String::new() };
                let p = from_decision(&d, &lg, &spec, &cfg, &model_ref, None, &[], 0.0);
                let input = p.codegen_input().unwrap();
                assert_eq!(input.node_strategies.iter().filter(|n| !n.is_empty()).count(), lg.layers.len(), "{what}");
                // Codegen checks realised == chosen for every choosing node.
                encode::build(&lg, &input).unwrap_or_else(|e| panic!("{what}: {e}"));
            }
        }
    }
}
