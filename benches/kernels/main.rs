//! Criterion benches of the kernels (ARCHITECTURE.md section 13), one module per kernel family.
//! Each case is a [`kvattn::bench::cases::Case`] under its id (e.g.
//! `decode/hd128/g4/ctx4096/b1/f16/bs16`), prepared once and timed with `iter_custom` on
//! [`Context::timed`]: device time where the adapter has timestamps, the wall clock around a
//! queue sync otherwise. The set is small (minutes on lavapipe); sweeps and the roofline belong
//! to `kvattn bench`. Run on whatever adapter `Context::new()` picks:
//! `cargo bench`, or `cargo bench -- decode/hd128/g4` for some of them.

mod append_kv;
mod copy;
mod decode;
mod mla;
mod prefill;
#[cfg(feature = "decoder")]
mod qmatmul;

use std::sync::OnceLock;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use kvattn::bench::cases::{prepare, Case, Prepared};
use kvattn::gpu::Context;

/// The adapter every bench shares.
fn gpu() -> &'static Context {
    static CTX: OnceLock<Context> = OnceLock::new();
    CTX.get_or_init(|| {
        let ctx = Context::new().expect("benches need a GPU adapter (see README)");
        eprintln!(
            "benches on adapter: {} ({}), timestamps: {}",
            ctx.adapter().name,
            ctx.adapter().backend,
            ctx.caps().timestamps
        );
        ctx
    })
}

/// Benches `cases` (whose ids all start with `family/`) in the criterion group `family`, so
/// that each bench's id is its case's id. A case is prepared (and run once, untimed) when
/// criterion first runs it, not at all when a filter skips it, and freed before the next one.
pub fn bench_cases(c: &mut Criterion, family: &str, cases: &[Case]) {
    let ctx = gpu();
    let mut group = c.benchmark_group(family);
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for case in cases {
        let id = case.id();
        let name = id.strip_prefix(&format!("{family}/")).unwrap_or(&id);
        let mut prepared: Option<Prepared> = None;
        group.bench_function(name, |b| {
            let p = prepared.get_or_insert_with(|| {
                let p = prepare(ctx, case).unwrap_or_else(|e| panic!("preparing {id}: {e}"));
                // One untimed run: a software adapter compiles the pipelines at their first
                // submission, which would otherwise count in criterion's warm-up estimate.
                p.run(ctx)
                    .and_then(|()| ctx.wait())
                    .unwrap_or_else(|e| panic!("running {id}: {e}"));
                p
            });
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let ((), t) = ctx
                        .timed(|| p.run(ctx))
                        .unwrap_or_else(|e| panic!("running {id}: {e}"));
                    // NaN or negative as zero, out of range as the maximum: never a panic.
                    let d =
                        Duration::try_from_secs_f64(t.seconds.max(0.0)).unwrap_or(Duration::MAX);
                    total = total.saturating_add(d);
                }
                total
            })
        });
        drop(prepared);
    }
    group.finish();
}

/// The decoder's block-format products with the `decoder` feature; nothing without it.
fn decoder_benches(_c: &mut Criterion) {
    #[cfg(feature = "decoder")]
    qmatmul::benches(_c);
}

criterion_group!(
    benches,
    decode::benches,
    prefill::benches,
    append_kv::benches,
    mla::benches,
    copy::benches,
    decoder_benches
);
criterion_main!(benches);
