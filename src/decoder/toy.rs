//! The cached-vs-uncached experiment of the KV-cache article (`seeds/000`, section 3) on the
//! GPU: a small decoder with seeded random weights (2 layers, d_model 128, 8 heads of 16, MLP
//! 512, vocab 512, f32) generates greedily from a 32-token random prompt to lengths 128, 256 and
//! 512, once with the KV cache (prefill the prompt, then one token per step) and once
//! recomputing the whole forward pass every step (the cache emptied before each step, so
//! nothing is reused). It reports whether the tokens match, the largest logit difference, the
//! FLOPs each way (counted by [`Decoder::forward`]), the time each way, the per-step time in
//! 64-token windows, and the cache bytes after a 1,024-token prefill for MHA, GQA (2 KV heads)
//! and MQA next to `2 x layers x kv_heads x head_dim x tokens x 4`.

use web_time::Instant;

use super::generate::{profiled, StepProfile};
use super::model::{Decoder, DecoderConfig, HostLayer, HostWeights};
use super::sampling::argmax;
use crate::cache::paged::{PagedKvCache, PoolSize};
use crate::gpu::Context;
use crate::quant::KvDtype;
use crate::rng::SplitMix64;
use crate::rope::RopeStyle;
use crate::shader::Precision;
use crate::Result;

/// The toy model's shape with `n_kv_heads` KV heads (8: MHA, 2: GQA, 1: MQA).
pub fn toy_config(n_kv_heads: usize) -> DecoderConfig {
    DecoderConfig {
        layers: 2,
        d_model: 128,
        n_heads: 8,
        n_kv_heads,
        head_dim: 16,
        ffn: 512,
        vocab: 512,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::NeoX,
        rms_eps: 1e-5,
    }
}

/// Normals from SplitMix64, for reproducible weights without dependencies.
struct Normals(SplitMix64);

impl Normals {
    fn uniform(&mut self) -> f64 {
        self.0.uniform_open()
    }

    fn take(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (a, b) = (self.uniform(), self.uniform());
                ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos() * scale) as f32
            })
            .collect()
    }
}

/// Seeded random weights for `c`: embeddings of unit variance, each matrix scaled by
/// `1 / sqrt(fan_in)`, norms 1, an untied output projection.
pub fn random_weights(c: &DecoderConfig, seed: u64) -> HostWeights {
    let mut r = Normals(SplitMix64::new(seed));
    let d = c.d_model;
    let fan = |n: usize| 1.0 / (n as f64).sqrt();
    let layers = (0..c.layers)
        .map(|_| HostLayer {
            attn_norm: vec![1.0; d],
            wq: r.take(c.q_dim() * d, fan(d)),
            wk: r.take(c.kv_dim() * d, fan(d)),
            wv: r.take(c.kv_dim() * d, fan(d)),
            wo: r.take(d * c.q_dim(), fan(c.q_dim())),
            bq: None,
            bk: None,
            bv: None,
            ffn_norm: vec![1.0; d],
            w_gate: r.take(c.ffn * d, fan(d)),
            w_up: r.take(c.ffn * d, fan(d)),
            w_down: r.take(d * c.ffn, fan(c.ffn)),
        })
        .collect();
    HostWeights {
        embed: r.take(c.vocab * d, 1.0),
        layers,
        final_norm: vec![1.0; d],
        lm_head: Some(r.take(c.vocab * d, fan(d))),
        rope_freqs: None,
    }
}

/// A greedy generation: the tokens, the logits that chose each new token, the FLOPs, the wall
/// time, and each step's time.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Prompt and generated tokens.
    pub tokens: Vec<u32>,
    /// Per generated token, the logits it was chosen from.
    pub logits: Vec<Vec<f32>>,
    /// FLOPs of every step.
    pub flops: u64,
    /// Seconds of the whole generation.
    pub seconds: f64,
    /// Seconds of each step (the first is the cached run's prompt prefill).
    pub step_seconds: Vec<f64>,
    /// The cached run's decode steps, profiled (empty when recomputing).
    pub profile: Vec<StepProfile>,
}

/// Greedy generation from `prompt` to `length` tokens, with the KV cache (`cached`) or
/// recomputing everything each step.
pub fn generate(
    ctx: &Context,
    model: &Decoder,
    prompt: &[u32],
    length: usize,
    cached: bool,
) -> Result<Generation> {
    let c = model.config();
    let mut kv = c.kv_config(KvDtype::F32);
    kv.prefix_caching = false;
    let blocks = length.div_ceil(kv.block_size) + 1;
    let mut cache = PagedKvCache::new(ctx, kv, PoolSize::Blocks(blocks))?;
    let seq = 0;
    cache.add_sequence(seq, &[])?;
    let mut tokens = prompt.to_vec();
    let mut logits = Vec::new();
    let mut flops = 0;
    let mut step_seconds = Vec::new();
    let mut profile = Vec::new();
    let start = Instant::now();
    while tokens.len() < length {
        let t = Instant::now();
        let step = if cached {
            let new = if logits.is_empty() {
                &tokens[..]
            } else {
                &tokens[tokens.len() - 1..]
            };
            if logits.is_empty() {
                model.forward(ctx, &mut cache, &[(seq, new)])?
            } else {
                let (step, p) = profiled(ctx, || model.forward(ctx, &mut cache, &[(seq, new)]))?;
                profile.push(p);
                step
            }
        } else {
            cache.free(seq)?;
            cache.add_sequence(seq, &[])?;
            model.forward(ctx, &mut cache, &[(seq, &tokens[..])])?
        };
        flops += step.flops;
        tokens.push(argmax(&step.logits)?);
        logits.push(step.logits);
        step_seconds.push(t.elapsed().as_secs_f64());
    }
    Ok(Generation {
        tokens,
        logits,
        flops,
        seconds: start.elapsed().as_secs_f64(),
        step_seconds,
        profile,
    })
}

/// One length of the experiment.
#[derive(Debug, Clone, PartialEq)]
pub struct LengthResult {
    /// Total tokens (prompt included).
    pub length: usize,
    /// FLOPs with the cache.
    pub flops_cached: u64,
    /// FLOPs recomputing every step.
    pub flops_uncached: u64,
    /// Seconds with the cache.
    pub seconds_cached: f64,
    /// Seconds recomputing.
    pub seconds_uncached: f64,
    /// Whether the two generated the same tokens.
    pub tokens_match: bool,
    /// Largest difference between the two runs' logits, over every step.
    pub max_logit_diff: f64,
    /// Median step time (cached, uncached) per 64-token window of positions.
    pub windows: Vec<(usize, f64, f64)>,
}

/// Cache bytes of one attention layout after the prefill.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheBytes {
    /// `mha`, `gqa` or `mqa`.
    pub name: &'static str,
    /// KV heads.
    pub kv_heads: usize,
    /// Bytes of the blocks the sequence holds, over all layers, K and V.
    pub measured: u64,
    /// `2 x layers x kv_heads x head_dim x tokens x 4`.
    pub formula: u64,
    /// Whether the last logits with the cache (the prefill) equal those of a recomputation
    /// within 1e-3 (the article's check).
    pub logits_agree: bool,
}

/// The whole experiment's results.
#[derive(Debug, Clone, PartialEq)]
pub struct ToyReport {
    /// Per length.
    pub lengths: Vec<LengthResult>,
    /// MHA, GQA and MQA.
    pub cache_bytes: Vec<CacheBytes>,
    /// The decode steps of the first length's cached run, profiled.
    pub decode_profile: Vec<StepProfile>,
}

fn median(mut x: Vec<f64>) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ToyOptions {
    /// Total lengths to generate to.
    pub lengths: Vec<usize>,
    /// Prompt tokens.
    pub prompt: usize,
    /// Tokens prefilled for the cache-size measurement.
    pub prefill: usize,
    /// Seed of the weights and the prompt.
    pub seed: u64,
    /// Attention kernel precision.
    pub precision: Precision,
}

impl Default for ToyOptions {
    /// The article's: lengths 128, 256, 512 from 32 prompt tokens, a 1,024-token prefill.
    fn default() -> Self {
        Self {
            lengths: vec![128, 256, 512],
            prompt: 32,
            prefill: 1024,
            seed: 20_261_013,
            precision: Precision::F32,
        }
    }
}

/// Runs the experiment.
pub fn run(ctx: &Context, opts: &ToyOptions) -> Result<ToyReport> {
    let config = toy_config(8);
    let model = Decoder::upload(
        ctx,
        config,
        &random_weights(&config, opts.seed),
        opts.precision,
    )?;
    let mut r = Normals(SplitMix64::new(opts.seed ^ 0x5eed));
    let prompt: Vec<u32> = (0..opts.prompt)
        .map(|_| (r.uniform() * config.vocab as f64) as u32 % config.vocab as u32)
        .collect();
    let mut lengths = Vec::new();
    let mut decode_profile = Vec::new();
    for &length in &opts.lengths {
        let with = generate(ctx, &model, &prompt, length, true)?;
        if decode_profile.is_empty() {
            decode_profile = with.profile.clone();
        }
        let without = generate(ctx, &model, &prompt, length, false)?;
        let mut max_diff = 0.0f64;
        for (a, b) in with.logits.iter().zip(&without.logits) {
            for (x, y) in a.iter().zip(b) {
                max_diff = max_diff.max((f64::from(*x) - f64::from(*y)).abs());
            }
        }
        // Step i produced token prompt + i, from a context of prompt + i tokens.
        let windows = (0..length.div_ceil(64))
            .filter_map(|w| {
                let in_window = |g: &Generation| -> Vec<f64> {
                    g.step_seconds
                        .iter()
                        .enumerate()
                        .skip(1)
                        .filter(|(i, _)| (opts.prompt + i) / 64 == w)
                        .map(|(_, &s)| s)
                        .collect()
                };
                let (a, b) = (in_window(&with), in_window(&without));
                (!a.is_empty()).then(|| (w * 64, median(a), median(b)))
            })
            .collect();
        lengths.push(LengthResult {
            length,
            flops_cached: with.flops,
            flops_uncached: without.flops,
            seconds_cached: with.seconds,
            seconds_uncached: without.seconds,
            tokens_match: with.tokens == without.tokens,
            max_logit_diff: max_diff,
            windows,
        });
    }
    let mut cache_bytes = Vec::new();
    for (name, kv_heads) in [("mha", 8), ("gqa", 2), ("mqa", 1)] {
        let c = toy_config(kv_heads);
        let m = Decoder::upload(ctx, c, &random_weights(&c, opts.seed), opts.precision)?;
        let tokens: Vec<u32> = (0..opts.prefill)
            .map(|_| (r.uniform() * c.vocab as f64) as u32 % c.vocab as u32)
            .collect();
        let mut kv = c.kv_config(KvDtype::F32);
        kv.prefix_caching = false;
        let blocks = opts.prefill.div_ceil(kv.block_size);
        let mut cache = PagedKvCache::new(ctx, kv, PoolSize::Blocks(blocks + 1))?;
        cache.add_sequence(0, &[])?;
        let prefill = m.forward(ctx, &mut cache, &[(0, &tokens)])?;
        let held = cache.allocator().blocks(0)?.len() as u64;
        let measured = held * cache.config().bytes_per_block();
        let formula = (2 * c.layers * kv_heads * c.head_dim * opts.prefill * 4) as u64;
        // The last logits once more without reusing anything: the prefix minus its last token
        // prefilled, then the last token decoded against the cache.
        let mut fresh =
            PagedKvCache::new(ctx, cache.config().clone(), PoolSize::Blocks(blocks + 1))?;
        fresh.add_sequence(0, &[])?;
        let n = tokens.len();
        m.forward(ctx, &mut fresh, &[(0, &tokens[..n - 1])])?;
        let decoded = m.forward(ctx, &mut fresh, &[(0, &tokens[n - 1..])])?;
        let agree = prefill
            .logits
            .iter()
            .zip(&decoded.logits)
            .all(|(a, b)| (a - b).abs() <= 1e-3);
        cache_bytes.push(CacheBytes {
            name,
            kv_heads,
            measured,
            formula,
            logits_agree: agree,
        });
    }
    Ok(ToyReport {
        lengths,
        cache_bytes,
        decode_profile,
    })
}
