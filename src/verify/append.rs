//! The `append_kv` cases: the paged cache's append (quantizing on write, pools split over several
//! bindings) against the CPU encoder's value and scale words, bit for bit.

use crate::cache::append_kv::SourceDtype;
use crate::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig, PoolSize};
use crate::cache::scales::CacheScales;
use crate::gpu::{Context, ContextOptions};
use crate::quant::pack::pack_halves;
use crate::quant::{decode_rows, encode_rows, per_tensor_scale, EncodedRows, KvDtype, ScaleMode};
use crate::Result;

use super::clock::Stopwatch;
use super::metrics::{exact_outcome, Outcome, Rng};
use super::oracle::to_f16;
use super::report::Status;
use super::verifier::Verifier;

/// Binding cap of the append checks' context (pools span several buffers).
const APPEND_BINDING_CAP: u64 = 64 << 10;
/// KV heads of the append checks.
pub(crate) const APPEND_KV_HEADS: usize = 2;

impl Verifier<'_> {
    /// Appends three sequences in two interleaved rounds into a cache whose pools span several
    /// buffers, free blocks shuffled, and compares the stored value and scale words with the CPU
    /// encoder's. The data holds edge rows (see [`edge_rows`]); per-tensor FP8 scales are
    /// calibrated on the first sequence only, so later values saturate.
    pub(crate) async fn append_kv(&mut self, case: AppendCase, seed: u64) -> Result<Outcome> {
        let AppendCase {
            dtype,
            d,
            block_size,
            src,
            per_tensor,
        } = case;
        // The GPU side: the capped context (first use), the cache, the appends; then the
        // read-backs below.
        let gpu = Stopwatch::start();
        if self.capped.is_none() {
            self.capped = Some(
                Context::new_async(&ContextOptions {
                    max_storage_binding_cap: Some(APPEND_BINDING_CAP),
                    ..Default::default()
                })
                .await?,
            );
        }
        let ctx = self.capped.as_ref().expect("created above");
        let hkv = APPEND_KV_HEADS;
        let lens = [5usize, 17, 40];
        let row = hkv * d;
        let mut rng = Rng::new(seed);
        let mut data: Vec<(Vec<f32>, Vec<f32>)> = lens
            .iter()
            .map(|&n| (rng.normals(n * row, 1.5), rng.normals(n * row, 1.5)))
            .collect();
        if dtype.is_quantized() {
            let (k, v) = &mut data[2];
            edge_rows(dtype, d, k, &mut rng);
            edge_rows(dtype, d, &mut v[row..], &mut rng);
        }
        if src == SourceDtype::F16 {
            for (k, v) in &mut data {
                *k = to_f16(k);
                *v = to_f16(v);
            }
        }
        let mode = |x: &[f32]| -> Result<ScaleMode> {
            Ok(if per_tensor {
                ScaleMode::PerTensor(per_tensor_scale(dtype, x, 1.0)?)
            } else {
                ScaleMode::PerRow
            })
        };
        let (k_mode, v_mode) = (mode(&data[0].0)?, mode(&data[0].1)?);
        let scales = |m: ScaleMode| match m {
            ScaleMode::PerTensor(s) => CacheScales::PerTensor(vec![s]),
            ScaleMode::PerRow => CacheScales::PerRow,
        };
        let config = PagedKvConfig {
            block_size,
            prefix_caching: false,
            k_scales: scales(k_mode),
            v_scales: scales(v_mode),
            ..PagedKvConfig::new(1, hkv, d, dtype)
        };
        // At least twice the blocks needed, and enough for three or more buffers.
        let needed: usize = lens.iter().map(|n| n.div_ceil(block_size)).sum();
        let per_buffer = (APPEND_BINDING_CAP / config.k_layout().block_bytes()).max(1) as usize;
        let blocks = (2 * needed + 2).max(2 * per_buffer + 1);
        let mut cache = PagedKvCache::new(ctx, config, PoolSize::Blocks(blocks))?;
        cache.shuffle_free_blocks(seed);
        let buffers = cache.layer(0)?.k.buffers().len();
        for s in 0..lens.len() {
            cache.add_sequence(s as u64, &[])?;
        }
        // Two rounds: the first 2/3 of every sequence, then the rest.
        let split: Vec<usize> = lens.iter().map(|&n| (2 * n).div_ceil(3)).collect();
        for round in 0..2 {
            let ranges: Vec<std::ops::Range<usize>> = lens
                .iter()
                .zip(&split)
                .map(|(&n, &m)| if round == 0 { 0..m } else { m..n })
                .collect();
            match src {
                SourceDtype::F32 => {
                    for (s, r) in ranges.iter().enumerate() {
                        let (k, v) = &data[s];
                        let tokens: Vec<u32> = r.clone().map(|t| t as u32).collect();
                        cache.append_host(
                            ctx,
                            s as u64,
                            &tokens,
                            &[k[r.start * row..r.end * row].to_vec()],
                            &[v[r.start * row..r.end * row].to_vec()],
                        )?;
                    }
                }
                SourceDtype::F16 => {
                    let mut batch = AppendBatch::new();
                    let (mut kh, mut vh) = (Vec::new(), Vec::new());
                    for (s, r) in ranges.iter().enumerate() {
                        let (k, v) = &data[s];
                        let tokens: Vec<u32> = r.clone().map(|t| t as u32).collect();
                        cache.append_tokens(ctx, &mut batch, s as u64, &tokens)?;
                        let bits = |x: &[f32]| {
                            x.iter()
                                .map(|&v| half::f16::from_f32(v).to_bits())
                                .collect::<Vec<u16>>()
                        };
                        kh.extend(bits(&k[r.start * row..r.end * row]));
                        vh.extend(bits(&v[r.start * row..r.end * row]));
                    }
                    let kb = ctx.upload("verify k", &pack_halves(&kh))?;
                    let vb = ctx.upload("verify v", &pack_halves(&vh))?;
                    cache.write_layer(ctx, 0, &batch, &kb, &vb, SourceDtype::F16)?;
                }
            }
        }
        self.phases.gpu += gpu.seconds();
        let reference = Stopwatch::start();
        let mut read_seconds = 0.0;
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let (mut mismatched, mut scale_mismatched) = (0usize, 0usize);
        let differ = |a: &[u32], b: &[u32]| {
            a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
        };
        for (s, (k, v)) in data.iter().enumerate() {
            let read = Stopwatch::start();
            let (gk, gv) = cache.read_rows_async(ctx, s as u64, 0).await?;
            read_seconds += read.seconds();
            let ek = encode_rows(dtype, d, k, k_mode)?;
            let ev = encode_rows(dtype, d, v, v_mode)?;
            for (g, e) in [(gk, ek), (gv, ev)] {
                mismatched += differ(&g.words, &e.words);
                scale_mismatched += differ(&g.scales, &e.scales);
                if g.scale_mode != e.scale_mode {
                    scale_mismatched += 1;
                }
                want.extend(decode_rows(&e)?);
                // Decoded with the CPU's scales where the GPU's are malformed.
                let g = EncodedRows {
                    words: g.words,
                    scales: if g.scales.len() == e.scales.len() {
                        g.scales
                    } else {
                        e.scales.clone()
                    },
                    ..e
                };
                got.extend(decode_rows(&g)?);
            }
        }
        let mut outcome = exact_outcome(&got, &want);
        self.phases.gpu += read_seconds;
        self.phases.reference += (reference.seconds() - read_seconds).max(0.0);
        if mismatched + scale_mismatched > 0 {
            outcome.status = Status::Fail;
            outcome.note = Some(format!(
                "{mismatched} stored value words and {scale_mismatched} scale words differ from \
                 the CPU encoder's"
            ));
        }
        if buffers < 3 {
            outcome
                .note
                .get_or_insert_with(|| format!("K pool in only {buffers} buffer(s)"));
        }
        Ok(outcome)
    }
}

/// One append check.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AppendCase {
    pub(crate) dtype: KvDtype,
    pub(crate) d: usize,
    pub(crate) block_size: usize,
    pub(crate) src: SourceDtype,
    pub(crate) per_tensor: bool,
}

/// Overwrites the first token rows of `x` (rows of `d` values, at least 4 rows) with the edge
/// cases of a quantized `dtype`: a zero row; a row whose largest magnitude is the format's
/// largest value (scale 1) holding exact ties between adjacent codes (rounded to even), subnormal
/// FP8 values and their ties; a row of tiny values; a row with one huge outlier, so that the
/// others fall into the subnormal range.
fn edge_rows(dtype: KvDtype, d: usize, x: &mut [f32], rng: &mut Rng) {
    let rows: Vec<&mut [f32]> = x.chunks_mut(d).take(4).collect();
    let [zero, ties, tiny, outlier] = <[&mut [f32]; 4]>::try_from(rows).expect("4 rows");
    zero.fill(0.0);
    // Ties: the midpoint of two adjacent representable values, for a range of exponents.
    let (max, mantissa_bits, min_exp) = match dtype.fp8_format() {
        Some(f) => (
            f.max_value(),
            if dtype == KvDtype::Fp8E4M3 { 3 } else { 2 },
            if dtype == KvDtype::Fp8E4M3 { -9 } else { -16 },
        ),
        None => (127.0, 0, 0),
    };
    for (i, t) in ties.iter_mut().enumerate() {
        let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
        *t = sign
            * if dtype.fp8_format().is_some() {
                // (1 + (2m + 1) / 2^(mb + 1)) * 2^e, e from the subnormal range up, and
                // (2m + 1) * 2^(min_exp - 1) (ties between subnormals).
                let m = (i / 2) % (1 << mantissa_bits);
                let e = min_exp + (i / 7) as i32 % (12 - min_exp);
                if i % 5 == 4 {
                    (2 * m + 1) as f32 * 2f32.powi(min_exp - 1)
                } else {
                    (1.0 + (2 * m + 1) as f32 / (2 << mantissa_bits) as f32) * 2f32.powi(e)
                }
            } else {
                (i % 120) as f32 + 0.5
            };
    }
    ties[0] = max;
    ties[1] = -max;
    for t in tiny.iter_mut() {
        *t = rng.normals(1, 1e-3)[0];
    }
    outlier[d / 2] = 3e3;
}
