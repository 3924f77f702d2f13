// kv_load.wgsl: decode token rows of K and V from any KV storage format
// (ARCHITECTURE.md section 6).
//
// Needs kv_format.wgsl (the decoders). Composed into kernels by plain string concatenation; core
// WGSL. The CPU codec in src/quant/ is the definition: kv_load4 computes the same f32 values,
// bit for bit, with the same operations in the same order.
//
// Pool layout. A pool is an array<u32> of blocks; a block holds KV_BLOCK_ROWS token rows (KV
// heads x slots, row r of the pool is row r % KV_BLOCK_ROWS of block r / KV_BLOCK_ROWS): first
// the rows' values, each `kv_words_per_row` words padded to `kv_row_stride` (a multiple of 4),
// then the rows' scale words, `kv_scale_words_per_row` each (f32 bits for per-row FP8 and int8;
// one word per group of 32 values for int4: f16 scale in the low half, f16 min in the high
// half), the block padded to `kv_block_words` (a multiple of 4): every block and every row
// starts on a 16-byte boundary (kv_format.wgsl holds the rule). Formats without per-row scales
// have no scale section, so row r's values start at word r * kv_row_stride.
//
// The including kernel MUST define:
//   fn kv_word(which: u32, i: u32) -> u32   word i of the K (which even) or V (which odd) pool;
//                                           the higher bits of `which` are the kernel's own
//                                           (a pool buffer slot), the functions here read bit 0
//   fn kv_tensor_scale(which: u32) -> f32   the per-tensor FP8 scale of K or V (called only
//                                           when K_SCALE_PER_TENSOR / V_SCALE_PER_TENSOR)
// and sets the overrides below.
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
// Token rows per block (KV heads x block size); 1 for rows back to back with their scales.
override KV_BLOCK_ROWS: u32 = 1u;

fn kv_dtype_of(which: u32) -> u32 {
    return select(K_DTYPE, V_DTYPE, (which & 1u) != 0u);
}

fn kv_dim_of(which: u32) -> u32 {
    return select(K_DIM, V_DIM, (which & 1u) != 0u);
}

fn kv_per_tensor_of(which: u32) -> bool {
    return select(K_SCALE_PER_TENSOR, V_SCALE_PER_TENSOR, (which & 1u) != 0u);
}

// Value words per row of K or V.
fn kv_wpr(which: u32) -> u32 {
    return kv_words_per_row(kv_dtype_of(which), kv_dim_of(which));
}

// Scale words per row of K or V.
fn kv_spr(which: u32) -> u32 {
    return kv_scale_words_per_row(kv_dtype_of(which), kv_dim_of(which), kv_per_tensor_of(which));
}

// Words from one value row to the next of K or V.
fn kv_stride(which: u32) -> u32 {
    return kv_row_stride(kv_dtype_of(which), kv_dim_of(which));
}

// Words of one block of K or V.
fn kv_block_stride(which: u32) -> u32 {
    return kv_block_words(kv_dtype_of(which), kv_dim_of(which), kv_per_tensor_of(which),
        KV_BLOCK_ROWS);
}

// First value word of pool row `row`.
fn kv_row_base(which: u32, row: u32) -> u32 {
    let stride = kv_stride(which);
    if kv_spr(which) == 0u {
        return row * stride;
    }
    return (row / KV_BLOCK_ROWS) * kv_block_stride(which) + (row % KV_BLOCK_ROWS) * stride;
}

// First scale word of pool row `row` (meaningful only when the format has per-row scales).
fn kv_scale_base(which: u32, row: u32) -> u32 {
    return (row / KV_BLOCK_ROWS) * kv_block_stride(which) + KV_BLOCK_ROWS * kv_stride(which)
        + (row % KV_BLOCK_ROWS) * kv_spr(which);
}

// Whether K or V rows carry a scale of their own (per-row FP8, int8), as opposed to none, a
// per-tensor scale or int4's per-group scales.
fn kv_row_scaled(which: u32) -> bool {
    let dtype = kv_dtype_of(which);
    let scaled = dtype == KV_FP8_E4M3 || dtype == KV_FP8_E5M2 || dtype == KV_INT8;
    return scaled && !kv_per_tensor_of(which);
}

// The factor every value of row `row` is multiplied by when read, for FP8 (per-tensor or per-row)
// and int8; 1 for the other formats. Kernels may apply it once per row instead of per value (to
// a dot product, or to a probability), reading values with kv_load4_codes.
fn kv_row_scale(which: u32, row: u32) -> f32 {
    switch kv_dtype_of(which) {
        case KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8: {
            if kv_per_tensor_of(which) {
                return kv_tensor_scale(which);
            }
            return bitcast<f32>(kv_word(which, kv_scale_base(which, row)));
        }
        default: {
            return 1.0;
        }
    }
}

// Values c4 * 4 .. c4 * 4 + 3 of row `row`, without the row factor kv_row_scale (FP8 and int8
// give their decoded codes; the other formats give their values).
fn kv_load4_codes(which: u32, row: u32, c4: u32) -> vec4<f32> {
    let dtype = kv_dtype_of(which);
    let base = kv_row_base(which, row);
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
        case KV_FP8_E4M3: {
            let b = kv_bytes(kv_word(which, base + c4));
            r = vec4<f32>(kv_fp8_e4m3(b.x), kv_fp8_e4m3(b.y), kv_fp8_e4m3(b.z), kv_fp8_e4m3(b.w));
        }
        case KV_FP8_E5M2: {
            let b = kv_bytes(kv_word(which, base + c4));
            r = vec4<f32>(kv_fp8_e5m2(b.x), kv_fp8_e5m2(b.y), kv_fp8_e5m2(b.z), kv_fp8_e5m2(b.w));
        }
        case KV_INT8: {
            r = kv_int8x4(kv_word(which, base + c4));
        }
        case KV_INT4: {
            r = kv_int4_load4(which, row, c4, kv_int4_group(which, row, c4 / 8u));
        }
        default: {}
    }
    return r;
}

// The (scale, min) of int4 group g (values 32g .. 32g + 31) of row `row`: f16 scale in the low
// half of its scale word, f16 min in the high half.
fn kv_int4_group(which: u32, row: u32, g: u32) -> vec2<f32> {
    return kv_unpack_f16x2(kv_word(which, kv_scale_base(which, row) + g));
}

// Values c4 * 4 .. + 3 of int4 row `row`, whose group's (scale, min) is `sm` (kernels reading a
// whole row decode each group's parameters once).
fn kv_int4_load4(which: u32, row: u32, c4: u32, sm: vec2<f32>) -> vec4<f32> {
    // Eight codes per word: values c4 * 4 .. + 3 are one half of word c4 / 2.
    let w = kv_word(which, kv_row_base(which, row) + c4 / 2u) >> ((c4 & 1u) * 16u);
    let q = (vec4<u32>(w) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    return fma(kv_small_f32x4(q), vec4<f32>(sm.x), vec4<f32>(sm.y));
}

// Values c4 * 4 .. c4 * 4 + 3 of row `row`, decoded exactly as the CPU codec does.
fn kv_load4(which: u32, row: u32, c4: u32) -> vec4<f32> {
    let r = kv_load4_codes(which, row, c4);
    switch kv_dtype_of(which) {
        case KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8: {
            return r * kv_row_scale(which, row);
        }
        default: {
            return r;
        }
    }
}
