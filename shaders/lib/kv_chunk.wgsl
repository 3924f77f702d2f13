// kv_chunk.wgsl: decode a 16-byte chunk (four words) of a K/V row of any format into vec4
// columns, for the paged attention kernels that read rows 16 bytes at a time (paged.wgsl,
// paged_lanes.wgsl). Needs kv_format.wgsl, and `fn kv_half2(w: u32) -> vec2<f32>` from the
// including kernel (two f16 values of a word, element 2i in the low half, exact).
//
// Four words hold 4 columns (vec4s of values) of f32, 8 of f16/bf16, 16 of FP8/int8 and 32 of
// int4, which is exactly one int4 scale group. The values are kv_load4_codes's, bit for bit.

// Column i of the four words `wv` of a row of `dtype`, as kv_load4_codes gives it (int4 with its
// group's (scale, min) `sm`; the four words are one whole int4 group).
fn kv_quad_of(dtype: u32, wv: vec4<u32>, i: u32, sm: vec2<f32>) -> vec4<f32> {
    switch dtype {
        case KV_F32: {
            return bitcast<vec4<f32>>(wv);
        }
        case KV_F16: {
            return vec4<f32>(kv_half2(wv[2u * i]), kv_half2(wv[2u * i + 1u]));
        }
        case KV_BF16: {
            return vec4<f32>(kv_unpack_bf16x2(wv[2u * i]), kv_unpack_bf16x2(wv[2u * i + 1u]));
        }
        case KV_FP8_E4M3: {
            let b = kv_bytes(wv[i]);
            return vec4<f32>(kv_fp8_e4m3(b.x), kv_fp8_e4m3(b.y), kv_fp8_e4m3(b.z), kv_fp8_e4m3(b.w));
        }
        case KV_FP8_E5M2: {
            let b = kv_bytes(wv[i]);
            return vec4<f32>(kv_fp8_e5m2(b.x), kv_fp8_e5m2(b.y), kv_fp8_e5m2(b.z), kv_fp8_e5m2(b.w));
        }
        case KV_INT8: {
            return kv_int8x4(wv[i]);
        }
        case KV_INT4: {
            let w = wv[i / 2u] >> ((i & 1u) * 16u);
            let q = (vec4<u32>(w) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
            return fma(kv_small_f32x4(q), vec4<f32>(sm.x), vec4<f32>(sm.y));
        }
        default: {
            return vec4<f32>(0.0);
        }
    }
}
