//! The host planning of one step of a [`PagedAttentionPlan`](super::PagedAttentionPlan): work
//! items, merge tiles, item lists per dispatch and the metadata words, and the workspace a
//! [`PlanCapacity`](super::paged_plan::PlanCapacity) needs at worst. Pure host code: nothing here touches the
//! GPU.

use super::paged::{KvGeometry, SeqSpec, ITEM_WORDS, LANE_WG, SEQ_WORDS, TILE_WORDS};
use super::{AttentionOptions, AttentionShape};
use crate::gpu::AttentionKernel;
use crate::{Error, Result};

/// What a plan keeps fixed for its whole life (everything the planner needs besides the batch).
#[derive(Debug, Clone)]
pub(crate) struct Fixed {
    pub shape: AttentionShape,
    pub options: AttentionOptions,
    pub split_tokens: usize,
    /// Rows per tile (the WGSL `TILE`).
    pub tile: usize,
    pub kernel: AttentionKernel,
    /// The workgroup kernel's layout (None for the lanes kernel).
    pub layout: Option<super::paged::WorkgroupLayout>,
    pub geometry: KvGeometry,
    /// Items one dispatch takes at most.
    pub per_dispatch: usize,
    /// The adapter's workgroups per dimension.
    pub max_x: usize,
    /// Pool buffers (K and V each) one dispatch of the kernel may bind
    /// ([`DeviceFit::pool_slots`](super::paged::DeviceFit::pool_slots)).
    pub slot_budget: usize,
}

impl Fixed {
    /// Whether every dispatch binds the whole pool (all its buffers), so that items are never
    /// cut where a sequence's blocks change buffer: a pool of at most
    /// [`slot_budget`](Self::slot_budget) buffers (what the device's storage bindings allow
    /// the kernel), unless the caller dispatches buffer by buffer. Then a row's splits depend
    /// on its sequence's length alone, never on which buffer the allocator put a block in.
    pub fn binds_whole_pool(&self) -> bool {
        !self.geometry.per_buffer && self.geometry.num_buffers <= self.slot_budget
    }

    /// Pool buffers each attend dispatch binds: all of them where it
    /// [binds the whole pool](Self::binds_whole_pool), else one.
    pub fn pool_slots(&self) -> usize {
        if self.binds_whole_pool() {
            self.geometry.num_buffers.max(1)
        } else {
            1
        }
    }
}

/// One attend dispatch of a step: its pool buffer, its chunk of that buffer's items, how many
/// items it takes and where its item list starts in the metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepDispatch {
    pub buffer: usize,
    pub chunk: usize,
    pub list_len: usize,
    pub list_at: usize,
}

/// One planned step: the metadata words and what the parameters of each dispatch point at.
#[derive(Debug, Clone)]
pub(crate) struct Step {
    pub meta: Vec<u32>,
    pub dispatches: Vec<StepDispatch>,
    pub items_at: usize,
    pub seqs_at: usize,
    pub slopes_at: usize,
    pub sinks_at: usize,
    pub tiles_at: usize,
    /// The sliding window as the kernels receive it (0: none).
    pub window: u32,
    pub total_q: usize,
    pub num_items: usize,
    pub num_tiles: usize,
}

/// The sizes the GPU workspace of a plan is created for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkspaceSize {
    /// Work items (each a partial state of `tile` rows per KV head).
    pub items: usize,
    /// Merge tiles.
    pub tiles: usize,
    /// Words of the metadata buffer.
    pub meta_words: usize,
    /// Dispatches per pool buffer (each with its own parameter uniform).
    pub chunks_per_buffer: usize,
}

impl Step {
    /// The workspace this step needs exactly.
    pub fn size(&self, num_buffers: usize) -> WorkspaceSize {
        let chunks_per_buffer = (0..num_buffers)
            .map(|b| self.dispatches.iter().filter(|d| d.buffer == b).count())
            .max()
            .unwrap_or(0)
            .max(1);
        WorkspaceSize {
            items: self.num_items,
            tiles: self.num_tiles,
            meta_words: self.meta.len(),
            chunks_per_buffer,
        }
    }
}

/// `a * b` or [`Error::InvalidArgument`] naming `what` when it overflows.
fn mul(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| {
        Error::InvalidArgument(format!("plan capacity: {what} overflows ({a} * {b})"))
    })
}

fn add(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_add(b).ok_or_else(|| {
        Error::InvalidArgument(format!("plan capacity: {what} overflows ({a} + {b})"))
    })
}

impl Fixed {
    /// The workspace a batch within `capacity` needs at worst. With `S = min(max_seqs,
    /// max_q_tokens)` sequences (each has a query), `Q = max_q_tokens`, `B = max_blocks_per_seq`,
    /// `L = B * block_size` keys, `G` the GQA group, `T` the tile and `P` the pool buffers:
    ///
    /// - tiles: a sequence of `q` queries has `ceil(q G / T)` tiles, and summed over at most `S`
    ///   sequences of `Q` queries that is at most `(Q G + S (T - 1)) / T`;
    /// - items per tile: the tile's keys lie in `0..L`, cut at multiples of `split_tokens`
    ///   (at most `ceil(L / split_tokens)` pieces) and, with `P > 1` buffers not bound whole
    ///   ([`binds_whole_pool`](Self::binds_whole_pool)), also where the block table
    ///   changes buffer (at most once per block boundary: `B - 1` more);
    /// - items: tiles times items per tile;
    /// - dispatches per buffer: `ceil(items / items per dispatch)`;
    /// - metadata words: `8 items + 4 S + 2 Hq + 5 tiles + S B + items` (items, sequences, ALiBi
    ///   slopes and sinks, merge tiles, block tables, item lists).
    pub fn worst_case(&self, capacity: &super::paged_plan::PlanCapacity) -> Result<WorkspaceSize> {
        let seqs = capacity.max_seqs.min(capacity.max_q_tokens);
        let group = self.shape.group();
        let tile = self.tile;
        let rows = mul("query rows", capacity.max_q_tokens, group)?;
        let tiles = add("tiles", rows, mul("tiles", seqs, tile - 1)?)? / tile;
        let keys = mul(
            "keys",
            capacity.max_blocks_per_seq,
            self.geometry.k.block_size,
        )?;
        let mut per_tile = keys.div_ceil(self.split_tokens);
        if self.geometry.num_buffers > 1 && !self.binds_whole_pool() {
            per_tile = add("items per tile", per_tile, capacity.max_blocks_per_seq - 1)?;
        }
        let items = mul("work items", tiles, per_tile)?;
        let chunks_per_buffer = items.div_ceil(self.per_dispatch).max(1);
        let mut meta_words = mul("metadata", items, ITEM_WORDS + 1)?;
        meta_words = add("metadata", meta_words, mul("metadata", seqs, SEQ_WORDS)?)?;
        meta_words = add("metadata", meta_words, 2 * self.shape.num_q_heads)?;
        meta_words = add("metadata", meta_words, mul("metadata", tiles, TILE_WORDS)?)?;
        meta_words = add(
            "metadata",
            meta_words,
            mul("metadata", seqs, capacity.max_blocks_per_seq)?,
        )?;
        Ok(WorkspaceSize {
            items,
            tiles,
            meta_words,
            chunks_per_buffer,
        })
    }

    /// Checks every sequence (lengths, masks, block tables) and plans the step: the same items,
    /// tiles, splits and metadata for a given batch whatever the plan's capacity.
    pub fn plan(&self, seqs: &[SeqSpec]) -> Result<Step> {
        let shape = self.shape;
        let opts = &self.options;
        let geometry = &self.geometry;
        let bs = geometry.k.block_size;
        if seqs.is_empty() {
            return Err(Error::InvalidArgument("an empty batch".into()));
        }
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
        let tile = self.tile;
        let split_tokens = self.split_tokens;
        // A window at least as long as every sequence's keys masks nothing: it is no window.
        // What remains is shorter than a sequence (at most MAX_TOKENS), so it fits a u32 and the
        // kernels' `p - j < window` never meets a wrapped sum.
        let max_len_k = seqs.iter().map(|s| s.len_k).max().unwrap_or(0);
        let window = opts
            .sliding_window
            .filter(|&w| opts.causal && w < max_len_k);
        let bpb = geometry.blocks_per_buffer;
        // The buffer of a block as the dispatches see it (all one when they bind the whole
        // pool).
        let whole = self.binds_whole_pool();
        let buffer_of = |block: u32| if whole { 0 } else { block as usize / bpb };

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
                    let buffer = buffer_of(s.table[k0 / bs]);
                    let mut k1 = ((k0 / split_tokens + 1) * split_tokens).min(hi);
                    // End the item where the blocks leave this buffer.
                    let mut k = (k0 / bs + 1) * bs;
                    while k < k1 {
                        if buffer_of(s.table[k / bs]) != buffer {
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
        let mut dispatches = Vec::new();
        for buffer in 0..geometry.num_buffers {
            let ids: Vec<u32> = (0..items.len())
                .filter(|&i| item_buffer[i] == buffer)
                .map(|i| i as u32)
                .collect();
            for (chunk, list) in ids.chunks(self.per_dispatch).enumerate() {
                dispatches.push(StepDispatch {
                    buffer,
                    chunk,
                    list_len: list.len(),
                    list_at: meta.len(),
                });
                meta.extend(list);
            }
        }
        if tiles.len() > self.max_x {
            return Err(Error::InvalidArgument(format!(
                "{} row tiles exceed the adapter's {} workgroups per dimension; split the batch",
                tiles.len(),
                self.max_x
            )));
        }
        Ok(Step {
            meta,
            dispatches,
            items_at,
            seqs_at,
            slopes_at,
            sinks_at,
            tiles_at,
            window: window.map_or(0, |w| w as u32),
            total_q: seqs.iter().map(|s| s.len_q).sum(),
            num_items: items.len(),
            num_tiles: tiles.len(),
        })
    }
}

/// Items one dispatch takes: a workgroup each, or a KV head's invocation each.
pub(crate) fn items_per_dispatch(kernel: AttentionKernel, max_x: usize, kv_heads: usize) -> usize {
    match kernel {
        AttentionKernel::Workgroup => max_x,
        AttentionKernel::Lanes => (max_x * LANE_WG as usize / kv_heads).max(1),
    }
}

/// Rows per tile of a plan whose sequences have at most `max_rows` query rows (`group` a
/// token), in a layout whose tiles hold at most `full_tile`: one token's group exactly (a decode
/// plan keeps the tile of its group), else `max_rows` rounded up to a multiple of 4, at most the
/// full tile. Every tile size is a pipeline variant of its own, which a CPU adapter compiles for
/// seconds at its first dispatch: so chunks of 9 to 12 rows share one variant and 13 to 16
/// another rather than compiling one each. The rows past a tile's last are computed and never
/// written (the lane sums add rows four at a time anyway), and a row's bits do not depend on its
/// tile.
pub(crate) fn plan_tile(full_tile: usize, max_rows: usize, group: usize) -> usize {
    let rows = if max_rows <= group {
        max_rows
    } else {
        max_rows.next_multiple_of(4)
    };
    full_tile.min(rows).max(1)
}

#[cfg(test)]
mod tests {
    use super::plan_tile;

    #[test]
    fn plan_tiles_are_a_group_or_a_multiple_of_four() {
        // (full tile, most rows, group) -> tile
        for (full, rows, group, tile) in [
            (16, 1, 1, 1),    // MHA decode
            (16, 3, 3, 3),    // GQA decode, group 3
            (16, 6, 3, 8),    // two tokens of group 3
            (16, 9, 3, 12),   // three
            (16, 15, 3, 16),  // five
            (16, 60, 3, 16),  // a long chunk: the full tile
            (16, 2, 1, 4),    // two tokens, MHA
            (16, 32, 32, 16), // a group wider than the tile
            (6, 5, 1, 6),     // a full tile that is not a multiple of 4
            (16, 0, 4, 1),    // no rows: one
        ] {
            assert_eq!(plan_tile(full, rows, group), tile, "{full} {rows} {group}");
        }
    }
}
