// kv_store.wgsl: encode f32 values into KV storage formats, bit for bit as the CPU codec in
// src/quant/ does (integer operations on the f32 bits only: no float arithmetic, so neither the
// driver's rounding nor its subnormal flushing can change a code).
//
// Needs kv_format.wgsl (the KV_* dtype codes). Values come in and go out as raw bits (u32), never
// as f32, so NaN payloads and subnormals survive untouched.

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
