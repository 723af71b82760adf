//! Fusion: op chains that one fused kernel computes are rewritten into that one op.
//!
//! Exporters spell GELU as elementwise arithmetic: Hugging Face's `gelu_new` (GPT-2) as
//! `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, `F.gelu` at opsets below 20 as
//! `0.5·x·(1 + erf(x/√2))`. Each chain is eight or five elementwise nodes, each a full pass over
//! the activation forward and more backward (`Pow` with a tensor exponent runs `powf`). The chain
//! is the ONNX `Gelu` op (opset 20; `approximate = "tanh"` for the first form), whose meaning
//! every stage already knows (shape inference, figures, split rules: elementwise), and which the
//! runner runs as libtorch's fused `gelu` kernel.
//!
//! The rewrite keeps ids: the chain's last node becomes the `Gelu` node (same id, same output
//! value) reading the chain's input, and the chain's other nodes are removed. Each rewrite is
//! returned as an [`ir::Fusion`](crate::ir::Fusion): analysis runs this pass and keeps the
//! records (`LayeredGraph::fused`), the plan carries them, and the runner replays exactly them
//! with [`apply`], which checks each against the graph (no pattern matching at run time).
//!
//! A chain is fused only where each interior value has the chain as its only reader and every
//! constant equals the formula's (within f32 rounding), so the fused op computes what the chain
//! computes, up to rounding.

use std::collections::HashSet;

use super::PassError;
use crate::ir::{Attr, FusedOp, Fusion, GeluApproximation, Graph, NodeId, OpKind, ValueId};

/// How many chains of each kind a list of rewrites fused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fused {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` chains now `Gelu(approximate = "tanh")`.
    pub gelu_tanh: usize,
    /// `0.5·x·(1 + erf(x/√2))` chains now `Gelu`.
    pub gelu_erf: usize,
}

impl Fused {
    /// The counts of `fusions`.
    pub fn of(fusions: &[Fusion]) -> Fused {
        let mut out = Fused::default();
        for f in fusions {
            match f.op {
                FusedOp::Gelu { approximate: GeluApproximation::Tanh } => out.gelu_tanh += 1,
                FusedOp::Gelu { approximate: GeluApproximation::None } => out.gelu_erf += 1,
            }
        }
        out
    }

    /// Chains rewritten in all.
    pub fn total(&self) -> usize {
        self.gelu_tanh + self.gelu_erf
    }
}

impl std::fmt::Display for Fused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "fused {} tanh-GELU and {} erf-GELU chains into Gelu", self.gelu_tanh, self.gelu_erf)
    }
}

/// Rewrites every GELU chain of `graph` into one `Gelu` node (see the module docs); returns the
/// rewrites in the order applied.
pub fn fuse(graph: &mut Graph) -> Vec<Fusion> {
    let mut out = Vec::new();
    let Ok(order) = graph.topo_order() else { return out };
    for id in order {
        if graph.try_node(id).is_none_or(|n| !n.op.is(OpKind::Mul)) {
            continue;
        }
        let m = Matcher { g: graph, uses: readers(graph) };
        let Some((x, approximate)) = m.gelu(id) else { continue };
        let approximate = if approximate { GeluApproximation::Tanh } else { GeluApproximation::None };
        let fusion = Fusion { node: id, op: FusedOp::Gelu { approximate }, input: x, output: graph.node(id).outputs[0], replaces: chain(graph, id, x) };
        // the matcher proved the chain; the checks of `apply` hold by construction
        if apply(graph, &fusion).is_ok() {
            out.push(fusion);
        }
    }
    out
}

/// The nodes between `x` and node `last`: `last` and every producer reached backwards from it
/// without passing through `x`, ascending.
fn chain(g: &Graph, last: NodeId, x: ValueId) -> Vec<NodeId> {
    let mut seen: HashSet<NodeId> = HashSet::new();
    let mut stack = vec![last];
    while let Some(n) = stack.pop() {
        if !seen.insert(n) {
            continue;
        }
        for &v in g.node(n).inputs.iter().flatten() {
            if v != x
                && let Some(p) = g.value(v).producer
            {
                stack.push(p);
            }
        }
    }
    let mut out: Vec<NodeId> = seen.into_iter().collect();
    out.sort();
    out
}

/// Applies one rewrite to `graph`: node `f.node` becomes `f.op` reading `f.input` (its output
/// kept), the chain's other nodes are removed. Refused, naming the node, unless the record fits
/// the graph: every replaced node exists, `f.node` is one of them and makes `f.output`, the
/// chain is closed (its nodes read only `f.input`, constants and each other; only `f.output`
/// leaves it) and reads `f.input`, and its ops are those of `f.op`'s formula.
pub fn apply(graph: &mut Graph, f: &Fusion) -> Result<(), PassError> {
    let name = graph.try_node(f.node).map_or_else(|| format!("#{}", f.node.index()), |n| n.name.clone());
    let bad = |msg: String| PassError::Fusion { node: name.clone(), msg };
    if !f.replaces.contains(&f.node) {
        return Err(bad("the node is not among the nodes it replaces".into()));
    }
    let mut members: HashSet<NodeId> = HashSet::new();
    for &n in &f.replaces {
        if graph.try_node(n).is_none() {
            return Err(bad(format!("it replaces node #{}, which the graph does not have", n.index())));
        }
        if !members.insert(n) {
            return Err(bad(format!("it lists node `{}` twice", graph.node(n).name)));
        }
    }
    if graph.node(f.node).outputs != [f.output] {
        return Err(bad(format!("the node does not make `{}` (alone)", graph.value(f.output).name)));
    }
    let mut reads_input = false;
    let mut ops: HashSet<OpKind> = HashSet::new();
    for &n in &f.replaces {
        let node = graph.node(n);
        if let crate::ir::Op::Known(k) = node.op {
            ops.insert(k);
        }
        for &v in node.inputs.iter().flatten() {
            let val = graph.value(v);
            if v == f.input {
                reads_input = true;
            } else if let Some(p) = val.producer.filter(|p| !members.contains(p)) {
                return Err(bad(format!("node `{}` of the chain reads `{}`, made by `{}` outside it", node.name, val.name, graph.node(p).name)));
            } else if val.producer.is_none() && val.data.is_none() {
                return Err(bad(format!("node `{}` of the chain reads `{}`, which is neither made in the chain nor a constant", node.name, val.name)));
            }
        }
    }
    if !reads_input {
        return Err(bad(format!("no node of the chain reads its input `{}`", graph.value(f.input).name)));
    }
    let readers = readers(graph);
    for &n in f.replaces.iter().filter(|&&n| n != f.node) {
        for &o in &graph.node(n).outputs {
            let inside: usize = f.replaces.iter().map(|&m| graph.node(m).inputs.iter().flatten().filter(|&&v| v == o).count()).sum();
            if readers[o.index()] != inside {
                return Err(bad(format!("`{}` of node `{}` is read outside the chain", graph.value(o).name, graph.node(n).name)));
            }
        }
    }
    let FusedOp::Gelu { approximate } = f.op;
    let core = match approximate {
        GeluApproximation::Tanh => OpKind::Tanh,
        GeluApproximation::None => OpKind::Erf,
    };
    if !ops.contains(&core) || !ops.contains(&OpKind::Mul) {
        return Err(bad(format!("the chain has no {core:?} and Mul, so it is not {}", f.op)));
    }
    let node = graph.node_mut(f.node);
    node.op = crate::ir::Op::Known(OpKind::Gelu);
    node.attrs = crate::ir::Attrs::default();
    if approximate == GeluApproximation::Tanh {
        node.attrs.set("approximate", Attr::Str("tanh".into()));
    }
    node.inputs.truncate(1);
    // rewires the node's edges to its one input
    graph.set_input(f.node, 0, Some(f.input));
    for &n in f.replaces.iter().filter(|&&n| n != f.node) {
        graph.remove_node(n);
    }
    Ok(())
}

/// How many nodes read each value (graph outputs count as a reader).
fn readers(g: &Graph) -> Vec<usize> {
    let mut n = vec![0; g.value_count()];
    for id in g.node_ids() {
        for v in g.node(id).inputs.iter().flatten() {
            n[v.index()] += 1;
        }
    }
    for v in &g.outputs {
        n[v.index()] += 1;
    }
    n
}

struct Matcher<'g> {
    g: &'g Graph,
    uses: Vec<usize>,
}

/// √(2/π) and 1/√2 as the formulas use them.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const SQRT_2: f64 = std::f64::consts::SQRT_2;

impl Matcher<'_> {
    /// The node making `v` when `v` is read only by the chain, with its op.
    fn inner(&self, v: ValueId, op: OpKind) -> Option<NodeId> {
        let p = self.g.value(v).producer?;
        let n = self.g.node(p);
        (n.op.is(op) && n.outputs.len() == 1 && self.uses[v.index()] == 1).then_some(p)
    }

    /// The two inputs of a binary node.
    fn pair(&self, id: NodeId) -> Option<(ValueId, ValueId)> {
        match self.g.node(id).inputs.as_slice() {
            [Some(a), Some(b)] => Some((*a, *b)),
            _ => None,
        }
    }

    /// The value of a one-element constant (initializer or folded constant).
    fn scalar(&self, v: ValueId) -> Option<f64> {
        let val = self.g.value(v);
        if val.producer.is_some() {
            return None;
        }
        if val.training.as_ref().is_some_and(|t| matches!(t, crate::ir::Training::Trained { .. })) {
            return None;
        }
        let data = val.data.as_ref()?;
        if data.numel() != 1 {
            return None;
        }
        data.to_f64_vec()?.first().copied()
    }

    fn is_const(&self, v: ValueId, want: f64) -> bool {
        // f32 rounding of the formula's constant, and of its reciprocal for `Div`
        self.scalar(v).is_some_and(|c| (c - want).abs() <= 1e-6 * want.abs().max(1e-30))
    }

    /// For a commutative binary node: (the other input, true) when one input is the constant.
    fn with_const(&self, id: NodeId, want: f64) -> Option<ValueId> {
        let (a, b) = self.pair(id)?;
        if self.is_const(b, want) {
            Some(a)
        } else if self.is_const(a, want) {
            Some(b)
        } else {
            None
        }
    }

    /// `id` = Mul(Mul(x, 0.5), Add(1, tanh(...)|erf(...))) in any operand order: (x, tanh form).
    fn gelu(&self, id: NodeId) -> Option<(ValueId, bool)> {
        let (a, b) = self.pair(id)?;
        for (half, one_plus) in [(a, b), (b, a)] {
            let Some(h) = self.inner(half, OpKind::Mul) else { continue };
            let Some(x) = self.with_const(h, 0.5) else { continue };
            let Some(add) = self.inner(one_plus, OpKind::Add) else { continue };
            let Some(f) = self.with_const(add, 1.0) else { continue };
            if let Some(t) = self.inner(f, OpKind::Tanh) {
                if self.tanh_arg(self.g.node(t).inputs.first().copied().flatten()?, x) {
                    return Some((x, true));
                }
            }
            if let Some(e) = self.inner(f, OpKind::Erf) {
                if self.erf_arg(self.g.node(e).inputs.first().copied().flatten()?, x) {
                    return Some((x, false));
                }
            }
        }
        None
    }

    /// `s` = √(2/π)·(x + 0.044715·x³).
    fn tanh_arg(&self, s: ValueId, x: ValueId) -> bool {
        let inner = || -> Option<bool> {
            let m = self.inner(s, OpKind::Mul)?;
            let r = self.with_const(m, SQRT_2_OVER_PI)?;
            let add = self.inner(r, OpKind::Add)?;
            let (p, q) = self.pair(add)?;
            let cube_term = if p == x { q } else if q == x { p } else { return None };
            let mq = self.inner(cube_term, OpKind::Mul)?;
            let cube = self.with_const(mq, 0.044715)?;
            let pw = self.inner(cube, OpKind::Pow)?;
            let (base, exp) = self.pair(pw)?;
            Some(base == x && self.is_const(exp, 3.0))
        };
        inner().unwrap_or(false)
    }

    /// `s` = x/√2 (`Div` by √2 or `Mul` by 1/√2).
    fn erf_arg(&self, s: ValueId, x: ValueId) -> bool {
        if let Some(d) = self.inner(s, OpKind::Div) {
            return self.pair(d).is_some_and(|(a, b)| a == x && self.is_const(b, SQRT_2));
        }
        if let Some(m) = self.inner(s, OpKind::Mul) {
            return self.with_const(m, 1.0 / SQRT_2) == Some(x);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attrs, DType, Node, Op, Shape, Tensor, TensorType, ValueKind};

    fn ty() -> Option<TensorType> {
        Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[4])) })
    }

    struct B {
        g: Graph,
        n: u32,
    }

    impl B {
        fn c(&mut self, v: f32) -> ValueId {
            self.n += 1;
            let t = Tensor::from_f32(vec![], &[v]);
            self.g.add_value(format!("c{}", self.n), ValueKind::Initializer, None, Some(t)).unwrap()
        }
        fn op(&mut self, k: OpKind, ins: &[ValueId]) -> ValueId {
            self.n += 1;
            let out = self.g.add_value(format!("v{}", self.n), ValueKind::Intermediate, ty(), None).unwrap();
            let node = Node {
                name: format!("n{}", self.n),
                op: Op::Known(k),
                attrs: Attrs::default(),
                inputs: ins.iter().map(|&v| Some(v)).collect(),
                outputs: vec![out],
                namespace: None,
                order: self.n,
            };
            self.g.add_node(node).unwrap();
            out
        }
    }

    fn tanh_gelu(b: &mut B, x: ValueId, swap: bool) -> ValueId {
        tanh_gelu_with(b, x, swap, 0.044715)
    }

    /// The tanh chain with `k` in place of 0.044715.
    fn tanh_gelu_with(b: &mut B, x: ValueId, swap: bool, k: f32) -> ValueId {
        let (c05, c3, ck, cs, c1) = (b.c(0.5), b.c(3.0), b.c(k), b.c(SQRT_2_OVER_PI as f32), b.c(1.0));
        let half = b.op(OpKind::Mul, &[x, c05]);
        let p = b.op(OpKind::Pow, &[x, c3]);
        let q = b.op(OpKind::Mul, &[p, ck]);
        let r = b.op(OpKind::Add, &[x, q]);
        let s = b.op(OpKind::Mul, &[r, cs]);
        let t = b.op(OpKind::Tanh, &[s]);
        let u = if swap { b.op(OpKind::Add, &[c1, t]) } else { b.op(OpKind::Add, &[t, c1]) };
        if swap { b.op(OpKind::Mul, &[u, half]) } else { b.op(OpKind::Mul, &[half, u]) }
    }

    fn graph() -> (B, ValueId) {
        let mut b = B { g: Graph::new("t"), n: 0 };
        let x = b.g.add_value("x", ValueKind::Input, ty(), None).unwrap();
        b.g.inputs = vec![x];
        (b, x)
    }

    #[test]
    fn tanh_and_erf_chains_become_one_gelu_each() {
        let (mut b, x) = graph();
        let y1 = tanh_gelu(&mut b, x, false);
        let y2 = tanh_gelu(&mut b, y1, true);
        let (c05, c1, r2) = (b.c(0.5), b.c(1.0), b.c(SQRT_2 as f32));
        let half = b.op(OpKind::Mul, &[y2, c05]);
        let d = b.op(OpKind::Div, &[y2, r2]);
        let e = b.op(OpKind::Erf, &[d]);
        let u = b.op(OpKind::Add, &[e, c1]);
        let y3 = b.op(OpKind::Mul, &[half, u]);
        b.g.outputs = vec![y3];
        let mut g = b.g;
        let unfused = g.clone();
        let fusions = fuse(&mut g);
        assert_eq!(Fused::of(&fusions), Fused { gelu_tanh: 2, gelu_erf: 1 });
        assert_eq!(fusions.iter().map(|f| f.replaces.len()).collect::<Vec<_>>(), [8, 8, 5]);
        g.verify().unwrap();
        // the chains' other nodes are gone
        assert_eq!(crate::passes::dce::remove_dead_nodes(&mut g), 0);
        assert_eq!(g.node_count(), 3);
        // replaying the records on the unfused graph gives the same graph
        let mut replayed = unfused;
        for f in &fusions {
            apply(&mut replayed, f).unwrap();
        }
        assert_eq!(format!("{replayed}"), format!("{g}"));
        let ops: Vec<String> = g.topo_order().unwrap().iter().map(|&n| {
            let node = g.node(n);
            format!("{}{}", node.op, node.attrs.str("approximate").map(|a| format!("({a})")).unwrap_or_default())
        }).collect();
        assert_eq!(ops, ["Gelu(tanh)", "Gelu(tanh)", "Gelu"]);
        // the chain now reads its input directly and makes the same output value
        let last = g.value(y3).producer.unwrap();
        assert_eq!(g.node(last).inputs, vec![Some(y2)]);
    }

    #[test]
    fn wrong_constants_or_shared_interiors_are_left_alone() {
        // 0.04 instead of 0.044715
        let (mut b, x) = graph();
        let y = tanh_gelu_with(&mut b, x, false, 0.04);
        b.g.outputs = vec![y];
        assert!(fuse(&mut b.g).is_empty());

        // the tanh is also a graph output
        let (mut b, x) = graph();
        let y = tanh_gelu(&mut b, x, false);
        let tanh = b.g.value_ids().find(|&v| b.g.value(v).producer.is_some_and(|p| b.g.node(p).op.is(OpKind::Tanh))).unwrap();
        b.g.outputs = vec![y, tanh];
        assert!(fuse(&mut b.g).is_empty());
    }

    #[test]
    fn records_that_do_not_fit_the_graph_are_refused_naming_the_node() {
        let (mut b, x) = graph();
        let y = tanh_gelu(&mut b, x, false);
        b.g.outputs = vec![y];
        let unfused = b.g.clone();
        let mut g = b.g;
        let f = fuse(&mut g).pop().unwrap();
        let node = unfused.node(f.node).name.clone();
        let refused = |f: &Fusion, want: &str| {
            let err = apply(&mut unfused.clone(), f).unwrap_err().to_string();
            assert!(err.contains(&format!("`{node}`")) && err.contains(want), "{err}");
        };
        // another input: the chain reads x, which it neither makes nor holds as a constant
        let other = unfused.value_by_name("c1").unwrap();
        refused(&Fusion { input: other, ..f.clone() }, "reads `x`");
        // a node of the chain left out: its output is read by the chain, made outside it
        refused(&Fusion { replaces: f.replaces[1..].to_vec(), ..f.clone() }, "outside it");
        // the other approximation
        refused(&Fusion { op: FusedOp::Gelu { approximate: GeluApproximation::None }, ..f.clone() }, "not Gelu");
        // the record as made applies
        apply(&mut unfused.clone(), &f).unwrap();
    }
}
