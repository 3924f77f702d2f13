//! The residual add on the GPU (`shaders/add.wgsl`): `x[i] += y[i]`, in place, one f32
//! addition per element (correctly rounded on Vulkan, Metal, DX12 and GL, so the result equals
//! the CPU's [`crate::reference::ops::add`] bit for bit for normal values; an adapter that
//! flushes subnormals to zero may differ there).

use crate::decoder::ops::{check_distinct, prepare_elementwise, PreparedOp};
use crate::gpu::dispatch::check_positive;
use crate::gpu::{check_storage, Context};
use crate::shader::Kernel;
use crate::Result;

crate::wgsl_struct! {
    /// Mirror of the WGSL `AddParams` uniform (one per dispatch).
    pub struct AddParams {
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
