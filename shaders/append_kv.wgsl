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
//   them. Scale words: f32 bits of the row's scale (per-row FP8, int8); one word per group of 32
//   values, f16 scale low and f16 min high (int4). Per-tensor FP8 has none: its scale and
//   reciprocal are in `tensor`.
// pool4 and pool_words are the same buffer: pool4 takes every value store, 16 bytes wide (a
//   row's stride is whole vec4<u32> units and starts on one: the pool layout's padding, whose
//   words past a row's wpr are written as 0); pool_words takes the scale words, which several
//   rows share a vec4 of. The two views never touch the same word. (A component store through
//   pool4 could be carried out as a read-modify-write of the whole vector, racing with another
//   workgroup's row whose scale word shares it.)
//
// Mapping: a workgroup of WG invocations serves ROWS = WG / LANES row entries (consecutive in
// the list) of one KV head; LANES consecutive invocations serve one row, lane l writing its
// 16-byte chunks l, l + LANES, .. (the host sizes LANES to the row's chunks, so short rows share
// a workgroup). Adjacent lanes thus read adjacent source words and write adjacent 16-byte
// chunks. Entries past the end of the list write nothing. Per-row FP8 and int8 reduce the row's
// amax over its lanes in workgroup memory (a fixed tree; max is exact); int4 gives one lane per
// group of 32 values (one chunk and one scale word).
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
    // Entry handled by the first row of workgroup y = 0 of this dispatch (dispatches are
    // chunked in y).
    entry_base: u32,
    num_kv_heads: u32,
    block_size: u32,
    first_block: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 64u;
// Invocations per row: a power of two dividing WG (append_kv.rs `lanes_per_row`).
override LANES: u32 = 16u;
// Head dim of this tensor; DST_DTYPE is its storage format (a KV_* code).
override DIM: u32 = 128u;
override DST_DTYPE: u32 = 0u;
override SRC_F16: bool = false;
// FP8 with the static scale of `tensor` (no scale words); otherwise scales per row.
override PER_TENSOR: bool = false;

@group(0) @binding(0) var<uniform> params: AppendParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read_write> pool4: array<vec4<u32>>;
@group(0) @binding(4) var<uniform> tensor: TensorScale;
@group(0) @binding(5) var<storage, read_write> pool_words: array<u32>;

// Per invocation, its share of its row's amax, reduced in place.
var<workgroup> wg_amax: array<u32, WG>;

// f32 bits of element `e` of the source.
fn src_bits(e: u32) -> u32 {
    if SRC_F16 {
        return kv_f16_to_f32_bits((src[e / 2u] >> ((e & 1u) * 16u)) & 0xffffu);
    }
    return src[e];
}

// f32 bits of elements e and e + 1 of the source (e even: one word of an f16 source).
fn src_pair(e: u32) -> vec2<u32> {
    if SRC_F16 {
        let w = src[e / 2u];
        return vec2<u32>(kv_f16_to_f32_bits(w & 0xffffu), kv_f16_to_f32_bits(w >> 16u));
    }
    return vec2<u32>(src[e], src[e + 1u]);
}

// Two f16 values as kv_f32_bits_to_f16(kv_f16_to_f32_bits(h)) gives each: h itself, except that
// a NaN gets its quiet bit (0x0200). (Finite f16 values and infinities are exact in f32 and come
// back unchanged; a NaN's f32 bits are sign | 0x7fc00000 | m << 13, which encode back to
// sign | 0x7e00 | m.)
fn f16_requiet2(w: u32) -> u32 {
    let nan = (vec2<u32>(w & 0x7fffu, (w >> 16u) & 0x7fffu)) > vec2<u32>(0x7c00u);
    return w | select(0u, 0x0200u, nan.x) | select(0u, 0x02000000u, nan.y);
}

// Word `w` of an unscaled row (f32, f16, bf16) whose first source element is `e0`.
fn encode_word(e0: u32, w: u32) -> u32 {
    switch DST_DTYPE {
        case KV_F16: {
            if SRC_F16 {
                return f16_requiet2(src[e0 / 2u + w]);
            }
            let p = src_pair(e0 + 2u * w);
            return kv_f32_bits_to_f16(p.x) | (kv_f32_bits_to_f16(p.y) << 16u);
        }
        case KV_BF16: {
            let p = src_pair(e0 + 2u * w);
            return kv_f32_bits_to_bf16(p.x) | (kv_f32_bits_to_bf16(p.y) << 16u);
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

// Word `w` of an 8-bit row (four codes, element 4w in the low byte).
fn encode_word8(e0: u32, w: u32, inv: u32) -> u32 {
    let e = e0 + 4u * w;
    let lo = src_pair(e);
    let hi = src_pair(e + 2u);
    return encode_byte(lo.x, inv) | (encode_byte(lo.y, inv) << 8u)
        | (encode_byte(hi.x, inv) << 16u) | (encode_byte(hi.y, inv) << 24u);
}

// The amax contribution of one value: the integer max of `bits & 0x7fffffff`, FP8 over finite
// values only (`amax_finite_bits`); for int8 a NaN counts as infinity, so the amax of a row
// holding either is infinity (the poisoned scale).
fn amax_of(bits: u32) -> u32 {
    let a = bits & 0x7fffffffu;
    if DST_DTYPE == KV_INT8 {
        return min(a, 0x7f800000u);
    }
    return select(0u, a, a < 0x7f800000u);
}

// The row's values of chunk c (16 values of an 8-bit row, fewer past DIM): their amax.
fn chunk_amax(e0: u32, c: u32) -> u32 {
    var m = 0u;
    for (var i = 0u; i < 16u; i += 2u) {
        let e = 16u * c + i;
        if e < DIM {
            let p = src_pair(e0 + e);
            m = max(m, max(amax_of(p.x), amax_of(p.y)));
        }
    }
    return m;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let lane = lid % LANES;
    let entry = params.entry_base + wid.y * (WG / LANES) + lid / LANES;
    // Not workgroup-uniform: no return before the barriers below.
    let in_range = entry < params.num_entries;
    let e_row = select(0u, 2u * entry, in_range);
    let token = rows[e_row];
    let slot = rows[e_row + 1u];
    let block = slot / params.block_size - params.first_block;
    let offset = slot % params.block_size;
    let wpr = kv_words_per_row(DST_DTYPE, DIM);
    let spr = kv_scale_words_per_row(DST_DTYPE, DIM, PER_TENSOR);
    let stride = kv_row_stride(DST_DTYPE, DIM);
    let chunks = stride / 4u;
    let block_rows = params.num_kv_heads * params.block_size;
    let row = h * params.block_size + offset;
    let block_base = block * kv_block_words(DST_DTYPE, DIM, PER_TENSOR, block_rows);
    let dst4 = (block_base + row * stride) / 4u;
    let scale_dst = block_base + block_rows * stride + row * spr;
    let e0 = (token * params.num_kv_heads + h) * DIM;

    // Per-row FP8 and int8: the row's amax, reduced over its LANES invocations.
    let fp8 = DST_DTYPE == KV_FP8_E4M3 || DST_DTYPE == KV_FP8_E5M2;
    var amax = 0u;
    if (fp8 && !PER_TENSOR) || DST_DTYPE == KV_INT8 {
        var m = 0u;
        if in_range {
            for (var c = lane; c < chunks; c += LANES) {
                m = max(m, chunk_amax(e0, c));
            }
        }
        wg_amax[lid] = m;
        workgroupBarrier();
        for (var s = LANES / 2u; s > 0u; s >>= 1u) {
            if lane < s {
                wg_amax[lid] = max(wg_amax[lid], wg_amax[lid + s]);
            }
            workgroupBarrier();
        }
        amax = wg_amax[lid - lane];
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
                if lane == 0u {
                    pool_words[scale_dst] = s.x;
                }
            } else if !PER_TENSOR {
                // Power of two 2^k: the reciprocal is exact, x * 2^-k is done exactly below.
                let k = kv_fp8_row_scale_exponent(amax, select(15, 8, DST_DTYPE == KV_FP8_E4M3));
                inv = u32(127 - k) << 23u;
                if lane == 0u {
                    pool_words[scale_dst] = u32(k + 127) << 23u;
                }
            }
            for (var c = lane; c < chunks; c += LANES) {
                var v = vec4<u32>(0u);
                for (var j = 0u; j < 4u; j++) {
                    if 4u * c + j < wpr {
                        v[j] = encode_word8(e0, 4u * c + j, inv);
                    }
                }
                pool4[dst4 + c] = v;
            }
        }
        case KV_INT4: {
            // One chunk per group of 32 values: 4 value words and 1 scale word.
            for (var g = lane; g < chunks; g += LANES) {
                let g0 = e0 + 32u * g;
                // Min and max by total order (-0 < +0), as Int4Params::for_group; a NaN or an
                // infinity poisons the group.
                var lo = kv_total_key(0x7f800000u);
                var hi = kv_total_key(0xff800000u);
                var finite = true;
                for (var i = 0u; i < 32u; i += 2u) {
                    let p = src_pair(g0 + i);
                    finite = finite && (p.x & 0x7fffffffu) < 0x7f800000u
                        && (p.y & 0x7fffffffu) < 0x7f800000u;
                    let kx = kv_total_key(p.x);
                    let ky = kv_total_key(p.y);
                    lo = min(lo, min(kx, ky));
                    hi = max(hi, max(kx, ky));
                }
                var p = vec4<u32>(0x7e00u, 0x7e00u, 0u, 0x7fc00000u);
                if finite {
                    p = kv_int4_params(kv_total_unkey(lo), kv_total_unkey(hi));
                }
                pool_words[scale_dst + g] = p.x | (p.y << 16u);
                var v = vec4<u32>(0u);
                for (var w = 0u; w < 4u; w++) {
                    var word = 0u;
                    for (var j = 0u; j < 8u; j += 2u) {
                        let q = src_pair(g0 + 8u * w + j);
                        word |= kv_encode_int4(q.x, p.z, p.w) << (4u * j);
                        word |= kv_encode_int4(q.y, p.z, p.w) << (4u * j + 4u);
                    }
                    v[w] = word;
                }
                pool4[dst4 + g] = v;
            }
        }
        default: {
            for (var c = lane; c < chunks; c += LANES) {
                var v = vec4<u32>(0u);
                for (var j = 0u; j < 4u; j++) {
                    if 4u * c + j < wpr {
                        v[j] = encode_word(e0, 4u * c + j);
                    }
                }
                pool4[dst4 + c] = v;
            }
        }
    }
}
