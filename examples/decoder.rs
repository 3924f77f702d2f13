//! The example decoder.
//!
//! Without arguments: the KV-cache article's toy experiment on the GPU (a 2-layer decoder with
//! seeded random weights generating greedily with and without the KV cache; see
//! `kvattn::decoder::toy`). `--json` prints its results as one object.
//!
//! With `--model PATH`: a Llama-family GGUF model (e.g. SmolLM2-135M-Instruct) generating text
//! through kvattn's kernels, streamed as it is produced.
//!
//! ```text
//! cargo run --release --example decoder [-- --json]
//! cargo run --release --example decoder -- --model SmolLM2-135M-Instruct.Q4_1.gguf \
//!     --prompt "What is the capital of France?" [--raw] [--max-tokens 64] \
//!     [--temperature 0] [--top-k 0] [--top-p 1] [--seed 0] [--kv-dtype f16]
//! ```

use std::io::Write;

use kvattn::decoder::generate::{generate_text, per_step_line, TextOptions};
use kvattn::decoder::load::load_gguf;
use kvattn::decoder::toy::{self, ToyOptions, ToyReport};
use kvattn::gpu::Context;
use kvattn::{Error, Result};

const USAGE: &str = "\
decoder: the KV-cache toy experiment (default) or a GGUF model generating text

  cargo run --release --example decoder [-- --json] [--quick]
  cargo run --release --example decoder -- --model FILE.gguf [--prompt TEXT] [--raw]
      [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--kv-dtype D]

  --json          the toy experiment's results as one JSON object
  --quick         the toy experiment at lengths 64 and 128 with a 256-token prefill
  --model FILE    a Llama-family GGUF file (F32/F16/Q8_0/Q4_0/Q4_1 tensors)
  --prompt TEXT   the user message (default: a question about France)
  --raw           the prompt as is, without the chat template
  --max-tokens N  tokens to generate at most (default 64)
  --temperature T 0 for greedy (default), else sampling with --top-k/--top-p and --seed
  --kv-dtype D    KV cache format: f32, f16 (default), bf16, fp8-e4m3, fp8-e5m2, int8, int4";

/// Command-line options.
#[derive(Debug, Clone)]
struct Opts {
    json: bool,
    quick: bool,
    model: Option<String>,
    text: TextOptions,
}

fn parse() -> Result<Opts> {
    let mut o = Opts {
        json: false,
        quick: false,
        model: None,
        text: TextOptions {
            profile: true,
            ..TextOptions::default()
        },
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bad = |m: String| Error::InvalidArgument(m);
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        match flag {
            "--json" => o.json = true,
            "--quick" => o.quick = true,
            "--raw" => o.text.raw = true,
            "--help" | "-h" => {
                println!("{}", USAGE);
                std::process::exit(0);
            }
            _ => {
                let value = args
                    .get(i + 1)
                    .ok_or_else(|| bad(format!("{flag} needs a value")))?
                    .clone();
                i += 1;
                let num = |what: &str| -> Result<f64> {
                    value
                        .parse::<f64>()
                        .map_err(|_| bad(format!("{what}: {value:?} is not a number")))
                };
                match flag {
                    "--model" => o.model = Some(value.clone()),
                    "--prompt" => o.text.prompt = value.clone(),
                    "--max-tokens" => o.text.max_tokens = num(flag)? as usize,
                    "--temperature" => o.text.sampling.temperature = num(flag)? as f32,
                    "--top-k" => o.text.sampling.top_k = num(flag)? as usize,
                    "--top-p" => o.text.sampling.top_p = num(flag)? as f32,
                    "--seed" => o.text.sampling.seed = num(flag)? as u64,
                    "--kv-dtype" => o.text.kv_dtype = value.parse()?,
                    _ => return Err(bad(format!("unknown flag {flag}; see --help"))),
                }
            }
        }
        i += 1;
    }
    Ok(o)
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

fn toy_json(r: &ToyReport) -> String {
    let lengths: Vec<String> = r
        .lengths
        .iter()
        .map(|l| {
            format!(
                "{{\"length\":{},\"flops_cached\":{},\"flops_uncached\":{},\"seconds_cached\":{},\"seconds_uncached\":{},\"tokens_match\":{},\"max_logit_diff\":{:e}}}",
                l.length, l.flops_cached, l.flops_uncached, l.seconds_cached, l.seconds_uncached,
                l.tokens_match, l.max_logit_diff
            )
        })
        .collect();
    let caches: Vec<String> = r
        .cache_bytes
        .iter()
        .map(|c| {
            format!(
                "\"{}\":{{\"measured\":{},\"formula\":{},\"kv_heads\":{}}}",
                c.name, c.measured, c.formula, c.kv_heads
            )
        })
        .collect();
    let tokens_match = r.lengths.iter().all(|l| l.tokens_match);
    let max_diff = r
        .lengths
        .iter()
        .map(|l| l.max_logit_diff)
        .fold(0.0, f64::max);
    format!(
        "{{\"tokens_match\":{tokens_match},\"max_logit_diff\":{max_diff:e},\"lengths\":[{}],\"cache_bytes\":{{{}}}}}",
        lengths.join(","),
        caches.join(",")
    )
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decoder: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let o = parse()?;
    let ctx = Context::new()?;
    if let Some(path) = &o.model {
        return run_model(&ctx, path, &o.text);
    }
    if !o.json {
        println!(
            "adapter: {} ({})",
            ctx.adapter().name,
            ctx.adapter().backend
        );
        std::io::stdout().flush().ok();
    }
    let mut toy_opts = ToyOptions::default();
    if o.quick {
        toy_opts.lengths = vec![64, 128];
        toy_opts.prefill = 256;
    }
    let report = toy::run(&ctx, &toy_opts)?;
    if o.json {
        println!("{}", toy_json(&report));
    } else {
        print_toy(&report);
        let steps = &report.decode_profile;
        let wall: f64 = steps.iter().map(|p| p.wall_seconds).sum();
        println!(
            "\ndecode: {} tokens in {:.2} s ({:.2} tokens/s), the first length's cached run",
            steps.len(),
            wall,
            steps.len() as f64 / wall.max(1e-9)
        );
        println!("{}", per_step_line(steps));
    }
    Ok(())
}

/// Loads the GGUF model (with a progress bar) and streams its answer.
fn run_model(ctx: &Context, path: &str, opts: &TextOptions) -> Result<()> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {msg} {bar:40} {pos}/{len} tensors")
            .expect("a valid template"),
    );
    bar.set_message(path.to_string());
    let loaded = load_gguf(ctx, path, opts.precision, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    eprintln!(
        "{}: {} layers, {} heads ({} KV) of {}, vocab {}; adapter {} ({}); KV {}",
        path,
        loaded.model.config().layers,
        loaded.model.config().n_heads,
        loaded.model.config().n_kv_heads,
        loaded.model.config().head_dim,
        loaded.model.config().vocab,
        ctx.adapter().name,
        ctx.adapter().backend,
        opts.kv_dtype
    );
    let mut out = std::io::stdout();
    let stats = generate_text(ctx, &loaded, opts, |piece| {
        let _ = out.write_all(piece.as_bytes());
        let _ = out.flush();
    })?;
    println!();
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
    Ok(())
}
