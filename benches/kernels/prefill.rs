//! Prefill: a causal chunk of 512 query tokens after 0 and after 4,096 cached keys (GQA 32/8,
//! head dim 128, f16 KV).

use criterion::Criterion;
use kvattn::bench::cases::Case;
use kvattn::quant::KvDtype;

/// Benches the prefill cases.
pub fn benches(c: &mut Criterion) {
    let cases = [0, 4096].map(|prefix| Case::prefill(KvDtype::F16, prefix, 512));
    super::bench_cases(c, "prefill", &cases);
}
