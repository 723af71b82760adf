//! Tensor-parallel shards of a layer: what the tensor-split engine ([`crate::split`]) emits for
//! a layer, laid out per tensor rank (weight slices, rewrites, collectives by name), and the
//! rank's subgraph built from it ([`apply_shard`]).
//!
//! The result is a [`LayerShard`] per tensor rank: names and ranges, never weight data.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use super::collectives::{CollectiveInsert, CollectiveKind, GroupKind, InputRef, collective_node};
use crate::ir::{
    Attrs, DType, DimBindings, Graph, LayeredGraph, Node, NodeId, Op, OpKind, Shape, Storage,
    Tensor, TensorType, ValueId, ValueKind,
};
use crate::passes::shape_infer::{self, ShapeInfo};
use crate::split::emit::{Fresh, derived, i64_const};
use crate::split::{Engine, SplitPlan, Strategy, TensorCollective, emit_deferred_bias, emit_masked_gather};
pub use crate::split::{ConstantRewrite, NodeRewrite, PartialGradient, SplitError as CodegenError};

/// A slice of an initializer along one axis: the concatenation of `ranges` (start, end).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WeightSlice {
    /// Initializer name.
    pub initializer: String,
    /// Axis sliced.
    pub axis: usize,
    /// Half-open ranges along `axis`, concatenated in order.
    pub ranges: Vec<[u64; 2]>,
    /// Consecutive tensor ranks holding this same slice (grouped-query KV heads when the
    /// tensor degree exceeds the KV heads): ranks `r - r % replicas ..` share it, and its
    /// gradient is summed over them.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replicas: u64,
}

fn one() -> u64 {
    1
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

impl WeightSlice {
    /// Elements along `axis` this slice keeps.
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(|r| r[1].saturating_sub(r[0])).sum()
    }

    /// True if the slice keeps nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
/// What one tensor rank runs of one layer: the plan-file description of its shard.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerShard {
    /// Layer index.
    pub layer: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Tensor rank (0..tp).
    pub rank: usize,
    /// Initializers this rank holds a slice of (all others are replicated).
    pub weight_slices: Vec<WeightSlice>,
    /// Shape constants rewritten for the shard.
    pub constant_rewrites: Vec<ConstantRewrite>,
    /// Structural rewrites.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rewrites: Vec<NodeRewrite>,
    /// Collectives inserted.
    pub collectives: Vec<CollectiveInsert>,
    /// Gradients to all-reduce over the tensor group in the backward pass (forward unchanged).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial_gradients: Vec<PartialGradient>,
}

impl LayerShard {
    /// The unsharded layer (tp = 1): nothing sliced, rewritten or inserted.
    pub fn whole(layer: usize) -> LayerShard {
        LayerShard {
            layer,
            tp: 1,
            rank: 0,
            weight_slices: Vec::new(),
            constant_rewrites: Vec::new(),
            rewrites: Vec::new(),
            collectives: Vec::new(),
            partial_gradients: Vec::new(),
        }
    }
}

/// Shards layers of one analysed graph: the tensor-split engine's plans, laid out per rank.
pub struct Sharder<'a> {
    engine: Engine<'a>,
}

impl<'a> Sharder<'a> {
    /// Prepares to shard the layers of `lg`.
    pub fn new(lg: &'a LayeredGraph) -> Result<Sharder<'a>, CodegenError> {
        Ok(Sharder { engine: Engine::new(lg)? })
    }

    /// Turns sequence parallelism on or off for the shards this sharder makes (default off):
    /// each row-parallel all-reduce becomes a reduce-scatter over the tokens, token-wise ops
    /// after it run on the rank's tokens, and all-gathers restore whole values where needed.
    pub fn with_sequence_parallel(self, on: bool) -> Self {
        Sharder { engine: self.engine.with_sequence_parallel(on) }
    }

    /// The tensor-split engine behind it.
    pub fn engine(&self) -> &Engine<'a> {
        &self.engine
    }

    /// The `tp` shards of layer `layer`, rank 0 first. Weights that do not divide `tp` ways
    /// stay whole (see [`Sharder::shard_layer_strict`]).
    pub fn shard_layer(&self, layer: usize, tp: usize) -> Result<Vec<LayerShard>, CodegenError> {
        let plan = self.engine.plan(layer, tp)?;
        Ok(self.per_rank(&plan, layer, tp))
    }

    /// [`Sharder::shard_layer`], but a layer whose matmul weights or vocabulary table do not
    /// divide `tp` ways is an error naming them and the degrees up to 64 that do divide it.
    pub fn shard_layer_strict(&self, layer: usize, tp: usize) -> Result<Vec<LayerShard>, CodegenError> {
        let plan = self.engine.plan(layer, tp)?;
        let lg = self.engine.graph();
        if !plan.kept_whole.is_empty() {
            let weights = plan.kept_whole.iter().map(|&w| lg.graph.value(w).name.clone()).collect();
            let working = self.engine.working_degrees(layer, tp);
            let name = lg.layers[layer].name.clone();
            return Err(CodegenError::Indivisible { layer, name, tp, weights, working });
        }
        Ok(self.per_rank(&plan, layer, tp))
    }

    /// The `tp` shards of `layer` with the weights of the nodes named in `keep_whole`
    /// (matmuls and embedding lookups a plan chose to replicate) left whole, and the strategy
    /// realised per choosing node.
    pub fn shard_layer_keeping(&self, layer: usize, tp: usize, keep_whole: &[String]) -> Result<(Vec<LayerShard>, Vec<(String, Strategy)>), CodegenError> {
        let (plan, realised) = self.engine.plan_keeping(layer, tp, keep_whole)?;
        Ok((self.per_rank(&plan, layer, tp), realised))
    }

    fn per_rank(&self, plan: &SplitPlan, layer: usize, tp: usize) -> Vec<LayerShard> {
        let g = &self.engine.graph().graph;
        let collectives: Vec<CollectiveInsert> = plan.collectives.iter().map(|c| collective_insert(g, c)).collect();
        (0..tp).map(|r| for_rank(g, plan, &collectives, layer, tp, r)).collect()
    }
}

/// The plan-file form of a tensor-group collective.
fn collective_insert(g: &Graph, c: &TensorCollective) -> CollectiveInsert {
    let mut out = CollectiveInsert::after(g.value(c.value).name.clone(), c.op, GroupKind::Tensor);
    out.readers = c.readers.iter().map(|&(n, input)| InputRef { node: g.node(n).name.clone(), input }).collect();
    out.view = c.view.clone();
    out
}

/// Rank `rank`'s shard of a layer's plan.
fn for_rank(g: &Graph, plan: &SplitPlan, collectives: &[CollectiveInsert], layer: usize, tp: usize, rank: usize) -> LayerShard {
    let t = tp as i64;
    let r = rank as i64;
    let weight_slices = plan
        .weights
        .iter()
        .map(|(&w, s)| {
            let (t, r) = (t / s.rep, r / s.rep);
            WeightSlice {
                initializer: g.value(w).name.clone(),
                axis: s.axis,
                ranges: (0..s.outer).map(|o| [((o * t + r) * s.inner) as u64, ((o * t + r + 1) * s.inner) as u64]).collect(),
                replicas: s.rep as u64,
            }
        })
        .collect();
    let mut rewrites = plan.rewrites.clone();
    for (node, table) in &plan.gathers {
        let s = plan.weights[table];
        rewrites.push(NodeRewrite::MaskedGather { node: node.clone(), start: r * s.inner, end: (r + 1) * s.inner });
    }
    LayerShard {
        layer,
        tp,
        rank,
        weight_slices,
        constant_rewrites: plan.constant_rewrites.clone(),
        rewrites,
        collectives: collectives.to_vec(),
        partial_gradients: plan.partial_gradients.clone(),
    }
}

/// The `tp` shards of every layer of `lg` (index: layer, then rank).
pub fn shard_all(lg: &LayeredGraph, tp: usize) -> Result<Vec<Vec<LayerShard>>, CodegenError> {
    let s = Sharder::new(lg)?;
    (0..lg.layers.len()).map(|l| s.shard_layer(l, tp)).collect()
}

/// The values a node set reads from outside and produces for outside (graph outputs included).
pub fn layer_boundary(graph: &Graph, nodes: &[NodeId]) -> (Vec<ValueId>, Vec<ValueId>) {
    let set: HashSet<NodeId> = nodes.iter().copied().collect();
    let uses = graph.uses();
    let mut inputs = Vec::new();
    let mut seen = HashSet::new();
    let mut outputs = Vec::new();
    for &n in nodes {
        let node = graph.node(n);
        for v in node.inputs.iter().flatten() {
            let val = graph.value(*v);
            let outside = val.producer.is_none_or(|p| !set.contains(&p));
            if outside && val.kind == ValueKind::Intermediate || val.kind == ValueKind::Input {
                if seen.insert(*v) {
                    inputs.push(*v);
                }
            }
        }
        for &o in &node.outputs {
            if graph.outputs.contains(&o) || uses[o.index()].iter().any(|u| !set.contains(u)) {
                outputs.push(o);
            }
        }
    }
    (inputs, outputs)
}

/// Slices `t` along `axis` to the concatenation of `ranges` (inline data only).
pub fn slice_tensor(t: &Tensor, axis: usize, ranges: &[[u64; 2]]) -> Option<Tensor> {
    let dims = &t.dims;
    if axis >= dims.len() {
        return None;
    }
    let len: u64 = ranges.iter().map(|r| r[1] - r[0]).sum();
    let mut new_dims = dims.clone();
    new_dims[axis] = len as i64;
    let size = t.dtype.size_bytes() as usize;
    let raw = t.raw()?;
    let outer: usize = dims[..axis].iter().map(|&d| d as usize).product();
    let inner: usize = dims[axis + 1..].iter().map(|&d| d as usize).product::<usize>() * size;
    let d = dims[axis] as usize;
    let mut out = Vec::with_capacity(outer * len as usize * inner);
    for o in 0..outer {
        for r in ranges {
            let (s, e) = (r[0] as usize, r[1] as usize);
            if e > d || s > e {
                return None;
            }
            out.extend_from_slice(raw.get((o * d + s) * inner..(o * d + e) * inner)?);
        }
    }
    Some(Tensor { dtype: t.dtype, dims: new_dims, storage: Storage::Raw(out.into()) })
}

/// Builds the rank's subgraph of a layer: weights sliced, constants rewritten, rewrites
/// applied (the family files' emission rules in `split`), collectives inserted as typed
/// `Op::Collective` nodes; shape-inferred and verified.
///
/// Integer inputs the shard needs for its shapes (shape arithmetic that depends on the batch
/// or sequence, computed by an earlier layer) stay inputs; inference evaluates them at the
/// bound dims.
pub fn apply_shard(graph: &Graph, layer_nodes: &[NodeId], shard: &LayerShard, dims: &DimBindings) -> Result<Graph, CodegenError> {
    let info = shape_infer::infer(graph, &dims.values, false)?;
    apply_shard_with(graph, &info, layer_nodes, shard, dims)
}

impl Sharder<'_> {
    /// [`apply_shard`] for a layer of this sharder's graph (reuses its shape information).
    pub fn apply(&self, layer: usize, shard: &LayerShard) -> Result<Graph, CodegenError> {
        let lg = self.engine.graph();
        let l = lg.layers.get(layer).ok_or(CodegenError::NoLayer { layer, layers: lg.layers.len() })?;
        apply_shard_with(&lg.graph, self.engine.info(), &l.nodes, shard, &lg.dims)
    }
}

fn apply_shard_with(graph: &Graph, info: &ShapeInfo, layer_nodes: &[NodeId], shard: &LayerShard, dims: &DimBindings) -> Result<Graph, CodegenError> {
    let mut b = ShardBuild::new(graph, info, shard)?;
    let (inputs, outputs) = layer_boundary(graph, layer_nodes);
    for &v in &inputs {
        b.copy(v)?;
    }
    let node_by_name: HashMap<&str, NodeId> = layer_nodes.iter().map(|&n| (graph.node(n).name.as_str(), n)).collect();
    for c in &shard.constant_rewrites {
        if !node_by_name.contains_key(c.node.as_str()) {
            return Err(b.bad(format!("constant rewrite names node `{}`, which is not in the layer", c.node)));
        }
    }
    let mut topo: Vec<NodeId> = layer_nodes.to_vec();
    let pos: HashMap<NodeId, usize> = graph.topo_order()?.into_iter().enumerate().map(|(i, n)| (n, i)).collect();
    topo.sort_by_key(|n| pos.get(n).copied().unwrap_or(usize::MAX));
    for &nid in &topo {
        b.node(graph.node(nid))?;
    }
    b.check_collectives(&node_by_name)?;
    for o in outputs {
        let v = b.map[&o];
        b.g.outputs.push(v);
    }
    b.finish(dims)
}

/// One rank's subgraph of a layer in the making (see [`apply_shard`]).
struct ShardBuild<'a> {
    graph: &'a Graph,
    info: &'a ShapeInfo,
    shard: &'a LayerShard,
    g: Graph,
    slices: HashMap<&'a str, &'a WeightSlice>,
    /// Collectives every reader reads, by the value they combine.
    collect: HashMap<&'a str, &'a CollectiveInsert>,
    /// Collectives read only at some node inputs: (node, slot) → index into `shard.collectives`.
    scoped_at: HashMap<(&'a str, usize), usize>,
    /// Their results, once made.
    scoped_out: HashMap<usize, ValueId>,
    /// Model value → subgraph value.
    map: HashMap<ValueId, ValueId>,
    fresh: Fresh,
}

impl<'a> ShardBuild<'a> {
    fn new(graph: &'a Graph, info: &'a ShapeInfo, shard: &'a LayerShard) -> Result<ShardBuild<'a>, CodegenError> {
        let mut b = ShardBuild {
            graph,
            info,
            shard,
            g: Graph::new(format!("{}.layer{}.tp{}", graph.name, shard.layer, shard.rank)),
            slices: shard.weight_slices.iter().map(|s| (s.initializer.as_str(), s)).collect(),
            collect: shard.collectives.iter().filter(|c| c.readers.is_empty()).map(|c| (c.after_value.as_str(), c)).collect(),
            scoped_at: HashMap::new(),
            scoped_out: HashMap::new(),
            map: HashMap::new(),
            fresh: Fresh::default(),
        };
        for (i, c) in shard.collectives.iter().enumerate() {
            for r in &c.readers {
                if b.scoped_at.insert((r.node.as_str(), r.input), i).is_some() {
                    return Err(b.bad(format!("input {} of node `{}` is read through two collectives", r.input, r.node)));
                }
            }
        }
        for s in &shard.weight_slices {
            if graph.value_by_name(&s.initializer).is_none() {
                return Err(b.bad(format!("weight slice names `{}`, which the model does not have", s.initializer)));
            }
        }
        Ok(b)
    }

    fn bad(&self, msg: String) -> CodegenError {
        CodegenError::BadShard { layer: self.shard.layer, rank: self.shard.rank, msg }
    }

    fn full_shape(&self, v: ValueId) -> Option<Vec<i64>> {
        self.info.types[v.index()].as_ref().and_then(|t| t.shape.clone())
    }

    fn dtype_of(&self, v: ValueId) -> DType {
        self.info.types[v.index()].as_ref().map_or(DType::F32, |t| t.dtype)
    }

    /// The subgraph's copy of model value `v` from outside the layer: an initializer or
    /// constant (sliced to the rank's part where the shard slices it), or an input.
    fn copy(&mut self, v: ValueId) -> Result<ValueId, CodegenError> {
        if let Some(&m) = self.map.get(&v) {
            return Ok(m);
        }
        let val = self.graph.value(v);
        let (kind, mut ty, mut data) = match val.kind {
            ValueKind::Initializer | ValueKind::Constant => (val.kind, val.ty.clone(), val.data.clone()),
            _ => (ValueKind::Input, val.ty.clone(), None),
        };
        if let Some(s) = self.slices.get(val.name.as_str()) {
            let shape = ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(Shape::known).or_else(|| data.as_ref().map(|d| d.dims.clone()));
            let Some(mut shape) = shape else { return Err(self.bad(format!("`{}` has no known shape", val.name))) };
            if s.axis >= shape.len() || s.ranges.iter().any(|r| r[0] > r[1] || r[1] > shape[s.axis] as u64) {
                return Err(self.bad(format!("slice of `{}` along axis {} is out of range for shape {shape:?}", val.name, s.axis)));
            }
            shape[s.axis] = s.len() as i64;
            if let Some(d) = &data
                && let Storage::Raw(_) = d.storage
            {
                data = Some(slice_tensor(d, s.axis, &s.ranges).ok_or_else(|| self.bad(format!("cannot slice `{}`", val.name)))?);
            } else if data.is_some() {
                data = None;
            }
            let dtype = ty.as_ref().map(|t| t.dtype).or(data.as_ref().map(|d| d.dtype)).unwrap_or(DType::F32);
            ty = Some(TensorType { dtype, shape: Some(Shape::from_known(&shape)) });
        }
        let id = self.g.add_value(val.name.clone(), kind, ty, data)?;
        // the model's decision of what is trained (a learned scalar is trained on every rank)
        let copied = self.g.value_mut(id);
        (copied.training, copied.record) = (val.training.clone(), val.record.clone());
        if kind == ValueKind::Input {
            self.g.inputs.push(id);
        }
        self.map.insert(v, id);
        Ok(id)
    }

    /// What `node` reads at `slot` (model value `v`): through the collective scoped to that
    /// input, a rewritten constant, or a shape divided at run time.
    fn operand(&mut self, node: &'a Node, slot: usize, v: ValueId) -> Result<ValueId, CodegenError> {
        let mut id = self.copy(v)?;
        if let Some(&ci) = self.scoped_at.get(&(node.name.as_str(), slot)) {
            id = match self.scoped_out.get(&ci) {
                Some(&x) => x,
                None => {
                    let c = &self.shard.collectives[ci];
                    if self.graph.value(v).name != c.after_value {
                        return Err(self.bad(format!("collective on `{}` names input {slot} of `{}`, which reads `{}`", c.after_value, node.name, self.graph.value(v).name)));
                    }
                    let name = self.fresh.name(&c.after_value, c.kind.name());
                    let out = self.g.add_value(format!("{name}.out"), ValueKind::Intermediate, None, None)?;
                    let (shape, dtype) = (self.full_shape(v), self.dtype_of(v));
                    emit_collective(&mut self.g, c, &name, id, out, shape.as_deref(), dtype, self.shard.tp, node.order)?;
                    self.scoped_out.insert(ci, out);
                    out
                }
            };
        }
        if let Some(c) = self.shard.constant_rewrites.iter().find(|c| c.node == node.name && c.input == slot) {
            let val = self.graph.value(v);
            let dtype = val.data.as_ref().map_or(DType::I64, |d| d.dtype);
            let dims = val.data.as_ref().map_or(vec![c.new_values.len() as i64], |d| d.dims.clone());
            let t = crate::passes::fold::int_tensor(dtype, dims.clone(), &c.new_values);
            id = self.g.add_value(self.fresh.name(&val.name, "tp"), ValueKind::Constant, Some(TensorType { dtype, shape: Some(Shape::from_known(&dims)) }), Some(t))?;
        }
        for r in &self.shard.rewrites {
            if let NodeRewrite::DivideShape { node: rn, input, divisors } = r
                && *rn == node.name
                && *input == slot
            {
                let d = i64_const(&mut self.g, self.fresh.name(&node.name, "divisors"), divisors)?;
                let out = self.g.add_value(self.fresh.name(&node.name, "shape"), ValueKind::Intermediate, None, None)?;
                self.g.add_node(derived(node, self.fresh.name(&node.name, "divide_shape"), OpKind::Div, vec![id, d], out))?;
                id = out;
            }
        }
        Ok(id)
    }

    /// Emits `node` as the shard has it: masked (a vocabulary-split lookup), with its bias
    /// deferred past the collective (a row-split Gemm), or as it is; then the collectives that
    /// combine its outputs.
    fn node(&mut self, node: &'a Node) -> Result<(), CodegenError> {
        let mut inputs: Vec<Option<ValueId>> = Vec::with_capacity(node.inputs.len());
        for (slot, v) in node.inputs.iter().enumerate() {
            inputs.push(match *v {
                Some(v) => Some(self.operand(node, slot, v)?),
                None => None,
            });
        }
        let defer = self.shard.rewrites.iter().any(|r| matches!(r, NodeRewrite::DeferBias { node: n } if *n == node.name));
        let masked = self.shard.rewrites.iter().find_map(|r| match r {
            NodeRewrite::MaskedGather { node: n, start, end } if *n == node.name => Some((*start, *end)),
            _ => None,
        });
        // an output a collective combines: the node makes `{name}.local`, the collective `name`
        let mut outs = Vec::with_capacity(node.outputs.len());
        let mut after: Vec<(ValueId, ValueId, ValueId)> = Vec::new();
        for &o in &node.outputs {
            let val = self.graph.value(o);
            if self.collect.contains_key(val.name.as_str()) {
                let local = self.g.add_value(format!("{}.local", val.name), ValueKind::Intermediate, None, None)?;
                let full = self.g.add_value(val.name.clone(), ValueKind::Intermediate, val.ty.clone(), None)?;
                self.map.insert(o, full);
                outs.push(local);
                after.push((local, full, o));
            } else {
                let id = self.g.add_value(val.name.clone(), ValueKind::Intermediate, None, None)?;
                self.map.insert(o, id);
                outs.push(id);
            }
        }
        let bias = inputs.get(2).copied().flatten();
        if let Some(rows) = masked {
            let (Some(table), Some(ids)) = (inputs.first().copied().flatten(), inputs.get(1).copied().flatten()) else {
                return Err(self.bad(format!("masked gather `{}` lacks operands", node.name)));
            };
            let id_dtype = self.graph.value(node.inputs[1].unwrap_or(node.outputs[0])).ty.as_ref().map_or(DType::I64, |t| t.dtype);
            emit_masked_gather(&mut self.g, node, (table, ids), outs[0], rows, id_dtype, &self.fresh)?;
        } else if let (true, true, Some(bias)) = (defer, node.op.is(OpKind::Gemm), bias) {
            // the bias joins after the collective; until then the local output is the bias-free sum
            let Some(&(_, full, o)) = after.first() else {
                return Err(self.bad(format!("Gemm `{}` defers its bias but nothing reduces its output", node.name)));
            };
            let c = self.collect[self.graph.value(o).name.as_str()];
            let (shape, dtype, tp) = (self.full_shape(o), self.dtype_of(o), self.shard.tp);
            let fresh = &self.fresh;
            let reduce = |g: &mut Graph, partial: ValueId, reduced: ValueId| {
                emit_collective(g, c, &fresh.name(&node.name, c.kind.name()), partial, reduced, shape.as_deref(), dtype, tp, node.order)
            };
            emit_deferred_bias(&mut self.g, node, (&inputs[..2], bias), (self.graph.value(o).ty.clone(), full), fresh, reduce)?;
            after.clear();
        } else {
            let mut attrs = node.attrs.clone();
            if self.shard.rewrites.iter().any(|r| matches!(r, NodeRewrite::ShareExpertBias { node: n } if *n == node.name)) {
                attrs.set("down_bias_share", crate::ir::Attr::Int(self.shard.tp as i64));
            }
            self.g.add_node(Node { name: node.name.clone(), op: node.op.clone(), attrs, inputs, outputs: outs, namespace: node.namespace.clone(), order: node.order })?;
        }
        for (local, full, o) in after {
            let c = self.collect[self.graph.value(o).name.as_str()];
            let name = self.fresh.name(&self.graph.value(o).name, c.kind.name());
            let (shape, dtype) = (self.full_shape(o), self.dtype_of(o));
            emit_collective(&mut self.g, c, &name, local, full, shape.as_deref(), dtype, self.shard.tp, node.order)?;
        }
        Ok(())
    }

    /// Every collective of the shard was placed: a scoped one at an input the layer reads, any
    /// other after a value the layer makes.
    fn check_collectives(&self, node_by_name: &HashMap<&str, NodeId>) -> Result<(), CodegenError> {
        let graph = self.graph;
        for (i, c) in self.shard.collectives.iter().enumerate() {
            if !c.readers.is_empty() {
                if !self.scoped_out.contains_key(&i) {
                    let r = &c.readers[0];
                    return Err(self.bad(format!("collective on `{}` names input {} of `{}`, which the layer does not read", c.after_value, r.input, r.node)));
                }
                continue;
            }
            let made_here = |v: ValueId| self.map.contains_key(&v) && graph.value(v).producer.is_some_and(|p| node_by_name.contains_key(graph.node(p).name.as_str()));
            if !graph.value_by_name(&c.after_value).is_some_and(made_here) {
                return Err(self.bad(format!("collective after `{}`, which the layer does not produce", c.after_value)));
            }
        }
        Ok(())
    }

    /// The verified subgraph, its values typed by inference on a probe where integer inputs
    /// are constants at the bound dims.
    fn finish(self, dims: &DimBindings) -> Result<Graph, CodegenError> {
        let mut g = self.g;
        g.verify()?;
        let mut probe = g.clone();
        let mut kept = Vec::new();
        for &v in &g.inputs {
            let global = self.graph.value_by_name(&g.value(v).name);
            let ints = global.and_then(|gv| self.info.ints(gv).map(|x| (gv, x)));
            match ints {
                Some((gv, vals)) => {
                    let ty = self.info.types[gv.index()].as_ref();
                    let dtype = ty.map_or(DType::I64, |t| t.dtype);
                    let shape = ty.and_then(|t| t.shape.clone()).unwrap_or_else(|| vec![vals.len() as i64]);
                    let val = probe.value_mut(v);
                    val.kind = ValueKind::Constant;
                    val.data = Some(crate::passes::fold::int_tensor(dtype, shape, vals));
                }
                None => kept.push(v),
            }
        }
        probe.inputs = kept;
        shape_infer::infer_shapes(&mut probe, dims)?;
        for v in g.value_ids().collect::<Vec<_>>() {
            if g.value(v).kind == ValueKind::Intermediate {
                g.value_mut(v).ty = probe.value(v).ty.clone();
            }
        }
        g.verify()?;
        Ok(g)
    }
}

/// Adds the nodes of collective `c` from `input` to `output`: the collective node, wrapped in
/// reshapes to and from its view if it has one. `full` is the model value's shape.
#[allow(clippy::too_many_arguments)]
fn emit_collective(
    g: &mut Graph,
    c: &CollectiveInsert,
    name: &str,
    input: ValueId,
    output: ValueId,
    full: Option<&[i64]>,
    dtype: DType,
    tp: usize,
    order: u32,
) -> Result<(), CodegenError> {
    let t = tp as i64;
    let splits = matches!(c.kind, CollectiveKind::ReduceScatter { .. } | CollectiveKind::Scatter { .. });
    let axis = c.kind.axis().unwrap_or(0);
    let Some(view) = &c.view else {
        // a collective's result has the declared type of the whole value, or its chunk
        let mut ty = g.value(output).ty.clone().or_else(|| full.map(|f| TensorType { dtype, shape: Some(Shape::from_known(f)) }));
        if splits {
            if let Some(shape) = ty.as_mut().and_then(|t| t.shape.as_mut())
                && let Some(d) = shape.0.get_mut(axis)
            {
                *d = match (d.known(), full.and_then(|f| f.get(axis))) {
                    (Some(k), _) | (None, Some(&k)) => crate::ir::Dim::Known(k / t),
                    _ => d.clone(),
                };
            }
        }
        g.value_mut(output).ty = ty;
        g.add_node(collective_node(name.to_string(), c.kind, c.group, input, output, order))?;
        return Ok(());
    };
    let bad = |m: &str| CodegenError::BadShard { layer: 0, rank: 0, msg: format!("collective on `{}`: {m}", c.after_value) };
    let full = full.ok_or_else(|| bad("its view needs the value's shape, which is unknown"))?;
    if axis >= view.len() || view[axis] <= 0 || view[axis] % t != 0 {
        return Err(bad(&format!("view {view:?} does not split {tp} ways along axis {axis}")));
    }
    let numel: i64 = full.iter().product();
    let known: i64 = view.iter().filter(|&&d| d != -1).product();
    let resolved: Vec<i64> = view.iter().map(|&d| if d == -1 { numel / known.max(1) } else { d }).collect();
    let mut in_target = view.clone();
    let mut out_view = resolved.clone();
    if splits {
        out_view[axis] /= t;
    } else {
        in_target[axis] /= t;
    }
    // back to the value's own layout: its entry holding the token chunk is left free
    let upto: i64 = resolved[..=axis].iter().product();
    let mut acc = 1;
    let k = full.iter().position(|&d| {
        acc *= d;
        acc >= upto
    });
    let mut back = full.to_vec();
    if let Some(k) = k {
        back[k] = -1;
    }
    let reshape = |g: &mut Graph, what: &str, x: ValueId, target: ValueId, out: ValueId| {
        g.add_node(Node {
            name: format!("{name}.{what}"),
            op: Op::Known(OpKind::Reshape),
            attrs: Attrs::default(),
            inputs: vec![Some(x), Some(target)],
            outputs: vec![out],
            namespace: None,
            order,
        })
    };
    let tin = i64_const(g, format!("{name}.view_shape"), &in_target)?;
    let vin = g.add_value(format!("{name}.view_in"), ValueKind::Intermediate, None, None)?;
    reshape(g, "view", input, tin, vin)?;
    let vout = g.add_value(format!("{name}.view_out"), ValueKind::Intermediate, Some(TensorType { dtype, shape: Some(Shape::from_known(&out_view)) }), None)?;
    g.add_node(collective_node(name.to_string(), c.kind, c.group, vin, vout, order))?;
    let tback = i64_const(g, format!("{name}.unview_shape"), &back)?;
    reshape(g, "unview", vout, tback, output)?;
    g.value_mut(output).ty = None;
    Ok(())
}
