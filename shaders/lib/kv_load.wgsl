// kv_load.wgsl: decode token rows of K and V from any KV storage format (DESIGN.md section 5).
//
// Composed into kernels by plain string concatenation. Core WGSL (no `enable f16`) that naga
// validates with no capabilities at all, so not even unpack2x16float (see kv_f16). The CPU codec
// in src/quant/ is the definition: every function here computes the same f32 values, bit for
// bit, with the same operations in the same order.
//
// The including kernel MUST define the two functions through which all memory is read:
//   fn kv_word(which: u32, i: u32) -> u32        word i of the K (which == 0u) or V (1u) pool
//   fn kv_scale_word(which: u32, i: u32) -> u32  word i of the K or V scale pool
// and sets the overrides below. Pools hold token rows back to back, `kv_words_per_row` words
// each (the Rust `KvDtype::words_per_row`); scale pools hold `kv_scale_words_per_row` words per
// row (f32 bits for per-row FP8 and int8; per group of 32 values for int4: f16 scale in the low
// half, f16 min in the high half). A per-tensor FP8 scale is word 0 of the scale pool.
//
// Exactness: f16 and FP8 decodes build the f32 bits with integer ops. The products below
// (fp8 * scale, int8 * scale) are single correctly rounded f32 multiplies; int4's
// fma(q, scale, min) has an exact product (4 x 11 significant bits), so it gives the same result
// fused or not. A driver that flushes subnormals may differ from the CPU on subnormal results
// only (tiny scales or values); bf16 subnormals are passed through as f32 subnormals.

const KV_F32: u32 = 0u;
const KV_F16: u32 = 1u;
const KV_BF16: u32 = 2u;
const KV_FP8_E4M3: u32 = 3u;
const KV_FP8_E5M2: u32 = 4u;
const KV_INT8: u32 = 5u;
const KV_INT4: u32 = 6u;

// Storage format (a KV_* code), head dim and scale kind of K and V.
override K_DTYPE: u32 = 0u;
override V_DTYPE: u32 = 0u;
override K_DIM: u32 = 128u;
override V_DIM: u32 = 128u;
override K_SCALE_PER_TENSOR: bool = false;
override V_SCALE_PER_TENSOR: bool = false;

// One f16 (low 16 bits of h), decoded by hand: exact, subnormals included. Not
// unpack2x16float: naga/wgpu 30 gate that behind Capabilities::SHADER_FLOAT16_IN_FLOAT32
// (DownlevelFlags::SHADER_F16_IN_F32, missing on lavapipe without SHADER_F16), and a driver may
// flush the f16 subnormals it produces.
fn kv_f16(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let em = h & 0x7fffu;
    let m = h & 0x3ffu;
    // Normal: exponent field rebiased from 15 to 127.
    let normal = (em << 13u) + (112u << 23u);
    // Subnormal m * 2^-24, normalised on the leading bit p of m (unused when m == 0).
    let p = firstLeadingBit(m);
    let sub = ((p + 103u) << 23u) | ((m ^ (1u << p)) << (23u - p));
    var bits = select(normal, sub, em < 0x400u);
    bits = select(bits, 0u, em == 0u);
    bits = select(bits, 0x7f800000u, em == 0x7c00u);
    bits = select(bits, 0x7fc00000u | (m << 13u), em > 0x7c00u);
    return bitcast<f32>(sign | bits);
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
    // Subnormal m * 2^-9, normalised on the leading bit p of m (unused when m == 0).
    let p = firstLeadingBit(m);
    let sub = ((p + 118u) << 23u) | ((m ^ (1u << p)) << (23u - p));
    var bits = select(normal, sub, em < 8u);
    bits = select(bits, 0u, em == 0u);
    bits = select(bits, 0x7fc00000u, em == 0x7fu);
    return bitcast<f32>(sign | bits);
}

// OCP E5M2 code (low 8 bits of b): bias 15, 0x7c infinity, 0x7d..0x7f NaN.
fn kv_fp8_e5m2(b: u32) -> f32 {
    let sign = (b & 0x80u) << 24u;
    let em = b & 0x7fu;
    let m = b & 3u;
    let normal = (em << 21u) + (112u << 23u);
    // Subnormal m * 2^-16.
    let p = firstLeadingBit(m);
    let sub = ((p + 111u) << 23u) | ((m ^ (1u << p)) << (23u - p));
    var bits = select(normal, sub, em < 4u);
    bits = select(bits, 0u, em == 0u);
    bits = select(bits, 0x7f800000u, em == 0x7cu);
    bits = select(bits, 0x7fc00000u, em > 0x7cu);
    return bitcast<f32>(sign | bits);
}

// Two's complement int8 code (low 8 bits of b).
fn kv_int8(b: u32) -> f32 {
    return f32(bitcast<i32>(b << 24u) >> 24u);
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

// Values c4 * 4 .. c4 * 4 + 3 of token row `row` of K (which == 0u) or V (which == 1u).
fn kv_load4(which: u32, row: u32, c4: u32) -> vec4<f32> {
    let is_v = which != 0u;
    let dtype = select(K_DTYPE, V_DTYPE, is_v);
    let dim = select(K_DIM, V_DIM, is_v);
    let per_tensor = select(K_SCALE_PER_TENSOR, V_SCALE_PER_TENSOR, is_v);
    let base = row * kv_words_per_row(dtype, dim);
    var r = vec4<f32>(0.0);
    switch dtype {
        case KV_F32: {
            let i = base + c4 * 4u;
            r = vec4<f32>(
                bitcast<f32>(kv_word(which, i)),
                bitcast<f32>(kv_word(which, i + 1u)),
                bitcast<f32>(kv_word(which, i + 2u)),
                bitcast<f32>(kv_word(which, i + 3u)),
            );
        }
        case KV_F16: {
            let i = base + c4 * 2u;
            let w = vec2<u32>(kv_word(which, i), kv_word(which, i + 1u));
            r = vec4<f32>(kv_unpack_f16x2(w.x), kv_unpack_f16x2(w.y));
        }
        case KV_BF16: {
            let i = base + c4 * 2u;
            let w = vec2<u32>(kv_word(which, i), kv_word(which, i + 1u));
            r = vec4<f32>(kv_unpack_bf16x2(w.x), kv_unpack_bf16x2(w.y));
        }
        case KV_FP8_E4M3, KV_FP8_E5M2: {
            let b = kv_bytes(kv_word(which, base + c4));
            let scale = bitcast<f32>(kv_scale_word(which, select(row, 0u, per_tensor)));
            if dtype == KV_FP8_E4M3 {
                r = vec4<f32>(
                    kv_fp8_e4m3(b.x), kv_fp8_e4m3(b.y), kv_fp8_e4m3(b.z), kv_fp8_e4m3(b.w)
                );
            } else {
                r = vec4<f32>(
                    kv_fp8_e5m2(b.x), kv_fp8_e5m2(b.y), kv_fp8_e5m2(b.z), kv_fp8_e5m2(b.w)
                );
            }
            r = r * scale;
        }
        case KV_INT8: {
            let w = kv_word(which, base + c4);
            // Sign-extend each byte: move it to the top, arithmetic shift back down.
            let top = vec4<u32>(w) << vec4<u32>(24u, 16u, 8u, 0u);
            let q = bitcast<vec4<i32>>(top) >> vec4<u32>(24u);
            r = vec4<f32>(q) * bitcast<f32>(kv_scale_word(which, row));
        }
        case KV_INT4: {
            // Eight codes per word: values c4 * 4 .. + 3 are one half of word c4 / 2.
            let w = kv_word(which, base + c4 / 2u) >> ((c4 & 1u) * 16u);
            let q = (vec4<u32>(w) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
            // Group c4 / 8 (32 values); f16 scale in the low half, f16 min in the high half.
            let sm = kv_unpack_f16x2(kv_scale_word(which, row * (dim / 32u) + c4 / 8u));
            r = fma(vec4<f32>(q), vec4<f32>(sm.x), vec4<f32>(sm.y));
        }
        default: {}
    }
    return r;
}
