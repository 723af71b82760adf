//! ModelProto → `ir::Graph`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use prost::Message;
use sha2::{Digest, Sha256};

use super::error::{ImportError, ImportWarning, MAX_IR_VERSION};
use super::inline::{Functions, normalize_domain};
use super::proto::{AttributeProto, ModelProto, NodeProto, SparseTensorProto, TensorProto, TypeProto, ValueInfoProto, type_proto};
use super::tensor::{ExternalResolver, convert};
use crate::ir::{Attr, Attrs, DType, Dim, Graph, GraphError, Node, Op, OpKind, Shape, TensorType, ValueId, ValueKind};

/// An imported model: the graph plus what the file said about itself.
#[derive(Clone, Debug)]
pub struct ImportedModel {
    /// The graph (values typed where the model declares types; no inference yet).
    pub graph: Graph,
    /// The model file.
    pub path: PathBuf,
    /// `ModelProto.ir_version`.
    pub ir_version: i64,
    /// Opset version per domain (`""` is the default domain); same as `graph.opsets`.
    pub opsets: BTreeMap<String, i64>,
    /// `ModelProto.producer_name`.
    pub producer_name: String,
    /// `ModelProto.producer_version`.
    pub producer_version: String,
    /// Things that did not stop the import (missing external data, unknown ops).
    pub warnings: Vec<ImportWarning>,
    /// SHA-256 of the model file's bytes, lower-case hex.
    pub sha256: String,
    /// Whether external data is missing (the model is graph-only: shapes, no weights).
    pub graph_only: bool,
    /// What canonicalising the opset-dependent forms rewrote.
    pub canonicalised: super::canonical::Canonicalised,
}

/// Reads and imports an ONNX model file. External data is resolved as metadata only. The file
/// is memory-mapped and initializers' `raw_data` stays in the map (nothing is copied; pages
/// are read when a weight is).
pub fn load_model(path: &Path) -> Result<ImportedModel, ImportError> {
    let io = |e| ImportError::Io { file: path.to_path_buf(), source: e };
    let file = std::fs::File::open(path).map_err(io)?;
    if file.metadata().map_err(io)?.len() == 0 {
        return Err(ImportError::Empty { file: path.to_path_buf() });
    }
    // SAFETY: read-only; a model file rewritten while mapped is outside what the importer
    // defends against
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    decode_model_shared(prost::bytes::Bytes::from_owner(map), path)
}

/// Imports a model from its bytes; `path` names it in errors and locates external data
/// (relative to its folder). The file itself is not read.
pub fn decode_model_bytes(bytes: &[u8], path: &Path) -> Result<ImportedModel, ImportError> {
    decode_model_shared(prost::bytes::Bytes::copy_from_slice(bytes), path)
}

/// [`decode_model_bytes`] from shared bytes, which initializers' raw data points into.
fn decode_model_shared(bytes: prost::bytes::Bytes, path: &Path) -> Result<ImportedModel, ImportError> {
    if bytes.is_empty() {
        return Err(ImportError::Empty { file: path.to_path_buf() });
    }
    let model = ModelProto::decode(bytes.clone()).map_err(|e| ImportError::Decode {
        file: path.to_path_buf(),
        what: "model",
        reason: e.to_string(),
    })?;
    let digest = Sha256::digest(&bytes);
    let mut sha256 = String::with_capacity(64);
    for b in digest {
        let _ = write!(sha256, "{b:02x}");
    }
    import_model(model, path, sha256)
}

/// Control-flow op types of the default domain.
const CONTROL_FLOW: &[&str] = &["If", "Loop", "Scan", "SequenceMap"];

/// `AttributeProto.AttributeType` codes.
mod attr_type {
    pub const FLOAT: i32 = 1;
    pub const INT: i32 = 2;
    pub const STRING: i32 = 3;
    pub const TENSOR: i32 = 4;
    pub const GRAPH: i32 = 5;
    pub const FLOATS: i32 = 6;
    pub const INTS: i32 = 7;
    pub const STRINGS: i32 = 8;
    pub const TENSORS: i32 = 9;
    pub const GRAPHS: i32 = 10;
    pub const SPARSE_TENSOR: i32 = 11;
    pub const SPARSE_TENSORS: i32 = 12;
}

fn model_err_node(file: &Path, node: &str, reason: impl Into<String>) -> ImportError {
    ImportError::BadNode { file: file.to_path_buf(), node: node.to_string(), reason: reason.into() }
}

fn import_model(model: ModelProto, path: &Path, sha256: String) -> Result<ImportedModel, ImportError> {
    let file = path.to_path_buf();
    let ir_version = model.ir_version.unwrap_or(0);
    if ir_version > MAX_IR_VERSION {
        return Err(ImportError::IrTooNew { file, version: ir_version });
    }
    let mut warnings = Vec::new();
    let mut opsets = BTreeMap::new();
    for o in &model.opset_import {
        let domain = normalize_domain(o.domain.as_deref().unwrap_or("")).to_string();
        opsets.insert(domain, o.version.unwrap_or(1));
    }
    let ModelProto { graph, functions, producer_name, producer_version, metadata_props, .. } = model;
    let graph_proto = graph.ok_or_else(|| ImportError::MissingGraph { file: file.clone() })?;
    if opsets.is_empty() && ir_version >= 3 {
        warnings.push(ImportWarning::Other(format!("{}: the model imports no opset (ModelProto.opset_import is empty)", file.display())));
    }

    // Nodes, with model-local functions inlined.
    let mut nodes = Vec::with_capacity(graph_proto.node.len());
    let mut funcs = Functions::new(&functions);
    funcs.expand(graph_proto.node, &file, 0, &mut nodes)?;
    let names = unique_node_names(&nodes);
    refuse_control_flow(&nodes, &names, &file)?;

    let mut g = Graph::new(graph_proto.name.clone().unwrap_or_default());
    g.opsets = opsets;
    let mut imp = Importer { file, g, names, producer_of: Vec::new(), resolver: ExternalResolver::new(path), syms: 0, warnings };
    // Declared types: value_info, then outputs and inputs (which win).
    let mut declared: HashMap<&str, &TypeProto> = HashMap::new();
    for vi in graph_proto.value_info.iter().chain(&graph_proto.output).chain(&graph_proto.input) {
        if let (Some(name), Some(ty)) = (vi.name.as_deref(), vi.r#type.as_ref()) {
            declared.insert(name, ty);
        }
    }
    imp.initializers_and_inputs(&graph_proto.initializer, &graph_proto.sparse_initializer, &graph_proto.input)?;
    let outputs = imp.node_outputs(&nodes, &declared)?;
    let (inputs, order) = imp.node_inputs(&nodes)?;
    let unknown = imp.add_nodes(nodes, order, inputs, outputs)?;
    let Importer { file, mut g, resolver, mut warnings, .. } = imp;

    for vi in &graph_proto.output {
        let name = vi.name.clone().unwrap_or_default();
        let v = g.value_by_name(&name).ok_or_else(|| ImportError::DanglingOutput { file: file.clone(), output: name.clone() })?;
        g.outputs.push(v);
    }
    if let Some(entry) = metadata_props.iter().find(|p| p.key.as_deref() == Some(super::record::AUX_LOSS_KEY)) {
        g.aux_losses = super::record::aux_losses(&g, entry.value.as_deref().unwrap_or(""), &file)?;
    }

    // the last step: one form for every opset, so nothing after the importer reads the opset
    let opset = *g.opsets.entry(String::new()).or_insert(super::canonical::DEFAULT_OPSET);
    let canonicalised = super::canonical::canonicalise(&mut g, opset, &file)?;
    if canonicalised != super::canonical::Canonicalised::default() {
        tracing::debug!(?canonicalised, opset, "{}: opset-dependent forms canonicalised", file.display());
    }
    g.verify().map_err(|e| ImportError::Graph { file: file.clone(), source: e })?;

    for (domain, op_type, node, count) in unknown {
        warnings.push(ImportWarning::UnknownOp { domain, op_type, node, count });
    }
    let graph_only = !resolver.missing.is_empty();
    if let Some((tensor, path)) = resolver.missing.first() {
        warnings.push(ImportWarning::MissingExternalData { tensors: resolver.missing.len(), first_file: path.clone(), first_tensor: tensor.clone() });
    }
    if funcs.calls() > 0 {
        tracing::debug!("{}: inlined {} model-local function call(s)", file.display(), funcs.calls());
    }
    let opsets = g.opsets.clone();
    Ok(ImportedModel {
        graph: g,
        path: file,
        ir_version,
        opsets,
        producer_name: producer_name.unwrap_or_default(),
        producer_version: producer_version.unwrap_or_default(),
        warnings,
        sha256,
        graph_only,
        canonicalised,
    })
}

/// Refuses control flow: a node with a subgraph attribute, or a default-domain control-flow op.
fn refuse_control_flow(nodes: &[NodeProto], names: &[String], file: &Path) -> Result<(), ImportError> {
    for (n, name) in nodes.iter().zip(names) {
        let op_type = n.op_type.as_deref().unwrap_or("");
        let default_domain = normalize_domain(n.domain.as_deref().unwrap_or("")).is_empty();
        let has_subgraph = n.attribute.iter().any(|a| matches!(a.r#type, Some(attr_type::GRAPH) | Some(attr_type::GRAPHS)) || a.g.is_some() || !a.graphs.is_empty());
        if has_subgraph || (default_domain && CONTROL_FLOW.contains(&op_type)) {
            return Err(ImportError::ControlFlow { file: file.to_path_buf(), node: name.clone(), op_type: op_type.to_string() });
        }
    }
    Ok(())
}

/// No producing node: an initializer or a graph input (see [`Importer::producer_of`]).
const NONE: usize = usize::MAX;

/// The graph being imported, with what the import's steps share.
struct Importer {
    file: PathBuf,
    g: Graph,
    /// Unique node names, by node index in the file (functions inlined).
    names: Vec<String>,
    /// The node (index) defining each value, by value index; [`NONE`] for initializers and
    /// graph inputs.
    producer_of: Vec<usize>,
    resolver: ExternalResolver,
    /// Symbolic dims named so far.
    syms: usize,
    warnings: Vec<ImportWarning>,
}

impl Importer {
    fn graph_err(&self, e: GraphError) -> ImportError {
        ImportError::Graph { file: self.file.clone(), source: e }
    }

    /// What defines value `v`, for an error naming both definitions of a name.
    fn describe(&self, v: ValueId) -> String {
        match (self.g.value(v).kind, self.producer_of.get(v.index()).filter(|&&i| i != NONE)) {
            (_, Some(&i)) => format!("node `{}`", self.names[i]),
            (ValueKind::Initializer, _) => "an initializer".to_string(),
            _ => "a graph input".to_string(),
        }
    }

    /// The initializers (with their parameter records), then the graph inputs that are not
    /// initializers.
    fn initializers_and_inputs(&mut self, initializers: &[TensorProto], sparse: &[SparseTensorProto], inputs: &[ValueInfoProto]) -> Result<(), ImportError> {
        if let Some(s) = sparse.first() {
            let name = s.values.as_ref().and_then(|v| v.name.clone()).unwrap_or_default();
            return Err(ImportError::BadTensor { file: self.file.clone(), tensor: name, reason: "sparse initializers are not supported".into() });
        }
        for t in initializers {
            let tensor = convert(t, &mut self.resolver)?;
            let name = t.name.clone().unwrap_or_default();
            if let Some(v) = self.g.value_by_name(&name) {
                return Err(ImportError::DuplicateOutput { file: self.file.clone(), value: name, first: self.describe(v), second: "an initializer".into() });
            }
            let record = super::record::read(t, &self.file)?;
            let ty = TensorType { dtype: tensor.dtype, shape: Some(Shape::from_known(&tensor.dims)) };
            let id = self.g.add_value(name, ValueKind::Initializer, Some(ty), Some(tensor)).map_err(|e| self.graph_err(e))?;
            self.g.value_mut(id).record = record;
        }
        for vi in inputs {
            let name = vi.name.clone().unwrap_or_default();
            match self.g.value_by_name(&name) {
                Some(v) if self.g.value(v).kind == ValueKind::Initializer => continue,
                Some(v) => {
                    return Err(ImportError::DuplicateOutput { file: self.file.clone(), value: name, first: self.describe(v), second: "a graph input".into() });
                }
                None => {}
            }
            let ty = value_type(vi, &mut self.syms);
            let id = self.g.add_value(name, ValueKind::Input, ty, None).map_err(|e| self.graph_err(e))?;
            self.g.inputs.push(id);
        }
        Ok(())
    }

    /// Every node output, before any node (the file need not be topologically sorted), typed
    /// where `declared`; by node index.
    fn node_outputs(&mut self, nodes: &[NodeProto], declared: &HashMap<&str, &TypeProto>) -> Result<Vec<Vec<ValueId>>, ImportError> {
        let mut node_outputs: Vec<Vec<ValueId>> = Vec::with_capacity(nodes.len());
        for (i, n) in nodes.iter().enumerate() {
            let mut outs = Vec::with_capacity(n.output.len());
            for out in n.output.iter().filter(|o| !o.is_empty()) {
                if let Some(v) = self.g.value_by_name(out) {
                    return Err(ImportError::DuplicateOutput { file: self.file.clone(), value: out.clone(), first: self.describe(v), second: format!("node `{}`", self.names[i]) });
                }
                let ty = declared.get(out.as_str()).and_then(|t| type_from_proto(t, &mut self.syms));
                let id = self.g.add_value(out.clone(), ValueKind::Intermediate, ty, None).map_err(|e| self.graph_err(e))?;
                self.producer_of.resize(id.index(), NONE);
                self.producer_of.push(i);
                outs.push(id);
            }
            node_outputs.push(outs);
        }
        Ok(node_outputs)
    }

    /// Each node's inputs by name, and the nodes in topological order (ties broken by file
    /// position).
    fn node_inputs(&self, nodes: &[NodeProto]) -> Result<(Vec<Vec<Option<ValueId>>>, Vec<usize>), ImportError> {
        let mut node_inputs: Vec<Vec<Option<ValueId>>> = Vec::with_capacity(nodes.len());
        let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        let mut indegree = vec![0usize; nodes.len()];
        for (i, n) in nodes.iter().enumerate() {
            let mut ins = Vec::with_capacity(n.input.len());
            let mut preds: Vec<usize> = Vec::new();
            for input in &n.input {
                if input.is_empty() {
                    ins.push(None);
                    continue;
                }
                let v = self.g.value_by_name(input).ok_or_else(|| ImportError::DanglingInput { file: self.file.clone(), node: self.names[i].clone(), input: input.clone() })?;
                if let Some(&p) = self.producer_of.get(v.index()).filter(|&&p| p != NONE)
                    && !preds.contains(&p)
                {
                    preds.push(p);
                    dependents[p].push(i);
                    indegree[i] += 1;
                }
                ins.push(Some(v));
            }
            node_inputs.push(ins);
        }
        let mut ready: BinaryHeap<Reverse<usize>> = (0..nodes.len()).filter(|&i| indegree[i] == 0).map(Reverse).collect();
        let mut order = Vec::with_capacity(nodes.len());
        while let Some(Reverse(i)) = ready.pop() {
            order.push(i);
            for &d in &dependents[i] {
                indegree[d] -= 1;
                if indegree[d] == 0 {
                    ready.push(Reverse(d));
                }
            }
        }
        if order.len() != nodes.len() {
            let stuck = (0..nodes.len()).find(|&i| indegree[i] > 0).unwrap_or(0);
            return Err(ImportError::Cycle { file: self.file.clone(), node: self.names[stuck].clone() });
        }
        Ok((node_inputs, order))
    }

    /// Adds the nodes in `order`; returns the ops the IR does not know (domain, op type, first
    /// node, count), kept as placeholders.
    fn add_nodes(&mut self, nodes: Vec<NodeProto>, order: Vec<usize>, mut inputs: Vec<Vec<Option<ValueId>>>, mut outputs: Vec<Vec<ValueId>>) -> Result<Vec<(String, String, String, usize)>, ImportError> {
        let mut unknown: Vec<(String, String, String, usize)> = Vec::new();
        let mut node_protos: Vec<Option<NodeProto>> = nodes.into_iter().map(Some).collect();
        for i in order {
            let Some(n) = node_protos[i].take() else { continue };
            let name = self.names[i].clone();
            let op_type = n.op_type.unwrap_or_default();
            let domain = normalize_domain(n.domain.as_deref().unwrap_or("")).to_string();
            let op = match (domain.is_empty(), OpKind::from_onnx(&op_type)) {
                (true, Some(kind)) => Op::Known(kind),
                _ => {
                    match unknown.iter_mut().find(|u| u.0 == domain && u.1 == op_type) {
                        Some(u) => u.3 += 1,
                        None => unknown.push((domain.clone(), op_type.clone(), name.clone(), 1)),
                    }
                    Op::Placeholder { op_type: op_type.clone(), domain }
                }
            };
            let attrs = parse_attrs(&n.attribute, &name, &self.file, &mut self.resolver, &mut self.warnings)?;
            if op.is(OpKind::Constant)
                && let (Some(&out), Some(ty)) = (outputs[i].first(), constant_type(&attrs))
                && self.g.value(out).ty.is_none()
            {
                self.g.value_mut(out).ty = Some(ty);
            }
            let namespace = n.metadata_props.iter().find(|p| p.key.as_deref() == Some("namespace")).and_then(|p| p.value.clone());
            let node = Node { name, op, attrs, inputs: std::mem::take(&mut inputs[i]), outputs: std::mem::take(&mut outputs[i]), namespace, order: i as u32 };
            self.g.add_node(node).map_err(|e| self.graph_err(e))?;
        }
        Ok(unknown)
    }
}

/// Node names made unique: an empty name becomes `OpType_N`, a repeated one `name_N`.
fn unique_node_names(nodes: &[NodeProto]) -> Vec<String> {
    let mut used: HashSet<String> = nodes.iter().filter_map(|n| n.name.clone()).filter(|s| !s.is_empty()).collect();
    let mut seen: HashSet<&str> = HashSet::with_capacity(nodes.len());
    let mut counters: HashMap<String, usize> = HashMap::new();
    let mut fresh = |base: &str, used: &mut HashSet<String>| -> String {
        let k = counters.entry(base.to_string()).or_insert(0);
        loop {
            let candidate = format!("{base}_{k}");
            *k += 1;
            if used.insert(candidate.clone()) {
                return candidate;
            }
        }
    };
    nodes
        .iter()
        .map(|n| match n.name.as_deref() {
            Some(name) if !name.is_empty() && seen.insert(name) => name.to_string(),
            Some(name) if !name.is_empty() => fresh(name, &mut used),
            _ => fresh(n.op_type.as_deref().filter(|s| !s.is_empty()).unwrap_or("node"), &mut used),
        })
        .collect()
}

fn value_type(vi: &ValueInfoProto, syms: &mut usize) -> Option<TensorType> {
    vi.r#type.as_ref().and_then(|t| type_from_proto(t, syms))
}

/// A tensor TypeProto → `TensorType`. A dim with neither value nor param becomes a fresh
/// symbol `?N` (rank kept, size unknown); non-tensor types give `None`.
fn type_from_proto(ty: &TypeProto, syms: &mut usize) -> Option<TensorType> {
    let type_proto::Value::TensorType(t) = ty.value.as_ref()? else { return None };
    let dtype = DType::from_onnx(t.elem_type.unwrap_or(0))?;
    let shape = t.shape.as_ref().map(|s| {
        Shape(
            s.dim
                .iter()
                .map(|d| match &d.value {
                    Some(super::proto::tensor_shape_proto::dimension::Value::DimValue(v)) => Dim::Known(*v),
                    Some(super::proto::tensor_shape_proto::dimension::Value::DimParam(p)) if !p.is_empty() => {
                        Dim::Sym(p.clone())
                    }
                    _ => {
                        *syms += 1;
                        Dim::Sym(format!("?{syms}"))
                    }
                })
                .collect(),
        )
    });
    Some(TensorType { dtype, shape })
}

/// The output type of a `Constant` node from its attribute.
fn constant_type(attrs: &Attrs) -> Option<TensorType> {
    let (dtype, dims): (DType, Vec<i64>) = match attrs.0.values().next()? {
        Attr::Tensor(t) => (t.dtype, t.dims.clone()),
        Attr::Float(_) => (DType::F32, vec![]),
        Attr::Int(_) => (DType::I64, vec![]),
        Attr::Str(_) => (DType::Str, vec![]),
        Attr::Floats(v) => (DType::F32, vec![v.len() as i64]),
        Attr::Ints(v) => (DType::I64, vec![v.len() as i64]),
        Attr::Strs(v) => (DType::Str, vec![v.len() as i64]),
    };
    Some(TensorType { dtype, shape: Some(Shape::from_known(&dims)) })
}

fn parse_attrs(
    attrs: &[AttributeProto],
    node: &str,
    file: &Path,
    resolver: &mut ExternalResolver,
    warnings: &mut Vec<ImportWarning>,
) -> Result<Attrs, ImportError> {
    let mut out = Attrs::default();
    for a in attrs {
        let name = a.name.clone().unwrap_or_default();
        if a.ref_attr_name.as_deref().is_some_and(|r| !r.is_empty()) {
            return Err(model_err_node(
                file,
                node,
                format!("attribute `{name}` refers to a function attribute outside a function"),
            ));
        }
        let kind = match a.r#type.unwrap_or(0) {
            0 => infer_attr_type(a),
            k => k,
        };
        let value = match kind {
            attr_type::FLOAT => Attr::Float(a.f.unwrap_or(0.0)),
            attr_type::INT => Attr::Int(a.i.unwrap_or(0)),
            attr_type::STRING => Attr::Str(String::from_utf8_lossy(a.s.as_deref().unwrap_or(&[])).into_owned()),
            attr_type::FLOATS => Attr::Floats(a.floats.clone()),
            attr_type::INTS => Attr::Ints(a.ints.clone()),
            attr_type::STRINGS => {
                Attr::Strs(a.strings.iter().map(|s| String::from_utf8_lossy(s).into_owned()).collect())
            }
            attr_type::TENSOR => {
                let t = a
                    .t
                    .as_ref()
                    .ok_or_else(|| model_err_node(file, node, format!("TENSOR attribute `{name}` has no tensor")))?;
                let mut t = t.clone();
                if t.name.as_deref().is_none_or(str::is_empty) {
                    t.name = Some(format!("{node}.{name}"));
                }
                Attr::Tensor(convert(&t, resolver)?)
            }
            attr_type::SPARSE_TENSOR | attr_type::SPARSE_TENSORS => {
                return Err(model_err_node(
                    file,
                    node,
                    format!("sparse tensor attribute `{name}` is not supported; densify the constant before export"),
                ));
            }
            attr_type::TENSORS => {
                warnings.push(ImportWarning::Other(format!("node `{node}`: TENSORS attribute `{name}` ignored")));
                continue;
            }
            // GRAPH(S) were refused as control flow; TYPE_PROTO(S) carry no data we use.
            _ => continue,
        };
        out.0.insert(name, value);
    }
    Ok(out)
}

/// Attribute type for IR versions that left `type` unset.
fn infer_attr_type(a: &AttributeProto) -> i32 {
    if a.t.is_some() {
        attr_type::TENSOR
    } else if a.g.is_some() {
        attr_type::GRAPH
    } else if a.sparse_tensor.is_some() {
        attr_type::SPARSE_TENSOR
    } else if !a.floats.is_empty() {
        attr_type::FLOATS
    } else if !a.ints.is_empty() {
        attr_type::INTS
    } else if !a.strings.is_empty() {
        attr_type::STRINGS
    } else if !a.tensors.is_empty() {
        attr_type::TENSORS
    } else if !a.graphs.is_empty() {
        attr_type::GRAPHS
    } else if a.f.is_some() {
        attr_type::FLOAT
    } else if a.i.is_some() {
        attr_type::INT
    } else if a.s.is_some() {
        attr_type::STRING
    } else {
        0
    }
}

#[cfg(test)]
mod zero_copy {
    use super::*;
    use crate::ir::Storage;

    /// Initializers' raw data points into the buffer the model was decoded from (for
    /// `load_model`, the memory-mapped file): nothing is copied.
    #[test]
    fn raw_data_stays_in_the_decoded_buffer() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx");
        let buf = prost::bytes::Bytes::from(std::fs::read(&path).unwrap());
        let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
        let m = decode_model_shared(buf.clone(), &path).unwrap();
        let mut inside = 0;
        for v in m.graph.initializers() {
            if let Some(Storage::Raw(b)) = m.graph.value(v).data.as_ref().map(|d| &d.storage) {
                if b.len() >= 1024 {
                    assert!(range.contains(&(b.as_ptr() as usize)), "`{}` was copied", m.graph.value(v).name);
                    inside += 1;
                }
            }
        }
        assert!(inside >= 10, "only {inside} large initializers");
        assert_eq!(load_model(&path).unwrap().sha256, m.sha256);
    }
}
