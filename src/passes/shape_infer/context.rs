//! What every op family's inference shares: the limits on what a file may declare, the
//! inferred type of a value, the node under inference with typed access to its inputs, and
//! the axis and size checks.

use crate::ir::{Attrs, DType, Graph, Node, ValueId};

/// Integer tensors up to this many elements are evaluated (and may be folded).
pub const MAX_EVAL_ELEMS: usize = 4096;

/// The most dims a value may have: libtorch's reductions take at most 64 ("only tensors with
/// up to 64 dims are supported").
pub const MAX_RANK: usize = 64;

/// The most elements (and the largest dim) a value may have, 2⁴⁸ ≈ 2.8·10¹⁴: more than any
/// device holds, and small enough that byte counts of every dtype stay exact in `i64`/`f64`.
pub const MAX_ELEMS: i64 = 1 << 48;

/// The inferred type of one value: element type and, if known, concrete dims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ty {
    /// Element type.
    pub dtype: DType,
    /// Concrete dims, if known.
    pub shape: Option<Vec<i64>>,
}

/// What inference knows about each value, indexed by `ValueId::index()`.
#[derive(Clone, Debug, Default)]
pub struct ShapeInfo {
    /// Inferred types.
    pub types: Vec<Option<Ty>>,
    /// Values of small integer/bool tensors, row-major, widened to i64.
    pub ints: Vec<Option<Vec<i64>>>,
}

impl ShapeInfo {
    /// The evaluated integer value of `v`, if known.
    pub fn ints(&self, v: ValueId) -> Option<&[i64]> {
        self.ints.get(v.index()).and_then(|x| x.as_deref())
    }
}

/// One output's inferred type and evaluated integer value.
pub(super) type Out = (Option<Ty>, Option<Vec<i64>>);

/// One node's outputs, or what is wrong (the caller adds node and op).
pub(super) type Outs = Result<Vec<Out>, String>;

/// A node under inference, with typed access to what is known of its inputs.
pub(super) struct Ctx<'a> {
    pub(super) graph: &'a Graph,
    pub(super) node: &'a Node,
    pub(super) info: &'a ShapeInfo,
}

impl Ctx<'_> {
    pub(super) fn input(&self, i: usize) -> Option<ValueId> {
        self.node.inputs.get(i).copied().flatten()
    }
    pub(super) fn name(&self, i: usize) -> &str {
        self.input(i).map(|v| self.graph.value(v).name.as_str()).unwrap_or("")
    }
    pub(super) fn ty(&self, i: usize) -> Option<&Ty> {
        self.input(i).and_then(|v| self.info.types[v.index()].as_ref())
    }
    pub(super) fn shape(&self, i: usize) -> Option<&[i64]> {
        self.ty(i).and_then(|t| t.shape.as_deref())
    }
    pub(super) fn dtype(&self, i: usize) -> Option<DType> {
        self.ty(i).map(|t| t.dtype)
    }
    pub(super) fn ints(&self, i: usize) -> Option<&[i64]> {
        self.input(i).and_then(|v| self.info.ints(v))
    }
    /// Integer operand needed for the output shape; an error if present but not evaluable.
    pub(super) fn need_ints(&self, i: usize, what: &str) -> Result<Option<&[i64]>, String> {
        match self.input(i) {
            None => Ok(None),
            Some(v) => match self.info.ints(v) {
                Some(x) => Ok(Some(x)),
                None if reads_input_values(self.graph, v) => Err(format!(
                    "its {what} (`{}`) is computed from the values of the graph's inputs, not only from shapes (a \
                     data-dependent size, such as the tokens routed to each expert); the planner needs every shape \
                     fixed before training: export the module in a form whose shapes do not depend on the data",
                    self.graph.value(v).name
                )),
                None => Err(format!(
                    "its {what} (`{}`) is not a constant after binding dims; it must be computable from shapes",
                    self.graph.value(v).name
                )),
            },
        }
    }
    pub(super) fn attrs(&self) -> &Attrs {
        &self.node.attrs
    }
    pub(super) fn same(&self, i: usize) -> Out {
        (self.ty(i).cloned(), None)
    }
}

pub(super) fn one(o: Out) -> Outs {
    Ok(vec![o])
}

pub(super) fn ty(dtype: DType, shape: Vec<i64>) -> Option<Ty> {
    Some(Ty { dtype, shape: Some(shape) })
}

pub(super) fn ty_opt(dtype: Option<DType>, shape: Option<Vec<i64>>) -> Option<Ty> {
    dtype.map(|dtype| Ty { dtype, shape })
}

pub(super) fn int_like(dtype: Option<DType>) -> bool {
    dtype.is_some_and(|d| d.is_int() || d == DType::Bool)
}

/// Normalises an axis for ops that do not index a dim by it (reductions, normalisations,
/// squeezes): a scalar takes axis 0.
pub(crate) fn norm_axis(axis: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r.max(1) && !(r == 0 && a == 0) {
        return Err(format!("axis {axis} is out of range for rank {rank}"));
    }
    Ok(a as usize)
}

/// Normalises an axis that names a dim of a tensor of `rank` (so a scalar has none).
pub(super) fn dim_axis(axis: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        return Err(format!("axis {axis} is out of range for rank {rank}"));
    }
    Ok(a as usize)
}

/// Elements of a tensor of dims `s`; an error for a negative dim or past [`MAX_ELEMS`].
pub(super) fn numel(s: &[i64]) -> Result<i64, String> {
    if let Some(d) = s.iter().find(|&&d| d < 0) {
        return Err(format!("dims {s:?} hold a negative size {d}"));
    }
    s.iter()
        .try_fold(1i64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= MAX_ELEMS)
        .ok_or_else(|| format!("dims {s:?} hold more than 2^48 elements, more than any device holds"))
}

/// A value's dims are in range: rank ≤ [`MAX_RANK`], every dim and the element count in
/// `0..=`[`MAX_ELEMS`].
pub(super) fn check_dims(s: &[i64]) -> Result<(), String> {
    if s.len() > MAX_RANK {
        return Err(format!("rank {} exceeds {MAX_RANK}, the most dims libtorch's reductions take", s.len()));
    }
    if let Some(d) = s.iter().find(|&&d| d > MAX_ELEMS) {
        return Err(format!("dims {s:?} hold a size {d}, more than any device holds"));
    }
    numel(s).map(|_| ())
}


/// Whether `v` is computed from the values (not only the shapes) of a graph input: some path
/// back from it reaches an input other than through `Shape` or `Size`.
fn reads_input_values(graph: &Graph, v: ValueId) -> bool {
    use crate::ir::OpKind;
    let (mut seen, mut stack) = (std::collections::HashSet::new(), vec![v]);
    while let Some(v) = stack.pop() {
        if !seen.insert(v) {
            continue;
        }
        let Some(p) = graph.value(v).producer else {
            if graph.inputs.contains(&v) {
                return true;
            }
            continue;
        };
        let node = graph.node(p);
        if node.op.is(OpKind::Shape) || node.op.is(OpKind::Size) {
            continue;
        }
        stack.extend(node.inputs.iter().flatten().copied());
    }
    false
}
