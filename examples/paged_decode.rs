//! Paged decode throughput per KV format beside the adapter's copy bandwidth and f32 FMA rate,
//! measured in the same run.
//!
//! `cargo run --release --example paged_decode [-- --seqs 4 --contexts 4096,16384
//!  --kv-dtypes f16,fp8-e4m3,int8,int4 --precisions f32,f16 --copy-mib 256 --rounds 3]`
//!
//! GQA 32/8, head dim 128, block size 16, scales per token row. The decode kernel reads every K
//! and V row of the batch once per group tile (the whole group of 4 query heads fits one tile),
//! so its effective bandwidth is KV bytes (scales included) / time. The copy ceiling is the best
//! of a buffer-to-buffer copy and the `copy_blocks` kernel over 256 MiB; the arithmetic ceiling
//! is a kernel of independent f32 FMAs. The roofline time of a case is
//! `max(bytes / copy bandwidth, flops / FMA rate)` with the standard attention count of
//! `4 * query heads * head dim * context` FLOPs per query token. Times are wall clock around a
//! queue wait; the cases are timed in turn over several rounds and each keeps its best, so that
//! load on the machine hits them alike; each format's time is also given as a ratio to f16's.

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

/// Independent f32 FMA chains: FLOP/s (an FMA counts 2) of the best of a few runs.
fn fma_rate(ctx: &Context) -> f64 {
    const SRC: &str = r#"
@group(0) @binding(0) var<storage, read_write> out: array<vec4<f32>>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var a = vec4<f32>(f32(gid.x) * 1e-9, 0.5, 0.25, 0.125);
    var b = a + 0.1;
    var c = a + 0.2;
    var d = a + 0.3;
    let m = vec4<f32>(0.999);
    let k = vec4<f32>(1e-3);
    for (var i = 0u; i < 256u; i++) {
        a = fma(a, m, k);
        b = fma(b, m, k);
        c = fma(c, m, k);
        d = fma(d, m, k);
    }
    out[gid.x] = a + b + c + d;
}
"#;
    let module = ctx
        .device
        .create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("fma rate"),
            source: wgpu::ShaderSource::Wgsl(SRC.into()),
        });
    let pipeline = ctx
        .device
        .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("fma rate"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
    let groups = 4096u32;
    let out = ctx
        .filled("fma out", groups as usize * 64 * 4, 0.0f32)
        .unwrap();
    let bind = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 0,
            resource: out.as_entire_binding(),
        }],
    });
    let secs = best_of(3, ctx, || {
        let mut e = ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = e.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &bind, &[]);
            pass.dispatch_workgroups(groups, 1, 1);
        }
        ctx.queue.submit([e.finish()]);
    });
    // 4 chains x 4 lanes x 256 iterations x 2 FLOPs per invocation.
    (groups as f64 * 64.0 * 4.0 * 4.0 * 256.0 * 2.0) / secs
}

/// A one-layer cache of `dtype` (GQA 8 KV heads, head dim 128, block 16) holding `seqs`
/// sequences of `len` tokens, written by GPU appends of 2,048 tokens at a time.
fn filled_cache(
    ctx: &Context,
    dtype: KvDtype,
    seqs: usize,
    len: usize,
) -> kvattn::Result<PagedKvCache> {
    let config = PagedKvConfig {
        prefix_caching: false,
        ..PagedKvConfig::new(1, 8, 128, dtype)
    };
    let blocks = seqs * len.div_ceil(16);
    let mut cache = PagedKvCache::new(ctx, config, PoolSize::Blocks(blocks))?;
    let chunk = 2048.min(len);
    let values: Vec<f32> = (0..chunk * 8 * 128)
        .map(|i| ((i * 2654435761usize) % 1000) as f32 * 1e-3 - 0.5)
        .collect();
    let src = ctx.upload("src", &values)?;
    for s in 0..seqs as u64 {
        cache.add_sequence(s, &[])?;
        let mut done = 0;
        while done < len {
            let n = chunk.min(len - done);
            let mut batch = AppendBatch::new();
            cache.append_tokens(ctx, &mut batch, s, &vec![0; n])?;
            let pools = cache.layer(0)?;
            append_kv(ctx, &pools.k, &src, SourceDtype::F32, batch.slots())?;
            append_kv(ctx, &pools.v, &src, SourceDtype::F32, batch.slots())?;
            done += n;
        }
    }
    Ok(cache)
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
    let copy_mib: u64 = value("--copy-mib", "256").parse().expect("--copy-mib N");
    let copy_bytes =
        (copy_mib << 20).min(ctx.caps().max_storage_buffer_binding_size / (1 << 20) * (1 << 20));
    let (dma, kernel) = copy_bandwidth(&ctx, copy_bytes);
    let ceiling = dma.max(kernel);
    println!(
        "copy over {} MiB: buffer copy {:.2} GB/s, copy kernel {:.2} GB/s",
        copy_bytes >> 20,
        dma / 1e9,
        kernel / 1e9
    );

    let flops_peak = fma_rate(&ctx);
    println!("f32 FMA rate: {:.2} GFLOP/s", flops_peak / 1e9);
    let dtypes: Vec<KvDtype> = value("--kv-dtypes", "f16,fp8-e4m3,int8,int4")
        .split(',')
        .map(|d| d.parse())
        .collect::<kvattn::Result<_>>()?;
    let mut precisions = Vec::new();
    for p in value("--precisions", "f32,f16").split(',') {
        let p = match p {
            "f32" => Precision::F32,
            "f16" => Precision::F16,
            other => panic!("--precisions: unknown {other}"),
        };
        if p == Precision::F32 || ctx.caps().shader_f16 {
            precisions.push(p);
        }
    }

    let shape = AttentionShape {
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim_qk: 128,
        head_dim_v: 128,
    };
    println!("decode GQA 32/8 hd128, block 16, {seqs} sequences:");
    println!(
        "{:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>8}",
        "context",
        "kv",
        "math",
        "KV MiB",
        "time ms",
        "GB/s",
        "of copy",
        "GFLOP/s",
        "roofline",
        "vs f16"
    );
    let mut cases_caches: Vec<PagedKvCache> = Vec::new();
    let rounds: usize = value("--rounds", "3").parse().expect("--rounds N");
    for &len in &contexts {
        // Every format's cache first, then rounds that time each (format, precision) in turn,
        // keeping each case's best: load changes on the machine hit every case alike.
        let mut cases = Vec::new();
        for &dtype in &dtypes {
            let cache = filled_cache(&ctx, dtype, seqs, len)?;
            // Bytes the kernel must read: every K and V row of the batch with its scales.
            let row_bytes = |l: kvattn::cache::pool::PoolLayout| {
                4 * (l.words_per_row() + l.scale_words_per_row())
            };
            let c = cache.config();
            let kv_bytes =
                (seqs * len * 8 * (row_bytes(c.k_layout()) + row_bytes(c.v_layout()))) as f64;
            for &precision in &precisions {
                cases.push((dtype, precision, kv_bytes, f64::INFINITY));
            }
            cases_caches.push(cache);
        }
        let queries: Vec<PagedQuery> = (0..seqs as u64)
            .map(|seq| PagedQuery { seq, len_q: 1 })
            .collect();
        let opts = AttentionOptions::default();
        let q = ctx.filled("q", seqs * 32 * 128, 0.02f32)?;
        let out = ctx.filled("out", seqs * 32 * 128, 0.0f32)?;
        let lse = ctx.filled("lse", seqs * 32, 0.0f32)?;
        let mut plans = Vec::new();
        for (i, &(_, precision, _, _)) in cases.iter().enumerate() {
            let args = PagedAttentionArgs {
                layer: 0,
                batch: &queries,
                shape,
                options: &opts,
                precision,
            };
            let cache = &cases_caches[i / precisions.len()];
            plans.push(PagedAttentionPlan::new(&ctx, cache, &args)?);
        }
        for _ in 0..rounds {
            for (i, case) in cases.iter_mut().enumerate() {
                let cache = &cases_caches[i / precisions.len()];
                let secs = best_of(2, &ctx, || {
                    plans[i].run(&ctx, cache, 0, &q, &out, &lse).unwrap()
                });
                case.3 = case.3.min(secs);
            }
        }
        let flops = (4 * 32 * 128 * len * seqs) as f64;
        for &(dtype, precision, kv_bytes, secs) in &cases {
            let f16 = cases
                .iter()
                .find(|c| c.0 == KvDtype::F16 && c.1 == precision)
                .map(|c| c.3);
            let roofline = (kv_bytes / ceiling).max(flops / flops_peak);
            let bw = kv_bytes / secs;
            let ratio = f16
                .map(|f| format!("{:.2}x", f / secs))
                .unwrap_or_else(|| "-".into());
            println!(
                "{len:>8} {:>9} {:>9} {:>9.1} {:>9.2} {:>8.2} {:>7.1}% {:>8.2} {:>8.1}% {:>8}",
                dtype.name(),
                precision.name(),
                kv_bytes / f64::from(1 << 20),
                secs * 1e3,
                bw / 1e9,
                100.0 * bw / ceiling,
                flops / secs / 1e9,
                100.0 * roofline / secs,
                ratio
            );
        }
        cases_caches.clear();
    }
    Ok(())
}
