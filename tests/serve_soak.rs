//! Soak test of the continuous-batching scheduler (issue 15) on the toy model.
//!
//! One paged KV cache, small enough to bind, serves a long run of epochs. Each epoch is a fresh
//! [`Scheduler`] with its own preemption policy (swap and recompute alternate), concurrency,
//! step token budget and EOS, fed by random (Poisson) arrivals, some submitted before they
//! arrive. Prompts share system prefixes, repeat earlier prompts, or continue an earlier
//! request's prompt and output (so prefix hits land on blocks written by decode steps as well
//! as by prefills). Between steps the test forks running requests' sequences through
//! [`PagedKvCache::fork`] (the scheduler has no fork of its own) and drives the forks itself,
//! batched, so that blocks are shared with running, swapped and recomputed requests and
//! copy-on-write happens under the scheduler. After an epoch's arrivals stop, it drains.
//!
//! After every step: the allocator's invariants hold; no append failed; every submitted request
//! is in exactly one of waiting, running, preempted (swapped or dropped) and finished (derived
//! from the scheduler's first-come-first-served admission, its admitted-prompt-token counter,
//! the cache's sequences, the swap counters and the finished list); every running request's
//! cached tokens are its expected tokens; every finished request's output equals, token for
//! token, the greedy run of that request alone (its own cache, no preemption, whole prompt in one
//! step); every fork predicts its parent's expected tokens. After every epoch every block is
//! free, and at the end one sequence can take the whole pool (every cached prefix block was
//! evictable). The run must have swapped, recomputed, hit the prefix cache and forked.
//!
//! `KVATTN_SOAK_STEPS` sets the scheduler steps (default [`DEFAULT_STEPS`]; at least two epochs
//! run, and the last one's drain adds steps), `KVATTN_SOAK_SEED` the seed (decimal or `0x` hex; default
//! [`DEFAULT_SEED`]). The seed and the figures go to stderr even when the test passes.

mod common;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::time::Instant;

use kvattn::cache::allocator::SeqId;
use kvattn::cache::paged::{AppendBatch, PagedKvCache, PoolSize};
use kvattn::decoder::model::Decoder;
use kvattn::decoder::sampling::argmax;
use kvattn::decoder::toy::{random_weights, toy_config};
use kvattn::quant::KvDtype;
use kvattn::rng::SplitMix64;
use kvattn::serve::{Preemption, Request, Scheduler, SchedulerConfig};
use kvattn::shader::Precision;

use common::gpu;

/// Scheduler steps when `KVATTN_SOAK_STEPS` is not set: about two minutes on lavapipe or
/// llvmpipe on two cores, two thirds of it in the runs alone that give the expected outputs.
const DEFAULT_STEPS: usize = 600;
/// Seed when `KVATTN_SOAK_SEED` is not set.
const DEFAULT_SEED: u64 = 0x50A4_2026;
/// Token slots per block.
const BLOCK_SIZE: usize = 2;
/// Blocks in the soak's cache: 80 tokens, about four average requests (prompt and output) or
/// two of the longest, so preemption happens.
const NUM_BLOCKS: usize = 40;
/// Longest prompt.
const MAX_PROMPT: usize = 20;
/// Most tokens a request generates.
const MAX_NEW: usize = 16;
/// Fork sequences get ids from here up (requests count up from 0).
const FORK_BASE: SeqId = 1 << 40;
/// Steps in a row that process nothing before the run is declared stalled.
const MAX_IDLE: usize = 2_000;

/// Writes a line to stderr directly: libtest captures `eprintln!` of passing tests, and the
/// figures belong in the CI log.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "serve_soak: {line}");
}

fn env_or<T>(name: &str, default: T, parse: impl Fn(&str) -> Option<T>) -> T {
    match std::env::var(name) {
        Ok(v) => parse(v.trim()).unwrap_or_else(|| panic!("{name}={v:?} is not valid")),
        Err(_) => default,
    }
}

fn parse_seed(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(&hex.replace('_', ""), 16).ok(),
        None => s.replace('_', "").parse().ok(),
    }
}

/// Uniform in `lo..=hi`.
fn range(r: &mut SplitMix64, lo: usize, hi: usize) -> usize {
    lo + (r.next_u64() % (hi - lo + 1) as u64) as usize
}

fn token(r: &mut SplitMix64, vocab: usize) -> u32 {
    (r.next_u64() % vocab as u64) as u32
}

/// Expected outputs: each prompt generated greedily alone, in a cache of its own without
/// prefix caching or preemption, the whole prompt in one step and then one token per step.
/// Memoized by prompt: a shorter budget takes the first tokens of a longer run's output
/// (greedy decoding does not look ahead).
struct Oracle<'a> {
    model: &'a Decoder,
    cache: PagedKvCache,
    memo: HashMap<Vec<u32>, Vec<u32>>,
    runs: usize,
}

impl<'a> Oracle<'a> {
    fn new(model: &'a Decoder) -> Self {
        let mut kv = model.config().kv_config(KvDtype::F16);
        kv.block_size = BLOCK_SIZE;
        kv.prefix_caching = false;
        let blocks = (MAX_PROMPT + MAX_NEW).div_ceil(BLOCK_SIZE);
        Self {
            model,
            cache: PagedKvCache::new(gpu(), kv, PoolSize::Blocks(blocks)).unwrap(),
            memo: HashMap::new(),
            runs: 0,
        }
    }

    /// The first `n` tokens greedy decoding generates after `prompt`.
    fn generate(&mut self, prompt: &[u32], n: usize) -> Vec<u32> {
        if let Some(out) = self.memo.get(prompt).filter(|o| o.len() >= n) {
            return out[..n].to_vec();
        }
        let ctx = gpu();
        self.runs += 1;
        self.cache.add_sequence(0, &[]).unwrap();
        let mut out = Vec::with_capacity(n);
        let mut step = self.model.forward(ctx, &mut self.cache, &[(0, prompt)]);
        loop {
            let next = argmax(&step.unwrap().logits).unwrap();
            out.push(next);
            if out.len() == n {
                break;
            }
            step = self.model.forward(ctx, &mut self.cache, &[(0, &[next])]);
        }
        self.cache.free(0).unwrap();
        self.memo.insert(prompt.to_vec(), out.clone());
        out
    }
}

/// A submitted request as the test knows it.
struct Sub {
    id: u64,
    prompt_len: usize,
    arrival: f64,
    /// Prompt and the greedy output of `max_new` tokens, EOS ignored.
    reference: Vec<u32>,
    /// The output the scheduler must produce (the reference's, cut after the first EOS).
    expected: Vec<u32>,
}

/// A fork of a running request's sequence, driven by the test.
struct Fork {
    id: SeqId,
    parent: u64,
    /// The parent's reference tokens: what the fork must predict.
    reference: Vec<u32>,
    prompt_len: usize,
    /// Freed when it holds this many tokens.
    stop: usize,
}

/// Figures of the whole run.
#[derive(Default, Debug)]
struct Tally {
    steps: usize,
    idle_steps: usize,
    epochs: usize,
    submitted: usize,
    completed: usize,
    output_tokens: usize,
    swaps: usize,
    recomputes: usize,
    recomputed_tokens: usize,
    prompt_tokens: usize,
    prefix_hit_tokens: usize,
    failed_admissions: usize,
    forks: usize,
    fork_tokens: usize,
    fork_predictions: usize,
    forks_dropped: usize,
    most_live: usize,
    /// Seconds in the scheduler's steps, the runs alone and the forks' steps.
    sched_s: f64,
    alone_s: f64,
    forks_s: f64,
}

/// Prompt kinds: a shared system prefix and a tail, an earlier prompt again, a cut of an
/// earlier request's prompt and output with a new tail, or random tokens.
fn new_prompt(
    r: &mut SplitMix64,
    vocab: usize,
    systems: &[Vec<u32>],
    history: &[(usize, Vec<u32>)],
) -> Vec<u32> {
    let tail =
        |r: &mut SplitMix64, n: usize| -> Vec<u32> { (0..n).map(|_| token(r, vocab)).collect() };
    // One of the last 32 requests: prompt length, prompt and output.
    let recent = |r: &mut SplitMix64| history.len() - 1 - range(r, 0, history.len().min(32) - 1);
    match range(r, 0, 99) {
        0..=39 => {
            let mut p = systems[range(r, 0, systems.len() - 1)].clone();
            let n = range(r, 1, 4);
            p.extend(tail(r, n));
            p
        }
        40..=64 if !history.is_empty() => {
            let h = &history[recent(r)].1;
            let cut = range(r, 1, h.len().min(MAX_PROMPT - 1));
            let mut p = h[..cut].to_vec();
            let n = range(r, 1, (MAX_PROMPT - cut).min(4));
            p.extend(tail(r, n));
            p
        }
        65..=79 if !history.is_empty() => {
            // An earlier prompt again.
            let (len, h) = &history[recent(r)];
            h[..*len].to_vec()
        }
        _ => {
            let n = range(r, 1, 12);
            tail(r, n)
        }
    }
}

/// Distinct blocks the forks hold.
fn fork_blocks(cache: &PagedKvCache, forks: &[Fork]) -> usize {
    let mut blocks = HashSet::new();
    for f in forks {
        blocks.extend(cache.block_table(f.id).unwrap().iter().copied());
    }
    blocks.len()
}

#[test]
fn scheduler_soak_with_preemption_prefix_hits_and_forks() {
    let steps_target = env_or("KVATTN_SOAK_STEPS", DEFAULT_STEPS, |s| {
        s.replace('_', "").parse().ok()
    });
    let seed = env_or("KVATTN_SOAK_SEED", DEFAULT_SEED, parse_seed);
    let start = Instant::now();
    let ctx = gpu();
    let adapter = ctx.adapter();
    report(&format!(
        "{} ({}), seed {seed:#x} (KVATTN_SOAK_SEED), {steps_target} steps (KVATTN_SOAK_STEPS); \
         cache of {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens, prompts up to {MAX_PROMPT} tokens, \
         up to {MAX_NEW} generated",
        adapter.name, adapter.backend
    ));
    let config = toy_config(2);
    let model = Decoder::upload(ctx, config, &random_weights(&config, 77), Precision::F32).unwrap();
    let vocab = config.vocab;
    let mut oracle = Oracle::new(&model);
    let mut kv = config.kv_config(KvDtype::F16);
    kv.block_size = BLOCK_SIZE;
    let mut cache = PagedKvCache::new(ctx, kv, PoolSize::Blocks(NUM_BLOCKS)).unwrap();
    let longest = cache.allocator().blocks_for(MAX_PROMPT + MAX_NEW);
    // While the forks hold at most this many blocks, the oldest running request can always
    // take its next step alone (its longest sequence plus a copy-on-write block), so the
    // scheduler never runs out of blocks with one request running.
    let fork_budget = NUM_BLOCKS - longest - 1;

    let mut r = SplitMix64::new(seed);
    let systems: Vec<Vec<u32>> = [4, 8, 13]
        .iter()
        .map(|&n| (0..n).map(|_| token(&mut r, vocab)).collect())
        .collect();
    let mut history: Vec<(usize, Vec<u32>)> = Vec::new();
    let mut t = Tally::default();
    let mut forks: Vec<Fork> = Vec::new();
    let mut next_id: u64 = 0;
    let mut next_fork: SeqId = FORK_BASE;
    let mut clock = 0.0f64;
    let mut policy = if r.next_u64() % 2 == 0 {
        Preemption::Swap
    } else {
        Preemption::Recompute
    };

    // At least two epochs (one of each preemption policy), and past the steps asked for (up to
    // four times as many) until both policies have preempted.
    let preempted_both = |t: &Tally| t.swaps > 0 && t.recomputes > 0;
    while t.epochs < 2
        || t.steps < steps_target
        || (!preempted_both(&t) && t.steps < 4 * steps_target)
    {
        t.epochs += 1;
        let cfg = SchedulerConfig {
            max_step_tokens: [5, 8, 16, 32][range(&mut r, 0, 3)],
            max_running: range(&mut r, 5, 8),
            preemption: policy,
            eos: if range(&mut r, 0, 2) == 0 && !history.is_empty() {
                // A token greedy decoding produced before: some requests will end at it.
                let h = &history[range(&mut r, 0, history.len() - 1)].1;
                Some(h[h.len() - 1])
            } else {
                None
            },
        };
        // Arrivals of prompt groups per step: 0.8 to 1.6 times what the epoch serves (about 24
        // tokens of work per group; a step computes its token budget or, in decode, about one
        // token per running request), so the queue builds up and drains without taking over.
        let capacity = cfg.max_step_tokens.min(cfg.max_running + 1) as f64 / 24.0;
        let rate = capacity * (0.8 + 0.8 * r.uniform());
        let arrivals_end = t.steps + range(&mut r, 100, 400).min(steps_target.div_ceil(2));
        let mut sched = Scheduler::new(cfg).unwrap();
        let mut subs: Vec<Sub> = Vec::new();
        let mut index: HashMap<u64, usize> = HashMap::new();
        // prefix[i]: prompt tokens of the first i submitted requests.
        let mut prefix = vec![0usize];
        let mut admitted = 0;
        let mut finished: HashSet<u64> = HashSet::new();
        let mut seen = 0;
        let mut running_before: HashSet<u64> = HashSet::new();
        let mut observed_preemptions: HashMap<u64, usize> = HashMap::new();
        let tel0 = cache.telemetry();
        let mut next_arrival = clock + -r.uniform_open().ln() / rate;
        let mut idle = 0;
        let first_step = t.steps;

        loop {
            let now = clock;
            let at = format!("seed {seed:#x}, step {}, epoch {}", t.steps, t.epochs);
            // Submit what has arrived, and a little of what will (the scheduler must hold it).
            let lookahead = range(&mut r, 0, 3) as f64;
            while t.steps < arrivals_end && next_arrival <= now + lookahead {
                // One prompt, sampled 1 to 3 times (greedy: the samples agree), each with its
                // own token budget.
                let prompt = new_prompt(&mut r, vocab, &systems, &history);
                let samples = [1, 1, 1, 2, 3][range(&mut r, 0, 4)];
                let budgets: Vec<usize> = (0..samples).map(|_| range(&mut r, 2, MAX_NEW)).collect();
                let t0 = Instant::now();
                let out = oracle.generate(&prompt, *budgets.iter().max().unwrap());
                t.alone_s += t0.elapsed().as_secs_f64();
                for max_new in budgets {
                    let out = &out[..max_new];
                    let expected = match cfg.eos.and_then(|e| out.iter().position(|&x| x == e)) {
                        Some(i) => out[..=i].to_vec(),
                        None => out.to_vec(),
                    };
                    let mut reference = prompt.clone();
                    reference.extend_from_slice(out);
                    let id = next_id;
                    next_id += 1;
                    sched
                        .submit(
                            &cache,
                            Request {
                                id,
                                prompt: prompt.clone(),
                                max_new_tokens: max_new,
                                arrival: next_arrival,
                            },
                        )
                        .unwrap_or_else(|e| panic!("{at}: submit {id}: {e}"));
                    index.insert(id, subs.len());
                    prefix.push(prefix[prefix.len() - 1] + prompt.len());
                    history.push((prompt.len(), reference.clone()));
                    subs.push(Sub {
                        id,
                        prompt_len: prompt.len(),
                        arrival: next_arrival,
                        reference,
                        expected,
                    });
                    t.submitted += 1;
                }
                next_arrival += -r.uniform_open().ln() / rate;
            }
            if t.steps >= arrivals_end && sched.is_done() {
                break;
            }

            // Forks must leave the scheduler room for its oldest request alone.
            while fork_blocks(&cache, &forks) > fork_budget {
                let f = forks.remove(0);
                cache.free(f.id).unwrap();
                t.forks_dropped += 1;
            }

            let t0 = Instant::now();
            let processed = sched
                .step(ctx, &model, &mut cache, now, || now)
                .unwrap_or_else(|e| panic!("{at}: step: {e}"));
            t.sched_s += t0.elapsed().as_secs_f64();
            t.steps += 1;
            clock += 1.0;
            if processed == 0 {
                t.idle_steps += 1;
                idle += 1;
                assert!(idle < MAX_IDLE, "{at}: the scheduler stalls");
            } else {
                idle = 0;
            }

            // --- Checks after the step.
            let a = cache.allocator();
            a.check_invariants()
                .unwrap_or_else(|e| panic!("{at}: allocator invariants: {e}"));
            let c = sched.counters();
            assert_eq!(c.failed_appends, 0, "{at}: an append failed");
            // Admission is first come, first served: the admitted requests are the first
            // `admitted` submitted, whose prompt tokens the counter adds up.
            let before = admitted;
            while admitted < subs.len() && prefix[admitted] < c.prompt_tokens {
                admitted += 1;
            }
            assert_eq!(
                prefix[admitted], c.prompt_tokens,
                "{at}: the admitted prompt tokens are not those of the first requests"
            );
            for s in &subs[before..admitted] {
                assert!(
                    s.arrival <= now,
                    "{at}: request {} admitted at {now} before its arrival {}",
                    s.id,
                    s.arrival
                );
            }
            // Finished: each admitted, once, with exactly the output of its run alone.
            for f in &sched.finished()[seen..] {
                let i = *index
                    .get(&f.id)
                    .unwrap_or_else(|| panic!("{at}: unknown request {} finished", f.id));
                assert!(i < admitted, "{at}: request {} finished unadmitted", f.id);
                assert!(
                    finished.insert(f.id),
                    "{at}: request {} finished twice",
                    f.id
                );
                let s = &subs[i];
                assert_eq!(f.prompt_len, s.prompt_len, "{at}: request {}", f.id);
                assert_eq!(
                    f.output, s.expected,
                    "{at}: request {} (preempted {} times) differs from its run alone",
                    f.id, f.preemptions
                );
                assert_eq!(
                    f.token_times.len(),
                    f.output.len(),
                    "{at}: request {}",
                    f.id
                );
                assert!(
                    observed_preemptions.get(&f.id).copied().unwrap_or(0) <= f.preemptions,
                    "{at}: request {} was seen preempted more often than it counts",
                    f.id
                );
                t.completed += 1;
                t.output_tokens += f.output.len();
            }
            seen = sched.finished().len();
            // Running: the requests with a sequence in the cache; each admitted, unfinished,
            // its cached tokens a prefix of its reference.
            let mut running = HashSet::new();
            let mut fork_seqs = HashSet::new();
            for id in a.sequences() {
                if id >= FORK_BASE {
                    fork_seqs.insert(id);
                    continue;
                }
                let i = *index.get(&id).unwrap_or_else(|| {
                    panic!("{at}: the cache holds sequence {id}, not a request of this epoch")
                });
                assert!(i < admitted, "{at}: waiting request {id} is in the cache");
                assert!(
                    !finished.contains(&id),
                    "{at}: finished request {id} is in the cache"
                );
                let tokens = a.tokens(id).unwrap();
                assert_eq!(
                    tokens,
                    &subs[i].reference[..tokens.len()],
                    "{at}: request {id}'s cached tokens"
                );
                running.insert(id);
            }
            let live_forks: HashSet<SeqId> = forks.iter().map(|f| f.id).collect();
            assert_eq!(fork_seqs, live_forks, "{at}: fork sequences");
            assert!(
                running.len() <= cfg.max_running,
                "{at}: {} running, at most {}",
                running.len(),
                cfg.max_running
            );
            // Live: admitted and unfinished = running + preempted; the preempted ones are
            // swapped out (swap) or dropped (recompute), never both.
            let live = admitted - finished.len();
            assert_eq!(sched.live(), live, "{at}: live requests");
            let preempted = live
                .checked_sub(running.len())
                .unwrap_or_else(|| panic!("{at}: more running than live"));
            let tel = cache.telemetry();
            let swapped = (tel.swaps_out - tel0.swaps_out) - (tel.swaps_in - tel0.swaps_in);
            match policy {
                Preemption::Swap => assert_eq!(swapped as usize, preempted, "{at}: swapped"),
                Preemption::Recompute => assert_eq!(swapped, 0, "{at}: swaps under recompute"),
            }
            for id in running_before.difference(&running) {
                if !finished.contains(id) {
                    *observed_preemptions.entry(*id).or_default() += 1;
                }
            }
            t.most_live = t.most_live.max(live);
            running_before = running;

            // --- Forks: now and then fork a running request; advance every fork by a chunk
            // (several prompt tokens, or one token past the prompt) in one batch.
            if !running_before.is_empty() && range(&mut r, 0, 99) < 12 {
                let mut ids: Vec<u64> = running_before.iter().copied().collect();
                ids.sort_unstable();
                let parent = ids[range(&mut r, 0, ids.len() - 1)];
                let s = &subs[index[&parent]];
                let len = cache.allocator().len(parent).unwrap();
                if len + 1 < s.reference.len() {
                    let id = next_fork;
                    next_fork += 1;
                    cache.fork(parent, id).unwrap();
                    assert_eq!(
                        cache.allocator().tokens(id).unwrap(),
                        cache.allocator().tokens(parent).unwrap()
                    );
                    forks.push(Fork {
                        id,
                        parent,
                        reference: s.reference.clone(),
                        prompt_len: s.prompt_len,
                        stop: range(&mut r, len + 1, s.reference.len() - 1),
                    });
                    t.forks += 1;
                }
            }
            if !forks.is_empty() {
                let mut batch: Vec<(SeqId, std::ops::Range<usize>)> = Vec::new();
                for f in &forks {
                    let len = cache.allocator().len(f.id).unwrap();
                    let n = if len < f.prompt_len {
                        range(&mut r, 1, 4).min(f.prompt_len - len)
                    } else {
                        1
                    };
                    batch.push((f.id, len..(len + n).min(f.stop)));
                }
                let news: Vec<(SeqId, usize)> =
                    batch.iter().map(|(id, w)| (*id, w.len())).collect();
                let need = cache.blocks_needed(&news).unwrap();
                if need > cache.allocator().num_free_blocks()
                    || fork_blocks(&cache, &forks) + need > fork_budget
                {
                    let f = forks.remove(0);
                    cache.free(f.id).unwrap();
                    t.forks_dropped += 1;
                } else {
                    let inputs: Vec<(SeqId, &[u32])> = batch
                        .iter()
                        .zip(&forks)
                        .map(|((id, w), f)| (*id, &f.reference[w.clone()]))
                        .collect();
                    let t0 = Instant::now();
                    let out = model
                        .forward(ctx, &mut cache, &inputs)
                        .unwrap_or_else(|e| panic!("{at}: fork step: {e}"));
                    t.forks_s += t0.elapsed().as_secs_f64();
                    for (row, ((id, w), f)) in batch.iter().zip(&forks).enumerate() {
                        t.fork_tokens += w.len();
                        let len = w.end;
                        assert_eq!(
                            cache.allocator().tokens(*id).unwrap(),
                            &f.reference[..len],
                            "{at}: fork {id} of request {}",
                            f.parent
                        );
                        if len >= f.prompt_len {
                            let next = argmax(&out.logits[row * vocab..(row + 1) * vocab]).unwrap();
                            assert_eq!(
                                next, f.reference[len],
                                "{at}: fork {id} of request {} at {len} tokens predicts \
                                 otherwise than the request's run alone",
                                f.parent
                            );
                            t.fork_predictions += 1;
                        }
                    }
                    let (done, keep): (Vec<Fork>, Vec<Fork>) = forks
                        .drain(..)
                        .partition(|f| cache.allocator().len(f.id).unwrap() >= f.stop);
                    for f in done {
                        cache.free(f.id).unwrap();
                    }
                    forks = keep;
                }
                cache
                    .allocator()
                    .check_invariants()
                    .unwrap_or_else(|e| panic!("{at}: allocator invariants after the forks: {e}"));
            }
        }

        // --- The epoch drained: everything finished, every block free once the forks go.
        let at = format!(
            "seed {seed:#x}, end of epoch {} (step {})",
            t.epochs, t.steps
        );
        let c = sched.counters().clone();
        assert_eq!(finished.len(), subs.len(), "{at}: requests lost");
        assert_eq!(
            sched
                .finished()
                .iter()
                .map(|f| f.preemptions)
                .sum::<usize>(),
            c.preemptions,
            "{at}: preemptions per request do not add up"
        );
        let tel = cache.telemetry();
        let (out, back) = (tel.swaps_out - tel0.swaps_out, tel.swaps_in - tel0.swaps_in);
        match policy {
            Preemption::Swap => {
                assert_eq!(
                    (out as usize, back as usize),
                    (c.preemptions, c.preemptions),
                    "{at}"
                );
                t.swaps += c.preemptions;
            }
            Preemption::Recompute => {
                assert_eq!((out, back), (0, 0), "{at}");
                t.recomputes += c.preemptions;
            }
        }
        t.recomputed_tokens += c.recomputed_tokens;
        t.prompt_tokens += c.prompt_tokens;
        t.prefix_hit_tokens += c.prefix_hit_tokens;
        t.failed_admissions += c.failed_admissions;
        report(&format!(
            "epoch {} ({}, {} running, {} tokens per step, EOS {:?}, {:.2} arrivals per step): \
             {} requests, {} steps, {} preemptions, {} prefix hit tokens",
            t.epochs,
            policy.name(),
            cfg.max_running,
            cfg.max_step_tokens,
            cfg.eos,
            rate,
            subs.len(),
            t.steps - first_step,
            c.preemptions,
            c.prefix_hit_tokens
        ));
        for f in forks.drain(..) {
            cache.free(f.id).unwrap();
        }
        let a = cache.allocator();
        a.check_invariants()
            .unwrap_or_else(|e| panic!("{at}: allocator invariants: {e}"));
        assert_eq!(a.num_used_blocks(), 0, "{at}: blocks left in use");
        assert_eq!(a.sequences().count(), 0, "{at}: sequences left");
        policy = match policy {
            Preemption::Swap => Preemption::Recompute,
            Preemption::Recompute => Preemption::Swap,
        };
    }

    // --- Every block is free: one sequence can take the whole pool, evicting every cached
    // prefix block, and gives it back. (Its token ids are beyond the vocabulary, so its blocks,
    // whose rows are never written, can never be a prefix hit.)
    let tel = cache.telemetry();
    let evictions = tel.evictions;
    let all: Vec<u32> = (0..(NUM_BLOCKS * BLOCK_SIZE) as u32)
        .map(|i| 1_000_000 + i)
        .collect();
    cache.add_sequence(u64::MAX, &[]).unwrap();
    cache
        .append_tokens(ctx, &mut AppendBatch::new(), u64::MAX, &all)
        .unwrap();
    let full = cache.telemetry();
    assert_eq!(full.free_blocks, 0);
    assert_eq!(full.evictions - evictions, tel.cached_blocks as u64);
    cache.free(u64::MAX).unwrap();
    let a = cache.allocator();
    a.check_invariants().unwrap();
    assert_eq!((a.num_used_blocks(), a.num_free_blocks()), (0, NUM_BLOCKS));

    let tel = cache.telemetry();
    report(&format!(
        "{} steps ({} idle) in {} epochs, {:.1} s; {} requests submitted, {} completed ({} output \
         tokens, up to {} live at once), {} alone runs for the expected outputs; seconds in \
         the scheduler {:.1}, the runs alone {:.1}, the forks {:.1}",
        t.steps,
        t.idle_steps,
        t.epochs,
        start.elapsed().as_secs_f64(),
        t.submitted,
        t.completed,
        t.output_tokens,
        t.most_live,
        oracle.runs,
        t.sched_s,
        t.alone_s,
        t.forks_s
    ));
    report(&format!(
        "swaps {}, recomputes {} ({} tokens recomputed), prefix hits {} of {} prompt tokens at \
         admission ({} block hits in all), forks {} ({} tokens, {} predictions checked, {} \
         dropped for room), copy-on-write copies {}, evictions {}, failed admissions {}",
        t.swaps,
        t.recomputes,
        t.recomputed_tokens,
        t.prefix_hit_tokens,
        t.prompt_tokens,
        tel.prefix_hits,
        t.forks,
        t.fork_tokens,
        t.fork_predictions,
        t.forks_dropped,
        tel.cow_copies,
        tel.evictions,
        t.failed_admissions
    ));
    assert_eq!(t.completed, t.submitted, "requests lost");
    assert!(t.swaps > 0, "no request was swapped out: run more steps");
    assert!(
        t.recomputes > 0,
        "no request was recomputed: run more steps"
    );
    assert!(t.prefix_hit_tokens > 0, "no prefix hit: run more steps");
    assert!(
        t.forks > 0 && t.fork_predictions > 0,
        "no fork was checked: run more steps"
    );
    assert!(
        tel.cow_copies > 0,
        "no copy-on-write happened: run more steps"
    );
}
