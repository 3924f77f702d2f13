//! A GGUF version 3 writer for the tests: metadata (the types the decoder reads), tensors as
//! given (blocks as they are, f32 vectors and matrices), the Llama-family hyper-parameter keys
//! of a [`DecoderConfig`], and a whole model's tensors.

use kvattn::decoder::gguf::GgmlType;
use kvattn::decoder::model::{DecoderConfig, HostWeights};
use kvattn::decoder::weights::LayerMatrix;

/// One tensor: its type and file bytes.
pub type Blocks = (GgmlType, Vec<u8>);

/// A GGUF file being written: metadata and tensors in the order they were added.
#[derive(Default)]
pub struct GgufWriter {
    kv: Vec<u8>,
    n_kv: u64,
    /// Name, dims (`ne0` first: `[in, out]` for a matrix) and data.
    tensors: Vec<(String, Vec<u64>, Blocks)>,
}

fn string(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// f32 values as an F32 tensor's bytes.
pub fn f32_blocks(v: &[f32]) -> Blocks {
    (
        GgmlType::F32,
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

impl GgufWriter {
    /// A key with its type tag and encoded value.
    fn put(&mut self, key: &str, tag: u32, value: &[u8]) -> &mut Self {
        string(&mut self.kv, key);
        self.kv.extend(tag.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    /// A u32 key.
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.put(key, 4, &v.to_le_bytes())
    }

    /// An f32 key.
    pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.put(key, 6, &v.to_le_bytes())
    }

    /// A string key.
    pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
        let mut b = Vec::new();
        string(&mut b, v);
        self.put(key, 8, &b)
    }

    /// An array-of-strings key.
    pub fn str_array(&mut self, key: &str, v: &[String]) -> &mut Self {
        let mut b = 8u32.to_le_bytes().to_vec();
        b.extend((v.len() as u64).to_le_bytes());
        v.iter().for_each(|s| string(&mut b, s));
        self.put(key, 9, &b)
    }

    /// A tensor of dims `dims` (`ne0` first).
    pub fn tensor(&mut self, name: &str, dims: &[u64], data: Blocks) -> &mut Self {
        self.tensors.push((name.into(), dims.to_vec(), data));
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
        let align = |x: usize| x.div_ceil(32) * 32;
        let mut info = Vec::new();
        let mut offset = 0usize;
        for (name, dims, (ty, bytes)) in &self.tensors {
            string(&mut info, name);
            info.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|x| info.extend(x.to_le_bytes()));
            info.extend(ty.id().to_le_bytes());
            info.extend((offset as u64).to_le_bytes());
            offset = align(offset + bytes.len());
        }
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.n_kv.to_le_bytes());
        out.extend(&self.kv);
        out.extend(info);
        out.resize(align(out.len()), 0);
        for (_, _, (_, bytes)) in &self.tensors {
            out.extend(bytes);
            out.resize(align(out.len()), 0);
        }
        out
    }
}

/// A fresh directory under the temporary directory for a test's files (`tag` and the process
/// id in its name).
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvattn-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
