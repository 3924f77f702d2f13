//! MLA's latent paged cache: per token and layer the latent `c_kv` (`rank` values, any
//! [`KvDtype`]) and the rotated RoPE key `k_pe` (`d_rope` values, f32, f16 or bf16, since RoPE
//! values are sensitive to rounding), in the same block allocator, block tables and pools as
//! the ordinary cache.
//!
//! An [`MlaCache`] is a [`PagedKvCache`] of one KV head whose "K" pools hold `c_kv` and whose
//! "V" pools hold `k_pe`; the MLA kernels read it as such (a key is `[c_kv ; k_pe]`, a value is
//! `c_kv`). Allocation, prefix caching, forks, swaps and snapshots are the ordinary cache's:
//! reach them through [`MlaCache::cache`] and [`MlaCache::cache_mut`].

use crate::cache::allocator::SeqId;
use crate::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use crate::cache::scales::CacheScales;
use crate::gpu::Context;
use crate::quant::KvDtype;
use crate::{Error, Result};

/// The shape and formats of a latent cache.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaCacheConfig {
    /// Transformer layers.
    pub layers: usize,
    /// Latent width (`kv_lora_rank`, DeepSeek-V2: 512).
    pub rank: usize,
    /// RoPE key dims (`qk_rope_head_dim`, DeepSeek-V2: 64).
    pub d_rope: usize,
    /// Storage format of the latent: any [`KvDtype`].
    pub latent_dtype: KvDtype,
    /// Scales of a quantized latent (per row, or per-tensor FP8 scales).
    pub latent_scales: CacheScales,
    /// Storage format of the RoPE keys: f32, f16 or bf16.
    pub rope_dtype: KvDtype,
    /// Token slots per block: a power of two from 1 to 256 (default 64, as FlashMLA).
    pub block_size: usize,
    /// Share full blocks of identical prompt prefixes.
    pub prefix_caching: bool,
    /// Identifies the model (checked on snapshot import).
    pub model_id: String,
}

impl MlaCacheConfig {
    /// `layers` layers of a `rank`-wide latent in `latent_dtype` with per-row scales and
    /// `d_rope`-dim RoPE keys kept 16-bit (f32 when the latent is f32, bf16 when it is bf16,
    /// f16 otherwise), block size 64, prefix caching on.
    pub fn new(layers: usize, rank: usize, d_rope: usize, latent_dtype: KvDtype) -> Self {
        let rope_dtype = match latent_dtype {
            KvDtype::F32 => KvDtype::F32,
            KvDtype::Bf16 => KvDtype::Bf16,
            _ => KvDtype::F16,
        };
        Self {
            layers,
            rank,
            d_rope,
            latent_dtype,
            latent_scales: CacheScales::PerRow,
            rope_dtype,
            block_size: 64,
            prefix_caching: true,
            model_id: String::new(),
        }
    }

    /// The ordinary cache configuration that stores this latent cache.
    pub fn paged(&self) -> PagedKvConfig {
        PagedKvConfig {
            layers: self.layers,
            num_kv_heads: 1,
            head_dim_k: self.rank,
            head_dim_v: self.d_rope,
            k_dtype: self.latent_dtype,
            v_dtype: self.rope_dtype,
            k_scales: self.latent_scales.clone(),
            v_scales: CacheScales::PerRow,
            block_size: self.block_size,
            prefix_caching: self.prefix_caching,
            model_id: self.model_id.clone(),
        }
    }

    /// Checks every field: the RoPE format, and what the ordinary cache checks (the dims suit
    /// their formats, the scales the latent format).
    pub fn validate(&self) -> Result<()> {
        if !matches!(self.rope_dtype, KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16) {
            return Err(Error::InvalidArgument(format!(
                "the RoPE keys are kept in f32, f16 or bf16, not {}",
                self.rope_dtype
            )));
        }
        self.paged().validate()
    }

    /// Bytes one token takes in the cache over every layer, scales included.
    pub fn bytes_per_token(&self) -> u64 {
        self.paged().bytes_per_block() / self.block_size as u64
    }
}

/// A latent paged cache on the GPU.
#[derive(Debug)]
pub struct MlaCache {
    config: MlaCacheConfig,
    cache: PagedKvCache,
}

impl MlaCache {
    /// Allocates the pools of every layer (`size` counts latent and RoPE pools together).
    pub fn new(ctx: &Context, config: MlaCacheConfig, size: PoolSize) -> Result<Self> {
        config.validate()?;
        let cache = PagedKvCache::new(ctx, config.paged(), size)?;
        Ok(Self { config, cache })
    }

    /// The configuration.
    pub fn config(&self) -> &MlaCacheConfig {
        &self.config
    }

    /// The underlying cache (allocator, block tables, pools).
    pub fn cache(&self) -> &PagedKvCache {
        &self.cache
    }

    /// The underlying cache, for sequence management (add, fork, free, swap).
    pub fn cache_mut(&mut self) -> &mut PagedKvCache {
        &mut self.cache
    }

    /// Appends `tokens` to `seq` with, per layer, their latent rows `c_kv[layer]`
    /// (`[tokens.len(), rank]` f32) and rotated RoPE keys `k_pe[layer]`
    /// (`[tokens.len(), d_rope]`), quantized on the GPU as they are written. Shapes are checked
    /// before anything is allocated.
    pub fn append_host(
        &mut self,
        ctx: &Context,
        seq: SeqId,
        tokens: &[u32],
        c_kv: &[Vec<f32>],
        k_pe: &[Vec<f32>],
    ) -> Result<()> {
        self.cache.append_host(ctx, seq, tokens, c_kv, k_pe)
    }
}
