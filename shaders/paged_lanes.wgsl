// paged_lanes: attention over a paged KV cache for CPU-backed adapters (lavapipe, llvmpipe,
// SwiftShader, WARP), where one invocation is one SIMD lane of a CPU core.
//
// Such adapters run a workgroup's invocations in SIMD groups on one CPU thread and execute every
// storage, workgroup and indexed private-array access lane by lane, while arithmetic on private
// values is vectorized across the lanes. So this kernel gives every invocation one whole (work
// item, KV head) of paged.wgsl's plan and keeps everything else in registers: the tile's queries
// are read once, then the invocation streams the item's keys and values itself with an online
// softmax, and writes the same partial (o, lse) per row as paged.wgsl (merged by merge.wgsl).
// There is no workgroup memory and no barrier; the only memory accesses in the key loop are the
// K/V values themselves, each key's block-table entry and its scale words. Neighbouring
// invocations serve neighbouring KV heads of one item, so they read neighbouring rows of the
// same blocks.
//
// The host (src/attention/paged_lanes.rs) writes out the loops over rows and vec4 columns where
// this file says `@unroll`, for one shape per module (rows per tile, columns of the query, RoPE
// and output rows, column packing of the K and V formats), so every query and accumulator is a
// named private value, never an indexed array the adapter would keep in memory. The override
// constants TILE, K_DIM, ROPE_DIM and OUT_DIM a pipeline gets are the shape's.
//
// Results follow paged.wgsl's arithmetic (the same decoders, score transform, row factors and
// `real` rounding of queries, keys, values and probabilities), in another summation order; they
// are batch-invariant for the same reason (an item's keys and their order depend on its sequence
// alone).

override LANE_WG: u32 = 8u;

// The K and V pools of each bound pool buffer, POOL_SLOTS of them (a pool over as many buffers
// as the storage bindings allow is bound whole, so a split's keys may lie in any; else each
// dispatch binds one buffer), written out by the host (shader.rs, pool_bindings): as
// array<u32> (pool_word) and again as array<vec4<u32>> (pool_vec4), for shapes whose rows all
// start on a 16-byte boundary: the code written out for those reads four words per access, so
// an adapter that loads lane by lane does a quarter of the loads (the vec4 views are bound only
// then: other shapes never read them). Pool `which` = 2 slot + (0 for K, 1 for V).
// @pool-bindings

fn kv_word(which: u32, i: u32) -> u32 {
    return pool_word(which, i);
}

// Words 4w .. 4w + 3 of pool row `row` of pool `which`.
fn kv_word4(which: u32, row: u32, w: u32) -> vec4<u32> {
    return pool_vec4(which, kv_row_base(which, row) / 4u + w);
}

// kv_quad_of (a column of four words) is kv_chunk.wgsl's, through the kv_half2 written out
// below.

// @unroll half2: two f16 values of a word, element 2i in the low half (unpack2x16float where the
// adapter has it; exact either way: every f16 is an f32).

@compute @workgroup_size(LANE_WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let pair = gid.x;
    if pair >= params.list_len * params.num_kv_heads {
        return;
    }
    let item = plan[params.list_at + pair / params.num_kv_heads];
    let kv_head = pair % params.num_kv_heads;
    let it = work_item(item);
    let q4 = (K_DIM + ROPE_DIM) / 4u;
    let causal = (params.flags & FLAG_CAUSAL) != 0u;
    let alibi = (params.flags & FLAG_ALIBI) != 0u;
    let bs_shift = firstTrailingBit(params.block_size);
    let bs_mask = params.block_size - 1u;

    // @unroll declare: q_T_C, qr_T_C (RoPE part), a_T_C, m_T, l_T, pos_T, slope_T.
    // @unroll load_queries: for row T (rows past n_rows repeat the last one, never written):
    //   r = row0 + min(T, n_rows - 1); its head, position, ALiBi slope and query columns.

    for (var j = it.key_start; j < it.key_end; j++) {
        let at = plan[it.table + (j >> bs_shift)] - params.first_block;
        var kp = 0u;
        var block = at;
        if POOL_SLOTS > 1u {
            kp = 2u * (at / params.blocks_per_buffer);
            block = at % params.blocks_per_buffer;
        }
        let vp = kp + value_pool();
        let row = (block * params.num_kv_heads + kv_head) * params.block_size + (j & bs_mask);
        // @unroll key_dots: d_T = q_T . k over the K pool row's columns (codes; int4 decodes
        //   each group's scale and min once).
        let k_scale = kv_row_scale(kp, row);
        let v_scale = select(1.0, kv_row_scale(vp, row), kv_row_scaled(vp));
        // @unroll rope_dots: d_T = d_T * k_scale, plus the RoPE part of the key (MLA).
        // @unroll softmax: per row, the score (ARCHITECTURE.md section 2; softmax.wgsl's NaN rules:
        //   a visible key scoring NaN or +inf sets bad_T) and the online softmax update: m_T,
        //   l_T, the factor alpha_T rescaling a_T, the probability p_T (times the V row's scale)
        //   and live_T (p_T is not zero).
        // @unroll values: a_T_C = a_T_C * alpha_T + p_T * v_C, the product only where live_T
        //   (a key of probability 0 never reads its value row into a row).
    }

    let out_base = (item * params.num_kv_heads + kv_head) * TILE;
    let dv4 = OUT_DIM / 4u;
    let v_tensor_scale = value_tensor_scale();
    // @unroll write: rows T < n_rows: o = a_T * (v_tensor_scale / l_T) and lse, or NaN for
    //   both where bad_T.
}
