//! Per-node sharding strategies and the intra-layer ILP inside the planner.

mod common;

use smp_partition::cost::{ClusterSpec, GroupSpan};
use smp_partition::ir::LayerKind;
use smp_partition::solve::layer_cost::{CostContext, LayerConfig};
use smp_partition::solve::oracle::brute_force_intra;
use smp_partition::solve::strategy::{StrategyInputs, build};
use smp_partition::solve::{Baseline, PlanOptions, SolverOptions, plan};

fn small() -> smp_partition::ir::LayeredGraph {
    common::gpt(common::GptShape { layers: 4, hidden: 1024.0, heads: 16.0, seq: 1024.0, vocab: 32000.0 })
}

fn cfg(tp: usize, per_node: usize) -> LayerConfig {
    LayerConfig::dense(tp, 2, 0, GroupSpan { size: 1, per_node: 1 }, GroupSpan { size: 1, per_node: 1 }, GroupSpan { size: tp, per_node }, false)
}

#[test]
fn megatron_is_an_assignment_and_the_ilp_matches_brute_force() {
    let lg = small();
    for (preset, per_node) in [("h100-80gb:8", 8), ("h100-80gb:16", 1)] {
        let spec = ClusterSpec::parse(preset).unwrap();
        let mut ctx = CostContext::new(&lg, &spec, spec.default_precision());
        for tp in [2, 4] {
            let lc = cfg(tp, per_node.min(tp));
            for layer in 0..lg.layers.len() {
                let megatron = ctx.details(layer, &lc)[0].clone();
                let x = StrategyInputs {
                    spec: &spec,
                    comm: &ctx.comm,
                    dtype: ctx.dtype,
                    bytes: &ctx.bytes,
                    tp,
                    microbatch: 2.0,
                    tp_group: lc.tp_group,
                    state_bytes_per_param: 16.0,
                    grad_bytes_per_param: ctx.precision.grad as f64,
                    sequence_parallel: false,
                };
                let ls = build(&lg, layer, &x);
                // The Megatron split, evaluated in the intra-layer problem, costs what the
                // Megatron layer point costs.
                let m = ls.problem.evaluate(&ls.megatron).unwrap();
                let rel = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-30);
                assert!(rel(m.fwd_s, megatron.fwd_s), "layer {layer} tp {tp}: fwd {} vs {}", m.fwd_s, megatron.fwd_s);
                assert!(rel(m.bwd_s, megatron.bwd_s), "layer {layer} tp {tp}: bwd {} vs {}", m.bwd_s, megatron.bwd_s);
                assert!(rel(ls.params_of(&ls.megatron), megatron.param_elems));
                // The ILP's optimum equals exhaustive enumeration and never exceeds Megatron.
                let (_, sol) = ls.problem.solve(false, None, &SolverOptions::default()).unwrap();
                let sol = sol.unwrap();
                let (best, _) = brute_force_intra(&ls.problem).unwrap();
                let t = sol.fwd_s + sol.bwd_s;
                assert!((t - best).abs() <= 1e-6 * best, "layer {layer} tp {tp}: ILP {t} vs brute force {best}");
                assert!(t <= (m.fwd_s + m.bwd_s) * (1.0 + 1e-9));
            }
        }
    }
}

#[test]
fn plan_records_a_strategy_per_node() {
    let lg = small();
    let spec = ClusterSpec::parse("h100-80gb:8").unwrap();
    let mut c = PlanOptions { global_batch: Some(64), ..Default::default() };
    c.tp = Some(4);
    let d = plan(&lg, &spec, &c, &mut |_| {}).unwrap();
    assert_eq!(d.layers.len(), lg.layers.len());
    for l in &d.layers {
        let layer = &lg.layers[l.layer];
        assert_eq!(l.nodes.len(), layer.nodes.len(), "layer {}", l.layer);
        let names: Vec<&str> = l.nodes.iter().map(|(_, s)| s.name()).collect();
        if layer.kind == LayerKind::Block {
            assert!(names.iter().any(|s| ["column", "row", "replicate"].contains(s)), "{names:?}");
        }
        assert!(names.iter().all(|s| ["column", "row", "replicate", "vocab", "heads", "follow"].contains(s)), "{names:?}");
    }
    // The Megatron baseline keeps Megatron's split in every layer.
    c.baseline = Some(Baseline::Megatron);
    let m = plan(&lg, &spec, &c, &mut |_| {}).unwrap();
    assert!(m.layers.iter().all(|l| l.strategy == "megatron-tp4"), "{:?}", m.layers.iter().map(|l| &l.strategy).collect::<Vec<_>>());
    assert!(d.predicted.step_time_s <= m.predicted.step_time_s * (1.0 + 1e-9));
}

/// Without sequence parallelism every tensor rank keeps a column split's input whole (its
/// weight gradient reads it): the column offers of a block count each distinct input's
/// (1 − 1/t) share once, however many splits read it (q, k and v one norm's output; gate and up
/// the other's). Under sequence parallelism the layer's ÷t stands.
#[test]
fn a_column_split_keeps_its_input_whole_without_sequence_parallelism() {
    use smp_partition::split::{Strategy, offers};
    // the bundled Llama export, as torch.onnx writes it
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/llama.onnx");
    let graph = smp_partition::frontend::onnx::load_model(&path).unwrap().graph;
    let lg = smp_partition::passes::analyze(graph, &smp_partition::passes::AnalyzeOptions { seq_len: Some(512), ..Default::default() }).unwrap();
    let spec = ClusterSpec::parse("h100-80gb:2").unwrap();
    // f32 training, the export's type: the graph's bytes are the trained ones
    let ctx = CostContext::new(&lg, &spec, smp_partition::ir::Precision::F32);
    let (tp, microbatch) = (2usize, 2.0);
    let block = (0..lg.layers.len()).find(|&l| lg.layers[l].kind == LayerKind::Block).expect("a block");
    let lay = &lg.layers[block];
    let x = |sequence_parallel| StrategyInputs {
        spec: &spec,
        comm: &ctx.comm,
        dtype: ctx.dtype,
        bytes: &ctx.bytes,
        tp,
        microbatch,
        tp_group: cfg(tp, tp).tp_group,
        state_bytes_per_param: 16.0,
        grad_bytes_per_param: ctx.precision.grad as f64,
        sequence_parallel,
    };
    let columns = |sp| {
        let o = offers(&lg, block, &x(sp));
        o.nodes.into_iter().filter_map(|n| n.options.iter().find(|c| c.strategy == Strategy::Column).map(|c| (n.members, c.act_bytes))).collect::<Vec<_>>()
    };
    let without = columns(false);
    // the oracle: the activation each column split reads (its first input), each value once,
    // whole on every rank where the layer's count divided it by t
    let read: std::collections::BTreeSet<_> = without.iter().map(|(m, _)| lg.graph.node(lay.nodes[m[0]]).inputs[0].unwrap()).collect();
    assert!(without.len() >= 5 && read.len() == 2, "{} column splits reading {} values", without.len(), read.len());
    let whole: f64 = read
        .iter()
        .map(|&v| lg.graph.value(v).ty.as_ref().and_then(|t| t.bytes()).unwrap() as f64 / lg.dims.graph_batch as f64 * microbatch * (1.0 - 1.0 / tp as f64))
        .sum();
    let counted: f64 = without.iter().map(|(_, a)| a).sum();
    assert!((counted - whole).abs() <= 1e-9 * whole, "column splits count {counted} bytes, their whole inputs are {whole}");
    assert!(columns(true).iter().all(|(_, a)| *a == 0.0), "under sequence parallelism the inputs split with the layer");
}
