//! Attention: the matmuls between two activations (scores and context) split by heads when both
//! operands are split alike (see [`Prop::matmul`]), and so does a fused
//! `ScaledDotProductAttention` ([`Prop::attention`]); grouped-query KV heads shared by several
//! ranks go through `repeat_kv`'s Expand here. The planner's attention cores are found in
//! [`super::analyse`].

use super::Strategy;
use super::context::{Decision, Splitter, Tokens};
use super::offer::{Feasible, Offer, Pricer};
use super::realise::{Fail, Prop, R, Sh};
use crate::ir::{NodeId, OpKind, ValueId};

impl Prop<'_, '_> {
    /// A fused `ScaledDotProductAttention(q, kᵀ, v, mask?)`: q, kᵀ and v split alike along one
    /// of their two leading axes (heads, or batch) run split, each rank attending over its
    /// heads; the output is split the same way. The mask is used whole where it broadcasts
    /// along that axis (size 1 there, as causal and padding masks `[b, 1, s, s]` are), split
    /// with the heads when it is split alike, sliced when it is a free weight, and refused
    /// otherwise, as an elementwise `Add` of it would be.
    pub(super) fn attention(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let o = n.outputs[0];
        let input = |i: usize| n.inputs.get(i).copied().flatten();
        let (Some(q), Some(kt), Some(v)) = (input(0), input(1), input(2)) else { return self.err("missing operand") };
        let mask = input(3);
        let mut split: Option<(usize, i64, i64, Option<ValueId>)> = None;
        for x in [q, kt, v] {
            let rank = self.need_shape(x)?.len();
            match self.state(x) {
                Sh::Split { axis, outer, inner, origin } if axis + 2 < rank => match split {
                    Some((a, ou, inn, o2)) if (a, ou, inn, self.rep(o2)) != (axis, outer, inner, self.rep(origin)) => {
                        return self.err("q, kᵀ and v are split differently");
                    }
                    _ => split = Some((axis, outer, inner, origin.or(split.and_then(|s| s.3)))),
                },
                Sh::Split { .. } => return self.err("q, kᵀ or v is split along an axis the scores contract or keep; attention splits by heads"),
                Sh::Partial => return self.err("a partial sum reaches attention"),
                Sh::Rep => return self.err(format!("`{}` is whole while another operand is split by heads", self.g.value(x).name)),
            }
        }
        let Some((axis, outer, inner, origin)) = split else { return self.err("no operand is split") };
        let rank = self.need_shape(o)?.len();
        if let Some(m) = mask {
            let ms = self.need_shape(m)?;
            let off = rank.checked_sub(ms.len()).ok_or_else(|| Fail::Error(self.unsupported_last("the mask has a higher rank than the scores".into())))?;
            match self.state(m) {
                Sh::Split { axis: ma, outer: mo, inner: mi, origin: morigin }
                    if (ma + off, mo, mi, self.rep(morigin)) == (axis, outer, inner, self.rep(origin)) => {}
                Sh::Split { .. } => return self.err("the mask is split other than the heads"),
                Sh::Partial => return self.err("the mask is a partial sum"),
                Sh::Rep => {
                    let broadcasts = axis < off || ms[axis - off] == 1;
                    if !broadcasts && !(self.is_free_weight(m) && self.split_weight(m, axis - off, outer, inner)) {
                        return self.err(format!("replicated mask `{}` would need slicing along the heads", self.g.value(m).name));
                    }
                }
            }
        }
        self.set(o, Sh::Split { axis, outer, inner, origin });
        Ok(())
    }

    /// Grouped-query attention's `repeat_kv` when `rep` ranks share each KV head: the Expand
    /// that repeats each head `n` times along `oaxis + 1` keeps `n / rep` copies per rank, and
    /// the Reshape that merges the two axes into query heads then holds this rank's query heads
    /// (a plain `t`-way split of the merged axis).
    pub(super) fn expand_shared_heads(&mut self, id: NodeId, oaxis: usize, outer: i64, inner: i64, rep: i64, origin: Option<ValueId>) -> R<()> {
        let n = self.g.node(id);
        let (Some(x), o) = (n.inputs.first().copied().flatten(), n.outputs[0]) else { return self.err("missing operand") };
        let xs = self.need_shape(x)?;
        let os = self.need_shape(o)?;
        let iaxis = oaxis + xs.len() - os.len();
        let slen = n.inputs.get(1).copied().flatten().and_then(|v| self.ints(v)).map_or(0, <[i64]>::len);
        let reshaped_only = self.s.uses[o.index()]
            .iter()
            .all(|&u| self.in_layer.contains(&u) && self.g.node(u).op.is(OpKind::Reshape) && self.g.node(u).inputs.first().copied().flatten() == Some(o));
        let copies = os.get(oaxis + 1).copied().unwrap_or(0);
        let fits = outer == 1
            && inner == 1
            && xs.get(iaxis + 1) == Some(&1)
            && copies % rep == 0
            && slen + oaxis >= os.len()
            && reshaped_only
            && !self.g.outputs.contains(&o);
        if !fits {
            return match origin {
                Some(weight) => Err(Fail::Replicate { weight }),
                None => self.err("a head shared by several ranks is expanded other than by repeat_kv"),
            };
        }
        let pos = slen + oaxis - os.len();
        self.shrink_shape_entry_by(id, 1, pos, os[oaxis], self.t / rep)?;
        self.shrink_shape_entry_by(id, 1, pos + 1, copies, rep)?;
        self.set(o, Sh::Split { axis: oaxis + 1, outer: 1, inner: copies / rep, origin: None });
        Ok(())
    }
}

/// Offers.
impl Pricer<'_> {
    /// Attention core `k` (its matmuls and the ops between them) split by heads, when its heads
    /// divide and every projection feeding it splits by columns, or whole.
    pub(super) fn core_offers(&self, f: &Feasible<'_>, k: usize) -> Vec<Offer> {
        let c = &f.sg.cores[k];
        let all = self.figures(c.nodes.iter().chain(c.matmuls.iter()).map(|&i| (i, 1.0)));
        let mut options = Vec::new();
        if f.core_ok[k] && c.producers.iter().all(|q| f.col_ok[q]) {
            options.push(self.opt(Strategy::Heads, all[0], all[1], all[4] / self.t, 0.0));
        }
        options.push(self.replicate(&all));
        options
    }
}

/// Context parallelism.
impl Splitter<'_> {
    /// The fused attention `softmax(scale·q·kᵀ + mask)·v`: queries local, keys and values
    /// gathered, the mask's rows cut to the queries.
    pub(super) fn attention(&self, n: NodeId) -> Option<Decision> {
        let node = self.g.node(n);
        let q = node.inputs.first().copied().flatten()?;
        let qs = self.shape(q)?.to_vec();
        let rq = qs.len();
        let mut convert = Vec::new();
        let out = match self.tokens[q.index()] {
            Tokens::Local { axis, outer } if axis + 1 < rq => Tokens::Local { axis, outer },
            Tokens::Local { .. } => {
                convert.push((0, Tokens::Whole));
                Tokens::Whole
            }
            Tokens::Whole => Tokens::Whole,
        };
        for slot in [1, 2] {
            if node.inputs.get(slot).copied().flatten().is_some_and(|v| self.tokens[v.index()] != Tokens::Whole) {
                convert.push((slot, Tokens::Whole));
            }
        }
        if let Some(m) = node.inputs.get(3).copied().flatten() {
            let ms = self.shape(m)?;
            let mt = self.tokens[m.index()];
            let Tokens::Local { axis: ta, outer } = out else {
                if mt != Tokens::Whole {
                    convert.push((3, Tokens::Whole));
                }
                return Some(Decision { convert, out, shape: None });
            };
            let off = rq.saturating_sub(ms.len());
            let aligned = (ta >= off).then(|| ta - off);
            let rows = aligned.map(|a| Tokens::Local { axis: a, outer });
            if Some(mt) != rows {
                match aligned {
                    Some(a) if ms[a] != 1 && ms[a] == qs[ta] => convert.push((3, Tokens::Local { axis: a, outer })),
                    _ if mt != Tokens::Whole => convert.push((3, Tokens::Whole)),
                    _ => {}
                }
            }
        }
        Some(Decision { convert, out, shape: None })
    }
}
