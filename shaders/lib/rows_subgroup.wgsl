// rows_subgroup.wgsl: the paged kernel's sums of a key's partial dot products over the
// KEY_LANES lanes of a group with subgroup shuffles (needs SUBGROUP), and the entry point. The
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
        var x = vec4<f32>(d[t], d[t + 1u], d[t + 2u], d[t + 3u]);
        for (var o = KEY_LANES / 2u; o > 0u; o /= 2u) {
            x = x + subgroupShuffleXor(x, o);
        }
        out[t] = x.x;
        out[t + 1u] = x.y;
        out[t + 2u] = x.z;
        out[t + 3u] = x.w;
    }
    if !lanes_packed {
        let nan = bitcast<f32>(NAN_BITS);
        for (var t = 0u; t < MAX_TILE; t++) {
            out[t] = nan;
        }
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
    attend(wid, tid);
}
