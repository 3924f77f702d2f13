//! CPU quantization to the block formats a model can be re-encoded in: Q8_0, Q5_0 and Q4_K
//! (with [`dequantize`](super::dequantize) the round trip the tests bound). Used to make the
//! Q8_0 and Q4_K versions of a model the benchmarks compare (`examples/requantize.rs`).
//!
//! Written from the format definitions ([`super::legacy`], [`super::kquants`]):
//! - **Q8_0**: `d = max |x| / 127`, codes `round(x / d)`.
//! - **Q5_0**: `d = -v / 16` for `v` the value of largest magnitude (so `v` gets code 0),
//!   codes `floor(x / d + 16.5)` at most 31.
//! - **Q4_K**: each sub-block of 32 spans `[min(0, min x), max x]` in 15 steps; the block's
//!   `d` and `dmin` are the largest sub-block step and offset over 63, each sub-block's 6-bit
//!   scale and min are rounded against those (f16-rounded) values, and the codes
//!   `round((x + dmin m) / (d sc))`, clamped to 0..15, against the rounded scales.
//!
//! Values must be finite: a NaN or an infinity would make a whole block's scale non-finite, so
//! it is refused, naming the value's index.

use half::f16;

use super::kquants::QK_K;
use super::legacy::QK;
use crate::decoder::gguf::GgmlType;
use crate::{Error, Result};

/// The types [`quantize`] writes.
pub const QUANTIZE_TYPES: [GgmlType; 3] = [GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_K];

/// `values` (a whole number of blocks) in the block format `ty`, the bytes a GGUF file holds.
///
/// # Errors
/// [`Error::InvalidArgument`] when `ty` is not one of [`QUANTIZE_TYPES`], `values` is not a
/// whole number of blocks, or a value is NaN or infinite (its index named).
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>> {
    if !QUANTIZE_TYPES.contains(&ty) {
        let names: Vec<&str> = QUANTIZE_TYPES.iter().map(|t| t.name()).collect();
        return Err(Error::InvalidArgument(format!(
            "quantizing to {ty} is not supported (types: {})",
            names.join(", ")
        )));
    }
    let bs = ty.block_size() as usize;
    if values.len() % bs != 0 {
        return Err(Error::InvalidArgument(format!(
            "{} values are not whole blocks of {bs} ({ty})",
            values.len()
        )));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "value {i} is {}: only finite values can be quantized",
            values[i]
        )));
    }
    let mut out = Vec::with_capacity(ty.bytes_for(values.len() as u64)? as usize);
    for block in values.chunks_exact(bs) {
        match ty {
            GgmlType::Q8_0 => q8_0(block, &mut out),
            GgmlType::Q5_0 => q5_0(block, &mut out),
            _ => q4_k(block, &mut out),
        }
    }
    Ok(out)
}

/// `1 / d`, or 0 for a zero scale (a block of zeros gets codes of zero).
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

fn push_f16(out: &mut Vec<u8>, v: f32) {
    out.extend(f16::from_f32(v).to_bits().to_le_bytes());
}

fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    push_f16(out, d);
    out.extend(
        x.iter()
            .map(|&v| (v * id).round().clamp(-127.0, 127.0) as i8 as u8),
    );
}

fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let max = x
        .iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let d = max / -16.0;
    let id = inverse(d);
    push_f16(out, d);
    let q: Vec<u8> = x
        .iter()
        .map(|&v| (v * id + 16.5).floor().clamp(0.0, 31.0) as u8)
        .collect();
    let mut qh = 0u32;
    for (j, &c) in q.iter().enumerate() {
        qh |= u32::from(c >> 4) << j;
    }
    out.extend(qh.to_le_bytes());
    out.extend((0..QK / 2).map(|j| (q[j] & 0x0F) | (q[j + QK / 2] & 0x0F) << 4));
}

fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    // Each sub-block's step and offset: [min(0, min), max] in 15 steps.
    let mut step = [0f32; 8];
    let mut offset = [0f32; 8];
    for (s, sub) in x.chunks_exact(QK).enumerate() {
        let lo = sub.iter().fold(0f32, |m, &v| m.min(v));
        let hi = sub.iter().fold(f32::MIN, |m, &v| m.max(v));
        step[s] = ((hi - lo) / 15.0).max(0.0);
        offset[s] = -lo;
    }
    let max_step = step.iter().fold(0f32, |m, &v| m.max(v));
    let max_offset = offset.iter().fold(0f32, |m, &v| m.max(v));
    // The stored (f16) super-block scales; sub-block scales and mins are rounded against them.
    let d = f16::from_f32(max_step / 63.0).to_f32();
    let dmin = f16::from_f32(max_offset / 63.0).to_f32();
    let six = |v: f32, unit: f32| (v * inverse(unit)).round().clamp(0.0, 63.0) as u8;
    let sc: Vec<u8> = step.iter().map(|&v| six(v, d)).collect();
    let m: Vec<u8> = offset.iter().map(|&v| six(v, dmin)).collect();
    push_f16(out, d);
    push_f16(out, dmin);
    let mut packed = [0u8; 12];
    for s in 0..8 {
        if s < 4 {
            packed[s] = sc[s];
            packed[s + 4] = m[s];
        } else {
            packed[s + 4] = (sc[s] & 0x0F) | (m[s] & 0x0F) << 4;
            packed[s - 4] |= (sc[s] >> 4) << 6;
            packed[s] |= (m[s] >> 4) << 6;
        }
    }
    out.extend(packed);
    // Codes against the scales the decoder will use: d * sc and dmin * m.
    let mut q = [0u8; QK_K];
    for (s, sub) in x.chunks_exact(QK).enumerate() {
        let (scale, off) = (d * f32::from(sc[s]), dmin * f32::from(m[s]));
        let is = inverse(scale);
        for (l, &v) in sub.iter().enumerate() {
            q[QK * s + l] = ((v + off) * is).round().clamp(0.0, 15.0) as u8;
        }
    }
    for p in 0..4 {
        out.extend((0..32).map(|l| q[64 * p + l] | q[64 * p + 32 + l] << 4));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::blocks::dequantize;

    /// Normal-ish values from a fixed LCG (Box-Muller).
    fn normals(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut uniform = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (a, b) = (uniform(), uniform());
                ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
            })
            .collect()
    }

    /// RMS of the round-trip error over the RMS of the values.
    fn relative_rms(ty: GgmlType, x: &[f32]) -> f64 {
        let q = quantize(ty, x).unwrap();
        assert_eq!(q.len() as u64, ty.bytes_for(x.len() as u64).unwrap());
        let y = dequantize(ty, &q, x.len()).unwrap();
        let err: f64 = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| f64::from(a - b).powi(2))
            .sum();
        let norm: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
        (err / norm).sqrt()
    }

    #[test]
    fn round_trip_error_is_what_the_code_width_allows() {
        let x = normals(256 * 64, 7);
        // Uniform rounding error of a step s has RMS s / sqrt(12): Q8_0's step is about
        // 3.5 sigma / 127, Q5_0's 3.5 sigma / 16, Q4_K's 4.5 sigma / 15 (and its 6-bit scales).
        for (ty, bound) in [
            (GgmlType::Q8_0, 0.012),
            (GgmlType::Q5_0, 0.07),
            (GgmlType::Q4_K, 0.13),
        ] {
            let e = relative_rms(ty, &x);
            println!("{ty}: relative RMS round-trip error {e:.4}");
            assert!(e < bound, "{ty}: relative RMS error {e}");
            assert!(
                e > bound / 20.0,
                "{ty}: relative RMS error {e} is implausibly small"
            );
        }
    }

    #[test]
    fn a_value_is_within_half_a_step_of_its_code() {
        // Q8_0 and Q5_0 have one scale per block: every value is at most half a step (plus
        // the f16 rounding of the scale) from its decoded value, except, in Q5_0, values on
        // the side opposite the largest magnitude past code 31 (15 steps), clamped there.
        let x = normals(32 * 40, 11);
        for (ty, levels) in [(GgmlType::Q8_0, 127.0), (GgmlType::Q5_0, 16.0)] {
            let y = dequantize(ty, &quantize(ty, &x).unwrap(), x.len()).unwrap();
            for (b, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let step = amax / levels;
                for (a, r) in xs.iter().zip(ys) {
                    let clamped = if ty == GgmlType::Q5_0 {
                        (a.abs() - 15.5 * step).max(0.0)
                    } else {
                        0.0
                    };
                    assert!(
                        (a - r).abs() <= 0.5 * step * 1.01 + amax * 1e-3 + clamped,
                        "{ty} block {b}: {a} -> {r} (step {step})"
                    );
                }
            }
        }
    }

    #[test]
    fn zeros_and_constant_blocks() {
        for ty in QUANTIZE_TYPES {
            let n = ty.block_size() as usize;
            let y = dequantize(ty, &quantize(ty, &vec![0.0; n]).unwrap(), n).unwrap();
            assert!(y.iter().all(|&v| v == 0.0), "{ty}: {y:?}");
            // A block of one value (the extreme code): within 1% of it.
            for c in [0.75f32, -2.5] {
                let y = dequantize(ty, &quantize(ty, &vec![c; n]).unwrap(), n).unwrap();
                assert!(
                    y.iter().all(|&v| (v - c).abs() <= 0.01 * c.abs()),
                    "{ty} {c}: {y:?}"
                );
            }
        }
    }

    #[test]
    fn k_scales_use_all_six_bits() {
        // Sub-blocks of very different ranges: the 6-bit scales and mins of sub-blocks 4..7
        // (split over two bytes) must decode to what was meant, so each sub-block's error stays
        // within its own step.
        let mut x = normals(256, 3);
        for (s, sub) in x.chunks_mut(32).enumerate() {
            let scale = [1.0, 0.05, 3.0, 0.4, 2.0, 0.02, 1.5, 0.7][s];
            sub.iter_mut().for_each(|v| *v = *v * scale - 0.3 * scale);
        }
        let y = dequantize(GgmlType::Q4_K, &quantize(GgmlType::Q4_K, &x).unwrap(), 256).unwrap();
        for (s, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let lo = xs.iter().fold(0f32, |m, &v| m.min(v));
            let hi = xs.iter().fold(f32::MIN, |m, &v| m.max(v));
            // Half a step, plus the rounding of the 6-bit scale and min against the block's
            // largest (at most half a unit of 1/63 of the largest, over 15 steps and the min).
            let slack = 0.5 * (hi - lo) / 15.0 + 3.0 * 0.5 / 63.0 * 3.5 * 1.1;
            for (a, r) in xs.iter().zip(ys) {
                assert!((a - r).abs() <= slack, "sub-block {s}: {a} -> {r}");
            }
        }
    }

    #[test]
    fn bad_input_is_refused() {
        let e = quantize(GgmlType::Q6_K, &[0.0; 256])
            .unwrap_err()
            .to_string();
        assert!(e.contains("Q6_K"), "{e}");
        assert!(quantize(GgmlType::Q8_0, &[0.0; 48]).is_err());
        let mut x = vec![1.0; 64];
        x[37] = f32::NAN;
        let e = quantize(GgmlType::Q8_0, &x).unwrap_err().to_string();
        assert!(e.contains("37"), "{e}");
        x[37] = f32::INFINITY;
        assert!(quantize(GgmlType::Q4_K, &[f32::INFINITY; 256]).is_err());
        assert!(quantize(GgmlType::Q5_0, &x).is_err());
    }
}
