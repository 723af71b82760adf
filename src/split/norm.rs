//! Norms and reductions (Softmax, LayerNormalization, Reduce*, CumSum, Slice): they run split
//! only when they do not work along the split axis; a norm's scale and bias stay whole.

use super::realise::{Prop, R, Sh, norm_axis};
use crate::ir::{NodeId, OpKind, ValueId};

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
        let touched: Vec<usize> = match kind {
            Softmax | LogSoftmax => vec![norm_axis(n.attrs.int("axis", -1), rank).unwrap_or(rank)],
            LayerNormalization => {
                let a = norm_axis(n.attrs.int("axis", -1), rank).unwrap_or(0);
                (a..rank).collect()
            }
            CumSum => inp(1).and_then(|v| self.ints(v)).map(|a| a.iter().filter_map(|&a| norm_axis(a, rank)).collect()).unwrap_or_default(),
            Slice => {
                let starts = inp(1).and_then(|v| self.ints(v)).map_or(0, <[i64]>::len);
                match inp(3).and_then(|v| self.ints(v)) {
                    Some(a) => a.iter().filter_map(|&a| norm_axis(a, rank)).collect(),
                    None => (0..starts).collect(),
                }
            }
            _ => {
                let axes: Vec<i64> = inp(1).and_then(|v| self.ints(v)).map(<[i64]>::to_vec).unwrap_or_default();
                if axes.is_empty() { (0..rank).collect() } else { axes.iter().filter_map(|&a| norm_axis(a, rank)).collect() }
            }
        };
        if touched.contains(&axis) {
            return self.err(format!("it works along the split axis {axis}"));
        }
        if kind == LayerNormalization {
            for (i, s) in states.iter().enumerate().skip(1) {
                if *s != Sh::Rep || inp(i).is_some_and(|v| self.weights.contains_key(&v)) {
                    return self.err("split norm weights");
                }
            }
        }
        let keep = !matches!(kind, ReduceMean | ReduceSum | ReduceMax) || n.attrs.int("keepdims", 1) == 1;
        let axis = if keep { axis } else { axis - touched.iter().filter(|&&a| a < axis).count() };
        self.set(outs[0], Sh::Split { axis, outer, inner, origin });
        for &o in &outs[1..] {
            self.sh.insert(o, Sh::Split { axis, outer, inner, origin });
        }
        Ok(())
    }
}
