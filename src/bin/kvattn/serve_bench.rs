//! `kvattn serve-bench`: the continuous-batching scheduler under a synthetic load, swept over
//! the concurrency (`seeds/000`, section 6: throughput rises with concurrency until the KV
//! memory caps it; past that, time to first token jumps).
//!
//! Every concurrency runs the same workload (seeded prompts and arrivals) on a fresh cache of
//! the same size, on the wall clock. A concurrency of `C` is `C` clients: at most `C` requests
//! are in flight (sent and not finished), and the scheduler runs at most `C` at once
//! ([`SchedulerConfig::max_running`](kvattn::serve::SchedulerConfig::max_running)). A request is sent when the clock has passed its arrival
//! and a client is free, and its time to first token counts from then, as vLLM's
//! `benchmark_serving --max-concurrency` counts it; the time it was held back by busy clients
//! is reported apart (`ttft_from_arrival_p95_s`). Requests the cache cannot hold wait in the
//! scheduler's queue (a failed admission) or are preempted, and that wait is in the TTFT.

mod args;
mod plot;
mod report;
mod workload;

use std::path::Path;
use std::time::Instant;

use kvattn::decoder::toy::toy_config;
use kvattn::gpu::Context;
use kvattn::Result;

pub use args::ServeBenchArgs;

use crate::case::invalid;
use crate::files::{check_outputs, write_all_or_none};
use args::Settings;
use workload::{load_model, run_once, Row, Workload};

/// Runs the sweep and prints the table (or JSON); writes the CSV and SVG files last, only when
/// every run completed every request without a failed append.
pub fn run(args: &ServeBenchArgs) -> Result<()> {
    let s = Settings::new(args)?;
    let outputs: Vec<(&str, &Path)> = [("--csv", &args.csv), ("--svg", &args.svg)]
        .into_iter()
        .filter_map(|(flag, p)| p.as_deref().map(|p| (flag, p)))
        .collect();
    let model: Vec<(&str, &Path)> = args
        .model
        .as_deref()
        .map(|p| ("--model", p))
        .into_iter()
        .collect();
    check_outputs(&outputs, &model)?;
    let toy = toy_config(args.kv_heads.unwrap_or(8));
    if args.model.is_none() {
        toy.validate()
            .map_err(|e| invalid(format!("--kv-heads: {e}")))?;
    }
    if let Some(path) = &args.model {
        std::fs::metadata(path).map_err(|source| kvattn::Error::Io {
            what: format!("cannot read {}", path.display()),
            source,
        })?;
    }
    let sweep_start = Instant::now();
    let ctx = Context::new()?;
    let a = ctx.adapter();
    let adapter = format!("{} ({}, {})", a.name, a.backend, a.device_type);
    let model = load_model(&ctx, args, &toy)?;
    let c = *model.config();
    let w = Workload::new(&s, c.vocab);
    let model_name = match &args.model {
        Some(p) => p.display().to_string(),
        None => "toy".to_string(),
    };
    let header = report::header(&adapter, &model_name, &c, &s, args.repeats);
    for line in &header {
        if args.json {
            eprintln!("serve-bench: {line}");
        } else {
            println!("{line}");
        }
    }
    // Compile every pipeline before timing: two short requests through a tiny run.
    let warm = Workload {
        prompts: w.prompts.iter().take(2).cloned().collect(),
        arrivals: vec![0.0; w.prompts.len().min(2)],
    };
    let short = Settings {
        output_len: 2,
        ..s.clone()
    };
    run_once(&ctx, &model, &short, &warm, 2)?;
    let mut runs: Vec<Vec<Row>> = s.concurrency.iter().map(|_| Vec::new()).collect();
    for repeat in 0..args.repeats {
        for (&concurrency, runs) in s.concurrency.iter().zip(&mut runs) {
            let row = run_once(&ctx, &model, &s, &w, concurrency)?;
            eprintln!("{}", report::progress(&row, repeat, args.repeats));
            runs.push(row);
        }
    }
    // Per concurrency, the run of median throughput (the lower one of an even count).
    let rows: Vec<Row> = runs
        .into_iter()
        .map(|mut r| {
            r.sort_by(|a, b| {
                a.stats
                    .throughput_tok_s
                    .total_cmp(&b.stats.throughput_tok_s)
            });
            r.swap_remove((r.len() - 1) / 2)
        })
        .collect();
    if args.json {
        print!("{}", report::json(&rows));
    } else {
        println!();
        print!("{}", report::table(&rows));
    }
    eprintln!(
        "serve-bench: sweep took {:.1} s",
        sweep_start.elapsed().as_secs_f64()
    );
    for r in &rows {
        if r.stats.failed_appends != 0 {
            return Err(invalid(format!(
                "concurrency {}: {} appends failed (the scheduler must prevent every one)",
                r.concurrency, r.stats.failed_appends
            )));
        }
        if r.stats.completed != r.stats.requested {
            return Err(invalid(format!(
                "concurrency {}: {} of {} requests completed",
                r.concurrency, r.stats.completed, r.stats.requested
            )));
        }
    }
    let mut files = Vec::new();
    if let Some(p) = &args.csv {
        files.push((p.as_path(), report::csv(&rows)));
    }
    if let Some(p) = &args.svg {
        let points: Vec<plot::Point> = rows
            .iter()
            .map(|r| plot::Point {
                concurrency: r.concurrency,
                throughput: r.stats.throughput_tok_s,
                ttft_p95: r.stats.ttft_p95_s,
            })
            .collect();
        let title = format!(
            "{model_name}, {} requests of {} + {} tokens, {} KV blocks of {}",
            s.requests, s.prompt_len, s.output_len, s.kv_blocks, s.block_size
        );
        let svg = plot::svg(&points, &title, s.kv_blocks / s.blocks_per_request())
            .map_err(|e| invalid(format!("cannot draw {}: {e}", p.display())))?;
        files.push((p.as_path(), svg));
    }
    write_all_or_none(&files)
}
