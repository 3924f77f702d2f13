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
//! encoder; [`Decoder::forward_with`] submits it and reads the logits back). The decoder keeps
//! what a step records (prepared kernels with their bind groups, the append and attention
//! plans, the logits buffer and its staging) for the last two step shapes, so a decode step
//! with the batch shape of the previous one creates no buffer and no bind group.

use crate::attention::paged::PagedQuery;
use crate::attention::paged_plan::{AttentionIo, PagedAttentionPlan, PlanCapacity, PlanSpec};
use crate::attention::{AttentionOptions, AttentionShape, SPLIT_TOKENS};
use crate::cache::allocator::SeqId;
use crate::cache::append_kv::SourceDtype;
use crate::cache::append_plan::{AppendIo, AppendPlan};
use crate::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig};
use crate::decoder::ops::add::{prepare_bias_add, BiasAddArgs};
use crate::decoder::ops::embed::{embed_host_check, prepare_embed, EmbedArgs};
use crate::decoder::ops::qmatmul::input_buffer;
use crate::decoder::ops::rms_norm::{prepare_rms_norm, RmsNormArgs};
use crate::decoder::ops::swiglu::{prepare_swiglu, SwigluArgs};
use crate::decoder::ops::PreparedOp;
use crate::decoder::passes::{op, StepPasses};
use crate::decoder::weights::{GpuMatrix, LayerMatrix, Product, WeightSource};
use crate::gpu::{Context, Readback};
use crate::quant::KvDtype;
use crate::rope::{PreparedRope, Rope, RopeArgs, RopeConfig, RopeStyle, RopeTables};
use crate::shader::Precision;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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
    /// Bias added after the Q product, `[n_heads * head_dim]` (Qwen2); `None`: no bias.
    pub bq: Option<Vec<f32>>,
    /// Bias added after the K product (before RoPE), `[n_kv_heads * head_dim]`.
    pub bk: Option<Vec<f32>>,
    /// Bias added after the V product, `[n_kv_heads * head_dim]`.
    pub bv: Option<Vec<f32>>,
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
    /// RoPE frequency factors `[head_dim / 2]` (Llama 3.1's `rope_freqs.weight`): pair `i`'s
    /// frequency is divided by `rope_freqs[i]`; `None`: unscaled.
    pub rope_freqs: Option<Vec<f32>>,
}

impl HostLayer {
    /// The bias added after matrix `which`'s product: [`HostLayer::bq`], [`HostLayer::bk`],
    /// [`HostLayer::bv`]; `None` for the other matrices.
    pub fn bias(&self, which: LayerMatrix) -> Option<&[f32]> {
        match which {
            LayerMatrix::Q => self.bq.as_deref(),
            LayerMatrix::K => self.bk.as_deref(),
            LayerMatrix::V => self.bv.as_deref(),
            _ => None,
        }
    }
}

impl HostWeights {
    /// Checks every tensor's length against `c` (and the RoPE frequency factors:
    /// [`RopeConfig::inv_freq_scaled`]).
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
        c.rope(c.n_heads)
            .inv_freq_scaled(self.rope_freqs.as_deref())?;
        for l in &self.layers {
            check("attn_norm", l.attn_norm.len(), d)?;
            check("wq", l.wq.len(), c.q_dim() * d)?;
            check("wk", l.wk.len(), c.kv_dim() * d)?;
            check("wv", l.wv.len(), c.kv_dim() * d)?;
            check("wo", l.wo.len(), d * c.q_dim())?;
            for (what, bias, want) in [
                ("bq", &l.bq, c.q_dim()),
                ("bk", &l.bk, c.kv_dim()),
                ("bv", &l.bv, c.kv_dim()),
            ] {
                if let Some(b) = bias {
                    check(what, b.len(), want)?;
                }
            }
            check("ffn_norm", l.ffn_norm.len(), d)?;
            check("w_gate", l.w_gate.len(), c.ffn * d)?;
            check("w_up", l.w_up.len(), c.ffn * d)?;
            check("w_down", l.w_down.len(), d * c.ffn)?;
        }
        Ok(())
    }
}

/// One layer's weights on the GPU: its norms, and its matrices in [`LayerMatrix::ALL`] order
/// with the bias added after each product (if any).
#[derive(Debug)]
struct GpuLayer {
    attn_norm: wgpu::Buffer,
    ffn_norm: wgpu::Buffer,
    matrices: Vec<GpuMatrix>,
    biases: Vec<Option<wgpu::Buffer>>,
}

impl GpuLayer {
    fn matrix(&self, which: LayerMatrix) -> &GpuMatrix {
        &self.matrices[which.index()]
    }

    fn bias(&self, which: LayerMatrix) -> Option<&wgpu::Buffer> {
        self.biases[which.index()].as_ref()
    }
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

/// Step shapes whose prepared resources a decoder keeps (e.g. a prefill and a decode shape);
/// the least recently used one is dropped for a new shape.
const MAX_SHAPES: usize = 2;

/// What a step's prepared resources are made for: the cache, each sequence's new tokens (in
/// batch order) and which logits are read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StepShape {
    cache: u64,
    lens: Vec<usize>,
    which: Logits,
}

impl StepShape {
    fn tokens(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Logit rows the step reads back.
    fn rows(&self) -> usize {
        match self.which {
            Logits::Last => self.lens.len(),
            Logits::All => self.tokens(),
        }
    }
}

/// Activation buffers for steps of up to `tokens` tokens, shared by every prepared step shape
/// (steps run one after another on the queue), with the token ids and positions each step
/// writes with [`Context::write_buffer`].
#[derive(Debug)]
struct Scratch {
    tokens: usize,
    ids: wgpu::Buffer,
    positions: wgpu::Buffer,
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
    /// The rows that need logits, gathered (`Logits::Last` over several sequences).
    last: wgpu::Buffer,
}

impl Scratch {
    fn new(ctx: &Context, c: &DecoderConfig, t: usize) -> Result<Self> {
        let f = |what: &str, n: usize| ctx.filled(what, n.max(1), 0.0f32);
        // The inputs of the matrix products: readable by every kernel of the block-format
        // product (the row kernel reads x through a uniform window).
        let input = |what: &str, n: usize| input_buffer(ctx, what, &vec![0.0f32; n.max(1)]);
        Ok(Self {
            tokens: t,
            ids: ctx.filled("token ids", t, 0u32)?,
            positions: ctx.filled("positions", t, 0u32)?,
            x: f("residual", t * c.d_model)?,
            h: input("normed", t * c.d_model)?,
            q: f("q", t * c.q_dim())?,
            k: f("k", t * c.kv_dim())?,
            v: f("v", t * c.kv_dim())?,
            q_rot: f("q rotated", t * c.q_dim())?,
            k_rot: f("k rotated", t * c.kv_dim())?,
            attn: input("attention out", t * c.q_dim())?,
            lse: f("attention lse", t * c.n_heads)?,
            proj: f("projection", t * c.d_model)?,
            gate: f("gate", t * c.ffn)?,
            up: f("up", t * c.ffn)?,
            act: input("activation", t * c.ffn)?,
            last: input("rows that need logits", t * c.d_model)?,
        })
    }
}

/// The whole of a buffer as a binding.
fn whole(buffer: &wgpu::Buffer) -> wgpu::BufferBinding<'_> {
    wgpu::BufferBinding {
        buffer,
        offset: 0,
        size: None,
    }
}

/// One layer's prepared ops (those that bind the layer's weights).
#[derive(Debug)]
struct LayerStep {
    attn_norm: PreparedOp,
    /// The Q, K and V products: one grouped product where the row kernel takes them together
    /// (a decode step of one row on a CPU adapter, `GpuMatrix::prepare_group`), else three.
    qkv: Vec<Product>,
    /// The Q, K and V biases' adds (those the layer has), after the three products.
    qkv_bias: Vec<PreparedOp>,
    o: Product,
    ffn_norm: PreparedOp,
    gate: Product,
    up: Product,
    down: Product,
}

/// Everything a step of one shape records, made once: the prepared ops with their bind
/// groups, the attention and append plans, the logits buffer and its readback staging. A warm
/// step of the shape writes its ids, positions and plan metadata and records these: no buffer,
/// no bind group, one submission.
#[derive(Debug)]
struct Step {
    shape: StepShape,
    embed: PreparedOp,
    /// The queries' and keys' rotations: one dispatch ([`Rope::prepare_pair`]).
    rope: PreparedRope,
    swiglu: PreparedOp,
    layers: Vec<LayerStep>,
    final_norm: PreparedOp,
    /// `Logits::Last` over several sequences: their last rows gathered into one block, so one
    /// product reads the output projection once (with the indices it gathers by).
    gather: Option<(PreparedOp, wgpu::Buffer)>,
    /// The logits: one product for every row ([`Logits::All`]), for the one sequence's last row,
    /// or for the gathered last rows of several sequences.
    head: Vec<Product>,
    logits: wgpu::Buffer,
    readback: Arc<Readback>,
    attention: PagedAttentionPlan,
    append: AppendPlan,
    /// FLOPs of the step's matrix products.
    matmul_flops: u64,
}

/// A decoder's step resources: the shared activations and the prepared steps, most recently
/// used last.
#[derive(Debug, Default)]
struct StepCache {
    scratch: Option<Scratch>,
    steps: Vec<Step>,
}

/// Blocks per sequence an attention plan is made for when a sequence needs `blocks`: room to
/// grow (doubling), within the pool.
fn blocks_capacity(blocks: usize, pool_blocks: usize) -> usize {
    (blocks.max(1).next_power_of_two() * 2).min(pool_blocks.max(1))
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
        Self::upload_from(ctx, config, weights, precision, |_, _| {})
    }

    /// Uploads the weights `source` hands out, one tensor at a time, checking each against
    /// `config`: matrices in a GGUF block format stay in it on the GPU (see
    /// [`super::weights`]), with the biases of the Q, K and V products the source has
    /// ([`WeightSource::bias`]) and RoPE scaled by the source's frequency factors
    /// ([`WeightSource::rope_freqs`]). `progress(done, total)` is called after each norm and
    /// each matrix (with its bias).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `config` is invalid, a tensor has the wrong size, a
    /// block matrix's rows are not a multiple of 32 values, a bias comes with a matrix other
    /// than Q, K or V, or the RoPE frequency factors are not `head_dim / 2` finite positive
    /// values; [`Error::MissingFeature`] for
    /// [`Precision::F16`] without `SHADER_F16`; the source's errors; [`Error::Wgpu`] from wgpu.
    pub fn upload_from(
        ctx: &Context,
        config: DecoderConfig,
        source: &dyn WeightSource,
        precision: Precision,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        config.validate()?;
        if precision == Precision::F16 && !ctx.caps().shader_f16 {
            return Err(Error::MissingFeature("shader-f16"));
        }
        let c = config;
        let total = 3 + (2 + LayerMatrix::ALL.len()) * c.layers;
        let mut done = 0;
        let mut tick = || {
            done += 1;
            progress(done, total);
        };
        let vector = |what: &str, x: Vec<f32>| -> Result<wgpu::Buffer> {
            if x.len() != c.d_model {
                return Err(Error::InvalidArgument(format!(
                    "{what}: {} values, expected d_model = {}",
                    x.len(),
                    c.d_model
                )));
            }
            ctx.upload(what, &x)
        };
        let mut bytes = 0u64;
        let embed =
            GpuMatrix::upload(ctx, "embedding", &source.embedding()?, (c.vocab, c.d_model))?;
        bytes += embed.gpu_bytes();
        tick();
        let lm_head = match source.output()? {
            Some(data) => {
                let m = GpuMatrix::upload(ctx, "output projection", &data, (c.vocab, c.d_model))?;
                bytes += m.gpu_bytes();
                Some(m)
            }
            None => None,
        };
        tick();
        let rope_freqs = source.rope_freqs()?;
        let rope = |heads| RopeTables::scaled(ctx, &config.rope(heads), rope_freqs.as_deref());
        let (rope_q, rope_k) = (rope(c.n_heads)?, rope(c.n_kv_heads)?);
        let final_norm = vector("final norm", source.final_norm()?)?;
        bytes += final_norm.size();
        tick();
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let (attn, ffn) = source.norms(i)?;
            let attn_norm = vector("attn_norm", attn)?;
            let ffn_norm = vector("ffn_norm", ffn)?;
            bytes += attn_norm.size() + ffn_norm.size();
            tick();
            tick();
            let mut matrices = Vec::with_capacity(LayerMatrix::ALL.len());
            let mut biases = Vec::with_capacity(LayerMatrix::ALL.len());
            for which in LayerMatrix::ALL {
                let what = format!("layer {i} {}", which.gguf_name());
                let data = source.matrix(i, which)?;
                let m = GpuMatrix::upload(ctx, &what, &data, which.shape(&c))?;
                bytes += m.gpu_bytes();
                matrices.push(m);
                let bias = match source.bias(i, which)? {
                    Some(b) => {
                        let rows = which.shape(&c).0;
                        if !matches!(which, LayerMatrix::Q | LayerMatrix::K | LayerMatrix::V) {
                            return Err(Error::InvalidArgument(format!(
                                "{what}: a bias after this product is not supported (only \
                                 after Q, K and V)"
                            )));
                        }
                        if b.len() != rows {
                            return Err(Error::InvalidArgument(format!(
                                "{what} bias: {} values, expected {rows}",
                                b.len()
                            )));
                        }
                        let buffer = ctx.upload(&format!("{what} bias"), &b)?;
                        bytes += buffer.size();
                        Some(buffer)
                    }
                    None => None,
                };
                biases.push(bias);
                tick();
            }
            layers.push(GpuLayer {
                attn_norm,
                ffn_norm,
                matrices,
                biases,
            });
        }
        Ok(Self {
            config,
            precision,
            embed,
            layers,
            final_norm,
            lm_head,
            weight_bytes: bytes,
            rope_q,
            rope_k,
            steps: Mutex::new(StepCache::default()),
            pass_per_op: AtomicBool::new(false),
        })
    }

    /// Records each op of the steps from now on in a compute pass of its own, labelled with
    /// the op's name ([`super::passes::op`]), when `on`; in one pass per step when not (the
    /// default). The results are the same bit for bit; with the steps timed by
    /// [`Context::timed_passes`] the passes say where a step's device time goes (the decoder
    /// example's `--profile-ops`).
    pub fn set_pass_per_op(&self, on: bool) {
        self.pass_per_op.store(on, Ordering::Relaxed);
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
            let per_op = self.pass_per_op.load(Ordering::Relaxed);
            let mut passes = StepPasses::new(ctx, encoder, per_op);
            self.encode_layers(ctx, &mut passes, cache, &step, s)?;
            passes.finish();
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

    /// The prepared steps, emptied when a panic mid-step poisoned them (a plan may have been
    /// recorded but not submitted: start afresh).
    fn lock_steps(&self) -> std::sync::MutexGuard<'_, StepCache> {
        self.steps.lock().unwrap_or_else(|poisoned| {
            self.steps.clear_poison();
            let mut guard = poisoned.into_inner();
            *guard = StepCache::default();
            guard
        })
    }

    /// Activations for steps of `t` tokens in `st` (made anew, with every prepared step
    /// dropped, when the current ones are smaller).
    fn ensure_scratch(&self, ctx: &Context, st: &mut StepCache, t: usize) -> Result<()> {
        if st.scratch.as_ref().is_none_or(|s| s.tokens < t) {
            // Every prepared step binds the old activations: drop them with it.
            st.steps.clear();
            st.scratch = None;
            // Rounded up, so that steps of growing length (a recomputing run) do not make new
            // activations every step.
            st.scratch = Some(Scratch::new(
                ctx,
                &self.config,
                t.next_power_of_two().max(16),
            )?);
        }
        Ok(())
    }

    /// Records a prepared step (whose plans were updated for this step) into `passes`.
    fn encode_layers(
        &self,
        ctx: &Context,
        passes: &mut StepPasses<'_>,
        cache: &PagedKvCache,
        step: &Step,
        s: &Scratch,
    ) -> Result<()> {
        step.embed.encode(passes.op(op::EMBED));
        for (layer, ops) in step.layers.iter().enumerate() {
            ops.attn_norm.encode(passes.op(op::ATTN_NORM));
            let pass = passes.op(op::QKV);
            for product in &ops.qkv {
                product.encode(pass);
            }
            if !ops.qkv_bias.is_empty() {
                let pass = passes.op(op::QKV_BIAS);
                for bias in &ops.qkv_bias {
                    bias.encode(pass);
                }
            }
            step.rope.encode(passes.op(op::ROPE));
            let io = AppendIo {
                cache,
                layer,
                k: whole(&s.k_rot),
                v: whole(&s.v),
                src: SourceDtype::F32,
            };
            step.append.encode(ctx, passes.op(op::APPEND), &io)?;
            let io = AttentionIo {
                cache,
                layer,
                q: whole(&s.q_rot),
                out: whole(&s.attn),
                lse: whole(&s.lse),
            };
            step.attention.encode(ctx, passes.op(op::ATTENTION), &io)?;
            ops.o.encode(passes.op(op::O));
            ops.ffn_norm.encode(passes.op(op::FFN_NORM));
            ops.gate.encode(passes.op(op::GATE));
            ops.up.encode(passes.op(op::UP));
            step.swiglu.encode(passes.op(op::SWIGLU));
            ops.down.encode(passes.op(op::DOWN));
        }
        step.final_norm.encode(passes.op(op::FINAL_NORM));
        if let Some((gather, _)) = &step.gather {
            gather.encode(passes.op(op::GATHER));
        }
        let pass = passes.op(op::HEAD);
        for head in &step.head {
            head.encode(pass);
        }
        Ok(())
    }

    /// An attention plan for steps of `shape` over `cache`, for sequences of up to `blocks`
    /// blocks.
    fn attention_plan(
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
    fn prepare_step(
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
fn attention_flops(c: &DecoderConfig, positions: &[u32]) -> u64 {
    let keys: u64 = positions.iter().map(|&p| u64::from(p) + 1).sum();
    keys * 4 * (c.n_heads * c.head_dim) as u64
}
