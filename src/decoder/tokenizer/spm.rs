//! SentencePiece BPE (`tokenizer.ggml.model = llama`): `▁` for spaces, pairs merged by the score
//! of the token they make, byte fallback.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::{tok_err, TokenType, Tokenizer};
use crate::Result;

/// SentencePiece's stand-in for a space (U+2581).
pub(super) const SPACE: char = '▁';

/// One score per token: `scores` as given, or all 0 when empty. Refuses a length that is not
/// the vocabulary's and NaN.
pub(super) fn check_scores(scores: Vec<f32>, n: usize) -> Result<Vec<f32>> {
    if scores.is_empty() {
        return Ok(vec![0.0; n]);
    }
    if scores.len() != n {
        return Err(tok_err(format!("{} scores for {n} tokens", scores.len())));
    }
    if let Some(i) = scores.iter().position(|s| s.is_nan()) {
        return Err(tok_err(format!("token {i} has a NaN score")));
    }
    Ok(scores)
}

/// The byte of a byte token's text, `<0xAB>`.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The id of each byte's token (`<0xXX>`, of type [`TokenType::Byte`]); refuses a byte token
/// whose text is not of that form.
pub(super) fn byte_ids(tokens: &[String], types: &[TokenType]) -> Result<[Option<u32>; 256]> {
    let mut ids = [None; 256];
    for (i, (t, ty)) in tokens.iter().zip(types).enumerate() {
        if *ty == TokenType::Byte {
            let b = parse_byte_token(t).ok_or_else(|| {
                tok_err(format!("byte token {i} is {t:?}, not of the form <0xAB>"))
            })?;
            ids[b as usize].get_or_insert(i as u32);
        }
    }
    Ok(ids)
}

/// The bytes every token decodes to, concatenated, and each token's start: byte tokens as their
/// byte, control tokens as their text, the others with `▁` as a space.
pub(super) fn token_bytes(tokens: &[String], types: &[TokenType]) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = Vec::new();
    let mut offsets = Vec::with_capacity(tokens.len() + 1);
    offsets.push(0);
    for (t, ty) in tokens.iter().zip(types) {
        match (ty, parse_byte_token(t)) {
            (TokenType::Byte, Some(b)) => bytes.push(b),
            (TokenType::Control, _) => bytes.extend_from_slice(t.as_bytes()),
            _ => bytes.extend_from_slice(t.replace(SPACE, " ").as_bytes()),
        }
        offsets.push(bytes.len());
    }
    (bytes, offsets)
}

/// A pair of adjacent symbols whose concatenation is a token: the highest score first, then the
/// leftmost.
#[derive(Debug)]
struct Candidate {
    score: f32,
    left: usize,
    /// The lengths of the two symbols when the pair was found (a pair whose symbols have grown
    /// since is stale).
    left_len: usize,
    right_len: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Encodes text between special tokens: spaces to `▁` (and one in front when `prefix`), then
/// the characters merged pairwise by score, then any symbol that is not a token as byte tokens
/// (or the unknown token, once per character, when a byte has no token).
pub(super) fn encode(
    tok: &Tokenizer,
    scores: &[f32],
    text: &str,
    prefix: bool,
    out: &mut Vec<u32>,
) {
    const NONE: usize = usize::MAX;
    let mut s = String::with_capacity(text.len() + 3);
    if prefix {
        s.push(SPACE);
    }
    for c in text.chars() {
        s.push(if c == ' ' { SPACE } else { c });
    }
    // Symbol i starts at byte start[i] and is len[i] bytes long; symbols are linked in order.
    let start: Vec<usize> = s.char_indices().map(|(i, _)| i).collect();
    let n = start.len();
    let mut len: Vec<usize> = (0..n)
        .map(|i| start.get(i + 1).copied().unwrap_or(s.len()) - start[i])
        .collect();
    let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
    let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
    let mut alive = vec![true; n];
    let token = |from: usize, to: usize| -> Option<u32> {
        let id = tok.token_to_id(&s[from..to])?;
        tok.types[id as usize].is_mergeable().then_some(id)
    };
    let candidate = |left: usize, right: usize, len: &[usize]| -> Option<Candidate> {
        let id = token(start[left], start[right] + len[right])?;
        Some(Candidate {
            score: scores[id as usize],
            left,
            left_len: len[left],
            right_len: len[right],
        })
    };
    let mut heap = BinaryHeap::new();
    for i in 1..n {
        heap.extend(candidate(i - 1, i, &len));
    }
    while let Some(c) = heap.pop() {
        let (l, r) = (c.left, next[c.left]);
        if !alive[l] || r == NONE || len[l] != c.left_len || len[r] != c.right_len {
            continue; // stale: one side was merged since
        }
        len[l] += len[r];
        alive[r] = false;
        next[l] = next[r];
        if next[r] != NONE {
            prev[next[r]] = l;
        }
        if prev[l] != NONE {
            heap.extend(candidate(prev[l], l, &len));
        }
        if next[l] != NONE {
            heap.extend(candidate(l, next[l], &len));
        }
    }
    let mut i = if n == 0 { NONE } else { 0 };
    while i != NONE {
        let (from, to) = (start[i], start[i] + len[i]);
        match token(from, to) {
            Some(id) => out.push(id),
            None => {
                // Only a single character can be missing (merges make tokens): its bytes.
                let bytes = &s.as_bytes()[from..to];
                let ids: Option<Vec<u32>> =
                    bytes.iter().map(|&b| tok.byte_ids[b as usize]).collect();
                match ids {
                    Some(ids) => out.extend(ids),
                    None => out.extend(tok.unk),
                }
            }
        }
        i = next[i];
    }
}
