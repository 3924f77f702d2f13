//! What a step of the decoder costs the device (issue 16): after a prefill and one warm-up
//! decode step, a decode step of the same batch shape is exactly one submission and creates
//! no buffer, no bind group and no pipeline (`Context::counters` around `Decoder::forward`),
//! across block boundaries, for one sequence and for a batch of two; and its logits are the
//! bits of a cold run, where every step is made by a freshly uploaded decoder (nothing reused);
//! with its shapes prepared ahead (`Decoder::prepare_shape`) the first prefill and decode step
//! create no buffer; a step recorded with a pass per op (for profiling) gives the same bits,
//! its passes named for the ops.
//!
//! Each test has a context of its own, so that other tests' work does not count.

use kvattn::cache::allocator::SeqId;
use kvattn::cache::paged::{PagedKvCache, PoolSize};
use kvattn::decoder::model::{Decoder, DecoderConfig, HostWeights, Logits};
use kvattn::decoder::passes::op;
use kvattn::decoder::toy::{random_weights, toy_config};
use kvattn::gpu::{Context, Counters, PassTime};
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;

use crate::common::{own_context, Rng};

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

/// A cache of 16 blocks of 16 tokens for `c` with the sequences `seqs`.
fn cache_for(ctx: &Context, c: &DecoderConfig, dtype: KvDtype, seqs: &[SeqId]) -> PagedKvCache {
    let mut cache = PagedKvCache::new(ctx, c.kv_config(dtype), PoolSize::Blocks(16)).unwrap();
    cache.shuffle_free_blocks(5);
    for &seq in seqs {
        cache.add_sequence(seq, &[]).unwrap();
    }
    cache
}

/// One step with what it submitted and created.
fn counted(
    ctx: &Context,
    model: &Decoder,
    cache: &mut PagedKvCache,
    batch: &[(SeqId, &[u32])],
    which: Logits,
) -> (Vec<f32>, Counters) {
    let before = ctx.counters();
    let out = model.forward_with(ctx, cache, batch, which).unwrap();
    (out.logits, ctx.counters().since(&before))
}

fn assert_warm(what: &str, step: &Counters) {
    assert_eq!(step.submissions, 1, "{what}: {step:?}");
    assert_eq!(step.buffers_created, 0, "{what}: {step:?}");
    assert_eq!(step.bind_groups_created, 0, "{what}: {step:?}");
    assert_eq!(step.pipelines_compiled, 0, "{what}: {step:?}");
    assert!(
        step.bytes_uploaded > 0,
        "{what}: no ids or metadata written: {step:?}"
    );
}

/// The logits of `steps` run cold: each step by a decoder uploaded for it, on a fresh cache.
fn cold_run(
    ctx: &Context,
    (c, w): (&DecoderConfig, &HostWeights),
    dtype: KvDtype,
    steps: &[Vec<(SeqId, Vec<u32>)>],
) -> Vec<Vec<f32>> {
    let seqs: Vec<SeqId> = steps[0].iter().map(|s| s.0).collect();
    let mut cache = cache_for(ctx, c, dtype, &seqs);
    steps
        .iter()
        .map(|step| {
            let model = Decoder::upload(ctx, *c, w, Precision::F32).unwrap();
            let batch: Vec<(SeqId, &[u32])> =
                step.iter().map(|(s, t)| (*s, t.as_slice())).collect();
            model.forward(ctx, &mut cache, &batch).unwrap().logits
        })
        .collect()
}

/// Prefills, then decodes `decode` tokens per sequence one step at a time; every decode step
/// after the first is checked warm; all logits against the cold run.
fn check_decoding(ctx: &Context, dtype: KvDtype, prompts: &[(SeqId, usize)], decode: usize) {
    let c = toy_config(2);
    let w = random_weights(&c, 31);
    let model = Decoder::upload(ctx, c, &w, Precision::F32).unwrap();
    let ids: Vec<(SeqId, Vec<u32>)> = prompts
        .iter()
        .map(|&(seq, len)| (seq, tokens(len + decode, c.vocab, 40 + seq)))
        .collect();
    let mut steps: Vec<Vec<(SeqId, Vec<u32>)>> = vec![ids
        .iter()
        .zip(prompts)
        .map(|((seq, t), &(_, len))| (*seq, t[..len].to_vec()))
        .collect()];
    for i in 0..decode {
        steps.push(
            ids.iter()
                .zip(prompts)
                .map(|((seq, t), &(_, len))| (*seq, vec![t[len + i]]))
                .collect(),
        );
    }
    let seqs: Vec<SeqId> = prompts.iter().map(|p| p.0).collect();
    let mut cache = cache_for(ctx, &c, dtype, &seqs);
    let mut warm = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let batch: Vec<(SeqId, &[u32])> = step.iter().map(|(s, t)| (*s, t.as_slice())).collect();
        let (logits, counters) = counted(ctx, &model, &mut cache, &batch, Logits::Last);
        // Step 0 is the prefill, step 1 the warm-up decode step.
        if i >= 2 {
            assert_warm(
                &format!("{dtype} {prompts:?}: decode step {}", i - 1),
                &counters,
            );
        } else {
            assert!(counters.submissions >= 1, "{counters:?}");
        }
        warm.push(logits);
    }
    let cold = cold_run(ctx, (&c, &w), dtype, &steps);
    for (i, (a, b)) in warm.iter().zip(&cold).enumerate() {
        let (a, b): (Vec<u32>, Vec<u32>) = (
            a.iter().map(|v| v.to_bits()).collect(),
            b.iter().map(|v| v.to_bits()).collect(),
        );
        assert!(
            a == b,
            "{dtype} {prompts:?}: step {i}: warm and cold logits differ"
        );
    }
}

#[test]
fn a_warm_decode_step_is_one_submission_that_creates_nothing() {
    let ctx = own_context(None);
    // 13 prompt tokens, then 7 decode steps: the sequence crosses into its second block.
    check_decoding(&ctx, KvDtype::F32, &[(0, 13)], 7);
}

#[test]
fn a_warm_batched_decode_step_is_one_submission_that_creates_nothing() {
    let ctx = own_context(None);
    // Two sequences of different lengths decoding together; the first crosses a block.
    check_decoding(&ctx, KvDtype::F16, &[(3, 14), (1, 5)], 5);
}

#[test]
fn warm_steps_of_two_shapes_and_all_logits_create_nothing() {
    // Scoring chunks of 4 tokens (every token's logits) alternating with decode steps: both
    // shapes stay prepared, so every step after each shape's first creates nothing.
    let ctx = own_context(None);
    let c = toy_config(1);
    let w = random_weights(&c, 32);
    let model = Decoder::upload(&ctx, c, &w, Precision::F32).unwrap();
    let ids = tokens(40, c.vocab, 9);
    let mut cache = cache_for(&ctx, &c, KvDtype::F32, &[0]);
    let mut at = 0;
    let mut last = Vec::new();
    for round in 0..4 {
        let (chunk, counters) = counted(
            &ctx,
            &model,
            &mut cache,
            &[(0, &ids[at..at + 4])],
            Logits::All,
        );
        assert_eq!(chunk.len(), 4 * c.vocab);
        if round > 0 {
            assert_warm(&format!("chunk of round {round}"), &counters);
        }
        at += 4;
        let (logits, counters) = counted(
            &ctx,
            &model,
            &mut cache,
            &[(0, &ids[at..at + 1])],
            Logits::Last,
        );
        if round > 0 {
            assert_warm(&format!("decode step of round {round}"), &counters);
        }
        last = logits;
        at += 1;
    }
    // The same tokens prefilled at once by a fresh decoder, then the last one decoded: the
    // same bits (batch invariance, and nothing stale in the reused resources).
    let mut fresh = cache_for(&ctx, &c, KvDtype::F32, &[0]);
    let cold = Decoder::upload(&ctx, c, &w, Precision::F32).unwrap();
    let all = cold
        .forward_with(&ctx, &mut fresh, &[(0, &ids[..at - 1])], Logits::All)
        .unwrap();
    assert_eq!(all.logits.len(), (at - 1) * c.vocab);
    let cold_last = cold
        .forward(&ctx, &mut fresh, &[(0, &ids[at - 1..at])])
        .unwrap();
    // Dropping what the decoder keeps makes the next step build it again.
    model.clear_steps();
    let (_, counters) = counted(
        &ctx,
        &model,
        &mut cache,
        &[(0, &ids[at..at + 1])],
        Logits::Last,
    );
    assert!(
        counters.buffers_created > 0 && counters.bind_groups_created > 0,
        "after clear_steps: {counters:?}"
    );
    assert!(
        cold_last.logits == last,
        "chunked warm steps and a cold prefill differ"
    );
}

#[test]
fn shapes_prepared_ahead_leave_the_first_steps_only_the_plans_bindings() {
    // `Decoder::prepare_shape` for the prefill and the decode shapes (what `generate_text` does
    // before it times them) makes their products' and ops' pipelines, buffers and bind groups:
    // the first prefill and decode step create no buffer (the attention and append plans
    // still bind their inputs then), the next step nothing, and the logits have the bits of a
    // decoder that made its steps as it went.
    let ctx = own_context(None);
    let c = toy_config(2);
    let w = random_weights(&c, 33);
    let ids = tokens(12, c.vocab, 10);
    let model = Decoder::upload(&ctx, c, &w, Precision::F32).unwrap();
    let mut cache = cache_for(&ctx, &c, KvDtype::F16, &[0]);
    for lens in [9, 1] {
        let before = ctx.counters();
        model
            .prepare_shape(&ctx, &cache, &[lens], Logits::Last, ids.len())
            .unwrap();
        let made = ctx.counters().since(&before);
        assert_eq!(made.submissions, 0, "{made:?}");
        assert!(made.bind_groups_created > 0, "{lens}: {made:?}");
        // Prepared already: nothing more.
        let before = ctx.counters();
        model
            .prepare_shape(&ctx, &cache, &[lens], Logits::Last, ids.len())
            .unwrap();
        assert_eq!(ctx.counters().since(&before).bind_groups_created, 0);
    }
    assert_eq!(cache.allocator().len(0).unwrap(), 0, "the cache changed");
    let mut warm = Vec::new();
    for (i, step) in [&ids[..9], &ids[9..10], &ids[10..11]]
        .into_iter()
        .enumerate()
    {
        let (logits, counters) = counted(&ctx, &model, &mut cache, &[(0, step)], Logits::Last);
        if i < 2 {
            // The attention and append plans bind their inputs at a shape's first recording.
            assert_eq!(counters.submissions, 1, "step {i}: {counters:?}");
            assert_eq!(counters.buffers_created, 0, "step {i}: {counters:?}");
        } else {
            assert_warm(&format!("step {i}"), &counters);
        }
        warm.push(logits);
    }
    let steps: Vec<Vec<(SeqId, Vec<u32>)>> = [&ids[..9], &ids[9..10], &ids[10..11]]
        .iter()
        .map(|t| vec![(0, t.to_vec())])
        .collect();
    let cold = cold_run(&ctx, (&c, &w), KvDtype::F16, &steps);
    for (i, (a, b)) in warm.iter().zip(&cold).enumerate() {
        assert!(
            a.iter()
                .map(|v| v.to_bits())
                .eq(b.iter().map(|v| v.to_bits())),
            "step {i}: logits differ from a decoder that made its steps as it went"
        );
    }
    // Bad shapes and a cache of another model are refused.
    for bad in [&[][..], &[0][..], &[3, 0][..]] {
        assert!(model
            .prepare_shape(&ctx, &cache, bad, Logits::Last, 4)
            .is_err());
    }
    let other = cache_for(&ctx, &toy_config(8), KvDtype::F32, &[0]);
    assert!(model
        .prepare_shape(&ctx, &other, &[1], Logits::Last, 4)
        .is_err());
}

#[test]
fn a_step_with_a_pass_per_op_gives_the_same_bits_and_a_pass_named_for_each_op() {
    // A prefill of two sequences (their last rows gathered for the output projection), a
    // batched decode step and a decode step of one: the same logits bit for bit with one
    // pass a step and with a pass per op, and the per-op passes carry the ops' names in the
    // order a step records them.
    let ctx = own_context(None);
    let c = toy_config(2);
    let w = random_weights(&c, 33);
    let model = Decoder::upload(&ctx, c, &w, Precision::F32).unwrap();
    let (a, b) = (tokens(11, c.vocab, 7), tokens(6, c.vocab, 8));
    let steps: [Vec<(SeqId, &[u32])>; 3] = [
        vec![(0, &a[..9]), (1, &b[..5])],
        vec![(0, &a[9..10]), (1, &b[5..6])],
        vec![(0, &a[10..11])],
    ];
    let run = |per_op: bool| -> (Vec<Vec<u32>>, Vec<Vec<PassTime>>) {
        model.set_pass_per_op(per_op);
        assert_eq!(model.pass_per_op(), per_op);
        let mut cache = cache_for(&ctx, &c, KvDtype::F16, &[0, 1]);
        let runs = steps
            .iter()
            .map(|batch| {
                let (out, _, passes) = ctx
                    .timed_passes(|| model.forward(&ctx, &mut cache, batch))
                    .unwrap();
                let bits = out.logits.iter().map(|v| v.to_bits()).collect();
                (bits, passes)
            })
            .unzip();
        model.set_pass_per_op(false);
        runs
    };
    let (one, one_passes) = run(false);
    let (split, split_passes) = run(true);
    for (i, (x, y)) in one.iter().zip(&split).enumerate() {
        assert!(x == y, "step {i}: a pass per op changed the logits");
    }
    if !ctx.caps().timestamps {
        // Without timestamps nothing is timed pass by pass.
        assert!(one_passes.iter().chain(&split_passes).all(Vec::is_empty));
        return;
    }
    let layer = [
        op::ATTN_NORM,
        op::QKV,
        op::ROPE,
        op::APPEND,
        op::ATTENTION,
        op::O,
        op::FFN_NORM,
        op::GATE,
        op::UP,
        op::SWIGLU,
        op::DOWN,
    ];
    for (i, (one, split)) in one_passes.iter().zip(&split_passes).enumerate() {
        let labels: Vec<&str> = one.iter().map(|p| p.label.as_str()).collect();
        assert_eq!(labels, ["decoder step"], "step {i}, one pass");
        let mut want = vec![op::EMBED];
        for _ in 0..c.layers {
            want.extend(layer);
        }
        want.push(op::FINAL_NORM);
        if steps[i].len() > 1 {
            want.push(op::GATHER);
        }
        want.push(op::HEAD);
        let labels: Vec<&str> = split.iter().map(|p| p.label.as_str()).collect();
        assert_eq!(labels, want, "step {i}, a pass per op");
        assert!(
            split
                .iter()
                .all(|p| p.seconds.is_finite() && p.seconds >= 0.0),
            "step {i}: {split:?}"
        );
    }
}
