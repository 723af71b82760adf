//! Executing a graph on tch: one kernel per ONNX op family (`ops/`), the forward executor with
//! autograd (`executor`), conversions between IR and tch tensors (`tensor`), and the autograd
//! shim (`grad`: gradients accumulated in place, libtorch's fused AdamW).

pub mod context;
pub mod executor;
pub(crate) mod experts;
pub(crate) mod grad;
pub(crate) mod storage;
pub mod ops;
pub mod tensor;

/// Sets libtorch's intra-op thread count for this process.
pub fn set_threads(n: i32) {
    tch::set_num_threads(n);
}
