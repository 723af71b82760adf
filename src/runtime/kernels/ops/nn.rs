//! Contractions, convolution, normalisation, pooling, softmax, dropout.

use tch::{Kind, Tensor};

use super::NormStats;
use super::{Args, KResult, axis, bail};
use crate::ir::OpKind;

pub(super) fn matmul(a: &Args) -> KResult<Tensor> {
    Ok(a.x(0)?.f_matmul(a.x(1)?)?)
}

/// `ScaledDotProductAttention(q, kᵀ, v, mask?)` (made by `passes::fuse`): libtorch's
/// `scaled_dot_product_attention` on `q`, `kᵀ` transposed back (a view) and `v`, with the node's
/// `scale`, no dropout and no implicit causal mask. A bool mask keeps where true (the kernel's
/// meaning, and the `Where` it replaced); a float mask is added to the scaled scores.
pub(super) fn scaled_dot_product_attention(a: &Args) -> KResult<Tensor> {
    let (q, kt, v) = (a.x(0)?, a.x(1)?, a.x(2)?);
    let scale = match a.attrs().tensor("scale").and_then(|t| t.to_f64_vec()).as_deref() {
        Some(&[s]) => s,
        _ => bail!("attribute `scale` must be a one-element tensor"),
    };
    let k = kt.f_transpose(-2, -1)?;
    // libtorch's fused kernels want unit-stride rows; a `kᵀ` made whole (gathered, not a view
    // of k) would send it down the path that materialises the scores
    let k = if k.stride().last().is_some_and(|&s| s != 1) { k.f_contiguous()? } else { k };
    let mask = match a.opt(3) {
        Some(m) if m.kind() != Kind::Bool && m.kind() != q.kind() => Some(m.f_to_kind(q.kind())?),
        Some(m) => Some(m.shallow_clone()),
        None => None,
    };
    Ok(Tensor::f_scaled_dot_product_attention(q, &k, v, mask, 0.0, false, scale, false)?)
}

pub(super) fn gemm(a: &Args) -> KResult<Tensor> {
    let mut x = a.x(0)?.shallow_clone();
    let mut w = a.x(1)?.shallow_clone();
    if a.int("transA", 0) != 0 {
        x = x.f_transpose(0, 1)?;
    }
    if a.int("transB", 0) != 0 {
        w = w.f_transpose(0, 1)?;
    }
    let alpha = a.float("alpha", 1.0);
    let beta = a.float("beta", 1.0);
    if let Some(c) = a.opt(2).filter(|c| alpha == 1.0 && beta == 1.0 && x.dim() == 2 && w.dim() == 2 && c.dim() <= 2) {
        // one BLAS call that starts from the bias (torch's Linear), not a product and an add
        return Ok(c.f_addmm(&x, &w)?);
    }
    let mut y = x.f_matmul(&w)?;
    if alpha != 1.0 {
        y = y.f_mul_scalar(alpha)?;
    }
    if let Some(c) = a.opt(2) {
        y = if beta != 1.0 { y.f_add(&c.f_mul_scalar(beta)?)? } else { y.f_add(c)? };
    }
    Ok(y)
}

/// Kernel geometry of a conv or pooling node, pads split into begin and end.
struct Window {
    kernel: Vec<i64>,
    strides: Vec<i64>,
    dilations: Vec<i64>,
    begin: Vec<i64>,
    end: Vec<i64>,
}

impl Window {
    fn new(a: &Args, x: &Tensor, kernel: Vec<i64>) -> KResult<Window> {
        let n = kernel.len();
        let spatial = &x.size()[2..];
        if spatial.len() != n {
            bail!("input has {} spatial axes but the kernel has {n}", spatial.len());
        }
        let strides = a.attrs().ints("strides").map(<[i64]>::to_vec).unwrap_or(vec![1; n]);
        let dilations = a.attrs().ints("dilations").map(<[i64]>::to_vec).unwrap_or(vec![1; n]);
        if strides.len() != n || dilations.len() != n {
            bail!("strides {strides:?} / dilations {dilations:?} do not match kernel {kernel:?}");
        }
        let auto_pad = a.attrs().str("auto_pad").unwrap_or("NOTSET");
        let (begin, end) = match auto_pad {
            "SAME_UPPER" | "SAME_LOWER" => {
                let mut b = Vec::new();
                let mut e = Vec::new();
                for i in 0..n {
                    let out = (spatial[i] + strides[i] - 1) / strides[i];
                    let total = ((out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - spatial[i]).max(0);
                    let small = total / 2;
                    if auto_pad == "SAME_UPPER" {
                        b.push(small);
                        e.push(total - small);
                    } else {
                        b.push(total - small);
                        e.push(small);
                    }
                }
                (b, e)
            }
            "VALID" => (vec![0; n], vec![0; n]),
            "NOTSET" | "" => match a.attrs().ints("pads") {
                Some(p) if p.len() == 2 * n => (p[..n].to_vec(), p[n..].to_vec()),
                Some(p) => bail!("pads {p:?} must have 2×{n} entries"),
                None => (vec![0; n], vec![0; n]),
            },
            other => bail!("auto_pad `{other}` is not an ONNX value"),
        };
        Ok(Window { kernel, strides, dilations, begin, end })
    }

    fn symmetric(&self) -> bool {
        self.begin == self.end
    }

    /// torch's pad list (last axis first) for all pads.
    fn torch_pads(&self) -> Vec<i64> {
        let mut p = Vec::new();
        for i in (0..self.begin.len()).rev() {
            p.push(self.begin[i]);
            p.push(self.end[i]);
        }
        p
    }
}

pub(super) fn conv(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let w = a.x(1)?;
    let kernel = w.size()[2..].to_vec();
    if let Some(k) = a.attrs().ints("kernel_shape") {
        if k != kernel.as_slice() {
            bail!("kernel_shape {k:?} differs from the weight's {kernel:?}");
        }
    }
    let win = Window::new(a, x, kernel)?;
    let group = a.int("group", 1);
    let n = win.kernel.len();
    let (x, pad) = if win.symmetric() {
        (x.shallow_clone(), win.begin.clone())
    } else {
        (x.f_constant_pad_nd(win.torch_pads())?, vec![0; n])
    };
    Ok(x.f_convolution(w, a.opt(2), &win.strides, &pad, &win.dilations, false, vec![0; n], group)?)
}

pub(super) fn layer_norm(a: &Args) -> KResult<Vec<Tensor>> {
    let x = a.x(0)?;
    let rank = x.dim();
    let ax = axis(a.int("axis", -1), rank)? as usize;
    let shape = x.size()[ax..].to_vec();
    let eps = a.float("epsilon", 1e-5);
    let scale = a.x(1)?;
    let bias = a.opt(2);
    let exact = scale.size() == shape && bias.is_none_or(|b| b.size() == shape);
    let (mut y, mean, rstd) = if exact {
        x.f_native_layer_norm(&shape, Some(scale), bias, eps)?
    } else {
        let (y, m, r) = x.f_native_layer_norm(&shape, None::<&Tensor>, None::<&Tensor>, eps)?;
        let mut y = y.f_mul(scale)?;
        if let Some(b) = bias {
            y = y.f_add(b)?;
        }
        (y, m, r)
    };
    let k = x.f_kind()?;
    if y.f_kind()? != k {
        y = y.f_to_kind(k)?;
    }
    let stash = if a.int("stash_type", 1) == 1 && matches!(k, Kind::Half | Kind::BFloat16) {
        Kind::Float
    } else {
        k
    };
    let mut out = vec![y, mean.f_to_kind(stash)?, rstd.f_to_kind(stash)?];
    out.truncate(a.n_out().max(1));
    Ok(out)
}

/// `RMSNormalization(x, scale)` (ONNX opset 23, and the fused RMSNorm chain of
/// `passes::fuse`): `x / √(mean(x², axes) + ε) · scale` over the axes from `axis` on, as
/// libtorch's `rms_norm`; a scale of another shape or type multiplies the normed `x`.
pub(super) fn rms_norm(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let ax = axis(a.int("axis", -1), x.dim())? as usize;
    let shape = x.size()[ax..].to_vec();
    let eps = a.float("epsilon", 1e-5);
    let w = a.x(1)?;
    if w.size() == shape && w.f_kind()? == x.f_kind()? {
        Ok(x.f_rms_norm(&shape, Some(w), eps)?)
    } else {
        Ok(x.f_rms_norm(&shape, None::<&Tensor>, eps)?.f_mul(w)?)
    }
}

/// `SwiGlu(gate, up)` (made by `passes::fuse`): `silu(gate) ⊙ up`, broadcast.
pub(super) fn swiglu(a: &Args) -> KResult<Tensor> {
    let (gate, up) = (a.x(0)?, a.x(1)?);
    let s = gate.f_silu()?;
    let h = s.f_mul(up)?;
    // silu(gate), which the product's backward keeps, handed to a recompute that rebuilds it
    super::moe::note_inside_silu(gate, up, &s);
    Ok(h)
}

/// `ApplyRotary(x, cos, sin)` (see [`OpKind::ApplyRotary`](crate::ir::OpKind::ApplyRotary)):
/// `x·cos + rot(x)·sin`, the products and sum of the exported chain, one `addcmul` for the last;
/// tables of one angle per pair widened first.
pub(super) fn apply_rotary(a: &Args) -> KResult<Tensor> {
    let (x, cos, sin) = (a.x(0)?, a.x(1)?, a.x(2)?);
    let d = x.size().last().copied().unwrap_or(0);
    if d < 2 || d % 2 != 0 {
        bail!("ApplyRotary needs an even last axis of x, it has {d}");
    }
    let interleaved = a.int("interleaved", 0) != 0;
    // tables of one angle per pair, widened to x's last axis (they are small: no heads, no batch)
    let widen = |t: &Tensor| -> KResult<Tensor> {
        if d == 2 || t.size().last().copied() != Some(d / 2) {
            return Ok(t.shallow_clone());
        }
        Ok(if interleaved { Tensor::f_stack(&[t, t], -1)?.f_flatten(-2, -1)? } else { Tensor::f_cat(&[t, t], -1)? })
    };
    let (cos, sin) = (widen(cos)?, widen(sin)?);
    let rot = if interleaved {
        let pairs = x.f_unflatten(-1, [d / 2, 2])?;
        Tensor::f_stack(&[pairs.f_select(-1, 1)?.f_neg()?, pairs.f_select(-1, 0)?], -1)?.f_flatten(-2, -1)?
    } else {
        Tensor::f_cat(&[x.f_narrow(-1, d / 2, d / 2)?.f_neg()?, x.f_narrow(-1, 0, d / 2)?], -1)?
    };
    Ok(x.f_mul(&cos)?.f_addcmul(&rot, &sin)?)
}

/// Reshapes a per-channel vector to broadcast against `[N, C, ...]` of `rank`.
fn per_channel(v: &Tensor, rank: usize) -> KResult<Tensor> {
    let mut shape = vec![1i64; rank.max(2)];
    shape[1] = -1;
    Ok(v.f_reshape(&shape)?)
}

pub(super) fn batch_norm(a: &Args) -> KResult<Vec<Tensor>> {
    let x = a.x(0)?;
    let (scale, bias, mean, var) = (a.x(1)?, a.x(2)?, a.x(3)?, a.x(4)?);
    let eps = a.float("epsilon", 1e-5);
    // ONNX's momentum weighs the old value: PyTorch's 0.1 is exported as 0.9
    let momentum = a.float("momentum", 0.9);
    let rank = x.dim();
    let update = match a.ctx.norm {
        NormStats::Batch { update } => update,
        NormStats::Running if a.int("training_mode", 0) != 0 => false,
        NormStats::Running => {
            let y = x.f_batch_norm(Some(scale), Some(bias), Some(mean), Some(var), false, 0.0, eps, false)?;
            return Ok(vec![y]);
        }
    };
    let dims: Vec<i64> = (0..rank as i64).filter(|&d| d != 1).collect();
    let batch_mean = x.f_mean_dim(dims.as_slice(), false, None::<Kind>)?;
    let batch_var = x.f_var_correction(dims.as_slice(), 0i64, false)?;
    let norm = x
        .f_sub(&per_channel(&batch_mean, rank)?)?
        .f_div(&per_channel(&batch_var.f_add_scalar(eps)?.f_sqrt()?, rank)?)?;
    let y = norm.f_mul(&per_channel(scale, rank)?)?.f_add(&per_channel(bias, rank)?)?;
    let running_mean = mean.f_mul_scalar(momentum)?.f_add(&batch_mean.f_detach()?.f_mul_scalar(1.0 - momentum)?)?;
    let running_var = if update {
        // PyTorch moves the running variance towards the unbiased batch variance
        let n = (x.numel() as i64 / x.size().get(1).copied().unwrap_or(1).max(1)).max(2) as f64;
        let unbiased = batch_var.f_detach()?.f_mul_scalar(n / (n - 1.0))?;
        let rv = var.f_mul_scalar(momentum)?.f_add(&unbiased.f_mul_scalar(1.0 - momentum)?)?;
        tch::no_grad(|| -> KResult<()> {
            let (mut m, mut v) = (mean.shallow_clone(), var.shallow_clone());
            m.f_copy_(&running_mean)?;
            v.f_copy_(&rv)?;
            Ok(())
        })?;
        rv
    } else {
        var.f_mul_scalar(momentum)?.f_add(&batch_var.f_detach()?.f_mul_scalar(1.0 - momentum)?)?
    };
    let mut out = vec![y, running_mean, running_var];
    out.truncate(a.n_out().max(1));
    Ok(out)
}

pub(super) fn instance_norm(a: &Args) -> KResult<Tensor> {
    let eps = a.float("epsilon", 1e-5);
    Ok(a.x(0)?.f_instance_norm(Some(a.x(1)?), Some(a.x(2)?), None::<&Tensor>, None::<&Tensor>, true, 0.1, eps, false)?)
}

pub(super) fn lrn(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let size = a.int("size", 0);
    if size < 1 {
        bail!("attribute `size` must be ≥ 1");
    }
    let alpha = a.float("alpha", 1e-4);
    let beta = a.float("beta", 0.75);
    let bias = a.float("bias", 1.0);
    let c = x.size()[1];
    let before = (size - 1) / 2;
    let after = size - 1 - before;
    let sq = x.f_mul(x)?;
    // pad the channel axis: torch's pad list runs from the last axis, so pad axes 2.. with 0
    let mut pads = vec![0i64; 2 * (x.dim() - 2)];
    pads.extend([before, after]);
    let padded = sq.f_constant_pad_nd(pads)?;
    let mut sum = padded.f_narrow(1, 0, c)?;
    for i in 1..size {
        sum = sum.f_add(&padded.f_narrow(1, i, c)?)?;
    }
    let denom = sum.f_mul_scalar(alpha / size as f64)?.f_add_scalar(bias)?.f_pow_tensor_scalar(beta)?;
    Ok(x.f_div(&denom)?)
}

fn pool_kernel(a: &Args) -> KResult<Vec<i64>> {
    match a.attrs().ints("kernel_shape") {
        Some(k) => Ok(k.to_vec()),
        None => bail!("attribute `kernel_shape` is required"),
    }
}

pub(super) fn max_pool(a: &Args) -> KResult<Vec<Tensor>> {
    let x = a.x(0)?;
    let win = Window::new(a, x, pool_kernel(a)?)?;
    let n = win.kernel.len();
    let ceil = a.int("ceil_mode", 0) != 0;
    let (xp, pad) = if win.symmetric() && win.begin.iter().zip(&win.kernel).all(|(p, k)| 2 * p <= *k) {
        (x.shallow_clone(), win.begin.clone())
    } else {
        (x.f_pad(win.torch_pads(), "constant", f64::NEG_INFINITY)?, vec![0; n])
    };
    let (y, idx) = match n {
        1 => xp.f_max_pool1d_with_indices(&win.kernel, &win.strides, &pad, &win.dilations, ceil)?,
        2 => xp.f_max_pool2d_with_indices(&win.kernel, &win.strides, &pad, &win.dilations, ceil)?,
        3 => xp.f_max_pool3d_with_indices(&win.kernel, &win.strides, &pad, &win.dilations, ceil)?,
        _ => bail!("{n}-D pooling is not supported (1-3 spatial axes)"),
    };
    if a.n_out() < 2 {
        return Ok(vec![y]);
    }
    // torch indexes within each padded (n, c) plane; ONNX indexes the whole unpadded tensor.
    let size = x.size();
    let spatial = &size[2..];
    let padded: Vec<i64> = xp.size()[2..].to_vec();
    let col_major = a.int("storage_order", 0) != 0;
    let mut rem = idx.shallow_clone();
    let mut flat = idx.f_zeros_like()?;
    let plane: i64 = spatial.iter().product();
    for d in (0..n).rev() {
        let coord = rem.f_remainder(padded[d])?.f_sub_scalar(win.begin[d] - pad[d])?;
        rem = rem.f_div_tensor_mode(&Tensor::f_scalar_tensor(padded[d], (Kind::Int64, idx.device()))?, "floor")?;
        let stride: i64 = if col_major { spatial[..d].iter().product() } else { spatial[d + 1..].iter().product() };
        flat = flat.f_add(&coord.f_mul_scalar(stride)?)?;
    }
    let nc = Tensor::f_arange(size[0] * size[1], (Kind::Int64, idx.device()))?
        .f_reshape([size[0], size[1]].iter().copied().chain(std::iter::repeat_n(1, n)).collect::<Vec<_>>())?;
    let flat = flat.f_add(&nc.f_mul_scalar(plane)?)?;
    Ok(vec![y, flat])
}

fn avg_pool_raw(x: &Tensor, k: &[i64], s: &[i64], p: &[i64], ceil: bool, cip: bool) -> KResult<Tensor> {
    Ok(match k.len() {
        1 => x.f_avg_pool1d(k, s, p, ceil, cip)?,
        2 => x.f_avg_pool2d(k, s, p, ceil, cip, None::<i64>)?,
        3 => x.f_avg_pool3d(k, s, p, ceil, cip, None::<i64>)?,
        n => bail!("{n}-D pooling is not supported (1-3 spatial axes)"),
    })
}

pub(super) fn avg_pool(a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let win = Window::new(a, x, pool_kernel(a)?)?;
    if win.dilations.iter().any(|&d| d != 1) {
        bail!("dilated AveragePool is not supported (dilations {:?})", win.dilations);
    }
    let n = win.kernel.len();
    let ceil = a.int("ceil_mode", 0) != 0;
    let cip = a.int("count_include_pad", 0) != 0;
    let zero = vec![0; n];
    if win.begin.iter().chain(&win.end).all(|&p| p == 0) {
        return avg_pool_raw(x, &win.kernel, &win.strides, &zero, ceil, true);
    }
    let xp = x.f_constant_pad_nd(win.torch_pads())?;
    let sum = avg_pool_raw(&xp, &win.kernel, &win.strides, &zero, ceil, true)?;
    if cip {
        return Ok(sum);
    }
    // divide by the share of real (unpadded) elements in each window
    let ones = x.f_ones_like()?.f_narrow(0, 0, 1)?.f_narrow(1, 0, 1)?;
    let mask = avg_pool_raw(&ones.f_constant_pad_nd(win.torch_pads())?, &win.kernel, &win.strides, &zero, ceil, true)?;
    Ok(sum.f_div(&mask)?)
}

pub(super) fn global_pool(kind: OpKind, a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let dims: Vec<i64> = (2..x.dim() as i64).collect();
    Ok(match kind {
        OpKind::GlobalMaxPool => x.f_amax(dims.as_slice(), true)?,
        _ => x.f_mean_dim(dims.as_slice(), true, None::<Kind>)?,
    })
}

pub(super) fn softmax(kind: OpKind, a: &Args) -> KResult<Tensor> {
    let x = a.x(0)?;
    let log = kind == OpKind::LogSoftmax;
    let rank = x.dim();
    let ax = axis(a.int("axis", -1), rank)?;
    Ok(if log { x.f_log_softmax(ax, None::<Kind>)? } else { x.f_softmax(ax, None::<Kind>)? })
}

/// Uniform numbers shaped like `x` whose row i (axis 0, the microbatch's samples) depends on
/// `key`, the node and the global sample `key.first_sample + i` alone. Drawn by the CPU's
/// generator whatever `x`'s device, so a GPU run drops what the CPU run drops.
fn keyed_uniform(x: &Tensor, node: &str, key: super::DropoutKey) -> KResult<Tensor> {
    keyed_uniform_shaped(&x.size(), x, node, key)
}

/// [`keyed_uniform`] of shape `size` (`x` gives the kind and device).
fn keyed_uniform_shaped(size: &[i64], x: &Tensor, node: &str, key: super::DropoutKey) -> KResult<Tensor> {
    let size = size.to_vec();
    let (rows, row_shape) = match size.split_first() {
        Some((&n, rest)) => (n, rest.to_vec()),
        None => (1, Vec::new()),
    };
    // FNV-1a of the node's name, then splitmix64 over the key's parts
    let node_key = node.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let mix = |h: u64, part: u64| {
        let mut z = (h ^ part).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut out = Vec::with_capacity(rows.max(0) as usize);
    for i in 0..rows {
        let h = [key.seed as u64, key.step as u64, (key.first_sample + i) as u64].into_iter().fold(node_key, mix);
        let seed = (h >> 1) as i64;
        out.push(crate::runtime::kernels::tensor::seeded(seed, || Tensor::f_rand(&row_shape, (x.kind(), tch::Device::Cpu)))?);
    }
    if size.is_empty() {
        return Ok(out.pop().map_or_else(|| x.f_rand_like(), |t| t.f_to_device(x.device()))?);
    }
    Ok(Tensor::f_stack(&out, 0)?.f_to_device(x.device())?)
}

pub(super) fn dropout(a: &Args) -> KResult<Vec<Tensor>> {
    let x = a.x(0)?;
    let ratio = a.scalar(1)?.unwrap_or(0.5);
    let training = a.scalar(2)?.is_some_and(|v| v != 0.0);
    // a training executor drops only inside a training step, not in validation
    let active = training && ratio > 0.0 && (!a.ctx.training || a.ctx.dropout.is_some());
    let (y, mask) = if active {
        let uniform = match a.ctx.dropout {
            Some(key) => match (a.ctx.context, a.attrs().0.get(crate::split::context::DROPOUT_TOKEN_AXIS)) {
                // local tokens: the one-process mask, this rank's rows of it
                (Some(me), Some(crate::ir::Attr::Int(axis))) => {
                    let axis = *axis as usize;
                    let outer = a.int(crate::split::context::DROPOUT_TOKEN_OUTER, 1);
                    let mut whole = x.size();
                    let Some(len) = whole.get_mut(axis) else { bail!("dropout token axis {axis} of a tensor of {} axes", x.dim()) };
                    *len *= me.size as i64;
                    let u = keyed_uniform_shaped(&whole, x, &a.node.name, key)?;
                    crate::runtime::kernels::context::localize(&u, axis, crate::runtime::kernels::context::Blocks { outer, seq: 0 }, me).map_err(super::KernelError)?
                }
                _ => keyed_uniform(x, &a.node.name, key)?,
            },
            None => x.f_rand_like()?,
        };
        let keep = uniform.f_ge(ratio)?;
        (x.f_mul(&keep)?.f_div_scalar(1.0 - ratio)?, keep)
    } else {
        (x.shallow_clone(), x.f_ones_like()?.f_to_kind(Kind::Bool)?)
    };
    let mut out = vec![y, mask];
    out.truncate(a.n_out().max(1));
    Ok(out)
}

/// SoftmaxCrossEntropyLoss(scores, labels, weights?) → (loss, log_prob?) and
/// NegativeLogLikelihoodLoss(input, target, weight?) → loss: libtorch's log-softmax over axis 1
/// (the classes; SoftmaxCrossEntropyLoss only) and its N-dimensional NLL, whose `mean` is ONNX's
/// (the weighted sum over the weights of the counted targets). Without `ignore_index` every
/// target counts: the kernel is given a value no class index takes.
pub(super) fn loss(kind: OpKind, a: &Args) -> KResult<Vec<Tensor>> {
    let x = a.x(0)?;
    let target = a.x(1)?.f_to_kind(Kind::Int64)?;
    let reduction = match a.attrs().str("reduction").unwrap_or("mean") {
        "none" => tch::Reduction::None,
        "sum" => tch::Reduction::Sum,
        "mean" => tch::Reduction::Mean,
        other => bail!("attribute `reduction` is `{other}`; expected `none`, `sum` or `mean`"),
    };
    let ignore = a.attrs().int_opt("ignore_index").unwrap_or(i64::MIN);
    let weight = match a.opt(2) {
        Some(w) if w.kind() != x.kind() => Some(w.f_to_kind(x.kind())?),
        w => w.map(Tensor::shallow_clone),
    };
    if x.dim() < 2 {
        bail!("scores of shape {:?}: at least [N, C] expected", x.size());
    }
    let log_prob = if kind == OpKind::SoftmaxCrossEntropyLoss { x.f_log_softmax(1, None::<Kind>)? } else { x.shallow_clone() };
    let loss = log_prob.f_nll_loss_nd(&target, weight.as_ref(), reduction, ignore)?;
    let mut out = vec![loss, log_prob];
    out.truncate(a.n_out().max(1));
    Ok(out)
}
