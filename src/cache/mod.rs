//! The paged KV cache: block allocator with prefix sharing and copy-on-write, admission,
//! telemetry, GPU block pools, in-place append, swap, snapshots, and the capacity model.
pub mod allocator;
pub mod append_kv;
pub mod append_plan;
pub mod capacity;
pub mod copy_blocks;
pub mod paged;
pub mod pool;
pub mod prefix;
pub mod presets;
pub mod scales;
pub mod snapshot;
pub mod telemetry;
