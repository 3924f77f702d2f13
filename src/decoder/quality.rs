//! What a KV storage format costs a real model: its next-token distributions compared with a
//! reference run (f16 KV) over the same teacher-forced text. Per query position, the greedy
//! tokens (argmax) agree or not, and the KL divergence `KL(P_ref || P_format)` of the two
//! softmax distributions is computed in f64. Positions are bucketed into context slices
//! ([`SLICES`]: 0-128, 128-512, 512+) so the cost can be read by context length.
//!
//! `examples/kv_quality.rs` drives it over a GGUF model; this module holds only the host-side
//! arithmetic.

use super::sampling::argmax;
use crate::{Error, Result};

/// A range of query positions `[start, end)`; `end == None`: no upper bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextSlice {
    /// First position.
    pub start: usize,
    /// One past the last position, `None` for an open end.
    pub end: Option<usize>,
}

impl ContextSlice {
    /// Whether `position` falls in the slice.
    pub fn contains(&self, position: usize) -> bool {
        position >= self.start && self.end.is_none_or(|e| position < e)
    }

    /// "0-128", "128-512", "512+".
    pub fn name(&self) -> String {
        match self.end {
            Some(e) => format!("{}-{e}", self.start),
            None => format!("{}+", self.start),
        }
    }
}

/// The context slices of the report: positions 0-128, 128-512 and 512 on.
pub const SLICES: [ContextSlice; 3] = [
    ContextSlice {
        start: 0,
        end: Some(128),
    },
    ContextSlice {
        start: 128,
        end: Some(512),
    },
    ContextSlice {
        start: 512,
        end: None,
    },
];

/// The index in [`SLICES`] of the slice holding `position`.
pub fn slice_index(position: usize) -> usize {
    SLICES
        .iter()
        .position(|s| s.contains(position))
        .expect("the slices cover every position")
}

/// `log softmax(logits)` in f64 (max-subtracted, so any finite logits are safe).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .map(|&x| f64::from(x))
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&x| f64::from(x) - log_z).collect()
}

/// `KL(P || Q) = sum_i p_i (log p_i - log q_i)` from log-probabilities, in nats. Terms with
/// `p_i == 0` (underflowed) contribute nothing; a rounding-negative sum is clamped to 0.
pub fn kl_divergence(log_p: &[f64], log_q: &[f64]) -> f64 {
    assert_eq!(log_p.len(), log_q.len(), "distributions of different sizes");
    let kl: f64 = log_p
        .iter()
        .zip(log_q)
        .map(|(&lp, &lq)| {
            let p = lp.exp();
            if p == 0.0 {
                0.0
            } else {
                p * (lp - lq)
            }
        })
        .sum();
    kl.max(0.0)
}

/// Agreement and KL divergence summed over the positions of one slice.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SliceStats {
    /// Positions counted.
    pub tokens: usize,
    /// Positions whose greedy token equals the reference's.
    pub agree: usize,
    /// Sum of `KL(P_ref || P)` over the positions, nats.
    pub kl_sum: f64,
}

impl SliceStats {
    /// The fraction of positions whose greedy token agrees (1 for no positions).
    pub fn agreement(&self) -> f64 {
        if self.tokens == 0 {
            1.0
        } else {
            self.agree as f64 / self.tokens as f64
        }
    }

    /// The mean KL divergence per position (0 for no positions).
    pub fn mean_kl(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.kl_sum / self.tokens as f64
        }
    }

    /// Adds the counts of `other`.
    pub fn merge(&mut self, other: &SliceStats) {
        self.tokens += other.tokens;
        self.agree += other.agree;
        self.kl_sum += other.kl_sum;
    }
}

/// One format's statistics against the reference, per slice of [`SLICES`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct QualityStats {
    /// Per slice, in the order of [`SLICES`].
    pub slices: [SliceStats; 3],
}

/// The reference's rows of one chunk, prepared once for every format compared with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceRows {
    /// Position of the first row.
    pub first_position: usize,
    /// Vocabulary size (row length).
    pub vocab: usize,
    /// Per row: the greedy token.
    pub argmax: Vec<u32>,
    /// Per row: the log-probabilities.
    pub log_probs: Vec<Vec<f64>>,
}

/// Checks that `logits` is whole rows of `vocab` finite values.
fn check_rows(what: &str, logits: &[f32], vocab: usize) -> Result<usize> {
    if vocab == 0 || logits.len() % vocab != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what}: {} logits are not whole rows of {vocab}",
            logits.len()
        )));
    }
    if let Some(i) = logits.iter().position(|x| !x.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "{what}: logit {} of row {} is {}",
            i % vocab,
            i / vocab,
            logits[i]
        )));
    }
    Ok(logits.len() / vocab)
}

impl ReferenceRows {
    /// The reference's logits `[rows, vocab]` for the query positions from `first_position`.
    pub fn new(first_position: usize, logits: &[f32], vocab: usize) -> Result<Self> {
        let rows = check_rows("reference", logits, vocab)?;
        let mut argmaxes = Vec::with_capacity(rows);
        let mut log_probs = Vec::with_capacity(rows);
        for row in logits.chunks_exact(vocab) {
            argmaxes.push(argmax(row)?);
            log_probs.push(log_softmax(row));
        }
        Ok(Self {
            first_position,
            vocab,
            argmax: argmaxes,
            log_probs,
        })
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.argmax.len()
    }
}

impl QualityStats {
    /// Adds one chunk: `logits` `[rows, vocab]` of the format at the reference's positions.
    pub fn add(&mut self, reference: &ReferenceRows, logits: &[f32]) -> Result<()> {
        let rows = check_rows("format", logits, reference.vocab)?;
        if rows != reference.rows() {
            return Err(Error::InvalidArgument(format!(
                "{rows} rows of logits against {} reference rows",
                reference.rows()
            )));
        }
        for (r, row) in logits.chunks_exact(reference.vocab).enumerate() {
            let s = &mut self.slices[slice_index(reference.first_position + r)];
            s.tokens += 1;
            s.agree += usize::from(argmax(row)? == reference.argmax[r]);
            s.kl_sum += kl_divergence(&reference.log_probs[r], &log_softmax(row));
        }
        Ok(())
    }

    /// Every slice together.
    pub fn overall(&self) -> SliceStats {
        let mut all = SliceStats::default();
        for s in &self.slices {
            all.merge(s);
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn slices_cover_positions_with_half_open_bounds() {
        assert_eq!(slice_index(0), 0);
        assert_eq!(slice_index(127), 0);
        assert_eq!(slice_index(128), 1);
        assert_eq!(slice_index(511), 1);
        assert_eq!(slice_index(512), 2);
        assert_eq!(slice_index(1_000_000), 2);
        let names: Vec<String> = SLICES.iter().map(|s| s.name()).collect();
        assert_eq!(names, ["0-128", "128-512", "512+"]);
    }

    #[test]
    fn log_softmax_matches_hand_values_and_survives_large_logits() {
        // softmax(0, ln 3) = (1/4, 3/4).
        let l = log_softmax(&[0.0, 3f32.ln()]);
        assert!(close(l[0].exp(), 0.25, 1e-7));
        assert!(close(l[1].exp(), 0.75, 1e-7));
        // Uniform over 4 tokens, whatever the offset.
        for x in log_softmax(&[1000.0; 4]) {
            assert!(close(x, -(4f64.ln()), 1e-12));
        }
        let big = log_softmax(&[-1.0e4, 0.0]);
        assert!(big[1].abs() < 1e-300 && big[0] < -9999.0);
    }

    #[test]
    fn kl_matches_hand_computed_distributions() {
        // P = (1/2, 1/2), Q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3).
        let p = [0.5f64.ln(), 0.5f64.ln()];
        let q = [0.25f64.ln(), 0.75f64.ln()];
        assert!(close(
            kl_divergence(&p, &q),
            0.5 * (4.0f64 / 3.0).ln(),
            1e-15
        ));
        // And the other way: 1/4 ln(1/2) + 3/4 ln(3/2).
        let back = 0.25 * 0.5f64.ln() + 0.75 * 1.5f64.ln();
        assert!(close(kl_divergence(&q, &p), back, 1e-15));
        assert_eq!(kl_divergence(&p, &p), 0.0);
        // A zero-probability reference token contributes nothing.
        let p0 = [f64::NEG_INFINITY, 0.0];
        assert!(close(kl_divergence(&p0, &q), -(0.75f64.ln()), 1e-15));
        // The same from logits: softmax(0, 0) vs softmax(0, ln 3).
        let lp = log_softmax(&[0.0, 0.0]);
        let lq = log_softmax(&[0.0, 3f32.ln()]);
        assert!(close(
            kl_divergence(&lp, &lq),
            0.5 * (4.0f64 / 3.0).ln(),
            1e-7
        ));
    }

    #[test]
    fn stats_count_agreement_and_kl_per_slice() {
        // Three rows of vocab 2 at positions 127, 128, 129: slice 0 gets one row, slice 1 two.
        let reference = [0.0, 0.0, 2.0, 0.0, 0.0, 3f32.ln()];
        let r = ReferenceRows::new(127, &reference, 2).unwrap();
        assert_eq!(r.argmax, [0, 0, 1]);
        let format = [0.0, 3f32.ln(), 2.0, 0.0, 0.0, 3f32.ln()];
        let mut s = QualityStats::default();
        s.add(&r, &format).unwrap();
        // Row 0: reference ties (argmax 0) but the format picks 1; KL = 1/2 ln(4/3).
        assert_eq!(
            (s.slices[0].tokens, s.slices[0].agree),
            (1, 0),
            "{:?}",
            s.slices
        );
        assert!(close(s.slices[0].kl_sum, 0.5 * (4.0f64 / 3.0).ln(), 1e-7));
        // Rows 1 and 2: identical logits, agreement, KL 0.
        assert_eq!((s.slices[1].tokens, s.slices[1].agree), (2, 2));
        assert_eq!(s.slices[1].mean_kl(), 0.0);
        assert_eq!(s.slices[2], SliceStats::default());
        assert_eq!(s.slices[2].agreement(), 1.0);
        let all = s.overall();
        assert_eq!((all.tokens, all.agree), (3, 2));
        assert!(close(all.agreement(), 2.0 / 3.0, 1e-15));
        assert!(close(all.mean_kl(), (4.0f64 / 3.0).ln() / 6.0, 1e-7));
    }

    #[test]
    fn bad_rows_are_refused() {
        assert!(ReferenceRows::new(0, &[0.0, 1.0, 2.0], 2).is_err());
        assert!(ReferenceRows::new(0, &[0.0, f32::NAN], 2).is_err());
        let r = ReferenceRows::new(0, &[0.0, 1.0], 2).unwrap();
        let mut s = QualityStats::default();
        assert!(s.add(&r, &[0.0, 1.0, 0.0, 1.0]).is_err());
        assert!(s.add(&r, &[f32::INFINITY, 1.0]).is_err());
        assert_eq!(s, QualityStats::default());
    }
}
