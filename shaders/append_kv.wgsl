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
// src4 is src again as 16-byte units where SRC_VEC4 (every (token, head) row of the source is whole
//   16-byte units): each lane then reads its chunk's source values 16 bytes at a time, adjacent
//   lanes adjacent units. Otherwise it is unused (the host binds some other buffer there).
// pool4 and pool_words are two views of the pool buffer, and a dispatch binds the pool to one of
//   them only (the host binds the pool's spare buffer to the other): WebGPU refuses a buffer
//   bound twice where either binding is writable. Formats without scale words (f32, f16, bf16,
//   per-tensor FP8) store values through pool4, 16 bytes wide (a row's stride is whole
//   vec4<u32> units and starts on one: the pool layout's padding, whose words past a row's wpr
//   are written as 0). Formats with scale words (per-row FP8, int8, int4; VALUE_WORDS) store
//   values and scales through pool_words, a chunk as four word stores: several rows share a vec4
//   of scale words, and a component store through pool4 may be carried out as a
//   read-modify-write of the whole vector (WGSL allows it), racing with another workgroup's row.
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
// The source's rows are whole 16-byte units (DIM times the source's value bytes a multiple of 16):
// read it through src4.
override SRC_VEC4: bool = false;
// Values go through pool_words as words (the format has scale words; see pool4 above).
override VALUE_WORDS: bool = false;

@group(0) @binding(0) var<uniform> params: AppendParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read_write> pool4: array<vec4<u32>>;
@group(0) @binding(4) var<uniform> tensor: TensorScale;
@group(0) @binding(5) var<storage, read_write> pool_words: array<u32>;
@group(0) @binding(6) var<storage, read> src4: array<vec4<u32>>;

// Stores value chunk i (16-byte unit i of the pool buffer) through the view the dispatch binds.
fn store_chunk(i: u32, v: vec4<u32>) {
    if VALUE_WORDS {
        let w = 4u * i;
        pool_words[w] = v.x;
        pool_words[w + 1u] = v.y;
        pool_words[w + 2u] = v.z;
        pool_words[w + 3u] = v.w;
    } else {
        pool4[i] = v;
    }
}

// Per invocation, its share of its row's amax, reduced in place.
var<workgroup> wg_amax: array<u32, WG>;

// f32 bits of the two f16 values of word `w`, element 2i in the low half.
fn f16_word_bits(w: u32) -> vec2<u32> {
    return vec2<u32>(kv_f16_to_f32_bits(w & 0xffffu), kv_f16_to_f32_bits(w >> 16u));
}

// f32 bits of elements e and e + 1 of the source (e even: one word of an f16 source).
fn src_pair(e: u32) -> vec2<u32> {
    if SRC_F16 {
        return f16_word_bits(src[e / 2u]);
    }
    return vec2<u32>(src[e], src[e + 1u]);
}

// f32 bits of elements e .. e + 3 of the source, e - e0 a multiple of 4 (a whole 16-byte unit of
// an f32 source, half of one of an f16 source, where SRC_VEC4).
fn src_quad(e: u32) -> vec4<u32> {
    if SRC_VEC4 {
        if SRC_F16 {
            let u = src4[e / 8u];
            let w = select(u.xy, u.zw, (e & 4u) != 0u);
            return vec4<u32>(f16_word_bits(w.x), f16_word_bits(w.y));
        }
        return src4[e / 4u];
    }
    return vec4<u32>(src_pair(e), src_pair(e + 2u));
}

// Source words w .. w + 3 (w a multiple of 4 where SRC_VEC4).
fn src_word4(w: u32) -> vec4<u32> {
    if SRC_VEC4 {
        return src4[w / 4u];
    }
    return vec4<u32>(src[w], src[w + 1u], src[w + 2u], src[w + 3u]);
}

// Two f16 values as kv_f32_bits_to_f16(kv_f16_to_f32_bits(h)) gives each: h itself, except that
// a NaN gets its quiet bit (0x0200). (Finite f16 values and infinities are exact in f32 and come
// back unchanged; a NaN's f32 bits are sign | 0x7fc00000 | m << 13, which encode back to
// sign | 0x7e00 | m.)
fn f16_requiet2(w: u32) -> u32 {
    let nan = (vec2<u32>(w & 0x7fffu, (w >> 16u) & 0x7fffu)) > vec2<u32>(0x7c00u);
    return w | select(0u, 0x0200u, nan.x) | select(0u, 0x02000000u, nan.y);
}

// f32 bits -> the 16-bit storage format's bits (f16 or bf16).
fn half_bits(bits: u32) -> u32 {
    if DST_DTYPE == KV_BF16 {
        return kv_f32_bits_to_bf16(bits);
    }
    return kv_f32_bits_to_f16(bits);
}

// Words 4c .. 4c + 3 of an unscaled row (f32, f16, bf16) whose first source element is `e0`;
// words past the row's end hold whatever the source has there (the caller drops them).
fn encode_chunk(e0: u32, c: u32) -> vec4<u32> {
    if DST_DTYPE == KV_F32 {
        return src_quad(e0 + 4u * c);
    }
    if DST_DTYPE == KV_F16 && SRC_F16 {
        let w = src_word4(e0 / 2u + 4u * c);
        return vec4<u32>(f16_requiet2(w.x), f16_requiet2(w.y), f16_requiet2(w.z), f16_requiet2(w.w));
    }
    // Two values a word, element 2i in the low half.
    let a = src_quad(e0 + 8u * c);
    let b = src_quad(e0 + 8u * c + 4u);
    return vec4<u32>(
        half_bits(a.x) | (half_bits(a.y) << 16u),
        half_bits(a.z) | (half_bits(a.w) << 16u),
        half_bits(b.x) | (half_bits(b.y) << 16u),
        half_bits(b.z) | (half_bits(b.w) << 16u),
    );
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
    let q = src_quad(e0 + 4u * w);
    return encode_byte(q.x, inv) | (encode_byte(q.y, inv) << 8u)
        | (encode_byte(q.z, inv) << 16u) | (encode_byte(q.w, inv) << 24u);
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

// The row's values of chunk c (16 values of an 8-bit row, fewer past DIM, a multiple of 4 as
// every head dim is): their amax.
fn chunk_amax(e0: u32, c: u32) -> u32 {
    var m = 0u;
    for (var i = 0u; i < 16u; i += 4u) {
        let e = 16u * c + i;
        if e < DIM {
            let q = src_quad(e0 + e);
            m = max(m, max(max(amax_of(q.x), amax_of(q.y)), max(amax_of(q.z), amax_of(q.w))));
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
                store_chunk(dst4 + c, v);
            }
        }
        case KV_INT4: {
            // One chunk per group of 32 values: 4 value words and 1 scale word.
            for (var g = lane; g < chunks; g += LANES) {
                let g0 = e0 + 32u * g;
                // The group's values, read once for its min and max and for its codes. Min and
                // max by total order (-0 < +0), as Int4Params::for_group; a NaN or an infinity
                // poisons the group.
                var vals: array<vec4<u32>, 8>;
                var lo = kv_total_key(0x7f800000u);
                var hi = kv_total_key(0xff800000u);
                var finite = true;
                for (var i = 0u; i < 8u; i++) {
                    let q = src_quad(g0 + 4u * i);
                    vals[i] = q;
                    finite = finite && all((q & vec4<u32>(0x7fffffffu)) < vec4<u32>(0x7f800000u));
                    let k = vec4<u32>(
                        kv_total_key(q.x),
                        kv_total_key(q.y),
                        kv_total_key(q.z),
                        kv_total_key(q.w),
                    );
                    lo = min(lo, min(min(k.x, k.y), min(k.z, k.w)));
                    hi = max(hi, max(max(k.x, k.y), max(k.z, k.w)));
                }
                var p = vec4<u32>(0x7e00u, 0x7e00u, 0u, 0x7fc00000u);
                if finite {
                    p = kv_int4_params(kv_total_unkey(lo), kv_total_unkey(hi));
                }
                pool_words[scale_dst + g] = p.x | (p.y << 16u);
                // Word w holds values 8w .. 8w + 7 (quads 2w and 2w + 1), low nibble first.
                var v = vec4<u32>(0u);
                for (var w = 0u; w < 4u; w++) {
                    var word = 0u;
                    for (var h = 0u; h < 2u; h++) {
                        let q = vals[2u * w + h];
                        let sh = 16u * h;
                        word |= kv_encode_int4(q.x, p.z, p.w) << sh;
                        word |= kv_encode_int4(q.y, p.z, p.w) << (sh + 4u);
                        word |= kv_encode_int4(q.z, p.z, p.w) << (sh + 8u);
                        word |= kv_encode_int4(q.w, p.z, p.w) << (sh + 12u);
                    }
                    v[w] = word;
                }
                store_chunk(dst4 + g, v);
            }
        }
        default: {
            for (var c = lane; c < chunks; c += LANES) {
                let words = encode_chunk(e0, c);
                let keep = vec4<u32>(4u * c) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(wpr);
                store_chunk(dst4 + c, select(vec4<u32>(0u), words, keep));
            }
        }
    }
}
