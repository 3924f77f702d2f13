//! Multi-head Latent Attention (DeepSeek-V2) on the GPU: the latent paged cache
//! ([`MlaCache`]), the layer weights ([`MlaWeights`]) and attention on the absorbed and the
//! up-projection paths ([`MlaPlan`], [`mla_host`]). The CPU reference is
//! [`reference::mla`](mod@crate::reference::mla).

mod absorbed;
pub mod cache;
pub mod plan;
pub mod strided_copy;
mod up_proj;
pub mod weights;

/// The strided per-head product, which lives in [`matmul`](crate::matmul) (the decoder uses
/// it too); re-exported here under its old path.
pub use crate::matmul::head_matmul;

pub use cache::{MlaCache, MlaCacheConfig};
pub use plan::{mla_host, mla_host_async, MlaArgs, MlaIo, MlaPath, MlaPlan};
pub use weights::MlaWeights;
