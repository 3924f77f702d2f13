//! CPU dequantization of the ggml tensor types kvattn reads: plain F32, F16 and BF16, the blocks
//! of 32 ([`legacy`]: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants of 256 ([`kquants`]:
//! Q4_K, Q5_K, Q6_K), the types of the Q4_0 ... Q8_0, Q4_K_M, Q5_K_M and Q6_K files people
//! download.
//!
//! This is the definition the GPU kernels are checked against: every value is computed with the
//! f32 operations, in the order, that ggml's reference dequantization uses (a scale is an f16
//! widened to f32, a sub-block scale one f32 product, a value one product and at most one sum).
//! It is written from the format definitions and cross-checked, bit for bit, against golden
//! vectors produced by PyPI's `gguf` package (`scripts/gguf-golden.py`,
//! `tests/data/gguf_golden.bin`).

pub mod kquants;
pub mod legacy;
pub mod quantize;

use half::{bf16, f16};

use super::gguf::GgmlType;
use crate::{Error, Result};

/// The types [`dequantize`] reads.
pub const SUPPORTED: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// The f16 at the start of `b` (little-endian), widened to f32.
pub(crate) fn f16_at(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Decodes one block (`block_bytes` long) into `out` (`block_size` long).
type BlockFn = fn(&[u8], &mut [f32]);

/// The block decoder of a quantized type in [`SUPPORTED`].
fn block_fn(ty: GgmlType) -> Option<BlockFn> {
    Some(match ty {
        GgmlType::Q4_0 => legacy::q4_0,
        GgmlType::Q4_1 => legacy::q4_1,
        GgmlType::Q5_0 => legacy::q5_0,
        GgmlType::Q5_1 => legacy::q5_1,
        GgmlType::Q8_0 => legacy::q8_0,
        GgmlType::Q4_K => kquants::q4_k,
        GgmlType::Q5_K => kquants::q5_k,
        GgmlType::Q6_K => kquants::q6_k,
        _ => return None,
    })
}

/// Dequantizes `n` elements of type `ty` from `data` (exactly the bytes `n` elements take).
///
/// # Errors
/// [`Error::Gguf`] naming the type when it is not in [`SUPPORTED`], when `n` is not a whole
/// number of blocks, or when `data` is not exactly `n` elements long.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n];
    dequantize_into(ty, data, &mut out)?;
    Ok(out)
}

/// [`dequantize`] into a caller's buffer: `out.len()` elements from `data`. On an error `out`
/// is left untouched.
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let plain = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    let decode = block_fn(ty);
    if !plain && decode.is_none() {
        let names: Vec<&str> = SUPPORTED.iter().map(|t| t.name()).collect();
        return Err(Error::Gguf(format!(
            "dequantizing ggml type {ty} (id {}) is not supported (supported: {})",
            ty.id(),
            names.join(", ")
        )));
    }
    let need = ty.bytes_for(out.len() as u64)?;
    if data.len() as u64 != need {
        return Err(Error::Gguf(format!(
            "{} elements of {ty} need {need} bytes, got {}",
            out.len(),
            data.len()
        )));
    }
    match (ty, decode) {
        (GgmlType::F32, _) => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        (GgmlType::F16, _) => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16_at(b);
            }
        }
        (GgmlType::BF16, _) => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        (_, Some(decode)) => {
            let (bs, bb) = (ty.block_size() as usize, ty.block_bytes() as usize);
            for (o, b) in out.chunks_exact_mut(bs).zip(data.chunks_exact(bb)) {
                decode(b, o);
            }
        }
        (_, None) => unreachable!("refused above"),
    }
    Ok(())
}

#[cfg(test)]
mod tests;
