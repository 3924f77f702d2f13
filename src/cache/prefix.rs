//! The prefix cache: full KV blocks keyed by a hash chained over (parent hash, token ids).
//!
//! A block's KV rows depend on every token before them, not only on the block's own tokens, so
//! a block may only be shared by sequences whose whole prefix up to the end of the block is
//! identical. The key of block `i` of a sequence is
//! `hash(key of block i-1 (or ROOT_HASH), token ids of block i)`, so equal prefixes give equal
//! keys. Keys are never trusted alone: every [`CacheEntry`] stores its block's token ids and a
//! link to its parent entry (an [`EntryRef`], whose id is never reused), and
//! [`PrefixCache::lookup`] returns an entry only when both match, token by token. By induction
//! over the chain a hit therefore holds exactly the tokens asked for after exactly the prefix
//! matched so far, even if two different chains collide on a key (a collision only costs a
//! miss, never a wrong block).
//!
//! The hash is `std::hash::DefaultHasher::new()` (SipHash with fixed keys): deterministic within
//! a build, which is all an in-memory cache needs. Keys are not meant to be persisted.
//!
//! The cache only records which block holds which content; the
//! [`BlockAllocator`](super::allocator::BlockAllocator) decides when blocks are registered
//! (when they become full), attached (a prefix hit) and evicted (a free cached block allocated
//! for other content).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use super::allocator::BlockId;
use crate::{Error, Result};

/// Identity of one cache entry; ids are never reused, so a stale link never matches a newer
/// entry registered under the same key.
pub type EntryId = u64;

/// The chain value of the empty prefix: the "parent hash" of a sequence's first block.
pub const ROOT_HASH: u64 = 0x6b76_6174_746e_0001;

/// The chained hash of a block holding `tokens` after the prefix whose chain value is `parent`
/// ([`ROOT_HASH`] for a sequence's first block).
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// A link to a cache entry: the key it is stored under and its id. It is live while the cache
/// still holds that very entry (same key, same id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryRef {
    /// The chained hash the entry is stored under.
    pub key: u64,
    /// The entry's id.
    pub id: EntryId,
}

/// One cached block: its content (token ids) and the entry of the block before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheEntry {
    id: EntryId,
    block: BlockId,
    parent: Option<EntryRef>,
    tokens: Box<[u32]>,
}

impl CacheEntry {
    /// The entry's id.
    pub fn id(&self) -> EntryId {
        self.id
    }

    /// The physical block holding the content.
    pub fn block(&self) -> BlockId {
        self.block
    }

    /// The entry of the previous block of the chain (`None` for a first block).
    pub fn parent(&self) -> Option<EntryRef> {
        self.parent
    }

    /// The token ids of the block.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// What [`PrefixCache::register`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registration {
    /// The block is now cached under this entry.
    Inserted(EntryRef),
    /// An identical block (same tokens after the same chain) was already cached under this
    /// entry; it is kept and the new block stays uncached.
    Existing(EntryRef),
    /// Not registered: the key is taken by different content (a hash collision), the parent
    /// entry is gone, or the block is already cached.
    NotRegistered,
}

/// Maps chained hashes to the blocks holding that content.
#[derive(Clone, Debug)]
pub struct PrefixCache {
    map: HashMap<u64, CacheEntry>,
    /// Key of the entry each block holds, if any.
    block_key: Vec<Option<u64>>,
    next_id: EntryId,
    mask: u64,
}

impl PrefixCache {
    /// An empty cache over a pool of `num_blocks` blocks ([`Error::InvalidArgument`] if its
    /// block index cannot be allocated).
    pub fn new(num_blocks: usize) -> Result<Self> {
        Ok(Self {
            map: HashMap::new(),
            block_key: super::allocator::filled(num_blocks, None)?,
            next_id: 1,
            mask: u64::MAX,
        })
    }

    /// Keeps only the low `bits` bits (1 to 64) of every key, so that tests can make different
    /// chains collide often. Refused unless the cache is empty.
    pub fn set_hash_bits(&mut self, bits: u32) -> Result<()> {
        if !(1..=64).contains(&bits) {
            return Err(Error::InvalidArgument(format!(
                "prefix hash bits must be 1 to 64, got {bits}"
            )));
        }
        if !self.map.is_empty() {
            return Err(Error::InvalidArgument(
                "the prefix hash width can only change while the cache is empty".into(),
            ));
        }
        self.mask = if bits == 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        Ok(())
    }

    /// The key of a block holding `tokens` after the chain value `parent`: [`chain_hash`]
    /// truncated to the configured width.
    pub fn key(&self, parent: u64, tokens: &[u32]) -> u64 {
        chain_hash(parent, tokens) & self.mask
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no block is cached.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether the cache still holds the entry `r` links to.
    pub fn is_live(&self, r: EntryRef) -> bool {
        self.get(r).is_some()
    }

    /// The entry `r` links to, if the cache still holds it.
    pub fn get(&self, r: EntryRef) -> Option<&CacheEntry> {
        self.map.get(&r.key).filter(|e| e.id == r.id)
    }

    /// The entry under `key` if it holds exactly `tokens` and follows exactly `parent` (`None`
    /// for a first block); anything else (absent, collision, other prefix) is a miss.
    pub fn lookup(
        &self,
        key: u64,
        parent: Option<EntryRef>,
        tokens: &[u32],
    ) -> Option<&CacheEntry> {
        self.map
            .get(&key)
            .filter(|e| e.parent == parent && *e.tokens == *tokens)
    }

    /// Whether `block` holds a cache entry.
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.block_key[block as usize].is_some()
    }

    /// The entry `block` holds, if any.
    pub fn entry_of_block(&self, block: BlockId) -> Option<(u64, &CacheEntry)> {
        let key = self.block_key[block as usize]?;
        self.map.get(&key).map(|e| (key, e))
    }

    /// Registers `block`, which holds `tokens` after the chain of `parent` (`None` for a first
    /// block), under `key`. An identical entry already cached is kept (its link is returned); a
    /// different entry under the same key is kept too unless its own parent is gone, in which
    /// case it can never be hit again and is replaced.
    pub fn register(
        &mut self,
        key: u64,
        parent: Option<EntryRef>,
        block: BlockId,
        tokens: &[u32],
    ) -> Registration {
        if parent.is_some_and(|p| !self.is_live(p)) || self.is_cached(block) {
            return Registration::NotRegistered;
        }
        if let Some(e) = self.map.get(&key) {
            if e.parent == parent && *e.tokens == *tokens {
                return Registration::Existing(EntryRef { key, id: e.id });
            }
            if e.parent.is_some_and(|p| !self.is_live(p)) {
                let stale = e.block;
                self.block_key[stale as usize] = None;
                self.map.remove(&key);
            } else {
                return Registration::NotRegistered;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.map.insert(
            key,
            CacheEntry {
                id,
                block,
                parent,
                tokens: tokens.into(),
            },
        );
        self.block_key[block as usize] = Some(key);
        Registration::Inserted(EntryRef { key, id })
    }

    /// Drops the entry `block` holds (eviction); returns whether there was one.
    pub fn remove_block(&mut self, block: BlockId) -> bool {
        match self.block_key[block as usize].take() {
            Some(key) => {
                self.map.remove(&key);
                true
            }
            None => false,
        }
    }

    /// Every entry with its key, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &CacheEntry)> + '_ {
        self.map.iter().map(|(k, e)| (*k, e))
    }

    /// Checks that entries and the block index agree: each entry's block points back at it,
    /// each indexed block has its entry, no block holds two entries.
    pub fn check(&self) -> std::result::Result<(), String> {
        for (key, e) in &self.map {
            let b = e.block as usize;
            if b >= self.block_key.len() {
                return Err(format!("cache entry {key:#x} names block {b} out of range"));
            }
            if self.block_key[b] != Some(*key) {
                return Err(format!(
                    "cache entry {key:#x} names block {b}, whose index says {:?}",
                    self.block_key[b]
                ));
            }
            if key & !self.mask != 0 {
                return Err(format!("cache key {key:#x} is wider than the hash width"));
            }
        }
        let indexed = self.block_key.iter().filter(|k| k.is_some()).count();
        if indexed != self.map.len() {
            return Err(format!(
                "{indexed} blocks are indexed as cached but the cache has {} entries",
                self.map.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_hash_depends_on_parent_and_tokens() {
        let a = chain_hash(ROOT_HASH, &[1, 2]);
        assert_eq!(a, chain_hash(ROOT_HASH, &[1, 2]));
        assert_ne!(a, chain_hash(ROOT_HASH, &[2, 1]));
        assert_ne!(chain_hash(a, &[1, 2]), a);
    }

    #[test]
    fn lookup_verifies_tokens_and_parent() {
        let mut c = PrefixCache::new(4).unwrap();
        let k0 = c.key(ROOT_HASH, &[1, 2]);
        let r0 = match c.register(k0, None, 0, &[1, 2]) {
            Registration::Inserted(r) => r,
            other => panic!("{other:?}"),
        };
        assert_eq!(c.lookup(k0, None, &[1, 2]).map(|e| e.block()), Some(0));
        // Same key, other tokens (a forced collision): a miss, not a wrong block.
        assert!(c.lookup(k0, None, &[1, 3]).is_none());
        // Same key and tokens, other parent: a miss.
        assert!(c.lookup(k0, Some(r0), &[1, 2]).is_none());
        // An identical block is not registered twice.
        assert_eq!(c.register(k0, None, 1, &[1, 2]), Registration::Existing(r0));
        assert!(!c.is_cached(1));
        // A colliding different block is refused while the old one is valid.
        assert_eq!(
            c.register(k0, None, 2, &[9, 9]),
            Registration::NotRegistered
        );
        c.check().unwrap();
    }

    #[test]
    fn children_of_an_evicted_entry_are_unreachable_and_replaceable() {
        let mut c = PrefixCache::new(8).unwrap();
        let k0 = c.key(ROOT_HASH, &[1]);
        let Registration::Inserted(r0) = c.register(k0, None, 0, &[1]) else {
            panic!()
        };
        let k1 = c.key(k0, &[2]);
        let Registration::Inserted(r1) = c.register(k1, Some(r0), 1, &[2]) else {
            panic!()
        };
        assert!(c.is_live(r1));
        assert!(c.remove_block(0));
        assert!(!c.is_live(r0));
        // Same content re-registered in another block: a new id, so the old child cannot match.
        let Registration::Inserted(r0b) = c.register(k0, None, 2, &[1]) else {
            panic!()
        };
        assert_ne!(r0b.id, r0.id);
        assert!(c.lookup(k1, Some(r0b), &[2]).is_none());
        // Registering the child again replaces the stale entry.
        assert!(matches!(
            c.register(k1, Some(r0b), 3, &[2]),
            Registration::Inserted(_)
        ));
        assert!(!c.is_cached(1));
        assert_eq!(c.lookup(k1, Some(r0b), &[2]).map(|e| e.block()), Some(3));
        // A child of a dead parent is not registered.
        assert_eq!(
            c.register(k1 ^ 1, Some(r0), 4, &[5]),
            Registration::NotRegistered
        );
        c.check().unwrap();
        assert!(c.set_hash_bits(8).is_err(), "only while empty");
    }
}
