// bandwidth: the copy kernel that measures an adapter's memory bandwidth ceiling (ARCHITECTURE.md
// section 13). Each invocation copies vec4<u32> values i, i + stride, i + 2 stride, ... of `src`
// into `dst`: 16-byte loads and stores, neighbouring invocations on neighbouring values. The
// host times it with several workgroup counts and keeps the best.

struct BandwidthParams {
    // vec4<u32> values to copy.
    n: u32,
    // Invocations in the dispatch (WG * workgroups).
    stride: u32,
    _pad0: u32,
    _pad1: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> params: BandwidthParams;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<u32>>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    for (var i = gid.x; i < params.n; i += params.stride) {
        dst[i] = src[i];
    }
}
