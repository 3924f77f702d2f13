//! `AppendPlan` (the append of every step's new K/V rows, made once) against
//! `PagedKvCache::write_layer` and the CPU codec, the counters of a warm step, the plan's typed
//! errors, and the one-submission forms of `copy_blocks` and copy-on-write.
//!
//! Every test makes a context of its own, so that its counters see only its own work, with
//! storage bindings capped at 64 KiB so that every pool splits over several buffers.

use std::num::NonZeroU64;

use kvattn::cache::append_kv::SourceDtype;
use kvattn::cache::append_plan::{AppendIo, AppendPlan};
use kvattn::cache::copy_blocks::copy_blocks;
use kvattn::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::pool::{BlockPool, PoolLayout};
use kvattn::cache::scales::CacheScales;
use kvattn::gpu::Context;
use kvattn::quant::{encode_rows, KvDtype, ScaleMode};
use kvattn::Error;

use crate::common::{own_context, pool_words, Rng};

fn base_config() -> PagedKvConfig {
    PagedKvConfig {
        head_dim_v: 32,
        block_size: 8,
        model_id: "append-plan".into(),
        ..PagedKvConfig::new(2, 2, 64, KvDtype::F16)
    }
}

/// Two caches made and shuffled alike: the same calls give the same slots.
fn twin_caches(ctx: &Context, cfg: &PagedKvConfig, blocks: usize) -> [PagedKvCache; 2] {
    [0, 1].map(|_| {
        let mut cache = PagedKvCache::new(ctx, cfg.clone(), PoolSize::Blocks(blocks)).unwrap();
        cache.shuffle_free_blocks(7);
        let pools = cache.layer(0).unwrap();
        assert!(
            pools.k.buffers().len() >= 2 && pools.v.buffers().len() >= 2,
            "the pools should split over several buffers"
        );
        cache
    })
}

/// Per layer, the K and V source buffers of `rows` rows (STORAGE | COPY_DST), pre-filled with
/// a sentinel.
fn sources(ctx: &Context, cfg: &PagedKvConfig, rows: usize) -> Vec<(wgpu::Buffer, wgpu::Buffer)> {
    let buf = |d: usize| {
        ctx.filled("source", rows * cfg.num_kv_heads * d, u32::MAX)
            .unwrap()
    };
    (0..cfg.layers)
        .map(|_| (buf(cfg.head_dim_k), buf(cfg.head_dim_v)))
        .collect()
}

/// `n` random values as `src` holds them: the words to write and the values the pool sees
/// (for f16, the f16 values as f32).
fn values(rng: &mut Rng, n: usize, src: SourceDtype) -> (Vec<u32>, Vec<f32>) {
    let x = rng.normals(n, 2.0);
    match src {
        SourceDtype::F32 => (x.iter().map(|v| v.to_bits()).collect(), x),
        SourceDtype::F16 => {
            let h: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
            let words = h
                .chunks(2)
                .map(|p| u32::from(p[0].to_bits()) | (u32::from(p[1].to_bits()) << 16))
                .collect();
            (words, h.iter().map(|v| v.to_f32()).collect())
        }
    }
}

fn io<'a>(
    cache: &'a PagedKvCache,
    layer: usize,
    src: &'a [(wgpu::Buffer, wgpu::Buffer)],
    dtype: SourceDtype,
) -> AppendIo<'a> {
    AppendIo {
        cache,
        layer,
        k: src[layer].0.as_entire_buffer_binding(),
        v: src[layer].1.as_entire_buffer_binding(),
        src: dtype,
    }
}

/// A plan of one row from an f16 source whose rows are not whole 16-byte units (head dims 4 and
/// 12): the kernel reads that source word by word and its 16-byte view of the source takes the
/// plan's row list instead, which must be a 16-byte binding although one row's entry is 8 bytes.
#[test]
fn a_one_row_plan_over_a_word_read_source_matches_the_cpu_codec() {
    let cfg = PagedKvConfig {
        head_dim_v: 12,
        block_size: 4,
        model_id: "append-plan-one-row".into(),
        ..PagedKvConfig::new(1, 1, 4, KvDtype::F16)
    };
    let ctx = own_context(None);
    let mut cache = PagedKvCache::new(&ctx, cfg.clone(), PoolSize::Blocks(4)).unwrap();
    cache.add_sequence(1, &[]).unwrap();
    let src = sources(&ctx, &cfg, 1);
    let mut plan = AppendPlan::with_capacity(&ctx, &cache, 1).unwrap();
    let mut rng = Rng::new(12);
    let (mut mk, mut mv) = (Vec::new(), Vec::new());
    for step in 0..3u32 {
        let (kw, kf) = values(&mut rng, cfg.head_dim_k, SourceDtype::F16);
        let (vw, vf) = values(&mut rng, cfg.head_dim_v, SourceDtype::F16);
        ctx.write_buffer(&src[0].0, 0, bytemuck::cast_slice(&kw))
            .unwrap();
        ctx.write_buffer(&src[0].1, 0, bytemuck::cast_slice(&vw))
            .unwrap();
        mk.extend(kf);
        mv.extend(vf);
        let mut batch = AppendBatch::new();
        cache.append_tokens(&ctx, &mut batch, 1, &[step]).unwrap();
        plan.update(&ctx, &cache, &batch).unwrap();
        ctx.run_pass("one-row append plan", |pass| {
            plan.encode(&ctx, pass, &io(&cache, 0, &src, SourceDtype::F16))
        })
        .unwrap();
    }
    let (k, v) = cache.read_rows(&ctx, 1, 0).unwrap();
    assert_eq!(
        k,
        encode_rows(KvDtype::F16, 4, &mk, ScaleMode::PerRow).unwrap()
    );
    assert_eq!(
        v,
        encode_rows(KvDtype::F16, 12, &mv, ScaleMode::PerRow).unwrap()
    );
}

#[test]
fn append_plan_matches_write_layer_and_a_warm_step_creates_nothing() {
    let base = base_config();
    let cases = [
        ("f16 cache, f32 source", base.clone(), SourceDtype::F32),
        (
            "fp8 per-tensor K, int4 V, f32 source",
            PagedKvConfig {
                k_dtype: KvDtype::Fp8E4M3,
                k_scales: CacheScales::PerTensor(vec![0.0125, 0.75]),
                v_dtype: KvDtype::Int4,
                ..base.clone()
            },
            SourceDtype::F32,
        ),
        (
            "int8 K, bf16 V, f16 source",
            PagedKvConfig {
                k_dtype: KvDtype::Int8,
                v_dtype: KvDtype::Bf16,
                ..base.clone()
            },
            SourceDtype::F16,
        ),
        (
            "fp8 e5m2 per-row K, f32 V, f16 source",
            PagedKvConfig {
                k_dtype: KvDtype::Fp8E5M2,
                v_dtype: KvDtype::F32,
                ..base.clone()
            },
            SourceDtype::F16,
        ),
    ];
    for (name, cfg, dtype) in cases {
        eprintln!("case: {name}");
        let ctx = own_context(Some(64 << 10));
        let [mut by_layer, mut by_plan] = twin_caches(&ctx, &cfg, 96);
        let max_rows = 64;
        let src = sources(&ctx, &cfg, max_rows);
        let mut plan = AppendPlan::with_capacity(&ctx, &by_plan, max_rows).unwrap();
        assert_eq!(plan.capacity(), max_rows);
        let mut rng = Rng::new(11);
        // Per sequence, per layer: the K and V values the pool should hold.
        let seqs = [1u64, 2, 3];
        let mut model: Vec<Vec<(Vec<f32>, Vec<f32>)>> =
            vec![vec![(Vec::new(), Vec::new()); cfg.layers]; seqs.len()];
        for cache in [&mut by_layer, &mut by_plan] {
            for seq in seqs {
                cache.add_sequence(seq, &[]).unwrap();
            }
        }
        // A prefill step, then three decode steps.
        let steps: [[usize; 3]; 4] = [[5, 19, 30], [1, 1, 1], [1, 1, 1], [1, 0, 1]];
        for (step, news) in steps.iter().enumerate() {
            let tokens =
                |n: usize| -> Vec<u32> { (0..n as u32).map(|t| t + 100 * step as u32).collect() };
            let mut by_layer_batch = AppendBatch::new();
            for (&seq, &n) in seqs.iter().zip(news) {
                if n > 0 {
                    by_layer
                        .append_tokens(&ctx, &mut by_layer_batch, seq, &tokens(n))
                        .unwrap();
                }
            }
            let rows = by_layer_batch.len();
            // The step's rows, written into the same source buffers every step.
            for (layer, (kb, vb)) in src.iter().enumerate() {
                let (kw, kf) = values(&mut rng, rows * cfg.num_kv_heads * cfg.head_dim_k, dtype);
                let (vw, vf) = values(&mut rng, rows * cfg.num_kv_heads * cfg.head_dim_v, dtype);
                ctx.write_buffer(kb, 0, bytemuck::cast_slice(&kw)).unwrap();
                ctx.write_buffer(vb, 0, bytemuck::cast_slice(&vw)).unwrap();
                let (kr, vr) = (
                    cfg.num_kv_heads * cfg.head_dim_k,
                    cfg.num_kv_heads * cfg.head_dim_v,
                );
                let mut row = 0;
                for (s, &n) in news.iter().enumerate() {
                    model[s][layer].0.extend(&kf[row * kr..(row + n) * kr]);
                    model[s][layer].1.extend(&vf[row * vr..(row + n) * vr]);
                    row += n;
                }
            }
            for (layer, (kb, vb)) in src.iter().enumerate() {
                by_layer
                    .write_layer(&ctx, layer, &by_layer_batch, kb, vb, dtype)
                    .unwrap();
            }
            // The plan's step: allocation, update, record, one submission.
            let before_b = ctx.counters();
            let mut batch = AppendBatch::new();
            for (&seq, &n) in seqs.iter().zip(news) {
                if n > 0 {
                    by_plan
                        .append_tokens(&ctx, &mut batch, seq, &tokens(n))
                        .unwrap();
                }
            }
            assert_eq!(batch.slots(), by_layer_batch.slots(), "{name}: same slots");
            let before = ctx.counters();
            plan.update(&ctx, &by_plan, &batch).unwrap();
            assert_eq!(plan.rows(), rows);
            ctx.run_pass("append plan step", |pass| {
                for layer in 0..cfg.layers {
                    plan.encode(&ctx, pass, &io(&by_plan, layer, &src, dtype))?;
                }
                Ok(())
            })
            .unwrap();
            let spent = ctx.counters().since(&before);
            assert_eq!(spent.submissions, 1, "{name} step {step}: one submission");
            if step > 0 {
                let warm = ctx.counters().since(&before_b);
                assert_eq!(
                    (
                        warm.buffers_created,
                        warm.bind_groups_created,
                        warm.pipelines_compiled
                    ),
                    (0, 0, 0),
                    "{name} step {step}: a warm step (allocation, update, record) created \
                     something: {warm:?}"
                );
            } else {
                assert!(
                    spent.bind_groups_created > 0,
                    "{name}: the first step binds"
                );
            }
        }
        ctx.wait().unwrap();
        assert_eq!(
            pool_words(&ctx, &by_plan),
            pool_words(&ctx, &by_layer),
            "{name}: the plan's pools differ from write_layer's"
        );
        for (s, &seq) in seqs.iter().enumerate() {
            for (layer, (mk, mv)) in model[s].iter().enumerate() {
                let (k, v) = by_plan.read_rows(&ctx, seq, layer).unwrap();
                let want =
                    |dtype, d, mode: ScaleMode, x: &[f32]| encode_rows(dtype, d, x, mode).unwrap();
                assert_eq!(
                    k,
                    want(cfg.k_dtype, cfg.head_dim_k, cfg.k_scales.mode(layer), mk),
                    "{name}: seq {seq} layer {layer} K against the CPU codec"
                );
                assert_eq!(
                    v,
                    want(cfg.v_dtype, cfg.head_dim_v, cfg.v_scales.mode(layer), mv),
                    "{name}: seq {seq} layer {layer} V against the CPU codec"
                );
            }
        }
    }
}

#[test]
fn append_plan_refuses_bad_input_with_typed_errors_before_recording() {
    let ctx = own_context(Some(64 << 10));
    let cfg = base_config();
    let [mut cache, mut other] = twin_caches(&ctx, &cfg, 64);
    let src = sources(&ctx, &cfg, 4);
    let mut plan = AppendPlan::with_capacity(&ctx, &cache, 4).unwrap();
    assert!(matches!(
        AppendPlan::with_capacity(&ctx, &cache, 0),
        Err(Error::InvalidArgument(_))
    ));
    for c in [&mut cache, &mut other] {
        c.add_sequence(1, &[]).unwrap();
    }
    let d = SourceDtype::F32;
    let refused =
        |what: &str, r: Result<wgpu::SubmissionIndex, Error>, want: fn(&Error) -> bool| {
            let e = r.expect_err(what);
            assert!(want(&e), "{what}: {e:?}");
        };
    let invalid = |e: &Error| matches!(e, Error::InvalidArgument(_));
    let before = ctx.counters();
    // Recording before any update.
    refused(
        "encode before update",
        ctx.run_pass("t", |p| plan.encode(&ctx, p, &io(&cache, 0, &src, d))),
        invalid,
    );
    // Over capacity: five rows into a plan of four.
    let mut big = AppendBatch::new();
    cache
        .append_tokens(&ctx, &mut big, 1, &[1, 2, 3, 4, 5])
        .unwrap();
    let e = plan.update(&ctx, &cache, &big).unwrap_err();
    assert!(invalid(&e), "over capacity: {e:?}");
    // Another cache of the same shape.
    let mut theirs = AppendBatch::new();
    other.append_tokens(&ctx, &mut theirs, 1, &[1, 2]).unwrap();
    let e = plan.update(&ctx, &other, &theirs).unwrap_err();
    assert!(invalid(&e), "another cache: {e:?}");
    // A good update; then every bad source is refused before anything is recorded.
    let mut batch = AppendBatch::new();
    cache.append_tokens(&ctx, &mut batch, 1, &[6, 7]).unwrap();
    plan.update(&ctx, &cache, &batch).unwrap();
    let align = u64::from(ctx.device.limits().min_storage_buffer_offset_alignment);
    let k_rows = cfg.num_kv_heads * cfg.head_dim_k * 4;
    let wide = ctx.filled("wide", k_rows + 16, 0u32).unwrap();
    let no_storage = ctx
        .create_buffer(&wgpu::BufferDescriptor {
            label: Some("no storage"),
            size: (4 * k_rows) as u64,
            usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
        .unwrap();
    type Case<'a> = (&'a str, wgpu::BufferBinding<'a>, fn(&Error) -> bool);
    let bad: Vec<Case> = vec![
        (
            "misaligned offset",
            wgpu::BufferBinding {
                buffer: &wide,
                offset: 4,
                size: None,
            },
            |e| matches!(e, Error::InvalidArgument(_)),
        ),
        (
            "too small",
            wgpu::BufferBinding {
                buffer: &wide,
                offset: 0,
                size: NonZeroU64::new(k_rows as u64),
            },
            |e| matches!(e, Error::ShapeMismatch { .. }),
        ),
        (
            "aligned offset leaving too little",
            wgpu::BufferBinding {
                buffer: &wide,
                offset: (3 * k_rows as u64).div_ceil(align) * align,
                size: None,
            },
            |e| matches!(e, Error::ShapeMismatch { .. }),
        ),
        (
            "no STORAGE usage",
            no_storage.as_entire_buffer_binding(),
            |e| matches!(e, Error::InvalidArgument(_)),
        ),
        (
            "a pool buffer of the cache",
            cache.layer(0).unwrap().k.buffers()[0].as_entire_buffer_binding(),
            |e| matches!(e, Error::InvalidArgument(_)),
        ),
    ];
    for (what, k, want) in bad {
        let r = ctx.run_pass("t", |p| {
            plan.encode(
                &ctx,
                p,
                &AppendIo {
                    k,
                    ..io(&cache, 0, &src, d)
                },
            )
        });
        refused(what, r, want);
    }
    refused(
        "a missing layer",
        ctx.run_pass("t", |p| {
            plan.encode(
                &ctx,
                p,
                &AppendIo {
                    layer: 2,
                    ..io(&cache, 0, &src, d)
                },
            )
        }),
        invalid,
    );
    refused(
        "another cache's io",
        ctx.run_pass("t", |p| plan.encode(&ctx, p, &io(&other, 0, &src, d))),
        invalid,
    );
    assert_eq!(
        ctx.counters().since(&before).submissions,
        0,
        "a refused encode submitted something"
    );
    // Nothing was recorded, so updating again without a submission is allowed.
    plan.update(&ctx, &cache, &batch).unwrap();
    // Recorded but not submitted: the next update is refused, and allowed after the submission.
    let mut encoder = ctx.encoder("held");
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        for layer in 0..cfg.layers {
            plan.encode(&ctx, &mut pass, &io(&cache, layer, &src, d))
                .unwrap();
        }
    }
    let e = plan.update(&ctx, &cache, &batch).unwrap_err();
    assert!(invalid(&e), "update before the submission: {e:?}");
    ctx.submit("held", encoder).unwrap();
    plan.update(&ctx, &cache, &batch).unwrap();
    ctx.wait().unwrap();
}

#[test]
fn copy_blocks_and_copy_on_write_are_one_submission() {
    let ctx = own_context(Some(64 << 10));
    let layout = PoolLayout {
        num_kv_heads: 2,
        head_dim: 64,
        dtype: KvDtype::F32,
        block_size: 8,
        scale: ScaleMode::PerRow,
    };
    let pool = BlockPool::new(&ctx, layout, 96, "copy test").unwrap();
    let per = pool.blocks_per_buffer();
    assert!(
        pool.buffers().len() >= 3,
        "{} buffers",
        pool.buffers().len()
    );
    let bw = layout.block_words();
    let blocks: Vec<u32> = (0..96).collect();
    let mut words: Vec<u32> = (0..96 * bw as u32).collect();
    pool.write_blocks(&ctx, &blocks, &words).unwrap();
    // Inside one buffer (twice, in two buffers) and between buffers, both directions.
    let p = per as u32;
    let pairs = [
        (0, 1),
        (2, p + 3),
        (2 * p + 1, 4),
        (p + 5, p + 6),
        (5, 2 * p + 7),
    ];
    let before = ctx.counters();
    copy_blocks(&ctx, &pool, &pairs).unwrap();
    assert_eq!(ctx.counters().since(&before).submissions, 1);
    for &(s, d) in &pairs {
        let (s, d) = (s as usize * bw, d as usize * bw);
        let copied = words[s..s + bw].to_vec();
        words[d..d + bw].copy_from_slice(&copied);
    }
    assert_eq!(pool.read_blocks(&ctx, &blocks).unwrap(), words);
    // A block outside the pool: typed error, nothing submitted.
    let before = ctx.counters();
    let e = copy_blocks(&ctx, &pool, &[(0, 96)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert_eq!(ctx.counters().since(&before).submissions, 0);

    // Copy-on-write of a shared partial block on every layer: one submission.
    let cfg = PagedKvConfig {
        k_dtype: KvDtype::F32,
        v_dtype: KvDtype::F32,
        ..base_config()
    };
    let [mut cache, _] = twin_caches(&ctx, &cfg, 64);
    cache.add_sequence(1, &[]).unwrap();
    let mut rng = Rng::new(5);
    let k: Vec<Vec<f32>> = (0..2).map(|_| rng.normals(5 * 2 * 64, 1.0)).collect();
    let v: Vec<Vec<f32>> = (0..2).map(|_| rng.normals(5 * 2 * 32, 1.0)).collect();
    cache
        .append_host(&ctx, 1, &[1, 2, 3, 4, 5], &k, &v)
        .unwrap();
    cache.fork(1, 2).unwrap();
    let before = ctx.counters();
    let mut batch = AppendBatch::new();
    cache.append_tokens(&ctx, &mut batch, 2, &[9]).unwrap();
    assert_eq!(ctx.counters().since(&before).submissions, 1);
    assert_ne!(
        cache.block_table(1).unwrap(),
        cache.block_table(2).unwrap(),
        "the fork's partial block was copied"
    );
    for layer in 0..2 {
        let (k1, v1) = cache.read_f32(&ctx, 1, layer).unwrap();
        let (k2, v2) = cache.read_f32(&ctx, 2, layer).unwrap();
        assert_eq!(k1, k[layer]);
        assert_eq!(v1, v[layer]);
        assert_eq!(&k2[..k1.len()], &k1[..], "layer {layer}: copied K");
        assert_eq!(&v2[..v1.len()], &v1[..], "layer {layer}: copied V");
    }
}
