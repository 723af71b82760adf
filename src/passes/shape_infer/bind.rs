//! Dim binding: which size each symbolic dim of the graph's inputs takes (`--seq-len`,
//! `--dim NAME=V`, the batch), and resolving a declared shape under those sizes.

use std::collections::BTreeMap;

use crate::passes::{AnalyzeOptions, PassError};
use crate::ir::{Dim, DimBindings, Graph, Shape};

/// Decides the dim bindings: batch = first dim of the first input (bound to 1 if symbolic),
/// `--seq-len` = its second dim, `--dim NAME=V` anything. Every symbolic dim of a used input
/// must end up bound.
pub fn bind_dims(graph: &Graph, opts: &AnalyzeOptions) -> Result<DimBindings, PassError> {
    let mut values: BTreeMap<String, i64> = BTreeMap::new();
    for (name, &v) in &opts.dims {
        if v <= 0 {
            return Err(PassError::BadBinding(format!("--dim {name}={v}: sizes must be positive")));
        }
        values.insert(name.clone(), v);
    }
    let mut b = DimBindings { graph_batch: 1, ..DimBindings::default() };
    let first = graph.inputs.first().map(|&v| graph.value(v));
    let first_shape = first.and_then(|v| v.ty.as_ref()).and_then(|t| t.shape.as_ref());
    if let (Some(input), Some(shape)) = (first, first_shape) {
        match shape.0.first() {
            Some(Dim::Sym(s)) => {
                b.batch_symbol = Some(s.clone());
                let v = *values.entry(s.clone()).or_insert(1);
                b.graph_batch = v;
            }
            Some(Dim::Known(v)) if *v > 0 => {
                b.graph_batch = *v;
                b.fixed_batch = true;
            }
            _ => {}
        }
        if let Some(seq) = opts.seq_len {
            if seq <= 0 {
                return Err(PassError::BadBinding(format!("--seq-len {seq}: must be positive")));
            }
            match shape.0.get(1) {
                Some(Dim::Sym(s)) => {
                    values.insert(s.clone(), seq);
                }
                Some(Dim::Known(v)) if *v != seq => {
                    return Err(PassError::SeqLenConflict { input: input.name.clone(), fixed: *v, requested: seq });
                }
                Some(Dim::Known(_)) => {}
                None => {
                    return Err(PassError::BadBinding(format!(
                        "--seq-len {seq}: input `{}` has no second (sequence) dim; use --dim NAME=V",
                        input.name
                    )));
                }
            }
        }
    }
    let uses = graph.uses();
    for &input in &graph.inputs {
        if uses[input.index()].is_empty() && !graph.outputs.contains(&input) {
            continue;
        }
        let val = graph.value(input);
        let Some(shape) = val.ty.as_ref().and_then(|t| t.shape.as_ref()) else { continue };
        for (axis, d) in shape.0.iter().enumerate() {
            if let Dim::Sym(s) = d
                && !values.contains_key(s)
            {
                let is_seq = Some(input) == graph.inputs.first().copied() && axis == 1;
                let fix = if is_seq {
                    format!("pass --seq-len N (or --dim {s}=N)")
                } else {
                    format!("pass --dim {s}=N")
                };
                return Err(PassError::UnboundDim { dim: s.clone(), input: val.name.clone(), fix });
            }
        }
    }
    b.values = values;
    Ok(b)
}

/// Resolves a shape's symbols; `None` if one is unbound.
pub(super) fn resolve(shape: &Shape, dims: &BTreeMap<String, i64>) -> Option<Vec<i64>> {
    shape
        .0
        .iter()
        .map(|d| match d {
            Dim::Known(v) => Some(*v),
            Dim::Sym(s) => dims.get(s).copied(),
        })
        .collect()
}

