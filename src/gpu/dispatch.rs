//! The host side of dispatching kernels, shared by every kernel family: argument checks,
//! binding large operands in slices of rows from aligned offsets, element grids, and recording
//! a list of dispatches into a compute pass (or submitting them as one pass).

use std::num::NonZeroU64;
use std::sync::Arc;

use super::Context;
use crate::{Error, Result};

#[cfg(feature = "decoder")]
/// Invocations per workgroup of the one-invocation-per-element kernels (their WGSL
/// `@workgroup_size`).
pub(crate) const WG: u64 = 64;

/// The device's storage-buffer offset alignment in bytes (at least 4).
pub(crate) fn offset_alignment(ctx: &Context) -> u64 {
    u64::from(ctx.device.limits().min_storage_buffer_offset_alignment).max(4)
}

/// Element strides of a `[rows, heads, dim]` operand: element `(t, h, i)` is at
/// `offset + t * row + h * head + i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowStrides {
    /// Index of element `(0, 0, 0)`.
    pub offset: usize,
    /// Elements between consecutive rows (tokens).
    pub row: usize,
    /// Elements between consecutive heads (0: every head reads the same values).
    pub head: usize,
}

impl RowStrides {
    /// Dense `[rows, heads, dim]` at `offset`: `row = heads * dim`, `head = dim`.
    pub fn dense(offset: usize, heads: usize, dim: usize) -> Self {
        Self {
            offset,
            row: heads * dim,
            head: dim,
        }
    }

    /// Index of the last element touched by `rows x heads x dim` elements (all positive), or
    /// an error when it overflows.
    pub(crate) fn last_index(
        &self,
        what: &str,
        rows: usize,
        heads: usize,
        dim: usize,
    ) -> Result<usize> {
        (rows - 1)
            .checked_mul(self.row)
            .and_then(|a| {
                (heads - 1)
                    .checked_mul(self.head)
                    .and_then(|b| a.checked_add(b))
            })
            .and_then(|a| a.checked_add(self.offset))
            .and_then(|a| a.checked_add(dim - 1))
            .ok_or_else(|| Error::InvalidArgument(format!("{what}: element indices overflow")))
    }

    /// Checks that every stride and the offset fit a u32 (the kernels index in u32).
    pub(crate) fn check_u32(&self, what: &str) -> Result<()> {
        for (name, v) in [
            ("offset", self.offset),
            ("row stride", self.row),
            ("head stride", self.head),
        ] {
            fit_u32(&format!("{what} {name}"), v)?;
        }
        Ok(())
    }

    /// Checks that no two of the `rows x heads x dim` elements share an index (an output
    /// written twice would race): sorted by stride, each stride must step over the whole span of
    /// the smaller ones.
    pub(crate) fn check_distinct(
        &self,
        what: &str,
        rows: usize,
        heads: usize,
        dim: usize,
    ) -> Result<()> {
        let mut dims: Vec<(usize, usize)> = [(1, dim), (self.head, heads), (self.row, rows)]
            .into_iter()
            .filter(|&(_, extent)| extent > 1)
            .collect();
        dims.sort_unstable();
        let mut span = 1usize;
        for (stride, extent) in dims {
            if stride < span {
                return Err(Error::InvalidArgument(format!(
                    "{what}: strides (row {}, head {}) make written elements overlap \
                     ({rows} rows, {heads} heads, {dim} values)",
                    self.row, self.head
                )));
            }
            span = stride.saturating_mul(extent);
        }
        Ok(())
    }
}

pub(crate) fn fit_u32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} {v} does not fit a u32")))
}

pub(crate) fn check_positive(what: &str, dims: &[(&str, usize)]) -> Result<()> {
    for &(name, v) in dims {
        if v == 0 {
            return Err(Error::InvalidArgument(format!(
                "{what}: {name} must be positive"
            )));
        }
        fit_u32(&format!("{what} {name}"), v)?;
    }
    Ok(())
}

/// Checks that a host slice holds at least `elems` values.
pub(crate) fn check_slice(what: &'static str, len: usize, elems: usize) -> Result<()> {
    if len < elems {
        return Err(Error::ShapeMismatch {
            what,
            expected: elems,
            got: len,
        });
    }
    Ok(())
}

/// A `[rows, heads, dim]` operand bound in slices of rows: the byte range one chunk of rows
/// touches, bound from an offset aligned to `min_storage_buffer_offset_alignment`.
pub(crate) struct ChunkedOperand {
    pub what: &'static str,
    pub strides: RowStrides,
    pub heads: usize,
    pub dim: usize,
}

/// Where one chunk's slice of an operand is bound and its offset inside that binding.
pub(crate) struct Slice {
    /// Byte offset of the binding in the buffer.
    pub byte_offset: u64,
    /// Bytes bound.
    pub bytes: NonZeroU64,
    /// Element index of `(first row of the chunk, 0, 0)` inside the binding.
    pub offset: u32,
}

/// Largest storage binding a chunk may use: the adapter's (possibly capped) binding limit, at
/// most 2 GiB so that every element index inside it fits comfortably in a u32.
pub(crate) fn binding_limit(ctx: &Context) -> u64 {
    ctx.caps().max_storage_buffer_binding_size.min(1 << 31)
}

impl ChunkedOperand {
    /// Elements one row spans (all heads).
    fn row_span(&self) -> u64 {
        (self.heads as u64 - 1) * self.strides.head as u64 + self.dim as u64
    }

    /// Most rows one binding can hold (at least 1), or [`Error::TooLarge`] when not even one
    /// row fits.
    pub fn max_rows(&self, ctx: &Context) -> Result<usize> {
        let limit = binding_limit(ctx) / 4;
        let slack = offset_alignment(ctx) / 4;
        let span = self.row_span();
        if span + slack > limit {
            return Err(Error::TooLarge {
                what: format!("one row of {} ({span} values)", self.what),
                bytes: (span + slack) * 4,
                limit: limit * 4,
            });
        }
        if self.strides.row == 0 {
            return Ok(usize::MAX);
        }
        let rows = (limit - slack - span) / self.strides.row as u64 + 1;
        Ok(usize::try_from(rows).unwrap_or(usize::MAX))
    }

    /// The binding of rows `t0 .. t0 + rows`.
    pub fn slice(&self, ctx: &Context, t0: usize, rows: usize) -> Result<Slice> {
        let lo = (self.strides.offset + t0 * self.strides.row) as u64;
        let hi = lo + (rows as u64 - 1) * self.strides.row as u64 + self.row_span();
        let align = offset_alignment(ctx);
        let byte_offset = lo * 4 / align * align;
        let bytes = hi * 4 - byte_offset;
        Ok(Slice {
            byte_offset,
            bytes: NonZeroU64::new(bytes)
                .ok_or_else(|| Error::InvalidArgument(format!("{}: empty binding", self.what)))?,
            offset: fit_u32(self.what, (lo - byte_offset / 4) as usize)?,
        })
    }
}

/// A binding of `bytes` bytes of `buffer` from `offset`.
pub(crate) fn range(
    buffer: &wgpu::Buffer,
    offset: u64,
    bytes: NonZeroU64,
) -> wgpu::BindingResource<'_> {
    wgpu::BindingResource::Buffer(wgpu::BufferBinding {
        buffer,
        offset,
        size: Some(bytes),
    })
}

#[cfg(feature = "decoder")]
/// The part of a buffer one dispatch binds: from `offset` (aligned) for `size` bytes; the
/// dispatch's first element is `base` elements into the binding.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bound {
    offset: u64,
    size: NonZeroU64,
    /// Index of the first element of interest inside the binding.
    pub base: u32,
}

#[cfg(feature = "decoder")]
impl Bound {
    /// The binding resource for `buffer`.
    pub fn resource(self, buffer: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
        range(buffer, self.offset, self.size)
    }
}

#[cfg(feature = "decoder")]
/// Most 32-bit elements one dispatch may bind from an arbitrary first element: a binding,
/// less the slack of aligning its offset down.
pub(crate) fn max_bound_elems(ctx: &Context) -> u64 {
    (binding_limit(ctx) - offset_alignment(ctx)) / 4
}

#[cfg(feature = "decoder")]
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

#[cfg(feature = "decoder")]
/// A 2-D grid of `WG`-invocation workgroups covering `invocations` (at most 2^29, so that the
/// grid fits any adapter's 65,535 per dimension): the grid and the invocations along x.
pub(crate) fn element_grid(ctx: &Context, invocations: u64) -> ([u32; 3], u32) {
    let max_groups = u64::from(ctx.caps().max_compute_workgroups_per_dimension).max(1);
    let groups = invocations.div_ceil(WG).max(1);
    let gx = groups.min(max_groups);
    let gy = groups.div_ceil(gx);
    ([gx as u32, gy as u32, 1], (gx * WG) as u32)
}

#[cfg(feature = "decoder")]
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

/// Prepares one dispatch per `(resources, grid)` of `pipeline` and records them into `pass`
/// in order. Every bind group is created (and checked) before anything is recorded.
pub(crate) fn encode_dispatches(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    label: &str,
    pipeline: &Arc<wgpu::ComputePipeline>,
    dispatches: Vec<(Vec<wgpu::BindingResource<'_>>, [u32; 3])>,
) -> Result<()> {
    let prepared = dispatches
        .into_iter()
        .map(|(resources, grid)| ctx.prepare_dispatch(label, pipeline, &resources, grid))
        .collect::<Result<Vec<_>>>()?;
    for dispatch in &prepared {
        dispatch.encode(pass);
    }
    Ok(())
}

/// What every storage binding a caller hands in must satisfy: `STORAGE` usage, an offset that
/// is a multiple of the device's storage-offset alignment, and a range inside the buffer.
/// Returns the bound size in bytes: the binding's size, or (without one) the rest of the buffer
/// from the offset. [`Error::InvalidArgument`] names `what` otherwise.
pub(crate) fn check_binding_place(
    ctx: &Context,
    what: &str,
    binding: &wgpu::BufferBinding<'_>,
) -> Result<u64> {
    let buffer = binding.buffer;
    if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
        return Err(Error::InvalidArgument(format!(
            "{what} was not created with STORAGE usage"
        )));
    }
    let align = offset_alignment(ctx);
    if binding.offset % align != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: offset {} is not a multiple of the device's storage offset alignment \
             ({align} bytes)",
            binding.offset
        )));
    }
    let total = buffer.size();
    let rest = total.checked_sub(binding.offset).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{what}: offset {} is past the end of a {total}-byte buffer",
            binding.offset
        ))
    })?;
    let size = binding.size.map_or(rest, NonZeroU64::get);
    if size > rest {
        return Err(Error::InvalidArgument(format!(
            "{what}: {size} bytes at {} pass the end of a {total}-byte buffer",
            binding.offset
        )));
    }
    Ok(size)
}
