//! Attention over the paged cache (decode and chunked prefill) vs the CPU reference: head dims,
//! GQA groups, block sizes around the lengths, prefixes and chunks, options, split-K, pools over
//! three or more bindings, batch invariance, forks and prefix hits feeding the kernel.

use kvattn::attention::decode::{decode_batch, DecodeConfig};
use kvattn::attention::merge_states::{merge_states, AttentionState};
use kvattn::attention::paged::{
    paged_attention_host, PagedAttentionArgs, PagedAttentionPlan, PagedQuery,
};
use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::scales::CacheScales;
use kvattn::gpu::{AttentionKernel, Context, ContextOptions, UNWRITTEN};
use kvattn::quant::{decode_rows, encode_rows, per_tensor_scale, KvDtype, ScaleMode};
use kvattn::reference;
use kvattn::shader::Precision;

use crate::common::{
    gpu, gpu_capped, grid_stride, is_gl, max_abs_err, option_sets, output_scale,
    test_attention_kernel, test_context_options, Rng, Worst,
};

/// A batch on the host: per sequence its K/V rows (f32, token order) and its queries.
struct HostBatch {
    shape: AttentionShape,
    lens: Vec<(usize, usize)>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    q: Vec<f32>,
}

impl HostBatch {
    fn new(shape: AttentionShape, lens: &[(usize, usize)], seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let (hkv, dk, dv) = (shape.num_kv_heads, shape.head_dim_qk, shape.head_dim_v);
        let total_q: usize = lens.iter().map(|l| l.1).sum();
        Self {
            shape,
            lens: lens.to_vec(),
            k: lens
                .iter()
                .map(|&(lk, _)| rng.normals(lk * hkv * dk, 1.0))
                .collect(),
            v: lens
                .iter()
                .map(|&(lk, _)| rng.normals(lk * hkv * dv, 1.0))
                .collect(),
            q: rng.normals(total_q * shape.num_q_heads * dk, 1.0),
        }
    }

    /// The values a cache of `storage` holds: each token row (one KV head) encoded by the CPU
    /// codec and decoded back.
    fn stored_as(&self, storage: &Storage) -> (Vec<f32>, Vec<f32>) {
        let round = |x: &[Vec<f32>], dtype: KvDtype, mode: ScaleMode, d: usize| -> Vec<f32> {
            decode_rows(&encode_rows(dtype, d, &x.concat(), mode).unwrap()).unwrap()
        };
        (
            round(&self.k, storage.k, storage.k_mode, self.shape.head_dim_qk),
            round(&self.v, storage.v, storage.v_mode, self.shape.head_dim_v),
        )
    }

    fn reference(&self, dtype: KvDtype, opts: &AttentionOptions) -> reference::AttentionOutput {
        self.reference_as(&Storage::uniform(dtype), opts)
    }

    fn reference_as(
        &self,
        storage: &Storage,
        opts: &AttentionOptions,
    ) -> reference::AttentionOutput {
        let (k, v) = self.stored_as(storage);
        let mut cu_q = vec![0u32];
        let mut cu_k = vec![0u32];
        for &(lk, lq) in &self.lens {
            cu_q.push(cu_q.last().unwrap() + lq as u32);
            cu_k.push(cu_k.last().unwrap() + lk as u32);
        }
        let batch = RaggedBatch {
            q: &self.q,
            k: &k,
            v: &v,
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
        };
        reference::attention(&batch, &self.shape, opts).unwrap()
    }

    /// A cache holding every sequence (ids 0..), written in random interleaved chunks so the
    /// physical blocks of a sequence are scattered.
    fn cache(&self, ctx: &Context, dtype: KvDtype, block_size: usize) -> PagedKvCache {
        self.cache_as(ctx, &Storage::uniform(dtype), block_size)
    }

    fn cache_as(&self, ctx: &Context, storage: &Storage, block_size: usize) -> PagedKvCache {
        let s = &self.shape;
        let scales = |mode: ScaleMode| match mode {
            ScaleMode::PerTensor(x) => CacheScales::PerTensor(vec![x]),
            ScaleMode::PerRow => CacheScales::PerRow,
        };
        let cfg = PagedKvConfig {
            head_dim_v: s.head_dim_v,
            block_size,
            prefix_caching: false,
            k_dtype: storage.k,
            v_dtype: storage.v,
            k_scales: scales(storage.k_mode),
            v_scales: scales(storage.v_mode),
            ..PagedKvConfig::new(1, s.num_kv_heads, s.head_dim_qk, KvDtype::F32)
        };
        let blocks: usize = self
            .lens
            .iter()
            .map(|l| l.0.div_ceil(block_size))
            .sum::<usize>()
            + 4;
        let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(blocks)).unwrap();
        let mut written = vec![0usize; self.lens.len()];
        let mut rng = Rng::new(blocks as u64);
        for i in 0..self.lens.len() {
            cache.add_sequence(i as u64, &[]).unwrap();
        }
        let (kr, vr) = (
            s.num_kv_heads * s.head_dim_qk,
            s.num_kv_heads * s.head_dim_v,
        );
        while written.iter().zip(&self.lens).any(|(w, l)| w < &l.0) {
            let i = (rng.next_u64() as usize) % self.lens.len();
            let left = self.lens[i].0 - written[i];
            if left == 0 {
                continue;
            }
            let n = left.min(1 + (rng.next_u64() % 70) as usize);
            let (a, b) = (written[i], written[i] + n);
            let tokens = vec![0u32; n];
            let k = vec![self.k[i][a * kr..b * kr].to_vec()];
            let v = vec![self.v[i][a * vr..b * vr].to_vec()];
            cache.append_host(ctx, i as u64, &tokens, &k, &v).unwrap();
            written[i] = b;
        }
        cache
    }

    fn queries(&self) -> Vec<PagedQuery> {
        self.lens
            .iter()
            .enumerate()
            .map(|(i, &(_, lq))| PagedQuery {
                seq: i as u64,
                len_q: lq,
            })
            .collect()
    }
}

/// K and V storage formats and scale modes of a test cache.
#[derive(Debug, Clone, Copy)]
struct Storage {
    k: KvDtype,
    k_mode: ScaleMode,
    v: KvDtype,
    v_mode: ScaleMode,
}

impl Storage {
    fn uniform(dtype: KvDtype) -> Self {
        Self::per_row(dtype, dtype)
    }

    fn per_row(k: KvDtype, v: KvDtype) -> Self {
        Self {
            k,
            k_mode: ScaleMode::PerRow,
            v,
            v_mode: ScaleMode::PerRow,
        }
    }

    fn name(&self) -> String {
        let mode = |m: ScaleMode| match m {
            ScaleMode::PerTensor(s) => format!("/t{s}"),
            ScaleMode::PerRow => String::new(),
        };
        format!(
            "k {}{} v {}{}",
            self.k,
            mode(self.k_mode),
            self.v,
            mode(self.v_mode)
        )
    }
}

fn capped_at(bytes: u64) -> Context {
    Context::with_options(&ContextOptions {
        max_storage_binding_cap: Some(bytes),
        ..test_context_options()
    })
    .unwrap()
}

fn precisions(ctx: &Context) -> Vec<Precision> {
    let mut p = vec![Precision::F32];
    if ctx.caps().shader_f16 {
        p.push(Precision::F16);
    }
    p
}

/// f32 kernels: 1e-4 of the output scale. f16 kernels (Q, K, V, P held in f16): 2^-9 of the
/// scale plus twice the f16 rounding of the inputs seen by the reference (an honest f16
/// computation's error is dominated by those roundings; the decode tests check the exact
/// FlashAttention rule).
fn check(
    name: &str,
    precision: Precision,
    got: &reference::AttentionOutput,
    want: &reference::AttentionOutput,
    want16: Option<&reference::AttentionOutput>,
) -> f64 {
    let scale = output_scale(&want.out);
    let err = max_abs_err(&got.out, &want.out);
    let lse_err = max_abs_err(&got.lse, &want.lse);
    let (bound, lse_bound) = match (precision, want16) {
        (Precision::F16, Some(w16)) => (
            2.0 * max_abs_err(&w16.out, &want.out) + scale / 512.0,
            2.0 * max_abs_err(&w16.lse, &want.lse) + 1.0 / 512.0,
        ),
        _ => (1e-4 * scale, 1e-4),
    };
    assert!(err <= bound, "{name}: out error {err:e} > {bound:e}");
    assert!(
        lse_err <= lse_bound,
        "{name}: lse error {lse_err:e} > {lse_bound:e}"
    );
    err / scale
}

/// The reference on inputs rounded to f16 (queries too): what an f16 kernel sees.
fn reference_f16(
    b: &HostBatch,
    storage: &Storage,
    opts: &AttentionOptions,
) -> reference::AttentionOutput {
    let r =
        |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect() };
    let (k, v) = b.stored_as(storage);
    let (k, v, q) = (r(&k), r(&v), r(&b.q));
    let mut cu_q = vec![0u32];
    let mut cu_k = vec![0u32];
    for &(lk, lq) in &b.lens {
        cu_q.push(cu_q.last().unwrap() + lq as u32);
        cu_k.push(cu_k.last().unwrap() + lk as u32);
    }
    let batch = RaggedBatch {
        q: &q,
        k: &k,
        v: &v,
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
    };
    reference::attention(&batch, &b.shape, opts).unwrap()
}

fn run(
    ctx: &Context,
    cache: &PagedKvCache,
    b: &HostBatch,
    opts: &AttentionOptions,
    precision: Precision,
) -> reference::AttentionOutput {
    let batch = b.queries();
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &batch,
        shape: b.shape,
        options: opts,
        precision,
    };
    paged_attention_host(ctx, cache, &args, &b.q).unwrap()
}

#[test]
fn paged_decode_and_prefill_match_reference_on_grid() {
    let ctx = gpu_capped();
    // (hq, hkv): MHA, GQA 2, 4, 8, MQA.
    let heads = [(4usize, 4usize), (8, 4), (8, 2), (16, 2), (6, 1)];
    let dims = [
        (64usize, 64usize),
        (80, 80),
        (96, 96),
        (128, 128),
        (256, 256),
        (192, 128),
    ];
    let block_sizes = [1usize, 8, 16, 32, 128, 256];
    let dtypes = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];
    let mut cases = 0;
    let mut worst = Worst::default();
    let every = grid_stride(ctx);
    for (i, &(dk, dv)) in dims.iter().enumerate() {
        for (j, &(hq, hkv)) in heads.iter().enumerate() {
            let n = i * heads.len() + j;
            if n % every != 0 {
                continue;
            }
            let bs = block_sizes[n % block_sizes.len()];
            let dtype = dtypes[n % dtypes.len()];
            let shape = AttentionShape {
                num_q_heads: hq,
                num_kv_heads: hkv,
                head_dim_qk: dk,
                head_dim_v: dv,
            };
            // Decode at 1, 17, 97, 1000 (split-K) and around a block boundary; prefill chunks
            // of 1 to 64 queries after prefixes of 0 to 500.
            let mut lens = vec![
                (1, 1),
                (17, 1),
                (97, 1),
                (bs, 1),
                (bs + 1, 1),
                (5, 5),
                (40 + 17, 17),
            ];
            if bs > 1 {
                lens.push((bs - 1, 1));
            }
            if n % 2 == 0 {
                lens.push((1000, 1));
            } else {
                lens.push((500 + 64, 64));
            }
            let b = HostBatch::new(shape, &lens, n as u64);
            // Pools over three or more bindings: the shared 64 KiB cap when three blocks fit it,
            // else a cap of three blocks.
            let block_bytes = (bs * hkv * dk.max(dv) * 4) as u64;
            let own;
            let ctx = if 3 * block_bytes <= 64 << 10 {
                ctx
            } else {
                own = capped_at(3 * block_bytes);
                &own
            };
            let cache = b.cache(ctx, dtype, bs);
            let buffers = cache.layer(0).unwrap().k.buffers().len();
            assert!(buffers >= 3, "only {buffers} buffers");
            let opts = AttentionOptions::default();
            let want = b.reference(dtype, &opts);
            // One precision a point, in turn every two points (n / 2): with the block size (n
            // mod 6) and the format (n mod 3) every pair of values of any two axes still meets,
            // at half the points' compiling.
            let precisions = precisions(ctx);
            let precision = precisions[(n / 2) % precisions.len()];
            let got = run(ctx, &cache, &b, &opts, precision);
            let w16 = (precision == Precision::F16)
                .then(|| reference_f16(&b, &Storage::uniform(dtype), &opts));
            let name = format!(
                "hd{dk}/{dv} hq{hq} hkv{hkv} bs{bs} {dtype} {}",
                precision.name()
            );
            let e = check(&name, precision, &got, &want, w16.as_ref());
            worst.add(format!("{dtype}/{}", precision.name()), e);
            cases += 1;
        }
    }
    eprintln!(
        "paged grid: {cases} cases (one point in {every}); worst error / output scale: {worst:?}"
    );
}

#[test]
fn paged_options_match_reference() {
    let ctx = gpu_capped();
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let b = HostBatch::new(shape, &[(1, 1), (30, 1), (200, 13), (700, 40), (9, 9)], 77);
    let cache = b.cache(ctx, KvDtype::F16, 16);
    for (name, opts) in option_sets(8, 5) {
        let want = b.reference(KvDtype::F16, &opts);
        for precision in precisions(ctx) {
            let got = run(ctx, &cache, &b, &opts, precision);
            let w16 = (precision == Precision::F16)
                .then(|| reference_f16(&b, &Storage::uniform(KvDtype::F16), &opts));
            check(
                &format!("{name} {}", precision.name()),
                precision,
                &got,
                &want,
                w16.as_ref(),
            );
        }
    }
}

#[test]
fn a_row_is_bitwise_the_same_alone_or_batched() {
    let ctx = gpu_capped();
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 128,
        head_dim_v: 128,
    };
    let b = HostBatch::new(shape, &[(300, 1), (900, 1), (120, 20), (64, 64)], 9);
    let cache = b.cache(ctx, KvDtype::F16, 16);
    let opts = AttentionOptions::default();
    let all = run(ctx, &cache, &b, &opts, Precision::F32);
    let row = shape.num_q_heads * shape.head_dim_v;
    let mut q_at = 0;
    for (i, &(_, lq)) in b.lens.iter().enumerate() {
        let batch = [PagedQuery {
            seq: i as u64,
            len_q: lq,
        }];
        let args = PagedAttentionArgs {
            layer: 0,
            batch: &batch,
            shape,
            options: &opts,
            precision: Precision::F32,
        };
        let q = &b.q[q_at * shape.num_q_heads * 128..(q_at + lq) * shape.num_q_heads * 128];
        let alone = paged_attention_host(ctx, &cache, &args, q).unwrap();
        assert_eq!(
            alone.out,
            all.out[q_at * row..(q_at + lq) * row],
            "sequence {i}"
        );
        q_at += lq;
    }
}

#[test]
fn paged_equals_contiguous_and_split_equals_unsplit() {
    // Uncapped: one buffer, so the paged and contiguous kernels cut the same splits.
    let ctx = gpu();
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let lens = [(1000usize, 1usize), (17, 1), (1300, 1)];
    let b = HostBatch::new(shape, &lens, 4);
    let cache = b.cache(ctx, KvDtype::F16, 16);
    let opts = AttentionOptions::default();
    let paged = run(ctx, &cache, &b, &opts, Precision::F32);
    let (k, v) = (b.k.concat(), b.v.concat());
    let cu_k = [0u32, 1000, 1017, 2317];
    let batch = RaggedBatch {
        q: &b.q,
        k: &k,
        v: &v,
        cu_seqlens_q: &[0, 1, 2, 3],
        cu_seqlens_k: &cu_k,
    };
    let config = DecodeConfig {
        k_dtype: KvDtype::F16,
        v_dtype: KvDtype::F16,
        precision: Precision::F32,
    };
    let contiguous = decode_batch(ctx, &batch, &shape, &opts, &config).unwrap();
    assert_eq!(
        paged.out, contiguous.out,
        "paged and contiguous decode differ"
    );
    assert_eq!(paged.lse, contiguous.lse);

    // Split-K: 64-key splits against one split per sequence.
    let queries = b.queries();
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &queries,
        shape,
        options: &opts,
        precision: Precision::F32,
    };
    let rows = 3 * shape.num_q_heads;
    let mut results = Vec::new();
    for split in [64usize, 1 << 20] {
        let plan = PagedAttentionPlan::with_split_tokens(ctx, &cache, &args, split).unwrap();
        let q = ctx.upload("q", &b.q).unwrap();
        let out = ctx.filled("out", rows * 64, UNWRITTEN).unwrap();
        let lse = ctx.filled("lse", rows, UNWRITTEN).unwrap();
        plan.run(ctx, &cache, 0, &q, &out, &lse).unwrap();
        results.push((
            plan.num_items(),
            ctx.read_back::<f32>(&out, rows * 64).unwrap(),
        ));
    }
    assert!(
        results[0].0 > results[1].0,
        "the small split cut more work items"
    );
    let err = max_abs_err(&results[0].1, &results[1].1);
    assert!(
        err <= 1e-5 * output_scale(&results[1].1),
        "split vs unsplit: {err:e}"
    );
}

#[test]
fn forks_and_prefix_hits_feed_the_kernel() {
    let ctx = gpu_capped();
    let shape = AttentionShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let cfg = PagedKvConfig {
        block_size: 8,
        ..PagedKvConfig::new(1, 2, 64, KvDtype::F32)
    };
    let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(64)).unwrap();
    let mut rng = Rng::new(12);
    let row = 2 * 64;
    // Parent: 21 tokens; fork; each branch appends its own 6 tokens.
    let prompt: Vec<u32> = (0..21).collect();
    let (pk, pv) = (rng.normals(21 * row, 1.0), rng.normals(21 * row, 1.0));
    cache.add_sequence(1, &prompt).unwrap();
    cache
        .append_host(
            ctx,
            1,
            &prompt,
            std::slice::from_ref(&pk),
            std::slice::from_ref(&pv),
        )
        .unwrap();
    cache.fork(1, 2).unwrap();
    let mut ks = vec![pk.clone(), pk.clone()];
    let mut vs = vec![pv.clone(), pv.clone()];
    for (i, seq) in [1u64, 2].into_iter().enumerate() {
        let (k, v) = (rng.normals(6 * row, 1.0), rng.normals(6 * row, 1.0));
        cache
            .append_host(
                ctx,
                seq,
                &[100 + seq as u32; 6],
                std::slice::from_ref(&k),
                std::slice::from_ref(&v),
            )
            .unwrap();
        ks[i].extend(k);
        vs[i].extend(v);
    }
    // A third sequence with the same prompt reuses the two full cached blocks (16 tokens).
    let cached = cache.add_sequence(3, &prompt).unwrap();
    assert_eq!(cached, 16);
    cache
        .append_host(
            ctx,
            3,
            &prompt[16..],
            &[pk[16 * row..].to_vec()],
            &[pv[16 * row..].to_vec()],
        )
        .unwrap();
    ks.push(pk.clone());
    vs.push(pv.clone());
    assert_eq!(
        cache.block_table(3).unwrap()[..2],
        cache.block_table(1).unwrap()[..2]
    );

    let lens = [(27usize, 3usize), (27, 1), (21, 21)];
    let total_q: usize = lens.iter().map(|l| l.1).sum();
    let q = rng.normals(total_q * 4 * 64, 1.0);
    let batch: Vec<PagedQuery> = lens
        .iter()
        .enumerate()
        .map(|(i, l)| PagedQuery {
            seq: i as u64 + 1,
            len_q: l.1,
        })
        .collect();
    let opts = AttentionOptions::default();
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &batch,
        shape,
        options: &opts,
        precision: Precision::F32,
    };
    let got = paged_attention_host(ctx, &cache, &args, &q).unwrap();
    let (k, v) = (ks.concat(), vs.concat());
    let cu_q = [0u32, 3, 4, 25];
    let cu_k = [0u32, 27, 54, 75];
    let want = reference::attention(
        &RaggedBatch {
            q: &q,
            k: &k,
            v: &v,
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
        },
        &shape,
        &opts,
    )
    .unwrap();
    check("forks and prefix hits", Precision::F32, &got, &want, None);
}

#[test]
fn paged_attention_rejects_bad_input() {
    let ctx = gpu_capped();
    let shape = AttentionShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let b = HostBatch::new(shape, &[(10, 2)], 1);
    let cache = b.cache(ctx, KvDtype::F32, 8);
    let opts = AttentionOptions::default();
    let try_run = |batch: &[PagedQuery], shape: AttentionShape, q: &[f32]| {
        let args = PagedAttentionArgs {
            layer: 0,
            batch,
            shape,
            options: &opts,
            precision: Precision::F32,
        };
        paged_attention_host(ctx, &cache, &args, q)
    };
    let q = &b.q;
    assert!(
        try_run(&[PagedQuery { seq: 0, len_q: 11 }], shape, q).is_err(),
        "len_q > len_k"
    );
    assert!(
        try_run(&[PagedQuery { seq: 0, len_q: 0 }], shape, q).is_err(),
        "len_q 0"
    );
    assert!(
        try_run(&[PagedQuery { seq: 9, len_q: 1 }], shape, q).is_err(),
        "unknown sequence"
    );
    assert!(try_run(&[], shape, q).is_err(), "empty batch");
    let wrong = AttentionShape {
        num_kv_heads: 4,
        ..shape
    };
    assert!(
        try_run(&[PagedQuery { seq: 0, len_q: 2 }], wrong, q).is_err(),
        "KV heads differ from the cache"
    );
    assert!(
        try_run(&[PagedQuery { seq: 0, len_q: 2 }], shape, &q[1..]).is_err(),
        "short q"
    );
    assert!(try_run(&[PagedQuery { seq: 0, len_q: 2 }], shape, q).is_ok());
}

#[test]
fn subgroup_and_portable_reductions_agree() {
    // The workgroup kernel sums a key's partial dot products over its lane group with subgroup
    // shuffles where the device has them, through workgroup memory otherwise, in the same
    // butterfly order: with the same lanes per key the two give the same bits. Lane counts past
    // the subgroup size (16 and 32 on lavapipe's subgroups of 8) run the portable sums only, and
    // must match the reference.
    let ctx = gpu();
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 80,
        head_dim_v: 80,
    };
    let b = HostBatch::new(shape, &[(700, 1), (97, 20), (16, 16)], 31);
    let opts = AttentionOptions::default();
    let want = b.reference(KvDtype::F16, &opts);
    let context = |disable_subgroups, key_lanes| {
        Context::with_options(&ContextOptions {
            disable_subgroups,
            key_lanes: Some(key_lanes),
            attention_kernel: test_attention_kernel(),
            ..Default::default()
        })
        .unwrap()
    };
    let attend = |ctx: &Context| {
        let cache = b.cache(ctx, KvDtype::F16, 16);
        run(ctx, &cache, &b, &opts, Precision::F32)
    };
    let shuffle_lanes = ctx.caps().subgroup_min_size.clamp(1, 8);
    // On GL (the second backend, without subgroups: both contexts sum portably) every other
    // lane count, each a written-out variant compiling for seconds there.
    let mut lane_counts = if is_gl(ctx) {
        vec![2, 8, 32]
    } else {
        vec![1, 2, 4, 8, 16, 32]
    };
    lane_counts.retain(|&l| l != shuffle_lanes);
    lane_counts.insert(0, shuffle_lanes);
    let mut first = None;
    for lanes in lane_counts {
        let portable = context(true, lanes);
        assert!(!portable.caps().subgroups);
        let p = attend(&portable);
        check(
            &format!("portable, {lanes} lanes"),
            Precision::F32,
            &p,
            &want,
            None,
        );
        if first.is_none() {
            first = Some(p);
        }
    }
    let portable = first.unwrap();
    let sub = context(false, shuffle_lanes);
    let a = attend(&sub);
    check(
        &format!("subgroups, {shuffle_lanes} lanes"),
        Precision::F32,
        &a,
        &want,
        None,
    );
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&a.out),
        bits(&portable.out),
        "subgroup and portable sums over {shuffle_lanes} lanes differ (subgroups: {})",
        sub.caps().subgroups
    );
    assert_eq!(bits(&a.lse), bits(&portable.lse));
}

#[test]
fn keys_two_at_a_time_give_the_bits_of_one_at_a_time() {
    // The workgroup kernel takes a step's keys two at a time (ContextOptions::key_pairs, a GPU's
    // default) in tiles of at most 4 rows without int4: both keys' rows are loaded, then used in
    // key order, with the arithmetic of one key at a time. So both forms give the same bits:
    // a decode batch (tiles of one token's 4 query heads, which take pairs), a prefill batch
    // (tiles of 8 rows, one key at a time either way), lengths that leave a pair half past a
    // split's keys, 16-bit and 8-bit formats, and int4 (one key at a time either way).
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 128,
        head_dim_v: 128,
    };
    let decode = HostBatch::new(shape, &[(700, 1), (1000, 1), (5, 1), (97, 1)], 37);
    let prefill = HostBatch::new(shape, &[(97, 20), (1000, 3), (16, 16)], 38);
    let (on, off) = workgroup_contexts(|o, pairs| o.key_pairs = Some(pairs));
    assert!(on.caps().key_pairs && !off.caps().key_pairs);
    // Every format on the first backend; on GL (the second in CI, where each written-out variant
    // compiles for seconds) one 16-bit and one 8-bit format, both paired in decode.
    let dtypes: &[KvDtype] = if is_gl(&on) {
        &[KvDtype::F16, KvDtype::Int8]
    } else {
        &[
            KvDtype::F16,
            KvDtype::Bf16,
            KvDtype::Fp8E4M3,
            KvDtype::Int8,
            KvDtype::Int4,
        ]
    };
    let batches = [("decode", &decode), ("prefill", &prefill)];
    assert_same_bits((&on, &off), &batches, dtypes, "keys two at a time");
}

/// Two contexts running the workgroup kernel that differ in one knob: `set` turns it on for the
/// first and off for the second.
fn workgroup_contexts(set: impl Fn(&mut ContextOptions, bool)) -> (Context, Context) {
    let context = |on| {
        let mut opts = ContextOptions {
            attention_kernel: Some(AttentionKernel::Workgroup),
            ..Default::default()
        };
        set(&mut opts, on);
        Context::with_options(&opts).unwrap()
    };
    (context(true), context(false))
}

/// Each batch in each format (block size 16) on `ctx.0` and `ctx.1`, contexts that differ in a
/// knob that must not change the bits (`knob` names it): the first within the reference's
/// tolerance, both bit for bit the same.
fn assert_same_bits(
    ctx: (&Context, &Context),
    batches: &[(&str, &HostBatch)],
    dtypes: &[KvDtype],
    knob: &str,
) {
    let opts = AttentionOptions::default();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for &(name, b) in batches {
        for &dtype in dtypes {
            let attend = |ctx: &Context| {
                let cache = b.cache(ctx, dtype, 16);
                run(ctx, &cache, b, &opts, Precision::F32)
            };
            let (on, off) = (attend(ctx.0), attend(ctx.1));
            let what = format!("{name}, {dtype:?}");
            check(
                &format!("{what}, {knob}"),
                Precision::F32,
                &on,
                &b.reference(dtype, &opts),
                None,
            );
            assert_eq!(bits(&on.out), bits(&off.out), "{what}, {knob}: outputs");
            assert_eq!(bits(&on.lse), bits(&off.lse), "{what}, {knob}: lse");
        }
    }
}

#[test]
fn one_lane_a_key_two_steps_a_pass_gives_the_bits_of_one_a_pass() {
    // With one lane a key row (key_lanes 1) each step of the workgroup kernel is one key, as in
    // MLA; with step pairs (ContextOptions::step_pairs) two steps go in one pass, the values
    // then read from the V pool (MLA's are the latent already loaded). The same bits either
    // way: a decode and a prefill batch with lengths that leave half a pass past a split's
    // keys, a 16-bit format and int4.
    let shape = AttentionShape {
        num_q_heads: 6,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let decode = HostBatch::new(shape, &[(700, 1), (5, 1), (97, 1)], 47);
    let prefill = HostBatch::new(shape, &[(97, 20), (16, 16)], 48);
    let (on, off) = workgroup_contexts(|o, pairs| {
        o.key_lanes = Some(1);
        o.step_pairs = Some(pairs);
    });
    assert!(on.caps().step_pairs && !off.caps().step_pairs);
    // On GL (the second backend in CI, where each written-out variant compiles for seconds) the
    // decode batch in the 16-bit format alone.
    let (batches, dtypes): (&[_], &[_]) = if is_gl(&on) {
        (&[("decode", &decode)], &[KvDtype::F16])
    } else {
        (
            &[("decode", &decode), ("prefill", &prefill)],
            &[KvDtype::F16, KvDtype::Int4],
        )
    };
    assert_same_bits(
        (&on, &off),
        batches,
        dtypes,
        "one lane a key, two steps a pass",
    );
}

#[test]
fn narrow_and_wide_workgroups_both_match_reference() {
    // The workgroup kernel's workgroups hold up to 8 lane groups on a GPU, which split a work
    // item's keys and combine at the end, and one group (one SIMD vector) on a CPU adapter
    // (ContextOptions::narrow_workgroups). The shared test context takes the GPU's form
    // everywhere; here both forms, each checked to be the layout asked for, against the
    // reference: GQA, MQA and MHA, d_v != d_qk, formats read wide and word by word, decode and
    // prefill across splits, and every option set on one shape.
    let (narrow, wide) = workgroup_contexts(|o, narrow| o.narrow_workgroups = Some(narrow));
    assert!(narrow.caps().narrow_workgroups && !wide.caps().narrow_workgroups);
    // The default: narrow on CPU adapters only.
    let default = Context::new().unwrap();
    assert_eq!(default.caps().narrow_workgroups, default.caps().cpu_adapter);
    let gl = is_gl(&narrow);
    let shapes = [
        (
            8usize,
            2usize,
            64usize,
            64usize,
            Storage::uniform(KvDtype::F16),
        ),
        (6, 1, 96, 96, Storage::uniform(KvDtype::Int8)),
        (4, 4, 36, 36, Storage::uniform(KvDtype::Fp8E4M3)),
        (
            16,
            2,
            192,
            128,
            Storage::per_row(KvDtype::Int4, KvDtype::Bf16),
        ),
    ];
    // On GL (the second backend in CI, where each written-out variant compiles for seconds)
    // the first shape.
    let shapes = if gl { &shapes[..1] } else { &shapes[..] };
    let mut wgs = Vec::new();
    for (i, (hq, hkv, dk, dv, storage)) in shapes.iter().enumerate() {
        let shape = AttentionShape {
            num_q_heads: *hq,
            num_kv_heads: *hkv,
            head_dim_qk: *dk,
            head_dim_v: *dv,
        };
        let b = HostBatch::new(
            shape,
            &[(1, 1), (700, 1), (97, 20), (600, 17)],
            60 + i as u64,
        );
        let opts = AttentionOptions::default();
        let want = b.reference_as(storage, &opts);
        for (name, ctx) in [("narrow", &narrow), ("wide", &wide)] {
            let cache = b.cache_as(ctx, storage, 16);
            let batch = b.queries();
            let args = PagedAttentionArgs {
                layer: 0,
                batch: &batch,
                shape,
                options: &opts,
                precision: Precision::F32,
            };
            let plan = PagedAttentionPlan::new(ctx, &cache, &args).unwrap();
            let layout = plan.workgroup_layout().unwrap();
            wgs.push((name, layout.key_lanes, layout.wg));
            let got = run(ctx, &cache, &b, &opts, Precision::F32);
            let what = format!("{name} hd{dk}/{dv} hq{hq} hkv{hkv} {}", storage.name());
            check(&what, Precision::F32, &got, &want, None);
        }
    }
    // Each shape's narrow workgroups are at most one SIMD vector (8 invocations) or one lane
    // group, and hold fewer invocations than the wide ones.
    for pair in wgs.chunks(2) {
        let ((_, lanes, n), (_, _, w)) = (pair[0], pair[1]);
        assert!(n == lanes.max(8) && w > n, "{wgs:?}");
    }
    // Every option set (windows, softcap, ALiBi, sinks, non-causal) on the first shape; on GL
    // a window and the sinks.
    let (hq, hkv, dk, dv, storage) = shapes[0];
    let shape = AttentionShape {
        num_q_heads: hq,
        num_kv_heads: hkv,
        head_dim_qk: dk,
        head_dim_v: dv,
    };
    let b = HostBatch::new(shape, &[(1, 1), (30, 1), (200, 13), (700, 40)], 59);
    for (name, opts) in option_sets(hq, 7) {
        if gl && !matches!(name, "window 37" | "sinks") {
            continue;
        }
        let want = b.reference_as(&storage, &opts);
        for (form, ctx) in [("narrow", &narrow), ("wide", &wide)] {
            let cache = b.cache_as(ctx, &storage, 16);
            let got = run(ctx, &cache, &b, &opts, Precision::F32);
            check(&format!("{form} {name}"), Precision::F32, &got, &want, None);
        }
    }
}

#[test]
fn cascade_prefix_pass_merged_with_suffix_pass_equals_full_attention() {
    // Two requests share a 300-token prefix. Cascade: every query attends once to the prefix
    // (one non-causal pass over the prefix sequence), once to its own suffix (causal), and the
    // two states are merged. The result must equal causal attention over prefix ++ suffix.
    let ctx = gpu_capped();
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let (prefix, suffixes, len_qs) = (300usize, [40usize, 25], [5usize, 1]);
    let mut rng = Rng::new(44);
    let row = 2 * 64;
    let cfg = PagedKvConfig {
        block_size: 16,
        prefix_caching: false,
        ..PagedKvConfig::new(1, 2, 64, KvDtype::F32)
    };
    let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(64)).unwrap();
    let (pk, pv) = (
        rng.normals(prefix * row, 1.0),
        rng.normals(prefix * row, 1.0),
    );
    cache.add_sequence(0, &[]).unwrap();
    cache
        .append_host(
            ctx,
            0,
            &vec![0; prefix],
            std::slice::from_ref(&pk),
            std::slice::from_ref(&pv),
        )
        .unwrap();
    let mut full_k = Vec::new();
    let mut full_v = Vec::new();
    for (i, &len) in suffixes.iter().enumerate() {
        let (k, v) = (rng.normals(len * row, 1.0), rng.normals(len * row, 1.0));
        let seq = i as u64 + 1;
        cache.add_sequence(seq, &[]).unwrap();
        cache
            .append_host(
                ctx,
                seq,
                &vec![0; len],
                std::slice::from_ref(&k),
                std::slice::from_ref(&v),
            )
            .unwrap();
        full_k.extend_from_slice(&pk);
        full_k.extend(k);
        full_v.extend_from_slice(&pv);
        full_v.extend(v);
    }
    let total_q: usize = len_qs.iter().sum();
    let rows = total_q * shape.num_q_heads;
    let q = rng.normals(rows * 64, 1.0);
    let qb = ctx.upload("q", &q).unwrap();
    let state = |name: &str| {
        (
            ctx.filled(name, rows * 64, UNWRITTEN).unwrap(),
            ctx.filled(name, rows, UNWRITTEN).unwrap(),
        )
    };
    // Pass 1: all queries over the prefix, non-causal (len_q > len_k is allowed then).
    let non_causal = AttentionOptions {
        causal: false,
        ..Default::default()
    };
    let prefix_batch = [PagedQuery {
        seq: 0,
        len_q: total_q,
    }];
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &prefix_batch,
        shape,
        options: &non_causal,
        precision: Precision::F32,
    };
    let a = state("prefix");
    PagedAttentionPlan::new(ctx, &cache, &args)
        .unwrap()
        .run(ctx, &cache, 0, &qb, &a.0, &a.1)
        .unwrap();
    // Pass 2: each request's queries over its own suffix, causal.
    let causal = AttentionOptions::default();
    let suffix_batch = [
        PagedQuery {
            seq: 1,
            len_q: len_qs[0],
        },
        PagedQuery {
            seq: 2,
            len_q: len_qs[1],
        },
    ];
    let args = PagedAttentionArgs {
        batch: &suffix_batch,
        options: &causal,
        ..args
    };
    let b = state("suffix");
    PagedAttentionPlan::new(ctx, &cache, &args)
        .unwrap()
        .run(ctx, &cache, 0, &qb, &b.0, &b.1)
        .unwrap();
    let out = state("merged");
    fn st(s: &(wgpu::Buffer, wgpu::Buffer)) -> AttentionState<'_> {
        AttentionState { o: &s.0, lse: &s.1 }
    }
    merge_states(ctx, rows, 64, st(&a), st(&b), st(&out)).unwrap();
    let got = reference::AttentionOutput {
        out: ctx.read_back(&out.0, rows * 64).unwrap(),
        lse: ctx.read_back(&out.1, rows).unwrap(),
    };
    let cu_q = [0u32, len_qs[0] as u32, total_q as u32];
    let cu_k = [
        0u32,
        (prefix + suffixes[0]) as u32,
        (2 * prefix + suffixes[0] + suffixes[1]) as u32,
    ];
    let batch = RaggedBatch {
        q: &q,
        k: &full_k,
        v: &full_v,
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
    };
    let want = reference::attention(&batch, &shape, &causal).unwrap();
    check("cascade", Precision::F32, &got, &want, None);
    // More queries than keys: refused when causal or with ALiBi, accepted otherwise.
    let many = [PagedQuery { seq: 2, len_q: 30 }];
    let bad = PagedAttentionArgs {
        batch: &many,
        ..args
    };
    assert!(PagedAttentionPlan::new(ctx, &cache, &bad).is_err());
    let alibi = AttentionOptions {
        causal: false,
        alibi_slopes: Some(vec![0.1; 8]),
        ..Default::default()
    };
    let bad = PagedAttentionArgs {
        options: &alibi,
        ..bad
    };
    assert!(PagedAttentionPlan::new(ctx, &cache, &bad).is_err());
    let ok = PagedAttentionArgs {
        options: &non_causal,
        ..bad
    };
    assert!(PagedAttentionPlan::new(ctx, &cache, &ok).is_ok());
}

#[test]
fn quantized_kv_matches_reference_on_dequantized_rows() {
    // Every quantized format (per-row scales), per-tensor FP8 from calibration, and K and V in
    // different formats; decode and prefill chunks; pools over several bindings; both kernels.
    let ctx = gpu_capped();
    let heads = [(8usize, 2usize), (4, 4), (6, 1), (16, 2)];
    let dims = [
        (64usize, 64usize),
        (128, 128),
        (96, 96),
        (192, 128),
        (256, 256),
    ];
    let block_sizes = [16usize, 1, 32, 8];
    let mut storages: Vec<Storage> = [
        KvDtype::Fp8E4M3,
        KvDtype::Fp8E5M2,
        KvDtype::Int8,
        KvDtype::Int4,
    ]
    .into_iter()
    .map(Storage::uniform)
    .collect();
    storages.push(Storage::per_row(KvDtype::Int8, KvDtype::Int4));
    storages.push(Storage::per_row(KvDtype::Fp8E5M2, KvDtype::F16));
    storages.push(Storage::per_row(KvDtype::Bf16, KvDtype::Fp8E4M3));
    let mut cases = 0;
    let mut worst = Worst::default();
    let mut n = 0;
    let every = grid_stride(ctx);
    for &(dk, dv) in &dims {
        for (si, base) in storages.iter().enumerate() {
            let (hq, hkv) = heads[n % heads.len()];
            let bs = block_sizes[n % block_sizes.len()];
            n += 1;
            // Points in pairs, so that a sampled grid keeps both scale modes (n % 2 below).
            if (n / 2) % every != 0 {
                continue;
            }
            let shape = AttentionShape {
                num_q_heads: hq,
                num_kv_heads: hkv,
                head_dim_qk: dk,
                head_dim_v: dv,
            };
            let lens = [(1, 1), (97, 1), (bs + 1, 1), (40 + 17, 17), (600, 1)];
            let b = HostBatch::new(shape, &lens, (si * 31 + dk) as u64);
            // Per-tensor FP8 (every other case): scales calibrated on this batch with headroom.
            let mut storage = *base;
            if n % 2 == 0 && storage.k.fp8_format().is_some() {
                let k = per_tensor_scale(storage.k, &b.k.concat(), 1.25).unwrap();
                storage.k_mode = ScaleMode::PerTensor(k);
            }
            if n % 2 == 0 && storage.v.fp8_format().is_some() {
                let v = per_tensor_scale(storage.v, &b.v.concat(), 1.0).unwrap();
                storage.v_mode = ScaleMode::PerTensor(v);
            }
            let block_bytes = (bs * hkv * dk.max(dv) * 4) as u64;
            let own;
            let ctx = if 3 * block_bytes <= 64 << 10 {
                ctx
            } else {
                own = capped_at(3 * block_bytes);
                &own
            };
            let cache = b.cache_as(ctx, &storage, bs);
            let opts = AttentionOptions::default();
            let want = b.reference_as(&storage, &opts);
            for precision in precisions(ctx) {
                let got = run(ctx, &cache, &b, &opts, precision);
                let w16 = (precision == Precision::F16).then(|| reference_f16(&b, &storage, &opts));
                let name = format!(
                    "hd{dk}/{dv} hq{hq} hkv{hkv} bs{bs} {} {}",
                    storage.name(),
                    precision.name()
                );
                let e = check(&name, precision, &got, &want, w16.as_ref());
                worst.add(format!("{}/{}", base.name(), precision.name()), e);
                cases += 1;
            }
        }
    }
    eprintln!(
        "quantized grid: {cases} cases (one point in {every}); worst error / output scale: \
         {worst:?}"
    );
}

#[test]
fn workgroup_and_lanes_kernels_both_match_reference() {
    // The context picks one kernel by adapter type (lanes on CPU adapters, workgroup on GPUs);
    // both must be right everywhere. Formats read wide (f16, int8, int4) and word by word (fp8
    // at head dim 36), GQA/MQA/MHA, d_v != d_qk, decode and a prefill chunk, split-K.
    let shapes = [
        (
            8usize,
            2usize,
            64usize,
            64usize,
            Storage::uniform(KvDtype::F16),
            16usize,
        ),
        (6, 1, 96, 96, Storage::uniform(KvDtype::Int8), 8),
        (
            16,
            2,
            192,
            128,
            Storage::per_row(KvDtype::Int4, KvDtype::Bf16),
            32,
        ),
        (4, 4, 36, 36, Storage::uniform(KvDtype::Fp8E4M3), 1),
        (32, 8, 128, 128, Storage::uniform(KvDtype::F32), 16),
    ];
    for kernel in [AttentionKernel::Workgroup, AttentionKernel::Lanes] {
        let ctx = Context::with_options(&ContextOptions {
            attention_kernel: Some(kernel),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(ctx.caps().attention_kernel, kernel);
        for (i, &(hq, hkv, dk, dv, storage, bs)) in shapes.iter().enumerate() {
            let shape = AttentionShape {
                num_q_heads: hq,
                num_kv_heads: hkv,
                head_dim_qk: dk,
                head_dim_v: dv,
            };
            let b = HostBatch::new(shape, &[(1, 1), (97, 1), (700, 1), (57, 17)], i as u64);
            let cache = b.cache_as(&ctx, &storage, bs);
            let batch = b.queries();
            for precision in precisions(&ctx) {
                let args = PagedAttentionArgs {
                    layer: 0,
                    batch: &batch,
                    shape,
                    options: &AttentionOptions::default(),
                    precision,
                };
                let plan = PagedAttentionPlan::new(&ctx, &cache, &args).unwrap();
                assert_eq!(plan.kernel(), kernel, "hd{dk} takes the chosen kernel");
                let opts = AttentionOptions::default();
                let got = run(&ctx, &cache, &b, &opts, precision);
                let want = b.reference_as(&storage, &opts);
                let w16 = (precision == Precision::F16).then(|| reference_f16(&b, &storage, &opts));
                let name = format!(
                    "{} hd{dk}/{dv} hq{hq} hkv{hkv} bs{bs} {} {}",
                    kernel.name(),
                    storage.name(),
                    precision.name()
                );
                check(&name, precision, &got, &want, w16.as_ref());
            }
        }
        // Every option (windows, softcap, ALiBi, sinks, non-causal) on one shape.
        let (hq, hkv, dk, dv, storage, bs) = shapes[0];
        let shape = AttentionShape {
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim_qk: dk,
            head_dim_v: dv,
        };
        let b = HostBatch::new(shape, &[(1, 1), (30, 1), (200, 13), (700, 40)], 41);
        let cache = b.cache_as(&ctx, &storage, bs);
        for (name, opts) in option_sets(hq, 6) {
            let want = b.reference_as(&storage, &opts);
            let got = run(&ctx, &cache, &b, &opts, Precision::F32);
            check(
                &format!("{} {name}", kernel.name()),
                Precision::F32,
                &got,
                &want,
                None,
            );
        }
    }
}

#[test]
fn results_do_not_depend_on_which_pool_buffer_holds_a_block() {
    // The workgroup kernel binds a pool of two buffers whole, so a sequence's splits are the
    // fixed token splits whatever buffer the allocator put its blocks in: the same sequence
    // gives the same bits in a cache where its blocks all lie in the first buffer and in one
    // where an earlier sequence pushed them across both.
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let bs = 16;
    // f16 rows of 64 values, 2 KV heads, 16 slots: 4 KiB blocks; 48 blocks per buffer.
    let block_bytes = 2 * 16 * 32 * 4;
    let ctx = Context::with_options(&ContextOptions {
        max_storage_binding_cap: Some(48 * block_bytes),
        attention_kernel: Some(AttentionKernel::Workgroup),
        ..Default::default()
    })
    .unwrap();
    // 17 query tokens' queries: the first one for decode, all for a prefill chunk.
    let b = HostBatch::new(shape, &[(700, 17)], 77);
    let cfg = PagedKvConfig {
        block_size: bs,
        prefix_caching: false,
        ..PagedKvConfig::new(1, 2, 64, KvDtype::F16)
    };
    let run_after = |filler_blocks: usize, len_q: usize| {
        let mut cache = PagedKvCache::new(&ctx, cfg.clone(), PoolSize::Blocks(96)).unwrap();
        assert_eq!(cache.layer(0).unwrap().k.buffers().len(), 2);
        if filler_blocks > 0 {
            let n = filler_blocks * bs;
            cache.add_sequence(9, &[]).unwrap();
            let rows = vec![vec![0.5f32; n * 2 * 64]];
            cache
                .append_host(&ctx, 9, &vec![0; n], &rows, &rows)
                .unwrap();
        }
        cache.add_sequence(0, &[]).unwrap();
        cache
            .append_host(&ctx, 0, &vec![0; 700], &[b.k[0].clone()], &[b.v[0].clone()])
            .unwrap();
        let table = cache.allocator().blocks(0).unwrap().to_vec();
        let buffers: std::collections::BTreeSet<u32> = table.iter().map(|&x| x / 48).collect();
        let opts = AttentionOptions::default();
        let batch = [PagedQuery { seq: 0, len_q }];
        let args = PagedAttentionArgs {
            layer: 0,
            batch: &batch,
            shape,
            options: &opts,
            precision: Precision::F32,
        };
        let plan = PagedAttentionPlan::new(&ctx, &cache, &args).unwrap();
        let rows = len_q * shape.num_q_heads * shape.head_dim_qk;
        let out = paged_attention_host(&ctx, &cache, &args, &b.q[..rows]).unwrap();
        (buffers, plan.num_items(), out)
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for len_q in [1, 17] {
        let (one, items_one, a) = run_after(0, len_q);
        let (two, items_two, c) = run_after(40, len_q);
        assert_eq!(
            one.len(),
            1,
            "the first cache keeps the sequence in one buffer"
        );
        assert_eq!(two.len(), 2, "the second cache spreads it over both");
        assert_eq!(items_one, items_two, "the same splits (len_q {len_q})");
        assert_eq!(bits(&a.out), bits(&c.out), "len_q {len_q}: outputs differ");
        assert_eq!(bits(&a.lse), bits(&c.lse), "len_q {len_q}: lse differ");
    }
}

#[test]
fn a_pool_over_many_buffers_gives_the_bits_of_a_pool_in_one_buffer() {
    // Both kernels bind a pool whole where the device's storage bindings allow
    // (DeviceFit::pool_slots: the workgroup kernel 8 pool buffers on lavapipe's 32 bindings
    // and 6 on llvmpipe's 16; the lanes kernel, which also binds vec4 views of these rows, 7
    // and 3): a sequence whose blocks are scattered over three or five buffers gets the
    // splits, and the bits, of the same sequence in a pool of one buffer, in decode and in a
    // prefill chunk.
    let shape = AttentionShape {
        num_q_heads: 6,
        num_kv_heads: 3,
        head_dim_qk: 80,
        head_dim_v: 80,
    };
    let cfg = PagedKvConfig {
        block_size: 8,
        prefix_caching: false,
        ..PagedKvConfig::new(1, 3, 80, KvDtype::Int8)
    };
    // int8 rows with a scale each, 3 KV heads, 8 slots a block; 389 keys take 49 of the 60.
    let block_bytes = cfg.k_layout().block_bytes();
    let (pool_blocks, len_k) = (60, 389);
    let b = HostBatch::new(shape, &[(len_k, 13)], 91);
    let run = |ctx: &Context, len_q: usize| {
        let mut cache = PagedKvCache::new(ctx, cfg.clone(), PoolSize::Blocks(pool_blocks)).unwrap();
        cache.shuffle_free_blocks(5);
        cache.add_sequence(0, &[]).unwrap();
        cache
            .append_host(
                ctx,
                0,
                &vec![0; len_k],
                &[b.k[0].clone()],
                &[b.v[0].clone()],
            )
            .unwrap();
        let pool = &cache.layer(0).unwrap().k;
        let bpb = pool.blocks_per_buffer() as u32;
        let table = cache.allocator().blocks(0).unwrap().to_vec();
        let used: std::collections::BTreeSet<u32> = table.iter().map(|&x| x / bpb).collect();
        let buffers = (pool.buffers().len(), used.len());
        let opts = AttentionOptions {
            causal: true,
            ..Default::default()
        };
        let batch = [PagedQuery { seq: 0, len_q }];
        let args = PagedAttentionArgs {
            layer: 0,
            batch: &batch,
            shape,
            options: &opts,
            precision: Precision::F32,
        };
        let plan = PagedAttentionPlan::new(ctx, &cache, &args).unwrap();
        assert_eq!(plan.kernel(), ctx.caps().attention_kernel);
        let rows = len_q * shape.num_q_heads * shape.head_dim_qk;
        let out = paged_attention_host(ctx, &cache, &args, &b.q[..rows]).unwrap();
        (buffers, plan.num_items(), out)
    };
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let kernels = [
        (AttentionKernel::Workgroup, 1, 5),
        (AttentionKernel::Lanes, 2, 3),
    ];
    for (kernel, views, buffers) in kernels {
        let open = |cap: Option<u64>| {
            Context::with_options(&ContextOptions {
                max_storage_binding_cap: cap,
                attention_kernel: Some(kernel),
                ..Default::default()
            })
            .unwrap()
        };
        let one = open(None);
        let many = open(Some(pool_blocks as u64 / buffers as u64 * block_bytes));
        let slots = kvattn::attention::paged::DeviceFit::of(&many).pool_slots(views);
        assert!(
            slots >= buffers,
            "{kernel:?}: this adapter binds {slots} pool buffers at once ({} storage buffers \
             per stage); the test needs {buffers}",
            many.caps().max_storage_buffers_per_shader_stage
        );
        for len_q in [1, 13] {
            let what = format!("{kernel:?}, len_q {len_q}");
            let (in_one, items_a, a) = run(&one, len_q);
            let (in_many, items_b, c) = run(&many, len_q);
            assert_eq!(in_one, (1, 1), "{what}: the first pool is one buffer");
            assert_eq!(in_many.0, buffers, "{what}: the capped pool's buffers");
            assert!(
                in_many.1 >= buffers - 1,
                "{what}: the shuffled blocks lie in {} of the {buffers} buffers",
                in_many.1
            );
            assert_eq!(items_a, items_b, "{what}: the same splits");
            assert_eq!(bits(&a.out), bits(&c.out), "{what}: outputs differ");
            assert_eq!(bits(&a.lse), bits(&c.lse), "{what}: lse differ");
        }
    }
}

#[test]
fn a_tile_of_more_rows_than_invocations_writes_every_row() {
    // One lane a key (rows of one 16-byte chunk: f32 at head dim 4, FP8 and int8 at 16) gives
    // workgroups of 8 invocations, fewer than a tile of 16 rows (GPUs take 16 rows of f32 at
    // head dim 4, CPU adapters of the 8-bit formats too): every row's max and sum must still be
    // combined. Prefill chunks of 9 and 17 tokens times a group of 4 fill such tiles.
    let ctx = Context::with_options(&ContextOptions {
        attention_kernel: Some(AttentionKernel::Workgroup),
        ..Default::default()
    })
    .unwrap();
    for (d, dtype) in [
        (4, KvDtype::F32),
        (16, KvDtype::Fp8E4M3),
        (16, KvDtype::Int8),
    ] {
        let shape = AttentionShape {
            num_q_heads: 8,
            num_kv_heads: 2,
            head_dim_qk: d,
            head_dim_v: d,
        };
        let storage = Storage::uniform(dtype);
        let b = HostBatch::new(shape, &[(9, 9), (1, 1), (57, 17)], d as u64);
        let cache = b.cache_as(&ctx, &storage, 8);
        let opts = AttentionOptions::default();
        let want = b.reference_as(&storage, &opts);
        for precision in precisions(&ctx) {
            let got = run(&ctx, &cache, &b, &opts, precision);
            let w16 = (precision == Precision::F16).then(|| reference_f16(&b, &storage, &opts));
            let name = format!("hd{d} {} {}", storage.name(), precision.name());
            check(&name, precision, &got, &want, w16.as_ref());
        }
    }
}
