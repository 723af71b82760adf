//! Element types, with their ONNX codes and sizes.

use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    F8E4M3,
    F8E5M2,
    /// FLOAT8E4M3FNUZ: no infinities, no negative zero, NaN is 0x80, exponent bias 8.
    F8E4M3Fnuz,
    /// FLOAT8E5M2FNUZ: as above, exponent bias 16.
    F8E5M2Fnuz,
    I4,
    U4,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    Bool,
    Str,
    C64,
    C128,
}

impl DType {
    /// Maps an ONNX `TensorProto.DataType` code; `None` for UNDEFINED or unknown codes.
    pub fn from_onnx(code: i32) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::U8,
            3 => DType::I8,
            4 => DType::U16,
            5 => DType::I16,
            6 => DType::I32,
            7 => DType::I64,
            8 => DType::Str,
            9 => DType::Bool,
            10 => DType::F16,
            11 => DType::F64,
            12 => DType::U32,
            13 => DType::U64,
            14 => DType::C64,
            15 => DType::C128,
            16 => DType::BF16,
            17 => DType::F8E4M3,
            18 => DType::F8E4M3Fnuz,
            19 => DType::F8E5M2,
            20 => DType::F8E5M2Fnuz,
            21 => DType::U4,
            22 => DType::I4,
            _ => return None,
        })
    }

    /// The ONNX `TensorProto.DataType` code.
    pub fn to_onnx(self) -> i32 {
        match self {
            DType::F32 => 1,
            DType::U8 => 2,
            DType::I8 => 3,
            DType::U16 => 4,
            DType::I16 => 5,
            DType::I32 => 6,
            DType::I64 => 7,
            DType::Str => 8,
            DType::Bool => 9,
            DType::F16 => 10,
            DType::F64 => 11,
            DType::U32 => 12,
            DType::U64 => 13,
            DType::C64 => 14,
            DType::C128 => 15,
            DType::BF16 => 16,
            DType::F8E4M3 => 17,
            DType::F8E5M2 => 19,
            DType::F8E4M3Fnuz => 18,
            DType::F8E5M2Fnuz => 20,
            DType::U4 => 21,
            DType::I4 => 22,
        }
    }

    /// Bytes per element (4-bit types round up to 1; strings count as 0).
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F64 | DType::I64 | DType::U64 | DType::C64 => 8,
            DType::C128 => 16,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz | DType::I8 | DType::U8 | DType::Bool => 1,
            DType::I4 | DType::U4 => 1,
            DType::Str => 0,
        }
    }

    /// True for real floating-point types (the ones that hold trainable parameters).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32
                | DType::F64
                | DType::F16
                | DType::BF16
                | DType::F8E4M3
                | DType::F8E5M2
                | DType::F8E4M3Fnuz
                | DType::F8E5M2Fnuz
        )
    }

    /// True for the 8-bit float types.
    pub fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz)
    }

    /// True for signed and unsigned integer types.
    pub fn is_int(self) -> bool {
        matches!(
            self,
            DType::I4
                | DType::U4
                | DType::I8
                | DType::I16
                | DType::I32
                | DType::I64
                | DType::U8
                | DType::U16
                | DType::U32
                | DType::U64
        )
    }

    /// Short lower-case name, as used in dumps (`f32`, `bf16`, `i64`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
            DType::F8E4M3Fnuz => "f8e4m3fnuz",
            DType::F8E5M2Fnuz => "f8e5m2fnuz",
            DType::I4 => "i4",
            DType::U4 => "u4",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
            DType::Str => "str",
            DType::C64 => "c64",
            DType::C128 => "c128",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
