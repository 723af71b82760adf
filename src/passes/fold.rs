//! Constant folding of shape arithmetic: nodes whose (single) output is a small integer tensor
//! that shape inference evaluated become constants. Values that depend on a symbolic dim
//! (batch, sequence) stay computed, so the graph still runs at any size the export allowed:
//! inference is repeated with every symbol perturbed and only values equal in both runs fold.
//! Float tensors are never folded, except `Constant` nodes, which become constant values.

use std::collections::BTreeMap;

use super::PassError;
use super::shape_infer::{self, MAX_EVAL_ELEMS, ShapeInfo};
use crate::ir::{Attr, DType, Dim, DimBindings, Graph, OpKind, Storage, Tensor, ValueKind};

/// Folds what can be folded; returns the number of nodes replaced by constants.
pub fn fold_constants(graph: &mut Graph, dims: &DimBindings, info: &ShapeInfo) -> Result<usize, PassError> {
    // Integers can only depend on a symbolic dim through Shape or Size.
    let reads_shapes = graph.node_ids().any(|n| graph.node(n).op.is(OpKind::Shape) || graph.node(n).op.is(OpKind::Size));
    let perturbed: BTreeMap<String, i64> = if reads_shapes {
        dims.values.iter().map(|(k, &v)| (k.clone(), v.saturating_mul(2).saturating_add(1))).collect()
    } else {
        BTreeMap::new()
    };
    let other = if perturbed.is_empty() {
        None
    } else {
        match shape_infer::infer(graph, &perturbed, false) {
            Ok(o) => Some(o),
            Err(e) => {
                tracing::debug!(error = %e, "inference at perturbed dims failed; folding only symbol-free arithmetic");
                None
            }
        }
    };
    let structurally_tainted = if other.is_none() && !perturbed.is_empty() { shape_taint(graph)? } else { Vec::new() };
    let order = graph.topo_order()?;
    let mut folded = 0;
    for id in order {
        let node = graph.node(id);
        if node.op.is(OpKind::Constant) {
            if let Some(t) = constant_tensor(graph, id) {
                graph.fold_to_constant(id, t);
                folded += 1;
            }
            continue;
        }
        if node.outputs.len() != 1 || node.op.kind().is_none() {
            continue;
        }
        let out = node.outputs[0];
        if graph.outputs.contains(&out) {
            continue;
        }
        let Some(vals) = info.ints(out) else { continue };
        let Some(ty) = info.types[out.index()].as_ref() else { continue };
        let Some(shape) = ty.shape.as_ref() else { continue };
        if !(ty.dtype.is_int() || ty.dtype == DType::Bool) || vals.len() > MAX_EVAL_ELEMS {
            continue;
        }
        let stable = match &other {
            Some(o) => o.ints(out) == Some(vals) && o.types[out.index()].as_ref() == Some(ty),
            None => perturbed.is_empty() || !structurally_tainted[out.index()],
        };
        if !stable {
            continue;
        }
        let t = int_tensor(ty.dtype, shape.clone(), vals);
        graph.fold_to_constant(id, t);
        folded += 1;
    }
    Ok(folded)
}

/// Values downstream of a Shape/Size node (used when the perturbed run is unavailable).
fn shape_taint(graph: &Graph) -> Result<Vec<bool>, PassError> {
    let mut taint = vec![false; graph.value_count()];
    let symbolic_inputs = graph.inputs.iter().any(|&v| {
        graph.value(v).ty.as_ref().and_then(|t| t.shape.as_ref()).is_some_and(|s| s.0.iter().any(|d| matches!(d, Dim::Sym(_))))
    });
    for id in graph.topo_order()? {
        let node = graph.node(id);
        let t = (symbolic_inputs && (node.op.is(OpKind::Shape) || node.op.is(OpKind::Size)))
            || node.inputs.iter().flatten().any(|v| taint[v.index()]);
        for &o in &node.outputs {
            taint[o.index()] = t;
        }
    }
    Ok(taint)
}

/// The tensor a `Constant` node holds.
fn constant_tensor(graph: &Graph, id: crate::ir::NodeId) -> Option<Tensor> {
    let a = &graph.node(id).attrs;
    if let Some(Attr::Tensor(t)) = a.get("value")
        && !matches!(t.storage, Storage::External(_))
    {
        return Some(t.clone());
    }
    a.int_opt("value_int")
        .map(|v| Tensor::from_i64(vec![], &[v]))
        .or_else(|| a.ints("value_ints").map(|v| Tensor::from_i64(vec![v.len() as i64], v)))
        .or_else(|| a.get("value_float").map(|_| Tensor::from_f32(vec![], &[a.float("value_float", 0.0)])))
        .or_else(|| a.floats("value_floats").map(|v| Tensor::from_f32(vec![v.len() as i64], v)))
}

/// An integer or bool tensor of `dtype` holding `vals`.
pub fn int_tensor(dtype: DType, dims: Vec<i64>, vals: &[i64]) -> Tensor {
    let size = dtype.size_bytes() as usize;
    let mut bytes = Vec::with_capacity(vals.len() * size);
    for &v in vals {
        bytes.extend_from_slice(&v.to_le_bytes()[..size.min(8)]);
    }
    Tensor { dtype, dims, storage: Storage::Raw(bytes.into()) }
}

/// True if the value is a constant (folded or initializer) — helper for later passes.
pub fn is_constant(graph: &Graph, v: crate::ir::ValueId) -> bool {
    matches!(graph.value(v).kind, ValueKind::Constant | ValueKind::Initializer)
}

#[cfg(test)]
mod tests {
    use crate::ir::{DType, OpKind, ValueKind};
    use crate::passes::testutil::{Gpt, gpt};
    use crate::passes::{AnalyzeOptions, analyze};

    fn cfg(batch: Option<i64>, seq: Option<i64>) -> Gpt {
        Gpt {
            blocks: 2,
            hidden: 64,
            heads: 4,
            vocab: 100,
            ffn: 256,
            batch,
            seq,
            dtype: DType::F32,
            namespaces: true,
            layer_names: true,
        }
    }

    fn count(lg: &crate::ir::LayeredGraph, k: OpKind) -> usize {
        lg.graph.node_ids().filter(|&n| lg.graph.node(n).op.is(k)).count()
    }

    #[test]
    fn fixed_dims_fold_the_whole_shape_chain() {
        let lg = analyze(gpt(cfg(Some(2), Some(8))), &AnalyzeOptions::default()).unwrap();
        assert_eq!(count(&lg, OpKind::Shape), 0);
        assert_eq!(count(&lg, OpKind::Concat), 0);
        for n in lg.graph.node_ids() {
            let node = lg.graph.node(n);
            if node.op.is(OpKind::Reshape) {
                let t = node.inputs[1].unwrap();
                assert_eq!(lg.graph.value(t).kind, ValueKind::Constant);
                let v = lg.graph.value(t).data.as_ref().unwrap().to_i64_vec().unwrap();
                assert!(v == vec![2, 8, 4, 16] || v == vec![2, 8, 64], "{v:?}");
            }
        }
    }

    #[test]
    fn symbolic_dims_stay_computed_so_the_graph_runs_at_any_size() {
        let lg = analyze(gpt(cfg(None, None)), &AnalyzeOptions { seq_len: Some(8), ..Default::default() }).unwrap();
        assert_eq!(count(&lg, OpKind::Shape), 1);
        assert_eq!(count(&lg, OpKind::Concat), 2);
        // Shapes are still inferred at the bound sizes.
        let out = lg.graph.outputs[0];
        let s = lg.graph.value(out).ty.as_ref().unwrap().shape.as_ref().unwrap().known().unwrap();
        assert_eq!(s, vec![1, 8, 100]);
    }
}
