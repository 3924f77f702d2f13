//! `kvattn run <op>`: one kernel on tensors from a safetensors case file
//! (ARCHITECTURE.md section 12).
//!
//! - `attention`: K/V written into a paged cache of any storage format (quantized on write by
//!   the GPU encoder; physical blocks in shuffled order), then attention over it; writes `out` and
//!   `lse`.
//! - `mla`: Multi-head Latent Attention (`run_mla.rs`).
//! - `quantize`: `x` written into a one-layer paged cache of a storage format by the GPU encoder
//!   and read back; the codes and scales are checked against the CPU codec (an error if they
//!   differ) and written with the GPU decoder's values: `codes`, `scales`, `mins` (int4) and
//!   `dequant`.
//!
//! Everything that can be checked on the host is checked before the GPU is touched (the output
//! path first: its directory, and that it is not the input file); nothing is written on error.

use std::collections::HashMap;
use std::path::PathBuf;

use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::gpu::Context;
use kvattn::quant::dequant::dequantize;
use kvattn::quant::pack::words_to_le_bytes;
use kvattn::quant::{encode_rows, EncodedRows, Int4Params, KvDtype, ScaleMode, INT4_GROUP};
use kvattn::shader::Precision;
pub use kvattn::verify::paged::check_block_size;
use kvattn::verify::paged::{cache_scales, check_paged, check_setup, run_paged, PagedSetup};
use kvattn::{Error, Result};

use crate::case::{invalid, read_file, write_atomic, AttentionCase, CaseFile, OutTensor};
use crate::files::check_outputs;

/// Seed of the free-block shuffle of `run attention` (fixed, so runs are reproducible).
const SHUFFLE_SEED: u64 = 0x6b76_6174_746e;

/// Arguments of `kvattn run`.
#[derive(clap::Args)]
pub struct RunArgs {
    #[command(subcommand)]
    op: RunOp,
}

/// The operations `kvattn run` can perform.
#[derive(clap::Subcommand)]
enum RunOp {
    /// Attention over a paged cache: `q`, `k`, `v`, `cu_seqlens_q`, `cu_seqlens_k` (varlen
    /// layout), options in the metadata; writes `out` and `lse`.
    Attention(AttentionArgs),
    /// Quantize `x` [n, H, d] into a KV storage format: writes the codes, scales and the GPU's
    /// dequantized values.
    Quantize(QuantizeArgs),
    /// Multi-head Latent Attention (DeepSeek-V2) over a latent paged cache: `q_nope`, `q_pe`,
    /// `c_kv`, `k_pe`, `w_uk`, `w_uv`, `cu_seqlens_q`, `cu_seqlens_k`; writes `out` and `lse`.
    Mla(crate::run_mla::MlaRunArgs),
}

/// Arguments of `kvattn run attention`.
#[derive(clap::Args)]
pub struct AttentionArgs {
    /// Case file (safetensors): q, k, v, cu_seqlens_q, cu_seqlens_k; optional sinks,
    /// alibi_slopes; metadata causal, scale, sliding_window, softcap, and k_scale / v_scale
    /// (static per-tensor FP8 scales of K / V; absent: a scale per token row).
    #[arg(long = "in", value_name = "CASE")]
    input: PathBuf,
    /// Result file (safetensors): out [total_q, Hq, d_v] and lse [total_q, Hq].
    #[arg(long, value_name = "RESULT")]
    out: PathBuf,
    /// Storage format of K and V: f32 (default), f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4.
    #[arg(long, value_name = "D")]
    kv_dtype: Option<String>,
    /// Storage format of K (overrides --kv-dtype).
    #[arg(long, value_name = "D")]
    k_dtype: Option<String>,
    /// Storage format of V (overrides --kv-dtype).
    #[arg(long, value_name = "D")]
    v_dtype: Option<String>,
    /// Tokens per cache block: a power of two from 1 to 256.
    #[arg(long, value_name = "N", default_value_t = 16)]
    block_size: usize,
    /// Kernel precision: f32 (portable) or f16 (needs shader-f16).
    #[arg(long, value_name = "P", default_value = "f32")]
    precision: String,
}

/// Arguments of `kvattn run quantize`.
#[derive(clap::Args)]
pub struct QuantizeArgs {
    /// Input file (safetensors): x f32 [n, H, d]; metadata scale (FP8 only: one per-tensor
    /// scale; absent: a scale per token row).
    #[arg(long = "in", value_name = "FILE")]
    input: PathBuf,
    /// Result file (safetensors): codes, scales, mins (int4), dequant.
    #[arg(long, value_name = "RESULT")]
    out: PathBuf,
    /// Storage format: f32, f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4.
    #[arg(long, value_name = "D")]
    kv_dtype: String,
}

/// Runs `kvattn run`.
pub fn run(args: &RunArgs) -> Result<()> {
    match &args.op {
        RunOp::Attention(a) => attention(a),
        RunOp::Quantize(a) => quantize(a),
        RunOp::Mla(a) => crate::run_mla::run(a),
    }
}

/// Parses `--precision`.
pub fn parse_precision(s: &str) -> Result<Precision> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" => Ok(Precision::F32),
        "f16" => Ok(Precision::F16),
        _ => Err(invalid(format!("unknown precision {s:?}; valid: f32, f16"))),
    }
}

/// The storage format of `--kv-dtype`-style flags, f32 when none is given.
fn dtype_flag(specific: &Option<String>, both: &Option<String>) -> Result<KvDtype> {
    specific
        .as_deref()
        .or(both.as_deref())
        .map_or(Ok(KvDtype::F32), str::parse)
}

/// Metadata every result carries: the adapter and backend.
pub fn adapter_meta(ctx: &Context) -> HashMap<String, String> {
    HashMap::from([
        ("adapter".to_string(), ctx.adapter().name.clone()),
        ("backend".to_string(), ctx.adapter().backend.clone()),
    ])
}

/// `kvattn run attention`.
fn attention(args: &AttentionArgs) -> Result<()> {
    let mut setup = PagedSetup {
        k_dtype: dtype_flag(&args.k_dtype, &args.kv_dtype)?,
        v_dtype: dtype_flag(&args.v_dtype, &args.kv_dtype)?,
        k_scale: None,
        v_scale: None,
        block_size: args.block_size,
        precision: parse_precision(&args.precision)?,
        seed: SHUFFLE_SEED,
    };
    check_setup(&setup)?;
    check_outputs(&[("--out", &args.out)], &[("--in", &args.input)])?;
    let bytes = read_file(&args.input)?;
    let file = CaseFile::parse(&bytes, &args.input)?;
    let case = AttentionCase::from_file(&file)?;
    setup.k_scale = file.meta_parse("k_scale", "a number (a per-tensor FP8 scale)")?;
    setup.v_scale = file.meta_parse("v_scale", "a number (a per-tensor FP8 scale)")?;
    let batch = case.batch();
    check_paged(&batch, &case.shape, &case.options, &setup)?;

    let ctx = Context::new()?;
    let result = run_paged(&ctx, &batch, &case.shape, &case.options, &setup)?;
    let (total_q, hq, dv) = (
        batch.total_q(),
        case.shape.num_q_heads,
        case.shape.head_dim_v,
    );
    let mut meta = adapter_meta(&ctx);
    meta.extend([
        ("precision".to_string(), setup.precision.name().to_string()),
        ("k_dtype".to_string(), setup.k_dtype.name().to_string()),
        ("v_dtype".to_string(), setup.v_dtype.name().to_string()),
        ("block_size".to_string(), setup.block_size.to_string()),
    ]);
    for (key, scale) in [("k_scale", setup.k_scale), ("v_scale", setup.v_scale)] {
        if let Some(s) = scale {
            meta.insert(key.to_string(), s.to_string());
        }
    }
    write_atomic(
        &args.out,
        &[
            OutTensor::f32("out", vec![total_q, hq, dv], &result.out),
            OutTensor::f32("lse", vec![total_q, hq], &result.lse),
        ],
        meta,
    )
}

/// `kvattn run quantize`: the CPU codec first (it stores every value; README, "NaN, infinities and
/// extreme values"), then the GPU encoder through a paged cache, compared with it bit for bit.
fn quantize(args: &QuantizeArgs) -> Result<()> {
    let dtype: KvDtype = args.kv_dtype.parse()?;
    check_outputs(&[("--out", &args.out)], &[("--in", &args.input)])?;
    let bytes = read_file(&args.input)?;
    let file = CaseFile::parse(&bytes, &args.input)?;
    file.check_names(&["x"], &["scale"])?;
    let x = file.f32("x", 3, "[n, H, d]")?;
    let (n, h, d) = (x.shape[0], x.shape[1], x.shape[2]);
    if n == 0 || h == 0 {
        return Err(invalid(format!("x has no rows (shape {:?})", x.shape)));
    }
    dtype.check_head_dim(d)?;
    let tensor_scale: Option<f32> = file.meta_parse("scale", "a number")?;
    let mode = match tensor_scale {
        Some(s) if dtype.fp8_format().is_some() => ScaleMode::PerTensor(s),
        Some(_) => {
            return Err(invalid(format!(
                "metadata scale (a per-tensor scale) applies to FP8 only, not {dtype}"
            )))
        }
        None => ScaleMode::PerRow,
    };
    dtype.check_scale_mode(mode)?;
    let want = encode_rows(dtype, d, &x.data, mode)?;
    let ctx = Context::new()?;
    let got = gpu_encode(&ctx, dtype, mode, [n, h, d], &x.data)?;
    compare_codes(&got, &want, h)?;
    quantize_out(&ctx, args, &got, [n, h, d])
}

/// Writes `x` (`[n, H, d]`) as the K and V of `n` tokens of one sequence into a one-layer
/// paged cache of `dtype` (free blocks shuffled, so token order differs from block order) and
/// reads the stored K rows back in token order. The V rows, written from the same values,
/// must equal them.
fn gpu_encode(
    ctx: &Context,
    dtype: KvDtype,
    mode: ScaleMode,
    [n, h, d]: [usize; 3],
    x: &[f32],
) -> Result<EncodedRows> {
    let block_size = 16;
    let config = PagedKvConfig {
        layers: 1,
        num_kv_heads: h,
        head_dim_k: d,
        head_dim_v: d,
        k_dtype: dtype,
        v_dtype: dtype,
        k_scales: cache_scales(mode),
        v_scales: cache_scales(mode),
        block_size,
        prefix_caching: false,
        model_id: String::new(),
    };
    let needed = n.div_ceil(block_size);
    let mut cache = PagedKvCache::new(ctx, config, PoolSize::Blocks(needed + needed / 2 + 1))?;
    cache.shuffle_free_blocks(SHUFFLE_SEED);
    cache.add_sequence(0, &[])?;
    let tokens: Vec<u32> = (0..n as u32).collect();
    cache.append_host(ctx, 0, &tokens, &[x.to_vec()], &[x.to_vec()])?;
    let (k, v) = cache.read_rows(ctx, 0, 0)?;
    if k != v {
        return Err(Error::Gpu(format!(
            "the {dtype} K and V pools hold different words for the same values"
        )));
    }
    Ok(k)
}

/// Fails (`Error::Gpu`, saying how many rows differ and the first one) unless the GPU encoder's
/// rows equal the CPU codec's bit for bit, values and scale words.
fn compare_codes(got: &EncodedRows, want: &EncodedRows, heads: usize) -> Result<()> {
    let (d, dtype) = (want.head_dim, want.dtype);
    let wpr = dtype.words_per_row(d);
    let spr = dtype.scale_words_per_row(d, want.scale_mode);
    let rows = want.num_rows();
    if got.words.len() != want.words.len() || got.scales.len() != want.scales.len() {
        return Err(Error::Gpu(format!(
            "the GPU encoder stored {} value words and {} scale words; the CPU codec {} and {}",
            got.words.len(),
            got.scales.len(),
            want.words.len(),
            want.scales.len()
        )));
    }
    let differs = |r: usize| {
        got.words[r * wpr..(r + 1) * wpr] != want.words[r * wpr..(r + 1) * wpr]
            || got.scales[r * spr..(r + 1) * spr] != want.scales[r * spr..(r + 1) * spr]
    };
    let bad: Vec<usize> = (0..rows).filter(|&r| differs(r)).collect();
    match bad.first() {
        None if got.scale_mode == want.scale_mode => Ok(()),
        None => Err(Error::Gpu(format!(
            "the GPU pool's scale mode {:?} is not the requested {:?}",
            got.scale_mode, want.scale_mode
        ))),
        Some(&r) => Err(Error::Gpu(format!(
            "the GPU encoder's {dtype} codes or scales differ from the CPU codec's in {} of \
             {rows} rows (first: token {} head {}); nothing written",
            bad.len(),
            r / heads,
            r % heads
        ))),
    }
}

/// Dequantizes `rows` on the GPU and writes the result file of `run quantize`.
fn quantize_out(
    ctx: &Context,
    args: &QuantizeArgs,
    rows: &EncodedRows,
    [n, h, d]: [usize; 3],
) -> Result<()> {
    let dtype = rows.dtype;
    let dequant = dequantize(ctx, rows)?;
    let mut tensors = vec![OutTensor::u8(
        "codes",
        vec![n, h, dtype.bytes_per_row(d)],
        words_to_le_bytes(&rows.words),
    )];
    match (dtype, rows.scale_mode) {
        (_, ScaleMode::PerTensor(s)) => tensors.push(OutTensor::f32("scales", vec![1], &[s])),
        (KvDtype::Int4, _) => {
            let params: Vec<Int4Params> = rows
                .scales
                .iter()
                .map(|&w| Int4Params::from_word(w))
                .collect();
            let groups = d / INT4_GROUP;
            let scales: Vec<f32> = params.iter().map(Int4Params::scale).collect();
            let mins: Vec<f32> = params.iter().map(Int4Params::min).collect();
            tensors.push(OutTensor::f32("scales", vec![n, h, groups], &scales));
            tensors.push(OutTensor::f32("mins", vec![n, h, groups], &mins));
        }
        _ if !rows.scales.is_empty() => {
            let scales: Vec<f32> = rows.scales.iter().map(|&w| f32::from_bits(w)).collect();
            tensors.push(OutTensor::f32("scales", vec![n, h], &scales));
        }
        _ => {}
    }
    tensors.push(OutTensor::f32("dequant", vec![n, h, d], &dequant));
    let mut meta = adapter_meta(ctx);
    meta.insert("kv_dtype".into(), dtype.name().into());
    if let ScaleMode::PerTensor(s) = rows.scale_mode {
        meta.insert("scale".into(), s.to_string());
    }
    write_atomic(&args.out, &tensors, meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_that_differ_from_the_cpu_codec_are_an_error() {
        let x: Vec<f32> = (0..3 * 2 * 8).map(|i| i as f32 * 0.37 - 5.0).collect();
        for (dtype, mode) in [
            (KvDtype::Int8, ScaleMode::PerRow),
            (KvDtype::Fp8E4M3, ScaleMode::PerTensor(0.5)),
            (KvDtype::F16, ScaleMode::PerRow),
        ] {
            let want = encode_rows(dtype, 8, &x, mode).unwrap();
            assert!(compare_codes(&want, &want, 2).is_ok());
            let mut got = want.clone();
            let wpr = dtype.words_per_row(8);
            got.words[3 * wpr] ^= 1; // token 1, head 1
            let err = compare_codes(&got, &want, 2).unwrap_err().to_string();
            assert!(
                err.contains("1 of 6 rows") && err.contains("token 1 head 1"),
                "{err}"
            );
            if !want.scales.is_empty() {
                let mut got = want.clone();
                got.scales[4] = got.scales[4].wrapping_add(1); // token 2, head 0
                let err = compare_codes(&got, &want, 2).unwrap_err().to_string();
                assert!(err.contains("token 2 head 0"), "{err}");
            }
            let mut short = want.clone();
            short.words.pop();
            assert!(matches!(
                compare_codes(&short, &want, 2),
                Err(Error::Gpu(_))
            ));
        }
    }
}
