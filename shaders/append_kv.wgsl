// append_kv: write new token rows of K or V into their slots of one pool buffer, in place,
// encoding them into the pool's storage format (DESIGN.md sections 5 and 6).
//
// src: [n_src, Hkv, DIM] values, f32 bits or (SRC_F16) f16 pairs, element 2i in the low half.
// rows: pairs (source token index, global slot = block * block_size + offset), only slots whose
//   block lives in this buffer (the host partitions them).
// pool: blocks [Hkv][block_size][words_per_row], block `first_block` at word 0.
// One workgroup per (KV head, row entry); its invocations write the row's words.

struct AppendParams {
    num_entries: u32,
    // Entry handled by workgroup y = 0 of this dispatch (dispatches are chunked in y).
    entry_base: u32,
    num_kv_heads: u32,
    block_size: u32,
    first_block: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

override WG: u32 = 64u;
// Head dim of this tensor; DST_DTYPE is its storage format (a KV_* code).
override DIM: u32 = 128u;
override DST_DTYPE: u32 = 0u;
override SRC_F16: bool = false;

@group(0) @binding(0) var<uniform> params: AppendParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(0) @binding(3) var<storage, read_write> pool: array<u32>;

// f32 bits of element `e` of the source.
fn src_bits(e: u32) -> u32 {
    if SRC_F16 {
        return kv_f16_to_f32_bits((src[e / 2u] >> ((e & 1u) * 16u)) & 0xffffu);
    }
    return src[e];
}

// Word `w` of a row whose first source element is `e0`, in DST_DTYPE.
fn encode_word(e0: u32, w: u32) -> u32 {
    switch DST_DTYPE {
        case KV_F16: {
            let e = e0 + 2u * w;
            return kv_f32_bits_to_f16(src_bits(e)) | (kv_f32_bits_to_f16(src_bits(e + 1u)) << 16u);
        }
        case KV_BF16: {
            let e = e0 + 2u * w;
            return kv_f32_bits_to_bf16(src_bits(e)) | (kv_f32_bits_to_bf16(src_bits(e + 1u)) << 16u);
        }
        default: {
            return src_bits(e0 + w);
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let entry = params.entry_base + wid.y;
    if entry >= params.num_entries {
        return;
    }
    let h = wid.x;
    let token = rows[2u * entry];
    let slot = rows[2u * entry + 1u];
    let block = slot / params.block_size - params.first_block;
    let offset = slot % params.block_size;
    let wpr = kv_words_per_row(DST_DTYPE, DIM);
    let dst = ((block * params.num_kv_heads + h) * params.block_size + offset) * wpr;
    let e0 = (token * params.num_kv_heads + h) * DIM;
    for (var w = lid; w < wpr; w += WG) {
        pool[dst + w] = encode_word(e0, w);
    }
}
