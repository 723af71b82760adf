//! `.npz`/`.npy` files: reading through tch (deflated or stored zips), writing our own
//! uncompressed zip so every element type numpy knows round-trips (tch's writer has no bool).

use std::io::Write;
use std::path::Path;

use tch::Tensor;

use crate::runtime::RuntimeError;
use crate::runtime::kernels::tensor::to_bytes;
use crate::ir::DType;

fn ferr(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::File { path: path.display().to_string(), message: message.into() }
}

/// Reads every array of an `.npz` file, in file order, keyed by name without `.npy`.
pub fn read_npz(path: &Path) -> Result<Vec<(String, Tensor)>, RuntimeError> {
    if !path.is_file() {
        return Err(ferr(path, "no such file"));
    }
    // tch unwraps on some malformed archives; keep that a user error.
    let p = path.to_path_buf();
    match std::panic::catch_unwind(move || Tensor::read_npz(&p)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(ferr(path, format!("not a readable .npz: {e}"))),
        Err(_) => Err(ferr(path, "not a readable .npz (malformed zip)")),
    }
}

/// Reads one `.npy` array.
pub fn read_npy(path: &Path) -> Result<Tensor, RuntimeError> {
    Tensor::read_npy(path).map_err(|e| ferr(path, format!("not a readable .npy: {e}")))
}

fn descr(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::F16 => "<f2",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::U8 => "|u1",
        DType::U16 => "<u2",
        DType::U32 => "<u4",
        DType::U64 => "<u8",
        DType::Bool => "|b1",
        DType::C64 => "<c8",
        DType::C128 => "<c16",
        _ => return None,
    })
}

/// The `.npy` bytes of a tensor. `as_dtype` narrows widened unsigned types back (u16/u32/u64
/// held as i64); bf16 and f8 are written as f32, which numpy can read.
pub fn npy_bytes(t: &Tensor, as_dtype: Option<DType>) -> Result<Vec<u8>, String> {
    let (mut dtype, dims, mut data) = to_bytes(t)?;
    match (dtype, as_dtype) {
        (DType::I64, Some(target @ (DType::U16 | DType::U32 | DType::U64))) => {
            let size = target.size_bytes() as usize;
            data = data.chunks_exact(8).flat_map(|c| c[..size].to_vec()).collect();
            dtype = target;
        }
        (DType::BF16 | DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz, _) => {
            let (d, _, bytes) = to_bytes(&t.f_to_kind(tch::Kind::Float).map_err(|e| e.to_string())?)?;
            dtype = d;
            data = bytes;
        }
        _ => {}
    }
    let Some(descr) = descr(dtype) else {
        return Err(format!("element type {dtype} has no numpy form"));
    };
    let shape = match dims.len() {
        0 => "()".to_string(),
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data);
    Ok(out)
}

fn crc32(data: &[u8]) -> u32 {
    let mut table = [0u32; 256];
    for (i, e) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
        *e = c;
    }
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c = table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    c ^ 0xFFFF_FFFF
}

/// Writes named arrays as an uncompressed `.npz` (each `NAME.npy`). `dtypes` optionally gives
/// the element type each array should be written as (see [`npy_bytes`]).
pub fn write_npz(path: &Path, arrays: &[(String, Tensor, Option<DType>)]) -> Result<(), RuntimeError> {
    let mut body: Vec<u8> = Vec::new();
    let mut central: Vec<u8> = Vec::new();
    for (name, t, as_dtype) in arrays {
        let data = npy_bytes(t, *as_dtype).map_err(|e| ferr(path, format!("array `{name}`: {e}")))?;
        let fname = format!("{name}.npy");
        if data.len() > u32::MAX as usize || body.len() > u32::MAX as usize {
            return Err(ferr(path, "arrays over 4 GiB need zip64, which this writer does not do"));
        }
        let crc = crc32(&data);
        let offset = body.len() as u32;
        let common = |v: &mut Vec<u8>| {
            v.extend_from_slice(&20u16.to_le_bytes()); // version needed
            v.extend_from_slice(&0u16.to_le_bytes()); // flags
            v.extend_from_slice(&0u16.to_le_bytes()); // stored
            v.extend_from_slice(&0u16.to_le_bytes()); // time
            v.extend_from_slice(&0x21u16.to_le_bytes()); // date 1980-01-01
            v.extend_from_slice(&crc.to_le_bytes());
            v.extend_from_slice(&(data.len() as u32).to_le_bytes());
            v.extend_from_slice(&(data.len() as u32).to_le_bytes());
            v.extend_from_slice(&(fname.len() as u16).to_le_bytes());
            v.extend_from_slice(&0u16.to_le_bytes()); // extra
        };
        body.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        common(&mut body);
        body.extend_from_slice(fname.as_bytes());
        body.extend_from_slice(&data);
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&20u16.to_le_bytes()); // made by
        common(&mut central);
        central.extend_from_slice(&0u16.to_le_bytes()); // comment
        central.extend_from_slice(&0u16.to_le_bytes()); // disk
        central.extend_from_slice(&0u16.to_le_bytes()); // internal attrs
        central.extend_from_slice(&0u32.to_le_bytes()); // external attrs
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(fname.as_bytes());
    }
    let n = arrays.len() as u16;
    let cd_offset = body.len() as u32;
    let mut end = Vec::new();
    end.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    end.extend_from_slice(&[0, 0, 0, 0]);
    end.extend_from_slice(&n.to_le_bytes());
    end.extend_from_slice(&n.to_le_bytes());
    end.extend_from_slice(&(central.len() as u32).to_le_bytes());
    end.extend_from_slice(&cd_offset.to_le_bytes());
    end.extend_from_slice(&0u16.to_le_bytes());
    let mut f = std::fs::File::create(path).map_err(|e| ferr(path, format!("cannot create: {e}")))?;
    f.write_all(&body)
        .and_then(|_| f.write_all(&central))
        .and_then(|_| f.write_all(&end))
        .map_err(|e| ferr(path, format!("cannot write: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn round_trips_through_tch_reader() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.npz");
        let x = Tensor::from_slice(&[1.5f32, -2.0, 3.0, 4.0]).reshape([2, 2]);
        let b = Tensor::from_slice(&[true, false, true]);
        write_npz(&path, &[("x".into(), x.shallow_clone(), None), ("b".into(), b.shallow_clone(), None)]).unwrap();
        let back = read_npz(&path).unwrap();
        assert_eq!(back[0].0, "x");
        assert!(back[0].1.equal(&x));
        assert_eq!(back[1].0, "b");
        assert!(back[1].1.equal(&b));
    }
}
