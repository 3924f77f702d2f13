//! Building a case's caches, buffers and plan once ([`prepare`]), running it
//! ([`Prepared::run`]) and timing it ([`measure`]).

use super::fill::{fill_cache, values};
use super::{Case, CaseKernel};
use crate::attention::decode::{decode, DecodeArgs};
use crate::attention::paged::{PagedAttentionArgs, PagedAttentionPlan, PagedQuery};
use crate::attention::{AttentionOptions, AttentionShape};
use crate::bench::bandwidth::copy_bytes;
use crate::cache::append_kv::SourceDtype;
use crate::cache::paged::{AppendBatch, PagedKvCache, PoolSize};
use crate::gpu::{Context, STORAGE};
use crate::mla::{MlaArgs, MlaCache, MlaIo, MlaPath, MlaPlan, MlaWeights};
use crate::quant::{encode_rows, ScaleMode};
use crate::{Error, Result};

/// Workgroups of the copy kernel in a [`CaseKernel::Copy`] case.
const COPY_WORKGROUPS: u32 = 16384;
/// Distinct rows encoded for a contiguous cache (repeated to fill it).
const TEMPLATE_ROWS: usize = 4096;

/// A case with everything it needs on the GPU: filled caches, queries, outputs, the plan.
#[derive(Debug)]
pub struct Prepared {
    case: Case,
    work: Work,
}

#[derive(Debug)]
enum Work {
    Paged(Box<PagedWork>),
    Contiguous(Box<ContiguousWork>),
    Append(Box<AppendWork>),
    Mla(Box<MlaWork>),
    Copy(CopyWork),
}

/// Query, output and log-sum-exp buffers of an attention case.
#[derive(Debug)]
struct Io {
    q: wgpu::Buffer,
    out: wgpu::Buffer,
    lse: wgpu::Buffer,
}

#[derive(Debug)]
struct PagedWork {
    cache: PagedKvCache,
    plan: PagedAttentionPlan,
    io: Io,
}

#[derive(Debug)]
struct ContiguousWork {
    shape: AttentionShape,
    options: AttentionOptions,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    cu_seqlens_k: Vec<u32>,
    io: Io,
}

#[derive(Debug)]
struct AppendWork {
    cache: PagedKvCache,
    batch: AppendBatch,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
}

#[derive(Debug)]
struct MlaWork {
    cache: MlaCache,
    plan: MlaPlan,
    weights: MlaWeights,
    q_nope: wgpu::Buffer,
    q_pe: wgpu::Buffer,
    out: wgpu::Buffer,
    lse: wgpu::Buffer,
}

#[derive(Debug)]
struct CopyWork {
    src: wgpu::Buffer,
    dst: wgpu::Buffer,
    bytes: u64,
    workgroups: u32,
}

/// How long a case took over several runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measurement {
    /// Median seconds of one run (the mean of the two middle runs for an even count).
    pub median_seconds: f64,
    /// Fastest run, seconds.
    pub min_seconds: f64,
    /// Whether every run was timed with device timestamps (else the wall clock).
    pub timestamps: bool,
}

impl Prepared {
    /// The case.
    pub fn case(&self) -> &Case {
        &self.case
    }

    /// Submits one execution of the case; does not wait. Nothing is planned or uploaded here,
    /// except for the contiguous decode, whose public entry point
    /// ([`decode`](crate::attention::decode::decode)) plans its identity block table on every
    /// call (before its first pass, so device timestamps do not see it).
    ///
    /// # Errors
    /// GPU errors from the kernels.
    pub fn run(&self, ctx: &Context) -> Result<()> {
        match &self.work {
            Work::Paged(w) => w.plan.run(ctx, &w.cache, 0, &w.io.q, &w.io.out, &w.io.lse),
            Work::Contiguous(w) => decode(
                ctx,
                &DecodeArgs {
                    shape: w.shape,
                    options: &w.options,
                    precision: self.case.precision,
                    q: &w.io.q,
                    k: &w.k,
                    v: &w.v,
                    k_dtype: self.case.kv_dtype,
                    v_dtype: self.case.kv_dtype,
                    cu_seqlens_k: &w.cu_seqlens_k,
                    out: &w.io.out,
                    lse: &w.io.lse,
                },
            ),
            Work::Append(w) => w
                .cache
                .write_layer(ctx, 0, &w.batch, &w.k, &w.v, SourceDtype::F32),
            Work::Mla(w) => w.plan.run(
                ctx,
                &w.cache,
                0,
                &w.weights,
                &MlaIo {
                    q_nope: &w.q_nope,
                    q_pe: &w.q_pe,
                    out: &w.out,
                    lse: &w.lse,
                },
            ),
            Work::Copy(w) => copy_bytes(ctx, &w.src, &w.dst, w.bytes, w.workgroups),
        }
    }
}

/// Builds `case` on `ctx`: allocates its caches and fills them with validly encoded rows (GPU
/// appends of deterministic values), uploads queries, allocates outputs and plans the batch.
/// Waits for the GPU before returning.
///
/// # Errors
/// What [`Case::validate`] finds; [`Error::MissingFeature`] for an f16 kernel without
/// `SHADER_F16`; [`Error::TooLarge`] or [`Error::Wgpu`] when a buffer does not fit the adapter
/// (lavapipe allocates at most about 2 GiB at once).
pub fn prepare(ctx: &Context, case: &Case) -> Result<Prepared> {
    case.validate()?;
    if case.precision == crate::shader::Precision::F16 && !ctx.caps().shader_f16 {
        return Err(Error::MissingFeature("shader-f16"));
    }
    let work = match case.kernel {
        CaseKernel::Decode | CaseKernel::Prefill if case.paged => {
            Work::Paged(Box::new(paged(ctx, case)?))
        }
        CaseKernel::Decode | CaseKernel::Prefill => {
            Work::Contiguous(Box::new(contiguous(ctx, case)?))
        }
        CaseKernel::AppendKv => Work::Append(Box::new(append(ctx, case)?)),
        CaseKernel::MlaAbsorbed => Work::Mla(Box::new(mla(ctx, case)?)),
        CaseKernel::Copy => Work::Copy(copy(ctx, case)?),
    };
    ctx.wait()?;
    Ok(Prepared { case: *case, work })
}

/// Runs `prepared` `warmup` times untimed, then `repeats` times each timed with
/// [`Context::timed`] (device timestamps where the adapter has them).
///
/// # Errors
/// [`Error::InvalidArgument`] for zero repeats; GPU errors from the run; [`Error::Gpu`] when a
/// run's time is not a positive finite number.
pub fn measure(
    ctx: &Context,
    prepared: &Prepared,
    warmup: usize,
    repeats: usize,
) -> Result<Measurement> {
    if repeats == 0 {
        return Err(Error::InvalidArgument(
            "a measurement needs at least one repeat".into(),
        ));
    }
    for _ in 0..warmup {
        prepared.run(ctx)?;
        ctx.wait()?;
    }
    let mut times = Vec::with_capacity(repeats);
    let mut timestamps = true;
    for _ in 0..repeats {
        let ((), t) = ctx.timed(|| prepared.run(ctx))?;
        if !(t.seconds.is_finite() && t.seconds > 0.0) {
            return Err(Error::Gpu(format!(
                "case {}: a run timed {} s",
                prepared.case.id(),
                t.seconds
            )));
        }
        times.push(t.seconds);
        timestamps &= t.timestamps;
    }
    times.sort_by(f64::total_cmp);
    let n = times.len();
    let median = if n % 2 == 1 {
        times[n / 2]
    } else {
        0.5 * (times[n / 2 - 1] + times[n / 2])
    };
    Ok(Measurement {
        median_seconds: median,
        min_seconds: times[0],
        timestamps,
    })
}

fn attention_shape(case: &Case) -> AttentionShape {
    AttentionShape {
        num_q_heads: case.q_heads,
        num_kv_heads: case.kv_heads,
        head_dim_qk: case.head_dim,
        head_dim_v: case.head_dim,
    }
}

/// Queries of deterministic values and NaN-filled outputs for `rows` query rows.
fn attention_io(ctx: &Context, case: &Case, rows: usize) -> Result<Io> {
    Ok(Io {
        q: ctx.upload("bench q", &values(rows * case.head_dim, 3, 1.0))?,
        out: ctx.filled("bench out", rows * case.head_dim, crate::gpu::UNWRITTEN)?,
        lse: ctx.filled("bench lse", rows, crate::gpu::UNWRITTEN)?,
    })
}

fn blocks(case: &Case, tokens: usize) -> PoolSize {
    PoolSize::Blocks(case.batch * tokens.div_ceil(case.block_size))
}

fn paged(ctx: &Context, case: &Case) -> Result<PagedWork> {
    let mut cache = PagedKvCache::new(ctx, case.paged_config(), blocks(case, case.context))?;
    fill_cache(ctx, &mut cache, case.batch, case.context)?;
    let queries: Vec<PagedQuery> = (0..case.batch as u64)
        .map(|seq| PagedQuery {
            seq,
            len_q: case.chunk,
        })
        .collect();
    let options = AttentionOptions::default();
    let plan = PagedAttentionPlan::new(
        ctx,
        &cache,
        &PagedAttentionArgs {
            layer: 0,
            batch: &queries,
            shape: attention_shape(case),
            options: &options,
            precision: case.precision,
        },
    )?;
    let io = attention_io(ctx, case, case.batch * case.chunk * case.q_heads)?;
    Ok(PagedWork { cache, plan, io })
}

/// Fails with [`Error::TooLarge`] when a buffer of `bytes` would not fit one storage binding,
/// before its host data is built.
fn check_binding(ctx: &Context, what: &str, bytes: usize) -> Result<()> {
    let caps = ctx.caps();
    let limit = caps
        .max_storage_buffer_binding_size
        .min(caps.max_buffer_size);
    if bytes as u64 > limit {
        return Err(Error::TooLarge {
            what: what.to_string(),
            bytes: bytes as u64,
            limit,
        });
    }
    Ok(())
}

fn contiguous(ctx: &Context, case: &Case) -> Result<ContiguousWork> {
    let rows = case.batch * case.context * case.kv_heads;
    let wpr = case.kv_dtype.words_per_row(case.head_dim);
    check_binding(ctx, "the contiguous K buffer", rows * wpr * 4)?;
    let tiled = |seed| -> Result<wgpu::Buffer> {
        let template = values(rows.min(TEMPLATE_ROWS) * case.head_dim, seed, 1.0);
        let encoded = encode_rows(case.kv_dtype, case.head_dim, &template, ScaleMode::PerRow)?;
        let words: Vec<u32> = encoded
            .words
            .iter()
            .copied()
            .cycle()
            .take(rows * wpr)
            .collect();
        ctx.upload("bench contiguous kv", &words)
    };
    Ok(ContiguousWork {
        shape: attention_shape(case),
        options: AttentionOptions::default(),
        k: tiled(1)?,
        v: tiled(2)?,
        cu_seqlens_k: (0..=case.batch)
            .map(|s| (s * case.context) as u32)
            .collect(),
        io: attention_io(ctx, case, case.batch * case.q_heads)?,
    })
}

fn append(ctx: &Context, case: &Case) -> Result<AppendWork> {
    let mut cache = PagedKvCache::new(ctx, case.paged_config(), blocks(case, case.chunk))?;
    let mut batch = AppendBatch::new();
    for seq in 0..case.batch as u64 {
        cache.add_sequence(seq, &[])?;
        cache.append_tokens(ctx, &mut batch, seq, &vec![0; case.chunk])?;
    }
    let n = batch.len() * case.kv_heads * case.head_dim;
    check_binding(ctx, "the append source", n * 4)?;
    let k = ctx.upload("bench append k", &values(n, 1, 1.0))?;
    let v = ctx.upload("bench append v", &values(n, 2, 1.0))?;
    // The first write arranges the rows (kept in the batch) and fills the pools.
    cache.write_layer(ctx, 0, &batch, &k, &v, SourceDtype::F32)?;
    Ok(AppendWork { cache, batch, k, v })
}

fn mla(ctx: &Context, case: &Case) -> Result<MlaWork> {
    let s = case.mla_shape();
    let mut cache = MlaCache::new(ctx, case.mla_cache_config(), blocks(case, case.context))?;
    fill_cache(ctx, cache.cache_mut(), case.batch, case.context)?;
    let queries: Vec<PagedQuery> = (0..case.batch as u64)
        .map(|seq| PagedQuery { seq, len_q: 1 })
        .collect();
    let plan = MlaPlan::new(
        ctx,
        &cache,
        &MlaArgs {
            layer: 0,
            batch: &queries,
            shape: s,
            scale: None,
            precision: case.precision,
            path: MlaPath::Absorbed,
            up_proj_chunk: None,
        },
    )?;
    let inv_sqrt = |d: usize| 1.0 / (d as f32).sqrt();
    let w_uk = values(s.num_heads * s.d_nope * s.rank, 4, inv_sqrt(s.d_nope));
    let w_uv = values(s.num_heads * s.rank * s.d_v, 5, inv_sqrt(s.rank));
    let weights = MlaWeights::upload(ctx, &s, &w_uk, &w_uv)?;
    let rows = case.batch * s.num_heads;
    Ok(MlaWork {
        cache,
        plan,
        weights,
        q_nope: ctx.upload("bench q_nope", &values(rows * s.d_nope, 6, 1.0))?,
        q_pe: ctx.upload("bench q_pe", &values(rows * s.d_rope, 7, 1.0))?,
        out: ctx.filled("bench out", rows * s.d_v, crate::gpu::UNWRITTEN)?,
        lse: ctx.filled("bench lse", rows, crate::gpu::UNWRITTEN)?,
    })
}

fn copy(ctx: &Context, case: &Case) -> Result<CopyWork> {
    let bytes = case.copy_bytes();
    check_binding(ctx, "the copy buffers", bytes as usize)?;
    if bytes == 0 {
        return Err(Error::InvalidArgument(format!(
            "case {}: nothing to copy",
            case.id()
        )));
    }
    let buffer = |label| {
        ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes,
            usage: STORAGE,
            mapped_at_creation: false,
        })
    };
    Ok(CopyWork {
        src: buffer("bench copy source")?,
        dst: buffer("bench copy destination")?,
        bytes,
        workgroups: COPY_WORKGROUPS.min(ctx.caps().max_compute_workgroups_per_dimension),
    })
}
