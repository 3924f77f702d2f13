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
/// `a` or `b`).
pub fn merge_states(
    ctx: &Context,
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
    for (name, s) in [("a", a), ("b", b), ("out", out)] {
        if s.o.size() < (rows * head_dim_v * 4) as u64 || s.lse.size() < (rows * 4) as u64 {
            return Err(Error::InvalidArgument(format!(
                "state {name} is smaller than {rows} rows of {head_dim_v} values"
            )));
        }
    }
    if rows == 0 {
        return Ok(());
    }
    let vec4s = (rows * head_dim_v / 4) as u32;
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
    ctx.dispatch(
        &pipeline,
        &[&uniform, a.o, a.lse, b.o, b.lse, out.o, out.lse],
        [gx, gy, 1],
    )
}
