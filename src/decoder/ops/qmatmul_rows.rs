//! The row kernel of the block-format product (`shaders/qmatmul_rows.wgsl`), for CPU
//! adapters: an invocation owns 4 rows of `W` (in each of the up to 12 windows of `W` a
//! dispatch binds for one row of `x`) and computes their 16 partials itself, each decoded chunk
//! applied to up to 4 rows of `x`, with the bits of the lane kernel
//! ([`super::qmatmul`]). It reads `x` and `W` through uniform bindings of [`X_WINDOW_BYTES`]
//! (on Mesa's CPU adapters a uniform load is one scalar load a lane, unrolled, and a storage
//! load a loop over the SIMD lanes through the stack, slower still): the `x` buffer needs
//! `UNIFORM` usage and room for the window after the row,
//! which [`input_buffer`] gives, and the weight a CPU adapter's upload of 64 KiB or more
//! ([`QWeight::has_windows`](super::qmatmul::QWeight::has_windows)). The decoder makes its
//! activations so; a product whose operands the kernel cannot read falls back to the lane
//! kernel.

use std::num::NonZeroU64;

use crate::gpu::dispatch::range;
use crate::gpu::Context;
use crate::Result;

/// Bytes of `x` the kernel binds (its `X_VEC4` vec4s): WebGPU's smallest
/// `maxUniformBufferBindingSize`.
pub const X_WINDOW_BYTES: u64 = 64 * 1024;

/// Invocations per workgroup (the kernel's `ROW_WG`): one SIMD vector of lavapipe, so that a
/// window's rows make several workgroups for the adapter's threads; each owns 4 rows of `W` in
/// each window the dispatch binds.
pub(crate) const ROW_WG: usize = 8;

/// A buffer of `x` rows every kernel of the product can read, the row kernel included:
/// `values`, then [`X_WINDOW_BYTES`] of zeros, with `STORAGE | UNIFORM | COPY_SRC | COPY_DST`
/// usage.
///
/// # Errors
/// [`Error::TooLarge`](crate::Error::TooLarge) when `values` exceed a storage binding;
/// [`Error::Wgpu`](crate::Error::Wgpu) from wgpu.
pub fn input_buffer(ctx: &Context, label: &str, values: &[f32]) -> Result<wgpu::Buffer> {
    let bytes: &[u8] = bytemuck::cast_slice(values);
    ctx.check_binding(label, bytes.len() as u64)?;
    ctx.buffer_with(
        label,
        bytes,
        bytes.len() as u64 + X_WINDOW_BYTES,
        crate::gpu::STORAGE | wgpu::BufferUsages::UNIFORM,
    )
}

/// Where one dispatch reads `x`: a uniform window from an aligned offset, the first value
/// `base` values into it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    offset: u64,
    /// Index of the dispatch's first x value inside the window.
    pub base: u32,
}

impl Window {
    /// The window holding values `first .. first + len` of `x`, when the kernel can read them
    /// there: `x` has `UNIFORM` usage, the device binds [`X_WINDOW_BYTES`] as a uniform, the
    /// values fit the window from its aligned offset and the window fits the buffer.
    pub fn of(ctx: &Context, x: &wgpu::Buffer, first: usize, len: usize) -> Option<Self> {
        let limits = ctx.device.limits();
        if !x.usage().contains(wgpu::BufferUsages::UNIFORM)
            || limits.max_uniform_buffer_binding_size < X_WINDOW_BYTES
        {
            return None;
        }
        let align = u64::from(limits.min_uniform_buffer_offset_alignment).max(4);
        let start = (first as u64).checked_mul(4)?;
        let offset = start / align * align;
        let base = (start - offset) / 4;
        let fits = (base + len as u64) * 4 <= X_WINDOW_BYTES
            && offset.checked_add(X_WINDOW_BYTES)? <= x.size();
        fits.then_some(Self {
            offset,
            base: base as u32,
        })
    }

    /// Most rows of `k` values one window holds after an aligned offset (0 when not one).
    pub fn max_rows(ctx: &Context, k: usize) -> usize {
        let align = u64::from(ctx.device.limits().min_uniform_buffer_offset_alignment).max(4);
        ((X_WINDOW_BYTES - (align - 4)) / 4 / k as u64) as usize
    }

    /// The binding resource for `x`.
    pub fn resource(self, x: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
        window_resource(x, self.offset)
    }
}

/// The window of `buffer` from `offset` (bytes, aligned) as a binding.
pub(crate) fn window_resource(buffer: &wgpu::Buffer, offset: u64) -> wgpu::BindingResource<'_> {
    const SIZE: NonZeroU64 = match NonZeroU64::new(X_WINDOW_BYTES) {
        Some(size) => size,
        None => panic!("an empty window"),
    };
    range(buffer, offset, SIZE)
}
