//! The up-projection MLA path: latent rows expanded to per-head K and V, attended by the
//! ordinary paged kernel, chunk by chunk.
//!
//! Each sequence's cached keys are cut into pieces of `min(SPLIT_TOKENS, capacity)` keys from
//! its first key (`capacity`: the keys one binding holds expanded, or the caller's
//! `up_proj_chunk`), and whole pieces are packed into chunks of at most `capacity` keys in
//! batch order. For each chunk the latent rows are decoded from the latent pools
//! (`dequantize_gather`), expanded to `K[t, h] = [W_UK[h] c_kv_t ; k_pe_t]` and
//! `V[t, h] = W_UV[h]^T c_kv_t` in one scratch pair, and the attention kernel runs over them as
//! if they were pool buffer `chunk index` of an f32 MHA cache with block size 1. The plan cuts
//! work items at chunk boundaries as it cuts them at pool buffer boundaries, which fall on piece
//! boundaries only, so a row's splits depend on its own sequence (and the binding size), never
//! on the rest of the batch; the chunks' partial states are merged once, in key order, at the
//! end.

use super::cache::MlaCache;
use super::head_matmul::{HeadMatmul, RowStrides};
use super::plan::{MlaArgs, MlaIo};
use super::strided_copy::StridedCopy;
use super::weights::MlaWeights;
use crate::attention::paged::{
    KvGeometry, PagedAttentionArgs, PagedAttentionPlan, SeqSpec, SPLIT_TOKENS,
};
use crate::attention::{AttentionOptions, AttentionShape};
use crate::cache::pool::{PoolLayout, TensorScale};
use crate::gpu::Context;
use crate::problem::MlaShape;
use crate::quant::dequant::encode_dequantize_gather;
use crate::quant::{KvDtype, ScaleMode};
use crate::{Error, Result};

/// Latent rows to decode for one chunk: per latent pool buffer, (chunk row, pool row) pairs.
type ChunkGather = Vec<(usize, Vec<(u32, u32)>)>;

/// Plan and scratch buffers of the up-projection path.
#[derive(Debug)]
pub(crate) struct UpProjPlan {
    shape: MlaShape,
    total_q: usize,
    attention: PagedAttentionPlan,
    gathers: Vec<ChunkGather>,
    /// `[total_q, H, d_nope + d_rope]`.
    q_cat: wgpu::Buffer,
    /// `[chunk, rank]` and `[chunk, d_rope]`: the chunk's decoded latent rows and RoPE keys.
    c_kv: wgpu::Buffer,
    k_pe: wgpu::Buffer,
    /// `[chunk, H, d_nope + d_rope]` and `[chunk, H, d_v]`: the chunk's expanded K and V.
    k_exp: wgpu::Buffer,
    v_exp: wgpu::Buffer,
    /// The expanded pools' (unit) tensor scale.
    unit_scale: wgpu::Buffer,
}

/// Keys per chunk: as many as one binding holds expanded, or `requested`.
fn chunk_tokens(ctx: &Context, s: &MlaShape, requested: Option<usize>) -> Result<usize> {
    let caps = ctx.caps();
    let binding = caps
        .max_storage_buffer_binding_size
        .min(caps.max_buffer_size);
    let row_bytes = (s.num_heads * (s.d_nope + s.d_rope).max(s.d_v) * 4) as u64;
    let fit = (binding / row_bytes) as usize;
    if fit == 0 {
        return Err(Error::TooLarge {
            what: "one expanded key row of every head".into(),
            bytes: row_bytes,
            limit: binding,
        });
    }
    match requested {
        Some(0) => Err(Error::InvalidArgument(
            "the up-projection chunk needs at least one key".into(),
        )),
        Some(n) if n > fit => Err(Error::TooLarge {
            what: format!("an up-projection chunk of {n} keys"),
            bytes: n as u64 * row_bytes,
            limit: binding,
        }),
        Some(n) => Ok(n),
        None => Ok(fit),
    }
}

impl UpProjPlan {
    pub(crate) fn new(ctx: &Context, cache: &MlaCache, args: &MlaArgs) -> Result<Self> {
        let s = args.shape;
        let h = s.num_heads;
        let dq = s.d_nope + s.d_rope;
        if args.batch.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
        let latent = cache.cache();
        let alloc = latent.allocator();
        let pools = latent.layer(0)?;
        let (bs, bpb) = (latent.config().block_size, pools.k.blocks_per_buffer());
        // Each sequence's keys are cut into pieces at multiples of `piece` from its first key,
        // and whole pieces are packed into chunks in batch order. A chunk is a pool buffer of
        // the attention plan, which cuts work items where a sequence's keys change buffer:
        // here only at piece boundaries, which depend on the sequence and the device's binding
        // size alone (with chunks of at least SPLIT_TOKENS keys, at split boundaries, which cut
        // items anyway), so a row's splits, and its bits, never depend on the rest of the
        // batch.
        let capacity = chunk_tokens(ctx, &s, args.up_proj_chunk)?;
        let piece = capacity.min(SPLIT_TOKENS);
        // Per chunk: (pool buffer, pool row) of each latent row it holds. Key ids are
        // chunk * capacity + row in the chunk.
        let mut chunks: Vec<Vec<(usize, u32)>> = Vec::new();
        let mut seqs = Vec::with_capacity(args.batch.len());
        let mut q_base = 0;
        for query in args.batch {
            let len_k = alloc.len(query.seq)?;
            let table = alloc.blocks(query.seq)?;
            let mut ids = Vec::with_capacity(len_k);
            for p0 in (0..len_k).step_by(piece) {
                let n = piece.min(len_k - p0);
                if chunks.last().is_none_or(|c| c.len() + n > capacity) {
                    chunks.push(Vec::new());
                }
                let b = chunks.len() - 1;
                let rows = &mut chunks[b];
                for j in p0..p0 + n {
                    let id = u32::try_from(b * capacity + rows.len()).map_err(|_| {
                        Error::InvalidArgument(format!(
                            "{} chunks of {capacity} keys exceed the u32 block ids of the \
                             expanded cache",
                            b + 1
                        ))
                    })?;
                    ids.push(id);
                    let block = table[j / bs] as usize;
                    rows.push((block / bpb, ((block % bpb) * bs + j % bs) as u32));
                }
            }
            seqs.push(SeqSpec {
                q_base,
                len_q: query.len_q,
                len_k,
                table: ids,
            });
            q_base += query.len_q;
        }
        // Rows of the scratch chunk: the fullest chunk's.
        let chunk = chunks.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let gathers = chunks
            .iter()
            .map(|rows| {
                let mut by_buffer: ChunkGather = Vec::new();
                for (i, &(buffer, row)) in rows.iter().enumerate() {
                    match by_buffer.iter_mut().find(|(b, _)| *b == buffer) {
                        Some((_, pairs)) => pairs.push((i as u32, row)),
                        None => by_buffer.push((buffer, vec![(i as u32, row)])),
                    }
                }
                by_buffer
            })
            .collect::<Vec<_>>();
        let expanded = |head_dim| PoolLayout {
            num_kv_heads: h,
            head_dim,
            dtype: KvDtype::F32,
            block_size: 1,
            scale: ScaleMode::PerRow,
        };
        let geometry = KvGeometry {
            k: expanded(dq),
            v: expanded(s.d_v),
            blocks_per_buffer: capacity,
            num_buffers: gathers.len(),
            per_buffer: true,
            mla: false,
        };
        let options = AttentionOptions {
            scale: Some(args.scale()?),
            ..AttentionOptions::default()
        };
        let attention = PagedAttentionPlan::from_specs(
            ctx,
            &PagedAttentionArgs {
                layer: args.layer,
                batch: args.batch,
                shape: AttentionShape {
                    num_q_heads: h,
                    num_kv_heads: h,
                    head_dim_qk: dq,
                    head_dim_v: s.d_v,
                },
                options: &options,
                precision: args.precision,
            },
            &geometry,
            &seqs,
            SPLIT_TOKENS,
        )?;
        let total_q = q_base;
        Ok(Self {
            shape: s,
            total_q,
            attention,
            gathers,
            q_cat: ctx.filled("mla q_cat", total_q * h * dq, crate::gpu::UNWRITTEN)?,
            c_kv: ctx.filled("mla chunk c_kv", chunk * s.rank, crate::gpu::UNWRITTEN)?,
            k_pe: ctx.filled("mla chunk k_pe", chunk * s.d_rope, crate::gpu::UNWRITTEN)?,
            k_exp: ctx.filled("mla chunk K", chunk * h * dq, crate::gpu::UNWRITTEN)?,
            v_exp: ctx.filled("mla chunk V", chunk * h * s.d_v, crate::gpu::UNWRITTEN)?,
            unit_scale: ctx.uniform(
                "unit tensor scale",
                &TensorScale {
                    scale: 1.0,
                    inv_scale: 1.0,
                    ..Default::default()
                },
            )?,
        })
    }

    /// Records the path into `pass`, chunk after chunk of keys: the joined queries, then per
    /// chunk the latent rows' decoding, the expansion to K and V and the attention over them,
    /// then the merge of every chunk's partial states; nothing is submitted. The chunks share
    /// one scratch K/V pair: the dispatches of one pass run in order, each seeing the writes of
    /// the ones before. The projections and copies of every chunk are checked and their bind
    /// groups made first; the decoding (row lists the plan made) and the attention plan (the
    /// plan's scratch and `io.out`/`io.lse`, which [`MlaPlan::encode`](super::MlaPlan::encode)
    /// checked before) make theirs as they record.
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
        let dq = s.d_nope + s.d_rope;
        let config = cache.cache().config();
        let (k_layout, v_layout) = (config.k_layout_of(layer), config.v_layout_of(layer));
        let pools = cache.cache().layer(layer)?;
        // q = [q_nope ; q_pe] per head.
        let mut queries = Vec::with_capacity(2);
        for (src, n, offset, row) in [
            (io.q_nope, s.d_nope, 0, s.d_nope),
            (io.q_pe, s.d_rope, s.d_nope, s.d_rope),
        ] {
            queries.push(
                StridedCopy {
                    rows: t,
                    heads: h,
                    n,
                    src: RowStrides::dense(0, h, row),
                    dst: RowStrides {
                        offset,
                        row: h * dq,
                        head: dq,
                    },
                }
                .prepare(ctx, src, &self.q_cat)?,
            );
        }
        let k_rows = RowStrides::dense(0, h, dq);
        let latent = RowStrides {
            offset: 0,
            row: s.rank,
            head: 0,
        };
        let mut expansions = Vec::with_capacity(self.gathers.len());
        for gather in &self.gathers {
            // The chunk's keys: every pool buffer's rows of it.
            let rows = gather.iter().map(|(_, pairs)| pairs.len()).sum();
            // K_nope[t, h, n] = sum_r c_kv[t, r] W_UK[h, n, r], into columns 0..d_nope.
            let k_nope = HeadMatmul {
                rows,
                heads: h,
                inner: s.rank,
                n_out: s.d_nope,
                x: latent,
                w_head: s.d_nope * s.rank,
                w_k: 1,
                w_n: s.rank,
                y: k_rows,
            }
            .prepare(ctx, &self.c_kv, weights.w_uk(), &self.k_exp)?;
            // k_pe, shared by every head, into columns d_nope..
            let k_pe = StridedCopy {
                rows,
                heads: h,
                n: s.d_rope,
                src: RowStrides {
                    offset: 0,
                    row: s.d_rope,
                    head: 0,
                },
                dst: RowStrides {
                    offset: s.d_nope,
                    ..k_rows
                },
            }
            .prepare(ctx, &self.k_pe, &self.k_exp)?;
            // V[t, h, v] = sum_r c_kv[t, r] W_UV[h, r, v].
            let v = HeadMatmul {
                rows,
                heads: h,
                inner: s.rank,
                n_out: s.d_v,
                x: latent,
                w_head: s.rank * s.d_v,
                w_k: s.d_v,
                w_n: 1,
                y: RowStrides::dense(0, h, s.d_v),
            }
            .prepare(ctx, &self.c_kv, weights.w_uv(), &self.v_exp)?;
            expansions.push((k_nope, k_pe, v));
        }
        for copy in &queries {
            copy.encode(pass);
        }
        for (b, (gather, (k_nope, k_pe, v))) in self.gathers.iter().zip(&expansions).enumerate() {
            for (buffer, pairs) in gather {
                encode_dequantize_gather(
                    ctx,
                    pass,
                    &pools.k.buffers()[*buffer],
                    &k_layout,
                    pairs,
                    &self.c_kv,
                )?;
                encode_dequantize_gather(
                    ctx,
                    pass,
                    &pools.v.buffers()[*buffer],
                    &v_layout,
                    pairs,
                    &self.k_pe,
                )?;
            }
            k_nope.encode(pass);
            k_pe.encode(pass);
            v.encode(pass);
            self.attention.encode_attend_buffer(
                ctx,
                pass,
                b,
                (&self.k_exp, &self.v_exp),
                (&self.unit_scale, &self.unit_scale),
                &self.q_cat.as_entire_buffer_binding(),
            )?;
        }
        self.attention.encode_merge(
            ctx,
            pass,
            &io.out.as_entire_buffer_binding(),
            &io.lse.as_entire_buffer_binding(),
        )
    }
}
