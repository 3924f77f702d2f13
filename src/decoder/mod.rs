//! A Llama-family decoder on kvattn's kernels (ARCHITECTURE.md sections 9 and 15): the forward
//! pass on the GPU ([`model`], with the element-wise kernels and the block-format products of
//! [`ops`], the weights of [`weights`]), loading GGUF models ([`gguf`], [`load`], the block
//! formats of [`blocks`]; [`gguf_writer`] writes them), the tokenizers (byte-level BPE and
//! SentencePiece) with prompts from the file's chat template ([`tokenizer`]), sampling on the
//! host ([`sampling`]), text generation ([`generate`]), a step's compute passes for profiling
//! ([`passes`]) and the KV-cache article's toy experiment ([`toy`]).

pub mod blocks;
pub mod generate;
pub mod gguf;
pub mod gguf_writer;
pub mod load;
pub mod model;
pub mod ops;
pub mod passes;
pub mod quality;
pub mod sampling;
pub mod tokenizer;
pub mod toy;
pub mod weights;
