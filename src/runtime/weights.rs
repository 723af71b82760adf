//! Initializers as tch tensors: in-memory bytes, external data (memory-mapped, offset and
//! length checked against the file), or random values for graph-only models; and which of
//! them are trained.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use tch::{Kind, Tensor};

use super::RuntimeError;
use super::tensor::{from_bytes, is_float_kind, kind_of};
use crate::ir::{ExternalData, Graph, Storage, ValueId, ValueKind};

/// How initializers are materialised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitMode {
    /// Read every initializer (external files must exist and be complete).
    Load,
    /// External initializers get seeded random values without touching their files; in-memory
    /// ones are used as stored. Lets a graph-only model run.
    Random {
        /// Seed of the random values.
        seed: i64,
    },
}

/// The initializers of a graph as tch tensors, keyed by value id.
pub struct Weights {
    /// Tensor per initializer (and per folded constant of the graph).
    pub tensors: HashMap<ValueId, Tensor>,
}

/// True if initializer `id` is a trained parameter. One definition for the whole compiler
/// (`passes::figures::is_trainable`): floating point, more than one element (exporters store
/// constants such as `sqrt(d)` as scalar initializers), and not a well-known buffer by name
/// (RoPE tables, masks, position ids). Integer tensors and folded constants never are.
pub fn is_trainable(graph: &Graph, id: ValueId) -> bool {
    crate::passes::figures::is_trainable(graph, id)
}

impl Weights {
    /// Materialises every initializer and constant of `graph`. Float tensors are converted to
    /// `float_kind` when given.
    pub fn load(graph: &Graph, mode: InitMode, float_kind: Option<Kind>) -> Result<Weights, RuntimeError> {
        let mut maps: HashMap<PathBuf, Mmap> = HashMap::new();
        let mut tensors = HashMap::new();
        if let InitMode::Random { seed } = mode {
            tch::manual_seed(seed);
        }
        for id in graph.value_ids() {
            let v = graph.value(id);
            if !matches!(v.kind, ValueKind::Initializer | ValueKind::Constant) {
                continue;
            }
            let Some(data) = &v.data else { continue };
            let werr = |message: String| RuntimeError::Weight { name: v.name.clone(), message };
            let t = match &data.storage {
                Storage::Raw(bytes) => from_bytes(data.dtype, &data.dims, bytes).map_err(werr)?,
                Storage::Strings(_) => {
                    return Err(werr("string tensors are not supported by the libtorch runner".into()));
                }
                Storage::External(ext) => match mode {
                    InitMode::Random { .. } => {
                        random_init(&v.name, data.dtype, &data.dims).map_err(werr)?
                    }
                    InitMode::Load => {
                        let bytes = external_bytes(&mut maps, ext, data.nbytes()).map_err(werr)?;
                        from_bytes(data.dtype, &data.dims, bytes).map_err(werr)?
                    }
                },
            };
            let t = match float_kind {
                Some(k) if is_float_kind(t.kind()) && t.kind() != k => t.f_to_kind(k)?,
                _ => t,
            };
            tensors.insert(id, t);
        }
        Ok(Weights { tensors })
    }
}

/// The bytes of an external tensor from its memory-mapped file, checked against the file.
fn external_bytes<'m>(maps: &'m mut HashMap<PathBuf, Mmap>, ext: &ExternalData, want: u64) -> Result<&'m [u8], String> {
    let path: &Path = &ext.path;
    if !path.is_file() {
        return Err(format!(
            "external data file `{}` ({}) does not exist; put it beside the model or run with `--init random`",
            ext.location,
            path.display()
        ));
    }
    if !maps.contains_key(path) {
        let file = File::open(path).map_err(|e| format!("cannot open external data `{}`: {e}", path.display()))?;
        // SAFETY: the map is read-only and lives as long as this loader; a file truncated by
        // another process while mapped is outside what the runner defends against.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("cannot map `{}`: {e}", path.display()))?;
        maps.insert(path.to_path_buf(), map);
    }
    let map = &maps[path];
    let file_len = map.len() as u64;
    let length = if ext.length > 0 { ext.length } else { want };
    if length != want {
        return Err(format!("external data length {length} does not match the tensor's {want} bytes"));
    }
    let end = ext.offset.checked_add(length).ok_or("offset + length overflows")?;
    if end > file_len {
        return Err(format!(
            "external data `{}` is truncated: needs bytes {}..{end}, the file has {file_len}",
            path.display(),
            ext.offset
        ));
    }
    Ok(&map[ext.offset as usize..end as usize])
}

/// Seeded values for a weight whose data is not read: N(0, 0.02) for weights, 0 for biases,
/// 1 for norm scales, 0 for integer tensors.
fn random_init(name: &str, dtype: crate::ir::DType, dims: &[i64]) -> Result<Tensor, String> {
    let kind = kind_of(dtype)?;
    let opts = (kind, tch::Device::Cpu);
    let lower = name.to_lowercase();
    let t = if !is_float_kind(kind) {
        Tensor::f_zeros(dims, opts)
    } else if lower.ends_with("bias") {
        Tensor::f_zeros(dims, opts)
    } else if dims.len() == 1 && (lower.contains("norm") || lower.contains("ln")) {
        Tensor::f_ones(dims, opts)
    } else {
        Tensor::f_randn(dims, (Kind::Float, tch::Device::Cpu)).and_then(|t| t.f_mul_scalar(0.02)).and_then(|t| t.f_to_kind(kind))
    };
    t.map_err(|e| e.to_string())
}
