//! Llama RMSNorm on the GPU (`shaders/rms_norm.wgsl`), out of place:
//!
//! ```text
//! out[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * weight[i]
//! ```
//!
//! for `rows` rows of `dim` f32 values. The CPU reference is
//! [`crate::reference::ops::rms_norm`].
//!
//! One workgroup per row (any `dim`) of [`workgroup_size`] invocations (256 where the device
//! allows; 8 on CPU adapters), a fixed reduction order ([`tree_size`] partial sums, each over
//! its strided elements in index order, then a tree in workgroup memory; 8 invocations take
//! 32 partials each): the bits of a row's output depend only on that row, `weight`, `eps` and
//! the device's tree size, never on how many rows share the call, where the call's slices of
//! the buffers begin (ARCHITECTURE.md section 1) or the workgroup size.
//!
//! No finite input overflows: the kernel scales the row by a power of two (exactly) so that its
//! largest magnitude is about 1 before squaring, so rows of magnitude `1e18` or `3e38` normalize
//! as well as rows of magnitude 1. A row of zeros gives zeros, with `eps = 0` too. The outputs
//! of a row holding an infinity or a NaN are unspecified (WGSL leaves such arithmetic to the
//! adapter).
//!
//! # Accuracy
//!
//! Within `2e-6` of the f64 reference, relative to each output (the test's bound). The sum of
//! squares carries at most `ceil(dim / TREE) + log2(TREE)` f32 roundings of `2^-24` each
//! (`2.4e-6` relative at `dim = 8192` with 256 partials if every one went the same way; far
//! less in practice), halved by the square root; `inverseSqrt` adds at most 2 ulp (WGSL) and
//! the three products 0.5 ulp each.

use crate::decoder::ops::PreparedOp;
use crate::gpu::dispatch::{bind, check_distinct, max_bound_elems, mul};
use crate::gpu::dispatch::{binding_limit, check_positive};
use crate::gpu::{check_storage, Context};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `RmsNormParams` uniform (one per dispatch).
    pub struct RmsNormParams {
        /// Rows in this dispatch.
        pub rows: u32,
        /// Values per row.
        pub dim: u32,
        /// Added to the mean of squares.
        pub eps: f32,
        /// Workgroups along x of the dispatch grid.
        pub groups_x: u32,
        /// Index of the dispatch's first row inside the x binding.
        pub x_base: u32,
        /// The same inside the out binding.
        pub out_base: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
    }
}

/// Invocations per workgroup and partial sums per reduction (the WGSL `WG` and `TREE`; one
/// workgroup per row) on devices that allow it.
pub const WORKGROUP_SIZE: u32 = 256;

/// Invocations per workgroup with [`Capabilities::narrow_workgroups`](crate::gpu::Capabilities::narrow_workgroups)
/// (CPU adapters by default): one SIMD vector of lavapipe. A CPU adapter runs a workgroup's
/// invocations one vector after another and each barrier switches between them. The 8 take
/// the partial sums of [`tree_size`] invocations in the same order: the same bits.
pub const NARROW_WORKGROUP_SIZE: u32 = 8;

/// Invocations per workgroup on `ctx`'s device: [`NARROW_WORKGROUP_SIZE`] with narrow
/// workgroups ([`ContextOptions::narrow_workgroups`](crate::gpu::ContextOptions::narrow_workgroups),
/// the default on CPU adapters), else [`tree_size`]. The bits do not depend on it.
pub fn workgroup_size(ctx: &Context) -> u32 {
    let tree = tree_size(ctx);
    if ctx.caps().narrow_workgroups {
        NARROW_WORKGROUP_SIZE.min(tree)
    } else {
        tree
    }
}

/// Partial sums of a row's reductions on `ctx`'s device: [`WORKGROUP_SIZE`], or the largest
/// power of two within the device's `max_compute_invocations_per_workgroup` when that is
/// smaller (GLES guarantees 128). A row's result depends on it (the tree of partial sums),
/// never on the batch or the workgroup size.
pub fn tree_size(ctx: &Context) -> u32 {
    let limit = ctx.caps().max_compute_invocations_per_workgroup.max(1);
    WORKGROUP_SIZE.min(1 << (31 - limit.leading_zeros()))
}

/// Override constants for the naga tests: the usual workgroup, GLES's smallest, and the narrow
/// one with each.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    [(256.0, 256.0), (128.0, 128.0), (8.0, 256.0), (8.0, 128.0)]
        .map(|(wg, tree)| vec![("WG", wg), ("TREE", tree)])
        .to_vec()
}

/// One RMSNorm: `rows` rows of `dim` values of `x` into `out`, scaled by `weight`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNormArgs<'a> {
    /// Rows.
    pub rows: usize,
    /// Values per row.
    pub dim: usize,
    /// Added to the mean of squares (finite, `>= 0`).
    pub eps: f32,
    /// Input `[rows, dim]` (f32 storage).
    pub x: &'a wgpu::Buffer,
    /// Weight `[dim]` (f32 storage).
    pub weight: &'a wgpu::Buffer,
    /// Output `[rows, dim]` (f32 storage, other than `x` and `weight`).
    pub out: &'a wgpu::Buffer,
}

/// Checks `args` and prepares the op (see [`rms_norm`] for the rules and errors).
pub fn prepare_rms_norm(ctx: &Context, args: &RmsNormArgs<'_>) -> Result<PreparedOp> {
    let RmsNormArgs {
        rows,
        dim,
        eps,
        x,
        weight,
        out,
    } = *args;
    check_positive("rms_norm", &[("rows", rows), ("dim", dim)])?;
    if !eps.is_finite() || eps < 0.0 || (eps != 0.0 && !eps.is_normal()) {
        return Err(Error::InvalidArgument(format!(
            "rms_norm: eps {eps} must be 0 or a finite, normal f32 >= {:e} (drivers may flush \
             subnormals)",
            f32::MIN_POSITIVE
        )));
    }
    let elems = mul("rms_norm rows * dim", rows, dim)?;
    check_storage("rms_norm x", x, elems)?;
    check_storage("rms_norm weight", weight, dim)?;
    check_storage("rms_norm out", out, elems)?;
    check_distinct("rms_norm", ("out", out), &[("x", x), ("weight", weight)])?;
    let per_binding = max_bound_elems(ctx);
    if dim as u64 > per_binding {
        return Err(Error::TooLarge {
            what: format!("one rms_norm row ({dim} values)"),
            bytes: dim as u64 * 4,
            limit: binding_limit(ctx),
        });
    }
    let rows_per_chunk = (per_binding / dim as u64) as usize;
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::RmsNorm, Precision::F32),
        &[
            ("WG", f64::from(workgroup_size(ctx))),
            ("TREE", f64::from(tree_size(ctx))),
        ],
    );
    let pipeline = ctx.pipeline(&key)?;
    let max_groups = ctx.caps().max_compute_workgroups_per_dimension.max(1) as usize;
    let w = bind(ctx, 0, dim as u64)?;
    let mut uniforms = Vec::new();
    let mut dispatches = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let n = rows_per_chunk.min(rows - r0);
        let first = (r0 * dim) as u64;
        let span = (n * dim) as u64;
        let (xs, os) = (bind(ctx, first, span)?, bind(ctx, first, span)?);
        let gx = n.min(max_groups);
        let gy = n.div_ceil(gx);
        let params = RmsNormParams {
            rows: n as u32,
            dim: dim as u32,
            eps,
            groups_x: gx as u32,
            x_base: xs.base,
            out_base: os.base,
            ..Default::default()
        };
        let uniform = ctx.uniform("rms_norm params", &params)?;
        let resources = [
            uniform.as_entire_binding(),
            xs.resource(x),
            w.resource(weight),
            os.resource(out),
        ];
        let grid = [gx as u32, gy as u32, 1];
        dispatches.push(ctx.prepare_dispatch("rms_norm", &pipeline, &resources, grid)?);
        uniforms.push(uniform);
        r0 += n;
    }
    Ok(PreparedOp {
        dispatches,
        _uniforms: uniforms,
    })
}

/// Records the op into `pass` (submits nothing); on error nothing is recorded.
pub fn encode_rms_norm(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    args: &RmsNormArgs<'_>,
) -> Result<()> {
    prepare_rms_norm(ctx, args)?.encode(pass);
    Ok(())
}

/// RMSNorm of `rows` rows of `dim` values: `x` holds `[rows, dim]` f32 values, `weight`
/// `[dim]`, and the first `rows * dim` values of `out` are written (the rest is not touched).
/// `eps` must be 0 or a finite normal f32 (at least `f32::MIN_POSITIVE`; Llama uses `1e-5` or
/// `1e-6`): drivers may flush a subnormal `eps` to 0. `out` must be a buffer other
/// than `x` and `weight`. Rows are processed in slices when `x` or `out` exceeds one storage
/// binding (one submission).
///
/// # Errors
/// Everything is checked before anything is dispatched: [`Error::InvalidArgument`] when `rows`
/// or `dim` is 0 or does not fit a u32, `rows * dim` overflows, `eps` is negative, subnormal or not finite,
/// a buffer lacks `STORAGE` usage, or `out` is `x` or `weight`; [`Error::ShapeMismatch`] when a
/// buffer holds fewer values than the shape needs; [`Error::TooLarge`] when one row exceeds a
/// storage binding; [`Error::Wgpu`] or [`Error::Shader`] from wgpu.
pub fn rms_norm(
    ctx: &Context,
    rows: usize,
    dim: usize,
    eps: f32,
    x: &wgpu::Buffer,
    weight: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Result<()> {
    let args = RmsNormArgs {
        rows,
        dim,
        eps,
        x,
        weight,
        out,
    };
    let op = prepare_rms_norm(ctx, &args)?;
    ctx.run_pass("rms_norm", |pass| {
        op.encode(pass);
        Ok(())
    })
    .map(|_| ())
}
