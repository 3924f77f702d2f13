//! The oracles of the attention cases: the data of a problem, the values its storage holds, and
//! the honest f16 emulation that bounds the f16 kernels.

use crate::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use crate::quant::{decode_rows, encode_rows, KvDtype, ScaleMode};
use crate::reference::AttentionOutput;
use crate::Result;

use super::cases::{Opts, Problem};
use super::metrics::Rng;

/// The values a kernel reads back from `dtype` storage with scales `mode`.
pub(crate) fn stored(
    dtype: KvDtype,
    head_dim: usize,
    x: &[f32],
    mode: ScaleMode,
) -> Result<Vec<f32>> {
    decode_rows(&encode_rows(dtype, head_dim, x, mode)?)
}

pub(crate) fn to_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// The f16 kernels' arithmetic done honestly on the CPU: Q, K, V and the probabilities (relative
/// to the row's maximum) rounded to f16, everything else in f64, with the masks and options of
/// [`crate::reference`].
pub(crate) fn f16_emulation(
    batch: &RaggedBatch,
    shape: &AttentionShape,
    opts: &AttentionOptions,
) -> AttentionOutput {
    let (q, k, v) = (to_f16(batch.q), to_f16(batch.k), to_f16(batch.v));
    let (hq, hkv) = (shape.num_q_heads, shape.num_kv_heads);
    let (d, dv) = (shape.head_dim_qk, shape.head_dim_v);
    let scale = f64::from(opts.scale_for(shape));
    let mut out = vec![0.0f32; batch.total_q() * hq * dv];
    let mut lse = vec![0.0f32; batch.total_q() * hq];
    for seq in 0..batch.num_seqs() {
        let (q_rows, k_rows) = batch.token_ranges(seq);
        let (len_q, len_k) = (q_rows.len() as i64, k_rows.len() as i64);
        for (i, row) in q_rows.enumerate() {
            let pos = i as i64 + len_k - len_q;
            for h in 0..hq {
                let kvh = h / shape.group();
                let qr = &q[(row * hq + h) * d..][..d];
                let mut keys = Vec::new();
                let mut scores = Vec::new();
                for (j, kr) in k_rows.clone().enumerate() {
                    let j = j as i64;
                    let visible = !opts.causal
                        || (j <= pos && opts.sliding_window.is_none_or(|w| j > pos - w as i64));
                    if !visible {
                        continue;
                    }
                    let kv = &k[(kr * hkv + kvh) * d..][..d];
                    let dot: f64 = qr
                        .iter()
                        .zip(kv)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum();
                    let mut s = scale * dot;
                    if let Some(cap) = opts.softcap {
                        let cap = f64::from(cap);
                        s = cap * (s / cap).tanh();
                    }
                    if let Some(slopes) = &opts.alibi_slopes {
                        s -= f64::from(slopes[h]) * (pos - j).unsigned_abs() as f64;
                    }
                    keys.push(kr);
                    scores.push(s);
                }
                let sink = opts.sinks.as_ref().map(|s| f64::from(s[h]));
                let m = scores
                    .iter()
                    .copied()
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores
                    .iter()
                    .map(|&s| f64::from(half::f16::from_f64((s - m).exp()).to_f32()))
                    .collect();
                let l: f64 = p.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
                lse[row * hq + h] = (m + l.ln()) as f32;
                for c in 0..dv {
                    let acc: f64 = keys
                        .iter()
                        .zip(&p)
                        .map(|(&kr, &pj)| pj * f64::from(v[(kr * hkv + kvh) * dv + c]))
                        .sum();
                    out[(row * hq + h) * dv + c] = (acc / l) as f32;
                }
            }
        }
    }
    AttentionOutput { out, lse }
}

/// Random tensors of a problem (`q` already sized for its query rows).
pub(crate) struct ProblemData {
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) cu_q: Vec<u32>,
    pub(crate) cu_k: Vec<u32>,
}

impl ProblemData {
    pub(crate) fn new(p: &Problem, seed: u64) -> Self {
        let s = &p.shape;
        let mut cu_q = vec![0u32];
        let mut cu_k = vec![0u32];
        for &(lq, lk) in &p.lens {
            cu_q.push(cu_q.last().unwrap() + lq as u32);
            cu_k.push(cu_k.last().unwrap() + lk as u32);
        }
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        let mut rng = Rng::new(seed);
        let mut data = Self {
            q: rng.normals(tq * s.num_q_heads * s.head_dim_qk, 1.0),
            k: rng.normals(tk * s.num_kv_heads * s.head_dim_qk, 1.0),
            v: rng.normals(tk * s.num_kv_heads * s.head_dim_v, 1.0),
            cu_q,
            cu_k,
        };
        if p.opts == Opts::NanInf {
            data.plant_specials(s);
        }
        data
    }

    /// NaN and infinity in the data, one kind per sequence: sequence 0's first query (head 0)
    /// gets a NaN (its row is NaN); sequence 1's last key a NaN (only its last query sees it);
    /// sequence 2's middle value an infinity and sequence 3's last value a NaN (one column of
    /// the rows that see them).
    fn plant_specials(&mut self, s: &AttentionShape) {
        let (hkv, dk, dv) = (s.num_kv_heads, s.head_dim_qk, s.head_dim_v);
        let key = |seq: usize, j: usize| self.cu_k[seq] as usize + j;
        let len_k = |seq: usize| (self.cu_k[seq + 1] - self.cu_k[seq]) as usize;
        let seqs = self.cu_q.len() - 1;
        self.q[self.cu_q[0] as usize * s.num_q_heads * dk] = f32::NAN;
        if seqs > 1 {
            let j = key(1, len_k(1) - 1);
            self.k[j * hkv * dk + 1] = f32::NAN;
        }
        if seqs > 2 {
            let j = key(2, len_k(2) / 2);
            self.v[j * hkv * dv + 2] = f32::INFINITY;
        }
        if seqs > 3 {
            let j = key(3, len_k(3) - 1);
            self.v[(j * hkv + hkv - 1) * dv + 3] = f32::NAN;
        }
    }

    pub(crate) fn batch<'a>(&'a self, k: &'a [f32], v: &'a [f32]) -> RaggedBatch<'a> {
        RaggedBatch {
            q: &self.q,
            k,
            v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
        }
    }
}

/// The oracle of an attention check: the reference on the stored values and, for f16 kernels,
/// the honest f16 emulation on the same values.
pub(crate) struct Oracle {
    pub(crate) want: AttentionOutput,
    pub(crate) f16: Option<AttentionOutput>,
}

/// FNV-1a of `text`: the data seed of a problem, so checks of the same problem (decode and
/// paged, both precisions) see the same data and share their oracle.
pub(crate) fn seed_of(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
