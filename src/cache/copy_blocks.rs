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

/// Copies block `src` to block `dst` for every pair; a destination must not be a source.
pub fn copy_blocks(ctx: &Context, pool: &BlockPool, pairs: &[(BlockId, BlockId)]) -> Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    let bytes = pool.layout().block_bytes();
    let mut same_buffer: Vec<Vec<u32>> = vec![Vec::new(); pool.buffers().len()];
    let mut encoder = ctx.encoder("copy blocks between buffers");
    for &(src, dst) in pairs {
        let (sb, sl) = pool.locate(src)?;
        let (db, dl) = pool.locate(dst)?;
        if sb == db {
            same_buffer[sb].extend([sl as u32, dl as u32]);
        } else {
            encoder.copy_buffer_to_buffer(
                &pool.buffers()[sb],
                sl as u64 * bytes,
                &pool.buffers()[db],
                dl as u64 * bytes,
                bytes,
            );
        }
    }
    ctx.submit("copy blocks between buffers", encoder)?;
    let key = PipelineKey::new(ShaderVariant::new(Kernel::CopyBlocks, Precision::F32), &[]);
    // Pairs per dispatch: within the workgroup limit and the (possibly capped) binding size.
    let caps = ctx.caps();
    let per_dispatch = (caps.max_compute_workgroups_per_dimension as usize)
        .min((caps.max_storage_buffer_binding_size / 8) as usize);
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
            ctx.dispatch(
                &pipeline,
                &[&uniform, &list, &pool.buffers()[buffer]],
                [params.num_pairs, 1, 1],
            )?;
        }
    }
    Ok(())
}
