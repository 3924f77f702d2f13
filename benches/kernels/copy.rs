//! The copy kernel moving the bytes of the f16 decode cases at 4,096 and 16,384 keys: what a
//! decode that only streams its KV once would take.

use criterion::Criterion;
use kvattn::bench::cases::Case;
use kvattn::quant::KvDtype;

/// Benches the copy cases.
pub fn benches(c: &mut Criterion) {
    let cases = [4096, 16384].map(|ctx| Case::copy(KvDtype::F16, ctx));
    super::bench_cases(c, "copy", &cases);
}
