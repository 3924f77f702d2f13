//! The bounds-checked little-endian reader ([`Cursor`]) the parser reads the header, metadata
//! and tensor table with: counts are checked against the bytes left before anything is
//! allocated for them.

use super::{gguf_err, Array, Value, ValueType, MAX_ARRAY_DEPTH, MAX_PREALLOC};
use crate::Result;

/// Bounds-checked little-endian reader over the file bytes.
pub(super) struct Cursor<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(gguf_err(format!(
                "truncated file: {what} needs {n} bytes at offset {}, only {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub(super) fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub(super) fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub(super) fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items each taking at least `min_size` bytes: refused when they cannot fit in
    /// what is left of the file (so no allocation exceeds the file size).
    pub(super) fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = (self.remaining() / min_size.max(1)) as u64;
        if n > fits {
            return Err(gguf_err(format!(
                "{what} {n} at offset {at} is impossible: only {} bytes left in the file",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    pub(super) fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.count(1, &format!("{what} length"))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| gguf_err(format!("{what} at offset {at} is not valid UTF-8: {e}")))
    }

    pub(super) fn value_type(&mut self, what: &str) -> Result<ValueType> {
        let at = self.pos;
        let tag = self.u32(what)?;
        ValueType::from_tag(tag)
            .ok_or_else(|| gguf_err(format!("{what}: unknown value type {tag} at offset {at}")))
    }

    pub(super) fn value(&mut self, ty: ValueType, depth: usize, what: &str) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8(what)?),
            ValueType::I8 => Value::I8(self.u8(what)? as i8),
            ValueType::U16 => Value::U16(self.u16(what)?),
            ValueType::I16 => Value::I16(self.u16(what)? as i16),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(self.u32(what)? as i32),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(self.u64(what)? as i64),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32(what)?)),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64(what)?)),
            ValueType::Bool => Value::Bool(self.bool(what)?),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array_value(depth + 1, what)?),
        })
    }

    fn bool(&mut self, what: &str) -> Result<bool> {
        let at = self.pos;
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(gguf_err(format!(
                "{what}: bool byte {b} at offset {at} is not 0 or 1"
            ))),
        }
    }

    fn array_value(&mut self, depth: usize, what: &str) -> Result<Array> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(gguf_err(format!(
                "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
            )));
        }
        let ty = self.value_type(what)?;
        let n = self.count(ty.min_size(), &format!("{what} element count"))?;
        macro_rules! fixed {
            ($variant:ident, $read:expr) => {{
                let mut v = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    v.push($read);
                }
                Array::$variant(v)
            }};
        }
        Ok(match ty {
            ValueType::U8 => Array::U8(self.take(n, what)?.to_vec()),
            ValueType::I8 => Array::I8(self.take(n, what)?.iter().map(|&b| b as i8).collect()),
            ValueType::U16 => fixed!(U16, self.u16(what)?),
            ValueType::I16 => fixed!(I16, self.u16(what)? as i16),
            ValueType::U32 => fixed!(U32, self.u32(what)?),
            ValueType::I32 => fixed!(I32, self.u32(what)? as i32),
            ValueType::U64 => fixed!(U64, self.u64(what)?),
            ValueType::I64 => fixed!(I64, self.u64(what)? as i64),
            ValueType::F32 => fixed!(F32, f32::from_bits(self.u32(what)?)),
            ValueType::F64 => fixed!(F64, f64::from_bits(self.u64(what)?)),
            ValueType::Bool => fixed!(Bool, self.bool(what)?),
            ValueType::String => fixed!(String, self.string(what)?),
            ValueType::Array => fixed!(Array, self.array_value(depth + 1, what)?),
        })
    }
}

pub(super) fn align_up(x: u64, align: u64) -> Option<u64> {
    x.checked_add(align - 1).map(|v| v / align * align)
}
