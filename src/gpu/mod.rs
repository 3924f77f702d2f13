//! The GPU context: adapter choice, features and limits, buffers and readback.
mod buffer;
mod context;
mod layout;
mod sentinel;
mod timing;

pub(crate) use buffer::check_storage;
pub use buffer::STORAGE;
pub use context::{AdapterSummary, AttentionKernel, Capabilities, Context, ContextOptions};
pub use layout::WgslStruct;
pub use sentinel::{is_unwritten, UNWRITTEN, UNWRITTEN_BITS};
pub use timing::Timing;
