//! CPU reference of the Llama-family decoder's forward pass: the oracle of
//! [`Decoder`](crate::decoder::model::Decoder). Plain loops with f64 accumulation for the norms
//! and matrix products (each output rounded once to f32, then the layer's Q/K/V bias, if any,
//! added in f32), [`rope`](super::rope::rope) for the rotary embedding and
//! [`attention`](super::attention()) (causal) for attention, on one sequence. RoPE frequencies
//! are divided by the weights' frequency factors when they have them
//! ([`rope_scaled`](super::rope::rope_scaled)).

use crate::attention::{AttentionOptions, RaggedBatch};
use crate::decoder::model::{DecoderConfig, HostWeights};
use crate::{Error, Result};

/// `out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w` for rows of `w.len()` values.
fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        out.extend(
            row.iter()
                .zip(w)
                .map(|(&v, &g)| (f64::from(v) * inv * f64::from(g)) as f32),
        );
    }
    out
}

/// `y[t] = W x[t]` with `W` `[n, k]`.
fn linear(x: &[f32], w: &[f32], k: usize, n: usize) -> Vec<f32> {
    let mut y = Vec::with_capacity(x.len() / k * n);
    for row in x.chunks(k) {
        for wr in w.chunks(k).take(n) {
            let acc: f64 = row
                .iter()
                .zip(wr)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            y.push(acc as f32);
        }
    }
    y
}

/// `y[t] + b` for every row `t` of `y` ([`super::ops::bias_add`]), when there is a bias.
fn add_bias(y: Vec<f32>, bias: Option<&[f32]>) -> Result<Vec<f32>> {
    match bias {
        Some(b) => super::ops::bias_add(&y, b),
        None => Ok(y),
    }
}

/// The residual stream `[tokens.len(), d_model]` after the first `layers` layers.
fn hidden(
    config: &DecoderConfig,
    weights: &HostWeights,
    tokens: &[u32],
    layers: Option<usize>,
) -> Result<Vec<f32>> {
    config.validate()?;
    weights.validate(config)?;
    let c = config;
    let d = c.d_model;
    if tokens.is_empty() {
        return Err(Error::InvalidArgument("no tokens".into()));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab) {
        return Err(Error::InvalidArgument(format!(
            "token {bad} is outside the vocabulary of {}",
            c.vocab
        )));
    }
    let n_layers = layers.unwrap_or(c.layers).min(c.layers);
    let t = tokens.len();
    let positions: Vec<u32> = (0..t as u32).collect();
    let mut x: Vec<f32> = tokens
        .iter()
        .flat_map(|&id| weights.embed[id as usize * d..(id as usize + 1) * d].to_vec())
        .collect();
    let shape = c.attention_shape();
    let options = AttentionOptions::default();
    for w in &weights.layers[..n_layers] {
        let h = rms_norm(&x, &w.attn_norm, c.rms_eps);
        let q = add_bias(linear(&h, &w.wq, d, c.q_dim()), w.bq.as_deref())?;
        let k = add_bias(linear(&h, &w.wk, d, c.kv_dim()), w.bk.as_deref())?;
        let v = add_bias(linear(&h, &w.wv, d, c.kv_dim()), w.bv.as_deref())?;
        let factors = weights.rope_freqs.as_deref();
        let q = super::rope::rope_scaled(&q, &positions, &c.rope(c.n_heads), factors)?;
        let k = super::rope::rope_scaled(&k, &positions, &c.rope(c.n_kv_heads), factors)?;
        let cu = [0u32, t as u32];
        let batch = RaggedBatch {
            q: &q,
            k: &k,
            v: &v,
            cu_seqlens_q: &cu,
            cu_seqlens_k: &cu,
        };
        let attn = super::attention(&batch, &shape, &options)?.out;
        let o = linear(&attn, &w.wo, c.q_dim(), d);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let h = rms_norm(&x, &w.ffn_norm, c.rms_eps);
        let gate = linear(&h, &w.w_gate, d, c.ffn);
        let up = linear(&h, &w.w_up, d, c.ffn);
        let act: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| {
                let g = f64::from(g);
                (g / (1.0 + (-g).exp()) * f64::from(u)) as f32
            })
            .collect();
        let down = linear(&act, &w.w_down, c.ffn, d);
        x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
    }
    Ok(x)
}

/// The logits (`[vocab]`) after the last of `tokens`, run as one causal prefill from position 0
/// through the first `layers` layers of the model (all of them when `None`), then the final norm
/// and the output projection.
pub fn llama_logits(
    config: &DecoderConfig,
    weights: &HostWeights,
    tokens: &[u32],
    layers: Option<usize>,
) -> Result<Vec<f32>> {
    let x = hidden(config, weights, tokens, layers)?;
    let d = config.d_model;
    head(config, weights, &x[x.len() - d..])
}

/// [`llama_logits`] after every one of `tokens`: `[tokens.len(), vocab]`, row `i` predicting
/// token `i + 1` (teacher forcing: one pass checks a whole greedy continuation).
pub fn llama_logits_all(
    config: &DecoderConfig,
    weights: &HostWeights,
    tokens: &[u32],
    layers: Option<usize>,
) -> Result<Vec<f32>> {
    let x = hidden(config, weights, tokens, layers)?;
    head(config, weights, &x)
}

/// The final norm and the output projection of each row of `x`.
fn head(c: &DecoderConfig, weights: &HostWeights, x: &[f32]) -> Result<Vec<f32>> {
    let d = c.d_model;
    let table = weights.lm_head.as_deref().unwrap_or(&weights.embed);
    let mut out = Vec::with_capacity(x.len() / d * c.vocab);
    for row in x.chunks_exact(d) {
        let normed = rms_norm(row, &weights.final_norm, c.rms_eps);
        out.extend(linear(&normed, table, d, c.vocab));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::toy::{random_weights, toy_config};

    #[test]
    fn biases_and_factors_of_the_wrong_shape_are_refused() {
        let c = DecoderConfig {
            layers: 1,
            ..toy_config(2)
        };
        let w = random_weights(&c, 3);
        let mut biased = w.clone();
        biased.layers[0].bk = Some(vec![0.5; c.kv_dim()]);
        let a = llama_logits(&c, &w, &[1, 2, 3], None).unwrap();
        let b = llama_logits(&c, &biased, &[1, 2, 3], None).unwrap();
        assert_ne!(a, b, "the K bias is used");
        biased.layers[0].bk = Some(vec![0.5; c.q_dim()]);
        match llama_logits(&c, &biased, &[1], None) {
            Err(Error::ShapeMismatch { what: "bk", .. }) => {}
            other => panic!("{other:?}"),
        }
        for factors in [vec![1.0; c.head_dim], vec![0.0; c.head_dim / 2]] {
            let scaled = HostWeights {
                rope_freqs: Some(factors),
                ..w.clone()
            };
            match llama_logits(&c, &scaled, &[1], None) {
                Err(Error::InvalidArgument(m)) => assert!(m.contains("RoPE"), "{m}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(super::super::ops::bias_add(&[1.0; 5], &[1.0, 2.0]).is_err());
        assert!(super::super::ops::bias_add(&[1.0; 4], &[]).is_err());
    }
}
