//! kvattn inside an application that owns its wgpu device.
//!
//! The application opens an adapter and a device with plain wgpu, hands them to kvattn with
//! `Context::from_wgpu`, and records the KV append and the paged attention of two layers into
//! ONE compute pass of its own command encoder, then submits once. The plans are made once
//! with a capacity; each step only writes their metadata (`update`), so a step creates no
//! buffer and no bind group after the first. The result is checked against kvattn's CPU
//! reference.
//!
//! ```text
//! cargo run --release --example embed            # WGPU_BACKEND=gl for llvmpipe
//! ```
//!
//! It takes no arguments (`--help` describes it); it exits with an error if the result differs
//! from the reference or a warm step creates a GPU object.

use clap::Parser;
use kvattn::attention::paged::{
    AttentionIo, PagedAttentionPlan, PagedQuery, PlanCapacity, PlanSpec, SPLIT_TOKENS,
};
use kvattn::attention::{AttentionOptions, AttentionShape, RaggedBatch};
use kvattn::cache::append_kv::SourceDtype;
use kvattn::cache::append_plan::{AppendIo, AppendPlan};
use kvattn::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::gpu::{Context, ContextOptions};
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;

const LAYERS: usize = 2;
const HQ: usize = 8;
const HKV: usize = 2;
const D: usize = 64;

/// kvattn inside an application that owns its wgpu device.
///
/// Opens an adapter and a device with plain wgpu, hands them to kvattn (Context::from_wgpu),
/// and records the KV append and the paged attention of two layers into one compute pass of the
/// application's own encoder, two decode steps, each checked against the CPU reference. Fails
/// if a result differs or a warm step creates a buffer or bind group. The adapter is the one
/// WGPU_BACKEND selects.
#[derive(Debug, Parser)]
#[command(name = "embed")]
struct Args {}

/// Deterministic values in [-1, 1), exactly representable in f16 (the cache stores f16).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            half::f16::from_f32((x >> 8) as f32 / (1 << 23) as f32 - 1.0).to_f32()
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    Args::parse();
    // 1. The application's adapter and device, made with plain wgpu.
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle().with_env());
    let adapter =
        pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default()))?;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("my application"),
        required_limits: adapter.limits(),
        ..Default::default()
    }))?;

    // 2. kvattn on that device: no handler of the application's is replaced.
    let ctx = Context::from_wgpu(device, queue, &adapter, &ContextOptions::default())?;
    println!(
        "adapter: {} ({})",
        ctx.adapter().name,
        ctx.adapter().backend
    );

    // 3. A paged cache of two layers, and two sequences with 20 and 5 tokens of history.
    let mut cache = PagedKvCache::new(
        &ctx,
        PagedKvConfig::new(LAYERS, HKV, D, KvDtype::F16),
        PoolSize::Blocks(16),
    )?;
    let history = [20usize, 5];
    let row = HKV * D;
    let mut host_k: Vec<Vec<Vec<f32>>> = Vec::new(); // [seq][layer] -> [len, HKV, D]
    let mut host_v: Vec<Vec<Vec<f32>>> = Vec::new();
    for (seq, &len) in history.iter().enumerate() {
        cache.add_sequence(seq as u64, &[])?;
        let k: Vec<Vec<f32>> = (0..LAYERS)
            .map(|l| values(len * row, (10 * seq + l) as u32))
            .collect();
        let v: Vec<Vec<f32>> = (0..LAYERS)
            .map(|l| values(len * row, (10 * seq + l + 5) as u32))
            .collect();
        let tokens: Vec<u32> = (0..len as u32).collect();
        cache.append_host(&ctx, seq as u64, &tokens, &k, &v)?;
        host_k.push(k);
        host_v.push(v);
    }

    // 4. Plans made once, sized for the steps to come.
    let shape = AttentionShape {
        num_q_heads: HQ,
        num_kv_heads: HKV,
        head_dim_qk: D,
        head_dim_v: D,
    };
    let options = AttentionOptions::default();
    let spec = PlanSpec {
        shape,
        options: &options,
        precision: Precision::F32,
        split_tokens: SPLIT_TOKENS,
    };
    let capacity = PlanCapacity {
        max_seqs: 2,
        max_q_tokens: 2,
        max_blocks_per_seq: 8,
    };
    let mut attention = PagedAttentionPlan::with_capacity(&ctx, &cache, &spec, capacity)?;
    let mut append = AppendPlan::with_capacity(&ctx, &cache, 2)?;

    // 5. The step's buffers (the application's: its own kernels would write K, V and Q).
    let upload = |label: &str, n: usize| ctx.filled(label, n, 0.0f32);
    let k_buf = (0..LAYERS)
        .map(|_| upload("new k", 2 * row))
        .collect::<Result<Vec<_>, _>>()?;
    let v_buf = (0..LAYERS)
        .map(|_| upload("new v", 2 * row))
        .collect::<Result<Vec<_>, _>>()?;
    let q_buf = (0..LAYERS)
        .map(|_| upload("q", 2 * HQ * D))
        .collect::<Result<Vec<_>, _>>()?;
    let out = (0..LAYERS)
        .map(|_| upload("out", 2 * HQ * D))
        .collect::<Result<Vec<_>, _>>()?;
    let lse = (0..LAYERS)
        .map(|_| upload("lse", 2 * HQ))
        .collect::<Result<Vec<_>, _>>()?;

    // 6. Two decode steps, a new token for each sequence in each.
    for step in 0..2u32 {
        let mut batch = AppendBatch::new();
        for seq in 0..2u64 {
            cache.append_tokens(&ctx, &mut batch, seq, &[7])?;
        }
        let new_k: Vec<Vec<f32>> = (0..LAYERS)
            .map(|l| values(2 * row, 100 + 10 * step + l as u32))
            .collect();
        let new_v: Vec<Vec<f32>> = (0..LAYERS)
            .map(|l| values(2 * row, 200 + 10 * step + l as u32))
            .collect();
        let q: Vec<Vec<f32>> = (0..LAYERS)
            .map(|l| values(2 * HQ * D, 300 + 10 * step + l as u32))
            .collect();
        for layer in 0..LAYERS {
            ctx.write_buffer(&k_buf[layer], 0, bytemuck::cast_slice(&new_k[layer]))?;
            ctx.write_buffer(&v_buf[layer], 0, bytemuck::cast_slice(&new_v[layer]))?;
            ctx.write_buffer(&q_buf[layer], 0, bytemuck::cast_slice(&q[layer]))?;
        }
        let before = ctx.counters();
        append.update(&ctx, &cache, &batch)?;
        let queries = [
            PagedQuery { seq: 0, len_q: 1 },
            PagedQuery { seq: 1, len_q: 1 },
        ];
        attention.update(&ctx, &cache, &queries)?;

        // Both layers into one compute pass of the application's own encoder; one submission.
        let mut encoder = ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("step"),
            });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            for layer in 0..LAYERS {
                append.encode(
                    &ctx,
                    &mut pass,
                    &AppendIo {
                        cache: &cache,
                        layer,
                        k: k_buf[layer].as_entire_buffer_binding(),
                        v: v_buf[layer].as_entire_buffer_binding(),
                        src: SourceDtype::F32,
                    },
                )?;
                attention.encode(
                    &ctx,
                    &mut pass,
                    &AttentionIo {
                        cache: &cache,
                        layer,
                        q: q_buf[layer].as_entire_buffer_binding(),
                        out: out[layer].as_entire_buffer_binding(),
                        lse: lse[layer].as_entire_buffer_binding(),
                    },
                )?;
            }
        }
        ctx.submit("step", encoder)?; // Context::submit (not queue.submit) lets the plans see it
        let used = ctx.counters().since(&before);
        println!(
            "step {step}: {LAYERS} layers of append + attention in one compute pass: {} submission, \
             {} buffers and {} bind groups created",
            used.submissions, used.buffers_created, used.bind_groups_created
        );

        // 7. Check against the CPU reference over the same K/V.
        let mut worst = 0.0f32;
        for layer in 0..LAYERS {
            let got = ctx.read_back::<f32>(&out[layer], 2 * HQ * D)?;
            let (mut k, mut v, mut cu_k) = (Vec::new(), Vec::new(), vec![0u32]);
            for seq in 0..2 {
                host_k[seq][layer].extend(&new_k[layer][seq * row..(seq + 1) * row]);
                host_v[seq][layer].extend(&new_v[layer][seq * row..(seq + 1) * row]);
                k.extend(&host_k[seq][layer]);
                v.extend(&host_v[seq][layer]);
                cu_k.push(cu_k[seq] + (host_k[seq][layer].len() / row) as u32);
            }
            let batch = RaggedBatch {
                q: &q[layer],
                k: &k,
                v: &v,
                cu_seqlens_q: &[0, 1, 2],
                cu_seqlens_k: &cu_k,
            };
            let want = kvattn::reference::attention(&batch, &shape, &options)?;
            for (a, b) in got.iter().zip(&want.out) {
                let d = (a - b).abs();
                // A NaN anywhere makes the whole check fail (f32::max would skip it).
                worst = if d.is_nan() || worst.is_nan() {
                    f32::NAN
                } else {
                    worst.max(d)
                };
            }
        }
        println!("step {step}: max |GPU - CPU reference| over both layers: {worst:.2e}");
        if worst.is_nan() || worst >= 1e-4 {
            return Err(format!("the GPU result differs from the reference by {worst}").into());
        }
        if step > 0 && (used.buffers_created, used.bind_groups_created) != (0, 0) {
            return Err("a warm step created GPU objects".into());
        }
    }
    Ok(())
}
