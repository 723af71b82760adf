//! Freeing and refilling a tensor's storage in place, as FSDP resizes its gathered parameters'
//! storage to nothing between uses: autograd's saved views of a gathered weight keep the
//! storage object, not its bytes, and read them again once the weight is gathered back into
//! the same storage. Through csrc/autograd_shim.cpp (tch has no storage resize).

use tch::Tensor;

use super::grad::{check, raw};
use crate::runtime::RuntimeError;

unsafe extern "C" {
    fn smp_storage_free(t: *mut torch_sys::C_tensor) -> *mut std::ffi::c_char;
    fn smp_storage_refill(t: *mut torch_sys::C_tensor, nbytes: i64) -> *mut std::ffi::c_char;
    fn smp_storage_take(dst: *mut torch_sys::C_tensor, src: *mut torch_sys::C_tensor) -> *mut std::ffi::c_char;
}

/// Frees the bytes of `t`'s storage; `t` and every view of it must not be read until
/// [`refill`] gives it bytes again.
pub(crate) fn free(t: &Tensor) -> Result<(), RuntimeError> {
    // SAFETY: a live tensor; the shim swaps its storage's data pointer.
    check("free storage", unsafe { smp_storage_free(raw(t)) })
}

/// Gives `t`'s storage fresh bytes for all of `t` (contents undefined: write them before
/// reading).
pub(crate) fn refill(t: &Tensor) -> Result<(), RuntimeError> {
    let nbytes = (t.numel() * t.kind().elt_size_in_bytes()) as i64;
    // SAFETY: a live tensor whose storage starts at offset 0 (a whole tensor, not a view).
    check("refill storage", unsafe { smp_storage_refill(raw(t), nbytes) })
}

/// Moves `src`'s bytes into `dst`'s freed storage (no copy, `dst`'s version counter untouched,
/// so autograd's saved references to `dst` read them as its own); `src` is left empty. Both
/// whole tensors of one layout, type and device.
pub(crate) fn take(dst: &Tensor, src: &Tensor) -> Result<(), RuntimeError> {
    // SAFETY: two live tensors; the shim checks their layouts and moves one data pointer.
    check("rebuild storage", unsafe { smp_storage_take(raw(dst), raw(src)) })
}
