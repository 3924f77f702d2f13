//! The telemetry of a serving run: time to first token and inter-token latency (p50, p95),
//! output tokens per second, KV block utilization, prefix hit rate, preemptions, recomputed
//! tokens, failed admissions and appends.

use super::scheduler::{Counters, Finished};

/// A run's summary.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RunStats {
    /// Requests submitted.
    pub requested: usize,
    /// Requests finished.
    pub completed: usize,
    /// Output tokens of the finished requests.
    pub output_tokens: usize,
    /// Seconds from the first arrival to the last token.
    pub seconds: f64,
    /// `output_tokens / seconds`.
    pub throughput_tok_s: f64,
    /// Time to first token, median and 95th percentile.
    pub ttft_p50_s: f64,
    /// See [`ttft_p50_s`](Self::ttft_p50_s).
    pub ttft_p95_s: f64,
    /// Inter-token latency, median and 95th percentile.
    pub itl_p50_s: f64,
    /// See [`itl_p50_s`](Self::itl_p50_s).
    pub itl_p95_s: f64,
    /// Mean and peak fraction of the cache's blocks in use after each step.
    pub block_utilization_mean: f64,
    /// See [`block_utilization_mean`](Self::block_utilization_mean).
    pub block_utilization_peak: f64,
    /// Prompt tokens found in the prefix cache / prompt tokens.
    pub prefix_hit_rate: f64,
    /// Preemptions.
    pub preemptions: usize,
    /// Tokens computed again after preemption.
    pub recomputed_tokens: usize,
    /// Refused admissions.
    pub failed_admissions: usize,
    /// Appends that failed (0 by construction).
    pub failed_appends: usize,
    /// Steps run.
    pub steps: usize,
}

/// The `q`-quantile (0..=1) of `x` by the nearest-rank method; NaN for no values.
pub fn quantile(x: &[f64], q: f64) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    let mut v = x.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

impl RunStats {
    /// The summary of `finished` requests out of `requested`, with the scheduler's counters.
    pub fn new(requested: usize, finished: &[Finished], counters: &Counters) -> Self {
        let ttft: Vec<f64> = finished.iter().map(Finished::ttft).collect();
        let itl: Vec<f64> = finished.iter().flat_map(|f| f.inter_token()).collect();
        let output_tokens = finished.iter().map(|f| f.output.len()).sum();
        let start = finished
            .iter()
            .map(|f| f.arrival)
            .fold(f64::INFINITY, f64::min);
        let end = finished
            .iter()
            .filter_map(|f| f.token_times.last().copied())
            .fold(f64::NEG_INFINITY, f64::max);
        let seconds = if finished.is_empty() {
            0.0
        } else {
            end - start
        };
        let u: Vec<f64> = counters.utilization.iter().map(|u| u.1).collect();
        Self {
            requested,
            completed: finished.len(),
            output_tokens,
            seconds,
            throughput_tok_s: if seconds > 0.0 {
                output_tokens as f64 / seconds
            } else {
                0.0
            },
            ttft_p50_s: quantile(&ttft, 0.5),
            ttft_p95_s: quantile(&ttft, 0.95),
            itl_p50_s: quantile(&itl, 0.5),
            itl_p95_s: quantile(&itl, 0.95),
            block_utilization_mean: if u.is_empty() {
                0.0
            } else {
                u.iter().sum::<f64>() / u.len() as f64
            },
            block_utilization_peak: u.iter().copied().fold(0.0, f64::max),
            prefix_hit_rate: counters.prefix_hit_rate(),
            preemptions: counters.preemptions,
            recomputed_tokens: counters.recomputed_tokens,
            failed_admissions: counters.failed_admissions,
            failed_appends: counters.failed_appends,
            steps: counters.steps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let x = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(quantile(&x, 0.5), 3.0);
        assert_eq!(quantile(&x, 0.95), 5.0);
        assert_eq!(quantile(&x, 0.0), 1.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn stats_of_two_requests() {
        let f = |id, arrival: f64, times: Vec<f64>| Finished {
            id,
            prompt_len: 3,
            output: vec![1; times.len()],
            arrival,
            token_times: times,
            preemptions: 0,
        };
        let done = [f(1, 0.0, vec![1.0, 1.5, 2.0]), f(2, 0.5, vec![3.0, 4.0])];
        let c = Counters {
            prompt_tokens: 6,
            prefix_hit_tokens: 3,
            utilization: vec![(1.0, 0.5), (2.0, 1.0)],
            ..Counters::default()
        };
        let s = RunStats::new(3, &done, &c);
        assert_eq!((s.requested, s.completed, s.output_tokens), (3, 2, 5));
        assert_eq!(s.seconds, 4.0);
        assert_eq!(s.throughput_tok_s, 1.25);
        assert_eq!((s.ttft_p50_s, s.ttft_p95_s), (1.0, 2.5));
        assert_eq!((s.itl_p50_s, s.itl_p95_s), (0.5, 1.0));
        assert_eq!(s.prefix_hit_rate, 0.5);
        assert_eq!(
            (s.block_utilization_mean, s.block_utilization_peak),
            (0.75, 1.0)
        );
    }
}
