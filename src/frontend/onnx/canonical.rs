//! ONNX canonicalised once: the importer's last step rewrites every opset-dependent form into
//! the one form the rest of the compiler and the runner read, so that no later pass, split rule
//! or kernel branches on the opset (`ir::Graph::opsets` is kept for the IR dump only).
//!
//! The canonical form is the newest opset's:
//! - attributes that became inputs are inputs (constants): `axes` of `ReduceSum` (before 13),
//!   of the other reductions (before 18) and of `Squeeze`/`Unsqueeze` (before 13); `split` of
//!   `Split` (before 13); `starts`/`ends`/`axes` of `Slice` (before 10); `min`/`max` of `Clip`
//!   (before 11); `pads`/`value` of `Pad` (before 11); `k` of `TopK` (before 10); `ratio` of
//!   `Dropout` (before 12, which had no training mode: the node stays inactive); `Resize`'s
//!   `scales` moves to input 2 behind an empty `roi` (before 11);
//! - `Softmax` and `LogSoftmax` before 13, which coerce their input to 2-D at `axis` (default
//!   1), normalise over the last axis: unchanged where `axis` is the last axis, otherwise
//!   `Flatten(axis)` → softmax over the last axis → `Reshape` back to `Shape(x)`;
//! - every defaulted axis is written out: `axis` of `Softmax`/`LogSoftmax` (−1), `Gather`,
//!   `GatherElements`, `Split`, `ArgMax`, `ArgMin` (0), `Flatten` (1), `LayerNormalization` and
//!   `TopK` (−1); and `mode` of `GridSample` (`bilinear` before 20, `linear` from 20);
//! - `BitwiseNot` of a 16- or 32-bit unsigned value is `BitwiseXor` with the width's ones.

use std::path::Path;

use super::error::ImportError;
use crate::ir::{Attr, DType, Graph, Node, NodeId, Op, OpKind, Shape, Storage, Tensor, TensorType, ValueId, ValueKind};

/// The default-domain opset of a model that imports none (ONNX's own rule would make it 1, but
/// the files that omit it are written by hand against a current opset).
pub const DEFAULT_OPSET: i64 = 21;

/// What canonicalisation rewrote (for the debug log and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Canonicalised {
    /// Attributes moved into constant inputs.
    pub attrs_to_inputs: usize,
    /// Softmaxes over a non-last axis rewritten as flatten → softmax → reshape.
    pub softmax_rewrites: usize,
    /// Defaulted axes written out.
    pub axes_written: usize,
    /// Unsigned 16/32-bit `BitwiseNot`s rewritten as `BitwiseXor` with the width's ones.
    pub unsigned_nots: usize,
}

/// Rewrites `g`, imported from a model of default-domain `opset`, into the canonical form.
pub fn canonicalise(g: &mut Graph, opset: i64, file: &Path) -> Result<Canonicalised, ImportError> {
    let mut c = Canon { g, file, done: Canonicalised::default(), fresh: 0 };
    let ids: Vec<NodeId> = c.g.node_ids().collect();
    for id in ids {
        let Some(kind) = c.g.node(id).op.kind() else { continue };
        c.node(id, kind, opset)?;
    }
    Ok(c.done)
}

struct Canon<'a> {
    g: &'a mut Graph,
    file: &'a Path,
    done: Canonicalised,
    fresh: usize,
}

impl Canon<'_> {
    fn node(&mut self, id: NodeId, kind: OpKind, opset: i64) -> Result<(), ImportError> {
        use OpKind::*;
        match kind {
            ReduceSum if opset < 13 => self.attr_to_input(id, "axes", 1, IntsOrScalar::Ints)?,
            ReduceMean | ReduceMax | ReduceMin | ReduceProd | ReduceL1 | ReduceL2 | ReduceLogSumExp | ReduceSumSquare if opset < 18 => {
                self.attr_to_input(id, "axes", 1, IntsOrScalar::Ints)?
            }
            Squeeze | Unsqueeze if opset < 13 => self.attr_to_input(id, "axes", 1, IntsOrScalar::Ints)?,
            Split if opset < 13 => self.attr_to_input(id, "split", 1, IntsOrScalar::Ints)?,
            Slice if opset < 10 => {
                // `axes` is optional; `starts` and `ends` are required
                self.attr_to_input(id, "starts", 1, IntsOrScalar::Ints)?;
                self.attr_to_input(id, "ends", 2, IntsOrScalar::Ints)?;
                self.attr_to_input(id, "axes", 3, IntsOrScalar::Ints)?;
            }
            Clip if opset < 11 => {
                self.attr_to_input(id, "min", 1, IntsOrScalar::FloatLikeInput)?;
                self.attr_to_input(id, "max", 2, IntsOrScalar::FloatLikeInput)?;
            }
            Pad if opset < 11 => {
                self.attr_to_input(id, "pads", 1, IntsOrScalar::Ints)?;
                self.attr_to_input(id, "value", 2, IntsOrScalar::FloatLikeInput)?;
            }
            TopK if opset < 10 => self.attr_to_input(id, "k", 1, IntsOrScalar::IntAsList)?,
            Dropout if opset < 12 => {
                self.attr_to_input(id, "ratio", 1, IntsOrScalar::Float32)?;
                self.g.node_mut(id).attrs.0.remove("is_test");
            }
            Resize if opset < 11 => self.resize_without_roi(id),
            BitwiseNot => self.unsigned_not_as_xor(id),
            _ => {}
        }
        match kind {
            GridSample => self.default_str(id, "mode", if opset < 20 { "bilinear" } else { "linear" }),
            _ => {}
        }
        match kind {
            Softmax | LogSoftmax if opset < 13 => self.coerced_softmax(id)?,
            Softmax | LogSoftmax | LayerNormalization | RMSNormalization | TopK => self.default_axis(id, -1),
            Gather | GatherElements | Split | ArgMax | ArgMin => self.default_axis(id, 0),
            Flatten => self.default_axis(id, 1),
            _ => {}
        }
        Ok(())
    }

    fn default_axis(&mut self, id: NodeId, axis: i64) {
        let attrs = &mut self.g.node_mut(id).attrs;
        if attrs.get("axis").is_none() {
            attrs.set("axis", Attr::Int(axis));
            self.done.axes_written += 1;
        }
    }

    fn default_str(&mut self, id: NodeId, name: &str, value: &str) {
        let attrs = &mut self.g.node_mut(id).attrs;
        if attrs.get(name).is_none() {
            attrs.set(name, Attr::Str(value.to_string()));
            self.done.axes_written += 1;
        }
    }

    /// `BitwiseNot` of a 16- or 32-bit unsigned value is `BitwiseXor` with that width's ones:
    /// the runner holds those types zero-extended in int64, where a complement would set the
    /// upper bits too.
    fn unsigned_not_as_xor(&mut self, id: NodeId) {
        let x = self.g.node(id).inputs.first().copied().flatten();
        let (dtype, ones) = match x.and_then(|x| self.g.value(x).ty.as_ref()).map(|t| t.dtype) {
            Some(DType::U16) => (DType::U16, u16::MAX.to_le_bytes().to_vec()),
            Some(DType::U32) => (DType::U32, u32::MAX.to_le_bytes().to_vec()),
            _ => return,
        };
        let name = format!("{}.ones", self.g.node(id).name);
        let mask = self.constant(&name, Tensor { dtype, dims: vec![], storage: Storage::Raw(ones.into()) });
        self.g.node_mut(id).op = Op::Known(OpKind::BitwiseXor);
        self.g.set_input(id, 1, Some(mask));
        self.done.unsigned_nots += 1;
    }

    /// Resize at opset 10 is `(X, scales)`: from 11 it is `(X, roi, scales, sizes)`.
    fn resize_without_roi(&mut self, id: NodeId) {
        let scales = self.g.node(id).inputs.get(1).copied().flatten();
        self.g.set_input(id, 1, None);
        self.g.set_input(id, 2, scales);
        self.done.attrs_to_inputs += 1;
    }

    /// Moves attribute `name` of node `id` into input `slot` as a constant.
    fn attr_to_input(&mut self, id: NodeId, name: &str, slot: usize, form: IntsOrScalar) -> Result<(), ImportError> {
        let Some(attr) = self.g.node_mut(id).attrs.0.remove(name) else { return Ok(()) };
        let node_name = self.g.node(id).name.clone();
        if self.g.node(id).inputs.get(slot).copied().flatten().is_some() {
            return Err(self.bad(&node_name, format!("has both the attribute `{name}` and input {slot}: the attribute is its opset's form of that input")));
        }
        let tensor = match (form, &attr) {
            (IntsOrScalar::Ints, Attr::Ints(v)) => Tensor::from_i64(vec![v.len() as i64], v),
            (IntsOrScalar::IntAsList, Attr::Int(v)) => Tensor::from_i64(vec![1], &[*v]),
            (IntsOrScalar::Float32, Attr::Float(v)) => Tensor::from_f32(vec![], &[*v]),
            (IntsOrScalar::FloatLikeInput, Attr::Float(v)) => {
                let dtype = self.g.node(id).inputs.first().copied().flatten().and_then(|x| self.g.value(x).ty.as_ref()).map(|t| t.dtype);
                float_scalar(dtype.unwrap_or(DType::F32), *v as f64)
            }
            _ => return Err(self.bad(&node_name, format!("attribute `{name}` is {attr}, not what its opset defines"))),
        };
        let v = self.constant(&format!("{node_name}.{name}"), tensor);
        self.g.set_input(id, slot, Some(v));
        self.done.attrs_to_inputs += 1;
        Ok(())
    }

    /// Softmax before opset 13: `x` coerced to 2-D at `axis`, normalised over the second axis.
    fn coerced_softmax(&mut self, id: NodeId) -> Result<(), ImportError> {
        let node = self.g.node(id).clone();
        let axis = node.attrs.int("axis", 1);
        let Some(x) = node.inputs.first().copied().flatten() else { return Ok(()) };
        let rank = self.g.value(x).ty.as_ref().and_then(|t| t.shape.as_ref()).map(Shape::rank);
        let last = axis == -1 || rank.is_some_and(|r| axis == r as i64 - 1 || (r == 0 && axis == 0));
        if last {
            self.g.node_mut(id).attrs.set("axis", Attr::Int(-1));
            return Ok(());
        }
        let Some(&y) = node.outputs.first() else { return Ok(()) };
        // x → Flatten(axis) → softmax over the last axis → Reshape(Shape(x)) → y
        let dtype = self.g.value(x).ty.as_ref().map(|t| t.dtype);
        let ty = |shape: Option<Shape>| dtype.map(|dtype| TensorType { dtype, shape });
        let flat = self.intermediate(&format!("{}.flat", node.name), ty(None));
        let soft = self.intermediate(&format!("{}.2d", node.name), ty(None));
        let shape = self.intermediate(&format!("{}.shape", node.name), Some(TensorType { dtype: DType::I64, shape: rank.map(|r| Shape::from_known(&[r as i64])) }));
        let mut flatten = self.derived(&node, "flatten", OpKind::Flatten, vec![Some(x)], vec![flat]);
        flatten.attrs.set("axis", Attr::Int(axis));
        let shape_of = self.derived(&node, "shape", OpKind::Shape, vec![Some(x)], vec![shape]);
        let reshape = self.derived(&node, "reshape", OpKind::Reshape, vec![Some(soft), Some(shape)], vec![]);
        let readers: Vec<(NodeId, usize)> = self
            .g
            .node_ids()
            .flat_map(|n| self.g.node(n).inputs.iter().enumerate().filter(|(_, v)| **v == Some(y)).map(move |(slot, _)| (n, slot)).collect::<Vec<_>>())
            .collect();
        // the softmax node keeps its name and now makes the 2-D value; Reshape makes `y`
        let graph_err = |file: &Path, e| ImportError::Graph { file: file.to_path_buf(), source: e };
        self.g.remove_node(id);
        let mut softmax = node.clone();
        softmax.inputs = vec![Some(flat)];
        softmax.outputs = vec![soft];
        softmax.attrs.set("axis", Attr::Int(-1));
        self.g.add_node(flatten).map_err(|e| graph_err(self.file, e))?;
        self.g.add_node(shape_of).map_err(|e| graph_err(self.file, e))?;
        self.g.add_node(softmax).map_err(|e| graph_err(self.file, e))?;
        let reshape = Node { outputs: vec![y], ..reshape };
        self.g.add_node(reshape).map_err(|e| graph_err(self.file, e))?;
        // the readers of `y` now read it from the Reshape: their edges follow
        for (reader, slot) in readers {
            self.g.set_input(reader, slot, Some(y));
        }
        self.done.softmax_rewrites += 1;
        Ok(())
    }

    /// A node made for `from` (its namespace and file position).
    fn derived(&mut self, from: &Node, what: &str, kind: OpKind, inputs: Vec<Option<ValueId>>, outputs: Vec<ValueId>) -> Node {
        Node {
            name: self.free_name(&format!("{}.{what}", from.name)),
            op: Op::Known(kind),
            attrs: Default::default(),
            inputs,
            outputs,
            namespace: from.namespace.clone(),
            order: from.order,
        }
    }

    fn free_name(&mut self, base: &str) -> String {
        let mut name = base.to_string();
        while self.g.value_by_name(&name).is_some() {
            self.fresh += 1;
            name = format!("{base}.{}", self.fresh);
        }
        name
    }

    fn intermediate(&mut self, name: &str, ty: Option<TensorType>) -> ValueId {
        let name = self.free_name(name);
        self.g.add_value(name, ValueKind::Intermediate, ty, None).expect("a free name")
    }

    fn constant(&mut self, name: &str, t: Tensor) -> ValueId {
        let name = self.free_name(name);
        let ty = TensorType { dtype: t.dtype, shape: Some(Shape::from_known(&t.dims)) };
        self.g.add_value(name, ValueKind::Constant, Some(ty), Some(t)).expect("a free name")
    }

    fn bad(&self, node: &str, reason: String) -> ImportError {
        ImportError::BadNode { file: self.file.to_path_buf(), node: node.to_string(), reason }
    }
}

/// How an attribute becomes an input.
#[derive(Clone, Copy)]
enum IntsOrScalar {
    /// `INTS` → a 1-D int64 tensor.
    Ints,
    /// `INT` → a 1-element int64 tensor (TopK's `k`).
    IntAsList,
    /// `FLOAT` → an f32 scalar (Dropout's `ratio`).
    Float32,
    /// `FLOAT` → a scalar of the node's first input's type (Clip's bounds, Pad's value).
    FloatLikeInput,
}

/// A scalar of a floating-point `dtype` (f32 for any other).
fn float_scalar(dtype: DType, v: f64) -> Tensor {
    let bytes: Vec<u8> = match dtype {
        DType::F64 => v.to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
        DType::BF16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
        _ => return Tensor::from_f32(vec![], &[v as f32]),
    };
    Tensor { dtype, dims: vec![], storage: Storage::Raw(bytes.into()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Attrs;

    fn graph(kind: OpKind, attrs: &[(&str, Attr)], x_rank: usize) -> (Graph, NodeId, ValueId) {
        let mut g = Graph::new("t");
        let x = g.add_value("x", ValueKind::Input, Some(TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&vec![2; x_rank])) }), None).unwrap();
        g.inputs.push(x);
        let y = g.add_value("y", ValueKind::Intermediate, None, None).unwrap();
        let mut a = Attrs::default();
        for (k, v) in attrs {
            a.set(k, v.clone());
        }
        let id = g.add_node(Node { name: "n".into(), op: Op::Known(kind), attrs: a, inputs: vec![Some(x)], outputs: vec![y], namespace: None, order: 0 }).unwrap();
        g.outputs.push(y);
        (g, id, y)
    }

    #[test]
    fn attributes_that_became_inputs_are_inputs() {
        let (mut g, id, _) = graph(OpKind::ReduceMean, &[("axes", Attr::Ints(vec![-1])), ("keepdims", Attr::Int(1))], 3);
        let done = canonicalise(&mut g, 13, Path::new("m.onnx")).unwrap();
        assert_eq!(done.attrs_to_inputs, 1);
        let n = g.node(id);
        assert!(n.attrs.get("axes").is_none());
        let axes = n.inputs[1].unwrap();
        assert_eq!(g.value(axes).data.as_ref().unwrap().to_i64_vec().unwrap(), vec![-1]);
        g.verify().unwrap();
        // at opset 18 the same node already has its input form: nothing moves
        let (mut g, _, _) = graph(OpKind::ReduceMean, &[("keepdims", Attr::Int(1))], 3);
        assert_eq!(canonicalise(&mut g, 18, Path::new("m.onnx")).unwrap().attrs_to_inputs, 0);
    }

    #[test]
    fn softmax_before_13_over_a_middle_axis_is_flatten_softmax_reshape() {
        let (mut g, _, y) = graph(OpKind::Softmax, &[("axis", Attr::Int(1))], 3);
        // a reader of the softmax's output keeps reading it
        let z = g.add_value("z", ValueKind::Intermediate, None, None).unwrap();
        let reader = g.add_node(Node { name: "r".into(), op: Op::Known(OpKind::Relu), attrs: Attrs::default(), inputs: vec![Some(y)], outputs: vec![z], namespace: None, order: 1 }).unwrap();
        g.outputs = vec![z];
        let done = canonicalise(&mut g, 11, Path::new("m.onnx")).unwrap();
        assert_eq!(g.predecessors(reader).collect::<Vec<_>>(), vec![g.value(y).producer.unwrap()]);
        assert_eq!(done.softmax_rewrites, 1);
        g.verify().unwrap();
        let order = g.topo_order().unwrap();
        let kinds: Vec<OpKind> = order.iter().filter_map(|&n| g.node(n).op.kind()).collect();
        assert!(kinds.ends_with(&[OpKind::Softmax, OpKind::Reshape, OpKind::Relu]), "{kinds:?}");
        assert!(kinds.contains(&OpKind::Flatten) && kinds.contains(&OpKind::Shape), "{kinds:?}");
        let reshape = g.value(y).producer.unwrap();
        assert!(g.node(reshape).op.is(OpKind::Reshape));
        let soft = order.iter().copied().find(|&n| g.node(n).op.is(OpKind::Softmax)).unwrap();
        assert_eq!(g.node(soft).name, "n");
        assert_eq!(g.node(soft).attrs.int_opt("axis"), Some(-1));
        // over the last axis the coerced form is the plain one
        let (mut g, id, _) = graph(OpKind::Softmax, &[("axis", Attr::Int(2))], 3);
        assert_eq!(canonicalise(&mut g, 11, Path::new("m.onnx")).unwrap().softmax_rewrites, 0);
        assert_eq!(g.node(id).attrs.int_opt("axis"), Some(-1));
        // before 13 the default axis is 1: on a rank-2 input that is the last axis
        let (mut g, id, _) = graph(OpKind::LogSoftmax, &[], 2);
        assert_eq!(canonicalise(&mut g, 12, Path::new("m.onnx")).unwrap().softmax_rewrites, 0);
        assert_eq!(g.node(id).attrs.int_opt("axis"), Some(-1));
    }

    #[test]
    fn a_complement_of_narrow_unsigned_ints_is_a_xor_with_their_ones() {
        for (dtype, ones) in [(DType::U16, 0xffff), (DType::U32, 0xffff_ffff), (DType::I32, -1)] {
            let (mut g, id, _) = graph(OpKind::BitwiseNot, &[], 2);
            let x = g.node(id).inputs[0].unwrap();
            g.value_mut(x).ty.as_mut().unwrap().dtype = dtype;
            let done = canonicalise(&mut g, 18, Path::new("m.onnx")).unwrap();
            assert_eq!(done.unsigned_nots, usize::from(dtype != DType::I32), "{dtype:?}");
            let n = g.node(id);
            if dtype == DType::I32 {
                // int64 holds a signed value's bits: its complement is the plain one
                assert!(n.op.is(OpKind::BitwiseNot) && n.inputs.len() == 1, "{dtype:?}");
                continue;
            }
            assert!(n.op.is(OpKind::BitwiseXor), "{dtype:?}");
            let mask = g.value(n.inputs[1].unwrap()).data.as_ref().unwrap();
            assert_eq!((mask.dtype, mask.to_i64_vec().unwrap()), (dtype, vec![ones]));
            g.verify().unwrap();
        }
    }

    #[test]
    fn defaulted_axes_are_written_out() {
        let (mut g, id, _) = graph(OpKind::Softmax, &[], 3);
        assert_eq!(canonicalise(&mut g, 18, Path::new("m.onnx")).unwrap().axes_written, 1);
        assert_eq!(g.node(id).attrs.int_opt("axis"), Some(-1));
        let (mut g, id, _) = graph(OpKind::Flatten, &[], 3);
        canonicalise(&mut g, 18, Path::new("m.onnx")).unwrap();
        assert_eq!(g.node(id).attrs.int_opt("axis"), Some(1));
    }

    #[test]
    fn an_attribute_beside_its_input_is_refused_naming_the_node() {
        let (mut g, id, _) = graph(OpKind::Unsqueeze, &[("axes", Attr::Ints(vec![0]))], 2);
        let c = g.add_value("c", ValueKind::Constant, None, Some(Tensor::from_i64(vec![1], &[0]))).unwrap();
        g.set_input(id, 1, Some(c));
        let e = canonicalise(&mut g, 11, Path::new("m.onnx")).unwrap_err().to_string();
        assert!(e.contains("m.onnx") && e.contains("`n`") && e.contains("axes"), "{e}");
    }
}
