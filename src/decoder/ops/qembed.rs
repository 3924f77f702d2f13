//! The token-embedding gather from a table kept in its GGUF block format
//! (`shaders/qembed.wgsl`): `out[t, :] = table[tokens[t], :]` as f32 for each of `n_tokens`
//! tokens, every value decoded exactly as [`crate::decoder::blocks`] does (its CPU reference is
//! that dequantization of the token's row). An id `>= vocab` reads nothing and gets a row of
//! zeros, as in [`super::embed`]; check ids on the host with [`super::embed::embed_host_check`].
//!
//! The table is a [`QWeight`] (`vocab` rows of `dim` values), so a tied output projection and
//! the gather share one copy of it on the GPU.

use crate::decoder::ops::qmatmul::{format_constants, format_variant, QWeight};
use crate::decoder::ops::PreparedOp;
use crate::gpu::dispatch::{bind, check_distinct, check_positive, element_grid, max_bound_elems};
use crate::gpu::dispatch::{binding_limit, mul};
use crate::gpu::{check_storage, Context};
use crate::pipeline::PipelineKey;
use crate::shader::Kernel;
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `QEmbedParams` uniform (one per dispatch).
    pub struct QEmbedParams {
        /// Tokens in this dispatch.
        pub n_tokens: u32,
        /// Chunks of 32 values per row.
        pub chunks: u32,
        /// Rows of the whole table.
        pub vocab: u32,
        /// First id of the bound part.
        pub row_lo: u32,
        /// Rows of the bound part.
        pub part_rows: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// Index of the dispatch's first token inside the tokens binding.
        pub tokens_base: u32,
        /// Index of the dispatch's first output value inside the out binding.
        pub out_base: u32,
        /// 1 when this dispatch writes the zero rows of ids `>= vocab`.
        pub zero_oob: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
        /// Padding.
        pub _pad2: u32,
    }
}

/// Override constants for the naga tests: every type.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    crate::decoder::blocks::SUPPORTED
        .iter()
        .map(|&ty| format_constants(ty))
        .collect()
}

/// One gather: `out[t, :] = table[tokens[t], :]` for `t < n_tokens`.
#[derive(Debug, Clone, Copy)]
pub struct QEmbedArgs<'a> {
    /// Token ids, `n_tokens` u32 values.
    pub tokens: &'a wgpu::Buffer,
    /// Tokens.
    pub n_tokens: usize,
    /// The table: `vocab` rows of `dim` values.
    pub table: &'a QWeight,
    /// Output `[n_tokens, dim]` f32 (a buffer other than `tokens`).
    pub out: &'a wgpu::Buffer,
}

/// Checks `args` and prepares the gather: one dispatch per part of the table and per slice of
/// tokens that fits a storage binding.
///
/// # Errors
/// [`Error::InvalidArgument`] when `n_tokens` is 0, a buffer lacks `STORAGE` usage or `out`
/// is `tokens`; [`Error::ShapeMismatch`] when a buffer is too small; [`Error::TooLarge`] when
/// one row exceeds a storage binding; [`Error::Wgpu`] or [`Error::Shader`] from wgpu.
pub fn prepare_qembed(ctx: &Context, args: &QEmbedArgs<'_>) -> Result<PreparedOp> {
    let QEmbedArgs {
        tokens,
        n_tokens,
        table,
        out,
    } = *args;
    let (vocab, dim) = table.shape();
    check_positive("qembed", &[("n_tokens", n_tokens)])?;
    let out_elems = mul("qembed n_tokens * dim", n_tokens, dim)?;
    check_storage("qembed tokens", tokens, n_tokens)?;
    check_storage("qembed out", out, out_elems)?;
    check_distinct("qembed", ("out", out), &[("tokens", tokens)])?;
    let per_binding = max_bound_elems(ctx);
    if dim as u64 > per_binding {
        return Err(Error::TooLarge {
            what: format!("one embedding row ({dim} values)"),
            bytes: dim as u64 * 4,
            limit: binding_limit(ctx),
        });
    }
    let per_slice = (per_binding / dim as u64) as usize;
    let mut plans = Vec::new();
    let mut t0 = 0;
    while t0 < n_tokens {
        let nt = per_slice.min(n_tokens - t0);
        let ts = bind(ctx, t0 as u64, nt as u64)?;
        let os = bind(ctx, (t0 * dim) as u64, (nt * dim) as u64)?;
        let (grid, stride_x) = element_grid(ctx, (nt * dim / 8) as u64);
        for (part, (_, r0, rows)) in table.parts().enumerate() {
            let params = QEmbedParams {
                n_tokens: nt as u32,
                chunks: (dim / 32) as u32,
                vocab: vocab as u32,
                row_lo: r0 as u32,
                part_rows: rows as u32,
                stride_x,
                tokens_base: ts.base,
                out_base: os.base,
                zero_oob: u32::from(part == 0),
                ..Default::default()
            };
            plans.push((part, params, ts, os, grid));
        }
        t0 += nt;
    }
    let key = PipelineKey::new(
        format_variant(
            Kernel::QEmbed,
            table.ggml_type(),
            ctx.caps().f16_unpack_exact,
        ),
        &format_constants(table.ggml_type()),
    );
    let pipeline = ctx.pipeline(&key)?;
    let buffers: Vec<&wgpu::Buffer> = table.parts().map(|(b, _, _)| b).collect();
    let mut uniforms = Vec::with_capacity(plans.len());
    let mut dispatches = Vec::with_capacity(plans.len());
    for (part, params, ts, os, grid) in plans {
        let uniform = ctx.uniform("qembed params", &params)?;
        let resources = [
            uniform.as_entire_binding(),
            ts.resource(tokens),
            buffers[part].as_entire_binding(),
            os.resource(out),
        ];
        dispatches.push(ctx.prepare_dispatch("qembed", &pipeline, &resources, grid)?);
        uniforms.push(uniform);
    }
    Ok(PreparedOp {
        dispatches,
        _uniforms: uniforms,
    })
}

/// The gather in a compute pass of its own, submitted.
///
/// # Errors
/// Those of [`prepare_qembed`], before anything is submitted.
pub fn qembed(ctx: &Context, args: &QEmbedArgs<'_>) -> Result<()> {
    let op = prepare_qembed(ctx, args)?;
    ctx.run_pass("qembed", |pass| {
        op.encode(pass);
        Ok(())
    })
    .map(|_| ())
}
