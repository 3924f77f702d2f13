//! An MLA layer's up-projection weights on the GPU.

use crate::attention::spec::check_len;
use crate::gpu::Context;
use crate::problem::MlaShape;
use crate::{Error, Result};

/// `W_UK` `[H, d_nope, rank]` and `W_UV` `[H, rank, d_v]` of one layer, uploaded once.
#[derive(Debug)]
pub struct MlaWeights {
    shape: MlaShape,
    w_uk: wgpu::Buffer,
    w_uv: wgpu::Buffer,
}

impl MlaWeights {
    /// Uploads `w_uk` and `w_uv` after checking their lengths against `shape` and that each
    /// fits one storage binding.
    pub fn upload(ctx: &Context, shape: &MlaShape, w_uk: &[f32], w_uv: &[f32]) -> Result<Self> {
        shape.validate()?;
        let h = shape.num_heads;
        check_len("w_uk", w_uk.len(), &[h, shape.d_nope, shape.rank])?;
        check_len("w_uv", w_uv.len(), &[h, shape.rank, shape.d_v])?;
        let caps = ctx.caps();
        let binding = caps
            .max_storage_buffer_binding_size
            .min(caps.max_buffer_size);
        for (what, len) in [("w_uk", w_uk.len()), ("w_uv", w_uv.len())] {
            if (len as u64) * 4 > binding {
                return Err(Error::TooLarge {
                    what: what.into(),
                    bytes: len as u64 * 4,
                    limit: binding,
                });
            }
        }
        Ok(Self {
            shape: *shape,
            w_uk: ctx.upload("w_uk", w_uk)?,
            w_uv: ctx.upload("w_uv", w_uv)?,
        })
    }

    /// The layer shape the weights were checked against.
    pub fn shape(&self) -> &MlaShape {
        &self.shape
    }

    /// `W_UK` `[H, d_nope, rank]`.
    pub fn w_uk(&self) -> &wgpu::Buffer {
        &self.w_uk
    }

    /// `W_UV` `[H, rank, d_v]`.
    pub fn w_uv(&self) -> &wgpu::Buffer {
        &self.w_uv
    }
}
