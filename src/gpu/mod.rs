//! The GPU context: adapter choice, features and limits, buffers and readback.
mod buffer;
mod context;
mod counters;
pub(crate) mod dispatch;
pub mod f16_check;
mod gate;
mod layout;
mod readback;
mod record;
mod sentinel;
mod serial;
mod timing;

pub(crate) use buffer::check_storage;
pub use buffer::STORAGE;
pub use context::{
    AdapterFacts, AdapterSummary, AttentionKernel, Capabilities, Context, ContextOptions,
};
pub use counters::Counters;
pub use dispatch::RowStrides;
pub use gate::UpdateGate;
pub use layout::WgslStruct;
pub use readback::Readback;
pub use record::Dispatch;
pub use sentinel::{is_unwritten, UNWRITTEN, UNWRITTEN_BITS};
pub use timing::{PassTime, Timing};
