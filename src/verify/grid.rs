//! The verification grid: the full one, or the quick subset.

use crate::attention::AttentionShape;
use crate::cache::append_kv::SourceDtype;
use crate::quant::KvDtype;
use crate::shader::Precision;

use super::cases::{Check, KvFormat, Opts, Problem, ATTN_DTYPES, CONTEXTS, QUANT_FORMATS};
use super::mla;

/// The grid: the full one, or the `--quick` subset.
pub(crate) fn grid(quick: bool, precisions: &[Precision]) -> Vec<Check> {
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
            || !crate::attention::decode::SUPPORTED.contains(&format.k)
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
