//! MLA decode with DeepSeek-V2 shapes: the absorbed path against the up-projection path at a
//! given context, measured in the same run, and their agreement with each other and with the
//! CPU reference.
//!
//! `cargo run --release --example mla_decode [-- --context 4096 --seqs 1 --kv-dtype f16
//!  --precision f32 --rounds 3]`
//!
//! One layer: 128 heads, nope 128, RoPE 64, rank 512, v 128. Each sequence holds `--context`
//! cached tokens and decodes one query token. A step of the absorbed path is query absorption
//! (`H * d_nope * rank` multiply-adds per token), attention over the latent rows (per head and
//! key: `rank + d_rope` for the score, `rank` for the output) and the output up-projection
//! (`H * rank * d_v`); a step of the up-projection path expands every cached latent row to
//! per-head K and V (`H * rank * (d_nope + d_v)` per key) and runs attention with head dims 192
//! and 128, walking the context in chunks that fit one storage binding. Times are wall clock
//! around a queue wait, the paths timed in turn over several rounds, each keeping its best.

use std::time::Instant;

use kvattn::attention::paged::PagedQuery;
use kvattn::cache::paged::PoolSize;
use kvattn::gpu::Context;
use kvattn::mla::{MlaArgs, MlaCache, MlaCacheConfig, MlaIo, MlaPath, MlaPlan, MlaWeights};
use kvattn::quant::KvDtype;
use kvattn::reference::mla::{mla, MlaBatch, MlaShape};
use kvattn::shader::Precision;

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

struct Opts {
    context: usize,
    seqs: usize,
    latent: KvDtype,
    precision: Precision,
    rounds: usize,
    check: bool,
}

fn parse() -> kvattn::Result<Opts> {
    let mut o = Opts {
        context: 4096,
        seqs: 1,
        latent: KvDtype::F16,
        precision: Precision::F32,
        rounds: 3,
        check: true,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bad = |m: String| kvattn::Error::InvalidArgument(m);
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "--no-check" {
            o.check = false;
            i += 1;
            continue;
        }
        let value = args
            .get(i + 1)
            .ok_or_else(|| bad(format!("{flag} needs a value")))?;
        let num = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| bad(format!("{flag}: {v:?} is not a count")))
        };
        match flag {
            "--context" => o.context = num(value)?,
            "--seqs" => o.seqs = num(value)?,
            "--rounds" => o.rounds = num(value)?.max(1),
            "--kv-dtype" => o.latent = value.parse()?,
            "--precision" => {
                o.precision = match value.as_str() {
                    "f32" => Precision::F32,
                    "f16" => Precision::F16,
                    _ => return Err(bad(format!("unknown precision {value:?}"))),
                }
            }
            _ => return Err(bad(format!("unknown flag {flag}"))),
        }
        i += 2;
    }
    if o.context == 0 || o.seqs == 0 {
        return Err(bad("--context and --seqs must be positive".into()));
    }
    Ok(o)
}

fn main() -> kvattn::Result<()> {
    let o = parse()?;
    let ctx = Context::new()?;
    let s = MlaShape::DEEPSEEK_V2;
    let h = s.num_heads;
    println!(
        "adapter: {} ({}); DeepSeek-V2 MLA layer (128 heads, nope 128, RoPE 64, rank 512, v 128)",
        ctx.adapter().name,
        ctx.adapter().backend
    );
    println!(
        "{} sequence(s) x {} cached tokens, latent {}, kernel precision {}",
        o.seqs,
        o.context,
        o.latent,
        o.precision.name()
    );
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let c_kv = rng.normals(o.seqs * o.context * s.rank, 1.0);
    let k_pe = rng.normals(o.seqs * o.context * s.d_rope, 1.0);
    let w_uk = rng.normals(h * s.d_nope * s.rank, 1.0 / (s.d_nope as f32).sqrt());
    let w_uv = rng.normals(h * s.rank * s.d_v, 1.0 / (s.rank as f32).sqrt());
    let q_nope = rng.normals(o.seqs * h * s.d_nope, 1.0);
    let q_pe = rng.normals(o.seqs * h * s.d_rope, 1.0);

    let config = MlaCacheConfig::new(1, s.rank, s.d_rope, o.latent);
    let blocks = o.seqs * o.context.div_ceil(config.block_size);
    let mut cache = MlaCache::new(&ctx, config, PoolSize::Blocks(blocks))?;
    let tokens: Vec<u32> = (0..o.context as u32).collect();
    let mut batch = Vec::new();
    for i in 0..o.seqs {
        cache.cache_mut().add_sequence(i as u64, &[])?;
        let c = c_kv[i * o.context * s.rank..(i + 1) * o.context * s.rank].to_vec();
        let p = k_pe[i * o.context * s.d_rope..(i + 1) * o.context * s.d_rope].to_vec();
        cache.append_host(&ctx, i as u64, &tokens, &[c], &[p])?;
        batch.push(PagedQuery {
            seq: i as u64,
            len_q: 1,
        });
    }
    let weights = MlaWeights::upload(&ctx, &s, &w_uk, &w_uv)?;
    let qn = ctx.upload("q_nope", &q_nope)?;
    let qp = ctx.upload("q_pe", &q_pe)?;
    let rows = o.seqs * h;
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
                    precision: o.precision,
                    path,
                    up_proj_chunk: None,
                },
            )
        })
        .collect::<kvattn::Result<Vec<_>>>()?;
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
    for _ in 0..o.rounds {
        for (i, b) in best.iter_mut().enumerate() {
            *b = b.min(step(i)?);
        }
    }
    let n = o.context as f64;
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
    println!("\n| path | ms per decode step | GFLOP per step | GFLOP/s |");
    println!("|---|---:|---:|---:|");
    for (i, path) in paths.iter().enumerate() {
        let flops = per_seq_flops[i] * o.seqs as f64;
        println!(
            "| {} | {:.1} | {:.2} | {:.1} |",
            path.name(),
            best[i] * 1e3,
            flops / 1e9,
            flops / best[i] / 1e9
        );
    }
    println!(
        "\nup-proj / absorbed time: {:.1}x (FLOP ratio {:.1}x)",
        best[1] / best[0],
        per_seq_flops[1] / per_seq_flops[0]
    );

    let read = |i: usize| -> kvattn::Result<(Vec<f32>, Vec<f32>)> {
        Ok((
            ctx.read_back(&outs[i].0, rows * s.d_v)?,
            ctx.read_back(&outs[i].1, rows)?,
        ))
    };
    let (a, b) = (read(0)?, read(1)?);
    let max_diff = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(p, q)| f64::from((p - q).abs()))
            .fold(0.0, f64::max)
    };
    let scale = |x: &[f32]| x.iter().map(|v| f64::from(v.abs())).fold(1.0, f64::max);
    println!(
        "absorbed vs up-proj: max |out difference| / output scale {:.2e}, max |lse difference| {:.2e}",
        max_diff(&a.0, &b.0) / scale(&a.0),
        max_diff(&a.1, &b.1)
    );
    if o.check {
        // The CPU reference on the latent as stored.
        let mut c_st = Vec::new();
        let mut p_st = Vec::new();
        for i in 0..o.seqs {
            let (c, p) = cache.cache().read_rows(&ctx, i as u64, 0)?;
            c_st.extend(kvattn::quant::decode_rows(&c)?);
            p_st.extend(kvattn::quant::decode_rows(&p)?);
        }
        let cu_q: Vec<u32> = (0..=o.seqs as u32).collect();
        let cu_k: Vec<u32> = (0..=o.seqs).map(|i| (i * o.context) as u32).collect();
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
        for (i, got) in [&a, &b].iter().enumerate() {
            println!(
                "{} vs CPU reference (f64): max |out error| / output scale {:.2e}, max |lse error| {:.2e}",
                paths[i].name(),
                max_diff(&got.0, &want.out) / scale(&want.out),
                max_diff(&got.1, &want.lse)
            );
        }
    }
    Ok(())
}
