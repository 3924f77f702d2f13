// embed: out[t, :] = table[tokens[t], :] for the [n_tokens, dim] output, bit for bit (values
// travel as u32 words). An id >= vocab reads nothing and gets a row of zeros.
//
// The table may exceed one storage binding: the host binds it in slices of whole rows
// (ids vocab_lo .. vocab_lo + vocab_rows) and dispatches once per slice; a dispatch writes only
// the outputs whose id falls in its slice, and the dispatch with zero_oob = 1 (one per token
// chunk) writes the zeros of out-of-range ids, so every output element is written exactly once.
// One invocation per output element on a 2-D grid of workgroups.

struct EmbedParams {
    // Tokens in this dispatch.
    n_tokens: u32,
    dim: u32,
    vocab: u32,
    // First id, and number of rows, of the table slice bound in this dispatch.
    vocab_lo: u32,
    vocab_rows: u32,
    // Invocations along x of the dispatch grid (64 * workgroups in x).
    stride_x: u32,
    // Index of this dispatch's first token / first table row / first output row in the bindings.
    tokens_base: u32,
    table_base: u32,
    out_base: u32,
    // 1: this dispatch writes zeros for ids >= vocab.
    zero_oob: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: EmbedParams;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let idx = gid.y * params.stride_x + gid.x;
    if idx >= params.n_tokens * params.dim {
        return;
    }
    let t = idx / params.dim;
    let i = idx % params.dim;
    let id = tokens[params.tokens_base + t];
    if id >= params.vocab {
        if params.zero_oob == 1u {
            out[params.out_base + idx] = 0u;
        }
        return;
    }
    if id < params.vocab_lo || id - params.vocab_lo >= params.vocab_rows {
        return;
    }
    out[params.out_base + idx] = table[params.table_base + (id - params.vocab_lo) * params.dim + i];
}
