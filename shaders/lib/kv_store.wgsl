// kv_store.wgsl: encode f32 values into KV storage formats, bit for bit as the CPU codec in
// src/quant/ does. Integer operations on the f32 bits only, no float arithmetic at all: WGSL
// lets a driver flush subnormals, treat infinities and NaN as indeterminate and round division
// loosely, so every float operation the CPU codec performs (the scale multiplies, int8/int4's
// divisions, int4's subtractions) is done here by hand, correctly rounded (nearest, ties to
// even), subnormals included.
//
// Needs kv_format.wgsl (the KV_* dtype codes, kv_f16_to_f32_bits). Values come in and go out as
// raw bits (u32), never as f32, so NaN payloads and subnormals survive untouched.
//
// Invalid operations (inf - inf, inf * 0, 0 / 0, inf / inf) give 0xffc00000, the default NaN of
// x86 (the CPU codec's usual host); a NaN operand comes back quieted with its sign, as x86 and
// ARM return it.

// v >> s rounded to nearest, ties to even (1 <= s <= 31). Port of round.rs `shift_right_rne`.
fn kv_shift_right_rne(v: u32, s: u32) -> u32 {
    let q = v >> s;
    let rem = v & ((1u << s) - 1u);
    let half = 1u << (s - 1u);
    return select(q, q + 1u, rem > half || (rem == half && (q & 1u) == 1u));
}

// Rounds an f32 magnitude (bits without sign, finite) to a float format with `man_bits` mantissa
// bits and exponent bias `bias`; the code may exceed the largest finite one (the caller
// saturates or maps it to infinity). Port of round.rs `round_magnitude`.
fn kv_round_magnitude(abs: u32, man_bits: u32, bias: u32) -> u32 {
    let e = abs >> 23u;
    if e == 0u {
        return 0u;
    }
    if e >= 128u - bias {
        return kv_shift_right_rne(abs, 23u - man_bits) - ((127u - bias) << man_bits);
    }
    let sig = (abs & 0x007fffffu) | 0x00800000u;
    let s = 151u - bias - man_bits - e;
    if s > 24u {
        return 0u;
    }
    return kv_shift_right_rne(sig, s);
}

// f32 bits -> f16 bits: nearest even, overflow to infinity, NaN kept quiet (f16.rs).
fn kv_f32_bits_to_f16(bits: u32) -> u32 {
    let sign = (bits >> 16u) & 0x8000u;
    let abs = bits & 0x7fffffffu;
    if abs > 0x7f800000u {
        return sign | 0x7c00u | 0x0200u | ((abs & 0x007fffffu) >> 13u);
    }
    if abs == 0x7f800000u {
        return sign | 0x7c00u;
    }
    return sign | min(kv_round_magnitude(abs, 10u, 15u), 0x7c00u);
}

// f32 bits -> bf16 bits: nearest even, NaN kept quiet (bf16.rs).
fn kv_f32_bits_to_bf16(bits: u32) -> u32 {
    if (bits & 0x7fffffffu) > 0x7f800000u {
        return (bits >> 16u) | 0x0040u;
    }
    return ((bits & 0x80000000u) >> 16u) | kv_shift_right_rne(bits & 0x7fffffffu, 16u);
}

// ---------------------------------------------------------------------------------------------
// Exact f32 arithmetic on bits (IEEE 754 binary32, round to nearest even, gradual underflow).

const KV_F32_INF: u32 = 0x7f800000u;
// Result of an invalid operation (see the header).
const KV_DEFAULT_NAN: u32 = 0xffc00000u;
const KV_F32_ONE: u32 = 0x3f800000u;

// A finite nonzero magnitude as value = sig * 2^(e - 150), sig in [2^23, 2^24): e is the biased
// exponent for normal values; subnormals are normalised (e <= 0).
struct KvUnpacked {
    sig: u32,
    e: i32,
}

fn kv_unpack(abs: u32) -> KvUnpacked {
    let field = abs >> 23u;
    if field == 0u {
        let p = firstLeadingBit(abs);
        return KvUnpacked(abs << (23u - p), i32(p) - 22);
    }
    return KvUnpacked((abs & 0x007fffffu) | 0x00800000u, i32(field));
}

// The f32 bits nearest (ties to even) to sign * (sig + rem / 2^24) * 2^(e - 150), with sig in
// [2^23, 2^24) and rem in [0, 2^24) (only rem vs 2^23, and rem != 0, matter): infinity on
// overflow, subnormal or zero on underflow (rounding up to the smallest normal when due).
fn kv_round_pack(sign: u32, sig: u32, rem: u32, e: i32) -> u32 {
    if e >= 1 {
        var s = sig + select(0u, 1u, rem > 0x800000u || (rem == 0x800000u && (sig & 1u) == 1u));
        var ee = e;
        if s == 0x1000000u {
            s = 0x800000u;
            ee += 1;
        }
        if ee >= 255 {
            return sign | KV_F32_INF;
        }
        return sign | (u32(ee) << 23u) | (s & 0x007fffffu);
    }
    // Subnormal: the value in units of 2^-149 is (sig + rem / 2^24) / 2^sh.
    let sh = u32(1 - e);
    if sh > 24u {
        return sign; // below half the smallest subnormal
    }
    let q = sig >> sh;
    let r = sig & ((1u << sh) - 1u);
    let half = 1u << (sh - 1u);
    let up = r > half || (r == half && (rem != 0u || (q & 1u) == 1u));
    return sign | (q + select(0u, 1u, up));
}

// The NaN result of an operation on a and b when either is NaN (the first NaN operand, quieted, as
// x86 and Rust give it), else 0 (never a NaN's bits).
fn kv_nan_operand(a: u32, b: u32) -> u32 {
    if (a & 0x7fffffffu) > KV_F32_INF {
        return a | 0x00400000u;
    }
    if (b & 0x7fffffffu) > KV_F32_INF {
        return b | 0x00400000u;
    }
    return 0u;
}

// a * b, correctly rounded (Rust's `a * b` on f32).
fn kv_mul_bits(a: u32, b: u32) -> u32 {
    let sign = (a ^ b) & 0x80000000u;
    let aa = a & 0x7fffffffu;
    let ba = b & 0x7fffffffu;
    let nan = kv_nan_operand(a, b);
    if nan != 0u {
        return nan;
    }
    if aa == KV_F32_INF || ba == KV_F32_INF {
        if aa == 0u || ba == 0u {
            return KV_DEFAULT_NAN;
        }
        return sign | KV_F32_INF;
    }
    if aa == 0u || ba == 0u {
        return sign;
    }
    // b a normal power of two (a per-row FP8 reciprocal scale) and a normal: where the product's
    // exponent field stays in 1..=254 the product is exact, a sum of the exponents.
    let fa = aa >> 23u;
    if (ba & 0x007fffffu) == 0u && ba >= 0x00800000u && fa != 0u {
        let f = i32(fa) + i32(ba >> 23u) - 127;
        if f >= 1 && f <= 254 {
            return sign | (u32(f) << 23u) | (aa & 0x007fffffu);
        }
    }
    let x = kv_unpack(aa);
    let y = kv_unpack(ba);
    // 24 x 24 -> 48-bit product hi * 2^24 + lo from 12-bit limbs (no partial sum reaches 2^32).
    let a0 = x.sig & 0xfffu;
    let a1 = x.sig >> 12u;
    let b0 = y.sig & 0xfffu;
    let b1 = y.sig >> 12u;
    let mid = a0 * b1 + a1 * b0;
    let t = a0 * b0 + ((mid & 0xfffu) << 12u);
    let lo = t & 0xffffffu;
    let hi = a1 * b1 + (mid >> 12u) + (t >> 24u); // in [2^22, 2^24)
    if hi >= 0x800000u {
        return kv_round_pack(sign, hi, lo, x.e + y.e - 126);
    }
    return kv_round_pack(sign, (hi << 1u) | (lo >> 23u), (lo << 1u) & 0xffffffu, x.e + y.e - 127);
}

// a / b, correctly rounded (Rust's `a / b` on f32), by long division of the significands.
fn kv_div_bits(a: u32, b: u32) -> u32 {
    let sign = (a ^ b) & 0x80000000u;
    let aa = a & 0x7fffffffu;
    let ba = b & 0x7fffffffu;
    let nan = kv_nan_operand(a, b);
    if nan != 0u {
        return nan;
    }
    if aa == KV_F32_INF {
        return select(sign | KV_F32_INF, KV_DEFAULT_NAN, ba == KV_F32_INF);
    }
    if ba == KV_F32_INF {
        return sign;
    }
    if ba == 0u {
        return select(sign | KV_F32_INF, KV_DEFAULT_NAN, aa == 0u);
    }
    if aa == 0u {
        return sign;
    }
    let x = kv_unpack(aa);
    let y = kv_unpack(ba);
    var r = x.sig;
    var e = x.e - y.e + 127;
    if r < y.sig {
        r = r << 1u;
        e -= 1;
    }
    // r / y.sig is in [1, 2): 25 quotient bits (24 significant and a round bit), r < 2^25.
    var q = 0u;
    for (var i = 0u; i < 25u; i++) {
        q = q << 1u;
        if r >= y.sig {
            r -= y.sig;
            q |= 1u;
        }
        r = r << 1u;
    }
    return kv_round_pack(sign, q >> 1u, ((q & 1u) << 23u) | select(0u, 1u, r != 0u), e);
}

// a + b, correctly rounded (Rust's `a + b` on f32).
fn kv_add_bits(a: u32, b: u32) -> u32 {
    let aa = a & 0x7fffffffu;
    let ba = b & 0x7fffffffu;
    let nan = kv_nan_operand(a, b);
    if nan != 0u {
        return nan;
    }
    if aa == KV_F32_INF {
        return select(a, KV_DEFAULT_NAN, ba == KV_F32_INF && ((a ^ b) & 0x80000000u) != 0u);
    }
    if ba == KV_F32_INF {
        return b;
    }
    if aa == 0u {
        return select(b, a & b, ba == 0u); // -0 only for -0 + -0
    }
    if ba == 0u {
        return a;
    }
    let swap = ba > aa;
    let big = select(a, b, swap);
    let small = select(b, a, swap);
    let x = kv_unpack(big & 0x7fffffffu);
    let y = kv_unpack(small & 0x7fffffffu);
    // Six guard bits; the bits of the smaller operand shifted out fold into a sticky bit, which
    // stays at least two places below the rounding position.
    let d = u32(x.e - y.e);
    let big_sig = x.sig << 6u;
    var small_sig = y.sig << 6u;
    if d >= 31u {
        small_sig = 1u;
    } else if d > 0u {
        let lost = small_sig & ((1u << d) - 1u);
        small_sig = (small_sig >> d) | select(0u, 1u, lost != 0u);
    }
    var s: u32;
    if ((a ^ b) & 0x80000000u) == 0u {
        s = big_sig + small_sig;
    } else {
        s = big_sig - small_sig;
    }
    if s == 0u {
        return 0u; // exact cancellation gives +0
    }
    let sign = big & 0x80000000u;
    let p = firstLeadingBit(s);
    if p > 23u {
        let sh = p - 23u;
        let rem = s & ((1u << sh) - 1u);
        return kv_round_pack(sign, s >> sh, rem << (24u - sh), x.e - 6 + i32(sh));
    }
    // Massive cancellation (exponents differ by at most one): exact.
    return kv_round_pack(sign, s << (23u - p), 0u, x.e - 6 - i32(23u - p));
}

// a - b, correctly rounded.
fn kv_sub_bits(a: u32, b: u32) -> u32 {
    return kv_add_bits(a, b ^ 0x80000000u);
}

// f32 bits rounded to an integer, ties to even, clamped to lo..=hi; NaN gives 0 (Rust's
// `x.round_ties_even().clamp(lo, hi) as i8 / as u8`).
fn kv_round_clamp(bits: u32, lo: i32, hi: i32) -> i32 {
    let abs = bits & 0x7fffffffu;
    if abs > KV_F32_INF {
        return 0;
    }
    let e = abs >> 23u;
    var m = 0;
    if e >= 150u {
        m = 0x1000000; // |x| >= 2^23 (infinity included): beyond any clamp
    } else if e >= 126u {
        m = i32(kv_shift_right_rne((abs & 0x007fffffu) | 0x00800000u, 150u - e));
    }
    return clamp(select(m, -m, (bits & 0x80000000u) != 0u), lo, hi);
}

// ---------------------------------------------------------------------------------------------
// FP8 (fp8.rs, fp8_scale.rs).

// f32 bits -> an FP8 code with `man_bits` mantissa bits and exponent `bias`: nearest even,
// finite values saturating to the code `max_code`, NaN -> `nan_code | sign`, infinity ->
// `inf_code | sign` (fp8.rs).
fn kv_encode_fp8(bits: u32, man_bits: u32, bias: u32, max_code: u32, nan_inf: vec2<u32>) -> u32 {
    let sign = (bits >> 24u) & 0x80u;
    let abs = bits & 0x7fffffffu;
    if abs > KV_F32_INF {
        return nan_inf.x | sign;
    }
    if abs == KV_F32_INF {
        return nan_inf.y | sign;
    }
    return min(kv_round_magnitude(abs, man_bits, bias), max_code) | sign;
}

// f32 bits -> OCP E4M3 "fn": finite values saturating to +-448, NaN and infinity -> 0x7f | sign.
fn kv_encode_e4m3(bits: u32) -> u32 {
    return kv_encode_fp8(bits, 3u, 7u, 0x7eu, vec2<u32>(0x7fu, 0x7fu));
}

// f32 bits -> OCP E5M2: finite values saturating to +-57344, infinity -> 0x7c | sign,
// NaN -> 0x7e | sign.
fn kv_encode_e5m2(bits: u32) -> u32 {
    return kv_encode_fp8(bits, 2u, 15u, 0x7bu, vec2<u32>(0x7eu, 0x7cu));
}

// `Fp8Format::encode_scaled`: the code `code` of the product `prod` = x * inv_scale, except that
// a finite x whose product overflowed saturates to `max_code | sign`.
fn kv_fp8_saturate_scaled(bits: u32, prod: u32, code: u32, max_code: u32) -> u32 {
    if (bits & 0x7fffffffu) < KV_F32_INF && (prod & 0x7fffffffu) == KV_F32_INF {
        return max_code | ((prod >> 24u) & 0x80u);
    }
    return code;
}

// The exponent k of a row's dynamic FP8 scale 2^k, from the row's `amax_finite_bits` (the
// integer max of `bits & 0x7fffffff` over its finite values): `fp8_row_scale_exponent` clamped as
// `Fp8Scale::for_row` does (at least -126, at most 127 - max_exp so that max times the scale is
// finite); 0 (scale 1) for amax 0. `max_exp`: 8 for E4M3, 15 for E5M2. The scale's f32 bits are
// (k + 127) << 23, its reciprocal's (127 - k) << 23.
fn kv_fp8_row_scale_exponent(amax: u32, max_exp: i32) -> i32 {
    if amax == 0u {
        return 0;
    }
    let field = amax >> 23u;
    var e = i32(field) - 127;
    var mant = amax & 0x007fffffu;
    if field == 0u {
        let p = firstLeadingBit(amax);
        e = i32(p) - 149;
        mant = (amax << (23u - p)) & 0x007fffffu;
    }
    return clamp(e - max_exp + select(0, 1, mant > 0x00600000u), -126, 127 - max_exp);
}

// ---------------------------------------------------------------------------------------------
// int8 (int8.rs).

// `Int8Scale::from_amax` from the bits of amax (non-negative; infinity or NaN for a row holding a
// non-finite value): scale = amax / 127 (one f32 step lower where 127 * scale would overflow) and
// its reciprocal 1 / scale as f32 bits, (0, 0) when the scale is not a positive normal f32, and
// the poisoned (NaN, 0) for a non-finite amax.
fn kv_int8_scale(amax: u32) -> vec2<u32> {
    if amax >= KV_F32_INF {
        return vec2<u32>(0x7fc00000u, 0u);
    }
    var s = kv_div_bits(amax, 0x42fe0000u); // 127.0
    if kv_mul_bits(s, 0x42fe0000u) == KV_F32_INF {
        s -= 1u;
    }
    let field = s >> 23u; // the sign bit is 0 for a positive scale
    if field == 0u || field >= 0xffu {
        return vec2<u32>(0u);
    }
    return vec2<u32>(s, kv_div_bits(KV_F32_ONE, s));
}

// `encode_int8` as its low 8 bits: clamp(round_ties_even(x * inv), -127, 127), NaN -> 0.
fn kv_encode_int8(bits: u32, inv: u32) -> u32 {
    return u32(kv_round_clamp(kv_mul_bits(bits, inv), -127, 127)) & 0xffu;
}

// ---------------------------------------------------------------------------------------------
// int4 (int4.rs).

// An integer key ordering f32 bits as `f32::total_cmp` does (-0 below +0).
fn kv_total_key(bits: u32) -> u32 {
    return select(bits | 0x80000000u, ~bits, (bits & 0x80000000u) != 0u);
}

// The f32 bits of a total-order key.
fn kv_total_unkey(key: u32) -> u32 {
    return select(~key, key & 0x7fffffffu, (key & 0x80000000u) != 0u);
}

// `Int4Params` of a group of finite values from its min and max (f32 bits, as `for_group` finds
// them): x = f16 scale bits, y = f16 min bits, z = f32 bits of the reciprocal of the f16 scale
// (0 when that is 0), w = f32 bits of the f16 min; `Int4Params::POISON` (f16 NaN for both,
// reciprocal 0) when either f16 is not finite.
fn kv_int4_params(min_bits: u32, max_bits: u32) -> vec4<u32> {
    let scale_h = kv_f32_bits_to_f16(kv_div_bits(kv_sub_bits(max_bits, min_bits), 0x41700000u)); // 15.0
    let min_h = kv_f32_bits_to_f16(min_bits);
    if (scale_h & 0x7fffu) >= 0x7c00u || (min_h & 0x7fffu) >= 0x7c00u {
        return vec4<u32>(0x7e00u, 0x7e00u, 0u, 0x7fc00000u);
    }
    let scale = kv_f16_to_f32_bits(scale_h);
    var inv = 0u;
    if scale != 0u {
        inv = kv_div_bits(KV_F32_ONE, scale);
    }
    return vec4<u32>(scale_h, min_h, inv, kv_f16_to_f32_bits(min_h));
}

// `encode_int4`: clamp(round_ties_even((x - min_h) * inv), 0, 15), NaN -> 0.
fn kv_encode_int4(bits: u32, inv: u32, min_f: u32) -> u32 {
    return u32(kv_round_clamp(kv_mul_bits(kv_sub_bits(bits, min_f), inv), 0, 15));
}
