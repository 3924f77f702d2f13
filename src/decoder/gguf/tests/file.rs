//! Tests of the parser and the parsed file: every metadata type, versions and magic,
//! dequantization, memory-mapped files, truncated, corrupt and absurd files.

use half::{bf16, f16};

use super::Writer;
use crate::decoder::gguf::file::FileBytes;
use crate::decoder::gguf::{dequantize, Array, GgmlType, GgufFile, Value};
use crate::Error;

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

/// Every metadata type, scalar and array, including a nested array.
fn all_types_file() -> Vec<u8> {
    let mut w = Writer::new();
    w.raw("t.u8", 0, &[200])
        .raw("t.i8", 1, &[0xFE])
        .raw("t.u16", 2, &60000u16.to_le_bytes())
        .raw("t.i16", 3, &(-30000i16).to_le_bytes())
        .u32("t.u32", 4_000_000_000)
        .raw("t.i32", 5, &(-7i32).to_le_bytes())
        .f32("t.f32", 1.5)
        .bool("t.bool", true)
        .str("t.str", "héllo")
        .raw("t.u64", 10, &u64::MAX.to_le_bytes())
        .raw("t.i64", 11, &(-5i64).to_le_bytes())
        .raw("t.f64", 12, &0.25f64.to_le_bytes())
        .str_array("t.strs", &["a", "", "ü"])
        .i32_array("t.i32s", &[1, -2, 3]);
    // u8 array, f32 array, bool array, nested [[1u16, 2u16], []].
    let mut p = 0u32.to_le_bytes().to_vec();
    p.extend_from_slice(&3u64.to_le_bytes());
    p.extend_from_slice(&[1, 2, 3]);
    w.raw("t.u8s", 9, &p);
    let mut p = 6u32.to_le_bytes().to_vec();
    p.extend_from_slice(&2u64.to_le_bytes());
    p.extend_from_slice(&0.5f32.to_le_bytes());
    p.extend_from_slice(&(-1f32).to_le_bytes());
    w.raw("t.f32s", 9, &p);
    let mut p = 7u32.to_le_bytes().to_vec();
    p.extend_from_slice(&2u64.to_le_bytes());
    p.extend_from_slice(&[0, 1]);
    w.raw("t.bools", 9, &p);
    let mut p = 9u32.to_le_bytes().to_vec();
    p.extend_from_slice(&2u64.to_le_bytes());
    p.extend_from_slice(&2u32.to_le_bytes());
    p.extend_from_slice(&2u64.to_le_bytes());
    p.extend_from_slice(&1u16.to_le_bytes());
    p.extend_from_slice(&2u16.to_le_bytes());
    p.extend_from_slice(&4u32.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    w.raw("t.nested", 9, &p);
    w.tensor(
        "v",
        &[2],
        GgmlType::F32,
        [1.0f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
    );
    w.build()
}

#[test]
fn every_metadata_type() {
    let f = GgufFile::parse(all_types_file()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.metadata().len(), 18);
    assert_eq!(f.get("t.u8"), Some(&Value::U8(200)));
    assert_eq!(f.get("t.i8"), Some(&Value::I8(-2)));
    assert_eq!(f.get("t.u16"), Some(&Value::U16(60000)));
    assert_eq!(f.get("t.i16"), Some(&Value::I16(-30000)));
    assert_eq!(f.get_u32("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get_i64("t.i32").unwrap(), -7);
    assert_eq!(f.get_f32("t.f32").unwrap(), 1.5);
    assert!(f.get_bool("t.bool").unwrap());
    assert_eq!(f.get_str("t.str").unwrap(), "héllo");
    assert_eq!(f.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(f.get_i64("t.i64").unwrap(), -5);
    assert_eq!(f.get_f32("t.f64").unwrap(), 0.25);
    assert_eq!(f.get_str_array("t.strs").unwrap(), ["a", "", "ü"]);
    assert_eq!(f.get_i32_array("t.i32s").unwrap(), [1, -2, 3]);
    assert_eq!(f.get_array("t.u8s").unwrap(), &Array::U8(vec![1, 2, 3]));
    assert_eq!(f.get_f32_array("t.f32s").unwrap(), [0.5, -1.0]);
    assert_eq!(
        f.get_array("t.bools").unwrap(),
        &Array::Bool(vec![false, true])
    );
    assert_eq!(
        f.get_array("t.nested").unwrap(),
        &Array::Array(vec![Array::U16(vec![1, 2]), Array::U32(vec![])])
    );
    // u8 and u16 widen to u32; u64::MAX does not fit; negative does not fit.
    assert_eq!(f.get_u32("t.u8").unwrap(), 200);
    assert!(matches!(f.get_u32("t.u64"), Err(Error::Gguf(m)) if m.contains("does not fit")));
    assert!(matches!(f.get_u32("t.i32"), Err(Error::Gguf(_))));
    // Wrong types and missing keys are typed errors naming the key.
    assert!(
        matches!(f.get_str("t.u32"), Err(Error::Gguf(m)) if m.contains("t.u32") && m.contains("expected string"))
    );
    assert!(
        matches!(f.get_i32_array("t.strs"), Err(Error::Gguf(m)) if m.contains("array of string"))
    );
    assert!(
        matches!(f.get_f32("nope"), Err(Error::Gguf(m)) if m.contains("nope") && m.contains("missing"))
    );
    assert_eq!(f.get_u32_opt("nope").unwrap(), None);
    assert!(f.get_u32_opt("t.str").is_err());
    assert_eq!(f.tensor_f32("v").unwrap(), [1.0, -2.0]);
    assert!(f.tensor("w").is_none());
    assert!(f.tensor_f32("w").is_err());
}

#[test]
fn version_2_and_magic() {
    let mut bytes = all_types_file();
    bytes[4] = 2;
    assert_eq!(GgufFile::parse(bytes.clone()).unwrap().version(), 2);
    bytes[4] = 1;
    assert!(
        matches!(GgufFile::parse(bytes.clone()), Err(Error::Gguf(m)) if m.contains("version 1"))
    );
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(
        matches!(GgufFile::parse(bytes.clone()), Err(Error::Gguf(m)) if m.contains("big-endian"))
    );
    bytes[0] = b'X';
    assert!(matches!(GgufFile::parse(bytes), Err(Error::Gguf(m)) if m.contains("not a GGUF")));
}

/// Q8_0, Q4_0 and Q4_1 blocks written by hand from known codes, F16 and BF16 values that
/// are exact in 16 bits.
#[test]
fn dequantize_every_type_exactly() {
    let mut w = Writer::new();
    w.alignment = 64;
    w.u32("general.alignment", 64);
    // F16 / BF16: 3 values exact in both formats.
    let vals = [1.0f32, -0.5, 96.0];
    w.tensor(
        "f16",
        &[3],
        GgmlType::F16,
        vals.iter().flat_map(|&x| h(x)).collect(),
    );
    w.tensor(
        "bf16",
        &[3],
        GgmlType::BF16,
        vals.iter()
            .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
    );
    // Q8_0: two blocks (one row of 64), d = 0.5 and d = -2; q = j - 16 and -128..=127 ends.
    let mut q8 = Vec::new();
    let mut q8_want = Vec::new();
    for (d, base) in [(0.5f32, -16i32), (-2.0, -128)] {
        q8.extend_from_slice(&h(d));
        for j in 0..32 {
            let q = if base == -128 && j == 31 {
                127
            } else {
                base + j
            };
            q8.push(q as i8 as u8);
            q8_want.push(q as f32 * d);
        }
    }
    w.tensor("q8_0", &[64], GgmlType::Q8_0, q8);
    // Q4_0: one block, d = 0.25; element j has code j % 16 (low nibbles 0..15 at bytes 0..15),
    // element 16 + j has code 15 - j (high nibbles).
    let mut q40 = h(0.25).to_vec();
    let mut q40_want = vec![0f32; 32];
    for j in 0..16u8 {
        let (lo, hi) = (j, 15 - j);
        q40.push(lo | hi << 4);
        q40_want[j as usize] = (lo as f32 - 8.0) * 0.25;
        q40_want[16 + j as usize] = (hi as f32 - 8.0) * 0.25;
    }
    w.tensor("q4_0", &[32], GgmlType::Q4_0, q40);
    // Q4_1: two rows of one block: d = 0.5, m = -3 and d = 1, m = 0.125.
    let mut q41 = Vec::new();
    let mut q41_want = Vec::new();
    for (d, m) in [(0.5f32, -3.0f32), (1.0, 0.125)] {
        q41.extend_from_slice(&h(d));
        q41.extend_from_slice(&h(m));
        let mut row = vec![0f32; 32];
        for j in 0..16u8 {
            let (lo, hi) = ((j * 7) % 16, (j * 3 + 1) % 16);
            q41.push(lo | hi << 4);
            row[j as usize] = lo as f32 * d + m;
            row[16 + j as usize] = hi as f32 * d + m;
        }
        q41_want.extend(row);
    }
    w.tensor("q4_1", &[32, 2], GgmlType::Q4_1, q41);
    let f = GgufFile::parse(w.build()).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor_f32("f16").unwrap(), vals);
    assert_eq!(f.tensor_f32("bf16").unwrap(), vals);
    assert_eq!(f.tensor_f32("q8_0").unwrap(), q8_want);
    assert_eq!(f.tensor_f32("q4_0").unwrap(), q40_want);
    assert_eq!(q40_want[0], -2.0);
    assert_eq!(q40_want[16], 1.75);
    assert_eq!(f.tensor_f32("q4_1").unwrap(), q41_want);
    assert_eq!(f.tensor_rows_f32("q4_1", 1..2).unwrap(), q41_want[32..]);
    assert!(f.tensor_rows_f32("q4_1", 1..3).is_err());
    let t = f.tensor("q4_1").unwrap();
    assert_eq!(
        (t.row_len(), t.n_rows(), t.row_bytes(), t.n_bytes),
        (32, 2, 20, 40)
    );
    assert_eq!(f.tensor_data("q4_1").unwrap().len(), 40);
}

#[test]
fn unsupported_type_is_named() {
    let mut w = Writer::new();
    w.tensor("k", &[256], GgmlType::Q2_K, vec![0; 84]);
    let f = GgufFile::parse(w.build()).unwrap();
    assert_eq!(f.tensor("k").unwrap().ggml_type, GgmlType::Q2_K);
    let e = f.tensor_f32("k").unwrap_err().to_string();
    assert!(e.contains("Q2_K") && e.contains("not supported"), "{e}");
    // An id ggml does not define.
    let mut w = Writer::new();
    w.tensors.push(("x".into(), vec![4], 4, vec![0; 16]));
    let e = GgufFile::parse(w.build()).unwrap_err().to_string();
    assert!(e.contains("unknown ggml type id 4"), "{e}");
}

/// A file on disk is mapped, and reads as the same bytes parsed from memory; a file cut
/// short on disk (or empty) is refused with an error naming the path.
#[test]
fn an_opened_file_is_mapped_and_checked_like_a_parsed_one() {
    let dir = std::env::temp_dir().join(format!("kvattn-gguf-map-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = all_types_file();
    let path = dir.join("all.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let mapped = GgufFile::open(&path).unwrap();
    assert!(matches!(mapped.bytes, FileBytes::Mapped(_)));
    let parsed = GgufFile::parse(bytes.clone()).unwrap();
    assert_eq!(mapped.file_len(), bytes.len() as u64);
    assert_eq!(mapped.tensors(), parsed.tensors());
    for t in parsed.tensors() {
        assert_eq!(
            mapped.tensor_data(&t.name).unwrap(),
            parsed.tensor_data(&t.name).unwrap()
        );
    }
    // A clone shares the mapping.
    let clone = mapped.clone();
    drop(mapped);
    assert_eq!(clone.metadata(), parsed.metadata());
    for (name, len) in [("cut.gguf", bytes.len() - 1), ("empty.gguf", 0)] {
        let cut = dir.join(name);
        std::fs::write(&cut, &bytes[..len]).unwrap();
        let e = GgufFile::open(&cut).unwrap_err().to_string();
        assert!(e.contains(&cut.display().to_string()), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncation_at_every_byte_is_an_error() {
    let bytes = all_types_file();
    for n in 0..bytes.len() {
        let r = GgufFile::parse(bytes[..n].to_vec());
        assert!(matches!(r, Err(Error::Gguf(_))), "truncated at {n}: {r:?}");
    }
    // Every single corrupted byte: an Err or a file, never a panic.
    for i in 0..bytes.len() {
        for v in [0x00, 0xFF, 0x80, 0x07] {
            let mut b = bytes.clone();
            b[i] = v;
            let _ = GgufFile::parse(b).map(|f| {
                for t in f.tensors().to_vec() {
                    let _ = f.tensor_f32(&t.name);
                }
            });
        }
    }
}

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

#[test]
fn absurd_counts_and_sizes_are_refused() {
    let err = |b: Vec<u8>| GgufFile::parse(b).unwrap_err().to_string();
    // Counts larger than the file.
    assert!(err(header(u64::MAX, 0)).contains("tensor count"));
    assert!(err(header(0, 1 << 40)).contains("metadata count"));
    // A string length larger than the file.
    let mut b = header(0, 1);
    b.extend_from_slice(&(1u64 << 50).to_le_bytes());
    b.extend_from_slice(&[b'k'; 16]);
    assert!(err(b).contains("length"));
    // An array count larger than the file, and a too-deep nesting.
    let mut w = Writer::new();
    let mut p = 4u32.to_le_bytes().to_vec();
    p.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
    w.raw("a", 9, &p);
    assert!(err(w.build()).contains("element count"));
    let mut w = Writer::new();
    let mut p = Vec::new();
    for _ in 0..40 {
        p.extend_from_slice(&9u32.to_le_bytes());
        p.extend_from_slice(&1u64.to_le_bytes());
    }
    w.raw("deep", 9, &p);
    assert!(err(w.build()).contains("nested"));
    // Unknown value type; bad bool.
    assert!(err(Writer::new().raw("x", 13, &[0; 8]).build()).contains("unknown value type 13"));
    assert!(err(Writer::new().raw("x", 7, &[2]).build()).contains("bool"));
    // Duplicate key; invalid UTF-8.
    assert!(err(Writer::new().u32("k", 1).u32("k", 2).build()).contains("twice"));
    assert!(err(Writer::new()
        .raw("k", 8, &[1, 0, 0, 0, 0, 0, 0, 0, 0xFF])
        .build())
    .contains("UTF-8"));
    // Bad alignment.
    assert!(err(Writer::new().u32("general.alignment", 24).build()).contains("alignment"));
    assert!(err(Writer::new().u32("general.alignment", 0).build()).contains("alignment"));
    // Dims overflow, too many dims, zero dims, row not a multiple of the block.
    let t = |dims: &[u64], ty: GgmlType| {
        let mut w = Writer::new();
        w.tensor("t", dims, ty, vec![0; 64]);
        err(w.build())
    };
    assert!(t(&[1 << 32, 1 << 32], GgmlType::F32).contains("overflow"));
    assert!(t(&[u64::MAX], GgmlType::F32).contains("too large"));
    assert!(t(&[1, 1, 1, 1, 1], GgmlType::F32).contains("dimensions"));
    assert!(t(&[], GgmlType::F32).contains("dimensions"));
    assert!(t(&[16, 2], GgmlType::Q8_0).contains("multiple of the Q8_0 block size"));
    // Data past the end, duplicate tensor names, misaligned offset.
    assert!(t(&[32], GgmlType::F32).contains("past the end"));
    let mut w = Writer::new();
    w.tensor("t", &[1], GgmlType::F32, vec![0; 4])
        .tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    assert!(err(w.build()).contains("twice"));
    let mut b = {
        let mut w = Writer::new();
        w.tensor("t", &[1], GgmlType::F32, vec![0; 4]);
        w.build()
    };
    // The offset field is the 8 bytes before the data section padding: find and patch it.
    let pos = 24 + 8 + 1 + 4 + 8 + 4;
    b[pos..pos + 8].copy_from_slice(&4u64.to_le_bytes());
    assert!(err(b).contains("not a multiple of the alignment"));
    // Dequantize with a wrong byte count.
    assert!(dequantize(GgmlType::Q8_0, &[0; 33], 32).is_err());
    assert!(dequantize(GgmlType::Q8_0, &[0; 34], 31).is_err());
}
