//! Context parallelism of a stage's graph: the tokens of every sequence split over the `c` ranks
//! of a context group. Causal load balance: the sequence is cut into `2c` equal chunks and rank
//! `r` holds chunks `r` and `2c − 1 − r` (a front and a back one), so every rank attends over
//! the same number of earlier tokens.
//!
//! The rewrite keeps the graph's meaning (every value is the one-process value) and records,
//! per value, whether a rank holds all of it ([`Tokens::Whole`], the same on every rank of the
//! group) or only its tokens along one axis ([`Tokens::Local`]). It follows the data:
//! - token ids (an integer `[batch, seq]` input that reaches an embedding lookup) are the seeds:
//!   each rank takes its tokens of them, so the residual stream is local from the embedding on;
//! - ops that work token by token (elementwise ops, norms and softmaxes over other axes, weight
//!   matmuls, reshapes and transposes that keep the tokens, slices, splits and concats along
//!   other axes, routed experts) run on the local tokens; a whole operand they combine with a
//!   local one along the token axis (positions, rotary tables, causal masks' rows) is cut to
//!   the rank's tokens, by a `TokenLocalize` op, without communication;
//! - attention is the one place a rank needs the others' tokens: the keys and values (`kᵀ` and
//!   `v` of the fused op, or the second operand of the score and value matmuls when attention
//!   did not fuse) are all-gathered over the group (a `TokenGather` op, whose backward is a
//!   reduce-scatter), so queries stay local and the mask's columns are whole;
//! - any other op reading a local value first gathers it (correct for every op, paid in
//!   communication); shapes computed from a local value are the one-process shapes.
//!
//! Reshape and Expand targets whose token entry is the global size shrink by `c`; Dropout on
//! local tokens draws the one-process mask and keeps the rank's rows of it.

use std::collections::{HashMap, HashSet};

use thiserror::Error;

use crate::ir::{Attr, Attrs, CollectiveKind, DType, DimBindings, Graph, GraphError, GroupKind, Node, NodeId, Op, OpKind, Shape, TensorType, ValueId, ValueKind};
use super::axes::norm_axis;
use super::family::{Family, family, opaque};
use crate::passes::PassError;
use crate::passes::shape_infer::{self, ShapeInfo};

/// Dropout attributes naming the token axis of a local input (and its `outer` blocks).
pub const DROPOUT_TOKEN_AXIS: &str = "context_axis";
/// See [`DROPOUT_TOKEN_AXIS`].
pub const DROPOUT_TOKEN_OUTER: &str = "context_outer";

/// Which tokens of a value a rank of the context group holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tokens {
    /// All of it (the same on every rank of the group).
    Whole,
    /// Its tokens along `axis`: the axis holds `outer` blocks of the sequence (tokens flattened
    /// with the batch into axis 0 have `outer` = batch), and the rank holds its tokens of each.
    Local {
        /// The token axis.
        axis: usize,
        /// Sequence blocks along it.
        outer: i64,
    },
}

/// Why a graph cannot be split over a context group.
#[derive(Debug, Error)]
pub enum ContextError {
    /// A node's operands do not line up with its local tokens.
    #[error("context parallelism: node `{node}` ({op}): {msg}")]
    Node {
        /// The node.
        node: String,
        /// Its op.
        op: String,
        /// What is wrong.
        msg: String,
    },
    /// The sequence does not cut into `2c` equal chunks.
    #[error("context parallelism over {cp} ranks cuts each sequence into {chunks} chunks, but value `{value}` has {len} tokens; choose a sequence length divisible by {chunks} or a smaller --cp")]
    Indivisible {
        /// The value.
        value: String,
        /// Its tokens per sequence.
        len: i64,
        /// The context degree.
        cp: usize,
        /// 2·cp.
        chunks: usize,
    },
    /// Shape inference failed.
    #[error("context parallelism: {0}")]
    Shapes(#[from] PassError),
    /// The rewrite made an invalid graph (a bug).
    #[error("context parallelism: {0}")]
    Graph(#[from] GraphError),
}

/// What a stage's graph is told of the values it receives and yields, from the model-wide
/// split.
#[derive(Clone, Debug, Default)]
pub struct Boundary {
    /// Tokens of received values (checked on yielded ones), by name.
    pub tokens: HashMap<String, Tokens>,
    /// Evaluated small integer values (shapes computed upstream), by name: dims and elements.
    pub ints: HashMap<String, (Vec<i64>, Vec<i64>)>,
}

/// A graph split over a context group.
pub struct ContextSplit {
    /// The rewritten graph (the same node and value ids, plus the inserted ones).
    pub graph: Graph,
    /// Each original value's tokens, by name.
    pub tokens: HashMap<String, Tokens>,
    /// The evaluated small integer values, by name (dims and elements).
    pub ints: HashMap<String, (Vec<i64>, Vec<i64>)>,
    /// All-gathers inserted.
    pub gathers: usize,
    /// Localizations inserted.
    pub localizes: usize,
}

/// Splits `graph` (shapes bound by `dims`) over a context group of `cp` ranks. `boundary` gives
/// the tokens of values made elsewhere (a stage's received inputs, from the model-wide split),
/// the form the caller needs its outputs in (a stage's yields, converted where they differ),
/// and the values of received integer tensors (shapes computed upstream).
pub fn split_context(graph: &Graph, dims: &DimBindings, cp: usize, boundary: &Boundary) -> Result<ContextSplit, ContextError> {
    let fixed = &boundary.tokens;
    // received shapes are known upstream: inferred as the constants they are
    let mut probe = graph.clone();
    for &v in &graph.inputs {
        if let Some((d, vals)) = boundary.ints.get(&graph.value(v).name) {
            let dtype = graph.value(v).ty.as_ref().map_or(DType::I64, |t| t.dtype);
            let val = probe.value_mut(v);
            val.kind = ValueKind::Constant;
            val.data = Some(crate::passes::fold::int_tensor(dtype, d.clone(), vals));
        }
    }
    let info = shape_infer::infer(&probe, &dims.values, false)?;
    let order = graph.topo_order()?;
    let uses = graph.uses();
    // a whole value every reader cuts the same way is made local where it is made (an
    // elementwise op on cut operands): masks and position tables are built for the rank's
    // rows only; repeated until nothing more moves upstream
    let mut forced: HashMap<ValueId, Tokens> = HashMap::new();
    let mut s = loop {
        let mut s = Splitter {
            g: graph,
            uses: &uses,
            info: info.clone(),
            cp: cp as i64,
            out: graph.clone(),
            tokens: vec![Tokens::Whole; graph.value_count()],
            current: HashMap::new(),
            converted: HashMap::new(),
            reads: HashMap::new(),
            forced: forced.clone(),
            counter: 0,
            gathers: 0,
            localizes: 0,
        };
        for &v in &graph.inputs {
            if let Some(&t) = fixed.get(&graph.value(v).name) {
                s.tokens[v.index()] = t;
            }
        }
        for v in s.token_inputs() {
            let t = Tokens::Local { axis: 1, outer: 1 };
            s.check_divides(v, t)?;
            let local = s.convert(v, Tokens::Whole, t, graph.value(v).name.clone(), 0)?;
            s.current.insert(v, local);
            s.tokens[v.index()] = t;
        }
        for &n in &order {
            s.node(n)?;
        }
        // and a local value every reader gathers, made by a view of a local one, is made whole
        // from the gathered input: keys and values are gathered before grouped-query attention
        // repeats their heads
        let gathered_views: Vec<(ValueId, Tokens)> = s
            .reads
            .iter()
            .filter_map(|(&v, forms)| {
                let [Tokens::Whole] = forms.as_slice() else { return None };
                let p = graph.value(v).producer?;
                let node = graph.node(p);
                let view = node.op.kind().is_some_and(moves_elements_only);
                let from_local = node.inputs.first().copied().flatten().is_some_and(|x| s.tokens[x.index()] != Tokens::Whole);
                (view && from_local && s.tokens[v.index()] != Tokens::Whole && !graph.outputs.contains(&v) && !forced.contains_key(&v)).then_some((v, Tokens::Whole))
            })
            .collect();
        let movable: Vec<(ValueId, Tokens)> = s
            .reads
            .iter()
            .filter_map(|(&v, forms)| {
                let [t @ Tokens::Local { .. }] = forms.as_slice() else { return None };
                let p = graph.value(v).producer?;
                let elementwise = graph.node(p).op.kind().is_some_and(|k| k.is_elementwise() || matches!(k, OpKind::Identity | OpKind::Expand | OpKind::ApplyRotary));
                (elementwise && s.tokens[v.index()] == Tokens::Whole && !graph.outputs.contains(&v) && !forced.contains_key(&v)).then_some((v, *t))
            })
            .collect();
        if (movable.is_empty() && gathered_views.is_empty()) || forced.len() > 4 * graph.value_count() {
            break s;
        }
        forced.extend(movable);
        forced.extend(gathered_views);
    };
    schedule_gathers_late(&mut s.out);
    // an output read through a stand-in (a shape made global), or held otherwise than the
    // model-wide split sends it, leaves under its name in the form the next stage expects
    let mut outputs = s.out.outputs.clone();
    for o in outputs.iter_mut() {
        let name = graph.value(*o).name.clone();
        let got = s.tokens[o.index()];
        let want = fixed.get(&name).copied().unwrap_or(got);
        if want != got {
            s.check_divides(*o, want)?;
            let order = graph.value(*o).producer.map_or(0, |p| graph.node(p).order);
            let c = s.convert(*o, got, want, name.clone(), order)?;
            s.current.insert(*o, c);
            s.tokens[o.index()] = want;
        }
        if let Some(&c) = s.current.get(o) {
            let name = graph.value(*o).name.clone();
            s.out.rename_value(*o, format!("{name}.context_local"))?;
            s.out.rename_value(c, name)?;
            *o = c;
        }
    }
    s.out.outputs = outputs;
    let tokens = graph.value_ids().map(|v| (graph.value(v).name.clone(), s.tokens[v.index()])).collect();
    let ints = graph
        .value_ids()
        .filter_map(|v| {
            let vals = s.info.ints(v)?.to_vec();
            let d = s.shape(v).map_or_else(|| vec![vals.len() as i64], <[i64]>::to_vec);
            Some((graph.value(v).name.clone(), (d, vals)))
        })
        .collect();
    Ok(ContextSplit { graph: s.out, tokens, ints, gathers: s.gathers, localizes: s.localizes })
}

/// Ops that only move (or repeat) elements: a gather may move across them.
fn moves_elements_only(k: OpKind) -> bool {
    matches!(k, OpKind::Reshape | OpKind::Transpose | OpKind::Unsqueeze | OpKind::Squeeze | OpKind::Expand | OpKind::Flatten | OpKind::Identity)
}

/// True for a context all-gather node.
pub fn is_token_gather(op: &Op) -> bool {
    matches!(op, Op::Collective { kind: CollectiveKind::TokenGather { .. }, .. })
}

/// Orders each all-gather with the first op past the views that read it (attention), so the
/// keys' and values' gathers of a layer are ready together and the runner sends them as one.
fn schedule_gathers_late(g: &mut Graph) {
    let uses = g.uses();
    let gathers: Vec<NodeId> = g.node_ids().filter(|&n| is_token_gather(&g.node(n).op)).collect();
    for n in gathers {
        let mut stack: Vec<ValueId> = g.node(n).outputs.clone();
        let mut seen = HashSet::new();
        let mut at: Option<u32> = None;
        while let Some(v) = stack.pop() {
            for &u in &uses[v.index()] {
                if !seen.insert(u) {
                    continue;
                }
                let node = g.node(u);
                let view = node.op.kind().is_some_and(moves_elements_only);
                if view {
                    stack.extend(node.outputs.iter().copied());
                } else {
                    at = Some(at.map_or(node.order, |a| a.min(node.order)));
                }
            }
        }
        if let Some(order) = at {
            let node = g.node_mut(n);
            node.order = node.order.max(order);
        }
    }
}

/// How one node runs on local tokens.
pub(super) struct Decision {
    /// Input slots read in another form: slot, the form.
    pub(super) convert: Vec<(usize, Tokens)>,
    /// The tokens of its outputs.
    pub(super) out: Tokens,
    /// A shape operand divided at run time: slot, one divisor per entry.
    pub(super) shape: Option<(usize, Vec<i64>)>,
}

impl Decision {
    pub(super) fn to(out: Tokens) -> Decision {
        Decision { convert: Vec::new(), out, shape: None }
    }
}

pub(super) struct Splitter<'g> {
    pub(super) g: &'g Graph,
    /// Each value's readers.
    uses: &'g [Vec<NodeId>],
    pub(super) info: ShapeInfo,
    pub(super) cp: i64,
    out: Graph,
    pub(super) tokens: Vec<Tokens>,
    /// Values read through a stand-in (seeds' local ids, shapes of local values as constants).
    current: HashMap<ValueId, ValueId>,
    /// Conversions made: (value, form) → the converted value.
    converted: HashMap<(ValueId, Tokens), ValueId>,
    /// The forms each value is read in.
    reads: HashMap<ValueId, Vec<Tokens>>,
    /// Values made local (or whole) where they are made (see [`split_context`]).
    forced: HashMap<ValueId, Tokens>,
    counter: usize,
    gathers: usize,
    localizes: usize,
}


impl Splitter<'_> {
    pub(super) fn shape(&self, v: ValueId) -> Option<&[i64]> {
        self.info.types.get(v.index())?.as_ref()?.shape.as_deref()
    }

    fn err(&self, n: NodeId, msg: impl Into<String>) -> ContextError {
        let node = self.g.node(n);
        ContextError::Node { node: node.name.clone(), op: node.op.to_string(), msg: msg.into() }
    }

    /// Integer `[batch, seq]` graph inputs that reach an embedding lookup's indices through
    /// elementwise ops and views only (token, position and segment ids; not attention masks).
    fn token_inputs(&self) -> Vec<ValueId> {
        let uses = self.uses;
        let mut out = Vec::new();
        for &v in &self.g.inputs {
            let val = self.g.value(v);
            let int = self.info.types[v.index()].as_ref().is_some_and(|t| t.dtype.is_int());
            if val.kind != ValueKind::Input || !int || self.tokens[v.index()] != Tokens::Whole || self.shape(v).is_none_or(|s| s.len() != 2) {
                continue;
            }
            let mut stack = vec![v];
            let mut seen = HashSet::new();
            let mut lookup = false;
            while let Some(x) = stack.pop() {
                for &u in &uses[x.index()] {
                    let node = self.g.node(u);
                    if !seen.insert(u) {
                        continue;
                    }
                    match node.op.kind() {
                        Some(OpKind::Gather) if node.inputs.get(1).copied().flatten() == Some(x) => {
                            let data = node.inputs.first().copied().flatten();
                            if data.is_some_and(|d| self.g.value(d).kind == ValueKind::Initializer) && node.attrs.int("axis", 0) == 0 {
                                lookup = true;
                            }
                        }
                        Some(k) if k.is_elementwise() || matches!(k, OpKind::Identity | OpKind::Reshape | OpKind::Unsqueeze | OpKind::Squeeze | OpKind::Flatten) => {
                            stack.extend(node.outputs.iter().copied())
                        }
                        _ => {}
                    }
                }
            }
            if lookup {
                out.push(v);
            }
        }
        out
    }

    fn check_divides(&self, v: ValueId, t: Tokens) -> Result<(), ContextError> {
        if let Tokens::Local { axis, outer } = t
            && let Some(s) = self.shape(v)
            && let Some(&len) = s.get(axis)
        {
            let chunks = 2 * self.cp;
            let seq = len / outer.max(1);
            if outer <= 0 || len % outer != 0 || seq % chunks != 0 || seq == 0 {
                return Err(ContextError::Indivisible { value: self.g.value(v).name.clone(), len: seq, cp: self.cp as usize, chunks: chunks as usize });
            }
        }
        Ok(())
    }

    fn fresh(&mut self, base: &str, what: &str) -> String {
        self.counter += 1;
        format!("{base}.{what}{}", self.counter)
    }

    /// `v` (held as `from`, read through `src`) in form `to`: the converted value's id.
    fn convert(&mut self, v: ValueId, from: Tokens, to: Tokens, src_name: String, order: u32) -> Result<ValueId, ContextError> {
        if let Some(&c) = self.converted.get(&(v, to)) {
            return Ok(c);
        }
        let src = self.current.get(&v).copied().unwrap_or(v);
        let mut at = src;
        let mut held = from;
        let emit = |s: &mut Self, kind: CollectiveKind, input: ValueId| -> Result<ValueId, ContextError> {
            let gather = matches!(kind, CollectiveKind::TokenGather { .. });
            let axis = kind.axis().unwrap_or(0);
            let name = s.fresh(&src_name, if gather { "context_gather" } else { "context_local" });
            // declared as shape inference sees it: the whole value, or its token axis over c
            let whole = s.info.types[v.index()].clone();
            let ty = whole.map(|t| {
                let shape = t.shape.map(|mut d| {
                    if !gather && let Some(len) = d.get_mut(axis) {
                        *len /= s.cp;
                    }
                    Shape::from_known(&d)
                });
                TensorType { dtype: t.dtype, shape }
            });
            let outv = s.out.add_value(format!("{name}.out"), ValueKind::Intermediate, ty, None)?;
            s.out.add_node(Node {
                name,
                op: Op::Collective { kind, group: GroupKind::Context },
                attrs: Attrs::default(),
                inputs: vec![Some(input)],
                outputs: vec![outv],
                namespace: None,
                order,
            })?;
            Ok(outv)
        };
        if let Tokens::Local { axis, outer } = held
            && held != to
        {
            let seq = self.block_tokens(v, axis, outer);
            at = emit(self, CollectiveKind::TokenGather { axis, outer, seq }, at)?;
            self.gathers += 1;
            tracing::debug!(value = %src_name, axis, "context all-gather");
            held = Tokens::Whole;
        }
        if let (Tokens::Whole, Tokens::Local { axis, outer }) = (held, to) {
            let seq = self.block_tokens(v, axis, outer);
            at = emit(self, CollectiveKind::TokenLocalize { axis, outer, seq }, at)?;
            self.localizes += 1;
            tracing::debug!(value = %src_name, axis, "context cut");
        }
        self.converted.insert((v, to), at);
        Ok(at)
    }

    /// Tokens of one whole sequence block of `v` along `axis` (`outer` blocks at the inferred
    /// batch); 0 when its shape is unknown.
    fn block_tokens(&self, v: ValueId, axis: usize, outer: i64) -> i64 {
        let len = self.shape(v).and_then(|s| s.get(axis).copied()).unwrap_or(0);
        if outer > 0 && len > 0 && len % outer == 0 { len / outer } else { 0 }
    }

    /// Records that `v` is read as `form`.
    fn read(&mut self, v: ValueId, form: Tokens) {
        let forms = self.reads.entry(v).or_default();
        if !forms.contains(&form) {
            forms.push(form);
        }
    }

    /// A new node `op(a, b)` of shape arithmetic; its output.
    fn arith(&mut self, op: OpKind, a: ValueId, b: ValueId, order: u32) -> Result<ValueId, ContextError> {
        let base = self.out.value(a).name.clone();
        let name = self.fresh(&base, if op == OpKind::Mul { "global" } else { "local" });
        let out = self.out.add_value(format!("{name}.out"), ValueKind::Intermediate, None, None)?;
        self.out.add_node(Node { name, op: Op::Known(op), attrs: Attrs::default(), inputs: vec![Some(a), Some(b)], outputs: vec![out], namespace: None, order })?;
        Ok(out)
    }

    /// Runs node `n` on local tokens: decides, inserts the conversions and rewrites.
    fn node(&mut self, n: NodeId) -> Result<(), ContextError> {
        let node = self.g.node(n);
        let any_local = node.inputs.iter().flatten().any(|v| self.tokens[v.index()] != Tokens::Whole);
        let forced = node.outputs.first().and_then(|o| self.forced.get(o)).copied();
        let order = node.order;
        if !any_local && forced.is_none() {
            for v in node.inputs.iter().flatten() {
                self.read(*v, self.tokens[v.index()]);
            }
            // only stand-ins to rewire
            for (slot, v) in node.inputs.iter().enumerate() {
                if let Some(v) = *v
                    && let Some(&c) = self.current.get(&v)
                {
                    self.out.set_input(n, slot, Some(c));
                }
            }
            return Ok(());
        }
        if node.op.is(OpKind::Shape) || node.op.is(OpKind::Size) {
            // the one-process shape (the local one, its token entry times c): later shape
            // arithmetic stays global
            let x = node.inputs.first().copied().flatten().ok_or_else(|| self.err(n, "no input"))?;
            if let Some(&c) = self.current.get(&x) {
                self.out.set_input(n, 0, Some(c));
            }
            let Tokens::Local { axis, .. } = self.tokens[x.index()] else { return Ok(()) };
            let o = node.outputs[0];
            let factors: Vec<i64> = if node.op.is(OpKind::Size) {
                vec![self.cp]
            } else {
                let rank = self.shape(x).map_or(0, <[i64]>::len);
                let start = norm_axis(node.attrs.int("start", 0), rank).unwrap_or(0);
                let end = node.attrs.0.get("end").map(|_| node.attrs.int("end", rank as i64)).map_or(rank, |e| if e < 0 { (e + rank as i64).max(0) as usize } else { (e as usize).min(rank) });
                (start..end.max(start)).map(|i| if i == axis { self.cp } else { 1 }).collect()
            };
            let dims = if node.op.is(OpKind::Size) { Vec::new() } else { vec![factors.len() as i64] };
            let name = self.fresh(&self.g.value(o).name, "context_factor");
            let data = crate::passes::fold::int_tensor(DType::I64, dims.clone(), &factors);
            let f = self.out.add_value(name, ValueKind::Constant, Some(TensorType { dtype: DType::I64, shape: Some(Shape::from_known(&dims)) }), Some(data))?;
            let global = self.arith(OpKind::Mul, o, f, order)?;
            self.current.insert(o, global);
            return Ok(());
        }
        let decided = match (forced, node.outputs.first().and_then(|&o| self.shape(o)).map(<[i64]>::to_vec)) {
            (Some(Tokens::Whole), _) => None,
            (Some(t), Some(os)) if node.op.is(OpKind::Expand) => self.expand_to(n, &os, t),
            (Some(t), Some(os)) => Some(self.elementwise_operands(n, &os, t, &(0..node.inputs.len()).collect::<Vec<_>>())),
            _ => self.decide(n)?,
        };
        let d = match decided {
            Some(d) => d,
            None => {
                let convert = node.inputs.iter().enumerate().filter_map(|(i, v)| v.filter(|v| self.tokens[v.index()] != Tokens::Whole).map(|_| (i, Tokens::Whole))).collect();
                Decision { convert, out: Tokens::Whole, shape: None }
            }
        };
        let node = self.g.node(n);
        let inputs = node.inputs.clone();
        let outputs = node.outputs.clone();
        for (slot, v) in inputs.iter().enumerate() {
            let Some(v) = *v else { continue };
            let form = d.convert.iter().find(|c| c.0 == slot).map_or(self.tokens[v.index()], |c| c.1);
            self.read(v, form);
            if let Some(&(_, to)) = d.convert.iter().find(|c| c.0 == slot) {
                self.check_divides(v, to)?;
                let from = self.tokens[v.index()];
                let c = self.convert(v, from, to, self.g.value(v).name.clone(), order)?;
                self.out.set_input(n, slot, Some(c));
            } else if let Some(&c) = self.current.get(&v) {
                self.out.set_input(n, slot, Some(c));
            }
        }
        if let Some((slot, divisors)) = d.shape {
            // the target as given (global), its token entry divided by c at run time
            let orig = inputs[slot].ok_or_else(|| self.err(n, "no shape operand"))?;
            let target = self.current.get(&orig).copied().unwrap_or(orig);
            let dtype = self.info.types[orig.index()].as_ref().map_or(DType::I64, |t| t.dtype);
            let name = self.fresh(&self.g.value(orig).name, "context_divisors");
            let dims = vec![divisors.len() as i64];
            let data = crate::passes::fold::int_tensor(dtype, dims.clone(), &divisors);
            let c = self.out.add_value(name, ValueKind::Constant, Some(TensorType { dtype, shape: Some(Shape::from_known(&dims)) }), Some(data))?;
            let local = self.arith(OpKind::Div, target, c, order)?;
            self.out.set_input(n, slot, Some(local));
        }
        if let Tokens::Local { axis, outer } = d.out {
            if self.g.node(n).op.is(OpKind::Dropout) {
                let nm = self.out.node_mut(n);
                nm.attrs.set(DROPOUT_TOKEN_AXIS, Attr::Int(axis as i64));
                nm.attrs.set(DROPOUT_TOKEN_OUTER, Attr::Int(outer));
            }
            for &o in &outputs {
                self.check_divides(o, d.out)?;
            }
        }
        // every output alike (Dropout's mask, TopK's indices)
        for &o in &outputs {
            self.tokens[o.index()] = d.out;
        }
        Ok(())
    }

    /// The placement of a node with a local input, or None to run it whole.
    fn decide(&self, n: NodeId) -> Result<Option<Decision>, ContextError> {
        let node = self.g.node(n);
        let tok = |v: Option<ValueId>| v.map_or(Tokens::Whole, |v| self.tokens[v.index()]);
        let input = |i: usize| node.inputs.get(i).copied().flatten();
        let Some(&o) = node.outputs.first() else { return Ok(None) };
        let Some(os) = self.shape(o).map(<[i64]>::to_vec) else { return Ok(None) };
        if let Op::Collective { kind, .. } = &node.op {
            return Ok(match *kind {
                CollectiveKind::AllReduce | CollectiveKind::CopyToRegion => self.elementwise(n, &os),
                CollectiveKind::Scatter { axis } if tok(input(0)) == Tokens::Whole => {
                    let t = Tokens::Local { axis, outer: 1 };
                    Some(Decision { convert: vec![(0, t)], out: t, shape: None })
                }
                CollectiveKind::AllGather { .. } | CollectiveKind::ReduceScatter { .. } | CollectiveKind::Scatter { .. } => Some(Decision::to(tok(input(0)))),
                CollectiveKind::TokenGather { .. } | CollectiveKind::TokenLocalize { .. } => None,
            });
        }
        // the rule the tensor split keeps whole by: such a node reads whole inputs
        if opaque(self.g, &self.info, self.uses, n).is_some() {
            return Ok(None);
        }
        let Some(kind) = node.op.kind() else { return Ok(None) };
        use OpKind::*;
        Ok(match family(kind) {
            Family::Elementwise => self.elementwise(n, &os),
            Family::Norm => self.reduction(n),
            Family::Matmul if kind == Gemm => self.gemm(n, &os),
            Family::Matmul => self.matmul(n, &os),
            Family::Attention => self.attention(n),
            Family::View => match kind {
                Expand => self.expand(n, &os),
                Transpose => self.transpose(n, &os),
                Split => self.split(n, &os),
                Concat => self.concat(n, &os),
                _ => self.view(n, &os, kind == Reshape),
            },
            Family::Gather => self.gather(n),
            Family::Experts => self.experts(n),
            // Shape and Size are rewritten in `node`; the others read no local value
            Family::Shape | Family::Whole => None,
        })
    }

    /// `out`, with each of `slots` brought in line with it: a local operand on another axis
    /// gathered (and cut again if it spans the tokens), a whole operand spanning the tokens cut.
    pub(super) fn elementwise_operands(&self, n: NodeId, os: &[i64], out: Tokens, slots: &[usize]) -> Decision {
        let node = self.g.node(n);
        let Tokens::Local { axis: ta, outer } = out else { return Decision::to(out) };
        let r = os.len();
        let mut convert = Vec::new();
        for &slot in slots {
            let Some(v) = node.inputs.get(slot).copied().flatten() else { continue };
            let Some(vs) = self.shape(v) else { continue };
            let ri = vs.len();
            let off = r.saturating_sub(ri);
            let aligned = (ta >= off && ri <= r).then(|| ta - off);
            let t = self.tokens[v.index()];
            if let (Tokens::Local { axis, outer: o }, Some(a)) = (t, aligned)
                && axis == a
                && o == outer
            {
                continue;
            }
            match aligned {
                Some(a) if vs[a] != 1 && vs[a] == os[ta] => convert.push((slot, Tokens::Local { axis: a, outer })),
                _ if t != Tokens::Whole => convert.push((slot, Tokens::Whole)),
                _ => {}
            }
        }
        Decision { convert, out, shape: None }
    }






}

/// Positions (in one sequence of `seq` tokens) that rank `rank` of `cp` holds, in its order:
/// chunk `rank`, then chunk `2·cp − 1 − rank`, of `2·cp` equal chunks.
pub fn local_positions(seq: i64, rank: usize, cp: usize) -> Vec<i64> {
    let chunk = seq / (2 * cp as i64);
    let front = rank as i64 * chunk;
    let back = (2 * cp as i64 - 1 - rank as i64) * chunk;
    (front..front + chunk).chain(back..back + chunk).collect()
}

/// Where each global position's token sits once the group's local tokens are concatenated in
/// member order: `gathered[order[i]]` is position `i`.
pub fn gathered_order(seq: i64, cp: usize) -> Vec<i64> {
    let mut order = vec![0i64; seq as usize];
    for r in 0..cp {
        for (j, p) in local_positions(seq, r, cp).into_iter().enumerate() {
            order[p as usize] = r as i64 * (seq / cp as i64) + j as i64;
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_hold_a_front_and_a_back_chunk_and_the_order_inverts_the_gather() {
        assert_eq!(local_positions(8, 0, 2), vec![0, 1, 6, 7]);
        assert_eq!(local_positions(8, 1, 2), vec![2, 3, 4, 5]);
        for cp in [1usize, 2, 4] {
            let seq = 16;
            let gathered: Vec<i64> = (0..cp).flat_map(|r| local_positions(seq, r, cp)).collect();
            let order = gathered_order(seq, cp);
            let restored: Vec<i64> = order.iter().map(|&i| gathered[i as usize]).collect();
            assert_eq!(restored, (0..seq).collect::<Vec<_>>(), "cp {cp}");
        }
    }
}
