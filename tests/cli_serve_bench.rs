//! `kvattn serve-bench` end to end: the built binary runs a quick sweep on the adapter
//! `WGPU_BACKEND` selects; its JSON has the documented keys in order, every request completes
//! and no append fails; the CSV and SVG files are well-formed; a shared prefix hits the prefix
//! cache under Poisson arrivals; bad flags fail with one line on stderr and write nothing.
#![cfg(feature = "cli")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;

/// The keys every object starts with, in this order.
const KEYS: [&str; 11] = [
    "concurrency",
    "throughput_tok_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "itl_p50_s",
    "itl_p95_s",
    "preemptions",
    "prefix_hit_rate",
    "failed_appends",
    "completed",
    "requested",
];

/// An adapter name no adapter has: a run that reaches the GPU fails with "no GPU adapter
/// found", so an error seen under it came before any GPU work.
const NO_ADAPTER: &str = "no-such-adapter-kvattn-test";

/// `kvattn serve-bench args` with [`NO_ADAPTER`].
fn kvattn_no_gpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvattn"))
        .env("WGPU_ADAPTER_NAME", NO_ADAPTER)
        .arg("serve-bench")
        .args(args)
        .output()
        .expect("run kvattn")
}

fn kvattn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvattn"))
        // The workgroup attention kernel unless the caller picks one (see tests/common).
        .env(
            "KVATTN_ATTENTION_KERNEL",
            std::env::var("KVATTN_ATTENTION_KERNEL").unwrap_or_else(|_| "workgroup".into()),
        )
        .arg("serve-bench")
        .args(args)
        .output()
        .expect("run kvattn")
}

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvattn-cli-serve-bench-{}-{name}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Runs with `--json`, expects success and one array of objects.
fn json_rows(args: &[&str]) -> (Vec<Value>, String, String) {
    let mut all = args.to_vec();
    all.push("--json");
    let out = kvattn(&all);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "serve-bench {args:?}: {stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: Value = serde_json::from_str(&stdout).expect("one JSON array on stdout");
    let rows = v.as_array().expect("an array").clone();
    (rows, stdout, stderr)
}

fn int(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not an integer in {v}"))
}

fn float(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

/// The keys of each object in the raw JSON text, in the order written.
fn key_orders(text: &str) -> Vec<Vec<String>> {
    text.split('{')
        .skip(1)
        .map(|obj| {
            let obj = obj.split('}').next().unwrap();
            obj.split(',')
                .filter_map(|field| {
                    let (k, _) = field.split_once(':')?;
                    Some(k.trim().trim_matches('"').to_string())
                })
                .collect()
        })
        .collect()
}

#[test]
fn quick_sweep_json_csv_and_svg() {
    let dir = temp_dir("quick");
    let csv = dir.join("sweep.csv");
    let svg = dir.join("sweep.svg");
    let (rows, text, stderr) = json_rows(&[
        "--quick",
        "--concurrency",
        "1,4",
        "--csv",
        s(&csv),
        "--svg",
        s(&svg),
    ]);
    assert!(stderr.contains("adapter"), "no adapter line: {stderr}");
    assert_eq!(rows.len(), 2);
    for (row, c) in rows.iter().zip([1, 4]) {
        for key in KEYS {
            assert!(row.get(key).is_some(), "{key} missing in {row}");
        }
        assert_eq!(int(row, "concurrency"), c);
        assert_eq!(int(row, "requested"), 32);
        assert_eq!(int(row, "completed"), int(row, "requested"));
        assert_eq!(int(row, "failed_appends"), 0);
        assert!(float(row, "throughput_tok_s") > 0.0);
        let (p50, p95) = (float(row, "ttft_p50_s"), float(row, "ttft_p95_s"));
        assert!(0.0 < p50 && p50 <= p95, "{row}");
        let (p50, p95) = (float(row, "itl_p50_s"), float(row, "itl_p95_s"));
        assert!(0.0 < p50 && p50 <= p95, "{row}");
        assert_eq!(float(row, "prefix_hit_rate"), 0.0);
    }
    for keys in key_orders(&text) {
        assert_eq!(keys[..KEYS.len()], KEYS, "key order");
    }

    let csv_text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = csv_text.lines().collect();
    assert_eq!(lines.len(), 3, "{csv_text}");
    let header: Vec<&str> = lines[0].split(',').collect();
    assert_eq!(header[..KEYS.len()], KEYS);
    for (line, c) in lines[1..].iter().zip(["1", "4"]) {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells.len(), header.len(), "{line}");
        assert_eq!(cells[0], c);
        for cell in &cells {
            cell.parse::<f64>()
                .unwrap_or_else(|_| panic!("{cell:?} in {line:?} is not a number"));
        }
        let col = |k: &str| cells[header.iter().position(|h| *h == k).unwrap()];
        assert_eq!(col("completed"), col("requested"));
        assert_eq!(col("failed_appends"), "0");
    }

    let svg_text = std::fs::read_to_string(&svg).unwrap();
    let head = svg_text.trim_start();
    assert!(head.starts_with("<svg") || head.starts_with("<?xml"));
    assert!(svg_text.trim_end().ends_with("</svg>"));
    assert!(svg_text.contains("<polyline") || svg_text.contains("<path"));
    assert_eq!(svg_text.matches("<svg").count(), 1);
    assert_eq!(
        listing(&dir),
        ["sweep.csv", "sweep.svg"],
        "temporary files left"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn shared_prefix_hits_under_poisson_arrivals() {
    let (rows, _, _) = json_rows(&[
        "--quick",
        "--requests",
        "8",
        "--concurrency",
        "2",
        "--shared-prefix",
        "16",
        "--arrivals",
        "poisson",
        "--rate",
        "40",
        "--preemption",
        "swap",
    ]);
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(int(row, "completed"), 8);
    assert_eq!(int(row, "failed_appends"), 0);
    // 16 of each 32-token prompt are one shared full block: every request admitted after the
    // first computed it finds it (6 or 7 of 8: 0.375 or 0.4375 of the prompt tokens).
    let rate = float(row, "prefix_hit_rate");
    assert!((0.3..=0.5).contains(&rate), "prefix hit rate {rate}");
}

#[test]
fn bad_flags_fail_with_one_line_and_write_nothing() {
    let dir = temp_dir("bad");
    let csv = dir.join("out.csv");
    let svg = dir.join("out.svg");
    let cases: &[(&[&str], &str)] = &[
        (&["--arrivals", "sometimes"], "--arrivals"),
        (&["--arrivals", "poisson"], "--rate"),
        (&["--rate", "5"], "--rate"),
        (&["--arrivals", "poisson", "--rate", "0"], "--rate"),
        (&["--concurrency", "0"], "--concurrency"),
        (&["--concurrency", "1,x"], "--concurrency"),
        (&["--concurrency", "2,2"], "twice"),
        (&["--kv-dtype", "f17"], "f17"),
        (&["--preemption", "never"], "--preemption"),
        (&["--block-size", "12"], "--block-size"),
        (&["--kv-blocks", "1"], "--kv-blocks"),
        (&["--requests", "0"], "--requests"),
        (&["--repeats", "0"], "--repeats"),
        (&["--shared-prefix", "100"], "--shared-prefix"),
        (&["--kv-heads", "3"], "--kv-heads"),
        (&["--model", "/nonexistent/model.gguf"], "cannot read"),
        (&["--model", "model.gguf", "--kv-heads", "2"], "--kv-heads"),
        (&["--requests", "many"], "--requests"),
        (&["--no-such-flag"], "--no-such-flag"),
    ];
    for (args, needle) in cases {
        let mut all = args.to_vec();
        all.extend(["--csv", s(&csv), "--svg", s(&svg)]);
        check_fails(&all, needle);
    }
    check_fails(
        &["--csv", "/nonexistent-kvattn-dir/out.csv"],
        "does not exist",
    );
    check_fails(&["--svg", s(&dir)], "is a directory");
    assert!(
        listing(&dir).is_empty(),
        "files written: {:?}",
        listing(&dir)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Expects a failure with one line on stderr mentioning `needle` and nothing on stdout.
fn check_fails(args: &[&str], needle: &str) {
    let out = kvattn(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err:?}");
    assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
}

/// Expects `out` to have failed with one line on stderr mentioning `needle` and nothing on
/// stdout.
fn one_line_failure(out: &Output, what: &str, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{what}: {err:?}");
    assert!(out.stdout.is_empty(), "{what} printed to stdout");
    assert_eq!(err.lines().count(), 1, "{what}: {err:?}");
    assert!(err.starts_with("kvattn: "), "{what}: {err:?}");
    assert!(err.contains(needle), "{what}: {err:?} lacks {needle:?}");
}

/// A rate whose mean gap between arrivals exceeds a minute (it panicked or slept for ever),
/// or that is not a finite positive number, is refused before the adapter is opened; a rate
/// just above the bound passes the checks (and then finds no adapter).
#[test]
fn rates_beyond_the_bound_are_refused_before_any_gpu_work() {
    for rate in ["1e-20", "1e-12", "0.01", "0", "-1", "inf", "NaN"] {
        let flag = format!("--rate={rate}");
        let o = kvattn_no_gpu(&["--quick", "--arrivals", "poisson", &flag]);
        one_line_failure(&o, &format!("--rate {rate}"), "at least 1/60");
        assert!(String::from_utf8_lossy(&o.stderr).contains("--rate"));
    }
    let o = kvattn_no_gpu(&["--quick", "--arrivals", "poisson", "--rate", "0.02"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("no GPU adapter found"), "{err:?}");
}

/// Output files are checked before the adapter is opened: two flags naming one file (however
/// spelt) and an output naming the --model file are refused as one line, nothing written.
#[test]
fn output_paths_are_checked_before_any_gpu_work() {
    let dir = temp_dir("same");
    let out = dir.join("sweep.out");
    let dotted = dir.join(".").join("sweep.out");
    let model = dir.join("model.gguf");
    std::fs::write(&model, b"not really a model").unwrap();
    let cases: [(&[&str], &str); 3] = [
        (
            &["--csv", s(&out), "--svg", s(&out)],
            "is the same file as --csv",
        ),
        (
            &["--csv", s(&out), "--svg", s(&dotted)],
            "is the same file as --csv",
        ),
        (
            &["--model", s(&model), "--csv", s(&model)],
            "is the same file as --model",
        ),
    ];
    for (args, needle) in cases {
        one_line_failure(&kvattn_no_gpu(args), &format!("{args:?}"), needle);
        assert_eq!(listing(&dir), ["model.gguf"], "{args:?}");
    }
    assert_eq!(std::fs::read(&model).unwrap(), b"not really a model");
    let _ = std::fs::remove_dir_all(&dir);
}
