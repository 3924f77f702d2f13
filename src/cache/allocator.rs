//! [`BlockAllocator`]: block tables of a paged KV cache (pure Rust, no GPU).
//!
//! The pool holds `num_blocks` blocks of `block_size` token slots. Each sequence has a block
//! table (its blocks in token order) and its token ids; token `t` of a sequence lives in slot
//! `table[t / block_size] * block_size + t % block_size` of the pool. Blocks are reference
//! counted: [`BlockAllocator::fork`] and prefix-cache hits share blocks between sequences, and
//! a shared partial last block is copied on the next append (copy-on-write).
//!
//! # Free queue and eviction
//!
//! Free blocks sit in one queue (an intrusive doubly linked list over block ids, O(1) removal).
//! Allocation takes the front. When a block's last holder lets go of it, it goes to the *back*
//! if it holds a cached prefix (so cached blocks are evicted least recently freed first; a
//! sequence's blocks are released last-to-first, so a chain's tail is evicted before its head)
//! and to the *front* if it holds nothing worth keeping. A free cached block keeps its cache
//! entry and still counts as free; a prefix hit takes it out of the queue, and allocating it
//! for other content drops the entry (an eviction). So [`BlockAllocator::free`] returns
//! capacity at once and eviction is LRU.
//!
//! # Copy-on-write and plans
//!
//! [`BlockAllocator::append`] returns an [`AppendPlan`]: the slot of each new token and the
//! block copies to perform first. Execute plans in the order they were made, each plan's copies
//! before its writes. Plans made with no `fork`, `free` or `swap_out` between them may be
//! batched as "all their copies, then all their writes"; a fork must see the rows written by
//! earlier plans, so flush pending writes of a sequence before forking it (and before freeing
//! or swapping out anything whose blocks a pending write targets).
//!
//! # Reservations
//!
//! [`BlockAllocator::reserve`] sets aside free blocks for a sequence's future tokens: other
//! sequences (appends, prefix hits on free cached blocks, swap-ins) cannot take them, and the
//! sequence's appends draw on them first. Reserved blocks are a count, not particular blocks;
//! they stay in the free queue and count as free.

use std::collections::BTreeMap;

use super::prefix::{EntryRef, PrefixCache, Registration, ROOT_HASH};
use super::telemetry::Telemetry;
use crate::{Error, Result};

/// Index of a block in the pool.
pub type BlockId = u32;

/// A sequence's id, chosen by the caller.
pub type SeqId = u64;

/// End-of-list marker of the free queue (never a block id: there are fewer than 2^31 blocks).
const NIL: u32 = u32::MAX;

/// Shape of the pool and whether full blocks are shared through the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocatorConfig {
    /// Blocks in the pool: at least 1, below 2^31, and `num_blocks * block_size <= 2^32` so
    /// every slot fits a `u32`.
    pub num_blocks: usize,
    /// Token slots per block: a power of two from 1 to 256.
    pub block_size: usize,
    /// Register full blocks in the prefix cache and reuse them for new prompts.
    pub prefix_caching: bool,
}

impl AllocatorConfig {
    /// `num_blocks` blocks of `block_size` slots, prefix caching on.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            prefix_caching: true,
        }
    }
}

/// Where an append's tokens go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AppendPlan {
    /// Physical token slot of each appended token: block_id * block_size + offset, in order.
    pub slots: Vec<u32>,
    /// Copy-on-write: copy the whole block `src` into `dst` BEFORE writing the new rows (the GPU
    /// side does the copy). At most one pair per plan (the shared partial last block).
    pub copies: Vec<(BlockId, BlockId)>,
}

/// What [`BlockAllocator::swap_out`] returns and [`BlockAllocator::swap_in`] needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwappedSeq {
    /// The sequence's token ids.
    pub tokens: Vec<u32>,
    /// The block table the sequence had (for the caller's record): the host copy of
    /// `blocks[i]` goes into block `i` of the table `swap_in` returns.
    pub blocks: Vec<BlockId>,
    /// Block size of the allocator it came from (`swap_in` refuses another).
    pub block_size: usize,
}

/// Counters of what happened, reported by [`BlockAllocator::telemetry`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counters {
    prefix_hits: u64,
    prefix_misses: u64,
    evictions: u64,
    cow_copies: u64,
    swaps_out: u64,
    swaps_in: u64,
    failed_admissions: u64,
}

/// The free blocks, in allocation order: an intrusive doubly linked list over block ids.
#[derive(Clone, Debug)]
struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// Every block free, in id order.
    fn all(n: usize) -> Result<Self> {
        let mut prev = filled(n, NIL)?;
        let mut next = filled(n, NIL)?;
        for i in 0..n {
            if i > 0 {
                prev[i] = i as u32 - 1;
            }
            if i + 1 < n {
                next[i] = i as u32 + 1;
            }
        }
        Ok(Self {
            prev,
            next,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n as u32 - 1 },
            len: n,
        })
    }

    fn push_back(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.len += 1;
    }

    fn push_front(&mut self, b: u32) {
        self.next[b as usize] = self.head;
        self.prev[b as usize] = NIL;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.len += 1;
    }

    /// Unlinks `b`, which must be in the queue.
    fn remove(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    /// Front to back; stops after `next.len()` steps even if the links were corrupted.
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        let mut left = self.next.len();
        std::iter::from_fn(move || {
            if cur == NIL || left == 0 {
                return None;
            }
            left -= 1;
            let b = cur;
            cur = self.next[b as usize];
            Some(b)
        })
    }
}

/// One sequence's state.
#[derive(Clone, Debug, Default)]
struct Sequence {
    tokens: Vec<u32>,
    table: Vec<BlockId>,
    /// With prefix caching: the chain key of each full block.
    chain: Vec<u64>,
    /// With prefix caching: for each full block, the cache entry holding identical content
    /// (this block's own entry or an identical one elsewhere), if known.
    entries: Vec<Option<EntryRef>>,
    /// Blocks reserved for this sequence's future appends.
    reserved: usize,
}

/// Block tables, reference counts, the free queue, the prefix cache and reservations of a paged
/// KV cache. See the [module docs](self) for the policies.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    cfg: AllocatorConfig,
    refcount: Vec<u32>,
    queue: FreeQueue,
    cache: PrefixCache,
    seqs: BTreeMap<SeqId, Sequence>,
    /// Sum of the sequences' reservations.
    reserved: usize,
    counters: Counters,
}

/// `n` copies of `v`, or [`Error::InvalidArgument`] if the memory cannot be had (a huge pool).
pub(crate) fn filled<T: Clone>(n: usize, v: T) -> Result<Vec<T>> {
    let mut x = Vec::new();
    x.try_reserve_exact(n).map_err(|_| {
        Error::InvalidArgument(format!("cannot allocate the bookkeeping of {n} blocks"))
    })?;
    x.resize(n, v);
    Ok(x)
}

/// Takes the front free block for new content: its cache entry, if any, is evicted. The caller
/// has checked that a block is free.
fn take_block(
    queue: &mut FreeQueue,
    refcount: &mut [u32],
    cache: &mut PrefixCache,
    counters: &mut Counters,
) -> BlockId {
    let b = queue
        .pop_front()
        .expect("the caller checked that enough blocks are free");
    if cache.remove_block(b) {
        counters.evictions += 1;
    }
    refcount[b as usize] = 1;
    b
}

/// Drops one reference to each block of `table`, last block first; blocks nobody holds any
/// more return to the free queue (cached ones to the back, others to the front).
fn release(queue: &mut FreeQueue, refcount: &mut [u32], cache: &PrefixCache, table: &[BlockId]) {
    for &b in table.iter().rev() {
        let rc = &mut refcount[b as usize];
        *rc -= 1;
        if *rc == 0 {
            if cache.is_cached(b) {
                queue.push_back(b);
            } else {
                queue.push_front(b);
            }
        }
    }
}

/// Registers the full blocks `from..to` of `seq` (which must have their tokens and blocks) in
/// the cache, extending `seq.chain` and `seq.entries`.
fn register_full(cache: &mut PrefixCache, seq: &mut Sequence, bs: usize, from: usize, to: usize) {
    debug_assert_eq!(seq.chain.len(), from);
    for i in from..to {
        let tokens = &seq.tokens[i * bs..(i + 1) * bs];
        let parent_key = if i == 0 { ROOT_HASH } else { seq.chain[i - 1] };
        let key = cache.key(parent_key, tokens);
        let entry = match (i, seq.entries.last().copied().flatten()) {
            (0, _) => Some(None),
            (_, Some(p)) => Some(Some(p)),
            // The previous block has no entry: this one cannot be found by a lookup either.
            (_, None) => None,
        }
        .and_then(
            |parent| match cache.register(key, parent, seq.table[i], tokens) {
                Registration::Inserted(r) | Registration::Existing(r) => Some(r),
                Registration::NotRegistered => None,
            },
        );
        seq.chain.push(key);
        seq.entries.push(entry);
    }
}

impl BlockAllocator {
    /// An allocator with every block free. [`Error::InvalidArgument`] unless `block_size` is a
    /// power of two from 1 to 256 and `1 <= num_blocks < 2^31` with
    /// `num_blocks * block_size <= 2^32` (or if its bookkeeping, about 20 bytes per block,
    /// cannot be allocated).
    pub fn new(cfg: AllocatorConfig) -> Result<Self> {
        let bs = cfg.block_size;
        if !(1..=256).contains(&bs) || !bs.is_power_of_two() {
            return Err(Error::InvalidArgument(format!(
                "block size must be a power of two from 1 to 256, got {bs}"
            )));
        }
        let n = cfg.num_blocks;
        if n == 0 || n >= 1 << 31 {
            return Err(Error::InvalidArgument(format!(
                "the pool needs 1 to 2^31 - 1 blocks, got {n}"
            )));
        }
        if n as u64 * bs as u64 > 1 << 32 {
            return Err(Error::InvalidArgument(format!(
                "{n} blocks of {bs} slots exceed 2^32 token slots (slots are u32)"
            )));
        }
        Ok(Self {
            cfg,
            refcount: filled(n, 0)?,
            queue: FreeQueue::all(n)?,
            cache: PrefixCache::new(n)?,
            seqs: BTreeMap::new(),
            reserved: 0,
            counters: Counters::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> AllocatorConfig {
        self.cfg
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.cfg.num_blocks
    }

    /// Blocks free for allocation, including unreferenced blocks still holding cached prefixes
    /// and blocks set aside by reservations.
    pub fn num_free_blocks(&self) -> usize {
        self.queue.len
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used_blocks(&self) -> usize {
        self.cfg.num_blocks - self.queue.len
    }

    /// Free blocks set aside by reservations.
    pub fn num_reserved_blocks(&self) -> usize {
        self.reserved
    }

    /// Blocks needed to hold `tokens` tokens: `ceil(tokens / block_size)`.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Whether a new sequence of `tokens` tokens fits now in free blocks nobody reserved
    /// (prefix hits, which may need fewer blocks, are not counted).
    pub fn can_admit(&self, tokens: usize) -> bool {
        self.blocks_for(tokens) <= self.unreserved()
    }

    /// Free blocks not set aside by reservations.
    fn unreserved(&self) -> usize {
        self.queue.len - self.reserved
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq))
    }

    /// Blocks an append of `n` tokens to `s` needs now: new blocks plus one copy if the last
    /// block is partial and shared.
    fn blocks_to_append(&self, s: &Sequence, n: usize) -> Result<usize> {
        if n == 0 {
            return Ok(0);
        }
        let len = s.tokens.len();
        let total = len.checked_add(n).ok_or_else(|| {
            Error::InvalidArgument(format!("{n} more tokens overflow the sequence length"))
        })?;
        let cow = len % self.cfg.block_size != 0
            && s.table
                .last()
                .is_some_and(|&b| self.refcount[b as usize] > 1);
        Ok(self.blocks_for(total) - s.table.len() + usize::from(cow))
    }

    /// Sets aside the blocks that appending `tokens` more tokens to `seq` would need now
    /// (including a copy-on-write block if its partial last block is shared), replacing any
    /// earlier reservation of `seq` (`tokens == 0` releases it). Its appends draw on the
    /// reservation first; other sequences cannot take reserved blocks. [`Error::OutOfBlocks`]
    /// (nothing changes) if the free blocks nobody else reserved do not suffice. The
    /// reservation is released with the sequence (`free`, `swap_out`); a fork does not inherit
    /// it.
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<()> {
        let s = self.seq(seq)?;
        let needed = self.blocks_to_append(s, tokens)?;
        let old = s.reserved;
        let available = self.unreserved() + old;
        if needed > available {
            self.counters.failed_admissions += 1;
            return Err(Error::OutOfBlocks { needed, available });
        }
        self.reserved = self.reserved - old + needed;
        self.seqs.get_mut(&seq).expect("checked above").reserved = needed;
        Ok(())
    }

    /// Creates an empty sequence `seq`. With prefix caching, the longest run of leading full
    /// blocks of `prompt` found in the prefix cache (same tokens after the same prefix) is
    /// attached, shared, and the number of tokens it covers is returned: a multiple of the
    /// block size, 0 without hits or without prefix caching. The caller then appends
    /// `prompt[cached..]`. (To always have at least one token left to compute, pass
    /// `&prompt[..prompt.len() - 1]`.) The run stops early rather than take a free cached block
    /// that reservations need. [`Error::SequenceExists`] if the id is taken.
    pub fn add_sequence(&mut self, seq: SeqId, prompt: &[u32]) -> Result<usize> {
        if self.seqs.contains_key(&seq) {
            return Err(Error::SequenceExists(seq));
        }
        let mut s = Sequence::default();
        if self.cfg.prefix_caching {
            let bs = self.cfg.block_size;
            let full = prompt.len() / bs;
            let mut unreserved = self.unreserved();
            let mut parent_key = ROOT_HASH;
            let mut parent = None;
            for i in 0..full {
                let tokens = &prompt[i * bs..(i + 1) * bs];
                let key = self.cache.key(parent_key, tokens);
                let Some(e) = self.cache.lookup(key, parent, tokens) else {
                    break;
                };
                let (b, r) = (e.block(), EntryRef { key, id: e.id() });
                if self.refcount[b as usize] == 0 {
                    if unreserved == 0 {
                        break;
                    }
                    unreserved -= 1;
                    self.queue.remove(b);
                }
                self.refcount[b as usize] += 1;
                s.table.push(b);
                s.chain.push(key);
                s.entries.push(Some(r));
                parent_key = key;
                parent = Some(r);
            }
            let hits = s.table.len();
            s.tokens = prompt[..hits * bs].to_vec();
            self.counters.prefix_hits += hits as u64;
            self.counters.prefix_misses += (full - hits) as u64;
        }
        let cached = s.tokens.len();
        self.seqs.insert(seq, s);
        Ok(cached)
    }

    /// Allocates slots for `tokens` new tokens of `seq` (their ids are kept: they key the prefix
    /// cache). A shared partial last block is first copied into a new block (an entry in
    /// `copies`; the table then points at the copy). Blocks that become full are registered in
    /// the prefix cache unless identical content is already cached. On
    /// [`Error::OutOfBlocks`] nothing changes but the failure counter. An empty `tokens` gives
    /// an empty plan.
    pub fn append(&mut self, seq: SeqId, tokens: &[u32]) -> Result<AppendPlan> {
        let s = self.seq(seq)?;
        let needed = self.blocks_to_append(s, tokens.len())?;
        let available = self.unreserved() + s.reserved;
        if needed > available {
            self.counters.failed_admissions += 1;
            return Err(Error::OutOfBlocks { needed, available });
        }
        let mut plan = AppendPlan {
            slots: Vec::with_capacity(tokens.len()),
            copies: Vec::new(),
        };
        if tokens.is_empty() {
            return Ok(plan);
        }
        let bs = self.cfg.block_size;
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let from_reservation = needed.min(s.reserved);
        s.reserved -= from_reservation;
        self.reserved -= from_reservation;

        let len = s.tokens.len();
        if len % bs != 0 {
            let last = s.table.len() - 1;
            let src = s.table[last];
            if self.refcount[src as usize] > 1 {
                let dst = take_block(
                    &mut self.queue,
                    &mut self.refcount,
                    &mut self.cache,
                    &mut self.counters,
                );
                self.refcount[src as usize] -= 1;
                s.table[last] = dst;
                plan.copies.push((src, dst));
                self.counters.cow_copies += 1;
            }
        }
        for pos in len..len + tokens.len() {
            if pos % bs == 0 {
                let b = take_block(
                    &mut self.queue,
                    &mut self.refcount,
                    &mut self.cache,
                    &mut self.counters,
                );
                s.table.push(b);
            }
            plan.slots
                .push(s.table[pos / bs] * bs as u32 + (pos % bs) as u32);
        }
        s.tokens.extend_from_slice(tokens);
        if self.cfg.prefix_caching {
            register_full(&mut self.cache, s, bs, len / bs, s.tokens.len() / bs);
        }
        Ok(plan)
    }

    /// Creates `child` sharing every block of `parent` (reference counts +1) with the same
    /// tokens; the first of them to append to a shared partial last block copies it. No block
    /// is allocated; `parent`'s reservation is not shared.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        let p = self.seq(parent)?;
        if self.seqs.contains_key(&child) {
            return Err(Error::SequenceExists(child));
        }
        let c = Sequence {
            reserved: 0,
            ..p.clone()
        };
        for &b in &c.table {
            self.refcount[b as usize] += 1;
        }
        self.seqs.insert(child, c);
        Ok(())
    }

    /// Ends `seq`: its blocks (those no other sequence holds) and its reservation are free at
    /// once. Cached blocks keep their prefix-cache entries until allocated for other content.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        self.remove(seq).map(|_| ())
    }

    fn remove(&mut self, seq: SeqId) -> Result<Sequence> {
        let s = self.seqs.remove(&seq).ok_or(Error::UnknownSequence(seq))?;
        self.reserved -= s.reserved;
        release(&mut self.queue, &mut self.refcount, &self.cache, &s.table);
        Ok(s)
    }

    /// The block table of `seq`: its blocks in token order.
    pub fn blocks(&self, seq: SeqId) -> Result<&[BlockId]> {
        Ok(&self.seq(seq)?.table)
    }

    /// Tokens in `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.tokens.len())
    }

    /// The token ids of `seq`.
    pub fn tokens(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(seq)?.tokens)
    }

    /// Blocks reserved for `seq`'s future appends.
    pub fn reserved_for(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.reserved)
    }

    /// Whether `seq` exists.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// The live sequences, in increasing id order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Number of sequences holding `block` (0 if it is free or out of range).
    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcount.get(block as usize).copied().unwrap_or(0)
    }

    /// Whether `block` holds a prefix-cache entry.
    pub fn is_cached(&self, block: BlockId) -> bool {
        (block as usize) < self.cfg.num_blocks && self.cache.is_cached(block)
    }

    /// The free blocks in allocation order (the next block allocated first).
    pub fn free_queue(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.queue.iter()
    }

    /// Reorders the free queue by a permutation that depends only on `seed` and the queue's
    /// current contents, so that later allocations take physical blocks in a scattered order
    /// (tests and `kvattn run` use it to check that kernels follow the block tables). Free blocks
    /// without a cache entry are shuffled among themselves and stay in front; free cached blocks
    /// keep their least-recently-freed order behind them, so eviction stays LRU. Nothing else
    /// changes.
    pub fn shuffle_free_queue(&mut self, seed: u64) {
        let (mut plain, cached): (Vec<u32>, Vec<u32>) =
            self.queue.iter().partition(|&b| !self.cache.is_cached(b));
        // Fisher-Yates driven by splitmix64.
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        for i in (1..plain.len()).rev() {
            let j = (next() % (i as u64 + 1)) as usize;
            plain.swap(i, j);
        }
        for &b in plain.iter().chain(&cached) {
            self.queue.remove(b);
        }
        for &b in plain.iter().chain(&cached) {
            self.queue.push_back(b);
        }
    }

    /// Releases `seq`'s blocks and reservation like [`free`](Self::free) and returns what
    /// [`swap_in`](Self::swap_in) needs. Copy the sequence's KV to the host BEFORE calling this:
    /// its blocks may be reused by the next allocation.
    pub fn swap_out(&mut self, seq: SeqId) -> Result<SwappedSeq> {
        let s = self.remove(seq)?;
        self.counters.swaps_out += 1;
        Ok(SwappedSeq {
            tokens: s.tokens,
            blocks: s.table,
            block_size: self.cfg.block_size,
        })
    }

    /// Re-creates `seq` from `swapped` in freshly allocated, unshared blocks (possibly other ids
    /// than it had) and returns its new block table: copy the host data of `swapped.blocks[i]`
    /// into block `i` of it. Its full blocks are registered in the prefix cache as appends would
    /// (before the data is copied in, so copy it before anything reads them).
    /// [`Error::OutOfBlocks`] (nothing changes but the failure counter) if the unreserved free
    /// blocks do not suffice; [`Error::SequenceExists`] if `seq` is live;
    /// [`Error::InvalidArgument`] if `swapped` came from another block size or its block list
    /// does not match its token count.
    pub fn swap_in(&mut self, seq: SeqId, swapped: &SwappedSeq) -> Result<Vec<BlockId>> {
        let bs = self.cfg.block_size;
        if swapped.block_size != bs {
            return Err(Error::InvalidArgument(format!(
                "swapped sequence has block size {}, this allocator {bs}",
                swapped.block_size
            )));
        }
        let needed = self.blocks_for(swapped.tokens.len());
        if swapped.blocks.len() != needed {
            return Err(Error::InvalidArgument(format!(
                "swapped sequence lists {} blocks for {} tokens ({needed} expected)",
                swapped.blocks.len(),
                swapped.tokens.len()
            )));
        }
        if self.seqs.contains_key(&seq) {
            return Err(Error::SequenceExists(seq));
        }
        let available = self.unreserved();
        if needed > available {
            self.counters.failed_admissions += 1;
            return Err(Error::OutOfBlocks { needed, available });
        }
        let mut s = Sequence {
            tokens: swapped.tokens.clone(),
            ..Sequence::default()
        };
        for _ in 0..needed {
            let b = take_block(
                &mut self.queue,
                &mut self.refcount,
                &mut self.cache,
                &mut self.counters,
            );
            s.table.push(b);
        }
        if self.cfg.prefix_caching {
            let full = s.tokens.len() / bs;
            register_full(&mut self.cache, &mut s, bs, 0, full);
        }
        let table = s.table.clone();
        self.seqs.insert(seq, s);
        self.counters.swaps_in += 1;
        Ok(table)
    }

    /// Keeps only the low `bits` bits (1 to 64; 64 is the default) of prefix-cache keys, so
    /// that tests can make different chains collide often. Refused
    /// ([`Error::InvalidArgument`]) unless no sequence exists and the cache is empty.
    pub fn set_prefix_hash_bits(&mut self, bits: u32) -> Result<()> {
        if !self.seqs.is_empty() {
            return Err(Error::InvalidArgument(
                "the prefix hash width can only change while no sequence exists".into(),
            ));
        }
        self.cache.set_hash_bits(bits)
    }

    /// Occupancy and counters; O(num_blocks + total blocks of all tables).
    pub fn telemetry(&self) -> Telemetry {
        let bs = self.cfg.block_size;
        let mut fill = vec![0usize; self.cfg.num_blocks];
        let mut logical = 0;
        for s in self.seqs.values() {
            let len = s.tokens.len();
            logical += len;
            for (i, &b) in s.table.iter().enumerate() {
                let f = &mut fill[b as usize];
                *f = (*f).max((len - i * bs).min(bs));
            }
        }
        let unique: usize = fill.iter().sum();
        let used = self.num_used_blocks();
        let allocated = used * bs;
        let c = self.counters;
        Telemetry {
            sequences: self.seqs.len(),
            logical_tokens: logical,
            unique_tokens: unique,
            allocated_slots: allocated,
            block_utilization: if allocated == 0 {
                0.0
            } else {
                logical as f64 / allocated as f64
            },
            fragmentation_slots: allocated.saturating_sub(logical),
            unused_slots: allocated - unique,
            used_blocks: used,
            free_blocks: self.queue.len,
            reserved_blocks: self.reserved,
            cached_blocks: self.cache.len(),
            cached_free_blocks: self
                .queue
                .iter()
                .filter(|&b| self.cache.is_cached(b))
                .count(),
            total_blocks: self.cfg.num_blocks,
            block_size: bs,
            prefix_hits: c.prefix_hits,
            prefix_misses: c.prefix_misses,
            evictions: c.evictions,
            cow_copies: c.cow_copies,
            swaps_out: c.swaps_out,
            swaps_in: c.swaps_in,
            failed_admissions: c.failed_admissions,
        }
    }

    /// Checks every invariant (for tests), O(num_blocks + tokens): each block is free (in the
    /// queue, once) xor referenced; reference counts equal the number of table entries holding
    /// the block; free + used = total; reservations add up and fit the free blocks; each table
    /// has `ceil(len / block_size)` blocks; the prefix cache is consistent, holds only blocks
    /// that are free or full in every sequence holding them, with those sequences' tokens, and
    /// its chain links agree with the sequences' tokens.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let n = self.cfg.num_blocks;
        let bs = self.cfg.block_size;
        // The free queue: each block once, links consistent, only unreferenced blocks.
        let mut in_queue = vec![false; n];
        let mut count = 0;
        let mut prev = NIL;
        for b in self.queue.iter() {
            let i = b as usize;
            if i >= n {
                return Err(format!("free queue holds block {b} out of range"));
            }
            if in_queue[i] {
                return Err(format!("block {b} is twice in the free queue"));
            }
            if self.queue.prev[i] != prev {
                return Err(format!("free queue back link of block {b} is broken"));
            }
            in_queue[i] = true;
            count += 1;
            prev = b;
        }
        if prev != self.queue.tail {
            return Err("free queue tail is not its last block".into());
        }
        if count != self.queue.len {
            return Err(format!(
                "free queue links {count} blocks but counts {}",
                self.queue.len
            ));
        }
        // Reference counts against the tables.
        let mut holders = vec![0u32; n];
        let mut reserved = 0;
        for (&id, s) in &self.seqs {
            if s.table.len() != s.tokens.len().div_ceil(bs) {
                return Err(format!(
                    "sequence {id} has {} tokens in {} blocks",
                    s.tokens.len(),
                    s.table.len()
                ));
            }
            for &b in &s.table {
                if b as usize >= n {
                    return Err(format!("sequence {id} holds block {b} out of range"));
                }
                holders[b as usize] += 1;
            }
            reserved += s.reserved;
        }
        for b in 0..n {
            if holders[b] != self.refcount[b] {
                return Err(format!(
                    "block {b} has refcount {} but {} table entries",
                    self.refcount[b], holders[b]
                ));
            }
            if (self.refcount[b] == 0) != in_queue[b] {
                return Err(format!(
                    "block {b}: refcount {}, in free queue: {}",
                    self.refcount[b], in_queue[b]
                ));
            }
        }
        let used = self.refcount.iter().filter(|&&r| r > 0).count();
        if used + self.queue.len != n {
            return Err(format!(
                "{used} used + {} free blocks != {n}",
                self.queue.len
            ));
        }
        if reserved != self.reserved {
            return Err(format!(
                "reservations add up to {reserved} but the total says {}",
                self.reserved
            ));
        }
        if self.reserved > self.queue.len {
            return Err(format!(
                "{} blocks reserved but only {} free",
                self.reserved, self.queue.len
            ));
        }
        // The prefix cache.
        self.cache.check()?;
        if !self.cfg.prefix_caching {
            if !self.cache.is_empty() {
                return Err("prefix caching is off but the cache has entries".into());
            }
            return Ok(());
        }
        for (&id, s) in &self.seqs {
            let full = s.tokens.len() / bs;
            if s.chain.len() != full || s.entries.len() != full {
                return Err(format!(
                    "sequence {id} has {full} full blocks but {} chain keys and {} entries",
                    s.chain.len(),
                    s.entries.len()
                ));
            }
            let mut parent_key = ROOT_HASH;
            for (i, &b) in s.table.iter().enumerate() {
                if i >= full {
                    if self.cache.is_cached(b) {
                        return Err(format!(
                            "sequence {id} holds cached block {b} as its partial last block"
                        ));
                    }
                    break;
                }
                let tokens = &s.tokens[i * bs..(i + 1) * bs];
                let key = self.cache.key(parent_key, tokens);
                if key != s.chain[i] {
                    return Err(format!("sequence {id} block {i}: chain key is stale"));
                }
                parent_key = key;
                // The entry it records, if still live, holds these tokens.
                if let Some(e) = s.entries[i].and_then(|r| self.cache.get(r)) {
                    if e.tokens() != tokens {
                        return Err(format!(
                            "sequence {id} block {i} links to an entry of other tokens"
                        ));
                    }
                }
                if let Some((_, e)) = self.cache.entry_of_block(b) {
                    if e.tokens() != tokens {
                        return Err(format!(
                            "block {b} is cached with tokens {:?} but sequence {id} holds {:?} in it",
                            e.tokens(),
                            tokens
                        ));
                    }
                    if (i == 0) != e.parent().is_none() {
                        return Err(format!(
                            "cached block {b} at position {i} of sequence {id} has parent {:?}",
                            e.parent()
                        ));
                    }
                    if let Some(p) = e.parent() {
                        if let Some(pe) = self.cache.get(p) {
                            let prev = &s.tokens[(i - 1) * bs..i * bs];
                            if pe.tokens() != prev {
                                return Err(format!(
                                    "cached block {b} of sequence {id} follows an entry of other tokens"
                                ));
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(num_blocks: usize, block_size: usize) -> BlockAllocator {
        BlockAllocator::new(AllocatorConfig::new(num_blocks, block_size)).unwrap()
    }

    /// Everything observable except the failure counter.
    type State = (
        Vec<(SeqId, Vec<BlockId>, Vec<u32>, usize)>,
        Vec<BlockId>,
        Vec<bool>,
        Telemetry,
    );

    fn state(a: &BlockAllocator) -> State {
        let seqs = a
            .sequences()
            .map(|s| {
                (
                    s,
                    a.blocks(s).unwrap().to_vec(),
                    a.tokens(s).unwrap().to_vec(),
                    a.reserved_for(s).unwrap(),
                )
            })
            .collect();
        let cached = (0..a.num_blocks() as u32).map(|b| a.is_cached(b)).collect();
        let mut t = a.telemetry();
        t.failed_admissions = 0;
        (seqs, a.free_queue().collect(), cached, t)
    }

    #[test]
    fn config_is_validated() {
        for (n, bs) in [
            (0, 16),
            (1 << 31, 1),
            (4, 0),
            (4, 3),
            (4, 512),
            (1 << 30, 8),
        ] {
            let e = BlockAllocator::new(AllocatorConfig::new(n, bs)).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{n} {bs}: {e}");
        }
        for bs in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
            let a = alloc(3, bs);
            assert_eq!(
                (a.num_blocks(), a.block_size(), a.num_free_blocks()),
                (3, bs, 3)
            );
        }
    }

    #[test]
    fn append_allocates_slots_in_order() {
        let mut a = alloc(8, 4);
        assert_eq!(a.add_sequence(1, &[]).unwrap(), 0);
        let p = a.append(1, &[10, 11, 12, 13, 14, 15]).unwrap();
        assert!(p.copies.is_empty());
        let t = a.blocks(1).unwrap().to_vec();
        assert_eq!(t, vec![0, 1]);
        assert_eq!(p.slots, vec![0, 1, 2, 3, 4, 5]);
        let p = a.append(1, &[16, 17, 18]).unwrap();
        assert_eq!(p.slots, vec![6, 7, 8]);
        assert_eq!(a.blocks(1).unwrap(), &[0, 1, 2]);
        assert_eq!(a.len(1).unwrap(), 9);
        assert_eq!(a.tokens(1).unwrap(), &[10, 11, 12, 13, 14, 15, 16, 17, 18]);
        assert_eq!((a.num_used_blocks(), a.num_free_blocks()), (3, 5));
        assert_eq!(a.append(1, &[]).unwrap(), AppendPlan::default());
        a.check_invariants().unwrap();
        a.free(1).unwrap();
        assert_eq!(a.num_free_blocks(), 8);
        a.check_invariants().unwrap();
    }

    #[test]
    fn fork_then_append_to_both_copies_once() {
        let mut a = alloc(8, 4);
        a.add_sequence(1, &[]).unwrap();
        a.append(1, &[1, 2, 3, 4, 5, 6]).unwrap(); // blocks 0 (full) and 1 (2 of 4)
        a.fork(1, 2).unwrap();
        assert_eq!(a.blocks(2).unwrap(), a.blocks(1).unwrap());
        assert_eq!((a.refcount(0), a.refcount(1)), (2, 2));
        assert_eq!(a.num_used_blocks(), 2, "a fork allocates nothing");
        a.check_invariants().unwrap();

        let p1 = a.append(1, &[7]).unwrap();
        let new = a.blocks(1).unwrap()[1];
        assert_eq!(p1.copies, vec![(1, new)]);
        assert_eq!(p1.slots, vec![new * 4 + 2]);
        assert_eq!(a.blocks(1).unwrap()[0], 0, "the full block stays shared");
        assert_eq!((a.refcount(1), a.refcount(new)), (1, 1));

        let p2 = a.append(2, &[8, 9]).unwrap();
        assert!(
            p2.copies.is_empty(),
            "the other branch now owns the old block"
        );
        assert_eq!(p2.slots, vec![6, 7]);
        assert_eq!(a.telemetry().cow_copies, 1);
        assert_eq!(a.tokens(1).unwrap(), &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(a.tokens(2).unwrap(), &[1, 2, 3, 4, 5, 6, 8, 9]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn fork_at_a_block_boundary_copies_nothing() {
        let mut a = alloc(8, 2);
        a.add_sequence(1, &[]).unwrap();
        a.append(1, &[1, 2, 3, 4]).unwrap();
        a.fork(1, 2).unwrap();
        assert!(a.append(1, &[5]).unwrap().copies.is_empty());
        assert!(a.append(2, &[6]).unwrap().copies.is_empty());
        assert_eq!(a.telemetry().cow_copies, 0);
        assert!(matches!(a.fork(1, 2), Err(Error::SequenceExists(2))));
        assert!(matches!(a.fork(9, 3), Err(Error::UnknownSequence(9))));
        a.check_invariants().unwrap();
    }

    #[test]
    fn prefix_hit_reuses_blocks() {
        let mut a = alloc(16, 2);
        let prompt = [1, 2, 3, 4, 5, 6, 7];
        assert_eq!(a.add_sequence(1, &prompt).unwrap(), 0);
        a.append(1, &prompt).unwrap();
        let t1 = a.blocks(1).unwrap().to_vec();
        assert_eq!(a.telemetry().cached_blocks, 3);
        // Same first two blocks, then another token: two hits.
        let p2 = [1, 2, 3, 4, 9, 9, 9];
        assert_eq!(a.add_sequence(2, &p2).unwrap(), 4);
        assert_eq!(a.tokens(2).unwrap(), &[1, 2, 3, 4]);
        assert_eq!(a.blocks(2).unwrap(), &t1[..2]);
        assert_eq!(
            (a.refcount(t1[0]), a.refcount(t1[1]), a.refcount(t1[2])),
            (2, 2, 1)
        );
        a.append(2, &p2[4..]).unwrap();
        let t = a.telemetry();
        assert_eq!((t.prefix_hits, t.prefix_misses), (2, 3 + 1));
        // The same tokens after another prefix are not the same block.
        assert_eq!(a.add_sequence(3, &[9, 9, 3, 4]).unwrap(), 0);
        // Prefix caching off: no hits, nothing cached.
        let mut b = BlockAllocator::new(AllocatorConfig {
            prefix_caching: false,
            ..AllocatorConfig::new(16, 2)
        })
        .unwrap();
        b.add_sequence(1, &prompt).unwrap();
        b.append(1, &prompt).unwrap();
        assert_eq!(b.add_sequence(2, &prompt).unwrap(), 0);
        assert_eq!(b.telemetry().cached_blocks, 0);
        a.check_invariants().unwrap();
        b.check_invariants().unwrap();
    }

    #[test]
    fn identical_blocks_are_cached_once() {
        let mut a = alloc(16, 2);
        for s in [1, 2] {
            a.add_sequence(s, &[]).unwrap();
            a.append(s, &[5, 6, 7, 8]).unwrap();
        }
        assert_eq!(
            a.telemetry().cached_blocks,
            2,
            "the second copy keeps the first entry"
        );
        let t1 = a.blocks(1).unwrap().to_vec();
        assert!(t1.iter().all(|&b| a.is_cached(b)));
        assert!(a.blocks(2).unwrap().iter().all(|&b| !a.is_cached(b)));
        // A hit finds sequence 1's blocks.
        assert_eq!(a.add_sequence(3, &[5, 6, 7, 8]).unwrap(), 4);
        assert_eq!(a.blocks(3).unwrap(), &t1[..]);
        // After sequence 1 and 3 end, sequence 2's chain can register its own blocks later.
        a.check_invariants().unwrap();
    }

    #[test]
    fn freed_cached_blocks_stay_hittable_until_evicted_lru() {
        let mut a = alloc(6, 2);
        a.add_sequence(1, &[]).unwrap();
        a.append(1, &[1, 1, 2, 2, 3]).unwrap(); // blocks 0, 1 cached; 2 partial
        a.add_sequence(2, &[]).unwrap();
        a.append(2, &[4, 4]).unwrap(); // block 3 cached
        assert_eq!(a.free_queue().collect::<Vec<_>>(), vec![4, 5]);
        a.free(1).unwrap();
        // Partial block 2 (uncached) goes to the front; cached ones to the back, tail first.
        assert_eq!(a.free_queue().collect::<Vec<_>>(), vec![2, 4, 5, 1, 0]);
        a.free(2).unwrap();
        assert_eq!(a.free_queue().collect::<Vec<_>>(), vec![2, 4, 5, 1, 0, 3]);
        assert_eq!(a.num_free_blocks(), 6, "free returns capacity at once");
        let t = a.telemetry();
        assert_eq!((t.cached_blocks, t.cached_free_blocks), (3, 3));
        // A hit takes a free cached block out of the queue.
        assert_eq!(a.add_sequence(3, &[4, 4, 0]).unwrap(), 2);
        assert_eq!(a.blocks(3).unwrap(), &[3]);
        assert_eq!(a.free_queue().collect::<Vec<_>>(), vec![2, 4, 5, 1, 0]);
        // Allocating: uncached blocks first, then the least recently freed cached block (1).
        a.add_sequence(4, &[]).unwrap();
        a.append(4, &[9; 7]).unwrap();
        assert_eq!(a.blocks(4).unwrap(), &[2, 4, 5, 1]);
        assert_eq!(a.telemetry().evictions, 1);
        assert!(!a.is_cached(1) && a.is_cached(0));
        // Block 0's entry survives but its chain's second block is gone: a one-block hit.
        a.free(3).unwrap();
        assert_eq!(a.add_sequence(5, &[1, 1, 2, 2]).unwrap(), 2);
        assert_eq!(a.blocks(5).unwrap(), &[0]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn failed_append_changes_nothing() {
        let mut a = alloc(4, 4);
        a.add_sequence(1, &[]).unwrap();
        a.append(1, &[1, 2, 3, 4, 5, 6]).unwrap();
        a.fork(1, 2).unwrap();
        a.add_sequence(3, &[]).unwrap();
        a.append(3, &[7]).unwrap(); // 1 free block left
        let before = state(&a);
        // Needs a copy of the shared partial block plus one new block.
        let e = a.append(1, &[0, 0, 0]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfBlocks {
                    needed: 2,
                    available: 1
                }
            ),
            "{e}"
        );
        assert_eq!(state(&a), before);
        assert_eq!(a.telemetry().failed_admissions, 1);
        let e = a.append(3, &[0; 9]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfBlocks {
                    needed: 2,
                    available: 1
                }
            ),
            "{e}"
        );
        assert_eq!(state(&a), before);
        assert!(matches!(a.append(9, &[1]), Err(Error::UnknownSequence(9))));
        assert_eq!(a.telemetry().failed_admissions, 2);
        a.check_invariants().unwrap();
        // What fits still works.
        assert_eq!(a.append(1, &[0]).unwrap().copies.len(), 1);
        a.check_invariants().unwrap();
    }

    #[test]
    fn reservations_hold_blocks_for_their_sequence() {
        let mut a = alloc(6, 2);
        a.add_sequence(1, &[]).unwrap();
        a.add_sequence(2, &[]).unwrap();
        a.append(1, &[1]).unwrap();
        assert!(a.can_admit(10));
        a.reserve(1, 7).unwrap(); // 8 tokens: 3 more blocks
        assert_eq!(
            (a.reserved_for(1).unwrap(), a.num_reserved_blocks()),
            (3, 3)
        );
        assert!(a.can_admit(4) && !a.can_admit(5));
        let before = state(&a);
        let e = a.append(2, &[0; 5]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfBlocks {
                    needed: 3,
                    available: 2
                }
            ),
            "{e}"
        );
        assert_eq!(state(&a), before);
        let e = a.reserve(2, 6).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfBlocks {
                    needed: 3,
                    available: 2
                }
            ),
            "{e}"
        );
        assert_eq!(state(&a), before);
        // Sequence 1 draws on its reservation.
        a.append(1, &[2, 3]).unwrap();
        assert_eq!(a.reserved_for(1).unwrap(), 2);
        a.append(2, &[0; 4]).unwrap(); // the 2 unreserved blocks
        a.append(1, &[4, 5, 6, 7]).unwrap();
        assert_eq!(
            (a.reserved_for(1).unwrap(), a.num_reserved_blocks()),
            (0, 0)
        );
        a.check_invariants().unwrap();
        // A new reservation replaces the old one; free releases it.
        a.free(2).unwrap();
        a.reserve(1, 4).unwrap();
        assert_eq!(a.num_reserved_blocks(), 2);
        a.reserve(1, 2).unwrap(); // 9 tokens: 1 more block (length 7 in 4 blocks of 2)
        assert_eq!(a.num_reserved_blocks(), 1);
        a.free(1).unwrap();
        assert_eq!(a.num_reserved_blocks(), 0);
        assert!(matches!(a.reserve(1, 1), Err(Error::UnknownSequence(1))));
        assert_eq!(a.telemetry().failed_admissions, 2);
        a.check_invariants().unwrap();
    }

    #[test]
    fn reservation_counts_a_pending_copy_on_write() {
        let mut a = alloc(4, 4);
        a.add_sequence(1, &[]).unwrap();
        a.append(1, &[1, 2]).unwrap();
        a.fork(1, 2).unwrap();
        a.reserve(1, 2).unwrap();
        assert_eq!(
            a.reserved_for(1).unwrap(),
            1,
            "the copy of the shared partial block"
        );
        a.reserve(2, 3).unwrap();
        assert_eq!(a.reserved_for(2).unwrap(), 2);
        assert_eq!(a.num_reserved_blocks(), 3);
        a.check_invariants().unwrap();
    }

    #[test]
    fn prefix_hits_do_not_take_reserved_blocks() {
        let mut a = alloc(3, 1);
        a.add_sequence(1, &[]).unwrap();
        a.append(1, &[7, 8]).unwrap();
        a.free(1).unwrap(); // blocks 0, 1 free and cached
        a.add_sequence(2, &[]).unwrap();
        a.reserve(2, 2).unwrap(); // 2 of 3 free blocks
        assert_eq!(
            a.add_sequence(3, &[7, 8]).unwrap(),
            1,
            "one unreserved block to take"
        );
        assert_eq!(a.num_free_blocks(), 2);
        a.check_invariants().unwrap();
    }

    #[test]
    fn swap_out_and_in() {
        let mut a = alloc(8, 4);
        a.add_sequence(1, &[]).unwrap();
        a.append(1, &[1, 2, 3, 4, 5, 6]).unwrap();
        a.fork(1, 2).unwrap();
        a.reserve(1, 8).unwrap();
        let old = a.blocks(1).unwrap().to_vec();
        let sw = a.swap_out(1).unwrap();
        assert_eq!(sw.tokens, vec![1, 2, 3, 4, 5, 6]);
        assert_eq!(sw.blocks, old);
        assert_eq!(sw.block_size, 4);
        assert!(matches!(a.blocks(1), Err(Error::UnknownSequence(1))));
        assert_eq!(a.num_reserved_blocks(), 0);
        assert_eq!(a.num_used_blocks(), 2, "sequence 2 still holds them");
        a.check_invariants().unwrap();
        let new = a.swap_in(1, &sw).unwrap();
        assert_eq!(new.len(), 2);
        assert!(
            new.iter().all(|b| !old.contains(b)),
            "fresh blocks, no sharing"
        );
        assert_eq!(a.blocks(1).unwrap(), &new[..]);
        assert_eq!(a.tokens(1).unwrap(), &sw.tokens[..]);
        assert!(matches!(a.swap_in(1, &sw), Err(Error::SequenceExists(1))));
        let t = a.telemetry();
        assert_eq!((t.swaps_out, t.swaps_in), (1, 1));
        a.check_invariants().unwrap();
        // Not enough room: nothing changes.
        a.add_sequence(3, &[]).unwrap();
        a.append(3, &[0; 13]).unwrap(); // 4 blocks, 0 free
        let before = state(&a);
        let e = a.swap_in(4, &sw).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfBlocks {
                    needed: 2,
                    available: 0
                }
            ),
            "{e}"
        );
        assert_eq!(state(&a), before);
        let wrong = SwappedSeq {
            block_size: 8,
            ..sw.clone()
        };
        assert!(matches!(
            a.swap_in(4, &wrong),
            Err(Error::InvalidArgument(_))
        ));
        let wrong = SwappedSeq {
            blocks: vec![0],
            ..sw.clone()
        };
        assert!(matches!(
            a.swap_in(4, &wrong),
            Err(Error::InvalidArgument(_))
        ));
        a.check_invariants().unwrap();
    }

    #[test]
    fn telemetry_counts_shared_blocks() {
        let mut a = alloc(8, 4);
        a.add_sequence(1, &[]).unwrap();
        a.append(1, &[1, 2, 3, 4, 5, 6]).unwrap();
        a.fork(1, 2).unwrap();
        let t = a.telemetry();
        assert_eq!((t.sequences, t.logical_tokens, t.unique_tokens), (2, 12, 6));
        assert_eq!((t.allocated_slots, t.used_blocks, t.free_blocks), (8, 2, 6));
        assert_eq!(t.block_utilization, 1.5);
        assert_eq!((t.fragmentation_slots, t.unused_slots), (0, 2));
        a.append(2, &[7]).unwrap();
        let t = a.telemetry();
        assert_eq!(
            (t.logical_tokens, t.unique_tokens, t.allocated_slots),
            (13, 9, 12)
        );
        assert_eq!(t.cow_copies, 1);
        assert!(t.to_string().contains("copy-on-write 1"));
    }

    #[test]
    fn colliding_hashes_never_return_other_tokens() {
        let mut a = alloc(64, 2);
        a.set_prefix_hash_bits(1).unwrap();
        let prompts: [&[u32]; 4] = [&[1, 2, 3, 4], &[3, 4, 1, 2], &[1, 2, 1, 2], &[2, 1, 3, 4]];
        for (s, p) in prompts.iter().enumerate() {
            let cached = a.add_sequence(s as u64, p).unwrap();
            assert_eq!(a.tokens(s as u64).unwrap(), &p[..cached]);
            a.append(s as u64, &p[cached..]).unwrap();
            a.check_invariants().unwrap();
        }
        for (s, p) in prompts.iter().enumerate() {
            let id = 10 + s as u64;
            let cached = a.add_sequence(id, p).unwrap();
            assert_eq!(a.tokens(id).unwrap(), &p[..cached]);
            for (i, &b) in a.blocks(id).unwrap().iter().enumerate() {
                // A shared block belongs to an earlier sequence with the same prefix.
                let owner = a
                    .sequences()
                    .filter(|&o| o != id && a.blocks(o).unwrap().get(i) == Some(&b))
                    .collect::<Vec<_>>();
                assert!(!owner.is_empty());
                for o in owner {
                    assert_eq!(a.tokens(o).unwrap()[..(i + 1) * 2], p[..(i + 1) * 2]);
                }
            }
        }
        assert!(a.set_prefix_hash_bits(64).is_err());
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_child_entry_never_outlives_its_parent_content() {
        use crate::cache::prefix::{chain_hash, ROOT_HASH};
        // With 1-bit keys, find tokens a != b whose first blocks share a key, and c whose
        // block after them has another key (so it can be cached next to them).
        let key = |parent: u64, t: u32| chain_hash(parent, &[t]) & 1;
        let (a, b) = (0..8u32)
            .flat_map(|a| (0..8u32).map(move |b| (a, b)))
            .find(|&(a, b)| a != b && key(ROOT_HASH, a) == key(ROOT_HASH, b))
            .unwrap();
        let hp = key(ROOT_HASH, a);
        let c = (0..8u32).find(|&c| key(hp, c) != hp).unwrap();
        let mut x = alloc(3, 1);
        x.set_prefix_hash_bits(1).unwrap();
        x.add_sequence(1, &[]).unwrap();
        x.append(1, &[a]).unwrap(); // block 0 cached: [a]
        x.add_sequence(2, &[]).unwrap();
        x.append(2, &[a, c]).unwrap(); // [a] already cached; [c] after it cached in block 2
        assert_eq!(x.telemetry().cached_blocks, 2);
        x.free(1).unwrap(); // block 0 free, still cached
        x.add_sequence(3, &[]).unwrap();
        x.append(3, &[b]).unwrap(); // evicts [a] from block 0; [b] cached under the same key
        assert_eq!(x.telemetry().evictions, 1);
        // [b, c]: the cached [c] followed [a], not [b]: only the first block may hit.
        assert_eq!(x.add_sequence(4, &[b, c]).unwrap(), 1);
        assert_eq!(x.blocks(4).unwrap(), x.blocks(3).unwrap());
        x.check_invariants().unwrap();
    }

    #[test]
    fn unknown_and_duplicate_ids_are_errors() {
        let mut a = alloc(2, 1);
        a.add_sequence(1, &[]).unwrap();
        assert!(matches!(
            a.add_sequence(1, &[]),
            Err(Error::SequenceExists(1))
        ));
        assert!(matches!(a.free(2), Err(Error::UnknownSequence(2))));
        assert!(matches!(a.swap_out(2), Err(Error::UnknownSequence(2))));
        assert!(matches!(a.len(2), Err(Error::UnknownSequence(2))));
        assert!(matches!(a.tokens(2), Err(Error::UnknownSequence(2))));
        assert_eq!(a.sequences().collect::<Vec<_>>(), vec![1]);
        assert_eq!(a.refcount(99), 0);
        assert!(!a.is_cached(99));
        assert!(a.contains(1) && !a.contains(2));
    }

    #[test]
    fn shuffle_free_queue_permutes_deterministically() {
        let mut a = alloc(64, 4);
        let before: Vec<BlockId> = a.free_queue().collect();
        a.shuffle_free_queue(7);
        let after: Vec<BlockId> = a.free_queue().collect();
        a.check_invariants().unwrap();
        assert_ne!(after, before, "a shuffle of 64 blocks moves something");
        let mut sorted = after.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, before, "a permutation of the same blocks");
        let mut b = alloc(64, 4);
        b.shuffle_free_queue(7);
        assert_eq!(
            b.free_queue().collect::<Vec<_>>(),
            after,
            "same seed, same order"
        );
        b.shuffle_free_queue(8);
        b.check_invariants().unwrap();
        // Allocation follows the shuffled queue.
        a.add_sequence(1, &[]).unwrap();
        let plan = a.append(1, &[1; 12]).unwrap();
        assert_eq!(a.blocks(1).unwrap(), &after[..3]);
        assert_eq!(plan.slots[4], after[1] * 4);
        a.check_invariants().unwrap();

        // Free cached blocks keep their LRU order behind the uncached ones.
        let mut c = alloc(8, 2);
        c.add_sequence(1, &[]).unwrap();
        c.append(1, &[1, 2, 3, 4, 5]).unwrap();
        c.free(1).unwrap();
        let cached: Vec<BlockId> = c.free_queue().filter(|&b| c.is_cached(b)).collect();
        assert_eq!(cached.len(), 2);
        c.shuffle_free_queue(3);
        c.check_invariants().unwrap();
        let q: Vec<BlockId> = c.free_queue().collect();
        assert_eq!(q.len(), 8);
        assert_eq!(&q[6..], &cached[..]);
        assert!(q[..6].iter().all(|&b| !c.is_cached(b)));
        // A prefix hit still finds them.
        assert_eq!(c.add_sequence(2, &[1, 2, 3, 4, 5]).unwrap(), 4);
        c.check_invariants().unwrap();
    }
}
