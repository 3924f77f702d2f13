//! [`PagedAttentionPlan`]: a plan that lives across steps. Its GPU workspace (metadata, partial
//! states, per-dispatch parameters) is created once for a [`PlanCapacity`];
//! [`update`](PagedAttentionPlan::update) writes the next step's metadata with
//! [`Context::write_buffer`]; [`encode`](PagedAttentionPlan::encode) records the attend
//! dispatches and the merge into a caller's compute pass, with bind groups cached in the plan, so
//! a warm step creates no buffer and no bind group.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, PoisonError};

use super::paged::{
    constants, lanes_constants, lanes_fit, lanes_tile, rows_aligned, DeviceFit, KvGeometry,
    PagedAttentionArgs, PagedParams, PagedQuery, SeqSpec, WorkgroupLayout, LANE_WG, SPLIT_TOKENS,
};
use super::paged_plan_step::{
    items_per_dispatch, plan_tile, Fixed, Step, StepDispatch, WorkspaceSize,
};
use super::{AttentionOptions, AttentionShape};
use crate::attention::merge::MergeParams;
use crate::attention::paged_lanes::{columns_per_word4, LanesShape};
use crate::cache::paged::PagedKvCache;
use crate::gpu::{AttentionKernel, Context, UpdateGate};
use crate::pipeline::PipelineKey;
use crate::shader::{Kernel, Precision, ShaderVariant};
use crate::{Error, Result};

/// The largest batch a plan made by [`PagedAttentionPlan::with_capacity`] takes; its GPU
/// workspace is sized for the worst batch within these bounds (see
/// [`with_capacity`](PagedAttentionPlan::with_capacity) for the formula), and
/// [`update`](PagedAttentionPlan::update) refuses a batch beyond any of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanCapacity {
    /// Sequences per batch.
    pub max_seqs: usize,
    /// Query tokens per batch, all sequences together.
    pub max_q_tokens: usize,
    /// Blocks of one sequence's block table (its keys are at most this many blocks).
    pub max_blocks_per_seq: usize,
}

/// What a plan computes for its whole life: shape, options, kernel precision and split-K size.
#[derive(Debug, Clone, Copy)]
pub struct PlanSpec<'a> {
    /// Heads and head dims (KV heads and dims must match the cache).
    pub shape: AttentionShape,
    /// Mask and score options.
    pub options: &'a AttentionOptions,
    /// Kernel variant; [`Precision::F16`] needs `SHADER_F16`.
    pub precision: Precision,
    /// Keys per split-K split ([`SPLIT_TOKENS`] by default); results are bitwise reproducible
    /// only for the same value.
    pub split_tokens: usize,
}

/// The buffers one [`PagedAttentionPlan::encode`] reads and writes. `q` is `[total_q, Hq, d_qk]`
/// f32, `out` `[total_q, Hq, d_v]` f32 and `lse` `[total_q, Hq]` f32; each may be a range of a
/// larger buffer (an activation arena) from an offset that is a multiple of the device's
/// `min_storage_buffer_offset_alignment`, and needs `STORAGE` usage. `out` and `lse` may share a
/// buffer but not overlap.
#[derive(Debug, Clone)]
pub struct AttentionIo<'a> {
    /// The cache the plan was made for.
    pub cache: &'a PagedKvCache,
    /// Layer of the cache to attend over.
    pub layer: usize,
    /// Queries.
    pub q: wgpu::BufferBinding<'a>,
    /// Outputs.
    pub out: wgpu::BufferBinding<'a>,
    /// Log-sum-exps.
    pub lse: wgpu::BufferBinding<'a>,
}

/// A checked binding: buffer, offset and bound size in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Bound {
    buffer: wgpu::Buffer,
    offset: u64,
    size: u64,
}

impl Bound {
    fn resource(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: self.offset,
            size: NonZeroU64::new(self.size),
        })
    }
}

/// A cached bind group's key: the dispatch slot (or [`MERGE_SLOT`]) and the caller's buffers it
/// binds (pools, scales, q; or out, lse).
#[derive(Debug, PartialEq, Eq, Hash)]
struct BindKey {
    slot: usize,
    bound: Vec<Bound>,
}

const MERGE_SLOT: usize = usize::MAX;
/// Bind groups the cache holds per dispatch slot before it is cleared: enough for every layer
/// of a large model with one set of activation buffers.
const BIND_GROUPS_PER_SLOT: usize = 256;

/// The current step: what `update` planned last.
#[derive(Debug, Clone, Default)]
struct StepState {
    total_q: usize,
    num_items: usize,
    num_tiles: usize,
    dispatches: Vec<StepDispatch>,
}

/// A batch planned over a paged cache: built once for a capacity ([`with_capacity`]), updated per
/// step ([`update`]) and recorded per layer ([`encode`], or [`run`] which submits).
///
/// [`with_capacity`]: Self::with_capacity
/// [`update`]: Self::update
/// [`encode`]: Self::encode
/// [`run`]: Self::run
#[derive(Debug)]
pub struct PagedAttentionPlan {
    fixed: Fixed,
    precision: Precision,
    /// The device converts f16 in shaders exactly (`SHADER_F16_IN_F32`, checked on all
    /// patterns when the context was made).
    f16_convert: bool,
    capacity: PlanCapacity,
    size: WorkspaceSize,
    /// The first K pool buffer of layer 0 of the cache the plan was made for (none for plans
    /// over other storage).
    cache_id: Option<wgpu::Buffer>,
    step: StepState,
    /// One parameter uniform per dispatch slot: slot `buffer * chunks_per_buffer + chunk`.
    params: Vec<wgpu::Buffer>,
    merge_params: wgpu::Buffer,
    meta: wgpu::Buffer,
    o_part: wgpu::Buffer,
    lse_part: wgpu::Buffer,
    gate: UpdateGate,
    bind_groups: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    /// Whether encode binds every slot of the pools it sees (plans made with a capacity, so
    /// that a later step finds its bind groups ready), or only the slots the step records.
    eager_bind: bool,
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

/// The geometry of `cache` read as an ordinary K/V cache or (`mla`) as MLA's latent cache.
fn cache_geometry(cache: &PagedKvCache, mla: bool) -> Result<(KvGeometry, wgpu::Buffer)> {
    let c = cache.config();
    let pools = cache.layer(0)?;
    let id = pools
        .k
        .buffers()
        .first()
        .cloned()
        .ok_or_else(|| Error::InvalidArgument("the cache has no pool buffers".into()))?;
    Ok((
        KvGeometry {
            k: c.k_layout(),
            v: c.v_layout(),
            blocks_per_buffer: pools.k.blocks_per_buffer(),
            num_buffers: pools.k.buffers().len(),
            per_buffer: false,
            mla,
        },
        id,
    ))
}

/// The planner's view of `batch` over `cache`. Block tables are cut to the blocks that hold the
/// keys (the kernels read no further).
fn batch_specs(cache: &PagedKvCache, batch: &[PagedQuery]) -> Result<Vec<SeqSpec>> {
    let bs = cache.config().block_size;
    let mut seqs = Vec::with_capacity(batch.len());
    let mut q_base = 0usize;
    for query in batch {
        let len_k = cache.allocator().len(query.seq)?;
        let table = cache.allocator().blocks(query.seq)?;
        let used = len_k.div_ceil(bs).min(table.len());
        seqs.push(SeqSpec {
            q_base,
            len_q: query.len_q,
            len_k,
            table: table[..used].to_vec(),
        });
        q_base = q_base.checked_add(query.len_q).ok_or_else(|| {
            Error::InvalidArgument("the batch's query tokens overflow a usize".into())
        })?;
    }
    Ok(seqs)
}

impl PagedAttentionPlan {
    /// Plans `args.batch` over `cache`: checks every sequence (known, `1 <= len_q <= len_k`),
    /// cuts the work items and writes the metadata. Valid for every layer until the block
    /// tables change (the next append, fork, free or swap). The same as
    /// [`with_capacity`](Self::with_capacity) for exactly this batch, then
    /// [`update`](Self::update).
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
        let (geometry, id) = cache_geometry(cache, mla)?;
        if args.batch.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
        let seqs = batch_specs(cache, args.batch)?;
        let mut plan = Self::from_specs(ctx, args, &geometry, &seqs, split_tokens)?;
        plan.cache_id = Some(id);
        Ok(plan)
    }

    /// Plans `seqs` over storage of `geometry` with a workspace of exactly their size, and
    /// writes their metadata.
    pub(crate) fn from_specs(
        ctx: &Context,
        args: &PagedAttentionArgs,
        geometry: &KvGeometry,
        seqs: &[SeqSpec],
        split_tokens: usize,
    ) -> Result<Self> {
        let spec = PlanSpec {
            shape: args.shape,
            options: args.options,
            precision: args.precision,
            split_tokens,
        };
        if seqs.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
        let capacity = PlanCapacity {
            max_seqs: seqs.len(),
            max_q_tokens: seqs.iter().map(|s| s.len_q).sum(),
            max_blocks_per_seq: seqs.iter().map(|s| s.table.len()).max().unwrap_or(1),
        };
        // Tiles no larger than the batch's largest sequence needs (a decode batch's tile is its
        // GQA group). A sequence's tile boundaries stay those of the full tile: one that fits
        // the smaller tile would fit one full tile too, and a larger one means the full tile.
        let max_len_q = seqs.iter().map(|s| s.len_q).max().unwrap_or(1);
        let fixed = Self::fixed(ctx, &spec, geometry, max_len_q)?;
        let step = fixed.plan(seqs)?;
        let size = step.size(geometry.num_buffers);
        let mut plan = Self::with_workspace(ctx, fixed, spec.precision, capacity, size, None)?;
        plan.apply(ctx, step)?;
        Ok(plan)
    }

    /// A plan over `cache` for any batch within `capacity`, with no batch yet: its GPU
    /// workspace (metadata, partial states, one parameter uniform per dispatch) is created here,
    /// once, for the worst batch within `capacity`; [`update`](Self::update) plans each step
    /// into it. With `S = min(max_seqs, max_q_tokens)`, `Q = max_q_tokens`,
    /// `B = max_blocks_per_seq`, `L = B * block_size`, `G` the GQA group, `T` the tile rows
    /// (the full tile, at most `Q G`) and `P` the pool buffers per layer, the workspace holds
    /// `(Q G + S (T - 1)) / T` merge tiles, `ceil(L / split_tokens)` (plus `B - 1` when
    /// `P > 1` and the kernel does not bind the whole pool) work items per tile, and the metadata words of that many items, tiles, `S`
    /// sequences of `B` blocks.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero capacity or split, a shape or options the cache or
    /// kernels refuse; [`Error::MissingFeature`] for f16 without `SHADER_F16`; creation errors.
    pub fn with_capacity(
        ctx: &Context,
        cache: &PagedKvCache,
        spec: &PlanSpec,
        capacity: PlanCapacity,
    ) -> Result<Self> {
        for (name, v) in [
            ("max_seqs", capacity.max_seqs),
            ("max_q_tokens", capacity.max_q_tokens),
            ("max_blocks_per_seq", capacity.max_blocks_per_seq),
        ] {
            if v == 0 {
                return Err(Error::InvalidArgument(format!(
                    "plan capacity: {name} must be positive"
                )));
            }
        }
        let (geometry, id) = cache_geometry(cache, false)?;
        let fixed = Self::fixed(ctx, spec, &geometry, capacity.max_q_tokens)?;
        let size = fixed.worst_case(&capacity)?;
        Self::with_workspace(ctx, fixed, spec.precision, capacity, size, Some(id))
    }

    /// Checks the spec and fixes the kernel and tile, for sequences of at most `max_len_q`
    /// queries.
    fn fixed(
        ctx: &Context,
        spec: &PlanSpec,
        geometry: &KvGeometry,
        max_len_q: usize,
    ) -> Result<Fixed> {
        if spec.split_tokens == 0 {
            return Err(Error::InvalidArgument(
                "split-K needs at least one key per split".into(),
            ));
        }
        let shape = spec.shape;
        check_shape_and_options(ctx, &shape, spec.options, geometry, spec.precision)?;
        let kernel = match ctx.caps().attention_kernel {
            AttentionKernel::Lanes if lanes_fit(&shape, geometry) => AttentionKernel::Lanes,
            _ => AttentionKernel::Workgroup,
        };
        let fit = DeviceFit::of(ctx);
        let layout = match kernel {
            AttentionKernel::Workgroup => Some(WorkgroupLayout::new(&shape, geometry, &fit)?),
            AttentionKernel::Lanes => None,
        };
        // Storage bindings per pool buffer: one view, and the lanes kernel's vec4 views of
        // rows on 16-byte boundaries.
        let views = match kernel {
            AttentionKernel::Lanes if rows_aligned(&geometry.k, &geometry.v) => 2,
            _ => 1,
        };
        let full_tile = layout.map_or_else(|| lanes_tile(&shape), |l| l.full_tile);
        let max_rows = max_len_q.saturating_mul(shape.group());
        let tile = plan_tile(full_tile, max_rows, shape.group());
        let max_x = ctx.caps().max_compute_workgroups_per_dimension as usize;
        Ok(Fixed {
            shape,
            options: spec.options.clone(),
            split_tokens: spec.split_tokens,
            tile,
            kernel,
            layout,
            geometry: *geometry,
            per_dispatch: items_per_dispatch(kernel, max_x, shape.num_kv_heads),
            max_x,
            slot_budget: fit.pool_slots(views),
        })
    }

    /// Creates the workspace of `size`.
    fn with_workspace(
        ctx: &Context,
        fixed: Fixed,
        precision: Precision,
        capacity: PlanCapacity,
        size: WorkspaceSize,
        cache_id: Option<wgpu::Buffer>,
    ) -> Result<Self> {
        let hkv = fixed.shape.num_kv_heads;
        let part_rows = size.items.checked_mul(hkv * fixed.tile).ok_or_else(|| {
            Error::InvalidArgument("plan capacity: partial states overflow".into())
        })?;
        let part_values = part_rows
            .checked_mul(fixed.shape.head_dim_v)
            .ok_or_else(|| {
                Error::InvalidArgument("plan capacity: partial states overflow".into())
            })?;
        let slots = fixed.geometry.num_buffers * size.chunks_per_buffer;
        let meta_bytes = (size.meta_words.max(4) as u64) * 4;
        let limit = ctx.device.limits().max_storage_buffer_binding_size;
        if meta_bytes > limit {
            return Err(Error::TooLarge {
                what: "attention plan metadata".into(),
                bytes: meta_bytes,
                limit,
            });
        }
        let meta = ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some("attention plan"),
            size: meta_bytes,
            usage: crate::gpu::STORAGE,
            mapped_at_creation: false,
        })?;
        // Only plans made with a capacity (the ones that get a cache id here) live across steps.
        let eager_bind = cache_id.is_some();
        let params = (0..slots)
            .map(|_| ctx.uniform("paged params", &PagedParams::default()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            precision,
            f16_convert: ctx.caps().f16_unpack_exact,
            capacity,
            size,
            cache_id,
            step: StepState::default(),
            params,
            merge_params: ctx.uniform("merge params", &MergeParams::default())?,
            meta,
            o_part: ctx.filled("partial o", part_values, crate::gpu::UNWRITTEN)?,
            lse_part: ctx.filled("partial lse", part_rows, crate::gpu::UNWRITTEN)?,
            gate: UpdateGate::default(),
            bind_groups: Mutex::new(HashMap::new()),
            eager_bind,
            fixed,
        })
    }

    /// Checks that `cache` is the cache the plan was made for.
    fn check_cache(&self, cache: &PagedKvCache) -> Result<()> {
        let id = cache.layer(0)?.k.buffers().first();
        match &self.cache_id {
            Some(mine) if id == Some(mine) => Ok(()),
            Some(_) => Err(Error::InvalidArgument(
                "the plan was made for another cache (its pool buffers differ)".into(),
            )),
            None => Err(Error::InvalidArgument(
                "the plan was not made over a paged cache".into(),
            )),
        }
    }

    /// Plans `batch` over `cache` (the same items, tiles and splits as [`new`](Self::new)) and
    /// writes its metadata and dispatch parameters into the plan's workspace with
    /// [`Context::write_buffer`]; creates no buffer. The writes land at the next submission, so
    /// a plan is updated at most once per submission.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] before anything is written: a batch over the capacity (naming
    /// `max_seqs`, `max_q_tokens` or `max_blocks_per_seq`), another cache than the plan's, a
    /// second update after the plan was recorded with no submission in between
    /// ([`UpdateGate`]), or a sequence the planner refuses; [`Error::UnknownSequence`].
    pub fn update(
        &mut self,
        ctx: &Context,
        cache: &PagedKvCache,
        batch: &[PagedQuery],
    ) -> Result<()> {
        self.check_cache(cache)?;
        let cap = self.capacity;
        if batch.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
        if batch.len() > cap.max_seqs {
            return Err(Error::InvalidArgument(format!(
                "the batch has {} sequences, over the plan's max_seqs {}",
                batch.len(),
                cap.max_seqs
            )));
        }
        let seqs = batch_specs(cache, batch)?;
        let total_q: usize = seqs.iter().map(|s| s.len_q).sum();
        if total_q > cap.max_q_tokens {
            return Err(Error::InvalidArgument(format!(
                "the batch has {total_q} query tokens, over the plan's max_q_tokens {}",
                cap.max_q_tokens
            )));
        }
        if let Some((i, s)) = seqs
            .iter()
            .enumerate()
            .find(|(_, s)| s.table.len() > cap.max_blocks_per_seq)
        {
            return Err(Error::InvalidArgument(format!(
                "sequence {i} holds {} blocks, over the plan's max_blocks_per_seq {}",
                s.table.len(),
                cap.max_blocks_per_seq
            )));
        }
        let step = self.fixed.plan(&seqs)?;
        self.apply(ctx, step)
    }

    /// Checks that `step` fits the workspace and the update gate, then writes it.
    fn apply(&mut self, ctx: &Context, step: Step) -> Result<()> {
        let need = step.size(self.fixed.geometry.num_buffers);
        let size = self.size;
        if need.items > size.items
            || need.tiles > size.tiles
            || need.meta_words > size.meta_words
            || need.chunks_per_buffer > size.chunks_per_buffer
        {
            return Err(Error::InvalidArgument(format!(
                "the batch needs {need:?}, more than the plan's workspace {size:?}"
            )));
        }
        self.gate.check_update(ctx, "a paged attention plan")?;
        let f = &self.fixed;
        let shape = &f.shape;
        let opts = &f.options;
        let bs = f.geometry.k.block_size;
        let bpb = f.geometry.blocks_per_buffer;
        let flags = u32::from(opts.causal) | (u32::from(opts.alibi_slopes.is_some()) << 1);
        ctx.write_buffer(&self.meta, 0, bytemuck::cast_slice(&step.meta))?;
        for d in &step.dispatches {
            let params = PagedParams {
                num_q_heads: shape.num_q_heads as u32,
                num_kv_heads: shape.num_kv_heads as u32,
                block_size: bs as u32,
                first_block: (d.buffer * bpb) as u32,
                scale: opts.scale_for(shape),
                softcap: opts.softcap.unwrap_or(0.0),
                window: step.window,
                flags,
                items_at: step.items_at as u32,
                seqs_at: step.seqs_at as u32,
                slopes_at: step.slopes_at as u32,
                list_at: d.list_at as u32,
                list_len: d.list_len as u32,
                blocks_per_buffer: bpb as u32,
                ..Default::default()
            };
            let slot = self.slot(d);
            ctx.write_buffer(&self.params[slot], 0, bytemuck::bytes_of(&params))?;
        }
        let merge_params = MergeParams {
            num_q_heads: shape.num_q_heads as u32,
            num_kv_heads: shape.num_kv_heads as u32,
            flags: u32::from(opts.sinks.is_some()),
            tiles_at: step.tiles_at as u32,
            sinks_at: step.sinks_at as u32,
            ..Default::default()
        };
        ctx.write_buffer(&self.merge_params, 0, bytemuck::bytes_of(&merge_params))?;
        self.gate.updated(ctx);
        self.step = StepState {
            total_q: step.total_q,
            num_items: step.num_items,
            num_tiles: step.num_tiles,
            dispatches: step.dispatches,
        };
        Ok(())
    }

    fn slot(&self, d: &StepDispatch) -> usize {
        d.buffer * self.size.chunks_per_buffer + d.chunk
    }

    /// Query rows (tokens) of the current batch.
    pub fn total_q(&self) -> usize {
        self.step.total_q
    }

    /// The kernel the plan runs (the context's choice, or the workgroup kernel for head dims
    /// the lanes kernel does not take).
    pub fn kernel(&self) -> AttentionKernel {
        self.fixed.kernel
    }

    /// The workgroup kernel's layout (lanes per key, invocations, chunks, tile), or `None`
    /// when the plan runs the lanes kernel.
    pub fn workgroup_layout(&self) -> Option<super::paged::WorkgroupLayout> {
        self.fixed.layout
    }

    /// Work items (partial states per KV head) the plan cut for the current batch.
    pub fn num_items(&self) -> usize {
        self.step.num_items
    }

    /// Whether [`update`](Self::update) may run now (see [`UpdateGate`]): false after the plan
    /// was recorded until a submission follows.
    pub fn may_update(&self, ctx: &Context) -> bool {
        self.gate.may_update(ctx)
    }

    /// The capacity the plan's workspace was made for.
    pub fn capacity(&self) -> PlanCapacity {
        self.capacity
    }

    fn pipeline_key(&self, kernel: Kernel) -> PipelineKey {
        let f = &self.fixed;
        let precision = if kernel == Kernel::Merge {
            Precision::F32
        } else {
            self.precision
        };
        let attention = |layout| {
            constants(
                &f.shape,
                f.tile,
                &f.geometry.k,
                &f.geometry.v,
                f.geometry.mla,
                layout,
            )
        };
        let constants = match kernel {
            Kernel::Merge => crate::attention::merge::constants(&f.shape, f.tile),
            Kernel::PagedLanes => lanes_constants(attention(None), f.tile),
            _ => attention(f.layout.as_ref()),
        };
        let subgroups =
            kernel.has_subgroup_variant() && f.layout.is_some_and(|layout| layout.subgroups);
        let variant = match kernel {
            Kernel::PagedLanes => ShaderVariant::lanes(precision, self.lanes_shape()),
            _ => ShaderVariant {
                subgroups,
                f16_convert: kernel == Kernel::Paged && self.f16_convert,
                unroll: if kernel == Kernel::Paged {
                    f.layout.map(|layout| layout.shape(f.tile))
                } else {
                    None
                },
                // At most MAX_POOL_SLOTS (8), so the u8 holds it.
                pool_slots: if kernel == Kernel::Paged {
                    f.pool_slots() as u8
                } else {
                    1
                },
                ..ShaderVariant::new(kernel, precision)
            },
        };
        PipelineKey::new(variant, &constants)
    }

    /// What the lanes kernel is written out for in this plan.
    fn lanes_shape(&self) -> LanesShape {
        let f = &self.fixed;
        let (k, v) = (&f.geometry.k, &f.geometry.v);
        let mla = f.geometry.mla;
        LanesShape {
            tile: f.tile as u16,
            k_cols: (k.head_dim / 4) as u16,
            rope_cols: if mla { (v.head_dim / 4) as u16 } else { 0 },
            out_cols: (f.shape.head_dim_v / 4) as u16,
            k_qpw: columns_per_word4(k.dtype),
            v_qpw: columns_per_word4(if mla { k.dtype } else { v.dtype }),
            wide: rows_aligned(k, v),
            f16_convert: self.f16_convert,
            // At most MAX_POOL_SLOTS (8), so the u8 holds it.
            pool_slots: f.pool_slots() as u8,
        }
    }

    /// Checks that the plan holds a batch (so there is something to record).
    fn check_ready(&self) -> Result<()> {
        if self.step.total_q == 0 {
            return Err(Error::InvalidArgument(
                "the paged attention plan has not been updated with a batch yet".into(),
            ));
        }
        Ok(())
    }

    /// Checks `binding` (`STORAGE` usage, aligned offset, in bounds, at least `elems` f32) and
    /// returns it as a cache key part.
    fn check_binding(
        ctx: &Context,
        what: &str,
        binding: &wgpu::BufferBinding<'_>,
        elems: usize,
    ) -> Result<Bound> {
        let buffer = binding.buffer;
        let size =
            crate::gpu::dispatch::check_binding_place(ctx, &format!("{what} buffer"), binding)?;
        // Without a size, the rest of the buffer, up to the largest binding the device takes
        // (a large arena is bound from the offset, not whole).
        let limit = ctx.device.limits().max_storage_buffer_binding_size / 4 * 4;
        let size = if binding.size.is_none() {
            size.min(limit)
        } else {
            size
        };
        if size > limit {
            return Err(Error::InvalidArgument(format!(
                "{what} binding of {size} bytes exceeds the device's {limit}-byte storage binding \
                 limit"
            )));
        }
        let bytes = (elems as u64).saturating_mul(4);
        if size < bytes {
            return Err(Error::InvalidArgument(format!(
                "{what} buffer holds {size} bytes, the batch needs {bytes}"
            )));
        }
        // The whole binding is bound (not only what this batch needs), so the cached bind
        // group serves every batch.
        Ok(Bound {
            buffer: buffer.clone(),
            offset: binding.offset,
            size,
        })
    }

    /// The cached bind group of `key`, created by `make` on a miss.
    fn bind_group(
        &self,
        key: BindKey,
        make: impl FnOnce(&BindKey) -> Result<wgpu::BindGroup>,
    ) -> Result<wgpu::BindGroup> {
        let mut cache = self
            .bind_groups
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(group) = cache.get(&key) {
            return Ok(group.clone());
        }
        let group = make(&key)?;
        if cache.len() >= (self.params.len() + 1) * BIND_GROUPS_PER_SLOT {
            cache.clear();
        }
        cache.insert(key, group.clone());
        Ok(group)
    }

    /// The attend dispatches of the current step over pool buffers `buffers` (each bound as
    /// `pools[b]`), prepared: pipeline, bind group and grid.
    fn prepare_attend(
        &self,
        ctx: &Context,
        pools: &[(usize, (&wgpu::Buffer, &wgpu::Buffer))],
        scales: (&wgpu::Buffer, &wgpu::Buffer),
        q: &Bound,
    ) -> Result<Vec<Prepared>> {
        let hkv = self.fixed.shape.num_kv_heads;
        let (kernel, lanes) = match self.fixed.kernel {
            AttentionKernel::Workgroup => (Kernel::Paged, false),
            AttentionKernel::Lanes => (Kernel::PagedLanes, true),
        };
        let pipeline = ctx.pipeline(&self.pipeline_key(kernel))?;
        let wide = lanes && self.lanes_shape().wide;
        let whole = |b: &wgpu::Buffer| Bound {
            buffer: b.clone(),
            offset: 0,
            size: b.size(),
        };
        // What each dispatch's pool bindings hold: the whole pool, one slot per buffer, where
        // the plan binds it whole, else the one buffer the dispatch's items read.
        let sets: Vec<(usize, Vec<(&wgpu::Buffer, &wgpu::Buffer)>)> =
            if self.fixed.binds_whole_pool() {
                let all: Option<Vec<_>> = (0..self.fixed.geometry.num_buffers)
                    .map(|b| pools.iter().find(|(i, _)| *i == b).map(|(_, p)| *p))
                    .collect();
                let all = all.ok_or_else(|| {
                    Error::InvalidArgument(
                        "paged attention: the plan binds the whole pool, and a pool buffer is \
                         missing"
                            .into(),
                    )
                })?;
                vec![(0, all)]
            } else {
                pools.iter().map(|&(b, p)| (b, vec![p])).collect()
            };
        // The bind group of every slot of these pool buffers, used this step or not: a later
        // step whose items reach another buffer (or chunk) then finds its bind group ready.
        let cpb = self.size.chunks_per_buffer;
        let mut groups = HashMap::new();
        for (buffer, slots) in &sets {
            for slot in buffer * cpb..(buffer + 1) * cpb {
                // A plan made for one batch binds only what it records.
                if !self.eager_bind && !self.step.dispatches.iter().any(|d| self.slot(d) == slot) {
                    continue;
                }
                // Scales, queries, then the pools slot by slot (K, V).
                let mut bound = vec![whole(scales.0), whole(scales.1), q.clone()];
                for (k, v) in slots {
                    bound.extend([whole(k), whole(v)]);
                }
                let key = BindKey { slot, bound };
                let group = self.bind_group(key, |key| {
                    let [sk, sv, q, pools @ ..] = &key.bound[..] else {
                        unreachable!("scales, queries and pools are bound")
                    };
                    let (k, v) = (&pools[0], &pools[1]);
                    let mut resources = vec![
                        self.params[slot].as_entire_binding(),
                        q.resource(),
                        k.buffer.as_entire_binding(),
                        v.buffer.as_entire_binding(),
                        self.meta.as_entire_binding(),
                        self.o_part.as_entire_binding(),
                        self.lse_part.as_entire_binding(),
                        sk.buffer.as_entire_binding(),
                        sv.buffer.as_entire_binding(),
                    ];
                    // The pools of slots 1 and up (bindings 9, 10, ...), then the lanes
                    // kernel's vec4 views of every slot's pools where its shape reads them
                    // (shader::pool_bindings numbers them so).
                    resources.extend(pools[2..].iter().map(|b| b.buffer.as_entire_binding()));
                    if wide {
                        resources.extend(pools.iter().map(|b| b.buffer.as_entire_binding()));
                    }
                    ctx.bind_group("paged attention", &pipeline, &resources)
                })?;
                groups.insert(slot, group);
            }
        }
        let mut prepared = Vec::new();
        for d in &self.step.dispatches {
            let Some(group) = groups.get(&self.slot(d)) else {
                continue;
            };
            let grid = if lanes {
                [(d.list_len * hkv).div_ceil(LANE_WG as usize) as u32, 1, 1]
            } else {
                [d.list_len as u32, hkv as u32, 1]
            };
            check_grid(ctx, grid)?;
            prepared.push(Prepared {
                pipeline: Arc::clone(&pipeline),
                group: group.clone(),
                grid,
            });
        }
        Ok(prepared)
    }

    /// The merge of the current step into `out` and `lse`, prepared.
    fn prepare_merge(&self, ctx: &Context, out: &Bound, lse: &Bound) -> Result<Prepared> {
        let pipeline = ctx.pipeline(&self.pipeline_key(Kernel::Merge))?;
        let key = BindKey {
            slot: MERGE_SLOT,
            bound: vec![out.clone(), lse.clone()],
        };
        let group = self.bind_group(key, |key| {
            ctx.bind_group(
                "attention merge",
                &pipeline,
                &[
                    self.merge_params.as_entire_binding(),
                    self.meta.as_entire_binding(),
                    self.o_part.as_entire_binding(),
                    self.lse_part.as_entire_binding(),
                    key.bound[0].resource(),
                    key.bound[1].resource(),
                ],
            )
        })?;
        let grid = [
            self.step.num_tiles as u32,
            self.fixed.shape.num_kv_heads as u32,
            1,
        ];
        check_grid(ctx, grid)?;
        Ok(Prepared {
            pipeline,
            group,
            grid,
        })
    }

    /// Checks q, out and lse against the current batch.
    fn check_io(
        &self,
        ctx: &Context,
        q: &wgpu::BufferBinding<'_>,
        out: &wgpu::BufferBinding<'_>,
        lse: &wgpu::BufferBinding<'_>,
    ) -> Result<(Bound, Bound, Bound)> {
        self.check_ready()?;
        let s = &self.fixed.shape;
        let rows = self.step.total_q * s.num_q_heads;
        let q = Self::check_binding(ctx, "q", q, rows * s.head_dim_qk)?;
        let out = Self::check_binding(ctx, "out", out, rows * s.head_dim_v)?;
        let lse = Self::check_binding(ctx, "lse", lse, rows)?;
        // What the merge writes of each.
        let (out_bytes, lse_bytes) = ((rows * s.head_dim_v * 4) as u64, (rows * 4) as u64);
        if out.buffer == lse.buffer
            && out.offset < lse.offset + lse_bytes
            && lse.offset < out.offset + out_bytes
        {
            return Err(Error::InvalidArgument(
                "out and lse overlap in one buffer".into(),
            ));
        }
        Ok((q, out, lse))
    }

    /// Records the current batch's attention over `io.layer` of `io.cache` into `pass`: every
    /// attend dispatch, then the merge into `io.out` and `io.lse`. Submits nothing; the
    /// metadata written by the last [`update`](Self::update) lands at the next submission, which
    /// must contain this pass. Everything is checked and every bind group made (or found in the
    /// plan's cache: a warm step creates none) before the first dispatch is recorded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`]: no batch yet, another cache than the plan's, a binding
    /// without `STORAGE` usage, at an offset that is not a multiple of
    /// `min_storage_buffer_offset_alignment`, too small for the batch, or `out` overlapping
    /// `lse`; [`Error::Wgpu`] for a buffer the device refuses to bind (one of another device).
    pub fn encode(
        &self,
        ctx: &Context,
        pass: &mut wgpu::ComputePass<'_>,
        io: &AttentionIo<'_>,
    ) -> Result<()> {
        self.check_cache(io.cache)?;
        let layer = io.cache.layer(io.layer)?;
        let pairs: Vec<_> = layer.k.buffers().iter().zip(layer.v.buffers()).collect();
        let scales = (layer.k.scale_uniform(), layer.v.scale_uniform());
        self.encode_on(ctx, pass, &pairs, scales, (&io.q, &io.out, &io.lse))
    }

    /// [`encode`](Self::encode) over explicit pool buffers: `pools[b]` is the (K, V) buffer
    /// pair `b`, `scales` the K and V pools' scale uniforms.
    pub(crate) fn encode_on(
        &self,
        ctx: &Context,
        pass: &mut wgpu::ComputePass<'_>,
        pools: &[(&wgpu::Buffer, &wgpu::Buffer)],
        scales: (&wgpu::Buffer, &wgpu::Buffer),
        (q, out, lse): (
            &wgpu::BufferBinding<'_>,
            &wgpu::BufferBinding<'_>,
            &wgpu::BufferBinding<'_>,
        ),
    ) -> Result<()> {
        let (q, out, lse) = self.check_io(ctx, q, out, lse)?;
        if pools.len() != self.fixed.geometry.num_buffers {
            return Err(Error::InvalidArgument(format!(
                "{} pool buffers given, the plan was made for {}",
                pools.len(),
                self.fixed.geometry.num_buffers
            )));
        }
        let indexed: Vec<_> = pools.iter().copied().enumerate().collect();
        let mut prepared = self.prepare_attend(ctx, &indexed, scales, &q)?;
        prepared.push(self.prepare_merge(ctx, &out, &lse)?);
        self.gate.record("a paged attention plan")?;
        for p in &prepared {
            p.encode(pass);
        }
        Ok(())
    }

    /// Records the work items whose keys lie in pool buffer `buffer`, bound as `pools` (K, V):
    /// their partial states, for [`encode_merge`](Self::encode_merge) once every buffer is done.
    pub(crate) fn encode_attend_buffer(
        &self,
        ctx: &Context,
        pass: &mut wgpu::ComputePass<'_>,
        buffer: usize,
        pools: (&wgpu::Buffer, &wgpu::Buffer),
        scales: (&wgpu::Buffer, &wgpu::Buffer),
        q: &wgpu::BufferBinding<'_>,
    ) -> Result<()> {
        self.check_ready()?;
        let s = &self.fixed.shape;
        let q = Self::check_binding(
            ctx,
            "q",
            q,
            self.step.total_q * s.num_q_heads * s.head_dim_qk,
        )?;
        let prepared = self.prepare_attend(ctx, &[(buffer, pools)], scales, &q)?;
        self.gate.record("a paged attention plan")?;
        for p in &prepared {
            p.encode(pass);
        }
        Ok(())
    }

    /// Records the merge of every item's partial state into `out` and `lse`.
    pub(crate) fn encode_merge(
        &self,
        ctx: &Context,
        pass: &mut wgpu::ComputePass<'_>,
        out: &wgpu::BufferBinding<'_>,
        lse: &wgpu::BufferBinding<'_>,
    ) -> Result<()> {
        self.check_ready()?;
        let s = &self.fixed.shape;
        let rows = self.step.total_q * s.num_q_heads;
        let out = Self::check_binding(ctx, "out", out, rows * s.head_dim_v)?;
        let lse = Self::check_binding(ctx, "lse", lse, rows)?;
        let prepared = self.prepare_merge(ctx, &out, &lse)?;
        self.gate.record("a paged attention plan")?;
        prepared.encode(pass);
        Ok(())
    }

    /// Runs the batch on `layer` of `cache` (the cache the plan was made for): [`encode`] in a
    /// compute pass of its own, submitted (one submission).
    ///
    /// [`encode`]: Self::encode
    pub fn run(
        &self,
        ctx: &Context,
        cache: &PagedKvCache,
        layer: usize,
        q: &wgpu::Buffer,
        out: &wgpu::Buffer,
        lse: &wgpu::Buffer,
    ) -> Result<()> {
        let io = AttentionIo {
            cache,
            layer,
            q: q.as_entire_buffer_binding(),
            out: out.as_entire_buffer_binding(),
            lse: lse.as_entire_buffer_binding(),
        };
        ctx.run_pass("paged attention", |pass| self.encode(ctx, pass, &io))?;
        Ok(())
    }
}

/// One dispatch ready to record.
struct Prepared {
    pipeline: Arc<wgpu::ComputePipeline>,
    group: wgpu::BindGroup,
    grid: [u32; 3],
}

impl Prepared {
    fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.group, &[]);
        pass.dispatch_workgroups(self.grid[0], self.grid[1], self.grid[2]);
    }
}

fn check_grid(ctx: &Context, grid: [u32; 3]) -> Result<()> {
    let max = ctx.caps().max_compute_workgroups_per_dimension;
    if grid.iter().any(|&n| n > max) {
        return Err(Error::InvalidArgument(format!(
            "paged attention: dispatch of {grid:?} workgroups exceeds the adapter's {max} per \
             dimension"
        )));
    }
    Ok(())
}
