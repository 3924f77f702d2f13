//! The paged cache on the GPU: appends in random interleavings, forks with copy-on-write, reads
//! back through the block tables, swap, snapshots, pools split over several bindings.

use std::collections::BTreeMap;

use kvattn::cache::append_kv::{append_kv, SourceDtype};
use kvattn::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::pool::{BlockPool, PoolLayout};
use kvattn::cache::scales::CacheScales;
use kvattn::quant::{encode_rows, KvDtype};
use kvattn::Error;

use crate::common::{gpu_capped, own_context, Rng};

/// What the host believes a sequence holds: tokens and, per layer, its K and V rows (f32).
#[derive(Clone, Default)]
struct Model {
    tokens: Vec<u32>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

fn config(dtype: KvDtype, block_size: usize) -> PagedKvConfig {
    PagedKvConfig {
        head_dim_v: 32,
        block_size,
        model_id: "test-model".into(),
        ..PagedKvConfig::new(2, 2, 64, dtype)
    }
}

/// `config` with K and V in quantized formats: K FP8 E4M3 with a per-tensor scale per layer,
/// V `v` with per-row scales.
fn quantized_config(v: KvDtype, block_size: usize) -> PagedKvConfig {
    PagedKvConfig {
        k_dtype: KvDtype::Fp8E4M3,
        k_scales: CacheScales::PerTensor(vec![0.0125, 0.75]),
        v_dtype: v,
        ..config(KvDtype::F16, block_size)
    }
}

/// Every test's pools span three or more bindings, so the split path always runs.
fn new_cache(cfg: PagedKvConfig, blocks: usize) -> PagedKvCache {
    let cache = PagedKvCache::new(gpu_capped(), cfg, PoolSize::Blocks(blocks)).unwrap();
    let pools = cache.layer(0).unwrap();
    for (name, pool) in [("K", &pools.k), ("V", &pools.v)] {
        assert!(
            pool.buffers().len() >= 3,
            "{name} pool in {} buffers",
            pool.buffers().len()
        );
    }
    cache
}

fn check_all(cache: &PagedKvCache, models: &BTreeMap<u64, Model>) {
    let ctx = gpu_capped();
    let c = cache.config();
    for (&seq, m) in models {
        assert_eq!(
            cache.allocator().tokens(seq).unwrap(),
            &m.tokens[..],
            "seq {seq} tokens"
        );
        for layer in 0..c.layers {
            // Values and scale words, with each layer's own scale mode.
            let (k, v) = cache.read_rows(ctx, seq, layer).unwrap();
            let want = |dtype, d, mode, x: &[f32]| encode_rows(dtype, d, x, mode).unwrap();
            let kw = want(c.k_dtype, c.head_dim_k, c.k_scales.mode(layer), &m.k[layer]);
            let vw = want(c.v_dtype, c.head_dim_v, c.v_scales.mode(layer), &m.v[layer]);
            assert_eq!(k, kw, "seq {seq} layer {layer} K");
            assert_eq!(v, vw, "seq {seq} layer {layer} V");
        }
    }
    cache.allocator().check_invariants().unwrap();
}

fn append(
    cache: &mut PagedKvCache,
    rng: &mut Rng,
    models: &mut BTreeMap<u64, Model>,
    seq: u64,
    n: usize,
) -> Result<(), Error> {
    let c = cache.config().clone();
    let tokens: Vec<u32> = (0..n).map(|_| (rng.next_u64() % 5) as u32).collect();
    let k: Vec<Vec<f32>> = (0..c.layers)
        .map(|_| rng.normals(n * c.num_kv_heads * c.head_dim_k, 1.0))
        .collect();
    let v: Vec<Vec<f32>> = (0..c.layers)
        .map(|_| rng.normals(n * c.num_kv_heads * c.head_dim_v, 1.0))
        .collect();
    cache.append_host(gpu_capped(), seq, &tokens, &k, &v)?;
    let m = models.get_mut(&seq).unwrap();
    m.tokens.extend(&tokens);
    for l in 0..c.layers {
        m.k[l].extend(&k[l]);
        m.v[l].extend(&v[l]);
    }
    Ok(())
}

#[test]
fn random_appends_and_forks_read_back_through_block_tables() {
    for (cfg, block_size) in [
        (config(KvDtype::F32, 16), 16),
        (config(KvDtype::F16, 4), 4),
        (config(KvDtype::Bf16, 1), 1),
        (config(KvDtype::F16, 256), 256),
        (quantized_config(KvDtype::Int4, 8), 8),
        (quantized_config(KvDtype::Int8, 1), 1),
        (quantized_config(KvDtype::Fp8E5M2, 16), 16),
    ] {
        let cfg = PagedKvConfig {
            prefix_caching: false,
            ..cfg
        };
        let blocks = 4096 / block_size + 8;
        let mut cache = new_cache(cfg, blocks);
        let mut rng = Rng::new(block_size as u64);
        let mut models: BTreeMap<u64, Model> = BTreeMap::new();
        let mut next = 0u64;
        let empty = empty_model();
        for step in 0..60 {
            let roll = rng.next_u64() % 10;
            if models.is_empty() || roll == 0 {
                cache.add_sequence(next, &[]).unwrap();
                models.insert(next, empty.clone());
                next += 1;
            } else if roll == 1 {
                let parent = *models
                    .keys()
                    .nth((rng.next_u64() as usize) % models.len())
                    .unwrap();
                cache.fork(parent, next).unwrap();
                let copy = models[&parent].clone();
                models.insert(next, copy);
                next += 1;
            } else if roll == 2 && models.len() > 2 {
                let seq = *models.keys().next().unwrap();
                cache.free(seq).unwrap();
                models.remove(&seq);
            } else {
                let seq = *models
                    .keys()
                    .nth((rng.next_u64() as usize) % models.len())
                    .unwrap();
                let n = 1 + (rng.next_u64() % 37) as usize;
                append(&mut cache, &mut rng, &mut models, seq, n).unwrap();
            }
            if step % 20 == 19 {
                check_all(&cache, &models);
            }
        }
        // Fork, then append to both branches: the shared partial block is copied once.
        let parent = *models.keys().last().unwrap();
        append(&mut cache, &mut rng, &mut models, parent, 3).unwrap();
        let partial = models[&parent].tokens.len() % block_size != 0;
        cache.fork(parent, next).unwrap();
        models.insert(next, models[&parent].clone());
        let before = cache.telemetry().cow_copies;
        append(&mut cache, &mut rng, &mut models, parent, 2).unwrap();
        append(&mut cache, &mut rng, &mut models, next, 5).unwrap();
        // The first branch to append copies the shared partial block (earlier random forks may
        // share it too, so the second branch may copy as well).
        assert!(cache.telemetry().cow_copies - before >= u64::from(partial) as _);
        check_all(&cache, &models);
    }
}

#[test]
fn fork_copy_on_write_keeps_both_branches() {
    let mut cache = new_cache(config(KvDtype::F16, 8), 160);
    let mut rng = Rng::new(11);
    let mut models = BTreeMap::new();
    cache.add_sequence(1, &[]).unwrap();
    models.insert(1, empty_model());
    append(&mut cache, &mut rng, &mut models, 1, 13).unwrap(); // one full block, one partial
    cache.fork(1, 2).unwrap();
    models.insert(2, models[&1].clone());
    assert_eq!(cache.block_table(1).unwrap(), cache.block_table(2).unwrap());
    append(&mut cache, &mut rng, &mut models, 1, 1).unwrap();
    append(&mut cache, &mut rng, &mut models, 2, 6).unwrap();
    let (t1, t2) = (
        cache.block_table(1).unwrap().to_vec(),
        cache.block_table(2).unwrap().to_vec(),
    );
    assert_eq!(t1[0], t2[0], "the full block stays shared");
    assert_ne!(t1[1], t2[1], "the partial block was copied on write");
    assert!(cache.telemetry().cow_copies >= 1);
    check_all(&cache, &models);
}

/// Every word of every pool of the cache, for "no byte written" checks.
fn all_pool_words(cache: &PagedKvCache) -> Vec<Vec<u32>> {
    crate::common::pool_words(gpu_capped(), cache)
}

fn empty_model() -> Model {
    Model {
        tokens: vec![],
        k: vec![vec![]; 2],
        v: vec![vec![]; 2],
    }
}

#[test]
fn failed_append_changes_nothing() {
    let ctx = gpu_capped();
    let mut cache = new_cache(config(KvDtype::F32, 16), 48);
    let mut rng = Rng::new(3);
    let mut models = BTreeMap::new();
    // A filler takes 44 of the 48 blocks.
    for (seq, n) in [(8u64, 44 * 16), (7, 40)] {
        cache.add_sequence(seq, &[]).unwrap();
        models.insert(seq, empty_model());
        append(&mut cache, &mut rng, &mut models, seq, n).unwrap();
    }
    let table = cache.block_table(7).unwrap().to_vec();
    let free = cache.allocator().num_free_blocks();
    let telemetry = cache.telemetry();
    let words = all_pool_words(&cache);
    // 40 more tokens need 2 more blocks; 1 is free.
    let err = append(&mut cache, &mut rng, &mut models, 7, 40).unwrap_err();
    assert!(matches!(err, Error::OutOfBlocks { .. }), "{err}");
    assert_eq!(cache.block_table(7).unwrap(), &table[..]);
    assert_eq!(cache.allocator().num_free_blocks(), free);
    assert_eq!(
        cache.telemetry().failed_admissions,
        telemetry.failed_admissions + 1
    );
    assert_eq!(cache.telemetry().logical_tokens, telemetry.logical_tokens);
    assert_eq!(
        all_pool_words(&cache),
        words,
        "a failed append wrote to a pool"
    );
    // A shape error is caught before any allocation.
    let bad = cache.append_host(
        ctx,
        7,
        &[1],
        &[vec![0.0; 3], vec![0.0; 3]],
        &[vec![0.0; 3], vec![0.0; 3]],
    );
    assert!(matches!(bad, Err(Error::ShapeMismatch { .. })));
    assert_eq!(cache.allocator().num_free_blocks(), free);
    assert_eq!(all_pool_words(&cache), words);
    check_all(&cache, &models);
}

#[test]
fn swap_out_and_in_is_bit_identical() {
    for cfg in [config(KvDtype::Bf16, 4), quantized_config(KvDtype::Int4, 4)] {
        swap_round_trip(cfg);
    }
}

fn swap_round_trip(cfg: PagedKvConfig) {
    let ctx = gpu_capped();
    let mut cache = new_cache(cfg, 300);
    let mut rng = Rng::new(21);
    let mut models = BTreeMap::new();
    for seq in [1u64, 2] {
        cache.add_sequence(seq, &[]).unwrap();
        models.insert(seq, empty_model());
        append(&mut cache, &mut rng, &mut models, seq, 23).unwrap();
    }
    let before: Vec<_> = (0..2)
        .map(|l| cache.read_rows(ctx, 1, l).unwrap())
        .collect();
    let old_table = cache.block_table(1).unwrap().to_vec();
    let swapped = cache.swap_out(ctx, 1).unwrap();
    assert!(
        cache.block_table(1).is_err(),
        "a swapped-out sequence holds no blocks"
    );
    // Another sequence takes the freed blocks, so the swap-in lands elsewhere.
    cache.add_sequence(3, &[]).unwrap();
    models.insert(3, empty_model());
    append(&mut cache, &mut rng, &mut models, 3, 23).unwrap();
    cache.swap_in(ctx, 1, &swapped).unwrap();
    assert_ne!(cache.block_table(1).unwrap(), &old_table[..]);
    let after: Vec<_> = (0..2)
        .map(|l| cache.read_rows(ctx, 1, l).unwrap())
        .collect();
    assert_eq!(before, after);
    assert_eq!(cache.telemetry().swaps_out, 1);
    assert_eq!(cache.telemetry().swaps_in, 1);
    check_all(&cache, &models);
}

#[test]
fn quantized_snapshots_carry_scales_and_refuse_other_scales() {
    let ctx = gpu_capped();
    let cfg = quantized_config(KvDtype::Int8, 16);
    let mut cache = new_cache(cfg.clone(), 96);
    let mut rng = Rng::new(81);
    let mut models = BTreeMap::new();
    cache.add_sequence(1, &[]).unwrap();
    models.insert(1, empty_model());
    append(&mut cache, &mut rng, &mut models, 1, 29).unwrap();
    let bytes = cache.export_snapshot(ctx, 1).unwrap();
    // Another block size: values and per-row scales are re-laid bit for bit.
    let mut other = new_cache(quantized_config(KvDtype::Int8, 4), 400);
    other.import_snapshot(ctx, 4, &bytes).unwrap();
    let mut expect = BTreeMap::new();
    expect.insert(4u64, models[&1].clone());
    check_all(&other, &expect);
    // Codes mean nothing under another per-tensor scale, or per-row scales.
    for k_scales in [
        CacheScales::PerTensor(vec![0.0125, 0.5]),
        CacheScales::PerRow,
    ] {
        let cfg = PagedKvConfig {
            k_scales,
            ..cfg.clone()
        };
        let mut target = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(96)).unwrap();
        let err = target.import_snapshot(ctx, 5, &bytes).unwrap_err();
        assert!(matches!(err, Error::Snapshot(_)), "{err}");
        assert!(target.block_table(5).is_err());
    }
}

#[test]
fn snapshots_round_trip_and_refuse_mismatches() {
    let ctx = gpu_capped();
    let mut cache = new_cache(config(KvDtype::F16, 16), 96);
    let mut rng = Rng::new(8);
    let mut models = BTreeMap::new();
    cache.add_sequence(1, &[]).unwrap();
    models.insert(1, empty_model());
    append(&mut cache, &mut rng, &mut models, 1, 37).unwrap();
    let bytes = cache.export_snapshot(ctx, 1).unwrap();

    // Same layout, another block size: rows are re-laid, bit for bit.
    let mut other = new_cache(config(KvDtype::F16, 4), 400);
    other.import_snapshot(ctx, 9, &bytes).unwrap();
    let mut expect = BTreeMap::new();
    expect.insert(9u64, models[&1].clone());
    check_all(&other, &expect);

    // Any mismatch is refused, and nothing is created.
    let mismatches = [
        PagedKvConfig {
            model_id: "another-model".into(),
            ..config(KvDtype::F16, 16)
        },
        config(KvDtype::Bf16, 16),
        PagedKvConfig {
            head_dim_v: 64,
            ..config(KvDtype::F16, 16)
        },
        PagedKvConfig {
            layers: 3,
            ..config(KvDtype::F16, 16)
        },
    ];
    for cfg in mismatches {
        let mut target = PagedKvCache::new(ctx, cfg.clone(), PoolSize::Blocks(96)).unwrap();
        let err = target.import_snapshot(ctx, 5, &bytes).unwrap_err();
        assert!(matches!(err, Error::Snapshot(_)), "{cfg:?}: {err}");
        assert!(target.block_table(5).is_err());
        assert_eq!(target.allocator().num_free_blocks(), 96);
    }
    let mut garbage = bytes.clone();
    garbage.truncate(bytes.len() / 2);
    assert!(matches!(
        cache.import_snapshot(ctx, 6, &garbage),
        Err(Error::Safetensors { .. })
    ));
    // Not enough room: refused with OutOfBlocks, nothing left behind.
    let mut small = PagedKvCache::new(ctx, config(KvDtype::F16, 16), PoolSize::Blocks(2)).unwrap();
    assert!(matches!(
        small.import_snapshot(ctx, 1, &bytes),
        Err(Error::OutOfBlocks { .. })
    ));
    assert!(small.block_table(1).is_err());
    assert_eq!(small.allocator().num_free_blocks(), 2);
}

#[test]
fn pool_larger_than_one_binding_splits_and_every_buffer_is_reachable() {
    // A pool of about 312 MiB: 5000 blocks of 64 KiB over bindings capped at 128 MiB (lavapipe's
    // own limit; a large GPU binds 2 GiB or more, where this pool would fit one binding).
    let ctx = &own_context(Some(128 << 20));
    let layout = PoolLayout {
        num_kv_heads: 8,
        head_dim: 128,
        dtype: KvDtype::F32,
        block_size: 16,

        scale: kvattn::quant::ScaleMode::PerRow,
    };
    let pool = BlockPool::new(ctx, layout, 5000, "big pool").unwrap();
    let binding = ctx.caps().max_storage_buffer_binding_size;
    assert!(pool.bytes() > binding);
    assert_eq!(
        pool.buffers().len() as u64,
        pool.bytes()
            .div_ceil(binding / layout.block_bytes() * layout.block_bytes())
    );
    eprintln!(
        "large pool: {} bytes in {} buffers of <= {binding}",
        pool.bytes(),
        pool.buffers().len()
    );
    // One row into the first block and one into the last, through append_kv, read back.
    let rows: Vec<f32> = (0..2 * 8 * 128).map(|i| i as f32 * 0.5).collect();
    let src = ctx.upload("rows", &rows).unwrap();
    let slots = [3u32, 4999 * 16 + 15];
    append_kv(ctx, &pool, &src, SourceDtype::F32, &slots).unwrap();
    let words = pool.read_blocks(ctx, &[0, 4999]).unwrap();
    for (i, (block_idx, offset)) in [(0usize, 3usize), (1, 15)].into_iter().enumerate() {
        for h in 0..8 {
            let at = block_idx * layout.block_words() + layout.row_in_block(h, offset);
            let got: Vec<f32> = words[at..at + 128]
                .iter()
                .map(|&w| f32::from_bits(w))
                .collect();
            assert_eq!(got, rows[(i * 8 + h) * 128..][..128], "row {i} head {h}");
        }
    }
    // Slots outside the pool are refused before dispatch.
    assert!(append_kv(ctx, &pool, &src, SourceDtype::F32, &[5000 * 16]).is_err());
}

#[test]
fn f16_sources_append_bit_exact() {
    let ctx = gpu_capped();
    let mut cache = new_cache(config(KvDtype::F32, 8), 96);
    cache.add_sequence(1, &[]).unwrap();
    let mut batch = AppendBatch::new();
    cache.append_tokens(ctx, &mut batch, 1, &[1, 2, 3]).unwrap();
    let mut rng = Rng::new(2);
    let halves = |n: usize, rng: &mut Rng| -> (Vec<u32>, Vec<f32>) {
        let vals: Vec<half::f16> = (0..n).map(|_| half::f16::from_f32(rng.normal())).collect();
        let words = vals
            .chunks(2)
            .map(|p| u32::from(p[0].to_bits()) | (u32::from(p[1].to_bits()) << 16))
            .collect();
        (words, vals.iter().map(|v| v.to_f32()).collect())
    };
    let (kw, kf) = halves(3 * 2 * 64, &mut rng);
    let (vw, vf) = halves(3 * 2 * 32, &mut rng);
    let (kb, vb) = (ctx.upload("k", &kw).unwrap(), ctx.upload("v", &vw).unwrap());
    cache
        .write_layer(ctx, 0, &batch, &kb, &vb, SourceDtype::F16)
        .unwrap();
    let (k, v) = cache.read_f32(ctx, 1, 0).unwrap();
    assert_eq!(k, kf);
    assert_eq!(v, vf);
    // The batch's row arrangement, built by the first layer, serves the next one.
    let (kw2, kf2) = halves(3 * 2 * 64, &mut rng);
    let (vw2, vf2) = halves(3 * 2 * 32, &mut rng);
    let (kb, vb) = (
        ctx.upload("k", &kw2).unwrap(),
        ctx.upload("v", &vw2).unwrap(),
    );
    cache
        .write_layer(ctx, 1, &batch, &kb, &vb, SourceDtype::F16)
        .unwrap();
    assert_eq!(cache.read_f32(ctx, 1, 1).unwrap(), (kf2, vf2));
    assert_eq!(
        cache.read_f32(ctx, 1, 0).unwrap(),
        (kf, vf),
        "layer 0 untouched"
    );
}
