//! `append_kv`: 4,096 new K and V rows (8 heads of 128, f32 source) encoded into f16, FP8 E4M3,
//! int8 and int4 pools.

use criterion::Criterion;
use kvattn::bench::cases::Case;
use kvattn::quant::KvDtype::*;

/// Benches the append cases.
pub fn benches(c: &mut Criterion) {
    let cases = [F16, Fp8E4M3, Int8, Int4].map(|dtype| Case::append_kv(dtype, 4096));
    super::bench_cases(c, "append_kv", &cases);
}
