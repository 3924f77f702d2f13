//! The matrix product over weights kept in their GGUF block format (`shaders/qmatmul.wgsl`):
//! `y[y_row + t, o] = sum_i W[o, i] x[x_row + t, i]` for `t < rows`, `W` being `n` rows of `k`
//! values of one of the types [`crate::decoder::blocks`] reads (F32, F16, BF16, Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). Its CPU reference is [`crate::reference::qmatmul`].
//!
//! **Weights on the GPU** ([`QWeight`]) are the file's bytes: blocks whose size is not a whole
//! number of words (Q4_0 18 bytes, Q5_0 22, Q8_0 34, Q6_K 210) get two bytes of padding, after
//! the leading f16 scale (so that the codes start on a word) or, for Q6_K, at the end. At most
//! 11% more than the file (Q4_0). A weight larger than one storage binding is split by rows
//! into several buffers, each dispatched on its own.
//!
//! **Three kernels, one order of sums.** Every output is 16 partial sums (partial `l` over the
//! chunks of 32 values `l, l + 16, ...`, each chunk's values in order with fma) added by a
//! fixed tree, the order of the CPU reference; the kernels differ only in who computes which
//! partial ([`QMatmulMapping`]):
//! - the lane kernel (`qmatmul.wgsl`): a workgroup computes 16 rows of `W` for up to 8 rows
//!   of `x`, 16 lanes splitting a row of `W` (adjacent lanes read adjacent chunks), each
//!   decoded chunk applied to every row of `x`; the partials meet in workgroup memory. For
//!   decode on GPUs and for any product the others do not take.
//! - the row kernel ([`qmatmul_rows`](super::qmatmul_rows)): an invocation owns 4 rows of `W`
//!   (in each of up to 12 windows of `W` a dispatch binds, [`max_windows`]) and computes their
//!   partials itself, each decoded chunk applied to up to 4 rows of `x`, `x` and `W` read
//!   through uniform windows. For CPU adapters, whose storage loads and barriers are costly;
//!   `x` must come from [`input_buffer`] (the decoder's activations do) and `W` be a weight of
//!   64 KiB or more ([`QWeight::has_windows`]). Up to three weights of one type can share its
//!   dispatches for one row of `x` ([`qmatmul_group`](super::qmatmul_group)).
//! - the tiled kernel ([`qmatmul_tiled`](super::qmatmul_tiled)): tiles of 16 rows of `x` by 16
//!   rows of `W` staged in workgroup memory. For products of [`TILED_MIN_ROWS`] rows or more
//!   (prefill chunks) on GPUs.
//!
//! A row's result is bit-identical whatever the kernel, the batch or the number of rows per
//! workgroup (tested), and every value of `W` is decoded exactly as the CPU does (each is an
//! exact product in f32, so fused or not it is the same).
//!
//! **Adding into y.** With [`QMatmulArgs::accumulate`] every kernel adds each output into `y`
//! (`y + sum`, one f32 addition) instead of writing it: the decoder's residual adds after the
//! O and down products, the bits of the product followed by [`add_in_place`](super::add::add_in_place)
//! and one dispatch fewer each (tested).
//!
//! **NaN and infinities** propagate as IEEE arithmetic has them, as in the CPU reference: a NaN
//! or infinite value of `x`, or a block whose f16 scale is NaN or infinite, makes the outputs
//! that read it NaN or infinite (the decoder's sampler then refuses NaN and +inf logits, naming
//! the token). Nothing is clamped or skipped.

use crate::decoder::gguf::GgmlType;
use crate::decoder::ops::qmatmul_rows::{window_resource, Window, ROW_WG, X_WINDOW_BYTES};
use crate::decoder::ops::qmatmul_tiled::{TILE_W_ROWS, TILE_X_ROWS};
use crate::decoder::ops::{check_distinct, PreparedOp};
use crate::gpu::dispatch::{bind, binding_limit, check_positive, max_bound_elems, mul, Bound};
use crate::gpu::{check_storage, Context};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

pub use crate::decoder::ops::qmatmul_rows::input_buffer;
pub use crate::decoder::ops::qmatmul_tiled::TILED_MIN_ROWS;
pub use crate::reference::qmatmul::{CHUNK, LANES};

/// Lane groups per workgroup (the kernel's `GROUPS`).
const GROUPS: usize = 4;
/// Rows of `W` per lane group (the kernel's `WROWS`, one per component of a vec4).
const W_ROWS: usize = 4;
/// Rows of `W` per workgroup (lane mapping).
pub const ROWS_OF_W: usize = GROUPS * W_ROWS;
/// Most rows of `x` per workgroup (the kernel's largest `ROWS`).
pub const MAX_X_ROWS: usize = 8;

crate::wgsl_struct! {
    /// Mirror of the WGSL `QMatmulParams` uniform (one per dispatch).
    pub struct QMatmulParams {
        /// Rows of x (and y) in this dispatch.
        pub rows: u32,
        /// Values per row of W and x.
        pub k: u32,
        /// Rows of W bound in this dispatch.
        pub n: u32,
        /// Column of y written by row 0 of the bound W.
        pub n_base: u32,
        /// Values per row of y.
        pub y_stride: u32,
        /// Index of the dispatch's first x value inside the x binding.
        pub x_base: u32,
        /// Index of the dispatch's first y row inside the y binding.
        pub y_base: u32,
        /// 1: add the product into y (`y += W x`, [`QMatmulArgs::accumulate`]); 0: write it.
        pub accumulate: u32,
        /// Row kernel: the first weight word inside the binding of window `j` (element `j`;
        /// zeros for the other kernels).
        pub win_w_base: [u32; 12],
        /// Row kernel: the rows of `W` window `j` holds.
        pub win_n: [u32; 12],
        /// Row kernel: the column of y row 0 of window `j` writes.
        pub win_n_base: [u32; 12],
        /// Row kernel: the output window `j` writes (0: `y`, 1 and 2: a grouped product's
        /// second and third, [`super::qmatmul_group`]).
        pub win_dst: [u32; 12],
    }
}

/// How a type's rows are stored on the GPU: words per row of `k` values.
fn row_words(ty: GgmlType, k: usize) -> Option<usize> {
    Some(match ty {
        GgmlType::F32 => k,
        GgmlType::F16 | GgmlType::BF16 => k / 2,
        _ => k / ty.block_size() as usize * block_words(ty)?,
    })
}

/// Words of one block on the GPU (with its padding); `None` for a type the kernel does not read.
fn block_words(ty: GgmlType) -> Option<usize> {
    Some(match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => 5,
        GgmlType::Q5_0 | GgmlType::Q5_1 => 6,
        GgmlType::Q8_0 => 9,
        GgmlType::Q4_K => 36,
        GgmlType::Q5_K => 44,
        GgmlType::Q6_K => 53,
        _ => return None,
    })
}

/// The GPU words of whole rows of `ty` stored as the file stores them (`bytes`, a whole
/// number of rows of `k` values): blocks padded as the module docs say.
///
/// # Errors
/// [`Error::InvalidArgument`] when the kernel does not read `ty`, `k` is not a positive
/// multiple of 32, or `bytes` is not a whole number of rows.
pub fn pack_rows(ty: GgmlType, k: usize, bytes: &[u8]) -> Result<Vec<u32>> {
    let words = check_type(ty, k)?;
    let row_bytes = ty.bytes_for(k as u64)? as usize;
    if bytes.len() % row_bytes != 0 {
        return Err(Error::InvalidArgument(format!(
            "qmatmul weight: {} bytes are not whole rows of {k} {ty} values ({row_bytes} bytes \
             each)",
            bytes.len()
        )));
    }
    let mut out = Vec::with_capacity(bytes.len() / row_bytes * words);
    let push = |out: &mut Vec<u32>, b: &[u8]| {
        out.extend(
            b.chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
        )
    };
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
            // The f16 scale, two bytes of padding, the rest of the block.
            for block in bytes.chunks_exact(ty.block_bytes() as usize) {
                out.push(u32::from(u16::from_le_bytes([block[0], block[1]])));
                push(&mut out, &block[2..]);
            }
        }
        GgmlType::Q6_K => {
            for block in bytes.chunks_exact(210) {
                push(&mut out, &block[..208]);
                out.push(u32::from(u16::from_le_bytes([block[208], block[209]])));
            }
        }
        _ => push(&mut out, bytes),
    }
    Ok(out)
}

/// Words per row, or the error naming why the kernel cannot take `ty` rows of `k` values.
fn check_type(ty: GgmlType, k: usize) -> Result<usize> {
    if k == 0 || k % CHUNK != 0 {
        return Err(Error::InvalidArgument(format!(
            "qmatmul: rows of {k} values; the kernel needs a positive multiple of {CHUNK}"
        )));
    }
    let bs = ty.block_size() as usize;
    row_words(ty, k).filter(|_| k % bs == 0).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "qmatmul: weights of ggml type {ty} (id {}) with rows of {k} values are not \
             supported (types: {}; rows a multiple of the block size)",
            ty.id(),
            crate::decoder::blocks::SUPPORTED
                .map(GgmlType::name)
                .join(", ")
        ))
    })
}

/// A weight resident on the GPU in its block format: `n` rows of `k` values of type `ty`, in
/// one buffer per part of whole rows (several when it exceeds one storage binding).
#[derive(Debug)]
pub struct QWeight {
    ty: GgmlType,
    n: usize,
    k: usize,
    /// (buffer, first row, rows).
    parts: Vec<(wgpu::Buffer, usize, usize)>,
    bytes: u64,
}

impl QWeight {
    /// Uploads `n` rows of `k` values of type `ty` from their file bytes (`data`, exactly the
    /// rows' bytes), split into parts of whole rows that each fit a storage binding and the
    /// workgroup grid.
    ///
    /// # Errors
    /// Those of [`pack_rows`]; [`Error::ShapeMismatch`] when `data` is not `n` rows (in bytes);
    /// [`Error::TooLarge`] when one row exceeds a storage binding; [`Error::Wgpu`] from wgpu.
    pub fn upload(
        ctx: &Context,
        label: &str,
        ty: GgmlType,
        (n, k): (usize, usize),
        data: &[u8],
    ) -> Result<Self> {
        check_positive("qmatmul weight", &[("n", n), ("k", k)])?;
        let words = check_type(ty, k)?;
        let row_bytes = ty.bytes_for(k as u64)? as usize;
        let want = mul("qmatmul weight bytes", n, row_bytes)?;
        if data.len() != want {
            return Err(Error::ShapeMismatch {
                what: "qmatmul weight bytes (n rows of k values)",
                expected: want,
                got: data.len(),
            });
        }
        let limit = binding_limit(ctx);
        // On CPU adapters the row kernel reads a weight of a window or more through uniform
        // windows (weight_windows): each part gets one offset alignment of room after its rows
        // and is at least one window long (only a last part can be shorter).
        let windows = ctx.caps().cpu_adapter && (n * words * 4) as u64 >= X_WINDOW_BYTES;
        let room = if windows {
            u64::from(ctx.device.limits().min_uniform_buffer_offset_alignment)
        } else {
            0
        };
        let per_part = (limit.saturating_sub(room) / (words as u64 * 4)) as usize;
        if per_part == 0 {
            return Err(Error::TooLarge {
                what: format!("one row of qmatmul weight {label}"),
                bytes: words as u64 * 4,
                limit,
            });
        }
        let max_groups = ctx.caps().max_compute_workgroups_per_dimension as usize;
        let per_part = per_part.min(max_groups * ROWS_OF_W);
        let mut parts = Vec::new();
        let mut bytes = 0;
        let mut r0 = 0;
        while r0 < n {
            let rows = per_part.min(n - r0);
            let packed = pack_rows(ty, k, &data[r0 * row_bytes..(r0 + rows) * row_bytes])?;
            let buffer = if windows {
                let data: &[u8] = bytemuck::cast_slice(&packed);
                ctx.buffer_with(
                    label,
                    data,
                    (data.len() as u64 + room).max(X_WINDOW_BYTES),
                    crate::gpu::STORAGE | wgpu::BufferUsages::UNIFORM,
                )?
            } else {
                ctx.upload(label, &packed)?
            };
            bytes += buffer.size();
            parts.push((buffer, r0, rows));
            r0 += rows;
        }
        Ok(Self {
            ty,
            n,
            k,
            parts,
            bytes,
        })
    }

    /// The ggml type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ty
    }

    /// Rows (outputs) and values per row (inputs).
    pub fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes the weight takes on the GPU (its buffers, with their padding: on CPU adapters
    /// each part is at least 64 KiB and has 256 bytes or so of room after its rows).
    pub fn gpu_bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the row kernel ([`QMatmulMapping::Rows`]) can read it: uploaded on a CPU
    /// adapter, at least 64 KiB, rows of at most 64 KiB.
    pub fn has_windows(&self, ctx: &Context) -> bool {
        weight_windows(ctx, self).is_some()
    }

    /// Buffers it is split into.
    pub fn num_parts(&self) -> usize {
        self.parts.len()
    }

    /// The buffer of part `i`.
    pub(super) fn part_buffer(&self, i: usize) -> &wgpu::Buffer {
        &self.parts[i].0
    }

    /// The parts: (buffer, first row, rows).
    pub(crate) fn parts(&self) -> impl Iterator<Item = (&wgpu::Buffer, usize, usize)> {
        self.parts.iter().map(|(b, r0, n)| (b, *r0, *n))
    }
}

/// One product: `y[y_row + t, :] = W x[x_row + t, :]` for `t < rows`.
#[derive(Debug, Clone, Copy)]
pub struct QMatmulArgs<'a> {
    /// The input, `[.., k]` f32 rows.
    pub x: &'a wgpu::Buffer,
    /// First row of `x` read.
    pub x_row: usize,
    /// Rows to multiply.
    pub rows: usize,
    /// The weight.
    pub w: &'a QWeight,
    /// The output, `[.., n]` f32 rows (a buffer other than `x`); only the product's rows
    /// change.
    pub y: &'a wgpu::Buffer,
    /// First row of `y` written.
    pub y_row: usize,
    /// Add the product into `y` (`y[y_row + t] += W x[x_row + t]`, one f32 addition per
    /// output, `y`'s value first: the residual add fused into the product, with the bits of
    /// the product followed by [`add_in_place`](super::add::add_in_place)) instead of writing
    /// it.
    pub accumulate: bool,
}

/// Rows of x per workgroup of the lane kernel for a product of `rows` rows (bits do not depend
/// on it).
fn x_rows_per_group(rows: usize) -> usize {
    match rows {
        1 => 1,
        2 => 2,
        3..=4 => 4,
        _ => MAX_X_ROWS,
    }
}

/// The override constants of lib/ggml_blocks.wgsl for weights of type `ty`.
pub(crate) fn format_constants(ty: GgmlType) -> Vec<(&'static str, f64)> {
    let (words, chunks) = match block_words(ty) {
        Some(w) => (w, ty.block_size() as usize / CHUNK),
        None => (1, 1),
    };
    vec![
        ("FORMAT", f64::from(ty.id())),
        ("BLOCK_WORDS", words as f64),
        ("BLOCK_CHUNKS", chunks as f64),
    ]
}

/// The lane kernel's constants: the format's and the rows of x per workgroup.
fn lane_constants(ty: GgmlType, x_rows: usize) -> Vec<(&'static str, f64)> {
    let mut c = format_constants(ty);
    c.push(("ROWS", x_rows as f64));
    c
}

/// Override constants of the lane kernel for the naga tests: every type, one and eight rows
/// of x.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    crate::decoder::blocks::SUPPORTED
        .iter()
        .flat_map(|&ty| [lane_constants(ty, 1), lane_constants(ty, MAX_X_ROWS)])
        .collect()
}

/// The row kernel's constants: the format's, the rows of x per decoded weight (1, 2 or 4) and
/// the windows of `W` per dispatch (1 to [`MAX_WINDOWS`]; more than 1 only for one row of x).
pub(super) fn row_constants(ty: GgmlType, rows: usize, windows: usize) -> Vec<(&'static str, f64)> {
    let mut c = format_constants(ty);
    c.push(("ROWS_T", rows.clamp(1, 4).next_power_of_two().min(4) as f64));
    c.push(("WINDOWS", windows as f64));
    c
}

/// Windows of `W` the row kernel's variant for a dispatch of `windows` binds: the whole quads
/// of 4 that hold them (4, 8 or 12; each count its own source,
/// [`crate::shader::window_source`]).
pub(super) fn bound_windows(windows: usize) -> u8 {
    (4 * windows.clamp(1, MAX_WINDOWS).div_ceil(4)) as u8
}

/// The shader of `kernel` for weights of type `ty` (written out for the type,
/// [`ShaderVariant::ggml_format`]), its f16 scales decoded as [`format_variant`] says, and, for
/// the row kernel, a dispatch of `windows` windows.
pub(super) fn row_variant(
    kernel: Kernel,
    ty: GgmlType,
    windows: usize,
    f16_convert: bool,
) -> ShaderVariant {
    let base = format_variant(kernel, ty, f16_convert);
    if kernel == Kernel::QMatmulRows {
        ShaderVariant {
            weight_windows: bound_windows(windows),
            ..base
        }
    } else {
        base
    }
}

/// The shader of a block-format kernel (the product's three, or [`Kernel::QEmbed`]) written
/// out for weights of type `ty`, decoding f16 (the blocks' scales, F16 weights) with
/// `unpack2x16float` where `f16_convert` (the context's
/// [`Capabilities::f16_unpack_exact`](crate::gpu::Capabilities::f16_unpack_exact): checked
/// exact on every pattern) and with the exact integer decoder otherwise. Both give the CPU's
/// values, so the bits do not depend on it.
pub(crate) fn format_variant(kernel: Kernel, ty: GgmlType, f16_convert: bool) -> ShaderVariant {
    ShaderVariant {
        ggml_format: Some(ty.id() as u8),
        f16_convert,
        ..ShaderVariant::new(kernel, Precision::F32)
    }
}

/// Every shader the host composes for a block-format kernel, for the naga tests: one per
/// supported type and way of decoding f16, and for the row kernel each of those with 4, 8 and
/// 12 bound windows.
pub fn format_variants(kernel: Kernel) -> Vec<ShaderVariant> {
    let windows: &[usize] = if kernel == Kernel::QMatmulRows {
        &[4, 8, 12]
    } else {
        &[1]
    };
    let mut variants = Vec::new();
    for ty in crate::decoder::blocks::SUPPORTED {
        for &w in windows {
            for f16_convert in [false, true] {
                variants.push(row_variant(kernel, ty, w, f16_convert));
            }
        }
    }
    variants
}

/// Most windows of `W` one dispatch of the row kernel binds (its `WINDOWS`; bindings `w`,
/// `w1` .. `w11` of its 12-window variant): with its uniform and `x`'s window, 14 uniform
/// bindings, where the device allows that many ([`max_windows`]). A CPU adapter pays tens of
/// microseconds a dispatch (lavapipe wakes its threads and waits for them; about 50 us on a
/// 2-core machine), so the fewer dispatches the better.
pub const MAX_WINDOWS: usize = 12;

/// Most windows of `W` one dispatch binds on the context's device: whole quads of 4 within its
/// uniform bindings a stage, less the kernel's uniform and `x`'s window (8 with WebGPU's
/// default of 12; 12 on lavapipe and llvmpipe, which allow 15), at most [`MAX_WINDOWS`].
pub fn max_windows(ctx: &Context) -> usize {
    let uniforms = ctx.caps().max_uniform_buffers_per_shader_stage as usize;
    (uniforms.saturating_sub(2) / 4 * 4).clamp(4, MAX_WINDOWS)
}

/// Override constants of the row kernel for the naga tests: every type, one row of x with 1
/// to [`MAX_WINDOWS`] windows per dispatch, and four rows of x per decoded weight.
pub fn row_representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    crate::decoder::blocks::SUPPORTED
        .iter()
        .flat_map(|&ty| {
            (1..=MAX_WINDOWS)
                .map(move |windows| row_constants(ty, 1, windows))
                .chain([row_constants(ty, 4, 1)])
        })
        .collect()
}

/// `windows` windows of `W` shared by as few dispatches of at most `most` as hold them, as
/// evenly as they go (5 as 3 and 2): the windows of each dispatch, in order.
pub(super) fn window_batches(windows: usize, most: usize) -> Vec<std::ops::Range<usize>> {
    let batches = windows.div_ceil(most.max(1));
    let mut out = Vec::with_capacity(batches);
    let mut start = 0;
    for b in 0..batches {
        let len = windows / batches + usize::from(b < windows % batches);
        out.push(start..start + len);
        start += len;
    }
    out
}

/// Override constants of the tiled kernel for the naga tests: every type's format.
pub fn format_representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    crate::decoder::blocks::SUPPORTED
        .iter()
        .map(|&ty| format_constants(ty))
        .collect()
}

/// Which kernel computes a product; all give every output the same bits (the same partials in
/// the same order, then the same tree; a NaN output is NaN in all, with the sign IEEE
/// arithmetic leaves to the operand order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QMatmulMapping {
    /// `qmatmul.wgsl`: 16 lanes split a row of `W`, each decoded chunk applied to up to 8 rows
    /// of `x`, the partials added through workgroup memory (GPUs; any number of rows).
    Lanes,
    /// `qmatmul_rows.wgsl`: an invocation owns whole rows of `W` and computes their 16
    /// partials one after the other, each decoded chunk applied to up to 4 rows of `x`, `x`
    /// and `W` read through uniform windows (CPU adapters, where storage loads are costly and
    /// barriers expensive). Needs an `x` made by [`input_buffer`] and a `W` with
    /// [`QWeight::has_windows`].
    Rows,
    /// `qmatmul_tiled.wgsl`: tiles of 16 rows of `x` by 16 rows of `W` through workgroup
    /// memory (products of many rows on GPUs).
    Tiled,
}

impl QMatmulMapping {
    /// The kernel [`prepare_qmatmul`] picks for `args` on the context's adapter: on a CPU
    /// adapter [`Rows`](Self::Rows) when it can read `x` and `W` (else
    /// [`Lanes`](Self::Lanes)); on a GPU [`Tiled`](Self::Tiled) from [`TILED_MIN_ROWS`] rows,
    /// else [`Lanes`](Self::Lanes).
    pub fn for_product(ctx: &Context, args: &QMatmulArgs<'_>) -> Self {
        let (_, k) = args.w.shape();
        if ctx.caps().cpu_adapter {
            let first = args.x_row.saturating_mul(k);
            if Window::of(ctx, args.x, first, k).is_some() && weight_windows(ctx, args.w).is_some()
            {
                return Self::Rows;
            }
            Self::Lanes
        } else if args.rows >= TILED_MIN_ROWS {
            Self::Tiled
        } else {
            Self::Lanes
        }
    }

    /// The kernel.
    fn kernel(self) -> Kernel {
        match self {
            Self::Lanes => Kernel::QMatmul,
            Self::Rows => Kernel::QMatmulRows,
            Self::Tiled => Kernel::QMatmulTiled,
        }
    }
}

/// Checks `args` and prepares the product: one dispatch per part of the weight and per slice
/// of rows that fits a binding and the workgroup grid. The kernel is the adapter's
/// ([`QMatmulMapping::for_product`]).
///
/// # Errors
/// [`Error::InvalidArgument`] when `rows` is 0, a buffer lacks `STORAGE` usage, `y` is `x`, or
/// an index overflows; [`Error::ShapeMismatch`] when `x` or `y` is too small; [`Error::TooLarge`]
/// when one row of x or y exceeds a storage binding; [`Error::Wgpu`] or [`Error::Shader`]
/// from wgpu. Nothing is created before every check has passed.
pub fn prepare_qmatmul(ctx: &Context, args: &QMatmulArgs<'_>) -> Result<PreparedOp> {
    prepare_qmatmul_mapped(ctx, args, QMatmulMapping::for_product(ctx, args))
}

/// How one slice of rows binds `x`.
#[derive(Debug, Clone, Copy)]
enum XBinding {
    Storage(Bound),
    Window(Window),
}

impl XBinding {
    fn base(self) -> u32 {
        match self {
            Self::Storage(b) => b.base,
            Self::Window(w) => w.base,
        }
    }

    fn resource(self, x: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
        match self {
            Self::Storage(b) => b.resource(x),
            Self::Window(w) => w.resource(x),
        }
    }
}

/// The rows of `W` one dispatch binds: part `part`, whole or from a uniform window at `window`
/// (bytes), its first word `base` words into the binding; rows `r0 .. r0 + nr` of `W`.
#[derive(Debug, Clone, Copy)]
pub(super) struct WSlice {
    pub(super) part: usize,
    window: Option<u64>,
    pub(super) base: u32,
    pub(super) r0: usize,
    pub(super) nr: usize,
}

impl WSlice {
    pub(super) fn resource(self, buffer: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
        match self.window {
            None => buffer.as_entire_binding(),
            Some(offset) => window_resource(buffer, offset),
        }
    }
}

/// `w` cut into uniform windows of whole rows for the row kernel; `None` when it was not
/// uploaded for them (UNIFORM usage, a window's room after each part) or a row does not fit.
pub(super) fn weight_windows(ctx: &Context, w: &QWeight) -> Option<Vec<WSlice>> {
    let row_words = row_words(w.ty, w.k)? as u64;
    let align = u64::from(ctx.device.limits().min_uniform_buffer_offset_alignment).max(4);
    let window_words = X_WINDOW_BYTES / 4;
    let threads = cpu_threads();
    let mut out = Vec::new();
    for (part, (buffer, r0, nr)) in w.parts.iter().enumerate() {
        if !buffer.usage().contains(wgpu::BufferUsages::UNIFORM) {
            return None;
        }
        let mut r = 0;
        while r < *nr {
            let start = r as u64 * row_words * 4;
            let mut offset = start / align * align;
            if offset + X_WINDOW_BYTES > buffer.size() {
                // The last window ends at the buffer's end (its rows end at least one
                // alignment before it).
                offset = buffer.size().checked_sub(X_WINDOW_BYTES)? / align * align;
            }
            let base = (start - offset) / 4;
            let fit = (window_words.checked_sub(base)? / row_words) as usize;
            if fit == 0 {
                return None;
            }
            let count = whole_groups(fit, GROUP_ROWS, threads).min(nr - r);
            out.push(WSlice {
                part,
                window: Some(offset),
                base: base as u32,
                r0: r0 + r,
                nr: count,
            });
            r += count;
        }
    }
    Some(out)
}

/// Rows of `W` a workgroup of the row kernel owns in each window (4 per invocation).
pub(super) const GROUP_ROWS: usize = ROW_WG * W_ROWS;

/// Rows of `W` one window of the row kernel takes when `fit` fit: whole workgroups of `group`
/// rows, as many as a multiple of the CPU adapter's threads where that many fit. A CPU adapter
/// runs a dispatch's workgroups on its threads, a workgroup past `n` still computes all its
/// rows (they repeat the last one), and a thread left without a workgroup at a window's end
/// idles until the next dispatch; rows per window change no row's bits.
fn whole_groups(fit: usize, group: usize, threads: usize) -> usize {
    let round = group * threads.max(1);
    if fit >= round {
        fit / round * round
    } else if fit >= group {
        fit / group * group
    } else {
        fit
    }
}

/// Threads a CPU adapter runs workgroups on: Mesa's llvmpipe and lavapipe start
/// `LP_NUM_THREADS` of them, by default one per CPU; 1 where the host does not say (the web).
fn cpu_threads() -> usize {
    #[cfg(not(target_arch = "wasm32"))]
    {
        std::env::var("LP_NUM_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1)
            .min(64)
    }
    #[cfg(target_arch = "wasm32")]
    {
        1
    }
}

/// [`prepare_qmatmul`] with the kernel `mapping` (tests compare them).
///
/// # Errors
/// Those of [`prepare_qmatmul`]; [`Error::InvalidArgument`] for [`QMatmulMapping::Rows`] when
/// `x` cannot be read through a uniform window (not made by [`input_buffer`], or rows longer
/// than the window) or `w` cannot ([`QWeight::has_windows`]).
pub fn prepare_qmatmul_mapped(
    ctx: &Context,
    args: &QMatmulArgs<'_>,
    mapping: QMatmulMapping,
) -> Result<PreparedOp> {
    let QMatmulArgs {
        x,
        x_row,
        rows,
        w,
        y,
        y_row,
        accumulate,
    } = *args;
    let (n, k) = w.shape();
    check_positive("qmatmul", &[("rows", rows)])?;
    let x_end = mul("qmatmul x", x_row.saturating_add(rows), k)?;
    let y_end = mul("qmatmul y", y_row.saturating_add(rows), n)?;
    check_storage("qmatmul x", x, x_end)?;
    check_storage("qmatmul y", y, y_end)?;
    check_distinct("qmatmul", ("y", y), &[("x", x)])?;
    let per_binding = max_bound_elems(ctx) as usize;
    if k.max(n) > per_binding {
        return Err(Error::TooLarge {
            what: format!("one row of qmatmul x or y ({} values)", k.max(n)),
            bytes: k.max(n) as u64 * 4,
            limit: binding_limit(ctx),
        });
    }
    let fit = |v: usize| -> Result<u32> {
        u32::try_from(v).map_err(|_| Error::InvalidArgument(format!("qmatmul: {v} exceeds u32")))
    };
    fit(x_end)?;
    fit(y_end)?;
    let max_groups = ctx.caps().max_compute_workgroups_per_dimension as usize;
    // Rows of x and of W per workgroup, the most rows of x one dispatch takes, and the
    // kernel's constants.
    let (x_per_group, w_per_group, x_limit, constants) = match mapping {
        QMatmulMapping::Lanes => {
            let xr = x_rows_per_group(rows);
            (xr, ROWS_OF_W, per_binding / k, lane_constants(w.ty, xr))
        }
        QMatmulMapping::Rows => {
            let most = Window::max_rows(ctx, k);
            if most == 0 || Window::of(ctx, x, x_row * k, k).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "qmatmul: the row kernel reads x through a uniform window of {} bytes: x \
                     needs UNIFORM usage and the window's room after each row (make it with \
                     qmatmul_rows::input_buffer) and rows of at most {} values (not {k})",
                    X_WINDOW_BYTES,
                    Window::max_rows(ctx, 1)
                )));
            }
            (most, GROUP_ROWS, most, row_constants(w.ty, rows, 1))
        }
        QMatmulMapping::Tiled => (
            TILE_X_ROWS,
            TILE_W_ROWS,
            per_binding / k,
            format_constants(w.ty),
        ),
    };
    let per_slice = x_limit
        .min(per_binding / n)
        .min(max_groups * x_per_group)
        .max(1);
    // The rows of W each dispatch binds: whole parts, or for the row kernel windows of whole
    // rows.
    let w_slices = match mapping {
        QMatmulMapping::Rows => weight_windows(ctx, w).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "qmatmul: the row kernel reads W through uniform windows of {X_WINDOW_BYTES} \
                 bytes: the weight must be uploaded on a CPU adapter, at least one window \
                 long, with rows that fit one (QWeight::has_windows)"
            ))
        })?,
        _ => w
            .parts
            .iter()
            .enumerate()
            .map(|(part, &(_, r0, nr))| WSlice {
                part,
                window: None,
                base: 0,
                r0,
                nr,
            })
            .collect(),
    };
    // Every binding and uniform value first: nothing is created for a product that fails.
    let mut plans = Vec::new();
    let mut t0 = 0;
    while t0 < rows {
        let nt = per_slice.min(rows - t0);
        let first = (x_row + t0) * k;
        let xs = match mapping {
            QMatmulMapping::Rows => {
                XBinding::Window(Window::of(ctx, x, first, nt * k).ok_or_else(|| {
                    Error::InvalidArgument(
                        "qmatmul: x has no room for the row kernel's window".into(),
                    )
                })?)
            }
            _ => XBinding::Storage(bind(ctx, first as u64, (nt * k) as u64)?),
        };
        let ys = bind(ctx, ((y_row + t0) * n) as u64, (nt * n) as u64)?;
        // The row kernel takes up to max_windows windows of W a dispatch for one row of x
        // (each window's rows and bits as alone); every other case one part or window each.
        let batches = if mapping == QMatmulMapping::Rows && rows == 1 {
            window_batches(w_slices.len(), max_windows(ctx))
        } else {
            (0..w_slices.len()).map(|i| i..i + 1).collect()
        };
        for batch in batches {
            let slices = &w_slices[batch];
            let first = slices[0];
            let mut params = QMatmulParams {
                rows: nt as u32,
                k: k as u32,
                n: first.nr as u32,
                n_base: first.r0 as u32,
                y_stride: n as u32,
                x_base: xs.base(),
                y_base: ys.base,
                accumulate: u32::from(accumulate),
                ..QMatmulParams::default()
            };
            if mapping == QMatmulMapping::Rows {
                for (j, ws) in slices.iter().enumerate() {
                    params.win_w_base[j] = ws.base;
                    params.win_n[j] = ws.nr as u32;
                    params.win_n_base[j] = ws.r0 as u32;
                }
            }
            let most_rows = slices.iter().map(|ws| ws.nr).max().unwrap_or(0);
            let grid = [
                most_rows.div_ceil(w_per_group) as u32,
                nt.div_ceil(x_per_group) as u32,
                1,
            ];
            plans.push((slices.to_vec(), params, xs, ys, grid));
        }
        t0 += nt;
    }
    // One pipeline per number of windows a dispatch binds (the row kernel's WINDOWS).
    let mut pipelines = vec![None; MAX_WINDOWS + 1];
    let mut uniforms = Vec::with_capacity(plans.len());
    let mut dispatches = Vec::with_capacity(plans.len());
    for (slices, params, xs, ys, grid) in plans {
        let windows = slices.len();
        let pipeline = match &pipelines[windows] {
            Some(p) => std::sync::Arc::clone(p),
            None => {
                let constants = match mapping {
                    QMatmulMapping::Rows => row_constants(w.ty, rows, windows),
                    _ => constants.clone(),
                };
                let variant =
                    row_variant(mapping.kernel(), w.ty, windows, ctx.caps().f16_unpack_exact);
                let key = PipelineKey::new(variant, &constants);
                let p = ctx.pipeline(&key)?;
                pipelines[windows] = Some(std::sync::Arc::clone(&p));
                p
            }
        };
        let uniform = ctx.uniform("qmatmul params", &params)?;
        let w_resource = |j: usize| {
            let ws = slices[j.min(windows - 1)];
            ws.resource(&w.parts[ws.part].0)
        };
        let mut resources = vec![
            uniform.as_entire_binding(),
            xs.resource(x),
            w_resource(0),
            ys.resource(y),
        ];
        if mapping == QMatmulMapping::Rows {
            // Outputs 1 and 2 (y again: every window writes y), then windows 1 .. 3, 1 .. 7
            // or 1 .. 11 of the variant (past the dispatch's windows, its last again: never
            // read).
            resources.extend([ys.resource(y), ys.resource(y)]);
            let bound = usize::from(bound_windows(windows));
            resources.extend((1..bound).map(w_resource));
        }
        dispatches.push(ctx.prepare_dispatch(
            mapping.kernel().name(),
            &pipeline,
            &resources,
            grid,
        )?);
        uniforms.push(uniform);
    }
    Ok(PreparedOp {
        dispatches,
        _uniforms: uniforms,
    })
}

/// [`prepare_qmatmul`] recorded into `pass` (submits nothing).
///
/// # Errors
/// Those of [`prepare_qmatmul`], before anything is recorded.
pub fn encode_qmatmul(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    args: &QMatmulArgs<'_>,
) -> Result<()> {
    prepare_qmatmul(ctx, args)?.encode(pass);
    Ok(())
}

/// The product in a compute pass of its own, submitted.
///
/// # Errors
/// Those of [`prepare_qmatmul`], before anything is submitted.
pub fn qmatmul(ctx: &Context, args: &QMatmulArgs<'_>) -> Result<()> {
    let prepared = prepare_qmatmul(ctx, args)?;
    ctx.run_pass("qmatmul", |pass| {
        prepared.encode(pass);
        Ok(())
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padded_blocks_stay_within_15_percent_of_the_file() {
        for ty in crate::decoder::blocks::SUPPORTED {
            let k = 256;
            let file = ty.bytes_for(k as u64).unwrap() as usize;
            let gpu = row_words(ty, k).unwrap() * 4;
            assert!(
                gpu >= file && gpu as f64 <= file as f64 * 1.15,
                "{ty}: {gpu} / {file}"
            );
            let packed = pack_rows(ty, k, &vec![0xA5; 3 * file]).unwrap();
            assert_eq!(packed.len() * 4, 3 * gpu, "{ty}");
        }
    }

    #[test]
    fn padding_moves_codes_onto_words() {
        // Q8_0: d = 0x1234, codes 0..31: the codes start at word 1.
        let mut block = vec![0x34, 0x12];
        block.extend(0u8..32);
        let words = pack_rows(GgmlType::Q8_0, 32, &block).unwrap();
        assert_eq!(words[0], 0x1234);
        assert_eq!(words[1], u32::from_le_bytes([0, 1, 2, 3]));
        assert_eq!(words[8], u32::from_le_bytes([28, 29, 30, 31]));
        // Q6_K: its d (last two bytes) alone in the last word.
        let mut block = vec![7u8; 208];
        block.extend([0xCD, 0xAB]);
        let words = pack_rows(GgmlType::Q6_K, 256, &block).unwrap();
        assert_eq!((words.len(), words[52]), (53, 0xABCD));
    }

    #[test]
    fn row_kernel_windows_take_whole_workgroups_shared_by_the_threads() {
        assert_eq!(GROUP_ROWS, 32);
        // Q4_1 rows of 576 values: 182 fit a window; 4 workgroups, 2 for each of 2 threads.
        assert_eq!(whole_groups(182, 32, 2), 128);
        assert_eq!(whole_groups(182, 32, 1), 160);
        // Fewer rows than one workgroup per thread: whole workgroups still.
        assert_eq!(whole_groups(68, 32, 4), 64);
        // Under one workgroup: the rows that fit.
        assert_eq!(whole_groups(20, 32, 2), 20);
        assert_eq!(whole_groups(101, 32, 0), 96);
    }

    #[test]
    fn windows_are_shared_evenly_by_the_fewest_dispatches() {
        let lens = |n, most| {
            window_batches(n, most)
                .into_iter()
                .map(|r| r.len())
                .collect::<Vec<_>>()
        };
        assert_eq!(lens(1, 8), [1]);
        assert_eq!(lens(8, 8), [8]);
        // attn_q of SmolLM2 (5 windows), ffn_down (9), ffn_gate (12), the output (768), with
        // 8 windows a dispatch (WebGPU's default limits) and 12 (lavapipe's).
        assert_eq!(lens(5, 8), [5]);
        assert_eq!(lens(9, 8), [5, 4]);
        assert_eq!(lens(12, 8), [6, 6]);
        assert_eq!(lens(17, 8), [6, 6, 5]);
        assert_eq!(lens(768, 8), [8; 96]);
        assert_eq!(lens(9, 12), [9]);
        assert_eq!(lens(12, 12), [12]);
        assert_eq!(lens(17, 12), [9, 8]);
        assert_eq!(lens(768, 12), [12; 64]);
        // In order, each window once.
        for most in [4, 8, 12] {
            let all: Vec<usize> = window_batches(11, most).into_iter().flatten().collect();
            assert_eq!(all, (0..11).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_dispatch_binds_the_whole_quads_its_windows_need() {
        assert_eq!(bound_windows(1), 4);
        assert_eq!(bound_windows(4), 4);
        assert_eq!(bound_windows(5), 8);
        assert_eq!(bound_windows(8), 8);
        assert_eq!(bound_windows(9), 12);
        assert_eq!(bound_windows(12), 12);
    }

    #[test]
    fn unsupported_shapes_and_types_are_refused() {
        assert!(pack_rows(GgmlType::Q4_K, 32, &[0; 144]).is_err());
        assert!(pack_rows(GgmlType::F32, 48, &[0; 192]).is_err());
        assert!(pack_rows(GgmlType::Q2_K, 256, &[0; 84]).is_err());
        assert!(pack_rows(GgmlType::Q4_1, 32, &[0; 30]).is_err());
        let e = check_type(GgmlType::IQ4_NL, 32).unwrap_err().to_string();
        assert!(e.contains("IQ4_NL"), "{e}");
    }
}
