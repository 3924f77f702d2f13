//! A Llama-family decoder on kvattn's kernels: token embedding, RMSNorm, matrix products,
//! RoPE, `append_kv` into a [`PagedKvCache`], paged attention, SwiGLU MLP, logits. Every
//! per-token computation runs on the GPU; the host plans the step and reads the logits back.
//!
//! Each matrix is `[out, in]` row-major (the GGUF / PyTorch layout: `y = W x`), on the GPU in
//! f32 or in its GGUF block format ([`super::weights`]). One [`Decoder::forward`] step takes,
//! per sequence, its new tokens (a prompt chunk, or one token when decoding), appends their K/V
//! to the cache at positions following what the sequence already holds, and returns the logits
//! of each sequence's last new token.
//! It also counts the step's FLOPs (a multiply-add is 2): the matrix products and attention's
//! two products over the keys each query sees; the elementwise work (norms, RoPE, SwiGLU,
//! softmax) is left out, as usual.
//!
//! A step is one submission ([`Decoder::encode_step`] records it into one compute pass of an
//! encoder, or a pass per op for profiling, [`Decoder::set_pass_per_op`];
//! [`Decoder::forward_with`] submits it and reads the logits back). The decoder keeps
//! what a step records (prepared kernels with their bind groups, the append and attention
//! plans, the logits buffer and its staging) for the last two step shapes, so a decode step
//! with the batch shape of the previous one creates no buffer and no bind group.

mod config;
mod record;
mod scratch;
mod step;
mod upload;

pub use config::{DecoderConfig, HostLayer, HostWeights};

use crate::attention::paged::PagedQuery;
use crate::cache::allocator::SeqId;
use crate::cache::paged::{AppendBatch, PagedKvCache};
use crate::decoder::ops::embed::embed_host_check;
use crate::decoder::passes::StepPasses;
use crate::decoder::weights::GpuMatrix;
use crate::gpu::{Context, Readback};
use crate::rope::RopeTables;
use crate::shader::Precision;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use step::{attention_flops, blocks_capacity, StepCache, StepShape, MAX_SHAPES};
use upload::GpuLayer;

use crate::{Error, Result};

/// Which tokens of a step get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Logits {
    /// Each sequence's last new token (generation).
    #[default]
    Last,
    /// Every new token (scoring a text, quality measurements).
    All,
}

/// What one step returns.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// Logits `[rows, vocab]`, in batch order: each sequence's last new token
    /// ([`Logits::Last`]) or every new token ([`Logits::All`]).
    pub logits: Vec<f32>,
    /// FLOPs of the step (matrix products and attention; multiply-add = 2).
    pub flops: u64,
}

/// A step recorded by [`Decoder::encode_step`]: its logits, once the caller has submitted the
/// encoder.
#[derive(Debug)]
pub struct PendingStep {
    readback: Arc<Readback>,
    len: usize,
    flops: u64,
}

impl PendingStep {
    /// The step's logits and FLOPs once submission `index` (the one that carried the step's
    /// encoder) has run; reports the errors of every submission so far first.
    pub async fn read_async(
        self,
        ctx: &Context,
        index: wgpu::SubmissionIndex,
    ) -> Result<StepOutput> {
        let logits = self.readback.read_async(ctx, index, self.len).await?;
        Ok(StepOutput {
            logits,
            flops: self.flops,
        })
    }

    /// The blocking form of [`read_async`](Self::read_async).
    pub fn read(self, ctx: &Context, index: wgpu::SubmissionIndex) -> Result<StepOutput> {
        pollster::block_on(self.read_async(ctx, index))
    }
}

/// A decoder with its weights on the GPU.
#[derive(Debug)]
pub struct Decoder {
    config: DecoderConfig,
    precision: Precision,
    embed: GpuMatrix,
    layers: Vec<GpuLayer>,
    final_norm: wgpu::Buffer,
    lm_head: Option<GpuMatrix>,
    /// Bytes of every weight on the GPU.
    weight_bytes: u64,
    /// RoPE's turns tables for the queries and the keys (uploaded once).
    rope_q: RopeTables,
    rope_k: RopeTables,
    /// The activations and the prepared steps of the last few step shapes.
    steps: Mutex<StepCache>,
    /// Whether a step records each op in a pass of its own ([`Decoder::set_pass_per_op`]).
    pass_per_op: AtomicBool,
}

impl Decoder {
    /// Records each op of the steps from now on in a compute pass of its own, labelled with
    /// the op's name ([`super::passes::op`]), when `on`; in one pass per step when not (the
    /// default). The results are the same bit for bit; with the steps timed by
    /// [`Context::timed_passes`] the passes say where a step's device time goes (the decoder
    /// example's `--profile-ops`).
    pub fn set_pass_per_op(&self, on: bool) {
        self.pass_per_op.store(on, Ordering::Relaxed);
    }

    /// Whether steps record each op in a pass of its own ([`set_pass_per_op`](Self::set_pass_per_op)).
    pub fn pass_per_op(&self) -> bool {
        self.pass_per_op.load(Ordering::Relaxed)
    }

    /// Bytes of every weight on the GPU (matrices in their block format, norms in f32).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// The model's shape.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// Drops the activations and prepared steps the decoder keeps between steps (they hold
    /// bindings of the caches they ran on, and so those caches' pools, until a step of another
    /// shape replaces them). The next step makes them anew.
    pub fn clear_steps(&self) {
        let mut steps = self.steps.lock().unwrap_or_else(|poisoned| {
            self.steps.clear_poison();
            poisoned.into_inner()
        });
        *steps = StepCache::default();
    }

    /// One step: appends each sequence's new tokens (`batch[i] = (seq, tokens)`, at least one
    /// token each, sequences distinct and already added to `cache`) and returns the logits of
    /// each sequence's last new token. The cache must have this model's layers, KV heads and
    /// head dim. On an allocation error ([`Error::OutOfBlocks`]) nothing is appended.
    pub fn forward(
        &self,
        ctx: &Context,
        cache: &mut PagedKvCache,
        batch: &[(SeqId, &[u32])],
    ) -> Result<StepOutput> {
        self.forward_with(ctx, cache, batch, Logits::Last)
    }

    /// [`forward`](Self::forward) with the logits of the tokens `which` chooses: the step is
    /// recorded by [`encode_step`](Self::encode_step) into one encoder, submitted once, and
    /// only the logits asked for are read back.
    ///
    /// # Errors
    /// As [`encode_step`](Self::encode_step); the errors of the step's submission come back
    /// from its readback.
    pub fn forward_with(
        &self,
        ctx: &Context,
        cache: &mut PagedKvCache,
        batch: &[(SeqId, &[u32])],
        which: Logits,
    ) -> Result<StepOutput> {
        pollster::block_on(self.forward_with_async(ctx, cache, batch, which))
    }

    /// [`forward_with`](Self::forward_with) without blocking: the step's readback is awaited,
    /// so it runs on the browser's main thread.
    pub async fn forward_with_async(
        &self,
        ctx: &Context,
        cache: &mut PagedKvCache,
        batch: &[(SeqId, &[u32])],
        which: Logits,
    ) -> Result<StepOutput> {
        let mut encoder = ctx.encoder("decoder step");
        let pending = self.encode_step(ctx, cache, batch, which, &mut encoder)?;
        let index = ctx.submit("decoder step", encoder)?;
        pending.read_async(ctx, index).await
    }

    /// Records one step (see [`forward_with`](Self::forward_with)) into `encoder`, for the
    /// caller to submit with [`Context::submit`] (possibly with work of its own) and then read
    /// with [`PendingStep::read`]. Read a step's logits before recording the next step of the
    /// same shape (they share the staging buffer).
    ///
    /// The step goes into one compute pass of `encoder`: the embedding, every layer (norm, Q/K/V products
    /// and their biases, RoPE, the append into the cache, paged attention, output product added
    /// into the residual stream, norm, gate/up products, SwiGLU, down product added into the
    /// residual stream), the final norm and the logits are
    /// recorded, then the logits are copied into a reusable staging buffer. The resources of a step (activations, plans,
    /// bind groups, logits) are kept for the last few step shapes (tokens per sequence, which
    /// logits, the cache), so a step with the shape of an earlier one (a warm decode step)
    /// creates no buffer and no bind group: it writes the token ids, positions and plan
    /// metadata with [`Context::write_buffer`] and records. Copy-on-write block copies of a
    /// forked sequence's shared last block run before the step, in their own submission.
    ///
    /// # Errors
    /// Before anything is allocated or recorded: [`Error::InvalidArgument`] for a cache of
    /// another shape, an empty batch, a sequence without new tokens or twice in the batch, a
    /// token id outside the vocabulary; [`Error::UnknownSequence`]; [`Error::OutOfBlocks`] when
    /// the new tokens' blocks do not fit (nothing is appended then); creation errors of a new
    /// step shape.
    pub fn encode_step(
        &self,
        ctx: &Context,
        cache: &mut PagedKvCache,
        batch: &[(SeqId, &[u32])],
        which: Logits,
        encoder: &mut wgpu::CommandEncoder,
    ) -> Result<PendingStep> {
        let c = self.config;
        self.check_cache(cache)?;
        if batch.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut queries = Vec::with_capacity(batch.len());
        let mut max_blocks = 0;
        let alloc = cache.allocator();
        for (i, &(seq, tokens)) in batch.iter().enumerate() {
            if tokens.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq} has no new token"
                )));
            }
            if batch[..i].iter().any(|b| b.0 == seq) {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq} appears twice in one step"
                )));
            }
            let start = alloc.len(seq)?;
            positions.extend((start..start + tokens.len()).map(|p| p as u32));
            ids.extend_from_slice(tokens);
            queries.push(PagedQuery {
                seq,
                len_q: tokens.len(),
            });
            max_blocks = max_blocks.max(alloc.blocks_for(start + tokens.len()));
        }
        embed_host_check(&ids, c.vocab)?;
        // All or nothing: refuse the step unless every sequence's new blocks fit, then allocate.
        let news: Vec<(SeqId, usize)> = batch.iter().map(|&(s, t)| (s, t.len())).collect();
        let need = cache.blocks_needed(&news)?;
        let free = cache.allocator().num_free_blocks();
        if need > free {
            return Err(Error::OutOfBlocks {
                needed: need,
                available: free,
            });
        }
        let shape = StepShape {
            cache: cache.id(),
            lens: news.iter().map(|&(_, n)| n).collect(),
            which,
        };
        let t = ids.len();
        let rows = shape.rows();

        // The step's resources: found for a known shape, else made now (before the cache
        // changes, so that a failed creation leaves it as it was).
        let mut guard = self.lock_steps();
        let st = &mut *guard;
        self.ensure_scratch(ctx, st, t)?;
        let s = st.scratch.as_ref().expect("made above");
        let pool_blocks = cache.allocator().num_blocks();
        // A step recorded into an encoder that was never submitted leaves its plans waiting for
        // a submission: such a step is made anew rather than refused after the allocation.
        let known = st.steps.iter().position(|p| {
            p.shape == shape && p.attention.may_update(ctx) && p.append.may_update(ctx)
        });
        st.steps.retain(|p| p.shape != shape || known.is_some());
        let mut step = match known {
            Some(i) => st.steps.remove(i),
            None => {
                let blocks = blocks_capacity(max_blocks, pool_blocks);
                self.prepare_step(ctx, cache, shape, s, blocks)?
            }
        };
        if step.attention.capacity().max_blocks_per_seq < max_blocks {
            let blocks = blocks_capacity(max_blocks, pool_blocks);
            step.attention = self.attention_plan(ctx, cache, &step.shape, blocks)?;
        }

        // Allocate the slots (and run copy-on-write copies), write the step's ids, positions
        // and plan metadata, record everything into one pass and submit it once.
        let mut append = AppendBatch::new();
        for &(seq, tokens) in batch {
            cache.append_tokens(ctx, &mut append, seq, tokens)?;
        }
        ctx.write_buffer(&s.ids, 0, bytemuck::cast_slice(&ids))?;
        ctx.write_buffer(&s.positions, 0, bytemuck::cast_slice(&positions))?;
        step.append.update(ctx, cache, &append)?;
        step.attention.update(ctx, cache, &queries)?;
        {
            // The passes end when `passes` goes out of scope, so the encoder records again.
            let mut passes = StepPasses::new(ctx, encoder, self.pass_per_op());
            self.encode_layers(ctx, &mut passes, cache, &step, s)?;
        }
        let bytes = (rows * c.vocab * 4) as u64;
        step.readback.encode_copy(encoder, &step.logits, 0, bytes)?;
        let pending = PendingStep {
            readback: Arc::clone(&step.readback),
            len: rows * c.vocab,
            flops: step.matmul_flops + c.layers as u64 * attention_flops(&c, &positions),
        };
        // Keep the shape, most recently used last.
        st.steps.push(step);
        if st.steps.len() > MAX_SHAPES {
            st.steps.remove(0);
        }
        Ok(pending)
    }

    /// [`Error::InvalidArgument`] unless `cache` has the model's layers and KV heads.
    fn check_cache(&self, cache: &PagedKvCache) -> Result<()> {
        let c = self.config;
        let kc = cache.config();
        if kc.layers != c.layers || kc.num_kv_heads != c.n_kv_heads || kc.head_dim_k != c.head_dim {
            return Err(Error::InvalidArgument(format!(
                "the cache ({} layers, {} KV heads of {}) does not fit the model ({} layers, {} \
                 KV heads of {})",
                kc.layers, kc.num_kv_heads, kc.head_dim_k, c.layers, c.n_kv_heads, c.head_dim
            )));
        }
        Ok(())
    }

    /// Makes ahead of time what a step of `lens` new tokens per sequence (one entry per
    /// sequence) reading the logits `which` records over `cache`, for sequences of up to
    /// `max_len` tokens: the pipelines of its products and element-wise ops (which a driver
    /// may take seconds to compile), its buffers and bind groups. A later step of that shape
    /// finds them ([`encode_step`](Self::encode_step) makes them otherwise), so a generation
    /// can compile its prefill and decode shapes before it times them. The attention and
    /// append plans still bind the step's inputs (and make the pipelines of the kernels its
    /// lengths pick) at the shape's first recording. Changes nothing in the cache.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a cache of another shape, no sequence or a sequence of no
    /// tokens; creation errors.
    pub fn prepare_shape(
        &self,
        ctx: &Context,
        cache: &PagedKvCache,
        lens: &[usize],
        which: Logits,
        max_len: usize,
    ) -> Result<()> {
        self.check_cache(cache)?;
        if lens.is_empty() || lens.contains(&0) {
            return Err(Error::InvalidArgument(format!(
                "a step shape needs sequences of at least one token, not {lens:?}"
            )));
        }
        let shape = StepShape {
            cache: cache.id(),
            lens: lens.to_vec(),
            which,
        };
        let mut guard = self.lock_steps();
        let st = &mut *guard;
        self.ensure_scratch(ctx, st, shape.tokens())?;
        if st.steps.iter().any(|p| p.shape == shape) {
            return Ok(());
        }
        let s = st.scratch.as_ref().expect("made above");
        let alloc = cache.allocator();
        let blocks = blocks_capacity(alloc.blocks_for(max_len.max(1)), alloc.num_blocks());
        let step = self.prepare_step(ctx, cache, shape, s, blocks)?;
        st.steps.push(step);
        if st.steps.len() > MAX_SHAPES {
            st.steps.remove(0);
        }
        Ok(())
    }
}
