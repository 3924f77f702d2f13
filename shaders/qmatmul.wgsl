// qmatmul: y = W x over weights kept in their GGUF block format (src/decoder/ops/qmatmul.rs),
// the lane mapping (GPUs; any number of rows). For t < rows and o < n (the rows of W bound in
// this dispatch):
//
//   y[y_base + t * y_stride + n_base + o] = sum over i < k of W[o, i] * x[x_base + t * k + i]
//
// Weights. W is n rows of k values (k a multiple of 32), each row its blocks back to back, each
// block BLOCK_WORDS words (QB values): the file's bytes, with two bytes of padding after the
// leading f16 of Q4_0, Q5_0 and Q8_0 and after Q6_K's trailing f16 (qmatmul.rs, pack_rows), so
// that every code section starts on a word. A chunk is 32 consecutive values of a row (a block of
// 32, or one sub-block of a K-quant's 256); ggml_values8 (lib/ggml_blocks.wgsl) decodes 8 of
// them, exactly as the CPU (src/decoder/blocks/). The order of the sums: lib/qmatmul_dot.wgsl.
//
// Mapping. A workgroup of WG = LANES * GROUPS invocations computes GROUPS * 4 rows of W (lane
// group g the 4 rows from (wid.x * GROUPS + g) * 4) for ROWS rows of x (wid.y * ROWS ...): lane
// l takes the partial l of its group's outputs, applies each x value it loads to its 4 rows of W
// and each chunk of weights it decodes to every row of x, so a product of several rows reads
// the weights once per ROWS rows. Adjacent lanes read adjacent chunks. Rows of x past `rows`
// repeat the last one, rows of W past `n` the last one; neither is written.
//
// NaN and infinities follow IEEE arithmetic, as in the CPU reference: nothing selects, clamps
// or skips, so a NaN or infinity in x or in a block's scale reaches every output that reads it.

@group(0) @binding(0) var<uniform> params: QMatmulParams;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// The output, for lib/qmatmul_dot.wgsl's stores.
fn y_get(i: u32) -> f32 {
    return y[i];
}

fn y_set(i: u32, v: f32) {
    y[i] = v;
}

fn ggml_word(i: u32) -> u32 {
    return w[i];
}

// Rows of x per workgroup (1 to 8).
override ROWS: u32 = 1u;

const GROUPS: u32 = 4u;
const WG: u32 = LANES * GROUPS;

// Row i of x's contribution: x values 8p .. 8p + 7 of its chunk (vec4 `xo` of the first row)
// against the decoded weights.
fn x_row_dot(w: Rows4, xo: u32, t0: u32, i: u32, acc: vec4<f32>) -> vec4<f32> {
    let at = xo + min(t0 + i, params.rows - 1u) * (params.k / 4u);
    return dot8x4(w, x[at], x[at + 1u], acc);
}

// Every row of x's contribution. The accumulators are indexed by literals only (rows past ROWS
// are trimmed by the `if`s on the constant), so that they stay in registers on compilers that
// keep arrays indexed by loop counters in memory (lavapipe).
fn rows_dot(w: Rows4, xo: u32, t0: u32, acc: ptr<function, array<vec4<f32>, 8>>) {
    (*acc)[0] = x_row_dot(w, xo, t0, 0u, (*acc)[0]);
    if ROWS > 1u {
        (*acc)[1] = x_row_dot(w, xo, t0, 1u, (*acc)[1]);
    }
    if ROWS > 2u {
        (*acc)[2] = x_row_dot(w, xo, t0, 2u, (*acc)[2]);
        (*acc)[3] = x_row_dot(w, xo, t0, 3u, (*acc)[3]);
    }
    if ROWS > 4u {
        (*acc)[4] = x_row_dot(w, xo, t0, 4u, (*acc)[4]);
        (*acc)[5] = x_row_dot(w, xo, t0, 5u, (*acc)[5]);
        (*acc)[6] = x_row_dot(w, xo, t0, 6u, (*acc)[6]);
        (*acc)[7] = x_row_dot(w, xo, t0, 7u, (*acc)[7]);
    }
}

// Each invocation's partial sums, vec4 [x row][invocation] (component: row of W).
var<workgroup> parts: array<vec4<f32>, 512>;

// The partials of invocation `lid` written to workgroup memory, every row of x.
fn store_parts(lid: u32, acc: ptr<function, array<vec4<f32>, 8>>) {
    parts[lid] = (*acc)[0];
    if ROWS > 1u {
        parts[WG + lid] = (*acc)[1];
    }
    if ROWS > 2u {
        parts[2u * WG + lid] = (*acc)[2];
        parts[3u * WG + lid] = (*acc)[3];
    }
    if ROWS > 4u {
        parts[4u * WG + lid] = (*acc)[4];
        parts[5u * WG + lid] = (*acc)[5];
        parts[6u * WG + lid] = (*acc)[6];
        parts[7u * WG + lid] = (*acc)[7];
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let grp = lid / LANES;
    let lane = lid % LANES;
    // The group's first row of W, and the workgroup's first row of x.
    let o0 = (wid.x * GROUPS + grp) * 4u;
    let t0 = wid.y * ROWS;
    let chunks = params.k / 32u;

    var acc: array<vec4<f32>, 8>;
    for (var c = lane; c < chunks; c += LANES) {
        let ch = chunks4(o0, chunks, c);
        for (var p = 0u; p < 4u; p++) {
            rows_dot(rows4(ch, p), params.x_base / 4u + c * 8u + 2u * p, t0, &acc);
        }
    }
    store_parts(lid, &acc);
    workgroupBarrier();
    // Lane i < ROWS of the group adds the partials of x row i (its 4 rows of W) by the tree:
    // one barrier in all.
    if lane < ROWS {
        var v: array<vec4<f32>, LANES>;
        for (var l = 0u; l < LANES; l++) {
            v[l] = parts[lane * WG + grp * LANES + l];
        }
        store4(t0 + lane, o0, lane_tree(&v));
    }
}
