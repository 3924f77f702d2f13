//! Buffer creation, upload and readback.

use bytemuck::Pod;

use super::Context;
use crate::{Error, Result};

/// Usage of the storage buffers kernels read and write: bindable, and copyable both ways so
/// tests and swap can read them back or fill them.
pub const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Checks that `buffer` is a storage buffer holding at least `elems` 32-bit values: otherwise
/// [`Error::InvalidArgument`] (no STORAGE usage) or [`Error::ShapeMismatch`] (too small).
pub(crate) fn check_storage(what: &'static str, buffer: &wgpu::Buffer, elems: usize) -> Result<()> {
    if !buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
        return Err(Error::InvalidArgument(format!(
            "{what} was not created with STORAGE usage"
        )));
    }
    let have = buffer.size() / 4;
    if have < elems as u64 {
        return Err(Error::ShapeMismatch {
            what,
            expected: elems,
            got: usize::try_from(have).unwrap_or(usize::MAX),
        });
    }
    Ok(())
}

/// Smallest buffer we create: wgpu refuses zero-sized bindings.
const MIN_BYTES: u64 = 16;

impl Context {
    fn check_binding(&self, label: &str, bytes: u64) -> Result<()> {
        // The device's own limit: a test cap (ContextOptions::max_storage_binding_cap) shapes how
        // pools are split, not what a buffer may hold.
        let limit = self.device.limits().max_storage_buffer_binding_size;
        if bytes > limit {
            return Err(Error::TooLarge {
                what: format!("storage buffer {label}"),
                bytes,
                limit,
            });
        }
        Ok(())
    }

    /// A buffer of `usage` holding `contents` (zero-padded to a multiple of 4 bytes, and to at
    /// least `min_bytes`), created under error scopes and filled through a mapping: a refused
    /// creation is [`Error::Gpu`] / [`Error::OutOfMemory`] / [`Error::DeviceLost`], never
    /// wgpu's panic in `create_buffer_init`.
    pub(crate) fn buffer_with(
        &self,
        label: &str,
        contents: &[u8],
        min_bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        let size = (contents.len() as u64)
            .div_ceil(wgpu::COPY_BUFFER_ALIGNMENT)
            .saturating_mul(wgpu::COPY_BUFFER_ALIGNMENT)
            .max(min_bytes)
            .max(wgpu::COPY_BUFFER_ALIGNMENT);
        let buffer = self.scoped(label, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage,
                mapped_at_creation: true,
            })
        })?;
        fill_mapped(&buffer, contents)
            .map_err(|e| self.lost_or(Error::Gpu(format!("{label}: filling a new buffer: {e}"))))?;
        self.scoped(label, || buffer.unmap())?;
        Ok(buffer)
    }

    /// A storage buffer holding `data` (padded to at least 16 bytes). Fails with
    /// [`Error::TooLarge`] past the device's storage binding limit, with
    /// [`Error::OutOfMemory`] when the device cannot hold it, and [`Error::DeviceLost`] once the
    /// device is lost.
    pub fn upload<T: Pod>(&self, label: &str, data: &[T]) -> Result<wgpu::Buffer> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        self.check_binding(label, bytes.len() as u64)?;
        self.buffer_with(label, bytes, MIN_BYTES, STORAGE)
    }

    /// A uniform buffer holding one parameter struct.
    ///
    /// This cannot fail on a healthy device short of running out of memory, so it returns the
    /// buffer rather than a `Result`. When creation does fail (out of memory, device lost) the
    /// buffer is invalid and nothing panics: inside [`Context::scoped`] the error is that
    /// scope's, otherwise the device-wide handler records it and the next [`Context::wait`] or
    /// [`Context::read_back`] returns it; a dispatch that binds the buffer fails with
    /// [`Error::Gpu`] in its own scope. No result is ever computed from it silently.
    pub fn uniform<T: Pod>(&self, label: &str, value: &T) -> wgpu::Buffer {
        let contents = bytemuck::bytes_of(value);
        let size = (contents.len() as u64)
            .div_ceil(wgpu::COPY_BUFFER_ALIGNMENT)
            .max(1)
            * wgpu::COPY_BUFFER_ALIGNMENT;
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::UNIFORM,
            mapped_at_creation: true,
        });
        // An invalid buffer has no mapping; its creation error is already reported.
        let _ = fill_mapped(&buffer, contents);
        buffer.unmap();
        buffer
    }

    /// A storage buffer of `len` elements, every one set to `fill`. Outputs are pre-filled with
    /// a sentinel (NaN) so that a missing write shows in tests. Fails as [`Context::upload`].
    pub fn filled<T: Pod>(&self, label: &str, len: usize, fill: T) -> Result<wgpu::Buffer> {
        let bytes = (len.max(1) as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        self.check_binding(label, bytes)?;
        self.upload(label, &vec![fill; len.max(1)])
    }

    /// Copies the first `len` elements of `buffer` back to the host and waits for them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `buffer` holds fewer than `len` elements;
    /// [`Error::Gpu`] when wgpu refuses the copy (for example `buffer` lacks `COPY_SRC`) or the
    /// mapping fails, and as [`Context::wait`] (device loss, an earlier uncaptured error).
    pub fn read_back<T: Pod>(&self, buffer: &wgpu::Buffer, len: usize) -> Result<Vec<T>> {
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
            return Ok(Vec::new());
        }
        // Copies must be multiples of 4 bytes.
        let copy = bytes.div_ceil(4) * 4;
        let (tx, rx) = std::sync::mpsc::channel();
        let staging = self.scoped("readback", || {
            let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kvattn readback"),
                size: copy,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut encoder = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor::default());
            encoder.copy_buffer_to_buffer(buffer, 0, &staging, 0, copy);
            self.queue.submit([encoder.finish()]);
            staging.map_async(wgpu::MapMode::Read, .., move |r| {
                let _ = tx.send(r);
            });
            staging
        })?;
        self.wait()?;
        rx.recv()
            .map_err(|_| self.lost_or(Error::Gpu("readback callback never ran".into())))?
            .map_err(|e| self.lost_or(Error::Gpu(format!("mapping a readback buffer: {e}"))))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| self.lost_or(Error::Gpu(format!("mapped range: {e}"))))?;
        let out = bytemuck::pod_collect_to_vec(&view[..bytes as usize]);
        drop(view);
        staging.unmap();
        Ok(out)
    }

    /// Blocks until the device has finished all submitted work.
    ///
    /// # Errors
    /// [`Error::DeviceLost`] once the device is lost; the first error wgpu raised outside any
    /// error scope since the last wait or readback (on any thread), as [`Error::Gpu`] or
    /// [`Error::OutOfMemory`]; [`Error::Gpu`] when the wait itself fails.
    pub fn wait(&self) -> Result<()> {
        self.check_lost()?;
        self.poll(wgpu::PollType::wait_indefinitely())?;
        self.take_uncaptured()
    }
}

/// Copies `contents` to the start of `buffer`'s mapping (made at creation; fresh buffers are
/// zeroed, so the padding needs no write).
fn fill_mapped(buffer: &wgpu::Buffer, contents: &[u8]) -> std::result::Result<(), String> {
    let mut view = buffer.get_mapped_range_mut(..).map_err(|e| e.to_string())?;
    if view.len() < contents.len() {
        return Err("the mapping is smaller than the contents".into());
    }
    view.slice(..contents.len()).copy_from_slice(contents);
    Ok(())
}
