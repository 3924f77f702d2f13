//! Decode over a contiguous cache vs the CPU reference, on a grid of head dims, GQA groups and
//! context lengths, in every storage format and precision the adapter offers.

use half::f16;
use kvattn::attention::decode::{decode, decode_batch, DecodeArgs, DecodeConfig};
use kvattn::attention::paged::{paged_attention_host, PagedAttentionArgs, PagedQuery};
use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::gpu::{is_unwritten, UNWRITTEN};
use kvattn::quant::{encode_rows, KvDtype, ScaleMode};
use kvattn::reference;
use kvattn::shader::Precision;
use kvattn::Error;

use crate::common::{
    gpu, grid_stride, max_abs_err, on_diagonal, option_sets, output_scale, own_context, Rng, Worst,
};

const CONTEXTS: [usize; 4] = [1, 17, 97, 1000];

/// (num_q_heads, num_kv_heads): MHA, GQA 4, GQA 8, MQA with an odd group, MQA with 32 heads.
const HEADS: [(usize, usize); 5] = [(4, 4), (8, 2), (16, 2), (12, 1), (32, 1)];

struct Case {
    shape: AttentionShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
}

impl Case {
    fn new(shape: AttentionShape, lens: &[usize], seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let total_k: usize = lens.iter().sum();
        let mut cu_k = vec![0u32];
        for &l in lens {
            cu_k.push(cu_k.last().unwrap() + l as u32);
        }
        Self {
            q: rng.normals(lens.len() * shape.num_q_heads * shape.head_dim_qk, 1.0),
            k: rng.normals(total_k * shape.num_kv_heads * shape.head_dim_qk, 1.0),
            v: rng.normals(total_k * shape.num_kv_heads * shape.head_dim_v, 1.0),
            cu_q: (0..=lens.len() as u32).collect(),
            cu_k,
            shape,
        }
    }

    fn batch(&self) -> RaggedBatch<'_> {
        RaggedBatch {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
        }
    }
}

fn round_to(dtype: KvDtype, x: &[f32]) -> Vec<f32> {
    match dtype {
        KvDtype::F32 => x.to_vec(),
        KvDtype::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        KvDtype::Bf16 => x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect(),
        other => panic!("no rounding for {other}"),
    }
}

fn to_f16(x: &[f32]) -> Vec<f32> {
    round_to(KvDtype::F16, x)
}

/// The f16 kernel's arithmetic done honestly on the CPU: q, k, v and the probabilities held in
/// f16 (the probabilities relative to the row's final max), everything else in f64, with every
/// option of ARCHITECTURE.md section 2 (the query of a decode row sits at the last key).
fn decode_f16_emulated(
    case: &Case,
    k: &[f32],
    v: &[f32],
    opts: &AttentionOptions,
) -> (Vec<f32>, Vec<f32>) {
    let s = &case.shape;
    let (hq, hkv, d, dv) = (s.num_q_heads, s.num_kv_heads, s.head_dim_qk, s.head_dim_v);
    let q = to_f16(&case.q);
    let (k, v) = (to_f16(k), to_f16(v));
    let scale = f64::from(opts.scale_for(s));
    let (mut out, mut lse) = (Vec::new(), Vec::new());
    for seq in 0..case.cu_k.len() - 1 {
        let (k0, k1) = (case.cu_k[seq] as usize, case.cu_k[seq + 1] as usize);
        let len = k1 - k0;
        let first = k0 + len.saturating_sub(opts.sliding_window.unwrap_or(len));
        for h in 0..hq {
            let kvh = h / s.group();
            let qr = &q[(seq * hq + h) * d..][..d];
            let scores: Vec<f64> = (first..k1)
                .map(|j| {
                    let kr = &k[(j * hkv + kvh) * d..][..d];
                    let mut x = scale
                        * qr.iter()
                            .zip(kr)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>();
                    if let Some(cap) = opts.softcap {
                        x = f64::from(cap) * (x / f64::from(cap)).tanh();
                    }
                    if let Some(slopes) = &opts.alibi_slopes {
                        x -= f64::from(slopes[h]) * (k1 - 1 - j) as f64;
                    }
                    x
                })
                .collect();
            let sink = opts.sinks.as_ref().map(|s| f64::from(s[h]));
            let m = scores
                .iter()
                .cloned()
                .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            let p: Vec<f64> = scores
                .iter()
                .map(|&x| f64::from(f16::from_f64((x - m).exp()).to_f32()))
                .collect();
            let l: f64 = p.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
            lse.push((m + l.ln()) as f32);
            for c in 0..dv {
                let acc: f64 = (first..k1)
                    .zip(&p)
                    .map(|(j, &pj)| pj * f64::from(v[(j * hkv + kvh) * dv + c]))
                    .sum();
                out.push((acc / l) as f32);
            }
        }
    }
    (out, lse)
}

/// Error bounds for `precision`: f32 kernels within 1e-4 of the output scale (lse within 1e-4);
/// f16 kernels at most twice as wrong as the honest f16 computation (FlashAttention's rule),
/// plus 1e-5 of the scale for f32 summation order.
fn bounds(
    precision: Precision,
    case: &Case,
    kv: (&[f32], &[f32]),
    opts: &AttentionOptions,
    want: &reference::AttentionOutput,
) -> (f64, f64) {
    let scale = output_scale(&want.out);
    match precision {
        Precision::F32 => (1e-4 * scale, 1e-4),
        Precision::F16 => {
            let (out, lse) = decode_f16_emulated(case, kv.0, kv.1, opts);
            (
                2.0 * max_abs_err(&out, &want.out) + 1e-5 * scale,
                2.0 * max_abs_err(&lse, &want.lse) + 1e-5,
            )
        }
    }
}

fn precisions() -> Vec<Precision> {
    let mut p = vec![Precision::F32];
    if gpu().caps().shader_f16 {
        p.push(Precision::F16);
    }
    p
}

#[test]
fn decode_matches_reference_on_grid() {
    let ctx = gpu();
    let mut cases = 0;
    let mut worst = Worst::default();
    let dims = [64usize, 80, 128, 256];
    let dtypes = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];
    for (di, &d) in dims.iter().enumerate() {
        for (hi, &(hq, hkv)) in HEADS.iter().enumerate() {
            // The grid's time is compiling its variants, one or two a point. Every pair of a
            // head dim, a head layout and a format meets on the first backend: the format of a
            // point is the sum of its other two indices modulo the formats (a Latin square, 20
            // points rather than all 60, each in every precision). On the second backend only
            // the points of one diagonal (`on_diagonal`), every value of every axis once.
            if !on_diagonal(ctx, &[di, hi], &[dims.len(), HEADS.len()]) {
                continue;
            }
            let dtype = dtypes[(di + hi) % dtypes.len()];
            let shape = AttentionShape {
                num_q_heads: hq,
                num_kv_heads: hkv,
                head_dim_qk: d,
                head_dim_v: d,
            };
            let case = Case::new(shape, &CONTEXTS, (d * 31 + hi) as u64);
            let opts = AttentionOptions::default();
            // The reference sees exactly the values stored in the cache.
            let (k, v) = (round_to(dtype, &case.k), round_to(dtype, &case.v));
            let batch = RaggedBatch {
                k: &k,
                v: &v,
                ..case.batch()
            };
            let want = reference::attention(&batch, &shape, &opts).unwrap();
            let scale = output_scale(&want.out);
            for precision in precisions() {
                let config = DecodeConfig {
                    k_dtype: dtype,
                    v_dtype: dtype,
                    precision,
                };
                let got = decode_batch(ctx, &case.batch(), &shape, &opts, &config).unwrap();
                let err = max_abs_err(&got.out, &want.out);
                let lse_err = max_abs_err(&got.lse, &want.lse);
                let name = format!("hd{d} hq{hq} hkv{hkv} {dtype} {}", precision.name());
                let (bound, lse_bound) = bounds(precision, &case, (&k, &v), &opts, &want);
                assert!(err <= bound, "{name}: out error {err:e} > {bound:e}");
                assert!(
                    lse_err <= lse_bound,
                    "{name}: lse error {lse_err:e} > {lse_bound:e}"
                );
                worst.add(format!("{dtype}/{}", precision.name()), err / scale);
                cases += 1;
            }
        }
    }
    eprintln!("decode grid: {cases} cases; worst error / output scale: {worst:?}");
}

#[test]
fn decode_options_match_reference() {
    let ctx = gpu();
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 96,
    };
    let case = Case::new(shape, &[1, 5, 97, 300], 7);
    for (name, opts) in option_sets(8, 99) {
        let want = reference::attention(&case.batch(), &shape, &opts).unwrap();
        for precision in precisions() {
            let config = DecodeConfig {
                precision,
                ..Default::default()
            };
            let got = decode_batch(ctx, &case.batch(), &shape, &opts, &config).unwrap();
            let (bound, lse_bound) = bounds(precision, &case, (&case.k, &case.v), &opts, &want);
            let err = max_abs_err(&got.out, &want.out);
            let lse_err = max_abs_err(&got.lse, &want.lse);
            let name = format!("{name} {}", precision.name());
            assert!(err <= bound, "{name}: out error {err:e} > {bound:e}");
            assert!(
                lse_err <= lse_bound,
                "{name}: lse error {lse_err:e} > {lse_bound:e}"
            );
        }
    }
}

#[test]
fn decode_is_batch_invariant() {
    // A sequence's result must not depend on what else is in the batch.
    let ctx = gpu();
    let shape = AttentionShape {
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim_qk: 128,
        head_dim_v: 128,
    };
    let both = Case::new(shape, &[33, 200], 3);
    let got = decode_batch(
        ctx,
        &both.batch(),
        &shape,
        &AttentionOptions::default(),
        &DecodeConfig::default(),
    )
    .unwrap();
    let d = shape.head_dim_qk;
    let hkv = shape.num_kv_heads;
    let alone = RaggedBatch {
        q: &both.q[shape.num_q_heads * d..],
        k: &both.k[33 * hkv * d..],
        v: &both.v[33 * hkv * d..],
        cu_seqlens_q: &[0, 1],
        cu_seqlens_k: &[0, 200],
    };
    let single = decode_batch(
        ctx,
        &alone,
        &shape,
        &AttentionOptions::default(),
        &DecodeConfig::default(),
    )
    .unwrap();
    let half = got.out.len() / 2;
    assert_eq!(
        &got.out[half..],
        &single.out[..],
        "second sequence changed with its batch"
    );
}

#[test]
fn decode_rejects_bad_input_with_typed_errors() {
    let ctx = gpu();
    let shape = AttentionShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim_qk: 64,
        head_dim_v: 64,
    };
    let case = Case::new(shape, &[3, 4], 1);
    let opts = AttentionOptions::default();
    let cfg = DecodeConfig::default();
    // Two queries in one sequence.
    let cu_q = [0u32, 2, 2];
    let bad = RaggedBatch {
        cu_seqlens_q: &cu_q,
        ..case.batch()
    };
    assert!(decode_batch(ctx, &bad, &shape, &opts, &cfg).is_err());
    // Head dim not a multiple of 4.
    let odd = AttentionShape {
        head_dim_qk: 66,
        head_dim_v: 66,
        ..shape
    };
    let c2 = Case::new(odd, &[3, 4], 1);
    assert!(matches!(
        decode_batch(ctx, &c2.batch(), &odd, &opts, &cfg),
        Err(Error::UnsupportedHeadDim { .. })
    ));
    // The same for f16/bf16 K or V, and past the largest head dim.
    let wide = AttentionShape {
        head_dim_qk: 1028,
        head_dim_v: 1028,
        ..shape
    };
    let c4 = Case::new(wide, &[3, 4], 1);
    for (k_dtype, v_dtype) in [(KvDtype::F16, KvDtype::F32), (KvDtype::F32, KvDtype::Bf16)] {
        let config = DecodeConfig {
            k_dtype,
            v_dtype,
            ..cfg
        };
        for (c, s, d) in [(&c2, &odd, 66), (&c4, &wide, 1028)] {
            assert!(matches!(
                decode_batch(ctx, &c.batch(), s, &opts, &config),
                Err(Error::UnsupportedHeadDim { head_dim, .. }) if head_dim == d
            ));
        }
    }
    // Quantized formats are not read by this kernel.
    let int8 = DecodeConfig {
        k_dtype: KvDtype::Int8,
        ..cfg
    };
    assert!(matches!(
        decode_batch(ctx, &case.batch(), &shape, &opts, &int8),
        Err(Error::InvalidArgument(_))
    ));
    // Truncated K.
    let short = RaggedBatch {
        k: &case.k[1..],
        ..case.batch()
    };
    assert!(matches!(
        decode_batch(ctx, &short, &shape, &opts, &cfg),
        Err(Error::ShapeMismatch { .. })
    ));
    // The f16 variant on a device without it.
    if !ctx.caps().shader_f16 {
        let f16 = DecodeConfig {
            precision: Precision::F16,
            ..cfg
        };
        assert!(matches!(
            decode_batch(ctx, &case.batch(), &shape, &opts, &f16),
            Err(Error::MissingFeature(_))
        ));
    }
}

/// f16/bf16 head dims that are multiples of 4 but not of 8: rows of `d / 2` words, which a pool
/// pads to a multiple of 4 words (`KvDtype::row_stride`). (d_qk, d_v).
const PADDED_DIMS: [(usize, usize); 6] =
    [(4, 4), (12, 12), (20, 20), (36, 36), (100, 100), (12, 20)];

/// Storage pairs (K, V) with at least one padded side: both, K only, V only.
const PADDED_STORAGE: [(KvDtype, KvDtype); 4] = [
    (KvDtype::F16, KvDtype::F16),
    (KvDtype::Bf16, KvDtype::Bf16),
    (KvDtype::F16, KvDtype::F32),
    (KvDtype::F32, KvDtype::Bf16),
];

/// Odd key counts, one past a split of 512 keys.
const PADDED_CONTEXTS: [usize; 4] = [1, 17, 97, 513];

fn padded_shape(i: usize, (dk, dv): (usize, usize)) -> AttentionShape {
    let (hq, hkv) = [(8, 2), (6, 3), (4, 4)][i % 3];
    AttentionShape {
        num_q_heads: hq,
        num_kv_heads: hkv,
        head_dim_qk: dk,
        head_dim_v: dv,
    }
}

#[test]
fn decode_takes_head_dims_whose_rows_pools_pad() {
    // Before 16-byte row padding these worked with rows back to back; the contiguous decode now
    // re-lays them into a padded pool on the GPU and must still match the reference.
    let ctx = gpu();
    let (mut cases, mut worst) = (0, Worst::default());
    for (di, &dims) in PADDED_DIMS.iter().enumerate() {
        let shape = padded_shape(di, dims);
        let case = Case::new(shape, &PADDED_CONTEXTS, 5 + di as u64);
        let opts = AttentionOptions::default();
        for (ti, &(k_dtype, v_dtype)) in PADDED_STORAGE.iter().enumerate() {
            // All points on the first backend; on the second one storage pair per head dim, in
            // turn, so that every pair still runs there.
            if (di + ti) % grid_stride(ctx) != 0 {
                continue;
            }
            let (k, v) = (round_to(k_dtype, &case.k), round_to(v_dtype, &case.v));
            let batch = RaggedBatch {
                k: &k,
                v: &v,
                ..case.batch()
            };
            let want = reference::attention(&batch, &shape, &opts).unwrap();
            for precision in precisions() {
                let config = DecodeConfig {
                    k_dtype,
                    v_dtype,
                    precision,
                };
                let name = format!("{dims:?} {k_dtype}/{v_dtype} {}", precision.name());
                let got = decode_batch(ctx, &case.batch(), &shape, &opts, &config)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                let (bound, lse_bound) = bounds(precision, &case, (&k, &v), &opts, &want);
                let err = max_abs_err(&got.out, &want.out);
                let lse_err = max_abs_err(&got.lse, &want.lse);
                assert!(err <= bound, "{name}: out error {err:e} > {bound:e}");
                assert!(
                    lse_err <= lse_bound,
                    "{name}: lse error {lse_err:e} > {lse_bound:e}"
                );
                worst.add(
                    format!("{k_dtype}/{v_dtype}/{}", precision.name()),
                    err / output_scale(&want.out),
                );
                cases += 1;
            }
        }
    }
    assert!(cases > 0);
    eprintln!("padded-row decode: {cases} cases; worst error / output scale: {worst:?}");
}

/// `case`'s rows appended to a one-layer paged cache of `block_size` slots in `k_dtype` /
/// `v_dtype`, one sequence per decode query, then paged attention over it.
fn pool_run(
    case: &Case,
    (k_dtype, v_dtype): (KvDtype, KvDtype),
    block_size: usize,
) -> reference::AttentionOutput {
    let ctx = gpu();
    let s = &case.shape;
    let cfg = PagedKvConfig {
        head_dim_v: s.head_dim_v,
        block_size,
        prefix_caching: false,
        k_dtype,
        v_dtype,
        ..PagedKvConfig::new(1, s.num_kv_heads, s.head_dim_qk, KvDtype::F32)
    };
    let total_k = *case.cu_k.last().unwrap() as usize;
    let blocks = total_k.div_ceil(block_size) + case.cu_k.len();
    let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(blocks)).unwrap();
    let (kr, vr) = (
        s.num_kv_heads * s.head_dim_qk,
        s.num_kv_heads * s.head_dim_v,
    );
    let mut queries = Vec::new();
    for (i, w) in case.cu_k.windows(2).enumerate() {
        let (a, b) = (w[0] as usize, w[1] as usize);
        cache.add_sequence(i as u64, &[]).unwrap();
        cache
            .append_host(
                ctx,
                i as u64,
                &vec![0; b - a],
                &[case.k[a * kr..b * kr].to_vec()],
                &[case.v[a * vr..b * vr].to_vec()],
            )
            .unwrap();
        queries.push(PagedQuery {
            seq: i as u64,
            len_q: 1,
        });
    }
    let opts = AttentionOptions::default();
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &queries,
        shape: *s,
        options: &opts,
        precision: Precision::F32,
    };
    paged_attention_host(ctx, &cache, &args, &case.q).unwrap()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn decode_of_padded_rows_gives_the_bits_of_a_pool() {
    // The temporary pool holds exactly what a paged cache holds for the same rows (padding
    // words 0), so the contiguous decode and paged attention over a cache give the same bits.
    let ctx = gpu();
    for (di, &dims) in PADDED_DIMS.iter().enumerate().skip(1) {
        let shape = padded_shape(di, dims);
        let case = Case::new(shape, &PADDED_CONTEXTS, 40 + di as u64);
        let storage = PADDED_STORAGE[di % PADDED_STORAGE.len()];
        let config = DecodeConfig {
            k_dtype: storage.0,
            v_dtype: storage.1,
            precision: Precision::F32,
        };
        let got = decode_batch(
            ctx,
            &case.batch(),
            &shape,
            &AttentionOptions::default(),
            &config,
        )
        .unwrap();
        let want = pool_run(&case, storage, 16);
        let name = format!("{dims:?} {}/{}", storage.0, storage.1);
        assert_eq!(bits(&got.out), bits(&want.out), "{name}: out");
        assert_eq!(bits(&got.lse), bits(&want.lse), "{name}: lse");
    }
}

#[test]
fn decode_of_padded_rows_refuses_bad_buffers_before_writing() {
    // Errors on the path that copies K/V into a padded pool come before anything is recorded:
    // nothing is submitted and out/lse keep their sentinel. (A context of its own, so that the
    // submission count sees no other test's work.)
    let ctx = &own_context(None);
    let shape = padded_shape(1, (12, 12));
    let case = Case::new(shape, &[3, 5], 2);
    let upload = |dtype, d, x: &[f32]| {
        let words = encode_rows(dtype, d, x, ScaleMode::PerRow).unwrap().words;
        ctx.upload("kv", &words).unwrap()
    };
    let q = ctx.upload("q", &case.q).unwrap();
    let k = upload(KvDtype::F16, 12, &case.k);
    let v = upload(KvDtype::Bf16, 12, &case.v);
    let short = upload(KvDtype::F16, 12, &case.k[..case.k.len() - 12 * 4]);
    let rows = 2 * shape.num_q_heads;
    let out = ctx.filled("out", rows * 12, UNWRITTEN).unwrap();
    let lse = ctx.filled("lse", rows, UNWRITTEN).unwrap();
    let opts = AttentionOptions::default();
    let args = DecodeArgs {
        shape,
        options: &opts,
        precision: Precision::F32,
        q: &q,
        k: &k,
        v: &v,
        k_dtype: KvDtype::F16,
        v_dtype: KvDtype::Bf16,
        cu_seqlens_k: &case.cu_k,
        out: &out,
        lse: &lse,
    };
    let before = ctx.counters();
    let refused = [
        ("short k", DecodeArgs { k: &short, ..args }),
        ("out is lse", DecodeArgs { lse: &out, ..args }),
        (
            "cu_seqlens_k",
            DecodeArgs {
                cu_seqlens_k: &[0, 3, 3],
                ..args
            },
        ),
    ];
    for (name, bad) in &refused {
        let err = decode(ctx, bad).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{name}: {err}");
    }
    assert_eq!(ctx.counters().since(&before).submissions, 0);
    let o: Vec<f32> = ctx.read_back(&out, rows * 12).unwrap();
    let l: Vec<f32> = ctx.read_back(&lse, rows).unwrap();
    assert!(
        o.iter().chain(&l).all(|&x| is_unwritten(x)),
        "partial writes"
    );
    // The same buffers, well formed, give decode_batch's bits.
    decode(ctx, &args).unwrap();
    let config = DecodeConfig {
        k_dtype: KvDtype::F16,
        v_dtype: KvDtype::Bf16,
        precision: Precision::F32,
    };
    let want = decode_batch(ctx, &case.batch(), &shape, &opts, &config).unwrap();
    assert_eq!(
        bits(&ctx.read_back(&out, rows * 12).unwrap()),
        bits(&want.out)
    );
    assert_eq!(bits(&ctx.read_back(&lse, rows).unwrap()), bits(&want.lse));
}
