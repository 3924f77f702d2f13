//! `kvattn verify --quality`: the printer of [`kvattn::verify::quality()`], how much each KV
//! storage format costs in attention output quality, by context length, on this adapter.

use std::time::Instant;

use kvattn::gpu::Context;
use kvattn::verify::{self, QualityOptions, QualityProgress, QualityReport};
use kvattn::Result;

use crate::output::json;
use crate::output::table::{Align, Table};
use crate::verify::fmt_err;

/// Runs `kvattn verify --quality` (timed from `start`); `Ok(false)` when a row breaks its bound.
pub fn run(quick: bool, as_json: bool, start: Instant) -> Result<bool> {
    let ctx = Context::new()?;
    let options = QualityOptions {
        quick,
        ..Default::default()
    };
    let report = verify::quality(&ctx, &options, &mut print_progress)?;
    let wall = start.elapsed().as_secs_f64();
    if as_json {
        println!("{}", json::line(&report));
    } else {
        let a = &report.adapter;
        println!(
            "kvattn verify --quality{} on {} ({}, {})",
            if quick { " --quick" } else { "" },
            a.name,
            a.backend,
            a.device_type
        );
        print_table(&report);
        let t = &report.times;
        println!(
            "{} rows: {} within the bound, {} beyond it ({wall:.1}s)",
            report.rows.len(),
            report.rows.len() - report.failed,
            report.failed,
        );
        println!(
            "time: {:.1}s compiling {} pipelines, {:.1}s kernels (the codec's references \
             alongside), {:.1}s f64 reference, {:.1}s other; {wall:.1}s in all",
            t.compile_seconds,
            t.pipelines_compiled,
            t.kernel_seconds,
            t.reference_seconds,
            (wall - t.compile_seconds - t.kernel_seconds - t.reference_seconds).max(0.0),
        );
    }
    if report.failed > 0 {
        eprintln!(
            "kvattn: verify --quality: {} of {} rows exceed {} x the codec's NMSE + {:e}",
            report.failed,
            report.rows.len(),
            report.bound_factor,
            report.nmse_floor
        );
    }
    Ok(report.passed())
}

fn print_progress(p: &QualityProgress) {
    match p {
        QualityProgress::Reference { keys, seconds } => eprintln!(
            "quality: {} keys, f64 reference on f32 K/V ({seconds:.2}s)",
            keys.name()
        ),
        QualityProgress::FormatStarted {
            index,
            total,
            keys,
            format,
        } => eprint!(
            "quality [{:>2}/{total}] {} keys, {format} ... ",
            index + 1,
            keys.name()
        ),
        QualityProgress::FormatFinished {
            rows,
            pipelines_compiled,
            seconds,
            ..
        } => eprintln!(
            "{} ({seconds:.2}s, {pipelines_compiled} pipelines compiled)",
            if rows.iter().all(|r| r.pass) {
                "pass"
            } else {
                "FAIL"
            }
        ),
        _ => {}
    }
}

fn print_table(r: &QualityReport) {
    let (hq, hkv, d) = (r.num_q_heads, r.num_kv_heads, r.head_dim);
    let (factor, floor) = (r.bound_factor, r.nmse_floor);
    println!(
        "decode: 1 query token per sequence, {hq} query heads over {hkv} KV heads, head dim {d}, \
         {} kernel, block size {}; K and V in the same format",
        r.precision.name(),
        r.block_size
    );
    println!(
        "error of the output against the f64 reference on f32 K/V; gpu: the paged kernel over \
         the GPU-encoded cache; codec: the f64 reference on CPU-quantized K/V"
    );
    println!(
        "keys: gaussian = N(0, 1); outliers = N(0, 1) with {} of {d} channels per KV head {}x \
         larger; values and queries N(0, 1); per-tensor scales calibrated on {} separate \
         tokens (amax / format max; x2: twice that)",
        r.outlier_channels, r.outlier_factor, r.calibration_tokens
    );
    println!(
        "K only / V only: the codec's NMSE with only K (only V) quantized, the other f32; bound: \
         gpu NMSE <= {factor} x codec NMSE + {floor:e}"
    );
    let mut table = Table::new([
        ("keys", Align::Left),
        ("format", Align::Left),
        ("ctx", Align::Right),
        ("NMSE gpu", Align::Right),
        ("NMSE codec", Align::Right),
        ("K only", Align::Right),
        ("V only", Align::Right),
        ("max err gpu", Align::Right),
        ("max err codec", Align::Right),
        ("result", Align::Left),
    ])
    .min_width(0, 8)
    .min_width(2, 5)
    .min_width(3, 9)
    .min_width(5, 9)
    .min_width(6, 9);
    for row in &r.rows {
        table.push(vec![
            row.keys.name().into(),
            row.format.clone(),
            row.context.to_string(),
            fmt_err(row.gpu_nmse),
            fmt_err(Some(row.codec_nmse)),
            fmt_err(Some(row.codec_k_only_nmse)),
            fmt_err(Some(row.codec_v_only_nmse)),
            fmt_err(row.gpu_max_err),
            fmt_err(Some(row.codec_max_err)),
            if row.pass { "pass" } else { "FAIL" }.into(),
        ]);
    }
    print!("{}", table.text("  "));
    let mut notes: Vec<String> = Vec::new();
    for row in &r.rows {
        if let Some(n) = &row.note {
            let line = format!("{} keys, {}: {n}", row.keys.name(), row.format);
            if !notes.contains(&line) {
                notes.push(line);
            }
        }
    }
    for n in notes {
        println!("note: {}", n.replace('\n', " "));
    }
}
