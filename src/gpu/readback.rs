//! Reading buffers back: a copy recorded with the work (or in its own submission), `map_async`,
//! then a wait on that one submission only.
//!
//! On native backends the library polls the device while it waits (`poll` with the
//! submission's index); on the web the browser's event loop completes the mapping and the
//! async forms simply await it. Nothing here waits for the whole device.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context as TaskContext, Poll, Waker};

use bytemuck::Pod;

use super::Context;
use crate::{Error, Result};

/// A mapping request's outcome, filled by wgpu's callback.
#[derive(Default)]
struct MapState {
    result: Option<std::result::Result<(), wgpu::BufferAsyncError>>,
    waker: Option<Waker>,
}

/// Resolves when wgpu calls back with the mapping's outcome.
struct MapFuture(Arc<Mutex<MapState>>);

impl Future for MapFuture {
    type Output = std::result::Result<(), wgpu::BufferAsyncError>;
    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match state.result.take() {
            Some(r) => Poll::Ready(r),
            None => {
                state.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A staging buffer that reads a GPU buffer back after the submission that copies into it. Make
/// one per step shape and reuse it: [`encode_copy`](Self::encode_copy) into the step's
/// encoder, submit, then [`read`](Self::read) or [`read_async`](Self::read_async) with the
/// submission's index. Reading creates nothing and submits nothing.
#[derive(Debug)]
pub struct Readback {
    staging: wgpu::Buffer,
    /// Bytes copied by the last `encode_copy`.
    copied: Mutex<u64>,
}

impl Readback {
    /// A staging buffer of `bytes` (rounded up to 4).
    pub fn new(ctx: &Context, label: &str, bytes: u64) -> Result<Self> {
        let size = bytes.div_ceil(4).max(1) * 4;
        let staging = ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })?;
        Ok(Self {
            staging,
            copied: Mutex::new(0),
        })
    }

    /// Bytes the staging buffer holds.
    pub fn capacity(&self) -> u64 {
        self.staging.size()
    }

    /// Records a copy of `bytes` bytes of `src` from byte `offset` into the staging buffer.
    /// [`Error::InvalidArgument`] (nothing recorded) when `src` lacks `COPY_SRC`, the range
    /// passes its end or the staging buffer's, or is not 4-byte aligned.
    pub fn encode_copy(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        src: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
    ) -> Result<()> {
        if !src.usage().contains(wgpu::BufferUsages::COPY_SRC) {
            return Err(Error::InvalidArgument(
                "readback: the source buffer lacks COPY_SRC usage".into(),
            ));
        }
        let copy = bytes.div_ceil(4) * 4;
        if offset % 4 != 0 {
            return Err(Error::InvalidArgument(format!(
                "readback: offset {offset} is not a multiple of 4 bytes"
            )));
        }
        if offset.checked_add(copy).is_none_or(|end| end > src.size()) || copy > self.capacity() {
            return Err(Error::InvalidArgument(format!(
                "readback of {bytes} bytes at {offset} from a {}-byte buffer into {} bytes of \
                 staging",
                src.size(),
                self.capacity()
            )));
        }
        if copy > 0 {
            encoder.copy_buffer_to_buffer(src, offset, &self.staging, 0, copy);
        }
        *self.copied.lock().unwrap_or_else(PoisonError::into_inner) = bytes;
        Ok(())
    }

    /// The first `len` values of the last copy, once submission `index` (the one that carried
    /// the copy) has run. Reports the errors of every submission so far first (see
    /// [`Context::check_errors`]).
    pub async fn read_async<T: Pod>(
        &self,
        ctx: &Context,
        index: wgpu::SubmissionIndex,
        len: usize,
    ) -> Result<Vec<T>> {
        let bytes = (len * std::mem::size_of::<T>()) as u64;
        let copied = *self.copied.lock().unwrap_or_else(PoisonError::into_inner);
        if bytes > copied {
            return Err(Error::InvalidArgument(format!(
                "readback of {bytes} bytes after a copy of {copied}"
            )));
        }
        if bytes == 0 {
            ctx.check_errors_async().await?;
            return Ok(Vec::new());
        }
        ctx.map_after(&self.staging, index).await?;
        let view = self.staging.get_mapped_range(..).map_err(|e| {
            ctx.lost_or(Error::WgpuCall {
                what: "mapped range of a readback buffer".into(),
                source: Box::new(e),
            })
        })?;
        let out = bytemuck::pod_collect_to_vec(&view[..bytes as usize]);
        drop(view);
        ctx.serial.run(|| self.staging.unmap());
        Ok(out)
    }

    /// The blocking form of [`read_async`](Self::read_async).
    pub fn read<T: Pod>(
        &self,
        ctx: &Context,
        index: wgpu::SubmissionIndex,
        len: usize,
    ) -> Result<Vec<T>> {
        pollster::block_on(self.read_async(ctx, index, len))
    }
}

impl Context {
    /// Maps `staging` for reading once submission `index` has run: on native the library polls
    /// the device for that submission; then the errors of every submission so far are reported.
    pub(crate) async fn map_after(
        &self,
        staging: &wgpu::Buffer,
        index: wgpu::SubmissionIndex,
    ) -> Result<()> {
        let state = Arc::new(Mutex::new(MapState::default()));
        let filled = Arc::clone(&state);
        self.serial.run(|| {
            staging.map_async(wgpu::MapMode::Read, .., move |r| {
                let mut s = filled.lock().unwrap_or_else(PoisonError::into_inner);
                s.result = Some(r);
                if let Some(w) = s.waker.take() {
                    w.wake();
                }
            })
        });
        #[cfg(not(target_arch = "wasm32"))]
        self.poll(wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: None,
        })?;
        #[cfg(target_arch = "wasm32")]
        let _ = index;
        let mapped = MapFuture(state).await;
        self.check_errors_async().await?;
        mapped.map_err(|e| {
            self.lost_or(Error::WgpuCall {
                what: "mapping a readback buffer".into(),
                source: Box::new(e),
            })
        })
    }

    /// Copies the first `len` elements of `buffer` back to the host: one submission (the copy),
    /// then a wait on that submission only.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `buffer` holds fewer than `len` elements or lacks
    /// `COPY_SRC`; the errors of earlier submissions (see [`Context::check_errors`]);
    /// [`Error::WgpuCall`] when the mapping fails; [`Error::DeviceLost`].
    pub async fn read_back_async<T: Pod>(
        &self,
        buffer: &wgpu::Buffer,
        len: usize,
    ) -> Result<Vec<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .map_or(u64::MAX, |b| b as u64);
        if bytes > buffer.size() {
            return Err(Error::InvalidArgument(format!(
                "read_back of {len} elements of {} bytes from a buffer of {} bytes",
                std::mem::size_of::<T>(),
                buffer.size()
            )));
        }
        self.check_lost()?;
        if bytes == 0 {
            self.check_errors_async().await?;
            return Ok(Vec::new());
        }
        let readback = Readback::new(self, "kvattn readback", bytes)?;
        let mut encoder = self.encoder("readback");
        readback.encode_copy(&mut encoder, buffer, 0, bytes)?;
        let index = self.submit("readback", encoder)?;
        readback
            .read_async(self, index, len)
            .await
            .map_err(|e| match e {
                // A failed wait or mapping may mean the device is gone: report the cause.
                Error::Gpu(_) | Error::Wgpu { .. } | Error::WgpuCall { .. } => self.lost_or(e),
                other => other,
            })
    }

    /// The blocking form of [`read_back_async`](Self::read_back_async).
    pub fn read_back<T: Pod>(&self, buffer: &wgpu::Buffer, len: usize) -> Result<Vec<T>> {
        pollster::block_on(self.read_back_async(buffer, len))
    }

    /// Blocks until the device has finished all submitted work (an explicit sync point of the
    /// whole queue; readbacks wait for their own submission only).
    ///
    /// # Errors
    /// [`Error::DeviceLost`] once the device is lost; the errors of every submission so far (see
    /// [`Context::check_errors`]); [`Error::WgpuCall`] when the wait itself fails.
    pub fn wait(&self) -> Result<()> {
        self.check_lost()?;
        self.poll(wgpu::PollType::wait_indefinitely())?;
        self.check_errors()
    }
}
