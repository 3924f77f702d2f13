//! What a context has created and submitted: the numbers an embedding application watches to
//! see that a warm step creates nothing and submits once.

use std::sync::atomic::{AtomicU64, Ordering};

/// Totals since the [`Context`](super::Context) was created. Every buffer, bind group, pipeline,
/// upload and submission of the crate goes through one counting method of the context, so these
/// are exact (a test checks the source for calls that bypass them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Command buffers submitted to the queue.
    pub submissions: u64,
    /// Buffers created (storage, uniform, staging, query resolve).
    pub buffers_created: u64,
    /// Bind groups created.
    pub bind_groups_created: u64,
    /// Compute pipelines compiled (the pipeline cache's misses).
    pub pipelines_compiled: u64,
    /// Wall time spent compiling them, in nanoseconds: the shader module's creation (WGSL
    /// parsed, validated and translated) and the pipeline's, as the host waited for them.
    /// A driver that defers its own compilation to the first dispatch (some OpenGL drivers)
    /// makes that dispatch slower instead.
    pub pipeline_compile_nanos: u64,
    /// Bytes written from the host: buffer contents at creation and `write_buffer`.
    pub bytes_uploaded: u64,
}

impl Counters {
    /// What happened between `earlier` and `self` (counter by counter).
    pub fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            submissions: self.submissions - earlier.submissions,
            buffers_created: self.buffers_created - earlier.buffers_created,
            bind_groups_created: self.bind_groups_created - earlier.bind_groups_created,
            pipelines_compiled: self.pipelines_compiled - earlier.pipelines_compiled,
            pipeline_compile_nanos: self.pipeline_compile_nanos - earlier.pipeline_compile_nanos,
            bytes_uploaded: self.bytes_uploaded - earlier.bytes_uploaded,
        }
    }
}

/// The live counters inside a context.
#[derive(Debug, Default)]
pub(crate) struct AtomicCounters {
    pub submissions: AtomicU64,
    pub buffers: AtomicU64,
    pub bind_groups: AtomicU64,
    pub pipelines: AtomicU64,
    pub compile_nanos: AtomicU64,
    pub bytes: AtomicU64,
}

impl AtomicCounters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds `nanos` of pipeline compilation.
    pub fn add_compile_nanos(&self, nanos: u64) {
        Self::add(&self.compile_nanos, nanos);
    }

    pub fn snapshot(&self) -> Counters {
        Counters {
            submissions: self.submissions.load(Ordering::Relaxed),
            buffers_created: self.buffers.load(Ordering::Relaxed),
            bind_groups_created: self.bind_groups.load(Ordering::Relaxed),
            pipelines_compiled: self.pipelines.load(Ordering::Relaxed),
            pipeline_compile_nanos: self.compile_nanos.load(Ordering::Relaxed),
            bytes_uploaded: self.bytes.load(Ordering::Relaxed),
        }
    }
}
