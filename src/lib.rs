#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
pub mod attention;
pub mod bench;
pub mod cache;
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
pub mod serve;
pub mod shader;

pub use error::{Error, Result};
