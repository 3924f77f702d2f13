//! kvattn: cross-vendor GPU attention kernels over a KV cache, on wgpu and WGSL.
pub mod attention;
pub mod error;
pub mod quant;
pub mod reference;

pub use error::{Error, Result};
