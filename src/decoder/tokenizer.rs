//! GPT-2 byte-level BPE tokenizer built from GGUF metadata (`tokenizer.ggml.*`), with ChatML
//! prompts and a streaming decoder.
//!
//! Encoding, as Hugging Face `tokenizers` and llama.cpp do it for `tokenizer.ggml.model = gpt2`:
//!
//! 1. Control and user-defined tokens (`<|im_start|>`, ...) that appear literally in the text map
//!    to their own ids (the longest one wins where several start at the same place).
//! 2. The rest is pre-split: for the `smollm` / `starcoder` pre-tokenizers every digit first
//!    becomes a piece of its own; then the GPT-2 regex
//!    `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` splits each piece.
//!    (The `regex` crate has no look-ahead: `\s+(?!\S)` is obtained by giving back the last
//!    whitespace character of a run that a non-space follows, which is what the look-ahead does.)
//! 3. Each piece's UTF-8 bytes map to GPT-2's printable byte alphabet (`' '` -> `Ġ`,
//!    `'\n'` -> `Ċ`, ...) and the merges are applied, lowest rank first (leftmost on ties).
//!
//! Decoding maps tokens back to bytes (control tokens give their text) and joins them; bytes that
//! are not valid UTF-8 become U+FFFD. [`StreamDecoder`] does the same token by token, holding back
//! an incomplete UTF-8 sequence until the token that completes it arrives.
//!
//! ```no_run
//! use kvattn::decoder::{gguf::GgufFile, tokenizer::Tokenizer};
//! # fn main() -> kvattn::Result<()> {
//! let file = GgufFile::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tok = Tokenizer::from_gguf(&file)?;
//! let prompt = tok.chat_prompt(&[("user", "What is the capital of France?")], true)?;
//! let ids = tok.encode(&prompt);
//! assert_eq!(tok.decode(&ids), prompt);
//! # Ok(()) }
//! ```

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use regex::Regex;

use super::gguf::GgufFile;
use crate::{Error, Result};

/// The GPT-2 pre-tokenizer regex without its `\s+(?!\S)` alternative (emulated in code).
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

fn tok_err(msg: impl Into<String>) -> Error {
    Error::Tokenizer(msg.into())
}

/// Kind of a vocabulary entry (`tokenizer.ggml.token_type`, llama.cpp's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0: no type given.
    Undefined,
    /// 1: an ordinary BPE token.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token (`<|im_start|>`, `<|endoftext|>`, ...): matched literally in text.
    Control,
    /// 4: a user-defined token: matched literally in text.
    UserDefined,
    /// 5: an unused slot.
    Unused,
    /// 6: a byte token (`<0x41>`, SentencePiece style).
    Byte,
}

impl TokenType {
    /// The type for a value of `tokenizer.ggml.token_type`; `None` for unknown values.
    pub fn from_id(id: i32) -> Option<Self> {
        Some(match id {
            0 => Self::Undefined,
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }

    /// True for the types matched literally in text by [`Tokenizer::encode`] and decoded as
    /// their text: control and user-defined.
    pub fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined)
    }
}

/// How text is split before BPE (`tokenizer.ggml.pre`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PreTokenizer {
    /// The GPT-2 regex alone (`gpt2`, and files without `tokenizer.ggml.pre`).
    Gpt2,
    /// Every digit (`\p{N}`) isolated first, then the GPT-2 regex (`smollm`, `starcoder`).
    Gpt2Digits,
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value; `None` for names not supported.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "gpt2" => Some(Self::Gpt2),
            "smollm" | "starcoder" => Some(Self::Gpt2Digits),
            _ => None,
        }
    }
}

/// Everything a [`Tokenizer`] is built from; [`Tokenizer::from_gguf`] fills it from the metadata.
#[derive(Clone, Debug)]
pub struct TokenizerConfig {
    /// Token strings in GPT-2's byte alphabet, indexed by id.
    pub tokens: Vec<String>,
    /// One type per token (empty: all [`TokenType::Normal`]).
    pub token_types: Vec<TokenType>,
    /// Merges, `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// The pre-tokenizer.
    pub pre: PreTokenizer,
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Unknown token (used for a byte missing from the vocabulary).
    pub unk: Option<u32>,
    /// Padding token.
    pub pad: Option<u32>,
    /// Whether prompts start with BOS (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// The Jinja chat template (`tokenizer.chat_template`).
    pub chat_template: Option<String>,
}

/// GPT-2's byte -> printable character table (`bytes_to_unicode`).
fn byte_to_char_table() -> [char; 256] {
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
        table[b as usize] = char::from_u32(c).expect("below 0x200");
    }
    table
}

/// A GPT-2 byte-level BPE tokenizer.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    tokens: Vec<String>,
    types: Vec<TokenType>,
    vocab: HashMap<String, u32>,
    /// (left, right) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Id of each byte's single-character token.
    byte_ids: [Option<u32>; 256],
    /// Control and user-defined tokens, longest text first.
    specials: Vec<u32>,
    /// Whether some special token starts with this byte.
    special_first: [bool; 256],
    /// Bytes of every token, concatenated; token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    pre: PreTokenizer,
    split: Regex,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata. Requires `tokenizer.ggml.model =
    /// gpt2` and a supported `tokenizer.ggml.pre` (see [`PreTokenizer::from_name`]).
    ///
    /// # Errors
    /// [`Error::Gguf`] when a key is missing or of the wrong type; [`Error::Tokenizer`] for an
    /// unsupported model or pre-tokenizer, token lists of different lengths, an unknown token
    /// type or a malformed merge.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(tok_err(format!(
                "tokenizer model {model:?} is not supported (only \"gpt2\" byte-level BPE)"
            )));
        }
        let pre = match file.get_str_opt("tokenizer.ggml.pre")? {
            None => PreTokenizer::Gpt2,
            Some(name) => PreTokenizer::from_name(name).ok_or_else(|| {
                tok_err(format!(
                    "pre-tokenizer {name:?} is not supported (supported: gpt2, smollm, starcoder)"
                ))
            })?,
        };
        let tokens = file.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        let token_types = match file.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(_) => file
                .get_i32_array("tokenizer.ggml.token_type")?
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    TokenType::from_id(t)
                        .ok_or_else(|| tok_err(format!("token {i} has unknown token type {t}")))
                })
                .collect::<Result<_>>()?,
        };
        let merges = file.get_str_array("tokenizer.ggml.merges")?.to_vec();
        Self::new(TokenizerConfig {
            tokens,
            token_types,
            merges,
            pre,
            bos: file.get_u32_opt("tokenizer.ggml.bos_token_id")?,
            eos: file.get_u32_opt("tokenizer.ggml.eos_token_id")?,
            unk: file.get_u32_opt("tokenizer.ggml.unknown_token_id")?,
            pad: file.get_u32_opt("tokenizer.ggml.padding_token_id")?,
            add_bos: file
                .get_bool_opt("tokenizer.ggml.add_bos_token")?
                .unwrap_or(false),
            chat_template: file
                .get_str_opt("tokenizer.chat_template")?
                .map(str::to_string),
        })
    }

    /// Builds the tokenizer from its parts, checking them: at least one token, ids that fit in
    /// `u32`, one type per token, special ids in range, every merge `"a b"` made of two tokens
    /// whose concatenation is a token.
    pub fn new(config: TokenizerConfig) -> Result<Self> {
        let TokenizerConfig {
            tokens,
            mut token_types,
            merges: merge_lines,
            pre,
            bos,
            eos,
            unk,
            pad,
            add_bos,
            chat_template,
        } = config;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(tok_err(format!("vocabulary of {n} tokens")));
        }
        if token_types.is_empty() {
            token_types = vec![TokenType::Normal; n];
        } else if token_types.len() != n {
            return Err(tok_err(format!(
                "{} token types for {n} tokens",
                token_types.len()
            )));
        }
        for (what, id) in [("bos", bos), ("eos", eos), ("unk", unk), ("pad", pad)] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(tok_err(format!(
                        "{what} token id {id} is outside the vocabulary of {n}"
                    )));
                }
            }
        }
        let mut vocab = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            vocab.entry(t.clone()).or_insert(i as u32);
        }
        let mut merges = HashMap::with_capacity(merge_lines.len());
        for (rank, line) in merge_lines.iter().enumerate() {
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
            merges.entry((ia, ib)).or_insert((rank as u32, merged));
        }
        let b2c = byte_to_char_table();
        let mut c2b = HashMap::with_capacity(256);
        let mut byte_ids = [None; 256];
        for (b, &c) in b2c.iter().enumerate() {
            c2b.insert(c, b as u8);
            byte_ids[b] = vocab.get(c.encode_utf8(&mut [0; 4]) as &str).copied();
        }
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| token_types[i as usize].is_special() && !tokens[i as usize].is_empty())
            .collect();
        specials.sort_by_key(|&i| Reverse(tokens[i as usize].len()));
        let mut special_first = [false; 256];
        for &i in &specials {
            special_first[tokens[i as usize].as_bytes()[0] as usize] = true;
        }
        let mut bytes = Vec::new();
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        for (t, ty) in tokens.iter().zip(&token_types) {
            if ty.is_special() {
                bytes.extend_from_slice(t.as_bytes());
            } else {
                for c in t.chars() {
                    match c2b.get(&c) {
                        Some(&b) => bytes.push(b),
                        // Not in the byte alphabet: keep the character as it is.
                        None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
            }
            offsets.push(bytes.len());
        }
        let split = Regex::new(GPT2_SPLIT).map_err(|e| tok_err(format!("split regex: {e}")))?;
        Ok(Self {
            tokens,
            types: token_types,
            vocab,
            merges,
            byte_ids,
            specials,
            special_first,
            bytes,
            offsets,
            pre,
            split,
            bos,
            eos,
            unk,
            pad,
            add_bos,
            chat_template,
        })
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Beginning-of-sequence id.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence id (for an instruct model, the end of a turn: `<|im_end|>` in SmolLM2).
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Unknown-token id.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    /// Padding id.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether a prompt should start with BOS (`tokenizer.ggml.add_bos_token`, default false).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The pre-tokenizer in use.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// The chat template, if the file has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The id of a token given as it is written in the vocabulary (`"<|im_start|>"`, `"Ġthe"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    /// The vocabulary string of a token (in GPT-2's byte alphabet for normal tokens).
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The type of a token.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// True for control tokens (`<|im_start|>`, `<|endoftext|>`, ...).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }

    /// The bytes a token decodes to (control tokens: their text); `None` for an id outside the
    /// vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        (i < self.tokens.len()).then(|| &self.bytes[self.offsets[i]..self.offsets[i + 1]])
    }

    /// Encodes text. Control tokens written literally map to their ids; no BOS is added (see
    /// [`Tokenizer::encode_prompt`]). A byte whose single-character token is missing from the
    /// vocabulary becomes the unknown token (and is dropped when there is none); with a complete
    /// GPT-2 byte alphabet this never happens.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut plain_start = 0;
        let mut i = 0;
        let bytes = text.as_bytes();
        while i < bytes.len() {
            let found = if !self.special_first[bytes[i] as usize] || !text.is_char_boundary(i) {
                None
            } else {
                self.specials
                    .iter()
                    .copied()
                    .find(|&id| bytes[i..].starts_with(self.tokens[id as usize].as_bytes()))
            };
            match found {
                Some(id) => {
                    self.encode_plain(&text[plain_start..i], &mut out);
                    out.push(id);
                    i += self.tokens[id as usize].len();
                    plain_start = i;
                }
                None => i += 1,
            }
        }
        self.encode_plain(&text[plain_start..], &mut out);
        out
    }

    /// [`Tokenizer::encode`] with BOS in front when the model asks for it ([`Tokenizer::add_bos`]).
    pub fn encode_prompt(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.push(bos);
        }
        ids.extend(self.encode(text));
        ids
    }

    /// Text without special tokens: pre-split, then BPE on each piece.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        for piece in self.pre_split(text) {
            self.bpe(piece.as_bytes(), out);
        }
    }

    /// The pre-tokenizer's pieces of `text` (which holds no special token).
    fn pre_split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut pieces = Vec::new();
        match self.pre {
            PreTokenizer::Gpt2 => self.regex_split(text, &mut pieces),
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
        }
        pieces
    }

    /// The GPT-2 regex split, with `\s+(?!\S)` emulated: a whitespace run of more than one
    /// character that a non-space follows gives back its last character.
    fn regex_split<'t>(&self, text: &'t str, pieces: &mut Vec<&'t str>) {
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.split.find_at(text, pos) else {
                // Unreachable: the alternatives cover every character. Keep the rest whole.
                pieces.push(&text[pos..]);
                break;
            };
            debug_assert_eq!(m.start(), pos, "the split regex leaves no gaps");
            let mut end = m.end();
            let s = m.as_str();
            if end < text.len() && s.chars().all(char::is_whitespace) {
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

    /// Byte-level BPE on one piece: merges applied lowest rank first, leftmost first on ties.
    fn bpe(&self, piece: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        let mut ids: Vec<u32> = Vec::with_capacity(piece.len());
        for &b in piece {
            if let Some(id) = self.byte_ids[b as usize].or(self.unk) {
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
            if let Some(&(rank, _)) = self.merges.get(&(ids[i], ids[i + 1])) {
                heap.push(Reverse((rank, i, ids[i], ids[i + 1])));
            }
        }
        while let Some(Reverse((_, i, l, r))) = heap.pop() {
            let j = next[i];
            if !alive[i] || ids[i] != l || j == NONE || ids[j] != r {
                continue; // stale: one side was merged since
            }
            let (_, merged) = self.merges[&(l, r)];
            ids[i] = merged;
            alive[j] = false;
            next[i] = next[j];
            if next[j] != NONE {
                prev[next[j]] = i;
            }
            if prev[i] != NONE {
                let p = prev[i];
                if let Some(&(rank, _)) = self.merges.get(&(ids[p], merged)) {
                    heap.push(Reverse((rank, p, ids[p], merged)));
                }
            }
            if next[i] != NONE {
                let q = next[i];
                if let Some(&(rank, _)) = self.merges.get(&(merged, ids[q])) {
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

    /// The bytes of a sequence of tokens, joined (ids outside the vocabulary give U+FFFD).
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            match self.token_bytes(id) {
                Some(b) => out.extend_from_slice(b),
                None => out.extend_from_slice("\u{FFFD}".as_bytes()),
            }
        }
        out
    }

    /// Decodes tokens to text: bytes joined, control tokens as their text, invalid UTF-8 (and ids
    /// outside the vocabulary) as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// A decoder for printing tokens one at a time.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    /// Renders a conversation in ChatML, as the model's chat template does:
    /// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then `<|im_start|>assistant\n`
    /// when `add_generation_prompt`. When the template carries a default system message (the
    /// literal text after `<|im_start|>system` in the template, as SmolLM2's "You are a helpful
    /// AI assistant named SmolLM, trained by Hugging Face") and the first message is not a system
    /// one, that system message comes first.
    ///
    /// Errors when the model has no chat template or one that is not ChatML (no `<|im_start|>`).
    pub fn chat_prompt(
        &self,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::InvalidArgument("the model has no chat template".into()))?;
        if !template.contains("<|im_start|>") || !template.contains("<|im_end|>") {
            return Err(Error::InvalidArgument(
                "chat template not supported: only ChatML templates (<|im_start|> ... <|im_end|>) are"
                    .into(),
            ));
        }
        let mut out = String::new();
        if let Some(&(role, _)) = messages.first() {
            if role != "system" {
                if let Some(system) = default_system_message(template) {
                    push_chatml(&mut out, "system", &system);
                }
            }
        }
        for &(role, content) in messages {
            push_chatml(&mut out, role, content);
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
        }
        Ok(out)
    }
}

fn push_chatml(out: &mut String, role: &str, content: &str) {
    out.push_str("<|im_start|>");
    out.push_str(role);
    out.push('\n');
    out.push_str(content);
    out.push_str("<|im_end|>\n");
}

/// The literal default system message of a ChatML template: the text between
/// `<|im_start|>system` + newline (a real one or the escape `\n`) and `<|im_end|>`, when it is
/// plain text (not an expression such as `' + messages[0]['content'] + '`).
fn default_system_message(template: &str) -> Option<String> {
    const START: &str = "<|im_start|>system";
    let mut rest = template;
    while let Some(at) = rest.find(START) {
        rest = &rest[at + START.len()..];
        let body = rest.strip_prefix('\n').or_else(|| rest.strip_prefix("\\n"));
        let Some(body) = body else { continue };
        let Some(end) = body.find("<|im_end|>") else {
            continue;
        };
        let text = &body[..end];
        let expression = ["{{", "{%", "' +", "+ '", "\" +", "+ \"", "message"]
            .iter()
            .any(|p| text.contains(p));
        if !text.is_empty() && !expression {
            return Some(text.replace("\\n", "\n").replace("\\'", "'"));
        }
    }
    None
}

/// Turns tokens into text one at a time, emitting text only once its UTF-8 is complete (a
/// character split over two byte tokens comes out with the second).
#[derive(Clone, Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder with nothing pending.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text that became complete (possibly empty). Invalid UTF-8
    /// comes out as U+FFFD; an incomplete sequence at the end is held back.
    pub fn push(&mut self, id: u32) -> String {
        match self.tokenizer.token_bytes(id) {
            Some(b) => self.pending.extend_from_slice(b),
            None => self.pending.extend_from_slice("\u{FFFD}".as_bytes()),
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Valid by construction.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                    }
                }
            }
        }
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// Ends the stream: whatever is held back, as U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny vocabulary: three control tokens, the 256 byte characters, and merged tokens.
    fn tiny(merges: &[&str], extra: &[&str], pre: PreTokenizer) -> Tokenizer {
        let b2c = byte_to_char_table();
        let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut types = vec![TokenType::Control; 3];
        for c in b2c {
            tokens.push(c.to_string());
            types.push(TokenType::Normal);
        }
        for t in extra {
            tokens.push(t.to_string());
            types.push(TokenType::Normal);
        }
        Tokenizer::new(TokenizerConfig {
            tokens,
            token_types: types,
            merges: merges.iter().map(|s| s.to_string()).collect(),
            pre,
            bos: Some(1),
            eos: Some(2),
            unk: Some(0),
            pad: None,
            add_bos: false,
            chat_template: Some(
                "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
                 {{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
                 Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + \
                 message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
                 {{ '<|im_start|>assistant\n' }}{% endif %}"
                    .into(),
            ),
        })
        .unwrap()
    }

    fn strs(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&i| tok.id_to_token(i).unwrap().to_string())
            .collect()
    }

    #[test]
    fn byte_alphabet() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[0xA0], 'ł');
        assert_eq!(t[0xAD], 'Ń');
        let mut sorted = t.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }

    #[test]
    fn pre_split_matches_the_gpt2_regex() {
        let g = tiny(&[], &[], PreTokenizer::Gpt2);
        let d = tiny(&[], &[], PreTokenizer::Gpt2Digits);
        let cases: &[(&str, &[&str])] = &[
            ("Hello world", &["Hello", " world"]),
            ("a   b", &["a", "  ", " b"]),
            ("x\n\ny", &["x", "\n", "\n", "y"]),
            ("x\n\n y", &["x", "\n\n", " y"]),
            ("end  ", &["end", "  "]),
            ("I'm don't we'll", &["I", "'m", " don", "'t", " we", "'ll"]),
            ("hello!!! ok?", &["hello", "!!!", " ok", "?"]),
            ("été 東京", &["été", " 東京"]),
            ("\t\tx", &["\t", "\t", "x"]),
        ];
        for (text, want) in cases {
            assert_eq!(g.pre_split(text), *want, "{text:?}");
        }
        assert_eq!(g.pre_split("abc 123"), ["abc", " 123"]);
        assert_eq!(d.pre_split("abc 123"), ["abc", " ", "1", "2", "3"]);
        assert_eq!(d.pre_split("x1y ٣"), ["x", "1", "y", " ", "٣"]);
    }

    #[test]
    fn bpe_applies_merges_by_rank() {
        // "e l" outranks "h e": "hell" -> h, el, l (not he, ll).
        let t = tiny(
            &["e l", "h e", "l l"],
            &["el", "he", "ll"],
            PreTokenizer::Gpt2,
        );
        assert_eq!(strs(&t, &t.encode("hell")), ["h", "el", "l"]);
        assert_eq!(strs(&t, &t.encode("hello")), ["h", "el", "l", "o"]);
        // Ties go left: "aaa" -> aa, a.
        let t = tiny(&["a a"], &["aa"], PreTokenizer::Gpt2);
        assert_eq!(strs(&t, &t.encode("aaa")), ["aa", "a"]);
        assert_eq!(strs(&t, &t.encode("aaaa")), ["aa", "aa"]);
        // Chained merges with the space character.
        let t = tiny(
            &["h e", "Ġ t", "Ġt he"],
            &["he", "Ġt", "Ġthe"],
            PreTokenizer::Gpt2,
        );
        assert_eq!(strs(&t, &t.encode("the the")), ["t", "he", "Ġthe"]);
        assert_eq!(t.decode(&t.encode("the the")), "the the");
        // Merges are checked.
        let err = |m: &str| {
            let mut c = TokenizerConfig {
                tokens: vec!["a".into(), "b".into(), "ab".into()],
                token_types: vec![],
                merges: vec![m.into()],
                pre: PreTokenizer::Gpt2,
                bos: None,
                eos: None,
                unk: None,
                pad: None,
                add_bos: false,
                chat_template: None,
            };
            let ok = Tokenizer::new(c.clone()).is_ok();
            c.merges.clear();
            c.bos = Some(3);
            assert!(Tokenizer::new(c).is_err());
            ok
        };
        assert!(err("a b"));
        assert!(!err("a c"));
        assert!(!err("b a"));
        assert!(!err("ab"));
    }

    #[test]
    fn control_tokens_are_single_ids() {
        let t = tiny(&[], &[], PreTokenizer::Gpt2);
        let ids = t.encode("<|im_start|>user\nhi<|im_end|><|endoftext|>");
        assert_eq!(ids[0], 1);
        assert_eq!(ids[ids.len() - 2..], [2, 0]);
        assert_eq!(
            strs(&t, &ids[1..ids.len() - 2]),
            ["u", "s", "e", "r", "Ċ", "h", "i"]
        );
        assert_eq!(
            t.decode(&ids),
            "<|im_start|>user\nhi<|im_end|><|endoftext|>"
        );
        // A partial control token is plain text.
        assert_eq!(t.decode(&t.encode("<|im_sta")), "<|im_sta");
        assert!(!t.encode("<|im_sta").contains(&1));
        assert!(t.is_control(1) && !t.is_control(3));
        assert_eq!(t.token_to_id("<|im_end|>"), Some(2));
        assert_eq!(
            (t.bos_id(), t.eos_id(), t.unk_id(), t.vocab_size()),
            (Some(1), Some(2), Some(0), 259)
        );
    }

    #[test]
    fn round_trip() {
        let t = tiny(
            &["h e", "Ġ t", "Ġt he", "l l"],
            &["he", "Ġt", "Ġthe", "ll"],
            PreTokenizer::Gpt2Digits,
        );
        for s in [
            "",
            "Hello, world! The year is 2024.",
            "Crème brûlée à la française, naïve façade",
            "東京は日本の首都です。北京",
            "emoji 🦀🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
            "digits 0123456789 ٣٤ ½",
            "   leading spaces, tabs\t\tand\n\n\nnewlines \r\n end   ",
            "mixed <|im_start|> control <|im_end|> tokens",
            "\u{0}\u{1}\u{7f} controls",
        ] {
            let ids = t.encode(s);
            assert_eq!(t.decode(&ids), s);
            // Streaming gives the same text.
            let mut sd = t.stream_decoder();
            let mut text: String = ids.iter().map(|&i| sd.push(i)).collect();
            text.push_str(&sd.finish());
            assert_eq!(text, s);
        }
    }

    #[test]
    fn stream_decoder_waits_for_whole_characters() {
        let t = tiny(&[], &[], PreTokenizer::Gpt2);
        let ids = t.encode("é🦀");
        assert_eq!(ids.len(), 6); // 2 + 4 byte tokens
        let mut sd = t.stream_decoder();
        assert_eq!(sd.push(ids[0]), "");
        assert_eq!(sd.pending_bytes(), 1);
        assert_eq!(sd.push(ids[1]), "é");
        for &i in &ids[2..5] {
            assert_eq!(sd.push(i), "");
        }
        assert_eq!(sd.push(ids[5]), "🦀");
        assert_eq!(sd.finish(), "");
        // Invalid bytes become U+FFFD, at once when they cannot start a character, at the end
        // when they are a dangling start.
        let byte = |b: u8| {
            t.token_to_id(&byte_to_char_table()[b as usize].to_string())
                .unwrap()
        };
        assert_eq!(sd.push(byte(0xFF)), "\u{FFFD}");
        assert_eq!(sd.push(byte(b'a')), "a");
        assert_eq!(sd.push(byte(0xE6)), "");
        assert_eq!(sd.push(byte(b'b')), "\u{FFFD}b");
        assert_eq!(sd.push(byte(0xF0)), "");
        assert_eq!(sd.finish(), "\u{FFFD}");
        assert_eq!(t.decode(&[byte(0xE6), byte(b'b')]), "\u{FFFD}b");
        assert_eq!(t.decode(&[100_000]), "\u{FFFD}");
    }

    #[test]
    fn from_gguf_metadata() {
        use crate::decoder::gguf::tests::Writer;
        let mut toks: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        toks.extend(byte_to_char_table().iter().map(|c| c.to_string()));
        toks.push("Ġt".into());
        let refs: Vec<&str> = toks.iter().map(String::as_str).collect();
        let mut types = vec![3, 3, 3];
        types.extend(vec![1; 257]);
        let build = |model: &str, pre: &str, types: &[i32]| {
            let mut w = Writer::new();
            w.str("tokenizer.ggml.model", model)
                .str("tokenizer.ggml.pre", pre)
                .str_array("tokenizer.ggml.tokens", &refs)
                .i32_array("tokenizer.ggml.token_type", types)
                .str_array("tokenizer.ggml.merges", &["Ġ t"])
                .u32("tokenizer.ggml.bos_token_id", 1)
                .u32("tokenizer.ggml.eos_token_id", 2)
                .u32("tokenizer.ggml.unknown_token_id", 0)
                .bool("tokenizer.ggml.add_bos_token", true)
                .str("tokenizer.chat_template", "<|im_start|>{{ x }}<|im_end|>");
            Tokenizer::from_gguf(&GgufFile::parse(w.build()).unwrap())
        };
        let t = build("gpt2", "smollm", &types).unwrap();
        assert_eq!(t.pre_tokenizer(), PreTokenizer::Gpt2Digits);
        assert_eq!(strs(&t, &t.encode(" t1")), ["Ġt", "1"]);
        assert_eq!(t.encode_prompt("t")[0], 1);
        assert!(t.add_bos());
        assert_eq!(
            t.chat_prompt(&[("user", "x")], false).unwrap(),
            "<|im_start|>user\nx<|im_end|>\n"
        );
        let e = build("llama", "smollm", &types).unwrap_err().to_string();
        assert!(
            e.contains("\"llama\"") && e.contains("not supported"),
            "{e}"
        );
        let e = build("gpt2", "llama-bpe", &types).unwrap_err().to_string();
        assert!(e.contains("llama-bpe"), "{e}");
        let mut bad = types.clone();
        bad[7] = 9;
        assert!(build("gpt2", "smollm", &bad)
            .unwrap_err()
            .to_string()
            .contains("token type 9"));
        assert!(build("gpt2", "smollm", &types[1..]).is_err());
    }

    #[test]
    fn chat_prompt_chatml() {
        let t = tiny(&[], &[], PreTokenizer::Gpt2);
        let sys = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
        assert_eq!(
            t.chat_prompt(&[("user", "Hi!")], true).unwrap(),
            format!("{sys}<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
        );
        assert_eq!(
            t.chat_prompt(
                &[
                    ("system", "Be brief."),
                    ("user", "Hi"),
                    ("assistant", "Hello."),
                    ("user", "Bye")
                ],
                false
            )
            .unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        );
        assert_eq!(t.chat_prompt(&[], true).unwrap(), "<|im_start|>assistant\n");
        // Escaped newlines in the template, no default system message, not ChatML, no template.
        assert_eq!(
            default_system_message(r"{{- '<|im_start|>system\nYou are Qwen.<|im_end|>\n' }}")
                .as_deref(),
            Some("You are Qwen.")
        );
        assert_eq!(
            default_system_message(
                "'<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>'"
            ),
            None
        );
        let mut c = t.clone();
        c.chat_template = Some("{{ '[INST] ' + message['content'] + ' [/INST]' }}".into());
        assert!(c
            .chat_prompt(&[("user", "x")], true)
            .unwrap_err()
            .to_string()
            .contains("not supported"));
        c.chat_template = None;
        assert!(c.chat_prompt(&[("user", "x")], true).is_err());
    }
}
