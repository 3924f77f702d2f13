//! Soak test of the block allocator: 100,000 append/fork/free cycles (plus new sequences with
//! shared prompt prefixes to keep the population up) on a small pool, so that copy-on-write,
//! prefix hits, LRU eviction and failed appends all happen thousands of times. At the end every
//! sequence is freed and every block must be free again: nothing leaked.

use kvattn::cache::allocator::{AllocatorConfig, BlockAllocator, SeqId};
use kvattn::Error;

const CYCLES: usize = 100_000;
/// New sequences are added while fewer than this many are live.
const POPULATION: usize = 32;
/// A sequence that grows past this many tokens, or whose append is refused, ends.
const MAX_LEN: usize = 160;

/// xorshift64*: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn soak_100k_append_fork_free_cycles_leak_nothing() {
    let mut a = BlockAllocator::new(AllocatorConfig::new(64, 16)).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let templates: Vec<Vec<u32>> = (0..4)
        .map(|t| (0..96).map(|i| ((i * 7 + t * 13) % 5) as u32).collect())
        .collect();
    let mut live: Vec<SeqId> = Vec::new();
    let mut next_id: SeqId = 0;
    let mut ops = 0u64;
    let mut failed_appends = 0u64;

    for cycle in 0..CYCLES {
        // Keep the population up with prompts that share prefixes.
        if live.len() < POPULATION {
            next_id += 1;
            let t = &templates[rng.below(templates.len())];
            let mut prompt = t[..rng.below(t.len())].to_vec();
            prompt.extend((0..rng.below(8)).map(|_| rng.below(5) as u32));
            let cached = a.add_sequence(next_id, &prompt).unwrap();
            ops += 1;
            live.push(next_id);
            ops += 1;
            if a.append(next_id, &prompt[cached..]).is_err() {
                failed_appends += 1;
            }
        }
        // Append; a sequence that is refused or grows too long ends.
        let i = rng.below(live.len());
        let seq = live[i];
        let chunk: Vec<u32> = (0..1 + rng.below(20))
            .map(|_| rng.below(5) as u32)
            .collect();
        ops += 1;
        let done = match a.append(seq, &chunk) {
            Ok(plan) => {
                assert_eq!(plan.slots.len(), chunk.len());
                a.len(seq).unwrap() > MAX_LEN
            }
            Err(Error::OutOfBlocks { .. }) => {
                failed_appends += 1;
                true
            }
            Err(e) => panic!("append: {e}"),
        };
        if done && live.len() > 1 {
            a.free(live.swap_remove(i)).unwrap();
            ops += 1;
        }
        // Fork.
        next_id += 1;
        a.fork(live[rng.below(live.len())], next_id).unwrap();
        ops += 1;
        live.push(next_id);
        // Free.
        let seq = live.swap_remove(rng.below(live.len()));
        a.free(seq).unwrap();
        ops += 1;
        if cycle % 100 == 99 {
            a.check_invariants()
                .unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
        }
    }
    let t = a.telemetry();
    for seq in live.drain(..) {
        a.free(seq).unwrap();
        ops += 1;
    }
    a.check_invariants().unwrap();
    let free = a.num_free_blocks();
    eprintln!(
        "soak: {CYCLES} cycles, {ops} allocator operations ({failed_appends} appends refused for lack of blocks); \
         final free blocks {free} of {}",
        a.num_blocks()
    );
    eprintln!("before the final frees:\n{t}");
    assert_eq!(free, a.num_blocks(), "blocks leaked");
    assert_eq!(a.num_used_blocks(), 0);
    assert_eq!(a.sequences().count(), 0);
    assert!(
        t.cow_copies > 1000 && t.prefix_hits > 1000 && t.evictions > 100,
        "{t}"
    );
}
