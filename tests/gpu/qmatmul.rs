//! The quantized matrix product (`kvattn::decoder::ops::qmatmul`) against its CPU reference for
//! every GGUF block type on odd shapes, its three kernels (lanes, rows, tiled) with the same
//! bits; a row's bits alone and in every batch; a weight and operands split over several
//! bindings; bad input refused before anything is written.

use half::{bf16, f16};
use kvattn::decoder::blocks::SUPPORTED;
use kvattn::decoder::gguf::GgmlType;
use kvattn::decoder::ops::qembed::{qembed, QEmbedArgs};
use kvattn::decoder::ops::qmatmul::{
    input_buffer, prepare_qmatmul_mapped, qmatmul, QMatmulArgs, QMatmulMapping, QWeight,
};
use kvattn::gpu::{Context, UNWRITTEN, UNWRITTEN_BITS};
use kvattn::reference::qmatmul as cpu;
use kvattn::Error;

use crate::common::{gpu, gpu_capped, Rng};

/// Byte offsets of a block's f16 scale fields in the file layout.
fn scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        _ => &[],
    }
}

/// `n` rows of `k` random values of `ty` in the file's layout: random codes, finite scales.
pub(crate) fn random_weight(rng: &mut Rng, ty: GgmlType, n: usize, k: usize) -> Vec<u8> {
    let values = n * k;
    match ty {
        GgmlType::F32 => rng
            .normals(values, 0.5)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        GgmlType::F16 => rng
            .normals(values, 0.5)
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        GgmlType::BF16 => rng
            .normals(values, 0.5)
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        _ => {
            let bb = ty.block_bytes() as usize;
            let blocks = values / ty.block_size() as usize;
            let mut out: Vec<u8> = (0..blocks * bb)
                .map(|_| (rng.next_u64() >> 56) as u8)
                .collect();
            for block in out.chunks_exact_mut(bb) {
                for &at in scale_fields(ty) {
                    let scale = (rng.uniform() as f32 * 0.1 + 0.01)
                        * if rng.uniform() < 0.3 { -1.0 } else { 1.0 };
                    block[at..at + 2]
                        .copy_from_slice(&f16::from_f32(scale).to_bits().to_le_bytes());
                }
            }
            out
        }
    }
}

/// Rows of W making at least 64 KiB on the GPU (so that the row kernel reads it on a CPU
/// adapter) with rows of `k` values of `ty`: an odd count.
pub(crate) fn window_rows(ty: GgmlType, k: usize) -> usize {
    let row = ty.bytes_for(k as u64).unwrap() as usize;
    (65536 / row + 2) | 1
}

/// Rows of k values a test of `ty` uses: one chunk per lane or fewer, and more chunks than
/// lanes (so that lanes take two).
fn ks(ty: GgmlType) -> [usize; 2] {
    if ty.block_size() == 256 {
        [256, 1280]
    } else {
        [96, 672]
    }
}

/// The three kernels.
const MAPPINGS: [QMatmulMapping; 3] = [
    QMatmulMapping::Lanes,
    QMatmulMapping::Rows,
    QMatmulMapping::Tiled,
];

/// Runs the product of rows `x_row ..` of `x` into rows `y_row ..` of a sentinel-filled y of
/// `y_rows` rows with each kernel; checks that they give the same bits and returns y.
fn run(ctx: &Context, w: &QWeight, x: &[f32], rows: (usize, usize, usize, usize)) -> Vec<f32> {
    let (n, _) = w.shape();
    let y0 = vec![UNWRITTEN; rows.3 * n];
    run_into(ctx, w, x, rows, (&y0, false))
}

/// [`run`] over a y that starts as `y0`, adding the product into it with `accumulate`.
fn run_into(
    ctx: &Context,
    w: &QWeight,
    x: &[f32],
    (x_row, rows, y_row, y_rows): (usize, usize, usize, usize),
    (y0, accumulate): (&[f32], bool),
) -> Vec<f32> {
    let (n, _) = w.shape();
    assert_eq!(y0.len(), y_rows * n);
    let xb = input_buffer(ctx, "x", x).unwrap();
    let mut outs = Vec::new();
    // The row kernel reads weights of 64 KiB or more uploaded on a CPU adapter.
    let mappings: Vec<QMatmulMapping> = MAPPINGS
        .into_iter()
        .filter(|&m| m != QMatmulMapping::Rows || w.has_windows(ctx))
        .collect();
    for &mapping in &mappings {
        let yb = ctx.upload("y", y0).unwrap();
        let args = QMatmulArgs {
            x: &xb,
            x_row,
            rows,
            w,
            y: &yb,
            y_row,
            accumulate,
        };
        let op = prepare_qmatmul_mapped(ctx, &args, mapping)
            .unwrap_or_else(|e| panic!("{}: {e}", w.ggml_type()));
        ctx.run_pass("qmatmul", |pass| {
            op.encode(pass);
            Ok(())
        })
        .unwrap();
        outs.push(ctx.read_back::<f32>(&yb, y_rows * n).unwrap());
    }
    // The same bits; a NaN is a NaN (IEEE leaves its sign and payload to the operand order).
    let bits = |v: &[f32]| {
        v.iter()
            .map(|f| if f.is_nan() { u32::MAX } else { f.to_bits() })
            .collect::<Vec<_>>()
    };
    for (mapping, out) in mappings.iter().zip(&outs).skip(1) {
        assert_eq!(
            bits(&outs[0]),
            bits(out),
            "{}: the {mapping:?} kernel differs from the lane kernel",
            w.ggml_type()
        );
    }
    outs.swap_remove(0)
}

/// The CPU reference in both roundings of `fma` (fused, then product-and-sum) and each
/// output's sum of |w x|.
struct Want {
    fused: Vec<f32>,
    unfused: Vec<f32>,
    abs: Vec<f64>,
}

/// Checks y against the CPU reference: rows `y_row .. y_row + rows` within a bound scaled by
/// each output's sum of |w x|, every other value still the sentinel. Returns how many outputs
/// had the bits of the fused and of the unfused reference.
fn check(
    what: &str,
    y: &[f32],
    want: &Want,
    (n, y_row, rows): (usize, usize, usize),
) -> (usize, usize) {
    let mut exact = (0, 0);
    for (i, &v) in y.iter().enumerate() {
        let r = i / n;
        if r < y_row || r >= y_row + rows {
            assert_eq!(
                v.to_bits(),
                UNWRITTEN_BITS,
                "{what}: y[{i}] outside the product was written"
            );
            continue;
        }
        let j = i - y_row * n;
        let bound = 1e-5 * want.abs[j] + 1e-30;
        assert!(
            (f64::from(v) - f64::from(want.fused[j])).abs() <= bound,
            "{what}: y[{r}, {}] = {v:e}, the CPU gives {:e} (bound {bound:e})",
            j % n,
            want.fused[j]
        );
        exact.0 += usize::from(v.to_bits() == want.fused[j].to_bits());
        exact.1 += usize::from(v.to_bits() == want.unfused[j].to_bits());
    }
    exact
}

fn reference(ty: GgmlType, (n, k): (usize, usize), w: &[u8], x: &[f32], rows: usize) -> Want {
    let fused = cpu::qmatmul(ty, n, k, w, x, rows).unwrap();
    let unfused = cpu::qmatmul_unfused(ty, n, k, w, x, rows).unwrap();
    let wv = kvattn::decoder::blocks::dequantize(ty, w, n * k).unwrap();
    let abs = (0..rows * n)
        .map(|j| {
            let (t, o) = (j / n, j % n);
            (0..k)
                .map(|i| f64::from(wv[o * k + i]).abs() * f64::from(x[t * k + i]).abs())
                .sum()
        })
        .collect();
    Want {
        fused,
        unfused,
        abs,
    }
}

/// Every output within the bound, and every output of every type with the bits of one of the
/// two references (the adapter's `fma` is fused or it is not): so every weight is decoded
/// exactly as the CPU does and every sum is taken in the reference's order.
#[test]
fn every_block_type_matches_the_cpu_reference_on_odd_shapes() {
    let ctx = gpu();
    let mut rng = Rng::new(19);
    let mut summary = Vec::new();
    let (mut fused, mut unfused, mut total) = (0, 0, 0);
    for ty in SUPPORTED {
        let mut exact = (0, 0, 0);
        // One row and three (4 rows of x a workgroup); a_row_gets_the_same_bits... takes the
        // other row counts. Each (type, rows) is three pipelines to compile (the kernels).
        // The second weight is at least 64 KiB: the row kernel reads it on CPU adapters.
        let [k0, k1] = ks(ty);
        for (k, (n, rows, x_row, y_row)) in
            [(k0, (13, 1, 1, 2)), (k1, (window_rows(ty, k1), 3, 0, 1))]
        {
            for rows in [rows, 4 - rows] {
                let w = random_weight(&mut rng, ty, n, k);
                let weight = QWeight::upload(ctx, "w", ty, (n, k), &w).unwrap();
                if k == k1 && ctx.caps().cpu_adapter {
                    assert!(
                        weight.has_windows(ctx),
                        "{ty}: the row kernel cannot read it"
                    );
                }
                let x = rng.normals((x_row + rows + 1) * k, 1.0);
                let y = run(ctx, &weight, &x, (x_row, rows, y_row, y_row + rows + 1));
                let xs = &x[x_row * k..(x_row + rows) * k];
                let want = reference(ty, (n, k), &w, xs, rows);
                let what = format!("{ty} n {n} k {k} rows {rows}");
                let (f, u) = check(&what, &y, &want, (n, y_row, rows));
                exact = (exact.0 + f, exact.1 + u, exact.2 + rows * n);
            }
        }
        summary.push(format!("{ty} {}+{}/{}", exact.0, exact.1, exact.2));
        (fused, unfused, total) = (fused + exact.0, unfused + exact.1, total + exact.2);
    }
    println!(
        "outputs with the bits of the fused + unfused reference: {}",
        summary.join(", ")
    );
    assert!(
        fused == total || unfused == total,
        "not every output has the bits of one reference: {}",
        summary.join(", ")
    );
}

/// One row of x over short weight rows (one block each) and weights of 8 and of 12 windows: the
/// row kernel binds up to 12 windows of W a dispatch where the device allows 14 uniform
/// bindings (lavapipe and llvmpipe; 8 within WebGPU's defaults), in quads of 4 (the last
/// window shorter), each invocation owning 4 rows in each; the kernels agree bit for bit and
/// match the CPU.
#[test]
fn one_row_over_short_weight_rows_matches_in_every_kernel() {
    let ctx = gpu();
    let mut rng = Rng::new(23);
    for ty in [
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::F16,
    ] {
        let k = (ty.block_size() as usize).max(32);
        // Over 7 (11) windows' worth of rows: 8 (12) windows on 2 threads (whole_groups), one
        // dispatch each where max_windows allows them.
        for full in [7, 11] {
            let n = full * window_rows(ty, k) + 5;
            let w = random_weight(&mut rng, ty, n, k);
            let weight = QWeight::upload(ctx, "w", ty, (n, k), &w).unwrap();
            let x = rng.normals(2 * k, 1.0);
            let y = run(ctx, &weight, &x, (1, 1, 0, 2));
            let want = reference(ty, (n, k), &w, &x[k..], 1);
            check(&format!("{ty} n {n} k {k} rows 1"), &y, &want, (n, 0, 1));
        }
    }
}

/// The blocks' f16 (scales, F16 weights) through `unpack2x16float`, where the context's f16
/// check found it exact (lavapipe), and through the exact integer decoder (a context told not
/// to check, as every context without the capability): the same values, so every kernel gives
/// the same bits either way, the row kernel and the embedding gather included. On an adapter
/// without the capability (llvmpipe) both contexts take the integer decoder.
#[test]
fn the_blocks_f16_decode_the_same_by_unpack2x16float_and_by_integers() {
    let ctx = gpu();
    let integer = Context::with_options(&kvattn::gpu::ContextOptions {
        disable_f16_unpack: true,
        ..crate::common::test_context_options()
    })
    .unwrap();
    assert!(!integer.caps().f16_unpack_exact);
    eprintln!(
        "f16 by unpack2x16float in the default context: {}",
        ctx.caps().f16_unpack_exact
    );
    let mut rng = Rng::new(31);
    for ty in [
        GgmlType::F16,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        let k = ks(ty)[1];
        let n = window_rows(ty, k);
        let mut w = random_weight(&mut rng, ty, n, k);
        // A subnormal, an infinite and a NaN f16 scale (blocks 0, 1 and 2 of row 0), where the
        // two decoders could part.
        let block = ty.bytes_for(ty.block_size()).unwrap() as usize;
        // F16 weights have no scales: there the first three values take them.
        let field = scale_fields(ty).first().copied().unwrap_or(0);
        for (b, h) in [f16::from_bits(0x0001), f16::INFINITY, f16::NAN]
            .into_iter()
            .enumerate()
        {
            let at = b * block + field;
            w[at..at + 2].copy_from_slice(&h.to_bits().to_le_bytes());
        }
        let x = rng.normals(2 * k, 1.0);
        let y: Vec<Vec<u32>> = [ctx, &integer]
            .into_iter()
            .map(|c| {
                let weight = QWeight::upload(c, "w", ty, (n, k), &w).unwrap();
                // run checks that the kernels agree with each other in this context.
                let y = run(c, &weight, &x, (1, 1, 0, 1));
                let ids = c.upload("ids", &[0u32, n as u32 - 1]).unwrap();
                let out = c.filled("out", 2 * k, UNWRITTEN).unwrap();
                let args = QEmbedArgs {
                    tokens: &ids,
                    n_tokens: 2,
                    table: &weight,
                    out: &out,
                };
                qembed(c, &args).unwrap();
                let table = c.read_back::<f32>(&out, 2 * k).unwrap();
                // The sentinel is a NaN: look for it before NaNs are made one value.
                assert!(
                    y.iter()
                        .chain(&table)
                        .all(|f| f.to_bits() != UNWRITTEN_BITS),
                    "{ty}: an output was not written"
                );
                y.iter()
                    .chain(&table)
                    .map(|f| if f.is_nan() { u32::MAX } else { f.to_bits() })
                    .collect()
            })
            .collect();
        assert_eq!(
            y[0], y[1],
            "{ty}: unpack2x16float and the integer decoder differ"
        );
    }
}

/// The residual add fused into the product (`accumulate`, the decoder's O and down products):
/// the product's rows of y become y + W x with the bits of the product followed by the add
/// (y's value first), in every kernel, over a weight of several windows of the row kernel too;
/// y's other rows keep their values.
#[test]
fn a_product_added_into_y_has_the_bits_of_the_product_then_the_add() {
    let ctx = gpu();
    let mut rng = Rng::new(41);
    let q4 = GgmlType::Q4_1;
    for (ty, n, k, rows) in [
        (q4, 13, 64, 3),
        (GgmlType::Q6_K, 7, 256, 1),
        (q4, 4 * window_rows(q4, 32) + 5, 32, 1),
        (GgmlType::F16, window_rows(GgmlType::F16, 64), 64, 2),
    ] {
        let w = random_weight(&mut rng, ty, n, k);
        let weight = QWeight::upload(ctx, "w", ty, (n, k), &w).unwrap();
        let x = rng.normals((rows + 1) * k, 1.0);
        let shape = (1, rows, 1, rows + 2);
        let product = run(ctx, &weight, &x, shape);
        let y0 = rng.normals((rows + 2) * n, 1.0);
        let y = run_into(ctx, &weight, &x, shape, (&y0, true));
        for (i, (&got, &before)) in y.iter().zip(&y0).enumerate() {
            let want = if (n..(rows + 1) * n).contains(&i) {
                before + product[i]
            } else {
                before
            };
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{ty} n {n} k {k} rows {rows}: y[{i}] = {got:e}, want {want:e}"
            );
        }
    }
}

#[test]
fn a_row_gets_the_same_bits_alone_or_in_any_batch() {
    let ctx = gpu();
    let mut rng = Rng::new(23);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::F16,
    ] {
        let k = ks(ty)[1];
        let n = window_rows(ty, k);
        let w = random_weight(&mut rng, ty, n, k);
        let weight = QWeight::upload(ctx, "w", ty, (n, k), &w).unwrap();
        let rows = 37;
        let x = rng.normals(rows * k, 1.0);
        let all = run(ctx, &weight, &x, (0, rows, 0, rows));
        // Every batch size picks its rows of x per workgroup of the lane kernel (1, 2, 4 or
        // 8); the tiled kernel's tiles of 16 start at other rows.
        for (first, count) in [
            (0, 1),
            (5, 1),
            (36, 1),
            (2, 2),
            (3, 4),
            (1, 3),
            (2, 9),
            (3, 17),
        ] {
            let part = run(ctx, &weight, &x, (first, count, 0, count));
            for t in 0..count {
                let a: Vec<u32> = all[(first + t) * n..(first + t + 1) * n]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let b: Vec<u32> = part[t * n..(t + 1) * n]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                assert_eq!(
                    a,
                    b,
                    "{ty}: row {} computed in a batch of {count} differs from the batch of {rows}",
                    first + t
                );
            }
        }
    }
}

#[test]
fn a_weight_past_one_binding_is_split_by_rows_with_the_same_bits() {
    // 64 KiB bindings: 300 rows of 288 bytes (Q8_0, k 256) are 86,400 bytes on the GPU.
    let capped = gpu_capped();
    let ctx = gpu();
    let mut rng = Rng::new(29);
    let (ty, n, k, rows) = (GgmlType::Q8_0, 300, 256, 70);
    let w = random_weight(&mut rng, ty, n, k);
    let split = QWeight::upload(capped, "w", ty, (n, k), &w).unwrap();
    assert!(split.num_parts() >= 2, "{} parts", split.num_parts());
    // The rows, plus on CPU adapters at most a 64 KiB minimum or 256 bytes of room per part.
    let rows_bytes = (n * 288) as u64;
    assert!(
        split.gpu_bytes() >= rows_bytes
            && split.gpu_bytes() <= rows_bytes + 65536 * split.num_parts() as u64,
        "{} bytes on the GPU",
        split.gpu_bytes()
    );
    let whole = QWeight::upload(ctx, "w", ty, (n, k), &w).unwrap();
    assert_eq!(whole.num_parts(), 1);
    // y (70 x 300 f32, 84,000 bytes) is bound in slices of rows too.
    let x = rng.normals((rows + 1) * k, 1.0);
    let a = run(capped, &split, &x, (1, rows, 0, rows));
    let b = run(ctx, &whole, &x, (1, rows, 0, rows));
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b));
    let want = reference(ty, (n, k), &w, &x[k..], rows);
    check("split", &a, &want, (n, 0, rows));
}

#[test]
fn bad_products_are_refused_before_anything_is_written() {
    let ctx = gpu();
    let mut rng = Rng::new(31);
    let (ty, n, k) = (GgmlType::Q4_1, 5, 64);
    let w = random_weight(&mut rng, ty, n, k);
    let weight = QWeight::upload(ctx, "w", ty, (n, k), &w).unwrap();
    // Wrong byte counts, rows of k not a multiple of the block, unsupported types.
    let short = QWeight::upload(ctx, "w", ty, (n, k), &w[1..]);
    assert!(
        matches!(short, Err(Error::ShapeMismatch { .. })),
        "{short:?}"
    );
    assert!(QWeight::upload(ctx, "w", GgmlType::Q4_K, (1, 128), &[0; 72]).is_err());
    let e = QWeight::upload(ctx, "w", GgmlType::Q2_K, (1, 256), &[0; 84]).unwrap_err();
    assert!(e.to_string().contains("Q2_K"), "{e}");
    let x = ctx.upload("x", &rng.normals(3 * k, 1.0)).unwrap();
    let y = ctx.filled("y", 3 * n, UNWRITTEN).unwrap();
    let args = |x_row, rows, y_row| QMatmulArgs {
        x: &x,
        x_row,
        rows,
        w: &weight,
        y: &y,
        y_row,
        accumulate: false,
    };
    for (what, a) in [
        ("no rows", args(0, 0, 0)),
        ("x too short", args(1, 3, 0)),
        ("y too short", args(0, 2, 2)),
    ] {
        let r = qmatmul(ctx, &a);
        assert!(r.is_err(), "{what}: {r:?}");
    }
    let same = QMatmulArgs {
        y: &x,
        ..args(0, 1, 0)
    };
    assert!(matches!(
        qmatmul(ctx, &same),
        Err(Error::InvalidArgument(_))
    ));
    // The row kernel reads x through a uniform window: an x without UNIFORM usage is refused
    // by name, and the adapter's choice for it is a kernel that reads storage.
    let e = prepare_qmatmul_mapped(ctx, &args(0, 1, 0), QMatmulMapping::Rows).unwrap_err();
    assert!(e.to_string().contains("input_buffer"), "{e}");
    assert_ne!(
        QMatmulMapping::for_product(ctx, &args(0, 1, 0)),
        QMatmulMapping::Rows
    );
    let y_now = ctx.read_back::<f32>(&y, 3 * n).unwrap();
    assert!(y_now.iter().all(|v| v.to_bits() == UNWRITTEN_BITS));
}

/// The gather from a table in each block format gives the CPU's dequantized rows bit for bit
/// (zeros for an id past the vocabulary), whole or split over 64 KiB bindings.
#[test]
fn the_embedding_gather_reads_every_block_type_exactly() {
    let mut rng = Rng::new(37);
    for ty in SUPPORTED {
        let (vocab, dim) = (1200, ks(ty)[0]);
        let table = random_weight(&mut rng, ty, vocab, dim);
        let rows = kvattn::decoder::blocks::dequantize(ty, &table, vocab * dim).unwrap();
        let ids = [3u32, 0, vocab as u32 + 5, vocab as u32 - 1, 3, 700];
        for (which, ctx) in [("whole", gpu()), ("split", gpu_capped())] {
            let weight = QWeight::upload(ctx, "table", ty, (vocab, dim), &table).unwrap();
            assert_eq!(weight.num_parts() > 1, which == "split", "{ty}");
            let tokens = ctx.upload("ids", &ids).unwrap();
            let out = ctx.filled("out", ids.len() * dim, UNWRITTEN).unwrap();
            let args = QEmbedArgs {
                tokens: &tokens,
                n_tokens: ids.len(),
                table: &weight,
                out: &out,
            };
            qembed(ctx, &args).unwrap();
            let got = ctx.read_back::<f32>(&out, ids.len() * dim).unwrap();
            for (t, &id) in ids.iter().enumerate() {
                let row = &got[t * dim..(t + 1) * dim];
                let want: Vec<u32> = if (id as usize) < vocab {
                    let i = id as usize;
                    rows[i * dim..(i + 1) * dim]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect()
                } else {
                    vec![0; dim]
                };
                let row: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
                assert_eq!(
                    row,
                    want,
                    "{ty} ({which}, {} parts): token {t} (id {id})",
                    weight.num_parts()
                );
            }
        }
    }
}

/// NaN and infinities propagate as in the CPU reference: a NaN in x makes every output of its
/// row NaN; a block with an infinite scale makes its row of W's outputs non-finite; the other
/// outputs stay finite and equal to the reference's.
#[test]
fn nan_and_infinities_propagate_like_the_reference() {
    let ctx = gpu();
    let mut rng = Rng::new(43);
    let (ty, n, k, rows) = (GgmlType::Q8_0, 6, 96, 3);
    let mut w = random_weight(&mut rng, ty, n, k);
    // Row 4's second block (34 bytes each, 3 a row): an infinite f16 scale.
    let at = (4 * 3 + 1) * 34;
    w[at..at + 2].copy_from_slice(&f16::INFINITY.to_bits().to_le_bytes());
    let mut x = rng.normals(rows * k, 1.0);
    x[k + 50] = f32::NAN;
    let weight = QWeight::upload(ctx, "w", ty, (n, k), &w).unwrap();
    let y = run(ctx, &weight, &x, (0, rows, 0, rows));
    let want = cpu::qmatmul_unfused(ty, n, k, &w, &x, rows).unwrap();
    for t in 0..rows {
        for o in 0..n {
            let (g, r) = (y[t * n + o], want[t * n + o]);
            if t == 1 {
                assert!(g.is_nan(), "y[1, {o}] = {g} with a NaN in x row 1");
            } else if o == 4 {
                assert!(
                    !g.is_finite(),
                    "y[{t}, 4] = {g} with an infinite scale in W row 4"
                );
            } else {
                assert!(g.is_finite(), "y[{t}, {o}] = {g}");
            }
            assert_eq!(g.is_nan(), r.is_nan(), "y[{t}, {o}]: {g} against {r}");
        }
    }
}
