// qmatmul_tiled: y = W x over weights in a GGUF block format, tiled through workgroup memory
// for products of many rows (prefill chunks; src/decoder/ops/qmatmul_tiled.rs). The same
// products and the same bits as qmatmul.wgsl (the formats and the order of the sums: its
// header and lib/qmatmul_dot.wgsl).
//
// A workgroup of 256 invocations computes a tile of TX = 16 rows of x by TW = 16 rows of W.
// Invocation lid is lane l = lid % 16 (partial l: chunks l, l + 16, ...) of group g = lid / 16,
// which owns the 4 x 4 outputs x rows 4 (g / 4) .. + 3, W rows 4 (g % 4) .. + 3. The k
// dimension goes by rounds of 16 chunks (chunk 16 r + l is lane l's), each in 4 steps of 8
// values: the workgroup stages the step's 8 values of 16 chunks of its 16 x rows and of its 16
// W rows (decoded, invocation lid the piece (row lid / 16, chunk lid % 16)) in workgroup memory,
// then each invocation applies its chunk's values to its 16 outputs with fma, in order. A lane
// whose chunk is past the row adds nothing (not a zero: -0 + 0 and NaN * 0 would change bits).
// At the end the 16 partials of every output go through workgroup memory to the tree. Each
// weight is decoded once per 16 rows of x and each x value loaded once per 16 rows of W.
//
// Workgroup memory: 16 KiB (WebGPU's default limit), the staged x and W, then the partials.

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

// Rows of x and of W per tile.
const TX: u32 = 16u;
const TW: u32 = 16u;
const TILE_WG: u32 = 256u;

// Staged values, vec4 [piece][2] (x pieces 0 .. 255 first, then W pieces), piece (row, lane):
// 16 * row + lane. After the last round: the partials, vec4 [lane][group][4 x rows] (component:
// row of W).
var<workgroup> tile: array<vec4<f32>, 1024>;

// Staged values 8p .. 8p + 7 of x row i (of the tile) in lane l's chunk.
fn staged_x(i: u32, l: u32) -> Values8 {
    let at = 2u * (16u * i + l);
    return Values8(tile[at], tile[at + 1u]);
}

// The same of W row r.
fn staged_w(r: u32, l: u32) -> Values8 {
    let at = 2u * (256u + 16u * r + l);
    return Values8(tile[at], tile[at + 1u]);
}

// acc + x row i's 8 values against the 4 W rows (component: row of W), in order.
fn tile_dot(wv: Rows4, i: u32, l: u32, acc: vec4<f32>) -> vec4<f32> {
    let xv = staged_x(i, l);
    return dot8x4(wv, xv.a, xv.b, acc);
}

@compute @workgroup_size(TILE_WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let l = lid % 16u;
    let g = lid / 16u;
    // The tile's first rows of W and x; this invocation's outputs within it.
    let ow = wid.x * TW;
    let tx = wid.y * TX;
    let oi = 4u * (g / 4u);
    let orow = 4u * (g % 4u);
    let chunks = params.k / 32u;
    let rounds = (chunks + 15u) / 16u;
    // The piece this invocation stages: x row sx and W row sw (both lid / 16), chunk of lane
    // lid % 16 (= l).
    let srow = g;
    let sx = params.x_base / 4u + min(tx + srow, params.rows - 1u) * (params.k / 4u);
    let sw = min(ow + srow, params.n - 1u);

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var r = 0u; r < rounds; r++) {
        let c = 16u * r + l;
        let live = c < chunks;
        // The chunk header, once per round (a lane past the row stages its last chunk: never
        // used).
        let ch = ggml_chunk(sw, chunks, min(c, chunks - 1u));
        for (var p = 0u; p < 4u; p++) {
            let xo = sx + min(c, chunks - 1u) * 8u + 2u * p;
            let wv = ggml_values8(ch, p);
            tile[2u * lid] = x[xo];
            tile[2u * lid + 1u] = x[xo + 1u];
            tile[2u * (256u + lid)] = wv.a;
            tile[2u * (256u + lid) + 1u] = wv.b;
            workgroupBarrier();
            if live {
                let w4 = Rows4(array<Values8, 4>(staged_w(orow, l), staged_w(orow + 1u, l),
                    staged_w(orow + 2u, l), staged_w(orow + 3u, l)));
                acc0 = tile_dot(w4, oi, l, acc0);
                acc1 = tile_dot(w4, oi + 1u, l, acc1);
                acc2 = tile_dot(w4, oi + 2u, l, acc2);
                acc3 = tile_dot(w4, oi + 3u, l, acc3);
            }
            workgroupBarrier();
        }
    }
    // Partials: [lane][group][x row of 4].
    let pb = (16u * l + g) * 4u;
    tile[pb] = acc0;
    tile[pb + 1u] = acc1;
    tile[pb + 2u] = acc2;
    tile[pb + 3u] = acc3;
    workgroupBarrier();
    // Invocation lid adds output (group lid / 16, x row lid % 4) for its 4 rows of W; only the
    // first 64 invocations have one.
    if lid < 64u {
        let og = lid / 4u;
        let oxi = lid % 4u;
        var v: array<vec4<f32>, LANES>;
        for (var j = 0u; j < LANES; j++) {
            v[j] = tile[(16u * j + og) * 4u + oxi];
        }
        store4(tx + 4u * (og / 4u) + oxi, ow + 4u * (og % 4u), lane_tree(&v));
    }
}
