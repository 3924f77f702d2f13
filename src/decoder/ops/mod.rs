//! The small GPU kernels a Llama-family decoder needs besides attention, RoPE
//! ([`crate::rope`]) and matrix products ([`crate::mla::head_matmul`]), all on f32 storage
//! buffers:
//!
//! - [`rms_norm::rms_norm`]: Llama RMSNorm, one workgroup per row, batch-invariant;
//! - [`swiglu::swiglu`]: `silu(gate) * up`, overflow-safe;
//! - [`add::add_in_place`]: `x += y`, the residual connection, and
//!   [`add::prepare_bias_add`]: `x[r] += b` on every row (Qwen2's Q/K/V biases);
//! - [`embed::embed`]: the token-embedding gather, with [`embed::embed_host_check`] for ids;
//! - [`qmatmul::qmatmul`]: the matrix product over weights in their GGUF block format, and
//!   [`qembed::qembed`] the gather from such a table; [`qmatmul_group::prepare_qmatmul_group`]
//!   several such products of one row in one dispatch (CPU adapters; prepared form only).
//!
//! Each kernel is one `.rs` here and one `.wgsl` of the same name in `shaders/`; its CPU
//! reference is in [`crate::reference::ops`]. Every entry point checks all of its arguments
//! (positive dimensions that fit a u32, storage buffers large enough, outputs distinct from
//! inputs) and returns a typed [`Error`](crate::Error) before anything is dispatched.
//!
//! Buffers may be larger than one storage binding: the kernels bind them in slices (from
//! offsets aligned to `min_storage_buffer_offset_alignment`) and dispatch once per slice, in one
//! submission. Work is submitted, not waited for; read the output back (or submit more work) as
//! usual.
//!
//! Each op comes in three forms, with the same checks and the same bits:
//! - `prepare_<op>(ctx, &args) -> PreparedOp`: checks everything and makes the bind groups
//!   once; [`PreparedOp::encode`] then records the op into a caller's compute pass any number
//!   of times, creating nothing (the decoder records its warm steps this way);
//! - `encode_<op>(ctx, pass, &args)`: prepare and record into a caller's pass (submits nothing);
//! - the plain function: the op in a compute pass of its own, submitted.

pub(crate) use crate::gpu::dispatch::check_distinct;
use crate::gpu::dispatch::{bind, element_grid, max_bound_elems};
use crate::gpu::{Context, Dispatch};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::Result;

pub mod add;
pub mod embed;
pub mod qembed;
pub mod qmatmul;
pub mod qmatmul_group;
pub mod qmatmul_rows;
pub mod qmatmul_tiled;
pub mod rms_norm;
pub mod swiglu;

/// One op prepared for a fixed shape and fixed buffers: its bind groups (and the uniforms they
/// bind) made once, so that recording it again creates nothing. Made by the `prepare_*`
/// functions of the op modules ([`rms_norm::prepare_rms_norm`], [`swiglu::prepare_swiglu`],
/// [`add::prepare_add`], [`embed::prepare_embed`]); the decoder keeps one per op of a step.
/// The buffers it binds stay alive as long as it does.
#[derive(Debug)]
pub struct PreparedOp {
    dispatches: Vec<Dispatch>,
    /// The per-dispatch parameter uniforms (bound by `dispatches`; kept with them).
    _uniforms: Vec<wgpu::Buffer>,
}

impl PreparedOp {
    /// Records the op's dispatches into `pass` (creates nothing, submits nothing).
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        for dispatch in &self.dispatches {
            dispatch.encode(pass);
        }
    }

    /// Dispatches the op records (one per slice of buffers larger than a storage binding).
    pub fn num_dispatches(&self) -> usize {
        self.dispatches.len()
    }
}

/// Prepares an element-wise kernel over elements `0..n` of every buffer in `buffers`
/// (bindings 1, 2, ... after the uniform at binding 0), in slices of at most
/// [`max_bound_elems`] elements. `params(n, stride_x, base)` builds a slice's uniform: its
/// element count, the invocations along x of its grid, and the index of its first element
/// inside each binding. The caller has validated everything.
pub(crate) fn prepare_elementwise<P: bytemuck::Pod>(
    ctx: &Context,
    kernel: Kernel,
    n: usize,
    buffers: &[&wgpu::Buffer],
    params: impl Fn(u32, u32, u32) -> P,
) -> Result<PreparedOp> {
    prepare_elementwise_with(ctx, kernel, n, (buffers, &[]), |n, stride_x, base, _| {
        params(n, stride_x, base)
    })
}

/// [`prepare_elementwise`] with, after the sliced buffers, buffers bound whole in every slice
/// (`(sliced, whole)`; each whole one must fit one binding); `params` also gets the index of
/// the slice's first element in the sliced buffers.
pub(crate) fn prepare_elementwise_with<P: bytemuck::Pod>(
    ctx: &Context,
    kernel: Kernel,
    n: usize,
    (buffers, whole): (&[&wgpu::Buffer], &[&wgpu::Buffer]),
    params: impl Fn(u32, u32, u32, u64) -> P,
) -> Result<PreparedOp> {
    let key = PipelineKey::new(ShaderVariant::new(kernel, Precision::F32), &[]);
    let pipeline = ctx.pipeline(&key)?;
    let per = max_bound_elems(ctx);
    let n = n as u64;
    let mut uniforms = Vec::new();
    let mut dispatches = Vec::new();
    let mut first = 0;
    while first < n {
        let elems = per.min(n - first);
        let bound = bind(ctx, first, elems)?;
        let (grid, stride_x) = element_grid(ctx, elems);
        let uniform = ctx.uniform(
            kernel.name(),
            &params(elems as u32, stride_x, bound.base, first),
        )?;
        let mut resources = vec![uniform.as_entire_binding()];
        resources.extend(buffers.iter().map(|b| bound.resource(b)));
        resources.extend(whole.iter().map(|b| b.as_entire_binding()));
        dispatches.push(ctx.prepare_dispatch(kernel.name(), &pipeline, &resources, grid)?);
        uniforms.push(uniform);
        first += elems;
    }
    Ok(PreparedOp {
        dispatches,
        _uniforms: uniforms,
    })
}
