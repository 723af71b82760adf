//! Rebinding a fixed batch: a graph exported at batch `B` (torch.onnx's default, fixed shapes)
//! rewritten to run microbatches of another size, as tensor-parallel shards rewrite head counts.
//!
//! What a fixed batch leaves in a graph, and how it is rewritten (node and value ids kept):
//! - graph inputs whose first dim is `B`: that dim becomes the new size;
//! - integer shape operands (`Reshape` and `Expand` targets, `ConstantOfShape` shapes) whose
//!   first entry is `B` or a multiple `B·m` (GPT-2's `[B, S, H]` reshapes, and its `[B·S, H]`
//!   flattening before each `Gemm`): that entry, to the new size (times `m`);
//! - frozen constants whose first dim is `B > 1` and whose `B` slices are equal (causal masks
//!   folded as `[B, 1, S, S]`, positions gathered per sample): one slice, repeated.
//!
//! At `B = 1` only entries equal to 1 are rewritten (a flattened `[S, H]` cannot be told from
//! a weight's shape), and leading-1 constants are left to broadcast.
//!
//! The rewrite is proven by shape inference: the rewritten graph is inferred at two probe sizes
//! that no dim of the graph has, and every value's shape (and every evaluated shape tensor)
//! must, dim by dim, either stay what it was at `B` or be `B·m` there and the probe size times
//! `m` in both probes. Anything else (a batch hidden in a later entry, a per-sample constant
//! that differs between samples, a node whose shapes no longer fit) refuses the rebinding with
//! [`PassError::FixedBatch`], which names the fixed batch and how to re-export.

use crate::ir::{DType, Dim, Graph, OpKind, Shape, Storage, Tensor, TensorType, ValueId, ValueKind};

use super::shape_infer::{self, ShapeInfo};
use super::{AnalyzeOptions, PassError};

/// What [`rebind_batch`] changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rebatched {
    /// The batch the graph fixed.
    pub from: i64,
    /// The batch it now runs.
    pub to: i64,
    /// Graph inputs whose batch dim was rebound.
    pub inputs: Vec<String>,
    /// Shape operands whose batch entry was rewritten.
    pub shape_constants: Vec<String>,
    /// Constants cut (or repeated) to the new batch.
    pub constants: Vec<String>,
}

/// The rewrite, found once and applied at any size.
struct Rewrite {
    from: i64,
    input: String,
    inputs: Vec<ValueId>,
    shape_constants: Vec<ValueId>,
    constants: Vec<ValueId>,
}

/// The batch the graph fixes: the first dim of its first input, when known.
pub fn fixed_batch(graph: &Graph) -> Option<(String, i64)> {
    let v = graph.value(*graph.inputs.first()?);
    match v.ty.as_ref()?.shape.as_ref()?.0.first()? {
        Dim::Known(b) if *b > 0 => Some((v.name.clone(), *b)),
        _ => None,
    }
}

/// Rewrites `graph`, whose batch is fixed, to run batches of `to` samples, and re-infers its
/// intermediates' types. A graph whose batch is symbolic, or already `to`, is left as is
/// (`None`). `opts` binds the other dims as analysis does.
pub fn rebind_batch(graph: &mut Graph, to: i64, opts: &AnalyzeOptions) -> Result<Option<Rebatched>, PassError> {
    let Some((input, from)) = fixed_batch(graph) else { return Ok(None) };
    if to == from {
        return Ok(None);
    }
    if to <= 0 {
        return Err(PassError::BadBinding(format!("microbatch size {to}: must be positive")));
    }
    let rw = prove(graph, opts)?;
    let _ = input;
    apply(graph, &rw, to);
    let dims = shape_infer::bind_dims(graph, opts)?;
    shape_infer::infer_shapes(graph, &dims).map_err(|e| refuse(&rw, to, format!("after the rewrite, {e}")))?;
    let names = |ids: &[ValueId]| ids.iter().map(|&v| graph.value(v).name.clone()).collect();
    Ok(Some(Rebatched { from, to, inputs: names(&rw.inputs), shape_constants: names(&rw.shape_constants), constants: names(&rw.constants) }))
}

/// Whether the fixed batch of `graph` can be rebound to another size: `Ok` for a symbolic
/// batch too; the error says why not.
pub fn check(graph: &Graph, opts: &AnalyzeOptions) -> Result<(), PassError> {
    if fixed_batch(graph).is_none() {
        return Ok(());
    }
    prove(graph, opts).map(|_| ())
}

fn refuse(rw: &Rewrite, to: i64, reason: String) -> PassError {
    PassError::FixedBatch { batch: rw.from, input: rw.input.clone(), to: Some(to), reason }
}

/// Finds the rewrite and proves it by inference at two probe sizes.
fn prove(graph: &Graph, opts: &AnalyzeOptions) -> Result<Rewrite, PassError> {
    let (input, from) = fixed_batch(graph).ok_or_else(|| PassError::BadBinding("the batch is not fixed".into()))?;
    let dims = shape_infer::bind_dims(graph, opts)?;
    let info = shape_infer::infer(graph, &dims.values, false)?;
    let rw = find(graph, &input, from);
    // two consecutive sizes no dim or shape entry of the graph has
    let mut used: std::collections::HashSet<i64> = std::collections::HashSet::new();
    for t in info.types.iter().flatten() {
        used.extend(t.shape.iter().flatten().copied());
    }
    for x in info.ints.iter().flatten().filter(|x| x.len() <= 16) {
        used.extend(x.iter().copied());
    }
    let q = (2..).find(|q| !used.contains(q) && !used.contains(&(q + 1))).unwrap_or(2);
    let mut probes: Vec<(i64, ShapeInfo)> = Vec::new();
    for p in [q, q + 1] {
        let mut g = graph.clone();
        apply(&mut g, &rw, p);
        let pi = shape_infer::infer(&g, &dims.values, false).map_err(|e| {
            PassError::FixedBatch { batch: from, input: input.clone(), to: None, reason: format!("rebound to a batch of {p}, {e}") }
        })?;
        probes.push((p, pi));
    }
    let fail = |v: ValueId, what: String| {
        let val = graph.value(v);
        let at = match val.producer {
            Some(n) => format!("`{}` (output of node `{}`, {})", val.name, graph.node(n).name, graph.node(n).op),
            None => format!("`{}`", val.name),
        };
        PassError::FixedBatch { batch: from, input: input.clone(), to: None, reason: format!("{at} {what}") }
    };
    let (q1, i1) = &probes[0];
    let (q2, i2) = &probes[1];
    // a dim stays, or is the batch times a fixed factor (`B·S` where a reshape flattens)
    let follows = |d0: i64, d1: i64, d2: i64| {
        (d0 == d1 && d1 == d2) || (d0 > 0 && d0 % from == 0 && d1 == d0 / from * q1 && d2 == d0 / from * q2)
    };
    for v in graph.value_ids() {
        let Some(s0) = info.types[v.index()].as_ref().and_then(|t| t.shape.as_ref()) else { continue };
        let s1 = i1.types[v.index()].as_ref().and_then(|t| t.shape.as_ref());
        let s2 = i2.types[v.index()].as_ref().and_then(|t| t.shape.as_ref());
        let (Some(s1), Some(s2)) = (s1, s2) else {
            return Err(fail(v, format!("has shape {s0:?} at batch {from} but no known shape when rebound")));
        };
        if s1.len() != s0.len() || s2.len() != s0.len() || (0..s0.len()).any(|i| !follows(s0[i], s1[i], s2[i])) {
            return Err(fail(v, format!("has shape {s0:?} at batch {from} but {s1:?} / {s2:?} rebound to {q1} / {q2}: a dim neither follows the batch nor stays fixed")));
        }
        // evaluated integers of a batch-independent shape (shape tensors, not per-sample data
        // such as gathered rows, whose shape the check above followed)
        if let (Some(x0), Some(x1), Some(x2)) = (info.ints(v), i1.ints(v), i2.ints(v))
            && s1 == s0
            && s2 == s0
            && (x1.len() != x0.len() || x2.len() != x0.len() || (0..x0.len()).any(|i| !follows(x0[i], x1[i], x2[i])))
        {
            return Err(fail(v, format!("holds {x0:?} at batch {from} but {x1:?} / {x2:?} rebound to {q1} / {q2}")));
        }
    }
    // a reshape keeps each sample's elements its own only if the batch is the outer factor of
    // the first dim on both sides (and in no other dim)
    let batchy = |v: ValueId| -> Vec<usize> {
        let shape = |i: &ShapeInfo| i.types[v.index()].as_ref().and_then(|t| t.shape.clone()).unwrap_or_default();
        let (s0, s1, s2) = (shape(&info), shape(i1), shape(i2));
        (0..s0.len().min(s1.len()).min(s2.len())).filter(|&k| s0[k] != s1[k] && follows(s0[k], s1[k], s2[k])).collect()
    };
    for n in graph.node_ids() {
        let node = graph.node(n);
        if node.op.is(OpKind::Reshape)
            && let (Some(Some(x)), Some(&y)) = (node.inputs.first(), node.outputs.first())
        {
            let (bx, by) = (batchy(*x), batchy(y));
            if !(bx.is_empty() && by.is_empty() || bx == [0] && by == [0]) {
                return Err(fail(
                    y,
                    format!("reshapes `{}` with the batch in dims {bx:?} to dims {by:?}: samples are rebound only where the batch is the outer factor of the first dim", graph.value(*x).name),
                ));
            }
        }
    }
    Ok(rw)
}

/// The candidates: inputs, shape operands and replicated constants that hold the batch.
fn find(graph: &Graph, input: &str, from: i64) -> Rewrite {
    let mut rw = Rewrite { from, input: input.to_string(), inputs: Vec::new(), shape_constants: Vec::new(), constants: Vec::new() };
    for &v in &graph.inputs {
        let first = graph.value(v).ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(|s| s.0.first().cloned());
        if first == Some(Dim::Known(from)) {
            rw.inputs.push(v);
        }
    }
    // (uses as a shape operand, other uses) per value
    let mut uses = vec![(0usize, 0usize); graph.value_count()];
    for n in graph.node_ids() {
        let node = graph.node(n);
        for (slot, v) in node.inputs.iter().enumerate() {
            let Some(v) = v else { continue };
            let shape_operand = matches!((node.op.kind(), slot), (Some(OpKind::Reshape | OpKind::Expand), 1) | (Some(OpKind::ConstantOfShape), 0));
            if shape_operand { uses[v.index()].0 += 1 } else { uses[v.index()].1 += 1 }
        }
    }
    for v in graph.value_ids() {
        let val = graph.value(v);
        if !matches!(val.kind, ValueKind::Initializer | ValueKind::Constant) || val.training.as_ref().is_some_and(|t| t.is_trained()) {
            continue;
        }
        let Some(t) = &val.data else { continue };
        let (shape_uses, other_uses) = uses[v.index()];
        if shape_uses > 0 && other_uses == 0 {
            // a multiple B·m only for B > 1 (at B = 1 every entry would be one)
            let batch_entry = |x0: i64| x0 == from || from > 1 && x0 > 0 && x0 % from == 0;
            if t.dims.len() == 1 && t.to_i64_vec().is_some_and(|x| x.first().is_some_and(|&x0| batch_entry(x0))) {
                rw.shape_constants.push(v);
            }
        } else if from > 1 && shape_uses == 0 && other_uses > 0 && t.dims.first() == Some(&from) && replicated(t) {
            // (at B = 1 a leading 1 broadcasts: nothing to cut)
            rw.constants.push(v);
        }
    }
    rw
}

/// True if the tensor's slices along axis 0 are all equal (inline data only).
fn replicated(t: &Tensor) -> bool {
    let Some(raw) = t.raw() else { return false };
    let n = t.dims[0].max(1) as usize;
    if raw.len() % n != 0 {
        return false;
    }
    let chunk = raw.len() / n;
    chunk > 0 && raw.chunks_exact(chunk).all(|c| c == &raw[..chunk])
}

/// Applies the rewrite at batch `to`.
fn apply(graph: &mut Graph, rw: &Rewrite, to: i64) {
    for &v in &rw.inputs {
        if let Some(Some(Dim::Known(d))) = graph.value_mut(v).ty.as_mut().and_then(|t| t.shape.as_mut()).map(|s| s.0.first_mut()) {
            *d = to;
        }
    }
    for &v in &rw.shape_constants {
        let val = graph.value_mut(v);
        let Some(t) = &val.data else { continue };
        let Some(mut x) = t.to_i64_vec() else { continue };
        x[0] = x[0] / rw.from * to;
        val.data = Some(super::fold::int_tensor(t.dtype, t.dims.clone(), &x));
    }
    for &v in &rw.constants {
        let val = graph.value_mut(v);
        let Some(t) = &val.data else { continue };
        let Some(raw) = t.raw() else { continue };
        let chunk = raw.len() / t.dims[0].max(1) as usize;
        let bytes: Vec<u8> = raw[..chunk].repeat(to as usize);
        let mut dims = t.dims.clone();
        dims[0] = to;
        let dtype: DType = t.dtype;
        val.ty = Some(TensorType { dtype, shape: Some(Shape::from_known(&dims)) });
        val.data = Some(Tensor { dtype, dims, storage: Storage::Raw(bytes.into()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::testutil::{Builder, Gpt, gpt};

    fn cfg(batch: i64) -> Gpt {
        Gpt {
            blocks: 2,
            hidden: 64,
            heads: 4,
            vocab: 128,
            ffn: 128,
            batch: Some(batch),
            seq: Some(8),
            dtype: DType::F32,
            namespaces: true,
            layer_names: true,
        }
    }

    fn output_shape(g: &Graph) -> Vec<i64> {
        g.value(g.outputs[0]).ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(Shape::known).unwrap()
    }

    #[test]
    fn shape_arithmetic_follows_the_rebound_input() {
        // unspecialised: Shape → Gather → Concat computes the batch at run time
        let mut g = gpt(cfg(4));
        let r = rebind_batch(&mut g, 1, &AnalyzeOptions::default()).unwrap().unwrap();
        assert_eq!((r.from, r.to, r.inputs.clone()), (4, 1, vec!["input_ids".to_string()]));
        assert!(r.shape_constants.is_empty() && r.constants.is_empty(), "{r:?}");
        assert_eq!(output_shape(&g), vec![1, 8, 128]);
    }

    #[test]
    fn folded_shape_constants_and_replicated_masks_are_rewritten() {
        // specialised: the reshape targets are folded constants holding the batch
        let mut lg = crate::passes::analyze(gpt(cfg(4)), &AnalyzeOptions::default()).unwrap();
        assert!(lg.dims.fixed_batch && lg.dims.batch_rebinds);
        // a causal mask folded per sample, [B, 1, S, S], doubled by a node and given to the
        // (fused) attention as its additive mask
        let mask: Vec<f32> = (0..4).flat_map(|_| (0..64).map(|i| if i % 8 > i / 8 { -1e9 } else { 0.0 })).collect();
        let m = lg.graph.add_value("mask", ValueKind::Constant, None, Some(Tensor::from_f32(vec![4, 1, 8, 8], &mask))).unwrap();
        let sm = lg.graph.node_ids().find(|&n| lg.graph.node(n).op.is(OpKind::ScaledDotProductAttention)).unwrap();
        let s = m;
        let masked = lg.graph.add_value("masked", ValueKind::Intermediate, None, None).unwrap();
        lg.graph
            .add_node(crate::ir::Node {
                name: "add_mask".into(),
                op: crate::ir::Op::Known(OpKind::Add),
                attrs: Default::default(),
                inputs: vec![Some(s), Some(m)],
                outputs: vec![masked],
                namespace: None,
                order: 0,
            })
            .unwrap();
        lg.graph.set_input(sm, 3, Some(masked));
        let mut g = lg.graph.clone();
        let r = rebind_batch(&mut g, 3, &AnalyzeOptions::default()).unwrap().unwrap();
        assert!(!r.shape_constants.is_empty(), "{r:?}");
        assert_eq!(r.constants, vec!["mask".to_string()]);
        assert_eq!(output_shape(&g), vec![3, 8, 128]);
        let mask3 = g.value(g.value_by_name("mask").unwrap()).data.clone().unwrap();
        assert_eq!(mask3.dims, vec![3, 1, 8, 8]);
        assert_eq!(mask3.raw().unwrap(), &Tensor::from_f32(vec![3, 1, 8, 8], &mask[..3 * 64]).raw().unwrap()[..]);
        // a per-sample mask whose samples differ cannot be rebound
        let mut per_sample = mask.clone();
        per_sample[64] = 5.0;
        let mut g = lg.graph.clone();
        g.value_mut(g.value_by_name("mask").unwrap()).data = Some(Tensor::from_f32(vec![4, 1, 8, 8], &per_sample));
        let e = rebind_batch(&mut g, 3, &AnalyzeOptions::default()).unwrap_err().to_string();
        // (the attention that reads the doubled mask no longer broadcasts it)
        let attention = &lg.graph.node(sm).name;
        assert!(e.contains("fixed at 4") && e.contains(&format!("`{attention}`")) && e.contains("torch.export.Dim(\"batch\")"), "{e}");
    }

    #[test]
    fn a_batch_moved_out_of_the_first_dim_is_refused_naming_the_node() {
        // [B, S, H] → Transpose → [S, B, H] → Reshape [S, B·H]: the batch is no longer the
        // outer factor of the first dim (8 = 2·B would rewrite, and the element counts fit)
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["4", "8", "16"]);
        let x = b.node(OpKind::Transpose, &[x], &[("perm", crate::ir::Attr::Ints(vec![1, 0, 2]))]);
        let t = b.ints(&[8, 64]);
        let y = b.node(OpKind::Reshape, &[x, t], &[]);
        let w = b.param("w", DType::F32, &[64, 16]);
        let y = b.node(OpKind::MatMul, &[y, w], &[]);
        b.output(y);
        let mut g = b.g;
        let e = rebind_batch(&mut g, 2, &AnalyzeOptions::default()).unwrap_err().to_string();
        assert!(e.contains("fixed at 4") && e.contains("input `x`") && e.contains("n_Reshape") && e.contains("outer factor"), "{e}");
        assert!(check(&g, &AnalyzeOptions::default()).is_err());
    }

    #[test]
    fn a_flattening_reshape_follows_the_batch() {
        // [B, S, H] → Reshape [B·S, H] → MatMul → Reshape [B, S, H] (GPT-2's Conv1D)
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["4", "8", "16"]);
        let t = b.ints(&[32, 16]);
        let y = b.node(OpKind::Reshape, &[x, t], &[]);
        let w = b.param("w", DType::F32, &[16, 16]);
        let y = b.node(OpKind::MatMul, &[y, w], &[]);
        let t = b.ints(&[4, 8, 16]);
        let y = b.node(OpKind::Reshape, &[y, t], &[]);
        b.output(y);
        let mut g = b.g;
        let r = rebind_batch(&mut g, 3, &AnalyzeOptions::default()).unwrap().unwrap();
        assert_eq!(r.shape_constants.len(), 2);
        assert_eq!(output_shape(&g), vec![3, 8, 16]);
        let flat = g.node_ids().find(|&n| g.node(n).op.is(OpKind::MatMul)).unwrap();
        let flat = g.node(flat).outputs[0];
        assert_eq!(g.value(flat).ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(Shape::known), Some(vec![24, 16]));
    }

    #[test]
    fn an_export_at_batch_one_rebinds() {
        let lg = crate::passes::analyze(gpt(cfg(1)), &AnalyzeOptions::default()).unwrap();
        assert!(lg.dims.fixed_batch && lg.dims.batch_rebinds);
        let mut g = lg.graph.clone();
        let r = rebind_batch(&mut g, 3, &AnalyzeOptions::default()).unwrap().unwrap();
        assert!(!r.shape_constants.is_empty(), "{r:?}");
        assert_eq!(output_shape(&g), vec![3, 8, 128]);
    }

    #[test]
    fn positions_gathered_per_sample_are_cut() {
        // OPT's fixed export: position rows gathered for every sample, [B, S] indices
        let mut b = Builder::new();
        let ids = b.input("input_ids", DType::I64, &["4", "8"]);
        let wte = b.param("wte", DType::F32, &[32, 16]);
        let wpe = b.param("wpe", DType::F32, &[8, 16]);
        let rows: Vec<i64> = (0..4).flat_map(|_| 0..8).collect();
        let pos = b.constant(Tensor::from_i64(vec![4, 8], &rows));
        let x = b.node(OpKind::Gather, &[wte, ids], &[]);
        let p = b.node(OpKind::Gather, &[wpe, pos], &[]);
        let y = b.node(OpKind::Add, &[x, p], &[]);
        b.output(y);
        let mut g = b.g;
        let r = rebind_batch(&mut g, 3, &AnalyzeOptions::default()).unwrap().unwrap();
        assert_eq!(r.constants.len(), 1, "{r:?}");
        assert_eq!(output_shape(&g), vec![3, 8, 16]);
        let cut = g.value(g.value_by_name(&r.constants[0]).unwrap()).data.clone().unwrap();
        assert_eq!(cut.to_i64_vec().unwrap(), rows[..24].to_vec());
    }
}
