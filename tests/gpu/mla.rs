//! MLA on the GPU vs the CPU reference (absorbed, f64): the absorbed path and the up-projection
//! path, decode and chunks after a prefix, ragged batches, every latent format (the reference
//! runs on the latent as the cache stores it), small odd shapes and DeepSeek-V2's.

use kvattn::attention::paged::PagedQuery;
use kvattn::cache::paged::PoolSize;
use kvattn::cache::scales::CacheScales;
use kvattn::gpu::{AttentionKernel, Context, ContextOptions};
use kvattn::mla::{
    mla_host, MlaArgs, MlaCache, MlaCacheConfig, MlaIo, MlaPath, MlaPlan, MlaWeights,
};
use kvattn::quant::{decode_rows, per_tensor_scale, KvDtype};
use kvattn::reference::mla::{mla, MlaBatch, MlaShape};
use kvattn::reference::AttentionOutput;
use kvattn::shader::Precision;
use kvattn::Error;

use crate::common::{gpu, gpu_capped, grid_stride, is_gl, max_abs_err, output_scale, Rng, Worst};

/// A batch on the host: per sequence (len_q, len_k), its latent rows and RoPE keys (token order),
/// the queries and one layer's weights.
struct HostMla {
    shape: MlaShape,
    lens: Vec<(usize, usize)>,
    c_kv: Vec<Vec<f32>>,
    k_pe: Vec<Vec<f32>>,
    q_nope: Vec<f32>,
    q_pe: Vec<f32>,
    w_uk: Vec<f32>,
    w_uv: Vec<f32>,
}

impl HostMla {
    fn new(shape: MlaShape, lens: &[(usize, usize)], seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let s = shape;
        let total_q: usize = lens.iter().map(|l| l.0).sum();
        Self {
            shape,
            lens: lens.to_vec(),
            c_kv: lens
                .iter()
                .map(|l| rng.normals(l.1 * s.rank, 1.0))
                .collect(),
            k_pe: lens
                .iter()
                .map(|l| rng.normals(l.1 * s.d_rope, 1.0))
                .collect(),
            q_nope: rng.normals(total_q * s.num_heads * s.d_nope, 1.0),
            q_pe: rng.normals(total_q * s.num_heads * s.d_rope, 1.0),
            // Weights scaled so q_lat and the outputs stay of order one.
            w_uk: rng.normals(
                s.num_heads * s.d_nope * s.rank,
                1.0 / (s.d_nope as f32).sqrt(),
            ),
            w_uv: rng.normals(s.num_heads * s.rank * s.d_v, 1.0 / (s.rank as f32).sqrt()),
        }
    }

    /// A cache of `config` holding every sequence (sequence i is id i), appended as a prefix and
    /// then the chunk of its queries.
    fn cache(&self, ctx: &Context, config: MlaCacheConfig) -> MlaCache {
        let s = &self.shape;
        let blocks: usize = self
            .lens
            .iter()
            .map(|l| l.1.div_ceil(config.block_size))
            .sum();
        let mut cache = MlaCache::new(ctx, config, PoolSize::Blocks(blocks + 3)).unwrap();
        cache.cache_mut().shuffle_free_blocks(7);
        for (i, &(lq, lk)) in self.lens.iter().enumerate() {
            cache.cache_mut().add_sequence(i as u64, &[]).unwrap();
            let split = lk - lq;
            for (a, b) in [(0, split), (split, lk)] {
                if a == b {
                    continue;
                }
                let tokens: Vec<u32> = (a as u32..b as u32).collect();
                let c = self.c_kv[i][a * s.rank..b * s.rank].to_vec();
                let p = self.k_pe[i][a * s.d_rope..b * s.d_rope].to_vec();
                cache
                    .append_host(ctx, i as u64, &tokens, &[c], &[p])
                    .unwrap();
            }
        }
        cache
    }

    fn queries(&self) -> Vec<PagedQuery> {
        self.lens
            .iter()
            .enumerate()
            .map(|(i, &(lq, _))| PagedQuery {
                seq: i as u64,
                len_q: lq,
            })
            .collect()
    }

    /// The reference on the latent and RoPE keys as `cache` stores them.
    fn reference(&self, ctx: &Context, cache: &MlaCache) -> AttentionOutput {
        let mut c_kv = Vec::new();
        let mut k_pe = Vec::new();
        for i in 0..self.lens.len() {
            let (c, p) = cache.cache().read_rows(ctx, i as u64, 0).unwrap();
            c_kv.extend(decode_rows(&c).unwrap());
            k_pe.extend(decode_rows(&p).unwrap());
        }
        let (cu_q, cu_k) = self.offsets();
        let batch = MlaBatch {
            q_nope: &self.q_nope,
            q_pe: &self.q_pe,
            c_kv: &c_kv,
            k_pe: &k_pe,
            w_uk: &self.w_uk,
            w_uv: &self.w_uv,
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
        };
        mla(&batch, &self.shape, None).unwrap()
    }

    fn offsets(&self) -> (Vec<u32>, Vec<u32>) {
        let mut cu_q = vec![0u32];
        let mut cu_k = vec![0u32];
        for &(lq, lk) in &self.lens {
            cu_q.push(cu_q.last().unwrap() + lq as u32);
            cu_k.push(cu_k.last().unwrap() + lk as u32);
        }
        (cu_q, cu_k)
    }

    fn run(
        &self,
        ctx: &Context,
        cache: &MlaCache,
        path: MlaPath,
        precision: Precision,
        chunk: Option<usize>,
    ) -> AttentionOutput {
        let weights = MlaWeights::upload(ctx, &self.shape, &self.w_uk, &self.w_uv).unwrap();
        let batch = self.queries();
        let args = MlaArgs {
            layer: 0,
            batch: &batch,
            shape: self.shape,
            scale: None,
            precision,
            path,
            up_proj_chunk: chunk,
        };
        mla_host(ctx, cache, &weights, &args, &self.q_nope, &self.q_pe).unwrap()
    }
}

fn precisions(ctx: &Context) -> Vec<Precision> {
    let mut p = vec![Precision::F32];
    if ctx.caps().shader_f16 {
        p.push(Precision::F16);
    }
    p
}

/// Checks `got` against `want`: f32 kernels within 1e-4 of the output scale (lse 1e-4); the f16
/// kernel holds the queries, latent rows and probabilities in f16: within 1/128 of the output
/// scale (lse 1/128).
fn check(name: &str, precision: Precision, got: &AttentionOutput, want: &AttentionOutput) -> f64 {
    let scale = output_scale(&want.out);
    let err = max_abs_err(&got.out, &want.out);
    let lse_err = max_abs_err(&got.lse, &want.lse);
    let (bound, lse_bound) = match precision {
        Precision::F32 => (1e-4 * scale, 1e-4 * output_scale(&want.lse)),
        Precision::F16 => (scale / 128.0, output_scale(&want.lse) / 128.0),
    };
    assert!(err <= bound, "{name}: out error {err:e} > {bound:e}");
    assert!(
        lse_err <= lse_bound,
        "{name}: lse error {lse_err:e} > {lse_bound:e}"
    );
    err / scale
}

fn config(shape: &MlaShape, latent: KvDtype, block_size: usize) -> MlaCacheConfig {
    let mut c = MlaCacheConfig::new(1, shape.rank, shape.d_rope, latent);
    c.block_size = block_size;
    c
}

/// Two small odd MLA shapes (RoPE parts of 8 and 4, latents of 64 and 96).
fn small_shapes() -> [MlaShape; 2] {
    [
        MlaShape {
            num_heads: 5,
            d_nope: 12,
            d_rope: 8,
            rank: 64,
            d_v: 20,
        },
        MlaShape {
            num_heads: 3,
            d_nope: 16,
            d_rope: 4,
            rank: 96,
            d_v: 8,
        },
    ]
}

#[test]
fn small_odd_shapes_both_paths_match_reference() {
    // Latent in every format (FP8 per-row and per-tensor), block sizes 1/16/64, pools over
    // several 64 KiB bindings, decode and chunks after a prefix in one ragged batch, the
    // up-projection path in several chunks and in one.
    let ctx = gpu_capped();
    let shapes = small_shapes();
    let latents = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Fp8E4M3,
        KvDtype::Fp8E5M2,
        KvDtype::Int8,
        KvDtype::Int4,
    ];
    let lens = [(1, 1), (1, 37), (9, 40), (70, 70), (1, 130)];
    let mut worst = Worst::default();
    let mut cases = 0;
    let mut point = 0;
    for (n, &latent) in latents.iter().enumerate() {
        let shape = shapes[n % shapes.len()];
        let b = HostMla::new(shape, &lens, 100 + n as u64);
        let bs = [16, 1, 64][n % 3];
        let mut cfg = config(&shape, latent, bs);
        if latent == KvDtype::Fp8E5M2 {
            let s = per_tensor_scale(latent, &b.c_kv.concat(), 1.25).unwrap();
            cfg.latent_scales = CacheScales::PerTensor(vec![s]);
        }
        let cache = b.cache(ctx, cfg);
        let want = b.reference(ctx, &cache);
        let precisions = precisions(ctx);
        for (j, (path, chunk)) in [
            (MlaPath::Absorbed, None),
            (MlaPath::UpProj, Some(23)),
            (MlaPath::UpProj, None),
        ]
        .into_iter()
        .enumerate()
        {
            // Each latent takes every path, in the precisions in turn (j + n of them): every
            // pair of a latent, a path and a precision meets where the adapter has both
            // precisions (21 points rather than 42). One point in `grid_stride` of those on the
            // second backend; all of them on the first.
            let precision = precisions[(j + n) % precisions.len()];
            point += 1;
            if point % grid_stride(ctx) != 0 {
                continue;
            }
            let got = b.run(ctx, &cache, path, precision, chunk);
            let name = format!(
                "{shape:?} {latent} bs{bs} {} {} chunk {chunk:?}",
                path.name(),
                precision.name()
            );
            let e = check(&name, precision, &got, &want);
            worst.add(format!("{}/{}", path.name(), precision.name()), e);
            cases += 1;
        }
    }
    eprintln!("MLA small shapes: {cases} cases; worst error / output scale: {worst:?}");
}

#[test]
fn deepseek_v2_shapes_both_paths_agree_with_reference_and_each_other() {
    // 128 heads, nope 128, RoPE 64, rank 512, v 128; f16 latent and a calibrated per-tensor
    // FP8 latent; a decode row and a chunk after a prefix in one batch.
    let ctx = gpu();
    let shape = MlaShape::DEEPSEEK_V2;
    let lens = [(1, 45), (4, 70)];
    let mut worst = Worst::default();
    for (n, latent) in [KvDtype::F16, KvDtype::Fp8E4M3].into_iter().enumerate() {
        let b = HostMla::new(shape, &lens, 900 + n as u64);
        let mut cfg = config(&shape, latent, 64);
        if latent == KvDtype::Fp8E4M3 {
            let s = per_tensor_scale(latent, &b.c_kv.concat(), 1.0).unwrap();
            cfg.latent_scales = CacheScales::PerTensor(vec![s]);
        }
        let cache = b.cache(ctx, cfg);
        let want = b.reference(ctx, &cache);
        for precision in precisions(ctx) {
            let absorbed = b.run(ctx, &cache, MlaPath::Absorbed, precision, None);
            let up = b.run(ctx, &cache, MlaPath::UpProj, precision, Some(32));
            let name = format!("DeepSeek-V2 {latent} {}", precision.name());
            let ea = check(&format!("{name} absorbed"), precision, &absorbed, &want);
            let eu = check(&format!("{name} up-proj"), precision, &up, &want);
            // The two GPU paths against each other.
            let between = max_abs_err(&absorbed.out, &up.out) / output_scale(&want.out);
            worst.add(format!("absorbed/{}", precision.name()), ea);
            worst.add(format!("up-proj/{}", precision.name()), eu);
            worst.add(format!("absorbed vs up-proj/{}", precision.name()), between);
        }
    }
    eprintln!("MLA DeepSeek-V2: worst error / output scale: {worst:?}");
}

#[test]
fn a_sequence_gets_the_same_bits_alone_or_batched_on_both_paths() {
    // The up-projection path packs whole pieces of each sequence's keys into chunks (pieces of
    // min(SPLIT_TOKENS, chunk) keys from the sequence's first key), so where a sequence sits in
    // the batch never moves a chunk boundary inside it: its rows get the same bits alone and
    // behind other sequences, with chunks smaller and larger than its keys. The absorbed path
    // (the paged kernel over the latent pool) likewise.
    let ctx = gpu_capped();
    let shape = small_shapes()[1];
    let lens = [(9, 40), (1, 130), (70, 70), (1, 37)];
    let b = HostMla::new(shape, &lens, 4242);
    let cache = b.cache(ctx, config(&shape, KvDtype::F16, 16));
    let (cu_q, _) = b.offsets();
    let (hn, hr) = (
        shape.num_heads * shape.d_nope,
        shape.num_heads * shape.d_rope,
    );
    let weights = MlaWeights::upload(ctx, &shape, &b.w_uk, &b.w_uv).unwrap();
    let run = |seqs: &[usize], path: MlaPath, chunk: Option<usize>| {
        let batch: Vec<PagedQuery> = seqs
            .iter()
            .map(|&i| PagedQuery {
                seq: i as u64,
                len_q: lens[i].0,
            })
            .collect();
        let rows = |x: &[f32], w: usize| -> Vec<f32> {
            seqs.iter()
                .flat_map(|&i| x[cu_q[i] as usize * w..cu_q[i + 1] as usize * w].to_vec())
                .collect()
        };
        let args = MlaArgs {
            layer: 0,
            batch: &batch,
            shape,
            scale: None,
            precision: Precision::F32,
            path,
            up_proj_chunk: chunk,
        };
        let (q_nope, q_pe) = (rows(&b.q_nope, hn), rows(&b.q_pe, hr));
        mla_host(ctx, &cache, &weights, &args, &q_nope, &q_pe).unwrap()
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let (ho, hl) = (shape.num_heads * shape.d_v, shape.num_heads);
    for (path, chunk) in [
        (MlaPath::Absorbed, None),
        (MlaPath::UpProj, Some(23)),
        (MlaPath::UpProj, Some(100)),
        (MlaPath::UpProj, None),
    ] {
        let all = run(&[0, 1, 2, 3], path, chunk);
        for i in 0..lens.len() {
            let alone = run(&[i], path, chunk);
            let (q0, q1) = (cu_q[i] as usize, cu_q[i + 1] as usize);
            let what = format!("{} chunk {chunk:?}, sequence {i}", path.name());
            assert_eq!(
                bits(&alone.out),
                bits(&all.out[q0 * ho..q1 * ho]),
                "{what}: outputs differ"
            );
            assert_eq!(
                bits(&alone.lse),
                bits(&all.lse[q0 * hl..q1 * hl]),
                "{what}: lse differ"
            );
        }
    }
}

#[test]
fn one_key_steps_two_a_pass_give_the_bits_of_one_a_pass() {
    // The workgroup kernel takes MLA's keys one a step; with step pairs (ContextOptions::
    // step_pairs, a CPU adapter's default) two steps a pass, both keys' rows loaded together
    // and each query and accumulator value read once for both, with the arithmetic of one key
    // a step. So both forms give the same bits: decode rows and chunks after a prefix, lengths
    // that leave the second key of a pass past a split's keys (1, 37, 130), pools over several
    // bindings, a 16-bit, an 8-bit and the int4 latent, and the RoPE part in both shapes.
    let context = |pairs| {
        Context::with_options(&ContextOptions {
            max_storage_binding_cap: Some(64 << 10),
            attention_kernel: Some(AttentionKernel::Workgroup),
            step_pairs: Some(pairs),
            ..Default::default()
        })
        .unwrap()
    };
    let (on, off) = (context(true), context(false));
    assert!(on.caps().step_pairs && !off.caps().step_pairs);
    let shapes = small_shapes();
    let lens = [(1, 1), (1, 37), (9, 40), (1, 130)];
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    // On GL (the second backend in CI, where each written-out variant compiles for seconds) the
    // 16-bit latent alone.
    let latents: &[KvDtype] = if is_gl(&on) {
        &[KvDtype::F16]
    } else {
        &[KvDtype::F16, KvDtype::Int8, KvDtype::Int4]
    };
    for (n, &latent) in latents.iter().enumerate() {
        let shape = shapes[n % shapes.len()];
        let b = HostMla::new(shape, &lens, 500 + n as u64);
        let run = |ctx: &Context| {
            let cache = b.cache(ctx, config(&shape, latent, [16, 1, 64][n]));
            let got = b.run(ctx, &cache, MlaPath::Absorbed, Precision::F32, None);
            (got, b.reference(ctx, &cache))
        };
        let ((paired, want), (single, _)) = (run(&on), run(&off));
        let what = format!("{shape:?} {latent}");
        check(
            &format!("{what}, two steps a pass"),
            Precision::F32,
            &paired,
            &want,
        );
        assert_eq!(bits(&paired.out), bits(&single.out), "{what}: outputs");
        assert_eq!(bits(&paired.lse), bits(&single.lse), "{what}: lse");
    }
}

#[test]
fn bad_input_is_refused() {
    let ctx = gpu();
    let shape = MlaShape {
        num_heads: 2,
        d_nope: 8,
        d_rope: 4,
        rank: 32,
        d_v: 8,
    };
    let b = HostMla::new(shape, &[(2, 5)], 1);
    let cache = b.cache(ctx, config(&shape, KvDtype::F16, 16));
    let weights = MlaWeights::upload(ctx, &shape, &b.w_uk, &b.w_uv).unwrap();
    let batch = b.queries();
    let args = MlaArgs {
        layer: 0,
        batch: &batch,
        shape,
        scale: None,
        precision: Precision::F32,
        path: MlaPath::Absorbed,
        up_proj_chunk: None,
    };
    // The RoPE keys stay 16-bit or f32.
    let mut cfg = config(&shape, KvDtype::Fp8E4M3, 16);
    cfg.rope_dtype = KvDtype::Int8;
    assert!(matches!(
        MlaCache::new(ctx, cfg, PoolSize::Blocks(4)),
        Err(Error::InvalidArgument(_))
    ));
    // Weights of the wrong length.
    assert!(matches!(
        MlaWeights::upload(ctx, &shape, &b.w_uk[1..], &b.w_uv),
        Err(Error::ShapeMismatch { .. })
    ));
    // A shape whose rank is not the cache's.
    let wrong = MlaArgs {
        shape: MlaShape { rank: 64, ..shape },
        ..args
    };
    assert!(MlaPlan::new(ctx, &cache, &wrong).is_err());
    // Non-finite scale, zero chunk, unknown sequence, len_q > len_k.
    for bad in [
        MlaArgs {
            scale: Some(f32::NAN),
            ..args
        },
        MlaArgs {
            path: MlaPath::UpProj,
            up_proj_chunk: Some(0),
            ..args
        },
    ] {
        assert!(MlaPlan::new(ctx, &cache, &bad).is_err());
    }
    for path in [MlaPath::Absorbed, MlaPath::UpProj] {
        for q in [
            PagedQuery { seq: 9, len_q: 1 },
            PagedQuery { seq: 0, len_q: 6 },
            PagedQuery { seq: 0, len_q: 0 },
        ] {
            let batch = [q];
            let bad = MlaArgs {
                batch: &batch,
                path,
                ..args
            };
            assert!(MlaPlan::new(ctx, &cache, &bad).is_err(), "{q:?} {path:?}");
        }
    }
    // Queries of the wrong length.
    assert!(matches!(
        mla_host(ctx, &cache, &weights, &args, &b.q_nope[1..], &b.q_pe),
        Err(Error::ShapeMismatch { .. })
    ));
    // Weights of another shape at run time.
    let other = MlaShape { d_v: 4, ..shape };
    let w_uv = vec![0.0; other.num_heads * other.rank * other.d_v];
    let other_weights = MlaWeights::upload(ctx, &other, &b.w_uk, &w_uv).unwrap();
    assert!(mla_host(ctx, &cache, &other_weights, &args, &b.q_nope, &b.q_pe).is_err());
    // And the good call works.
    assert!(mla_host(ctx, &cache, &weights, &args, &b.q_nope, &b.q_pe).is_ok());
}

#[test]
fn absorbed_path_on_the_lanes_kernel_matches_reference() {
    // The shared test contexts run the workgroup kernel (see tests/common); CPU adapters run
    // the lanes kernel by default, so check it here on both small shapes, a wide and a
    // word-by-word latent, pools over several bindings.
    let ctx = Context::with_options(&ContextOptions {
        max_storage_binding_cap: Some(64 << 10),
        attention_kernel: Some(AttentionKernel::Lanes),
        ..Default::default()
    })
    .unwrap();
    let shapes = small_shapes();
    let lens = [(1, 1), (1, 37), (9, 40), (70, 70), (1, 130)];
    for (n, (shape, latent)) in [(shapes[0], KvDtype::Int4), (shapes[1], KvDtype::F16)]
        .into_iter()
        .enumerate()
    {
        let b = HostMla::new(shape, &lens, 300 + n as u64);
        let cache = b.cache(&ctx, config(&shape, latent, 16));
        let want = b.reference(&ctx, &cache);
        let got = b.run(&ctx, &cache, MlaPath::Absorbed, Precision::F32, None);
        check(
            &format!("lanes {shape:?} {latent}"),
            Precision::F32,
            &got,
            &want,
        );
    }
}

/// The bits of the first `len` values of `buffer`.
fn bits(ctx: &Context, buffer: &wgpu::Buffer, len: usize) -> Vec<u32> {
    ctx.read_back::<f32>(buffer, len)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn encode_records_both_paths_into_a_callers_pass_with_the_run_bits() {
    // Both paths (the up-projection one in several chunks sharing one scratch pair) recorded
    // into ONE compute pass of the caller's encoder, one submission, give mla_host's bits;
    // bad io is refused before anything is recorded.
    let ctx = Context::with_options(&ContextOptions {
        max_storage_binding_cap: Some(64 << 10),
        attention_kernel: crate::common::test_attention_kernel(),
        ..Default::default()
    })
    .unwrap();
    let shape = small_shapes()[0];
    let b = HostMla::new(shape, &[(1, 37), (9, 40), (1, 130)], 21);
    let cache = b.cache(&ctx, config(&shape, KvDtype::Int8, 16));
    let weights = MlaWeights::upload(&ctx, &shape, &b.w_uk, &b.w_uv).unwrap();
    let batch = b.queries();
    let rows = b.q_nope.len() / shape.d_nope;
    let qn = ctx.upload("q_nope", &b.q_nope).unwrap();
    let qp = ctx.upload("q_pe", &b.q_pe).unwrap();
    let paths = [(MlaPath::Absorbed, None), (MlaPath::UpProj, Some(23))];
    let mut plans = Vec::new();
    let mut outs = Vec::new();
    let mut wants = Vec::new();
    for (path, chunk) in paths {
        let args = MlaArgs {
            layer: 0,
            batch: &batch,
            shape,
            scale: None,
            precision: Precision::F32,
            path,
            up_proj_chunk: chunk,
        };
        wants.push(mla_host(&ctx, &cache, &weights, &args, &b.q_nope, &b.q_pe).unwrap());
        plans.push(MlaPlan::new(&ctx, &cache, &args).unwrap());
        outs.push((
            ctx.filled("out", rows * shape.d_v, kvattn::gpu::UNWRITTEN)
                .unwrap(),
            ctx.filled("lse", rows, kvattn::gpu::UNWRITTEN).unwrap(),
        ));
    }
    let io = |(out, lse): &(wgpu::Buffer, wgpu::Buffer)| -> (wgpu::Buffer, wgpu::Buffer) {
        (out.clone(), lse.clone())
    };
    let before = ctx.counters();
    let mut encoder = ctx.encoder("caller's step");
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        for (plan, pair) in plans.iter().zip(&outs) {
            let (out, lse) = io(pair);
            plan.encode(
                &ctx,
                &mut pass,
                &cache,
                0,
                &weights,
                &MlaIo {
                    q_nope: &qn,
                    q_pe: &qp,
                    out: &out,
                    lse: &lse,
                },
            )
            .unwrap();
        }
    }
    assert_eq!(
        ctx.counters().since(&before).submissions,
        0,
        "encode submits nothing"
    );
    ctx.submit("caller's step", encoder).unwrap();
    for ((path, _), ((out, lse), want)) in paths.iter().zip(outs.iter().zip(&wants)) {
        let as_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&ctx, out, rows * shape.d_v),
            as_bits(&want.out),
            "{path:?} out"
        );
        assert_eq!(bits(&ctx, lse, rows), as_bits(&want.lse), "{path:?} lse");
    }
    // Bad io: refused with a typed error before anything is made or recorded.
    let small = ctx.filled("small lse", rows - 1, 0.0f32).unwrap();
    let (out, lse) = io(&outs[0]);
    let uniform_only = ctx
        .create_buffer(&wgpu::BufferDescriptor {
            label: Some("no storage"),
            size: (rows * shape.d_v * 4) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
        .unwrap();
    for plan in &plans {
        let before = ctx.counters();
        let mut encoder = ctx.encoder("refused");
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            let too_small = MlaIo {
                q_nope: &qn,
                q_pe: &qp,
                out: &out,
                lse: &small,
            };
            assert!(matches!(
                plan.encode(&ctx, &mut pass, &cache, 0, &weights, &too_small),
                Err(Error::ShapeMismatch { .. })
            ));
            let no_storage = MlaIo {
                out: &uniform_only,
                lse: &lse,
                ..too_small
            };
            assert!(matches!(
                plan.encode(&ctx, &mut pass, &cache, 0, &weights, &no_storage),
                Err(Error::InvalidArgument(_))
            ));
            let good = MlaIo {
                lse: &lse,
                ..too_small
            };
            assert!(matches!(
                plan.encode(&ctx, &mut pass, &cache, 1, &weights, &good),
                Err(Error::InvalidArgument(_))
            ));
        }
        drop(encoder);
        let made = ctx.counters().since(&before);
        assert_eq!(made.buffers_created, 0, "{made:?}");
        assert_eq!(made.bind_groups_created, 0, "{made:?}");
        assert_eq!(made.submissions, 0, "{made:?}");
    }
}
