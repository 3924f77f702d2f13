//! The cases of the verification grid: attention problems, storage formats, option sets, and
//! the names the report gives them.

use crate::attention::{AttentionOptions, AttentionShape};
use crate::cache::append_kv::SourceDtype;
use crate::quant::{per_tensor_scale, KvDtype, ScaleMode};
use crate::shader::Precision;
use crate::Result;

use super::append::APPEND_KV_HEADS;
use super::mla::MlaCheck;
use super::report::Kernel;

/// The error the paged kernel returns until it is implemented; rows that get exactly this
/// error are reported as unavailable, not failed.
pub(crate) const PAGED_UNIMPLEMENTED: &str = "paged attention is not implemented yet";

/// Unscaled storage formats: every attention kernel reads them.
pub(crate) const ATTN_DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

/// Quantized storage of the paged checks: every quantized format, per-tensor FP8, and K and V
/// in different formats.
pub(crate) const QUANT_FORMATS: [KvFormat; 7] = [
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
pub(crate) struct KvFormat {
    pub(crate) k: KvDtype,
    pub(crate) v: KvDtype,
    /// FP8 with static per-tensor scales calibrated on the problem's K and V (amax / format max);
    /// otherwise scales per token row.
    pub(crate) per_tensor: bool,
}

impl KvFormat {
    pub(crate) const fn same(dtype: KvDtype) -> Self {
        Self {
            k: dtype,
            v: dtype,
            per_tensor: false,
        }
    }

    pub(crate) const fn mixed(k: KvDtype, v: KvDtype) -> Self {
        Self {
            k,
            v,
            per_tensor: false,
        }
    }

    pub(crate) const fn per_tensor(dtype: KvDtype) -> Self {
        Self {
            k: dtype,
            v: dtype,
            per_tensor: true,
        }
    }

    /// Whether both head dims are ones the formats store.
    pub(crate) fn fits(&self, shape: &AttentionShape) -> bool {
        self.k.check_head_dim(shape.head_dim_qk).is_ok()
            && self.v.check_head_dim(shape.head_dim_v).is_ok()
    }

    /// The scale modes of K and V for the problem's data.
    pub(crate) fn modes(&self, k: &[f32], v: &[f32]) -> Result<(ScaleMode, ScaleMode)> {
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
pub(crate) const CONTEXTS: [usize; 4] = [1, 17, 97, 1000];

/// Option sets of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opts {
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
    pub(crate) fn name(self) -> &'static str {
        match self {
            Opts::Plain => "",
            Opts::WindowSoftcap => " window+softcap",
            Opts::AlibiSinks => " alibi+sinks+scale",
            Opts::NonCausal => " non-causal",
            Opts::NanInf => " nan+inf",
        }
    }

    pub(crate) fn options(self, hq: usize) -> AttentionOptions {
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
pub(crate) struct Problem {
    pub(crate) shape: AttentionShape,
    pub(crate) lens: Vec<(usize, usize)>,
    pub(crate) opts: Opts,
}

/// One row of the table to compute.
#[derive(Debug, Clone)]
pub(crate) enum Check {
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
    Mla(MlaCheck),
}

impl Check {
    pub(crate) fn kernel(&self) -> Kernel {
        match self {
            Check::Decode { .. } => Kernel::Decode,
            Check::Paged { .. } => Kernel::Paged,
            Check::Dequant { .. } => Kernel::Dequant,
            Check::AppendKv { .. } => Kernel::AppendKv,
            Check::Mla(_) => Kernel::Mla,
        }
    }

    /// The storage format(s) of the case.
    pub(crate) fn format(&self) -> String {
        match self {
            Check::Decode { dtype, .. } => dtype.to_string(),
            Check::Paged { format, .. } => format.to_string(),
            Check::Dequant {
                dtype, per_tensor, ..
            }
            | Check::AppendKv {
                dtype, per_tensor, ..
            } => {
                if *per_tensor {
                    format!("{dtype} per-tensor")
                } else {
                    dtype.to_string()
                }
            }
            Check::Mla(m) => m.storage(),
        }
    }

    /// The kernel's precision variant (`None` for the codecs).
    pub(crate) fn precision(&self) -> Option<Precision> {
        match self {
            Check::Decode { precision, .. } | Check::Paged { precision, .. } => Some(*precision),
            Check::Mla(m) => Some(m.precision),
            Check::Dequant { .. } | Check::AppendKv { .. } => None,
        }
    }

    /// The kernel and the formats, for the summary of largest errors.
    pub(crate) fn group(&self) -> String {
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

    pub(crate) fn name(&self) -> String {
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
pub(crate) fn lens_name(lens: &[(usize, usize)]) -> String {
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
