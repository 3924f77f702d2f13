// rows_subgroup.wgsl: the paged kernel's sums of a key's partial dot products over the
// KEY_LANES lanes of a group with subgroup shuffles (needs SUBGROUP), its other exchanges
// between the lanes of a group (maxima, one lane's rows to all), and the entry point. The
// same butterfly as rows_portable.wgsl (at step o = KEY_LANES / 2, ..., 1, lane i takes
// x_i + x_(i xor o)), so the bits agree; no barrier, and no subgroupAdd (whose order is the
// implementation's).
//
// The host takes this path only where a subgroup holds whole lane groups packed in
// invocation order (subgroups of at least KEY_LANES invocations, invocation i at lane
// i % subgroup size; never on DX12, which does not promise that packing). The entry point
// checks the packing anyway: an invocation that finds otherwise poisons its rows (NaN), rather
// than giving a wrong answer silently.

var<private> lanes_packed: bool;
// Nonzero once an invocation of the workgroup found the packing broken.
var<workgroup> lanes_unpacked: atomic<u32>;

fn lanes_sum_rows(d: array<f32, MAX_TILE>) -> array<f32, MAX_TILE> {
    var out: array<f32, MAX_TILE>;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        let t = 4u * r;
        let x = lanes_steps(vec4<f32>(d[t], d[t + 1u], d[t + 2u], d[t + 3u]), KEY_LANES / 2u);
        out[t] = x.x;
        out[t + 1u] = x.y;
        out[t + 2u] = x.z;
        out[t + 3u] = x.w;
    }
    return lanes_checked(out);
}

// The butterfly's steps o = o0, o0 / 2, ..., 1 on x0: lane i takes x_i + x_(i xor o).
fn lanes_steps(x0: vec4<f32>, o0: u32) -> vec4<f32> {
    var x = x0;
    for (var o = o0; o > 0u; o /= 2u) {
        x = x + subgroupShuffleXor(x, o);
    }
    return x;
}

// Sums as they are where the lanes are packed as the host assumed, NaN where not.
fn lanes_checked(sums: array<f32, MAX_TILE>) -> array<f32, MAX_TILE> {
    var out = sums;
    if !lanes_packed {
        let nan = nan_f32();
        for (var t = 0u; t < MAX_TILE; t++) {
            out[t] = nan;
        }
    }
    return out;
}

// The sums over the group's lanes of two keys' partial dot products, d0 of key a and d1 of key
// a + KEY_LANES / 2: lanes_sum_rows(d0) in the lanes of the group's lower half, lanes_sum_rows(d1)
// in the upper half, bit for bit. The first butterfly step pairs lane i with i + KEY_LANES / 2,
// one in each half: each sends the other the key it does not keep (one exchange where two sums
// took two), then the halves run the other steps on the key they keep.
fn lanes_sum_pair(d0: array<f32, MAX_TILE>, d1: array<f32, MAX_TILE>) -> array<f32, MAX_TILE> {
    let gap = KEY_LANES / 2u;
    let upper = (group_lane & gap) != 0u;
    var out: array<f32, MAX_TILE>;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        let t = 4u * r;
        let a = vec4<f32>(d0[t], d0[t + 1u], d0[t + 2u], d0[t + 3u]);
        let b = vec4<f32>(d1[t], d1[t + 1u], d1[t + 2u], d1[t + 3u]);
        let first = select(a, b, upper) + subgroupShuffleXor(select(b, a, upper), gap);
        let x = lanes_steps(first, gap / 2u);
        out[t] = x.x;
        out[t + 1u] = x.y;
        out[t + 2u] = x.z;
        out[t + 3u] = x.w;
    }
    return lanes_checked(out);
}

// Each row's max of x over the group's lanes (exact in any order), the same in every lane.
fn lanes_max_rows(x: array<f32, MAX_TILE>) -> array<f32, MAX_TILE> {
    var out: array<f32, MAX_TILE>;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        let t = 4u * r;
        var y = vec4<f32>(x[t], x[t + 1u], x[t + 2u], x[t + 3u]);
        for (var o = KEY_LANES / 2u; o > 0u; o /= 2u) {
            y = max(y, subgroupShuffleXor(y, o));
        }
        out[t] = y.x;
        out[t + 1u] = y.y;
        out[t + 2u] = y.z;
        out[t + 3u] = y.w;
    }
    return out;
}

// The rows this lane shares (lanes_share_rows), the subgroup lane of its group's first lane
// and its own lane in the group.
var<private> shared_rows: array<f32, MAX_TILE>;
var<private> group_lane0: u32;
var<private> group_lane: u32;

// Offers x to the group's lanes (lanes_shared_rows reads it).
fn lanes_share_rows(x: array<f32, MAX_TILE>) {
    shared_rows = x;
}

// The rows lane k of the group shared last.
fn lanes_shared_rows(k: u32) -> array<f32, MAX_TILE> {
    var out: array<f32, MAX_TILE>;
    for (var r = 0u; r < ROW_QUADS; r++) { // @unroll
        let t = 4u * r;
        let x = vec4<f32>(shared_rows[t], shared_rows[t + 1u], shared_rows[t + 2u],
            shared_rows[t + 3u]);
        let y = subgroupShuffle(x, group_lane0 + k);
        out[t] = y.x;
        out[t + 1u] = y.y;
        out[t + 2u] = y.z;
        out[t + 3u] = y.w;
    }
    return out;
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) size: u32,
) {
    if tid == 0u {
        atomicStore(&lanes_unpacked, 0u);
    }
    workgroupBarrier();
    if size < KEY_LANES || lane != tid % size {
        atomicOr(&lanes_unpacked, 1u);
    }
    workgroupBarrier();
    lanes_packed = atomicLoad(&lanes_unpacked) == 0u;
    group_lane = lane % KEY_LANES;
    group_lane0 = lane - group_lane;
    attend(wid, tid);
}
