//! Slice assignments that build a tensor piece by piece become one `Concat`.
//!
//! PyTorch code that fills an empty tensor by slices (`k = x.new_empty(...); k[..., :a] = p;
//! k[..., a:] = r`, DeepSeek's latent-attention key) is exported as a chain of `ScatterND`s onto
//! a `ConstantOfShape`, each writing a range of rows of axis 0; an assignment along another axis
//! is spelled between two `Transpose`s that bring that axis to the front and back. Where the
//! chain's ranges tile the axis exactly (no gap, no overlap), the base is overwritten everywhere
//! and the result is the `Concat` of the pieces along that axis, an op every stage can split
//! (heads stay split through it); anything else is left as it is.
//!
//! The rewrite keeps ids: the chain's last node (the last `ScatterND`, or the `Transpose` that
//! brings the axis back) becomes the `Concat` (same id, same output) reading the pieces as they
//! were before their `Transpose`s; the chain's other nodes are removed, and what made the base
//! and the indices is left to dead-node removal (a base may be shared). The pass is part of
//! [`super::specialise`], which the runner applies to the model it loads, so planner and runner
//! address the same graph without a record in the plan.

use crate::ir::{Attr, Attrs, Graph, NodeId, Op, OpKind, ValueId};
use super::fuse::readers;

/// Rewrites every exactly covering slice-assignment chain of `graph` into a `Concat`; returns
/// how many it rewrote.
pub fn concat_slice_assignments(graph: &mut Graph) -> usize {
    let Ok(order) = graph.topo_order() else { return 0 };
    let mut done = 0;
    // counted once, and again only after a rewrite changes who reads what
    let mut counts = readers(graph);
    for id in order {
        if graph.try_node(id).is_none() {
            continue;
        }
        let Some(m) = find(graph, &counts, id) else { continue };
        let node = graph.node_mut(m.concat);
        node.op = Op::Known(OpKind::Concat);
        let mut attrs = Attrs::default();
        attrs.set("axis", Attr::Int(m.axis));
        node.attrs = attrs;
        node.inputs = m.pieces.iter().map(|&v| Some(v)).collect();
        graph.set_input(m.concat, 0, Some(m.pieces[0]));
        if let Some(perm) = m.then_transpose {
            graph.node_mut(id).attrs.set("perm", Attr::Ints(perm));
            // the reused ScatterND's output is now in the pieces' layout: inference retypes it
            let out = graph.node(m.concat).outputs[0];
            graph.value_mut(out).ty = None;
        }
        for n in m.remove {
            graph.remove_node(n);
        }
        counts = readers(graph);
        done += 1;
    }
    done
}

/// A chain found at its last node.
struct Chain {
    /// The node that becomes the `Concat`: the last node, or the last `ScatterND` where the
    /// last node is a `Transpose` that does more than bring the axis back.
    concat: NodeId,
    /// The pieces in axis order (their values before the frame's `Transpose`).
    pieces: Vec<ValueId>,
    /// The concatenation axis in the pieces' layout.
    axis: i64,
    /// The last node's new permutation, where it stays a `Transpose` after the `Concat`.
    then_transpose: Option<Vec<i64>>,
    /// The chain's nodes to remove.
    remove: Vec<NodeId>,
}

/// The permutation of Transpose node `n` (reversed axes without `perm`), if its rank is known.
fn perm_of(g: &Graph, n: NodeId) -> Option<Vec<usize>> {
    let node = g.node(n);
    let rank = g.value(node.inputs.first().copied().flatten()?).ty.as_ref()?.shape.as_ref()?.rank();
    let perm: Vec<usize> = match node.attrs.ints("perm") {
        Some(p) => p.iter().map(|&a| usize::try_from(a).ok()).collect::<Option<_>>()?,
        None => (0..rank).rev().collect(),
    };
    let mut seen = vec![false; rank];
    for &a in &perm {
        if a >= rank || std::mem::replace(&mut seen[a], true) {
            return None;
        }
    }
    (perm.len() == rank).then_some(perm)
}

fn inverse(p: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; p.len()];
    for (i, &a) in p.iter().enumerate() {
        inv[a] = i;
    }
    inv
}

/// The node making `v` when it is `op` with one output read once.
fn only_reader_of(g: &Graph, readers: &[usize], v: ValueId, op: OpKind) -> Option<NodeId> {
    let p = g.value(v).producer?;
    let n = g.node(p);
    (n.op.is(op) && n.outputs.len() == 1 && readers[v.index()] == 1).then_some(p)
}

/// `Transpose` node making `v` by `perm`, read once.
fn transposed_by(g: &Graph, readers: &[usize], v: ValueId, perm: &[usize]) -> Option<NodeId> {
    only_reader_of(g, readers, v, OpKind::Transpose).filter(|&n| perm_of(g, n).as_deref() == Some(perm))
}

/// Whether `v` holds a value fixed before the run: a constant, an initializer that is not
/// trained, or a `ConstantOfShape` (an empty tensor as exporters spell it).
fn is_fixed(g: &Graph, v: ValueId) -> bool {
    let val = g.value(v);
    match val.producer {
        None => val.data.is_some() && !super::figures::is_trainable(g, v),
        Some(p) => g.node(p).op.is(OpKind::ConstantOfShape),
    }
}

/// The rows `[start, start + n)` of axis 0 a `ScatterND` with `[n, 1]` constant indices writes,
/// if they are consecutive and ascending.
fn rows(g: &Graph, scatter: NodeId, len: i64) -> Option<(i64, i64)> {
    let node = g.node(scatter);
    if node.inputs.len() != 3 || node.attrs.str("reduction").is_some_and(|r| r != "none") {
        return None;
    }
    let idx = g.value(node.inputs[1]?);
    let t = idx.data.as_ref().filter(|_| idx.producer.is_none())?;
    if t.dims.len() != 2 || t.dims[1] != 1 {
        return None;
    }
    let vals = t.to_i64_vec()?;
    let start = *vals.first()?;
    let consecutive = vals.iter().enumerate().all(|(i, &r)| r == start + i as i64);
    (consecutive && start >= 0 && start + (vals.len() as i64) <= len).then_some((start, vals.len() as i64))
}

/// The chain ending at node `last`, if its ranges tile the axis exactly.
fn find(g: &Graph, readers: &[usize], last: NodeId) -> Option<Chain> {
    let node = g.node(last);
    // the last ScatterND, and the Transpose after it, if any
    let (mut scatter, after) = match node.op.kind()? {
        OpKind::ScatterND => (last, None),
        OpKind::Transpose => {
            let s = only_reader_of(g, readers, node.inputs.first().copied().flatten()?, OpKind::ScatterND)?;
            (s, Some(perm_of(g, last)?))
        }
        _ => return None,
    };
    let first_scatter = scatter;
    // the frame: the permutation bringing the assigned axis to the front (the updates'
    // Transpose), or none
    let update = g.node(scatter).inputs.get(2).copied().flatten()?;
    let frame = only_reader_of(g, readers, update, OpKind::Transpose).and_then(|t| perm_of(g, t));
    if frame.is_some() && after.is_none() {
        return None;
    }
    let data_of = |s: NodeId| g.node(s).inputs.first().copied().flatten();
    let len = g.value(data_of(scatter)?).ty.as_ref()?.shape.as_ref()?.0.first()?.known()?;
    let mut remove = Vec::new();
    let mut ranges: Vec<(i64, i64, ValueId)> = Vec::new();
    loop {
        let (start, n) = rows(g, scatter, len)?;
        let update = g.node(scatter).inputs[2]?;
        let piece = match &frame {
            Some(p) => {
                let t = transposed_by(g, readers, update, p)?;
                remove.push(t);
                g.node(t).inputs.first().copied().flatten()?
            }
            None => update,
        };
        ranges.push((start, n, piece));
        if scatter != first_scatter {
            remove.push(scatter);
        }
        let data = data_of(scatter)?;
        // the previous assignment of the chain, brought into the frame and back
        let previous = match &frame {
            Some(p) => transposed_by(g, readers, data, p).and_then(|t1| {
                let back = transposed_by(g, readers, g.node(t1).inputs.first().copied().flatten()?, &inverse(p))?;
                let s = only_reader_of(g, readers, g.node(back).inputs.first().copied().flatten()?, OpKind::ScatterND)?;
                Some((s, [t1, back]))
            }),
            None => only_reader_of(g, readers, data, OpKind::ScatterND).map(|s| (s, [s, s])),
        };
        match previous {
            Some((s, via)) => {
                if frame.is_some() {
                    remove.extend(via);
                }
                scatter = s;
            }
            None => {
                // the base: fixed, directly or through the frame's Transpose
                let base_fixed = is_fixed(g, data)
                    || frame.as_ref().is_some_and(|p| {
                        g.value(data).producer.is_some_and(|t| {
                            g.node(t).op.is(OpKind::Transpose)
                                && perm_of(g, t).as_deref() == Some(p.as_slice())
                                && g.node(t).inputs.first().copied().flatten().is_some_and(|b| is_fixed(g, b))
                        })
                    });
                if !base_fixed {
                    return None;
                }
                break;
            }
        }
    }
    ranges.sort_by_key(|r| r.0);
    let mut at = 0;
    for &(start, n, _) in &ranges {
        if start != at {
            return None;
        }
        at += n;
    }
    if at != len {
        return None;
    }
    let axis = frame.as_ref().map_or(0, |p| p[0] as i64);
    let pieces = ranges.into_iter().map(|r| r.2).collect();
    // the last Transpose of the Concat's output in the frame: `frame` then `after`
    let then = after.map(|q| q.iter().map(|&i| frame.as_ref().map_or(i, |p| p[i]) as i64).collect::<Vec<i64>>());
    match then {
        Some(r) if r.iter().enumerate().any(|(i, &a)| a != i as i64) => {
            Some(Chain { concat: first_scatter, pieces, axis, then_transpose: Some(r), remove })
        }
        Some(_) => {
            remove.push(first_scatter);
            Some(Chain { concat: last, pieces, axis, then_transpose: None, remove })
        }
        None => Some(Chain { concat: last, pieces, axis, then_transpose: None, remove }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, Tensor};
    use crate::passes::testutil::Builder;

    /// Rows `start..start + n` as ScatterND indices `[n, 1]`.
    fn rows_idx(b: &mut Builder, start: i64, n: i64) -> ValueId {
        let v: Vec<i64> = (start..start + n).collect();
        b.constant(Tensor::from_i64(vec![n, 1], &v))
    }

    /// `key[..., a:b] = piece` for each `(a, b)` in order, onto an empty `[2, 4, 3, D]` tensor,
    /// as the exporter writes it (a Transpose bringing the last axis to the front and back).
    /// Returns the graph, the output and the pieces in axis order.
    fn chain(ranges: &[(i64, i64)], d: i64) -> (Graph, ValueId, Vec<ValueId>) {
        chain_then(ranges, d, &[3, 1, 2, 0])
    }

    /// [`chain`] whose last Transpose is by `last` (the exporter merges the one bringing the
    /// axis back with a later one).
    fn chain_then(ranges: &[(i64, i64)], d: i64, last: &[i64]) -> (Graph, ValueId, Vec<ValueId>) {
        let mut b = Builder::new();
        let perm = Attr::Ints(vec![3, 1, 2, 0]);
        let shape = b.ints(&[2, 4, 3, d]);
        let base = b.node(OpKind::ConstantOfShape, &[shape], &[]);
        let mut cur = base;
        let mut pieces = Vec::new();
        for (i, &(a, e)) in ranges.iter().enumerate() {
            let piece = b.input(&format!("p{i}"), DType::F32, &["2", "4", "3", &(e - a).to_string()]);
            pieces.push((a, piece));
            let t = b.node(OpKind::Transpose, &[cur], &[("perm", perm.clone())]);
            let idx = rows_idx(&mut b, a, e - a);
            let u = b.node(OpKind::Transpose, &[piece], &[("perm", perm.clone())]);
            let s = b.node(OpKind::ScatterND, &[t, idx, u], &[("reduction", Attr::Str("none".into()))]);
            let back = if i + 1 == ranges.len() { Attr::Ints(last.to_vec()) } else { perm.clone() };
            cur = b.node(OpKind::Transpose, &[s], &[("perm", back)]);
        }
        let out = b.node(OpKind::Relu, &[cur], &[]);
        b.output(out);
        let mut g = b.g;
        let dims = crate::ir::DimBindings::default();
        crate::passes::shape_infer::infer_shapes(&mut g, &dims).unwrap();
        pieces.sort_by_key(|p| p.0);
        (g, cur, pieces.into_iter().map(|p| p.1).collect())
    }

    fn count(g: &Graph, k: OpKind) -> usize {
        g.node_ids().filter(|&n| g.node(n).op.is(k)).count()
    }

    /// The chain became one Concat of the pieces, in axis order, along the last axis.
    fn assert_concat(ranges: &[(i64, i64)], d: i64) {
        let (mut g, out, pieces) = chain(ranges, d);
        let last = g.value(out).producer.unwrap();
        assert_eq!(concat_slice_assignments(&mut g), 1);
        crate::passes::dce::remove_dead_nodes(&mut g);
        g.verify().unwrap();
        let node = g.node(last);
        assert!(node.op.is(OpKind::Concat), "{}", node.op);
        assert_eq!(node.attrs.int_opt("axis"), Some(3));
        assert_eq!(node.inputs, pieces.iter().map(|&p| Some(p)).collect::<Vec<_>>());
        assert_eq!(g.node_count(), 2, "only the Concat and the Relu remain");
        assert_eq!(count(&g, OpKind::ScatterND) + count(&g, OpKind::Transpose) + count(&g, OpKind::ConstantOfShape), 0);
        crate::passes::shape_infer::infer_shapes(&mut g, &Default::default()).unwrap();
        assert_eq!(g.value(out).ty.as_ref().unwrap().shape.as_ref().unwrap().known(), Some(vec![2, 4, 3, d]));
    }

    #[test]
    fn two_pieces_covering_the_axis_become_a_concat() {
        assert_concat(&[(0, 4), (4, 6)], 6);
    }

    #[test]
    fn three_pieces_covering_the_axis_become_a_concat() {
        assert_concat(&[(0, 1), (1, 5), (5, 8)], 8);
    }

    #[test]
    fn pieces_assigned_in_reverse_order_concatenate_in_axis_order() {
        assert_concat(&[(5, 8), (1, 5), (0, 1)], 8);
    }

    #[test]
    fn a_last_transpose_that_does_more_stays_after_the_concat() {
        let (mut g, out, pieces) = chain_then(&[(0, 4), (4, 6)], 6, &[3, 1, 0, 2]);
        let last = g.value(out).producer.unwrap();
        let scatter = g.node(last).inputs[0].and_then(|v| g.value(v).producer).unwrap();
        assert_eq!(concat_slice_assignments(&mut g), 1);
        crate::passes::dce::remove_dead_nodes(&mut g);
        g.verify().unwrap();
        // the Transpose by [3, 1, 0, 2] of the frame [3, 1, 2, 0]: swaps the last two axes
        assert_eq!(g.node(last).attrs.ints("perm"), Some(&[0, 1, 3, 2][..]));
        let cat = g.node(scatter);
        assert!(cat.op.is(OpKind::Concat), "{}", cat.op);
        assert_eq!(cat.attrs.int_opt("axis"), Some(3));
        assert_eq!(cat.inputs, pieces.iter().map(|&p| Some(p)).collect::<Vec<_>>());
        assert_eq!(g.node_count(), 3);
        crate::passes::shape_infer::infer_shapes(&mut g, &Default::default()).unwrap();
        assert_eq!(g.value(out).ty.as_ref().unwrap().shape.as_ref().unwrap().known(), Some(vec![2, 4, 6, 3]));
    }

    fn assert_untouched(ranges: &[(i64, i64)], d: i64) {
        let (mut g, _, _) = chain(ranges, d);
        let before = g.node_count();
        assert_eq!(concat_slice_assignments(&mut g), 0);
        assert_eq!(g.node_count(), before);
        assert_eq!(count(&g, OpKind::ScatterND), ranges.len());
        assert_eq!(count(&g, OpKind::Concat), 0);
    }

    #[test]
    fn a_partial_cover_is_left_untouched() {
        assert_untouched(&[(0, 4), (4, 5)], 6);
        assert_untouched(&[(1, 6)], 6);
    }

    #[test]
    fn overlapping_pieces_are_left_untouched() {
        assert_untouched(&[(0, 4), (3, 6)], 6);
        assert_untouched(&[(0, 4), (2, 4), (4, 6)], 6);
    }

    #[test]
    fn an_assignment_onto_a_computed_base_is_left_untouched() {
        // the same chain onto `x` itself (not an empty tensor)
        let mut b = Builder::new();
        let perm = Attr::Ints(vec![1, 0]);
        let x = b.input("x", DType::F32, &["3", "4"]);
        let p = b.input("p", DType::F32, &["3", "4"]);
        let t = b.node(OpKind::Transpose, &[x], &[("perm", perm.clone())]);
        let idx = rows_idx(&mut b, 0, 4);
        let u = b.node(OpKind::Transpose, &[p], &[("perm", perm.clone())]);
        let s = b.node(OpKind::ScatterND, &[t, idx, u], &[]);
        let out = b.node(OpKind::Transpose, &[s], &[("perm", perm)]);
        b.output(out);
        let mut g = b.g;
        crate::passes::shape_infer::infer_shapes(&mut g, &Default::default()).unwrap();
        assert_eq!(concat_slice_assignments(&mut g), 0);
    }

    #[test]
    fn rows_of_axis_zero_need_no_transpose() {
        let mut b = Builder::new();
        let shape = b.ints(&[5, 2]);
        let base = b.node(OpKind::ConstantOfShape, &[shape], &[]);
        let p0 = b.input("p0", DType::F32, &["2", "2"]);
        let p1 = b.input("p1", DType::F32, &["3", "2"]);
        let i1 = rows_idx(&mut b, 2, 3);
        let s1 = b.node(OpKind::ScatterND, &[base, i1, p1], &[]);
        let i0 = rows_idx(&mut b, 0, 2);
        let s0 = b.node(OpKind::ScatterND, &[s1, i0, p0], &[]);
        b.output(s0);
        let mut g = b.g;
        crate::passes::shape_infer::infer_shapes(&mut g, &Default::default()).unwrap();
        let last = g.value(s0).producer.unwrap();
        assert_eq!(concat_slice_assignments(&mut g), 1);
        crate::passes::dce::remove_dead_nodes(&mut g);
        g.verify().unwrap();
        assert_eq!(g.node(last).inputs, vec![Some(p0), Some(p1)]);
        assert_eq!(g.node(last).attrs.int_opt("axis"), Some(0));
        assert_eq!(g.node_count(), 1);
    }
}
