//! `kvattn serve-bench`: the continuous-batching scheduler under a synthetic load, swept over
//! the concurrency (`seeds/000`, section 6: throughput rises with concurrency until the KV
//! memory caps it; past that, time to first token jumps).
//!
//! Every concurrency runs the same workload (seeded prompts and arrivals) on a fresh cache of
//! the same size, on the wall clock. A concurrency of `C` is `C` clients: at most `C` requests
//! are in flight (sent and not finished), and the scheduler runs at most `C` at once
//! ([`SchedulerConfig::max_running`]). A request is sent when the clock has passed its arrival
//! and a client is free, and its time to first token counts from then, as vLLM's
//! `benchmark_serving --max-concurrency` counts it; the time it was held back by busy clients
//! is reported apart (`ttft_from_arrival_p95_s`). Requests the cache cannot hold wait in the
//! scheduler's queue (a failed admission) or are preempted, and that wait is in the TTFT.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvattn::cache::paged::{PagedKvCache, PoolSize};
use kvattn::decoder::load::load_gguf;
use kvattn::decoder::model::{Decoder, DecoderConfig};
use kvattn::decoder::toy::{random_weights, toy_config};
use kvattn::gpu::Context;
use kvattn::quant::KvDtype;
use kvattn::rng::SplitMix64;
use kvattn::serve::stats::quantile;
use kvattn::serve::{Preemption, Request, RunStats, Scheduler, SchedulerConfig};
use kvattn::shader::Precision;
use kvattn::Result;

use crate::case::invalid;
use crate::columns::{self, Value};
use crate::files::{check_outputs, write_all_or_none};
use crate::plot;

/// The concurrencies swept by default.
const CONCURRENCY: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Requests whose prompt and output the default cache holds.
const FIT_REQUESTS: usize = 10;
/// Longest mean gap between Poisson arrivals, in seconds: `--rate` is at least its reciprocal.
const MAX_MEAN_GAP_S: f64 = 60.0;
/// Steps in a row that process nothing before a run is declared stalled.
const MAX_IDLE_STEPS: usize = 1000;

/// Arguments of `kvattn serve-bench`.
#[derive(clap::Args)]
pub struct ServeBenchArgs {
    /// Requests per run [default: 64; 32 with --quick].
    #[arg(long, value_name = "N")]
    requests: Option<usize>,
    /// Prompt tokens per request [default: 64; 32 with --quick].
    #[arg(long, value_name = "P")]
    prompt_len: Option<usize>,
    /// Tokens generated per request (EOS ignored) [default: 32; 16 with --quick].
    #[arg(long, value_name = "O")]
    output_len: Option<usize>,
    /// When requests arrive: all at once, or a Poisson process of --rate requests/s.
    #[arg(long, value_name = "all|poisson", default_value = "all")]
    arrivals: String,
    /// Requests per second of --arrivals poisson: at least 1/60 (a mean gap between arrivals
    /// of at most a minute).
    #[arg(long, value_name = "R")]
    rate: Option<f64>,
    /// Leading prompt tokens every request shares (exercises prefix caching).
    #[arg(long, value_name = "S", default_value_t = 0)]
    shared_prefix: usize,
    /// Seed of the prompts, the arrivals and the toy model's weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A GGUF Llama model instead of the toy model (2 layers, d_model 128, 8 heads of 16).
    #[arg(long, value_name = "FILE.gguf")]
    model: Option<PathBuf>,
    /// KV heads of the toy model: 8 (MHA, default), 4 or 2 (GQA), 1 (MQA).
    #[arg(long, value_name = "N")]
    kv_heads: Option<usize>,
    /// Cache storage: f32, f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4.
    #[arg(long, default_value = "f16")]
    kv_dtype: String,
    /// Tokens per cache block (a power of two from 1 to 256).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// How a running request gives way when the cache is full: swap (its blocks go to host
    /// memory and come back) or recompute (its blocks are freed and its K/V computed again).
    #[arg(long, value_name = "swap|recompute", default_value = "recompute")]
    preemption: String,
    /// Tokens per scheduler step (prefill chunks and decode tokens together).
    #[arg(long, value_name = "N", default_value_t = 256)]
    step_tokens: usize,
    /// Concurrencies to run, comma-separated [default: 1,2,4,8,16,32,64].
    #[arg(long, value_name = "LIST")]
    concurrency: Option<String>,
    /// Cache blocks of every run [default: enough for 10 requests' prompt and output].
    #[arg(long, value_name = "B")]
    kv_blocks: Option<usize>,
    /// Write the table as CSV to FILE.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Draw throughput and p95 TTFT against concurrency as SVG to FILE.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
    /// Print one JSON array (one object per concurrency) instead of the table.
    #[arg(long)]
    json: bool,
    /// A short sweep (32 requests of 32 + 16 tokens), well under two minutes on lavapipe.
    #[arg(long)]
    quick: bool,
    /// Run the sweep K times (interleaved) and report, for each concurrency, the run with the
    /// median throughput: steadier numbers on a shared machine.
    #[arg(long, value_name = "K", default_value_t = 1)]
    repeats: usize,
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Arrivals {
    /// All at time 0.
    All,
    /// A Poisson process of this many requests per second.
    Poisson(f64),
}

/// The checked settings.
#[derive(Clone)]
struct Settings {
    requests: usize,
    prompt_len: usize,
    output_len: usize,
    arrivals: Arrivals,
    shared_prefix: usize,
    seed: u64,
    kv_dtype: KvDtype,
    block_size: usize,
    preemption: Preemption,
    step_tokens: usize,
    concurrency: Vec<usize>,
    kv_blocks: usize,
}

impl Settings {
    /// Checks the flags (nothing here needs the GPU).
    fn new(args: &ServeBenchArgs) -> Result<Self> {
        let pick = |given: Option<usize>, quick: usize, default: usize| {
            given.unwrap_or(if args.quick { quick } else { default })
        };
        let requests = pick(args.requests, 32, 64);
        let prompt_len = pick(args.prompt_len, 32, 64);
        let output_len = pick(args.output_len, 16, 32);
        for (flag, v) in [
            ("--requests", requests),
            ("--prompt-len", prompt_len),
            ("--output-len", output_len),
            ("--step-tokens", args.step_tokens),
            ("--repeats", args.repeats),
        ] {
            if v == 0 {
                return Err(invalid(format!("{flag} must be at least 1")));
            }
        }
        if args.shared_prefix > prompt_len {
            return Err(invalid(format!(
                "--shared-prefix {} is longer than the prompt (--prompt-len {prompt_len})",
                args.shared_prefix
            )));
        }
        let arrivals = match (args.arrivals.as_str(), args.rate) {
            ("all", None) => Arrivals::All,
            ("all", Some(_)) => {
                return Err(invalid(
                    "--rate sets the Poisson arrival rate: use it with --arrivals poisson",
                ))
            }
            ("poisson", Some(r)) if r.is_finite() && r >= 1.0 / MAX_MEAN_GAP_S => {
                Arrivals::Poisson(r)
            }
            ("poisson", Some(r)) => {
                return Err(invalid(format!(
                    "--rate {r:?}: give a finite number of requests per second of at least \
                     1/{MAX_MEAN_GAP_S} (a mean gap between arrivals of at most {MAX_MEAN_GAP_S} s)"
                )))
            }
            ("poisson", None) => {
                return Err(invalid(
                    "--arrivals poisson needs --rate R (requests per second)",
                ))
            }
            (other, _) => {
                return Err(invalid(format!(
                    "unknown --arrivals {other:?}; valid: all, poisson"
                )))
            }
        };
        let preemption = match args.preemption.as_str() {
            "swap" => Preemption::Swap,
            "recompute" => Preemption::Recompute,
            other => {
                return Err(invalid(format!(
                    "unknown --preemption {other:?}; valid: swap, recompute"
                )))
            }
        };
        let kv_dtype: KvDtype = args.kv_dtype.parse()?;
        let block_size = args.block_size;
        if !block_size.is_power_of_two() || block_size > 256 {
            return Err(invalid(format!(
                "--block-size {block_size} must be a power of two from 1 to 256"
            )));
        }
        let concurrency = match &args.concurrency {
            Some(list) => parse_concurrency(list)?,
            None => CONCURRENCY.to_vec(),
        };
        let per_request = (prompt_len + output_len).div_ceil(block_size);
        let kv_blocks = args.kv_blocks.unwrap_or(FIT_REQUESTS * per_request);
        if kv_blocks < per_request {
            return Err(invalid(format!(
                "--kv-blocks {kv_blocks} cannot hold one request: {} + {} tokens need {} blocks \
                 of {block_size}",
                prompt_len, output_len, per_request
            )));
        }
        if args.model.is_some() && args.kv_heads.is_some() {
            return Err(invalid(
                "--kv-heads shapes the toy model; a --model file has its own KV heads",
            ));
        }
        Ok(Self {
            requests,
            prompt_len,
            output_len,
            arrivals,
            shared_prefix: args.shared_prefix,
            seed: args.seed,
            kv_dtype,
            block_size,
            preemption,
            step_tokens: args.step_tokens,
            concurrency,
            kv_blocks,
        })
    }

    /// Blocks one request's prompt and output take.
    fn blocks_per_request(&self) -> usize {
        (self.prompt_len + self.output_len).div_ceil(self.block_size)
    }
}

/// `1,2,4`: positive integers, in any order, each once.
fn parse_concurrency(list: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.split(',') {
        let v: usize = part.trim().parse().map_err(|_| {
            invalid(format!(
                "--concurrency {list:?}: {part:?} is not a positive integer"
            ))
        })?;
        if v == 0 {
            return Err(invalid(format!(
                "--concurrency {list:?}: a concurrency must be at least 1"
            )));
        }
        if out.contains(&v) {
            return Err(invalid(format!(
                "--concurrency {list:?}: {v} is given twice"
            )));
        }
        out.push(v);
    }
    Ok(out)
}

/// The requests of every run: prompts and arrival times (seconds from the run's start).
struct Workload {
    prompts: Vec<Vec<u32>>,
    arrivals: Vec<f64>,
}

impl Workload {
    /// Random tokens below `vocab`; the first `shared_prefix` the same in every prompt. Poisson
    /// arrivals start at 0 and are spaced by exponential gaps of mean `1 / rate`.
    fn new(s: &Settings, vocab: usize) -> Self {
        let mut r = SplitMix64::new(s.seed ^ 0x5EED_5E4E_BE4C);
        let token = |r: &mut SplitMix64| (r.next_u64() % vocab as u64) as u32;
        let prefix: Vec<u32> = (0..s.shared_prefix).map(|_| token(&mut r)).collect();
        let prompts = (0..s.requests)
            .map(|_| {
                let mut p = prefix.clone();
                p.extend((s.shared_prefix..s.prompt_len).map(|_| token(&mut r)));
                p
            })
            .collect();
        let mut t = 0.0;
        let arrivals = (0..s.requests)
            .map(|i| match s.arrivals {
                Arrivals::All => 0.0,
                Arrivals::Poisson(rate) => {
                    if i > 0 {
                        t += -r.uniform_open().ln() / rate;
                    }
                    t
                }
            })
            .collect();
        Self { prompts, arrivals }
    }
}

/// `seconds` as a [`Duration`] without a panic: NaN and negative as zero, beyond its range as
/// its maximum.
fn duration(seconds: f64) -> Duration {
    Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX)
}

/// One concurrency's results.
struct Row {
    concurrency: usize,
    stats: RunStats,
    /// p95 of the first token's time from the request's arrival (client wait included).
    ttft_from_arrival_p95_s: f64,
    /// Wall seconds of the run.
    wall_s: f64,
}

/// The GGUF model of `--model`, or the toy model `toy` with weights seeded by `--seed`; f32
/// attention either way.
fn load_model(ctx: &Context, args: &ServeBenchArgs, toy: &DecoderConfig) -> Result<Decoder> {
    match &args.model {
        Some(path) => Ok(load_gguf(ctx, path, Precision::F32, |_, _| {})?.model),
        None => Decoder::upload(ctx, *toy, &random_weights(toy, args.seed), Precision::F32),
    }
}

/// Runs the workload at `concurrency` on a fresh cache of `s.kv_blocks` blocks, on the wall
/// clock.
fn run_once(
    ctx: &Context,
    model: &Decoder,
    s: &Settings,
    w: &Workload,
    concurrency: usize,
) -> Result<Row> {
    let mut kv = model.config().kv_config(s.kv_dtype);
    kv.block_size = s.block_size;
    let mut cache = PagedKvCache::new(ctx, kv, PoolSize::Blocks(s.kv_blocks))?;
    let mut sched = Scheduler::new(SchedulerConfig {
        max_step_tokens: s.step_tokens,
        max_running: concurrency,
        preemption: s.preemption,
        eos: None,
    })?;
    let n = w.prompts.len();
    let start = Instant::now();
    let clock = || start.elapsed().as_secs_f64();
    // When each client is free, earliest first: finishing times only grow, so a queue stays
    // sorted.
    let mut free: VecDeque<f64> = std::iter::repeat_n(0.0, concurrency).collect();
    let mut next = 0;
    let mut seen = 0;
    let mut idle = 0;
    loop {
        let now = clock();
        while next < n && w.arrivals[next] <= now {
            let Some(client) = free.pop_front() else {
                break;
            };
            sched.submit(
                &cache,
                Request {
                    id: next as u64,
                    prompt: w.prompts[next].clone(),
                    max_new_tokens: s.output_len,
                    arrival: w.arrivals[next].max(client),
                },
            )?;
            next += 1;
        }
        if next == n && sched.is_done() {
            break;
        }
        let tokens = sched.step(ctx, model, &mut cache, now, clock)?;
        for f in &sched.finished()[seen..] {
            free.push_back(f.token_times.last().copied().unwrap_or(now));
        }
        seen = sched.finished().len();
        if tokens > 0 {
            idle = 0;
        } else if sched.is_done() && next < n {
            // Nothing runnable: sleep until the next arrival.
            let wait = w.arrivals[next] - clock();
            if wait > 0.0 {
                std::thread::sleep(duration(wait));
            }
        } else {
            idle += 1;
            if idle >= MAX_IDLE_STEPS {
                return Err(invalid(format!(
                    "concurrency {concurrency}: the scheduler stalled with {} requests live and \
                     {} waiting",
                    sched.live(),
                    next - seen - sched.live()
                )));
            }
        }
    }
    let wall_s = start.elapsed().as_secs_f64();
    let finished = sched.finished();
    let from_arrival: Vec<f64> = finished
        .iter()
        .map(|f| {
            f.token_times
                .first()
                .map_or(f64::NAN, |t| t - w.arrivals[f.id as usize])
        })
        .collect();
    Ok(Row {
        concurrency,
        stats: RunStats::new(n, finished, sched.counters()),
        ttft_from_arrival_p95_s: quantile(&from_arrival, 0.95),
        wall_s,
    })
}

/// The table's columns: name and how a row shows it (the first eleven are the JSON keys every
/// consumer may rely on, in this order).
type Column = columns::Column<Row>;

/// A cell as the table shows it: throughputs to 0.1, other floats to 0.001, NaN as `-`.
fn text(value: &Value, name: &str) -> String {
    match value {
        Value::Float(v) if v.is_nan() => "-".into(),
        Value::Float(v) if name.ends_with("tok_s") => format!("{v:.1}"),
        Value::Float(v) => format!("{v:.3}"),
        other => other.csv(),
    }
}

const COLUMNS: [Column; 19] = [
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
fn table(rows: &[Row]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| COLUMNS.iter().map(|(n, get)| text(&get(r), n)).collect())
        .collect();
    let widths: Vec<usize> = COLUMNS
        .iter()
        .enumerate()
        .map(|(i, (n, _))| cells.iter().map(|c| c[i].len()).fold(n.len(), usize::max))
        .collect();
    let line = |row: Vec<String>| {
        row.iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let mut out = line(COLUMNS.iter().map(|c| c.0.to_string()).collect());
    out.push('\n');
    for c in cells {
        out.push_str(&line(c));
        out.push('\n');
    }
    out
}

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
        std::fs::metadata(path)
            .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
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
    let arrivals = match s.arrivals {
        Arrivals::All => "all at 0".to_string(),
        Arrivals::Poisson(r) => format!("poisson {r}/s"),
    };
    let header = [
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
            if args.repeats > 1 {
                format!(", median-throughput run of {}", args.repeats)
            } else {
                String::new()
            }
        ),
    ];
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
            eprintln!(
                "serve-bench: {}concurrency {concurrency}: {}/{} requests, {:.1} tok/s, p95 \
                 TTFT {:.3} s, {} preemptions ({:.1} s)",
                if args.repeats > 1 {
                    format!("run {}/{}, ", repeat + 1, args.repeats)
                } else {
                    String::new()
                },
                row.stats.completed,
                row.stats.requested,
                row.stats.throughput_tok_s,
                row.stats.ttft_p95_s,
                row.stats.preemptions,
                row.wall_s
            );
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
        print!("{}", columns::json(&rows, &COLUMNS));
    } else {
        println!();
        print!("{}", table(&rows));
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
        files.push((p.as_path(), columns::csv(&rows, &COLUMNS)));
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
