//! Joining, splitting and indexing: Concat, Split, Slice, Gather, GatherElements, GatherND,
//! ScatterND, Pad. Every axis from the file is checked against the rank it indexes, and 1-D
//! integer values are evaluated through them (shape arithmetic).

use super::context::{Ctx, Outs, dim_axis, one, ty_opt};

/// Concat(inputs…) along `axis`.
pub(super) fn concat(cx: &Ctx) -> Outs {
    let n = cx.node.inputs.len();
    let dtype = (0..n).find_map(|i| cx.dtype(i));
    let present: Vec<usize> = (0..n).filter(|&i| cx.input(i).is_some()).collect();
    let shapes: Option<Vec<&[i64]>> = present.iter().map(|&i| cx.shape(i)).collect();
    let Some(shapes) = shapes else { return one((ty_opt(dtype, None), None)) };
    let Some(first) = shapes.first() else { return Err("no inputs".into()) };
    if let Some(k) = shapes.iter().position(|s| s.is_empty()) {
        return Err(format!("input {} (`{}`) is a scalar (rank 0); Concat joins tensors of rank ≥ 1", present[k], cx.name(present[k])));
    }
    let ax = dim_axis(cx.attrs().int("axis", 0), first.len())?;
    let mut out = first.to_vec();
    out[ax] = 0;
    for s in &shapes {
        if s.len() != first.len() {
            return Err(format!("inputs of ranks {} and {} cannot be joined", first.len(), s.len()));
        }
        out[ax] = out[ax].checked_add(s[ax]).ok_or_else(|| format!("the joined dim {ax} of {shapes:?} overflows"))?;
    }
    let ints = if first.len() == 1 {
        let parts: Option<Vec<&[i64]>> = present.iter().map(|&i| cx.ints(i)).collect();
        parts.map(|p| p.concat())
    } else {
        None
    };
    one((ty_opt(dtype, Some(out)), ints))
}

/// Split(x, sizes?) along `axis` into the node's outputs: by sizes, or
/// in equal chunks (the last smaller).
pub(super) fn split(cx: &Ctx) -> Outs {
    let n = cx.node.outputs.len();
    let Some(x) = cx.shape(0) else { return Ok(vec![cx.same(0); n]) };
    let ax = dim_axis(cx.attrs().int("axis", 0), x.len())?;
    let d = x[ax];
    let sizes: Vec<i64> = match cx.need_ints(1, "split sizes")? {
        Some(s) => s.to_vec(),
        None => {
            let chunk = (d + n as i64 - 1) / (n as i64).max(1);
            (0..n as i64).map(|i| chunk.min(d - i * chunk).max(0)).collect()
        }
    };
    let total = sizes.iter().try_fold(0i64, |acc, &s| if s < 0 { None } else { acc.checked_add(s) });
    if sizes.len() != n || total != Some(d) {
        return Err(format!("split sizes {sizes:?} do not cover dim {d} in {n} outputs"));
    }
    let mut outs = Vec::with_capacity(n);
    let mut start = 0usize;
    for &s in &sizes {
        let mut sh = x.to_vec();
        sh[ax] = s;
        let end = start + s as usize;
        let ints = if x.len() == 1 { cx.ints(0).and_then(|v| v.get(start..end)).map(<[i64]>::to_vec) } else { None };
        start = end;
        outs.push((ty_opt(cx.dtype(0), Some(sh)), ints));
    }
    Ok(outs)
}

/// Slice(x, starts, ends, axes?, steps?), numpy clamping.
pub(super) fn slice(cx: &Ctx) -> Outs {
    let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
    let starts = cx.need_ints(1, "starts")?.ok_or("no starts")?.to_vec();
    let ends = cx.need_ints(2, "ends")?.ok_or("no ends")?.to_vec();
    let axes = cx.need_ints(3, "axes")?.map(<[i64]>::to_vec);
    let steps = cx.need_ints(4, "steps")?.map(<[i64]>::to_vec);
    if starts.len() != ends.len() {
        return Err("starts and ends differ in length".into());
    }
    let r = slice_ranges(x, &starts, &ends, axes.as_deref(), steps.as_deref())?;
    let out: Vec<i64> = r.iter().map(|t| t.1).collect();
    let ints = match (cx.ints(0), r.as_slice()) {
        (Some(v), &[(st, len, step)]) => (0..len).map(|i| v.get(usize::try_from(st + i * step).ok()?).copied()).collect(),
        _ => None,
    };
    one((ty_opt(cx.dtype(0), Some(out)), ints))
}

/// Per-axis (start, len, step) of a Slice; indices follow numpy clamping.
fn slice_ranges(data: &[i64], starts: &[i64], ends: &[i64], axes: Option<&[i64]>, steps: Option<&[i64]>) -> Result<Vec<(i64, i64, i64)>, String> {
    let mut r: Vec<(i64, i64, i64)> = data.iter().map(|&d| (0, d, 1)).collect();
    for (k, (&s, &e)) in starts.iter().zip(ends).enumerate() {
        let axis = match axes {
            Some(a) => dim_axis(*a.get(k).ok_or("axes shorter than starts")?, data.len())?,
            None => k,
        };
        let step = steps.and_then(|st| st.get(k)).copied().unwrap_or(1);
        if step == 0 {
            return Err("slice step 0".into());
        }
        let d = *data.get(axis).ok_or("slice axis out of range")?;
        let wrap = |x: i64| if x < 0 { x.saturating_add(d) } else { x };
        // the positions taken: ceil(span / |step|), the span clamped to the dim
        let count = |span: i64| (span.max(0) as u64).div_ceil(step.unsigned_abs()) as i64;
        let (start, len) = if d == 0 {
            (0, 0)
        } else if step > 0 {
            let st = wrap(s).clamp(0, d);
            let en = wrap(e).clamp(0, d);
            (st, count(en - st))
        } else {
            let st = wrap(s).clamp(0, d - 1);
            let en = wrap(e).clamp(-1, d - 1);
            (st, count(st - en))
        };
        r[axis] = (start, len, step);
    }
    Ok(r)
}

/// Gather(x, indices) along `axis`: `x[..axis] ++ indices ++ x[axis+1..]`.
pub(super) fn gather(cx: &Ctx) -> Outs {
    let (Some(x), Some(ind)) = (cx.shape(0), cx.shape(1)) else { return one((ty_opt(cx.dtype(0), None), None)) };
    let ax = dim_axis(cx.attrs().int("axis", 0), x.len())?;
    let mut out = x[..ax].to_vec();
    out.extend_from_slice(ind);
    out.extend_from_slice(&x[ax + 1..]);
    let ints = match (cx.ints(0), cx.ints(1)) {
        (Some(v), Some(i)) if x.len() == 1 => i
            .iter()
            .map(|&k| v.get(usize::try_from(if k < 0 { k + x[0] } else { k }).ok()?).copied())
            .collect::<Option<Vec<i64>>>(),
        _ => None,
    };
    one((ty_opt(cx.dtype(0), Some(out)), ints))
}

/// GatherElements(x, indices): the indices' shape.
pub(super) fn gather_elements(cx: &Ctx) -> Outs {
    one((ty_opt(cx.dtype(0), cx.shape(1).map(<[i64]>::to_vec)), None))
}

/// GatherND(x, indices) with `batch_dims`.
pub(super) fn gather_nd(cx: &Ctx) -> Outs {
    let (Some(x), Some(ind)) = (cx.shape(0), cx.shape(1)) else { return one((ty_opt(cx.dtype(0), None), None)) };
    let b = cx.attrs().int("batch_dims", 0).max(0) as usize;
    let last = *ind.last().ok_or("indices of rank 0")?;
    let fits = usize::try_from(last).ok().and_then(|l| l.checked_add(b)).filter(|&n| n <= x.len());
    let Some(from) = fits else {
        return Err(format!("indices {ind:?} index too many dims of {x:?}"));
    };
    let mut out = ind[..ind.len() - 1].to_vec();
    out.extend_from_slice(&x[from..]);
    one((ty_opt(cx.dtype(0), Some(out)), None))
}

/// ScatterND: the data's type.
pub(super) fn scatter_nd(cx: &Ctx) -> Outs {
    one(cx.same(0))
}

/// Pad(x, pads, value?, axes?): each padded dim grows by its two pads.
pub(super) fn pad(cx: &Ctx) -> Outs {
    let pads: Vec<i64> = cx.need_ints(1, "pads")?.ok_or("no pads")?.to_vec();
    let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
    let axes: Vec<usize> = match cx.need_ints(3, "axes")? {
        Some(ax) => ax.iter().map(|&v| dim_axis(v, x.len())).collect::<Result<_, _>>()?,
        None => (0..x.len()).collect(),
    };
    let k = axes.len();
    if pads.len() != 2 * k {
        return Err(format!("pads {pads:?} do not fit {k} axes"));
    }
    let mut out = x.to_vec();
    for (j, &ax) in axes.iter().enumerate() {
        let grown = out[ax].checked_add(pads[j]).and_then(|d| d.checked_add(pads[j + k]));
        out[ax] = grown.ok_or_else(|| format!("pads {pads:?} overflow dim {ax} of {x:?}"))?;
    }
    one((ty_opt(cx.dtype(0), Some(out)), None))
}
