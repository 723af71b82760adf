//! The libtorch executor (feature `runner`): ONNX op kernels on tch, weights, a forward
//! executor with autograd, npz files, and single-device training.
//!
//! This is the only module that names tch.

pub mod calibrate;
pub mod checkpoint;
pub mod data;
pub mod dist;
pub mod executor;
pub mod export;
mod grad;
mod interp;
pub mod launch;
mod layout;
pub mod npz;
pub mod ops;
pub mod pipeline;
pub mod plan_check;
mod rank;
mod report;
pub mod tensor;
pub mod train;
pub mod weights;
mod zero;

pub use executor::{Executor, ExecOptions};
pub use weights::{InitMode, Weights};

/// Errors of the runtime, each naming the node, value, file or flag concerned.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Ops without a kernel, found before execution starts.
    #[error("the graph has ops this runner cannot execute: {0}")]
    Unsupported(String),
    /// A kernel failed while running a node.
    #[error("node `{node}` ({op}): {message}")]
    Kernel {
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// What went wrong.
        message: String,
    },
    /// A weight could not be materialised.
    #[error("initializer `{name}`: {message}")]
    Weight {
        /// Initializer name.
        name: String,
        /// What went wrong and how to fix it.
        message: String,
    },
    /// A graph input fed by the user does not fit the graph.
    #[error("input `{name}`: {message}")]
    Input {
        /// Graph input name.
        name: String,
        /// What went wrong.
        message: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The graph itself is inconsistent.
    #[error(transparent)]
    Graph(#[from] crate::ir::GraphError),
    /// Training set-up or loss problems.
    #[error("training: {0}")]
    Train(String),
    /// A libtorch call outside a kernel failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}
