//! The benchmark cases of `kvattn::bench::cases` on the GPU: every kernel family prepares and
//! measures to positive finite times, and its row is judged against (made-up) ceilings.

use kvattn::bench::cases::{measure, prepare, row, Case, CaseKernel};
use kvattn::bench::Ceilings;
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;

use crate::common::gpu;

/// Tiny cases of every kernel family.
fn tiny_cases() -> Vec<Case> {
    vec![
        Case::decode(KvDtype::F16, 40)
            .with_heads(4, 2)
            .with_head_dim(32),
        Case::decode(KvDtype::Int4, 40)
            .with_heads(4, 2)
            .with_head_dim(32)
            .with_batch(3),
        Case::decode(KvDtype::Bf16, 40)
            .with_heads(4, 2)
            .with_head_dim(32)
            .contiguous(),
        Case::prefill(KvDtype::Int8, 24, 8)
            .with_heads(4, 2)
            .with_head_dim(32)
            .with_block_size(8),
        Case::append_kv(KvDtype::Fp8E5M2, 20)
            .with_heads(4, 2)
            .with_head_dim(32),
        Case::mla_absorbed(KvDtype::F16, 40)
            .with_heads(4, 1)
            .with_head_dim(32),
        Case::copy(KvDtype::F16, 40)
            .with_heads(4, 2)
            .with_head_dim(32),
    ]
}

#[test]
fn every_kernel_family_measures_positive_finite_times() {
    let ctx = gpu();
    let ceilings = Ceilings {
        copy_gbps: 1.0,
        copy_trials: Vec::new(),
        copy_footprint: 0,
        f32_gflops: 1.0,
        f16_gflops: None,
        timestamps: ctx.caps().timestamps,
    };
    let mut kernels = Vec::new();
    for case in tiny_cases() {
        let prepared = prepare(ctx, &case).unwrap_or_else(|e| panic!("{}: {e}", case.id()));
        assert_eq!(prepared.case(), &case);
        let m = measure(ctx, &prepared, 1, 3).unwrap_or_else(|e| panic!("{}: {e}", case.id()));
        assert!(
            m.min_seconds > 0.0 && m.min_seconds <= m.median_seconds,
            "{}: {m:?}",
            case.id()
        );
        assert!(m.median_seconds.is_finite(), "{}: {m:?}", case.id());
        assert_eq!(m.timestamps, ctx.caps().timestamps);
        let r = row(&case, &m, &ceilings);
        assert!(r.roofline_fraction > 0.0 && r.roofline_fraction.is_finite());
        assert_eq!(r.kv_bytes, case.kv_bytes());
        kernels.push(case.kernel);
    }
    assert!(kernels.contains(&CaseKernel::MlaAbsorbed));
}

#[test]
fn f16_kernels_and_bad_cases() {
    let ctx = gpu();
    let case = Case::decode(KvDtype::F16, 24)
        .with_heads(4, 4)
        .with_head_dim(16)
        .with_precision(Precision::F16);
    match prepare(ctx, &case) {
        Ok(p) => {
            assert!(ctx.caps().shader_f16);
            assert!(measure(ctx, &p, 0, 1).unwrap().median_seconds > 0.0);
            assert!(measure(ctx, &p, 0, 0).is_err());
        }
        Err(e) => assert!(!ctx.caps().shader_f16, "{e}"),
    }
    // Invalid cases fail before anything is allocated.
    let bad = Case::decode(KvDtype::Int8, 24).contiguous();
    assert!(prepare(ctx, &bad).is_err());
    assert!(prepare(ctx, &Case::decode(KvDtype::F16, 0)).is_err());
}
