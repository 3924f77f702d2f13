//! MLA absorbed decode, DeepSeek-V2's shape over 4,096 cached tokens, f16 and FP8 E4M3 latent.

use criterion::Criterion;
use kvattn::bench::cases::Case;
use kvattn::quant::KvDtype::*;

/// Benches the MLA cases.
pub fn benches(c: &mut Criterion) {
    let cases = [F16, Fp8E4M3].map(|dtype| Case::mla_absorbed(dtype, 4096));
    super::bench_cases(c, "mla_absorbed", &cases);
}
