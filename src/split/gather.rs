//! Gathers: the vocabulary table splits by rows (a masked lookup whose output is a partial sum);
//! other gathers follow a table split on another axis.

use super::Strategy;
use super::axes::norm_axis;
use super::context::{Decision, Splitter, Tokens};
use super::emit::{Fresh, derived, i64_const, scalar_const};
use super::offer::{Offer, Pricer};
use super::realise::{Prop, R, Sh};
use crate::ir::{Attr, DType, Graph, GraphError, Node, NodeId, OpKind, PADDING_ROWS, ValueId, ValueKind};

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

/// Offers.
impl Pricer<'_> {
    /// The vocabulary table split by rows (where it is the vocabulary and its `rows` divide;
    /// one forward all-reduce), or whole.
    pub(super) fn embedding_offers(&self, (rows, is_vocab): (Option<i64>, bool), i: usize) -> Vec<Offer> {
        let own = self.figures([(i, 1.0)]);
        let mut options = Vec::new();
        if is_vocab && self.divides(rows) {
            options.push(self.opt(Strategy::Vocab, own[0] + self.ar, own[1], own[4] / self.t, 0.0));
        }
        options.push(self.replicate(&own));
        options
    }
}

/// Emission: the vocabulary-split lookup `node` on this rank's rows `[start, end)` of the table.
/// Ids outside them read row 0 and their rows are zeroed, so the output is this rank's part of a
/// sum: `where(in_range, gather(table, where(in_range, ids − start, 0)), 0)`.
pub fn emit_masked_gather(g: &mut Graph, node: &Node, (table, ids): (ValueId, ValueId), out: ValueId, (start, end): (i64, i64), id_dtype: DType, fresh: &Fresh) -> Result<(), GraphError> {
    let name = node.name.as_str();
    let fdt = g.value(table).ty.as_ref().map_or(DType::F32, |t| t.dtype);
    let cs = scalar_const(g, fresh.name(name, "vocab_start"), id_dtype, start)?;
    let ce = scalar_const(g, fresh.name(name, "vocab_end"), id_dtype, end)?;
    let zi = scalar_const(g, fresh.name(name, "zero_index"), id_dtype, 0)?;
    let zf = scalar_const(g, fresh.name(name, "zero"), fdt, 0)?;
    let axes = i64_const(g, fresh.name(name, "last_axis"), &[-1])?;
    let mut val = |what: &str| g.add_value(fresh.name(name, what), ValueKind::Intermediate, None, None);
    let (ge, lt, inr, sh, safe, got, m) = (val("ge")?, val("lt")?, val("in_range")?, val("shifted")?, val("safe")?, val("rows")?, val("mask")?);
    let mut lookup = derived(node, name.to_string(), OpKind::Gather, vec![table, safe], got);
    lookup.attrs.set("axis", Attr::Int(0));
    // padding rows of this rank's slice of the table, in its own row numbers
    let local: Vec<i64> = node.attrs.ints(PADDING_ROWS).unwrap_or(&[]).iter().filter(|&&p| (start..end).contains(&p)).map(|p| p - start).collect();
    if !local.is_empty() {
        lookup.attrs.set(PADDING_ROWS, Attr::Ints(local));
    }
    for n in [
        derived(node, fresh.name(name, "ge"), OpKind::GreaterOrEqual, vec![ids, cs], ge),
        derived(node, fresh.name(name, "lt"), OpKind::Less, vec![ids, ce], lt),
        derived(node, fresh.name(name, "and"), OpKind::And, vec![ge, lt], inr),
        derived(node, fresh.name(name, "sub"), OpKind::Sub, vec![ids, cs], sh),
        derived(node, fresh.name(name, "where_index"), OpKind::Where, vec![inr, sh, zi], safe),
        lookup,
        derived(node, fresh.name(name, "unsqueeze"), OpKind::Unsqueeze, vec![inr, axes], m),
        derived(node, fresh.name(name, "where_rows"), OpKind::Where, vec![m, got, zf], out),
    ] {
        g.add_node(n)?;
    }
    Ok(())
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
