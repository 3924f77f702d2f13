// paged_io.wgsl: what the paged attention kernels (paged.wgsl, paged_lanes.wgsl) share: their
// parameters, the plan's record layout and their bindings but the pools, which each kernel
// declares with the accessors kv_load.wgsl needs (kv_word).
// Needs kv_load.wgsl (override K_DIM) and kv_format.wgsl.

struct PagedParams {
    num_q_heads: u32,
    num_kv_heads: u32,
    block_size: u32,
    // First global block id of the bound pool buffer (slot 0).
    first_block: u32,
    scale: f32,
    // 0 = no softcap.
    softcap: f32,
    // 0 = no sliding window.
    window: u32,
    // bit 0: causal, bit 1: ALiBi.
    flags: u32,
    // Word offsets into `plan`.
    items_at: u32,
    seqs_at: u32,
    slopes_at: u32,
    // Work items of this dispatch: plan[list_at .. list_at + list_len] are item ids.
    list_at: u32,
    list_len: u32,
    // Blocks per pool buffer: block b (counted from first_block) is block b % blocks_per_buffer
    // of the buffer in slot b / blocks_per_buffer.
    blocks_per_buffer: u32,
    _pad1: u32,
    _pad2: u32,
}

// Query heads per KV head.
override GROUP: u32 = 1u;
// Rows per tile (<= MAX_TILE, and ACC_COLS * ACC_ROWS <= MAX_ACC).
override TILE: u32 = 1u;
// MLA: RoPE dims of a key, read from the V pool (0: ordinary K/V).
override ROPE_DIM: u32 = 0u;
// Dims of an output row (V_DIM, or K_DIM for MLA). A query row has K_DIM + ROPE_DIM.
override OUT_DIM: u32 = 128u;

const FLAG_CAUSAL: u32 = 1u;
const FLAG_ALIBI: u32 = 2u;
// Words per work item and per sequence record in `plan`.
const ITEM_WORDS: u32 = 8u;
const SEQ_WORDS: u32 = 4u;

@group(0) @binding(0) var<uniform> params: PagedParams;
// [total_q, Hq, (K_DIM + ROPE_DIM) / 4]
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
// Bindings 2 and 3 (and 9 and 10) are the K and V pools; each kernel declares them and defines
// kv_word (and kv_word4) over them.
// Work items (seq, first row, rows, key start, key end, 3 unused), sequences (first query
// token, len_q, len_k, block table offset), ALiBi slopes (f32 bits), block tables, item lists.
@group(0) @binding(4) var<storage, read> plan: array<u32>;
// Partial states: [item, kv head, TILE, OUT_DIM / 4] and [item, kv head, TILE].
@group(0) @binding(5) var<storage, read_write> o_part: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> lse_part: array<f32>;
@group(0) @binding(7) var<uniform> k_tensor: TensorScale;
@group(0) @binding(8) var<uniform> v_tensor: TensorScale;

fn kv_tensor_scale(which: u32) -> f32 {
    if (which & 1u) == 0u {
        return k_tensor.scale;
    }
    return v_tensor.scale;
}

// The pool the values come from: V, or K (the latent) for MLA.
fn value_pool() -> u32 {
    if ROPE_DIM > 0u {
        return 0u;
    }
    return 1u;
}

// The per-tensor scale of the values (1 unless they have one), applied to the output once.
fn value_tensor_scale() -> f32 {
    let w = value_pool();
    return select(1.0, kv_tensor_scale(w), kv_per_tensor_of(w));
}

// A work item of the plan and its sequence's record: the tile's first row and rows, the key
// range it sees, and the sequence's first query token, query and key lengths and block table.
struct WorkItem {
    seq: u32,
    row0: u32,
    n_rows: u32,
    key_start: u32,
    key_end: u32,
    q_base: u32,
    len_q: u32,
    len_k: u32,
    table: u32,
}

// Work item `item` as the host wrote it (ITEM_WORDS and SEQ_WORDS words per record).
fn work_item(item: u32) -> WorkItem {
    let ib = params.items_at + item * ITEM_WORDS;
    let seq = plan[ib];
    let sb = params.seqs_at + seq * SEQ_WORDS;
    return WorkItem(
        seq,
        plan[ib + 1u],
        plan[ib + 2u],
        plan[ib + 3u],
        plan[ib + 4u],
        plan[sb],
        plan[sb + 1u],
        plan[sb + 2u],
        plan[sb + 3u],
    );
}
