//! Loading a Llama-family GGUF model onto the GPU: hyper-parameters, weights (matrices in their
//! block format, tensor by tensor from the memory-mapped file: [`GgufSource`]), and the
//! tokenizer. [`host_weights`] dequantizes a model to f32 on the host instead (for the CPU
//! reference).

use std::borrow::Cow;

use super::blocks::SUPPORTED;
use super::gguf::{GgufFile, LlamaHyper};
use super::model::{Decoder, DecoderConfig, HostLayer, HostWeights};
use super::tokenizer::Tokenizer;
use super::weights::{LayerMatrix, MatrixData, WeightSource};
use crate::gpu::Context;
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

/// The decoder shape of a GGUF Llama-family model. RoPE pairs as
/// [`LlamaHyper::rope_style`] says: GPT-J for `llama` files (llama.cpp's converter permutes
/// the Q and K rows for it), NeoX for `qwen2`. Partial rotary embeddings are refused.
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
        rope_style: h.rope_style(),
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
    let per_layer = 9 + if hyper.qkv_bias { 3 } else { 0 };
    let total = 2
        + usize::from(!hyper.tied_embeddings)
        + usize::from(hyper.rope_freqs)
        + per_layer * config.layers;
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
    let rope_freqs = if hyper.rope_freqs {
        Some(load("rope_freqs.weight")?)
    } else {
        None
    };
    let layers = (0..config.layers)
        .map(|i| {
            let mut t = |what: &str| load(&format!("blk.{i}.{what}"));
            let mut layer = HostLayer {
                attn_norm: t("attn_norm.weight")?,
                wq: t("attn_q.weight")?,
                wk: t("attn_k.weight")?,
                wv: t("attn_v.weight")?,
                wo: t("attn_output.weight")?,
                bq: None,
                bk: None,
                bv: None,
                ffn_norm: t("ffn_norm.weight")?,
                w_gate: t("ffn_gate.weight")?,
                w_up: t("ffn_up.weight")?,
                w_down: t("ffn_down.weight")?,
            };
            if hyper.qkv_bias {
                layer.bq = Some(t("attn_q.bias")?);
                layer.bk = Some(t("attn_k.bias")?);
                layer.bv = Some(t("attn_v.bias")?);
            }
            Ok(layer)
        })
        .collect::<Result<Vec<_>>>()?;
    let weights = HostWeights {
        embed,
        layers,
        final_norm,
        lm_head,
        rope_freqs,
    };
    weights.validate(&config)?;
    Ok((config, weights))
}

/// A GGUF file as a [`WeightSource`]: each matrix of a type the quantized product reads (rows a
/// multiple of 32 values) is handed out as its bytes, borrowed from the mapped file, so it goes
/// to the GPU in its block format; any other matrix is dequantized to f32. Norms and biases
/// are f32.
#[derive(Debug, Clone, Copy)]
pub struct GgufSource<'a> {
    file: &'a GgufFile,
    tied: bool,
    qkv_bias: bool,
    rope_freqs: bool,
}

impl<'a> GgufSource<'a> {
    /// The weights of `file`, whose hyper-parameters are `hyper` (checked with
    /// [`LlamaHyper::check_tensors`] first).
    pub fn new(file: &'a GgufFile, hyper: &LlamaHyper) -> Result<Self> {
        hyper.check_tensors(file)?;
        Ok(Self {
            file,
            tied: hyper.tied_embeddings,
            qkv_bias: hyper.qkv_bias,
            rope_freqs: hyper.rope_freqs,
        })
    }

    fn matrix_named(&self, name: &str) -> Result<MatrixData<'a>> {
        let t = self
            .file
            .tensor(name)
            .ok_or_else(|| Error::Gguf(format!("tensor {name} is missing")))?;
        if SUPPORTED.contains(&t.ggml_type) && t.row_len() % 32 == 0 {
            Ok(MatrixData::Blocks {
                ty: t.ggml_type,
                bytes: self.file.tensor_data(name)?,
            })
        } else {
            Ok(MatrixData::F32(Cow::Owned(self.file.tensor_f32(name)?)))
        }
    }
}

impl WeightSource for GgufSource<'_> {
    fn embedding(&self) -> Result<MatrixData<'_>> {
        self.matrix_named("token_embd.weight")
    }

    fn output(&self) -> Result<Option<MatrixData<'_>>> {
        if self.tied {
            return Ok(None);
        }
        self.matrix_named("output.weight").map(Some)
    }

    fn final_norm(&self) -> Result<Vec<f32>> {
        self.file.tensor_f32("output_norm.weight")
    }

    fn norms(&self, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let t = |what: &str| self.file.tensor_f32(&format!("blk.{layer}.{what}.weight"));
        Ok((t("attn_norm")?, t("ffn_norm")?))
    }

    fn matrix(&self, layer: usize, which: LayerMatrix) -> Result<MatrixData<'_>> {
        self.matrix_named(&format!("blk.{layer}.{}.weight", which.gguf_name()))
    }

    fn bias(&self, layer: usize, which: LayerMatrix) -> Result<Option<Vec<f32>>> {
        let has = matches!(which, LayerMatrix::Q | LayerMatrix::K | LayerMatrix::V);
        if !(self.qkv_bias && has) {
            return Ok(None);
        }
        let name = format!("blk.{layer}.{}.bias", which.gguf_name());
        self.file.tensor_f32(&name).map(Some)
    }

    fn rope_freqs(&self) -> Result<Option<Vec<f32>>> {
        if !self.rope_freqs {
            return Ok(None);
        }
        self.file.tensor_f32("rope_freqs.weight").map(Some)
    }
}

/// Maps the GGUF file at `path` and uploads its weights tensor by tensor, matrices in their
/// block format ([`GgufSource`]); `progress(done, total)` counts tensors. `precision` is the
/// attention kernel's. Not on the web (no files there): parse the bytes with
/// [`GgufFile::parse`] and call [`load_gguf_file`].
#[cfg(not(target_arch = "wasm32"))]
pub fn load_gguf(
    ctx: &Context,
    path: impl AsRef<std::path::Path>,
    precision: Precision,
    progress: impl FnMut(usize, usize),
) -> Result<LoadedModel> {
    load_gguf_file(ctx, &GgufFile::open(path)?, precision, progress)
}

/// [`load_gguf`] from a file already opened or parsed.
pub fn load_gguf_file(
    ctx: &Context,
    file: &GgufFile,
    precision: Precision,
    progress: impl FnMut(usize, usize),
) -> Result<LoadedModel> {
    let hyper = LlamaHyper::from_gguf(file)?;
    let tokenizer = Tokenizer::from_gguf(file)?;
    if tokenizer.vocab_size() != hyper.vocab_size {
        return Err(Error::InvalidArgument(format!(
            "the tokenizer has {} tokens but the model a vocabulary of {}",
            tokenizer.vocab_size(),
            hyper.vocab_size
        )));
    }
    let config = decoder_config(&hyper)?;
    let source = GgufSource::new(file, &hyper)?;
    let model = Decoder::upload_from(ctx, config, &source, precision, progress)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        hyper,
    })
}
