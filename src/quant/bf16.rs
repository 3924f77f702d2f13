//! bfloat16 encode and decode by hand, with integer bit operations only.
//!
//! bf16 is the top half of an f32. Encode rounds to nearest, ties to even (a carry out of the
//! mantissa moves into the exponent, so the largest f32 values round to infinity); NaN stays NaN
//! (quiet bit set, high payload kept), as in the `half` crate. f32 subnormals become bf16
//! subnormals. Decode is `bits << 16`, exactly what the WGSL decoder does (so a signalling-NaN
//! code decodes to a signalling NaN; the encoder never produces one).

use super::round::shift_right_rne;

/// Encodes `x` as bf16 bits, round-to-nearest-even, NaN kept (quiet).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7FFF_FFFF > 0x7F80_0000 {
        return ((bits >> 16) | 0x0040) as u16;
    }
    let sign = bits & 0x8000_0000;
    ((sign >> 16) | shift_right_rne(bits & 0x7FFF_FFFF, 16)) as u16
}

/// Decodes bf16 bits to f32 (exact: the bits shifted into the high half).
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn check(x: f32) {
        let want = bf16::from_f32(x).to_bits();
        let got = f32_to_bf16_bits(x);
        if x.is_nan() {
            assert!(bf16::from_bits(got).is_nan());
            assert_eq!(got & 0x8000, want & 0x8000);
        } else {
            assert_eq!(got, want, "f32 bits {:#010x}", x.to_bits());
        }
    }

    #[test]
    fn all_bf16_codes_round_trip() {
        for b in 0..=u16::MAX {
            let x = bf16_bits_to_f32(b);
            let want = bf16::from_bits(b).to_f32();
            if want.is_nan() {
                assert!(x.is_nan());
            } else {
                assert_eq!(x.to_bits(), want.to_bits());
                assert_eq!(f32_to_bf16_bits(x), b);
            }
        }
    }

    #[test]
    fn edge_cases_match_half() {
        let edges = [
            0.0f32,
            1.0,
            f32::MAX,
            f32::from_bits(0x7F7F_8000), // tie above the largest bf16: even is infinity
            f32::from_bits(0x7F7F_7FFF),
            f32::INFINITY,
            f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(1),
            f32::from_bits(0x0000_8000), // subnormal tie: even is zero
            f32::from_bits(0x0001_8000), // subnormal tie: even is 2
            f32::from_bits(0x007F_FFFF), // rounds up to the smallest normal
            f32::from_bits(0x3F80_8000), // 1 + 2^-8: tie, even is 1
            f32::from_bits(0x3F81_8000), // tie, even is 1 + 2^-6
        ];
        for x in edges {
            check(x);
            check(-x);
        }
    }

    #[test]
    fn random_bits_match_half() {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            check(f32::from_bits(s as u32));
            check(f32::from_bits((s >> 32) as u32));
        }
    }
}
