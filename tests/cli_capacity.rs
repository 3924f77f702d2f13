//! `kvattn capacity` end to end: runs the built binary with `--json` on the seed cases and checks
//! the numbers, the text line, and that bad arguments fail with nothing on stdout. No GPU needed.
#![cfg(feature = "cli")]

use serde_json::Value;
use std::process::{Command, Output};

fn kvattn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvattn"))
        // The workgroup attention kernel unless the caller picks one (see tests/common).
        .env(
            "KVATTN_ATTENTION_KERNEL",
            std::env::var("KVATTN_ATTENTION_KERNEL").unwrap_or_else(|_| "workgroup".into()),
        )
        .arg("capacity")
        .args(args)
        .output()
        .expect("run kvattn")
}

/// Runs with `--json`, expects success and one JSON object.
fn json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = kvattn(&all);
    assert!(
        out.status.success(),
        "kvattn capacity {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert!(v.is_object());
    v
}

fn int(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not an integer in {v}"))
}

/// Runs, expects a failure with an error on stderr mentioning every `needles` and nothing on
/// stdout.
fn fails(args: &[&str], needles: &[&str]) {
    let out = kvattn(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
    for n in needles {
        assert!(err.contains(n), "{args:?}: {err:?} lacks {n:?}");
    }
}

/// Seed 001: 32 sequences x 8,192 tokens x 80 layers x 8 KV heads x 128 x 2 bytes x 2 (K, V).
#[test]
fn seed_001_80_gib() {
    let preset = json(&[
        "--model",
        "llama-3.1-70b",
        "--dtype",
        "f16",
        "--tokens",
        "8192",
        "--seqs",
        "32",
    ]);
    let explicit = json(&[
        "--layers",
        "80",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--dtype",
        "bf16",
        "--tokens-per-seq",
        "8192",
        "--seqs",
        "32",
    ]);
    for v in [&preset, &explicit] {
        assert_eq!(int(v, "bytes_per_token"), 327_680);
        assert_eq!(int(v, "total_bytes"), 85_899_345_920);
        assert_eq!(int(v, "tokens"), 8_192);
        assert_eq!(int(v, "seqs"), 32);
        assert_eq!(int(v, "layers"), 80);
        assert_eq!(v["total_gib"].as_f64(), Some(80.0));
        assert_eq!(v["block_size"], Value::Null);
        assert!(v.get("max_tokens").is_none());
    }
    assert_eq!(preset["model"], "llama-3.1-70b");
    assert_eq!(preset["dtype"], "f16");
    assert_eq!(explicit["model"], Value::Null);
}

#[test]
fn text_line() {
    let out = kvattn(&[
        "--model",
        "llama-3.1-70b",
        "--dtype",
        "f16",
        "--tokens",
        "8192",
        "--seqs",
        "32",
        "--budget-bytes",
        "80GiB",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    assert_eq!(
        lines.next().unwrap(),
        "llama-3.1-70b f16: 327,680 bytes/token; 32 seqs x 8,192 tokens = 85,899,345,920 bytes \
         (80.00 GiB, 85.90 GB)"
    );
    assert_eq!(
        lines.next().unwrap(),
        "budget 85,899,345,920 bytes (80.00 GiB, 85.90 GB): max 262,144 tokens; max 32 seqs of \
         8,192 tokens"
    );
    assert_eq!(lines.next(), None);
}

/// Seed 000 section 4: Qwen3-1.7B in bf16 is 114,688 bytes per token; 22,048 tokens took
/// 2.36 GiB in vLLM; FP8 fits twice as many tokens in the same memory.
#[test]
fn seed_000_qwen3_1_7b() {
    let v = json(&["--model", "qwen3-1.7b", "--dtype", "bf16"]);
    assert_eq!(int(&v, "bytes_per_token"), 114_688);
    assert_eq!(int(&v, "total_bytes"), 114_688);
    assert_eq!(int(&v, "q_heads"), 16);
    assert_eq!(int(&v, "kv_heads"), 8);
    let v = json(&["--model", "qwen3-1.7b", "--tokens", "22048"]);
    assert_eq!(int(&v, "total_bytes"), 2_528_641_024);
    assert_eq!(format!("{:.3}", v["total_gib"].as_f64().unwrap()), "2.355");
    // A KV memory of 2.355 GiB (vLLM logged "2.36 GiB") holds exactly 22,048 tokens in blocks
    // of 16.
    let v = json(&[
        "--model",
        "qwen3-1.7b",
        "--block-size",
        "16",
        "--budget-bytes",
        "2.355GiB",
    ]);
    assert_eq!(int(&v, "max_tokens"), 22_048);
    let budget = [
        "--model",
        "qwen3-1.7b",
        "--block-size",
        "16",
        "--budget-bytes",
    ];
    let bf16 = json(&[&budget[..], &["2528641024", "--dtype", "bf16"]].concat());
    assert_eq!(int(&bf16, "max_tokens"), 22_048);
    assert_eq!(int(&bf16, "max_sequences"), 1_378); // sequences of one 16-token block
    let fp8 = json(&[&budget[..], &["2528641024", "--dtype", "fp8-e4m3"]].concat());
    assert_eq!(int(&fp8, "bytes_per_token"), 57_344);
    assert_eq!(int(&fp8, "max_tokens"), 44_096);
    assert!(int(&fp8, "max_tokens") >= 41_920); // vLLM's measured FP8 count fits
}

/// Seed 000 section 4: Llama 3.1 70B at 128K tokens is 40 GiB in bf16.
#[test]
fn seed_000_llama_70b_128k() {
    let v = json(&["--model", "llama-3.1-70b", "--tokens", "131072"]);
    assert_eq!(int(&v, "total_bytes"), 42_949_672_960);
    assert_eq!(v["total_gib"].as_f64(), Some(40.0));
}

/// Seed 000 section 4: DeepSeek-V2 stores (512 + 64) x 60 = 34,560 values per token, 67.5 KiB in
/// bf16.
#[test]
fn seed_000_deepseek_v2() {
    let preset = json(&["--model", "deepseek-v2", "--dtype", "bf16"]);
    let explicit = json(&["--layers", "60", "--mla-rank", "512", "--rope-dim", "64"]);
    for v in [&preset, &explicit] {
        assert_eq!(int(v, "values_per_token"), 34_560);
        assert_eq!(int(v, "bytes_per_token"), 69_120);
        assert_eq!(v["attention"], "mla");
        assert_eq!(int(v, "mla_rank"), 512);
        assert_eq!(int(v, "rope_dim"), 64);
    }
    // The RoPE part stays 16-bit when the latent is FP8; per-token scales add 4 bytes a layer.
    let v = json(&["--model", "deepseek-v2", "--dtype", "fp8-e4m3"]);
    assert_eq!(int(&v, "bytes_per_token"), 38_400);
    let v = json(&[
        "--model",
        "deepseek-v2",
        "--dtype",
        "fp8-e4m3",
        "--scales",
        "per-token",
    ]);
    assert_eq!(int(&v, "bytes_per_token"), 38_640);
    assert_eq!(int(&v, "scale_bytes_per_token"), 240);
    // The same heads as MHA: 1,966,080 values per token.
    let v = json(&["--layers", "60", "--kv-heads", "128", "--head-dim", "128"]);
    assert_eq!(int(&v, "values_per_token"), 1_966_080);
}

const MHA_KEYS: [&str; 5] = [
    "mha_equivalent_values_per_token",
    "mha_equivalent_bytes_per_token",
    "mha_equivalent_head_dim",
    "mha_ratio_values",
    "mha_ratio_bytes",
];

fn float(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

/// The text output's lines, expecting success.
fn text_lines(args: &[&str]) -> Vec<String> {
    let out = kvattn(args);
    assert!(
        out.status.success(),
        "kvattn capacity {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The comparison line for `heads` heads of `head_dim`, from the numbers it reports.
fn vs_mha_line(
    heads: u64,
    head_dim: u64,
    mha_values: u64,
    mha_bytes: u64,
    rv: f64,
    rb: f64,
) -> String {
    let sep = |n: u64| {
        let d = n.to_string();
        let mut out = String::new();
        for (i, ch) in d.chars().enumerate() {
            if i > 0 && (d.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(ch);
        }
        out
    };
    format!(
        "vs MHA of the same {heads} heads (K and V of {head_dim} dims): {} values/token, {rv:.1}x \
         the latent's values ({} bytes/token, {rb:.1}x the latent's bytes)",
        sep(mha_values),
        sep(mha_bytes)
    )
}

/// Seed 000 section 4: DeepSeek-V2's 128 heads of 128 as MHA would leave 2 x 60 x 128 x 128 =
/// 1,966,080 values per token, about 57x the latent's 34,560. The MHA cache takes the same dtype
/// and scales; the latent's RoPE part stays 16-bit when it is quantized, so the byte ratio
/// differs from the value ratio then.
#[test]
fn deepseek_v2_vs_mha() {
    let (layers, heads, head_dim, rank, rope) = (60u64, 128u64, 128u64, 512u64, 64u64);
    let mha_values = 2 * layers * heads * head_dim;
    let mla_values = layers * (rank + rope);
    assert_eq!(mha_values, 1_966_080);
    assert_eq!(mla_values, 34_560);
    // (dtype, scales, bytes per value, scale bytes per row)
    for (dtype, scales, p, row_scale) in [
        ("bf16", "per-tensor", 2, 0),
        ("fp8-e4m3", "per-tensor", 1, 0),
        ("fp8-e4m3", "per-token", 1, 4),
    ] {
        let args = [
            "--model",
            "deepseek-v2",
            "--dtype",
            dtype,
            "--scales",
            scales,
        ];
        let v = json(&args);
        let mha_bytes = mha_values * p + 2 * layers * heads * row_scale;
        let mla_bytes = layers * (rank * p + rope * 2 + row_scale);
        let (rv, rb) = (
            mha_values as f64 / mla_values as f64,
            mha_bytes as f64 / mla_bytes as f64,
        );
        assert_eq!(int(&v, "values_per_token"), mla_values);
        assert_eq!(int(&v, "bytes_per_token"), mla_bytes, "{dtype} {scales}");
        assert_eq!(int(&v, "q_heads"), heads);
        assert_eq!(int(&v, "mha_equivalent_head_dim"), head_dim);
        assert_eq!(int(&v, "mha_equivalent_values_per_token"), mha_values);
        assert_eq!(int(&v, "mha_equivalent_bytes_per_token"), mha_bytes);
        assert_eq!(float(&v, "mha_ratio_values"), rv);
        assert_eq!(float(&v, "mha_ratio_bytes"), rb);
        let lines = text_lines(&args);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(
            lines[1],
            vs_mha_line(heads, head_dim, mha_values, mha_bytes, rv, rb)
        );
    }
    // The seed's "about 57x", and the printed ratios.
    assert_eq!((1_966_080.0 / 34_560.0_f64).round(), 57.0);
    let bf16 = text_lines(&["--model", "deepseek-v2"]);
    assert!(bf16[1].contains(" 56.9x the latent's values (3,932,160 bytes/token, 56.9x"));
    let fp8 = text_lines(&["--model", "deepseek-v2", "--dtype", "fp8-e4m3"]);
    assert!(fp8[1].contains(" 56.9x the latent's values (1,966,080 bytes/token, 51.2x"));
}

/// An explicit MLA shape compares only when --q-heads and --head-dim ask for it; an MHA shape
/// never does.
#[test]
fn explicit_mla_vs_mha() {
    let mla = ["--layers", "60", "--mla-rank", "512", "--rope-dim", "64"];
    let plain = json(&mla);
    for key in MHA_KEYS.iter().chain(&["q_heads"]) {
        assert!(plain.get(key).is_none(), "{key} in {plain}");
    }
    assert_eq!(text_lines(&mla).len(), 1);
    let asked = [&mla[..], &["--q-heads", "128", "--head-dim", "128"]].concat();
    let explicit = json(&asked);
    let preset = json(&["--model", "deepseek-v2"]);
    for key in MHA_KEYS.iter().chain(&["q_heads", "bytes_per_token"]) {
        assert_eq!(explicit[key], preset[key], "{key}");
    }
    assert_eq!(explicit["model"], Value::Null);
    // Another shape, in f32: 2 layers of rank 128 + RoPE 32 vs 16 heads of 64.
    let args = [
        "--layers",
        "2",
        "--mla-rank",
        "128",
        "--rope-dim",
        "32",
        "--q-heads",
        "16",
        "--head-dim",
        "64",
        "--dtype",
        "f32",
    ];
    let v = json(&args);
    let (mha_values, mla_values) = (2 * 2 * 16 * 64, 2 * (128 + 32));
    assert_eq!(int(&v, "values_per_token"), mla_values);
    assert_eq!(int(&v, "q_heads"), 16);
    assert_eq!(int(&v, "mha_equivalent_head_dim"), 64);
    assert_eq!(int(&v, "mha_equivalent_values_per_token"), mha_values);
    assert_eq!(int(&v, "mha_equivalent_bytes_per_token"), mha_values * 4);
    let ratio = mha_values as f64 / mla_values as f64;
    assert_eq!(float(&v, "mha_ratio_values"), ratio);
    assert_eq!(float(&v, "mha_ratio_bytes"), ratio);
    assert_eq!(
        text_lines(&args)[1],
        vs_mha_line(16, 64, mha_values, mha_values * 4, ratio, ratio)
    );
    // MHA presets and shapes: no comparison.
    for args in [
        &["--model", "qwen3-8b"][..],
        &["--layers", "60", "--kv-heads", "128", "--head-dim", "128"][..],
    ] {
        let v = json(args);
        for key in MHA_KEYS {
            assert!(v.get(key).is_none(), "{key} in {v}");
        }
        assert_eq!(text_lines(args).len(), 1);
    }
}

#[test]
fn mha_comparison_bad_arguments_fail() {
    let mla = ["--layers", "60", "--mla-rank", "512", "--rope-dim", "64"];
    let with = |extra: &[&'static str]| [&mla[..], extra].concat();
    fails(&with(&["--q-heads", "128"]), &["--q-heads", "--head-dim"]);
    fails(&with(&["--head-dim", "128"]), &["--head-dim", "--q-heads"]);
    fails(
        &with(&["--q-heads", "0", "--head-dim", "128"]),
        &["query heads", "positive"],
    );
    fails(
        &with(&["--q-heads", "16", "--head-dim", "130"]),
        &["MHA equivalent", "multiple of 4"],
    );
    fails(
        &with(&["--q-heads", "16", "--head-dim", "48", "--dtype", "int4"]),
        &["MHA equivalent", "multiple of 32"],
    );
    fails(
        &with(&["--q-heads", "16", "--head-dim", "128", "--kv-heads", "16"]),
        &["mixed"],
    );
    // --q-heads with an MHA shape, or with a preset (which has its own heads).
    fails(
        &[
            "--layers",
            "60",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--q-heads",
            "64",
        ],
        &["--q-heads", "MLA"],
    );
    fails(
        &["--layers", "60", "--head-dim", "128", "--q-heads", "64"],
        &["--q-heads", "MLA"],
    );
    fails(
        &["--model", "deepseek-v2", "--q-heads", "64"],
        &["--model", "--q-heads"],
    );
    fails(
        &["--model", "deepseek-v2", "--head-dim", "64"],
        &["--model", "--head-dim"],
    );
    fails(
        &["--model", "llama-3.1-70b", "--q-heads", "64"],
        &["--q-heads"],
    );
    fails(&with(&["--q-heads", "-1", "--head-dim", "128"]), &[]);
}

/// Seed 003: 32 layers x 8 KV heads x 128 in fp16: 8,000 tokens ~1.05 GB, 32,000 ~4.19 GB.
#[test]
fn seed_003_gb() {
    for (tokens, bytes, gb) in [
        ("8000", 1_048_576_000, "1.05 GB"),
        ("32000", 4_194_304_000, "4.19 GB"),
    ] {
        let shape = [
            "--layers",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--dtype",
            "f16",
            "--tokens",
            tokens,
        ];
        assert_eq!(int(&json(&shape), "total_bytes"), bytes);
        let out = kvattn(&shape);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains(gb), "{text}");
    }
}

/// Seed 000 section 3: the toy model (2 layers, 8 heads of 16, f32) after 1,024 tokens.
#[test]
fn seed_000_toy_model() {
    for (kv_heads, bytes) in [("8", 2_097_152), ("1", 262_144)] {
        let v = json(&[
            "--layers",
            "2",
            "--kv-heads",
            kv_heads,
            "--head-dim",
            "16",
            "--dtype",
            "f32",
            "--tokens",
            "1024",
        ]);
        assert_eq!(int(&v, "total_bytes"), bytes);
    }
}

#[test]
fn smollm2_and_quantized_overheads() {
    let v = json(&["--model", "smollm2-135m"]);
    assert_eq!(int(&v, "bytes_per_token"), 23_040);
    let q = |dtype: &str, scales: Option<&str>| {
        let mut a = vec!["--model", "llama-3.1-70b", "--dtype", dtype];
        if let Some(s) = scales {
            a.extend(["--scales", s]);
        }
        json(&a)
    };
    assert_eq!(int(&q("fp8-e5m2", None), "bytes_per_token"), 163_840);
    assert_eq!(
        int(&q("fp8-e5m2", Some("per-tensor")), "bytes_per_token"),
        163_840
    );
    let per_token = q("fp8-e4m3", Some("per-token"));
    assert_eq!(int(&per_token, "bytes_per_token"), 168_960);
    assert_eq!(per_token["scales"], "per-token");
    assert_eq!(int(&q("int8", None), "bytes_per_token"), 168_960);
    let int4 = q("int4", None);
    assert_eq!(int(&int4, "payload_bytes_per_token"), 81_920);
    assert_eq!(int(&int4, "scale_bytes_per_token"), 20_480);
    assert_eq!(int(&int4, "bytes_per_token"), 102_400);
    assert_eq!(int4["scales"], "per-group-32");
}

#[test]
fn blocks_and_budgets() {
    let v = json(&[
        "--model",
        "llama-3.1-70b",
        "--tokens",
        "8200",
        "--seqs",
        "32",
        "--block-size",
        "16",
    ]);
    assert_eq!(int(&v, "tokens_requested"), 8_200);
    assert_eq!(int(&v, "tokens"), 8_208);
    assert_eq!(int(&v, "total_bytes"), 327_680 * 8_208 * 32);
    let v = json(&["--model", "llama-3.1-70b", "--tokens", "8200"]);
    assert_eq!(int(&v, "tokens"), 8_200);
    // 80 GiB less one byte, blocks of 16: whole blocks only.
    let v = json(&[
        "--model",
        "llama-3.1-70b",
        "--block-size",
        "16",
        "--budget-bytes",
        "85899345919",
        "--tokens-per-seq",
        "8192",
    ]);
    assert_eq!(int(&v, "budget_bytes"), 85_899_345_919);
    assert_eq!(int(&v, "max_tokens"), 262_128);
    assert_eq!(int(&v, "max_sequences"), 31);
    let v = json(&[
        "--model",
        "llama-3.1-70b",
        "--budget-bytes",
        "80GiB",
        "--tokens-per-seq",
        "8192",
        "--dtype",
        "fp8-e4m3",
    ]);
    assert_eq!(int(&v, "max_tokens"), 524_288);
    assert_eq!(int(&v, "max_sequences"), 64);
}

#[test]
fn bad_arguments_fail() {
    fails(&["--model", "gpt-5"], &["gpt-5", "llama-3.1-70b"]);
    fails(&["--model", "qwen3-8b", "--layers", "36"], &["--layers"]);
    fails(
        &["--layers", "60", "--kv-heads", "8", "--mla-rank", "512"],
        &["mixed"],
    );
    fails(&["--layers", "32", "--kv-heads", "8"], &["--head-dim"]);
    fails(&["--layers", "60", "--mla-rank", "512"], &["--rope-dim"]);
    fails(&["--kv-heads", "8", "--head-dim", "128"], &["--layers"]);
    fails(&[], &["--model"]);
    fails(&["--model", "qwen3-8b", "--dtype", "int2"], &["int2"]);
    for dtype in ["bf16", "int8", "int4"] {
        fails(
            &[
                "--model",
                "qwen3-8b",
                "--dtype",
                dtype,
                "--scales",
                "per-token",
            ],
            &["FP8"],
        );
    }
    fails(
        &["--model", "qwen3-8b", "--scales", "per-block"],
        &["per-block"],
    );
    fails(
        &["--model", "qwen3-8b", "--block-size", "24"],
        &["power of two"],
    );
    fails(
        &["--model", "qwen3-8b", "--block-size", "512"],
        &["power of two"],
    );
    fails(&["--model", "qwen3-8b", "--tokens", "0"], &["positive"]);
    fails(&["--model", "qwen3-8b", "--seqs", "0"], &["positive"]);
    fails(
        &["--model", "qwen3-8b", "--budget-bytes", "lots"],
        &["lots"],
    );
    fails(&["--model", "qwen3-8b", "--budget-bytes", "0"], &["budget"]);
    fails(
        &[
            "--layers",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "100",
            "--dtype",
            "int4",
        ],
        &["multiple of 32"],
    );
    fails(
        &["--layers", "32", "--kv-heads", "8", "--head-dim", "130"],
        &["multiple of 4"],
    );
    fails(
        &[
            "--layers",
            "4000000000",
            "--kv-heads",
            "4000000000",
            "--head-dim",
            "4000000000",
        ],
        &["overflow"],
    );
    fails(
        &[
            "--model",
            "llama-3.1-405b",
            "--tokens",
            "18446744073709551615",
        ],
        &["overflow"],
    );
    // Usage errors from the parser.
    fails(&["--model", "qwen3-8b", "--tokens", "-1"], &[]);
    fails(
        &[
            "--model",
            "qwen3-8b",
            "--tokens",
            "5",
            "--tokens-per-seq",
            "6",
        ],
        &[],
    );
    // The semantic errors above exit with 1.
    assert_eq!(kvattn(&["--model", "gpt-5"]).status.code(), Some(1));
}

/// Usage errors from the parser are one line on stderr like the other errors, with clap's exit
/// status (2); `--help` still prints the full help.
#[test]
fn usage_errors_are_one_line() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--model", "qwen3-8b", "--tokens", "-1"],
            "unexpected argument '-1'",
        ),
        (
            &[
                "--model",
                "qwen3-8b",
                "--tokens",
                "5",
                "--tokens-per-seq",
                "6",
            ],
            "cannot be used multiple times",
        ),
        (
            &["--kv-dtype", "f16"],
            "a similar argument exists: '--dtype'",
        ),
        (&["--seqs", "many"], "invalid value 'many' for '--seqs <B>'"),
        (&["--model"], "--model"),
    ];
    for (args, needle) in cases {
        let out = kvattn(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err:?}");
        assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err:?}");
        assert!(err.starts_with("kvattn: capacity: "), "{args:?}: {err:?}");
        assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
    }
    let out = kvattn(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.lines().count() > 5 && help.contains("--budget-bytes"),
        "{help}"
    );
}
