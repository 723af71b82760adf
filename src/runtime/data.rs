//! Training data: token files (a flat little-endian array of uint16 or uint32 token ids, the
//! nanoGPT / Megatron `.bin` convention, memory-mapped, with its dtype in a JSON sidecar), the
//! seeded order of their samples, and the batches each step reads.
//!
//! A sample is a window of `seq_len` consecutive tokens, windows laid end to end
//! (`[w·S, (w+1)·S)`). Step `k`'s global batch holds the samples `(k−1)·B .. k·B` of an
//! endless sequence that visits every window once per epoch in an order drawn from
//! (seed, epoch) alone, so every plan of the same batch and sequence length sees the same
//! global batches. A rank reads only the rows of its replica, and only if its stages need them.

use std::path::{Path, PathBuf};

use memmap2::Mmap;
use tch::{Kind, Tensor};

use super::RuntimeError;
use super::executor::Executor;
use super::tensor::kind_of;
use super::train::{Batch, split_batch};
use crate::ir::{Dim, ValueId};

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

fn ferr(path: &Path, message: impl Into<String>) -> RuntimeError {
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
    seq_len: i64,
    global_batch: i64,
    order: Order,
    /// (input name, element kind, fill), for every required graph input.
    inputs: Vec<(String, Kind, Fill)>,
    vocab: Option<i64>,
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
        let vocab = super::train::vocab_size(exec);
        if let (Some(v), Some(s)) = (vocab, file.vocab_size()) {
            if s > v as u64 {
                return Err(ferr(&path, format!("its sidecar gives a vocabulary of {s}, the model's is {v}; tokenize for this model")));
            }
        }
        Ok(TokenStream { file, seq_len, global_batch, order, inputs, vocab })
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
        let cpu = tch::Device::Cpu;
        let mut out = Vec::with_capacity(self.inputs.len());
        for (name, kind, fill) in &self.inputs {
            let t = match fill {
                Fill::Ids => Tensor::f_from_slice(&ids)?.f_reshape(dims)?.f_to_kind(*kind)?,
                Fill::Ones => Tensor::f_ones(dims, (*kind, cpu))?,
                Fill::Zeros => Tensor::f_zeros(dims, (*kind, cpu))?,
                Fill::Positions => Tensor::f_arange(self.seq_len, (*kind, cpu))?.f_expand(dims, false)?.f_contiguous()?,
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
/// from `seed`) or one fixed batch (`.npy`/`.npz`/`.safetensors`).
pub fn open_data(exec: &Executor, path: &Path, seq_len: i64, global_batch: i64, order: Order) -> Result<DataSource, RuntimeError> {
    if is_token_file(path) {
        let file = TokenFile::open(path)?;
        Ok(DataSource::Tokens(TokenStream::new(file, exec, seq_len, global_batch, order)?))
    } else {
        Ok(DataSource::Fixed(super::train::read_batch(exec, path)?))
    }
}

/// What `prepare-data` wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    /// Training tokens and source files.
    pub train: (u64, Vec<PathBuf>),
    /// Validation tokens and source files (none without a validation split).
    pub val: (u64, Vec<PathBuf>),
    /// Files that were not UTF-8 text (a tokenizer read them with U+FFFD replacements).
    pub not_utf8: Vec<PathBuf>,
}

/// The validation file beside training file `out`: `NAME.val.bin` for `NAME.bin`.
pub fn val_path(out: &Path) -> PathBuf {
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    out.with_file_name(format!("{stem}.val.bin"))
}

/// Every regular file of `inputs` (directories walked recursively), sorted by path, without
/// duplicates; `ext` keeps only files with that extension.
pub fn collect_files(inputs: &[PathBuf], ext: Option<&str>) -> Result<Vec<PathBuf>, RuntimeError> {
    fn walk(p: &Path, ext: Option<&str>, out: &mut Vec<PathBuf>) -> Result<(), RuntimeError> {
        let meta = std::fs::metadata(p).map_err(|e| ferr(p, format!("cannot read: {e}")))?;
        if meta.is_dir() {
            let rd = std::fs::read_dir(p).map_err(|e| ferr(p, format!("cannot list: {e}")))?;
            for entry in rd {
                let entry = entry.map_err(|e| ferr(p, format!("cannot list: {e}")))?;
                let path = entry.path();
                let ft = entry.file_type().map_err(|e| ferr(&path, e.to_string()))?;
                // symlinked directories are not followed (no cycles)
                if ft.is_dir() || (ft.is_file() && ext.is_none_or(|x| path.extension().is_some_and(|e| e == x))) {
                    walk(&path, ext, out)?;
                }
            }
        } else if meta.is_file() {
            out.push(p.to_path_buf());
        }
        Ok(())
    }
    let mut out = Vec::new();
    for p in inputs {
        walk(p, ext, &mut out)?;
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Splits sorted `files` into training and validation: with fraction `f` > 0, every k-th
/// file (k = round(1/f); files k−1, 2k−1, …) is held out.
pub fn split_files(files: &[PathBuf], val_fraction: f64) -> (Vec<PathBuf>, Vec<PathBuf>) {
    if val_fraction <= 0.0 {
        return (files.to_vec(), Vec::new());
    }
    let k = ((1.0 / val_fraction).round() as usize).max(2);
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, f) in files.iter().enumerate() {
        if i % k == k - 1 { val.push(f.clone()) } else { train.push(f.clone()) }
    }
    (train, val)
}

/// How `prepare-data` turns text into token ids.
pub enum TextTokenizer {
    /// One token per byte (ids 0–255).
    Bytes,
    /// A Hugging Face `tokenizer.json` (its own vocabulary; no special tokens added).
    HuggingFace {
        /// The file it was read from, for the sidecar and messages.
        path: PathBuf,
        /// The tokenizer.
        tokenizer: Box<tokenizers::Tokenizer>,
    },
}

impl TextTokenizer {
    /// Reads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<TextTokenizer, RuntimeError> {
        let tokenizer = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| ferr(path, format!("not a Hugging Face tokenizer.json: {e}")))?;
        Ok(TextTokenizer::HuggingFace { path: path.to_path_buf(), tokenizer: Box::new(tokenizer) })
    }

    /// Ids are below this.
    pub fn vocab_size(&self) -> u64 {
        match self {
            TextTokenizer::Bytes => 256,
            TextTokenizer::HuggingFace { tokenizer, .. } => tokenizer.get_vocab_size(true) as u64,
        }
    }

    /// What the sidecar records as the tokenizer.
    fn describe(&self) -> String {
        match self {
            TextTokenizer::Bytes => "bytes".into(),
            TextTokenizer::HuggingFace { path, .. } => std::fs::canonicalize(path).unwrap_or_else(|_| path.clone()).display().to_string(),
        }
    }

    /// The ids of the file `file`'s contents `bytes`. A tokenizer reads text: bytes that are
    /// not UTF-8 are replaced by U+FFFD, and the second value says whether any were.
    fn encode(&self, file: &Path, bytes: &[u8]) -> Result<(Vec<u32>, bool), RuntimeError> {
        match self {
            TextTokenizer::Bytes => Ok((bytes.iter().map(|&b| u32::from(b)).collect(), false)),
            TextTokenizer::HuggingFace { path, tokenizer } => {
                let text = String::from_utf8_lossy(bytes);
                let lossy = matches!(text, std::borrow::Cow::Owned(_));
                let enc = tokenizer
                    .encode(text.as_ref(), false)
                    .map_err(|e| ferr(file, format!("tokenizer `{}` cannot encode it: {e}", path.display())))?;
                Ok((enc.get_ids().to_vec(), lossy))
            }
        }
    }
}

/// Writes token files from the text of `inputs` (files, or directories walked recursively,
/// sorted by path), tokenized by `tokenizer`: `out` and, with `val_fraction` > 0, the held-out
/// files at [`val_path`]`(out)`, each with its sidecar. uint16 ids when the vocabulary fits,
/// else uint32. Writes go to a temporary file renamed into place.
pub fn prepare(
    inputs: &[PathBuf],
    ext: Option<&str>,
    out: &Path,
    val_fraction: f64,
    tokenizer: &TextTokenizer,
) -> Result<Prepared, RuntimeError> {
    if !(0.0..=0.5).contains(&val_fraction) {
        return Err(RuntimeError::Train(format!("--val-fraction {val_fraction} must lie in [0, 0.5]")));
    }
    if !is_token_file(out) {
        return Err(ferr(out, "the output of prepare-data must end in .bin (its sidecar goes beside it as .bin.json)"));
    }
    let files = collect_files(inputs, ext)?;
    if files.is_empty() {
        return Err(RuntimeError::Train(format!("no input files found in {inputs:?}{}", ext.map(|e| format!(" with extension .{e}")).unwrap_or_default())));
    }
    let (train, val) = split_files(&files, val_fraction);
    if val_fraction > 0.0 && (val.is_empty() || train.is_empty()) {
        return Err(RuntimeError::Train(format!(
            "--val-fraction {val_fraction} holds out every {}-th file, but there are only {} files; lower the fraction or add files",
            ((1.0 / val_fraction).round() as usize).max(2),
            files.len()
        )));
    }
    let mut lossy = Vec::new();
    let n_train = write_token_file(&train, out, tokenizer, &mut lossy)?;
    let n_val = if val.is_empty() { 0 } else { write_token_file(&val, &val_path(out), tokenizer, &mut lossy)? };
    Ok(Prepared { train: (n_train, train), val: (n_val, val), not_utf8: lossy })
}

/// Concatenates the tokens of `files` into `out` and writes its sidecar; files whose bytes
/// were not all UTF-8 are added to `lossy`.
fn write_token_file(files: &[PathBuf], out: &Path, tokenizer: &TextTokenizer, lossy: &mut Vec<PathBuf>) -> Result<u64, RuntimeError> {
    use std::io::Write;
    let vocab = tokenizer.vocab_size();
    let dtype = TokenDtype::for_vocab(vocab);
    let tmp = out.with_extension("bin.tmp");
    let f = std::fs::File::create(&tmp).map_err(|e| ferr(&tmp, format!("cannot create: {e}")))?;
    let mut w = std::io::BufWriter::new(f);
    let mut tokens = 0u64;
    for p in files {
        let bytes = std::fs::read(p).map_err(|e| ferr(p, format!("cannot read: {e}")))?;
        let (ids, replaced) = tokenizer.encode(p, &bytes)?;
        if replaced {
            lossy.push(p.clone());
        }
        let mut buf = Vec::with_capacity(ids.len() * dtype.bytes());
        for &id in &ids {
            match dtype {
                TokenDtype::U16 => buf.extend_from_slice(&(id as u16).to_le_bytes()),
                TokenDtype::U32 => buf.extend_from_slice(&id.to_le_bytes()),
            }
        }
        w.write_all(&buf).map_err(|e| ferr(&tmp, format!("cannot write: {e}")))?;
        tokens += ids.len() as u64;
    }
    let f = w.into_inner().map_err(|e| ferr(&tmp, format!("cannot write: {e}")))?;
    f.sync_all().map_err(|e| ferr(&tmp, format!("cannot write: {e}")))?;
    std::fs::rename(&tmp, out).map_err(|e| ferr(out, format!("cannot rename {} into place: {e}", tmp.display())))?;
    let meta = Sidecar {
        dtype: dtype.name().into(),
        tokens: Some(tokens),
        vocab_size: Some(vocab),
        tokenizer: Some(tokenizer.describe()),
        files: files.iter().map(|p| p.display().to_string()).collect(),
    };
    let side = sidecar_path(out);
    let text = serde_json::to_string_pretty(&meta).map_err(|e| ferr(&side, e.to_string()))?;
    std::fs::write(&side, text + "\n").map_err(|e| ferr(&side, format!("cannot write: {e}")))?;
    Ok(tokens)
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

    #[test]
    fn every_kth_file_is_held_out() {
        let files: Vec<PathBuf> = (0..10).map(|i| PathBuf::from(format!("f{i}"))).collect();
        let (train, val) = split_files(&files, 0.25);
        assert_eq!(val, vec![PathBuf::from("f3"), PathBuf::from("f7")]);
        assert_eq!(train.len(), 8);
        let (train, val) = split_files(&files, 0.0);
        assert_eq!((train.len(), val.len()), (10, 0));
    }
}
