//! GPU tests: every kernel against the CPU reference on the adapter `Context::new()` picks
//! (lavapipe and llvmpipe in CI). They fail, never skip, when no adapter exists.

#[path = "../common/mod.rs"]
mod common;

mod append_plan;
mod append_quant;
#[cfg(feature = "bench")]
mod bench_cases;
mod context;
mod decode;
#[cfg(feature = "decoder")]
mod decoder;
#[cfg(feature = "decoder")]
mod decoder_arch;
#[cfg(feature = "decoder")]
mod decoder_blocks;
#[cfg(feature = "decoder")]
mod decoder_ops;
mod embedding;
#[cfg(feature = "decoder")]
mod gguf_writer;
mod gpu_errors;
mod head_matmul;
mod kv_load;
mod matmul;
mod mla;
mod nan_semantics;
mod paged;
mod paged_attention;
mod plan_lifetime;
#[cfg(feature = "decoder")]
mod qmatmul;
mod qmatmul_group;
mod rope;
#[cfg(feature = "serve")]
mod serve;
mod snapshot;
#[cfg(feature = "decoder")]
mod step_counters;
mod strided_copy;
mod threads;
mod verify;
