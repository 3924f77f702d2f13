//! GGUF files for the tests, through the library's writer: metadata (the types the decoder
//! reads), tensors as given (blocks as they are, f32 vectors and matrices), the Llama-family
//! hyper-parameter keys of a [`DecoderConfig`], and a whole model's tensors.

use kvattn::decoder::gguf::{Array, GgmlType, Value};
use kvattn::decoder::model::{DecoderConfig, HostWeights};
use kvattn::decoder::weights::LayerMatrix;

/// One tensor: its type and file bytes.
pub type Blocks = (GgmlType, Vec<u8>);

/// A GGUF file being written (the library's writer, `kvattn::decoder::gguf_writer`, with the
/// shorthands the tests use): metadata and tensors in the order they were added.
#[derive(Default)]
pub struct GgufWriter(kvattn::decoder::gguf_writer::GgufWriter);

/// f32 values as an F32 tensor's bytes.
pub fn f32_blocks(v: &[f32]) -> Blocks {
    (
        GgmlType::F32,
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

impl GgufWriter {
    /// A u32 key.
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.0.metadata(key, Value::U32(v));
        self
    }

    /// An f32 key.
    pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.0.metadata(key, Value::F32(v));
        self
    }

    /// A string key.
    pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
        self.0.metadata(key, Value::String(v.into()));
        self
    }

    /// An array-of-strings key.
    pub fn str_array(&mut self, key: &str, v: &[String]) -> &mut Self {
        self.0
            .metadata(key, Value::Array(Array::String(v.to_vec())));
        self
    }

    /// A tensor of dims `dims` (`ne0` first); panics when the writer refuses it (a test bug).
    pub fn tensor(&mut self, name: &str, dims: &[u64], (ty, data): Blocks) -> &mut Self {
        self.0.tensor(name, ty, dims, data).unwrap();
        self
    }

    /// The hyper-parameter keys `LlamaHyper` reads for a model of shape `c` and architecture
    /// `arch` (the head dim as `attention.key_length` and `value_length`).
    pub fn hyper(&mut self, arch: &str, c: &DecoderConfig) -> &mut Self {
        self.str("general.architecture", arch);
        for (key, v) in [
            ("block_count", c.layers),
            ("embedding_length", c.d_model),
            ("feed_forward_length", c.ffn),
            ("attention.head_count", c.n_heads),
            ("attention.head_count_kv", c.n_kv_heads),
            ("attention.key_length", c.head_dim),
            ("attention.value_length", c.head_dim),
            ("context_length", 256),
            ("vocab_size", c.vocab),
        ] {
            self.u32(&format!("{arch}.{key}"), v as u32);
        }
        self.f32(&format!("{arch}.rope.freq_base"), c.rope_theta);
        self.f32(
            &format!("{arch}.attention.layer_norm_rms_epsilon"),
            c.rms_eps,
        )
    }

    /// Every tensor of a model of shape `c`: the embedding, output (unless `None`) and layer
    /// matrices as `matrix` hands them out (`None` for the output: tied), the norms, Q/K/V
    /// biases and RoPE frequency factors of `w` as F32.
    pub fn model(
        &mut self,
        c: &DecoderConfig,
        w: &HostWeights,
        mut matrix: impl FnMut(Option<(usize, LayerMatrix)>, bool) -> Option<Blocks>,
    ) -> &mut Self {
        let (d, v) = (c.d_model as u64, c.vocab as u64);
        let embedding = matrix(None, false).expect("an embedding");
        self.tensor("token_embd.weight", &[d, v], embedding);
        if let Some(output) = matrix(None, true) {
            self.tensor("output.weight", &[d, v], output);
        }
        self.tensor("output_norm.weight", &[d], f32_blocks(&w.final_norm));
        if let Some(f) = &w.rope_freqs {
            self.tensor("rope_freqs.weight", &[f.len() as u64], f32_blocks(f));
        }
        for (i, l) in w.layers.iter().enumerate() {
            self.tensor(
                &format!("blk.{i}.attn_norm.weight"),
                &[d],
                f32_blocks(&l.attn_norm),
            );
            self.tensor(
                &format!("blk.{i}.ffn_norm.weight"),
                &[d],
                f32_blocks(&l.ffn_norm),
            );
            for which in LayerMatrix::ALL {
                let (n, k) = which.shape(c);
                let name = format!("blk.{i}.{}", which.gguf_name());
                let data = matrix(Some((i, which)), false).expect("every layer matrix");
                self.tensor(&format!("{name}.weight"), &[k as u64, n as u64], data);
                if let Some(b) = l.bias(which) {
                    self.tensor(&format!("{name}.bias"), &[n as u64], f32_blocks(b));
                }
            }
        }
        self
    }

    /// The file's bytes (alignment 32).
    pub fn build(&self) -> Vec<u8> {
        self.0.to_bytes().unwrap()
    }
}

/// A fresh directory under the temporary directory for a test's files (`tag` and the process
/// id in its name).
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvattn-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
