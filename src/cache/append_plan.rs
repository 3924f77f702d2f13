//! [`AppendPlan`]: writing each step's new K/V rows into a [`PagedKvCache`] without creating
//! anything on a warm step.
//!
//! A plan is made once for a cache and a largest batch ([`AppendPlan::with_capacity`]: the row
//! list and the parameter slots of every possible dispatch, created once). Each step,
//! [`update`](AppendPlan::update) writes the step's (source row, slot) list and dispatch
//! parameters with [`Context::write_buffer`], and [`encode`](AppendPlan::encode) records the
//! `append_kv` dispatches of one layer into the caller's compute pass. The bind groups of a
//! layer are made by its first `encode` (for every pool buffer, so a later step that writes
//! into another buffer of the pool creates nothing either) and kept while the layer's K/V
//! source bindings stay the same.
//!
//! The pool contents are exactly those of [`PagedKvCache::write_layer`] (the same kernel, the
//! same rows per pool buffer, in the same order).

use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, PoisonError};

use super::append_kv::{
    append_pipeline, bindings, workgroups_for, AppendParams, SourceDtype, MIN_LIST_BYTES,
};
use super::paged::{AppendBatch, PagedKvCache};
use super::pool::BlockPool;
use crate::gpu::dispatch::fit_u32;
use crate::gpu::{Context, UpdateGate};
use crate::{Error, Result};

/// Where one layer's new rows come from: `k` is `[rows, Hkv, head_dim_k]` and `v`
/// `[rows, Hkv, head_dim_v]` in `src`, rows in batch order, each at the start of its binding.
#[derive(Debug, Clone)]
pub struct AppendIo<'a> {
    /// The cache written.
    pub cache: &'a PagedKvCache,
    /// The layer written.
    pub layer: usize,
    /// The new K rows (a storage binding; its offset aligned to the device's
    /// `min_storage_buffer_offset_alignment`).
    pub k: wgpu::BufferBinding<'a>,
    /// The new V rows (as `k`).
    pub v: wgpu::BufferBinding<'a>,
    /// Element type of `k` and `v`.
    pub src: SourceDtype,
}

/// Checks that `binding` is a storage binding of at least `needed` bytes: `STORAGE` usage, an
/// offset aligned to `min_storage_buffer_offset_alignment`, inside its buffer, a size that is a
/// multiple of 4 and at most the device's storage binding limit. Returns the bound size.
pub(crate) fn check_storage_binding(
    ctx: &Context,
    what: &'static str,
    binding: &wgpu::BufferBinding<'_>,
    needed: u64,
) -> Result<u64> {
    let size = crate::gpu::dispatch::check_binding_place(ctx, what, binding)?;
    if size % 4 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: a binding of {size} bytes is not a multiple of 4 bytes"
        )));
    }
    if size < needed {
        return Err(Error::ShapeMismatch {
            what,
            expected: usize::try_from(needed).unwrap_or(usize::MAX),
            got: usize::try_from(size).unwrap_or(usize::MAX),
        });
    }
    let limit = ctx.device.limits().max_storage_buffer_binding_size;
    if size > limit {
        return Err(Error::TooLarge {
            what: what.to_string(),
            bytes: size,
            limit,
        });
    }
    if size == 0 {
        return Err(Error::InvalidArgument(format!("{what}: an empty binding")));
    }
    Ok(size)
}

/// Checks one layer's K/V sources against `rows` rows of the cache's shape and returns that
/// layer's pools. Shared by [`AppendPlan::encode`] and [`AppendBatch::encode`].
pub(crate) fn check_io<'c>(
    ctx: &Context,
    io: &AppendIo<'c>,
    rows: usize,
) -> Result<&'c super::pool::LayerPools> {
    let pools = io.cache.layer(io.layer)?;
    let c = io.cache.config();
    let rows = rows as u64;
    let heads = c.num_kv_heads as u64;
    let bytes = io.src.bytes() as u64;
    check_storage_binding(
        ctx,
        "append source k",
        &io.k,
        rows * heads * c.head_dim_k as u64 * bytes,
    )?;
    check_storage_binding(
        ctx,
        "append source v",
        &io.v,
        rows * heads * c.head_dim_v as u64 * bytes,
    )?;
    for (name, binding) in [("k", &io.k), ("v", &io.v)] {
        if pools
            .k
            .buffers()
            .iter()
            .chain(pools.v.buffers())
            .any(|b| b == binding.buffer)
        {
            return Err(Error::InvalidArgument(format!(
                "append source {name} is a buffer of the cache's own pools"
            )));
        }
    }
    Ok(pools)
}

/// A binding as a key: buffer, offset, size.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BindingKey {
    buffer: wgpu::Buffer,
    offset: u64,
    size: Option<NonZeroU64>,
}

impl BindingKey {
    fn of(binding: &wgpu::BufferBinding<'_>) -> Self {
        Self {
            buffer: binding.buffer.clone(),
            offset: binding.offset,
            size: binding.size,
        }
    }

    fn buffer_binding(&self) -> wgpu::BufferBinding<'_> {
        wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: self.offset,
            size: self.size,
        }
    }
}

/// One layer's bind groups, made for one pair of K/V source bindings.
#[derive(Debug)]
struct LayerBinds {
    k: BindingKey,
    v: BindingKey,
    src: SourceDtype,
    /// The K and V pipelines.
    pipelines: [Arc<wgpu::ComputePipeline>; 2],
    /// Per tensor (K, V), per parameter slot: the bind group.
    groups: [Vec<wgpu::BindGroup>; 2],
}

/// One dispatch of the current step (for each of K and V).
#[derive(Debug, Clone, Copy)]
struct StepDispatch {
    /// Parameter slot (which also names the pool buffer).
    slot: usize,
    /// Row entries (the workgroups along y hold several: `append_kv::workgroups_for`).
    entries: u32,
}

/// Bytes of one [`AppendParams`] slot.
const PARAMS_BYTES: u64 = std::mem::size_of::<AppendParams>() as u64;

/// The append of every step's new K/V rows into one [`PagedKvCache`], with its buffers made once
/// (see the module docs). `Send + Sync`.
#[derive(Debug)]
pub struct AppendPlan {
    cache_id: u64,
    max_rows: usize,
    layers: usize,
    num_kv_heads: u32,
    block_size: u32,
    blocks_per_buffer: usize,
    /// Slots of the pool (blocks * block size).
    pool_slots: u64,
    /// `(source row, slot)` pairs of the step, grouped by pool buffer.
    list: wgpu::Buffer,
    /// One [`AppendParams`] per possible dispatch, `slot_stride` bytes apart.
    params: wgpu::Buffer,
    slot_stride: u64,
    /// Per pool buffer: its first parameter slot and how many it has.
    buffer_slots: Vec<(usize, usize)>,
    /// Pool buffer of each parameter slot.
    slot_buffer: Vec<usize>,
    /// The current step's dispatches and rows.
    step: Vec<StepDispatch>,
    rows: usize,
    gate: UpdateGate,
    binds: Mutex<Vec<Option<LayerBinds>>>,
}

// wgpu's web objects are neither, and the web has one thread.
#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<AppendPlan>();
};

impl AppendPlan {
    /// A plan for appending at most `max_rows` rows per step to `cache`: creates the row list
    /// and the parameter slots of every dispatch a step can need (two buffers).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `max_rows` is 0 or its list exceeds a storage binding or
    /// u32 indexing, or the cache's KV heads exceed the workgroup grid; creation errors.
    pub fn with_capacity(ctx: &Context, cache: &PagedKvCache, max_rows: usize) -> Result<Self> {
        if max_rows == 0 {
            return Err(Error::InvalidArgument(
                "an append plan needs a capacity of at least one row".into(),
            ));
        }
        let pool = &cache.layer(0)?.k;
        let layout = pool.layout();
        let max_y = ctx.caps().max_compute_workgroups_per_dimension as usize;
        if layout.num_kv_heads > max_y {
            return Err(Error::InvalidArgument(format!(
                "append: {} KV heads exceed the adapter's {max_y} workgroups per dimension",
                layout.num_kv_heads
            )));
        }
        let list_bytes = (max_rows as u64)
            .checked_mul(8)
            .filter(|&b| b <= ctx.device.limits().max_storage_buffer_binding_size)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "an append plan of {max_rows} rows: its row list exceeds one storage binding"
                ))
            })?;
        fit_u32("append plan rows", max_rows * 2)?;
        // Parameter slots: per pool buffer, enough dispatches for the rows it can take.
        let bpb = pool.blocks_per_buffer();
        let mut buffer_slots = Vec::new();
        let mut slot_buffer = Vec::new();
        for b in 0..pool.buffers().len() {
            let blocks = bpb.min(pool.num_blocks() - b * bpb);
            let most = max_rows.min(blocks * layout.block_size);
            let n = most.div_ceil(max_y).max(1);
            buffer_slots.push((slot_buffer.len(), n));
            slot_buffer.extend(std::iter::repeat_n(b, n));
        }
        let align = u64::from(ctx.device.limits().min_uniform_buffer_offset_alignment);
        let slot_stride = PARAMS_BYTES.div_ceil(align.max(1)) * align.max(1);
        let list = ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some("append plan rows"),
            size: list_bytes.max(MIN_LIST_BYTES),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })?;
        let params = ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some("append plan params"),
            size: slot_stride * slot_buffer.len() as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })?;
        Ok(Self {
            cache_id: cache.id(),
            max_rows,
            layers: cache.config().layers,
            num_kv_heads: layout.num_kv_heads as u32,
            block_size: layout.block_size as u32,
            blocks_per_buffer: bpb,
            pool_slots: (pool.num_blocks() * layout.block_size) as u64,
            list,
            params,
            slot_stride,
            buffer_slots,
            slot_buffer,
            step: Vec::new(),
            rows: 0,
            gate: UpdateGate::default(),
            binds: Mutex::new((0..cache.config().layers).map(|_| None).collect()),
        })
    }

    /// Whether [`update`](Self::update) may run now (see [`UpdateGate`]): false after the plan
    /// was recorded until a submission follows.
    pub fn may_update(&self, ctx: &Context) -> bool {
        self.gate.may_update(ctx)
    }

    /// Most rows one step may append.
    pub fn capacity(&self) -> usize {
        self.max_rows
    }

    /// Rows of the step the plan was last updated with.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Writes the rows of `batch` (the step's new tokens, see
    /// [`PagedKvCache::append_tokens`]) into the plan with [`Context::write_buffer`]; they land
    /// at the next submission. Creates nothing.
    ///
    /// # Errors
    /// Nothing is written on error. [`Error::InvalidArgument`] when `cache` is not the cache the
    /// plan was made for, the batch holds more rows than the plan's capacity or a slot outside
    /// the pool, or the plan was recorded since its last update and no submission followed (see
    /// [`UpdateGate`]); [`Error::DeviceLost`].
    pub fn update(
        &mut self,
        ctx: &Context,
        cache: &PagedKvCache,
        batch: &AppendBatch,
    ) -> Result<()> {
        self.check_cache(cache)?;
        self.gate.check_update(ctx, "an AppendPlan")?;
        let slots = batch.slots();
        if slots.len() > self.max_rows {
            return Err(Error::InvalidArgument(format!(
                "an append of {} rows exceeds the plan's capacity of {} rows",
                slots.len(),
                self.max_rows
            )));
        }
        if let Some(&bad) = slots.iter().find(|&&s| u64::from(s) >= self.pool_slots) {
            return Err(Error::InvalidArgument(format!(
                "slot {bad} outside the pool's {} slots",
                self.pool_slots
            )));
        }
        // (source row, slot) pairs grouped by pool buffer, batch order inside a buffer.
        let slots_per_buffer = self.blocks_per_buffer as u64 * u64::from(self.block_size);
        let buffers = self.buffer_slots.len();
        let buffer_of = |slot: u32| (u64::from(slot) / slots_per_buffer) as usize;
        let mut counts = vec![0usize; buffers];
        for &s in slots {
            counts[buffer_of(s)] += 1;
        }
        let mut starts = vec![0usize; buffers];
        for b in 1..buffers {
            starts[b] = starts[b - 1] + counts[b - 1];
        }
        let mut next = starts.clone();
        let mut words = vec![0u32; 2 * slots.len()];
        for (i, &s) in slots.iter().enumerate() {
            let at = &mut next[buffer_of(s)];
            words[2 * *at] = i as u32;
            words[2 * *at + 1] = s;
            *at += 1;
        }
        let max_y = ctx.caps().max_compute_workgroups_per_dimension as usize;
        let mut step = Vec::new();
        let mut writes = Vec::new();
        for b in 0..buffers {
            if counts[b] == 0 {
                continue;
            }
            let (first_slot, n_slots) = self.buffer_slots[b];
            let chunks = counts[b].div_ceil(max_y);
            if chunks > n_slots {
                return Err(Error::InvalidArgument(format!(
                    "an append of {} rows into pool buffer {b} lists a slot twice",
                    counts[b]
                )));
            }
            let end = starts[b] + counts[b];
            for c in 0..chunks {
                let base = starts[b] + c * max_y;
                let params = AppendParams {
                    num_entries: end as u32,
                    entry_base: base as u32,
                    num_kv_heads: self.num_kv_heads,
                    block_size: self.block_size,
                    first_block: (b * self.blocks_per_buffer) as u32,
                    ..Default::default()
                };
                writes.push((first_slot + c, params));
                step.push(StepDispatch {
                    slot: first_slot + c,
                    entries: (end - base).min(max_y) as u32,
                });
            }
        }
        ctx.write_buffer(&self.list, 0, bytemuck::cast_slice(&words))?;
        for (slot, params) in &writes {
            ctx.write_buffer(
                &self.params,
                *slot as u64 * self.slot_stride,
                bytemuck::bytes_of(params),
            )?;
        }
        self.step = step;
        self.rows = slots.len();
        self.gate.updated(ctx);
        Ok(())
    }

    fn check_cache(&self, cache: &PagedKvCache) -> Result<()> {
        if cache.id() != self.cache_id {
            return Err(Error::InvalidArgument(
                "this AppendPlan was made for another cache".into(),
            ));
        }
        Ok(())
    }

    /// The bind groups writing `pool` from `src`, one per parameter slot.
    fn groups(
        &self,
        ctx: &Context,
        pipeline: &wgpu::ComputePipeline,
        pool: &BlockPool,
        src: &BindingKey,
        src_dtype: SourceDtype,
    ) -> Result<Vec<wgpu::BindGroup>> {
        let size = NonZeroU64::new(PARAMS_BYTES).expect("params are not empty");
        self.slot_buffer
            .iter()
            .enumerate()
            .map(|(slot, &b)| {
                ctx.bind_group(
                    "append plan",
                    pipeline,
                    &bindings(
                        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: &self.params,
                            offset: slot as u64 * self.slot_stride,
                            size: Some(size),
                        }),
                        src.buffer_binding(),
                        src_dtype,
                        &self.list,
                        pool,
                        b,
                    ),
                )
            })
            .collect()
    }

    /// Records the append of the current step's rows into layer `io.layer` of `io.cache` (the
    /// K dispatches, then the V dispatches) into `pass`. The layer's bind groups are made by
    /// its first encode (and again when its K/V bindings or source type change); otherwise this
    /// creates nothing. Submit the pass's encoder with [`Context::submit`] before the next
    /// [`update`](Self::update).
    ///
    /// # Errors
    /// Everything is checked and every bind group made before the first dispatch is recorded:
    /// [`Error::InvalidArgument`] when `io.cache` is not the plan's cache, the layer does not
    /// exist, the plan was never updated, a source lacks `STORAGE` usage, is bound at an offset
    /// not aligned to `min_storage_buffer_offset_alignment` or is one of the cache's pool
    /// buffers; [`Error::ShapeMismatch`] when a source binding holds fewer bytes than the
    /// step's rows need; [`Error::TooLarge`] past the storage binding limit; creation errors.
    pub fn encode(
        &self,
        ctx: &Context,
        pass: &mut wgpu::ComputePass<'_>,
        io: &AppendIo<'_>,
    ) -> Result<()> {
        self.check_cache(io.cache)?;
        if io.layer >= self.layers {
            return Err(Error::InvalidArgument(format!(
                "layer {} of {}",
                io.layer, self.layers
            )));
        }
        let pools = check_io(ctx, io, self.rows)?;
        let (k, v) = (BindingKey::of(&io.k), BindingKey::of(&io.v));
        let mut binds = self.binds.lock().unwrap_or_else(PoisonError::into_inner);
        let fresh = binds[io.layer]
            .as_ref()
            .is_none_or(|b| b.k != k || b.v != v || b.src != io.src);
        if fresh {
            let pk = append_pipeline(ctx, &pools.k, io.src)?;
            let pv = append_pipeline(ctx, &pools.v, io.src)?;
            let gk = self.groups(ctx, &pk, &pools.k, &k, io.src)?;
            let gv = self.groups(ctx, &pv, &pools.v, &v, io.src)?;
            binds[io.layer] = Some(LayerBinds {
                k,
                v,
                src: io.src,
                pipelines: [pk, pv],
                groups: [gk, gv],
            });
        }
        let layer = binds[io.layer]
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("append plan: no bind groups".into()))?;
        self.gate.record("an AppendPlan")?;
        for (t, pool) in [&pools.k, &pools.v].into_iter().enumerate() {
            pass.set_pipeline(&layer.pipelines[t]);
            for d in &self.step {
                pass.set_bind_group(0, &layer.groups[t][d.slot], &[]);
                pass.dispatch_workgroups(self.num_kv_heads, workgroups_for(pool, d.entries), 1);
            }
        }
        Ok(())
    }
}
