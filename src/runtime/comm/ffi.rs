//! Raw bindings to csrc/c10d_shim.cpp. Every fallible call returns a malloc'd error message
//! (free with `smp_c10d_free_error`) or null.

use std::ffi::{c_char, c_int, c_void};

use torch_sys::C_tensor;

unsafe extern "C" {
    pub fn smp_c10d_free_error(e: *mut c_char);
    pub fn smp_c10d_wait_ns() -> i64;
    pub fn smp_c10d_waiting(buf: *mut c_char, cap: c_int, waited_ns: *mut i64) -> c_int;
    pub fn smp_c10d_store_new(host: *const c_char, port: u16, is_server: c_int, world: c_int, timeout_ms: i64, out: *mut *mut c_void) -> *mut c_char;
    pub fn smp_c10d_store_free(s: *mut c_void);
    pub fn smp_c10d_group_new(
        store: *mut c_void,
        prefix: *const c_char,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        nccl: c_int,
        gloo_ifaces: *const c_char,
        gloo_host: *const c_char,
        out: *mut *mut c_void,
    ) -> *mut c_char;
    pub fn smp_c10d_group_free(g: *mut c_void);
    pub fn smp_c10d_group_has_nccl(g: *mut c_void) -> c_int;
    pub fn smp_c10d_all_reduce_sum(g: *mut c_void, t: *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_all_gather(g: *mut c_void, out: *mut C_tensor, input: *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_all_gather_start(g: *mut c_void, out: *mut C_tensor, input: *mut C_tensor, work: *mut *mut c_void) -> *mut c_char;
    pub fn smp_c10d_reduce_scatter_sum(g: *mut c_void, out: *mut C_tensor, input: *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_broadcast(g: *mut c_void, t: *mut C_tensor, root: c_int) -> *mut c_char;
    pub fn smp_c10d_barrier(g: *mut c_void) -> *mut c_char;
    pub fn smp_c10d_isend(g: *mut c_void, t: *mut C_tensor, dst: c_int, tag: c_int, work: *mut *mut c_void) -> *mut c_char;
    pub fn smp_c10d_irecv(g: *mut c_void, t: *mut C_tensor, src: c_int, tag: c_int, work: *mut *mut c_void) -> *mut c_char;
    pub fn smp_c10d_work_wait(w: *mut c_void) -> *mut c_char;
    pub fn smp_c10d_work_free(w: *mut c_void);
    pub fn smp_c10d_work_done(w: *mut c_void) -> c_int;
    pub fn smp_c10d_reduce_from_tensor_region(g: *mut c_void, x: *mut C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_copy_to_tensor_region(g: *mut c_void, x: *mut C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_gather_along_axis(g: *mut c_void, x: *mut C_tensor, axis: i64, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_context_gather(g: *mut c_void, x: *mut C_tensor, axis: i64, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_context_gather_start(g: *mut c_void, x: *mut C_tensor, axis: i64, pending: *mut *mut c_void) -> *mut c_char;
    pub fn smp_c10d_context_gather_finish(pending: *mut c_void, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_pending_gather_free(pending: *mut c_void);
    pub fn smp_c10d_reduce_scatter_along_axis(g: *mut c_void, x: *mut C_tensor, axis: i64, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_all_to_all_rows(g: *mut c_void, x: *mut C_tensor, send: *const i64, recv: *const i64, n: i64, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn smp_c10d_scatter_along_axis(g: *mut c_void, x: *mut C_tensor, axis: i64, out: *mut *mut C_tensor) -> *mut c_char;
}
