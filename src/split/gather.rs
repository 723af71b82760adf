//! Gathers: the vocabulary table splits by rows (a masked lookup whose output is a partial sum);
//! other gathers follow a table split on another axis.

use super::realise::{Prop, R, Sh};
use crate::ir::NodeId;

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
