// copy_blocks: copy whole blocks inside one pool buffer (copy-on-write of a shared partial
// block). wgpu cannot copy a buffer into itself, hence a kernel; copies between two buffers use
// copy_buffer_to_buffer. One workgroup per (source, destination) pair; a destination is never a
// source in the same dispatch.

struct CopyParams {
    num_pairs: u32,
    // Words per block.
    block_words: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: CopyParams;
// Pairs (source block, destination block), both local to this buffer.
@group(0) @binding(1) var<storage, read> pairs: array<u32>;
@group(0) @binding(2) var<storage, read_write> pool: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let p = wid.x;
    if p >= params.num_pairs {
        return;
    }
    let src = pairs[2u * p] * params.block_words;
    let dst = pairs[2u * p + 1u] * params.block_words;
    for (var i = lid; i < params.block_words; i += 64u) {
        pool[dst + i] = pool[src + i];
    }
}
