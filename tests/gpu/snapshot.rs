//! Snapshot integrity: a checksum of the header fields and the payload in the header, so that no
//! flipped bit anywhere in the file imports silently, and old format versions are refused by name. (Round trips and layout
//! mismatches are in tests/gpu/paged.rs.)

use std::collections::HashMap;

use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::snapshot::{FORMAT_VERSION, KERNEL_REVISION};
use kvattn::quant::KvDtype;
use kvattn::Error;
use safetensors::SafeTensors;

use crate::common::{gpu, Rng};

const BLOCKS: usize = 24;

fn config(k: KvDtype, v: KvDtype) -> PagedKvConfig {
    PagedKvConfig {
        head_dim_v: 32,
        v_dtype: v,
        model_id: "snapshot-test".into(),
        ..PagedKvConfig::new(2, 2, 64, k)
    }
}

/// A cache holding sequence 1 with `len` random tokens, and its snapshot.
fn exported(cfg: &PagedKvConfig, len: usize, seed: u64) -> (PagedKvCache, Vec<u8>) {
    let ctx = gpu();
    let mut cache = PagedKvCache::new(ctx, cfg.clone(), PoolSize::Blocks(BLOCKS)).unwrap();
    let mut rng = Rng::new(seed);
    cache.add_sequence(1, &[]).unwrap();
    let tokens: Vec<u32> = (0..len).map(|_| rng.next_u64() as u32 % 5000).collect();
    let rows = |d: usize, rng: &mut Rng| -> Vec<Vec<f32>> {
        (0..cfg.layers)
            .map(|_| rng.normals(len * cfg.num_kv_heads * d, 1.0))
            .collect()
    };
    let k = rows(cfg.head_dim_k, &mut rng);
    let v = rows(cfg.head_dim_v, &mut rng);
    cache.append_host(ctx, 1, &tokens, &k, &v).unwrap();
    let bytes = cache.export_snapshot(ctx, 1).unwrap();
    (cache, bytes)
}

/// Imports `bytes` into `target` as sequence 7, which must be refused with a typed error and
/// leave `target` as it was.
fn assert_refused(target: &mut PagedKvCache, bytes: &[u8], what: &str) -> Error {
    let err = match target.import_snapshot(gpu(), 7, bytes) {
        Ok(()) => panic!("{what}: a corrupted snapshot was imported"),
        Err(e) => e,
    };
    assert!(!target.allocator().contains(7), "{what}: {err}");
    assert_eq!(target.allocator().num_free_blocks(), BLOCKS, "{what}");
    err
}

/// Where the JSON header ends (safetensors: 8-byte little-endian length, then the header).
fn header_end(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

#[test]
fn every_flipped_bit_is_refused() {
    for (cfg, len) in [
        (config(KvDtype::F16, KvDtype::F16), 37),
        (config(KvDtype::Int8, KvDtype::Fp8E4M3), 20),
    ] {
        let (_, bytes) = exported(&cfg, len, 11);
        let mut target = PagedKvCache::new(gpu(), cfg.clone(), PoolSize::Blocks(BLOCKS)).unwrap();
        // The intact snapshot imports, so every refusal below is the flip's doing.
        target.import_snapshot(gpu(), 9, &bytes).unwrap();
        target.free(9).unwrap();
        let end = header_end(&bytes);
        // Every byte of the length and the header, every 7th of the payload, and the last byte
        // of the file; the bit flipped cycles through the 8 positions.
        let positions: Vec<usize> = (0..end)
            .chain((end..bytes.len()).step_by(7))
            .chain([end, end + 1, bytes.len() - 1])
            .collect();
        let mut checksum_refusals = 0;
        for (n, &at) in positions.iter().enumerate() {
            let mut corrupt = bytes.clone();
            corrupt[at] ^= 1 << (n % 8);
            let what = format!(
                "{:?}/{:?}: bit {} of byte {at}",
                cfg.k_dtype,
                cfg.v_dtype,
                n % 8
            );
            let err = assert_refused(&mut target, &corrupt, &what);
            // A flip that breaks the safetensors framing is refused by safetensors (its error
            // kept as the source), any other by the snapshot checks.
            assert!(
                matches!(err, Error::Snapshot(_) | Error::Safetensors { .. }),
                "{what}: {err}"
            );
            if at >= end {
                // Inside the payload the header is intact: the checksum is what refuses it.
                assert!(err.to_string().contains("checksum"), "{what}: {err}");
                checksum_refusals += 1;
            }
        }
        assert!(checksum_refusals > 100, "{checksum_refusals}");
        // Nothing was left behind by any refusal: the intact file still imports.
        target.import_snapshot(gpu(), 7, &bytes).unwrap();
    }
}

/// `bytes` re-serialized with its header edited by `edit` (the tensors unchanged).
fn with_header(bytes: &[u8], edit: impl FnOnce(&mut HashMap<String, String>)) -> Vec<u8> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    let mut header = meta.metadata().clone().unwrap();
    edit(&mut header);
    safetensors::serialize(st.tensors(), Some(header)).unwrap()
}

#[test]
fn header_names_the_version_and_the_checksum() {
    let cfg = config(KvDtype::Bf16, KvDtype::F32);
    let (_, bytes) = exported(&cfg, 29, 3);
    let st = SafeTensors::read_metadata(&bytes).unwrap().1;
    let header = st.metadata().clone().unwrap();
    assert_eq!(header["format_version"], FORMAT_VERSION);
    assert_eq!(FORMAT_VERSION, "2");
    let crc = &header["crc32"];
    assert!(
        crc.len() == 8 && crc.chars().all(|c| c.is_ascii_hexdigit()),
        "{crc}"
    );
    let mut target = PagedKvCache::new(gpu(), cfg, PoolSize::Blocks(BLOCKS)).unwrap();

    // Re-serializing changes nothing the checksum covers (it does not depend on the layout
    // safetensors chose), so the copy imports.
    let same = with_header(&bytes, |_| {});
    target.import_snapshot(gpu(), 3, &same).unwrap();
    target.free(3).unwrap();

    // Version 1 (no checksum) is refused by name, as is any other version.
    let v1 = with_header(&bytes, |h| {
        h.insert("format_version".into(), "1".into());
        h.remove("crc32");
    });
    let err = assert_refused(&mut target, &v1, "version 1");
    assert!(
        matches!(&err, Error::Snapshot(m) if m.contains("version 1")),
        "{err}"
    );
    let v3 = with_header(&bytes, |h| {
        h.insert("format_version".into(), "3".into());
    });
    let err = assert_refused(&mut target, &v3, "version 3");
    assert!(
        matches!(&err, Error::Snapshot(m) if m.contains("\"3\"")),
        "{err}"
    );
    // A snapshot of the pool layout before 16-byte padding (revision kvattn-kv-2): refused by
    // the header check, which names the field, before the checksum is looked at.
    assert_eq!(KERNEL_REVISION, "kvattn-kv-3");
    let old = with_header(&bytes, |h| {
        h.insert("kernel_revision".into(), "kvattn-kv-2".into());
    });
    let err = assert_refused(&mut target, &old, "revision kvattn-kv-2");
    assert!(
        matches!(&err, Error::Snapshot(m) if m.contains("kernel_revision") && m.contains("kvattn-kv-2")),
        "{err}"
    );
    // No checksum, or a wrong one.
    let none = with_header(&bytes, |h| {
        h.remove("crc32");
    });
    let err = assert_refused(&mut target, &none, "no checksum");
    assert!(
        matches!(&err, Error::Snapshot(m) if m.contains("crc32")),
        "{err}"
    );
    let wrong = with_header(&bytes, |h| {
        let flipped = u32::from_str_radix(&h["crc32"], 16).unwrap() ^ 1;
        h.insert("crc32".into(), format!("{flipped:08x}"));
    });
    let err = assert_refused(&mut target, &wrong, "wrong checksum");
    assert!(
        matches!(&err, Error::Snapshot(m) if m.contains("checksum does not match")),
        "{err}"
    );
    // A tensor renamed consistently in the header: the checksum covers names too.
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let renamed: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let name = match name.as_str() {
                "k.0" => "k.1".to_string(),
                "k.1" => "k.0".to_string(),
                _ => name,
            };
            (name, t)
        })
        .collect();
    let header = SafeTensors::read_metadata(&bytes)
        .unwrap()
        .1
        .metadata()
        .clone();
    let swapped = safetensors::serialize(renamed, header).unwrap();
    let err = assert_refused(&mut target, &swapped, "layers swapped");
    assert!(
        matches!(&err, Error::Snapshot(m) if m.contains("checksum")),
        "{err}"
    );
    // An existing sequence id is refused before anything else, and kept.
    target.import_snapshot(gpu(), 3, &bytes).unwrap();
    let table = target.block_table(3).unwrap().to_vec();
    assert!(matches!(
        target.import_snapshot(gpu(), 3, &bytes),
        Err(Error::SequenceExists(3))
    ));
    assert_eq!(target.block_table(3).unwrap(), &table[..]);
}
