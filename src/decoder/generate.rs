//! Text generation with a loaded model: the prompt (raw, or in the model's chat template),
//! a prefill, then one token per step until EOS or the token budget, streamed as text.

use web_time::Instant;

use super::load::LoadedModel;
use super::model::{Decoder, Logits};
use super::sampling::{Sampler, Sampling};
use crate::cache::paged::{PagedKvCache, PoolSize};
use crate::gpu::{Context, Counters, PassTime};
use crate::quant::KvDtype;
use crate::shader::Precision;
use crate::{Error, Result};

/// What to generate and how.
#[derive(Debug, Clone)]
pub struct TextOptions {
    /// The user message (or the raw prompt with [`raw`](Self::raw)).
    pub prompt: String,
    /// Use the prompt as is, without the chat template.
    pub raw: bool,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How to choose tokens.
    pub sampling: Sampling,
    /// KV cache storage format.
    pub kv_dtype: KvDtype,
    /// Attention kernel precision (used when the model is loaded).
    pub precision: Precision,
    /// Profile every decode step ([`TextStats::decode_profile`]): device timestamps around
    /// the step and a queue sync before it.
    pub profile: bool,
    /// Profile every decode step (as [`profile`](Self::profile) does) with each op in a
    /// compute pass of its own ([`Decoder::set_pass_per_op`]), and say where the step's device
    /// time goes ([`TextStats::op_profile`]; empty on an adapter without timestamps).
    pub profile_ops: bool,
}

impl Default for TextOptions {
    /// A question about France in the chat template, 64 tokens, greedy, f16 KV, f32 kernels.
    fn default() -> Self {
        Self {
            prompt: "What is the capital of France?".into(),
            raw: false,
            max_tokens: 64,
            sampling: Sampling::default(),
            kv_dtype: KvDtype::F16,
            precision: Precision::F32,
            profile: false,
            profile_ops: false,
        }
    }
}

/// What a generation produced and how fast.
#[derive(Debug, Clone, PartialEq)]
pub struct TextStats {
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The generated token ids (EOS not included).
    pub ids: Vec<u32>,
    /// The generated text.
    pub text: String,
    /// Prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Seconds spent before the prefill making the prefill's and the decode steps'
    /// pipelines and buffers ([`Decoder::prepare_shape`](super::model::Decoder::prepare_shape)).
    pub warmup_seconds: f64,
    /// Seconds of the prefill (through the first token's logits).
    pub prefill_seconds: f64,
    /// Decode steps run (one per generated token after the first).
    pub decode_tokens: usize,
    /// Seconds of the decode steps.
    pub decode_seconds: f64,
    /// The logits the first generated token was chosen from.
    pub first_logits: Vec<f32>,
    /// What each decode step did on the device (with [`TextOptions::profile`] or
    /// [`TextOptions::profile_ops`]).
    pub decode_profile: Vec<StepProfile>,
    /// Where a decode step's device time went, op by op, in the order a step records them
    /// (with [`TextOptions::profile_ops`] on an adapter with timestamps).
    pub op_profile: Vec<OpTime>,
}

/// One op's share of a decode step ([`TextOptions::profile_ops`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The op's name ([`super::passes::op`]).
    pub op: String,
    /// Its passes in a step (one per layer for a layer's op).
    pub passes: usize,
    /// The median over the profiled steps of the op's device seconds in a step (its passes
    /// summed).
    pub seconds: f64,
}

/// What one decode step cost: what it created and submitted, and where its time went.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepProfile {
    /// Submissions, buffers, bind groups, pipelines and uploads of the step.
    pub counters: Counters,
    /// Wall-clock seconds of the step (host recording, device work, readback).
    pub wall_seconds: f64,
    /// Seconds the step's compute passes ran on the device (timestamps), or the wall clock
    /// where the adapter has no timestamps.
    pub device_seconds: f64,
}

impl StepProfile {
    /// Host seconds: the wall clock less the device time.
    pub fn host_seconds(&self) -> f64 {
        (self.wall_seconds - self.device_seconds).max(0.0)
    }
}

/// Runs `f` (one step) with its counters and device time measured: the queue is synced
/// before it, and its compute passes carry timestamps where the adapter has them.
pub fn profiled<T>(ctx: &Context, f: impl FnOnce() -> Result<T>) -> Result<(T, StepProfile)> {
    profiled_passes(ctx, f).map(|(value, profile, _)| (value, profile))
}

/// [`profiled`], with each compute pass the step recorded, timed ([`Context::timed_passes`]).
pub fn profiled_passes<T>(
    ctx: &Context,
    f: impl FnOnce() -> Result<T>,
) -> Result<(T, StepProfile, Vec<PassTime>)> {
    let ((value, counters, wall), timing, passes) = ctx.timed_passes(|| {
        let before = ctx.counters();
        // The step alone: not the queue sync before it nor the timestamp readback after it.
        let start = Instant::now();
        let value = f()?;
        let wall = start.elapsed().as_secs_f64();
        Ok((value, ctx.counters().since(&before), wall))
    })?;
    Ok((
        value,
        StepProfile {
            counters,
            wall_seconds: wall,
            device_seconds: timing.busy_seconds,
        },
        passes,
    ))
}

/// Each op's passes and median seconds per step over `steps` (each step's passes, labelled by
/// op), ops in the order of their first pass.
pub fn op_times(steps: &[Vec<PassTime>]) -> Vec<OpTime> {
    // Per op: the most passes of a step, and its seconds in each step (0 where it has none).
    let mut ops: Vec<(String, usize, Vec<f64>)> = Vec::new();
    for (i, passes) in steps.iter().enumerate() {
        let mut counts = vec![0usize; ops.len()];
        for pass in passes {
            let at = match ops.iter().position(|(op, ..)| *op == pass.label) {
                Some(at) => at,
                None => {
                    ops.push((pass.label.clone(), 0, vec![0.0; steps.len()]));
                    counts.push(0);
                    ops.len() - 1
                }
            };
            counts[at] += 1;
            ops[at].2[i] += pass.seconds;
        }
        for (o, count) in ops.iter_mut().zip(counts) {
            o.1 = o.1.max(count);
        }
    }
    ops.into_iter()
        .map(|(op, passes, seconds)| OpTime {
            op,
            passes,
            seconds: median(seconds),
        })
        .collect()
}

/// Lines of a table of `ops` (see [`op_times`]): each op's passes, milliseconds per step and
/// share of their sum.
pub fn op_table(ops: &[OpTime]) -> Vec<String> {
    let total: f64 = ops.iter().map(|o| o.seconds).sum();
    let mut lines = vec![format!(
        "{:<16} {:>6} {:>9} {:>6}",
        "op", "passes", "ms", "share"
    )];
    for o in ops {
        lines.push(format!(
            "{:<16} {:>6} {:>9.3} {:>5.1}%",
            o.op,
            o.passes,
            o.seconds * 1e3,
            if total > 0.0 {
                100.0 * o.seconds / total
            } else {
                0.0
            }
        ));
    }
    lines.push(format!(
        "{:<16} {:>6} {:>9.3}",
        "sum",
        ops.iter().map(|o| o.passes).sum::<usize>(),
        total * 1e3
    ));
    lines
}

/// The median of `values` (0 when empty).
pub fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// `per decode step: S submissions, B buffers, G bind groups, host H ms, device D ms`: the
/// medians over `steps` (the decoder example prints it after generating).
pub fn per_step_line(steps: &[StepProfile]) -> String {
    let m = |f: &dyn Fn(&StepProfile) -> f64| median(steps.iter().map(f).collect());
    format!(
        "per decode step: {} submissions, {} buffers, {} bind groups, host {:.2} ms, device {:.2} ms",
        m(&|p| p.counters.submissions as f64),
        m(&|p| p.counters.buffers_created as f64),
        m(&|p| p.counters.bind_groups_created as f64),
        m(&|p| p.host_seconds() * 1e3),
        m(&|p| p.device_seconds * 1e3),
    )
}

/// The prompt's token ids under `opts` (chat template unless raw).
pub fn prompt_ids(loaded: &LoadedModel, opts: &TextOptions) -> Result<Vec<u32>> {
    let t = &loaded.tokenizer;
    let ids = if opts.raw {
        t.encode_prompt(&opts.prompt)
    } else {
        t.encode(&t.chat_prompt(&[("user", opts.prompt.as_str())], true)?)
    };
    if ids.is_empty() {
        return Err(Error::InvalidArgument("the prompt has no tokens".into()));
    }
    Ok(ids)
}

/// Generates from `opts.prompt`, calling `on_text` with each piece of text as soon as it is
/// complete UTF-8.
pub fn generate_text(
    ctx: &Context,
    loaded: &LoadedModel,
    opts: &TextOptions,
    mut on_text: impl FnMut(&str),
) -> Result<TextStats> {
    let mut sampler = Sampler::new(opts.sampling)?;
    let prompt = prompt_ids(loaded, opts)?;
    let model = &loaded.model;
    let c = model.config();
    let kv = c.kv_config(opts.kv_dtype);
    let blocks = (prompt.len() + opts.max_tokens + 1).div_ceil(kv.block_size);
    let mut cache = PagedKvCache::new(ctx, kv, PoolSize::Blocks(blocks))?;
    let seq = 0;
    cache.add_sequence(seq, &[])?;
    let eos = loaded.tokenizer.eos_id();
    let mut stream = loaded.tokenizer.stream_decoder();
    let mut ids = Vec::new();
    let mut text = String::new();

    // The prefill's and the decode steps' pipelines compiled (and their buffers made) before
    // either is timed.
    let tw = Instant::now();
    let max_len = prompt.len() + opts.max_tokens;
    for lens in [prompt.len(), 1] {
        model.prepare_shape(ctx, &cache, &[lens], Logits::Last, max_len)?;
    }
    let warmup_seconds = tw.elapsed().as_secs_f64();

    let t0 = Instant::now();
    let first = model.forward(ctx, &mut cache, &[(seq, &prompt)])?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let first_logits = first.logits;
    let mut logits = first_logits.clone();
    let t1 = Instant::now();
    let mut decode_tokens = 0;
    let mut decode_profile = Vec::new();
    let mut step_passes = Vec::new();
    let _per_op = PassPerOp::new(model, opts.profile_ops);
    while ids.len() < opts.max_tokens {
        let next = sampler.sample(&logits)?;
        if Some(next) == eos {
            break;
        }
        ids.push(next);
        let piece = stream.push(next);
        if !piece.is_empty() {
            on_text(&piece);
            text.push_str(&piece);
        }
        if ids.len() == opts.max_tokens {
            break;
        }
        let step = [(seq, &[next][..])];
        logits = if opts.profile || opts.profile_ops {
            let (out, profile, passes) =
                profiled_passes(ctx, || model.forward(ctx, &mut cache, &step))?;
            decode_profile.push(profile);
            if opts.profile_ops && !passes.is_empty() {
                step_passes.push(passes);
            }
            out.logits
        } else {
            model.forward(ctx, &mut cache, &step)?.logits
        };
        decode_tokens += 1;
    }
    let rest = stream.finish();
    if !rest.is_empty() {
        on_text(&rest);
        text.push_str(&rest);
    }
    Ok(TextStats {
        prefill_tokens: prompt.len(),
        prompt_ids: prompt,
        ids,
        text,
        warmup_seconds,
        prefill_seconds,
        decode_tokens,
        decode_seconds: t1.elapsed().as_secs_f64(),
        first_logits,
        decode_profile,
        op_profile: op_times(&step_passes),
    })
}

/// The decoder's steps recorded with a pass per op while this lives (when asked for), as
/// before it afterwards, errors included.
struct PassPerOp<'a> {
    model: &'a Decoder,
    before: bool,
}

impl<'a> PassPerOp<'a> {
    fn new(model: &'a Decoder, on: bool) -> Self {
        let before = model.pass_per_op();
        model.set_pass_per_op(before || on);
        Self { model, before }
    }
}

impl Drop for PassPerOp<'_> {
    fn drop(&mut self) {
        self.model.set_pass_per_op(self.before);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(label: &str, ms: f64) -> PassTime {
        PassTime {
            label: label.into(),
            seconds: ms * 1e-3,
        }
    }

    #[test]
    fn op_times_sum_each_ops_passes_and_take_the_median_over_steps() {
        let steps = vec![
            vec![pass("a", 1.0), pass("b", 2.0), pass("a", 3.0)],
            vec![
                pass("a", 2.0),
                pass("b", 4.0),
                pass("a", 2.0),
                pass("c", 9.0),
            ],
            vec![pass("b", 1.0), pass("a", 5.0), pass("a", 5.0)],
        ];
        let ops = op_times(&steps);
        let got: Vec<(&str, usize, f64)> = ops
            .iter()
            .map(|o| (o.op.as_str(), o.passes, (o.seconds * 1e6).round() / 1e3))
            .collect();
        // a: 4, 4, 10 ms; b: 2, 4, 1; c: 0, 9, 0 (absent steps count as 0).
        assert_eq!(got, [("a", 2, 4.0), ("b", 1, 2.0), ("c", 1, 0.0)]);
        assert!(op_times(&[]).is_empty());
        let table = op_table(&ops);
        assert_eq!(table.len(), ops.len() + 2, "{table:?}");
        assert!(
            table[1].starts_with("a ") && table[1].contains("66.7%"),
            "{table:?}"
        );
        assert!(table.last().unwrap().contains("6.000"), "{table:?}");
    }
}
