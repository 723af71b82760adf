//! ONNX frontend: models built in Rust with prost, written to a tempdir, imported.

use std::path::{Path, PathBuf};

use prost::Message;
use smp_partition::frontend::onnx::proto::{
    AttributeProto, FunctionProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto,
    TensorProto, TensorShapeProto, TypeProto, ValueInfoProto, tensor_shape_proto, type_proto,
};
use smp_partition::frontend::onnx::{
    ImportError, ImportWarning, ImportedModel, decode_model_bytes, load_model, load_tensor_pb, tensor_from_proto,
};
use smp_partition::ir::{Attr, DType, Dim, Op, OpKind, Shape, Storage, Tensor, TensorType, ValueKind};

// ---- builders ----------------------------------------------------------------------------

const F32: i32 = 1;
const I64: i32 = 7;

fn raw_tensor(name: &str, data_type: i32, dims: &[i64], raw: Vec<u8>) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        data_type: Some(data_type),
        dims: dims.to_vec(),
        raw_data: Some(raw.into()),
        ..Default::default()
    }
}

fn f32_tensor(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
    raw_tensor(name, F32, dims, values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

fn external_tensor(name: &str, dims: &[i64], kv: &[(&str, &str)]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        data_type: Some(F32),
        dims: dims.to_vec(),
        data_location: Some(1),
        external_data: kv
            .iter()
            .map(|(k, v)| StringStringEntryProto { key: Some((*k).into()), value: Some((*v).into()) })
            .collect(),
        ..Default::default()
    }
}

enum D {
    K(i64),
    S(&'static str),
    Unknown,
}

fn value_info(name: &str, elem: i32, dims: &[D]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| tensor_shape_proto::Dimension {
            value: match d {
                D::K(v) => Some(tensor_shape_proto::dimension::Value::DimValue(*v)),
                D::S(s) => Some(tensor_shape_proto::dimension::Value::DimParam((*s).into())),
                D::Unknown => None,
            },
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(op: &str, name: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(name.into()),
        input: inputs.iter().map(|s| (*s).into()).collect(),
        output: outputs.iter().map(|s| (*s).into()).collect(),
        ..Default::default()
    }
}

fn attr_int(name: &str, v: i64) -> AttributeProto {
    AttributeProto { name: Some(name.into()), r#type: Some(2), i: Some(v), ..Default::default() }
}

fn attr_float(name: &str, v: f32) -> AttributeProto {
    AttributeProto { name: Some(name.into()), r#type: Some(1), f: Some(v), ..Default::default() }
}

fn attr_ref(name: &str, reference: &str, ty: i32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(ty),
        ref_attr_name: Some(reference.into()),
        ..Default::default()
    }
}

fn model(graph: GraphProto) -> ModelProto {
    ModelProto {
        ir_version: Some(10),
        producer_name: Some("frontend-test".into()),
        opset_import: vec![OperatorSetIdProto { domain: Some("".into()), version: Some(18) }],
        graph: Some(graph),
        ..Default::default()
    }
}

/// y = x @ w + b with a symbolic batch.
fn linear_graph() -> GraphProto {
    GraphProto {
        name: Some("linear".into()),
        node: vec![node("MatMul", "mm", &["x", "w"], &["xw"]), node("Add", "add", &["xw", "b"], &["y"])],
        initializer: vec![
            f32_tensor("w", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            f32_tensor("b", &[3], &[0.5, -0.5, 0.25]),
        ],
        input: vec![value_info("x", F32, &[D::S("batch"), D::K(2)])],
        output: vec![value_info("y", F32, &[D::S("batch"), D::K(3)])],
        ..Default::default()
    }
}

fn write_bytes(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn write_model(dir: &Path, name: &str, m: &ModelProto) -> PathBuf {
    write_bytes(dir, name, &m.encode_to_vec())
}

fn import(m: &ModelProto) -> Result<ImportedModel, ImportError> {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path(), "model.onnx", m);
    load_model(&path)
}

fn import_graph(g: GraphProto) -> Result<ImportedModel, ImportError> {
    import(&model(g))
}

fn err_text(r: Result<ImportedModel, ImportError>) -> String {
    match r {
        Ok(_) => panic!("expected an import error"),
        Err(e) => e.to_string(),
    }
}

fn init_tensor<'a>(m: &'a ImportedModel, name: &str) -> &'a Tensor {
    let v = m.graph.value_by_name(name).unwrap_or_else(|| panic!("no value {name}"));
    m.graph.value(v).data.as_ref().unwrap_or_else(|| panic!("{name} has no data"))
}

// ---- basics ------------------------------------------------------------------------------

#[test]
fn raw_data_model_imports_with_types_kinds_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(linear_graph());
    let bytes = m.encode_to_vec();
    let path = write_bytes(dir.path(), "linear.onnx", &bytes);
    let imported = load_model(&path).unwrap();
    let g = &imported.graph;

    assert_eq!(imported.ir_version, 10);
    assert_eq!(imported.producer_name, "frontend-test");
    assert_eq!(imported.opsets.get(""), Some(&18));
    assert_eq!(g.opsets, imported.opsets);
    assert!(imported.warnings.is_empty(), "{:?}", imported.warnings);
    use sha2::Digest;
    let want: String = sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(imported.sha256, want);

    assert_eq!(g.node_count(), 2);
    let x = g.value_by_name("x").unwrap();
    assert_eq!(g.inputs, vec![x]);
    assert_eq!(g.value(x).kind, ValueKind::Input);
    assert_eq!(
        g.value(x).ty,
        Some(TensorType { dtype: DType::F32, shape: Some(Shape(vec![Dim::Sym("batch".into()), Dim::Known(2)])) })
    );
    let w = g.value_by_name("w").unwrap();
    assert_eq!(g.value(w).kind, ValueKind::Initializer);
    assert_eq!(init_tensor(&imported, "w").to_f64_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let y = g.value_by_name("y").unwrap();
    assert_eq!(g.outputs, vec![y]);
    assert_eq!(g.value(y).kind, ValueKind::Intermediate);
    assert_eq!(g.value(y).ty.as_ref().map(|t| t.to_string()), Some("f32[batch,3]".to_string()));

    let order = g.topo_order().unwrap();
    let ops: Vec<&Op> = order.iter().map(|&n| &g.node(n).op).collect();
    assert_eq!(ops, vec![&Op::Known(OpKind::MatMul), &Op::Known(OpKind::Add)]);
    let add = g.node(order[1]);
    assert_eq!(add.inputs, vec![g.value_by_name("xw"), Some(g.value_by_name("b").unwrap())]);
    assert_eq!(add.order, 1);
    g.verify().unwrap();
    let mm = g.value_by_name("xw").unwrap();
    assert_eq!(g.value(mm).producer, Some(order[0]));
}

#[test]
fn decode_model_bytes_matches_load_model() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(linear_graph());
    let path = write_model(dir.path(), "linear.onnx", &m);
    let a = load_model(&path).unwrap();
    let b = decode_model_bytes(&m.encode_to_vec(), &path).unwrap();
    assert_eq!(a.sha256, b.sha256);
    assert_eq!(a.graph.to_string(), b.graph.to_string());
}

#[test]
fn input_that_is_also_an_initializer_is_an_initializer() {
    let mut g = linear_graph();
    g.input.push(value_info("w", F32, &[D::K(2), D::K(3)]));
    let m = import_graph(g).unwrap();
    let w = m.graph.value_by_name("w").unwrap();
    assert_eq!(m.graph.value(w).kind, ValueKind::Initializer);
    assert_eq!(m.graph.inputs.len(), 1);
}

#[test]
fn opsets_ai_onnx_maps_to_default_domain_and_custom_domains_kept() {
    let mut m = model(linear_graph());
    m.opset_import = vec![
        OperatorSetIdProto { domain: Some("ai.onnx".into()), version: Some(17) },
        OperatorSetIdProto { domain: Some("com.microsoft".into()), version: Some(1) },
    ];
    let imported = import(&m).unwrap();
    assert_eq!(imported.graph.opsets.get(""), Some(&17));
    assert_eq!(imported.graph.opsets.get("com.microsoft"), Some(&1));
    assert_eq!(imported.graph.opsets.len(), 2);
}

#[test]
fn value_info_types_and_unknown_dims_become_fresh_symbols() {
    let mut g = linear_graph();
    g.value_info.push(value_info("xw", F32, &[D::Unknown, D::K(3)]));
    g.input[0] = value_info("x", F32, &[D::Unknown, D::K(2)]);
    let m = import_graph(g).unwrap();
    let ty = |n: &str| m.graph.value(m.graph.value_by_name(n).unwrap()).ty.clone().unwrap();
    let (xw, x) = (ty("xw"), ty("x"));
    let (Dim::Sym(a), Dim::Sym(b)) = (&xw.shape.as_ref().unwrap().0[0], &x.shape.as_ref().unwrap().0[0]) else {
        panic!("unknown dims must be symbols: {xw} {x}");
    };
    assert!(a.starts_with('?') && b.starts_with('?'));
    assert_ne!(a, b, "each unknown dim gets its own symbol");
}

#[test]
fn nodes_keep_namespace_order_and_get_unique_names() {
    let mut g = linear_graph();
    g.node[0].name = Some(String::new());
    g.node[1].name = Some("dup".into());
    g.node.push(node("Relu", "dup", &["y"], &["r"]));
    g.node.push(node("Relu", "", &["r"], &["r2"]));
    g.node[0].metadata_props.push(StringStringEntryProto {
        key: Some("namespace".into()),
        value: Some(": __main__.W/m.transformer.h.0: transformers.GPT2Block".into()),
    });
    g.output = vec![value_info("r2", F32, &[])];
    let m = import_graph(g).unwrap();
    let gr = &m.graph;
    let mut names: Vec<(u32, String, Option<String>)> = gr
        .node_ids()
        .map(|id| {
            let n = gr.node(id);
            (n.order, n.name.clone(), n.namespace.clone())
        })
        .collect();
    names.sort();
    let just: Vec<&str> = names.iter().map(|n| n.1.as_str()).collect();
    assert_eq!(just, vec!["MatMul_0", "dup", "dup_0", "Relu_0"]);
    assert_eq!(names[0].2.as_deref(), Some(": __main__.W/m.transformer.h.0: transformers.GPT2Block"));
    assert_eq!(names[1].2, None);
}

#[test]
fn nodes_out_of_topological_order_are_wired_correctly() {
    let mut g = linear_graph();
    g.node.reverse();
    let m = import_graph(g).unwrap();
    m.graph.verify().unwrap();
    let order = m.graph.topo_order().unwrap();
    assert_eq!(m.graph.node(order[0]).name, "mm");
    assert_eq!(m.graph.node(order[1]).name, "add");
    assert_eq!(m.graph.predecessors(order[1]).collect::<Vec<_>>(), vec![order[0]]);
}

#[test]
fn attributes_of_every_plain_type_are_parsed() {
    let mut g = linear_graph();
    let mut n = node("Custom", "c", &["y"], &["z"]);
    n.domain = Some("test.domain".into());
    n.attribute = vec![
        attr_int("i", -3),
        attr_float("f", 0.5),
        AttributeProto { name: Some("s".into()), r#type: Some(3), s: Some(b"hello".to_vec()), ..Default::default() },
        AttributeProto { name: Some("is".into()), r#type: Some(7), ints: vec![1, 2, 3], ..Default::default() },
        AttributeProto { name: Some("fs".into()), r#type: Some(6), floats: vec![1.5, 2.5], ..Default::default() },
        AttributeProto {
            name: Some("ss".into()),
            r#type: Some(8),
            strings: vec![b"a".to_vec(), b"b".to_vec()],
            ..Default::default()
        },
        AttributeProto {
            name: Some("t".into()),
            r#type: Some(4),
            t: Some(f32_tensor("", &[2], &[1.0, 2.0])),
            ..Default::default()
        },
        // No `type` (IR < 2 style): inferred from the field that is set.
        AttributeProto { name: Some("legacy".into()), ints: vec![7], ..Default::default() },
    ];
    g.node.push(n);
    g.output = vec![value_info("z", F32, &[])];
    let m = import_graph(g).unwrap();
    let id = m.graph.node_ids().find(|&i| m.graph.node(i).name == "c").unwrap();
    let a = &m.graph.node(id).attrs;
    assert_eq!(a.get("i"), Some(&Attr::Int(-3)));
    assert_eq!(a.get("f"), Some(&Attr::Float(0.5)));
    assert_eq!(a.get("s"), Some(&Attr::Str("hello".into())));
    assert_eq!(a.get("is"), Some(&Attr::Ints(vec![1, 2, 3])));
    assert_eq!(a.get("fs"), Some(&Attr::Floats(vec![1.5, 2.5])));
    assert_eq!(a.get("ss"), Some(&Attr::Strs(vec!["a".into(), "b".into()])));
    assert_eq!(a.tensor("t").and_then(Tensor::to_f64_vec), Some(vec![1.0, 2.0]));
    assert_eq!(a.get("legacy"), Some(&Attr::Ints(vec![7])));
}

// ---- storage forms -----------------------------------------------------------------------

/// One element type stored in its typed field and as raw_data must decode to the same bytes.
fn check_typed(data_type: i32, dtype: DType, dims: &[i64], fill: impl Fn(&mut TensorProto), raw: Vec<u8>) {
    let mut typed = TensorProto { name: Some("t".into()), data_type: Some(data_type), dims: dims.to_vec(), ..Default::default() };
    fill(&mut typed);
    let here = Path::new("model.onnx");
    let from_typed = tensor_from_proto(&typed, here).unwrap();
    let from_raw = tensor_from_proto(&raw_tensor("t", data_type, dims, raw.clone()), here).unwrap();
    assert_eq!(from_typed.dtype, dtype);
    assert_eq!(from_typed.dims, dims);
    assert_eq!(from_typed.raw(), Some(raw.as_slice()), "typed field of {dtype}");
    assert_eq!(from_typed, from_raw);
}

#[test]
fn every_typed_storage_field_decodes_like_raw_data() {
    let f = [1.5f32, -2.0, 3.25, 0.0];
    check_typed(1, DType::F32, &[2, 2], |t| t.float_data = f.to_vec(), f.iter().flat_map(|v| v.to_le_bytes()).collect());
    let d = [1.5f64, -1e300, 7.0];
    check_typed(11, DType::F64, &[3], |t| t.double_data = d.to_vec(), d.iter().flat_map(|v| v.to_le_bytes()).collect());
    let l = [i64::MIN, -1, 0, i64::MAX];
    check_typed(7, DType::I64, &[4], |t| t.int64_data = l.to_vec(), l.iter().flat_map(|v| v.to_le_bytes()).collect());
    let i = [i32::MIN, -7, 9];
    check_typed(6, DType::I32, &[3], |t| t.int32_data = i.to_vec(), i.iter().flat_map(|v| v.to_le_bytes()).collect());
    let u = [u64::MAX, 3];
    check_typed(13, DType::U64, &[2], |t| t.uint64_data = u.to_vec(), u.iter().flat_map(|v| v.to_le_bytes()).collect());
    let u32s = [u32::MAX, 5];
    check_typed(
        12,
        DType::U32,
        &[2],
        |t| t.uint64_data = u32s.iter().map(|&v| v as u64).collect(),
        u32s.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    // 16-bit floats travel as bit patterns in int32_data.
    let h: Vec<half::f16> = [1.0f32, -0.5, 65504.0].iter().map(|&v| half::f16::from_f32(v)).collect();
    check_typed(
        10,
        DType::F16,
        &[3],
        |t| t.int32_data = h.iter().map(|v| v.to_bits() as i32).collect(),
        h.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    let bf: Vec<half::bf16> = [1.0f32, -3.0, 1e30].iter().map(|&v| half::bf16::from_f32(v)).collect();
    check_typed(
        16,
        DType::BF16,
        &[3],
        |t| t.int32_data = bf.iter().map(|v| v.to_bits() as i32).collect(),
        bf.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    let i16s = [i16::MIN, -1, 300];
    check_typed(
        5,
        DType::I16,
        &[3],
        |t| t.int32_data = i16s.iter().map(|&v| v as i32).collect(),
        i16s.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    let u16s = [u16::MAX, 2];
    check_typed(
        4,
        DType::U16,
        &[2],
        |t| t.int32_data = u16s.iter().map(|&v| v as i32).collect(),
        u16s.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    let i8s = [-128i8, -1, 127];
    check_typed(3, DType::I8, &[3], |t| t.int32_data = i8s.iter().map(|&v| v as i32).collect(), i8s.iter().map(|&v| v as u8).collect());
    check_typed(2, DType::U8, &[2], |t| t.int32_data = vec![255, 0], vec![255, 0]);
    check_typed(9, DType::Bool, &[3], |t| t.int32_data = vec![1, 0, 1], vec![1, 0, 1]);
    // complex64 as (re, im) float pairs
    check_typed(14, DType::C64, &[1], |t| t.float_data = vec![1.0, 2.0], [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect());
    // scalars and empty tensors
    check_typed(1, DType::F32, &[], |t| t.float_data = vec![4.0], 4.0f32.to_le_bytes().to_vec());
    check_typed(1, DType::F32, &[0, 3], |_| {}, vec![]);
}

#[test]
fn typed_values_read_back_as_numbers() {
    let here = Path::new("m.onnx");
    let mut t = TensorProto { name: Some("h".into()), data_type: Some(10), dims: vec![2], ..Default::default() };
    t.int32_data = vec![half::f16::from_f32(0.5).to_bits() as i32, half::f16::from_f32(-2.0).to_bits() as i32];
    assert_eq!(tensor_from_proto(&t, here).unwrap().to_f64_vec(), Some(vec![0.5, -2.0]));
    let t = TensorProto { name: Some("l".into()), data_type: Some(7), dims: vec![3], int64_data: vec![5, -6, 7], ..Default::default() };
    assert_eq!(tensor_from_proto(&t, here).unwrap().to_i64_vec(), Some(vec![5, -6, 7]));
}

#[test]
fn string_tensors_keep_their_bytes() {
    let t = TensorProto {
        name: Some("s".into()),
        data_type: Some(8),
        dims: vec![2],
        string_data: vec![b"ab".to_vec(), vec![0xff, 0]],
        ..Default::default()
    };
    let tensor = tensor_from_proto(&t, Path::new("m.onnx")).unwrap();
    assert_eq!(tensor.storage, Storage::Strings(vec![b"ab".to_vec(), vec![0xff, 0]]));
}

#[test]
fn wrong_data_length_names_the_tensor() {
    let mut g = linear_graph();
    g.initializer[0] = raw_tensor("w", F32, &[2, 3], vec![0; 20]);
    let e = err_text(import_graph(g));
    assert!(e.contains("`w`") && e.contains("20 bytes") && e.contains("24"), "{e}");
    let mut g = linear_graph();
    g.initializer[1] = TensorProto { name: Some("b".into()), data_type: Some(F32), dims: vec![3], float_data: vec![1.0], ..Default::default() };
    let e = err_text(import_graph(g));
    assert!(e.contains("`b`"), "{e}");
    let mut g = linear_graph();
    g.initializer[1].data_type = Some(999);
    let e = err_text(import_graph(g));
    assert!(e.contains("`b`") && e.contains("999"), "{e}");
}

// ---- external data -----------------------------------------------------------------------

/// A model whose `w` (2×3 f32 = 24 bytes) and `b` (3 f32 = 12 bytes) live in external files.
fn external_model(w_kv: &[(&str, &str)], b_kv: &[(&str, &str)]) -> ModelProto {
    let mut g = linear_graph();
    g.initializer = vec![external_tensor("w", &[2, 3], w_kv), external_tensor("b", &[3], b_kv)];
    model(g)
}

fn import_in(dir: &Path, m: &ModelProto) -> Result<ImportedModel, ImportError> {
    load_model(&write_model(dir, "model.onnx", m))
}

#[test]
fn external_data_present_is_metadata_only() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("weights")).unwrap();
    std::fs::write(dir.path().join("weights/data.bin"), vec![7u8; 64]).unwrap();
    let m = external_model(
        &[("location", "weights/data.bin"), ("offset", "16"), ("length", "24")],
        &[("location", "weights/data.bin"), ("offset", "40")],
    );
    let imported = import_in(dir.path(), &m).unwrap();
    assert!(imported.warnings.is_empty(), "{:?}", imported.warnings);
    assert!(!imported.graph_only);
    let canonical = dir.path().join("weights/data.bin").canonicalize().unwrap();
    let Storage::External(w) = &init_tensor(&imported, "w").storage else { panic!("w must be external") };
    assert_eq!((w.location.as_str(), w.offset, w.length, w.present), ("weights/data.bin", 16, 24, true));
    assert_eq!(w.path, canonical);
    let Storage::External(b) = &init_tensor(&imported, "b").storage else { panic!("b must be external") };
    assert_eq!((b.offset, b.length), (40, 12), "absent length = numel * size");
    assert_eq!(init_tensor(&imported, "b").nbytes(), 12);
}

#[test]
fn missing_external_file_gives_a_graph_only_model_with_one_warning() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(&[("location", "gone.bin")], &[("location", "gone.bin"), ("offset", "24")]);
    let imported = import_in(dir.path(), &m).unwrap();
    assert!(imported.graph_only);
    assert_eq!(imported.warnings.len(), 1, "{:?}", imported.warnings);
    let ImportWarning::MissingExternalData { tensors, first_tensor, .. } = &imported.warnings[0] else {
        panic!("{:?}", imported.warnings)
    };
    assert_eq!((*tensors, first_tensor.as_str()), (2, "w"));
    assert!(imported.warnings[0].to_string().contains("graph-only"));
    let Storage::External(w) = &init_tensor(&imported, "w").storage else { panic!() };
    assert!(!w.present);
    assert_eq!(w.length, 24);
    assert_eq!(imported.graph.value(imported.graph.value_by_name("w").unwrap()).ty.as_ref().unwrap().to_string(), "f32[2,3]");
}

#[test]
fn short_external_file_is_an_error_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data.bin"), vec![0u8; 30]).unwrap();
    let m = external_model(&[("location", "data.bin")], &[("location", "data.bin"), ("offset", "24")]);
    let e = import_in(dir.path(), &m).unwrap_err();
    assert!(matches!(&e, ImportError::ExternalShort { tensor, actual: 30, end: 36, .. } if tensor == "b"), "{e}");
    let text = e.to_string();
    assert!(text.contains("model.onnx") && text.contains("`b`") && text.contains("30 bytes"), "{text}");
}

#[test]
fn zero_byte_external_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data.bin"), b"").unwrap();
    let m = external_model(&[("location", "data.bin")], &[("location", "data.bin"), ("offset", "24")]);
    let e = err_text(import_in(dir.path(), &m));
    assert!(e.contains("`w`") && e.contains("0 bytes"), "{e}");
}

#[test]
fn external_location_with_dotdot_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let inner = dir.path().join("model");
    std::fs::create_dir(&inner).unwrap();
    std::fs::write(dir.path().join("secret.bin"), vec![0u8; 64]).unwrap();
    let m = external_model(&[("location", "data.bin")], &[("location", "../secret.bin")]);
    let e = import_in(&inner, &m).unwrap_err();
    assert!(matches!(&e, ImportError::ExternalPath { tensor, .. } if tensor == "b"), "{e}");
    assert!(e.to_string().contains("`..`"), "{e}");
    // Even when the `..` would come back inside the folder.
    let m = external_model(&[("location", "sub/../data.bin")], &[("location", "data.bin")]);
    let e = err_text(import_in(&inner, &m));
    assert!(e.contains("`w`"), "{e}");
}

#[test]
fn absolute_external_location_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let abs = dir.path().join("data.bin");
    std::fs::write(&abs, vec![0u8; 64]).unwrap();
    let m = external_model(&[("location", abs.to_str().unwrap())], &[("location", "data.bin")]);
    let e = import_in(dir.path(), &m).unwrap_err();
    assert!(matches!(&e, ImportError::ExternalPath { tensor, .. } if tensor == "w"), "{e}");
    assert!(e.to_string().contains("absolute"), "{e}");
}

#[test]
fn external_location_escaping_through_a_symlink_is_refused() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret.bin"), vec![0u8; 64]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret.bin"), dir.path().join("data.bin")).unwrap();
    let m = external_model(&[("location", "data.bin")], &[("location", "data.bin")]);
    let e = import_in(dir.path(), &m).unwrap_err();
    assert!(matches!(&e, ImportError::ExternalPath { tensor, .. } if tensor == "w"), "{e}");
    assert!(e.to_string().contains("outside the model's folder"), "{e}");

    // A symlinked folder leading outside, even to a file that does not exist.
    let dir2 = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), dir2.path().join("weights")).unwrap();
    let m = external_model(&[("location", "weights/missing.bin")], &[("location", "weights/missing.bin")]);
    let e = err_text(import_in(dir2.path(), &m));
    assert!(e.contains("`w`") && e.contains("outside"), "{e}");
}

#[test]
fn symlink_inside_the_model_folder_is_fine() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("real.bin"), vec![0u8; 64]).unwrap();
    std::os::unix::fs::symlink(dir.path().join("real.bin"), dir.path().join("data.bin")).unwrap();
    let m = external_model(&[("location", "data.bin")], &[("location", "data.bin"), ("offset", "24")]);
    let imported = import_in(dir.path(), &m).unwrap();
    let Storage::External(w) = &init_tensor(&imported, "w").storage else { panic!() };
    assert!(w.present);
    assert_eq!(w.path, dir.path().join("real.bin").canonicalize().unwrap());
}

// ---- functions, control flow, unknown ops ------------------------------------------------

/// `custom.Scale(X) -> Y`: Y = X * alpha (Constant with a referenced FLOAT attribute) + X.
fn scale_function() -> FunctionProto {
    let mut konst = node("Constant", "k", &[], &["alpha_t"]);
    konst.attribute = vec![attr_ref("value_float", "alpha", 1)];
    let mut lrelu = node("LeakyRelu", "lr", &["Y0"], &["Y"]);
    lrelu.attribute = vec![attr_ref("alpha", "slope", 1)];
    FunctionProto {
        name: Some("Scale".into()),
        domain: Some("custom".into()),
        input: vec!["X".into()],
        output: vec!["Y".into()],
        attribute: vec!["alpha".into()],
        attribute_proto: vec![attr_float("slope", 0.125)],
        node: vec![konst, node("Mul", "mul", &["X", "alpha_t"], &["t"]), node("Add", "add", &["t", "X"], &["Y0"]), lrelu],
        opset_import: vec![OperatorSetIdProto { domain: Some("".into()), version: Some(18) }],
        ..Default::default()
    }
}

fn call(name: &str, input: &str, output: &str, alpha: f32) -> NodeProto {
    let mut n = node("Scale", name, &[input], &[output]);
    n.domain = Some("custom".into());
    n.attribute = vec![attr_float("alpha", alpha)];
    n
}

#[test]
fn model_local_functions_are_inlined_with_attributes_bound() {
    let mut g = linear_graph();
    g.node.push(call("s1", "y", "z1", 2.0));
    g.node.push(call("s2", "z1", "z2", 3.0));
    g.output = vec![value_info("z2", F32, &[])];
    let mut m = model(g);
    m.opset_import.push(OperatorSetIdProto { domain: Some("custom".into()), version: Some(1) });
    m.functions = vec![scale_function()];
    let imported = import(&m).unwrap();
    let gr = &imported.graph;
    gr.verify().unwrap();
    assert!(imported.warnings.is_empty(), "{:?}", imported.warnings);
    assert_eq!(gr.node_count(), 2 + 2 * 4);
    assert!(gr.node_ids().all(|id| gr.node(id).op.kind().is_some()), "no placeholders left");
    let by_name = |n: &str| gr.node(gr.node_ids().find(|&i| gr.node(i).name == n).unwrap_or_else(|| panic!("no node {n}")));
    assert_eq!(by_name("s1/k").attrs.get("value_float"), Some(&Attr::Float(2.0)));
    assert_eq!(by_name("s2/k").attrs.get("value_float"), Some(&Attr::Float(3.0)));
    assert_eq!(by_name("s1/lr").attrs.get("alpha"), Some(&Attr::Float(0.125)), "function default");
    // Formal parameters map to actual values; locals are renamed per call.
    let mul = by_name("s2/mul");
    assert_eq!(gr.value(mul.inputs[0].unwrap()).name, "z1");
    assert_eq!(gr.value(mul.inputs[1].unwrap()).name, "s2/alpha_t");
    let z2 = gr.value_by_name("z2").unwrap();
    assert_eq!(gr.node(gr.value(z2).producer.unwrap()).name, "s2/lr");
    assert_eq!(gr.outputs, vec![z2]);
    // Constant outputs typed from the attribute.
    let k = gr.value_by_name("s1/alpha_t").unwrap();
    assert_eq!(gr.value(k).ty.as_ref().unwrap().to_string(), "f32[]");
}

#[test]
fn nested_functions_inline_and_recursion_is_bounded() {
    let mut outer = FunctionProto {
        name: Some("Twice".into()),
        domain: Some("custom".into()),
        input: vec!["A".into()],
        output: vec!["B".into()],
        node: vec![call("first", "A", "mid", 1.0), call("second", "mid", "B", 1.0)],
        ..Default::default()
    };
    let mut g = linear_graph();
    let mut n = node("Twice", "tw", &["y"], &["z"]);
    n.domain = Some("custom".into());
    g.node.push(n);
    g.output = vec![value_info("z", F32, &[])];
    let mut m = model(g);
    m.functions = vec![outer.clone(), scale_function()];
    let imported = import(&m).unwrap();
    assert_eq!(imported.graph.node_count(), 2 + 8);
    imported.graph.verify().unwrap();
    assert!(imported.graph.value_by_name("tw/mid").is_some());

    // A function that calls itself.
    outer.node = vec![{
        let mut n = node("Twice", "again", &["A"], &["B"]);
        n.domain = Some("custom".into());
        n
    }];
    m.functions = vec![outer];
    let e = err_text(import(&m));
    assert!(e.contains("Twice") && e.contains("recursive"), "{e}");
}

#[test]
fn control_flow_is_refused_naming_the_node() {
    let mut g = linear_graph();
    let mut n = node("If", "branch", &["cond"], &["z"]);
    n.attribute = vec![AttributeProto {
        name: Some("then_branch".into()),
        r#type: Some(5),
        g: Some(GraphProto::default()),
        ..Default::default()
    }];
    g.node.push(n);
    g.input.push(value_info("cond", 9, &[]));
    let e = import_graph(g).unwrap_err();
    assert!(matches!(e, ImportError::ControlFlow { .. }));
    assert!(e.to_string().contains("Unsupported control flow: node `branch` (If)"), "{e}");

    let mut g = linear_graph();
    g.node.push(node("Loop", "loop", &["", ""], &["z"]));
    let e = err_text(import_graph(g));
    assert!(e.contains("node `loop` (Loop)"), "{e}");
}

#[test]
fn unknown_ops_become_placeholders_with_one_warning_per_op() {
    let mut g = linear_graph();
    for (i, (inp, out)) in [("y", "f1"), ("f1", "f2")].iter().enumerate() {
        let mut n = node("FusedMatMul", &format!("fused{i}"), &[inp, "w2"], &[out]);
        n.domain = Some("com.microsoft".into());
        g.node.push(n);
    }
    g.node.push(node("NotAnOnnxOp", "weird", &["f2"], &["z"]));
    g.initializer.push(f32_tensor("w2", &[3, 3], &[0.0; 9]));
    g.output = vec![value_info("z", F32, &[D::K(1)])];
    let m = import_graph(g).unwrap();
    assert_eq!(m.warnings.len(), 2, "{:?}", m.warnings);
    assert_eq!(
        m.warnings[0],
        ImportWarning::UnknownOp { domain: "com.microsoft".into(), op_type: "FusedMatMul".into(), node: "fused0".into(), count: 2 }
    );
    assert!(m.warnings[1].to_string().contains("NotAnOnnxOp"));
    let gr = &m.graph;
    let fused = gr.node(gr.value(gr.value_by_name("f1").unwrap()).producer.unwrap());
    assert_eq!(fused.op, Op::Placeholder { op_type: "FusedMatMul".into(), domain: "com.microsoft".into() });
    let z = gr.value_by_name("z").unwrap();
    assert_eq!(gr.value(z).ty.as_ref().unwrap().to_string(), "f32[1]", "declared output type kept");
}

#[test]
fn constant_nodes_keep_their_attributes() {
    let mut g = linear_graph();
    let mut c1 = node("Constant", "c_tensor", &[], &["c1"]);
    c1.attribute = vec![AttributeProto {
        name: Some("value".into()),
        r#type: Some(4),
        t: Some(TensorProto { data_type: Some(I64), dims: vec![2], int64_data: vec![4, -1], ..Default::default() }),
        ..Default::default()
    }];
    let mut c2 = node("Constant", "c_ints", &[], &["c2"]);
    c2.attribute = vec![AttributeProto { name: Some("value_ints".into()), r#type: Some(7), ints: vec![1, 2, 3], ..Default::default() }];
    g.node.push(c1);
    g.node.push(c2);
    g.node.push(node("Reshape", "r", &["y", "c1"], &["z"]));
    g.output = vec![value_info("z", F32, &[]), value_info("c2", I64, &[D::K(3)])];
    let m = import_graph(g).unwrap();
    let gr = &m.graph;
    let c1 = gr.node(gr.value(gr.value_by_name("c1").unwrap()).producer.unwrap());
    assert!(c1.op.is(OpKind::Constant));
    assert_eq!(c1.attrs.tensor("value").and_then(Tensor::to_i64_vec), Some(vec![4, -1]));
    assert_eq!(gr.value(gr.value_by_name("c1").unwrap()).ty.as_ref().unwrap().to_string(), "i64[2]");
    let c2 = gr.node(gr.value(gr.value_by_name("c2").unwrap()).producer.unwrap());
    assert_eq!(c2.attrs.ints("value_ints"), Some(&[1i64, 2, 3][..]));

    let mut g = linear_graph();
    let mut sparse = node("Constant", "c_sparse", &[], &["s"]);
    sparse.attribute = vec![AttributeProto { name: Some("sparse_value".into()), r#type: Some(11), ..Default::default() }];
    g.node.push(sparse);
    let e = err_text(import_graph(g));
    assert!(e.contains("`c_sparse`") && e.contains("sparse"), "{e}");
}

// ---- bad input ---------------------------------------------------------------------------

#[test]
fn empty_file_says_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_bytes(dir.path(), "empty.onnx", b"");
    let e = load_model(&path).unwrap_err();
    assert!(matches!(e, ImportError::Empty { .. }));
    let text = e.to_string();
    assert!(text.contains("empty file") && text.contains("empty.onnx"), "{text}");
}

#[test]
fn truncated_file_is_a_decode_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = model(linear_graph()).encode_to_vec();
    let path = write_bytes(dir.path(), "cut.onnx", &bytes[..bytes.len() / 2]);
    let e = load_model(&path).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, ImportError::Decode { .. }), "{text}");
    assert!(text.contains("cut.onnx") && text.contains("truncated"), "{text}");
}

/// A fixed pseudo-random byte stream (xorshift), so the test is reproducible.
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 24) as u8
        })
        .collect()
}

#[test]
fn random_bytes_are_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    for seed in 1..=20u64 {
        let path = write_bytes(dir.path(), "noise.onnx", &noise(4096, seed));
        let e = load_model(&path).unwrap_err();
        assert!(e.to_string().contains("noise.onnx"), "{e}");
    }
}

#[test]
fn missing_graph_is_an_error() {
    let mut m = model(linear_graph());
    m.graph = None;
    let e = err_text(import(&m));
    assert!(e.contains("no graph"), "{e}");
}

#[test]
fn dangling_input_names_node_and_input() {
    let mut g = linear_graph();
    g.node[1].input[1] = "bias_typo".into();
    let e = import_graph(g).unwrap_err();
    assert!(matches!(&e, ImportError::DanglingInput { node, input, .. } if node == "add" && input == "bias_typo"), "{e}");
    let mut g = linear_graph();
    g.output[0].name = Some("nowhere".into());
    let e = err_text(import_graph(g));
    assert!(e.contains("`nowhere`"), "{e}");
}

#[test]
fn duplicate_outputs_and_cycles_are_errors() {
    let mut g = linear_graph();
    g.node.push(node("Relu", "again", &["x"], &["xw"]));
    let e = err_text(import_graph(g));
    assert!(e.contains("`xw`") && e.contains("`mm`") && e.contains("`again`"), "{e}");
    let mut g = linear_graph();
    g.node.push(node("Relu", "shadow", &["x"], &["w"]));
    let e = err_text(import_graph(g));
    assert!(e.contains("`w`") && e.contains("initializer"), "{e}");

    let mut g = linear_graph();
    g.node = vec![node("Add", "a", &["x", "q"], &["p"]), node("Relu", "b", &["p"], &["q"]), node("Relu", "c", &["p"], &["y"])];
    let e = import_graph(g).unwrap_err();
    assert!(matches!(&e, ImportError::Cycle { node, .. } if node == "a" || node == "b"), "{e}");
}

#[test]
fn ir_version_too_new_is_refused() {
    let mut m = model(linear_graph());
    m.ir_version = Some(15);
    let e = err_text(import(&m));
    assert!(e.contains("IR version 15") && e.contains("14"), "{e}");
    m.ir_version = Some(14);
    import(&m).unwrap();
}

#[test]
fn missing_file_is_an_io_error_naming_it() {
    let e = load_model(Path::new("/nonexistent/dir/model.onnx")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/dir/model.onnx"), "{e}");
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]
        /// Corrupting or cutting a valid model never panics.
        #[test]
        fn corrupted_models_never_panic(cut in 0usize..400, flips in proptest::collection::vec((0usize..400, any::<u8>()), 0..6)) {
            let mut bytes = model(linear_graph()).encode_to_vec();
            for (at, v) in flips {
                let i = at % bytes.len();
                bytes[i] = v;
            }
            bytes.truncate(cut.min(bytes.len()));
            let _ = decode_model_bytes(&bytes, Path::new("fuzz.onnx"));
        }
    }
}

// ---- TensorProto files -------------------------------------------------------------------

#[test]
fn load_tensor_pb_reads_serialized_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let t = TensorProto { name: Some("input".into()), data_type: Some(F32), dims: vec![2], float_data: vec![1.0, 2.0], ..Default::default() };
    let path = write_bytes(dir.path(), "input_0.pb", &t.encode_to_vec());
    let tensor = load_tensor_pb(&path).unwrap();
    assert_eq!((tensor.dtype, tensor.dims.clone()), (DType::F32, vec![2]));
    assert_eq!(tensor.to_f64_vec(), Some(vec![1.0, 2.0]));
    let empty = write_bytes(dir.path(), "empty.pb", b"");
    assert!(load_tensor_pb(&empty).unwrap_err().to_string().contains("empty file"));
}

// ---- the onnx wheel's light_* models, against the onnx package ---------------------------

fn venv_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv")
}

fn onnx_data_dir() -> PathBuf {
    match std::env::var_os("SMP_ONNX_DATA") {
        Some(d) => PathBuf::from(d),
        None => venv_dir().join("lib/python3.11/site-packages/onnx/backend/test/data"),
    }
}

#[test]
fn light_models_import_and_match_the_onnx_package() {
    let light = onnx_data_dir().join("light");
    let mut models: Vec<PathBuf> = std::fs::read_dir(&light)
        .unwrap_or_else(|e| panic!("{}: {e}; run `make venv` (or set SMP_ONNX_DATA to onnx/backend/test/data)", light.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("light_") && name.ends_with(".onnx")
        })
        .collect();
    models.sort();
    assert!(models.len() >= 9, "expected the onnx wheel's light_* models in {}", light.display());

    let python = std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| venv_dir().join("bin/python"));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/onnx_model_stats.py");
    let out = std::process::Command::new(&python)
        .arg(&script)
        .args(&models)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}; run `make venv`", python.display()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let oracle: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    for path in &models {
        let name = path.file_name().unwrap().to_str().unwrap();
        let m = load_model(path).unwrap_or_else(|e| panic!("{e}"));
        let g = &m.graph;
        g.verify().unwrap_or_else(|e| panic!("{name}: {e}"));
        let float_elems: u64 = g
            .initializers()
            .filter_map(|v| g.value(v).data.as_ref())
            .filter(|t| t.dtype.is_float())
            .map(Tensor::numel)
            .sum();
        let want = &oracle[name];
        assert_eq!(float_elems, want["float_initializer_elems"].as_u64().unwrap(), "{name}: float initializer elements");
        assert_eq!(g.initializers().count() as u64, want["initializers"].as_u64().unwrap(), "{name}: initializers");
        // a Softmax before opset 13 over a middle (or unknown) axis is canonicalised into four nodes
        let canonical_nodes = 3 * m.canonicalised.softmax_rewrites as u64;
        assert_eq!(g.node_count() as u64, want["nodes"].as_u64().unwrap() + canonical_nodes, "{name}: nodes");
        assert_eq!(g.inputs.len() as u64, want["inputs"].as_u64().unwrap(), "{name}: inputs");
        assert_eq!(g.outputs.len() as u64, want["outputs"].as_u64().unwrap(), "{name}: outputs");
        assert!(m.warnings.is_empty(), "{name}: {:?}", m.warnings);
    }
}

#[test]
fn tensor_files_written_by_the_onnx_package_match_numpy() {
    // The onnx package writes TensorProtos in its typed fields (make_tensor) and as raw_data
    // (numpy_helper.from_array); each must decode to what numpy holds.
    let dir = tempfile::tempdir().unwrap();
    let python = std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| venv_dir().join("bin/python"));
    let code = r#"
import sys, os, json, numpy as np, onnx
from onnx import helper, numpy_helper, TensorProto as T
d = sys.argv[1]
vals = [0.5, -2.0, 3.25, 1e-3, 65504.0, -0.0]
cases = {
  'f32_typed': helper.make_tensor('a', T.FLOAT, [2, 3], vals),
  'f16_typed': helper.make_tensor('b', T.FLOAT16, [6], np.array(vals, np.float16)),
  'bf16_typed': helper.make_tensor('c', T.BFLOAT16, [3, 2], vals),
  'f64_typed': helper.make_tensor('d', T.DOUBLE, [6], vals),
  'i8_typed': helper.make_tensor('e', T.INT8, [4], [-128, -1, 0, 127]),
  'u16_typed': helper.make_tensor('f', T.UINT16, [2], [65535, 7]),
  'bool_typed': helper.make_tensor('g', T.BOOL, [3], [True, False, True]),
  'i64_typed': helper.make_tensor('h', T.INT64, [2], [-(2**40), 5]),
  'u32_typed': helper.make_tensor('i', T.UINT32, [2], [4000000000, 1]),
  'f32_raw': numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 8, 'j'),
  'f16_raw': numpy_helper.from_array(np.array(vals, np.float16), 'k'),
  'i32_raw': numpy_helper.from_array(np.array([-5, 6, 2**31 - 1], np.int32), 'l'),
  'scalar_raw': numpy_helper.from_array(np.array(2.5, np.float64), 'm'),
}
out = {}
for name, t in cases.items():
    open(os.path.join(d, name + '.pb'), 'wb').write(t.SerializeToString())
    a = numpy_helper.to_array(t)
    out[name] = {'dims': list(a.shape), 'type': t.data_type, 'values': [float(v) for v in a.astype(np.float64).ravel()]}
print(json.dumps(out))
"#;
    let out = std::process::Command::new(&python)
        .arg("-c")
        .arg(code)
        .arg(dir.path())
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}; run `make venv`", python.display()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let oracle: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cases = oracle.as_object().unwrap();
    assert_eq!(cases.len(), 13);
    for (name, want) in cases {
        let file = dir.path().join(format!("{name}.pb"));
        let t = load_tensor_pb(&file).unwrap_or_else(|e| panic!("{e}"));
        let dims: Vec<i64> = want["dims"].as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect();
        assert_eq!(t.dims, dims, "{name}");
        assert_eq!(t.dtype.to_onnx() as i64, want["type"].as_i64().unwrap(), "{name}");
        let values: Vec<f64> = want["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
        assert_eq!(t.to_f64_vec().unwrap(), values, "{name}");
    }
}

#[test]
fn function_inlining_agrees_with_onnx_inliner_and_onnxruntime() {
    // The onnx package parses a model with nested local functions, attribute references and
    // a default; its inliner gives the op multiset; onnxruntime evaluates the model at X = 1,
    // and since every op on the path is a scaling (LeakyRelu is identity on positives) the
    // output equals the product of the inlined Constant values.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("functions.onnx");
    let python = std::env::var_os("SMP_PYTHON").map(PathBuf::from).unwrap_or_else(|| venv_dir().join("bin/python"));
    let code = r#"
import sys, json, collections, numpy as np, onnx, onnx.parser, onnx.inliner, onnxruntime as ort
text = '''
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[N, 4] X) => (float[N, 4] Y) {
    T = local.Scale <alpha = 2.0> (X)
    U = local.Scale (T)
    Y = local.Twice (U)
}
<domain: "local", opset_import: ["" : 18]>
Scale <alpha: float = 0.5> (A) => (B) {
    C = Constant <value_float: float = @alpha> ()
    B = Mul (A, C)
}
<domain: "local", opset_import: ["" : 18, "local": 1]>
Twice (A) => (B) {
    M = local.Scale <alpha = 3.0>(A)
    L = LeakyRelu <alpha = 0.25> (M)
    B = local.Scale (L)
}
'''
m = onnx.parser.parse_model(text)
onnx.checker.check_model(m)
onnx.save(m, sys.argv[1])
ops = collections.Counter(n.op_type for n in onnx.inliner.inline_local_functions(m).graph.node)
y = ort.InferenceSession(sys.argv[1]).run(None, {"X": np.ones((2, 4), np.float32)})[0]
print(json.dumps({"ops": ops, "y": float(y[0, 0])}))
"#;
    let out = std::process::Command::new(&python)
        .arg("-c")
        .arg(code)
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}; run `make venv`", python.display()));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let oracle: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    let m = load_model(&path).unwrap();
    let g = &m.graph;
    g.verify().unwrap();
    assert!(m.warnings.is_empty(), "{:?}", m.warnings);
    let mut ops = std::collections::BTreeMap::<String, u64>::new();
    for id in g.node_ids() {
        *ops.entry(g.node(id).op.name().to_string()).or_default() += 1;
    }
    let want: std::collections::BTreeMap<String, u64> = oracle["ops"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
        .collect();
    assert_eq!(ops, want);
    let product: f64 = g
        .node_ids()
        .map(|id| g.node(id))
        .filter(|n| n.op.is(OpKind::Constant))
        .map(|n| match n.attrs.get("value_float") {
            Some(Attr::Float(v)) => *v as f64,
            other => panic!("constant `{}` has {other:?}", n.name),
        })
        .product();
    assert_eq!(product, oracle["y"].as_f64().unwrap());
    let y = g.value_by_name("Y").unwrap();
    assert_eq!(g.outputs, vec![y]);
    assert_eq!(g.node(g.value(y).producer.unwrap()).op, Op::Known(OpKind::Mul));
}

#[test]
fn every_models_file_imports_with_the_recorded_float_initializer_count() {
    // models/manifest.json is written by the export script from python's onnx.
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let manifest_path = repo.join("models/manifest.json");
    let text = std::fs::read_to_string(&manifest_path).unwrap_or_else(|e| panic!("{}: {e}", manifest_path.display()));
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let entries = manifest.as_object().unwrap();
    assert!(!entries.is_empty());
    for (name, entry) in entries {
        let file = repo.join(entry["file"].as_str().unwrap());
        let m = load_model(&file).unwrap_or_else(|e| panic!("{name}: {e}"));
        let g = &m.graph;
        g.verify().unwrap_or_else(|e| panic!("{name}: {e}"));
        let floats: u64 = g
            .initializers()
            .filter_map(|v| g.value(v).data.as_ref())
            .filter(|t| t.dtype.is_float())
            .map(Tensor::numel)
            .sum();
        assert_eq!(floats, entry["float_initializer_elements"].as_u64().unwrap(), "{name}");
        let graph_only = entry["graph_only"].as_bool().unwrap();
        assert_eq!(m.graph_only, graph_only, "{name}");
        let missing = m.warnings.iter().filter(|w| matches!(w, ImportWarning::MissingExternalData { .. })).count();
        assert_eq!(missing, usize::from(graph_only), "{name}: {:?}", m.warnings);
        assert!(
            !m.warnings.iter().any(|w| matches!(w, ImportWarning::UnknownOp { .. })),
            "{name}: {:?}",
            m.warnings
        );
    }
}

#[test]
fn exponential_function_nesting_is_refused_not_exhausting_memory() {
    // F0 calls F1 twice, F1 calls F2 twice, ... 30 levels: 2^30 leaves if inlined.
    let levels = 30;
    let functions: Vec<FunctionProto> = (0..levels)
        .map(|i| {
            let body = if i + 1 == levels {
                vec![node("Relu", "r", &["A"], &["B"])]
            } else {
                let mut a = node(&format!("F{}", i + 1), "a", &["A"], &["M"]);
                a.domain = Some("custom".into());
                let mut b = node(&format!("F{}", i + 1), "b", &["M"], &["B"]);
                b.domain = Some("custom".into());
                vec![a, b]
            };
            FunctionProto {
                name: Some(format!("F{i}")),
                domain: Some("custom".into()),
                input: vec!["A".into()],
                output: vec!["B".into()],
                node: body,
                ..Default::default()
            }
        })
        .collect();
    let mut g = linear_graph();
    let mut n = node("F0", "bomb", &["y"], &["z"]);
    n.domain = Some("custom".into());
    g.node.push(n);
    let mut m = model(g);
    m.functions = functions;
    let e = err_text(import(&m));
    assert!(e.contains("node `bomb`") && e.contains("would make 536870914 nodes"), "{e}");
}

#[test]
fn decoding_bytes_for_a_path_in_a_missing_folder_treats_external_data_as_missing() {
    let mut g = linear_graph();
    g.initializer[0] = external_tensor("w", &[2, 3], &[("location", "w.bin")]);
    let bytes = model(g).encode_to_vec();
    let m = decode_model_bytes(&bytes, Path::new("/nonexistent/folder/model.onnx")).unwrap();
    assert!(m.graph_only);
    assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
}
