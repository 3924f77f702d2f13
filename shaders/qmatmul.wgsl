// qmatmul: y = W x over weights kept in their GGUF block format (src/decoder/ops/qmatmul.rs).
// For t < rows and o < n (the rows of W bound in this dispatch):
//
//   y[y_base + t * y_stride + n_base + o] = sum over i < k of W[o, i] * x[x_base + t * k + i]
//
// Weights. W is n rows of k values (k a multiple of 32), each row its blocks back to back, each
// block BLOCK_WORDS words (QB values): the file's bytes, with two bytes of padding after the
// leading f16 of Q4_0, Q5_0 and Q8_0 and after Q6_K's trailing f16 (qmatmul.rs, pack_rows), so
// that every code section starts on a word. A chunk is 32 consecutive values of a row (a block of
// 32, or one sub-block of a K-quant's 256); weights8 decodes 8 of them, exactly as the CPU
// (src/decoder/blocks/): every product is exact in f32 (at most 23 significant bits), so fused
// or not it gives the CPU's bits.
//
// Reduction order, the same for every number of rows (batch invariance) and the CPU reference:
// lane l of LANES takes the chunks c with c % LANES == l in increasing order and sums
// w * x over each chunk's values in order with fma into its partial; the LANES partials are then
// added by a fixed tree (step o = LANES / 2, ..., 1: p[j] += p[j + o] for j < o).
//
// Mapping. A workgroup of WG = LANES * NCOL invocations computes NCOL rows of W (lane group
// `col` row wid.x * NCOL + col) for ROWS rows of x (wid.y * ROWS ...): each lane decodes a
// chunk's weights once and applies them to every row of x, so a prefill chunk reads the weights
// once per ROWS rows. Adjacent lanes read adjacent chunks. Rows of x past `rows` repeat the last
// one and are not written; rows of W past `n` repeat the last one and are not written.

struct QMatmulParams {
    // Rows of x (and y) in this dispatch.
    rows: u32,
    // Values per row of W and x.
    k: u32,
    // Rows of W bound in this dispatch.
    n: u32,
    // Column of y that row 0 of the bound W writes.
    n_base: u32,
    // Values per row of y.
    y_stride: u32,
    // Index of the dispatch's first x value inside the x binding (a multiple of 4).
    x_base: u32,
    // Index of the dispatch's first y row (column 0) inside the y binding.
    y_base: u32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> params: QMatmulParams;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// The ggml type (its id) of W, the words of one block, and the chunks (of 32) per block.
override FORMAT: u32 = 3u;
override BLOCK_WORDS: u32 = 5u;
override BLOCK_CHUNKS: u32 = 1u;
// Rows of x per workgroup (1 to 8).
override ROWS: u32 = 1u;

const LANES: u32 = 16u;
const NCOL: u32 = 4u;
const WG: u32 = LANES * NCOL;

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
struct W8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

// Bytes 0..3 of w0 then of w1, each shifted right by `shift` and masked by `mask`.
fn bytes8(w0: u32, w1: u32, shift: u32, mask: u32) -> array<u32, 8> {
    let s = vec4<u32>(0u, 8u, 16u, 24u) + vec4<u32>(shift);
    let lo = (vec4<u32>(w0) >> s) & vec4<u32>(mask);
    let hi = (vec4<u32>(w1) >> s) & vec4<u32>(mask);
    return array<u32, 8>(lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w);
}

// Bits b .. b + 7 of `bits`, each as 0 or 16 (the fifth bit of a 5-bit code).
fn fifth8(bits: u32, b: u32) -> array<u32, 8> {
    let v = (vec4<u32>(bits) >> (vec4<u32>(b) + vec4<u32>(0u, 1u, 2u, 3u))) & vec4<u32>(1u);
    let u = (vec4<u32>(bits) >> (vec4<u32>(b) + vec4<u32>(4u, 5u, 6u, 7u))) & vec4<u32>(1u);
    return array<u32, 8>(v.x << 4u, v.y << 4u, v.z << 4u, v.w << 4u, u.x << 4u, u.y << 4u,
        u.z << 4u, u.w << 4u);
}

// scale * f32(code) + offset for eight codes (offset -0.0 adds nothing: exact products).
fn scaled8(q: array<u32, 8>, bias: f32, scale: f32, offset: f32) -> W8 {
    let a = vec4<f32>(f32(q[0]), f32(q[1]), f32(q[2]), f32(q[3])) + vec4<f32>(bias);
    let b = vec4<f32>(f32(q[4]), f32(q[5]), f32(q[6]), f32(q[7])) + vec4<f32>(bias);
    return W8(a * scale + vec4<f32>(offset), b * scale + vec4<f32>(offset));
}

// Sum of two code arrays.
fn add8(a: array<u32, 8>, b: array<u32, 8>) -> array<u32, 8> {
    var r: array<u32, 8>;
    for (var i = 0u; i < 8u; i++) {
        r[i] = a[i] + b[i];
    }
    return r;
}

// (scale, min) of K-quant sub-block s from the three words of packed 6-bit fields at `at`.
fn k_scale_min(at: u32, s: u32) -> vec2<u32> {
    let q = array<u32, 3>(w[at], w[at + 1u], w[at + 2u]);
    // Byte i of the 12.
    let b_s = (q[s / 4u] >> (8u * (s % 4u))) & 0xffu;
    let b_s4 = (q[(s + 4u) / 4u] >> (8u * ((s + 4u) % 4u))) & 0xffu;
    if s < 4u {
        return vec2<u32>(b_s & 63u, b_s4 & 63u);
    }
    let b_sm4 = (q[(s - 4u) / 4u] >> (8u * ((s - 4u) % 4u))) & 0xffu;
    return vec2<u32>((b_s4 & 15u) | ((b_sm4 >> 6u) << 4u), (b_s4 >> 4u) | ((b_s >> 6u) << 4u));
}

// Values 8p .. 8p + 7 of chunk c of W row `row`.
fn weights8(row: u32, c: u32, p: u32) -> W8 {
    let chunks = params.k / 32u;
    switch FORMAT {
        case GGML_F32: {
            let at = (row * chunks + c) * 32u + 8u * p;
            return W8(
                bitcast<vec4<f32>>(vec4<u32>(w[at], w[at + 1u], w[at + 2u], w[at + 3u])),
                bitcast<vec4<f32>>(vec4<u32>(w[at + 4u], w[at + 5u], w[at + 6u], w[at + 7u])),
            );
        }
        case GGML_F16, GGML_BF16: {
            let at = (row * chunks + c) * 16u + 4u * p;
            if FORMAT == GGML_F16 {
                return W8(
                    vec4<f32>(kv_unpack_f16x2(w[at]), kv_unpack_f16x2(w[at + 1u])),
                    vec4<f32>(kv_unpack_f16x2(w[at + 2u]), kv_unpack_f16x2(w[at + 3u])),
                );
            }
            return W8(
                vec4<f32>(kv_unpack_bf16x2(w[at]), kv_unpack_bf16x2(w[at + 1u])),
                vec4<f32>(kv_unpack_bf16x2(w[at + 2u]), kv_unpack_bf16x2(w[at + 3u])),
            );
        }
        default: {}
    }
    let block = row * (chunks / BLOCK_CHUNKS) + c / BLOCK_CHUNKS;
    let bw = block * BLOCK_WORDS;
    let s = c % BLOCK_CHUNKS;
    let head = w[bw];
    let d = kv_f16(head & 0xffffu);
    let m = kv_f16(head >> 16u);
    // Blocks of 32: piece p < 2 is the low nibbles of code bytes 8p ..; p >= 2 the high ones
    // of bytes 8(p - 2) ...
    let half = p / 2u;
    let pair = 2u * (p % 2u);
    switch FORMAT {
        case GGML_Q4_0: {
            let q = bytes8(w[bw + 1u + pair], w[bw + 2u + pair], 4u * half, 15u);
            return scaled8(q, -8.0, d, -0.0);
        }
        case GGML_Q4_1: {
            let q = bytes8(w[bw + 1u + pair], w[bw + 2u + pair], 4u * half, 15u);
            return scaled8(q, 0.0, d, m);
        }
        case GGML_Q5_0, GGML_Q5_1: {
            let lo = bytes8(w[bw + 2u + pair], w[bw + 3u + pair], 4u * half, 15u);
            let q = add8(lo, fifth8(w[bw + 1u], 8u * p));
            if FORMAT == GGML_Q5_0 {
                return scaled8(q, -16.0, d, -0.0);
            }
            return scaled8(q, 0.0, d, m);
        }
        case GGML_Q8_0: {
            let q = bytes8(w[bw + 1u + 2u * p], w[bw + 2u + 2u * p], 0u, 255u);
            // Sign-extend: codes 128..255 are -128..-1.
            var sq: array<u32, 8>;
            for (var i = 0u; i < 8u; i++) {
                sq[i] = q[i] ^ 128u;
            }
            return scaled8(sq, -128.0, d, -0.0);
        }
        case GGML_Q4_K, GGML_Q5_K: {
            // Sub-block s: 64-value piece s / 2, low (even s) or high nibbles of its 32 bytes.
            let sm = k_scale_min(bw + 1u, s);
            let scale = d * f32(sm.x);
            let offset = m * f32(sm.y);
            var codes_at = bw + 4u;
            var q: array<u32, 8>;
            if FORMAT == GGML_Q5_K {
                // Fifth bit of element l: bit s of qh byte l (qh: words 4 .. 11).
                let hb = bytes8(w[bw + 4u + 2u * p], w[bw + 5u + 2u * p], s, 1u);
                codes_at = bw + 12u;
                let lo = bytes8(w[codes_at + 8u * (s / 2u) + 2u * p],
                    w[codes_at + 8u * (s / 2u) + 2u * p + 1u], 4u * (s % 2u), 15u);
                for (var i = 0u; i < 8u; i++) {
                    q[i] = lo[i] | (hb[i] << 4u);
                }
            } else {
                q = bytes8(w[codes_at + 8u * (s / 2u) + 2u * p],
                    w[codes_at + 8u * (s / 2u) + 2u * p + 1u], 4u * (s % 2u), 15u);
            }
            return scaled8(q, 0.0, scale, -offset);
        }
        case GGML_Q6_K: {
            // Chunk s: half h = s / 4, quarter kq = s % 4 (elements 128h + 32kq + l).
            let h = s / 4u;
            let kq = s % 4u;
            let ql_at = bw + 16u * h + 8u * (kq % 2u) + 2u * p;
            let lo = bytes8(w[ql_at], w[ql_at + 1u], 4u * (kq / 2u), 15u);
            let qh_at = bw + 32u + 8u * h + 2u * p;
            let hi = bytes8(w[qh_at], w[qh_at + 1u], 2u * kq, 3u);
            var q: array<u32, 8>;
            for (var i = 0u; i < 8u; i++) {
                q[i] = lo[i] | (hi[i] << 4u);
            }
            let si = 8u * h + p / 2u + 2u * kq;
            let sc = bitcast<i32>(w[bw + 48u + si / 4u] << (24u - 8u * (si % 4u))) >> 24u;
            let dq = kv_f16(w[bw + 52u] & 0xffffu);
            return scaled8(q, -32.0, dq * f32(sc), -0.0);
        }
        default: {
            return W8(vec4<f32>(0.0), vec4<f32>(0.0));
        }
    }
}

// acc + sum of w * x over 8 values, in order.
fn dot8(wv: W8, xa: vec4<f32>, xb: vec4<f32>, acc: f32) -> f32 {
    var s = fma(wv.a.x, xa.x, acc);
    s = fma(wv.a.y, xa.y, s);
    s = fma(wv.a.z, xa.z, s);
    s = fma(wv.a.w, xa.w, s);
    s = fma(wv.b.x, xb.x, s);
    s = fma(wv.b.y, xb.y, s);
    s = fma(wv.b.z, xb.z, s);
    return fma(wv.b.w, xb.w, s);
}

var<workgroup> parts: array<f32, 512>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let col = lid / LANES;
    let lane = lid % LANES;
    let o = wid.x * NCOL + col;
    let row = min(o, params.n - 1u);
    let t0 = wid.y * ROWS;
    let chunks = params.k / 32u;
    let k4 = params.k / 4u;

    var acc: array<f32, 8>;
    for (var c = lane; c < chunks; c += LANES) {
        for (var p = 0u; p < 4u; p++) {
            let wv = weights8(row, c, p);
            let xo = params.x_base / 4u + c * 8u + 2u * p;
            for (var i = 0u; i < ROWS; i++) {
                let t = min(t0 + i, params.rows - 1u);
                let at = xo + t * k4;
                acc[i] = dot8(wv, x[at], x[at + 1u], acc[i]);
            }
        }
    }
    for (var i = 0u; i < ROWS; i++) {
        parts[i * WG + lid] = acc[i];
    }
    workgroupBarrier();
    if lane != 0u || o >= params.n {
        return;
    }
    for (var i = 0u; i < ROWS; i++) {
        let t = t0 + i;
        if t < params.rows {
            var v: array<f32, LANES>;
            for (var j = 0u; j < LANES; j++) {
                v[j] = parts[i * WG + lid + j];
            }
            for (var step = LANES / 2u; step > 0u; step /= 2u) {
                for (var j = 0u; j < step; j++) {
                    v[j] = v[j] + v[j + step];
                }
            }
            y[params.y_base + t * params.y_stride + params.n_base + o] = v[0];
        }
    }
}
