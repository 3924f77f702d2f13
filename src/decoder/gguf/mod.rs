//! GGUF reader: header, metadata, tensor table and dequantization to f32 ([`super::blocks`]),
//! plus the Llama hyper-parameters a decoder needs ([`LlamaHyper`]).
//!
//! GGUF (llama.cpp's model format) is little-endian: a header (`"GGUF"`, version, tensor count,
//! metadata count), the metadata key/value pairs, the tensor infos (name, dims, ggml type, offset
//! into the data section), padding to `general.alignment` (default 32) and the tensor data.
//! Versions 2 and 3 share that layout and both are read; version 1 and big-endian files are not.
//!
//! **Dims are `ne0`-first**: `dims[0]` is the contiguous dimension (the length of a row), the
//! last one varies slowest. So `token_embd.weight` with dims `[576, 49152]` is 49,152 rows of
//! 576 values (one row per token), and a projection `blk.N.attn_q.weight` with dims
//! `[d_in, d_out]` holds `d_out` rows of `d_in` values: `y[o] = sum_i W[o * d_in + i] * x[i]`.
//!
//! Every input is validated: a truncated or corrupt file gives [`Error::Gguf`], never a panic.
//! Counts are checked against the bytes left before anything is allocated for them, and initial
//! capacities are capped, so memory stays proportional to what is actually in the file.
//!
//! ```no_run
//! use kvattn::decoder::gguf::{GgufFile, LlamaHyper};
//! # fn main() -> kvattn::Result<()> {
//! let file = GgufFile::open("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let hyper = LlamaHyper::from_gguf(&file)?;
//! let norm = file.tensor_f32("blk.0.attn_norm.weight")?; // F32, d_model values
//! assert_eq!(norm.len(), hyper.d_model);
//! # Ok(()) }
//! ```

mod file;
mod ggml_type;
mod hyper;
mod reader;
#[cfg(test)]
pub(crate) mod tests;
mod value;

pub use super::blocks::{dequantize, dequantize_into};
pub use file::{GgufFile, TensorInfo};
pub use ggml_type::GgmlType;
pub use hyper::{check_rope_scaling, LlamaHyper, LLAMA_ARCHITECTURES};
pub use value::{Array, Value, ValueType};

use crate::Error;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor's offset when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGUF tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays the reader accepts (real files use at most 2).
pub const MAX_ARRAY_DEPTH: usize = 16;

/// Most entries reserved up front for a count read from the file (a corrupt count must not
/// reserve more than the data behind it can fill).
const MAX_PREALLOC: usize = 1 << 16;

fn gguf_err(msg: impl Into<String>) -> Error {
    Error::Gguf(msg.into())
}
