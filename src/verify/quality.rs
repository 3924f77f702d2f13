//! [`quality`](super::quality()): how much each KV storage format costs in attention output quality,
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

use crate::attention::AttentionOptions;
use crate::gpu::{AdapterSummary, Context};
use crate::quant::{decode_rows, encode_rows, per_tensor_scale, ScaleMode};
use crate::reference;
use crate::shader::Precision;
use crate::Result;

use super::clock::Stopwatch;
use super::metrics::{max_abs_err, nmse};
use super::paged::{check_paged, run_paged, PagedSetup};
use super::quality_data::{
    Data, Format, BLOCK_SIZE, CALIBRATION_TOKENS, CONTEXTS, D, FORMATS, HKV, HQ, OUTLIER_CHANNELS,
    OUTLIER_FACTOR, QUICK_CONTEXTS, QUICK_TOKENS_PER_CONTEXT, SHAPE, TOKENS_PER_CONTEXT,
};
pub use super::quality_data::{Keys, BOUND_FACTOR, NMSE_FLOOR};

/// What [`quality`](super::quality()) measures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QualityOptions {
    /// Contexts 128 and 1024 only, about 2K cached tokens each (instead of 128 to 16K, about
    /// 32K tokens each).
    pub quick: bool,
    /// Context lengths instead of those `quick` picks (each a positive number of tokens).
    pub contexts: Vec<usize>,
    /// Cached tokens per context length instead of those `quick` picks: that many divided by
    /// the context (at least one) sequences of each length.
    pub tokens_per_context: Option<usize>,
}

/// One row of the table: a key distribution, a storage format and a context length.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct QualityRow {
    /// The key distribution.
    pub keys: Keys,
    /// The storage format of K and V, e.g. `fp8-e4m3 per-tensor x2`.
    pub format: String,
    /// Cached tokens of each sequence.
    pub context: usize,
    /// NMSE of the paged kernel over the GPU-encoded cache; `None` when the kernel failed
    /// (see the note).
    pub gpu_nmse: Option<f64>,
    /// NMSE of the f64 reference on CPU-quantized K/V (the format's own error).
    pub codec_nmse: f64,
    /// Largest absolute error of the kernel's output; `None` when the kernel failed.
    pub gpu_max_err: Option<f64>,
    /// Largest absolute error of the codec's output.
    pub codec_max_err: f64,
    /// The codec's NMSE with only K quantized (V in f32).
    pub codec_k_only_nmse: f64,
    /// The codec's NMSE with only V quantized (K in f32).
    pub codec_v_only_nmse: f64,
    /// The static per-tensor scale of K, if the format has one.
    pub k_scale: Option<f32>,
    /// The static per-tensor scale of V, if the format has one.
    pub v_scale: Option<f32>,
    /// Whether `gpu_nmse <= BOUND_FACTOR * codec_nmse + NMSE_FLOOR`.
    pub pass: bool,
    /// The kernel's error, when it failed.
    pub note: Option<String>,
}

/// Where the quality table's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct QualityTimes {
    /// Wall time of the whole call.
    pub seconds: f64,
    /// Compute pipelines compiled.
    pub pipelines_compiled: u64,
    /// Seconds compiling them.
    pub compile_seconds: f64,
    /// Seconds on the GPU side less compilation (cache writes, the kernel, read-backs), while
    /// the codec's references run on other threads. It includes what a driver defers to a
    /// pipeline's first dispatch (most of a cold run on Mesa's software adapters), which
    /// [`run`](super::run) measures apart; the table is not repeated.
    pub kernel_seconds: f64,
    /// Seconds of the f64 reference on the f32 K/V (once per key distribution).
    pub reference_seconds: f64,
}

/// The report of [`quality`](super::quality()).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct QualityReport {
    /// The adapter measured.
    pub adapter: AdapterSummary,
    /// Query heads.
    pub num_q_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head dim of K and V.
    pub head_dim: usize,
    /// The kernel's precision.
    pub precision: Precision,
    /// Tokens per cache block.
    pub block_size: usize,
    /// Outlier channels per KV head of [`Keys::Outliers`].
    pub outlier_channels: usize,
    /// How much larger they are.
    pub outlier_factor: f32,
    /// Tokens of the separate sample per-tensor scales are calibrated on.
    pub calibration_tokens: usize,
    /// [`BOUND_FACTOR`].
    pub bound_factor: f64,
    /// [`NMSE_FLOOR`].
    pub nmse_floor: f64,
    /// Every row: per key distribution, per format, per context.
    pub rows: Vec<QualityRow>,
    /// Rows beyond their bound.
    pub failed: usize,
    /// Where the time went.
    pub times: QualityTimes,
}

impl QualityReport {
    /// Whether every row holds its bound.
    pub fn passed(&self) -> bool {
        self.failed == 0
    }
}

/// What [`quality`](super::quality()) reports while it runs.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum QualityProgress<'a> {
    /// The f64 reference on the f32 K/V of a key distribution is done.
    Reference {
        /// The key distribution.
        keys: Keys,
        /// Its wall time.
        seconds: f64,
    },
    /// A format starts (its pipelines may take a while to compile).
    FormatStarted {
        /// Position among the `total` (key distribution, format) pairs (0-based).
        index: usize,
        /// Pairs in the table.
        total: usize,
        /// The key distribution.
        keys: Keys,
        /// The format.
        format: &'a str,
    },
    /// A format is done: its rows, one per context.
    FormatFinished {
        /// Position (0-based).
        index: usize,
        /// Pairs in the table.
        total: usize,
        /// Its rows.
        rows: &'a [QualityRow],
        /// Pipelines compiled during it.
        pipelines_compiled: u64,
        /// Its wall time.
        seconds: f64,
    },
}

/// Measures the quality table on `ctx`, calling `progress` as it goes. The call returns an
/// error when the options are invalid or a reference cannot run; a kernel error makes its
/// rows fail (the note says why).
pub fn quality(
    ctx: &Context,
    options: &QualityOptions,
    progress: &mut dyn FnMut(&QualityProgress),
) -> Result<QualityReport> {
    let clock = Stopwatch::start();
    let contexts: &[usize] = match (&options.contexts[..], options.quick) {
        ([], true) => &QUICK_CONTEXTS,
        ([], false) => &CONTEXTS,
        (c, _) => c,
    };
    let tokens = options.tokens_per_context.unwrap_or(if options.quick {
        QUICK_TOKENS_PER_CONTEXT
    } else {
        TOKENS_PER_CONTEXT
    });
    if contexts.contains(&0) || tokens == 0 {
        return Err(crate::Error::InvalidArgument(format!(
            "quality: contexts {contexts:?} and {tokens} tokens per context must be positive"
        )));
    }
    let before = ctx.counters();
    let total = 2 * FORMATS.len();
    let mut rows = Vec::new();
    let (mut reference_seconds, mut gpu_seconds) = (0.0, 0.0);
    for keys in [Keys::Gaussian, Keys::Outliers] {
        let t = Stopwatch::start();
        let data = Data::new(keys, contexts, tokens);
        let reference_out = reference::attention(
            &data.batch(&data.k, &data.v),
            &SHAPE,
            &AttentionOptions::default(),
        )?
        .out;
        let seconds = t.seconds();
        reference_seconds += seconds;
        progress(&QualityProgress::Reference { keys, seconds });
        for format in FORMATS {
            let index = rows.len() / contexts.len();
            let name = format.name();
            progress(&QualityProgress::FormatStarted {
                index,
                total,
                keys,
                format: &name,
            });
            let (t, compiled) = (Stopwatch::start(), ctx.counters());
            let (got, gpu) = measure(ctx, &data, &reference_out, keys, format)?;
            gpu_seconds += gpu;
            progress(&QualityProgress::FormatFinished {
                index,
                total,
                rows: &got,
                pipelines_compiled: ctx.counters().since(&compiled).pipelines_compiled,
                seconds: t.seconds(),
            });
            rows.extend(got);
        }
    }
    let compiled = ctx.counters().since(&before);
    let compile_seconds = compiled.pipeline_compile_nanos as f64 * 1e-9;
    let failed = rows.iter().filter(|r| !r.pass).count();
    Ok(QualityReport {
        adapter: ctx.adapter().clone(),
        num_q_heads: HQ,
        num_kv_heads: HKV,
        head_dim: D,
        precision: Precision::F32,
        block_size: BLOCK_SIZE,
        outlier_channels: OUTLIER_CHANNELS,
        outlier_factor: OUTLIER_FACTOR,
        calibration_tokens: CALIBRATION_TOKENS,
        bound_factor: BOUND_FACTOR,
        nmse_floor: NMSE_FLOOR,
        rows,
        failed,
        times: QualityTimes {
            seconds: clock.seconds(),
            pipelines_compiled: compiled.pipelines_compiled,
            compile_seconds,
            kernel_seconds: (gpu_seconds - compile_seconds).max(0.0),
            reference_seconds,
        },
    })
}

/// The rows of one key distribution and format, one per context length, and the wall time
/// of the GPU side.
fn measure(
    ctx: &Context,
    data: &Data,
    reference_out: &[f32],
    keys: Keys,
    format: Format,
) -> Result<(Vec<QualityRow>, f64)> {
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
    // this one drives the GPU (one after the other on wasm32, which has no threads).
    let gpu_clock = Stopwatch::start();
    let run_gpu = || {
        let gpu = check_paged(&batch, &SHAPE, &opts, &setup)
            .and_then(|()| run_paged(ctx, &batch, &SHAPE, &opts, &setup));
        (gpu, gpu_clock.seconds())
    };
    let inputs = [(&k, &v), (&k, &data.v), (&data.k, &v)];
    let reference_of = |(k, v): (&Vec<f32>, &Vec<f32>)| {
        reference::attention(&data.batch(k, v), &SHAPE, &AttentionOptions::default())
    };
    #[cfg(not(target_arch = "wasm32"))]
    let ((gpu, gpu_seconds), [codec, codec_k, codec_v]) = std::thread::scope(|scope| {
        let refs = inputs.map(|kv| scope.spawn(move || reference_of(kv)));
        (
            run_gpu(),
            refs.map(|h| h.join().expect("the reference does not panic")),
        )
    });
    #[cfg(target_arch = "wasm32")]
    let ((gpu, gpu_seconds), [codec, codec_k, codec_v]) = (run_gpu(), inputs.map(reference_of));
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
            let codec_k_only_nmse = nmse(&codec_k.out[range.clone()], want);
            let codec_v_only_nmse = nmse(&codec_v.out[range.clone()], want);
            let (codec_nmse, codec_max_err) = (nmse(c, want), max_abs_err(c, want));
            let (gpu_nmse, gpu_max_err, note) = match &gpu {
                Ok(g) => {
                    let g = &g.out[range];
                    (Some(nmse(g, want)), Some(max_abs_err(g, want)), None)
                }
                Err(e) => (None, None, Some(e.to_string())),
            };
            let pass = gpu_nmse.is_some_and(|g| g <= BOUND_FACTOR * codec_nmse + NMSE_FLOOR);
            QualityRow {
                keys,
                format: format.name(),
                context,
                gpu_nmse,
                codec_nmse,
                gpu_max_err,
                codec_max_err,
                codec_k_only_nmse,
                codec_v_only_nmse,
                k_scale: setup.k_scale,
                v_scale: setup.v_scale,
                pass,
                note,
            }
        })
        .collect();
    Ok((rows, gpu_seconds))
}
