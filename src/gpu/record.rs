//! Recording work without submitting it, and the context's counted doors to the device: every
//! buffer, bind group, upload and submission of the crate goes through a method here.
//!
//! # Errors without blocking
//! A submission gets one set of error scopes (validation, out-of-memory, internal) around
//! `finish` and `submit`. The scopes are popped at once but their results are not awaited:
//! they are kept and reported, as a typed [`Error`], by the next readback
//! ([`Context::read_back`], [`Context::read_back_async`]) or explicit sync point
//! ([`Context::check_errors`], [`Context::wait`]). Creating a bind group or buffer is checked
//! on the spot (a buffer of another device or with the wrong usage fails before anything is
//! recorded).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, PoisonError};

use super::counters::AtomicCounters;
use super::Context;
use crate::{Error, Result};

/// The result of a popped error scope, awaited at the next sync point.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) type ScopeFuture = Pin<Box<dyn Future<Output = Option<wgpu::Error>> + Send>>;
/// The result of a popped error scope, awaited at the next sync point.
#[cfg(target_arch = "wasm32")]
pub(crate) type ScopeFuture = Pin<Box<dyn Future<Output = Option<wgpu::Error>>>>;

/// The scopes of one submission (or upload) whose results are not known yet.
pub(crate) struct PendingScope {
    what: String,
    /// Validation, out-of-memory, internal: the first error found is reported.
    futures: Vec<ScopeFuture>,
}

/// Scopes past this many are settled as they come (those already resolved, which on native is
/// all of them), so that an application that submits without ever syncing holds a bounded list.
const SETTLE_AT: usize = 32;

/// What the next sync point reports: scopes not looked at yet, and the first error (and how
/// many more) among those already settled.
#[derive(Default)]
pub(crate) struct Pending {
    scopes: Vec<PendingScope>,
    caught: Option<Error>,
    more: usize,
}

impl Pending {
    fn catch(&mut self, what: &str, error: wgpu::Error) {
        match self.caught {
            None => self.caught = Some(gpu_error(what, error)),
            Some(_) => self.more += 1,
        }
    }

    /// Polls every scope once without waiting: resolved ones are dropped (their error kept),
    /// unresolved ones stay.
    fn settle_ready(&mut self) {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let scopes = std::mem::take(&mut self.scopes);
        for mut scope in scopes {
            let mut open = Vec::new();
            for mut future in std::mem::take(&mut scope.futures) {
                match future.as_mut().poll(&mut cx) {
                    std::task::Poll::Ready(Some(e)) => self.catch(&scope.what, e),
                    std::task::Poll::Ready(None) => {}
                    std::task::Poll::Pending => open.push(future),
                }
            }
            if !open.is_empty() {
                scope.futures = open;
                self.scopes.push(scope);
            }
        }
    }
}

/// One dispatch prepared ahead of recording: its pipeline, bind group and grid. Recording it
/// creates nothing; plans and the decoder keep these across steps.
#[derive(Debug, Clone)]
pub struct Dispatch {
    pipeline: Arc<wgpu::ComputePipeline>,
    bind_group: wgpu::BindGroup,
    grid: [u32; 3],
}

impl Dispatch {
    /// Records the dispatch into `pass`.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        pass.dispatch_workgroups(self.grid[0], self.grid[1], self.grid[2]);
    }

    /// The workgroup grid.
    pub fn grid(&self) -> [u32; 3] {
        self.grid
    }
}

/// A wgpu error raised while doing `what`, as the crate's error.
pub(crate) fn gpu_error(what: &str, error: wgpu::Error) -> Error {
    match error {
        source @ wgpu::Error::OutOfMemory { .. } => Error::OutOfMemory {
            what: what.to_string(),
            source,
            more: 0,
        },
        source => Error::Wgpu {
            what: what.to_string(),
            source,
            more: 0,
        },
    }
}

/// `error`, the first of `more + 1` wgpu errors, saying how many followed it.
pub(crate) fn with_more(error: Error, more: usize) -> Error {
    match error {
        Error::Wgpu { what, source, .. } => Error::Wgpu { what, source, more },
        Error::OutOfMemory { what, source, .. } => Error::OutOfMemory { what, source, more },
        other => other,
    }
}

impl Context {
    /// The counters so far (see [`Counters`](super::Counters)).
    pub fn counters(&self) -> super::Counters {
        self.counters.snapshot()
    }

    /// Runs `f` inside error scopes whose results are reported at the next sync point instead
    /// of waited for here.
    pub(crate) fn deferred<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        self.check_lost()?;
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = self.serial.run(f);
        let futures: Vec<ScopeFuture> = vec![
            Box::pin(validation.pop()),
            Box::pin(oom.pop()),
            Box::pin(internal.pop()),
        ];
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        pending.scopes.push(PendingScope {
            what: what.to_string(),
            futures,
        });
        if pending.scopes.len() >= SETTLE_AT {
            pending.settle_ready();
        }
        Ok(value)
    }

    /// Awaits the error scopes of every submission so far and returns the first error any of
    /// them caught, then the first error raised outside any scope (on a context that installed
    /// its own handler), then device loss. Never waits for the GPU to finish work.
    pub async fn check_errors_async(&self) -> Result<()> {
        let mut pending =
            std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner));
        for scope in std::mem::take(&mut pending.scopes) {
            for future in scope.futures {
                if let Some(e) = future.await {
                    pending.catch(&scope.what, e);
                }
            }
        }
        let (first, more) = (pending.caught, pending.more);
        self.check_lost()?;
        match first {
            // Objects of a lost device are invalid: report the cause, not the symptom.
            Some(e) => Err(self.lost_or(with_more(e, more))),
            None => self.take_uncaptured(),
        }
    }

    /// The blocking form of [`check_errors_async`](Self::check_errors_async) (on native
    /// backends the scopes' results are ready when popped, so this does not block).
    pub fn check_errors(&self) -> Result<()> {
        pollster::block_on(self.check_errors_async())
    }

    /// A command encoder for recording kvattn's (and the caller's) work.
    pub fn encoder(&self, label: &str) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) })
    }

    /// Finishes `encoder` and submits it: one submission, inside one set of error scopes whose
    /// errors come back at the next readback or [`check_errors`](Self::check_errors). Submit
    /// work that uses kvattn's plans through this (not `queue.submit`), so that a plan knows when
    /// its metadata writes have been consumed.
    pub fn submit(
        &self,
        what: &str,
        encoder: wgpu::CommandEncoder,
    ) -> Result<wgpu::SubmissionIndex> {
        let index = self.deferred(what, || self.queue.submit([encoder.finish()]))?;
        AtomicCounters::add(&self.counters.submissions, 1);
        Ok(index)
    }

    /// Records what `f` records into one compute pass of a new encoder and submits it. When `f`
    /// fails nothing is submitted (the half-recorded encoder is dropped).
    pub fn run_pass(
        &self,
        what: &str,
        f: impl FnOnce(&mut wgpu::ComputePass<'_>) -> Result<()>,
    ) -> Result<wgpu::SubmissionIndex> {
        self.check_lost()?;
        let mut encoder = self.encoder(what);
        {
            let mut pass = self.begin_compute_pass(&mut encoder, Some(what));
            f(&mut pass)?;
        }
        self.submit(what, encoder)
    }

    /// A buffer made by `desc`, checked on the spot: a refused creation is [`Error::Wgpu`],
    /// [`Error::OutOfMemory`] or [`Error::DeviceLost`].
    pub fn create_buffer(&self, desc: &wgpu::BufferDescriptor<'_>) -> Result<wgpu::Buffer> {
        let buffer = self.scoped(desc.label.unwrap_or("buffer"), || {
            self.device.create_buffer(desc)
        })?;
        AtomicCounters::add(&self.counters.buffers, 1);
        Ok(buffer)
    }

    /// A bind group binding `resources` to bindings 0, 1, ... of group 0 of `pipeline` (layout
    /// taken from the shader), checked on the spot: a buffer of another device, without the
    /// usage the shader needs or bound past its end is [`Error::Wgpu`] naming `label`.
    pub fn bind_group(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        resources: &[wgpu::BindingResource<'_>],
    ) -> Result<wgpu::BindGroup> {
        let entries: Vec<wgpu::BindGroupEntry> = resources
            .iter()
            .enumerate()
            .map(|(i, resource)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: resource.clone(),
            })
            .collect();
        let group = self.scoped(label, || {
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(label),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            })
        })?;
        AtomicCounters::add(&self.counters.bind_groups, 1);
        Ok(group)
    }

    /// A [`Dispatch`] of `pipeline` over `grid` with `resources` bound (see
    /// [`bind_group`](Self::bind_group)); the grid is checked against the adapter's limit.
    pub fn prepare_dispatch(
        &self,
        label: &str,
        pipeline: &Arc<wgpu::ComputePipeline>,
        resources: &[wgpu::BindingResource<'_>],
        grid: [u32; 3],
    ) -> Result<Dispatch> {
        let max = self.caps().max_compute_workgroups_per_dimension;
        if grid.iter().any(|&n| n > max) {
            return Err(Error::InvalidArgument(format!(
                "{label}: dispatch of {grid:?} workgroups exceeds the adapter's {max} per dimension"
            )));
        }
        Ok(Dispatch {
            pipeline: Arc::clone(pipeline),
            bind_group: self.bind_group(label, pipeline, resources)?,
            grid,
        })
    }

    /// Writes `data` into `buffer` at byte `offset` through the queue: it lands before the next
    /// submission runs. Checked first (usage `COPY_DST`, 4-byte alignment, bounds).
    pub fn write_buffer(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        if !buffer.usage().contains(wgpu::BufferUsages::COPY_DST) {
            return Err(Error::InvalidArgument(
                "write_buffer: the buffer lacks COPY_DST usage".into(),
            ));
        }
        let len = data.len() as u64;
        if offset % wgpu::COPY_BUFFER_ALIGNMENT != 0 || len % wgpu::COPY_BUFFER_ALIGNMENT != 0 {
            return Err(Error::InvalidArgument(format!(
                "write_buffer: offset {offset} and length {len} must be multiples of 4 bytes"
            )));
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > buffer.size())
        {
            return Err(Error::InvalidArgument(format!(
                "write_buffer: {len} bytes at {offset} pass the end of a {}-byte buffer",
                buffer.size()
            )));
        }
        if len == 0 {
            return Ok(());
        }
        self.deferred("write_buffer", || {
            self.queue.write_buffer(buffer, offset, data)
        })?;
        AtomicCounters::add(&self.counters.bytes, len);
        Ok(())
    }

    /// Counts a compiled pipeline (the pipeline cache calls this on a miss).
    pub(crate) fn count_pipeline(&self) {
        AtomicCounters::add(&self.counters.pipelines, 1);
    }

    /// Counts bytes written into a buffer mapped at creation.
    pub(crate) fn count_upload(&self, bytes: u64) {
        AtomicCounters::add(&self.counters.bytes, bytes);
    }
}
