// qembed: the token-embedding gather from a table kept in its GGUF block format
// (src/decoder/ops/qembed.rs): out[t, :] = table[tokens[t], :] as f32, each value decoded by
// lib/ggml_blocks.wgsl exactly as the CPU does. An id >= vocab reads nothing and gets a row of
// zeros.
//
// The table may be split into parts of whole rows (one buffer each, see QWeight): a dispatch
// binds one part (ids row_lo .. row_lo + part_rows) and writes only the outputs whose id falls
// in it; the dispatch with zero_oob = 1 writes the zeros of out-of-range ids. One invocation
// per (token, chunk of 32 values, piece of 8) on a 2-D grid of workgroups.

struct QEmbedParams {
    n_tokens: u32,
    // Chunks (of 32 values) per row.
    chunks: u32,
    vocab: u32,
    // First id, and rows, of the bound part.
    row_lo: u32,
    part_rows: u32,
    // Invocations along x of the dispatch grid (64 * workgroups in x).
    stride_x: u32,
    // Index of the dispatch's first token and first output value inside their bindings.
    tokens_base: u32,
    out_base: u32,
    zero_oob: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> params: QEmbedParams;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn ggml_word(i: u32) -> u32 {
    return table[i];
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let idx = gid.y * params.stride_x + gid.x;
    let per_token = params.chunks * 4u;
    if idx >= params.n_tokens * per_token {
        return;
    }
    let t = idx / per_token;
    let c = (idx % per_token) / 4u;
    let p = idx % 4u;
    let at = params.out_base + t * params.chunks * 32u + c * 32u + p * 8u;
    let id = tokens[params.tokens_base + t];
    if id >= params.vocab {
        if params.zero_oob == 1u {
            for (var i = 0u; i < 8u; i++) {
                out[at + i] = 0.0;
            }
        }
        return;
    }
    if id < params.row_lo || id - params.row_lo >= params.part_rows {
        return;
    }
    let v = ggml_values8(ggml_chunk(id - params.row_lo, params.chunks, c), p);
    for (var i = 0u; i < 4u; i++) {
        out[at + i] = v.a[i];
        out[at + 4u + i] = v.b[i];
    }
}
