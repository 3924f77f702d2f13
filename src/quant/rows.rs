//! Whole token rows: encode `[n, head_dim]` f32 values into pool words and scale words, and
//! decode them back exactly as the WGSL `kv_load4` does.

use super::bf16::{bf16_bits_to_f32, f32_to_bf16_bits};
use super::f16::{f16_bits_to_f32, f32_to_f16_bits};
use super::fp8_scale::Fp8Scale;
use super::int4::{decode_int4, encode_int4, Int4Params, INT4_GROUP};
use super::int8::{decode_int8, encode_int8, Int8Scale};
use super::pack::{byte_at, half_at, nibble_at, pack_bytes, pack_halves, pack_nibbles};
use super::{KvDtype, ScaleMode};
use crate::{Error, Result};

/// Token rows in a storage format, laid out as a pool holds them: row `r` is
/// `words[r * wpr .. (r + 1) * wpr]` with `wpr = dtype.words_per_row(head_dim)`, and its scales
/// are `scales[r * spr .. (r + 1) * spr]` with `spr = dtype.scale_words_per_row(head_dim,
/// scale_mode)`.
///
/// Scale words: f32 bits for FP8 (per row) and Int8; one word per group of 32 for Int4 (f16 scale
/// low, f16 min high). For per-tensor FP8 `scales` is empty and the scale is in `scale_mode`
/// (the GPU kernels read it from a uniform: see [`EncodedRows::scale_pool_words`]). In a GPU
/// pool the scale words of a block follow its value words (see `shaders/lib/kv_load.wgsl`).
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedRows {
    /// The storage format.
    pub dtype: KvDtype,
    /// Values per row.
    pub head_dim: usize,
    /// `PerTensor(scale)` for per-tensor FP8, `PerRow` otherwise.
    pub scale_mode: ScaleMode,
    /// The packed values, `words_per_row` per row.
    pub words: Vec<u32>,
    /// The scale words, `scale_words_per_row` per row.
    pub scales: Vec<u32>,
}

impl EncodedRows {
    /// Number of rows (`words.len() / words_per_row`).
    pub fn num_rows(&self) -> usize {
        self.words.len() / self.dtype.words_per_row(self.head_dim).max(1)
    }

    /// The scale words as the dequantize kernel's second binding takes them: the per-row scale
    /// words, or for per-tensor FP8 a single word holding the tensor scale's f32 bits.
    pub fn scale_pool_words(&self) -> Vec<u32> {
        match self.scale_mode {
            ScaleMode::PerTensor(s) => vec![s.to_bits()],
            ScaleMode::PerRow => self.scales.clone(),
        }
    }

    /// The rows as a pool of one-row blocks holds them (`kv_load.wgsl` with `KV_BLOCK_ROWS = 1`):
    /// each row's value words, zero words up to its [`row_stride`](KvDtype::row_stride), its
    /// scale words and zero words up to the block's [`block_words`](KvDtype::block_words) (a
    /// multiple of 4).
    pub fn interleaved_words(&self) -> Vec<u32> {
        let wpr = self.dtype.words_per_row(self.head_dim);
        let stride = self.dtype.row_stride(self.head_dim);
        let spr = self
            .dtype
            .scale_words_per_row(self.head_dim, self.scale_mode);
        let bw = self.dtype.block_words(self.head_dim, self.scale_mode, 1);
        let mut out = vec![0; self.num_rows() * bw];
        for (r, block) in out.chunks_mut(bw).enumerate() {
            block[..wpr].copy_from_slice(&self.words[r * wpr..(r + 1) * wpr]);
            block[stride..stride + spr].copy_from_slice(&self.scales[r * spr..(r + 1) * spr]);
        }
        out
    }

    /// Checks head dim, scale mode and that `words` and `scales` hold a whole number of rows.
    pub fn validate(&self) -> Result<()> {
        self.dtype.check_head_dim(self.head_dim)?;
        self.dtype.check_scale_mode(self.scale_mode)?;
        let wpr = self.dtype.words_per_row(self.head_dim);
        if self.words.len() % wpr != 0 {
            return Err(Error::ShapeMismatch {
                what: "encoded words (a whole number of rows)",
                expected: self.words.len().div_ceil(wpr) * wpr,
                got: self.words.len(),
            });
        }
        let spr = self
            .dtype
            .scale_words_per_row(self.head_dim, self.scale_mode);
        if self.scales.len() != self.num_rows() * spr {
            return Err(Error::ShapeMismatch {
                what: "encoded scale words",
                expected: self.num_rows() * spr,
                got: self.scales.len(),
            });
        }
        Ok(())
    }

    /// Decodes row `r` (see [`decode_rows`]).
    pub fn decode_row(&self, r: usize) -> Result<Vec<f32>> {
        self.validate()?;
        if r >= self.num_rows() {
            return Err(Error::InvalidArgument(format!(
                "row {r} out of range ({} rows)",
                self.num_rows()
            )));
        }
        let mut out = vec![0.0; self.head_dim];
        decode_row_into(self, r, &mut out);
        Ok(out)
    }
}

/// Encodes `x` (`[n, head_dim]` row-major, `n >= 0`) in `dtype`.
///
/// Errors: `UnsupportedHeadDim` for a head dim the format refuses; `ShapeMismatch` when `x.len()`
/// is not a multiple of `head_dim`; `InvalidArgument` for a scale mode the dtype does not take
/// (see [`KvDtype::check_scale_mode`]). Every value is accepted; what the formats make of NaN,
/// infinities and f32's extremes (README, "NaN, infinities and extreme values"):
/// f32 keeps them; f16 and bf16 round finite values past their range to ±infinity and keep
/// NaN; FP8 saturates finite values to ±max, keeps ±infinity in E5M2 and makes it NaN in E4M3,
/// keeps NaN, and a row's dynamic scale ignores non-finite values and stays small enough that
/// max times scale is finite; int8 stores a row holding NaN or ±infinity with a NaN scale
/// ([`Int8Scale::POISON`]: the whole row reads NaN); int4 does the same per group of 32 for NaN,
/// ±infinity and values beyond f16's range ([`Int4Params::POISON`]).
pub fn encode_rows(
    dtype: KvDtype,
    head_dim: usize,
    x: &[f32],
    mode: ScaleMode,
) -> Result<EncodedRows> {
    dtype.check_head_dim(head_dim)?;
    dtype.check_scale_mode(mode)?;
    if x.len() % head_dim != 0 {
        return Err(Error::ShapeMismatch {
            what: "rows of head_dim values",
            expected: x.len().div_ceil(head_dim) * head_dim,
            got: x.len(),
        });
    }
    let mut scales = Vec::new();
    let words = match dtype {
        KvDtype::F32 => x.iter().map(|v| v.to_bits()).collect(),
        KvDtype::F16 => pack_halves(&x.iter().map(|&v| f32_to_f16_bits(v)).collect::<Vec<_>>()),
        KvDtype::Bf16 => pack_halves(&x.iter().map(|&v| f32_to_bf16_bits(v)).collect::<Vec<_>>()),
        KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 => {
            let fmt = dtype.fp8_format().expect("fp8 dtype");
            let tensor = match mode {
                ScaleMode::PerTensor(s) => Some(Fp8Scale::per_tensor(s)?),
                ScaleMode::PerRow => None,
            };
            let mut codes = Vec::with_capacity(x.len());
            for row in x.chunks(head_dim) {
                let s = tensor.unwrap_or_else(|| {
                    let s = Fp8Scale::for_row(fmt, row);
                    scales.push(s.scale.to_bits());
                    s
                });
                codes.extend(row.iter().map(|&v| fmt.encode_scaled(v, s.inv_scale)));
            }
            pack_bytes(&codes)
        }
        KvDtype::Int8 => {
            let mut codes = Vec::with_capacity(x.len());
            for row in x.chunks(head_dim) {
                let s = Int8Scale::for_row(row);
                scales.push(s.scale.to_bits());
                codes.extend(row.iter().map(|&v| encode_int8(v, s) as u8));
            }
            pack_bytes(&codes)
        }
        KvDtype::Int4 => {
            let mut codes = Vec::with_capacity(x.len());
            for group in x.chunks(INT4_GROUP) {
                let p = Int4Params::for_group(group);
                scales.push(p.to_word());
                codes.extend(group.iter().map(|&v| encode_int4(v, &p)));
            }
            pack_nibbles(&codes)
        }
    };
    Ok(EncodedRows {
        dtype,
        head_dim,
        scale_mode: mode,
        words,
        scales,
    })
}

/// Encodes int8 rows with given scales (one per row), for instance a GPU's own scale and
/// reciprocal read back, to check its codes. Errors as [`encode_rows`], plus `ShapeMismatch`
/// when `scales` does not hold one entry per row.
pub fn encode_int8_rows_with(
    head_dim: usize,
    x: &[f32],
    scales: &[Int8Scale],
) -> Result<EncodedRows> {
    let mut out = encode_rows(KvDtype::Int8, head_dim, x, ScaleMode::PerRow)?;
    check_len("int8 scales (one per row)", out.scales.len(), scales.len())?;
    let codes: Vec<u8> = x
        .chunks(head_dim)
        .zip(scales)
        .flat_map(|(row, &s)| row.iter().map(move |&v| encode_int8(v, s) as u8))
        .collect();
    out.words = pack_bytes(&codes);
    out.scales = scales.iter().map(|s| s.scale.to_bits()).collect();
    Ok(out)
}

/// Encodes int4 rows with given group parameters (one per group of 32, row-major), for instance
/// a GPU's own f16 scale/min and reciprocal, to check its codes. Errors as [`encode_rows`], plus
/// `ShapeMismatch` when `params` does not hold one entry per group.
pub fn encode_int4_rows_with(
    head_dim: usize,
    x: &[f32],
    params: &[Int4Params],
) -> Result<EncodedRows> {
    let mut out = encode_rows(KvDtype::Int4, head_dim, x, ScaleMode::PerRow)?;
    check_len(
        "int4 group parameters (one per group of 32)",
        out.scales.len(),
        params.len(),
    )?;
    let codes: Vec<u8> = x
        .chunks(INT4_GROUP)
        .zip(params)
        .flat_map(|(g, p)| g.iter().map(move |&v| encode_int4(v, p)))
        .collect();
    out.words = pack_nibbles(&codes);
    out.scales = params.iter().map(|p| p.to_word()).collect();
    Ok(out)
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            what,
            expected,
            got,
        })
    }
}

/// Decodes every row, in the same operations and order as the WGSL `kv_load4`: FP8
/// `decode(q) * scale`, int8 `q as f32 * scale`, int4 `fma(q, scale_h, min_h)`, f16/bf16 exact.
/// Errors when `rows` fails [`EncodedRows::validate`].
pub fn decode_rows(rows: &EncodedRows) -> Result<Vec<f32>> {
    rows.validate()?;
    let mut out = vec![0.0; rows.num_rows() * rows.head_dim];
    for (r, dst) in out.chunks_mut(rows.head_dim).enumerate() {
        decode_row_into(rows, r, dst);
    }
    Ok(out)
}

/// Decodes row `r` of validated rows into `out` (`head_dim` values).
fn decode_row_into(rows: &EncodedRows, r: usize, out: &mut [f32]) {
    let d = rows.head_dim;
    let wpr = rows.dtype.words_per_row(d);
    let spr = rows.dtype.scale_words_per_row(d, rows.scale_mode);
    let w = &rows.words[r * wpr..(r + 1) * wpr];
    let s = &rows.scales[r * spr..(r + 1) * spr];
    match rows.dtype {
        KvDtype::F32 => {
            for (o, &b) in out.iter_mut().zip(w) {
                *o = f32::from_bits(b);
            }
        }
        KvDtype::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_bits_to_f32(half_at(w, i));
            }
        }
        KvDtype::Bf16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16_bits_to_f32(half_at(w, i));
            }
        }
        KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 => {
            let fmt = rows.dtype.fp8_format().expect("fp8 dtype");
            let scale = match rows.scale_mode {
                ScaleMode::PerTensor(t) => t,
                ScaleMode::PerRow => f32::from_bits(s[0]),
            };
            for (i, o) in out.iter_mut().enumerate() {
                *o = fmt.decode(byte_at(w, i)) * scale;
            }
        }
        KvDtype::Int8 => {
            let scale = f32::from_bits(s[0]);
            for (i, o) in out.iter_mut().enumerate() {
                *o = decode_int8(byte_at(w, i) as i8, scale);
            }
        }
        KvDtype::Int4 => {
            for (i, o) in out.iter_mut().enumerate() {
                let p = Int4Params::from_word(s[i / INT4_GROUP]);
                *o = decode_int4(nibble_at(w, i), p.scale(), p.min());
            }
        }
    }
}
