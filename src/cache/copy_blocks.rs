//! Copy whole blocks of a pool (copy-on-write of a shared partial block): inside one buffer with
//! the `copy_blocks` kernel (`shaders/copy_blocks.wgsl`; wgpu cannot copy a buffer into itself),
//! between buffers with `copy_buffer_to_buffer`.

use super::allocator::BlockId;
use super::pool::BlockPool;
use crate::gpu::Context;
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::Result;

crate::wgsl_struct! {
    /// Mirror of the WGSL `CopyParams` uniform.
    pub struct CopyParams {
        /// Pairs in this dispatch.
        pub num_pairs: u32,
        /// Words per block.
        pub block_words: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
    }
}

/// Override constants for the naga tests (the kernel has none).
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    vec![Vec::new()]
}

/// Copies block `src` to block `dst` for every pair; a destination must not be a source. One
/// submission ([`encode_copy_blocks`] into an encoder of its own; none without pairs).
pub fn copy_blocks(ctx: &Context, pool: &BlockPool, pairs: &[(BlockId, BlockId)]) -> Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let mut encoder = ctx.encoder("copy blocks");
    encode_copy_blocks(ctx, &mut encoder, pool, pairs)?;
    ctx.submit("copy blocks", encoder)?;
    Ok(())
}

/// Records [`copy_blocks`] into `encoder`: a buffer copy per pair whose blocks lie in different
/// pool buffers, then one compute pass for the pairs inside one buffer (wgpu cannot copy a
/// buffer into itself). Every block is located, and every buffer and bind group made, before
/// anything is recorded.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when a block lies outside the
/// pool (nothing recorded); creation errors.
pub fn encode_copy_blocks(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    pool: &BlockPool,
    pairs: &[(BlockId, BlockId)],
) -> Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let bytes = pool.layout().block_bytes();
    let mut same_buffer: Vec<Vec<u32>> = vec![Vec::new(); pool.buffers().len()];
    let mut between = Vec::new();
    for &(src, dst) in pairs {
        let (sb, sl) = pool.locate(src)?;
        let (db, dl) = pool.locate(dst)?;
        if sb == db {
            same_buffer[sb].extend([sl as u32, dl as u32]);
        } else {
            between.push((sb, sl as u64 * bytes, db, dl as u64 * bytes));
        }
    }
    let key = PipelineKey::new(ShaderVariant::new(Kernel::CopyBlocks, Precision::F32), &[]);
    // Pairs per dispatch: within the workgroup limit and the (possibly capped) binding size.
    let caps = ctx.caps();
    let per_dispatch = (caps.max_compute_workgroups_per_dimension as usize)
        .min((caps.max_storage_buffer_binding_size / 8) as usize);
    let mut dispatches = Vec::new();
    for (buffer, pairs) in same_buffer.iter().enumerate() {
        for chunk in pairs.chunks(2 * per_dispatch) {
            if chunk.is_empty() {
                continue;
            }
            let pipeline = ctx.pipeline(&key)?;
            let params = CopyParams {
                num_pairs: (chunk.len() / 2) as u32,
                block_words: pool.layout().block_words() as u32,
                ..Default::default()
            };
            let uniform = ctx.uniform("copy params", &params)?;
            let list = ctx.upload("copy pairs", chunk)?;
            dispatches.push(ctx.prepare_dispatch(
                "copy_blocks",
                &pipeline,
                &[
                    uniform.as_entire_binding(),
                    list.as_entire_binding(),
                    pool.buffers()[buffer].as_entire_binding(),
                ],
                [params.num_pairs, 1, 1],
            )?);
        }
    }
    for &(sb, so, db, doff) in &between {
        encoder.copy_buffer_to_buffer(&pool.buffers()[sb], so, &pool.buffers()[db], doff, bytes);
    }
    if !dispatches.is_empty() {
        let mut pass = ctx.begin_compute_pass(encoder, Some("copy blocks"));
        for dispatch in &dispatches {
            dispatch.encode(&mut pass);
        }
    }
    Ok(())
}
