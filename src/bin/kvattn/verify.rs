//! `kvattn verify`: the printer of [`kvattn::verify::run`] (every kernel and storage format this
//! adapter supports against the CPU oracles, over a built-in grid): progress on stderr, a table of
//! errors and times (or the report as JSON), a non-zero exit if anything fails.
//!
//! `--quality` prints [`kvattn::verify::quality()`] instead (see `quality.rs`).

use kvattn::gpu::Context;
use kvattn::verify::{self, Kernel, Progress, Status, VerifyOptions, VerifyReport};
use kvattn::Result;

use crate::output::json;
use crate::output::table::{Align, Table};

/// Arguments of `kvattn verify`.
#[derive(clap::Args)]
pub struct VerifyArgs {
    /// A subset of the grid: every kernel and format, fewer shapes (on a software adapter about
    /// 5 minutes cold, mostly driver compilation; seconds with Mesa's shader cache warm). With
    /// --quality: contexts 128 and 1024 only.
    #[arg(long)]
    quick: bool,
    /// Only the checks of these kernels (decode, paged, dequant, append_kv, mla); repeatable.
    #[arg(long = "kernel", value_name = "NAME", conflicts_with = "quality")]
    kernels: Vec<String>,
    /// Instead of the checks: the quality table of the KV storage formats (NMSE and max error
    /// of the attention output against f32 KV, by context length, beside the CPU codec's own);
    /// with --quick only contexts 128 and 1024.
    #[arg(long)]
    quality: bool,
    /// Print the report as JSON instead of the table (progress still goes to stderr).
    #[arg(long)]
    json: bool,
}

/// An error for the tables: "-" for none, "inf" for infinite, "0", or two significant digits.
pub(crate) fn fmt_err(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(x) if x.is_nan() => "-".into(),
        Some(x) if x.is_infinite() => "inf".into(),
        Some(0.0) => "0".into(),
        Some(x) => format!("{x:.2e}"),
    }
}

/// Runs `kvattn verify`; `Ok(false)` when some check failed (the table says which).
pub fn run(args: &VerifyArgs) -> Result<bool> {
    let start = std::time::Instant::now();
    if args.quality {
        return crate::quality::run(args.quick, args.json, start);
    }
    let kernels = args
        .kernels
        .iter()
        .map(|k| k.parse())
        .collect::<Result<Vec<Kernel>>>()?;
    let ctx = Context::new()?;
    let open_seconds = start.elapsed().as_secs_f64();
    let options = VerifyOptions {
        quick: args.quick,
        kernels,
        ..Default::default()
    };
    let report = verify::run(&ctx, &options, &mut print_progress)?;
    if args.json {
        println!("{}", json::line(&report));
    } else {
        let a = &report.adapter;
        println!(
            "kvattn verify{} on {} ({}, {}); features [{}]",
            if args.quick { " --quick" } else { "" },
            a.name,
            a.backend,
            a.device_type,
            report.capabilities.feature_names().join(", ")
        );
        print_table(&report);
        print_summary(&report, open_seconds, start.elapsed().as_secs_f64());
    }
    if report.failed > 0 {
        eprintln!(
            "kvattn: verify: {} of {} checks failed",
            report.failed,
            report.cases.len()
        );
    }
    Ok(report.passed())
}

/// One stderr line per case: its start (a software adapter may compile for a while), then its
/// verdict, pipelines compiled, their compilation and first dispatch, and the case's time.
fn print_progress(p: &Progress) {
    match p {
        Progress::CaseStarted {
            index,
            total,
            kernel,
            name,
            ..
        } => eprint!("verify [{:>3}/{total}] {kernel} {name} ... ", index + 1),
        Progress::CaseFinished { case, .. } => {
            let t = &case.times;
            let compiled = if t.pipelines_compiled > 0 {
                format!(
                    "; {} pipelines compiled in {:.2}s, first dispatch {:.2}s",
                    t.pipelines_compiled, t.compile_seconds, t.first_use_seconds
                )
            } else {
                String::new()
            };
            eprintln!("{} ({:.2}s{compiled})", case.status.label(), t.seconds);
        }
        _ => {}
    }
}

fn print_table(report: &VerifyReport) {
    let mut table = Table::new([
        ("kernel", Align::Left),
        ("case", Align::Left),
        ("max error", Align::Right),
        ("NMSE", Align::Right),
        ("lse error", Align::Right),
        ("compiled", Align::Right),
        ("compile s", Align::Right),
        ("first use s", Align::Right),
        ("kernel s", Align::Right),
        ("result", Align::Left),
    ])
    .min_width(0, 9)
    .min_width(1, 4)
    .min_width(2, 9)
    .min_width(3, 9)
    .min_width(4, 9);
    for c in &report.cases {
        table.push(vec![
            c.kernel.name().into(),
            c.name.clone(),
            fmt_err(c.max_error),
            fmt_err(c.nmse),
            fmt_err(c.lse_error),
            c.times.pipelines_compiled.to_string(),
            format!("{:.2}", c.times.compile_seconds),
            format!("{:.2}", c.times.first_use_seconds),
            format!("{:.3}", c.times.kernel_seconds),
            c.status.label().into(),
        ]);
    }
    print!("{}", table.text("  "));
    // Notes: why rows failed or were unavailable (once per distinct message).
    let mut notes: Vec<String> = Vec::new();
    for c in &report.cases {
        if let Some(n) = &c.note {
            let line = match c.status {
                Status::Unavailable => format!("{}: unavailable: {n}", c.kernel),
                _ => format!("{} {}: {n}", c.kernel, c.name),
            };
            if !notes.contains(&line) {
                notes.push(line);
            }
        }
    }
    for n in notes {
        println!("note: {}", n.replace('\n', " "));
    }
    let groups = report.largest_errors();
    if !groups.is_empty() {
        println!("largest errors:");
        let w = groups
            .iter()
            .map(|g| g.group.len())
            .max()
            .unwrap_or(0)
            .max(28);
        for g in groups {
            let out = fmt_err(Some(g.max_error));
            match g.lse_error {
                None => println!("  {:<w$} out {out}", g.group),
                Some(l) => println!("  {:<w$} out {out}  lse {}", g.group, fmt_err(Some(l))),
            }
        }
    }
}

/// The counts, then where the wall time went: opening the adapter, compiling pipelines, the
/// drivers' work at first dispatch, the kernels, the CPU reference, the repeats and the rest,
/// adding up to the total.
fn print_summary(report: &VerifyReport, open_seconds: f64, wall_seconds: f64) {
    let t = &report.times;
    println!(
        "{} checks: {} passed, {} failed, {} unavailable ({wall_seconds:.1}s)",
        report.cases.len(),
        report.passed,
        report.failed,
        report.unavailable,
    );
    let parts = open_seconds
        + t.compile_seconds
        + t.first_use_seconds
        + t.kernel_seconds
        + t.reference_seconds
        + t.repeat_seconds;
    println!(
        "time: {:.1}s opening the adapter, {:.1}s compiling {} pipelines, {:.1}s first \
         dispatches (driver work deferred from compilation), {:.1}s kernels, {:.1}s CPU \
         reference, {:.1}s repeating each case (same bits required), {:.1}s other; \
         {wall_seconds:.1}s in all",
        open_seconds,
        t.compile_seconds,
        t.pipelines_compiled,
        t.first_use_seconds,
        t.kernel_seconds,
        t.reference_seconds,
        t.repeat_seconds,
        (wall_seconds - parts).max(0.0),
    );
}
