//! MLA decode with DeepSeek-V2 shapes: the absorbed path against the up-projection path at a
//! given context, measured in the same run, and their agreement with each other and with the
//! CPU reference.
//!
//! `cargo run --release --example mla_decode [-- --context 4096 --seqs 1 --kv-dtype f16
//!  --precision f32 --rounds 3 --no-check --json]`
//!
//! One layer: 128 heads, nope 128, RoPE 64, rank 512, v 128. Each sequence holds `--context`
//! cached tokens and decodes one query token. A step of the absorbed path is query absorption
//! (`H * d_nope * rank` multiply-adds per token), attention over the latent rows (per head and
//! key: `rank + d_rope` for the score, `rank` for the output) and the output up-projection
//! (`H * rank * d_v`); a step of the up-projection path expands every cached latent row to
//! per-head K and V (`H * rank * (d_nope + d_v)` per key) and runs attention with head dims 192
//! and 128, walking the context in chunks that fit one storage binding. Times are wall clock
//! around a queue wait, the paths timed in turn over several rounds, each keeping its best.
//! `--json` prints the results as one object (`examples/common`: NaN and infinities are `null`
//! beside a `<field>_non_finite` field).

use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, ValueEnum};

use kvattn::attention::paged::PagedQuery;
use kvattn::cache::paged::PoolSize;
use kvattn::gpu::Context;
use kvattn::mla::{MlaArgs, MlaCache, MlaCacheConfig, MlaIo, MlaPath, MlaPlan, MlaWeights};
use kvattn::quant::KvDtype;
use kvattn::reference::mla::{mla, MlaBatch, MlaShape};
use kvattn::shader::Precision;

mod common;
use common::Object;

/// A small deterministic generator (xorshift) of standard normals.
struct Rng(u64);

impl Rng {
    fn normal(&mut self) -> f32 {
        let mut u = || {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let (a, b) = (u(), u());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    }

    fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// MLA decode with DeepSeek-V2 shapes: the absorbed path against the up-projection path.
///
/// One layer (128 heads, nope 128, RoPE 64, rank 512, v 128); each sequence holds --context
/// cached tokens and decodes one query token on each path. Prints the best time of each path
/// over --rounds, their agreement with each other and (unless --no-check) with the CPU
/// reference.
#[derive(Debug, Parser)]
#[command(name = "mla_decode")]
struct Args {
    /// Cached tokens per sequence
    #[arg(long, value_name = "N", default_value = "4096")]
    context: NonZeroUsize,
    /// Sequences decoding together
    #[arg(long, value_name = "N", default_value = "1")]
    seqs: NonZeroUsize,
    /// Storage format of the latent rows: f32, f16, bf16, fp8-e4m3, fp8-e5m2, int8, int4
    #[arg(long, value_name = "D", default_value_t = KvDtype::F16)]
    kv_dtype: KvDtype,
    /// Kernel precision (f16 needs SHADER_F16)
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32)]
    precision: PrecisionArg,
    /// Timed rounds after the warm-up; each path keeps its best (0 counts as 1)
    #[arg(long, value_name = "N", default_value_t = 3)]
    rounds: usize,
    /// Skip the comparison with the CPU reference
    #[arg(long)]
    no_check: bool,
    /// Print the results as one JSON object
    #[arg(long)]
    json: bool,
}

/// `--precision`.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum PrecisionArg {
    F32,
    F16,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Precision {
        match p {
            PrecisionArg::F32 => Precision::F32,
            PrecisionArg::F16 => Precision::F16,
        }
    }
}

/// The largest of `x`; NaN if any is NaN (`f64::max` would skip it).
fn max_or_nan(x: impl IntoIterator<Item = f64>, floor: f64) -> f64 {
    x.into_iter().fold(floor, |m, v| {
        if m.is_nan() || v.is_nan() {
            f64::NAN
        } else {
            m.max(v)
        }
    })
}

/// Largest |x - y|, NaN if any difference is.
fn max_diff(x: &[f32], y: &[f32]) -> f64 {
    max_or_nan(x.iter().zip(y).map(|(p, q)| f64::from((p - q).abs())), 0.0)
}

/// The output scale: the largest |x|, at least 1.
fn scale(x: &[f32]) -> f64 {
    max_or_nan(x.iter().map(|v| f64::from(v.abs())), 1.0)
}

/// One path's error against a reference: max |out difference| / output scale, max |lse
/// difference|.
fn errors(got: &(Vec<f32>, Vec<f32>), out: &[f32], lse: &[f32]) -> (f64, f64) {
    (max_diff(&got.0, out) / scale(out), max_diff(&got.1, lse))
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mla_decode: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> kvattn::Result<()> {
    let (context, seqs) = (args.context.get(), args.seqs.get());
    let (latent, precision) = (args.kv_dtype, Precision::from(args.precision));
    let ctx = Context::new()?;
    let s = MlaShape::DEEPSEEK_V2;
    let h = s.num_heads;
    let adapter = format!("{} ({})", ctx.adapter().name, ctx.adapter().backend);
    if !args.json {
        println!(
            "adapter: {adapter}; DeepSeek-V2 MLA layer (128 heads, nope 128, RoPE 64, rank 512, v 128)"
        );
        println!(
            "{seqs} sequence(s) x {context} cached tokens, latent {latent}, kernel precision {}",
            precision.name()
        );
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let c_kv = rng.normals(seqs * context * s.rank, 1.0);
    let k_pe = rng.normals(seqs * context * s.d_rope, 1.0);
    let w_uk = rng.normals(h * s.d_nope * s.rank, 1.0 / (s.d_nope as f32).sqrt());
    let w_uv = rng.normals(h * s.rank * s.d_v, 1.0 / (s.rank as f32).sqrt());
    let q_nope = rng.normals(seqs * h * s.d_nope, 1.0);
    let q_pe = rng.normals(seqs * h * s.d_rope, 1.0);

    let config = MlaCacheConfig::new(1, s.rank, s.d_rope, latent);
    let blocks = seqs * context.div_ceil(config.block_size);
    let mut cache = MlaCache::new(&ctx, config, PoolSize::Blocks(blocks))?;
    let tokens: Vec<u32> = (0..context as u32).collect();
    let mut batch = Vec::new();
    for i in 0..seqs {
        cache.cache_mut().add_sequence(i as u64, &[])?;
        let c = c_kv[i * context * s.rank..(i + 1) * context * s.rank].to_vec();
        let p = k_pe[i * context * s.d_rope..(i + 1) * context * s.d_rope].to_vec();
        cache.append_host(&ctx, i as u64, &tokens, &[c], &[p])?;
        batch.push(PagedQuery {
            seq: i as u64,
            len_q: 1,
        });
    }
    let weights = MlaWeights::upload(&ctx, &s, &w_uk, &w_uv)?;
    let qn = ctx.upload("q_nope", &q_nope)?;
    let qp = ctx.upload("q_pe", &q_pe)?;
    let rows = seqs * h;
    let paths = [MlaPath::Absorbed, MlaPath::UpProj];
    let plans = paths
        .iter()
        .map(|&path| {
            MlaPlan::new(
                &ctx,
                &cache,
                &MlaArgs {
                    layer: 0,
                    batch: &batch,
                    shape: s,
                    scale: None,
                    precision,
                    path,
                    up_proj_chunk: None,
                },
            )
        })
        .collect::<kvattn::Result<Vec<_>>>()?;
    // Outputs start as NaN: a kernel that writes nothing shows as a NaN error, never as 0.
    let outs = paths
        .iter()
        .map(|_| {
            Ok((
                ctx.filled("out", rows * s.d_v, f32::NAN)?,
                ctx.filled("lse", rows, f32::NAN)?,
            ))
        })
        .collect::<kvattn::Result<Vec<_>>>()?;
    let step = |i: usize| -> kvattn::Result<f64> {
        let t = Instant::now();
        let io = MlaIo {
            q_nope: &qn,
            q_pe: &qp,
            out: &outs[i].0,
            lse: &outs[i].1,
        };
        plans[i].run(&ctx, &cache, 0, &weights, &io)?;
        ctx.wait()?;
        Ok(t.elapsed().as_secs_f64())
    };
    // Warm-up (pipelines), then rounds in turn.
    for i in 0..paths.len() {
        step(i)?;
    }
    let mut best = [f64::INFINITY; 2];
    for _ in 0..args.rounds.max(1) {
        for (i, b) in best.iter_mut().enumerate() {
            *b = b.min(step(i)?);
        }
    }
    let n = context as f64;
    let hf = h as f64;
    let (rank, dr, dn, dv) = (
        s.rank as f64,
        s.d_rope as f64,
        s.d_nope as f64,
        s.d_v as f64,
    );
    let per_seq_flops = [
        2.0 * hf * (dn * rank + n * (rank + dr) + n * rank + rank * dv),
        2.0 * hf * (n * rank * (dn + dv) + n * (dn + dr) + n * dv),
    ];
    let flops = per_seq_flops.map(|f| f * seqs as f64);

    let read = |i: usize| -> kvattn::Result<(Vec<f32>, Vec<f32>)> {
        Ok((
            ctx.read_back(&outs[i].0, rows * s.d_v)?,
            ctx.read_back(&outs[i].1, rows)?,
        ))
    };
    let got = [read(0)?, read(1)?];
    let between = errors(&got[1], &got[0].0, &got[0].1); // relative to the absorbed output
    let reference = if args.no_check {
        None
    } else {
        // The CPU reference on the latent as stored.
        let mut c_st = Vec::new();
        let mut p_st = Vec::new();
        for i in 0..seqs {
            let (c, p) = cache.cache().read_rows(&ctx, i as u64, 0)?;
            c_st.extend(kvattn::quant::decode_rows(&c)?);
            p_st.extend(kvattn::quant::decode_rows(&p)?);
        }
        let cu_q: Vec<u32> = (0..=seqs as u32).collect();
        let cu_k: Vec<u32> = (0..=seqs).map(|i| (i * context) as u32).collect();
        let want = mla(
            &MlaBatch {
                q_nope: &q_nope,
                q_pe: &q_pe,
                c_kv: &c_st,
                k_pe: &p_st,
                w_uk: &w_uk,
                w_uv: &w_uv,
                cu_seqlens_q: &cu_q,
                cu_seqlens_k: &cu_k,
            },
            &s,
            None,
        )?;
        Some(got.each_ref().map(|g| errors(g, &want.out, &want.lse)))
    };

    if args.json {
        let path_rows: Vec<Object> = paths
            .iter()
            .enumerate()
            .map(|(i, path)| {
                let row = Object::new()
                    .set("path", path.name())
                    .set("seconds", best[i])
                    .set("flops", flops[i])
                    .set("flops_per_second", flops[i] / best[i]);
                match &reference {
                    Some(r) => row
                        .set("reference_out_error", r[i].0)
                        .set("reference_lse_error", r[i].1),
                    None => row,
                }
            })
            .collect();
        common::print(
            Object::new()
                .set("adapter", adapter)
                .set("context", context)
                .set("seqs", seqs)
                .set("kv_dtype", latent.name())
                .set("precision", precision.name())
                .set("rounds", args.rounds.max(1))
                .set("paths", path_rows)
                .set("up_proj_over_absorbed_time", best[1] / best[0])
                .set("up_proj_over_absorbed_flops", flops[1] / flops[0])
                .set("between_paths_out_error", between.0)
                .set("between_paths_lse_error", between.1),
        );
        return Ok(());
    }
    println!("\n| path | ms per decode step | GFLOP per step | GFLOP/s |");
    println!("|---|---:|---:|---:|");
    for (i, path) in paths.iter().enumerate() {
        println!(
            "| {} | {:.1} | {:.2} | {:.1} |",
            path.name(),
            best[i] * 1e3,
            flops[i] / 1e9,
            flops[i] / best[i] / 1e9
        );
    }
    println!(
        "\nup-proj / absorbed time: {:.1}x (FLOP ratio {:.1}x)",
        best[1] / best[0],
        flops[1] / flops[0]
    );
    println!(
        "absorbed vs up-proj: max |out difference| / output scale {:.2e}, max |lse difference| {:.2e}",
        between.0, between.1
    );
    for (i, (out, lse)) in reference.iter().flatten().enumerate() {
        println!(
            "{} vs CPU reference (f64): max |out error| / output scale {out:.2e}, max |lse error| {lse:.2e}",
            paths[i].name()
        );
    }
    Ok(())
}
