//! Token files: the file format and its sidecar, the seeded order of samples, and windows of a
//! file as batches of a model's inputs.

use std::path::{Path, PathBuf};

use memmap2::Mmap;
use tch::{Kind, Tensor};

use super::batch::{Batch, vocab_size};
use crate::ir::{Dim, ValueId};
use crate::runtime::RuntimeError;
use crate::runtime::kernels::executor::Executor;
use crate::runtime::kernels::tensor::kind_of;

/// Width of a token id in a token file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    /// Little-endian uint16 (vocabularies up to 65 536).
    U16,
    /// Little-endian uint32.
    U32,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn bytes(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The sidecar's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "uint16",
            TokenDtype::U32 => "uint32",
        }
    }

    /// Parses a sidecar `dtype` (`uint16`/`u16`, `uint32`/`u32`).
    pub fn parse(s: &str) -> Option<TokenDtype> {
        match s {
            "uint16" | "u16" => Some(TokenDtype::U16),
            "uint32" | "u32" => Some(TokenDtype::U32),
            _ => None,
        }
    }

    /// The narrowest type holding ids below `vocab`.
    pub fn for_vocab(vocab: u64) -> TokenDtype {
        if vocab <= 1 << 16 { TokenDtype::U16 } else { TokenDtype::U32 }
    }
}

/// The JSON sidecar of a token file (`NAME.bin.json` beside `NAME.bin`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sidecar {
    /// `uint16` or `uint32`.
    pub dtype: String,
    /// Tokens in the file (checked against its size when given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Every id is below this (checked against the model's vocabulary when given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<u64>,
    /// How the text was tokenized (`bytes`, or the `tokenizer.json` path), for the record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// The source files, in order, for the record.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
}

/// The sidecar path of token file `bin`: `bin` with `.json` appended.
pub fn sidecar_path(bin: &Path) -> PathBuf {
    let mut s = bin.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// Whether `path` names a token file (extension `.bin`).
pub fn is_token_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "bin")
}

pub(super) fn ferr(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::File { path: path.display().to_string(), message: message.into() }
}

/// A memory-mapped token file.
pub struct TokenFile {
    path: PathBuf,
    map: Option<Mmap>,
    dtype: TokenDtype,
    tokens: usize,
    vocab_size: Option<u64>,
}

impl TokenFile {
    /// Maps `path`, reading its dtype from the sidecar.
    pub fn open(path: &Path) -> Result<TokenFile, RuntimeError> {
        let side = sidecar_path(path);
        let text = std::fs::read_to_string(&side).map_err(|e| {
            ferr(&side, format!("cannot read the sidecar of token file `{}` ({e}); write it as {{\"dtype\": \"uint16\"}} (or \"uint32\"), or create the file with `smp-runner prepare-data`", path.display()))
        })?;
        let meta: Sidecar = serde_json::from_str(&text)
            .map_err(|e| ferr(&side, format!("not a token-file sidecar ({e}); it must be a JSON object such as {{\"dtype\": \"uint16\"}}")))?;
        let dtype = TokenDtype::parse(&meta.dtype)
            .ok_or_else(|| ferr(&side, format!("dtype `{}` is not a token type; use \"uint16\" or \"uint32\"", meta.dtype)))?;
        let file = std::fs::File::open(path).map_err(|e| ferr(path, format!("cannot open the token file: {e}")))?;
        let len = file.metadata().map_err(|e| ferr(path, e.to_string()))?.len();
        if len % dtype.bytes() as u64 != 0 {
            return Err(ferr(
                path,
                format!("{len} bytes is not a whole number of {} tokens; the file is truncated or its sidecar's dtype is wrong", dtype.name()),
            ));
        }
        let tokens = (len / dtype.bytes() as u64) as usize;
        if let Some(t) = meta.tokens.filter(|&t| t != tokens as u64) {
            return Err(ferr(path, format!("holds {tokens} {} tokens, its sidecar `{}` says {t}; the file is truncated or its sidecar's dtype is wrong", dtype.name(), side.display())));
        }
        // SAFETY: the file is only read; a token file changed while a run maps it is outside
        // the contract (as for any memory-mapped input).
        let map = if len == 0 { None } else { Some(unsafe { Mmap::map(&file) }.map_err(|e| ferr(path, format!("cannot map the token file: {e}")))?) };
        Ok(TokenFile { path: path.to_path_buf(), map, dtype, tokens, vocab_size: meta.vocab_size })
    }

    /// Tokens in the file.
    pub fn len(&self) -> usize {
        self.tokens
    }

    /// Whether the file holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The id type.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// The sidecar's vocabulary size, if it gives one.
    pub fn vocab_size(&self) -> Option<u64> {
        self.vocab_size
    }

    /// Tokens `[start, start + n)` as i64 (the caller checks the range).
    pub fn read(&self, start: usize, n: usize) -> Vec<i64> {
        let Some(map) = &self.map else { return Vec::new() };
        let w = self.dtype.bytes();
        let bytes = &map[start * w..(start + n) * w];
        match self.dtype {
            TokenDtype::U16 => bytes.chunks_exact(2).map(|c| i64::from(u16::from_le_bytes([c[0], c[1]]))).collect(),
            TokenDtype::U32 => bytes.chunks_exact(4).map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect(),
        }
    }
}

/// The order samples are visited in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// A fresh seeded permutation of the windows each epoch.
    Shuffled {
        /// The run's seed.
        seed: u64,
    },
    /// Windows in file order (validation).
    Sequential,
}

/// Index of sample `j` (0-based, over the whole run) among `n` windows.
pub fn sample_window(order: Order, j: u64, n: u64) -> u64 {
    match order {
        Order::Sequential => j % n,
        Order::Shuffled { seed } => permute(j % n, n, splitmix64(seed ^ splitmix64(j / n))),
    }
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A keyed bijection of `[0, n)`: a 4-round Feistel network on the smallest even-bit power of
/// two ≥ n, walked until it lands below n.
fn permute(i: u64, n: u64, key: u64) -> u64 {
    if n <= 1 {
        return 0;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2).max(1);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..4u64 {
            let f = splitmix64(key ^ (round << 56) ^ r) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

/// How a graph input is filled beside the token ids.
#[derive(Clone, Debug)]
enum Fill {
    /// The window's token ids.
    Ids,
    /// Ones (attention masks).
    Ones,
    /// Zeros (token types).
    Zeros,
    /// `0..seq_len` per row (position ids).
    Positions,
}

/// Windows of a token file as batches of a model's inputs.
pub struct TokenStream {
    file: TokenFile,
    /// Tokens per sample.
    pub(super) seq_len: i64,
    /// Samples per global batch.
    pub(super) global_batch: i64,
    order: Order,
    /// (input name, element kind, fill), for every required graph input.
    inputs: Vec<(String, Kind, Fill)>,
    vocab: Option<i64>,
    /// Where batches are handed over (the model's device).
    device: tch::Device,
}

impl TokenStream {
    /// Samples of `seq_len` tokens from `file` for the model of `exec`, `global_batch` per
    /// step. The token-id input is the integer input named like `input_ids` (else the first);
    /// masks get ones, position ids `0..seq_len`, token types zeros.
    pub fn new(file: TokenFile, exec: &Executor, seq_len: i64, global_batch: i64, order: Order) -> Result<TokenStream, RuntimeError> {
        let graph = exec.graph();
        let path = file.path.clone();
        if seq_len < 2 {
            return Err(ferr(&path, format!("a sequence length of {seq_len} leaves nothing to predict; use --seq-len 2 or more")));
        }
        if (file.len() as u64) < seq_len as u64 {
            return Err(ferr(&path, format!("holds {} tokens, fewer than one sample of {seq_len}; use more text or a shorter sequence", file.len())));
        }
        let required = exec.required_inputs();
        let ids = token_input(exec).ok_or_else(|| ferr(&path, "a token file feeds a model's integer token-id input, and this model has none; pass --data as .npz"))?;
        let mut inputs = Vec::new();
        for id in required {
            let v = graph.value(id);
            let ierr = |m: String| ferr(&path, format!("model input `{}`: {m}", v.name));
            let ty = v.ty.as_ref().ok_or_else(|| ierr("has no declared type; pass --data as .npz".into()))?;
            let kind = kind_of(ty.dtype).map_err(ierr)?;
            if let Some(shape) = &ty.shape {
                if shape.rank() != 2 {
                    return Err(ierr(format!("has shape {shape}; token windows fill [batch, seq] inputs only (pass --data as .npz)")));
                }
                if let Dim::Known(k) = shape.0[1] {
                    if k != seq_len {
                        return Err(ierr(format!("has a fixed sequence length of {k}, the run's is {seq_len}; use --seq-len {k} (or re-plan)")));
                    }
                }
            }
            let lower = v.name.to_lowercase();
            let fill = if id == ids {
                Fill::Ids
            } else if lower.contains("mask") {
                Fill::Ones
            } else if lower.contains("position") {
                Fill::Positions
            } else if lower.contains("token_type") {
                Fill::Zeros
            } else {
                return Err(ierr("a token file only feeds token ids, masks, position ids and token types; pass --data as .npz".into()));
            };
            inputs.push((v.name.clone(), kind, fill));
        }
        let vocab = vocab_size(exec);
        if let (Some(v), Some(s)) = (vocab, file.vocab_size()) {
            if s > v as u64 {
                return Err(ferr(&path, format!("its sidecar gives a vocabulary of {s}, the model's is {v}; tokenize for this model")));
            }
        }
        Ok(TokenStream { file, seq_len, global_batch, order, inputs, vocab, device: exec.device() })
    }

    /// Windows in the file.
    pub fn windows(&self) -> u64 {
        self.file.len() as u64 / self.seq_len as u64
    }

    /// The token-file path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// Rows `rows` of batch `k` (from 1): each row one window, with every required input.
    pub fn rows(&self, k: usize, rows: std::ops::Range<i64>) -> Result<Batch, RuntimeError> {
        let n = self.windows();
        let s = self.seq_len as usize;
        let mut ids: Vec<i64> = Vec::with_capacity(rows.clone().count() * s);
        for b in rows.clone() {
            let j = (k as u64 - 1) * self.global_batch as u64 + b as u64;
            let w = sample_window(self.order, j, n) as usize;
            let window = self.file.read(w * s, s);
            if let Some(v) = self.vocab {
                if let Some(pos) = window.iter().position(|&t| t >= v) {
                    return Err(ferr(
                        self.path(),
                        format!("token {} at position {} is outside the model's vocabulary of {v}; tokenize for this model", window[pos], w * s + pos),
                    ));
                }
            }
            ids.extend(window);
        }
        let dims = [rows.end - rows.start, self.seq_len];
        let dev = self.device;
        let mut out = Vec::with_capacity(self.inputs.len());
        for (name, kind, fill) in &self.inputs {
            let t = match fill {
                Fill::Ids => Tensor::f_from_slice(&ids)?.f_reshape(dims)?.f_to_kind(*kind)?.f_to_device(dev)?,
                Fill::Ones => Tensor::f_ones(dims, (*kind, dev))?,
                Fill::Zeros => Tensor::f_zeros(dims, (*kind, dev))?,
                Fill::Positions => Tensor::f_arange(self.seq_len, (*kind, dev))?.f_expand(dims, false)?.f_contiguous()?,
            };
            out.push((name.clone(), t));
        }
        Ok(out)
    }
}

/// The model's token-id input: the integer input whose name holds `input_ids`, else the
/// first integer input (as the causal loss picks it).
pub fn token_input(exec: &Executor) -> Option<ValueId> {
    let graph = exec.graph();
    let ints: Vec<ValueId> = exec.required_inputs().into_iter().filter(|&id| graph.value(id).ty.as_ref().is_some_and(|t| t.dtype.is_int())).collect();
    ints.iter().copied().find(|&id| graph.value(id).name.contains("input_ids")).or_else(|| ints.first().copied())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_is_a_bijection_for_every_size() {
        for n in 1..=70u64 {
            for key in [0u64, 1, 0xdead_beef] {
                let mut seen: Vec<u64> = (0..n).map(|i| permute(i, n, key)).collect();
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n {n} key {key}");
            }
        }
    }

    #[test]
    fn shuffled_order_changes_with_seed_and_epoch_and_covers_each_epoch() {
        let n = 50;
        let a: Vec<u64> = (0..n).map(|j| sample_window(Order::Shuffled { seed: 1 }, j, n)).collect();
        let b: Vec<u64> = (0..n).map(|j| sample_window(Order::Shuffled { seed: 2 }, j, n)).collect();
        let a2: Vec<u64> = (n..2 * n).map(|j| sample_window(Order::Shuffled { seed: 1 }, j, n)).collect();
        assert_ne!(a, b);
        assert_ne!(a, a2);
        for mut e in [a.clone(), a2] {
            e.sort_unstable();
            assert_eq!(e, (0..n).collect::<Vec<_>>());
        }
        // not the identity
        assert_ne!(a, (0..n).collect::<Vec<_>>());
    }

}
