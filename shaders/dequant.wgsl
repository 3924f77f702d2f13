// Dequantize token rows of any KV storage format to f32, exactly as the CPU codec decodes them.
//
// pool: rows of K_DIM values in format K_DTYPE with their scale words, in blocks of
// KV_BLOCK_ROWS rows (kv_load.wgsl: 1 for rows back to back with their scales, a BlockPool's
// `block_rows()` for a pool buffer); tensor_scale: word 0 is the per-tensor FP8 scale (when
// K_SCALE_PER_TENSOR); out: [*, K_DIM] f32.
//
// Without `gather`, row r of the pool goes to row r of out, for r < num_rows. With `gather`,
// pair p of `rows` (out row, pool row) decodes that pool row into that out row, for
// p < num_rows; other out rows are not touched. One invocation per 4 values.

struct DequantParams {
    // Rows to decode (pairs, when gathering).
    num_rows: u32,
    // Invocations along x of the dispatch grid (x * 64 * workgroups in x).
    stride_x: u32,
    // 1: decode the pool rows listed in `rows`; 0: rows 0 .. num_rows in order.
    gather: u32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> params: DequantParams;
@group(0) @binding(1) var<storage, read> pool: array<u32>;
@group(0) @binding(2) var<storage, read> tensor_scale: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;
// (out row, pool row) pairs when gathering; one unused word otherwise.
@group(0) @binding(4) var<storage, read> rows: array<u32>;

fn kv_word(which: u32, i: u32) -> u32 {
    return pool[i];
}

fn kv_tensor_scale(which: u32) -> f32 {
    return bitcast<f32>(tensor_scale[0]);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d4 = K_DIM / 4u;
    let i = gid.y * params.stride_x + gid.x;
    if i >= params.num_rows * d4 {
        return;
    }
    let r = i / d4;
    let c4 = i % d4;
    if params.gather != 0u {
        out[rows[2u * r] * d4 + c4] = kv_load4(0u, rows[2u * r + 1u], c4);
    } else {
        out[i] = kv_load4(0u, r, c4);
    }
}
