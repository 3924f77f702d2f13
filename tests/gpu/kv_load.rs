//! The WGSL decoders of every KV format against the CPU codec, bit for bit, on rows back to
//! back and gathered from the blocks of a paged cache.

use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::pool::BlockPool;
use kvattn::cache::scales::CacheScales;
use kvattn::quant::dequant::{
    dequantize, dequantize_gather, encode_dequantize, encode_dequantize_gather,
};
use kvattn::quant::{decode_rows, encode_rows, EncodedRows, KvDtype, ScaleMode};
use kvattn::Error;

use crate::common::{gpu, gpu_capped, Rng};

fn assert_bit_exact(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
        assert!(
            same,
            "{what}: element {i}: GPU {g:e} ({:#010x}) vs CPU {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn all_fp8_codes_decode_bit_exact() {
    let ctx = gpu();
    // 256 codes, four per word, as one row of 256 values; scales: 1, a power of two, and an
    // arbitrary per-tensor scale, plus per-row scales.
    let words: Vec<u32> = (0..64u32)
        .map(|w| (0..4).map(|b| (w * 4 + b) << (8 * b)).sum())
        .collect();
    for dtype in [KvDtype::Fp8E4M3, KvDtype::Fp8E5M2] {
        for scale in [1.0f32, 0.125, 0.3712] {
            let rows = EncodedRows {
                dtype,
                head_dim: 256,
                scale_mode: ScaleMode::PerTensor(scale),
                words: words.clone(),
                scales: Vec::new(),
            };
            let want = decode_rows(&rows).unwrap();
            assert_bit_exact(
                &format!("{dtype} x{scale}"),
                &dequantize(ctx, &rows).unwrap(),
                &want,
            );
        }
        let per_row = EncodedRows {
            dtype,
            head_dim: 32,
            scale_mode: ScaleMode::PerRow,
            words: words.clone(),
            scales: (0..8)
                .map(|r| (0.5f32 * (r as f32 + 1.0)).to_bits())
                .collect(),
        };
        let want = decode_rows(&per_row).unwrap();
        assert_bit_exact(
            &format!("{dtype} per row"),
            &dequantize(ctx, &per_row).unwrap(),
            &want,
        );
    }
}

#[test]
fn random_rows_of_every_format_decode_bit_exact() {
    let ctx = gpu();
    let mut rng = Rng::new(5);
    for dtype in KvDtype::ALL {
        for head_dim in [32usize, 64, 96, 128, 256] {
            let rows = 37;
            let mut x = rng.normals(rows * head_dim, 3.0);
            // Some large and some tiny values to reach saturation and subnormal codes.
            for i in (0..x.len()).step_by(17) {
                x[i] *= 1e3;
            }
            for i in (5..x.len()).step_by(23) {
                x[i] *= 1e-6;
            }
            let modes: &[ScaleMode] = if dtype.fp8_format().is_some() {
                &[ScaleMode::PerRow, ScaleMode::PerTensor(0.75)]
            } else {
                &[ScaleMode::PerRow]
            };
            for &mode in modes {
                let enc = encode_rows(dtype, head_dim, &x, mode).unwrap();
                let want = decode_rows(&enc).unwrap();
                let got = dequantize(ctx, &enc).unwrap();
                assert_bit_exact(&format!("{dtype} d{head_dim} {mode:?}"), &got, &want);
            }
        }
    }
}

/// The NaN rows of the gather output keep when nothing is written to them.
const SENTINEL: u32 = 0x7fc0_5a5a;

/// Per pool buffer, the (out row, pool row) pairs that gather `tokens` of `table` into out rows
/// `first_out ..` in the given order.
fn gather_pairs(
    pool: &BlockPool,
    table: &[u32],
    tokens: &[usize],
    first_out: u32,
) -> Vec<Vec<(u32, u32)>> {
    let layout = pool.layout();
    let mut per_buffer = vec![Vec::new(); pool.buffers().len()];
    for (j, &t) in tokens.iter().enumerate() {
        let (buffer, local) = pool.locate(table[t / layout.block_size]).unwrap();
        // One KV head: row = block * block_rows + head * block_size + slot.
        let row = local * layout.block_rows() + t % layout.block_size;
        per_buffer[buffer].push((first_out + j as u32, row as u32));
    }
    per_buffer
}

/// Rows of a sequence in a real paged cache (1 KV head, blocks in shuffled order, pools split
/// over several 64 KiB buffers for the wide rows), gathered in shuffled order into a NaN-filled
/// buffer: every listed row equals the CPU decode of the stored row bit for bit, the others stay
/// NaN.
#[test]
fn gather_from_a_paged_pool_decodes_bit_exact() {
    let ctx = gpu_capped();
    let mut rng = Rng::new(17);
    let formats = [
        (KvDtype::F16, CacheScales::PerRow),
        (KvDtype::Bf16, CacheScales::PerRow),
        (KvDtype::Fp8E4M3, CacheScales::PerRow),
        (KvDtype::Fp8E4M3, CacheScales::PerTensor(vec![0.37])),
        (KvDtype::Int8, CacheScales::PerRow),
        (KvDtype::Int4, CacheScales::PerRow),
    ];
    let len = 37usize;
    let mut split_seen = false;
    for (dtype, scales) in formats {
        for head_dim in [64usize, 512] {
            for block_size in [16usize, 1] {
                let what = format!("{dtype} {scales:?} d{head_dim} block {block_size}");
                let cfg = PagedKvConfig {
                    k_scales: scales.clone(),
                    v_scales: scales.clone(),
                    block_size,
                    prefix_caching: false,
                    ..PagedKvConfig::new(1, 1, head_dim, dtype)
                };
                let blocks = len.div_ceil(block_size) + 5;
                let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(blocks)).unwrap();
                cache.shuffle_free_blocks(rng.next_u64());
                cache.add_sequence(0, &[]).unwrap();
                let mut k = rng.normals(len * head_dim, 2.0);
                for i in (0..k.len()).step_by(13) {
                    k[i] *= 300.0;
                }
                let v = rng.normals(len * head_dim, 0.5);
                let tokens: Vec<u32> = (0..len as u32).collect();
                cache.append_host(ctx, 0, &tokens, &[k], &[v]).unwrap();
                let (k_rows, v_rows) = cache.read_rows(ctx, 0, 0).unwrap();
                let table = cache.block_table(0).unwrap().to_vec();
                let pools = cache.layer(0).unwrap();
                split_seen |= pools.k.buffers().len() > 1;
                // Tokens in shuffled order, into out rows 2 .. len + 2 of len + 3.
                let mut order: Vec<usize> = (0..len).collect();
                for i in (1..len).rev() {
                    order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
                }
                for (name, pool, stored) in [("K", &pools.k, &k_rows), ("V", &pools.v, &v_rows)] {
                    let want = decode_rows(stored).unwrap();
                    let out_rows = len + 3;
                    let out = ctx
                        .filled("gather out", out_rows * head_dim, f32::from_bits(SENTINEL))
                        .unwrap();
                    for (b, pairs) in gather_pairs(pool, &table, &order, 2).iter().enumerate() {
                        if !pairs.is_empty() {
                            dequantize_gather(ctx, &pool.buffers()[b], pool.layout(), pairs, &out)
                                .unwrap_or_else(|e| panic!("{what} {name}: {e}"));
                        }
                    }
                    let got: Vec<f32> = ctx.read_back(&out, out_rows * head_dim).unwrap();
                    for r in 0..out_rows {
                        let row = &got[r * head_dim..(r + 1) * head_dim];
                        if r < 2 || r >= len + 2 {
                            assert!(
                                row.iter().all(|x| x.to_bits() == SENTINEL),
                                "{what} {name}: out row {r} is not listed but was written"
                            );
                        } else {
                            let t = order[r - 2];
                            assert_bit_exact(
                                &format!("{what} {name}: token {t} in out row {r}"),
                                row,
                                &want[t * head_dim..(t + 1) * head_dim],
                            );
                        }
                    }
                }
            }
        }
    }
    assert!(split_seen, "no pool spanned several buffers");
}

#[test]
fn gather_refuses_bad_input() {
    let ctx = gpu();
    let cfg = PagedKvConfig::new(1, 1, 64, KvDtype::Int8);
    let cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(4)).unwrap();
    let pool = &cache.layer(0).unwrap().k;
    let layout = pool.layout();
    let buffer = &pool.buffers()[0];
    let out = ctx.filled("out", 8 * 64, f32::from_bits(SENTINEL)).unwrap();
    let rows = 4 * layout.block_rows() as u32;
    let bad = [
        ("no pairs", vec![]),
        ("pool row past the buffer", vec![(0, rows)]),
        ("out row past out", vec![(8, 0)]),
        ("out row twice", vec![(1, 0), (1, 3)]),
    ];
    for (what, pairs) in bad {
        match dequantize_gather(ctx, buffer, layout, &pairs, &out) {
            Err(Error::InvalidArgument(_)) | Err(Error::ShapeMismatch { .. }) => {}
            other => panic!("{what}: expected a typed error, got {other:?}"),
        }
    }
    let mut wide = *layout;
    wide.head_dim = 66;
    assert!(dequantize_gather(ctx, buffer, &wide, &[(0, 0)], &out).is_err());
    let got: Vec<u32> = ctx.read_back(&out, 8 * 64).unwrap();
    assert!(got.iter().all(|&x| x == SENTINEL), "an error wrote to out");
    // The last row of the pool and of out are in range.
    dequantize_gather(ctx, buffer, layout, &[(7, rows - 1)], &out).unwrap();
}

/// The encode forms record into one caller's pass: gathers from every pool buffer and a
/// dequantize of host rows, one submission, the wrappers' bits. A bad gather among good ones is
/// refused before anything is recorded: nothing submitted, the output untouched.
#[test]
fn encode_forms_record_into_one_pass_with_the_wrappers_bits() {
    let ctx = kvattn::gpu::Context::with_options(&kvattn::gpu::ContextOptions {
        max_storage_binding_cap: Some(64 << 10),
        ..Default::default()
    })
    .unwrap();
    let ctx = &ctx;
    let mut rng = Rng::new(23);
    let (len, head_dim) = (40usize, 512usize);
    let cfg = PagedKvConfig {
        block_size: 4,
        prefix_caching: false,
        ..PagedKvConfig::new(1, 1, head_dim, KvDtype::Int8)
    };
    let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(96)).unwrap();
    cache.shuffle_free_blocks(3);
    cache.add_sequence(0, &[]).unwrap();
    let k = rng.normals(len * head_dim, 2.0);
    let v = rng.normals(len * head_dim, 1.0);
    let tokens: Vec<u32> = (0..len as u32).collect();
    cache.append_host(ctx, 0, &tokens, &[k], &[v]).unwrap();
    let (k_rows, _) = cache.read_rows(ctx, 0, 0).unwrap();
    let table = cache.block_table(0).unwrap().to_vec();
    let pool = &cache.layer(0).unwrap().k;
    assert!(pool.buffers().len() > 1, "the pool splits");
    let order: Vec<usize> = (0..len).rev().collect();
    let per_buffer = gather_pairs(pool, &table, &order, 1);
    let n = (len + 1) * head_dim;
    let sentinel = f32::from_bits(SENTINEL);
    let (by_wrapper, by_encode) = (
        ctx.filled("wrapper out", n, sentinel).unwrap(),
        ctx.filled("encode out", n, sentinel).unwrap(),
    );
    for (b, pairs) in per_buffer.iter().enumerate() {
        if !pairs.is_empty() {
            dequantize_gather(ctx, &pool.buffers()[b], pool.layout(), pairs, &by_wrapper).unwrap();
        }
    }
    let host = dequantize(ctx, &k_rows).unwrap();
    let dense = ctx.filled("dense out", len * head_dim, sentinel).unwrap();
    let before = ctx.counters();
    ctx.run_pass("gathers", |pass| {
        for (b, pairs) in per_buffer.iter().enumerate() {
            if !pairs.is_empty() {
                encode_dequantize_gather(
                    ctx,
                    pass,
                    &pool.buffers()[b],
                    pool.layout(),
                    pairs,
                    &by_encode,
                )?;
            }
        }
        encode_dequantize(ctx, pass, &k_rows, &dense)
    })
    .unwrap();
    assert_eq!(ctx.counters().since(&before).submissions, 1);
    let got: Vec<f32> = ctx.read_back(&by_encode, n).unwrap();
    let want: Vec<f32> = ctx.read_back(&by_wrapper, n).unwrap();
    assert_bit_exact("encoded gathers", &got, &want);
    assert_eq!(got[0].to_bits(), SENTINEL, "row 0 is not listed");
    let dense: Vec<f32> = ctx.read_back(&dense, len * head_dim).unwrap();
    assert_bit_exact("encoded dequantize", &dense, &host);

    // A good gather, then one listing an out row twice: refused, nothing submitted.
    let fresh = ctx.filled("fresh out", n, sentinel).unwrap();
    let before = ctx.counters();
    let e = ctx
        .run_pass("bad gathers", |pass| {
            let (b, pairs) = per_buffer
                .iter()
                .enumerate()
                .find(|(_, p)| !p.is_empty())
                .unwrap();
            let buffer = &pool.buffers()[b];
            encode_dequantize_gather(ctx, pass, buffer, pool.layout(), pairs, &fresh)?;
            encode_dequantize_gather(ctx, pass, buffer, pool.layout(), &[(0, 0), (0, 1)], &fresh)
        })
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert_eq!(ctx.counters().since(&before).submissions, 0);
    let got: Vec<f32> = ctx.read_back(&fresh, n).unwrap();
    assert!(got.iter().all(|x| x.to_bits() == SENTINEL), "written");
    // An output without STORAGE usage is refused by encode_dequantize.
    let staging = ctx
        .create_buffer(&wgpu::BufferDescriptor {
            label: Some("no storage"),
            size: (len * head_dim * 4) as u64,
            usage: wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
        .unwrap();
    let e = ctx
        .run_pass("bad dequantize", |pass| {
            encode_dequantize(ctx, pass, &k_rows, &staging)
        })
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
}
