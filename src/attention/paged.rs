//! Attention over the paged cache: decode (`len_q == 1`) and chunked prefill (`len_q >= 1`) in
//! one kernel family, with split-K over fixed token ranges and pool buffers, merged by
//! (o, lse). Plan once per batch from the block tables, run per layer.

use super::{AttentionOptions, AttentionShape};
use crate::cache::allocator::SeqId;
use crate::cache::paged::PagedKvCache;
use crate::gpu::Context;
use crate::reference::AttentionOutput;
use crate::shader::Precision;
use crate::{Error, Result};

/// One sequence of a batch: its queries are its last `len_q` cached tokens (bottom-right
/// alignment: `len_k` is the sequence's length in the cache, so append the chunk's K/V first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedQuery {
    /// The sequence.
    pub seq: SeqId,
    /// Query tokens of this sequence in the batch (1 for decode).
    pub len_q: usize,
}

/// What to compute: which layer, which sequences, the shape and options, the kernel variant.
#[derive(Debug, Clone, Copy)]
pub struct PagedAttentionArgs<'a> {
    /// Layer of the cache to attend over.
    pub layer: usize,
    /// The sequences and their query counts, in the order of the query rows.
    pub batch: &'a [PagedQuery],
    /// Heads and head dims (KV heads and dims must match the cache).
    pub shape: AttentionShape,
    /// Mask and score options.
    pub options: &'a AttentionOptions,
    /// Kernel variant; [`Precision::F16`] needs `SHADER_F16`.
    pub precision: Precision,
}

/// Runs attention over `cache` with host queries `q` (`[total_q, Hq, d_qk]`, rows in batch
/// order) and reads `out` (`[total_q, Hq, d_v]`) and `lse` (`[total_q, Hq]`) back.
pub fn paged_attention_host(
    ctx: &Context,
    cache: &PagedKvCache,
    args: &PagedAttentionArgs,
    q: &[f32],
) -> Result<AttentionOutput> {
    let _ = (ctx, cache, args, q);
    Err(Error::InvalidArgument("paged attention is not implemented yet".into()))
}
