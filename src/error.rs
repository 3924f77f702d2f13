//! The crate's error type: one variant per way a call can fail.

/// Everything that can go wrong in kvattn. Every public function that takes user input returns
/// `Result<T, Error>`; no user input makes the library panic.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No wgpu adapter matched the request (or none exists on this machine).
    #[error("no GPU adapter found ({detail}). On a machine without a GPU install Mesa's software adapters (`apt-get install mesa-vulkan-drivers` for Vulkan lavapipe) or run with WGPU_BACKEND=gl (llvmpipe)")]
    NoAdapter {
        /// What was asked for and what was found.
        detail: String,
    },
    /// The adapter refused to create a device with the requested features and limits.
    #[error("could not create a device on adapter {adapter}: {message}")]
    RequestDevice {
        /// Adapter name.
        adapter: String,
        /// wgpu's message.
        message: String,
    },
    /// A shader module or pipeline failed validation.
    #[error("shader {name} failed to compile: {message}")]
    Shader {
        /// Name of the composed source (kernel and variant).
        name: String,
        /// The validator's message.
        message: String,
    },
    /// wgpu reported a validation or internal error, or a mapping or readback failed. The
    /// message names the operation and carries wgpu's description.
    #[error("GPU error: {0}")]
    Gpu(String),
    /// The device ran out of memory while the named operation created or used a resource.
    /// Nothing that operation returned exists; smaller requests may still succeed.
    #[error("GPU out of memory: {0}")]
    OutOfMemory(String),
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
    /// A snapshot file could not be read, or does not match the cache it is imported into.
    #[error("snapshot: {0}")]
    Snapshot(String),
    /// A GGUF model file could not be read or parsed (I/O failure, truncated or corrupt data, an
    /// unsupported version or tensor type), or lacks a key or tensor the caller needs.
    #[error("GGUF: {0}")]
    Gguf(String),
}

/// `Result` with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
