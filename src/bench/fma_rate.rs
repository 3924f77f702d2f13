//! The kernel that measures an adapter's arithmetic rate (`shaders/fma_rate.wgsl`): eight
//! independent chains of vec4 fused multiply-adds per invocation, in f32 or f16.

use crate::gpu::{check_storage, Context};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `FmaParams` uniform.
    pub struct FmaParams {
        /// Steps of every chain.
        pub iters: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
        /// Padding.
        pub _pad2: u32,
    }
}

/// Invocations per workgroup of the FMA kernel.
pub const FMA_WG: u32 = 64;

/// Floating-point operations per invocation and step: 8 chains x 4 lanes x 2 (an FMA is a
/// multiply and an add).
pub const FLOPS_PER_STEP: u64 = 64;

/// Override constants for the naga tests.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    vec![vec![("WG", f64::from(FMA_WG))]]
}

/// Runs `workgroups` workgroups of the FMA kernel in `precision`, `iters` steps per chain,
/// writing one vec4 per invocation into `out`; returns the floating-point operations done.
/// One submission; does not wait.
///
/// # Errors
/// [`Error::InvalidArgument`] when `workgroups` or `iters` is 0 or `workgroups` is past the
/// adapter's limit, [`Error::MissingFeature`] for f16 without
/// `SHADER_F16`, [`Error::ShapeMismatch`] when `out` holds fewer than 4 values per
/// invocation, [`Error::Wgpu`] from wgpu.
pub fn fma_chains(
    ctx: &Context,
    precision: Precision,
    out: &wgpu::Buffer,
    workgroups: u32,
    iters: u32,
) -> Result<u64> {
    let max = ctx.caps().max_compute_workgroups_per_dimension;
    if workgroups == 0 || workgroups > max || iters == 0 {
        return Err(Error::InvalidArgument(format!(
            "FMA kernel with {workgroups} workgroups and {iters} steps: need 1..={max} and > 0"
        )));
    }
    if precision == Precision::F16 && !ctx.caps().shader_f16 {
        return Err(Error::MissingFeature("shader-f16"));
    }
    let invocations = workgroups as usize * FMA_WG as usize;
    check_storage("FMA output", out, 4 * invocations)?;
    let uniform = ctx.uniform(
        "fma params",
        &FmaParams {
            iters,
            ..Default::default()
        },
    )?;
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::FmaRate, precision),
        &[("WG", f64::from(FMA_WG))],
    );
    let pipeline = ctx.pipeline(&key)?;
    ctx.dispatch(&pipeline, &[&uniform, out], [workgroups, 1, 1])?;
    Ok(invocations as u64 * u64::from(iters) * FLOPS_PER_STEP)
}
