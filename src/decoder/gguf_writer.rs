//! GGUF writer: a version 3 file from metadata and tensors, laid out as [`super::gguf`]
//! reads it (header, metadata, tensor infos, padding to `general.alignment`, data). Used to
//! re-encode a model in other block formats (`examples/requantize.rs`) and by tests that write
//! their own models.
//!
//! ```
//! use kvattn::decoder::gguf::{GgmlType, GgufFile, Value};
//! use kvattn::decoder::gguf_writer::GgufWriter;
//! # fn main() -> kvattn::Result<()> {
//! let mut w = GgufWriter::new();
//! w.metadata("general.architecture", Value::String("llama".into()));
//! let norm: Vec<u8> = [1.0f32; 8].iter().flat_map(|v| v.to_le_bytes()).collect();
//! w.tensor("output_norm.weight", GgmlType::F32, &[8], norm)?;
//! let file = GgufFile::parse(w.to_bytes()?)?;
//! assert_eq!(file.tensor_f32("output_norm.weight")?, vec![1.0; 8]);
//! # Ok(()) }
//! ```

use std::io::Write;

use super::gguf::{Array, GgmlType, Value, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use crate::{Error, Result};

/// One tensor to write.
#[derive(Debug, Clone)]
struct Tensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

/// A GGUF file being assembled: metadata in insertion order (a key set twice keeps its first
/// place and its last value), tensors in insertion order.
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<Tensor>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to `value`.
    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.metadata.push((key.to_string(), value)),
        }
        self
    }

    /// Adds a tensor of type `ty` and dims `dims` (`ne0` first, as GGUF stores them) whose
    /// bytes, in the file's layout, are `data`.
    ///
    /// # Errors
    /// [`Error::Gguf`] when the name is already used, there are no dims or more than
    /// [`MAX_DIMS`], a dim is zero, the row length is not a whole number of `ty`'s blocks, or
    /// `data` is not the bytes `dims` of `ty` need.
    pub fn tensor(
        &mut self,
        name: &str,
        ty: GgmlType,
        dims: &[u64],
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let err = |msg: String| Err(Error::Gguf(format!("tensor {name}: {msg}")));
        if self.tensors.iter().any(|t| t.name == name) {
            return err("written twice".into());
        }
        if dims.is_empty() || dims.len() > MAX_DIMS || dims.contains(&0) {
            return err(format!("dims {dims:?} (1 to {MAX_DIMS}, none zero)"));
        }
        if dims[0] % ty.block_size() != 0 {
            return err(format!(
                "rows of {} values are not whole blocks of {ty} ({})",
                dims[0],
                ty.block_size()
            ));
        }
        let elements = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::Gguf(format!("tensor {name}: dims {dims:?} overflow")))?;
        let need = ty.bytes_for(elements)?;
        if data.len() as u64 != need {
            return err(format!(
                "{elements} values of {ty} need {need} bytes, got {}",
                data.len()
            ));
        }
        self.tensors.push(Tensor {
            name: name.to_string(),
            ty,
            dims: dims.to_vec(),
            data,
        });
        Ok(self)
    }

    /// The alignment the file declares (`general.alignment`, else 32).
    fn alignment(&self) -> Result<u64> {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, Value::U32(a))) if a.is_power_of_two() => Ok(u64::from(*a)),
            Some((_, v)) => Err(Error::Gguf(format!(
                "general.alignment must be a power of two u32, got {v:?}"
            ))),
        }
    }

    /// The whole file.
    ///
    /// # Errors
    /// [`Error::Gguf`] for a `general.alignment` that is not a power-of-two `u32`.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write_to(&mut out)?;
        Ok(out)
    }

    /// Writes the file to `path` (not on the web, which has no files: use
    /// [`GgufWriter::to_bytes`]).
    ///
    /// # Errors
    /// Those of [`GgufWriter::to_bytes`]; [`Error::Gguf`] naming the path when it cannot be
    /// written.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn write_file(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |e: std::io::Error| Error::Gguf(format!("{}: {e}", path.display()));
        let file = std::fs::File::create(path).map_err(io)?;
        let mut out = std::io::BufWriter::new(file);
        self.write_to(&mut out)?;
        out.flush().map_err(io)
    }

    fn write_to(&self, out: &mut impl Write) -> Result<()> {
        let align = self.alignment()?;
        let mut head = Vec::new();
        head.extend(GGUF_MAGIC);
        head.extend(3u32.to_le_bytes());
        head.extend((self.tensors.len() as u64).to_le_bytes());
        head.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut head, key);
            head.extend(value.value_type().tag().to_le_bytes());
            put_value(&mut head, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut head, &t.name);
            head.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend(d.to_le_bytes());
            }
            head.extend(t.ty.id().to_le_bytes());
            head.extend(offset.to_le_bytes());
            offset = (offset + t.data.len() as u64).next_multiple_of(align);
        }
        let pad = |len: u64| vec![0u8; (len.next_multiple_of(align) - len) as usize];
        head.extend(pad(head.len() as u64));
        let io = |e: std::io::Error| Error::Gguf(format!("writing a GGUF file: {e}"));
        out.write_all(&head).map_err(io)?;
        for t in &self.tensors {
            out.write_all(&t.data).map_err(io)?;
            out.write_all(&pad(t.data.len() as u64)).map_err(io)?;
        }
        Ok(())
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend(a.element_type().tag().to_le_bytes());
    out.extend((a.len() as u64).to_le_bytes());
    match a {
        Array::U8(v) => out.extend(v),
        Array::I8(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::U16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::I16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::U32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::I32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::U64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::I64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::F64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_str(out, s)),
        Array::Array(v) => v.iter().for_each(|inner| put_array(out, inner)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::gguf::GgufFile;

    #[test]
    fn every_value_type_and_tensors_read_back() {
        let values = [
            ("a.u8", Value::U8(7)),
            ("a.i8", Value::I8(-7)),
            ("a.u16", Value::U16(65000)),
            ("a.i16", Value::I16(-300)),
            ("a.u32", Value::U32(4_000_000_000)),
            ("a.i32", Value::I32(-5)),
            ("a.u64", Value::U64(1 << 40)),
            ("a.i64", Value::I64(-(1 << 40))),
            ("a.f32", Value::F32(1.5)),
            ("a.f64", Value::F64(-2.25)),
            ("a.bool", Value::Bool(true)),
            ("a.str", Value::String("héllo".into())),
            (
                "a.arr",
                Value::Array(Array::Array(vec![
                    Array::String(vec!["x".into(), String::new()]),
                    Array::I32(vec![1, -2]),
                ])),
            ),
            ("general.alignment", Value::U32(64)),
        ];
        let mut w = GgufWriter::new();
        for (k, v) in &values {
            w.metadata(k, v.clone());
        }
        let q8: Vec<u8> = (0..34u8).collect();
        let f: Vec<u8> = (0..12).flat_map(|i| (i as f32).to_le_bytes()).collect();
        w.tensor("t.q8", GgmlType::Q8_0, &[32, 1], q8.clone())
            .unwrap();
        w.tensor("t.f32", GgmlType::F32, &[4, 3], f.clone())
            .unwrap();
        let file = GgufFile::parse(w.to_bytes().unwrap()).unwrap();
        assert_eq!(file.version(), 3);
        assert_eq!(file.alignment(), 64);
        for (k, v) in &values {
            assert_eq!(file.get(k), Some(v), "{k}");
        }
        assert_eq!(file.tensor_data("t.q8").unwrap(), &q8[..]);
        assert_eq!(file.tensor_data("t.f32").unwrap(), &f[..]);
        assert_eq!(file.tensor("t.f32").unwrap().offset % 64, 0);
    }

    #[test]
    fn bad_tensors_and_alignment_are_refused() {
        let mut w = GgufWriter::new();
        w.tensor("a", GgmlType::F32, &[2], vec![0; 8]).unwrap();
        assert!(w.tensor("a", GgmlType::F32, &[2], vec![0; 8]).is_err());
        assert!(w.tensor("b", GgmlType::F32, &[2], vec![0; 4]).is_err());
        assert!(w.tensor("c", GgmlType::Q8_0, &[16], vec![0; 17]).is_err());
        assert!(w.tensor("d", GgmlType::F32, &[], vec![]).is_err());
        assert!(w.tensor("e", GgmlType::F32, &[1, 0], vec![]).is_err());
        w.metadata("general.alignment", Value::U32(24));
        assert!(w.to_bytes().is_err());
    }
}
