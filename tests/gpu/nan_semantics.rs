//! NaN, infinities and extreme values through every attention kernel, every KV format, split-K,
//! the merges and MLA (README, "NaN, infinities and extreme values"): the GPU gives what the CPU
//! reference gives on the values the cache stores, NaN where it is NaN and finite where it is
//! finite, and never leaves an output unwritten.
//!
//! Before these rules a NaN query row came out as zeros with lse -inf, a NaN key was dropped
//! silently and an f16 key that overflowed to infinity too; each case below failed then.

use std::sync::OnceLock;

use kvattn::attention::merge_states::{merge_states, AttentionState};
use kvattn::attention::paged::{PagedAttentionArgs, PagedAttentionPlan, PagedQuery};
use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::scales::CacheScales;
use kvattn::gpu::{is_unwritten, AttentionKernel, Context, ContextOptions, UNWRITTEN};
use kvattn::mla::{mla_host, MlaArgs, MlaCache, MlaCacheConfig, MlaPath, MlaWeights};
use kvattn::quant::{decode_rows, encode_rows, KvDtype, ScaleMode};
use kvattn::reference::mla::{mla, MlaBatch, MlaShape};
use kvattn::reference::{self, AttentionOutput};
use kvattn::shader::Precision;

use crate::common::{gpu, gpu_narrow, grid_stride, Rng};

/// A context whose plans run the lanes kernel (the CPU adapters' default).
fn gpu_lanes() -> &'static Context {
    static CTX: OnceLock<Context> = OnceLock::new();
    CTX.get_or_init(|| {
        Context::with_options(&ContextOptions {
            attention_kernel: Some(AttentionKernel::Lanes),
            ..Default::default()
        })
        .expect("a wgpu adapter")
    })
}

/// Both attention kernels, the workgroup kernel in both its workgroup forms.
fn kernels() -> [(&'static str, &'static Context); 3] {
    [
        ("workgroup", gpu()),
        ("lanes", gpu_lanes()),
        ("workgroup, narrow", gpu_narrow()),
    ]
}

/// Checks `got` against `want` element by element: no sentinel left; NaN exactly where the
/// reference is NaN; infinities equal; finite values within `tol` times the output scale.
#[track_caller]
fn check_nan_aware(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want
        .iter()
        .filter(|x| x.is_finite())
        .fold(1.0f64, |m, x| m.max(f64::from(x.abs())));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(!is_unwritten(g), "{what}: element {i} never written");
        if w.is_nan() {
            assert!(g.is_nan(), "{what}: element {i} is {g}, the reference NaN");
        } else if w.is_infinite() {
            assert_eq!(g, w, "{what}: element {i}");
        } else {
            assert!(
                g.is_finite(),
                "{what}: element {i} is {g}, the reference {w}"
            );
            let err = (f64::from(g) - f64::from(w)).abs();
            assert!(err <= tol * scale, "{what}: element {i}: {g} vs {w}");
        }
    }
}

const SHAPE: AttentionShape = AttentionShape {
    num_q_heads: 4,
    num_kv_heads: 2,
    head_dim_qk: 32,
    head_dim_v: 32,
};

/// Two sequences: a chunk of 5 queries over 37 keys (positions 32..=36) and a decode step over
/// 20 keys. K/V `[total_k, Hkv, d]` and queries `[total_q, Hq, d]`, Gaussian.
struct Batch {
    lens: [(usize, usize); 2],
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
}

impl Batch {
    fn new(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let lens = [(37, 5), (20, 1)];
        let tk: usize = lens.iter().map(|l| l.0).sum();
        let tq: usize = lens.iter().map(|l| l.1).sum();
        let (hkv, hq, d) = (SHAPE.num_kv_heads, SHAPE.num_q_heads, SHAPE.head_dim_qk);
        Self {
            lens,
            k: rng.normals(tk * hkv * d, 1.0),
            v: rng.normals(tk * hkv * d, 1.0),
            q: rng.normals(tq * hq * d, 1.0),
        }
    }

    /// Index of element `c` of key `j` of sequence 0, KV head `h`, in `k` or `v`.
    fn kv_at(j: usize, h: usize, c: usize) -> usize {
        (j * SHAPE.num_kv_heads + h) * SHAPE.head_dim_qk + c
    }

    /// The reference on K/V as a cache of `k_mode`/`v_mode` stores them (CPU codec round trip).
    fn reference(
        &self,
        dtype: KvDtype,
        mode: ScaleMode,
        opts: &AttentionOptions,
    ) -> AttentionOutput {
        let d = SHAPE.head_dim_qk;
        let stored = |x: &[f32]| decode_rows(&encode_rows(dtype, d, x, mode).unwrap()).unwrap();
        let (k, v) = (stored(&self.k), stored(&self.v));
        let cu_q = [0, 5, 6];
        let cu_k = [0, 37, 57];
        let batch = RaggedBatch {
            q: &self.q,
            k: &k,
            v: &v,
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
        };
        reference::attention(&batch, &SHAPE, opts).unwrap()
    }

    /// The batch on the GPU through a cache of `dtype` (block size 8), split-K every `split`
    /// keys.
    fn run(
        &self,
        ctx: &Context,
        (dtype, mode): (KvDtype, ScaleMode),
        opts: &AttentionOptions,
        precision: Precision,
        split: usize,
    ) -> AttentionOutput {
        let scales = match mode {
            ScaleMode::PerTensor(x) => CacheScales::PerTensor(vec![x]),
            ScaleMode::PerRow => CacheScales::PerRow,
        };
        let cfg = PagedKvConfig {
            block_size: 8,
            prefix_caching: false,
            k_scales: scales.clone(),
            v_scales: scales,
            ..PagedKvConfig::new(1, SHAPE.num_kv_heads, SHAPE.head_dim_qk, dtype)
        };
        let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(16)).unwrap();
        let row = SHAPE.num_kv_heads * SHAPE.head_dim_qk;
        let mut start = 0;
        for (i, &(lk, _)) in self.lens.iter().enumerate() {
            cache.add_sequence(i as u64, &[]).unwrap();
            let (a, b) = (start * row, (start + lk) * row);
            cache
                .append_host(
                    ctx,
                    i as u64,
                    &vec![0; lk],
                    &[self.k[a..b].to_vec()],
                    &[self.v[a..b].to_vec()],
                )
                .unwrap();
            start += lk;
        }
        let queries = [
            PagedQuery { seq: 0, len_q: 5 },
            PagedQuery { seq: 1, len_q: 1 },
        ];
        let args = PagedAttentionArgs {
            layer: 0,
            batch: &queries,
            shape: SHAPE,
            options: opts,
            precision,
        };
        let plan = PagedAttentionPlan::with_split_tokens(ctx, &cache, &args, split).unwrap();
        let rows = 6 * SHAPE.num_q_heads;
        let q = ctx.upload("q", &self.q).unwrap();
        let out = ctx
            .filled("out", rows * SHAPE.head_dim_v, UNWRITTEN)
            .unwrap();
        let lse = ctx.filled("lse", rows, UNWRITTEN).unwrap();
        plan.run(ctx, &cache, 0, &q, &out, &lse).unwrap();
        AttentionOutput {
            out: ctx.read_back(&out, rows * SHAPE.head_dim_v).unwrap(),
            lse: ctx.read_back(&lse, rows).unwrap(),
        }
    }
}

/// Every format, FP8 with per-row and per-tensor scales.
fn formats() -> Vec<(KvDtype, ScaleMode)> {
    let mut f: Vec<_> = KvDtype::ALL
        .iter()
        .map(|&d| (d, ScaleMode::PerRow))
        .collect();
    f.push((KvDtype::Fp8E4M3, ScaleMode::PerTensor(0.25)));
    f.push((KvDtype::Fp8E5M2, ScaleMode::PerTensor(0.25)));
    f
}

/// The kernel precisions to run: f16 only where the adapter has it and the case's values stay
/// within f16's range (the f16 kernels round queries and keys to f16, where 1e5 is infinity).
fn precisions(ctx: &Context, f16: bool) -> Vec<Precision> {
    if f16 && ctx.caps().shader_f16 {
        vec![Precision::F32, Precision::F16]
    } else {
        vec![Precision::F32]
    }
}

/// What a case runs on besides the f32 kernels over unscaled formats.
#[derive(Clone, Copy)]
struct Scope {
    /// The f16 kernels (values within f16's range).
    f16: bool,
    /// Formats with scales (FP8, int8, int4). Their kernels apply a key's scale after the dot
    /// product of the query with the key's codes, so only a query whose products with raw
    /// codes stay finite gives the reference's result (README).
    scaled: bool,
}

const EVERYWHERE: Scope = Scope {
    f16: true,
    scaled: true,
};

/// Runs `b` with `opts` on both kernels, every format and precision (as `scope` allows),
/// splits of 16 keys and of one split per sequence, and checks it against the reference.
/// Returns how many output values the reference made NaN (in the f32 format), so each case can
/// say what it exercised.
fn check_everywhere(name: &str, b: &Batch, opts: &AttentionOptions, scope: Scope) -> usize {
    let mut nans = 0;
    for (ki, (kernel, ctx)) in kernels().into_iter().enumerate() {
        let formats = formats()
            .into_iter()
            .filter(|f| scope.scaled || matches!(f.0, KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16));
        for (fi, format) in formats.enumerate() {
            let want = b.reference(format.0, format.1, opts);
            if format.0 == KvDtype::F32 {
                nans = want.out.iter().filter(|x| x.is_nan()).count();
            }
            for (pi, precision) in precisions(ctx, scope.f16).into_iter().enumerate() {
                for (si, split) in [16, 1 << 20].into_iter().enumerate() {
                    // One run in `grid_stride` on the second backend (every format among
                    // them, each kernel and split in turn); all of them on the first.
                    if (fi + 2 * ki + si + pi) % grid_stride(ctx) != 0 {
                        continue;
                    }
                    let got = b.run(ctx, format, opts, precision, split);
                    let what = format!("{name}: {kernel} {format:?} {precision:?} split {split}");
                    // f16 kernels round queries, keys, values and probabilities to f16: check
                    // where the NaNs are, and the values of the f32 kernels.
                    let tol = if precision == Precision::F32 {
                        2e-4
                    } else {
                        1e30
                    };
                    check_nan_aware(&format!("{what} out"), &got.out, &want.out, tol);
                    check_nan_aware(&format!("{what} lse"), &got.lse, &want.lse, tol);
                }
            }
        }
    }
    nans
}

/// Output row (query token `t`, head `h`) of the batch: its `d_v` values.
fn out_row(o: &[f32], t: usize, h: usize) -> &[f32] {
    let d = SHAPE.head_dim_v;
    &o[(t * SHAPE.num_q_heads + h) * d..][..d]
}

#[test]
fn nan_query_makes_its_row_nan_and_nothing_else() {
    let mut b = Batch::new(1);
    // Query token 2 of sequence 0 (position 34), head 3.
    b.q[(2 * SHAPE.num_q_heads + 3) * SHAPE.head_dim_qk + 7] = f32::NAN;
    let opts = AttentionOptions::default();
    assert_eq!(
        check_everywhere("nan q", &b, &opts, EVERYWHERE),
        SHAPE.head_dim_v
    );
    let want = b.reference(KvDtype::F32, ScaleMode::PerRow, &opts);
    assert!(out_row(&want.out, 2, 3).iter().all(|x| x.is_nan()));
    assert!(want.lse[2 * 4 + 3].is_nan());
}

#[test]
fn nan_key_poisons_the_rows_that_see_it_and_only_them() {
    let mut b = Batch::new(2);
    // Key 33 of sequence 0, KV head 0 (query heads 0 and 1): queries at positions 33..=36
    // (tokens 1..=4) see it, the one at 32 (token 0) does not; with a window of 2 only 33 and
    // 34 do.
    b.k[Batch::kv_at(33, 0, 5)] = f32::NAN;
    let causal = AttentionOptions::default();
    assert_eq!(
        check_everywhere("nan k", &b, &causal, EVERYWHERE),
        4 * 2 * 32
    );
    let want = b.reference(KvDtype::F32, ScaleMode::PerRow, &causal);
    assert!(out_row(&want.out, 0, 0).iter().all(|x| x.is_finite()));
    assert!(out_row(&want.out, 1, 1).iter().all(|x| x.is_nan()));
    assert!(out_row(&want.out, 1, 2).iter().all(|x| x.is_finite()));
    let window = AttentionOptions {
        sliding_window: Some(2),
        ..Default::default()
    };
    assert_eq!(
        check_everywhere("nan k window", &b, &window, EVERYWHERE),
        2 * 2 * 32
    );
    // Softcap: tanh would turn a NaN score into a plausible number.
    let softcap = AttentionOptions {
        softcap: Some(5.0),
        sinks: Some(vec![0.5, -1.0, 2.0, 0.0]),
        ..Default::default()
    };
    assert_eq!(
        check_everywhere("nan k softcap sinks", &b, &softcap, EVERYWHERE),
        4 * 2 * 32
    );
}

#[test]
fn nan_value_reaches_only_its_column_of_the_rows_that_see_it() {
    let mut b = Batch::new(3);
    // Key 33's value (KV head 1): tokens 1..=4 see it. Key 36's (KV head 0) is infinite:
    // only token 4 (position 36) sees it; for the others the causal mask gives it weight 0,
    // so it never reaches them.
    b.v[Batch::kv_at(33, 1, 9)] = f32::NAN;
    b.v[Batch::kv_at(36, 0, 4)] = f32::INFINITY;
    let opts = AttentionOptions::default();
    let nans = check_everywhere("nan v", &b, &opts, EVERYWHERE);
    let want = b.reference(KvDtype::F32, ScaleMode::PerRow, &opts);
    // Heads 2 and 3 of tokens 1..=4: column 9 only.
    assert_eq!(nans, 4 * 2);
    assert!(out_row(&want.out, 0, 2)[9].is_finite());
    assert!(out_row(&want.out, 1, 2)[9].is_nan() && out_row(&want.out, 1, 2)[8].is_finite());
    // The infinite value reaches column 4 of token 4 (heads 0, 1) only, as infinity.
    assert_eq!(out_row(&want.out, 4, 0)[4].abs(), f32::INFINITY);
    assert!(out_row(&want.out, 3, 0)[4].is_finite());
}

#[test]
fn infinite_and_overflowing_keys_follow_ieee() {
    let mut b = Batch::new(4);
    // An infinite key element: the score is +inf for queries whose element 5 is positive
    // (their rows NaN), -inf for the others (the key gets weight 0). 1e5 overflows f16 and
    // bf16 keeps it; f16 storage then holds infinity.
    b.k[Batch::kv_at(30, 1, 5)] = f32::INFINITY;
    b.k[Batch::kv_at(10, 0, 6)] = 1.0e5;
    let opts = AttentionOptions::default();
    let nans = check_everywhere(
        "inf k",
        &b,
        &opts,
        Scope {
            f16: false,
            scaled: true,
        },
    );
    assert!(nans > 0, "some query saw +inf");
    let want = b.reference(KvDtype::F32, ScaleMode::PerRow, &opts);
    // Key 30 (KV head 1) is seen by all five queries of sequence 0 in heads 2 and 3: the sign
    // of each query's element 5 decides between a NaN row (+inf score) and a finite one (the
    // key dropped at -inf). Both outcomes occur in this data.
    let rows: Vec<bool> = (0..5)
        .flat_map(|t| [2, 3].map(|h| out_row(&want.out, t, h).iter().all(|x| x.is_nan())))
        .collect();
    assert!(rows.contains(&true) && rows.contains(&false), "{rows:?}");
    // Extreme finite queries, one nonzero element each: token 0 head 0 scores of about 1e36
    // (finite; the softmax picks one key), token 1 head 0 products of 3e38 times a key element,
    // which overflow f32 to +inf (the row NaN) or -inf (weight 0) where the element exceeds
    // about 1.13 in magnitude.
    let mut b = Batch::new(5);
    let d = SHAPE.head_dim_qk;
    let hq = SHAPE.num_q_heads;
    for (t, big) in [(0, 1.0e37f32), (1, 3.0e38)] {
        let q = &mut b.q[t * hq * d..][..d];
        q.fill(0.0);
        q[0] = big;
    }
    check_everywhere(
        "extreme q",
        &b,
        &opts,
        Scope {
            f16: false,
            scaled: false,
        },
    );
}

#[test]
fn sliding_window_beyond_u32_is_no_window() {
    // Windows at and past 2^32 once wrapped `j + window` in the kernels (outputs off by up to
    // 3.3); a window at least as long as the keys is no window at all.
    let b = Batch::new(6);
    let plain = b.run(
        gpu(),
        (KvDtype::F32, ScaleMode::PerRow),
        &AttentionOptions::default(),
        Precision::F32,
        16,
    );
    for w in [
        37,
        38,
        4_294_967_260,
        u32::MAX as usize,
        1 << 32,
        1 << 63,
        usize::MAX,
    ] {
        let opts = AttentionOptions {
            sliding_window: Some(w),
            ..Default::default()
        };
        let want = b.reference(KvDtype::F32, ScaleMode::PerRow, &opts);
        for (kernel, ctx) in kernels() {
            let got = b.run(
                ctx,
                (KvDtype::F32, ScaleMode::PerRow),
                &opts,
                Precision::F32,
                16,
            );
            check_nan_aware(&format!("window {w} {kernel}"), &got.out, &want.out, 2e-4);
            check_nan_aware(&format!("window {w} {kernel}"), &got.lse, &want.lse, 2e-4);
            if kernel == "workgroup" {
                assert_eq!(got.out, plain.out, "window {w} changed the result");
            }
        }
    }
    // Just inside the context it still masks: 36 keys of 37 drop key 0 for the last query.
    let opts = AttentionOptions {
        sliding_window: Some(36),
        ..Default::default()
    };
    let got = b.run(
        gpu(),
        (KvDtype::F32, ScaleMode::PerRow),
        &opts,
        Precision::F32,
        16,
    );
    assert_ne!(got.out, plain.out);
    check_nan_aware(
        "window 36",
        &got.out,
        &b.reference(KvDtype::F32, ScaleMode::PerRow, &opts).out,
        2e-4,
    );
}

#[test]
fn merge_states_propagates_nan_and_ignores_empty_states() {
    let ctx = gpu();
    let (rows, d) = (4, 8);
    // Row 0: both finite. Row 1: a's lse NaN. Row 2: b empty (lse -inf, o NaN: never read).
    // Row 3: both empty.
    let o_a: Vec<f32> = (0..rows * d).map(|i| i as f32 * 0.1).collect();
    let mut o_b: Vec<f32> = (0..rows * d).map(|i| 1.0 - i as f32 * 0.05).collect();
    o_b[2 * d..3 * d].fill(f32::NAN);
    let lse_a = [0.5, f32::NAN, 1.0, f32::NEG_INFINITY];
    let lse_b = [-0.25, 2.0, f32::NEG_INFINITY, f32::NEG_INFINITY];
    let up = |x: &[f32]| ctx.upload("state", x).unwrap();
    let (oa, la, ob, lb) = (up(&o_a), up(&lse_a), up(&o_b), up(&lse_b));
    let oo = ctx.filled("o", rows * d, UNWRITTEN).unwrap();
    let lo = ctx.filled("lse", rows, UNWRITTEN).unwrap();
    merge_states(
        ctx,
        rows,
        d,
        AttentionState { o: &oa, lse: &la },
        AttentionState { o: &ob, lse: &lb },
        AttentionState { o: &oo, lse: &lo },
    )
    .unwrap();
    let o: Vec<f32> = ctx.read_back(&oo, rows * d).unwrap();
    let l: Vec<f32> = ctx.read_back(&lo, rows).unwrap();
    let (wa, wb) = (0.5f64.exp(), (-0.25f64).exp());
    for c in 0..d {
        let want = (wa * f64::from(o_a[c]) + wb * f64::from(o_b[c])) / (wa + wb);
        assert!((f64::from(o[c]) - want).abs() < 1e-5, "row 0 col {c}");
        assert!(o[d + c].is_nan(), "row 1 col {c}");
        assert_eq!(o[2 * d + c], o_a[2 * d + c], "row 2 col {c}");
        assert_eq!(o[3 * d + c], 0.0, "row 3 col {c}");
    }
    assert!((f64::from(l[0]) - (wa + wb).ln()).abs() < 1e-5);
    assert!(l[1].is_nan());
    assert_eq!(l[2], 1.0);
    assert_eq!(l[3], f32::NEG_INFINITY);
}

#[test]
fn mla_both_paths_follow_the_rules() {
    let shape = MlaShape {
        num_heads: 3,
        d_nope: 8,
        d_rope: 4,
        rank: 32,
        d_v: 8,
    };
    let s = shape;
    let mut rng = Rng::new(9);
    // One sequence: 3 queries over 11 keys (positions 8..=10).
    let (lq, lk) = (3, 11);
    let mut c_kv = rng.normals(lk * s.rank, 1.0);
    let k_pe = rng.normals(lk * s.d_rope, 1.0);
    let mut q_nope = rng.normals(lq * s.num_heads * s.d_nope, 1.0);
    let q_pe = rng.normals(lq * s.num_heads * s.d_rope, 1.0);
    let w_uk = rng.normals(s.num_heads * s.d_nope * s.rank, 0.3);
    let w_uv = rng.normals(s.num_heads * s.rank * s.d_v, 0.2);
    // Query token 0, head 1: NaN. Key 9's latent: NaN (seen by tokens 1 and 2 only).
    q_nope[s.d_nope + 3] = f32::NAN;
    c_kv[9 * s.rank + 17] = f32::NAN;
    for latent in [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Fp8E4M3,
        KvDtype::Int8,
        KvDtype::Int4,
    ] {
        for (kernel, ctx) in kernels() {
            let mut config = MlaCacheConfig::new(1, s.rank, s.d_rope, latent);
            config.block_size = 4;
            let mut cache = MlaCache::new(ctx, config, PoolSize::Blocks(8)).unwrap();
            cache.cache_mut().add_sequence(0, &[]).unwrap();
            cache
                .append_host(
                    ctx,
                    0,
                    &vec![0; lk],
                    std::slice::from_ref(&c_kv),
                    std::slice::from_ref(&k_pe),
                )
                .unwrap();
            let (c, p) = cache.cache().read_rows(ctx, 0, 0).unwrap();
            let (c, p) = (decode_rows(&c).unwrap(), decode_rows(&p).unwrap());
            let batch = MlaBatch {
                q_nope: &q_nope,
                q_pe: &q_pe,
                c_kv: &c,
                k_pe: &p,
                w_uk: &w_uk,
                w_uv: &w_uv,
                cu_seqlens_q: &[0, lq as u32],
                cu_seqlens_k: &[0, lk as u32],
            };
            let want = mla(&batch, &shape, None).unwrap();
            let weights = MlaWeights::upload(ctx, &shape, &w_uk, &w_uv).unwrap();
            for path in [MlaPath::Absorbed, MlaPath::UpProj] {
                let queries = [PagedQuery { seq: 0, len_q: lq }];
                let args = MlaArgs {
                    layer: 0,
                    batch: &queries,
                    shape,
                    scale: None,
                    precision: Precision::F32,
                    path,
                    up_proj_chunk: Some(5),
                };
                let got = mla_host(ctx, &cache, &weights, &args, &q_nope, &q_pe).unwrap();
                let what = format!("mla {latent} {kernel} {path:?}");
                check_nan_aware(&format!("{what} out"), &got.out, &want.out, 2e-4);
                check_nan_aware(&format!("{what} lse"), &got.lse, &want.lse, 2e-4);
            }
            // Token 0 head 1 NaN; token 0 other heads finite; tokens 1, 2 NaN (key 9).
            let row = |t: usize, h: usize| &want.out[(t * s.num_heads + h) * s.d_v..][..s.d_v];
            assert!(row(0, 1).iter().all(|x| x.is_nan()), "{latent}");
            assert!(row(0, 0).iter().all(|x| x.is_finite()), "{latent}");
            assert!(row(2, 2).iter().all(|x| x.is_nan()), "{latent}");
        }
    }
}
