//! Gathers: the vocabulary table splits by rows (a masked lookup whose output is a partial sum);
//! other gathers follow a table split on another axis.

use super::realise::{Prop, R, Sh};
use crate::ir::NodeId;
use super::axes::norm_axis;
use super::context::{Decision, Splitter, Tokens};

impl Prop<'_, '_> {
    pub(super) fn gather(&mut self, id: NodeId) -> R<()> {
        let n = self.g.node(id);
        let (Some(data), Some(idx)) = (n.inputs.first().copied().flatten(), n.inputs.get(1).copied().flatten()) else {
            return self.err("missing operand");
        };
        let o = n.outputs[0];
        let axis = n.attrs.int("axis", 0);
        let ds = self.need_shape(data)?;
        if self.state(idx) != Sh::Rep {
            return self.err("split indices");
        }
        if self.is_free_weight(data)
            && axis == 0
            && ds.len() == 2
            && Some(ds[0]) == self.s.vocab
            && ds[0] % self.t == 0
            && self.weight_src.get(&data).is_some_and(|(i, _)| *i == data)
            && self.split_weight(data, 0, 1, ds[0] / self.t)
        {
            self.gathers.push((n.name.clone(), data));
            self.set(o, Sh::Partial);
            return Ok(());
        }
        if self.is_free_weight(data) && axis == 0 && ds.len() == 2 && Some(ds[0]) == self.s.vocab {
            self.kept_whole.insert(data);
        }
        match self.state(data) {
            Sh::Rep => {
                self.sh.insert(o, Sh::Rep);
                Ok(())
            }
            Sh::Split { axis: sa, outer, inner, origin } if sa as i64 != axis && axis == 0 => {
                let ir = self.need_shape(idx)?.len();
                self.set(o, Sh::Split { axis: sa + ir - 1, outer, inner, origin });
                Ok(())
            }
            _ => self.err("gather from a split table"),
        }
    }
}

/// Context parallelism.
impl Splitter<'_> {
    /// A lookup: local rows of the table along another axis, or local indices into a whole
    /// table (token ids into an embedding), stay local.
    pub(super) fn gather(&self, n: NodeId) -> Option<Decision> {
        let node = self.g.node(n);
        let input = |i: usize| node.inputs.get(i).copied().flatten();
        let tok = |i: usize| input(i).map_or(Tokens::Whole, |v| self.tokens[v.index()]);
        let g_axis = self.shape(input(0).unwrap_or(*node.outputs.first()?)).and_then(|s| norm_axis(node.attrs.int("axis", 0), s.len()));
        let ri = input(1).and_then(|v| self.shape(v)).map_or(0, <[i64]>::len);
        match (tok(0), tok(1), g_axis) {
            (Tokens::Local { axis, outer }, Tokens::Whole, Some(g)) if axis != g => {
                let k = if axis < g { axis } else { axis + ri - 1 };
                Some(Decision::to(Tokens::Local { axis: k, outer }))
            }
            (Tokens::Whole, Tokens::Local { axis, outer }, Some(g)) => Some(Decision::to(Tokens::Local { axis: g + axis, outer })),
            _ => None,
        }
    }
}
