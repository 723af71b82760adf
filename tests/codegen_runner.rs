//! Tensor-parallel shards on the libtorch single-device executor (feature `runner`): for every
//! models/ export and t ∈ {2, 4}, each layer's t shards, run in f32 and combined by their
//! inserted collectives, reproduce the layer's outputs of the unsharded model run in f64
//! (norm-relative ≤ 1e-5). The executor has no collective kernels, so each shard graph is cut at
//! its collectives (their results become inputs, their local parts outputs) and run repeatedly,
//! combining the parts between runs, until every collective has seen final inputs.
#![cfg(feature = "runner")]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use smp_partition::codegen::{Sharder, apply_shard};
use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{Dim, Graph, LayeredGraph, ValueId, ValueKind};
use smp_partition::passes::{AnalyzeOptions, analyze};
use smp_partition::runtime::{ExecOptions, Executor, InitMode, Weights};
use tch::{Device, Kind, Tensor};

const BATCH: i64 = 2;
const SEQ: i64 = 16;

fn model(name: &str) -> LayeredGraph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(format!("{name}.onnx"));
    let m = load_model(&path).unwrap();
    let opts = AnalyzeOptions {
        seq_len: (name != "vit").then_some(SEQ),
        dims: BTreeMap::from([("batch".to_string(), BATCH)]),
    };
    analyze(m.graph, &opts).unwrap()
}

fn dims_of(g: &Graph, v: ValueId, lg: &LayeredGraph) -> Vec<i64> {
    let shape = g.value(v).ty.as_ref().and_then(|t| t.shape.as_ref()).expect("shape-inferred shard");
    shape
        .0
        .iter()
        .enumerate()
        .map(|(i, d)| match d {
            Dim::Known(k) => *k,
            Dim::Sym(s) => lg.dims.values.get(s).copied().unwrap_or(if i == 0 { BATCH } else { SEQ }),
        })
        .collect()
}

/// Deterministic graph inputs: token ids below 256, or values in [-1, 1).
fn inputs(g: &Graph, lg: &LayeredGraph) -> Vec<(String, Tensor)> {
    tch::manual_seed(7);
    g.inputs
        .iter()
        .filter(|&&v| g.value(v).kind == ValueKind::Input)
        .map(|&v| {
            let val = g.value(v);
            let dims = dims_of(g, v, lg);
            let dtype = val.ty.as_ref().unwrap().dtype;
            let t = if dtype.is_float() {
                Tensor::rand(dims.as_slice(), (Kind::Double, Device::Cpu)) * 2.0 - 1.0
            } else {
                Tensor::randint(256, dims.as_slice(), (Kind::Int64, Device::Cpu))
            };
            (val.name.clone(), t)
        })
        .collect()
}

fn norm_rel(got: &Tensor, want: &Tensor) -> f64 {
    let g = got.to_kind(Kind::Double);
    let w = want.to_kind(Kind::Double);
    (&g - &w).norm().double_value(&[]) / w.norm().double_value(&[]).max(1e-30)
}

/// A shard graph cut at its collectives: (kind, axis, local part, result) per collective.
struct Cut {
    graph: Graph,
    collectives: Vec<(String, usize, ValueId, ValueId)>,
    outputs: usize,
}

fn cut(mut g: Graph) -> Cut {
    let outputs = g.outputs.len();
    let mut collectives = Vec::new();
    let ids: Vec<_> = g.node_ids().collect();
    for id in ids {
        let node = g.node(id).clone();
        let Some((kind, _)) = node.op.collective() else { continue };
        let (op_type, axis) = (kind.name().to_string(), kind.axis().unwrap_or(0));
        let (local, result) = (node.inputs[0].unwrap(), node.outputs[0]);
        g.remove_node(id);
        g.value_mut(result).kind = ValueKind::Input;
        g.inputs.push(result);
        g.outputs.push(local);
        collectives.push((op_type, axis, local, result));
    }
    Cut { graph: g, collectives, outputs }
}

#[test]
fn shards_reproduce_each_layer_in_f32() {
    check_f32(&[("gpt2", &[2, 4]), ("bert", &[2, 4]), ("llama", &[2, 4]), ("vit", &[2, 4])], false);
}

/// The same with sequence parallelism (ViT's 17 tokens do not divide by 2 or 4).
#[test]
fn sequence_parallel_shards_reproduce_each_layer_in_f32() {
    check_f32(&[("gpt2", &[2, 4]), ("bert", &[2, 4]), ("llama", &[2, 4])], true);
}

/// Each layer's shards, run in f32 by the runner's executor and combined by their collectives,
/// reproduce the f64 model's layer outputs (norm-relative ≤ 1e-5).
fn check_f32(models: &[(&str, &[usize])], sequence_parallel: bool) {
    for &(name, degrees) in models {
        let lg = model(name);
        // The whole model in f64, every layer boundary value an output.
        let mut full = lg.graph.clone();
        for l in &lg.layers {
            for &v in l.inputs.iter().chain(&l.outputs) {
                if !full.outputs.contains(&v) && full.value(v).kind != ValueKind::Input {
                    full.outputs.push(v);
                }
            }
        }
        let feeds = inputs(&full, &lg);
        let weights = Weights::load(&full, InitMode::Load, Some(Kind::Double)).unwrap();
        let ex = Executor::new(&full, weights, ExecOptions { float_kind: Some(Kind::Double), training: false, autocast: None }).unwrap();
        let bound = ex.bind_inputs(feeds.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()).unwrap();
        let outs = ex.forward(&bound).unwrap();
        let mut env: HashMap<String, Tensor> = full.outputs.iter().zip(outs).map(|(&v, t)| (full.value(v).name.clone(), t)).collect();
        for (n, t) in &feeds {
            env.insert(n.clone(), t.shallow_clone());
        }

        let sharder = Sharder::new(&lg).unwrap().with_sequence_parallel(sequence_parallel);
        for &t in degrees {
            for (li, layer) in lg.layers.iter().enumerate() {
                let shards = sharder.shard_layer(li, t).unwrap();
                let cuts: Vec<Cut> =
                    shards.iter().map(|s| cut(apply_shard(&lg.graph, &layer.nodes, s, &lg.dims).unwrap())).collect();
                let execs: Vec<Executor> = cuts
                    .iter()
                    .map(|c| {
                        let w = Weights::load(&c.graph, InitMode::Load, Some(Kind::Float)).unwrap();
                        Executor::new(&c.graph, w, ExecOptions { float_kind: Some(Kind::Float), training: false, autocast: None }).unwrap()
                    })
                    .collect();
                // Collective results, zeros until computed.
                let mut results: Vec<HashMap<ValueId, Tensor>> = cuts
                    .iter()
                    .map(|c| {
                        c.collectives
                            .iter()
                            .map(|&(_, _, _, r)| (r, Tensor::zeros(dims_of(&c.graph, r, &lg).as_slice(), (Kind::Float, Device::Cpu))))
                            .collect()
                    })
                    .collect();
                let rounds = cuts[0].collectives.len() + 1;
                let mut last: Vec<Vec<Tensor>> = Vec::new();
                for _ in 0..rounds {
                    last = cuts
                        .iter()
                        .zip(&execs)
                        .zip(&results)
                        .map(|((c, ex), res)| {
                            let named: Vec<(String, Tensor)> = c
                                .graph
                                .inputs
                                .iter()
                                .filter(|&&v| c.graph.value(v).kind == ValueKind::Input)
                                .map(|&v| {
                                    let n = c.graph.value(v).name.clone();
                                    let t = res.get(&v).map(Tensor::shallow_clone).unwrap_or_else(|| {
                                        let t = env.get(&n).unwrap_or_else(|| panic!("{name}: no value for `{n}`"));
                                        if t.is_floating_point() { t.to_kind(Kind::Float) } else { t.shallow_clone() }
                                    });
                                    (n, t)
                                })
                                .collect();
                            ex.forward(&ex.bind_inputs(named).unwrap()).unwrap()
                        })
                        .collect();
                    for (k, (kind, axis, _, _)) in cuts[0].collectives.iter().enumerate() {
                        let axis = *axis;
                        let parts: Vec<Tensor> = cuts.iter().zip(&last).map(|(c, o)| o[c.outputs + k].shallow_clone()).collect();
                        let sum = || parts.iter().skip(1).fold(parts[0].copy(), |a, b| a + b);
                        for (rank, res) in results.iter_mut().enumerate() {
                            let v = match kind.as_str() {
                                "AllReduce" => sum(),
                                "AllGather" => Tensor::cat(&parts, axis as i64),
                                "ReduceScatter" => {
                                    let s = sum();
                                    let each = s.size()[axis] / t as i64;
                                    s.narrow(axis as i64, rank as i64 * each, each)
                                }
                                "Scatter" => {
                                    let each = parts[rank].size()[axis] / t as i64;
                                    parts[rank].narrow(axis as i64, rank as i64 * each, each)
                                }
                                o => panic!("unknown collective {o}"),
                            };
                            res.insert(cuts[rank].collectives[k].3, v);
                        }
                    }
                }
                for (rank, (c, o)) in cuts.iter().zip(&last).enumerate() {
                    for (i, &v) in c.graph.outputs[..c.outputs].iter().enumerate() {
                        let vname = &c.graph.value(v).name;
                        let want = &env[vname];
                        let err = norm_rel(&o[i], want);
                        assert!(err <= 1e-5, "{name} t={t} layer {li} ({}) rank {rank}: `{vname}` off by {err:e}", layer.name);
                    }
                }
            }
        }
    }
}
