// Attention over a paged KV cache: decode (one query per sequence) and chunked prefill (a chunk of
// queries after a cached prefix) in one kernel.
//
// Rows. A query row is one (query token, query head) pair of one sequence. The rows of a sequence
// that share a KV head are ordered token-major (row r = token (r / GROUP), head r % GROUP of the
// group) and cut into tiles of TILE rows: for decode a tile is (part of) the GQA group of one
// token, for prefill a few tokens times the group. A tile's queries sit in workgroup memory, so
// each K/V row is read once per tile. Rows never interact: a row's bits do not depend on which
// other rows share its tile. Loops over a tile's rows run to the constant TILE, so that a
// compiler can unroll them and keep per-row values in registers; rows past `n_rows` hold zero
// queries and are computed but never used. The host sizes TILE to the batch (a decode tile is the
// GQA group) without moving any sequence's tile boundaries.
//
// Work items. The host plans, per (sequence, tile), the key range the tile can see, cut at fixed
// token splits (split-K, the same for every batch) and where the sequence's blocks change pool
// buffer. One dispatch per pool buffer binds that buffer's K and V; a workgroup serves one
// (work item, KV head) and writes a partial (o, lse) per row, merged in key order by merge.wgsl
// (which also adds the sinks).
//
// Scores follow ARCHITECTURE.md section 2: scale, softcap, ALiBi, mask (bottom-right causal,
// window). NaN and infinities follow softmax.wgsl: a visible key whose score is NaN or +inf marks
// its row (row_bad), whose output and lse are then written as NaN; a key whose probability is 0
// (masked, or a score of -inf) is never read into the output, whatever its value row holds.
//
// MLA (absorbed, DeepSeek-V2) is the same computation over a latent cache: with ROPE_DIM > 0 a
// key is [K pool row ; V pool row] (the latent c_kv, K_DIM values in any format, then the rotated
// RoPE key k_pe, ROPE_DIM values) and the value is the K pool row again, so OUT_DIM = K_DIM and
// the queries are [q_lat ; q_pe]. One latent row serves every head of a tile: MQA with head dims
// K_DIM + ROPE_DIM and K_DIM.
//
// Quantized K/V (FP8, int8) are read as codes (kv_load4_codes) and their scales are applied once
// per key rather than per value: a K row's scale multiplies its dot products, a V row's scale its
// probabilities (after the running sums have read them), and a per-tensor V scale the output
// once. Int4 (a scale per group of 32) is
// decoded in full.

override WG: u32 = 64u;
const MAX_TILE: u32 = 16u;
const MAX_ACC: u32 = 8u;
// Output accumulators: OUT_DIM / 4 columns (vec4) over the workgroup. With at most WG columns,
// LANES invocations share a column and each holds ACC_ROWS rows of it; with more, each
// invocation holds ACC_COLS columns of every row.
override ACC_COLS: u32 = (OUT_DIM / 4u + WG - 1u) / WG;
override LANES: u32 = max(1u, WG / (OUT_DIM / 4u));
override ACC_ROWS: u32 = (TILE + LANES - 1u) / LANES;
var<workgroup> q_tile: array<real4, TILE * (K_DIM + ROPE_DIM) / 4u>;
var<workgroup> scores: array<f32, TILE * WG>;
var<workgroup> row_max: array<f32, MAX_TILE>;
var<workgroup> row_sum: array<f32, MAX_TILE>;
var<workgroup> row_alpha: array<f32, MAX_TILE>;
// Nonzero once a visible key's score poisoned the row (NaN or +inf).
var<workgroup> row_bad: array<atomic<u32>, MAX_TILE>;
// Position p_i of each row's query, and its ALiBi slope.
var<workgroup> row_pos: array<u32, MAX_TILE>;
var<workgroup> row_slope: array<f32, MAX_TILE>;
// Per-row scale of each key of the chunk's V rows (1 unless V has per-row scales).
var<workgroup> v_row_scale: array<f32, WG>;
// Pool row of each key of the chunk (found once, by the invocation scoring that key).
var<workgroup> key_row: array<u32, WG>;

// Column of accumulator set m of invocation tid.
fn acc_col(tid: u32, m: u32) -> u32 {
    if ACC_COLS == 1u {
        return tid % (OUT_DIM / 4u);
    }
    return tid + m * WG;
}

// Which of a column's LANES an invocation is.
fn acc_lane(tid: u32) -> u32 {
    if ACC_COLS == 1u {
        return tid / (OUT_DIM / 4u);
    }
    return 0u;
}

// The kernel body; the entry point `main` and the row reductions `rows_update_max` /
// `rows_update_sum` come from rows_portable.wgsl or rows_subgroup.wgsl.
fn attend(wid: vec3<u32>, tid: u32) {
    let item = plan[params.list_at + wid.x];
    let kv_head = wid.y;
    let it = work_item(item);
    let d4 = K_DIM / 4u;
    let q4 = (K_DIM + ROPE_DIM) / 4u;
    let dv4 = OUT_DIM / 4u;
    let vp = value_pool();
    let causal = (params.flags & FLAG_CAUSAL) != 0u;
    let bs_shift = firstTrailingBit(params.block_size);
    let bs_mask = params.block_size - 1u;
    let alibi = (params.flags & FLAG_ALIBI) != 0u;

    if tid < MAX_TILE {
        row_max[tid] = MASKED;
        row_sum[tid] = 0.0;
        atomicStore(&row_bad[tid], 0u);
        if tid < it.n_rows {
            let r = it.row0 + tid;
            let h = kv_head * GROUP + r % GROUP;
            row_pos[tid] = r / GROUP + it.len_k - it.len_q;
            row_slope[tid] = select(0.0, bitcast<f32>(plan[params.slopes_at + h]), alibi);
        }
    }
    for (var i = tid; i < TILE * q4; i += WG) {
        let t = i / q4;
        var v = vec4<f32>(0.0);
        if t < it.n_rows {
            let r = it.row0 + t;
            let h = kv_head * GROUP + r % GROUP;
            v = q[((it.q_base + r / GROUP) * params.num_q_heads + h) * q4 + i % q4];
        }
        q_tile[i] = real4(v);
    }
    var acc: array<vec4<f32>, MAX_ACC>;
    workgroupBarrier();

    for (var c0 = it.key_start; c0 < it.key_end; c0 += WG) {
        // 1. One key per invocation, scored against every row of the tile.
        let j = c0 + tid;
        if j < it.key_end {
            var dots: array<f32, MAX_TILE>;
            // Block sizes are powers of two: shifts and masks, not divisions.
            let block = plan[it.table + (j >> bs_shift)] - params.first_block;
            let row = (block * params.num_kv_heads + kv_head) * params.block_size + (j & bs_mask);
            key_row[tid] = row;
            if K_DTYPE == KV_INT4 {
                // Each group's scale and min decoded once.
                for (var g = 0u; g < d4 / 8u; g++) {
                    let sm = kv_int4_group(0u, row, g);
                    for (var c = g * 8u; c < g * 8u + 8u; c++) {
                        let k = vec4<f32>(real4(kv_int4_load4(0u, row, c, sm)));
                        for (var t = 0u; t < TILE; t++) {
                            dots[t] += dot(vec4<f32>(q_tile[t * q4 + c]), k);
                        }
                    }
                }
            } else {
                for (var c = 0u; c < d4; c++) {
                    let k = vec4<f32>(real4(kv_load4_codes(0u, row, c)));
                    for (var t = 0u; t < TILE; t++) {
                        dots[t] += dot(vec4<f32>(q_tile[t * q4 + c]), k);
                    }
                }
            }
            let k_scale = kv_row_scale(0u, row);
            if kv_row_scaled(vp) {
                v_row_scale[tid] = kv_row_scale(vp, row);
            }
            for (var t = 0u; t < TILE; t++) {
                dots[t] *= k_scale;
            }
            // MLA: the RoPE part of the key, decoded in full (16-bit or f32, no row scale).
            for (var c = 0u; c < ROPE_DIM / 4u; c++) {
                let k = vec4<f32>(real4(kv_load4(1u, row, c)));
                for (var t = 0u; t < TILE; t++) {
                    dots[t] += dot(vec4<f32>(q_tile[t * q4 + d4 + c]), k);
                }
            }
            for (var t = 0u; t < TILE; t++) {
                let p = row_pos[t];
                var visible = true;
                if causal {
                    // p - j < window, never j + window > p: no sum of positions can wrap.
                    visible = j <= p && (params.window == 0u || p - j < params.window);
                }
                let dist = select(j - p, p - j, p >= j);
                let sc = score_of(dots[t], params.scale, params.softcap, row_slope[t] * f32(dist));
                if visible && sc.poison {
                    atomicOr(&row_bad[t], 1u);
                }
                scores[t * WG + tid] = select(MASKED, sc.value, visible);
            }
        } else {
            for (var t = 0u; t < TILE; t++) {
                scores[t * WG + tid] = MASKED;
            }
            v_row_scale[tid] = 1.0;
        }
        workgroupBarrier();

        // 2. New running max per row and the factor rescaling what came before.
        rows_update_max(tid, it.n_rows);
        workgroupBarrier();

        // 3. Probabilities, held in `real` precision.
        for (var t = 0u; t < TILE; t++) {
            if t >= it.n_rows {
                break;
            }
            let i = t * WG + tid;
            scores[i] = f32(real(softmax_weight(scores[i], row_max[t])));
        }
        workgroupBarrier();

        // 4. Running sums, and the tile's outputs (neighbouring invocations read neighbouring
        // values of a V row).
        rows_update_sum(tid, it.n_rows);
        if kv_row_scaled(vp) {
            // Fold each V row's scale into its probabilities once (the sums above are done).
            workgroupBarrier();
            // A zero probability stays zero (a masked key's scale may be NaN).
            for (var t = 0u; t < TILE; t++) {
                let i = t * WG + tid;
                if bits_nonzero(scores[i]) {
                    scores[i] *= v_row_scale[tid];
                }
            }
            workgroupBarrier();
        }
        // Each invocation owns ACC_COLS columns of the V rows and, for each, the rows
        // lane, lane + LANES, ...: a V value is loaded and decoded once per invocation and used
        // for all of its rows.
        let n = min(WG, it.key_end - c0);
        for (var m = 0u; m < ACC_COLS; m++) {
            let c = acc_col(tid, m);
            if c >= dv4 || acc_lane(tid) >= LANES {
                break;
            }
            for (var k = 0u; k < ACC_ROWS; k++) {
                let t = acc_lane(tid) + k * LANES;
                if t < it.n_rows {
                    acc[m * ACC_ROWS + k] *= row_alpha[t];
                }
            }
            for (var i = 0u; i < n; i++) {
                let row = key_row[i];
                let v = vec4<f32>(real4(kv_load4_codes(vp, row, c)));
                for (var k = 0u; k < ACC_ROWS; k++) {
                    let t = acc_lane(tid) + k * LANES;
                    if t < it.n_rows {
                        // Keys of probability 0 are skipped: 0 * inf or 0 * NaN must not reach
                        // a row.
                        let p = scores[t * WG + i];
                        if bits_nonzero(p) {
                            acc[m * ACC_ROWS + k] += p * v;
                        }
                    }
                }
            }
        }
        workgroupBarrier();
    }

    // Partial state of each row: normalized output and log-sum-exp (-inf when the row saw no
    // key of this item; NaN for both when a visible key poisoned it).
    let out_base = (item * params.num_kv_heads + kv_head) * TILE;
    for (var m = 0u; m < ACC_COLS; m++) {
        let c = acc_col(tid, m);
        if c >= dv4 || acc_lane(tid) >= LANES {
            break;
        }
        for (var k = 0u; k < ACC_ROWS; k++) {
            let t = acc_lane(tid) + k * LANES;
            if t < it.n_rows {
                let l = row_sum[t];
                // A per-tensor V scale (1 otherwise) applied once, with the normalization.
                let v_scale = value_tensor_scale();
                let bad = atomicLoad(&row_bad[t]) != 0u;
                let nan = bitcast<f32>(NAN_BITS);
                let o = acc[m * ACC_ROWS + k] * (select(0.0, 1.0 / l, l > 0.0) * v_scale);
                o_part[(out_base + t) * dv4 + c] = select(o, vec4<f32>(nan), bad);
                if c == 0u {
                    lse_part[out_base + t] = select(softmax_lse(row_max[t], l), nan, bad);
                }
            }
        }
    }
}
