//! The small GPU kernels a Llama-family decoder needs besides attention, RoPE
//! ([`crate::rope`]) and matrix products ([`crate::mla::head_matmul`]), all on f32 storage
//! buffers:
//!
//! - [`rms_norm::rms_norm`]: Llama RMSNorm, one workgroup per row, batch-invariant;
//! - [`swiglu::swiglu`]: `silu(gate) * up`, overflow-safe;
//! - [`add::add_in_place`]: `x += y`, the residual connection;
//! - [`embed::embed`]: the token-embedding gather, with [`embed::embed_host_check`] for ids.
//!
//! Each kernel is one `.rs` here and one `.wgsl` of the same name in `shaders/`; its CPU
//! reference is in [`crate::reference::ops`]. Every entry point checks all of its arguments
//! (positive dimensions that fit a u32, storage buffers large enough, outputs distinct from
//! inputs) and returns a typed [`Error`] before anything is dispatched.
//!
//! Buffers may be larger than one storage binding: the kernels bind them in slices (from
//! offsets aligned to `min_storage_buffer_offset_alignment`) and dispatch once per slice, in one
//! submission. Work is submitted, not waited for; read the output back (or submit more work) as
//! usual.

use std::num::NonZeroU64;

use crate::gpu::Context;
use crate::mla::head_matmul::{binding_limit, submit_dispatches};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

pub mod add;
pub mod embed;
pub mod rms_norm;
pub mod swiglu;

/// Invocations per workgroup of the one-invocation-per-element kernels (their WGSL
/// `@workgroup_size`).
pub(crate) const WG: u64 = 64;

/// The part of a buffer one dispatch binds: from `offset` (aligned) for `size` bytes; the
/// dispatch's first element is `base` elements into the binding.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bound {
    offset: u64,
    size: NonZeroU64,
    /// Index of the first element of interest inside the binding.
    pub base: u32,
}

impl Bound {
    /// The binding resource for `buffer`.
    pub fn resource(self, buffer: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
        crate::mla::head_matmul::range(buffer, self.offset, self.size)
    }
}

fn offset_alignment(ctx: &Context) -> u64 {
    u64::from(ctx.device.limits().min_storage_buffer_offset_alignment).max(4)
}

/// Most 32-bit elements one dispatch may bind from an arbitrary first element: a binding,
/// less the slack of aligning its offset down.
pub(crate) fn max_bound_elems(ctx: &Context) -> u64 {
    (binding_limit(ctx) - offset_alignment(ctx)) / 4
}

/// Binds elements `first .. first + elems` (32-bit) of a buffer that holds them; `elems` must
/// be positive and at most [`max_bound_elems`].
pub(crate) fn bind(ctx: &Context, first: u64, elems: u64) -> Result<Bound> {
    let align = offset_alignment(ctx);
    let start = first * 4;
    let offset = start / align * align;
    let base = (start - offset) / 4;
    let size = NonZeroU64::new((base + elems) * 4)
        .ok_or_else(|| Error::InvalidArgument("an empty binding".into()))?;
    Ok(Bound {
        offset,
        size,
        base: base as u32,
    })
}

/// A 2-D grid of `WG`-invocation workgroups covering `invocations` (at most 2^29, so that the
/// grid fits any adapter's 65,535 per dimension): the grid and the invocations along x.
pub(crate) fn element_grid(ctx: &Context, invocations: u64) -> ([u32; 3], u32) {
    let max_groups = u64::from(ctx.caps().max_compute_workgroups_per_dimension).max(1);
    let groups = invocations.div_ceil(WG).max(1);
    let gx = groups.min(max_groups);
    let gy = groups.div_ceil(gx);
    ([gx as u32, gy as u32, 1], (gx * WG) as u32)
}

/// [`Error::InvalidArgument`] when an output buffer is also one of the inputs (wgpu refuses a
/// buffer bound both read-only and read-write in one dispatch, and the kernels do not support
/// aliasing).
pub(crate) fn check_distinct(
    what: &str,
    out: (&str, &wgpu::Buffer),
    inputs: &[(&str, &wgpu::Buffer)],
) -> Result<()> {
    for (name, input) in inputs {
        if *input == out.1 {
            return Err(Error::InvalidArgument(format!(
                "{what}: {} and {name} must be different buffers",
                out.0
            )));
        }
    }
    Ok(())
}

/// `a * b`, or [`Error::InvalidArgument`] when it overflows a usize.
pub(crate) fn mul(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| Error::InvalidArgument(format!("{what}: {a} * {b} overflows")))
}

/// Dispatches an element-wise kernel over elements `0..n` of every buffer in `buffers`
/// (bindings 1, 2, ... after the uniform at binding 0), in slices of at most
/// [`max_bound_elems`] elements, one submission. `params(n, stride_x, base)` builds a slice's
/// uniform: its element count, the invocations along x of its grid, and the index of its first
/// element inside each binding. The caller has validated everything.
pub(crate) fn dispatch_elementwise<P: bytemuck::Pod>(
    ctx: &Context,
    kernel: Kernel,
    n: usize,
    buffers: &[&wgpu::Buffer],
    params: impl Fn(u32, u32, u32) -> P,
) -> Result<()> {
    let key = PipelineKey::new(ShaderVariant::new(kernel, Precision::F32), &[]);
    let pipeline = ctx.pipeline(&key)?;
    let per = max_bound_elems(ctx);
    let n = n as u64;
    let mut chunks = Vec::new();
    let mut first = 0;
    while first < n {
        let elems = per.min(n - first);
        let bound = bind(ctx, first, elems)?;
        let (grid, stride_x) = element_grid(ctx, elems);
        let uniform = ctx.uniform(kernel.name(), &params(elems as u32, stride_x, bound.base));
        chunks.push((uniform, bound, grid));
        first += elems;
    }
    let dispatches = chunks
        .iter()
        .map(|(uniform, bound, grid)| {
            let mut resources = vec![uniform.as_entire_binding()];
            resources.extend(buffers.iter().map(|b| bound.resource(b)));
            (resources, *grid)
        })
        .collect();
    submit_dispatches(ctx, kernel.name(), &pipeline, dispatches)
}
