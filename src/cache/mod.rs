//! The paged KV cache: block allocator with prefix sharing and copy-on-write, admission,
//! telemetry, GPU block pools, in-place append, swap, snapshots, and the capacity model.
pub mod allocator;
pub mod capacity;
pub mod presets;
pub mod telemetry;
