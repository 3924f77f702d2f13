//! Decode attention (one query token per sequence) over a contiguous KV cache
//! (`shaders/decode.wgsl`).
//!
//! K and V are laid out as in the FlashAttention varlen convention, `[total_k, Hkv, d]`, in f32,
//! f16 or bf16 storage (packed into u32 words as DESIGN.md section 5 says). A workgroup serves
//! one (sequence, KV head, tile of query heads): the whole GQA group when it fits, so each K/V
//! row is read once per tile.

use crate::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use crate::gpu::Context;
use crate::pipeline::PipelineKey;
use crate::quant::{encode_rows, KvDtype, ScaleMode};
use crate::reference::AttentionOutput;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `DecodeParams` uniform.
    pub struct DecodeParams {
        /// Sequences in the batch.
        pub num_seqs: u32,
        /// Query heads.
        pub num_q_heads: u32,
        /// KV heads.
        pub num_kv_heads: u32,
        /// Tiles of query heads per KV head.
        pub q_tiles: u32,
        /// Score scale.
        pub scale: f32,
        /// Logit softcap, 0 for none.
        pub softcap: f32,
        /// Sliding window in keys, 0 for none.
        pub window: u32,
        /// Bit 0: sinks, bit 1: ALiBi.
        pub flags: u32,
    }
}

/// Invocations per workgroup.
const WG: u32 = 64;
/// Largest tile of query heads (the WGSL `MAX_TILE`).
const MAX_TILE: usize = 16;
/// Output vec4s each invocation accumulates (the WGSL `MAX_ACC`).
const MAX_ACC: usize = 8;
/// Workgroup memory the query tile may take, in bytes.
const Q_TILE_BYTES: usize = 8192;

/// How a decode call is split into workgroups, derived from the shape alone (never from the
/// batch, so results do not depend on what else is batched).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlan {
    /// Query heads per workgroup.
    pub tile: usize,
    /// Tiles per KV head.
    pub q_tiles: usize,
}

impl DecodePlan {
    /// The plan for `shape` in `precision`: the largest tile of the group whose query rows fit
    /// the workgroup-memory budget and whose outputs fit the invocations' accumulators, with
    /// the group split into tiles of equal size.
    pub fn new(shape: &AttentionShape, precision: Precision) -> Self {
        let bytes = match precision {
            Precision::F32 => 4,
            Precision::F16 => 2,
        };
        let group = shape.group();
        let by_memory = Q_TILE_BYTES / (shape.head_dim_qk * bytes);
        let by_acc = MAX_ACC * 4 * WG as usize / shape.head_dim_v;
        let max_tile = MAX_TILE.min(by_memory).min(by_acc).max(1);
        let q_tiles = group.div_ceil(max_tile);
        Self {
            tile: group.div_ceil(q_tiles),
            q_tiles,
        }
    }

    fn constants(
        &self,
        shape: &AttentionShape,
        k: KvDtype,
        v: KvDtype,
    ) -> Vec<(&'static str, f64)> {
        vec![
            ("WG", f64::from(WG)),
            ("GROUP", shape.group() as f64),
            ("TILE", self.tile as f64),
            ("K_DIM", shape.head_dim_qk as f64),
            ("V_DIM", shape.head_dim_v as f64),
            ("K_DTYPE", f64::from(k.code())),
            ("V_DTYPE", f64::from(v.code())),
        ]
    }
}

/// Override constants for the shapes the naga tests validate: small and large heads, MHA, GQA
/// and MQA, in every storage format this kernel reads.
pub fn representative_constants(precision: Precision) -> Vec<Vec<(&'static str, f64)>> {
    let shapes = [
        (1, 1, 64, 64),
        (32, 8, 128, 128),
        (32, 1, 256, 256),
        (8, 1, 80, 96),
        (16, 1, 1024, 1024),
    ];
    let mut sets = Vec::new();
    for (i, &(hq, hkv, dk, dv)) in shapes.iter().enumerate() {
        let shape = AttentionShape {
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim_qk: dk,
            head_dim_v: dv,
        };
        let dtype = SUPPORTED[i % SUPPORTED.len()];
        sets.push(DecodePlan::new(&shape, precision).constants(&shape, dtype, dtype));
    }
    sets
}

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
    /// K rows `[total_k, Hkv, d_qk]` packed in `k_dtype`.
    pub k: &'a wgpu::Buffer,
    /// V rows `[total_k, Hkv, d_v]` packed in `v_dtype`.
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
        check_buffer(
            "k",
            self.k,
            rows * self.k_dtype.words_per_row(shape.head_dim_qk) as u64 * 4,
        )?;
        check_buffer(
            "v",
            self.v,
            rows * self.v_dtype.words_per_row(shape.head_dim_v) as u64 * 4,
        )?;
        check_buffer("out", self.out, num_seqs * hq * shape.head_dim_v as u64 * 4)?;
        check_buffer("lse", self.lse, num_seqs * hq * 4)?;
        Ok(())
    }
}

/// Runs decode attention; writes `out` and `lse`. Nothing is dispatched if validation fails.
pub fn decode(ctx: &Context, args: &DecodeArgs) -> Result<()> {
    args.validate(ctx)?;
    let shape = &args.shape;
    let opts = args.options;
    let plan = DecodePlan::new(shape, args.precision);
    let num_seqs = args.cu_seqlens_k.len() - 1;

    let mut meta: Vec<u32> = args.cu_seqlens_k.to_vec();
    let zeros = vec![0.0f32; shape.num_q_heads];
    let sinks = opts.sinks.as_deref().unwrap_or(&zeros);
    let slopes = opts.alibi_slopes.as_deref().unwrap_or(&zeros);
    meta.extend(sinks.iter().chain(slopes).map(|x| x.to_bits()));
    let flags = u32::from(opts.sinks.is_some()) | (u32::from(opts.alibi_slopes.is_some()) << 1);
    let params = DecodeParams {
        num_seqs: num_seqs as u32,
        num_q_heads: shape.num_q_heads as u32,
        num_kv_heads: shape.num_kv_heads as u32,
        q_tiles: plan.q_tiles as u32,
        scale: opts.scale_for(shape),
        softcap: opts.softcap.unwrap_or(0.0),
        window: u32::try_from(opts.sliding_window.unwrap_or(0)).unwrap_or(u32::MAX),
        flags,
    };

    let key = PipelineKey::new(
        ShaderVariant {
            kernel: Kernel::Decode,
            precision: args.precision,
        },
        &plan.constants(shape, args.k_dtype, args.v_dtype),
    );
    let pipeline = ctx.pipeline(&key)?;
    let uniform = ctx.uniform("decode params", &params);
    let meta = ctx.upload("decode meta", &meta)?;
    let workgroups = [
        (shape.num_kv_heads * plan.q_tiles) as u32,
        num_seqs as u32,
        1,
    ];
    ctx.dispatch(
        &pipeline,
        &[&uniform, args.q, args.k, args.v, &meta, args.out, args.lse],
        workgroups,
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
    let k = ctx.upload("k", &k.words)?;
    let v = ctx.upload("v", &v.words)?;
    let out = ctx.filled("out", out_len, f32::NAN)?;
    let lse = ctx.filled("lse", lse_len, f32::NAN)?;
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
