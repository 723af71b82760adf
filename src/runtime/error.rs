//! The runtime's error type, shared by every room.

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
    /// A checkpoint could not be written (every rank agrees it was not; none is complete).
    #[error("checkpoint of step {step} not written: {message}")]
    CheckpointNotWritten {
        /// The step whose checkpoint failed.
        step: usize,
        /// What failed (the file and the cause, on the rank it happened).
        message: String,
    },
    /// Ranks leave the job after a step (stragglers dropped under `launch --elastic`): every
    /// rank ends the run, and the launcher plans the job again without them.
    #[error("ranks {ranks:?} leave the job after step {step}: {why}")]
    Leave {
        /// The global ranks that leave.
        ranks: Vec<usize>,
        /// Why.
        why: String,
        /// The step after which they leave.
        step: usize,
        /// Whether this process is one of them.
        leaving: bool,
    },
    /// Rank 0 could not listen on the rendezvous port (exit status
    /// [`EXIT_PORT_IN_USE`](crate::runtime::launch::launcher::EXIT_PORT_IN_USE)).
    #[error("the rendezvous port {port} is in use ({message}); free it or give another with --master-port (launch picks a free one when none is given)")]
    PortInUse {
        /// The port.
        port: u16,
        /// libtorch's message.
        message: String,
    },
    /// Training set-up or loss problems.
    #[error("training: {0}")]
    Train(String),
    /// A libtorch call outside a kernel failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// A run-time failure of training or set-up, described by `m` (names what failed and the fix).
pub(crate) fn terr(m: impl Into<String>) -> RuntimeError {
    RuntimeError::Train(m.into())
}
