//! Attention kernels over a KV cache, and the problem description they share with the reference.
pub mod decode;
pub mod merge;
pub mod merge_states;
pub mod paged;
pub mod paged_lanes;
pub mod paged_plan;
mod paged_plan_step;
pub mod spec;

pub use paged::SPLIT_TOKENS;
pub use spec::{check_seq_len, AttentionOptions, AttentionShape, RaggedBatch, MAX_TOKENS};
