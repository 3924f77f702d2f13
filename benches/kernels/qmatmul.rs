//! The decoder's block-format products (`decoder::ops::qmatmul`) on SmolLM2-135M's FFN
//! shapes, a decode step's one row of x and a prefill chunk of 16, each with the kernel the
//! adapter picks (`QMatmulMapping::for_product`: the row kernel on CPU adapters; on GPUs the
//! lane kernel for one row, the tiled kernel for 16). Types: the test model's Q4_1 and the
//! repository's Q8_0 and Q4_K requantizations (Q4_K: the down product only, rows of whole
//! 256-value blocks). Throughput is the weight's bytes in the file, which each product reads
//! once (on the GPU a type whose blocks are not whole words is padded, at most 15% more): for
//! one row, against the adapter's copy ceiling (`kvattn bench --filter copy`), it says how far
//! the kernel is from streaming its weights (16 rows do 16 times the FLOPs). Random weights
//! with valid scales, seeded.

use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput};
use kvattn::decoder::blocks::quantize::quantize;
use kvattn::decoder::gguf::GgmlType;
use kvattn::decoder::ops::qmatmul::{prepare_qmatmul, QMatmulArgs, QMatmulMapping, QWeight};
use kvattn::decoder::ops::qmatmul_rows::input_buffer;
use kvattn::decoder::ops::PreparedOp;
use kvattn::rng::SplitMix64;

/// (name, rows of W, values per row): the FFN's gate (and up) and down products.
const SHAPES: [(&str, usize, usize); 2] = [("gate", 1536, 576), ("down", 576, 1536)];
/// Rows of x: a decode step and a prefill chunk.
const ROWS: [usize; 2] = [1, 16];

/// `n * k` values of type `ty`: Q4_1 (which the repository does not quantize to) as random
/// blocks of small positive scales, negative minimums and any codes; the others quantized
/// from uniform values in [-0.5, 0.5).
fn weight_bytes(ty: GgmlType, n: usize, k: usize, rng: &mut SplitMix64) -> Vec<u8> {
    if ty == GgmlType::Q4_1 {
        let mut bytes = Vec::with_capacity(n * k / 32 * 20);
        for _ in 0..n * k / 32 {
            let d = 0x2000u16 | (rng.next_u64() & 0x3ff) as u16;
            let m = 0xa000u16 | (rng.next_u64() & 0x3ff) as u16;
            bytes.extend_from_slice(&d.to_le_bytes());
            bytes.extend_from_slice(&m.to_le_bytes());
            bytes.extend((0..16).map(|_| rng.next_u64() as u8));
        }
        return bytes;
    }
    let values: Vec<f32> = (0..n * k).map(|_| rng.uniform() as f32 - 0.5).collect();
    quantize(ty, &values).expect("quantizable type")
}

/// A prepared product: its weight, operands and dispatches.
struct Product {
    _w: QWeight,
    _x: wgpu::Buffer,
    _y: wgpu::Buffer,
    op: PreparedOp,
}

impl Product {
    /// Case `id`: `rows` rows of x against an `n x k` weight of type `ty`, run once untimed (a
    /// software adapter compiles at the first submission).
    fn new(id: &str, ty: GgmlType, (n, k): (usize, usize), rows: usize, seed: u64) -> Product {
        let ctx = super::gpu();
        let mut rng = SplitMix64::new(seed);
        let bytes = weight_bytes(ty, n, k, &mut rng);
        let w = QWeight::upload(ctx, "w", ty, (n, k), &bytes).expect("uploading the weight");
        let x: Vec<f32> = (0..rows * k).map(|_| rng.uniform() as f32 - 0.5).collect();
        let x = input_buffer(ctx, "x", &x).expect("x");
        let y = ctx.filled("y", rows * n, 0.0f32).expect("y");
        let args = QMatmulArgs {
            x: &x,
            x_row: 0,
            rows,
            w: &w,
            y: &y,
            y_row: 0,
            accumulate: false,
        };
        let op = prepare_qmatmul(ctx, &args).expect("preparing the product");
        eprintln!(
            "qmatmul/{id}: {:?} kernel, {} dispatches",
            QMatmulMapping::for_product(ctx, &args),
            op.num_dispatches()
        );
        let p = Product {
            _w: w,
            _x: x,
            _y: y,
            op,
        };
        p.run()
            .and_then(|_| ctx.wait())
            .expect("running the product");
        p
    }

    fn run(&self) -> kvattn::Result<wgpu::SubmissionIndex> {
        super::gpu().run_pass("qmatmul", |pass| {
            self.op.encode(pass);
            Ok(())
        })
    }
}

/// Benches the products, each prepared when criterion first runs it (not at all when a filter
/// skips it) and freed before the next.
pub fn benches(c: &mut Criterion) {
    let ctx = super::gpu();
    let mut group = c.benchmark_group("qmatmul");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    let mut seed = 19;
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K] {
        for (name, n, k) in SHAPES {
            // Rows of whole blocks only (a K-quant's 256 values: not the gate's 576).
            if k % ty.block_size() as usize != 0 {
                continue;
            }
            for rows in ROWS {
                seed += 1;
                let id = format!("{}/{name}/n{n}/k{k}/rows{rows}", ty.name().to_lowercase());
                let bytes = ty.bytes_for((n * k) as u64).expect("whole blocks");
                group.throughput(Throughput::Bytes(bytes));
                let mut prepared: Option<Product> = None;
                group.bench_function(&id, |b| {
                    let p =
                        prepared.get_or_insert_with(|| Product::new(&id, ty, (n, k), rows, seed));
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let (_, t) = ctx.timed(|| p.run()).expect("running the product");
                            let d = Duration::try_from_secs_f64(t.seconds.max(0.0))
                                .unwrap_or(Duration::MAX);
                            total = total.saturating_add(d);
                        }
                        total
                    })
                });
                drop(prepared);
            }
        }
    }
    group.finish();
}
