//! Byte-level BPE pre-tokenizers: the regex splits llama.cpp names in `tokenizer.ggml.pre`.
//!
//! The patterns, as the models' `tokenizer.json` files write them:
//!
//! - GPT-2: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
//! - Llama 3: `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//!   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//! - Qwen2: Llama 3's with `\p{N}` (one digit) for `\p{N}{1,3}`.
//!
//! The `regex` crate has no look-ahead, so each pattern is compiled with `\s+` in place of
//! `\s+(?!\S)|\s+` and the look-ahead is emulated on the match: `\s+(?!\S)` matches a run of
//! whitespace that ends the text or, backtracking one character, all of a longer run but its
//! last character (which then starts the next piece, as in `" world"`); a single whitespace
//! character before a non-space is left to `\s+`. In the Llama 3 and Qwen2 patterns `\s*[\r\n]+`
//! comes first and takes every run that holds a line break (up to its last `\r` or `\n`), so
//! only a match without `\r` or `\n` is the look-ahead's. Alternation in `regex` is leftmost-first
//! like the backtracking engines the patterns were written for, so the rest matches as there.

use regex::Regex;

use super::tok_err;
use crate::Result;

/// How text is split before byte-level BPE (`tokenizer.ggml.pre`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PreTokenizer {
    /// The GPT-2 regex alone (`gpt2`, `gpt-2`, `default`, and files without
    /// `tokenizer.ggml.pre`).
    Gpt2,
    /// Every digit (`\p{N}`) isolated first, then the GPT-2 regex (`smollm`, `starcoder`).
    Gpt2Digits,
    /// The Llama 3 regex: digits in runs of up to three, line breaks kept with what precedes them
    /// (`llama-bpe`, `llama3`, `llama-v3`).
    Llama3,
    /// The Llama 3 regex with every digit on its own (`qwen2`).
    Qwen2,
}

/// The GPT-2 pattern without its `\s+(?!\S)` alternative (emulated in code).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";
/// The Llama 3 pattern without its `\s+(?!\S)` alternative (emulated in code).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";
/// The Qwen2 pattern without its `\s+(?!\S)` alternative (emulated in code).
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";

impl PreTokenizer {
    /// The `tokenizer.ggml.pre` names supported.
    pub const NAMES: &'static [&'static str] = &[
        "gpt2",
        "gpt-2",
        "default",
        "smollm",
        "starcoder",
        "llama-bpe",
        "llama3",
        "llama-v3",
        "qwen2",
    ];

    /// The pre-tokenizer for a `tokenizer.ggml.pre` value (one of [`PreTokenizer::NAMES`]);
    /// `None` for names not supported.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "gpt2" | "gpt-2" | "default" => Some(Self::Gpt2),
            "smollm" | "starcoder" => Some(Self::Gpt2Digits),
            "llama-bpe" | "llama3" | "llama-v3" => Some(Self::Llama3),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }

    /// The pattern, without the emulated look-ahead.
    fn pattern(self) -> &'static str {
        match self {
            Self::Gpt2 | Self::Gpt2Digits => GPT2,
            Self::Llama3 => LLAMA3,
            Self::Qwen2 => QWEN2,
        }
    }
}

/// A compiled pre-tokenizer.
#[derive(Clone, Debug)]
pub(super) struct Splitter {
    pre: PreTokenizer,
    regex: Regex,
}

impl Splitter {
    /// Compiles the pre-tokenizer's pattern.
    pub(super) fn new(pre: PreTokenizer) -> Result<Self> {
        let regex = Regex::new(pre.pattern()).map_err(|e| tok_err(format!("split regex: {e}")))?;
        Ok(Self { pre, regex })
    }

    /// The pieces of `text` (which holds no special token); they cover it, in order.
    pub(super) fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut pieces = Vec::new();
        match self.pre {
            PreTokenizer::Gpt2Digits => {
                let mut start = 0;
                for (i, c) in text.char_indices() {
                    if c.is_numeric() {
                        self.regex_split(&text[start..i], &mut pieces);
                        pieces.push(&text[i..i + c.len_utf8()]);
                        start = i + c.len_utf8();
                    }
                }
                self.regex_split(&text[start..], &mut pieces);
            }
            _ => self.regex_split(text, &mut pieces),
        }
        pieces
    }

    /// The regex split with `\s+(?!\S)` emulated (see the module docs).
    fn regex_split<'t>(&self, text: &'t str, pieces: &mut Vec<&'t str>) {
        // In the GPT-2 pattern every whitespace-only match is `\s+`; in the others one holding a
        // line break is `\s*[\r\n]+`, which the look-ahead does not touch.
        let line_breaks_apart =
            self.pre != PreTokenizer::Gpt2 && self.pre != PreTokenizer::Gpt2Digits;
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.regex.find_at(text, pos) else {
                // Unreachable: the alternatives cover every character. Keep the rest whole.
                pieces.push(&text[pos..]);
                break;
            };
            debug_assert_eq!(m.start(), pos, "the split regex leaves no gaps");
            let mut end = m.end();
            let s = m.as_str();
            let look_ahead = s.chars().all(char::is_whitespace)
                && !(line_breaks_apart && s.contains(['\r', '\n']));
            if end < text.len() && look_ahead {
                if let Some(last) = s.chars().next_back() {
                    if last.len_utf8() < s.len() {
                        end -= last.len_utf8();
                    }
                }
            }
            pieces.push(&text[m.start()..end]);
            pos = end;
        }
    }
}
