//! The case sets of `kvattn bench`: a quick one (about a minute on lavapipe) and the full
//! sweep. Both fit an adapter that allocates at most 2 GiB at once and binds at most 128 MiB.

use super::Case;
use crate::quant::KvDtype;
use crate::shader::Precision;

/// Contexts of the full set's sweeps.
const SWEEP: [usize; 5] = [1024, 2048, 4096, 8192, 16384];

/// A small representative set, each case in kernel precision `precision`: GQA 32/8 decode in
/// f16 at 4,096 and 16,384 keys and in int8, FP8 E4M3 and int4 at 16,384; the contiguous cache;
/// MHA 32/32 and MQA 32/1; batch 8; head dim 64; one prefill chunk of 512; an append of 4,096
/// tokens; MLA absorbed decode (DeepSeek-V2, f16 latent); the copy kernel.
pub fn quick_set(precision: Precision) -> Vec<Case> {
    use KvDtype::*;
    let d = Case::decode;
    [
        d(F16, 4096),
        d(F16, 16384),
        d(Int8, 16384),
        d(Fp8E4M3, 16384),
        d(Int4, 16384),
        d(F16, 16384).contiguous(),
        d(F16, 4096).with_heads(32, 32),
        d(F16, 4096).with_heads(32, 1),
        d(F16, 4096).with_batch(8),
        d(F16, 4096).with_head_dim(64),
        Case::prefill(F16, 0, 512),
        Case::append_kv(F16, 4096),
        Case::mla_absorbed(F16, 4096),
        Case::copy(F16, 16384),
    ]
    .into_iter()
    .map(|c| c.with_precision(precision))
    .collect()
}

/// The full sweep, each case in kernel precision `precision`: GQA 32/8 decode over contexts
/// 1,024 to 16,384 in every storage format; the contiguous cache in f32, f16 and bf16; MHA,
/// MQA and group 8; head dim 64; batch 8 (4,096 and 16,384 keys) and 32 (4,096 keys); split-K
/// over 32,768 keys; prefill chunks of 512 after 0 and 4,096 keys; appends and MLA absorbed
/// decode in several formats; copies of several sizes. Everything in [`quick_set`] is in it.
pub fn full_set(precision: Precision) -> Vec<Case> {
    use KvDtype::*;
    let d = Case::decode;
    let mut cases = quick_set(precision);
    for dtype in KvDtype::ALL {
        cases.extend(SWEEP.map(|ctx| d(dtype, ctx)));
    }
    for dtype in [F32, F16, Bf16] {
        cases.extend([1024, 4096, 16384].map(|ctx| d(dtype, ctx).contiguous()));
    }
    for (q, kv) in [(32, 32), (32, 1)] {
        cases.extend([1024, 4096, 16384].map(|ctx| d(F16, ctx).with_heads(q, kv)));
    }
    cases.push(d(F16, 4096).with_heads(32, 4));
    cases.extend(SWEEP.map(|ctx| d(F16, ctx).with_head_dim(64)));
    cases.push(d(Int8, 4096).with_head_dim(64));
    let quantized = [F16, Fp8E4M3, Int8, Int4];
    for dtype in quantized {
        cases.extend([4096, 16384].map(|ctx| d(dtype, ctx).with_batch(8)));
        cases.push(d(dtype, 4096).with_batch(32));
        cases.push(d(dtype, 32768));
        cases.extend([0, 4096].map(|prefix| Case::prefill(dtype, prefix, 512)));
    }
    cases.extend(KvDtype::ALL.map(|dtype| Case::append_kv(dtype, 4096)));
    cases.extend([F16, Bf16, Fp8E4M3, Int8, Int4].map(|dtype| Case::mla_absorbed(dtype, 4096)));
    cases.push(Case::mla_absorbed(F16, 16384));
    cases.extend([1024, 4096, 16384].map(|ctx| Case::copy(F16, ctx)));
    let mut unique: Vec<Case> = Vec::with_capacity(cases.len());
    for case in cases {
        let case = case.with_precision(precision);
        if !unique.contains(&case) {
            unique.push(case);
        }
    }
    unique
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_valid_unique_and_fit_two_gib() {
        let quick = quick_set(Precision::F32);
        let full = full_set(Precision::F16);
        assert!(quick.len() < full.len());
        for set in [&quick, &full] {
            let mut ids: Vec<String> = set.iter().map(Case::id).collect();
            for c in set.iter() {
                c.validate().unwrap();
                // The KV a case holds (append: the pool it writes; copy: both buffers).
                assert!(
                    c.kv_bytes() < 2 << 30,
                    "{} moves {} bytes",
                    c.id(),
                    c.kv_bytes()
                );
            }
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), set.len(), "duplicate ids");
        }
        assert!(full.iter().all(|c| c.precision == Precision::F16));
        for q in &quick {
            assert!(full.iter().any(|f| f.id() == q.id()), "{} missing", q.id());
        }
    }
}
