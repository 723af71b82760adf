//! ONNX importer: protobuf (prost over onnx.proto, IR ≤ 14) → `ir::Graph`.
//!
//! Initializers in any storage form are normalised to little-endian raw bytes; external data
//! is resolved to metadata only (never read). Model-local functions are inlined; control flow
//! is refused; ops the IR does not know become placeholders with a warning. The last step
//! canonicalises every opset-dependent form (`canonical`), so no later stage reads the opset.
//!
//! A dim with neither `dim_value` nor `dim_param` becomes a fresh symbol `?N`.

mod canonical;
mod error;
mod import;
mod inline;
#[allow(missing_docs, clippy::all, rustdoc::all)]
pub mod proto;
mod record;
mod tensor;

pub use canonical::{Canonicalised, DEFAULT_OPSET};
pub use error::{ImportError, ImportWarning, MAX_IR_VERSION};
pub use import::{ImportedModel, decode_model_bytes, load_model};
pub use tensor::{load_tensor_pb, tensor_from_proto};
