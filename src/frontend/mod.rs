//! Model importers.

pub mod onnx;
