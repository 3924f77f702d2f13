// strided_copy: copy a strided [rows, heads, n] block of f32 values between buffers, bit for bit
// (the values travel as u32 words: NaN payloads and -0.0 are kept). For t < rows, h < heads,
// i < n:
//
//   dst[dst_offset + t * dst_row + h * dst_head + i] = src[src_offset + t * src_row + h * src_head + i]
//
// Strides in elements, relative to the bound ranges; src_head may be 0 (one row broadcast to
// every head). One invocation per element, element index (t * heads + h) * n + i, on a 2-D
// grid of workgroups.

struct StridedCopyParams {
    // Rows in this dispatch.
    rows: u32,
    heads: u32,
    n: u32,
    // Invocations along x of the dispatch grid (64 * workgroups in x).
    stride_x: u32,
    src_offset: u32,
    src_row: u32,
    src_head: u32,
    dst_offset: u32,
    dst_row: u32,
    dst_head: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: StridedCopyParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let idx = gid.y * params.stride_x + gid.x;
    let per_row = params.heads * params.n;
    if idx >= params.rows * per_row {
        return;
    }
    let t = idx / per_row;
    let h = (idx % per_row) / params.n;
    let i = idx % params.n;
    dst[params.dst_offset + t * params.dst_row + h * params.dst_head + i] =
        src[params.src_offset + t * params.src_row + h * params.src_head + i];
}
