//! SwiGLU on the GPU (`shaders/swiglu.wgsl`): the gated activation of a Llama MLP,
//! `out[i] = silu(gate[i]) * up[i]` with `silu(g) = g / (1 + exp(-g))`. The CPU reference is
//! [`crate::reference::ops::swiglu`].
//!
//! The kernel evaluates the sigmoid from `exp(-|g|)` only, so no input overflows `exp`: a very
//! negative gate (e.g. `-1e4`) gives `-0 * up`, a very positive one (`g > 17.33`, where
//! `exp(-g) < 2^-25` and the sigmoid rounds to 1) gives exactly `gate * up`. Finite inputs give
//! finite outputs (unless `gate * up` itself overflows); NaN propagates.

use crate::decoder::ops::{check_distinct, prepare_elementwise, PreparedOp};
use crate::gpu::dispatch::check_positive;
use crate::gpu::{check_storage, Context};
use crate::shader::Kernel;
use crate::Result;

crate::wgsl_struct! {
    /// Mirror of the WGSL `SwigluParams` uniform (one per dispatch).
    pub struct SwigluParams {
        /// Elements in this dispatch.
        pub n: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// Index of the dispatch's first element inside each binding.
        pub base: u32,
        /// Padding.
        pub _pad0: u32,
    }
}

/// Override constants for the naga tests (the kernel has none).
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    vec![Vec::new()]
}

/// One SwiGLU: `out[i] = silu(gate[i]) * up[i]` for `i < n`.
#[derive(Debug, Clone, Copy)]
pub struct SwigluArgs<'a> {
    /// Elements.
    pub n: usize,
    /// The gate (f32 storage).
    pub gate: &'a wgpu::Buffer,
    /// The linear branch (f32 storage; may be `gate`).
    pub up: &'a wgpu::Buffer,
    /// Written (f32 storage, other than `gate` and `up`).
    pub out: &'a wgpu::Buffer,
}

/// Checks `args` and prepares the op (see [`swiglu`] for the rules and errors).
pub fn prepare_swiglu(ctx: &Context, args: &SwigluArgs<'_>) -> Result<PreparedOp> {
    let SwigluArgs { n, gate, up, out } = *args;
    check_positive("swiglu", &[("n", n)])?;
    check_storage("swiglu gate", gate, n)?;
    check_storage("swiglu up", up, n)?;
    check_storage("swiglu out", out, n)?;
    check_distinct("swiglu", ("out", out), &[("gate", gate), ("up", up)])?;
    prepare_elementwise(
        ctx,
        Kernel::Swiglu,
        n,
        &[gate, up, out],
        |n, stride_x, base| SwigluParams {
            n,
            stride_x,
            base,
            ..Default::default()
        },
    )
}

/// Records the op into `pass` (submits nothing); on error nothing is recorded.
pub fn encode_swiglu(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    args: &SwigluArgs<'_>,
) -> Result<()> {
    prepare_swiglu(ctx, args)?.encode(pass);
    Ok(())
}

/// `out[i] = silu(gate[i]) * up[i]` for `i < n`, on f32 storage buffers (see the module docs
/// for the numerics). Elements of `out` past `n` are not touched. `gate` and `up` may be the
/// same buffer; `out` must differ from both. Buffers larger than one storage binding are
/// processed in slices (one submission).
///
/// # Errors
/// Everything is checked before anything is dispatched: [`Error::InvalidArgument`] when `n` is
/// 0 or does not fit a u32, when a buffer lacks `STORAGE` usage, or when `out` is `gate` or
/// `up`; [`Error::ShapeMismatch`] when a buffer holds fewer than `n` f32 values;
/// [`Error::Wgpu`] or [`Error::Shader`] from wgpu.
///
/// [`Error::InvalidArgument`]: crate::Error::InvalidArgument
/// [`Error::ShapeMismatch`]: crate::Error::ShapeMismatch
/// [`Error::Wgpu`]: crate::Error::Wgpu
/// [`Error::Shader`]: crate::Error::Shader
pub fn swiglu(
    ctx: &Context,
    n: usize,
    gate: &wgpu::Buffer,
    up: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Result<()> {
    let op = prepare_swiglu(ctx, &SwigluArgs { n, gate, up, out })?;
    ctx.run_pass("swiglu", |pass| {
        op.encode(pass);
        Ok(())
    })
    .map(|_| ())
}
