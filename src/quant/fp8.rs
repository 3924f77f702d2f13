//! OCP 8-bit floats (FP8 E4M3 "fn" and E5M2), encoded and decoded by hand.
//!
//! - E4M3 "fn": bias 7, 3 mantissa bits, no infinities, NaN `0x7F`/`0xFF`, largest finite 448
//!   (`0x7E`), smallest subnormal 2^-9.
//! - E5M2: bias 15, 2 mantissa bits, ±infinity `0x7C`/`0xFC`, NaN `0x7D..=0x7F` (and negatives),
//!   largest finite 57344 (`0x7B`), smallest subnormal 2^-16.
//!
//! Encode rounds to nearest, ties to even, and saturates finite values: every finite value beyond
//! the largest finite one becomes ±max (vLLM's / CUDA's `SATFINITE`). Non-finite values stay
//! non-finite, so no overflow upstream turns into a plausible number: ±infinity becomes ±infinity
//! in E5M2 (`0x7C | sign`) and NaN in E4M3, which has no infinity (`0x7F | sign`); NaN stays NaN
//! (E4M3 `0x7F | sign`, E5M2 the quiet NaN `0x7E | sign`, the top mantissa bit set as in f16's
//! quiet NaN `0x7E00`). With a scale, [`Fp8Format::encode_scaled`] saturates a finite value whose
//! scaled product overflows f32. f32 subnormal inputs give ±0. The encoder uses only integer
//! operations on `f32::to_bits`, so the WGSL port matches it bit for bit on any GPU.
//!
//! Decode builds the f32 bits directly (exact); NaN codes decode to the quiet NaN `0x7FC00000`
//! with the code's sign.

use super::round::round_magnitude;

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 value.
pub const E5M2_MAX: f32 = 57344.0;

/// The two OCP FP8 formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// E4M3 "fn": 4 exponent bits, 3 mantissa bits, no infinities.
    E4M3,
    /// E5M2: 5 exponent bits, 2 mantissa bits, with infinities.
    E5M2,
}

impl Fp8Format {
    /// Encodes `x` in this format (see [`encode_e4m3`], [`encode_e5m2`]).
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8Format::E4M3 => encode_e4m3(x),
            Fp8Format::E5M2 => encode_e5m2(x),
        }
    }

    /// Encodes `x * inv_scale`, saturating where a finite `x` overflows f32 when scaled (it is
    /// beyond the format's range whatever the scale); a non-finite `x` encodes as itself would.
    pub fn encode_scaled(self, x: f32, inv_scale: f32) -> u8 {
        let y = x * inv_scale;
        if x.is_finite() && y.is_infinite() {
            let max = match self {
                Fp8Format::E4M3 => 0x7E,
                Fp8Format::E5M2 => 0x7B,
            };
            return max | ((y.to_bits() >> 24) as u8 & 0x80);
        }
        self.encode(y)
    }

    /// Decodes a code of this format (see [`decode_e4m3`], [`decode_e5m2`]).
    pub fn decode(self, code: u8) -> f32 {
        match self {
            Fp8Format::E4M3 => decode_e4m3(code),
            Fp8Format::E5M2 => decode_e5m2(code),
        }
    }

    /// Largest finite value: 448 for E4M3, 57344 for E5M2.
    pub fn max_value(self) -> f32 {
        match self {
            Fp8Format::E4M3 => E4M3_MAX,
            Fp8Format::E5M2 => E5M2_MAX,
        }
    }

    /// Unbiased exponent of the largest finite value (8 for E4M3, 15 for E5M2). Both maxima have
    /// the significand 1.75.
    pub fn max_exponent(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 8,
            Fp8Format::E5M2 => 15,
        }
    }
}

/// Encodes `x` with `man_bits` mantissa bits and exponent `bias`: round-to-nearest-even,
/// saturating finite values to the code `max_code`, NaN -> `nan_code | sign`, ±infinity ->
/// `inf_code | sign`.
fn encode_fp8(
    x: f32,
    man_bits: u32,
    bias: u32,
    max_code: u32,
    (nan_code, inf_code): (u8, u8),
) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    if abs > 0x7F80_0000 {
        return nan_code | sign;
    }
    if abs == 0x7F80_0000 {
        return inf_code | sign;
    }
    (round_magnitude(abs, man_bits, bias).min(max_code) as u8) | sign
}

/// Encodes `x` as OCP E4M3 "fn": round-to-nearest-even, finite values saturating to ±448;
/// NaN and ±infinity (which the format lacks) -> NaN `0x7F | sign`.
pub fn encode_e4m3(x: f32) -> u8 {
    encode_fp8(x, 3, 7, 0x7E, (0x7F, 0x7F))
}

/// Encodes `x` as OCP E5M2: round-to-nearest-even, finite values saturating to ±57344;
/// ±infinity -> `0x7C | sign`, NaN -> `0x7E | sign`.
pub fn encode_e5m2(x: f32) -> u8 {
    encode_fp8(x, 2, 15, 0x7B, (0x7E, 0x7C))
}

/// Decodes an OCP E4M3 "fn" code (exact). `0x7F`/`0xFF` decode to NaN.
pub fn decode_e4m3(code: u8) -> f32 {
    let c = code as u32;
    let sign = (c & 0x80) << 24;
    let e = (c >> 3) & 0xF;
    let m = c & 0x7;
    let bits = if e == 0xF && m == 0x7 {
        sign | 0x7FC0_0000
    } else if e == 0 {
        if m == 0 {
            sign
        } else {
            // m * 2^-9: normalise on the leading bit p of m.
            let p = m.ilog2();
            sign | ((p + 118) << 23) | ((m ^ (1 << p)) << (23 - p))
        }
    } else {
        sign | ((e + 120) << 23) | (m << 20)
    };
    f32::from_bits(bits)
}

/// Decodes an OCP E5M2 code (exact). `0x7C`/`0xFC` decode to ±infinity, `0x7D..=0x7F` and their
/// negatives to NaN.
pub fn decode_e5m2(code: u8) -> f32 {
    let c = code as u32;
    let sign = (c & 0x80) << 24;
    let e = (c >> 2) & 0x1F;
    let m = c & 0x3;
    let bits = if e == 0x1F {
        if m == 0 {
            sign | 0x7F80_0000
        } else {
            sign | 0x7FC0_0000
        }
    } else if e == 0 {
        if m == 0 {
            sign
        } else {
            // m * 2^-16: normalise on the leading bit p of m.
            let p = m.ilog2();
            sign | ((p + 111) << 23) | ((m ^ (1 << p)) << (23 - p))
        }
    } else {
        sign | ((e + 112) << 23) | (m << 21)
    };
    f32::from_bits(bits)
}
