//! Token-by-token decoding that emits only whole UTF-8 characters.

use super::Tokenizer;

/// Turns tokens into text one at a time, emitting text only once its UTF-8 is complete (a
/// character split over two byte tokens comes out with the second).
#[derive(Clone, Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
    /// No token but control tokens pushed yet (SentencePiece drops the first token's space).
    at_start: bool,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder with nothing pending.
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
            at_start: true,
        }
    }

    /// Adds one token; returns the text that became complete (possibly empty). Invalid UTF-8
    /// comes out as U+FFFD; an incomplete sequence at the end is held back.
    pub fn push(&mut self, id: u32) -> String {
        let bytes = self.tokenizer.piece_bytes(id, &mut self.at_start);
        self.pending.extend_from_slice(bytes);
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

    /// Ends the stream: whatever is held back, as U+FFFD. The decoder can then start a new
    /// sequence.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        self.at_start = true;
        out
    }
}
