// merge_states: combine two attention states over disjoint key sets, row by row:
// (o, lse) = merge((o_a, lse_a), (o_b, lse_b)). Cascade attention merges a shared-prefix pass
// with a per-sequence pass this way. A state with lse = -inf (no key) contributes nothing; a
// state with lse = NaN (a poisoned row, softmax.wgsl) makes the merged row NaN.
// Rows are (query token, head) pairs: o [rows, V_DIM] f32, lse [rows] f32.

struct MergeStatesParams {
    rows: u32,
    // Invocations along x of the dispatch grid.
    stride_x: u32,
    _pad0: u32,
    _pad1: u32,
}

override V_DIM: u32 = 128u;

@group(0) @binding(0) var<uniform> params: MergeStatesParams;
@group(0) @binding(1) var<storage, read> o_a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> lse_a: array<f32>;
@group(0) @binding(3) var<storage, read> o_b: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> lse_b: array<f32>;
@group(0) @binding(5) var<storage, read_write> o_out: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> lse_out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let dv4 = V_DIM / 4u;
    let i = gid.y * params.stride_x + gid.x;
    if i >= params.rows * dv4 {
        return;
    }
    let r = i / dv4;
    let bad = bits_nan(lse_a[r]) || bits_nan(lse_b[r]);
    let la = state_lse(lse_a[r]);
    let lb = state_lse(lse_b[r]);
    let m = max(MASKED, max(la, lb));
    let wa = softmax_weight(la, m);
    let wb = softmax_weight(lb, m);
    let l = wa + wb;
    // A state of weight 0 is not read (its o may be anything, NaN included).
    var o = vec4<f32>(0.0);
    if bits_nonzero(wa) {
        o += wa * o_a[i];
    }
    if bits_nonzero(wb) {
        o += wb * o_b[i];
    }
    let nan = nan_f32();
    o_out[i] = select(o * softmax_inv_sum(l), vec4<f32>(nan), bad);
    if i % dv4 == 0u {
        lse_out[r] = select(softmax_lse(m, l), nan, bad);
    }
}
