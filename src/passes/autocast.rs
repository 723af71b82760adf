//! The element type each value has in a mixed-precision run (`torch.autocast`, as the runner
//! executes `bf16-mixed` and `fp16-mixed`): what the figures pass prices those runs' bytes at.
//!
//! Floating-point graph inputs, parameters and constants are fp32. A value made by a `Low` op
//! ([`crate::ir::AutocastClass`]) is in the low type; by an `Fp32` op, fp32; by an `AsIs` op,
//! its inputs' promoted type (torch's rules: fp32 if any dimensioned float input is fp32; a
//! zero-dim one counts only when no dimensioned float input exists). What a `Low` op keeps for
//! its backward are its low-type casts of its inputs: a copy of its own when the input is fp32
//! (besides the fp32 original, if another reader keeps that), the value itself when it is
//! already low ([`super::figures::compute_at`], which reads these types).

use crate::ir::{AutocastClass, DType, Graph, NodeId, OpKind, ValueKind};

/// Per value (by index), its element type in an autocast run computing its products in `low`
/// (`None` where the graph does not know the value's type). `order`: the nodes in execution
/// order.
pub fn dtypes(graph: &Graph, order: &[NodeId], low: DType) -> Vec<Option<DType>> {
    let declared = |v: crate::ir::ValueId| graph.value(v).ty.as_ref().map(|t| t.dtype);
    let mut out: Vec<Option<DType>> = graph.value_ids().map(declared).collect();
    for v in graph.value_ids() {
        let val = graph.value(v);
        if matches!(val.kind, ValueKind::Input | ValueKind::Initializer | ValueKind::Constant) && out[v.index()].is_some_and(|d| d.is_float()) {
            out[v.index()] = Some(DType::F32);
        }
    }
    for &id in order {
        let node = graph.node(id);
        let Some(kind) = node.op.kind() else { continue };
        let input = |i: usize| node.inputs.get(i).copied().flatten().and_then(|v| out[v.index()]);
        let run = match kind.autocast_class() {
            AutocastClass::Low => Some(low),
            AutocastClass::Fp32 => Some(DType::F32),
            AutocastClass::Inside => input(0),
            AutocastClass::AsIs => match kind {
                // an explicit type: the node's own
                OpKind::Cast | OpKind::ConstantOfShape | OpKind::Range | OpKind::Constant => None,
                OpKind::CastLike => input(1),
                // the kernels return x's type (layer norm casts back; pow keeps the base's)
                OpKind::LayerNormalization | OpKind::Pow | OpKind::Pad | OpKind::ScatterND | OpKind::ScatterElements => input(0),
                _ => promoted(graph, node, &out),
            },
        };
        for &o in &node.outputs {
            if let (Some(d), Some(decl)) = (run, out[o.index()])
                && decl.is_float()
                && d.is_float()
            {
                out[o.index()] = Some(d);
            }
        }
    }
    out
}

/// torch's type promotion over `node`'s floating-point inputs (their run types in `dtypes`):
/// the widest of the dimensioned ones, else of the zero-dim ones; `None` without float inputs.
fn promoted(graph: &Graph, node: &crate::ir::Node, dtypes: &[Option<DType>]) -> Option<DType> {
    let floats = || node.inputs.iter().flatten().filter_map(|&v| dtypes[v.index()].filter(|d| d.is_float()).map(|d| (v, d)));
    let zero_dim = |v: crate::ir::ValueId| graph.value(v).ty.as_ref().and_then(|t| t.shape.as_ref()).is_some_and(|s| s.rank() == 0);
    let widest = |it: &mut dyn Iterator<Item = DType>| it.max_by_key(|d| (d.size_bytes(), *d == DType::F32));
    widest(&mut floats().filter(|&(v, _)| !zero_dim(v)).map(|(_, d)| d)).or_else(|| widest(&mut floats().map(|(_, d)| d)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DimBindings;
    use crate::passes::testutil::Builder;

    #[test]
    fn products_are_low_and_elementwise_ops_promote() {
        // y = x·W (low); r = x + y (fp32 + low: fp32); z = y · s, s zero-dim fp32 (low);
        // n = RMSNorm(r, w) (fp32); q = Softmax(y) (low)
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["2", "4"]);
        let w = b.param("w", DType::F32, &[4, 4]);
        let s = b.param("s", DType::F32, &[]);
        let nw = b.param("nw", DType::F32, &[4]);
        let y = b.node(OpKind::MatMul, &[x, w], &[]);
        let r = b.node(OpKind::Add, &[x, y], &[]);
        let z = b.node(OpKind::Mul, &[y, s], &[]);
        let n = b.node(OpKind::RMSNormalization, &[r, nw], &[]);
        let q = b.node(OpKind::Softmax, &[y], &[]);
        let mut g = b.g;
        crate::passes::shape_infer::infer_shapes(&mut g, &DimBindings::default()).unwrap();
        let order = g.topo_order().unwrap();
        let d = dtypes(&g, &order, DType::BF16);
        let at = |v: crate::ir::ValueId| d[v.index()];
        assert_eq!((at(x), at(w), at(y)), (Some(DType::F32), Some(DType::F32), Some(DType::BF16)));
        assert_eq!((at(r), at(z), at(n), at(q)), (Some(DType::F32), Some(DType::BF16), Some(DType::F32), Some(DType::BF16)));
    }
}
