//! `kvattn verify --quality`: how much each KV storage format costs in attention output quality,
//! by context length, on this adapter.
//!
//! For every format (f16, bf16, FP8 E4M3 per row, FP8 E4M3 per tensor with a calibrated scale
//! without and with headroom, FP8 E5M2 per row, int8, int4; K and V in the same format) and two
//! key distributions (Gaussian, and keys with outlier channels), decode query tokens (one per
//! sequence) attend over 128, 1K, 4K and 16K cached tokens (8 query heads over 2 KV heads, head
//! dim 128; about 32K cached tokens per context length, so many sequences of the short ones).
//! Each row gives the NMSE (`sum (o - o_ref)^2 / sum o_ref^2`, over the outputs of every
//! sequence of that length), the largest absolute error, and the codec's NMSE with only K or only
//! V quantized, of:
//!
//! - **gpu**: the paged attention kernel (f32 math) over a cache the GPU encoder filled;
//! - **codec**: the f64 CPU reference run on K/V quantized and dequantized by the CPU codec;
//!
//! both against `o_ref`, the f64 reference on the f32 K/V. The codec number is the format's own
//! error, measured before any kernel; a row passes when the GPU's NMSE is at most
//! [`BOUND_FACTOR`] times the codec's plus [`NMSE_FLOOR`] (which only matters for f16, whose
//! codec error is close to the f32 kernel's own rounding).

use std::time::Instant;

use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::gpu::Context;
use kvattn::quant::{decode_rows, encode_rows, per_tensor_scale, KvDtype, ScaleMode};
use kvattn::reference;
use kvattn::shader::Precision;
use kvattn::Result;

use crate::run::{check_paged, run_paged, PagedSetup};
use crate::verify::{fmt_err, max_abs_err, nmse, Rng};

/// Context lengths of the full table.
pub const CONTEXTS: [usize; 4] = [128, 1024, 4096, 16384];
/// Context lengths of `--quick`.
pub const QUICK_CONTEXTS: [usize; 2] = [128, 1024];
/// Cached tokens per context length: `TOKENS_PER_CONTEXT / context` sequences (at least one) of
/// each length, so short contexts average over many queries.
const TOKENS_PER_CONTEXT: usize = 32768;
/// [`TOKENS_PER_CONTEXT`] of `--quick`.
const QUICK_TOKENS_PER_CONTEXT: usize = 2048;
/// Query heads.
const HQ: usize = 8;
/// KV heads.
const HKV: usize = 2;
/// Head dim of K and V.
const D: usize = 128;
/// Outlier channels per KV head in the outlier distribution.
const OUTLIER_CHANNELS: usize = 4;
/// How much larger the outlier channels are than the others.
const OUTLIER_FACTOR: f32 = 20.0;
/// Tokens of the separate sample a per-tensor scale is calibrated on.
const CALIBRATION_TOKENS: usize = 1024;
/// A row passes when `gpu NMSE <= BOUND_FACTOR * codec NMSE + NMSE_FLOOR`.
pub const BOUND_FACTOR: f64 = 2.0;
/// See [`BOUND_FACTOR`]: the f32 kernel's own rounding, far below every format's error.
pub const NMSE_FLOOR: f64 = 1e-10;
/// Tokens per cache block.
const BLOCK_SIZE: usize = 16;

/// A storage format of the table (K and V the same).
#[derive(Debug, Clone, Copy)]
struct Format {
    dtype: KvDtype,
    /// A static per-tensor FP8 scale calibrated on a separate sample with this headroom
    /// (`amax * headroom / format max`); `None`: scales per token row.
    headroom: Option<f32>,
}

impl Format {
    const fn per_row(dtype: KvDtype) -> Self {
        Self {
            dtype,
            headroom: None,
        }
    }

    fn name(&self) -> String {
        let scales = match (self.dtype, self.headroom) {
            (d, _) if !d.is_quantized() => String::new(),
            (_, Some(1.0)) => " per-tensor".into(),
            (_, Some(h)) => format!(" per-tensor x{h}"),
            (KvDtype::Int4, None) => " per-group".into(),
            (_, None) => " per-row".into(),
        };
        format!("{}{scales}", self.dtype)
    }
}

/// The formats of the table. FP8 E4M3 with a per-tensor scale twice: calibrated on the sample's
/// amax exactly (values beyond the sample saturate) and with headroom 2.
const FORMATS: [Format; 8] = [
    Format::per_row(KvDtype::F16),
    Format::per_row(KvDtype::Bf16),
    Format::per_row(KvDtype::Fp8E4M3),
    Format {
        dtype: KvDtype::Fp8E4M3,
        headroom: Some(1.0),
    },
    Format {
        dtype: KvDtype::Fp8E4M3,
        headroom: Some(2.0),
    },
    Format::per_row(KvDtype::Fp8E5M2),
    Format::per_row(KvDtype::Int8),
    Format::per_row(KvDtype::Int4),
];

/// How the keys are distributed (values and queries are standard normal in both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// Standard normal.
    Gaussian,
    /// Standard normal, but [`OUTLIER_CHANNELS`] channels per KV head (fixed, chosen at random)
    /// [`OUTLIER_FACTOR`] times larger. With isotropic queries these channels also dominate the
    /// scores (their spread grows from 1 to about 3.7), as in real models' sharper heads.
    Outliers,
}

impl Keys {
    fn name(self) -> &'static str {
        match self {
            Keys::Gaussian => "gaussian",
            Keys::Outliers => "outliers",
        }
    }
}

/// The per-channel multipliers of K for `keys`: `[HKV, D]`.
fn channel_scales(keys: Keys) -> Vec<f32> {
    match keys {
        Keys::Gaussian => vec![1.0; HKV * D],
        Keys::Outliers => {
            let mut rng = Rng::new(0x0071_1e75);
            let mut scales = vec![1.0; HKV * D];
            for head in scales.chunks_mut(D) {
                let mut picked = 0;
                while picked < OUTLIER_CHANNELS {
                    let c = (rng.uniform() * D as f64) as usize % D;
                    if head[c] == 1.0 {
                        head[c] = OUTLIER_FACTOR;
                        picked += 1;
                    }
                }
            }
            scales
        }
    }
}

/// `tokens` rows of K `[tokens, HKV, D]` for `keys`.
fn keys_of(keys: Keys, tokens: usize, rng: &mut Rng) -> Vec<f32> {
    let scales = channel_scales(keys);
    let mut k = rng.normals(tokens * HKV * D, 1.0);
    for row in k.chunks_mut(HKV * D) {
        for (x, s) in row.iter_mut().zip(&scales) {
            *x *= s;
        }
    }
    k
}

/// Sequences of every context length (about [`TOKENS_PER_CONTEXT`] tokens of each), one query
/// token each.
struct Data {
    /// Per context length: the sequences (= query rows) that have it.
    groups: Vec<(usize, std::ops::Range<usize>)>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
    /// A separate sample of the same distribution, for per-tensor calibration.
    calib_k: Vec<f32>,
    calib_v: Vec<f32>,
}

impl Data {
    fn new(keys: Keys, contexts: &[usize], tokens_per_context: usize) -> Self {
        let mut rng = Rng::new(0x9a11_7e00 + keys as u64);
        let mut cu_k = vec![0u32];
        let mut groups = Vec::new();
        for &c in contexts {
            let seqs = (tokens_per_context / c).max(1);
            let first = cu_k.len() - 1;
            for _ in 0..seqs {
                cu_k.push(cu_k.last().expect("non-empty") + c as u32);
            }
            groups.push((c, first..first + seqs));
        }
        let (num_seqs, total) = (cu_k.len() - 1, *cu_k.last().expect("non-empty") as usize);
        Self {
            groups,
            q: rng.normals(num_seqs * HQ * D, 1.0),
            k: keys_of(keys, total, &mut rng),
            v: rng.normals(total * HKV * D, 1.0),
            cu_q: (0..=num_seqs as u32).collect(),
            cu_k,
            calib_k: keys_of(keys, CALIBRATION_TOKENS, &mut rng),
            calib_v: rng.normals(CALIBRATION_TOKENS * HKV * D, 1.0),
        }
    }

    fn batch<'a>(&'a self, k: &'a [f32], v: &'a [f32]) -> RaggedBatch<'a> {
        RaggedBatch {
            q: &self.q,
            k,
            v,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
struct Row {
    keys: Keys,
    format: String,
    context: usize,
    gpu_nmse: f64,
    codec_nmse: f64,
    gpu_max_err: f64,
    codec_max_err: f64,
    /// The codec's NMSE with only K quantized (V f32), and with only V quantized.
    codec_k_nmse: f64,
    codec_v_nmse: f64,
    k_scale: Option<f32>,
    v_scale: Option<f32>,
    pass: bool,
    note: Option<String>,
}

const SHAPE: AttentionShape = AttentionShape {
    num_q_heads: HQ,
    num_kv_heads: HKV,
    head_dim_qk: D,
    head_dim_v: D,
};

/// The rows of one key distribution and format, one per context length.
fn measure(
    ctx: &Context,
    data: &Data,
    reference_out: &[f32],
    keys: Keys,
    format: Format,
) -> Result<Vec<Row>> {
    let opts = AttentionOptions::default();
    let mode = |x: &[f32]| -> Result<ScaleMode> {
        Ok(if let Some(headroom) = format.headroom {
            ScaleMode::PerTensor(per_tensor_scale(format.dtype, x, headroom)?)
        } else {
            ScaleMode::PerRow
        })
    };
    let (k_mode, v_mode) = (mode(&data.calib_k)?, mode(&data.calib_v)?);
    let scale_of = |m: ScaleMode| match m {
        ScaleMode::PerTensor(s) => Some(s),
        ScaleMode::PerRow => None,
    };
    // The codec: the f64 reference on CPU-quantized K/V.
    let k = decode_rows(&encode_rows(format.dtype, D, &data.k, k_mode)?)?;
    let v = decode_rows(&encode_rows(format.dtype, D, &data.v, v_mode)?)?;
    // The GPU: the paged kernel over the GPU-encoded cache of the f32 K/V.
    let setup = PagedSetup {
        k_dtype: format.dtype,
        v_dtype: format.dtype,
        k_scale: scale_of(k_mode),
        v_scale: scale_of(v_mode),
        block_size: BLOCK_SIZE,
        precision: Precision::F32,
        seed: 0x5eed,
    };
    let batch = data.batch(&data.k, &data.v);
    // The three CPU references (K and V quantized, K only, V only) run on other threads while
    // this one drives the GPU.
    let (gpu, [codec, codec_k, codec_v]) = std::thread::scope(|scope| {
        let refs = [(&k, &v), (&k, &data.v), (&data.k, &v)].map(|(k, v)| {
            let opts = &opts;
            scope.spawn(move || reference::attention(&data.batch(k, v), &SHAPE, opts))
        });
        let gpu = check_paged(&batch, &SHAPE, &opts, &setup)
            .and_then(|()| run_paged(ctx, &batch, &SHAPE, &opts, &setup));
        (
            gpu,
            refs.map(|h| h.join().expect("the reference does not panic")),
        )
    });
    let (codec, codec_k, codec_v) = (codec?, codec_k?, codec_v?);
    let per_seq = HQ * D;
    let rows = data
        .groups
        .iter()
        .map(|(context, seqs)| {
            let context = *context;
            let range = seqs.start * per_seq..seqs.end * per_seq;
            let want = &reference_out[range.clone()];
            let c = &codec.out[range.clone()];
            let codec_k_nmse = nmse(&codec_k.out[range.clone()], want);
            let codec_v_nmse = nmse(&codec_v.out[range.clone()], want);
            let (codec_nmse, codec_max_err) = (nmse(c, want), max_abs_err(c, want));
            let (gpu_nmse, gpu_max_err, note) = match &gpu {
                Ok(g) => {
                    let g = &g.out[range];
                    (nmse(g, want), max_abs_err(g, want), None)
                }
                Err(e) => (f64::NAN, f64::NAN, Some(e.to_string())),
            };
            let pass = gpu_nmse <= BOUND_FACTOR * codec_nmse + NMSE_FLOOR;
            Row {
                keys,
                format: format.name(),
                context,
                gpu_nmse,
                codec_nmse,
                gpu_max_err,
                codec_max_err,
                codec_k_nmse,
                codec_v_nmse,
                k_scale: setup.k_scale,
                v_scale: setup.v_scale,
                pass,
                note,
            }
        })
        .collect();
    Ok(rows)
}

/// Runs `kvattn verify --quality`; `Ok(false)` when a row breaks its bound.
pub fn run(quick: bool, json: bool) -> Result<bool> {
    let start = Instant::now();
    let (contexts, tokens): (&[usize], usize) = if quick {
        (&QUICK_CONTEXTS, QUICK_TOKENS_PER_CONTEXT)
    } else {
        (&CONTEXTS, TOKENS_PER_CONTEXT)
    };
    let ctx = Context::new()?;
    let a = ctx.adapter();
    let mut rows = Vec::new();
    for keys in [Keys::Gaussian, Keys::Outliers] {
        let t = Instant::now();
        let data = Data::new(keys, contexts, tokens);
        let reference_out = reference::attention(
            &data.batch(&data.k, &data.v),
            &SHAPE,
            &AttentionOptions::default(),
        )?
        .out;
        eprintln!(
            "quality: {} keys, f64 reference on f32 K/V ({:.2}s)",
            keys.name(),
            t.elapsed().as_secs_f64()
        );
        for format in FORMATS {
            let t = Instant::now();
            let got = measure(&ctx, &data, &reference_out, keys, format)?;
            eprintln!(
                "quality: {} keys, {} ... {} ({:.2}s)",
                keys.name(),
                format.name(),
                if got.iter().all(|r| r.pass) {
                    "pass"
                } else {
                    "FAIL"
                },
                t.elapsed().as_secs_f64()
            );
            rows.extend(got);
        }
    }
    let failed = rows.iter().filter(|r| !r.pass).count();
    if json {
        print_json(&ctx, &rows);
    } else {
        println!(
            "kvattn verify --quality{} on {} ({}, {})",
            if quick { " --quick" } else { "" },
            a.name,
            a.backend,
            a.device_type
        );
        print_table(&rows);
        println!(
            "{} rows: {} within the bound, {failed} beyond it ({:.1}s)",
            rows.len(),
            rows.len() - failed,
            start.elapsed().as_secs_f64()
        );
    }
    if failed > 0 {
        eprintln!(
            "kvattn: verify --quality: {failed} of {} rows exceed {BOUND_FACTOR} x the codec's \
             NMSE + {NMSE_FLOOR:e}",
            rows.len()
        );
    }
    Ok(failed == 0)
}

fn print_table(rows: &[Row]) {
    println!(
        "decode: 1 query token per sequence, {HQ} query heads over {HKV} KV heads, head dim {D}, \
         f32 kernel, block size {BLOCK_SIZE}; K and V in the same format"
    );
    println!(
        "error of the output against the f64 reference on f32 K/V; gpu: the paged kernel over \
         the GPU-encoded cache; codec: the f64 reference on CPU-quantized K/V"
    );
    println!(
        "keys: gaussian = N(0, 1); outliers = N(0, 1) with {OUTLIER_CHANNELS} of {D} channels \
         per KV head {OUTLIER_FACTOR}x larger; values and queries N(0, 1); per-tensor scales \
         calibrated on {CALIBRATION_TOKENS} separate tokens (amax / format max; x2: twice that)"
    );
    println!(
        "K only / V only: the codec's NMSE with only K (only V) quantized, the other f32; bound: \
         gpu NMSE <= {BOUND_FACTOR} x codec NMSE + {NMSE_FLOOR:e}"
    );
    let fw = rows
        .iter()
        .map(|r| r.format.len())
        .max()
        .unwrap_or(6)
        .max(6);
    println!(
        "{:<8}  {:<fw$}  {:>5}  {:>9}  {:>10}  {:>9}  {:>9}  {:>11}  {:>13}  result",
        "keys",
        "format",
        "ctx",
        "NMSE gpu",
        "NMSE codec",
        "K only",
        "V only",
        "max err gpu",
        "max err codec"
    );
    for r in rows {
        println!(
            "{:<8}  {:<fw$}  {:>5}  {:>9}  {:>10}  {:>9}  {:>9}  {:>11}  {:>13}  {}",
            r.keys.name(),
            r.format,
            r.context,
            fmt_err(r.gpu_nmse),
            fmt_err(r.codec_nmse),
            fmt_err(r.codec_k_nmse),
            fmt_err(r.codec_v_nmse),
            fmt_err(r.gpu_max_err),
            fmt_err(r.codec_max_err),
            if r.pass { "pass" } else { "FAIL" }
        );
    }
    let mut notes: Vec<String> = Vec::new();
    for r in rows {
        if let Some(n) = &r.note {
            let line = format!("{} keys, {}: {n}", r.keys.name(), r.format);
            if !notes.contains(&line) {
                notes.push(line);
            }
        }
    }
    for n in notes {
        println!("note: {}", n.replace('\n', " "));
    }
}

fn print_json(ctx: &Context, rows: &[Row]) {
    let a = ctx.adapter();
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "keys": r.keys.name(),
                "format": r.format,
                "context": r.context,
                "gpu_nmse": r.gpu_nmse,
                "codec_nmse": r.codec_nmse,
                "gpu_max_err": r.gpu_max_err,
                "codec_max_err": r.codec_max_err,
                "codec_k_only_nmse": r.codec_k_nmse,
                "codec_v_only_nmse": r.codec_v_nmse,
                "k_scale": r.k_scale,
                "v_scale": r.v_scale,
                "pass": r.pass,
                "note": r.note,
            })
        })
        .collect();
    let value = serde_json::json!({
        "adapter": a.name,
        "backend": a.backend,
        "num_q_heads": HQ,
        "num_kv_heads": HKV,
        "head_dim": D,
        "precision": "f32",
        "block_size": BLOCK_SIZE,
        "bound_factor": BOUND_FACTOR,
        "nmse_floor": NMSE_FLOOR,
        "rows": rows,
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&value).expect("JSON of plain values")
    );
}
