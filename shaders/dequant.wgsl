// Dequantize token rows of any KV storage format to f32, exactly as the CPU codec decodes them.
//
// pool: rows of K_DIM values in format K_DTYPE, each followed by its scale words (kv_load.wgsl
// with KV_BLOCK_ROWS = 1); tensor_scale: word 0 is the per-tensor FP8 scale (when
// K_SCALE_PER_TENSOR); out: [num_rows, K_DIM] f32.

struct DequantParams {
    num_rows: u32,
    // Invocations along x of the dispatch grid (x * 64 * workgroups in x).
    stride_x: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: DequantParams;
@group(0) @binding(1) var<storage, read> pool: array<u32>;
@group(0) @binding(2) var<storage, read> tensor_scale: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

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
    out[i] = kv_load4(0u, i / d4, i % d4);
}
