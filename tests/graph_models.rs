//! The passes on every committed model: parameters against the export script's count,
//! matmul FLOPs against shapes and closed forms, blocks as N layers with one signature.

use std::path::Path;

use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{LayerKind, LayeredGraph, OpKind};
use smp_partition::passes::{AnalyzeOptions, analyze};

fn manifest() -> serde_json::Map<String, serde_json::Value> {
    let text = std::fs::read_to_string("models/manifest.json").expect("models/manifest.json");
    serde_json::from_str(&text).expect("manifest is JSON")
}

fn load(file: &str, seq: Option<i64>) -> LayeredGraph {
    let m = load_model(Path::new(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    analyze(m.graph, &AnalyzeOptions { seq_len: seq, ..Default::default() }).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn entries() -> Vec<(String, serde_json::Value)> {
    manifest().into_iter().filter(|(_, v)| v["file"].as_str().is_some_and(|f| Path::new(f).exists())).collect()
}

fn seq_of(v: &serde_json::Value) -> Option<i64> {
    // Symbolic sequences are bound to the recorded length (or 32 for small exports).
    let fixed = v["inputs"][0]["shape"][1].as_i64();
    if fixed.is_some() { None } else { Some(v["seq"].as_i64().unwrap_or(32)) }
}

#[test]
fn params_equal_the_recorded_float_initializer_count() {
    let entries = entries();
    assert!(!entries.is_empty(), "no models found");
    for (name, v) in entries {
        let lg = load(v["file"].as_str().unwrap(), seq_of(&v));
        // an export's merged initializers count once per module tensor they stand for
        let want = v["untied_float_elements"].as_u64().or(v["float_initializer_elements"].as_u64()).unwrap();
        assert_eq!(lg.params, want, "{name}");
    }
}

#[test]
fn matmul_flops_are_two_m_n_k_from_the_shapes() {
    for (name, v) in entries() {
        let lg = load(v["file"].as_str().unwrap(), seq_of(&v));
        let g = &lg.graph;
        let dims = |val| g.value(val).ty.as_ref().unwrap().shape.as_ref().unwrap().known().unwrap();
        for n in g.node_ids() {
            let node = g.node(n);
            if !(node.op.is(OpKind::MatMul) || node.op.is(OpKind::Gemm)) {
                continue;
            }
            let (a, b) = match (node.inputs.first(), node.inputs.get(1)) {
                (Some(Some(a)), Some(Some(b))) => (dims(*a), dims(*b)),
                _ => continue,
            };
            let want = if node.op.is(OpKind::MatMul) {
                // [..., m, k] × [..., k, n] with broadcast batch dims.
                let (m, k, nn) = (a[a.len() - 2], a[a.len() - 1], b[b.len() - 1]);
                let (ba, bb) = (&a[..a.len() - 2], &b[..b.len() - 2]);
                let r = ba.len().max(bb.len());
                let batch: i64 = (0..r)
                    .map(|i| {
                        let x = if i + ba.len() >= r { ba[i + ba.len() - r] } else { 1 };
                        let y = if i + bb.len() >= r { bb[i + bb.len() - r] } else { 1 };
                        x.max(y)
                    })
                    .product();
                2.0 * (batch * m * nn * k) as f64
            } else if node.op.is(OpKind::Gemm) {
                let ta = node.attrs.int("transA", 0) != 0;
                let tb = node.attrs.int("transB", 0) != 0;
                let (m, k) = if ta { (a[1], a[0]) } else { (a[0], a[1]) };
                let nn = if tb { b[0] } else { b[1] };
                2.0 * (m * nn * k) as f64 + if node.inputs.get(2).copied().flatten().is_some() { (m * nn) as f64 } else { 0.0 }
            } else {
                continue;
            };
            let got = lg.node_figures(n).flops * lg.dims.graph_batch as f64;
            assert_eq!(got, want, "{name}: node {}", node.name);
        }
    }
}

#[test]
fn gpt_matmul_flops_match_the_closed_form() {
    // Per sample: 24·l·s·h² (QKV, projection, MLP) + 4·l·s²·h (attention) + 2·s·h·V (LM head).
    for (name, v) in entries().into_iter().filter(|(_, v)| v["kind"] == "gpt" && v["graph_only"] == true) {
        let lg = load(v["file"].as_str().unwrap(), None);
        let (l, h, s, voc) = (v["layers"].as_f64().unwrap(), v["hidden"].as_f64().unwrap(), v["seq"].as_f64().unwrap(), v["vocab"].as_f64().unwrap());
        let want = 24.0 * l * s * h * h + 4.0 * l * s * s * h + 2.0 * s * h * voc;
        let g = &lg.graph;
        let got: f64 = g
            .node_ids()
            .filter(|&n| g.node(n).op.is(OpKind::MatMul) || g.node(n).op.is(OpKind::Gemm))
            .map(|n| lg.node_figures(n).flops)
            .sum();
        // Gemm biases add 2·l·s·(3h + h + 4h + h)-ish terms: well under 0.1 %.
        assert!((got - want).abs() / want < 1e-3, "{name}: {got} vs {want}");
    }
}

#[test]
fn transformer_blocks_are_n_layers_with_one_signature_per_kind() {
    for (name, v) in entries() {
        let Some(n) = v["layers"].as_u64() else { continue };
        let lg = load(v["file"].as_str().unwrap(), seq_of(&v));
        let blocks: Vec<_> = lg.layers.iter().filter(|l| l.kind == LayerKind::Block).collect();
        assert_eq!(blocks.len() as u64, n, "{name}: {:?}", lg.layers.iter().map(|l| &l.name).collect::<Vec<_>>());
        // The first `dense_layers` blocks (DeepSeek's dense MLPs) share one signature, the rest another.
        let dense = v["dense_layers"].as_u64().unwrap_or(0) as usize;
        let (first, rest) = blocks.split_at(dense.min(blocks.len()));
        for part in [first, rest] {
            assert!(part.iter().all(|b| b.signature == part[0].signature), "{name}: blocks differ");
        }
        if let (Some(a), Some(b)) = (first.first(), rest.first()) {
            assert_ne!(a.signature, b.signature, "{name}: the dense blocks should differ from the expert blocks");
        }
        assert_eq!(lg.layers.first().map(|l| l.kind), Some(LayerKind::Embedding), "{name}");
        assert_eq!(lg.layers.last().map(|l| l.kind), Some(LayerKind::Head), "{name}");
    }
}
