//! The typed results of [`run`](super::run): one [`CaseReport`] per case, totals and times, and
//! the [`Progress`] events a caller sees while the grid runs.

use crate::gpu::{AdapterSummary, Capabilities};
use crate::shader::Precision;
use crate::{Error, Result};

/// The kernels the grid checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Kernel {
    /// Contiguous decode attention, against the reference on the stored K/V.
    Decode,
    /// Attention over the paged cache (decode and prefill batches, every storage format).
    Paged,
    /// The GPU KV decoders, against the CPU codec bit for bit.
    Dequant,
    /// The paged cache's append (quantizing on write), against the CPU encoder bit for bit.
    AppendKv,
    /// Multi-head Latent Attention, both paths, every latent format.
    Mla,
}

impl Kernel {
    /// Every kernel, in the order of the grid.
    pub const ALL: [Kernel; 5] = [
        Kernel::Decode,
        Kernel::Paged,
        Kernel::Dequant,
        Kernel::AppendKv,
        Kernel::Mla,
    ];

    /// The name the command line and the report use: `decode`, `paged`, `dequant`,
    /// `append_kv`, `mla`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Decode => "decode",
            Kernel::Paged => "paged",
            Kernel::Dequant => "dequant",
            Kernel::AppendKv => "append_kv",
            Kernel::Mla => "mla",
        }
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Kernel {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Kernel::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let valid: Vec<&str> = Kernel::ALL.iter().map(|k| k.name()).collect();
                Error::InvalidArgument(format!("unknown kernel {s:?}; valid: {}", valid.join(", ")))
            })
    }
}

/// How a case came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Status {
    /// Within its bound (or bit-exact).
    Pass,
    /// Beyond its bound, not bit-exact, or the kernel returned an error (see the note).
    Fail,
    /// The kernel is not implemented on this build (see the note); not a failure.
    Unavailable,
}

impl Status {
    /// `pass`, `FAIL` or `unavailable`, as the table prints it.
    pub fn label(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "FAIL",
            Status::Unavailable => "unavailable",
        }
    }
}

/// How a case's result is compared with its oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Metric {
    /// Largest absolute error of the output (and of the lse) within [`CaseReport::bound`]
    /// (and [`CaseReport::lse_bound`]); NaN and infinities count as exact where the reference
    /// has the same.
    Tolerance,
    /// Every value bit for bit equal to the CPU codec's (and, for appends, every stored word).
    BitExact,
}

/// Where a case's time went. `seconds` is the case's wall time; the other parts add up to it
/// with what is left (`seconds` less all of them), the host's data preparation.
///
/// Every case runs twice on the same data ([`run`](super::run)): the first run is judged; the
/// repeat, with every pipeline already compiled and used once, must give the same bits, and
/// its GPU side measures the kernels.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct CaseTimes {
    /// Wall time of the case, start to verdict (both runs).
    pub seconds: f64,
    /// Compute pipelines compiled during the case (the pipeline caches' misses, on every
    /// context the case used).
    pub pipelines_compiled: u64,
    /// Wall time of those compilations ([`Counters::pipeline_compile_nanos`](crate::gpu::Counters::pipeline_compile_nanos)).
    pub compile_seconds: f64,
    /// What the first run's GPU side took beyond the repeat's: work a driver defers to the
    /// first dispatch of a new pipeline (Mesa's llvmpipe behind OpenGL and lavapipe both
    /// compile their machine code there: nearly all of a cold `--quick` run) and other
    /// first-use costs. Zero for a case that did not run twice (it failed to run, or is
    /// unavailable).
    pub first_use_seconds: f64,
    /// Wall time of the GPU side of one warm run (the repeat's, or the first run's if it was
    /// shorter): creating the cache and buffers, uploads, the dispatches and the read-backs, as
    /// the host waited for them. Not a GPU timestamp: on a software adapter it is the kernels'
    /// CPU time, on a GPU it includes the transfers.
    pub kernel_seconds: f64,
    /// Wall time of the CPU oracle (first run): the reference (and f16 emulation) in f64, the
    /// CPU codec.
    pub reference_seconds: f64,
    /// Wall time of the repeat (its preparation, GPU side and comparison), less any
    /// compilation it did.
    pub repeat_seconds: f64,
}

/// One case of the grid and how it came out.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct CaseReport {
    /// Position in the grid (0-based).
    pub index: usize,
    /// The kernel checked.
    pub kernel: Kernel,
    /// The case, as the table names it (shape, storage, precision, block size, lengths, options).
    pub name: String,
    /// The storage format(s), e.g. `f16`, `int8/int4`, `fp8-e4m3 per-tensor`.
    pub format: String,
    /// The kernel's precision variant (`None` for the codecs).
    pub precision: Option<Precision>,
    /// The kernel, formats and variant: cases of one group share a line of
    /// [`VerifyReport::largest_errors`].
    pub group: String,
    /// Pass, fail or unavailable.
    pub status: Status,
    /// How the result was compared.
    pub metric: Metric,
    /// Largest absolute error of the output; `None` when not measured (the kernel failed or
    /// is unavailable). An infinite error (a NaN where the reference has none, a wrong length)
    /// sets [`CaseReport::non_finite_error`] and is `null` in JSON.
    pub max_error: Option<f64>,
    /// Normalized mean squared error of the output (`sum (o - ref)^2 / sum ref^2`, over the
    /// elements the reference gives a finite value); `None` when not measured.
    pub nmse: Option<f64>,
    /// Largest absolute error of the lse (attention kernels).
    pub lse_error: Option<f64>,
    /// The output's bound ([`Metric::Tolerance`]).
    pub bound: Option<f64>,
    /// The lse's bound ([`Metric::Tolerance`]).
    pub lse_bound: Option<f64>,
    /// Whether one of the errors is infinite.
    pub non_finite_error: bool,
    /// Why the case failed or is unavailable, or what else is worth saying.
    pub note: Option<String>,
    /// Where its time went.
    pub times: CaseTimes,
}

/// Totals of a run: wall time of the whole call and its parts (the sums of the cases' parts,
/// see [`CaseTimes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Times {
    /// Wall time of the whole [`run`](super::run) call (every case and the grid's set-up).
    pub seconds: f64,
    /// Compute pipelines compiled.
    pub pipelines_compiled: u64,
    /// Seconds compiling them.
    pub compile_seconds: f64,
    /// Seconds of first-use work beyond the warm runs ([`CaseTimes::first_use_seconds`]).
    pub first_use_seconds: f64,
    /// Seconds on the GPU side of warm runs ([`CaseTimes::kernel_seconds`]).
    pub kernel_seconds: f64,
    /// Seconds in the CPU oracle.
    pub reference_seconds: f64,
    /// Seconds repeating each case to check that it reproduces its bits.
    pub repeat_seconds: f64,
    /// The rest: data preparation and the grid's set-up (`seconds` less the parts above).
    pub other_seconds: f64,
}

/// The report of [`run`](super::run).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct VerifyReport {
    /// The adapter verified.
    pub adapter: AdapterSummary,
    /// Its capabilities (features and limits) as kvattn sees them.
    pub capabilities: Capabilities,
    /// Whether the quick subset ran.
    pub quick: bool,
    /// The kernel precisions checked.
    pub precisions: Vec<Precision>,
    /// Every case, in grid order.
    pub cases: Vec<CaseReport>,
    /// Cases that passed.
    pub passed: usize,
    /// Cases that failed.
    pub failed: usize,
    /// Cases whose kernel is unavailable.
    pub unavailable: usize,
    /// Where the time went.
    pub times: Times,
}

/// The largest errors of one group of cases (see [`VerifyReport::largest_errors`]).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct GroupErrors {
    /// The kernel, formats and variant.
    pub group: String,
    /// The largest output error of its measured cases.
    pub max_error: f64,
    /// The largest lse error, for attention kernels.
    pub lse_error: Option<f64>,
}

impl VerifyReport {
    /// Whether no case failed.
    pub fn passed(&self) -> bool {
        self.failed == 0
    }

    /// The largest errors per group (kernel, formats, variant), over the measured cases, in
    /// order of first appearance.
    pub fn largest_errors(&self) -> Vec<GroupErrors> {
        let mut groups: Vec<GroupErrors> = Vec::new();
        for c in &self.cases {
            let Some(e) = c.max_error else {
                continue;
            };
            match groups.iter_mut().find(|g| g.group == c.group) {
                Some(g) => {
                    g.max_error = g.max_error.max(e);
                    if let Some(l) = c.lse_error {
                        g.lse_error = Some(g.lse_error.map_or(l, |x| x.max(l)));
                    }
                }
                None => groups.push(GroupErrors {
                    group: c.group.clone(),
                    max_error: e,
                    lse_error: c.lse_error,
                }),
            }
        }
        groups
    }
}

/// What [`run`](super::run) reports while it runs.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Progress<'a> {
    /// A case starts (its pipelines may take a while to compile on a software adapter).
    CaseStarted {
        /// Its position (0-based).
        index: usize,
        /// Cases in the grid.
        total: usize,
        /// Its kernel.
        kernel: Kernel,
        /// Its name.
        name: &'a str,
    },
    /// A case is done.
    CaseFinished {
        /// Cases in the grid.
        total: usize,
        /// Its report (verdict, errors, times, pipelines compiled).
        case: &'a CaseReport,
    },
}
