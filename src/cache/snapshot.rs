//! Versioned snapshots of one sequence's KV as safetensors.
//!
//! Tensors, in token order (so a snapshot does not depend on which physical blocks held it, nor
//! on the block size): `tokens` U32 `[len]`, and per layer `l`: `k.{l}` U32 `[len, Hkv, k words
//! per row]`, `v.{l}` U32 `[len, Hkv, v words per row]` (the stored words, bit for bit, packed as
//! ARCHITECTURE.md section 6 says), and for formats with per-row scales `k_scales.{l}` /
//! `v_scales.{l}` U32 `[len, Hkv, scale words per row]`. The metadata header records everything
//! needed to refuse a mismatch: [`FORMAT_VERSION`], `k_dtype`, `v_dtype`, `k_scales`/`v_scales`
//! ("per-row", or "per-tensor:" and each layer's scale bits: codes mean nothing under another
//! scale), `block_size`, `layers`, `kv_heads`, `head_dim_k`, `head_dim_v`, `model_id`,
//! `kernel_revision`, `tokens`, and `crc32`: a CRC-32 (IEEE), as 8 lowercase hex digits, of every
//! other header field (in key order, each as key, a zero byte, value, a zero byte) and then of
//! every tensor (in name order, each as its name, a zero byte, its shape as little-endian u64s and
//! its data bytes). It does not depend on how safetensors lays the file out.
//!
//! Import checks the version, then every field against the cache (the block size alone may
//! differ: rows are re-laid into the importing cache's blocks, which changes no byte of any
//! row), then the checksum: a snapshot with any bit flipped, in the payload or in a header field
//! not otherwise checked, is refused as corrupt, never imported as different KV. It never
//! reinterprets bytes of another layout. Version 1 snapshots, which had no checksum, are refused:
//! export them again from a cache that holds them.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use super::allocator::SeqId;
use super::paged::PagedKvCache;
use crate::gpu::Context;
use crate::{Error, Result};

/// Version of the snapshot format written here, and the only one read: version 2 added the
/// `crc32` header field.
pub const FORMAT_VERSION: &str = "2";

/// The header key holding the checksum.
const CHECKSUM_KEY: &str = "crc32";

/// CRC-32 of the header fields `meta` but [`CHECKSUM_KEY`], in key order, then of the tensors
/// `(name, shape, data)`, in name order.
fn checksum<'a>(
    meta: &HashMap<String, String>,
    tensors: impl IntoIterator<Item = (&'a str, &'a [usize], &'a [u8])>,
) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    let mut fields: Vec<_> = meta.iter().filter(|(k, _)| *k != CHECKSUM_KEY).collect();
    fields.sort_unstable();
    for (key, value) in fields {
        for part in [key, value] {
            hasher.update(part.as_bytes());
            hasher.update(&[0]);
        }
    }
    let mut tensors: Vec<_> = tensors.into_iter().collect();
    tensors.sort_unstable_by_key(|&(name, _, _)| name);
    for (name, shape, data) in tensors {
        hasher.update(name.as_bytes());
        hasher.update(&[0]);
        for &d in shape {
            hasher.update(&(d as u64).to_le_bytes());
        }
        hasher.update(data);
    }
    hasher.finalize()
}

/// Revision of the pool byte layout (row packing, block layout). Bumped whenever stored bytes
/// would mean something else; snapshots of another revision are refused. `kvattn-kv-3`: pool
/// blocks and rows padded to 16-byte boundaries (ARCHITECTURE.md section 6); `kvattn-kv-2`
/// snapshots are refused.
pub const KERNEL_REVISION: &str = "kvattn-kv-3";

fn header(cache: &PagedKvCache, tokens: usize) -> HashMap<String, String> {
    let c = cache.config();
    [
        ("format_version", FORMAT_VERSION.to_string()),
        ("k_dtype", c.k_dtype.name().to_string()),
        ("v_dtype", c.v_dtype.name().to_string()),
        ("k_scales", c.k_scales.describe()),
        ("v_scales", c.v_scales.describe()),
        ("block_size", c.block_size.to_string()),
        ("layers", c.layers.to_string()),
        ("kv_heads", c.num_kv_heads.to_string()),
        ("head_dim_k", c.head_dim_k.to_string()),
        ("head_dim_v", c.head_dim_v.to_string()),
        ("model_id", c.model_id.clone()),
        ("kernel_revision", KERNEL_REVISION.to_string()),
        ("tokens", tokens.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn bytes_of(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn words_of(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A safetensors error while doing `what` with a snapshot.
fn st_err(what: &str) -> impl FnOnce(safetensors::SafeTensorError) -> Error + '_ {
    move |source| Error::Safetensors {
        what: format!("snapshot: {what}"),
        source,
    }
}

impl PagedKvCache {
    /// Exports `seq` (its tokens and every layer's K/V) as safetensors bytes.
    pub fn export_snapshot(&self, ctx: &Context, seq: SeqId) -> Result<Vec<u8>> {
        let tokens = self.allocator().tokens(seq)?.to_vec();
        let len = tokens.len();
        let c = self.config().clone();
        let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> =
            vec![("tokens".into(), vec![len], bytes_of(&tokens))];
        for layer in 0..c.layers {
            let (k, v) = self.read_rows(ctx, seq, layer)?;
            for (name, rows, layout) in [("k", k, c.k_layout()), ("v", v, c.v_layout())] {
                owned.push((
                    format!("{name}.{layer}"),
                    vec![len, c.num_kv_heads, layout.words_per_row()],
                    bytes_of(&rows.words),
                ));
                if layout.scale_words_per_row() > 0 {
                    owned.push((
                        format!("{name}_scales.{layer}"),
                        vec![len, c.num_kv_heads, layout.scale_words_per_row()],
                        bytes_of(&rows.scales),
                    ));
                }
            }
        }
        let views = owned
            .iter()
            .map(|(name, shape, data)| {
                Ok((
                    name.clone(),
                    TensorView::new(Dtype::U32, shape.clone(), data)
                        .map_err(st_err("exporting a tensor"))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut meta = header(self, len);
        let crc = checksum(
            &meta,
            owned
                .iter()
                .map(|(name, shape, data)| (name.as_str(), shape.as_slice(), data.as_slice())),
        );
        meta.insert(CHECKSUM_KEY.into(), format!("{crc:08x}"));
        safetensors::serialize(views, Some(meta)).map_err(st_err("serializing"))
    }

    /// Imports a snapshot as a new sequence `seq`. Refuses with [`Error::Safetensors`] bytes
    /// that are not safetensors, and with [`Error::Snapshot`] a file that is not a snapshot, one
    /// of another format version, one whose contents do not match its checksum (corrupt), any
    /// header that differs from this cache's own (block size excepted), and any tensor of the
    /// wrong dtype or shape; [`Error::SequenceExists`] when `seq` is taken
    /// and [`Error::OutOfBlocks`] when the cache lacks room. On any error the cache is unchanged.
    pub fn import_snapshot(&mut self, ctx: &Context, seq: SeqId, bytes: &[u8]) -> Result<()> {
        if self.allocator().contains(seq) {
            return Err(Error::SequenceExists(seq));
        }
        let st = SafeTensors::deserialize(bytes).map_err(st_err("not safetensors"))?;
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(st_err("not safetensors"))?;
        let found = meta
            .metadata()
            .clone()
            .ok_or_else(|| Error::Snapshot("no metadata header: not a kvattn snapshot".into()))?;
        match found.get("format_version").map(String::as_str) {
            Some(FORMAT_VERSION) => {}
            Some("1") => {
                return Err(Error::Snapshot(format!(
                    "format version 1 (no checksum) is no longer read; export the \
                     sequence again to get version {FORMAT_VERSION}"
                )))
            }
            Some(other) => {
                return Err(Error::Snapshot(format!(
                    "format version {other:?} is not supported (this build reads version \
                     {FORMAT_VERSION})"
                )))
            }
            None => {
                return Err(Error::Snapshot(
                    "header lacks format_version: not a kvattn snapshot".into(),
                ))
            }
        }
        let len: usize = found
            .get("tokens")
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| Error::Snapshot("header lacks a token count".into()))?;
        for (key, want) in header(self, len) {
            if key == "block_size" {
                continue;
            }
            match found.get(&key) {
                Some(got) if *got == want => {}
                Some(got) => {
                    return Err(Error::Snapshot(format!(
                        "{key} is {got:?} in the snapshot but {want:?} in this cache"
                    )))
                }
                None => return Err(Error::Snapshot(format!("header lacks {key}"))),
            }
        }
        let want_crc = found
            .get(CHECKSUM_KEY)
            .ok_or_else(|| Error::Snapshot(format!("header lacks {CHECKSUM_KEY}")))?;
        let views: Vec<_> = st.iter().collect();
        let got_crc = checksum(
            &found,
            views.iter().map(|(name, t)| (*name, t.shape(), t.data())),
        );
        if *want_crc != format!("{got_crc:08x}") {
            return Err(Error::Snapshot(format!(
                "checksum does not match: the header says {want_crc:?}, the contents hash to \
                 \"{got_crc:08x}\"; the snapshot is corrupt"
            )));
        }
        let c = self.config().clone();
        let tensor = |name: &str, shape: Vec<usize>| -> Result<Vec<u32>> {
            let t = st
                .tensor(name)
                .map_err(|_| Error::Snapshot(format!("tensor {name} is missing")))?;
            if t.dtype() != Dtype::U32 || t.shape() != shape.as_slice() {
                return Err(Error::Snapshot(format!(
                    "tensor {name} is {:?} {:?}, expected U32 {shape:?}",
                    t.dtype(),
                    t.shape()
                )));
            }
            Ok(words_of(t.data()))
        };
        let tokens = tensor("tokens", vec![len])?;
        let rows_of = |name: &str, l: usize, layout: crate::cache::pool::PoolLayout| {
            let words = tensor(
                &format!("{name}.{l}"),
                vec![len, c.num_kv_heads, layout.words_per_row()],
            )?;
            let spr = layout.scale_words_per_row();
            let scales = if spr > 0 {
                tensor(
                    &format!("{name}_scales.{l}"),
                    vec![len, c.num_kv_heads, spr],
                )?
            } else {
                Vec::new()
            };
            Ok((words, scales))
        };
        let rows = (0..c.layers)
            .map(|l| {
                Ok((
                    rows_of("k", l, c.k_layout())?,
                    rows_of("v", l, c.v_layout())?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let inserted = self.insert_rows(ctx, seq, &tokens, &rows);
        if inserted.is_err() && self.allocator().contains(seq) {
            // A GPU write failed after the blocks were taken: give them back.
            self.free(seq)?;
        }
        inserted
    }
}
