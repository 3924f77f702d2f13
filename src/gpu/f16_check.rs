//! The f16 check: before any kernel converts f16 with `unpack2x16float`, a context runs every
//! one of the 65,536 f16 bit patterns through it on the device (`shaders/f16_check.wgsl`) and
//! compares each with the exact integer decoder of the CPU codec
//! ([`f16_bits_to_f32`]). Drivers may flush f16
//! subnormals to zero, which would change results silently; a context whose device differs
//! anywhere keeps the integer decoder
//! ([`Capabilities::f16_unpack_exact`](super::Capabilities::f16_unpack_exact) is false).

use super::Context;
use crate::pipeline::PipelineKey;
use crate::quant::f16::f16_bits_to_f32;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::Result;

/// The f16 patterns whose `unpack2x16float` on `ctx`'s device differs from the exact decoder
/// (any NaN for a NaN pattern counts as equal: kernels read NaN by class, not payload). Needs
/// [`wgpu::DownlevelFlags::SHADER_F16_IN_F32`]
/// ([`Capabilities::f16_in_f32`](super::Capabilities::f16_in_f32)).
///
/// # Errors
/// [`Error::MissingFeature`](crate::Error::MissingFeature) without `SHADER_F16_IN_F32`; GPU
/// errors.
pub fn unpack_mismatches(ctx: &Context) -> Result<Vec<u16>> {
    pollster::block_on(unpack_mismatches_async(ctx))
}

/// [`unpack_mismatches`] without blocking (the form the web uses).
pub async fn unpack_mismatches_async(ctx: &Context) -> Result<Vec<u16>> {
    if !ctx.caps().f16_in_f32 {
        return Err(crate::Error::MissingFeature("shader-f16-in-f32"));
    }
    let key = PipelineKey::new(ShaderVariant::new(Kernel::F16Check, Precision::F32), &[]);
    let pipeline = ctx.pipeline(&key)?;
    let out = ctx.filled("f16 check", 1 << 16, super::UNWRITTEN_BITS)?;
    let group = ctx.bind_group("f16 check", &pipeline, &[out.as_entire_binding()])?;
    ctx.run_pass("f16 check", |pass| {
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &group, &[]);
        // 64 invocations per workgroup, 16,384 per row of the grid, two patterns each.
        pass.dispatch_workgroups(256, 2, 1);
        Ok(())
    })?;
    let got: Vec<u32> = ctx.read_back_async(&out, 1 << 16).await?;
    Ok((0..=u16::MAX)
        .filter(|&h| {
            let want = f16_bits_to_f32(h);
            let g = f32::from_bits(got[usize::from(h)]);
            !(want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan()))
        })
        .collect())
}
