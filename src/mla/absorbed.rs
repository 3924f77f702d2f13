//! The absorbed MLA path: `q_lat = W_UK^T q_nope` per head, attention over the latent cache
//! (the paged kernel in its MLA mode, `shaders/paged.wgsl`), then `out = W_UV^T o_lat` per head.

use super::cache::MlaCache;
use super::head_matmul::{HeadMatmul, RowStrides};
use super::plan::{MlaArgs, MlaIo};
use super::strided_copy::StridedCopy;
use super::weights::MlaWeights;
use crate::attention::paged::{AttentionIo, PagedAttentionArgs, PagedAttentionPlan, SPLIT_TOKENS};
use crate::attention::{AttentionOptions, AttentionShape};
use crate::gpu::Context;
use crate::problem::MlaShape;
use crate::Result;

/// The attention shape the paged kernel sees: MQA over `[c_kv ; k_pe]` keys and `c_kv` values.
pub(crate) fn latent_shape(s: &MlaShape) -> AttentionShape {
    AttentionShape {
        num_q_heads: s.num_heads,
        num_kv_heads: 1,
        head_dim_qk: s.rank + s.d_rope,
        head_dim_v: s.rank,
    }
}

/// Plan and scratch buffers of the absorbed path.
#[derive(Debug)]
pub(crate) struct AbsorbedPlan {
    shape: MlaShape,
    total_q: usize,
    attention: PagedAttentionPlan,
    /// `[total_q, H, rank + d_rope]`: absorbed queries joined with the RoPE queries.
    q_cat: wgpu::Buffer,
    /// `[total_q, H, rank]`: the latent outputs.
    o_lat: wgpu::Buffer,
}

impl AbsorbedPlan {
    pub(crate) fn new(ctx: &Context, cache: &MlaCache, args: &MlaArgs) -> Result<Self> {
        let s = args.shape;
        let options = AttentionOptions {
            scale: Some(args.scale()?),
            ..AttentionOptions::default()
        };
        let attention = PagedAttentionPlan::over_cache(
            ctx,
            cache.cache(),
            &PagedAttentionArgs {
                layer: args.layer,
                batch: args.batch,
                shape: latent_shape(&s),
                options: &options,
                precision: args.precision,
            },
            SPLIT_TOKENS,
            true,
        )?;
        let total_q = attention.total_q();
        let rows = total_q * s.num_heads;
        Ok(Self {
            shape: s,
            total_q,
            attention,
            q_cat: ctx.filled(
                "mla q_cat",
                rows * (s.rank + s.d_rope),
                crate::gpu::UNWRITTEN,
            )?,
            o_lat: ctx.filled("mla o_lat", rows * s.rank, crate::gpu::UNWRITTEN)?,
        })
    }

    /// Records the path into `pass`: query absorption, the RoPE queries' copy, attention over
    /// the latent rows (split-K states and their merge), the output up-projection; nothing is
    /// submitted. The projections and the copy are checked and their bind groups made first;
    /// the attention plan then checks its own buffers (the plan's scratch and `io.lse`, which
    /// [`MlaPlan::encode`](super::MlaPlan::encode) checked before) and records.
    pub(crate) fn encode(
        &self,
        ctx: &Context,
        pass: &mut wgpu::ComputePass<'_>,
        cache: &MlaCache,
        layer: usize,
        weights: &MlaWeights,
        io: &MlaIo,
    ) -> Result<()> {
        let s = &self.shape;
        let (h, t) = (s.num_heads, self.total_q);
        let q_row = s.rank + s.d_rope;
        // q_lat[t, h, r] = sum_n q_nope[t, h, n] W_UK[h, n, r], into columns 0..rank of q_cat.
        let absorb = HeadMatmul {
            rows: t,
            heads: h,
            inner: s.d_nope,
            n_out: s.rank,
            x: RowStrides::dense(0, h, s.d_nope),
            w_head: s.d_nope * s.rank,
            w_k: s.rank,
            w_n: 1,
            y: RowStrides::dense(0, h, q_row),
        }
        .prepare(ctx, io.q_nope, weights.w_uk(), &self.q_cat)?;
        // q_pe into columns rank.. of q_cat.
        let rope = StridedCopy {
            rows: t,
            heads: h,
            n: s.d_rope,
            src: RowStrides::dense(0, h, s.d_rope),
            dst: RowStrides::dense(s.rank, h, q_row),
        }
        .prepare(ctx, io.q_pe, &self.q_cat)?;
        // out[t, h, v] = sum_r o_lat[t, h, r] W_UV[h, r, v].
        let up = HeadMatmul {
            rows: t,
            heads: h,
            inner: s.rank,
            n_out: s.d_v,
            x: RowStrides::dense(0, h, s.rank),
            w_head: s.rank * s.d_v,
            w_k: s.d_v,
            w_n: 1,
            y: RowStrides::dense(0, h, s.d_v),
        }
        .prepare(ctx, &self.o_lat, weights.w_uv(), io.out)?;
        absorb.encode(pass);
        rope.encode(pass);
        self.attention.encode(
            ctx,
            pass,
            &AttentionIo {
                cache: cache.cache(),
                layer,
                q: self.q_cat.as_entire_buffer_binding(),
                out: self.o_lat.as_entire_buffer_binding(),
                lse: io.lse.as_entire_buffer_binding(),
            },
        )?;
        up.encode(pass);
        Ok(())
    }
}
