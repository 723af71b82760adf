//! Bad model files through the CLI: a clear error naming the cause, exit status 1, no panic.

use std::path::{Path, PathBuf};
use std::process::Command;

use prost::Message;
use smp_partition::frontend::onnx::proto::{
    GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto, TensorProto, TensorShapeProto,
    TypeProto, ValueInfoProto, tensor_shape_proto, type_proto,
};

fn value_info(name: &str, dims: &[i64]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|&d| tensor_shape_proto::Dimension {
            value: Some(tensor_shape_proto::dimension::Value::DimValue(d)),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(1),
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

/// y = x @ w with `w` (4×4 f32) stored as the caller says.
fn model(w: TensorProto) -> ModelProto {
    ModelProto {
        ir_version: Some(10),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(18) }],
        graph: Some(GraphProto {
            name: Some("bad".into()),
            node: vec![node("MatMul", "mm", &["x", "w"], &["y"])],
            initializer: vec![w],
            input: vec![value_info("x", &[2, 4])],
            output: vec![value_info("y", &[2, 4])],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn raw_w() -> TensorProto {
    TensorProto {
        name: Some("w".into()),
        data_type: Some(1),
        dims: vec![4, 4],
        raw_data: Some(vec![0; 64].into()),
        ..Default::default()
    }
}

fn external_w(location: &str) -> TensorProto {
    TensorProto {
        name: Some("w".into()),
        data_type: Some(1),
        dims: vec![4, 4],
        data_location: Some(1),
        external_data: vec![StringStringEntryProto { key: Some("location".into()), value: Some(location.into()) }],
        ..Default::default()
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Runs `smp-partition graph FILE` (text and `--json`); both must exit 1 with every
/// `expect`ed phrase on stderr and no panic.
fn assert_refused(path: &Path, expect: &[&str]) {
    assert_refused_with(path, &[], expect);
}

/// [`assert_refused`] with further options of `graph`.
fn assert_refused_with(path: &Path, options: &[&str], expect: &[&str]) {
    let mut args = vec!["graph".to_string(), path.display().to_string()];
    args.extend(options.iter().map(|o| o.to_string()));
    let json = args.iter().cloned().chain(["--json".to_string()]).collect();
    for args in [args, json] {
        let out = Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: stderr: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        for phrase in expect {
            assert!(stderr.contains(phrase), "{args:?}: `{phrase}` not in: {stderr}");
        }
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout: {}", String::from_utf8_lossy(&out.stdout));
    }
}

#[test]
fn empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "empty.onnx", b"");
    assert_refused(&path, &["empty.onnx", "empty file"]);
}

#[test]
fn truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = model(raw_w()).encode_to_vec();
    let path = write(dir.path(), "cut.onnx", &bytes[..bytes.len() * 2 / 3]);
    assert_refused(&path, &["cut.onnx", "truncated or corrupt"]);
}

#[test]
fn random_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let bytes: Vec<u8> = (0..2048)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 32) as u8
        })
        .collect();
    let path = write(dir.path(), "noise.onnx", &bytes);
    assert_refused(&path, &["noise.onnx"]);
}

#[test]
fn missing_graph() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = model(raw_w());
    m.graph = None;
    let path = write(dir.path(), "nograph.onnx", &m.encode_to_vec());
    assert_refused(&path, &["nograph.onnx", "no graph"]);
}

#[test]
fn dangling_node_input() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = model(raw_w());
    if let Some(g) = m.graph.as_mut() {
        g.node[0].input[1] = "w_typo".into();
    }
    let path = write(dir.path(), "dangling.onnx", &m.encode_to_vec());
    assert_refused(&path, &["node `mm`", "`w_typo`"]);
}

#[test]
fn external_data_with_dotdot() {
    let dir = tempfile::tempdir().unwrap();
    let inner = dir.path().join("m");
    std::fs::create_dir(&inner).unwrap();
    std::fs::write(dir.path().join("w.bin"), vec![0u8; 64]).unwrap();
    let path = write(&inner, "dotdot.onnx", &model(external_w("../w.bin")).encode_to_vec());
    assert_refused(&path, &["tensor `w`", "`..`"]);
}

#[test]
fn external_data_absolute() {
    let dir = tempfile::tempdir().unwrap();
    let abs = write(dir.path(), "w.bin", &[0u8; 64]);
    let path = write(dir.path(), "abs.onnx", &model(external_w(abs.to_str().unwrap())).encode_to_vec());
    assert_refused(&path, &["tensor `w`", "absolute"]);
}

#[test]
fn external_data_through_symlink() {
    let outside = tempfile::tempdir().unwrap();
    let target = write(outside.path(), "w.bin", &[0u8; 64]);
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&target, dir.path().join("w.bin")).unwrap();
    let path = write(dir.path(), "link.onnx", &model(external_w("w.bin")).encode_to_vec());
    assert_refused(&path, &["tensor `w`", "outside the model's folder"]);
}

#[test]
fn external_file_shorter_than_declared() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "w.bin", &[0u8; 10]);
    let path = write(dir.path(), "short.onnx", &model(external_w("w.bin")).encode_to_vec());
    assert_refused(&path, &["tensor `w`", "10 bytes", "length 64"]);
    write(dir.path(), "w.bin", b"");
    assert_refused(&path, &["tensor `w`", "0 bytes"]);
}

#[test]
fn control_flow() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = model(raw_w());
    if let Some(g) = m.graph.as_mut() {
        g.node.push(node("Loop", "the_loop", &["", ""], &["z"]));
    }
    let path = write(dir.path(), "loop.onnx", &m.encode_to_vec());
    assert_refused(&path, &["Unsupported control flow: node `the_loop` (Loop)"]);
}

/// Issue 31: tf2onnx's Keras transformer with one `ReduceProd`'s `keepdims` flipped to 0 hands
/// its `Concat` a scalar first input; shape inference panicked (`out[ax] = 0` on rank 0).
#[test]
fn scalar_reaching_concat_in_a_mutated_keras_transformer() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(repo.join("models/keras/keras_lm.onnx")).unwrap();
    let mut m = ModelProto::decode(bytes.as_slice()).unwrap();
    let g = m.graph.as_mut().unwrap();
    let prod = g.node.iter_mut().find(|n| n.name.as_deref() == Some("ReduceProd__877")).unwrap();
    let keepdims = prod.attribute.iter_mut().find(|a| a.name.as_deref() == Some("keepdims")).unwrap();
    keepdims.i = Some(0);
    let path = write(dir.path(), "keras_lm_mutated.onnx", &m.encode_to_vec());
    assert_refused_with(&path, &["--seq-len", "16"], &["node `Concat__881` (Concat)", "`ReduceProd__877:0`", "scalar (rank 0)"]);
}
