//! `passes::fuse` on a real export: the pass fires on the GELU chains of Hugging Face GPT-2
//! (models/gpt2.onnx, `gelu_new`), and the fused graph trains as the unfused one.
#![cfg(feature = "runner")]

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
    let exec = Executor::new(graph, weights, ExecOptions { float_kind: Some(kind), training: true }).expect("executor");
    let batch = train::synthetic_batch(&exec, 4, 32, 7).expect("batch");
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
    assert_eq!(f, Fused { gelu_tanh: 4, gelu_erf: 0 }, "one GELU per GPT-2 block");
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
