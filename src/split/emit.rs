//! What the family files' emission rules share: constants added to a rank's subgraph, and the
//! names of the nodes they make.

use crate::ir::{Attrs, DType, Graph, GraphError, Node, Op, OpKind, Shape, Storage, Tensor, TensorType, ValueId, ValueKind};

/// Fresh names for the values and nodes an emission rule adds: `{base}.{what}{n}`, `n` counting
/// up over one subgraph.
#[derive(Debug, Default)]
pub struct Fresh(std::cell::Cell<u32>);

impl Fresh {
    /// The next name for `what` made for `base`.
    pub fn name(&self, base: &str, what: &str) -> String {
        self.0.set(self.0.get() + 1);
        format!("{base}.{what}{}", self.0.get())
    }
}

/// A scalar constant of `dtype` holding the integer `v` (0 for a floating-point `dtype`).
pub fn scalar_const(g: &mut Graph, name: String, dtype: DType, v: i64) -> Result<ValueId, GraphError> {
    let size = dtype.size_bytes() as usize;
    let bytes: Vec<u8> = if dtype.is_float() { vec![0; size] } else { v.to_le_bytes()[..size.min(8)].to_vec() };
    let t = Tensor { dtype, dims: vec![], storage: Storage::Raw(bytes.into()) };
    g.add_value(name, ValueKind::Constant, Some(TensorType { dtype, shape: Some(Shape(vec![])) }), Some(t))
}

/// A 1-D int64 constant.
pub fn i64_const(g: &mut Graph, name: String, vals: &[i64]) -> Result<ValueId, GraphError> {
    let t = Tensor::from_i64(vec![vals.len() as i64], vals);
    g.add_value(name, ValueKind::Constant, Some(TensorType { dtype: DType::I64, shape: Some(Shape::from_known(&[vals.len() as i64])) }), Some(t))
}

/// A floating-point scalar: f64 for an f64 `dtype`, f32 otherwise.
pub fn float_scalar(dtype: DType, v: f32) -> Tensor {
    match dtype {
        DType::F64 => Tensor { dtype, dims: vec![], storage: Storage::Raw((v as f64).to_le_bytes().to_vec().into()) },
        _ => Tensor::from_f32(vec![], &[v]),
    }
}

/// A node of `kind` made for `from` (its namespace and order), with no attributes.
pub fn derived(from: &Node, name: String, kind: OpKind, inputs: Vec<ValueId>, output: ValueId) -> Node {
    Node { name, op: Op::Known(kind), attrs: Attrs::default(), inputs: inputs.into_iter().map(Some).collect(), outputs: vec![output], namespace: from.namespace.clone(), order: from.order }
}
