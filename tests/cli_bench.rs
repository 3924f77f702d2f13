//! `kvattn bench` end to end: the built binary measures small ceilings and a few tiny cases
//! (`--context`) on the adapter `WGPU_BACKEND` selects; its JSON has every documented key with
//! sane values; the CSV and SVG files are well-formed; bad flags fail with one line on stderr
//! and write nothing.
#![cfg(feature = "cli")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;

/// Keys every object must have.
const KEYS: [&str; 17] = [
    "kernel",
    "kv_dtype",
    "context",
    "batch",
    "q_heads",
    "kv_heads",
    "head_dim",
    "block_size",
    "paged",
    "seconds",
    "kv_bytes",
    "flops",
    "gbps",
    "copy_gbps",
    "gflops_peak",
    "roofline_seconds",
    "roofline_fraction",
];

/// Small ceilings and tiny cases: each run takes seconds.
const FAST: [&str; 5] = ["--quick", "--ceiling-mib", "8", "--context", "128"];

/// An adapter name no adapter has: a run that reaches the GPU fails with "no GPU adapter
/// found", so an error seen under it came before any GPU work.
const NO_ADAPTER: &str = "no-such-adapter-kvattn-test";

fn kvattn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvattn"))
        // The workgroup attention kernel unless the caller picks one (see tests/common).
        .env(
            "KVATTN_ATTENTION_KERNEL",
            std::env::var("KVATTN_ATTENTION_KERNEL").unwrap_or_else(|_| "workgroup".into()),
        )
        .arg("bench")
        .args(args)
        .output()
        .expect("run kvattn")
}

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvattn-cli-bench-{}-{name}-{}",
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

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn float(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

fn int(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not an integer in {v}"))
}

/// Runs with `FAST` and `args`, expects success and returns (stdout, stderr).
fn ok(args: &[&str]) -> (String, String) {
    let mut all = FAST.to_vec();
    all.extend_from_slice(args);
    let out = kvattn(&all);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "bench {all:?}: {stderr}");
    (String::from_utf8(out.stdout).unwrap(), stderr)
}

/// Expects failure with exactly one line on stderr containing `needle`.
fn fails(args: &[&str], needle: &str) {
    let out = kvattn(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "bench {args:?} succeeded");
    assert_eq!(stderr.lines().count(), 1, "bench {args:?}: {stderr}");
    assert!(stderr.starts_with("kvattn: "), "{stderr}");
    assert!(stderr.contains(needle), "bench {args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "bench {args:?} printed to stdout");
}

/// One GPU run (each process compiles its shaders anew): the JSON, the table's CSV and the plot.
#[test]
fn json_csv_and_plot_of_every_kernel_family() {
    let dir = temp_dir("run");
    let csv = dir.join("bench.csv");
    let svg = dir.join("bench.svg");
    let (stdout, stderr) = ok(&[
        "--filter",
        "decode/hd128/g4,decode/hd64,prefill,append_kv,mla,copy",
        "--repeats",
        "2",
        "--json",
        "--csv",
        s(&csv),
        "--plot",
        s(&svg),
    ]);
    assert!(stderr.contains("adapter: "), "no adapter line: {stderr}");
    assert!(stderr.contains("copy "), "no ceilings: {stderr}");
    let v: Value = serde_json::from_str(&stdout).expect("only one JSON array on stdout");
    let rows = v.as_array().expect("an array");
    let ids: Vec<&str> = rows.iter().map(|r| r["id"].as_str().unwrap()).collect();
    // Quick set at 128 keys: GQA decode in f16, int8, fp8-e4m3, int4, contiguous, batch 8;
    // head dim 64; prefill; append; MLA; copy.
    assert_eq!(rows.len(), 11, "{ids:?}");
    for r in rows {
        for key in KEYS {
            assert!(r.get(key).is_some(), "{key} missing from {r}");
        }
        let seconds = float(r, "seconds");
        assert!(seconds > 0.0 && seconds.is_finite(), "{r}");
        assert!(float(r, "copy_gbps") > 0.0, "{r}");
        assert!(float(r, "gflops_peak") > 0.0, "{r}");
        let fraction = float(r, "roofline_fraction");
        assert!(fraction > 0.0 && fraction.is_finite(), "{r}");
        let roofline = float(r, "roofline_seconds");
        assert!(
            (roofline / seconds - fraction).abs() <= 1e-9 * fraction,
            "{r}"
        );
        let gbps = float(r, "gbps");
        let bytes = int(r, "kv_bytes") as f64;
        assert!((gbps - bytes / seconds / 1e9).abs() <= 1e-9 * gbps, "{r}");
        assert_eq!(r["precision"], "f32");
    }
    let kernels: Vec<&str> = rows.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
    for k in ["decode", "prefill", "append_kv", "mla_absorbed", "copy"] {
        assert!(kernels.contains(&k), "{k} missing: {kernels:?}");
    }
    let r = rows
        .iter()
        .find(|r| r["id"] == "decode/hd64/g4/ctx128/b1/f16/bs16")
        .expect("the head dim 64 case");
    assert_eq!(r["kernel"], "decode");
    assert_eq!(r["kv_dtype"], "f16");
    assert_eq!(r["paged"], true);
    assert_eq!(
        [
            "context",
            "batch",
            "q_heads",
            "kv_heads",
            "head_dim",
            "block_size"
        ]
        .map(|k| int(r, k)),
        [128, 1, 32, 8, 64, 16]
    );
    // 128 tokens x 8 heads x (128 + 128) bytes; 4 x 32 heads x 64 dims x 128 keys.
    assert_eq!(int(r, "kv_bytes"), 262_144);
    assert_eq!(int(r, "flops"), 1_048_576);

    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    for key in KEYS {
        assert!(header.contains(&key), "{key} missing from {header:?}");
    }
    let id = header.iter().position(|&h| h == "id").unwrap();
    let csv_ids: Vec<&str> = lines
        .map(|l| {
            let cells: Vec<&str> = l.split(',').collect();
            assert_eq!(cells.len(), header.len(), "{l}");
            cells[id]
        })
        .collect();
    assert_eq!(csv_ids, ids);
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg"), "{}", &svg_text[..80]);
    assert!(svg_text.contains("int8") && svg_text.contains("roofline"));
    assert_eq!(listing(&dir), ["bench.csv", "bench.svg"]);
}

/// The table: the ceilings, a Markdown header and one line per case (cases without the
/// attention kernel, which is slow to compile in a debug build).
#[test]
fn table_of_copy_and_append() {
    let (stdout, _) = ok(&["--filter", "copy,append_kv", "--repeats", "1"]);
    assert!(stdout.contains("adapter: "), "{stdout}");
    assert!(stdout.contains("ceilings ("), "{stdout}");
    assert!(stdout.contains("| case"), "{stdout}");
    for id in [
        "copy/hd128/kv8/ctx128/b1/f16",
        "append_kv/hd128/kv8/tok128/b1/f16/bs16",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {id} ")))
            .unwrap_or_else(|| panic!("no row for {id}: {stdout}"));
        assert!(line.ends_with("| mem   |"), "{line}");
    }
}

#[test]
fn list_prints_ids_without_a_gpu_run() {
    let out = kvattn(&["--quick", "--list", "--filter", "decode/hd128/g4/ctx16384"]);
    assert!(out.status.success());
    let ids = String::from_utf8(out.stdout).unwrap();
    assert!(ids
        .lines()
        .any(|l| l == "decode/hd128/g4/ctx16384/b1/int4/bs16"));
    assert!(ids.lines().all(|l| l.contains("ctx16384")), "{ids}");
}

#[test]
fn bad_flags_fail_with_one_line_and_write_nothing() {
    let dir = temp_dir("bad");
    let csv = dir.join("bench.csv");
    let svg = dir.join("bench.svg");
    let files = ["--csv", s(&csv), "--plot", s(&svg)];
    let with = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = extra.iter().map(|x| x.to_string()).collect();
        v.extend(files.iter().map(|x| x.to_string()));
        v
    };
    let cases: [(&[&str], &str); 8] = [
        (&["--quick", "--repeats", "0"], "--repeats"),
        (&["--quick", "--precision", "f64"], "--precision"),
        (&["--quick", "--filter", "no-such-case"], "matches no case"),
        (&["--quick", "--context", "0"], "--context"),
        (&["--quick", "--ceiling-mib", "0"], "--ceiling-mib"),
        (&["--quick", "--repeats", "many"], "--repeats"),
        (&["--quick", "--bogus"], "--bogus"),
        (&["--quick", "--filter", "copy"], "--plot"),
    ];
    for (args, needle) in cases {
        let all = with(args);
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        fails(&refs, needle);
        assert!(listing(&dir).is_empty(), "bench {args:?} wrote files");
    }
    let missing = dir.join("no/such/dir/out.csv");
    fails(&["--quick", "--csv", s(&missing)], "does not exist");
    fails(&["--quick", "--plot", s(&dir)], "is a directory");
    assert!(listing(&dir).is_empty());
}

/// Two output flags naming one file (however spelt) are refused before the adapter is opened,
/// as one line naming both flags, and nothing is written.
#[test]
fn one_file_for_two_outputs_is_refused_before_any_gpu_work() {
    let dir = temp_dir("same");
    std::fs::create_dir(dir.join("sub")).unwrap();
    let out = dir.join("bench.out");
    for other in [
        out.clone(),
        dir.join(".").join("bench.out"),
        dir.join("sub").join("..").join("bench.out"),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_kvattn"))
            .env("WGPU_ADAPTER_NAME", NO_ADAPTER)
            .args(["bench", "--quick", "--csv", s(&out), "--plot", s(&other)])
            .output()
            .expect("run kvattn");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{other:?}: {err:?}");
        assert!(o.stdout.is_empty(), "{other:?}: printed to stdout");
        assert_eq!(err.lines().count(), 1, "{other:?}: {err:?}");
        assert!(
            err.starts_with("kvattn: ") && err.contains("is the same file as --csv"),
            "{other:?}: {err:?}"
        );
        assert!(err.contains("--plot"), "{err:?}");
        assert_eq!(listing(&dir), ["sub"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
