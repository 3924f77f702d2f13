//! Tests of the GGUF reader, and the minimal GGUF writer they build their files with (also used
//! by the tokenizer's tests).

use super::reader::align_up;
use super::{GgmlType, DEFAULT_ALIGNMENT};

mod file;
mod hyper;

/// A minimal GGUF writer for tests.
#[derive(Default)]
pub(crate) struct Writer {
    pub version: u32,
    pub alignment: u64,
    pub kv: Vec<u8>,
    pub n_kv: u64,
    pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

pub(crate) fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

impl Writer {
    pub fn new() -> Self {
        Self {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            ..Default::default()
        }
    }

    /// A key with an already encoded value (type tag + payload).
    pub fn raw(&mut self, key: &str, tag: u32, payload: &[u8]) -> &mut Self {
        put_str(&mut self.kv, key);
        self.kv.extend_from_slice(&tag.to_le_bytes());
        self.kv.extend_from_slice(payload);
        self.n_kv += 1;
        self
    }
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.raw(key, 4, &v.to_le_bytes())
    }
    pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.raw(key, 6, &v.to_le_bytes())
    }
    pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.raw(key, 7, &[v as u8])
    }
    pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
        let mut p = Vec::new();
        put_str(&mut p, v);
        self.raw(key, 8, &p)
    }
    pub fn str_array(&mut self, key: &str, v: &[&str]) -> &mut Self {
        let mut p = 8u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for s in v {
            put_str(&mut p, s);
        }
        self.raw(key, 9, &p)
    }
    pub fn i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
        let mut p = 5u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            p.extend_from_slice(&x.to_le_bytes());
        }
        self.raw(key, 9, &p)
    }
    pub fn f32_array(&mut self, key: &str, v: &[f32]) -> &mut Self {
        let mut p = 6u32.to_le_bytes().to_vec();
        p.extend_from_slice(&(v.len() as u64).to_le_bytes());
        for x in v {
            p.extend_from_slice(&x.to_le_bytes());
        }
        self.raw(key, 9, &p)
    }
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty.id(), data));
        self
    }

    pub fn build(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&self.n_kv.to_le_bytes());
        b.extend_from_slice(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = align_up(offset + data.len() as u64, self.alignment).unwrap();
        }
        while b.len() as u64 % self.alignment != 0 {
            b.push(0);
        }
        let start = b.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            b.resize(start + off as usize, 0);
            b.extend_from_slice(data);
        }
        b
    }
}
