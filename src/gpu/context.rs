//! Adapter choice, device creation and what the device can do.

use std::sync::{Arc, Mutex, PoisonError};

use super::counters::AtomicCounters;
#[cfg(not(target_arch = "wasm32"))]
use super::record::gpu_error;
use super::record::Pending;
use crate::pipeline::PipelineCache;
use crate::{Error, Result};

/// How to choose an adapter. The defaults read wgpu's environment variables (`WGPU_BACKEND`,
/// `WGPU_ADAPTER_NAME`, `WGPU_POWER_PREF`); fields set here take precedence over them.
#[derive(Debug, Clone, Default)]
pub struct ContextOptions {
    /// Backends to consider; `None` means `WGPU_BACKEND`, or Vulkan, Metal, DX12 and GL when
    /// that is unset.
    pub backends: Option<wgpu::Backends>,
    /// Case-insensitive substring of the adapter name; `None` means `WGPU_ADAPTER_NAME`.
    pub adapter_name: Option<String>,
    /// Power preference; `None` means `WGPU_POWER_PREF`, else discrete GPUs first.
    pub power_preference: Option<wgpu::PowerPreference>,
    /// Do not request `SHADER_F16` even if the adapter has it (forces the portable path).
    pub disable_f16: bool,
    /// Do not request `SUBGROUP` even if the adapter has it.
    pub disable_subgroups: bool,
    /// Do not run the f16 check: the kernels keep the exact integer f16 decoder even where
    /// `unpack2x16float` would be exact
    /// ([`Capabilities::f16_unpack_exact`] stays false). The values are the same either way: a
    /// testing knob (and a few milliseconds less at context creation).
    pub disable_f16_unpack: bool,
    /// Cap on the storage binding size the library plans KV pools with (tests use small caps
    /// so that pools split across several buffers). Other buffers are checked against the
    /// device's own limit. `None` uses the adapter's limit.
    pub max_storage_binding_cap: Option<u64>,
    /// Which attention kernel to run; `None` means `KVATTN_ATTENTION_KERNEL` (`workgroup` or
    /// `lanes`), else [`AttentionKernel::Lanes`] on CPU-backed adapters and
    /// [`AttentionKernel::Workgroup`] on GPUs.
    pub attention_kernel: Option<AttentionKernel>,
    /// Lanes of the workgroup attention kernel that share one key row (a power of two from 1
    /// to 32); `None` means `KVATTN_KEY_LANES` when set, else each plan chooses from the row size
    /// and the subgroup size. A tuning and testing knob: results are bitwise reproducible only
    /// for one lane count.
    pub key_lanes: Option<u32>,
    /// Whether the workgroup attention kernel takes a step's keys two at a time where its tile
    /// allows (see [`WorkgroupLayout`](crate::attention::paged::WorkgroupLayout)); `None`: on
    /// GPUs, not on CPU-backed adapters (where it measured slower). The bits are the same
    /// either way: a testing and tuning knob.
    pub key_pairs: Option<bool>,
    /// Whether the workgroup attention kernel, where it takes one key a step (MLA, or one lane
    /// a key), takes two steps a pass: both keys' rows loaded together, each query and
    /// accumulator value read once for both (see
    /// [`WorkgroupLayout`](crate::attention::paged::WorkgroupLayout)); `None`: on CPU-backed
    /// adapters (MLA absorbed decode 1.3x faster on lavapipe), not on GPUs (not yet measured
    /// there). The bits are the same either way: a testing and tuning knob.
    pub step_pairs: Option<bool>,
    /// Whether the workgroup attention kernel's workgroups hold one lane group (or as many as
    /// fill one SIMD vector of 8 invocations) rather than up to 8 groups that split a work
    /// item's keys and combine at the end (see
    /// [`WorkgroupLayout`](crate::attention::paged::WorkgroupLayout)); `None`: on CPU-backed
    /// adapters, which run a workgroup's invocations one SIMD vector after another on one
    /// thread, so that more groups add only their combine and their reads of the queries (on
    /// lavapipe prefill about 2x faster, decode 1.2-1.6x); not on GPUs. The groups split the
    /// keys, so the bits differ between the two: results are bitwise reproducible only for
    /// one setting, as for [`ContextOptions::key_lanes`]. The decoder's RMSNorm follows it
    /// too (one vector of 8 invocations a row instead of 256: `decoder::ops::rms_norm`).
    pub narrow_workgroups: Option<bool>,
}

/// The two implementations of paged attention: the same plan, partial states and merge, and
/// results equal up to f32 summation order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum AttentionKernel {
    /// `paged.wgsl`: a workgroup per (work item, KV head), whose lane groups each read whole key
    /// and value rows 16 bytes per lane, with the tile's queries in registers (see
    /// [`WorkgroupLayout`](crate::attention::paged::WorkgroupLayout)). For GPUs.
    Workgroup,
    /// `paged_lanes.wgsl`: an invocation per (work item, KV head), everything in private
    /// memory, no barriers. For CPU-backed adapters (lavapipe, llvmpipe, WARP, SwiftShader),
    /// which execute memory accesses lane by lane; head dims up to 256 (larger ones, and MLA's
    /// latent, run the workgroup kernel).
    Lanes,
}

impl AttentionKernel {
    /// `workgroup` or `lanes`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::Workgroup => "workgroup",
            AttentionKernel::Lanes => "lanes",
        }
    }
}

impl std::str::FromStr for AttentionKernel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "workgroup" => Ok(AttentionKernel::Workgroup),
            "lanes" => Ok(AttentionKernel::Lanes),
            other => Err(Error::InvalidArgument(format!(
                "unknown attention kernel {other:?} (workgroup or lanes)"
            ))),
        }
    }
}

/// `KVATTN_KEY_LANES` (a tuning knob, like [`ContextOptions::key_lanes`]): `None` when unset.
///
/// # Errors
/// [`Error::InvalidArgument`] when it is set but not a number (the plan checks the value).
fn key_lanes_from_env() -> Result<Option<u32>> {
    match std::env::var("KVATTN_KEY_LANES") {
        Ok(s) => s.trim().parse().map(Some).map_err(|_| {
            Error::InvalidArgument(format!(
                "KVATTN_KEY_LANES {s:?}: a power of two from 1 to 32"
            ))
        }),
        Err(_) => Ok(None),
    }
}

/// The adapter a [`Context`] runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct AdapterSummary {
    /// Adapter name as the driver reports it.
    pub name: String,
    /// Backend (vulkan, metal, dx12, gl).
    pub backend: String,
    /// Device type (DiscreteGpu, IntegratedGpu, Cpu, ...).
    pub device_type: String,
    /// Driver name.
    pub driver: String,
    /// Driver version or other detail.
    pub driver_info: String,
}

/// What kvattn needs to know about the adapter of a device it did not open (see
/// [`Context::from_wgpu`]).
#[derive(Debug, Clone)]
pub struct AdapterFacts {
    /// The adapter's info (name, backend, device type, subgroup sizes).
    pub info: wgpu::AdapterInfo,
    /// Its downlevel capabilities (whether shaders may convert f16 in f32).
    pub downlevel: wgpu::DownlevelCapabilities,
}

impl From<&wgpu::Adapter> for AdapterFacts {
    fn from(adapter: &wgpu::Adapter) -> Self {
        Self {
            info: adapter.get_info(),
            downlevel: adapter.get_downlevel_capabilities(),
        }
    }
}

/// What the device was created with: the optional features the kernels can use and the limits
/// they plan with.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Capabilities {
    /// `SHADER_F16`: the f16 kernel variants are available.
    pub shader_f16: bool,
    /// `SUBGROUP`: subgroup builtins are available.
    pub subgroups: bool,
    /// Smallest subgroup size the adapter may use (0 when subgroups are off).
    pub subgroup_min_size: u32,
    /// Largest subgroup size the adapter may use (0 when subgroups are off).
    pub subgroup_max_size: u32,
    /// `TIMESTAMP_QUERY`: kernels can be timed on the device.
    pub timestamps: bool,
    /// Largest storage buffer binding that KV pools are planned with, in bytes (the adapter's
    /// limit, or [`ContextOptions::max_storage_binding_cap`] when smaller).
    pub max_storage_buffer_binding_size: u64,
    /// Largest buffer, in bytes.
    pub max_buffer_size: u64,
    /// Storage buffers one shader stage may bind.
    pub max_storage_buffers_per_shader_stage: u32,
    /// Uniform buffers one shader stage may bind (the row kernel of the decoder's products
    /// binds several windows of a weight and one of its input).
    pub max_uniform_buffers_per_shader_stage: u32,
    /// Workgroup memory per workgroup, in bytes.
    pub max_compute_workgroup_storage_size: u32,
    /// Invocations per workgroup.
    pub max_compute_invocations_per_workgroup: u32,
    /// The attention kernel plans use (see [`ContextOptions::attention_kernel`]).
    pub attention_kernel: AttentionKernel,
    /// Lanes per key row the workgroup attention kernel is forced to (see
    /// [`ContextOptions::key_lanes`]).
    pub key_lanes: Option<u32>,
    /// Whether the workgroup attention kernel takes keys two at a time where its tile allows
    /// (see [`ContextOptions::key_pairs`]).
    pub key_pairs: bool,
    /// Whether the workgroup attention kernel takes two one-key steps a pass (see
    /// [`ContextOptions::step_pairs`]).
    pub step_pairs: bool,
    /// Whether the workgroup attention kernel's workgroups hold one lane group, or as many as
    /// fill one SIMD vector (see [`ContextOptions::narrow_workgroups`]).
    pub narrow_workgroups: bool,
    /// Shaders may use `unpack2x16float` and friends
    /// ([`wgpu::DownlevelFlags::SHADER_F16_IN_F32`]).
    pub f16_in_f32: bool,
    /// `unpack2x16float` gave the exact value of all 65,536 f16 patterns when the context was
    /// made ([`f16_check`](super::f16_check)), so the attention kernels convert f16 K/V with
    /// it; false without [`f16_in_f32`](Self::f16_in_f32) or on any mismatch (the exact
    /// integer decoder then stays).
    pub f16_unpack_exact: bool,
    /// Workgroups per dispatch dimension.
    pub max_compute_workgroups_per_dimension: u32,
    /// The adapter runs on the CPU (lavapipe, llvmpipe, WARP): its invocations' private arrays
    /// live in memory rather than in a register file, so the workgroup attention kernel takes
    /// larger tiles of rows there (ARCHITECTURE.md section 5).
    pub cpu_adapter: bool,
}

impl Capabilities {
    /// Names of the optional features in use, for printing.
    pub fn feature_names(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        if self.shader_f16 {
            names.push("shader-f16");
        }
        if self.subgroups {
            names.push("subgroup");
        }
        if self.timestamps {
            names.push("timestamp-query");
        }
        names
    }
}

/// A device on one adapter, with its queue, capabilities and pipeline cache. Cheap to share by
/// reference; every kernel call takes `&Context`, and one context may be used from several
/// threads at once (it is `Send + Sync` on native targets).
///
/// # GPU errors
/// wgpu's own default turns every error it raises into a panic. kvattn never relies on it: it
/// creates buffers and bind groups inside error scopes (a refused creation comes back from that
/// call as [`Error::Wgpu`] or [`Error::OutOfMemory`]), and gives every submission one set of
/// scopes whose errors come back, typed, from the next readback or
/// [`Context::check_errors`] / [`Context::wait`] (see [`Context::submit`]).
///
/// A context that opened its own device ([`Context::new`], [`Context::new_async`]) also
/// installs a device-wide handler for errors raised outside any scope (work recorded on
/// [`Context::device`] directly) and a device-lost callback; the next sync point returns what
/// they saw. A context made with [`Context::from_wgpu`] installs neither: the device's handlers
/// belong to the application, and kvattn's own errors still come back through its scopes.
/// When the device is lost (or destroyed with `device.destroy()`), every later call returns
/// [`Error::DeviceLost`]; a destroyed device is noticed at the next wait, readback or upload.
///
/// # Threads
/// A context is `Send + Sync`: threads may share one, each with its own caches and plans. On
/// GL, wgpu guards the one GL context with a lock it waits on for only a few seconds before
/// panicking, and holds it through every compilation, submission and wait; so on GL a context
/// lets one thread at a time into the device calls it makes, and the others queue without a
/// timeout. An application's own calls on [`Context::device`] and drops of buffers do not
/// queue there: on GL, keep each of those off threads that may wait behind a long submission.
pub struct Context {
    /// The wgpu device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    adapter: AdapterSummary,
    caps: Capabilities,
    pub(crate) pipelines: PipelineCache,
    pub(crate) clock: super::timing::PassClock,
    health: Arc<DeviceHealth>,
    pub(crate) counters: AtomicCounters,
    /// Error scopes of submissions whose results the next sync point reports.
    pub(crate) pending: Mutex<Pending>,
    /// Whether kvattn opened the device (and so installed its error and loss handlers).
    owns_device: bool,
    /// One thread at a time in the device calls on GL (see [`super::serial`]).
    pub(crate) serial: super::serial::DeviceSerial,
}

/// What wgpu reported outside kvattn's error scopes, shared with the device's callbacks: device
/// loss (kept: every later call fails) and the first uncaptured error (reported once).
#[derive(Default)]
struct DeviceHealth {
    lost: Mutex<Option<String>>,
    uncaptured: Mutex<Option<Uncaptured>>,
}

/// The first uncaptured error since it was last reported (as the crate's error), and how many
/// followed it.
struct Uncaptured {
    error: UncapturedError,
    more: usize,
}

/// An uncaptured error as kept for the next sync point. On the web wgpu's errors are not `Send`
/// while its error handler must be, so the error is kept as its message there.
#[cfg(not(target_arch = "wasm32"))]
type UncapturedError = Error;
/// An uncaptured error as kept for the next sync point. On the web wgpu's errors are not `Send`
/// while its error handler must be, so the error is kept as its message there.
#[cfg(target_arch = "wasm32")]
type UncapturedError = String;

#[cfg(not(target_arch = "wasm32"))]
fn uncaptured_error(error: wgpu::Error) -> UncapturedError {
    gpu_error("outside any error scope", error)
}

#[cfg(target_arch = "wasm32")]
fn uncaptured_error(error: wgpu::Error) -> UncapturedError {
    format!("outside any error scope: {error}")
}

impl DeviceHealth {
    fn lose(&self, message: String) {
        let mut lost = self.lost.lock().unwrap_or_else(PoisonError::into_inner);
        lost.get_or_insert(message);
    }

    fn lost(&self) -> Option<String> {
        self.lost
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn record(&self, error: wgpu::Error) {
        let mut pending = self
            .uncaptured
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match pending.as_mut() {
            Some(first) => first.more += 1,
            None => {
                *pending = Some(Uncaptured {
                    error: uncaptured_error(error),
                    more: 0,
                })
            }
        }
    }

    fn take(&self) -> Option<Uncaptured> {
        self.uncaptured
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("adapter", &self.adapter)
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

fn type_rank(t: wgpu::DeviceType, pref: wgpu::PowerPreference) -> u32 {
    use wgpu::DeviceType as T;
    match (t, pref) {
        (T::IntegratedGpu, wgpu::PowerPreference::LowPower) => 0,
        (T::DiscreteGpu, _) => 1,
        (T::IntegratedGpu, _) => 2,
        (T::VirtualGpu, _) => 3,
        (T::Other, _) => 4,
        (T::Cpu, _) => 5,
    }
}

fn backend_rank(b: wgpu::Backend) -> u32 {
    match b {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        wgpu::Backend::Gl => 1,
        _ => 2,
    }
}

fn summary(info: &wgpu::AdapterInfo) -> AdapterSummary {
    AdapterSummary {
        name: info.name.clone(),
        backend: info.backend.to_str().to_string(),
        device_type: format!("{:?}", info.device_type),
        driver: info.driver.clone(),
        driver_info: info.driver_info.clone(),
    }
}

impl Context {
    /// Opens the best adapter, honouring `WGPU_BACKEND`, `WGPU_ADAPTER_NAME` and
    /// `WGPU_POWER_PREF`. Fails with [`Error::NoAdapter`] (which says how to get a software
    /// adapter) when none exists.
    pub fn new() -> Result<Self> {
        Self::with_options(&ContextOptions::default())
    }

    /// Opens an adapter chosen by `opts` (environment variables fill the unset fields). The
    /// blocking form of [`new_async`](Self::new_async).
    pub fn with_options(opts: &ContextOptions) -> Result<Self> {
        pollster::block_on(Self::new_async(opts))
    }

    /// Opens an adapter chosen by `opts` and creates a device on it with the optional features
    /// kvattn uses where the adapter has them (see [`Context::from_wgpu`]).
    pub async fn new_async(opts: &ContextOptions) -> Result<Self> {
        let backends = opts
            .backends
            .or_else(wgpu::Backends::from_env)
            .unwrap_or(wgpu::Backends::PRIMARY | wgpu::Backends::GL);
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle().with_env();
        desc.backends = backends;
        let instance = wgpu::Instance::new(desc);
        let name = opts
            .adapter_name
            .clone()
            .or_else(|| std::env::var("WGPU_ADAPTER_NAME").ok())
            .map(|n| n.to_lowercase());
        let pref = opts
            .power_preference
            .or_else(wgpu::PowerPreference::from_env)
            .unwrap_or(wgpu::PowerPreference::HighPerformance);

        let adapters = instance.enumerate_adapters(backends).await;
        let found: Vec<String> = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({})", i.name, i.backend.to_str())
            })
            .collect();
        let adapter = adapters
            .into_iter()
            .filter(|a| {
                let info = a.get_info();
                let named = name
                    .as_ref()
                    .is_none_or(|n| info.name.to_lowercase().contains(n));
                named
                    && a.get_downlevel_capabilities()
                        .flags
                        .contains(wgpu::DownlevelFlags::COMPUTE_SHADERS)
            })
            .min_by_key(|a| {
                let info = a.get_info();
                (
                    type_rank(info.device_type, pref),
                    backend_rank(info.backend),
                )
            })
            .ok_or_else(|| Error::NoAdapter {
                detail: format!(
                    "backends {backends:?}, name filter {:?}; adapters present: [{}]",
                    name.as_deref().unwrap_or("none"),
                    found.join(", ")
                ),
            })?;
        Self::open_on(&adapter, opts).await
    }

    async fn open_on(adapter: &wgpu::Adapter, opts: &ContextOptions) -> Result<Self> {
        let info = adapter.get_info();
        let have = adapter.features();
        let mut wanted = wgpu::Features::TIMESTAMP_QUERY;
        if !opts.disable_f16 {
            wanted |= wgpu::Features::SHADER_F16;
        }
        if !opts.disable_subgroups {
            wanted |= wgpu::Features::SUBGROUP;
        }
        let features = have & wanted;
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("kvattn"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: wgpu::ExperimentalFeatures::disabled(),
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|source| Error::RequestDevice {
                adapter: info.name.clone(),
                source,
            })?;
        let mut ctx = Self::build(
            device,
            queue,
            &info,
            &adapter.get_downlevel_capabilities(),
            opts,
        )?;
        ctx.owns_device = true;
        // Replace wgpu's panicking default handler and note loss, before anything can fail.
        let recorder = Arc::clone(&ctx.health);
        ctx.device
            .on_uncaptured_error(Arc::new(move |e| recorder.record(e)));
        let recorder = Arc::clone(&ctx.health);
        ctx.device.set_device_lost_callback(move |reason, message| {
            recorder.lose(format!("{reason:?}: {message}"));
        });
        #[cfg(target_arch = "wasm32")]
        ctx.check_f16_unpack(opts).await;
        Ok(ctx)
    }

    /// A context on the application's own device and queue. `adapter` says what kvattn needs
    /// to know about the adapter the device came from (its name, type and downlevel flags;
    /// pass `&wgpu::Adapter` or an [`AdapterFacts`]). `opts` chooses the attention kernel, can
    /// switch off f16 or subgroup variants and cap the planned binding size; its adapter
    /// choice fields are ignored.
    ///
    /// Capabilities come from the features and limits the device was created with, never from
    /// what the adapter could offer. kvattn uses, when the device has them:
    /// `SHADER_F16` (f16 kernel variants and KV math), `SUBGROUP` (subgroup reductions in the
    /// attention kernel) and `TIMESTAMP_QUERY` (device timing in benchmarks). Without them it
    /// runs the portable variants and times on the wall clock; it never fails for their
    /// absence (an explicit request for an f16 variant returns [`Error::MissingFeature`]).
    ///
    /// kvattn installs no uncaptured-error handler and no device-lost callback on this device
    /// (they are the application's): its own work is checked through error scopes, and its
    /// errors come back from its calls and sync points (see the type's docs).
    pub fn from_wgpu(
        device: wgpu::Device,
        queue: wgpu::Queue,
        adapter: impl Into<AdapterFacts>,
        opts: &ContextOptions,
    ) -> Result<Self> {
        let facts = adapter.into();
        Self::build(device, queue, &facts.info, &facts.downlevel, opts)
    }

    fn build(
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: &wgpu::AdapterInfo,
        downlevel: &wgpu::DownlevelCapabilities,
        opts: &ContextOptions,
    ) -> Result<Self> {
        let mut features = device.features();
        if opts.disable_f16 {
            features.remove(wgpu::Features::SHADER_F16);
        }
        if opts.disable_subgroups {
            features.remove(wgpu::Features::SUBGROUP);
        }
        let limits = device.limits();
        let subgroups = features.contains(wgpu::Features::SUBGROUP);
        let attention_kernel = match opts.attention_kernel {
            Some(kernel) => kernel,
            None => match std::env::var("KVATTN_ATTENTION_KERNEL") {
                Ok(name) => name.parse()?,
                Err(_) if info.device_type == wgpu::DeviceType::Cpu => AttentionKernel::Lanes,
                Err(_) => AttentionKernel::Workgroup,
            },
        };
        let binding = limits.max_storage_buffer_binding_size;
        let caps = Capabilities {
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups,
            subgroup_min_size: if subgroups { info.subgroup_min_size } else { 0 },
            subgroup_max_size: if subgroups { info.subgroup_max_size } else { 0 },
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            max_storage_buffer_binding_size: opts
                .max_storage_binding_cap
                .map_or(binding, |cap| cap.min(binding)),
            max_buffer_size: limits.max_buffer_size,
            max_storage_buffers_per_shader_stage: limits.max_storage_buffers_per_shader_stage,
            max_uniform_buffers_per_shader_stage: limits.max_uniform_buffers_per_shader_stage,
            max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
            max_compute_workgroups_per_dimension: limits.max_compute_workgroups_per_dimension,
            attention_kernel,
            key_lanes: match opts.key_lanes {
                Some(lanes) => Some(lanes),
                None => key_lanes_from_env()?,
            },
            key_pairs: opts
                .key_pairs
                .unwrap_or(info.device_type != wgpu::DeviceType::Cpu),
            step_pairs: opts
                .step_pairs
                .unwrap_or(info.device_type == wgpu::DeviceType::Cpu),
            narrow_workgroups: opts
                .narrow_workgroups
                .unwrap_or(info.device_type == wgpu::DeviceType::Cpu),
            f16_in_f32: downlevel
                .flags
                .contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32),
            f16_unpack_exact: false,
            cpu_adapter: info.device_type == wgpu::DeviceType::Cpu,
        };
        #[cfg_attr(target_arch = "wasm32", allow(unused_mut))]
        let mut ctx = Self {
            device,
            queue,
            adapter: summary(info),
            caps,
            pipelines: PipelineCache::default(),
            clock: Default::default(),
            health: Arc::new(DeviceHealth::default()),
            counters: AtomicCounters::default(),
            pending: Mutex::new(Pending::default()),
            owns_device: false,
            serial: super::serial::DeviceSerial::new(info.backend == wgpu::Backend::Gl),
        };
        // On the web the check's readback must be awaited: `new_async` runs it there, and a
        // context made by `from_wgpu` keeps the integer decoder.
        #[cfg(not(target_arch = "wasm32"))]
        pollster::block_on(ctx.check_f16_unpack(opts));
        Ok(ctx)
    }

    /// Runs the f16 check (see [`super::f16_check`]) where the device can convert f16 in f32
    /// code, and lets the kernels use `unpack2x16float` only when every pattern matched.
    async fn check_f16_unpack(&mut self, opts: &ContextOptions) {
        if self.caps.f16_in_f32 && !opts.disable_f16_unpack {
            // A failed or inexact check keeps the integer decoder: never a reason to refuse.
            let mismatches = super::f16_check::unpack_mismatches_async(self).await;
            self.caps.f16_unpack_exact = mismatches.is_ok_and(|m| m.is_empty());
            // The check's buffers and submission are the context's making, not the caller's.
            self.counters = AtomicCounters::default();
        }
    }

    /// Whether kvattn opened this device itself (rather than [`Context::from_wgpu`]).
    pub fn owns_device(&self) -> bool {
        self.owns_device
    }

    /// The adapter this context runs on.
    pub fn adapter(&self) -> &AdapterSummary {
        &self.adapter
    }

    /// Features and limits of the device.
    pub fn caps(&self) -> &Capabilities {
        &self.caps
    }

    /// Runs `f` inside validation, out-of-memory and internal error scopes: a wgpu error raised
    /// by what `f` records on this thread becomes [`Error::Wgpu`] or [`Error::OutOfMemory`]
    /// (naming `what`) instead of a panic in wgpu's default handler. Fails with
    /// [`Error::DeviceLost`] without running `f` when the device is known to be lost, and after
    /// it when the device was lost meanwhile (an error in the scope waits for the queue to find
    /// out whether the device is lost). On GL, `f` runs while this thread alone is inside the
    /// context's device calls (wgpu's GL context lock panics after a short wait, so the
    /// context queues its threads itself); `f` must not wait for another thread's kvattn work.
    ///
    /// On the web (`wasm32`) an error scope's result is a promise the browser settles later, and
    /// nothing may block for it: there `f`'s errors are reported by the next sync point instead
    /// (a readback or [`check_errors_async`](Self::check_errors_async)), as a submission's are.
    pub fn scoped<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        #[cfg(target_arch = "wasm32")]
        return self.deferred(what, f);
        #[cfg(not(target_arch = "wasm32"))]
        self.scoped_now(what, f)
    }

    /// [`scoped`](Self::scoped) on native backends, where a popped scope's result is ready.
    #[cfg(not(target_arch = "wasm32"))]
    fn scoped_now<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        self.check_lost()?;
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = self.serial.run(f);
        let validation = pollster::block_on(validation.pop());
        let oom = pollster::block_on(oom.pop());
        let internal = pollster::block_on(internal.pop());
        self.check_lost()?;
        match validation.or(oom).or(internal) {
            // Objects of a lost device are invalid: report the cause, not the symptom.
            Some(e) => Err(self.lost_or(gpu_error(what, e))),
            None => Ok(value),
        }
    }

    /// [`Error::DeviceLost`] once the device is known to be lost.
    pub(crate) fn check_lost(&self) -> Result<()> {
        match self.health.lost() {
            Some(message) => Err(Error::DeviceLost(message)),
            None => Ok(()),
        }
    }

    /// The first error wgpu raised outside any error scope since the last call, if any.
    pub(crate) fn take_uncaptured(&self) -> Result<()> {
        let Some(Uncaptured { error, more }) = self.health.take() else {
            return Ok(());
        };
        // On the web the kept message becomes the error, with the count in it.
        #[cfg(target_arch = "wasm32")]
        let (error, more) = match more {
            0 => (Error::Gpu(error), 0),
            more => (Error::Gpu(format!("{error} (and {more} more)")), 0),
        };
        Err(match more {
            0 => error,
            more => super::record::with_more(error, more),
        })
    }

    /// Polls the device. wgpu panics (rather than returning an error) when the driver reports the
    /// device lost or out of memory during a poll; that panic is caught here and the device is
    /// marked lost, so this returns [`Error::DeviceLost`] (wgpu's panic message is still printed
    /// by the panic hook, and nothing is caught under `panic = "abort"`).
    pub(crate) fn poll(&self, poll: wgpu::PollType) -> Result<wgpu::PollStatus> {
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.serial.run(|| self.device.poll(poll))
        }));
        match polled {
            Ok(Ok(status)) => {
                self.check_lost()?;
                Ok(status)
            }
            Ok(Err(e)) => {
                self.check_lost()?;
                Err(Error::WgpuCall {
                    what: "waiting for the device".into(),
                    source: Box::new(e),
                })
            }
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "wgpu panicked while polling the device".into());
                self.health.lose(message);
                self.check_lost().map(|()| wgpu::PollStatus::QueueEmpty)
            }
        }
    }

    /// After a wgpu call failed in a way that may mean the device is gone: [`Error::DeviceLost`]
    /// if it is lost, else `error`. A destroyed device is only reported lost once its queue is
    /// idle, so this waits for the queue (on this failure path only).
    pub(crate) fn lost_or(&self, error: Error) -> Error {
        let waited = self
            .check_lost()
            .and_then(|()| self.poll(wgpu::PollType::wait_indefinitely()))
            .and_then(|_| self.check_lost());
        match waited {
            Err(lost @ Error::DeviceLost(_)) => lost,
            _ => error,
        }
    }
}

#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    // One context serves several threads at once (see tests/gpu/threads.rs).
    fn assert_send_sync<T: Send + Sync>() {}
    let _ = assert_send_sync::<Context>;
};
