//! Attention over the paged cache (`shaders/paged.wgsl`, merged by `shaders/merge.wgsl`):
//! decode (`len_q == 1`) and chunked prefill (`len_q >= 1`) in one kernel family.
//!
//! A query row is one (query token, query head). The rows of a sequence that share a KV head
//! are cut into tiles (the whole GQA group of a decode token when it fits workgroup memory; a few
//! tokens times the group for prefill). Each tile's visible key range is cut at fixed token
//! splits ([`SPLIT_TOKENS`], split-K) and where the sequence's blocks change pool buffer (a pool
//! larger than one binding is split over buffers; each buffer is one more split, DESIGN.md
//! section 4). A workgroup computes a partial (o, lse) per row for one (work item, KV head); the
//! merge kernel combines a row's partials in key order and adds the sinks once.
//!
//! Two kernels run the same plan and write the same partial states: `paged.wgsl` (a workgroup
//! per work item and KV head, for GPUs) and `paged_lanes.wgsl` (an invocation per work item and
//! KV head, for CPU-backed adapters, written out per shape by [`super::paged_lanes`]). The
//! context's [`AttentionKernel`] chooses; head dims past the lanes kernel's 256 take the
//! workgroup kernel.
//!
//! Splits depend only on a sequence's own length and block table, never on the rest of the
//! batch, and rows never interact, so a row's output is bitwise the same alone or batched.
//!
//! [`PagedAttentionPlan`] is built once per batch (block tables, work items and their GPU
//! buffers) and [`PagedAttentionPlan::run`] runs per layer.

use super::paged_lanes::{
    columns_per_word4, LanesShape, L_MAX_DIM as LANES_MAX_DIM, L_MAX_ROPE,
    L_MAX_TILE as LANES_MAX_TILE,
};
use super::{AttentionOptions, AttentionShape};
use crate::attention::merge::{merge, MergeArgs, MergeParams};
use crate::cache::allocator::SeqId;
use crate::cache::paged::PagedKvCache;
use crate::cache::pool::PoolLayout;
use crate::gpu::{AttentionKernel, Context};
use crate::pipeline::PipelineKey;
use crate::quant::KvDtype;
use crate::reference::AttentionOutput;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

/// Keys per split-K split. Fixed, so a row's reduction order never depends on the batch.
pub const SPLIT_TOKENS: usize = 512;
/// Invocations per workgroup.
const WG: u32 = 64;
/// Invocations per workgroup of the lanes kernel (one SIMD group of a CPU adapter: 256-bit
/// vectors of f32).
const LANE_WG: u32 = 8;
/// Largest tile of rows (the WGSL `MAX_TILE`).
const MAX_TILE: usize = 16;
/// Output vec4s each invocation accumulates (the WGSL `MAX_ACC`).
const MAX_ACC: usize = 8;
/// Workgroup memory the query tile may take, in bytes.
const Q_TILE_BYTES: usize = 8192;
/// Words of one work item, one sequence record and one merge tile in the metadata buffer.
const ITEM_WORDS: usize = 8;
const SEQ_WORDS: usize = 4;
const TILE_WORDS: usize = 5;

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
fn lanes_constants(set: Vec<(&'static str, f64)>, tile: usize) -> Vec<(&'static str, f64)> {
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
fn lanes_tile(shape: &AttentionShape) -> usize {
    let cols = shape.head_dim_qk.max(shape.head_dim_v).div_ceil(4);
    (LANES_MAX_VALUES / 4 / cols).clamp(1, LANES_MAX_TILE)
}

/// Query (or output) values a lanes-kernel tile holds at most.
const LANES_MAX_VALUES: usize = 512;

/// Whether every row of pools `k` and `v` starts on a 16-byte boundary, so the lanes kernel can
/// read rows as vec4<u32> (their blocks, rows and scale sections are whole multiples of four
/// words).
fn rows_aligned(k: &PoolLayout, v: &PoolLayout) -> bool {
    [k, v]
        .iter()
        .all(|l| l.words_per_row() % 4 == 0 && l.block_words() % 4 == 0)
}

/// Whether the lanes kernel takes this geometry: query and output rows of at most 256 values
/// (an MLA key's RoPE part at most 64).
fn lanes_fit(shape: &AttentionShape, geometry: &KvGeometry) -> bool {
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

/// A batch planned once from its block tables; [`run`](Self::run) per layer.
#[derive(Debug)]
pub struct PagedAttentionPlan {
    shape: AttentionShape,
    precision: Precision,
    /// Rows per tile (the WGSL `TILE`).
    tile: usize,
    /// The kernel the plan runs.
    kernel: AttentionKernel,
    /// The device converts f16 in shaders (`SHADER_F16_IN_F32`).
    f16_in_f32: bool,
    /// Subgroup reductions, chosen at plan time when the device has `SUBGROUP`.
    subgroups: bool,
    geometry: KvGeometry,
    total_q: usize,
    num_items: usize,
    num_tiles: usize,
    /// Per dispatch: pool buffer, items, and its parameters (built once, used by every layer).
    dispatches: Vec<(usize, usize, wgpu::Buffer)>,
    merge_params: wgpu::Buffer,
    meta: wgpu::Buffer,
    o_part: wgpu::Buffer,
    lse_part: wgpu::Buffer,
}

fn check_shape_and_options(
    ctx: &Context,
    shape: &AttentionShape,
    options: &AttentionOptions,
    geometry: &KvGeometry,
    precision: Precision,
) -> Result<()> {
    shape.validate()?;
    options.validate(shape)?;
    let (k, v) = (&geometry.k, &geometry.v);
    k.dtype.check_head_dim(k.head_dim)?;
    v.dtype.check_head_dim(v.head_dim)?;
    let (dims_qk, dims_v) = if geometry.mla {
        (k.head_dim + v.head_dim, k.head_dim)
    } else {
        (k.head_dim, v.head_dim)
    };
    if shape.num_kv_heads != k.num_kv_heads
        || shape.head_dim_qk != dims_qk
        || shape.head_dim_v != dims_v
    {
        return Err(Error::InvalidArgument(format!(
            "shape {shape:?} does not match the cache ({} KV heads, head dims {dims_qk} and \
             {dims_v})",
            k.num_kv_heads
        )));
    }
    if precision == Precision::F16 && !ctx.caps().shader_f16 {
        return Err(Error::MissingFeature("shader-f16"));
    }
    Ok(())
}

impl PagedAttentionPlan {
    /// Plans `args.batch` over `cache`: checks every sequence (known, `1 <= len_q <= len_k`),
    /// cuts the work items and uploads the metadata. Valid for every layer until the block
    /// tables change (the next append, fork, free or swap).
    pub fn new(ctx: &Context, cache: &PagedKvCache, args: &PagedAttentionArgs) -> Result<Self> {
        Self::with_split_tokens(ctx, cache, args, SPLIT_TOKENS)
    }

    /// [`new`](Self::new) with another split-K size (keys per split, at least 1). Keep one value
    /// for a deployment: results are bitwise reproducible only for the same split.
    pub fn with_split_tokens(
        ctx: &Context,
        cache: &PagedKvCache,
        args: &PagedAttentionArgs,
        split_tokens: usize,
    ) -> Result<Self> {
        Self::over_cache(ctx, cache, args, split_tokens, false)
    }

    /// Plans `args.batch` over `cache`, read as an ordinary K/V cache or (`mla`) as MLA's latent
    /// cache (see [`KvGeometry::mla`]).
    pub(crate) fn over_cache(
        ctx: &Context,
        cache: &PagedKvCache,
        args: &PagedAttentionArgs,
        split_tokens: usize,
        mla: bool,
    ) -> Result<Self> {
        let c = cache.config();
        let pools = cache.layer(0)?;
        let geometry = KvGeometry {
            k: c.k_layout(),
            v: c.v_layout(),
            blocks_per_buffer: pools.k.blocks_per_buffer(),
            num_buffers: pools.k.buffers().len(),
            mla,
        };
        if args.batch.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
        let mut seqs = Vec::with_capacity(args.batch.len());
        let mut q_base = 0;
        for query in args.batch {
            let len_k = cache.allocator().len(query.seq)?;
            seqs.push(SeqSpec {
                q_base,
                len_q: query.len_q,
                len_k,
                table: cache.allocator().blocks(query.seq)?.to_vec(),
            });
            q_base += query.len_q;
        }
        Self::from_specs(ctx, args, &geometry, &seqs, split_tokens)
    }

    pub(crate) fn from_specs(
        ctx: &Context,
        args: &PagedAttentionArgs,
        geometry: &KvGeometry,
        seqs: &[SeqSpec],
        split_tokens: usize,
    ) -> Result<Self> {
        if split_tokens == 0 {
            return Err(Error::InvalidArgument(
                "split-K needs at least one key per split".into(),
            ));
        }
        let shape = args.shape;
        let opts = args.options;
        check_shape_and_options(ctx, &shape, opts, geometry, args.precision)?;
        let bs = geometry.k.block_size;
        for (i, s) in seqs.iter().enumerate() {
            super::check_seq_len(&format!("sequence {i}"), s.len_q, s.len_k)?;
            if s.len_q == 0 || s.len_k == 0 {
                return Err(Error::InvalidArgument(format!("sequence {i} is empty")));
            }
            // Without the causal mask the queries need not be the sequence's own tokens (a
            // cascade's shared-prefix pass); ALiBi then has no positions to measure from.
            if s.len_q > s.len_k && (opts.causal || opts.alibi_slopes.is_some()) {
                return Err(Error::InvalidArgument(format!(
                    "sequence {i}: len_q {} > len_k {} needs non-causal attention without ALiBi",
                    s.len_q, s.len_k
                )));
            }
            if s.table.len() * bs < s.len_k {
                return Err(Error::InvalidArgument(format!(
                    "sequence {i}: {} blocks cannot hold {} tokens",
                    s.table.len(),
                    s.len_k
                )));
            }
        }
        let group = shape.group();
        // Tiles no larger than the batch's largest sequence needs (a decode batch's tile is its
        // GQA group). A sequence's tile boundaries stay those of the full tile: one that fits
        // the smaller tile would fit one full tile too, and a larger one means the full tile.
        let max_rows = seqs.iter().map(|s| s.len_q * group).max().unwrap_or(1);
        let kernel = match ctx.caps().attention_kernel {
            AttentionKernel::Lanes if lanes_fit(&shape, geometry) => AttentionKernel::Lanes,
            _ => AttentionKernel::Workgroup,
        };
        let full_tile = match kernel {
            AttentionKernel::Workgroup => tile_rows(&shape, args.precision),
            AttentionKernel::Lanes => lanes_tile(&shape),
        };
        let tile = full_tile.min(max_rows).max(1);
        // A window at least as long as every sequence's keys masks nothing: it is no window.
        // What remains is shorter than a sequence (at most MAX_TOKENS), so it fits a u32 and the
        // kernels' `p - j < window` never meets a wrapped sum.
        let max_len_k = seqs.iter().map(|s| s.len_k).max().unwrap_or(0);
        let window = opts
            .sliding_window
            .filter(|&w| opts.causal && w < max_len_k);
        let bpb = geometry.blocks_per_buffer;

        // Work items in (sequence, tile, key) order; merge tiles point at their run of items.
        let mut items: Vec<[u32; ITEM_WORDS]> = Vec::new();
        let mut item_buffer: Vec<usize> = Vec::new();
        let mut tiles: Vec<[u32; TILE_WORDS]> = Vec::new();
        for (si, s) in seqs.iter().enumerate() {
            let rows = s.len_q * group;
            let mut row0 = 0;
            while row0 < rows {
                let n = tile.min(rows - row0);
                let (lo, hi) = if opts.causal {
                    // Positions of the tile's first and last query.
                    let first_pos = row0 / group + s.len_k - s.len_q;
                    let last_pos = (row0 + n - 1) / group + s.len_k - s.len_q;
                    let lo = window.map_or(0, |w| (first_pos + 1).saturating_sub(w));
                    (lo, last_pos + 1)
                } else {
                    (0, s.len_k)
                };
                let first_item = items.len();
                let mut k0 = lo;
                while k0 < hi {
                    let buffer = s.table[k0 / bs] as usize / bpb;
                    let mut k1 = ((k0 / split_tokens + 1) * split_tokens).min(hi);
                    // End the item where the blocks leave this buffer.
                    let mut k = (k0 / bs + 1) * bs;
                    while k < k1 {
                        if s.table[k / bs] as usize / bpb != buffer {
                            k1 = k;
                            break;
                        }
                        k += bs;
                    }
                    items.push([
                        si as u32,
                        row0 as u32,
                        n as u32,
                        k0 as u32,
                        k1 as u32,
                        0,
                        0,
                        0,
                    ]);
                    item_buffer.push(buffer);
                    k0 = k1;
                }
                tiles.push([
                    s.q_base as u32,
                    row0 as u32,
                    n as u32,
                    first_item as u32,
                    (items.len() - first_item) as u32,
                ]);
                // Rows of a tile are relative to the sequence: q_base locates them.
                row0 += n;
            }
        }

        // Metadata: items, sequences, slopes, sinks, merge tiles, block tables, item lists.
        let mut meta: Vec<u32> = Vec::new();
        let items_at = meta.len();
        meta.extend(items.iter().flatten());
        let seqs_at = meta.len();
        let tables_at = seqs_at + seqs.len() * SEQ_WORDS;
        let mut table_at = tables_at + 2 * shape.num_q_heads + tiles.len() * TILE_WORDS;
        for s in seqs {
            meta.extend([
                s.q_base as u32,
                s.len_q as u32,
                s.len_k as u32,
                table_at as u32,
            ]);
            table_at += s.table.len();
        }
        let slopes_at = meta.len();
        let zeros = vec![0.0f32; shape.num_q_heads];
        meta.extend(
            opts.alibi_slopes
                .as_deref()
                .unwrap_or(&zeros)
                .iter()
                .map(|x| x.to_bits()),
        );
        let sinks_at = meta.len();
        meta.extend(
            opts.sinks
                .as_deref()
                .unwrap_or(&zeros)
                .iter()
                .map(|x| x.to_bits()),
        );
        let tiles_at = meta.len();
        meta.extend(tiles.iter().flatten());
        debug_assert_eq!(
            meta.len(),
            tables_at + 2 * shape.num_q_heads + tiles.len() * TILE_WORDS
        );
        for s in seqs {
            meta.extend(&s.table);
        }
        let max_x = ctx.caps().max_compute_workgroups_per_dimension as usize;
        // Items per dispatch: a workgroup each, or a KV head's invocation each.
        let per_dispatch = match kernel {
            AttentionKernel::Workgroup => max_x,
            AttentionKernel::Lanes => (max_x * LANE_WG as usize / shape.num_kv_heads).max(1),
        };
        let mut dispatches = Vec::new();
        for buffer in 0..geometry.num_buffers {
            let ids: Vec<u32> = (0..items.len())
                .filter(|&i| item_buffer[i] == buffer)
                .map(|i| i as u32)
                .collect();
            for chunk in ids.chunks(per_dispatch) {
                dispatches.push((buffer, meta.len(), chunk.len()));
                meta.extend(chunk);
            }
        }
        if tiles.len() > max_x {
            return Err(Error::InvalidArgument(format!(
                "{} row tiles exceed the adapter's {max_x} workgroups per dimension; split the batch",
                tiles.len()
            )));
        }

        let total_q = seqs.iter().map(|s| s.len_q).sum();
        let hkv = shape.num_kv_heads;
        let part_rows = items.len() * hkv * tile;
        let window = window.map_or(0, |w| w as u32);
        let flags = u32::from(opts.causal) | (u32::from(opts.alibi_slopes.is_some()) << 1);
        let dispatches = dispatches
            .into_iter()
            .map(|(buffer, list_at, list_len)| {
                let params = PagedParams {
                    num_q_heads: shape.num_q_heads as u32,
                    num_kv_heads: hkv as u32,
                    block_size: bs as u32,
                    first_block: (buffer * bpb) as u32,
                    scale: opts.scale_for(&shape),
                    softcap: opts.softcap.unwrap_or(0.0),
                    window,
                    flags,
                    items_at: items_at as u32,
                    seqs_at: seqs_at as u32,
                    slopes_at: slopes_at as u32,
                    list_at: list_at as u32,
                    list_len: list_len as u32,
                    ..Default::default()
                };
                Ok((buffer, list_len, ctx.uniform("paged params", &params)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let merge_params = MergeParams {
            num_q_heads: shape.num_q_heads as u32,
            num_kv_heads: hkv as u32,
            flags: u32::from(opts.sinks.is_some()),
            tiles_at: tiles_at as u32,
            sinks_at: sinks_at as u32,
            ..Default::default()
        };
        let plan = Self {
            shape,
            precision: args.precision,
            tile,
            kernel,
            f16_in_f32: ctx.caps().f16_in_f32,
            subgroups: ctx.caps().subgroups,
            geometry: *geometry,
            total_q,
            num_items: items.len(),
            num_tiles: tiles.len(),
            dispatches,
            merge_params: ctx.uniform("merge params", &merge_params)?,
            meta: ctx.upload("attention plan", &meta)?,
            o_part: ctx.filled(
                "partial o",
                part_rows * shape.head_dim_v,
                crate::gpu::UNWRITTEN,
            )?,
            lse_part: ctx.filled("partial lse", part_rows, crate::gpu::UNWRITTEN)?,
        };
        Ok(plan)
    }

    /// Query rows (tokens) of the batch.
    pub fn total_q(&self) -> usize {
        self.total_q
    }

    /// The kernel the plan runs (the context's choice, or the workgroup kernel for head dims
    /// the lanes kernel does not take).
    pub fn kernel(&self) -> AttentionKernel {
        self.kernel
    }

    /// Work items (partial states per KV head) the plan cut.
    pub fn num_items(&self) -> usize {
        self.num_items
    }

    fn pipeline_key(&self, kernel: Kernel) -> PipelineKey {
        let precision = if kernel == Kernel::Merge {
            Precision::F32
        } else {
            self.precision
        };
        let attention = || {
            constants(
                &self.shape,
                self.tile,
                &self.geometry.k,
                &self.geometry.v,
                self.geometry.mla,
            )
        };
        let constants = match kernel {
            Kernel::Merge => crate::attention::merge::constants(&self.shape, self.tile),
            Kernel::PagedLanes => lanes_constants(attention(), self.tile),
            _ => attention(),
        };
        let subgroups = self.subgroups && kernel.has_subgroup_variant();
        let variant = match kernel {
            Kernel::PagedLanes => ShaderVariant::lanes(precision, self.lanes_shape()),
            _ => ShaderVariant {
                subgroups,
                ..ShaderVariant::new(kernel, precision)
            },
        };
        PipelineKey::new(variant, &constants)
    }

    /// What the lanes kernel is written out for in this plan.
    fn lanes_shape(&self) -> LanesShape {
        let (k, v) = (&self.geometry.k, &self.geometry.v);
        let mla = self.geometry.mla;
        LanesShape {
            tile: self.tile as u16,
            k_cols: (k.head_dim / 4) as u16,
            rope_cols: if mla { (v.head_dim / 4) as u16 } else { 0 },
            out_cols: (self.shape.head_dim_v / 4) as u16,
            k_qpw: columns_per_word4(k.dtype),
            v_qpw: columns_per_word4(if mla { k.dtype } else { v.dtype }),
            wide: rows_aligned(k, v),
            f16_convert: self.f16_in_f32,
        }
    }

    /// Runs the batch on one layer's pools: `pools[b]` is the (K, V) buffer pair `b`, `scales`
    /// the K and V pools' [`TensorScale`](crate::cache::pool::TensorScale) uniforms. `q` is
    /// `[total_q, Hq, d_qk]` f32; writes `out` `[total_q, Hq, d_v]` and `lse` `[total_q, Hq]`.
    pub(crate) fn run_on(
        &self,
        ctx: &Context,
        pools: &[(&wgpu::Buffer, &wgpu::Buffer)],
        scales: (&wgpu::Buffer, &wgpu::Buffer),
        q: &wgpu::Buffer,
        out: &wgpu::Buffer,
        lse: &wgpu::Buffer,
    ) -> Result<()> {
        let s = &self.shape;
        let need = |what: &str, buffer: &wgpu::Buffer, elems: usize| -> Result<()> {
            let bytes = (elems * 4) as u64;
            if buffer.size() < bytes {
                return Err(Error::InvalidArgument(format!(
                    "{what} buffer holds {} bytes, the batch needs {bytes}",
                    buffer.size()
                )));
            }
            Ok(())
        };
        need("q", q, self.total_q * s.num_q_heads * s.head_dim_qk)?;
        need("out", out, self.total_q * s.num_q_heads * s.head_dim_v)?;
        need("lse", lse, self.total_q * s.num_q_heads)?;
        if pools.len() != self.geometry.num_buffers {
            return Err(Error::InvalidArgument(format!(
                "{} pool buffers given, the plan was made for {}",
                pools.len(),
                self.geometry.num_buffers
            )));
        }
        for (buffer, &pair) in pools.iter().enumerate() {
            self.attend_buffer(ctx, buffer, pair, scales, q)?;
        }
        self.merge_into(ctx, out, lse)
    }

    /// The work items whose keys lie in pool buffer `buffer`, bound as `pools` (K, V): their
    /// partial states, for [`merge_into`](Self::merge_into) once every buffer is done. The
    /// buffers' contents need to stay only until this call is submitted, so one scratch pair can
    /// serve every buffer in turn. `q` must hold the batch (callers check its size).
    pub(crate) fn attend_buffer(
        &self,
        ctx: &Context,
        buffer: usize,
        pools: (&wgpu::Buffer, &wgpu::Buffer),
        scales: (&wgpu::Buffer, &wgpu::Buffer),
        q: &wgpu::Buffer,
    ) -> Result<()> {
        let (kernel, per_item) = match self.kernel {
            AttentionKernel::Workgroup => (Kernel::Paged, None),
            AttentionKernel::Lanes => (Kernel::PagedLanes, Some(self.shape.num_kv_heads)),
        };
        let pipeline = ctx.pipeline(&self.pipeline_key(kernel))?;
        for (b, list_len, uniform) in &self.dispatches {
            if *b != buffer {
                continue;
            }
            let grid = match per_item {
                None => [*list_len as u32, self.shape.num_kv_heads as u32, 1],
                Some(heads) => [(*list_len * heads).div_ceil(LANE_WG as usize) as u32, 1, 1],
            };
            let mut buffers = vec![
                uniform,
                q,
                pools.0,
                pools.1,
                &self.meta,
                &self.o_part,
                &self.lse_part,
                scales.0,
                scales.1,
            ];
            if per_item.is_some() && self.lanes_shape().wide {
                // The lanes kernel's vec4 views of the same pools.
                buffers.extend([pools.0, pools.1]);
            }
            ctx.dispatch(&pipeline, &buffers, grid)?;
        }
        Ok(())
    }

    /// Merges every item's partial state into `out` and `lse` (sizes checked by the caller).
    pub(crate) fn merge_into(
        &self,
        ctx: &Context,
        out: &wgpu::Buffer,
        lse: &wgpu::Buffer,
    ) -> Result<()> {
        let s = &self.shape;
        let merge_pipeline = ctx.pipeline(&self.pipeline_key(Kernel::Merge))?;
        merge(
            ctx,
            &MergeArgs {
                pipeline: &merge_pipeline,
                params: &self.merge_params,
                num_tiles: self.num_tiles,
                num_kv_heads: s.num_kv_heads,
                meta: &self.meta,
                o_part: &self.o_part,
                lse_part: &self.lse_part,
                out,
                lse,
            },
        )
    }

    /// Runs the batch on `layer` of `cache` (the cache the plan was made from).
    pub fn run(
        &self,
        ctx: &Context,
        cache: &PagedKvCache,
        layer: usize,
        q: &wgpu::Buffer,
        out: &wgpu::Buffer,
        lse: &wgpu::Buffer,
    ) -> Result<()> {
        let pools = cache.layer(layer)?;
        let pairs: Vec<_> = pools.k.buffers().iter().zip(pools.v.buffers()).collect();
        let scales = (pools.k.scale_uniform(), pools.v.scale_uniform());
        self.run_on(ctx, &pairs, scales, q, out, lse)
    }
}

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
