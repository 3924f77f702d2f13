//! Cross-vendor GPU attention kernels over a paged KV cache, on [wgpu] and WGSL.
//!
//! kvattn runs wherever wgpu runs compute (Vulkan, Metal, DX12, OpenGL, WebGPU, and software
//! adapters such as Mesa's lavapipe and llvmpipe). It provides what a serving engine or a local
//! inference runtime needs around the KV cache: attention kernels for decode and chunked
//! prefill (MHA, GQA, MQA, ragged batches, split-K, sliding window, softcap, sinks, ALiBi),
//! DeepSeek-V2 Multi-head Latent Attention, KV storage in f32, f16, bf16, FP8, int8 and int4
//! (encoded on the GPU bit for bit as the CPU codec does), and a paged cache with prefix
//! sharing, copy-on-write, swap and snapshots. Every kernel has a CPU reference (plain loops,
//! f64 accumulation) that checks it in the tests and, through verification, on the user's
//! adapter. Bad input is a typed [`Error`], never a panic.
//!
//! # Features
//!
//! | feature | adds |
//! |---|---|
//! | *(default)* | the library: [`gpu`], [`attention`], [`cache`], [`quant`], [`mla`], [`rope`](mod@rope), [`matmul`], [`reference`](mod@reference), [`verify`] |
//! | `decoder` | `decoder`: a Llama-family decoder (GGUF, tokenizer, forward pass, sampling) and `reference::llama` |
//! | `serve` | `serve`: a continuous-batching scheduler (implies `decoder`) |
//! | `bench` | `bench`: the adapter's ceilings, benchmark cases, the roofline |
//! | `serde` | `Serialize` for reports, telemetry, capacity results and bench rows |
//! | `cli` | the `kvattn` binary (implies all of the above) |
//!
//! The default features pull in none of the command line's dependencies.
//!
//! # Example
//!
//! A paged cache holding one sequence's K/V in f16, attention over it for one decode token with
//! eight query heads over two KV heads, checked against the CPU reference:
//!
//! ```
//! use kvattn::attention::paged::{paged_attention_host, PagedAttentionArgs, PagedQuery};
//! use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
//! use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
//! use kvattn::gpu::Context;
//! use kvattn::quant::KvDtype;
//! use kvattn::shader::Precision;
//!
//! fn main() -> kvattn::Result<()> {
//!     let ctx = Context::new()?; // the best adapter; WGPU_BACKEND=vulkan, gl, ... to choose
//!
//!     // One layer, 2 KV heads of 64 dims, f16 storage, 8 blocks of 16 tokens.
//!     let config = PagedKvConfig::new(1, 2, 64, KvDtype::F16);
//!     let mut cache = PagedKvCache::new(&ctx, config, PoolSize::Blocks(8))?;
//!     cache.add_sequence(0, &[])?;
//!     // Five tokens' K and V, [tokens, kv heads, head dim] per layer (exact in f16).
//!     let k: Vec<f32> = (0..5 * 2 * 64).map(|i| (i % 7) as f32 * 0.25).collect();
//!     let v: Vec<f32> = (0..5 * 2 * 64).map(|i| (i % 5) as f32 * 0.5).collect();
//!     cache.append_host(&ctx, 0, &[1, 2, 3, 4, 5], &[k.clone()], &[v.clone()])?;
//!
//!     // One query token (the last position) for 8 query heads sharing the 2 KV heads.
//!     let shape = AttentionShape { num_q_heads: 8, num_kv_heads: 2, head_dim_qk: 64, head_dim_v: 64 };
//!     let options = AttentionOptions::default(); // causal, scale 1/sqrt(64)
//!     let q = vec![0.1f32; 8 * 64];
//!     let batch = [PagedQuery { seq: 0, len_q: 1 }];
//!     let args = PagedAttentionArgs {
//!         layer: 0,
//!         batch: &batch,
//!         shape,
//!         options: &options,
//!         precision: Precision::F32,
//!     };
//!     let got = paged_attention_host(&ctx, &cache, &args, &q)?; // out [1, 8, 64], lse [1, 8]
//!
//!     // The same attention on the CPU (f64), in the FlashAttention varlen layout.
//!     let reference = RaggedBatch { q: &q, k: &k, v: &v, cu_seqlens_q: &[0, 1], cu_seqlens_k: &[0, 5] };
//!     let want = kvattn::reference::attention(&reference, &shape, &options)?;
//!     assert!(got.out.iter().zip(&want.out).all(|(a, b)| (a - b).abs() < 1e-4));
//!     Ok(())
//! }
//! ```
//!
//! Serving loops keep everything on the GPU: plans made once per capacity
//! ([`attention::paged::PagedAttentionPlan`], [`cache::append_plan::AppendPlan`]) record each
//! step into the caller's compute pass, creating nothing after the first step, on a device
//! kvattn opened or on the application's own ([`gpu::Context::from_wgpu`]). [`verify::run`]
//! checks every kernel and storage format against the CPU reference on the adapter at hand.
//!
//! # Further reading
//!
//! - [README](https://github.com/kvattn/kvattn/blob/main/README.md): quick start, more
//!   examples (embedding in an application, quantized KV, MLA, verification), the command
//!   line.
//! - [ARCHITECTURE.md](https://github.com/kvattn/kvattn/blob/main/docs/ARCHITECTURE.md): the
//!   layers, the life of a decode step, the exact encoding of every KV format, mask and score
//!   conventions, NaN rules, tolerances.
//! - [benchmarks.md](https://github.com/kvattn/kvattn/blob/main/docs/benchmarks.md) and
//!   [quality.md](https://github.com/kvattn/kvattn/blob/main/docs/quality.md): measurements.
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// wgpu's web objects are neither `Send` nor `Sync`; the crate's `Arc`s share them between
// threads on native targets, and the web has one thread.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]
pub mod attention;
#[cfg(feature = "bench")]
pub mod bench;
pub mod cache;
#[cfg(feature = "decoder")]
pub mod decoder;
pub mod error;
mod ggml_source;
pub mod gpu;
pub mod kernels;
pub mod matmul;
pub mod mla;
pub mod pipeline;
pub mod problem;
pub mod quant;
pub mod reference;
pub mod rng;
pub mod rope;
#[cfg(feature = "serve")]
pub mod serve;
pub mod shader;
pub mod verify;

pub use error::{Error, Result};

// The README's Rust examples, compiled (and run where not `no_run`) as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
