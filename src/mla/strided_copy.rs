//! A strided copy of a `[rows, heads, n]` block of f32 values between GPU buffers
//! (`shaders/strided_copy.wgsl`), bit for bit (NaN payloads and `-0.0` included). MLA uses it
//! to place the rotated `q_pe` / `k_pe` beside the latent columns of wider rows, and to
//! broadcast the one `k_pe` row of a token to every head (`src.head = 0`); the contiguous decode
//! ([`crate::attention::decode`]) uses it to lay packed K/V rows out as a pool's 16-byte rows.
//!
//! For `t < rows`, `h < heads`, `i < n`:
//!
//! ```text
//! dst[dst.offset + t*dst.row + h*dst.head + i] = src[src.offset + t*src.row + h*src.head + i]
//! ```
//!
//! Only those elements of `dst` are written.

use crate::gpu::check_storage;
use crate::gpu::dispatch::{
    binding_limit, check_positive, check_slice, range, ChunkedOperand, RowStrides,
};
use crate::gpu::{Context, Dispatch};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `StridedCopyParams` uniform (one per dispatch).
    pub struct StridedCopyParams {
        /// Rows in this dispatch.
        pub rows: u32,
        /// Heads.
        pub heads: u32,
        /// Values per (row, head).
        pub n: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// Index of src's first row inside its binding.
        pub src_offset: u32,
        /// Row stride of src.
        pub src_row: u32,
        /// Head stride of src.
        pub src_head: u32,
        /// Index of dst's first row inside its binding.
        pub dst_offset: u32,
        /// Row stride of dst.
        pub dst_row: u32,
        /// Head stride of dst.
        pub dst_head: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
    }
}

/// Invocations per workgroup (the WGSL `@workgroup_size`).
const WG: u64 = 64;

/// The host mirrors of the kernel's WGSL structs, for the naga layout test
/// ([`kernels::param_structs`](crate::kernels::param_structs)).
pub fn param_structs() -> Vec<crate::kernels::StructLayout> {
    vec![crate::kernels::layout_of::<StridedCopyParams>()]
}

/// Override constants for the naga tests (the kernel has none).
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    vec![Vec::new()]
}

/// A strided copy of `rows x heads x n` f32 values (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StridedCopy {
    /// Rows (tokens).
    pub rows: usize,
    /// Heads.
    pub heads: usize,
    /// Values per (row, head).
    pub n: usize,
    /// Strides of the source (`head` may be 0: every head reads the same values).
    pub src: RowStrides,
    /// Strides of the destination.
    pub dst: RowStrides,
}

impl StridedCopy {
    /// Checks that every dimension is positive, every stride, offset and dimension fits a u32,
    /// indices do not overflow, and no two elements are written to the same place.
    pub fn validate(&self) -> Result<()> {
        check_positive(
            "strided_copy",
            &[("rows", self.rows), ("heads", self.heads), ("n", self.n)],
        )?;
        self.src.check_u32("strided_copy src")?;
        self.dst.check_u32("strided_copy dst")?;
        self.src_len()?;
        self.dst_len()?;
        self.dst
            .check_distinct("strided_copy dst", self.rows, self.heads, self.n)
    }

    /// Elements src must hold (its largest index + 1).
    fn src_len(&self) -> Result<usize> {
        Ok(self
            .src
            .last_index("strided_copy src", self.rows, self.heads, self.n)?
            + 1)
    }

    /// Elements dst must hold.
    fn dst_len(&self) -> Result<usize> {
        Ok(self
            .dst
            .last_index("strided_copy dst", self.rows, self.heads, self.n)?
            + 1)
    }

    /// The copy on the CPU; only the elements the copy writes change.
    ///
    /// # Errors
    /// [`validate`](Self::validate), and [`Error::ShapeMismatch`] when a slice is shorter than
    /// the largest index the copy touches.
    pub fn reference(&self, src: &[f32], dst: &mut [f32]) -> Result<()> {
        self.validate()?;
        check_slice("strided_copy src", src.len(), self.src_len()?)?;
        check_slice("strided_copy dst", dst.len(), self.dst_len()?)?;
        for t in 0..self.rows {
            for h in 0..self.heads {
                let s = self.src.offset + t * self.src.row + h * self.src.head;
                let d = self.dst.offset + t * self.dst.row + h * self.dst.head;
                dst[d..d + self.n].copy_from_slice(&src[s..s + self.n]);
            }
        }
        Ok(())
    }
}

/// A copy prepared once: its parameter uniforms, bind groups and grids. Recording it
/// ([`encode`](Self::encode)) creates nothing. It stays bound to the buffers it was prepared
/// with.
#[derive(Debug)]
pub struct PreparedCopy {
    dispatches: Vec<Dispatch>,
    /// Kept alive with the bind groups that read them.
    _params: Vec<wgpu::Buffer>,
}

impl PreparedCopy {
    /// Records the copy's dispatches into `pass`, in order.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        for dispatch in &self.dispatches {
            dispatch.encode(pass);
        }
    }

    /// Dispatches one recording makes.
    pub fn dispatches(&self) -> usize {
        self.dispatches.len()
    }
}

impl StridedCopy {
    /// Checks the copy against its buffers and prepares its dispatches (one parameter uniform
    /// and one bind group each): `src` and `dst` are f32 storage buffers laid out as `self`
    /// says. Rows are split over several dispatches when the slices they touch exceed one
    /// storage binding.
    ///
    /// # Errors
    /// Everything is checked before anything is created: [`StridedCopy::validate`];
    /// [`Error::ShapeMismatch`] when a buffer is smaller than the largest index the copy
    /// touches; [`Error::InvalidArgument`] when `src` and `dst` are the same buffer or one
    /// lacks `STORAGE` usage; [`Error::TooLarge`] when one row of either exceeds a storage
    /// binding; [`Error::Wgpu`] or [`Error::Shader`] from wgpu.
    pub fn prepare(
        &self,
        ctx: &Context,
        src: &wgpu::Buffer,
        dst: &wgpu::Buffer,
    ) -> Result<PreparedCopy> {
        let spec = self;
        spec.validate()?;
        check_storage("strided_copy src", src, spec.src_len()?)?;
        check_storage("strided_copy dst", dst, spec.dst_len()?)?;
        if src == dst {
            return Err(Error::InvalidArgument(
                "strided_copy: src and dst must be different buffers".into(),
            ));
        }
        let so = ChunkedOperand {
            what: "strided_copy src",
            strides: spec.src,
            heads: spec.heads,
            dim: spec.n,
        };
        let dop = ChunkedOperand {
            what: "strided_copy dst",
            strides: spec.dst,
            heads: spec.heads,
            dim: spec.n,
        };
        let max_groups = u64::from(ctx.caps().max_compute_workgroups_per_dimension);
        let per_row = (spec.heads * spec.n) as u64;
        // Elements of one dispatch: within the grid and a u32 index.
        let grid_rows = (max_groups * max_groups * WG).min(u64::from(u32::MAX)) / per_row;
        let per_chunk = so
            .max_rows(ctx)?
            .min(dop.max_rows(ctx)?)
            .min(usize::try_from(grid_rows).unwrap_or(usize::MAX));
        if per_chunk == 0 {
            return Err(Error::TooLarge {
                what: format!("one row of strided_copy ({per_row} values)"),
                bytes: per_row * 4,
                limit: binding_limit(ctx),
            });
        }
        let mut chunks = Vec::new();
        let mut t0 = 0;
        while t0 < spec.rows {
            let rows = per_chunk.min(spec.rows - t0);
            let ss = so.slice(ctx, t0, rows)?;
            let ds = dop.slice(ctx, t0, rows)?;
            let groups = (rows as u64 * per_row).div_ceil(WG);
            let gx = groups.min(max_groups);
            let gy = groups.div_ceil(gx);
            let params = StridedCopyParams {
                rows: rows as u32,
                heads: spec.heads as u32,
                n: spec.n as u32,
                stride_x: (gx * WG) as u32,
                src_offset: ss.offset,
                src_row: spec.src.row as u32,
                src_head: spec.src.head as u32,
                dst_offset: ds.offset,
                dst_row: spec.dst.row as u32,
                dst_head: spec.dst.head as u32,
                ..Default::default()
            };
            chunks.push((params, ss, ds, [gx as u32, gy as u32, 1]));
            t0 += rows;
        }
        let key = PipelineKey::new(ShaderVariant::new(Kernel::StridedCopy, Precision::F32), &[]);
        let pipeline = ctx.pipeline(&key)?;
        let mut params = Vec::with_capacity(chunks.len());
        let mut dispatches = Vec::with_capacity(chunks.len());
        for (p, ss, ds, grid) in &chunks {
            let uniform = ctx.uniform("strided_copy params", p)?;
            dispatches.push(ctx.prepare_dispatch(
                "strided_copy",
                &pipeline,
                &[
                    uniform.as_entire_binding(),
                    range(src, ss.byte_offset, ss.bytes),
                    range(dst, ds.byte_offset, ds.bytes),
                ],
                *grid,
            )?);
            params.push(uniform);
        }
        Ok(PreparedCopy {
            dispatches,
            _params: params,
        })
    }
}

/// Records the copy into `pass` (see [`StridedCopy::prepare`], whose checks and errors it
/// shares): every bind group is created before the first dispatch is recorded; nothing is
/// submitted.
pub fn encode_strided_copy(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    spec: &StridedCopy,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
) -> Result<()> {
    spec.prepare(ctx, src, dst)?.encode(pass);
    Ok(())
}

/// Copies on the GPU in one submission: [`encode_strided_copy`] into a compute pass of its own,
/// submitted.
///
/// # Errors
/// Those of [`StridedCopy::prepare`], before anything is submitted.
pub fn strided_copy(
    ctx: &Context,
    spec: &StridedCopy,
    src: &wgpu::Buffer,
    dst: &wgpu::Buffer,
) -> Result<()> {
    let prepared = spec.prepare(ctx, src, dst)?;
    ctx.run_pass("strided_copy", |pass| {
        prepared.encode(pass);
        Ok(())
    })?;
    Ok(())
}
