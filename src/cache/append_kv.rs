//! `append_kv`: write new K or V rows into their slots of a block pool, in place, encoding them
//! into the pool's storage format on the GPU (`shaders/append_kv.wgsl`, encoders in
//! `shaders/lib/kv_store.wgsl`). The encoders match the CPU codec ([`crate::quant::encode_rows`])
//! bit for bit, quantized formats included: FP8 E4M3/E5M2 with per-tensor or dynamic per-row
//! scales, int8 and int4, each row's (or group's) scale computed on the GPU with integer
//! arithmetic on the f32 bits (correctly rounded, subnormals included), never with the driver's
//! float operations. A workgroup writes several rows when rows are short, adjacent lanes on
//! adjacent 16-byte chunks (the mapping is in the shader's header).

use std::sync::Arc;

use super::append_plan::check_storage_binding;
use super::pool::BlockPool;
use crate::gpu::{Context, Dispatch};
use crate::pipeline::PipelineKey;
use crate::quant::KvDtype;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `AppendParams` uniform.
    pub struct AppendParams {
        /// Row entries in this buffer's list.
        pub num_entries: u32,
        /// Entry of workgroup y = 0 in this dispatch.
        pub entry_base: u32,
        /// KV heads.
        pub num_kv_heads: u32,
        /// Token slots per block.
        pub block_size: u32,
        /// Global id of the buffer's first block.
        pub first_block: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
        /// Padding.
        pub _pad2: u32,
    }
}

/// Invocations per workgroup.
const WG: u32 = 64;

/// Invocations that write one row of `dtype` at `head_dim` (the kernel's `LANES`): one per
/// 16-byte chunk of the row's [`row_stride`](KvDtype::row_stride) (int4: one per group of 32
/// values), rounded up to a power of two, at most a workgroup. The workgroup serves
/// `WG / LANES` rows ([`rows_per_workgroup`]).
fn lanes_per_row(dtype: KvDtype, head_dim: usize) -> u32 {
    let chunks = dtype.row_stride(head_dim).div_ceil(4).max(1) as u32;
    chunks.next_power_of_two().min(WG)
}

/// Row entries one `append_kv` workgroup writes for pools of `dtype` at `head_dim`.
fn rows_per_workgroup(dtype: KvDtype, head_dim: usize) -> u32 {
    WG / lanes_per_row(dtype, head_dim)
}

/// Workgroups along y of a dispatch writing `entries` row entries into `pool`.
pub(crate) fn workgroups_for(pool: &BlockPool, entries: u32) -> u32 {
    let layout = pool.layout();
    entries.div_ceil(rows_per_workgroup(layout.dtype, layout.head_dim))
}

/// Element type of the new rows the caller provides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceDtype {
    /// f32 values.
    F32,
    /// f16 values, two per u32 word, the even element in the low half.
    F16,
}

impl SourceDtype {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            SourceDtype::F32 => 4,
            SourceDtype::F16 => 2,
        }
    }
}

/// Whether every (token, head) row of a source is whole 16-byte units, so that the kernel reads
/// it 16 bytes at a time (its `src4` view): every f32 source (head dims are multiples of 4), f16
/// sources at head dims that are multiples of 8.
fn source_vec4(head_dim: usize, src: SourceDtype) -> bool {
    (head_dim * src.bytes()) % 16 == 0
}

/// Smallest row list in bytes: the list stands in for the kernel's 16-byte view of the source
/// where the source is not read through it (see [`bindings`]). [`Context::upload`] never makes
/// a smaller buffer; [`AppendPlan`](super::append_plan::AppendPlan) sizes its list to at least
/// this.
pub(crate) const MIN_LIST_BYTES: u64 = 16;

/// The kernel's bindings, in order, writing buffer `buffer` of `pool` from `src` (`src_dtype`
/// values) with the row list `list` and the parameters `params`. The source is bound twice, as
/// words and as 16-byte units; where the kernel does not read it as the latter
/// ([`source_vec4`] false), that view takes the row list instead, which is at least
/// [`MIN_LIST_BYTES`] (a source may be smaller than a 16-byte view's smallest binding).
pub(crate) fn bindings<'a>(
    params: wgpu::BindingResource<'a>,
    src: wgpu::BufferBinding<'a>,
    src_dtype: SourceDtype,
    list: &'a wgpu::Buffer,
    pool: &'a BlockPool,
    buffer: usize,
) -> [wgpu::BindingResource<'a>; 7] {
    let src4 = if source_vec4(pool.layout().head_dim, src_dtype) {
        wgpu::BindingResource::Buffer(src.clone())
    } else {
        list.as_entire_binding()
    };
    // The pool goes to one of its two views only (WebGPU refuses a buffer bound twice where
    // either binding is writable); the pool's spare buffer takes the other.
    let layout = pool.layout();
    let (pool4, pool_words) = if value_words(layout.dtype, layout.per_tensor_scale()) {
        (pool.spare(), &pool.buffers()[buffer])
    } else {
        (&pool.buffers()[buffer], pool.spare())
    };
    [
        params,
        wgpu::BindingResource::Buffer(src),
        list.as_entire_binding(),
        pool4.as_entire_binding(),
        pool.scale_uniform().as_entire_binding(),
        pool_words.as_entire_binding(),
        src4,
    ]
}

/// Whether the kernel stores values through its word view of the pool, rather than 16 bytes at
/// a time: formats with scale words (per-row FP8, int8, int4; per-tensor FP8 has none).
fn value_words(dtype: KvDtype, per_tensor: bool) -> bool {
    dtype.is_quantized() && !per_tensor
}

fn constants(pool: &BlockPool, src: SourceDtype) -> Vec<(&'static str, f64)> {
    let layout = pool.layout();
    kernel_constants(
        layout.dtype,
        layout.head_dim,
        src,
        layout.per_tensor_scale(),
    )
}

fn kernel_constants(
    dtype: KvDtype,
    head_dim: usize,
    src: SourceDtype,
    per_tensor: bool,
) -> Vec<(&'static str, f64)> {
    vec![
        ("WG", f64::from(WG)),
        ("LANES", f64::from(lanes_per_row(dtype, head_dim))),
        ("DIM", head_dim as f64),
        ("DST_DTYPE", f64::from(dtype.code())),
        ("SRC_F16", f64::from(u8::from(src == SourceDtype::F16))),
        ("PER_TENSOR", f64::from(u8::from(per_tensor))),
        ("SRC_VEC4", f64::from(u8::from(source_vec4(head_dim, src)))),
        (
            "VALUE_WORDS",
            f64::from(u8::from(value_words(dtype, per_tensor))),
        ),
    ]
}

/// The `append_kv` pipeline writing into pools shaped like `pool` from `src` values.
pub(crate) fn append_pipeline(
    ctx: &Context,
    pool: &BlockPool,
    src: SourceDtype,
) -> Result<Arc<wgpu::ComputePipeline>> {
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::AppendKv, Precision::F32),
        &constants(pool, src),
    );
    ctx.pipeline(&key)
}

/// Override constants for the naga tests: every storage format (FP8 with per-row and
/// per-tensor scales), the smallest and largest head dims, both sources, both ways of reading
/// them.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    let mut sets = Vec::new();
    for dtype in KvDtype::ALL {
        let modes: &[bool] = if dtype.fp8_format().is_some() {
            &[false, true]
        } else {
            &[false]
        };
        for &per_tensor in modes {
            let smallest = if dtype == KvDtype::Int4 { 32 } else { 4 };
            for (dim, src) in [
                (smallest, SourceDtype::F32),
                // An f16 source read word by word (not whole 16-byte rows) but for int4.
                (smallest, SourceDtype::F16),
                (64, SourceDtype::F16),
                (crate::quant::MAX_HEAD_DIM, SourceDtype::F16),
            ] {
                sets.push(kernel_constants(dtype, dim, src, per_tensor));
            }
        }
    }
    sets
}

/// The rows of one append, arranged for the GPU once: per pool buffer, the (source row, slot)
/// list and the dispatch parameters. Every pool with the same heads, block size and split (the K
/// and V pools of every layer of a cache) takes the same arrangement, so a batch builds it once
/// and writes every layer with it.
#[derive(Debug, Clone)]
pub struct AppendRows {
    rows: usize,
    num_kv_heads: usize,
    block_size: usize,
    blocks_per_buffer: usize,
    num_blocks: usize,
    /// Per dispatch: pool buffer, row entries (at most the grid's y limit), row list,
    /// parameters.
    dispatches: Vec<(usize, u32, wgpu::Buffer, wgpu::Buffer)>,
}

impl AppendRows {
    /// Arranges rows `0..slots.len()` of a source for writing into global slots `slots` of pools
    /// shaped like `pool`. Slots outside the pool are refused.
    pub fn new(ctx: &Context, pool: &BlockPool, slots: &[u32]) -> Result<Self> {
        let layout = pool.layout();
        let capacity = (pool.num_blocks() * layout.block_size) as u64;
        if let Some(&bad) = slots.iter().find(|&&s| u64::from(s) >= capacity) {
            return Err(Error::InvalidArgument(format!(
                "slot {bad} outside the pool's {capacity} slots"
            )));
        }
        // (source row, slot) pairs per buffer.
        let slots_per_buffer = (pool.blocks_per_buffer() * layout.block_size) as u32;
        let mut per_buffer: Vec<Vec<u32>> = vec![Vec::new(); pool.buffers().len()];
        for (i, &slot) in slots.iter().enumerate() {
            per_buffer[(slot / slots_per_buffer) as usize].extend([i as u32, slot]);
        }
        let max_y = ctx.caps().max_compute_workgroups_per_dimension;
        let mut dispatches = Vec::new();
        for (buffer, entries) in per_buffer.iter().enumerate() {
            if entries.is_empty() {
                continue;
            }
            let num_entries = (entries.len() / 2) as u32;
            let list = ctx.upload("append rows", entries)?;
            let mut base = 0;
            while base < num_entries {
                let n = (num_entries - base).min(max_y);
                let params = AppendParams {
                    num_entries,
                    entry_base: base,
                    num_kv_heads: layout.num_kv_heads as u32,
                    block_size: layout.block_size as u32,
                    first_block: (buffer * pool.blocks_per_buffer()) as u32,
                    ..Default::default()
                };
                let uniform = ctx.uniform("append params", &params)?;
                dispatches.push((buffer, n, list.clone(), uniform));
                base += n;
            }
        }
        Ok(Self {
            rows: slots.len(),
            num_kv_heads: layout.num_kv_heads,
            block_size: layout.block_size,
            blocks_per_buffer: pool.blocks_per_buffer(),
            num_blocks: pool.num_blocks(),
            dispatches,
        })
    }

    /// Whether `pool` is shaped like the pool this arrangement was made for.
    fn fits(&self, pool: &BlockPool) -> bool {
        let layout = pool.layout();
        layout.num_kv_heads == self.num_kv_heads
            && layout.block_size == self.block_size
            && pool.blocks_per_buffer() == self.blocks_per_buffer
            && pool.num_blocks() == self.num_blocks
    }
}

/// Writes row `i` of `src` (`[n_src, num_kv_heads, head_dim]` in `src_dtype`, every head) into
/// global slot `slots[i]` (`block * block_size + offset`) of `pool`, for every `i`, encoded in
/// the pool's format exactly as [`encode_rows`](crate::quant::encode_rows) encodes the same
/// values (for an f16 source: the f16 values as f32), with the scale words at the pool layout's
/// [`scales_in_block`](super::pool::PoolLayout::scales_in_block):
///
/// - FP8 per-row: scale `2^k` from the row's finite amax, values `encode(x * 2^-k)` (exact);
/// - FP8 per-tensor: `encode(x * inv_scale)` with the pool's host-computed reciprocal (the
///   pool's [`scale_uniform`](BlockPool::scale_uniform));
/// - int8: `scale = amax / 127`, `inv = 1 / scale` (correctly rounded divisions done with
///   integer arithmetic, so they equal the CPU's), `round_ties_even(x * inv)` clamped to ±127;
/// - int4: per group of 32, min and max by total order (-0 < +0), f16 scale
///   `(max - min) / 15` and f16 min, `round_ties_even((x - min_h) / scale_h)` (by the reciprocal)
///   clamped to 0..=15.
///
/// Input outside the int8/int4 contract (which `encode_rows` refuses; the GPU cannot report
/// it) is encoded as the CPU codec's own functions do ([`Int8Scale::for_row`] and
/// [`encode_int8`]; [`Int4Params::for_group`] and [`encode_int4`]): NaN gives code 0 and is
/// ignored by the scales; an int8 row holding an infinity gets scale 0 and all codes 0; an int4
/// group holding an infinity or values beyond the f16 range gets the f16 scale/min the CPU
/// functions give (infinite or NaN; a NaN from inf - inf is the x86 default NaN, f16 `0xfe00`),
/// and codes 0 when the scale is not finite, else 0 or 15 where the min overflowed to +inf or
/// -inf.
///
/// [`Int8Scale::for_row`]: crate::quant::Int8Scale::for_row
/// [`encode_int8`]: crate::quant::int8::encode_int8
/// [`Int4Params::for_group`]: crate::quant::Int4Params::for_group
/// [`encode_int4`]: crate::quant::int4::encode_int4
///
/// Slots are checked against the pool and `src` against its size before anything is
/// dispatched.
pub fn append_kv(
    ctx: &Context,
    pool: &BlockPool,
    src: &wgpu::Buffer,
    src_dtype: SourceDtype,
    slots: &[u32],
) -> Result<()> {
    let rows = AppendRows::new(ctx, pool, slots)?;
    append_rows(ctx, pool, src, src_dtype, &rows)
}

/// [`append_kv`] with the rows already arranged (for writing several pools with one batch).
/// One submission (none when there are no rows).
pub fn append_rows(
    ctx: &Context,
    pool: &BlockPool,
    src: &wgpu::Buffer,
    src_dtype: SourceDtype,
    rows: &AppendRows,
) -> Result<()> {
    let dispatches = prepare_rows(ctx, pool, src.as_entire_buffer_binding(), src_dtype, rows)?;
    if dispatches.is_empty() {
        return Ok(());
    }
    ctx.run_pass("append_kv", |pass| {
        dispatches.iter().for_each(|d| d.encode(pass));
        Ok(())
    })?;
    Ok(())
}

/// Records [`append_rows`] into `pass`: the rows of `src` (a storage binding, rows from its
/// start) into `pool`. Everything is checked and every bind group made before anything is
/// recorded.
///
/// # Errors
/// [`Error::InvalidArgument`] when `rows` was arranged for a pool of another shape, `src` lacks
/// `STORAGE` usage or its offset is not aligned to `min_storage_buffer_offset_alignment`;
/// [`Error::ShapeMismatch`] when `src` holds fewer bytes than the rows; creation errors.
pub fn encode_append_rows(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    pool: &BlockPool,
    src: wgpu::BufferBinding<'_>,
    src_dtype: SourceDtype,
    rows: &AppendRows,
) -> Result<()> {
    for dispatch in &prepare_rows(ctx, pool, src, src_dtype, rows)? {
        dispatch.encode(pass);
    }
    Ok(())
}

/// The dispatches of [`encode_append_rows`], checked and bound, not recorded.
pub(crate) fn prepare_rows(
    ctx: &Context,
    pool: &BlockPool,
    src: wgpu::BufferBinding<'_>,
    src_dtype: SourceDtype,
    rows: &AppendRows,
) -> Result<Vec<Dispatch>> {
    if !rows.fits(pool) {
        return Err(Error::InvalidArgument(
            "the append rows were arranged for a pool of another shape".into(),
        ));
    }
    let layout = pool.layout();
    let row_bytes = (layout.num_kv_heads * layout.head_dim * src_dtype.bytes()) as u64;
    check_storage_binding(ctx, "append source", &src, row_bytes * rows.rows as u64)?;
    if rows.dispatches.is_empty() {
        return Ok(Vec::new());
    }
    let pipeline = append_pipeline(ctx, pool, src_dtype)?;
    rows.dispatches
        .iter()
        .map(|(buffer, n, list, uniform)| {
            ctx.prepare_dispatch(
                "append_kv",
                &pipeline,
                &bindings(
                    uniform.as_entire_binding(),
                    src.clone(),
                    src_dtype,
                    list,
                    pool,
                    *buffer,
                ),
                [layout.num_kv_heads as u32, workgroups_for(pool, *n), 1],
            )
        })
        .collect()
}
