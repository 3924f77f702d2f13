//! Decode steps of the toy decoder on the page's context, against the CPU reference.

use kvattn::cache::paged::{PagedKvCache, PoolSize};
use kvattn::decoder::model::{Decoder, Logits};
use kvattn::decoder::sampling::argmax;
use kvattn::decoder::toy::{random_weights, toy_config};
use kvattn::gpu::Context;
use kvattn::quant::KvDtype;
use kvattn::reference::llama::llama_logits;
use kvattn::shader::Precision;

use crate::{now_ms, DecodeStep};

/// Prompt tokens before the steps: two 16-token blocks and part of a third.
const PROMPT: usize = 37;
/// Decode steps: the first compiles the decode pipelines, the second runs warm.
const STEPS: usize = 2;

/// Prefills a 37-token prompt into a paged f32 cache (16-token blocks, free blocks shuffled),
/// then decodes two greedy tokens; each step's logits are compared with the CPU reference
/// forward pass over the whole prefix, within `1e-4` of the logits' scale (the native tests'
/// bound).
pub async fn decode_steps(ctx: &Context) -> kvattn::Result<DecodeStep> {
    let config = toy_config(2);
    let weights = random_weights(&config, 2026);
    let model = Decoder::upload(ctx, config, &weights, Precision::F32)?;
    let mut kv = config.kv_config(KvDtype::F32);
    kv.block_size = 16;
    let mut cache = PagedKvCache::new(ctx, kv, PoolSize::Blocks(8))?;
    cache.shuffle_free_blocks(5);
    cache.add_sequence(0, &[])?;
    let mut tokens: Vec<u32> = (0..PROMPT as u32)
        .map(|i| (i * 131 + 17) % config.vocab as u32)
        .collect();
    let start = now_ms();
    let prefill = model
        .forward_with_async(ctx, &mut cache, &[(0, &tokens)], Logits::Last)
        .await?;
    let prefill_ms = now_ms() - start;
    let mut next = argmax(&prefill.logits)?;
    let mut result = DecodeStep {
        prompt: PROMPT,
        steps: 0,
        max_error: 0.0,
        bound: f64::INFINITY,
        passed: true,
        tokens: Vec::new(),
        reference_tokens: Vec::new(),
        prefill_ms,
        step_ms: Vec::new(),
        error: None,
    };
    for _ in 0..STEPS {
        tokens.push(next);
        let start = now_ms();
        let step = model
            .forward_with_async(ctx, &mut cache, &[(0, &[next])], Logits::Last)
            .await?;
        result.step_ms.push(now_ms() - start);
        let want = llama_logits(&config, &weights, &tokens, None)?;
        let scale = want.iter().fold(1.0f64, |m, x| m.max(f64::from(x.abs())));
        let error = step
            .logits
            .iter()
            .zip(&want)
            .map(|(g, w)| f64::from((g - w).abs()))
            .fold(
                0.0,
                |m, e| if e.is_nan() { f64::INFINITY } else { m.max(e) },
            );
        let bound = 1e-4 * scale;
        let whole = step.logits.len() == want.len();
        result.passed &= whole && error <= bound;
        result.max_error = result.max_error.max(error);
        result.bound = result.bound.min(bound);
        next = argmax(&step.logits)?;
        result.tokens.push(next);
        result.reference_tokens.push(argmax(&want)?);
        result.steps += 1;
    }
    Ok(result)
}
