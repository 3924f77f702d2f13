//! The hyper-parameters of a Llama-family model read from a file's metadata ([`LlamaHyper`]),
//! the architectures read that way ([`LLAMA_ARCHITECTURES`]) and the tensor table they imply.

use super::{gguf_err, GgmlType, GgufFile, Value};
use crate::rope::RopeStyle;
use crate::Result;

/// Architectures whose GGUF keys and tensors follow the Llama layout (`{arch}.block_count`, ...):
/// `llama` (Llama 2 and 3.x, SmolLM, Mistral) and `qwen2` (Qwen2, Qwen2.5: biases on the Q, K
/// and V products, NeoX-style RoPE).
pub const LLAMA_ARCHITECTURES: &[&str] = &["llama", "qwen2"];

/// Hyper-parameters of a Llama-family model, read from GGUF metadata.
///
/// Note for the forward pass: for `llama` files, llama.cpp's converter permutes the rows of
/// `attn_q` and `attn_k` so that each rotary pair is two *adjacent* elements: they take GPT-J
/// style RoPE ([`crate::rope::RopeStyle::GptJ`]). It leaves `qwen2` rows as Hugging Face has
/// them: NeoX style ([`LlamaHyper::rope_style`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaHyper {
    /// `general.architecture`, one of [`LLAMA_ARCHITECTURES`].
    pub architecture: String,
    /// Transformer blocks (`{arch}.block_count`).
    pub n_layers: usize,
    /// Hidden size (`{arch}.embedding_length`).
    pub d_model: usize,
    /// Query heads (`{arch}.attention.head_count`).
    pub n_heads: usize,
    /// Key/value heads (`{arch}.attention.head_count_kv`, default `n_heads`).
    pub n_kv_heads: usize,
    /// Per-head dimension (`{arch}.attention.key_length`, else `d_model / n_heads`).
    pub head_dim: usize,
    /// Rotated dimensions per head (`{arch}.rope.dimension_count`, default `head_dim`).
    pub rope_dim: usize,
    /// Feed-forward inner size (`{arch}.feed_forward_length`).
    pub ffn_dim: usize,
    /// RoPE theta (`{arch}.rope.freq_base`, default 10000).
    pub rope_base: f32,
    /// RMSNorm epsilon (`{arch}.attention.layer_norm_rms_epsilon`, default 1e-5).
    pub rms_eps: f32,
    /// Vocabulary size (`{arch}.vocab_size`, else the tokenizer's token count, else
    /// `token_embd.weight`'s rows).
    pub vocab_size: usize,
    /// Training context length (`{arch}.context_length`).
    pub context_length: usize,
    /// True when there is no `output.weight`: the output projection is `token_embd.weight`.
    pub tied_embeddings: bool,
    /// True when the Q, K and V products have biases (`blk.N.attn_q.bias`, `attn_k.bias`,
    /// `attn_v.bias`): always for `qwen2`; for `llama` when the file has `blk.0.attn_q.bias`
    /// (llama.cpp accepts them there too). Then every layer must have all three.
    pub qkv_bias: bool,
    /// True when a `llama` file has `rope_freqs.weight` (`[rope_dim / 2]`, Llama 3.1 and
    /// 3.2): RoPE pair `i`'s frequency is divided by its factor `i`.
    pub rope_freqs: bool,
}

impl LlamaHyper {
    /// Reads and checks the hyper-parameters: the architecture is one of
    /// [`LLAMA_ARCHITECTURES`], sizes are positive, `n_heads` is a multiple of `n_kv_heads`,
    /// `head_dim` divides evenly, `rope_dim` is even and at most `head_dim`, epsilon and theta
    /// are finite and positive, RoPE is not scaled ([`check_rope_scaling`]), and
    /// `token_embd.weight` (when present) is `[d_model, vocab]`.
    /// [`LlamaHyper::check_tensors`] checks the rest of the tensor table.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.get_str("general.architecture")?;
        if !LLAMA_ARCHITECTURES.contains(&arch) {
            return Err(gguf_err(format!(
                "architecture {arch:?} is not supported (supported: {LLAMA_ARCHITECTURES:?})"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let positive = |k: &str| -> Result<usize> {
            let v = file.get_u32(&key(k))?;
            if v == 0 {
                return Err(gguf_err(format!("metadata {} must be positive", key(k))));
            }
            Ok(v as usize)
        };
        let n_layers = positive("block_count")?;
        let d_model = positive("embedding_length")?;
        let ffn_dim = positive("feed_forward_length")?;
        let n_heads = positive("attention.head_count")?;
        let context_length = positive("context_length")?;
        let n_kv_heads = match file.get_u32_opt(&key("attention.head_count_kv"))? {
            None => n_heads,
            Some(0) => {
                return Err(gguf_err(format!(
                    "metadata {} must be positive",
                    key("attention.head_count_kv")
                )))
            }
            Some(v) => v as usize,
        };
        if n_heads % n_kv_heads != 0 {
            return Err(gguf_err(format!(
                "{n_heads} query heads are not a multiple of {n_kv_heads} key/value heads"
            )));
        }
        let head_dim = match file.get_u32_opt(&key("attention.key_length"))? {
            Some(v) if v > 0 => v as usize,
            Some(_) => return Err(gguf_err("attention.key_length must be positive")),
            None => {
                if d_model % n_heads != 0 {
                    return Err(gguf_err(format!(
                        "embedding_length {d_model} is not a multiple of head_count {n_heads}"
                    )));
                }
                d_model / n_heads
            }
        };
        if let Some(v) = file.get_u32_opt(&key("attention.value_length"))? {
            if v as usize != head_dim {
                return Err(gguf_err(format!(
                    "attention.value_length {v} differs from the key length {head_dim}: not supported"
                )));
            }
        }
        let rope_dim = file
            .get_u32_opt(&key("rope.dimension_count"))?
            .map_or(head_dim, |v| v as usize);
        if rope_dim == 0 || rope_dim % 2 != 0 || rope_dim > head_dim {
            return Err(gguf_err(format!(
                "rope.dimension_count {rope_dim} must be even, positive and at most head_dim {head_dim}"
            )));
        }
        let rope_base = file.get_f32_opt(&key("rope.freq_base"))?.unwrap_or(10000.0);
        if !(rope_base.is_finite() && rope_base > 0.0) {
            return Err(gguf_err(format!(
                "rope.freq_base {rope_base} must be finite and positive"
            )));
        }
        check_rope_scaling(file, arch)?;
        let rms_eps = file
            .get_f32_opt(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5);
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            return Err(gguf_err(format!(
                "attention.layer_norm_rms_epsilon {rms_eps} must be finite and positive"
            )));
        }
        let embd = file.tensor("token_embd.weight");
        let vocab_size = match file.get_u32_opt(&key("vocab_size"))? {
            Some(v) => v as usize,
            None => match file.get("tokenizer.ggml.tokens").and_then(Value::as_array) {
                Some(a) => a.len(),
                None => match embd {
                    Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
                    _ => return Err(gguf_err("cannot tell the vocabulary size: no vocab_size key, no tokens, no token_embd.weight")),
                },
            },
        };
        if vocab_size == 0 {
            return Err(gguf_err("vocabulary size is 0"));
        }
        if let Some(t) = embd {
            if t.dims != [d_model as u64, vocab_size as u64] {
                return Err(gguf_err(format!(
                    "token_embd.weight has dims {:?}, expected [{d_model}, {vocab_size}]",
                    t.dims
                )));
            }
        }
        Ok(Self {
            architecture: arch.to_string(),
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            ffn_dim,
            rope_base,
            rms_eps,
            vocab_size,
            context_length,
            tied_embeddings: file.tensor("output.weight").is_none(),
            qkv_bias: arch == "qwen2" || file.tensor("blk.0.attn_q.bias").is_some(),
            rope_freqs: arch == "llama" && file.tensor("rope_freqs.weight").is_some(),
        })
    }

    /// The RoPE pairing the file's Q and K rows need: GPT-J for `llama` (rows permuted by the
    /// converter), NeoX for `qwen2`.
    pub fn rope_style(&self) -> RopeStyle {
        if self.architecture == "qwen2" {
            RopeStyle::NeoX
        } else {
            RopeStyle::GptJ
        }
    }

    /// The tensors a Llama model needs and their dims (`ne0` first): `token_embd.weight`,
    /// `output_norm.weight`, `output.weight` unless tied, and per block `attn_norm`, `attn_q`,
    /// `attn_k`, `attn_v`, `attn_output`, `ffn_norm`, `ffn_gate`, `ffn_up`, `ffn_down` (each
    /// `.weight`), with `attn_q.bias`, `attn_k.bias` and `attn_v.bias` when
    /// [`qkv_bias`](Self::qkv_bias), and `rope_freqs.weight` when
    /// [`rope_freqs`](Self::rope_freqs).
    pub fn expected_tensors(&self) -> Vec<(String, Vec<u64>)> {
        let d = self.d_model as u64;
        let q = (self.n_heads * self.head_dim) as u64;
        let kv = (self.n_kv_heads * self.head_dim) as u64;
        let f = self.ffn_dim as u64;
        let v = self.vocab_size as u64;
        let mut out = vec![
            ("token_embd.weight".to_string(), vec![d, v]),
            ("output_norm.weight".to_string(), vec![d]),
        ];
        if !self.tied_embeddings {
            out.push(("output.weight".to_string(), vec![d, v]));
        }
        if self.rope_freqs {
            out.push((
                "rope_freqs.weight".to_string(),
                vec![self.rope_dim as u64 / 2],
            ));
        }
        for i in 0..self.n_layers {
            for (name, dims) in [
                ("attn_norm", vec![d]),
                ("attn_q", vec![d, q]),
                ("attn_k", vec![d, kv]),
                ("attn_v", vec![d, kv]),
                ("attn_output", vec![q, d]),
                ("ffn_norm", vec![d]),
                ("ffn_gate", vec![d, f]),
                ("ffn_up", vec![d, f]),
                ("ffn_down", vec![f, d]),
            ] {
                out.push((format!("blk.{i}.{name}.weight"), dims));
            }
            if self.qkv_bias {
                for (name, n) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                    out.push((format!("blk.{i}.{name}.bias"), vec![n]));
                }
            }
        }
        out
    }

    /// Checks that every tensor of [`LlamaHyper::expected_tensors`] is present with its dims
    /// and a type kvattn reads, and that the file has no other tensor: one the forward pass
    /// would ignore (an `attn_output.bias`, a bias of another layer, `rope_freqs.weight` in a
    /// `qwen2` file) is refused by name rather than giving wrong logits.
    pub fn check_tensors(&self, file: &GgufFile) -> Result<()> {
        let expected = self.expected_tensors();
        if let Some(t) = file
            .tensors()
            .iter()
            .find(|t| !expected.iter().any(|(name, _)| *name == t.name))
        {
            let why = if t.name == "rope_freqs.weight" {
                " (per-dimension RoPE frequency factors, Llama 3.1 style RoPE scaling)"
            } else {
                ""
            };
            return Err(gguf_err(format!(
                "tensor {}{why} is not supported for architecture {:?}: kvattn's decoder \
                 would ignore it",
                t.name, self.architecture
            )));
        }
        for (name, dims) in expected {
            let t = file
                .tensor(&name)
                .ok_or_else(|| gguf_err(format!("tensor {name} is missing")))?;
            if t.dims != dims {
                return Err(gguf_err(format!(
                    "tensor {name} has dims {:?}, expected {dims:?}",
                    t.dims
                )));
            }
            if !t.ggml_type.can_dequantize() {
                return Err(gguf_err(format!(
                    "tensor {name} is of ggml type {} (id {}), which kvattn does not read \
                     (it reads {})",
                    t.ggml_type,
                    t.ggml_type.id(),
                    crate::decoder::blocks::SUPPORTED
                        .map(GgmlType::name)
                        .join(", ")
                )));
            }
        }
        Ok(())
    }
}

/// Refuses scaled RoPE, which the decoder does not implement: a `{arch}.rope.scaling.type`
/// other than `none` (or `linear` with a factor of 1), a `{arch}.rope.scaling.factor` or
/// `{arch}.rope.scale_linear` other than 1 (0 counts as unset, as in llama.cpp); the error
/// names the key and its value.
pub fn check_rope_scaling(file: &GgufFile, arch: &str) -> Result<()> {
    let unscaled = |k: &str| -> Result<bool> {
        Ok(file
            .get_f32_opt(&format!("{arch}.{k}"))?
            .is_none_or(|v| v == 0.0 || v == 1.0))
    };
    for k in ["rope.scaling.factor", "rope.scale_linear"] {
        if !unscaled(k)? {
            let v = file.get_f32(&format!("{arch}.{k}"))?;
            return Err(gguf_err(format!(
                "RoPE scaling ({arch}.{k} = {v}) is not supported"
            )));
        }
    }
    match file.get_str_opt(&format!("{arch}.rope.scaling.type"))? {
        None | Some("none") | Some("linear") => Ok(()),
        Some(other) => Err(gguf_err(format!(
            "RoPE scaling type {other:?} ({arch}.rope.scaling.type) is not supported"
        ))),
    }
}
