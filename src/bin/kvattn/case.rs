//! Case files (ARCHITECTURE.md section 12): safetensors in, safetensors out. Reading checks every
//! tensor's dtype and rank and parses the string metadata; writing goes through a temporary file
//! in the destination's directory and a rename, so a failed command leaves no output file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::{Error, Result};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

/// Metadata keys every case file may carry: `format`, which PyTorch's safetensors writer adds
/// on its own.
pub const FREE_META: [&str; 1] = ["format"];

/// An error about the input, as one line.
pub fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// Reads a whole file ("cannot read PATH: why" if it is missing or unreadable).
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| Error::Io {
        what: format!("cannot read {}", path.display()),
        source,
    })
}

/// A parsed safetensors file: its tensors and its metadata strings.
pub struct CaseFile<'a> {
    st: SafeTensors<'a>,
    meta: HashMap<String, String>,
    path: String,
}

/// A tensor's shape and values, f32 or integer, copied out of the file.
pub struct Tensor<T> {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Values in row-major order.
    pub data: Vec<T>,
}

impl<'a> CaseFile<'a> {
    /// Parses `bytes` read from `path` (named in error messages).
    pub fn parse(bytes: &'a [u8], path: &Path) -> Result<Self> {
        let path = path.display().to_string();
        let not_st = |source| Error::Safetensors {
            what: format!("{path} is not a safetensors file"),
            source,
        };
        let st = SafeTensors::deserialize(bytes).map_err(not_st)?;
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(not_st)?;
        let meta = header.metadata().clone().unwrap_or_default();
        Ok(Self { st, meta, path })
    }

    /// The tensor `name` if present, checked to be `dtype` with `rank` dimensions (`what`
    /// describes the expected shape in the error message).
    fn view(
        &self,
        name: &str,
        dtype: Dtype,
        rank: usize,
        what: &str,
    ) -> Result<Option<TensorView<'a>>> {
        let Ok(t) = self.st.tensor(name) else {
            return Ok(None);
        };
        if t.dtype() != dtype || t.shape().len() != rank {
            return Err(invalid(format!(
                "tensor {name} in {} is {:?} {:?}; expected {dtype:?} {what}",
                self.path,
                t.dtype(),
                t.shape()
            )));
        }
        Ok(Some(t))
    }

    /// An optional f32 tensor of rank `rank`.
    pub fn f32_opt(&self, name: &str, rank: usize, what: &str) -> Result<Option<Tensor<f32>>> {
        Ok(self.view(name, Dtype::F32, rank, what)?.map(|t| Tensor {
            shape: t.shape().to_vec(),
            data: t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }))
    }

    /// A required f32 tensor of rank `rank`.
    pub fn f32(&self, name: &str, rank: usize, what: &str) -> Result<Tensor<f32>> {
        self.f32_opt(name, rank, what)?
            .ok_or_else(|| self.missing(name, &format!("F32 {what}")))
    }

    /// A required i32 offset list (rank 1), as u32 (negative entries are refused).
    pub fn offsets(&self, name: &str) -> Result<Vec<u32>> {
        let t = self
            .view(name, Dtype::I32, 1, "[num_seqs + 1]")?
            .ok_or_else(|| self.missing(name, "I32 [num_seqs + 1]"))?;
        t.data()
            .chunks_exact(4)
            .enumerate()
            .map(|(i, c)| {
                let x = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                u32::try_from(x).map_err(|_| invalid(format!("{name}[{i}] is negative ({x})")))
            })
            .collect()
    }

    /// Refuses tensors not in `tensors` and metadata keys not in `meta` (nor [`FREE_META`]),
    /// so a misspelt optional name (`sink` for `sinks`) is an error rather than ignored.
    pub fn check_names(&self, tensors: &[&str], meta: &[&str]) -> Result<()> {
        let mut names = self.st.names();
        names.sort();
        if let Some(name) = names.iter().find(|n| !tensors.contains(n)) {
            return Err(invalid(format!(
                "{} has an unknown tensor {name:?}; accepted: {}",
                self.path,
                tensors.join(", ")
            )));
        }
        let mut keys: Vec<&String> = self.meta.keys().collect();
        keys.sort();
        let known = |k: &str| meta.contains(&k) || FREE_META.contains(&k);
        if let Some(key) = keys.into_iter().find(|k| !known(k)) {
            return Err(invalid(format!(
                "{} has an unknown metadata key {key:?}; accepted: {}",
                self.path,
                meta.iter()
                    .chain(&FREE_META)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(())
    }

    fn missing(&self, name: &str, what: &str) -> Error {
        invalid(format!("{} has no tensor {name} ({what})", self.path))
    }

    /// The metadata string `key`, if present.
    pub fn meta(&self, key: &str) -> Option<&str> {
        self.meta.get(key).map(String::as_str)
    }

    /// Metadata `key` parsed as `T` (`what` names the expected form in the error message).
    pub fn meta_parse<T: std::str::FromStr>(&self, key: &str, what: &str) -> Result<Option<T>> {
        self.meta(key)
            .map(|s| {
                s.trim().parse::<T>().map_err(|_| {
                    invalid(format!(
                        "metadata {key} in {} is {s:?}; expected {what}",
                        self.path
                    ))
                })
            })
            .transpose()
    }
}

/// The tensors of an attention case file (the last two optional).
const ATTENTION_TENSORS: [&str; 7] = [
    "q",
    "k",
    "v",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "sinks",
    "alibi_slopes",
];

/// The metadata keys of an attention case file (`k_scale` and `v_scale` are read by `run
/// attention` itself).
const ATTENTION_META: [&str; 6] = [
    "causal",
    "scale",
    "sliding_window",
    "softcap",
    "k_scale",
    "v_scale",
];

/// An attention problem read from a case file: shapes, options and the ragged batch's tensors.
pub struct AttentionCase {
    /// Heads and head dims, from the tensor shapes.
    pub shape: AttentionShape,
    /// Options from the metadata and the optional tensors.
    pub options: AttentionOptions,
    /// `[total_q, Hq, d]`.
    pub q: Vec<f32>,
    /// `[total_k, Hkv, d]`.
    pub k: Vec<f32>,
    /// `[total_k, Hkv, d_v]`.
    pub v: Vec<f32>,
    /// Query offsets.
    pub cu_q: Vec<u32>,
    /// Key offsets.
    pub cu_k: Vec<u32>,
}

impl AttentionCase {
    /// The batch view of the tensors.
    pub fn batch(&self) -> RaggedBatch<'_> {
        RaggedBatch {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
        }
    }

    /// Reads the `attention` tensors and metadata of ARCHITECTURE.md section 12 and checks that the
    /// shapes agree with each other and with the offsets (the rest is [`RaggedBatch::validate`]).
    pub fn from_file(f: &CaseFile) -> Result<Self> {
        f.check_names(&ATTENTION_TENSORS, &ATTENTION_META)?;
        let q = f.f32("q", 3, "[total_q, Hq, d]")?;
        let k = f.f32("k", 3, "[total_k, Hkv, d]")?;
        let v = f.f32("v", 3, "[total_k, Hkv, d_v]")?;
        let cu_q = f.offsets("cu_seqlens_q")?;
        let cu_k = f.offsets("cu_seqlens_k")?;
        let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
        if ks[0] != vs[0] {
            return Err(invalid(format!(
                "k has {} token rows but v has {}",
                ks[0], vs[0]
            )));
        }
        if ks[1] != vs[1] {
            return Err(invalid(format!(
                "k has {} heads but v has {}",
                ks[1], vs[1]
            )));
        }
        if qs[2] != ks[2] {
            return Err(invalid(format!(
                "q has head dim {} but k has {}",
                qs[2], ks[2]
            )));
        }
        for (name, cu, rows, tensor) in [
            ("cu_seqlens_q", &cu_q, qs[0], "q"),
            ("cu_seqlens_k", &cu_k, ks[0], "k"),
        ] {
            if let Some(&last) = cu.last() {
                if last as usize != rows {
                    return Err(invalid(format!(
                        "{name} ends at {last} but {tensor} has {rows} token rows"
                    )));
                }
            }
        }
        let shape = AttentionShape {
            num_q_heads: qs[1],
            num_kv_heads: ks[1],
            head_dim_qk: qs[2],
            head_dim_v: vs[2],
        };
        let per_head = |name: &str| -> Result<Option<Vec<f32>>> {
            let Some(t) = f.f32_opt(name, 1, "[Hq]")? else {
                return Ok(None);
            };
            if t.shape[0] != shape.num_q_heads {
                return Err(invalid(format!(
                    "{name} has {} entries but q has {} heads",
                    t.shape[0], shape.num_q_heads
                )));
            }
            Ok(Some(t.data))
        };
        let options = AttentionOptions {
            causal: f
                .meta_parse::<bool>("causal", "true or false")?
                .unwrap_or(true),
            scale: f.meta_parse::<f32>("scale", "a number")?,
            sliding_window: f.meta_parse::<usize>("sliding_window", "a whole number of tokens")?,
            softcap: f.meta_parse::<f32>("softcap", "a number")?,
            sinks: per_head("sinks")?,
            alibi_slopes: per_head("alibi_slopes")?,
        };
        Ok(Self {
            shape,
            options,
            q: q.data,
            k: k.data,
            v: v.data,
            cu_q,
            cu_k,
        })
    }
}

/// One output tensor: name, dtype, shape, little-endian bytes.
pub struct OutTensor {
    /// Tensor name.
    pub name: &'static str,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub bytes: Vec<u8>,
}

impl OutTensor {
    /// An f32 tensor.
    pub fn f32(name: &'static str, shape: Vec<usize>, data: &[f32]) -> Self {
        Self {
            name,
            dtype: Dtype::F32,
            shape,
            bytes: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// A u8 tensor.
    pub fn u8(name: &'static str, shape: Vec<usize>, data: Vec<u8>) -> Self {
        Self {
            name,
            dtype: Dtype::U8,
            shape,
            bytes: data,
        }
    }
}

/// Serializes `tensors` with `meta` and writes them to `path` atomically: a temporary file in
/// the same directory, renamed over `path` once complete (removed on failure).
pub fn write_atomic(
    path: &Path,
    tensors: &[OutTensor],
    meta: HashMap<String, String>,
) -> Result<()> {
    let views = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|v| (t.name, v))
                .map_err(|source| Error::Safetensors {
                    what: format!("tensor {}", t.name),
                    source,
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|source| Error::Safetensors {
        what: "cannot serialize the result".into(),
        source,
    })?;
    let tmp = temp_path(path);
    let result = std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, path));
    result.map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        Error::Io {
            what: format!("cannot write {}", path.display()),
            source,
        }
    })
}

/// `.NAME.tmp-PID` beside `path`.
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}
