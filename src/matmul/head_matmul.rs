//! A strided, per-head batched matrix product on the GPU (`shaders/head_matmul.wgsl`): the MLA
//! up-projection of the latent to per-head keys and values, query absorption
//! (`q_lat = W_UK^T q_nope`, a GEMV per head), and with one head the dense
//! [`Linear`](super::Linear) of the decoder. Also reachable as `kvattn::mla::head_matmul`.
//!
//! For `t < rows`, `h < heads`, `n < n_out`:
//!
//! ```text
//! y[y.offset + t*y.row + h*y.head + n] =
//!     sum over k < inner of x[x.offset + t*x.row + h*x.head + k] * w[h*w_head + k*w_k + n*w_n]
//! ```
//!
//! Strides are in f32 elements and arbitrary (`x.head` or `w_head` may be 0 to broadcast one
//! operand to every head; `w_k = 1, w_n = inner` reads a transposed weight). Only the listed
//! elements of `y` are written: the rest of the buffer keeps its contents, so a caller can fill
//! columns `0..512` of 576-wide rows with one product and the rest with another.
//!
//! Every output is one f32 accumulator summed over `k` in order with `fma`, whatever the tile
//! shape the host picks for the number of rows: a row's result does not depend on how many other
//! rows share the call (ARCHITECTURE.md section 1, batch invariance).

use std::num::NonZeroU64;

use crate::gpu::check_storage;
pub use crate::gpu::dispatch::RowStrides;
use crate::gpu::dispatch::{
    binding_limit, check_positive, check_slice, fit_u32, range, ChunkedOperand,
};
use crate::gpu::{Context, Dispatch};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `HeadMatmulParams` uniform (one per dispatch).
    pub struct HeadMatmulParams {
        /// Rows in this dispatch.
        pub rows: u32,
        /// Length of the reduction.
        pub inner: u32,
        /// Output columns per head.
        pub n_out: u32,
        /// Column tiles (workgroup x = row tile * n_tiles + column tile).
        pub n_tiles: u32,
        /// Index of x's first row inside its binding.
        pub x_offset: u32,
        /// Row stride of x.
        pub x_row: u32,
        /// Head stride of x.
        pub x_head: u32,
        /// Head stride of w.
        pub w_head: u32,
        /// k stride of w.
        pub w_k: u32,
        /// n stride of w.
        pub w_n: u32,
        /// Index of y's first row inside its binding.
        pub y_offset: u32,
        /// Row stride of y.
        pub y_row: u32,
        /// Head stride of y.
        pub y_head: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
        /// Padding.
        pub _pad2: u32,
    }
}

/// A strided per-head matrix product `y[t, h, :] = x[t, h, :] . W[h]` (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadMatmul {
    /// Rows (tokens).
    pub rows: usize,
    /// Heads.
    pub heads: usize,
    /// Length of the reduction (columns of x, rows of each `W[h]`).
    pub inner: usize,
    /// Output columns per head.
    pub n_out: usize,
    /// Strides of x (`[rows, heads, inner]`).
    pub x: RowStrides,
    /// Elements between the weights of consecutive heads (0: one weight for every head).
    pub w_head: usize,
    /// Elements between consecutive k of a weight.
    pub w_k: usize,
    /// Elements between consecutive output columns of a weight.
    pub w_n: usize,
    /// Strides of y (`[rows, heads, n_out]`).
    pub y: RowStrides,
}

/// Workgroup tile shape: the kernel's override constants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tile {
    /// Invocations per workgroup.
    wg: u32,
    /// Rows per tile.
    tm: u32,
    /// Rows per invocation (1 to 8).
    rm: u32,
    /// Column vec4s per invocation (1 to 4).
    rn4: u32,
    /// k per stage (a multiple of 4).
    tk: u32,
    /// Whether the w tile goes through workgroup memory.
    stage_w: bool,
}

impl Tile {
    /// The tile for a product of `rows` rows of `n_out` columns. Up to 8 rows, one invocation
    /// keeps every row of its columns and reads their weights straight from w (each weight is
    /// read once per workgroup; narrow products use 32 invocations so that fewer columns go
    /// idle); from 9 rows on, the w tile goes through workgroup memory and serves 16 or 64 rows.
    /// Measured on lavapipe (2 cores): 4,096 rows x 128 heads, inner 512, n_out 128 run at
    /// 6.7-7.5 GFLOP/s with the 64 x 64 tile (0.5 with one output per invocation); the one-row
    /// GEMV (128 heads, inner 128, n_out 512) at 0.8 GFLOP/s, bound by the weight reads.
    fn for_shape(rows: usize, n_out: usize) -> Tile {
        let wg = if n_out <= 128 { 32 } else { 64 };
        let direct = |tm| Tile {
            wg,
            tm,
            rm: tm,
            rn4: 1,
            tk: 16,
            stage_w: false,
        };
        match rows {
            1 => direct(1),
            2..=4 => direct(4),
            5..=8 => direct(8),
            9..=32 => Tile {
                wg: 64,
                tm: 16,
                rm: 8,
                rn4: 1,
                tk: 16,
                stage_w: true,
            },
            _ => Tile {
                wg: 64,
                tm: 64,
                rm: 8,
                rn4: 2,
                tk: 16,
                stage_w: true,
            },
        }
    }

    /// (rows, n_out) pairs that reach every tile shape.
    const SHAPES: [(usize, usize); 6] =
        [(1, 512), (1, 128), (4, 512), (8, 64), (16, 128), (64, 128)];

    /// Columns per tile.
    fn tn(&self) -> u32 {
        self.wg / (self.tm / self.rm) * self.rn4 * 4
    }

    fn constants(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("WG", f64::from(self.wg)),
            ("TM", f64::from(self.tm)),
            ("RM", f64::from(self.rm)),
            ("RN4", f64::from(self.rn4)),
            ("TK", f64::from(self.tk)),
            ("STAGE_W", f64::from(u8::from(self.stage_w))),
        ]
    }
}

/// The host mirrors of the kernel's WGSL structs, for the naga layout test
/// ([`kernels::param_structs`](crate::kernels::param_structs)).
pub fn param_structs() -> Vec<crate::kernels::StructLayout> {
    vec![crate::kernels::layout_of::<HeadMatmulParams>()]
}

/// Override constants for the naga tests: every tile shape the host picks.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    Tile::SHAPES
        .iter()
        .map(|&(rows, n_out)| Tile::for_shape(rows, n_out).constants())
        .collect()
}

impl HeadMatmul {
    /// Checks that every dimension is positive, every stride, offset and dimension fits a u32,
    /// indices do not overflow, and no two outputs share an element of y.
    pub fn validate(&self) -> Result<()> {
        check_positive(
            "head_matmul",
            &[
                ("rows", self.rows),
                ("heads", self.heads),
                ("inner", self.inner),
                ("n_out", self.n_out),
            ],
        )?;
        self.x.check_u32("head_matmul x")?;
        self.y.check_u32("head_matmul y")?;
        for (name, v) in [
            ("w_head", self.w_head),
            ("w_k", self.w_k),
            ("w_n", self.w_n),
        ] {
            fit_u32(&format!("head_matmul {name}"), v)?;
        }
        self.x_len()?;
        self.w_len()?;
        self.y_len()?;
        self.y
            .check_distinct("head_matmul y", self.rows, self.heads, self.n_out)
    }

    /// Elements x must hold (its largest index + 1).
    fn x_len(&self) -> Result<usize> {
        Ok(self
            .x
            .last_index("head_matmul x", self.rows, self.heads, self.inner)?
            + 1)
    }

    /// Elements w must hold.
    fn w_len(&self) -> Result<usize> {
        let overflow = || Error::InvalidArgument("head_matmul w: element indices overflow".into());
        let last = [
            (self.heads - 1, self.w_head),
            (self.inner - 1, self.w_k),
            (self.n_out - 1, self.w_n),
        ]
        .iter()
        .try_fold(0usize, |acc, &(i, s)| {
            i.checked_mul(s).and_then(|v| acc.checked_add(v))
        })
        .ok_or_else(overflow)?;
        Ok(last + 1)
    }

    /// Elements y must hold.
    fn y_len(&self) -> Result<usize> {
        Ok(self
            .y
            .last_index("head_matmul y", self.rows, self.heads, self.n_out)?
            + 1)
    }

    /// Floating-point operations: 2 per multiply-add.
    pub fn flops(&self) -> u64 {
        2 * self.rows as u64 * self.heads as u64 * self.inner as u64 * self.n_out as u64
    }

    /// The product on the CPU in f64 (plain loops), rounded to f32 into `y`; only the elements
    /// the product writes change.
    ///
    /// # Errors
    /// [`validate`](Self::validate), and [`Error::ShapeMismatch`] when a slice is shorter than
    /// the largest index the product touches.
    pub fn reference(&self, x: &[f32], w: &[f32], y: &mut [f32]) -> Result<()> {
        self.validate()?;
        check_slice("head_matmul x", x.len(), self.x_len()?)?;
        check_slice("head_matmul w", w.len(), self.w_len()?)?;
        check_slice("head_matmul y", y.len(), self.y_len()?)?;
        for t in 0..self.rows {
            for h in 0..self.heads {
                let xb = self.x.offset + t * self.x.row + h * self.x.head;
                let yb = self.y.offset + t * self.y.row + h * self.y.head;
                for n in 0..self.n_out {
                    let mut sum = 0f64;
                    for k in 0..self.inner {
                        let wv = w[h * self.w_head + k * self.w_k + n * self.w_n];
                        sum += f64::from(x[xb + k]) * f64::from(wv);
                    }
                    y[yb + n] = sum as f32;
                }
            }
        }
        Ok(())
    }
}

/// A product prepared once: its parameter uniforms, bind groups and grids. Recording it
/// ([`encode`](Self::encode)) creates nothing, so a caller that keeps it records warm steps
/// without touching the device. It stays bound to the buffers it was prepared with.
#[derive(Debug)]
pub struct PreparedMatmul {
    dispatches: Vec<Dispatch>,
    /// Kept alive with the bind groups that read them.
    _params: Vec<wgpu::Buffer>,
    flops: u64,
}

impl PreparedMatmul {
    /// Records the product's dispatches into `pass`, in order.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        for dispatch in &self.dispatches {
            dispatch.encode(pass);
        }
    }

    /// Floating-point operations of one recording (2 per multiply-add).
    pub fn flops(&self) -> u64 {
        self.flops
    }

    /// Dispatches one recording makes (rows are split when a slice of x or y exceeds one
    /// storage binding or the workgroup grid).
    pub fn dispatches(&self) -> usize {
        self.dispatches.len()
    }
}

impl HeadMatmul {
    /// Checks the product against its buffers and prepares its dispatches (one parameter
    /// uniform and one bind group each): `x`, `w` and `y` are f32 storage buffers laid out as
    /// `self` says. Rows are split over several dispatches when the slices of x or y they touch
    /// exceed one storage binding or the workgroup grid; w must fit one binding.
    ///
    /// # Errors
    /// Everything is checked before anything is created: [`HeadMatmul::validate`];
    /// [`Error::ShapeMismatch`] when a buffer is smaller than the largest index the product
    /// touches; [`Error::InvalidArgument`] when y is also x or w, a buffer lacks `STORAGE`
    /// usage, or `heads` exceeds the adapter's workgroups per dimension; [`Error::TooLarge`]
    /// when w, or one row of x or y, exceeds a storage binding; [`Error::Wgpu`] or
    /// [`Error::Shader`] from wgpu.
    pub fn prepare(
        &self,
        ctx: &Context,
        x: &wgpu::Buffer,
        w: &wgpu::Buffer,
        y: &wgpu::Buffer,
    ) -> Result<PreparedMatmul> {
        let spec = self;
        spec.validate()?;
        check_storage("head_matmul x", x, spec.x_len()?)?;
        check_storage("head_matmul w", w, spec.w_len()?)?;
        check_storage("head_matmul y", y, spec.y_len()?)?;
        if y == x || y == w {
            return Err(Error::InvalidArgument(
                "head_matmul writes y out of place: it must be a buffer other than x and w".into(),
            ));
        }
        let w_bytes = spec.w_len()? as u64 * 4;
        let limit = binding_limit(ctx);
        if w_bytes > limit {
            return Err(Error::TooLarge {
                what: "head_matmul weights w".into(),
                bytes: w_bytes,
                limit,
            });
        }
        let max_groups = ctx.caps().max_compute_workgroups_per_dimension;
        let heads = fit_u32("head_matmul heads", spec.heads)?;
        if heads > max_groups {
            return Err(Error::InvalidArgument(format!(
                "head_matmul: {heads} heads exceed the adapter's {max_groups} workgroups per \
                 dimension"
            )));
        }
        let tile = Tile::for_shape(spec.rows, spec.n_out);
        let tm = tile.tm as usize;
        let n_tiles = spec.n_out.div_ceil(tile.tn() as usize);
        if n_tiles > max_groups as usize {
            return Err(Error::InvalidArgument(format!(
                "head_matmul: {n_tiles} column tiles exceed the adapter's {max_groups} \
                 workgroups per dimension"
            )));
        }
        let xo = ChunkedOperand {
            what: "head_matmul x",
            strides: spec.x,
            heads: spec.heads,
            dim: spec.inner,
        };
        let yo = ChunkedOperand {
            what: "head_matmul y",
            strides: spec.y,
            heads: spec.heads,
            dim: spec.n_out,
        };
        let mut per_chunk = xo
            .max_rows(ctx)?
            .min(yo.max_rows(ctx)?)
            .min(max_groups as usize / n_tiles * tm);
        if per_chunk >= tm {
            per_chunk = per_chunk / tm * tm;
        }
        let w_range = NonZeroU64::new(w_bytes)
            .ok_or_else(|| Error::InvalidArgument("head_matmul w: empty".into()))?;
        // Every slice and parameter block first: nothing is created for a product that fails
        // its checks.
        let mut chunks = Vec::new();
        let mut t0 = 0;
        while t0 < spec.rows {
            let rows = per_chunk.min(spec.rows - t0);
            let xs = xo.slice(ctx, t0, rows)?;
            let ys = yo.slice(ctx, t0, rows)?;
            let params = HeadMatmulParams {
                rows: rows as u32,
                inner: spec.inner as u32,
                n_out: spec.n_out as u32,
                n_tiles: n_tiles as u32,
                x_offset: xs.offset,
                x_row: spec.x.row as u32,
                x_head: spec.x.head as u32,
                w_head: spec.w_head as u32,
                w_k: spec.w_k as u32,
                w_n: spec.w_n as u32,
                y_offset: ys.offset,
                y_row: spec.y.row as u32,
                y_head: spec.y.head as u32,
                ..Default::default()
            };
            let grid = [(rows.div_ceil(tm) * n_tiles) as u32, heads, 1];
            chunks.push((params, xs, ys, grid));
            t0 += rows;
        }
        let key = PipelineKey::new(
            ShaderVariant::new(Kernel::HeadMatmul, Precision::F32),
            &tile.constants(),
        );
        let pipeline = ctx.pipeline(&key)?;
        let mut params = Vec::with_capacity(chunks.len());
        let mut dispatches = Vec::with_capacity(chunks.len());
        for (p, xs, ys, grid) in &chunks {
            let uniform = ctx.uniform("head_matmul params", p)?;
            dispatches.push(ctx.prepare_dispatch(
                "head_matmul",
                &pipeline,
                &[
                    uniform.as_entire_binding(),
                    range(x, xs.byte_offset, xs.bytes),
                    range(w, 0, w_range),
                    range(y, ys.byte_offset, ys.bytes),
                ],
                *grid,
            )?);
            params.push(uniform);
        }
        Ok(PreparedMatmul {
            dispatches,
            _params: params,
            flops: spec.flops(),
        })
    }
}

/// Records the product into `pass` (see [`HeadMatmul::prepare`], whose checks and errors it
/// shares): every bind group is created before the first dispatch is recorded; nothing is
/// submitted.
pub fn encode_head_matmul(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    spec: &HeadMatmul,
    x: &wgpu::Buffer,
    w: &wgpu::Buffer,
    y: &wgpu::Buffer,
) -> Result<()> {
    spec.prepare(ctx, x, w, y)?.encode(pass);
    Ok(())
}

/// Runs the product on the GPU in one submission: [`encode_head_matmul`] into a compute pass of
/// its own, submitted.
///
/// # Errors
/// Those of [`HeadMatmul::prepare`], before anything is submitted.
pub fn head_matmul(
    ctx: &Context,
    spec: &HeadMatmul,
    x: &wgpu::Buffer,
    w: &wgpu::Buffer,
    y: &wgpu::Buffer,
) -> Result<()> {
    let prepared = spec.prepare(ctx, x, w, y)?;
    ctx.run_pass("head_matmul", |pass| {
        prepared.encode(pass);
        Ok(())
    })?;
    Ok(())
}
