//! What each KV storage format costs a real model: a fixed text (at least 1,000 tokens) fed
//! teacher-forced through a GGUF model in prefill chunks, once per format in lockstep (one
//! cache per format, each chunk attending to everything before it in that format), and every
//! position's next-token distribution compared with the f16-KV run's: greedy-token agreement
//! and mean `KL(P_f16 || P_format)` (softmax in f64), per context slice (positions 0-128,
//! 128-512, 512+) and overall. See `kvattn::decoder::quality`.
//!
//! ```text
//! cargo run --release --features decoder --example kv_quality -- \
//!     --model SmolLM2-135M-Instruct.Q4_1.gguf [--text FILE] [--chunk 64] [--json]
//! ```
//!
//! `--json` prints one array of rows (`examples/common`: NaN and infinities are `null` beside a
//! `<field>_non_finite` field).

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

use kvattn::cache::paged::{PagedKvCache, PoolSize};
use kvattn::decoder::load::load_gguf;
use kvattn::decoder::model::Logits;
use kvattn::decoder::quality::{QualityStats, ReferenceRows, SliceStats, SLICES};
use kvattn::gpu::Context;
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;
use kvattn::{Error, Result};

mod common;
use common::Object;

/// The default text, next to this example.
const DEFAULT_TEXT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/kv_quality.txt");

/// The fewest tokens a text must have.
const MIN_TOKENS: usize = 1000;

/// The reference format.
const REFERENCE: KvDtype = KvDtype::F16;

/// Greedy-token agreement and KL divergence of each KV format against f16 KV on a real model.
///
/// A fixed text (at least 1,000 tokens) is fed teacher-forced through the model in prefill
/// chunks, once per KV format in lockstep, and every position's next-token distribution is
/// compared with the f16-KV run's, per context slice (0-128, 128-512, 512+) and overall.
#[derive(Debug, Parser)]
#[command(name = "kv_quality")]
struct Args {
    /// A Llama-family GGUF file (tensors F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
    #[arg(long, value_name = "FILE")]
    model: PathBuf,
    /// The text to feed, at least 1,000 tokens [default: examples/data/kv_quality.txt]
    #[arg(long, value_name = "FILE", default_value = DEFAULT_TEXT, hide_default_value = true)]
    text: PathBuf,
    /// Prefill chunk in tokens
    #[arg(long, value_name = "N", default_value = "64")]
    chunk: NonZeroUsize,
    /// One JSON array of {kv_dtype, slice, tokens, agreement, mean_kl}
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_quality: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One format's run: its cache and its statistics against the reference.
struct Run {
    dtype: KvDtype,
    cache: PagedKvCache,
    stats: QualityStats,
}

fn run(o: &Args) -> Result<()> {
    let model_path = o.model.display();
    if !o.model.is_file() {
        return Err(Error::InvalidArgument(format!(
            "the model file {model_path} does not exist"
        )));
    }
    let text_path = o.text.display();
    let text = std::fs::read_to_string(&o.text).map_err(|e| {
        Error::InvalidArgument(format!("cannot read the text file {text_path}: {e}"))
    })?;
    let chunk_len = o.chunk.get();

    let t_start = Instant::now();
    let ctx = Context::new()?;
    let adapter = format!("{} ({})", ctx.adapter().name, ctx.adapter().backend);
    eprintln!("adapter: {adapter}; loading {model_path}");
    let loaded = load_gguf(&ctx, &o.model, Precision::F32, |_, _| {})?;
    let load_seconds = t_start.elapsed().as_secs_f64();
    let model = &loaded.model;
    let c = *model.config();
    let ids = loaded.tokenizer.encode_prompt(&text);
    if ids.len() < MIN_TOKENS {
        return Err(Error::InvalidArgument(format!(
            "the text {text_path} has {} tokens with this tokenizer; at least {MIN_TOKENS} are needed",
            ids.len()
        )));
    }

    // The reference first, then every other format in code order, each in its own cache.
    let dtypes: Vec<KvDtype> = std::iter::once(REFERENCE)
        .chain(KvDtype::ALL.into_iter().filter(|&d| d != REFERENCE))
        .collect();
    let seq = 0;
    let mut runs = dtypes
        .iter()
        .map(|&dtype| {
            let kv = c.kv_config(dtype);
            let blocks = ids.len().div_ceil(kv.block_size) + 1;
            let mut cache = PagedKvCache::new(&ctx, kv, PoolSize::Blocks(blocks))?;
            cache.add_sequence(seq, &[])?;
            Ok(Run {
                dtype,
                cache,
                stats: QualityStats::default(),
            })
        })
        .collect::<Result<Vec<_>>>()?;

    let t_measure = Instant::now();
    let chunks = ids.len().div_ceil(chunk_len);
    for (k, chunk) in ids.chunks(chunk_len).enumerate() {
        let first = k * chunk_len;
        let (reference, others) = runs.split_first_mut().expect("the reference run");
        let ref_logits = model
            .forward_with(&ctx, &mut reference.cache, &[(seq, chunk)], Logits::All)?
            .logits;
        let rows = ReferenceRows::new(first, &ref_logits, c.vocab)?;
        reference.stats.add(&rows, &ref_logits)?;
        for r in others.iter_mut() {
            let logits = model
                .forward_with(&ctx, &mut r.cache, &[(seq, chunk)], Logits::All)?
                .logits;
            r.stats
                .add(&rows, &logits)
                .map_err(|e| Error::InvalidArgument(format!("KV {}: {e}", r.dtype)))?;
        }
        eprintln!(
            "chunk {}/{chunks}: positions {first}..{} done, {:.1} s",
            k + 1,
            first + chunk.len(),
            t_measure.elapsed().as_secs_f64()
        );
    }
    let measure_seconds = t_measure.elapsed().as_secs_f64();

    if o.json {
        common::print(to_json(&runs));
    } else {
        print_table(&runs);
        println!();
        println!(
            "model: {model_path} ({} layers, {} heads ({} KV) of {}, vocab {})",
            c.layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab
        );
        println!("adapter: {adapter}");
        println!(
            "text: {text_path} ({} tokens, prefill chunks of {}, {} formats in lockstep)",
            ids.len(),
            chunk_len,
            runs.len()
        );
        println!(
            "wall time: {:.1} s measuring, {:.1} s loading",
            measure_seconds, load_seconds
        );
    }
    Ok(())
}

/// "99.2% / 1.3e-4".
fn cell(s: &SliceStats) -> String {
    format!("{:.1}% / {:.1e}", 100.0 * s.agreement(), s.mean_kl())
}

fn print_table(runs: &[Run]) {
    let tokens = |i: usize| runs[0].stats.slices[i].tokens;
    let mut header = String::from("| KV |");
    let mut rule = String::from("|---|");
    for (i, s) in SLICES.iter().enumerate() {
        header += &format!(" {} ({} tokens) |", s.name(), tokens(i));
        rule += "---:|";
    }
    header += &format!(" all ({} tokens) |", runs[0].stats.overall().tokens);
    rule += "---:|";
    println!("greedy-token agreement with f16 KV / mean KL(P_f16 || P_format) in nats\n");
    println!("{header}\n{rule}");
    for r in runs.iter().skip(1) {
        let mut row = format!("| {} |", r.dtype);
        for s in &r.stats.slices {
            row += &format!(" {} |", cell(s));
        }
        row += &format!(" {} |", cell(&r.stats.overall()));
        println!("{row}");
    }
}

/// One row per format (the reference excepted) and slice, then the format's overall row.
fn to_json(runs: &[Run]) -> Vec<Object> {
    let mut rows = Vec::new();
    for r in runs.iter().skip(1) {
        let named = SLICES
            .iter()
            .map(|s| s.name())
            .zip(r.stats.slices)
            .chain(std::iter::once(("all".to_string(), r.stats.overall())));
        for (slice, s) in named {
            rows.push(
                Object::new()
                    .set("kv_dtype", r.dtype.name())
                    .set("slice", slice)
                    .set("tokens", s.tokens)
                    .set("agreement", s.agreement())
                    .set("mean_kl", s.mean_kl()),
            );
        }
    }
    rows
}
