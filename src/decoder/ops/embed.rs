//! The token-embedding gather on the GPU (`shaders/embed.wgsl`): row `tokens[t]` of a
//! `[vocab, dim]` f32 table for each of `n_tokens` tokens, copied bit for bit into
//! `[n_tokens, dim]`. The CPU reference is [`crate::reference::ops::embed`].
//!
//! Token ids live in a GPU buffer, so the kernel cannot return an error for a bad one: an id
//! `>= vocab` reads nothing (never out of bounds) and gets a row of zeros. A caller that holds
//! the ids on the host checks them first with [`embed_host_check`], which returns the error the
//! kernel cannot.
//!
//! The table may be larger than one storage binding (a 128k x 4096 f32 table is 2 GiB): it is
//! bound in slices of whole rows, one dispatch per slice, each writing the outputs whose id
//! falls in its slice.

use crate::decoder::ops::PreparedOp;
use crate::gpu::dispatch::{bind, check_distinct, element_grid, max_bound_elems, mul};
use crate::gpu::dispatch::{binding_limit, check_positive};
use crate::gpu::{check_storage, Context};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `EmbedParams` uniform (one per dispatch).
    pub struct EmbedParams {
        /// Tokens in this dispatch.
        pub n_tokens: u32,
        /// Values per row.
        pub dim: u32,
        /// Rows of the whole table.
        pub vocab: u32,
        /// First id of the table slice bound in this dispatch.
        pub vocab_lo: u32,
        /// Rows of that slice.
        pub vocab_rows: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// Index of the dispatch's first token inside the tokens binding.
        pub tokens_base: u32,
        /// Index of the slice's first value inside the table binding.
        pub table_base: u32,
        /// Index of the dispatch's first output value inside the out binding.
        pub out_base: u32,
        /// 1 when this dispatch writes the zero rows of ids `>= vocab`.
        pub zero_oob: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
    }
}

/// Override constants for the naga tests (the kernel has none).
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    vec![Vec::new()]
}

/// Checks token ids on the host before they are uploaded for [`embed`]: every id must be below
/// `vocab`.
///
/// # Errors
/// [`Error::InvalidArgument`] when `vocab` is 0 or an id is `>= vocab` (the message names the
/// first such token and its id).
pub fn embed_host_check(ids: &[u32], vocab: usize) -> Result<()> {
    if vocab == 0 {
        return Err(Error::InvalidArgument(
            "embed: vocab must be positive".into(),
        ));
    }
    if let Some((t, &id)) = ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= vocab)
    {
        return Err(Error::InvalidArgument(format!(
            "embed: token {t} has id {id}, outside the vocabulary of {vocab}"
        )));
    }
    Ok(())
}

/// One embedding gather: `out[t, :] = table[tokens[t], :]` for `t < n_tokens`.
#[derive(Debug, Clone, Copy)]
pub struct EmbedArgs<'a> {
    /// Token ids, `n_tokens` u32 values (storage; the decoder rewrites them every step).
    pub tokens: &'a wgpu::Buffer,
    /// Tokens.
    pub n_tokens: usize,
    /// Values per row.
    pub dim: usize,
    /// Rows of the table.
    pub vocab: usize,
    /// The table `[vocab, dim]` (f32 storage).
    pub table: &'a wgpu::Buffer,
    /// Output `[n_tokens, dim]` (f32 storage, other than `tokens` and `table`).
    pub out: &'a wgpu::Buffer,
}

/// Checks `args` and prepares the gather (see [`embed`] for the rules and errors). The ids are
/// read from `tokens` when the op runs, so one prepared gather serves every step that writes
/// new ids into the same buffer.
pub fn prepare_embed(ctx: &Context, args: &EmbedArgs<'_>) -> Result<PreparedOp> {
    let EmbedArgs {
        tokens,
        n_tokens,
        dim,
        vocab,
        table,
        out,
    } = *args;
    check_positive(
        "embed",
        &[("n_tokens", n_tokens), ("dim", dim), ("vocab", vocab)],
    )?;
    let table_elems = mul("embed vocab * dim", vocab, dim)?;
    let out_elems = mul("embed n_tokens * dim", n_tokens, dim)?;
    check_storage("embed tokens", tokens, n_tokens)?;
    check_storage("embed table", table, table_elems)?;
    check_storage("embed out", out, out_elems)?;
    check_distinct(
        "embed",
        ("out", out),
        &[("tokens", tokens), ("table", table)],
    )?;
    let per_binding = max_bound_elems(ctx);
    if dim as u64 > per_binding {
        return Err(Error::TooLarge {
            what: format!("one embedding row ({dim} values)"),
            bytes: dim as u64 * 4,
            limit: binding_limit(ctx),
        });
    }
    let rows_per_chunk = (per_binding / dim as u64) as usize;
    let key = PipelineKey::new(ShaderVariant::new(Kernel::Embed, Precision::F32), &[]);
    let pipeline = ctx.pipeline(&key)?;
    let mut uniforms = Vec::new();
    let mut dispatches = Vec::new();
    let mut t0 = 0;
    while t0 < n_tokens {
        let nt = rows_per_chunk.min(n_tokens - t0);
        let ts = bind(ctx, t0 as u64, nt as u64)?;
        let os = bind(ctx, (t0 * dim) as u64, (nt * dim) as u64)?;
        let (grid, stride_x) = element_grid(ctx, (nt * dim) as u64);
        let mut v0 = 0;
        while v0 < vocab {
            let nv = rows_per_chunk.min(vocab - v0);
            let vs = bind(ctx, (v0 * dim) as u64, (nv * dim) as u64)?;
            let params = EmbedParams {
                n_tokens: nt as u32,
                dim: dim as u32,
                vocab: vocab as u32,
                vocab_lo: v0 as u32,
                vocab_rows: nv as u32,
                stride_x,
                tokens_base: ts.base,
                table_base: vs.base,
                out_base: os.base,
                zero_oob: u32::from(v0 == 0),
                ..Default::default()
            };
            let uniform = ctx.uniform("embed params", &params)?;
            let resources = [
                uniform.as_entire_binding(),
                ts.resource(tokens),
                vs.resource(table),
                os.resource(out),
            ];
            dispatches.push(ctx.prepare_dispatch("embed", &pipeline, &resources, grid)?);
            uniforms.push(uniform);
            v0 += nv;
        }
        t0 += nt;
    }
    Ok(PreparedOp {
        dispatches,
        _uniforms: uniforms,
    })
}

/// Records the gather into `pass` (submits nothing); on error nothing is recorded.
pub fn encode_embed(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    args: &EmbedArgs<'_>,
) -> Result<()> {
    prepare_embed(ctx, args)?.encode(pass);
    Ok(())
}

/// Gathers `out[t, :] = table[tokens[t], :]` for `t < n_tokens`: `tokens` holds `n_tokens`
/// u32 ids, `table` `[vocab, dim]` f32 values, and the first `n_tokens * dim` values of `out`
/// are written (the rest is not touched). An id `>= vocab` gives a row of zeros and reads
/// nothing; check ids on the host with [`embed_host_check`] first. `out` must be a buffer other
/// than `tokens` and `table`. Buffers larger than one storage binding are processed in slices
/// (one submission).
///
/// # Errors
/// Everything is checked before anything is dispatched: [`Error::InvalidArgument`] when
/// `n_tokens`, `dim` or `vocab` is 0 or does not fit a u32, a product of them overflows, a
/// buffer lacks `STORAGE` usage, or `out` is `tokens` or `table`; [`Error::ShapeMismatch`] when
/// a buffer holds fewer values than the shape needs; [`Error::TooLarge`] when one row exceeds
/// a storage binding; [`Error::Wgpu`] or [`Error::Shader`] from wgpu.
pub fn embed(
    ctx: &Context,
    tokens: &wgpu::Buffer,
    n_tokens: usize,
    dim: usize,
    vocab: usize,
    table: &wgpu::Buffer,
    out: &wgpu::Buffer,
) -> Result<()> {
    let args = EmbedArgs {
        tokens,
        n_tokens,
        dim,
        vocab,
        table,
        out,
    };
    let op = prepare_embed(ctx, &args)?;
    ctx.run_pass("embed", |pass| {
        op.encode(pass);
        Ok(())
    })
    .map(|_| ())
}
