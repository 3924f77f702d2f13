//! `kvattn run <op>`: one kernel on tensors from a safetensors case file (DESIGN.md section 9).
//!
//! - `attention`: K/V written into a paged cache (physical blocks in shuffled order), then
//!   attention over it; writes `out` and `lse`.
//! - `quantize`: the CPU codec's codes and scales of `x` in a KV storage format, and the GPU
//!   decoder's values; writes `codes`, `scales`, `mins` (int4) and `dequant`.
//!
//! Everything that can be checked on the host is checked before the GPU is touched; nothing is
//! written on error.

use std::collections::HashMap;
use std::path::PathBuf;

use kvattn::attention::paged::{paged_attention_host, PagedAttentionArgs, PagedQuery};
use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::gpu::Context;
use kvattn::quant::dequant::dequantize;
use kvattn::quant::pack::words_to_le_bytes;
use kvattn::quant::{encode_rows, Int4Params, KvDtype, ScaleMode, INT4_GROUP};
use kvattn::reference::AttentionOutput;
use kvattn::shader::Precision;
use kvattn::{Error, Result};

use crate::case::{invalid, read_file, write_atomic, AttentionCase, CaseFile, OutTensor};

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
}

/// Arguments of `kvattn run attention`.
#[derive(clap::Args)]
pub struct AttentionArgs {
    /// Case file (safetensors): q, k, v, cu_seqlens_q, cu_seqlens_k; optional sinks,
    /// alibi_slopes; metadata causal, scale, sliding_window, softcap.
    #[arg(long = "in", value_name = "CASE")]
    input: PathBuf,
    /// Result file (safetensors): out [total_q, Hq, d_v] and lse [total_q, Hq].
    #[arg(long, value_name = "RESULT")]
    out: PathBuf,
    /// Storage format of K and V: f32 (default), f16, bf16.
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

/// Checks a block size: a power of two from 1 to 256.
pub fn check_block_size(block_size: usize) -> Result<()> {
    if block_size.is_power_of_two() && block_size <= 256 {
        Ok(())
    } else {
        Err(invalid(format!(
            "block size {block_size} is not a power of two from 1 to 256"
        )))
    }
}

/// The storage formats the paged attention kernels read today.
pub const PAGED_DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

/// How to lay a problem out in the paged cache and which kernel variant to run.
#[derive(Debug, Clone, Copy)]
pub struct PagedSetup {
    /// Storage format of K.
    pub k_dtype: KvDtype,
    /// Storage format of V.
    pub v_dtype: KvDtype,
    /// Tokens per block.
    pub block_size: usize,
    /// Kernel precision.
    pub precision: Precision,
    /// Seed of the free-block shuffle.
    pub seed: u64,
}

/// Checks the flags alone: the block size and storage formats the paged kernels read.
pub fn check_setup(setup: &PagedSetup) -> Result<()> {
    check_block_size(setup.block_size)?;
    for (name, dtype) in [("K", setup.k_dtype), ("V", setup.v_dtype)] {
        if !PAGED_DTYPES.contains(&dtype) {
            return Err(invalid(format!(
                "{name} storage {dtype} is not supported by the paged attention kernels yet \
                 (quantized attention comes later); use f32, f16 or bf16"
            )));
        }
    }
    Ok(())
}

/// Host checks of a paged attention problem: the batch itself ([`RaggedBatch::validate`]),
/// head dims for the storage formats, formats the kernels read, the block size, and
/// `len_q <= len_k` (the queries of a sequence are its last `len_q` cached tokens).
pub fn check_paged(
    batch: &RaggedBatch,
    shape: &AttentionShape,
    options: &AttentionOptions,
    setup: &PagedSetup,
) -> Result<()> {
    check_setup(setup)?;
    setup.k_dtype.check_head_dim(shape.head_dim_qk)?;
    setup.v_dtype.check_head_dim(shape.head_dim_v)?;
    batch.validate(shape, options)?;
    for seq in 0..batch.num_seqs() {
        let (len_q, len_k) = batch.seq_lens(seq);
        if len_q > len_k {
            return Err(invalid(format!(
                "sequence {seq} has len_q {len_q} > len_k {len_k}; the paged kernels take a \
                 sequence's queries as its last len_q cached tokens"
            )));
        }
    }
    Ok(())
}

/// Writes the batch's K/V into a new paged cache (one layer, prefix caching off, free blocks
/// shuffled so physical blocks come in scattered order) and runs [`paged_attention_host`] with
/// every sequence's `len_q` queries. Call [`check_paged`] first.
pub fn run_paged(
    ctx: &Context,
    batch: &RaggedBatch,
    shape: &AttentionShape,
    options: &AttentionOptions,
    setup: &PagedSetup,
) -> Result<AttentionOutput> {
    if setup.precision == Precision::F16 && !ctx.caps().shader_f16 {
        return Err(Error::MissingFeature("shader-f16"));
    }
    let config = PagedKvConfig {
        layers: 1,
        num_kv_heads: shape.num_kv_heads,
        head_dim_k: shape.head_dim_qk,
        head_dim_v: shape.head_dim_v,
        k_dtype: setup.k_dtype,
        v_dtype: setup.v_dtype,
        k_scales: kvattn::cache::scales::CacheScales::PerRow,
        v_scales: kvattn::cache::scales::CacheScales::PerRow,
        block_size: setup.block_size,
        prefix_caching: false,
        model_id: String::new(),
    };
    let needed: usize = (0..batch.num_seqs())
        .map(|s| batch.seq_lens(s).1.div_ceil(setup.block_size))
        .sum();
    // Spare blocks, so the shuffled blocks come from a pool larger than the batch.
    let blocks = needed + needed / 2 + 1;
    let mut cache = PagedKvCache::new(ctx, config, PoolSize::Blocks(blocks))?;
    cache.shuffle_free_blocks(setup.seed);
    let (hkv, dk, dv) = (shape.num_kv_heads, shape.head_dim_qk, shape.head_dim_v);
    let mut queries = Vec::with_capacity(batch.num_seqs());
    for s in 0..batch.num_seqs() {
        let (q_rows, k_rows) = batch.token_ranges(s);
        let seq = s as u64;
        cache.add_sequence(seq, &[])?;
        let tokens: Vec<u32> = (0..k_rows.len() as u32).collect();
        let k = batch.k[k_rows.start * hkv * dk..k_rows.end * hkv * dk].to_vec();
        let v = batch.v[k_rows.start * hkv * dv..k_rows.end * hkv * dv].to_vec();
        cache.append_host(ctx, seq, &tokens, &[k], &[v])?;
        queries.push(PagedQuery {
            seq,
            len_q: q_rows.len(),
        });
    }
    let args = PagedAttentionArgs {
        layer: 0,
        batch: &queries,
        shape: *shape,
        options,
        precision: setup.precision,
    };
    paged_attention_host(ctx, &cache, &args, batch.q)
}

/// The storage format of `--kv-dtype`-style flags, f32 when none is given.
fn dtype_flag(specific: &Option<String>, both: &Option<String>) -> Result<KvDtype> {
    specific
        .as_deref()
        .or(both.as_deref())
        .map_or(Ok(KvDtype::F32), str::parse)
}

/// Metadata every result carries: the adapter and backend.
fn adapter_meta(ctx: &Context) -> HashMap<String, String> {
    HashMap::from([
        ("adapter".to_string(), ctx.adapter().name.clone()),
        ("backend".to_string(), ctx.adapter().backend.clone()),
    ])
}

/// `kvattn run attention`.
fn attention(args: &AttentionArgs) -> Result<()> {
    let setup = PagedSetup {
        k_dtype: dtype_flag(&args.k_dtype, &args.kv_dtype)?,
        v_dtype: dtype_flag(&args.v_dtype, &args.kv_dtype)?,
        block_size: args.block_size,
        precision: parse_precision(&args.precision)?,
        seed: SHUFFLE_SEED,
    };
    check_setup(&setup)?;
    let bytes = read_file(&args.input)?;
    let file = CaseFile::parse(&bytes, &args.input)?;
    let case = AttentionCase::from_file(&file)?;
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
    write_atomic(
        &args.out,
        &[
            OutTensor::f32("out", vec![total_q, hq, dv], &result.out),
            OutTensor::f32("lse", vec![total_q, hq], &result.lse),
        ],
        meta,
    )
}

/// `kvattn run quantize`.
fn quantize(args: &QuantizeArgs) -> Result<()> {
    let dtype: KvDtype = args.kv_dtype.parse()?;
    let bytes = read_file(&args.input)?;
    let file = CaseFile::parse(&bytes, &args.input)?;
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
    let rows = encode_rows(dtype, d, &x.data, mode)?;
    quantize_out(args, &rows, [n, h, d])
}

/// Dequantizes `rows` on the GPU and writes the result file of `run quantize`.
fn quantize_out(
    args: &QuantizeArgs,
    rows: &kvattn::quant::EncodedRows,
    [n, h, d]: [usize; 3],
) -> Result<()> {
    let dtype = rows.dtype;
    let ctx = Context::new()?;
    let dequant = dequantize(&ctx, rows)?;
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
    let mut meta = adapter_meta(&ctx);
    meta.insert("kv_dtype".into(), dtype.name().into());
    if let ScaleMode::PerTensor(s) = rows.scale_mode {
        meta.insert("scale".into(), s.to_string());
    }
    write_atomic(&args.out, &tensors, meta)
}
