//! The residual add on the GPU (`shaders/add.wgsl`): `x[i] += y[i]`, in place, one f32
//! addition per element (correctly rounded on Vulkan, Metal, DX12 and GL, so the result equals
//! the CPU's [`crate::reference::ops::add`] bit for bit for normal values; an adapter that
//! flushes subnormals to zero may differ there). The same kernel adds a bias to every row
//! ([`prepare_bias_add`]: `x[r * dim + j] += b[j]`, Qwen2's Q/K/V biases), with the same
//! rounding and NaN propagation; each element's sum depends on that element alone, so the op is
//! batch-invariant.

use crate::decoder::ops::{
    check_distinct, prepare_elementwise, prepare_elementwise_with, PreparedOp,
};
use crate::gpu::dispatch::{check_positive, max_bound_elems};
use crate::gpu::{check_storage, Context};
use crate::shader::Kernel;
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `AddParams` uniform (one per dispatch).
    pub struct AddParams {
        /// Elements in this dispatch.
        pub n: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// Index of the dispatch's first element inside each binding (of `y` too when
        /// `period` is 0).
        pub base: u32,
        /// 0: `y` is sliced as `x` is; else `y` is a whole bias of `period` values, added to
        /// every row of `period` elements of `x`.
        pub period: u32,
        /// With a bias: the bias index of the dispatch's first element.
        pub phase: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
        /// Padding.
        pub _pad2: u32,
    }
}

/// Override constants for the naga tests (the kernel has none).
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    vec![Vec::new()]
}

/// One residual add: `x[i] += y[i]` for `i < n`.
#[derive(Debug, Clone, Copy)]
pub struct AddArgs<'a> {
    /// Elements to add.
    pub n: usize,
    /// Added into, in place (f32 storage).
    pub x: &'a wgpu::Buffer,
    /// Added (f32 storage, a buffer other than `x`).
    pub y: &'a wgpu::Buffer,
}

/// Checks `args` and prepares the add (see [`add_in_place`] for the rules and errors).
pub fn prepare_add(ctx: &Context, args: &AddArgs<'_>) -> Result<PreparedOp> {
    let AddArgs { n, x, y } = *args;
    check_positive("add", &[("n", n)])?;
    check_storage("add x", x, n)?;
    check_storage("add y", y, n)?;
    check_distinct("add", ("x", x), &[("y", y)])?;
    prepare_elementwise(ctx, Kernel::Add, n, &[x, y], |n, stride_x, base| {
        AddParams {
            n,
            stride_x,
            base,
            ..Default::default()
        }
    })
}

/// A bias added to every row: `x[r * dim + j] += bias[j]` for `r < rows`, `j < dim`.
#[derive(Debug, Clone, Copy)]
pub struct BiasAddArgs<'a> {
    /// Rows of `x`.
    pub rows: usize,
    /// Values per row (and of the bias).
    pub dim: usize,
    /// Added into, in place (f32 storage, at least `rows * dim` values).
    pub x: &'a wgpu::Buffer,
    /// The bias (f32 storage of at least `dim` values, bound whole: it must fit one binding;
    /// a buffer other than `x`).
    pub bias: &'a wgpu::Buffer,
}

/// Checks `args` and prepares the bias add (the kernel of [`add_in_place`], with the bias
/// bound whole in every slice of `x`).
///
/// # Errors
/// Before anything is made: [`Error::InvalidArgument`] when `rows` or `dim` is 0, `rows *
/// dim` or `2 * dim` does not fit a u32, a buffer lacks `STORAGE` usage, the bias is `x`, or
/// its buffer does not fit one binding; [`Error::ShapeMismatch`] when `x` holds fewer than
/// `rows * dim` values or the bias fewer than `dim`; [`Error::Wgpu`] from wgpu.
pub fn prepare_bias_add(ctx: &Context, args: &BiasAddArgs<'_>) -> Result<PreparedOp> {
    let BiasAddArgs { rows, dim, x, bias } = *args;
    check_positive("bias add", &[("rows", rows), ("dim", dim)])?;
    let n = rows
        .checked_mul(dim)
        .filter(|&n| u32::try_from(n).is_ok())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("bias add: {rows} x {dim} values do not fit a u32"))
        })?;
    if u32::try_from(2 * dim as u64).is_err() {
        return Err(Error::InvalidArgument(format!(
            "bias add: a bias of {dim} values is too long"
        )));
    }
    check_storage("bias add x", x, n)?;
    check_storage("bias add bias", bias, dim)?;
    if bias.size() / 4 > max_bound_elems(ctx) {
        return Err(Error::InvalidArgument(format!(
            "bias add: the bias buffer ({} bytes) does not fit one binding",
            bias.size()
        )));
    }
    check_distinct("bias add", ("x", x), &[("bias", bias)])?;
    prepare_elementwise_with(
        ctx,
        Kernel::Add,
        n,
        (&[x], &[bias]),
        |n, stride_x, base, first| AddParams {
            n,
            stride_x,
            base,
            period: dim as u32,
            phase: (first % dim as u64) as u32,
            ..Default::default()
        },
    )
}

/// Records the add into `pass` (submits nothing); on error nothing is recorded.
pub fn encode_add(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    args: &AddArgs<'_>,
) -> Result<()> {
    prepare_add(ctx, args)?.encode(pass);
    Ok(())
}

/// `x[i] += y[i]` for `i < n`, in place on f32 storage buffers; elements past `n` are not
/// touched. `x` and `y` must be different buffers (to double `x`, scale it instead). Buffers
/// larger than one storage binding are processed in slices (one submission).
///
/// # Errors
/// Everything is checked before anything is dispatched: [`Error::InvalidArgument`] when `n` is
/// 0 or does not fit a u32, when a buffer lacks `STORAGE` usage, or when `x` is `y`;
/// [`Error::ShapeMismatch`] when a buffer holds fewer than `n` f32 values; [`Error::Wgpu`] or
/// [`Error::Shader`] from wgpu.
///
/// [`Error::InvalidArgument`]: crate::Error::InvalidArgument
/// [`Error::ShapeMismatch`]: crate::Error::ShapeMismatch
/// [`Error::Wgpu`]: crate::Error::Wgpu
/// [`Error::Shader`]: crate::Error::Shader
pub fn add_in_place(ctx: &Context, n: usize, x: &wgpu::Buffer, y: &wgpu::Buffer) -> Result<()> {
    let args = AddArgs { n, x, y };
    let op = prepare_add(ctx, &args)?;
    ctx.run_pass("add", |pass| {
        op.encode(pass);
        Ok(())
    })
    .map(|_| ())
}
