// head_matmul: a strided, per-head batched matrix product (MLA up-projection and query
// absorption). For t < rows, h < heads, n < n_out:
//
//   y[y_offset + t * y_row + h * y_head + n] =
//       sum over k < inner of x[x_offset + t * x_row + h * x_head + k] * w[h * w_head + k * w_k + n * w_n]
//
// Strides in f32 elements, relative to the bound ranges (the host binds each dispatch's slice of
// x and y). Only the listed elements of y are written.
//
// Tiling. A workgroup of WG invocations computes a TM x TN tile of (rows, n_out) for one head
// (workgroup_id.y); workgroup_id.x numbers (row tile, column tile) pairs, column tile fastest.
// The invocations form a TY x TX grid; each keeps RM rows x (4 * RN4) columns of outputs in
// registers. Along k, TK at a time, the x tile (TM x TK, [m][k / 4] in vec4) goes through
// workgroup memory; so does the w tile (TK x TN, [k][n / 4]) when STAGE_W. Without STAGE_W (tiles
// of at most 8 rows, TY = 1: one invocation holds every row of its columns, so each weight is
// read once per workgroup anyway) invocations read their weights straight from w, with their
// columns interleaved (column (j * 4 + c) * TX + tx) so that neighbouring invocations read
// neighbouring weights. Loads are scalar (strides are arbitrary) and branch-free at the edges
// (out-of-range elements read element 0 and count as 0); only in-range outputs are written.
//
// Every output is one f32 accumulator summed in k order with fma, the same in every variant:
// a row's result does not depend on the tile shape the host picks for the batch (batch
// invariance). The padding of the last k stage adds exact zeros.

struct HeadMatmulParams {
    // Rows in this dispatch.
    rows: u32,
    inner: u32,
    n_out: u32,
    // Column tiles: workgroup_id.x = row tile * n_tiles + column tile.
    n_tiles: u32,
    x_offset: u32,
    x_row: u32,
    x_head: u32,
    w_head: u32,
    w_k: u32,
    w_n: u32,
    y_offset: u32,
    y_row: u32,
    y_head: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: HeadMatmulParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// Invocations per workgroup (64, or 32 for narrow one-row products).
override WG: u32 = 64u;

// Rows per tile, rows per invocation (1 to 8), column vec4s per invocation (1 to 4), k per stage
// (a multiple of 4). The register tile is indexed by constants only: its 8 rows and 4 vec4s are
// written out and trimmed by `if RM > i` / `if RN4 > j` on these constants, and vector
// components are picked by literal arguments of inlined functions. Loops over function-local
// arrays indexed by loop counters stay rolled on some drivers (lavapipe), which then keep the
// accumulators in memory: 6x slower there.
override TM: u32 = 64u;
override RM: u32 = 8u;
override RN4: u32 = 4u;
override TK: u32 = 16u;
// Whether the w tile goes through workgroup memory.
override STAGE_W: bool = true;

override TY: u32 = TM / RM;
override TX: u32 = WG / TY;
// Columns per tile and their vec4 count.
override TN: u32 = TX * RN4 * 4u;
override TN4: u32 = TN / 4u;
override TK4: u32 = TK / 4u;
// vec4s of the w tile (one, unused, without STAGE_W).
override WS_LEN: u32 = select(1u, TK * TN4, STAGE_W);

var<workgroup> xs: array<vec4<f32>, TM * TK4>;
var<workgroup> ws: array<vec4<f32>, WS_LEN>;

// One row of an invocation's register tile: RN4 vec4s of columns (the rest unused).
alias Row = array<vec4<f32>, 4>;

// Column (relative to the tile) of component c of accumulator vec4 j of invocation tx.
fn column(tx: u32, j: u32, c: u32) -> u32 {
    if STAGE_W {
        return (tx * RN4 + j) * 4u + c;
    }
    return (j * 4u + c) * TX + tx;
}

// The four columns of accumulator vec4 j of invocation tx, absolute.
fn columns(n0: u32, tx: u32, j: u32) -> vec4<u32> {
    return vec4<u32>(n0) + vec4<u32>(column(tx, j, 0u), column(tx, j, 1u), column(tx, j, 2u), column(tx, j, 3u));
}

// x[i] when `ok`, else 0 (branch-free: element 0 is read instead).
fn x_or_zero(i: u32, ok: bool) -> f32 {
    return select(0.0, x[select(0u, i, ok)], ok);
}

// w[i] when `ok`, else 0.
fn w_or_zero(i: u32, ok: bool) -> f32 {
    return select(0.0, w[select(0u, i, ok)], ok);
}

// Weights of row k (absolute) for accumulator vec4 j of invocation tx, read straight from w.
fn w_direct(w_base: u32, k: u32, n0: u32, tx: u32, j: u32) -> vec4<f32> {
    let kb = w_base + k * params.w_k;
    let n = columns(n0, tx, j);
    let ok = vec4<bool>(k < params.inner) & (n < vec4<u32>(params.n_out));
    let idx = vec4<u32>(kb) + n * params.w_n;
    return vec4<f32>(
        w_or_zero(idx.x, ok.x),
        w_or_zero(idx.y, ok.y),
        w_or_zero(idx.z, ok.z),
        w_or_zero(idx.w, ok.w),
    );
}

// Weights of local row kl for the invocation's columns.
fn w_row(kl: u32, w_base: u32, k0: u32, n0: u32, tx: u32) -> Row {
    var b: Row;
    if STAGE_W {
        let i = kl * TN4 + tx * RN4;
        b[0] = ws[i];
        if RN4 > 1u {
            b[1] = ws[i + 1u];
        }
        if RN4 > 2u {
            b[2] = ws[i + 2u];
        }
        if RN4 > 3u {
            b[3] = ws[i + 3u];
        }
    } else {
        let k = k0 + kl;
        b[0] = w_direct(w_base, k, n0, tx, 0u);
        if RN4 > 1u {
            b[1] = w_direct(w_base, k, n0, tx, 1u);
        }
        if RN4 > 2u {
            b[2] = w_direct(w_base, k, n0, tx, 2u);
        }
        if RN4 > 3u {
            b[3] = w_direct(w_base, k, n0, tx, 3u);
        }
    }
    return b;
}

// acc + a * b over the row's columns.
fn fma_row(acc: Row, a: f32, b: Row) -> Row {
    var r = acc;
    let av = vec4<f32>(a);
    r[0] = fma(av, b[0], r[0]);
    if RN4 > 1u {
        r[1] = fma(av, b[1], r[1]);
    }
    if RN4 > 2u {
        r[2] = fma(av, b[2], r[2]);
    }
    if RN4 > 3u {
        r[3] = fma(av, b[3], r[3]);
    }
    return r;
}

// The invocation's register tile: RM rows (the rest unused), always indexed by constants.
alias Tile = array<Row, 8>;

// One k step of every row: row i gains a[i][c] * b. Called with a literal c, so that every
// index is a constant once inlined.
fn fma_rows(acc: ptr<function, Tile>, a: ptr<function, array<vec4<f32>, 8>>, c: u32, b: Row) {
    (*acc)[0] = fma_row((*acc)[0], (*a)[0][c], b);
    if RM > 1u {
        (*acc)[1] = fma_row((*acc)[1], (*a)[1][c], b);
    }
    if RM > 2u {
        (*acc)[2] = fma_row((*acc)[2], (*a)[2][c], b);
    }
    if RM > 3u {
        (*acc)[3] = fma_row((*acc)[3], (*a)[3][c], b);
    }
    if RM > 4u {
        (*acc)[4] = fma_row((*acc)[4], (*a)[4][c], b);
    }
    if RM > 5u {
        (*acc)[5] = fma_row((*acc)[5], (*a)[5][c], b);
    }
    if RM > 6u {
        (*acc)[6] = fma_row((*acc)[6], (*a)[6][c], b);
    }
    if RM > 7u {
        (*acc)[7] = fma_row((*acc)[7], (*a)[7][c], b);
    }
}

// The x values of the invocation's rows at k step kq (four k each).
fn x_rows(r0: u32, kq: u32) -> array<vec4<f32>, 8> {
    var a: array<vec4<f32>, 8>;
    a[0] = xs[r0 * TK4 + kq];
    if RM > 1u {
        a[1] = xs[(r0 + 1u) * TK4 + kq];
    }
    if RM > 2u {
        a[2] = xs[(r0 + 2u) * TK4 + kq];
    }
    if RM > 3u {
        a[3] = xs[(r0 + 3u) * TK4 + kq];
    }
    if RM > 4u {
        a[4] = xs[(r0 + 4u) * TK4 + kq];
    }
    if RM > 5u {
        a[5] = xs[(r0 + 5u) * TK4 + kq];
    }
    if RM > 6u {
        a[6] = xs[(r0 + 6u) * TK4 + kq];
    }
    if RM > 7u {
        a[7] = xs[(r0 + 7u) * TK4 + kq];
    }
    return a;
}

// Writes the invocation's row i (tile row ty * RM + i).
fn store_row(acc: Row, i: u32, m0: u32, n0: u32, h: u32, ty: u32, tx: u32) {
    let t = m0 + ty * RM + i;
    if t >= params.rows {
        return;
    }
    let base = params.y_offset + t * params.y_row + h * params.y_head;
    for (var j = 0u; j < RN4; j++) {
        let n = columns(n0, tx, j);
        let ok = n < vec4<u32>(params.n_out);
        let s = acc[j];
        if ok.x {
            y[base + n.x] = s.x;
        }
        if ok.y {
            y[base + n.y] = s.y;
        }
        if ok.z {
            y[base + n.z] = s.z;
        }
        if ok.w {
            y[base + n.w] = s.w;
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.y;
    let m0 = (wid.x / params.n_tiles) * TM;
    let n0 = (wid.x % params.n_tiles) * TN;
    let ty = lid / TX;
    let tx = lid % TX;
    let inner = params.inner;
    let x_base = params.x_offset + h * params.x_head;
    let w_base = h * params.w_head;
    // x row of the invocation's row i in the x tile: xs[(r0 + i) * TK4 + kq].
    let r0 = ty * RM;

    // Zero-initialized.
    var acc: Tile;

    for (var k0 = 0u; k0 < inner; k0 += TK) {
        // The x tile: rows m0 .. m0 + TM, k0 .. k0 + TK.
        for (var v = lid; v < TM * TK4; v += WG) {
            let t = m0 + v / TK4;
            let k = k0 + (v % TK4) * 4u;
            let base = x_base + t * params.x_row + k;
            let ok = vec4<bool>(t < params.rows) & (vec4<u32>(k) + vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(inner));
            xs[v] = vec4<f32>(
                x_or_zero(base, ok.x),
                x_or_zero(base + 1u, ok.y),
                x_or_zero(base + 2u, ok.z),
                x_or_zero(base + 3u, ok.w),
            );
        }
        if STAGE_W {
            // The w tile: k0 .. k0 + TK, columns n0 .. n0 + TN.
            for (var v = lid; v < TK * TN4; v += WG) {
                let k = k0 + v / TN4;
                let n = vec4<u32>(n0 + (v % TN4) * 4u) + vec4<u32>(0u, 1u, 2u, 3u);
                let ok = vec4<bool>(k < inner) & (n < vec4<u32>(params.n_out));
                let idx = vec4<u32>(w_base + k * params.w_k) + n * params.w_n;
                ws[v] = vec4<f32>(
                    w_or_zero(idx.x, ok.x),
                    w_or_zero(idx.y, ok.y),
                    w_or_zero(idx.z, ok.z),
                    w_or_zero(idx.w, ok.w),
                );
            }
        }
        workgroupBarrier();
        for (var kq = 0u; kq < TK4; kq++) {
            var a = x_rows(r0, kq);
            fma_rows(&acc, &a, 0u, w_row(kq * 4u, w_base, k0, n0, tx));
            fma_rows(&acc, &a, 1u, w_row(kq * 4u + 1u, w_base, k0, n0, tx));
            fma_rows(&acc, &a, 2u, w_row(kq * 4u + 2u, w_base, k0, n0, tx));
            fma_rows(&acc, &a, 3u, w_row(kq * 4u + 3u, w_base, k0, n0, tx));
        }
        workgroupBarrier();
    }

    store_row(acc[0], 0u, m0, n0, h, ty, tx);
    if RM > 1u {
        store_row(acc[1], 1u, m0, n0, h, ty, tx);
    }
    if RM > 2u {
        store_row(acc[2], 2u, m0, n0, h, ty, tx);
    }
    if RM > 3u {
        store_row(acc[3], 3u, m0, n0, h, ty, tx);
    }
    if RM > 4u {
        store_row(acc[4], 4u, m0, n0, h, ty, tx);
    }
    if RM > 5u {
        store_row(acc[5], 5u, m0, n0, h, ty, tx);
    }
    if RM > 6u {
        store_row(acc[6], 6u, m0, n0, h, ty, tx);
    }
    if RM > 7u {
        store_row(acc[7], 7u, m0, n0, h, ty, tx);
    }
}
