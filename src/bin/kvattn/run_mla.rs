//! `kvattn run mla`: Multi-head Latent Attention on a safetensors case file (ARCHITECTURE.md
//! section 12). The latent rows and RoPE keys are written into a latent paged cache (the latent
//! in `--kv-dtype`, quantized on write by the GPU encoder; physical blocks in shuffled order),
//! then the absorbed or the up-projection path runs over it; writes `out` and `lse`.

use std::path::PathBuf;

use kvattn::attention::paged::PagedQuery;
use kvattn::cache::paged::PoolSize;
use kvattn::cache::scales::CacheScales;
use kvattn::gpu::Context;
use kvattn::mla::{mla_host, MlaArgs, MlaCache, MlaCacheConfig, MlaPath, MlaWeights};
use kvattn::quant::{KvDtype, ScaleMode};
use kvattn::reference::mla::{MlaBatch, MlaShape};
use kvattn::Result;

use crate::case::{invalid, read_file, write_atomic, CaseFile, OutTensor};
use crate::files::check_outputs;
use crate::run::{adapter_meta, check_block_size, parse_precision};

/// Seed of the free-block shuffle (fixed, so runs are reproducible).
const SHUFFLE_SEED: u64 = 0x6d6c_6131;

/// Arguments of `kvattn run mla`.
#[derive(clap::Args)]
pub struct MlaRunArgs {
    /// Case file (safetensors): q_nope [total_q, H, d_nope], q_pe [total_q, H, d_rope] (rotated),
    /// c_kv [total_k, rank], k_pe [total_k, d_rope] (rotated), w_uk [H, d_nope, rank],
    /// w_uv [H, rank, d_v], cu_seqlens_q, cu_seqlens_k; metadata scale (default
    /// 1/sqrt(d_nope + d_rope)) and latent_scale (a static per-tensor FP8 scale of the latent;
    /// absent: a scale per token row).
    #[arg(long = "in", value_name = "CASE")]
    input: PathBuf,
    /// Result file (safetensors): out [total_q, H, d_v] and lse [total_q, H].
    #[arg(long, value_name = "RESULT")]
    out: PathBuf,
    /// absorbed (attention over the latent; the decode path) or up-proj (per-head K and V
    /// expanded from the latent, then ordinary attention).
    #[arg(long, value_name = "PATH", default_value = "absorbed")]
    path: String,
    /// Storage format of the latent: f32 (default), f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4.
    /// The RoPE keys stay f32 with an f32 latent, bf16 with bf16, f16 otherwise.
    #[arg(long, value_name = "D", default_value = "f32")]
    kv_dtype: String,
    /// Tokens per cache block: a power of two from 1 to 256.
    #[arg(long, value_name = "N", default_value_t = 64)]
    block_size: usize,
    /// Attention kernel precision: f32 (portable) or f16 (needs shader-f16).
    #[arg(long, value_name = "P", default_value = "f32")]
    precision: String,
    /// Keys per chunk of the up-projection path (default: as many as one storage binding holds
    /// expanded).
    #[arg(long, value_name = "N")]
    up_proj_chunk: Option<usize>,
}

/// The tensors of an MLA case file.
const MLA_TENSORS: [&str; 8] = [
    "q_nope",
    "q_pe",
    "c_kv",
    "k_pe",
    "w_uk",
    "w_uv",
    "cu_seqlens_q",
    "cu_seqlens_k",
];

/// An MLA problem read from a case file.
struct MlaCase {
    shape: MlaShape,
    scale: Option<f32>,
    latent_scale: Option<f32>,
    q_nope: Vec<f32>,
    q_pe: Vec<f32>,
    c_kv: Vec<f32>,
    k_pe: Vec<f32>,
    w_uk: Vec<f32>,
    w_uv: Vec<f32>,
    cu_q: Vec<u32>,
    cu_k: Vec<u32>,
}

/// Fails unless `got` equals `want`, naming both tensors' dimensions.
fn same(what: &str, got: usize, want: usize, of: &str) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(invalid(format!("{what} is {got} but {of} is {want}")))
    }
}

impl MlaCase {
    /// Reads the tensors and metadata and checks that the dimensions agree with each other and
    /// with the offsets (the rest is [`MlaBatch::validate`]).
    fn from_file(f: &CaseFile) -> Result<Self> {
        f.check_names(&MLA_TENSORS, &["scale", "latent_scale"])?;
        let q_nope = f.f32("q_nope", 3, "[total_q, H, d_nope]")?;
        let q_pe = f.f32("q_pe", 3, "[total_q, H, d_rope]")?;
        let c_kv = f.f32("c_kv", 2, "[total_k, rank]")?;
        let k_pe = f.f32("k_pe", 2, "[total_k, d_rope]")?;
        let w_uk = f.f32("w_uk", 3, "[H, d_nope, rank]")?;
        let w_uv = f.f32("w_uv", 3, "[H, rank, d_v]")?;
        let cu_q = f.offsets("cu_seqlens_q")?;
        let cu_k = f.offsets("cu_seqlens_k")?;
        let (qn, qp, c, kp) = (&q_nope.shape, &q_pe.shape, &c_kv.shape, &k_pe.shape);
        let (uk, uv) = (&w_uk.shape, &w_uv.shape);
        same("q_pe's token rows", qp[0], qn[0], "q_nope's")?;
        same("q_pe's heads", qp[1], qn[1], "q_nope's")?;
        same("k_pe's token rows", kp[0], c[0], "c_kv's")?;
        same("k_pe's RoPE dims", kp[1], qp[2], "q_pe's")?;
        same("w_uk's heads", uk[0], qn[1], "q_nope's")?;
        same("w_uk's d_nope", uk[1], qn[2], "q_nope's")?;
        same("w_uk's rank", uk[2], c[1], "c_kv's")?;
        same("w_uv's heads", uv[0], qn[1], "q_nope's")?;
        same("w_uv's rank", uv[1], c[1], "c_kv's")?;
        for (name, cu, rows, tensor) in [
            ("cu_seqlens_q", &cu_q, qn[0], "q_nope"),
            ("cu_seqlens_k", &cu_k, c[0], "c_kv"),
        ] {
            if let Some(&last) = cu.last() {
                if last as usize != rows {
                    return Err(invalid(format!(
                        "{name} ends at {last} but {tensor} has {rows} token rows"
                    )));
                }
            }
        }
        let shape = MlaShape {
            num_heads: qn[1],
            d_nope: qn[2],
            d_rope: qp[2],
            rank: c[1],
            d_v: uv[2],
        };
        let case = Self {
            shape,
            scale: f.meta_parse("scale", "a number")?,
            latent_scale: f.meta_parse("latent_scale", "a number (a per-tensor FP8 scale)")?,
            q_nope: q_nope.data,
            q_pe: q_pe.data,
            c_kv: c_kv.data,
            k_pe: k_pe.data,
            w_uk: w_uk.data,
            w_uv: w_uv.data,
            cu_q,
            cu_k,
        };
        case.batch().validate(&case.shape)?;
        Ok(case)
    }

    fn batch(&self) -> MlaBatch<'_> {
        MlaBatch {
            q_nope: &self.q_nope,
            q_pe: &self.q_pe,
            c_kv: &self.c_kv,
            k_pe: &self.k_pe,
            w_uk: &self.w_uk,
            w_uv: &self.w_uv,
            cu_seqlens_q: &self.cu_q,
            cu_seqlens_k: &self.cu_k,
        }
    }
}

/// `kvattn run mla`.
pub fn run(args: &MlaRunArgs) -> Result<()> {
    let path: MlaPath = args.path.parse()?;
    let latent: KvDtype = args.kv_dtype.parse()?;
    let precision = parse_precision(&args.precision)?;
    check_block_size(args.block_size)?;
    if args.up_proj_chunk == Some(0) {
        return Err(invalid("--up-proj-chunk must be at least 1"));
    }
    check_outputs(&[("--out", &args.out)], &[("--in", &args.input)])?;
    let bytes = read_file(&args.input)?;
    let file = CaseFile::parse(&bytes, &args.input)?;
    let case = MlaCase::from_file(&file)?;
    let s = case.shape;
    if let Some(scale) = case.scale {
        if !scale.is_finite() {
            return Err(invalid(format!(
                "metadata scale is {scale}; it must be finite"
            )));
        }
    }
    let mut config = MlaCacheConfig::new(1, s.rank, s.d_rope, latent);
    config.block_size = args.block_size;
    config.prefix_caching = false;
    if let Some(x) = case.latent_scale {
        latent
            .check_scale_mode(ScaleMode::PerTensor(x))
            .map_err(|e| invalid(format!("metadata latent_scale: {e}")))?;
        config.latent_scales = CacheScales::PerTensor(vec![x]);
    }
    config.validate()?;

    let ctx = Context::new()?;
    if precision == kvattn::shader::Precision::F16 && !ctx.caps().shader_f16 {
        return Err(kvattn::Error::MissingFeature("shader-f16"));
    }
    let result = attend(&ctx, &case, config, |queries| MlaArgs {
        layer: 0,
        batch: queries,
        shape: s,
        scale: case.scale,
        precision,
        path,
        up_proj_chunk: args.up_proj_chunk,
    })?;
    let total_q = case.batch().total_q();
    let mut meta = adapter_meta(&ctx);
    meta.extend([
        ("path".to_string(), path.name().to_string()),
        ("precision".to_string(), precision.name().to_string()),
        ("kv_dtype".to_string(), latent.name().to_string()),
        ("block_size".to_string(), args.block_size.to_string()),
    ]);
    if let Some(x) = case.latent_scale {
        meta.insert("latent_scale".into(), x.to_string());
    }
    write_atomic(
        &args.out,
        &[
            OutTensor::f32("out", vec![total_q, s.num_heads, s.d_v], &result.out),
            OutTensor::f32("lse", vec![total_q, s.num_heads], &result.lse),
        ],
        meta,
    )
}

/// Writes every sequence's latent rows into a new cache of `config` (free blocks shuffled) and
/// runs MLA with the arguments `args` builds for the sequences' queries.
fn attend(
    ctx: &Context,
    case: &MlaCase,
    config: MlaCacheConfig,
    args: impl Fn(&[PagedQuery]) -> MlaArgs<'_>,
) -> Result<kvattn::reference::AttentionOutput> {
    let s = &case.shape;
    let bs = config.block_size;
    let lens: Vec<(usize, usize)> = case
        .cu_q
        .windows(2)
        .zip(case.cu_k.windows(2))
        .map(|(q, k)| ((q[1] - q[0]) as usize, (k[1] - k[0]) as usize))
        .collect();
    let needed: usize = lens.iter().map(|l| l.1.div_ceil(bs)).sum();
    let mut cache = MlaCache::new(ctx, config, PoolSize::Blocks(needed + needed / 2 + 1))?;
    cache.cache_mut().shuffle_free_blocks(SHUFFLE_SEED);
    let mut queries = Vec::with_capacity(lens.len());
    for (i, (&(len_q, len_k), k0)) in lens.iter().zip(&case.cu_k).enumerate() {
        let (k0, seq) = (*k0 as usize, i as u64);
        cache.cache_mut().add_sequence(seq, &[])?;
        let tokens: Vec<u32> = (0..len_k as u32).collect();
        let c = case.c_kv[k0 * s.rank..(k0 + len_k) * s.rank].to_vec();
        let p = case.k_pe[k0 * s.d_rope..(k0 + len_k) * s.d_rope].to_vec();
        cache.append_host(ctx, seq, &tokens, &[c], &[p])?;
        queries.push(PagedQuery { seq, len_q });
    }
    let weights = MlaWeights::upload(ctx, s, &case.w_uk, &case.w_uv)?;
    mla_host(
        ctx,
        &cache,
        &weights,
        &args(&queries),
        &case.q_nope,
        &case.q_pe,
    )
}
