//! Buffer creation, upload and readback.

use bytemuck::Pod;
use wgpu::util::DeviceExt;

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

    /// A storage buffer holding `data` (padded to at least 16 bytes). Fails with
    /// [`Error::TooLarge`] past the device's storage binding limit.
    pub fn upload<T: Pod>(&self, label: &str, data: &[T]) -> Result<wgpu::Buffer> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        self.check_binding(label, bytes.len() as u64)?;
        let mut padded;
        let contents = if (bytes.len() as u64) < MIN_BYTES {
            padded = bytes.to_vec();
            padded.resize(MIN_BYTES as usize, 0);
            &padded[..]
        } else {
            bytes
        };
        Ok(self
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: STORAGE,
            }))
    }

    /// A uniform buffer holding one parameter struct.
    pub fn uniform<T: Pod>(&self, label: &str, value: &T) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytemuck::bytes_of(value),
                usage: wgpu::BufferUsages::UNIFORM,
            })
    }

    /// A storage buffer of `len` elements, every one set to `fill`. Outputs are pre-filled with
    /// a sentinel (NaN) so that a missing write shows in tests.
    pub fn filled<T: Pod>(&self, label: &str, len: usize, fill: T) -> Result<wgpu::Buffer> {
        self.upload(label, &vec![fill; len.max(1)])
    }

    /// Copies the first `len` elements of `buffer` back to the host and waits for them.
    pub fn read_back<T: Pod>(&self, buffer: &wgpu::Buffer, len: usize) -> Result<Vec<T>> {
        let bytes = (len * std::mem::size_of::<T>()) as u64;
        if bytes > buffer.size() {
            return Err(Error::InvalidArgument(format!(
                "read_back of {bytes} bytes from a buffer of {}",
                buffer.size()
            )));
        }
        if bytes == 0 {
            return Ok(Vec::new());
        }
        // Copies must be multiples of 4 bytes.
        let copy = bytes.div_ceil(4) * 4;
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
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|_| Error::Gpu("readback callback never ran".into()))?
            .map_err(|e| Error::Gpu(format!("mapping a readback buffer: {e}")))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| Error::Gpu(format!("mapped range: {e}")))?;
        let out = bytemuck::pod_collect_to_vec(&view[..bytes as usize]);
        drop(view);
        staging.unmap();
        Ok(out)
    }

    /// Blocks until the device has finished all submitted work.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| Error::Gpu(format!("waiting for the device: {e}")))
    }
}
