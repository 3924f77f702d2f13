//! Dequantize token rows on the GPU (`shaders/dequant.wgsl`): the WGSL decoders of
//! `shaders/lib/kv_load.wgsl` applied to a whole pool, written out as f32. Tests use it to check
//! the GPU decoders bit for bit against the CPU codec; `kvattn run quantize` reports it. In
//! gather mode ([`dequantize_gather`]) it decodes chosen rows of a paged pool buffer into chosen
//! rows of a dense f32 buffer (the MLA up-projection path's latent rows).

use super::{EncodedRows, KvDtype, ScaleMode};
use crate::cache::pool::PoolLayout;
use crate::gpu::Context;
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `DequantParams` uniform.
    pub struct DequantParams {
        /// Rows to decode.
        pub num_rows: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// 1: decode the (out row, pool row) pairs of the `rows` binding; 0: rows in order.
        pub gather: u32,
        /// Padding to 16 bytes.
        pub _pad0: u32,
    }
}

const WG: u32 = 64;

fn constants(
    dtype: KvDtype,
    head_dim: usize,
    mode: ScaleMode,
    block_rows: usize,
) -> Vec<(&'static str, f64)> {
    vec![
        ("K_DTYPE", f64::from(dtype.code())),
        ("K_DIM", head_dim as f64),
        (
            "K_SCALE_PER_TENSOR",
            f64::from(u8::from(matches!(mode, ScaleMode::PerTensor(_)))),
        ),
        ("KV_BLOCK_ROWS", block_rows as f64),
    ]
}

/// Override constants for the naga tests: every format, the smallest and largest head dims,
/// rows back to back and in pool blocks (1 and 4,096 rows per block).
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    KvDtype::ALL
        .iter()
        .flat_map(|&dtype| {
            let mode = if dtype.fp8_format().is_some() {
                ScaleMode::PerTensor(1.0)
            } else {
                ScaleMode::PerRow
            };
            [(32, 1), (1024, 1), (32, 4096), (1024, 256)]
                .map(move |(d, block_rows)| constants(dtype, d, mode, block_rows))
        })
        .collect()
}

/// The dispatch grid for `invocations` invocations of 64: `(x, y)` workgroups.
fn grid(ctx: &Context, invocations: u64) -> Result<(u32, u32)> {
    let groups = invocations.div_ceil(u64::from(WG)).max(1);
    let max = u64::from(ctx.caps().max_compute_workgroups_per_dimension);
    let gx = groups.min(max);
    let gy = groups.div_ceil(gx);
    if gy > max {
        return Err(Error::InvalidArgument(format!(
            "dequantize: {groups} workgroups exceed the adapter's {max} x {max} grid"
        )));
    }
    Ok((gx as u32, gy as u32))
}

/// Decodes every row of `rows` on the GPU and reads the f32 values back (`[rows, head_dim]`).
/// One submission for the decoding ([`encode_dequantize`]), then the readback.
pub fn dequantize(ctx: &Context, rows: &EncodedRows) -> Result<Vec<f32>> {
    pollster::block_on(dequantize_async(ctx, rows))
}

/// [`dequantize`] without blocking: the form to await in the browser.
pub async fn dequantize_async(ctx: &Context, rows: &EncodedRows) -> Result<Vec<f32>> {
    rows.validate()?;
    let len = rows.num_rows() * rows.head_dim;
    let out = ctx.filled("dequant out", len, crate::gpu::UNWRITTEN)?;
    ctx.run_pass("dequantize", |pass| {
        encode_dequantize(ctx, pass, rows, &out)
    })?;
    ctx.read_back_async(&out, len).await
}

/// Records the decoding of every row of `rows` into `out` (`[rows, head_dim]` f32 from the
/// start of the buffer) into `pass`. Uploads the rows (buffers made by this call); everything
/// is checked and bound before anything is recorded.
///
/// # Errors
/// [`EncodedRows::validate`]'s errors; [`Error::InvalidArgument`] when `out` lacks `STORAGE`
/// usage; [`Error::ShapeMismatch`] when it holds fewer values than the rows; creation errors.
pub fn encode_dequantize(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    rows: &EncodedRows,
    out: &wgpu::Buffer,
) -> Result<()> {
    rows.validate()?;
    let n = rows.num_rows();
    let len = n * rows.head_dim;
    crate::gpu::check_storage("dequantize out", out, len)?;
    let (gx, gy) = grid(ctx, (len / 4) as u64)?;
    let params = DequantParams {
        num_rows: n as u32,
        stride_x: gx * WG,
        ..Default::default()
    };
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::Dequant, Precision::F32),
        &constants(rows.dtype, rows.head_dim, rows.scale_mode, 1),
    );
    let pipeline = ctx.pipeline(&key)?;
    let uniform = ctx.uniform("dequant params", &params)?;
    let pool = ctx.upload("dequant pool", &rows.interleaved_words())?;
    let scales = ctx.upload("dequant scales", &rows.scale_pool_words())?;
    let no_rows = ctx.upload("dequant no rows", &[0u32])?;
    let resources: Vec<wgpu::BindingResource> = [&uniform, &pool, &scales, out, &no_rows]
        .iter()
        .map(|b| b.as_entire_binding())
        .collect();
    ctx.prepare_dispatch("dequantize", &pipeline, &resources, [gx, gy, 1])?
        .encode(pass);
    Ok(())
}

fn check_storage(what: &str, buffer: &wgpu::Buffer, ctx: &Context) -> Result<()> {
    if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
        return Err(Error::InvalidArgument(format!(
            "{what} was not created with STORAGE usage"
        )));
    }
    let limit = ctx.device.limits().max_storage_buffer_binding_size;
    if buffer.size() > limit {
        return Err(Error::TooLarge {
            what: what.to_string(),
            bytes: buffer.size(),
            limit,
        });
    }
    Ok(())
}

/// Decodes pool rows `pairs[i].1` of `pool` (a buffer of a
/// [`BlockPool`](crate::cache::pool::BlockPool) with layout `layout`; rows numbered as in
/// `shaders/lib/kv_load.wgsl` with `KV_BLOCK_ROWS = layout.block_rows()`: row
/// `block * block_rows + head * block_size + slot` of the blocks in this buffer) into rows
/// `pairs[i].0` of `out` (`[*, layout.head_dim]` f32), exactly as the CPU codec decodes them.
/// The per-tensor FP8 scale is `layout.scale`'s. Rows of `out` not listed are not touched. One
/// submission ([`encode_dequantize_gather`] into a pass of its own; several dispatches when the
/// pairs exceed one storage binding or the grid).
///
/// # Errors
/// As [`encode_dequantize_gather`]; nothing is submitted on error.
pub fn dequantize_gather(
    ctx: &Context,
    pool: &wgpu::Buffer,
    layout: &PoolLayout,
    pairs: &[(u32, u32)],
    out: &wgpu::Buffer,
) -> Result<()> {
    ctx.run_pass("dequantize_gather", |pass| {
        encode_dequantize_gather(ctx, pass, pool, layout, pairs, out)
    })?;
    Ok(())
}

/// Records [`dequantize_gather`] into `pass`. Uploads the pair lists and parameters (buffers
/// made by this call).
///
/// # Errors
/// Everything is checked and every bind group made before anything is recorded: the layout
/// ([`PoolLayout::validate`]); [`Error::InvalidArgument`] when `pairs` is empty, lists an out
/// row twice, or names a pool row whose block does not lie inside `pool`, or when a buffer lacks
/// `STORAGE` usage; [`Error::ShapeMismatch`] when `out` is smaller than its largest row;
/// [`Error::TooLarge`] when a buffer exceeds the device's storage binding limit;
/// [`Error::Wgpu`] or [`Error::Shader`] from wgpu.
pub fn encode_dequantize_gather(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    pool: &wgpu::Buffer,
    layout: &PoolLayout,
    pairs: &[(u32, u32)],
    out: &wgpu::Buffer,
) -> Result<()> {
    layout.validate()?;
    if pairs.is_empty() {
        return Err(Error::InvalidArgument(
            "dequantize_gather: no rows to decode".into(),
        ));
    }
    check_storage("dequantize_gather pool", pool, ctx)?;
    check_storage("dequantize_gather out", out, ctx)?;
    if pool == out {
        return Err(Error::InvalidArgument(
            "dequantize_gather: pool and out must be different buffers".into(),
        ));
    }
    let block_words = layout.block_words() as u64;
    let blocks = pool.size() / 4 / block_words;
    let block_rows = layout.block_rows() as u64;
    let pool_rows = blocks * block_rows;
    let mut out_rows: Vec<u32> = Vec::with_capacity(pairs.len());
    for &(o, p) in pairs {
        if u64::from(p) >= pool_rows {
            return Err(Error::InvalidArgument(format!(
                "dequantize_gather: pool row {p} is outside the buffer ({blocks} blocks of \
                 {block_rows} rows)"
            )));
        }
        out_rows.push(o);
    }
    out_rows.sort_unstable();
    if let Some(w) = out_rows.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::InvalidArgument(format!(
            "dequantize_gather: out row {} is listed twice",
            w[0]
        )));
    }
    let d = layout.head_dim;
    let last = out_rows[out_rows.len() - 1] as usize;
    let needed = (last + 1) * d;
    let have = out.size() / 4;
    if have < needed as u64 {
        return Err(Error::ShapeMismatch {
            what: "dequantize_gather out",
            expected: needed,
            got: usize::try_from(have).unwrap_or(usize::MAX),
        });
    }
    if u32::try_from(needed / 4).is_err() {
        return Err(Error::InvalidArgument(format!(
            "dequantize_gather: out row {last} of {d} values is past u32 indexing"
        )));
    }
    let scale = match layout.scale {
        ScaleMode::PerTensor(s) => s.to_bits(),
        ScaleMode::PerRow => 0,
    };
    let scales = ctx.upload("dequant tensor scale", &[scale])?;
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::Dequant, Precision::F32),
        &constants(layout.dtype, d, layout.scale, layout.block_rows()),
    );
    let pipeline = ctx.pipeline(&key)?;
    // Pairs per dispatch: within one binding of the pair list and a u32 invocation index.
    let binding = ctx.device.limits().max_storage_buffer_binding_size;
    let per_dispatch = (binding / 8)
        .min(u64::from(u32::MAX) / (d as u64 / 4))
        .max(1) as usize;
    let mut dispatches = Vec::new();
    for chunk in pairs.chunks(per_dispatch) {
        let (gx, gy) = grid(ctx, chunk.len() as u64 * (d as u64 / 4))?;
        let params = DequantParams {
            num_rows: chunk.len() as u32,
            stride_x: gx * WG,
            gather: 1,
            ..Default::default()
        };
        let words: Vec<u32> = chunk.iter().flat_map(|&(o, p)| [o, p]).collect();
        dispatches.push((
            ctx.uniform("dequant params", &params)?,
            ctx.upload("dequant rows", &words)?,
            [gx, gy, 1],
        ));
    }
    let dispatches = dispatches
        .iter()
        .map(|(uniform, rows, grid)| {
            let resources = [uniform, pool, &scales, out, rows]
                .iter()
                .map(|b| b.as_entire_binding())
                .collect();
            (resources, *grid)
        })
        .collect();
    crate::gpu::dispatch::encode_dispatches(ctx, pass, "dequantize_gather", &pipeline, dispatches)
}
