//! Matmuls with a weight operand: a replicated input splits the weight by columns (output
//! split), an input split along the contracted axis splits it by rows (partial sums, a deferred
//! Gemm bias). Matmuls of two activations split by heads (the attention core).

use super::Strategy;
use crate::cost::SplitDim;
use super::context::{Decision, Splitter, Tokens};
use super::emit::{Fresh, derived, float_scalar};
use super::offer::{Feasible, Offer, Pricer};
use super::realise::{Fail, Prop, R, Sh};
use super::rewrite::{NodeRewrite, add_bias_name};
use crate::ir::{DType, Graph, GraphError, Node, NodeId, OpKind, Shape, TensorType, ValueId, ValueKind};

impl Prop<'_, '_> {
    pub(super) fn matmul(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let gemm = n.op.is(OpKind::Gemm);
        let (Some(a), Some(b)) = (n.inputs.first().copied().flatten(), n.inputs.get(1).copied().flatten()) else {
            return self.err("missing operand");
        };
        let c = n.inputs.get(2).copied().flatten();
        let o = n.outputs[0];
        let (ta, tb) = if gemm { (n.attrs.int("transA", 0) != 0, n.attrs.int("transB", 0) != 0) } else { (false, false) };
        let ash = self.need_shape(a)?;
        let bsh = self.need_shape(b)?;
        let osh = self.need_shape(o)?;
        let (ra, rb, ro) = (ash.len(), bsh.len(), osh.len());
        if ra < 2 || rb < 2 {
            return self.err("vector matmul");
        }
        // Positions of k and n in B, and k/m in A.
        let (bk, bn) = if tb { (rb - 1, rb - 2) } else { (rb - 2, rb - 1) };
        let (am, ak) = if ta { (ra - 1, ra - 2) } else { (ra - 2, ra - 1) };
        let sa = self.state(a);
        let out: Sh;
        if self.is_free_weight(b) && rb == 2 && !self.is_free_weight(a) {
            match sa {
                Sh::Rep => {
                    let nd = bsh[bn];
                    out = match self.layout(Some(b), nd) {
                        Some((outer, inner)) if self.split_weight(b, bn, outer, inner) => {
                            Sh::Split { axis: ro - 1, outer, inner, origin: self.init_of(b) }
                        }
                        _ => {
                            if let Some((init, _)) = self.weight_src.get(&b) {
                                self.kept_whole.insert(*init);
                            }
                            Sh::Rep
                        }
                    };
                }
                Sh::Split { axis, outer, inner, origin } if axis == ak => {
                    if let Some(w) = origin
                        && self.rep(origin) > 1
                    {
                        return Err(Fail::Replicate { weight: w });
                    }
                    if !self.split_weight(b, bk, outer, inner) {
                        return self.err("the weight cannot be split by rows");
                    }
                    out = Sh::Partial;
                }
                Sh::Split { axis, outer, inner, origin } if axis != ak && !ta => {
                    out = Sh::Split { axis: axis + ro - ra, outer, inner, origin };
                }
                Sh::Partial => return self.err("partial input"),
                _ => return self.err("transposed split input"),
            }
        } else {
            let sb = self.state(b);
            out = match (sa, sb) {
                (Sh::Rep, Sh::Rep) => Sh::Rep,
                (Sh::Split { axis: x, outer: o1, inner: i1, origin }, Sh::Split { axis: y, outer: o2, inner: i2, origin: origin2 })
                    if !ta && !tb && (o1, i1, self.rep(origin)) == (o2, i2, self.rep(origin2)) =>
                {
                    if x + 2 < ra + 0 && y + 2 < rb && ra - x == rb - y {
                        Sh::Split { axis: x + ro - ra, outer: o1, inner: i1, origin }
                    } else if x == ak && y == bk {
                        Sh::Partial
                    } else {
                        return self.err("operands split on incompatible axes");
                    }
                }
                (Sh::Split { axis: x, outer, inner, origin }, Sh::Rep) if !ta => {
                    if x == am {
                        Sh::Split { axis: ro - 2, outer, inner, origin }
                    } else if x + 2 < ra && (rb < ra - x || bsh[x + rb - ra] == 1) {
                        Sh::Split { axis: x + ro - ra, outer, inner, origin }
                    } else {
                        return self.err("split operand against a replicated one");
                    }
                }
                (Sh::Rep, Sh::Split { axis: y, outer, inner, origin }) if !tb => {
                    if y == bn {
                        Sh::Split { axis: ro - 1, outer, inner, origin }
                    } else if y + 2 < rb && (ra < rb - y || ash[y + ra - rb] == 1) {
                        Sh::Split { axis: y + ro - rb, outer, inner, origin }
                    } else {
                        return self.err("replicated operand against a split one");
                    }
                }
                _ => return self.err("unsupported operand placements"),
            };
        }
        // Gemm bias.
        if let Some(c) = c {
            match out {
                Sh::Split { axis, outer, inner, .. } => {
                    let cs = self.need_shape(c)?;
                    let off = ro - cs.len();
                    if axis >= off && cs[axis - off] > 1 && !(self.is_free_weight(c) && self.split_weight(c, axis - off, outer, inner)) {
                        return self.err("the bias cannot be split");
                    }
                }
                Sh::Partial => {
                    self.rewrites.push(NodeRewrite::DeferBias { node: n.name.clone() });
                    self.reduce(o);
                    return Ok(());
                }
                Sh::Rep => {}
            }
        }
        self.set(o, out);
        Ok(())
    }

    pub(super) fn init_of(&self, v: ValueId) -> Option<ValueId> {
        match self.state(v) {
            Sh::Split { origin, .. } => origin,
            _ => None,
        }
    }
}

/// Emission: a row-split Gemm whose bias `C` (`bias`, read at input 2) is deferred
/// (`NodeRewrite::DeferBias`). The Gemm runs on `inputs` A and B into a partial sum, `reduce` (the caller's collective) combines it into a value of
/// type `reduced_ty`, and `reduced + beta·C` makes `full`.
pub fn emit_deferred_bias<E: From<GraphError>>(
    g: &mut Graph,
    node: &Node,
    (inputs, mut bias): (&[Option<ValueId>], ValueId),
    (reduced_ty, full): (Option<TensorType>, ValueId),
    fresh: &Fresh,
    reduce: impl FnOnce(&mut Graph, ValueId, ValueId) -> Result<(), E>,
) -> Result<(), E> {
    let name = node.name.as_str();
    let nobias = g.add_value(fresh.name(name, "nobias"), ValueKind::Intermediate, None, None)?;
    let mut attrs = node.attrs.clone();
    let beta = attrs.float("beta", 1.0);
    attrs.0.remove("beta");
    let inputs_ab = inputs.iter().take(2).copied().collect();
    g.add_node(Node { name: name.to_string(), op: node.op.clone(), attrs, inputs: inputs_ab, outputs: vec![nobias], namespace: node.namespace.clone(), order: node.order })?;
    let reduced = g.add_value(fresh.name(name, "reduced"), ValueKind::Intermediate, reduced_ty, None)?;
    reduce(g, nobias, reduced)?;
    if beta != 1.0 {
        let bt = g.value(bias).ty.as_ref().map_or(DType::F32, |t| t.dtype);
        let s = g.add_value(fresh.name(name, "beta"), ValueKind::Constant, Some(TensorType { dtype: bt, shape: Some(Shape(vec![])) }), Some(float_scalar(bt, beta)))?;
        let scaled = g.add_value(fresh.name(name, "scaled_bias"), ValueKind::Intermediate, None, None)?;
        let mut scale = derived(node, fresh.name(name, "scale_bias"), OpKind::Mul, vec![bias, s], scaled);
        scale.namespace = None;
        g.add_node(scale)?;
        bias = scaled;
    }
    g.add_node(derived(node, add_bias_name(name), OpKind::Add, vec![reduced, bias], full))?;
    Ok(())
}

/// Offers.
impl Pricer<'_> {
    /// A weight matmul splits by columns (with the ops its split flows through before its row
    /// consumer), by rows (when a column split or a heads core feeds it), or stays whole.
    pub(super) fn weight_matmul_offers(&self, f: &Feasible<'_>, i: usize) -> Vec<Offer> {
        let sg = f.sg;
        let own = self.figures_split([(i, 1.0)], SplitDim::Columns);
        let mut options = Vec::new();
        if f.col_ok[&i] {
            // The ops it feeds before its consumer run split with it (or whole).
            let region: Vec<(usize, f64)> = f
                .owner_share
                .iter()
                .filter(|(n, o)| o.contains(&i) && !f.in_core.contains(n))
                .map(|(&n, o)| (n, 1.0 / o.iter().filter(|q| f.col_ok[q]).count().max(1) as f64))
                .collect();
            let reg = self.figures(region.iter().copied());
            // A split output that leaves the split region is all-gathered by codegen, but
            // priced as an all-reduce (twice its traffic): the exact price moves Megatron's
            // Table 1 76.1B row past 10 % of its published rate (tests/published_runs.rs),
            // whose runs use a vocabulary-parallel loss this model does not price; both belong
            // together.
            let exit = if sg.reach[&i].as_ref().is_some_and(|r| r.exits) { self.ar } else { 0.0 };
            let first = f.first_reader.get(&sg.input[&i]) == Some(&i);
            let grad = if first { self.ar } else { 0.0 };
            // Without sequence parallelism every rank keeps the split's input whole for its
            // weight gradient (one tensor its sibling readers share): the first reader adds what
            // the layer's activations ÷ t leave out.
            let whole_input = if first && !self.x.sequence_parallel { own[5] } else { 0.0 };
            options.push(self.opt(Strategy::Column, own[0] + reg[0] + exit, own[1] + reg[1] + grad, (own[4] + reg[4]) / self.t, whole_input));
            options.push(self.opt(Strategy::Replicate, own[2] + reg[2], own[3] + reg[3], own[4] + reg[4], own[5] + reg[5]));
        } else {
            options.push(self.replicate(&own));
        }
        if f.row_ok(self, i) {
            // a row split divides the contracted dim: its own (smaller) GEMM efficiency
            let row = self.figures_split([(i, 1.0)], SplitDim::Contracted);
            let bias = match sg.kn[&i] {
                (Some(k), Some(n)) => (own[4] - (k * n) as f64).max(0.0),
                _ => 0.0,
            };
            options.insert(options.len() - 1, self.opt(Strategy::Row, row[0] + self.row_fwd, row[1] + self.sp_ag + self.partial_grad(bias), own[4] / self.t, 0.0));
        }
        options
    }
}

/// Context parallelism.
impl Splitter<'_> {
    pub(super) fn matmul(&self, n: NodeId, os: &[i64]) -> Option<Decision> {
        let node = self.g.node(n);
        let (a, b) = (node.inputs.first().copied().flatten()?, node.inputs.get(1).copied().flatten()?);
        let (ra, rb, r) = (self.shape(a)?.len(), self.shape(b)?.len(), os.len());
        if ra < 2 || rb < 2 {
            return None;
        }
        let mut convert = Vec::new();
        let mut target = None;
        match self.tokens[a.index()] {
            Tokens::Local { axis, .. } if axis == ra - 1 => convert.push((0, Tokens::Whole)),
            Tokens::Local { axis, outer } => target = Some(Tokens::Local { axis: axis + (r - ra), outer }),
            Tokens::Whole => {}
        }
        match self.tokens[b.index()] {
            // a batch axis of b: the output's, unless a already holds the tokens elsewhere
            Tokens::Local { axis, outer } if axis + 2 < rb && target.is_none_or(|t| t == Tokens::Local { axis: axis + (r - rb), outer }) => {
                target = Some(Tokens::Local { axis: axis + (r - rb), outer });
            }
            Tokens::Local { .. } => convert.push((1, Tokens::Whole)),
            Tokens::Whole => {}
        }
        let Some(Tokens::Local { axis: ta, outer }) = target else { return Some(Decision { convert, out: Tokens::Whole, shape: None }) };
        // a whole operand's batch axis spanning the tokens is cut
        for (slot, v, rv) in [(0usize, a, ra), (1, b, rb)] {
            if convert.iter().any(|c| c.0 == slot) || self.tokens[v.index()] != Tokens::Whole {
                continue;
            }
            let off = r - rv;
            if ta >= off && ta - off + 2 < rv {
                let k = ta - off;
                let vs = self.shape(v)?;
                if vs[k] != 1 && vs[k] == os[ta] {
                    convert.push((slot, Tokens::Local { axis: k, outer }));
                }
            }
        }
        Some(Decision { convert, out: Tokens::Local { axis: ta, outer }, shape: None })
    }

    /// Gemm on local rows of A: its rows stay local, B whole, C cut like the rows.
    pub(super) fn gemm(&self, n: NodeId, os: &[i64]) -> Option<Decision> {
        let node = self.g.node(n);
        let tok = |i: usize| node.inputs.get(i).copied().flatten().map_or(Tokens::Whole, |v| self.tokens[v.index()]);
        let m_axis = if node.attrs.int("transA", 0) != 0 { 1 } else { 0 };
        match (tok(0), tok(1)) {
            (Tokens::Local { axis, outer }, b) if axis == m_axis => {
                let out = Tokens::Local { axis: 0, outer };
                let mut d = self.elementwise_operands(n, os, out, &[2]);
                if b != Tokens::Whole {
                    d.convert.push((1, Tokens::Whole));
                }
                Some(d)
            }
            _ => None,
        }
    }
}
