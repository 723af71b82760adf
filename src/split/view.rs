//! Views: Reshape, Transpose/Squeeze/Unsqueeze (axis mapping), Split, Concat, Expand. A split
//! axis survives a view when a rank's block stays contiguous; shape operands shrink with it.

use std::collections::HashMap;

use super::context::{Decision, Splitter, Tokens};
use super::realise::{Fail, Prop, R, Sh, gcd, lcm, norm_axis};
use super::rewrite::{ConstantRewrite, NodeRewrite, PartialGradient};
use super::sequence::{Decision as SeqDecision, Seq, SeqLayer};
use crate::ir::{Node, NodeId, OpKind, ValueId, ValueKind};

impl Prop<'_, '_> {
    /// Reshape: the split axis moves to the output axis holding the same block; partial sums stay partial.
    pub(super) fn reshape(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let ins: Vec<Option<ValueId>> = n.inputs.clone();
        let outs = n.outputs.clone();
        let inp = |i: usize| ins.get(i).copied().flatten();
        let (x, o) = (inp(0).unwrap_or(outs[0]), outs[0]);
        match self.state(x) {
            Sh::Partial => {
                self.set(o, Sh::Partial);
                Ok(())
            }
            Sh::Split { axis, inner, origin, .. } => {
                let is = self.need_shape(x)?;
                let os = self.need_shape(o)?;
                let s_in: i64 = is[axis + 1..].iter().product();
                let ways = self.ways(origin);
                let find = |digit: i64, ways: i64| {
                    (0..os.len()).find_map(|k| {
                        let sk: i64 = os[k + 1..].iter().product();
                        (os[k] > 1 && digit % sk == 0 && (sk * os[k]) % (digit * ways) == 0)
                            .then(|| (k, digit / sk, os[k] * sk / (digit * ways)))
                    })
                };
                let Some((k, inner_k, outer_k)) = find(s_in * inner, ways) else {
                    // Fewer whole heads than ways (grouped-query KV heads): let `rep`
                    // ranks share each head, if that makes it survive.
                    if let Some(w) = origin
                        && self.rep(origin) == 1
                        && let Some(rep) = (2..=self.t).find(|&rep| self.t % rep == 0 && find(s_in * inner * rep, self.t / rep).is_some())
                    {
                        return Err(Fail::Replicas { weight: w, rep });
                    }
                    return self.err("the split axis does not survive the reshape");
                };
                self.shrink_shape_entry_by(id, 1, k, os[k], ways)?;
                self.set(o, Sh::Split { axis: k, outer: outer_k, inner: inner_k, origin });
                Ok(())
            }
            Sh::Rep => {
                self.sh.insert(o, Sh::Rep);
                Ok(())
            }
        }
    }

    /// Concat of equally placed inputs, not along the split axis.
    pub(super) fn concat(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let ins: Vec<Option<ValueId>> = n.inputs.clone();
        let outs = n.outputs.clone();
        let states: Vec<Sh> = ins.iter().map(|v| v.map_or(Sh::Rep, |v| self.state(v))).collect();
        let o = outs[0];
        let rank = self.need_shape(o)?.len();
        let cat = norm_axis(n.attrs.int("axis", 0), rank).unwrap_or(0);
        let first = states.iter().copied().find(|s| *s != Sh::Rep).unwrap_or(Sh::Rep);
        if let Sh::Split { axis, outer: 1, .. } = first
            && axis != cat
            && states.iter().all(|s| *s == first || *s == Sh::Rep)
        {
            for (slot, s) in states.iter().enumerate() {
                if let (Sh::Rep, Some(v)) = (s, ins[slot]) {
                    self.expand_into_heads(v, id, axis, first)?;
                }
            }
        }
        let states: Vec<Sh> = ins.iter().map(|v| v.map_or(Sh::Rep, |v| self.state(v))).collect();
        if states.iter().any(|s| *s != first) {
            return self.err("inputs are placed differently");
        }
        if let Sh::Split { axis, .. } = first
            && axis == cat
        {
            return self.err("it concatenates along the split axis");
        }
        self.set(o, first);
        Ok(())
    }

    /// A whole operand `v` of Concat `cat` beside ones split along `axis` (heads): when an
    /// Expand in the layer makes it from one head broadcast over all of them (latent
    /// attention's rotary key) and only `cat` reads it, that Expand yields this rank's heads
    /// instead, and the gradient it sends back is this rank's part (all-reduced). Otherwise
    /// `v` stays whole (and the Concat refuses).
    fn expand_into_heads(&mut self, v: ValueId, cat: NodeId, axis: usize, split: Sh) -> R<()> {
        let Some(&e) = self.nodes.iter().find(|&&n| self.g.node(n).outputs.contains(&v)) else { return Ok(()) };
        let en = self.g.node(e);
        let Some(x) = en.inputs.first().copied().flatten() else { return Ok(()) };
        let only_cat = self.s.uses[v.index()].iter().all(|&u| u == cat) && !self.g.outputs.contains(&v);
        if !en.op.is(OpKind::Expand) || !only_cat || self.state(x) != Sh::Rep {
            return Ok(());
        }
        let (xs, os) = (self.need_shape(x)?, self.need_shape(v)?);
        let Some(xaxis) = (axis + xs.len()).checked_sub(os.len()) else { return Ok(()) };
        if xs.get(xaxis) != Some(&1) || os[axis] % self.t != 0 {
            return Ok(());
        }
        let slen = en.inputs.get(1).copied().flatten().and_then(|s| self.ints(s)).map_or(0, <[i64]>::len);
        let Some(pos) = (slen + axis).checked_sub(os.len()) else { return Ok(()) };
        self.shrink_shape_entry_by(e, 1, pos, os[axis], self.t)?;
        if self.s.grad[x.index()] {
            self.partial_gradients.push(PartialGradient { node: en.name.clone(), input: 0, value: self.g.value(x).name.clone() });
        }
        self.set(v, split);
        Ok(())
    }

    /// Expand keeps the split axis (shifted by the new leading axes); shared KV heads see [`Prop::expand_shared_heads`].
    pub(super) fn expand(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let ins: Vec<Option<ValueId>> = n.inputs.clone();
        let outs = n.outputs.clone();
        let inp = |i: usize| ins.get(i).copied().flatten();
        let (x, o) = (inp(0).unwrap_or(outs[0]), outs[0]);
        match self.state(x) {
            Sh::Split { axis, outer, inner, origin } => {
                let xr = self.need_shape(x)?.len();
                let os = self.need_shape(o)?;
                let oaxis = axis + os.len() - xr;
                let slen = inp(1).and_then(|v| self.ints(v)).map_or(0, <[i64]>::len);
                let rep = self.rep(origin);
                if rep > 1 {
                    return self.expand_shared_heads(id, oaxis, outer, inner, rep, origin);
                }
                if slen + oaxis >= os.len() {
                    let pos = slen + oaxis - os.len();
                    self.shrink_shape_entry(id, 1, pos, os[oaxis])?;
                }
                self.set(o, Sh::Split { axis: oaxis, outer, inner, origin });
                Ok(())
            }
            _ => self.err("a partial sum reaches Expand"),
        }
    }

    /// The output axis of a unary-shaped op for input split axis `axis`.
    pub(super) fn map_axis(&self, id: NodeId, kind: OpKind, axis: usize) -> R<usize> {
        let n = self.g.node(id);
        let x = n.inputs[0].unwrap_or(n.outputs[0]);
        let xr = self.need_shape(x)?.len();
        let orank = self.need_shape(n.outputs[0])?.len();
        let axes = || -> Vec<i64> {
            n.inputs.get(1).copied().flatten().and_then(|v| self.ints(v)).map(<[i64]>::to_vec).unwrap_or_default()
        };
        Ok(match kind {
            OpKind::Transpose => {
                let perm: Vec<usize> = match n.attrs.ints("perm") {
                    Some(p) => p.iter().map(|&a| a as usize).collect(),
                    None => (0..xr).rev().collect(),
                };
                match perm.iter().position(|&p| p == axis) {
                    Some(a) => a,
                    None => return self.err("bad perm"),
                }
            }
            OpKind::Unsqueeze => {
                let mut ax: Vec<usize> = axes().iter().filter_map(|&a| norm_axis(a, orank)).collect();
                ax.sort_unstable();
                let mut a = axis;
                for &u in &ax {
                    if u <= a {
                        a += 1;
                    }
                }
                a
            }
            OpKind::Squeeze => {
                let ax: Vec<usize> = axes().iter().filter_map(|&a| norm_axis(a, xr)).collect();
                if ax.contains(&axis) {
                    return self.err("it squeezes the split axis");
                }
                axis - ax.iter().filter(|&&a| a < axis).count()
            }
            _ => axis,
        })
    }

    pub(super) fn split(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let x = n.inputs[0].unwrap_or(n.outputs[0]);
        let outs = n.outputs.clone();
        let xs = self.need_shape(x)?;
        let ax = norm_axis(n.attrs.int("axis", 0), xs.len()).unwrap_or(0);
        match self.state(x) {
            Sh::Partial => {
                for &o in &outs {
                    self.set(o, Sh::Partial);
                }
                Ok(())
            }
            Sh::Split { axis, outer, inner, origin } if axis != ax => {
                for &o in &outs {
                    self.set(o, Sh::Split { axis, outer, inner, origin });
                }
                Ok(())
            }
            Sh::Split { outer, inner, origin, .. } => {
                let d = xs[ax];
                let sizes: Vec<i64> = outs.iter().map(|&o| self.shape(o).map_or(0, |s| s[ax])).collect();
                let block = self.ways(origin) * inner;
                if sizes.iter().any(|&s| s % block != 0) {
                    let mut g = d;
                    let mut acc = 0;
                    for s in &sizes {
                        acc += s;
                        g = gcd(g, acc);
                    }
                    let need = lcm(outer, d / g.max(1));
                    return match origin {
                        Some(w) if need != outer && d % (need * self.ways(origin)) == 0 => Err(Fail::Demand { weight: w, outer: need }),
                        _ => self.err("the split sizes cut through a rank's block"),
                    };
                }
                if let Some(sv) = n.inputs.get(1).copied().flatten() {
                    let val = self.g.value(sv);
                    let Some(vals) = self.ints(sv).map(<[i64]>::to_vec) else {
                        return self.err("split sizes are not computable");
                    };
                    let ways = self.ways(origin);
                    let new_values: Vec<i64> = vals.iter().map(|v| v / ways).collect();
                    if matches!(val.kind, ValueKind::Constant | ValueKind::Initializer) {
                        self.constant_rewrites.push(ConstantRewrite { node: n.name.clone(), input: 1, value: val.name.clone(), new_values });
                    } else {
                        self.rewrites.push(NodeRewrite::DivideShape { node: n.name.clone(), input: 1, divisors: vec![ways; vals.len()] });
                    }
                }
                for (&o, &s) in outs.iter().zip(&sizes) {
                    self.set(o, Sh::Split { axis: ax, outer: s / block, inner, origin });
                }
                Ok(())
            }
            Sh::Rep => Ok(()),
        }
    }
}

/// Sequence parallelism.
impl SeqLayer<'_> {
    /// A Reshape that keeps each token's chunk in one axis: the tokens land there; a target
    /// entry naming the global token count shrinks by t.
    pub(super) fn reshape(&self, node: &Node, seq: &HashMap<ValueId, Seq>, state: Seq, os: &[i64]) -> Option<SeqDecision> {
        let x = node.inputs.first().copied().flatten()?;
        if seq.get(&x) != Some(&state) {
            return None;
        }
        let is = self.shape(x)?;
        let len = is[state.axis] / state.outer;
        let blocks = is[..state.axis].iter().product::<i64>() * state.outer;
        let post: i64 = is[state.axis + 1..].iter().product();
        let k = (0..os.len()).find(|&k| os[k + 1..].iter().product::<i64>() == post && os[k] % len == 0 && os[..k].iter().product::<i64>() * (os[k] / len) == blocks)?;
        let target = node.inputs.get(1).copied().flatten()?;
        let vals = self.info.ints(target)?;
        let entry = *vals.get(k)?;
        let copies_split = entry == 0 && node.attrs.int("allowzero", 0) == 0 && k == state.axis && is[k] == os[k];
        if !(entry == -1 || entry == os[k] || copies_split) {
            return None;
        }
        let shape_entry = (entry == os[k]).then_some((k, os[k]));
        let flat = k == 0 && (state.flat || state.axis > 0);
        Some(SeqDecision { out: Seq { axis: k, outer: os[k] / len, flat }, scatters: Vec::new(), shape_entry })
    }
}

/// Context parallelism.
impl Splitter<'_> {
    /// A view that keeps the tokens in one axis: where they land; a Reshape's explicit token
    /// entry shrinks by `c`.
    pub(super) fn view(&self, n: NodeId, os: &[i64], reshape: bool) -> Option<Decision> {
        let node = self.g.node(n);
        let x = node.inputs.first().copied().flatten()?;
        let Tokens::Local { axis, outer } = self.tokens[x.index()] else { return None };
        let is = self.shape(x)?;
        let len = is[axis] / outer;
        let blocks = is[..axis].iter().product::<i64>() * outer;
        let post: i64 = is[axis + 1..].iter().product();
        let k = (0..os.len()).find(|&k| {
            os[k + 1..].iter().product::<i64>() == post && len > 0 && os[k] % len == 0 && os[..k].iter().product::<i64>() * (os[k] / len) == blocks
        })?;
        let out = Tokens::Local { axis: k, outer: os[k] / len };
        if !reshape {
            return Some(Decision::to(out));
        }
        let target = node.inputs.get(1).copied().flatten()?;
        let vals = self.info.ints(target)?.to_vec();
        let entry = *vals.get(k)?;
        let copies = entry == 0 && node.attrs.int("allowzero", 0) == 0 && k == axis && is[k] == os[k];
        let shape = if entry == os[k] {
            let mut v = vec![1; vals.len()];
            v[k] = self.cp;
            Some((1, v))
        } else if entry == -1 || copies {
            None
        } else {
            return None;
        };
        Some(Decision { convert: Vec::new(), out, shape })
    }

    /// An Expand made to yield `out` (its input cut where it spans the tokens, a target entry
    /// that names them divided).
    pub(super) fn expand_to(&self, n: NodeId, os: &[i64], out: Tokens) -> Option<Decision> {
        let node = self.g.node(n);
        let Tokens::Local { axis: a, outer } = out else { return None };
        let x = node.inputs.first().copied().flatten()?;
        let xs = self.shape(x)?;
        let off = os.len().checked_sub(xs.len())?;
        let mut convert = Vec::new();
        if a >= off && xs[a - off] != 1 && xs[a - off] == os[a] {
            convert.push((0, Tokens::Local { axis: a - off, outer }));
        }
        let vals = self.info.ints(node.inputs.get(1).copied().flatten()?)?;
        let i = a.checked_sub(os.len().checked_sub(vals.len())?);
        let shape = i.filter(|&i| vals[i] == os[a] && vals[i] != 1).map(|i| {
            let mut d = vec![1; vals.len()];
            d[i] = self.cp;
            (1, d)
        });
        Some(Decision { convert, out, shape })
    }

    pub(super) fn expand(&self, n: NodeId, os: &[i64]) -> Option<Decision> {
        let node = self.g.node(n);
        let x = node.inputs.first().copied().flatten()?;
        let Tokens::Local { axis, outer } = self.tokens[x.index()] else { return None };
        let rx = self.shape(x)?.len();
        let k = axis + (os.len() - rx.min(os.len()));
        let vals = self.info.ints(node.inputs.get(1).copied().flatten()?)?.to_vec();
        let off = os.len() - vals.len().min(os.len());
        let shape = match k.checked_sub(off).and_then(|i| vals.get(i).map(|&e| (i, e))) {
            Some((i, e)) if e == os[k] && e != 1 => {
                let mut v = vec![1; vals.len()];
                v[i] = self.cp;
                Some((1, v))
            }
            _ => None,
        };
        Some(Decision { convert: Vec::new(), out: Tokens::Local { axis: k, outer }, shape })
    }

    /// A transpose moves the token axis where the permutation puts it.
    pub(super) fn transpose(&self, n: NodeId, os: &[i64]) -> Option<Decision> {
        let node = self.g.node(n);
        let Tokens::Local { axis, outer } = self.tokens[node.inputs.first().copied().flatten()?.index()] else { return None };
        let perm: Vec<i64> = node.attrs.ints("perm").map(<[i64]>::to_vec).unwrap_or_else(|| (0..os.len() as i64).rev().collect());
        perm.iter().position(|&p| p as usize == axis).map(|k| Decision::to(Tokens::Local { axis: k, outer }))
    }

    /// A split along another axis keeps the tokens local in every part.
    pub(super) fn split(&self, n: NodeId, os: &[i64]) -> Option<Decision> {
        let node = self.g.node(n);
        let Tokens::Local { axis, outer } = self.tokens[node.inputs.first().copied().flatten()?.index()] else { return None };
        let a = norm_axis(node.attrs.int("axis", 0), os.len());
        (a != Some(axis)).then(|| Decision::to(Tokens::Local { axis, outer }))
    }

    /// A concat along another axis: every operand brought to the first local one's tokens.
    pub(super) fn concat(&self, n: NodeId, os: &[i64]) -> Option<Decision> {
        let node = self.g.node(n);
        let a = norm_axis(node.attrs.int("axis", 0), os.len());
        let first = node.inputs.iter().flatten().find_map(|v| match self.tokens[v.index()] {
            Tokens::Local { axis, outer } if self.shape(*v).is_some_and(|s| s.len() == os.len()) => Some(Tokens::Local { axis, outer }),
            _ => None,
        });
        match first {
            Some(Tokens::Local { axis, outer }) if a != Some(axis) => {
                let all: Vec<usize> = (0..node.inputs.len()).collect();
                Some(self.elementwise_operands(n, os, Tokens::Local { axis, outer }, &all))
            }
            _ => None,
        }
    }

}
