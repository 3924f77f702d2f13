//! The capacity model (ARCHITECTURE.md section 7): bytes of KV cache per token, for a batch of
//! sequences, and how many tokens or sequences fit a byte budget.
//!
//! For a multi-head (MHA, GQA, MQA) cache a token leaves one K row and one V row of `head_dim`
//! values per KV head and layer:
//!
//! ```text
//! bytes/token = 2 * layers * kv_heads * head_dim * p  +  scale overhead
//! ```
//!
//! For a latent (MLA, DeepSeek-V2) cache a token leaves one row per layer (no separate K and V):
//! `rank` latent values in the cache dtype and `rope_dim` decoupled RoPE key values, which stay
//! 16-bit when the latent is quantized (and take the cache dtype otherwise):
//!
//! ```text
//! bytes/token = layers * (rank * p_latent + rope_dim * p_rope)  +  scale overhead
//! ```
//!
//! For comparison, [`compare_to_mha`] puts an MLA cache next to the MHA cache of the same query
//! heads, each with its own K and V rows of a given head dim ([`CacheShape::mha_equivalent`]),
//! in the same dtype and scale granularity: DeepSeek-V2's 128 heads of 128 would leave
//! `2 * 60 * 128 * 128 = 1,966,080` values per token, 56.9x the latent's 34,560.
//!
//! The scale overhead follows the storage formats of [`KvDtype`]: none for f32, f16 and bf16;
//! none for FP8 with one per-tensor scale ([`ScaleGranularity::PerTensor`], the default, the
//! scale being stored once outside the rows) and 4 bytes (an f32) per row with
//! [`ScaleGranularity::PerToken`]; 4 bytes per row for int8 (always per token row); 4 bytes (an f16
//! scale and an f16 min) per group of [`INT4_GROUP`] values for int4. A "row" is one KV head's
//! `head_dim` values of one token in one layer, of K or of V (MLA: the latent row).
//!
//! Token counts are rounded up to whole blocks only when a block size is given; a block then
//! also counts its 16-byte padding ([`block_padding_bytes`]: each pool block, K and V of a
//! layer, is a whole number of 16-byte units, so kernels can read rows as `vec4<u32>`), which
//! is 0 for the unscaled formats at the usual head dims. All arithmetic
//! is checked: a result that does not fit a `u64` is an [`Error::InvalidArgument`], as are zero
//! sizes and head dimensions the formats cannot pack.
//!
//! ```
//! use kvattn::cache::capacity::{bytes_per_token, total_bytes, CacheShape, CapacityQuery,
//!     ScaleGranularity};
//! use kvattn::quant::KvDtype;
//!
//! // 32 sequences x 8,192 tokens of an 80-layer, 8-KV-head, head-dim-128 model in bf16.
//! let shape = CacheShape::Mha { layers: 80, kv_heads: 8, head_dim: 128 };
//! let bpt = bytes_per_token(shape, KvDtype::Bf16, ScaleGranularity::PerTensor).unwrap();
//! assert_eq!(bpt, 327_680);
//! let q = CapacityQuery {
//!     shape,
//!     dtype: KvDtype::Bf16,
//!     scales: ScaleGranularity::PerTensor,
//!     block_size: None,
//!     tokens_per_seq: 8_192,
//!     seqs: 32,
//! };
//! assert_eq!(total_bytes(&q).unwrap(), 85_899_345_920); // 80 GiB
//! ```

use crate::quant::{KvDtype, ScaleMode, INT4_GROUP};
use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// Largest block size (tokens per block) the paged cache accepts; block sizes are powers of two
/// from 1 to this.
pub const MAX_BLOCK_SIZE: usize = 256;

/// Bytes of one scale word (an f32 scale, or int4's f16 scale and f16 min).
const SCALE_BYTES: u64 = 4;

/// Bytes per value of the 16-bit RoPE part of a quantized latent cache.
const ROPE_QUANTIZED_BYTES: u64 = 2;

/// The attention shape that decides what a token leaves in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(tag = "attention", rename_all = "lowercase"))]
pub enum CacheShape {
    /// Separate K and V rows per KV head and layer (MHA, GQA, MQA).
    Mha {
        /// Transformer layers.
        layers: usize,
        /// KV heads per layer (query heads for MHA, 1 for MQA).
        kv_heads: usize,
        /// Values per head row.
        head_dim: usize,
    },
    /// One compressed latent row per layer plus the decoupled RoPE key (MLA, DeepSeek-V2).
    Mla {
        /// Transformer layers.
        layers: usize,
        /// Latent width (DeepSeek-V2's `kv_lora_rank`).
        rank: usize,
        /// Width of the decoupled RoPE key (DeepSeek-V2's `qk_rope_head_dim`).
        rope_dim: usize,
    },
}

impl CacheShape {
    /// Transformer layers.
    pub fn layers(&self) -> usize {
        match *self {
            CacheShape::Mha { layers, .. } | CacheShape::Mla { layers, .. } => layers,
        }
    }

    /// "mha" or "mla".
    pub fn kind(&self) -> &'static str {
        match self {
            CacheShape::Mha { .. } => "mha",
            CacheShape::Mla { .. } => "mla",
        }
    }

    /// Checks the sizes for `dtype`: every size positive; row widths (`head_dim`, `rank`,
    /// `rope_dim`) multiples of 4 so rows pack into `u32` words, and `head_dim` / `rank` multiples
    /// of [`INT4_GROUP`] for int4 (its scale group). Otherwise [`Error::InvalidArgument`].
    pub fn check(&self, dtype: KvDtype) -> Result<()> {
        // (name, width, whether the row is stored in `dtype` with its scales)
        let (layers, rows): (usize, &[(&str, usize, bool)]) = match *self {
            CacheShape::Mha {
                layers,
                kv_heads,
                head_dim,
            } => {
                if kv_heads == 0 {
                    return Err(invalid("KV heads must be positive"));
                }
                (layers, &[("head dim", head_dim, true)])
            }
            CacheShape::Mla {
                layers,
                rank,
                rope_dim,
            } => (
                layers,
                &[("MLA rank", rank, true), ("RoPE dim", rope_dim, false)],
            ),
        };
        if layers == 0 {
            return Err(invalid("layers must be positive"));
        }
        for &(what, w, in_dtype) in rows {
            if w == 0 {
                return Err(invalid(format!("{what} must be positive")));
            }
            if w % 4 != 0 {
                return Err(invalid(format!("{what} {w} must be a multiple of 4")));
            }
            if in_dtype && dtype == KvDtype::Int4 && w % INT4_GROUP != 0 {
                return Err(invalid(format!(
                    "{what} {w} must be a multiple of {INT4_GROUP} for int4 (its scale group)"
                )));
            }
        }
        Ok(())
    }

    /// Values a token leaves in the cache, over all layers: `2 * layers * kv_heads * head_dim`
    /// (K and V) or, for MLA, `layers * (rank + rope_dim)`. DeepSeek-V2: 34,560.
    pub fn values_per_token(&self) -> Result<u64> {
        match *self {
            CacheShape::Mha {
                layers,
                kv_heads,
                head_dim,
            } => product(&[2, u(layers), u(kv_heads), u(head_dim)]),
            CacheShape::Mla {
                layers,
                rank,
                rope_dim,
            } => product(&[u(layers), add(u(rank), u(rope_dim))?]),
        }
    }
}

impl CacheShape {
    /// The multi-head cache an MLA shape is compared with: `q_heads` KV heads (one per query
    /// head, as in MHA), each with a K row and a V row of `head_dim` values, in every layer of
    /// this shape: `CacheShape::Mha { layers, kv_heads: q_heads, head_dim }`. DeepSeek-V2 (128
    /// query heads, head dim 128): 60 x 128 x 128, 1,966,080 values per token against the
    /// latent's 34,560.
    ///
    /// An MHA shape (already per-head K and V), zero query heads, or a head dim that no cache
    /// row can have (zero, or not a multiple of 4) is an [`Error::InvalidArgument`]; the int4
    /// group rule is checked with the dtype, by [`bytes_per_token`] or [`compare_to_mha`].
    pub fn mha_equivalent(&self, q_heads: usize, head_dim: usize) -> Result<CacheShape> {
        let CacheShape::Mla { layers, .. } = *self else {
            return Err(invalid(format!(
                "an MHA equivalent is defined for an MLA shape; {self} already stores K and V \
                 per KV head"
            )));
        };
        if q_heads == 0 {
            return Err(invalid("query heads must be positive"));
        }
        let mha = CacheShape::Mha {
            layers,
            kv_heads: q_heads,
            head_dim,
        };
        // f32 has no group rule: this checks only what every dtype requires.
        mha.check(KvDtype::F32)
            .map_err(|e| in_mha_equivalent(mha, e))?;
        Ok(mha)
    }
}

/// Names the MHA-equivalent shape in an argument error about its sizes.
fn in_mha_equivalent(mha: CacheShape, e: Error) -> Error {
    match e {
        Error::InvalidArgument(m) => invalid(format!("the MHA equivalent ({mha}): {m}")),
        other => other,
    }
}

/// An MLA cache next to the MHA cache of the same query heads ([`compare_to_mha`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct MhaComparison {
    /// The MHA-equivalent shape ([`CacheShape::mha_equivalent`]).
    pub mha: CacheShape,
    /// Values a token leaves in the MLA cache ([`CacheShape::values_per_token`]).
    pub mla_values_per_token: u64,
    /// Bytes a token takes in the MLA cache, scales included ([`bytes_per_token`]).
    pub mla_bytes_per_token: u64,
    /// Values a token would leave in the MHA-equivalent cache.
    pub mha_values_per_token: u64,
    /// Bytes a token would take in the MHA-equivalent cache, in the same dtype and scale
    /// granularity, scales included.
    pub mha_bytes_per_token: u64,
    /// `mha_values_per_token / mla_values_per_token` (DeepSeek-V2: 56.9).
    pub ratio_values: f64,
    /// `mha_bytes_per_token / mla_bytes_per_token`: differs from the value ratio when the latent
    /// is quantized (its RoPE part stays 16-bit) or has scales.
    pub ratio_bytes: f64,
}

/// Compares the MLA `shape` with its MHA equivalent ([`CacheShape::mha_equivalent`] of
/// `q_heads` heads with K and V rows of `head_dim` values), both in `dtype` with `scales`, by
/// the same formulas as [`CacheShape::values_per_token`] and [`bytes_per_token`]. DeepSeek-V2
/// in bf16: 1,966,080 values and 3,932,160 bytes per token, 56.9x the latent's 34,560 values and
/// 69,120 bytes.
///
/// ```
/// use kvattn::cache::capacity::{compare_to_mha, CacheShape, ScaleGranularity};
/// use kvattn::quant::KvDtype;
///
/// let v2 = CacheShape::Mla { layers: 60, rank: 512, rope_dim: 64 };
/// let c = compare_to_mha(v2, 128, 128, KvDtype::Bf16, ScaleGranularity::PerTensor).unwrap();
/// assert_eq!(c.mha_values_per_token, 2 * 60 * 128 * 128);
/// assert_eq!(format!("{:.1}", c.ratio_values), "56.9");
/// ```
///
/// Errors as [`CacheShape::mha_equivalent`] and [`bytes_per_token`]; an error of the MHA
/// shape's sizes names that shape.
pub fn compare_to_mha(
    shape: CacheShape,
    q_heads: usize,
    head_dim: usize,
    dtype: KvDtype,
    scales: ScaleGranularity,
) -> Result<MhaComparison> {
    let mla_bytes_per_token = bytes_per_token(shape, dtype, scales)?;
    let mla_values_per_token = shape.values_per_token()?;
    let mha = shape.mha_equivalent(q_heads, head_dim)?;
    let in_mha = |e| in_mha_equivalent(mha, e);
    let mha_values_per_token = mha.values_per_token().map_err(in_mha)?;
    let mha_bytes_per_token = bytes_per_token(mha, dtype, scales).map_err(in_mha)?;
    Ok(MhaComparison {
        mha,
        mla_values_per_token,
        mla_bytes_per_token,
        mha_values_per_token,
        mha_bytes_per_token,
        ratio_values: mha_values_per_token as f64 / mla_values_per_token as f64,
        ratio_bytes: mha_bytes_per_token as f64 / mla_bytes_per_token as f64,
    })
}

impl fmt::Display for CacheShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            CacheShape::Mha {
                layers,
                kv_heads,
                head_dim,
            } => write!(
                f,
                "MHA {layers} layers x {kv_heads} KV heads x head dim {head_dim}"
            ),
            CacheShape::Mla {
                layers,
                rank,
                rope_dim,
            } => write!(f, "MLA {layers} layers x (rank {rank} + RoPE {rope_dim})"),
        }
    }
}

/// How FP8 scales are stored. Only FP8 has a choice: int8 always has a scale per token row and
/// int4 a scale and min per group of 32 values, f32/f16/bf16 have none; those dtypes take the
/// default, `PerTensor`, which then stands for their fixed layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum ScaleGranularity {
    /// One scale for the whole tensor, stored once: no per-token overhead.
    #[default]
    PerTensor,
    /// An f32 scale per token row (FP8 only): 4 bytes per row of K and of V.
    PerToken,
}

impl ScaleGranularity {
    /// "per-tensor" or "per-token".
    pub fn name(self) -> &'static str {
        match self {
            ScaleGranularity::PerTensor => "per-tensor",
            ScaleGranularity::PerToken => "per-token",
        }
    }

    /// Checks that the granularity applies to `dtype`: `PerToken` is a choice for FP8 only.
    pub fn check(self, dtype: KvDtype) -> Result<()> {
        if self == ScaleGranularity::PerToken && dtype.fp8_format().is_none() {
            return Err(invalid(format!(
                "per-token scales are a choice for FP8 only; {dtype} {}",
                fixed_scales(dtype)
            )));
        }
        Ok(())
    }

    /// The scale layout `dtype` ends up with: "none", "per-tensor", "per-token" or
    /// "per-group-32".
    pub fn effective(self, dtype: KvDtype) -> &'static str {
        match dtype {
            KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16 => "none",
            KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 => self.name(),
            KvDtype::Int8 => "per-token",
            KvDtype::Int4 => "per-group-32",
        }
    }
}

fn fixed_scales(dtype: KvDtype) -> &'static str {
    match dtype {
        KvDtype::Int8 => "always has a scale per token row",
        KvDtype::Int4 => "always has a scale and min per group of 32 values",
        _ => "has no scales",
    }
}

impl fmt::Display for ScaleGranularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScaleGranularity {
    type Err = Error;

    /// Parses "per-tensor" or "per-token" (case-insensitive, `_` for `-`; "tensor", "token" and
    /// "per-row" also accepted).
    fn from_str(s: &str) -> Result<ScaleGranularity> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "per-tensor" | "tensor" => Ok(ScaleGranularity::PerTensor),
            "per-token" | "token" | "per-row" | "row" => Ok(ScaleGranularity::PerToken),
            _ => Err(invalid(format!(
                "unknown scale granularity {s:?}; valid: per-tensor, per-token"
            ))),
        }
    }
}

/// A capacity question: `seqs` sequences of `tokens_per_seq` tokens each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct CapacityQuery {
    /// The model's cache shape.
    pub shape: CacheShape,
    /// Storage format of the cache.
    pub dtype: KvDtype,
    /// FP8 scale granularity (see [`ScaleGranularity`]).
    pub scales: ScaleGranularity,
    /// Tokens per block; token counts are rounded up to whole blocks when given.
    pub block_size: Option<usize>,
    /// Tokens per sequence (before block rounding).
    pub tokens_per_seq: u64,
    /// Concurrent sequences.
    pub seqs: u64,
}

/// The answer to a [`CapacityQuery`], with its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Capacity {
    /// Values a token leaves in the cache over all layers ([`CacheShape::values_per_token`]).
    pub values_per_token: u64,
    /// Bytes of those values ([`payload_bytes_per_token`]).
    pub payload_bytes_per_token: u64,
    /// Bytes of their scales ([`scale_bytes_per_token`]).
    pub scale_bytes_per_token: u64,
    /// Payload plus scales ([`bytes_per_token`]).
    pub bytes_per_token: u64,
    /// Tokens per sequence after rounding up to whole blocks.
    pub tokens_per_seq: u64,
    /// Bytes of one sequence: `bytes_per_token * tokens_per_seq`, plus, with a block size, its
    /// blocks' 16-byte padding ([`block_padding_bytes`] per block).
    pub bytes_per_seq: u64,
    /// Bytes of all sequences: `bytes_per_seq * seqs`.
    pub total_bytes: u64,
}

/// Checks a block size: a power of two from 1 to [`MAX_BLOCK_SIZE`].
pub fn check_block_size(block_size: usize) -> Result<()> {
    if !block_size.is_power_of_two() || block_size > MAX_BLOCK_SIZE {
        return Err(invalid(format!(
            "block size {block_size} must be a power of two from 1 to {MAX_BLOCK_SIZE}"
        )));
    }
    Ok(())
}

/// `tokens` rounded up to whole blocks of `block_size` (unchanged without a block size).
pub fn round_to_blocks(tokens: u64, block_size: Option<usize>) -> Result<u64> {
    match block_size {
        None => Ok(tokens),
        Some(bs) => {
            check_block_size(bs)?;
            product(&[tokens.div_ceil(u(bs)), u(bs)])
        }
    }
}

/// Bytes of the values a token leaves in the cache, scales not counted.
pub fn payload_bytes_per_token(shape: CacheShape, dtype: KvDtype) -> Result<u64> {
    shape.check(dtype)?;
    let bits = u64::from(dtype.bits());
    match shape {
        CacheShape::Mha {
            layers,
            kv_heads,
            head_dim,
        } => {
            // head_dim is a multiple of 4 (32 for int4), so a row is whole bytes and whole words.
            let row = product(&[u(head_dim), bits])? / 8;
            product(&[2, u(layers), u(kv_heads), row])
        }
        CacheShape::Mla {
            layers,
            rank,
            rope_dim,
        } => {
            let latent = product(&[u(rank), bits])? / 8;
            let rope_bytes = if dtype.is_quantized() {
                ROPE_QUANTIZED_BYTES
            } else {
                bits / 8
            };
            let rope = product(&[u(rope_dim), rope_bytes])?;
            product(&[u(layers), add(latent, rope)?])
        }
    }
}

/// Bytes of the scales a token adds (see the module documentation). `PerToken` with a dtype
/// other than FP8 is an [`Error::InvalidArgument`].
pub fn scale_bytes_per_token(
    shape: CacheShape,
    dtype: KvDtype,
    scales: ScaleGranularity,
) -> Result<u64> {
    shape.check(dtype)?;
    scales.check(dtype)?;
    // Rows per token over all layers, and the width of one row.
    let (rows, width) = match shape {
        CacheShape::Mha {
            layers,
            kv_heads,
            head_dim,
        } => (product(&[2, u(layers), u(kv_heads)])?, head_dim),
        // One latent row per layer; the 16-bit RoPE part has no scale.
        CacheShape::Mla { layers, rank, .. } => (u(layers), rank),
    };
    let per_row = match (dtype, scales) {
        (KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16, _) => 0,
        (KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2, ScaleGranularity::PerTensor) => 0,
        (KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2, ScaleGranularity::PerToken) => SCALE_BYTES,
        (KvDtype::Int8, _) => SCALE_BYTES,
        (KvDtype::Int4, _) => SCALE_BYTES * u(width.div_ceil(INT4_GROUP)),
    };
    product(&[rows, per_row])
}

/// Bytes a token takes in the cache: K and V (or the latent row) of every layer, with the scale
/// overhead of quantized formats.
pub fn bytes_per_token(shape: CacheShape, dtype: KvDtype, scales: ScaleGranularity) -> Result<u64> {
    add(
        payload_bytes_per_token(shape, dtype)?,
        scale_bytes_per_token(shape, dtype, scales)?,
    )
}

/// Bytes of padding one block of `block_size` tokens adds over all layers: each pool block
/// (K and V of a layer; MLA: the latent and RoPE rows of a layer) is rounded up to a whole
/// number of 16-byte units, and so is each value row ([`KvDtype::block_words`]; ARCHITECTURE.md
/// section 6). 0 at the usual head dims for unscaled formats; at most 12 bytes per pool block
/// plus row padding at head dims that are not multiples of 16.
pub fn block_padding_bytes(
    shape: CacheShape,
    dtype: KvDtype,
    scales: ScaleGranularity,
    block_size: usize,
) -> Result<u64> {
    shape.check(dtype)?;
    scales.check(dtype)?;
    check_block_size(block_size)?;
    let mode = match (dtype.fp8_format(), scales) {
        (Some(_), ScaleGranularity::PerTensor) => ScaleMode::PerTensor(1.0),
        _ => ScaleMode::PerRow,
    };
    // Words of one pool block with and without the padding.
    let pad = |dtype: KvDtype, d: usize, mode: ScaleMode, rows: usize| -> u64 {
        let packed = rows * (dtype.words_per_row(d) + dtype.scale_words_per_row(d, mode));
        u((dtype.block_words(d, mode, rows) - packed) * 4)
    };
    match shape {
        CacheShape::Mha {
            layers,
            kv_heads,
            head_dim,
        } => product(&[
            2,
            u(layers),
            pad(dtype, head_dim, mode, kv_heads * block_size),
        ]),
        CacheShape::Mla {
            layers,
            rank,
            rope_dim,
        } => {
            // The RoPE part is 16-bit (f16) under a quantized latent, unscaled.
            let rope = if dtype.is_quantized() {
                KvDtype::F16
            } else {
                dtype
            };
            let latent = pad(dtype, rank, mode, block_size);
            let rope = pad(rope, rope_dim, ScaleMode::PerRow, block_size);
            product(&[u(layers), add(latent, rope)?])
        }
    }
}

/// Answers a query with all its parts. Zero tokens or sequences are an
/// [`Error::InvalidArgument`].
pub fn evaluate(q: &CapacityQuery) -> Result<Capacity> {
    if q.tokens_per_seq == 0 {
        return Err(invalid("tokens per sequence must be positive"));
    }
    if q.seqs == 0 {
        return Err(invalid("sequences must be positive"));
    }
    let payload = payload_bytes_per_token(q.shape, q.dtype)?;
    let scales = scale_bytes_per_token(q.shape, q.dtype, q.scales)?;
    let bpt = add(payload, scales)?;
    let tokens = round_to_blocks(q.tokens_per_seq, q.block_size)?;
    let padding = match q.block_size {
        Some(bs) => product(&[
            tokens / u(bs),
            block_padding_bytes(q.shape, q.dtype, q.scales, bs)?,
        ])?,
        None => 0,
    };
    let per_seq = add(product(&[bpt, tokens])?, padding)?;
    Ok(Capacity {
        values_per_token: q.shape.values_per_token()?,
        payload_bytes_per_token: payload,
        scale_bytes_per_token: scales,
        bytes_per_token: bpt,
        tokens_per_seq: tokens,
        bytes_per_seq: per_seq,
        total_bytes: product(&[per_seq, q.seqs])?,
    })
}

/// Bytes of the whole query: `bytes_per_token * tokens (rounded up to blocks) * seqs`.
pub fn total_bytes(q: &CapacityQuery) -> Result<u64> {
    evaluate(q).map(|c| c.total_bytes)
}

/// What fits a byte budget (see [`fit_budget`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct BudgetFit {
    /// Whole tokens that fit (rounded down to whole blocks when a block size is given).
    pub max_tokens: u64,
    /// Sequences of `tokens_per_seq` tokens (each rounded up to whole blocks) that fit.
    pub max_sequences: u64,
    /// Tokens one sequence occupies after block rounding.
    pub tokens_per_seq: u64,
    /// Bytes one sequence occupies.
    pub bytes_per_seq: u64,
}

/// How many tokens, and how many sequences of `tokens_per_seq` tokens, fit in `budget_bytes`.
/// A zero budget or zero tokens per sequence is an [`Error::InvalidArgument`].
pub fn fit_budget(
    shape: CacheShape,
    dtype: KvDtype,
    scales: ScaleGranularity,
    block_size: Option<usize>,
    budget_bytes: u64,
    tokens_per_seq: u64,
) -> Result<BudgetFit> {
    if budget_bytes == 0 {
        return Err(invalid("the byte budget must be positive"));
    }
    if tokens_per_seq == 0 {
        return Err(invalid("tokens per sequence must be positive"));
    }
    let bpt = bytes_per_token(shape, dtype, scales)?;
    let tokens = round_to_blocks(tokens_per_seq, block_size)?;
    let (max_tokens, bytes_per_seq) = match block_size {
        Some(bs) => {
            let pad = block_padding_bytes(shape, dtype, scales, bs)?;
            let per_block = add(product(&[bpt, u(bs)])?, pad)?;
            (
                budget_bytes / per_block * u(bs),
                add(product(&[bpt, tokens])?, product(&[tokens / u(bs), pad])?)?,
            )
        }
        None => (budget_bytes / bpt, product(&[bpt, tokens])?),
    };
    Ok(BudgetFit {
        max_tokens,
        max_sequences: budget_bytes / bytes_per_seq,
        tokens_per_seq: tokens,
        bytes_per_seq,
    })
}

/// Parses a byte count: an integer ("85899345920", `,` and `_` allowed as separators) or a
/// number with a unit, decimal (KB, MB, GB, TB) or binary (KiB, MiB, GiB, TiB), case-insensitive,
/// e.g. "80GiB", "2.36 GiB", "141GB". Fractions of a byte are rounded down; a plain byte count
/// must be whole.
pub fn parse_byte_size(s: &str) -> Result<u64> {
    let bad = || {
        invalid(format!(
            "{s:?} is not a byte count (e.g. 85899345920, 80GiB, 141GB)"
        ))
    };
    let t: String = s
        .trim()
        .chars()
        .filter(|c| *c != ',' && *c != '_')
        .collect();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let multiplier: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || frac.len() > 18 {
        return Err(bad());
    }
    let digits = format!("{int}{frac}");
    let mantissa: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| bad())?
    };
    let scale = 10u128.pow(frac.len() as u32);
    let scaled = mantissa.checked_mul(multiplier).ok_or_else(bad)?;
    if multiplier == 1 && scaled % scale != 0 {
        return Err(invalid(format!("{s:?}: a byte count must be whole")));
    }
    u64::try_from(scaled / scale).map_err(|_| invalid(format!("{s:?} bytes overflow u64")))
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

fn u(x: usize) -> u64 {
    x as u64
}

fn add(a: u64, b: u64) -> Result<u64> {
    a.checked_add(b)
        .ok_or_else(|| invalid("capacity overflows u64 bytes"))
}

fn product(xs: &[u64]) -> Result<u64> {
    xs.iter().try_fold(1u64, |acc, &x| {
        acc.checked_mul(x)
            .ok_or_else(|| invalid("capacity overflows u64 bytes"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool padding of ARCHITECTURE.md section 6 in the model: int8 at head dim 128 with 3
    /// KV heads and block size 1 pads each 99-word block to 100 words (4 bytes per K or V block
    /// per layer); unscaled f16 pads nothing.
    #[test]
    fn blocks_count_their_16_byte_padding() {
        let shape = mha(2, 3, 128);
        let pad = |dtype, bs| block_padding_bytes(shape, dtype, ScaleGranularity::PerTensor, bs);
        assert_eq!(pad(KvDtype::Int8, 1).unwrap(), 2 * 2 * 4);
        assert_eq!(pad(KvDtype::Int8, 4).unwrap(), 0);
        assert_eq!(pad(KvDtype::F16, 1).unwrap(), 0);
        let mut q = query(shape, KvDtype::Int8, 5, 3);
        q.block_size = Some(1);
        let c = evaluate(&q).unwrap();
        assert_eq!(c.bytes_per_seq, 5 * (c.bytes_per_token + 16));
        assert_eq!(c.total_bytes, 3 * c.bytes_per_seq);
        let fit = fit_budget(
            shape,
            KvDtype::Int8,
            ScaleGranularity::PerTensor,
            Some(1),
            10 * (c.bytes_per_token + 16) - 1,
            5,
        )
        .unwrap();
        assert_eq!((fit.max_tokens, fit.max_sequences), (9, 1));
        assert_eq!(fit.bytes_per_seq, c.bytes_per_seq);
    }

    const GIB: u64 = 1 << 30;
    const PT: ScaleGranularity = ScaleGranularity::PerTensor;
    const TOK: ScaleGranularity = ScaleGranularity::PerToken;

    fn mha(layers: usize, kv_heads: usize, head_dim: usize) -> CacheShape {
        CacheShape::Mha {
            layers,
            kv_heads,
            head_dim,
        }
    }

    const DEEPSEEK_V2: CacheShape = CacheShape::Mla {
        layers: 60,
        rank: 512,
        rope_dim: 64,
    };

    fn query(shape: CacheShape, dtype: KvDtype, tokens: u64, seqs: u64) -> CapacityQuery {
        CapacityQuery {
            shape,
            dtype,
            scales: PT,
            block_size: None,
            tokens_per_seq: tokens,
            seqs,
        }
    }

    fn bpt(shape: CacheShape, dtype: KvDtype) -> u64 {
        bytes_per_token(shape, dtype, PT).unwrap()
    }

    /// Seed 001 section 2: 2 x 32 x 8192 x 80 x 8 x 128 x 2 bytes = 85,899,345,920 = 80 GiB,
    /// the same in f16 and bf16.
    #[test]
    fn seed_001_llama_70b_shape_32_by_8192() {
        let shape = mha(80, 8, 128);
        for dtype in [KvDtype::F16, KvDtype::Bf16] {
            let q = query(shape, dtype, 8_192, 32);
            assert_eq!(total_bytes(&q).unwrap(), 85_899_345_920);
            assert_eq!(total_bytes(&q).unwrap(), 80 * GIB);
            assert_eq!(bpt(shape, dtype), 327_680);
        }
        // Already whole blocks of every size: block rounding changes nothing.
        for bs in [1, 16, 256] {
            let q = CapacityQuery {
                block_size: Some(bs),
                ..query(shape, KvDtype::Bf16, 8_192, 32)
            };
            assert_eq!(total_bytes(&q).unwrap(), 85_899_345_920);
        }
    }

    /// Seed 000 section 4: Qwen3-1.7B (28 layers, 8 KV heads, head dim 128) in bf16 is
    /// 114,688 bytes per token; vLLM's 22,048 tokens took 2.36 GiB of KV memory.
    #[test]
    fn seed_000_qwen3_1_7b() {
        let shape = mha(28, 8, 128);
        assert_eq!(bpt(shape, KvDtype::Bf16), 114_688);
        let total = total_bytes(&query(shape, KvDtype::Bf16, 22_048, 1)).unwrap();
        assert_eq!(total, 2_528_641_024);
        // 2.355 GiB: vLLM's "2.36 GiB" rounded, and a memory of 2.355 GiB holds exactly
        // these 22,048 tokens in blocks of 16.
        assert_eq!(format!("{:.3}", total as f64 / GIB as f64), "2.355");
        let logged = parse_byte_size("2.355GiB").unwrap();
        let fit = fit_budget(shape, KvDtype::Bf16, PT, Some(16), logged, 16).unwrap();
        assert_eq!(fit.max_tokens, 22_048);
        // 2.36 GiB / 22,048 tokens is about 114,900 bytes, within 0.25% of the formula.
        let measured = 2.36 * GIB as f64 / 22_048.0;
        assert!((measured / 114_688.0 - 1.0).abs() < 0.0025, "{measured}");
        // The same memory in FP8 (per-tensor scale) holds exactly twice the tokens, in blocks of
        // 16 as vLLM allocates them; vLLM measured 41,920 (1.9x), which does fit.
        let fit = |dtype| fit_budget(shape, dtype, PT, Some(16), total, 1).unwrap();
        assert_eq!(fit(KvDtype::Bf16).max_tokens, 22_048);
        assert_eq!(fit(KvDtype::Fp8E4M3).max_tokens, 44_096);
        assert!(fit(KvDtype::Fp8E5M2).max_tokens >= 41_920);
        assert_eq!(bpt(shape, KvDtype::Fp8E4M3), 57_344);
    }

    /// Seed 000 section 4: Llama 3.1 70B at its full 128K context is 40 GiB of KV in bf16.
    #[test]
    fn seed_000_llama_70b_128k_context() {
        let q = query(mha(80, 8, 128), KvDtype::Bf16, 128 * 1024, 1);
        assert_eq!(total_bytes(&q).unwrap(), 40 * GIB);
        assert_eq!(total_bytes(&q).unwrap(), 42_949_672_960);
    }

    /// Seed 000 section 4: DeepSeek-V2 stores (512 + 64) x 60 = 34,560 values per token, 67.5 KiB
    /// in bf16; the same heads as MHA (128 heads of 128) would be 1,966,080 values, about 57x.
    #[test]
    fn seed_000_deepseek_v2() {
        assert_eq!(DEEPSEEK_V2.values_per_token().unwrap(), 34_560);
        assert_eq!(bpt(DEEPSEEK_V2, KvDtype::Bf16), 69_120);
        assert_eq!(bpt(DEEPSEEK_V2, KvDtype::Bf16) * 2, 135 * 1024); // 67.5 KiB
        assert_eq!(bpt(DEEPSEEK_V2, KvDtype::F16), 69_120);
        assert_eq!(bpt(DEEPSEEK_V2, KvDtype::F32), 138_240);
        let as_mha = mha(60, 128, 128);
        assert_eq!(as_mha.values_per_token().unwrap(), 1_966_080);
        assert_eq!(bpt(as_mha, KvDtype::Bf16), 3_932_160);
        let ratio = 1_966_080.0 / 34_560.0_f64;
        assert_eq!(ratio.round(), 57.0);
        // Quantized latent: the RoPE part stays 16-bit, and only the latent row has scales.
        assert_eq!(bpt(DEEPSEEK_V2, KvDtype::Fp8E4M3), 60 * (512 + 64 * 2));
        assert_eq!(
            bytes_per_token(DEEPSEEK_V2, KvDtype::Fp8E4M3, TOK).unwrap(),
            60 * (512 + 64 * 2 + 4)
        );
        assert_eq!(bpt(DEEPSEEK_V2, KvDtype::Int8), 60 * (512 + 128 + 4));
        assert_eq!(bpt(DEEPSEEK_V2, KvDtype::Int4), 60 * (256 + 128 + 16 * 4));
    }

    /// Seed 000 section 4: "the same heads as MHA (128 heads, head dim 128): 1,966,080 values
    /// per token, about 1/57" -- by [`compare_to_mha`], in every dtype, from the formulas.
    #[test]
    fn deepseek_v2_vs_mha_equivalent() {
        let mha_shape = DEEPSEEK_V2.mha_equivalent(128, 128).unwrap();
        assert_eq!(mha_shape, mha(60, 128, 128));
        for dtype in KvDtype::ALL {
            let grans: &[ScaleGranularity] = if dtype.fp8_format().is_some() {
                &[PT, TOK]
            } else {
                &[PT]
            };
            for &scales in grans {
                let c = compare_to_mha(DEEPSEEK_V2, 128, 128, dtype, scales).unwrap();
                let mla_bytes = bytes_per_token(DEEPSEEK_V2, dtype, scales).unwrap();
                let mha_bytes = bytes_per_token(mha_shape, dtype, scales).unwrap();
                assert_eq!(c.mha, mha_shape);
                assert_eq!(c.mla_values_per_token, 34_560);
                assert_eq!(c.mha_values_per_token, 1_966_080);
                assert_eq!(c.mla_bytes_per_token, mla_bytes);
                assert_eq!(c.mha_bytes_per_token, mha_bytes);
                assert_eq!(c.ratio_values, 1_966_080.0 / 34_560.0);
                assert_eq!(c.ratio_bytes, mha_bytes as f64 / mla_bytes as f64);
            }
        }
        let bf16 = compare_to_mha(DEEPSEEK_V2, 128, 128, KvDtype::Bf16, PT).unwrap();
        assert_eq!(bf16.mha_bytes_per_token, 3_932_160);
        assert_eq!(format!("{:.1}", bf16.ratio_values), "56.9");
        assert_eq!(bf16.ratio_values.round(), 57.0); // the seed's "about 57x"

        // Every value is 2 bytes on both sides.
        assert_eq!(bf16.ratio_bytes, bf16.ratio_values);
        // FP8: the MHA cache halves, the latent does not (its RoPE part stays 16-bit).
        let fp8 = compare_to_mha(DEEPSEEK_V2, 128, 128, KvDtype::Fp8E4M3, PT).unwrap();
        assert_eq!(fp8.mha_bytes_per_token, 1_966_080);
        assert_eq!(fp8.mla_bytes_per_token, 38_400);
        assert_eq!(format!("{:.1}", fp8.ratio_bytes), "51.2");
        // Per-token FP8 scales: 2 x 60 x 128 rows on the MHA side, 60 latent rows.
        let tok = compare_to_mha(DEEPSEEK_V2, 128, 128, KvDtype::Fp8E4M3, TOK).unwrap();
        assert_eq!(tok.mha_bytes_per_token, 1_966_080 + 2 * 60 * 128 * 4);
        assert_eq!(tok.mla_bytes_per_token, 38_400 + 60 * 4);
    }

    #[test]
    fn mha_equivalent_errors() {
        let msg = |r: Result<CacheShape>| match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        assert!(msg(mha(60, 128, 128).mha_equivalent(128, 128)).contains("MLA"));
        assert!(msg(DEEPSEEK_V2.mha_equivalent(0, 128)).contains("query heads"));
        for (head_dim, want) in [(0, "positive"), (130, "multiple of 4")] {
            let m = msg(DEEPSEEK_V2.mha_equivalent(128, head_dim));
            assert!(m.contains(want) && m.contains("MHA equivalent"), "{m}");
        }
        // The int4 group rule applies to the MHA rows too, with the shape named.
        let e = compare_to_mha(DEEPSEEK_V2, 128, 48, KvDtype::Int4, PT).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("multiple of 32") && e.contains("MHA equivalent"),
            "{e}"
        );
        assert!(compare_to_mha(DEEPSEEK_V2, 128, 48, KvDtype::Int8, PT).is_ok());
        // Per-token scales are still FP8 only; overflow is an error, never a wrap.
        assert!(compare_to_mha(DEEPSEEK_V2, 128, 128, KvDtype::Bf16, TOK).is_err());
        let huge = compare_to_mha(DEEPSEEK_V2, usize::MAX, 128, KvDtype::F32, PT);
        assert!(huge.unwrap_err().to_string().contains("overflow"));
    }

    /// Seed 000 section 3: the numpy toy model (2 layers, head dim 16, f32, 1,024 tokens) has
    /// cache bytes 2 x 2 x KV heads x 16 x 1,024 x 4: MHA with 8 KV heads, MQA with 1.
    #[test]
    fn seed_000_toy_model() {
        let toy = |kv_heads| total_bytes(&query(mha(2, kv_heads, 16), KvDtype::F32, 1024, 1));
        assert_eq!(toy(8).unwrap(), 2_097_152);
        assert_eq!(toy(1).unwrap(), 262_144);
        for kv_heads in 1..=8 {
            assert_eq!(
                toy(kv_heads).unwrap(),
                2 * 2 * kv_heads as u64 * 16 * 1024 * 4
            );
        }
    }

    /// Seed 003: 32 layers, 8 KV heads, head dim 128, FP16: 8,000 tokens about 1.05 GB, 32,000
    /// about 4.19 GB (decimal GB).
    #[test]
    fn seed_003_context_growth() {
        let shape = mha(32, 8, 128);
        let gb = |tokens| {
            let b = total_bytes(&query(shape, KvDtype::F16, tokens, 1)).unwrap();
            (b, format!("{:.2}", b as f64 / 1e9))
        };
        assert_eq!(gb(8_000), (1_048_576_000, "1.05".to_string()));
        assert_eq!(gb(32_000), (4_194_304_000, "4.19".to_string()));
    }

    /// Seed 001 section 4: FP8 halves the dense payload of f16/bf16, 4-bit storage quarters it
    /// (before scales).
    #[test]
    fn seed_001_precision_ratios() {
        for shape in [mha(80, 8, 128), mha(30, 3, 64), DEEPSEEK_V2] {
            let p = |d| payload_bytes_per_token(shape, d).unwrap();
            assert_eq!(p(KvDtype::F32), 2 * p(KvDtype::Bf16));
            if let CacheShape::Mha { .. } = shape {
                assert_eq!(p(KvDtype::Bf16), 2 * p(KvDtype::Fp8E4M3));
                assert_eq!(p(KvDtype::Bf16), 4 * p(KvDtype::Int4));
            }
            assert_eq!(p(KvDtype::Fp8E4M3), p(KvDtype::Fp8E5M2));
            assert_eq!(p(KvDtype::Fp8E4M3), p(KvDtype::Int8));
        }
    }

    #[test]
    fn smollm2_135m() {
        let shape = mha(30, 3, 64);
        assert_eq!(bpt(shape, KvDtype::Bf16), 23_040);
        assert_eq!(bpt(shape, KvDtype::F32), 46_080);
        assert_eq!(bpt(shape, KvDtype::Fp8E4M3), 11_520);
        assert_eq!(
            bytes_per_token(shape, KvDtype::Fp8E4M3, TOK).unwrap(),
            11_520 + 180 * 4
        );
        assert_eq!(bpt(shape, KvDtype::Int8), 11_520 + 180 * 4);
        // 64 values: 32 bytes of int4 and two groups of 4 bytes per row.
        assert_eq!(bpt(shape, KvDtype::Int4), 180 * (32 + 8));
        let q = query(shape, KvDtype::Bf16, 2_048, 4);
        assert_eq!(total_bytes(&q).unwrap(), 23_040 * 2_048 * 4);
    }

    #[test]
    fn fp8_per_token_scale_overhead() {
        let shape = mha(80, 8, 128);
        for dtype in [KvDtype::Fp8E4M3, KvDtype::Fp8E5M2] {
            assert_eq!(scale_bytes_per_token(shape, dtype, PT).unwrap(), 0);
            assert_eq!(bytes_per_token(shape, dtype, PT).unwrap(), 163_840);
            // 2 x 80 x 8 rows of 4 bytes.
            assert_eq!(scale_bytes_per_token(shape, dtype, TOK).unwrap(), 5_120);
            assert_eq!(bytes_per_token(shape, dtype, TOK).unwrap(), 168_960);
        }
        for dtype in [
            KvDtype::F32,
            KvDtype::F16,
            KvDtype::Bf16,
            KvDtype::Int8,
            KvDtype::Int4,
        ] {
            let err = bytes_per_token(shape, dtype, TOK).unwrap_err().to_string();
            assert!(err.contains("FP8 only"), "{err}");
        }
        assert_eq!(bpt(shape, KvDtype::Int8), 168_960);
    }

    #[test]
    fn int4_group_overhead() {
        let shape = mha(80, 8, 128);
        // 64 bytes of values and 4 groups of 4 bytes per row, 1,280 rows.
        assert_eq!(
            payload_bytes_per_token(shape, KvDtype::Int4).unwrap(),
            81_920
        );
        assert_eq!(
            scale_bytes_per_token(shape, KvDtype::Int4, PT).unwrap(),
            20_480
        );
        assert_eq!(bpt(shape, KvDtype::Int4), 102_400);
        assert_eq!(bpt(mha(1, 1, 32), KvDtype::Int4), 2 * (16 + 4));
        assert!(bpt_err(mha(1, 1, 48), KvDtype::Int4).contains("multiple of 32"));
        assert_eq!(bpt(mha(1, 1, 48), KvDtype::Int8), 2 * (48 + 4));
    }

    fn bpt_err(shape: CacheShape, dtype: KvDtype) -> String {
        match bytes_per_token(shape, dtype, PT) {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn block_rounding() {
        assert_eq!(round_to_blocks(8_200, None).unwrap(), 8_200);
        assert_eq!(round_to_blocks(8_200, Some(16)).unwrap(), 8_208);
        assert_eq!(round_to_blocks(8_192, Some(16)).unwrap(), 8_192);
        assert_eq!(round_to_blocks(1, Some(256)).unwrap(), 256);
        assert_eq!(round_to_blocks(1, Some(1)).unwrap(), 1);
        for bad in [0, 3, 12, 512] {
            assert!(round_to_blocks(10, Some(bad)).is_err(), "{bad}");
        }
        let shape = mha(80, 8, 128);
        let q = CapacityQuery {
            block_size: Some(16),
            ..query(shape, KvDtype::F16, 8_200, 32)
        };
        let c = evaluate(&q).unwrap();
        assert_eq!(c.tokens_per_seq, 8_208);
        assert_eq!(c.total_bytes, 327_680 * 8_208 * 32);
        let unrounded = evaluate(&query(shape, KvDtype::F16, 8_200, 32)).unwrap();
        assert_eq!(unrounded.total_bytes, 327_680 * 8_200 * 32);
    }

    #[test]
    fn budgets() {
        let shape = mha(80, 8, 128);
        // Exactly the seed's 80 GiB: 32 sequences of 8,192 tokens, 262,144 tokens.
        let fit = fit_budget(shape, KvDtype::Bf16, PT, None, 80 * GIB, 8_192).unwrap();
        assert_eq!(
            fit,
            BudgetFit {
                max_tokens: 262_144,
                max_sequences: 32,
                tokens_per_seq: 8_192,
                bytes_per_seq: 2_684_354_560,
            }
        );
        // One byte short: one token and one sequence fewer.
        let fit = fit_budget(shape, KvDtype::Bf16, PT, None, 80 * GIB - 1, 8_192).unwrap();
        assert_eq!((fit.max_tokens, fit.max_sequences), (262_143, 31));
        // Blocks of 16: tokens round down to whole blocks, sequences of 8,200 use 8,208 slots.
        let fit = fit_budget(shape, KvDtype::Bf16, PT, Some(16), 80 * GIB - 1, 8_200).unwrap();
        assert_eq!(fit.max_tokens, 262_128);
        assert_eq!(fit.tokens_per_seq, 8_208);
        assert_eq!(fit.max_sequences, (80 * GIB - 1) / (327_680 * 8_208));
        // FP8 doubles the tokens of bf16.
        let fit = fit_budget(shape, KvDtype::Fp8E4M3, PT, None, 80 * GIB, 8_192).unwrap();
        assert_eq!((fit.max_tokens, fit.max_sequences), (524_288, 64));
        // Too small for one token.
        let fit = fit_budget(shape, KvDtype::Bf16, PT, None, 327_679, 1).unwrap();
        assert_eq!((fit.max_tokens, fit.max_sequences), (0, 0));
        assert!(fit_budget(shape, KvDtype::Bf16, PT, None, 0, 1).is_err());
        assert!(fit_budget(shape, KvDtype::Bf16, PT, None, 1, 0).is_err());
        // A sequence whose bytes overflow u64.
        assert!(fit_budget(shape, KvDtype::Bf16, PT, None, u64::MAX, u64::MAX / 2).is_err());
    }

    #[test]
    fn invalid_sizes_and_overflow() {
        for shape in [
            mha(0, 8, 128),
            mha(80, 0, 128),
            mha(80, 8, 0),
            mha(80, 8, 130),
        ] {
            bpt_err(shape, KvDtype::F16);
        }
        for (rank, rope_dim) in [(0, 64), (512, 0), (510, 64), (512, 66)] {
            bpt_err(
                CacheShape::Mla {
                    layers: 60,
                    rank,
                    rope_dim,
                },
                KvDtype::Bf16,
            );
        }
        assert!(bpt_err(
            CacheShape::Mla {
                layers: 60,
                rank: 500,
                rope_dim: 64
            },
            KvDtype::Int4
        )
        .contains("multiple of 32"));
        // Overflow anywhere is an error, never a wrap or a panic.
        assert!(bpt_err(mha(usize::MAX, 8, 128), KvDtype::F32).contains("overflow"));
        assert!(bpt_err(mha(1 << 40, 1 << 20, 1 << 10), KvDtype::F32).contains("overflow"));
        let q = query(mha(80, 8, 128), KvDtype::F16, u64::MAX / 2, 1);
        assert!(total_bytes(&q).is_err());
        let q = query(mha(80, 8, 128), KvDtype::F16, 1 << 20, u64::MAX / 2);
        assert!(total_bytes(&q).is_err());
        let q = CapacityQuery {
            block_size: Some(256),
            ..query(mha(1, 1, 4), KvDtype::F32, u64::MAX - 1, 1)
        };
        assert!(total_bytes(&q).is_err());
        assert!(total_bytes(&query(mha(80, 8, 128), KvDtype::F16, 0, 1)).is_err());
        assert!(total_bytes(&query(mha(80, 8, 128), KvDtype::F16, 1, 0)).is_err());
    }

    #[test]
    fn scale_names() {
        for s in [PT, TOK] {
            assert_eq!(s.name().parse::<ScaleGranularity>().unwrap(), s);
            assert_eq!(s.to_string(), s.name());
        }
        assert_eq!("PER_TOKEN".parse::<ScaleGranularity>().unwrap(), TOK);
        assert!("per-group".parse::<ScaleGranularity>().is_err());
        assert_eq!(PT.effective(KvDtype::Bf16), "none");
        assert_eq!(TOK.effective(KvDtype::Fp8E5M2), "per-token");
        assert_eq!(PT.effective(KvDtype::Int8), "per-token");
        assert_eq!(PT.effective(KvDtype::Int4), "per-group-32");
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("85899345920").unwrap(), 85_899_345_920);
        assert_eq!(parse_byte_size("85,899,345,920").unwrap(), 85_899_345_920);
        assert_eq!(parse_byte_size("80GiB").unwrap(), 80 * GIB);
        assert_eq!(parse_byte_size("80 gib").unwrap(), 80 * GIB);
        assert_eq!(parse_byte_size("141GB").unwrap(), 141_000_000_000);
        assert_eq!(parse_byte_size("1.5KiB").unwrap(), 1_536);
        assert_eq!(parse_byte_size("2.36GiB").unwrap(), 2_534_030_704);
        assert!(parse_byte_size("0.5B").is_err());
        assert_eq!(parse_byte_size("1TiB").unwrap(), 1 << 40);
        assert!(parse_byte_size("16EiB").is_err());
        for bad in [
            "",
            "GiB",
            "1.2.3GB",
            "-5",
            "1e9",
            "12 parsecs",
            "99999999999999999999",
        ] {
            assert!(parse_byte_size(bad).is_err(), "{bad:?}");
        }
    }
}
