//! The results of `kvattn bench` as JSON, CSV and a Markdown table, and the ceilings header.

use kvattn::bench::cases::{CaseKernel, Row};
use kvattn::bench::Ceilings;

use crate::output::table::{Align, Table};
use crate::output::{self, csv, json, Value};

type Column = output::Column<Row>;

/// The CSV header, in order: the fields of [`Row`] as it serializes to JSON.
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

/// One JSON array, one object per row: each [`Row`] as serde serializes it (the keys of
/// [`COLUMNS`], in order).
pub fn json(rows: &[Row]) -> String {
    json::array(rows)
}

/// A header line and one line per row.
pub fn csv(rows: &[Row]) -> String {
    csv::rows(rows, &COLUMNS)
}

/// The Markdown table: case, dtype, median ms, MB moved, GB/s, GFLOP/s, fraction of the
/// roofline and its bound; text left-aligned, numbers right-aligned.
pub fn table(rows: &[Row]) -> String {
    use Align::{Left, Right};
    let mut t = Table::new([
        ("case", Left),
        ("dtype", Left),
        ("ms", Right),
        ("KV MB", Right),
        ("GB/s", Right),
        ("GFLOP/s", Right),
        ("roofline", Right),
        ("bound", Left),
    ]);
    for r in rows {
        t.push(vec![
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
        ]);
    }
    t.markdown()
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvattn::bench::cases::{row, Case, Measurement};
    use kvattn::bench::{Ceilings, Trial};
    use kvattn::quant::KvDtype;

    /// The JSON (serde) and the CSV (columns) name the same fields in the same order.
    #[test]
    fn csv_columns_are_the_json_keys() {
        let case = Case::decode(KvDtype::F16, 128);
        let ceilings = Ceilings {
            copy_gbps: 10.0,
            copy_trials: vec![Trial {
                workgroups: 64,
                rate: 10.0,
            }],
            copy_footprint: 1 << 20,
            f32_gflops: 100.0,
            f16_gflops: None,
            timestamps: false,
        };
        let m = Measurement {
            median_seconds: 1e-3,
            min_seconds: 9e-4,
            timestamps: false,
        };
        let r = row(&case, &m, &ceilings);
        let text = json(std::slice::from_ref(&r));
        // Every key once, in column order.
        assert_eq!(text.matches("\": ").count(), COLUMNS.len(), "{text}");
        let at: Vec<usize> = COLUMNS
            .iter()
            .map(|(name, _)| text.find(&format!("\"{name}\": ")).expect(name))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");
        let names: Vec<&str> = COLUMNS.iter().map(|c| c.0).collect();
        let header = csv(&[r]);
        assert!(header.starts_with(&format!("{}\n", names.join(","))));
    }
}
