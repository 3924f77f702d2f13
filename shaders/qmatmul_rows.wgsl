// qmatmul_rows: y = W x over weights in a GGUF block format, the row mapping for CPU adapters
// (src/decoder/ops/qmatmul_rows.rs). The same products and the same bits as qmatmul.wgsl (the
// formats and the order of the sums: its header and lib/qmatmul_dot.wgsl).
//
// An invocation owns rows o0 .. o0 + 3 (o0 = (wid.x * ROW_WG + lid) * 4) of each of the
// dispatch's WINDOWS windows of W and computes their LANES partials one after another (partial
// l over chunks l, l + LANES, ...), then the tree in registers: no workgroup memory and no
// barrier (a CPU adapter turns a barrier into a coroutine switch). Rows of x are taken ROWS_T
// at a time (1, 2 or 4), each chunk of W decoded once per ROWS_T rows; with one row of x, each
// x value is loaded once per 4 WINDOWS rows of W. The host picks this kernel for every product
// on a CPU adapter whose operands it can read.
//
// x and W are read through uniform bindings of 64 KiB (X_VEC4 vec4s) from offsets aligned for
// uniform bindings: on Mesa's llvmpipe and lavapipe a storage load whose address depends on a
// loop is a loop over the SIMD lanes, one scalar at a time through the stack, while a uniform
// load is the same scalar loads unrolled (no gather instruction: each lane's offset extracted,
// bounds-checked, loaded and inserted), which costs less; also where every lane's address is
// the same (docs/benchmarks.md, 2026-12-08). The host binds a window only when the buffer has
// UNIFORM usage and room for the whole window.

@group(0) @binding(0) var<uniform> params: QMatmulParams;
@group(0) @binding(1) var<uniform> x: array<vec4<f32>, X_VEC4>;
@group(0) @binding(2) var<uniform> w: array<vec4<u32>, X_VEC4>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
// Outputs 1 and 2 of a grouped product (several weights of one row of x, each window writing
// the output params.win_dst names: src/decoder/ops/qmatmul_group.rs); y again otherwise.
@group(0) @binding(4) var<storage, read_write> y1: array<f32>;
@group(0) @binding(5) var<storage, read_write> y2: array<f32>;
// Windows 1 to 3, 1 to 7 or 1 to 11 (those past WINDOWS: the dispatch's last window again,
// never read), and ggml_word reading word i of window `win` through them: written here by the
// host for the variant's 4, 8 or 12 windows (src/shader.rs, window_source). With params and x,
// 8 bound windows make 10 uniform bindings, within WebGPU's default of 12 a stage; 12 make 14,
// bound only where the device allows them (lavapipe and llvmpipe allow 15).
// @window-bindings

// vec4s of the x window: 64 KiB, the smallest maxUniformBufferBindingSize WebGPU allows.
const X_VEC4: u32 = 4096u;

// The window ggml_word reads: set (to a literal) before each chunk is decoded, so that once
// the calls are inlined every read's window is a constant and the switch folds away. A
// dispatch of several windows is one dispatch instead of several: on a CPU adapter each
// dispatch costs a wake-up and a wait of its threads.
var<private> win: u32;

// Chunk c of rows o0 .. o0 + 3 of window j (its last row repeated past its rows).
fn window_chunks4(j: u32, o0: u32, chunks: u32, c: u32) -> Chunks4 {
    win = j;
    return chunks4_in(o0, params.win_n[j / 4u][j % 4u], chunks, c);
}

// Values 8p .. 8p + 7 of the four chunks of window j.
fn window_rows4(j: u32, ch: Chunks4, p: u32) -> Rows4 {
    win = j;
    return rows4(ch, p);
}

// The output window_store4 writes: set before each store, as `win` before each read.
var<private> dst: u32;

fn y_get(i: u32) -> f32 {
    switch dst {
        case 1u: {
            return y1[i];
        }
        case 2u: {
            return y2[i];
        }
        default: {
            return y[i];
        }
    }
}

fn y_set(i: u32, v: f32) {
    switch dst {
        case 1u: {
            y1[i] = v;
        }
        case 2u: {
            y2[i] = v;
        }
        default: {
            y[i] = v;
        }
    }
}

// Writes the outputs of x row t for rows o0 .. o0 + 3 of window j, where they exist, into the
// window's output.
fn window_store4(j: u32, t: u32, o0: u32, v: vec4<f32>) {
    dst = params.win_dst[j / 4u][j % 4u];
    store4_in(t, o0, params.win_n[j / 4u][j % 4u], params.win_n_base[j / 4u][j % 4u], v);
}

// Invocations per workgroup: one SIMD vector of lavapipe (8 lanes), so that a window's rows
// make several workgroups for the adapter's threads to share (the host rounds a window to
// whole workgroups: whole_groups in src/decoder/ops/qmatmul.rs).
override ROW_WG: u32 = 8u;

// Row t of x's contribution (rows past `rows` repeat the last one): x values 8p .. 8p + 7 of
// its chunk (vec4 `xo` of row 0) against the decoded weights.
fn x_row_dot(w: Rows4, xo: u32, t: u32, acc: vec4<f32>) -> vec4<f32> {
    let at = xo + min(t, params.rows - 1u) * (params.k / 4u);
    return dot8x4(w, x[at], x[at + 1u], acc);
}

// Rows of x per decoded weight (1 to 4): each chunk of W an invocation decodes is applied to
// ROWS_T rows of x. The accumulators are indexed by literals only (registers on lavapipe).
override ROWS_T: u32 = 1u;

// Windows of W per dispatch (1 to 12; more than 1 only for one row of x, ROWS_T = 1): each
// invocation owns 4 rows in each, taken four windows at a time (a quad: windows 0 .. 3, then
// 4 .. 7, then 8 .. 11), each x value loaded once per quad for its 4 rows of each window.
override WINDOWS: u32 = 1u;

// The partials of lane l (chunks l, l + LANES, ...) of the 4 rows of W from o0: for rows t ..
// t + ROWS_T - 1 of x (a0 .. a3) in window 0, or with WINDOWS > 1 for x row t in windows
// first .. first + 3 (a0 .. a3; first = 0, 4 or 8, a literal at each call).
struct Partials {
    a0: vec4<f32>,
    a1: vec4<f32>,
    a2: vec4<f32>,
    a3: vec4<f32>,
}

fn partials(o0: u32, chunks: u32, t: u32, l: u32, first: u32) -> Partials {
    var acc = Partials(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    for (var c = l; c < chunks; c += LANES) {
        let ch = window_chunks4(first, o0, chunks, c);
        if WINDOWS > 1u {
            // One row of x, the same rows of each window of the quad (a1 .. a3: windows
            // first + 1 .. first + 3), each x value loaded once for all. A window past WINDOWS
            // repeats the last (unused).
            let ch1 = window_chunks4(min(first + 1u, WINDOWS - 1u), o0, chunks, c);
            let ch2 = window_chunks4(min(first + 2u, WINDOWS - 1u), o0, chunks, c);
            let ch3 = window_chunks4(min(first + 3u, WINDOWS - 1u), o0, chunks, c);
            let at = params.x_base / 4u + c * 8u;
            for (var p = 0u; p < 4u; p++) {
                let xa = x[at + 2u * p];
                let xb = x[at + 2u * p + 1u];
                acc.a0 = dot8x4(window_rows4(first, ch, p), xa, xb, acc.a0);
                if WINDOWS > first + 1u {
                    acc.a1 = dot8x4(window_rows4(first + 1u, ch1, p), xa, xb, acc.a1);
                }
                if WINDOWS > first + 2u {
                    acc.a2 = dot8x4(window_rows4(first + 2u, ch2, p), xa, xb, acc.a2);
                }
                if WINDOWS > first + 3u {
                    acc.a3 = dot8x4(window_rows4(first + 3u, ch3, p), xa, xb, acc.a3);
                }
            }
            continue;
        }
        for (var p = 0u; p < 4u; p++) {
            let wv = window_rows4(0u, ch, p);
            let xo = params.x_base / 4u + c * 8u + 2u * p;
            acc.a0 = x_row_dot(wv, xo, t, acc.a0);
            if ROWS_T > 1u {
                acc.a1 = x_row_dot(wv, xo, t + 1u, acc.a1);
            }
            if ROWS_T > 2u {
                acc.a2 = x_row_dot(wv, xo, t + 2u, acc.a2);
                acc.a3 = x_row_dot(wv, xo, t + 3u, acc.a3);
            }
        }
    }
    return acc;
}

fn add_partials(x: Partials, y: Partials) -> Partials {
    return Partials(x.a0 + y.a0, x.a1 + y.a1, x.a2 + y.a2, x.a3 + y.a3);
}

// The sums of x row t for the 4 rows of W from o0 in the quad from window `first` (a
// literal at each call): lane_tree's sums (lib/qmatmul_dot.wgsl: step o adds p[j + o] to p[j],
// o = 8, 4, 2, 1) without an indexed array, which a CPU adapter keeps in memory one lane at a
// time: taken in bit-reversed order (0, 8, 4, 12, 2, ...), the partials meet that tree as a
// left-to-right binary tree, which a binary counter sums with one pending value per level (h0
// .. h3: four levels and 4-bit reversal, for LANES = 16).
fn quad_sums(o0: u32, chunks: u32, t: u32, first: u32) -> Partials {
    var h0: Partials;
    var h1: Partials;
    var h2: Partials;
    var h3: Partials;
    var sum: Partials;
    for (var i = 0u; i < LANES; i++) {
        let leaf = partials(o0, chunks, t, reverseBits(i) >> 28u, first);
        if (i & 1u) == 0u {
            h0 = leaf;
            continue;
        }
        let n1 = add_partials(h0, leaf);
        if (i & 2u) == 0u {
            h1 = n1;
            continue;
        }
        let n2 = add_partials(h1, n1);
        if (i & 4u) == 0u {
            h2 = n2;
            continue;
        }
        let n3 = add_partials(h2, n2);
        if (i & 8u) == 0u {
            h3 = n3;
            continue;
        }
        sum = add_partials(h3, n3);
    }
    return sum;
}

// Writes the sums of x row t of the quad from window `first` (a literal) for its windows
// below WINDOWS.
fn quad_store(t: u32, o0: u32, first: u32, sum: Partials) {
    window_store4(first, t, o0, sum.a0);
    if WINDOWS > first + 1u {
        window_store4(first + 1u, t, o0, sum.a1);
    }
    if WINDOWS > first + 2u {
        window_store4(first + 2u, t, o0, sum.a2);
    }
    if WINDOWS > first + 3u {
        window_store4(first + 3u, t, o0, sum.a3);
    }
}

@compute @workgroup_size(ROW_WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o0 = (wid.x * ROW_WG + lid) * 4u;
    let chunks = params.k / 32u;
    for (var t = 0u; t < params.rows; t += ROWS_T) {
        let sum = quad_sums(o0, chunks, t, 0u);
        if WINDOWS > 1u {
            quad_store(t, o0, 0u, sum);
            // The 8- and 12-window variants' later quads (windows 4 .. 7, and 8 .. 11):
            // @later-quads
            continue;
        }
        window_store4(0u, t, o0, sum.a0);
        if ROWS_T > 1u {
            window_store4(0u, t + 1u, o0, sum.a1);
        }
        if ROWS_T > 2u {
            window_store4(0u, t + 2u, o0, sum.a2);
            window_store4(0u, t + 3u, o0, sum.a3);
        }
    }
}
