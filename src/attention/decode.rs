//! Decode attention (one query token per sequence) over a contiguous KV cache.
//!
//! K and V are laid out as in the FlashAttention varlen convention, `[total_k, Hkv, d]`, in f32,
//! f16 or bf16 storage (packed into u32 words as ARCHITECTURE.md section 6 says, rows back to
//! back). Where every row is a whole number of 16-byte units (f32 at any head dim, f16/bf16 at
//! multiples of 8) that is exactly a paged pool with one-token blocks whose block table is the
//! identity; otherwise a pool pads each row to 16 bytes ([`KvDtype::row_stride`]), so the rows
//! are first copied on the GPU into a zeroed temporary pool of that layout
//! ([`crate::mla::strided_copy`], recorded in the same pass). Either way this runs the paged
//! kernel ([`super::paged`]) over that pool, with the bits of a pool-based run over the same
//! rows: a workgroup serves one (sequence, KV head, split) and the GQA group of its query (the
//! whole group when it fits workgroup memory), so each K/V row is read once per tile.

use super::paged::{self, KvGeometry, PagedAttentionArgs, PagedAttentionPlan, SeqSpec};
use crate::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use crate::cache::pool::PoolLayout;
use crate::gpu::dispatch::RowStrides;
use crate::gpu::Context;
use crate::mla::strided_copy::{PreparedCopy, StridedCopy};
use crate::quant::{encode_rows, KvDtype, ScaleMode};
use crate::reference::AttentionOutput;
use crate::shader::Precision;
use crate::{Error, Result};

/// Storage formats this kernel reads.
pub const SUPPORTED: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

/// GPU buffers and metadata of one decode call.
#[derive(Debug, Clone, Copy)]
pub struct DecodeArgs<'a> {
    /// Heads and head dimensions.
    pub shape: AttentionShape,
    /// Masking and score options (`causal` makes no difference to a single query at the end).
    pub options: &'a AttentionOptions,
    /// Which kernel variant to run; [`Precision::F16`] needs `SHADER_F16`.
    pub precision: Precision,
    /// `[num_seqs, Hq, d_qk]` f32.
    pub q: &'a wgpu::Buffer,
    /// K rows `[total_k, Hkv, d_qk]` packed in `k_dtype`, back to back (no padding between
    /// rows), in a buffer of at least their bytes rounded up to a multiple of 16 (the kernel
    /// reads 16 bytes at a time). Rows that are not whole 16-byte units (f16/bf16 at head dims
    /// that are not multiples of 8) are re-laid into a temporary padded pool first.
    pub k: &'a wgpu::Buffer,
    /// V rows `[total_k, Hkv, d_v]` packed in `v_dtype`, laid out like `k`.
    pub v: &'a wgpu::Buffer,
    /// Storage format of K.
    pub k_dtype: KvDtype,
    /// Storage format of V.
    pub v_dtype: KvDtype,
    /// Key offsets of the sequences, `[num_seqs + 1]`, starting at 0; every sequence needs at
    /// least one key.
    pub cu_seqlens_k: &'a [u32],
    /// Output `[num_seqs, Hq, d_v]` f32.
    pub out: &'a wgpu::Buffer,
    /// Log-sum-exp `[num_seqs, Hq]` f32.
    pub lse: &'a wgpu::Buffer,
}

fn check_buffer(what: &str, buffer: &wgpu::Buffer, bytes: u64) -> Result<()> {
    if buffer.size() < bytes {
        return Err(Error::InvalidArgument(format!(
            "{what} buffer holds {} bytes, the call needs {bytes}",
            buffer.size()
        )));
    }
    Ok(())
}

impl DecodeArgs<'_> {
    /// Checks everything that can be checked before dispatch.
    pub fn validate(&self, ctx: &Context) -> Result<()> {
        let shape = &self.shape;
        shape.validate()?;
        self.options.validate(shape)?;
        for (name, dtype) in [("K", self.k_dtype), ("V", self.v_dtype)] {
            if !SUPPORTED.contains(&dtype) {
                return Err(Error::InvalidArgument(format!(
                    "{name} dtype {dtype}: the contiguous decode kernel reads f32, f16 or bf16"
                )));
            }
        }
        self.k_dtype.check_head_dim(shape.head_dim_qk)?;
        self.v_dtype.check_head_dim(shape.head_dim_v)?;
        if self.precision == Precision::F16 && !ctx.caps().shader_f16 {
            return Err(Error::MissingFeature("shader-f16"));
        }
        let cu = self.cu_seqlens_k;
        if cu.len() < 2 || cu[0] != 0 {
            return Err(Error::InvalidArgument(
                "cu_seqlens_k needs num_seqs + 1 >= 2 entries starting at 0".into(),
            ));
        }
        if let Some(i) = cu.windows(2).position(|w| w[1] <= w[0]) {
            return Err(Error::InvalidArgument(format!(
                "sequence {i} has no keys (cu_seqlens_k must increase strictly)"
            )));
        }
        let num_seqs = (cu.len() - 1) as u64;
        let total_k = u64::from(cu[cu.len() - 1]);
        let (hq, hkv) = (shape.num_q_heads as u64, shape.num_kv_heads as u64);
        let rows = total_k * hkv;
        check_buffer("q", self.q, num_seqs * hq * shape.head_dim_qk as u64 * 4)?;
        // The kernel reads K and V 16 bytes at a time: their bytes rounded up to 16.
        check_buffer(
            "k",
            self.k,
            (rows * self.k_dtype.words_per_row(shape.head_dim_qk) as u64 * 4).next_multiple_of(16),
        )?;
        check_buffer(
            "v",
            self.v,
            (rows * self.v_dtype.words_per_row(shape.head_dim_v) as u64 * 4).next_multiple_of(16),
        )?;
        check_buffer("out", self.out, num_seqs * hq * shape.head_dim_v as u64 * 4)?;
        check_buffer("lse", self.lse, num_seqs * hq * 4)?;
        self.check_usage()
    }

    /// Checks that every buffer is a storage buffer and that `out` and `lse` are distinct, so
    /// that nothing the caller passed is refused once the K/V copies are recorded.
    fn check_usage(&self) -> Result<()> {
        for (name, buffer) in [
            ("q", self.q),
            ("k", self.k),
            ("v", self.v),
            ("out", self.out),
            ("lse", self.lse),
        ] {
            if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
                return Err(Error::InvalidArgument(format!(
                    "{name} buffer was not created with STORAGE usage"
                )));
            }
        }
        if self.out == self.lse {
            return Err(Error::InvalidArgument(
                "out and lse overlap in one buffer".into(),
            ));
        }
        Ok(())
    }

    /// The number of keys, `cu_seqlens_k`'s last entry (after [`validate`](Self::validate)).
    fn total_k(&self) -> usize {
        self.cu_seqlens_k.last().map_or(0, |&k| k as usize)
    }

    /// The pool of one-token blocks the kernel reads: K and V layouts, one buffer of `total_k`
    /// blocks.
    fn geometry(&self) -> KvGeometry {
        let layout = |dtype, head_dim| PoolLayout {
            num_kv_heads: self.shape.num_kv_heads,
            head_dim,
            dtype,
            block_size: 1,
            scale: ScaleMode::PerRow,
        };
        KvGeometry {
            k: layout(self.k_dtype, self.shape.head_dim_qk),
            v: layout(self.v_dtype, self.shape.head_dim_v),
            blocks_per_buffer: self.total_k(),
            num_buffers: 1,
            per_buffer: false,
            mla: false,
        }
    }

    /// One decode query per sequence over its keys, block table the identity.
    fn seqs(&self) -> Vec<SeqSpec> {
        self.cu_seqlens_k
            .windows(2)
            .enumerate()
            .map(|(i, w)| SeqSpec {
                q_base: i,
                len_q: 1,
                len_k: (w[1] - w[0]) as usize,
                table: (w[0]..w[1]).collect(),
            })
            .collect()
    }
}

/// K or V rows as the kernel reads them: a pool of one-token blocks.
enum PoolRows<'a> {
    /// The caller's rows already are that pool (every row a whole number of 16-byte units).
    Caller(&'a wgpu::Buffer),
    /// A zeroed temporary pool and the copy that fills its rows from the caller's.
    Padded {
        pool: wgpu::Buffer,
        copy: PreparedCopy,
    },
}

impl<'a> PoolRows<'a> {
    /// The rows of `buffer` (`[total_k, Hkv, d]`, `words_per_row` words each, back to back) as
    /// a pool of `layout` (one-token blocks): the buffer itself where the layouts agree, else a
    /// new pool of `total_k` blocks and its copy, prepared (nothing recorded).
    fn new(
        ctx: &Context,
        what: &str,
        buffer: &'a wgpu::Buffer,
        layout: &PoolLayout,
        total_k: usize,
    ) -> Result<Self> {
        let wpr = layout.words_per_row();
        if layout.row_stride() == wpr {
            return Ok(Self::Caller(buffer));
        }
        let copy = StridedCopy {
            rows: total_k,
            heads: layout.num_kv_heads,
            n: wpr,
            src: RowStrides::dense(0, layout.num_kv_heads, wpr),
            dst: RowStrides {
                offset: layout.row_in_block(0, 0),
                row: layout.block_words(),
                head: layout.row_in_block(1, 0),
            },
        };
        // Fresh buffers are zeroed: the padding words are 0, as in a pool.
        let pool = ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: (total_k as u64)
                .checked_mul(layout.block_bytes())
                .ok_or_else(|| Error::InvalidArgument(format!("{what}: size overflows")))?,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })?;
        let copy = copy.prepare(ctx, buffer, &pool)?;
        Ok(Self::Padded { pool, copy })
    }

    /// Records the copy into the temporary pool, if any.
    fn encode_copy(&self, pass: &mut wgpu::ComputePass<'_>) {
        if let Self::Padded { copy, .. } = self {
            copy.encode(pass);
        }
    }

    /// The buffer the kernel binds.
    fn pool(&self) -> &wgpu::Buffer {
        match self {
            Self::Caller(buffer) => buffer,
            Self::Padded { pool, .. } => pool,
        }
    }
}

/// Runs decode attention; writes `out` and `lse`: [`encode_decode`] in a compute pass of its
/// own, submitted (one submission). Nothing is submitted if validation fails.
pub fn decode(ctx: &Context, args: &DecodeArgs) -> Result<()> {
    ctx.run_pass("decode attention", |pass| encode_decode(ctx, pass, args))?;
    Ok(())
}

/// Records decode attention into `pass`; submits nothing. Its plan's metadata is written with
/// [`Context::write_buffer`] and lands at the next submission, which must contain this pass.
/// Where K or V rows are not whole 16-byte units (f16/bf16 at head dims that are not multiples
/// of 8), a copy of them into a temporary padded pool (kvattn's own buffer, kept alive by the
/// recorded pass) is recorded before the attention. Every argument is checked, the plan and the
/// temporary pools made and the copies' bind groups made before anything is recorded; the
/// attention's bind groups are made (and its dispatches recorded) after the copies.
///
/// # Errors
/// What [`DecodeArgs::validate`] refuses (a buffer without `STORAGE` usage, `out` and `lse` the
/// same buffer included); [`Error::Wgpu`] or [`Error::OutOfMemory`] when the device refuses a
/// binding or a temporary pool. Only a device refusing to bind `q`, `out` or `lse` (buffers of
/// another device) can fail once copies are recorded, and those copies write nothing but the
/// temporary pools.
pub fn encode_decode(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    args: &DecodeArgs,
) -> Result<()> {
    args.validate(ctx)?;
    let geometry = args.geometry();
    let plan = PagedAttentionPlan::from_specs(
        ctx,
        &PagedAttentionArgs {
            layer: 0,
            batch: &[],
            shape: args.shape,
            options: args.options,
            precision: args.precision,
        },
        &geometry,
        &args.seqs(),
        paged::SPLIT_TOKENS,
    )?;
    let total_k = args.total_k();
    let k = PoolRows::new(ctx, "decode K pool", args.k, &geometry.k, total_k)?;
    let v = PoolRows::new(ctx, "decode V pool", args.v, &geometry.v, total_k)?;
    let ones = ctx.uniform("unit scale", &geometry.k.tensor_scale()?)?;
    k.encode_copy(pass);
    v.encode_copy(pass);
    plan.encode_on(
        ctx,
        pass,
        &[(k.pool(), v.pool())],
        (&ones, &ones),
        (
            &args.q.as_entire_buffer_binding(),
            &args.out.as_entire_buffer_binding(),
            &args.lse.as_entire_buffer_binding(),
        ),
    )
}

/// Storage formats and kernel precision of a [`decode_batch`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeConfig {
    /// Storage format K is encoded into.
    pub k_dtype: KvDtype,
    /// Storage format V is encoded into.
    pub v_dtype: KvDtype,
    /// Kernel variant.
    pub precision: Precision,
}

impl Default for DecodeConfig {
    /// f32 storage, portable kernel.
    fn default() -> Self {
        Self {
            k_dtype: KvDtype::F32,
            v_dtype: KvDtype::F32,
            precision: Precision::F32,
        }
    }
}

/// Decode over host data: encodes `batch.k`/`batch.v` into the storage formats of `config`,
/// uploads everything, runs [`decode`] and reads `out` and `lse` back. Every sequence must have
/// exactly one query. Every head dim the formats take works (f16/bf16 rows that are not whole
/// 16-byte units go through [`decode`]'s padded pool). This is what tests and `kvattn verify`
/// use; a serving loop keeps its buffers on the GPU and calls [`decode`].
pub fn decode_batch(
    ctx: &Context,
    batch: &RaggedBatch,
    shape: &AttentionShape,
    options: &AttentionOptions,
    config: &DecodeConfig,
) -> Result<AttentionOutput> {
    pollster::block_on(decode_batch_async(ctx, batch, shape, options, config))
}

/// [`decode_batch`] without blocking: the form to await in the browser.
pub async fn decode_batch_async(
    ctx: &Context,
    batch: &RaggedBatch<'_>,
    shape: &AttentionShape,
    options: &AttentionOptions,
    config: &DecodeConfig,
) -> Result<AttentionOutput> {
    batch.validate(shape, options)?;
    if let Some(seq) = (0..batch.num_seqs()).find(|&s| batch.seq_lens(s).0 != 1) {
        return Err(Error::InvalidArgument(format!(
            "decode takes one query per sequence; sequence {seq} has {}",
            batch.seq_lens(seq).0
        )));
    }
    for dtype in [config.k_dtype, config.v_dtype] {
        if !SUPPORTED.contains(&dtype) {
            return Err(Error::InvalidArgument(format!(
                "the contiguous decode kernel reads f32, f16 or bf16, not {dtype}"
            )));
        }
    }
    if config.precision == Precision::F16 && !ctx.caps().shader_f16 {
        return Err(Error::MissingFeature("shader-f16"));
    }
    let k = encode_rows(
        config.k_dtype,
        shape.head_dim_qk,
        batch.k,
        ScaleMode::PerRow,
    )?;
    let v = encode_rows(config.v_dtype, shape.head_dim_v, batch.v, ScaleMode::PerRow)?;
    let num_seqs = batch.num_seqs();
    let out_len = num_seqs * shape.num_q_heads * shape.head_dim_v;
    let lse_len = num_seqs * shape.num_q_heads;
    let q = ctx.upload("q", batch.q)?;
    // The buffers' ends padded to whole 16-byte units, as `DecodeArgs` needs.
    let padded = |mut words: Vec<u32>| {
        words.resize(words.len().next_multiple_of(4), 0);
        words
    };
    let k = ctx.upload("k", &padded(k.words))?;
    let v = ctx.upload("v", &padded(v.words))?;
    let out = ctx.filled("out", out_len, crate::gpu::UNWRITTEN)?;
    let lse = ctx.filled("lse", lse_len, crate::gpu::UNWRITTEN)?;
    decode(
        ctx,
        &DecodeArgs {
            shape: *shape,
            options,
            precision: config.precision,
            q: &q,
            k: &k,
            v: &v,
            k_dtype: config.k_dtype,
            v_dtype: config.v_dtype,
            cu_seqlens_k: batch.cu_seqlens_k,
            out: &out,
            lse: &lse,
        },
    )?;
    Ok(AttentionOutput {
        out: ctx.read_back_async(&out, out_len).await?,
        lse: ctx.read_back_async(&lse, lse_len).await?,
    })
}
