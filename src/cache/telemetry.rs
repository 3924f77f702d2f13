//! Cache telemetry: occupancy of the block pool and counters of what the allocator did, as a
//! plain struct ([`Telemetry`], from
//! [`BlockAllocator::telemetry`](super::allocator::BlockAllocator::telemetry)) that prints
//! readably.

use std::fmt;

/// A snapshot of the allocator's occupancy and counters.
///
/// Token counts come in two flavours when blocks are shared (after a fork or a prefix hit):
/// *logical* tokens count a token once per sequence that holds it (what the sequences see),
/// *unique* tokens count each filled slot of a used block once (what the pool stores). Without
/// sharing they are equal.
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Telemetry {
    /// Live sequences.
    pub sequences: usize,
    /// Sum of the sequences' lengths (a shared token counts once per sequence holding it).
    pub logical_tokens: usize,
    /// Filled slots of used blocks, each physical slot counted once however many sequences
    /// share it.
    pub unique_tokens: usize,
    /// Token slots of the used blocks: `used_blocks * block_size`.
    pub allocated_slots: usize,
    /// `logical_tokens / allocated_slots` (0 when nothing is allocated). Shared blocks count
    /// once in the denominator but once per holder in the numerator, so with sharing this can
    /// exceed 1.0: the excess is the saving from sharing. The occupancy of the pool itself is
    /// `unique_tokens / allocated_slots` ([`Telemetry::slot_occupancy`]), never above 1.0.
    pub block_utilization: f64,
    /// `allocated_slots - logical_tokens`, saturating at 0 (sharing can make logical exceed
    /// allocated).
    pub fragmentation_slots: usize,
    /// `allocated_slots - unique_tokens`: slots of used blocks that hold nothing (the tails of
    /// partial last blocks), exact even with sharing.
    pub unused_slots: usize,
    /// Blocks held by at least one sequence.
    pub used_blocks: usize,
    /// Blocks free for allocation, including unreferenced blocks still holding cached prefixes.
    pub free_blocks: usize,
    /// Free blocks set aside by reservations (counted in `free_blocks`).
    pub reserved_blocks: usize,
    /// Blocks in the prefix cache, used or free.
    pub cached_blocks: usize,
    /// Free blocks still holding a cached prefix (evicted when allocated for other content).
    pub cached_free_blocks: usize,
    /// Blocks in the pool.
    pub total_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Full prompt blocks served from the prefix cache by `add_sequence`.
    pub prefix_hits: u64,
    /// Full prompt blocks `add_sequence` looked up and did not find (with prefix caching on).
    pub prefix_misses: u64,
    /// Cached blocks whose entry was dropped because the block was allocated for other content.
    pub evictions: u64,
    /// Shared partial blocks copied on write by `append`.
    pub cow_copies: u64,
    /// Sequences swapped out.
    pub swaps_out: u64,
    /// Sequences swapped in.
    pub swaps_in: u64,
    /// `reserve`, `append` or `swap_in` calls refused for lack of blocks.
    pub failed_admissions: u64,
}

impl Telemetry {
    /// `prefix_hits / (prefix_hits + prefix_misses)`, 0 before any lookup.
    pub fn prefix_hit_rate(&self) -> f64 {
        let total = self.prefix_hits + self.prefix_misses;
        if total == 0 {
            0.0
        } else {
            self.prefix_hits as f64 / total as f64
        }
    }

    /// `unique_tokens / allocated_slots`: the fraction of allocated slots holding a token (0
    /// when nothing is allocated).
    pub fn slot_occupancy(&self) -> f64 {
        if self.allocated_slots == 0 {
            0.0
        } else {
            self.unique_tokens as f64 / self.allocated_slots as f64
        }
    }
}

impl fmt::Display for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "sequences {}: {} logical tokens ({} unique) in {} allocated slots",
            self.sequences, self.logical_tokens, self.unique_tokens, self.allocated_slots
        )?;
        writeln!(
            f,
            "block utilization {:.1}% (logical/allocated), slot occupancy {:.1}%, fragmentation {} slots, unused {} slots",
            100.0 * self.block_utilization,
            100.0 * self.slot_occupancy(),
            self.fragmentation_slots,
            self.unused_slots
        )?;
        writeln!(
            f,
            "blocks: {} used, {} free ({} reserved, {} holding cached prefixes) of {} (block size {}); {} cached",
            self.used_blocks,
            self.free_blocks,
            self.reserved_blocks,
            self.cached_free_blocks,
            self.total_blocks,
            self.block_size,
            self.cached_blocks
        )?;
        write!(
            f,
            "prefix hits {} / misses {} blocks ({:.1}%), evictions {}, copy-on-write {}, swaps out {} / in {}, failed admissions {}",
            self.prefix_hits,
            self.prefix_misses,
            100.0 * self.prefix_hit_rate(),
            self.evictions,
            self.cow_copies,
            self.swaps_out,
            self.swaps_in,
            self.failed_admissions
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_readable_and_rates_are_safe() {
        let t = Telemetry::default();
        assert_eq!(t.prefix_hit_rate(), 0.0);
        assert_eq!(t.slot_occupancy(), 0.0);
        let t = Telemetry {
            sequences: 2,
            logical_tokens: 40,
            unique_tokens: 24,
            allocated_slots: 32,
            block_utilization: 1.25,
            used_blocks: 2,
            free_blocks: 6,
            total_blocks: 8,
            block_size: 16,
            prefix_hits: 1,
            prefix_misses: 3,
            unused_slots: 8,
            ..Default::default()
        };
        assert_eq!(t.prefix_hit_rate(), 0.25);
        let s = t.to_string();
        assert_eq!(s.lines().count(), 4, "{s}");
        assert!(
            s.contains("40 logical tokens (24 unique) in 32 allocated slots"),
            "{s}"
        );
        assert!(s.contains("block utilization 125.0%"), "{s}");
        assert!(s.contains("prefix hits 1 / misses 3 blocks (25.0%)"), "{s}");
    }
}
