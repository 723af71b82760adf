//! Which axes an op works along: the one reading of a node's axis attributes and inputs that
//! every token and tensor rule shares (a norm, softmax, reduction, scan or slice can run on a
//! part of its input only along the other axes).

use crate::ir::{Node, OpKind};
use crate::passes::shape_infer::{self, ShapeInfo};

/// Normalises a possibly negative `axis` against `rank`; None when out of range.
pub fn norm_axis(axis: i64, rank: usize) -> Option<usize> {
    let a = if axis < 0 { axis + rank as i64 } else { axis };
    (a >= 0 && (a as usize) < rank.max(1)).then_some(a as usize)
}

/// The axes of `node`'s first input (of `rank` axes) that the op combines or selects along:
/// the normalised axes of LayerNormalization and RMSNormalization (`axis` to the last), Softmax, LogSoftmax, TopK,
/// LpNormalization, ArgMax, ArgMin and CumSum, the reduced axes of the reductions, the sliced axes of Slice.
/// `None` for other ops and where the axes are not known (an axes input not evaluated).
/// Nodes are in the importer's canonical form: defaulted axes are written out, axes that
/// became inputs are inputs.
pub fn touched_axes(node: &Node, info: &ShapeInfo, rank: usize) -> Option<Vec<usize>> {
    use OpKind::*;
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let axis = |default: i64| norm_axis(node.attrs.int("axis", default), rank);
    match node.op.kind()? {
        LayerNormalization | RMSNormalization => Some((axis(-1)?..rank).collect()),
        Softmax | LogSoftmax | TopK | LpNormalization => Some(vec![axis(-1)?]),
        ArgMax | ArgMin => Some(vec![axis(0)?]),
        CumSum => Some(vec![norm_axis(*info.ints(input(1)?)?.first()?, rank)?]),
        k if k.is_reduction() => shape_infer::reduced_axes(node, info, rank),
        Slice => match input(3) {
            Some(a) => info.ints(a)?.iter().map(|&a| norm_axis(a, rank)).collect(),
            None => Some((0..info.ints(input(1)?)?.len()).collect()),
        },
        _ => None,
    }
}

/// Whether `node`'s output keeps every axis of its input (false for a reduction or ArgMax
/// with `keepdims` 0, whose touched axes disappear).
pub fn keeps_axes(node: &Node) -> bool {
    use OpKind::*;
    match node.op.kind() {
        Some(k) if k.is_reduction() || matches!(k, ArgMax | ArgMin) => node.attrs.int("keepdims", 1) == 1,
        _ => true,
    }
}
