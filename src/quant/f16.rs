//! IEEE binary16 (f16) encode and decode by hand, with integer bit operations only.
//!
//! Encode rounds to nearest, ties to even; values beyond the f16 range become ±infinity; f16
//! subnormals are produced exactly; NaN stays NaN (quiet: the top mantissa bit is set, the high
//! payload bits are kept, as the `half` crate and F16C hardware do). Decode is exact.

use super::round::round_magnitude;

/// Bits of f16 positive infinity.
const F16_INF: u32 = 0x7C00;

/// Encodes `x` as f16 bits, round-to-nearest-even, overflow to ±infinity, NaN kept (quiet).
pub fn f32_to_f16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return (sign | F16_INF | 0x0200 | ((abs & 0x007F_FFFF) >> 13)) as u16;
    }
    if abs == 0x7F80_0000 {
        return (sign | F16_INF) as u16;
    }
    (sign | round_magnitude(abs, 10, 15).min(F16_INF)) as u16
}

/// Decodes f16 bits to f32 (exact; NaN gets its quiet bit set, payload kept).
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let e = (h >> 10) & 0x1F;
    let m = h & 0x03FF;
    let bits = if e == 0x1F {
        if m == 0 {
            sign | 0x7F80_0000
        } else {
            sign | 0x7FC0_0000 | (m << 13)
        }
    } else if e == 0 {
        if m == 0 {
            sign
        } else {
            // m * 2^-24 with m < 2^10: normalise on the leading bit p.
            let p = m.ilog2();
            sign | ((p + 103) << 23) | ((m ^ (1 << p)) << (23 - p))
        }
    } else {
        sign | ((e + 112) << 23) | (m << 13)
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    fn check(x: f32) {
        let want = f16::from_f32(x).to_bits();
        let got = f32_to_f16_bits(x);
        if x.is_nan() {
            assert!(f16::from_bits(got).is_nan(), "{x:?} -> {got:#06x}");
            assert_eq!(got & 0x8000, want & 0x8000);
        } else {
            assert_eq!(got, want, "f32 bits {:#010x}", x.to_bits());
        }
    }

    #[test]
    fn all_f16_codes_decode_like_half() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32();
            let got = f16_bits_to_f32(h);
            if want.is_nan() {
                assert!(got.is_nan());
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
                // and back
                assert_eq!(f32_to_f16_bits(got), h);
            }
        }
    }

    #[test]
    fn edge_cases_match_half() {
        let p2 = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
        let edges = [
            0.0f32,
            1.0,
            65504.0,
            65519.0,
            65520.0, // tie between the largest finite and 2^16: even is infinity
            1e10,
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0x7FBF_FFFF),
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            p2(-24),                     // smallest subnormal
            p2(-25),                     // tie with zero: even is zero
            f32::from_bits(0x3300_0001), // just above 2^-25
            p2(-24) * 1.5,               // tie between 1 and 2 units: 2
            p2(-14) - p2(-24),           // largest subnormal
            p2(-14) - p2(-25),           // tie between largest subnormal and smallest normal
            p2(-14),                     // smallest normal
            1.0 + p2(-11),               // tie: even is 1.0
            1.0 + 3.0 * p2(-11),         // tie: even is 1 + 2^-9
        ];
        for x in edges {
            check(x);
            check(-x);
        }
    }

    #[test]
    fn midpoints_round_to_even() {
        // Midpoints between every pair of adjacent finite f16 values, subnormals included.
        for h in 0u16..0x7BFF {
            let lo = f16_bits_to_f32(h) as f64;
            let hi = f16_bits_to_f32(h + 1) as f64;
            let mid = ((lo + hi) / 2.0) as f32; // exact: needs at most 12 significant bits
            let want = if h % 2 == 0 { h } else { h + 1 };
            assert_eq!(f32_to_f16_bits(mid), want, "midpoint above {h:#06x}");
            assert_eq!(f32_to_f16_bits(-mid), want | 0x8000);
        }
    }

    #[test]
    fn random_values_match_half() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..200_000 {
            let r = xorshift(&mut s);
            // Raw bit patterns (every exponent) and values near the f16 range.
            check(f32::from_bits(r as u32));
            let e = (r >> 32) as u32 % 50 + 100; // exponents 2^-27 .. 2^22
            check(f32::from_bits(((r >> 40) as u32 & 0x807F_FFFF) | (e << 23)));
        }
    }
}
