//! FP8 scales: a static per-tensor scale, or a dynamic power-of-two scale per token row.
//!
//! Stored value = `encode(x * inv_scale)`, read value = `decode(q) * scale`. Dynamic scales are
//! `2^ceil(log2(amax / fmt_max))`, found from the exponent and mantissa bits of `amax` with integer
//! operations only (no division, no `log2`), so the GPU finds the same scale, and `x * inv_scale`
//! is exact.

use super::fp8::Fp8Format;
use crate::{Error, Result};

/// A scale and its reciprocal, both f32. The reciprocal is computed once (on the host for a
/// per-tensor scale, exactly for a power-of-two one) and the encoder only multiplies by it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Scale {
    /// Multiplier applied when reading: `value = decode(q) * scale`.
    pub scale: f32,
    /// Multiplier applied when writing: `q = encode(x * inv_scale)`.
    pub inv_scale: f32,
}

impl Fp8Scale {
    /// The identity scale (1, 1).
    pub const ONE: Fp8Scale = Fp8Scale {
        scale: 1.0,
        inv_scale: 1.0,
    };

    /// A static per-tensor scale (vLLM's `k_scale` / `v_scale`): `inv_scale = 1 / scale`.
    ///
    /// The scale must be a positive normal f32 whose reciprocal is also normal (so that no GPU
    /// flushes either to zero); anything else is `Error::InvalidArgument`.
    pub fn per_tensor(scale: f32) -> Result<Fp8Scale> {
        let inv_scale = 1.0 / scale;
        if scale > 0.0 && scale.is_normal() && inv_scale.is_normal() {
            Ok(Fp8Scale { scale, inv_scale })
        } else {
            Err(Error::InvalidArgument(format!(
                "FP8 per-tensor scale must be a positive normal f32 with a normal reciprocal, got {scale}"
            )))
        }
    }

    /// The power of two `2^k` for the exponent `k`, clamped to `-126..=127` so that both the
    /// scale and its reciprocal are normal f32.
    pub fn pow2(k: i32) -> Fp8Scale {
        let k = k.clamp(-126, 127);
        Fp8Scale {
            scale: f32::from_bits(((k + 127) as u32) << 23),
            inv_scale: f32::from_bits(((127 - k) as u32) << 23),
        }
    }

    /// The dynamic scale of one token row: `2^ceil(log2(amax / fmt.max_value()))` (see
    /// [`fp8_row_scale_exponent`]), at most `2^(127 - max_exponent)` so that the scale times the
    /// largest code stays finite (a row reaching f32's extremes saturates at ±max times that
    /// scale: about ±2.98e38 in E4M3, ±2.92e38 in E5M2, instead of decoding to infinity); 1 for
    /// a row whose `amax` is 0.
    pub fn for_row(fmt: Fp8Format, row: &[f32]) -> Fp8Scale {
        match fp8_row_scale_exponent(fmt, amax_finite_bits(row)) {
            Some(k) => Fp8Scale::pow2(k.min(max_row_scale_exponent(fmt))),
            None => Fp8Scale::ONE,
        }
    }
}

/// The largest exponent `k` of a dynamic row scale `2^k` for which `max_value * 2^k` is finite:
/// `127 - max_exponent` (119 for E4M3, 112 for E5M2; both maxima have the significand 1.75).
pub fn max_row_scale_exponent(fmt: Fp8Format) -> i32 {
    127 - fmt.max_exponent()
}

/// The largest `|x|` over the finite values of `row`, as f32 bits (0 for an empty or all-zero
/// row). NaN and ±infinity are ignored: they encode to NaN or ±infinity whatever the scale. Computed
/// as an integer maximum of `bits & 0x7FFF_FFFF`, which orders non-negative floats.
pub fn amax_finite_bits(row: &[f32]) -> u32 {
    row.iter()
        .map(|x| x.to_bits() & 0x7FFF_FFFF)
        .filter(|&a| a < 0x7F80_0000)
        .max()
        .unwrap_or(0)
}

/// The exponent `k = ceil(log2(amax / max))` of the dynamic FP8 scale, from the bits of `amax`
/// (finite, non-negative), computed exactly with integer operations: with
/// `amax = 1.f * 2^E` and `max = 1.75 * 2^M`, `k = E - M + (1.f > 1.75)`. `None` when `amax`
/// is 0. The result is not clamped (see [`Fp8Scale::pow2`]).
pub fn fp8_row_scale_exponent(fmt: Fp8Format, amax_bits: u32) -> Option<i32> {
    let a = amax_bits & 0x7FFF_FFFF;
    if a == 0 {
        return None;
    }
    let field = (a >> 23) as i32;
    let (e, mant) = if field == 0 {
        // Subnormal amax = m * 2^-149: normalise on the leading bit p.
        let p = a.ilog2();
        (p as i32 - 149, (a << (23 - p)) & 0x007F_FFFF)
    } else {
        (field - 127, a & 0x007F_FFFF)
    };
    // 0x60_0000 is the mantissa field of 1.75.
    Some(e - fmt.max_exponent() + i32::from(mant > 0x0060_0000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_scale_is_smallest_sufficient_power_of_two() {
        for fmt in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let max = fmt.max_value() as f64;
            let mut s = 0x1234_5678_9ABC_DEF1u64;
            for _ in 0..50_000 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let a = f32::from_bits((s as u32) & 0x7F7F_FFFF); // finite, non-negative
                if a == 0.0 {
                    continue;
                }
                let k = fp8_row_scale_exponent(fmt, a.to_bits()).unwrap();
                let p = 2f64.powi(k);
                assert!(a as f64 / p <= max, "{a} k={k}");
                assert!(a as f64 / (p / 2.0) > max, "{a} k={k}");
            }
            assert_eq!(
                fp8_row_scale_exponent(fmt, fmt.max_value().to_bits()),
                Some(0)
            );
            assert_eq!(
                fp8_row_scale_exponent(fmt, (2.0 * fmt.max_value()).to_bits()),
                Some(1)
            );
            let just_above = f32::from_bits(fmt.max_value().to_bits() + 1);
            assert_eq!(fp8_row_scale_exponent(fmt, just_above.to_bits()), Some(1));
            assert_eq!(fp8_row_scale_exponent(fmt, 0), None);
        }
    }

    #[test]
    fn row_scale_clamps_and_ignores_non_finite() {
        let s = Fp8Scale::for_row(Fp8Format::E4M3, &[f32::from_bits(1), -0.0]);
        assert_eq!(s.scale, f32::MIN_POSITIVE);
        assert_eq!(s.inv_scale, 2f32.powi(126));
        let s = Fp8Scale::for_row(Fp8Format::E4M3, &[f32::NAN, f32::INFINITY, 3.0, -896.0]);
        assert_eq!((s.scale, s.inv_scale), (2.0, 0.5));
        assert_eq!(
            Fp8Scale::for_row(Fp8Format::E5M2, &[0.0, -0.0]),
            Fp8Scale::ONE
        );
        assert_eq!(Fp8Scale::for_row(Fp8Format::E5M2, &[]), Fp8Scale::ONE);
        // Scales stop where the largest code times the scale would overflow f32.
        let s = Fp8Scale::for_row(Fp8Format::E5M2, &[f32::MAX]);
        assert_eq!(s.scale, 2f32.powi(112));
        let s = Fp8Scale::for_row(Fp8Format::E4M3, &[-3.4e38]);
        assert_eq!(s.scale, 2f32.powi(119));
    }

    #[test]
    fn per_tensor_scale_is_checked() {
        let s = Fp8Scale::per_tensor(0.25).unwrap();
        assert_eq!((s.scale, s.inv_scale), (0.25, 4.0));
        for bad in [
            0.0,
            -1.0,
            f32::NAN,
            f32::INFINITY,
            f32::from_bits(1),
            f32::MAX,
        ] {
            assert!(Fp8Scale::per_tensor(bad).is_err(), "{bad}");
        }
    }
}
