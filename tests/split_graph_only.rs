//! The graph-only Llama exports (`scripts/make_graph_only.py`: grouped-query `repeat_kv` as
//! Expand(Unsqueeze(kv), [1, 1, rep, 1, 1]) then a Reshape to a constant [0, heads, seq, d],
//! RoPE on constant tables) split as Megatron-LM splits them: q/k/v and gate/up by columns, the
//! attention cores by heads, o/down by rows, at t = 2 and 8 (their 8 KV heads divide). Before the
//! fix the Expand's broadcast entry 1 stopped the KV-head split, and every matmul of a block came
//! out `replicate`. Per-device weights and per-stage compute then scale ~1/t; a tiny twin with
//! real weights (8 query heads over 2 KV heads: split at t = 2, shared by 2 ranks at t = 4)
//! trains 5 f64 steps through `smp-runner launch` equal to one process within 1e-9; so does one
//! with 3 KV heads at t = 2 (neither divides the other: the attention stays whole, the MLP
//! splits).

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use smp_partition::codegen::Sharder;
use smp_partition::cost::ClusterSpec;
use smp_partition::ir::{LayerKind, LayeredGraph, ScheduleKind};
use smp_partition::passes::AnalyzeOptions;
use smp_partition::solve::{Baseline, CheckpointRule, PlanDecision, PlanOptions, plan};
use smp_partition::split::Strategy;
use smp_partition::{Analysed, load_and_analyze};

const SEQ: i64 = 8192;

/// `models/<name>.onnx` at its fixed sequence length, batch 1.
fn analysed(name: &str) -> Analysed {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(format!("{name}.onnx"));
    load_and_analyze(&path, &AnalyzeOptions { seq_len: None, dims: BTreeMap::from([("batch".to_string(), 1)]) }).unwrap()
}

/// The parameter a weight matmul reads (its second input), by node name.
fn weight_of(lg: &LayeredGraph, node: &str) -> Option<String> {
    let g = &lg.graph;
    let id = g.node_ids().find(|&n| g.node(n).name == node)?;
    let w = g.node(id).inputs.get(1).copied().flatten()?;
    let v = g.value(w);
    (v.kind == smp_partition::ir::ValueKind::Initializer).then(|| v.name.clone())
}

/// What Megatron-LM does with each matmul of a Llama block, by the weight's name; `None` for
/// the two attention-core matmuls (no weight), which split by heads.
fn megatron_strategy(weight: Option<&str>) -> Strategy {
    match weight {
        None => Strategy::Heads,
        Some(w) if ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"].iter().any(|p| w.contains(p)) => Strategy::Column,
        Some(w) if ["o_proj", "down_proj"].iter().any(|p| w.contains(p)) => Strategy::Row,
        Some(w) => panic!("unexpected weight matmul `{w}`"),
    }
}

/// `--baseline megatron` at tp × pp 4 (dp 1) on H100s.
fn megatron_plan(a: &Analysed, tp: usize) -> PlanDecision {
    let spec = ClusterSpec::parse(&format!("h100-80gb:{}", 4 * tp)).unwrap();
    let opts = PlanOptions {
        global_batch: Some(8),
        seq_len: Some(SEQ as u64),
        baseline: Some(Baseline::Megatron),
        tp: Some(tp),
        pp: Some(4),
        dp: Some(1),
        microbatches: Some(8),
        schedule: Some(ScheduleKind::OneFOneB),
        checkpointing: Some(CheckpointRule::Always),
        ..Default::default()
    };
    plan(&a.lg, &spec, &opts, &mut |_| {}).unwrap_or_else(|e| panic!("tp {tp}: {e}"))
}

/// Every block's matmuls in the plan take Megatron's strategy; returns how many were checked.
fn assert_megatron_blocks(lg: &LayeredGraph, d: &PlanDecision, what: &str) -> usize {
    let mut checked = 0;
    for l in &d.layers {
        if lg.layers[l.layer].kind != LayerKind::Block {
            continue;
        }
        let matmuls: Vec<&(String, Strategy)> = l.nodes.iter().filter(|(n, _)| n.rsplit('/').next().is_some_and(|s| s.starts_with("MatMul"))).collect();
        assert_eq!(matmuls.len(), 9, "{what} layer {}: {:?}", l.layer, l.nodes);
        for (node, got) in matmuls {
            let want = megatron_strategy(weight_of(lg, node).as_deref());
            assert_eq!(*got, want, "{what} layer {} `{node}` ({:?})", l.layer, weight_of(lg, node));
            checked += 1;
        }
    }
    checked
}

#[test]
fn graph_only_llama3_8b_plans_megatron_splits_and_scales_by_t() {
    let a = analysed("llama3-8b");
    let whole = megatron_plan(&a, 1);
    for tp in [2, 8] {
        let d = megatron_plan(&a, tp);
        assert_eq!(d.parallel.tp, tp);
        let n = assert_megatron_blocks(&a.lg, &d, &format!("llama3-8b tp {tp}"));
        assert_eq!(n, 32 * 9);
        // The embedding splits the vocabulary.
        let emb = d.layers.iter().find(|l| a.lg.layers[l.layer].kind == LayerKind::Embedding).unwrap();
        assert!(emb.nodes.iter().any(|(_, s)| *s == Strategy::Vocab), "tp {tp}: {:?}", emb.nodes);
        // A middle stage (8 blocks): parameters ÷ t, time ~÷ t. Above 1/t: the two all-reduces
        // per block (at t = 8 each ~half a block's split compute, with fused attention) and,
        // without sequence parallelism, the norms and residual adds every tensor rank runs
        // whole: measured ×1.15 (t 2) and ×2.17 (t 8) forward. Unsplit it was ×t.
        let (s1, s) = (&whole.stages[1], &d.stages[1]);
        let t = tp as f64;
        let params = s.memory.params * t / s1.memory.params;
        assert!((params - 1.0).abs() < 0.01, "tp {tp}: stage params × t / whole = {params}");
        let fwd = s.forward_s * t / s1.forward_s;
        let bwd = s.backward_s * t / s1.backward_s;
        eprintln!("llama3-8b tp {tp}: stage 1 forward {:.4} s (whole {:.4} s, ×t/whole {fwd:.3}), backward ×t/whole {bwd:.3}", s.forward_s, s1.forward_s);
        let most = if tp == 2 { 1.25 } else { 2.5 };
        assert!((0.95..most).contains(&fwd), "tp {tp}: stage forward × t / whole = {fwd}");
        assert!((0.95..most).contains(&bwd), "tp {tp}: stage backward × t / whole = {bwd}");
    }
}

/// Codegen's shards of one block of each graph-only Llama: 7 weights sliced, and a rank holds
/// 1/t of the block's matmul weights.
#[test]
fn graph_only_llama_blocks_shard_their_weights_by_t() {
    for name in ["llama3-8b", "llama3-70b", "llama3-405b"] {
        let a = analysed(name);
        let lg = &a.lg;
        let g = &lg.graph;
        let block = lg.layers.iter().position(|l| l.kind == LayerKind::Block).unwrap();
        let sharder = Sharder::new(lg).unwrap();
        let elems = |init: &str| -> (u64, Vec<u64>) {
            let v = g.value_ids().find(|&v| g.value(v).name == init).unwrap();
            let dims: Vec<u64> = g.value(v).ty.as_ref().unwrap().shape.as_ref().unwrap().known().unwrap().iter().map(|&d| d as u64).collect();
            (dims.iter().product(), dims)
        };
        for tp in [2, 8] {
            let (shards, realised) = sharder.shard_layer_keeping(block, tp, &[]).unwrap_or_else(|e| panic!("{name} tp {tp}: {e}"));
            for (node, s) in realised.iter().filter(|(n, _)| n.rsplit('/').next().is_some_and(|s| s.starts_with("MatMul"))) {
                assert_eq!(*s, megatron_strategy(weight_of(lg, node).as_deref()), "{name} tp {tp} `{node}`");
            }
            let mut whole = 0;
            for s in &shards {
                assert_eq!(s.weight_slices.len(), 7, "{name} tp {tp} rank {}: {:?}", s.rank, s.weight_slices);
                let mut held = 0;
                whole = 0;
                for w in &s.weight_slices {
                    let (n, dims) = elems(&w.initializer);
                    whole += n;
                    held += n / dims[w.axis] * w.len();
                }
                assert_eq!(held * tp as u64, whole, "{name} tp {tp} rank {}", s.rank);
            }
            assert!(whole > 0);
        }
    }
}

/// The graph-only Mixtral 8×7B (`scripts/make_graph_only.py`: Llama with sparse MoE MLPs as
/// the front door exports them) is planned as MoE: every block's dense experts fuse into one
/// `MixtureOfExperts` whose figures count the 2 routed experts of each token (not the 8) and
/// hold all 8 experts' weights, and the tensor split cuts every expert's intermediate dim t ways.
#[test]
fn graph_only_mixtral_fuses_its_experts_and_splits_them_by_t() {
    let a = analysed("mixtral-8x7b");
    let lg = &a.lg;
    let g = &lg.graph;
    let moe: Vec<_> = g.node_ids().filter(|&n| g.node(n).op.is(smp_partition::ir::OpKind::MixtureOfExperts)).collect();
    assert_eq!(moe.len(), 32, "one MixtureOfExperts per block");
    // the experts, the 2 RMSNorms of each block and the final one (its SwiGLU gates are the experts')
    let count = |f: fn(&smp_partition::ir::FusedOp) -> bool| lg.fused.iter().filter(|r| f(&r.op)).count();
    assert_eq!(count(|op| matches!(op, smp_partition::ir::FusedOp::MixtureOfExperts { .. })), 32);
    assert_eq!(count(|op| matches!(op, smp_partition::ir::FusedOp::RmsNorm { .. })), 65);
    // q's and k's rotary embeddings, their halves cut by one Split
    assert_eq!(count(|op| matches!(op, smp_partition::ir::FusedOp::Rotary { interleaved: false })), 64);
    assert_eq!(lg.fused.len(), 161);
    let (e, h, f, k, tokens) = (8.0, 4096.0, 14336.0, 2.0, 4096.0);
    let fig = lg.node_figures(moe[0]);
    assert_eq!(fig.param_elems as f64, e * 3.0 * h * f, "all experts' weights");
    let routed = tokens * k * (2.0 * h * 2.0 * f + 5.0 * f + 2.0 * f * h + 2.0 * h);
    assert!((fig.flops - routed).abs() <= 1e-9 * routed, "flops {} per sample, routed pairs {routed}", fig.flops);
    let block = lg.layers.iter().position(|l| l.kind == LayerKind::Block).unwrap();
    let sharder = Sharder::new(lg).unwrap();
    for tp in [2, 8] {
        let (shards, realised) = sharder.shard_layer_keeping(block, tp, &[]).unwrap_or_else(|e| panic!("tp {tp}: {e}"));
        let experts: Vec<_> = realised.iter().filter(|(n, _)| *n == g.node(moe[0]).name).collect();
        assert_eq!(experts.len(), 1, "tp {tp}: {realised:?}");
        assert_eq!(experts[0].1, Strategy::Experts, "tp {tp}");
        for s in &shards {
            let slices: Vec<_> = s.weight_slices.iter().filter(|w| w.initializer.contains("experts.")).collect();
            assert_eq!(slices.len(), 2, "tp {tp} rank {}: {:?}", s.rank, s.weight_slices);
            for w in slices {
                let (axis, blocks) = if w.initializer.ends_with("gate_up_proj") { (1, 2) } else { (2, 1) };
                assert_eq!((w.axis, w.ranges.len()), (axis, blocks), "{w:?}");
                assert_eq!(w.len() * tp as u64, blocks as u64 * f as u64, "tp {tp} rank {}: {w:?}", s.rank);
            }
        }
    }
}

/// 5 f64 steps of `model` in one process, and under `--baseline megatron` at each (pp, tp):
/// the losses must agree within 1e-9; `check` sees each plan first.
#[cfg(feature = "runner")]
fn runs_equal_one_process(model: &Path, runs: &[(usize, usize)], check: impl Fn(usize, usize, &serde_json::Value)) {
    use std::process::Command;

    let model = model.to_path_buf();
    let losses = |stdout: &[u8]| -> Vec<f64> {
        let v: serde_json::Value = serde_json::from_slice(stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(stdout)));
        v["steps"].as_array().unwrap().iter().map(|s| s["loss"].as_f64().unwrap()).collect()
    };
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["train", model.to_str().unwrap(), "--batch", "8", "--seq-len", "16", "--microbatches", "2"])
        .args(["--steps", "5", "--dtype", "f64", "--threads", "1", "--json"])
        .output()
        .unwrap();
    assert!(r.status.success(), "single process: {}", String::from_utf8_lossy(&r.stderr));
    let want = losses(&r.stdout);
    assert_eq!(want.len(), 5);
    assert!(want[4] < want[0], "the single process does not train: {want:?}");
    let tmp = tempfile::tempdir().unwrap();
    for &(pp, tp) in runs {
        let out = tmp.path().join(format!("pp{pp}tp{tp}.json"));
        let n = pp * tp;
        let plan = common::runner::plan_megatron(&model, pp, tp, &out);
        check(pp, tp, &plan);
        let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .args(["launch", "--nproc", &n.to_string(), out.to_str().unwrap()])
            .args(["--steps", "5", "--dtype", "f64", "--threads", "1", "--json", "--timeout", "120"])
            .output()
            .unwrap();
        assert!(r.status.success(), "launch pp{pp} tp{tp}: {}", String::from_utf8_lossy(&r.stderr));
        let got = losses(&r.stdout);
        assert_eq!(got.len(), want.len());
        let worst = got.iter().zip(&want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max);
        eprintln!("{} pp{pp} tp{tp} f64: max relative loss difference {worst:.2e}", model.display());
        assert!(worst <= 1e-9, "pp{pp} tp{tp}: {got:?} vs one process {want:?} ({worst:.2e})");
    }
}

/// The exports' directory, generated once per content of the scripts (one export at a time).
#[cfg(feature = "runner")]
fn exports() -> &'static Path {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| common::exports::exported("graph_only_exports.py", "llama-kv3.onnx"))
}

/// The blocks' weight slices of rank 0 in a plan (blocks: layers slicing an MLP weight).
#[cfg(feature = "runner")]
fn block_slices(plan: &serde_json::Value) -> Vec<Vec<(String, u64)>> {
    plan["codegen"]["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|layer| {
            layer[0]["weight_slices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| (w["initializer"].as_str().unwrap().to_string(), w["replicas"].as_u64().unwrap_or(1)))
                .collect::<Vec<_>>()
        })
        .filter(|s| s.iter().any(|(n, _)| n.contains("up_proj")))
        .collect()
}

/// A tiny graph-only Llama with real weights, 8 query heads over 2 KV heads: Megatron's split
/// at tp 2 (KV heads split), tp 4 (each KV head shared by 2 ranks) and pp 2 × tp 2 trains 5 f64
/// steps equal to one process.
#[cfg(feature = "runner")]
#[test]
fn tiny_graph_only_gqa_llama_tp_runs_equal_one_process() {
    runs_equal_one_process(&exports().join("llama-gqa.onnx"), &[(1, 2), (1, 4), (2, 2)], |pp, tp, plan| {
        // Every block: the 7 weights sliced; k/v shared by 2 ranks at tp 4 (2 KV heads).
        let blocks = block_slices(plan);
        assert_eq!(blocks.len(), 4, "pp{pp} tp{tp}");
        for slices in blocks {
            assert_eq!(slices.len(), 7, "pp{pp} tp{tp}: {slices:?}");
            for (name, shared) in slices {
                let kv = name.contains("k_proj") || name.contains("v_proj");
                assert_eq!(shared, if kv && tp == 4 { 2 } else { 1 }, "pp{pp} tp{tp}: {name}");
            }
        }
    });
}

/// 3 KV heads at tp 2 (neither divides the other): the attention stays whole on every rank
/// (q/k/v/o replicated) and the MLP still splits; equal to one process.
#[cfg(feature = "runner")]
#[test]
fn tiny_graph_only_llama_with_indivisible_kv_heads_splits_its_mlp() {
    runs_equal_one_process(&exports().join("llama-kv3.onnx"), &[(1, 2)], |pp, tp, plan| {
        let blocks = block_slices(plan);
        assert_eq!(blocks.len(), 2, "pp{pp} tp{tp}");
        for slices in blocks {
            let mut names: Vec<&str> = slices.iter().map(|(n, _)| n.rsplit('.').nth(1).unwrap_or("")).collect();
            names.sort_unstable();
            assert_eq!(names, ["down_proj", "gate_proj", "up_proj"], "pp{pp} tp{tp}: {slices:?}");
        }
    });
}

/// A tiny graph-only DeepSeek-V3 (latent attention over 4 heads, a dense layer, then routed
/// experts beside a shared expert): at tp 2 and pp 2 × tp 2 the attention splits by heads
/// (`q_b_proj`, `kv_b_proj` by columns, `o_proj` by rows, the low-rank down-projections
/// whole; the rotary key's Expand over the heads cut to each rank's 2), equal to one process.
#[cfg(feature = "runner")]
#[test]
fn tiny_graph_only_deepseek_latent_attention_splits_by_heads_and_runs_equal_one_process() {
    runs_equal_one_process(&exports().join("deepseek-mla.onnx"), &[(1, 2), (2, 2)], |pp, tp, plan| {
        for shards in plan["codegen"]["shards"].as_array().unwrap() {
            let s = &shards[0];
            let sliced: Vec<&str> = s["weight_slices"].as_array().unwrap().iter().map(|w| w["initializer"].as_str().unwrap()).collect();
            if !sliced.iter().any(|w| w.contains("self_attn")) {
                continue;
            }
            for w in ["q_b_proj", "kv_b_proj", "o_proj"] {
                assert!(sliced.iter().any(|n| n.contains(w)), "pp{pp} tp{tp}: {w} not sliced: {sliced:?}");
            }
            assert!(!sliced.iter().any(|n| n.contains("q_a_proj") || n.contains("kv_a_proj")), "pp{pp} tp{tp}: {sliced:?}");
            let rewrites = s["constant_rewrites"].as_array().unwrap();
            assert!(rewrites.iter().any(|r| r["value"] == "k_rot.heads" && r["new_values"] == serde_json::json!([1, 2, 1, 1])), "{rewrites:?}");
        }
    });
}
