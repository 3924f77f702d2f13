//! A Llama-family decoder on kvattn's kernels: token embedding, RMSNorm, matrix products,
//! RoPE, `append_kv` into a [`PagedKvCache`], paged attention, SwiGLU MLP, logits. Every
//! per-token computation runs on the GPU; the host plans the step and reads the logits back.
//!
//! Weights are f32 on the GPU, each matrix `[out, in]` row-major (the GGUF / PyTorch layout:
//! `y = W x`). One [`Decoder::forward`] step takes, per sequence, its new tokens (a prompt
//! chunk, or one token when decoding), appends their K/V to the cache at positions following
//! what the sequence already holds, and returns the logits of each sequence's last new token.
//! It also counts the step's FLOPs (a multiply-add is 2): the matrix products and attention's
//! two products over the keys each query sees; the elementwise work (norms, RoPE, SwiGLU,
//! softmax) is left out, as usual.

use crate::attention::paged::{PagedAttentionArgs, PagedAttentionPlan, PagedQuery};
use crate::attention::{AttentionOptions, AttentionShape};
use crate::cache::allocator::SeqId;
use crate::cache::append_kv::SourceDtype;
use crate::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig};
use crate::decoder::ops::add::add_in_place;
use crate::decoder::ops::embed::{embed, embed_host_check};
use crate::decoder::ops::rms_norm::rms_norm;
use crate::decoder::ops::swiglu::swiglu;
use crate::gpu::Context;
use crate::mla::head_matmul::{head_matmul, HeadMatmul, RowStrides};
use crate::quant::KvDtype;
use crate::rope::{rope, RopeConfig, RopeStyle};
use crate::shader::Precision;
use std::sync::Mutex;

use crate::{Error, Result};

/// The shape of a Llama-family decoder.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderConfig {
    /// Transformer layers.
    pub layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads (`n_heads` for MHA, 1 for MQA).
    pub n_kv_heads: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// MLP hidden width.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RoPE frequency base.
    pub rope_theta: f32,
    /// Which elements RoPE rotates together (GPT-J for Llama GGUF files, whose Q/K weights
    /// are permuted for it; NeoX for Hugging Face checkpoints).
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
}

impl DecoderConfig {
    /// Checks the sizes: all positive, heads a multiple of KV heads, even head dim.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("layers", self.layers),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Err(Error::InvalidArgument(format!(
                    "decoder {what} must be positive"
                )));
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "RoPE theta {} must be finite and positive",
                self.rope_theta
            )));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "RMSNorm epsilon {} must be finite and non-negative",
                self.rms_eps
            )));
        }
        self.attention_shape().validate()?;
        self.rope(self.n_heads).validate()
    }

    /// The attention shape of every layer.
    pub fn attention_shape(&self) -> AttentionShape {
        AttentionShape {
            num_q_heads: self.n_heads,
            num_kv_heads: self.n_kv_heads,
            head_dim_qk: self.head_dim,
            head_dim_v: self.head_dim,
        }
    }

    /// Width of a token's queries (`n_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of a token's keys or values (`n_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// The RoPE configuration for `heads` heads of a token.
    pub fn rope(&self, heads: usize) -> RopeConfig {
        RopeConfig::new(self.rope_style, self.rope_theta, self.head_dim, heads)
    }

    /// A paged cache configuration for this model in `dtype` (per-row scales, block size 16).
    pub fn kv_config(&self, dtype: KvDtype) -> PagedKvConfig {
        PagedKvConfig::new(self.layers, self.n_kv_heads, self.head_dim, dtype)
    }

    /// Parameters (weights) of the model, output projection included if untied.
    pub fn parameters(&self, tied: bool) -> usize {
        let d = self.d_model;
        let per_layer = 2 * d + d * self.q_dim() * 2 + d * self.kv_dim() * 2 + 3 * d * self.ffn;
        let head = if tied { 0 } else { self.vocab * d };
        self.vocab * d + self.layers * per_layer + d + head
    }
}

/// One layer's weights on the host, matrices `[out, in]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostLayer {
    /// RMSNorm weight before attention, `[d_model]`.
    pub attn_norm: Vec<f32>,
    /// `[n_heads * head_dim, d_model]`.
    pub wq: Vec<f32>,
    /// `[n_kv_heads * head_dim, d_model]`.
    pub wk: Vec<f32>,
    /// `[n_kv_heads * head_dim, d_model]`.
    pub wv: Vec<f32>,
    /// `[d_model, n_heads * head_dim]`.
    pub wo: Vec<f32>,
    /// RMSNorm weight before the MLP, `[d_model]`.
    pub ffn_norm: Vec<f32>,
    /// `[ffn, d_model]`.
    pub w_gate: Vec<f32>,
    /// `[ffn, d_model]`.
    pub w_up: Vec<f32>,
    /// `[d_model, ffn]`.
    pub w_down: Vec<f32>,
}

/// A model's weights on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostWeights {
    /// Token embedding `[vocab, d_model]`.
    pub embed: Vec<f32>,
    /// Per layer.
    pub layers: Vec<HostLayer>,
    /// Final RMSNorm weight `[d_model]`.
    pub final_norm: Vec<f32>,
    /// Output projection `[vocab, d_model]`; `None`: tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

impl HostWeights {
    /// Checks every tensor's length against `c`.
    pub fn validate(&self, c: &DecoderConfig) -> Result<()> {
        let d = c.d_model;
        let check = |what: &'static str, got: usize, want: usize| -> Result<()> {
            if got == want {
                Ok(())
            } else {
                Err(Error::ShapeMismatch {
                    what,
                    expected: want,
                    got,
                })
            }
        };
        check("embedding", self.embed.len(), c.vocab * d)?;
        check("final norm", self.final_norm.len(), d)?;
        if let Some(head) = &self.lm_head {
            check("output projection", head.len(), c.vocab * d)?;
        }
        check("layers", self.layers.len(), c.layers)?;
        for l in &self.layers {
            check("attn_norm", l.attn_norm.len(), d)?;
            check("wq", l.wq.len(), c.q_dim() * d)?;
            check("wk", l.wk.len(), c.kv_dim() * d)?;
            check("wv", l.wv.len(), c.kv_dim() * d)?;
            check("wo", l.wo.len(), d * c.q_dim())?;
            check("ffn_norm", l.ffn_norm.len(), d)?;
            check("w_gate", l.w_gate.len(), c.ffn * d)?;
            check("w_up", l.w_up.len(), c.ffn * d)?;
            check("w_down", l.w_down.len(), d * c.ffn)?;
        }
        Ok(())
    }
}

/// One layer's weights on the GPU.
#[derive(Debug)]
struct GpuLayer {
    attn_norm: wgpu::Buffer,
    wq: wgpu::Buffer,
    wk: wgpu::Buffer,
    wv: wgpu::Buffer,
    wo: wgpu::Buffer,
    ffn_norm: wgpu::Buffer,
    w_gate: wgpu::Buffer,
    w_up: wgpu::Buffer,
    w_down: wgpu::Buffer,
}

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

/// A decoder with its weights on the GPU.
#[derive(Debug)]
pub struct Decoder {
    config: DecoderConfig,
    precision: Precision,
    embed: wgpu::Buffer,
    layers: Vec<GpuLayer>,
    final_norm: wgpu::Buffer,
    lm_head: Option<wgpu::Buffer>,
    /// Activations of the largest step so far, reused by every step that fits them.
    scratch: Mutex<Option<Scratch>>,
}

/// `y[t, :] = W x[t, :]` for `rows` rows of `x` starting at row `x_row`, with `W` `[n, k]`;
/// rows of `y` start at row `y_row`. Returns the FLOPs.
fn linear(
    ctx: &Context,
    (x, x_row): (&wgpu::Buffer, usize),
    rows: usize,
    k: usize,
    w: &wgpu::Buffer,
    n: usize,
    (y, y_row): (&wgpu::Buffer, usize),
) -> Result<u64> {
    let spec = HeadMatmul {
        rows,
        heads: 1,
        inner: k,
        n_out: n,
        x: RowStrides {
            offset: x_row * k,
            row: k,
            head: 0,
        },
        w_head: 0,
        w_k: 1,
        w_n: k,
        y: RowStrides {
            offset: y_row * n,
            row: n,
            head: 0,
        },
    };
    head_matmul(ctx, &spec, x, w, y)?;
    Ok(spec.flops())
}

/// Activation buffers for steps of up to `tokens` tokens.
#[derive(Debug)]
struct Scratch {
    tokens: usize,
    x: wgpu::Buffer,
    h: wgpu::Buffer,
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    q_rot: wgpu::Buffer,
    k_rot: wgpu::Buffer,
    attn: wgpu::Buffer,
    lse: wgpu::Buffer,
    proj: wgpu::Buffer,
    gate: wgpu::Buffer,
    up: wgpu::Buffer,
    act: wgpu::Buffer,
}

impl Scratch {
    fn new(ctx: &Context, c: &DecoderConfig, t: usize) -> Result<Self> {
        let f = |what: &str, n: usize| ctx.filled(what, n.max(1), 0.0f32);
        Ok(Self {
            tokens: t,
            x: f("residual", t * c.d_model)?,
            h: f("normed", t * c.d_model)?,
            q: f("q", t * c.q_dim())?,
            k: f("k", t * c.kv_dim())?,
            v: f("v", t * c.kv_dim())?,
            q_rot: f("q rotated", t * c.q_dim())?,
            k_rot: f("k rotated", t * c.kv_dim())?,
            attn: f("attention out", t * c.q_dim())?,
            lse: f("attention lse", t * c.n_heads)?,
            proj: f("projection", t * c.d_model)?,
            gate: f("gate", t * c.ffn)?,
            up: f("up", t * c.ffn)?,
            act: f("activation", t * c.ffn)?,
        })
    }
}

impl Decoder {
    /// Checks `weights` against `config` and uploads them; `precision` is the attention
    /// kernel's ([`Precision::F16`] needs `SHADER_F16`).
    pub fn upload(
        ctx: &Context,
        config: DecoderConfig,
        weights: &HostWeights,
        precision: Precision,
    ) -> Result<Self> {
        config.validate()?;
        weights.validate(&config)?;
        if precision == Precision::F16 && !ctx.caps().shader_f16 {
            return Err(Error::MissingFeature("shader-f16"));
        }
        let up = |what: &str, x: &[f32]| ctx.upload(what, x);
        let layers = weights
            .layers
            .iter()
            .map(|l| {
                Ok(GpuLayer {
                    attn_norm: up("attn_norm", &l.attn_norm)?,
                    wq: up("wq", &l.wq)?,
                    wk: up("wk", &l.wk)?,
                    wv: up("wv", &l.wv)?,
                    wo: up("wo", &l.wo)?,
                    ffn_norm: up("ffn_norm", &l.ffn_norm)?,
                    w_gate: up("w_gate", &l.w_gate)?,
                    w_up: up("w_up", &l.w_up)?,
                    w_down: up("w_down", &l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config,
            precision,
            embed: up("embedding", &weights.embed)?,
            layers,
            final_norm: up("final norm", &weights.final_norm)?,
            lm_head: weights
                .lm_head
                .as_deref()
                .map(|h| up("output projection", h))
                .transpose()?,
            scratch: Mutex::new(None),
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
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

    /// [`forward`](Self::forward) with the logits of the tokens `which` chooses.
    pub fn forward_with(
        &self,
        ctx: &Context,
        cache: &mut PagedKvCache,
        batch: &[(SeqId, &[u32])],
        which: Logits,
    ) -> Result<StepOutput> {
        let c = self.config;
        let kc = cache.config();
        if kc.layers != c.layers || kc.num_kv_heads != c.n_kv_heads || kc.head_dim_k != c.head_dim {
            return Err(Error::InvalidArgument(format!(
                "the cache ({} layers, {} KV heads of {}) does not fit the model ({} layers, {} \
                 KV heads of {})",
                kc.layers, kc.num_kv_heads, kc.head_dim_k, c.layers, c.n_kv_heads, c.head_dim
            )));
        }
        if batch.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut queries = Vec::with_capacity(batch.len());
        let mut needed = 0;
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
            let start = cache.allocator().len(seq)?;
            positions.extend((start..start + tokens.len()).map(|p| p as u32));
            ids.extend_from_slice(tokens);
            queries.push(PagedQuery {
                seq,
                len_q: tokens.len(),
            });
            needed += tokens.len();
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
        let mut append = AppendBatch::new();
        for &(seq, tokens) in batch {
            cache.append_tokens(ctx, &mut append, seq, tokens)?;
        }
        let t = needed;
        // Reuse the activation buffers while they are large enough (wgpu orders the previous
        // step's work before this step's writes).
        let mut scratch = self
            .scratch
            .lock()
            .map_err(|_| Error::Gpu("the decoder's scratch buffers are poisoned".into()))?;
        if scratch.as_ref().is_none_or(|s| s.tokens < t) {
            *scratch = Some(Scratch::new(ctx, &c, t.max(16))?);
        }
        let s = scratch.as_ref().expect("allocated above");
        let tokens_buf = ctx.upload("token ids", &ids)?;
        embed(ctx, &tokens_buf, t, c.d_model, c.vocab, &self.embed, &s.x)?;
        let options = AttentionOptions::default();
        let plan = PagedAttentionPlan::new(
            ctx,
            cache,
            &PagedAttentionArgs {
                layer: 0,
                batch: &queries,
                shape: c.attention_shape(),
                options: &options,
                precision: self.precision,
            },
        )?;
        let mut flops = 0u64;
        for (l, w) in self.layers.iter().enumerate() {
            let d = c.d_model;
            rms_norm(ctx, t, d, c.rms_eps, &s.x, &w.attn_norm, &s.h)?;
            flops += linear(ctx, (&s.h, 0), t, d, &w.wq, c.q_dim(), (&s.q, 0))?;
            flops += linear(ctx, (&s.h, 0), t, d, &w.wk, c.kv_dim(), (&s.k, 0))?;
            flops += linear(ctx, (&s.h, 0), t, d, &w.wv, c.kv_dim(), (&s.v, 0))?;
            rope(ctx, &c.rope(c.n_heads), &s.q, &positions, &s.q_rot)?;
            rope(ctx, &c.rope(c.n_kv_heads), &s.k, &positions, &s.k_rot)?;
            cache.write_layer(ctx, l, &append, &s.k_rot, &s.v, SourceDtype::F32)?;
            plan.run(ctx, cache, l, &s.q_rot, &s.attn, &s.lse)?;
            flops += attention_flops(&c, &positions);
            flops += linear(ctx, (&s.attn, 0), t, c.q_dim(), &w.wo, d, (&s.proj, 0))?;
            add_in_place(ctx, t * d, &s.x, &s.proj)?;
            rms_norm(ctx, t, d, c.rms_eps, &s.x, &w.ffn_norm, &s.h)?;
            flops += linear(ctx, (&s.h, 0), t, d, &w.w_gate, c.ffn, (&s.gate, 0))?;
            flops += linear(ctx, (&s.h, 0), t, d, &w.w_up, c.ffn, (&s.up, 0))?;
            swiglu(ctx, t * c.ffn, &s.gate, &s.up, &s.act)?;
            flops += linear(ctx, (&s.act, 0), t, c.ffn, &w.w_down, d, (&s.proj, 0))?;
            add_in_place(ctx, t * d, &s.x, &s.proj)?;
        }
        rms_norm(ctx, t, c.d_model, c.rms_eps, &s.x, &self.final_norm, &s.h)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let rows = match which {
            Logits::Last => batch.len(),
            Logits::All => t,
        };
        let logits = ctx.filled("logits", rows * c.vocab, crate::gpu::UNWRITTEN)?;
        match which {
            Logits::All => {
                flops += linear(ctx, (&s.h, 0), t, c.d_model, head, c.vocab, (&logits, 0))?;
            }
            Logits::Last => {
                let mut row = 0;
                for (i, &(_, tokens)) in batch.iter().enumerate() {
                    row += tokens.len();
                    let x = (&s.h, row - 1);
                    flops += linear(ctx, x, 1, c.d_model, head, c.vocab, (&logits, i))?;
                }
            }
        }
        Ok(StepOutput {
            logits: ctx.read_back(&logits, rows * c.vocab)?,
            flops,
        })
    }
}

/// Attention FLOPs of one layer: per query token at position `p` (it sees `p + 1` keys) and
/// head, `2 * head_dim` for the scores and `2 * head_dim` for the output, per key.
fn attention_flops(c: &DecoderConfig, positions: &[u32]) -> u64 {
    let keys: u64 = positions.iter().map(|&p| u64::from(p) + 1).sum();
    keys * 4 * (c.n_heads * c.head_dim) as u64
}
