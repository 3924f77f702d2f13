//! Test data for the benchmark cases: deterministic values, and caches filled with valid
//! encoded rows by GPU appends.

use crate::cache::append_kv::SourceDtype;
use crate::cache::paged::{AppendBatch, PagedKvCache};
use crate::gpu::Context;
use crate::Result;

/// Largest f32 source buffer one fill append uploads (K or V).
const FILL_SOURCE_BYTES: usize = 16 << 20;

/// `n` deterministic values, uniform in `[-scale, scale)` (a hash of the index and `seed`).
pub(super) fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = i.wrapping_add(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let unit = (z >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * unit - 1.0) * scale
        })
        .collect()
}

/// Adds sequences `0..seqs` to `cache` and appends `tokens` tokens to each, writing K and V
/// rows of deterministic values with the GPU append kernel (so every row is validly encoded in
/// the cache's format, scales included), a few thousand tokens per append. Waits for the GPU.
pub(super) fn fill_cache(
    ctx: &Context,
    cache: &mut PagedKvCache,
    seqs: usize,
    tokens: usize,
) -> Result<()> {
    let c = cache.config().clone();
    let widest = c.num_kv_heads * c.head_dim_k.max(c.head_dim_v) * 4;
    let chunk = (FILL_SOURCE_BYTES / widest).clamp(1, tokens.max(1));
    let k = ctx.upload(
        "bench fill k",
        &values(chunk * c.num_kv_heads * c.head_dim_k, 1, 1.0),
    )?;
    let v = ctx.upload(
        "bench fill v",
        &values(chunk * c.num_kv_heads * c.head_dim_v, 2, 1.0),
    )?;
    for seq in 0..seqs as u64 {
        cache.add_sequence(seq, &[])?;
        let mut done = 0;
        while done < tokens {
            let n = chunk.min(tokens - done);
            let mut batch = AppendBatch::new();
            cache.append_tokens(ctx, &mut batch, seq, &vec![0; n])?;
            cache.write_layer(ctx, 0, &batch, &k, &v, SourceDtype::F32)?;
            done += n;
        }
    }
    ctx.wait()
}
