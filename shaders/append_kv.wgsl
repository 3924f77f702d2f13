// append_kv: write new token rows of K or V into their slots of one pool buffer, in place,
// encoding them into the pool's storage format (ARCHITECTURE.md sections 6 and 7), bit for bit as
// the CPU codec (`quant::encode_rows`) does; kv_store.wgsl holds the encoders.
//
// src: [n_src, Hkv, DIM] values, f32 bits or (SRC_F16) f16 pairs, element 2i in the low half.
// rows: pairs (source token index, global slot = block * block_size + offset), only slots whose
//   block lives in this buffer (the host partitions them).
// pool: blocks of R = Hkv * block_size rows, block `first_block` at word 0, each block
//   kv_block_words words (kv_format.wgsl: a multiple of 4): first every row's values (row
//   i = head * block_size + offset at word i * stride, stride = kv_row_stride, wpr rounded up to
//   4), then every row's scale words (row i at word R * stride + i * spr), as kv_load.wgsl reads
//   them; the padding words are never written. Scale words: f32 bits of the row's scale (per-row FP8, int8); one word per group
//   of 32 values, f16 scale low and f16 min high (int4). Per-tensor FP8 has none: its scale and
//   reciprocal are in `tensor`.
// One workgroup per (KV head, row entry); its invocations write the row's words.
//
// NaN, infinities and f32's extremes are encoded as the CPU codec encodes them (README, "NaN,
// infinities and extreme values"):
// - FP8: finite values saturate to +-max (also where x * inv_scale overflows), infinity stays
//   infinity in E5M2 and becomes NaN in E4M3, NaN stays NaN; a row's dynamic scale is at most
//   2^(127 - max exponent), so max times the scale is finite.
// - int8 (`Int8Scale::for_row`): a row holding NaN or an infinity gets the poisoned scale (NaN
//   bits 0x7fc00000) and every code 0; the scale steps down one f32 where 127 * scale would
//   overflow.
// - int4 (`Int4Params::for_group`): a group holding NaN or an infinity, or whose f16 scale or
//   min is not finite, gets f16 NaN (0x7e00) for both and every code 0.

struct AppendParams {
    num_entries: u32,
    // Entry handled by workgroup y = 0 of this dispatch (dispatches are chunked in y).
    entry_base: u32,
    num_kv_heads: u32,
    block_size: u32,
    first_block: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 64u;
// Head dim of this tensor; DST_DTYPE is its storage format (a KV_* code).
override DIM: u32 = 128u;
override DST_DTYPE: u32 = 0u;
override SRC_F16: bool = false;
// FP8 with the static scale of `tensor` (no scale words); otherwise scales per row.
override PER_TENSOR: bool = false;

@group(0) @binding(0) var<uniform> params: AppendParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read_write> pool: array<u32>;
@group(0) @binding(4) var<uniform> tensor: TensorScale;

// The row's amax (as f32 bits), reduced over the workgroup.
var<workgroup> wg_amax: atomic<u32>;

// f32 bits of element `e` of the source.
fn src_bits(e: u32) -> u32 {
    if SRC_F16 {
        return kv_f16_to_f32_bits((src[e / 2u] >> ((e & 1u) * 16u)) & 0xffffu);
    }
    return src[e];
}

// Word `w` of an unscaled row (f32, f16, bf16) whose first source element is `e0`.
fn encode_word(e0: u32, w: u32) -> u32 {
    switch DST_DTYPE {
        case KV_F16: {
            let e = e0 + 2u * w;
            return kv_f32_bits_to_f16(src_bits(e)) | (kv_f32_bits_to_f16(src_bits(e + 1u)) << 16u);
        }
        case KV_BF16: {
            let e = e0 + 2u * w;
            return kv_f32_bits_to_bf16(src_bits(e)) | (kv_f32_bits_to_bf16(src_bits(e + 1u)) << 16u);
        }
        default: {
            return src_bits(e0 + w);
        }
    }
}

// Code of one value in an 8-bit format (low 8 bits), `inv` the f32 bits of the reciprocal scale.
fn encode_byte(bits: u32, inv: u32) -> u32 {
    switch DST_DTYPE {
        case KV_FP8_E4M3: {
            let prod = kv_mul_bits(bits, inv);
            return kv_fp8_saturate_scaled(bits, prod, kv_encode_e4m3(prod), 0x7eu);
        }
        case KV_FP8_E5M2: {
            let prod = kv_mul_bits(bits, inv);
            return kv_fp8_saturate_scaled(bits, prod, kv_encode_e5m2(prod), 0x7bu);
        }
        default: {
            return kv_encode_int8(bits, inv);
        }
    }
}

// This invocation's share of the row's amax: the integer max of `bits & 0x7fffffff` over its
// elements, FP8 over finite values only (`amax_finite_bits`); for int8 a NaN counts as infinity,
// so the amax of a row holding either is infinity (the poisoned scale).
fn partial_amax(e0: u32, lid: u32) -> u32 {
    var m = 0u;
    for (var e = lid; e < DIM; e += WG) {
        let a = src_bits(e0 + e) & 0x7fffffffu;
        if DST_DTYPE == KV_INT8 {
            m = max(m, min(a, 0x7f800000u));
        } else if a < 0x7f800000u {
            m = max(m, a);
        }
    }
    return m;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let entry = params.entry_base + wid.y;
    // Workgroup-uniform. No early return: every invocation must reach the barriers below.
    let in_range = entry < params.num_entries;
    let h = wid.x;
    let e_row = select(0u, 2u * entry, in_range);
    let token = rows[e_row];
    let slot = rows[e_row + 1u];
    let block = slot / params.block_size - params.first_block;
    let offset = slot % params.block_size;
    let wpr = kv_words_per_row(DST_DTYPE, DIM);
    let spr = kv_scale_words_per_row(DST_DTYPE, DIM, PER_TENSOR);
    let stride = kv_row_stride(DST_DTYPE, DIM);
    let block_rows = params.num_kv_heads * params.block_size;
    let row = h * params.block_size + offset;
    let block_base = block * kv_block_words(DST_DTYPE, DIM, PER_TENSOR, block_rows);
    let dst = block_base + row * stride;
    let scale_dst = block_base + block_rows * stride + row * spr;
    let e0 = (token * params.num_kv_heads + h) * DIM;

    // Per-row FP8 and int8: the row's amax, reduced in workgroup memory.
    let fp8 = DST_DTYPE == KV_FP8_E4M3 || DST_DTYPE == KV_FP8_E5M2;
    var amax = 0u;
    if (fp8 && !PER_TENSOR) || DST_DTYPE == KV_INT8 {
        if lid == 0u {
            atomicStore(&wg_amax, 0u);
        }
        workgroupBarrier();
        if in_range {
            atomicMax(&wg_amax, partial_amax(e0, lid));
        }
        workgroupBarrier();
        amax = atomicLoad(&wg_amax);
    }
    if !in_range {
        return;
    }

    switch DST_DTYPE {
        case KV_FP8_E4M3, KV_FP8_E5M2, KV_INT8: {
            var inv = bitcast<u32>(tensor.inv_scale);
            if DST_DTYPE == KV_INT8 {
                let s = kv_int8_scale(amax);
                inv = s.y;
                if lid == 0u {
                    pool[scale_dst] = s.x;
                }
            } else if !PER_TENSOR {
                // Power of two 2^k: the reciprocal is exact, x * 2^-k is done exactly below.
                let k = kv_fp8_row_scale_exponent(amax, select(15, 8, DST_DTYPE == KV_FP8_E4M3));
                inv = u32(127 - k) << 23u;
                if lid == 0u {
                    pool[scale_dst] = u32(k + 127) << 23u;
                }
            }
            for (var w = lid; w < wpr; w += WG) {
                let e = e0 + 4u * w;
                pool[dst + w] = encode_byte(src_bits(e), inv)
                    | (encode_byte(src_bits(e + 1u), inv) << 8u)
                    | (encode_byte(src_bits(e + 2u), inv) << 16u)
                    | (encode_byte(src_bits(e + 3u), inv) << 24u);
            }
        }
        case KV_INT4: {
            // One invocation per group of 32 values: 4 value words and 1 scale word.
            for (var g = lid; g < DIM / 32u; g += WG) {
                let g0 = e0 + 32u * g;
                // Min and max by total order (-0 < +0), as Int4Params::for_group; a NaN or an
                // infinity poisons the group.
                var lo = kv_total_key(0x7f800000u);
                var hi = kv_total_key(0xff800000u);
                var finite = true;
                for (var i = 0u; i < 32u; i++) {
                    let b = src_bits(g0 + i);
                    finite = finite && (b & 0x7fffffffu) < 0x7f800000u;
                    let k = kv_total_key(b);
                    lo = min(lo, k);
                    hi = max(hi, k);
                }
                var p = vec4<u32>(0x7e00u, 0x7e00u, 0u, 0x7fc00000u);
                if finite {
                    p = kv_int4_params(kv_total_unkey(lo), kv_total_unkey(hi));
                }
                pool[scale_dst + g] = p.x | (p.y << 16u);
                for (var w = 0u; w < 4u; w++) {
                    var word = 0u;
                    for (var j = 0u; j < 8u; j++) {
                        word |= kv_encode_int4(src_bits(g0 + 8u * w + j), p.z, p.w) << (4u * j);
                    }
                    pool[dst + 4u * g + w] = word;
                }
            }
        }
        default: {
            for (var w = lid; w < wpr; w += WG) {
                pool[dst + w] = encode_word(e0, w);
            }
        }
    }
}
