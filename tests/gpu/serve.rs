//! The continuous-batching scheduler on the toy model: preempted requests continue token for
//! token (swap and recompute), K/V recomputed by a prefill equal those decode wrote, admission
//! never lets an append fail, prefix hits are counted, every block is free at the end, and a
//! random workload of 1,000 requests loses nothing.

use std::collections::HashMap;

use kvattn::cache::paged::{PagedKvCache, PoolSize};
use kvattn::decoder::model::Decoder;
use kvattn::decoder::toy::{random_weights, toy_config};
use kvattn::quant::KvDtype;
use kvattn::serve::{Preemption, Request, Scheduler, SchedulerConfig};
use kvattn::shader::Precision;

use crate::common::{gpu, Rng};

fn model() -> Decoder {
    let c = toy_config(2);
    Decoder::upload(gpu(), c, &random_weights(&c, 77), Precision::F32).unwrap()
}

fn cache(model: &Decoder, blocks: usize, block_size: usize) -> PagedKvCache {
    let mut kv = model.config().kv_config(KvDtype::F16);
    kv.block_size = block_size;
    PagedKvCache::new(gpu(), kv, PoolSize::Blocks(blocks)).unwrap()
}

/// Runs `requests` to completion on a step clock (time = steps run); returns the outputs by
/// id and the scheduler.
fn run(
    model: &Decoder,
    cache: &mut PagedKvCache,
    requests: &[Request],
    cfg: SchedulerConfig,
) -> (HashMap<u64, Vec<u32>>, Scheduler) {
    let mut s = Scheduler::new(cfg).unwrap();
    for r in requests {
        s.submit(cache, r.clone()).unwrap();
    }
    let mut t = 0.0;
    let mut idle = 0;
    while !s.is_done() {
        let n = s.step(gpu(), model, cache, t, || t + 0.5).unwrap();
        t += 1.0;
        idle = if n == 0 { idle + 1 } else { 0 };
        assert!(idle < 1000, "the scheduler stalls");
    }
    let out = s
        .finished()
        .iter()
        .map(|f| (f.id, f.output.clone()))
        .collect();
    (out, s)
}

fn requests(n: usize, seed: u64, shared_prefix: usize) -> Vec<Request> {
    let mut r = Rng::new(seed);
    let prefix: Vec<u32> = (0..shared_prefix)
        .map(|_| (r.next_u64() % 512) as u32)
        .collect();
    (0..n)
        .map(|i| {
            let len = 1 + (r.next_u64() % 30) as usize;
            let mut prompt = prefix.clone();
            prompt.extend((0..len).map(|_| (r.next_u64() % 512) as u32));
            Request {
                id: i as u64,
                prompt,
                max_new_tokens: 4 + (r.next_u64() % 20) as usize,
                arrival: (i / 3) as f64,
            }
        })
        .collect()
}

#[test]
fn preempted_requests_continue_token_for_token() {
    let m = model();
    let reqs = requests(8, 3, 0);
    let roomy = SchedulerConfig {
        max_step_tokens: 64,
        max_running: 8,
        preemption: Preemption::Swap,
        eos: None,
    };
    let (want, s) = run(&m, &mut cache(&m, 128, 8), &reqs, roomy);
    assert_eq!(s.counters().preemptions, 0);
    for policy in [Preemption::Swap, Preemption::Recompute] {
        let mut small = cache(&m, 14, 8);
        let cfg = SchedulerConfig {
            preemption: policy,
            ..roomy
        };
        let (got, s) = run(&m, &mut small, &reqs, cfg);
        let c = s.counters();
        assert!(
            c.preemptions > 0,
            "{policy:?}: the small cache preempted nothing"
        );
        assert_eq!(c.failed_appends, 0);
        if policy == Preemption::Recompute {
            assert!(c.recomputed_tokens > 0);
        }
        assert_eq!(
            got, want,
            "{policy:?}: outputs differ from the unpreempted run"
        );
        assert_eq!(
            small.allocator().num_used_blocks(),
            0,
            "{policy:?}: blocks left"
        );
        eprintln!(
            "{policy:?}: {} preemptions, {} recomputed tokens, {} failed admissions; outputs \
             identical for {} requests",
            c.preemptions,
            c.recomputed_tokens,
            c.failed_admissions,
            got.len()
        );
    }
}

#[test]
fn shared_prompts_hit_the_prefix_cache() {
    let m = model();
    let reqs = requests(6, 5, 32);
    let cfg = SchedulerConfig {
        max_step_tokens: 48,
        max_running: 2,
        preemption: Preemption::Recompute,
        eos: None,
    };
    let mut c = cache(&m, 64, 8);
    let (got, s) = run(&m, &mut c, &reqs, cfg);
    assert_eq!(got.len(), 6);
    // The first two requests compute the 32-token prefix; later ones find its 4 full blocks.
    assert!(
        s.counters().prefix_hit_rate() > 0.3,
        "{}",
        s.counters().prefix_hit_rate()
    );
    // Hits change nothing in the outputs: the same requests without prefix caching.
    let mut kv = m.config().kv_config(KvDtype::F16);
    kv.block_size = 8;
    kv.prefix_caching = false;
    let mut plain = PagedKvCache::new(gpu(), kv, PoolSize::Blocks(64)).unwrap();
    let (want, s2) = run(&m, &mut plain, &reqs, cfg);
    assert_eq!(s2.counters().prefix_hit_tokens, 0);
    assert_eq!(got, want);
}

#[test]
fn random_workload_of_1000_requests_loses_nothing() {
    let m = model();
    let mut r = Rng::new(11);
    let reqs: Vec<Request> = (0..1000)
        .map(|i| Request {
            id: 10_000 + i,
            prompt: (0..1 + r.next_u64() % 24)
                .map(|_| (r.next_u64() % 512) as u32)
                .collect(),
            max_new_tokens: 1 + (r.next_u64() % 8) as usize,
            arrival: (i / 50) as f64,
        })
        .collect();
    for policy in [Preemption::Recompute, Preemption::Swap] {
        let mut c = cache(&m, 40, 4);
        let cfg = SchedulerConfig {
            max_step_tokens: 96,
            max_running: 32,
            preemption: policy,
            eos: Some(7),
        };
        let (got, s) = run(&m, &mut c, &reqs, cfg);
        assert_eq!(got.len(), reqs.len(), "{policy:?}: requests lost");
        for q in &reqs {
            let out = &got[&q.id];
            // Every request ends at its budget or at EOS, never short of either.
            let ended_at_eos = out.last() == Some(&7);
            assert!(
                out.len() == q.max_new_tokens || (ended_at_eos && out.len() < q.max_new_tokens),
                "{policy:?}: request {} has {} of {} tokens",
                q.id,
                out.len(),
                q.max_new_tokens
            );
            assert!(!out[..out.len() - 1].contains(&7));
        }
        let counters = s.counters();
        assert_eq!(counters.failed_appends, 0);
        assert_eq!(c.allocator().num_used_blocks(), 0);
        c.allocator().check_invariants().unwrap();
        eprintln!(
            "{policy:?}: 1,000 requests, {} steps, {} preemptions, {} failed admissions",
            counters.steps, counters.preemptions, counters.failed_admissions
        );
    }
}

#[test]
fn requests_the_cache_can_never_hold_are_refused() {
    let m = model();
    let c = cache(&m, 4, 4);
    let mut s = Scheduler::new(SchedulerConfig {
        max_step_tokens: 8,
        max_running: 2,
        preemption: Preemption::Swap,
        eos: None,
    })
    .unwrap();
    let req = |id, len, new, arrival| Request {
        id,
        prompt: vec![1; len],
        max_new_tokens: new,
        arrival,
    };
    assert!(s.submit(&c, req(1, 10, 7, 0.0)).is_err()); // 17 tokens > 16 slots
    assert!(s.submit(&c, req(1, 0, 1, 0.0)).is_err());
    assert!(s.submit(&c, req(1, 2, 0, 0.0)).is_err());
    s.submit(&c, req(1, 2, 2, 1.0)).unwrap();
    assert!(s.submit(&c, req(1, 2, 2, 1.0)).is_err()); // duplicate id
    assert!(s.submit(&c, req(2, 2, 2, 0.5)).is_err()); // out of order
    assert!(s.submit(&c, req(3, 2, 2, f64::NAN)).is_err());
    assert!(Scheduler::new(SchedulerConfig {
        max_step_tokens: 0,
        max_running: 1,
        preemption: Preemption::Swap,
        eos: None,
    })
    .is_err());
}
