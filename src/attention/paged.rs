//! Attention over the paged cache (`shaders/paged.wgsl`, merged by `shaders/merge.wgsl`):
//! decode (`len_q == 1`) and chunked prefill (`len_q >= 1`) in one kernel family.
//!
//! A query row is one (query token, query head). The rows of a sequence that share a KV head
//! are cut into tiles (the whole GQA group of a decode token when it fits workgroup memory; a few
//! tokens times the group for prefill). Each tile's visible key range is cut at fixed token
//! splits ([`SPLIT_TOKENS`], split-K) and where the sequence's blocks change pool buffer (a pool
//! larger than one binding is split over buffers; each buffer is one more split, ARCHITECTURE.md
//! section 5). A workgroup computes a partial (o, lse) per row for one (work item, KV head); the
//! merge kernel combines a row's partials in key order and adds the sinks once.
//!
//! Two kernels run the same plan and write the same partial states: `paged.wgsl` (a workgroup
//! per work item and KV head, for GPUs) and `paged_lanes.wgsl` (an invocation per work item and
//! KV head, for CPU-backed adapters, written out per shape by [`super::paged_lanes`]). The
//! context's [`AttentionKernel`](crate::gpu::AttentionKernel) chooses; head dims past the lanes kernel's 256 take the
//! workgroup kernel.
//!
//! Splits depend only on a sequence's own length and block table, never on the rest of the
//! batch, and rows never interact, so a row's output is bitwise the same alone or batched.
//!
//! [`PagedAttentionPlan`] is built once per batch ([`PagedAttentionPlan::new`]) or once for a
//! [`PlanCapacity`] and updated per step ([`PagedAttentionPlan::with_capacity`],
//! [`PagedAttentionPlan::update`]); [`PagedAttentionPlan::encode`] records it per layer into a
//! caller's compute pass, and [`PagedAttentionPlan::run`] records and submits.

use super::paged_lanes::{
    columns_per_word4, LanesShape, L_MAX_DIM as LANES_MAX_DIM, L_MAX_ROPE,
    L_MAX_TILE as LANES_MAX_TILE,
};
use super::{AttentionOptions, AttentionShape};
use crate::cache::allocator::SeqId;
use crate::cache::paged::PagedKvCache;
use crate::cache::pool::PoolLayout;
use crate::gpu::Context;
use crate::quant::KvDtype;
use crate::reference::AttentionOutput;
use crate::shader::Precision;
use crate::{Error, Result};

/// Keys per split-K split. Fixed, so a row's reduction order never depends on the batch.
pub const SPLIT_TOKENS: usize = 512;
/// Invocations per workgroup.
const WG: u32 = 64;
/// Invocations per workgroup of the lanes kernel (one SIMD group of a CPU adapter: 256-bit
/// vectors of f32).
pub(super) const LANE_WG: u32 = 8;
/// Largest tile of rows (the WGSL `MAX_TILE`).
const MAX_TILE: usize = 16;
/// Output vec4s each invocation accumulates (the WGSL `MAX_ACC`).
const MAX_ACC: usize = 8;
/// Workgroup memory the query tile may take, in bytes.
const Q_TILE_BYTES: usize = 8192;
/// Words of one work item, one sequence record and one merge tile in the metadata buffer.
pub(super) const ITEM_WORDS: usize = 8;
pub(super) const SEQ_WORDS: usize = 4;
pub(super) const TILE_WORDS: usize = 5;

crate::wgsl_struct! {
    /// Mirror of the WGSL `PagedParams` uniform.
    pub struct PagedParams {
        /// Query heads.
        pub num_q_heads: u32,
        /// KV heads.
        pub num_kv_heads: u32,
        /// Token slots per block.
        pub block_size: u32,
        /// First global block of the bound pool buffer.
        pub first_block: u32,
        /// Score scale.
        pub scale: f32,
        /// Logit softcap, 0 for none.
        pub softcap: f32,
        /// Sliding window, 0 for none.
        pub window: u32,
        /// Bit 0: causal, bit 1: ALiBi.
        pub flags: u32,
        /// Offset of the work items in the metadata.
        pub items_at: u32,
        /// Offset of the sequence records.
        pub seqs_at: u32,
        /// Offset of the ALiBi slopes.
        pub slopes_at: u32,
        /// Offset of this dispatch's item list.
        pub list_at: u32,
        /// Items in this dispatch.
        pub list_len: u32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
        /// Padding.
        pub _pad2: u32,
    }
}

/// Rows per tile for `shape` in `precision`: as many as fit the query-tile memory budget and the
/// invocations' accumulators, at most 16. Depends on the shape alone.
pub fn tile_rows(shape: &AttentionShape, precision: Precision) -> usize {
    let bytes = match precision {
        Precision::F32 => 4,
        Precision::F16 => 2,
    };
    let by_memory = Q_TILE_BYTES / (shape.head_dim_qk * bytes);
    // The kernel's accumulator layout: columns (vec4) per invocation and lanes per column.
    let dv4 = shape.head_dim_v / 4;
    let cols = dv4.div_ceil(WG as usize);
    let lanes = (WG as usize / dv4).max(1);
    let by_acc = lanes * (MAX_ACC / cols);
    MAX_TILE.min(by_memory).min(by_acc).max(1)
}

/// Override constants of the attention kernel with tiles of `tile` rows over pools of layouts `k`
/// and `v` (for MLA, `latent` and the RoPE keys: see [`KvGeometry::mla`]).
pub(crate) fn constants(
    shape: &AttentionShape,
    tile: usize,
    k: &PoolLayout,
    v: &PoolLayout,
    mla: bool,
) -> Vec<(&'static str, f64)> {
    vec![
        ("WG", f64::from(WG)),
        ("GROUP", shape.group() as f64),
        ("TILE", tile as f64),
        ("K_DIM", k.head_dim as f64),
        ("V_DIM", v.head_dim as f64),
        ("ROPE_DIM", if mla { v.head_dim as f64 } else { 0.0 }),
        ("OUT_DIM", shape.head_dim_v as f64),
        ("K_DTYPE", f64::from(k.dtype.code())),
        ("V_DTYPE", f64::from(v.dtype.code())),
        (
            "K_SCALE_PER_TENSOR",
            f64::from(u8::from(k.per_tensor_scale())),
        ),
        (
            "V_SCALE_PER_TENSOR",
            f64::from(u8::from(v.per_tensor_scale())),
        ),
        ("KV_BLOCK_ROWS", k.block_rows() as f64),
    ]
}

/// Override constants the naga tests validate: small and large heads, MHA, GQA, MQA, d_v != d_qk.
pub fn representative_constants(precision: Precision) -> Vec<Vec<(&'static str, f64)>> {
    let shapes = [
        (1, 1, 64, 64),
        (32, 8, 128, 128),
        (32, 1, 256, 256),
        (8, 1, 80, 96),
        (16, 2, 192, 128),
        (16, 1, 1024, 1024),
    ];
    // (K dtype, V dtype, per-tensor FP8 scales), cycled over the shapes.
    let dtypes = [
        (KvDtype::F32, KvDtype::F32, false),
        (KvDtype::F16, KvDtype::F16, false),
        (KvDtype::Bf16, KvDtype::Bf16, false),
        (KvDtype::Fp8E4M3, KvDtype::Fp8E5M2, true),
        (KvDtype::Int8, KvDtype::Int4, false),
        (KvDtype::Fp8E5M2, KvDtype::Int8, false),
    ];
    let mut sets = Vec::new();
    for (i, &(hq, hkv, dk, dv)) in shapes.iter().enumerate() {
        let shape = AttentionShape {
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim_qk: dk,
            head_dim_v: dv,
        };
        for j in [i, i + 3] {
            let (k, v, per_tensor) = dtypes[j % dtypes.len()];
            let layout = |dtype: KvDtype, head_dim| PoolLayout {
                num_kv_heads: hkv,
                head_dim,
                dtype,
                block_size: 16,
                scale: if per_tensor {
                    crate::quant::ScaleMode::PerTensor(0.5)
                } else {
                    crate::quant::ScaleMode::PerRow
                },
            };
            let tile = tile_rows(&shape, precision);
            sets.push(constants(
                &shape,
                tile,
                &layout(k, dk),
                &layout(v, dv),
                false,
            ));
        }
    }
    // MLA, absorbed: DeepSeek-V2's latent (512, FP8 per tensor and int4) with a 64-dim RoPE key,
    // and a small latent.
    for (heads, rank, rope, latent) in [
        (128, 512, 64, KvDtype::Fp8E4M3),
        (128, 512, 64, KvDtype::Int4),
        (5, 32, 8, KvDtype::F16),
    ] {
        let shape = AttentionShape {
            num_q_heads: heads,
            num_kv_heads: 1,
            head_dim_qk: rank + rope,
            head_dim_v: rank,
        };
        let k = PoolLayout {
            num_kv_heads: 1,
            head_dim: rank,
            dtype: latent,
            block_size: 64,
            scale: if latent.fp8_format().is_some() {
                crate::quant::ScaleMode::PerTensor(0.5)
            } else {
                crate::quant::ScaleMode::PerRow
            },
        };
        let v = PoolLayout {
            head_dim: rope,
            dtype: KvDtype::Bf16,
            scale: crate::quant::ScaleMode::PerRow,
            ..k
        };
        sets.push(constants(
            &shape,
            tile_rows(&shape, precision),
            &k,
            &v,
            true,
        ));
    }
    sets
}

/// Shapes and override constants the naga tests validate for the lanes kernel: the workgroup
/// kernel's sets whose head dims it takes, with its own tile sizes, read wide and not.
fn lanes_representative(precision: Precision) -> Vec<(LanesShape, Vec<(&'static str, f64)>)> {
    let dtype = |code: f64| {
        KvDtype::ALL
            .into_iter()
            .find(|d| f64::from(d.code()) == code)
            .unwrap_or(KvDtype::F32)
    };
    representative_constants(precision)
        .into_iter()
        .filter(|set| {
            let get = |name| set.iter().find(|(n, _)| *n == name).map_or(0.0, |c| c.1);
            get("K_DIM") + get("ROPE_DIM") <= LANES_MAX_DIM as f64
                && get("OUT_DIM") <= LANES_MAX_DIM as f64
                && get("ROPE_DIM") <= L_MAX_ROPE as f64
        })
        .enumerate()
        .map(|(i, set)| {
            let get = |name| set.iter().find(|(n, _)| *n == name).map_or(0.0, |c| c.1);
            let rope = get("ROPE_DIM") as u16 / 4;
            let cols = (get("K_DIM") + get("ROPE_DIM")).max(get("OUT_DIM")) as usize / 4;
            let tile = (LANES_MAX_VALUES / 4 / cols).clamp(1, LANES_MAX_TILE);
            let shape = LanesShape {
                tile: (get("GROUP") as u16).min(tile as u16),
                k_cols: get("K_DIM") as u16 / 4,
                rope_cols: rope,
                out_cols: get("OUT_DIM") as u16 / 4,
                k_qpw: columns_per_word4(dtype(get("K_DTYPE"))),
                v_qpw: columns_per_word4(dtype(if rope > 0 {
                    get("K_DTYPE")
                } else {
                    get("V_DTYPE")
                })),
                wide: i % 2 == 0,
                f16_convert: i % 4 == 0,
            };
            (shape, lanes_constants(set, usize::from(shape.tile)))
        })
        .collect()
}

/// The lanes kernel shapes the naga tests build.
pub fn lanes_representative_shapes(precision: Precision) -> Vec<LanesShape> {
    lanes_representative(precision)
        .into_iter()
        .map(|(shape, _)| shape)
        .collect()
}

/// The override constants the naga tests use with the lanes kernel written out for `shape`.
pub fn lanes_constants_for(
    shape: LanesShape,
    precision: Precision,
) -> Option<Vec<(&'static str, f64)>> {
    lanes_representative(precision)
        .into_iter()
        .find(|(s, _)| *s == shape)
        .map(|(_, set)| set)
}

/// The lanes kernel's constants from the workgroup kernel's: its own workgroup size and tile.
pub(super) fn lanes_constants(
    set: Vec<(&'static str, f64)>,
    tile: usize,
) -> Vec<(&'static str, f64)> {
    set.into_iter()
        .map(|(name, value)| match name {
            "WG" => ("LANE_WG", f64::from(LANE_WG)),
            "TILE" => ("TILE", tile as f64),
            _ => (name, value),
        })
        .collect()
}

/// Rows per tile of the lanes kernel: at most 8, and at most 512 query or output values per
/// row set (tile x vec4 columns <= 128), which keeps the written-out kernel small enough for a
/// CPU adapter's compiler (lavapipe: about 0.5 s at 4 rows of 128 dims, 27 s at 8 rows, 106 s
/// at 8 rows of 256).
pub(super) fn lanes_tile(shape: &AttentionShape) -> usize {
    let cols = shape.head_dim_qk.max(shape.head_dim_v).div_ceil(4);
    (LANES_MAX_VALUES / 4 / cols).clamp(1, LANES_MAX_TILE)
}

/// Query (or output) values a lanes-kernel tile holds at most.
const LANES_MAX_VALUES: usize = 512;

/// Whether every row of pools `k` and `v` starts on a 16-byte boundary, so the lanes kernel can
/// read rows as vec4<u32> (their blocks, rows and scale sections are whole multiples of four
/// words).
pub(super) fn rows_aligned(k: &PoolLayout, v: &PoolLayout) -> bool {
    [k, v]
        .iter()
        .all(|l| l.words_per_row() % 4 == 0 && l.block_words() % 4 == 0)
}

/// Whether the lanes kernel takes this geometry: query and output rows of at most 256 values
/// (an MLA key's RoPE part at most 64).
pub(super) fn lanes_fit(shape: &AttentionShape, geometry: &KvGeometry) -> bool {
    shape.head_dim_qk <= LANES_MAX_DIM
        && shape.head_dim_v <= LANES_MAX_DIM
        && (!geometry.mla || geometry.v.head_dim <= L_MAX_ROPE)
}

/// Storage formats the attention kernels read: every [`KvDtype`].
pub const SUPPORTED: [KvDtype; 7] = KvDtype::ALL;

/// One sequence of a batch: its queries are its last `len_q` cached tokens (bottom-right
/// alignment: `len_k` is the sequence's length in the cache, so append the chunk's K/V first).
/// Without the causal mask (and ALiBi) `len_q` may exceed `len_k`: the queries then simply
/// attend to every cached token, as the shared-prefix pass of cascade attention does (merge its
/// state with the per-sequence pass by [`merge_states`](super::merge_states::merge_states)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedQuery {
    /// The sequence.
    pub seq: SeqId,
    /// Query tokens of this sequence in the batch (1 for decode).
    pub len_q: usize,
}

/// What to compute: which layer, which sequences, the shape and options, the kernel variant.
#[derive(Debug, Clone, Copy)]
pub struct PagedAttentionArgs<'a> {
    /// Layer of the cache to attend over.
    pub layer: usize,
    /// The sequences and their query counts, in the order of the query rows.
    pub batch: &'a [PagedQuery],
    /// Heads and head dims (KV heads and dims must match the cache).
    pub shape: AttentionShape,
    /// Mask and score options.
    pub options: &'a AttentionOptions,
    /// Kernel variant; [`Precision::F16`] needs `SHADER_F16`.
    pub precision: Precision,
}

/// A sequence as the planner sees it: where its queries start, its lengths, its block table.
#[derive(Debug, Clone)]
pub(crate) struct SeqSpec {
    pub q_base: usize,
    pub len_q: usize,
    pub len_k: usize,
    pub table: Vec<u32>,
}

/// Everything about the KV storage the planner and the kernel need.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvGeometry {
    pub k: PoolLayout,
    pub v: PoolLayout,
    /// Blocks per pool buffer (the same for K and V).
    pub blocks_per_buffer: usize,
    pub num_buffers: usize,
    /// MLA's latent cache: the K pool holds the latent `c_kv`, the V pool the RoPE keys `k_pe`;
    /// a key is `[c_kv ; k_pe]` and a value is `c_kv` (query dims `rank + d_rope`, output dims
    /// `rank`).
    pub mla: bool,
}

pub use super::paged_plan::{AttentionIo, PagedAttentionPlan, PlanCapacity, PlanSpec};

/// Runs attention over `cache` with host queries `q` (`[total_q, Hq, d_qk]`, rows in batch
/// order) and reads `out` (`[total_q, Hq, d_v]`) and `lse` (`[total_q, Hq]`) back.
pub fn paged_attention_host(
    ctx: &Context,
    cache: &PagedKvCache,
    args: &PagedAttentionArgs,
    q: &[f32],
) -> Result<AttentionOutput> {
    let plan = PagedAttentionPlan::new(ctx, cache, args)?;
    let s = &args.shape;
    let rows = plan.total_q() * s.num_q_heads;
    if q.len() != rows * s.head_dim_qk {
        return Err(Error::ShapeMismatch {
            what: "q",
            expected: rows * s.head_dim_qk,
            got: q.len(),
        });
    }
    let qb = ctx.upload("q", q)?;
    let out = ctx.filled("out", rows * s.head_dim_v, crate::gpu::UNWRITTEN)?;
    let lse = ctx.filled("lse", rows, crate::gpu::UNWRITTEN)?;
    plan.run(ctx, cache, args.layer, &qb, &out, &lse)?;
    Ok(AttentionOutput {
        out: ctx.read_back(&out, rows * s.head_dim_v)?,
        lse: ctx.read_back(&lse, rows)?,
    })
}
