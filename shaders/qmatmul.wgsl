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
// Mapping. A workgroup of WG = LANES * GROUPS invocations computes GROUPS * WROWS rows of W
// (lane group g the WROWS rows from (wid.x * GROUPS + g) * WROWS) for ROWS rows of x
// (wid.y * ROWS ...): each lane applies the x values it loads to its WROWS (4) rows of W and
// each chunk of weights it decodes to every row of x, so a prefill chunk reads the weights once
// per ROWS rows. Adjacent lanes read adjacent chunks. Rows of x past `rows` repeat the last one,
// rows of W past `n` the last one; neither is written. Neither WROWS nor ROWS changes the
// order of any sum. With ROW_MAJOR (one-row products on CPU adapters, see main_rows) an
// invocation computes a row's partials itself, with the same sums.
//
// NaN and infinities follow IEEE arithmetic, as in the CPU reference: nothing selects, clamps
// or skips, so a NaN or infinity in x or in a block's scale reaches every output that reads it.

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
// Whole rows of W an invocation (CPU adapters) instead of 16 lanes a row: the same sums.
override ROW_MAJOR: bool = false;

const LANES: u32 = 16u;
const GROUPS: u32 = 4u;
const WG: u32 = LANES * GROUPS;
// Invocations per workgroup: WG, or ROW_WG with ROW_MAJOR (fewer rows a workgroup, so that a
// narrow product still spreads over the cores).
override ROW_WG: u32 = 16u;
override WG_SIZE: u32 = select(WG, ROW_WG, ROW_MAJOR);
// Rows of W per lane group: a lane applies the x values it loads to WROWS rows of W (one per
// component of its accumulators) and each weight it decodes to ROWS rows of x.
const WROWS: u32 = 4u;

// The same value of four rows of W (component r: row r).
struct Rows4 {
    v: array<Values8, 4>,
}

// acc + sum over 8 values of w * x, in order; component r is row r of W.
fn dot8x4(w: Rows4, xa: vec4<f32>, xb: vec4<f32>, acc: vec4<f32>) -> vec4<f32> {
    let w0 = w.v[0];
    let w1 = w.v[1];
    let w2 = w.v[2];
    let w3 = w.v[3];
    var s = fma(vec4<f32>(w0.a.x, w1.a.x, w2.a.x, w3.a.x), vec4<f32>(xa.x), acc);
    s = fma(vec4<f32>(w0.a.y, w1.a.y, w2.a.y, w3.a.y), vec4<f32>(xa.y), s);
    s = fma(vec4<f32>(w0.a.z, w1.a.z, w2.a.z, w3.a.z), vec4<f32>(xa.z), s);
    s = fma(vec4<f32>(w0.a.w, w1.a.w, w2.a.w, w3.a.w), vec4<f32>(xa.w), s);
    s = fma(vec4<f32>(w0.b.x, w1.b.x, w2.b.x, w3.b.x), vec4<f32>(xb.x), s);
    s = fma(vec4<f32>(w0.b.y, w1.b.y, w2.b.y, w3.b.y), vec4<f32>(xb.y), s);
    s = fma(vec4<f32>(w0.b.z, w1.b.z, w2.b.z, w3.b.z), vec4<f32>(xb.z), s);
    return fma(vec4<f32>(w0.b.w, w1.b.w, w2.b.w, w3.b.w), vec4<f32>(xb.w), s);
}

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

// Chunk c of the four rows of W from o0 (the last row repeated past `n`).
struct Chunks4 {
    v: array<GgmlChunk, 4>,
}

fn chunks4(o0: u32, chunks: u32, c: u32) -> Chunks4 {
    let last = params.n - 1u;
    return Chunks4(array<GgmlChunk, 4>(
        ggml_chunk(min(o0, last), chunks, c),
        ggml_chunk(min(o0 + 1u, last), chunks, c),
        ggml_chunk(min(o0 + 2u, last), chunks, c),
        ggml_chunk(min(o0 + 3u, last), chunks, c),
    ));
}

// Values 8p .. 8p + 7 of the four chunks.
fn rows4(ch: Chunks4, p: u32) -> Rows4 {
    return Rows4(array<Values8, 4>(
        ggml_values8(ch.v[0], p),
        ggml_values8(ch.v[1], p),
        ggml_values8(ch.v[2], p),
        ggml_values8(ch.v[3], p),
    ));
}

// Writes row i of x's outputs (four rows of W from o0) where they exist.
fn store_row(i: u32, t0: u32, o0: u32, v: vec4<f32>) {
    let t = t0 + i;
    if i >= ROWS || t >= params.rows {
        return;
    }
    let base = params.y_base + t * params.y_stride + params.n_base;
    for (var r = 0u; r < WROWS; r++) {
        if o0 + r < params.n {
            y[base + o0 + r] = v[r];
        }
    }
}

// Whole rows an invocation (ROW_MAJOR, for CPU adapters): invocation lid owns rows of W
// (wid.x * ROW_WG + lid) * WROWS ... and computes the LANES partials of each of its outputs one
// after another (partial l over chunks l, l + LANES, ...), then the same tree in registers: the
// bits of the lane mapping, with no workgroup memory and no barrier. Rows of x are taken one at
// a time (each decodes the weights again: the host picks this mapping for one row).
fn main_rows(wid: vec3<u32>, lid: u32) {
    let o0 = (wid.x * ROW_WG + lid) * WROWS;
    let t0 = wid.y * ROWS;
    let chunks = params.k / 32u;
    for (var i = 0u; i < ROWS; i++) {
        var tree: array<vec4<f32>, LANES>;
        for (var l = 0u; l < LANES; l++) {
            var acc = vec4<f32>(0.0);
            for (var c = l; c < chunks; c += LANES) {
                let ch = chunks4(o0, chunks, c);
                for (var p = 0u; p < 4u; p++) {
                    acc = x_row_dot(rows4(ch, p), params.x_base / 4u + c * 8u + 2u * p, t0, i, acc);
                }
            }
            tree[l] = acc;
        }
        for (var step = LANES / 2u; step > 0u; step /= 2u) {
            for (var l = 0u; l < step; l++) {
                tree[l] = tree[l] + tree[l + step];
            }
        }
        store_row(i, t0, o0, tree[0]);
    }
}

@compute @workgroup_size(WG_SIZE)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if ROW_MAJOR {
        main_rows(wid, lid);
        return;
    }
    let grp = lid / LANES;
    let lane = lid % LANES;
    // The group's first row of W, and the workgroup's first row of x.
    let o0 = (wid.x * GROUPS + grp) * WROWS;
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
    // Lane j < ROWS * WROWS of the group adds the partials of output (x row j / WROWS, W row
    // j % WROWS) by the tree: one barrier in all.
    for (var j = lane; j < ROWS * WROWS; j += LANES) {
        let i = j / WROWS;
        let r = j % WROWS;
        var v: array<f32, LANES>;
        for (var l = 0u; l < LANES; l++) {
            v[l] = parts[i * WG + grp * LANES + l][r];
        }
        for (var step = LANES / 2u; step > 0u; step /= 2u) {
            for (var l = 0u; l < step; l++) {
                v[l] = v[l] + v[l + step];
            }
        }
        let t = t0 + i;
        if t < params.rows && o0 + r < params.n {
            y[params.y_base + t * params.y_stride + params.n_base + o0 + r] = v[0];
        }
    }
}
