//! Static shape inference: binds symbolic dims, then gives every value a concrete type,
//! evaluating small integer tensors (shape arithmetic) on the way.

use std::collections::BTreeMap;

use super::{AnalyzeOptions, PassError};
use crate::ir::{
    Attrs, DType, Dim, DimBindings, Graph, Node, NodeId, Op, OpKind, Shape, TensorType,
    ValueId, ValueKind,
};

/// Integer tensors up to this many elements are evaluated (and may be folded).
pub const MAX_EVAL_ELEMS: usize = 4096;

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

/// Infers every value's type under `dims`, writes the types of intermediates into the graph
/// and returns them with the evaluated small integer tensors.
pub fn infer_shapes(graph: &mut Graph, dims: &DimBindings) -> Result<ShapeInfo, PassError> {
    let info = infer(graph, &dims.values, true)?;
    for v in graph.value_ids().collect::<Vec<_>>() {
        let val = graph.value(v);
        if val.kind != ValueKind::Intermediate || val.producer.is_none() {
            continue;
        }
        let inferred = info.types[v.index()].as_ref().map(|t| TensorType {
            dtype: t.dtype,
            shape: t.shape.as_ref().map(|s| Shape::from_known(s)),
        });
        if let (Some(declared), Some(inf)) = (&val.ty, &inferred)
            && let (Some(ds), Some(is)) = (&declared.shape, &inf.shape)
        {
            let resolved = resolve(ds, &dims.values);
            let agrees = resolved.as_ref().is_none_or(|r| r == &is.known().unwrap_or_default());
            if !agrees || declared.dtype != inf.dtype {
                tracing::warn!(value = %val.name, declared = %declared, inferred = %inf, "declared value_info disagrees with inferred type; using the inferred one");
            }
        }
        if inferred.is_some() {
            graph.value_mut(v).ty = inferred;
        }
    }
    Ok(info)
}

/// Resolves a shape's symbols; `None` if one is unbound.
fn resolve(shape: &Shape, dims: &BTreeMap<String, i64>) -> Option<Vec<i64>> {
    shape
        .0
        .iter()
        .map(|d| match d {
            Dim::Known(v) => Some(*v),
            Dim::Sym(s) => dims.get(s).copied(),
        })
        .collect()
}

/// Infers types without touching the graph. `warn` logs unknown types.
pub fn infer(graph: &Graph, dims: &BTreeMap<String, i64>, warn: bool) -> Result<ShapeInfo, PassError> {
    let n = graph.value_count();
    let mut info = ShapeInfo { types: vec![None; n], ints: vec![None; n] };
    for v in graph.value_ids() {
        let val = graph.value(v);
        match val.kind {
            ValueKind::Initializer | ValueKind::Constant => {
                if let Some(t) = &val.data {
                    info.types[v.index()] = Some(Ty { dtype: t.dtype, shape: Some(t.dims.clone()) });
                    if (t.dtype.is_int() || t.dtype == DType::Bool) && t.numel() as usize <= MAX_EVAL_ELEMS {
                        info.ints[v.index()] = t.to_i64_vec();
                    }
                } else if let Some(ty) = &val.ty {
                    info.types[v.index()] = Some(Ty {
                        dtype: ty.dtype,
                        shape: ty.shape.as_ref().and_then(|s| resolve(s, dims)),
                    });
                }
            }
            ValueKind::Input => {
                if let Some(ty) = &val.ty {
                    info.types[v.index()] = Some(Ty {
                        dtype: ty.dtype,
                        shape: ty.shape.as_ref().and_then(|s| resolve(s, dims)),
                    });
                }
            }
            ValueKind::Intermediate => {}
        }
    }
    let order = graph.topo_order()?;
    let opset = graph.opsets.get("").or_else(|| graph.opsets.get("ai.onnx")).copied().unwrap_or(18);
    for id in order {
        let node = graph.node(id);
        let outs = infer_node(graph, id, &info, dims, opset).map_err(|msg| PassError::Shape {
            node: node.name.clone(),
            op: node.op.to_string(),
            msg,
        })?;
        for (i, &o) in node.outputs.iter().enumerate() {
            let (ty, ints) = outs.get(i).cloned().unwrap_or((None, None));
            if ty.is_none() && warn {
                tracing::warn!(node = %node.name, op = %node.op, value = %graph.value(o).name, "output type unknown; figures of its consumers will be incomplete");
            }
            let ints = ints.filter(|v| v.len() <= MAX_EVAL_ELEMS);
            info.types[o.index()] = ty;
            info.ints[o.index()] = ints;
        }
    }
    Ok(info)
}

type Out = (Option<Ty>, Option<Vec<i64>>);

struct Ctx<'a> {
    graph: &'a Graph,
    node: &'a Node,
    info: &'a ShapeInfo,
}

impl Ctx<'_> {
    fn input(&self, i: usize) -> Option<ValueId> {
        self.node.inputs.get(i).copied().flatten()
    }
    fn ty(&self, i: usize) -> Option<&Ty> {
        self.input(i).and_then(|v| self.info.types[v.index()].as_ref())
    }
    fn shape(&self, i: usize) -> Option<&[i64]> {
        self.ty(i).and_then(|t| t.shape.as_deref())
    }
    fn dtype(&self, i: usize) -> Option<DType> {
        self.ty(i).map(|t| t.dtype)
    }
    fn ints(&self, i: usize) -> Option<&[i64]> {
        self.input(i).and_then(|v| self.info.ints(v))
    }
    /// Integer operand needed for the output shape; an error if present but not evaluable.
    fn need_ints(&self, i: usize, what: &str) -> Result<Option<&[i64]>, String> {
        match self.input(i) {
            None => Ok(None),
            Some(v) => match self.info.ints(v) {
                Some(x) => Ok(Some(x)),
                None => Err(format!(
                    "its {what} (`{}`) is not a constant after binding dims; it must be computable from shapes",
                    self.graph.value(v).name
                )),
            },
        }
    }
    fn attrs(&self) -> &Attrs {
        &self.node.attrs
    }
    fn same(&self, i: usize) -> Out {
        (self.ty(i).cloned(), None)
    }
}

fn norm_axis(axis: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r.max(1) && !(r == 0 && a == 0) {
        return Err(format!("axis {axis} is out of range for rank {rank}"));
    }
    Ok(a as usize)
}

/// Multidirectional (numpy) broadcasting.
pub fn broadcast(a: &[i64], b: &[i64]) -> Result<Vec<i64>, String> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i < r - a.len() { 1 } else { a[i - (r - a.len())] };
        let db = if i < r - b.len() { 1 } else { b[i - (r - b.len())] };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(format!("shapes {a:?} and {b:?} do not broadcast"));
        };
    }
    Ok(out)
}

/// For each element of `out`, the row-major index into a tensor of shape `input` broadcast to it.
fn bcast_index(out: &[i64], input: &[i64]) -> Vec<usize> {
    let n: i64 = out.iter().product();
    let off = out.len() - input.len();
    let mut strides = vec![0i64; out.len()];
    let mut s = 1i64;
    for i in (0..input.len()).rev() {
        strides[i + off] = if input[i] == 1 { 0 } else { s };
        s *= input[i];
    }
    let mut idx = Vec::with_capacity(n.max(0) as usize);
    let mut coord = vec![0i64; out.len()];
    for _ in 0..n.max(0) {
        idx.push(coord.iter().zip(&strides).map(|(c, s)| c * s).sum::<i64>() as usize);
        for d in (0..out.len()).rev() {
            coord[d] += 1;
            if coord[d] < out[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    idx
}

fn numel(s: &[i64]) -> i64 {
    s.iter().product()
}

/// Elementwise over broadcast inputs: result type and (if all inputs are evaluated) values.
fn elementwise(cx: &Ctx, inputs: &[usize], dtype: Option<DType>, f: Option<&dyn Fn(&[i64]) -> i64>) -> Result<Out, String> {
    let Some(dtype) = dtype else { return Ok((None, None)) };
    let mut shape: Option<Vec<i64>> = Some(Vec::new());
    for &i in inputs {
        if cx.input(i).is_none() {
            continue;
        }
        shape = match (shape, cx.shape(i)) {
            (Some(s), Some(t)) => Some(broadcast(&s, t)?),
            _ => None,
        };
    }
    let mut ints = None;
    if let (Some(f), Some(out)) = (f, &shape)
        && (dtype.is_int() || dtype == DType::Bool)
        && numel(out) as usize <= MAX_EVAL_ELEMS
    {
        let vals: Option<Vec<(&[i64], Vec<usize>)>> = inputs
            .iter()
            .map(|&i| Some((cx.ints(i)?, bcast_index(out, cx.shape(i)?))))
            .collect();
        if let Some(vals) = vals {
            let mut res = Vec::with_capacity(numel(out) as usize);
            let mut args = vec![0i64; vals.len()];
            for e in 0..numel(out) as usize {
                for (k, (v, idx)) in vals.iter().enumerate() {
                    args[k] = *v.get(idx[e]).ok_or("evaluated value has the wrong size")?;
                }
                res.push(f(&args));
            }
            ints = Some(res);
        }
    }
    Ok((Some(Ty { dtype, shape }), ints))
}

fn int_like(dtype: Option<DType>) -> bool {
    dtype.is_some_and(|d| d.is_int() || d == DType::Bool)
}

fn cast_int(v: i64, to: DType) -> i64 {
    match to {
        DType::Bool => (v != 0) as i64,
        DType::I8 => v as i8 as i64,
        DType::U8 => v as u8 as i64,
        DType::I16 => v as i16 as i64,
        DType::U16 => v as u16 as i64,
        DType::I32 => v as i32 as i64,
        DType::U32 => v as u32 as i64,
        _ => v,
    }
}

fn pool_out(input: i64, k: i64, stride: i64, pad: i64, dil: i64, ceil: bool) -> i64 {
    let eff = (k - 1) * dil + 1;
    let num = input + pad - eff;
    if num < 0 {
        return 0;
    }
    if ceil { (num + stride - 1) / stride + 1 } else { num / stride + 1 }
}

/// Output spatial sizes of Conv/pooling, honouring auto_pad.
fn spatial(cx: &Ctx, input: &[i64], kernel: &[i64], ceil: bool) -> Result<Vec<i64>, String> {
    let n = kernel.len();
    if input.len() != n {
        return Err(format!("kernel rank {n} does not match {} spatial dims", input.len()));
    }
    let strides = cx.attrs().ints("strides").map(<[i64]>::to_vec).unwrap_or(vec![1; n]);
    let dil = cx.attrs().ints("dilations").map(<[i64]>::to_vec).unwrap_or(vec![1; n]);
    let pads = cx.attrs().ints("pads").map(<[i64]>::to_vec).unwrap_or(vec![0; 2 * n]);
    let auto = cx.attrs().str("auto_pad").unwrap_or("NOTSET");
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let s = *strides.get(i).unwrap_or(&1);
        let d = *dil.get(i).unwrap_or(&1);
        if s <= 0 {
            return Err(format!("stride {s} must be positive"));
        }
        out.push(match auto {
            "SAME_UPPER" | "SAME_LOWER" => (input[i] + s - 1) / s,
            "VALID" => pool_out(input[i], kernel[i], s, 0, d, ceil),
            _ => {
                let p = pads.get(i).unwrap_or(&0) + pads.get(i + n).unwrap_or(&0);
                pool_out(input[i], kernel[i], s, p, d, ceil)
            }
        });
    }
    Ok(out)
}

fn ty(dtype: DType, shape: Vec<i64>) -> Option<Ty> {
    Some(Ty { dtype, shape: Some(shape) })
}

fn ty_opt(dtype: Option<DType>, shape: Option<Vec<i64>>) -> Option<Ty> {
    dtype.map(|dtype| Ty { dtype, shape })
}

/// Per-axis (start, len, step) of a Slice; indices follow numpy clamping.
fn slice_ranges(data: &[i64], starts: &[i64], ends: &[i64], axes: Option<&[i64]>, steps: Option<&[i64]>) -> Result<Vec<(i64, i64, i64)>, String> {
    let mut r: Vec<(i64, i64, i64)> = data.iter().map(|&d| (0, d, 1)).collect();
    for (k, (&s, &e)) in starts.iter().zip(ends).enumerate() {
        let axis = match axes {
            Some(a) => norm_axis(*a.get(k).ok_or("axes shorter than starts")?, data.len())?,
            None => k,
        };
        let step = steps.and_then(|st| st.get(k)).copied().unwrap_or(1);
        if step == 0 {
            return Err("slice step 0".into());
        }
        let d = *data.get(axis).ok_or("slice axis out of range")?;
        let wrap = |x: i64| if x < 0 { x.saturating_add(d) } else { x };
        let (start, len) = if step > 0 {
            let st = wrap(s).clamp(0, d);
            let en = wrap(e).clamp(0, d);
            (st, ((en - st).max(0) + step - 1) / step)
        } else {
            let st = wrap(s).clamp(0, d - 1);
            let en = wrap(e).clamp(-1, d - 1);
            (st, ((st - en).max(0) + (-step) - 1) / (-step))
        };
        r[axis] = (start, len, step);
    }
    Ok(r)
}

fn infer_node(graph: &Graph, id: NodeId, info: &ShapeInfo, dims: &BTreeMap<String, i64>, opset: i64) -> Result<Vec<Out>, String> {
    let node = graph.node(id);
    let cx = Ctx { graph, node, info };
    let kind = match &node.op {
        Op::Known(k) => *k,
        Op::Placeholder { .. } => {
            return Ok(node
                .outputs
                .iter()
                .map(|&o| {
                    let t = graph.value(o).ty.as_ref().map(|t| Ty {
                        dtype: t.dtype,
                        shape: t.shape.as_ref().and_then(|s| resolve(s, dims)),
                    });
                    (t, None)
                })
                .collect());
        }
    };
    use OpKind::*;
    let a = cx.attrs();
    let one = |o: Out| Ok(vec![o]);
    match kind {
        Identity => one((cx.ty(0).cloned(), cx.ints(0).map(<[i64]>::to_vec))),
        Abs | Neg | Sign => {
            let f: &dyn Fn(&[i64]) -> i64 = match kind {
                Abs => &|x| x[0].abs(),
                Neg => &|x| -x[0],
                _ => &|x| x[0].signum(),
            };
            one(elementwise(&cx, &[0], cx.dtype(0), Some(f))?)
        }
        Exp | Log | Sqrt | Reciprocal | Tanh | Sigmoid | Relu | Erf | Sin | Cos | Floor | Ceil | Round
        | Softplus | LeakyRelu | Elu | Gelu | HardSigmoid | HardSwish | Clip | Trilu | CumSum | Softmax
        | LogSoftmax | LRN | InstanceNormalization => one(cx.same(0)),
        Not => one(elementwise(&cx, &[0], Some(DType::Bool), Some(&|x| (x[0] == 0) as i64))?),
        IsNaN | IsInf => one(elementwise(&cx, &[0], Some(DType::Bool), None)?),
        Cast => {
            let to = DType::from_onnx(a.int("to", 0) as i32).ok_or("Cast has no valid `to` type")?;
            cast_out(&cx, to)
        }
        CastLike => match cx.dtype(1) {
            Some(to) => cast_out(&cx, to),
            None => one((None, None)),
        },
        Add | Sub | Mul | Div | Mod | Pow | Max | Min | Sum | Mean => {
            let idx: Vec<usize> = (0..node.inputs.len()).collect();
            let fmod = a.int("fmod", 0) != 0;
            let f: Option<&dyn Fn(&[i64]) -> i64> = match kind {
                Add => Some(&|x| x[0].wrapping_add(x[1])),
                Sub => Some(&|x| x[0].wrapping_sub(x[1])),
                Mul => Some(&|x| x[0].wrapping_mul(x[1])),
                Div => Some(&|x| if x[1] == 0 { 0 } else { x[0].wrapping_div(x[1]) }),
                Mod if fmod => Some(&|x| if x[1] == 0 { 0 } else { x[0] % x[1] }),
                Mod => Some(&|x| if x[1] == 0 { 0 } else { ((x[0] % x[1]) + x[1]) % x[1] }),
                Max => Some(&|x| x.iter().copied().max().unwrap_or(0)),
                Min => Some(&|x| x.iter().copied().min().unwrap_or(0)),
                Sum => Some(&|x| x.iter().sum()),
                _ => None,
            };
            let f = if matches!(kind, Add | Sub | Mul | Div | Mod) && node.inputs.len() != 2 { None } else { f };
            one(elementwise(&cx, &idx, cx.dtype(0), f)?)
        }
        Equal | Less | LessOrEqual | Greater | GreaterOrEqual | And | Or | Xor => {
            let f: &dyn Fn(&[i64]) -> i64 = match kind {
                Equal => &|x| (x[0] == x[1]) as i64,
                Less => &|x| (x[0] < x[1]) as i64,
                LessOrEqual => &|x| (x[0] <= x[1]) as i64,
                Greater => &|x| (x[0] > x[1]) as i64,
                GreaterOrEqual => &|x| (x[0] >= x[1]) as i64,
                And => &|x| (x[0] != 0 && x[1] != 0) as i64,
                Or => &|x| (x[0] != 0 || x[1] != 0) as i64,
                _ => &|x| ((x[0] != 0) ^ (x[1] != 0)) as i64,
            };
            let f = if int_like(cx.dtype(0)) { Some(f) } else { None };
            one(elementwise(&cx, &[0, 1], Some(DType::Bool), f)?)
        }
        Where => one(elementwise(&cx, &[0, 1, 2], cx.dtype(1), Some(&|x| if x[0] != 0 { x[1] } else { x[2] }))?),
        MatMul => {
            let (Some(sa), Some(sb)) = (cx.shape(0), cx.shape(1)) else {
                return one((ty_opt(cx.dtype(0), None), None));
            };
            one((ty_opt(cx.dtype(0), Some(matmul_shape(sa, sb)?)), None))
        }
        ScaledDotProductAttention => {
            let (Some(q), Some(kt), Some(v)) = (cx.shape(0), cx.shape(1), cx.shape(2)) else {
                return one((ty_opt(cx.dtype(0), None), None));
            };
            let scores = matmul_shape(q, kt)?;
            if let Some(m) = cx.shape(3)
                && broadcast(&scores, m)? != scores
            {
                return Err(format!("the mask {m:?} does not broadcast to the scores {scores:?}"));
            }
            one((ty_opt(cx.dtype(0), Some(matmul_shape(&scores, v)?)), None))
        }
        MixtureOfExperts => one(mixture_of_experts(&cx)?),
        Gemm => {
            let (Some(sa), Some(sb)) = (cx.shape(0), cx.shape(1)) else {
                return one((ty_opt(cx.dtype(0), None), None));
            };
            if sa.len() != 2 || sb.len() != 2 {
                return Err(format!("Gemm needs rank-2 inputs, got {sa:?} and {sb:?}"));
            }
            let (m, ka) = if a.int("transA", 0) != 0 { (sa[1], sa[0]) } else { (sa[0], sa[1]) };
            let (kb, n) = if a.int("transB", 0) != 0 { (sb[1], sb[0]) } else { (sb[0], sb[1]) };
            if ka != kb {
                return Err(format!("inner dims differ: {sa:?} × {sb:?}"));
            }
            one((ty_opt(cx.dtype(0), Some(vec![m, n])), None))
        }
        Conv => {
            let (Some(x), Some(w)) = (cx.shape(0), cx.shape(1)) else {
                return one((ty_opt(cx.dtype(0), None), None));
            };
            if x.len() < 3 || w.len() != x.len() {
                return Err(format!("Conv input {x:?} and weight {w:?} ranks do not fit"));
            }
            let kernel = a.ints("kernel_shape").map(<[i64]>::to_vec).unwrap_or(w[2..].to_vec());
            let mut out = vec![x[0], w[0]];
            out.extend(spatial(&cx, &x[2..], &kernel, false)?);
            one((ty_opt(cx.dtype(0), Some(out)), None))
        }
        MaxPool | AveragePool => {
            let Some(x) = cx.shape(0) else { return one((ty_opt(cx.dtype(0), None), None)) };
            let kernel = a.ints("kernel_shape").ok_or("no kernel_shape")?.to_vec();
            if x.len() < 2 {
                return Err(format!("pooling input {x:?} has rank < 2"));
            }
            let mut out = x[..2].to_vec();
            out.extend(spatial(&cx, &x[2..], &kernel, a.int("ceil_mode", 0) != 0)?);
            let mut outs = vec![(ty_opt(cx.dtype(0), Some(out.clone())), None)];
            if node.outputs.len() > 1 {
                outs.push((ty(DType::I64, out), None));
            }
            Ok(outs)
        }
        GlobalAveragePool | GlobalMaxPool => {
            let s = cx.shape(0).map(|x| x.iter().enumerate().map(|(i, &d)| if i < 2 { d } else { 1 }).collect());
            one((ty_opt(cx.dtype(0), s), None))
        }
        LayerNormalization => {
            let x = cx.shape(0).map(<[i64]>::to_vec);
            let mut outs = vec![cx.same(0)];
            if node.outputs.len() > 1 {
                let stats = match &x {
                    Some(x) => {
                        let ax = norm_axis(a.int("axis", -1), x.len())?;
                        Some(x.iter().enumerate().map(|(i, &d)| if i < ax { d } else { 1 }).collect())
                    }
                    None => None,
                };
                let st = DType::from_onnx(a.int("stash_type", 1) as i32).unwrap_or(DType::F32);
                outs.push((ty_opt(Some(st), stats.clone()), None));
                outs.push((ty_opt(Some(st), stats), None));
            }
            Ok(outs)
        }
        BatchNormalization => {
            let c = cx.shape(0).and_then(|x| x.get(1).copied());
            let mut outs = vec![cx.same(0)];
            for _ in 1..node.outputs.len() {
                outs.push((ty_opt(cx.dtype(1).or(cx.dtype(0)), c.map(|c| vec![c])), None));
            }
            Ok(outs)
        }
        ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd => {
            let Some(x) = cx.shape(0) else { return one((ty_opt(cx.dtype(0), None), None)) };
            let axes: Vec<i64> = match cx.need_ints(1, "axes")? {
                Some(ax) => ax.to_vec(),
                None => a.ints("axes").map(<[i64]>::to_vec).unwrap_or_default(),
            };
            let noop = a.int("noop_with_empty_axes", 0) != 0;
            if axes.is_empty() && noop {
                return one(cx.same(0));
            }
            let axes: Vec<usize> = if axes.is_empty() {
                (0..x.len()).collect()
            } else {
                axes.iter().map(|&ax| norm_axis(ax, x.len())).collect::<Result<_, _>>()?
            };
            let keep = a.int("keepdims", 1) != 0;
            let out = reduce_shape(x, &axes, keep);
            let fold: Option<fn(i64, i64) -> i64> = match kind {
                ReduceSum => Some(i64::wrapping_add),
                ReduceProd => Some(i64::wrapping_mul),
                ReduceMax => Some(i64::max),
                ReduceMin => Some(i64::min),
                _ => None,
            };
            let ints = match (fold, cx.ints(0)) {
                (Some(f), Some(v)) => reduce_ints(x, v, &axes, f),
                _ => None,
            };
            one((ty_opt(cx.dtype(0), Some(out)), ints))
        }
        TopK => top_k(&cx),
        ArgMax | ArgMin => {
            let s = match cx.shape(0) {
                Some(x) => {
                    let ax = norm_axis(a.int("axis", 0), x.len())?;
                    Some(reduce_shape(x, &[ax], a.int("keepdims", 1) != 0))
                }
                None => None,
            };
            one((ty_opt(Some(DType::I64), s), None))
        }
        Reshape => {
            let target = cx.need_ints(1, "target shape")?.ok_or("no target shape")?;
            let Some(x) = cx.shape(0) else { return one((ty_opt(cx.dtype(0), None), None)) };
            let allowzero = a.int("allowzero", 0) != 0;
            let mut out: Vec<i64> = Vec::with_capacity(target.len());
            let mut infer_at = None;
            for (i, &t) in target.iter().enumerate() {
                if t == 0 && !allowzero {
                    out.push(*x.get(i).ok_or_else(|| format!("target {target:?} copies dim {i} of {x:?}"))?);
                } else if t == -1 {
                    if infer_at.replace(i).is_some() {
                        return Err(format!("target {target:?} has two -1"));
                    }
                    out.push(1);
                } else if t < 0 {
                    return Err(format!("target {target:?} has a negative size"));
                } else {
                    out.push(t);
                }
            }
            let total = numel(x);
            if let Some(i) = infer_at {
                let rest = numel(&out);
                if rest == 0 || total % rest != 0 {
                    return Err(format!("cannot reshape {x:?} to {target:?}"));
                }
                out[i] = total / rest;
            } else if numel(&out) != total {
                return Err(format!("cannot reshape {x:?} ({total} elements) to {out:?}"));
            }
            one((ty_opt(cx.dtype(0), Some(out)), cx.ints(0).map(<[i64]>::to_vec)))
        }
        Flatten => {
            let s = match cx.shape(0) {
                Some(x) => {
                    let mut ax = a.int("axis", 1);
                    if ax < 0 {
                        ax += x.len() as i64;
                    }
                    let ax = (ax.max(0) as usize).min(x.len());
                    Some(vec![numel(&x[..ax]), numel(&x[ax..])])
                }
                None => None,
            };
            one((ty_opt(cx.dtype(0), s), cx.ints(0).map(<[i64]>::to_vec)))
        }
        Transpose => {
            let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
            let perm: Vec<i64> = a.ints("perm").map(<[i64]>::to_vec).unwrap_or_else(|| (0..x.len() as i64).rev().collect());
            if perm.len() != x.len() {
                return Err(format!("perm {perm:?} does not fit rank {}", x.len()));
            }
            let out = perm.iter().map(|&p| norm_axis(p, x.len()).map(|p| x[p])).collect::<Result<Vec<_>, _>>()?;
            let ints = match cx.ints(0) {
                Some(v) if x.len() <= 1 => Some(v.to_vec()),
                _ => None,
            };
            one((ty_opt(cx.dtype(0), Some(out)), ints))
        }
        Concat => {
            let dtype = (0..node.inputs.len()).find_map(|i| cx.dtype(i));
            let shapes: Option<Vec<&[i64]>> = (0..node.inputs.len()).filter(|&i| cx.input(i).is_some()).map(|i| cx.shape(i)).collect();
            let Some(shapes) = shapes else { return one((ty_opt(dtype, None), None)) };
            let Some(first) = shapes.first() else { return Err("no inputs".into()) };
            let ax = norm_axis(a.int("axis", 0), first.len())?;
            let mut out = first.to_vec();
            out[ax] = 0;
            for s in &shapes {
                if s.len() != first.len() {
                    return Err(format!("inputs of ranks {} and {} cannot be joined", first.len(), s.len()));
                }
                out[ax] += s[ax];
            }
            let ints = if first.len() == 1 {
                let parts: Option<Vec<&[i64]>> = (0..node.inputs.len()).filter(|&i| cx.input(i).is_some()).map(|i| cx.ints(i)).collect();
                parts.map(|p| p.concat())
            } else {
                None
            };
            one((ty_opt(dtype, Some(out)), ints))
        }
        Split => {
            let n = node.outputs.len();
            let Some(x) = cx.shape(0) else { return Ok(vec![cx.same(0); n]) };
            let ax = norm_axis(a.int("axis", 0), x.len())?;
            let d = x[ax];
            let sizes: Vec<i64> = match cx.need_ints(1, "split sizes")? {
                Some(s) => s.to_vec(),
                None => match a.ints("split") {
                    Some(s) => s.to_vec(),
                    None => {
                        let chunk = (d + n as i64 - 1) / (n as i64).max(1);
                        (0..n as i64).map(|i| chunk.min(d - i * chunk).max(0)).collect()
                    }
                },
            };
            if sizes.len() != n || sizes.iter().sum::<i64>() != d {
                return Err(format!("split sizes {sizes:?} do not cover dim {d} in {n} outputs"));
            }
            let mut outs = Vec::with_capacity(n);
            let mut start = 0usize;
            for &s in &sizes {
                let mut sh = x.to_vec();
                sh[ax] = s;
                let ints = if x.len() == 1 { cx.ints(0).map(|v| v[start..start + s as usize].to_vec()) } else { None };
                start += s as usize;
                outs.push((ty_opt(cx.dtype(0), Some(sh)), ints));
            }
            Ok(outs)
        }
        Slice => {
            let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
            let (starts, ends, axes, steps): (Vec<i64>, Vec<i64>, Option<Vec<i64>>, Option<Vec<i64>>) = if opset >= 10 || node.inputs.len() > 1 {
                (
                    cx.need_ints(1, "starts")?.ok_or("no starts")?.to_vec(),
                    cx.need_ints(2, "ends")?.ok_or("no ends")?.to_vec(),
                    cx.need_ints(3, "axes")?.map(<[i64]>::to_vec),
                    cx.need_ints(4, "steps")?.map(<[i64]>::to_vec),
                )
            } else {
                (
                    a.ints("starts").ok_or("no starts")?.to_vec(),
                    a.ints("ends").ok_or("no ends")?.to_vec(),
                    a.ints("axes").map(<[i64]>::to_vec),
                    None,
                )
            };
            if starts.len() != ends.len() {
                return Err("starts and ends differ in length".into());
            }
            let r = slice_ranges(x, &starts, &ends, axes.as_deref(), steps.as_deref())?;
            let out: Vec<i64> = r.iter().map(|t| t.1).collect();
            let ints = match cx.ints(0) {
                Some(v) if x.len() == 1 => {
                    let (st, len, step) = r[0];
                    Some((0..len).map(|i| v[(st + i * step) as usize]).collect())
                }
                _ => None,
            };
            one((ty_opt(cx.dtype(0), Some(out)), ints))
        }
        Gather => {
            let (Some(x), Some(ind)) = (cx.shape(0), cx.shape(1)) else { return one((ty_opt(cx.dtype(0), None), None)) };
            let ax = norm_axis(a.int("axis", 0), x.len())?;
            let mut out = x[..ax].to_vec();
            out.extend_from_slice(ind);
            out.extend_from_slice(&x[ax + 1..]);
            let ints = match (cx.ints(0), cx.ints(1)) {
                (Some(v), Some(i)) if x.len() == 1 => i
                    .iter()
                    .map(|&k| v.get(if k < 0 { (k + x[0]) as usize } else { k as usize }).copied())
                    .collect::<Option<Vec<i64>>>(),
                _ => None,
            };
            one((ty_opt(cx.dtype(0), Some(out)), ints))
        }
        GatherElements => one((ty_opt(cx.dtype(0), cx.shape(1).map(<[i64]>::to_vec)), None)),
        GatherND => {
            let (Some(x), Some(ind)) = (cx.shape(0), cx.shape(1)) else { return one((ty_opt(cx.dtype(0), None), None)) };
            let b = a.int("batch_dims", 0).max(0) as usize;
            let last = *ind.last().ok_or("indices of rank 0")? as usize;
            if b + last > x.len() {
                return Err(format!("indices {ind:?} index too many dims of {x:?}"));
            }
            let mut out = ind[..ind.len() - 1].to_vec();
            out.extend_from_slice(&x[b + last..]);
            one((ty_opt(cx.dtype(0), Some(out)), None))
        }
        ScatterND => one(cx.same(0)),
        Unsqueeze => {
            let axes: Vec<i64> = match cx.need_ints(1, "axes")? {
                Some(x) => x.to_vec(),
                None => a.ints("axes").ok_or("no axes")?.to_vec(),
            };
            let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
            let r = x.len() + axes.len();
            let mut ax: Vec<usize> = axes.iter().map(|&v| norm_axis(v, r)).collect::<Result<_, _>>()?;
            ax.sort_unstable();
            let mut out = Vec::with_capacity(r);
            let mut it = x.iter();
            for i in 0..r {
                if ax.binary_search(&i).is_ok() {
                    out.push(1);
                } else {
                    out.push(*it.next().ok_or("repeated axes")?);
                }
            }
            one((ty_opt(cx.dtype(0), Some(out)), cx.ints(0).map(<[i64]>::to_vec)))
        }
        Squeeze => {
            let axes: Option<Vec<i64>> = match cx.need_ints(1, "axes")? {
                Some(x) => Some(x.to_vec()),
                None => a.ints("axes").map(<[i64]>::to_vec),
            };
            let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
            let out: Vec<i64> = match axes {
                Some(axes) => {
                    let ax: Vec<usize> = axes.iter().map(|&v| norm_axis(v, x.len())).collect::<Result<_, _>>()?;
                    x.iter().enumerate().filter(|(i, _)| !ax.contains(i)).map(|(_, &d)| d).collect()
                }
                None => x.iter().copied().filter(|&d| d != 1).collect(),
            };
            one((ty_opt(cx.dtype(0), Some(out)), cx.ints(0).map(<[i64]>::to_vec)))
        }
        Expand => {
            let target = cx.need_ints(1, "shape")?.ok_or("no shape")?;
            let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
            let out = broadcast(x, target)?;
            let ints = match cx.ints(0) {
                Some(v) if (numel(&out) as usize) <= MAX_EVAL_ELEMS => {
                    Some(bcast_index(&out, x).into_iter().map(|i| v.get(i).copied().unwrap_or(0)).collect())
                }
                _ => None,
            };
            one((ty_opt(cx.dtype(0), Some(out)), ints))
        }
        Tile => {
            let reps = cx.need_ints(1, "repeats")?.ok_or("no repeats")?;
            let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
            if reps.len() != x.len() {
                return Err(format!("repeats {reps:?} do not fit {x:?}"));
            }
            one((ty_opt(cx.dtype(0), Some(x.iter().zip(reps).map(|(d, r)| d * r).collect())), None))
        }
        Pad => {
            let pads: Vec<i64> = match cx.need_ints(1, "pads")? {
                Some(p) => p.to_vec(),
                None => a.ints("pads").ok_or("no pads")?.to_vec(),
            };
            let Some(x) = cx.shape(0) else { return one(cx.same(0)) };
            let axes: Vec<usize> = match cx.need_ints(3, "axes")? {
                Some(ax) => ax.iter().map(|&v| norm_axis(v, x.len())).collect::<Result<_, _>>()?,
                None => (0..x.len()).collect(),
            };
            let k = axes.len();
            if pads.len() != 2 * k {
                return Err(format!("pads {pads:?} do not fit {k} axes"));
            }
            let mut out = x.to_vec();
            for (j, &ax) in axes.iter().enumerate() {
                out[ax] += pads[j] + pads[j + k];
            }
            one((ty_opt(cx.dtype(0), Some(out)), None))
        }
        Shape => {
            let Some(x) = cx.shape(0) else { return one((None, None)) };
            let r = x.len() as i64;
            let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let start = clampi(a.int("start", 0));
            let end = clampi(a.int("end", r));
            let v: Vec<i64> = if start < end { x[start..end].to_vec() } else { Vec::new() };
            one((ty(DType::I64, vec![v.len() as i64]), Some(v)))
        }
        Size => {
            let v = cx.shape(0).map(|x| vec![numel(x)]);
            one((ty(DType::I64, vec![]), v))
        }
        ConstantOfShape => {
            let shape = cx.need_ints(0, "shape")?.ok_or("no shape")?.to_vec();
            let (dtype, fill) = match a.tensor("value") {
                Some(t) => (t.dtype, t.to_i64_vec().and_then(|v| v.first().copied())),
                None => (DType::F32, None),
            };
            let ints = match fill {
                Some(f) if (dtype.is_int() || dtype == DType::Bool) && numel(&shape) as usize <= MAX_EVAL_ELEMS => {
                    Some(vec![f; numel(&shape).max(0) as usize])
                }
                _ => None,
            };
            one((ty(dtype, shape), ints))
        }
        Range => {
            let dtype = cx.dtype(0).or(cx.dtype(1));
            let scalar = |i: usize| -> Option<f64> {
                if let Some(v) = cx.ints(i) {
                    return v.first().map(|&x| x as f64);
                }
                let val = graph.value(cx.input(i)?);
                val.data.as_ref().and_then(|t| t.to_f64_vec()).and_then(|v| v.first().copied())
            };
            let (Some(s), Some(l), Some(d)) = (scalar(0), scalar(1), scalar(2)) else {
                let v = cx.input(1).map(|v| graph.value(v).name.clone()).unwrap_or_default();
                return Err(format!("its limit `{v}` (or start/delta) is not a constant after binding dims"));
            };
            if d == 0.0 {
                return Err("delta is 0".into());
            }
            let n = ((l - s) / d).ceil().max(0.0) as i64;
            let ints = if int_like(dtype) && n as usize <= MAX_EVAL_ELEMS {
                Some((0..n).map(|i| s as i64 + i * d as i64).collect())
            } else {
                None
            };
            one((ty_opt(dtype, Some(vec![n])), ints))
        }
        Constant => {
            if let Some(t) = a.tensor("value") {
                let ints = if t.dtype.is_int() || t.dtype == DType::Bool { t.to_i64_vec() } else { None };
                one((ty(t.dtype, t.dims.clone()), ints))
            } else if let Some(v) = a.int_opt("value_int") {
                one((ty(DType::I64, vec![]), Some(vec![v])))
            } else if let Some(v) = a.ints("value_ints") {
                one((ty(DType::I64, vec![v.len() as i64]), Some(v.to_vec())))
            } else if a.get("value_float").is_some() {
                one((ty(DType::F32, vec![]), None))
            } else if let Some(v) = a.floats("value_floats") {
                one((ty(DType::F32, vec![v.len() as i64]), None))
            } else {
                let t = node.outputs.first().and_then(|&o| graph.value(o).data.as_ref());
                match t {
                    Some(t) => one((ty(t.dtype, t.dims.clone()), t.to_i64_vec())),
                    None => Err("Constant without a value attribute".into()),
                }
            }
        }
        Dropout => {
            let mut outs = vec![cx.same(0)];
            if node.outputs.len() > 1 {
                outs.push((ty_opt(Some(DType::Bool), cx.shape(0).map(<[i64]>::to_vec)), None));
            }
            Ok(outs)
        }
    }
}

fn cast_out(cx: &Ctx, to: DType) -> Result<Vec<Out>, String> {
    let shape = cx.shape(0).map(<[i64]>::to_vec);
    let ints = if int_like(Some(to)) {
        cx.ints(0).map(|v| v.iter().map(|&x| cast_int(x, to)).collect())
    } else {
        None
    };
    Ok(vec![(Some(Ty { dtype: to, shape }), ints)])
}

/// Reduces the row-major integer tensor `v` of shape `x` over `axes` with `f` (shape-arithmetic
/// chains such as tf2onnx's `ReduceProd(Gather(Shape(x)))`); `None` for an empty reduction.
fn reduce_ints(x: &[i64], v: &[i64], axes: &[usize], f: fn(i64, i64) -> i64) -> Option<Vec<i64>> {
    let kept: Vec<i64> = x.iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect();
    let mut out: Vec<Option<i64>> = vec![None; numel(&kept).max(0) as usize];
    let mut coord = vec![0i64; x.len()];
    for &val in v.iter().take(numel(x).max(0) as usize) {
        let mut at = 0i64;
        for (i, (&c, &d)) in coord.iter().zip(&kept).enumerate() {
            at = at * d + if axes.contains(&i) { 0 } else { c };
        }
        let slot = &mut out[at as usize];
        *slot = Some(slot.map_or(val, |acc| f(acc, val)));
        for d in (0..x.len()).rev() {
            coord[d] += 1;
            if coord[d] < x[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    out.into_iter().collect()
}

fn reduce_shape(x: &[i64], axes: &[usize], keep: bool) -> Vec<i64> {
    x.iter()
        .enumerate()
        .filter_map(|(i, &d)| {
            if axes.contains(&i) {
                if keep { Some(1) } else { None }
            } else {
                Some(d)
            }
        })
        .collect()
}

/// numpy matmul result shape.
pub fn matmul_shape(a: &[i64], b: &[i64]) -> Result<Vec<i64>, String> {
    if a.is_empty() || b.is_empty() {
        return Err("MatMul of a scalar".into());
    }
    let a2: Vec<i64> = if a.len() == 1 { vec![1, a[0]] } else { a.to_vec() };
    let b2: Vec<i64> = if b.len() == 1 { vec![b[0], 1] } else { b.to_vec() };
    let (m, k1) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    if k1 != k2 {
        return Err(format!("inner dims differ: {a:?} × {b:?}"));
    }
    let mut out = broadcast(&a2[..a2.len() - 2], &b2[..b2.len() - 2])?;
    if a.len() > 1 {
        out.push(m);
    }
    if b.len() > 1 {
        out.push(n);
    }
    Ok(out)
}

/// `MixtureOfExperts(x [N, H], weights [N, k], indices [N, k], gate_up [E, 2I, H], down
/// [E, H, I])` → `[N, H]` of x's type; the operands must agree.
fn mixture_of_experts(cx: &Ctx) -> Result<Out, String> {
    let shapes: Option<Vec<&[i64]>> = (0..5).map(|i| cx.shape(i)).collect();
    let Some(s) = shapes else { return Ok((ty_opt(cx.dtype(0), None), None)) };
    let (x, w, idx, gu, down) = (s[0], s[1], s[2], s[3], s[4]);
    let experts = cx.attrs().int("experts", 0);
    let fits = x.len() == 2
        && w.len() == 2
        && w == idx
        && w[0] == x[0]
        && gu.len() == 3
        && down.len() == 3
        && gu[0] == experts
        && down[0] == experts
        && gu[2] == x[1]
        && down[1] == x[1]
        && gu[1] == 2 * down[2];
    if !fits {
        return Err(format!(
            "operands x {x:?}, weights {w:?}, indices {idx:?}, gate_up {gu:?}, down {down:?} are not [N, H], [N, k], [N, k], [{experts}, 2I, H], [{experts}, H, I]"
        ));
    }
    if cx.dtype(2).is_some_and(|d| d != DType::I64) {
        return Err("the expert indices must be int64".into());
    }
    Ok((ty_opt(cx.dtype(0), Some(x.to_vec())), None))
}

/// ONNX `TopK(x, k)` (`k` an attribute before opset 10): values of x's type and int64
/// indices, x's shape with `k` along `axis`.
fn top_k(cx: &Ctx) -> Result<Vec<Out>, String> {
    let k = match cx.need_ints(1, "k")? {
        Some(&[k]) => Some(k),
        Some(k) => return Err(format!("k must hold one value, it holds {k:?}")),
        None => cx.attrs().int_opt("k"),
    };
    let shape = match (cx.shape(0), k) {
        (Some(x), Some(k)) => {
            let ax = norm_axis(cx.attrs().int("axis", -1), x.len())?;
            if k < 0 || k > x[ax] {
                return Err(format!("k = {k} is outside 0..={} (axis {ax} of {x:?})", x[ax]));
            }
            let mut out = x.to_vec();
            out[ax] = k;
            Some(out)
        }
        _ => None,
    };
    Ok(vec![(ty_opt(cx.dtype(0), shape.clone()), None), (ty_opt(Some(DType::I64), shape), None)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Tensor};
    use crate::passes::testutil::Builder;

    fn shape_of(g: &Graph, v: ValueId) -> Vec<i64> {
        g.value(v).ty.as_ref().unwrap().shape.as_ref().unwrap().known().unwrap()
    }

    fn run(b: &mut Builder, opts: &AnalyzeOptions) -> ShapeInfo {
        let dims = bind_dims(&b.g, opts).unwrap();
        infer_shapes(&mut b.g, &dims).unwrap()
    }

    #[test]
    fn broadcasting_and_matmul_follow_numpy() {
        assert_eq!(broadcast(&[2, 1, 4], &[3, 1]).unwrap(), vec![2, 3, 4]);
        assert!(broadcast(&[2, 3], &[4, 3]).is_err());
        assert_eq!(matmul_shape(&[5, 1, 2, 3], &[4, 3, 7]).unwrap(), vec![5, 4, 2, 7]);
        assert_eq!(matmul_shape(&[3], &[3, 7]).unwrap(), vec![7]);
        assert_eq!(matmul_shape(&[2, 3], &[3]).unwrap(), vec![2]);
        assert!(matmul_shape(&[2, 3], &[4, 5]).is_err());
    }

    #[test]
    fn reshape_copies_zeros_and_infers_minus_one() {
        let mut b = Builder::new(18);
        let x = b.input("x", DType::F32, &["batch", "6", "4"]);
        let t = b.ints(&[0, -1, 2]);
        let y = b.node(OpKind::Reshape, &[x, t], &[]);
        b.output(y);
        run(&mut b, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b.g, y), vec![1, 12, 2]);
    }

    #[test]
    fn shape_arithmetic_over_symbolic_dims_resolves_once_they_are_bound() {
        // tf2onnx's flatten: Reshape(x, Concat([-1], ReduceProd(Gather(Shape(x), [1, 2]))))
        // over `unk__` dims that only --seq-len binds.
        let mut b = Builder::new(18);
        let x = b.input("x", DType::F32, &["unk__1", "unk__2", "8"]);
        let shape = b.node(OpKind::Shape, &[x], &[]);
        let tail = b.ints(&[1, 2]);
        let dims = b.node(OpKind::Gather, &[shape, tail], &[]);
        let prod = b.node(OpKind::ReduceProd, &[dims], &[("keepdims", Attr::Int(1))]);
        let minus_one = b.ints(&[-1]);
        let target = b.node(OpKind::Concat, &[minus_one, prod], &[("axis", Attr::Int(0))]);
        let y = b.node(OpKind::Reshape, &[x, target], &[]);
        let m = b.node(OpKind::ReduceMax, &[dims], &[("keepdims", Attr::Int(0))]);
        b.output(y);
        b.output(m);
        let opts = AnalyzeOptions { seq_len: Some(5), ..Default::default() };
        let info = run(&mut b, &opts);
        assert_eq!(info.ints(prod), Some(&[40][..]));
        assert_eq!(info.ints(m), Some(&[8][..]));
        assert_eq!(shape_of(&b.g, y), vec![1, 40]);
    }

    #[test]
    fn integer_reductions_fold_over_the_given_axes() {
        // [[1, 2, 3], [4, 5, 6]]
        let v = [1, 2, 3, 4, 5, 6];
        assert_eq!(reduce_ints(&[2, 3], &v, &[0], i64::wrapping_add), Some(vec![5, 7, 9]));
        assert_eq!(reduce_ints(&[2, 3], &v, &[1], i64::wrapping_mul), Some(vec![6, 120]));
        assert_eq!(reduce_ints(&[2, 3], &v, &[0, 1], i64::max), Some(vec![6]));
        assert_eq!(reduce_ints(&[0], &[], &[0], i64::min), None);
    }

    #[test]
    fn axes_come_from_inputs_from_opset_13_and_attrs_before() {
        let mut b13 = Builder::new(13);
        let x = b13.input("x", DType::F32, &["3", "4"]);
        let ax = b13.ints(&[0, -1]);
        let y = b13.node(OpKind::Unsqueeze, &[x, ax], &[]);
        let z = b13.node(OpKind::Squeeze, &[y], &[]);
        b13.output(z);
        run(&mut b13, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b13.g, y), vec![1, 3, 4, 1]);
        assert_eq!(shape_of(&b13.g, z), vec![3, 4]);

        let mut b11 = Builder::new(11);
        let x = b11.input("x", DType::F32, &["3", "4"]);
        let y = b11.node(OpKind::Unsqueeze, &[x], &[("axes", Attr::Ints(vec![1]))]);
        let r = b11.node(OpKind::ReduceSum, &[y], &[("axes", Attr::Ints(vec![2])), ("keepdims", Attr::Int(0))]);
        b11.output(r);
        run(&mut b11, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b11.g, y), vec![3, 1, 4]);
        assert_eq!(shape_of(&b11.g, r), vec![3, 1]);
    }

    #[test]
    fn split_by_sizes_and_by_count() {
        let mut b = Builder::new(18);
        let x = b.input("x", DType::F32, &["2", "10"]);
        let sizes = b.ints(&[3, 7]);
        let p = b.node_n(OpKind::Split, &[Some(x), Some(sizes)], &[("axis", Attr::Int(1))], 2);
        let q = b.node_n(OpKind::Split, &[Some(x)], &[("axis", Attr::Int(1)), ("num_outputs", Attr::Int(3))], 3);
        for &v in p.iter().chain(&q) {
            b.output(v);
        }
        run(&mut b, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b.g, p[1]), vec![2, 7]);
        // ONNX 18: ceil(10/3) = 4, 4, 2.
        assert_eq!(q.iter().map(|&v| shape_of(&b.g, v)[1]).collect::<Vec<_>>(), vec![4, 4, 2]);
    }

    #[test]
    fn slice_clamps_like_numpy() {
        let mut b = Builder::new(18);
        let x = b.input("x", DType::F32, &["10", "8"]);
        let st = b.ints(&[-3, 100]);
        let en = b.ints(&[i64::MAX, 0]);
        let ax = b.ints(&[0, 1]);
        let sp = b.ints(&[1, -2]);
        let y = b.node(OpKind::Slice, &[x, st, en, ax, sp], &[]);
        b.output(y);
        run(&mut b, &AnalyzeOptions::default());
        // rows 7..10; columns 7,5,3,1
        assert_eq!(shape_of(&b.g, y), vec![3, 4]);
    }

    #[test]
    fn conv_and_pool_output_sizes() {
        let mut b = Builder::new(18);
        let x = b.input("x", DType::F32, &["batch", "3", "224", "224"]);
        let w = b.param("w", DType::F32, &[64, 3, 7, 7]);
        let c = b.node(
            OpKind::Conv,
            &[x, w],
            &[("strides", Attr::Ints(vec![2, 2])), ("pads", Attr::Ints(vec![3, 3, 3, 3]))],
        );
        let p = b.node(
            OpKind::MaxPool,
            &[c],
            &[("kernel_shape", Attr::Ints(vec![3, 3])), ("strides", Attr::Ints(vec![2, 2])), ("pads", Attr::Ints(vec![1, 1, 1, 1]))],
        );
        let g = b.node(OpKind::GlobalAveragePool, &[p], &[]);
        b.output(g);
        run(&mut b, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b.g, c), vec![1, 64, 112, 112]);
        assert_eq!(shape_of(&b.g, p), vec![1, 64, 56, 56]);
        assert_eq!(shape_of(&b.g, g), vec![1, 64, 1, 1]);
    }

    #[test]
    fn shape_arithmetic_is_evaluated() {
        let mut b = Builder::new(18);
        let x = b.input("x", DType::F32, &["batch", "seq", "8"]);
        let s = b.node(OpKind::Shape, &[x], &[]);
        let i = b.constant(Tensor::from_i64(vec![], &[1]));
        let seq = b.node(OpKind::Gather, &[s, i], &[]);
        let zero = b.constant(Tensor::from_i64(vec![], &[0]));
        let one = b.constant(Tensor::from_i64(vec![], &[1]));
        let r = b.node(OpKind::Range, &[zero, seq, one], &[]);
        let shp = b.ints(&[2, 3]);
        let k = b.node(OpKind::ConstantOfShape, &[shp], &[("value", Attr::Tensor(Tensor::from_i64(vec![1], &[7])))]);
        b.output(r);
        b.output(k);
        let info = run(&mut b, &AnalyzeOptions { seq_len: Some(5), ..Default::default() });
        assert_eq!(info.ints(s), Some(&[1, 5, 8][..]));
        assert_eq!(info.ints(r), Some(&[0, 1, 2, 3, 4][..]));
        assert_eq!(info.ints(k), Some(&[7; 6][..]));
        assert_eq!(shape_of(&b.g, r), vec![5]);
    }

    #[test]
    fn placeholder_uses_declared_type_or_stays_unknown() {
        use crate::ir::{Attrs, Node, Op};
        let mut b = Builder::new(18);
        let x = b.input("x", DType::F32, &["2"]);
        let ty = TensorType { dtype: DType::F16, shape: Some(Shape(vec![Dim::Sym("batch".into())])) };
        let y = b.g.add_value("y", ValueKind::Intermediate, Some(ty), None).unwrap();
        let z = b.g.add_value("z", ValueKind::Intermediate, None, None).unwrap();
        b.g.add_node(Node {
            name: "custom".into(),
            op: Op::Placeholder { op_type: "FancyOp".into(), domain: "com.x".into() },
            attrs: Attrs::default(),
            inputs: vec![Some(x)],
            outputs: vec![y, z],
            namespace: None,
            order: 0,
        })
        .unwrap();
        let w = b.node(OpKind::Relu, &[z], &[]);
        b.output(y);
        b.output(w);
        let dims = DimBindings { values: [("batch".to_string(), 3)].into(), graph_batch: 1, ..Default::default() };
        let info = infer_shapes(&mut b.g, &dims).unwrap();
        assert_eq!(info.types[y.index()], Some(Ty { dtype: DType::F16, shape: Some(vec![3]) }));
        assert_eq!(info.types[w.index()], None);
    }
}
