//! CPU references of the kernels: plain loops, f64 accumulation, explicit masks (ARCHITECTURE.md
//! section 11). They are the oracles of the GPU tests and of `kvattn verify`, and are themselves
//! tested on hand-computed cases.
//!
//! Inputs are f32 slices. To model a kernel that reads f16 (or quantized) values, round the inputs
//! to what the kernel sees before calling: every f16 and bf16 value is exact in f32.

pub mod attention;
#[cfg(feature = "decoder")]
pub mod llama;
pub mod mla;
pub mod ops;
#[cfg(feature = "decoder")]
pub mod qmatmul;
pub mod rope;

pub use attention::{attention, AttentionOutput};
pub use mla::{mla, MlaBatch, MlaShape};
pub use rope::{rope, RopeConfig, RopeStyle};
