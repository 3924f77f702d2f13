// qmatmul: y = W x over weights kept in their GGUF block format (src/decoder/ops/qmatmul.rs).
// For t < rows and o < n (the rows of W bound in this dispatch):
//
//   y[y_base + t * y_stride + n_base + o] = sum over i < k of W[o, i] * x[x_base + t * k + i]
//
// Weights. W is n rows of k values (k a multiple of 32), each row its blocks back to back, each
// block BLOCK_WORDS words (QB values): the file's bytes, with two bytes of padding after the
// leading f16 of Q4_0, Q5_0 and Q8_0 and after Q6_K's trailing f16 (qmatmul.rs, pack_rows), so
// that every code section starts on a word. A chunk is 32 consecutive values of a row (a block of
// 32, or one sub-block of a K-quant's 256); ggml_values8 (lib/ggml_blocks.wgsl) decodes 8 of
// them, exactly as the CPU (src/decoder/blocks/).
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

fn ggml_word(i: u32) -> u32 {
    return w[i];
}

// Rows of x per workgroup (1 to 8).
override ROWS: u32 = 1u;

const LANES: u32 = 16u;
const NCOL: u32 = 4u;
const WG: u32 = LANES * NCOL;

// acc + sum of w * x over 8 values, in order.
fn dot8(wv: Values8, xa: vec4<f32>, xb: vec4<f32>, acc: f32) -> f32 {
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
            let wv = ggml_values8(row, chunks, c, p);
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
