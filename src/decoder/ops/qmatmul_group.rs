//! Several block-format products of one row of `x` in as few dispatches as hold their
//! windows: `y_d = W_d x` for up to [`MAX_OUTPUTS`] weights of one type and row length, each
//! window of the row kernel ([`super::qmatmul_rows`]) writing its own output (the kernel's
//! `win_dst`). The decoder's Q, K and V products of a decode step (SmolLM2: 5 + 2 + 2
//! windows) become one dispatch instead of three; on a CPU adapter each dispatch costs a
//! wake-up and a wait of its threads.
//!
//! Every output has the bits of its own product ([`super::qmatmul`]): a window's rows are
//! computed as they are alone, whichever dispatch or window holds them (tested).

use crate::decoder::ops::qmatmul::{
    bound_windows, max_windows, row_constants, row_variant, weight_windows, window_batches,
    QMatmulParams, QWeight, WSlice, GROUP_ROWS,
};
use crate::decoder::ops::qmatmul_rows::Window;
use crate::decoder::ops::{check_distinct, PreparedOp};
use crate::gpu::dispatch::bind;
use crate::gpu::{check_storage, Context};
use crate::pipeline::PipelineKey;
use crate::shader::Kernel;
use crate::{Error, Result};

/// Most outputs one grouped product writes (the row kernel's `y`, `y1` and `y2`).
pub const MAX_OUTPUTS: usize = 3;

/// One output of a grouped product: `y[0 .. n] = W x` for the weight's `n` rows.
#[derive(Debug, Clone, Copy)]
pub struct GroupOutput<'a> {
    /// The weight.
    pub w: &'a QWeight,
    /// Its output (at least `n` f32 values; a buffer other than `x` and the other outputs').
    pub y: &'a wgpu::Buffer,
}

/// Whether [`prepare_qmatmul_group`] takes these products: 1 to [`MAX_OUTPUTS`] weights of
/// one type and row length, all readable by the row kernel ([`QWeight::has_windows`]), and an
/// `x` it reads through a uniform window (made by
/// [`input_buffer`](super::qmatmul_rows::input_buffer)) at row `x_row`.
pub fn can_group(ctx: &Context, x: &wgpu::Buffer, x_row: usize, outputs: &[GroupOutput]) -> bool {
    let Some(first) = outputs.first() else {
        return false;
    };
    let (ty, k) = (first.w.ggml_type(), first.w.shape().1);
    outputs.len() <= MAX_OUTPUTS
        && outputs
            .iter()
            .all(|o| o.w.ggml_type() == ty && o.w.shape().1 == k && o.w.has_windows(ctx))
        && x_row
            .checked_mul(k)
            .is_some_and(|first| Window::of(ctx, x, first, k).is_some())
}

/// Checks the products and prepares them: the windows of every weight, in output order,
/// shared by as few row-kernel dispatches as hold them.
///
/// # Errors
/// [`Error::InvalidArgument`] when [`can_group`] refuses them or two outputs (or an output and
/// `x`) are one buffer; [`Error::ShapeMismatch`] when `x` or an output is too small;
/// [`Error::Wgpu`] from wgpu.
pub fn prepare_qmatmul_group(
    ctx: &Context,
    x: &wgpu::Buffer,
    x_row: usize,
    outputs: &[GroupOutput],
) -> Result<PreparedOp> {
    if !can_group(ctx, x, x_row, outputs) {
        return Err(Error::InvalidArgument(format!(
            "qmatmul group: {} outputs; the row kernel takes 1 to {MAX_OUTPUTS} weights of one \
             type and row length, each readable through its uniform windows \
             (QWeight::has_windows), and an x made by qmatmul_rows::input_buffer",
            outputs.len()
        )));
    }
    let (ty, k) = (outputs[0].w.ggml_type(), outputs[0].w.shape().1);
    check_storage("qmatmul group x", x, (x_row + 1) * k)?;
    for (d, o) in outputs.iter().enumerate() {
        check_storage("qmatmul group y", o.y, o.w.shape().0)?;
        let others: Vec<(&str, &wgpu::Buffer)> = std::iter::once(("x", x))
            .chain(outputs[..d].iter().map(|p| ("another output", p.y)))
            .collect();
        check_distinct("qmatmul group", ("y", o.y), &others)?;
    }
    let xw = Window::of(ctx, x, x_row * k, k)
        .ok_or_else(|| Error::InvalidArgument("qmatmul group: x has no window".into()))?;
    // Each output bound from its first value; a window's rows land at its base plus their row.
    let ys = outputs
        .iter()
        .map(|o| bind(ctx, 0, o.w.shape().0 as u64))
        .collect::<Result<Vec<_>>>()?;
    let mut slices: Vec<(usize, WSlice)> = Vec::new();
    for (d, o) in outputs.iter().enumerate() {
        let windows = weight_windows(ctx, o.w).ok_or_else(|| {
            Error::InvalidArgument("qmatmul group: a weight has no windows".into())
        })?;
        slices.extend(windows.into_iter().map(|s| (d, s)));
    }
    let mut uniforms = Vec::new();
    let mut dispatches = Vec::new();
    for batch in window_batches(slices.len(), max_windows(ctx)) {
        let batch = &slices[batch];
        let windows = batch.len();
        let mut params = QMatmulParams {
            rows: 1,
            k: k as u32,
            n: batch[0].1.nr as u32,
            x_base: xw.base,
            ..QMatmulParams::default()
        };
        for (j, &(d, s)) in batch.iter().enumerate() {
            params.win_w_base[j] = s.base;
            params.win_n[j] = s.nr as u32;
            params.win_n_base[j] = ys[d].base + s.r0 as u32;
            params.win_dst[j] = d as u32;
        }
        let key = PipelineKey::new(
            row_variant(
                Kernel::QMatmulRows,
                ty,
                windows,
                ctx.caps().f16_unpack_exact,
            ),
            &row_constants(ty, 1, windows),
        );
        let pipeline = ctx.pipeline(&key)?;
        let uniform = ctx.uniform("qmatmul group params", &params)?;
        let w_resource = |j: usize| {
            let (d, s) = batch[j.min(windows - 1)];
            s.resource(outputs[d].w.part_buffer(s.part))
        };
        // Outputs past the group's: the first again (no window writes them).
        let y_resource = |d: usize| {
            let d = if d < outputs.len() { d } else { 0 };
            ys[d].resource(outputs[d].y)
        };
        let mut resources = vec![uniform.as_entire_binding(), xw.resource(x), w_resource(0)];
        resources.extend((0..MAX_OUTPUTS).map(y_resource));
        resources.extend((1..usize::from(bound_windows(windows))).map(w_resource));
        let most_rows = batch.iter().map(|(_, s)| s.nr).max().unwrap_or(0);
        let grid = [most_rows.div_ceil(GROUP_ROWS) as u32, 1, 1];
        dispatches.push(ctx.prepare_dispatch("qmatmul group", &pipeline, &resources, grid)?);
        uniforms.push(uniform);
    }
    Ok(PreparedOp {
        dispatches,
        _uniforms: uniforms,
    })
}
