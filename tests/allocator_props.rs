//! Property tests of the block allocator: random sequences of add (with prefix hits),
//! append (with copy-on-write and, implicitly, LRU eviction of cached blocks), fork, free,
//! swap out, swap in, reserve and admission checks, 10,000 operations per case.
//!
//! Alongside the allocator runs a model of the GPU pool: every slot holds the identity of the
//! KV row written there, which is the *whole prefix* up to and including its token (a node of
//! a trie of token sequences, so identities are exact, not hashes). Plans are applied like the
//! GPU side would (copies, then writes), swaps copy rows out and back, and free uncached blocks
//! are scribbled over. After every operation the allocator's invariants are checked and every
//! sequence is read back through its block table: each slot must hold exactly the row of its
//! own prefix. So a prefix hit can never hand out a block whose tokens (or whose earlier
//! tokens) differ, a shared block is never written, and a swap restores every row. Token ids
//! come from a three-letter alphabet and prompts from a few templates, so equal block contents
//! after different prefixes are common, and one configuration truncates the prefix hash to 2
//! bits so that keys collide all the time.

use std::collections::{BTreeMap, HashMap};

use kvattn::cache::allocator::{AllocatorConfig, BlockAllocator, BlockId, SeqId, SwappedSeq};
use kvattn::cache::telemetry::Telemetry;
use kvattn::Error;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

/// Operations per case.
const OPS: usize = 10_000;
/// Token ids are drawn from `0..ALPHABET`.
const ALPHABET: u32 = 3;
/// Above this many live sequences, adds and forks turn into frees.
const MAX_SEQS: usize = 24;
/// Swapped-out sequences kept for swapping in.
const MAX_SWAPPED: usize = 6;
/// A slot no row was written to (or that was scribbled over).
const GARBAGE: u32 = u32::MAX;

#[derive(Clone, Debug)]
enum Op {
    /// A new sequence whose prompt is the first `len` tokens of template `template` followed by
    /// `tail`; its uncached part is appended.
    Add {
        template: usize,
        len: usize,
        tail: Vec<u32>,
    },
    Append {
        seq: usize,
        tokens: Vec<u32>,
    },
    Fork {
        seq: usize,
    },
    Free {
        seq: usize,
    },
    SwapOut {
        seq: usize,
    },
    SwapIn {
        which: usize,
    },
    Reserve {
        seq: usize,
        tokens: usize,
    },
    /// `can_admit(n)` must agree with appending `n` tokens to a new sequence.
    Admit {
        tokens: Vec<u32>,
    },
}

fn tokens(max: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0..ALPHABET, 0..=max)
}

fn op(block_size: usize) -> impl Strategy<Value = Op> {
    let bs = block_size;
    let idx = 0..1000usize;
    prop_oneof![
        4 => (0..4usize, 0..=5 * bs, tokens(bs + 1))
            .prop_map(|(template, len, tail)| Op::Add { template, len, tail }),
        8 => (idx.clone(), prop::collection::vec(0..ALPHABET, 1..=2 * bs + 1))
            .prop_map(|(seq, tokens)| Op::Append { seq, tokens }),
        2 => idx.clone().prop_map(|seq| Op::Fork { seq }),
        5 => idx.clone().prop_map(|seq| Op::Free { seq }),
        1 => idx.clone().prop_map(|seq| Op::SwapOut { seq }),
        1 => idx.clone().prop_map(|which| Op::SwapIn { which }),
        1 => (idx, 0..=3 * bs).prop_map(|(seq, tokens)| Op::Reserve { seq, tokens }),
        1 => tokens(3 * bs).prop_map(|tokens| Op::Admit { tokens }),
    ]
}

fn ops(block_size: usize) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(block_size), OPS)
}

/// Prompt template `t`: a fixed pseudo-random token stream over the alphabet.
fn template(t: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * i * 7 + i * (3 + t) + t * 5) % ALPHABET as usize) as u32)
        .collect()
}

/// One sequence in the model: its tokens and the row identity of each position.
#[derive(Clone, Debug)]
struct ModelSeq {
    tokens: Vec<u32>,
    rows: Vec<u32>,
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

struct Harness {
    a: BlockAllocator,
    bs: usize,
    /// Row identities: trie of (parent row, token) -> row; row 0 is the empty prefix.
    trie: HashMap<(u32, u32), u32>,
    /// The modelled GPU pool: the row identity in each slot.
    mem: Vec<u32>,
    seqs: BTreeMap<SeqId, ModelSeq>,
    swapped: Vec<(SeqId, SwappedSeq, Vec<u32>)>,
    next_id: SeqId,
    ops_done: usize,
}

impl Harness {
    fn new(cfg: AllocatorConfig, hash_bits: u32) -> Self {
        let mut a = BlockAllocator::new(cfg).unwrap();
        a.set_prefix_hash_bits(hash_bits).unwrap();
        Self {
            a,
            bs: cfg.block_size,
            trie: HashMap::new(),
            mem: vec![GARBAGE; cfg.num_blocks * cfg.block_size],
            seqs: BTreeMap::new(),
            swapped: Vec::new(),
            next_id: 0,
            ops_done: 0,
        }
    }

    fn row(&mut self, parent: u32, token: u32) -> u32 {
        let next = self.trie.len() as u32 + 1;
        *self.trie.entry((parent, token)).or_insert(next)
    }

    /// The row identities of `tokens` after the prefix ending in row `parent`.
    fn rows(&mut self, mut parent: u32, tokens: &[u32]) -> Vec<u32> {
        tokens
            .iter()
            .map(|&t| {
                parent = self.row(parent, t);
                parent
            })
            .collect()
    }

    fn pick(&self, i: usize) -> Option<SeqId> {
        (!self.seqs.is_empty()).then(|| *self.seqs.keys().nth(i % self.seqs.len()).unwrap())
    }

    fn fresh_id(&mut self) -> SeqId {
        self.next_id += 1;
        self.next_id
    }

    fn slot(&self, seq: SeqId, pos: usize) -> usize {
        let table = self.a.blocks(seq).unwrap();
        table[pos / self.bs] as usize * self.bs + pos % self.bs
    }

    /// Appends through the allocator and applies the plan to the modelled pool; on
    /// `OutOfBlocks` checks that nothing changed.
    fn append(&mut self, seq: SeqId, tokens: &[u32]) -> bool {
        let before = state(&self.a);
        let failed = self.a.telemetry().failed_admissions;
        match self.a.append(seq, tokens) {
            Ok(plan) => {
                assert_eq!(plan.slots.len(), tokens.len());
                assert!(plan.copies.len() <= 1);
                let bs = self.bs;
                for &(src, dst) in &plan.copies {
                    let (s, d) = (src as usize * bs, dst as usize * bs);
                    self.mem.copy_within(s..s + bs, d);
                }
                let m = self.seqs.get_mut(&seq).unwrap();
                let parent = m.rows.last().copied().unwrap_or(0);
                let rows = self.rows(parent, tokens);
                for (&slot, &row) in plan.slots.iter().zip(&rows) {
                    assert_eq!(
                        self.a.refcount(slot / bs as u32),
                        1,
                        "a write into a shared block"
                    );
                    self.mem[slot as usize] = row;
                }
                let m = self.seqs.get_mut(&seq).unwrap();
                m.tokens.extend_from_slice(tokens);
                m.rows.extend(rows);
                true
            }
            Err(Error::OutOfBlocks { needed, available }) => {
                assert!(needed > available);
                assert_eq!(state(&self.a), before, "a failed append changed the state");
                assert_eq!(self.a.telemetry().failed_admissions, failed + 1);
                false
            }
            Err(e) => panic!("append: {e}"),
        }
    }

    fn run(&mut self, op: &Op) {
        let bs = self.bs;
        let op = match *op {
            Op::Add { .. } | Op::Fork { .. } if self.seqs.len() >= MAX_SEQS => {
                Op::Free { seq: self.ops_done }
            }
            ref op => op.clone(),
        };
        match op {
            Op::Add {
                template: t,
                len,
                tail,
            } => {
                let mut prompt = template(t, len);
                prompt.extend_from_slice(&tail);
                let id = self.fresh_id();
                let cached = self.a.add_sequence(id, &prompt).unwrap();
                assert_eq!(cached % bs, 0);
                assert!(cached <= prompt.len());
                let rows = self.rows(0, &prompt[..cached]);
                self.seqs.insert(
                    id,
                    ModelSeq {
                        tokens: prompt[..cached].to_vec(),
                        rows,
                    },
                );
                // The prefix cache handed out blocks: they must hold exactly these rows.
                self.verify_seq(id);
                self.append(id, &prompt[cached..]);
            }
            Op::Append { seq, tokens } => {
                if let Some(seq) = self.pick(seq) {
                    self.append(seq, &tokens);
                }
            }
            Op::Fork { seq } => {
                if let Some(parent) = self.pick(seq) {
                    let child = self.fresh_id();
                    let used = self.a.num_used_blocks();
                    self.a.fork(parent, child).unwrap();
                    assert_eq!(self.a.num_used_blocks(), used);
                    let m = self.seqs[&parent].clone();
                    self.seqs.insert(child, m);
                }
            }
            Op::Free { seq } => {
                if let Some(seq) = self.pick(seq) {
                    let free = self.a.num_free_blocks();
                    let sole = self
                        .a
                        .blocks(seq)
                        .unwrap()
                        .iter()
                        .filter(|&&b| self.a.refcount(b) == 1)
                        .count();
                    self.a.free(seq).unwrap();
                    assert_eq!(
                        self.a.num_free_blocks(),
                        free + sole,
                        "free returns capacity"
                    );
                    self.seqs.remove(&seq);
                }
            }
            Op::SwapOut { seq } => {
                if let Some(seq) = self.pick(seq) {
                    // The GPU side copies the rows to the host first.
                    let len = self.seqs[&seq].tokens.len();
                    let data: Vec<u32> = (0..len).map(|p| self.mem[self.slot(seq, p)]).collect();
                    let table = self.a.blocks(seq).unwrap().to_vec();
                    let sw = self.a.swap_out(seq).unwrap();
                    let m = self.seqs.remove(&seq).unwrap();
                    assert_eq!(sw.tokens, m.tokens);
                    assert_eq!(sw.blocks, table);
                    assert_eq!(data, m.rows);
                    if self.swapped.len() == MAX_SWAPPED {
                        self.swapped.remove(0);
                    }
                    self.swapped.push((seq, sw, data));
                }
            }
            Op::SwapIn { which } => {
                if self.swapped.is_empty() {
                    return;
                }
                let i = which % self.swapped.len();
                let (old_id, sw, data) = self.swapped[i].clone();
                let id = if self.seqs.contains_key(&old_id) {
                    self.fresh_id()
                } else {
                    old_id
                };
                let before = state(&self.a);
                match self.a.swap_in(id, &sw) {
                    Ok(table) => {
                        assert_eq!(table.len(), sw.blocks.len());
                        assert_eq!(self.a.blocks(id).unwrap(), &table[..]);
                        for &b in &table {
                            assert_eq!(self.a.refcount(b), 1, "swap-in shares nothing");
                        }
                        for (p, &row) in data.iter().enumerate() {
                            self.mem[table[p / bs] as usize * bs + p % bs] = row;
                        }
                        self.seqs.insert(
                            id,
                            ModelSeq {
                                tokens: sw.tokens.clone(),
                                rows: data,
                            },
                        );
                        self.swapped.remove(i);
                    }
                    Err(Error::OutOfBlocks { .. }) => {
                        assert_eq!(state(&self.a), before, "a failed swap-in changed the state");
                    }
                    Err(e) => panic!("swap_in: {e}"),
                }
            }
            Op::Reserve { seq, tokens } => {
                if let Some(seq) = self.pick(seq) {
                    let len = self.seqs[&seq].tokens.len();
                    let table = self.a.blocks(seq).unwrap();
                    let cow =
                        tokens > 0 && len % bs != 0 && self.a.refcount(*table.last().unwrap()) > 1;
                    let want = if tokens == 0 {
                        0
                    } else {
                        (len + tokens).div_ceil(bs) - table.len() + usize::from(cow)
                    };
                    let before = state(&self.a);
                    match self.a.reserve(seq, tokens) {
                        Ok(()) => assert_eq!(self.a.reserved_for(seq).unwrap(), want),
                        Err(Error::OutOfBlocks { needed, .. }) => {
                            assert_eq!(needed, want);
                            assert_eq!(
                                state(&self.a),
                                before,
                                "a failed reserve changed the state"
                            );
                        }
                        Err(e) => panic!("reserve: {e}"),
                    }
                }
            }
            Op::Admit { tokens } => {
                let admit = self.a.can_admit(tokens.len());
                let id = self.fresh_id();
                self.a.add_sequence(id, &[]).unwrap();
                self.seqs.insert(
                    id,
                    ModelSeq {
                        tokens: vec![],
                        rows: vec![],
                    },
                );
                let ok = self.append(id, &tokens);
                assert_eq!(
                    admit,
                    ok,
                    "can_admit({}) disagrees with append",
                    tokens.len()
                );
                if !ok {
                    self.a.free(id).unwrap();
                    self.seqs.remove(&id);
                }
            }
        }
        self.ops_done += 1;
        self.scribble();
        self.verify();
    }

    /// Free blocks that hold no cached prefix may be reused for anything: overwrite them.
    fn scribble(&mut self) {
        let bs = self.bs;
        let free: Vec<BlockId> = self
            .a
            .free_queue()
            .filter(|&b| !self.a.is_cached(b))
            .collect();
        for b in free {
            self.mem[b as usize * bs..(b as usize + 1) * bs].fill(GARBAGE);
        }
    }

    fn verify_seq(&self, seq: SeqId) {
        let m = &self.seqs[&seq];
        assert_eq!(
            self.a.tokens(seq).unwrap(),
            &m.tokens[..],
            "tokens of {seq}"
        );
        for (p, &row) in m.rows.iter().enumerate() {
            assert_eq!(
                self.mem[self.slot(seq, p)],
                row,
                "sequence {seq} position {p}: the block holds another prefix's row"
            );
        }
    }

    fn verify(&self) {
        if let Err(e) = self.a.check_invariants() {
            panic!("after {} operations: {e}", self.ops_done);
        }
        assert!(self.a.sequences().eq(self.seqs.keys().copied()));
        for &seq in self.seqs.keys() {
            self.verify_seq(seq);
        }
        let t = self.a.telemetry();
        assert_eq!(t.used_blocks + t.free_blocks, t.total_blocks);
        assert_eq!(
            t.logical_tokens,
            self.seqs.values().map(|m| m.tokens.len()).sum::<usize>()
        );
    }

    /// Frees everything: every block must be free again.
    fn finish(mut self) -> Telemetry {
        let ids: Vec<SeqId> = self.seqs.keys().copied().collect();
        for id in ids {
            self.a.free(id).unwrap();
            self.seqs.remove(&id);
        }
        self.verify();
        assert_eq!(self.a.num_free_blocks(), self.a.num_blocks());
        assert_eq!(self.a.num_reserved_blocks(), 0);
        self.a.telemetry()
    }
}

fn run_case(cfg: AllocatorConfig, hash_bits: u32, ops: &[Op]) -> Telemetry {
    let mut h = Harness::new(cfg, hash_bits);
    for op in ops {
        h.run(op);
    }
    h.finish()
}

fn prefix(num_blocks: usize, block_size: usize) -> AllocatorConfig {
    AllocatorConfig::new(num_blocks, block_size)
}

fn no_prefix(num_blocks: usize, block_size: usize) -> AllocatorConfig {
    AllocatorConfig {
        prefix_caching: false,
        ..prefix(num_blocks, block_size)
    }
}

fn proptest_config() -> ProptestConfig {
    ProptestConfig {
        cases: 2,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(proptest_config())]

    #[test]
    fn block_size_4_prefix_caching(ops in ops(4)) {
        run_case(prefix(40, 4), 64, &ops);
    }

    #[test]
    fn block_size_1_prefix_caching(ops in ops(1)) {
        run_case(prefix(64, 1), 64, &ops);
    }

    #[test]
    fn block_size_2_colliding_hashes(ops in ops(2)) {
        run_case(prefix(48, 2), 2, &ops);
    }

    #[test]
    fn block_size_1_colliding_hashes(ops in ops(1)) {
        run_case(prefix(64, 1), 3, &ops);
    }

    #[test]
    fn block_size_8_no_prefix_caching(ops in ops(8)) {
        run_case(no_prefix(16, 8), 64, &ops);
    }
}

/// One fixed random run per configuration, asserting that it really exercised prefix hits,
/// eviction, copy-on-write, swaps and failed admissions (so the properties above are not
/// vacuous).
#[test]
fn random_runs_exercise_every_path() {
    for (cfg, bits) in [(prefix(40, 4), 64), (prefix(48, 2), 2), (prefix(64, 1), 64)] {
        let mut runner = TestRunner::deterministic();
        let ops = ops(cfg.block_size).new_tree(&mut runner).unwrap().current();
        let t = run_case(cfg, bits, &ops);
        eprintln!("block size {} hash bits {bits}:\n{t}", cfg.block_size);
        assert!(t.prefix_hits > 0, "{t}");
        assert!(t.prefix_misses > 0, "{t}");
        assert!(t.evictions > 0, "{t}");
        // With one-token blocks no block is ever partial, so nothing is copied on write.
        assert_eq!(t.cow_copies > 0, cfg.block_size > 1, "{t}");
        assert!(t.swaps_out > 0 && t.swaps_in > 0, "{t}");
        assert!(t.failed_admissions > 0, "{t}");
    }
}
