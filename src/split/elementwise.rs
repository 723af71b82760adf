//! Elementwise ops: unary ops follow their input; n-ary ops need equally split inputs (a
//! replicated full-size weight operand is sliced with them); partial sums pass linear ops only.
//! `ApplyRotary` splits as they do (its tables broadcast over the heads, sliced along the tokens
//! with `x`), except along its last axis, which its rotation mixes.

use std::collections::HashMap;

use super::context::{Decision, Splitter, Tokens};
use super::realise::{Prop, R, Sh};
use super::sequence::{Decision as SeqDecision, Seq, SeqLayer};
use crate::ir::{Node, NodeId, OpKind, ValueId};

/// Whether an op of the family run on a part of its output of `rank` axes, cut along `axis`,
/// computes that part: false only for `ApplyRotary` cut along its last axis.
fn splits_along(kind: Option<OpKind>, axis: usize, rank: usize) -> bool {
    kind != Some(OpKind::ApplyRotary) || axis + 1 < rank
}

impl Prop<'_, '_> {
    /// Unary ops (and views that map axes): the output takes the input's placement.
    pub(super) fn unary(&mut self, id: NodeId, kind: OpKind) -> R<()> {
        let n = self.g.node(id);
        let ins: Vec<Option<ValueId>> = n.inputs.clone();
        let outs = n.outputs.clone();
        let inp = |i: usize| ins.get(i).copied().flatten();
        let x = inp(0).unwrap_or(outs[0]);
        let s = self.state(x);
        let out = match s {
            Sh::Partial if matches!(kind, OpKind::Transpose | OpKind::Squeeze | OpKind::Unsqueeze | OpKind::Identity | OpKind::Neg) => Sh::Partial,
            Sh::Partial => return self.err("a partial sum reaches a nonlinear op"),
            Sh::Rep => Sh::Rep,
            Sh::Split { axis, outer, inner, origin } => {
                let axis = self.map_axis(id, kind, axis)?;
                Sh::Split { axis, outer, inner, origin }
            }
        };
        for &o in &outs {
            self.set(o, out);
        }
        Ok(())
    }

    /// N-ary elementwise ops: equally split inputs, sliced weight operands, linear partial sums.
    pub(super) fn elementwise(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let o = n.outputs[0];
        let kind = n.op.kind();
        let os = self.need_shape(o)?;
        let ins: Vec<Option<ValueId>> = n.inputs.clone();
        let mut split: Option<(usize, i64, i64, Option<ValueId>)> = None;
        let mut partial = 0;
        for v in ins.iter().flatten() {
            match self.state(*v) {
                Sh::Partial => partial += 1,
                Sh::Split { axis, outer, inner, origin } => {
                    let r = self.need_shape(*v)?.len();
                    let oa = axis + os.len() - r;
                    match split {
                        Some((a, ou, inn, o2)) if (a, ou, inn, self.rep(o2)) != (oa, outer, inner, self.rep(origin)) => {
                            return self.err("inputs are split differently");
                        }
                        _ => split = Some((oa, outer, inner, origin.or(split.and_then(|s| s.3)))),
                    }
                }
                Sh::Rep => {}
            }
        }
        if partial > 0 {
            // Linear uses of partial sums: sums of partials, scaling by a replicated value.
            let all_partial_float = ins.iter().flatten().all(|v| self.state(*v) == Sh::Partial || !self.is_float(*v));
            let ok = match kind {
                Some(OpKind::Add | OpKind::Sub) => all_partial_float && split.is_none(),
                Some(OpKind::Mul) => partial == 1 && split.is_none(),
                Some(OpKind::Div) => ins.first().copied().flatten().is_some_and(|v| self.state(v) == Sh::Partial) && partial == 1 && split.is_none(),
                _ => false,
            };
            if !ok {
                return self.err("a partial sum is combined non-linearly");
            }
            self.set(o, Sh::Partial);
            return Ok(());
        }
        let Some((axis, outer, inner, origin)) = split else {
            self.sh.insert(o, Sh::Rep);
            return Ok(());
        };
        if !splits_along(kind, axis, os.len()) {
            return self.err(format!("it works along the split axis {axis}"));
        }
        for v in ins.iter().flatten().copied() {
            if self.state(v) != Sh::Rep {
                continue;
            }
            let vs = self.need_shape(v)?;
            let off = os.len() - vs.len();
            if axis < off || vs[axis - off] == 1 {
                continue;
            }
            // A replicated full-size operand: slice it if it is a weight.
            if !(self.is_free_weight(v) && self.split_weight(v, axis - off, outer, inner)) {
                return self.err(format!("replicated operand `{}` would need slicing", self.g.value(v).name));
            }
        }
        self.sh.insert(o, Sh::Split { axis, outer, inner, origin });
        Ok(())
    }
}

/// Sequence parallelism.
impl SeqLayer<'_> {
    /// An elementwise op on token chunks: every token-split operand placed alike and as large
    /// as the output along the token axis; a replicated operand spanning the tokens is sliced.
    pub(super) fn elementwise(&self, node: &Node, seq: &HashMap<ValueId, Seq>, state: Seq, os: &[i64]) -> Option<SeqDecision> {
        if !splits_along(node.op.kind(), state.axis, os.len()) {
            return None;
        }
        let mut scatters = Vec::new();
        for (slot, v) in node.inputs.iter().enumerate() {
            let Some(v) = *v else { continue };
            let vs = self.shape(v)?;
            if let Some(s) = seq.get(&v) {
                if *s != state || vs.len() != os.len() || vs[state.axis] != os[state.axis] {
                    return None;
                }
                continue;
            }
            let off = os.len().checked_sub(vs.len())?;
            if state.axis < off || vs[state.axis - off] == 1 {
                continue;
            }
            if vs.len() != os.len() || vs[state.axis] != os[state.axis] {
                return None;
            }
            scatters.push((slot, v));
        }
        Some(SeqDecision { out: state, scatters, shape_entry: None })
    }
}

/// Context parallelism.
impl Splitter<'_> {
    /// Output tokens of an elementwise node: those of its first local input of full rank
    /// (else of a lower-rank one, aligned from the right); every other operand made to match.
    pub(super) fn elementwise(&self, n: NodeId, os: &[i64]) -> Option<Decision> {
        let node = self.g.node(n);
        let r = os.len();
        let mut target = None;
        for v in node.inputs.iter().flatten() {
            if let Tokens::Local { axis, outer } = self.tokens[v.index()] {
                let ri = self.shape(*v)?.len();
                let t = Tokens::Local { axis: axis + (r - ri.min(r)), outer };
                if ri == r {
                    target = Some(t);
                    break;
                }
                target.get_or_insert(t);
            }
        }
        if let Some(Tokens::Local { axis, .. }) = target
            && !splits_along(node.op.kind(), axis, r)
        {
            return None;
        }
        let all: Vec<usize> = (0..node.inputs.len()).collect();
        Some(self.elementwise_operands(n, os, target?, &all))
    }
}
