//! The parsed file ([`GgufFile`]): opening or parsing it (header, metadata, tensor table and
//! their checks), typed metadata lookups and tensor data, raw or dequantized; the tensor table's
//! entries ([`TensorInfo`]).

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use super::reader::{align_up, Cursor};
use super::{
    dequantize, gguf_err, Array, GgmlType, Value, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS,
    MAX_PREALLOC,
};
use crate::{Error, Result};

/// One entry of the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, `ne0` first: `dims[0]` is the contiguous one (row length), the last varies
    /// slowest. `[576, 49152]` is 49,152 rows of 576.
    pub dims: Vec<u64>,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Byte offset of the data from the start of the data section (a multiple of the alignment).
    pub offset: u64,
    /// Product of `dims`.
    pub n_elements: u64,
    /// Bytes of data.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Elements per row: `dims[0]`.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(0)
    }

    /// Number of rows: the product of `dims[1..]` (1 for a vector).
    pub fn n_rows(&self) -> u64 {
        // The product of all dims fits in u64 (checked at parse), so this one does too.
        self.dims.iter().skip(1).product()
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> u64 {
        self.row_len() / self.ggml_type.block_size() * self.ggml_type.block_bytes()
    }
}

/// A parsed GGUF file held in memory: metadata, tensor table and the raw bytes.
#[derive(Clone)]
pub struct GgufFile {
    pub(super) bytes: FileBytes,
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("bytes", &self.bytes.len())
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

/// Where a file's bytes live: mapped from disk ([`GgufFile::open`]) or in memory
/// ([`GgufFile::parse`]); shared by clones.
#[derive(Clone)]
pub(super) enum FileBytes {
    Owned(Arc<Vec<u8>>),
    #[cfg(not(target_arch = "wasm32"))]
    Mapped(Arc<memmap2::Mmap>),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            #[cfg(not(target_arch = "wasm32"))]
            Self::Mapped(m) => m,
        }
    }
}

impl GgufFile {
    /// Maps the file at `path` into memory and parses its header, metadata and tensor table.
    /// The tensor data is not read here: the operating system reads a tensor's pages when the
    /// tensor is used ([`GgufFile::tensor_data`]), so opening a file costs its header, not its
    /// size, and memory holds only what was touched.
    ///
    /// The file must not be modified or truncated while the returned value lives (the usual
    /// contract of a memory-mapped file; model files are written once).
    ///
    /// # Errors
    /// [`Error::Io`] (naming `path`, with the I/O error as its source) when the file cannot be
    /// opened or mapped; [`Error::Gguf`] (naming `path`) when it is not a valid GGUF file.
    ///
    /// Not on the web (no files there): use [`GgufFile::parse`] on the fetched bytes.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            what: format!("GGUF: cannot read {}", path.display()),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let bytes = if len == 0 {
            FileBytes::Owned(Arc::new(Vec::new()))
        } else {
            // SAFETY: the mapping is read-only and private to this value; the documented
            // contract is that the file is not modified while it is mapped.
            FileBytes::Mapped(Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?))
        };
        Self::parse_bytes(bytes).map_err(|e| match e {
            Error::Gguf(m) => gguf_err(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Parses a whole GGUF file held in memory. Checks the header, every metadata value, the
    /// tensor table (dims, types, offsets and sizes inside the data section, unique names) and
    /// the alignment.
    pub fn parse(bytes: Vec<u8>) -> Result<Self> {
        Self::parse_bytes(FileBytes::Owned(Arc::new(bytes)))
    }

    fn parse_bytes(bytes: FileBytes) -> Result<Self> {
        let mut c = Cursor {
            buf: &bytes,
            pos: 0,
        };
        let magic = c.array::<4>("magic")?;
        if magic != GGUF_MAGIC {
            return Err(gguf_err(format!(
                "not a GGUF file: magic {magic:02x?}, expected \"GGUF\""
            )));
        }
        let version = c.u32("version")?;
        match version {
            2 | 3 => {}
            1 => return Err(gguf_err("GGUF version 1 is not supported (only 2 and 3)")),
            v if (1..=3).contains(&v.swap_bytes()) => {
                return Err(gguf_err(format!(
                    "big-endian GGUF (version {}) is not supported",
                    v.swap_bytes()
                )))
            }
            v => {
                return Err(gguf_err(format!(
                    "GGUF version {v} is not supported (only 2 and 3)"
                )))
            }
        }
        // Each tensor info takes at least 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 + 8.
        let n_tensors = c.count(32, "tensor count")?;
        let n_kv = c.count(8 + 4 + 1, "metadata count")?;

        let mut metadata = Vec::with_capacity(n_kv.min(MAX_PREALLOC));
        let mut key_index = HashMap::with_capacity(n_kv.min(MAX_PREALLOC));
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key {i}"))?;
            if key.is_empty() {
                return Err(gguf_err(format!("metadata key {i} is empty")));
            }
            let ty = c.value_type(&format!("metadata {key}"))?;
            let value = c.value(ty, 0, &format!("metadata {key}"))?;
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(gguf_err(format!("metadata key {key} appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match key_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                match v.as_integer() {
                    Some(a) if a > 0 && a <= u32::MAX as i128 && (a as u64).is_power_of_two() => {
                        a as u64
                    }
                    _ => {
                        return Err(gguf_err(format!(
                            "general.alignment must be a power of two that fits in u32, got {v:?}"
                        )))
                    }
                }
            }
        };

        let mut infos = Vec::with_capacity(n_tensors.min(MAX_PREALLOC));
        let mut tensor_index = HashMap::with_capacity(n_tensors.min(MAX_PREALLOC));
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor {i} name"))?;
            let n_dims = c.u32(&format!("tensor {name} n_dims"))? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(gguf_err(format!(
                    "tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims);
            // The product of the non-zero dims must fit too (so `n_rows` cannot overflow when
            // a zero dim makes the element count 0).
            let mut nonzero_product: u64 = 1;
            for _ in 0..n_dims {
                let d = c.u64(&format!("tensor {name} dims"))?;
                if d > i64::MAX as u64 {
                    return Err(gguf_err(format!(
                        "tensor {name}: dimension {d} is too large"
                    )));
                }
                nonzero_product = nonzero_product
                    .checked_mul(d.max(1))
                    .filter(|&n| n <= i64::MAX as u64)
                    .ok_or_else(|| {
                        gguf_err(format!(
                            "tensor {name}: element count overflows ({dims:?} x {d})"
                        ))
                    })?;
                dims.push(d);
            }
            let n_elements: u64 = if dims.contains(&0) {
                0
            } else {
                nonzero_product
            };
            let type_id = c.u32(&format!("tensor {name} type"))?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
                gguf_err(format!("tensor {name} has unknown ggml type id {type_id}"))
            })?;
            let offset = c.u64(&format!("tensor {name} offset"))?;
            if dims[0] % ggml_type.block_size() != 0 {
                return Err(gguf_err(format!(
                    "tensor {name}: row length {} is not a multiple of the {ggml_type} block size {}",
                    dims[0],
                    ggml_type.block_size()
                )));
            }
            let n_bytes = ggml_type
                .bytes_for(n_elements)
                .map_err(|e| gguf_err(format!("tensor {name}: {e}")))?;
            if offset % alignment != 0 {
                return Err(gguf_err(format!(
                    "tensor {name}: offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            if tensor_index.insert(name.clone(), infos.len()).is_some() {
                return Err(gguf_err(format!("tensor {name} appears twice")));
            }
            infos.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
                n_elements,
                n_bytes,
            });
        }

        let file_len = bytes.len() as u64;
        let data_offset = align_up(c.pos as u64, alignment)
            .ok_or_else(|| gguf_err("data section offset overflows"))?;
        if !infos.is_empty() && data_offset > file_len {
            return Err(gguf_err(format!(
                "truncated file: the data section starts at {data_offset}, past the end ({file_len})"
            )));
        }
        let data_len = file_len.saturating_sub(data_offset);
        for t in &infos {
            let end = t.offset.checked_add(t.n_bytes);
            if end.is_none_or(|end| end > data_len) {
                return Err(gguf_err(format!(
                    "tensor {} ({} bytes at data offset {}) runs past the end of the data section \
                     ({data_len} bytes): truncated or corrupt file",
                    t.name, t.n_bytes, t.offset
                )));
            }
        }

        Ok(Self {
            bytes,
            version,
            metadata,
            key_index,
            tensors: infos,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of the data section and tensor offsets (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| gguf_err(format!("metadata key {key} is missing")))
    }

    fn wrong_type(key: &str, want: &str, v: &Value) -> Error {
        let got = match v {
            Value::Array(a) => format!("array of {}", a.element_type()),
            v => v.value_type().to_string(),
        };
        gguf_err(format!("metadata {key}: expected {want}, found {got}"))
    }

    fn integer(key: &str, v: &Value, want: &str, min: i128, max: i128) -> Result<i128> {
        let n = v
            .as_integer()
            .ok_or_else(|| Self::wrong_type(key, want, v))?;
        if n < min || n > max {
            return Err(gguf_err(format!(
                "metadata {key} = {n} does not fit in {want}"
            )));
        }
        Ok(n)
    }

    /// A metadata integer as `u32`. Any integer type is accepted when the value fits (writers
    /// disagree on u32/i32/u64 for counts).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        Ok(Self::integer(key, self.require(key)?, "u32", 0, u32::MAX.into())? as u32)
    }

    /// [`GgufFile::get_u32`] for an optional key: `Ok(None)` when absent, an error when present
    /// with the wrong type.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>> {
        self.get(key)
            .map(|v| Self::integer(key, v, "u32", 0, u32::MAX.into()).map(|n| n as u32))
            .transpose()
    }

    /// A metadata integer as `u64` (any integer type that fits).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        Ok(Self::integer(key, self.require(key)?, "u64", 0, u64::MAX.into())? as u64)
    }

    /// A metadata integer as `i64` (any integer type that fits).
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        Ok(Self::integer(
            key,
            self.require(key)?,
            "i64",
            i64::MIN.into(),
            i64::MAX.into(),
        )? as i64)
    }

    /// A metadata float as `f32` (`f32`, or `f64` converted).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        let v = self.require(key)?;
        v.as_float()
            .map(|x| x as f32)
            .ok_or_else(|| Self::wrong_type(key, "f32", v))
    }

    /// [`GgufFile::get_f32`] for an optional key.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>> {
        self.get(key)
            .map(|v| {
                v.as_float()
                    .map(|x| x as f32)
                    .ok_or_else(|| Self::wrong_type(key, "f32", v))
            })
            .transpose()
    }

    /// A metadata bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(Self::wrong_type(key, "bool", v)),
        }
    }

    /// [`GgufFile::get_bool`] for an optional key.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::wrong_type(key, "bool", v)),
        }
    }

    /// A metadata string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong_type(key, "string", v))
    }

    /// [`GgufFile::get_str`] for an optional key.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| Self::wrong_type(key, "string", v)))
            .transpose()
    }

    /// A metadata array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        let v = self.require(key)?;
        v.as_array()
            .ok_or_else(|| Self::wrong_type(key, "array", v))
    }

    /// A metadata array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.get_array(key)? {
            Array::String(v) => Ok(v),
            _ => Err(Self::wrong_type(key, "array of string", self.require(key)?)),
        }
    }

    /// A metadata array of `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        match self.get_array(key)? {
            Array::I32(v) => Ok(v),
            _ => Err(Self::wrong_type(key, "array of i32", self.require(key)?)),
        }
    }

    /// A metadata array of `u32`.
    pub fn get_u32_array(&self, key: &str) -> Result<&[u32]> {
        match self.get_array(key)? {
            Array::U32(v) => Ok(v),
            _ => Err(Self::wrong_type(key, "array of u32", self.require(key)?)),
        }
    }

    /// A metadata array of `f32`.
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        match self.get_array(key)? {
            Array::F32(v) => Ok(v),
            _ => Err(Self::wrong_type(key, "array of f32", self.require(key)?)),
        }
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name)
            .ok_or_else(|| gguf_err(format!("tensor {name} is missing")))
    }

    /// The raw bytes of a tensor as stored (for uploading quantized weights as they are).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let t = self.require_tensor(name)?;
        // In range: checked at parse.
        let start = (self.data_offset + t.offset) as usize;
        Ok(&self.bytes[start..start + t.n_bytes as usize])
    }

    /// The whole tensor dequantized to f32, in storage order (`dims[0]` fastest).
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.require_tensor(name)?;
        let n = usize::try_from(t.n_elements)
            .map_err(|_| gguf_err(format!("tensor {name} is too large for this machine")))?;
        dequantize(t.ggml_type, self.tensor_data(name)?, n)
            .map_err(|e| gguf_err(format!("tensor {name}: {}", strip(e))))
    }

    /// Rows `rows` of a tensor dequantized to f32 (`rows.len() * row_len` values): for example
    /// one token's embedding from `token_embd.weight`.
    pub fn tensor_rows_f32(&self, name: &str, rows: Range<u64>) -> Result<Vec<f32>> {
        let t = self.require_tensor(name)?;
        if rows.start > rows.end || rows.end > t.n_rows() {
            return Err(gguf_err(format!(
                "tensor {name}: rows {rows:?} out of range (it has {} rows)",
                t.n_rows()
            )));
        }
        let data = self.tensor_data(name)?;
        let rb = t.row_bytes() as usize;
        let bytes = &data[rows.start as usize * rb..rows.end as usize * rb];
        let n = ((rows.end - rows.start) * t.row_len()) as usize;
        dequantize(t.ggml_type, bytes, n)
            .map_err(|e| gguf_err(format!("tensor {name}: {}", strip(e))))
    }
}

fn strip(e: Error) -> String {
    match e {
        Error::Gguf(m) => m,
        other => other.to_string(),
    }
}
