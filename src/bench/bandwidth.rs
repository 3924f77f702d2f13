//! The copy kernel that measures an adapter's memory bandwidth (`shaders/bandwidth.wgsl`).

use crate::gpu::{check_storage, Context};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `BandwidthParams` uniform.
    pub struct BandwidthParams {
        /// `vec4<u32>` values to copy.
        pub n: u32,
        /// Invocations in the dispatch.
        pub stride: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
    }
}

/// Invocations per workgroup of the copy kernel.
pub const COPY_WG: u32 = 64;

/// Override constants for the naga tests.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    vec![vec![("WG", f64::from(COPY_WG))]]
}

/// Copies the first `bytes` bytes of `src` into `dst` with `workgroups` workgroups of the
/// copy kernel (16-byte loads and stores, a grid-stride loop). One submission; does not wait.
///
/// # Errors
/// [`Error::InvalidArgument`] when `bytes` is 0, not a multiple of 16 or past a u32 count of
/// vec4 values, or `workgroups` is 0 or past the adapter's limit; [`Error::ShapeMismatch`] when
/// a buffer is smaller than `bytes`; [`Error::Wgpu`] from wgpu.
pub fn copy_bytes(
    ctx: &Context,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
    bytes: u64,
    workgroups: u32,
) -> Result<()> {
    if bytes == 0 || bytes % 16 != 0 || bytes / 16 > u64::from(u32::MAX) {
        return Err(Error::InvalidArgument(format!(
            "copy of {bytes} bytes: must be a positive multiple of 16 below 64 GiB"
        )));
    }
    let max = ctx.caps().max_compute_workgroups_per_dimension;
    if workgroups == 0 || workgroups > max {
        return Err(Error::InvalidArgument(format!(
            "copy with {workgroups} workgroups: must be 1..={max}"
        )));
    }
    let words = (bytes / 4) as usize;
    check_storage("copy source", src, words)?;
    check_storage("copy destination", dst, words)?;
    let params = BandwidthParams {
        n: (bytes / 16) as u32,
        stride: workgroups * COPY_WG,
        ..Default::default()
    };
    let uniform = ctx.uniform("bandwidth params", &params)?;
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::Bandwidth, Precision::F32),
        &[("WG", f64::from(COPY_WG))],
    );
    let pipeline = ctx.pipeline(&key)?;
    ctx.dispatch(&pipeline, &[&uniform, src, dst], [workgroups, 1, 1])
}
