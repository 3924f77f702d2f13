//! Merge of two attention states over disjoint key sets (`shaders/merge_states.wgsl`):
//! cascade attention runs a batch's queries over a shared prefix once (non-causal, see
//! [`PagedQuery`](super::paged::PagedQuery)) and over each sequence's own suffix, then merges the
//! two (o, lse) states row by row. `lse = -inf` (no key) contributes nothing.

use crate::gpu::Context;
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `MergeStatesParams` uniform.
    pub struct MergeStatesParams {
        /// Rows (query token x head).
        pub rows: u32,
        /// Invocations along x of the dispatch grid.
        pub stride_x: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
    }
}

const WG: u32 = 64;

/// Override constants the naga tests validate.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    [64.0, 128.0, 1024.0]
        .iter()
        .map(|&d| vec![("V_DIM", d)])
        .collect()
}

/// One attention state on the GPU: `o` `[rows, head_dim_v]` f32 and `lse` `[rows]` f32, rows
/// being (query token, head) pairs as the attention kernels write them.
#[derive(Debug, Clone, Copy)]
pub struct AttentionState<'a> {
    /// Normalized outputs.
    pub o: &'a wgpu::Buffer,
    /// Log-sum-exps.
    pub lse: &'a wgpu::Buffer,
}

/// Writes `merge(a, b)` into `out` for `rows` rows of `head_dim_v` values (`out` may not alias
/// `a` or `b`): [`encode_merge_states`] in a compute pass of its own, submitted.
pub fn merge_states(
    ctx: &Context,
    rows: usize,
    head_dim_v: usize,
    a: AttentionState,
    b: AttentionState,
    out: AttentionState,
) -> Result<()> {
    ctx.run_pass("merge states", |pass| {
        encode_merge_states(ctx, pass, rows, head_dim_v, a, b, out)
    })?;
    Ok(())
}

/// Records `out = merge(a, b)` for `rows` rows of `head_dim_v` values into `pass`; submits
/// nothing. Everything is checked and the bind group made before anything is recorded (zero
/// rows record nothing).
///
/// # Errors
/// [`Error::UnsupportedHeadDim`] unless `head_dim_v` is a positive multiple of 4;
/// [`Error::InvalidArgument`] for a state too small, a buffer without `STORAGE` usage or `out`
/// sharing a buffer with `a` or `b`; [`Error::Wgpu`] for a buffer the device refuses to bind.
pub fn encode_merge_states(
    ctx: &Context,
    pass: &mut wgpu::ComputePass<'_>,
    rows: usize,
    head_dim_v: usize,
    a: AttentionState,
    b: AttentionState,
    out: AttentionState,
) -> Result<()> {
    if head_dim_v == 0 || head_dim_v % 4 != 0 {
        return Err(Error::UnsupportedHeadDim {
            head_dim: head_dim_v,
            reason: "must be a positive multiple of 4".into(),
        });
    }
    let (o_bytes, lse_bytes) = rows
        .checked_mul(head_dim_v)
        .and_then(|n| n.checked_mul(4))
        .zip(rows.checked_mul(4))
        .ok_or_else(|| Error::InvalidArgument(format!("{rows} rows overflow a usize")))?;
    for (name, s) in [("a", a), ("b", b), ("out", out)] {
        if s.o.size() < o_bytes as u64 || s.lse.size() < lse_bytes as u64 {
            return Err(Error::InvalidArgument(format!(
                "state {name} is smaller than {rows} rows of {head_dim_v} values"
            )));
        }
        for buffer in [s.o, s.lse] {
            if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
                return Err(Error::InvalidArgument(format!(
                    "state {name}: a buffer was not created with STORAGE usage"
                )));
            }
        }
    }
    for written in [out.o, out.lse] {
        if [a.o, a.lse, b.o, b.lse].contains(&written) {
            return Err(Error::InvalidArgument(
                "merge_states: out may not share a buffer with a or b".into(),
            ));
        }
    }
    if rows == 0 {
        return Ok(());
    }
    let vec4s = u32::try_from(rows * head_dim_v / 4).map_err(|_| {
        Error::InvalidArgument(format!(
            "{rows} rows of {head_dim_v} values exceed u32 indices"
        ))
    })?;
    let groups = vec4s.div_ceil(WG);
    let max = ctx.caps().max_compute_workgroups_per_dimension;
    let (gx, gy) = if groups <= max {
        (groups, 1)
    } else {
        (max, groups.div_ceil(max))
    };
    let params = MergeStatesParams {
        rows: rows as u32,
        stride_x: gx * WG,
        ..Default::default()
    };
    let key = PipelineKey::new(
        ShaderVariant::new(Kernel::MergeStates, Precision::F32),
        &[("V_DIM", head_dim_v as f64)],
    );
    let pipeline = ctx.pipeline(&key)?;
    let uniform = ctx.uniform("merge states params", &params)?;
    let dispatch = ctx.prepare_dispatch(
        "merge states",
        &pipeline,
        &[&uniform, a.o, a.lse, b.o, b.lse, out.o, out.lse].map(|b| b.as_entire_binding()),
        [gx, gy, 1],
    )?;
    dispatch.encode(pass);
    Ok(())
}
