//! Byte-level BPE: GPT-2's byte alphabet and the ranked merges.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::{tok_err, TokenType};
use crate::Result;

/// GPT-2's byte -> printable character table (`bytes_to_unicode`): the printable Latin-1 bytes
/// stand for themselves, the others take the characters from U+0100 on, in byte order.
pub(super) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable = (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        // Below U+0200: always a valid scalar value.
        table[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    table
}

/// The bytes every token decodes to, concatenated, and each token's start (one more offset than
/// tokens): byte-alphabet characters as their bytes, special tokens as their text, other
/// characters (not in the alphabet) as their UTF-8.
pub(super) fn token_bytes(tokens: &[String], types: &[TokenType]) -> (Vec<u8>, Vec<usize>) {
    let b2c = byte_to_char_table();
    let c2b: HashMap<char, u8> = (0..=255u8).map(|b| (b2c[b as usize], b)).collect();
    let mut bytes = Vec::new();
    let mut offsets = Vec::with_capacity(tokens.len() + 1);
    offsets.push(0);
    for (t, ty) in tokens.iter().zip(types) {
        if ty.is_special() {
            bytes.extend_from_slice(t.as_bytes());
        } else {
            for c in t.chars() {
                match c2b.get(&c) {
                    Some(&b) => bytes.push(b),
                    None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
        }
        offsets.push(bytes.len());
    }
    (bytes, offsets)
}

/// The merges of a byte-level BPE vocabulary.
#[derive(Clone, Debug)]
pub(super) struct Merges {
    /// (left, right) -> (rank, merged id).
    ranks: HashMap<(u32, u32), (u32, u32)>,
    /// A piece that is itself a token is that token, merges or not (Llama 3).
    ignore_merges: bool,
    b2c: Box<[char; 256]>,
}

impl Merges {
    /// Checks and indexes the merges, `"left right"`, highest priority first.
    pub(super) fn new(
        lines: &[String],
        vocab: &HashMap<String, u32>,
        ignore_merges: bool,
    ) -> Result<Self> {
        let mut ranks = HashMap::with_capacity(lines.len());
        for (rank, line) in lines.iter().enumerate() {
            let bad = |why: &str| tok_err(format!("merge {rank} {line:?}: {why}"));
            let (a, b) = line
                .split_once(' ')
                .ok_or_else(|| bad("not two tokens separated by a space"))?;
            let ia = *vocab
                .get(a)
                .ok_or_else(|| bad("left side is not a token"))?;
            let ib = *vocab
                .get(b)
                .ok_or_else(|| bad("right side is not a token"))?;
            let merged = *vocab
                .get(&format!("{a}{b}"))
                .ok_or_else(|| bad("the merged token is not in the vocabulary"))?;
            ranks.entry((ia, ib)).or_insert((rank as u32, merged));
        }
        Ok(Self {
            ranks,
            ignore_merges,
            b2c: Box::new(byte_to_char_table()),
        })
    }

    /// The id of each byte's single-character token.
    pub(super) fn byte_ids(&self, vocab: &HashMap<String, u32>) -> [Option<u32>; 256] {
        let mut ids = [None; 256];
        for (b, id) in ids.iter_mut().enumerate() {
            *id = vocab
                .get(self.b2c[b].encode_utf8(&mut [0; 4]) as &str)
                .copied();
        }
        ids
    }

    /// Byte-level BPE on one piece: merges applied lowest rank first, leftmost first on ties.
    /// A byte without a token becomes `unk` (or nothing).
    pub(super) fn encode(
        &self,
        piece: &[u8],
        vocab: &HashMap<String, u32>,
        byte_ids: &[Option<u32>; 256],
        unk: Option<u32>,
        out: &mut Vec<u32>,
    ) {
        const NONE: usize = usize::MAX;
        if self.ignore_merges && piece.len() > 1 {
            let word: String = piece.iter().map(|&b| self.b2c[b as usize]).collect();
            if let Some(&id) = vocab.get(&word) {
                out.push(id);
                return;
            }
        }
        let mut ids: Vec<u32> = Vec::with_capacity(piece.len());
        for &b in piece {
            if let Some(id) = byte_ids[b as usize].or(unk) {
                ids.push(id);
            }
        }
        if ids.len() <= 1 {
            out.extend_from_slice(&ids);
            return;
        }
        let n = ids.len();
        let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut alive = vec![true; n];
        // (rank, left position, left id, right id)
        let mut heap = BinaryHeap::new();
        for i in 0..n - 1 {
            if let Some(&(rank, _)) = self.ranks.get(&(ids[i], ids[i + 1])) {
                heap.push(Reverse((rank, i, ids[i], ids[i + 1])));
            }
        }
        while let Some(Reverse((_, i, l, r))) = heap.pop() {
            let j = next[i];
            if !alive[i] || ids[i] != l || j == NONE || ids[j] != r {
                continue; // stale: one side was merged since
            }
            let Some(&(_, merged)) = self.ranks.get(&(l, r)) else {
                continue; // unreachable: only known pairs are pushed
            };
            ids[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[j] != NONE {
                prev[next[j]] = i;
            }
            if prev[i] != NONE {
                let p = prev[i];
                if let Some(&(rank, _)) = self.ranks.get(&(ids[p], merged)) {
                    heap.push(Reverse((rank, p, ids[p], merged)));
                }
            }
            if next[i] != NONE {
                let q = next[i];
                if let Some(&(rank, _)) = self.ranks.get(&(merged, ids[q])) {
                    heap.push(Reverse((rank, i, merged, ids[q])));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(ids[i]);
            i = next[i];
        }
    }
}
