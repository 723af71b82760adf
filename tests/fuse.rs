//! `passes::fuse` on real exports: the pass fires on the GELU chains of Hugging Face GPT-2
//! (models/gpt2.onnx, `gelu_new`) and on the eager attention of every bundled transformer, and
//! the fused graph trains (forward and gradients) as the unfused one; each attention pattern
//! variant is recognised and computes what its chain computes, near misses are left alone.
#![cfg(feature = "runner")]

mod common;

use std::path::PathBuf;

use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{DType, Graph, OpKind, Storage, Tensor as IrTensor};
use smp_partition::passes::fuse::{Fused, fuse};
use smp_partition::runtime::train::{self, AdamWConfig, LossKind, TrainConfig};
use smp_partition::runtime::{ExecOptions, Executor, InitMode, Weights};
use tch::{Kind, Tensor};

fn gpt2() -> Graph {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx");
    load_model(&path).expect("models/gpt2.onnx").graph
}

/// Trains `graph` 3 steps in `kind` on one fixed batch; the losses and the trained weights by
/// initializer name.
fn train3(graph: &Graph, kind: Kind) -> (Vec<f64>, Vec<(String, Tensor)>) {
    let weights = Weights::load(graph, InitMode::Load, Some(kind)).expect("weights");
    let exec = Executor::new(graph, weights, ExecOptions { float_kind: Some(kind), training: true, autocast: None }).expect("executor");
    let batch = smp_partition::runtime::data::synthetic_batch(&exec, 4, 32, 7).expect("batch");
    let cfg = TrainConfig { steps: 3, microbatches: 2, loss: LossKind::CausalLm, adamw: AdamWConfig::default(), clip: Some(1.0), ..TrainConfig::default() };
    let recs = train::train(&exec, &batch, &cfg).expect("train");
    (recs.iter().map(|r| r.loss).collect(), exec.parameters())
}

/// max |a − b| / max |b| over every trained tensor, and the largest relative loss difference.
fn distance(a: &(Vec<f64>, Vec<(String, Tensor)>), b: &(Vec<f64>, Vec<(String, Tensor)>)) -> (f64, f64) {
    let loss = a.0.iter().zip(&b.0).map(|(x, y)| (x - y).abs() / y.abs()).fold(0.0, f64::max);
    assert_eq!(a.1.len(), b.1.len());
    let mut w: f64 = 0.0;
    for ((na, ta), (nb, tb)) in a.1.iter().zip(&b.1) {
        assert_eq!(na, nb);
        let diff = (ta - tb).abs().max().double_value(&[]);
        let scale = tb.abs().max().double_value(&[]).max(1e-30);
        w = w.max(diff / scale);
    }
    (loss, w)
}

fn fused(graph: &Graph) -> Graph {
    let mut g = graph.clone();
    let f = Fused::of(&fuse(&mut g));
    assert_eq!(f, Fused { gelu_tanh: 4, gelu_erf: 0, attention: 4, ..Fused::default() }, "one GELU and one attention per GPT-2 block");
    g.verify().expect("fused graph verifies");
    let gelus = g.node_ids().filter(|&n| g.node(n).op.is(OpKind::Gelu)).count();
    assert_eq!(gelus, 4);
    g
}

#[test]
fn fused_gpt2_trains_as_unfused_in_f64() {
    // The export stores the chain's constants in f32 (0.044715 and √(2/π) rounded); with them
    // exact, the chain is torch's tanh-GELU formula, and f64 training must agree to rounding.
    let mut graph = gpt2();
    let exact = [0.044715_f64, (2.0 / std::f64::consts::PI).sqrt()];
    let mut replaced = 0;
    for v in graph.value_ids().collect::<Vec<_>>() {
        let val = graph.value_mut(v);
        let Some(data) = val.data.as_ref().filter(|d| d.numel() == 1 && d.dtype == DType::F32) else { continue };
        let Some(c) = data.to_f64_vec().and_then(|x| x.first().copied()) else { continue };
        if let Some(&e) = exact.iter().find(|&&e| (c - e).abs() < 1e-6 * e) {
            let t = IrTensor { dtype: DType::F64, dims: data.dims.clone(), storage: Storage::Raw(e.to_le_bytes().to_vec().into()) };
            val.data = Some(t);
            if let Some(ty) = val.ty.as_mut() {
                ty.dtype = DType::F64;
            }
            replaced += 1;
        }
    }
    assert!(replaced >= 2, "the chain's constants were found ({replaced})");
    let unfused = train3(&graph, Kind::Double);
    let fused = train3(&fused(&graph), Kind::Double);
    let (loss, w) = distance(&fused, &unfused);
    assert!(loss < 1e-12 && w < 1e-11, "fused vs unfused f64: loss {loss:.2e}, weights {w:.2e}");
}

#[test]
fn fused_gpt2_trains_as_unfused_in_f32() {
    let graph = gpt2();
    let unfused = train3(&graph, Kind::Float);
    let fused = train3(&fused(&graph), Kind::Float);
    // losses only: in f32 Adam turns the rounding of gradients that are zero in exact
    // arithmetic into ±lr steps (see tests/train_oracle.py), the f64 test checks the weights
    let (loss, _) = distance(&fused, &unfused);
    assert!(loss < 1e-5, "fused vs unfused f32: loss {loss:.2e}");
}

// ---------------------------------------------------------------------------------------------
// Attention: `passes::fuse` rewrites eager softmax attention into `ScaledDotProductAttention`.

use smp_partition::frontend::onnx::load_model as load;
use smp_partition::ir::{AttentionMask, Attrs, FusedOp, Node, Op, Shape, TensorType, ValueId, ValueKind};
use smp_partition::passes::{self, AnalyzeOptions};

/// The bundled exports with eager attention (all of `models/` but the CNN and graph-only ones),
/// with the loss each trains with in the runner's tests.
const ATTENTION_MODELS: [&str; 7] = ["gpt2", "llama", "opt", "phi", "bert", "roberta", "vit"];

fn model(name: &str) -> Graph {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("models/{name}.onnx"));
    load(&path).unwrap_or_else(|e| panic!("models/{name}.onnx: {e}")).graph
}

/// The model as the planner and the runner run it: specialised (dims bound, shape arithmetic
/// folded), before fusion.
fn specialised(name: &str) -> Graph {
    let opts = AnalyzeOptions { seq_len: Some(16), ..Default::default() };
    let g = model(name);
    let symbolic = g.inputs.first().and_then(|&v| g.value(v).ty.as_ref()).and_then(|t| t.shape.as_ref()).is_some_and(|s| s.0.get(1).is_some_and(|d| d.known().is_none()));
    let opts = if symbolic { opts } else { AnalyzeOptions::default() };
    passes::specialise(g, &opts).unwrap_or_else(|e| panic!("{name}: {e}")).0
}

/// Output 0 of `graph` and the gradient of Σ output·R (R fixed) for every trained tensor, in
/// `kind`, on one synthetic batch of 2 samples.
fn forward_and_grads(graph: &Graph, kind: Kind) -> (Tensor, Vec<(String, Tensor)>) {
    let weights = Weights::load(graph, InitMode::Load, Some(kind)).expect("weights");
    let exec = Executor::new(graph, weights, ExecOptions { float_kind: Some(kind), training: true, autocast: None }).expect("executor");
    let batch = smp_partition::runtime::data::synthetic_batch(&exec, 2, 16, 7).expect("batch");
    let feeds = exec.bind_inputs(batch).expect("inputs");
    let outs = exec.forward(&feeds).expect("forward");
    let y = &outs[0];
    let r = common::fixed_tensor(&y.size(), kind, 11.0);
    (y * &r).sum(kind).backward();
    let grads = exec.parameters().into_iter().map(|(n, p)| (n, p.grad())).collect();
    (y.detach(), grads)
}

/// max |a − b| / max |b|.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).abs().max().double_value(&[]);
    d / b.abs().max().double_value(&[]).max(1e-300)
}

#[test]
fn every_bundled_export_fuses_its_attention_and_computes_the_same_in_f64() {
    for name in ATTENTION_MODELS {
        let unfused = specialised(name);
        let mut all = unfused.clone();
        let records = fuse(&mut all);
        all.verify().unwrap_or_else(|e| panic!("{name}: {e}"));
        // attention alone (GPT-2's GELU chains hold f32-rounded constants, see above): its
        // records replayed on the unfused graph
        let mut fused = unfused.clone();
        for r in records.iter().filter(|r| matches!(r.op, FusedOp::Attention { .. })) {
            smp_partition::passes::fuse::apply(&mut fused, r).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        fused.verify().unwrap_or_else(|e| panic!("{name}: {e}"));
        let f = Fused::of(&records);
        assert_eq!(f.attention, 4, "{name}: one attention per block ({f})");
        let sdpa = fused.node_ids().filter(|&n| fused.node(n).op.is(OpKind::ScaledDotProductAttention)).count();
        assert_eq!(sdpa, 4, "{name}");
        assert_eq!(unfused.node_ids().filter(|&n| unfused.node(n).op.is(OpKind::Softmax)).count(), 4, "{name}");
        assert_eq!(fused.node_ids().filter(|&n| fused.node(n).op.is(OpKind::Softmax)).count(), 0, "{name}: every softmax fused");
        // the raw import (the runner's `train` without a plan) fuses them too
        let mut raw = model(name);
        assert_eq!(Fused::of(&fuse(&mut raw)).attention, 4, "{name}: raw import");

        let (yu, gu) = forward_and_grads(&unfused, Kind::Double);
        let (yf, gf) = forward_and_grads(&fused, Kind::Double);
        let out = rel(&yf, &yu);
        assert!(out < 1e-9, "{name}: output differs by {out:.2e}");
        assert_eq!(gu.len(), gf.len());
        // per tensor, relative to its largest element, or to a millionth of the largest gradient
        // for tensors whose gradient is zero in exact arithmetic (OPT's key biases: a per-row
        // constant the softmax cancels; both graphs give rounding noise there)
        let scale = gu.iter().filter(|(_, t)| t.defined()).map(|(_, t)| t.abs().max().double_value(&[])).fold(0.0, f64::max);
        let mut worst: (f64, &str) = (0.0, "");
        for ((nu, tu), (nf, tf)) in gu.iter().zip(&gf) {
            assert_eq!(nu, nf);
            assert_eq!(tu.defined(), tf.defined(), "{name}: `{nu}` has a gradient in one graph only");
            if tu.defined() {
                let d = (tf - tu).abs().max().double_value(&[]) / tu.abs().max().double_value(&[]).max(1e-6 * scale);
                if d > worst.0 {
                    worst = (d, nu);
                }
            }
        }
        assert!(worst.0 < 1e-9, "{name}: the gradient of `{}` differs by {:.2e}", worst.1, worst.0);
    }
}

#[test]
fn fused_attention_runs_in_f32_like_the_chain() {
    for name in ["gpt2", "llama"] {
        let unfused = specialised(name);
        let mut fused = unfused.clone();
        for r in fuse(&mut unfused.clone()).iter().filter(|r| matches!(r.op, FusedOp::Attention { .. })) {
            smp_partition::passes::fuse::apply(&mut fused, r).unwrap();
        }
        let (yu, gu) = forward_and_grads(&unfused, Kind::Float);
        let (yf, gf) = forward_and_grads(&fused, Kind::Float);
        assert_eq!(yf.kind(), Kind::Float);
        assert!(rel(&yf, &yu) < 1e-4, "{name}: f32 output {:.2e}", rel(&yf, &yu));
        for ((n, tu), (_, tf)) in gu.iter().zip(&gf) {
            if tu.defined() {
                assert!(rel(tf, tu) < 1e-3, "{name}: f32 gradient of `{n}` {:.2e}", rel(tf, tu));
            }
        }
    }
}

/// A small attention graph: inputs q `[2, 3, 5, 4]`, kᵀ `[2, 3, 4, 6]`, v `[2, 3, 6, 4]`, built
/// node by node.
struct Attn {
    g: Graph,
    n: u32,
}

impl Attn {
    fn new() -> (Attn, ValueId, ValueId, ValueId) {
        let mut a = Attn { g: Graph::new("attention"), n: 0 };
        a.g.opsets.insert(String::new(), 18);
        let q = a.input("q", DType::F32, &[2, 3, 5, 4]);
        let kt = a.input("kt", DType::F32, &[2, 3, 4, 6]);
        let v = a.input("v", DType::F32, &[2, 3, 6, 4]);
        (a, q, kt, v)
    }
    fn input(&mut self, name: &str, dtype: DType, dims: &[i64]) -> ValueId {
        let v = self.g.add_value(name, ValueKind::Input, Some(TensorType { dtype, shape: Some(Shape::from_known(dims)) }), None).unwrap();
        self.g.inputs.push(v);
        v
    }
    fn konst(&mut self, t: IrTensor) -> ValueId {
        self.n += 1;
        self.g.add_value(format!("c{}", self.n), ValueKind::Initializer, None, Some(t)).unwrap()
    }
    fn scalar(&mut self, x: f32) -> ValueId {
        self.konst(IrTensor::from_f32(vec![], &[x]))
    }
    fn op(&mut self, k: OpKind, ins: &[ValueId], attrs: &[(&str, smp_partition::ir::Attr)], dtype: DType, dims: &[i64]) -> ValueId {
        self.n += 1;
        let ty = Some(TensorType { dtype, shape: Some(Shape::from_known(dims)) });
        let out = self.g.add_value(format!("v{}", self.n), ValueKind::Intermediate, ty, None).unwrap();
        let mut a = Attrs::default();
        for (name, v) in attrs {
            a.set(name, v.clone());
        }
        let node = Node { name: format!("n{}", self.n), op: Op::Known(k), attrs: a, inputs: ins.iter().map(|&v| Some(v)).collect(), outputs: vec![out], namespace: None, order: self.n };
        self.g.add_node(node).unwrap();
        out
    }
    fn f(&mut self, k: OpKind, ins: &[ValueId], dims: &[i64]) -> ValueId {
        self.op(k, ins, &[], DType::F32, dims)
    }
    fn softmax(&mut self, x: ValueId, axis: i64) -> ValueId {
        self.op(OpKind::Softmax, &[x], &[("axis", smp_partition::ir::Attr::Int(axis))], DType::F32, &[2, 3, 5, 6])
    }
    fn finish(mut self, out: ValueId) -> Graph {
        self.g.outputs.push(out);
        self.g
    }
}

const S: [i64; 4] = [2, 3, 5, 6];
const O: [i64; 4] = [2, 3, 5, 4];

/// The pattern variants: (name, graph, expected scale, expected mask).
fn variants() -> Vec<(&'static str, Graph, f64, Option<AttentionMask>)> {
    let mut out = Vec::new();
    // GPT-2, Llama, BERT: Mul by a constant, Add of a float mask, Softmax, MatMul
    {
        let (mut a, q, kt, v) = Attn::new();
        let m = a.input("mask", DType::F32, &[2, 1, 5, 6]);
        let c = a.scalar(0.25);
        let s = a.f(OpKind::MatMul, &[q, kt], &S);
        let s = a.f(OpKind::Mul, &[s, c], &S);
        let s = a.f(OpKind::Add, &[s, m], &S);
        let p = a.softmax(s, -1);
        let o = a.f(OpKind::MatMul, &[p, v], &O);
        out.push(("mul scale, additive mask", a.finish(o), 0.25, Some(AttentionMask::Additive)));
    }
    // Div by √d, no mask, softmax axis written as 3
    {
        let (mut a, q, kt, v) = Attn::new();
        let c = a.scalar(2.0);
        let s = a.f(OpKind::MatMul, &[q, kt], &S);
        let s = a.f(OpKind::Div, &[s, c], &S);
        let p = a.softmax(s, 3);
        let o = a.f(OpKind::MatMul, &[p, v], &O);
        out.push(("div scale, no mask", a.finish(o), 0.5, None));
    }
    // torch.onnx's SDPA decomposition: √scale on q and on kᵀ, mask first in the Add
    {
        let (mut a, q, kt, v) = Attn::new();
        let m = a.input("mask", DType::F32, &[5, 6]);
        let (c1, c2) = (a.scalar(0.5), a.scalar(0.5));
        let qs = a.f(OpKind::Mul, &[q, c1], &O);
        let ks = a.f(OpKind::Mul, &[c2, kt], &[2, 3, 4, 6]);
        let s = a.f(OpKind::MatMul, &[qs, ks], &S);
        let s = a.f(OpKind::Add, &[m, s], &S);
        let p = a.softmax(s, -1);
        let o = a.f(OpKind::MatMul, &[p, v], &O);
        out.push(("sqrt scale on both sides", a.finish(o), 0.25, Some(AttentionMask::Additive)));
    }
    // OPT: no scale (q scaled upstream), mask added
    {
        let (mut a, q, kt, v) = Attn::new();
        let m = a.input("mask", DType::F32, &[2, 1, 5, 6]);
        let s = a.f(OpKind::MatMul, &[q, kt], &S);
        let s = a.f(OpKind::Add, &[s, m], &S);
        let p = a.softmax(s, -1);
        let o = a.f(OpKind::MatMul, &[p, v], &O);
        out.push(("no scale", a.finish(o), 1.0, Some(AttentionMask::Additive)));
    }
    // Where(bool mask, scores, lowest float), then an inactive Dropout
    {
        let (mut a, q, kt, v) = Attn::new();
        let m = a.input("keep", DType::Bool, &[1, 1, 5, 6]);
        let c = a.scalar(0.125);
        let lowest = a.scalar(f32::MIN);
        let ratio = a.scalar(0.1);
        let s = a.f(OpKind::MatMul, &[q, kt], &S);
        let s = a.f(OpKind::Mul, &[s, c], &S);
        let s = a.op(OpKind::Where, &[m, s, lowest], &[], DType::F32, &S);
        let p = a.softmax(s, -1);
        let p = a.f(OpKind::Dropout, &[p, ratio], &S);
        let o = a.f(OpKind::MatMul, &[p, v], &O);
        out.push(("bool mask, inactive dropout", a.finish(o), 0.125, Some(AttentionMask::Keep)));
    }
    out
}

/// Inputs for a variant graph: random q, kᵀ, v (gradients on), a causal keep/additive mask.
fn feeds(g: &Graph, kind: Kind) -> Vec<(String, Tensor)> {
    g.inputs
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let val = g.value(v);
            let dims = val.ty.as_ref().unwrap().shape.as_ref().unwrap().known().unwrap();
            let t = match val.name.as_str() {
                "keep" => Tensor::ones([5, 6], (Kind::Bool, tch::Device::Cpu)).tril(1).reshape(dims.as_slice()),
                "mask" => {
                    let keep = Tensor::ones([5, 6], (Kind::Bool, tch::Device::Cpu)).tril(1);
                    let add = Tensor::zeros([5, 6], (kind, tch::Device::Cpu)).masked_fill(&keep.logical_not(), f32::MIN as f64);
                    add.expand(dims.as_slice(), false).contiguous()
                }
                _ => common::fixed_tensor(&dims, kind, 3.0 + i as f64).set_requires_grad(true),
            };
            (val.name.clone(), t)
        })
        .collect()
}

/// The output and the gradients of q, kᵀ and v of Σ output·R.
fn run_variant(g: &Graph, kind: Kind) -> Vec<Tensor> {
    let weights = Weights::load(g, InitMode::Load, Some(kind)).expect("weights");
    let exec = Executor::new(g, weights, ExecOptions { float_kind: Some(kind), training: true, autocast: None }).expect("executor");
    let named = feeds(g, kind);
    let leaves: Vec<Tensor> = named.iter().filter(|(n, _)| ["q", "kt", "v"].contains(&n.as_str())).map(|(_, t)| t.shallow_clone()).collect();
    let bound = exec.bind_inputs(named).expect("inputs");
    let y = exec.forward(&bound).expect("forward").remove(0);
    let r = common::fixed_tensor(&y.size(), kind, 5.0);
    (&y * &r).sum(kind).backward();
    let mut out = vec![y.detach()];
    out.extend(leaves.iter().map(Tensor::grad));
    out
}

#[test]
fn each_attention_variant_is_recognised_and_computes_the_chain_in_f32_and_f64() {
    for (what, unfused, scale, mask) in variants() {
        let mut g = unfused.clone();
        let records = fuse(&mut g);
        assert_eq!(records.len(), 1, "{what}: {records:?}");
        let f = &records[0];
        assert_eq!(f.op, FusedOp::Attention { scale: smp_partition::ir::AttentionScale(scale), mask }, "{what}");
        g.verify().unwrap();
        assert_eq!(g.node_count(), 1, "{what}: the chain is one node");
        let node = g.node(f.node);
        assert!(node.op.is(OpKind::ScaledDotProductAttention), "{what}");
        let names: Vec<&str> = node.inputs.iter().flatten().map(|&v| g.value(v).name.as_str()).collect();
        let mut want = vec!["q", "kt", "v"];
        want.extend(unfused.inputs.iter().map(|&v| unfused.value(v).name.as_str()).filter(|n| ["mask", "keep"].contains(n)));
        assert_eq!(names, want, "{what}");
        // shape inference knows the op
        passes::shape_infer::infer_shapes(&mut g, &Default::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
        for (kind, tol) in [(Kind::Double, 1e-12), (Kind::Float, 1e-5)] {
            let a = run_variant(&unfused, kind);
            let b = run_variant(&g, kind);
            for (i, (x, y)) in b.iter().zip(&a).enumerate() {
                assert_eq!(x.kind(), kind);
                let d = rel(x, y);
                assert!(d < tol, "{what} {kind:?}: tensor {i} (output, dq, dkᵀ, dv) differs by {d:.2e}");
            }
        }
    }
}

#[test]
fn near_misses_of_attention_are_left_alone() {
    let chain = |f: &dyn Fn(&mut Attn, ValueId) -> ValueId, prob_out: bool| {
        let (mut a, q, kt, v) = Attn::new();
        let s = a.f(OpKind::MatMul, &[q, kt], &S);
        let p = f(&mut a, s);
        let o = a.f(OpKind::MatMul, &[p, v], &O);
        let mut g = a.finish(o);
        if prob_out {
            g.outputs.push(p);
        }
        g
    };
    let cases: Vec<(&str, Graph)> = vec![
        ("probabilities are a graph output", chain(&|a, s| a.softmax(s, -1), true)),
        ("softmax over another axis", chain(&|a, s| a.softmax(s, 2), false)),
        (
            "a scale of several values",
            chain(
                &|a, s| {
                    let c = a.konst(IrTensor::from_f32(vec![6], &[0.5; 6]));
                    let s = a.f(OpKind::Mul, &[s, c], &S);
                    a.softmax(s, -1)
                },
                false,
            ),
        ),
        (
            "dropout in training",
            chain(
                &|a, s| {
                    let p = a.softmax(s, -1);
                    let ratio = a.scalar(0.1);
                    let on = a.konst(IrTensor { dtype: DType::Bool, dims: vec![], storage: Storage::Raw(vec![1u8].into()) });
                    a.f(OpKind::Dropout, &[p, ratio, on], &S)
                },
                false,
            ),
        ),
        (
            "a Where filling a finite value",
            chain(
                &|a, s| {
                    let m = a.input("keep", DType::Bool, &[1, 1, 5, 6]);
                    let fill = a.scalar(-1e4);
                    let s = a.op(OpKind::Where, &[m, s, fill], &[], DType::F32, &S);
                    a.softmax(s, -1)
                },
                false,
            ),
        ),
    ];
    for (what, g) in cases {
        let mut fused = g.clone();
        let records = fuse(&mut fused);
        assert!(records.is_empty(), "{what}: fused {records:?}");
        assert_eq!(fused.node_count(), g.node_count(), "{what}: the graph is unchanged");
    }
    // a scores MatMul read elsewhere too
    let (mut a, q, kt, v) = Attn::new();
    let s = a.f(OpKind::MatMul, &[q, kt], &S);
    let p = a.softmax(s, -1);
    let o = a.f(OpKind::MatMul, &[p, v], &O);
    let mut g = a.finish(o);
    g.outputs.push(s);
    assert!(fuse(&mut g).is_empty(), "scores read outside the chain");
}

#[test]
fn attention_records_that_do_not_fit_are_refused_naming_the_node() {
    let (_, unfused, _, _) = variants().remove(0);
    let mut g = unfused.clone();
    let f = fuse(&mut g).pop().unwrap();
    let node = unfused.node(f.node).name.clone();
    let refused = |f: &smp_partition::ir::Fusion, want: &str| {
        let err = smp_partition::passes::fuse::apply(&mut unfused.clone(), f).unwrap_err().to_string();
        assert!(err.contains(&format!("`{node}`")) && err.contains(want), "{err}");
    };
    let FusedOp::Attention { scale, .. } = f.op else { panic!("{:?}", f.op) };
    refused(&smp_partition::ir::Fusion { op: FusedOp::Attention { scale: smp_partition::ir::AttentionScale(0.5), mask: Some(AttentionMask::Additive) }, ..f.clone() }, "scale by 0.25");
    refused(&smp_partition::ir::Fusion { op: FusedOp::Attention { scale, mask: None }, ..f.clone() }, "reads 3 inputs");
    refused(&smp_partition::ir::Fusion { op: FusedOp::Attention { scale, mask: Some(AttentionMask::Keep) }, ..f.clone() }, "mask");
    refused(&smp_partition::ir::Fusion { inputs: vec![f.inputs[1], f.inputs[0], f.inputs[2], f.inputs[3]], replaces: f.replaces[1..].to_vec(), ..f.clone() }, "outside it");
    smp_partition::passes::fuse::apply(&mut unfused.clone(), &f).unwrap();
}

// ---------------------------------------------------------------------------------------------
// RMSNorm and SwiGLU: `passes::fuse` rewrites them into `RMSNormalization` and `SwiGlu`.

const X: [i64; 3] = [2, 5, 8];

/// A graph of inputs `x` `[2, 5, 8]`, `w` `[8]` and the RMSNorm chain `build` makes of them.
fn norm_graph(build: &dyn Fn(&mut Attn, ValueId) -> ValueId) -> Graph {
    let mut a = Attn { g: Graph::new("rms_norm"), n: 0 };
    a.g.opsets.insert(String::new(), 18);
    let x = a.input("x", DType::F32, &X);
    let w = a.input("w", DType::F32, &[8]);
    let n = build(&mut a, x);
    let y = a.f(OpKind::Mul, &[w, n], &X);
    a.finish(y)
}

/// `ReduceMean(sq, [axis], keepdims 1) + ε` (ε first when `eps_first`), then its Sqrt.
fn root_of_mean(a: &mut Attn, sq: ValueId, axis: i64, eps_first: bool) -> ValueId {
    let axes = a.konst(IrTensor::from_i64(vec![1], &[axis]));
    let mut kept = X.to_vec();
    let ax = if axis < 0 { (axis + 3) as usize } else { axis as usize };
    kept[ax] = 1;
    let m = a.op(OpKind::ReduceMean, &[sq, axes], &[("keepdims", smp_partition::ir::Attr::Int(1))], DType::F32, &kept);
    let eps = a.scalar(1e-6);
    let s = a.f(OpKind::Add, &(if eps_first { [eps, m] } else { [m, eps] }), &kept);
    a.f(OpKind::Sqrt, &[s], &kept)
}

/// The RMSNorm variants: (name, graph).
fn norm_variants() -> Vec<(&'static str, Graph)> {
    vec![
        (
            "HF Llama: Pow, Reciprocal(Sqrt), x first",
            norm_graph(&|a, x| {
                let two = a.scalar(2.0);
                let sq = a.f(OpKind::Pow, &[x, two], &X);
                let r = root_of_mean(a, sq, -1, false);
                let r = a.f(OpKind::Reciprocal, &[r], &[2, 5, 1]);
                a.f(OpKind::Mul, &[x, r], &X)
            }),
        ),
        (
            "Mul(x, x), ε first, Div(1, Sqrt), root first, axis written as 2",
            norm_graph(&|a, x| {
                let sq = a.f(OpKind::Mul, &[x, x], &X);
                let r = root_of_mean(a, sq, 2, true);
                let one = a.scalar(1.0);
                let r = a.f(OpKind::Div, &[one, r], &[2, 5, 1]);
                a.f(OpKind::Mul, &[r, x], &X)
            }),
        ),
        ("HF under mixed precision: Cast up to f32, the norm, Cast back, bf16 weight", {
            use smp_partition::ir::Attr;
            let mut a = Attn { g: Graph::new("rms_norm"), n: 0 };
            a.g.opsets.insert(String::new(), 18);
            let x = a.input("x", DType::BF16, &X);
            let w = a.input("w", DType::BF16, &[8]);
            let x32 = a.op(OpKind::Cast, &[x], &[("to", Attr::Int(1))], DType::F32, &X);
            let two = a.scalar(2.0);
            let sq = a.f(OpKind::Pow, &[x32, two], &X);
            let r = root_of_mean(&mut a, sq, -1, false);
            let r = a.f(OpKind::Reciprocal, &[r], &[2, 5, 1]);
            let n = a.f(OpKind::Mul, &[x32, r], &X);
            let n = a.op(OpKind::Cast, &[n], &[("to", Attr::Int(16))], DType::BF16, &X);
            let y = a.op(OpKind::Mul, &[w, n], &[], DType::BF16, &X);
            a.finish(y)
        }),
        (
            "Div(x, Sqrt)",
            norm_graph(&|a, x| {
                let two = a.scalar(2.0);
                let sq = a.f(OpKind::Pow, &[x, two], &X);
                let r = root_of_mean(a, sq, -1, false);
                a.f(OpKind::Div, &[x, r], &X)
            }),
        ),
    ]
}

/// The SwiGLU variants over inputs `g` and `u` `[2, 5, 8]`: (name, graph).
fn swiglu_variants() -> Vec<(&'static str, Graph)> {
    let make = |gate_first: bool, sig_first: bool| {
        let mut a = Attn { g: Graph::new("swiglu"), n: 0 };
        a.g.opsets.insert(String::new(), 18);
        let g = a.input("g", DType::F32, &X);
        let u = a.input("u", DType::F32, &X);
        let s = a.f(OpKind::Sigmoid, &[g], &X);
        let act = a.f(OpKind::Mul, &(if sig_first { [s, g] } else { [g, s] }), &X);
        let y = a.f(OpKind::Mul, &(if gate_first { [act, u] } else { [u, act] }), &X);
        a.finish(y)
    };
    vec![("HF: Mul(Mul(g, Sigmoid(g)), u)", make(true, false)), ("Mul(u, Mul(Sigmoid(g), g))", make(false, true))]
}

/// The output and every input's gradient of Σ output·R, inputs fixed (gradients on).
fn run_with_input_grads(g: &Graph, kind: Kind) -> Vec<Tensor> {
    let weights = Weights::load(g, InitMode::Load, Some(kind)).expect("weights");
    let exec = Executor::new(g, weights, ExecOptions { float_kind: Some(kind), training: true, autocast: None }).expect("executor");
    let named = feeds(g, kind);
    let leaves: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
    let bound = exec.bind_inputs(named).expect("inputs");
    let y = exec.forward(&bound).expect("forward").remove(0);
    let r = common::fixed_tensor(&y.size(), kind, 5.0);
    (&y * &r).sum(kind).backward();
    let mut out = vec![y.detach()];
    out.extend(leaves.iter().map(Tensor::grad));
    out
}

/// Fuses `unfused`, which holds one chain, and returns its record after checking that it leaves
/// one node of `want` reading `inputs` (by name), that shapes infer, that the record replays to
/// the same graph, and that the node computes the chain in f64 (≤ 1e-12) and f32 (≤ 1e-5): the
/// output and every input's gradient.
fn fused_alone(what: &str, unfused: &Graph, want: OpKind, inputs: &[&str]) -> smp_partition::ir::Fusion {
    let mut g = unfused.clone();
    let records = fuse(&mut g);
    assert_eq!(records.len(), 1, "{what}: {records:?}");
    let f = records[0].clone();
    g.verify().unwrap();
    assert_eq!(g.node_count(), 1, "{what}: the chain is one node");
    let node = g.node(f.node);
    assert!(node.op.is(want), "{what}");
    let names: Vec<&str> = node.inputs.iter().flatten().map(|&v| g.value(v).name.as_str()).collect();
    assert_eq!(names, inputs, "{what}");
    passes::shape_infer::infer_shapes(&mut g, &Default::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
    // the replayed record gives the same graph
    let mut replayed = unfused.clone();
    smp_partition::passes::fuse::apply(&mut replayed, &f).unwrap();
    assert_eq!(format!("{replayed}"), format!("{g}"), "{what}");
    for (kind, tol) in [(Kind::Double, 1e-12), (Kind::Float, 1e-5)] {
        let a = run_with_input_grads(unfused, kind);
        let b = run_with_input_grads(&g, kind);
        assert_eq!(a.len(), 1 + inputs.len());
        for (i, (x, y)) in b.iter().zip(&a).enumerate() {
            assert_eq!(x.kind(), kind);
            let d = rel(x, y);
            assert!(d <= tol, "{what} {kind:?}: tensor {i} (output, then the inputs' gradients) differs by {d:.2e}");
        }
    }
    f
}

#[test]
fn each_rms_norm_and_swiglu_variant_is_recognised_and_computes_the_chain_in_f64_and_f32() {
    for (what, unfused) in norm_variants() {
        let f = fused_alone(what, &unfused, OpKind::RMSNormalization, &["x", "w"]);
        assert_eq!(f.op, FusedOp::RmsNorm { epsilon: smp_partition::ir::Epsilon(1e-6_f32 as f64) }, "{what}");
    }
    for (what, unfused) in swiglu_variants() {
        let f = fused_alone(what, &unfused, OpKind::SwiGlu, &["g", "u"]);
        assert_eq!(f.op, FusedOp::SwiGlu, "{what}");
    }
}

#[test]
fn near_misses_of_rms_norm_and_swiglu_are_left_alone() {
    let cases: Vec<(&str, Graph)> = vec![
        (
            "a mean over another axis",
            norm_graph(&|a, x| {
                let two = a.scalar(2.0);
                let sq = a.f(OpKind::Pow, &[x, two], &X);
                let r = root_of_mean(a, sq, 1, false);
                let r = a.f(OpKind::Reciprocal, &[r], &[2, 1, 8]);
                a.f(OpKind::Mul, &[x, r], &X)
            }),
        ),
        (
            "a cube",
            norm_graph(&|a, x| {
                let three = a.scalar(3.0);
                let sq = a.f(OpKind::Pow, &[x, three], &X);
                let r = root_of_mean(a, sq, -1, false);
                let r = a.f(OpKind::Reciprocal, &[r], &[2, 5, 1]);
                a.f(OpKind::Mul, &[x, r], &X)
            }),
        ),
        (
            "the root of another tensor's mean square",
            norm_graph(&|a, x| {
                let y = a.input("y", DType::F32, &X);
                let two = a.scalar(2.0);
                let sq = a.f(OpKind::Pow, &[y, two], &X);
                let r = root_of_mean(a, sq, -1, false);
                let r = a.f(OpKind::Reciprocal, &[r], &[2, 5, 1]);
                a.f(OpKind::Mul, &[x, r], &X)
            }),
        ),
        ("a SiLU of another tensor", {
            let mut a = Attn { g: Graph::new("swiglu"), n: 0 };
            let (g, h, u) = (a.input("g", DType::F32, &X), a.input("h", DType::F32, &X), a.input("u", DType::F32, &X));
            let s = a.f(OpKind::Sigmoid, &[h], &X);
            let act = a.f(OpKind::Mul, &[g, s], &X);
            let y = a.f(OpKind::Mul, &[act, u], &X);
            a.finish(y)
        }),
    ];
    for (what, g) in cases {
        let mut fused = g.clone();
        let records = fuse(&mut fused);
        assert!(records.is_empty(), "{what}: fused {records:?}");
    }
    // the activation read outside the chain
    let (_, mut g) = swiglu_variants().remove(0);
    let act = g.value_ids().find(|&v| g.value(v).producer.is_some_and(|p| g.node(p).op.is(OpKind::Mul) && g.node(p).inputs.iter().flatten().any(|&i| g.value(i).producer.is_some_and(|q| g.node(q).op.is(OpKind::Sigmoid))))).unwrap();
    g.outputs.push(act);
    assert!(fuse(&mut g).is_empty(), "the SiLU is a graph output");
}

#[test]
fn rms_norm_and_swiglu_records_that_do_not_fit_are_refused_naming_the_node() {
    let (_, unfused) = norm_variants().remove(0);
    let mut g = unfused.clone();
    let f = fuse(&mut g).pop().unwrap();
    let node = unfused.node(f.node).name.clone();
    let refused = |f: &smp_partition::ir::Fusion, want: &str| {
        let err = smp_partition::passes::fuse::apply(&mut unfused.clone(), f).unwrap_err().to_string();
        assert!(err.contains(&format!("`{node}`")) && err.contains(want), "{err}");
    };
    refused(&smp_partition::ir::Fusion { op: FusedOp::RmsNorm { epsilon: smp_partition::ir::Epsilon(1e-5) }, ..f.clone() }, "ε");
    refused(&smp_partition::ir::Fusion { op: FusedOp::SwiGlu, ..f.clone() }, "SwiGLU");
    smp_partition::passes::fuse::apply(&mut unfused.clone(), &f).unwrap();
}

#[test]
fn llama_fuses_its_norms_and_gates_and_computes_the_same_in_f64() {
    let unfused = specialised("llama");
    let mut all = unfused.clone();
    let records = fuse(&mut all);
    all.verify().unwrap();
    let f = Fused::of(&records);
    // two norms per block and the final one; one gated MLP per block
    assert_eq!((f.rms_norm, f.swiglu, f.attention), (9, 4, 4), "{f}");
    for k in [OpKind::Pow, OpKind::ReduceMean, OpKind::Sqrt, OpKind::Reciprocal, OpKind::Sigmoid] {
        assert_eq!(all.node_ids().filter(|&n| all.node(n).op.is(k)).count(), 0, "every {k} fused");
    }
    // the norm and gate records alone, replayed on the unfused graph
    let mut fused = unfused.clone();
    for r in records.iter().filter(|r| matches!(r.op, FusedOp::RmsNorm { .. } | FusedOp::SwiGlu)) {
        smp_partition::passes::fuse::apply(&mut fused, r).unwrap();
    }
    computes_the_same_in_f64("llama", &unfused, &fused);
}

/// `fused` computes what `unfused` computes in f64 within 1e-12, its output and every gradient.
fn computes_the_same_in_f64(name: &str, unfused: &Graph, fused: &Graph) {
    let (yu, gu) = forward_and_grads(unfused, Kind::Double);
    let (yf, gf) = forward_and_grads(fused, Kind::Double);
    let out = rel(&yf, &yu);
    assert!(out <= 1e-12, "{name}: output differs by {out:.2e}");
    assert_eq!(gu.len(), gf.len());
    for ((nu, tu), (_, tf)) in gu.iter().zip(&gf) {
        assert_eq!(tu.defined(), tf.defined(), "{name}: `{nu}`");
        if tu.defined() {
            let d = rel(tf, tu);
            assert!(d <= 1e-12, "{name}: the gradient of `{nu}` differs by {d:.2e}");
        }
    }
}

/// Seeded batches drawn on two threads at once are each the batch its seed draws alone: the
/// draws come from libtorch's one global generator (this binary's tests draw in parallel, and
/// once gave the fused and unfused Llama different tokens).
#[test]
fn seeded_batches_drawn_on_two_threads_at_once_are_their_own() {
    let g = specialised("gpt2");
    let draw = |seed: i64| -> Vec<Vec<f64>> {
        let weights = Weights::load(&g, InitMode::Load, Some(Kind::Float)).expect("weights");
        let exec = Executor::new(&g, weights, ExecOptions { float_kind: Some(Kind::Float), training: false, autocast: None }).expect("executor");
        let batch = smp_partition::runtime::data::synthetic_batch(&exec, 4, 64, seed).expect("batch");
        batch.into_iter().map(|(_, t)| Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).expect("values")).collect()
    };
    let alone = [draw(7), draw(8)];
    std::thread::scope(|s| {
        for (i, seed) in [7i64, 8].into_iter().enumerate() {
            let (draw, want) = (&draw, &alone[i]);
            s.spawn(move || {
                for round in 0..100 {
                    let got = draw(seed);
                    assert!(&got == want, "seed {seed}, round {round}: another thread's numbers");
                }
            });
        }
    });
}

// Rotary embedding: the `ApplyRotary` kernel against the chains HF's exports write (the
// dynamo exporter's Llama `rotate_half`, and GPT-J's `rotate_every_two`).

const Q: [i64; 4] = [2, 3, 5, 8];

/// Inputs `x` `[2, 3, 5, 8]`, `cos` and `sin` `[2, 1, 5, 8]`, and the rotation `rot` makes of
/// `x`, then `x·cos + rot·sin` (each form as the exporter writes it).
fn rotary_graph(rot: &dyn Fn(&mut Attn, ValueId) -> ValueId) -> Graph {
    rotary_chain(rot, false)
}

/// [`rotary_graph`], with every operand order swapped when `swap`
/// (`Add(Mul(sin, rot), Mul(cos, x))`).
fn rotary_chain(rot: &dyn Fn(&mut Attn, ValueId) -> ValueId, swap: bool) -> Graph {
    let mut a = Attn { g: Graph::new("rotary"), n: 0 };
    a.g.opsets.insert(String::new(), 18);
    let x = a.input("x", DType::F32, &Q);
    let cos = a.input("cos", DType::F32, &[2, 1, 5, 8]);
    let sin = a.input("sin", DType::F32, &[2, 1, 5, 8]);
    let r = rot(&mut a, x);
    let order = |p: ValueId, q: ValueId| if swap { [q, p] } else { [p, q] };
    let xc = a.f(OpKind::Mul, &order(x, cos), &Q);
    let rs = a.f(OpKind::Mul, &order(r, sin), &Q);
    let y = a.f(OpKind::Add, &order(xc, rs), &Q);
    a.finish(y)
}

fn ints(a: &mut Attn, v: &[i64]) -> ValueId {
    a.konst(IrTensor::from_i64(vec![v.len() as i64], v))
}

/// `Concat(Neg(x[..., 4:]), x[..., :4])`.
fn rotate_half(a: &mut Attn, x: ValueId) -> ValueId {
    let (z, h, end, last) = (ints(a, &[0]), ints(a, &[4]), ints(a, &[i64::MAX]), ints(a, &[3]));
    let x1 = a.f(OpKind::Slice, &[x, z, h, last], &[2, 3, 5, 4]);
    let x2 = a.f(OpKind::Slice, &[x, h, end, last], &[2, 3, 5, 4]);
    let n = a.f(OpKind::Neg, &[x2], &[2, 3, 5, 4]);
    a.op(OpKind::Concat, &[n, x1], &[("axis", smp_partition::ir::Attr::Int(-1))], DType::F32, &Q)
}

/// `Concat(Neg(h₁), h₀)` with `h₀, h₁ = Split(x, [4, 4], -1)` (`torch.chunk(x, 2, -1)`).
fn rotate_half_split(a: &mut Attn, x: ValueId) -> ValueId {
    split_rotation(a, x, Some([4, 4]), false)
}

/// `Concat(Neg(p), q)` of a two-way `Split` of `x`'s last axis by `sizes` (equal halves where
/// `None`), `p` its second part (its first when `negate_first`) and `q` the other.
fn split_rotation(a: &mut Attn, x: ValueId, sizes: Option<[i64; 2]>, negate_first: bool) -> ValueId {
    let [s0, s1] = sizes.unwrap_or([4, 4]);
    let mut ins = vec![Some(x)];
    if let Some(sz) = sizes {
        ins.push(Some(ints(a, &sz)));
    }
    a.n += 1;
    let outs: Vec<ValueId> = [s0, s1]
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            let ty = Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[2, 3, 5, w])) });
            a.g.add_value(format!("split{}_{i}", a.n), ValueKind::Intermediate, ty, None).unwrap()
        })
        .collect();
    let mut attrs = Attrs::default();
    attrs.set("axis", smp_partition::ir::Attr::Int(-1));
    if sizes.is_none() {
        attrs.set("num_outputs", smp_partition::ir::Attr::Int(2));
    }
    let node = Node { name: format!("split{}", a.n), op: Op::Known(OpKind::Split), attrs, inputs: ins, outputs: outs.clone(), namespace: None, order: a.n };
    a.g.add_node(node).unwrap();
    let (negated, kept) = if negate_first { (outs[0], outs[1]) } else { (outs[1], outs[0]) };
    let n = a.f(OpKind::Neg, &[negated], &[2, 3, 5, if negate_first { s0 } else { s1 }]);
    a.op(OpKind::Concat, &[n, kept], &[("axis", smp_partition::ir::Attr::Int(-1))], DType::F32, &Q)
}

/// `Reshape(Concat(Unsqueeze(Neg(x[..., 1::2]), -1), Unsqueeze(x[..., ::2], -1)), [.., 8])`.
fn rotate_every_two(a: &mut Attn, x: ValueId) -> ValueId {
    rotate_pairs(a, x, (i64::MAX, 2))
}

/// [`rotate_every_two`] with the "even" channels taken as `x[..., 0:end:step]`.
fn rotate_pairs(a: &mut Attn, x: ValueId, (even_end, even_step): (i64, i64)) -> ValueId {
    let (z, one, end, last, two, m1) = (ints(a, &[0]), ints(a, &[1]), ints(a, &[i64::MAX]), ints(a, &[3]), ints(a, &[2]), ints(a, &[-1]));
    let (e_end, e_step) = (ints(a, &[even_end]), ints(a, &[even_step]));
    let even = a.f(OpKind::Slice, &[x, z, e_end, last, e_step], &[2, 3, 5, 4]);
    let odd = a.f(OpKind::Slice, &[x, one, end, last, two], &[2, 3, 5, 4]);
    let n = a.f(OpKind::Neg, &[odd], &[2, 3, 5, 4]);
    let n = a.f(OpKind::Unsqueeze, &[n, m1], &[2, 3, 5, 4, 1]);
    let e = a.f(OpKind::Unsqueeze, &[even, m1], &[2, 3, 5, 4, 1]);
    let s = a.op(OpKind::Concat, &[n, e], &[("axis", smp_partition::ir::Attr::Int(-1))], DType::F32, &[2, 3, 5, 4, 2]);
    let shape = ints(a, &Q);
    a.f(OpKind::Reshape, &[s, shape], &Q)
}

/// [`rotate_every_two`] with the reshape's target computed from `x`'s shape, as a dynamic-shape
/// export writes it (`Shape(x)` outside the chain).
fn rotate_every_two_to_shape(a: &mut Attn, x: ValueId) -> ValueId {
    let shape = a.op(OpKind::Shape, &[x], &[], DType::I64, &[4]);
    let r = rotate_every_two(a, x);
    let reshape = a.g.value(r).producer.unwrap();
    a.g.set_input(reshape, 1, Some(shape));
    r
}

/// The one-node `ApplyRotary(x, cos, sin)` graph.
fn rotary_node(interleaved: bool) -> Graph {
    let mut a = Attn { g: Graph::new("rotary"), n: 0 };
    a.g.opsets.insert(String::new(), 18);
    let x = a.input("x", DType::F32, &Q);
    let cos = a.input("cos", DType::F32, &[2, 1, 5, 8]);
    let sin = a.input("sin", DType::F32, &[2, 1, 5, 8]);
    let y = a.op(OpKind::ApplyRotary, &[x, cos, sin], &[("interleaved", smp_partition::ir::Attr::Int(interleaved as i64))], DType::F32, &Q);
    a.finish(y)
}

#[test]
fn apply_rotary_computes_both_exported_chains_in_f64_forward_and_backward() {
    for (what, chain, interleaved) in
        [("half rotation", rotary_graph(&rotate_half), false), ("interleaved", rotary_graph(&rotate_every_two), true)]
    {
        let want = run_with_input_grads(&chain, Kind::Double);
        let got = run_with_input_grads(&rotary_node(interleaved), Kind::Double);
        assert_eq!(want.len(), 4, "{what}");
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.size(), g.size(), "{what}, tensor {i}");
            assert!(rel(w, g) <= 1e-12, "{what}, tensor {i} (output, then x, cos, sin's gradients): {}", rel(w, g));
        }
        // the other form's kernel differs: the test would catch a swapped attribute
        let other = run_with_input_grads(&rotary_node(!interleaved), Kind::Double);
        assert!(rel(&want[0], &other[0]) > 1e-3, "{what}");
    }
}

/// `unfused` fused: one `ApplyRotary(x, cos, sin)` of the form `interleaved`, `nodes` nodes left,
/// shapes inferred, and the record replayed on `unfused` giving the same graph. The graph and
/// the record.
fn fused_to_one_rotary(unfused: &Graph, what: &str, interleaved: bool, nodes: usize) -> (Graph, smp_partition::ir::Fusion) {
    let mut g = unfused.clone();
    let records = fuse(&mut g);
    assert_eq!(records.len(), 1, "{what}: {records:?}");
    let f = records[0].clone();
    assert_eq!(f.op, FusedOp::Rotary { interleaved }, "{what}");
    assert_eq!(Fused::of(&records).rotary, 1);
    g.verify().unwrap();
    assert_eq!(g.node_count(), nodes, "{what}: the chain is one node");
    let node = g.node(f.node);
    assert!(node.op.is(OpKind::ApplyRotary), "{what}");
    let names: Vec<&str> = node.inputs.iter().flatten().map(|&v| g.value(v).name.as_str()).collect();
    assert_eq!(names, ["x", "cos", "sin"], "{what}");
    passes::shape_infer::infer_shapes(&mut g, &Default::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut replayed = unfused.clone();
    smp_partition::passes::fuse::apply(&mut replayed, &f).unwrap();
    assert_eq!(format!("{replayed}"), format!("{g}"), "{what}");
    (g, f)
}

/// The record `f` of `unfused` → `g` with cos and sin swapped is refused, and `g` computes what
/// `unfused` does: output and every input's gradient, f64 within 1e-12, f32 within 1e-6.
fn rotary_swapped_refused_and_same_as_chain(unfused: &Graph, g: &Graph, f: &smp_partition::ir::Fusion, what: &str) {
    let swapped = smp_partition::ir::Fusion { inputs: vec![f.inputs[0], f.inputs[2], f.inputs[1]], ..f.clone() };
    assert!(smp_partition::passes::fuse::apply(&mut unfused.clone(), &swapped).is_err(), "{what}: cos and sin swapped");
    for (kind, tol) in [(Kind::Double, 1e-12), (Kind::Float, 1e-6)] {
        let a = run_with_input_grads(unfused, kind);
        let b = run_with_input_grads(g, kind);
        assert_eq!(a.len(), 4);
        for (i, (x, y)) in b.iter().zip(&a).enumerate() {
            assert_eq!(x.size(), y.size(), "{what}: tensor {i}");
            let d = rel(x, y);
            assert!(d <= tol, "{what} {kind:?}: tensor {i} (output, then x, cos, sin's gradients) differs by {d:.2e}");
        }
    }
}

#[test]
fn both_rotary_forms_in_any_operand_order_become_one_apply_rotary_computing_the_chain() {
    for (what, rot, interleaved, nodes) in [
        ("half rotation", &rotate_half as &dyn Fn(&mut Attn, ValueId) -> ValueId, false, 1),
        ("half rotation by one Split", &rotate_half_split, false, 1),
        ("half rotation by a Split without sizes", &|a: &mut Attn, x: ValueId| split_rotation(a, x, None, false), false, 1),
        ("interleaved", &rotate_every_two, true, 1),
        // the Shape stays for whatever else reads it
        ("interleaved to a computed shape", &rotate_every_two_to_shape, true, 2),
    ] {
        for swap in [false, true] {
            let unfused = rotary_chain(rot, swap);
            let (g, f) = fused_to_one_rotary(&unfused, &format!("{what}, swapped {swap}"), interleaved, nodes);
            let f = &f;
            // the other form's record is refused
            let other = smp_partition::ir::Fusion { op: FusedOp::Rotary { interleaved: !interleaved }, ..f.clone() };
            let err = smp_partition::passes::fuse::apply(&mut unfused.clone(), &other).unwrap_err().to_string();
            // (the half form's record does not read a computed shape at all)
            assert!(err.contains(&format!("`{}`", unfused.node(f.node).name)) && (err.contains("rot(x)") || err.contains("outside it")), "{err}");
            rotary_swapped_refused_and_same_as_chain(&unfused, &g, f, what);
        }
    }
}

#[test]
fn near_misses_of_rotary_are_left_alone() {
    // x's last axis (8) cut at `at`, the second part negated, concatenated negated part first
    // (`neg_first`) or last
    let cut = |a: &mut Attn, x: ValueId, at: i64, neg_first: bool| {
        let (z, h, end, last) = (ints(a, &[0]), ints(a, &[at]), ints(a, &[i64::MAX]), ints(a, &[3]));
        let x1 = a.f(OpKind::Slice, &[x, z, h, last], &[2, 3, 5, at]);
        let x2 = a.f(OpKind::Slice, &[x, h, end, last], &[2, 3, 5, 8 - at]);
        let n = a.f(OpKind::Neg, &[x2], &[2, 3, 5, 8 - at]);
        let parts = if neg_first { [n, x1] } else { [x1, n] };
        a.op(OpKind::Concat, &parts, &[("axis", smp_partition::ir::Attr::Int(-1))], DType::F32, &Q)
    };
    // a rotation by a quarter of the axis
    let quarter = |a: &mut Attn, x: ValueId| cut(a, x, 2, true);
    // the halves negated the other way round: Concat(x₁, Neg(x₂))
    let other_sign = |a: &mut Attn, x: ValueId| cut(a, x, 4, false);
    // pairs taken with the wrong step (x[..., ::1] is not the even channels)
    let wrong_step = |a: &mut Attn, x: ValueId| rotate_pairs(a, x, (4, 1));
    // the rotation of another tensor
    let another = |a: &mut Attn, _x: ValueId| {
        let y = a.input("y", DType::F32, &Q);
        rotate_half(a, y)
    };
    // a Split into unequal parts, and one whose first half is the negated one
    let uneven = |a: &mut Attn, x: ValueId| split_rotation(a, x, Some([2, 6]), false);
    let split_other_sign = |a: &mut Attn, x: ValueId| split_rotation(a, x, Some([4, 4]), true);
    let cases: [(&str, &dyn Fn(&mut Attn, ValueId) -> ValueId); 6] = [
        ("a quarter rotation", &quarter),
        ("the other sign", &other_sign),
        ("a wrong step", &wrong_step),
        ("another tensor's rotation", &another),
        ("an uneven Split", &uneven),
        ("a Split negating its first half", &split_other_sign),
    ];
    for (what, rot) in cases {
        let mut g = rotary_graph(rot);
        let records = fuse(&mut g);
        assert!(records.iter().all(|r| !matches!(r.op, FusedOp::Rotary { .. })), "{what}: fused {records:?}");
    }
    // the rotation read outside the chain
    let mut g = rotary_graph(&rotate_half);
    let rot = g.value_ids().find(|&v| g.value(v).producer.is_some_and(|p| g.node(p).op.is(OpKind::Concat))).unwrap();
    g.outputs.push(rot);
    assert!(fuse(&mut g).is_empty(), "the rotation is a graph output");
    // tables longer than x along an axis (the sum grows past x's shape)
    let mut a = Attn { g: Graph::new("rotary"), n: 0 };
    let x = a.input("x", DType::F32, &[2, 1, 5, 8]);
    let cos = a.input("cos", DType::F32, &[2, 3, 5, 8]);
    let sin = a.input("sin", DType::F32, &[2, 1, 5, 8]);
    let r = rotate_half_of(&mut a, x, &[2, 1, 5]);
    let xc = a.f(OpKind::Mul, &[x, cos], &Q);
    let rs = a.f(OpKind::Mul, &[r, sin], &[2, 1, 5, 8]);
    let y = a.f(OpKind::Add, &[xc, rs], &Q);
    let mut g = a.finish(y);
    assert!(fuse(&mut g).is_empty(), "cos longer than x");
}

/// [`rotate_half`] of `x` with leading dims `lead` and last axis 8.
fn rotate_half_of(a: &mut Attn, x: ValueId, lead: &[i64]) -> ValueId {
    let half: Vec<i64> = lead.iter().copied().chain([4]).collect();
    let whole: Vec<i64> = lead.iter().copied().chain([8]).collect();
    let (z, h, end, last) = (ints(a, &[0]), ints(a, &[4]), ints(a, &[i64::MAX]), ints(a, &[-1]));
    let x1 = a.f(OpKind::Slice, &[x, z, h, last], &half);
    let x2 = a.f(OpKind::Slice, &[x, h, end, last], &half);
    let n = a.f(OpKind::Neg, &[x2], &half);
    a.op(OpKind::Concat, &[n, x1], &[("axis", smp_partition::ir::Attr::Int(-1))], DType::F32, &whole)
}

#[test]
fn a_partial_rotary_fuses_its_rotated_slice_and_computes_the_chain() {
    // Phi / GPT-NeoX: the first 8 of 12 channels rotated, the last 4 passed through
    let mut a = Attn { g: Graph::new("partial"), n: 0 };
    a.g.opsets.insert(String::new(), 18);
    let full = a.input("x", DType::F32, &[2, 3, 5, 12]);
    let cos = a.input("cos", DType::F32, &[2, 1, 5, 8]);
    let sin = a.input("sin", DType::F32, &[2, 1, 5, 8]);
    let (z, eight, end, last) = (ints(&mut a, &[0]), ints(&mut a, &[8]), ints(&mut a, &[i64::MAX]), ints(&mut a, &[-1]));
    let x = a.f(OpKind::Slice, &[full, z, eight, last], &Q);
    let pass = a.f(OpKind::Slice, &[full, eight, end, last], &[2, 3, 5, 4]);
    let r = rotate_half_of(&mut a, x, &[2, 3, 5]);
    let xc = a.f(OpKind::Mul, &[x, cos], &Q);
    let rs = a.f(OpKind::Mul, &[r, sin], &Q);
    let y = a.f(OpKind::Add, &[xc, rs], &Q);
    let y = a.op(OpKind::Concat, &[y, pass], &[("axis", smp_partition::ir::Attr::Int(-1))], DType::F32, &[2, 3, 5, 12]);
    let unfused = a.finish(y);
    let mut g = unfused.clone();
    let records = fuse(&mut g);
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].op, FusedOp::Rotary { interleaved: false });
    assert_eq!(g.node_count(), 4, "the two slices, the rotary and the concat");
    let (want, got) = (run_with_input_grads(&unfused, Kind::Double), run_with_input_grads(&g, Kind::Double));
    for (i, (w, f)) in want.iter().zip(&got).enumerate() {
        assert!(rel(f, w) <= 1e-12, "tensor {i}: {:.2e}", rel(f, w));
    }
}

#[test]
fn llama_fuses_its_rotary_embeddings_and_computes_the_same_in_f64() {
    for name in ["llama", "phi"] {
        let unfused = specialised(name);
        let mut all = unfused.clone();
        let records = fuse(&mut all);
        all.verify().unwrap();
        let f = Fused::of(&records);
        // q and k in each of the 4 blocks
        assert_eq!(f.rotary, 8, "{name}: {f}");
        assert_eq!(all.node_ids().filter(|&n| all.node(n).op.is(OpKind::Neg)).count(), 0, "{name}: every rotation fused");
        // the rotary records alone, replayed on the unfused graph
        let mut fused = unfused.clone();
        for r in records.iter().filter(|r| matches!(r.op, FusedOp::Rotary { .. })) {
            smp_partition::passes::fuse::apply(&mut fused, r).unwrap();
        }
        computes_the_same_in_f64(name, &unfused, &fused);
    }
}

#[test]
fn a_fused_rotary_is_priced_as_its_chain_less_the_intermediates_it_no_longer_writes() {
    let opts = AnalyzeOptions { seq_len: Some(16), ..Default::default() };
    let (unfused, dims) = passes::specialise(model("llama"), &opts).unwrap();
    let mut fused = unfused.clone();
    let records: Vec<_> = fuse(&mut unfused.clone()).into_iter().filter(|r| matches!(r.op, FusedOp::Rotary { .. })).collect();
    for r in &records {
        smp_partition::passes::fuse::apply(&mut fused, r).unwrap();
    }
    let (fu, ff) = (passes::figures::compute(&unfused, &dims).unwrap(), passes::figures::compute(&fused, &dims).unwrap());
    assert!((ff.total_flops - fu.total_flops).abs() <= 1e-9 * fu.total_flops, "flops {} against the chains' {}", ff.total_flops, fu.total_flops);
    for r in &records {
        let [x, cos, sin] = r.inputs[..] else { panic!("{r:?}") };
        let chain: f64 = r.replaces.iter().map(|n| fu.per_node[n.index()].memory_bytes).sum();
        let node = ff.per_node[r.node.index()].memory_bytes;
        // the fused node reads x and the tables and writes its output; the chain's nodes also
        // wrote and read back each half, their negation, the rotation and the two products
        let want = 2.0 * fu.value_bytes(&unfused, x) + fu.value_bytes(&unfused, cos) + fu.value_bytes(&unfused, sin);
        assert!((node - want).abs() <= 1e-9 * want, "{node} bytes, not {want}");
        assert!(node < chain / 3.0, "{node} bytes against the chain's {chain}");
        let saved: f64 = r.replaces.iter().map(|n| fu.per_node[n.index()].saved_bytes).sum();
        assert!(ff.per_node[r.node.index()].saved_bytes <= saved, "saved");
    }
}

// The complex product: Llama 4's and DeepSeek-V2's `view_as_complex(x) · e^{iθ}` as the front
// door exports it in real arithmetic.

/// How [`complex_rotary`] writes the product; the default is the export's.
#[derive(Clone, Copy, Default)]
struct Complex {
    /// Every product's and the sum's operands swapped.
    swap: bool,
    /// The reshapes' targets computed from `x`'s shape (a dynamic-shape export).
    computed_shapes: bool,
    /// re = b·s − a·c (the wrong sign).
    sub_reversed: bool,
    /// im = a·c + b·s (the conjugate's parts mixed up).
    im_wrong: bool,
    /// a = x's odd channels, b = the even ones.
    gathers_swapped: bool,
    /// The stack's order: im first.
    im_first: bool,
}

/// Inputs `x` `[2, 3, 5, 8]`, `cos` and `sin` `[2, 1, 5, 4]` (one angle per pair), and
/// `view_as_real(view_as_complex(x.reshape(.., 4, 2)) · (cos + i·sin)).flatten(-2)` in real
/// arithmetic, as `_complex.py` exports it.
fn complex_rotary(how: Complex) -> Graph {
    let mut a = Attn { g: Graph::new("complex rotary"), n: 0 };
    a.g.opsets.insert(String::new(), 18);
    let x = a.input("x", DType::F32, &Q);
    let c = a.input("cos", DType::F32, &[2, 1, 5, 4]);
    let s = a.input("sin", DType::F32, &[2, 1, 5, 4]);
    let (pairs, back) = if how.computed_shapes {
        let shape = a.op(OpKind::Shape, &[x], &[], DType::I64, &[4]);
        let (z, three) = (ints(&mut a, &[0]), ints(&mut a, &[3]));
        let lead = a.op(OpKind::Slice, &[shape, z, three], &[], DType::I64, &[3]);
        let tail = ints(&mut a, &[-1, 2]);
        let pairs = a.op(OpKind::Concat, &[lead, tail], &[("axis", smp_partition::ir::Attr::Int(0))], DType::I64, &[5]);
        let eight = ints(&mut a, &[8]);
        let back = a.op(OpKind::Concat, &[lead, eight], &[("axis", smp_partition::ir::Attr::Int(0))], DType::I64, &[4]);
        (pairs, back)
    } else {
        (ints(&mut a, &[2, 3, 5, 4, 2]), ints(&mut a, &Q))
    };
    let v = a.f(OpKind::Reshape, &[x, pairs], &[2, 3, 5, 4, 2]);
    let half = [2, 3, 5, 4];
    let (i0, i1) = (a.konst(IrTensor::from_i64(vec![], &[0])), a.konst(IrTensor::from_i64(vec![], &[1])));
    let (i0, i1) = if how.gathers_swapped { (i1, i0) } else { (i0, i1) };
    let axis = [("axis", smp_partition::ir::Attr::Int(-1))];
    let re_x = a.op(OpKind::Gather, &[v, i0], &axis, DType::F32, &half);
    let im_x = a.op(OpKind::Gather, &[v, i1], &axis, DType::F32, &half);
    let order = |p: ValueId, q: ValueId| if how.swap { [q, p] } else { [p, q] };
    let ac = a.f(OpKind::Mul, &order(re_x, c), &half);
    let bs = a.f(OpKind::Mul, &order(im_x, s), &half);
    let re = a.f(OpKind::Sub, &if how.sub_reversed { [bs, ac] } else { [ac, bs] }, &half);
    let (as_, bc) = if how.im_wrong { (c, s) } else { (s, c) };
    let p = a.f(OpKind::Mul, &order(re_x, as_), &half);
    let q = a.f(OpKind::Mul, &order(im_x, bc), &half);
    let im = a.f(OpKind::Add, &order(p, q), &half);
    let m1 = ints(&mut a, &[-1]);
    let ure = a.f(OpKind::Unsqueeze, &[re, m1], &[2, 3, 5, 4, 1]);
    let uim = a.f(OpKind::Unsqueeze, &[im, m1], &[2, 3, 5, 4, 1]);
    let parts = if how.im_first { [uim, ure] } else { [ure, uim] };
    let st = a.op(OpKind::Concat, &parts, &axis, DType::F32, &[2, 3, 5, 4, 2]);
    let y = a.f(OpKind::Reshape, &[st, back], &Q);
    a.finish(y)
}

#[test]
fn the_complex_product_becomes_one_apply_rotary_computing_the_chain_forward_and_backward() {
    for (what, how, nodes) in [
        ("as exported", Complex::default(), 1),
        ("operands swapped", Complex { swap: true, ..Default::default() }, 1),
        // the shape arithmetic stays for whatever else reads it
        ("to computed shapes", Complex { computed_shapes: true, ..Default::default() }, 5),
    ] {
        let unfused = complex_rotary(how);
        let (g, f) = fused_to_one_rotary(&unfused, what, true, nodes);
        let f = &f;
        let out = g.outputs[0];
        assert_eq!(g.value(out).ty.as_ref().unwrap().shape, Some(Shape::from_known(&Q)), "{what}");
        // the half form's record is refused
        let half = smp_partition::ir::Fusion { op: FusedOp::Rotary { interleaved: false }, ..f.clone() };
        assert!(smp_partition::passes::fuse::apply(&mut unfused.clone(), &half).is_err(), "{what}: the half form");
        rotary_swapped_refused_and_same_as_chain(&unfused, &g, f, what);
    }
}

#[test]
fn near_misses_of_the_complex_product_are_left_alone() {
    for (what, how) in [
        ("re = b·s − a·c", Complex { sub_reversed: true, ..Default::default() }),
        ("im = a·c + b·s", Complex { im_wrong: true, ..Default::default() }),
        ("the parts swapped", Complex { gathers_swapped: true, ..Default::default() }),
        ("im stacked first", Complex { im_first: true, ..Default::default() }),
    ] {
        let unfused = complex_rotary(how);
        let mut g = unfused.clone();
        let records = fuse(&mut g);
        assert!(records.is_empty(), "{what}: fused {records:?}");
        // each near miss computes something else than the fused product
        let mut fused = complex_rotary(Complex::default());
        fuse(&mut fused);
        let (a, b) = (run_with_input_grads(&unfused, Kind::Double), run_with_input_grads(&fused, Kind::Double));
        assert!(rel(&a[0], &b[0]) > 1e-3, "{what}");
    }
    // the real part read outside the chain
    let mut g = complex_rotary(Complex::default());
    let re = g.value_ids().find(|&v| g.value(v).producer.is_some_and(|p| g.node(p).op.is(OpKind::Sub))).unwrap();
    g.outputs.push(re);
    assert!(fuse(&mut g).is_empty(), "the real part is a graph output");
}

#[test]
fn apply_rotary_reads_tables_of_one_angle_per_pair_as_widened_ones() {
    // ApplyRotary(x, c, s) with [.., 4] tables = ApplyRotary(x, C, S), C and S each angle
    // repeated for its pair (interleaved) or for both halves: forward and every input's gradient
    let graph = |interleaved: bool, widen: bool| {
        let mut a = Attn { g: Graph::new("rotary"), n: 0 };
        a.g.opsets.insert(String::new(), 18);
        let x = a.input("x", DType::F32, &Q);
        let cos = a.input("cos", DType::F32, &[2, 1, 5, 4]);
        let sin = a.input("sin", DType::F32, &[2, 1, 5, 4]);
        let mut tables = [cos, sin];
        if widen {
            for t in &mut tables {
                let axis = [("axis", smp_partition::ir::Attr::Int(-1))];
                *t = if interleaved {
                    let m1 = ints(&mut a, &[-1]);
                    let u = a.f(OpKind::Unsqueeze, &[*t, m1], &[2, 1, 5, 4, 1]);
                    let st = a.op(OpKind::Concat, &[u, u], &axis, DType::F32, &[2, 1, 5, 4, 2]);
                    let sh = ints(&mut a, &[2, 1, 5, 8]);
                    a.f(OpKind::Reshape, &[st, sh], &[2, 1, 5, 8])
                } else {
                    a.op(OpKind::Concat, &[*t, *t], &axis, DType::F32, &[2, 1, 5, 8])
                };
            }
        }
        let attrs = [("interleaved", smp_partition::ir::Attr::Int(interleaved as i64))];
        let y = a.op(OpKind::ApplyRotary, &[x, tables[0], tables[1]], &attrs, DType::F32, &Q);
        a.finish(y)
    };
    for interleaved in [true, false] {
        let (want, got) = (run_with_input_grads(&graph(interleaved, true), Kind::Double), run_with_input_grads(&graph(interleaved, false), Kind::Double));
        assert_eq!(want.len(), 4);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.size(), g.size(), "interleaved {interleaved}: tensor {i}");
            assert!(rel(w, g) <= 1e-12, "interleaved {interleaved}: tensor {i} (output, then x, cos, sin's gradients): {:.2e}", rel(w, g));
        }
    }
}

/// A layer norm as opsets before 17 write it, over inputs `x` `[2, 5, 8]`, `w` `[8]` and (with
/// `bias`) `b` `[8]`: `d = x − mean(x)`, `d / √(mean(d²) + ε)` (or `d · 1/√…`), `· w (+ b)`.
fn layer_norm_graph(bias: bool, reciprocal: bool, square_by_mul: bool) -> Graph {
    let mut a = Attn { g: Graph::new("layer_norm"), n: 0 };
    a.g.opsets.insert(String::new(), 14);
    let x = a.input("x", DType::F32, &X);
    let w = a.input("w", DType::F32, &[8]);
    let b = bias.then(|| a.input("b", DType::F32, &[8]));
    let axes = a.konst(IrTensor::from_i64(vec![1], &[-1]));
    let mean = a.op(OpKind::ReduceMean, &[x, axes], &[("keepdims", smp_partition::ir::Attr::Int(1))], DType::F32, &[2, 5, 1]);
    let d = a.f(OpKind::Sub, &[x, mean], &X);
    let sq = if square_by_mul {
        a.f(OpKind::Mul, &[d, d], &X)
    } else {
        let two = a.scalar(2.0);
        a.f(OpKind::Pow, &[d, two], &X)
    };
    let root = root_of_mean(&mut a, sq, -1, false);
    let n = if reciprocal {
        let r = a.f(OpKind::Reciprocal, &[root], &[2, 5, 1]);
        a.f(OpKind::Mul, &[d, r], &X)
    } else {
        a.f(OpKind::Div, &[d, root], &X)
    };
    let y = a.f(OpKind::Mul, &[n, w], &X);
    let y = match b {
        Some(b) => a.f(OpKind::Add, &[b, y], &X),
        None => y,
    };
    a.finish(y)
}

#[test]
fn a_written_out_layer_norm_becomes_one_node_and_computes_the_chain_in_f64_and_f32() {
    for (bias, reciprocal, square_by_mul) in [(true, false, false), (false, false, false), (true, true, true)] {
        let what = format!("bias {bias}, reciprocal {reciprocal}, square by Mul {square_by_mul}");
        let unfused = layer_norm_graph(bias, reciprocal, square_by_mul);
        let inputs: &[&str] = if bias { &["x", "w", "b"] } else { &["x", "w"] };
        let f = fused_alone(&what, &unfused, OpKind::LayerNormalization, inputs);
        assert_eq!(f.op, FusedOp::LayerNorm { epsilon: smp_partition::ir::Epsilon(1e-6_f32 as f64), bias }, "{what}");
    }
    // centred on another tensor's mean: an RMSNorm of the difference, not a layer norm of x
    let mut a = Attn { g: Graph::new("not_layer_norm"), n: 0 };
    a.g.opsets.insert(String::new(), 14);
    let x = a.input("x", DType::F32, &X);
    let other = a.input("other", DType::F32, &X);
    let w = a.input("w", DType::F32, &[8]);
    let axes = a.konst(IrTensor::from_i64(vec![1], &[-1]));
    let mean = a.op(OpKind::ReduceMean, &[other, axes], &[("keepdims", smp_partition::ir::Attr::Int(1))], DType::F32, &[2, 5, 1]);
    let d = a.f(OpKind::Sub, &[x, mean], &X);
    let two = a.scalar(2.0);
    let sq = a.f(OpKind::Pow, &[d, two], &X);
    let root = root_of_mean(&mut a, sq, -1, false);
    let n = a.f(OpKind::Div, &[d, root], &X);
    let y = a.f(OpKind::Mul, &[n, w], &X);
    let mut g = a.finish(y);
    let records = fuse(&mut g);
    assert!(records.iter().all(|r| !matches!(r.op, FusedOp::LayerNorm { .. })), "{records:?}");
}
