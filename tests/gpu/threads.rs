//! One context from several threads at once: the context, caches and plans are `Send + Sync`,
//! and four threads, each with its own cache (other formats and shapes), appending, attending
//! and reading back on one context concurrently get the same bits as the same work done one
//! thread after another.

use kvattn::attention::paged::{PagedAttentionArgs, PagedAttentionPlan, PagedQuery};
use kvattn::attention::{AttentionOptions, AttentionShape};
use kvattn::cache::paged::{PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::gpu::Context;
use kvattn::quant::KvDtype;
use kvattn::shader::Precision;

use crate::common::{test_context_options, Rng};

#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    fn assert_send_sync<T: Send + Sync>() {}
    let _ = assert_send_sync::<Context>;
    let _ = assert_send_sync::<PagedKvCache>;
    let _ = assert_send_sync::<PagedAttentionPlan>;
    let _ = assert_send_sync::<kvattn::cache::pool::BlockPool>;
    let _ = assert_send_sync::<kvattn::mla::MlaCache>;
    let _ = assert_send_sync::<kvattn::mla::MlaPlan>;
    let _ = assert_send_sync::<kvattn::mla::MlaWeights>;
    let _ = assert_send_sync::<kvattn::mla::head_matmul::HeadMatmul>;
    let _ = assert_send_sync::<kvattn::mla::strided_copy::StridedCopy>;
    #[cfg(feature = "decoder")]
    let _ = assert_send_sync::<kvattn::decoder::model::Decoder>;
    let _ = assert_send_sync::<kvattn::Error>;
};

/// One thread's cache: formats, heads, dims and block size.
struct Job {
    dtype: KvDtype,
    num_q_heads: usize,
    num_kv_heads: usize,
    head_dim_k: usize,
    head_dim_v: usize,
    block_size: usize,
    seed: u64,
}

const JOBS: [Job; 4] = [
    Job {
        dtype: KvDtype::F32,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim_k: 64,
        head_dim_v: 64,
        block_size: 16,
        seed: 1,
    },
    Job {
        dtype: KvDtype::F16,
        num_q_heads: 4,
        num_kv_heads: 1,
        head_dim_k: 128,
        head_dim_v: 128,
        block_size: 8,
        seed: 2,
    },
    Job {
        dtype: KvDtype::Bf16,
        num_q_heads: 8,
        num_kv_heads: 4,
        head_dim_k: 64,
        head_dim_v: 32,
        block_size: 32,
        seed: 3,
    },
    Job {
        dtype: KvDtype::Int8,
        num_q_heads: 2,
        num_kv_heads: 2,
        head_dim_k: 64,
        head_dim_v: 64,
        block_size: 4,
        seed: 4,
    },
];

const LAYERS: usize = 2;
const SEQS: u64 = 3;
const ROUNDS: usize = 6;

/// What one job produced: the bits of every attention output and LSE it read back, the K/V
/// words of every sequence, and a snapshot.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    attention: Vec<u32>,
    rows: Vec<u32>,
    snapshot: Vec<u8>,
}

/// Rounds of: append a chunk to every sequence, plan attention over all of them (the last with
/// as many queries as its chunk, the others decode), run it on both layers, read it back.
fn work(ctx: &Context, job: &Job) -> Outcome {
    let cfg = PagedKvConfig {
        head_dim_v: job.head_dim_v,
        block_size: job.block_size,
        prefix_caching: false,
        model_id: "threads".into(),
        ..PagedKvConfig::new(LAYERS, job.num_kv_heads, job.head_dim_k, job.dtype)
    };
    let shape = AttentionShape {
        num_q_heads: job.num_q_heads,
        num_kv_heads: job.num_kv_heads,
        head_dim_qk: job.head_dim_k,
        head_dim_v: job.head_dim_v,
    };
    let mut cache = PagedKvCache::new(ctx, cfg, PoolSize::Blocks(200)).unwrap();
    let mut rng = Rng::new(job.seed);
    for seq in 0..SEQS {
        cache.add_sequence(seq, &[]).unwrap();
    }
    let opts = AttentionOptions::default();
    let mut attention = Vec::new();
    for _ in 0..ROUNDS {
        let mut batch = Vec::new();
        for seq in 0..SEQS {
            let n = 1 + (rng.next_u64() % 40) as usize;
            let tokens: Vec<u32> = (0..n).map(|_| rng.next_u64() as u32 % 1000).collect();
            let rows = |d: usize, rng: &mut Rng| -> Vec<Vec<f32>> {
                (0..LAYERS)
                    .map(|_| rng.normals(n * job.num_kv_heads * d, 1.0))
                    .collect()
            };
            let k = rows(job.head_dim_k, &mut rng);
            let v = rows(job.head_dim_v, &mut rng);
            cache.append_host(ctx, seq, &tokens, &k, &v).unwrap();
            let len_q = if seq == SEQS - 1 { n } else { 1 };
            batch.push(PagedQuery { seq, len_q });
        }
        let args = PagedAttentionArgs {
            layer: 0,
            batch: &batch,
            shape,
            options: &opts,
            precision: Precision::F32,
        };
        let plan = PagedAttentionPlan::new(ctx, &cache, &args).unwrap();
        let q_rows = plan.total_q() * shape.num_q_heads;
        for layer in 0..LAYERS {
            let q = ctx
                .upload("q", &rng.normals(q_rows * shape.head_dim_qk, 1.0))
                .unwrap();
            let out = ctx
                .filled("out", q_rows * shape.head_dim_v, kvattn::gpu::UNWRITTEN)
                .unwrap();
            let lse = ctx.filled("lse", q_rows, kvattn::gpu::UNWRITTEN).unwrap();
            plan.run(ctx, &cache, layer, &q, &out, &lse).unwrap();
            let out: Vec<f32> = ctx.read_back(&out, q_rows * shape.head_dim_v).unwrap();
            let lse: Vec<f32> = ctx.read_back(&lse, q_rows).unwrap();
            assert!(
                out.iter().chain(&lse).all(|x| x.is_finite()),
                "{:?}: a missing or broken write",
                job.dtype
            );
            attention.extend(out.iter().chain(&lse).map(|x| x.to_bits()));
        }
    }
    let mut rows = Vec::new();
    for seq in 0..SEQS {
        for layer in 0..LAYERS {
            let (k, v) = cache.read_rows(ctx, seq, layer).unwrap();
            for r in [k, v] {
                rows.extend(r.words);
                rows.extend(r.scales);
            }
        }
    }
    let snapshot = cache.export_snapshot(ctx, SEQS - 1).unwrap();
    Outcome {
        attention,
        rows,
        snapshot,
    }
}

/// A snapshot's header fields and tensors, sorted (safetensors writes the header fields in
/// hash-map order, so equal snapshots need not be equal bytes).
type Contents = (Vec<(String, String)>, Vec<(String, Vec<usize>, Vec<u8>)>);

fn snapshot_contents(bytes: &[u8]) -> Contents {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let mut header: Vec<_> = meta.metadata().clone().unwrap().into_iter().collect();
    header.sort();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, t.shape().to_vec(), t.data().to_vec()))
        .collect();
    tensors.sort();
    (header, tensors)
}

#[test]
fn one_context_from_four_threads_matches_sequential_bits() {
    // A context of its own, so the threads also race to build the pipelines.
    let ctx = Context::with_options(&test_context_options()).unwrap();
    // On GL the pipelines are built before the threads start: wgpu's GL backend holds its one
    // context lock through each compilation (seconds on llvmpipe with a cold shader cache), and
    // a buffer dropped meanwhile on another thread waits for it at most six seconds, then
    // panics. kvattn's own device calls queue (src/gpu/serial.rs); drops cannot. The race to
    // build the pipelines runs on the other backends. Those sequential runs are then the ones
    // the threads are compared with.
    let sequential_first: Option<Vec<Outcome>> =
        crate::common::is_gl(&ctx).then(|| JOBS.iter().map(|job| work(&ctx, job)).collect());
    let threaded: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = JOBS.iter().map(|job| s.spawn(|| work(&ctx, job))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    ctx.wait().unwrap();
    let sequential =
        sequential_first.unwrap_or_else(|| JOBS.iter().map(|job| work(&ctx, job)).collect());
    for ((job, got), want) in JOBS.iter().zip(&threaded).zip(&sequential) {
        assert!(!want.attention.is_empty() && !want.rows.is_empty());
        assert_eq!(got.attention.len(), want.attention.len(), "{:?}", job.dtype);
        let differ = got
            .attention
            .iter()
            .zip(&want.attention)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            differ, 0,
            "{:?}: {differ} attention values differ from the sequential run",
            job.dtype
        );
        assert!(got.rows == want.rows, "{:?}: cache words differ", job.dtype);
        assert!(
            snapshot_contents(&got.snapshot) == snapshot_contents(&want.snapshot),
            "{:?}: snapshots differ",
            job.dtype
        );
    }
    // The jobs really differ from one another (no thread read another's results).
    for i in 0..JOBS.len() {
        for j in i + 1..JOBS.len() {
            assert_ne!(threaded[i].attention, threaded[j].attention);
        }
    }
}
