//! Norms and reductions (Softmax, LayerNormalization, RMSNormalization, Reduce*, CumSum, Slice, TopK, ArgMax,
//! LpNormalization): they run split, on token chunks or on local tokens only when they do not
//! work along the split or token axis; a norm's scale and bias stay whole.

use std::collections::HashMap;

use super::axes::{keeps_axes, touched_axes};
use super::context::{Decision, Splitter, Tokens};
use super::realise::{Prop, R, Sh};
use super::sequence::{Decision as SeqDecision, Seq, SeqLayer};
use crate::ir::{Node, NodeId, OpKind, ValueId};

impl Prop<'_, '_> {
    /// Norm-like ops over axes other than the split one.
    pub(super) fn norm(&mut self, id: NodeId, kind: OpKind) -> R<()> {
        let n = self.g.node(id);
        let ins: Vec<Option<ValueId>> = n.inputs.clone();
        let outs = n.outputs.clone();
        let inp = |i: usize| ins.get(i).copied().flatten();
        let states: Vec<Sh> = ins.iter().map(|v| v.map_or(Sh::Rep, |v| self.state(v))).collect();
        use OpKind::*;
        let x = inp(0).unwrap_or(outs[0]);
        let Sh::Split { axis, outer, inner, origin } = self.state(x) else {
            return self.err("a partial sum reaches a normalisation");
        };
        let rank = self.need_shape(x)?.len();
        let Some(touched) = touched_axes(n, &self.s.info, rank) else {
            return self.err("the axes it works along are not known");
        };
        if touched.contains(&axis) {
            return self.err(format!("it works along the split axis {axis}"));
        }
        if matches!(kind, LayerNormalization | RMSNormalization) {
            for (i, s) in states.iter().enumerate().skip(1) {
                if *s != Sh::Rep || inp(i).is_some_and(|v| self.weights.contains_key(&v)) {
                    return self.err("split norm weights");
                }
            }
        }
        let axis = if keeps_axes(n) { axis } else { axis - touched.iter().filter(|&&a| a < axis).count() };
        self.set(outs[0], Sh::Split { axis, outer, inner, origin });
        for &o in &outs[1..] {
            self.sh.insert(o, Sh::Split { axis, outer, inner, origin });
        }
        Ok(())
    }
}

/// Sequence parallelism.
impl SeqLayer<'_> {
    /// A norm, softmax or reduction kept on token chunks when it works along other axes and its
    /// scale and bias broadcast over the tokens. The other ops of the family (scans, top-k,
    /// slices, argmax and the rest of the reductions) read their tokens gathered.
    pub(super) fn norm(&self, node: &Node, seq: &HashMap<ValueId, Seq>, state: Seq) -> Option<SeqDecision> {
        use OpKind::*;
        if !matches!(node.op.kind()?, LayerNormalization | RMSNormalization | Softmax | LogSoftmax | ReduceMean | ReduceSum | ReduceMax | ReduceMin) {
            return None;
        }
        let x = node.inputs.first().copied().flatten()?;
        if seq.get(&x) != Some(&state) || node.inputs.iter().skip(1).flatten().any(|v| seq.contains_key(v)) {
            return None;
        }
        let rank = self.shape(x)?.len();
        if !keeps_axes(node) {
            return None;
        }
        let touched = touched_axes(node, self.info, rank)?;
        if touched.is_empty() || touched.contains(&state.axis) {
            return None;
        }
        // scale and bias of a norm: broadcast over the tokens
        for v in node.inputs.iter().skip(1).flatten() {
            let vs = self.shape(*v)?;
            let off = rank.checked_sub(vs.len())?;
            if state.axis >= off && vs[state.axis - off] != 1 {
                return None;
            }
        }
        Some(SeqDecision { out: state, scatters: Vec::new(), shape_entry: None })
    }
}

/// Context parallelism.
impl Splitter<'_> {
    /// An op along some axes on local tokens: local where it does not work along the token
    /// axis and its other operands are whole.
    pub(super) fn reduction(&self, n: NodeId) -> Option<Decision> {
        let node = self.g.node(n);
        let x = node.inputs.first().copied().flatten()?;
        let Tokens::Local { axis, outer } = self.tokens[x.index()] else { return None };
        if node.inputs.iter().skip(1).flatten().any(|v| self.tokens[v.index()] != Tokens::Whole) {
            return None;
        }
        let touched = touched_axes(node, &self.info, self.shape(x)?.len())?;
        if touched.contains(&axis) {
            return None;
        }
        let k = if keeps_axes(node) { axis } else { axis - touched.iter().filter(|&&a| a < axis).count() };
        Some(Decision::to(Tokens::Local { axis: k, outer }))
    }
}
