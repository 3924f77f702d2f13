//! Attention over the paged cache (`shaders/paged.wgsl`, merged by `shaders/merge.wgsl`):
//! decode (`len_q == 1`) and chunked prefill (`len_q >= 1`) in one kernel family.
//!
//! A query row is one (query token, query head). The rows of a sequence that share a KV head
//! are cut into tiles (the whole GQA group of a decode token when it fits workgroup memory; a few
//! tokens times the group for prefill). Each tile's visible key range is cut at fixed token
//! splits ([`SPLIT_TOKENS`], split-K). A pool larger than one binding is split over buffers: the
//! workgroup kernel binds as many of them whole as the device's storage bindings allow
//! ([`DeviceFit::pool_slots`], at most [`MAX_POOL_SLOTS`]); otherwise a split is also cut where
//! the sequence's blocks change buffer (ARCHITECTURE.md section 5). A workgroup computes a partial (o, lse) per row for one (work item, KV head); the
//! merge kernel combines a row's partials in key order and adds the sinks once.
//!
//! Two kernels run the same plan and write the same partial states: `paged.wgsl` (a workgroup
//! per work item and KV head, for GPUs, laid out by [`WorkgroupLayout`]) and `paged_lanes.wgsl` (an invocation per work item and
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
/// Invocations per workgroup of the lanes kernel (one SIMD group of a CPU adapter: 256-bit
/// vectors of f32).
pub(super) const LANE_WG: u32 = 8;
/// Largest tile of rows (the WGSL `MAX_TILE`).
const MAX_TILE: usize = 16;
/// Query and accumulator vec4s one invocation of the workgroup kernel holds at most on a GPU
/// (the WGSL `MAX_QREG` and `MAX_AREG` of its loop form; a CPU adapter may take more, see
/// [`CPU_TILE`]).
const MAX_QREG: usize = 32;
const MAX_AREG: usize = 32;
/// Rows a tile of the workgroup kernel may reach on a CPU adapter whatever its rows' registers
/// ([`DeviceFit::cpu`]): there the private arrays are memory, and the cost per (row, key) is
/// the words of the key's K and V rows loaded per tile, so a row as long as MLA's latent (576
/// values) takes tiles of 8 heads rather than the 1 the register budget allows a GPU.
const CPU_TILE: usize = 8;
/// The register budget of a CPU adapter, in query (and accumulator) vec4s an invocation: twice a
/// GPU's, so that rows of up to 4 vec4s a lane (head dim 128 in f16 or 8-bit formats, on 8
/// lanes) take tiles of 16 rather than 8. On lavapipe that took prefill of 512 queries after
/// 4,096 keys from 2.76 to 2.41 s, while MLA's heads (18 query vec4s a lane) were slower in
/// tiles of 16 than of 8 (145 against 136 ms): past [`CPU_TILE`] the budget decides.
const CPU_REGS: usize = 2 * MAX_QREG;
/// Rows a tile of the workgroup kernel takes at most on a CPU adapter without subgroup shuffles
/// (llvmpipe's GL): there every exchange between lanes is a workgroup barrier, which llvmpipe
/// compiles as a coroutine suspend whose frame holds every row's state, so compiling a variant
/// grows fast with its rows. On GL llvmpipe (2026-12-06, head dim 16, f32) a tile of 16 rows
/// took 60 s to compile and one of 4 rows 12 s; one row takes about 10 s. The bits do not depend
/// on the tile.
const CPU_PORTABLE_TILE: usize = 4;
/// Most lanes sharing a key row.
const MAX_KEY_LANES: u32 = 32;
/// Pool buffers (K and V each) one dispatch of an attention kernel binds at most: a pool over
/// at most [`DeviceFit::pool_slots`] buffers (this many where the device allows it) is read
/// whole by every dispatch, so splits never depend on which buffer holds a block.
pub const MAX_POOL_SLOTS: usize = 8;
/// Storage buffers of either attention kernel besides its pools (queries, the plan, the
/// partial outputs and log-sum-exps).
pub const OTHER_STORAGE_BUFFERS: usize = 4;
/// Invocations per workgroup the workgroup kernel asks for at most.
const MAX_WG: u32 = 256;
/// Lane groups per workgroup at most: the groups combine one after the other at the end, and
/// a 512-key split gives each of 8 groups 64 keys, enough to outweigh that.
const MAX_GROUPS: u32 = 8;
/// Invocations of a narrow workgroup ([`DeviceFit::narrow`]): one SIMD vector of a CPU adapter,
/// as the lanes kernel's workgroup; a lane group wider than that takes one workgroup alone.
const NARROW_WG: u32 = LANE_WG;
/// Words of one work item, one sequence record and one merge tile in the metadata buffer.
pub(super) const ITEM_WORDS: usize = 8;
pub(super) const SEQ_WORDS: usize = 4;
pub(super) const TILE_WORDS: usize = 5;

/// What the workgroup kernel's layout depends on besides the shape: the device's subgroups and
/// limits, and an optional forced lane count ([`crate::gpu::ContextOptions::key_lanes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceFit {
    /// Subgroup shuffles may be used (`SUBGROUP`, and not DX12, whose packing of invocations
    /// into subgroups is not promised).
    pub shuffles: bool,
    /// Smallest subgroup size of the adapter.
    pub subgroup_min_size: u32,
    /// Invocations per workgroup the device allows.
    pub max_invocations: u32,
    /// Workgroup memory per workgroup, in bytes.
    pub workgroup_storage: u32,
    /// Storage buffers one shader stage may bind.
    pub storage_buffers: u32,
    /// Lanes per key forced by the caller (a power of two, 1 to 32).
    pub key_lanes: Option<u32>,
    /// The adapter runs on the CPU ([`crate::gpu::Capabilities::cpu_adapter`]): tiles may
    /// reach 8 rows past the register budget, and take at most 4 without shuffles
    /// (`CPU_PORTABLE_TILE`).
    pub cpu: bool,
    /// Keys two at a time where the tile allows ([`crate::gpu::Capabilities::key_pairs`]).
    pub pairs: bool,
    /// Two one-key steps a pass ([`crate::gpu::Capabilities::step_pairs`]).
    pub step_pairs: bool,
    /// Workgroups of one lane group, or of as many as fill 8 invocations (`NARROW_WG`)
    /// ([`crate::gpu::Capabilities::narrow_workgroups`]), rather than up to 8 groups
    /// (`MAX_GROUPS`).
    pub narrow: bool,
}

impl DeviceFit {
    /// WebGPU's default limits, no subgroups: what every adapter offers.
    pub const BASELINE: DeviceFit = DeviceFit {
        shuffles: false,
        subgroup_min_size: 0,
        max_invocations: 256,
        workgroup_storage: 16384,
        storage_buffers: 8,
        key_lanes: None,
        cpu: false,
        pairs: true,
        step_pairs: false,
        narrow: false,
    };

    /// The fit of `ctx`'s device.
    pub fn of(ctx: &Context) -> DeviceFit {
        let caps = ctx.caps();
        DeviceFit {
            shuffles: caps.subgroups && ctx.adapter().backend != "dx12",
            subgroup_min_size: caps.subgroup_min_size,
            max_invocations: caps.max_compute_invocations_per_workgroup,
            workgroup_storage: caps.max_compute_workgroup_storage_size,
            storage_buffers: caps.max_storage_buffers_per_shader_stage,
            key_lanes: caps.key_lanes,
            cpu: caps.cpu_adapter,
            pairs: caps.key_pairs,
            step_pairs: caps.step_pairs,
            narrow: caps.narrow_workgroups,
        }
    }

    /// Pool buffers (K and V each) one dispatch of an attention kernel binds at most, with
    /// `views` storage bindings per buffer and pool (1, or 2 for the lanes kernel's wide
    /// shapes, which also bind vec4 views): what the storage bindings left by the kernel's
    /// other [`OTHER_STORAGE_BUFFERS`] allow, from 1 to [`MAX_POOL_SLOTS`] (the workgroup
    /// kernel: 2 under WebGPU's default 8).
    pub fn pool_slots(&self, views: usize) -> usize {
        ((self.storage_buffers as usize).saturating_sub(OTHER_STORAGE_BUFFERS) / (2 * views.max(1)))
            .clamp(1, MAX_POOL_SLOTS)
    }
}

/// How the workgroup kernel (`paged.wgsl`) is laid out for one geometry on one device: lanes
/// per key row, invocations, 16-byte chunks of each row, the largest tile of rows. Depends on
/// the shape, the storage formats and the device alone, never on the batch, so the partition
/// of a row's keys over the lane groups is the same in every plan (decode or prefill).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkgroupLayout {
    /// Invocations per workgroup.
    pub wg: u32,
    /// Lanes sharing one key row.
    pub key_lanes: u32,
    /// Keys a lane group takes per step, each scored by one of its lanes (`key_lanes`), or 1
    /// for MLA, whose values are the latent chunks every lane read for the key's dot products.
    pub key_step: u32,
    /// The lane groups sum with subgroup shuffles (else through workgroup memory).
    pub subgroups: bool,
    /// Rows are read as `vec4<u32>`.
    pub wide: bool,
    /// 16-byte chunks of a K row, a value row and an MLA RoPE key.
    pub chunks: [u32; 3],
    /// vec4 columns per chunk of each.
    pub columns: [u32; 3],
    /// The largest tile of rows the registers and workgroup memory take.
    pub full_tile: usize,
    /// A step's keys are taken two at a time where the tile allows (`PAIRS`; the kernel does so
    /// for tiles of at most 4 rows without int4, `PAIRED`). The bits are the same either way.
    pub pairs: bool,
    /// Where a step is one key (`key_step` 1), two steps a pass (`STEP_PAIRS`): both keys'
    /// rows loaded together, each query and accumulator value read once for both, every value
    /// meeting the same operations in the same order. The bits are the same either way.
    pub step_pairs: bool,
}

impl WorkgroupLayout {
    /// The layout for `shape` over `geometry` on a device of `fit`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a forced lane count that is not a power of two from 1 to
    /// 32 or whose rows do not fit one invocation's registers; [`Error::TooLarge`] when even a
    /// tile of one row needs more workgroup memory than the device has.
    pub(crate) fn new(
        shape: &AttentionShape,
        geometry: &KvGeometry,
        fit: &DeviceFit,
    ) -> Result<Self> {
        let (k, v) = (&geometry.k, &geometry.v);
        let value = if geometry.mla { k } else { v };
        let chunks = [
            k.words_per_row().div_ceil(4) as u32,
            value.words_per_row().div_ceil(4) as u32,
            if geometry.mla {
                v.words_per_row().div_ceil(4) as u32
            } else {
                0
            },
        ];
        let columns = [
            u32::from(columns_per_word4(k.dtype)),
            u32::from(columns_per_word4(value.dtype)),
            u32::from(columns_per_word4(v.dtype)),
        ];
        let regs = |lanes: u32| {
            let per = |i: usize| (chunks[i].div_ceil(lanes) * columns[i]) as usize;
            (per(0) + per(2), per(1))
        };
        let fits = |lanes: u32| {
            let (q, a) = regs(lanes);
            q <= MAX_QREG && a <= MAX_AREG
        };
        let natural = chunks[0]
            .max(chunks[1])
            .max(1)
            .next_power_of_two()
            .min(MAX_KEY_LANES);
        let sg = fit.subgroup_min_size;
        let (key_lanes, subgroups) = match fit.key_lanes {
            Some(l) => {
                if !l.is_power_of_two() || l > MAX_KEY_LANES {
                    return Err(Error::InvalidArgument(format!(
                        "key_lanes {l}: a power of two from 1 to {MAX_KEY_LANES}"
                    )));
                }
                if !fits(l) {
                    return Err(Error::InvalidArgument(format!(
                        "key_lanes {l}: a row of {shape:?} does not fit one invocation's \
                         registers with so few lanes"
                    )));
                }
                (l, fit.shuffles && l <= sg)
            }
            // Shuffles where a subgroup holds a whole lane group; fewer lanes (more chunks
            // each) rather than the portable path, as long as the registers take it.
            None if fit.shuffles && sg >= natural => (natural, true),
            None if fit.shuffles && sg >= 4 && sg.is_power_of_two() && fits(sg) => (sg, true),
            None => (natural, false),
        };
        let (q, a) = regs(key_lanes);
        // The lanes (and so the bits) are those of any device with these subgroups; a CPU
        // adapter only takes more rows a tile.
        let (max_q, max_a) = if fit.cpu {
            (CPU_REGS.max(CPU_TILE * q), CPU_REGS.max(CPU_TILE * a))
        } else {
            (MAX_QREG, MAX_AREG)
        };
        let by_regs = (max_q / q.max(1)).min(max_a / a.max(1));
        let max_tile = if fit.cpu && !subgroups {
            CPU_PORTABLE_TILE
        } else {
            MAX_TILE
        };
        let wide = super::paged::rows_aligned(k, v);
        let dv4 = shape.head_dim_v.div_ceil(4);
        // Workgroup memory of a tile of `t` rows with `wg` invocations (paged.wgsl's arrays).
        let bytes = |wg: u32, t: usize| {
            let groups = (wg / key_lanes) as usize;
            let mut b = t * dv4 * 16 + 3 * groups * t * 4 + 3 * MAX_TILE * 4;
            if !subgroups {
                b += 2 * wg as usize * t.div_ceil(4) * 16;
            } else {
                b += 4;
            }
            b
        };
        let limit = fit.workgroup_storage as usize;
        let mut wg = MAX_WG.min(fit.max_invocations.max(1));
        // Narrow workgroups (CPU adapters by default) hold one lane group where it fills a SIMD
        // vector: an adapter that runs a workgroup's invocations one vector after another on one
        // thread gains nothing from more groups but their combine, and each group reads the
        // tile's queries again.
        let groups = if fit.narrow {
            (NARROW_WG / key_lanes).max(1)
        } else {
            MAX_GROUPS
        };
        wg = (1 << (31 - wg.leading_zeros())).min(key_lanes * groups);
        // The same invocations with or without shuffles (the workgroup memory allowing), so
        // that the two sums give the same bits for the same lanes.
        wg = wg.max(key_lanes);
        loop {
            let tile = (1..=max_tile.min(by_regs).max(1))
                .rev()
                .find(|&t| bytes(wg, t) <= limit);
            if let Some(full_tile) = tile {
                return Ok(Self {
                    wg,
                    key_lanes,
                    key_step: if geometry.mla { 1 } else { key_lanes },
                    subgroups,
                    wide,
                    chunks,
                    columns,
                    full_tile,
                    pairs: fit.pairs,
                    step_pairs: fit.step_pairs,
                });
            }
            if wg <= key_lanes {
                return Err(Error::TooLarge {
                    what: format!("workgroup memory of attention over {shape:?}"),
                    bytes: bytes(wg, 1) as u64,
                    limit: u64::from(fit.workgroup_storage),
                });
            }
            wg /= 2;
        }
    }

    /// The shape the kernel is written out for with tiles of `tile` rows (the bounds of its
    /// `@unroll` loops; [`ShaderVariant::unroll`](crate::shader::ShaderVariant::unroll)).
    pub fn shape(&self, tile: usize) -> crate::shader::PagedShape {
        let per = |i: usize| {
            (
                self.chunks[i].div_ceil(self.key_lanes) as u8,
                self.columns[i] as u8,
            )
        };
        crate::shader::PagedShape {
            tile: tile as u8,
            k: per(0),
            rope: per(2),
            v: per(1),
        }
    }

    /// Names of the override constants of a layout.
    const LAYOUT_NAMES: [&'static str; 12] = [
        "WG",
        "KEY_LANES",
        "KEY_STEP",
        "WIDE",
        "K_CH",
        "V_CH",
        "R_CH",
        "QK",
        "QV",
        "QR",
        "PAIRS",
        "STEP_PAIRS",
    ];

    /// The override constants of this layout (beside the shape's and formats'), named as
    /// [`Self::LAYOUT_NAMES`].
    fn constants(&self) -> [(&'static str, f64); 12] {
        [
            ("WG", f64::from(self.wg)),
            ("KEY_LANES", f64::from(self.key_lanes)),
            ("KEY_STEP", f64::from(self.key_step)),
            ("WIDE", f64::from(u8::from(self.wide))),
            ("K_CH", f64::from(self.chunks[0])),
            ("V_CH", f64::from(self.chunks[1])),
            ("R_CH", f64::from(self.chunks[2])),
            ("QK", f64::from(self.columns[0])),
            ("QV", f64::from(self.columns[1])),
            ("QR", f64::from(self.columns[2])),
            ("PAIRS", f64::from(u8::from(self.pairs))),
            ("STEP_PAIRS", f64::from(u8::from(self.step_pairs))),
        ]
    }
}

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
        /// Blocks per pool buffer (the slot of a bound block is its index over this).
        pub blocks_per_buffer: u32,
        /// Padding.
        pub _pad1: u32,
        /// Padding.
        pub _pad2: u32,
    }
}

/// Override constants of the attention kernels with tiles of `tile` rows over pools of layouts
/// `k` and `v` (for MLA, `latent` and the RoPE keys: see [`KvGeometry::mla`]); the workgroup
/// kernel's also carry its `layout`.
pub(crate) fn constants(
    shape: &AttentionShape,
    tile: usize,
    k: &PoolLayout,
    v: &PoolLayout,
    mla: bool,
    layout: Option<&WorkgroupLayout>,
) -> Vec<(&'static str, f64)> {
    let mut set = vec![
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
    ];
    if let Some(layout) = layout {
        set.extend(layout.constants());
    }
    set
}

/// Override constants the naga tests validate: small and large heads, MHA, GQA, MQA, d_v != d_qk.
pub fn representative_constants(_precision: Precision) -> Vec<Vec<(&'static str, f64)>> {
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
            sets.push(workgroup_set(
                &shape,
                layout(k, dk),
                layout(v, dv),
                false,
                j,
            ));
        }
    }
    // Fewer chunks per lane of a K row than of a V row (int8 K, f16 V, 8 lanes a row): the
    // value loop's arrays must hold the larger.
    let gqa = AttentionShape {
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim_qk: 128,
        head_dim_v: 128,
    };
    let layout = |dtype| PoolLayout {
        num_kv_heads: 8,
        head_dim: 128,
        dtype,
        block_size: 16,
        scale: crate::quant::ScaleMode::PerRow,
    };
    sets.push(workgroup_set(
        &gqa,
        layout(KvDtype::Int8),
        layout(KvDtype::F16),
        false,
        1,
    ));
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
        sets.push(workgroup_set(&shape, k, v, true, sets.len()));
    }
    sets
}

/// The constants of the workgroup kernel for `shape` over pools `k` and `v` as a device would
/// plan them within WebGPU's baseline limits (the portable sums' memory included, as the naga
/// tests check every variant with every set): lanes chosen and keys two at a time for even `i`,
/// 8 lanes forced, keys one at a time and one-key steps two a pass for odd `i`.
fn workgroup_set(
    shape: &AttentionShape,
    k: PoolLayout,
    v: PoolLayout,
    mla: bool,
    i: usize,
) -> Vec<(&'static str, f64)> {
    let fit = if i % 2 == 0 {
        DeviceFit::BASELINE
    } else {
        DeviceFit {
            key_lanes: Some(8),
            ..DeviceFit::BASELINE
        }
    };
    let geometry = KvGeometry {
        k,
        v,
        blocks_per_buffer: 1,
        num_buffers: 1,
        per_buffer: false,
        mla,
    };
    let mut layout = WorkgroupLayout::new(shape, &geometry, &fit)
        .expect("the representative shapes fit the baseline limits");
    // Keys two at a time (a GPU's default) for even `i`, one at a time for odd `i`, whose
    // one-key steps (MLA) go two a pass (a CPU adapter's default).
    layout.pairs = i % 2 == 0;
    layout.step_pairs = i % 2 == 1;
    constants(shape, layout.full_tile, &k, &v, mla, Some(&layout))
}

/// The shape ([`crate::shader::PagedShape`]) a set of the workgroup kernel's override constants
/// describes (its `TILE`, chunks over `KEY_LANES` and columns), as the plan writes it out.
pub fn shape_of_constants(set: &[(&'static str, f64)]) -> crate::shader::PagedShape {
    let get = |name: &str| {
        set.iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |c| c.1 as u32)
    };
    let lanes = get("KEY_LANES").max(1);
    let per = |chunks: u32, columns: u32| (chunks.div_ceil(lanes) as u8, columns as u8);
    crate::shader::PagedShape {
        tile: get("TILE") as u8,
        k: per(get("K_CH"), get("QK")),
        rope: per(get("R_CH"), get("QR")),
        v: per(get("V_CH"), get("QV")),
    }
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
                // One pool buffer, two (WebGPU's default limits) and the most.
                pool_slots: [1, 2, MAX_POOL_SLOTS as u8][i % 3],
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

/// The lanes kernel's constants from the workgroup kernel's: its own workgroup size and tile,
/// none of the workgroup kernel's layout.
pub(super) fn lanes_constants(
    set: Vec<(&'static str, f64)>,
    tile: usize,
) -> Vec<(&'static str, f64)> {
    let layout = WorkgroupLayout::LAYOUT_NAMES;
    let mut out: Vec<_> = set
        .into_iter()
        .filter(|(name, _)| !layout.contains(name))
        .map(|(name, value)| match name {
            "TILE" => ("TILE", tile as f64),
            _ => (name, value),
        })
        .collect();
    out.push(("LANE_WG", f64::from(LANE_WG)));
    out
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

/// Whether the rows of pools `k` and `v` are whole 16-byte units, so the kernels can read them
/// as vec4<u32>. Every row starts on a 16-byte boundary in every layout
/// ([`KvDtype::block_words`](crate::quant::KvDtype::block_words) pads blocks and rows); this
/// asks that no row ends inside a unit.
pub(super) fn rows_aligned(k: &PoolLayout, v: &PoolLayout) -> bool {
    [k, v].iter().all(|l| l.words_per_row() % 4 == 0)
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
    /// The caller dispatches buffer by buffer (MLA's up-projection expands one pool buffer at a
    /// time), so items are cut where a sequence's blocks change buffer whatever the kernel.
    pub per_buffer: bool,
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
    pollster::block_on(paged_attention_host_async(ctx, cache, args, q))
}

/// [`paged_attention_host`] without blocking: the form to await in the browser.
pub async fn paged_attention_host_async(
    ctx: &Context,
    cache: &PagedKvCache,
    args: &PagedAttentionArgs<'_>,
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
        out: ctx.read_back_async(&out, rows * s.head_dim_v).await?,
        lse: ctx.read_back_async(&lse, rows).await?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(dtype: KvDtype, head_dim: usize, mla_rope: Option<usize>) -> KvGeometry {
        let k = PoolLayout {
            num_kv_heads: 2,
            head_dim,
            dtype,
            block_size: 16,
            scale: crate::quant::ScaleMode::PerRow,
        };
        let v = PoolLayout {
            head_dim: mla_rope.unwrap_or(head_dim),
            dtype: if mla_rope.is_some() {
                KvDtype::Bf16
            } else {
                dtype
            },
            ..k
        };
        KvGeometry {
            k,
            v,
            blocks_per_buffer: 64,
            num_buffers: 1,
            per_buffer: false,
            mla: mla_rope.is_some(),
        }
    }

    fn shape(hq: usize, d_qk: usize, d_v: usize) -> AttentionShape {
        AttentionShape {
            num_q_heads: hq,
            num_kv_heads: 2,
            head_dim_qk: d_qk,
            head_dim_v: d_v,
        }
    }

    #[test]
    fn layouts_fit_the_device_and_the_row() {
        let gpu = DeviceFit {
            shuffles: true,
            subgroup_min_size: 32,
            max_invocations: 1024,
            workgroup_storage: 49152,
            storage_buffers: 1_000_000,
            key_lanes: None,
            cpu: false,
            pairs: true,
            step_pairs: false,
            narrow: false,
        };
        // Pool slots: what the storage bindings leave, from 1 to MAX_POOL_SLOTS.
        assert_eq!(gpu.pool_slots(1), MAX_POOL_SLOTS);
        assert_eq!(DeviceFit::BASELINE.pool_slots(1), 2);
        assert_eq!(DeviceFit::BASELINE.pool_slots(2), 1);
        for (storage, one, two) in [
            (0, 1, 1),
            (5, 1, 1),
            (6, 1, 1),
            (16, 6, 3),
            (19, 7, 3),
            (20, 8, 4),
            (32, 8, 7),
            (64, 8, 8),
        ] {
            let fit = DeviceFit {
                storage_buffers: storage,
                ..gpu
            };
            assert_eq!(
                (fit.pool_slots(1), fit.pool_slots(2)),
                (one, two),
                "{storage} storage buffers"
            );
        }
        // f16 rows of 128 values are 16 chunks: 16 lanes share a row, 256 invocations.
        let l = WorkgroupLayout::new(
            &shape(8, 128, 128),
            &geometry(KvDtype::F16, 128, None),
            &gpu,
        )
        .unwrap();
        assert_eq!((l.key_lanes, l.wg, l.subgroups), (16, 128, true));
        // Every lane of a group owns one key of a step.
        assert_eq!(l.key_step, l.key_lanes);
        assert_eq!(l.chunks, [16, 16, 0]);
        assert_eq!(l.full_tile, 16);
        // int8 rows of 128 are 8 chunks; MLA's fp8 latent (32 chunks) with its bf16 RoPE key.
        let l = WorkgroupLayout::new(
            &shape(8, 128, 128),
            &geometry(KvDtype::Int8, 128, None),
            &gpu,
        )
        .unwrap();
        assert_eq!(l.key_lanes, 8);
        let l = WorkgroupLayout::new(
            &shape(16, 576, 512),
            &geometry(KvDtype::Fp8E4M3, 512, Some(64)),
            &gpu,
        )
        .unwrap();
        // MLA takes one key a step (its values are the latent chunks of that key).
        assert_eq!(l.key_step, 1);
        assert_eq!(
            (l.key_lanes, l.chunks, l.columns),
            (32, [32, 32, 8], [4, 4, 2])
        );
        // Subgroups of 8 (lavapipe): 8 lanes with two chunks each, not the portable sums.
        let sg8 = DeviceFit {
            subgroup_min_size: 8,
            ..gpu
        };
        let l = WorkgroupLayout::new(
            &shape(8, 128, 128),
            &geometry(KvDtype::F16, 128, None),
            &sg8,
        )
        .unwrap();
        assert_eq!((l.key_lanes, l.subgroups), (8, true));
        // A CPU adapter (lavapipe), GPU-wide workgroups: the same lanes, and so the same bits,
        // but tiles of up to CPU_TILE rows where a GPU's register budget takes fewer: MLA's f16
        // latent row (18 query and 16 accumulator vec4s a head on 8 lanes) gets 8 heads a
        // tile, not 1; rows that fit CPU_REGS take more (head dim 128: 16 rather than 8; 256: 8
        // rather than 4).
        let cpu = DeviceFit { cpu: true, ..sg8 };
        let mla = (shape(128, 576, 512), geometry(KvDtype::F16, 512, Some(64)));
        let on_gpu = WorkgroupLayout::new(&mla.0, &mla.1, &sg8).unwrap();
        let on_cpu = WorkgroupLayout::new(&mla.0, &mla.1, &cpu).unwrap();
        assert_eq!((on_gpu.key_lanes, on_gpu.full_tile), (8, 1));
        assert_eq!(
            on_cpu,
            WorkgroupLayout {
                full_tile: CPU_TILE,
                ..on_gpu
            }
        );
        for (d, gpu_tile, cpu_tile) in [(128, 8, 16), (256, 4, 8)] {
            let (s, g) = (shape(32, d, d), geometry(KvDtype::F16, d, None));
            let on_gpu = WorkgroupLayout::new(&s, &g, &sg8).unwrap();
            let on_cpu = WorkgroupLayout::new(&s, &g, &cpu).unwrap();
            assert_eq!(on_gpu.full_tile, gpu_tile, "head dim {d}");
            assert_eq!(
                on_cpu,
                WorkgroupLayout {
                    full_tile: cpu_tile,
                    ..on_gpu
                },
                "head dim {d}"
            );
        }
        // Rows of one chunk take one lane a key: 8 invocations, fewer than the tile's 16 rows
        // (f32 at head dim 4 on a GPU; FP8 at 16 on a CPU adapter). paged.wgsl combines every
        // row of such a tile (`a_tile_of_more_rows_than_invocations_writes_every_row`).
        for (d, dtype, fit) in [(4, KvDtype::F32, &sg8), (16, KvDtype::Fp8E4M3, &cpu)] {
            let l = WorkgroupLayout::new(&shape(8, d, d), &geometry(dtype, d, None), fit).unwrap();
            assert_eq!((l.key_lanes, l.wg, l.full_tile), (1, 8, 16), "{dtype} {d}");
        }
        // A CPU adapter without shuffles (llvmpipe's GL): the same lanes as a GPU without
        // them, tiles of at most CPU_PORTABLE_TILE rows (each barrier costs its compiler more
        // the more rows a tile holds).
        let portable = DeviceFit {
            cpu: true,
            ..DeviceFit::BASELINE
        };
        for (d, dtype) in [
            (16, KvDtype::F32),
            (128, KvDtype::F16),
            (16, KvDtype::Fp8E4M3),
        ] {
            let (s, g) = (shape(32, d, d), geometry(dtype, d, None));
            let on_gpu = WorkgroupLayout::new(&s, &g, &DeviceFit::BASELINE).unwrap();
            let on_cpu = WorkgroupLayout::new(&s, &g, &portable).unwrap();
            assert!(
                !on_cpu.subgroups && on_gpu.full_tile > CPU_PORTABLE_TILE,
                "{dtype} {d}"
            );
            assert_eq!(
                on_cpu,
                WorkgroupLayout {
                    full_tile: CPU_PORTABLE_TILE,
                    ..on_gpu
                },
                "{dtype} {d}"
            );
        }
        // Narrow workgroups (a CPU adapter's default): one lane group where it fills NARROW_WG
        // invocations, else as many as do; everything else as with GPU-wide workgroups.
        for (d, dtype, fit, lanes, wg) in [
            (128, KvDtype::F16, cpu, 8, 8),
            (64, KvDtype::F16, cpu, 8, 8),
            (16, KvDtype::F16, cpu, 2, 8),
            (128, KvDtype::F16, portable, 16, 16),
            (256, KvDtype::F32, portable, 32, 32),
        ] {
            let (s, g) = (shape(32, d, d), geometry(dtype, d, None));
            let wide = WorkgroupLayout::new(&s, &g, &fit).unwrap();
            let narrow = DeviceFit {
                narrow: true,
                ..fit
            };
            let l = WorkgroupLayout::new(&s, &g, &narrow).unwrap();
            assert!(wide.wg > l.wg, "{dtype} {d}");
            assert_eq!((l.key_lanes, l.wg), (lanes, wg), "{dtype} {d}");
            assert_eq!(l, WorkgroupLayout { wg, ..wide }, "{dtype} {d}");
        }
        // No subgroups (DX12, GL): the portable sums.
        let l = WorkgroupLayout::new(
            &shape(8, 128, 128),
            &geometry(KvDtype::F16, 128, None),
            &DeviceFit::BASELINE,
        )
        .unwrap();
        assert_eq!((l.key_lanes, l.subgroups, l.wg), (16, false, 128));
    }

    #[test]
    fn layouts_respect_workgroup_memory_and_invocations() {
        for storage in [8192, 16384, 32768] {
            for invocations in [64, 128, 256] {
                let fit = DeviceFit {
                    max_invocations: invocations,
                    workgroup_storage: storage,
                    ..DeviceFit::BASELINE
                };
                for (dtype, d) in [
                    (KvDtype::F32, 1024),
                    (KvDtype::F16, 256),
                    (KvDtype::Int4, 64),
                ] {
                    let s = shape(16, d, d);
                    let l = WorkgroupLayout::new(&s, &geometry(dtype, d, None), &fit).unwrap();
                    assert!(l.wg <= invocations && l.wg % l.key_lanes == 0);
                    let groups = (l.wg / l.key_lanes) as usize;
                    let t = l.full_tile;
                    let bytes = t * d / 4 * 16
                        + 3 * groups * t * 4
                        + 2 * l.wg as usize * t.div_ceil(4) * 16;
                    assert!(
                        bytes <= storage as usize,
                        "{dtype} d{d}: {bytes} > {storage}"
                    );
                }
            }
        }
        let tiny = DeviceFit {
            workgroup_storage: 256,
            ..DeviceFit::BASELINE
        };
        assert!(matches!(
            WorkgroupLayout::new(
                &shape(1, 1024, 1024),
                &geometry(KvDtype::F32, 1024, None),
                &tiny
            ),
            Err(Error::TooLarge { .. })
        ));
    }

    #[test]
    fn forced_lane_counts_are_checked() {
        let g = geometry(KvDtype::F32, 1024, None);
        for bad in [0, 3, 64] {
            let fit = DeviceFit {
                key_lanes: Some(bad),
                ..DeviceFit::BASELINE
            };
            assert!(WorkgroupLayout::new(&shape(2, 1024, 1024), &g, &fit).is_err());
        }
        // One lane cannot hold a 1024-value f32 row in its registers.
        let one = DeviceFit {
            key_lanes: Some(1),
            ..DeviceFit::BASELINE
        };
        assert!(matches!(
            WorkgroupLayout::new(&shape(2, 1024, 1024), &g, &one),
            Err(Error::InvalidArgument(_))
        ));
        let l = WorkgroupLayout::new(&shape(2, 64, 64), &geometry(KvDtype::F16, 64, None), &one)
            .unwrap();
        assert_eq!((l.key_lanes, l.subgroups), (1, false));
    }
}
