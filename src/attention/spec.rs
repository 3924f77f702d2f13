//! The attention problem, as the CPU reference and the GPU kernels both see it: head counts and
//! head dims ([`AttentionShape`]), the options that change the scores ([`AttentionOptions`]), and a
//! ragged batch of sequences in the FlashAttention varlen layout ([`RaggedBatch`]).
//!
//! The meaning of every option (score order, bottom-right masks, sinks, `lse`) is ARCHITECTURE.md
//! section 2; the reference in [`crate::reference`] is its executable form.

use std::ops::Range;

use crate::{Error, Result};

/// The longest sequence (keys, and so positions `0..MAX_TOKENS`) and the largest query chunk the
/// kernels accept: `2^31 - 1`. The kernels index keys and positions with u32, and the largest
/// sum they form is a query's position, at most `len_q + len_k`; with both below `2^31` no u32
/// sum of positions, lengths or offsets can wrap. Longer sequences are refused with
/// [`Error::InvalidArgument`] (see [`check_seq_len`]).
pub const MAX_TOKENS: usize = (1 << 31) - 1;

/// Checks that a sequence's `len_q` query tokens and `len_k` keys are within [`MAX_TOKENS`].
///
/// # Errors
/// [`Error::InvalidArgument`] naming `what` (for example `"sequence 3"`) when either is longer.
pub fn check_seq_len(what: &str, len_q: usize, len_k: usize) -> Result<()> {
    if len_q > MAX_TOKENS || len_k > MAX_TOKENS {
        return Err(Error::InvalidArgument(format!(
            "{what}: {len_q} queries over {len_k} keys; the kernels take at most {MAX_TOKENS} \
             (2^31 - 1) of each"
        )));
    }
    Ok(())
}

/// Head counts and head dims of one attention layer.
///
/// Query heads are grouped over KV heads: query head `h` reads KV head `h / group()`
/// (MHA: `group() == 1`; MQA: `num_kv_heads == 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Number of query heads `Hq`.
    pub num_q_heads: usize,
    /// Number of KV heads `Hkv`; must divide `num_q_heads`.
    pub num_kv_heads: usize,
    /// Head dim of Q and K (`d_qk`).
    pub head_dim_qk: usize,
    /// Head dim of V and of the output (`d_v`).
    pub head_dim_v: usize,
}

impl AttentionShape {
    /// Query heads per KV head: `num_q_heads / num_kv_heads` (0 when `num_kv_heads` is 0, which
    /// [`validate`](Self::validate) refuses).
    pub fn group(&self) -> usize {
        self.num_q_heads.checked_div(self.num_kv_heads).unwrap_or(0)
    }

    /// Checks that both head counts are positive, that `num_kv_heads` divides `num_q_heads`, and
    /// that both head dims are positive. Kernels add their own head-dim rules (multiples of 4).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for the head counts, [`Error::UnsupportedHeadDim`] for a zero
    /// head dim.
    pub fn validate(&self) -> Result<()> {
        if self.num_q_heads == 0 || self.num_kv_heads == 0 {
            return Err(Error::InvalidArgument(format!(
                "head counts must be positive (num_q_heads {}, num_kv_heads {})",
                self.num_q_heads, self.num_kv_heads
            )));
        }
        if self.num_q_heads % self.num_kv_heads != 0 {
            return Err(Error::InvalidArgument(format!(
                "num_q_heads ({}) must be a multiple of num_kv_heads ({})",
                self.num_q_heads, self.num_kv_heads
            )));
        }
        for head_dim in [self.head_dim_qk, self.head_dim_v] {
            if head_dim == 0 {
                return Err(Error::UnsupportedHeadDim {
                    head_dim,
                    reason: "must be at least 1".to_string(),
                });
            }
        }
        Ok(())
    }
}

/// Options that change the scores or the softmax (ARCHITECTURE.md section 2, applied in this order:
/// scale, softcap, ALiBi, mask; sinks join the denominator only).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOptions {
    /// Bottom-right aligned causal mask: query `i` of a chunk sits at position
    /// `p_i = i + len_k - len_q` and sees key `j` iff `j <= p_i`. Default `true`.
    pub causal: bool,
    /// Multiplier of `q . k`; `None` means `1 / sqrt(head_dim_qk)`.
    pub scale: Option<f32>,
    /// Sliding window `w >= 1` (causal only): query `i` sees the `w` keys `p_i - w < j <= p_i`,
    /// its own included (FlashAttention's `window_size = (w - 1, 0)`). Any `w` is accepted: a
    /// window at least as long as a sequence's keys masks nothing in it (the kernels receive it
    /// clamped to the context, so no position sum can wrap).
    pub sliding_window: Option<usize>,
    /// Logit softcap `cap > 0`: `s = cap * tanh(s / cap)`, applied after the scale.
    pub softcap: Option<f32>,
    /// Per query head raw logit (not scaled, not softcapped) that joins the softmax denominator
    /// only; `num_q_heads` entries.
    pub sinks: Option<Vec<f32>>,
    /// Per query head ALiBi slope: `s -= slope[h] * |p_i - j|`, applied after the softcap;
    /// `num_q_heads` entries.
    pub alibi_slopes: Option<Vec<f32>>,
}

impl Default for AttentionOptions {
    /// Causal, default scale, no window, no softcap, no sinks, no ALiBi.
    fn default() -> Self {
        Self {
            causal: true,
            scale: None,
            sliding_window: None,
            softcap: None,
            sinks: None,
            alibi_slopes: None,
        }
    }
}

impl AttentionOptions {
    /// The scale in effect: [`scale`](Self::scale) if set, else `1 / sqrt(head_dim_qk)` rounded
    /// once to f32 (the value the kernels receive; the reference uses the same f32).
    pub fn scale_for(&self, shape: &AttentionShape) -> f32 {
        self.scale
            .unwrap_or_else(|| (1.0 / (shape.head_dim_qk as f64).sqrt()) as f32)
    }

    /// Checks the options against `shape`: a finite scale; a window of at least 1 and only with
    /// `causal`; a finite positive softcap; sinks and ALiBi slopes with one finite entry per
    /// query head.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] for a sinks or slopes vector of the wrong length,
    /// [`Error::InvalidArgument`] for everything else.
    pub fn validate(&self, shape: &AttentionShape) -> Result<()> {
        if let Some(scale) = self.scale {
            if !scale.is_finite() {
                return Err(Error::InvalidArgument(format!(
                    "scale must be finite, got {scale}"
                )));
            }
        }
        if let Some(window) = self.sliding_window {
            if window == 0 {
                return Err(Error::InvalidArgument(
                    "sliding_window must be at least 1".to_string(),
                ));
            }
            if !self.causal {
                return Err(Error::InvalidArgument(
                    "sliding_window needs causal attention".to_string(),
                ));
            }
        }
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(Error::InvalidArgument(format!(
                    "softcap must be finite and positive, got {cap}"
                )));
            }
        }
        check_per_head("sinks", self.sinks.as_deref(), shape.num_q_heads)?;
        check_per_head(
            "alibi_slopes",
            self.alibi_slopes.as_deref(),
            shape.num_q_heads,
        )?;
        Ok(())
    }
}

/// Checks an optional per-query-head vector: `num_q_heads` finite entries.
fn check_per_head(what: &'static str, values: Option<&[f32]>, num_q_heads: usize) -> Result<()> {
    let Some(values) = values else {
        return Ok(());
    };
    if values.len() != num_q_heads {
        return Err(Error::ShapeMismatch {
            what,
            expected: num_q_heads,
            got: values.len(),
        });
    }
    if let Some(h) = values.iter().position(|x| !x.is_finite()) {
        return Err(Error::InvalidArgument(format!(
            "{what}[{h}] must be finite, got {}",
            values[h]
        )));
    }
    Ok(())
}

/// A ragged batch of sequences in the FlashAttention varlen layout, borrowed from the caller.
///
/// Sequence `s` owns query rows `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` and key rows
/// `cu_seqlens_k[s]..cu_seqlens_k[s + 1]`. Its queries are the last `len_q` positions of its
/// `len_k` keys (bottom-right alignment), so a decode step has `len_q == 1` and a chunk appended
/// after a cached prefix has `len_q < len_k`.
#[derive(Debug, Clone, Copy)]
pub struct RaggedBatch<'a> {
    /// Queries, `[total_q, Hq, d_qk]` row-major.
    pub q: &'a [f32],
    /// Keys, `[total_k, Hkv, d_qk]` row-major.
    pub k: &'a [f32],
    /// Values, `[total_k, Hkv, d_v]` row-major.
    pub v: &'a [f32],
    /// Query row offsets, `num_seqs + 1` entries: 0, non-decreasing, last = `total_q`.
    pub cu_seqlens_q: &'a [u32],
    /// Key row offsets, `num_seqs + 1` entries: 0, non-decreasing, last = `total_k`.
    pub cu_seqlens_k: &'a [u32],
}

impl RaggedBatch<'_> {
    /// Number of sequences: `cu_seqlens_q.len() - 1` (0 for an empty offset list).
    pub fn num_seqs(&self) -> usize {
        self.cu_seqlens_q.len().saturating_sub(1)
    }

    /// Total query rows: the last entry of `cu_seqlens_q` (0 if it is empty).
    pub fn total_q(&self) -> usize {
        total_rows(self.cu_seqlens_q)
    }

    /// Total key rows: the last entry of `cu_seqlens_k` (0 if it is empty).
    pub fn total_k(&self) -> usize {
        total_rows(self.cu_seqlens_k)
    }

    /// `(len_q, len_k)` of sequence `seq`.
    ///
    /// # Panics
    /// If `seq >= num_seqs()` or `cu_seqlens_k` is shorter than `cu_seqlens_q` (a batch that
    /// passed [`validate`](Self::validate) has neither problem).
    pub fn seq_lens(&self, seq: usize) -> (usize, usize) {
        let (q, k) = self.token_ranges(seq);
        (q.len(), k.len())
    }

    /// Query rows and key rows of sequence `seq`, as indices into the token dimension of
    /// `q` and of `k`/`v`.
    ///
    /// # Panics
    /// As [`seq_lens`](Self::seq_lens).
    pub fn token_ranges(&self, seq: usize) -> (Range<usize>, Range<usize>) {
        let range = |cu: &[u32]| {
            let start = cu[seq] as usize;
            let end = (cu[seq + 1] as usize).max(start);
            start..end
        };
        (range(self.cu_seqlens_q), range(self.cu_seqlens_k))
    }

    /// Checks everything the reference and the kernels rely on: `shape` and `opts` (their own
    /// `validate`), then well-formed offsets (at least one sequence, the same count for Q and K,
    /// starting at 0, non-decreasing), sequences within [`MAX_TOKENS`], tensor lengths that
    /// match the offsets and `shape`, no empty sequence (`len_q == 0` or `len_k == 0`), and
    /// `len_q <= len_k` when causal.
    ///
    /// # Errors
    /// The errors of [`AttentionShape::validate`] and [`AttentionOptions::validate`];
    /// [`Error::ShapeMismatch`] for a tensor (or `cu_seqlens_k`) of the wrong length;
    /// [`Error::InvalidArgument`] for malformed offsets and empty or over-long sequences.
    pub fn validate(&self, shape: &AttentionShape, opts: &AttentionOptions) -> Result<()> {
        shape.validate()?;
        opts.validate(shape)?;
        if self.cu_seqlens_q.len() < 2 {
            return Err(Error::InvalidArgument(format!(
                "a batch needs at least one sequence (cu_seqlens_q has {} entries, needs num_seqs + 1 >= 2)",
                self.cu_seqlens_q.len()
            )));
        }
        if self.cu_seqlens_k.len() != self.cu_seqlens_q.len() {
            return Err(Error::ShapeMismatch {
                what: "cu_seqlens_k",
                expected: self.cu_seqlens_q.len(),
                got: self.cu_seqlens_k.len(),
            });
        }
        check_offsets("cu_seqlens_q", self.cu_seqlens_q)?;
        check_offsets("cu_seqlens_k", self.cu_seqlens_k)?;
        for seq in 0..self.num_seqs() {
            let (len_q, len_k) = self.seq_lens(seq);
            check_seq_len(&format!("sequence {seq}"), len_q, len_k)?;
        }
        check_len(
            "q",
            self.q.len(),
            &[self.total_q(), shape.num_q_heads, shape.head_dim_qk],
        )?;
        check_len(
            "k",
            self.k.len(),
            &[self.total_k(), shape.num_kv_heads, shape.head_dim_qk],
        )?;
        check_len(
            "v",
            self.v.len(),
            &[self.total_k(), shape.num_kv_heads, shape.head_dim_v],
        )?;
        for seq in 0..self.num_seqs() {
            let (len_q, len_k) = self.seq_lens(seq);
            if len_q == 0 || len_k == 0 {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq} is empty (len_q {len_q}, len_k {len_k}); every sequence needs at least one query and one key"
                )));
            }
            if opts.causal && len_q > len_k {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq}: causal attention needs len_q <= len_k, got len_q {len_q} > len_k {len_k}"
                )));
            }
        }
        Ok(())
    }
}

/// Checks one offset list: starts at 0, never decreases.
/// The row count of an offset list: its last entry (0 if it is empty).
pub(crate) fn total_rows(cu: &[u32]) -> usize {
    cu.last().map_or(0, |&t| t as usize)
}

/// Checks an offset list: it starts at 0 and never decreases.
pub(crate) fn check_offsets(what: &str, cu: &[u32]) -> Result<()> {
    if cu[0] != 0 {
        return Err(Error::InvalidArgument(format!(
            "{what} must start at 0, starts at {}",
            cu[0]
        )));
    }
    if let Some(s) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::InvalidArgument(format!(
            "{what} must be non-decreasing: entry {} is {} after {}",
            s + 1,
            cu[s + 1],
            cu[s]
        )));
    }
    Ok(())
}

/// Checks that a tensor has the product of `dims` elements.
pub(crate) fn check_len(what: &'static str, got: usize, dims: &[usize]) -> Result<()> {
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            Error::InvalidArgument(format!("{what}: element count {dims:?} overflows usize"))
        })?;
    if got != expected {
        return Err(Error::ShapeMismatch {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: AttentionShape = AttentionShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim_qk: 8,
        head_dim_v: 4,
    };

    fn is_invalid(r: Result<()>, needle: &str) -> bool {
        matches!(r, Err(Error::InvalidArgument(ref m)) if m.contains(needle))
    }

    #[test]
    fn shape_group_and_valid_shapes() {
        assert_eq!(SHAPE.group(), 2);
        assert!(SHAPE.validate().is_ok());
        let mqa = AttentionShape {
            num_kv_heads: 1,
            ..SHAPE
        };
        assert_eq!(mqa.group(), 4);
        assert!(mqa.validate().is_ok());
        let zero_kv = AttentionShape {
            num_kv_heads: 0,
            ..SHAPE
        };
        assert_eq!(zero_kv.group(), 0);
    }

    #[test]
    fn shape_rejects_zero_heads() {
        for (hq, hkv) in [(0, 1), (4, 0), (0, 0)] {
            let s = AttentionShape {
                num_q_heads: hq,
                num_kv_heads: hkv,
                ..SHAPE
            };
            assert!(is_invalid(s.validate(), "positive"), "{s:?}");
        }
    }

    #[test]
    fn shape_rejects_indivisible_heads() {
        let s = AttentionShape {
            num_q_heads: 6,
            num_kv_heads: 4,
            ..SHAPE
        };
        assert!(is_invalid(s.validate(), "multiple of num_kv_heads"));
    }

    #[test]
    fn shape_rejects_zero_head_dims() {
        for s in [
            AttentionShape {
                head_dim_qk: 0,
                ..SHAPE
            },
            AttentionShape {
                head_dim_v: 0,
                ..SHAPE
            },
        ] {
            assert!(matches!(
                s.validate(),
                Err(Error::UnsupportedHeadDim { head_dim: 0, .. })
            ));
        }
    }

    #[test]
    fn default_options_and_scale() {
        let o = AttentionOptions::default();
        assert!(o.causal);
        assert_eq!(o.scale, None);
        assert_eq!(o.sliding_window, None);
        assert_eq!(o.softcap, None);
        assert_eq!(o.sinks, None);
        assert_eq!(o.alibi_slopes, None);
        assert!(o.validate(&SHAPE).is_ok());
        // 1 / sqrt(8) = 0.35355339059327373
        assert_eq!(o.scale_for(&SHAPE), 0.353_553_390_593_273_73_f64 as f32);
        let shape128 = AttentionShape {
            head_dim_qk: 128,
            ..SHAPE
        };
        // 1 / sqrt(128) = 0.08838834764831845, rounded once to f32.
        assert_eq!(o.scale_for(&shape128), 0.088_388_347_648_318_45_f64 as f32);
        let explicit = AttentionOptions {
            scale: Some(0.25),
            ..o
        };
        assert_eq!(explicit.scale_for(&SHAPE), 0.25);
    }

    #[test]
    fn options_reject_non_finite_scale() {
        for scale in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let o = AttentionOptions {
                scale: Some(scale),
                ..Default::default()
            };
            assert!(is_invalid(o.validate(&SHAPE), "scale"));
        }
    }

    #[test]
    fn options_window() {
        let zero = AttentionOptions {
            sliding_window: Some(0),
            ..Default::default()
        };
        assert!(is_invalid(zero.validate(&SHAPE), "at least 1"));
        let non_causal = AttentionOptions {
            causal: false,
            sliding_window: Some(4),
            ..Default::default()
        };
        assert!(is_invalid(non_causal.validate(&SHAPE), "causal"));
        let ok = AttentionOptions {
            sliding_window: Some(1),
            ..Default::default()
        };
        assert!(ok.validate(&SHAPE).is_ok());
    }

    #[test]
    fn options_reject_bad_softcap() {
        for cap in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let o = AttentionOptions {
                softcap: Some(cap),
                ..Default::default()
            };
            assert!(is_invalid(o.validate(&SHAPE), "softcap"), "{cap}");
        }
        let ok = AttentionOptions {
            softcap: Some(30.0),
            ..Default::default()
        };
        assert!(ok.validate(&SHAPE).is_ok());
    }

    #[test]
    fn options_per_head_vectors() {
        let wrong_len = AttentionOptions {
            sinks: Some(vec![0.0; 2]),
            ..Default::default()
        };
        assert!(matches!(
            wrong_len.validate(&SHAPE),
            Err(Error::ShapeMismatch {
                what: "sinks",
                expected: 4,
                got: 2
            })
        ));
        let wrong_len = AttentionOptions {
            alibi_slopes: Some(vec![0.5; 5]),
            ..Default::default()
        };
        assert!(matches!(
            wrong_len.validate(&SHAPE),
            Err(Error::ShapeMismatch {
                what: "alibi_slopes",
                expected: 4,
                got: 5
            })
        ));
        let nan_sink = AttentionOptions {
            sinks: Some(vec![0.0, f32::NAN, 0.0, 0.0]),
            ..Default::default()
        };
        assert!(is_invalid(nan_sink.validate(&SHAPE), "sinks[1]"));
        let inf_slope = AttentionOptions {
            alibi_slopes: Some(vec![0.0, 0.0, 0.0, f32::NEG_INFINITY]),
            ..Default::default()
        };
        assert!(is_invalid(inf_slope.validate(&SHAPE), "alibi_slopes[3]"));
        let ok = AttentionOptions {
            sinks: Some(vec![-1.0, 0.0, 1.0, 2.0]),
            alibi_slopes: Some(vec![0.5, 0.25, 0.125, 0.0625]),
            ..Default::default()
        };
        assert!(ok.validate(&SHAPE).is_ok());
    }

    /// Owned tensors for a batch with the given offsets, sized for `SHAPE`.
    struct Owned {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        cu_q: Vec<u32>,
        cu_k: Vec<u32>,
    }

    impl Owned {
        fn new(cu_q: &[u32], cu_k: &[u32]) -> Self {
            let tq = *cu_q.last().unwrap_or(&0) as usize;
            let tk = *cu_k.last().unwrap_or(&0) as usize;
            Self {
                q: vec![0.0; tq * SHAPE.num_q_heads * SHAPE.head_dim_qk],
                k: vec![0.0; tk * SHAPE.num_kv_heads * SHAPE.head_dim_qk],
                v: vec![0.0; tk * SHAPE.num_kv_heads * SHAPE.head_dim_v],
                cu_q: cu_q.to_vec(),
                cu_k: cu_k.to_vec(),
            }
        }

        fn batch(&self) -> RaggedBatch<'_> {
            RaggedBatch {
                q: &self.q,
                k: &self.k,
                v: &self.v,
                cu_seqlens_q: &self.cu_q,
                cu_seqlens_k: &self.cu_k,
            }
        }
    }

    fn causal() -> AttentionOptions {
        AttentionOptions::default()
    }

    fn non_causal() -> AttentionOptions {
        AttentionOptions {
            causal: false,
            ..Default::default()
        }
    }

    #[test]
    fn batch_accessors() {
        let t = Owned::new(&[0, 1, 4, 6], &[0, 5, 9, 9 + 17]);
        let b = t.batch();
        assert!(b.validate(&SHAPE, &causal()).is_ok());
        assert_eq!(b.num_seqs(), 3);
        assert_eq!(b.total_q(), 6);
        assert_eq!(b.total_k(), 26);
        assert_eq!(b.seq_lens(0), (1, 5));
        assert_eq!(b.seq_lens(1), (3, 4));
        assert_eq!(b.seq_lens(2), (2, 17));
        assert_eq!(b.token_ranges(1), (1..4, 5..9));
    }

    #[test]
    fn batch_validates_shape_and_options_first() {
        let t = Owned::new(&[0, 1], &[0, 1]);
        let bad_shape = AttentionShape {
            num_kv_heads: 3,
            ..SHAPE
        };
        assert!(is_invalid(
            t.batch().validate(&bad_shape, &causal()),
            "multiple"
        ));
        let bad_opts = AttentionOptions {
            softcap: Some(-1.0),
            ..Default::default()
        };
        assert!(is_invalid(t.batch().validate(&SHAPE, &bad_opts), "softcap"));
    }

    #[test]
    fn batch_needs_a_sequence() {
        for cu in [&[][..], &[0][..]] {
            let t = Owned::new(cu, cu);
            assert!(is_invalid(
                t.batch().validate(&SHAPE, &causal()),
                "at least one sequence"
            ));
        }
    }

    #[test]
    fn batch_rejects_mismatched_offset_counts() {
        let t = Owned::new(&[0, 1, 2], &[0, 3]);
        assert!(matches!(
            t.batch().validate(&SHAPE, &causal()),
            Err(Error::ShapeMismatch {
                what: "cu_seqlens_k",
                expected: 3,
                got: 2
            })
        ));
    }

    #[test]
    fn batch_rejects_offsets_not_starting_at_zero() {
        let t = Owned::new(&[1, 2], &[0, 3]);
        assert!(is_invalid(
            t.batch().validate(&SHAPE, &causal()),
            "cu_seqlens_q must start at 0"
        ));
        let t = Owned::new(&[0, 1], &[2, 3]);
        assert!(is_invalid(
            t.batch().validate(&SHAPE, &causal()),
            "cu_seqlens_k must start at 0"
        ));
    }

    #[test]
    fn batch_rejects_decreasing_offsets() {
        let t = Owned::new(&[0, 2, 1, 3], &[0, 3, 6, 9]);
        assert!(is_invalid(
            t.batch().validate(&SHAPE, &causal()),
            "cu_seqlens_q must be non-decreasing"
        ));
        let t = Owned::new(&[0, 1, 2], &[0, 5, 4]);
        assert!(is_invalid(
            t.batch().validate(&SHAPE, &causal()),
            "cu_seqlens_k must be non-decreasing"
        ));
    }

    #[test]
    fn batch_rejects_wrong_tensor_lengths() {
        // total_q 2, total_k 5: q 2*4*8 = 64, k 5*2*8 = 80, v 5*2*4 = 40.
        let mut t = Owned::new(&[0, 2], &[0, 5]);
        t.q.pop();
        assert!(matches!(
            t.batch().validate(&SHAPE, &causal()),
            Err(Error::ShapeMismatch {
                what: "q",
                expected: 64,
                got: 63
            })
        ));
        let mut t = Owned::new(&[0, 2], &[0, 5]);
        t.k.push(0.0);
        assert!(matches!(
            t.batch().validate(&SHAPE, &causal()),
            Err(Error::ShapeMismatch {
                what: "k",
                expected: 80,
                got: 81
            })
        ));
        let mut t = Owned::new(&[0, 2], &[0, 5]);
        t.v.truncate(8);
        assert!(matches!(
            t.batch().validate(&SHAPE, &causal()),
            Err(Error::ShapeMismatch {
                what: "v",
                expected: 40,
                got: 8
            })
        ));
        // A last offset beyond the tensors is a length mismatch too.
        let mut t = Owned::new(&[0, 2], &[0, 5]);
        t.cu_k = vec![0, 6];
        assert!(matches!(
            t.batch().validate(&SHAPE, &causal()),
            Err(Error::ShapeMismatch { what: "k", .. })
        ));
    }

    #[test]
    fn batch_rejects_empty_sequences() {
        for opts in [causal(), non_causal()] {
            let no_keys = Owned::new(&[0, 1, 2], &[0, 3, 3]);
            assert!(is_invalid(
                no_keys.batch().validate(&SHAPE, &opts),
                "sequence 1 is empty"
            ));
            let no_queries = Owned::new(&[0, 0, 1], &[0, 3, 4]);
            assert!(is_invalid(
                no_queries.batch().validate(&SHAPE, &opts),
                "sequence 0 is empty"
            ));
        }
    }

    #[test]
    fn sequences_longer_than_max_tokens_are_refused() {
        assert!(check_seq_len("s", MAX_TOKENS, MAX_TOKENS).is_ok());
        assert!(is_invalid(check_seq_len("s", 1, MAX_TOKENS + 1), "at most"));
        assert!(is_invalid(check_seq_len("s", MAX_TOKENS + 1, 1), "at most"));
        // At the limit the batch passes the length rule and fails on its (tiny) tensors; one
        // key more is refused by the rule itself.
        let max = MAX_TOKENS as u32;
        let mut t = Owned::new(&[0, 1], &[0, 1]);
        t.cu_k = vec![0, max];
        assert!(matches!(
            t.batch().validate(&SHAPE, &causal()),
            Err(Error::ShapeMismatch { what: "k", .. })
        ));
        t.cu_k = vec![0, max + 1];
        assert!(is_invalid(
            t.batch().validate(&SHAPE, &causal()),
            "sequence 0: 1 queries over 2147483648 keys"
        ));
    }

    #[test]
    fn causal_needs_len_q_at_most_len_k() {
        let t = Owned::new(&[0, 1, 4], &[0, 1, 3]);
        assert!(is_invalid(
            t.batch().validate(&SHAPE, &causal()),
            "sequence 1: causal attention needs len_q <= len_k"
        ));
        // Without the causal mask more queries than keys is fine.
        assert!(t.batch().validate(&SHAPE, &non_causal()).is_ok());
        // len_q == len_k is the plain prefill case.
        let t = Owned::new(&[0, 3], &[0, 3]);
        assert!(t.batch().validate(&SHAPE, &causal()).is_ok());
    }
}
