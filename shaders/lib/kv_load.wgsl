// kv_load.wgsl: decode token rows of K and V from any KV storage format (DESIGN.md section 5).
//
// Needs kv_format.wgsl (the decoders). Composed into kernels by plain string concatenation; core
// WGSL. The CPU codec in src/quant/ is the definition: kv_load4 computes the same f32 values,
// bit for bit, with the same operations in the same order.
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

// Storage format (a KV_* code), head dim and scale kind of K and V.
override K_DTYPE: u32 = 0u;
override V_DTYPE: u32 = 0u;
override K_DIM: u32 = 128u;
override V_DIM: u32 = 128u;
override K_SCALE_PER_TENSOR: bool = false;
override V_SCALE_PER_TENSOR: bool = false;

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
