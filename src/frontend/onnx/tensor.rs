//! TensorProto → `ir::Tensor`: every storage form normalised to little-endian raw bytes, and
//! external data resolved to metadata (never read).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use prost::Message;

use super::error::ImportError;
use super::proto::TensorProto;
use crate::ir::{DType, ExternalData, Storage, Tensor};

/// `TensorProto.DataLocation.EXTERNAL`.
const EXTERNAL: i32 = 1;

/// Resolves external-data locations against a model's folder, caching one `stat` per file.
pub(crate) struct ExternalResolver {
    model_file: PathBuf,
    dir: PathBuf,
    canonical_dir: Option<PathBuf>,
    files: HashMap<String, Resolved>,
    /// Tensors whose external file is missing: (tensor, file).
    pub(crate) missing: Vec<(String, PathBuf)>,
}

#[derive(Clone)]
struct Resolved {
    path: PathBuf,
    /// File size if the file exists.
    size: Option<u64>,
}

impl ExternalResolver {
    /// A resolver for locations relative to `model_file`'s folder.
    pub(crate) fn new(model_file: &Path) -> ExternalResolver {
        let dir = match model_file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let canonical_dir = dir.canonicalize().ok();
        ExternalResolver { model_file: model_file.to_path_buf(), dir, canonical_dir, files: HashMap::new(), missing: Vec::new() }
    }

    fn refuse(&self, tensor: &str, location: &str, reason: impl Into<String>) -> ImportError {
        ImportError::ExternalPath {
            file: self.model_file.clone(),
            tensor: tensor.to_string(),
            location: location.to_string(),
            reason: reason.into(),
        }
    }

    fn resolve(&mut self, tensor: &str, location: &str) -> Result<Resolved, ImportError> {
        if let Some(r) = self.files.get(location) {
            return Ok(r.clone());
        }
        if location.is_empty() {
            return Err(self.refuse(tensor, location, "it is empty"));
        }
        let looks_absolute = location.starts_with('/')
            || location.starts_with('\\')
            || location.as_bytes().get(1) == Some(&b':')
            || Path::new(location).is_absolute();
        if looks_absolute {
            return Err(self.refuse(tensor, location, "it is an absolute path; it must be relative to the model's folder"));
        }
        if location.split(['/', '\\']).any(|c| c == "..") {
            return Err(self.refuse(tensor, location, "it contains `..`; it must stay inside the model's folder"));
        }
        let joined = self.dir.join(location);
        let resolved = match std::fs::symlink_metadata(&joined) {
            Ok(_) => {
                let canonical = joined.canonicalize().map_err(|e| {
                    self.refuse(tensor, location, format!("it cannot be resolved ({e}); a dangling symbolic link?"))
                })?;
                self.check_inside(tensor, location, &canonical)?;
                let meta = std::fs::metadata(&canonical).map_err(|e| ImportError::Io { file: canonical.clone(), source: e })?;
                if !meta.is_file() {
                    return Err(self.refuse(tensor, location, "it is not a regular file"));
                }
                Resolved { path: canonical, size: Some(meta.len()) }
            }
            Err(_) => {
                // Missing: still make sure the deepest existing folder on the way stays inside
                // (when the model's folder itself does not exist, nothing under it can).
                let mut ancestor = if self.canonical_dir.is_some() { joined.parent() } else { None };
                while let Some(a) = ancestor {
                    if let Ok(c) = a.canonicalize() {
                        self.check_inside(tensor, location, &c)?;
                        break;
                    }
                    ancestor = a.parent();
                }
                Resolved { path: joined, size: None }
            }
        };
        self.files.insert(location.to_string(), resolved.clone());
        Ok(resolved)
    }

    fn check_inside(&self, tensor: &str, location: &str, canonical: &Path) -> Result<(), ImportError> {
        match &self.canonical_dir {
            Some(dir) if canonical.starts_with(dir) => Ok(()),
            Some(dir) => Err(self.refuse(
                tensor,
                location,
                format!(
                    "it resolves (through a symbolic link) to {}, outside the model's folder {}",
                    canonical.display(),
                    dir.display()
                ),
            )),
            None => Err(self.refuse(tensor, location, "the model's folder cannot be resolved")),
        }
    }
}

fn bad(file: &Path, tensor: &str, reason: impl Into<String>) -> ImportError {
    ImportError::BadTensor { file: file.to_path_buf(), tensor: tensor.to_string(), reason: reason.into() }
}

/// Converts a TensorProto to an `ir::Tensor`. External data is resolved relative to
/// `model_file`'s folder (metadata only; a missing file gives `present: false`).
pub fn tensor_from_proto(proto: &TensorProto, model_file: &Path) -> Result<Tensor, ImportError> {
    let mut resolver = ExternalResolver::new(model_file);
    convert(proto, &mut resolver)
}

/// Reads a serialized TensorProto file (the ONNX conformance cases' `input_0.pb`).
pub fn load_tensor_pb(path: &Path) -> Result<Tensor, ImportError> {
    let bytes = std::fs::read(path).map_err(|e| ImportError::Io { file: path.to_path_buf(), source: e })?;
    if bytes.is_empty() {
        return Err(ImportError::Empty { file: path.to_path_buf() });
    }
    let proto = TensorProto::decode(bytes.as_slice()).map_err(|e| ImportError::Decode {
        file: path.to_path_buf(),
        what: "tensor",
        reason: e.to_string(),
    })?;
    tensor_from_proto(&proto, path)
}

pub(crate) fn convert(proto: &TensorProto, resolver: &mut ExternalResolver) -> Result<Tensor, ImportError> {
    let name = proto.name.as_deref().unwrap_or("");
    let file = resolver.model_file.clone();
    let code = proto.data_type.unwrap_or(0);
    let dtype = DType::from_onnx(code)
        .ok_or_else(|| bad(&file, name, format!("unsupported or undefined element type (TensorProto.DataType {code})")))?;
    let dims = proto.dims.clone();
    if let Some(d) = dims.iter().find(|&&d| d < 0) {
        return Err(bad(&file, name, format!("negative dimension {d} in dims {dims:?}")));
    }
    if proto.segment.is_some() {
        return Err(bad(&file, name, "segmented tensors are not supported"));
    }
    let numel = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
    let numel = numel.ok_or_else(|| bad(&file, name, format!("dims {dims:?} overflow")))?;
    let four_bit = matches!(dtype, DType::I4 | DType::U4);
    let want_bytes = if four_bit { numel.div_ceil(2) } else { numel.saturating_mul(dtype.size_bytes()) };

    if proto.data_location == Some(EXTERNAL) {
        let mut location = None;
        let mut offset = 0u64;
        let mut length = None;
        for kv in &proto.external_data {
            let key = kv.key.as_deref().unwrap_or("");
            let value = kv.value.as_deref().unwrap_or("");
            let parse = |what: &str| {
                value.trim().parse::<u64>().map_err(|_| bad(&file, name, format!("external data {what} `{value}` is not a byte count")))
            };
            match key {
                "location" => location = Some(value.to_string()),
                "offset" => offset = parse("offset")?,
                "length" => length = Some(parse("length")?),
                _ => {}
            }
        }
        let location = location.ok_or_else(|| bad(&file, name, "external data without a `location` key"))?;
        let length = length.unwrap_or(want_bytes);
        let resolved = resolver.resolve(name, &location)?;
        let end = offset.checked_add(length).ok_or_else(|| bad(&file, name, "external offset + length overflows"))?;
        match resolved.size {
            Some(actual) if actual < end => {
                return Err(ImportError::ExternalShort {
                    file,
                    tensor: name.to_string(),
                    data_file: resolved.path,
                    actual,
                    offset,
                    length,
                    end,
                });
            }
            Some(_) => {}
            None => resolver.missing.push((name.to_string(), resolved.path.clone())),
        }
        let present = resolved.size.is_some();
        return Ok(Tensor {
            dtype,
            dims,
            storage: Storage::External(ExternalData { location, path: resolved.path, offset, length, present }),
        });
    }

    if dtype == DType::Str {
        if proto.string_data.len() as u64 != numel {
            return Err(bad(&file, name, format!("{} strings for dims {dims:?} ({numel} elements)", proto.string_data.len())));
        }
        return Ok(Tensor { dtype, dims, storage: Storage::Strings(proto.string_data.clone()) });
    }

    // raw_data stays where the decoder found it (inside the memory-mapped model file)
    let bytes: prost::bytes::Bytes = if let Some(raw) = &proto.raw_data {
        raw.clone()
    } else {
        typed_bytes(proto, dtype).into()
    };
    if bytes.len() as u64 != want_bytes {
        let source = if proto.raw_data.is_some() { "raw_data" } else { "typed data" };
        return Err(bad(
            &file,
            name,
            format!("{source} has {} bytes but {dtype}{dims:?} needs {want_bytes}", bytes.len()),
        ));
    }
    Ok(Tensor { dtype, dims, storage: Storage::Raw(bytes) })
}

/// Little-endian bytes from the typed repeated fields.
fn typed_bytes(p: &TensorProto, dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 | DType::C64 => p.float_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F64 | DType::C128 => p.double_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::I64 => p.int64_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::U64 => p.uint64_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::U32 => p.uint64_data.iter().flat_map(|&v| (v as u32).to_le_bytes()).collect(),
        DType::I32 => p.int32_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        // 16-bit types (f16 and bf16 as bit patterns) live in the low half of int32_data.
        DType::F16 | DType::BF16 | DType::I16 | DType::U16 => {
            p.int32_data.iter().flat_map(|&v| (v as u16).to_le_bytes()).collect()
        }
        // 8-bit types (and packed 4-bit pairs) live in the low byte.
        DType::I8 | DType::U8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz | DType::I4 | DType::U4 => {
            p.int32_data.iter().map(|&v| v as u8).collect()
        }
        DType::Str => Vec::new(),
    }
}
