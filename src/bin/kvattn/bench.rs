//! `kvattn bench`: the adapter's ceilings, then every selected case timed and judged against
//! them (`docs/ARCHITECTURE.md`, section 13, Benchmarks). The ceilings are measured in the same run as the cases: copy
//! bandwidth and FMA rate; a case's roofline time is `max(bytes / bandwidth, flops / rate)` and
//! it is judged by the fraction of that it reaches.

mod output;
mod plot;

use std::path::{Path, PathBuf};
use std::time::Instant;

use kvattn::bench::cases::{full_set, measure, prepare, quick_set, row, Case, Row};
use kvattn::bench::{measure_ceilings, CeilingOptions};
use kvattn::gpu::Context;
use kvattn::shader::Precision;
use kvattn::{Error, Result};

use crate::case::invalid;
use crate::files::{check_outputs, write_all_or_none};
use crate::run::parse_precision;
use output::{ceilings_header, csv, json, progress, table};

/// Largest `--context`.
const MAX_CONTEXT: usize = 1 << 20;

/// Arguments of `kvattn bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// The quick set (about a minute on lavapipe, ceilings included) instead of the full sweep.
    #[arg(long)]
    quick: bool,
    /// Only the cases whose id contains SUBSTR, e.g. decode/hd128/g4, int8 or ctx16384; several
    /// comma-separated substrings select the cases that contain any of them (ids look like
    /// decode/hd128/g4/ctx4096/b1/f16/bs16; --list prints them).
    #[arg(long, value_name = "SUBSTR[,SUBSTR...]")]
    filter: Option<String>,
    /// Timed runs per case; the median counts [default: 5; 3 with --quick].
    #[arg(long, value_name = "N")]
    repeats: Option<usize>,
    /// Untimed runs per case before the timed ones.
    #[arg(long, value_name = "N", default_value_t = 1)]
    warmup: usize,
    /// Kernel precision of the attention cases: f32 (portable) or f16 (needs SHADER_F16).
    #[arg(long, value_name = "f32|f16", default_value = "f32")]
    precision: String,
    /// Set every case's keys per sequence to N (prefill chunks are cut to N, appends write N
    /// tokens): small cases for a smoke test.
    #[arg(long, value_name = "N")]
    context: Option<usize>,
    /// MiB of each of the three copy buffer pairs of the bandwidth ceiling [default: 96]; keep
    /// the total (six buffers) above the last-level cache for a true figure.
    #[arg(long, value_name = "MIB")]
    ceiling_mib: Option<u64>,
    /// Print the ids of the selected cases and exit.
    #[arg(long)]
    list: bool,
    /// Write the results as CSV to FILE.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Draw the roofline fraction and GB/s of the GQA decode cases against context as SVG to
    /// FILE.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Print one JSON array (one object per case) instead of the table; the ceilings and
    /// progress go to stderr.
    #[arg(long)]
    json: bool,
}

/// The checked settings: nothing here needs the GPU.
struct Settings {
    cases: Vec<Case>,
    precision: Precision,
    repeats: usize,
    ceilings: CeilingOptions,
}

impl Settings {
    fn new(args: &BenchArgs) -> Result<Self> {
        let precision = parse_precision(&args.precision)
            .map_err(|_| invalid(format!("--precision {:?}: valid: f32, f16", args.precision)))?;
        let repeats = args.repeats.unwrap_or(if args.quick { 3 } else { 5 });
        if repeats == 0 {
            return Err(invalid("--repeats must be at least 1"));
        }
        let mut ceilings = if args.quick {
            CeilingOptions::quick()
        } else {
            CeilingOptions::default()
        };
        if let Some(mib) = args.ceiling_mib {
            if !(1..=4096).contains(&mib) {
                return Err(invalid(format!(
                    "--ceiling-mib {mib}: give 1 to 4096 MiB per copy buffer"
                )));
            }
            ceilings.buffer_bytes = mib << 20;
        }
        let mut cases = if args.quick {
            quick_set(precision)
        } else {
            full_set(precision)
        };
        if let Some(n) = args.context {
            if !(1..=MAX_CONTEXT).contains(&n) {
                return Err(invalid(format!(
                    "--context {n}: give 1 to {MAX_CONTEXT} keys per sequence"
                )));
            }
            cases = dedup(cases.into_iter().map(|c| c.with_context(n)));
            for c in &cases {
                c.validate()
                    .map_err(|e| invalid(format!("--context {n}: {e}")))?;
            }
        }
        if let Some(f) = &args.filter {
            let parts: Vec<&str> = f.split(',').filter(|p| !p.is_empty()).collect();
            cases.retain(|c| {
                let id = c.id();
                parts.iter().any(|p| id.contains(p))
            });
            if cases.is_empty() {
                return Err(invalid(format!(
                    "--filter {f:?} matches no case of the {} set (ids look like \
                     decode/hd128/g4/ctx4096/b1/f16/bs16; --list prints them)",
                    if args.quick { "quick" } else { "full" }
                )));
            }
        }
        if args.plot.is_some() && !cases.iter().any(plot::plots) {
            return Err(invalid(
                "--plot draws the paged GQA decode cases of batch 1 and the selection has none",
            ));
        }
        Ok(Self {
            cases,
            precision,
            repeats,
            ceilings,
        })
    }
}

/// The cases in order, each id once.
fn dedup(cases: impl Iterator<Item = Case>) -> Vec<Case> {
    let mut out: Vec<Case> = Vec::new();
    for c in cases {
        if !out.contains(&c) {
            out.push(c);
        }
    }
    out
}

/// `e` with the case id in front of its message.
fn in_case(case: &Case, e: Error) -> Error {
    match e {
        Error::Gpu(m) => Error::Gpu(format!("{}: {m}", case.id())),
        Error::Wgpu { what, source, more } => Error::Wgpu {
            what: format!("{}: {what}", case.id()),
            source,
            more,
        },
        Error::InvalidArgument(m) => invalid(format!("{}: {m}", case.id())),
        other => invalid(format!("{}: {other}", case.id())),
    }
}

/// Runs `kvattn bench`: checks the flags and output paths, measures the ceilings, times every
/// case, prints the table (or JSON) and writes the CSV and SVG files, all or none.
pub fn run(args: &BenchArgs) -> Result<()> {
    let s = Settings::new(args)?;
    let outputs: Vec<(&str, &Path)> = [("--csv", &args.csv), ("--plot", &args.plot)]
        .into_iter()
        .filter_map(|(flag, p)| p.as_deref().map(|p| (flag, p)))
        .collect();
    check_outputs(&outputs, &[])?;
    if args.list {
        for c in &s.cases {
            println!("{}", c.id());
        }
        return Ok(());
    }
    let start = Instant::now();
    let ctx = Context::new()?;
    if s.precision == Precision::F16 && !ctx.caps().shader_f16 {
        return Err(invalid(
            "--precision f16: this adapter lacks SHADER_F16; use --precision f32",
        ));
    }
    let a = ctx.adapter();
    let adapter = format!("{} ({}, {})", a.name, a.backend, a.device_type);
    let ceilings = measure_ceilings(&ctx, &s.ceilings)?;
    let header = format!(
        "{}kernel precision {}; {} cases, {} timed runs each after {} warm-up (median)\n",
        ceilings_header(&adapter, &ceilings),
        s.precision.name(),
        s.cases.len(),
        s.repeats,
        args.warmup
    );
    if args.json {
        eprint!("{header}");
    } else {
        print!("{header}");
    }
    let mut results: Vec<(Case, Row)> = Vec::with_capacity(s.cases.len());
    for case in &s.cases {
        let t = Instant::now();
        let prepared = prepare(&ctx, case).map_err(|e| in_case(case, e))?;
        let prepare_seconds = t.elapsed().as_secs_f64();
        let m = measure(&ctx, &prepared, args.warmup, s.repeats).map_err(|e| in_case(case, e))?;
        // Free this case's buffers before the next one allocates (lavapipe: 2 GiB at once).
        drop(prepared);
        let r = row(case, &m, &ceilings);
        eprintln!("{}", progress(&r, prepare_seconds));
        results.push((*case, r));
    }
    let rows: Vec<Row> = results.iter().map(|(_, r)| r.clone()).collect();
    if args.json {
        print!("{}", json(&rows));
    } else {
        println!();
        print!("{}", table(&rows));
    }
    eprintln!(
        "bench: {} cases in {:.1} s",
        rows.len(),
        start.elapsed().as_secs_f64()
    );
    let mut files = Vec::new();
    if let Some(p) = &args.csv {
        files.push((p.as_path(), csv(&rows)));
    }
    if let Some(p) = &args.plot {
        let title = format!(
            "paged GQA decode, batch 1, {} kernel: {adapter}, copy {:.1} GB/s",
            s.precision.name(),
            ceilings.copy_gbps
        );
        let svg = plot::svg(&results, &title)
            .map_err(|e| invalid(format!("cannot draw {}: {e}", p.display())))?;
        files.push((p.as_path(), svg));
    }
    write_all_or_none(&files)
}
