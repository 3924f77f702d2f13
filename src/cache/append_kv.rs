//! `append_kv`: write new K or V rows into their slots of a block pool, in place, encoding them
//! into the pool's storage format on the GPU (`shaders/append_kv.wgsl`). The encoders match the
//! CPU codec bit for bit.

use super::pool::BlockPool;
use crate::gpu::Context;
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

fn constants(pool: &BlockPool, src: SourceDtype) -> Vec<(&'static str, f64)> {
    let layout = pool.layout();
    vec![
        ("WG", f64::from(WG)),
        ("DIM", layout.head_dim as f64),
        ("DST_DTYPE", f64::from(layout.dtype.code())),
        ("SRC_F16", f64::from(u8::from(src == SourceDtype::F16))),
    ]
}

/// Override constants for the naga tests: every unscaled storage format, both sources.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    let mut sets = Vec::new();
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        for (dim, src) in [(64.0, 0.0), (1024.0, 1.0)] {
            sets.push(vec![
                ("WG", f64::from(WG)),
                ("DIM", dim),
                ("DST_DTYPE", f64::from(dtype.code())),
                ("SRC_F16", src),
            ]);
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
    /// Per dispatch: pool buffer, workgroups along y, row list, parameters.
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
                let uniform = ctx.uniform("append params", &params);
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
/// global slot `slots[i]` (`block * block_size + offset`) of `pool`, for every `i`. Slots are
/// checked against the pool and `src` against its size before anything is dispatched.
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
pub fn append_rows(
    ctx: &Context,
    pool: &BlockPool,
    src: &wgpu::Buffer,
    src_dtype: SourceDtype,
    rows: &AppendRows,
) -> Result<()> {
    if !rows.fits(pool) {
        return Err(Error::InvalidArgument(
            "the append rows were arranged for a pool of another shape".into(),
        ));
    }
    let layout = pool.layout();
    let row_bytes = (layout.num_kv_heads * layout.head_dim * src_dtype.bytes()) as u64;
    let needed = row_bytes * rows.rows as u64;
    if src.size() < needed {
        return Err(Error::InvalidArgument(format!(
            "append source holds {} bytes, {} rows need {needed}",
            src.size(),
            rows.rows
        )));
    }
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::AppendKv, Precision::F32),
        &constants(pool, src_dtype),
    );
    let pipeline = ctx.pipeline(&key)?;
    for (buffer, n, list, uniform) in &rows.dispatches {
        ctx.dispatch(
            &pipeline,
            &[uniform, src, list, &pool.buffers()[*buffer]],
            [layout.num_kv_heads as u32, *n, 1],
        )?;
    }
    Ok(())
}
