//! The crate's error type: one variant per way a call can fail.
//!
//! Errors that come from another library keep it as their [`source`](std::error::Error::source):
//! wgpu's errors ([`wgpu::Error`] from an error scope, [`wgpu::RequestDeviceError`], a failed
//! mapping or wait), I/O errors ([`std::io::Error`]) and safetensors errors
//! ([`safetensors::SafeTensorError`]). The message of such an error names the operation and
//! repeats the source's own message (out of memory excepted: wgpu's says no more than that), so
//! printing the error alone says everything; walking `source()` gives the typed original.

/// Everything that can go wrong in kvattn. Every public function that takes user input returns
/// `Result<T, Error>`; no user input makes the library panic.
///
/// The enum is `#[non_exhaustive]`: later versions may add variants, so a `match` on it needs a
/// `_` arm. On native targets it is `Send + Sync + 'static` (on `wasm32` without atomics wgpu's
/// own errors, and so this type, are neither `Send` nor `Sync`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No wgpu adapter matched the request (or none exists on this machine).
    #[error("no GPU adapter found ({detail}). On a machine without a GPU install Mesa's software adapters (`apt-get install mesa-vulkan-drivers` for Vulkan lavapipe) or run with WGPU_BACKEND=gl (llvmpipe)")]
    NoAdapter {
        /// What was asked for and what was found.
        detail: String,
    },
    /// The adapter refused to create a device with the requested features and limits.
    #[error("could not create a device on adapter {adapter}: {source}")]
    RequestDevice {
        /// Adapter name.
        adapter: String,
        /// wgpu's error.
        #[source]
        source: wgpu::RequestDeviceError,
    },
    /// A shader module or pipeline failed validation.
    #[error("shader {name} failed to compile: {source}")]
    Shader {
        /// Name of the composed source (kernel and variant; for a pipeline, its constants too).
        name: String,
        /// The validation error wgpu raised (its message is the validator's).
        #[source]
        source: wgpu::Error,
    },
    /// A GPU result kvattn itself found wrong (for example timestamps that run backwards, or a
    /// GPU encoder that disagrees with the CPU one). The message names the operation. Errors
    /// wgpu raises are [`Error::Wgpu`], [`Error::WgpuCall`] and [`Error::OutOfMemory`].
    #[error("GPU error: {0}")]
    Gpu(String),
    /// wgpu raised a validation or internal error while kvattn did `what` (caught by kvattn's
    /// error scopes, or by the device-wide handler of a context that opened its own device).
    #[error("GPU error: {what}: {source}{}", and_more(*more))]
    Wgpu {
        /// The operation: the buffer, bind group, submission or upload, as named by its caller.
        what: String,
        /// The first error wgpu raised (validation or internal).
        #[source]
        source: wgpu::Error,
        /// How many more errors were raised after it before this sync point.
        more: usize,
    },
    /// A wgpu call outside the error scopes failed: mapping a buffer
    /// ([`wgpu::BufferAsyncError`], [`wgpu::MapRangeError`]) or waiting for the device
    /// ([`wgpu::PollError`]). `source` is wgpu's error; downcast it to the type.
    #[error("GPU error: {what}: {source}")]
    WgpuCall {
        /// The operation.
        what: String,
        /// wgpu's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The device ran out of memory while the named operation created or used a resource.
    /// Nothing that operation returned exists; smaller requests may still succeed.
    #[error("GPU out of memory: {what}{}", and_more(*more))]
    OutOfMemory {
        /// The operation: the buffer, submission or upload, as named by its caller.
        what: String,
        /// wgpu's out-of-memory error.
        #[source]
        source: wgpu::Error,
        /// How many more errors were raised after it before this sync point.
        more: usize,
    },
    /// The device is lost (driver reset, GPU removed, or `device.destroy()` called). Every later
    /// call on the same [`Context`](crate::gpu::Context) fails with this error; open a new one.
    #[error("GPU device lost: {0}; open a new Context")]
    DeviceLost(String),
    /// The kernel needs an adapter feature this device does not have.
    #[error("this adapter lacks the feature {0}")]
    MissingFeature(&'static str),
    /// A head dimension the format or kernel cannot handle.
    #[error("head dimension {head_dim} is not supported: {reason}")]
    UnsupportedHeadDim {
        /// The head dimension given.
        head_dim: usize,
        /// Why it is refused (for example "must be a multiple of 4").
        reason: String,
    },
    /// A tensor's length does not match the shape implied by the other arguments.
    #[error("{what}: expected {expected} elements, got {got}")]
    ShapeMismatch {
        /// Which tensor.
        what: &'static str,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// An argument is out of its allowed range or inconsistent with another one.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A buffer would exceed an adapter limit (for example `max_storage_buffer_binding_size`).
    #[error("{what} needs {bytes} bytes, over the adapter limit of {limit}")]
    TooLarge {
        /// What was being sized.
        what: String,
        /// Bytes needed.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// The cache has too few free blocks for the request; nothing was changed.
    #[error("out of KV blocks: {needed} needed, {available} available")]
    OutOfBlocks {
        /// Blocks the request needed.
        needed: usize,
        /// Blocks that were available to it.
        available: usize,
    },
    /// No sequence with this id is in the cache.
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    /// A sequence with this id already exists.
    #[error("sequence {0} already exists")]
    SequenceExists(u64),
    /// A snapshot does not match the cache it is imported into, is of another format version, or
    /// is corrupt (its checksum disagrees). Bytes that are not safetensors at all are
    /// [`Error::Safetensors`].
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// Bytes that should be safetensors (a KV snapshot, a case file) are not, or tensors could
    /// not be serialized as safetensors.
    #[error("{what}: {source}")]
    Safetensors {
        /// What was being read or written (for example "snapshot: not safetensors").
        what: String,
        /// safetensors' error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// Reading or writing a file failed.
    #[error("{what}: {source}")]
    Io {
        /// The operation and the path (for example "GGUF: cannot read model.gguf").
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A GGUF model file could not be parsed (truncated or corrupt data, an unsupported version
    /// or tensor type), or lacks a key or tensor the caller needs. A file that cannot be read at
    /// all is [`Error::Io`].
    #[error("GGUF: {0}")]
    Gguf(String),
    /// A tokenizer could not be built from a model's vocabulary and merges (an unsupported
    /// model or pre-tokenizer, inconsistent token lists, a malformed merge).
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// " (and N more)" after the first of several errors, nothing after a single one.
fn and_more(more: usize) -> String {
    match more {
        0 => String::new(),
        n => format!(" (and {n} more)"),
    }
}

#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    // Errors cross threads (one context serves several) and go into `Box<dyn Error + Send +
    // Sync>` and anyhow.
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    let _ = assert_send_sync::<Error>;
};

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
