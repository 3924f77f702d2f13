//! The strided per-head matrix product (`kvattn::mla::head_matmul`) against its f64 CPU
//! reference: odd sizes, transposed weights, broadcast x and w, offsets, interleaved outputs
//! (untouched elements keep a NaN sentinel), the same result for a row whatever the batch
//! (every tile shape), outputs split over several bindings, and bad input.
//!
//! Tolerance: `1e-5 * sqrt(inner)` relative to the largest |value| of the output (at least 1):
//! an f32 dot product of `inner` terms accumulates about `sqrt(inner)` roundings of its scale.

use kvattn::gpu::Context;
use kvattn::mla::head_matmul::{head_matmul, HeadMatmul, RowStrides};
use kvattn::Error;

use crate::common::{gpu, gpu_capped, output_scale, Rng};

/// The sentinel untouched elements of y keep (a NaN with a payload).
const SENTINEL: u32 = 0x7fc0_1234;

/// Runs `spec` on the GPU over a y pre-filled with the sentinel and checks it against the
/// reference: written elements within the tolerance, every other element still the sentinel.
/// Returns y as read back.
fn run_and_check(
    ctx: &Context,
    what: &str,
    spec: &HeadMatmul,
    x: &[f32],
    w: &[f32],
    y_len: usize,
) -> Vec<f32> {
    let mut want = vec![f32::from_bits(SENTINEL); y_len];
    spec.reference(x, w, &mut want).unwrap();
    let xb = ctx.upload("x", x).unwrap();
    let wb = ctx.upload("w", w).unwrap();
    let yb = ctx.filled("y", y_len, f32::from_bits(SENTINEL)).unwrap();
    head_matmul(ctx, spec, &xb, &wb, &yb).unwrap_or_else(|e| panic!("{what}: {e}"));
    let got: Vec<f32> = ctx.read_back(&yb, y_len).unwrap();
    let written: Vec<f32> = want.iter().copied().filter(|v| !v.is_nan()).collect();
    assert_eq!(
        written.len(),
        spec.rows * spec.heads * spec.n_out,
        "{what}: the reference wrote NaN"
    );
    let tol = 1e-5 * (spec.inner as f64).sqrt() * output_scale(&written);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if w.is_nan() {
            assert_eq!(
                g.to_bits(),
                SENTINEL,
                "{what}: element {i} is not written by the product but changed to {g}"
            );
        } else {
            assert!(g.is_finite(), "{what}: element {i} = {g} (want {w})");
            let err = (f64::from(*g) - f64::from(*w)).abs();
            assert!(
                err <= tol,
                "{what}: element {i}: GPU {g} vs reference {w}, error {err:e} over {tol:e}"
            );
        }
    }
    got
}

/// Layouts the grid cycles through.
#[derive(Debug, Clone, Copy)]
enum Layout {
    /// Dense x `[rows, heads, inner]`, w `[heads, inner, n_out]`, y `[rows, heads, n_out]`.
    Dense,
    /// w stored transposed, `[heads, n_out, inner]` (`w_k = 1`, `w_n = inner`).
    Transposed,
    /// One x row for every head (`x.head = 0`), padded rows.
    BroadcastX,
    /// One weight for every head (`w_head = 0`).
    BroadcastW,
    /// Offsets everywhere, padded x, and y written into a sub-range of wider rows.
    Interleaved,
}

const LAYOUTS: [Layout; 5] = [
    Layout::Dense,
    Layout::Transposed,
    Layout::BroadcastX,
    Layout::BroadcastW,
    Layout::Interleaved,
];

/// The spec and the buffer lengths (x, w, y) of a layout.
fn spec_for(
    layout: Layout,
    rows: usize,
    heads: usize,
    inner: usize,
    n_out: usize,
) -> (HeadMatmul, usize, usize, usize) {
    let mut spec = HeadMatmul {
        rows,
        heads,
        inner,
        n_out,
        x: RowStrides::dense(0, heads, inner),
        w_head: inner * n_out,
        w_k: n_out,
        w_n: 1,
        y: RowStrides::dense(0, heads, n_out),
    };
    match layout {
        Layout::Dense => {}
        Layout::Transposed => {
            spec.w_k = 1;
            spec.w_n = inner;
        }
        Layout::BroadcastX => {
            spec.x = RowStrides {
                offset: 0,
                row: inner + 3,
                head: 0,
            };
        }
        Layout::BroadcastW => spec.w_head = 0,
        Layout::Interleaved => {
            spec.x = RowStrides {
                offset: 3,
                row: heads * (inner + 1) + 5,
                head: inner + 1,
            };
            spec.y = RowStrides {
                offset: 7,
                row: heads * (n_out + 9) + 11,
                head: n_out + 9,
            };
        }
    }
    let x_len = spec.x.offset + (rows - 1) * spec.x.row + (heads - 1) * spec.x.head + inner + 2;
    let w_len = (heads - 1) * spec.w_head + (inner - 1) * spec.w_k + (n_out - 1) * spec.w_n + 1;
    let y_len = spec.y.offset + rows * spec.y.row.max(heads * n_out) + 13;
    (spec, x_len, w_len, y_len)
}

#[test]
fn odd_sizes_and_layouts_match_the_reference() {
    let ctx = gpu();
    let mut rng = Rng::new(41);
    let mut case = 0;
    for rows in [1usize, 3, 17, 70] {
        for heads in [1usize, 3, 5] {
            for inner in [1usize, 7, 33, 130] {
                for n_out in [1usize, 5, 64, 131] {
                    let layout = LAYOUTS[case % LAYOUTS.len()];
                    case += 1;
                    let (spec, x_len, w_len, y_len) = spec_for(layout, rows, heads, inner, n_out);
                    let x = rng.normals(x_len, 1.0);
                    let w = rng.normals(w_len, 0.5);
                    let what =
                        format!("{layout:?} rows {rows} heads {heads} inner {inner} n_out {n_out}");
                    run_and_check(ctx, &what, &spec, &x, &w, y_len);
                }
            }
        }
    }
}

#[test]
fn every_layout_at_decode_and_prefill_sizes() {
    let ctx = gpu();
    let mut rng = Rng::new(43);
    for layout in LAYOUTS {
        for (rows, heads, inner, n_out) in [
            (1, 4, 128, 96),
            (2, 3, 40, 300),
            (9, 2, 64, 70),
            (65, 3, 48, 65),
        ] {
            let (spec, x_len, w_len, y_len) = spec_for(layout, rows, heads, inner, n_out);
            let x = rng.normals(x_len, 1.0);
            let w = rng.normals(w_len, 0.5);
            let what = format!("{layout:?} rows {rows} heads {heads} inner {inner} n_out {n_out}");
            run_and_check(ctx, &what, &spec, &x, &w, y_len);
        }
    }
}

/// A row's output is the same bits whatever the number of rows in the call (and so whatever
/// tile shape the host picks).
#[test]
fn a_row_does_not_depend_on_the_batch() {
    let ctx = gpu();
    let mut rng = Rng::new(47);
    let (heads, inner, n_out) = (3usize, 97usize, 75usize);
    let rows = 70;
    let (full, x_len, w_len, y_len) = spec_for(Layout::Dense, rows, heads, inner, n_out);
    let x = rng.normals(x_len, 1.0);
    let w = rng.normals(w_len, 0.5);
    let all = run_and_check(ctx, "all rows", &full, &x, &w, y_len);
    for (t0, n) in [
        (0usize, 1usize),
        (5, 1),
        (69, 1),
        (2, 3),
        (10, 4),
        (50, 6),
        (20, 9),
        (33, 16),
        (40, 17),
    ] {
        let spec = HeadMatmul {
            rows: n,
            x: RowStrides {
                offset: t0 * full.x.row,
                ..full.x
            },
            ..full
        };
        let got = run_and_check(
            ctx,
            &format!("rows {t0}..+{n}"),
            &spec,
            &x,
            &w,
            n * full.y.row,
        );
        let want = &all[t0 * full.y.row..(t0 + n) * full.y.row];
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "rows {t0}..+{n}: element {i}: {g} vs {w} in the full batch"
            );
        }
    }
}

/// With storage bindings capped at 64 KiB, x and y are bound in slices of rows over several
/// dispatches.
#[test]
fn outputs_larger_than_one_binding_are_split() {
    let ctx = gpu_capped();
    let mut rng = Rng::new(53);
    for layout in [Layout::Dense, Layout::Interleaved, Layout::BroadcastX] {
        let (spec, x_len, w_len, y_len) = spec_for(layout, 400, 4, 33, 40);
        assert!(y_len * 4 > 3 * 65536, "y spans several bindings");
        let x = rng.normals(x_len, 1.0);
        let w = rng.normals(w_len, 0.5);
        run_and_check(ctx, &format!("capped {layout:?}"), &spec, &x, &w, y_len);
    }
}

#[test]
fn bad_input_is_an_error_and_writes_nothing() {
    let ctx = gpu();
    let (spec, x_len, w_len, y_len) = spec_for(Layout::Dense, 5, 2, 8, 6);
    let x = ctx.upload("x", &vec![1f32; x_len]).unwrap();
    let w = ctx.upload("w", &vec![1f32; w_len]).unwrap();
    let y = ctx.filled("y", y_len, f32::from_bits(SENTINEL)).unwrap();
    let needed_x = spec.x.offset + 4 * spec.x.row + spec.x.head + 8;
    let short_x = ctx.upload("short x", &vec![1f32; needed_x - 1]).unwrap();
    let needed_w = w_len;
    let short_w = ctx.upload("short w", &vec![1f32; needed_w - 1]).unwrap();
    let short_y = ctx.filled("short y", 5 * 2 * 6 - 1, 0f32).unwrap();
    let check = |what: &str, r: kvattn::Result<()>, shape: bool| match r {
        Err(Error::ShapeMismatch { .. }) if shape => {}
        Err(Error::InvalidArgument(_)) if !shape => {}
        other => panic!("{what}: expected a typed error, got {other:?}"),
    };
    check(
        "x too small",
        head_matmul(ctx, &spec, &short_x, &w, &y),
        true,
    );
    check(
        "w too small",
        head_matmul(ctx, &spec, &x, &short_w, &y),
        true,
    );
    check(
        "y too small",
        head_matmul(ctx, &spec, &x, &w, &short_y),
        true,
    );
    for zero in 0..4 {
        let mut s = spec;
        match zero {
            0 => s.rows = 0,
            1 => s.heads = 0,
            2 => s.inner = 0,
            _ => s.n_out = 0,
        }
        check(
            &format!("zero dim {zero}"),
            head_matmul(ctx, &s, &x, &w, &y),
            false,
        );
    }
    check("y is x", head_matmul(ctx, &spec, &x, &w, &x), false);
    let overlapping = HeadMatmul {
        y: RowStrides {
            offset: 0,
            row: 6,
            head: 3,
        },
        ..spec
    };
    check(
        "overlapping y",
        head_matmul(ctx, &overlapping, &x, &w, &y),
        false,
    );
    let huge = HeadMatmul {
        x: RowStrides {
            offset: 0,
            row: 1 << 40,
            head: 8,
        },
        ..spec
    };
    check(
        "stride past u32",
        head_matmul(ctx, &huge, &x, &w, &y),
        false,
    );
    // The reference refuses short slices the same way.
    let mut out = vec![0f32; y_len];
    assert!(matches!(
        spec.reference(&vec![1f32; needed_x - 1], &vec![1f32; w_len], &mut out),
        Err(Error::ShapeMismatch { .. })
    ));
    let after: Vec<f32> = ctx.read_back(&y, y_len).unwrap();
    assert!(
        after.iter().all(|v| v.to_bits() == SENTINEL),
        "an error wrote to y"
    );
}
