// merge: combine the partial states (o, lse) of a row's work items, in key order, into its
// output; sinks join the denominator here, once. A partial whose lse is NaN (a poisoned row,
// softmax.wgsl) makes the row's output and lse NaN. Also serves cascade attention (a shared-prefix
// pass merged with per-sequence passes).
//
// A workgroup serves one (tile, KV head): tiles[tile] = (first query token, first row, rows,
// first item, items); the items of a tile are consecutive.

struct MergeParams {
    num_q_heads: u32,
    num_kv_heads: u32,
    // bit 0: sinks present.
    flags: u32,
    // Word offsets into `plan`.
    tiles_at: u32,
    sinks_at: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 64u;
override GROUP: u32 = 1u;
override TILE: u32 = 1u;
override V_DIM: u32 = 128u;

const TILE_WORDS: u32 = 5u;

@group(0) @binding(0) var<uniform> params: MergeParams;
@group(0) @binding(1) var<storage, read> plan: array<u32>;
@group(0) @binding(2) var<storage, read> o_part: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> lse_part: array<f32>;
// [total_q, Hq, V_DIM / 4] and [total_q, Hq]
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let tb = params.tiles_at + wid.x * TILE_WORDS;
    let q_base = plan[tb];
    let row0 = plan[tb + 1u];
    let n_rows = plan[tb + 2u];
    let first = plan[tb + 3u];
    let count = plan[tb + 4u];
    let kv_head = wid.y;
    let dv4 = V_DIM / 4u;
    for (var e = tid; e < n_rows * dv4; e += WG) {
        let t = e / dv4;
        let c = e % dv4;
        let r = row0 + t;
        let h = kv_head * GROUP + r % GROUP;
        // A partial with lse NaN poisoned the row; one with lse -inf saw no key and
        // contributes nothing (bit tests: softmax.wgsl).
        var m = MASKED;
        var bad = false;
        for (var i = 0u; i < count; i++) {
            let x = lse_part[((first + i) * params.num_kv_heads + kv_head) * TILE + t];
            bad = bad || bits_nan(x);
            m = max(m, state_lse(x));
        }
        var l = 0.0;
        var o = vec4<f32>(0.0);
        for (var i = 0u; i < count; i++) {
            let p = ((first + i) * params.num_kv_heads + kv_head) * TILE + t;
            let x = lse_part[p];
            let w = softmax_weight(state_lse(x), m);
            if bits_nonzero(w) {
                l += w;
                o += w * o_part[p * dv4 + c];
            }
        }
        if (params.flags & 1u) != 0u {
            let folded = softmax_add_sink(m, l, bitcast<f32>(plan[params.sinks_at + h]));
            m = folded.x;
            l = folded.y;
            o *= folded.z;
        }
        let dst = (q_base + r / GROUP) * params.num_q_heads + h;
        let nan = nan_f32();
        out[dst * dv4 + c] = select(o * softmax_inv_sum(l), vec4<f32>(nan), bad);
        if c == 0u {
            lse[dst] = select(softmax_lse(m, l), nan, bad);
        }
    }
}
