//! Symmetric int8 per token row: `scale = amax / 127`, codes in `-127..=127`.
//!
//! The encoder multiplies by a reciprocal computed once (`inv_scale = 1 / scale`, f32) and rounds
//! ties to even: `q = clamp(round_ties_even(x * inv_scale), -127, 127)`. Decode is
//! `q as f32 * scale`. A GPU that computes its own reciprocal may differ from this one in the last
//! bit, so [`encode_int8`] takes the pair explicitly: tests re-encode with the GPU's own values.

/// The scale of one int8 row and the reciprocal the encoder multiplies by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Int8Scale {
    /// Multiplier applied when reading: `value = q as f32 * scale`.
    pub scale: f32,
    /// Multiplier applied when writing: `q = round(x * inv_scale)`.
    pub inv_scale: f32,
}

impl Int8Scale {
    /// The all-zero scale: every code is 0 and decodes to 0.
    pub const ZERO: Int8Scale = Int8Scale {
        scale: 0.0,
        inv_scale: 0.0,
    };

    /// The scale of a poisoned row (one holding NaN or ±infinity, which int8 cannot store):
    /// a NaN scale (`0x7FC00000`) and a zero reciprocal, so every code is 0 and every value of
    /// the row decodes to NaN.
    pub const POISON: Int8Scale = Int8Scale {
        scale: f32::NAN,
        inv_scale: 0.0,
    };

    /// The scale for a row whose largest magnitude is `amax`: `scale = amax / 127` (f32 division)
    /// and `inv_scale = 1 / scale`. When `scale` is not a positive normal f32 (amax is 0 or tiny
    /// enough that the scale would be subnormal) the result is [`Int8Scale::ZERO`], so no GPU
    /// meets a subnormal scale; a non-finite `amax` gives [`Int8Scale::POISON`]. Where
    /// `127 * scale` would round past f32's largest value (amax within a rounding of `f32::MAX`)
    /// the scale is the next f32 below, so every code decodes to a finite value.
    pub fn from_amax(amax: f32) -> Int8Scale {
        if !amax.is_finite() {
            return Int8Scale::POISON;
        }
        let mut scale = amax / 127.0;
        if (scale * 127.0).is_infinite() {
            scale = f32::from_bits(scale.to_bits() - 1);
        }
        if scale > 0.0 && scale.is_normal() {
            Int8Scale {
                scale,
                inv_scale: 1.0 / scale,
            }
        } else {
            Int8Scale::ZERO
        }
    }

    /// The scale of a row: [`Int8Scale::from_amax`] of `max |x|`; [`Int8Scale::POISON`] when the
    /// row holds NaN or ±infinity.
    pub fn for_row(row: &[f32]) -> Int8Scale {
        if row.iter().any(|x| !x.is_finite()) {
            return Int8Scale::POISON;
        }
        Int8Scale::from_amax(row.iter().fold(0.0f32, |m, x| m.max(x.abs())))
    }
}

/// Encodes one value: `clamp(round_ties_even(x * inv_scale), -127, 127)`. A NaN product gives 0
/// (a row holding NaN or ±infinity has the [`Int8Scale::POISON`] scale: codes 0, values NaN).
pub fn encode_int8(x: f32, s: Int8Scale) -> i8 {
    (x * s.inv_scale).round_ties_even().clamp(-127.0, 127.0) as i8
}

/// Decodes one value: `q as f32 * scale`.
pub fn decode_int8(q: i8, scale: f32) -> f32 {
    q as f32 * scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_and_tiny_rows_give_zero_scale() {
        assert_eq!(Int8Scale::for_row(&[0.0, -0.0]), Int8Scale::ZERO);
        assert_eq!(Int8Scale::for_row(&[]), Int8Scale::ZERO);
        assert_eq!(Int8Scale::from_amax(f32::MIN_POSITIVE), Int8Scale::ZERO);
        assert_eq!(encode_int8(1.0, Int8Scale::ZERO), 0);
        assert_eq!(decode_int8(0, 0.0), 0.0);
    }

    #[test]
    fn codes_are_symmetric_and_round_to_even() {
        let s = Int8Scale::for_row(&[127.0, -3.0]);
        assert_eq!((s.scale, s.inv_scale), (1.0, 1.0));
        assert_eq!(encode_int8(127.0, s), 127);
        assert_eq!(encode_int8(-127.0, s), -127);
        assert_eq!(encode_int8(-500.0, s), -127); // never -128
        assert_eq!(encode_int8(2.5, s), 2);
        assert_eq!(encode_int8(3.5, s), 4);
        assert_eq!(encode_int8(-2.5, s), -2);
        assert_eq!(encode_int8(f32::NAN, s), 0);
    }

    #[test]
    fn non_finite_rows_are_poisoned_and_extremes_stay_finite() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let s = Int8Scale::for_row(&[1.0, bad, -2.0]);
            assert_eq!(s.scale.to_bits(), 0x7FC0_0000);
            assert_eq!(s.inv_scale, 0.0);
            for x in [1.0, bad, -2.0] {
                assert_eq!(encode_int8(x, s), 0);
            }
            assert!(decode_int8(0, s.scale).is_nan());
        }
        for amax in [
            f32::MAX,
            -f32::MAX,
            f32::from_bits(f32::MAX.to_bits() - 1),
            3.3e38,
        ] {
            let s = Int8Scale::for_row(&[amax, 1.0]);
            assert!(s.scale.is_normal(), "{amax}");
            for q in [127i8, -127] {
                assert!(decode_int8(q, s.scale).is_finite(), "{amax}: {q}");
            }
            let q = encode_int8(amax, s);
            assert_eq!(q.unsigned_abs(), 127, "{amax}");
        }
    }
}
