//! A synthetic layered GPT for planner tests: one weight MatMul node per layer carrying the
//! figures of a Megatron GPT layer (Narayanan et al. 2021; Korthikanti et al. 2022).
#![allow(dead_code)]

use smp_partition::ir::{
    Attrs, DType, DimBindings, Graph, Layer, LayerKind, LayeredGraph, Node, NodeFigures, Op, OpKind, Shape,
    TensorType, ValueKind,
};

/// Shape of a GPT.
#[derive(Clone, Copy, Debug)]
pub struct GptShape {
    pub layers: usize,
    pub hidden: f64,
    pub heads: f64,
    pub seq: f64,
    pub vocab: f64,
}

/// Per-sample figures: block FLOPs 24sh² + 4s²h, params 12h², saved bytes sh(34 + 5as/h)
/// (bf16); embedding params Vh; head FLOPs 2sVh (tied weight counted in the embedding).
pub fn gpt(shape: GptShape) -> LayeredGraph {
    let GptShape { layers, hidden: h, heads: a, seq: s, vocab: v } = shape;
    let mut g = Graph::new("synthetic-gpt");
    let bf16 = |dims: &[i64]| Some(TensorType { dtype: DType::BF16, shape: Some(Shape::from_known(dims)) });
    let mut x = g.add_value("input", ValueKind::Input, bf16(&[1, s as i64, h as i64]), None).unwrap();
    g.inputs.push(x);
    let mut out_layers = Vec::new();
    let mut figures = Vec::new();
    let total = layers + 2;
    for l in 0..total {
        let (kind, name, fig) = if l == 0 {
            let p = v * h + s * h;
            (LayerKind::Embedding, "embedding".to_string(), NodeFigures {
                flops: 0.0,
                param_elems: p as u64,
                param_bytes: 2 * p as u64,
                output_bytes: 2.0 * s * h,
                saved_bytes: 2.0 * s * h,
                memory_bytes: 4.0 * s * h,
                // Whole-layer figures: no attention scores marked.
                ..Default::default()
            })
        } else if l == total - 1 {
            (LayerKind::Head, "head".to_string(), NodeFigures {
                flops: 2.0 * s * v * h,
                param_elems: 2 * h as u64,
                param_bytes: 4 * h as u64,
                output_bytes: 2.0 * s * v,
                saved_bytes: 2.0 * s * h + 4.0 * s * v,
                memory_bytes: 2.0 * s * v,
                // Whole-layer figures: no attention scores marked.
                ..Default::default()
            })
        } else {
            let p = 12.0 * h * h + 13.0 * h;
            (LayerKind::Block, format!("h.{}", l - 1), NodeFigures {
                flops: 24.0 * s * h * h + 4.0 * s * s * h,
                param_elems: p as u64,
                param_bytes: 2 * p as u64,
                output_bytes: 2.0 * s * h,
                saved_bytes: s * h * (34.0 + 5.0 * a * s / h),
                memory_bytes: 2.0 * p + 20.0 * s * h,
                // Whole-layer figures: no attention scores marked.
                ..Default::default()
            })
        };
        let w = g
            .add_value(format!("w{l}"), ValueKind::Initializer, bf16(&[fig.param_elems as i64]), None)
            .unwrap();
        let y = g.add_value(format!("y{l}"), ValueKind::Intermediate, bf16(&[1, s as i64, h as i64]), None).unwrap();
        let node = g
            .add_node(Node {
                name: format!("mm{l}"),
                op: Op::Known(OpKind::MatMul),
                attrs: Attrs::default(),
                inputs: vec![Some(x), Some(w)],
                outputs: vec![y],
                namespace: None,
                order: l as u32,
            })
            .unwrap();
        assert_eq!(node.index(), figures.len());
        figures.push(fig);
        let signature = if kind == LayerKind::Block { "block".to_string() } else { name.clone() };
        out_layers.push(Layer {
            index: l,
            name,
            kind,
            nodes: vec![node],
            signature,
            params: vec![w],
            shared_params: vec![],
            inputs: vec![x],
            outputs: vec![y],
            figures: fig,
            input_bytes: 2.0 * s * h,
            offload_bytes: 2.0 * s * h,
            output_bytes: 2.0 * s * h,
            shared_input_bytes: 0.0,
            shared_saved_bytes: 0.0,
            selective_bytes: 0.0,
            selective_nodes: Vec::new(),
            op_selective: Default::default(),
            op_freed_bytes: 0.0,
            op_held_bytes: 0.0,
            loss_kept_bytes: 0.0,
        });
        x = y;
    }
    g.outputs.push(x);
    let params = figures.iter().map(|f| f.param_elems).sum();
    let flops = figures.iter().map(|f| f.flops).sum();
    LayeredGraph {
        graph: g,
        layers: out_layers,
        node_figures: figures,
        dims: DimBindings { values: Default::default(), batch_symbol: Some("batch".into()), graph_batch: 1, fixed_batch: false, batch_rebinds: false, batch_group: 0 },
        params,
        fused: Vec::new(),
        loss: None,
        flops_per_sample: flops,
    }
}
