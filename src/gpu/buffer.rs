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
    pub(crate) fn check_binding(&self, label: &str, bytes: u64) -> Result<()> {
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
    /// creation is [`Error::Wgpu`] / [`Error::OutOfMemory`] / [`Error::DeviceLost`], never
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
        let buffer = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: true,
        })?;
        self.count_upload(contents.len() as u64);
        fill_mapped(&buffer, label, contents).map_err(|e| self.lost_or(e))?;
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

    /// A uniform buffer holding one parameter struct (with `COPY_DST`, so a plan can rewrite
    /// it with [`Context::write_buffer`]). Fails as [`Context::create_buffer`].
    pub fn uniform<T: Pod>(&self, label: &str, value: &T) -> Result<wgpu::Buffer> {
        self.buffer_with(
            label,
            bytemuck::bytes_of(value),
            wgpu::COPY_BUFFER_ALIGNMENT,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )
    }

    /// A storage buffer of `len` elements, every one set to `fill`. Outputs are pre-filled with
    /// a sentinel (NaN) so that a missing write shows in tests. Fails as [`Context::upload`].
    pub fn filled<T: Pod>(&self, label: &str, len: usize, fill: T) -> Result<wgpu::Buffer> {
        let bytes = (len.max(1) as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        self.check_binding(label, bytes)?;
        self.upload(label, &vec![fill; len.max(1)])
    }
}

/// Copies `contents` to the start of `buffer`'s mapping (made at creation; fresh buffers are
/// zeroed, so the padding needs no write).
fn fill_mapped(buffer: &wgpu::Buffer, label: &str, contents: &[u8]) -> Result<()> {
    let mut view = buffer
        .get_mapped_range_mut(..)
        .map_err(|e| Error::WgpuCall {
            what: format!("{label}: filling a new buffer"),
            source: Box::new(e),
        })?;
    if view.len() < contents.len() {
        return Err(Error::Gpu(format!(
            "{label}: filling a new buffer: the mapping ({} bytes) is smaller than the contents \
             ({} bytes)",
            view.len(),
            contents.len()
        )));
    }
    view.slice(..contents.len()).copy_from_slice(contents);
    Ok(())
}
