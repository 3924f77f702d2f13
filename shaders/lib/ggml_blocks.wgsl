// ggml_blocks.wgsl: values of a weight row stored in a GGUF block format (F32, F16, BF16,
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), eight at a time, exactly as the CPU decodes
// them (src/decoder/blocks/; the GPU layout and its padding: src/decoder/ops/qmatmul.rs).
//
// Needs kv_format.wgsl (kv_unpack_bf16x2, kv_small_plus_f32x4) and kv_half2 (half2_exact.wgsl,
// the exact integer decoder, or half2_convert.wgsl, unpack2x16float where the context found it
// exact: the same values either way). The including kernel MUST define
//   fn ggml_word(i: u32) -> u32   word i of the weight (rows back to back, blocks back to back)
// and sets the overrides below. A row is `chunks` chunks of 32 values; a chunk is a block of
// 32, or one sub-block of a K-quant's 256. Every value is an exact product in f32 (at most 23
// significant bits) plus at most one sum, so fused or not it has the CPU's bits.

// The ggml type (its id), the words of one block on the GPU, and the chunks (of 32 values)
// per block.
override FORMAT: u32 = 3u;
override BLOCK_WORDS: u32 = 5u;
override BLOCK_CHUNKS: u32 = 1u;

const GGML_F32: u32 = 0u;
const GGML_F16: u32 = 1u;
const GGML_Q4_0: u32 = 2u;
const GGML_Q4_1: u32 = 3u;
const GGML_Q5_0: u32 = 6u;
const GGML_Q5_1: u32 = 7u;
const GGML_Q8_0: u32 = 8u;
const GGML_Q4_K: u32 = 12u;
const GGML_Q5_K: u32 = 13u;
const GGML_Q6_K: u32 = 14u;
const GGML_BF16: u32 = 30u;

// Eight consecutive values of a chunk, in order.
struct Values8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

// Bytes 0..3 of w0 then of w1, each shifted right by `shift` and masked by `mask`.
fn ggml_bytes8(w0: u32, w1: u32, shift: u32, mask: u32) -> array<u32, 8> {
    let s = vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>(shift);
    let lo = (vec4<u32>(w0) >> s) & vec4<u32>(mask);
    let hi = (vec4<u32>(w1) >> s) & vec4<u32>(mask);
    return array<u32, 8>(lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w);
}

// Bits b .. b + 7 of `bits`, each as 0 or 16 (the fifth bit of a 5-bit code).
fn ggml_fifth8(bits: u32, b: u32) -> array<u32, 8> {
    let v = (vec4<u32>(bits) >> (vec4<u32>(b) + vec4<u32>(0u, 1u, 2u, 3u))) & vec4<u32>(1u);
    let u = (vec4<u32>(bits) >> (vec4<u32>(b) + vec4<u32>(4u, 5u, 6u, 7u))) & vec4<u32>(1u);
    return array<u32, 8>(v.x << 4u, v.y << 4u, v.z << 4u, v.w << 4u, u.x << 4u, u.y << 4u,
        u.z << 4u, u.w << 4u);
}

// scale * (code + bias) + offset for eight codes (offset -0.0 adds nothing: exact products).
// Each code + bias exactly, without an int-to-float conversion (kv_small_plus_f32x4: codes are
// below 2^8, biases -128 to 0).
fn ggml_scaled8(q: array<u32, 8>, bias: f32, scale: f32, offset: f32) -> Values8 {
    let a = kv_small_plus_f32x4(vec4<u32>(q[0], q[1], q[2], q[3]), bias);
    let b = kv_small_plus_f32x4(vec4<u32>(q[4], q[5], q[6], q[7]), bias);
    return Values8(a * scale + vec4<f32>(offset), b * scale + vec4<f32>(offset));
}

// Sum of two code arrays.
fn ggml_add8(a: array<u32, 8>, b: array<u32, 8>) -> array<u32, 8> {
    var r: array<u32, 8>;
    for (var i = 0u; i < 8u; i++) {
        r[i] = a[i] + b[i];
    }
    return r;
}

// (scale, min) of K-quant sub-block s from the three words of packed 6-bit fields at `at`.
fn ggml_k_scale_min(at: u32, s: u32) -> vec2<u32> {
    let q = array<u32, 3>(ggml_word(at), ggml_word(at + 1u), ggml_word(at + 2u));
    // Byte i of the 12.
    let b_s = (q[s / 4u] >> (8u * (s % 4u))) & 0xffu;
    let b_s4 = (q[(s + 4u) / 4u] >> (8u * ((s + 4u) % 4u))) & 0xffu;
    if s < 4u {
        return vec2<u32>(b_s & 63u, b_s4 & 63u);
    }
    let b_sm4 = (q[(s - 4u) / 4u] >> (8u * ((s - 4u) % 4u))) & 0xffu;
    return vec2<u32>((b_s4 & 15u) | ((b_sm4 >> 6u) << 4u), (b_s4 >> 4u) | ((b_s >> 6u) << 4u));
}

// What every piece of a chunk shares, read once per chunk: where its words start (the row's
// chunk for plain types, the block otherwise), its sub-block, the scale and offset of its
// values (Q6_K: the scales of its two halves of 16 values), and for the 32-value blocks whose
// pieces share code words (Q4_0, Q4_1, Q5_0, Q5_1: pieces p and p + 2 are the low and high
// nibbles of the same bytes) the four code words and the fifth bits, so that each word is
// loaded once per chunk (zero for the other formats).
struct GgmlChunk {
    at: u32,
    s: u32,
    scale: vec2<f32>,
    offset: f32,
    codes: vec4<u32>,
    fifth: u32,
}

// The four code words of a 32-value block from word `at`.
fn ggml_codes4(at: u32) -> vec4<u32> {
    return vec4<u32>(ggml_word(at), ggml_word(at + 1u), ggml_word(at + 2u), ggml_word(at + 3u));
}

// Chunk c of row `row` (rows of `chunks` chunks).
fn ggml_chunk(row: u32, chunks: u32, c: u32) -> GgmlChunk {
    switch FORMAT {
        case GGML_F32: {
            return GgmlChunk((row * chunks + c) * 32u, 0u, vec2<f32>(1.0), -0.0, vec4<u32>(0u), 0u);
        }
        case GGML_F16, GGML_BF16: {
            return GgmlChunk((row * chunks + c) * 16u, 0u, vec2<f32>(1.0), -0.0, vec4<u32>(0u), 0u);
        }
        default: {}
    }
    let bw = (row * (chunks / BLOCK_CHUNKS) + c / BLOCK_CHUNKS) * BLOCK_WORDS;
    let s = c % BLOCK_CHUNKS;
    switch FORMAT {
        case GGML_Q4_K, GGML_Q5_K: {
            let dm = kv_half2(ggml_word(bw));
            let sm = ggml_k_scale_min(bw + 1u, s);
            let scale = dm.x * f32(sm.x);
            let offset = dm.y * f32(sm.y);
            return GgmlChunk(bw, s, vec2<f32>(scale), -offset, vec4<u32>(0u), 0u);
        }
        case GGML_Q6_K: {
            // The scales of values 0-15 and 16-31 of chunk s: bytes 8(s / 4) + 2(s % 4) and the
            // next, of one word.
            let si = 8u * (s / 4u) + 2u * (s % 4u);
            let sc_word = ggml_word(bw + 48u + si / 4u) >> (8u * (si % 4u));
            let sc = vec2<i32>(bitcast<i32>(sc_word << 24u) >> 24u,
                bitcast<i32>(sc_word << 16u) >> 24u);
            let dq = kv_half2(ggml_word(bw + 52u)).x;
            return GgmlChunk(bw, s, dq * vec2<f32>(sc), -0.0, vec4<u32>(0u), 0u);
        }
        case GGML_Q4_0, GGML_Q4_1: {
            let dm = kv_half2(ggml_word(bw));
            let offset = select(-0.0, dm.y, FORMAT == GGML_Q4_1);
            return GgmlChunk(bw, s, vec2<f32>(dm.x), offset,
                ggml_codes4(bw + 1u), 0u);
        }
        case GGML_Q5_0, GGML_Q5_1: {
            let dm = kv_half2(ggml_word(bw));
            let offset = select(-0.0, dm.y, FORMAT == GGML_Q5_1);
            return GgmlChunk(bw, s, vec2<f32>(dm.x), offset,
                ggml_codes4(bw + 2u), ggml_word(bw + 1u));
        }
        default: {
            return GgmlChunk(bw, s, vec2<f32>(kv_half2(ggml_word(bw)).x), -0.0,
                vec4<u32>(0u), 0u);
        }
    }
}

// Values 8p .. 8p + 7 of chunk `ch`.
fn ggml_values8(ch: GgmlChunk, p: u32) -> Values8 {
    let bw = ch.at;
    let s = ch.s;
    let d = ch.scale.x;
    switch FORMAT {
        case GGML_F32: {
            let at = bw + 8u * p;
            return Values8(
                bitcast<vec4<f32>>(vec4<u32>(ggml_word(at), ggml_word(at + 1u),
                    ggml_word(at + 2u), ggml_word(at + 3u))),
                bitcast<vec4<f32>>(vec4<u32>(ggml_word(at + 4u), ggml_word(at + 5u),
                    ggml_word(at + 6u), ggml_word(at + 7u))),
            );
        }
        case GGML_F16, GGML_BF16: {
            let at = bw + 4u * p;
            if FORMAT == GGML_F16 {
                return Values8(
                    vec4<f32>(kv_half2(ggml_word(at)), kv_half2(ggml_word(at + 1u))),
                    vec4<f32>(kv_half2(ggml_word(at + 2u)), kv_half2(ggml_word(at + 3u))),
                );
            }
            return Values8(
                vec4<f32>(kv_unpack_bf16x2(ggml_word(at)), kv_unpack_bf16x2(ggml_word(at + 1u))),
                vec4<f32>(kv_unpack_bf16x2(ggml_word(at + 2u)),
                    kv_unpack_bf16x2(ggml_word(at + 3u))),
            );
        }
        default: {}
    }
    // Blocks of 32: piece p < 2 is the low nibbles of code bytes 8p ..; p >= 2 the high ones
    // of bytes 8(p - 2) ...
    let half = p / 2u;
    let pair = 2u * (p % 2u);
    switch FORMAT {
        case GGML_Q4_0, GGML_Q4_1: {
            let q = ggml_bytes8(ch.codes[pair], ch.codes[pair + 1u], 4u * half, 15u);
            return ggml_scaled8(q, select(0.0, -8.0, FORMAT == GGML_Q4_0), d, ch.offset);
        }
        case GGML_Q5_0, GGML_Q5_1: {
            let lo = ggml_bytes8(ch.codes[pair], ch.codes[pair + 1u], 4u * half, 15u);
            let q = ggml_add8(lo, ggml_fifth8(ch.fifth, 8u * p));
            return ggml_scaled8(q, select(0.0, -16.0, FORMAT == GGML_Q5_0), d, ch.offset);
        }
        case GGML_Q8_0: {
            let q = ggml_bytes8(ggml_word(bw + 1u + 2u * p), ggml_word(bw + 2u + 2u * p), 0u, 255u);
            // Sign-extend: codes 128..255 are -128..-1.
            var sq: array<u32, 8>;
            for (var i = 0u; i < 8u; i++) {
                sq[i] = q[i] ^ 128u;
            }
            return ggml_scaled8(sq, -128.0, d, -0.0);
        }
        case GGML_Q4_K, GGML_Q5_K: {
            // Sub-block s: 64-value piece s / 2, low (even s) or high nibbles of its 32 bytes.
            var codes_at = bw + 4u;
            var q: array<u32, 8>;
            if FORMAT == GGML_Q5_K {
                // Fifth bit of element l: bit s of qh byte l (qh: words 4 .. 11).
                let hb = ggml_bytes8(ggml_word(bw + 4u + 2u * p), ggml_word(bw + 5u + 2u * p), s,
                    1u);
                codes_at = bw + 12u;
                let lo = ggml_bytes8(ggml_word(codes_at + 8u * (s / 2u) + 2u * p),
                    ggml_word(codes_at + 8u * (s / 2u) + 2u * p + 1u), 4u * (s % 2u), 15u);
                for (var i = 0u; i < 8u; i++) {
                    q[i] = lo[i] | (hb[i] << 4u);
                }
            } else {
                q = ggml_bytes8(ggml_word(codes_at + 8u * (s / 2u) + 2u * p),
                    ggml_word(codes_at + 8u * (s / 2u) + 2u * p + 1u), 4u * (s % 2u), 15u);
            }
            return ggml_scaled8(q, 0.0, d, ch.offset);
        }
        case GGML_Q6_K: {
            // Chunk s: half h = s / 4, quarter kq = s % 4 (elements 128h + 32kq + l).
            let h = s / 4u;
            let kq = s % 4u;
            let ql_at = bw + 16u * h + 8u * (kq % 2u) + 2u * p;
            let lo = ggml_bytes8(ggml_word(ql_at), ggml_word(ql_at + 1u), 4u * (kq / 2u), 15u);
            let qh_at = bw + 32u + 8u * h + 2u * p;
            let hi = ggml_bytes8(ggml_word(qh_at), ggml_word(qh_at + 1u), 2u * kq, 3u);
            var q: array<u32, 8>;
            for (var i = 0u; i < 8u; i++) {
                q[i] = lo[i] | (hi[i] << 4u);
            }
            return ggml_scaled8(q, -32.0, ch.scale[p / 2u], -0.0);
        }
        default: {
            return Values8(vec4<f32>(0.0), vec4<f32>(0.0));
        }
    }
}
