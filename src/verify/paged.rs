//! Attention over a paged cache from a problem in the FlashAttention varlen layout: the host
//! checks and the run that `kvattn run attention`, the verification grid and the quality table
//! share.

use crate::attention::paged::{self, paged_attention_host_async, PagedAttentionArgs, PagedQuery};
use crate::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use crate::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use crate::cache::scales::CacheScales;
use crate::gpu::Context;
use crate::quant::{KvDtype, ScaleMode};
use crate::reference::AttentionOutput;
use crate::shader::Precision;
use crate::{Error, Result};

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// Checks a block size: a power of two from 1 to 256.
pub fn check_block_size(block_size: usize) -> Result<()> {
    if block_size.is_power_of_two() && block_size <= 256 {
        Ok(())
    } else {
        Err(invalid(format!(
            "block size {block_size} is not a power of two from 1 to 256"
        )))
    }
}

/// How to lay a problem out in the paged cache and which kernel variant to run.
#[derive(Debug, Clone, Copy)]
pub struct PagedSetup {
    /// Storage format of K.
    pub k_dtype: KvDtype,
    /// Storage format of V.
    pub v_dtype: KvDtype,
    /// Static per-tensor FP8 scale of K (vLLM's `k_scale`); `None`: a scale per token row.
    pub k_scale: Option<f32>,
    /// Static per-tensor FP8 scale of V (`v_scale`); `None`: a scale per token row.
    pub v_scale: Option<f32>,
    /// Tokens per block.
    pub block_size: usize,
    /// Kernel precision.
    pub precision: Precision,
    /// Seed of the free-block shuffle.
    pub seed: u64,
}

impl PagedSetup {
    /// The scale mode of K.
    pub fn k_mode(&self) -> ScaleMode {
        self.k_scale.map_or(ScaleMode::PerRow, ScaleMode::PerTensor)
    }

    /// The scale mode of V.
    pub fn v_mode(&self) -> ScaleMode {
        self.v_scale.map_or(ScaleMode::PerRow, ScaleMode::PerTensor)
    }
}

/// The cache scales of a scale mode.
pub fn cache_scales(mode: ScaleMode) -> CacheScales {
    match mode {
        ScaleMode::PerTensor(s) => CacheScales::PerTensor(vec![s]),
        ScaleMode::PerRow => CacheScales::PerRow,
    }
}

/// Checks the setup alone: the block size, the storage formats the paged kernels read, and
/// per-tensor scales (FP8 only, positive normal with a normal reciprocal).
pub fn check_setup(setup: &PagedSetup) -> Result<()> {
    check_block_size(setup.block_size)?;
    for (name, key, dtype, mode) in [
        ("K", "k_scale", setup.k_dtype, setup.k_mode()),
        ("V", "v_scale", setup.v_dtype, setup.v_mode()),
    ] {
        if !paged::SUPPORTED.contains(&dtype) {
            return Err(invalid(format!(
                "{name} storage {dtype} is not read by the paged attention kernels"
            )));
        }
        dtype.check_scale_mode(mode).map_err(|e| match e {
            Error::InvalidArgument(m) => invalid(format!("metadata {key} ({name} storage): {m}")),
            other => other,
        })?;
    }
    Ok(())
}

/// Host checks of a paged attention problem: the batch itself ([`RaggedBatch::validate`]),
/// head dims for the storage formats, formats and scales the kernels read, the block size, and
/// `len_q <= len_k` (the queries of a sequence are its last `len_q` cached tokens).
pub fn check_paged(
    batch: &RaggedBatch,
    shape: &AttentionShape,
    options: &AttentionOptions,
    setup: &PagedSetup,
) -> Result<()> {
    check_setup(setup)?;
    setup.k_dtype.check_head_dim(shape.head_dim_qk)?;
    setup.v_dtype.check_head_dim(shape.head_dim_v)?;
    batch.validate(shape, options)?;
    for seq in 0..batch.num_seqs() {
        let (len_q, len_k) = batch.seq_lens(seq);
        if len_q > len_k {
            return Err(invalid(format!(
                "sequence {seq} has len_q {len_q} > len_k {len_k}; the paged kernels take a \
                 sequence's queries as its last len_q cached tokens"
            )));
        }
    }
    Ok(())
}

/// Writes the batch's K/V into a new paged cache (one layer, prefix caching off, free blocks
/// shuffled so physical blocks come in scattered order; quantized formats are encoded on the
/// GPU as they are written) and runs [`paged_attention_host`](paged::paged_attention_host) with every sequence's `len_q`
/// queries. Call [`check_paged`] first.
pub fn run_paged(
    ctx: &Context,
    batch: &RaggedBatch,
    shape: &AttentionShape,
    options: &AttentionOptions,
    setup: &PagedSetup,
) -> Result<AttentionOutput> {
    pollster::block_on(run_paged_async(ctx, batch, shape, options, setup))
}

/// [`run_paged`] without blocking: the form to await in the browser.
pub async fn run_paged_async(
    ctx: &Context,
    batch: &RaggedBatch<'_>,
    shape: &AttentionShape,
    options: &AttentionOptions,
    setup: &PagedSetup,
) -> Result<AttentionOutput> {
    if setup.precision == Precision::F16 && !ctx.caps().shader_f16 {
        return Err(Error::MissingFeature("shader-f16"));
    }
    let config = PagedKvConfig {
        layers: 1,
        num_kv_heads: shape.num_kv_heads,
        head_dim_k: shape.head_dim_qk,
        head_dim_v: shape.head_dim_v,
        k_dtype: setup.k_dtype,
        v_dtype: setup.v_dtype,
        k_scales: cache_scales(setup.k_mode()),
        v_scales: cache_scales(setup.v_mode()),
        block_size: setup.block_size,
        prefix_caching: false,
        model_id: String::new(),
    };
    let needed: usize = (0..batch.num_seqs())
        .map(|s| batch.seq_lens(s).1.div_ceil(setup.block_size))
        .sum();
    // Spare blocks, so the shuffled blocks come from a pool larger than the batch.
    let blocks = needed + needed / 2 + 1;
    let mut cache = PagedKvCache::new(ctx, config, PoolSize::Blocks(blocks))?;
    cache.shuffle_free_blocks(setup.seed);
    let (hkv, dk, dv) = (shape.num_kv_heads, shape.head_dim_qk, shape.head_dim_v);
    let mut queries = Vec::with_capacity(batch.num_seqs());
    for s in 0..batch.num_seqs() {
        let (q_rows, k_rows) = batch.token_ranges(s);
        let seq = s as u64;
        cache.add_sequence(seq, &[])?;
        let tokens: Vec<u32> = (0..k_rows.len() as u32).collect();
        let k = batch.k[k_rows.start * hkv * dk..k_rows.end * hkv * dk].to_vec();
        let v = batch.v[k_rows.start * hkv * dv..k_rows.end * hkv * dv].to_vec();
        cache.append_host(ctx, seq, &tokens, &[k], &[v])?;
        queries.push(PagedQuery {
            seq,
            len_q: q_rows.len(),
        });
    }
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &queries,
        shape: *shape,
        options,
        precision: setup.precision,
    };
    paged_attention_host_async(ctx, &cache, &args, batch.q).await
}
