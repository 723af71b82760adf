//! Numerical acceptance of tensor-parallel shards: for every models/ export and t ∈ {2, 4},
//! each layer's t shards, run by a reference f64 interpreter and combined by their inserted
//! collectives, reproduce the unsharded layer's outputs (norm-relative ≤ 1e-12).

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use common::interp::{Exec, T, combine};
use smp_partition::codegen::validate::validate_shards;
use smp_partition::codegen::{CollectiveKind, LayerShard, Sharder, apply_shard};
use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{DType, Graph, LayerKind, LayeredGraph, Op};
use smp_partition::passes::{AnalyzeOptions, analyze};

const BATCH: usize = 2;
const SEQ: usize = 16;

fn model(name: &str) -> LayeredGraph {
    model_at(name, SEQ)
}

/// `name` analysed at sequence length `seq` (text models).
fn model_at(name: &str, seq: usize) -> LayeredGraph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(format!("{name}.onnx"));
    let m = load_model(&path).unwrap();
    let text = name != "vit";
    let opts = AnalyzeOptions {
        seq_len: text.then_some(seq as i64),
        dims: BTreeMap::from([("batch".to_string(), BATCH as i64)]),
    };
    analyze(m.graph, &opts).unwrap()
}

/// Deterministic inputs: token ids below 256, or pixels in [-1, 1).
fn feeds(g: &Graph) -> HashMap<String, T> {
    let mut state: u64 = 0x2545F4914F6CDD1D;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = HashMap::new();
    for &v in &g.inputs {
        let val = g.value(v);
        let ty = val.ty.as_ref().unwrap();
        let dims: Vec<usize> = ty
            .shape
            .as_ref()
            .unwrap()
            .0
            .iter()
            .enumerate()
            .map(|(i, d)| d.known().map_or(if i == 0 { BATCH } else { SEQ }, |k| k as usize))
            .collect();
        let n = dims.iter().product();
        let data = if ty.dtype.is_float() {
            (0..n).map(|_| (next() % 2000) as f64 / 1000.0 - 1.0).collect()
        } else {
            (0..n).map(|_| (next() % 256) as f64).collect()
        };
        out.insert(val.name.clone(), T::new(ty.dtype, dims, data));
    }
    out
}

fn rel(a: &T, b: &T) -> f64 {
    assert_eq!(a.shape, b.shape);
    let num: f64 = a.data.iter().zip(&b.data).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let den: f64 = b.data.iter().map(|y| y * y).sum::<f64>().sqrt();
    num / den.max(1e-300)
}

/// Runs the t rank graphs in lockstep, combining at each collective; returns rank outputs.
fn run_ranks(graphs: &[Graph], feeds: &HashMap<String, T>) -> Vec<HashMap<String, T>> {
    let mut ex: Vec<Exec> = graphs.iter().map(|g| Exec::new(g, feeds)).collect();
    loop {
        let pending: Vec<_> = ex.iter_mut().map(|e| e.run_until_collective()).collect();
        if pending.iter().all(Option::is_none) {
            break;
        }
        assert!(pending.iter().all(Option::is_some), "ranks disagree on collectives");
        let parts: Vec<T> = ex.iter().zip(&pending).map(|(e, p)| e.env[&e.g.node(p.unwrap()).inputs[0].unwrap()].clone()).collect();
        let node = ex[0].g.node(pending[0].unwrap());
        let (kind, _) = node.op.collective().expect("a collective");
        let outs = combine(kind.name(), kind.axis().unwrap_or(0), &parts);
        for (e, o) in ex.iter_mut().zip(outs) {
            e.finish_collective(o);
        }
    }
    ex.iter()
        .map(|e| e.g.outputs.iter().map(|&v| (e.g.value(v).name.clone(), e.env[&v].clone())).collect())
        .collect()
}

/// Checks every layer of `name` at each degree; returns the shards per (t, layer).
fn check(name: &str, degrees: &[usize]) -> BTreeMap<usize, Vec<Vec<LayerShard>>> {
    check_with(name, degrees, false)
}

/// [`check`], with sequence parallelism on or off.
fn check_with(name: &str, degrees: &[usize], sequence_parallel: bool) -> BTreeMap<usize, Vec<Vec<LayerShard>>> {
    let lg = model(name);
    let inputs = feeds(&lg.graph);
    let mut full = Exec::new(&lg.graph, &inputs);
    assert!(full.run_until_collective().is_none());
    let env: HashMap<String, T> = full.env.iter().map(|(&v, t)| (lg.graph.value(v).name.clone(), t.clone())).collect();
    let sharder = Sharder::new(&lg).unwrap().with_sequence_parallel(sequence_parallel);
    let mut all = BTreeMap::new();
    for &t in degrees {
        let mut per_layer = Vec::new();
        for (li, layer) in lg.layers.iter().enumerate() {
            let shards = sharder.shard_layer(li, t).unwrap_or_else(|e| panic!("{name} t={t}: {e}"));
            validate_shards(&lg.graph, &shards).unwrap_or_else(|e| panic!("{name} t={t} layer {li}: {e}"));
            let graphs: Vec<Graph> = shards
                .iter()
                .map(|s| apply_shard(&lg.graph, &layer.nodes, s, &lg.dims).unwrap_or_else(|e| panic!("{name} t={t}: {e}")))
                .collect();
            let outs = run_ranks(&graphs, &env);
            for (r, o) in outs.iter().enumerate() {
                for (vname, got) in o {
                    let want = &env[vname];
                    let err = rel(got, want);
                    assert!(err <= 1e-12, "{name} t={t} layer {li} ({}) rank {r}: `{vname}` off by {err:e}", layer.name);
                }
            }
            per_layer.push(shards);
        }
        all.insert(t, per_layer);
    }
    all
}

fn count(shard: &LayerShard, kind: fn(&CollectiveKind) -> bool) -> usize {
    shard.collectives.iter().filter(|c| kind(&c.kind)).count()
}

/// Megatron's forward communication per block: two all-reduces (attention, MLP); the
/// vocabulary-parallel embedding one all-reduce; the LM head one all-gather of logits.
fn assert_megatron_shape(lg: &LayeredGraph, shards: &[Vec<LayerShard>], lm: bool) {
    for (layer, s) in lg.layers.iter().zip(shards) {
        let s0 = &s[0];
        let ar = count(s0, |k| matches!(k, CollectiveKind::AllReduce));
        let ag = count(s0, |k| matches!(k, CollectiveKind::AllGather { .. }));
        match layer.kind {
            LayerKind::Block => assert_eq!((ar, ag), (2, 0), "{}: {:?}", layer.name, s0.collectives),
            LayerKind::Head if lm => assert_eq!(ag, 1, "{}: {:?}", layer.name, s0.collectives),
            _ => {}
        }
    }
}

#[test]
fn gpt2_shards_reproduce_each_layer() {
    let all = check("gpt2", &[2, 4]);
    let lg = model("gpt2");
    for (t, shards) in &all {
        assert_megatron_shape(&lg, shards, true);
        // The fused c_attn splits q, k and v by heads: three ranges per rank.
        let block = lg.layers.iter().position(|l| l.kind == LayerKind::Block).unwrap();
        let qkv = shards[block][1].weight_slices.iter().find(|w| w.initializer.ends_with("c_attn.weight")).unwrap();
        let w = 64 / *t as u64;
        assert_eq!(qkv.ranges, vec![[w, 2 * w], [64 + w, 64 + 2 * w], [128 + w, 128 + 2 * w]]);
    }
}

#[test]
fn bert_shards_reproduce_each_layer() {
    let all = check("bert", &[2, 4]);
    let lg = model("bert");
    for shards in all.values() {
        assert_megatron_shape(&lg, shards, false);
    }
}

#[test]
fn llama_shards_reproduce_each_layer() {
    let all = check("llama", &[2, 4]);
    let lg = model("llama");
    assert_megatron_shape(&lg, &all[&2], true);
    assert_megatron_shape(&lg, &all[&4], true);
    // 2 KV heads over 4 ranks: each rank holds one query head and the KV head it reads, which
    // ranks 2k and 2k + 1 share (k_proj and v_proj rows [16k, 16k + 16), declared 2 replicas).
    for (layer, s) in lg.layers.iter().zip(&all[&4]) {
        if layer.kind != LayerKind::Block {
            continue;
        }
        for (r, shard) in s.iter().enumerate() {
            assert_eq!(shard.weight_slices.len(), 7, "{}: {:?}", layer.name, shard.weight_slices);
            let shared: Vec<_> = shard.weight_slices.iter().filter(|w| w.replicas == 2).collect();
            assert_eq!(shared.len(), 2, "{}: {:?}", layer.name, shard.weight_slices);
            let k = (r / 2) as u64;
            for w in shared {
                assert_eq!(w.ranges, vec![[16 * k, 16 * k + 16]], "{} rank {r}: {w:?}", layer.name);
            }
        }
    }
}

#[test]
fn vit_shards_reproduce_each_layer() {
    let all = check("vit", &[2, 4]);
    let lg = model("vit");
    for shards in all.values() {
        assert_megatron_shape(&lg, shards, false);
    }
}

#[test]
fn shards_serialise_small() {
    let lg = model("gpt2");
    let sharder = Sharder::new(&lg).unwrap();
    let s = sharder.shard_layer(1, 2).unwrap();
    let json = serde_json::to_string(&s).unwrap();
    let back: Vec<LayerShard> = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
    assert!(json.len() < 4096, "{} bytes", json.len());
    let _ = DType::F32;
}

/// Megatron's *f* (identity forward, all-reduce backward) sits before each column-parallel
/// block: one replicated value per attention and one per MLP, read only by matmuls.
#[test]
fn partial_gradients_mark_megatron_f() {
    for name in ["gpt2", "bert", "llama", "vit"] {
        let lg = model(name);
        let sharder = Sharder::new(&lg).unwrap();
        for t in [2, 4] {
            for (li, l) in lg.layers.iter().enumerate() {
                if l.kind != LayerKind::Block {
                    continue;
                }
                let s = &sharder.shard_layer(li, t).unwrap()[0];
                let values: std::collections::BTreeSet<&str> = s.partial_gradients.iter().map(|p| p.value.as_str()).collect();
                let want = 2;
                assert_eq!(values.len(), want, "{name} t={t} {}: {:?}", l.name, s.partial_gradients);
                for p in &s.partial_gradients {
                    let node = l.nodes.iter().map(|&n| lg.graph.node(n)).find(|n| n.name == p.node).unwrap();
                    assert!(matches!(node.op.to_string().as_str(), "MatMul" | "Gemm"), "{name}: {} is {}", p.node, node.op);
                    assert_eq!(node.inputs[p.input].map(|v| lg.graph.value(v).name.as_str()), Some(p.value.as_str()));
                }
            }
        }
    }
}

/// A pipeline of sharded stages, as the plan's codegen section describes it: each stage's
/// tensor ranks run their stage subgraphs in lockstep, fed only with the stage's data inputs
/// and what the previous stage sends (`outputs_to_next`, passed through where a stage does not
/// produce it); the last stage's outputs equal the unsharded model's.
#[test]
fn pipeline_of_sharded_stages_reproduces_the_model() {
    use smp_partition::codegen::encode::{CodegenInput, Mesh, StageInput, build};
    use smp_partition::ir::Parallelism;
    for (name, t, sequence_parallel) in [("gpt2", 2usize, false), ("llama", 2, false), ("llama", 4, false), ("bert", 4, false), ("gpt2", 2, true), ("llama", 4, true)] {
        let lg = model(name);
        let inputs = feeds(&lg.graph);
        let mut full = Exec::new(&lg.graph, &inputs);
        assert!(full.run_until_collective().is_none());
        let want: HashMap<String, T> = lg.graph.outputs.iter().map(|&v| (lg.graph.value(v).name.clone(), full.env[&v].clone())).collect();
        let n = lg.layers.len();
        let pp = 3;
        let stages = (0..pp)
            .map(|s| StageInput { layers: [s * n / pp, (s + 1) * n / pp - 1], checkpointed_layers: vec![], selective_layers: vec![], output_bytes: 0 })
            .collect();
        let parallel = Parallelism { sequence_parallel, offload: smp_partition::ir::OffloadRule::Never, ..Parallelism::of_degrees(pp, t, 1) };
        let mut input = CodegenInput { parallel, stages, replicated_layers: vec![], node_strategies: vec![], microbatch_size: None };
        if name == "bert" {
            // BERT's MLM head transform (dense, GELU, LayerNorm) splits at no degree: codegen
            // refuses it unless the plan says to replicate that layer.
            let err = build(&lg, &input).unwrap_err().to_string();
            assert!(err.contains(&format!("layer {} (`head`) does not split {t} ways", n - 1)), "{err}");
            input.replicated_layers = vec![n - 1];
        }
        let section = build(&lg, &input).unwrap();
        let mesh = Mesh { ranks: (0..pp).map(|p| vec![(0..t).map(|r| p * t + r).collect()]).collect() };
        // What has arrived at the current stage: data, then the previous stage's sends.
        let mut arrived: HashMap<String, T> = inputs.clone();
        let mut last_outputs = HashMap::new();
        for p in 0..pp {
            let views: Vec<_> = (0..t).map(|r| section.rank_view(&mesh, p * t + r, None).unwrap()).collect();
            let stage = &views[0].stages[0];
            let graphs: Vec<Graph> = views.iter().map(|v| v.stages[0].subgraph(&lg).unwrap()).collect();
            let outs = run_ranks(&graphs, &arrived);
            for o in &outs[1..] {
                for (k, v) in o {
                    assert!(rel(v, &outs[0][k]) <= 1e-12, "{name}: tensor ranks disagree on `{k}`");
                }
            }
            let mut next = inputs.clone();
            for sent in &stage.code.outputs_to_next {
                let v = outs[0].get(sent).or_else(|| arrived.get(sent)).unwrap_or_else(|| panic!("{name}: stage {p} sends `{sent}`, which it neither made nor received"));
                next.insert(sent.clone(), v.clone());
            }
            arrived = next;
            last_outputs = outs.into_iter().next().unwrap();
        }
        for (k, w) in &want {
            let got = last_outputs.get(k).unwrap_or_else(|| panic!("{name}: the last stage does not output `{k}`"));
            let err = rel(got, w);
            assert!(err <= 1e-12, "{name}: `{k}` off by {err:e}");
        }
    }
}

/// A layer that does not divide at the chosen degree is an error naming the layer, the
/// degree, the weights left whole and the degrees that do split it; each named degree splits
/// it entirely and the lenient sharder keeps exactly those weights whole.
#[test]
fn indivisible_layers_are_reported() {
    use smp_partition::codegen::CodegenError;
    for name in ["gpt2", "bert", "llama", "vit"] {
        let lg = model(name);
        let sharder = Sharder::new(&lg).unwrap();
        for t in [2, 4, 8] {
            for (li, l) in lg.layers.iter().enumerate() {
                match sharder.shard_layer_strict(li, t) {
                    Ok(shards) => assert_eq!(shards, sharder.shard_layer(li, t).unwrap()),
                    Err(CodegenError::Indivisible { layer, name: lname, tp, weights, working }) => {
                        eprintln!("{name} t={t} {lname}: whole {weights:?}, splits at {working:?}");
                        assert_eq!((layer, tp, lname.as_str()), (li, t, l.name.as_str()));
                        assert!(!weights.is_empty() && !working.contains(&t));
                        let sliced: Vec<String> = sharder.shard_layer(li, t).unwrap()[0].weight_slices.iter().map(|w| w.initializer.clone()).collect();
                        assert!(weights.iter().all(|w| !sliced.contains(w)), "{name} t={t}: {weights:?} vs {sliced:?}");
                        for &u in &working {
                            sharder.shard_layer_strict(li, u).unwrap_or_else(|e| panic!("{name} t={u}: {e}"));
                        }
                    }
                    Err(e) => panic!("{name} t={t} layer {li}: {e}"),
                }
            }
        }
    }
    // Llama's 4 query heads do not split 8 ways: its blocks report 2 and 4 among the degrees.
    let lg = model("llama");
    let sharder = Sharder::new(&lg).unwrap();
    let block = lg.layers.iter().position(|l| l.kind == LayerKind::Block).unwrap();
    let err = sharder.shard_layer_strict(block, 8).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("layer {block} (`{}`) does not split 8 ways", lg.layers[block].name)), "{msg}");
    let CodegenError::Indivisible { working, .. } = err else { panic!("{msg}") };
    assert!(working.starts_with(&[2, 4]), "{msg}");
}

/// A plan that replicates some matmuls (the MLP) keeps their weights whole; the combined
/// shards still reproduce the unsharded layer, and the rest of the block stays split.
#[test]
fn forced_replicate_nodes_reproduce_the_layer() {
    for (name, mlp) in [("gpt2", 2), ("llama", 3), ("bert", 2)] {
        let lg = model(name);
        let inputs = feeds(&lg.graph);
        let mut full = Exec::new(&lg.graph, &inputs);
        assert!(full.run_until_collective().is_none());
        let env: HashMap<String, T> = full.env.iter().map(|(&v, t)| (lg.graph.value(v).name.clone(), t.clone())).collect();
        let sharder = Sharder::new(&lg).unwrap();
        let li = lg.layers.iter().position(|l| l.kind == LayerKind::Block).unwrap();
        let layer = &lg.layers[li];
        let g = &lg.graph;
        let weight_mms: Vec<String> = layer
            .nodes
            .iter()
            .map(|&n| g.node(n))
            .filter(|n| matches!(n.op, Op::Known(smp_partition::ir::OpKind::MatMul | smp_partition::ir::OpKind::Gemm)))
            .filter(|n| n.inputs[1].is_some_and(|w| g.value(w).kind == smp_partition::ir::ValueKind::Initializer))
            .map(|n| n.name.clone())
            .collect();
        let keep = weight_mms[weight_mms.len() - mlp..].to_vec();
        for t in [2, 4] {
            let (shards, realised) = sharder.shard_layer_keeping(li, t, &keep).unwrap();
            for (node, s) in &realised {
                if keep.contains(node) {
                    assert_eq!(s.name(), "replicate", "{name} t={t} {node}");
                }
            }
            let split: Vec<&str> = realised.iter().map(|(_, s)| s.name()).filter(|s| *s != "replicate").collect();
            assert!(split.contains(&"column") && split.contains(&"heads") && split.contains(&"row"), "{name} t={t}: {realised:?}");
            // the heads split is the fused attention's (`passes::fuse`): it runs split by heads
            let attention: Vec<&str> = layer
                .nodes
                .iter()
                .map(|&n| g.node(n))
                .filter(|n| n.op.is(smp_partition::ir::OpKind::ScaledDotProductAttention))
                .map(|n| n.name.as_str())
                .collect();
            assert_eq!(attention.len(), 1, "{name}: the block's attention is fused");
            assert!(realised.iter().any(|(n, s)| n == attention[0] && s.name() == "heads"), "{name} t={t}: {realised:?}");
            validate_shards(&lg.graph, &shards).unwrap();
            let graphs: Vec<Graph> = shards.iter().map(|s| apply_shard(&lg.graph, &layer.nodes, s, &lg.dims).unwrap()).collect();
            for (r, o) in run_ranks(&graphs, &env).iter().enumerate() {
                for (vname, got) in o {
                    let err = rel(got, &env[vname]);
                    assert!(err <= 1e-12, "{name} t={t} rank {r}: `{vname}` off by {err:e}");
                }
            }
        }
    }
}

/// Sequence parallelism: every layer's t shards, with their reduce-scatters, scatters and
/// all-gathers, reproduce the unsharded layer (f64, norm-relative ≤ 1e-12) for every model
/// and t whose token count divides.
#[test]
fn sequence_parallel_shards_reproduce_each_layer() {
    for name in ["gpt2", "bert", "llama", "vit"] {
        let lg = model(name);
        let sharder = Sharder::new(&lg).unwrap().with_sequence_parallel(true);
        let block = lg.layers.iter().position(|l| l.kind == LayerKind::Block).unwrap();
        // tokens per sample: the token axis of the block's residual input
        let degrees: Vec<usize> = [2, 4]
            .into_iter()
            .filter(|&t| match sharder.shard_layer(block, t) {
                Ok(_) => true,
                Err(e) => {
                    assert!(matches!(e, smp_partition::codegen::CodegenError::SequenceIndivisible { .. }), "{name} t={t}: {e}");
                    eprintln!("{name} t={t}: {e}");
                    false
                }
            })
            .collect();
        if name != "vit" {
            assert_eq!(degrees, [2, 4], "{name}");
        }
        let all = check_with(name, &degrees, true);
        for (t, shards) in &all {
            for (layer, s) in lg.layers.iter().zip(shards) {
                if layer.kind != LayerKind::Block {
                    continue;
                }
                let rs = count(&s[0], |k| matches!(k, CollectiveKind::ReduceScatter { .. }));
                let ar = count(&s[0], |k| matches!(k, CollectiveKind::AllReduce));
                assert_eq!((rs, ar), (2, 0), "{name} t={t} {}: {:?}", layer.name, s[0].collectives);
            }
        }
    }
}

/// In a GPT-2 block, each all-reduce of plain tensor parallelism becomes a reduce-scatter of
/// the same value (two per block), the residual input is scattered, and all-gathers bring
/// the tokens back before the MLP and at the block's output; the norm weights and the
/// deferred biases that now see only a chunk of the tokens get their gradients summed.
#[test]
fn sequence_parallel_gpt2_block_has_reduce_scatter_all_gather_pairs() {
    let lg = model("gpt2");
    let tp = Sharder::new(&lg).unwrap();
    let sp = Sharder::new(&lg).unwrap().with_sequence_parallel(true);
    for (li, l) in lg.layers.iter().enumerate() {
        if l.kind != LayerKind::Block {
            continue;
        }
        for t in [2, 4] {
            let plain = &tp.shard_layer(li, t).unwrap()[0];
            let seq = &sp.shard_layer(li, t).unwrap()[0];
            let reduced: Vec<&str> = plain.collectives.iter().filter(|c| c.kind == CollectiveKind::AllReduce).map(|c| c.after_value.as_str()).collect();
            let scattered: Vec<&str> =
                seq.collectives.iter().filter(|c| matches!(c.kind, CollectiveKind::ReduceScatter { .. })).map(|c| c.after_value.as_str()).collect();
            assert_eq!(reduced.len(), 2, "{}: {:?}", l.name, plain.collectives);
            assert_eq!(scattered, reduced, "{}: {:?}", l.name, seq.collectives);
            let gathers = count(seq, |k| matches!(k, CollectiveKind::AllGather { .. }));
            let scatters = count(seq, |k| matches!(k, CollectiveKind::Scatter { .. }));
            assert_eq!((gathers, scatters), (2, 1), "{}: {:?}", l.name, seq.collectives);
            // the block output leaves whole: gathered under its own name
            let (_, outs) = smp_partition::codegen::shard::layer_boundary(&lg.graph, &l.nodes);
            for o in outs {
                let name = &lg.graph.value(o).name;
                assert!(
                    seq.collectives.iter().any(|c| &c.after_value == name && c.readers.is_empty() && matches!(c.kind, CollectiveKind::AllGather { .. })),
                    "{}: output `{name}` is not gathered: {:?}",
                    l.name,
                    seq.collectives
                );
            }
            let extra: std::collections::BTreeSet<&str> = seq.partial_gradients.iter().filter(|p| !plain.partial_gradients.contains(p)).map(|p| p.value.as_str()).collect();
            for w in ["ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias"] {
                assert!(extra.iter().any(|v| v.ends_with(w)), "{}: no partial gradient for {w}: {extra:?}", l.name);
            }
            assert!(plain.partial_gradients.iter().all(|p| seq.partial_gradients.contains(p)), "{}", l.name);
        }
    }
}

/// A token axis that does not divide by t is an error naming the layer, value, length and t.
#[test]
fn sequence_parallel_indivisible_sequence_is_reported() {
    use smp_partition::codegen::CodegenError;
    let lg = model_at("gpt2", 15);
    let sharder = Sharder::new(&lg).unwrap().with_sequence_parallel(true);
    let block = lg.layers.iter().position(|l| l.kind == LayerKind::Block).unwrap();
    let err = sharder.shard_layer(block, 2).unwrap_err();
    let msg = err.to_string();
    let CodegenError::SequenceIndivisible { layer, value, len, tp } = err else { panic!("{msg}") };
    assert_eq!((layer, len, tp), (block, 15, 2), "{msg}");
    assert!(msg.starts_with(&format!("layer {block}: sequence parallelism splits `{value}`")) && msg.contains("length 15") && msg.contains("tp = 2"), "{msg}");
    // without sequence parallelism the same layer splits
    Sharder::new(&lg).unwrap().shard_layer(block, 2).unwrap();
}
