// Attention over a paged KV cache for GPUs: decode (one query per sequence) and chunked prefill
// (a chunk of queries after a cached prefix) in one kernel.
//
// Rows. A query row is one (query token, query head) pair of one sequence. The rows of a sequence
// that share a KV head are ordered token-major (row r = token (r / GROUP), head r % GROUP of the
// group) and cut into tiles of TILE rows: for decode a tile is (part of) the GQA group of one
// token, for prefill a few tokens times the group. Every K/V row is read once per tile. Rows
// never interact: a row's bits do not depend on which other rows share its tile, or on TILE.
// Rows past `n_rows` repeat the last row and are computed but never written.
//
// Work items. The host plans, per (sequence, tile), the key range the tile can see, cut at fixed
// token splits (split-K, the same for every batch). A pool over as many buffers as the device
// can bind at once is bound whole (one slot per buffer, see the pools below); over more, each
// dispatch binds one buffer and items are also cut where a sequence's blocks change buffer. A
// workgroup serves one (work item, KV head)
// and writes a partial (o, lse) per row, merged in key order by merge.wgsl (which also adds the
// sinks).
//
// Lane groups. The workgroup's WG invocations are NG = WG / KEY_LANES groups of KEY_LANES lanes.
// A group reads one key row at a time: lane l loads the row's 16-byte chunks l, l + KEY_LANES,
// ..., so neighbouring lanes read neighbouring bytes, and each lane holds the query columns of
// its chunks (every row of the tile) in registers. A key's partial dot products are summed over
// the group's lanes by a fixed butterfly (lanes_sum_rows: subgroup shuffles in
// rows_subgroup.wgsl, the same tree through workgroup memory in rows_portable.wgsl, bit for bit
// the same sums). Each group runs its own online softmax over its keys, the keys j with
// j % NG == its index (absolute token positions, so the partition of a row's keys is the same
// in every tile and batch that holds the row), KEY_STEP keys a step, each scored by the lane
// that owns it (see the key loop), and reads each V row once, each lane its chunks of it. The
// groups combine once at the end, in group order. The subgroup path has no barrier in the key
// loop; the portable one has KEY_STEP + 2 per step.
//
// Scores follow ARCHITECTURE.md section 2: scale, softcap, ALiBi, mask (bottom-right causal,
// window). NaN and infinities follow softmax.wgsl: a visible key whose score is NaN or +inf marks
// its row (bad), whose output and lse are then written as NaN; a key whose probability is 0
// (masked, or a score of -inf) is never read into the output, whatever its value row holds.
//
// MLA (absorbed, DeepSeek-V2) is the same computation over a latent cache: with ROPE_DIM > 0 a
// key is [K pool row ; V pool row] (the latent c_kv, K_DIM values in any format, then the rotated
// RoPE key k_pe, ROPE_DIM values) and the value is the K pool row again, so OUT_DIM = K_DIM and
// the queries are [q_lat ; q_pe]. One latent row serves every head of a tile: MQA with head dims
// K_DIM + ROPE_DIM and K_DIM.
//
// Quantized K/V (FP8, int8) are read as codes and their scales are applied once per key rather
// than per value: a K row's scale multiplies each lane's partial dot products, a V row's scale
// the probabilities (after the running sums have read them), and a per-tensor V scale the output
// once. Int4 decodes each chunk (one scale group) with its group's scale and min.
//
// Loops marked `@unroll` run to a shape constant (TILE, chunks and columns per lane); the host
// writes them out (ShaderVariant::unroll), so that every per-row value sits in a register at a
// constant index rather than in an indexed array, which some compilers (CPU adapters among
// them) keep in memory.
//
// Arithmetic is written with explicit fma where a product meets a sum, so that every pipeline
// of this kernel (whatever its TILE) does the same operations.

override WG: u32 = 64u;
// Lanes sharing one key row: a power of two, at most 32, dividing WG.
override KEY_LANES: u32 = 8u;
// Key groups of the workgroup.
override NG: u32 = WG / KEY_LANES;
// Keys a group takes per step: KEY_LANES (lane k owns key k), or 1 for MLA (every lane owns it).
override KEY_STEP: u32 = KEY_LANES;
// Rows are read as vec4<u32> (every row of both pools starts on a 16-byte boundary).
override WIDE: bool = false;
// 16-byte chunks of a K pool row, of a value row (V, or the latent for MLA) and of an MLA RoPE
// key (V pool; 0 otherwise), and vec4 columns per chunk of each (kv_chunk.wgsl).
override K_CH: u32 = 16u;
override V_CH: u32 = 16u;
override R_CH: u32 = 0u;
override QK: u32 = 2u;
override QV: u32 = 2u;
override QR: u32 = 2u;
// Four-row vec4 slots of a tile (the lane-group sums add four rows at a time).
override ROW_QUADS: u32 = (TILE + 3u) / 4u;
// Chunks per lane of each.
override CHK: u32 = (K_CH + KEY_LANES - 1u) / KEY_LANES;
override CHV: u32 = (V_CH + KEY_LANES - 1u) / KEY_LANES;
override CHR: u32 = (R_CH + KEY_LANES - 1u) / KEY_LANES;
const MAX_TILE: u32 = 16u;
// Query and accumulator vec4s of one invocation at most (the host sizes TILE to fit:
// TILE * (CHK QK + CHR QR) <= MAX_QREG and TILE * CHV QV <= MAX_AREG).
const MAX_QREG: u32 = 32u;
const MAX_AREG: u32 = 32u;
// Chunks of a K row per lane at most (CHK QK <= MAX_QREG).
const MAX_CHK: u32 = 32u;
// Keys whose rows a lane loads together before using them (the paired key loops): two loads in
// flight where there was one, for a few more registers. The same values meet the same arithmetic
// in the same order, so the bits are those of one key at a time. On an H200 (Vulkan) pairs made
// f16 decode at tiles of 1 and 4 rows 10 to 18% faster, left int8 and FP8 as they were, and
// made int4 (+43%) and tiles of 8 rows (prefill, +20%) slower, whose registers they crowd: so
// they are taken for tiles of at most 4 rows without int4 (docs/gpu/h200-2026-12-04), where the
// host allows (PAIRS: GPUs by default; on lavapipe pairs measured slower).
const PAIR: u32 = 2u;
override PAIRS: bool = true;
// With one key a step (KEY_STEP = 1: MLA, or one lane a key), two steps a pass (the first key
// loop), the same bits as one (the second). On lavapipe this made MLA absorbed decode 1.3x
// faster (tiles of 8 heads: the query and accumulator vec4s, which a CPU adapter keeps in
// memory, read once for two keys); not yet measured on a GPU, where it is off by default
// (ContextOptions::step_pairs).
override STEP_PAIRS: bool = false;
override STEP_PAIRED: bool = STEP_PAIRS && KEY_STEP == 1u;
override PAIRED: bool = PAIRS && KEY_STEP > 1u && TILE <= 4u && K_DTYPE != KV_INT4
    && V_DTYPE != KV_INT4;

// Each group's running max, sum and poisoned flag per row, then the combined output rows.
override GROUP_ROWS: u32 = NG * TILE;
override COMB_LEN: u32 = TILE * OUT_DIM / 4u;
var<workgroup> grp_m: array<f32, GROUP_ROWS>;
var<workgroup> grp_l: array<f32, GROUP_ROWS>;
var<workgroup> grp_bad: array<u32, GROUP_ROWS>;
var<workgroup> comb: array<vec4<f32>, COMB_LEN>;
var<workgroup> row_m: array<f32, MAX_TILE>;
var<workgroup> row_l: array<f32, MAX_TILE>;
var<workgroup> row_bad: array<u32, MAX_TILE>;

// The pools, read 16 bytes at a time: K and V of each bound pool buffer, one slot per buffer.
// A pool of at most POOL_SLOTS buffers (as many as the device's storage bindings allow, see
// DeviceFit::pool_slots) is bound whole, so a split's keys may lie in any of them; over more,
// each dispatch binds one buffer (POOL_SLOTS = 1). The host writes the declarations out per slot
// count (shader.rs, pool_bindings): the constant POOL_SLOTS, bindings k_pool4_s / v_pool4_s
// (2 and 3 for slot 0, then 9 and 10, 11 and 12, ...) and pool_vec4(which, i), vec4 i of pool
// `which` = 2 slot + (0 for K, 1 for V). The host rounds every pool buffer up to 16 bytes, so
// every word has its vec4.
// @pool-bindings

fn kv_word(which: u32, i: u32) -> u32 {
    return pool_vec4(which, i >> 2u)[i & 3u];
}

// kv_half2 (two f16 values of a word) comes from lib/half2_exact.wgsl or lib/half2_convert.wgsl
// (ShaderVariant::f16_convert).

// Chunk ci (words 4ci .. 4ci + 3) of pool row `row` of pool `which`; words past the row read
// as 0.
fn pool_chunk(which: u32, row: u32, ci: u32) -> vec4<u32> {
    if WIDE {
        return pool_vec4(which, kv_row_base(which, row) / 4u + ci);
    }
    let words = kv_wpr(which);
    let base = kv_row_base(which, row) + ci * 4u;
    var w = vec4<u32>(0u);
    for (var e = 0u; e < 4u; e++) {
        if ci * 4u + e < words {
            w[e] = kv_word(which, base + e);
        }
    }
    return w;
}

// The (scale, min) that chunk ci of an int4 row is decoded with (a chunk is one scale group);
// (0, 0) for the other formats, for which kv_quad_of does not read it.
fn chunk_group(which: u32, row: u32, ci: u32) -> vec2<f32> {
    if kv_dtype_of(which) == KV_INT4 {
        return kv_int4_group(which, row, ci);
    }
    return vec2<f32>(0.0);
}

// d + q . k, in a fixed order.
fn dot_fma(q: vec4<f32>, k: vec4<f32>, d: f32) -> f32 {
    return fma(q.w, k.w, fma(q.z, k.z, fma(q.y, k.y, fma(q.x, k.x, d))));
}

// The K pool (2 slot) and the pool row of key j of the item's sequence for KV head `kv_head`.
// Block sizes are powers of two: shifts and masks, not divisions.
fn key_at(it: WorkItem, kv_head: u32, j: u32) -> vec2<u32> {
    let at = plan[it.table + (j >> firstTrailingBit(params.block_size))] - params.first_block;
    var slot = 0u;
    var block = at;
    if POOL_SLOTS > 1u {
        slot = at / params.blocks_per_buffer;
        block = at % params.blocks_per_buffer;
    }
    let row = (block * params.num_kv_heads + kv_head) * params.block_size
        + (j & (params.block_size - 1u));
    return vec2<u32>(2u * slot, row);
}

// Key jc's score for the row at position p_t whose ALiBi slope is `slope`: MASKED where the
// key is past the item's keys (`live` false) or the causal mask or window hides it, and
// poisoned only where the key is visible.
fn key_score(dot_qk: f32, jc: u32, p_t: u32, live: bool, slope: f32) -> Score {
    var visible = live;
    if (params.flags & FLAG_CAUSAL) != 0u {
        // p - j < window, never j + window > p: no sum of positions can wrap.
        visible = visible && jc <= p_t && (params.window == 0u || p_t - jc < params.window);
    }
    let dist = select(jc - p_t, p_t - jc, p_t >= jc);
    let sc = score_of(dot_qk, params.scale, params.softcap, slope * f32(dist));
    return Score(select(MASKED, sc.value, visible), visible && sc.poison);
}

// A row's online-softmax step over keys whose largest score is `top`: the new running max `m`,
// `raised` where it rose above the old `m_old`, `alpha` the factor of the running sum and output
// (exactly 1 unless raised), and `p` the weight of the lane's own key, of score `s`, in `real`
// precision.
struct RowStep {
    m: f32,
    raised: bool,
    alpha: f32,
    p: f32,
}

fn row_step(m_old: f32, top: f32, s: f32) -> RowStep {
    let m = max(m_old, top);
    let raised = m > m_old;
    let alpha = select(1.0, exp(m_old - m), raised);
    return RowStep(m, raised, alpha, f32(real(softmax_weight(s, m))));
}

// This lane's chunks (and int4 groups) of the K rows of PAIR keys (pool and row `kat[e]`,
// chunk c of key e at e MAX_CHK + c) and the rows' scales: what both paired key loops load.
struct PairRows {
    kw: array<vec4<u32>, PAIR * MAX_CHK>,
    kg: array<vec2<f32>, PAIR * MAX_CHK>,
    ks: array<f32, PAIR>,
}

fn pair_rows(kat: array<vec2<u32>, PAIR>, lane: u32) -> PairRows {
    var r: PairRows;
    for (var e = 0u; e < PAIR; e++) { // @unroll
        for (var c = 0u; c < CHK; c++) { // @unroll
            let ci = lane + c * KEY_LANES;
            if ci < K_CH {
                r.kw[e * MAX_CHK + c] = pool_chunk(kat[e].x, kat[e].y, ci);
                r.kg[e * MAX_CHK + c] = chunk_group(kat[e].x, kat[e].y, ci);
            }
        }
        r.ks[e] = kv_row_scale(kat[e].x, kat[e].y);
    }
    return r;
}

// The kernel body; the entry point `main` and `lanes_sum_rows` come from rows_portable.wgsl or
// rows_subgroup.wgsl.
fn attend(wid: vec3<u32>, tid: u32) {
    let item = plan[params.list_at + wid.x];
    let kv_head = wid.y;
    let it = work_item(item);
    let d4 = K_DIM / 4u;
    let q4 = (K_DIM + ROPE_DIM) / 4u;
    let dv4 = OUT_DIM / 4u;
    let v_dtype = kv_dtype_of(value_pool());
    let alibi = (params.flags & FLAG_ALIBI) != 0u;
    let lane = tid % KEY_LANES;
    let grp = tid / KEY_LANES;
    let r_at = TILE * CHK * QK;

    // The lane's query columns of every row, its rows' positions and slopes, running states.
    var qreg: array<vec4<f32>, MAX_QREG>;
    var pos: array<u32, MAX_TILE>;
    var slope: array<f32, MAX_TILE>;
    var m: array<f32, MAX_TILE>;
    var l: array<f32, MAX_TILE>;
    var bad: array<bool, MAX_TILE>;
    for (var t = 0u; t < TILE; t++) { // @unroll
        let r = it.row0 + min(t, it.n_rows - 1u);
        let h = kv_head * GROUP + r % GROUP;
        pos[t] = r / GROUP + it.len_k - it.len_q;
        slope[t] = select(0.0, bitcast<f32>(plan[params.slopes_at + h]), alibi);
        m[t] = MASKED;
        l[t] = 0.0;
        bad[t] = false;
        let qb = ((it.q_base + r / GROUP) * params.num_q_heads + h) * q4;
        for (var c = 0u; c < CHK; c++) { // @unroll
            for (var p = 0u; p < QK; p++) { // @unroll
                let col = (lane + c * KEY_LANES) * QK + p;
                var v = vec4<f32>(0.0);
                if col < d4 {
                    v = q[qb + col];
                }
                qreg[(t * CHK + c) * QK + p] = vec4<f32>(real4(v));
            }
        }
        for (var c = 0u; c < CHR; c++) { // @unroll
            for (var p = 0u; p < QR; p++) { // @unroll
                let col = (lane + c * KEY_LANES) * QR + p;
                var v = vec4<f32>(0.0);
                if col < ROPE_DIM / 4u {
                    v = q[qb + d4 + col];
                }
                qreg[r_at + (t * CHR + c) * QR + p] = vec4<f32>(real4(v));
            }
        }
    }
    var acc: array<vec4<f32>, MAX_AREG>;

    // Group grp takes the keys j of the item with j % NG == grp, KEY_STEP of them a step: key k
    // of step s is j = base + (s KEY_STEP + k) NG + grp, with base a multiple of NG KEY_STEP
    // (absolute positions, so the steps, like the partition, are the same in every tile and
    // batch that holds a row). Lane l owns key l % KEY_STEP of a step: it alone scores it and
    // adds its probability to the lane's own part of the row sums (the lanes' parts are added at
    // the end), so the softmax of a key runs in one lane, not in every lane of the group. The
    // running max is the group's, taken once a step. With KEY_STEP = 1 (MLA, whose values are
    // the latent chunks the lanes already read for the dot products) every lane owns the step's
    // key and nothing is exchanged. Every invocation runs the same steps (the portable sums have
    // barriers).
    let span = NG * KEY_STEP;
    let base = it.key_start - it.key_start % span;
    let steps = (it.key_end - base + span - 1u) / span;
    let own = lane % KEY_STEP;
    // With PAIRED, the distance between the two keys of a pair (1 where there are no pairs).
    let pair_gap = max(KEY_STEP / PAIR, 1u);
    // With STEP_PAIRED (one key a step, KEY_STEP = 1: MLA, or one lane a key), two steps a pass:
    // keys first and first + NG of the group, one after the other. Their rows are loaded
    // together, each query vec4 is read once for both dot products and each accumulator once
    // for both keys' updates, but every value meets the same operations in the same order as
    // in the loop below (the softmax of the first key, then the second's, each element of the
    // output rescaled and added to for the first key, then for the second), so the bits are
    // those of one key a step. A key past the range is a step no row sees, as below.
    let span2 = PAIR * NG;
    let base2 = it.key_start - it.key_start % span2;
    let passes = select(0u, (it.key_end - base2 + span2 - 1u) / span2, STEP_PAIRED);
    for (var s = 0u; s < passes; s++) {
        let first = base2 + s * span2 + grp;
        var live: array<bool, PAIR>;
        var kat: array<vec2<u32>, PAIR>;
        for (var e = 0u; e < PAIR; e++) { // @unroll
            let j = first + e * NG;
            live[e] = j >= it.key_start && j < it.key_end;
            kat[e] = key_at(it, kv_head, clamp(j, it.key_start, it.key_end - 1u));
        }
        var rows = pair_rows(kat, lane);

        // 1. Both keys' dot products with every row (the latent part, its row scale, then the
        // RoPE part), summed over the group's lanes.
        var d0: array<f32, MAX_TILE>;
        var d1: array<f32, MAX_TILE>;
        for (var c = 0u; c < CHK; c++) { // @unroll
            let ci = lane + c * KEY_LANES;
            if ci < K_CH {
                for (var p = 0u; p < QK; p++) { // @unroll
                    let k0 = vec4<f32>(real4(kv_quad_of(K_DTYPE, rows.kw[c], p, rows.kg[c])));
                    let k1 = vec4<f32>(real4(kv_quad_of(K_DTYPE, rows.kw[MAX_CHK + c], p,
                        rows.kg[MAX_CHK + c])));
                    for (var t = 0u; t < TILE; t++) { // @unroll
                        let qv = qreg[(t * CHK + c) * QK + p];
                        d0[t] = dot_fma(qv, k0, d0[t]);
                        d1[t] = dot_fma(qv, k1, d1[t]);
                    }
                }
            }
        }
        for (var t = 0u; t < TILE; t++) { // @unroll
            d0[t] *= rows.ks[0];
            d1[t] *= rows.ks[1];
        }
        for (var c = 0u; c < CHR; c++) { // @unroll
            let ci = lane + c * KEY_LANES;
            if ci < R_CH {
                let w0 = pool_chunk(kat[0].x + 1u, kat[0].y, ci);
                let w1 = pool_chunk(kat[1].x + 1u, kat[1].y, ci);
                for (var p = 0u; p < QR; p++) { // @unroll
                    let k0 = vec4<f32>(real4(kv_quad_of(V_DTYPE, w0, p, vec2<f32>(0.0))));
                    let k1 = vec4<f32>(real4(kv_quad_of(V_DTYPE, w1, p, vec2<f32>(0.0))));
                    for (var t = 0u; t < TILE; t++) { // @unroll
                        let qv = qreg[r_at + (t * CHR + c) * QR + p];
                        d0[t] = dot_fma(qv, k0, d0[t]);
                        d1[t] = dot_fma(qv, k1, d1[t]);
                    }
                }
            }
        }
        for (var t = 0u; t < TILE; t++) { // @unroll
            d0[t] = select(0.0, d0[t], live[0]);
            d1[t] = select(0.0, d1[t], live[1]);
        }
        var dd: array<array<f32, MAX_TILE>, PAIR>;
        dd[0] = lanes_sum_rows(d0);
        dd[1] = lanes_sum_rows(d1);

        // 2 and 3. Each key's scores and softmax step, the first key's before the second's.
        var alpha: array<array<f32, MAX_TILE>, PAIR>;
        var raised: array<array<bool, MAX_TILE>, PAIR>;
        var pv: array<array<f32, MAX_TILE>, PAIR>;
        for (var e = 0u; e < PAIR; e++) { // @unroll
            let jc = clamp(first + e * NG, it.key_start, it.key_end - 1u);
            let vp = kat[e].x + value_pool();
            let v_scale = select(1.0, kv_row_scale(vp, kat[e].y), kv_row_scaled(vp));
            for (var t = 0u; t < TILE; t++) { // @unroll
                let sc = key_score(dd[e][t], jc, pos[t], live[e], slope[t]);
                bad[t] = bad[t] || sc.poison;
                let st = row_step(m[t], sc.value, sc.value);
                raised[e][t] = st.raised;
                alpha[e][t] = st.alpha;
                l[t] = fma(l[t], st.alpha, st.p);
                m[t] = st.m;
                pv[e][t] = select(0.0, st.p * v_scale, bits_nonzero(st.p));
            }
        }

        // 4. The value rows (the latent chunks read above for MLA), each element rescaled and
        // added to for the first key, then for the second.
        for (var c = 0u; c < CHV; c++) { // @unroll
            let ci = lane + c * KEY_LANES;
            if ci < V_CH {
                var vw: array<vec4<u32>, PAIR>;
                var vg: array<vec2<f32>, PAIR>;
                for (var e = 0u; e < PAIR; e++) { // @unroll
                    if value_pool() == 0u {
                        vw[e] = rows.kw[e * MAX_CHK + c];
                        vg[e] = rows.kg[e * MAX_CHK + c];
                    } else {
                        vw[e] = pool_chunk(kat[e].x + 1u, kat[e].y, ci);
                        vg[e] = chunk_group(kat[e].x + 1u, kat[e].y, ci);
                    }
                }
                for (var p = 0u; p < QV; p++) { // @unroll
                    let v0 = vec4<f32>(real4(kv_quad_of(v_dtype, vw[0], p, vg[0])));
                    let v1 = vec4<f32>(real4(kv_quad_of(v_dtype, vw[1], p, vg[1])));
                    for (var t = 0u; t < TILE; t++) { // @unroll
                        let a = (t * CHV + c) * QV + p;
                        var o = acc[a];
                        if raised[0][t] {
                            o = o * alpha[0][t];
                        }
                        if bits_nonzero(pv[0][t]) {
                            o = fma(vec4<f32>(pv[0][t]), v0, o);
                        }
                        if raised[1][t] {
                            o = o * alpha[1][t];
                        }
                        if bits_nonzero(pv[1][t]) {
                            o = fma(vec4<f32>(pv[1][t]), v1, o);
                        }
                        acc[a] = o;
                    }
                }
            }
        }
    }
    // MLA (the values are the K pool row) keeps the latent's chunks of its one key a step.
    var kwords: array<vec4<u32>, MAX_CHK>;
    var kgroups: array<vec2<f32>, MAX_CHK>;
    for (var s = 0u; !STEP_PAIRED && s < steps; s++) {
        let first = base + s * span + grp;

        // 1. Each key's dot products with every row: this lane's part, then the whole sums, kept
        // by the key's owner. With PAIRED, PAIR keys at a time, k and k + KEY_STEP / 2: their
        // rows are loaded (an out-of-range key reads the nearest key's row, whose dot products
        // are then replaced by 0, as a skipped key's are), their dot products computed, then
        // summed together (lanes_sum_pair: each lane gets the sums of the one of the two keys
        // its half of the group may own, with half the exchanges of two lanes_sum_rows and
        // their bits).
        var own_dots: array<f32, MAX_TILE>;
        for (var k = 0u; PAIRED && k < pair_gap; k++) {
            var live: array<bool, PAIR>;
            var kat: array<vec2<u32>, PAIR>;
            for (var e = 0u; e < PAIR; e++) { // @unroll
                let j = first + (k + e * pair_gap) * NG;
                live[e] = j >= it.key_start && j < it.key_end;
                kat[e] = key_at(it, kv_head, clamp(j, it.key_start, it.key_end - 1u));
            }
            var rows = pair_rows(kat, lane);
            var dd: array<array<f32, MAX_TILE>, PAIR>;
            for (var e = 0u; e < PAIR; e++) { // @unroll
                var d: array<f32, MAX_TILE>;
                for (var c = 0u; c < CHK; c++) { // @unroll
                    let ci = lane + c * KEY_LANES;
                    if ci < K_CH {
                        for (var p = 0u; p < QK; p++) { // @unroll
                            let kq = vec4<f32>(real4(kv_quad_of(K_DTYPE,
                                rows.kw[e * MAX_CHK + c], p, rows.kg[e * MAX_CHK + c])));
                            for (var t = 0u; t < TILE; t++) { // @unroll
                                d[t] = dot_fma(qreg[(t * CHK + c) * QK + p], kq, d[t]);
                            }
                        }
                    }
                }
                for (var t = 0u; t < TILE; t++) { // @unroll
                    dd[e][t] = select(0.0, d[t] * rows.ks[e], live[e]);
                }
            }
            let dots = lanes_sum_pair(dd[0], dd[1]);
            let mine = own % pair_gap == k;
            for (var t = 0u; t < TILE; t++) { // @unroll
                own_dots[t] = select(own_dots[t], dots[t], mine);
            }
        }
        for (var k = 0u; !PAIRED && k < KEY_STEP; k++) {
            let j = first + k * NG;
            var d: array<f32, MAX_TILE>;
            if j >= it.key_start && j < it.key_end {
                let at = key_at(it, kv_head, j);
                let kp = at.x;
                let row = at.y;
                for (var c = 0u; c < CHK; c++) { // @unroll
                    let ci = lane + c * KEY_LANES;
                    if ci < K_CH {
                        let w = pool_chunk(kp, row, ci);
                        let sm = chunk_group(kp, row, ci);
                        if value_pool() == 0u {
                            kwords[c] = w;
                            kgroups[c] = sm;
                        }
                        for (var p = 0u; p < QK; p++) { // @unroll
                            let kq = vec4<f32>(real4(kv_quad_of(K_DTYPE, w, p, sm)));
                            for (var t = 0u; t < TILE; t++) { // @unroll
                                d[t] = dot_fma(qreg[(t * CHK + c) * QK + p], kq, d[t]);
                            }
                        }
                    }
                }
                let k_scale = kv_row_scale(kp, row);
                for (var t = 0u; t < TILE; t++) { // @unroll
                    d[t] *= k_scale;
                }
                // MLA: the RoPE part of the key (16-bit or f32, no row scale).
                for (var c = 0u; c < CHR; c++) { // @unroll
                    let ci = lane + c * KEY_LANES;
                    if ci < R_CH {
                        let w = pool_chunk(kp + 1u, row, ci);
                        for (var p = 0u; p < QR; p++) { // @unroll
                            let kq = vec4<f32>(real4(kv_quad_of(V_DTYPE, w, p, vec2<f32>(0.0))));
                            for (var t = 0u; t < TILE; t++) { // @unroll
                                d[t] = dot_fma(qreg[r_at + (t * CHR + c) * QR + p], kq, d[t]);
                            }
                        }
                    }
                }
            }
            let dots = lanes_sum_rows(d);
            let mine = own == k;
            for (var t = 0u; t < TILE; t++) { // @unroll
                own_dots[t] = select(own_dots[t], dots[t], mine);
            }
        }

        // 2. The scores of the lane's own key.
        let j = first + own * NG;
        let live = j >= it.key_start && j < it.key_end;
        let jc = clamp(j, it.key_start, it.key_end - 1u);
        let at = key_at(it, kv_head, jc);
        let vp = at.x + value_pool();
        let v_scale = select(1.0, kv_row_scale(vp, at.y), kv_row_scaled(vp));
        var sv: array<f32, MAX_TILE>;
        for (var t = 0u; t < TILE; t++) { // @unroll
            let sc = key_score(own_dots[t], jc, pos[t], live, slope[t]);
            bad[t] = bad[t] || sc.poison;
            sv[t] = sc.value;
        }

        // 3. The online softmax: the step's max over the group's keys, the running state
        // rescaled only where the max rose (alpha is exactly 1 elsewhere), the own key's
        // probability in `real` precision, and that times the V row's scale (a zero probability
        // stays zero: a masked key's scale may be NaN).
        var top = sv;
        if KEY_STEP > 1u {
            top = lanes_max_rows(sv);
        }
        var raised: array<bool, MAX_TILE>;
        var alpha: array<f32, MAX_TILE>;
        var pv: array<f32, MAX_TILE>;
        for (var t = 0u; t < TILE; t++) { // @unroll
            let st = row_step(m[t], top[t], sv[t]);
            raised[t] = st.raised;
            alpha[t] = st.alpha;
            l[t] = fma(l[t], st.alpha, st.p);
            m[t] = st.m;
            pv[t] = select(0.0, st.p * v_scale, bits_nonzero(st.p));
        }
        for (var c = 0u; c < CHV; c++) { // @unroll
            for (var p = 0u; p < QV; p++) { // @unroll
                for (var t = 0u; t < TILE; t++) { // @unroll
                    let a = (t * CHV + c) * QV + p;
                    if raised[t] {
                        acc[a] = acc[a] * alpha[t];
                    }
                }
            }
        }

        // 4. The value rows of the step's keys in order, each lane its chunks: acc += p v, the
        // product only where p is not zero (0 * inf or 0 * NaN must not reach a row), and no
        // read of a row that no row of the tile weighs. MLA's value is the latent the lane read
        // in step 1 (the same chunks: V_CH == K_CH, CHV == CHK), so it is not read again.
        if KEY_STEP > 1u {
            lanes_share_rows(pv);
        }
        for (var k = 0u; PAIRED && k < KEY_STEP; k += PAIR) {
            // PAIR keys at a time, as in step 1: both rows loaded where either is weighed (an
            // unweighed one of the two, or one past the range, reads a valid row never used).
            var pk: array<array<f32, MAX_TILE>, PAIR>;
            var weighed: array<bool, PAIR>;
            var any_weighed = false;
            for (var e = 0u; e < PAIR; e++) { // @unroll
                pk[e] = lanes_shared_rows(k + e);
                weighed[e] = false;
                for (var t = 0u; t < TILE; t++) { // @unroll
                    weighed[e] = weighed[e] || bits_nonzero(pk[e][t]);
                }
                any_weighed = any_weighed || weighed[e];
            }
            if any_weighed {
                var vw: array<vec4<u32>, PAIR * MAX_CHK>;
                var vg: array<vec2<f32>, PAIR * MAX_CHK>;
                for (var e = 0u; e < PAIR; e++) { // @unroll
                    let j = clamp(first + (k + e) * NG, it.key_start, it.key_end - 1u);
                    let vat = key_at(it, kv_head, j);
                    let vpk = vat.x + value_pool();
                    for (var c = 0u; c < CHV; c++) { // @unroll
                        let ci = lane + c * KEY_LANES;
                        if ci < V_CH {
                            vw[e * MAX_CHK + c] = pool_chunk(vpk, vat.y, ci);
                            vg[e * MAX_CHK + c] = chunk_group(vpk, vat.y, ci);
                        }
                    }
                }
                for (var e = 0u; e < PAIR; e++) { // @unroll
                    if weighed[e] {
                        for (var c = 0u; c < CHV; c++) { // @unroll
                            let ci = lane + c * KEY_LANES;
                            if ci < V_CH {
                                for (var p = 0u; p < QV; p++) { // @unroll
                                    let v = vec4<f32>(real4(kv_quad_of(v_dtype, vw[e * MAX_CHK + c],
                                        p, vg[e * MAX_CHK + c])));
                                    for (var t = 0u; t < TILE; t++) { // @unroll
                                        let a = (t * CHV + c) * QV + p;
                                        if bits_nonzero(pk[e][t]) {
                                            acc[a] = fma(vec4<f32>(pk[e][t]), v, acc[a]);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        for (var k = 0u; !PAIRED && k < KEY_STEP; k++) {
            var pk = pv;
            if KEY_STEP > 1u {
                pk = lanes_shared_rows(k);
            }
            var weighed = false;
            for (var t = 0u; t < TILE; t++) { // @unroll
                weighed = weighed || bits_nonzero(pk[t]);
            }
            if weighed {
                let vat = key_at(it, kv_head, first + k * NG);
                let vpk = vat.x + value_pool();
                for (var c = 0u; c < CHV; c++) { // @unroll
                    let ci = lane + c * KEY_LANES;
                    if ci < V_CH {
                        var w: vec4<u32>;
                        var sm: vec2<f32>;
                        if value_pool() == 0u {
                            w = kwords[c];
                            sm = kgroups[c];
                        } else {
                            w = pool_chunk(vpk, vat.y, ci);
                            sm = chunk_group(vpk, vat.y, ci);
                        }
                        for (var p = 0u; p < QV; p++) { // @unroll
                            let v = vec4<f32>(real4(kv_quad_of(v_dtype, w, p, sm)));
                            for (var t = 0u; t < TILE; t++) { // @unroll
                                let a = (t * CHV + c) * QV + p;
                                if bits_nonzero(pk[t]) {
                                    acc[a] = fma(vec4<f32>(pk[t]), v, acc[a]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    // The group's row sums (each lane summed its own keys) and poisoned flags (as 0 or 1; any
    // nonzero bits, NaN included, count as poisoned).
    if KEY_STEP > 1u {
        l = lanes_sum_rows(l);
        var flags: array<f32, MAX_TILE>;
        for (var t = 0u; t < TILE; t++) { // @unroll
            flags[t] = select(0.0, 1.0, bad[t]);
        }
        flags = lanes_max_rows(flags);
        for (var t = 0u; t < TILE; t++) { // @unroll
            bad[t] = bits_nonzero(flags[t]);
        }
    }

    // 5. The groups combine, in group order: each row's max over the groups, the groups' sums
    // and outputs rescaled to it.
    if lane == 0u {
        for (var t = 0u; t < TILE; t++) { // @unroll
            grp_m[grp * TILE + t] = m[t];
            grp_l[grp * TILE + t] = l[t];
            grp_bad[grp * TILE + t] = u32(bad[t]);
        }
    }
    workgroupBarrier();
    var f: array<f32, MAX_TILE>;
    for (var t = 0u; t < TILE; t++) { // @unroll
        var mt = MASKED;
        for (var g = 0u; g < NG; g++) {
            mt = max(mt, grp_m[g * TILE + t]);
        }
        f[t] = exp(m[t] - mt);
    }
    // Each row's max, sum and poisoned flag over the groups, once (visible to all after the
    // barriers below). A workgroup may have fewer invocations than the tile has rows (one lane
    // a key and few groups: WG 8 with tiles of 16), so each invocation takes rows WG apart.
    for (var t = tid; t < TILE; t += WG) {
        var mt = MASKED;
        var poisoned = 0u;
        for (var g = 0u; g < NG; g++) {
            mt = max(mt, grp_m[g * TILE + t]);
            poisoned |= grp_bad[g * TILE + t];
        }
        var lt = 0.0;
        for (var g = 0u; g < NG; g++) {
            lt = fma(grp_l[g * TILE + t], exp(grp_m[g * TILE + t] - mt), lt);
        }
        row_m[t] = mt;
        row_l[t] = lt;
        row_bad[t] = poisoned;
    }
    for (var g = 0u; g < NG; g++) {
        if grp == g {
            for (var c = 0u; c < CHV; c++) { // @unroll
                for (var p = 0u; p < QV; p++) { // @unroll
                    let col = (lane + c * KEY_LANES) * QV + p;
                    if col < dv4 {
                        for (var t = 0u; t < TILE; t++) { // @unroll
                            let a = (t * CHV + c) * QV + p;
                            let i = t * dv4 + col;
                            if g == 0u {
                                comb[i] = acc[a] * f[t];
                            } else {
                                comb[i] = fma(acc[a], vec4<f32>(f[t]), comb[i]);
                            }
                        }
                    }
                }
            }
        }
        workgroupBarrier();
    }

    // 6. Partial state of each row: normalized output and log-sum-exp (-inf when the row saw no
    // key of this item; NaN for both when a visible key poisoned it).
    let out_base = (item * params.num_kv_heads + kv_head) * TILE;
    let v_tensor = value_tensor_scale();
    let nan = nan_f32();
    for (var i = tid; i < it.n_rows * dv4; i += WG) {
        let t = i / dv4;
        let c = i % dv4;
        let mt = row_m[t];
        let lt = row_l[t];
        let poisoned = row_bad[t] != 0u;
        let o = comb[i] * (softmax_inv_sum(lt) * v_tensor);
        o_part[(out_base + t) * dv4 + c] = select(o, vec4<f32>(nan), poisoned);
        if c == 0u {
            lse_part[out_base + t] = select(softmax_lse(mt, lt), nan, poisoned);
        }
    }
}
