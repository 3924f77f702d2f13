//! The adapter's two ceilings, measured in the same run as the cases they judge (ARCHITECTURE.md
//! section 13): copy bandwidth (the best of the copy kernel at several workgroup counts, over
//! buffers that together exceed the CPU's last-level cache) and arithmetic rate (independent
//! FMA chains, f32 and f16 where the adapter has it).

use super::bandwidth::copy_bytes;
use super::fma_rate::{fma_chains, FMA_WG};
use crate::gpu::{Context, STORAGE};
use crate::shader::Precision;
use crate::{Error, Result};

/// How hard to look for the ceilings.
#[derive(Debug, Clone, PartialEq)]
pub struct CeilingOptions {
    /// Bytes of each copy buffer (capped by the adapter's storage binding limit).
    pub buffer_bytes: u64,
    /// Source/destination buffer pairs copied in turn: together they should exceed the
    /// last-level cache, so that no copy is served from it.
    pub pairs: usize,
    /// Workgroup counts tried for the copy kernel.
    pub copy_workgroups: Vec<u32>,
    /// Workgroup counts tried for the FMA kernel.
    pub fma_workgroups: Vec<u32>,
    /// Device seconds one FMA measurement aims at (its step count is calibrated to it).
    pub fma_seconds: f64,
    /// Measurements of each configuration; the best counts.
    pub repeats: usize,
}

impl Default for CeilingOptions {
    /// 96 MiB buffers in three pairs (576 MiB in all, over the 260 MiB last-level cache of the
    /// machines this was tuned on), three repeats.
    fn default() -> Self {
        Self {
            buffer_bytes: 96 << 20,
            pairs: 3,
            copy_workgroups: vec![64, 1024, 16384, 65535],
            fma_workgroups: vec![256, 4096],
            fma_seconds: 0.1,
            repeats: 3,
        }
    }
}

impl CeilingOptions {
    /// Fewer configurations and repeats, for `--quick` runs.
    pub fn quick() -> Self {
        Self {
            copy_workgroups: vec![16384, 65535],
            fma_workgroups: vec![4096],
            fma_seconds: 0.05,
            repeats: 4,
            ..Self::default()
        }
    }
}

/// One configuration of a ceiling kernel and the rate it reached.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Trial {
    /// Workgroups of the dispatch.
    pub workgroups: u32,
    /// GB/s (bytes read plus written) for the copy kernel, GFLOP/s for the FMA kernel.
    pub rate: f64,
}

/// The measured ceilings of an adapter.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Ceilings {
    /// Best copy bandwidth, GB/s (10^9 bytes per second), counting bytes read plus bytes
    /// written.
    pub copy_gbps: f64,
    /// Every copy configuration tried.
    pub copy_trials: Vec<Trial>,
    /// Bytes the copies cycled through (sources and destinations).
    pub copy_footprint: u64,
    /// Best f32 FMA rate, GFLOP/s.
    pub f32_gflops: f64,
    /// Best f16 FMA rate, GFLOP/s, where the adapter has f16.
    pub f16_gflops: Option<f64>,
    /// Whether the times came from device timestamps (else the wall clock).
    pub timestamps: bool,
}

impl Ceilings {
    /// The arithmetic ceiling of a kernel running in `precision`: the f16 rate for f16
    /// kernels (where measured), the f32 rate otherwise.
    pub fn gflops_peak(&self, precision: Precision) -> f64 {
        match precision {
            Precision::F16 => self.f16_gflops.unwrap_or(self.f32_gflops),
            Precision::F32 => self.f32_gflops,
        }
    }

    /// Roofline time of work that moves `bytes` and does `flops` in `precision`:
    /// `max(bytes / copy bandwidth, flops / arithmetic rate)`, in seconds.
    pub fn roofline_seconds(&self, bytes: u64, flops: u64, precision: Precision) -> f64 {
        let memory = bytes as f64 / (self.copy_gbps * 1e9);
        let compute = flops as f64 / (self.gflops_peak(precision) * 1e9);
        memory.max(compute)
    }
}

/// Measures the copy bandwidth and the arithmetic rates of `ctx`'s adapter.
///
/// # Errors
/// [`Error::InvalidArgument`] for empty option lists, zero repeats or pairs, or buffers under
/// 16 bytes; GPU errors from the kernels.
pub fn measure_ceilings(ctx: &Context, opts: &CeilingOptions) -> Result<Ceilings> {
    if opts.copy_workgroups.is_empty()
        || opts.fma_workgroups.is_empty()
        || opts.repeats == 0
        || opts.pairs == 0
        || opts.fma_seconds.is_nan()
        || opts.fma_seconds <= 0.0
    {
        return Err(Error::InvalidArgument(
            "ceiling options need workgroup counts, repeats, pairs and a positive FMA time".into(),
        ));
    }
    let (copy_trials, footprint, timestamps) = copy_ceiling(ctx, opts)?;
    let f32_gflops = fma_ceiling(ctx, opts, Precision::F32)?;
    let f16_gflops = if ctx.caps().shader_f16 {
        Some(fma_ceiling(ctx, opts, Precision::F16)?)
    } else {
        None
    };
    let copy_gbps = copy_trials.iter().map(|t| t.rate).fold(0.0, f64::max);
    Ok(Ceilings {
        copy_gbps,
        copy_trials,
        copy_footprint: footprint,
        f32_gflops,
        f16_gflops,
        timestamps,
    })
}

fn copy_ceiling(ctx: &Context, opts: &CeilingOptions) -> Result<(Vec<Trial>, u64, bool)> {
    let limit = ctx
        .device
        .limits()
        .max_storage_buffer_binding_size
        .min(ctx.caps().max_buffer_size);
    let bytes = opts.buffer_bytes.min(limit) / 16 * 16;
    if bytes == 0 {
        return Err(Error::InvalidArgument(format!(
            "copy buffers of {} bytes: need at least 16",
            opts.buffer_bytes
        )));
    }
    let make = |label| {
        ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes,
            usage: STORAGE,
            mapped_at_creation: false,
        })
    };
    let pairs: Vec<(wgpu::Buffer, wgpu::Buffer)> = (0..opts.pairs)
        .map(|_| Ok((make("copy source")?, make("copy destination")?)))
        .collect::<Result<_>>()?;
    let max = ctx.caps().max_compute_workgroups_per_dimension;
    // Touch every buffer once so that first-use clears are not timed.
    for (src, dst) in &pairs {
        copy_bytes(ctx, src, dst, bytes, 1024.min(max))?;
    }
    let mut trials = Vec::new();
    let mut timestamps = false;
    for &wg in &opts.copy_workgroups {
        let wg = wg.clamp(1, max);
        let mut best: f64 = 0.0;
        for _ in 0..opts.repeats {
            let ((), t) = ctx.timed(|| {
                for (src, dst) in &pairs {
                    copy_bytes(ctx, src, dst, bytes, wg)?;
                }
                Ok(())
            })?;
            timestamps = t.timestamps;
            best = best.max(2.0 * bytes as f64 * pairs.len() as f64 / t.seconds / 1e9);
        }
        trials.push(Trial {
            workgroups: wg,
            rate: best,
        });
    }
    Ok((trials, 2 * bytes * opts.pairs as u64, timestamps))
}

fn fma_ceiling(ctx: &Context, opts: &CeilingOptions, precision: Precision) -> Result<f64> {
    let max = ctx.caps().max_compute_workgroups_per_dimension;
    let mut best: f64 = 0.0;
    for &wg in &opts.fma_workgroups {
        let wg = wg.clamp(1, max);
        let out = ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some("fma output"),
            size: u64::from(wg) * u64::from(FMA_WG) * 16,
            usage: STORAGE,
            mapped_at_creation: false,
        })?;
        // Calibrate the step count to the time asked for.
        let mut iters = 16u32;
        let (_, t) = ctx.timed(|| fma_chains(ctx, precision, &out, wg, iters))?;
        let scale = (opts.fma_seconds / t.seconds.max(1e-7)).clamp(1.0, 1e6);
        iters = ((f64::from(iters) * scale) as u32).clamp(16, 1 << 20);
        for _ in 0..opts.repeats {
            let (flops, t) = ctx.timed(|| fma_chains(ctx, precision, &out, wg, iters))?;
            best = best.max(flops as f64 / t.seconds / 1e9);
        }
    }
    Ok(best)
}
