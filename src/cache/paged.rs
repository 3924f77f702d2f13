//! [`PagedKvCache`]: the block allocator and the GPU block pools of every layer, kept in step.
//!
//! Appends follow a plan/run split: [`PagedKvCache::append_tokens`] allocates the slots of one
//! sequence's new tokens (atomically: on error nothing changes) and performs any copy-on-write
//! on every layer; [`PagedKvCache::write_layer`] then writes a layer's new K/V rows of every
//! sequence in the batch with one `append_kv` dispatch per pool buffer (one submission).
//! [`AppendBatch::encode`] records the same into a caller's pass, and
//! [`AppendPlan`](super::append_plan::AppendPlan) does it every step without creating anything.

use super::allocator::{AllocatorConfig, BlockAllocator, BlockId, SeqId, SwappedSeq};
use std::cell::OnceCell;
use std::sync::atomic::{AtomicU64, Ordering};

use super::append_kv::{prepare_rows, AppendRows, SourceDtype};
use super::append_plan::{check_io, AppendIo};
use super::copy_blocks::encode_copy_blocks;
use super::pool::{BlockPool, LayerPools, PoolLayout};
use super::scales::CacheScales;
use super::telemetry::Telemetry;
use crate::gpu::Context;
use crate::quant::{decode_rows, EncodedRows, KvDtype};
use crate::{Error, Result};

/// What a paged cache holds: model shape, storage formats, block size.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedKvConfig {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads per layer.
    pub num_kv_heads: usize,
    /// Head dim of K.
    pub head_dim_k: usize,
    /// Head dim of V.
    pub head_dim_v: usize,
    /// Storage format of K.
    pub k_dtype: KvDtype,
    /// Storage format of V.
    pub v_dtype: KvDtype,
    /// Scales of K (quantized formats; [`CacheScales::PerRow`] otherwise).
    pub k_scales: CacheScales,
    /// Scales of V.
    pub v_scales: CacheScales,
    /// Token slots per block: a power of two from 1 to 256 (default 16).
    pub block_size: usize,
    /// Share full blocks of identical prompt prefixes.
    pub prefix_caching: bool,
    /// Identifies the model whose KV this is (checked on snapshot import).
    pub model_id: String,
}

impl PagedKvConfig {
    /// A cache of `layers` layers of `num_kv_heads` heads of dim `head_dim` (K and V) in
    /// `dtype` with per-row scales, block size 16, prefix caching on, no model id.
    pub fn new(layers: usize, num_kv_heads: usize, head_dim: usize, dtype: KvDtype) -> Self {
        Self {
            layers,
            num_kv_heads,
            head_dim_k: head_dim,
            head_dim_v: head_dim,
            k_dtype: dtype,
            v_dtype: dtype,
            k_scales: CacheScales::PerRow,
            v_scales: CacheScales::PerRow,
            block_size: 16,
            prefix_caching: true,
            model_id: String::new(),
        }
    }

    /// Layout of the K pools (of layer 0: the layers differ at most in their per-tensor scale).
    pub fn k_layout(&self) -> PoolLayout {
        self.k_layout_of(0)
    }

    /// Layout of the V pools (of layer 0).
    pub fn v_layout(&self) -> PoolLayout {
        self.v_layout_of(0)
    }

    /// Layout of the K pool of `layer`.
    pub fn k_layout_of(&self, layer: usize) -> PoolLayout {
        PoolLayout {
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim_k,
            dtype: self.k_dtype,
            block_size: self.block_size,
            scale: self.k_scales.mode(layer),
        }
    }

    /// Layout of the V pool of `layer`.
    pub fn v_layout_of(&self, layer: usize) -> PoolLayout {
        PoolLayout {
            head_dim: self.head_dim_v,
            dtype: self.v_dtype,
            scale: self.v_scales.mode(layer),
            ..self.k_layout_of(layer)
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if self.layers == 0 {
            return Err(Error::InvalidArgument(
                "a cache needs at least one layer".into(),
            ));
        }
        self.k_scales.validate("K", self.k_dtype, self.layers)?;
        self.v_scales.validate("V", self.v_dtype, self.layers)?;
        self.k_layout().validate()?;
        self.v_layout().validate()
    }

    /// GPU bytes of one block across every layer, K and V.
    pub fn bytes_per_block(&self) -> u64 {
        self.layers as u64 * (self.k_layout().block_bytes() + self.v_layout().block_bytes())
    }
}

/// How big to make the pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolSize {
    /// This many blocks (per layer, K and V each).
    Blocks(usize),
    /// As many blocks as fit this many bytes over all layers, K and V.
    Bytes(u64),
}

/// The new tokens of a batch: their slots in batch order (the order of the rows in the source
/// buffers given to [`PagedKvCache::write_layer`]). The GPU arrangement of the rows is built by
/// the first `write_layer` and reused by every later layer.
#[derive(Debug, Clone, Default)]
pub struct AppendBatch {
    slots: Vec<u32>,
    rows: OnceCell<AppendRows>,
}

impl AppendBatch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Global slot of each new row, in batch order.
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Records the batch's rows of layer `io.layer` into `pass` (the K dispatches, then the V
    /// dispatches). The batch's GPU arrangement of the rows is made by its first encode and
    /// reused for every layer; bind groups are made by every call (use
    /// [`AppendPlan`](super::append_plan::AppendPlan) to record warm steps without creating
    /// anything).
    ///
    /// # Errors
    /// Everything is checked and every bind group made before anything is recorded: as
    /// [`AppendPlan::encode`](super::append_plan::AppendPlan::encode) (the layer, the sources'
    /// usage, alignment and size), and [`Error::InvalidArgument`] when a slot lies outside the
    /// cache's pools.
    pub fn encode(
        &self,
        ctx: &Context,
        pass: &mut wgpu::ComputePass<'_>,
        io: &AppendIo<'_>,
    ) -> Result<()> {
        let pools = check_io(ctx, io, self.len())?;
        if self.is_empty() {
            return Ok(());
        }
        // K and V pools share heads, block size and split, so one arrangement serves both and
        // every layer.
        let rows = match self.rows.get() {
            Some(rows) => rows,
            None => {
                let rows = AppendRows::new(ctx, &pools.k, &self.slots)?;
                self.rows.get_or_init(|| rows)
            }
        };
        let mut dispatches = prepare_rows(ctx, &pools.k, io.k.clone(), io.src, rows)?;
        dispatches.extend(prepare_rows(ctx, &pools.v, io.v.clone(), io.src, rows)?);
        for dispatch in &dispatches {
            dispatch.encode(pass);
        }
        Ok(())
    }
}

/// A sequence's KV copied to host memory by [`PagedKvCache::swap_out`].
#[derive(Debug, Clone, PartialEq)]
pub struct SwappedSequence {
    /// The allocator's record (tokens).
    pub record: SwappedSeq,
    /// Per layer, the K and V words of the sequence's blocks in table order.
    pub layers: Vec<(Vec<u32>, Vec<u32>)>,
}

/// A paged KV cache on the GPU.
#[derive(Debug)]
pub struct PagedKvCache {
    /// Unique per cache made in this process (plans check they are used with their cache).
    id: u64,
    config: PagedKvConfig,
    alloc: BlockAllocator,
    layers: Vec<LayerPools>,
}

impl PagedKvCache {
    /// Allocates the pools of every layer.
    pub fn new(ctx: &Context, config: PagedKvConfig, size: PoolSize) -> Result<Self> {
        config.validate()?;
        let num_blocks = match size {
            PoolSize::Blocks(n) => n,
            PoolSize::Bytes(bytes) => (bytes / config.bytes_per_block()) as usize,
        };
        if num_blocks == 0 {
            return Err(Error::InvalidArgument(format!(
                "the pool size gives no block (one block is {} bytes over all layers)",
                config.bytes_per_block()
            )));
        }
        let alloc = BlockAllocator::new(AllocatorConfig {
            num_blocks,
            block_size: config.block_size,
            prefix_caching: config.prefix_caching,
        })?;
        // K and V split at the same block ids, so the kernels bind buffer b of each together.
        let per_buffer = BlockPool::max_blocks_per_buffer(ctx, &config.k_layout())?
            .min(BlockPool::max_blocks_per_buffer(ctx, &config.v_layout())?);
        let pool = |layout, name: String| {
            BlockPool::with_blocks_per_buffer(ctx, layout, num_blocks, per_buffer, &name)
        };
        let layers = (0..config.layers)
            .map(|l| {
                Ok(LayerPools {
                    k: pool(config.k_layout_of(l), format!("k pool {l}"))?,
                    v: pool(config.v_layout_of(l), format!("v pool {l}"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Ok(Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            config,
            alloc,
            layers,
        })
    }

    /// This cache's identity, unique among the caches made in this process (plans made for a
    /// cache check it).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The configuration.
    pub fn config(&self) -> &PagedKvConfig {
        &self.config
    }

    /// The allocator (block tables, free blocks, reservations).
    pub fn allocator(&self) -> &BlockAllocator {
        &self.alloc
    }

    /// The pools of `layer`.
    pub fn layer(&self, layer: usize) -> Result<&LayerPools> {
        self.layers.get(layer).ok_or_else(|| {
            Error::InvalidArgument(format!("layer {layer} of {}", self.layers.len()))
        })
    }

    /// GPU bytes of all pools.
    pub fn pool_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.k.bytes() + l.v.bytes()).sum()
    }

    /// Counters and occupancy.
    pub fn telemetry(&self) -> Telemetry {
        self.alloc.telemetry()
    }

    /// Whether a new sequence of `tokens` tokens fits now.
    pub fn can_admit(&self, tokens: usize) -> bool {
        self.alloc.can_admit(tokens)
    }

    /// Shuffles the free blocks (see [`BlockAllocator::shuffle_free_queue`]), so that later
    /// appends land in physical blocks in scattered order.
    pub fn shuffle_free_blocks(&mut self, seed: u64) {
        self.alloc.shuffle_free_queue(seed);
    }

    /// Sets aside blocks for `tokens` future tokens of `seq`.
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<()> {
        self.alloc.reserve(seq, tokens)
    }

    /// Starts a sequence; returns how many leading tokens of `prompt` the prefix cache already
    /// holds (append the rest).
    pub fn add_sequence(&mut self, seq: SeqId, prompt: &[u32]) -> Result<usize> {
        self.alloc.add_sequence(seq, prompt)
    }

    /// A new sequence `child` sharing every block of `parent` (copy-on-write). Write the rows
    /// of any pending [`AppendBatch`] holding `parent`'s tokens (every layer) first: the fork
    /// shares the blocks as they are on the GPU, and a later copy-on-write copies what is there.
    /// The same holds for [`free`](Self::free) and [`swap_out`](Self::swap_out).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        self.alloc.fork(parent, child)
    }

    /// Ends a sequence; its blocks are free at once.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        self.alloc.free(seq)
    }

    /// The block table of `seq`.
    pub fn block_table(&self, seq: SeqId) -> Result<&[BlockId]> {
        self.alloc.blocks(seq)
    }

    /// Blocks that appending `new` tokens to each sequence of `batch` (`(seq, new)` pairs,
    /// sequences distinct) may take: the blocks the new tokens start, plus one per sequence
    /// whose partial last block is shared (copy-on-write). An upper bound (prefix-cache hits may
    /// take fewer): when it is at most [`BlockAllocator::num_free_blocks`], the appends succeed.
    pub fn blocks_needed(&self, batch: &[(SeqId, usize)]) -> Result<usize> {
        let a = &self.alloc;
        let mut need = 0;
        for &(seq, new) in batch {
            let (len, blocks) = (a.len(seq)?, a.blocks(seq)?);
            need += a.blocks_for(len + new).saturating_sub(blocks.len());
            let shared_tail =
                len % a.block_size() != 0 && blocks.last().is_some_and(|&b| a.refcount(b) > 1);
            need += usize::from(shared_tail);
        }
        Ok(need)
    }

    /// Allocates slots for `tokens` new tokens of `seq` and adds them to `batch`; copy-on-write
    /// copies run on every layer now (one submission for all layers, none without copies). On
    /// error (e.g. [`Error::OutOfBlocks`]) nothing changes.
    pub fn append_tokens(
        &mut self,
        ctx: &Context,
        batch: &mut AppendBatch,
        seq: SeqId,
        tokens: &[u32],
    ) -> Result<()> {
        let plan = self.alloc.append(seq, tokens)?;
        if !plan.copies.is_empty() {
            let mut encoder = ctx.encoder("copy-on-write");
            for layer in &self.layers {
                encode_copy_blocks(ctx, &mut encoder, &layer.k, &plan.copies)?;
                encode_copy_blocks(ctx, &mut encoder, &layer.v, &plan.copies)?;
            }
            ctx.submit("copy-on-write", encoder)?;
        }
        batch.slots.extend_from_slice(&plan.slots);
        batch.rows = OnceCell::new();
        Ok(())
    }

    /// Writes one layer's new rows for `batch`: `k` is `[batch.len(), Hkv, head_dim_k]` and `v`
    /// `[batch.len(), Hkv, head_dim_v]`, both in `src`. One submission (none for an empty
    /// batch): [`AppendBatch::encode`] into a pass of its own.
    ///
    /// # Errors
    /// As [`AppendBatch::encode`]; nothing is submitted on error.
    pub fn write_layer(
        &self,
        ctx: &Context,
        layer: usize,
        batch: &AppendBatch,
        k: &wgpu::Buffer,
        v: &wgpu::Buffer,
        src: SourceDtype,
    ) -> Result<()> {
        let io = AppendIo {
            cache: self,
            layer,
            k: k.as_entire_buffer_binding(),
            v: v.as_entire_buffer_binding(),
            src,
        };
        if batch.is_empty() {
            check_io(ctx, &io, 0)?;
            return Ok(());
        }
        ctx.run_pass("write_layer", |pass| batch.encode(ctx, pass, &io))?;
        Ok(())
    }

    /// Appends `tokens` to `seq` with their K/V given on the host, per layer (`k[layer]` is
    /// `[tokens.len(), Hkv, head_dim_k]` f32), uploaded in chunks that fit one storage binding.
    /// Checks the shapes before allocating anything.
    pub fn append_host(
        &mut self,
        ctx: &Context,
        seq: SeqId,
        tokens: &[u32],
        k: &[Vec<f32>],
        v: &[Vec<f32>],
    ) -> Result<()> {
        let c = self.config.clone();
        for (what, data, dim) in [("k", k, c.head_dim_k), ("v", v, c.head_dim_v)] {
            if data.len() != c.layers {
                return Err(Error::ShapeMismatch {
                    what: "layers of new K/V rows",
                    expected: c.layers,
                    got: data.len(),
                });
            }
            let want = tokens.len() * c.num_kv_heads * dim;
            if let Some(bad) = data.iter().find(|d| d.len() != want) {
                return Err(Error::ShapeMismatch {
                    what: if what == "k" {
                        "new K rows"
                    } else {
                        "new V rows"
                    },
                    expected: want,
                    got: bad.len(),
                });
            }
        }
        let mut batch = AppendBatch::new();
        self.append_tokens(ctx, &mut batch, seq, tokens)?;
        // Upload in chunks whose rows fit one storage binding; arrange each chunk's rows once.
        let row_bytes = 4 * c.num_kv_heads * c.head_dim_k.max(c.head_dim_v);
        let binding = ctx.device.limits().max_storage_buffer_binding_size as usize;
        let per_chunk = (binding / row_bytes).max(1);
        let (kr, vr) = (c.num_kv_heads * c.head_dim_k, c.num_kv_heads * c.head_dim_v);
        let chunks = batch
            .slots
            .chunks(per_chunk)
            .map(|slots| AppendRows::new(ctx, &self.layers[0].k, slots))
            .collect::<Result<Vec<_>>>()?;
        // One submission per layer: every chunk's K and V rows.
        for (layer, pools) in self.layers.iter().enumerate() {
            let mut dispatches = Vec::new();
            for (i, rows) in chunks.iter().enumerate() {
                let start = i * per_chunk;
                let end = (start + per_chunk).min(batch.slots.len());
                let kb = ctx.upload("new k", &k[layer][start * kr..end * kr])?;
                let vb = ctx.upload("new v", &v[layer][start * vr..end * vr])?;
                let f32 = SourceDtype::F32;
                dispatches.extend(prepare_rows(
                    ctx,
                    &pools.k,
                    kb.as_entire_buffer_binding(),
                    f32,
                    rows,
                )?);
                dispatches.extend(prepare_rows(
                    ctx,
                    &pools.v,
                    vb.as_entire_buffer_binding(),
                    f32,
                    rows,
                )?);
            }
            if !dispatches.is_empty() {
                ctx.run_pass("append_host", |pass| {
                    dispatches.iter().for_each(|d| d.encode(pass));
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// The stored rows of `seq` in `layer`, in token order, K and V: values `[len, Hkv, words
    /// per row]` and scale words `[len, Hkv, scale words per row]` (gathered through the block
    /// table), with the pool's scale mode (for per-tensor FP8, the layer's scale).
    pub fn read_rows(
        &self,
        ctx: &Context,
        seq: SeqId,
        layer: usize,
    ) -> Result<(EncodedRows, EncodedRows)> {
        pollster::block_on(self.read_rows_async(ctx, seq, layer))
    }

    /// [`read_rows`](Self::read_rows) without blocking: the form to await in the browser.
    pub async fn read_rows_async(
        &self,
        ctx: &Context,
        seq: SeqId,
        layer: usize,
    ) -> Result<(EncodedRows, EncodedRows)> {
        let blocks = self.alloc.blocks(seq)?.to_vec();
        let len = self.alloc.len(seq)?;
        let pools = self.layer(layer)?;
        let rows = |pool: &BlockPool, words: Vec<u32>| {
            let (words, scales) = blocks_to_rows(pool.layout(), &words, len);
            let l = pool.layout();
            EncodedRows {
                dtype: l.dtype,
                head_dim: l.head_dim,
                scale_mode: l.scale,
                words,
                scales,
            }
        };
        let k = pools.k.read_blocks_async(ctx, &blocks).await?;
        let v = pools.v.read_blocks_async(ctx, &blocks).await?;
        Ok((rows(&pools.k, k), rows(&pools.v, v)))
    }

    /// The stored value words of `seq`'s rows in `layer`, in token order (see
    /// [`read_rows`](Self::read_rows), which also returns the scales).
    pub fn read_words(
        &self,
        ctx: &Context,
        seq: SeqId,
        layer: usize,
    ) -> Result<(Vec<u32>, Vec<u32>)> {
        let (k, v) = self.read_rows(ctx, seq, layer)?;
        Ok((k.words, v.words))
    }

    /// `seq`'s K and V of `layer` in token order, decoded to f32 exactly as the kernels read them.
    pub fn read_f32(
        &self,
        ctx: &Context,
        seq: SeqId,
        layer: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (k, v) = self.read_rows(ctx, seq, layer)?;
        Ok((decode_rows(&k)?, decode_rows(&v)?))
    }

    /// Copies `seq`'s blocks to host memory and releases them.
    pub fn swap_out(&mut self, ctx: &Context, seq: SeqId) -> Result<SwappedSequence> {
        let blocks = self.alloc.blocks(seq)?.to_vec();
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok((
                    l.k.read_blocks(ctx, &blocks)?,
                    l.v.read_blocks(ctx, &blocks)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let record = self.alloc.swap_out(seq)?;
        Ok(SwappedSequence { record, layers })
    }

    /// Brings a swapped-out sequence back (into possibly different blocks), bit for bit.
    pub fn swap_in(&mut self, ctx: &Context, seq: SeqId, swapped: &SwappedSequence) -> Result<()> {
        if swapped.layers.len() != self.layers.len() {
            return Err(Error::ShapeMismatch {
                what: "layers of a swapped sequence",
                expected: self.layers.len(),
                got: swapped.layers.len(),
            });
        }
        let n = self.alloc.blocks_for(swapped.record.tokens.len());
        for (k, v) in &swapped.layers {
            let (kw, vw) = (
                self.config.k_layout().block_words(),
                self.config.v_layout().block_words(),
            );
            if k.len() != n * kw || v.len() != n * vw {
                return Err(Error::InvalidArgument(
                    "swapped data does not match this cache's block layout".into(),
                ));
            }
        }
        let blocks = self.alloc.swap_in(seq, &swapped.record)?;
        for (pools, (k, v)) in self.layers.iter().zip(&swapped.layers) {
            pools.k.write_blocks(ctx, &blocks, k)?;
            pools.v.write_blocks(ctx, &blocks, v)?;
        }
        Ok(())
    }

    /// Writes `rows` (per layer, K and V, token order: values `[len, Hkv, words per row]` and
    /// scale words `[len, Hkv, scale words per row]`) into the blocks of a new sequence `seq`
    /// holding `tokens`. Used by snapshot import.
    pub(crate) fn insert_rows(
        &mut self,
        ctx: &Context,
        seq: SeqId,
        tokens: &[u32],
        rows: &[(RowWords, RowWords)],
    ) -> Result<()> {
        self.alloc.add_sequence(seq, &[])?;
        let plan = match self.alloc.append(seq, tokens) {
            Ok(plan) => plan,
            Err(e) => {
                self.alloc.free(seq)?;
                return Err(e);
            }
        };
        let blocks = self.alloc.blocks(seq)?.to_vec();
        debug_assert!(plan.copies.is_empty());
        for (pools, (k, v)) in self.layers.iter().zip(rows) {
            pools.k.write_blocks(
                ctx,
                &blocks,
                &rows_to_blocks(pools.k.layout(), k, tokens.len()),
            )?;
            pools.v.write_blocks(
                ctx,
                &blocks,
                &rows_to_blocks(pools.v.layout(), v, tokens.len()),
            )?;
        }
        Ok(())
    }
}

/// One tensor's rows in token order: value words and scale words.
pub(crate) type RowWords = (Vec<u32>, Vec<u32>);

/// Token-order values `[len, Hkv, wpr]` and scales `[len, Hkv, spr]` from block-order words (the
/// sequence's blocks in table order, each values then scales).
fn blocks_to_rows(layout: &PoolLayout, words: &[u32], len: usize) -> RowWords {
    let (bs, wpr, spr, bw) = (
        layout.block_size,
        layout.words_per_row(),
        layout.scale_words_per_row(),
        layout.block_words(),
    );
    let mut rows = Vec::with_capacity(len * layout.num_kv_heads * wpr);
    let mut scales = Vec::with_capacity(len * layout.num_kv_heads * spr);
    for t in 0..len {
        for h in 0..layout.num_kv_heads {
            let block = (t / bs) * bw;
            let at = block + layout.row_in_block(h, t % bs);
            rows.extend_from_slice(&words[at..at + wpr]);
            let at = block + layout.scales_in_block(h, t % bs);
            scales.extend_from_slice(&words[at..at + spr]);
        }
    }
    (rows, scales)
}

/// The inverse of [`blocks_to_rows`]: `ceil(len / block_size)` blocks, unused slots zero.
fn rows_to_blocks(layout: &PoolLayout, rows: &RowWords, len: usize) -> Vec<u32> {
    let (bs, wpr, spr, bw) = (
        layout.block_size,
        layout.words_per_row(),
        layout.scale_words_per_row(),
        layout.block_words(),
    );
    let mut words = vec![0u32; len.div_ceil(bs) * bw];
    for t in 0..len {
        for h in 0..layout.num_kv_heads {
            let block = (t / bs) * bw;
            let at = block + layout.row_in_block(h, t % bs);
            let src = (t * layout.num_kv_heads + h) * wpr;
            words[at..at + wpr].copy_from_slice(&rows.0[src..src + wpr]);
            let at = block + layout.scales_in_block(h, t % bs);
            let src = (t * layout.num_kv_heads + h) * spr;
            words[at..at + spr].copy_from_slice(&rows.1[src..src + spr]);
        }
    }
    words
}
