//! Constant tensors: initializers, `Constant` nodes and folded shape arithmetic.

use std::path::PathBuf;

use super::DType;

/// Where an external initializer's bytes live. Metadata only: the compiler never reads them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalData {
    /// `location` as written in the model (relative to the model's folder).
    pub location: String,
    /// The resolved path inside the model's folder.
    pub path: PathBuf,
    /// Byte offset into the file.
    pub offset: u64,
    /// Byte length of the tensor's data.
    pub length: u64,
    /// Whether the file exists (a missing file makes a graph-only model).
    pub present: bool,
}

/// The bytes of a constant tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Storage {
    /// Little-endian raw bytes, exactly `numel * size_bytes` long (ONNX `raw_data` layout).
    /// Shared and cheap to clone; imported models keep it inside the memory-mapped file.
    Raw(prost::bytes::Bytes),
    /// Stored in a file beside the model.
    External(ExternalData),
    /// String elements.
    Strings(Vec<Vec<u8>>),
}

/// A constant tensor with its element type and dims.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Element type.
    pub dtype: DType,
    /// Sizes of each axis.
    pub dims: Vec<i64>,
    /// The data.
    pub storage: Storage,
}

impl Tensor {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.dims.iter().fold(1u64, |n, &d| n.saturating_mul(d.max(0) as u64))
    }

    /// Bytes of data (as stored for external data, computed otherwise).
    pub fn nbytes(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.size_bytes())
    }

    /// An i64 tensor of the given dims.
    pub fn from_i64(dims: Vec<i64>, values: &[i64]) -> Tensor {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor { dtype: DType::I64, dims, storage: Storage::Raw(bytes.into()) }
    }

    /// An f32 tensor of the given dims.
    pub fn from_f32(dims: Vec<i64>, values: &[f32]) -> Tensor {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor { dtype: DType::F32, dims, storage: Storage::Raw(bytes.into()) }
    }

    /// An f64 tensor of the given dims.
    pub fn from_f64(dims: Vec<i64>, values: &[f64]) -> Tensor {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor { dtype: DType::F64, dims, storage: Storage::Raw(bytes.into()) }
    }

    /// The raw bytes, if held in memory.
    pub fn raw(&self) -> Option<&[u8]> {
        match &self.storage {
            Storage::Raw(b) => Some(b),
            _ => None,
        }
    }

    /// Integer (or bool) values widened to i64; `None` for float, string or external data.
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        let raw = self.raw()?;
        let n = self.numel() as usize;
        let size = self.dtype.size_bytes() as usize;
        if size == 0 || raw.len() < n * size {
            return None;
        }
        let chunks = raw.chunks_exact(size).take(n);
        Some(match self.dtype {
            DType::I64 => chunks.map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect(),
            DType::U64 => chunks.map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as i64).collect(),
            DType::I32 => chunks.map(|c| i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as i64).collect(),
            DType::U32 => chunks.map(|c| u32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as i64).collect(),
            DType::I16 => chunks.map(|c| i16::from_le_bytes(c.try_into().unwrap_or([0; 2])) as i64).collect(),
            DType::U16 => chunks.map(|c| u16::from_le_bytes(c.try_into().unwrap_or([0; 2])) as i64).collect(),
            DType::I8 => chunks.map(|c| c[0] as i8 as i64).collect(),
            DType::U8 | DType::Bool => chunks.map(|c| c[0] as i64).collect(),
            _ => return None,
        })
    }

    /// Numeric values as f64 (floats and integers); `None` for strings or external data.
    pub fn to_f64_vec(&self) -> Option<Vec<f64>> {
        if !self.dtype.is_float() {
            return self.to_i64_vec().map(|v| v.into_iter().map(|x| x as f64).collect());
        }
        let raw = self.raw()?;
        let n = self.numel() as usize;
        let size = self.dtype.size_bytes() as usize;
        if raw.len() < n * size {
            return None;
        }
        let chunks = raw.chunks_exact(size).take(n);
        Some(match self.dtype {
            DType::F32 => chunks.map(|c| f32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as f64).collect(),
            DType::F64 => chunks.map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect(),
            DType::F16 => chunks
                .map(|c| half::f16::from_le_bytes(c.try_into().unwrap_or([0; 2])).to_f64())
                .collect(),
            DType::BF16 => chunks
                .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap_or([0; 2])).to_f64())
                .collect(),
            _ => return None,
        })
    }
}
