//! The strided copy (`kvattn::mla::strided_copy`) against its CPU reference, bit for bit:
//! NaN payloads, -0.0, infinities and subnormals travel unchanged; untouched elements keep a
//! NaN sentinel; broadcast of one row to every head; grids past 65,535 workgroups; sources and
//! destinations bound in slices; bad input.

use kvattn::gpu::Context;
use kvattn::mla::head_matmul::RowStrides;
use kvattn::mla::strided_copy::{strided_copy, StridedCopy};
use kvattn::Error;

use crate::common::{gpu, gpu_capped, Rng};

/// The sentinel untouched elements of dst keep.
const SENTINEL: u32 = 0x7fc0_4321;

/// Source values with special bit patterns mixed in.
fn source(rng: &mut Rng, len: usize) -> Vec<f32> {
    let specials = [
        f32::from_bits(0x7fa0_0001), // signalling-pattern NaN with a payload
        f32::from_bits(0xffc0_beef), // negative quiet NaN with a payload
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(1), // smallest subnormal
        f32::from_bits(0x8000_0123),
    ];
    let mut v = rng.normals(len, 2.0);
    for (i, x) in v.iter_mut().enumerate() {
        if i % 11 == 3 {
            *x = specials[(i / 11) % specials.len()];
        }
    }
    v
}

fn run_and_check(ctx: &Context, what: &str, spec: &StridedCopy, src: &[f32], dst_len: usize) {
    let mut want = vec![f32::from_bits(SENTINEL); dst_len];
    spec.reference(src, &mut want).unwrap();
    let sb = ctx.upload("src", src).unwrap();
    let db = ctx
        .filled("dst", dst_len, f32::from_bits(SENTINEL))
        .unwrap();
    strided_copy(ctx, spec, &sb, &db).unwrap_or_else(|e| panic!("{what}: {e}"));
    let got: Vec<u32> = ctx.read_back(&db, dst_len).unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            *g,
            w.to_bits(),
            "{what}: element {i}: GPU {g:#010x} vs reference {:#010x}",
            w.to_bits()
        );
    }
}

/// The spec and the (src, dst) lengths of a case.
fn case(
    rows: usize,
    heads: usize,
    n: usize,
    broadcast: bool,
    padded: bool,
) -> (StridedCopy, usize, usize) {
    let src = if broadcast {
        RowStrides {
            offset: if padded { 5 } else { 0 },
            row: n + usize::from(padded) * 3,
            head: 0,
        }
    } else if padded {
        RowStrides {
            offset: 2,
            row: heads * (n + 2) + 1,
            head: n + 2,
        }
    } else {
        RowStrides::dense(0, heads, n)
    };
    let dst = if padded {
        // Writes columns 512.. of 576-wide rows, in the manner of MLA's q_pe placement.
        RowStrides {
            offset: 3 + n,
            row: heads * (2 * n + 1) + 7,
            head: 2 * n + 1,
        }
    } else {
        RowStrides::dense(0, heads, n)
    };
    let spec = StridedCopy {
        rows,
        heads,
        n,
        src,
        dst,
    };
    let src_len = src.offset + (rows - 1) * src.row + (heads - 1) * src.head + n;
    let dst_len = dst.offset + (rows - 1) * dst.row + (heads - 1) * dst.head + n + 9;
    (spec, src_len, dst_len)
}

#[test]
fn copies_bit_exact_over_a_grid_of_shapes() {
    let ctx = gpu();
    let mut rng = Rng::new(61);
    for rows in [1usize, 3, 17, 70] {
        for heads in [1usize, 3, 5] {
            for n in [1usize, 5, 64, 131] {
                for broadcast in [false, true] {
                    for padded in [false, true] {
                        let (spec, src_len, dst_len) = case(rows, heads, n, broadcast, padded);
                        let src = source(&mut rng, src_len);
                        let what = format!(
                            "rows {rows} heads {heads} n {n} broadcast {broadcast} padded {padded}"
                        );
                        run_and_check(ctx, &what, &spec, &src, dst_len);
                    }
                }
            }
        }
    }
}

/// 2^23 elements: 131,072 workgroups of 64, past the 65,535 of one grid dimension.
#[test]
fn grids_past_one_dimension() {
    let ctx = gpu();
    let mut rng = Rng::new(67);
    let (spec, src_len, dst_len) = case(4096, 32, 64, false, false);
    assert!(spec.rows * spec.heads * spec.n / 64 > 65_535);
    let src = source(&mut rng, src_len);
    run_and_check(ctx, "2^23 elements", &spec, &src, dst_len);
}

/// With storage bindings capped at 64 KiB, src and dst are bound in slices of rows.
#[test]
fn copies_larger_than_one_binding_are_split() {
    let ctx = gpu_capped();
    let mut rng = Rng::new(71);
    for (broadcast, padded) in [(false, false), (false, true), (true, true)] {
        let (spec, src_len, dst_len) = case(500, 3, 40, broadcast, padded);
        assert!(dst_len * 4 > 3 * 65536);
        let src = source(&mut rng, src_len);
        run_and_check(
            ctx,
            &format!("capped broadcast {broadcast} padded {padded}"),
            &spec,
            &src,
            dst_len,
        );
    }
}

#[test]
fn bad_input_is_an_error_and_writes_nothing() {
    let ctx = gpu();
    let (spec, src_len, dst_len) = case(4, 2, 8, false, true);
    let src = ctx.upload("src", &vec![1f32; src_len]).unwrap();
    let dst = ctx
        .filled("dst", dst_len, f32::from_bits(SENTINEL))
        .unwrap();
    let short_src = ctx.upload("short src", &vec![1f32; src_len - 1]).unwrap();
    let needed_dst = spec.dst.offset + 3 * spec.dst.row + spec.dst.head + 8;
    let short_dst = ctx.filled("short dst", needed_dst - 1, 0f32).unwrap();
    let check = |what: &str, r: kvattn::Result<()>, shape: bool| match r {
        Err(Error::ShapeMismatch { .. }) if shape => {}
        Err(Error::InvalidArgument(_)) if !shape => {}
        other => panic!("{what}: expected a typed error, got {other:?}"),
    };
    check(
        "src too small",
        strided_copy(ctx, &spec, &short_src, &dst),
        true,
    );
    check(
        "dst too small",
        strided_copy(ctx, &spec, &src, &short_dst),
        true,
    );
    for zero in 0..3 {
        let mut s = spec;
        match zero {
            0 => s.rows = 0,
            1 => s.heads = 0,
            _ => s.n = 0,
        }
        check(
            &format!("zero dim {zero}"),
            strided_copy(ctx, &s, &src, &dst),
            false,
        );
    }
    check("src is dst", strided_copy(ctx, &spec, &dst, &dst), false);
    let overlapping = StridedCopy {
        dst: RowStrides {
            offset: 0,
            row: 8,
            head: 4,
        },
        ..spec
    };
    check(
        "overlapping dst",
        strided_copy(ctx, &overlapping, &src, &dst),
        false,
    );
    let mut out = vec![0f32; dst_len];
    assert!(matches!(
        spec.reference(&vec![1f32; src_len - 1], &mut out),
        Err(Error::ShapeMismatch { .. })
    ));
    let after: Vec<u32> = ctx.read_back(&dst, dst_len).unwrap();
    assert!(
        after.iter().all(|&v| v == SENTINEL),
        "an error wrote to dst"
    );
}
