//! Criterion benches of the kernels, timed on the wall clock with a queue sync per iteration
//! (device timestamps and the roofline table come with `kvattn bench`). Run on whatever adapter
//! `Context::new()` picks: `cargo bench`.

use criterion::{criterion_group, criterion_main, Criterion};
use kvattn::attention::decode::{decode, DecodeArgs};
use kvattn::attention::paged::tile_rows;
use kvattn::attention::{AttentionOptions, AttentionShape};
use kvattn::gpu::Context;
use kvattn::quant::{encode_rows, KvDtype, ScaleMode};
use kvattn::shader::Precision;

fn decode_benches(c: &mut Criterion) {
    let ctx = Context::new().expect("benches need a GPU adapter (see README)");
    let mut group = c.benchmark_group("decode");
    group.sample_size(10);
    let shape = AttentionShape {
        num_q_heads: 32,
        num_kv_heads: 8,
        head_dim_qk: 128,
        head_dim_v: 128,
    };
    let (seqs, ctx_len) = (4usize, 4096usize);
    for (dtype, precision) in [
        (KvDtype::F16, Precision::F32),
        (KvDtype::F16, Precision::F16),
    ] {
        if precision == Precision::F16 && !ctx.caps().shader_f16 {
            continue;
        }
        let rows = seqs * ctx_len * shape.num_kv_heads;
        let x: Vec<f32> = (0..rows * shape.head_dim_qk)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
            .collect();
        let kv = encode_rows(dtype, shape.head_dim_qk, &x, ScaleMode::PerRow).unwrap();
        let k = ctx.upload("k", &kv.words).unwrap();
        let v = ctx.upload("v", &kv.words).unwrap();
        let q = ctx
            .upload(
                "q",
                &vec![0.01f32; seqs * shape.num_q_heads * shape.head_dim_qk],
            )
            .unwrap();
        let out = ctx
            .filled("out", seqs * shape.num_q_heads * shape.head_dim_v, 0.0f32)
            .unwrap();
        let lse = ctx.filled("lse", seqs * shape.num_q_heads, 0.0f32).unwrap();
        let cu: Vec<u32> = (0..=seqs as u32).map(|s| s * ctx_len as u32).collect();
        let opts = AttentionOptions::default();
        let args = DecodeArgs {
            shape,
            options: &opts,
            precision,
            q: &q,
            k: &k,
            v: &v,
            k_dtype: dtype,
            v_dtype: dtype,
            cu_seqlens_k: &cu,
            out: &out,
            lse: &lse,
        };
        let tile = tile_rows(&shape, precision);
        let id = format!(
            "hd128/g{}/ctx{ctx_len}/seqs{seqs}/{dtype}/{}/tile{}",
            shape.group(),
            precision.name(),
            tile
        );
        group.bench_function(id, |b| {
            b.iter(|| {
                decode(&ctx, &args).unwrap();
                ctx.wait().unwrap();
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decode_benches);
criterion_main!(benches);
