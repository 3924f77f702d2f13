//! CPU reference of attention over a ragged batch (the oracle of the decode and prefill kernels).
//!
//! Per sequence, per query row `i`, per query head `h` (KV head `h / group`), with
//! `p_i = i + len_k - len_q` (bottom-right alignment), the score of key `j` is, in this order:
//!
//! 1. `s = scale * (q . k)`, the dot product accumulated in f64;
//! 2. softcap, when set: `s = cap * tanh(s / cap)`;
//! 3. ALiBi, when slopes are given: `s = s - slope[h] * |p_i - j|`;
//! 4. mask: causal keeps `j <= p_i`; a sliding window `w` (causal only) keeps `p_i - w < j <= p_i`;
//!    without `causal` every key of the sequence is visible.
//!
//! Under the causal mask every visible key has `j <= p_i`, so the ALiBi distance `|p_i - j|` is
//! `p_i - j` (ARCHITECTURE.md section 2). Without the mask, keys after `p_i` are penalized by
//! their distance too (FlashAttention's `-slope * |i + len_k - len_q - j|`), with the same
//! bottom-right `p_i`.
//!
//! A sink `sink[h]` is a raw logit (not scaled, not softcapped, no ALiBi) that joins the softmax
//! denominator only: `lse = ln(sum_j exp(s_j) + exp(sink[h]))`, computed in f64 after subtracting
//! the maximum, and `out = sum_j exp(s_j - lse) v_j` over the keys whose weight is not 0. A row
//! with no visible key and no sink would get `out = 0` and `lse = -inf`; a batch that passes
//! validation has no such row (every sequence has a key, and a causal query always sees its own
//! position).
//!
//! NaN and infinities (README, "NaN, infinities and extreme values"), as the kernels' f32
//! arithmetic gives them: `scale * (q . k)` past f32's range is ±inf; a NaN there makes the row
//! NaN even where the softcap's tanh would hide it; the softcap takes ±inf to ±cap; the final
//! score of a visible key is then classified: NaN or +inf makes the row's output
//! and lse NaN; -inf, or a finite score below -1e38 (the kernels' masked range), gives the key
//! weight 0. A key of weight 0 (masked, -inf, or underflowed) is never read into the output, so
//! NaN or infinity in its value row changes nothing; in a key of positive weight it reaches the
//! output columns it sits in by IEEE arithmetic.

use std::ops::Range;

use crate::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use crate::Result;

pub use crate::problem::AttentionOutput;

/// Attention over every sequence of `batch`, as ARCHITECTURE.md section 2 defines it (see the
/// module docs for the exact formula).
///
/// # Errors
/// Validates `batch`, `shape` and `opts` first ([`RaggedBatch::validate`]) and returns their
/// error unchanged; nothing is computed for an invalid input.
pub fn attention(
    batch: &RaggedBatch,
    shape: &AttentionShape,
    opts: &AttentionOptions,
) -> Result<AttentionOutput> {
    batch.validate(shape, opts)?;
    let hq = shape.num_q_heads;
    let d_v = shape.head_dim_v;
    let total_q = batch.total_q();
    let mut out = vec![0.0f32; total_q * hq * d_v];
    let mut lse = vec![0.0f32; total_q * hq];

    for seq in 0..batch.num_seqs() {
        let (q_rows, k_rows) = batch.token_ranges(seq);
        let (len_q, len_k) = (q_rows.len(), k_rows.len());
        for i in 0..len_q {
            let row = q_rows.start + i;
            // Bottom-right alignment: the last query sits at the last key.
            let pos = i as i64 + len_k as i64 - len_q as i64;
            for h in 0..hq {
                let (o, l) = attend_row(batch, shape, opts, row, pos, k_rows.clone(), h);
                let dst = (row * hq + h) * d_v;
                for (d, &x) in o.iter().enumerate() {
                    out[dst + d] = x as f32;
                }
                lse[row * hq + h] = l as f32;
            }
        }
    }
    Ok(AttentionOutput { out, lse })
}

/// One query row `row` (at position `pos`) of query head `h` against the key rows `k_rows` of its
/// sequence: returns `(out[d_v], lse)` in f64.
fn attend_row(
    batch: &RaggedBatch,
    shape: &AttentionShape,
    opts: &AttentionOptions,
    row: usize,
    pos: i64,
    k_rows: Range<usize>,
    h: usize,
) -> (Vec<f64>, f64) {
    let (hq, hkv) = (shape.num_q_heads, shape.num_kv_heads);
    let (d_qk, d_v) = (shape.head_dim_qk, shape.head_dim_v);
    let kv_head = h / shape.group();
    let q = &batch.q[(row * hq + h) * d_qk..][..d_qk];

    // Scores of the visible keys, in key order.
    let mut keys = Vec::with_capacity(k_rows.len());
    let mut scores = Vec::with_capacity(k_rows.len());
    for (j, k_row) in k_rows.enumerate() {
        if visible(opts, pos, j as i64) {
            let k = &batch.k[(k_row * hkv + kv_head) * d_qk..][..d_qk];
            keys.push(k_row);
            scores.push(score(q, k, opts, shape, h, pos, j as i64));
        }
    }
    let sink = opts.sinks.as_ref().map(|sinks| f64::from(sinks[h]));
    let Some((weights, lse)) = softmax_scored(&scores, sink) else {
        return (vec![f64::NAN; d_v], f64::NAN);
    };

    let mut out = vec![0.0f64; d_v];
    for (&k_row, &w) in keys.iter().zip(&weights) {
        if w == 0.0 {
            continue;
        }
        let v = &batch.v[(k_row * hkv + kv_head) * d_v..][..d_v];
        for (o, &x) in out.iter_mut().zip(v) {
            *o += w * f64::from(x);
        }
    }
    (out, lse)
}

/// How a visible key's score enters the softmax.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Scored {
    /// A finite score (at least -1e38 as f32).
    Finite(f64),
    /// -inf, or a finite score below -1e38: weight 0.
    Zero,
    /// NaN or +inf: the row's output and lse are NaN.
    Poison,
}

/// The kernels' masked range: an f32 score at or below this counts as -inf.
const MASKED_BELOW: f32 = -1.0e38;

/// `scale * dot` as the kernels' f32 arithmetic sees it: the dot product, then the scaled score,
/// ±inf where either leaves f32's range (NaN stays NaN; a NaN from `0 * inf` too).
pub(crate) fn scaled_dot(scale: f32, dot: f64) -> f64 {
    let f32_range = |x: f64| {
        if (x as f32).is_infinite() {
            f64::INFINITY.copysign(x)
        } else {
            x
        }
    };
    f32_range(f64::from(scale) * f32_range(dot))
}

/// Classifies a visible key's final score by its f32 value.
pub(crate) fn classify(s: f64) -> Scored {
    let s32 = s as f32;
    if s.is_nan() || s32 == f32::INFINITY {
        Scored::Poison
    } else if s32 > MASKED_BELOW {
        Scored::Finite(s)
    } else {
        Scored::Zero
    }
}

/// Softmax over classified scores with an optional sink: the weights (0 for [`Scored::Zero`])
/// and lse as [`softmax_with_sink`] gives them, or `None` when a score poisons the row.
pub(crate) fn softmax_scored(scores: &[Scored], sink: Option<f64>) -> Option<(Vec<f64>, f64)> {
    let mut finite = Vec::with_capacity(scores.len());
    for s in scores {
        match s {
            Scored::Poison => return None,
            Scored::Finite(x) => finite.push(*x),
            Scored::Zero => {}
        }
    }
    let (w, lse) = softmax_with_sink(&finite, sink);
    let mut w = w.into_iter();
    let weights = scores
        .iter()
        .map(|s| match s {
            Scored::Finite(_) => w.next().unwrap_or(0.0),
            _ => 0.0,
        })
        .collect();
    Some((weights, lse))
}

/// Steps 1 to 3 of the score (scale, softcap, ALiBi) of query head `h` at position `pos` against
/// key `j` of its sequence, classified ([`classify`]).
fn score(
    q: &[f32],
    k: &[f32],
    opts: &AttentionOptions,
    shape: &AttentionShape,
    h: usize,
    pos: i64,
    j: i64,
) -> Scored {
    let dot: f64 = q
        .iter()
        .zip(k)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum();
    let mut s = scaled_dot(opts.scale_for(shape), dot);
    if s.is_nan() {
        return Scored::Poison;
    }
    if let Some(cap) = opts.softcap {
        let cap = f64::from(cap);
        s = cap * (s / cap).tanh();
    }
    if let Some(slopes) = &opts.alibi_slopes {
        let distance = (pos - j).unsigned_abs() as f64;
        s -= f64::from(slopes[h]) * distance;
    }
    classify(s)
}

/// Step 4: whether the query at position `pos` sees key `j`.
fn visible(opts: &AttentionOptions, pos: i64, j: i64) -> bool {
    if !opts.causal {
        return true;
    }
    // pos - j < w, compared without converting w (any usize) to a signed position.
    let in_window = |w: usize| u64::try_from(pos - j).is_ok_and(|d| (d as u128) < w as u128);
    j <= pos && opts.sliding_window.is_none_or(in_window)
}

/// Softmax of `scores` whose denominator also holds `exp(sink)`: returns the weights
/// `exp(s_j - lse)` and `lse = ln(sum_j exp(s_j) + exp(sink))`, computed after subtracting the
/// maximum. Nothing at all (no score, no sink) gives no weights and `lse = -inf`.
pub(crate) fn softmax_with_sink(scores: &[f64], sink: Option<f64>) -> (Vec<f64>, f64) {
    let max = scores
        .iter()
        .copied()
        .chain(sink)
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return (vec![0.0; scores.len()], f64::NEG_INFINITY);
    }
    let denom: f64 = scores
        .iter()
        .copied()
        .chain(sink)
        .map(|s| (s - max).exp())
        .sum();
    let lse = max + denom.ln();
    let weights = scores.iter().map(|&s| (s - lse).exp()).collect();
    (weights, lse)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    const LN2: f64 = std::f64::consts::LN_2;
    const LN3: f64 = 1.098_612_288_668_109_8;

    /// A one-head shape (MHA with one head).
    fn one_head(head_dim_qk: usize, head_dim_v: usize) -> AttentionShape {
        AttentionShape {
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim_qk,
            head_dim_v,
        }
    }

    fn opts_scale_1() -> AttentionOptions {
        AttentionOptions {
            scale: Some(1.0),
            ..Default::default()
        }
    }

    fn run(
        shape: AttentionShape,
        opts: &AttentionOptions,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cu_q: &[u32],
        cu_k: &[u32],
    ) -> AttentionOutput {
        let batch = RaggedBatch {
            q,
            k,
            v,
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
        };
        attention(&batch, &shape, opts).expect("valid case")
    }

    /// Asserts `got` equals `want` to 1e-6 relative to max(1, |want|) (f32 rounding of f64
    /// values is 6e-8 relative; inputs such as ln 3 rounded to f32 add about as much).
    #[track_caller]
    fn assert_close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "lengths: got {got:?}, want {want:?}");
        for (n, (&g, &w)) in got.iter().zip(want).enumerate() {
            let tol = 1e-6 * w.abs().max(1.0);
            assert!(
                (f64::from(g) - w).abs() <= tol,
                "element {n}: got {g}, want {w} (got {got:?}, want {want:?})"
            );
        }
    }

    #[test]
    fn softmax_of_two_keys() {
        // q . k = 0 and ln 3: weights 1/(1+3) = 1/4 and 3/4; lse = ln(1 + 3) = ln 4.
        // One query at the last position (p_0 = 1) sees both keys.
        let r = run(
            one_head(1, 2),
            &opts_scale_1(),
            &[1.0],
            &[0.0, LN3 as f32],
            &[1.0, 0.0, 0.0, 1.0],
            &[0, 1],
            &[0, 2],
        );
        assert_close(&r.out, &[0.25, 0.75]);
        assert_close(&r.lse, &[4f64.ln()]);
    }

    #[test]
    fn default_scale_is_one_over_sqrt_d() {
        // d_qk 2: scale 1/sqrt 2. Four equal keys (1, 2), q (0.3, -0.7):
        // s = (0.3 - 1.4) / sqrt 2 = -0.7778174593 for every key, so the weights are uniform
        // and out = mean of V = ((1+3+5+7)/4, (2+4+6+8)/4) = (4, 5); lse = s + ln 4 = 0.6084769018.
        let r = run(
            one_head(2, 2),
            &AttentionOptions::default(),
            &[0.3, -0.7],
            &[1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0],
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
            &[0, 1],
            &[0, 4],
        );
        assert_close(&r.out, &[4.0, 5.0]);
        assert_close(&r.lse, &[-1.1 / 2f64.sqrt() + 4f64.ln()]);
    }

    #[test]
    fn explicit_scale() {
        // d_qk 4, q (1,0,0,0), keys 0 and (2 ln 3, 0,0,0), V scalars 0 and 1.
        let q = [1.0, 0.0, 0.0, 0.0];
        let k = [0.0, 0.0, 0.0, 0.0, (2.0 * LN3) as f32, 0.0, 0.0, 0.0];
        let v = [0.0, 1.0];
        // Default scale 1/sqrt 4 = 0.5: scores 0 and ln 3, out = 3/4, lse = ln 4.
        let r = run(
            one_head(4, 1),
            &AttentionOptions::default(),
            &q,
            &k,
            &v,
            &[0, 1],
            &[0, 2],
        );
        assert_close(&r.out, &[0.75]);
        assert_close(&r.lse, &[4f64.ln()]);
        // Scale 0.25: scores 0 and ln 3 / 2, exp = 1 and sqrt 3:
        // out = sqrt 3 / (1 + sqrt 3) = 0.6339745962, lse = ln(1 + sqrt 3) = 1.0050525387.
        let quarter = AttentionOptions {
            scale: Some(0.25),
            ..Default::default()
        };
        let r = run(one_head(4, 1), &quarter, &q, &k, &v, &[0, 1], &[0, 2]);
        assert_close(&r.out, &[0.633_974_596_215_561_3]);
        assert_close(&r.lse, &[1.005_052_538_742_381]);
    }

    #[test]
    fn uniform_keys_give_the_mean_of_v() {
        // q = 0: every score is 0, weights 1/3 each; lse = ln 3.
        let r = run(
            one_head(2, 2),
            &AttentionOptions::default(),
            &[0.0, 0.0],
            &[0.5, -1.0, 2.0, 3.0, -4.0, 0.25],
            &[1.0, -3.0, 2.0, 6.0, 6.0, 0.0],
            &[0, 1],
            &[0, 3],
        );
        assert_close(&r.out, &[3.0, 1.0]);
        assert_close(&r.lse, &[LN3]);
    }

    #[test]
    fn sliding_window_of_one_leaves_the_own_key() {
        // One query at p_0 = 2 over 3 keys; window 1 keeps only j = 2:
        // out = v_2 = 30, lse = its score 0.5.
        let opts = AttentionOptions {
            sliding_window: Some(1),
            ..opts_scale_1()
        };
        let q = [1.0];
        let k = [5.0, -2.0, 0.5];
        let v = [10.0, 20.0, 30.0];
        let r = run(one_head(1, 1), &opts, &q, &k, &v, &[0, 1], &[0, 3]);
        assert_close(&r.out, &[30.0]);
        assert_close(&r.lse, &[0.5]);
        // Window 2 keeps j = 1, 2 (scores -2, 0.5): lse = ln(e^-2 + e^0.5) = 0.5788897343,
        // w_2 = e^0.5 / (e^-2 + e^0.5) = 0.9241418200, out = 20 + 10 w_2 = 29.241418200.
        let opts = AttentionOptions {
            sliding_window: Some(2),
            ..opts_scale_1()
        };
        let r = run(one_head(1, 1), &opts, &q, &k, &v, &[0, 1], &[0, 3]);
        assert_close(&r.out, &[20.0 + 10.0 * 0.924_141_819_978_756_4]);
        assert_close(&r.lse, &[0.578_889_734_292_549_8]);
        // A window wider than the sequence changes nothing: plain causal.
        let wide = AttentionOptions {
            sliding_window: Some(100),
            ..opts_scale_1()
        };
        let plain = run(
            one_head(1, 1),
            &opts_scale_1(),
            &q,
            &k,
            &v,
            &[0, 1],
            &[0, 3],
        );
        let r = run(one_head(1, 1), &wide, &q, &k, &v, &[0, 1], &[0, 3]);
        assert_eq!(r, plain);
    }

    #[test]
    fn sliding_window_in_a_chunk() {
        // len_q 2, len_k 4, window 2, q = 0 (uniform weights over visible keys):
        // query 0 at p = 2 sees keys 1, 2; query 1 at p = 3 sees keys 2, 3.
        let opts = AttentionOptions {
            sliding_window: Some(2),
            ..Default::default()
        };
        let r = run(
            one_head(1, 1),
            &opts,
            &[0.0, 0.0],
            &[1.0, 2.0, 3.0, 4.0],
            &[1.0, 2.0, 4.0, 8.0],
            &[0, 2],
            &[0, 4],
        );
        assert_close(&r.out, &[3.0, 6.0]);
        assert_close(&r.lse, &[LN2, LN2]);
    }

    #[test]
    fn sink_halves_the_weights() {
        // Scores 0 and ln 3 sum to exp = 4; a sink logit ln 4 doubles the denominator:
        // out = (1/8, 3/8), half of (1/4, 3/4); lse = ln 8 = ln 4 + ln 2.
        // Scale 2 with q = 0.5 gives the same scores, and the sink is not scaled
        // (a scaled sink would be 2 ln 4).
        let opts = AttentionOptions {
            scale: Some(2.0),
            sinks: Some(vec![4f64.ln() as f32]),
            ..Default::default()
        };
        let r = run(
            one_head(1, 2),
            &opts,
            &[0.5],
            &[0.0, LN3 as f32],
            &[1.0, 0.0, 0.0, 1.0],
            &[0, 1],
            &[0, 2],
        );
        assert_close(&r.out, &[0.125, 0.375]);
        assert_close(&r.lse, &[8f64.ln()]);
    }

    #[test]
    fn sink_is_not_softcapped() {
        // One key with score 0 (softcap 0.5 leaves 0 at 0), v = 1; sink 2 stays 2 (capped it
        // would be 0.5 tanh 4 = 0.4997): out = 1 / (1 + e^2) = 0.1192029220,
        // lse = ln(1 + e^2) = 2.1269280110.
        let opts = AttentionOptions {
            softcap: Some(0.5),
            sinks: Some(vec![2.0]),
            ..Default::default()
        };
        let r = run(
            one_head(1, 1),
            &opts,
            &[0.0],
            &[3.0],
            &[1.0],
            &[0, 1],
            &[0, 1],
        );
        assert_close(&r.out, &[0.119_202_922_022_117_57]);
        assert_close(&r.lse, &[2.126_928_011_042_972_2]);
    }

    #[test]
    fn causal_chunk_sees_a_growing_prefix() {
        // len_q 2, len_k 3, q = 0: query 0 sits at p = 1 and sees keys 0, 1 (mean of 1, 2 =
        // 1.5, lse ln 2); query 1 sits at p = 2 and sees all three (mean 7/3, lse ln 3).
        let q = [0.0, 0.0];
        let k = [1.0, -1.0, 2.0];
        let v = [1.0, 2.0, 4.0];
        let r = run(
            one_head(1, 1),
            &AttentionOptions::default(),
            &q,
            &k,
            &v,
            &[0, 2],
            &[0, 3],
        );
        assert_close(&r.out, &[1.5, 7.0 / 3.0]);
        assert_close(&r.lse, &[LN2, LN3]);
        // Non-causal: both queries see all three keys.
        let non_causal = AttentionOptions {
            causal: false,
            ..Default::default()
        };
        let r = run(one_head(1, 1), &non_causal, &q, &k, &v, &[0, 2], &[0, 3]);
        assert_close(&r.out, &[7.0 / 3.0, 7.0 / 3.0]);
        assert_close(&r.lse, &[LN3, LN3]);
    }

    #[test]
    fn non_causal_with_more_queries_than_keys() {
        // len_q 3, len_k 2, scale 1, q = (0, 1, -1), keys 0 and ln 3, V 0 and 1:
        // q 0: uniform, out 1/2, lse ln 2; q 1: scores 0, ln 3: out 3/4, lse ln 4;
        // q -1: scores 0, -ln 3: weights 3/4, 1/4, out 1/4, lse ln(1 + 1/3) = ln(4/3).
        let opts = AttentionOptions {
            causal: false,
            scale: Some(1.0),
            ..Default::default()
        };
        let r = run(
            one_head(1, 1),
            &opts,
            &[0.0, 1.0, -1.0],
            &[0.0, LN3 as f32],
            &[0.0, 1.0],
            &[0, 3],
            &[0, 2],
        );
        assert_close(&r.out, &[0.5, 0.75, 0.25]);
        assert_close(&r.lse, &[LN2, 4f64.ln(), (4.0f64 / 3.0).ln()]);
    }

    #[test]
    fn softcap_after_scale() {
        // Scale 0.5, q . k = 4 and 0: s = 2 and 0. Cap 4: s_0 = 4 tanh(0.5) = 1.8484686290,
        // s_1 = 0. V scalars 1 and 0: out = e^s_0 / (e^s_0 + 1) = 6.3500877331 / 7.3500877331
        // = 0.8639472022, lse = ln(7.3500877331) = 1.9947122496.
        let opts = AttentionOptions {
            scale: Some(0.5),
            softcap: Some(4.0),
            ..Default::default()
        };
        let r = run(
            one_head(1, 1),
            &opts,
            &[4.0],
            &[1.0, 0.0],
            &[1.0, 0.0],
            &[0, 1],
            &[0, 2],
        );
        assert_close(&r.out, &[0.863_947_202_221_646_3]);
        assert_close(&r.lse, &[1.994_712_249_625_084_4]);
    }

    #[test]
    fn alibi_causal_chunk() {
        // Hq 2 over one KV head, q = 0 (raw scores 0), slopes (ln 2, 0), len_q 2, len_k 3,
        // V scalars (0, 1, 2).
        // Query 1 at p = 2, head 0: biases -2 ln 2, -ln 2, 0 -> exp 1/4, 1/2, 1, sum 7/4:
        //   weights 1/7, 2/7, 4/7, out = (2 + 8)/7 = 10/7, lse = ln(7/4).
        // Query 0 at p = 1, head 0: keys 0, 1 with biases -ln 2, 0 -> weights 1/3, 2/3,
        //   out 2/3, lse = ln(3/2).
        // Head 1 (slope 0): plain means, out 1/2 and 1, lse ln 2 and ln 3.
        let shape = AttentionShape {
            num_q_heads: 2,
            num_kv_heads: 1,
            head_dim_qk: 1,
            head_dim_v: 1,
        };
        let opts = AttentionOptions {
            alibi_slopes: Some(vec![LN2 as f32, 0.0]),
            ..Default::default()
        };
        let q = [0.0; 4];
        let k = [0.3, -0.6, 0.9];
        let v = [0.0, 1.0, 2.0];
        let r = run(shape, &opts, &q, &k, &v, &[0, 2], &[0, 3]);
        // Rows follow tokens: [query 0 head 0, query 0 head 1, query 1 head 0, query 1 head 1].
        assert_close(&r.out, &[2.0 / 3.0, 0.5, 10.0 / 7.0, 1.0]);
        assert_close(&r.lse, &[1.5f64.ln(), LN2, 1.75f64.ln(), LN3]);
        // ALiBi comes after the softcap: a tiny cap on zero scores leaves the biases whole.
        let capped = AttentionOptions {
            softcap: Some(0.1),
            ..opts.clone()
        };
        let r2 = run(shape, &capped, &q, &k, &v, &[0, 2], &[0, 3]);
        assert_close(&r2.out, &[2.0 / 3.0, 0.5, 10.0 / 7.0, 1.0]);
        assert_close(&r2.lse, &[1.5f64.ln(), LN2, 1.75f64.ln(), LN3]);
        // Non-causal: query 0 (p = 1) now sees key 2 at distance |1 - 2| = 1.
        // Head 0: biases -ln 2, 0, -ln 2 -> exp 1/2, 1, 1/2, sum 2: weights 1/4, 1/2, 1/4,
        //   out = 1/2 + 2/4 = 1, lse = ln 2. Query 1 is unchanged (no key after p = 2).
        let non_causal = AttentionOptions {
            causal: false,
            ..opts
        };
        let r3 = run(shape, &non_causal, &q, &k, &v, &[0, 2], &[0, 3]);
        assert_close(&r3.out, &[1.0, 1.0, 10.0 / 7.0, 1.0]);
        assert_close(&r3.lse, &[LN2, LN3, 1.75f64.ln(), LN3]);
    }

    #[test]
    fn gqa_maps_query_heads_to_kv_heads() {
        // Hq 4, Hkv 2, group 2: q heads 0, 1 read KV head 0, q heads 2, 3 read KV head 1.
        // Scale 1, q per head (1, 0, 1, 0); KV head 0: keys (0, ln 3), V (1, 0);
        // KV head 1: keys (ln 3, 0), V (2, 0).
        // head 0: weights 1/4, 3/4 -> out 1/4, lse ln 4; head 1: uniform -> 1/2, ln 2;
        // head 2: weights 3/4, 1/4 -> 3/2, ln 4; head 3: uniform -> 1, ln 2.
        let shape = AttentionShape {
            num_q_heads: 4,
            num_kv_heads: 2,
            head_dim_qk: 1,
            head_dim_v: 1,
        };
        let ln3 = LN3 as f32;
        // Layout [token, kv head, d].
        let k = [0.0, ln3, ln3, 0.0];
        let v = [1.0, 2.0, 0.0, 0.0];
        let r = run(
            shape,
            &opts_scale_1(),
            &[1.0, 0.0, 1.0, 0.0],
            &k,
            &v,
            &[0, 1],
            &[0, 2],
        );
        assert_close(&r.out, &[0.25, 0.5, 1.5, 1.0]);
        assert_close(&r.lse, &[4f64.ln(), LN2, 4f64.ln(), LN2]);
    }

    #[test]
    fn mqa_shares_one_kv_head() {
        // Hq 3 over one KV head, q per head (1, 0, -1), keys (0, ln 3), V (1, 0), scale 1:
        // head 0: 1/4, ln 4; head 1: 1/2, ln 2; head 2: scores 0, -ln 3 -> 3/4, ln(4/3).
        let shape = AttentionShape {
            num_q_heads: 3,
            num_kv_heads: 1,
            head_dim_qk: 1,
            head_dim_v: 1,
        };
        let r = run(
            shape,
            &opts_scale_1(),
            &[1.0, 0.0, -1.0],
            &[0.0, LN3 as f32],
            &[1.0, 0.0],
            &[0, 1],
            &[0, 2],
        );
        assert_close(&r.out, &[0.25, 0.5, 0.75]);
        assert_close(&r.lse, &[4f64.ln(), LN2, (4.0f64 / 3.0).ln()]);
    }

    #[test]
    fn different_qk_and_v_head_dims() {
        // d_qk 2, d_v 3, scale 1, q (1, 1): k_0 (0.5, -0.5) scores 0, k_1 (ln 3, 0) scores ln 3.
        // out = v_0 / 4 + 3 v_1 / 4 = (1, 2, 3)/4 + 3 (5, 6, 7)/4 = (4, 5, 6); lse ln 4.
        let r = run(
            one_head(2, 3),
            &opts_scale_1(),
            &[1.0, 1.0],
            &[0.5, -0.5, LN3 as f32, 0.0],
            &[1.0, 2.0, 3.0, 5.0, 6.0, 7.0],
            &[0, 1],
            &[0, 2],
        );
        assert_close(&r.out, &[4.0, 5.0, 6.0]);
        assert_close(&r.lse, &[4f64.ln()]);
    }

    #[test]
    fn large_scores_are_stable() {
        // Two equal scores of 2000 (exp overflows in f64 without the max subtraction):
        // out = mean (1 + 3)/2 = 2, lse = 2000 + ln 2.
        let r = run(
            one_head(1, 1),
            &opts_scale_1(),
            &[1.0],
            &[2000.0, 2000.0],
            &[1.0, 3.0],
            &[0, 1],
            &[0, 2],
        );
        assert_close(&r.out, &[2.0]);
        assert_close(&r.lse, &[2000.0 + LN2]);
    }

    #[test]
    fn softmax_of_nothing() {
        // No visible key and no sink: no weights, lse = -inf (the row's output stays 0).
        let (w, lse) = softmax_with_sink(&[], None);
        assert!(w.is_empty());
        assert_eq!(lse, f64::NEG_INFINITY);
        // Only a sink: lse is the sink.
        let (w, lse) = softmax_with_sink(&[], Some(1.5));
        assert!(w.is_empty());
        assert_eq!(lse, 1.5);
    }

    #[test]
    fn invalid_input_is_an_error() {
        let opts = AttentionOptions {
            causal: false,
            sliding_window: Some(2),
            ..Default::default()
        };
        let batch = RaggedBatch {
            q: &[0.0],
            k: &[0.0],
            v: &[0.0],
            cu_seqlens_q: &[0, 1],
            cu_seqlens_k: &[0, 1],
        };
        assert!(matches!(
            attention(&batch, &one_head(1, 1), &opts),
            Err(Error::InvalidArgument(_))
        ));
        let short_v = RaggedBatch { v: &[], ..batch };
        assert!(matches!(
            attention(&short_v, &one_head(1, 1), &AttentionOptions::default()),
            Err(Error::ShapeMismatch { what: "v", .. })
        ));
    }

    /// Deterministic values in [-1, 1) (a 64-bit LCG; the top 24 bits make exact f32s).
    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 23) as f32) - 1.0
            })
            .collect()
    }

    /// Runs `lens` as one batch and each sequence alone; demands bitwise equal rows.
    fn check_batch_equals_sequences_alone(
        shape: AttentionShape,
        opts: &AttentionOptions,
        lens: &[(u32, u32)],
    ) {
        let (hq, hkv, d_qk, d_v) = (
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim_qk,
            shape.head_dim_v,
        );
        let mut cu_q = vec![0u32];
        let mut cu_k = vec![0u32];
        for &(lq, lk) in lens {
            cu_q.push(cu_q.last().unwrap() + lq);
            cu_k.push(cu_k.last().unwrap() + lk);
        }
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        let q: Vec<f32> = pseudo_random(tq * hq * d_qk, 1)
            .iter()
            .map(|x| 3.0 * x)
            .collect();
        let k = pseudo_random(tk * hkv * d_qk, 2);
        let v = pseudo_random(tk * hkv * d_v, 3);
        let all = run(shape, opts, &q, &k, &v, &cu_q, &cu_k);
        for (s, &(lq, lk)) in lens.iter().enumerate() {
            let (q0, k0) = (cu_q[s] as usize, cu_k[s] as usize);
            let (lq, lk) = (lq as usize, lk as usize);
            let alone = run(
                shape,
                opts,
                &q[q0 * hq * d_qk..(q0 + lq) * hq * d_qk],
                &k[k0 * hkv * d_qk..(k0 + lk) * hkv * d_qk],
                &v[k0 * hkv * d_v..(k0 + lk) * hkv * d_v],
                &[0, lq as u32],
                &[0, lk as u32],
            );
            assert_eq!(
                &all.out[q0 * hq * d_v..(q0 + lq) * hq * d_v],
                &alone.out[..],
                "sequence {s}"
            );
            assert_eq!(
                &all.lse[q0 * hq..(q0 + lq) * hq],
                &alone.lse[..],
                "sequence {s}"
            );
            assert!(alone.lse.iter().all(|l| l.is_finite()));
        }
    }

    #[test]
    fn batch_of_sequences_equals_each_alone() {
        let shape = AttentionShape {
            num_q_heads: 4,
            num_kv_heads: 2,
            head_dim_qk: 8,
            head_dim_v: 4,
        };
        let lens = [(1, 5), (3, 3), (4, 9), (2, 17), (1, 1)];
        check_batch_equals_sequences_alone(shape, &AttentionOptions::default(), &lens);
        let everything = AttentionOptions {
            causal: true,
            scale: Some(0.7),
            sliding_window: Some(3),
            softcap: Some(2.5),
            sinks: Some(vec![0.5, -1.0, 0.0, 2.0]),
            alibi_slopes: Some(vec![0.5, 0.25, 0.125, 0.0625]),
        };
        check_batch_equals_sequences_alone(shape, &everything, &lens);
        let non_causal = AttentionOptions {
            causal: false,
            sinks: Some(vec![0.1, 0.2, 0.3, 0.4]),
            alibi_slopes: Some(vec![0.5, 0.25, 0.125, 0.0625]),
            ..Default::default()
        };
        check_batch_equals_sequences_alone(shape, &non_causal, &[(1, 5), (6, 3), (4, 9), (2, 2)]);
    }

    #[test]
    fn gqa_equals_mha_with_repeated_kv_heads() {
        // Hq 6 over Hkv 2 (group 3) vs Hq 6 over 6 KV heads where KV head h is a copy of
        // KV head h / 3: the results are identical.
        let gqa = AttentionShape {
            num_q_heads: 6,
            num_kv_heads: 2,
            head_dim_qk: 4,
            head_dim_v: 8,
        };
        let mha = AttentionShape {
            num_kv_heads: 6,
            ..gqa
        };
        let (cu_q, cu_k) = ([0u32, 2, 3], [0u32, 7, 12]);
        let (tq, tk) = (3, 12);
        let q = pseudo_random(tq * 6 * 4, 4);
        let k = pseudo_random(tk * 2 * 4, 5);
        let v = pseudo_random(tk * 2 * 8, 6);
        let repeat = |x: &[f32], d: usize| -> Vec<f32> {
            let mut out = Vec::new();
            for t in 0..tk {
                for h in 0..6 {
                    let src = (t * 2 + h / 3) * d;
                    out.extend_from_slice(&x[src..src + d]);
                }
            }
            out
        };
        let (k6, v6) = (repeat(&k, 4), repeat(&v, 8));
        let opts = AttentionOptions {
            softcap: Some(5.0),
            sinks: Some(vec![0.0, 1.0, -1.0, 0.5, 0.25, -0.25]),
            ..Default::default()
        };
        let a = run(gqa, &opts, &q, &k, &v, &cu_q, &cu_k);
        let b = run(mha, &opts, &q, &k6, &v6, &cu_q, &cu_k);
        assert_eq!(a, b);
    }
}
