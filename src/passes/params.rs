//! What is trained: one typed decision ([`Training`]) per initializer, from the export's
//! parameter record (docs/parameter-record.md) or, without one, from structural rules; plus
//! `--trainable` / `--frozen` patterns. The graph is rewritten so that every trained
//! initializer is exactly one module tensor:
//! - an initializer the exporter merged from N equal-valued parameters is untied into N
//!   initializers, each read by the nodes of its parameter;
//! - an initializer that is a transposed or row-gathered view of a parameter another
//!   initializer holds becomes a `Transpose` / `Gather` node of that one (a real tie: one
//!   tensor, gradients summed by autograd);
//! - rows gathered at export time (a fixed-shape export's positions) become a `Gather` of a new
//!   initializer holding the distinct rows, so every sample's copy trains the same rows.
//!
//! Without a record (conservative):
//! - not floating point, or a scalar: frozen;
//! - a well-known buffer name (RoPE tables, masks, position ids): frozen;
//! - read only as a shape or index operand, or holding only mask values (0 and ≤ −1e4), or
//!   shaped by the fixed batch / sequence of the inputs (masks, RoPE caches, gathered
//!   positions): frozen;
//! - all elements equal and read by several nodes: the exporter merged it, so it is untied into
//!   one trained tensor per reading node;
//! - otherwise trained; a varied initializer read by several nodes is a real tie.
//!
//! Running [`decide`] again is a no-op: values that already carry a decision keep it.

use std::collections::{BTreeMap, HashMap};

use super::PassError;
use crate::ir::{
    Attr, Attrs, DType, DecisionSource, Dim, FrozenReason, Graph, Node, NodeId, Op, OpKind, PADDING_ROWS,
    ParamRecord, ParamTransform, RecordKind, Storage, Tensor, Training, ValueId, ValueKind,
};

/// Which initializers the user forces trained or frozen (glob patterns, `*` and `?`, matched
/// against the initializer's name and the module names it stands for).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamOptions {
    /// `--trainable`: train matching initializers the rules would freeze (floating-point,
    /// more than one element).
    pub trainable: Vec<String>,
    /// `--frozen`: never train matching initializers (wins over `trainable`).
    pub frozen: Vec<String>,
}

impl ParamOptions {
    /// The patterns as command-line flags (`--trainable 'G' --frozen 'H'`).
    pub fn flags(&self) -> String {
        let t = self.trainable.iter().map(|g| format!("--trainable '{g}'"));
        let f = self.frozen.iter().map(|g| format!("--frozen '{g}'"));
        t.chain(f).collect::<Vec<_>>().join(" ")
    }

    /// What is trained, in words, for messages.
    pub fn describe(&self) -> String {
        if *self == ParamOptions::default() { "by the model's record and rules (no --trainable/--frozen)".into() } else { format!("with `{}`", self.flags()) }
    }
}

/// What [`decide`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamSummary {
    /// Initializers trained.
    pub trained_tensors: usize,
    /// Their elements.
    pub trained_elems: u64,
    /// Initializers held frozen.
    pub frozen_tensors: usize,
    /// Their elements.
    pub frozen_elems: u64,
    /// Merged initializers untied.
    pub untied: usize,
    /// Initializers made by untying.
    pub copies: usize,
    /// Initializers rewritten as a view (`Transpose`/`Gather`) of the tensor they tie to.
    pub views: usize,
    /// Float initializers decided by the structural rules: the file carries no parameter
    /// record, so what the exporter dropped or folded cannot be known.
    pub without_record: usize,
    /// Float constants held frozen that look like folded parameters.
    pub suspects: Vec<Suspect>,
}

/// A float constant of a file without a parameter record that looks like a parameter the
/// exporter folded (a fixed-shape export folds the position embedding rows it gathers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Suspect {
    /// The initializer.
    pub name: String,
    /// Its shape.
    pub dims: Vec<i64>,
    /// An `Add`/`Sub` adds it to an activation.
    pub added_to_activations: bool,
    /// Its rows are as wide as those of a table the model looks rows up in (`Gather`).
    pub table_rows: bool,
}

impl std::fmt::Display for Suspect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let why: Vec<&str> = [(self.added_to_activations, "added to activations"), (self.table_rows, "rows of a table")]
            .into_iter()
            .filter_map(|(on, w)| on.then_some(w))
            .collect();
        write!(f, "`{}` {:?} ({})", self.name, self.dims, why.join(", "))
    }
}

impl std::fmt::Display for ParamSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trains {} tensors ({} elements), holds {} frozen ({} elements)",
            self.trained_tensors, self.trained_elems, self.frozen_tensors, self.frozen_elems
        )?;
        if self.untied > 0 {
            write!(f, "; untied {} merged initializers into {} tensors", self.untied, self.untied + self.copies)?;
        }
        if self.views > 0 {
            write!(f, "; {} initializers tied as views", self.views)?;
        }
        if self.without_record > 0 {
            write!(
                f,
                "\nthe file has no parameter record, so what is trained follows structural rules: an exporter may have \
                 dropped parameters (zero biases) or folded them into constants, and those are not trained"
            )?;
            if self.suspects.is_empty() {
                write!(f, "; no constant here looks like a folded parameter")?;
            } else {
                let list: Vec<String> = self.suspects.iter().map(Suspect::to_string).collect();
                write!(f, "; these float constants look like folded parameters and are held frozen: {}", list.join(", "))?;
            }
            write!(f, "\nto train exactly what the module trains, export it through `smp_partition.export` (it records every parameter)")?;
        }
        Ok(())
    }
}

/// True if initializer `v` is trained: its decision if [`decide`] ran, else the rule without
/// a record (floating point, more than one element, not a well-known buffer name).
pub fn is_trained(graph: &Graph, v: ValueId) -> bool {
    let val = graph.value(v);
    if val.kind != ValueKind::Initializer {
        return false;
    }
    match &val.training {
        Some(t) => t.is_trained(),
        None => legacy_frozen(graph, v).is_none(),
    }
}

/// For every value (by index): whether it carries a gradient in training, that is, it is a
/// trained initializer or a floating-point value computed from one. Only these values need a
/// gradient from a later pipeline stage; masks and positions computed from the data and
/// constants do not.
pub fn carries_gradient(graph: &Graph) -> Result<Vec<bool>, PassError> {
    let mut carries = vec![false; graph.value_count()];
    for v in graph.initializers() {
        carries[v.index()] = is_trained(graph, v);
    }
    for n in graph.topo_order()? {
        let node = graph.node(n);
        if node.inputs.iter().flatten().any(|v| carries[v.index()]) {
            for &o in &node.outputs {
                carries[o.index()] = graph.value(o).ty.as_ref().is_some_and(|t| t.dtype.is_float());
            }
        }
    }
    Ok(carries)
}

/// Decides, for every initializer, whether it is trained, rewriting the graph as the module
/// doc says. Returns counts for the run's log.
pub fn decide(graph: &mut Graph, opts: &ParamOptions) -> Result<ParamSummary, PassError> {
    let mut summary = ParamSummary::default();
    let pending: Vec<ValueId> =
        graph.initializers().filter(|&v| graph.value(v).training.is_none()).collect();
    let (recorded, plain): (Vec<ValueId>, Vec<ValueId>) =
        pending.into_iter().partition(|&v| graph.value(v).record.is_some());
    if !recorded.is_empty() {
        from_records(graph, &recorded, &mut summary)?;
    }
    structural(graph, &plain, &mut summary)?;
    apply_patterns(graph, opts)?;
    for v in graph.initializers().collect::<Vec<_>>() {
        let n = graph.value(v).data.as_ref().map_or(0, Tensor::numel);
        if is_trained(graph, v) {
            summary.trained_tensors += 1;
            summary.trained_elems += n;
        } else {
            summary.frozen_tensors += 1;
            summary.frozen_elems += n;
        }
    }
    Ok(summary)
}

/// The frozen reason of the rule without a record, or `None` if it would be trained.
fn legacy_frozen(graph: &Graph, v: ValueId) -> Option<FrozenReason> {
    let val = graph.value(v);
    let dtype = val.data.as_ref().map(|t| t.dtype).or(val.ty.as_ref().map(|t| t.dtype));
    let numel = val.data.as_ref().map(Tensor::numel).or_else(|| val.ty.as_ref()?.shape.as_ref()?.numel()).unwrap_or(0);
    if !dtype.is_some_and(|d| d.is_float()) || numel <= 1 {
        return Some(FrozenReason::NotAWeight);
    }
    let name = val.name.to_ascii_lowercase();
    ["inv_freq", "rotary", "rope", "_cached", "mask", "position_ids"]
        .iter()
        .any(|b| name.contains(b))
        .then_some(FrozenReason::BufferName)
}

fn frozen(reason: FrozenReason) -> Training {
    Training::Frozen { reason }
}

/// A value name not yet used, from `want`.
fn free_name(graph: &Graph, want: &str) -> String {
    if graph.value_by_name(want).is_none() {
        return want.to_string();
    }
    (1..).map(|k| format!("{want}#{k}")).find(|n| graph.value_by_name(n).is_none()).unwrap_or_default()
}

/// A new initializer holding `data`, typed from it.
fn add_initializer(graph: &mut Graph, want: &str, data: Tensor) -> Result<ValueId, PassError> {
    let name = free_name(graph, want);
    let ty = crate::ir::TensorType { dtype: data.dtype, shape: Some(crate::ir::Shape::from_known(&data.dims)) };
    Ok(graph.add_value(name, ValueKind::Initializer, Some(ty), Some(data))?)
}

/// Points every input of `nodes` that reads `from` at `to`.
fn redirect(graph: &mut Graph, nodes: &[NodeId], from: ValueId, to: ValueId) {
    for &n in nodes {
        let slots: Vec<usize> =
            graph.node(n).inputs.iter().enumerate().filter(|(_, v)| **v == Some(from)).map(|(i, _)| i).collect();
        for s in slots {
            graph.set_input(n, s, Some(to));
        }
    }
}

/// Turns initializer `v` into the output of a new node `op(inputs)` (its data dropped).
fn make_view(graph: &mut Graph, v: ValueId, op: OpKind, inputs: Vec<ValueId>, attrs: Attrs) -> Result<(), PassError> {
    let order = graph.node_ids().map(|n| graph.node(n).order).min().unwrap_or(0).saturating_sub(1);
    let name = format!("smp_tie/{}", graph.value(v).name);
    let readers: Vec<NodeId> = graph.node_ids().filter(|&n| graph.node(n).inputs.contains(&Some(v))).collect();
    {
        let val = graph.value_mut(v);
        val.data = None;
        val.record = None;
        val.training = None;
    }
    graph.add_node(Node {
        name,
        op: Op::Known(op),
        attrs,
        inputs: inputs.into_iter().map(Some).collect(),
        outputs: vec![v],
        namespace: None,
        order,
    })?;
    // the readers' edges now come from the new producer
    redirect(graph, &readers, v, v);
    Ok(())
}

/// An i64 constant value.
fn add_index(graph: &mut Graph, want: &str, dims: Vec<i64>, rows: &[i64]) -> Result<ValueId, PassError> {
    let t = Tensor::from_i64(dims.clone(), rows);
    let ty = crate::ir::TensorType { dtype: DType::I64, shape: Some(crate::ir::Shape::from_known(&dims)) };
    let name = free_name(graph, want);
    Ok(graph.add_value(name, ValueKind::Constant, Some(ty), Some(t))?)
}

fn node_by_name(graph: &Graph) -> HashMap<String, NodeId> {
    graph.node_ids().map(|n| (graph.node(n).name.clone(), n)).collect()
}

/// Readers of each value, by value index.
fn readers(graph: &Graph) -> Vec<Vec<NodeId>> {
    let mut out = vec![Vec::new(); graph.value_count()];
    for n in graph.node_ids() {
        for v in graph.node(n).inputs.iter().flatten() {
            if out[v.index()].last() != Some(&n) {
                out[v.index()].push(n);
            }
        }
    }
    out
}

fn bad_record(graph: &Graph, v: ValueId, msg: String) -> PassError {
    PassError::ParamRecord { value: graph.value(v).name.clone(), msg }
}

fn from_records(graph: &mut Graph, recorded: &[ValueId], summary: &mut ParamSummary) -> Result<(), PassError> {
    let by_name = node_by_name(graph);
    let users = readers(graph);
    // 1. untie merged initializers: one initializer per entry, read by that entry's sites
    let mut singles: Vec<(ValueId, Option<(String, usize)>)> = Vec::new();
    for &v in recorded {
        let rec = graph.value(v).record.clone().unwrap_or_else(|| unreachable!("partitioned on record"));
        match rec.kind {
            RecordKind::Buffer => graph.value_mut(v).training = Some(frozen(FrozenReason::Buffer)),
            RecordKind::Constant => graph.value_mut(v).training = Some(frozen(FrozenReason::Constant)),
            RecordKind::Parameter if rec.params.len() <= 1 => singles.push((v, None)),
            RecordKind::Parameter => {
                let origin = graph.value(v).name.clone();
                let n = rec.params.len();
                let data = graph.value(v).data.clone().ok_or_else(|| bad_record(graph, v, "no data".into()))?;
                let one = |i: usize| ParamRecord {
                    kind: RecordKind::Parameter,
                    params: vec![rec.params[i].clone()],
                    transform: rec.transform.clone(),
                    sites: Vec::new(),
                    persistent: true,
                    trainable: rec.trainable,
                    padding_rows: rec.padding_rows.clone(),
                };
                for i in 1..n {
                    let sites: Vec<NodeId> = rec.sites.get(i).into_iter().flatten().filter_map(|s| by_name.get(s).copied()).collect();
                    let sites: Vec<NodeId> = sites.into_iter().filter(|s| users[v.index()].contains(s)).collect();
                    if sites.is_empty() {
                        return Err(bad_record(graph, v, format!("no node of `smp.sites` reads entry `{}`", rec.params[i][0])));
                    }
                    let c = add_initializer(graph, rec.name(i).unwrap_or(&origin), data.clone())?;
                    graph.value_mut(c).record = Some(one(i));
                    redirect(graph, &sites, v, c);
                    singles.push((c, Some((origin.clone(), n))));
                }
                graph.value_mut(v).record = Some(one(0));
                singles.push((v, Some((origin, n))));
                summary.untied += 1;
                summary.copies += n - 1;
            }
        }
    }
    // 2. group by module tensor; views of a tensor another initializer holds become nodes
    let mut groups: BTreeMap<String, Vec<ValueId>> = BTreeMap::new();
    let mut untied_from: HashMap<ValueId, (String, usize)> = HashMap::new();
    for (v, u) in singles {
        let key = graph.value(v).record.as_ref().and_then(|r| r.name(0)).unwrap_or_default().to_string();
        groups.entry(key).or_default().push(v);
        if let Some(u) = u {
            untied_from.insert(v, u);
        }
    }
    for (param, members) in groups {
        let transform = |g: &Graph, v: ValueId| g.value(v).record.as_ref().map(|r| r.transform.clone()).unwrap_or(ParamTransform::Identity);
        let rank = |t: &ParamTransform| match t {
            ParamTransform::Identity => 0,
            ParamTransform::Transpose => 1,
            ParamTransform::Gather { .. } => 2,
        };
        let canon = *members.iter().min_by_key(|&&v| (rank(&transform(graph, v)), v)).unwrap_or(&members[0]);
        let aliases = graph.value(canon).record.as_ref().map(|r| r.params[0].clone()).unwrap_or_default();
        let ct = transform(graph, canon);
        // before views drop their records
        let padding = padding_rows(graph, &members);
        // the tensor views are made of, and its transform relative to the module tensor
        let (base, base_t) = match ct {
            ParamTransform::Gather { .. } => {
                // no initializer holds the tensor itself: hold the distinct rows gathered
                let (base, rows) = distinct_rows(graph, &members, &param)?;
                (base, ParamTransform::Gather { dims: vec![rows.len() as i64], rows })
            }
            t => (canon, t),
        };
        for &m in &members {
            if m == base {
                continue;
            }
            let users_m: Vec<NodeId> = graph.node_ids().filter(|&n| graph.node(n).inputs.contains(&Some(m))).collect();
            let mt = transform(graph, m);
            match (&base_t, &mt) {
                (a, b) if rank(a) == rank(b) && rank(a) < 2 => {
                    redirect(graph, &users_m, m, base);
                    graph.value_mut(m).training = Some(frozen(FrozenReason::Constant));
                }
                (ParamTransform::Identity, ParamTransform::Transpose) | (ParamTransform::Transpose, ParamTransform::Identity) => {
                    let attrs = Attrs(BTreeMap::from([("perm".to_string(), Attr::Ints(vec![1, 0]))]));
                    make_view(graph, m, OpKind::Transpose, vec![base], attrs)?;
                }
                (_, ParamTransform::Gather { dims, rows }) => {
                    let index: Vec<i64> = match &base_t {
                        ParamTransform::Identity => rows.clone(),
                        ParamTransform::Gather { rows: held, .. } => rows
                            .iter()
                            .map(|r| held.iter().position(|h| h == r).map(|p| p as i64))
                            .collect::<Option<_>>()
                            .ok_or_else(|| bad_record(graph, m, "gathers a row no initializer holds".into()))?,
                        ParamTransform::Transpose => {
                            return Err(bad_record(graph, m, format!("gathers rows of `{param}`, which the file holds only transposed")));
                        }
                    };
                    let name = format!("{}/rows", graph.value(m).name);
                    let idx = add_index(graph, &name, dims.clone(), &index)?;
                    let attrs = Attrs(BTreeMap::from([("axis".to_string(), Attr::Int(0))]));
                    make_view(graph, m, OpKind::Gather, vec![base, idx], attrs)?;
                }
                _ => return Err(bad_record(graph, m, format!("cannot tie it to `{}`", graph.value(base).name))),
            }
            summary.views += 1;
        }
        mark_padding_lookups(graph, base, &base_t, &padding);
        let trainable = graph.value(canon).record.as_ref().is_none_or(|r| r.trainable);
        graph.value_mut(base).training = Some(if trainable {
            Training::Trained { names: aliases, transform: base_t, untied_from: untied_from.get(&canon).cloned(), source: DecisionSource::Record }
        } else {
            frozen(FrozenReason::Module)
        });
    }
    Ok(())
}

/// The padding rows the records of `members` (one module tensor) name, sorted, once each.
fn padding_rows(graph: &Graph, members: &[ValueId]) -> Vec<i64> {
    let mut rows: Vec<i64> = members.iter().filter_map(|&m| graph.value(m).record.as_ref()).flat_map(|r| r.padding_rows.iter().copied()).collect();
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Marks every axis-0 `Gather` of `table` (a module tensor by `transform`) with the padding
/// rows in the table's own row numbers ([`PADDING_ROWS`]): lookups of those rows send it no
/// gradient, as `nn.Embedding(..., padding_idx)`'s do. Other readers (a tied LM head) are
/// untouched, so the padding row still trains through them, as in PyTorch.
fn mark_padding_lookups(graph: &mut Graph, table: ValueId, transform: &ParamTransform, padding: &[i64]) {
    let rows: Vec<i64> = match transform {
        ParamTransform::Identity => padding.to_vec(),
        // the table holds only some rows: their positions in it
        ParamTransform::Gather { rows: held, .. } => {
            held.iter().enumerate().filter(|(_, r)| padding.contains(r)).map(|(i, _)| i as i64).collect()
        }
        // a transposed table is not looked up by the module's rows
        ParamTransform::Transpose => Vec::new(),
    };
    if rows.is_empty() {
        return;
    }
    let rank = graph.value(table).data.as_ref().map_or(2, |d| d.dims.len() as i64);
    let lookups: Vec<NodeId> = graph
        .node_ids()
        .filter(|&n| {
            let node = graph.node(n);
            let axis = node.attrs.int("axis", 0);
            node.op.is(OpKind::Gather) && node.inputs.first() == Some(&Some(table)) && (axis == 0 || axis == -rank)
        })
        .collect();
    for n in lookups {
        graph.node_mut(n).attrs.set(PADDING_ROWS, Attr::Ints(rows.clone()));
    }
}

/// A new initializer holding the distinct rows the gather-members of one parameter hold, in
/// increasing row order; returns it and those row numbers.
fn distinct_rows(graph: &mut Graph, members: &[ValueId], param: &str) -> Result<(ValueId, Vec<i64>), PassError> {
    let mut rows: BTreeMap<i64, Vec<u8>> = BTreeMap::new();
    let mut proto: Option<(DType, Vec<i64>)> = None;
    for &m in members {
        let Some(ParamTransform::Gather { dims, rows: idx }) = graph.value(m).record.as_ref().map(|r| r.transform.clone()) else {
            continue;
        };
        let data = graph.value(m).data.clone().ok_or_else(|| bad_record(graph, m, "no data".into()))?;
        let Storage::Raw(bytes) = &data.storage else {
            return Err(bad_record(graph, m, "gathered rows must be stored inline".into()));
        };
        let tail: Vec<i64> = data.dims.get(dims.len()..).unwrap_or(&[]).to_vec();
        if data.dims.get(..dims.len()) != Some(dims.as_slice()) {
            return Err(bad_record(graph, m, format!("`smp.gather` dims {dims:?} do not lead its dims {:?}", data.dims)));
        }
        let row_bytes = tail.iter().product::<i64>() as usize * data.dtype.size_bytes() as usize;
        for (i, r) in idx.iter().enumerate() {
            let chunk = bytes.get(i * row_bytes..(i + 1) * row_bytes).ok_or_else(|| bad_record(graph, m, "data shorter than its rows".into()))?;
            rows.entry(*r).or_insert_with(|| chunk.to_vec());
        }
        proto.get_or_insert((data.dtype, tail));
    }
    let (dtype, tail) =
        proto.ok_or_else(|| PassError::ParamRecord { value: param.to_string(), msg: "no initializer holds its gathered rows".into() })?;
    let mut dims = vec![rows.len() as i64];
    dims.extend(&tail);
    let bytes: Vec<u8> = rows.values().flatten().copied().collect();
    let held: Vec<i64> = rows.keys().copied().collect();
    let v = add_initializer(graph, param, Tensor { dtype, dims, storage: Storage::Raw(bytes.into()) })?;
    let aliases = members
        .iter()
        .find_map(|&m| graph.value(m).record.as_ref().map(|r| r.params[0].clone()))
        .unwrap_or_else(|| vec![param.to_string()]);
    graph.value_mut(v).record = Some(ParamRecord {
        kind: RecordKind::Parameter,
        params: vec![aliases],
        transform: ParamTransform::Gather { dims: vec![held.len() as i64], rows: held.clone() },
        sites: Vec::new(),
        persistent: true,
        trainable: members.iter().filter_map(|&m| graph.value(m).record.as_ref()).all(|r| r.trainable),
        padding_rows: padding_rows(graph, members),
    });
    Ok((v, held))
}

/// Input slots that carry shapes, indices or conditions, never data a weight would be.
fn is_shape_slot(op: &Op, slot: usize) -> bool {
    use OpKind::*;
    match op.kind() {
        Some(Reshape | Expand | Tile | Unsqueeze | Squeeze | Split | Gather | GatherElements | GatherND) => slot >= 1,
        Some(Slice | Pad | Range | ConstantOfShape) => true,
        Some(Where) => slot == 0,
        Some(k) if k.is_reduction() => slot >= 1,
        Some(Resize) => slot >= 1,
        Some(OneHot) => slot == 1,
        _ => false,
    }
}

/// The fixed batch and sequence of the integer (token) inputs, and the fixed batch of any input.
fn fixed_dims(graph: &Graph) -> (Option<i64>, Option<i64>) {
    let mut batch = None;
    let mut seq = None;
    for &i in &graph.inputs {
        let Some(ty) = &graph.value(i).ty else { continue };
        let Some(shape) = &ty.shape else { continue };
        if let Some(Dim::Known(b)) = shape.0.first() {
            batch = batch.or(Some(*b));
        }
        if ty.dtype.is_int() && shape.rank() == 2 {
            if let Some(Dim::Known(s)) = shape.0.get(1) {
                seq = seq.or(Some(*s));
            }
        }
    }
    (batch.filter(|&b| b > 1), seq)
}

/// Widths of the rows of the tables the model looks rows up in (`Gather` of an initializer).
fn table_row_widths(graph: &Graph) -> Vec<i64> {
    let mut widths: Vec<i64> = graph
        .node_ids()
        .filter(|&n| graph.node(n).op.is(OpKind::Gather))
        .filter_map(|n| graph.node(n).inputs.first().copied().flatten())
        .filter(|&t| graph.value(t).kind == ValueKind::Initializer)
        .filter_map(|t| graph.value(t).data.as_ref().filter(|d| d.dims.len() == 2 && d.dtype.is_float()).map(|d| d.dims[1]))
        .collect();
    widths.sort_unstable();
    widths.dedup();
    widths
}

/// Whether an `Add`/`Sub` among `readers` adds `v` to an activation (a value computed from
/// the graph's inputs, not an initializer or constant).
fn added_to_activation(graph: &Graph, v: ValueId, readers: &[NodeId]) -> bool {
    readers.iter().any(|&n| {
        let node = graph.node(n);
        (node.op.is(OpKind::Add) || node.op.is(OpKind::Sub))
            && node.inputs.iter().flatten().any(|&x| x != v && matches!(graph.value(x).kind, ValueKind::Input | ValueKind::Intermediate))
    })
}

fn structural(graph: &mut Graph, plain: &[ValueId], summary: &mut ParamSummary) -> Result<(), PassError> {
    let users = readers(graph);
    let (batch, seq) = fixed_dims(graph);
    let widths = table_row_widths(graph);
    for &v in plain {
        if graph.value(v).data.as_ref().is_some_and(|d| d.dtype.is_float() && d.numel() > 1) {
            summary.without_record += 1;
        }
        if let Some(r) = legacy_frozen(graph, v) {
            graph.value_mut(v).training = Some(frozen(r));
            continue;
        }
        let readers_v = &users[v.index()];
        let only_shapes = !readers_v.is_empty()
            && readers_v.iter().all(|&n| {
                let node = graph.node(n);
                node.inputs.iter().enumerate().filter(|(_, x)| **x == Some(v)).all(|(s, _)| is_shape_slot(&node.op, s))
            });
        let data = graph.value(v).data.clone();
        let vals = data.as_ref().and_then(Tensor::to_f64_vec);
        let dims = data.as_ref().map(|t| t.dims.clone()).unwrap_or_default();
        let mask_values = vals.as_ref().is_some_and(|x| {
            dims.len() >= 2 && x.iter().all(|&e| e == 0.0 || e <= -1e4) && x.iter().any(|&e| e <= -1e4)
        });
        let rank = dims.len();
        // a weight a matmul contracts is no folded table, whatever its dims (stacked experts
        // [E, H, F] whose H equals the sequence)
        let contracted = !readers_v.is_empty() && readers_v.iter().all(|&n| graph.node(n).op.kind().is_some_and(|k| matches!(k, OpKind::MatMul | OpKind::Gemm)));
        let data_shaped = rank >= 3
            && !contracted
            && (batch.is_some_and(|b| dims[0] == b) || seq.is_some_and(|s| dims[rank - 2] == s))
            && dims[..rank - 2].iter().skip(1).all(|&d| d == 1 || batch == Some(d));
        if only_shapes || mask_values || data_shaped {
            graph.value_mut(v).training = Some(frozen(FrozenReason::MaskOrPosition));
            if data_shaped && !only_shapes && !mask_values {
                let suspect = Suspect {
                    name: graph.value(v).name.clone(),
                    dims: dims.clone(),
                    added_to_activations: added_to_activation(graph, v, readers_v),
                    table_rows: dims.last().is_some_and(|d| widths.contains(d)),
                };
                if suspect.added_to_activations || suspect.table_rows {
                    summary.suspects.push(suspect);
                }
            }
            continue;
        }
        let all_equal = vals.as_ref().is_some_and(|x| x.windows(2).all(|w| w[0] == w[1]));
        let name = graph.value(v).name.clone();
        let trained = |untied: Option<(String, usize)>, own: String| Training::Trained {
            names: vec![own],
            transform: ParamTransform::Identity,
            untied_from: untied,
            source: DecisionSource::Structure,
        };
        if all_equal && readers_v.len() > 1 {
            let n = readers_v.len();
            let Some(data) = data else { continue };
            for (k, &r) in readers_v.iter().enumerate().skip(1) {
                let c = add_initializer(graph, &format!("{name}#untied{k}"), data.clone())?;
                redirect(graph, &[r], v, c);
                let own = graph.value(c).name.clone();
                graph.value_mut(c).training = Some(trained(Some((name.clone(), n)), own));
            }
            graph.value_mut(v).training = Some(trained(Some((name.clone(), n)), name));
            summary.untied += 1;
            summary.copies += n - 1;
        } else {
            graph.value_mut(v).training = Some(trained(None, name));
        }
    }
    Ok(())
}

/// `*` (any run) and `?` (one character) glob match.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

fn apply_patterns(graph: &mut Graph, opts: &ParamOptions) -> Result<(), PassError> {
    if opts.trainable.is_empty() && opts.frozen.is_empty() {
        return Ok(());
    }
    // an initializer's own name and the module tensors it stands for
    let names_of = |graph: &Graph, v: ValueId| {
        let val = graph.value(v);
        let mut names = vec![val.name.clone()];
        if let Some(Training::Trained { names: n, .. }) = &val.training {
            names.extend(n.iter().cloned());
        }
        names
    };
    let every: Vec<String> = graph.initializers().flat_map(|v| names_of(graph, v)).collect();
    for (flag, patterns) in [("--frozen", &opts.frozen), ("--trainable", &opts.trainable)] {
        if let Some(p) = patterns.iter().find(|p| !every.iter().any(|n| glob(p, n))) {
            return Err(unmatched(flag, p, &every));
        }
    }
    for v in graph.initializers().collect::<Vec<_>>() {
        let names = names_of(graph, v);
        let hit = |pats: &[String]| pats.iter().any(|p| names.iter().any(|n| glob(p, n)));
        if hit(&opts.frozen) {
            graph.value_mut(v).training = Some(frozen(FrozenReason::Pattern));
        } else if hit(&opts.trainable) && !is_trained(graph, v) && legacy_frozen(graph, v) != Some(FrozenReason::NotAWeight) {
            graph.value_mut(v).training = Some(Training::Trained {
                names: vec![graph.value(v).name.clone()],
                transform: ParamTransform::Identity,
                untied_from: None,
                source: DecisionSource::Pattern,
            });
        }
    }
    Ok(())
}

/// The error for `pattern` of `flag` matching none of `names`: the name sharing the longest
/// literal prefix with it, and why when that name is a mixture of experts' stacked weight.
fn unmatched(flag: &'static str, pattern: &str, names: &[String]) -> PassError {
    let literal: String = pattern.chars().take_while(|c| !matches!(c, '*' | '?')).collect();
    let shared = |n: &String| n.chars().zip(literal.chars()).take_while(|(a, b)| a == b).count();
    let nearest = names.iter().max_by_key(|n| (shared(n), std::cmp::Reverse(n.len()))).cloned().unwrap_or_default();
    // the front door stacks per-expert weights into one tensor per block (`smp.stacked`)
    let stacked = ["gate_up_proj", "down_proj"].iter().any(|w| nearest.ends_with(w)) && !literal.starts_with(&nearest);
    let hint = if stacked {
        format!(": `{nearest}` holds every expert of its block stacked, and a stacked weight is trained or frozen whole; name it (or its block's experts with `*`) to freeze them all")
    } else {
        String::new()
    };
    PassError::PatternMatchesNothing { flag, pattern: pattern.to_string(), nearest, hint }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::Builder;

    /// An in-memory f32 initializer.
    fn init(b: &mut Builder, name: &str, dims: &[i64], vals: &[f32]) -> ValueId {
        let t = Tensor::from_f32(dims.to_vec(), vals);
        let ty = crate::ir::TensorType { dtype: DType::F32, shape: Some(crate::ir::Shape::from_known(dims)) };
        b.g.add_value(name, ValueKind::Initializer, Some(ty), Some(t)).unwrap()
    }

    fn record(params: &[&str], transform: ParamTransform, sites: &[&[&str]]) -> ParamRecord {
        ParamRecord {
            kind: RecordKind::Parameter,
            params: params.iter().map(|p| vec![p.to_string()]).collect(),
            transform,
            sites: sites.iter().map(|s| s.iter().map(|x| x.to_string()).collect()).collect(),
            persistent: true,
            trainable: true,
            padding_rows: Vec::new(),
        }
    }

    #[test]
    fn a_parameter_the_module_holds_frozen_is_loaded_but_not_trained() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["2", "2"]);
        let w = init(&mut b, "w", &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let u = init(&mut b, "u", &[2, 2], &[5.0, 6.0, 7.0, 8.0]);
        let h = b.node(OpKind::MatMul, &[x, w], &[]);
        let y = b.node(OpKind::MatMul, &[h, u], &[]);
        b.output(y);
        b.g.value_mut(w).record = Some(ParamRecord { trainable: false, ..record(&["pos.weight"], ParamTransform::Identity, &[]) });
        b.g.value_mut(u).record = Some(record(&["fc.weight"], ParamTransform::Identity, &[]));
        let summary = decide(&mut b.g, &ParamOptions::default()).unwrap();
        assert_eq!(b.g.value(w).training, Some(frozen(FrozenReason::Module)));
        assert_eq!(trained_names(&b.g, u), vec!["fc.weight".to_string()]);
        assert_eq!((summary.trained_tensors, summary.frozen_tensors), (1, 1));
    }

    fn trained_names(g: &Graph, v: ValueId) -> Vec<String> {
        match &g.value(v).training {
            Some(Training::Trained { names, .. }) => names.clone(),
            other => panic!("`{}` is not trained: {other:?}", g.value(v).name),
        }
    }

    /// Two Mul nodes reading `w`; returns (builder, w, [mul nodes' outputs]).
    fn two_users(vals: &[f32]) -> (Builder, ValueId, [ValueId; 2]) {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["b", "4"]);
        let w = init(&mut b, "w", &[4], vals);
        let y1 = b.node(OpKind::Mul, &[x, w], &[]);
        let y2 = b.node(OpKind::Mul, &[y1, w], &[]);
        b.output(y2);
        (b, w, [y1, y2])
    }

    fn reader_of(g: &Graph, out: ValueId) -> Vec<ValueId> {
        let n = g.value(out).producer.unwrap();
        g.node(n).inputs.iter().flatten().copied().collect()
    }

    #[test]
    fn equal_valued_shared_initializer_is_untied_per_reader() {
        let (mut b, w, [y1, y2]) = two_users(&[1.0; 4]);
        let s = decide(&mut b.g, &ParamOptions::default()).unwrap();
        assert_eq!((s.untied, s.copies, s.trained_tensors), (1, 1, 2));
        let (a, c) = (reader_of(&b.g, y1)[1], reader_of(&b.g, y2)[1]);
        assert_eq!(a, w);
        assert_ne!(a, c, "each Mul reads its own copy");
        assert!(is_trained(&b.g, a) && is_trained(&b.g, c));
        // a second run changes nothing
        assert_eq!(decide(&mut b.g, &ParamOptions::default()).unwrap().copies, 0);
    }

    #[test]
    fn varied_shared_initializer_is_a_real_tie() {
        let (mut b, w, [y1, y2]) = two_users(&[1.0, 2.0, 3.0, 4.0]);
        let s = decide(&mut b.g, &ParamOptions::default()).unwrap();
        assert_eq!((s.untied, s.trained_tensors), (0, 1));
        assert_eq!(reader_of(&b.g, y1)[1], w);
        assert_eq!(reader_of(&b.g, y2)[1], w);
    }

    #[test]
    fn masks_and_patterns_freeze() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["b", "1", "2", "2"]);
        let m = init(&mut b, "val_7", &[1, 1, 2, 2], &[0.0, f32::MIN, 0.0, 0.0]);
        let w = init(&mut b, "scale", &[2], &[0.5, 2.0]);
        let y = b.node(OpKind::Add, &[x, m], &[]);
        let y = b.node(OpKind::Mul, &[y, w], &[]);
        b.output(y);
        let opts = ParamOptions { frozen: vec!["sc*".into()], ..Default::default() };
        decide(&mut b.g, &opts).unwrap();
        assert_eq!(b.g.value(m).training, Some(Training::Frozen { reason: FrozenReason::MaskOrPosition }));
        assert_eq!(b.g.value(w).training, Some(Training::Frozen { reason: FrozenReason::Pattern }));
    }

    #[test]
    fn a_pattern_that_matches_nothing_is_refused_naming_the_nearest_parameter() {
        let build = || {
            let mut b = Builder::new();
            let x = b.input("x", DType::F32, &["2", "2"]);
            let w = init(&mut b, "mlp.experts.gate_up_proj", &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
            let u = init(&mut b, "mlp.fc.weight", &[2, 2], &[5.0, 6.0, 7.0, 8.0]);
            let h = b.node(OpKind::MatMul, &[x, w], &[]);
            let y = b.node(OpKind::MatMul, &[h, u], &[]);
            b.output(y);
            b
        };
        let refused = |frozen: &str| {
            let opts = ParamOptions { frozen: vec![frozen.into()], ..Default::default() };
            decide(&mut build().g, &opts).map(|_| ()).unwrap_err().to_string()
        };
        let err = refused("mlp.fc.bias");
        assert!(err.contains("--frozen 'mlp.fc.bias' matches no parameter") && err.contains("nearest name is `mlp.fc.weight`"), "{err}");
        assert!(!err.contains("stacked"), "{err}");
        // one expert of a stacked weight: frozen whole or not at all
        let err = refused("mlp.experts.3.*");
        assert!(err.contains("`mlp.experts.gate_up_proj` holds every expert of its block stacked"), "{err}");
        let trainable = ParamOptions { trainable: vec!["nothing*".into()], ..Default::default() };
        assert!(decide(&mut build().g, &trainable).unwrap_err().to_string().starts_with("--trainable 'nothing*'"));
        let ok = ParamOptions { frozen: vec!["mlp.experts.*".into()], ..Default::default() };
        decide(&mut build().g, &ok).expect("a pattern naming the stacked weight applies");
    }

    #[test]
    fn merged_record_is_untied_by_sites() {
        let (mut b, w, [y1, y2]) = two_users(&[0.0; 4]);
        let n2 = b.g.node(b.g.value(y2).producer.unwrap()).name.clone();
        let n1 = b.g.node(b.g.value(y1).producer.unwrap()).name.clone();
        b.g.value_mut(w).record = Some(record(&["h.0.bias", "h.1.bias"], ParamTransform::Identity, &[&[&n2], &[&n1]]));
        decide(&mut b.g, &ParamOptions::default()).unwrap();
        assert_eq!(trained_names(&b.g, reader_of(&b.g, y2)[1]), ["h.0.bias"]);
        let c = reader_of(&b.g, y1)[1];
        assert_eq!(trained_names(&b.g, c), ["h.1.bias"]);
        assert_eq!(b.g.value(c).name, "h.1.bias");
    }

    #[test]
    fn views_of_one_parameter_become_nodes() {
        let mut b = Builder::new();
        let ids = b.input("ids", DType::I64, &["2", "2"]);
        let emb = init(&mut b, "wte", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let emb_t = init(&mut b, "val_9", &[2, 3], &[1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
        // positions 0, 1 of a [4, 2] table, gathered for both samples
        let pos = init(&mut b, "embedding_1", &[2, 2, 2], &[7.0, 8.0, 9.0, 10.0, 7.0, 8.0, 9.0, 10.0]);
        b.g.value_mut(emb).record = Some(record(&["wte"], ParamTransform::Identity, &[]));
        b.g.value_mut(emb_t).record = Some(record(&["wte"], ParamTransform::Transpose, &[]));
        let rows = ParamTransform::Gather { dims: vec![2, 2], rows: vec![0, 1, 0, 1] };
        b.g.value_mut(pos).record = Some(record(&["wpe"], rows, &[]));
        let h = b.node(OpKind::Gather, &[emb, ids], &[]);
        let h = b.node(OpKind::Add, &[h, pos], &[]);
        let y = b.node(OpKind::MatMul, &[h, emb_t], &[]);
        b.output(y);
        let s = decide(&mut b.g, &ParamOptions::default()).unwrap();
        assert_eq!((s.views, s.trained_tensors), (2, 2));
        assert_eq!(b.g.value(emb_t).kind, ValueKind::Intermediate);
        let tr = b.g.node(b.g.value(emb_t).producer.unwrap());
        assert!(tr.op.is(OpKind::Transpose) && tr.inputs[0] == Some(emb));
        let ga = b.g.node(b.g.value(pos).producer.unwrap());
        assert!(ga.op.is(OpKind::Gather));
        let held = ga.inputs[0].unwrap();
        assert_eq!(b.g.value(held).data.as_ref().unwrap().dims, [2, 2]);
        match &b.g.value(held).training {
            Some(Training::Trained { names, transform: ParamTransform::Gather { rows, .. }, .. }) => {
                assert_eq!((names.as_slice(), rows.as_slice()), (&["wpe".to_string()][..], &[0i64, 1][..]));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(b.g.value(ga.inputs[1].unwrap()).data.as_ref().unwrap().to_i64_vec().unwrap(), [0, 1, 0, 1]);
        b.g.verify().unwrap();
    }

    #[test]
    fn padding_rows_mark_the_lookups_of_the_table_not_its_tied_head() {
        let mut b = Builder::new();
        let ids = b.input("ids", DType::I64, &["2", "2"]);
        let emb = init(&mut b, "wte", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let emb_t = init(&mut b, "val_9", &[2, 3], &[1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
        // rows 0, 2 of a [4, 2] position table gathered at export; row 2 is its padding row
        let pos = init(&mut b, "embedding_1", &[2, 2], &[7.0, 8.0, 9.0, 10.0]);
        b.g.value_mut(emb).record = Some(ParamRecord { padding_rows: vec![1], ..record(&["wte"], ParamTransform::Identity, &[]) });
        b.g.value_mut(emb_t).record = Some(record(&["wte"], ParamTransform::Transpose, &[]));
        let rows = ParamTransform::Gather { dims: vec![2], rows: vec![0, 2] };
        b.g.value_mut(pos).record = Some(ParamRecord { padding_rows: vec![2], ..record(&["wpe"], rows, &[]) });
        let h = b.node(OpKind::Gather, &[emb, ids], &[]);
        let h = b.node(OpKind::Add, &[h, pos], &[]);
        let y = b.node(OpKind::MatMul, &[h, emb_t], &[]);
        b.output(y);
        decide(&mut b.g, &ParamOptions::default()).unwrap();
        let padding = |n: NodeId| b.g.node(n).attrs.ints(PADDING_ROWS).map(<[i64]>::to_vec);
        let lookup = b.g.node_ids().find(|&n| b.g.node(n).inputs.first() == Some(&Some(emb))
            && b.g.node(n).op.is(OpKind::Gather)).unwrap();
        assert_eq!(padding(lookup), Some(vec![1]));
        // the head reads the same tensor through a Transpose: it keeps its gradient
        let head = b.g.value(emb_t).producer.unwrap();
        assert_eq!(padding(head), None);
        // the gathered positions: row 2 of `wpe` is row 1 of the table holding rows 0 and 2
        let tie = b.g.value(pos).producer.unwrap();
        assert_eq!(padding(tie), Some(vec![1]));
        b.g.verify().unwrap();
    }

    #[test]
    fn glob_matches_like_a_shell() {
        assert!(glob("*.ln_*.weight", "model.h.0.ln_1.weight"));
        assert!(glob("a?c", "abc"));
        assert!(!glob("a?c", "abbc"));
        assert!(glob("*", ""));
        assert!(!glob("*.bias", "x.weight"));
    }
}
