//! The GPU context: adapter choice, features and limits, buffers and readback.
mod buffer;
mod context;
mod layout;

pub use buffer::STORAGE;
pub use context::{AdapterSummary, Capabilities, Context, ContextOptions};
pub use layout::WgslStruct;
