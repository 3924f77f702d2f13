//! Merge of partial attention states (o, lse) (`shaders/merge.wgsl`): split-K partials of the
//! paged kernel, in key order; sinks join the denominator here, once. The same combination
//! serves cascade attention (a shared-prefix pass merged with per-sequence passes). The
//! paged attention plan records the merge (see `PagedAttentionPlan::encode`).

use super::AttentionShape;

crate::wgsl_struct! {
    /// Mirror of the WGSL `MergeParams` uniform.
    pub struct MergeParams {
        /// Query heads.
        pub num_q_heads: u32,
        /// KV heads.
        pub num_kv_heads: u32,
        /// Bit 0: sinks present.
        pub flags: u32,
        /// Offset of the tiles in the metadata.
        pub tiles_at: u32,
        /// Offset of the sinks.
        pub sinks_at: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
        /// Padding.
        pub _pad2: u32,
    }
}

const WG: u32 = 64;

/// Override constants of the merge kernel for `shape` and the attention plan's `tile` rows.
pub(crate) fn constants(shape: &AttentionShape, tile: usize) -> Vec<(&'static str, f64)> {
    vec![
        ("WG", f64::from(WG)),
        ("GROUP", shape.group() as f64),
        ("TILE", tile as f64),
        ("V_DIM", shape.head_dim_v as f64),
    ]
}

/// Override constants the naga tests validate.
pub fn representative_constants() -> Vec<Vec<(&'static str, f64)>> {
    [(1, 1, 64, 64), (32, 8, 128, 128), (16, 2, 192, 1024)]
        .iter()
        .map(|&(hq, hkv, dk, dv)| {
            let shape = AttentionShape {
                num_q_heads: hq,
                num_kv_heads: hkv,
                head_dim_qk: dk,
                head_dim_v: dv,
            };
            constants(&shape, (hq / hkv).clamp(1, 16))
        })
        .collect()
}
