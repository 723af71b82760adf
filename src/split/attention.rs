//! Attention: the matmuls between two activations (scores and context) split by heads when both
//! operands are split alike (see [`Prop::matmul`]); grouped-query KV heads shared by several
//! ranks go through `repeat_kv`'s Expand here. The planner's attention cores are found in
//! [`super::analyse`].

use super::realise::{Fail, Prop, R, Sh};
use crate::ir::{NodeId, OpKind, ValueId};

impl Prop<'_, '_> {
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
