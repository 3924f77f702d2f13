//! `kvattn verify`: every kernel and storage format this adapter supports, against the CPU
//! oracles, over a built-in grid; a table of errors; a non-zero exit if anything fails.
//!
//! Kernels and oracles:
//! - `decode` (contiguous decode): [`kvattn::reference::attention()`] on the values the kernel
//!   stores (K/V rounded to the storage format);
//! - `paged` (attention over the paged cache, decode and prefill batches, free blocks shuffled,
//!   every storage format, K and V formats mixed, per-row and per-tensor FP8 scales): the same
//!   reference on the values the CPU codec stores; while the kernel is not implemented its rows
//!   read "unavailable";
//! - `dequant` (the GPU KV decoders): the CPU codec, bit for bit;
//! - `append_kv` (the paged cache's append, quantizing on write, pools split over several
//!   bindings): the CPU encoder's value and scale words, bit for bit;
//! - `mla` (Multi-head Latent Attention, absorbed and up-projection paths, every latent
//!   format): [`kvattn::reference::mla::mla`] on the latent as stored (see `verify/mla.rs`).
//!
//! `--quality` runs the quality table of the quantized formats instead (see `quality.rs`).
//!
//! Tolerances are the crate's (README "Tolerances"): f32 kernels within
//! `1e-4 * max(1, max |ref|)`, lse within `1e-4`; f16 kernels within twice the error of an
//! honest f16 emulation (Q, K, V and the probabilities rounded to f16, everything else in f64)
//! plus `1e-5` of the output scale.

use std::collections::HashMap;
use std::time::Instant;

use kvattn::attention::decode::{decode_batch, DecodeConfig};
use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::cache::append_kv::SourceDtype;
use kvattn::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::scales::CacheScales;
use kvattn::gpu::{Context, ContextOptions};
use kvattn::quant::dequant::dequantize;
use kvattn::quant::pack::pack_halves;
use kvattn::quant::{decode_rows, encode_rows, per_tensor_scale, EncodedRows, KvDtype, ScaleMode};
use kvattn::reference::{self, AttentionOutput};
use kvattn::shader::Precision;
use kvattn::{Error, Result};

use crate::run::{check_paged, run_paged, PagedSetup};

mod mla;

/// Arguments of `kvattn verify`.
#[derive(clap::Args)]
pub struct VerifyArgs {
    /// A subset of the grid that runs in about a minute on a software adapter (with --quality:
    /// contexts 128 and 1024 only).
    #[arg(long)]
    quick: bool,
    /// Only the checks of these kernels (decode, paged, dequant, append_kv, mla); repeatable.
    #[arg(long = "kernel", value_name = "NAME", conflicts_with = "quality")]
    kernels: Vec<String>,
    /// Instead of the checks: the quality table of the KV storage formats (NMSE and max error
    /// of the attention output against f32 KV, by context length, beside the CPU codec's own);
    /// with --quick only contexts 128 and 1024.
    #[arg(long)]
    quality: bool,
    /// With --quality: print the rows as JSON instead of the table.
    #[arg(long, requires = "quality")]
    json: bool,
}

/// The error the paged kernel returns until it is implemented; rows that get exactly this
/// error are reported as unavailable, not failed.
const PAGED_UNIMPLEMENTED: &str = "paged attention is not implemented yet";

/// Unscaled storage formats: every attention kernel reads them.
const ATTN_DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

/// Quantized storage of the paged checks: every quantized format, per-tensor FP8, and K and V
/// in different formats.
const QUANT_FORMATS: [KvFormat; 7] = [
    KvFormat::same(KvDtype::Fp8E4M3),
    KvFormat::same(KvDtype::Int8),
    KvFormat::same(KvDtype::Int4),
    KvFormat::same(KvDtype::Fp8E5M2),
    KvFormat::mixed(KvDtype::Int8, KvDtype::Int4),
    KvFormat::per_tensor(KvDtype::Fp8E4M3),
    KvFormat::per_tensor(KvDtype::Fp8E5M2),
];

/// How the K and V of an attention check are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KvFormat {
    k: KvDtype,
    v: KvDtype,
    /// FP8 with static per-tensor scales calibrated on the problem's K and V (amax / format max);
    /// otherwise scales per token row.
    per_tensor: bool,
}

impl KvFormat {
    const fn same(dtype: KvDtype) -> Self {
        Self {
            k: dtype,
            v: dtype,
            per_tensor: false,
        }
    }

    const fn mixed(k: KvDtype, v: KvDtype) -> Self {
        Self {
            k,
            v,
            per_tensor: false,
        }
    }

    const fn per_tensor(dtype: KvDtype) -> Self {
        Self {
            k: dtype,
            v: dtype,
            per_tensor: true,
        }
    }

    /// Whether both head dims are ones the formats store.
    fn fits(&self, shape: &AttentionShape) -> bool {
        self.k.check_head_dim(shape.head_dim_qk).is_ok()
            && self.v.check_head_dim(shape.head_dim_v).is_ok()
    }

    /// The scale modes of K and V for the problem's data.
    fn modes(&self, k: &[f32], v: &[f32]) -> Result<(ScaleMode, ScaleMode)> {
        let mode = |dtype: KvDtype, x: &[f32]| -> Result<ScaleMode> {
            if self.per_tensor && dtype.fp8_format().is_some() {
                Ok(ScaleMode::PerTensor(per_tensor_scale(dtype, x, 1.0)?))
            } else {
                Ok(ScaleMode::PerRow)
            }
        };
        Ok((mode(self.k, k)?, mode(self.v, v)?))
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.k == self.v {
            write!(f, "{}", self.k)?;
        } else {
            write!(f, "{}/{}", self.k, self.v)?;
        }
        if self.per_tensor {
            f.write_str(" per-tensor")?;
        }
        Ok(())
    }
}

/// Key lengths of the sequences of every decode batch.
const CONTEXTS: [usize; 4] = [1, 17, 97, 1000];

/// Option sets of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opts {
    /// Causal, default scale.
    Plain,
    /// Sliding window and logit softcap.
    WindowSoftcap,
    /// ALiBi, sinks and an explicit scale.
    AlibiSinks,
    /// No causal mask.
    NonCausal,
    /// Causal, with NaN and infinity planted in the data (README, "NaN, infinities and extreme
    /// values"): the kernel must give NaN exactly where the reference does.
    NanInf,
}

impl Opts {
    fn name(self) -> &'static str {
        match self {
            Opts::Plain => "",
            Opts::WindowSoftcap => " window+softcap",
            Opts::AlibiSinks => " alibi+sinks+scale",
            Opts::NonCausal => " non-causal",
            Opts::NanInf => " nan+inf",
        }
    }

    fn options(self, hq: usize) -> AttentionOptions {
        match self {
            Opts::Plain => AttentionOptions::default(),
            Opts::WindowSoftcap => AttentionOptions {
                sliding_window: Some(24),
                softcap: Some(5.0),
                ..Default::default()
            },
            Opts::AlibiSinks => AttentionOptions {
                scale: Some(0.11),
                alibi_slopes: Some(
                    (0..hq)
                        .map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / hq as f32))
                        .collect(),
                ),
                sinks: Some((0..hq).map(|h| h as f32 * 0.75 - 1.5).collect()),
                ..Default::default()
            },
            Opts::NonCausal => AttentionOptions {
                causal: false,
                ..Default::default()
            },
            Opts::NanInf => AttentionOptions::default(),
        }
    }
}

/// An attention problem of the grid: heads and dims, `(len_q, len_k)` per sequence, options.
#[derive(Debug, Clone)]
struct Problem {
    shape: AttentionShape,
    lens: Vec<(usize, usize)>,
    opts: Opts,
}

/// One row of the table to compute.
#[derive(Debug, Clone)]
enum Check {
    Decode {
        problem: Problem,
        dtype: KvDtype,
        precision: Precision,
    },
    Paged {
        problem: Problem,
        format: KvFormat,
        precision: Precision,
        block_size: usize,
    },
    Dequant {
        dtype: KvDtype,
        head_dim: usize,
        per_tensor: bool,
    },
    AppendKv {
        dtype: KvDtype,
        head_dim: usize,
        block_size: usize,
        src: SourceDtype,
        per_tensor: bool,
    },
    Mla(mla::MlaCheck),
}

impl Check {
    fn kernel(&self) -> &'static str {
        match self {
            Check::Decode { .. } => "decode",
            Check::Paged { .. } => "paged",
            Check::Dequant { .. } => "dequant",
            Check::AppendKv { .. } => "append_kv",
            Check::Mla(_) => "mla",
        }
    }

    /// The kernel and the formats, for the summary of largest errors.
    fn group(&self) -> String {
        match self {
            Check::Decode {
                dtype, precision, ..
            } => format!("{} kv {dtype}, {} math", self.kernel(), precision.name()),
            Check::Paged {
                format, precision, ..
            } => format!("{} kv {format}, {} math", self.kernel(), precision.name()),
            Check::Dequant { dtype, .. } | Check::AppendKv { dtype, .. } => {
                format!("{} {dtype}", self.kernel())
            }
            Check::Mla(m) => format!(
                "mla {} latent {}, {} math",
                m.path.name(),
                m.storage(),
                m.precision.name()
            ),
        }
    }

    fn name(&self) -> String {
        fn shape_name(p: &Problem) -> String {
            let s = &p.shape;
            let dims = if s.head_dim_qk == s.head_dim_v {
                format!("d{}", s.head_dim_qk)
            } else {
                format!("d{}/{}", s.head_dim_qk, s.head_dim_v)
            };
            format!("{dims} h{}/{}", s.num_q_heads, s.num_kv_heads)
        }
        match self {
            Check::Decode {
                problem,
                dtype,
                precision,
            } => {
                let ctx: Vec<String> = problem.lens.iter().map(|l| l.1.to_string()).collect();
                format!(
                    "{} kv-{dtype} {} ctx {}{}",
                    shape_name(problem),
                    precision.name(),
                    ctx.join(","),
                    problem.opts.name()
                )
            }
            Check::Paged {
                problem,
                format,
                precision,
                block_size,
            } => {
                let mode = if problem.lens.iter().all(|l| l.0 == 1) {
                    "decode"
                } else {
                    "prefill"
                };
                format!(
                    "{mode} {} kv-{format} {} bs{block_size} q/k {}{}",
                    shape_name(problem),
                    precision.name(),
                    lens_name(&problem.lens),
                    problem.opts.name()
                )
            }
            Check::Dequant {
                dtype,
                head_dim,
                per_tensor,
            } => {
                let scale = match (dtype.is_quantized(), per_tensor) {
                    (false, _) => "",
                    (true, true) => " per-tensor",
                    (true, false) if *dtype == KvDtype::Int4 => " per-group",
                    (true, false) => " per-row",
                };
                format!("{dtype} d{head_dim}{scale}")
            }
            Check::AppendKv {
                dtype,
                head_dim,
                block_size,
                src,
                per_tensor,
            } => {
                let src = match src {
                    SourceDtype::F32 => "f32",
                    SourceDtype::F16 => "f16",
                };
                let scale = match (dtype.is_quantized(), per_tensor) {
                    (false, _) => "",
                    (true, true) => " per-tensor",
                    (true, false) if *dtype == KvDtype::Int4 => " per-group",
                    (true, false) => " per-row",
                };
                format!("{dtype}{scale} d{head_dim} h{APPEND_KV_HEADS} bs{block_size} from {src}")
            }
            Check::Mla(m) => m.name(),
        }
    }
}

/// Sequence lengths as a case name shows them: `len_k` for a decode row, `len_q/len_k` else.
fn lens_name(lens: &[(usize, usize)]) -> String {
    let parts: Vec<String> = lens
        .iter()
        .map(|&(q, k)| {
            if q == 1 {
                k.to_string()
            } else {
                format!("{q}/{k}")
            }
        })
        .collect();
    parts.join(",")
}

/// The grid: the full one, or the `--quick` subset.
fn grid(quick: bool, precisions: &[Precision]) -> Vec<Check> {
    let decode_lens: Vec<(usize, usize)> = CONTEXTS.iter().map(|&k| (1, k)).collect();
    // Chunks after prefixes of 0 to 936 tokens (a shorter last chunk in quick mode).
    let long_chunk = if quick { 8 } else { 64 };
    let prefill_lens = vec![(1, 1), (17, 17), (16, 97), (long_chunk, 1000), (3, 40)];
    let shape = |d: usize, dv: usize, hq: usize, hkv: usize| AttentionShape {
        num_q_heads: hq,
        num_kv_heads: hkv,
        head_dim_qk: d,
        head_dim_v: dv,
    };
    // (shape, storage): every shape in every unscaled format, and each quantized storage on one
    // heads configuration per head dim (in turn); a few in quick mode.
    let heads: [(usize, usize); 4] = [(4, 4), (16, 4), (32, 4), (8, 1)];
    let mut shapes: Vec<(AttentionShape, KvFormat)> = Vec::new();
    if quick {
        let (s64, s80, s128) = (
            shape(64, 64, 4, 4),
            shape(80, 80, 8, 1),
            shape(128, 128, 16, 2),
        );
        shapes.push((s64, KvFormat::same(KvDtype::F32)));
        shapes.push((s80, KvFormat::same(KvDtype::Bf16)));
        shapes.push((s128, KvFormat::same(KvDtype::F16)));
        // Quantized storage on small shapes (GQA 4 where it matters); `verify --quality` runs
        // head dim 128.
        let gqa = shape(64, 64, 8, 2);
        shapes.push((s64, KvFormat::same(KvDtype::Fp8E4M3)));
        shapes.push((s80, KvFormat::same(KvDtype::Int8)));
        shapes.push((gqa, KvFormat::same(KvDtype::Int4)));
        shapes.push((s64, KvFormat::same(KvDtype::Fp8E5M2)));
        shapes.push((gqa, KvFormat::mixed(KvDtype::Int8, KvDtype::Int4)));
        shapes.push((gqa, KvFormat::per_tensor(KvDtype::Fp8E4M3)));
    } else {
        let mut turn = 0;
        for d in [64, 80, 96, 128, 256] {
            for &(hq, hkv) in &heads {
                for dtype in ATTN_DTYPES {
                    shapes.push((shape(d, d, hq, hkv), KvFormat::same(dtype)));
                }
            }
            for format in QUANT_FORMATS {
                let (hq, hkv) = heads[turn % heads.len()];
                turn += 1;
                let s = shape(d, d, hq, hkv);
                if format.fits(&s) {
                    shapes.push((s, format));
                }
            }
        }
        shapes.push((shape(192, 128, 8, 2), KvFormat::same(KvDtype::F16)));
        shapes.push((
            shape(192, 128, 8, 2),
            KvFormat::mixed(KvDtype::Fp8E4M3, KvDtype::Int4),
        ));
    }
    let options_shape = shape(128, 128, 16, 4);
    let option_sets = [Opts::WindowSoftcap, Opts::AlibiSinks];

    let mut checks = Vec::new();
    // Contiguous decode: the unscaled formats it reads.
    for &(s, format) in &shapes {
        if format.per_tensor
            || format.k != format.v
            || !kvattn::attention::decode::SUPPORTED.contains(&format.k)
        {
            continue;
        }
        for &precision in precisions {
            checks.push(Check::Decode {
                problem: Problem {
                    shape: s,
                    lens: decode_lens.clone(),
                    opts: Opts::Plain,
                },
                dtype: format.k,
                precision,
            });
        }
    }
    for opts in option_sets {
        for &precision in precisions {
            checks.push(Check::Decode {
                problem: Problem {
                    shape: options_shape,
                    lens: decode_lens.clone(),
                    opts,
                },
                dtype: KvDtype::F16,
                precision,
            });
        }
    }
    // Paged: decode and prefill batches, block sizes in turn.
    let block_sizes = [16, 1, 32, 128, 8];
    let mut b = 0;
    let mut next_block = || {
        b += 1;
        block_sizes[(b - 1) % block_sizes.len()]
    };
    // Quick mode runs each quantized storage in one precision, in turn (every new storage
    // format is a pipeline to compile, the bulk of a check's time on a software adapter).
    let mut quant_turn = 0;
    for &(s, format) in &shapes {
        let format_precisions: Vec<Precision> = if quick && format.k.is_quantized() {
            quant_turn += 1;
            vec![precisions[(quant_turn - 1) % precisions.len()]]
        } else {
            precisions.to_vec()
        };
        for lens in [&decode_lens, &prefill_lens] {
            for &precision in &format_precisions {
                checks.push(Check::Paged {
                    problem: Problem {
                        shape: s,
                        lens: lens.clone(),
                        opts: Opts::Plain,
                    },
                    format,
                    precision,
                    block_size: next_block(),
                });
            }
        }
    }
    // Options, in bf16 and (full grid) a quantized storage each.
    let option_formats: &[(Opts, KvFormat)] = if quick {
        &[]
    } else {
        &[
            (
                Opts::WindowSoftcap,
                KvFormat::mixed(KvDtype::Int8, KvDtype::Int4),
            ),
            (Opts::AlibiSinks, KvFormat::per_tensor(KvDtype::Fp8E4M3)),
            (Opts::NonCausal, KvFormat::same(KvDtype::Int4)),
        ]
    };
    let option_checks = option_sets
        .into_iter()
        .chain([Opts::NonCausal])
        .map(|o| (o, KvFormat::same(KvDtype::Bf16)))
        .chain(option_formats.iter().copied());
    for (opts, format) in option_checks {
        for lens in [&decode_lens, &prefill_lens] {
            for &precision in precisions {
                checks.push(Check::Paged {
                    problem: Problem {
                        shape: options_shape,
                        lens: lens.clone(),
                        opts,
                    },
                    format,
                    precision,
                    block_size: next_block(),
                });
            }
        }
    }
    // NaN and infinities: the f32 kernels (the f16 ones hold values in f16, whose own rounding
    // the reference does not model), f32 storage and (full grid) the quantized formats, whose
    // int8/int4 rows holding NaN or infinity read NaN.
    let special_formats: &[KvFormat] = if quick {
        &[KvFormat::same(KvDtype::F32)]
    } else {
        &[
            KvFormat::same(KvDtype::F32),
            KvFormat::same(KvDtype::F16),
            KvFormat::mixed(KvDtype::Int8, KvDtype::Int4),
            KvFormat::same(KvDtype::Fp8E4M3),
        ]
    };
    for &format in special_formats {
        for lens in [&decode_lens, &prefill_lens] {
            checks.push(Check::Paged {
                problem: Problem {
                    shape: shape(64, 64, 8, 2),
                    lens: lens.clone(),
                    opts: Opts::NanInf,
                },
                format,
                precision: Precision::F32,
                block_size: next_block(),
            });
        }
    }
    // KV decoders: every format, per-tensor and per-row FP8 scales.
    let dims: &[usize] = if quick {
        &[128]
    } else {
        &[64, 80, 96, 128, 256]
    };
    for &head_dim in dims {
        for dtype in KvDtype::ALL {
            if dtype.check_head_dim(head_dim).is_err() {
                continue;
            }
            checks.push(Check::Dequant {
                dtype,
                head_dim,
                per_tensor: false,
            });
            if dtype.fp8_format().is_some() {
                checks.push(Check::Dequant {
                    dtype,
                    head_dim,
                    per_tensor: true,
                });
            }
        }
    }
    // Appends into the paged cache: every format, per-row and per-tensor FP8 scales.
    let appends: Vec<(usize, usize)> = if quick {
        vec![(128, 16)]
    } else {
        // Blocks of at most 64 KiB: a block must fit one (capped) binding.
        vec![(64, 1), (80, 16), (128, 16), (256, 32)]
    };
    for (head_dim, block_size) in appends {
        for dtype in KvDtype::ALL {
            if dtype.check_head_dim(head_dim).is_err() {
                continue;
            }
            let modes: &[bool] = if dtype.fp8_format().is_some() {
                &[false, true]
            } else {
                &[false]
            };
            for &per_tensor in modes {
                for src in [SourceDtype::F32, SourceDtype::F16] {
                    checks.push(Check::AppendKv {
                        dtype,
                        head_dim,
                        block_size,
                        src,
                        per_tensor,
                    });
                }
            }
        }
    }
    checks.extend(mla::mla_grid(quick, precisions).into_iter().map(Check::Mla));
    checks
}

/// How a row came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Pass,
    Fail,
    Unavailable,
}

/// A computed row of the table.
struct Outcome {
    status: Status,
    /// Largest absolute error of the output (NaN: not measured).
    max_err: f64,
    /// Normalized mean squared error of the output (NaN: not measured).
    nmse: f64,
    /// Largest absolute error of the lse, for attention kernels.
    lse_err: Option<f64>,
    /// The error of a kernel that failed to run, or what else is worth saying.
    note: Option<String>,
}

impl Outcome {
    /// An attention kernel's outcome: its output and lse against the oracle's, passing when
    /// both errors are within `bounds` (output, lse).
    /// NaN and infinities count as exact where the reference has the same (README, "NaN,
    /// infinities and extreme values"); an element no kernel wrote, as infinitely wrong.
    fn attention(got: &AttentionOutput, want: &AttentionOutput, bounds: (f64, f64)) -> Self {
        let (bound, lse_bound) = bounds;
        let max_err = special_aware_err(&got.out, &want.out);
        let lse_err = special_aware_err(&got.lse, &want.lse);
        let pass = max_err <= bound && lse_err <= lse_bound;
        // NMSE over the elements the reference gives a finite value.
        let (g, w): (Vec<f32>, Vec<f32>) = got
            .out
            .iter()
            .zip(&want.out)
            .filter(|(_, w)| w.is_finite())
            .map(|(&g, &w)| (g, w))
            .unzip();
        Self {
            status: if pass { Status::Pass } else { Status::Fail },
            max_err,
            nmse: nmse(&g, &w),
            lse_err: Some(lse_err),
            note: (!pass).then(|| {
                format!(
                    "out error {max_err:.3e} (bound {bound:.3e}), lse error {lse_err:.3e} (bound {lse_bound:.3e})"
                )
            }),
        }
    }

    fn unmeasured(status: Status, note: String) -> Self {
        Self {
            status,
            max_err: f64::NAN,
            nmse: f64::NAN,
            lse_err: None,
            note: Some(note),
        }
    }
}

/// xorshift64*: deterministic test data without dependencies.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `n` standard normal values (Box-Muller) times `scale`.
    pub(crate) fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u1 = self.uniform().max(1e-300);
                let u2 = self.uniform();
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                z as f32 * scale
            })
            .collect()
    }
}

/// Largest absolute difference; NaN anywhere counts as infinite.
pub(crate) fn max_abs_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_nan() || w.is_nan() {
                f64::INFINITY
            } else if g == w {
                0.0
            } else {
                (f64::from(g) - f64::from(w)).abs()
            }
        })
        .fold(0.0, f64::max)
}

/// [`max_abs_err`], except that NaN where the reference is NaN, and an infinity equal to the
/// reference's, count as exact; an element still holding the unwritten-output sentinel is
/// infinitely wrong.
fn special_aware_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if kvattn::gpu::is_unwritten(g) {
                f64::INFINITY
            } else if (g.is_nan() && w.is_nan()) || (w.is_infinite() && g == w) {
                0.0
            } else {
                max_abs_err(&[g], &[w])
            }
        })
        .fold(0.0, f64::max)
}

/// `sum (got - want)^2 / sum want^2` (0 when both are all zero); NaN anywhere counts as infinite.
pub(crate) fn nmse(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() || got.iter().chain(want).any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - f64::from(w)).powi(2);
        den += f64::from(w).powi(2);
    }
    if num == 0.0 {
        0.0
    } else {
        num / den
    }
}

/// The values a kernel reads back from `dtype` storage with scales `mode`.
fn stored(dtype: KvDtype, head_dim: usize, x: &[f32], mode: ScaleMode) -> Result<Vec<f32>> {
    decode_rows(&encode_rows(dtype, head_dim, x, mode)?)
}

fn to_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

/// The f16 kernels' arithmetic done honestly on the CPU: Q, K, V and the probabilities (relative
/// to the row's maximum) rounded to f16, everything else in f64, with the masks and options of
/// [`kvattn::reference`].
fn f16_emulation(
    batch: &RaggedBatch,
    shape: &AttentionShape,
    opts: &AttentionOptions,
) -> AttentionOutput {
    let (q, k, v) = (to_f16(batch.q), to_f16(batch.k), to_f16(batch.v));
    let (hq, hkv) = (shape.num_q_heads, shape.num_kv_heads);
    let (d, dv) = (shape.head_dim_qk, shape.head_dim_v);
    let scale = f64::from(opts.scale_for(shape));
    let mut out = vec![0.0f32; batch.total_q() * hq * dv];
    let mut lse = vec![0.0f32; batch.total_q() * hq];
    for seq in 0..batch.num_seqs() {
        let (q_rows, k_rows) = batch.token_ranges(seq);
        let (len_q, len_k) = (q_rows.len() as i64, k_rows.len() as i64);
        for (i, row) in q_rows.enumerate() {
            let pos = i as i64 + len_k - len_q;
            for h in 0..hq {
                let kvh = h / shape.group();
                let qr = &q[(row * hq + h) * d..][..d];
                let mut keys = Vec::new();
                let mut scores = Vec::new();
                for (j, kr) in k_rows.clone().enumerate() {
                    let j = j as i64;
                    let visible = !opts.causal
                        || (j <= pos && opts.sliding_window.is_none_or(|w| j > pos - w as i64));
                    if !visible {
                        continue;
                    }
                    let kv = &k[(kr * hkv + kvh) * d..][..d];
                    let dot: f64 = qr
                        .iter()
                        .zip(kv)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum();
                    let mut s = scale * dot;
                    if let Some(cap) = opts.softcap {
                        let cap = f64::from(cap);
                        s = cap * (s / cap).tanh();
                    }
                    if let Some(slopes) = &opts.alibi_slopes {
                        s -= f64::from(slopes[h]) * (pos - j).unsigned_abs() as f64;
                    }
                    keys.push(kr);
                    scores.push(s);
                }
                let sink = opts.sinks.as_ref().map(|s| f64::from(s[h]));
                let m = scores
                    .iter()
                    .copied()
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores
                    .iter()
                    .map(|&s| f64::from(half::f16::from_f64((s - m).exp()).to_f32()))
                    .collect();
                let l: f64 = p.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
                lse[row * hq + h] = (m + l.ln()) as f32;
                for c in 0..dv {
                    let acc: f64 = keys
                        .iter()
                        .zip(&p)
                        .map(|(&kr, &pj)| pj * f64::from(v[(kr * hkv + kvh) * dv + c]))
                        .sum();
                    out[(row * hq + h) * dv + c] = (acc / l) as f32;
                }
            }
        }
    }
    AttentionOutput { out, lse }
}

/// Random tensors of a problem (`q` already sized for its query rows).
struct ProblemData {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
}

impl ProblemData {
    fn new(p: &Problem, seed: u64) -> Self {
        let s = &p.shape;
        let mut cu_q = vec![0u32];
        let mut cu_k = vec![0u32];
        for &(lq, lk) in &p.lens {
            cu_q.push(cu_q.last().unwrap() + lq as u32);
            cu_k.push(cu_k.last().unwrap() + lk as u32);
        }
        let (tq, tk) = (
            *cu_q.last().unwrap() as usize,
            *cu_k.last().unwrap() as usize,
        );
        let mut rng = Rng::new(seed);
        let mut data = Self {
            q: rng.normals(tq * s.num_q_heads * s.head_dim_qk, 1.0),
            k: rng.normals(tk * s.num_kv_heads * s.head_dim_qk, 1.0),
            v: rng.normals(tk * s.num_kv_heads * s.head_dim_v, 1.0),
            cu_q,
            cu_k,
        };
        if p.opts == Opts::NanInf {
            data.plant_specials(s);
        }
        data
    }

    /// NaN and infinity in the data, one kind per sequence: sequence 0's first query (head 0)
    /// gets a NaN (its row is NaN); sequence 1's last key a NaN (only its last query sees it);
    /// sequence 2's middle value an infinity and sequence 3's last value a NaN (one column of
    /// the rows that see them).
    fn plant_specials(&mut self, s: &AttentionShape) {
        let (hkv, dk, dv) = (s.num_kv_heads, s.head_dim_qk, s.head_dim_v);
        let key = |seq: usize, j: usize| self.cu_k[seq] as usize + j;
        let len_k = |seq: usize| (self.cu_k[seq + 1] - self.cu_k[seq]) as usize;
        let seqs = self.cu_q.len() - 1;
        self.q[self.cu_q[0] as usize * s.num_q_heads * dk] = f32::NAN;
        if seqs > 1 {
            let j = key(1, len_k(1) - 1);
            self.k[j * hkv * dk + 1] = f32::NAN;
        }
        if seqs > 2 {
            let j = key(2, len_k(2) / 2);
            self.v[j * hkv * dv + 2] = f32::INFINITY;
        }
        if seqs > 3 {
            let j = key(3, len_k(3) - 1);
            self.v[(j * hkv + hkv - 1) * dv + 3] = f32::NAN;
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

/// The oracle of an attention check: the reference on the stored values and, for f16 kernels,
/// the honest f16 emulation on the same values.
struct Oracle {
    want: AttentionOutput,
    f16: Option<AttentionOutput>,
}

/// FNV-1a of `text`: the data seed of a problem, so checks of the same problem (decode and
/// paged, both precisions) see the same data and share their oracle.
fn seed_of(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What the verifier keeps across checks: the adapter and, made on first use, a second
/// context whose storage bindings are capped so that pools split over several buffers.
struct Verifier {
    ctx: Context,
    capped: Option<Context>,
    /// Oracles by problem and storage format.
    oracles: HashMap<String, Oracle>,
}

/// Binding cap of the append checks' context (pools span several buffers).
const APPEND_BINDING_CAP: u64 = 64 << 10;
/// KV heads of the append checks.
const APPEND_KV_HEADS: usize = 2;

impl Verifier {
    /// Compares an attention kernel's output with the reference on the stored values (K and V
    /// in `format` with scales `modes`, encoded by the CPU codec), with the tolerance of
    /// `precision`.
    fn judge_attention(
        &mut self,
        got: &AttentionOutput,
        data: &ProblemData,
        problem: &Problem,
        (format, modes): (KvFormat, (ScaleMode, ScaleMode)),
        precision: Precision,
    ) -> Result<Outcome> {
        let s = &problem.shape;
        let opts = problem.opts.options(s.num_q_heads);
        let k = stored(format.k, s.head_dim_qk, &data.k, modes.0)?;
        let v = stored(format.v, s.head_dim_v, &data.v, modes.1)?;
        let batch = data.batch(&k, &v);
        let key = format!("{problem:?} {format}");
        if !self.oracles.contains_key(&key) {
            let want = reference::attention(&batch, s, &opts)?;
            self.oracles.insert(key.clone(), Oracle { want, f16: None });
        }
        let oracle = self.oracles.get_mut(&key).expect("inserted above");
        if precision == Precision::F16 && oracle.f16.is_none() {
            oracle.f16 = Some(f16_emulation(&batch, s, &opts));
        }
        let want = &oracle.want;
        let scale = want
            .out
            .iter()
            .filter(|x| x.is_finite())
            .map(|x| f64::from(x.abs()))
            .fold(1.0, f64::max);
        let (bound, lse_bound) = match (precision, &oracle.f16) {
            (Precision::F16, Some(emu)) => (
                2.0 * max_abs_err(&emu.out, &want.out) + 1e-5 * scale,
                2.0 * max_abs_err(&emu.lse, &want.lse) + 1e-5,
            ),
            _ => (1e-4 * scale, 1e-4),
        };
        Ok(Outcome::attention(got, want, (bound, lse_bound)))
    }

    fn run(&mut self, check: &Check, seed: u64) -> Result<Outcome> {
        match check {
            Check::Decode {
                problem,
                dtype,
                precision,
            } => {
                let data = ProblemData::new(problem, seed_of(&format!("{problem:?}")));
                let opts = problem.opts.options(problem.shape.num_q_heads);
                let config = DecodeConfig {
                    k_dtype: *dtype,
                    v_dtype: *dtype,
                    precision: *precision,
                };
                let batch = data.batch(&data.k, &data.v);
                let storage = (
                    KvFormat::same(*dtype),
                    (ScaleMode::PerRow, ScaleMode::PerRow),
                );
                match decode_batch(&self.ctx, &batch, &problem.shape, &opts, &config) {
                    Ok(got) => self.judge_attention(&got, &data, problem, storage, *precision),
                    Err(e) => Ok(Outcome::unmeasured(Status::Fail, e.to_string())),
                }
            }
            Check::Paged {
                problem,
                format,
                precision,
                block_size,
            } => {
                let data = ProblemData::new(problem, seed_of(&format!("{problem:?}")));
                let opts = problem.opts.options(problem.shape.num_q_heads);
                let modes = format.modes(&data.k, &data.v)?;
                let tensor_scale = |m: ScaleMode| match m {
                    ScaleMode::PerTensor(s) => Some(s),
                    ScaleMode::PerRow => None,
                };
                let setup = PagedSetup {
                    k_dtype: format.k,
                    v_dtype: format.v,
                    k_scale: tensor_scale(modes.0),
                    v_scale: tensor_scale(modes.1),
                    block_size: *block_size,
                    precision: *precision,
                    seed,
                };
                let batch = data.batch(&data.k, &data.v);
                let result = check_paged(&batch, &problem.shape, &opts, &setup)
                    .and_then(|()| run_paged(&self.ctx, &batch, &problem.shape, &opts, &setup));
                let storage = (*format, modes);
                match result {
                    Ok(got) => self.judge_attention(&got, &data, problem, storage, *precision),
                    Err(Error::InvalidArgument(m)) if m == PAGED_UNIMPLEMENTED => {
                        Ok(Outcome::unmeasured(Status::Unavailable, m))
                    }
                    Err(e) => Ok(Outcome::unmeasured(Status::Fail, e.to_string())),
                }
            }
            Check::Dequant {
                dtype,
                head_dim,
                per_tensor,
            } => self.dequant(*dtype, *head_dim, *per_tensor, seed),
            Check::AppendKv {
                dtype,
                head_dim,
                block_size,
                src,
                per_tensor,
            } => self.append_kv(
                AppendCase {
                    dtype: *dtype,
                    d: *head_dim,
                    block_size: *block_size,
                    src: *src,
                    per_tensor: *per_tensor,
                },
                seed,
            ),
            Check::Mla(m) => m.run(&self.ctx, seed),
        }
    }

    /// GPU decoders against the CPU codec on 3 x 37 rows with an outlier per row.
    fn dequant(&self, dtype: KvDtype, d: usize, per_tensor: bool, seed: u64) -> Result<Outcome> {
        let rows = 3 * 37;
        let mut x = Rng::new(seed).normals(rows * d, 2.0);
        for (r, row) in x.chunks_mut(d).enumerate() {
            row[r % d] *= 40.0;
        }
        let mode = match dtype.fp8_format() {
            Some(fmt) if per_tensor => {
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                ScaleMode::PerTensor(amax / fmt.max_value())
            }
            _ => ScaleMode::PerRow,
        };
        let rows = encode_rows(dtype, d, &x, mode)?;
        let want = decode_rows(&rows)?;
        match dequantize(&self.ctx, &rows) {
            Ok(got) => Ok(exact_outcome(&got, &want)),
            Err(e) => Ok(Outcome::unmeasured(Status::Fail, e.to_string())),
        }
    }

    /// Appends three sequences in two interleaved rounds into a cache whose pools span several
    /// buffers, free blocks shuffled, and compares the stored value and scale words with the CPU
    /// encoder's. The data holds edge rows (see [`edge_rows`]); per-tensor FP8 scales are
    /// calibrated on the first sequence only, so later values saturate.
    fn append_kv(&mut self, case: AppendCase, seed: u64) -> Result<Outcome> {
        let AppendCase {
            dtype,
            d,
            block_size,
            src,
            per_tensor,
        } = case;
        if self.capped.is_none() {
            self.capped = Some(Context::with_options(&ContextOptions {
                max_storage_binding_cap: Some(APPEND_BINDING_CAP),
                ..Default::default()
            })?);
        }
        let ctx = self.capped.as_ref().expect("created above");
        let hkv = APPEND_KV_HEADS;
        let lens = [5usize, 17, 40];
        let row = hkv * d;
        let mut rng = Rng::new(seed);
        let mut data: Vec<(Vec<f32>, Vec<f32>)> = lens
            .iter()
            .map(|&n| (rng.normals(n * row, 1.5), rng.normals(n * row, 1.5)))
            .collect();
        if dtype.is_quantized() {
            let (k, v) = &mut data[2];
            edge_rows(dtype, d, k, &mut rng);
            edge_rows(dtype, d, &mut v[row..], &mut rng);
        }
        if src == SourceDtype::F16 {
            for (k, v) in &mut data {
                *k = to_f16(k);
                *v = to_f16(v);
            }
        }
        let mode = |x: &[f32]| -> Result<ScaleMode> {
            Ok(if per_tensor {
                ScaleMode::PerTensor(per_tensor_scale(dtype, x, 1.0)?)
            } else {
                ScaleMode::PerRow
            })
        };
        let (k_mode, v_mode) = (mode(&data[0].0)?, mode(&data[0].1)?);
        let scales = |m: ScaleMode| match m {
            ScaleMode::PerTensor(s) => CacheScales::PerTensor(vec![s]),
            ScaleMode::PerRow => CacheScales::PerRow,
        };
        let config = PagedKvConfig {
            block_size,
            prefix_caching: false,
            k_scales: scales(k_mode),
            v_scales: scales(v_mode),
            ..PagedKvConfig::new(1, hkv, d, dtype)
        };
        // At least twice the blocks needed, and enough for three or more buffers.
        let needed: usize = lens.iter().map(|n| n.div_ceil(block_size)).sum();
        let per_buffer = (APPEND_BINDING_CAP / config.k_layout().block_bytes()).max(1) as usize;
        let blocks = (2 * needed + 2).max(2 * per_buffer + 1);
        let mut cache = PagedKvCache::new(ctx, config, PoolSize::Blocks(blocks))?;
        cache.shuffle_free_blocks(seed);
        let buffers = cache.layer(0)?.k.buffers().len();
        for s in 0..lens.len() {
            cache.add_sequence(s as u64, &[])?;
        }
        // Two rounds: the first 2/3 of every sequence, then the rest.
        let split: Vec<usize> = lens.iter().map(|&n| (2 * n).div_ceil(3)).collect();
        for round in 0..2 {
            let ranges: Vec<std::ops::Range<usize>> = lens
                .iter()
                .zip(&split)
                .map(|(&n, &m)| if round == 0 { 0..m } else { m..n })
                .collect();
            match src {
                SourceDtype::F32 => {
                    for (s, r) in ranges.iter().enumerate() {
                        let (k, v) = &data[s];
                        let tokens: Vec<u32> = r.clone().map(|t| t as u32).collect();
                        cache.append_host(
                            ctx,
                            s as u64,
                            &tokens,
                            &[k[r.start * row..r.end * row].to_vec()],
                            &[v[r.start * row..r.end * row].to_vec()],
                        )?;
                    }
                }
                SourceDtype::F16 => {
                    let mut batch = AppendBatch::new();
                    let (mut kh, mut vh) = (Vec::new(), Vec::new());
                    for (s, r) in ranges.iter().enumerate() {
                        let (k, v) = &data[s];
                        let tokens: Vec<u32> = r.clone().map(|t| t as u32).collect();
                        cache.append_tokens(ctx, &mut batch, s as u64, &tokens)?;
                        let bits = |x: &[f32]| {
                            x.iter()
                                .map(|&v| half::f16::from_f32(v).to_bits())
                                .collect::<Vec<u16>>()
                        };
                        kh.extend(bits(&k[r.start * row..r.end * row]));
                        vh.extend(bits(&v[r.start * row..r.end * row]));
                    }
                    let kb = ctx.upload("verify k", &pack_halves(&kh))?;
                    let vb = ctx.upload("verify v", &pack_halves(&vh))?;
                    cache.write_layer(ctx, 0, &batch, &kb, &vb, SourceDtype::F16)?;
                }
            }
        }
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let (mut mismatched, mut scale_mismatched) = (0usize, 0usize);
        let differ = |a: &[u32], b: &[u32]| {
            a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
        };
        for (s, (k, v)) in data.iter().enumerate() {
            let (gk, gv) = cache.read_rows(ctx, s as u64, 0)?;
            let ek = encode_rows(dtype, d, k, k_mode)?;
            let ev = encode_rows(dtype, d, v, v_mode)?;
            for (g, e) in [(gk, ek), (gv, ev)] {
                mismatched += differ(&g.words, &e.words);
                scale_mismatched += differ(&g.scales, &e.scales);
                if g.scale_mode != e.scale_mode {
                    scale_mismatched += 1;
                }
                want.extend(decode_rows(&e)?);
                // Decoded with the CPU's scales where the GPU's are malformed.
                let g = EncodedRows {
                    words: g.words,
                    scales: if g.scales.len() == e.scales.len() {
                        g.scales
                    } else {
                        e.scales.clone()
                    },
                    ..e
                };
                got.extend(decode_rows(&g)?);
            }
        }
        let mut outcome = exact_outcome(&got, &want);
        if mismatched + scale_mismatched > 0 {
            outcome.status = Status::Fail;
            outcome.note = Some(format!(
                "{mismatched} stored value words and {scale_mismatched} scale words differ from \
                 the CPU encoder's"
            ));
        }
        if buffers < 3 {
            outcome
                .note
                .get_or_insert_with(|| format!("K pool in only {buffers} buffer(s)"));
        }
        Ok(outcome)
    }
}

/// One append check.
#[derive(Debug, Clone, Copy)]
struct AppendCase {
    dtype: KvDtype,
    d: usize,
    block_size: usize,
    src: SourceDtype,
    per_tensor: bool,
}

/// Overwrites the first token rows of `x` (rows of `d` values, at least 4 rows) with the edge
/// cases of a quantized `dtype`: a zero row; a row whose largest magnitude is the format's
/// largest value (scale 1) holding exact ties between adjacent codes (rounded to even), subnormal
/// FP8 values and their ties; a row of tiny values; a row with one huge outlier, so that the
/// others fall into the subnormal range.
fn edge_rows(dtype: KvDtype, d: usize, x: &mut [f32], rng: &mut Rng) {
    let rows: Vec<&mut [f32]> = x.chunks_mut(d).take(4).collect();
    let [zero, ties, tiny, outlier] = <[&mut [f32]; 4]>::try_from(rows).expect("4 rows");
    zero.fill(0.0);
    // Ties: the midpoint of two adjacent representable values, for a range of exponents.
    let (max, mantissa_bits, min_exp) = match dtype.fp8_format() {
        Some(f) => (
            f.max_value(),
            if dtype == KvDtype::Fp8E4M3 { 3 } else { 2 },
            if dtype == KvDtype::Fp8E4M3 { -9 } else { -16 },
        ),
        None => (127.0, 0, 0),
    };
    for (i, t) in ties.iter_mut().enumerate() {
        let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
        *t = sign
            * if dtype.fp8_format().is_some() {
                // (1 + (2m + 1) / 2^(mb + 1)) * 2^e, e from the subnormal range up, and
                // (2m + 1) * 2^(min_exp - 1) (ties between subnormals).
                let m = (i / 2) % (1 << mantissa_bits);
                let e = min_exp + (i / 7) as i32 % (12 - min_exp);
                if i % 5 == 4 {
                    (2 * m + 1) as f32 * 2f32.powi(min_exp - 1)
                } else {
                    (1.0 + (2 * m + 1) as f32 / (2 << mantissa_bits) as f32) * 2f32.powi(e)
                }
            } else {
                (i % 120) as f32 + 0.5
            };
    }
    ties[0] = max;
    ties[1] = -max;
    for t in tiny.iter_mut() {
        *t = rng.normals(1, 1e-3)[0];
    }
    outlier[d / 2] = 3e3;
}

/// A bit-exact comparison: pass iff every value has the same bits.
fn exact_outcome(got: &[f32], want: &[f32]) -> Outcome {
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    Outcome {
        status: if same { Status::Pass } else { Status::Fail },
        max_err: max_abs_err(got, want),
        nmse: nmse(got, want),
        lse_err: None,
        note: (!same).then(|| "not bit-exact with the CPU codec".to_string()),
    }
}

/// An error for the tables: "-" for none (NaN), "0", or two significant digits.
pub(crate) fn fmt_err(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else if x == 0.0 {
        "0".into()
    } else {
        format!("{x:.2e}")
    }
}

/// Runs `kvattn verify`; `Ok(false)` when some check failed (the table says which).
pub fn run(args: &VerifyArgs) -> Result<bool> {
    if args.quality {
        return crate::quality::run(args.quick, args.json);
    }
    const KERNELS: [&str; 5] = ["decode", "paged", "dequant", "append_kv", "mla"];
    if let Some(bad) = args.kernels.iter().find(|k| !KERNELS.contains(&k.as_str())) {
        return Err(Error::InvalidArgument(format!(
            "unknown kernel {bad:?}; valid: {}",
            KERNELS.join(", ")
        )));
    }
    let start = Instant::now();
    let ctx = Context::new()?;
    let a = ctx.adapter();
    let mut precisions = vec![Precision::F32];
    if ctx.caps().shader_f16 {
        precisions.push(Precision::F16);
    }
    let mut checks = grid(args.quick, &precisions);
    if !args.kernels.is_empty() {
        checks.retain(|c| args.kernels.iter().any(|k| k == c.kernel()));
    }
    println!(
        "kvattn verify{} on {} ({}, {}); features [{}]",
        if args.quick { " --quick" } else { "" },
        a.name,
        a.backend,
        a.device_type,
        ctx.caps().feature_names().join(", ")
    );
    let mut verifier = Verifier {
        ctx,
        capped: None,
        oracles: HashMap::new(),
    };
    let mut rows = Vec::with_capacity(checks.len());
    for (i, check) in checks.iter().enumerate() {
        let name = check.name();
        eprint!(
            "verify [{:>3}/{}] {} {name} ... ",
            i + 1,
            checks.len(),
            check.kernel()
        );
        let t = Instant::now();
        let outcome = verifier
            .run(check, 0x5eed + i as u64)
            .unwrap_or_else(|e| Outcome::unmeasured(Status::Fail, e.to_string()));
        let status = match outcome.status {
            Status::Pass => "pass",
            Status::Fail => "FAIL",
            Status::Unavailable => "unavailable",
        };
        eprintln!("{status} ({:.2}s)", t.elapsed().as_secs_f64());
        rows.push((check, name, outcome));
    }
    print_table(&rows);
    let count = |s: Status| rows.iter().filter(|r| r.2.status == s).count();
    let (passed, failed, unavailable) = (
        count(Status::Pass),
        count(Status::Fail),
        count(Status::Unavailable),
    );
    println!(
        "{} checks: {passed} passed, {failed} failed, {unavailable} unavailable ({:.1}s)",
        rows.len(),
        start.elapsed().as_secs_f64()
    );
    if failed > 0 {
        eprintln!("kvattn: verify: {failed} of {} checks failed", rows.len());
    }
    Ok(failed == 0)
}

fn print_table(rows: &[(&Check, String, Outcome)]) {
    let case_w = rows.iter().map(|r| r.1.len()).max().unwrap_or(4).max(4);
    println!(
        "{:<9}  {:<case_w$}  {:>9}  {:>9}  {:>9}  result",
        "kernel", "case", "max error", "NMSE", "lse error"
    );
    for (check, name, o) in rows {
        let status = match o.status {
            Status::Pass => "pass",
            Status::Fail => "FAIL",
            Status::Unavailable => "unavailable",
        };
        println!(
            "{:<9}  {name:<case_w$}  {:>9}  {:>9}  {:>9}  {status}",
            check.kernel(),
            fmt_err(o.max_err),
            fmt_err(o.nmse),
            o.lse_err.map_or("-".into(), fmt_err),
        );
    }
    // Notes: why rows failed or were unavailable (once per distinct message).
    let mut notes: Vec<String> = Vec::new();
    for (check, name, o) in rows {
        if let Some(n) = &o.note {
            let line = match o.status {
                Status::Unavailable => format!("{}: unavailable: {n}", check.kernel()),
                _ => format!("{} {name}: {n}", check.kernel()),
            };
            if !notes.contains(&line) {
                notes.push(line);
            }
        }
    }
    for n in notes {
        println!("note: {}", n.replace('\n', " "));
    }
    // Largest errors per kernel and format, over the measured rows.
    let mut groups: Vec<(String, f64, f64)> = Vec::new();
    for (check, _, o) in rows {
        if o.max_err.is_nan() {
            continue;
        }
        let g = check.group();
        let lse = o.lse_err.unwrap_or(f64::NAN);
        match groups.iter_mut().find(|x| x.0 == g) {
            Some(x) => {
                x.1 = x.1.max(o.max_err);
                x.2 = x.2.max(lse);
            }
            None => groups.push((g, o.max_err, lse)),
        }
    }
    if !groups.is_empty() {
        println!("largest errors:");
        let w = groups.iter().map(|g| g.0.len()).max().unwrap_or(0).max(28);
        for (g, e, l) in groups {
            if l.is_nan() {
                println!("  {g:<w$} out {}", fmt_err(e));
            } else {
                println!("  {g:<w$} out {}  lse {}", fmt_err(e), fmt_err(l));
            }
        }
    }
}
