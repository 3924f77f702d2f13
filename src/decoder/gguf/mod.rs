//! GGUF reader: header, metadata, tensor table and dequantization to f32 ([`super::blocks`]),
//! plus the Llama hyper-parameters a decoder needs ([`LlamaHyper`]).
//!
//! GGUF (llama.cpp's model format) is little-endian: a header (`"GGUF"`, version, tensor count,
//! metadata count), the metadata key/value pairs, the tensor infos (name, dims, ggml type, offset
//! into the data section), padding to `general.alignment` (default 32) and the tensor data.
//! Versions 2 and 3 share that layout and both are read; version 1 and big-endian files are not.
//!
//! **Dims are `ne0`-first**: `dims[0]` is the contiguous dimension (the length of a row), the
//! last one varies slowest. So `token_embd.weight` with dims `[576, 49152]` is 49,152 rows of
//! 576 values (one row per token), and a projection `blk.N.attn_q.weight` with dims
//! `[d_in, d_out]` holds `d_out` rows of `d_in` values: `y[o] = sum_i W[o * d_in + i] * x[i]`.
//!
//! Every input is validated: a truncated or corrupt file gives [`Error::Gguf`], never a panic.
//! Counts are checked against the bytes left before anything is allocated for them, and initial
//! capacities are capped, so memory stays proportional to what is actually in the file.
//!
//! ```no_run
//! use kvattn::decoder::gguf::{GgufFile, LlamaHyper};
//! # fn main() -> kvattn::Result<()> {
//! let file = GgufFile::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let hyper = LlamaHyper::from_gguf(&file)?;
//! let norm = file.tensor_f32("blk.0.attn_norm.weight")?; // F32, d_model values
//! assert_eq!(norm.len(), hyper.d_model);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

pub use super::blocks::{dequantize, dequantize_into};
use crate::rope::RopeStyle;
use crate::{Error, Result};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor's offset when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGUF tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays the reader accepts (real files use at most 2).
pub const MAX_ARRAY_DEPTH: usize = 16;

/// Most entries reserved up front for a count read from the file (a corrupt count must not
/// reserve more than the data behind it can fill).
const MAX_PREALLOC: usize = 1 << 16;

fn gguf_err(msg: impl Into<String>) -> Error {
    Error::Gguf(msg.into())
}

/// The type tag of a metadata value, as stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// `u8` (tag 0).
    U8,
    /// `i8` (tag 1).
    I8,
    /// `u16` (tag 2).
    U16,
    /// `i16` (tag 3).
    I16,
    /// `u32` (tag 4).
    U32,
    /// `i32` (tag 5).
    I32,
    /// `f32` (tag 6).
    F32,
    /// `bool`, one byte 0 or 1 (tag 7).
    Bool,
    /// UTF-8 string: `u64` length then bytes (tag 8).
    String,
    /// Array: element type tag, `u64` count, elements (tag 9).
    Array,
    /// `u64` (tag 10).
    U64,
    /// `i64` (tag 11).
    I64,
    /// `f64` (tag 12).
    F64,
}

impl ValueType {
    /// The type for a tag read from a file; `None` for unknown tags.
    pub fn from_tag(tag: u32) -> Option<Self> {
        Some(match tag {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// The tag written in the file.
    pub fn tag(self) -> u32 {
        match self {
            Self::U8 => 0,
            Self::I8 => 1,
            Self::U16 => 2,
            Self::I16 => 3,
            Self::U32 => 4,
            Self::I32 => 5,
            Self::F32 => 6,
            Self::Bool => 7,
            Self::String => 8,
            Self::Array => 9,
            Self::U64 => 10,
            Self::I64 => 11,
            Self::F64 => 12,
        }
    }

    /// The fewest bytes one value of this type takes in the file (used to bound counts).
    fn min_size(self) -> usize {
        match self {
            Self::U8 | Self::I8 | Self::Bool => 1,
            Self::U16 | Self::I16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 | Self::String => 8,
            Self::Array => 12,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        };
        f.write_str(name)
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f32`.
    F32(f32),
    /// `f64`.
    F64(f64),
    /// `bool`.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array (all elements of one type).
    Array(Array),
}

/// A metadata array: all elements share one type. Arrays may nest.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    /// `u8` elements.
    U8(Vec<u8>),
    /// `i8` elements.
    I8(Vec<i8>),
    /// `u16` elements.
    U16(Vec<u16>),
    /// `i16` elements.
    I16(Vec<i16>),
    /// `u32` elements.
    U32(Vec<u32>),
    /// `i32` elements.
    I32(Vec<i32>),
    /// `u64` elements.
    U64(Vec<u64>),
    /// `i64` elements.
    I64(Vec<i64>),
    /// `f32` elements.
    F32(Vec<f32>),
    /// `f64` elements.
    F64(Vec<f64>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// String elements.
    String(Vec<String>),
    /// Arrays of arrays.
    Array(Vec<Array>),
}

impl Array {
    /// The type of the elements.
    pub fn element_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F32(_) => ValueType::F32,
            Self::F64(_) => ValueType::F64,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array(_) => ValueType::Array,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::F64(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Value {
    /// The type tag of this value.
    pub fn value_type(&self) -> ValueType {
        match self {
            Self::U8(_) => ValueType::U8,
            Self::I8(_) => ValueType::I8,
            Self::U16(_) => ValueType::U16,
            Self::I16(_) => ValueType::I16,
            Self::U32(_) => ValueType::U32,
            Self::I32(_) => ValueType::I32,
            Self::U64(_) => ValueType::U64,
            Self::I64(_) => ValueType::I64,
            Self::F32(_) => ValueType::F32,
            Self::F64(_) => ValueType::F64,
            Self::Bool(_) => ValueType::Bool,
            Self::String(_) => ValueType::String,
            Self::Array(_) => ValueType::Array,
        }
    }

    /// The value as a signed 128-bit integer when it is any integer type (not bool, not float).
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Self::U8(v) => v.into(),
            Self::I8(v) => v.into(),
            Self::U16(v) => v.into(),
            Self::I16(v) => v.into(),
            Self::U32(v) => v.into(),
            Self::I32(v) => v.into(),
            Self::U64(v) => v.into(),
            Self::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as `f64` when it is `f32` or `f64`.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The string, when the value is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The array, when the value is one.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A ggml tensor type: how elements are stored (plain floats or quantized blocks).
///
/// Every type known to current ggml can be *read* (its size is known, so the tensor table is
/// checked); [`GgmlType::can_dequantize`] says which ones [`dequantize`] turns into f32.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float (id 0).
    F32,
    /// IEEE half (id 1).
    F16,
    /// Blocks of 32: f16 scale `d`, 16 bytes of nibbles; value = (nibble - 8) * d (id 2).
    Q4_0,
    /// Blocks of 32: f16 scale `d`, f16 min `m`, 16 bytes of nibbles; value = nibble * d + m (id 3).
    Q4_1,
    /// Blocks of 32, 5-bit (id 6).
    Q5_0,
    /// Blocks of 32, 5-bit with min (id 7).
    Q5_1,
    /// Blocks of 32: f16 scale `d`, 32 `i8`; value = q * d (id 8).
    Q8_0,
    /// Blocks of 32, 8-bit with sum (id 9).
    Q8_1,
    /// K-quant, blocks of 256 (id 10).
    Q2_K,
    /// K-quant, blocks of 256 (id 11).
    Q3_K,
    /// K-quant, blocks of 256 (id 12).
    Q4_K,
    /// K-quant, blocks of 256 (id 13).
    Q5_K,
    /// K-quant, blocks of 256 (id 14).
    Q6_K,
    /// K-quant, blocks of 256 (id 15).
    Q8_K,
    /// I-quant (id 16).
    IQ2_XXS,
    /// I-quant (id 17).
    IQ2_XS,
    /// I-quant (id 18).
    IQ3_XXS,
    /// I-quant (id 19).
    IQ1_S,
    /// I-quant, blocks of 32 (id 20).
    IQ4_NL,
    /// I-quant (id 21).
    IQ3_S,
    /// I-quant (id 22).
    IQ2_S,
    /// I-quant (id 23).
    IQ4_XS,
    /// 8-bit integer (id 24).
    I8,
    /// 16-bit integer (id 25).
    I16,
    /// 32-bit integer (id 26).
    I32,
    /// 64-bit integer (id 27).
    I64,
    /// 64-bit float (id 28).
    F64,
    /// I-quant (id 29).
    IQ1_M,
    /// bfloat16 (id 30).
    BF16,
    /// Ternary quant (id 34).
    TQ1_0,
    /// Ternary quant (id 35).
    TQ2_0,
    /// Microscaling FP4, blocks of 32 (id 39).
    MXFP4,
}

impl GgmlType {
    /// The type for an id read from a file; `None` for ids ggml does not (or no longer) define.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2_K,
            11 => Self::Q3_K,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            15 => Self::Q8_K,
            16 => Self::IQ2_XXS,
            17 => Self::IQ2_XS,
            18 => Self::IQ3_XXS,
            19 => Self::IQ1_S,
            20 => Self::IQ4_NL,
            21 => Self::IQ3_S,
            22 => Self::IQ2_S,
            23 => Self::IQ4_XS,
            24 => Self::I8,
            25 => Self::I16,
            26 => Self::I32,
            27 => Self::I64,
            28 => Self::F64,
            29 => Self::IQ1_M,
            30 => Self::BF16,
            34 => Self::TQ1_0,
            35 => Self::TQ2_0,
            39 => Self::MXFP4,
            _ => return None,
        })
    }

    /// The id written in the file.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q8_1 => 9,
            Self::Q2_K => 10,
            Self::Q3_K => 11,
            Self::Q4_K => 12,
            Self::Q5_K => 13,
            Self::Q6_K => 14,
            Self::Q8_K => 15,
            Self::IQ2_XXS => 16,
            Self::IQ2_XS => 17,
            Self::IQ3_XXS => 18,
            Self::IQ1_S => 19,
            Self::IQ4_NL => 20,
            Self::IQ3_S => 21,
            Self::IQ2_S => 22,
            Self::IQ4_XS => 23,
            Self::I8 => 24,
            Self::I16 => 25,
            Self::I32 => 26,
            Self::I64 => 27,
            Self::F64 => 28,
            Self::IQ1_M => 29,
            Self::BF16 => 30,
            Self::TQ1_0 => 34,
            Self::TQ2_0 => 35,
            Self::MXFP4 => 39,
        }
    }

    /// Elements per block (1 for plain types). A row (`dims[0]`) is a whole number of blocks.
    pub fn block_size(self) -> u64 {
        match self {
            Self::F32
            | Self::F16
            | Self::BF16
            | Self::F64
            | Self::I8
            | Self::I16
            | Self::I32
            | Self::I64 => 1,
            Self::Q4_0
            | Self::Q4_1
            | Self::Q5_0
            | Self::Q5_1
            | Self::Q8_0
            | Self::Q8_1
            | Self::IQ4_NL
            | Self::MXFP4 => 32,
            _ => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        match self {
            Self::F32 | Self::I32 => 4,
            Self::F16 | Self::BF16 | Self::I16 => 2,
            Self::F64 | Self::I64 => 8,
            Self::I8 => 1,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q8_1 => 36,
            Self::Q2_K => 84,
            Self::Q3_K => 110,
            Self::Q4_K => 144,
            Self::Q5_K => 176,
            Self::Q6_K => 210,
            Self::Q8_K => 292,
            Self::IQ2_XXS => 66,
            Self::IQ2_XS => 74,
            Self::IQ3_XXS => 98,
            Self::IQ1_S => 50,
            Self::IQ4_NL => 18,
            Self::IQ3_S => 110,
            Self::IQ2_S => 82,
            Self::IQ4_XS => 136,
            Self::IQ1_M => 56,
            Self::TQ1_0 => 54,
            Self::TQ2_0 => 66,
            Self::MXFP4 => 17,
        }
    }

    /// ggml's name for the type (`"Q4_1"`, `"F32"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q2_K => "Q2_K",
            Self::Q3_K => "Q3_K",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::Q8_K => "Q8_K",
            Self::IQ2_XXS => "IQ2_XXS",
            Self::IQ2_XS => "IQ2_XS",
            Self::IQ3_XXS => "IQ3_XXS",
            Self::IQ1_S => "IQ1_S",
            Self::IQ4_NL => "IQ4_NL",
            Self::IQ3_S => "IQ3_S",
            Self::IQ2_S => "IQ2_S",
            Self::IQ4_XS => "IQ4_XS",
            Self::I8 => "I8",
            Self::I16 => "I16",
            Self::I32 => "I32",
            Self::I64 => "I64",
            Self::F64 => "F64",
            Self::IQ1_M => "IQ1_M",
            Self::BF16 => "BF16",
            Self::TQ1_0 => "TQ1_0",
            Self::TQ2_0 => "TQ2_0",
            Self::MXFP4 => "MXFP4",
        }
    }

    /// Whether [`dequantize`] supports this type (one of [`super::blocks::SUPPORTED`]: F32,
    /// F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
    pub fn can_dequantize(self) -> bool {
        super::blocks::SUPPORTED.contains(&self)
    }

    /// Bytes that `n_elements` elements take, or an error when `n_elements` is not a whole
    /// number of blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Result<u64> {
        let bs = self.block_size();
        if n_elements % bs != 0 {
            return Err(gguf_err(format!(
                "{n_elements} elements of {self} are not a whole number of blocks of {bs}"
            )));
        }
        (n_elements / bs)
            .checked_mul(self.block_bytes())
            .ok_or_else(|| gguf_err(format!("{n_elements} elements of {self}: size overflows")))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One entry of the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, `ne0` first: `dims[0]` is the contiguous one (row length), the last varies
    /// slowest. `[576, 49152]` is 49,152 rows of 576.
    pub dims: Vec<u64>,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Byte offset of the data from the start of the data section (a multiple of the alignment).
    pub offset: u64,
    /// Product of `dims`.
    pub n_elements: u64,
    /// Bytes of data.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Elements per row: `dims[0]`.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(0)
    }

    /// Number of rows: the product of `dims[1..]` (1 for a vector).
    pub fn n_rows(&self) -> u64 {
        // The product of all dims fits in u64 (checked at parse), so this one does too.
        self.dims.iter().skip(1).product()
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> u64 {
        self.row_len() / self.ggml_type.block_size() * self.ggml_type.block_bytes()
    }
}

/// A parsed GGUF file held in memory: metadata, tensor table and the raw bytes.
#[derive(Clone)]
pub struct GgufFile {
    bytes: FileBytes,
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("bytes", &self.bytes.len())
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

/// Where a file's bytes live: mapped from disk ([`GgufFile::open`]) or in memory
/// ([`GgufFile::parse`]); shared by clones.
#[derive(Clone)]
enum FileBytes {
    Owned(Arc<Vec<u8>>),
    #[cfg(not(target_arch = "wasm32"))]
    Mapped(Arc<memmap2::Mmap>),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            #[cfg(not(target_arch = "wasm32"))]
            Self::Mapped(m) => m,
        }
    }
}

/// Bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(gguf_err(format!(
                "truncated file: {what} needs {n} bytes at offset {}, only {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each taking at least `min_size` bytes: refused when they cannot fit in
    /// what is left of the file (so no allocation exceeds the file size).
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = (self.remaining() / min_size.max(1)) as u64;
        if n > fits {
            return Err(gguf_err(format!(
                "{what} {n} at offset {at} is impossible: only {} bytes left in the file",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.count(1, &format!("{what} length"))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| gguf_err(format!("{what} at offset {at} is not valid UTF-8: {e}")))
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType> {
        let at = self.pos;
        let tag = self.u32(what)?;
        ValueType::from_tag(tag)
            .ok_or_else(|| gguf_err(format!("{what}: unknown value type {tag} at offset {at}")))
    }

    fn value(&mut self, ty: ValueType, depth: usize, what: &str) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8(what)?),
            ValueType::I8 => Value::I8(self.u8(what)? as i8),
            ValueType::U16 => Value::U16(self.u16(what)?),
            ValueType::I16 => Value::I16(self.u16(what)? as i16),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(self.u32(what)? as i32),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(self.u64(what)? as i64),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32(what)?)),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64(what)?)),
            ValueType::Bool => Value::Bool(self.bool(what)?),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array_value(depth + 1, what)?),
        })
    }

    fn bool(&mut self, what: &str) -> Result<bool> {
        let at = self.pos;
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(gguf_err(format!(
                "{what}: bool byte {b} at offset {at} is not 0 or 1"
            ))),
        }
    }

    fn array_value(&mut self, depth: usize, what: &str) -> Result<Array> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(gguf_err(format!(
                "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
            )));
        }
        let ty = self.value_type(what)?;
        let n = self.count(ty.min_size(), &format!("{what} element count"))?;
        macro_rules! fixed {
            ($variant:ident, $read:expr) => {{
                let mut v = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    v.push($read);
                }
                Array::$variant(v)
            }};
        }
        Ok(match ty {
            ValueType::U8 => Array::U8(self.take(n, what)?.to_vec()),
            ValueType::I8 => Array::I8(self.take(n, what)?.iter().map(|&b| b as i8).collect()),
            ValueType::U16 => fixed!(U16, self.u16(what)?),
            ValueType::I16 => fixed!(I16, self.u16(what)? as i16),
            ValueType::U32 => fixed!(U32, self.u32(what)?),
            ValueType::I32 => fixed!(I32, self.u32(what)? as i32),
            ValueType::U64 => fixed!(U64, self.u64(what)?),
            ValueType::I64 => fixed!(I64, self.u64(what)? as i64),
            ValueType::F32 => fixed!(F32, f32::from_bits(self.u32(what)?)),
            ValueType::F64 => fixed!(F64, f64::from_bits(self.u64(what)?)),
            ValueType::Bool => fixed!(Bool, self.bool(what)?),
            ValueType::String => fixed!(String, self.string(what)?),
            ValueType::Array => fixed!(Array, self.array_value(depth + 1, what)?),
        })
    }
}

fn align_up(x: u64, align: u64) -> Option<u64> {
    x.checked_add(align - 1).map(|v| v / align * align)
}

impl GgufFile {
    /// Maps the file at `path` into memory and parses its header, metadata and tensor table.
    /// The tensor data is not read here: the operating system reads a tensor's pages when the
    /// tensor is used ([`GgufFile::tensor_data`]), so opening a file costs its header, not its
    /// size, and memory holds only what was touched.
    ///
    /// The file must not be modified or truncated while the returned value lives (the usual
    /// contract of a memory-mapped file; model files are written once).
    ///
    /// # Errors
    /// [`Error::Io`] (naming `path`, with the I/O error as its source) when the file cannot be
    /// opened or mapped; [`Error::Gguf`] (naming `path`) when it is not a valid GGUF file.
    ///
    /// Not on the web (no files there): use [`GgufFile::parse`] on the fetched bytes.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            what: format!("GGUF: cannot read {}", path.display()),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let bytes = if len == 0 {
            FileBytes::Owned(Arc::new(Vec::new()))
        } else {
            // SAFETY: the mapping is read-only and private to this value; the documented
            // contract is that the file is not modified while it is mapped.
            FileBytes::Mapped(Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?))
        };
        Self::parse_bytes(bytes).map_err(|e| match e {
            Error::Gguf(m) => gguf_err(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Parses a whole GGUF file held in memory. Checks the header, every metadata value, the
    /// tensor table (dims, types, offsets and sizes inside the data section, unique names) and
    /// the alignment.
    pub fn parse(bytes: Vec<u8>) -> Result<Self> {
        Self::parse_bytes(FileBytes::Owned(Arc::new(bytes)))
    }

    fn parse_bytes(bytes: FileBytes) -> Result<Self> {
        let mut c = Cursor {
            buf: &bytes,
            pos: 0,
        };
        let magic = c.array::<4>("magic")?;
        if magic != GGUF_MAGIC {
            return Err(gguf_err(format!(
                "not a GGUF file: magic {magic:02x?}, expected \"GGUF\""
            )));
        }
        let version = c.u32("version")?;
        match version {
            2 | 3 => {}
            1 => return Err(gguf_err("GGUF version 1 is not supported (only 2 and 3)")),
            v if (1..=3).contains(&v.swap_bytes()) => {
                return Err(gguf_err(format!(
                    "big-endian GGUF (version {}) is not supported",
                    v.swap_bytes()
                )))
            }
            v => {
                return Err(gguf_err(format!(
                    "GGUF version {v} is not supported (only 2 and 3)"
                )))
            }
        }
        // Each tensor info takes at least 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 + 8.
        let n_tensors = c.count(32, "tensor count")?;
        let n_kv = c.count(8 + 4 + 1, "metadata count")?;

        let mut metadata = Vec::with_capacity(n_kv.min(MAX_PREALLOC));
        let mut key_index = HashMap::with_capacity(n_kv.min(MAX_PREALLOC));
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key {i}"))?;
            if key.is_empty() {
                return Err(gguf_err(format!("metadata key {i} is empty")));
            }
            let ty = c.value_type(&format!("metadata {key}"))?;
            let value = c.value(ty, 0, &format!("metadata {key}"))?;
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(gguf_err(format!("metadata key {key} appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match key_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                match v.as_integer() {
                    Some(a) if a > 0 && a <= u32::MAX as i128 && (a as u64).is_power_of_two() => {
                        a as u64
                    }
                    _ => {
                        return Err(gguf_err(format!(
                            "general.alignment must be a power of two that fits in u32, got {v:?}"
                        )))
                    }
                }
            }
        };

        let mut infos = Vec::with_capacity(n_tensors.min(MAX_PREALLOC));
        let mut tensor_index = HashMap::with_capacity(n_tensors.min(MAX_PREALLOC));
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor {i} name"))?;
            let n_dims = c.u32(&format!("tensor {name} n_dims"))? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(gguf_err(format!(
                    "tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims);
            // The product of the non-zero dims must fit too (so `n_rows` cannot overflow when
            // a zero dim makes the element count 0).
            let mut nonzero_product: u64 = 1;
            for _ in 0..n_dims {
                let d = c.u64(&format!("tensor {name} dims"))?;
                if d > i64::MAX as u64 {
                    return Err(gguf_err(format!(
                        "tensor {name}: dimension {d} is too large"
                    )));
                }
                nonzero_product = nonzero_product
                    .checked_mul(d.max(1))
                    .filter(|&n| n <= i64::MAX as u64)
                    .ok_or_else(|| {
                        gguf_err(format!(
                            "tensor {name}: element count overflows ({dims:?} x {d})"
                        ))
                    })?;
                dims.push(d);
            }
            let n_elements: u64 = if dims.contains(&0) {
                0
            } else {
                nonzero_product
            };
            let type_id = c.u32(&format!("tensor {name} type"))?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
                gguf_err(format!("tensor {name} has unknown ggml type id {type_id}"))
            })?;
            let offset = c.u64(&format!("tensor {name} offset"))?;
            if dims[0] % ggml_type.block_size() != 0 {
                return Err(gguf_err(format!(
                    "tensor {name}: row length {} is not a multiple of the {ggml_type} block size {}",
                    dims[0],
                    ggml_type.block_size()
                )));
            }
            let n_bytes = ggml_type
                .bytes_for(n_elements)
                .map_err(|e| gguf_err(format!("tensor {name}: {e}")))?;
            if offset % alignment != 0 {
                return Err(gguf_err(format!(
                    "tensor {name}: offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            if tensor_index.insert(name.clone(), infos.len()).is_some() {
                return Err(gguf_err(format!("tensor {name} appears twice")));
            }
            infos.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
                n_elements,
                n_bytes,
            });
        }

        let file_len = bytes.len() as u64;
        let data_offset = align_up(c.pos as u64, alignment)
            .ok_or_else(|| gguf_err("data section offset overflows"))?;
        if !infos.is_empty() && data_offset > file_len {
            return Err(gguf_err(format!(
                "truncated file: the data section starts at {data_offset}, past the end ({file_len})"
            )));
        }
        let data_len = file_len.saturating_sub(data_offset);
        for t in &infos {
            let end = t.offset.checked_add(t.n_bytes);
            if end.is_none_or(|end| end > data_len) {
                return Err(gguf_err(format!(
                    "tensor {} ({} bytes at data offset {}) runs past the end of the data section \
                     ({data_len} bytes): truncated or corrupt file",
                    t.name, t.n_bytes, t.offset
                )));
            }
        }

        Ok(Self {
            bytes,
            version,
            metadata,
            key_index,
            tensors: infos,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of the data section and tensor offsets (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| gguf_err(format!("metadata key {key} is missing")))
    }

    fn wrong_type(key: &str, want: &str, v: &Value) -> Error {
        let got = match v {
            Value::Array(a) => format!("array of {}", a.element_type()),
            v => v.value_type().to_string(),
        };
        gguf_err(format!("metadata {key}: expected {want}, found {got}"))
    }

    fn integer(key: &str, v: &Value, want: &str, min: i128, max: i128) -> Result<i128> {
        let n = v
            .as_integer()
            .ok_or_else(|| Self::wrong_type(key, want, v))?;
        if n < min || n > max {
            return Err(gguf_err(format!(
                "metadata {key} = {n} does not fit in {want}"
            )));
        }
        Ok(n)
    }

    /// A metadata integer as `u32`. Any integer type is accepted when the value fits (writers
    /// disagree on u32/i32/u64 for counts).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        Ok(Self::integer(key, self.require(key)?, "u32", 0, u32::MAX.into())? as u32)
    }

    /// [`GgufFile::get_u32`] for an optional key: `Ok(None)` when absent, an error when present
    /// with the wrong type.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>> {
        self.get(key)
            .map(|v| Self::integer(key, v, "u32", 0, u32::MAX.into()).map(|n| n as u32))
            .transpose()
    }

    /// A metadata integer as `u64` (any integer type that fits).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        Ok(Self::integer(key, self.require(key)?, "u64", 0, u64::MAX.into())? as u64)
    }

    /// A metadata integer as `i64` (any integer type that fits).
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        Ok(Self::integer(
            key,
            self.require(key)?,
            "i64",
            i64::MIN.into(),
            i64::MAX.into(),
        )? as i64)
    }

    /// A metadata float as `f32` (`f32`, or `f64` converted).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_float()
            .map(|x| x as f32)
            .ok_or_else(|| Self::wrong_type(key, "f32", v))
    }

    /// [`GgufFile::get_f32`] for an optional key.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>> {
        self.get(key)
            .map(|v| {
                v.as_float()
                    .map(|x| x as f32)
                    .ok_or_else(|| Self::wrong_type(key, "f32", v))
            })
            .transpose()
    }

    /// A metadata bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(Self::wrong_type(key, "bool", v)),
        }
    }

    /// [`GgufFile::get_bool`] for an optional key.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong_type(key, "bool", v)),
        }
    }

    /// A metadata string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong_type(key, "string", v))
    }

    /// [`GgufFile::get_str`] for an optional key.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| Self::wrong_type(key, "string", v)))
            .transpose()
    }

    /// A metadata array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        let v = self.require(key)?;
        v.as_array()
            .ok_or_else(|| Self::wrong_type(key, "array", v))
    }

    /// A metadata array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.get_array(key)? {
            Array::String(v) => Ok(v),
            _ => Err(Self::wrong_type(key, "array of string", self.require(key)?)),
        }
    }

    /// A metadata array of `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        match self.get_array(key)? {
            Array::I32(v) => Ok(v),
            _ => Err(Self::wrong_type(key, "array of i32", self.require(key)?)),
        }
    }

    /// A metadata array of `u32`.
    pub fn get_u32_array(&self, key: &str) -> Result<&[u32]> {
        match self.get_array(key)? {
            Array::U32(v) => Ok(v),
            _ => Err(Self::wrong_type(key, "array of u32", self.require(key)?)),
        }
    }

    /// A metadata array of `f32`.
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        match self.get_array(key)? {
            Array::F32(v) => Ok(v),
            _ => Err(Self::wrong_type(key, "array of f32", self.require(key)?)),
        }
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name)
            .ok_or_else(|| gguf_err(format!("tensor {name} is missing")))
    }

    /// The raw bytes of a tensor as stored (for uploading quantized weights as they are).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let t = self.require_tensor(name)?;
        // In range: checked at parse.
        let start = (self.data_offset + t.offset) as usize;
        Ok(&self.bytes[start..start + t.n_bytes as usize])
    }

    /// The whole tensor dequantized to f32, in storage order (`dims[0]` fastest).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.require_tensor(name)?;
        let n = usize::try_from(t.n_elements)
            .map_err(|_| gguf_err(format!("tensor {name} is too large for this machine")))?;
        dequantize(t.ggml_type, self.tensor_data(name)?, n)
            .map_err(|e| gguf_err(format!("tensor {name}: {}", strip(e))))
    }

    /// Rows `rows` of a tensor dequantized to f32 (`rows.len() * row_len` values): for example
    /// one token's embedding from `token_embd.weight`.
    pub fn tensor_rows_f32(&self, name: &str, rows: Range<u64>) -> Result<Vec<f32>> {
        let t = self.require_tensor(name)?;
        if rows.start > rows.end || rows.end > t.n_rows() {
            return Err(gguf_err(format!(
                "tensor {name}: rows {rows:?} out of range (it has {} rows)",
                t.n_rows()
            )));
        }
        let data = self.tensor_data(name)?;
        let rb = t.row_bytes() as usize;
        let bytes = &data[rows.start as usize * rb..rows.end as usize * rb];
        let n = ((rows.end - rows.start) * t.row_len()) as usize;
        dequantize(t.ggml_type, bytes, n)
            .map_err(|e| gguf_err(format!("tensor {name}: {}", strip(e))))
    }
}

fn strip(e: Error) -> String {
    match e {
        Error::Gguf(m) => m,
        other => other.to_string(),
    }
}

/// Architectures whose GGUF keys and tensors follow the Llama layout (`{arch}.block_count`, ...):
/// `llama` (Llama 2 and 3.x, SmolLM, Mistral) and `qwen2` (Qwen2, Qwen2.5: biases on the Q, K
/// and V products, NeoX-style RoPE).
pub const LLAMA_ARCHITECTURES: &[&str] = &["llama", "qwen2"];

/// Hyper-parameters of a Llama-family model, read from GGUF metadata.
///
/// Note for the forward pass: for `llama` files, llama.cpp's converter permutes the rows of
/// `attn_q` and `attn_k` so that each rotary pair is two *adjacent* elements: they take GPT-J
/// style RoPE ([`crate::rope::RopeStyle::GptJ`]). It leaves `qwen2` rows as Hugging Face has
/// them: NeoX style ([`LlamaHyper::rope_style`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaHyper {
    /// `general.architecture`, one of [`LLAMA_ARCHITECTURES`].
    pub architecture: String,
    /// Transformer blocks (`{arch}.block_count`).
    pub n_layers: usize,
    /// Hidden size (`{arch}.embedding_length`).
    pub d_model: usize,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_heads: usize,
    /// Key/value heads (`{arch}.attention.head_count_kv`, default `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head dimension (`{arch}.attention.key_length`, else `d_model / n_heads`).
    pub head_dim: usize,
    /// Rotated dimensions per head (`{arch}.rope.dimension_count`, default `head_dim`).
    pub rope_dim: usize,
    /// Feed-forward inner size (`{arch}.feed_forward_length`).
    pub ffn_dim: usize,
    /// RoPE theta (`{arch}.rope.freq_base`, default 10000).
    pub rope_base: f32,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`, default 1e-5).
    pub rms_eps: f32,
    /// Vocabulary size (`{arch}.vocab_size`, else the tokenizer's token count, else
    /// `token_embd.weight`'s rows).
    pub vocab_size: usize,
    /// Training context length (`{arch}.context_length`).
    pub context_length: usize,
    /// True when there is no `output.weight`: the output projection is `token_embd.weight`.
    pub tied_embeddings: bool,
    /// True when the Q, K and V products have biases (`blk.N.attn_q.bias`, `attn_k.bias`,
    /// `attn_v.bias`): always for `qwen2`; for `llama` when the file has `blk.0.attn_q.bias`
    /// (llama.cpp accepts them there too). Then every layer must have all three.
    pub qkv_bias: bool,
    /// True when a `llama` file has `rope_freqs.weight` (`[rope_dim / 2]`, Llama 3.1 and
    /// 3.2): RoPE pair `i`'s frequency is divided by its factor `i`.
    pub rope_freqs: bool,
}

impl LlamaHyper {
    /// Reads and checks the hyper-parameters: the architecture is one of
    /// [`LLAMA_ARCHITECTURES`], sizes are positive, `n_heads` is a multiple of `n_kv_heads`,
    /// `head_dim` divides evenly, `rope_dim` is even and at most `head_dim`, epsilon and theta
    /// are finite and positive, RoPE is not scaled ([`check_rope_scaling`]), and
    /// `token_embd.weight` (when present) is `[d_model, vocab]`.
    /// [`LlamaHyper::check_tensors`] checks the rest of the tensor table.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.get_str("general.architecture")?;
        if !LLAMA_ARCHITECTURES.contains(&arch) {
            return Err(gguf_err(format!(
                "architecture {arch:?} is not supported (supported: {LLAMA_ARCHITECTURES:?})"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let positive = |k: &str| -> Result<usize> {
            let v = file.get_u32(&key(k))?;
            if v == 0 {
                return Err(gguf_err(format!("metadata {} must be positive", key(k))));
            }
            Ok(v as usize)
        };
        let n_layers = positive("block_count")?;
        let d_model = positive("embedding_length")?;
        let ffn_dim = positive("feed_forward_length")?;
        let n_heads = positive("attention.head_count")?;
        let context_length = positive("context_length")?;
        let n_kv_heads = match file.get_u32_opt(&key("attention.head_count_kv"))? {
            None => n_heads,
            Some(0) => {
                return Err(gguf_err(format!(
                    "metadata {} must be positive",
                    key("attention.head_count_kv")
                )))
            }
            Some(v) => v as usize,
        };
        if n_heads % n_kv_heads != 0 {
            return Err(gguf_err(format!(
                "{n_heads} query heads are not a multiple of {n_kv_heads} key/value heads"
            )));
        }
        let head_dim = match file.get_u32_opt(&key("attention.key_length"))? {
            Some(v) if v > 0 => v as usize,
            Some(_) => return Err(gguf_err("attention.key_length must be positive")),
            None => {
                if d_model % n_heads != 0 {
                    return Err(gguf_err(format!(
                        "embedding_length {d_model} is not a multiple of head_count {n_heads}"
                    )));
                }
                d_model / n_heads
            }
        };
        if let Some(v) = file.get_u32_opt(&key("attention.value_length"))? {
            if v as usize != head_dim {
                return Err(gguf_err(format!(
                    "attention.value_length {v} differs from the key length {head_dim}: not supported"
                )));
            }
        }
        let rope_dim = file
            .get_u32_opt(&key("rope.dimension_count"))?
            .map_or(head_dim, |v| v as usize);
        if rope_dim == 0 || rope_dim % 2 != 0 || rope_dim > head_dim {
            return Err(gguf_err(format!(
                "rope.dimension_count {rope_dim} must be even, positive and at most head_dim {head_dim}"
            )));
        }
        let rope_base = file.get_f32_opt(&key("rope.freq_base"))?.unwrap_or(10000.0);
        if !(rope_base.is_finite() && rope_base > 0.0) {
            return Err(gguf_err(format!(
                "rope.freq_base {rope_base} must be finite and positive"
            )));
        }
        check_rope_scaling(file, arch)?;
        let rms_eps = file
            .get_f32_opt(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5);
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            return Err(gguf_err(format!(
                "attention.layer_norm_rms_epsilon {rms_eps} must be finite and positive"
            )));
        }
        let embd = file.tensor("token_embd.weight");
        let vocab_size = match file.get_u32_opt(&key("vocab_size"))? {
            Some(v) => v as usize,
            None => match file.get("tokenizer.ggml.tokens").and_then(Value::as_array) {
                Some(a) => a.len(),
                None => match embd {
                    Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
                    _ => return Err(gguf_err("cannot tell the vocabulary size: no vocab_size key, no tokens, no token_embd.weight")),
                },
            },
        };
        if vocab_size == 0 {
            return Err(gguf_err("vocabulary size is 0"));
        }
        if let Some(t) = embd {
            if t.dims != [d_model as u64, vocab_size as u64] {
                return Err(gguf_err(format!(
                    "token_embd.weight has dims {:?}, expected [{d_model}, {vocab_size}]",
                    t.dims
                )));
            }
        }
        Ok(Self {
            architecture: arch.to_string(),
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            ffn_dim,
            rope_base,
            rms_eps,
            vocab_size,
            context_length,
            tied_embeddings: file.tensor("output.weight").is_none(),
            qkv_bias: arch == "qwen2" || file.tensor("blk.0.attn_q.bias").is_some(),
            rope_freqs: arch == "llama" && file.tensor("rope_freqs.weight").is_some(),
        })
    }

    /// The RoPE pairing the file's Q and K rows need: GPT-J for `llama` (rows permuted by the
    /// converter), NeoX for `qwen2`.
    pub fn rope_style(&self) -> RopeStyle {
        if self.architecture == "qwen2" {
            RopeStyle::NeoX
        } else {
            RopeStyle::GptJ
        }
    }

    /// The tensors a Llama model needs and their dims (`ne0` first): `token_embd.weight`,
    /// `output_norm.weight`, `output.weight` unless tied, and per block `attn_norm`, `attn_q`,
    /// `attn_k`, `attn_v`, `attn_output`, `ffn_norm`, `ffn_gate`, `ffn_up`, `ffn_down` (each
    /// `.weight`), with `attn_q.bias`, `attn_k.bias` and `attn_v.bias` when
    /// [`qkv_bias`](Self::qkv_bias), and `rope_freqs.weight` when
    /// [`rope_freqs`](Self::rope_freqs).
    pub fn expected_tensors(&self) -> Vec<(String, Vec<u64>)> {
        let d = self.d_model as u64;
        let q = (self.n_heads * self.head_dim) as u64;
        let kv = (self.n_kv_heads * self.head_dim) as u64;
        let f = self.ffn_dim as u64;
        let v = self.vocab_size as u64;
        let mut out = vec![
            ("token_embd.weight".to_string(), vec![d, v]),
            ("output_norm.weight".to_string(), vec![d]),
        ];
        if !self.tied_embeddings {
            out.push(("output.weight".to_string(), vec![d, v]));
        }
        if self.rope_freqs {
            out.push((
                "rope_freqs.weight".to_string(),
                vec![self.rope_dim as u64 / 2],
            ));
        }
        for i in 0..self.n_layers {
            for (name, dims) in [
                ("attn_norm", vec![d]),
                ("attn_q", vec![d, q]),
                ("attn_k", vec![d, kv]),
                ("attn_v", vec![d, kv]),
                ("attn_output", vec![q, d]),
                ("ffn_norm", vec![d]),
                ("ffn_gate", vec![d, f]),
                ("ffn_up", vec![d, f]),
                ("ffn_down", vec![f, d]),
            ] {
                out.push((format!("blk.{i}.{name}.weight"), dims));
            }
            if self.qkv_bias {
                for (name, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                    out.push((format!("blk.{i}.{name}.bias"), vec![n]));
                }
            }
        }
        out
    }

    /// Checks that every tensor of [`LlamaHyper::expected_tensors`] is present with its dims
    /// and a type kvattn reads, and that the file has no other tensor: one the forward pass
    /// would ignore (an `attn_output.bias`, a bias of another layer, `rope_freqs.weight` in a
    /// `qwen2` file) is refused by name rather than giving wrong logits.
    pub fn check_tensors(&self, file: &GgufFile) -> Result<()> {
        let expected = self.expected_tensors();
        if let Some(t) = file
            .tensors()
            .iter()
            .find(|t| !expected.iter().any(|(name, _)| *name == t.name))
        {
            let why = if t.name == "rope_freqs.weight" {
                " (per-dimension RoPE frequency factors, Llama 3.1 style RoPE scaling)"
            } else {
                ""
            };
            return Err(gguf_err(format!(
                "tensor {}{why} is not supported for architecture {:?}: kvattn's decoder \
                 would ignore it",
                t.name, self.architecture
            )));
        }
        for (name, dims) in expected {
            let t = file
                .tensor(&name)
                .ok_or_else(|| gguf_err(format!("tensor {name} is missing")))?;
            if t.dims != dims {
                return Err(gguf_err(format!(
                    "tensor {name} has dims {:?}, expected {dims:?}",
                    t.dims
                )));
            }
            if !t.ggml_type.can_dequantize() {
                return Err(gguf_err(format!(
                    "tensor {name} is of ggml type {} (id {}), which kvattn does not read \
                     (it reads {})",
                    t.ggml_type,
                    t.ggml_type.id(),
                    super::blocks::SUPPORTED.map(GgmlType::name).join(", ")
                )));
            }
        }
        Ok(())
    }
}

/// Refuses scaled RoPE, which the decoder does not implement: a `{arch}.rope.scaling.type`
/// other than `none` (or `linear` with a factor of 1), a `{arch}.rope.scaling.factor` or
/// `{arch}.rope.scale_linear` other than 1 (0 counts as unset, as in llama.cpp); the error
/// names the key and its value.
pub fn check_rope_scaling(file: &GgufFile, arch: &str) -> Result<()> {
    let unscaled = |k: &str| -> Result<bool> {
        Ok(file
            .get_f32_opt(&format!("{arch}.{k}"))?
            .is_none_or(|v| v == 0.0 || v == 1.0))
    };
    for k in ["rope.scaling.factor", "rope.scale_linear"] {
        if !unscaled(k)? {
            let v = file.get_f32(&format!("{arch}.{k}"))?;
            return Err(gguf_err(format!(
                "RoPE scaling ({arch}.{k} = {v}) is not supported"
            )));
        }
    }
    match file.get_str_opt(&format!("{arch}.rope.scaling.type"))? {
        None | Some("none") | Some("linear") => Ok(()),
        Some(other) => Err(gguf_err(format!(
            "RoPE scaling type {other:?} ({arch}.rope.scaling.type) is not supported"
        ))),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use half::{bf16, f16};

    /// A minimal GGUF writer for tests.
    #[derive(Default)]
    pub(crate) struct Writer {
        pub version: u32,
        pub alignment: u64,
        pub kv: Vec<u8>,
        pub n_kv: u64,
        pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    pub(crate) fn put_str(b: &mut Vec<u8>, s: &str) {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }

    impl Writer {
        pub fn new() -> Self {
            Self {
                version: 3,
                alignment: DEFAULT_ALIGNMENT,
                ..Default::default()
            }
        }

        /// A key with an already encoded value (type tag + payload).
        pub fn raw(&mut self, key: &str, tag: u32, payload: &[u8]) -> &mut Self {
            put_str(&mut self.kv, key);
            self.kv.extend_from_slice(&tag.to_le_bytes());
            self.kv.extend_from_slice(payload);
            self.n_kv += 1;
            self
        }
        pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.raw(key, 4, &v.to_le_bytes())
        }
        pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.raw(key, 6, &v.to_le_bytes())
        }
        pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
            self.raw(key, 7, &[v as u8])
        }
        pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
            let mut p = Vec::new();
            put_str(&mut p, v);
            self.raw(key, 8, &p)
        }
        pub fn str_array(&mut self, key: &str, v: &[&str]) -> &mut Self {
            let mut p = 8u32.to_le_bytes().to_vec();
            p.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for s in v {
                put_str(&mut p, s);
            }
            self.raw(key, 9, &p)
        }
        pub fn i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
            let mut p = 5u32.to_le_bytes().to_vec();
            p.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v {
                p.extend_from_slice(&x.to_le_bytes());
            }
            self.raw(key, 9, &p)
        }
        pub fn f32_array(&mut self, key: &str, v: &[f32]) -> &mut Self {
            let mut p = 6u32.to_le_bytes().to_vec();
            p.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v {
                p.extend_from_slice(&x.to_le_bytes());
            }
            self.raw(key, 9, &p)
        }
        pub fn tensor(
            &mut self,
            name: &str,
            dims: &[u64],
            ty: GgmlType,
            data: Vec<u8>,
        ) -> &mut Self {
            self.tensors
                .push((name.to_string(), dims.to_vec(), ty.id(), data));
            self
        }

        pub fn build(&self) -> Vec<u8> {
            let mut b = b"GGUF".to_vec();
            b.extend_from_slice(&self.version.to_le_bytes());
            b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            b.extend_from_slice(&self.n_kv.to_le_bytes());
            b.extend_from_slice(&self.kv);
            let mut offset = 0u64;
            let mut offsets = Vec::new();
            for (name, dims, ty, data) in &self.tensors {
                put_str(&mut b, name);
                b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
                for d in dims {
                    b.extend_from_slice(&d.to_le_bytes());
                }
                b.extend_from_slice(&ty.to_le_bytes());
                b.extend_from_slice(&offset.to_le_bytes());
                offsets.push(offset);
                offset = align_up(offset + data.len() as u64, self.alignment).unwrap();
            }
            while b.len() as u64 % self.alignment != 0 {
                b.push(0);
            }
            let start = b.len();
            for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
                b.resize(start + off as usize, 0);
                b.extend_from_slice(data);
            }
            b
        }
    }

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_bits().to_le_bytes()
    }

    /// Every metadata type, scalar and array, including a nested array.
    fn all_types_file() -> Vec<u8> {
        let mut w = Writer::new();
        w.raw("t.u8", 0, &[200])
            .raw("t.i8", 1, &[0xFE])
            .raw("t.u16", 2, &60000u16.to_le_bytes())
            .raw("t.i16", 3, &(-30000i16).to_le_bytes())
            .u32("t.u32", 4_000_000_000)
            .raw("t.i32", 5, &(-7i32).to_le_bytes())
            .f32("t.f32", 1.5)
            .bool("t.bool", true)
            .str("t.str", "héllo")
            .raw("t.u64", 10, &u64::MAX.to_le_bytes())
            .raw("t.i64", 11, &(-5i64).to_le_bytes())
            .raw("t.f64", 12, &0.25f64.to_le_bytes())
            .str_array("t.strs", &["a", "", "ü"])
            .i32_array("t.i32s", &[1, -2, 3]);
        // u8 array, f32 array, bool array, nested [[1u16, 2u16], []].
        let mut p = 0u32.to_le_bytes().to_vec();
        p.extend_from_slice(&3u64.to_le_bytes());
        p.extend_from_slice(&[1, 2, 3]);
        w.raw("t.u8s", 9, &p);
        let mut p = 6u32.to_le_bytes().to_vec();
        p.extend_from_slice(&2u64.to_le_bytes());
        p.extend_from_slice(&0.5f32.to_le_bytes());
        p.extend_from_slice(&(-1f32).to_le_bytes());
        w.raw("t.f32s", 9, &p);
        let mut p = 7u32.to_le_bytes().to_vec();
        p.extend_from_slice(&2u64.to_le_bytes());
        p.extend_from_slice(&[0, 1]);
        w.raw("t.bools", 9, &p);
        let mut p = 9u32.to_le_bytes().to_vec();
        p.extend_from_slice(&2u64.to_le_bytes());
        p.extend_from_slice(&2u32.to_le_bytes());
        p.extend_from_slice(&2u64.to_le_bytes());
        p.extend_from_slice(&1u16.to_le_bytes());
        p.extend_from_slice(&2u16.to_le_bytes());
        p.extend_from_slice(&4u32.to_le_bytes());
        p.extend_from_slice(&0u64.to_le_bytes());
        w.raw("t.nested", 9, &p);
        w.tensor(
            "v",
            &[2],
            GgmlType::F32,
            [1.0f32, -2.0]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        );
        w.build()
    }

    #[test]
    fn every_metadata_type() {
        let f = GgufFile::parse(all_types_file()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.metadata().len(), 18);
        assert_eq!(f.get("t.u8"), Some(&Value::U8(200)));
        assert_eq!(f.get("t.i8"), Some(&Value::I8(-2)));
        assert_eq!(f.get("t.u16"), Some(&Value::U16(60000)));
        assert_eq!(f.get("t.i16"), Some(&Value::I16(-30000)));
        assert_eq!(f.get_u32("t.u32").unwrap(), 4_000_000_000);
        assert_eq!(f.get_i64("t.i32").unwrap(), -7);
        assert_eq!(f.get_f32("t.f32").unwrap(), 1.5);
        assert!(f.get_bool("t.bool").unwrap());
        assert_eq!(f.get_str("t.str").unwrap(), "héllo");
        assert_eq!(f.get_u64("t.u64").unwrap(), u64::MAX);
        assert_eq!(f.get_i64("t.i64").unwrap(), -5);
        assert_eq!(f.get_f32("t.f64").unwrap(), 0.25);
        assert_eq!(f.get_str_array("t.strs").unwrap(), ["a", "", "ü"]);
        assert_eq!(f.get_i32_array("t.i32s").unwrap(), [1, -2, 3]);
        assert_eq!(f.get_array("t.u8s").unwrap(), &Array::U8(vec![1, 2, 3]));
        assert_eq!(f.get_f32_array("t.f32s").unwrap(), [0.5, -1.0]);
        assert_eq!(
            f.get_array("t.bools").unwrap(),
            &Array::Bool(vec![false, true])
        );
        assert_eq!(
            f.get_array("t.nested").unwrap(),
            &Array::Array(vec![Array::U16(vec![1, 2]), Array::U32(vec![])])
        );
        // u8 and u16 widen to u32; u64::MAX does not fit; negative does not fit.
        assert_eq!(f.get_u32("t.u8").unwrap(), 200);
        assert!(matches!(f.get_u32("t.u64"), Err(Error::Gguf(m)) if m.contains("does not fit")));
        assert!(matches!(f.get_u32("t.i32"), Err(Error::Gguf(_))));
        // Wrong types and missing keys are typed errors naming the key.
        assert!(
            matches!(f.get_str("t.u32"), Err(Error::Gguf(m)) if m.contains("t.u32") && m.contains("expected string"))
        );
        assert!(
            matches!(f.get_i32_array("t.strs"), Err(Error::Gguf(m)) if m.contains("array of string"))
        );
        assert!(
            matches!(f.get_f32("nope"), Err(Error::Gguf(m)) if m.contains("nope") && m.contains("missing"))
        );
        assert_eq!(f.get_u32_opt("nope").unwrap(), None);
        assert!(f.get_u32_opt("t.str").is_err());
        assert_eq!(f.tensor_f32("v").unwrap(), [1.0, -2.0]);
        assert!(f.tensor("w").is_none());
        assert!(f.tensor_f32("w").is_err());
    }

    #[test]
    fn version_2_and_magic() {
        let mut bytes = all_types_file();
        bytes[4] = 2;
        assert_eq!(GgufFile::parse(bytes.clone()).unwrap().version(), 2);
        bytes[4] = 1;
        assert!(
            matches!(GgufFile::parse(bytes.clone()), Err(Error::Gguf(m)) if m.contains("version 1"))
        );
        bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(
            matches!(GgufFile::parse(bytes.clone()), Err(Error::Gguf(m)) if m.contains("big-endian"))
        );
        bytes[0] = b'X';
        assert!(matches!(GgufFile::parse(bytes), Err(Error::Gguf(m)) if m.contains("not a GGUF")));
    }

    /// Q8_0, Q4_0 and Q4_1 blocks written by hand from known codes, F16 and BF16 values that
    /// are exact in 16 bits.
    #[test]
    fn dequantize_every_type_exactly() {
        let mut w = Writer::new();
        w.alignment = 64;
        w.u32("general.alignment", 64);
        // F16 / BF16: 3 values exact in both formats.
        let vals = [1.0f32, -0.5, 96.0];
        w.tensor(
            "f16",
            &[3],
            GgmlType::F16,
            vals.iter().flat_map(|&x| h(x)).collect(),
        );
        w.tensor(
            "bf16",
            &[3],
            GgmlType::BF16,
            vals.iter()
                .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
                .collect(),
        );
        // Q8_0: two blocks (one row of 64), d = 0.5 and d = -2; q = j - 16 and -128..=127 ends.
        let mut q8 = Vec::new();
        let mut q8_want = Vec::new();
        for (d, base) in [(0.5f32, -16i32), (-2.0, -128)] {
            q8.extend_from_slice(&h(d));
            for j in 0..32 {
                let q = if base == -128 && j == 31 {
                    127
                } else {
                    base + j
                };
                q8.push(q as i8 as u8);
                q8_want.push(q as f32 * d);
            }
        }
        w.tensor("q8_0", &[64], GgmlType::Q8_0, q8);
        // Q4_0: one block, d = 0.25; element j has code j % 16 (low nibbles 0..15 at bytes 0..15),
        // element 16 + j has code 15 - j (high nibbles).
        let mut q40 = h(0.25).to_vec();
        let mut q40_want = vec![0f32; 32];
        for j in 0..16u8 {
            let (lo, hi) = (j, 15 - j);
            q40.push(lo | hi << 4);
            q40_want[j as usize] = (lo as f32 - 8.0) * 0.25;
            q40_want[16 + j as usize] = (hi as f32 - 8.0) * 0.25;
        }
        w.tensor("q4_0", &[32], GgmlType::Q4_0, q40);
        // Q4_1: two rows of one block: d = 0.5, m = -3 and d = 1, m = 0.125.
        let mut q41 = Vec::new();
        let mut q41_want = Vec::new();
        for (d, m) in [(0.5f32, -3.0f32), (1.0, 0.125)] {
            q41.extend_from_slice(&h(d));
            q41.extend_from_slice(&h(m));
            let mut row = vec![0f32; 32];
            for j in 0..16u8 {
                let (lo, hi) = ((j * 7) % 16, (j * 3 + 1) % 16);
                q41.push(lo | hi << 4);
                row[j as usize] = lo as f32 * d + m;
                row[16 + j as usize] = hi as f32 * d + m;
            }
            q41_want.extend(row);
        }
        w.tensor("q4_1", &[32, 2], GgmlType::Q4_1, q41);
        let f = GgufFile::parse(w.build()).unwrap();
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_offset() % 64, 0);
        assert_eq!(f.tensor_f32("f16").unwrap(), vals);
        assert_eq!(f.tensor_f32("bf16").unwrap(), vals);
        assert_eq!(f.tensor_f32("q8_0").unwrap(), q8_want);
        assert_eq!(f.tensor_f32("q4_0").unwrap(), q40_want);
        assert_eq!(q40_want[0], -2.0);
        assert_eq!(q40_want[16], 1.75);
        assert_eq!(f.tensor_f32("q4_1").unwrap(), q41_want);
        assert_eq!(f.tensor_rows_f32("q4_1", 1..2).unwrap(), q41_want[32..]);
        assert!(f.tensor_rows_f32("q4_1", 1..3).is_err());
        let t = f.tensor("q4_1").unwrap();
        assert_eq!(
            (t.row_len(), t.n_rows(), t.row_bytes(), t.n_bytes),
            (32, 2, 20, 40)
        );
        assert_eq!(f.tensor_data("q4_1").unwrap().len(), 40);
    }

    #[test]
    fn unsupported_type_is_named() {
        let mut w = Writer::new();
        w.tensor("k", &[256], GgmlType::Q2_K, vec![0; 84]);
        let f = GgufFile::parse(w.build()).unwrap();
        assert_eq!(f.tensor("k").unwrap().ggml_type, GgmlType::Q2_K);
        let e = f.tensor_f32("k").unwrap_err().to_string();
        assert!(e.contains("Q2_K") && e.contains("not supported"), "{e}");
        // An id ggml does not define.
        let mut w = Writer::new();
        w.tensors.push(("x".into(), vec![4], 4, vec![0; 16]));
        let e = GgufFile::parse(w.build()).unwrap_err().to_string();
        assert!(e.contains("unknown ggml type id 4"), "{e}");
    }

    /// A file on disk is mapped, and reads as the same bytes parsed from memory; a file cut
    /// short on disk (or empty) is refused with an error naming the path.
    #[test]
    fn an_opened_file_is_mapped_and_checked_like_a_parsed_one() {
        let dir = std::env::temp_dir().join(format!("kvattn-gguf-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bytes = all_types_file();
        let path = dir.join("all.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let mapped = GgufFile::open(&path).unwrap();
        assert!(matches!(mapped.bytes, FileBytes::Mapped(_)));
        let parsed = GgufFile::parse(bytes.clone()).unwrap();
        assert_eq!(mapped.file_len(), bytes.len() as u64);
        assert_eq!(mapped.tensors(), parsed.tensors());
        for t in parsed.tensors() {
            assert_eq!(
                mapped.tensor_data(&t.name).unwrap(),
                parsed.tensor_data(&t.name).unwrap()
            );
        }
        // A clone shares the mapping.
        let clone = mapped.clone();
        drop(mapped);
        assert_eq!(clone.metadata(), parsed.metadata());
        for (name, len) in [("cut.gguf", bytes.len() - 1), ("empty.gguf", 0)] {
            let cut = dir.join(name);
            std::fs::write(&cut, &bytes[..len]).unwrap();
            let e = GgufFile::open(&cut).unwrap_err().to_string();
            assert!(e.contains(&cut.display().to_string()), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn truncation_at_every_byte_is_an_error() {
        let bytes = all_types_file();
        for n in 0..bytes.len() {
            let r = GgufFile::parse(bytes[..n].to_vec());
            assert!(matches!(r, Err(Error::Gguf(_))), "truncated at {n}: {r:?}");
        }
        // Every single corrupted byte: an Err or a file, never a panic.
        for i in 0..bytes.len() {
            for v in [0x00, 0xFF, 0x80, 0x07] {
                let mut b = bytes.clone();
                b[i] = v;
                let _ = GgufFile::parse(b).map(|f| {
                    for t in f.tensors().to_vec() {
                        let _ = f.tensor_f32(&t.name);
                    }
                });
            }
        }
    }

    fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&n_tensors.to_le_bytes());
        b.extend_from_slice(&n_kv.to_le_bytes());
        b
    }

    #[test]
    fn absurd_counts_and_sizes_are_refused() {
        let err = |b: Vec<u8>| GgufFile::parse(b).unwrap_err().to_string();
        // Counts larger than the file.
        assert!(err(header(u64::MAX, 0)).contains("tensor count"));
        assert!(err(header(0, 1 << 40)).contains("metadata count"));
        // A string length larger than the file.
        let mut b = header(0, 1);
        b.extend_from_slice(&(1u64 << 50).to_le_bytes());
        b.extend_from_slice(&[b'k'; 16]);
        assert!(err(b).contains("length"));
        // An array count larger than the file, and a too-deep nesting.
        let mut w = Writer::new();
        let mut p = 4u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
        w.raw("a", 9, &p);
        assert!(err(w.build()).contains("element count"));
        let mut w = Writer::new();
        let mut p = Vec::new();
        for _ in 0..40 {
            p.extend_from_slice(&9u32.to_le_bytes());
            p.extend_from_slice(&1u64.to_le_bytes());
        }
        w.raw("deep", 9, &p);
        assert!(err(w.build()).contains("nested"));
        // Unknown value type; bad bool.
        assert!(err(Writer::new().raw("x", 13, &[0; 8]).build()).contains("unknown value type 13"));
        assert!(err(Writer::new().raw("x", 7, &[2]).build()).contains("bool"));
        // Duplicate key; invalid UTF-8.
        assert!(err(Writer::new().u32("k", 1).u32("k", 2).build()).contains("twice"));
        assert!(err(Writer::new()
            .raw("k", 8, &[1, 0, 0, 0, 0, 0, 0, 0, 0xFF])
            .build())
        .contains("UTF-8"));
        // Bad alignment.
        assert!(err(Writer::new().u32("general.alignment", 24).build()).contains("alignment"));
        assert!(err(Writer::new().u32("general.alignment", 0).build()).contains("alignment"));
        // Dims overflow, too many dims, zero dims, row not a multiple of the block.
        let t = |dims: &[u64], ty: GgmlType| {
            let mut w = Writer::new();
            w.tensor("t", dims, ty, vec![0; 64]);
            err(w.build())
        };
        assert!(t(&[1 << 32, 1 << 32], GgmlType::F32).contains("overflow"));
        assert!(t(&[u64::MAX], GgmlType::F32).contains("too large"));
        assert!(t(&[1, 1, 1, 1, 1], GgmlType::F32).contains("dimensions"));
        assert!(t(&[], GgmlType::F32).contains("dimensions"));
        assert!(t(&[16, 2], GgmlType::Q8_0).contains("multiple of the Q8_0 block size"));
        // Data past the end, duplicate tensor names, misaligned offset.
        assert!(t(&[32], GgmlType::F32).contains("past the end"));
        let mut w = Writer::new();
        w.tensor("t", &[1], GgmlType::F32, vec![0; 4])
            .tensor("t", &[1], GgmlType::F32, vec![0; 4]);
        assert!(err(w.build()).contains("twice"));
        let mut b = {
            let mut w = Writer::new();
            w.tensor("t", &[1], GgmlType::F32, vec![0; 4]);
            w.build()
        };
        // The offset field is the 8 bytes before the data section padding: find and patch it.
        let pos = 24 + 8 + 1 + 4 + 8 + 4;
        b[pos..pos + 8].copy_from_slice(&4u64.to_le_bytes());
        assert!(err(b).contains("not a multiple of the alignment"));
        // Dequantize with a wrong byte count.
        assert!(dequantize(GgmlType::Q8_0, &[0; 33], 32).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0; 34], 31).is_err());
    }

    fn llama_file(extra: impl FnOnce(&mut Writer)) -> Vec<u8> {
        let mut w = Writer::new();
        w.str("general.architecture", "llama")
            .u32("llama.block_count", 2)
            .u32("llama.embedding_length", 64)
            .u32("llama.feed_forward_length", 128)
            .u32("llama.attention.head_count", 4)
            .u32("llama.attention.head_count_kv", 2)
            .u32("llama.context_length", 256)
            .u32("llama.vocab_size", 10)
            .f32("llama.rope.freq_base", 100000.0)
            .f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
        extra(&mut w);
        w.build()
    }

    #[test]
    fn llama_hyper() {
        let f = GgufFile::parse(llama_file(|_| {})).unwrap();
        let h = LlamaHyper::from_gguf(&f).unwrap();
        assert_eq!(
            h,
            LlamaHyper {
                architecture: "llama".into(),
                n_layers: 2,
                d_model: 64,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 16,
                rope_dim: 16,
                ffn_dim: 128,
                rope_base: 100000.0,
                rms_eps: 1e-5,
                vocab_size: 10,
                context_length: 256,
                tied_embeddings: true,
                qkv_bias: false,
                rope_freqs: false,
            }
        );
        assert_eq!(h.rope_style(), RopeStyle::GptJ);
        let names = h.expected_tensors();
        assert_eq!(names.len(), 2 + 2 * 9);
        assert!(h
            .check_tensors(&f)
            .unwrap_err()
            .to_string()
            .contains("token_embd.weight"));
        // Every tensor present: accepted; one of a type kvattn does not read: refused, named.
        let with_tensors = |odd: Option<&str>| {
            let bytes = llama_file(|w| {
                for (name, dims) in h.expected_tensors() {
                    let n = dims.iter().product::<u64>() as usize;
                    if odd == Some(name.as_str()) {
                        w.tensor(&name, &dims, GgmlType::IQ4_NL, vec![0; n / 32 * 18]);
                    } else {
                        w.tensor(&name, &dims, GgmlType::F32, vec![0; n * 4]);
                    }
                }
            });
            GgufFile::parse(bytes).unwrap()
        };
        h.check_tensors(&with_tensors(None)).unwrap();
        let e = h
            .check_tensors(&with_tensors(Some("blk.1.ffn_up.weight")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.1.ffn_up.weight") && e.contains("IQ4_NL"),
            "{e}"
        );
        let bad = |extra: fn(&mut Writer), what: &str| {
            let f = GgufFile::parse(llama_file(extra)).unwrap();
            let e = LlamaHyper::from_gguf(&f).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        bad(
            |w| {
                w.u32("llama.rope.dimension_count", 18);
            },
            "dimension_count",
        );
        bad(
            |w| {
                w.u32("llama.attention.key_length", 0);
            },
            "key_length",
        );
        bad(
            |w| {
                w.tensor(
                    "token_embd.weight",
                    &[64, 9],
                    GgmlType::F32,
                    vec![0; 64 * 9 * 4],
                );
            },
            "token_embd",
        );
        let mut w = Writer::new();
        w.str("general.architecture", "gptneox");
        let e = LlamaHyper::from_gguf(&GgufFile::parse(w.build()).unwrap()).unwrap_err();
        assert!(e.to_string().contains("gptneox"));
        let mut w = Writer::new();
        w.str("general.architecture", "llama")
            .u32("llama.block_count", 2);
        let e = LlamaHyper::from_gguf(&GgufFile::parse(w.build()).unwrap()).unwrap_err();
        assert!(e.to_string().contains("llama.embedding_length"), "{e}");
    }

    /// A file of architecture `arch` with the hyper-parameters of [`llama_file`] and `extra`.
    fn arch_file(arch: &str, extra: impl FnOnce(&mut Writer)) -> GgufFile {
        let mut w = Writer::new();
        w.str("general.architecture", arch);
        for (k, v) in [
            ("block_count", 2),
            ("embedding_length", 64),
            ("feed_forward_length", 128),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("context_length", 256),
            ("vocab_size", 10),
        ] {
            w.u32(&format!("{arch}.{k}"), v);
        }
        extra(&mut w);
        GgufFile::parse(w.build()).unwrap()
    }

    /// Adds every tensor of `h` (F32 zeros) but those named in `skip`, then `more`.
    fn all_tensors(w: &mut Writer, h: &LlamaHyper, skip: &[&str], more: &[(&str, &[u64])]) {
        let zeros = |dims: &[u64]| vec![0u8; dims.iter().product::<u64>() as usize * 4];
        for (name, dims) in h.expected_tensors() {
            if !skip.contains(&name.as_str()) {
                w.tensor(&name, &dims, GgmlType::F32, zeros(&dims));
            }
        }
        for (name, dims) in more {
            w.tensor(name, dims, GgmlType::F32, zeros(dims));
        }
    }

    #[test]
    fn qwen2_needs_its_biases_and_pairs_neox() {
        let f = arch_file("qwen2", |w| {
            w.f32("qwen2.rope.freq_base", 1e6);
        });
        let h = LlamaHyper::from_gguf(&f).unwrap();
        assert_eq!(h.architecture, "qwen2");
        assert!(h.qkv_bias && h.tied_embeddings);
        assert_eq!(h.rope_base, 1e6);
        assert_eq!(h.rope_style(), RopeStyle::NeoX);
        let names = h.expected_tensors();
        assert_eq!(names.len(), 2 + 2 * 12);
        assert!(names.contains(&("blk.1.attn_k.bias".into(), vec![32])));
        assert!(names.contains(&("blk.0.attn_q.bias".into(), vec![64])));
        let complete = arch_file("qwen2", |w| all_tensors(w, &h, &[], &[]));
        h.check_tensors(&complete).unwrap();
        let e = h
            .check_tensors(&arch_file("qwen2", |w| {
                all_tensors(w, &h, &["blk.1.attn_v.bias"], &[])
            }))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.1.attn_v.bias") && e.contains("missing"),
            "{e}"
        );
    }

    #[test]
    fn llama_biases_are_optional_and_all_or_nothing() {
        let plain = LlamaHyper::from_gguf(&arch_file("llama", |_| {})).unwrap();
        assert!(!plain.qkv_bias);
        // With blk.0.attn_q.bias the file has biases: every layer needs all three.
        let biased = LlamaHyper::from_gguf(&arch_file("llama", |w| {
            all_tensors(w, &plain, &[], &[("blk.0.attn_q.bias", &[64])]);
        }))
        .unwrap();
        assert!(biased.qkv_bias);
        assert_eq!(biased.rope_style(), RopeStyle::GptJ);
        let f = arch_file("llama", |w| {
            all_tensors(w, &plain, &[], &[("blk.0.attn_q.bias", &[64])]);
        });
        let e = biased.check_tensors(&f).unwrap_err().to_string();
        assert!(e.contains("blk.0.attn_k.bias"), "{e}");
        let f = arch_file("llama", |w| all_tensors(w, &biased, &[], &[]));
        biased.check_tensors(&f).unwrap();
    }

    #[test]
    fn llama_rope_freqs_are_read_and_checked() {
        let plain = LlamaHyper::from_gguf(&arch_file("llama", |_| {})).unwrap();
        let base = &plain;
        let with = |dims: &'static [u64]| {
            arch_file("llama", move |w| {
                all_tensors(w, base, &[], &[("rope_freqs.weight", dims)]);
            })
        };
        let h = LlamaHyper::from_gguf(&with(&[8])).unwrap();
        assert!(h.rope_freqs && !plain.rope_freqs);
        assert!(h
            .expected_tensors()
            .contains(&("rope_freqs.weight".into(), vec![8])));
        h.check_tensors(&with(&[8])).unwrap();
        let e = h.check_tensors(&with(&[16])).unwrap_err().to_string();
        assert!(e.contains("rope_freqs.weight") && e.contains("[16]"), "{e}");
        // qwen2 files have no frequency factors: one is a tensor the decoder would ignore.
        let q = LlamaHyper::from_gguf(&arch_file("qwen2", |_| {})).unwrap();
        let f = arch_file("qwen2", |w| {
            all_tensors(w, &q, &[], &[("rope_freqs.weight", &[8])]);
        });
        let q = LlamaHyper::from_gguf(&f).unwrap();
        assert!(!q.rope_freqs);
        let e = q.check_tensors(&f).unwrap_err().to_string();
        assert!(
            e.contains("rope_freqs.weight") && e.contains("frequency factors"),
            "{e}"
        );
    }

    #[test]
    fn tensors_the_decoder_would_ignore_are_refused_by_name() {
        let h = LlamaHyper::from_gguf(&arch_file("llama", |_| {})).unwrap();
        for (name, dims, also) in [
            ("blk.1.attn_output.bias", &[64u64][..], "ignore"),
            ("blk.0.attn_q.bias", &[64][..], "ignore"),
        ] {
            let f = arch_file("llama", |w| all_tensors(w, &h, &[], &[(name, dims)]));
            // blk.0.attn_q.bias turns the biases on when the file is read; checked against
            // the hyper-parameters of a file without it, it is one tensor too many.
            let e = h.check_tensors(&f).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(also), "{e}");
        }
    }

    #[test]
    fn scaled_rope_is_refused_by_name() {
        let refused = |extra: fn(&mut Writer), what: &[&str]| {
            let e = LlamaHyper::from_gguf(&arch_file("llama", extra))
                .unwrap_err()
                .to_string();
            assert!(what.iter().all(|w| e.contains(w)), "{e}");
        };
        refused(
            |w| {
                w.str("llama.rope.scaling.type", "yarn");
            },
            &["yarn", "llama.rope.scaling.type"],
        );
        refused(
            |w| {
                w.str("llama.rope.scaling.type", "linear")
                    .f32("llama.rope.scaling.factor", 4.0);
            },
            &["llama.rope.scaling.factor", "4"],
        );
        refused(
            |w| {
                w.f32("llama.rope.scale_linear", 2.0);
            },
            &["llama.rope.scale_linear"],
        );
        // Unscaled spellings load.
        for extra in [
            (|w: &mut Writer| {
                w.str("llama.rope.scaling.type", "none");
            }) as fn(&mut Writer),
            |w| {
                w.str("llama.rope.scaling.type", "linear")
                    .f32("llama.rope.scaling.factor", 1.0);
            },
            |w| {
                w.f32("llama.rope.scaling.factor", 0.0);
            },
        ] {
            LlamaHyper::from_gguf(&arch_file("llama", extra)).unwrap();
        }
        // An unknown architecture is named, with the supported ones.
        let e = LlamaHyper::from_gguf(&arch_file("phi3", |_| {}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("phi3") && e.contains("qwen2"), "{e}");
    }
}
