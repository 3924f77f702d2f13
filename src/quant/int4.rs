//! Asymmetric int4 per group of 32 values along `head_dim`, with an f16 scale and an f16 min.
//!
//! For a group with minimum `min` and maximum `max`: `scale = (max - min) / 15` (f32), then both
//! are rounded to f16 (`scale_h`, `min_h`, with this crate's f16 encoder) and the encoder uses the
//! rounded values: `inv = 1 / scale_h` (f32; 0 when `scale_h` is 0),
//! `q = clamp(round_ties_even((x - min_h) * inv), 0, 15)`. Decode is
//! `fma(q, scale_h, min_h)`; the product `q * scale_h` has at most 15 significant bits, so it is
//! exact in f32 and the result is the same whether or not a GPU fuses the multiply-add.

use super::f16::{f16_bits_to_f32, f32_to_f16_bits};

/// Values per int4 group (one scale word per group).
pub const INT4_GROUP: usize = 32;

/// The parameters of one int4 group: f16 scale and min (as stored) and the f32 reciprocal of the
/// scale that the encoder multiplies by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Int4Params {
    /// f16 bits of the scale.
    pub scale_h: u16,
    /// f16 bits of the minimum.
    pub min_h: u16,
    /// `1 / scale` as f32 (0 when the scale is 0 or not finite).
    pub inv_scale: f32,
}

impl Int4Params {
    /// Parameters from stored f16 bits, with the reciprocal computed here: `1 / scale` in f32,
    /// 0 when the scale is 0 or not finite.
    pub fn from_halves(scale_h: u16, min_h: u16) -> Int4Params {
        let scale = f16_bits_to_f32(scale_h);
        let inv_scale = if scale > 0.0 && scale.is_finite() {
            1.0 / scale
        } else {
            0.0
        };
        Int4Params {
            scale_h,
            min_h,
            inv_scale,
        }
    }

    /// The parameters of a poisoned group (one holding NaN or ±infinity, or values whose f16
    /// scale or min would not be finite, |x| beyond about 65504): f16 NaN (`0x7E00`) for both,
    /// a zero reciprocal, so every code is 0 and every value decodes to NaN.
    pub const POISON: Int4Params = Int4Params {
        scale_h: 0x7E00,
        min_h: 0x7E00,
        inv_scale: 0.0,
    };

    /// Whether these are [`Int4Params::POISON`]'s halves.
    pub fn is_poison(&self) -> bool {
        self.scale_h == 0x7E00 && self.min_h == 0x7E00
    }

    /// The parameters of a group: min and max over the group (an empty group is treated as
    /// zeros), `scale = (max - min) / 15`, both rounded to f16; [`Int4Params::POISON`] when the
    /// group holds NaN or ±infinity or either f16 is not finite.
    ///
    /// Min and max compare by IEEE total order (`f32::total_cmp`), so `-0.0 < +0.0` and the sign
    /// of a zero min is deterministic (`f32::min` may return either zero); the GPU encoder
    /// compares the same integer keys.
    pub fn for_group(group: &[f32]) -> Int4Params {
        if group.iter().any(|x| !x.is_finite()) {
            return Int4Params::POISON;
        }
        let (mut min, mut max) = (f32::INFINITY, f32::NEG_INFINITY);
        for &x in group {
            if x.total_cmp(&min).is_lt() {
                min = x;
            }
            if x.total_cmp(&max).is_gt() {
                max = x;
            }
        }
        if min > max {
            (min, max) = (0.0, 0.0);
        }
        let scale = (max - min) / 15.0;
        let p = Int4Params::from_halves(f32_to_f16_bits(scale), f32_to_f16_bits(min));
        if p.scale().is_finite() && p.min().is_finite() {
            p
        } else {
            Int4Params::POISON
        }
    }

    /// Parameters from a stored scale word (f16 scale in the low half, f16 min in the high half).
    pub fn from_word(word: u32) -> Int4Params {
        Int4Params::from_halves(word as u16, (word >> 16) as u16)
    }

    /// The scale word as stored: f16 scale in the low half, f16 min in the high half.
    pub fn to_word(&self) -> u32 {
        self.scale_h as u32 | ((self.min_h as u32) << 16)
    }

    /// The f16 scale as f32.
    pub fn scale(&self) -> f32 {
        f16_bits_to_f32(self.scale_h)
    }

    /// The f16 minimum as f32.
    pub fn min(&self) -> f32 {
        f16_bits_to_f32(self.min_h)
    }
}

/// Encodes one value: `clamp(round_ties_even((x - min_h) * inv_scale), 0, 15)`.
pub fn encode_int4(x: f32, p: &Int4Params) -> u8 {
    ((x - p.min()) * p.inv_scale)
        .round_ties_even()
        .clamp(0.0, 15.0) as u8
}

/// Decodes one value: `fma(q, scale_h, min_h)` with `scale_h` and `min_h` as f32.
pub fn decode_int4(q: u8, scale_h: f32, min_h: f32) -> f32 {
    (q as f32).mul_add(scale_h, min_h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_layout_and_constant_group() {
        let p = Int4Params::for_group(&[3.0; 32]);
        assert_eq!((p.scale(), p.min(), p.inv_scale), (0.0, 3.0, 0.0));
        assert_eq!(p.to_word(), 0x4200_0000);
        assert_eq!(Int4Params::from_word(p.to_word()), p);
        assert_eq!(encode_int4(3.0, &p), 0);
        assert_eq!(decode_int4(0, p.scale(), p.min()), 3.0);
        let e = Int4Params::for_group(&[]);
        assert_eq!((e.scale(), e.min()), (0.0, 0.0));
    }

    #[test]
    fn signed_zeros_and_nan_are_ordered_deterministically() {
        for g in [[0.0f32, -0.0], [-0.0, 0.0]] {
            let p = Int4Params::for_group(&g);
            assert_eq!((p.min_h, p.scale_h), (0x8000, 0), "{g:?}");
        }
    }

    #[test]
    fn groups_outside_f16_or_not_finite_are_poisoned() {
        for g in [
            vec![0.0, f32::NAN, 0.0],
            vec![f32::NAN; 4],
            vec![1.0, f32::INFINITY],
            vec![f32::NEG_INFINITY, 1.0],
            vec![-3.4e38, 1.0],
            vec![f32::MAX, 0.0],
            vec![-65520.0, 0.0],
        ] {
            let p = Int4Params::for_group(&g);
            assert!(p.is_poison(), "{g:?}");
            assert_eq!(p.to_word(), 0x7E00_7E00);
            for &x in &g {
                assert_eq!(encode_int4(x, &p), 0, "{g:?}");
            }
            assert!(decode_int4(0, p.scale(), p.min()).is_nan());
        }
        // The f16 range itself is fine.
        let p = Int4Params::for_group(&[-65504.0, 65504.0]);
        assert!(!p.is_poison());
        assert_eq!(decode_int4(0, p.scale(), p.min()), -65504.0);
    }

    #[test]
    fn endpoints_map_to_0_and_15() {
        let g: Vec<f32> = (0..32).map(|i| i as f32 * 0.5 - 3.0).collect();
        let p = Int4Params::for_group(&g);
        assert_eq!(p.min(), -3.0);
        assert_eq!(p.scale(), 1.0 + 34.0 / 1024.0); // 15.5 / 15 rounded to f16
        assert_eq!(encode_int4(-3.0, &p), 0);
        assert_eq!(encode_int4(12.5, &p), 15);
        assert_eq!(encode_int4(100.0, &p), 15);
        assert_eq!(encode_int4(-100.0, &p), 0);
    }
}
