//! Runs an `ir::Graph` forward on tch in topological order, with autograd, freeing each
//! intermediate after its last use.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};

use tch::{Device, Kind, Tensor};

use std::sync::Arc;

use crate::runtime::comm::ProcessGroup;
use super::context::ContextRank;
use super::ops::{self, DropoutKey, NormStats, OpContext};
use crate::ir::{CollectiveKind, GroupKind, Node, Op};
use super::tensor::kind_of;
use crate::passes::figures::is_trainable;
use crate::runtime::RuntimeError;
use crate::ir::{Dim, Graph, NodeId, ValueId, ValueKind};

/// The initializers of a graph as tch tensors, keyed by value id.
pub struct Weights {
    /// Tensor per initializer (and per folded constant of the graph).
    pub tensors: HashMap<ValueId, Tensor>,
}

/// How the executor runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExecOptions {
    /// Run every floating-point tensor in this kind (`--dtype`); `None` keeps the model's types.
    pub float_kind: Option<Kind>,
    /// Make trainable initializers autograd leaves.
    pub training: bool,
    /// Mixed precision: the low kind matrix products compute in, as `torch.autocast` does
    /// (weights stay in `float_kind`).
    pub autocast: Option<Kind>,
}

/// A graph ready to run: execution order, last uses, weights.
pub struct Executor<'g> {
    graph: &'g Graph,
    order: Vec<NodeId>,
    /// For each value: the position in `order` after which it is dead (`usize::MAX`: a graph
    /// output, kept; `None`: never read).
    last_use: Vec<Option<usize>>,
    ctx: OpContext,
    /// Initializers and constants as tensors (trainable ones require grad when training).
    pub weights: HashMap<ValueId, Tensor>,
    /// The tensor-parallel group that codegen's inserted collectives run over.
    pub tensor_group: Option<Arc<ProcessGroup>>,
    /// How the `MixtureOfExperts` nodes route their tokens (expert parallelism; unset: every
    /// expert is local and every token this rank's).
    expert_routing: std::cell::OnceCell<super::experts::ExpertRouting>,
    /// The statistics BatchNormalization uses in the next runs.
    norm: Cell<NormStats>,
    /// The key of the Dropout masks in the next runs (none: outside a training step).
    dropout: Cell<Option<DropoutKey>>,
    /// The context group the inserted context-parallel nodes run over, with this rank's place.
    context: std::cell::OnceCell<(Arc<ProcessGroup>, ContextRank)>,
    /// By node index: whether the node reaches a graph output (dead ones are skipped).
    live: Vec<bool>,
    /// Where float weights live and kernels run (`--device`).
    device: Device,
    /// By node index: the input slots the node may write its result over ([`scratch_operands`]).
    in_place: Vec<Vec<usize>>,
    /// While [`Executor::setting_aside_experts`] runs: the mixtures of experts (by name) whose
    /// experts' activations it sets aside, and what they made.
    set_aside: std::cell::RefCell<(std::collections::HashSet<String>, Vec<ops::moe::ExpertActivationParts>)>,
}

/// Lists the nodes without a kernel, or `Ok` if every node has one.
pub fn check_supported(graph: &Graph) -> Result<(), RuntimeError> {
    let mut missing: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for id in graph.node_ids() {
        let node = graph.node(id);
        if !ops::has_kernel(&node.op) && node.op.collective().is_none() {
            missing.entry(node.op.to_string()).or_default().push(node.name.clone());
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = missing
        .iter()
        .map(|(op, nodes)| {
            let shown: Vec<&str> = nodes.iter().take(3).map(String::as_str).collect();
            let more = if nodes.len() > 3 { format!(" and {} more", nodes.len() - 3) } else { String::new() };
            format!("op `{op}` at node(s) {}{more}", shown.join(", "))
        })
        .collect();
    Err(RuntimeError::Unsupported(list.join("; ")))
}

impl<'g> Executor<'g> {
    /// Prepares `graph`: checks every op has a kernel (before anything runs), orders the
    /// nodes, and takes the weights. Runs on the CPU.
    pub fn new(graph: &'g Graph, weights: Weights, opts: ExecOptions) -> Result<Executor<'g>, RuntimeError> {
        Self::new_on(graph, weights, opts, Device::Cpu)
    }

    /// [`Executor::new`] on `device`: float weights move there (integer and boolean constants,
    /// shape arithmetic's inputs, stay on the host until a kernel combines them with device
    /// tensors).
    pub fn new_on(graph: &'g Graph, weights: Weights, opts: ExecOptions, device: Device) -> Result<Executor<'g>, RuntimeError> {
        check_supported(graph)?;
        let live = crate::passes::dce::live_nodes(graph);
        // nodes that reach no graph output (e.g. the rest of a chain `passes::fuse` rewrote) never run
        let order: Vec<NodeId> = graph.topo_order()?.into_iter().filter(|n| live[n.index()]).collect();
        let mut last_use = vec![None; graph.value_count()];
        for (pos, &id) in order.iter().enumerate() {
            for v in graph.node(id).inputs.iter().flatten() {
                last_use[v.index()] = Some(pos);
            }
        }
        for &out in &graph.outputs {
            last_use[out.index()] = Some(usize::MAX);
        }
        let mut weights = weights.tensors;
        if device != Device::Cpu {
            for t in weights.values_mut() {
                if super::tensor::is_float_kind(t.kind()) && t.device() != device {
                    *t = t.f_to_device(device)?;
                }
            }
        }
        if opts.training {
            for (id, t) in weights.iter_mut() {
                if is_trainable(graph, *id) {
                    *t = t.f_detach()?.f_set_requires_grad(true)?;
                }
            }
        }
        let ctx = OpContext { float_kind: opts.float_kind, training: opts.training, norm: NormStats::Running, dropout: None, autocast: opts.autocast, context: None };
        let in_place = scratch_operands(graph);
        Ok(Executor { graph, order, last_use, ctx, weights, tensor_group: None, expert_routing: std::cell::OnceCell::new(), norm: Cell::new(NormStats::Running), dropout: Cell::new(None), context: std::cell::OnceCell::new(), live, device, in_place, set_aside: Default::default() })
    }

    /// Makes the `MixtureOfExperts` nodes route their tokens as `routing` says (expert
    /// parallelism: this rank's expert weights hold its experts alone). Set once.
    pub fn set_expert_routing(&self, routing: super::experts::ExpertRouting) {
        let _ = self.expert_routing.set(routing);
    }

    /// Makes the context-parallel nodes run over `pg` (this rank holding its tokens of every
    /// sequence). Set once.
    pub fn set_context_group(&self, pg: Arc<ProcessGroup>) {
        let me = ContextRank { index: pg.index(), size: pg.size() };
        let _ = self.context.set((pg, me));
    }

    /// This rank's place in its context group, under context parallelism.
    pub fn context_rank(&self) -> Option<ContextRank> {
        self.context.get().map(|c| c.1)
    }

    /// Sets the key Dropout masks are drawn from in the runs that follow (a training step's
    /// microbatch); `None` draws from the global generator.
    pub fn set_dropout_key(&self, key: Option<DropoutKey>) {
        self.dropout.set(key);
    }

    /// Sets the statistics BatchNormalization normalises with in the runs that follow: batch
    /// statistics in a training forward, running statistics in validation and inference.
    pub fn set_norm_stats(&self, norm: NormStats) {
        self.norm.set(norm);
    }

    /// Runs `f` (forwards of this executor), handing back the experts' activations the
    /// mixtures of experts named in `experts` made, and the silu(gate) of the SwiGLUs named there
    /// (selective recompute frees them and rebuilds them before the backward:
    /// [`ops::moe::ExpertActivationParts`]).
    pub(crate) fn setting_aside_experts<T>(&self, experts: std::collections::HashSet<String>, f: impl FnOnce() -> T) -> (T, Vec<ops::moe::ExpertActivationParts>) {
        *self.set_aside.borrow_mut() = (experts, Vec::new());
        let out = f();
        let (_, made) = std::mem::take(&mut *self.set_aside.borrow_mut());
        (out, made)
    }

    /// One node: a kernel, or a tensor-parallel collective over `tensor_group`.
    fn run_node(&self, node: &Node, inputs: &[Option<Tensor>]) -> Result<Vec<Tensor>, String> {
        let inside = node.op.kind().is_some_and(|k| k.recomputed_inside() || k.keeps_inside());
        if inside && self.set_aside.borrow().0.contains(&node.name) {
            let (out, made) = ops::moe::setting_aside(|| self.run_kernel(node, inputs));
            self.set_aside.borrow_mut().1.extend(made);
            return out;
        }
        self.run_kernel(node, inputs)
    }

    /// [`Executor::run_node`]'s work.
    fn run_kernel(&self, node: &Node, inputs: &[Option<Tensor>]) -> Result<Vec<Tensor>, String> {
        let ctx = OpContext { norm: self.norm.get(), dropout: self.dropout.get(), context: self.context_rank(), ..self.ctx };
        if let Some(routing) = self.expert_routing.get().filter(|_| node.op.is(crate::ir::OpKind::MixtureOfExperts)) {
            return super::experts::routed(node, inputs, &ctx, routing).map(|t| vec![t]);
        }
        let Op::Collective { kind, group } = node.op else {
            return ops::run(node, inputs, &ctx).map_err(|e| e.0);
        };
        let x = match inputs.first() {
            Some(Some(t)) => t,
            _ => return Err(format!("{} without an input", node.op)),
        };
        if group == GroupKind::Context {
            let (pg, me) = self.context.get().ok_or("a context-parallel node, but this run has no context group (cp = 1)")?;
            return match kind {
                CollectiveKind::TokenGather { axis, outer, seq } => super::context::gather(pg, x, axis, super::context::Blocks { outer, seq }),
                CollectiveKind::TokenLocalize { axis, outer, seq } => super::context::localize(x, axis, super::context::Blocks { outer, seq }, *me),
                other => Err(format!("{} over the context group has no runner kernel", other.name())),
            }
            .map(|t| vec![t]);
        }
        if group != GroupKind::Tensor {
            return Err(format!("collective over the `{group}` group inside a stage graph; only `tensor` is supported"));
        }
        let pg = self.tensor_group.as_ref().ok_or("a tensor-parallel collective, but this run has no tensor group (tp = 1)")?;
        // sums of low-precision partials are taken in fp32 and rounded once
        let widen = kind.sums() && matches!(x.kind(), Kind::Half | Kind::BFloat16);
        let wide;
        let x = if widen {
            wide = x.f_to_kind(Kind::Float).map_err(|e| e.to_string())?;
            &wide
        } else {
            x
        };
        let out = match kind {
            CollectiveKind::AllReduce => pg.reduce_from_tensor_region(x),
            CollectiveKind::CopyToRegion => pg.copy_to_tensor_region(x),
            CollectiveKind::AllGather { axis } => pg.gather_along_axis(x, axis as i64),
            CollectiveKind::ReduceScatter { axis } => pg.reduce_scatter_along_axis(x, axis as i64),
            CollectiveKind::Scatter { axis } => pg.scatter_along_axis(x, axis as i64),
            other => return Err(format!("{} over the tensor group has no runner kernel", other.name())),
        };
        let out = out.map_err(|e| e.to_string())?;
        let out = match inputs.first() {
            Some(Some(t)) if widen => out.f_to_kind(t.kind()).map_err(|e| e.to_string())?,
            _ => out,
        };
        Ok(vec![out])
    }

    /// The device float weights live on and kernels run on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The kind floats are run in (`--dtype`), if forced.
    pub fn float_kind(&self) -> Option<Kind> {
        self.ctx.float_kind
    }

    /// The low kind of a mixed-precision run's matrix products, if any.
    pub fn autocast(&self) -> Option<Kind> {
        self.ctx.autocast
    }

    /// The graph being run.
    pub fn graph(&self) -> &Graph {
        self.graph
    }

    /// The trainable parameters, by initializer name, in value order.
    pub fn parameters(&self) -> Vec<(String, Tensor)> {
        let mut ids: Vec<&ValueId> = self.weights.keys().filter(|id| is_trainable(self.graph, **id)).collect();
        ids.sort();
        ids.into_iter()
            .map(|id| (self.graph.value(*id).name.clone(), self.weights[id].shallow_clone()))
            .collect()
    }

    /// The graph inputs the caller must feed (initializers listed as inputs are optional).
    pub fn required_inputs(&self) -> Vec<ValueId> {
        self.graph
            .inputs
            .iter()
            .copied()
            .filter(|&v| self.graph.value(v).kind == ValueKind::Input)
            .collect()
    }

    /// [`Self::bind_inputs`] of the arrays of a data batch that are graph inputs (its labels
    /// and other arrays are not the model's); a required input no array feeds is named beside
    /// the arrays the batch has, as an array feeds the input of its name.
    pub fn bind_batch(&self, batch: &[(String, Tensor)]) -> Result<HashMap<ValueId, Tensor>, RuntimeError> {
        let graph = self.graph;
        for id in self.required_inputs() {
            batch_array(batch, &graph.value(id).name)?;
        }
        let is_input = |n: &str| graph.inputs.iter().any(|&v| graph.value(v).name == n);
        self.bind_inputs(batch.iter().filter(|(n, _)| is_input(n)).map(|(n, t)| (n.clone(), t.shallow_clone())).collect())
    }

    /// Matches named tensors to graph inputs, checking names, element types, ranks and known
    /// dims, and that a symbolic dim has one size across inputs.
    ///
    /// See [`Self::bind_batch`] for a data batch, whose other arrays are not the model's.
    pub fn bind_inputs(&self, named: Vec<(String, Tensor)>) -> Result<HashMap<ValueId, Tensor>, RuntimeError> {
        let graph = self.graph;
        let names: Vec<String> = graph.inputs.iter().map(|&v| graph.value(v).name.clone()).collect();
        let mut feeds = HashMap::new();
        let mut symbols: HashMap<String, (i64, String)> = HashMap::new();
        for (name, t) in named {
            let Some(id) = graph.value_by_name(&name).filter(|id| graph.inputs.contains(id)) else {
                return Err(RuntimeError::Input {
                    name,
                    message: format!("the graph has no such input; its inputs are {names:?}"),
                });
            };
            let ierr = |message: String| RuntimeError::Input { name: name.clone(), message };
            let mut t = t;
            if let Some(ty) = &graph.value(id).ty {
                let want = kind_of(ty.dtype).map_err(ierr)?;
                let have = t.kind();
                let float_ok = self.ctx.float_kind.is_some()
                    && super::tensor::is_float_kind(want)
                    && super::tensor::is_float_kind(have);
                if have != want && !float_ok {
                    return Err(ierr(format!("element type {have:?} given, the graph wants {}", ty.dtype)));
                }
                if let Some(shape) = &ty.shape {
                    let size = t.size();
                    if size.len() != shape.rank() {
                        return Err(ierr(format!("shape {size:?} given, the graph wants {shape}")));
                    }
                    for (i, d) in shape.0.iter().enumerate() {
                        match d {
                            Dim::Known(k) if *k != size[i] => {
                                return Err(ierr(format!(
                                    "shape {size:?} given, the graph wants {shape} (axis {i} must be {k})"
                                )));
                            }
                            Dim::Sym(s) => {
                                if let Some((v, other)) = symbols.get(s) {
                                    if *v != size[i] {
                                        return Err(ierr(format!(
                                            "axis {i} (`{s}`) is {} but input `{other}` has `{s}` = {v}",
                                            size[i]
                                        )));
                                    }
                                } else {
                                    symbols.insert(s.clone(), (size[i], name.clone()));
                                }
                            }
                            _ => {}
                        }
                    }
                }
            }
            if let Some(k) = self.ctx.float_kind {
                if super::tensor::is_float_kind(t.kind()) && t.kind() != k {
                    t = t.f_to_kind(k)?;
                }
            }
            feeds.insert(id, t);
        }
        for id in self.required_inputs() {
            if !feeds.contains_key(&id) {
                let given: Vec<String> = feeds.keys().map(|v| graph.value(*v).name.clone()).collect();
                return Err(RuntimeError::Input {
                    name: graph.value(id).name.clone(),
                    message: format!("missing; the given inputs are {given:?}"),
                });
            }
        }
        Ok(feeds)
    }

    /// Runs one node on the inputs `fetch` finds (fed, received, produced or weights); the
    /// one per-node step of [`Executor::run_nodes`] and [`Executor::forward`].
    /// `dead(v)`: whether input `v` is this run's own tensor and read by nothing after this
    /// node, so the node may write over it (see [`scratch_operands`]).
    fn step(&self, id: NodeId, fetch: impl Fn(ValueId) -> Option<Tensor>, dead: impl Fn(ValueId) -> bool) -> Result<Vec<Tensor>, RuntimeError> {
        let node = self.graph.node(id);
        let kerr = |message: String| RuntimeError::Kernel { node: node.name.clone(), op: node.op.to_string(), message };
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for v in &node.inputs {
            inputs.push(match v {
                Some(v) => Some(fetch(*v).ok_or_else(|| {
                    kerr(format!("input `{}` has no value (not fed or received, not an initializer)", self.graph.value(*v).name))
                })?),
                None => None,
            });
        }
        let inputs = self.placed(node, inputs).map_err(|e| kerr(e.to_string()))?;
        let slots = self.in_place.get(id.index()).map(Vec::as_slice).unwrap_or(&[]);
        if let Some(&slot) = slots.iter().find(|&&i| node.inputs[i].is_some_and(&dead)) {
            if let Some(out) = ops::run_in_place(node, &inputs, slot).map_err(|e| kerr(e.0))? {
                return Ok(vec![out]);
            }
        }
        let outs = self.run_node(node, &inputs).map_err(kerr)?;
        if outs.len() < node.outputs.len() {
            return Err(kerr(format!("kernel made {} outputs, the node has {}", outs.len(), node.outputs.len())));
        }
        Ok(outs)
    }

    /// On a GPU run, a node with an input on the GPU gets its host inputs there too (integer
    /// constants, masks made on the host), except those its kernel reads as host numbers.
    fn placed(&self, node: &Node, inputs: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>, tch::TchError> {
        if self.device == Device::Cpu {
            return Ok(inputs);
        }
        let Some(dev) = inputs.iter().flatten().map(Tensor::device).find(|d| d.is_cuda()) else {
            return Ok(inputs);
        };
        let kind = node.op.kind();
        inputs
            .into_iter()
            .enumerate()
            .map(|(i, t)| match t {
                Some(t) if t.device() != dev && !kind.is_some_and(|k| ops::reads_on_host(k, i)) => t.f_to_device(dev).map(Some),
                t => Ok(t),
            })
            .collect()
    }

    /// Runs `nodes` (a subset, in execution order) on `feeds` (values produced outside the
    /// subset); returns the values of `keep` (fed, weights, or produced by `nodes`).
    pub fn run_nodes(
        &self,
        nodes: &[NodeId],
        feeds: &HashMap<ValueId, Tensor>,
        keep: &[ValueId],
    ) -> Result<HashMap<ValueId, Tensor>, RuntimeError> {
        let graph = self.graph;
        let nodes: Vec<NodeId> = nodes.iter().copied().filter(|n| self.live.get(n.index()).copied().unwrap_or(true)).collect();
        let (nodes, batches) = gather_schedule(graph, &nodes, |n| self.context_gather_input(graph.node(n)));
        let mut last: HashMap<ValueId, usize> = HashMap::new();
        for (pos, &id) in nodes.iter().enumerate() {
            for v in graph.node(id).inputs.iter().flatten() {
                last.insert(*v, pos);
            }
        }
        for &v in keep {
            last.insert(v, usize::MAX);
        }
        let mut live: HashMap<ValueId, Tensor> = HashMap::new();
        let fetch = |live: &HashMap<ValueId, Tensor>, v: ValueId| -> Option<Tensor> {
            live.get(&v).or_else(|| feeds.get(&v)).or_else(|| self.weights.get(&v)).map(Tensor::shallow_clone)
        };
        // context all-gathers in flight, and which of them makes each gathered value
        let mut flying: Vec<Option<(Vec<NodeId>, super::context::PendingMany<'_>)>> = Vec::new();
        let mut landing: HashMap<ValueId, usize> = HashMap::new();
        let land = |i: usize, flying: &mut Vec<Option<(Vec<NodeId>, super::context::PendingMany<'_>)>>, live: &mut HashMap<ValueId, Tensor>| -> Result<(), RuntimeError> {
            let Some((members, pending)) = flying[i].take() else { return Ok(()) };
            let first = graph.node(members[0]);
            let got = pending.finish().map_err(|message| RuntimeError::Kernel { node: first.name.clone(), op: first.op.to_string(), message })?;
            for (&n, t) in members.iter().zip(got) {
                let v = graph.node(n).outputs[0];
                if last.contains_key(&v) {
                    live.insert(v, t);
                }
            }
            Ok(())
        };
        for (pos, &id) in nodes.iter().enumerate() {
            let node = graph.node(id);
            for v in node.inputs.iter().flatten() {
                if let Some(i) = landing.remove(v) {
                    land(i, &mut flying, &mut live)?;
                }
            }
            if self.context_gather_input(node).is_some() {
                // posted with its batch (at the batch's first node), landed where first read
                if let Some(batch) = batches.get(&id) {
                    for members in self.by_kind(batch, |v| fetch(&live, v)) {
                        let pending = self.gather_start(&members, |v| fetch(&live, v))?;
                        for &n in &members {
                            landing.insert(graph.node(n).outputs[0], flying.len());
                        }
                        flying.push(Some((members, pending)));
                    }
                }
            } else {
                let dead = |v: ValueId| live.contains_key(&v) && last.get(&v) == Some(&pos);
                let outs = self.step(id, |v| fetch(&live, v), dead)?;
                for (&v, t) in node.outputs.iter().zip(outs) {
                    if last.contains_key(&v) {
                        live.insert(v, t);
                    }
                }
            }
            for v in node.inputs.iter().flatten() {
                if last.get(v) == Some(&pos) {
                    live.remove(v);
                }
            }
        }
        for i in 0..flying.len() {
            land(i, &mut flying, &mut live)?;
        }
        keep.iter()
            .map(|&v| {
                let t = fetch(&live, v).ok_or_else(|| RuntimeError::Input {
                    name: graph.value(v).name.clone(),
                    message: "value kept from a stage was not computed".into(),
                })?;
                Ok((v, t))
            })
            .collect()
    }

    /// `batch`'s gathers grouped by their input's kind (one collective per kind), each group in
    /// batch order; groups in the order of their first member.
    fn by_kind(&self, batch: &[NodeId], fetch: impl Fn(ValueId) -> Option<Tensor>) -> Vec<Vec<NodeId>> {
        let mut groups: Vec<(Option<Kind>, Vec<NodeId>)> = Vec::new();
        for &n in batch {
            let kind = self.context_gather_input(self.graph.node(n)).and_then(&fetch).map(|t| t.kind());
            match groups.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, g)) => g.push(n),
                None => groups.push((kind, vec![n])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }

    /// The input of a context-parallel all-gather node, when this run has a context group.
    fn context_gather_input(&self, node: &Node) -> Option<ValueId> {
        self.context.get()?;
        match &node.op {
            Op::Collective { kind: CollectiveKind::TokenGather { .. }, .. } => node.inputs.first().copied().flatten(),
            _ => None,
        }
    }

    /// Posts the context all-gathers `nodes` as one collective.
    fn gather_start(&self, nodes: &[NodeId], fetch: impl Fn(ValueId) -> Option<Tensor>) -> Result<super::context::PendingMany<'_>, RuntimeError> {
        let first = self.graph.node(nodes[0]);
        let kerr = |message: String| RuntimeError::Kernel { node: first.name.clone(), op: first.op.to_string(), message };
        let (pg, _) = self.context.get().ok_or_else(|| kerr("no context group".into()))?;
        let mut xs = Vec::with_capacity(nodes.len());
        for &n in nodes {
            let node = self.graph.node(n);
            let x = self.context_gather_input(node).and_then(&fetch).ok_or_else(|| kerr(format!("`{}` has no input", node.name)))?;
            let Op::Collective { kind: CollectiveKind::TokenGather { axis, outer, seq }, .. } = node.op else {
                return Err(kerr(format!("`{}` is not a context all-gather", node.name)));
            };
            xs.push((x, axis, super::context::Blocks { outer, seq }));
        }
        super::context::gather_many_start(pg, &xs).map_err(kerr)
    }

    /// Runs the graph on bound inputs; returns the graph outputs in order.
    pub fn forward(&self, feeds: &HashMap<ValueId, Tensor>) -> Result<Vec<Tensor>, RuntimeError> {
        let graph = self.graph;
        let mut live: Vec<Option<Tensor>> = (0..graph.value_count()).map(|_| None).collect();
        let fetch = |live: &Vec<Option<Tensor>>, v: ValueId| -> Option<Tensor> {
            if let Some(t) = &live[v.index()] {
                return Some(t.shallow_clone());
            }
            feeds.get(&v).or_else(|| self.weights.get(&v)).map(Tensor::shallow_clone)
        };
        for (pos, &id) in self.order.iter().enumerate() {
            let node = graph.node(id);
            let dead = |v: ValueId| live[v.index()].is_some() && self.last_use[v.index()] == Some(pos);
            let outs = self.step(id, |v| fetch(&live, v), dead)?;
            for (&v, t) in node.outputs.iter().zip(outs) {
                live[v.index()] = Some(t);
            }
            for v in node.inputs.iter().flatten() {
                if self.last_use[v.index()] == Some(pos) {
                    live[v.index()] = None;
                }
            }
            for &v in &node.outputs {
                if self.last_use[v.index()].is_none() {
                    live[v.index()] = None;
                }
            }
        }
        graph
            .outputs
            .iter()
            .map(|&v| {
                fetch(&live, v).ok_or_else(|| RuntimeError::Input {
                    name: graph.value(v).name.clone(),
                    message: "graph output has no value".into(),
                })
            })
            .collect()
    }
}

/// By node index: the input slots whose value the node may write its result over, in place of
/// a new tensor: a slot the op allows ([`OpKind::in_place_operands`]) holding a value that a
/// scratch-making op produced ([`OpKind::output_is_scratch`]), that this node alone reads, once,
/// and that is no graph output. No backward then reads the value (its producer's does not, and
/// this node's saves nothing), so autograd keeps no copy the write would change; its views
/// could only come from its readers. At run time the value must also be the run's own tensor
/// at its last read (not fed, received or kept) and of the result's shape and type
/// ([`ops::run_in_place`]).
fn scratch_operands(graph: &Graph) -> Vec<Vec<usize>> {
    let mut reads = vec![0usize; graph.value_count()];
    let mut slots = Vec::new();
    for id in graph.node_ids() {
        for v in graph.node(id).inputs.iter().flatten() {
            reads[v.index()] += 1;
        }
        slots.resize(slots.len().max(id.index() + 1), Vec::new());
    }
    for &v in &graph.outputs {
        reads[v.index()] = usize::MAX;
    }
    let scratch = |v: ValueId| {
        let val = graph.value(v);
        reads[v.index()] == 1
            && val.kind == ValueKind::Intermediate
            && val.producer.is_some_and(|p| graph.node(p).op.kind().is_some_and(|k| k.output_is_scratch()))
    };
    for id in graph.node_ids() {
        let node = graph.node(id);
        let Some(kind) = node.op.kind() else { continue };
        slots[id.index()] = kind.in_place_operands().iter().copied().filter(|&i| node.inputs.get(i).copied().flatten().is_some_and(scratch)).collect();
    }
    slots
}

/// The order [`Executor::run_nodes`] runs `nodes` in, and its context all-gathers batched:
/// each batch keyed by its first gather, with every later gather whose input is made before
/// that gather (a layer's keys and values: one collective). Each batch is posted as soon as
/// its inputs exist: the nodes they are computed from move before it and the others of its
/// stretch (the queries' projection and rotary) after it, so they run while it travels.
/// Without gathers (`gather_input` gives a gather node's input), `nodes` as given. The same on every rank of
/// the group (it depends on the node list alone), so the collectives stay in step.
fn gather_schedule(graph: &Graph, nodes: &[NodeId], gather_input: impl Fn(NodeId) -> Option<ValueId>) -> (Vec<NodeId>, HashMap<NodeId, Vec<NodeId>>) {
    let gathers: Vec<usize> = (0..nodes.len()).filter(|&i| gather_input(nodes[i]).is_some()).collect();
    if gathers.is_empty() {
        return (nodes.to_vec(), HashMap::new());
    }
    let made_at: HashMap<ValueId, usize> = nodes.iter().enumerate().flat_map(|(i, &n)| graph.node(n).outputs.iter().map(move |&v| (v, i))).collect();
    let input_at = |i: usize| gather_input(nodes[i]).and_then(|v| made_at.get(&v).copied());
    let mut batched = vec![false; nodes.len()];
    let mut batches: Vec<(usize, Vec<usize>)> = Vec::new();
    for (k, &g) in gathers.iter().enumerate() {
        if batched[g] {
            continue;
        }
        let members: Vec<usize> = std::iter::once(g).chain(gathers[k + 1..].iter().copied().filter(|&h| !batched[h] && input_at(h).is_none_or(|p| p < g))).collect();
        for &m in &members {
            batched[m] = true;
        }
        batches.push((g, members));
    }
    let mut placed = vec![false; nodes.len()];
    let mut order = Vec::with_capacity(nodes.len());
    let mut from = 0;
    for (first, members) in &batches {
        // what the batch's inputs are computed from, within this stretch
        let mut needed = vec![false; nodes.len()];
        let mut stack: Vec<usize> = members.iter().filter_map(|&m| input_at(m)).collect();
        while let Some(i) = stack.pop() {
            if i < from || placed[i] || needed[i] {
                continue;
            }
            needed[i] = true;
            stack.extend(graph.node(nodes[i]).inputs.iter().flatten().filter_map(|v| made_at.get(v).copied()));
        }
        for i in (from..*first).filter(|&i| needed[i]).chain(members.iter().copied()).chain(from..*first) {
            if !placed[i] {
                placed[i] = true;
                order.push(nodes[i]);
            }
        }
        from = first + 1;
    }
    order.extend((from..nodes.len()).filter(|&i| !placed[i]).map(|i| nodes[i]));
    let keyed = batches.into_iter().map(|(first, members)| (nodes[first], members.into_iter().map(|m| nodes[m]).collect())).collect();
    (order, keyed)
}


/// The array of a data batch named `name` (a graph input's name); none is an input error naming
/// the arrays the batch has and the fix.
pub fn batch_array<'b>(batch: &'b [(String, Tensor)], name: &str) -> Result<&'b Tensor, RuntimeError> {
    batch.iter().find(|(n, _)| n == name).map(|(_, t)| t).ok_or_else(|| {
        let has: Vec<&String> = batch.iter().map(|(n, _)| n).collect();
        RuntimeError::Input { name: name.to_string(), message: format!("no array of the data has its name; the data has {has:?}: name the array `{name}`") }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, DType, Shape, TensorType};

    /// Adds node `name` (`op`, `order`) reading `ins`; its one output.
    fn node(g: &mut Graph, name: &str, op: Op, order: u32, ins: &[ValueId]) -> (NodeId, ValueId) {
        let ty = Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[2, 4])) });
        let out = g.add_value(format!("{name}.out"), ValueKind::Intermediate, ty, None).unwrap();
        let n = Node { name: name.into(), op, attrs: Attrs::default(), inputs: ins.iter().map(|&v| Some(v)).collect(), outputs: vec![out], namespace: None, order };
        (g.add_node(n).unwrap(), out)
    }

    #[test]
    fn only_a_sum_over_scratch_that_nothing_else_reads_may_write_in_place() {
        use crate::ir::OpKind::{Add, MatMul, Sigmoid, Sub};
        let mut g = Graph::new("scratch");
        let ty = Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[2, 4])) });
        let x = g.add_value("x", ValueKind::Input, ty, None).unwrap();
        g.inputs.push(x);
        let (_, y) = node(&mut g, "y", Op::Known(MatMul), 1, &[x, x]);
        let (a, _) = node(&mut g, "a", Op::Known(Add), 2, &[x, y]);
        let (_, s) = node(&mut g, "s", Op::Known(Sigmoid), 3, &[x]);
        let (b, _) = node(&mut g, "b", Op::Known(Add), 4, &[s, x]);
        let (_, y2) = node(&mut g, "y2", Op::Known(MatMul), 5, &[x, x]);
        let (c, _) = node(&mut g, "c", Op::Known(Sub), 6, &[x, y2]);
        let (_, y3) = node(&mut g, "y3", Op::Known(MatMul), 7, &[x, x]);
        let (d, _) = node(&mut g, "d", Op::Known(Add), 8, &[y3, x]);
        let (e, e_out) = node(&mut g, "e", Op::Known(Add), 9, &[y3, x]);
        let (_, y4) = node(&mut g, "y4", Op::Known(MatMul), 10, &[x, x]);
        let (f, _) = node(&mut g, "f", Op::Known(Add), 11, &[y4, e_out]);
        g.outputs.push(y4);
        let slots = scratch_operands(&g);
        assert_eq!(slots[a.index()], [1], "a product read once: the sum may write over it");
        assert!(slots[b.index()].is_empty(), "a sigmoid's backward reads its output");
        assert!(slots[c.index()].is_empty(), "a difference writes only over its minuend");
        assert!(slots[d.index()].is_empty() && slots[e.index()].is_empty(), "a product read twice");
        assert_eq!(slots[f.index()], [1], "not the product the graph returns; the sum e made (out of place) and only f reads");
    }

    #[test]
    fn a_sum_written_over_a_product_gives_the_same_numbers_and_gradients() {
        use crate::ir::OpKind::{Add, MatMul};
        let run = |keep_product: bool| {
            let mut g = Graph::new("residual");
            let ty = Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[2, 4])) });
            let x = g.add_value("x", ValueKind::Input, ty.clone(), None).unwrap();
            g.inputs.push(x);
            let wty = Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[4, 4])) });
            let w = g.add_value("w", ValueKind::Initializer, wty, None).unwrap();
            let (_, y) = node(&mut g, "proj", Op::Known(MatMul), 1, &[x, w]);
            let (_, z) = node(&mut g, "residual", Op::Known(Add), 2, &[x, y]);
            g.outputs.push(z);
            if keep_product {
                g.outputs.push(y);
            }
            let wt = Tensor::from_slice(&(0..16).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>()).reshape([4, 4]);
            let weights = Weights { tensors: HashMap::from([(w, wt)]) };
            let exec = Executor::new(&g, weights, ExecOptions { float_kind: Some(Kind::Double), ..Default::default() }).unwrap();
            let xt = Tensor::from_slice(&(0..8).map(|i| (i as f64 * 0.91).cos()).collect::<Vec<_>>()).reshape([2, 4]).set_requires_grad(true);
            let outs = exec.forward(&HashMap::from([(x, xt.shallow_clone())])).unwrap();
            let r = Tensor::from_slice(&[1.0f64, -2.0, 0.5, 3.0]);
            (&outs[0] * &r).sum(Kind::Double).backward();
            (outs[0].detach(), xt.grad(), outs[0].internal_version())
        };
        let (z, gx, version) = run(false);
        let (z_ref, gx_ref, version_ref) = run(true);
        assert_eq!(version, 1, "the sum wrote over the product");
        assert_eq!(version_ref, 0, "a product the graph returns is not written over");
        assert_eq!(f64::try_from((&z - &z_ref).abs().max()).unwrap(), 0.0);
        assert_eq!(f64::try_from((&gx - &gx_ref).abs().max()).unwrap(), 0.0);
    }

    #[test]
    fn a_layers_gathers_are_posted_once_keys_and_values_exist_and_the_queries_run_while_they_travel() {
        use crate::ir::OpKind::{Neg, Relu, Sum};
        let mut g = Graph::new("layer");
        let ty = Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[2, 4])) });
        let x = g.add_value("x", ValueKind::Input, ty, None).unwrap();
        g.inputs.push(x);
        let gather = Op::Collective { kind: CollectiveKind::TokenGather { axis: 0, outer: 1, seq: 4 }, group: GroupKind::Context };
        // exported order: q, k, v, k's rotary; the gathers scheduled with the attention
        let (nq, q) = node(&mut g, "q", Op::Known(Relu), 1, &[x]);
        let (nk, k) = node(&mut g, "k", Op::Known(Relu), 2, &[x]);
        let (nv, v) = node(&mut g, "v", Op::Known(Relu), 3, &[x]);
        let (nqr, qr) = node(&mut g, "q_rot", Op::Known(Neg), 4, &[q]);
        let (nkr, kr) = node(&mut g, "k_rot", Op::Known(Neg), 5, &[k]);
        let (gk, kw) = node(&mut g, "gather_k", gather.clone(), 6, &[kr]);
        let (gv, vw) = node(&mut g, "gather_v", gather.clone(), 6, &[v]);
        let (att, a) = node(&mut g, "attention", Op::Known(Sum), 6, &[qr, kw, vw]);
        // the next layer's keys, from the attention's output
        let (nk2, k2) = node(&mut g, "k2", Op::Known(Relu), 7, &[a]);
        let (g2, w2) = node(&mut g, "gather_k2", gather, 8, &[k2]);
        let (att2, _) = node(&mut g, "attention2", Op::Known(Sum), 8, &[w2, a]);
        let nodes = g.topo_order().unwrap();
        assert_eq!(nodes, [nq, nk, nv, nqr, nkr, gk, gv, att, nk2, g2, att2]);
        let input = |n: NodeId| matches!(g.node(n).op, Op::Collective { .. }).then(|| g.node(n).inputs[0].unwrap());
        let (order, batches) = gather_schedule(&g, &nodes, input);
        assert_eq!(order, [nk, nv, nkr, gk, gv, nq, nqr, att, nk2, g2, att2], "keys and values first, then the gathers, then the queries");
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[&gk], [gk, gv], "a layer's keys and values in one collective");
        assert_eq!(batches[&g2], [g2]);
        // without gathers, as given
        let (same, none) = gather_schedule(&g, &nodes, |_| None);
        assert_eq!(same, nodes);
        assert!(none.is_empty());
    }
}
