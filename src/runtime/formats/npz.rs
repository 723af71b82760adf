//! `.npz`/`.npy` files: reading numpy's headers ourselves (every numeric type; the data's
//! size checked against the header before it is read) from stored or deflated zips, writing
//! our own uncompressed zip so every element type numpy knows round-trips (tch's writer has no
//! bool).

use std::io::{Read, Write};
use std::path::Path;

use tch::Tensor;

use crate::runtime::RuntimeError;
use crate::runtime::kernels::tensor::to_bytes;
use crate::ir::DType;

fn ferr(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::File { path: path.display().to_string(), message: message.into() }
}

/// Reads every array of an `.npz` file, in file order, keyed by name without `.npy`.
/// Members may be stored or deflated; each is checked against its `.npy` header before its
/// data is read, so a damaged archive is refused naming the member.
pub fn read_npz(path: &Path) -> Result<Vec<(String, Tensor)>, RuntimeError> {
    let file = std::fs::File::open(path).map_err(|e| ferr(path, format!("cannot read: {e}")))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file)).map_err(|e| ferr(path, format!("not a readable .npz: {e}")))?;
    let mut out = Vec::with_capacity(zip.len());
    for i in 0..zip.len() {
        let mut member = zip.by_index(i).map_err(|e| ferr(path, format!("not a readable .npz: member {i}: {e}")))?;
        let name = member.name().to_string();
        let bad = |m: String| ferr(path, format!("not a readable .npz: member `{name}`: {m}"));
        let header = npy_header(&mut member).map_err(bad)?;
        // deflate expands at most 1032-fold: a member claiming more data is damaged
        let can_hold = member.compressed_size().saturating_mul(1032).min(member.size());
        if (header.data_bytes as u64).saturating_add(header.header_bytes as u64) > can_hold {
            return Err(bad(format!("its header ({}{:?}) needs {} bytes of data, the member holds {}", header.dtype, header.dims, header.data_bytes, member.size())));
        }
        let tensor = npy_data(&mut member, &header).map_err(bad)?;
        out.push((name.strip_suffix(".npy").unwrap_or(&name).to_string(), tensor));
    }
    Ok(out)
}

/// Reads one `.npy` array.
pub fn read_npy(path: &Path) -> Result<Tensor, RuntimeError> {
    let bad = |m: String| ferr(path, format!("not a readable .npy: {m}"));
    let file = std::fs::File::open(path).map_err(|e| ferr(path, format!("cannot read: {e}")))?;
    let len = file.metadata().map_err(|e| ferr(path, format!("cannot read: {e}")))?.len();
    let mut reader = std::io::BufReader::new(file);
    let header = npy_header(&mut reader).map_err(bad)?;
    let have = len.saturating_sub(header.header_bytes as u64);
    if have < header.data_bytes as u64 {
        return Err(bad(format!("its header ({}{:?}) needs {} bytes of data, the file holds {have}", header.dtype, header.dims, header.data_bytes)));
    }
    npy_data(&mut reader, &header).map_err(bad)
}

/// What an `.npy` header says.
struct NpyHeader {
    dtype: DType,
    dims: Vec<i64>,
    /// Bytes of the magic, version, length and header text.
    header_bytes: usize,
    /// Bytes of data the dims and element type need.
    data_bytes: usize,
}

/// Reads and checks an `.npy` header (format versions 1 to 3): a little-endian or
/// byte-order-free element type numpy writes, C order, dims whose byte count fits.
fn npy_header(r: &mut impl Read) -> Result<NpyHeader, String> {
    let mut pre = [0u8; 8];
    r.read_exact(&mut pre).map_err(|_| "shorter than an .npy header".to_string())?;
    if &pre[..6] != b"\x93NUMPY" {
        return Err("no `\\x93NUMPY` magic at its start".into());
    }
    let short = |_| "shorter than an .npy header".to_string();
    let (len, prefix) = match pre[6] {
        1 => {
            let mut n = [0u8; 2];
            r.read_exact(&mut n).map_err(short)?;
            (u16::from_le_bytes(n) as usize, 10)
        }
        2 | 3 => {
            let mut n = [0u8; 4];
            r.read_exact(&mut n).map_err(short)?;
            (u32::from_le_bytes(n) as usize, 12)
        }
        v => return Err(format!("format version {v}.{} is not one numpy writes (1.0, 2.0, 3.0)", pre[7])),
    };
    if len > 1 << 20 {
        return Err(format!("its header claims {len} bytes"));
    }
    let mut text = vec![0u8; len];
    r.read_exact(&mut text).map_err(|_| format!("its header of {len} bytes is cut short"))?;
    let text = String::from_utf8(text).map_err(|_| "its header is not text".to_string())?;
    let field = |key: &str| -> Option<&str> {
        let at = text.find(&format!("'{key}':"))? + key.len() + 3;
        let rest = text[at..].trim_start();
        let end = if rest.starts_with('(') { rest.find(')')? + 1 } else { rest.find([',', '}']).unwrap_or(rest.len()) };
        Some(rest[..end].trim())
    };
    match field("fortran_order") {
        Some("False") | None => {}
        Some("True") => return Err("it is in Fortran order; save it with np.ascontiguousarray".into()),
        Some(v) => return Err(format!("fortran_order `{v}` is not True or False")),
    }
    let descr = field("descr").ok_or("its header has no `descr`")?.trim_matches('\'');
    if descr.starts_with('>') {
        return Err(format!("element type `{descr}` is big-endian; save it little-endian (numpy's default)"));
    }
    let dtype = match descr.trim_start_matches(['<', '|', '=']) {
        "f2" | "e" => DType::F16,
        "f4" | "f" => DType::F32,
        "f8" | "d" => DType::F64,
        "i1" | "b" => DType::I8,
        "i2" | "h" => DType::I16,
        "i4" | "i" => DType::I32,
        "i8" | "q" => DType::I64,
        "u1" | "B" => DType::U8,
        "u2" | "H" => DType::U16,
        "u4" | "I" => DType::U32,
        "u8" | "Q" => DType::U64,
        "b1" | "?" => DType::Bool,
        "c8" | "F" => DType::C64,
        "c16" | "D" => DType::C128,
        other => return Err(format!("element type `{other}` is not a numeric numpy type this runner reads")),
    };
    let shape = field("shape").ok_or("its header has no `shape`")?;
    let inner = shape.strip_prefix('(').and_then(|s| s.strip_suffix(')')).ok_or_else(|| format!("shape `{shape}` is not a tuple"))?;
    let dims = inner
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<i64>().ok().filter(|&v| v >= 0).ok_or_else(|| format!("shape `{shape}`: `{d}` is not a size")))
        .collect::<Result<Vec<i64>, String>>()?;
    // numpy allows empty arrays of any extent; libtorch's strides must fit in i64
    if dims.iter().try_fold(1i64, |n, &d| n.checked_mul(d.max(1))).is_none() {
        return Err(format!("shape {dims:?} spans more elements than libtorch can index, even empty"));
    }
    let data_bytes = dims
        .iter()
        .try_fold(dtype.size_bytes(), |n, &d| n.checked_mul(d as u64))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("shape {dims:?} of {dtype} is more bytes than any file holds"))?;
    Ok(NpyHeader { dtype, dims, header_bytes: prefix + len, data_bytes })
}

/// The data an `.npy` header announces, read after it.
fn npy_data(r: &mut impl Read, h: &NpyHeader) -> Result<Tensor, String> {
    let mut data = vec![0u8; h.data_bytes];
    r.read_exact(&mut data).map_err(|e| format!("its data ({}{:?}, {} bytes) cannot be read: {e}", h.dtype, h.dims, h.data_bytes))?;
    crate::runtime::kernels::tensor::from_bytes(h.dtype, &h.dims, &data)
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
    let mut members = Vec::with_capacity(arrays.len());
    for (name, t, as_dtype) in arrays {
        let data = npy_bytes(t, *as_dtype).map_err(|e| ferr(path, format!("array `{name}`: {e}")))?;
        members.push((format!("{name}.npy"), data));
    }
    let bytes = stored_zip(&members).map_err(|e| ferr(path, e))?;
    let mut f = std::fs::File::create(path).map_err(|e| ferr(path, format!("cannot create: {e}")))?;
    f.write_all(&bytes).map_err(|e| ferr(path, format!("cannot write: {e}")))
}

/// An uncompressed zip of `members` (name, bytes), as numpy's `savez` writes one.
pub fn stored_zip(members: &[(String, Vec<u8>)]) -> Result<Vec<u8>, String> {
    let mut body: Vec<u8> = Vec::new();
    let mut central: Vec<u8> = Vec::new();
    for (fname, data) in members {
        if data.len() > u32::MAX as usize || body.len() > u32::MAX as usize {
            return Err("arrays over 4 GiB need zip64, which this writer does not do".into());
        }
        let crc = crc32(data);
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
        body.extend_from_slice(data);
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
    let n = members.len() as u16;
    let cd_offset = body.len() as u32;
    let central_len = central.len() as u32;
    body.extend_from_slice(&central);
    body.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    body.extend_from_slice(&[0, 0, 0, 0]);
    body.extend_from_slice(&n.to_le_bytes());
    body.extend_from_slice(&n.to_le_bytes());
    body.extend_from_slice(&central_len.to_le_bytes());
    body.extend_from_slice(&cd_offset.to_le_bytes());
    body.extend_from_slice(&0u16.to_le_bytes());
    Ok(body)
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
