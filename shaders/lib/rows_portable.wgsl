// rows_portable.wgsl: how the paged kernel sums a key's partial dot products over the
// KEY_LANES lanes of a group, and its other exchanges between the lanes of a group (maxima, one
// lane's rows to all), in core WGSL through workgroup memory; and the kernel's entry point. The
// subgroup variant (rows_subgroup.wgsl) computes the same sums with shuffles; both add in the
// butterfly's order (at step o = KEY_LANES / 2, ..., 1, lane i takes x_i + x_(i xor o)), so their
// bits agree. Uses the kernel's ROW_QUADS, WG, KEY_LANES, MAX_TILE and `attend`.

override LANE_PARTS: u32 = 2u * WG * ROW_QUADS;
// Two halves, used alternately: one barrier per exchange is enough (a half is written again
// only after every invocation passed the next exchange's barrier, so after it read the half:
// shared rows are read before the next exchange).
var<workgroup> lane_parts: array<vec4<f32>, LANE_PARTS>;
var<private> lane_half: u32;

// Writes x (a row per component, four rows a vec4) to the next half of lane_parts and waits
// for the workgroup; returns where the half starts. Must be called in uniform control flow.
fn lanes_publish(x: array<f32, MAX_TILE>) -> u32 {
    let at = lane_half * WG * ROW_QUADS;
    lane_half ^= 1u;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        let t = 4u * r;
        lane_parts[at + local_tid * ROW_QUADS + r] = vec4<f32>(x[t], x[t + 1u], x[t + 2u], x[t + 3u]);
    }
    workgroupBarrier();
    return at;
}

// Each row's partial sums d over the invocation's lane group, the same value in every lane.
// Must be called in uniform control flow (it has a barrier).
fn lanes_sum_rows(d: array<f32, MAX_TILE>) -> array<f32, MAX_TILE> {
    let at = lanes_publish(d);
    let first = local_tid - local_tid % KEY_LANES;
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

// lanes_sum_rows(d0) in the lanes of the group's lower half (below KEY_LANES / 2),
// lanes_sum_rows(d1) in the upper half (rows_subgroup.wgsl exchanges less for the same bits).
// Must be called in uniform control flow (it has barriers).
fn lanes_sum_pair(d0: array<f32, MAX_TILE>, d1: array<f32, MAX_TILE>) -> array<f32, MAX_TILE> {
    let s0 = lanes_sum_rows(d0);
    let s1 = lanes_sum_rows(d1);
    let upper = ((local_tid % KEY_LANES) & (KEY_LANES / 2u)) != 0u;
    var out: array<f32, MAX_TILE>;
    for (var t = 0u; t < TILE; t++) { // @unroll
        out[t] = select(s0[t], s1[t], upper);
    }
    return out;
}

// Each row's max of x over the group's lanes (exact in any order), the same in every lane.
// Must be called in uniform control flow (it has a barrier).
fn lanes_max_rows(x: array<f32, MAX_TILE>) -> array<f32, MAX_TILE> {
    let at = lanes_publish(x);
    let first = local_tid - local_tid % KEY_LANES;
    var out: array<f32, MAX_TILE>;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        var y = lane_parts[at + first * ROW_QUADS + r];
        for (var i = 1u; i < KEY_LANES; i++) {
            y = max(y, lane_parts[at + (first + i) * ROW_QUADS + r]);
        }
        let t = 4u * r;
        out[t] = y.x;
        out[t + 1u] = y.y;
        out[t + 2u] = y.z;
        out[t + 3u] = y.w;
    }
    return out;
}

// Where the rows shared last lie in lane_parts.
var<private> shared_at: u32;

// Offers x to the group's lanes (lanes_shared_rows reads it until the second exchange after
// this one). Must be called in uniform control flow (it has a barrier).
fn lanes_share_rows(x: array<f32, MAX_TILE>) {
    shared_at = lanes_publish(x);
}

// The rows lane k of the group shared last.
fn lanes_shared_rows(k: u32) -> array<f32, MAX_TILE> {
    let at = shared_at + (local_tid - local_tid % KEY_LANES + k) * ROW_QUADS;
    var out: array<f32, MAX_TILE>;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        let y = lane_parts[at + r];
        let t = 4u * r;
        out[t] = y.x;
        out[t + 1u] = y.y;
        out[t + 2u] = y.z;
        out[t + 3u] = y.w;
    }
    return out;
}

var<private> local_tid: u32;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    local_tid = tid;
    attend(wid, tid);
}
