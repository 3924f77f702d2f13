//! The work of one run: the seeded prompts and arrival times every concurrency serves, the
//! model, and one run of the scheduler on the wall clock.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvattn::cache::paged::{PagedKvCache, PoolSize};
use kvattn::decoder::load::load_gguf;
use kvattn::decoder::model::{Decoder, DecoderConfig};
use kvattn::decoder::toy::random_weights;
use kvattn::gpu::Context;
use kvattn::rng::SplitMix64;
use kvattn::serve::stats::quantile;
use kvattn::serve::{Request, RunStats, Scheduler, SchedulerConfig};
use kvattn::shader::Precision;
use kvattn::Result;

use super::args::{Arrivals, ServeBenchArgs, Settings};
use crate::case::invalid;

/// Steps in a row that process nothing before a run is declared stalled.
const MAX_IDLE_STEPS: usize = 1000;

/// The requests of every run: prompts and arrival times (seconds from the run's start).
pub(super) struct Workload {
    pub(super) prompts: Vec<Vec<u32>>,
    pub(super) arrivals: Vec<f64>,
}

impl Workload {
    /// Random tokens below `vocab`; the first `shared_prefix` the same in every prompt. Poisson
    /// arrivals start at 0 and are spaced by exponential gaps of mean `1 / rate`.
    pub(super) fn new(s: &Settings, vocab: usize) -> Self {
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
pub(super) struct Row {
    pub(super) concurrency: usize,
    pub(super) stats: RunStats,
    /// p95 of the first token's time from the request's arrival (client wait included).
    pub(super) ttft_from_arrival_p95_s: f64,
    /// Wall seconds of the run.
    pub(super) wall_s: f64,
}

/// The GGUF model of `--model`, or the toy model `toy` with weights seeded by `--seed`; f32
/// attention either way.
pub(super) fn load_model(
    ctx: &Context,
    args: &ServeBenchArgs,
    toy: &DecoderConfig,
) -> Result<Decoder> {
    match &args.model {
        Some(path) => Ok(load_gguf(ctx, path, Precision::F32, |_, _| {})?.model),
        None => Decoder::upload(ctx, *toy, &random_weights(toy, args.seed), Precision::F32),
    }
}

/// Runs the workload at `concurrency` on a fresh cache of `s.kv_blocks` blocks, on the wall
/// clock.
pub(super) fn run_once(
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
