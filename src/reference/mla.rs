//! CPU reference of Multi-head Latent Attention (DeepSeek-V2), the oracle of the MLA kernels.
//!
//! Per token the cache holds a latent `c_kv` (`rank` values) and a rotated RoPE key `k_pe`
//! (`d_rope` values) shared by every head. Head `h` sees the key
//! `[W_UK[h] c_kv ; k_pe]` (`d_nope + d_rope` values) and the value `W_UV[h]^T c_kv` (`d_v`
//! values), with `w_uk` `[H, d_nope, rank]` and `w_uv` `[H, rank, d_v]`. Attention is causal,
//! bottom-right aligned, with scale `1 / sqrt(d_nope + d_rope)` unless given.
//!
//! [`mla`] computes it in the absorbed form, in f64 throughout: `q_lat = W_UK[h]^T q_nope`,
//! score `(q_lat . c_kv + q_pe . k_pe) * scale`, latent output `o_lat = sum_j p_j c_kv_j`, output
//! `W_UV[h]^T o_lat`. This equals the up-projected form exactly in real arithmetic; the test
//! below checks both against each other. NaN and infinities follow the attention reference's
//! rules ([`mod@super::attention`]): a visible key scoring NaN or +inf makes the row NaN, and a key of
//! weight 0 is not read into the output. [`expand`] gives the up-projected per-head K and V, for
//! running an ordinary attention over them.

use crate::attention::spec::{check_len, check_offsets, total_rows};
use crate::problem::AttentionOutput;
use crate::reference::attention::{classify, scaled_dot, softmax_scored, Scored};
use crate::{Error, Result};

pub use crate::problem::MlaShape;

/// An MLA batch in the FlashAttention varlen layout (ARCHITECTURE.md section 12, `run mla`).
#[derive(Debug, Clone, Copy)]
pub struct MlaBatch<'a> {
    /// `[total_q, H, d_nope]`.
    pub q_nope: &'a [f32],
    /// `[total_q, H, d_rope]`, already rotated.
    pub q_pe: &'a [f32],
    /// `[total_k, rank]`.
    pub c_kv: &'a [f32],
    /// `[total_k, d_rope]`, already rotated.
    pub k_pe: &'a [f32],
    /// `[H, d_nope, rank]`.
    pub w_uk: &'a [f32],
    /// `[H, rank, d_v]`.
    pub w_uv: &'a [f32],
    /// Query row offsets, `num_seqs + 1` entries.
    pub cu_seqlens_q: &'a [u32],
    /// Key row offsets, `num_seqs + 1` entries.
    pub cu_seqlens_k: &'a [u32],
}

impl MlaBatch<'_> {
    /// Checks the shape, the offsets (as [`RaggedBatch`](crate::attention::RaggedBatch) does:
    /// no empty sequence, none longer than [`MAX_TOKENS`](crate::attention::MAX_TOKENS),
    /// `len_q <= len_k` for the causal mask) and every tensor's length.
    pub fn validate(&self, shape: &MlaShape) -> Result<()> {
        shape.validate()?;
        if self.cu_seqlens_q.len() < 2 {
            return Err(Error::InvalidArgument(
                "an MLA batch needs at least one sequence".into(),
            ));
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
        for (s, (q, k)) in self
            .cu_seqlens_q
            .windows(2)
            .zip(self.cu_seqlens_k.windows(2))
            .enumerate()
        {
            let (lq, lk) = (q[1] - q[0], k[1] - k[0]);
            crate::attention::check_seq_len(&format!("sequence {s}"), lq as usize, lk as usize)?;
            if lq == 0 || lk == 0 {
                return Err(Error::InvalidArgument(format!(
                    "sequence {s} is empty (len_q {lq}, len_k {lk})"
                )));
            }
            if lq > lk {
                return Err(Error::InvalidArgument(format!(
                    "sequence {s}: len_q {lq} > len_k {lk} under the causal mask"
                )));
            }
        }
        let (tq, tk) = (self.total_q(), self.total_k());
        let (h, s) = (shape.num_heads, shape);
        check_len("q_nope", self.q_nope.len(), &[tq, h, s.d_nope])?;
        check_len("q_pe", self.q_pe.len(), &[tq, h, s.d_rope])?;
        check_len("c_kv", self.c_kv.len(), &[tk, s.rank])?;
        check_len("k_pe", self.k_pe.len(), &[tk, s.d_rope])?;
        check_len("w_uk", self.w_uk.len(), &[h, s.d_nope, s.rank])?;
        check_len("w_uv", self.w_uv.len(), &[h, s.rank, s.d_v])
    }

    /// Total query rows.
    pub fn total_q(&self) -> usize {
        total_rows(self.cu_seqlens_q)
    }

    /// Total latent rows.
    pub fn total_k(&self) -> usize {
        total_rows(self.cu_seqlens_k)
    }
}

/// MLA over every sequence of `batch` (causal, bottom-right), in the absorbed form in f64;
/// `scale` `None` means [`MlaShape::default_scale`]. Output `[total_q, H, d_v]` and
/// `lse` `[total_q, H]`. Errors: those of [`MlaBatch::validate`], and a non-finite scale.
pub fn mla(batch: &MlaBatch, shape: &MlaShape, scale: Option<f32>) -> Result<AttentionOutput> {
    batch.validate(shape)?;
    let scale = scale.unwrap_or_else(|| shape.default_scale());
    if !scale.is_finite() {
        return Err(Error::InvalidArgument(format!(
            "MLA scale must be finite, got {scale}"
        )));
    }
    let s = *shape;
    let h_n = s.num_heads;
    let mut out = vec![0.0f32; batch.total_q() * h_n * s.d_v];
    let mut lse = vec![0.0f32; batch.total_q() * h_n];
    for (q, k) in batch
        .cu_seqlens_q
        .windows(2)
        .zip(batch.cu_seqlens_k.windows(2))
    {
        let (q0, lq) = (q[0] as usize, (q[1] - q[0]) as usize);
        let (k0, lk) = (k[0] as usize, (k[1] - k[0]) as usize);
        for i in 0..lq {
            let row = q0 + i;
            let pos = i + lk - lq;
            for h in 0..h_n {
                // q_lat[r] = sum_n w_uk[h][n][r] q_nope[n].
                let qn = &batch.q_nope[(row * h_n + h) * s.d_nope..][..s.d_nope];
                let qp = &batch.q_pe[(row * h_n + h) * s.d_rope..][..s.d_rope];
                let mut q_lat = vec![0.0f64; s.rank];
                for (n, &x) in qn.iter().enumerate() {
                    let w = &batch.w_uk[(h * s.d_nope + n) * s.rank..][..s.rank];
                    for (acc, &wr) in q_lat.iter_mut().zip(w) {
                        *acc += f64::from(wr) * f64::from(x);
                    }
                }
                let scores: Vec<Scored> = (0..=pos)
                    .map(|j| {
                        let c = &batch.c_kv[(k0 + j) * s.rank..][..s.rank];
                        let kp = &batch.k_pe[(k0 + j) * s.d_rope..][..s.d_rope];
                        let lat: f64 = q_lat.iter().zip(c).map(|(a, &b)| a * f64::from(b)).sum();
                        let pe: f64 = qp
                            .iter()
                            .zip(kp)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum();
                        classify(scaled_dot(scale, lat + pe))
                    })
                    .collect();
                let dst = &mut out[(row * h_n + h) * s.d_v..][..s.d_v];
                let Some((p, l)) = softmax_scored(&scores, None) else {
                    dst.fill(f32::NAN);
                    lse[row * h_n + h] = f32::NAN;
                    continue;
                };
                let mut o_lat = vec![0.0f64; s.rank];
                for (j, &pj) in p.iter().enumerate() {
                    if pj == 0.0 {
                        continue;
                    }
                    let c = &batch.c_kv[(k0 + j) * s.rank..][..s.rank];
                    for (acc, &x) in o_lat.iter_mut().zip(c) {
                        *acc += pj * f64::from(x);
                    }
                }
                // out[v] = sum_r w_uv[h][r][v] o_lat[r].
                let mut o = vec![0.0f64; s.d_v];
                for (r, &x) in o_lat.iter().enumerate() {
                    let w = &batch.w_uv[(h * s.rank + r) * s.d_v..][..s.d_v];
                    for (acc, &wv) in o.iter_mut().zip(w) {
                        *acc += f64::from(wv) * x;
                    }
                }
                for (d, x) in dst.iter_mut().zip(o) {
                    *d = x as f32;
                }
                lse[row * h_n + h] = l as f32;
            }
        }
    }
    Ok(AttentionOutput { out, lse })
}

/// The up-projected form of `batch`: per-head queries `[total_q, H, d_nope + d_rope]`
/// (`[q_nope ; q_pe]`), keys `[total_k, H, d_nope + d_rope]` (`[W_UK[h] c_kv ; k_pe]`) and values
/// `[total_k, H, d_v]` (`W_UV[h]^T c_kv`), accumulated in f64 and rounded once to f32: the
/// inputs of an ordinary MHA over the same sequences. Errors: those of [`MlaBatch::validate`].
pub fn expand(batch: &MlaBatch, shape: &MlaShape) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    batch.validate(shape)?;
    let s = *shape;
    let (h_n, dqk) = (s.num_heads, s.d_nope + s.d_rope);
    let mut q = Vec::with_capacity(batch.total_q() * h_n * dqk);
    for row in 0..batch.total_q() {
        for h in 0..h_n {
            q.extend_from_slice(&batch.q_nope[(row * h_n + h) * s.d_nope..][..s.d_nope]);
            q.extend_from_slice(&batch.q_pe[(row * h_n + h) * s.d_rope..][..s.d_rope]);
        }
    }
    let mut k = Vec::with_capacity(batch.total_k() * h_n * dqk);
    let mut v = Vec::with_capacity(batch.total_k() * h_n * s.d_v);
    for t in 0..batch.total_k() {
        let c = &batch.c_kv[t * s.rank..][..s.rank];
        let kp = &batch.k_pe[t * s.d_rope..][..s.d_rope];
        for h in 0..h_n {
            for n in 0..s.d_nope {
                let w = &batch.w_uk[(h * s.d_nope + n) * s.rank..][..s.rank];
                let x: f64 = w
                    .iter()
                    .zip(c)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
                k.push(x as f32);
            }
            k.extend_from_slice(kp);
            let mut o = vec![0.0f64; s.d_v];
            for (r, &x) in c.iter().enumerate() {
                let w = &batch.w_uv[(h * s.rank + r) * s.d_v..][..s.d_v];
                for (acc, &wv) in o.iter_mut().zip(w) {
                    *acc += f64::from(wv) * f64::from(x);
                }
            }
            v.extend(o.into_iter().map(|x| x as f32));
        }
    }
    Ok((q, k, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{AttentionOptions, AttentionShape, RaggedBatch};

    struct Data {
        q_nope: Vec<f32>,
        q_pe: Vec<f32>,
        c_kv: Vec<f32>,
        k_pe: Vec<f32>,
        w_uk: Vec<f32>,
        w_uv: Vec<f32>,
    }

    fn data(s: &MlaShape, tq: usize, tk: usize, seed: u64) -> Data {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut gen = |n: usize, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
                })
                .collect()
        };
        let h = s.num_heads;
        Data {
            q_nope: gen(tq * h * s.d_nope, 2.0),
            q_pe: gen(tq * h * s.d_rope, 2.0),
            c_kv: gen(tk * s.rank, 2.0),
            k_pe: gen(tk * s.d_rope, 2.0),
            w_uk: gen(h * s.d_nope * s.rank, 2.0 / (s.rank as f32).sqrt()),
            w_uv: gen(h * s.rank * s.d_v, 2.0 / (s.rank as f32).sqrt()),
        }
    }

    fn batch<'a>(d: &'a Data, cu_q: &'a [u32], cu_k: &'a [u32]) -> MlaBatch<'a> {
        MlaBatch {
            q_nope: &d.q_nope,
            q_pe: &d.q_pe,
            c_kv: &d.c_kv,
            k_pe: &d.k_pe,
            w_uk: &d.w_uk,
            w_uv: &d.w_uv,
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
        }
    }

    #[test]
    fn absorbed_form_equals_up_projected_attention() {
        // Small odd shapes and a DeepSeek-V2-wide latent with few heads; decode and chunks.
        for (s, cu_q, cu_k) in [
            (
                MlaShape {
                    num_heads: 3,
                    d_nope: 5,
                    d_rope: 3,
                    rank: 7,
                    d_v: 6,
                },
                vec![0u32, 1, 4, 9],
                vec![0u32, 1, 11, 40],
            ),
            (
                MlaShape {
                    num_heads: 2,
                    ..MlaShape::DEEPSEEK_V2
                },
                vec![0u32, 1, 3],
                vec![0u32, 9, 30],
            ),
        ] {
            let d = data(
                &s,
                *cu_q.last().unwrap() as usize,
                *cu_k.last().unwrap() as usize,
                7,
            );
            let b = batch(&d, &cu_q, &cu_k);
            let got = mla(&b, &s, None).unwrap();
            let (q, k, v) = expand(&b, &s).unwrap();
            let shape = AttentionShape {
                num_q_heads: s.num_heads,
                num_kv_heads: s.num_heads,
                head_dim_qk: s.d_nope + s.d_rope,
                head_dim_v: s.d_v,
            };
            let opts = AttentionOptions {
                scale: Some(s.default_scale()),
                ..Default::default()
            };
            let rb = RaggedBatch {
                q: &q,
                k: &k,
                v: &v,
                cu_seqlens_q: &cu_q,
                cu_seqlens_k: &cu_k,
            };
            let want = crate::reference::attention(&rb, &shape, &opts).unwrap();
            let scale = want.out.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            for (a, b) in got.out.iter().zip(&want.out) {
                assert!((a - b).abs() <= 1e-5 * scale, "{s:?}: {a} vs {b}");
            }
            for (a, b) in got.lse.iter().zip(&want.lse) {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "{s:?}: lse {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn one_key_gives_its_up_projected_value() {
        // A single cached token: the softmax is 1, out = W_UV^T c_kv, lse = the score.
        let s = MlaShape {
            num_heads: 1,
            d_nope: 1,
            d_rope: 1,
            rank: 2,
            d_v: 1,
        };
        let d = Data {
            q_nope: vec![2.0],
            q_pe: vec![1.0],
            c_kv: vec![3.0, -1.0],
            k_pe: vec![0.5],
            w_uk: vec![1.0, 4.0],
            w_uv: vec![2.0, 5.0],
        };
        let cu = [0u32, 1];
        let r = mla(&batch(&d, &cu, &cu), &s, Some(0.5)).unwrap();
        // q_lat = (2, 8); score = 0.5 * (2*3 + 8*(-1) + 1*0.5) = -0.75; out = 2*3 + 5*(-1) = 1.
        assert_eq!(r.out, vec![1.0]);
        assert_eq!(r.lse, vec![-0.75]);
    }

    #[test]
    fn bad_batches_are_refused() {
        let s = MlaShape {
            num_heads: 2,
            d_nope: 4,
            d_rope: 2,
            rank: 8,
            d_v: 4,
        };
        let d = data(&s, 2, 3, 1);
        let (cu_q, cu_k) = ([0u32, 2], [0u32, 3]);
        assert!(mla(&batch(&d, &cu_q, &cu_k), &s, None).is_ok());
        let mut short = batch(&d, &cu_q, &cu_k);
        short.k_pe = &d.k_pe[1..];
        assert!(matches!(
            mla(&short, &s, None),
            Err(Error::ShapeMismatch { what: "k_pe", .. })
        ));
        assert!(matches!(
            mla(&batch(&d, &[0, 2], &[0, 1]), &s, None),
            Err(Error::ShapeMismatch { .. }) | Err(Error::InvalidArgument(_))
        ));
        assert!(mla(&batch(&d, &cu_q, &cu_k), &s, Some(f32::NAN)).is_err());
        let zero = MlaShape { rank: 0, ..s };
        assert!(mla(&batch(&d, &cu_q, &cu_k), &zero, None).is_err());
    }
}
