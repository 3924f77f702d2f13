//! Loading a Llama-family GGUF model onto the GPU: hyper-parameters, weights (dequantized to
//! f32 on load), and the tokenizer.

use std::path::Path;

use super::gguf::{GgufFile, LlamaHyper};
use super::model::{Decoder, DecoderConfig, HostLayer, HostWeights};
use super::tokenizer::Tokenizer;
use crate::gpu::Context;
use crate::rope::RopeStyle;
use crate::shader::Precision;
use crate::{Error, Result};

/// A model ready to generate: the decoder on the GPU, its tokenizer and hyper-parameters.
#[derive(Debug)]
pub struct LoadedModel {
    /// The decoder.
    pub model: Decoder,
    /// The tokenizer from the file's metadata.
    pub tokenizer: Tokenizer,
    /// The file's hyper-parameters.
    pub hyper: LlamaHyper,
}

/// The decoder shape of a GGUF Llama model. GGUF Llama files need GPT-J-style RoPE: llama.cpp's
/// converter permutes the Q and K rows for it. Partial rotary embeddings are refused.
pub fn decoder_config(h: &LlamaHyper) -> Result<DecoderConfig> {
    if h.rope_dim != h.head_dim {
        return Err(Error::InvalidArgument(format!(
            "partial rotary embeddings (RoPE dim {} of head dim {}) are not supported",
            h.rope_dim, h.head_dim
        )));
    }
    Ok(DecoderConfig {
        layers: h.n_layers,
        d_model: h.d_model,
        n_heads: h.n_heads,
        n_kv_heads: h.n_kv_heads,
        head_dim: h.head_dim,
        ffn: h.ffn_dim,
        vocab: h.vocab_size,
        rope_theta: h.rope_base,
        rope_style: RopeStyle::GptJ,
        rms_eps: h.rms_eps,
    })
}

/// The weights of the first `layers` layers (all when `None`) of `file`, dequantized to f32;
/// `progress(done, total)` is called after each tensor. The returned config has that many
/// layers.
pub fn host_weights(
    file: &GgufFile,
    hyper: &LlamaHyper,
    layers: Option<usize>,
    mut progress: impl FnMut(usize, usize),
) -> Result<(DecoderConfig, HostWeights)> {
    hyper.check_tensors(file)?;
    let mut config = decoder_config(hyper)?;
    config.layers = layers.unwrap_or(hyper.n_layers).min(hyper.n_layers);
    let total = 2 + usize::from(!hyper.tied_embeddings) + 9 * config.layers;
    let mut done = 0;
    let mut load = |name: &str| -> Result<Vec<f32>> {
        let x = file.tensor_f32(name)?;
        done += 1;
        progress(done, total);
        Ok(x)
    };
    let embed = load("token_embd.weight")?;
    let final_norm = load("output_norm.weight")?;
    let lm_head = if hyper.tied_embeddings {
        None
    } else {
        Some(load("output.weight")?)
    };
    let layers = (0..config.layers)
        .map(|i| {
            let mut t = |what: &str| load(&format!("blk.{i}.{what}.weight"));
            Ok(HostLayer {
                attn_norm: t("attn_norm")?,
                wq: t("attn_q")?,
                wk: t("attn_k")?,
                wv: t("attn_v")?,
                wo: t("attn_output")?,
                ffn_norm: t("ffn_norm")?,
                w_gate: t("ffn_gate")?,
                w_up: t("ffn_up")?,
                w_down: t("ffn_down")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let weights = HostWeights {
        embed,
        layers,
        final_norm,
        lm_head,
    };
    weights.validate(&config)?;
    Ok((config, weights))
}

/// Reads the GGUF file at `path`, dequantizes its weights and uploads them; `progress(done,
/// total)` counts tensors. `precision` is the attention kernel's.
pub fn load_gguf(
    ctx: &Context,
    path: impl AsRef<Path>,
    precision: Precision,
    progress: impl FnMut(usize, usize),
) -> Result<LoadedModel> {
    let file = GgufFile::open(path)?;
    let hyper = LlamaHyper::from_gguf(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    if tokenizer.vocab_size() != hyper.vocab_size {
        return Err(Error::InvalidArgument(format!(
            "the tokenizer has {} tokens but the model a vocabulary of {}",
            tokenizer.vocab_size(),
            hyper.vocab_size
        )));
    }
    let (config, weights) = host_weights(&file, &hyper, None, progress)?;
    let model = Decoder::upload(ctx, config, &weights, precision)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        hyper,
    })
}
