//! Integer rounding helpers shared by the hand-written float encoders (f16, bf16, FP8).
//!
//! Everything here works on the raw bits of an `f32` with integer operations only, so that the
//! WGSL ports compute the same codes bit for bit on every GPU (no float arithmetic, no reliance on
//! the driver's rounding or denormal handling).

/// `v >> s` rounded to nearest, ties to even. `s` must be in `1..=31`.
#[inline]
pub(crate) fn shift_right_rne(v: u32, s: u32) -> u32 {
    debug_assert!((1..=31).contains(&s));
    let q = v >> s;
    let rem = v & ((1u32 << s) - 1);
    let half = 1u32 << (s - 1);
    if rem > half || (rem == half && (q & 1) == 1) {
        q + 1
    } else {
        q
    }
}

/// Rounds the magnitude `abs` (f32 bits without the sign, finite, not NaN) to a binary floating
/// format with `man_bits` mantissa bits and exponent bias `bias`, round-to-nearest-even, and returns
/// the code without its sign bit. The code may exceed the format's largest finite code (and, for
/// inputs at or beyond the largest f32, run into the exponent field of infinity): the caller
/// saturates or maps it to infinity. f32 subnormal inputs give 0 (they are far below the smallest
/// subnormal of every target format). Results that round up from the largest subnormal to the
/// smallest normal come out right because the code space is monotonic.
#[inline]
pub(crate) fn round_magnitude(abs: u32, man_bits: u32, bias: u32) -> u32 {
    let e = abs >> 23; // biased f32 exponent
    if e == 0 {
        return 0;
    }
    // Smallest f32 biased exponent whose values are normal in the target: 2^(1 - bias).
    let min_normal_e = 128 - bias;
    if e >= min_normal_e {
        // Normal: drop the low mantissa bits with rounding (a carry moves into the exponent),
        // then re-bias the exponent field from 127 to `bias`.
        shift_right_rne(abs, 23 - man_bits) - ((127 - bias) << man_bits)
    } else {
        // Subnormal in the target: the code is the significand in units of 2^(1 - bias - man_bits).
        let sig = (abs & 0x007F_FFFF) | 0x0080_0000;
        let s = 151 - bias - man_bits - e; // >= 24 - man_bits >= 1
        if s > 24 {
            0 // below half the smallest subnormal (sig < 2^24 <= half)
        } else {
            shift_right_rne(sig, s)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shift_right_rne_ties_to_even() {
        assert_eq!(shift_right_rne(0b101, 1), 0b10); // 2.5 -> 2
        assert_eq!(shift_right_rne(0b111, 1), 0b100); // 3.5 -> 4
        assert_eq!(shift_right_rne(0b1011, 2), 0b11); // 2.75 -> 3
        assert_eq!(shift_right_rne(0b1001, 2), 0b10); // 2.25 -> 2
        assert_eq!(shift_right_rne((1 << 30) - 1, 31), 0); // just below one half
        assert_eq!(shift_right_rne(u32::MAX >> 1, 31), 1); // just below one
        assert_eq!(shift_right_rne(1 << 30, 31), 0); // one half, even
        assert_eq!(shift_right_rne(3 << 30, 31), 2); // 1.5 -> 2
    }
}
