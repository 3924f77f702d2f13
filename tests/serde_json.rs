//! The `serde` feature: the results the CLI prints as JSON (capacity, bench rows and ceilings,
//! serving stats, cache telemetry, the adapter) serialize with the CLI's field names and
//! values, enums as their command-line names, and NaN or infinity as `null`, never as invalid
//! JSON.
#![cfg(feature = "serde")]

use kvattn::cache::capacity::{
    compare_to_mha, evaluate, fit_budget, CacheShape, CapacityQuery, ScaleGranularity,
};
use kvattn::quant::KvDtype;
use serde_json::{json, Value};

/// `value` as a JSON string parsed back: what a consumer of the CLI's output sees.
fn round_trip<T: serde::Serialize>(value: &T) -> Value {
    let text = serde_json::to_string(value).expect("serializes");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("invalid JSON {text}: {e}"))
}

/// Seed 001: 32 sequences x 8,192 tokens of Llama-3.1-70B in bf16 take 80 GiB.
#[test]
fn capacity_query_result_and_budget() {
    let shape = CacheShape::Mha {
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
    };
    let q = CapacityQuery {
        shape,
        dtype: KvDtype::Fp8E4M3,
        scales: ScaleGranularity::PerToken,
        block_size: None,
        tokens_per_seq: 8192,
        seqs: 32,
    };
    let v = round_trip(&q);
    assert_eq!(
        v["shape"],
        json!({"attention": "mha", "layers": 80, "kv_heads": 8, "head_dim": 128})
    );
    assert_eq!(v["dtype"], "fp8-e4m3");
    assert_eq!(v["scales"], "per-token");
    assert_eq!(v["block_size"], Value::Null);
    let bf16 = CapacityQuery {
        dtype: KvDtype::Bf16,
        scales: ScaleGranularity::PerTensor,
        ..q
    };
    let c = round_trip(&evaluate(&bf16).unwrap());
    assert_eq!(c["bytes_per_token"], 327_680);
    assert_eq!(c["scale_bytes_per_token"], 0);
    assert_eq!(c["tokens_per_seq"], 8192);
    assert_eq!(c["total_bytes"], 85_899_345_920u64);
    let fit = round_trip(
        &fit_budget(
            shape,
            KvDtype::Bf16,
            ScaleGranularity::PerTensor,
            None,
            80 << 30,
            8192,
        )
        .unwrap(),
    );
    assert_eq!(fit["max_tokens"], 262_144);
    assert_eq!(fit["max_sequences"], 32);
    let mla = CacheShape::Mla {
        layers: 60,
        rank: 512,
        rope_dim: 64,
    };
    let m = round_trip(
        &compare_to_mha(mla, 128, 128, KvDtype::Bf16, ScaleGranularity::PerTensor).unwrap(),
    );
    assert_eq!(m["mha"]["attention"], "mha");
    assert_eq!(m["mha"]["kv_heads"], 128);
    let ratio = m["ratio_values"].as_f64().expect("a number");
    // 2 x 128 heads x 128 dims against 512 + 64 latent and RoPE values per layer.
    assert!((ratio - 32768.0 / 576.0).abs() < 1e-9, "{m}");
}

#[cfg(feature = "bench")]
#[test]
fn bench_row_and_ceilings_with_non_finite_values() {
    use kvattn::bench::cases::{row, Case, Measurement};
    use kvattn::bench::{Ceilings, Trial};

    let ceilings = Ceilings {
        copy_gbps: 20.0,
        copy_trials: vec![Trial {
            workgroups: 256,
            rate: 20.0,
        }],
        copy_footprint: 6 << 20,
        // Far above the copy rate: decode is memory-bound.
        f32_gflops: 1e6,
        f16_gflops: None,
        timestamps: true,
    };
    let c = round_trip(&Ceilings {
        f32_gflops: f64::NAN,
        ..ceilings.clone()
    });
    assert_eq!(c["copy_trials"], json!([{"workgroups": 256, "rate": 20.0}]));
    assert_eq!(c["f32_gflops"], Value::Null, "NaN becomes null");
    assert_eq!(c["f16_gflops"], Value::Null);
    assert_eq!(c["timestamps"], true);

    let case = Case::decode(KvDtype::Fp8E4M3, 128);
    // A time of zero: infinite rates, which must come out as null.
    let m = Measurement {
        median_seconds: 0.0,
        min_seconds: 0.0,
        timestamps: false,
    };
    let r = round_trip(&row(&case, &m, &ceilings));
    assert_eq!(r["id"], case.id());
    assert_eq!(r["kernel"], "decode");
    assert_eq!(r["kv_dtype"], "fp8-e4m3");
    assert_eq!(r["precision"], "f32");
    assert_eq!(r["bound"], "mem");
    assert_eq!(r["context"], 128);
    assert_eq!(r["paged"], true);
    assert_eq!(r["kv_bytes"], case.kv_bytes());
    assert_eq!(r["seconds"], 0.0);
    assert_eq!(r["gbps"], Value::Null, "infinity becomes null");
    assert_eq!(r["roofline_fraction"], Value::Null);
    assert_eq!(r["copy_gbps"], 20.0);
    let c = round_trip(&case);
    assert_eq!(c["kernel"], "decode");
    assert_eq!(c["kv_dtype"], "fp8-e4m3");
}

#[cfg(feature = "serve")]
#[test]
fn serving_stats_of_a_run_without_tokens() {
    use kvattn::serve::scheduler::Counters;
    use kvattn::serve::RunStats;

    let counters = Counters {
        steps: 3,
        preemptions: 1,
        utilization: vec![(0.5, 0.25)],
        ..Counters::default()
    };
    let s = round_trip(&RunStats::new(4, &[], &counters));
    assert_eq!(s["requested"], 4);
    assert_eq!(s["completed"], 0);
    assert_eq!(s["steps"], 3);
    assert_eq!(s["preemptions"], 1);
    // No finished request: no time to first token, a NaN percentile.
    assert_eq!(s["ttft_p50_s"], Value::Null);
    assert_eq!(s["itl_p95_s"], Value::Null);
    assert!(s.get("throughput_tok_s").is_some());
    let c = round_trip(&counters);
    assert_eq!(c["utilization"], json!([[0.5, 0.25]]));
    assert_eq!(c["failed_appends"], 0);
}

#[test]
fn cache_telemetry_and_attention_kernel() {
    use kvattn::cache::telemetry::Telemetry;
    use kvattn::gpu::AttentionKernel;

    let t = Telemetry {
        sequences: 2,
        block_utilization: f64::NAN,
        ..Telemetry::default()
    };
    let v = round_trip(&t);
    assert_eq!(v["sequences"], 2);
    assert_eq!(v["block_utilization"], Value::Null);
    assert_eq!(round_trip(&AttentionKernel::Lanes), "lanes");
}
