//! `ir::Tensor` ↔ `tch::Tensor` by raw little-endian bytes, for every element type torch holds.
//!
//! Unsigned 16/32/64-bit integers and 4-bit integers have no tch kind: they are held widened
//! (u16/u32/u64 as i64, u4/i4 unpacked to u8/i8) and narrowed back where an output needs them.

use tch::{Device, Kind, Tensor};

use crate::ir::{self, DType, Storage};

/// `draw` run with libtorch's global CPU generator seeded to `seed`, as one step: seeding and
/// drawing from the process's one generator are locked against every other seeded draw, or a
/// draw on another thread at the same time would take this one's numbers.
pub fn seeded<T>(seed: i64, draw: impl FnOnce() -> T) -> T {
    static DRAWING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _drawing = DRAWING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    tch::manual_seed(seed);
    draw()
}

/// A detached copy of `t` in its own storage (a narrowed view would keep its whole buffer
/// alive; a shallow clone would share it).
pub fn owned_copy(t: &Tensor) -> Result<Tensor, tch::TchError> {
    let t = t.f_detach()?;
    let mut out = t.f_empty_like()?;
    out.f_copy_(&t)?;
    Ok(out)
}

/// The tch kind a value of `dtype` is held in.
pub fn kind_of(dtype: DType) -> Result<Kind, String> {
    Ok(match dtype {
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F8E4M3 => Kind::Float8e4m3fn,
        DType::F8E5M2 => Kind::Float8e5m2,
        DType::F8E4M3Fnuz => Kind::Float8e4m3fnuz,
        DType::F8E5M2Fnuz => Kind::Float8e5m2fnuz,
        DType::I8 | DType::I4 => Kind::Int8,
        DType::U8 | DType::U4 => Kind::Uint8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 | DType::U16 | DType::U32 | DType::U64 => Kind::Int64,
        DType::Bool => Kind::Bool,
        DType::C64 => Kind::ComplexFloat,
        DType::C128 => Kind::ComplexDouble,
        DType::Str => return Err("string tensors are not supported by the libtorch runner".into()),
    })
}

/// The IR element type of a tch kind.
pub fn dtype_of(kind: Kind) -> Result<DType, String> {
    Ok(match kind {
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Float8e4m3fn => DType::F8E4M3,
        Kind::Float8e5m2 => DType::F8E5M2,
        Kind::Float8e4m3fnuz => DType::F8E4M3Fnuz,
        Kind::Float8e5m2fnuz => DType::F8E5M2Fnuz,
        Kind::Int8 => DType::I8,
        Kind::Uint8 => DType::U8,
        Kind::Int16 => DType::I16,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        Kind::Bool => DType::Bool,
        Kind::ComplexFloat => DType::C64,
        Kind::ComplexDouble => DType::C128,
        other => return Err(format!("tch kind {other:?} has no ONNX element type here")),
    })
}

/// True for floating-point kinds (the ones autograd trains).
pub fn is_float_kind(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float
            | Kind::Double
            | Kind::Half
            | Kind::BFloat16
            | Kind::Float8e4m3fn
            | Kind::Float8e5m2
            | Kind::Float8e4m3fnuz
            | Kind::Float8e5m2fnuz
    )
}

/// Builds a tch tensor from little-endian bytes laid out as ONNX `raw_data`.
/// Checks the byte count against dtype and dims first.
pub fn from_bytes(dtype: DType, dims: &[i64], bytes: &[u8]) -> Result<Tensor, String> {
    if let Some(d) = dims.iter().find(|&&d| d < 0) {
        return Err(format!("negative dimension {d} in dims {dims:?}"));
    }
    let too_many = || format!("dims {dims:?} of {dtype} hold more bytes than memory does");
    let numel = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d as usize)).ok_or_else(too_many)?;
    let want = match dtype {
        DType::I4 | DType::U4 => numel.div_ceil(2),
        _ => numel.checked_mul(dtype.size_bytes() as usize).ok_or_else(too_many)?,
    };
    if bytes.len() != want {
        return Err(format!(
            "{} bytes of data, but {dtype}{dims:?} needs {want} bytes",
            bytes.len()
        ));
    }
    let kind = kind_of(dtype)?;
    let t = match dtype {
        DType::U16 => {
            let v: Vec<i64> = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as i64).collect();
            Tensor::f_from_slice(&v)
        }
        DType::U32 => {
            let v: Vec<i64> = bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
                .collect();
            Tensor::f_from_slice(&v)
        }
        DType::U64 => Tensor::f_from_data_size(bytes, &[numel as i64], Kind::Int64),
        DType::I4 | DType::U4 => {
            let signed = dtype == DType::I4;
            let v: Vec<i8> = (0..numel)
                .map(|i| {
                    let b = bytes[i / 2];
                    let nib = if i % 2 == 0 { b & 0x0f } else { b >> 4 };
                    if signed && nib >= 8 { nib as i8 - 16 } else { nib as i8 }
                })
                .collect();
            Tensor::f_from_slice(&v).and_then(|t| t.f_to_kind(kind))
        }
        _ => Tensor::f_from_data_size(bytes, &[numel as i64], kind),
    }
    .map_err(|e| e.to_string())?;
    t.f_reshape(dims).map_err(|e| e.to_string())
}

/// Converts an in-memory IR constant to a tch tensor (external data is loaded by `weights`).
pub fn from_ir(t: &ir::Tensor) -> Result<Tensor, String> {
    match &t.storage {
        Storage::Raw(bytes) => from_bytes(t.dtype, &t.dims, bytes),
        Storage::External(ext) => Err(format!(
            "data is external (`{}`); load it through the runner's weight loader",
            ext.location
        )),
        Storage::Strings(_) => Err("string tensors are not supported by the libtorch runner".into()),
    }
}

/// Little-endian bytes of a tensor (made contiguous, on CPU), with its IR dtype.
pub fn to_bytes(t: &Tensor) -> Result<(DType, Vec<i64>, Vec<u8>), String> {
    let t = t
        .f_detach()
        .and_then(|t| t.f_to_device(Device::Cpu))
        .and_then(|t| t.f_contiguous())
        .map_err(|e| e.to_string())?;
    let kind = t.f_kind().map_err(|e| e.to_string())?;
    let dtype = dtype_of(kind)?;
    let numel = t.numel();
    let mut bytes = vec![0u8; numel * kind.elt_size_in_bytes()];
    t.f_copy_data_u8(&mut bytes, numel).map_err(|e| e.to_string())?;
    Ok((dtype, t.size(), bytes))
}

/// Converts a tch tensor to an IR constant with raw storage.
pub fn to_ir(t: &Tensor) -> Result<ir::Tensor, String> {
    let (dtype, dims, bytes) = to_bytes(t)?;
    Ok(ir::Tensor { dtype, dims, storage: Storage::Raw(bytes.into()) })
}

/// The elements of an integer (or bool) tensor, widened to i64 (shape arithmetic inputs).
pub fn to_i64_vec(t: &Tensor) -> Result<Vec<i64>, String> {
    let t = t
        .f_detach()
        .and_then(|t| t.f_to_device(Device::Cpu))
        .and_then(|t| t.f_to_kind(Kind::Int64))
        .and_then(|t| t.f_contiguous())
        .map_err(|e| e.to_string())?;
    let n = t.numel();
    let mut v = vec![0i64; n];
    t.f_copy_data(&mut v, n).map_err(|e| e.to_string())?;
    Ok(v)
}

/// The elements of a numeric tensor as f64.
pub fn to_f64_vec(t: &Tensor) -> Result<Vec<f64>, String> {
    let t = t
        .f_detach()
        .and_then(|t| t.f_to_device(Device::Cpu))
        .and_then(|t| t.f_to_kind(Kind::Double))
        .and_then(|t| t.f_contiguous())
        .map_err(|e| e.to_string())?;
    let n = t.numel();
    let mut v = vec![0f64; n];
    t.f_copy_data(&mut v, n).map_err(|e| e.to_string())?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_byte_layout() {
        for (dtype, bytes) in [
            (DType::F32, 1.5f32.to_le_bytes().repeat(6)),
            (DType::F64, (-2.25f64).to_le_bytes().repeat(6)),
            (DType::F16, half::f16::from_f32(0.5).to_le_bytes().repeat(6)),
            (DType::BF16, half::bf16::from_f32(3.0).to_le_bytes().repeat(6)),
            (DType::I32, (-7i32).to_le_bytes().repeat(6)),
            (DType::I64, (1i64 << 40).to_le_bytes().repeat(6)),
            (DType::Bool, vec![1, 0, 1, 1, 0, 0]),
            (DType::U8, vec![250, 0, 1, 2, 3, 4]),
        ] {
            let t = from_bytes(dtype, &[2, 3], &bytes).unwrap();
            let (d, dims, back) = to_bytes(&t).unwrap();
            assert_eq!((d, dims, back), (dtype, vec![2, 3], bytes), "{dtype}");
        }
    }

    #[test]
    fn widens_unsigned_and_unpacks_nibbles() {
        let t = from_bytes(DType::U32, &[2], &[0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0]).unwrap();
        assert_eq!(to_i64_vec(&t).unwrap(), vec![4294967295, 1]);
        let t = from_bytes(DType::I4, &[3], &[0xf7, 0x01]).unwrap();
        assert_eq!(to_i64_vec(&t).unwrap(), vec![7, -1, 1]);
    }

    #[test]
    fn refuses_wrong_byte_counts() {
        assert!(from_bytes(DType::F32, &[2, 2], &[0u8; 12]).is_err());
    }
}
