//! The decoder's shape ([`DecoderConfig`]) and its weights on the host ([`HostWeights`],
//! [`HostLayer`]), with the checks of both.

use crate::attention::AttentionShape;
use crate::cache::paged::PagedKvConfig;
use crate::decoder::weights::LayerMatrix;
use crate::quant::KvDtype;
use crate::rope::{RopeConfig, RopeStyle};

use crate::{Error, Result};

/// The shape of a Llama-family decoder.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderConfig {
    /// Transformer layers.
    pub layers: usize,
    /// Residual width.
    pub d_model: usize,
    /// Query heads.
    pub n_heads: usize,
    /// KV heads (`n_heads` for MHA, 1 for MQA).
    pub n_kv_heads: usize,
    /// Dims per head.
    pub head_dim: usize,
    /// MLP hidden width.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RoPE frequency base.
    pub rope_theta: f32,
    /// Which elements RoPE rotates together (GPT-J for Llama GGUF files, whose Q/K weights
    /// are permuted for it; NeoX for Hugging Face checkpoints).
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
}

impl DecoderConfig {
    /// Checks the sizes: all positive, heads a multiple of KV heads, even head dim.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("layers", self.layers),
            ("d_model", self.d_model),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Err(Error::InvalidArgument(format!(
                    "decoder {what} must be positive"
                )));
            }
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "RoPE theta {} must be finite and positive",
                self.rope_theta
            )));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "RMSNorm epsilon {} must be finite and non-negative",
                self.rms_eps
            )));
        }
        self.attention_shape().validate()?;
        self.rope(self.n_heads).validate()
    }

    /// The attention shape of every layer.
    pub fn attention_shape(&self) -> AttentionShape {
        AttentionShape {
            num_q_heads: self.n_heads,
            num_kv_heads: self.n_kv_heads,
            head_dim_qk: self.head_dim,
            head_dim_v: self.head_dim,
        }
    }

    /// Width of a token's queries (`n_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of a token's keys or values (`n_kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// The RoPE configuration for `heads` heads of a token.
    pub fn rope(&self, heads: usize) -> RopeConfig {
        RopeConfig::new(self.rope_style, self.rope_theta, self.head_dim, heads)
    }

    /// A paged cache configuration for this model in `dtype` (per-row scales, block size 16).
    pub fn kv_config(&self, dtype: KvDtype) -> PagedKvConfig {
        PagedKvConfig::new(self.layers, self.n_kv_heads, self.head_dim, dtype)
    }

    /// Parameters (weights) of the model, output projection included if untied.
    pub fn parameters(&self, tied: bool) -> usize {
        let d = self.d_model;
        let per_layer = 2 * d + d * self.q_dim() * 2 + d * self.kv_dim() * 2 + 3 * d * self.ffn;
        let head = if tied { 0 } else { self.vocab * d };
        self.vocab * d + self.layers * per_layer + d + head
    }
}

/// One layer's weights on the host, matrices `[out, in]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct HostLayer {
    /// RMSNorm weight before attention, `[d_model]`.
    pub attn_norm: Vec<f32>,
    /// `[n_heads * head_dim, d_model]`.
    pub wq: Vec<f32>,
    /// `[n_kv_heads * head_dim, d_model]`.
    pub wk: Vec<f32>,
    /// `[n_kv_heads * head_dim, d_model]`.
    pub wv: Vec<f32>,
    /// `[d_model, n_heads * head_dim]`.
    pub wo: Vec<f32>,
    /// Bias added after the Q product, `[n_heads * head_dim]` (Qwen2); `None`: no bias.
    pub bq: Option<Vec<f32>>,
    /// Bias added after the K product (before RoPE), `[n_kv_heads * head_dim]`.
    pub bk: Option<Vec<f32>>,
    /// Bias added after the V product, `[n_kv_heads * head_dim]`.
    pub bv: Option<Vec<f32>>,
    /// RMSNorm weight before the MLP, `[d_model]`.
    pub ffn_norm: Vec<f32>,
    /// `[ffn, d_model]`.
    pub w_gate: Vec<f32>,
    /// `[ffn, d_model]`.
    pub w_up: Vec<f32>,
    /// `[d_model, ffn]`.
    pub w_down: Vec<f32>,
}

/// A model's weights on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostWeights {
    /// Token embedding `[vocab, d_model]`.
    pub embed: Vec<f32>,
    /// Per layer.
    pub layers: Vec<HostLayer>,
    /// Final RMSNorm weight `[d_model]`.
    pub final_norm: Vec<f32>,
    /// Output projection `[vocab, d_model]`; `None`: tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
    /// RoPE frequency factors `[head_dim / 2]` (Llama 3.1's `rope_freqs.weight`): pair `i`'s
    /// frequency is divided by `rope_freqs[i]`; `None`: unscaled.
    pub rope_freqs: Option<Vec<f32>>,
}

impl HostLayer {
    /// The bias added after matrix `which`'s product: [`HostLayer::bq`], [`HostLayer::bk`],
    /// [`HostLayer::bv`]; `None` for the other matrices.
    pub fn bias(&self, which: LayerMatrix) -> Option<&[f32]> {
        match which {
            LayerMatrix::Q => self.bq.as_deref(),
            LayerMatrix::K => self.bk.as_deref(),
            LayerMatrix::V => self.bv.as_deref(),
            _ => None,
        }
    }
}

impl HostWeights {
    /// Checks every tensor's length against `c` (and the RoPE frequency factors:
    /// [`RopeConfig::inv_freq_scaled`]).
    pub fn validate(&self, c: &DecoderConfig) -> Result<()> {
        let d = c.d_model;
        let check = |what: &'static str, got: usize, want: usize| -> Result<()> {
            if got == want {
                Ok(())
            } else {
                Err(Error::ShapeMismatch {
                    what,
                    expected: want,
                    got,
                })
            }
        };
        check("embedding", self.embed.len(), c.vocab * d)?;
        check("final norm", self.final_norm.len(), d)?;
        if let Some(head) = &self.lm_head {
            check("output projection", head.len(), c.vocab * d)?;
        }
        check("layers", self.layers.len(), c.layers)?;
        c.rope(c.n_heads)
            .inv_freq_scaled(self.rope_freqs.as_deref())?;
        for l in &self.layers {
            check("attn_norm", l.attn_norm.len(), d)?;
            check("wq", l.wq.len(), c.q_dim() * d)?;
            check("wk", l.wk.len(), c.kv_dim() * d)?;
            check("wv", l.wv.len(), c.kv_dim() * d)?;
            check("wo", l.wo.len(), d * c.q_dim())?;
            for (what, bias, want) in [
                ("bq", &l.bq, c.q_dim()),
                ("bk", &l.bk, c.kv_dim()),
                ("bv", &l.bv, c.kv_dim()),
            ] {
                if let Some(b) = bias {
                    check(what, b.len(), want)?;
                }
            }
            check("ffn_norm", l.ffn_norm.len(), d)?;
            check("w_gate", l.w_gate.len(), c.ffn * d)?;
            check("w_up", l.w_up.len(), c.ffn * d)?;
            check("w_down", l.w_down.len(), d * c.ffn)?;
        }
        Ok(())
    }
}
