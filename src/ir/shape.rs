//! Tensor shapes with symbolic dimensions.

use std::fmt;

use super::DType;

/// One dimension: a known size or a named symbol (`batch`, `seq`, `s0`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    /// A fixed size.
    Known(i64),
    /// A symbolic size, bound later by `--seq-len`/`--dim` or the batch.
    Sym(String),
}

impl Dim {
    /// The size if known.
    pub fn known(&self) -> Option<i64> {
        match self {
            Dim::Known(v) => Some(*v),
            Dim::Sym(_) => None,
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Known(v) => write!(f, "{v}"),
            Dim::Sym(s) => f.write_str(s),
        }
    }
}

/// A shape: one `Dim` per axis (rank 0 = scalar).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    /// A shape of known sizes.
    pub fn from_known(dims: &[i64]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::Known(d)).collect())
    }

    /// Number of axes.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// All sizes, if every dimension is known.
    pub fn known(&self) -> Option<Vec<i64>> {
        self.0.iter().map(Dim::known).collect()
    }

    /// Element count, if every dimension is known.
    pub fn numel(&self) -> Option<u64> {
        self.0
            .iter()
            .try_fold(1u64, |acc, d| d.known().map(|v| acc.saturating_mul(v.max(0) as u64)))
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Element type plus shape; the shape is `None` when not even the rank is known.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Shape, if known.
    pub shape: Option<Shape>,
}

impl TensorType {
    /// Bytes of one tensor of this type, if its shape is fully known.
    pub fn bytes(&self) -> Option<u64> {
        self.shape
            .as_ref()
            .and_then(Shape::numel)
            .map(|n| n.saturating_mul(self.dtype.size_bytes()))
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.shape {
            Some(s) => write!(f, "{}{}", self.dtype, s),
            None => write!(f, "{}[?]", self.dtype),
        }
    }
}
