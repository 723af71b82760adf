//! Hand-built graphs for the passes' unit tests.

use std::path::PathBuf;

use crate::ir::{
    Attr, Attrs, DType, Dim, ExternalData, Graph, Node, Op, OpKind, Shape, Storage, Tensor, TensorType, ValueId, ValueKind,
};

/// Builds graphs with fresh value names.
pub struct Builder {
    pub g: Graph,
    next: u32,
    pub namespace: Option<String>,
}

impl Builder {
    /// An empty graph; what it builds is in the canonical form the ONNX importer writes.
    pub fn new() -> Builder {
        Builder { g: Graph::new("test"), next: 0, namespace: None }
    }

    fn fresh(&mut self, p: &str) -> String {
        self.next += 1;
        format!("{p}_{}", self.next)
    }

    /// A graph input; dims given as strings, numbers are fixed sizes.
    pub fn input(&mut self, name: &str, dtype: DType, dims: &[&str]) -> ValueId {
        let shape = Shape(dims.iter().map(|d| d.parse().map(Dim::Known).unwrap_or(Dim::Sym(d.to_string()))).collect());
        let v = self.g.add_value(name, ValueKind::Input, Some(TensorType { dtype, shape: Some(shape) }), None).unwrap();
        self.g.inputs.push(v);
        v
    }

    /// A parameter whose bytes live in a never-written file (metadata only).
    pub fn param(&mut self, name: &str, dtype: DType, dims: &[i64]) -> ValueId {
        let t = Tensor {
            dtype,
            dims: dims.to_vec(),
            storage: Storage::External(ExternalData {
                location: "w.bin".into(),
                path: PathBuf::from("w.bin"),
                offset: 0,
                length: 0,
                present: false,
            }),
        };
        let ty = TensorType { dtype, shape: Some(Shape::from_known(dims)) };
        self.g.add_value(name, ValueKind::Initializer, Some(ty), Some(t)).unwrap()
    }

    /// A constant value (not a node).
    pub fn constant(&mut self, t: Tensor) -> ValueId {
        let name = self.fresh("const");
        let ty = TensorType { dtype: t.dtype, shape: Some(Shape::from_known(&t.dims)) };
        self.g.add_value(name, ValueKind::Constant, Some(ty), Some(t)).unwrap()
    }

    pub fn ints(&mut self, v: &[i64]) -> ValueId {
        self.constant(Tensor::from_i64(vec![v.len() as i64], v))
    }

    /// Adds a node with `n_out` outputs.
    pub fn node_n(&mut self, kind: OpKind, inputs: &[Option<ValueId>], attrs: &[(&str, Attr)], n_out: usize) -> Vec<ValueId> {
        let outs: Vec<ValueId> = (0..n_out)
            .map(|_| {
                let n = self.fresh(kind.name());
                self.g.add_value(n, ValueKind::Intermediate, None, None).unwrap()
            })
            .collect();
        let mut a = Attrs::default();
        for (k, v) in attrs {
            a.set(k, v.clone());
        }
        let name = self.fresh(&format!("n_{}", kind.name()));
        let order = self.g.node_count() as u32;
        self.g
            .add_node(Node {
                name,
                op: Op::Known(kind),
                attrs: a,
                inputs: inputs.to_vec(),
                outputs: outs.clone(),
                namespace: self.namespace.clone(),
                order,
            })
            .unwrap();
        outs
    }

    pub fn node(&mut self, kind: OpKind, inputs: &[ValueId], attrs: &[(&str, Attr)]) -> ValueId {
        let ins: Vec<Option<ValueId>> = inputs.iter().map(|&v| Some(v)).collect();
        self.node_n(kind, &ins, attrs, 1)[0]
    }

    pub fn output(&mut self, v: ValueId) {
        self.g.outputs.push(v);
    }
}

/// Sizes of the hand-built GPT.
#[derive(Clone, Copy)]
pub struct Gpt {
    pub blocks: usize,
    pub hidden: i64,
    pub heads: i64,
    pub vocab: i64,
    pub ffn: i64,
    /// `None` = symbolic batch.
    pub batch: Option<i64>,
    /// `None` = symbolic sequence.
    pub seq: Option<i64>,
    pub dtype: DType,
    /// Write `namespace` metadata.
    pub namespaces: bool,
    /// Name weights `h.<i>.…` (else `val_<n>` as the exporter does for folded weights).
    pub layer_names: bool,
}

/// A Megatron-style pre-LN GPT: embedding, blocks (LN → QKV → attention with Softmax → proj
/// → add → LN → fc1 → Gelu → fc2 → add), final LN and an LM head tied to the embedding.
pub fn gpt(c: Gpt) -> Graph {
    let mut b = Builder::new();
    let (h, a) = (c.hidden, c.heads);
    let d = h / a;
    let bs = c.batch.map(|x| x.to_string()).unwrap_or("batch".into());
    let ss = c.seq.map(|x| x.to_string()).unwrap_or("seq".into());
    let ids = b.input("input_ids", DType::I64, &[&bs, &ss]);
    let ns = |b: &mut Builder, path: &str| {
        if c.namespaces {
            b.namespace = Some(format!(": __main__.W/m: GPT{path}/op: aten.op"));
        }
    };
    let mut pnum = 0;
    let mut pname = |layer: Option<usize>, what: &str| {
        pnum += 1;
        match layer {
            Some(i) if c.layer_names => format!("h.{i}.{what}"),
            None if c.layer_names => what.to_string(),
            _ => format!("val_{pnum}"),
        }
    };
    ns(&mut b, "/m.wte: Embedding");
    let wte = b.param(&pname(None, "wte.weight"), c.dtype, &[c.vocab, h]);
    let mut x = b.node(OpKind::Gather, &[wte, ids], &[]);
    // Shape arithmetic as exporters write it: Shape → Gather → Concat → Reshape.
    ns(&mut b, "");
    let shape = b.node(OpKind::Shape, &[ids], &[]);
    let i0 = b.constant(Tensor::from_i64(vec![], &[0]));
    let i1 = b.constant(Tensor::from_i64(vec![], &[1]));
    let bdim = b.node(OpKind::Gather, &[shape, i0], &[]);
    let sdim = b.node(OpKind::Gather, &[shape, i1], &[]);
    let zero = b.ints(&[0]);
    let bdim = b.node(OpKind::Unsqueeze, &[bdim, zero], &[]);
    let sdim = b.node(OpKind::Unsqueeze, &[sdim, zero], &[]);
    let heads = b.ints(&[a, d]);
    let hid = b.ints(&[h]);
    let split_shape = b.node(OpKind::Concat, &[bdim, sdim, heads], &[("axis", Attr::Int(0))]);
    let merge_shape = b.node(OpKind::Concat, &[bdim, sdim, hid], &[("axis", Attr::Int(0))]);
    let scale = b.constant(match c.dtype {
        DType::BF16 => Tensor {
            dtype: DType::BF16,
            dims: vec![],
            storage: Storage::Raw(half::bf16::from_f32((d as f32).sqrt()).to_le_bytes().to_vec().into()),
        },
        _ => Tensor::from_f32(vec![], &[(d as f32).sqrt()]),
    });
    let perm_q = Attr::Ints(vec![0, 2, 1, 3]);
    let perm_k = Attr::Ints(vec![0, 2, 3, 1]);
    for i in 0..c.blocks {
        let p = format!("/m.h.{i}: Block");
        ns(&mut b, &format!("{p}/m.h.{i}.ln_1: LayerNorm"));
        let w = b.param(&pname(Some(i), "ln_1.weight"), c.dtype, &[h]);
        let bb = b.param(&pname(Some(i), "ln_1.bias"), c.dtype, &[h]);
        let ln = b.node(OpKind::LayerNormalization, &[x, w, bb], &[("axis", Attr::Int(-1))]);
        ns(&mut b, &format!("{p}/m.h.{i}.attn: Attention"));
        let wqkv = b.param(&pname(Some(i), "attn.qkv.weight"), c.dtype, &[h, 3 * h]);
        let bqkv = b.param(&pname(Some(i), "attn.qkv.bias"), c.dtype, &[3 * h]);
        let qkv = b.node(OpKind::MatMul, &[ln, wqkv], &[]);
        let qkv = b.node(OpKind::Add, &[qkv, bqkv], &[]);
        let parts = b.node_n(OpKind::Split, &[Some(qkv)], &[("axis", Attr::Int(2)), ("num_outputs", Attr::Int(3))], 3);
        let q = b.node(OpKind::Reshape, &[parts[0], split_shape], &[]);
        let q = b.node(OpKind::Transpose, &[q], &[("perm", perm_q.clone())]);
        let k = b.node(OpKind::Reshape, &[parts[1], split_shape], &[]);
        let k = b.node(OpKind::Transpose, &[k], &[("perm", perm_k.clone())]);
        let v = b.node(OpKind::Reshape, &[parts[2], split_shape], &[]);
        let v = b.node(OpKind::Transpose, &[v], &[("perm", perm_q.clone())]);
        let s = b.node(OpKind::MatMul, &[q, k], &[]);
        let s = b.node(OpKind::Div, &[s, scale], &[]);
        let pr = b.node(OpKind::Softmax, &[s], &[("axis", Attr::Int(-1))]);
        let ctx = b.node(OpKind::MatMul, &[pr, v], &[]);
        let ctx = b.node(OpKind::Transpose, &[ctx], &[("perm", perm_q.clone())]);
        let ctx = b.node(OpKind::Reshape, &[ctx, merge_shape], &[]);
        let wo = b.param(&pname(Some(i), "attn.proj.weight"), c.dtype, &[h, h]);
        let bo = b.param(&pname(Some(i), "attn.proj.bias"), c.dtype, &[h]);
        let o = b.node(OpKind::MatMul, &[ctx, wo], &[]);
        let o = b.node(OpKind::Add, &[o, bo], &[]);
        ns(&mut b, &p);
        let r = b.node(OpKind::Add, &[x, o], &[]);
        ns(&mut b, &format!("{p}/m.h.{i}.ln_2: LayerNorm"));
        let w = b.param(&pname(Some(i), "ln_2.weight"), c.dtype, &[h]);
        let bb = b.param(&pname(Some(i), "ln_2.bias"), c.dtype, &[h]);
        let ln = b.node(OpKind::LayerNormalization, &[r, w, bb], &[("axis", Attr::Int(-1))]);
        ns(&mut b, &format!("{p}/m.h.{i}.mlp: Mlp"));
        let w1 = b.param(&pname(Some(i), "mlp.fc1.weight"), c.dtype, &[h, c.ffn]);
        let b1 = b.param(&pname(Some(i), "mlp.fc1.bias"), c.dtype, &[c.ffn]);
        let w2 = b.param(&pname(Some(i), "mlp.fc2.weight"), c.dtype, &[c.ffn, h]);
        let b2 = b.param(&pname(Some(i), "mlp.fc2.bias"), c.dtype, &[h]);
        let f = b.node(OpKind::MatMul, &[ln, w1], &[]);
        let f = b.node(OpKind::Add, &[f, b1], &[]);
        let f = b.node(OpKind::Gelu, &[f], &[]);
        let f = b.node(OpKind::MatMul, &[f, w2], &[]);
        let f = b.node(OpKind::Add, &[f, b2], &[]);
        ns(&mut b, &p);
        x = b.node(OpKind::Add, &[r, f], &[]);
    }
    ns(&mut b, "/m.ln_f: LayerNorm");
    let w = b.param(&pname(None, "ln_f.weight"), c.dtype, &[h]);
    let bb = b.param(&pname(None, "ln_f.bias"), c.dtype, &[h]);
    let x = b.node(OpKind::LayerNormalization, &[x, w, bb], &[("axis", Attr::Int(-1))]);
    ns(&mut b, "/m.lm_head: Linear");
    let wt = b.node(OpKind::Transpose, &[wte], &[("perm", Attr::Ints(vec![1, 0]))]);
    let logits = b.node(OpKind::MatMul, &[x, wt], &[]);
    b.output(logits);
    b.g
}
