//! The embeddable forms of the dense products and the strided copy: `Linear` (prepare, encode,
//! run) and `HeadMatmul::prepare` / `encode_head_matmul` / `encode_strided_copy` give the
//! wrappers' bits; a prepared product recorded again creates no buffer and no bind group; bad
//! input is a typed error before anything is created or recorded.

use kvattn::gpu::{Context, UNWRITTEN, UNWRITTEN_BITS};
use kvattn::matmul::head_matmul::head_matmul;
use kvattn::matmul::{encode_head_matmul, HeadMatmul, Linear, RowStrides};
use kvattn::mla::strided_copy::{encode_strided_copy, strided_copy, StridedCopy};
use kvattn::Error;

use crate::common::{gpu, gpu_capped, own_context, Rng};

/// Records `f` into one compute pass of a caller's encoder and submits it.
fn in_one_pass(ctx: &Context, f: impl FnOnce(&mut wgpu::ComputePass<'_>)) {
    let mut encoder = ctx.encoder("caller's encoder");
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        f(&mut pass);
    }
    ctx.submit("caller's step", encoder).unwrap();
}

fn bits(ctx: &Context, buffer: &wgpu::Buffer, len: usize) -> Vec<u32> {
    ctx.read_back::<f32>(buffer, len)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// A refused product: what is wrong, the product, and the error it must give.
type Case<'a> = (&'static str, Linear<'a>, fn(&Error) -> bool);

/// One-head specs of every tile shape (rows 1, 3, 8, 20, 70) with offsets.
fn linear_cases() -> Vec<(usize, usize, usize, usize, usize)> {
    // (rows, k, n, x_row, y_row)
    vec![
        (1, 37, 300, 2, 1),
        (3, 64, 130, 0, 4),
        (8, 16, 64, 1, 0),
        (20, 33, 50, 3, 2),
        (70, 24, 129, 0, 1),
    ]
}

#[test]
fn linear_forms_give_the_head_matmul_bits() {
    let ctx = gpu();
    let mut rng = Rng::new(5);
    for (rows, k, n, x_row, y_row) in linear_cases() {
        let x = ctx
            .upload("x", &rng.normals((x_row + rows + 1) * k, 1.0))
            .unwrap();
        let w = ctx.upload("w", &rng.normals(n * k, 0.3)).unwrap();
        let y_len = (y_row + rows + 1) * n;
        let ys: Vec<wgpu::Buffer> = (0..4)
            .map(|_| ctx.filled("y", y_len, UNWRITTEN).unwrap())
            .collect();
        let linear = |y| Linear {
            x: &x,
            x_row,
            rows,
            k,
            w: &w,
            n,
            y,
            y_row,
        };
        let what = format!("rows {rows} k {k} n {n}");
        // The head_matmul the decoder used to call.
        let spec = HeadMatmul {
            rows,
            heads: 1,
            inner: k,
            n_out: n,
            x: RowStrides {
                offset: x_row * k,
                row: k,
                head: 0,
            },
            w_head: 0,
            w_k: 1,
            w_n: k,
            y: RowStrides {
                offset: y_row * n,
                row: n,
                head: 0,
            },
        };
        assert_eq!(linear(&ys[0]).spec().unwrap(), spec, "{what}");
        head_matmul(ctx, &spec, &x, &w, &ys[0]).unwrap();
        assert_eq!(linear(&ys[1]).run(ctx).unwrap(), spec.flops());
        let prepared = linear(&ys[3]).prepare(ctx).unwrap();
        assert_eq!(prepared.flops(), 2 * (rows * k * n) as u64);
        in_one_pass(ctx, |pass| {
            assert_eq!(linear(&ys[2]).encode(ctx, pass).unwrap(), spec.flops());
            prepared.encode(pass);
        });
        let want = bits(ctx, &ys[0], y_len);
        let written = want.iter().filter(|&&b| b != UNWRITTEN_BITS).count();
        assert_eq!(written, rows * n, "{what}: only rows y_row.. are written");
        for (i, y) in ys.iter().enumerate().skip(1) {
            assert_eq!(bits(ctx, y, y_len), want, "{what}: form {i}");
        }
    }
}

#[test]
fn prepared_forms_split_over_bindings_give_the_wrappers_bits() {
    // 64 KiB bindings: x and y of 3,000 rows split into several dispatches.
    let ctx = gpu_capped();
    let mut rng = Rng::new(9);
    let (rows, heads, inner, n_out) = (3000, 2, 12, 20);
    let spec = HeadMatmul {
        rows,
        heads,
        inner,
        n_out,
        x: RowStrides::dense(3, heads, inner),
        w_head: inner * n_out,
        w_k: n_out,
        w_n: 1,
        y: RowStrides::dense(5, heads, n_out),
    };
    let x = ctx
        .upload("x", &rng.normals(3 + rows * heads * inner, 1.0))
        .unwrap();
    let w = ctx
        .upload("w", &rng.normals(heads * inner * n_out, 0.3))
        .unwrap();
    let y_len = 5 + rows * heads * n_out;
    let y0 = ctx.filled("y0", y_len, UNWRITTEN).unwrap();
    let y1 = ctx.filled("y1", y_len, UNWRITTEN).unwrap();
    let y2 = ctx.filled("y2", y_len, UNWRITTEN).unwrap();
    head_matmul(ctx, &spec, &x, &w, &y0).unwrap();
    let prepared = spec.prepare(ctx, &x, &w, &y1).unwrap();
    assert!(prepared.dispatches() > 1, "the product is split");
    in_one_pass(ctx, |pass| {
        prepared.encode(pass);
        encode_head_matmul(ctx, pass, &spec, &x, &w, &y2).unwrap();
    });
    let want = bits(ctx, &y0, y_len);
    assert_eq!(bits(ctx, &y1, y_len), want);
    assert_eq!(bits(ctx, &y2, y_len), want);

    let copy = StridedCopy {
        rows,
        heads,
        n: 7,
        src: RowStrides::dense(1, heads, 9),
        dst: RowStrides::dense(2, heads, 8),
    };
    let src = ctx
        .upload("src", &rng.normals(1 + rows * heads * 9, 1.0))
        .unwrap();
    let d_len = 2 + rows * heads * 8;
    let d0 = ctx.filled("d0", d_len, UNWRITTEN).unwrap();
    let d1 = ctx.filled("d1", d_len, UNWRITTEN).unwrap();
    let d2 = ctx.filled("d2", d_len, UNWRITTEN).unwrap();
    strided_copy(ctx, &copy, &src, &d0).unwrap();
    let prepared = copy.prepare(ctx, &src, &d1).unwrap();
    assert!(prepared.dispatches() > 1, "the copy is split");
    in_one_pass(ctx, |pass| {
        prepared.encode(pass);
        encode_strided_copy(ctx, pass, &copy, &src, &d2).unwrap();
    });
    let want = bits(ctx, &d0, d_len);
    assert_eq!(bits(ctx, &d1, d_len), want);
    assert_eq!(bits(ctx, &d2, d_len), want);
}

#[test]
fn a_prepared_product_recorded_again_creates_nothing() {
    let ctx = own_context(None);
    let mut rng = Rng::new(11);
    let (rows, k, n) = (4, 40, 24);
    let x = ctx.upload("x", &rng.normals(rows * k, 1.0)).unwrap();
    let w = ctx.upload("w", &rng.normals(n * k, 0.3)).unwrap();
    let y = ctx.filled("y", rows * n, UNWRITTEN).unwrap();
    let linear = Linear {
        x: &x,
        x_row: 0,
        rows,
        k,
        w: &w,
        n,
        y: &y,
        y_row: 0,
    };
    let copy_dst = ctx.filled("copy dst", rows * n, UNWRITTEN).unwrap();
    let copy = StridedCopy {
        rows,
        heads: 1,
        n,
        src: RowStrides::dense(0, 1, n),
        dst: RowStrides::dense(0, 1, n),
    };
    let before = ctx.counters();
    let prepared = linear.prepare(&ctx).unwrap();
    let prepared_copy = copy.prepare(&ctx, &y, &copy_dst).unwrap();
    let made = ctx.counters().since(&before);
    assert_eq!(
        made.bind_groups_created as usize,
        prepared.dispatches() + prepared_copy.dispatches(),
        "{made:?}"
    );
    assert_eq!(made.submissions, 0, "preparing submits nothing: {made:?}");
    for step in 0..2 {
        let before = ctx.counters();
        in_one_pass(&ctx, |pass| {
            prepared.encode(pass);
            prepared_copy.encode(pass);
        });
        let step_counts = ctx.counters().since(&before);
        assert_eq!(
            step_counts.buffers_created, 0,
            "step {step}: {step_counts:?}"
        );
        assert_eq!(
            step_counts.bind_groups_created, 0,
            "step {step}: {step_counts:?}"
        );
        assert_eq!(step_counts.submissions, 1, "step {step}: {step_counts:?}");
    }
    // The recorded product is the wrapper's.
    let want = ctx.filled("want", rows * n, UNWRITTEN).unwrap();
    Linear { y: &want, ..linear }.run(&ctx).unwrap();
    assert_eq!(bits(&ctx, &y, rows * n), bits(&ctx, &want, rows * n));
    assert_eq!(bits(&ctx, &copy_dst, rows * n), bits(&ctx, &want, rows * n));
}

#[test]
fn bad_input_is_a_typed_error_before_anything_is_made() {
    let ctx = own_context(None);
    let (rows, k, n) = (3, 8, 16);
    // x holds more than the product reads, so that it can stand in for y.
    let x = ctx.upload("x", &vec![1.0f32; rows * n]).unwrap();
    let w = ctx.upload("w", &vec![1.0f32; n * k]).unwrap();
    let y = ctx.filled("y", rows * n, UNWRITTEN).unwrap();
    let small = ctx.filled("small y", rows * n - 1, UNWRITTEN).unwrap();
    let no_storage = ctx
        .create_buffer(&wgpu::BufferDescriptor {
            label: Some("y without STORAGE"),
            size: (rows * n * 4) as u64,
            usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
        .unwrap();
    let good = Linear {
        x: &x,
        x_row: 0,
        rows,
        k,
        w: &w,
        n,
        y: &y,
        y_row: 0,
    };
    let cases: Vec<Case> = vec![
        ("y too small", Linear { y: &small, ..good }, |e| {
            matches!(e, Error::ShapeMismatch { .. })
        }),
        ("y row past the end", Linear { y_row: 1, ..good }, |e| {
            matches!(e, Error::ShapeMismatch { .. })
        }),
        ("x rows past the end", Linear { x_row: 4, ..good }, |e| {
            matches!(e, Error::ShapeMismatch { .. })
        }),
        (
            "y without STORAGE",
            Linear {
                y: &no_storage,
                ..good
            },
            |e| matches!(e, Error::InvalidArgument(_)),
        ),
        ("y is x", Linear { y: &x, ..good }, |e| {
            matches!(e, Error::InvalidArgument(_))
        }),
        ("no rows", Linear { rows: 0, ..good }, |e| {
            matches!(e, Error::InvalidArgument(_))
        }),
        (
            "row offset overflows",
            Linear {
                y_row: usize::MAX,
                ..good
            },
            |e| matches!(e, Error::InvalidArgument(_)),
        ),
    ];
    for (what, linear, expected) in cases {
        let before = ctx.counters();
        let e = linear.prepare(&ctx).expect_err(what);
        assert!(expected(&e), "{what}: {e:?}");
        let mut encoder = ctx.encoder("refused");
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
            let e = linear.encode(&ctx, &mut pass).expect_err(what);
            assert!(expected(&e), "{what}: {e:?}");
        }
        drop(encoder);
        let e = linear.run(&ctx).expect_err(what);
        assert!(expected(&e), "{what}: {e:?}");
        let made = ctx.counters().since(&before);
        assert_eq!(made.buffers_created, 0, "{what}: {made:?}");
        assert_eq!(made.bind_groups_created, 0, "{what}: {made:?}");
        assert_eq!(made.submissions, 0, "{what}: {made:?}");
    }
    // The strided copy's encode form refuses the same way.
    let copy = StridedCopy {
        rows,
        heads: 1,
        n,
        src: RowStrides::dense(0, 1, n),
        dst: RowStrides::dense(0, 1, n),
    };
    let before = ctx.counters();
    for (dst, expected) in [
        (&small, "ShapeMismatch"),
        (&no_storage, "InvalidArgument"),
        (&y, "InvalidArgument"),
    ] {
        let mut encoder = ctx.encoder("refused");
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        let e = encode_strided_copy(&ctx, &mut pass, &copy, &y, dst).unwrap_err();
        assert!(format!("{e:?}").starts_with(expected), "{e:?}");
    }
    let made = ctx.counters().since(&before);
    assert_eq!(
        made.buffers_created + made.bind_groups_created,
        0,
        "{made:?}"
    );
    // Nothing was written.
    assert!(bits(&ctx, &y, rows * n)
        .iter()
        .all(|&b| b == UNWRITTEN_BITS));
}
