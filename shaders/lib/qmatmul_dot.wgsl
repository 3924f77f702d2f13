// qmatmul_dot.wgsl: what the three block-format product kernels share (qmatmul.wgsl,
// qmatmul_rows.wgsl, qmatmul_tiled.wgsl; host side src/decoder/ops/qmatmul.rs): the uniform,
// the decoding of four rows of W at once, and their dot product with eight x values.
//
// Needs ggml_blocks.wgsl. The including kernel MUST declare `params: QMatmulParams` and
// define `fn y_get(i: u32) -> f32` and `fn y_set(i: u32, v: f32)`, value i of its output (the
// row kernel's outputs are several buffers).
//
// Every kernel sums in the one order the CPU reference has (reference::qmatmul): partial l of
// LANES takes the chunks c with c % LANES == l in increasing order and adds w * x over each
// chunk's values in order with fma; the LANES partials are then added by a fixed tree (step
// o = LANES / 2, ..., 1: p[j] += p[j + o] for j < o). A kernel changes only who computes which
// partial, never a sum's operands or order: a row's bits do not depend on the kernel, the
// batch or the number of rows per workgroup.

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
    // 1: add each output into y (y's value first: the residual add, fused); 0: write it.
    accumulate: u32,
    // The row kernel's windows of W (window j: component j % 4 of element j / 4; zeros for
    // the other kernels): the first weight word inside window j's binding, its rows, and the
    // column of y its row 0 writes.
    win_w_base: array<vec4<u32>, 3>,
    win_n: array<vec4<u32>, 3>,
    win_n_base: array<vec4<u32>, 3>,
    // The row kernel's output of window j: 0 (y), 1 (y1) or 2 (y2).
    win_dst: array<vec4<u32>, 3>,
}

// Partials per output (lanes of a row of W).
const LANES: u32 = 16u;

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

// Chunk c of the four rows of W from o0 (the last row repeated past `n`).
struct Chunks4 {
    v: array<GgmlChunk, 4>,
}

fn chunks4(o0: u32, chunks: u32, c: u32) -> Chunks4 {
    return chunks4_in(o0, params.n, chunks, c);
}

// Chunk c of the four rows of W from o0 in a slice of n rows (n > 0; the last row repeated
// past n).
fn chunks4_in(o0: u32, n: u32, chunks: u32, c: u32) -> Chunks4 {
    let last = n - 1u;
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

// The fixed tree over LANES partials (component r: row r of W): the result of every kernel.
fn lane_tree(v: ptr<function, array<vec4<f32>, LANES>>) -> vec4<f32> {
    for (var step = LANES / 2u; step > 0u; step /= 2u) {
        for (var l = 0u; l < step; l++) {
            (*v)[l] = (*v)[l] + (*v)[l + step];
        }
    }
    return (*v)[0];
}

// Writes the outputs of x row t for the four rows of W from o0, where they exist.
fn store4(t: u32, o0: u32, v: vec4<f32>) {
    store4_in(t, o0, params.n, params.n_base, v);
}

// store4 for a slice of n rows of W whose row 0 writes column n_base of y (adds into it with
// params.accumulate).
fn store4_in(t: u32, o0: u32, n: u32, n_base: u32, v: vec4<f32>) {
    if t >= params.rows {
        return;
    }
    let base = params.y_base + t * params.y_stride + n_base;
    for (var r = 0u; r < 4u; r++) {
        if o0 + r < n {
            let i = base + o0 + r;
            if params.accumulate != 0u {
                y_set(i, y_get(i) + v[r]);
            } else {
                y_set(i, v[r]);
            }
        }
    }
}
