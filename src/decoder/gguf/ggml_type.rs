//! Tensor storage types ([`GgmlType`]): ggml's type ids, names, block sizes and byte counts.

use std::fmt;

use super::gguf_err;
use crate::Result;

/// A ggml tensor type: how elements are stored (plain floats or quantized blocks).
///
/// Every type known to current ggml can be *read* (its size is known, so the tensor table is
/// checked); [`GgmlType::can_dequantize`] says which ones [`dequantize`] turns into f32.
///
/// [`dequantize`]: super::dequantize
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
    ///
    /// [`dequantize`]: super::dequantize
    /// [`super::blocks::SUPPORTED`]: crate::decoder::blocks::SUPPORTED
    pub fn can_dequantize(self) -> bool {
        crate::decoder::blocks::SUPPORTED.contains(&self)
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
