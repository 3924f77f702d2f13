//! The flags of `kvattn serve-bench` and their checked form, [`Settings`] (nothing here needs
//! the GPU).

use std::path::PathBuf;

use kvattn::quant::KvDtype;
use kvattn::serve::Preemption;
use kvattn::Result;

use crate::case::invalid;

/// The concurrencies swept by default.
const CONCURRENCY: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Requests whose prompt and output the default cache holds.
const FIT_REQUESTS: usize = 10;
/// Longest mean gap between Poisson arrivals, in seconds: `--rate` is at least its reciprocal.
const MAX_MEAN_GAP_S: f64 = 60.0;
/// Arguments of `kvattn serve-bench`.
#[derive(clap::Args)]
pub struct ServeBenchArgs {
    /// Requests per run [default: 64; 32 with --quick].
    #[arg(long, value_name = "N")]
    pub(super) requests: Option<usize>,
    /// Prompt tokens per request [default: 64; 32 with --quick].
    #[arg(long, value_name = "P")]
    pub(super) prompt_len: Option<usize>,
    /// Tokens generated per request (EOS ignored) [default: 32; 16 with --quick].
    #[arg(long, value_name = "O")]
    pub(super) output_len: Option<usize>,
    /// When requests arrive: all at once, or a Poisson process of --rate requests/s.
    #[arg(long, value_name = "all|poisson", default_value = "all")]
    pub(super) arrivals: String,
    /// Requests per second of --arrivals poisson: at least 1/60 (a mean gap between arrivals
    /// of at most a minute).
    #[arg(long, value_name = "R")]
    pub(super) rate: Option<f64>,
    /// Leading prompt tokens every request shares (exercises prefix caching).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub(super) shared_prefix: usize,
    /// Seed of the prompts, the arrivals and the toy model's weights.
    #[arg(long, default_value_t = 0)]
    pub(super) seed: u64,
    /// A GGUF Llama model instead of the toy model (2 layers, d_model 128, 8 heads of 16).
    #[arg(long, value_name = "FILE.gguf")]
    pub(super) model: Option<PathBuf>,
    /// KV heads of the toy model: 8 (MHA, default), 4 or 2 (GQA), 1 (MQA).
    #[arg(long, value_name = "N")]
    pub(super) kv_heads: Option<usize>,
    /// Cache storage: f32, f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4.
    #[arg(long, default_value = "f16")]
    pub(super) kv_dtype: String,
    /// Tokens per cache block (a power of two from 1 to 256).
    #[arg(long, default_value_t = 16)]
    pub(super) block_size: usize,
    /// How a running request gives way when the cache is full: swap (its blocks go to host
    /// memory and come back) or recompute (its blocks are freed and its K/V computed again).
    #[arg(long, value_name = "swap|recompute", default_value = "recompute")]
    pub(super) preemption: String,
    /// Tokens per scheduler step (prefill chunks and decode tokens together).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub(super) step_tokens: usize,
    /// Concurrencies to run, comma-separated [default: 1,2,4,8,16,32,64].
    #[arg(long, value_name = "LIST")]
    pub(super) concurrency: Option<String>,
    /// Cache blocks of every run [default: enough for 10 requests' prompt and output].
    #[arg(long, value_name = "B")]
    pub(super) kv_blocks: Option<usize>,
    /// Write the table as CSV to FILE.
    #[arg(long, value_name = "FILE")]
    pub(super) csv: Option<PathBuf>,
    /// Draw throughput and p95 TTFT against concurrency as SVG to FILE.
    #[arg(long, value_name = "FILE")]
    pub(super) svg: Option<PathBuf>,
    /// Print one JSON array (one object per concurrency) instead of the table.
    #[arg(long)]
    pub(super) json: bool,
    /// A short sweep (32 requests of 32 + 16 tokens), well under two minutes on lavapipe.
    #[arg(long)]
    pub(super) quick: bool,
    /// Run the sweep K times (interleaved) and report, for each concurrency, the run with the
    /// median throughput: steadier numbers on a shared machine.
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub(super) repeats: usize,
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Arrivals {
    /// All at time 0.
    All,
    /// A Poisson process of this many requests per second.
    Poisson(f64),
}

/// The checked settings.
#[derive(Clone)]
pub(super) struct Settings {
    pub(super) requests: usize,
    pub(super) prompt_len: usize,
    pub(super) output_len: usize,
    pub(super) arrivals: Arrivals,
    pub(super) shared_prefix: usize,
    pub(super) seed: u64,
    pub(super) kv_dtype: KvDtype,
    pub(super) block_size: usize,
    pub(super) preemption: Preemption,
    pub(super) step_tokens: usize,
    pub(super) concurrency: Vec<usize>,
    pub(super) kv_blocks: usize,
}

impl Settings {
    /// Checks the flags (nothing here needs the GPU).
    pub(super) fn new(args: &ServeBenchArgs) -> Result<Self> {
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
    pub(super) fn blocks_per_request(&self) -> usize {
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
