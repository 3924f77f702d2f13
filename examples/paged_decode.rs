//! Paged decode throughput beside the adapter's copy bandwidth, measured in the same run.
//!
//! `cargo run --release --example paged_decode [-- --seqs 4 --contexts 4096,16384]`
//!
//! GQA 32/8, head dim 128, f16 KV, block size 16. The decode kernel reads every K and V row
//! of the batch once per group tile (the whole group of 4 query heads fits one tile), so its
//! effective bandwidth is KV bytes / time. The copy ceiling is the best of a buffer-to-buffer
//! copy and the `copy_blocks` kernel over 256 MiB. Times are wall clock around a queue wait, the
//! best of several runs.

use std::time::Instant;

use kvattn::attention::paged::{PagedAttentionArgs, PagedAttentionPlan, PagedQuery};
use kvattn::attention::{AttentionOptions, AttentionShape};
use kvattn::cache::append_kv::{append_kv, SourceDtype};
use kvattn::cache::copy_blocks::copy_blocks;
use kvattn::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::pool::{BlockPool, PoolLayout};
use kvattn::gpu::Context;
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;

fn best_of(runs: usize, ctx: &Context, mut f: impl FnMut()) -> f64 {
    f();
    ctx.wait().unwrap();
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            ctx.wait().unwrap();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Best copy bandwidth (bytes read + written per second) over `bytes`.
fn copy_bandwidth(ctx: &Context, bytes: u64) -> (f64, f64) {
    let a = ctx.filled("copy a", (bytes / 4) as usize, 1u32).unwrap();
    let b = ctx.filled("copy b", (bytes / 4) as usize, 0u32).unwrap();
    let dma = best_of(5, ctx, || {
        let mut e = ctx.device.create_command_encoder(&Default::default());
        e.copy_buffer_to_buffer(&a, 0, &b, 0, bytes);
        ctx.queue.submit([e.finish()]);
    });
    // The copy kernel: blocks of 1 MiB inside one pool buffer, first half to second half.
    let layout = PoolLayout {
        num_kv_heads: 1,
        head_dim: 1024,
        dtype: KvDtype::F32,
        block_size: 256,
        scale: kvattn::quant::ScaleMode::PerRow,
    };
    let blocks = (bytes / layout.block_bytes()) as usize;
    let pool = BlockPool::with_blocks_per_buffer(ctx, layout, blocks, blocks, "copy pool").unwrap();
    let pairs: Vec<(u32, u32)> = (0..blocks as u32 / 2)
        .map(|i| (i, i + blocks as u32 / 2))
        .collect();
    let kernel = best_of(5, ctx, || copy_blocks(ctx, &pool, &pairs).unwrap());
    let moved = |secs: f64, n: u64| 2.0 * n as f64 / secs;
    (moved(dma, bytes), moved(kernel, bytes / 2))
}

fn main() -> kvattn::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str, default: &str| -> String {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| default.into())
    };
    let seqs: usize = value("--seqs", "4").parse().expect("--seqs N");
    let contexts: Vec<usize> = value("--contexts", "4096,16384")
        .split(',')
        .map(|c| c.parse().expect("--contexts A,B"))
        .collect();

    let ctx = Context::new()?;
    println!(
        "adapter: {} ({}, {})",
        ctx.adapter().name,
        ctx.adapter().backend,
        ctx.adapter().device_type
    );
    let copy_bytes =
        (256u64 << 20).min(ctx.caps().max_storage_buffer_binding_size / (1 << 20) * (1 << 20));
    let (dma, kernel) = copy_bandwidth(&ctx, copy_bytes);
    let ceiling = dma.max(kernel);
    println!(
        "copy over {} MiB: buffer copy {:.2} GB/s, copy kernel {:.2} GB/s",
        copy_bytes >> 20,
        dma / 1e9,
        kernel / 1e9
    );

    let shape = AttentionShape {
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim_qk: 128,
        head_dim_v: 128,
    };
    println!("decode GQA 32/8 hd128 f16 KV, block 16, {seqs} sequences:");
    println!(
        "{:>8} {:>9} {:>12} {:>10} {:>10} {:>9}",
        "context", "precision", "KV MiB", "time ms", "GB/s", "of copy"
    );
    for &len in &contexts {
        let config = PagedKvConfig {
            prefix_caching: false,
            ..PagedKvConfig::new(1, 8, 128, KvDtype::F16)
        };
        let blocks = seqs * len.div_ceil(16);
        let mut cache = PagedKvCache::new(&ctx, config, PoolSize::Blocks(blocks))?;
        // Fill every sequence with one GPU-side append per chunk (values do not matter here).
        let chunk = 2048.min(len);
        let src = ctx.filled("src", chunk * 8 * 128, 0.01f32)?;
        for s in 0..seqs as u64 {
            cache.add_sequence(s, &[])?;
            let mut done = 0;
            while done < len {
                let n = chunk.min(len - done);
                let mut batch = AppendBatch::new();
                cache.append_tokens(&ctx, &mut batch, s, &vec![0; n])?;
                let pools = cache.layer(0)?;
                append_kv(&ctx, &pools.k, &src, SourceDtype::F32, batch.slots())?;
                append_kv(&ctx, &pools.v, &src, SourceDtype::F32, batch.slots())?;
                done += n;
            }
        }
        let queries: Vec<PagedQuery> = (0..seqs as u64)
            .map(|seq| PagedQuery { seq, len_q: 1 })
            .collect();
        let opts = AttentionOptions::default();
        let kv_bytes = (2 * seqs * len * 8 * 128 * 2) as f64;
        let mut precisions = vec![Precision::F32];
        if ctx.caps().shader_f16 {
            precisions.push(Precision::F16);
        }
        for precision in precisions {
            let args = PagedAttentionArgs {
                layer: 0,
                batch: &queries,
                shape,
                options: &opts,
                precision,
            };
            let plan = PagedAttentionPlan::new(&ctx, &cache, &args)?;
            let q = ctx.filled("q", seqs * 32 * 128, 0.02f32)?;
            let out = ctx.filled("out", seqs * 32 * 128, 0.0f32)?;
            let lse = ctx.filled("lse", seqs * 32, 0.0f32)?;
            let secs = best_of(5, &ctx, || {
                plan.run(&ctx, &cache, 0, &q, &out, &lse).unwrap()
            });
            let bw = kv_bytes / secs;
            println!(
                "{len:>8} {:>9} {:>12.1} {:>10.2} {:>10.2} {:>8.1}%",
                precision.name(),
                kv_bytes / f64::from(1 << 20),
                secs * 1e3,
                bw / 1e9,
                100.0 * bw / ceiling
            );
        }
    }
    Ok(())
}
