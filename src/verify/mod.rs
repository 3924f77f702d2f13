//! Verification on the user's adapter: every kernel, storage format and variant the adapter
//! supports against the CPU reference ([`run`], the grid of `kvattn verify`), and what each KV
//! storage format costs in attention quality ([`quality()`], `kvattn verify --quality`).
//!
//! Kernels and oracles:
//! - `decode` (contiguous decode): [`reference::attention()`](crate::reference::attention()) on
//!   the values the kernel stores (K/V rounded to the storage format);
//! - `paged` (attention over the paged cache, decode and prefill batches, free blocks shuffled,
//!   every storage format, K and V formats mixed, per-row and per-tensor FP8 scales): the same
//!   reference on the values the CPU codec stores;
//! - `dequant` (the GPU KV decoders): the CPU codec, bit for bit;
//! - `append_kv` (the paged cache's append, quantizing on write, pools split over several
//!   bindings): the CPU encoder's value and scale words, bit for bit;
//! - `mla` (Multi-head Latent Attention, absorbed and up-projection paths, every latent
//!   format): [`reference::mla()`](crate::reference::mla()) on the latent as stored.
//!
//! Tolerances (docs/ARCHITECTURE.md, "Tolerances"): f32 kernels within
//! `1e-4 * max(1, max |ref|)`, lse within `1e-4`; f16 kernels within twice the error of an
//! honest f16 emulation (Q, K, V and the probabilities rounded to f16, everything else in f64)
//! plus `1e-5` of the output scale; MLA's f16 kernel within `1/128` of the output scale.
//!
//! The module does no file or process I/O (no printing, no environment): it returns typed
//! reports and reports progress through a callback, so it runs wherever the crate does.
//!
//! ```no_run
//! use kvattn::gpu::Context;
//! use kvattn::verify::{self, Progress, VerifyOptions};
//!
//! let ctx = Context::new()?;
//! let options = VerifyOptions { quick: true, ..Default::default() };
//! let report = verify::run(&ctx, &options, &mut |p: &Progress| {
//!     if let Progress::CaseFinished { case, total } = p {
//!         println!("[{}/{total}] {} {}: {}", case.index + 1, case.kernel, case.name, case.status.label());
//!     }
//! })?;
//! println!("{} passed, {} failed; {} pipelines compiled in {:.1}s",
//!     report.passed, report.failed, report.times.pipelines_compiled, report.times.compile_seconds);
//! assert!(report.passed());
//! # Ok::<(), kvattn::Error>(())
//! ```

mod append;
mod cases;
pub(crate) mod clock;
mod grid;
mod metrics;
mod mla;
mod oracle;
pub mod paged;
mod quality;
mod quality_data;
mod report;
mod verifier;

use std::collections::HashMap;

use crate::gpu::{Context, Counters};
use crate::shader::Precision;
use crate::Result;

use clock::Stopwatch;
use metrics::Outcome;
use verifier::{Phases, Verifier};

pub use quality::{
    quality, Keys, QualityOptions, QualityProgress, QualityReport, QualityRow, QualityTimes,
    BOUND_FACTOR, NMSE_FLOOR,
};
pub use report::{
    CaseReport, CaseTimes, GroupErrors, Kernel, Metric, Progress, Status, Times, VerifyReport,
};

/// What [`run`] checks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyOptions {
    /// A subset of the grid: every kernel and storage format, fewer shapes, lengths and
    /// variants. On Mesa's software adapters (2 cores) its kernels take seconds; a cold run
    /// takes about 5 minutes, almost all of it the driver compiling at first dispatch, and
    /// seconds once Mesa's shader cache holds the pipelines.
    pub quick: bool,
    /// Only the cases of these kernels; empty: every kernel.
    pub kernels: Vec<Kernel>,
    /// Only these kernel precisions (a precision the adapter lacks is left out); empty: every
    /// precision the adapter supports.
    pub precisions: Vec<Precision>,
    /// Only the cases whose name contains this text.
    pub name_contains: Option<String>,
    /// Test hook: every attention output and decoded value is perturbed before it is judged, so
    /// the cases of `decode`, `paged`, `dequant` and `mla` must fail.
    #[doc(hidden)]
    pub corrupt: bool,
    /// Test hook: only the repeat of every case is perturbed, so every case that ran must fail
    /// as not reproducible.
    #[doc(hidden)]
    pub corrupt_repeat: bool,
}

/// Pipelines compiled and their compilation time on `ctx` and, when there is one, the
/// verifier's second context.
fn compile_counters(v: &Verifier) -> Counters {
    let mut c = v.ctx.counters();
    if let Some(capped) = &v.capped {
        let more = capped.counters();
        c.pipelines_compiled += more.pipelines_compiled;
        c.pipeline_compile_nanos += more.pipeline_compile_nanos;
    }
    c
}

/// Runs the verification grid on `ctx`: every case the options select, each against its CPU
/// oracle, calling `progress` before and after each case. A case whose kernel returns an error
/// fails (the note says why); the call itself returns an error only when the grid cannot be
/// set up or an oracle cannot run.
///
/// This blocks until the grid is done; in the browser await [`run_async`] instead.
pub fn run(
    ctx: &Context,
    options: &VerifyOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<VerifyReport> {
    pollster::block_on(run_async(ctx, options, progress))
}

/// [`run`] without blocking: every readback is awaited, so it runs on the browser's main thread
/// (the web page of `web/` awaits it). `progress` is called between cases, so a caller that
/// updates a page from it shows each case as it finishes.
pub async fn run_async(
    ctx: &Context,
    options: &VerifyOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<VerifyReport> {
    let clock = Stopwatch::start();
    let supported = |p: &Precision| *p == Precision::F32 || ctx.caps().shader_f16;
    let precisions: Vec<Precision> = if options.precisions.is_empty() {
        [Precision::F32, Precision::F16]
            .into_iter()
            .filter(supported)
            .collect()
    } else {
        options
            .precisions
            .iter()
            .copied()
            .filter(supported)
            .collect()
    };
    let mut checks = if precisions.is_empty() {
        Vec::new()
    } else {
        grid::grid(options.quick, &precisions)
    };
    checks.retain(|c| options.kernels.is_empty() || options.kernels.contains(&c.kernel()));
    if let Some(text) = &options.name_contains {
        checks.retain(|c| c.name().contains(text.as_str()));
    }
    let mut verifier = Verifier {
        ctx,
        capped: None,
        oracles: HashMap::new(),
        phases: Phases::default(),
        corrupt: options.corrupt,
    };
    let total = checks.len();
    let mut cases = Vec::with_capacity(total);
    for (index, check) in checks.iter().enumerate() {
        let name = check.name();
        progress(&Progress::CaseStarted {
            index,
            total,
            kernel: check.kernel(),
            name: &name,
        });
        let seed = 0x5eed + index as u64;
        let (outcome, times) = run_case(&mut verifier, check, seed, options.corrupt_repeat).await;
        let case = case_report(index, check, name, outcome, times);
        progress(&Progress::CaseFinished { total, case: &case });
        cases.push(case);
    }
    let count = |s: Status| cases.iter().filter(|c| c.status == s).count();
    let (passed, failed, unavailable) = (
        count(Status::Pass),
        count(Status::Fail),
        count(Status::Unavailable),
    );
    let sum = |part: fn(&CaseTimes) -> f64| cases.iter().map(|c| part(&c.times)).sum::<f64>();
    let mut times = Times {
        pipelines_compiled: cases.iter().map(|c| c.times.pipelines_compiled).sum(),
        compile_seconds: sum(|t| t.compile_seconds),
        first_use_seconds: sum(|t| t.first_use_seconds),
        kernel_seconds: sum(|t| t.kernel_seconds),
        reference_seconds: sum(|t| t.reference_seconds),
        repeat_seconds: sum(|t| t.repeat_seconds),
        ..Times::default()
    };
    times.seconds = clock.seconds();
    times.other_seconds = (times.seconds
        - times.compile_seconds
        - times.first_use_seconds
        - times.kernel_seconds
        - times.reference_seconds
        - times.repeat_seconds)
        .max(0.0);
    Ok(VerifyReport {
        adapter: ctx.adapter().clone(),
        capabilities: ctx.caps().clone(),
        quick: options.quick,
        precisions,
        cases,
        passed,
        failed,
        unavailable,
        times,
    })
}

/// Runs one case twice on the same data (same seed, same block shuffle). The first run
/// compiles what the case needs and is judged; the repeat, with every pipeline compiled and
/// dispatched once, must give a result with the same bits (a kernel whose result depends on
/// anything but its input fails here), and its GPU side is the case's kernel time. A case whose
/// first run measured nothing (the kernel failed to run, or is unavailable) is not repeated.
/// `corrupt_repeat` (a test hook) perturbs the repeat's results alone.
async fn run_case(
    verifier: &mut Verifier<'_>,
    check: &cases::Check,
    seed: u64,
    corrupt_repeat: bool,
) -> (Outcome, CaseTimes) {
    let clock = Stopwatch::start();
    let before = compile_counters(verifier);
    let (mut outcome, first) = run_once(verifier, check, seed).await;
    let compiled_first = compile_counters(verifier).since(&before);
    let first_compile = compiled_first.pipeline_compile_nanos as f64 * 1e-9;
    let first_gpu = (first.gpu - first_compile).max(0.0);
    let (mut kernel_seconds, mut repeat_seconds) = (first_gpu, 0.0);
    if let Some(digest) = outcome.digest {
        let repeat_clock = Stopwatch::start();
        let before_repeat = compile_counters(verifier);
        let corrupt = verifier.corrupt;
        verifier.corrupt |= corrupt_repeat;
        let (again, warm) = run_once(verifier, check, seed).await;
        verifier.corrupt = corrupt;
        let repeat_compile = compile_counters(verifier)
            .since(&before_repeat)
            .pipeline_compile_nanos as f64
            * 1e-9;
        repeat_seconds = (repeat_clock.seconds() - repeat_compile).max(0.0);
        kernel_seconds = (warm.gpu - repeat_compile).max(0.0).min(first_gpu);
        if again.digest != Some(digest) {
            outcome.status = Status::Fail;
            let why = match again.note {
                Some(note) if again.digest.is_none() => format!(": {note}"),
                _ => String::new(),
            };
            let note =
                format!("not reproducible: a second run on the same data gave other bits{why}");
            outcome.note = Some(match outcome.note.take() {
                Some(first_note) => format!("{note}; first run: {first_note}"),
                None => note,
            });
        }
    }
    let compiled = compile_counters(verifier).since(&before);
    let times = CaseTimes {
        seconds: clock.seconds(),
        pipelines_compiled: compiled.pipelines_compiled,
        compile_seconds: compiled.pipeline_compile_nanos as f64 * 1e-9,
        first_use_seconds: first_gpu - kernel_seconds,
        kernel_seconds,
        reference_seconds: first.reference,
        repeat_seconds,
    };
    (outcome, times)
}

/// One run of a case: its outcome (an error is a failed case) and where its time went.
async fn run_once(
    verifier: &mut Verifier<'_>,
    check: &cases::Check,
    seed: u64,
) -> (Outcome, Phases) {
    verifier.phases = Phases::default();
    let outcome = verifier
        .run(check, seed)
        .await
        .unwrap_or_else(|e| Outcome::from_error(&e));
    (outcome, verifier.phases)
}

/// The report of one case.
fn case_report(
    index: usize,
    check: &cases::Check,
    name: String,
    o: Outcome,
    times: CaseTimes,
) -> CaseReport {
    let measured = |x: f64| (!x.is_nan()).then_some(x);
    let non_finite_error = [o.max_err, o.nmse, o.lse_err.unwrap_or(0.0)]
        .iter()
        .any(|x| x.is_infinite());
    CaseReport {
        index,
        kernel: check.kernel(),
        name,
        format: check.format(),
        precision: check.precision(),
        group: check.group(),
        status: o.status,
        metric: match check.kernel() {
            Kernel::Dequant | Kernel::AppendKv => Metric::BitExact,
            Kernel::Decode | Kernel::Paged | Kernel::Mla => Metric::Tolerance,
        },
        max_error: measured(o.max_err),
        nmse: measured(o.nmse),
        lse_error: o.lse_err.and_then(measured),
        bound: o.bounds.map(|b| b.0),
        lse_bound: o.bounds.map(|b| b.1),
        non_finite_error,
        note: o.note,
        times,
    }
}
