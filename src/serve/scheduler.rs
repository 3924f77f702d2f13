//! A continuous-batching scheduler over the [`Decoder`] and a [`PagedKvCache`] (the contract of
//! `seeds/001`, section 6): requests wait in arrival order; each step admits what fits, forms
//! one batch of prefill chunks and decode tokens under a token budget, and finishes requests at
//! their budget or EOS, freeing their blocks at once.
//!
//! - **Admission** happens only when the cache can hold the request's prompt (plus its first
//!   generated token) in unreserved free blocks beside what the running requests' pending
//!   tokens may take in the next step, and never ahead of an earlier request (first come,
//!   first served); a refusal is counted as a failed admission.
//! - **Before every step** the scheduler computes the blocks the batch may take
//!   ([`PagedKvCache::blocks_needed`]); while they exceed the free blocks it preempts the
//!   latest-arrived running request, by swapping its blocks out to host memory
//!   ([`Preemption::Swap`]) or by dropping them to recompute its tokens later
//!   ([`Preemption::Recompute`]). So an append never fails (`failed_appends` stays 0).
//! - **Preempted requests resume** (swap in, or prefill their tokens again) before any new
//!   request is admitted, oldest first. Greedy decoding then continues token for token as if
//!   nothing happened: every kernel is batch-invariant, and K/V recomputed by a prefill are
//!   bitwise the K/V that decode steps wrote.
//! - **Prefix caching**: a prompt's leading full blocks that the cache already holds (a shared
//!   system prompt) are reused and not prefilled again; the hits are counted.

use std::collections::VecDeque;

use crate::cache::allocator::SeqId;
use crate::cache::paged::{PagedKvCache, SwappedSequence};
use crate::decoder::model::Decoder;
use crate::decoder::sampling::argmax;
use crate::gpu::Context;
use crate::{Error, Result};

/// A generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Unique id (also the cache's sequence id while it runs).
    pub id: u64,
    /// Prompt tokens (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least one).
    pub max_new_tokens: usize,
    /// When it arrives, in seconds on the caller's clock.
    pub arrival: f64,
}

/// What to do with a running request when the cache cannot hold the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    /// Copy its blocks to host memory and bring them back later.
    Swap,
    /// Free its blocks and prefill its tokens again later.
    Recompute,
}

impl Preemption {
    /// `swap` or `recompute`.
    pub fn name(self) -> &'static str {
        match self {
            Preemption::Swap => "swap",
            Preemption::Recompute => "recompute",
        }
    }
}

/// Scheduler settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per step (prefill chunks and decode tokens together), at least 1.
    pub max_step_tokens: usize,
    /// Requests running at once (the concurrency), at least 1.
    pub max_running: usize,
    /// The preemption policy.
    pub preemption: Preemption,
    /// The end-of-sequence token, if generation stops at it.
    pub eos: Option<u32>,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The request's id.
    pub id: u64,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Generated tokens (EOS included when it ended the request).
    pub output: Vec<u32>,
    /// Arrival time.
    pub arrival: f64,
    /// When each output token was produced.
    pub token_times: Vec<f64>,
    /// Times it was preempted.
    pub preemptions: usize,
}

impl Finished {
    /// Time to first token.
    pub fn ttft(&self) -> f64 {
        self.token_times
            .first()
            .map_or(f64::NAN, |t| t - self.arrival)
    }

    /// Gaps between consecutive output tokens.
    pub fn inter_token(&self) -> impl Iterator<Item = f64> + '_ {
        self.token_times.windows(2).map(|w| w[1] - w[0])
    }
}

/// Counters of a run.
#[derive(Debug, Clone, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Counters {
    /// Steps run.
    pub steps: usize,
    /// Preemptions.
    pub preemptions: usize,
    /// Tokens whose K/V were dropped by preemption and computed again.
    pub recomputed_tokens: usize,
    /// Times the request at the head of the queue did not fit the cache.
    pub failed_admissions: usize,
    /// Appends that failed in a step (the scheduler's guarantee: 0).
    pub failed_appends: usize,
    /// Prompt tokens admitted.
    pub prompt_tokens: usize,
    /// Prompt tokens found in the prefix cache at admission.
    pub prefix_hit_tokens: usize,
    /// `(time, used blocks / blocks)` after each step.
    pub utilization: Vec<(f64, f64)>,
}

impl Counters {
    /// `prefix_hit_tokens / prompt_tokens` (0 without prompts).
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.prefix_hit_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// Where an admitted request's K/V are.
#[derive(Debug)]
enum Place {
    /// In the cache.
    Running,
    /// Swapped out to host memory.
    Swapped(SwappedSequence),
    /// Dropped; `dropped` tokens had been computed.
    Dropped { dropped: usize },
}

/// An admitted request.
#[derive(Debug)]
struct Live {
    req: Request,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache (or swapped out).
    computed: usize,
    token_times: Vec<f64>,
    preemptions: usize,
    place: Place,
}

impl Live {
    fn generated(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }
}

/// The scheduler.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    waiting: VecDeque<Request>,
    live: Vec<Live>,
    finished: Vec<Finished>,
    counters: Counters,
}

impl Scheduler {
    /// A scheduler with `cfg` (checked).
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        if cfg.max_step_tokens == 0 || cfg.max_running == 0 {
            return Err(Error::InvalidArgument(
                "the step token budget and the concurrency must be at least 1".into(),
            ));
        }
        Ok(Self {
            cfg,
            waiting: VecDeque::new(),
            live: Vec::new(),
            finished: Vec::new(),
            counters: Counters::default(),
        })
    }

    /// Queues `req`. Refused: an empty prompt, no tokens to generate, a duplicate id, an
    /// arrival before the last queued one, or a request the whole cache could never hold.
    pub fn submit(&mut self, cache: &PagedKvCache, req: Request) -> Result<()> {
        if req.prompt.is_empty() || req.max_new_tokens == 0 {
            return Err(Error::InvalidArgument(format!(
                "request {}: needs a prompt and at least one token to generate",
                req.id
            )));
        }
        let known = self.waiting.iter().any(|r| r.id == req.id)
            || self.live.iter().any(|l| l.req.id == req.id)
            || self.finished.iter().any(|f| f.id == req.id)
            || cache.allocator().contains(req.id);
        if known {
            return Err(Error::InvalidArgument(format!(
                "request id {} is already in use",
                req.id
            )));
        }
        if self.waiting.back().is_some_and(|r| r.arrival > req.arrival) || !req.arrival.is_finite()
        {
            return Err(Error::InvalidArgument(format!(
                "request {}: arrivals must be finite and in order",
                req.id
            )));
        }
        let a = cache.allocator();
        let most = a.blocks_for(req.prompt.len() + req.max_new_tokens);
        if most > a.num_blocks() {
            return Err(Error::OutOfBlocks {
                needed: most,
                available: a.num_blocks(),
            });
        }
        self.waiting.push_back(req);
        Ok(())
    }

    /// Whether every submitted request has finished.
    pub fn is_done(&self) -> bool {
        self.waiting.is_empty() && self.live.is_empty()
    }

    /// Finished requests, in finishing order.
    pub fn finished(&self) -> &[Finished] {
        &self.finished
    }

    /// The run's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Requests admitted and not finished (running or preempted).
    pub fn live(&self) -> usize {
        self.live.len()
    }

    fn running(&self) -> usize {
        self.live
            .iter()
            .filter(|l| matches!(l.place, Place::Running))
            .count()
    }

    /// Free blocks nobody reserved, less what the running requests' pending tokens may take:
    /// what admitting or resuming may use without forcing a preemption in the next step.
    fn room(&self, cache: &PagedKvCache) -> Result<usize> {
        let a = cache.allocator();
        let free = a.num_free_blocks() - a.num_reserved_blocks();
        let pending: Vec<(SeqId, usize)> = self
            .live
            .iter()
            .filter(|l| matches!(l.place, Place::Running))
            .map(|l| (l.req.id, (l.tokens.len() - l.computed).max(1)))
            .collect();
        Ok(free.saturating_sub(cache.blocks_needed(&pending)?))
    }

    /// Brings preempted requests back, oldest first, while they fit; false if one is left.
    fn resume(&mut self, ctx: &Context, cache: &mut PagedKvCache) -> Result<bool> {
        for i in 0..self.live.len() {
            if matches!(self.live[i].place, Place::Running) {
                continue;
            }
            let l = &self.live[i];
            // Room for its tokens and the next one, beside the running requests' next step.
            let fits = cache.allocator().blocks_for(l.tokens.len() + 1) <= self.room(cache)?;
            if !fits || self.running() >= self.cfg.max_running {
                return Ok(false);
            }
            let id = l.req.id;
            let place = std::mem::replace(&mut self.live[i].place, Place::Running);
            match place {
                Place::Swapped(swapped) => cache.swap_in(ctx, id, &swapped)?,
                Place::Dropped { dropped } => {
                    let l = &mut self.live[i];
                    // Whole blocks still in the prefix cache are reused; the rest is prefilled
                    // again (at least the last token, whose logits choose the next one).
                    let hits = cache.add_sequence(id, &l.tokens[..l.tokens.len() - 1])?;
                    l.computed = hits;
                    self.counters.recomputed_tokens += dropped.saturating_sub(hits);
                }
                Place::Running => {}
            }
        }
        Ok(true)
    }

    /// Admits waiting requests that have arrived by `now`, in order, while they fit.
    fn admit(&mut self, cache: &mut PagedKvCache, now: f64) -> Result<()> {
        while let Some(req) = self.waiting.front() {
            if req.arrival > now || self.running() >= self.cfg.max_running {
                break;
            }
            if cache.allocator().blocks_for(req.prompt.len() + 1) > self.room(cache)? {
                self.counters.failed_admissions += 1;
                break;
            }
            let req = self.waiting.pop_front().expect("front exists");
            // The last prompt token is always computed: its logits choose the first token.
            let hits = cache.add_sequence(req.id, &req.prompt[..req.prompt.len() - 1])?;
            self.counters.prompt_tokens += req.prompt.len();
            self.counters.prefix_hit_tokens += hits;
            self.live.push(Live {
                tokens: req.prompt.clone(),
                computed: hits,
                token_times: Vec::new(),
                preemptions: 0,
                place: Place::Running,
                req,
            });
        }
        Ok(())
    }

    /// Preempts the latest-arrived running request.
    fn preempt_last(&mut self, ctx: &Context, cache: &mut PagedKvCache) -> Result<()> {
        let i = (0..self.live.len())
            .rev()
            .find(|&i| matches!(self.live[i].place, Place::Running))
            .ok_or_else(|| Error::InvalidArgument("nothing to preempt".into()))?;
        let l = &mut self.live[i];
        l.preemptions += 1;
        self.counters.preemptions += 1;
        l.place = match self.cfg.preemption {
            Preemption::Swap => Place::Swapped(cache.swap_out(ctx, l.req.id)?),
            Preemption::Recompute => {
                let dropped = l.computed;
                cache.free(l.req.id)?;
                l.computed = 0;
                Place::Dropped { dropped }
            }
        };
        Ok(())
    }

    /// One step at time `now` (the caller's clock; `clock()` is read again after the model
    /// ran, to time the tokens): resume, admit, batch, preempt while the batch does not fit,
    /// run the model, take the next tokens. Returns the tokens the step processed (0 when
    /// nothing was runnable: e.g. every request arrives later).
    pub fn step(
        &mut self,
        ctx: &Context,
        model: &Decoder,
        cache: &mut PagedKvCache,
        now: f64,
        clock: impl Fn() -> f64,
    ) -> Result<usize> {
        if self.resume(ctx, cache)? {
            self.admit(cache, now)?;
        }
        loop {
            // The batch: running requests in arrival order, each its pending tokens, within
            // the token budget.
            let mut left = self.cfg.max_step_tokens;
            let mut batch: Vec<(usize, usize)> = Vec::new();
            for (i, l) in self.live.iter().enumerate() {
                if left == 0 {
                    break;
                }
                if matches!(l.place, Place::Running) {
                    let n = (l.tokens.len() - l.computed).min(left);
                    if n > 0 {
                        batch.push((i, n));
                        left -= n;
                    }
                }
            }
            if batch.is_empty() {
                return Ok(0);
            }
            let news: Vec<(SeqId, usize)> = batch
                .iter()
                .map(|&(i, n)| (self.live[i].req.id, n))
                .collect();
            if cache.blocks_needed(&news)? > cache.allocator().num_free_blocks() {
                if self.running() <= 1 {
                    return Err(Error::OutOfBlocks {
                        needed: cache.blocks_needed(&news)?,
                        available: cache.allocator().num_free_blocks(),
                    });
                }
                self.preempt_last(ctx, cache)?;
                continue;
            }
            let inputs: Vec<(SeqId, &[u32])> = batch
                .iter()
                .map(|&(i, n)| {
                    let l = &self.live[i];
                    (l.req.id, &l.tokens[l.computed..l.computed + n])
                })
                .collect();
            let out = match model.forward(ctx, cache, &inputs) {
                Ok(out) => out,
                Err(e) => {
                    if matches!(e, Error::OutOfBlocks { .. }) {
                        self.counters.failed_appends += 1;
                    }
                    return Err(e);
                }
            };
            let t = clock();
            let vocab = model.config().vocab;
            let mut done = Vec::new();
            for (row, &(i, n)) in batch.iter().enumerate() {
                let l = &mut self.live[i];
                l.computed += n;
                if l.computed < l.tokens.len() {
                    continue; // a prefill chunk that is not the last
                }
                let next = argmax(&out.logits[row * vocab..(row + 1) * vocab])?;
                l.tokens.push(next);
                l.token_times.push(t);
                if l.generated() >= l.req.max_new_tokens || Some(next) == self.cfg.eos {
                    done.push(i);
                }
            }
            for &i in done.iter().rev() {
                let l = self.live.remove(i);
                cache.free(l.req.id)?;
                self.finished.push(Finished {
                    id: l.req.id,
                    prompt_len: l.req.prompt.len(),
                    output: l.tokens[l.req.prompt.len()..].to_vec(),
                    arrival: l.req.arrival,
                    token_times: l.token_times,
                    preemptions: l.preemptions,
                });
            }
            self.counters.steps += 1;
            let a = cache.allocator();
            self.counters
                .utilization
                .push((t, a.num_used_blocks() as f64 / a.num_blocks() as f64));
            return Ok(news.iter().map(|n| n.1).sum());
        }
    }
}
