//! KV storage formats (ARCHITECTURE.md section 6): the [`KvDtype`] list, packing into `u32` words,
//! and the CPU codecs (f16, bf16, FP8 E4M3/E5M2, int8, int4) with their scales.
//!
//! The CPU codec here is the definition of every format: the GPU encoder and the WGSL decoder
//! (`shaders/lib/kv_load.wgsl`) match it bit for bit. Encoders use integer bit operations for
//! float rounding, multiply by reciprocal scales computed once, and round ties to even.
//!
//! Pools are arrays of `u32` words whatever the dtype; a token row of `head_dim` values takes
//! [`KvDtype::words_per_row`] words and [`KvDtype::scale_words_per_row`] scale words. See
//! [`encode_rows`] and [`decode_rows`] for whole rows.

pub mod bf16;
pub mod calibrate;
pub mod dequant;
pub mod f16;
pub mod fp8;
pub mod fp8_scale;
pub mod int4;
pub mod int8;
pub mod pack;
mod round;
mod rows;

pub use calibrate::per_tensor_scale;
pub use fp8::Fp8Format;
pub use fp8_scale::Fp8Scale;
pub use int4::{Int4Params, INT4_GROUP};
pub use int8::Int8Scale;
pub use rows::{
    decode_rows, encode_int4_rows_with, encode_int8_rows_with, encode_rows, EncodedRows,
};

use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// Largest head dimension any format accepts.
pub const MAX_HEAD_DIM: usize = 1024;

/// How a KV element is stored. The discriminant order is the WGSL code ([`KvDtype::code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum KvDtype {
    /// IEEE f32, one value per word.
    F32,
    /// IEEE f16, two values per word (`unpack2x16float`).
    F16,
    /// bfloat16, two values per word.
    Bf16,
    /// OCP FP8 E4M3 "fn", four values per word, with a per-tensor or per-row f32 scale.
    #[cfg_attr(feature = "serde", serde(rename = "fp8-e4m3"))]
    Fp8E4M3,
    /// OCP FP8 E5M2, four values per word, with a per-tensor or per-row f32 scale.
    #[cfg_attr(feature = "serde", serde(rename = "fp8-e5m2"))]
    Fp8E5M2,
    /// Symmetric int8, four values per word, an f32 scale per row.
    Int8,
    /// Asymmetric int4, eight values per word, an f16 scale and f16 min per group of 32 values.
    Int4,
}

impl KvDtype {
    /// Every dtype, in code order.
    pub const ALL: [KvDtype; 7] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Fp8E4M3,
        KvDtype::Fp8E5M2,
        KvDtype::Int8,
        KvDtype::Int4,
    ];

    /// The code passed to the WGSL overrides `K_DTYPE` / `V_DTYPE` (0..=6, the order of
    /// [`KvDtype::ALL`]; `KV_F32` .. `KV_INT4` in `kv_load.wgsl`).
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The dtype of a WGSL code, `None` for an unknown code.
    pub fn from_code(code: u32) -> Option<KvDtype> {
        KvDtype::ALL.get(code as usize).copied()
    }

    /// The name used on the command line and in files: "f32", "f16", "bf16", "fp8-e4m3",
    /// "fp8-e5m2", "int8", "int4".
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8E4M3 => "fp8-e4m3",
            KvDtype::Fp8E5M2 => "fp8-e5m2",
            KvDtype::Int8 => "int8",
            KvDtype::Int4 => "int4",
        }
    }

    /// Bits per stored value (scales not counted).
    pub fn bits(self) -> u32 {
        match self {
            KvDtype::F32 => 32,
            KvDtype::F16 | KvDtype::Bf16 => 16,
            KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 | KvDtype::Int8 => 8,
            KvDtype::Int4 => 4,
        }
    }

    /// The FP8 format of an FP8 dtype, `None` for the others.
    pub fn fp8_format(self) -> Option<Fp8Format> {
        match self {
            KvDtype::Fp8E4M3 => Some(Fp8Format::E4M3),
            KvDtype::Fp8E5M2 => Some(Fp8Format::E5M2),
            _ => None,
        }
    }

    /// Whether values are stored with scales (FP8, int8, int4).
    pub fn is_quantized(self) -> bool {
        self.bits() <= 8
    }

    /// Checks a head dimension: positive, a multiple of 4 (of 32 for Int4, its scale group), at
    /// most [`MAX_HEAD_DIM`]. Otherwise `Error::UnsupportedHeadDim`.
    pub fn check_head_dim(self, d: usize) -> Result<()> {
        let reason = if d == 0 {
            "must be positive".to_string()
        } else if d % 4 != 0 {
            "must be a multiple of 4".to_string()
        } else if self == KvDtype::Int4 && d % INT4_GROUP != 0 {
            format!("int4 needs a multiple of {INT4_GROUP} (its scale group)")
        } else if d > MAX_HEAD_DIM {
            format!("must be at most {MAX_HEAD_DIM}")
        } else {
            return Ok(());
        };
        Err(Error::UnsupportedHeadDim {
            head_dim: d,
            reason,
        })
    }

    /// Checks that `mode` applies to this dtype: a per-tensor scale only for FP8 and only a
    /// positive normal one (see [`Fp8Scale::per_tensor`]); `PerRow` for every dtype (for F32,
    /// F16 and Bf16 it means "no scale"). Otherwise `Error::InvalidArgument`.
    pub fn check_scale_mode(self, mode: ScaleMode) -> Result<()> {
        match mode {
            ScaleMode::PerRow => Ok(()),
            ScaleMode::PerTensor(s) if self.fp8_format().is_some() => {
                Fp8Scale::per_tensor(s).map(|_| ())
            }
            ScaleMode::PerTensor(_) => Err(Error::InvalidArgument(format!(
                "a per-tensor scale applies to FP8 only; {self} uses {}",
                match self {
                    KvDtype::Int8 => "a scale per token row",
                    KvDtype::Int4 => "a scale and min per group of 32 values",
                    _ => "no scale",
                }
            ))),
        }
    }

    /// `u32` words holding one token row of `d` values (`d * bits / 32`, rounded up).
    pub fn words_per_row(self, d: usize) -> usize {
        (d * self.bits() as usize).div_ceil(32)
    }

    /// Bytes of one token row of `d` values (scales not counted).
    pub fn bytes_per_row(self, d: usize) -> usize {
        4 * self.words_per_row(d)
    }

    /// `u32` scale words per token row of `d` values: 0 for F32/F16/Bf16 and for per-tensor FP8
    /// (the one tensor scale is stored once, outside the rows), 1 for per-row FP8 and for Int8,
    /// `d / 32` for Int4 (one word per group: f16 scale low, f16 min high).
    pub fn scale_words_per_row(self, d: usize, mode: ScaleMode) -> usize {
        match (self, mode) {
            (KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16, _) => 0,
            (KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2, ScaleMode::PerTensor(_)) => 0,
            (KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 | KvDtype::Int8, _) => 1,
            (KvDtype::Int4, _) => d.div_ceil(INT4_GROUP),
        }
    }

    /// Words from the start of one value row of a pool block to the next:
    /// [`words_per_row`](Self::words_per_row) rounded up to a multiple of 4 (16 bytes), so that
    /// every row starts on a 16-byte boundary. Equal to `words_per_row` for every format at head
    /// dims that are multiples of 16 (f32: every head dim; f16/bf16: multiples of 8).
    pub fn row_stride(self, d: usize) -> usize {
        align_words(self.words_per_row(d))
    }

    /// `u32` words of one pool block of `rows` token rows: the rows' values
    /// ([`row_stride`](Self::row_stride) words apart), then their scale words
    /// ([`scale_words_per_row`](Self::scale_words_per_row) each, back to back), the whole
    /// rounded up to a multiple of 4 words. Blocks, value rows and scale sections thus all start
    /// on 16-byte boundaries. The one definition of the block stride: `PoolLayout`, the CPU
    /// layout paths and `kv_block_words` in `shaders/lib/kv_format.wgsl` follow it.
    pub fn block_words(self, d: usize, mode: ScaleMode, rows: usize) -> usize {
        align_words(rows * (self.row_stride(d) + self.scale_words_per_row(d, mode)))
    }
}

/// `words` rounded up to a whole number of 16-byte units (a multiple of 4 words).
const fn align_words(words: usize) -> usize {
    words.next_multiple_of(4)
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = Error;

    /// Parses a name of [`KvDtype::name`], case-insensitively, with `_` accepted for `-`; also
    /// vLLM's "fp8" (= fp8-e4m3), "e4m3", "e5m2", "float32", "float16", "bfloat16".
    fn from_str(s: &str) -> Result<KvDtype> {
        let t = s.trim().to_ascii_lowercase().replace('_', "-");
        let alias = match t.as_str() {
            "fp8" | "e4m3" | "fp8-e4m3fn" => Some(KvDtype::Fp8E4M3),
            "e5m2" => Some(KvDtype::Fp8E5M2),
            "float32" => Some(KvDtype::F32),
            "float16" | "half" => Some(KvDtype::F16),
            "bfloat16" => Some(KvDtype::Bf16),
            _ => None,
        };
        alias
            .or_else(|| KvDtype::ALL.into_iter().find(|d| d.name() == t))
            .ok_or_else(|| {
                let names: Vec<&str> = KvDtype::ALL.iter().map(|d| d.name()).collect();
                Error::InvalidArgument(format!(
                    "unknown KV dtype {s:?}; valid: {}",
                    names.join(", ")
                ))
            })
    }
}

/// Where the scales of a quantized format come from.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ScaleMode {
    /// One static f32 scale for the whole tensor (vLLM's `k_scale` / `v_scale`). FP8 only.
    PerTensor(f32),
    /// Scales computed per token row (FP8: a power of two; Int8: `amax / 127`) or per group of a
    /// row (Int4). For F32/F16/Bf16, which have no scales, this is the mode to pass.
    #[default]
    PerRow,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_names_and_parsing() {
        for (i, d) in KvDtype::ALL.into_iter().enumerate() {
            assert_eq!(d.code(), i as u32);
            assert_eq!(KvDtype::from_code(i as u32), Some(d));
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
            assert_eq!(d.to_string(), d.name());
        }
        assert_eq!(KvDtype::from_code(7), None);
        assert_eq!("FP8_E5M2".parse::<KvDtype>().unwrap(), KvDtype::Fp8E5M2);
        assert_eq!("fp8".parse::<KvDtype>().unwrap(), KvDtype::Fp8E4M3);
        let err = "int2".parse::<KvDtype>().unwrap_err().to_string();
        assert!(err.contains("int2") && err.contains("fp8-e4m3") && err.contains("bf16"));
    }

    #[test]
    fn head_dims() {
        for d in KvDtype::ALL {
            assert!(d.check_head_dim(128).is_ok());
            assert!(d.check_head_dim(1024).is_ok());
            for bad in [0, 2, 130, 1056] {
                assert!(matches!(
                    d.check_head_dim(bad),
                    Err(Error::UnsupportedHeadDim { head_dim, .. }) if head_dim == bad
                ));
            }
        }
        assert!(KvDtype::Int8.check_head_dim(80).is_ok());
        assert!(KvDtype::Int4.check_head_dim(80).is_err());
        assert!(KvDtype::Int4.check_head_dim(96).is_ok());
    }

    #[test]
    fn sizes() {
        let t = ScaleMode::PerTensor(1.0);
        let r = ScaleMode::PerRow;
        let d = 128;
        let want = [
            (128, 0, 0),
            (64, 0, 0),
            (64, 0, 0),
            (32, 0, 1),
            (32, 0, 1),
            (32, 1, 1),
            (16, 4, 4),
        ];
        for (dt, (w, st, sr)) in KvDtype::ALL.into_iter().zip(want) {
            assert_eq!(dt.words_per_row(d), w, "{dt}");
            assert_eq!(dt.bytes_per_row(d), 4 * w);
            if dt.fp8_format().is_some() {
                assert_eq!(dt.scale_words_per_row(d, t), st, "{dt}");
            }
            assert_eq!(dt.scale_words_per_row(d, r), sr, "{dt}");
            assert_eq!(dt.words_per_row(d) * 32, d * dt.bits() as usize);
        }
    }

    #[test]
    fn scale_modes() {
        for d in KvDtype::ALL {
            assert!(d.check_scale_mode(ScaleMode::PerRow).is_ok());
            let t = d.check_scale_mode(ScaleMode::PerTensor(0.5));
            assert_eq!(t.is_ok(), d.fp8_format().is_some(), "{d}");
        }
        assert!(KvDtype::Fp8E4M3
            .check_scale_mode(ScaleMode::PerTensor(0.0))
            .is_err());
        assert!(KvDtype::Fp8E5M2
            .check_scale_mode(ScaleMode::PerTensor(f32::NAN))
            .is_err());
    }
}
