#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
pub mod attention;
#[cfg(feature = "bench")]
pub mod bench;
pub mod cache;
#[cfg(feature = "decoder")]
pub mod decoder;
pub mod error;
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

pub use error::{Error, Result};
