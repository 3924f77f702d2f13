//! What `kvattn serve-bench` prints and writes: the table, its JSON and CSV (one list of
//! columns), the header lines and the progress line of each run.

use kvattn::decoder::model::DecoderConfig;

use super::args::{Arrivals, Settings};
use super::workload::Row;
use crate::output::table::{Align, Table};
use crate::output::{self, csv, json, Value};

/// The table's columns: name and how a row shows it (the first eleven are the JSON keys every
/// consumer may rely on, in this order).
type Column = output::Column<Row>;

/// A cell as the table shows it: throughputs to 0.1, other floats to 0.001, NaN as `-`.
fn text(value: &Value, name: &str) -> String {
    match value {
        Value::Float(v) if v.is_nan() => "-".into(),
        Value::Float(v) if name.ends_with("tok_s") => format!("{v:.1}"),
        Value::Float(v) => format!("{v:.3}"),
        other => other.csv(),
    }
}

pub(super) const COLUMNS: [Column; 19] = [
    ("concurrency", |r| Value::Int(r.concurrency as u64)),
    ("throughput_tok_s", |r| {
        Value::Float(r.stats.throughput_tok_s)
    }),
    ("ttft_p50_s", |r| Value::Float(r.stats.ttft_p50_s)),
    ("ttft_p95_s", |r| Value::Float(r.stats.ttft_p95_s)),
    ("itl_p50_s", |r| Value::Float(r.stats.itl_p50_s)),
    ("itl_p95_s", |r| Value::Float(r.stats.itl_p95_s)),
    ("preemptions", |r| Value::Int(r.stats.preemptions as u64)),
    ("prefix_hit_rate", |r| Value::Float(r.stats.prefix_hit_rate)),
    ("failed_appends", |r| {
        Value::Int(r.stats.failed_appends as u64)
    }),
    ("completed", |r| Value::Int(r.stats.completed as u64)),
    ("requested", |r| Value::Int(r.stats.requested as u64)),
    ("block_util_mean", |r| {
        Value::Float(r.stats.block_utilization_mean)
    }),
    ("block_util_peak", |r| {
        Value::Float(r.stats.block_utilization_peak)
    }),
    ("recomputed_tokens", |r| {
        Value::Int(r.stats.recomputed_tokens as u64)
    }),
    ("failed_admissions", |r| {
        Value::Int(r.stats.failed_admissions as u64)
    }),
    ("ttft_from_arrival_p95_s", |r| {
        Value::Float(r.ttft_from_arrival_p95_s)
    }),
    ("output_tokens", |r| {
        Value::Int(r.stats.output_tokens as u64)
    }),
    ("steps", |r| Value::Int(r.stats.steps as u64)),
    ("seconds", |r| Value::Float(r.wall_s)),
];

/// The table, columns right-aligned to their widest cell.
pub(super) fn table(rows: &[Row]) -> String {
    let mut t = Table::new(COLUMNS.iter().map(|(name, _)| (*name, Align::Right)));
    for r in rows {
        t.push(COLUMNS.iter().map(|(n, get)| text(&get(r), n)).collect());
    }
    t.text("  ")
}

/// The rows as one JSON array, one object per concurrency, keys in [`COLUMNS`] order.
pub(super) fn json(rows: &[Row]) -> String {
    json::columns(rows, &COLUMNS)
}

/// The rows as CSV, the header in [`COLUMNS`] order.
pub(super) fn csv(rows: &[Row]) -> String {
    csv::rows(rows, &COLUMNS)
}

/// The lines above the table: the adapter, the model, the cache and the workload.
pub(super) fn header(
    adapter: &str,
    model_name: &str,
    c: &DecoderConfig,
    s: &Settings,
    repeats: usize,
) -> [String; 4] {
    let arrivals = match s.arrivals {
        Arrivals::All => "all at 0".to_string(),
        Arrivals::Poisson(r) => format!("poisson {r}/s"),
    };
    [
        format!("adapter   {adapter}"),
        format!(
            "model     {model_name}: {} layers, d_model {}, {} heads, {} KV heads of {}, vocab {}",
            c.layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab
        ),
        format!(
            "cache     {} blocks of {} tokens ({} tokens, {} requests of {} + {}), {}, {} \
             preemption, prefix caching",
            s.kv_blocks,
            s.block_size,
            s.kv_blocks * s.block_size,
            s.kv_blocks / s.blocks_per_request(),
            s.prompt_len,
            s.output_len,
            s.kv_dtype.name(),
            s.preemption.name()
        ),
        format!(
            "workload  {} requests, prompt {} ({} shared), output {}, arrivals {arrivals}, \
             seed {}, {} tokens per step{}",
            s.requests,
            s.prompt_len,
            s.shared_prefix,
            s.output_len,
            s.seed,
            s.step_tokens,
            if repeats > 1 {
                format!(", median-throughput run of {repeats}")
            } else {
                String::new()
            }
        ),
    ]
}

/// The line on stderr when run `repeat` (from 0) of `repeats` ends at a concurrency.
pub(super) fn progress(row: &Row, repeat: usize, repeats: usize) -> String {
    format!(
        "serve-bench: {}concurrency {}: {}/{} requests, {:.1} tok/s, p95 TTFT {:.3} s, {} \
         preemptions ({:.1} s)",
        if repeats > 1 {
            format!("run {}/{repeats}, ", repeat + 1)
        } else {
            String::new()
        },
        row.concurrency,
        row.stats.completed,
        row.stats.requested,
        row.stats.throughput_tok_s,
        row.stats.ttft_p95_s,
        row.stats.preemptions,
        row.wall_s
    )
}
