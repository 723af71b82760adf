//! Batches of arrays keyed by graph input name: synthetic seeded data, one batch read from a
//! file, and microbatch splits.

use std::path::Path;

use tch::{Kind, Tensor};

use crate::ir::Dim;
use crate::runtime::RuntimeError;
use crate::runtime::kernels::executor::Executor;
use crate::runtime::kernels::tensor::{is_float_kind, kind_of};
use crate::runtime::formats::npz;

/// A global batch: arrays keyed by graph input name, plus `labels`/`targets` if given.
pub type Batch = Vec<(String, Tensor)>;

/// Synthetic, seeded data for every required graph input: token ids in `[0, vocab)` for
/// integer inputs (masks get ones, position ids `0..S`), N(0, 1) for float inputs. Symbolic
/// axis 0 is the batch, other symbolic axes the sequence length. Drawn on the host, handed
/// over on `exec`'s device (the same values on every device).
pub fn synthetic_batch(exec: &Executor, batch: i64, seq_len: i64, seed: i64) -> Result<Batch, RuntimeError> {
    crate::runtime::kernels::tensor::seeded(seed, || draw_batch(exec, batch, seq_len))
}

/// [`synthetic_batch`]'s draws from the generator as seeded.
fn draw_batch(exec: &Executor, batch: i64, seq_len: i64) -> Result<Batch, RuntimeError> {
    let graph = exec.graph();
    let vocab = vocab_size(exec);
    let mut out = Vec::new();
    for id in exec.required_inputs() {
        let v = graph.value(id);
        let terr = |m: String| RuntimeError::Train(format!("input `{}`: {m}", v.name));
        let Some(ty) = &v.ty else { return Err(terr("has no declared type; pass --data".into())) };
        let Some(shape) = &ty.shape else { return Err(terr("has no declared shape; pass --data".into())) };
        let dims: Vec<i64> = shape
            .0
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                Dim::Known(k) if i == 0 => batch.max(*k),
                Dim::Known(k) => *k,
                Dim::Sym(_) if i == 0 => batch,
                Dim::Sym(_) => seq_len,
            })
            .collect();
        let kind = kind_of(ty.dtype).map_err(terr)?;
        let name = v.name.to_lowercase();
        let cpu = tch::Device::Cpu;
        let t = if is_float_kind(kind) {
            Tensor::f_randn(&dims, (Kind::Float, cpu))?.f_to_kind(kind)?
        } else if name.contains("mask") {
            Tensor::f_ones(&dims, (kind, cpu))?
        } else if name.contains("position") {
            let s = *dims.last().unwrap_or(&1);
            Tensor::f_arange(s, (kind, cpu))?.f_expand(&dims, false)?.f_contiguous()?
        } else if name.contains("token_type") {
            Tensor::f_zeros(&dims, (kind, cpu))?
        } else {
            let Some(vocab) = vocab else {
                return Err(terr("cannot tell the vocabulary size for synthetic ids; pass --data".into()));
            };
            Tensor::f_randint_low(0, vocab, &dims, (Kind::Int64, cpu))?.f_to_kind(kind)?
        };
        out.push((v.name.clone(), t.f_to_device(exec.device())?));
    }
    Ok(out)
}

/// The vocabulary: the last axis of a rank-3 float output if known, else the row count of the
/// largest 2-D float initializer (the embedding).
pub(crate) fn vocab_size(exec: &Executor) -> Option<i64> {
    let graph = exec.graph();
    for &o in &graph.outputs {
        if let Some(ty) = &graph.value(o).ty {
            if let Some(s) = &ty.shape {
                if s.rank() == 3 && ty.dtype.is_float() {
                    if let Some(Dim::Known(v)) = s.0.last() {
                        return Some(*v);
                    }
                }
            }
        }
    }
    graph
        .initializers()
        .filter_map(|id| graph.value(id).data.as_ref())
        .filter(|d| d.dims.len() == 2 && d.dtype.is_float())
        .max_by_key(|d| d.dims[0] * d.dims[1])
        .map(|d| d.dims[0])
}

/// Reads a data file: `.npz` (arrays by name), `.safetensors` (tensors by name) or `.npy` (the
/// single required input).
pub fn read_batch(exec: &Executor, path: &Path) -> Result<Batch, RuntimeError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let ferr = |m: String| RuntimeError::File { path: path.display().to_string(), message: m };
    match ext {
        "npz" => npz::read_npz(path),
        "safetensors" => Tensor::read_safetensors(path).map_err(|e| ferr(format!("not readable safetensors: {e}"))),
        "npy" => {
            let inputs = exec.required_inputs();
            let [only] = inputs.as_slice() else {
                return Err(ferr(format!(
                    "a .npy holds one array but the graph has {} inputs; use .npz keyed by input name",
                    inputs.len()
                )));
            };
            Ok(vec![(exec.graph().value(*only).name.clone(), npz::read_npy(path)?)])
        }
        _ => Err(ferr("data must be .npy, .npz or .safetensors".into())),
    }
}

/// Splits each array of a batch into `m` equal microbatches along axis 0.
pub fn split_batch(batch: &Batch, m: usize) -> Result<Vec<Batch>, RuntimeError> {
    let mut out: Vec<Batch> = (0..m).map(|_| Vec::new()).collect();
    for (name, t) in batch {
        let b = t.size().first().copied().unwrap_or(0);
        if b % m as i64 != 0 {
            return Err(RuntimeError::Train(format!(
                "array `{name}` has batch {b}, not divisible into {m} microbatches"
            )));
        }
        for (i, part) in t.f_split(b / m as i64, 0)?.into_iter().enumerate() {
            out[i].push((name.clone(), part));
        }
    }
    Ok(out)
}

