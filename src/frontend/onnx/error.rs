//! Import errors and warnings. Every error names the file and the tensor or node concerned.

use std::fmt;
use std::path::PathBuf;

use crate::ir::GraphError;

/// The newest ONNX IR version the importer understands.
pub const MAX_IR_VERSION: i64 = 14;

/// Why a model could not be imported.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The file could not be read.
    #[error("{file}: cannot read the file: {source}")]
    Io {
        /// The file.
        file: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A 0-byte file.
    #[error("{file}: empty file (0 bytes), not an ONNX model")]
    Empty {
        /// The file.
        file: PathBuf,
    },
    /// The bytes are not a valid protobuf message of the expected type.
    #[error("{file}: not a valid ONNX {what} (truncated or corrupt file?): {reason}")]
    Decode {
        /// The file.
        file: PathBuf,
        /// `model` or `tensor`.
        what: &'static str,
        /// The decoder's message.
        reason: String,
    },
    /// The model's `smp.aux_loss` metadata (written by the export) does not describe graph
    /// outputs.
    #[error("{file}: model metadata `smp.aux_loss`: {reason}; re-export through smp_partition.export or remove the entry")]
    BadAuxLoss {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A ModelProto without a graph.
    #[error("{file}: the model has no graph (ModelProto.graph is missing)")]
    MissingGraph {
        /// The file.
        file: PathBuf,
    },
    /// IR version newer than [`MAX_IR_VERSION`].
    #[error(
        "{file}: ONNX IR version {version} is newer than the newest supported ({MAX_IR_VERSION}); \
         re-export with onnx <= 1.23 or convert the model with onnx.version_converter"
    )]
    IrTooNew {
        /// The file.
        file: PathBuf,
        /// The model's IR version.
        version: i64,
    },
    /// A node input that no node, initializer or graph input defines.
    #[error("{file}: node `{node}` reads `{input}`, which no node, initializer or graph input defines")]
    DanglingInput {
        /// The file.
        file: PathBuf,
        /// The reading node.
        node: String,
        /// The undefined input name.
        input: String,
    },
    /// A graph output that nothing defines.
    #[error("{file}: graph output `{output}` is not defined by any node, initializer or graph input")]
    DanglingOutput {
        /// The file.
        file: PathBuf,
        /// The output name.
        output: String,
    },
    /// A value defined twice (by two nodes, or a node and an initializer/input).
    #[error("{file}: value `{value}` is defined twice: by {first} and by {second}")]
    DuplicateOutput {
        /// The file.
        file: PathBuf,
        /// The value name.
        value: String,
        /// The first definition (`node `x``, `initializer`, `graph input`).
        first: String,
        /// The second definition.
        second: String,
    },
    /// A cycle in the node graph.
    #[error("{file}: the graph has a cycle through node `{node}`")]
    Cycle {
        /// The file.
        file: PathBuf,
        /// A node on (or blocked by) the cycle.
        node: String,
    },
    /// If/Loop/Scan or any node with a subgraph attribute.
    #[error(
        "{file}: Unsupported control flow: node `{node}` ({op_type}); \
         export the model without data-dependent control flow (unroll loops, trace branches)"
    )]
    ControlFlow {
        /// The file.
        file: PathBuf,
        /// The node.
        node: String,
        /// Its op type.
        op_type: String,
    },
    /// External data whose `location` leaves the model's folder.
    #[error("{file}: tensor `{tensor}`: external data location `{location}` is refused: {reason}")]
    ExternalPath {
        /// The model file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// `location` as written.
        location: String,
        /// Why (absolute, contains `..`, symlink out of the folder).
        reason: String,
    },
    /// An external file shorter than offset + length.
    #[error(
        "{file}: tensor `{tensor}`: external file `{data_file}` has {actual} bytes but the tensor \
         needs bytes {offset}..{end} (offset {offset} + length {length}); the file is truncated or \
         belongs to another export"
    )]
    ExternalShort {
        /// The model file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// The external file.
        data_file: PathBuf,
        /// Its size.
        actual: u64,
        /// Declared offset.
        offset: u64,
        /// Declared length.
        length: u64,
        /// offset + length.
        end: u64,
    },
    /// A malformed tensor (unknown type, wrong data length, bad external keys).
    #[error("{file}: tensor `{tensor}`: {reason}")]
    BadTensor {
        /// The file.
        file: PathBuf,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A malformed node (bad attribute, sparse constant, function problem).
    #[error("{file}: node `{node}`: {reason}")]
    BadNode {
        /// The file.
        file: PathBuf,
        /// The node.
        node: String,
        /// What is wrong.
        reason: String,
    },
    /// A graph construction error.
    #[error("{file}: {source}")]
    Graph {
        /// The file.
        file: PathBuf,
        /// The graph error.
        source: GraphError,
    },
}

/// Something odd in a model that does not stop the import.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImportWarning {
    /// External data files are missing: the model is graph-only (shapes, no weights).
    MissingExternalData {
        /// Number of tensors whose file is missing.
        tensors: usize,
        /// The first missing file.
        first_file: PathBuf,
        /// The first tensor concerned.
        first_tensor: String,
    },
    /// An op the IR does not know; its nodes became placeholders.
    UnknownOp {
        /// Domain (empty for the default domain).
        domain: String,
        /// Op type.
        op_type: String,
        /// The first node with it.
        node: String,
        /// How many nodes have it.
        count: usize,
    },
    /// Anything else worth telling.
    Other(String),
}

impl fmt::Display for ImportWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImportWarning::MissingExternalData { tensors, first_file, first_tensor } => write!(
                f,
                "external data missing for {tensors} tensor(s) (first: `{first_tensor}` in {}): \
                 graph-only model, planning uses shapes only",
                first_file.display()
            ),
            ImportWarning::UnknownOp { domain, op_type, node, count } => {
                let d = if domain.is_empty() { "ai.onnx" } else { domain };
                write!(f, "unknown op {d}::{op_type} ({count} node(s), first `{node}`): kept as a placeholder")
            }
            ImportWarning::Other(s) => f.write_str(s),
        }
    }
}
