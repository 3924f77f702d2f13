//! `kvattn capacity`: KV cache bytes for a model, a dtype and a batch, and what fits a budget.

use kvattn::cache::capacity::{
    compare_to_mha, evaluate, fit_budget, parse_byte_size, BudgetFit, CacheShape, Capacity,
    CapacityQuery, MhaComparison, ScaleGranularity,
};
use kvattn::cache::presets::{preset, preset_names, ModelPreset};
use kvattn::quant::KvDtype;
use kvattn::{Error, Result};

use crate::output;

/// Arguments of `kvattn capacity`.
#[derive(clap::Args)]
pub struct CapacityArgs {
    /// A model preset: llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, qwen2.5-1.5b, qwen2.5-7b,
    /// qwen3-1.7b, qwen3-8b, mistral-7b, deepseek-v2, smollm2-135m. Or give the shape with
    /// --layers and --kv-heads/--head-dim (or --mla-rank/--rope-dim). An MLA preset
    /// (deepseek-v2) is also compared with the MHA cache of its query heads.
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
    /// Transformer layers (explicit shape).
    #[arg(long)]
    layers: Option<usize>,
    /// KV heads per layer (explicit MHA/GQA/MQA shape).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Values per head (explicit MHA/GQA/MQA shape); with --mla-rank/--rope-dim and --q-heads,
    /// the K and V head dim of the MHA cache the latent is compared with.
    #[arg(long)]
    head_dim: Option<usize>,
    /// Query heads per layer of an explicit MLA shape: with --head-dim, compares the latent
    /// with an MHA cache of that many heads, each with K and V rows of --head-dim values.
    #[arg(long, value_name = "N")]
    q_heads: Option<usize>,
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

/// The MHA cache an MLA shape is compared with: (query heads, K and V head dim).
type MhaRequest = Option<(usize, usize)>;

/// Resolves the shape: a preset or explicit flags, never both, never MHA and MLA flags mixed;
/// and, for an MLA shape, the MHA comparison (a preset's own, or --q-heads with --head-dim).
fn shape(args: &CapacityArgs) -> Result<(Source, CacheShape, MhaRequest)> {
    let explicit: Vec<&str> = [
        ("--layers", args.layers.is_some()),
        ("--kv-heads", args.kv_heads.is_some()),
        ("--head-dim", args.head_dim.is_some()),
        ("--q-heads", args.q_heads.is_some()),
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
        let request = p.mha_equivalent_head_dim.map(|d| (p.q_heads, d));
        return Ok((Source::Preset(p), p.shape, request));
    }
    let mla = args.mla_rank.is_some() || args.rope_dim.is_some();
    // --head-dim belongs to an MLA shape too when it sizes the MHA comparison (--q-heads).
    let mha = args.kv_heads.is_some() || (args.head_dim.is_some() && !mla);
    if mha && mla {
        return Err(invalid(
            "MHA flags (--kv-heads, --head-dim) and MLA flags (--mla-rank, --rope-dim) \
             cannot be mixed",
        ));
    }
    if args.q_heads.is_some() && !mla {
        return Err(invalid(
            "--q-heads asks for the MHA comparison of an MLA shape (--mla-rank and --rope-dim); \
             an MHA shape (--kv-heads, --head-dim) has nothing to compare",
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
    if mla {
        let shape = match (args.mla_rank, args.rope_dim) {
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
        };
        let request = match (args.q_heads, args.head_dim) {
            (Some(q_heads), Some(head_dim)) => Some((q_heads, head_dim)),
            (None, None) => None,
            (Some(_), None) => {
                return Err(invalid(
                    "--q-heads needs --head-dim: the K and V head dim of the MHA cache the \
                     latent is compared with",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "--head-dim with an MLA shape (--mla-rank, --rope-dim) sizes the MHA \
                     comparison and needs --q-heads too",
                ))
            }
        };
        return Ok((Source::Explicit, shape, request));
    }
    let shape = match (args.kv_heads, args.head_dim) {
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
    };
    Ok((Source::Explicit, shape, None))
}

/// Computes the capacity (and the budget fit) and prints them as text or JSON.
pub fn run(args: &CapacityArgs) -> Result<()> {
    let (source, shape, request) = shape(args)?;
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
    let vs_mha = match request {
        Some((q_heads, head_dim)) => Some(compare_to_mha(shape, q_heads, head_dim, dtype, scales)?),
        None => None,
    };
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
        print!(
            "{}",
            output::json::pretty(&json(&source, &query, &cap, vs_mha.as_ref(), budget))
        );
    } else {
        print!("{}", text(&label, &query, &cap, vs_mha.as_ref(), budget));
    }
    Ok(())
}

fn json(
    source: &Source,
    q: &CapacityQuery,
    c: &Capacity,
    vs_mha: Option<&MhaComparison>,
    budget: Option<(u64, BudgetFit)>,
) -> serde_json::Value {
    let mut v = serde_json::json!({
        "model": match source {
            Source::Preset(p) => Some(p.name),
            Source::Explicit => None,
        },
        "attention": q.shape.kind(),
        "layers": q.shape.layers(),
        "dtype": q.dtype,
        "scales": q.scales.effective(q.dtype),
        "block_size": q.block_size,
        "tokens_requested": q.tokens_per_seq,
        "seqs": q.seqs,
        "total_gib": gib(c.total_bytes),
        "total_gb": gb(c.total_bytes),
    });
    let o = v.as_object_mut().expect("an object");
    // The capacity's own fields under their names in the library, but `tokens` for the
    // tokens per sequence after block rounding.
    if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(c) {
        for (key, value) in fields {
            let key = if key == "tokens_per_seq" {
                "tokens".to_string()
            } else {
                key
            };
            o.insert(key, value);
        }
    }
    if let Source::Preset(p) = source {
        o.insert("q_heads".into(), p.q_heads.into());
    }
    if let Some(m) = vs_mha {
        if let CacheShape::Mha {
            kv_heads, head_dim, ..
        } = m.mha
        {
            // An explicit shape's query heads are known only from --q-heads.
            o.insert("q_heads".into(), kv_heads.into());
            o.insert("mha_equivalent_head_dim".into(), head_dim.into());
        }
        o.insert(
            "mha_equivalent_values_per_token".into(),
            m.mha_values_per_token.into(),
        );
        o.insert(
            "mha_equivalent_bytes_per_token".into(),
            m.mha_bytes_per_token.into(),
        );
        o.insert("mha_ratio_values".into(), m.ratio_values.into());
        o.insert("mha_ratio_bytes".into(), m.ratio_bytes.into());
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

fn text(
    label: &str,
    q: &CapacityQuery,
    c: &Capacity,
    vs_mha: Option<&MhaComparison>,
    budget: Option<(u64, BudgetFit)>,
) -> String {
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
    if let Some(m) = vs_mha {
        if let CacheShape::Mha {
            kv_heads, head_dim, ..
        } = m.mha
        {
            out += &format!(
                "vs MHA of the same {kv_heads} heads (K and V of {head_dim} dims): {} values/token, \
                 {:.1}x the latent's values ({} bytes/token, {:.1}x the latent's bytes)\n",
                thousands(m.mha_values_per_token),
                m.ratio_values,
                thousands(m.mha_bytes_per_token),
                m.ratio_bytes,
            );
        }
    }
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
