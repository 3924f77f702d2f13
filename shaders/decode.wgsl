// Decode attention: one query token per sequence over a contiguous KV cache.
//
// Layouts (row-major): q [num_seqs, Hq, K_DIM] f32; K pool [total_k, Hkv, K_DIM] and V pool
// [total_k, Hkv, V_DIM] in the storage format K_DTYPE / V_DTYPE (see kv_load.wgsl);
// out [num_seqs, Hq, V_DIM] f32; lse [num_seqs, Hq] f32.
//
// One workgroup serves (kv head, tile of TILE query heads of its group) x sequence, so each K/V
// row is read once per tile. The keys are walked in chunks of WG: each invocation scores one
// key against the whole tile, the tile's running max and sum are updated, then each invocation
// accumulates its share of the tile's [TILE, V_DIM] output (neighbouring invocations read
// neighbouring values of a V row).

struct DecodeParams {
    num_seqs: u32,
    num_q_heads: u32,
    num_kv_heads: u32,
    // Tiles of query heads per KV head: ceil(GROUP / TILE).
    q_tiles: u32,
    scale: f32,
    // 0 = no softcap.
    softcap: f32,
    // 0 = no sliding window.
    window: u32,
    // bit 0: sinks present, bit 1: ALiBi slopes present.
    flags: u32,
}

override WG: u32 = 64u;
// Query heads per KV head.
override GROUP: u32 = 1u;
// Query heads per workgroup (<= MAX_TILE, TILE * V_DIM <= MAX_ACC * 4 * WG).
override TILE: u32 = 1u;

const MAX_TILE: u32 = 16u;
const MAX_ACC: u32 = 8u;
const FLAG_SINKS: u32 = 1u;
const FLAG_ALIBI: u32 = 2u;

@group(0) @binding(0) var<uniform> params: DecodeParams;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> k_pool: array<u32>;
@group(0) @binding(3) var<storage, read> v_pool: array<u32>;
// cu_seqlens_k [num_seqs + 1], then as f32 bits: sinks [Hq], ALiBi slopes [Hq].
@group(0) @binding(4) var<storage, read> seq_meta: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> lse: array<f32>;

var<workgroup> q_tile: array<real4, TILE * K_DIM / 4u>;
var<workgroup> scores: array<f32, TILE * WG>;
var<workgroup> row_max: array<f32, MAX_TILE>;
var<workgroup> row_sum: array<f32, MAX_TILE>;
var<workgroup> row_alpha: array<f32, MAX_TILE>;

fn kv_word(which: u32, i: u32) -> u32 {
    if which == 0u {
        return k_pool[i];
    }
    return v_pool[i];
}

// This kernel takes unscaled formats only (f32, f16, bf16); the host refuses the others.
fn kv_scale_word(which: u32, i: u32) -> u32 {
    return 0u;
}

fn head_const(which: u32, h: u32) -> f32 {
    return bitcast<f32>(seq_meta[params.num_seqs + 1u + which * params.num_q_heads + h]);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let seq = wid.y;
    let kv_head = wid.x / params.q_tiles;
    let tile = wid.x % params.q_tiles;
    let head0 = kv_head * GROUP + tile * TILE;
    let n_heads = min(TILE, GROUP - tile * TILE);
    let k_start = seq_meta[seq];
    let len_k = seq_meta[seq + 1u] - k_start;
    let d4 = K_DIM / 4u;
    let dv4 = V_DIM / 4u;
    let pos = len_k - 1u;
    let alibi_on = (params.flags & FLAG_ALIBI) != 0u;

    for (var i = tid; i < TILE * d4; i += WG) {
        let t = i / d4;
        var v = vec4<f32>(0.0);
        if t < n_heads {
            v = q[(seq * params.num_q_heads + head0 + t) * d4 + i % d4];
        }
        q_tile[i] = real4(v);
    }
    if tid < MAX_TILE {
        row_max[tid] = MASKED;
        row_sum[tid] = 0.0;
    }
    var acc: array<vec4<f32>, MAX_ACC>;
    var first = 0u;
    if params.window > 0u && len_k > params.window {
        first = len_k - params.window;
    }
    workgroupBarrier();

    for (var c0 = first; c0 < len_k; c0 += WG) {
        // 1. One key per invocation, scored against every head of the tile.
        let j = c0 + tid;
        if j < len_k {
            var dots: array<f32, MAX_TILE>;
            let row = (k_start + j) * params.num_kv_heads + kv_head;
            for (var c = 0u; c < d4; c++) {
                let k = vec4<f32>(real4(kv_load4(0u, row, c)));
                for (var t = 0u; t < TILE; t++) {
                    dots[t] += dot(vec4<f32>(q_tile[t * d4 + c]), k);
                }
            }
            for (var t = 0u; t < TILE; t++) {
                var bias = 0.0;
                if alibi_on {
                    bias = head_const(1u, head0 + t) * f32(pos - j);
                }
                scores[t * WG + tid] = score_transform(dots[t], params.scale, params.softcap, bias);
            }
        } else {
            for (var t = 0u; t < TILE; t++) {
                scores[t * WG + tid] = MASKED;
            }
        }
        workgroupBarrier();

        // 2. New running max per head and the factor rescaling what came before.
        if tid < TILE {
            var m = row_max[tid];
            for (var i = 0u; i < WG; i++) {
                m = max(m, scores[tid * WG + i]);
            }
            row_alpha[tid] = exp(row_max[tid] - m);
            row_max[tid] = m;
        }
        workgroupBarrier();

        // 3. Probabilities, held in `real` precision.
        for (var t = 0u; t < TILE; t++) {
            let i = t * WG + tid;
            scores[i] = f32(real(softmax_weight(scores[i], row_max[t])));
        }
        workgroupBarrier();

        // 4. Running sums, and the tile's outputs.
        if tid < TILE {
            var l = 0.0;
            for (var i = 0u; i < WG; i++) {
                l += scores[tid * WG + i];
            }
            row_sum[tid] = row_sum[tid] * row_alpha[tid] + l;
        }
        let n = min(WG, len_k - c0);
        for (var r = 0u; r < MAX_ACC; r++) {
            let e = tid + r * WG;
            if e >= TILE * dv4 {
                break;
            }
            let t = e / dv4;
            let c = e % dv4;
            var a = acc[r] * row_alpha[t];
            for (var i = 0u; i < n; i++) {
                let v = vec4<f32>(real4(kv_load4(1u, (k_start + c0 + i) * params.num_kv_heads + kv_head, c)));
                a += scores[t * WG + i] * v;
            }
            acc[r] = a;
        }
        workgroupBarrier();
    }

    // Normalize and write the heads of this tile.
    let sinks_on = (params.flags & FLAG_SINKS) != 0u;
    for (var r = 0u; r < MAX_ACC; r++) {
        let e = tid + r * WG;
        if e >= n_heads * dv4 {
            break;
        }
        let t = e / dv4;
        let c = e % dv4;
        let h = head0 + t;
        var m = row_max[t];
        var l = row_sum[t];
        var o = acc[r];
        if sinks_on {
            let folded = softmax_add_sink(m, l, head_const(0u, h));
            m = folded.x;
            l = folded.y;
            o *= folded.z;
        }
        let inv = select(0.0, 1.0 / l, l > 0.0);
        out[(seq * params.num_q_heads + h) * dv4 + c] = o * inv;
        if c == 0u {
            lse[seq * params.num_q_heads + h] = softmax_lse(m, l);
        }
    }
}
