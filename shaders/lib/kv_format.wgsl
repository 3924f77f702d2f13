// kv_format.wgsl: the KV storage formats (ARCHITECTURE.md section 6) as WGSL: dtype codes, row
// sizes and exact decoders of single values. Pure functions, no memory access: kv_load.wgsl
// (reading pools) and kv_store.wgsl (encoding) build on it. Core WGSL that naga validates with no
// capabilities. The CPU codec in src/quant/ is the definition: every function here computes the
// same bits with the same operations in the same order.

const KV_F32: u32 = 0u;
const KV_F16: u32 = 1u;
const KV_BF16: u32 = 2u;
const KV_FP8_E4M3: u32 = 3u;
const KV_FP8_E5M2: u32 = 4u;
const KV_INT8: u32 = 5u;
const KV_INT4: u32 = 6u;

// A pool's per-tensor FP8 scale and its reciprocal computed on the host (`Fp8Scale`; 1 and 1 for
// the other scale modes): the uniform every pool carries (Rust `TensorScale`).
struct TensorScale {
    scale: f32,
    inv_scale: f32,
    _pad0: u32,
    _pad1: u32,
}

// One f16 (low 16 bits of h), decoded by hand: exact, subnormals included. Not
// unpack2x16float: naga/wgpu 30 gate that behind Capabilities::SHADER_FLOAT16_IN_FLOAT32
// (DownlevelFlags::SHADER_F16_IN_F32, missing on lavapipe without SHADER_F16), and a driver may
// flush the f16 subnormals it produces.
fn kv_f16_to_f32_bits(h: u32) -> u32 {
    let sign = (h & 0x8000u) << 16u;
    let em = h & 0x7fffu;
    let m = h & 0x3ffu;
    // Normal: exponent field rebiased from 15 to 127.
    let normal = (em << 13u) + (112u << 23u);
    // Subnormal (or zero) m * 2^-24, as (2^-14 + m 2^-24) - 2^-14: two normal f32 whose
    // difference is exact (kv_sub_normal), so no driver's subnormal flushing can touch it.
    let sub = kv_sub_normal(113u, m << 13u);
    var bits = select(normal, sub, em < 0x400u);
    bits = select(bits, 0x7f800000u, em == 0x7c00u);
    bits = select(bits, 0x7fc00000u | (m << 13u), em > 0x7c00u);
    return sign | bits;
}

// The bits of 2^(e - 127) mant / 2^23 (mant < 2^23): the normal f32 of exponent field e and
// mantissa field `mant`, less 2^(e - 127), an exact subtraction (Sterbenz) of normal numbers.
// The decoders take their subnormal codes' values so rather than by an int-to-float conversion,
// a quarter-rate instruction on some GPUs (NVIDIA's among them).
fn kv_sub_normal(e: u32, mant: u32) -> u32 {
    return bitcast<u32>(bitcast<f32>((e << 23u) | mant) - bitcast<f32>(e << 23u));
}

// Integers below 2^23 as f32, exactly, without an int-to-float conversion: each placed in the
// mantissa of 2^23, then 2^23 subtracted.
fn kv_small_f32x4(u: vec4<u32>) -> vec4<f32> {
    return kv_small_plus_f32x4(u, 0.0);
}

// u + bias as f32, exactly, for u below 2^23 and a small integer bias (|bias| well below 2^22,
// so that 2^23 - bias and u + bias are exact): kv_small_f32x4 with 2^23 - bias subtracted
// instead of 2^23, the bias at no cost.
fn kv_small_plus_f32x4(u: vec4<u32>, bias: f32) -> vec4<f32> {
    return bitcast<vec4<f32>>(u | vec4<u32>(0x4b000000u)) - vec4<f32>(8388608.0 - bias);
}

// The four two's complement int8 codes of a word, element 4i in the low byte, exactly: each
// byte's sign bit flipped (the code plus 128, 0 to 255), placed in the mantissa of 2^23, then
// 2^23 + 128 subtracted. No int-to-float conversion (see kv_small_f32x4).
fn kv_int8x4(w: u32) -> vec4<f32> {
    let u = (vec4<u32>(w ^ 0x80808080u) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xffu);
    return bitcast<vec4<f32>>(u | vec4<u32>(0x4b000000u)) - vec4<f32>(8388736.0);
}

// kv_f16_to_f32_bits as a value.
fn kv_f16(h: u32) -> f32 {
    return bitcast<f32>(kv_f16_to_f32_bits(h));
}

// Two f16 values, element 2i in the low half.
fn kv_unpack_f16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(kv_f16(w & 0xffffu), kv_f16(w >> 16u));
}

// Two bf16 values, element 2i in the low half.
fn kv_unpack_bf16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

// OCP E4M3 "fn" code (low 8 bits of b): bias 7, no infinities, 0x7f/0xff NaN.
fn kv_fp8_e4m3(b: u32) -> f32 {
    let sign = (b & 0x80u) << 24u;
    let em = b & 0x7fu;
    let m = b & 7u;
    // Normal: exponent field rebiased from 7 to 127.
    let normal = (em << 20u) + (120u << 23u);
    // Subnormal (or zero) m * 2^-9, exact and normal in f32 (see kv_f16_to_f32_bits).
    let sub = kv_sub_normal(121u, m << 20u);
    var bits = select(normal, sub, em < 8u);
    bits = select(bits, 0x7fc00000u, em == 0x7fu);
    return bitcast<f32>(sign | bits);
}

// OCP E5M2 code (low 8 bits of b): bias 15, 0x7c infinity, 0x7d..0x7f NaN.
fn kv_fp8_e5m2(b: u32) -> f32 {
    let sign = (b & 0x80u) << 24u;
    let em = b & 0x7fu;
    let m = b & 3u;
    let normal = (em << 21u) + (112u << 23u);
    // Subnormal (or zero) m * 2^-16, exact and normal in f32.
    let sub = kv_sub_normal(113u, m << 21u);
    var bits = select(normal, sub, em < 4u);
    bits = select(bits, 0x7f800000u, em == 0x7cu);
    bits = select(bits, 0x7fc00000u, em > 0x7cu);
    return bitcast<f32>(sign | bits);
}

// The four bytes of a word, element 4i in the low byte.
fn kv_bytes(w: u32) -> vec4<u32> {
    return (vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xffu);
}

// u32 words per token row (KvDtype::words_per_row).
fn kv_words_per_row(dtype: u32, dim: u32) -> u32 {
    switch dtype {
        case KV_F32: {
            return dim;
        }
        case KV_F16, KV_BF16: {
            return dim / 2u;
        }
        case KV_INT4: {
            return dim / 8u;
        }
        default: {
            return dim / 4u;
        }
    }
}

// Scale words per token row (KvDtype::scale_words_per_row).
fn kv_scale_words_per_row(dtype: u32, dim: u32, per_tensor: bool) -> u32 {
    switch dtype {
        case KV_FP8_E4M3, KV_FP8_E5M2: {
            return select(1u, 0u, per_tensor);
        }
        case KV_INT8: {
            return 1u;
        }
        case KV_INT4: {
            return dim / 32u;
        }
        default: {
            return 0u;
        }
    }
}


// Words from one value row of a pool block to the next (KvDtype::row_stride): the row's words
// rounded up to a multiple of 4, so every row starts on a 16-byte boundary.
fn kv_row_stride(dtype: u32, dim: u32) -> u32 {
    return (kv_words_per_row(dtype, dim) + 3u) & ~3u;
}

// Words of one pool block of `rows` token rows (KvDtype::block_words, the one definition of the
// block stride): the rows' values kv_row_stride words apart, then their scale words back to
// back, the whole rounded up to a multiple of 4 words.
fn kv_block_words(dtype: u32, dim: u32, per_tensor: bool, rows: u32) -> u32 {
    let spr = kv_scale_words_per_row(dtype, dim, per_tensor);
    return (rows * (kv_row_stride(dtype, dim) + spr) + 3u) & ~3u;
}
