//! Dense matrix products on the GPU: the decoder's `y = W x` ([`Linear`]) and the strided
//! per-head product it is built on ([`head_matmul`](mod@head_matmul), which MLA also uses).
//!
//! Each product comes in three forms: prepared once ([`Linear::prepare`],
//! [`HeadMatmul::prepare`]: a [`PreparedMatmul`] holding its bind groups, recorded every step
//! without creating anything), recorded into a caller's compute pass ([`Linear::encode`],
//! [`encode_head_matmul`]), or run in a submission of its own ([`Linear::run`],
//! [`head_matmul::head_matmul()`]). All three give the same bits: one kernel, one tile choice
//! per shape.

pub mod head_matmul;

// Not the function `head_matmul` itself: `matmul::head_matmul` (and its old path
// `mla::head_matmul`) names the module alone.
pub use head_matmul::{encode_head_matmul, HeadMatmul, PreparedMatmul, RowStrides};

use crate::gpu::Context;
use crate::Result;

/// `y[y_row + t, :] = W x[x_row + t, :]` for `t < rows`: `x` holds rows of `k` f32 values
/// (row `x_row` is the first one read), `W` is `[n, k]` row-major (each output is the dot
/// product of a row of `W` with a row of `x`), and `y` holds rows of `n` values (row `y_row`
/// is the first one written; no other element of `y` changes). Each output is one f32
/// accumulator summed over `k` in order with `fma`, whatever `rows` is (batch invariance).
#[derive(Debug, Clone, Copy)]
pub struct Linear<'a> {
    /// The input, `[.., k]` f32 rows.
    pub x: &'a wgpu::Buffer,
    /// First row of `x` read.
    pub x_row: usize,
    /// Rows (tokens) to multiply.
    pub rows: usize,
    /// Input width (length of the reduction).
    pub k: usize,
    /// The weight, `[n, k]` row-major f32.
    pub w: &'a wgpu::Buffer,
    /// Output width.
    pub n: usize,
    /// The output, `[.., n]` f32 rows; must be a buffer other than `x` and `w`.
    pub y: &'a wgpu::Buffer,
    /// First row of `y` written.
    pub y_row: usize,
}

impl Linear<'_> {
    /// The product as a one-head [`HeadMatmul`] (the same kernel and tiles).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when a row offset overflows.
    pub fn spec(&self) -> Result<HeadMatmul> {
        let offset =
            |what: &str, row: usize, width: usize| crate::gpu::dispatch::mul(what, row, width);
        Ok(HeadMatmul {
            rows: self.rows,
            heads: 1,
            inner: self.k,
            n_out: self.n,
            x: RowStrides {
                offset: offset("linear x_row", self.x_row, self.k)?,
                row: self.k,
                head: 0,
            },
            w_head: 0,
            w_k: 1,
            w_n: self.k,
            y: RowStrides {
                offset: offset("linear y_row", self.y_row, self.n)?,
                row: self.n,
                head: 0,
            },
        })
    }

    /// Floating-point operations: `2 * rows * k * n`.
    pub fn flops(&self) -> u64 {
        2 * self.rows as u64 * self.k as u64 * self.n as u64
    }

    /// Checks the product against its buffers and prepares its dispatches, to be recorded
    /// every step with [`PreparedMatmul::encode`] (which creates nothing).
    ///
    /// # Errors
    /// Those of [`HeadMatmul::prepare`]: a zero dimension, a buffer too small for the rows it
    /// is given ([`Error::ShapeMismatch`](crate::Error::ShapeMismatch)), a buffer without
    /// `STORAGE` usage, `y` also `x` or `w`, a weight past one storage binding; all before
    /// anything is created.
    pub fn prepare(&self, ctx: &Context) -> Result<PreparedMatmul> {
        self.spec()?.prepare(ctx, self.x, self.w, self.y)
    }

    /// Records the product into `pass` (every bind group created first; nothing submitted) and
    /// returns its FLOPs.
    ///
    /// # Errors
    /// Those of [`prepare`](Self::prepare), before anything is recorded.
    pub fn encode(&self, ctx: &Context, pass: &mut wgpu::ComputePass<'_>) -> Result<u64> {
        let prepared = self.prepare(ctx)?;
        prepared.encode(pass);
        Ok(prepared.flops())
    }

    /// Runs the product in one submission of its own and returns its FLOPs.
    ///
    /// # Errors
    /// Those of [`prepare`](Self::prepare), before anything is submitted.
    pub fn run(&self, ctx: &Context) -> Result<u64> {
        let prepared = self.prepare(ctx)?;
        ctx.run_pass("linear", |pass| {
            prepared.encode(pass);
            Ok(())
        })?;
        Ok(prepared.flops())
    }
}
