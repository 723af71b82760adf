//! A small f64 reference interpreter for the ops of transformer layers (test code only).
//! Every tensor holds f64 data; integer and bool tensors hold whole numbers (bools as 0/1).

#![allow(dead_code)]

use std::collections::HashMap;

use smp_partition::ir::{DType, Graph, Node, NodeId, Op, OpKind, ValueId, ValueKind};

/// A dense tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct T {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

impl T {
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<f64>) -> T {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "shape {shape:?}");
        T { dtype, shape, data }
    }
    fn ints(&self) -> Vec<i64> {
        self.data.iter().map(|&x| x as i64).collect()
    }
    fn is_int(&self) -> bool {
        !self.dtype.is_float()
    }
}

fn strides(s: &[usize]) -> Vec<usize> {
    let mut st = vec![1; s.len()];
    for i in (0..s.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * s[i + 1];
    }
    st
}

fn bshape(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let da = if i < r - a.len() { 1 } else { a[i - (r - a.len())] };
            let db = if i < r - b.len() { 1 } else { b[i - (r - b.len())] };
            if da == 1 { db } else { da }
        })
        .collect()
}

/// Index map of `input` broadcast to `out`.
fn bidx(out: &[usize], input: &[usize]) -> Vec<usize> {
    let n: usize = out.iter().product();
    let off = out.len() - input.len();
    let ist = strides(input);
    let mut st = vec![0; out.len()];
    for i in 0..input.len() {
        st[i + off] = if input[i] == 1 { 0 } else { ist[i] };
    }
    let mut idx = Vec::with_capacity(n);
    let mut coord = vec![0; out.len()];
    for _ in 0..n {
        idx.push(coord.iter().zip(&st).map(|(c, s)| c * s).sum());
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

fn nary(ins: &[&T], dtype: DType, f: impl Fn(&[f64]) -> f64) -> T {
    let mut shape = vec![];
    for t in ins {
        shape = bshape(&shape, &t.shape);
    }
    let idx: Vec<Vec<usize>> = ins.iter().map(|t| bidx(&shape, &t.shape)).collect();
    let n: usize = shape.iter().product();
    let mut args = vec![0.0; ins.len()];
    let data = (0..n)
        .map(|i| {
            for (k, t) in ins.iter().enumerate() {
                args[k] = t.data[idx[k][i]];
            }
            f(&args)
        })
        .collect();
    T::new(dtype, shape, data)
}

pub fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 3.0 {
        let mut sum = 0.0;
        let mut term = a; // x^(2n+1)/n!
        let mut n = 0.0;
        loop {
            let add = term / (2.0 * n + 1.0);
            sum += add;
            if add.abs() < 1e-17 * sum.abs() {
                break;
            }
            n += 1.0;
            term *= -a * a / n;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc by continued fraction (Lentz).
        let mut f = a;
        let mut c = a;
        let mut d = 0.0;
        for k in 1..200 {
            let an = k as f64 / 2.0;
            d = a + an * d;
            d = 1.0 / d;
            c = a + an / c;
            let delta = c * d;
            f *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        1.0 - (-a * a).exp() / (f * std::f64::consts::PI.sqrt())
    };
    if x < 0.0 { -r } else { r }
}

fn axis(a: i64, r: usize) -> usize {
    if a < 0 { (a + r as i64) as usize } else { a as usize }
}

fn transpose(x: &T, perm: &[usize]) -> T {
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    let ist = strides(&x.shape);
    let n = x.data.len();
    let mut data = Vec::with_capacity(n);
    let mut coord = vec![0; shape.len()];
    for _ in 0..n {
        data.push(x.data[coord.iter().enumerate().map(|(i, c)| c * ist[perm[i]]).sum::<usize>()]);
        for d in (0..shape.len()).rev() {
            coord[d] += 1;
            if coord[d] < shape[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    T::new(x.dtype, shape, data)
}

/// Softmax of `t` along axis `ax`.
fn softmax(t: &T, ax: usize) -> T {
    let r = t.shape.len();
    let mut perm: Vec<usize> = (0..r).filter(|&i| i != ax).collect();
    perm.push(ax);
    let xt = transpose(t, &perm);
    let d = t.shape[ax];
    let mut data = xt.data.clone();
    for row in data.chunks_mut(d) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        row.iter_mut().for_each(|v| *v = (*v - m).exp() / s);
    }
    let y = T::new(t.dtype, xt.shape.clone(), data);
    let mut inv = vec![0; r];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    transpose(&y, &inv)
}

fn matmul(a: &T, b: &T) -> T {
    let (a2, b2) = (a.shape.len(), b.shape.len());
    let (m, k) = (a.shape[a2 - 2], a.shape[a2 - 1]);
    let n = b.shape[b2 - 1];
    assert_eq!(b.shape[b2 - 2], k, "matmul {:?} {:?}", a.shape, b.shape);
    let batch = bshape(&a.shape[..a2 - 2], &b.shape[..b2 - 2]);
    let ia = bidx(&batch, &a.shape[..a2 - 2]);
    let ib = bidx(&batch, &b.shape[..b2 - 2]);
    let nb: usize = batch.iter().product();
    let mut data = vec![0.0; nb * m * n];
    for bi in 0..nb {
        let (ao, bo) = (ia[bi] * m * k, ib[bi] * k * n);
        for i in 0..m {
            for kk in 0..k {
                let av = a.data[ao + i * k + kk];
                for j in 0..n {
                    data[bi * m * n + i * n + j] += av * b.data[bo + kk * n + j];
                }
            }
        }
    }
    let mut shape = batch;
    shape.extend([m, n]);
    T::new(a.dtype, shape, data)
}

/// Splits `x` along `ax` into pieces of the given sizes.
pub fn split(x: &T, ax: usize, sizes: &[usize]) -> Vec<T> {
    let outer: usize = x.shape[..ax].iter().product();
    let inner: usize = x.shape[ax + 1..].iter().product();
    let d = x.shape[ax];
    let mut start = 0;
    sizes
        .iter()
        .map(|&s| {
            let mut data = Vec::with_capacity(outer * s * inner);
            for o in 0..outer {
                data.extend_from_slice(&x.data[(o * d + start) * inner..(o * d + start + s) * inner]);
            }
            start += s;
            let mut shape = x.shape.clone();
            shape[ax] = s;
            T::new(x.dtype, shape, data)
        })
        .collect()
}

/// Concatenates along `ax`.
pub fn concat(xs: &[&T], ax: usize) -> T {
    let outer: usize = xs[0].shape[..ax].iter().product();
    let inner: usize = xs[0].shape[ax + 1..].iter().product();
    let mut data = Vec::new();
    for o in 0..outer {
        for x in xs {
            let d = x.shape[ax];
            data.extend_from_slice(&x.data[o * d * inner..(o + 1) * d * inner]);
        }
    }
    let mut shape = xs[0].shape.clone();
    shape[ax] = xs.iter().map(|x| x.shape[ax]).sum();
    T::new(xs[0].dtype, shape, data)
}

fn reduce(x: &T, axes: &[usize], keep: bool, f: impl Fn(&[f64]) -> f64) -> T {
    let r = x.shape.len();
    let kept: Vec<usize> = (0..r).filter(|a| !axes.contains(a)).collect();
    let perm: Vec<usize> = kept.iter().chain(axes.iter()).copied().collect();
    let xt = transpose(x, &perm);
    let red: usize = axes.iter().map(|&a| x.shape[a]).product();
    let data: Vec<f64> = xt.data.chunks(red.max(1)).map(&f).collect();
    let shape: Vec<usize> = if keep {
        (0..r).map(|a| if axes.contains(&a) { 1 } else { x.shape[a] }).collect()
    } else {
        kept.iter().map(|&a| x.shape[a]).collect()
    };
    T::new(x.dtype, shape, data)
}

/// Evaluates nodes of a graph over an environment of named values.
pub struct Exec<'g> {
    pub g: &'g Graph,
    pub env: HashMap<ValueId, T>,
    order: Vec<NodeId>,
    pos: usize,
}

pub fn constant(g: &Graph, v: ValueId) -> Option<T> {
    let val = g.value(v);
    let t = val.data.as_ref()?;
    let data = t.to_f64_vec()?;
    Some(T::new(t.dtype, t.dims.iter().map(|&d| d as usize).collect(), data))
}

impl<'g> Exec<'g> {
    /// Feeds are by value name; constants come from the graph.
    pub fn new(g: &'g Graph, feeds: &HashMap<String, T>) -> Exec<'g> {
        let mut env = HashMap::new();
        for v in g.value_ids() {
            let val = g.value(v);
            match val.kind {
                ValueKind::Initializer | ValueKind::Constant => {
                    if let Some(t) = constant(g, v) {
                        env.insert(v, t);
                    }
                }
                ValueKind::Input => {
                    if let Some(t) = feeds.get(&val.name) {
                        env.insert(v, t.clone());
                    }
                }
                _ => {}
            }
        }
        Exec { g, env, order: g.topo_order().unwrap(), pos: 0 }
    }

    /// Runs until the next collective (returned, not run) or the end (None).
    pub fn run_until_collective(&mut self) -> Option<NodeId> {
        while self.pos < self.order.len() {
            let id = self.order[self.pos];
            let node = self.g.node(id);
            if node.op.collective().is_some() {
                return Some(id);
            }
            let outs = eval(self.g, node, &self.env);
            for (o, t) in node.outputs.iter().zip(outs) {
                self.env.insert(*o, t);
            }
            self.pos += 1;
        }
        None
    }

    /// Completes the pending collective with its output.
    pub fn finish_collective(&mut self, out: T) {
        let id = self.order[self.pos];
        self.env.insert(self.g.node(id).outputs[0], out);
        self.pos += 1;
    }

    pub fn get(&self, name: &str) -> Option<&T> {
        self.g.value_by_name(name).and_then(|v| self.env.get(&v))
    }
}

fn eval(g: &Graph, node: &Node, env: &HashMap<ValueId, T>) -> Vec<T> {
    let get = |i: usize| -> Option<&T> { node.inputs.get(i).copied().flatten().map(|v| env.get(&v).unwrap_or_else(|| panic!("`{}` reads unset `{}`", node.name, g.value(v).name))) };
    let x = |i: usize| get(i).unwrap_or_else(|| panic!("`{}`: missing input {i}", node.name));
    let a = &node.attrs;
    let Some(kind) = node.op.kind() else { panic!("unknown op {}", node.op) };
    use OpKind::*;
    let f = |fun: fn(f64) -> f64| vec![nary(&[x(0)], x(0).dtype, |v| fun(v[0]))];
    let bin = |fun: &dyn Fn(f64, f64) -> f64, dt: Option<DType>| vec![nary(&[x(0), x(1)], dt.unwrap_or(x(0).dtype), |v| fun(v[0], v[1]))];
    let int = x(0).is_int();
    match kind {
        Identity | Dropout => vec![x(0).clone()],
        // x·cos + rot(x)·sin, rot on the last axis: (−second half, first half), or per pair
        // (−odd, even) when interleaved
        ApplyRotary => {
            let xv = x(0);
            let d = *xv.shape.last().expect("ApplyRotary of a scalar");
            let interleaved = a.int("interleaved", 0) != 0;
            let mut rot = xv.data.clone();
            for (out, row) in rot.chunks_mut(d).zip(xv.data.chunks(d)) {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = match (interleaved, j % 2 == 0, j < d / 2) {
                        (true, true, _) => -row[j + 1],
                        (true, false, _) => row[j - 1],
                        (false, _, true) => -row[j + d / 2],
                        (false, _, false) => row[j - d / 2],
                    };
                }
            }
            let rot = T::new(xv.dtype, xv.shape.clone(), rot);
            vec![nary(&[xv, x(1), &rot, x(2)], xv.dtype, |v| v[0] * v[1] + v[2] * v[3])]
        }
        Neg => f(|v| -v),
        Sqrt => f(f64::sqrt),
        Tanh => f(f64::tanh),
        Erf => f(erf),
        // ONNX Gelu (the fused GELU chains): tanh form or exact erf form
        Gelu if a.str("approximate") == Some("tanh") => {
            f(|v| 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh()))
        }
        Gelu => f(|v| 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))),
        Exp => f(f64::exp),
        Log => f(f64::ln),
        Sin => f(f64::sin),
        Cos => f(f64::cos),
        Abs => f(f64::abs),
        Relu => f(|v| v.max(0.0)),
        Reciprocal => f(|v| 1.0 / v),
        Sigmoid => f(|v| 1.0 / (1.0 + (-v).exp())),
        Not => f(|v| if v != 0.0 { 0.0 } else { 1.0 }),
        IsNaN => vec![nary(&[x(0)], DType::Bool, |v| if v[0].is_nan() { 1.0 } else { 0.0 })],
        Add => bin(&|p, q| p + q, None),
        Sub => bin(&|p, q| p - q, None),
        Mul => bin(&|p, q| p * q, None),
        // the fused gated MLP: silu(gate) · up
        SwiGlu => bin(&|g, u| g / (1.0 + (-g).exp()) * u, None),
        Div => bin(&move |p, q| if int { (p / q).trunc() } else { p / q }, None),
        Pow => bin(&|p, q| p.powf(q), None),
        Max => bin(&|p: f64, q| p.max(q), None),
        Min => bin(&|p: f64, q| p.min(q), None),
        Equal => bin(&|p, q| (p == q) as i32 as f64, Some(DType::Bool)),
        Less => bin(&|p, q| (p < q) as i32 as f64, Some(DType::Bool)),
        LessOrEqual => bin(&|p, q| (p <= q) as i32 as f64, Some(DType::Bool)),
        Greater => bin(&|p, q| (p > q) as i32 as f64, Some(DType::Bool)),
        GreaterOrEqual => bin(&|p, q| (p >= q) as i32 as f64, Some(DType::Bool)),
        And => bin(&|p, q| (p != 0.0 && q != 0.0) as i32 as f64, Some(DType::Bool)),
        Or => bin(&|p, q| (p != 0.0 || q != 0.0) as i32 as f64, Some(DType::Bool)),
        Where => vec![nary(&[x(0), x(1), x(2)], x(1).dtype, |v| if v[0] != 0.0 { v[1] } else { v[2] })],
        Cast => {
            let to = DType::from_onnx(a.int("to", 1) as i32).unwrap();
            let t = x(0);
            let data = t
                .data
                .iter()
                .map(|&v| if to == DType::Bool { (v != 0.0) as i32 as f64 } else if to.is_float() { v } else { v.trunc() })
                .collect();
            vec![T::new(to, t.shape.clone(), data)]
        }
        MatMul => vec![matmul(x(0), x(1))],
        Gemm => {
            let mut p = x(0).clone();
            let mut q = x(1).clone();
            if a.int("transA", 0) != 0 {
                p = transpose(&p, &[1, 0]);
            }
            if a.int("transB", 0) != 0 {
                q = transpose(&q, &[1, 0]);
            }
            let alpha = a.float("alpha", 1.0) as f64;
            let beta = a.float("beta", 1.0) as f64;
            let mut y = matmul(&p, &q);
            y.data.iter_mut().for_each(|v| *v *= alpha);
            if let Some(c) = get(2) {
                y = nary(&[&y, c], y.dtype, |v| v[0] + beta * v[1]);
            }
            vec![y]
        }
        ScaledDotProductAttention => {
            // softmax(scale·q·kᵀ (+ mask, or where the bool mask keeps)) · v
            let scale = a.tensor("scale").and_then(|t| t.to_f64_vec()).expect("scale")[0];
            let mut s = matmul(x(0), x(1));
            s.data.iter_mut().for_each(|v| *v *= scale);
            if let Some(m) = get(3) {
                s = if m.dtype == DType::Bool {
                    nary(&[m, &s], s.dtype, |v| if v[0] != 0.0 { v[1] } else { f64::NEG_INFINITY })
                } else {
                    nary(&[&s, m], s.dtype, |v| v[0] + v[1])
                };
            }
            vec![matmul(&softmax(&s, s.shape.len() - 1), x(2))]
        }
        Softmax => {
            let t = x(0);
            let ax = axis(a.int("axis", -1), t.shape.len());
            vec![softmax(t, ax)]
        }
        LayerNormalization => {
            let t = x(0);
            let ax = axis(a.int("axis", -1), t.shape.len());
            let d: usize = t.shape[ax..].iter().product();
            let eps = a.float("epsilon", 1e-5) as f64;
            let mut data = t.data.clone();
            for row in data.chunks_mut(d) {
                let m = row.iter().sum::<f64>() / d as f64;
                let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / d as f64;
                let s = 1.0 / (var + eps).sqrt();
                row.iter_mut().for_each(|v| *v = (*v - m) * s);
            }
            let mut y = T::new(t.dtype, t.shape.clone(), data);
            y = nary(&[&y, x(1)], y.dtype, |v| v[0] * v[1]);
            if let Some(b) = get(2) {
                y = nary(&[&y, b], y.dtype, |v| v[0] + v[1]);
            }
            vec![y]
        }
        RMSNormalization => {
            let t = x(0);
            let ax = axis(a.int("axis", -1), t.shape.len());
            let d: usize = t.shape[ax..].iter().product();
            let eps = a.float("epsilon", 1e-5) as f64;
            let mut data = t.data.clone();
            for row in data.chunks_mut(d) {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
                let s = 1.0 / (ms + eps).sqrt();
                row.iter_mut().for_each(|v| *v *= s);
            }
            let y = T::new(t.dtype, t.shape.clone(), data);
            vec![nary(&[&y, x(1)], y.dtype, |v| v[0] * v[1])]
        }
        Reshape => {
            let t = x(0);
            let tgt = x(1).ints();
            let allowzero = a.int("allowzero", 0) != 0;
            let mut shape: Vec<i64> = tgt.iter().enumerate().map(|(i, &d)| if d == 0 && !allowzero { t.shape[i] as i64 } else { d }).collect();
            let known: i64 = shape.iter().filter(|&&d| d != -1).product();
            for d in shape.iter_mut() {
                if *d == -1 {
                    *d = t.data.len() as i64 / known;
                }
            }
            vec![T::new(t.dtype, shape.iter().map(|&d| d as usize).collect(), t.data.clone())]
        }
        Transpose => {
            let t = x(0);
            let perm: Vec<usize> = match a.ints("perm") {
                Some(p) => p.iter().map(|&v| v as usize).collect(),
                None => (0..t.shape.len()).rev().collect(),
            };
            vec![transpose(t, &perm)]
        }
        Split => {
            let t = x(0);
            let ax = axis(a.int("axis", 0), t.shape.len());
            let sizes: Vec<usize> = match get(1) {
                Some(s) => s.ints().iter().map(|&v| v as usize).collect(),
                None => {
                    let n = node.outputs.len();
                    let d = t.shape[ax];
                    let each = d.div_ceil(n);
                    (0..n).map(|i| each.min(d - (i * each).min(d))).collect()
                }
            };
            split(t, ax, &sizes)
        }
        Concat => {
            let xs: Vec<&T> = node.inputs.iter().flatten().map(|v| &env[v]).collect();
            let ax = axis(a.int("axis", 0), xs[0].shape.len());
            vec![concat(&xs, ax)]
        }
        Gather => {
            let (t, idx) = (x(0), x(1));
            let ax = axis(a.int("axis", 0), t.shape.len());
            let outer: usize = t.shape[..ax].iter().product();
            let inner: usize = t.shape[ax + 1..].iter().product();
            let d = t.shape[ax];
            let mut data = Vec::new();
            for o in 0..outer {
                for &i in &idx.data {
                    let i = if i < 0.0 { (i as i64 + d as i64) as usize } else { i as usize };
                    data.extend_from_slice(&t.data[(o * d + i) * inner..(o * d + i + 1) * inner]);
                }
            }
            let mut shape: Vec<usize> = t.shape[..ax].to_vec();
            shape.extend(&idx.shape);
            shape.extend(&t.shape[ax + 1..]);
            vec![T::new(t.dtype, shape, data)]
        }
        GatherElements => {
            let (t, idx) = (x(0), x(1));
            let ax = axis(a.int("axis", 0), t.shape.len());
            let st = strides(&t.shape);
            let ist = strides(&idx.shape);
            let data = (0..idx.data.len())
                .map(|k| {
                    let mut off = 0;
                    for d in 0..idx.shape.len() {
                        let c = (k / ist[d]) % idx.shape[d];
                        let c = if d == ax { idx.data[k] as usize } else { c };
                        off += c * st[d];
                    }
                    t.data[off]
                })
                .collect();
            vec![T::new(t.dtype, idx.shape.clone(), data)]
        }
        GatherND => {
            let (t, idx) = (x(0), x(1));
            assert_eq!(a.int("batch_dims", 0), 0);
            let q = *idx.shape.last().unwrap();
            let st = strides(&t.shape);
            let inner: usize = t.shape[q..].iter().product();
            let mut data = Vec::new();
            for row in idx.data.chunks(q) {
                let off: usize = row.iter().enumerate().map(|(d, &i)| i as usize * st[d]).sum();
                data.extend_from_slice(&t.data[off..off + inner]);
            }
            let mut shape = idx.shape[..idx.shape.len() - 1].to_vec();
            shape.extend(&t.shape[q..]);
            vec![T::new(t.dtype, shape, data)]
        }
        Slice => {
            let t = x(0);
            let r = t.shape.len();
            let starts = x(1).ints();
            let ends = x(2).ints();
            let axes: Vec<usize> = get(3).map(|v| v.ints().iter().map(|&v| axis(v, r)).collect()).unwrap_or((0..starts.len()).collect());
            let steps = get(4).map(|v| v.ints()).unwrap_or(vec![1; starts.len()]);
            let mut sel: Vec<Vec<usize>> = t.shape.iter().map(|&d| (0..d).collect()).collect();
            for (i, &ax) in axes.iter().enumerate() {
                let d = t.shape[ax] as i64;
                let w = |v: i64| if v < 0 { v + d } else { v };
                let step = steps[i];
                let mut out = Vec::new();
                if step > 0 {
                    let (s, e) = (w(starts[i]).clamp(0, d), w(ends[i]).clamp(0, d));
                    let mut k = s;
                    while k < e {
                        out.push(k as usize);
                        k += step;
                    }
                } else {
                    let (s, e) = (w(starts[i]).clamp(0, d - 1), w(ends[i]).clamp(-1, d - 1));
                    let mut k = s;
                    while k > e {
                        out.push(k as usize);
                        k += step;
                    }
                }
                sel[ax] = out;
            }
            let shape: Vec<usize> = sel.iter().map(Vec::len).collect();
            let st = strides(&t.shape);
            let n: usize = shape.iter().product();
            let mut data = Vec::with_capacity(n);
            let mut coord = vec![0; r];
            for _ in 0..n {
                data.push(t.data[coord.iter().enumerate().map(|(d, &c)| sel[d][c] * st[d]).sum::<usize>()]);
                for d in (0..r).rev() {
                    coord[d] += 1;
                    if coord[d] < shape[d] {
                        break;
                    }
                    coord[d] = 0;
                }
            }
            vec![T::new(t.dtype, shape, data)]
        }
        Unsqueeze => {
            let t = x(0);
            let axes = get(1).map(|v| v.ints()).or(a.ints("axes").map(<[i64]>::to_vec)).unwrap();
            let r = t.shape.len() + axes.len();
            let mut ax: Vec<usize> = axes.iter().map(|&v| axis(v, r)).collect();
            ax.sort_unstable();
            let mut shape = t.shape.clone();
            for &p in &ax {
                shape.insert(p, 1);
            }
            vec![T::new(t.dtype, shape, t.data.clone())]
        }
        Squeeze => {
            let t = x(0);
            let r = t.shape.len();
            let axes: Vec<usize> = match get(1).map(|v| v.ints()).or(a.ints("axes").map(<[i64]>::to_vec)) {
                Some(v) => v.iter().map(|&v| axis(v, r)).collect(),
                None => (0..r).filter(|&i| t.shape[i] == 1).collect(),
            };
            let shape = (0..r).filter(|i| !axes.contains(i)).map(|i| t.shape[i]).collect();
            vec![T::new(t.dtype, shape, t.data.clone())]
        }
        Expand => {
            let t = x(0);
            let s: Vec<usize> = x(1).ints().iter().map(|&v| v as usize).collect();
            let shape = bshape(&t.shape, &s);
            let idx = bidx(&shape, &t.shape);
            vec![T::new(t.dtype, shape, idx.iter().map(|&i| t.data[i]).collect())]
        }
        Shape => {
            let t = x(0);
            let r = t.shape.len() as i64;
            let w = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
            let s = w(a.int("start", 0));
            let e = a.int_opt("end").map_or(r as usize, w);
            let d: Vec<f64> = t.shape[s..e].iter().map(|&v| v as f64).collect();
            vec![T::new(DType::I64, vec![d.len()], d)]
        }
        ConstantOfShape => {
            let s: Vec<usize> = x(0).ints().iter().map(|&v| v as usize).collect();
            let (dt, v) = match a.tensor("value") {
                Some(t) => (t.dtype, t.to_f64_vec().unwrap()[0]),
                None => (DType::F32, 0.0),
            };
            let n = s.iter().product();
            vec![T::new(dt, s, vec![v; n])]
        }
        Range => {
            let (s, l, d) = (x(0).data[0], x(1).data[0], x(2).data[0]);
            let n = ((l - s) / d).ceil().max(0.0) as usize;
            vec![T::new(x(0).dtype, vec![n], (0..n).map(|i| s + i as f64 * d).collect())]
        }
        Trilu => {
            let t = x(0);
            let k = get(1).map_or(0, |v| v.data[0] as i64);
            let upper = a.int("upper", 1) != 0;
            let r = t.shape.len();
            let (m, n) = (t.shape[r - 2], t.shape[r - 1]);
            let mut data = t.data.clone();
            for (idx, v) in data.iter_mut().enumerate() {
                let j = (idx % n) as i64;
                let i = ((idx / n) % m) as i64;
                let keep = if upper { j - i >= k } else { j - i <= k };
                if !keep {
                    *v = 0.0;
                }
            }
            vec![T::new(t.dtype, t.shape.clone(), data)]
        }
        CumSum => {
            let t = x(0);
            let ax = axis(x(1).data[0] as i64, t.shape.len());
            assert!(a.int("exclusive", 0) == 0 && a.int("reverse", 0) == 0);
            let st = strides(&t.shape);
            let mut data = t.data.clone();
            for i in 0..data.len() {
                if (i / st[ax]) % t.shape[ax] != 0 {
                    data[i] += data[i - st[ax]];
                }
            }
            vec![T::new(t.dtype, t.shape.clone(), data)]
        }
        ReduceMean | ReduceSum | ReduceMax => {
            let t = x(0);
            let r = t.shape.len();
            let axes: Vec<usize> = match get(1).map(|v| v.ints()).or(a.ints("axes").map(<[i64]>::to_vec)) {
                Some(v) if !v.is_empty() => v.iter().map(|&v| axis(v, r)).collect(),
                _ => (0..r).collect(),
            };
            let keep = a.int("keepdims", 1) != 0;
            vec![match kind {
                ReduceMean => reduce(t, &axes, keep, |s| s.iter().sum::<f64>() / s.len() as f64),
                ReduceSum => reduce(t, &axes, keep, |s| s.iter().sum()),
                _ => reduce(t, &axes, keep, |s| s.iter().cloned().fold(f64::NEG_INFINITY, f64::max)),
            }]
        }
        Conv => {
            // 2-D convolution, no padding, group 1 (the ViT patch embedding).
            let (xin, w) = (x(0), x(1));
            let st = a.ints("strides").map(<[i64]>::to_vec).unwrap_or(vec![1, 1]);
            assert!(a.int("group", 1) == 1 && a.ints("pads").is_none_or(|p| p.iter().all(|&v| v == 0)));
            let (nb, c, h, wd) = (xin.shape[0], xin.shape[1], xin.shape[2], xin.shape[3]);
            let (oc, kh, kw) = (w.shape[0], w.shape[2], w.shape[3]);
            let (sh, sw) = (st[0] as usize, st[1] as usize);
            let (oh, ow) = ((h - kh) / sh + 1, (wd - kw) / sw + 1);
            let mut data = vec![0.0; nb * oc * oh * ow];
            for b in 0..nb {
                for o in 0..oc {
                    for i in 0..oh {
                        for j in 0..ow {
                            let mut s = get(2).map_or(0.0, |bias| bias.data[o]);
                            for ci in 0..c {
                                for u in 0..kh {
                                    for v in 0..kw {
                                        s += xin.data[((b * c + ci) * h + i * sh + u) * wd + j * sw + v] * w.data[((o * c + ci) * kh + u) * kw + v];
                                    }
                                }
                            }
                            data[((b * oc + o) * oh + i) * ow + j] = s;
                        }
                    }
                }
            }
            vec![T::new(xin.dtype, vec![nb, oc, oh, ow], data)]
        }
        Constant => {
            let t = a.tensor("value").expect("Constant without tensor");
            vec![T::new(t.dtype, t.dims.iter().map(|&d| d as usize).collect(), t.to_f64_vec().unwrap())]
        }
        k => panic!("interpreter: op {k} not implemented (node `{}`)", node.name),
    }
}

/// What each of `parts.len()` ranks gets from a collective `op_type` along `axis`, given
/// every rank's input (rank order): the reference for the runner's collectives.
pub fn combine(op_type: &str, axis: usize, parts: &[T]) -> Vec<T> {
    let t = parts.len();
    let sum = || {
        let mut s = parts[0].clone();
        for p in &parts[1..] {
            s.data.iter_mut().zip(&p.data).for_each(|(a, b)| *a += b);
        }
        s
    };
    let chunks = |x: &T| {
        assert_eq!(x.shape[axis] % t, 0, "{op_type}: axis {axis} of {:?} does not split {t} ways", x.shape);
        split(x, axis, &vec![x.shape[axis] / t; t])
    };
    match op_type {
        "AllReduce" => vec![sum(); t],
        "AllGather" => vec![concat(&parts.iter().collect::<Vec<_>>(), axis); t],
        "ReduceScatter" => chunks(&sum()),
        // local: rank r keeps the r-th chunk of its own (replicated) tensor
        "Scatter" => parts.iter().enumerate().map(|(r, p)| chunks(p).swap_remove(r)).collect(),
        o => panic!("unknown collective {o}"),
    }
}
