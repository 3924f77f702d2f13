//! Decode: GQA 32/8 head dim 128 in f16 over 1,024 to 16,384 keys, every other storage format
//! at 4,096, groups 1 and 8, head dim 64, batch 8, and the contiguous cache.

use criterion::Criterion;
use kvattn::bench::cases::Case;
use kvattn::quant::KvDtype::{self, *};

/// The decode cases.
fn cases() -> Vec<Case> {
    let d = Case::decode;
    let mut cases: Vec<Case> = [1024, 4096, 16384].map(|ctx| d(F16, ctx)).to_vec();
    let others: [KvDtype; 6] = [F32, Bf16, Fp8E4M3, Fp8E5M2, Int8, Int4];
    cases.extend(others.map(|dtype| d(dtype, 4096)));
    cases.extend([
        d(F16, 4096).with_heads(32, 32),
        d(F16, 4096).with_heads(32, 4),
        d(F16, 4096).with_head_dim(64),
        d(F16, 16384).with_head_dim(64),
        d(F16, 4096).with_batch(8),
        d(F16, 4096).contiguous(),
        d(F16, 16384).contiguous(),
    ]);
    cases
}

/// Benches the decode cases.
pub fn benches(c: &mut Criterion) {
    super::bench_cases(c, "decode", &cases());
}
