//! The example decoder.
//!
//! Without arguments: the KV-cache article's toy experiment on the GPU (a 2-layer decoder with
//! seeded random weights generating greedily with and without the KV cache; see
//! `kvattn::decoder::toy`). `--json` prints its results as one object (`examples/common`: NaN
//! and infinities are `null` beside a `<field>_non_finite` field).
//!
//! With `--model PATH`: a Llama-family GGUF model (e.g. SmolLM2-135M-Instruct) generating text
//! through kvattn's kernels, streamed as it is produced.
//!
//! ```text
//! cargo run --release --features decoder --example decoder [-- --json] [--quick]
//! cargo run --release --features decoder --example decoder -- \
//!     --model SmolLM2-135M-Instruct.Q4_1.gguf --prompt "What is the capital of France?" \
//!     [--raw] [--max-tokens 64] [--temperature 0] [--top-k 0] [--top-p 1] [--seed 0] \
//!     [--kv-dtype f16] [--profile-ops]
//! ```
//!
//! `--profile-ops` records each op of a decode step in a compute pass of its own and prints
//! where the step's device time goes (median milliseconds per step by op), on adapters with
//! timestamps.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use kvattn::decoder::generate::{generate_text, op_table, per_step_line, TextOptions};
use kvattn::decoder::load::load_gguf;
use kvattn::decoder::sampling::Sampling;
use kvattn::decoder::toy::{self, ToyOptions, ToyReport};
use kvattn::gpu::Context;
use kvattn::quant::KvDtype;
use kvattn::Result;

mod common;
use common::Object;

/// The example decoder: the KV-cache toy experiment (default) or a GGUF model generating text.
///
/// Without --model: a 2-layer decoder with seeded random weights generates greedily with and
/// without the paged KV cache on the GPU (no download). With --model: a Llama-family GGUF
/// model answers --prompt through kvattn's kernels, streamed as it is produced.
#[derive(Debug, Parser)]
#[command(name = "decoder")]
struct Args {
    /// Print the toy experiment's results as one JSON object (NaN and infinities: null and a
    /// `<field>_non_finite` field)
    #[arg(long, conflicts_with = "model")]
    json: bool,
    /// The toy experiment at lengths 64 and 128 with a 256-token prefill
    #[arg(long, conflicts_with = "model")]
    quick: bool,
    /// A Llama-family GGUF file (tensors F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) to generate text with
    #[arg(long, value_name = "FILE")]
    model: Option<PathBuf>,
    /// The user message
    #[arg(long, value_name = "TEXT", requires = "model", default_value_t = TextOptions::default().prompt)]
    prompt: String,
    /// Use the prompt as is, without the chat template
    #[arg(long, requires = "model")]
    raw: bool,
    /// Tokens to generate at most
    #[arg(long, value_name = "N", requires = "model", default_value_t = TextOptions::default().max_tokens)]
    max_tokens: usize,
    /// 0 for greedy, else sampling with --top-k, --top-p and --seed
    #[arg(long, value_name = "T", requires = "model", default_value_t = Sampling::default().temperature)]
    temperature: f32,
    /// Keep the K most likely tokens when sampling (0: all)
    #[arg(long, value_name = "K", requires = "model", default_value_t = Sampling::default().top_k)]
    top_k: usize,
    /// Keep the most likely tokens up to probability P when sampling (1: all)
    #[arg(long, value_name = "P", requires = "model", default_value_t = Sampling::default().top_p)]
    top_p: f32,
    /// Seed of the sampling draws
    #[arg(long, value_name = "S", requires = "model", default_value_t = Sampling::default().seed)]
    seed: u64,
    /// KV cache format: f32, f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4
    #[arg(long, value_name = "D", requires = "model", default_value_t = TextOptions::default().kv_dtype)]
    kv_dtype: KvDtype,
    /// Time each op of the decode steps in a compute pass of its own and print where a step's
    /// device time goes (adapters with timestamps)
    #[arg(long, requires = "model")]
    profile_ops: bool,
}

impl Args {
    /// The generation options of `--model`, with every decode step profiled.
    fn text_options(&self) -> TextOptions {
        TextOptions {
            prompt: self.prompt.clone(),
            raw: self.raw,
            max_tokens: self.max_tokens,
            sampling: Sampling {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
            },
            kv_dtype: self.kv_dtype,
            profile: true,
            profile_ops: self.profile_ops,
            ..TextOptions::default()
        }
    }
}

fn print_toy(r: &ToyReport) {
    println!("\nKV cache on the GPU: the article's toy experiment");
    println!("(2 layers, d_model 128, 8 heads of 16, MLP 512, vocab 512, f32, seeded random");
    println!(" weights, a 32-token random prompt, greedy decoding)\n");
    println!("| length | tokens match | max logit diff | GFLOP cached | GFLOP uncached | s cached | s uncached |");
    println!("|---:|:---:|---:|---:|---:|---:|---:|");
    for l in &r.lengths {
        println!(
            "| {} | {} | {:.1e} | {:.4} | {:.3} | {:.2} | {:.2} |",
            l.length,
            if l.tokens_match { "yes" } else { "NO" },
            l.max_logit_diff,
            l.flops_cached as f64 / 1e9,
            l.flops_uncached as f64 / 1e9,
            l.seconds_cached,
            l.seconds_uncached
        );
    }
    for w in r.lengths.windows(2) {
        println!(
            "{} -> {}: FLOPs x{:.2} uncached, x{:.2} cached",
            w[0].length,
            w[1].length,
            w[1].flops_uncached as f64 / w[0].flops_uncached as f64,
            w[1].flops_cached as f64 / w[0].flops_cached as f64
        );
    }
    if let Some(last) = r.lengths.last() {
        println!(
            "\nMedian step time per 64-token window, length {}:",
            last.length
        );
        println!("| positions | cached ms | uncached ms |");
        println!("|---|---:|---:|");
        for &(start, a, b) in &last.windows {
            println!(
                "| {start}..{} | {:.2} | {:.2} |",
                start + 64,
                a * 1e3,
                b * 1e3
            );
        }
    }
    println!("\nCache bytes after the prefill (f32 KV):");
    println!("| layout | KV heads | measured | 2 x layers x kv_heads x head_dim x tokens x 4 | last logits cached = recomputed (1e-3) |");
    println!("|---|---:|---:|---:|:---:|");
    for c in &r.cache_bytes {
        println!(
            "| {} | {} | {} | {} | {} |",
            c.name,
            c.kv_heads,
            c.measured,
            c.formula,
            if c.logits_agree { "yes" } else { "NO" }
        );
    }
}

/// The toy experiment's results as one JSON object.
fn toy_json(r: &ToyReport) -> Object {
    let lengths: Vec<Object> = r
        .lengths
        .iter()
        .map(|l| {
            let windows: Vec<Object> = l
                .windows
                .iter()
                .map(|&(start, cached, uncached)| {
                    Object::new()
                        .set("start", start)
                        .set("end", start + 64)
                        .set("seconds_cached", cached)
                        .set("seconds_uncached", uncached)
                })
                .collect();
            Object::new()
                .set("length", l.length)
                .set("flops_cached", l.flops_cached)
                .set("flops_uncached", l.flops_uncached)
                .set("seconds_cached", l.seconds_cached)
                .set("seconds_uncached", l.seconds_uncached)
                .set("tokens_match", l.tokens_match)
                .set("max_logit_diff", l.max_logit_diff)
                .set("windows", windows)
        })
        .collect();
    let caches = r.cache_bytes.iter().fold(Object::new(), |o, c| {
        let layout = Object::new()
            .set("measured", c.measured)
            .set("formula", c.formula)
            .set("kv_heads", c.kv_heads)
            .set("logits_agree", c.logits_agree);
        o.set(c.name, layout)
    });
    let (tokens, seconds) = decode_totals(r);
    // The largest difference; a NaN anywhere makes it NaN (f64::max would skip it).
    let max_diff = r
        .lengths
        .iter()
        .map(|l| l.max_logit_diff)
        .fold(0.0, |m: f64, d| {
            if m.is_nan() || d.is_nan() {
                f64::NAN
            } else {
                m.max(d)
            }
        });
    Object::new()
        .set("tokens_match", r.lengths.iter().all(|l| l.tokens_match))
        .set("max_logit_diff", max_diff)
        .set("lengths", lengths)
        .set("cache_bytes", caches)
        .set(
            "decode",
            Object::new()
                .set("tokens", tokens)
                .set("seconds", seconds)
                .set("tokens_per_second", tokens as f64 / seconds),
        )
}

/// Decode steps of the first length's cached run and their wall-clock seconds.
fn decode_totals(r: &ToyReport) -> (usize, f64) {
    let steps = &r.decode_profile;
    (steps.len(), steps.iter().map(|p| p.wall_seconds).sum())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decoder: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<()> {
    let ctx = Context::new()?;
    if let Some(path) = &args.model {
        return run_model(&ctx, path, &args.text_options());
    }
    if !args.json {
        println!(
            "adapter: {} ({})",
            ctx.adapter().name,
            ctx.adapter().backend
        );
        std::io::stdout().flush().ok();
    }
    let mut toy_opts = ToyOptions::default();
    if args.quick {
        toy_opts.lengths = vec![64, 128];
        toy_opts.prefill = 256;
    }
    let report = toy::run(&ctx, &toy_opts)?;
    if args.json {
        common::print(toy_json(&report));
    } else {
        print_toy(&report);
        let (tokens, wall) = decode_totals(&report);
        println!(
            "\ndecode: {} tokens in {:.2} s ({:.2} tokens/s), the first length's cached run",
            tokens,
            wall,
            tokens as f64 / wall.max(1e-9)
        );
        println!("{}", per_step_line(&report.decode_profile));
    }
    Ok(())
}

/// Loads the GGUF model (with a progress bar) and streams its answer.
fn run_model(ctx: &Context, path: &Path, opts: &TextOptions) -> Result<()> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {msg} {bar:40} {pos}/{len} tensors")
            .expect("a valid template"),
    );
    bar.set_message(path.display().to_string());
    let loaded = load_gguf(ctx, path, opts.precision, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    eprintln!(
        "{}: {} layers, {} heads ({} KV) of {}, vocab {}; adapter {} ({}); KV {}",
        path.display(),
        loaded.model.config().layers,
        loaded.model.config().n_heads,
        loaded.model.config().n_kv_heads,
        loaded.model.config().head_dim,
        loaded.model.config().vocab,
        ctx.adapter().name,
        ctx.adapter().backend,
        opts.kv_dtype
    );
    eprintln!(
        "weights on the GPU: {:.1} MB",
        loaded.model.weight_bytes() as f64 / 1e6
    );
    let mut out = std::io::stdout();
    let stats = generate_text(ctx, &loaded, opts, |piece| {
        let _ = out.write_all(piece.as_bytes());
        let _ = out.flush();
    })?;
    println!();
    eprintln!(
        "warm-up (the prefill's and the decode step's pipelines): {:.2} s",
        stats.warmup_seconds
    );
    eprintln!(
        "prefill: {} tokens in {:.2} s ({:.1} tokens/s); decode: {} tokens in {:.2} s ({:.2} tokens/s)",
        stats.prefill_tokens,
        stats.prefill_seconds,
        stats.prefill_tokens as f64 / stats.prefill_seconds,
        stats.decode_tokens,
        stats.decode_seconds,
        stats.decode_tokens as f64 / stats.decode_seconds.max(1e-9)
    );
    eprintln!("{}", per_step_line(&stats.decode_profile));
    if opts.profile_ops {
        if stats.decode_profile.is_empty() {
            eprintln!("no per-op profile: no decode step ran");
        } else if stats.op_profile.is_empty() {
            eprintln!("no per-op profile: the adapter has no timestamps");
        } else {
            eprintln!(
                "device time per decode step by op (a pass per op; medians over {} steps):",
                stats.decode_profile.len()
            );
            for line in op_table(&stats.op_profile) {
                eprintln!("  {line}");
            }
        }
    }
    Ok(())
}
