//! Tokenizers built from GGUF metadata (`tokenizer.ggml.*`): GPT-2 style byte-level BPE and
//! SentencePiece BPE, chat prompts rendered from the file's own Jinja template, and a streaming
//! decoder.
//!
//! Two tokenizer models, as llama.cpp names them in `tokenizer.ggml.model`:
//!
//! - **`gpt2`, byte-level BPE** (SmolLM2, Llama 3, Qwen2, ...).
//!   Control and user-defined tokens (`<|im_start|>`, ...) written in the text map to their own
//!   ids (the longest one wins where several start at the same place). The rest is pre-split by
//!   the regex of the file's `tokenizer.ggml.pre` ([`PreTokenizer`]: `gpt2`, `smollm`/`starcoder`,
//!   `llama-bpe`, `qwen2`); each piece's UTF-8 bytes map to GPT-2's printable byte alphabet
//!   (`' '` -> `Ġ`, `'\n'` -> `Ċ`, ...) and the merges are applied, lowest rank first (leftmost
//!   on ties). With `llama-bpe` a piece that is itself a token is that token (Llama 3's
//!   `ignore_merges`).
//! - **`llama`, SentencePiece BPE** (Llama 2, Mistral, TinyLlama and other older files). Spaces
//!   become `▁` (U+2581) and, with `tokenizer.ggml.add_space_prefix` (default true), each stretch
//!   of text between special tokens gets a leading `▁` (as llama.cpp does). The characters are
//!   merged pairwise: the adjacent pair whose concatenation is a vocabulary token of the highest
//!   score (`tokenizer.ggml.scores`) merges first, the leftmost on ties, until no pair is a token.
//!   A character that is not a token becomes its UTF-8 bytes as byte tokens (`<0xE6>`, ...) or,
//!   without them, the unknown token.
//!
//! Decoding maps tokens back to bytes (control tokens give their text; SentencePiece: `▁` gives
//! a space and byte tokens their byte, and the space the prefix added in front of the first
//! token is dropped) and joins them; bytes that are not valid UTF-8 become U+FFFD.
//! [`StreamDecoder`] does the same token by token, holding back an incomplete UTF-8 sequence
//! until the token that completes it arrives.
//!
//! [`Tokenizer::chat_prompt`] renders the file's `tokenizer.chat_template` with MiniJinja, as
//! Hugging Face's `apply_chat_template` does.
//!
//! **Why not the `tokenizers` crate.** GGUF carries vocabularies, merges and scores, not
//! `tokenizer.json`, so its models would still have to be assembled here from the metadata; the
//! SentencePiece files give scores where its BPE model wants ranked merges, and its regex
//! pre-tokenizers need `fancy-regex` for the look-ahead. Without default features it still brings
//! 44 crates the decoder does not otherwise build (rayon, derive_builder and its proc macros,
//! `fancy-regex`, `esaxx-rs`, ...; `tokenizers` 0.22.2). The code here is a few hundred lines on
//! the `regex` crate the decoder already uses, and `scripts/tokenizer-golden.py` checks it against
//! Hugging Face `tokenizers` and `sentencepiece` (`tests/data/tokenizer_golden.json`).
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

mod bpe;
mod chat;
mod pretokenize;
mod spm;
mod stream;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::HashMap;

use super::gguf::GgufFile;
use crate::{Error, Result};

pub use pretokenize::PreTokenizer;
pub use stream::StreamDecoder;

fn tok_err(msg: impl Into<String>) -> Error {
    Error::Tokenizer(msg.into())
}

/// Kind of a vocabulary entry (`tokenizer.ggml.token_type`, llama.cpp's numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0: no type given.
    Undefined,
    /// 1: an ordinary token.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token (`<|im_start|>`, `<|endoftext|>`, `<s>`, ...): matched literally in
    /// text.
    Control,
    /// 4: a user-defined token: matched literally in text.
    UserDefined,
    /// 5: an unused slot (never produced by encoding).
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

    /// True for the types SentencePiece merges into (normal, user-defined, untyped).
    fn is_mergeable(self) -> bool {
        matches!(self, Self::Normal | Self::UserDefined | Self::Undefined)
    }
}

/// The tokenizer algorithm (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TokenizerModel {
    /// `gpt2`: byte-level BPE with ranked merges and a regex pre-tokenizer.
    #[default]
    Gpt2,
    /// `llama`: SentencePiece BPE with token scores and byte fallback.
    SentencePiece,
}

impl TokenizerModel {
    /// The `tokenizer.ggml.model` values supported.
    pub const SUPPORTED: &'static [&'static str] = &["gpt2", "llama"];

    /// The model for a `tokenizer.ggml.model` value; `None` for models not supported.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "gpt2" => Some(Self::Gpt2),
            "llama" => Some(Self::SentencePiece),
            _ => None,
        }
    }

    /// The `tokenizer.ggml.model` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::SentencePiece => "llama",
        }
    }
}

/// Everything a [`Tokenizer`] is built from; [`Tokenizer::from_gguf`] fills it from the metadata.
/// `..Default::default()` fills the fields a caller does not need (a byte-level BPE tokenizer
/// with the GPT-2 pre-tokenizer, no special ids, no template).
#[derive(Clone, Debug)]
pub struct TokenizerConfig {
    /// The tokenizer algorithm.
    pub model: TokenizerModel,
    /// Token strings, indexed by id: in GPT-2's byte alphabet for [`TokenizerModel::Gpt2`], with
    /// `▁` for spaces for [`TokenizerModel::SentencePiece`].
    pub tokens: Vec<String>,
    /// One type per token (empty: all [`TokenType::Normal`]).
    pub token_types: Vec<TokenType>,
    /// SentencePiece: one score per token, higher merges first (empty: all 0). Unused by BPE.
    pub scores: Vec<f32>,
    /// Byte-level BPE: merges, `"left right"`, highest priority first. Unused by SentencePiece.
    pub merges: Vec<String>,
    /// Byte-level BPE: the pre-tokenizer. Unused by SentencePiece.
    pub pre: PreTokenizer,
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Unknown token (used for a character or byte missing from the vocabulary).
    pub unk: Option<u32>,
    /// Padding token.
    pub pad: Option<u32>,
    /// Whether prompts start with BOS (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// SentencePiece: whether text gets a leading `▁` (`tokenizer.ggml.add_space_prefix`).
    pub add_space_prefix: bool,
    /// The Jinja chat template (`tokenizer.chat_template`).
    pub chat_template: Option<String>,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        Self {
            model: TokenizerModel::Gpt2,
            tokens: Vec::new(),
            token_types: Vec::new(),
            scores: Vec::new(),
            merges: Vec::new(),
            pre: PreTokenizer::Gpt2,
            bos: None,
            eos: None,
            unk: None,
            pad: None,
            add_bos: false,
            add_space_prefix: true,
            chat_template: None,
        }
    }
}

/// What the model does with text between special tokens.
#[derive(Clone, Debug)]
enum Engine {
    Bpe {
        merges: bpe::Merges,
        split: pretokenize::Splitter,
    },
    Spm {
        scores: Vec<f32>,
        add_space_prefix: bool,
    },
}

/// A tokenizer: byte-level BPE or SentencePiece BPE (see the module docs).
#[derive(Clone, Debug)]
pub struct Tokenizer {
    model: TokenizerModel,
    engine: Engine,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    vocab: HashMap<String, u32>,
    /// Id of each byte's token (BPE: its byte-alphabet character; SentencePiece: `<0xXX>`).
    byte_ids: [Option<u32>; 256],
    /// Control and user-defined tokens, longest text first.
    specials: Vec<u32>,
    /// Whether some special token starts with this byte.
    special_first: [bool; 256],
    /// Bytes of every token, concatenated; token `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    pre: PreTokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata: `tokenizer.ggml.model` `gpt2`
    /// (with a supported `tokenizer.ggml.pre`, see [`PreTokenizer::from_name`]; absent means
    /// `gpt2`) or `llama` (SentencePiece, with `tokenizer.ggml.scores`).
    ///
    /// # Errors
    /// [`Error::Gguf`] when a key is missing or of the wrong type; [`Error::Tokenizer`] for an
    /// unsupported model or pre-tokenizer (the message names it and lists the supported ones),
    /// token lists of different lengths, an unknown token type or a malformed merge.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let name = file.get_str("tokenizer.ggml.model")?;
        let model = TokenizerModel::from_name(name).ok_or_else(|| {
            tok_err(format!(
                "tokenizer model {name:?} is not supported (supported: \"gpt2\" byte-level BPE, \
                 \"llama\" SentencePiece BPE)"
            ))
        })?;
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
        let (pre, merges, scores) = match model {
            TokenizerModel::Gpt2 => {
                let pre = match file.get_str_opt("tokenizer.ggml.pre")? {
                    None => PreTokenizer::Gpt2,
                    Some(name) => PreTokenizer::from_name(name).ok_or_else(|| {
                        tok_err(format!(
                            "pre-tokenizer {name:?} is not supported (supported: {})",
                            PreTokenizer::NAMES.join(", ")
                        ))
                    })?,
                };
                let merges = file.get_str_array("tokenizer.ggml.merges")?.to_vec();
                (pre, merges, Vec::new())
            }
            TokenizerModel::SentencePiece => {
                let scores = file.get_f32_array("tokenizer.ggml.scores")?.to_vec();
                (PreTokenizer::Gpt2, Vec::new(), scores)
            }
        };
        Self::new(TokenizerConfig {
            model,
            tokens,
            token_types,
            scores,
            merges,
            pre,
            bos: file.get_u32_opt("tokenizer.ggml.bos_token_id")?,
            eos: file.get_u32_opt("tokenizer.ggml.eos_token_id")?,
            unk: file.get_u32_opt("tokenizer.ggml.unknown_token_id")?,
            pad: file.get_u32_opt("tokenizer.ggml.padding_token_id")?,
            // llama.cpp's defaults: SentencePiece models start with BOS, BPE ones say so.
            add_bos: file
                .get_bool_opt("tokenizer.ggml.add_bos_token")?
                .unwrap_or(model == TokenizerModel::SentencePiece),
            add_space_prefix: file
                .get_bool_opt("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(true),
            chat_template: file
                .get_str_opt("tokenizer.chat_template")?
                .map(str::to_string),
        })
    }

    /// Builds the tokenizer from its parts, checking them: at least one token, ids that fit in
    /// `u32`, one type per token, special ids in range; byte-level BPE: every merge `"a b"` made
    /// of two tokens whose concatenation is a token; SentencePiece: one score per token, none
    /// NaN, byte tokens of the form `<0xXX>`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] naming the first inconsistency.
    pub fn new(config: TokenizerConfig) -> Result<Self> {
        let TokenizerConfig {
            model,
            tokens,
            mut token_types,
            scores,
            merges,
            pre,
            bos,
            eos,
            unk,
            pad,
            add_bos,
            add_space_prefix,
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
        let (engine, byte_ids, bytes, offsets) = match model {
            TokenizerModel::Gpt2 => {
                let merges = bpe::Merges::new(&merges, &vocab, pre == PreTokenizer::Llama3)?;
                let split = pretokenize::Splitter::new(pre)?;
                let byte_ids = merges.byte_ids(&vocab);
                let (bytes, offsets) = bpe::token_bytes(&tokens, &token_types);
                (Engine::Bpe { merges, split }, byte_ids, bytes, offsets)
            }
            TokenizerModel::SentencePiece => {
                let scores = spm::check_scores(scores, n)?;
                let byte_ids = spm::byte_ids(&tokens, &token_types)?;
                let (bytes, offsets) = spm::token_bytes(&tokens, &token_types);
                let engine = Engine::Spm {
                    scores,
                    add_space_prefix,
                };
                (engine, byte_ids, bytes, offsets)
            }
        };
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| token_types[i as usize].is_special() && !tokens[i as usize].is_empty())
            .collect();
        specials.sort_by_key(|&i| Reverse(tokens[i as usize].len()));
        let mut special_first = [false; 256];
        for &i in &specials {
            special_first[tokens[i as usize].as_bytes()[0] as usize] = true;
        }
        Ok(Self {
            model,
            engine,
            tokens,
            types: token_types,
            vocab,
            byte_ids,
            specials,
            special_first,
            bytes,
            offsets,
            pre,
            bos,
            eos,
            unk,
            pad,
            add_bos,
            chat_template,
        })
    }

    /// The tokenizer algorithm.
    pub fn model(&self) -> TokenizerModel {
        self.model
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

    /// Whether a prompt should start with BOS (`tokenizer.ggml.add_bos_token`; when absent,
    /// true for SentencePiece and false for byte-level BPE, as in llama.cpp).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The pre-tokenizer of a byte-level BPE tokenizer (SentencePiece has none and reports
    /// [`PreTokenizer::Gpt2`]).
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// SentencePiece: whether text gets a leading `▁` (false for byte-level BPE).
    pub fn add_space_prefix(&self) -> bool {
        matches!(
            self.engine,
            Engine::Spm {
                add_space_prefix: true,
                ..
            }
        )
    }

    /// The chat template, if the file has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The id of a token given as it is written in the vocabulary (`"<|im_start|>"`, `"Ġthe"`,
    /// `"▁the"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    /// The vocabulary string of a token (in GPT-2's byte alphabet for byte-level BPE, with `▁`
    /// for SentencePiece).
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The type of a token.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// True for control tokens (`<|im_start|>`, `<|endoftext|>`, `<s>`, ...).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }

    /// The bytes a token decodes to (control tokens: their text; SentencePiece: `▁` as a
    /// space, byte tokens as their byte); `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        (i < self.tokens.len()).then(|| &self.bytes[self.offsets[i]..self.offsets[i + 1]])
    }

    /// Encodes text. Control and user-defined tokens written literally map to their ids; no BOS
    /// is added (see [`Tokenizer::encode_prompt`]). A byte (BPE) or character (SentencePiece
    /// without its byte tokens) missing from the vocabulary becomes the unknown token, and is
    /// dropped when there is none; with a complete byte alphabet this never happens.
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

    /// Text between special tokens (or the ends of the text), never empty text: no token.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        match &self.engine {
            Engine::Bpe { merges, split } => {
                for piece in split.split(text) {
                    merges.encode(piece.as_bytes(), &self.vocab, &self.byte_ids, self.unk, out);
                }
            }
            Engine::Spm {
                scores,
                add_space_prefix,
            } => spm::encode(self, scores, text, *add_space_prefix, out),
        }
    }

    /// Whether decoding drops the leading space of this token when it is the first one that is
    /// not a control token: SentencePiece with the space prefix, a normal token.
    fn strips_leading_space(&self, id: u32) -> bool {
        self.add_space_prefix()
            && matches!(
                self.token_type(id),
                Some(TokenType::Normal | TokenType::Undefined)
            )
            && self
                .token_bytes(id)
                .is_some_and(|b| b.first() == Some(&b' '))
    }

    /// The bytes of a sequence of tokens, joined (ids outside the vocabulary give U+FFFD). For
    /// SentencePiece with the space prefix, the leading space of the first token that is not a
    /// control token is dropped, as SentencePiece does.
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut at_start = true;
        for &id in ids {
            out.extend_from_slice(self.piece_bytes(id, &mut at_start));
        }
        out
    }

    /// One token's bytes in a sequence being decoded; `at_start` says whether no token other than
    /// control tokens came before (and is updated).
    fn piece_bytes(&self, id: u32, at_start: &mut bool) -> &[u8] {
        let Some(b) = self.token_bytes(id) else {
            *at_start = false;
            return "\u{FFFD}".as_bytes();
        };
        if !*at_start || self.is_control(id) {
            return b;
        }
        *at_start = false;
        if self.strips_leading_space(id) {
            &b[1..]
        } else {
            b
        }
    }

    /// Decodes tokens to text: bytes joined as [`Tokenizer::decode_bytes`] does, control tokens
    /// as their text, invalid UTF-8 (and ids outside the vocabulary) as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
    }

    /// A decoder for printing tokens one at a time; it gives the text [`Tokenizer::decode`]
    /// gives for the tokens pushed so far.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    /// Renders a conversation with the model's chat template (`tokenizer.chat_template`), as
    /// Hugging Face's `apply_chat_template` does: `messages` as `(role, content)` pairs, then
    /// the opening of the assistant's turn when `add_generation_prompt`. The template also sees
    /// `bos_token` and `eos_token` (the tokens' text), `tools` and `documents` (none),
    /// `raise_exception(message)` and `strftime_now(format)` (today's date in UTC from the
    /// system clock).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the model has no chat template or the template does not
    /// compile or render; [`Error::InvalidArgument`] with the template's message when it calls
    /// `raise_exception` (a conversation the template refuses, such as roles that do not
    /// alternate).
    pub fn chat_prompt(
        &self,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            tok_err("the model has no chat template (tokenizer.chat_template); use a raw prompt")
        })?;
        let text_of = |id: Option<u32>| {
            id.and_then(|i| self.id_to_token(i))
                .unwrap_or_default()
                .to_string()
        };
        chat::render(
            template,
            &chat::ChatInput {
                messages,
                add_generation_prompt,
                bos_token: text_of(self.bos),
                eos_token: text_of(self.eos),
            },
        )
    }
}
