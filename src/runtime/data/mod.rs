//! Training data: token files (a flat little-endian array of uint16 or uint32 token ids, the
//! nanoGPT / Megatron `.bin` convention, memory-mapped, with its dtype in a JSON sidecar), the
//! seeded order of their samples, the batches each step reads, and `prepare-data`.
//!
//! A sample is a window of `seq_len` consecutive tokens, windows laid end to end
//! (`[w·S, (w+1)·S)`). Step `k`'s global batch holds the samples `(k−1)·B .. k·B` of an
//! endless sequence that visits every window once per epoch in an order drawn from
//! (seed, epoch) alone, so every plan of the same batch and sequence length sees the same
//! global batches. A rank reads only the rows of its replica, and only if its stages need them.

pub mod batch;
pub mod prepare;
pub mod tokens;

use std::path::Path;

use crate::runtime::RuntimeError;
use crate::runtime::kernels::executor::Executor;

pub use batch::{Batch, read_batch, split_batch, synthetic_batch};
pub use prepare::{Prepared, TextTokenizer, prepare, val_path};
pub use tokens::{Order, Sidecar, TokenDtype, TokenFile, TokenStream, is_token_file, sample_window, sidecar_path};

/// Where a run's batches come from.
pub enum DataSource {
    /// One global batch, the same every step (`.npy`/`.npz`/`.safetensors` or synthetic).
    Fixed(Batch),
    /// Windows of a token file.
    Tokens(TokenStream),
}

impl DataSource {
    /// Samples in one global batch.
    pub fn global_batch(&self) -> i64 {
        match self {
            DataSource::Fixed(b) => b.first().and_then(|(_, t)| t.size().first().copied()).unwrap_or(0),
            DataSource::Tokens(s) => s.global_batch,
        }
    }

    /// Tokens in one global batch: samples × sequence length (for a fixed batch, the first two
    /// axes of its first array).
    pub fn tokens_per_batch(&self) -> i64 {
        match self {
            DataSource::Fixed(b) => b.first().map_or(0, |(_, t)| t.size().iter().take(2).product()),
            DataSource::Tokens(s) => s.global_batch * s.seq_len,
        }
    }

    /// Replica `d`'s share (of `dp`) of batch `k`'s samples (from 1), cut into `m`
    /// microbatches: it takes the d-th contiguous share.
    pub fn replica_microbatches(&self, k: usize, d: usize, dp: usize, m: usize) -> Result<Vec<Batch>, RuntimeError> {
        let b = self.global_batch();
        let parts = (dp * m) as i64;
        let check = |name: &str, b: i64| {
            if b % parts != 0 || b == 0 {
                Err(RuntimeError::Train(format!("array `{name}` has batch {b}, not divisible into dp {dp} × {m} microbatches")))
            } else {
                Ok(())
            }
        };
        let share = b / dp as i64;
        let rows = d as i64 * share..(d as i64 + 1) * share;
        let batch: Batch = match self {
            DataSource::Fixed(batch) => {
                let mut out = Vec::with_capacity(batch.len());
                for (name, t) in batch {
                    let b = t.size().first().copied().unwrap_or(0);
                    check(name, b)?;
                    out.push((name.clone(), t.f_narrow(0, d as i64 * (b / dp as i64), b / dp as i64)?));
                }
                out
            }
            DataSource::Tokens(s) => {
                check("token windows (the global batch)", b)?;
                s.rows(k, rows)?
            }
        };
        split_batch(&batch, m)
    }
}

/// Reads `--data`: a token file (`.bin`, windows of `seq_len`, `global_batch` per step, order
/// from `seed`) or one fixed batch (`.npy`/`.npz`/`.safetensors`); its batches come on
/// `exec`'s device.
pub fn open_data(exec: &Executor, path: &Path, seq_len: i64, global_batch: i64, order: Order) -> Result<DataSource, RuntimeError> {
    if is_token_file(path) {
        let file = TokenFile::open(path)?;
        Ok(DataSource::Tokens(TokenStream::new(file, exec, seq_len, global_batch, order)?))
    } else {
        let batch = read_batch(exec, path)?;
        Ok(DataSource::Fixed(batch.into_iter().map(|(n, t)| Ok((n, t.f_to_device(exec.device())?))).collect::<Result<_, RuntimeError>>()?))
    }
}

