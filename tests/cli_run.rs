//! `kvattn run attention`, `kvattn run mla`, `kvattn run quantize`, `kvattn verify --quick` and `kvattn verify
//! --quality --quick` end to end: the built binary on case files written here, results compared
//! with the CPU reference and codec (quantized K/V: the reference on the CPU codec's stored
//! values); every kind of invalid input fails with one line on stderr and writes nothing. The
//! GPU runs use the adapter `WGPU_BACKEND` selects.
#![cfg(feature = "cli")]

#[path = "common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{max_abs_err, output_scale, Rng};
use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::quant::pack::words_to_le_bytes;
use kvattn::quant::{decode_rows, encode_rows, Fp8Format, Int4Params, KvDtype, ScaleMode};
use kvattn::reference;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

/// Whether `paged_attention_host` is implemented. While it is not, `run attention` on a valid
/// case must fail with its "not implemented yet" error (and write nothing).
const PAGED_IMPLEMENTED: bool = true;
const UNIMPLEMENTED: &str = "paged attention is not implemented yet";

fn kvattn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvattn"))
        // The workgroup attention kernel unless the caller picks one (see tests/common).
        .env(
            "KVATTN_ATTENTION_KERNEL",
            std::env::var("KVATTN_ATTENTION_KERNEL").unwrap_or_else(|_| "workgroup".into()),
        )
        .args(args)
        .output()
        .expect("run kvattn")
}

/// An adapter name no adapter has: a command that reaches the GPU fails with "no GPU adapter
/// found", so an error seen under it came before any GPU work.
const NO_ADAPTER: &str = "no-such-adapter-kvattn-test";

/// `kvattn args` run in `cwd` with [`NO_ADAPTER`].
fn kvattn_no_gpu(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvattn"))
        .env("WGPU_ADAPTER_NAME", NO_ADAPTER)
        .current_dir(cwd)
        .args(args)
        .output()
        .expect("run kvattn")
}

/// Expects `o` to have failed with exit status `code`, nothing on stdout and exactly one line
/// on stderr, starting `kvattn: ` and containing `needle`.
fn one_line_failure(o: &Output, code: i32, needle: &str, what: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "{what}: {err:?}");
    assert!(o.stdout.is_empty(), "{what}: printed to stdout");
    assert_eq!(
        err.lines().count(),
        1,
        "{what}: stderr is not one line: {err:?}"
    );
    assert!(err.starts_with("kvattn: "), "{what}: {err:?}");
    assert!(err.contains(needle), "{what}: {err:?} lacks {needle:?}");
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

/// A fresh, empty directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kvattn-cli-run-{}-{name}-{}",
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

/// A tensor to write: name, dtype, shape, little-endian bytes.
#[derive(Clone)]
struct RawTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn f32_t(name: &str, shape: Vec<usize>, data: &[f32]) -> RawTensor {
    RawTensor {
        name: name.into(),
        dtype: Dtype::F32,
        shape,
        bytes: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn i32_t(name: &str, data: &[i32]) -> RawTensor {
    RawTensor {
        name: name.into(),
        dtype: Dtype::I32,
        shape: vec![data.len()],
        bytes: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Tensors and metadata of a case file, editable before writing.
#[derive(Clone)]
struct CaseFile {
    tensors: Vec<RawTensor>,
    meta: HashMap<String, String>,
}

impl CaseFile {
    /// Replaces (or adds) a tensor.
    fn set(&mut self, t: RawTensor) -> &mut Self {
        self.tensors.retain(|x| x.name != t.name);
        self.tensors.push(t);
        self
    }

    fn meta(&mut self, key: &str, value: &str) -> &mut Self {
        self.meta.insert(key.into(), value.into());
        self
    }

    fn write(&self, path: &Path) {
        let views: Vec<(String, TensorView)> = self
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap(),
                )
            })
            .collect();
        let meta = (!self.meta.is_empty()).then(|| self.meta.clone());
        std::fs::write(path, safetensors::serialize(views, meta).unwrap()).unwrap();
    }
}

/// A random attention problem in the varlen layout.
struct Problem {
    shape: AttentionShape,
    opts: AttentionOptions,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
}

impl Problem {
    /// `lens` are `(len_q, len_k)` per sequence.
    fn new(hq: usize, hkv: usize, d: usize, dv: usize, lens: &[(usize, usize)], seed: u64) -> Self {
        let (mut cu_q, mut cu_k) = (vec![0u32], vec![0u32]);
        for &(lq, lk) in lens {
            cu_q.push(cu_q.last().unwrap() + lq as u32);
            cu_k.push(cu_k.last().unwrap() + lk as u32);
        }
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        let mut rng = Rng::new(seed);
        Self {
            shape: AttentionShape {
                num_q_heads: hq,
                num_kv_heads: hkv,
                head_dim_qk: d,
                head_dim_v: dv,
            },
            opts: AttentionOptions::default(),
            q: rng.normals(tq * hq * d, 1.0),
            k: rng.normals(tk * hkv * d, 1.0),
            v: rng.normals(tk * hkv * dv, 1.0),
            cu_q,
            cu_k,
        }
    }

    /// The case file of ARCHITECTURE.md section 12 for this problem.
    fn file(&self) -> CaseFile {
        let s = &self.shape;
        let (tq, tk) = (
            *self.cu_q.last().unwrap() as usize,
            *self.cu_k.last().unwrap() as usize,
        );
        let cu = |c: &[u32]| c.iter().map(|&x| x as i32).collect::<Vec<_>>();
        let mut f = CaseFile {
            tensors: vec![
                f32_t("q", vec![tq, s.num_q_heads, s.head_dim_qk], &self.q),
                f32_t("k", vec![tk, s.num_kv_heads, s.head_dim_qk], &self.k),
                f32_t("v", vec![tk, s.num_kv_heads, s.head_dim_v], &self.v),
                i32_t("cu_seqlens_q", &cu(&self.cu_q)),
                i32_t("cu_seqlens_k", &cu(&self.cu_k)),
            ],
            meta: HashMap::new(),
        };
        let o = &self.opts;
        if !o.causal {
            f.meta("causal", "false");
        }
        if let Some(x) = o.scale {
            f.meta("scale", &x.to_string());
        }
        if let Some(w) = o.sliding_window {
            f.meta("sliding_window", &w.to_string());
        }
        if let Some(c) = o.softcap {
            f.meta("softcap", &c.to_string());
        }
        if let Some(x) = &o.sinks {
            f.set(f32_t("sinks", vec![x.len()], x));
        }
        if let Some(x) = &o.alibi_slopes {
            f.set(f32_t("alibi_slopes", vec![x.len()], x));
        }
        f
    }

    /// The reference on the values the CPU codec stores for K in `k` and V in `v` (storage
    /// format and scale mode): quantized, then dequantized.
    fn reference(&self, k: Storage, v: Storage) -> reference::AttentionOutput {
        let stored = |(dtype, mode): Storage, d, x: &[f32]| {
            decode_rows(&encode_rows(dtype, d, x, mode).unwrap()).unwrap()
        };
        let k = stored(k, self.shape.head_dim_qk, &self.k);
        let v = stored(v, self.shape.head_dim_v, &self.v);
        let batch = RaggedBatch {
            q: &self.q,
            k: &k,
            v: &v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
        };
        reference::attention(&batch, &self.shape, &self.opts).unwrap()
    }
}

/// A storage format and its scale mode.
type Storage = (KvDtype, ScaleMode);

/// `dtype` with scales per token row (the default of `run attention`).
fn per_row(dtype: KvDtype) -> Storage {
    (dtype, ScaleMode::PerRow)
}

/// A result file: tensors as (shape, f32 or u8 values) and metadata.
struct Result_ {
    f32s: HashMap<String, (Vec<usize>, Vec<f32>)>,
    u8s: HashMap<String, (Vec<usize>, Vec<u8>)>,
    meta: HashMap<String, String>,
}

fn read_result(path: &Path) -> Result_ {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut r = Result_ {
        f32s: HashMap::new(),
        u8s: HashMap::new(),
        meta: header.metadata().clone().unwrap_or_default(),
    };
    for (name, t) in st.tensors() {
        match t.dtype() {
            Dtype::F32 => {
                let x = t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                r.f32s.insert(name, (t.shape().to_vec(), x));
            }
            Dtype::U8 => {
                r.u8s.insert(name, (t.shape().to_vec(), t.data().to_vec()));
            }
            other => panic!("unexpected dtype {other:?} of {name}"),
        }
    }
    r
}

/// Whether the adapter has shader-f16 (from `kvattn info --json`).
fn has_f16() -> bool {
    let out = kvattn(&["info", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["features"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f == "shader-f16")
}

/// Runs `run attention` on `p` with `flags` and checks the result against the reference on the
/// stored values (f32 precision: 1e-4 of the output scale; f16: 1e-2), K and V stored with
/// scales per token row.
fn check_attention(name: &str, p: &Problem, flags: &[&str], k: KvDtype, v: KvDtype) {
    check_attention_file(name, p, &p.file(), flags, per_row(k), per_row(v));
}

/// [`check_attention`] on the case file `file` of `p` (which may carry `k_scale` / `v_scale`),
/// with K and V stored as `k` and `v`.
fn check_attention_file(
    name: &str,
    p: &Problem,
    file: &CaseFile,
    flags: &[&str],
    k: Storage,
    v: Storage,
) {
    let dir = temp_dir(name);
    let (case, out) = (dir.join("case.safetensors"), dir.join("out.safetensors"));
    file.write(&case);
    let mut args = vec!["run", "attention", "--in", s(&case), "--out", s(&out)];
    args.extend_from_slice(flags);
    let o = kvattn(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    if !PAGED_IMPLEMENTED {
        assert!(
            !o.status.success(),
            "{name}: succeeded before the kernel exists"
        );
        assert!(err.contains(UNIMPLEMENTED), "{name}: {err}");
        assert!(!out.exists(), "{name}: wrote a result on error");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    assert!(o.status.success(), "{name}: {err}");
    let r = read_result(&out);
    let sh = &p.shape;
    let tq = *p.cu_q.last().unwrap() as usize;
    let (out_shape, got_out) = &r.f32s["out"];
    let (lse_shape, got_lse) = &r.f32s["lse"];
    assert_eq!(out_shape, &vec![tq, sh.num_q_heads, sh.head_dim_v]);
    assert_eq!(lse_shape, &vec![tq, sh.num_q_heads]);
    let f16 = flags.windows(2).any(|w| w == ["--precision", "f16"]);
    assert_eq!(r.meta["precision"], if f16 { "f16" } else { "f32" });
    assert!(!r.meta["adapter"].is_empty() && !r.meta["backend"].is_empty());
    assert_eq!(r.meta["k_dtype"], k.0.name(), "{name}");
    assert_eq!(r.meta["v_dtype"], v.0.name(), "{name}");
    for (key, (_, mode)) in [("k_scale", k), ("v_scale", v)] {
        match mode {
            ScaleMode::PerTensor(sc) => {
                assert_eq!(r.meta[key].parse::<f32>().unwrap(), sc, "{name} {key}")
            }
            ScaleMode::PerRow => assert!(!r.meta.contains_key(key), "{name} {key}"),
        }
    }
    let want = p.reference(k, v);
    let scale = output_scale(&want.out);
    let tol = if f16 { 1e-2 } else { 1e-4 };
    let (e, le) = (
        max_abs_err(got_out, &want.out),
        max_abs_err(got_lse, &want.lse),
    );
    assert!(e <= tol * scale, "{name}: out error {e:e}");
    assert!(le <= tol, "{name}: lse error {le:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_attention_decode_batch_matches_reference() {
    // GQA 4, four sequences of one query each, context lengths 1, 17, 97, 200.
    let p = Problem::new(8, 2, 64, 64, &[(1, 1), (1, 17), (1, 97), (1, 200)], 1);
    check_attention("decode-f32", &p, &[], KvDtype::F32, KvDtype::F32);
}

#[test]
fn run_attention_prefill_with_options_matches_reference() {
    // Chunks after cached prefixes, every option, f16 storage, block size 8.
    let mut p = Problem::new(4, 1, 32, 32, &[(5, 5), (3, 40), (1, 9), (16, 70)], 2);
    p.opts = AttentionOptions {
        scale: Some(0.2),
        sliding_window: Some(12),
        softcap: Some(4.0),
        sinks: Some(vec![0.5, -1.0, 0.0, 2.0]),
        alibi_slopes: Some(vec![0.25, 0.125, 0.0625, 0.03125]),
        causal: true,
    };
    check_attention(
        "prefill-options-f16kv",
        &p,
        &["--kv-dtype", "f16", "--block-size", "8"],
        KvDtype::F16,
        KvDtype::F16,
    );
}

#[test]
fn run_attention_mixed_dtypes_and_head_dims() {
    // d_v != d_qk, K in bf16 and V in f16, non-causal, block size 1, MHA.
    let mut p = Problem::new(2, 2, 48, 16, &[(2, 7), (4, 4)], 3);
    p.opts.causal = false;
    check_attention(
        "mixed",
        &p,
        &["--k-dtype", "bf16", "--v-dtype", "f16", "--block-size", "1"],
        KvDtype::Bf16,
        KvDtype::F16,
    );
    // --k-dtype overrides --kv-dtype for K only.
    check_attention(
        "override",
        &p,
        &[
            "--kv-dtype",
            "bf16",
            "--v-dtype",
            "f32",
            "--block-size",
            "128",
        ],
        KvDtype::Bf16,
        KvDtype::F32,
    );
}

#[test]
fn run_attention_quantized_kv_matches_reference_on_stored_values() {
    // Every quantized format, K and V alone or mixed, per-row and per-tensor FP8 scales, decode
    // and prefill batches; the reference runs on the CPU codec's stored values and the
    // tolerance is the f32 one.
    let decode = Problem::new(8, 2, 64, 64, &[(1, 1), (1, 17), (1, 97), (1, 200)], 21);
    let mut prefill = Problem::new(4, 1, 32, 32, &[(5, 5), (3, 40), (1, 9), (16, 70)], 22);
    prefill.opts.sliding_window = Some(12);
    prefill.opts.softcap = Some(4.0);
    for dtype in [
        KvDtype::Fp8E4M3,
        KvDtype::Fp8E5M2,
        KvDtype::Int8,
        KvDtype::Int4,
    ] {
        let name = dtype.name();
        check_attention(
            &format!("decode-{name}"),
            &decode,
            &["--kv-dtype", name],
            dtype,
            dtype,
        );
        check_attention(
            &format!("prefill-{name}"),
            &prefill,
            &["--kv-dtype", name, "--block-size", "8"],
            dtype,
            dtype,
        );
    }
    // K int8, V int4 (and the other way), d_v != d_qk.
    let mut mixed = Problem::new(4, 2, 96, 64, &[(1, 33), (6, 50)], 23);
    mixed.opts.causal = false;
    check_attention(
        "int8-k-int4-v",
        &mixed,
        &[
            "--k-dtype",
            "int8",
            "--v-dtype",
            "int4",
            "--block-size",
            "1",
        ],
        KvDtype::Int8,
        KvDtype::Int4,
    );
    check_attention(
        "int4-k-fp8-v",
        &mixed,
        &["--kv-dtype", "fp8-e5m2", "--k-dtype", "int4"],
        KvDtype::Int4,
        KvDtype::Fp8E5M2,
    );
    // Static per-tensor FP8 scales from the case file: both, and K only (V per row).
    let amax = |x: &[f32]| x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (ks, vs) = (amax(&decode.k) / 448.0, amax(&decode.v) / 57344.0 * 64.0);
    let mut f = decode.file();
    f.meta("k_scale", &ks.to_string())
        .meta("v_scale", &vs.to_string());
    check_attention_file(
        "per-tensor",
        &decode,
        &f,
        &["--k-dtype", "fp8-e4m3", "--v-dtype", "fp8-e5m2"],
        (KvDtype::Fp8E4M3, ScaleMode::PerTensor(ks)),
        (KvDtype::Fp8E5M2, ScaleMode::PerTensor(vs)),
    );
    let mut f = prefill.file();
    f.meta("k_scale", "0.0078125");
    check_attention_file(
        "per-tensor-k-only",
        &prefill,
        &f,
        &["--kv-dtype", "fp8-e4m3", "--block-size", "32"],
        (KvDtype::Fp8E4M3, ScaleMode::PerTensor(0.0078125)),
        per_row(KvDtype::Fp8E4M3),
    );
}

#[test]
fn run_attention_f16_precision_where_available() {
    if !has_f16() {
        eprintln!("adapter without shader-f16: only the f32 kernels run");
        return;
    }
    let p = Problem::new(8, 1, 64, 64, &[(1, 30), (6, 50)], 4);
    check_attention(
        "f16-precision",
        &p,
        &["--kv-dtype", "f16", "--precision", "f16"],
        KvDtype::F16,
        KvDtype::F16,
    );
}

/// Runs `run attention` on `file` with `flags`; expects a non-zero exit, exactly one line on
/// stderr containing `needle`, nothing on stdout and no output file.
fn rejects(name: &str, file: Option<&CaseFile>, flags: &[&str], needle: &str) {
    rejects_op("attention", name, file, flags, needle);
}

/// [`rejects`] for `run OP`.
fn rejects_op(op: &str, name: &str, file: Option<&CaseFile>, flags: &[&str], needle: &str) {
    let dir = temp_dir(name);
    let (case, out) = (dir.join("case.safetensors"), dir.join("out.safetensors"));
    if let Some(f) = file {
        f.write(&case);
    }
    let mut args = vec!["run", op, "--in", s(&case), "--out", s(&out)];
    args.extend_from_slice(flags);
    let o = kvattn(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{name}: succeeded");
    assert!(o.stdout.is_empty(), "{name}: printed to stdout");
    assert_eq!(
        err.lines().count(),
        1,
        "{name}: stderr is not one line: {err:?}"
    );
    assert!(err.starts_with("kvattn: "), "{name}: {err:?}");
    assert!(err.contains(needle), "{name}: {err:?} lacks {needle:?}");
    assert!(!out.exists(), "{name}: wrote {}", out.display());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "case.safetensors")
        .collect();
    assert!(leftovers.is_empty(), "{name}: left {leftovers:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_attention_rejects_invalid_input() {
    let p = Problem::new(4, 2, 16, 16, &[(1, 5), (2, 6)], 5);
    let good = p.file();
    let edit = |f: &dyn Fn(&mut CaseFile)| {
        let mut c = good.clone();
        f(&mut c);
        c
    };
    // Head dim not a multiple of 4.
    let d6 = Problem::new(4, 2, 6, 6, &[(1, 5)], 6).file();
    rejects("head-dim", Some(&d6), &[], "multiple of 4");
    // Query heads not a multiple of KV heads.
    let h3 = Problem::new(3, 2, 16, 16, &[(1, 5)], 7).file();
    rejects("heads", Some(&h3), &[], "multiple of num_kv_heads");
    // Inconsistent offsets: decreasing, not ending at the row count, different counts.
    let f = edit(&|c| {
        c.set(i32_t("cu_seqlens_q", &[0, 2, 1, 3]));
        c.set(i32_t("cu_seqlens_k", &[0, 5, 8, 11]));
    });
    rejects("cu-decreasing", Some(&f), &[], "non-decreasing");
    let f = edit(&|c| {
        c.set(i32_t("cu_seqlens_k", &[0, 5, 10]));
    });
    rejects(
        "cu-end",
        Some(&f),
        &[],
        "cu_seqlens_k ends at 10 but k has 11",
    );
    let f = edit(&|c| {
        c.set(i32_t("cu_seqlens_k", &[0, 11]));
    });
    rejects("cu-count", Some(&f), &[], "cu_seqlens_k");
    let f = edit(&|c| {
        c.set(i32_t("cu_seqlens_q", &[0, -1, 3]));
    });
    rejects("cu-negative", Some(&f), &[], "negative");
    // len_q > len_k under the causal mask.
    let long_q = Problem::new(4, 2, 16, 16, &[(4, 3)], 8).file();
    rejects("len-q", Some(&long_q), &[], "len_q <= len_k");
    // K and V with different token counts.
    let f = edit(&|c| {
        c.set(f32_t("v", vec![10, 2, 16], &vec![0.0; 10 * 2 * 16]));
    });
    rejects("kv-len", Some(&f), &[], "k has 11 token rows but v has 10");
    // An empty sequence.
    let empty = Problem::new(4, 2, 16, 16, &[(1, 5), (0, 0)], 9).file();
    rejects("empty", Some(&empty), &[], "empty");
    // A window without the causal mask.
    let f = edit(&|c| {
        c.meta("causal", "false").meta("sliding_window", "4");
    });
    rejects("window", Some(&f), &[], "sliding_window needs causal");
    // Block size not a power of two.
    rejects(
        "block-size",
        Some(&good),
        &["--block-size", "12"],
        "power of two",
    );
    rejects(
        "block-size-big",
        Some(&good),
        &["--block-size", "512"],
        "power of two",
    );
    // Missing file; not safetensors.
    rejects("missing", None, &[], "cannot read");
    let dir = temp_dir("not-st");
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"this is not a tensor file at all").unwrap();
    let out = dir.join("out.safetensors");
    let o = kvattn(&["run", "attention", "--in", s(&junk), "--out", s(&out)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.lines().count() == 1, "{err}");
    assert!(err.contains("not a safetensors file"), "{err}");
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&dir);
    // Wrong dtype or rank of a tensor; a missing tensor.
    let f = edit(&|c| {
        c.set(RawTensor {
            name: "q".into(),
            dtype: Dtype::F16,
            shape: vec![3, 4, 16],
            bytes: vec![0; 3 * 4 * 16 * 2],
        });
    });
    rejects("q-dtype", Some(&f), &[], "tensor q");
    let f = edit(&|c| {
        c.set(f32_t("q", vec![3, 64], &p.q));
    });
    rejects("q-rank", Some(&f), &[], "expected F32 [total_q, Hq, d]");
    let f = edit(&|c| {
        c.set(f32_t("cu_seqlens_k", vec![3], &[0.0, 5.0, 11.0]));
    });
    rejects("cu-dtype", Some(&f), &[], "expected I32");
    let f = edit(&|c| {
        c.tensors.retain(|t| t.name != "v");
    });
    rejects("no-v", Some(&f), &[], "no tensor v");
    // Per-head tensors of the wrong length; metadata that does not parse.
    let f = edit(&|c| {
        c.set(f32_t("sinks", vec![3], &[0.0; 3]));
    });
    rejects("sinks", Some(&f), &[], "sinks has 3 entries");
    let f = edit(&|c| {
        c.meta("causal", "maybe");
    });
    rejects("causal", Some(&f), &[], "metadata causal");
    let f = edit(&|c| {
        c.meta("softcap", "-1");
    });
    rejects("softcap", Some(&f), &[], "softcap");
    // Storage formats: unknown; int4 with a head dim not a multiple of 32 (16 here).
    rejects(
        "dtype",
        Some(&good),
        &["--kv-dtype", "int2"],
        "unknown KV dtype",
    );
    rejects(
        "int4-head-dim",
        Some(&good),
        &["--v-dtype", "int4"],
        "multiple of 32",
    );
    // Per-tensor scales: FP8 only, positive normal, a number.
    let f = edit(&|c| {
        c.meta("k_scale", "0.5");
    });
    rejects("k-scale-int8", Some(&f), &["--kv-dtype", "int8"], "k_scale");
    rejects("k-scale-f16", Some(&f), &["--kv-dtype", "f16"], "FP8 only");
    let f = edit(&|c| {
        c.meta("v_scale", "0");
    });
    rejects(
        "v-scale-zero",
        Some(&f),
        &["--kv-dtype", "fp8-e4m3"],
        "positive normal",
    );
    let f = edit(&|c| {
        c.meta("v_scale", "big");
    });
    rejects(
        "v-scale-nan",
        Some(&f),
        &["--kv-dtype", "fp8-e5m2"],
        "metadata v_scale",
    );
    rejects(
        "precision",
        Some(&good),
        &["--precision", "f64"],
        "unknown precision",
    );
}

/// A valid case file of each `run` op, with the flags it needs.
fn valid_cases() -> [(&'static str, CaseFile, &'static [&'static str]); 3] {
    let quantize = CaseFile {
        tensors: vec![f32_t("x", vec![2, 1, 8], &[0.5; 16])],
        meta: HashMap::new(),
    };
    [
        (
            "attention",
            Problem::new(2, 1, 8, 8, &[(1, 3)], 10).file(),
            &[],
        ),
        (
            "mla",
            MlaProblem::new(small_mla_shape(), &[(1, 3)], 12).file(),
            &[],
        ),
        ("quantize", quantize, &["--kv-dtype", "f16"]),
    ]
}

/// A missing output directory or an output that is a directory is reported before the kernel
/// runs (the adapter is never opened), as one line naming `--out`, and nothing is written.
#[test]
fn run_checks_the_destination_before_any_gpu_work() {
    for (op, file, flags) in valid_cases() {
        let dir = temp_dir(&format!("bad-dest-{op}"));
        file.write(&dir.join("case.safetensors"));
        std::fs::create_dir(dir.join("sub")).unwrap();
        for (out, needle) in [
            (
                "no-such-dir/out.safetensors",
                "the directory no-such-dir does not exist",
            ),
            ("sub", "--out sub is a directory"),
        ] {
            let mut args = vec!["run", op, "--in", "case.safetensors", "--out", out];
            args.extend_from_slice(flags);
            let o = kvattn_no_gpu(&dir, &args);
            one_line_failure(&o, 1, needle, &format!("{op} --out {out}"));
            assert_eq!(listing(&dir), ["case.safetensors", "sub"], "{op} {out}");
            assert_eq!(
                listing(&dir.join("sub")),
                Vec::<String>::new(),
                "{op} {out}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `--out` naming the `--in` file, however spelt (the same name, `./`, through a directory and
/// back, absolute against relative, a symlink either way), is refused before any GPU work and
/// leaves the input as it was.
#[cfg(unix)]
#[test]
fn run_refuses_an_output_that_is_its_input() {
    for (op, file, flags) in valid_cases() {
        let dir = temp_dir(&format!("same-{op}"));
        let case = dir.join("case.safetensors");
        file.write(&case);
        let before = std::fs::read(&case).unwrap();
        std::os::unix::fs::symlink("case.safetensors", dir.join("link.safetensors")).unwrap();
        std::fs::create_dir(dir.join("sub")).unwrap();
        for (input, out) in [
            ("case.safetensors", "case.safetensors"),
            ("case.safetensors", "./case.safetensors"),
            ("./case.safetensors", "sub/../case.safetensors"),
            ("case.safetensors", s(&case)),
            ("case.safetensors", "link.safetensors"),
            ("link.safetensors", "case.safetensors"),
        ] {
            let mut args = vec!["run", op, "--in", input, "--out", out];
            args.extend_from_slice(flags);
            let o = kvattn_no_gpu(&dir, &args);
            let what = format!("{op} --in {input} --out {out}");
            one_line_failure(&o, 1, "is the same file as --in", &what);
            assert_eq!(
                std::fs::read(&case).unwrap(),
                before,
                "{what}: input changed"
            );
            assert_eq!(
                listing(&dir),
                ["case.safetensors", "link.safetensors", "sub"],
                "{what}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A misspelt tensor or metadata key is refused, naming it and the accepted ones, for every
/// op; the metadata key `format` (PyTorch's writer adds it) is accepted.
#[test]
fn run_refuses_unknown_tensors_and_metadata_keys() {
    let [(_, attention, _), (_, mla, _), (_, quantize, _)] = valid_cases();
    let edit = |file: &CaseFile, f: &dyn Fn(&mut CaseFile)| {
        let mut c = file.clone();
        f(&mut c);
        c
    };
    let sink = edit(&attention, &|c| {
        c.set(f32_t("sink", vec![2], &[0.0, 0.0]));
    });
    rejects(
        "unknown-sink",
        Some(&sink),
        &[],
        "unknown tensor \"sink\"; accepted: q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, \
         alibi_slopes",
    );
    let window = edit(&attention, &|c| {
        c.meta("sliding-window", "2");
    });
    rejects(
        "unknown-window",
        Some(&window),
        &[],
        "unknown metadata key \"sliding-window\"; accepted: causal, scale, sliding_window, \
         softcap, k_scale, v_scale, format",
    );
    let w = edit(&mla, &|c| {
        c.set(f32_t("w_kv", vec![1], &[0.0]));
    });
    rejects_op(
        "mla",
        "unknown-w-kv",
        Some(&w),
        &[],
        "unknown tensor \"w_kv\"",
    );
    let latent = edit(&mla, &|c| {
        c.meta("latent-scale", "0.5");
    });
    rejects_op(
        "mla",
        "unknown-latent-scale",
        Some(&latent),
        &["--kv-dtype", "fp8-e4m3"],
        "unknown metadata key \"latent-scale\"; accepted: scale, latent_scale, format",
    );
    let y = edit(&quantize, &|c| {
        c.set(f32_t("y", vec![1], &[0.0]));
    });
    rejects_op(
        "quantize",
        "unknown-y",
        Some(&y),
        &["--kv-dtype", "f16"],
        "unknown tensor \"y\"; accepted: x",
    );
    let scales = edit(&quantize, &|c| {
        c.meta("scales", "0.5");
    });
    rejects_op(
        "quantize",
        "unknown-scales",
        Some(&scales),
        &["--kv-dtype", "fp8-e4m3"],
        "unknown metadata key \"scales\"; accepted: scale, format",
    );
    // `format` passes the name check: the next check speaks (or the run succeeds).
    let pt = |file: &CaseFile| {
        edit(file, &|c| {
            c.meta("format", "pt");
        })
    };
    let bad_rank = edit(&pt(&mla), &|c| {
        c.set(f32_t("w_uk", vec![3, 8, 16], &[0.0; 3 * 8 * 16]));
    });
    rejects_op("mla", "format-mla", Some(&bad_rank), &[], "w_uk's rank");
    rejects_op(
        "quantize",
        "format-quantize",
        Some(&pt(&quantize)),
        &["--kv-dtype", "int4"],
        "multiple of 32",
    );
    let p = Problem::new(2, 1, 8, 8, &[(1, 3)], 10);
    let f32_rows = per_row(KvDtype::F32);
    check_attention_file(
        "format-attention",
        &p,
        &pt(&p.file()),
        &[],
        f32_rows,
        f32_rows,
    );
}

/// Usage errors of every subcommand are one line on stderr with clap's exit status (2), as
/// the other errors are; `--help` still prints the full help.
#[test]
fn usage_errors_are_one_line() {
    let dir = temp_dir("usage");
    let cases: [(&[&str], &str); 10] = [
        (&["run", "attention"], "run attention: the following required arguments were not provided: --in <CASE>, --out <RESULT>"),
        (&["run", "attention", "--in", "a", "--out", "b", "--bogus"], "run attention: unexpected argument '--bogus'"),
        (&["run", "attention", "--in", "a", "--out", "b", "--block-size", "x"], "--block-size"),
        (&["run", "mla", "--in", "a", "--out", "b", "--up-proj-chunk", "-3"], "run mla: "),
        (&["run", "quantize", "--in", "a", "--out", "b"], "--kv-dtype"),
        (&["run", "attnetion"], "run: unrecognized subcommand 'attnetion'"),
        (&["verify", "--bogus"], "verify: unexpected argument '--bogus'"),
        (&["verify", "--quality", "--kernel", "decode"], "verify: "),
        (&["info", "--bogus"], "info: unexpected argument '--bogus'"),
        (&["bogus"], "unrecognized subcommand 'bogus'"),
    ];
    for (args, needle) in cases {
        let o = kvattn_no_gpu(&dir, args);
        one_line_failure(&o, 2, needle, &format!("{args:?}"));
    }
    for args in [
        &["run", "attention", "--help"][..],
        &["run", "--help"],
        &["--help"],
    ] {
        let o = kvattn_no_gpu(&dir, args);
        assert!(o.status.success(), "{args:?}");
        let help = String::from_utf8_lossy(&o.stdout);
        assert!(
            help.lines().count() > 5 && help.contains("Usage:"),
            "{args:?}: {help}"
        );
    }
    assert!(listing(&dir).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A random MLA problem in the varlen layout (ARCHITECTURE.md section 12, `run mla`).
struct MlaProblem {
    shape: reference::mla::MlaShape,
    tensors: Vec<(&'static str, Vec<usize>, Vec<f32>)>,
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
}

impl MlaProblem {
    fn new(shape: reference::mla::MlaShape, lens: &[(usize, usize)], seed: u64) -> Self {
        let (mut cu_q, mut cu_k) = (vec![0u32], vec![0u32]);
        for &(lq, lk) in lens {
            cu_q.push(cu_q.last().unwrap() + lq as u32);
            cu_k.push(cu_k.last().unwrap() + lk as u32);
        }
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        let mut rng = Rng::new(seed);
        let sh = shape;
        let h = sh.num_heads;
        let mut t = |name, dims: Vec<usize>, scale: f32| {
            let n = dims.iter().product();
            (name, dims, rng.normals(n, scale))
        };
        let tensors = vec![
            t("q_nope", vec![tq, h, sh.d_nope], 1.0),
            t("q_pe", vec![tq, h, sh.d_rope], 1.0),
            t("c_kv", vec![tk, sh.rank], 1.0),
            t("k_pe", vec![tk, sh.d_rope], 1.0),
            t(
                "w_uk",
                vec![h, sh.d_nope, sh.rank],
                1.0 / (sh.d_nope as f32).sqrt(),
            ),
            t(
                "w_uv",
                vec![h, sh.rank, sh.d_v],
                1.0 / (sh.rank as f32).sqrt(),
            ),
        ];
        Self {
            shape,
            tensors,
            cu_q,
            cu_k,
        }
    }

    fn get(&self, name: &str) -> &[f32] {
        &self.tensors.iter().find(|t| t.0 == name).unwrap().2
    }

    fn file(&self) -> CaseFile {
        let cu = |c: &[u32]| c.iter().map(|&x| x as i32).collect::<Vec<_>>();
        let mut tensors: Vec<RawTensor> = self
            .tensors
            .iter()
            .map(|(name, dims, data)| f32_t(name, dims.clone(), data))
            .collect();
        tensors.push(i32_t("cu_seqlens_q", &cu(&self.cu_q)));
        tensors.push(i32_t("cu_seqlens_k", &cu(&self.cu_k)));
        CaseFile {
            tensors,
            meta: HashMap::new(),
        }
    }

    /// The reference on the latent as a cache of `latent` stores it (the RoPE keys in f32 with
    /// an f32 latent, bf16 with bf16, f16 otherwise).
    fn reference(&self, latent: KvDtype, mode: ScaleMode) -> reference::AttentionOutput {
        let sh = &self.shape;
        let c_kv =
            decode_rows(&encode_rows(latent, sh.rank, self.get("c_kv"), mode).unwrap()).unwrap();
        let rope = match latent {
            KvDtype::F32 => KvDtype::F32,
            KvDtype::Bf16 => KvDtype::Bf16,
            _ => KvDtype::F16,
        };
        let k_pe = decode_rows(
            &encode_rows(rope, sh.d_rope, self.get("k_pe"), ScaleMode::PerRow).unwrap(),
        )
        .unwrap();
        let batch = reference::mla::MlaBatch {
            q_nope: self.get("q_nope"),
            q_pe: self.get("q_pe"),
            c_kv: &c_kv,
            k_pe: &k_pe,
            w_uk: self.get("w_uk"),
            w_uv: self.get("w_uv"),
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
        };
        reference::mla::mla(&batch, sh, None).unwrap()
    }
}

fn small_mla_shape() -> reference::mla::MlaShape {
    reference::mla::MlaShape {
        num_heads: 3,
        d_nope: 8,
        d_rope: 4,
        rank: 32,
        d_v: 12,
    }
}

#[test]
fn run_mla_matches_reference_on_both_paths() {
    // A ragged batch (a decode row, a chunk after a prefix); the latent in f32, per-tensor FP8
    // (metadata latent_scale) and int4; the up-projection path in chunks of 4 keys.
    let p = MlaProblem::new(small_mla_shape(), &[(1, 5), (3, 9)], 41);
    let sh = p.shape;
    let tq = *p.cu_q.last().unwrap() as usize;
    for (latent, scale) in [
        (KvDtype::F32, None),
        (KvDtype::Fp8E4M3, Some(0.0625f32)),
        (KvDtype::Int4, None),
    ] {
        let mut file = p.file();
        if let Some(x) = scale {
            file.meta("latent_scale", &x.to_string());
        }
        let mode = scale.map_or(ScaleMode::PerRow, ScaleMode::PerTensor);
        let want = p.reference(latent, mode);
        for path in [
            &["--path", "absorbed"][..],
            &["--path", "up-proj", "--up-proj-chunk", "4"],
        ] {
            let name = format!("mla-{latent}-{}", path[1]);
            let dir = temp_dir(&name);
            let (case, out) = (dir.join("case.safetensors"), dir.join("out.safetensors"));
            file.write(&case);
            let mut args = vec!["run", "mla", "--in", s(&case), "--out", s(&out)];
            args.extend_from_slice(path);
            args.extend_from_slice(&["--kv-dtype", latent.name(), "--block-size", "4"]);
            let o = kvattn(&args);
            assert!(
                o.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            let r = read_result(&out);
            let (out_shape, got) = &r.f32s["out"];
            let (lse_shape, got_lse) = &r.f32s["lse"];
            assert_eq!(out_shape, &vec![tq, sh.num_heads, sh.d_v]);
            assert_eq!(lse_shape, &vec![tq, sh.num_heads]);
            assert_eq!(r.meta["path"], path[1]);
            assert_eq!(r.meta["kv_dtype"], latent.name());
            let scale_out = output_scale(&want.out);
            let (e, le) = (max_abs_err(got, &want.out), max_abs_err(got_lse, &want.lse));
            assert!(e <= 1e-4 * scale_out, "{name}: out error {e:e}");
            assert!(
                le <= 1e-4 * output_scale(&want.lse),
                "{name}: lse error {le:e}"
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
fn run_mla_rejects_invalid_input() {
    let p = MlaProblem::new(small_mla_shape(), &[(1, 5), (2, 6)], 43);
    let good = p.file();
    let edit = |f: &dyn Fn(&mut CaseFile)| {
        let mut c = good.clone();
        f(&mut c);
        c
    };
    let sh = p.shape;
    let no_w_uk = edit(&|c| c.tensors.retain(|t| t.name != "w_uk"));
    rejects_op("mla", "mla-missing", Some(&no_w_uk), &[], "no tensor w_uk");
    let bad_rank = edit(&|c| {
        c.set(f32_t("w_uk", vec![3, 8, 16], &[0.0; 3 * 8 * 16]));
    });
    rejects_op("mla", "mla-rank", Some(&bad_rank), &[], "w_uk's rank");
    let bad_heads = edit(&|c| {
        c.set(f32_t("w_uv", vec![2, 32, 12], &[0.0; 2 * 32 * 12]));
    });
    rejects_op("mla", "mla-heads", Some(&bad_heads), &[], "w_uv's heads");
    let bad_rope = edit(&|c| {
        c.set(f32_t("k_pe", vec![11, 8], &[0.0; 88]));
    });
    rejects_op("mla", "mla-rope", Some(&bad_rope), &[], "k_pe's RoPE dims");
    let bad_cu = edit(&|c| {
        c.set(i32_t("cu_seqlens_k", &[0, 5, 10]));
    });
    rejects_op(
        "mla",
        "mla-cu",
        Some(&bad_cu),
        &[],
        "cu_seqlens_k ends at 10",
    );
    let long_q = edit(&|c| {
        c.set(i32_t("cu_seqlens_k", &[0, 1, 11]));
        c.set(f32_t("q_nope", vec![3, 3, 8], &[0.0; 72]));
        c.set(f32_t("q_pe", vec![3, 3, 4], &[0.0; 36]));
        c.set(i32_t("cu_seqlens_q", &[0, 2, 3]));
    });
    rejects_op("mla", "mla-causal", Some(&long_q), &[], "len_q 2 > len_k 1");
    let mut nan = p.get("c_kv").to_vec();
    nan[7] = f32::NAN;
    let nan_file = edit(&|c| {
        c.set(f32_t("c_kv", vec![11, sh.rank], &nan));
    });
    // A NaN latent value is stored (an int8 row holding it is poisoned) and shows: the queries
    // of sequence 0 all see token 0, so their rows are NaN; sequence 1's are not.
    let dir = temp_dir("mla-nan");
    let (case, out) = (dir.join("case.safetensors"), dir.join("out.safetensors"));
    nan_file.write(&case);
    let o = kvattn(&[
        "run",
        "mla",
        "--in",
        s(&case),
        "--out",
        s(&out),
        "--kv-dtype",
        "int8",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = read_result(&out);
    let (shape, lse) = &r.f32s["lse"];
    let first = p.cu_q[1] as usize * shape[1];
    assert!(lse[..first].iter().all(|x| x.is_nan()), "{lse:?}");
    assert!(lse[first..].iter().all(|x| x.is_finite()), "{lse:?}");
    let _ = std::fs::remove_dir_all(&dir);
    let scaled = edit(&|c| {
        c.meta("latent_scale", "0.5");
    });
    rejects_op(
        "mla",
        "mla-scale-int8",
        Some(&scaled),
        &["--kv-dtype", "int8"],
        "latent_scale",
    );
    let bad_scale = edit(&|c| {
        c.meta("scale", "nan");
    });
    rejects_op("mla", "mla-scale", Some(&bad_scale), &[], "scale");
    for (flags, needle) in [
        (&["--path", "sideways"][..], "unknown MLA path"),
        (&["--kv-dtype", "fp7"][..], "fp7"),
        (&["--block-size", "3"][..], "block size 3"),
        (&["--up-proj-chunk", "0"][..], "--up-proj-chunk"),
        (&["--precision", "f64"][..], "unknown precision"),
    ] {
        rejects_op("mla", "mla-flags", Some(&good), flags, needle);
    }
    // int4 needs a latent width that is a multiple of 32.
    let q = MlaProblem::new(
        reference::mla::MlaShape {
            rank: 36,
            ..small_mla_shape()
        },
        &[(1, 3)],
        5,
    );
    rejects_op(
        "mla",
        "mla-int4-rank",
        Some(&q.file()),
        &["--kv-dtype", "int4"],
        "36",
    );
    rejects_op("mla", "mla-no-file", None, &[], "cannot read");
}

/// Runs `run quantize` on `x` `[n, H, d]` in `dtype` (metadata `scale` if given) and returns
/// the result file.
fn run_quantize(
    name: &str,
    x: &[f32],
    [n, h, d]: [usize; 3],
    dtype: KvDtype,
    scale: Option<f32>,
) -> Result_ {
    let dir = temp_dir(name);
    let (inp, out) = (dir.join("x.safetensors"), dir.join("q.safetensors"));
    let mut f = CaseFile {
        tensors: vec![f32_t("x", vec![n, h, d], x)],
        meta: HashMap::new(),
    };
    if let Some(sc) = scale {
        f.meta("scale", &sc.to_string());
    }
    f.write(&inp);
    let o = kvattn(&[
        "run",
        "quantize",
        "--in",
        s(&inp),
        "--out",
        s(&out),
        "--kv-dtype",
        dtype.name(),
    ]);
    assert!(
        o.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r = read_result(&out);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// `run quantize` of `x` [n, H, d] in `dtype` (with a per-tensor scale if given), checked
/// against the CPU codec: codes and scales exactly, `dequant` bit for bit.
fn check_quantize(dtype: KvDtype, tensor_scale: Option<f32>, [n, h, d]: [usize; 3]) {
    let mut x = Rng::new(11 + n as u64).normals(n * h * d, 3.0);
    let i = 7 % x.len();
    x[i] = 90.0;
    let mode = tensor_scale.map_or(ScaleMode::PerRow, ScaleMode::PerTensor);
    let name = format!("quantize-{dtype}-{n}x{h}x{d}");
    let r = run_quantize(&name, &x, [n, h, d], dtype, tensor_scale);
    let want = encode_rows(dtype, d, &x, mode).unwrap();
    let (cshape, codes) = &r.u8s["codes"];
    assert_eq!(cshape, &vec![n, h, dtype.bytes_per_row(d)], "{dtype}");
    assert_eq!(codes, &words_to_le_bytes(&want.words), "{dtype} codes");
    let (dshape, deq) = &r.f32s["dequant"];
    assert_eq!(dshape, &vec![n, h, d]);
    let cpu = decode_rows(&want).unwrap();
    assert!(
        deq.iter()
            .zip(&cpu)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{dtype}: GPU dequant differs from the CPU codec"
    );
    match (dtype, tensor_scale) {
        (_, Some(sc)) => {
            assert_eq!(r.f32s["scales"], (vec![1], vec![sc]));
            assert_eq!(r.meta["scale"].parse::<f32>().unwrap(), sc);
        }
        (KvDtype::Int4, None) => {
            let p: Vec<Int4Params> = want
                .scales
                .iter()
                .map(|&w| Int4Params::from_word(w))
                .collect();
            let shape = vec![n, h, d / 32];
            let sc: Vec<f32> = p.iter().map(Int4Params::scale).collect();
            let mn: Vec<f32> = p.iter().map(Int4Params::min).collect();
            assert_eq!(r.f32s["scales"], (shape.clone(), sc));
            assert_eq!(r.f32s["mins"], (shape, mn));
        }
        (KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 | KvDtype::Int8, None) => {
            let sc: Vec<f32> = want.scales.iter().map(|&w| f32::from_bits(w)).collect();
            assert_eq!(r.f32s["scales"], (vec![n, h], sc));
            assert!(!r.f32s.contains_key("mins"));
        }
        _ => assert!(!r.f32s.contains_key("scales"), "{dtype} has no scales"),
    }
    assert_eq!(r.meta["kv_dtype"], dtype.name());
}

#[test]
fn run_quantize_round_trips_every_format() {
    for dtype in KvDtype::ALL {
        check_quantize(dtype, None, [5, 3, 64]);
    }
    check_quantize(KvDtype::Fp8E4M3, Some(0.25), [5, 3, 64]);
    check_quantize(KvDtype::Fp8E5M2, Some(3.0), [5, 3, 64]);
    // Other shapes: one row; more tokens than a block (token order, not block order); int4
    // with three groups per row; the smallest head dim.
    check_quantize(KvDtype::Int4, None, [1, 1, 32]);
    check_quantize(KvDtype::Int4, None, [37, 2, 96]);
    check_quantize(KvDtype::Int8, None, [40, 1, 4]);
    check_quantize(KvDtype::Fp8E4M3, None, [19, 4, 8]);
    check_quantize(KvDtype::Fp8E5M2, Some(0.5), [33, 1, 12]);
}

/// Inputs for an FP8 conversion check: every finite code's value, the midpoints between
/// adjacent codes (ties, rounded to even) and the floats just beside them, values beyond the
/// largest finite one (saturation), infinities, NaN, zeros, f32 subnormals and random values.
fn fp8_edge_values(fmt: Fp8Format) -> Vec<f32> {
    let mut finite: Vec<f32> = (0..=255u8)
        .map(|c| fmt.decode(c))
        .filter(|v| v.is_finite())
        .collect();
    finite.sort_by(f32::total_cmp);
    finite.dedup();
    let mut x = finite.clone();
    for w in finite.windows(2) {
        let mid = (w[0] + w[1]) / 2.0; // exact: adjacent codes differ in one bit of f32 precision
        x.extend([
            mid,
            f32::from_bits(mid.to_bits() + 1),
            f32::from_bits(mid.to_bits() - 1),
        ]);
    }
    let max = fmt.max_value();
    x.extend([
        max * 1.0625,
        max * 1.125,
        max * 1.25,
        1e6,
        f32::MAX,
        f32::INFINITY,
        f32::NAN,
        0.0,
        -0.0,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        1e-30,
    ]);
    let mut rng = Rng::new(0xf8);
    x.extend(rng.normals(200, 50.0));
    let negated: Vec<f32> = x.iter().map(|v| -v).collect();
    x.extend(negated);
    x
}

#[test]
fn run_quantize_fp8_scale_one_is_saturating_round_to_nearest_even() {
    // With a per-tensor scale of 1 the GPU encoder's codes are a plain conversion of x: the
    // `float8` crate's (CUDA's SATFINITE conversion) for every finite value, and the crate's
    // own codec for all of them; NaN stays NaN with its sign, infinity stays non-finite
    // (E5M2's infinity, E4M3's NaN).
    for (dtype, fmt) in [
        (KvDtype::Fp8E4M3, Fp8Format::E4M3),
        (KvDtype::Fp8E5M2, Fp8Format::E5M2),
    ] {
        let mut x = fp8_edge_values(fmt);
        let (h, d) = (2, 64);
        let n = x.len().div_ceil(h * d);
        x.resize(n * h * d, 0.0);
        let r = run_quantize(&format!("fp8-one-{dtype}"), &x, [n, h, d], dtype, Some(1.0));
        let (shape, codes) = &r.u8s["codes"];
        assert_eq!(shape, &vec![n, h, d], "{dtype}");
        assert_eq!(r.f32s["scales"], (vec![1], vec![1.0]));
        let (_, deq) = &r.f32s["dequant"];
        let mut nans = 0;
        for (i, (&v, &c)) in x.iter().zip(codes).enumerate() {
            assert_eq!(c, fmt.encode(v), "{dtype} x[{i}] = {v:e}");
            if v.is_nan() {
                nans += 1;
                assert!(
                    fmt.decode(c).is_nan() && deq[i].is_nan(),
                    "{dtype} NaN -> {c:#04x}"
                );
                assert_eq!(c & 0x80 != 0, v.is_sign_negative(), "{dtype} NaN sign");
                continue;
            }
            if v.is_infinite() {
                assert!(!deq[i].is_finite(), "{dtype} {v} -> {}", deq[i]);
                assert_eq!(c & 0x80 != 0, v.is_sign_negative(), "{dtype} inf sign");
                continue;
            }
            let want = match fmt {
                Fp8Format::E4M3 => float8::F8E4M3::from_f32(v).to_bits(),
                Fp8Format::E5M2 => float8::F8E5M2::from_f32(v).to_bits(),
            };
            assert_eq!(c, want, "{dtype} x[{i}] = {v:e}: not float8's conversion");
            assert_eq!(
                deq[i].to_bits(),
                fmt.decode(c).to_bits(),
                "{dtype} dequant[{i}]"
            );
            if v.abs() >= fmt.max_value() {
                assert_eq!(deq[i].abs(), fmt.max_value(), "{dtype} {v:e} saturates");
            }
        }
        assert_eq!(nans, 2, "{dtype}: NaN inputs");
    }
}

#[test]
fn run_quantize_rejects_invalid_input() {
    let dir = temp_dir("quantize-bad");
    let (inp, out) = (dir.join("x.safetensors"), dir.join("q.safetensors"));
    let run = |dtype: &str| {
        kvattn(&[
            "run",
            "quantize",
            "--in",
            s(&inp),
            "--out",
            s(&out),
            "--kv-dtype",
            dtype,
        ])
    };
    let cases: [(Vec<usize>, Option<&str>, &str, &str); 11] = [
        // A per-tensor scale is for FP8 only.
        (vec![2, 1, 64], Some("0.5"), "int8", "FP8 only"),
        (vec![2, 1, 64], Some("0.5"), "int4", "FP8 only"),
        (vec![2, 1, 64], Some("1"), "bf16", "FP8 only"),
        // ... and positive normal, and a number.
        (vec![2, 1, 64], Some("0"), "fp8-e4m3", "positive normal"),
        (vec![2, 1, 64], Some("-2"), "fp8-e5m2", "positive normal"),
        (vec![2, 1, 64], Some("one"), "fp8-e4m3", "metadata scale"),
        // int4 needs head dims in multiples of 32.
        (vec![2, 1, 48], None, "int4", "multiple of 32"),
        // Not a multiple of 4.
        (vec![2, 1, 6], None, "f16", "multiple of 4"),
        // Wrong rank; no rows.
        (vec![2, 64], None, "f16", "expected F32 [n, H, d]"),
        (vec![0, 2, 64], None, "int8", "no rows"),
        // Unknown format.
        (vec![2, 1, 64], None, "int3", "unknown KV dtype"),
    ];
    for (shape, scale, dtype, needle) in cases {
        let len = shape.iter().product::<usize>();
        let x = vec![1.0; len];
        let mut f = CaseFile {
            tensors: vec![f32_t("x", shape.clone(), &x)],
            meta: HashMap::new(),
        };
        if let Some(sc) = scale {
            f.meta("scale", sc);
        }
        f.write(&inp);
        let o = run(dtype);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{shape:?} {dtype}: succeeded");
        assert_eq!(err.lines().count(), 1, "{err:?}");
        assert!(
            err.contains(needle),
            "{shape:?} {dtype}: {err:?} lacks {needle:?}"
        );
        assert!(!out.exists());
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["x.safetensors"], "{shape:?} {dtype}: left files");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn verify_quick_passes() {
    let o = kvattn(&["verify", "--quick"]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "verify --quick failed:\n{stdout}\n{stderr}"
    );
    let passes = |needles: &[&str]| {
        stdout
            .lines()
            .any(|l| l.ends_with("pass") && needles.iter().all(|n| l.contains(n)))
    };
    for kernel in ["decode", "paged", "dequant", "append_kv", "mla"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(kernel) && l.ends_with("pass")),
            "no passing {kernel} row:\n{stdout}"
        );
    }
    // Both MLA paths, with a quantized latent.
    for path in ["mla        absorbed ", "mla        up-proj "] {
        assert!(passes(&[path, "latent-int4 "]), "no {path}row:\n{stdout}");
    }
    // Every quantized format in the attention checks (decode and prefill batches) and in the
    // quantize-on-write checks, per-row and per-tensor.
    for format in [
        "kv-fp8-e4m3 ",
        "kv-fp8-e5m2 ",
        "kv-int8 ",
        "kv-int4 ",
        "kv-int8/int4 ",
        "kv-fp8-e4m3 per-tensor ",
    ] {
        for mode in ["paged      decode ", "paged      prefill "] {
            assert!(passes(&[mode, format]), "no {mode}{format}row:\n{stdout}");
        }
    }
    for case in [
        "fp8-e4m3 per-row ",
        "fp8-e4m3 per-tensor ",
        "fp8-e5m2 per-row ",
        "fp8-e5m2 per-tensor ",
        "int8 per-row ",
        "int4 per-group ",
    ] {
        assert!(
            passes(&["append_kv  ", case]),
            "no append_kv {case}row:\n{stdout}"
        );
    }
    assert!(!stdout.contains("FAIL"), "{stdout}");
    assert!(stdout.contains(" 0 failed"), "{stdout}");
    // Progress goes to stderr, one line per check.
    assert!(stderr.contains("verify ["), "{stderr}");
    // The time line's parts (each printed to 0.1 s) add up to its total.
    let line = stdout
        .lines()
        .find(|l| l.starts_with("time: "))
        .unwrap_or_else(|| panic!("no time line:\n{stdout}"));
    let seconds = |text: &str| -> Vec<f64> {
        text.split([' ', ',', ';'])
            .filter_map(|w| w.strip_suffix('s')?.parse().ok())
            .collect()
    };
    let (parts, total) = line.rsplit_once("; ").expect("parts; total");
    let (parts, total) = (seconds(parts), seconds(total));
    assert_eq!((parts.len(), total.len()), (7, 1), "{line}");
    let sum: f64 = parts.iter().sum();
    assert!((sum - total[0]).abs() <= 0.05 * 8.0, "{line}");
    assert!(
        line.contains("first dispatches") && line.contains("repeating"),
        "{line}"
    );
}

#[test]
fn verify_quality_quick_holds_its_bound() {
    // Contexts 128 and 1024, both key distributions, every format: the GPU's NMSE within twice
    // the codec's (plus the floor), and the codec numbers ordered as the formats' precision.
    let o = kvattn(&["verify", "--quality", "--quick", "--json"]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "verify --quality failed:\n{stdout}\n{stderr}"
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
    assert_eq!(v["head_dim"], 128);
    let (factor, floor) = (
        v["bound_factor"].as_f64().unwrap(),
        v["nmse_floor"].as_f64().unwrap(),
    );
    assert!(factor <= 2.0 && floor <= 1e-9, "{factor} {floor}");
    let rows = v["rows"].as_array().unwrap();
    let formats = [
        "f16",
        "bf16",
        "fp8-e4m3 per-row",
        "fp8-e4m3 per-tensor",
        "fp8-e4m3 per-tensor x2",
        "fp8-e5m2 per-row",
        "int8 per-row",
        "int4 per-group",
    ];
    assert_eq!(rows.len(), 2 * formats.len() * 2, "{stdout}");
    let mut codec: HashMap<(String, String, u64), f64> = HashMap::new();
    for r in rows {
        let (gpu, cpu) = (
            r["gpu_nmse"].as_f64().expect("gpu_nmse"),
            r["codec_nmse"].as_f64().expect("codec_nmse"),
        );
        assert!(r["pass"].as_bool().unwrap(), "{r}");
        assert!(gpu <= factor * cpu + floor, "{r}");
        assert!(cpu > 0.0 && cpu < 1.0, "{r}");
        assert!(r["gpu_max_err"].as_f64().unwrap().is_finite(), "{r}");
        let key = (
            r["keys"].as_str().unwrap().to_string(),
            r["format"].as_str().unwrap().to_string(),
            r["context"].as_u64().unwrap(),
        );
        assert!(formats.contains(&key.1.as_str()), "{r}");
        assert!([128, 1024].contains(&key.2), "{r}");
        codec.insert(key, cpu);
    }
    for keys in ["gaussian", "outliers"] {
        for ctx in [128, 1024] {
            let c = |f: &str| codec[&(keys.to_string(), f.to_string(), ctx)];
            assert!(c("f16") < c("bf16"), "{keys} {ctx}");
            assert!(c("bf16") < c("fp8-e4m3 per-row"), "{keys} {ctx}");
            assert!(
                c("fp8-e4m3 per-row") < c("fp8-e5m2 per-row"),
                "{keys} {ctx}"
            );
            assert!(c("int8 per-row") < c("int4 per-group"), "{keys} {ctx}");
        }
    }
}

/// Runs `run attention` on `file` with `flags` and returns (out, lse).
fn attention_result(name: &str, file: &CaseFile, flags: &[&str]) -> (Vec<f32>, Vec<f32>) {
    let dir = temp_dir(name);
    let (case, out) = (dir.join("case.safetensors"), dir.join("out.safetensors"));
    file.write(&case);
    let mut args = vec!["run", "attention", "--in", s(&case), "--out", s(&out)];
    args.extend_from_slice(flags);
    let o = kvattn(&args);
    assert!(
        o.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut r = read_result(&out);
    let _ = std::fs::remove_dir_all(&dir);
    (
        r.f32s.remove("out").unwrap().1,
        r.f32s.remove("lse").unwrap().1,
    )
}

#[test]
fn run_attention_huge_windows_and_nan_are_never_silent() {
    // Windows near and past 2^32 wrapped in the kernels (outputs off by up to 3.3, exit 0):
    // now a window at least as long as the keys is no window, bit for bit.
    let p = Problem::new(4, 2, 32, 32, &[(3, 20), (1, 9)], 40);
    let plain = attention_result("window-none", &p.file(), &[]);
    for w in [
        "4294967260",
        "4294967295",
        "4294967296",
        "9223372036854775808",
    ] {
        let mut f = p.file();
        f.meta("sliding_window", w);
        assert_eq!(
            attention_result(&format!("window-{w}"), &f, &[]),
            plain,
            "window {w}"
        );
    }
    // A NaN in q made its row zeros with lse -inf; a NaN key (f32, or int8, whose row is then
    // poisoned) vanished. Now those rows are NaN and every other row is unchanged, bit for bit.
    let (hq, d) = (4, 32);
    let mut nan_q = Problem::new(4, 2, 32, 32, &[(3, 20), (1, 9)], 40);
    nan_q.q[(hq + 2) * d + 3] = f32::NAN; // token 1, head 2
    let (out, lse) = attention_result("nan-q", &nan_q.file(), &[]);
    for row in 0..4 * hq {
        let o = &out[row * d..][..d];
        if row == hq + 2 {
            assert!(
                o.iter().all(|x| x.is_nan()) && lse[row].is_nan(),
                "row {row}"
            );
        } else {
            assert_eq!(o, &plain.0[row * d..][..d], "row {row}");
            assert_eq!(lse[row].to_bits(), plain.1[row].to_bits(), "row {row}");
        }
    }
    let mut nan_k = Problem::new(4, 2, 32, 32, &[(3, 20), (1, 9)], 40);
    nan_k.k[(5 * 2 + 1) * d + 7] = f32::NAN; // key 5 of sequence 0, KV head 1
    for kv in ["f32", "int8", "fp8-e4m3"] {
        let (out, lse) =
            attention_result(&format!("nan-k-{kv}"), &nan_k.file(), &["--kv-dtype", kv]);
        // Sequence 0's three queries (tokens 0..3) see key 5: heads 2 and 3 are NaN.
        for token in 0..4 {
            for h in 0..hq {
                let row = token * hq + h;
                let bad = token < 3 && h >= 2;
                let o = &out[row * d..][..d];
                assert_eq!(
                    o.iter().all(|x| x.is_nan()),
                    bad,
                    "{kv} token {token} head {h}"
                );
                assert_eq!(
                    o.iter().all(|x| x.is_finite()),
                    !bad,
                    "{kv} token {token} head {h}"
                );
                assert_eq!(lse[row].is_nan(), bad, "{kv} token {token} head {h}");
            }
        }
    }
}
