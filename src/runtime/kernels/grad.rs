//! Backward passes that accumulate into the leaves' `.grad`, as PyTorch's `loss.backward()`
//! does: autograd's AccumulateGrad adds each fresh weight gradient into its leaf's `.grad` in
//! place as soon as it is produced and frees it, so gradient accumulation over microbatches
//! holds one copy of the gradients, never the accumulated ones beside a whole fresh set.
//! Through csrc/autograd_shim.cpp (tch has no backward with chosen inputs that accumulates,
//! no way to set a leaf's `.grad`, and no fused AdamW), which also holds the fused AdamW update.

use std::ffi::{CStr, c_char, c_int};

use tch::{TchError, Tensor};

use crate::runtime::RuntimeError;

unsafe extern "C" {
    fn smp_autograd_free_error(e: *mut c_char);
    fn smp_autograd_backward(
        roots: *const *mut torch_sys::C_tensor,
        nroots: c_int,
        inputs: *const *mut torch_sys::C_tensor,
        ninputs: c_int,
        keep_graph: c_int,
    ) -> *mut c_char;
    fn smp_autograd_set_grad(t: *mut torch_sys::C_tensor, g: *mut torch_sys::C_tensor) -> *mut c_char;
    fn smp_fused_adamw(
        params: *const *mut torch_sys::C_tensor,
        grads: *const *mut torch_sys::C_tensor,
        exp_avgs: *const *mut torch_sys::C_tensor,
        exp_avg_sqs: *const *mut torch_sys::C_tensor,
        n: c_int,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        step: i64,
    ) -> *mut c_char;
}

pub(super) fn check(call: &str, err: *mut c_char) -> Result<(), RuntimeError> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: the shim returns a NUL-terminated malloc'd string, freed here once.
    let message = unsafe {
        let m = CStr::from_ptr(err).to_string_lossy().into_owned();
        smp_autograd_free_error(err);
        m
    };
    Err(RuntimeError::Torch(TchError::Torch(format!("{call}: {message}"))))
}

pub(super) fn raw(t: &Tensor) -> *mut torch_sys::C_tensor {
    t.as_ptr() as *mut torch_sys::C_tensor
}

/// Backward from the scalar `root` into the leaves `inputs` (`torch.autograd.backward(root,
/// inputs=inputs)`): each input's gradient is accumulated into its `.grad` (kept as the
/// `.grad` when it has none), nothing else is computed or accumulated. `keep_graph` keeps the
/// graph for a later pass. No inputs: nothing to do.
pub(crate) fn backward_into(root: &Tensor, inputs: &[&Tensor], keep_graph: bool) -> Result<(), RuntimeError> {
    if inputs.is_empty() {
        return Ok(());
    }
    let roots = [raw(root)];
    let ins: Vec<*mut torch_sys::C_tensor> = inputs.iter().map(|t| raw(t)).collect();
    let n = c_int::try_from(ins.len()).map_err(|_| RuntimeError::Train(format!("a backward into {} leaves", ins.len())))?;
    // SAFETY: live tensors for the duration of the call; the shim copies the handles.
    check("backward", unsafe { smp_autograd_backward(roots.as_ptr(), 1, ins.as_ptr(), n, c_int::from(keep_graph)) })
}

/// Makes `g` (the same tensor, not a copy) the `.grad` of leaf `t`, or clears it (`None`).
pub(crate) fn set_grad(t: &Tensor, g: Option<&Tensor>) -> Result<(), RuntimeError> {
    let g = g.map_or(std::ptr::null_mut(), raw);
    // SAFETY: live tensors; the shim copies the handle of `g`.
    check("set grad", unsafe { smp_autograd_set_grad(raw(t), g) })
}

/// Takes leaf `t`'s `.grad` out of it (clearing it): the gradient, or `None` when it had none.
pub(crate) fn take_grad(t: &Tensor) -> Result<Option<Tensor>, RuntimeError> {
    let g = t.f_grad()?;
    set_grad(t, None)?;
    Ok(g.defined().then_some(g))
}

/// The AdamW hyper-parameters of one update.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWUpdate {
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    /// The update's number, from 1.
    pub step: i64,
}

/// One AdamW update with libtorch's fused kernel (`torch.optim.AdamW(fused=True)`): each
/// parameter and its moments (`exp_avg`, `exp_avg_sq`) updated in place from its gradient, in
/// one pass over their memory. The four lists have equal lengths; gradients are defined.
pub(crate) fn fused_adamw(params: &[&Tensor], grads: &[&Tensor], exp_avgs: &[&Tensor], exp_avg_sqs: &[&Tensor], u: AdamWUpdate) -> Result<(), RuntimeError> {
    let n = params.len();
    if grads.len() != n || exp_avgs.len() != n || exp_avg_sqs.len() != n {
        return Err(RuntimeError::Train(format!(
            "fused AdamW: {n} parameters, {} gradients, {} and {} moments",
            grads.len(),
            exp_avgs.len(),
            exp_avg_sqs.len()
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let handles = |ts: &[&Tensor]| -> Vec<*mut torch_sys::C_tensor> { ts.iter().map(|t| raw(t)).collect() };
    let (p, g, m, v) = (handles(params), handles(grads), handles(exp_avgs), handles(exp_avg_sqs));
    let count = c_int::try_from(n).map_err(|_| RuntimeError::Train(format!("fused AdamW over {n} parameters")))?;
    // SAFETY: live tensors for the duration of the call; the shim copies the handles.
    check("fused AdamW", unsafe {
        smp_fused_adamw(p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr(), count, u.lr, u.betas.0, u.betas.1, u.weight_decay, u.eps, u.step)
    })
}
