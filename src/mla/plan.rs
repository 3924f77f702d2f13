//! MLA attention over a latent cache: the batch description, its plan and the host entry point.
//!
//! Both paths compute, per query token and head `h` (causal, bottom-right aligned),
//! `out[h] = W_UV[h]^T sum_j p_j c_kv_j` with
//! `p = softmax(scale * (q_lat[h] . c_kv_j + q_pe[h] . k_pe_j))` and
//! `q_lat[h] = W_UK[h]^T q_nope[h]`:
//!
//! - [`MlaPath::Absorbed`] (decode, short chunks): query absorption (a per-head matrix product),
//!   attention over the latent rows themselves (the paged kernel in its MLA mode: MQA with head
//!   dims `rank + d_rope` and `rank`, every latent row read once per tile of heads, split-K at
//!   fixed token splits), then the output up-projection. Its cost per key is `O(H * rank)`.
//! - [`MlaPath::UpProj`] (long prefills): the latent rows expanded to per-head
//!   `K = [W_UK[h] c_kv ; k_pe]` (`d_nope + d_rope` dims) and `V = W_UV[h]^T c_kv` (`d_v`
//!   dims), attended by the ordinary kernel, chunk by chunk of keys so that a chunk's expanded
//!   K and V fit one storage binding; the chunks' partial states are merged once at the end.
//!   Its cost per key is `O(H * rank * (d_nope + d_v))` for the expansion, shared by every
//!   query of a long chunk.

use super::absorbed::AbsorbedPlan;
use super::cache::MlaCache;
use super::up_proj::UpProjPlan;
use super::weights::MlaWeights;
use crate::attention::paged::PagedQuery;
use crate::gpu::{check_storage, Context};
use crate::problem::AttentionOutput;
use crate::problem::MlaShape;
use crate::shader::Precision;
use crate::{Error, Result};

/// Which computation serves a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MlaPath {
    /// Attention over the latent rows with absorbed queries (the decode path).
    #[default]
    Absorbed,
    /// Latent rows up-projected to per-head K and V, then ordinary attention.
    UpProj,
}

impl MlaPath {
    /// `absorbed` or `up-proj`.
    pub fn name(self) -> &'static str {
        match self {
            MlaPath::Absorbed => "absorbed",
            MlaPath::UpProj => "up-proj",
        }
    }
}

impl std::str::FromStr for MlaPath {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "absorbed" => Ok(MlaPath::Absorbed),
            "up-proj" | "upproj" | "up_proj" => Ok(MlaPath::UpProj),
            _ => Err(Error::InvalidArgument(format!(
                "unknown MLA path {s:?} (absorbed or up-proj)"
            ))),
        }
    }
}

/// What to compute: which layer, which sequences, the shape, the path.
#[derive(Debug, Clone, Copy)]
pub struct MlaArgs<'a> {
    /// Layer of the cache to attend over (used by [`mla_host`]; [`MlaPlan::run`] takes it).
    pub layer: usize,
    /// The sequences and their query counts, in the order of the query rows. A sequence's
    /// queries are its last `len_q` cached tokens: append the chunk's latent rows first.
    pub batch: &'a [PagedQuery],
    /// The layer's dimensions (rank and RoPE dims must match the cache).
    pub shape: MlaShape,
    /// Score scale; `None` means [`MlaShape::default_scale`].
    pub scale: Option<f32>,
    /// Attention kernel variant; [`Precision::F16`] needs `SHADER_F16`. Products, sums and the
    /// projections stay f32.
    pub precision: Precision,
    /// Absorbed or up-projection.
    pub path: MlaPath,
    /// Keys per chunk of the up-projection path; `None`: as many as one storage binding holds
    /// expanded (DeepSeek-V2 on a 128 MiB binding: 1,365 tokens).
    pub up_proj_chunk: Option<usize>,
}

impl MlaArgs<'_> {
    /// The score scale in effect, checked finite.
    pub(crate) fn scale(&self) -> Result<f32> {
        let scale = self.scale.unwrap_or_else(|| self.shape.default_scale());
        if !scale.is_finite() {
            return Err(Error::InvalidArgument(format!(
                "MLA scale must be finite, got {scale}"
            )));
        }
        Ok(scale)
    }
}

/// The GPU buffers of one layer's run: queries in, output and log-sum-exp out (f32).
#[derive(Debug, Clone, Copy)]
pub struct MlaIo<'a> {
    /// `[total_q, H, d_nope]`.
    pub q_nope: &'a wgpu::Buffer,
    /// `[total_q, H, d_rope]`, already rotated.
    pub q_pe: &'a wgpu::Buffer,
    /// `[total_q, H, d_v]`, written.
    pub out: &'a wgpu::Buffer,
    /// `[total_q, H]`, written.
    pub lse: &'a wgpu::Buffer,
}

#[derive(Debug)]
enum Inner {
    Absorbed(AbsorbedPlan),
    UpProj(UpProjPlan),
}

/// A batch planned once from its block tables; [`run`](Self::run) per layer.
#[derive(Debug)]
pub struct MlaPlan {
    shape: MlaShape,
    total_q: usize,
    inner: Inner,
}

impl MlaPlan {
    /// Plans `args.batch` over `cache` on `args.path`. Valid for every layer until the block
    /// tables change.
    pub fn new(ctx: &Context, cache: &MlaCache, args: &MlaArgs) -> Result<Self> {
        let s = &args.shape;
        s.validate()?;
        let c = cache.config();
        if s.rank != c.rank || s.d_rope != c.d_rope {
            return Err(Error::InvalidArgument(format!(
                "MLA shape (rank {}, RoPE {}) does not match the cache (rank {}, RoPE {})",
                s.rank, s.d_rope, c.rank, c.d_rope
            )));
        }
        args.scale()?;
        let inner = match args.path {
            MlaPath::Absorbed => Inner::Absorbed(AbsorbedPlan::new(ctx, cache, args)?),
            MlaPath::UpProj => Inner::UpProj(UpProjPlan::new(ctx, cache, args)?),
        };
        Ok(Self {
            shape: *s,
            total_q: args.batch.iter().map(|q| q.len_q).sum(),
            inner,
        })
    }

    /// Query tokens of the batch.
    pub fn total_q(&self) -> usize {
        self.total_q
    }

    /// Records the batch on `layer` of `cache` (the cache the plan was made from) with that
    /// layer's `weights` into `pass`, reading and writing the buffers of `io`; nothing is
    /// submitted. Both paths record into the one pass (the up-projection path's chunks share a
    /// scratch pair, in dispatch order).
    ///
    /// # Errors
    /// Checked before anything is recorded: [`Error::InvalidArgument`] for weights of another
    /// shape, a layer the cache lacks, or an `io` buffer without `STORAGE` usage;
    /// [`Error::ShapeMismatch`] for an `io` buffer smaller than the batch. The plan's own
    /// scratch and row lists need no check; a device-level refusal ([`Error::Wgpu`]) of a bind
    /// group made while recording may leave `pass` partly recorded: drop its encoder then.
    pub fn encode(
        &self,
        ctx: &Context,
        pass: &mut wgpu::ComputePass<'_>,
        cache: &MlaCache,
        layer: usize,
        weights: &MlaWeights,
        io: &MlaIo,
    ) -> Result<()> {
        self.check(cache, layer, weights, io)?;
        match &self.inner {
            Inner::Absorbed(p) => p.encode(ctx, pass, cache, layer, weights, io),
            Inner::UpProj(p) => p.encode(ctx, pass, cache, layer, weights, io),
        }
    }

    /// Runs the batch on `layer` of `cache` (the cache the plan was made from) with that layer's
    /// `weights`, reading and writing the buffers of `io`: [`encode`](Self::encode) into a
    /// compute pass of its own, submitted (one submission; nothing is submitted on error).
    pub fn run(
        &self,
        ctx: &Context,
        cache: &MlaCache,
        layer: usize,
        weights: &MlaWeights,
        io: &MlaIo,
    ) -> Result<()> {
        self.check(cache, layer, weights, io)?;
        ctx.run_pass("mla", |pass| {
            self.encode(ctx, pass, cache, layer, weights, io)
        })?;
        Ok(())
    }

    /// The checks of [`encode`](Self::encode) on the caller's arguments.
    fn check(
        &self,
        cache: &MlaCache,
        layer: usize,
        weights: &MlaWeights,
        io: &MlaIo,
    ) -> Result<()> {
        let s = &self.shape;
        if weights.shape() != s {
            return Err(Error::InvalidArgument(format!(
                "weights of shape {:?} for a plan of shape {s:?}",
                weights.shape()
            )));
        }
        let rows = self.total_q * s.num_heads;
        check_storage("q_nope buffer", io.q_nope, rows * s.d_nope)?;
        check_storage("q_pe buffer", io.q_pe, rows * s.d_rope)?;
        check_storage("out buffer", io.out, rows * s.d_v)?;
        check_storage("lse buffer", io.lse, rows)?;
        cache.cache().layer(layer)?;
        Ok(())
    }
}

/// Runs MLA over `cache` with host queries and reads `out` (`[total_q, H, d_v]`) and `lse`
/// (`[total_q, H]`) back.
pub fn mla_host(
    ctx: &Context,
    cache: &MlaCache,
    weights: &MlaWeights,
    args: &MlaArgs,
    q_nope: &[f32],
    q_pe: &[f32],
) -> Result<AttentionOutput> {
    pollster::block_on(mla_host_async(ctx, cache, weights, args, q_nope, q_pe))
}

/// [`mla_host`] without blocking: the form to await in the browser.
pub async fn mla_host_async(
    ctx: &Context,
    cache: &MlaCache,
    weights: &MlaWeights,
    args: &MlaArgs<'_>,
    q_nope: &[f32],
    q_pe: &[f32],
) -> Result<AttentionOutput> {
    let plan = MlaPlan::new(ctx, cache, args)?;
    let s = &args.shape;
    let rows = plan.total_q() * s.num_heads;
    for (what, data, dim) in [("q_nope", q_nope, s.d_nope), ("q_pe", q_pe, s.d_rope)] {
        if data.len() != rows * dim {
            return Err(Error::ShapeMismatch {
                what,
                expected: rows * dim,
                got: data.len(),
            });
        }
    }
    let qn = ctx.upload("q_nope", q_nope)?;
    let qp = ctx.upload("q_pe", q_pe)?;
    let out = ctx.filled("mla out", rows * s.d_v, crate::gpu::UNWRITTEN)?;
    let lse = ctx.filled("mla lse", rows, crate::gpu::UNWRITTEN)?;
    let io = MlaIo {
        q_nope: &qn,
        q_pe: &qp,
        out: &out,
        lse: &lse,
    };
    plan.run(ctx, cache, args.layer, weights, &io)?;
    Ok(AttentionOutput {
        out: ctx.read_back_async(&out, rows * s.d_v).await?,
        lse: ctx.read_back_async(&lse, rows).await?,
    })
}
