//! What a decoder keeps to record a step: the step shapes ([`StepShape`]), the prepared ops,
//! plans and logits buffers of one shape ([`Step`], [`LayerStep`]) and the cache of the last
//! few ([`StepCache`]), with the `impl Decoder` that makes them (`prepare_step`,
//! `attention_plan`) and the step's attention FLOPs.

use super::scratch::{whole, Scratch};
use super::{Decoder, DecoderConfig, Logits};
use crate::attention::paged_plan::{PagedAttentionPlan, PlanCapacity, PlanSpec};
use crate::attention::{AttentionOptions, SPLIT_TOKENS};
use crate::cache::append_plan::AppendPlan;
use crate::cache::paged::PagedKvCache;
use crate::decoder::ops::add::{prepare_bias_add, BiasAddArgs};
use crate::decoder::ops::embed::{prepare_embed, EmbedArgs};
use crate::decoder::ops::rms_norm::{prepare_rms_norm, RmsNormArgs};
use crate::decoder::ops::swiglu::{prepare_swiglu, SwigluArgs};
use crate::decoder::ops::PreparedOp;
use crate::decoder::weights::{GpuMatrix, LayerMatrix, Product};
use crate::gpu::{Context, Readback};
use crate::rope::{PreparedRope, Rope, RopeArgs};
use std::sync::Arc;

use crate::Result;

/// Step shapes whose prepared resources a decoder keeps (e.g. a prefill and a decode shape);
/// the least recently used one is dropped for a new shape.
pub(super) const MAX_SHAPES: usize = 2;

/// What a step's prepared resources are made for: the cache, each sequence's new tokens (in
/// batch order) and which logits are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StepShape {
    pub(super) cache: u64,
    pub(super) lens: Vec<usize>,
    pub(super) which: Logits,
}

impl StepShape {
    pub(super) fn tokens(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Logit rows the step reads back.
    pub(super) fn rows(&self) -> usize {
        match self.which {
            Logits::Last => self.lens.len(),
            Logits::All => self.tokens(),
        }
    }
}

/// One layer's prepared ops (those that bind the layer's weights).
#[derive(Debug)]
pub(super) struct LayerStep {
    pub(super) attn_norm: PreparedOp,
    /// The Q, K and V products: one grouped product where the row kernel takes them together
    /// (a decode step of one row on a CPU adapter, `GpuMatrix::prepare_group`), else three.
    pub(super) qkv: Vec<Product>,
    /// The Q, K and V biases' adds (those the layer has), after the three products.
    pub(super) qkv_bias: Vec<PreparedOp>,
    pub(super) o: Product,
    pub(super) ffn_norm: PreparedOp,
    pub(super) gate: Product,
    pub(super) up: Product,
    pub(super) down: Product,
}

/// Everything a step of one shape records, made once: the prepared ops with their bind
/// groups, the attention and append plans, the logits buffer and its readback staging. A warm
/// step of the shape writes its ids, positions and plan metadata and records these: no buffer,
/// no bind group, one submission.
#[derive(Debug)]
pub(super) struct Step {
    pub(super) shape: StepShape,
    pub(super) embed: PreparedOp,
    /// The queries' and keys' rotations: one dispatch ([`Rope::prepare_pair`]).
    pub(super) rope: PreparedRope,
    pub(super) swiglu: PreparedOp,
    pub(super) layers: Vec<LayerStep>,
    pub(super) final_norm: PreparedOp,
    /// `Logits::Last` over several sequences: their last rows gathered into one block, so one
    /// product reads the output projection once (with the indices it gathers by).
    pub(super) gather: Option<(PreparedOp, wgpu::Buffer)>,
    /// The logits: one product for every row ([`Logits::All`]), for the one sequence's last row,
    /// or for the gathered last rows of several sequences.
    pub(super) head: Vec<Product>,
    pub(super) logits: wgpu::Buffer,
    pub(super) readback: Arc<Readback>,
    pub(super) attention: PagedAttentionPlan,
    pub(super) append: AppendPlan,
    /// FLOPs of the step's matrix products.
    pub(super) matmul_flops: u64,
}

/// A decoder's step resources: the shared activations and the prepared steps, most recently
/// used last.
#[derive(Debug, Default)]
pub(super) struct StepCache {
    pub(super) scratch: Option<Scratch>,
    pub(super) steps: Vec<Step>,
}

/// Blocks per sequence an attention plan is made for when a sequence needs `blocks`: room to
/// grow (doubling), within the pool.
pub(super) fn blocks_capacity(blocks: usize, pool_blocks: usize) -> usize {
    (blocks.max(1).next_power_of_two() * 2).min(pool_blocks.max(1))
}

impl Decoder {
    /// The prepared steps, emptied when a panic mid-step poisoned them (a plan may have been
    /// recorded but not submitted: start afresh).
    pub(super) fn lock_steps(&self) -> std::sync::MutexGuard<'_, StepCache> {
        self.steps.lock().unwrap_or_else(|poisoned| {
            self.steps.clear_poison();
            let mut guard = poisoned.into_inner();
            *guard = StepCache::default();
            guard
        })
    }

    /// An attention plan for steps of `shape` over `cache`, for sequences of up to `blocks`
    /// blocks.
    pub(super) fn attention_plan(
        &self,
        ctx: &Context,
        cache: &PagedKvCache,
        shape: &StepShape,
        blocks: usize,
    ) -> Result<PagedAttentionPlan> {
        let options = AttentionOptions::default();
        let spec = PlanSpec {
            shape: self.config.attention_shape(),
            options: &options,
            precision: self.precision,
            split_tokens: SPLIT_TOKENS,
        };
        let capacity = PlanCapacity {
            max_seqs: shape.lens.len(),
            max_q_tokens: shape.tokens(),
            max_blocks_per_seq: blocks,
        };
        PagedAttentionPlan::with_capacity(ctx, cache, &spec, capacity)
    }

    /// Makes everything a step of `shape` records, over the activations `s`.
    pub(super) fn prepare_step(
        &self,
        ctx: &Context,
        cache: &PagedKvCache,
        shape: StepShape,
        s: &Scratch,
        blocks: usize,
    ) -> Result<Step> {
        let c = self.config;
        let (t, d) = (shape.tokens(), c.d_model);
        let flops = std::cell::Cell::new(0u64);
        let counted = |p: Product| {
            flops.set(flops.get() + p.flops());
            p
        };
        let product = |m: &GpuMatrix, x, rows: (usize, usize, usize), y| -> Result<Product> {
            Ok(counted(m.prepare(ctx, x, rows, y)?))
        };
        // The residual adds `x += W in` fused into the O and down products.
        let added = |m: &GpuMatrix, input| -> Result<Product> {
            Ok(counted(m.prepare_added(ctx, input, t, &s.x, &s.proj)?))
        };
        let all = (0, t, 0);
        // One row: Q, K and V in one grouped product where the row kernel takes them.
        let qkv = |q: &GpuMatrix, k: &GpuMatrix, v: &GpuMatrix| -> Result<Vec<Product>> {
            let outputs = [(q, &s.q), (k, &s.k), (v, &s.v)];
            if t == 1 {
                if let Some(p) = GpuMatrix::prepare_group(ctx, &s.h, 0, &outputs)? {
                    return Ok(vec![counted(p)]);
                }
            }
            outputs
                .into_iter()
                .map(|(m, y)| product(m, &s.h, all, y))
                .collect()
        };
        let norm = |weight, out| RmsNormArgs {
            rows: t,
            dim: d,
            eps: c.rms_eps,
            x: &s.x,
            weight,
            out,
        };
        let mut layers = Vec::with_capacity(c.layers);
        for w in &self.layers {
            let m = |which| w.matrix(which);
            let mut qkv_bias = Vec::new();
            for (which, x) in [
                (LayerMatrix::Q, &s.q),
                (LayerMatrix::K, &s.k),
                (LayerMatrix::V, &s.v),
            ] {
                if let Some(bias) = w.bias(which) {
                    let args = BiasAddArgs {
                        rows: t,
                        dim: which.shape(&c).0,
                        x,
                        bias,
                    };
                    qkv_bias.push(prepare_bias_add(ctx, &args)?);
                }
            }
            layers.push(LayerStep {
                attn_norm: prepare_rms_norm(ctx, &norm(&w.attn_norm, &s.h))?,
                qkv: qkv(m(LayerMatrix::Q), m(LayerMatrix::K), m(LayerMatrix::V))?,
                qkv_bias,
                o: added(m(LayerMatrix::O), &s.attn)?,
                ffn_norm: prepare_rms_norm(ctx, &norm(&w.ffn_norm, &s.h))?,
                gate: product(m(LayerMatrix::Gate), &s.h, all, &s.gate)?,
                up: product(m(LayerMatrix::Up), &s.h, all, &s.up)?,
                down: added(m(LayerMatrix::Down), &s.act)?,
            });
        }
        let rows = shape.rows();
        let logits = ctx.filled("logits", rows * c.vocab, crate::gpu::UNWRITTEN)?;
        let head_w = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut head = Vec::new();
        let mut gather = None;
        match shape.which {
            Logits::All => head.push(product(head_w, &s.h, all, &logits)?),
            Logits::Last if shape.lens.len() == 1 => {
                head.push(product(head_w, &s.h, (t - 1, 1, 0), &logits)?);
            }
            Logits::Last => {
                // Each sequence's last row gathered (bit for bit), then one product over them:
                // the products are batch-invariant, so each row gets the bits a step of its
                // sequence alone gives.
                let lasts: Vec<u32> = shape
                    .lens
                    .iter()
                    .scan(0u32, |row, &len| {
                        *row += len as u32;
                        Some(*row - 1)
                    })
                    .collect();
                let ids = ctx.upload("rows that need logits", &lasts)?;
                let op = prepare_embed(
                    ctx,
                    &EmbedArgs {
                        tokens: &ids,
                        n_tokens: lasts.len(),
                        dim: d,
                        vocab: t,
                        table: &s.h,
                        out: &s.last,
                    },
                )?;
                head.push(product(head_w, &s.last, (0, lasts.len(), 0), &logits)?);
                gather = Some((op, ids));
            }
        }
        let rope = |tables, x, out| RopeArgs {
            tables,
            x: whole(x),
            positions: &s.positions,
            tokens: t,
            out: whole(out),
        };
        Ok(Step {
            embed: self.embed.prepare_gather(ctx, &s.ids, t, &s.x)?,
            rope: Rope::prepare_pair(
                ctx,
                &rope(&self.rope_q, &s.q, &s.q_rot),
                &rope(&self.rope_k, &s.k, &s.k_rot),
            )?,
            swiglu: prepare_swiglu(
                ctx,
                &SwigluArgs {
                    n: t * c.ffn,
                    gate: &s.gate,
                    up: &s.up,
                    out: &s.act,
                },
            )?,
            layers,
            final_norm: prepare_rms_norm(ctx, &norm(&self.final_norm, &s.h))?,
            gather,
            head,
            readback: Arc::new(Readback::new(
                ctx,
                "logits readback",
                (rows * c.vocab * 4) as u64,
            )?),
            logits,
            attention: self.attention_plan(ctx, cache, &shape, blocks)?,
            append: AppendPlan::with_capacity(ctx, cache, t)?,
            matmul_flops: flops.get(),
            shape,
        })
    }
}

/// Attention FLOPs of one layer: per query token at position `p` (it sees `p + 1` keys) and
/// head, `2 * head_dim` for the scores and `2 * head_dim` for the output, per key.
pub(super) fn attention_flops(c: &DecoderConfig, positions: &[u32]) -> u64 {
    let keys: u64 = positions.iter().map(|&p| u64::from(p) + 1).sum();
    keys * 4 * (c.n_heads * c.head_dim) as u64
}
