//! What analysis is asked: how symbolic dims are bound.

use std::collections::BTreeMap;

/// Options of [`super::analyze`]: how to bind symbolic dims.
#[derive(Clone, Debug, Default)]
pub struct AnalyzeOptions {
    /// Binds the symbolic sequence dim (second dim of the first graph input).
    pub seq_len: Option<i64>,
    /// Binds any symbolic dim by name (`--dim NAME=V`).
    pub dims: BTreeMap<String, i64>,
}
