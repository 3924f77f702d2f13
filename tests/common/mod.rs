//! Shared by the integration tests: the adapter, a deterministic PRNG, error measures.
#![allow(dead_code)]

use std::sync::OnceLock;

use kvattn::attention::AttentionOptions;
use kvattn::gpu::Context;

/// The context every GPU test in a binary shares. With no adapter the test fails (never
/// skips) with a message that says how to get one. Its workgroup attention kernel is laid out
/// as on a GPU (wide workgroups, `ContextOptions::narrow_workgroups` off) on every adapter: the
/// tests check what GPUs run; a CPU adapter's narrow workgroups have tests of their own.
pub fn gpu() -> &'static Context {
    static CTX: OnceLock<Context> = OnceLock::new();
    CTX.get_or_init(|| {
        let ctx = Context::with_options(&test_context_options())
            .unwrap_or_else(|e| panic!("GPU tests need a wgpu adapter and none was usable: {e}"));
        eprintln!(
            "kvattn tests on adapter: {} ({}, {}), features [{}]",
            ctx.adapter().name,
            ctx.adapter().backend,
            ctx.adapter().device_type,
            ctx.caps().feature_names().join(", ")
        );
        ctx
    })
}

/// The options of the shared test context ([`gpu`]): the test attention kernel
/// ([`test_attention_kernel`]) in wide workgroups. A test that compares another context's bits
/// with the shared one's makes it with these.
pub fn test_context_options() -> kvattn::gpu::ContextOptions {
    kvattn::gpu::ContextOptions {
        attention_kernel: test_attention_kernel(),
        narrow_workgroups: Some(false),
        ..Default::default()
    }
}

/// A context in narrow workgroups (`ContextOptions::narrow_workgroups`, a CPU adapter's
/// default; [`gpu`] takes a GPU's wide ones everywhere) whose plans run the workgroup attention
/// kernel: its one-group workgroups, and the decoder's RMSNorm in 8 invocations a row.
pub fn gpu_narrow() -> &'static Context {
    static CTX: OnceLock<Context> = OnceLock::new();
    CTX.get_or_init(|| {
        Context::with_options(&kvattn::gpu::ContextOptions {
            attention_kernel: Some(kvattn::gpu::AttentionKernel::Workgroup),
            narrow_workgroups: Some(true),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("GPU tests need a wgpu adapter and none was usable: {e}"))
    })
}

/// xorshift64*: deterministic, dependency-free test data.
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed (any value).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    /// `n` normal values times `scale`.
    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// Largest absolute difference; NaN anywhere (a missing write) counts as infinite.
pub fn max_abs_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_nan() || w.is_nan() {
                f64::INFINITY
            } else if g == w {
                0.0
            } else {
                (f64::from(g) - f64::from(w)).abs()
            }
        })
        .fold(0.0, f64::max)
}

/// Largest absolute value, at least 1 (the output scale the tolerances are relative to).
pub fn output_scale(x: &[f32]) -> f64 {
    x.iter().map(|v| f64::from(v.abs())).fold(1.0, f64::max)
}

/// The attention kernel of the shared test contexts: `KVATTN_ATTENTION_KERNEL` when set, else
/// the workgroup kernel. The lanes kernel (the default on CPU adapters) is written out per
/// shape and takes lavapipe's compiler seconds per shape, too long for every point of the
/// grids on two cores; tests/gpu/paged_attention.rs and tests/gpu/mla.rs check it on shapes,
/// formats and options of their own. `KVATTN_ATTENTION_KERNEL=lanes cargo test` runs the whole
/// suite on it.
pub fn test_attention_kernel() -> Option<kvattn::gpu::AttentionKernel> {
    match std::env::var("KVATTN_ATTENTION_KERNEL") {
        Ok(name) => Some(
            name.parse()
                .expect("KVATTN_ATTENTION_KERNEL: workgroup or lanes"),
        ),
        Err(_) => Some(kvattn::gpu::AttentionKernel::Workgroup),
    }
}

/// Whether `ctx` runs on GL (llvmpipe in CI), where the suites sample their big grids and
/// build pipelines before racing threads (see `grid_stride` and `tests/gpu/threads.rs`).
pub fn is_gl(ctx: &Context) -> bool {
    ctx.adapter().backend == "gl"
}

/// One point in how many of the big GPU grids a test runs on `ctx`: all on Vulkan, one in four
/// on GL (llvmpipe, the second backend in CI, where compiling each new written-out variant takes
/// seconds and the workgroup attention kernel takes the portable sums with a barrier per step).
/// Every point still runs on the first backend; each grid picks its points so that every format
/// and kernel still occurs on the second.
pub fn grid_stride(ctx: &Context) -> usize {
    if is_gl(ctx) {
        4
    } else {
        1
    }
}

/// Whether the point at `at` of a grid whose axes have `lens` values runs on `ctx`: every point
/// on Vulkan; on GL (see `grid_stride`) only the points of one diagonal, those whose index on
/// every axis a is i % lens[a] for one i below the longest axis's length. That is the fewest
/// points that still run every value of every axis (each head dim, head layout and format) on
/// the second backend; a grid whose compiled variants dominate its time samples with this
/// rather than with `grid_stride`.
pub fn on_diagonal(ctx: &Context, at: &[usize], lens: &[usize]) -> bool {
    assert_eq!(at.len(), lens.len(), "one index an axis");
    if !is_gl(ctx) {
        return true;
    }
    let n = lens.iter().copied().max().unwrap_or(0);
    (0..n).any(|i| at.iter().zip(lens).all(|(&a, &len)| a == i % len))
}

/// A second context on the same adapter whose storage bindings are capped at 64 KiB, so every
/// pool splits over several buffers and the split path runs in every test that uses it.
pub fn gpu_capped() -> &'static Context {
    static CTX: OnceLock<Context> = OnceLock::new();
    CTX.get_or_init(|| own_context(Some(64 << 10)))
}

/// A context of the test's own, so that its counters and errors see only that test's work;
/// `cap` caps the storage bindings pools are planned with (pools then split over buffers).
pub fn own_context(cap: Option<u64>) -> Context {
    Context::with_options(&kvattn::gpu::ContextOptions {
        max_storage_binding_cap: cap,
        ..test_context_options()
    })
    .unwrap_or_else(|e| panic!("GPU tests need a wgpu adapter and none was usable: {e}"))
}

/// Every block of every pool of `cache`, K then V per layer.
pub fn pool_words(ctx: &Context, cache: &kvattn::cache::paged::PagedKvCache) -> Vec<Vec<u32>> {
    let blocks: Vec<u32> = (0..cache.allocator().num_blocks() as u32).collect();
    (0..cache.config().layers)
        .flat_map(|l| {
            let pools = cache.layer(l).unwrap();
            [
                pools.k.read_blocks(ctx, &blocks).unwrap(),
                pools.v.read_blocks(ctx, &blocks).unwrap(),
            ]
        })
        .collect()
}

/// The attention options every kernel is checked with (ARCHITECTURE.md section 2), for `hq` query
/// heads: windows of 1 and 37 keys, softcap with an explicit scale, ALiBi, sinks, non-causal
/// with and without ALiBi, and everything at once.
pub fn option_sets(hq: usize, seed: u64) -> Vec<(&'static str, AttentionOptions)> {
    let mut rng = Rng::new(seed);
    let with = |f: &dyn Fn(&mut AttentionOptions)| {
        let mut o = AttentionOptions::default();
        f(&mut o);
        o
    };
    let slopes: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
    let sinks = rng.normals(hq, 2.0);
    let mixed_slopes: Vec<f32> = rng.normals(hq, 0.05).iter().map(|x| x.abs()).collect();
    let mixed_sinks = rng.normals(hq, 1.0);
    vec![
        ("window 1", with(&|o| o.sliding_window = Some(1))),
        ("window 37", with(&|o| o.sliding_window = Some(37))),
        (
            "softcap",
            with(&|o| {
                o.softcap = Some(3.0);
                o.scale = Some(0.4);
            }),
        ),
        ("alibi", with(&|o| o.alibi_slopes = Some(slopes.clone()))),
        ("sinks", with(&|o| o.sinks = Some(sinks.clone()))),
        ("non-causal", with(&|o| o.causal = false)),
        (
            "non-causal alibi",
            with(&|o| {
                o.causal = false;
                o.alibi_slopes = Some(vec![0.05; hq]);
            }),
        ),
        (
            "everything",
            with(&|o| {
                o.sliding_window = Some(100);
                o.softcap = Some(5.0);
                o.alibi_slopes = Some(mixed_slopes.clone());
                o.sinks = Some(mixed_sinks.clone());
            }),
        ),
    ]
}

/// The largest error seen per label (e.g. "f16/f32": storage / kernel precision), in first-seen
/// order, for the summary line a grid test prints.
#[derive(Default)]
pub struct Worst(Vec<(String, f64)>);

impl Worst {
    /// Records `err` under `label`.
    pub fn add(&mut self, label: String, err: f64) {
        match self.0.iter_mut().find(|(l, _)| *l == label) {
            Some((_, w)) => *w = w.max(err),
            None => self.0.push((label, err)),
        }
    }
}

impl std::fmt::Debug for Worst {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.0).finish()
    }
}
