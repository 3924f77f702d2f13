//! The results of `kvattn bench` as JSON, CSV and a Markdown table, and the ceilings header.

use kvattn::bench::cases::{CaseKernel, Row};
use kvattn::bench::Ceilings;

use crate::columns::{self, Value};

type Column = columns::Column<Row>;

/// The keys of every JSON object and the CSV header, in order.
const COLUMNS: [Column; 24] = [
    ("id", |r| Value::Owned(r.id.clone())),
    ("kernel", |r| Value::Text(r.kernel.name())),
    ("kv_dtype", |r| Value::Text(r.kv_dtype.name())),
    ("precision", |r| Value::Text(r.precision.name())),
    ("context", |r| Value::Int(r.context as u64)),
    ("chunk", |r| Value::Int(r.chunk as u64)),
    ("batch", |r| Value::Int(r.batch as u64)),
    ("q_heads", |r| Value::Int(r.q_heads as u64)),
    ("kv_heads", |r| Value::Int(r.kv_heads as u64)),
    ("head_dim", |r| Value::Int(r.head_dim as u64)),
    ("block_size", |r| Value::Int(r.block_size as u64)),
    ("paged", |r| Value::Bool(r.paged)),
    ("seconds", |r| Value::Float(r.seconds)),
    ("min_seconds", |r| Value::Float(r.min_seconds)),
    ("timestamps", |r| Value::Bool(r.timestamps)),
    ("kv_bytes", |r| Value::Int(r.kv_bytes)),
    ("flops", |r| Value::Int(r.flops)),
    ("gbps", |r| Value::Float(r.gbps)),
    ("gflops", |r| Value::Float(r.gflops)),
    ("copy_gbps", |r| Value::Float(r.copy_gbps)),
    ("gflops_peak", |r| Value::Float(r.gflops_peak)),
    ("roofline_seconds", |r| Value::Float(r.roofline_seconds)),
    ("roofline_fraction", |r| Value::Float(r.roofline_fraction)),
    ("bound", |r| Value::Text(r.bound.name())),
];

/// One JSON array, one object per row, keys in [`COLUMNS`] order.
pub fn json(rows: &[Row]) -> String {
    columns::json(rows, &COLUMNS)
}

/// A header line and one line per row.
pub fn csv(rows: &[Row]) -> String {
    columns::csv(rows, &COLUMNS)
}

/// The Markdown table: case, dtype, median ms, MB moved, GB/s, GFLOP/s, fraction of the
/// roofline and its bound.
pub fn table(rows: &[Row]) -> String {
    const HEAD: [&str; 8] = [
        "case", "dtype", "ms", "KV MB", "GB/s", "GFLOP/s", "roofline", "bound",
    ];
    let cells: Vec<[String; 8]> = rows
        .iter()
        .map(|r| {
            [
                r.id.clone(),
                r.kv_dtype.name().to_string(),
                format!("{:.3}", r.seconds * 1e3),
                format!("{:.1}", r.kv_bytes as f64 / 1e6),
                format!("{:.2}", r.gbps),
                if r.flops == 0 {
                    "-".into()
                } else {
                    format!("{:.2}", r.gflops)
                },
                format!("{:.1}%", 100.0 * r.roofline_fraction),
                r.bound.name().to_string(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..HEAD.len())
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].len())
                .fold(HEAD[i].len(), usize::max)
        })
        .collect();
    // Text left-aligned, numbers right-aligned.
    let left = |i: usize| i < 2 || i == HEAD.len() - 1;
    let line = |row: &[String]| {
        let parts: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (c, &w))| {
                if left(i) {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        format!("| {} |\n", parts.join(" | "))
    };
    let mut out = line(&HEAD.map(String::from));
    let rule: Vec<String> = widths
        .iter()
        .enumerate()
        .map(|(i, &w)| {
            if left(i) {
                "-".repeat(w)
            } else {
                format!("{}:", "-".repeat(w - 1))
            }
        })
        .collect();
    out.push_str(&format!("| {} |\n", rule.join(" | ")));
    for c in &cells {
        out.push_str(&line(c));
    }
    out
}

/// The lines describing the adapter and its ceilings.
pub fn ceilings_header(adapter: &str, c: &Ceilings) -> String {
    let best = c
        .copy_trials
        .iter()
        .max_by(|a, b| a.rate.total_cmp(&b.rate))
        .map_or(0, |t| t.workgroups);
    let trials: Vec<String> = c
        .copy_trials
        .iter()
        .map(|t| format!("{}: {:.2}", t.workgroups, t.rate))
        .collect();
    let f16 = c.f16_gflops.map_or_else(
        || "not measured (no SHADER_F16)".to_string(),
        |g| format!("{g:.2} GFLOP/s"),
    );
    format!(
        "adapter: {adapter}\n\
         ceilings ({}): copy {:.2} GB/s with {best} workgroups (GB/s by workgroups: {}) over \
         {} MiB; FMA f32 {:.2} GFLOP/s, f16 {f16}\n",
        if c.timestamps {
            "device timestamps"
        } else {
            "wall clock"
        },
        c.copy_gbps,
        trials.join(", "),
        c.copy_footprint >> 20,
        c.f32_gflops,
    )
}

/// The line printed on stderr as each case finishes.
pub fn progress(r: &Row, prepare_seconds: f64) -> String {
    let rate = match r.kernel {
        CaseKernel::AppendKv | CaseKernel::Copy => format!("{:.2} GB/s", r.gbps),
        _ => format!("{:.2} GB/s, {:.2} GFLOP/s", r.gbps, r.gflops),
    };
    format!(
        "bench: {}: {:.3} ms, {rate}, {:.1}% of the roofline ({}), prepared in {prepare_seconds:.1} s",
        r.id,
        r.seconds * 1e3,
        100.0 * r.roofline_fraction,
        r.bound.name()
    )
}
