//! The trained model out of a checkpoint (docs/checkpoints.md): the original ONNX file with
//! its initializers replaced by the trained values (the runner's untied copies added as
//! initializers of their own and read by the nodes that read them), or the trained weights
//! alone as safetensors under module parameter names, in the module's layout.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use prost::Message;
use tch::Tensor;

use super::checkpoint::{self, Loaded};
use super::slice;
use crate::runtime::kernels::tensor::to_bytes;
use crate::runtime::{ExecOptions, Executor, InitMode, RuntimeError, Weights};
use crate::frontend::onnx::proto::{ModelProto, StringStringEntryProto, TensorProto};
use crate::ir::{FrozenReason, Graph, ParamRecord, ParamTransform, RecordKind, Storage, Training, ValueKind};

/// Initializers of at least this many bytes go to the external data file.
const EXTERNAL_MIN_BYTES: usize = 1024;

/// Above this many bytes of initializer data, an ONNX export keeps them beside the file (one
/// protobuf message may not exceed 2 GiB).
pub const EXTERNAL_DATA_ABOVE: u64 = 1 << 30;

/// Whether an ONNX export of `graph` writes its initializers as external data: when asked,
/// when the model kept them outside, or when they exceed [`EXTERNAL_DATA_ABOVE`] bytes.
pub fn needs_external_data(graph: &Graph, asked: bool) -> bool {
    let data = || graph.initializers().filter_map(|v| graph.value(v).data.as_ref());
    asked || data().any(|d| matches!(d.storage, Storage::External(_))) || data().map(|d| d.nbytes()).sum::<u64>() > EXTERNAL_DATA_ABOVE
}

fn ferr(path: &Path, m: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::File { path: path.display().to_string(), message: m.to_string() }
}

/// The model's initializers with the checkpoint's trained values put in (in the model's own
/// element types), as an executor for evaluating the runner's tie nodes.
pub fn trained_executor<'g>(ckpt: &Loaded, graph: &'g Graph) -> Result<Executor<'g>, RuntimeError> {
    trained_executor_in(ckpt, graph, None)
}

/// [`trained_executor`] with the floating-point weights in `float_kind` (a run's precision,
/// so that an f64 run's weights come out as it trained them); `None`: the model's own types.
pub fn trained_executor_in<'g>(ckpt: &Loaded, graph: &'g Graph, float_kind: Option<tch::Kind>) -> Result<Executor<'g>, RuntimeError> {
    let mut weights = Weights::load(graph, InitMode::Load, float_kind)?;
    checkpoint::restore_params(ckpt, graph, &mut weights.tensors)?;
    Executor::new(graph, weights, ExecOptions { float_kind, training: false, autocast: None })
}

/// The trained weights under module parameter names in the module's layout (every alias of a
/// tied tensor; buffers the export's record names and parameters a `--frozen` pattern held, as
/// the model holds them). A tensor whose rows were gathered at export time is written as those
/// rows, with their indices under `NAME#rows`.
pub fn module_tensors(exec: &Executor<'_>) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    let graph = exec.graph();
    let mut out = BTreeMap::new();
    for v in graph.initializers() {
        let Some(w) = exec.weights.get(&v) else { continue };
        let val = graph.value(v);
        // (the names it is written under, how the module's tensor was transformed into it)
        let module: Option<(Vec<String>, &ParamTransform)> = match &val.training {
            Some(Training::Trained { names, transform, untied_from, .. }) => {
                let own = slice::param_name(graph, v);
                let names = if untied_from.is_some() && own != names[0] { vec![own] } else { names.clone() };
                Some((names, transform))
            }
            // a module parameter held frozen (`--frozen`, or frozen in the module): its value as loaded
            Some(Training::Frozen { reason: FrozenReason::Pattern | FrozenReason::Module }) => match val.record.as_ref().filter(|r| r.kind == RecordKind::Parameter) {
                Some(rec) => Some((rec.params.iter().flatten().cloned().collect(), &rec.transform)),
                None => Some((vec![val.name.clone()], &ParamTransform::Identity)),
            },
            _ => None,
        };
        match module {
            Some((names, transform)) => {
                let w = w.f_detach()?;
                let w = if *transform == ParamTransform::Transpose { w.f_tr()?.f_contiguous()? } else { w };
                if let (ParamTransform::Gather { rows, dims }, Some(first)) = (transform, names.first()) {
                    out.insert(format!("{first}#rows"), Tensor::from_slice(rows).f_reshape(dims.as_slice())?);
                }
                for n in names {
                    out.insert(n, w.shallow_clone());
                }
            }
            None => {
                // a non-persistent buffer is no part of the module's state (`load_state_dict`)
                if let Some(rec) = val.record.as_ref().filter(|r| r.kind == RecordKind::Buffer && r.persistent) {
                    for n in rec.params.iter().flatten() {
                        out.insert(n.clone(), w.f_detach()?);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Writes the trained weights of `exec` ([`module_tensors`]) as safetensors; returns the keys.
pub fn write_safetensors(exec: &Executor<'_>, out: &Path) -> Result<Vec<String>, RuntimeError> {
    let tensors: Vec<(String, Tensor)> = module_tensors(exec)?.into_iter().collect();
    checkpoint::write_atomic(out, &checkpoint::safetensors_bytes(&tensors)?)?;
    Ok(tensors.into_iter().map(|(k, _)| k).collect())
}

/// Writes the trained weights of `exec` ([`module_tensors`]) to `out`, as safetensors or npz by
/// its extension; returns the path.
pub fn write_module_tensors(exec: &Executor<'_>, out: &Path) -> Result<PathBuf, RuntimeError> {
    match out.extension().and_then(|e| e.to_str()) {
        Some("safetensors") => {
            write_safetensors(exec, out)?;
        }
        Some("npz") => {
            let arrays: Vec<(String, Tensor, Option<crate::ir::DType>)> = module_tensors(exec)?.into_iter().map(|(k, t)| (k, t, None)).collect();
            crate::runtime::formats::npz::write_npz(out, &arrays)?;
        }
        _ => return Err(ferr(out, "the trained weights are written as `.safetensors` or `.npz`")),
    }
    Ok(out.to_path_buf())
}

/// Writes the ONNX model at `model` with the trained values of `exec` to `out`: every
/// initializer the graph still holds takes its trained value, one the runner replaced by a tie
/// node (a transposed or gathered view) the node's value, and each untied copy becomes an
/// initializer read by its nodes. With `external`, all initializer data goes to `OUT.data`
/// beside it (needed past protobuf's 2 GB); otherwise it is stored inline.
pub fn write_onnx(exec: &Executor<'_>, model: &Path, out: &Path, external: bool) -> Result<Option<PathBuf>, RuntimeError> {
    let graph = exec.graph();
    let bytes = std::fs::read(model).map_err(|e| ferr(model, format!("cannot read the model: {e}")))?;
    let mut proto = ModelProto::decode(bytes.as_slice()).map_err(|e| ferr(model, format!("not an ONNX model: {e}")))?;
    let g = proto.graph.as_mut().ok_or_else(|| ferr(model, "the model has no graph"))?;
    let mut values: Vec<(usize, Tensor)> = Vec::new();
    for (k, init) in g.initializer.iter().enumerate() {
        let Some(name) = init.name.as_deref() else { continue };
        let Some(v) = graph.value_by_name(name) else { continue };
        let t = if let Some(w) = exec.weights.get(&v) {
            if !matches!(graph.value(v).kind, ValueKind::Initializer | ValueKind::Constant) {
                continue;
            }
            w.f_detach()?
        } else if let Some(n) = graph.node_ids().find(|&n| graph.node(n).outputs.contains(&v)) {
            // a view the runner tied to another initializer (`smp_tie/…`)
            let outs = tch::no_grad(|| exec.run_nodes(&[n], &HashMap::new(), &[v]))?;
            outs.get(&v).map(Tensor::shallow_clone).ok_or_else(|| ferr(model, format!("tie node of `{name}` gave no value")))?
        } else {
            continue;
        };
        values.push((k, t));
    }
    // the runner's rewiring: untied copies become initializers of their own, and nodes read
    // the initializer the runner gave them (a redundant copy of a tensor: its canonical one)
    let node_at: HashMap<String, usize> = g.node.iter().enumerate().filter_map(|(i, n)| n.name.clone().map(|s| (s, i))).collect();
    let mut have: HashMap<String, usize> = g.initializer.iter().enumerate().filter_map(|(k, t)| t.name.clone().map(|n| (n, k))).collect();
    let read_before = readers(g);
    for n in graph.node_ids() {
        let node = graph.node(n);
        let Some(&pi) = node_at.get(&node.name) else { continue };
        for (slot, inp) in node.inputs.iter().enumerate() {
            let Some(v) = *inp else { continue };
            let val = graph.value(v);
            if val.kind != ValueKind::Initializer || !exec.weights.contains_key(&v) {
                continue;
            }
            let Some(cur) = g.node[pi].input.get(slot).cloned() else { continue };
            if cur == val.name || !have.contains_key(&cur) {
                continue;
            }
            if !have.contains_key(&val.name) {
                let w = exec.weights[&v].f_detach()?;
                let dt = val.data.as_ref().map(|d| d.dtype.to_onnx()).unwrap_or(1);
                g.initializer.push(TensorProto { name: Some(val.name.clone()), data_type: Some(dt), dims: w.size(), ..Default::default() });
                have.insert(val.name.clone(), g.initializer.len() - 1);
                values.push((g.initializer.len() - 1, w));
            }
            g.node[pi].input[slot] = val.name.clone();
        }
    }
    // records as the runner decided them (one module tensor per initializer)
    for (name, &k) in &have {
        if let Some(rec) = graph.value_by_name(name).and_then(|v| graph.value(v).record.as_ref()) {
            let t = &mut g.initializer[k];
            t.metadata_props.retain(|e| !e.key.as_deref().is_some_and(|k| k.starts_with("smp.")));
            t.metadata_props.extend(record_props(rec));
        }
    }
    // initializers no node reads any more
    let read_after = readers(g);
    let dropped: std::collections::HashSet<usize> =
        (0..g.initializer.len()).filter(|k| read_before.contains(k) && !read_after.contains(k)).collect();
    // initializers left as they are but stored beside the original model
    let model_dir = model.parent().unwrap_or(Path::new("."));
    let rewritten: std::collections::HashSet<usize> = values.iter().map(|(k, _)| *k).collect();
    let mut raw: Vec<(usize, Vec<u8>)> = Vec::new();
    for (k, init) in g.initializer.iter().enumerate() {
        if rewritten.contains(&k) || init.data_location != Some(1) {
            continue;
        }
        let name = init.name.clone().unwrap_or_default();
        let v = graph.value_by_name(&name).and_then(|v| graph.value(v).data.as_ref());
        let bytes = match v.map(|d| &d.storage) {
            Some(Storage::External(ext)) => read_range(&ext.path, ext.offset, if ext.length > 0 { ext.length } else { v.map_or(0, |d| d.nbytes()) })?,
            _ => {
                let loc = init.external_data.iter().find(|e| e.key.as_deref() == Some("location")).and_then(|e| e.value.clone()).unwrap_or_default();
                return Err(ferr(model, format!("initializer `{name}` stored in `{}` cannot be copied", model_dir.join(loc).display())));
            }
        };
        raw.push((k, bytes));
    }
    for (k, t) in values {
        let (_, _, bytes) = to_bytes(&t).map_err(|m| ferr(model, m))?;
        raw.push((k, bytes));
    }
    raw.retain(|(k, _)| !dropped.contains(k));
    raw.sort_by_key(|(k, _)| *k);
    let data_path = external.then(|| out.with_extension("onnx.data"));
    let mut blob: Vec<u8> = Vec::new();
    for (k, bytes) in raw {
        let t = &mut g.initializer[k];
        t.float_data.clear();
        t.double_data.clear();
        t.int32_data.clear();
        t.int64_data.clear();
        t.uint64_data.clear();
        t.external_data.clear();
        // small tensors (shape operands, which runtimes read while loading) stay inline, as
        // onnx.save's size threshold keeps them
        match data_path.as_ref().filter(|_| bytes.len() >= EXTERNAL_MIN_BYTES) {
            Some(p) => {
                while blob.len() % 64 != 0 {
                    blob.push(0);
                }
                let entry = |k: &str, v: String| StringStringEntryProto { key: Some(k.into()), value: Some(v) };
                let loc = p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
                t.external_data = vec![entry("location", loc), entry("offset", blob.len().to_string()), entry("length", bytes.len().to_string())];
                t.data_location = Some(1);
                t.raw_data = None;
                blob.extend_from_slice(&bytes);
            }
            None => {
                t.data_location = None;
                t.raw_data = Some(bytes.into());
            }
        }
    }
    let mut k = 0;
    g.initializer.retain(|_| {
        k += 1;
        !dropped.contains(&(k - 1))
    });
    if let Some(p) = &data_path {
        checkpoint::write_atomic(p, &blob)?;
    }
    checkpoint::write_atomic(out, &proto.encode_to_vec())?;
    Ok(data_path)
}

fn read_range(path: &Path, offset: u64, len: u64) -> Result<Vec<u8>, RuntimeError> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).map_err(|e| ferr(path, format!("cannot open external data: {e}")))?;
    f.seek(SeekFrom::Start(offset)).map_err(|e| ferr(path, e))?;
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf).map_err(|e| ferr(path, format!("external data truncated: {e}")))?;
    Ok(buf)
}

/// Positions of the initializers some node of `g` reads (or the graph outputs).
fn readers(g: &crate::frontend::onnx::proto::GraphProto) -> std::collections::HashSet<usize> {
    let read: std::collections::HashSet<&str> =
        g.node.iter().flat_map(|n| n.input.iter().map(String::as_str)).chain(g.output.iter().filter_map(|o| o.name.as_deref())).collect();
    g.initializer.iter().enumerate().filter(|(_, t)| t.name.as_deref().is_some_and(|n| read.contains(n))).map(|(k, _)| k).collect()
}

/// A parameter record as `smp.*` metadata (docs/parameter-record.md).
fn record_props(rec: &ParamRecord) -> Vec<StringStringEntryProto> {
    let e = |k: &str, v: String| StringStringEntryProto { key: Some(k.into()), value: Some(v) };
    let kind = match rec.kind {
        RecordKind::Parameter => "parameter",
        RecordKind::Buffer => "buffer",
        RecordKind::Constant => "constant",
    };
    let mut out = vec![e("smp.kind", kind.into())];
    if !rec.params.is_empty() {
        out.push(e("smp.params", serde_json::to_string(&rec.params).unwrap_or_default()));
    }
    match &rec.transform {
        ParamTransform::Identity => out.push(e("smp.transform", "identity".into())),
        ParamTransform::Transpose => out.push(e("smp.transform", "transpose".into())),
        ParamTransform::Gather { dims, rows } => {
            out.push(e("smp.transform", "gather".into()));
            out.push(e("smp.gather", serde_json::json!({"dims": dims, "rows": rows}).to_string()));
        }
    }
    if rec.params.len() > 1 && rec.sites.len() == rec.params.len() {
        out.push(e("smp.sites", serde_json::to_string(&rec.sites).unwrap_or_default()));
    }
    if !rec.persistent {
        out.push(e("smp.persistent", "false".into()));
    }
    if !rec.trainable {
        out.push(e("smp.trainable", "false".into()));
    }
    if !rec.padding_rows.is_empty() {
        out.push(e("smp.padding_rows", serde_json::to_string(&rec.padding_rows).unwrap_or_default()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, ExternalData, Tensor as Data};

    fn graph_with(tensors: Vec<Data>) -> Graph {
        let mut g = Graph::new("g");
        for (i, t) in tensors.into_iter().enumerate() {
            g.add_value(format!("w{i}"), ValueKind::Initializer, None, Some(t)).unwrap();
        }
        g
    }

    fn raw_f32(elems: usize) -> Data {
        // zeroed pages are not touched, so a 1 GiB tensor costs no memory here
        Data { dtype: DType::F32, dims: vec![elems as i64], storage: Storage::Raw(vec![0u8; elems * 4].into()) }
    }

    #[test]
    fn initializers_go_outside_above_one_gib_when_asked_or_when_the_model_kept_them_outside() {
        let quarter = (EXTERNAL_DATA_ABOVE / 16) as usize; // elements of a quarter GiB of f32
        assert!(!needs_external_data(&graph_with(vec![raw_f32(quarter), raw_f32(quarter)]), false));
        assert!(needs_external_data(&graph_with(vec![raw_f32(quarter), raw_f32(quarter)]), true));
        // exactly 1 GiB stays inline, one element more goes outside
        let gib = graph_with(vec![raw_f32(2 * quarter), raw_f32(2 * quarter)]);
        assert!(!needs_external_data(&gib, false));
        assert!(needs_external_data(&graph_with(vec![raw_f32(2 * quarter), raw_f32(2 * quarter), raw_f32(1)]), false));
        let ext = ExternalData { location: "w.bin".into(), path: "w.bin".into(), offset: 0, length: 16, present: true };
        let outside = Data { dtype: DType::F32, dims: vec![4], storage: Storage::External(ext) };
        assert!(needs_external_data(&graph_with(vec![raw_f32(4), outside]), false));
    }
}
