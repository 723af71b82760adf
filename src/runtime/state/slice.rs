//! What checkpoints and weight sources share: where a piece of a tensor lies in the whole
//! (tensor-parallel cut, ZeRO block) and the names tensors are stored under.

use serde::{Deserialize, Serialize};

use crate::ir::{DecisionSource, FrozenReason, Graph, ParamTransform, Training, ValueId};

/// Where one piece of a tensor lies in the whole: the experts `experts` (a range of axis 0:
/// expert parallelism's part; none: all of them), cut along `axis` to `ranges` (concatenated
/// in order; none: not cut), then, flattened row-major, the elements `flat` (none: all of them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    /// Axis of the tensor-parallel cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axis: Option<usize>,
    /// Half-open ranges along `axis`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<[u64; 2]>,
    /// Half-open element range of the cut tensor, flattened (a ZeRO block's part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flat: Option<[u64; 2]>,
    /// Half-open range along axis 0 taken before the cut: the experts an expert-parallel rank
    /// holds of a stacked expert weight `[E, ...]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<[u64; 2]>,
}

impl Slice {
    /// The whole tensor.
    pub fn whole() -> Slice {
        Slice { axis: None, ranges: Vec::new(), flat: None, experts: None }
    }
}

/// The dims of `shape` with only `experts` of axis 0 kept, and where that block starts in the
/// whole tensor's row-major order.
fn expert_block(shape: &[i64], experts: Option<[u64; 2]>) -> Result<(Vec<i64>, u64), String> {
    let Some([a, b]) = experts else { return Ok((shape.to_vec(), 0)) };
    let Some(&e) = shape.first() else { return Err("an expert range of a scalar".into()) };
    if a > b || b > e.max(0) as u64 {
        return Err(format!("experts {a}..{b} exceed the {e} of axis 0"));
    }
    let inner: u64 = shape[1..].iter().map(|&d| d.max(0) as u64).product();
    let mut s = shape.to_vec();
    s[0] = (b - a) as i64;
    Ok((s, a * inner))
}

/// Shape of the whole `shape` with `part`'s experts kept and cut as `part` says (before `flat`).
pub fn slice_shape(shape: &[i64], part: &Slice) -> Result<Vec<i64>, String> {
    if part.experts.is_some() && part.axis == Some(0) {
        return Err("a cut along axis 0 of an expert-parallel part".into());
    }
    let (dims, _) = expert_block(shape, part.experts)?;
    cut_shape(&dims, part.axis, &part.ranges)
}

/// Shape of the whole `shape` cut along `axis` to `ranges`.
pub fn cut_shape(shape: &[i64], axis: Option<usize>, ranges: &[[u64; 2]]) -> Result<Vec<i64>, String> {
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(format!("shape {shape:?} has a negative dim {d}"));
    }
    let mut s = shape.to_vec();
    if let Some(a) = axis {
        let dim = *shape.get(a).ok_or_else(|| format!("cut along axis {a} of a rank-{} tensor", shape.len()))?;
        if ranges.iter().any(|r| r[0] > r[1] || r[1] > dim as u64) {
            return Err(format!("ranges {ranges:?} exceed dimension {dim} of axis {a}"));
        }
        s[a] = ranges.iter().try_fold(0i64, |n, r| n.checked_add((r[1] - r[0]) as i64)).ok_or_else(|| format!("ranges {ranges:?} overflow"))?;
    }
    Ok(s)
}

/// Shape of `part` of a tensor shaped `dims`: the cut, or `[n]` for a flat range.
pub fn part_dims(dims: &[i64], part: &Slice) -> Result<Vec<i64>, String> {
    let cut = slice_shape(dims, part)?;
    let n = cut.iter().try_fold(1i64, |n, &d| n.checked_mul(d)).ok_or_else(|| format!("shape {cut:?} has more elements than memory holds"))?;
    match part.flat {
        None => Ok(cut),
        Some([a, b]) if a <= b && b <= n as u64 => Ok(vec![(b - a) as i64]),
        Some(f) => Err(format!("element range {f:?} exceeds the {n} elements of its cut")),
    }
}

/// The elements of `part` of a tensor shaped `dims` as runs `(start, len)` of the whole
/// tensor's row-major order, in the part's own order (adjacent runs merged).
pub fn runs(dims: &[i64], part: &Slice) -> Result<Vec<(u64, u64)>, String> {
    if part.experts.is_some() {
        slice_shape(dims, part)?;
        let (block, base) = expert_block(dims, part.experts)?;
        let inner = Slice { experts: None, ..part.clone() };
        return Ok(runs(&block, &inner)?.into_iter().map(|(s, l)| (s + base, l)).collect());
    }
    let numel: u64 = dims.iter().map(|&d| d.max(0) as u64).product();
    let mut cut: Vec<(u64, u64)> = Vec::new();
    let push = |v: &mut Vec<(u64, u64)>, s: u64, l: u64| {
        if l == 0 {
            return;
        }
        match v.last_mut() {
            Some(last) if last.0 + last.1 == s => last.1 += l,
            _ => v.push((s, l)),
        }
    };
    match part.axis {
        None => push(&mut cut, 0, numel),
        Some(a) => {
            cut_shape(dims, Some(a), &part.ranges)?;
            let outer: u64 = dims[..a].iter().map(|&d| d as u64).product();
            let inner: u64 = dims[a + 1..].iter().map(|&d| d as u64).product();
            let d = dims[a] as u64;
            for o in 0..outer {
                for r in &part.ranges {
                    push(&mut cut, (o * d + r[0]) * inner, (r[1] - r[0]) * inner);
                }
            }
        }
    }
    let Some([fa, fb]) = part.flat else { return Ok(cut) };
    let mut out = Vec::new();
    let mut at = 0u64;
    for (s, l) in cut {
        let (lo, hi) = (fa.max(at), fb.min(at + l));
        if lo < hi {
            push(&mut out, s + (lo - at), hi - lo);
        }
        at += l;
    }
    if fb > at {
        return Err(format!("element range {fa}..{fb} exceeds the {at} elements of its cut"));
    }
    Ok(out)
}

/// The checkpoint name of trained initializer `v` (docs/checkpoints.md): the module
/// parameter's name from the export's record; without a record the initializer's name, and
/// `<initializer>@<consumer node>` for the copies the runner unties.
pub fn param_name(graph: &Graph, v: ValueId) -> String {
    let val = graph.value(v);
    match &val.training {
        Some(Training::Trained { names, untied_from: Some((orig, _)), source, .. }) if *source != DecisionSource::Record || names.is_empty() => {
            let node = graph.uses()[v.index()].first().map(|&n| graph.node(n).name.clone()).unwrap_or_default();
            format!("{orig}@{node}")
        }
        Some(Training::Trained { names, .. }) if !names.is_empty() => names[0].clone(),
        _ => val.name.clone(),
    }
}

/// True for a module buffer (an initializer the record or the name rules call a buffer).
pub fn is_buffer(graph: &Graph, v: ValueId) -> bool {
    matches!(&graph.value(v).training, Some(Training::Frozen { reason: FrozenReason::Buffer | FrozenReason::BufferName }))
}

/// The checkpoint name of module buffer `v`: its record's name, else the initializer's.
pub fn buffer_name(graph: &Graph, v: ValueId) -> String {
    let val = graph.value(v);
    val.record.as_ref().and_then(|r| r.name(0)).unwrap_or(&val.name).to_string()
}

/// True when trained initializer `v` holds its module tensor transposed.
pub fn is_transposed(graph: &Graph, v: ValueId) -> bool {
    matches!(&graph.value(v).training, Some(Training::Trained { transform: ParamTransform::Transpose, .. }))
}

