//! Import speed of a graph-only GPT-3 175B-shaped model (96 layers, hidden 12288, bf16 weights
//! in a never-written external file), built here with prost. Goal: well under 100 ms.
//!
//! Run: `cargo bench --bench import` (or `--profile dev` for a quick look). Prints numbers.

use std::time::Instant;

use prost::Message;
use smp_partition::frontend::onnx::load_model;
use smp_partition::frontend::onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, tensor_shape_proto, type_proto,
};

const LAYERS: usize = 96;
const HIDDEN: i64 = 12288;
const HEADS: i64 = 96;
const VOCAB: i64 = 51200;
const SEQ: i64 = 2048;
const BF16: i32 = 16;

struct Builder {
    graph: GraphProto,
    offset: u64,
    params: u64,
    count: usize,
}

impl Builder {
    fn weight(&mut self, name: &str, dims: &[i64]) -> String {
        let numel: i64 = dims.iter().product();
        let length = numel as u64 * 2;
        let kv = |k: &str, v: String| StringStringEntryProto { key: Some(k.into()), value: Some(v) };
        self.graph.initializer.push(TensorProto {
            name: Some(name.into()),
            data_type: Some(BF16),
            dims: dims.to_vec(),
            data_location: Some(1),
            external_data: vec![
                kv("location", "gpt3.onnx.data".into()),
                kv("offset", self.offset.to_string()),
                kv("length", length.to_string()),
            ],
            ..Default::default()
        });
        self.offset += length;
        self.params += numel as u64;
        name.to_string()
    }

    fn shape_const(&mut self, values: &[i64]) -> String {
        let name = format!("val_{}", self.count);
        self.count += 1;
        self.graph.initializer.push(TensorProto {
            name: Some(name.clone()),
            data_type: Some(7),
            dims: vec![values.len() as i64],
            raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into()),
            ..Default::default()
        });
        name
    }

    fn node(&mut self, op: &str, inputs: &[&str], namespace: &str, attrs: Vec<AttributeProto>) -> String {
        let out = format!("{}_{}", op.to_lowercase(), self.count);
        self.count += 1;
        self.graph.node.push(NodeProto {
            op_type: Some(op.into()),
            name: Some(format!("node_{out}")),
            input: inputs.iter().map(|s| (*s).into()).collect(),
            output: vec![out.clone()],
            attribute: attrs,
            metadata_props: vec![StringStringEntryProto {
                key: Some("namespace".into()),
                value: Some(format!("{namespace}/{out}: aten.{}.default", op.to_lowercase())),
            }],
            ..Default::default()
        });
        out
    }
}

fn int_attr(name: &str, v: i64) -> AttributeProto {
    AttributeProto { name: Some(name.into()), r#type: Some(2), i: Some(v), ..Default::default() }
}

fn gpt3() -> (ModelProto, u64) {
    let mut b = Builder { graph: GraphProto { name: Some("gpt3".into()), ..Default::default() }, offset: 0, params: 0, count: 0 };
    let dim = |d: tensor_shape_proto::dimension::Value| tensor_shape_proto::Dimension { value: Some(d), ..Default::default() };
    let vi = |name: &str, elem: i32, dims: Vec<tensor_shape_proto::Dimension>| ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem),
                shape: Some(TensorShapeProto { dim: dims }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    use tensor_shape_proto::dimension::Value::{DimParam, DimValue};
    b.graph.input.push(vi("input_ids", 7, vec![dim(DimParam("batch".into())), dim(DimValue(SEQ))]));
    let root = ": __main__.GPT/m.transformer: GPT3Model";
    let wte = b.weight("transformer.wte.weight", &[VOCAB, HIDDEN]);
    let wpe = b.weight("transformer.wpe.weight", &[SEQ, HIDDEN]);
    let tok = b.node("Gather", &[&wte, "input_ids"], root, vec![]);
    let mut x = b.node("Add", &[&tok, &wpe], root, vec![]);
    for l in 0..LAYERS {
        let ns = format!("{root}/m.transformer.h.{l}: GPT3Block");
        let p = format!("transformer.h.{l}");
        let ln1w = b.weight(&format!("{p}.ln_1.weight"), &[HIDDEN]);
        let ln1b = b.weight(&format!("{p}.ln_1.bias"), &[HIDDEN]);
        let qkvw = b.weight(&format!("{p}.attn.c_attn.weight"), &[HIDDEN, 3 * HIDDEN]);
        let qkvb = b.weight(&format!("{p}.attn.c_attn.bias"), &[3 * HIDDEN]);
        let projw = b.weight(&format!("{p}.attn.c_proj.weight"), &[HIDDEN, HIDDEN]);
        let projb = b.weight(&format!("{p}.attn.c_proj.bias"), &[HIDDEN]);
        let ln2w = b.weight(&format!("{p}.ln_2.weight"), &[HIDDEN]);
        let ln2b = b.weight(&format!("{p}.ln_2.bias"), &[HIDDEN]);
        let fcw = b.weight(&format!("{p}.mlp.c_fc.weight"), &[HIDDEN, 4 * HIDDEN]);
        let fcb = b.weight(&format!("{p}.mlp.c_fc.bias"), &[4 * HIDDEN]);
        let fc2w = b.weight(&format!("{p}.mlp.c_proj.weight"), &[4 * HIDDEN, HIDDEN]);
        let fc2b = b.weight(&format!("{p}.mlp.c_proj.bias"), &[HIDDEN]);
        let heads = b.shape_const(&[-1, SEQ, HEADS, HIDDEN / HEADS]);
        let merged = b.shape_const(&[-1, SEQ, HIDDEN]);
        let split = b.shape_const(&[HIDDEN, HIDDEN, HIDDEN]);

        let h = b.node("LayerNormalization", &[&x, &ln1w, &ln1b], &ns, vec![int_attr("axis", -1)]);
        let qkv = b.node("MatMul", &[&h, &qkvw], &ns, vec![]);
        let qkv = b.node("Add", &[&qkv, &qkvb], &ns, vec![]);
        let q = b.node("Split", &[&qkv, &split], &ns, vec![int_attr("axis", 2)]);
        let q = b.node("Reshape", &[&q, &heads], &ns, vec![]);
        let q = b.node("Transpose", &[&q], &ns, vec![]);
        let s = b.node("MatMul", &[&q, &q], &ns, vec![]);
        let s = b.node("Softmax", &[&s], &ns, vec![int_attr("axis", -1)]);
        let a = b.node("MatMul", &[&s, &q], &ns, vec![]);
        let a = b.node("Transpose", &[&a], &ns, vec![]);
        let a = b.node("Reshape", &[&a, &merged], &ns, vec![]);
        let a = b.node("MatMul", &[&a, &projw], &ns, vec![]);
        let a = b.node("Add", &[&a, &projb], &ns, vec![]);
        let r = b.node("Add", &[&x, &a], &ns, vec![]);
        let h = b.node("LayerNormalization", &[&r, &ln2w, &ln2b], &ns, vec![int_attr("axis", -1)]);
        let f = b.node("MatMul", &[&h, &fcw], &ns, vec![]);
        let f = b.node("Add", &[&f, &fcb], &ns, vec![]);
        let f = b.node("Gelu", &[&f], &ns, vec![]);
        let f = b.node("MatMul", &[&f, &fc2w], &ns, vec![]);
        let f = b.node("Add", &[&f, &fc2b], &ns, vec![]);
        x = b.node("Add", &[&r, &f], &ns, vec![]);
    }
    let lnfw = b.weight("transformer.ln_f.weight", &[HIDDEN]);
    let lnfb = b.weight("transformer.ln_f.bias", &[HIDDEN]);
    let h = b.node("LayerNormalization", &[&x, &lnfw, &lnfb], root, vec![]);
    let wt = b.node("Transpose", &[&wte], root, vec![]);
    let logits = b.node("MatMul", &[&h, &wt], root, vec![]);
    b.graph.output.push(vi(&logits, 16, vec![dim(DimParam("batch".into())), dim(DimValue(SEQ)), dim(DimValue(VOCAB))]));
    let model = ModelProto {
        ir_version: Some(10),
        producer_name: Some("smp-partition bench".into()),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(18) }],
        graph: Some(b.graph),
        ..Default::default()
    };
    (model, b.params)
}

fn main() {
    let (model, params) = gpt3();
    let dir = std::env::temp_dir().join(format!("smp-import-bench-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("{}: {e}", dir.display());
        std::process::exit(1);
    }
    let path = dir.join("gpt3.onnx");
    let bytes = model.encode_to_vec();
    if let Err(e) = std::fs::write(&path, &bytes) {
        eprintln!("{}: {e}", path.display());
        std::process::exit(1);
    }
    let graph = model.graph.as_ref().map(|g| (g.initializer.len(), g.node.len())).unwrap_or_default();
    println!(
        "gpt3-175b graph-only: {} bytes, {} initializers, {} nodes, {:.1}B params",
        bytes.len(),
        graph.0,
        graph.1,
        params as f64 / 1e9
    );
    let runs = 20;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        match load_model(&path) {
            Ok(m) => assert_eq!(m.graph.node_count(), graph.1),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1);
            }
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    report("synthetic gpt3-175b", &mut times);
    let _ = std::fs::remove_dir_all(&dir);

    // The checked-in graph-only models, when present.
    let repo = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    for name in ["gpt3-175b", "llama3-70b", "gpt-1t"] {
        let path = repo.join("models").join(format!("{name}.onnx"));
        if !path.exists() {
            continue;
        }
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t = Instant::now();
            if let Err(e) = load_model(&path) {
                eprintln!("{e}");
                std::process::exit(1);
            }
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        report(&format!("models/{name}.onnx"), &mut times);
    }
}

fn report(what: &str, times: &mut [f64]) {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    println!("load_model {what}: min {:.2} ms, median {:.2} ms, max {:.2} ms over {n} runs", times[0], times[n / 2], times[n - 1]);
}
