// rows_portable.wgsl: how the paged kernel sums a key's partial dot products over the
// KEY_LANES lanes of a group, in core WGSL, and the kernel's entry point. The subgroup variant
// (rows_subgroup.wgsl) computes the same sums with shuffles; both add in the butterfly's order
// (at step o = KEY_LANES / 2, ..., 1, lane i takes x_i + x_(i xor o)), so their bits agree.
// Uses the kernel's ROW_QUADS, WG, KEY_LANES, MAX_TILE and `attend`.

override LANE_PARTS: u32 = 2u * WG * ROW_QUADS;
// Two halves, used alternately: one barrier per call is enough (a half is written again only
// after every invocation passed the next call's barrier, so after it read the half).
var<workgroup> lane_parts: array<vec4<f32>, LANE_PARTS>;
var<private> lane_half: u32;

// Each row's partial sums d over the invocation's lane group, the same value in every lane.
// Must be called in uniform control flow (it has a barrier).
fn lanes_sum_rows(d: array<f32, MAX_TILE>) -> array<f32, MAX_TILE> {
    let at = lane_half * WG * ROW_QUADS;
    lane_half ^= 1u;
    let tid = local_tid;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        let t = 4u * r;
        lane_parts[at + tid * ROW_QUADS + r] = vec4<f32>(d[t], d[t + 1u], d[t + 2u], d[t + 3u]);
    }
    workgroupBarrier();
    let first = tid - tid % KEY_LANES;
    var out: array<f32, MAX_TILE>;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        var x: array<vec4<f32>, 32>;
        for (var i = 0u; i < KEY_LANES; i++) {
            x[i] = lane_parts[at + (first + i) * ROW_QUADS + r];
        }
        for (var o = KEY_LANES / 2u; o > 0u; o /= 2u) {
            for (var i = 0u; i < o; i++) {
                x[i] = x[i] + x[i + o];
            }
        }
        let t = 4u * r;
        out[t] = x[0].x;
        out[t + 1u] = x[0].y;
        out[t + 2u] = x[0].z;
        out[t + 3u] = x[0].w;
    }
    return out;
}

var<private> local_tid: u32;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    local_tid = tid;
    attend(wid, tid);
}
