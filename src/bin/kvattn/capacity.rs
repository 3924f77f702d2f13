//! `kvattn capacity`: KV cache bytes for a model, a dtype and a batch, and what fits a budget.

use kvattn::cache::capacity::{
    evaluate, fit_budget, parse_byte_size, BudgetFit, CacheShape, Capacity, CapacityQuery,
    ScaleGranularity,
};
use kvattn::cache::presets::{preset, preset_names, ModelPreset};
use kvattn::quant::KvDtype;
use kvattn::{Error, Result};

/// Arguments of `kvattn capacity`.
#[derive(clap::Args)]
pub struct CapacityArgs {
    /// A model preset: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, qwen2.5-1.5b, qwen2.5-7b,
    /// qwen3-1.7b, qwen3-8b, mistral-7b, deepseek-v2, smollm2-135m. Or give the shape with
    /// --layers and --kv-heads/--head-dim (or --mla-rank/--rope-dim).
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// Transformer layers (explicit shape).
    #[arg(long)]
    layers: Option<usize>,
    /// KV heads per layer (explicit MHA/GQA/MQA shape).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Values per head (explicit MHA/GQA/MQA shape).
    #[arg(long)]
    head_dim: Option<usize>,
    /// Latent width per layer (explicit MLA shape, DeepSeek-V2's kv_lora_rank).
    #[arg(long)]
    mla_rank: Option<usize>,
    /// Decoupled RoPE key width per layer (explicit MLA shape), 16-bit when the latent is
    /// quantized.
    #[arg(long)]
    rope_dim: Option<usize>,
    /// Cache storage: f32, f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// FP8 scales: per-tensor (default, no per-token overhead) or per-token (4 bytes per row of
    /// K and of V). int8 always has a scale per row, int4 one per group of 32 values.
    #[arg(long, value_name = "GRANULARITY")]
    scales: Option<String>,
    /// Tokens per sequence (rounded up to whole blocks with --block-size).
    #[arg(long = "tokens", visible_alias = "tokens-per-seq", value_name = "N")]
    tokens: Option<u64>,
    /// Concurrent sequences.
    #[arg(long, value_name = "B", default_value_t = 1)]
    seqs: u64,
    /// Tokens per block (a power of two from 1 to 256); without it no block rounding.
    #[arg(long)]
    block_size: Option<usize>,
    /// A byte budget (e.g. 85899345920, 80GiB, 141GB): how many tokens, and sequences of
    /// --tokens-per-seq tokens, fit in it.
    #[arg(long, value_name = "BYTES")]
    budget_bytes: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Where the shape came from.
enum Source {
    Preset(&'static ModelPreset),
    Explicit,
}

/// Resolves the shape: a preset or explicit flags, never both, never MHA and MLA flags mixed.
fn shape(args: &CapacityArgs) -> Result<(Source, CacheShape)> {
    let explicit: Vec<&str> = [
        ("--layers", args.layers.is_some()),
        ("--kv-heads", args.kv_heads.is_some()),
        ("--head-dim", args.head_dim.is_some()),
        ("--mla-rank", args.mla_rank.is_some()),
        ("--rope-dim", args.rope_dim.is_some()),
    ]
    .into_iter()
    .filter_map(|(flag, given)| given.then_some(flag))
    .collect();
    if let Some(name) = &args.model {
        if !explicit.is_empty() {
            return Err(invalid(format!(
                "--model {name} conflicts with {}: give a preset or an explicit shape, not both",
                explicit.join(", ")
            )));
        }
        let p = preset(name)?;
        return Ok((Source::Preset(p), p.shape));
    }
    let mha = args.kv_heads.is_some() || args.head_dim.is_some();
    let mla = args.mla_rank.is_some() || args.rope_dim.is_some();
    if mha && mla {
        return Err(invalid(
            "MHA flags (--kv-heads, --head-dim) and MLA flags (--mla-rank, --rope-dim) \
             cannot be mixed",
        ));
    }
    let Some(layers) = args.layers else {
        return Err(invalid(format!(
            "give --model NAME ({}) or --layers with --kv-heads and --head-dim (or --mla-rank \
             and --rope-dim for a latent cache)",
            preset_names().join(", ")
        )));
    };
    let missing = |pairs: [(&'static str, bool); 2]| {
        let m: Vec<&str> = pairs
            .into_iter()
            .filter_map(|(f, given)| (!given).then_some(f))
            .collect();
        invalid(format!("--layers needs {} too", m.join(" and ")))
    };
    let shape = if mla {
        match (args.mla_rank, args.rope_dim) {
            (Some(rank), Some(rope_dim)) => CacheShape::Mla {
                layers,
                rank,
                rope_dim,
            },
            (r, d) => {
                return Err(missing([
                    ("--mla-rank", r.is_some()),
                    ("--rope-dim", d.is_some()),
                ]))
            }
        }
    } else {
        match (args.kv_heads, args.head_dim) {
            (Some(kv_heads), Some(head_dim)) => CacheShape::Mha {
                layers,
                kv_heads,
                head_dim,
            },
            (h, d) => {
                return Err(missing([
                    ("--kv-heads", h.is_some()),
                    ("--head-dim", d.is_some()),
                ]))
            }
        }
    };
    Ok((Source::Explicit, shape))
}

/// Computes the capacity (and the budget fit) and prints them as text or JSON.
pub fn run(args: &CapacityArgs) -> Result<()> {
    let (source, shape) = shape(args)?;
    let dtype: KvDtype = args.dtype.parse()?;
    let scales: ScaleGranularity = match &args.scales {
        Some(s) => s.parse()?,
        None => ScaleGranularity::PerTensor,
    };
    scales.check(dtype)?;
    let query = CapacityQuery {
        shape,
        dtype,
        scales,
        block_size: args.block_size,
        tokens_per_seq: args.tokens.unwrap_or(1),
        seqs: args.seqs,
    };
    let cap = evaluate(&query)?;
    let budget = match &args.budget_bytes {
        Some(b) => {
            let bytes = parse_byte_size(b)?;
            let fit = fit_budget(
                shape,
                dtype,
                scales,
                args.block_size,
                bytes,
                query.tokens_per_seq,
            )?;
            Some((bytes, fit))
        }
        None => None,
    };
    let label = match &source {
        Source::Preset(p) => p.name.to_string(),
        Source::Explicit => shape.to_string(),
    };
    if args.json {
        println!("{:#}", json(&source, &query, &cap, budget));
    } else {
        print!("{}", text(&label, &query, &cap, budget));
    }
    Ok(())
}

fn json(
    source: &Source,
    q: &CapacityQuery,
    c: &Capacity,
    budget: Option<(u64, BudgetFit)>,
) -> serde_json::Value {
    let mut v = serde_json::json!({
        "model": match source {
            Source::Preset(p) => Some(p.name),
            Source::Explicit => None,
        },
        "attention": q.shape.kind(),
        "layers": q.shape.layers(),
        "dtype": q.dtype.name(),
        "scales": q.scales.effective(q.dtype),
        "block_size": q.block_size,
        "values_per_token": c.values_per_token,
        "payload_bytes_per_token": c.payload_bytes_per_token,
        "scale_bytes_per_token": c.scale_bytes_per_token,
        "bytes_per_token": c.bytes_per_token,
        "tokens_requested": q.tokens_per_seq,
        "tokens": c.tokens_per_seq,
        "seqs": q.seqs,
        "bytes_per_seq": c.bytes_per_seq,
        "total_bytes": c.total_bytes,
        "total_gib": gib(c.total_bytes),
        "total_gb": gb(c.total_bytes),
    });
    let o = v.as_object_mut().expect("an object");
    if let Source::Preset(p) = source {
        o.insert("q_heads".into(), p.q_heads.into());
    }
    match q.shape {
        CacheShape::Mha {
            kv_heads, head_dim, ..
        } => {
            o.insert("kv_heads".into(), kv_heads.into());
            o.insert("head_dim".into(), head_dim.into());
        }
        CacheShape::Mla { rank, rope_dim, .. } => {
            o.insert("mla_rank".into(), rank.into());
            o.insert("rope_dim".into(), rope_dim.into());
        }
    }
    if let Some((bytes, fit)) = budget {
        o.insert("budget_bytes".into(), bytes.into());
        o.insert("max_tokens".into(), fit.max_tokens.into());
        o.insert("max_sequences".into(), fit.max_sequences.into());
    }
    v
}

fn text(label: &str, q: &CapacityQuery, c: &Capacity, budget: Option<(u64, BudgetFit)>) -> String {
    let scales = match (q.dtype.fp8_format(), q.scales) {
        (Some(_), ScaleGranularity::PerToken) => " (per-token scales)",
        _ => "",
    };
    let tokens = if c.tokens_per_seq != q.tokens_per_seq {
        format!(
            "{} tokens ({} requested, blocks of {})",
            thousands(c.tokens_per_seq),
            thousands(q.tokens_per_seq),
            q.block_size.unwrap_or(1)
        )
    } else {
        format!(
            "{} {}",
            thousands(c.tokens_per_seq),
            plural(c.tokens_per_seq, "token")
        )
    };
    let mut out = format!(
        "{label} {}{scales}: {} bytes/token; {} {} x {tokens} = {}\n",
        q.dtype,
        thousands(c.bytes_per_token),
        thousands(q.seqs),
        plural(q.seqs, "seq"),
        sized(c.total_bytes),
    );
    if let Some((bytes, fit)) = budget {
        out += &format!(
            "budget {}: max {} {}; max {} {} of {} {}\n",
            sized(bytes),
            thousands(fit.max_tokens),
            plural(fit.max_tokens, "token"),
            thousands(fit.max_sequences),
            plural(fit.max_sequences, "seq"),
            thousands(fit.tokens_per_seq),
            plural(fit.tokens_per_seq, "token"),
        );
    }
    out
}

/// "85,899,345,920 bytes (80.00 GiB, 85.90 GB)".
fn sized(bytes: u64) -> String {
    format!(
        "{} bytes ({:.2} GiB, {:.2} GB)",
        thousands(bytes),
        gib(bytes),
        gb(bytes)
    )
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

fn plural(n: u64, word: &str) -> String {
    if n == 1 {
        word.to_string()
    } else {
        format!("{word}s")
    }
}

/// `n` with a comma every three digits.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}
