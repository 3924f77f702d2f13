//! One result: a case, its measured time and how it compares with the adapter's ceilings.

use super::{Case, CaseKernel, Measurement};
use crate::bench::Ceilings;
use crate::quant::KvDtype;
use crate::shader::Precision;

/// Which ceiling sets a case's roofline time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Bound {
    /// Bytes over the copy bandwidth.
    #[cfg_attr(feature = "serde", serde(rename = "mem"))]
    Memory,
    /// Floating-point operations over the FMA rate.
    #[cfg_attr(feature = "serde", serde(rename = "fma"))]
    Arithmetic,
}

impl Bound {
    /// `mem` or `fma`.
    pub fn name(self) -> &'static str {
        match self {
            Bound::Memory => "mem",
            Bound::Arithmetic => "fma",
        }
    }
}

/// One row of the benchmark table: the case's fields, its time and its roofline.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Row {
    /// [`Case::id`].
    pub id: String,
    /// The kernel.
    pub kernel: CaseKernel,
    /// KV storage format.
    pub kv_dtype: KvDtype,
    /// Kernel precision.
    pub precision: Precision,
    /// Keys per sequence.
    pub context: usize,
    /// Query tokens per sequence.
    pub chunk: usize,
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dim (MLA: latent rank).
    pub head_dim: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Paged (else contiguous) cache.
    pub paged: bool,
    /// Median seconds per run.
    pub seconds: f64,
    /// Fastest run, seconds.
    pub min_seconds: f64,
    /// Whether the times are device timestamps.
    pub timestamps: bool,
    /// [`Case::kv_bytes`].
    pub kv_bytes: u64,
    /// [`Case::flops`].
    pub flops: u64,
    /// `kv_bytes / seconds`, GB/s.
    pub gbps: f64,
    /// `flops / seconds`, GFLOP/s.
    pub gflops: f64,
    /// The adapter's copy bandwidth, GB/s.
    pub copy_gbps: f64,
    /// The adapter's FMA rate in the case's precision, GFLOP/s.
    pub gflops_peak: f64,
    /// `max(kv_bytes / copy bandwidth, flops / FMA rate)`, seconds.
    pub roofline_seconds: f64,
    /// `roofline_seconds / seconds`: 1 at the roofline.
    pub roofline_fraction: f64,
    /// Which term of the roofline is the larger.
    pub bound: Bound,
}

/// The row of `case` measured as `m`, judged against `ceilings`.
pub fn row(case: &Case, m: &Measurement, ceilings: &Ceilings) -> Row {
    let (kv_bytes, flops) = (case.kv_bytes(), case.flops());
    let gflops_peak = ceilings.gflops_peak(case.precision);
    let roofline_seconds = ceilings.roofline_seconds(kv_bytes, flops, case.precision);
    let memory = kv_bytes as f64 / (ceilings.copy_gbps * 1e9);
    let arithmetic = flops as f64 / (gflops_peak * 1e9);
    let seconds = m.median_seconds;
    Row {
        id: case.id(),
        kernel: case.kernel,
        kv_dtype: case.kv_dtype,
        precision: case.precision,
        context: case.context,
        chunk: case.chunk,
        batch: case.batch,
        q_heads: case.q_heads,
        kv_heads: case.kv_heads,
        head_dim: case.head_dim,
        block_size: case.block_size,
        paged: case.paged,
        seconds,
        min_seconds: m.min_seconds,
        timestamps: m.timestamps,
        kv_bytes,
        flops,
        gbps: kv_bytes as f64 / seconds / 1e9,
        gflops: flops as f64 / seconds / 1e9,
        copy_gbps: ceilings.copy_gbps,
        gflops_peak,
        roofline_seconds,
        roofline_fraction: roofline_seconds / seconds,
        bound: if memory >= arithmetic {
            Bound::Memory
        } else {
            Bound::Arithmetic
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_of_a_decode_row() {
        let ceilings = Ceilings {
            copy_gbps: 10.0,
            copy_trials: Vec::new(),
            copy_footprint: 0,
            f32_gflops: 20.0,
            f16_gflops: Some(40.0),
            timestamps: true,
        };
        let case = Case::decode(KvDtype::F16, 4096);
        let m = Measurement {
            median_seconds: 0.01,
            min_seconds: 0.009,
            timestamps: true,
        };
        let r = row(&case, &m, &ceilings);
        // 16,777,216 bytes at 10 GB/s: 1.678 ms; 67,108,864 FLOP at 20 GFLOP/s: 3.355 ms.
        assert_eq!(r.bound, Bound::Arithmetic);
        assert!((r.roofline_seconds - 67_108_864.0 / 20e9).abs() < 1e-12);
        assert!((r.roofline_fraction - r.roofline_seconds / 0.01).abs() < 1e-12);
        assert!((r.gbps - 1.6777216).abs() < 1e-9);
        assert!((r.gflops - 6.7108864).abs() < 1e-9);
        assert_eq!(r.gflops_peak, 20.0);
        // In f16 the FMA rate doubles and memory binds.
        let f16 = row(&case.with_precision(Precision::F16), &m, &ceilings);
        assert_eq!(f16.gflops_peak, 40.0);
        assert_eq!(f16.bound, Bound::Memory);
        assert_eq!(r.id, "decode/hd128/g4/ctx4096/b1/f16/bs16");
    }
}
