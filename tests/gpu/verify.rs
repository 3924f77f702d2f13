//! `kvattn::verify` as a library: the grid's report (verdicts, counts, times that add up,
//! pipelines compiled, progress for every case), a grid whose outputs are corrupted on purpose
//! failing, and the quality table on a tiny configuration.

use std::time::Instant;

use kvattn::shader::Precision;
use kvattn::verify::{
    self, Kernel, Metric, Progress, QualityOptions, QualityProgress, Status, VerifyOptions,
    VerifyReport,
};

use crate::common::{is_gl, own_context};

/// The quick grid's f32 cases of these kernels.
fn options(kernels: &[Kernel]) -> VerifyOptions {
    VerifyOptions {
        quick: true,
        kernels: kernels.to_vec(),
        precisions: vec![Precision::F32],
        ..Default::default()
    }
}

/// Runs the grid, checking that progress reports every case's start and then its end, in order.
fn run_checked(ctx: &kvattn::gpu::Context, options: &VerifyOptions) -> VerifyReport {
    let mut events: Vec<(bool, usize)> = Vec::new();
    let mut compiled_in_progress = 0;
    let report = verify::run(ctx, options, &mut |p: &Progress| match p {
        Progress::CaseStarted { index, total, .. } => {
            assert!(index < total);
            events.push((true, *index));
        }
        Progress::CaseFinished { case, .. } => {
            compiled_in_progress += case.times.pipelines_compiled;
            events.push((false, case.index));
        }
        _ => {}
    })
    .expect("the grid runs");
    let want: Vec<(bool, usize)> = (0..report.cases.len())
        .flat_map(|i| [(true, i), (false, i)])
        .collect();
    assert_eq!(events, want, "progress events");
    assert_eq!(compiled_in_progress, report.times.pipelines_compiled);
    report
}

/// Counts, totals and times of a report are consistent.
fn assert_consistent(report: &VerifyReport, wall: f64) {
    let n = report.cases.len();
    assert_eq!(report.passed + report.failed + report.unavailable, n);
    let t = &report.times;
    let sum = |f: fn(&verify::CaseTimes) -> f64| report.cases.iter().map(|c| f(&c.times)).sum();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * (1.0 + a.abs());
    assert!(
        close(t.compile_seconds, sum(|c| c.compile_seconds)),
        "{t:?}"
    );
    assert!(close(t.kernel_seconds, sum(|c| c.kernel_seconds)), "{t:?}");
    assert!(
        close(t.reference_seconds, sum(|c| c.reference_seconds)),
        "{t:?}"
    );
    assert!(
        close(t.first_use_seconds, sum(|c| c.first_use_seconds)),
        "{t:?}"
    );
    assert!(close(t.repeat_seconds, sum(|c| c.repeat_seconds)), "{t:?}");
    let parts = t.compile_seconds
        + t.first_use_seconds
        + t.kernel_seconds
        + t.reference_seconds
        + t.repeat_seconds;
    assert!(t.seconds + 1e-6 >= parts, "{t:?}");
    assert!(close(t.seconds, parts + t.other_seconds), "{t:?}");
    assert!(t.seconds <= wall, "report {}s, measured {wall}s", t.seconds);
    assert!(t.seconds >= sum(|c| c.seconds) - 1e-6, "{t:?}");
    for (i, c) in report.cases.iter().enumerate() {
        assert_eq!(c.index, i);
        let ct = &c.times;
        let parts = ct.compile_seconds
            + ct.first_use_seconds
            + ct.kernel_seconds
            + ct.reference_seconds
            + ct.repeat_seconds;
        assert!(ct.seconds + 1e-6 >= parts, "{}: {ct:?}", c.name);
        assert!(
            ct.kernel_seconds > 0.0 && ct.reference_seconds > 0.0,
            "{}: {ct:?}",
            c.name
        );
        // Every case that measured something ran twice; the repeat holds the kernels again.
        if c.max_error.is_some() {
            assert!(ct.repeat_seconds >= ct.kernel_seconds, "{}: {ct:?}", c.name);
            assert!(ct.first_use_seconds.is_finite(), "{}: {ct:?}", c.name);
        }
    }
}

#[test]
fn the_grid_reports_every_case_with_honest_times() {
    let ctx = own_context(None);
    let kernels = [Kernel::Decode, Kernel::Dequant, Kernel::AppendKv];
    let start = Instant::now();
    let report = run_checked(&ctx, &options(&kernels));
    assert_consistent(&report, start.elapsed().as_secs_f64());
    assert!(report.passed(), "{report:#?}");
    assert_eq!(report.failed, 0);
    assert_eq!(report.precisions, [Precision::F32]);
    for k in kernels {
        assert!(report.cases.iter().any(|c| c.kernel == k), "no {k} case");
    }
    assert!(report.cases.iter().all(|c| kernels.contains(&c.kernel)));
    for c in &report.cases {
        assert_eq!(c.status, Status::Pass, "{c:?}");
        match c.kernel {
            Kernel::Dequant | Kernel::AppendKv => {
                assert_eq!(c.metric, Metric::BitExact);
                assert_eq!(c.max_error, Some(0.0), "{c:?}");
                assert_eq!(c.precision, None);
            }
            _ => {
                assert_eq!(c.metric, Metric::Tolerance);
                let (e, b) = (c.max_error.unwrap(), c.bound.unwrap());
                assert!(e <= b && b > 0.0, "{c:?}");
                assert!(c.lse_error.unwrap() <= c.lse_bound.unwrap(), "{c:?}");
                assert_eq!(c.precision, Some(Precision::F32));
            }
        }
    }
    // A fresh context compiles; the time is counted.
    let t = report.times;
    assert!(t.pipelines_compiled > 0 && t.compile_seconds > 0.0, "{t:?}");
    assert_eq!(
        ctx.counters().pipelines_compiled,
        report
            .cases
            .iter()
            .filter(|c| c.kernel != Kernel::AppendKv)
            .map(|c| c.times.pipelines_compiled)
            .sum::<u64>(),
        "pipelines of the adapter's context (the append cases use a capped one of their own)"
    );
    assert!(report.largest_errors().len() >= kernels.len());

    // The same cases again on the same context compile nothing.
    let again = run_checked(&ctx, &options(&[Kernel::Decode, Kernel::Dequant]));
    assert!(again.passed());
    assert!(again.cases.len() < report.cases.len());
    assert_eq!(again.times.pipelines_compiled, 0, "{:?}", again.times);
    assert_eq!(again.times.compile_seconds, 0.0);

    #[cfg(feature = "serde")]
    {
        let v = serde_json::to_value(&report).unwrap();
        assert_eq!(v["cases"].as_array().unwrap().len(), report.cases.len());
        assert_eq!(v["cases"][0]["status"], "pass");
        assert_eq!(v["cases"][0]["kernel"], "decode");
        assert_eq!(v["times"]["pipelines_compiled"], t.pipelines_compiled);
        // The parts of the time split reach the JSON, per case and in total.
        for part in ["first_use_seconds", "kernel_seconds", "repeat_seconds"] {
            assert!(v["times"][part].is_f64(), "times.{part}");
            assert!(
                v["cases"][0]["times"][part].is_f64(),
                "cases[0].times.{part}"
            );
        }
        assert!(v["adapter"]["name"].is_string());
    }
}

#[test]
fn corrupted_outputs_fail() {
    let ctx = own_context(None);
    let mut options = options(&[Kernel::Decode, Kernel::Dequant, Kernel::Mla]);
    options.name_contains = Some(String::new());
    options.corrupt = true;
    let report = run_checked(&ctx, &options);
    assert!(!report.passed());
    assert!(!report.cases.is_empty());
    assert_eq!(report.failed, report.cases.len(), "{report:#?}");
    for c in &report.cases {
        assert_eq!(c.status, Status::Fail, "{c:?}");
        let note = c.note.as_deref().unwrap_or("");
        match c.metric {
            Metric::BitExact => assert!(note.contains("bit-exact"), "{c:?}"),
            Metric::Tolerance => {
                assert!(c.max_error.unwrap() > c.bound.unwrap(), "{c:?}");
                assert!(note.contains("bound"), "{c:?}");
            }
        }
    }
    // Perturbing only the repeat: every case is judged passing on its first run, then fails
    // as not reproducible.
    options.corrupt = false;
    options.corrupt_repeat = true;
    let unstable = run_checked(&ctx, &options);
    assert_eq!(unstable.failed, unstable.cases.len(), "{unstable:#?}");
    for c in &unstable.cases {
        let note = c.note.as_deref().unwrap_or("");
        assert!(note.starts_with("not reproducible"), "{c:?}");
        match c.metric {
            Metric::BitExact => assert_eq!(c.max_error, Some(0.0), "{c:?}"),
            Metric::Tolerance => assert!(c.max_error.unwrap() <= c.bound.unwrap(), "{c:?}"),
        }
    }
    options.corrupt_repeat = false;

    // The name filter selects: no case has this in its name.
    options.name_contains = Some("no such case".into());
    let none = run_checked(&ctx, &options);
    assert!(none.cases.is_empty() && none.passed());
}

#[test]
fn the_quality_table_on_a_tiny_configuration() {
    let ctx = own_context(None);
    let options = QualityOptions {
        contexts: vec![16, 64],
        tokens_per_context: Some(128),
        ..Default::default()
    };
    let (mut started, mut finished) = (0, 0);
    let report = verify::quality(&ctx, &options, &mut |p: &QualityProgress| match p {
        QualityProgress::FormatStarted { index, .. } => {
            assert_eq!(*index, started);
            started += 1;
        }
        QualityProgress::FormatFinished { index, rows, .. } => {
            assert_eq!(*index, finished);
            assert_eq!(rows.len(), 2);
            finished += 1;
        }
        _ => {}
    })
    .expect("the quality table runs");
    assert_eq!((started, finished), (16, 16));
    assert_eq!(report.rows.len(), 2 * 8 * 2);
    assert!(report.passed(), "{report:#?}");
    for r in &report.rows {
        let gpu = r.gpu_nmse.expect("measured");
        assert!(
            gpu <= report.bound_factor * r.codec_nmse + report.nmse_floor,
            "{r:?}"
        );
        assert!(r.codec_nmse > 0.0 && r.codec_nmse < 1.0, "{r:?}");
        assert!([16, 64].contains(&r.context));
    }
    let t = report.times;
    assert!(t.pipelines_compiled > 0 && t.seconds >= t.compile_seconds + t.reference_seconds);
    let bad = QualityOptions {
        contexts: vec![0],
        ..Default::default()
    };
    assert!(matches!(
        verify::quality(&ctx, &bad, &mut |_| {}),
        Err(kvattn::Error::InvalidArgument(_))
    ));
}

#[test]
fn cases_past_the_adapters_limits_are_skipped_with_the_reason_never_passed() {
    // Storage bindings of 4 KiB (a browser or GLES limit can be far below a native one): the
    // paged cases whose KV block does not fit one binding are unavailable, with the limit in
    // their note; the rest still pass (their pools split over many buffers). None fails, and
    // none that needs more is counted as passed. On the second backend (GL) only the head dim
    // 64 cases, decode and prefill in several formats and block sizes, some of which fit and
    // some not: the same rules at a third of the grid's compiling and its pools' many
    // dispatches, which make this the suite's slowest test on llvmpipe.
    let ctx = own_context(Some(4096));
    let mut opts = options(&[Kernel::Paged]);
    if is_gl(&ctx) {
        opts.name_contains = Some(" d64 ".into());
    }
    let report = run_checked(&ctx, &opts);
    assert!(!report.cases.is_empty());
    assert_eq!(report.failed, 0, "{report:#?}");
    assert!(report.unavailable > 0, "{report:#?}");
    assert!(report.passed > 0, "{report:#?}");
    for c in report
        .cases
        .iter()
        .filter(|c| c.status == Status::Unavailable)
    {
        let note = c.note.as_deref().unwrap_or("");
        assert!(
            note.starts_with("this adapter cannot run it") && note.contains("limit"),
            "{c:?}"
        );
        assert_eq!(c.max_error, None, "{c:?}");
    }
    assert_eq!(
        report.passed + report.unavailable,
        report.cases.len(),
        "{report:#?}"
    );
}
