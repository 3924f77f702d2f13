//! Decode attention (one query token per sequence) over a contiguous KV cache.
//!
//! K and V are laid out as in the FlashAttention varlen convention, `[total_k, Hkv, d]`, in f32,
//! f16 or bf16 storage (packed into u32 words as ARCHITECTURE.md section 6 says). That is exactly a
//! paged pool with one-token blocks whose block table is the identity, so this runs the paged
//! kernel ([`super::paged`]): a workgroup serves one (sequence, KV head, split) and the GQA group
//! of its query (the whole group when it fits workgroup memory), so each K/V row is read once
//! per tile.

use super::paged::{self, KvGeometry, PagedAttentionArgs, PagedAttentionPlan, SeqSpec};
use crate::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use crate::cache::pool::PoolLayout;
use crate::gpu::Context;
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
    /// K rows `[total_k, Hkv, d_qk]` packed in `k_dtype`, in a buffer of at least their bytes
    /// rounded up to a multiple of 16 (the kernel reads 16 bytes at a time).
    pub k: &'a wgpu::Buffer,
    /// V rows `[total_k, Hkv, d_v]` packed in `v_dtype`, padded like `k`.
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
        // `[total_k, Hkv, d]` is a pool of one-token blocks only where rows need no 16-byte
        // padding (`KvDtype::row_stride`).
        for (dtype, d) in [
            (self.k_dtype, shape.head_dim_qk),
            (self.v_dtype, shape.head_dim_v),
        ] {
            if dtype.row_stride(d) != dtype.words_per_row(d) {
                return Err(Error::UnsupportedHeadDim {
                    head_dim: d,
                    reason: format!(
                        "the contiguous decode kernel reads {dtype} rows of whole 16-byte units: \
                         a multiple of 8"
                    ),
                });
            }
        }
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
        Ok(())
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
/// Everything is checked and every bind group made before anything is recorded.
///
/// # Errors
/// What [`DecodeArgs::validate`] refuses; [`Error::InvalidArgument`] for a buffer without
/// `STORAGE` usage; [`Error::Wgpu`] for a buffer the device refuses to bind.
pub fn encode_decode(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    args: &DecodeArgs,
) -> Result<()> {
    args.validate(ctx)?;
    let shape = args.shape;
    let cu = args.cu_seqlens_k;
    let total_k = cu[cu.len() - 1] as usize;
    let seqs: Vec<SeqSpec> = cu
        .windows(2)
        .enumerate()
        .map(|(i, w)| SeqSpec {
            q_base: i,
            len_q: 1,
            len_k: (w[1] - w[0]) as usize,
            table: (w[0]..w[1]).collect(),
        })
        .collect();
    let layout = |dtype, head_dim| PoolLayout {
        num_kv_heads: shape.num_kv_heads,
        head_dim,
        dtype,
        block_size: 1,
        scale: ScaleMode::PerRow,
    };
    let geometry = KvGeometry {
        k: layout(args.k_dtype, shape.head_dim_qk),
        v: layout(args.v_dtype, shape.head_dim_v),
        blocks_per_buffer: total_k,
        num_buffers: 1,
        per_buffer: false,
        mla: false,
    };
    for (name, buffer) in [("k", args.k), ("v", args.v)] {
        if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
            return Err(Error::InvalidArgument(format!(
                "{name} buffer was not created with STORAGE usage"
            )));
        }
    }
    let plan = PagedAttentionPlan::from_specs(
        ctx,
        &PagedAttentionArgs {
            layer: 0,
            batch: &[],
            shape,
            options: args.options,
            precision: args.precision,
        },
        &geometry,
        &seqs,
        paged::SPLIT_TOKENS,
    )?;
    let ones = ctx.uniform("unit scale", &geometry.k.tensor_scale()?)?;
    plan.encode_on(
        ctx,
        pass,
        &[(args.k, args.v)],
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
/// exactly one query. This is what tests and `kvattn verify` use; a serving loop keeps its
/// buffers on the GPU and calls [`decode`].
pub fn decode_batch(
    ctx: &Context,
    batch: &RaggedBatch,
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
    // Rows padded to whole 16-byte units, as `DecodeArgs` needs.
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
        out: ctx.read_back(&out, out_len)?,
        lse: ctx.read_back(&lse, lse_len)?,
    })
}
