//! `prepare-data`: token files written from text files (byte-level ids, or a Hugging Face
//! tokenizer), with a validation split of whole files.

use std::path::{Path, PathBuf};

use super::tokens::{Sidecar, TokenDtype, ferr, is_token_file, sidecar_path};
use crate::runtime::RuntimeError;

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
    fn every_kth_file_is_held_out() {
        let files: Vec<PathBuf> = (0..10).map(|i| PathBuf::from(format!("f{i}"))).collect();
        let (train, val) = split_files(&files, 0.25);
        assert_eq!(val, vec![PathBuf::from("f3"), PathBuf::from("f7")]);
        assert_eq!(train.len(), 8);
        let (train, val) = split_files(&files, 0.0);
        assert_eq!((train.len(), val.len()), (10, 0));
    }
}
