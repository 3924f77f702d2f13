//! The decoder's small kernels (`kvattn::decoder::ops`: rms_norm, swiglu, add, embed) against
//! their CPU references (`kvattn::reference::ops`) on odd sizes, with outputs pre-filled with a
//! NaN sentinel (a missing write shows; so does a write past the end, into the tail), element
//! counts past the 65,535-workgroup grid limit, buffers bound in slices (a context whose storage
//! bindings are capped at 64 KiB), extreme inputs, batch invariance and bad input.
//!
//! Tolerances:
//! - rms_norm: `2e-6` relative to each output (plus `f32::MIN_POSITIVE` absolute, for outputs
//!   an adapter may flush from subnormal to zero); the bound is derived in
//!   `kvattn::decoder::ops::rms_norm`'s docs.
//! - swiglu: see [`swiglu_bound`] (a few ulp, plus WGSL's allowance for `exp`).
//! - add, bias add and embed: bit for bit (one correctly rounded f32 addition; a copy).

use kvattn::decoder::ops::add::{
    add_in_place, encode_add, prepare_add, prepare_bias_add, AddArgs, BiasAddArgs,
};
use kvattn::decoder::ops::embed::{
    embed, embed_host_check, encode_embed, prepare_embed, EmbedArgs,
};
use kvattn::decoder::ops::rms_norm::{
    encode_rms_norm, prepare_rms_norm, rms_norm, tree_size, workgroup_size, RmsNormArgs,
    NARROW_WORKGROUP_SIZE, WORKGROUP_SIZE,
};
use kvattn::decoder::ops::swiglu::{encode_swiglu, prepare_swiglu, swiglu, SwigluArgs};
use kvattn::gpu::Context;
use kvattn::reference::ops as reference;
use kvattn::Error;

use crate::common::{gpu, gpu_capped, gpu_narrow, Rng};

/// Values of the NaN sentinel appended after every output.
const TAIL: usize = 7;

/// An output buffer of `len` values plus [`TAIL`], all NaN.
fn nan_out(ctx: &Context, len: usize) -> wgpu::Buffer {
    ctx.filled("out", len + TAIL, f32::NAN).unwrap()
}

/// Reads `len` values plus the tail back and checks that the tail is still NaN.
fn read(ctx: &Context, what: &str, buffer: &wgpu::Buffer, len: usize) -> Vec<f32> {
    let mut v: Vec<f32> = ctx.read_back(buffer, len + TAIL).unwrap();
    assert!(
        v[len..].iter().all(|x| x.is_nan()),
        "{what}: wrote past the end of the output"
    );
    v.truncate(len);
    v
}

/// A buffer without STORAGE usage.
fn uniform_buffer(ctx: &Context) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("not storage"),
        size: 1 << 16,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

fn assert_invalid<T: std::fmt::Debug>(what: &str, r: kvattn::Result<T>) {
    match r {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

fn assert_shape<T: std::fmt::Debug>(what: &str, r: kvattn::Result<T>) {
    match r {
        Err(Error::ShapeMismatch { .. }) => {}
        other => panic!("{what}: expected ShapeMismatch, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// rms_norm

/// Relative tolerance of rms_norm against the f64 reference.
const RMS_REL: f64 = 2e-6;

/// Runs rms_norm on the GPU and returns the output (checked for a NaN-free body and an
/// untouched tail).
fn run_rms(ctx: &Context, x: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32) -> Vec<f32> {
    let xb = ctx.upload("x", x).unwrap();
    let wb = ctx.upload("weight", w).unwrap();
    let out = nan_out(ctx, rows * dim);
    rms_norm(ctx, rows, dim, eps, &xb, &wb, &out).unwrap();
    read(ctx, "rms_norm", &out, rows * dim)
}

/// Checks `got` against the reference; returns the worst relative error.
fn check_rms(
    what: &str,
    got: &[f32],
    x: &[f32],
    w: &[f32],
    rows: usize,
    dim: usize,
    eps: f32,
) -> f64 {
    let want = reference::rms_norm(x, w, rows, dim, eps).unwrap();
    let mut worst: f64 = 0.0;
    for (i, (&g, &r)) in got.iter().zip(&want).enumerate() {
        assert!(!g.is_nan(), "{what}: NaN at {i} (reference {r})");
        let err = (f64::from(g) - f64::from(r)).abs();
        let bound = RMS_REL * f64::from(r.abs()) + f64::from(f32::MIN_POSITIVE);
        assert!(
            err <= bound,
            "{what}: element {i} (row {}, col {}): GPU {g:e} vs reference {r:e}",
            i / dim,
            i % dim
        );
        if r != 0.0 {
            worst = worst.max(err / f64::from(r.abs()));
        }
    }
    worst
}

/// Llama-like weights around 1, and rows whose scales vary over twelve orders of magnitude.
fn rms_inputs(rng: &mut Rng, rows: usize, dim: usize) -> (Vec<f32>, Vec<f32>) {
    let w: Vec<f32> = rng.normals(dim, 0.2).iter().map(|v| 1.0 + v).collect();
    let mut x = Vec::with_capacity(rows * dim);
    for r in 0..rows {
        let scale = 10f32.powi((r % 13) as i32 - 6);
        x.extend(rng.normals(dim, scale));
    }
    (x, w)
}

#[test]
fn rms_norm_workgroup_fits_the_device() {
    // The invocations per workgroup come from the device's limit, not a constant.
    let ctx = gpu();
    let wg = workgroup_size(ctx);
    let limit = ctx.caps().max_compute_invocations_per_workgroup;
    assert!(
        wg.is_power_of_two() && wg <= limit && wg <= WORKGROUP_SIZE,
        "{wg} for {limit}"
    );
    assert!(
        wg * 2 > limit.min(WORKGROUP_SIZE),
        "{wg}: the largest that fits {limit}"
    );
}

/// Narrow workgroups (8 invocations taking 32 partial sums each) give the bits of the wide
/// ones, on rows of every scale.
#[test]
fn rms_norm_narrow_workgroups_give_the_wide_bits() {
    let (wide, narrow) = (gpu(), gpu_narrow());
    assert_eq!(workgroup_size(narrow), NARROW_WORKGROUP_SIZE);
    assert!(workgroup_size(wide) > NARROW_WORKGROUP_SIZE);
    assert_eq!(tree_size(narrow), tree_size(wide));
    let mut rng = Rng::new(105);
    for (rows, dim) in [(13usize, 1usize), (13, 5), (13, 576), (7, 4099), (3, 8192)] {
        let (mut x, w) = rms_inputs(&mut rng, rows, dim);
        x[..dim].fill(3e38);
        let a = run_rms(wide, &x, &w, rows, dim, 1e-5);
        let b = run_rms(narrow, &x, &w, rows, dim, 1e-5);
        let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(same, "rows {rows} dim {dim}: narrow bits differ from wide");
    }
}

#[test]
fn rms_norm_matches_reference_over_shapes() {
    let mut rng = Rng::new(101);
    for ctx in [gpu(), gpu_narrow()] {
        let wg = workgroup_size(ctx);
        let mut worst: f64 = 0.0;
        for rows in [1usize, 3, 70] {
            for dim in [1usize, 5, 64, 576, 1536, 4099, 8192] {
                let (x, w) = rms_inputs(&mut rng, rows, dim);
                for eps in [1e-5f32, 1e-6, 0.0] {
                    let what = format!("rms_norm wg {wg} rows {rows} dim {dim} eps {eps}");
                    let got = run_rms(ctx, &x, &w, rows, dim, eps);
                    worst = worst.max(check_rms(&what, &got, &x, &w, rows, dim, eps));
                }
            }
        }
        eprintln!("rms_norm wg {wg}: worst relative error {worst:e} (bound {RMS_REL:e})");
    }
}

#[test]
fn rms_norm_zero_huge_and_tiny_rows() {
    for ctx in [gpu(), gpu_narrow()] {
        zero_huge_and_tiny_rows(ctx);
    }
}

fn zero_huge_and_tiny_rows(ctx: &Context) {
    let mut rng = Rng::new(102);
    for dim in [1usize, 5, 576, 4099, 8192] {
        let w: Vec<f32> = rng.normals(dim, 0.2).iter().map(|v| 1.0 + v).collect();
        let mut x = vec![0.0f32; dim]; // a row of zeros
        x.extend(rng.normals(dim, 1e18)); // squares of 1e36 would overflow an f32 sum
        x.extend(vec![3e38f32; dim]); // the largest magnitudes
        x.extend(rng.normals(dim, f32::MAX / 8.0));
        x.extend(rng.normals(dim, 1e-30)); // eps dominates
        x.extend(rng.normals(dim, 1e-20));
        x.push(1e18); // one large value among small ones
        x.extend(rng.normals(dim - 1, 1.0));
        let rows = x.len() / dim;
        for eps in [1e-5f32, 0.0, 1e-30, 3.0e38] {
            let what = format!("extreme rows dim {dim} eps {eps}");
            let got = run_rms(ctx, &x, &w, rows, dim, eps);
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{what}: non-finite output"
            );
            assert!(got[..dim].iter().all(|&v| v == 0.0), "{what}: zero row");
            check_rms(&what, &got, &x, &w, rows, dim, eps);
        }
    }
}

#[test]
fn rms_norm_is_batch_invariant() {
    // The capped context binds the rows in slices from other offsets (wide workgroups).
    for (ctx, capped) in [(gpu(), Some(gpu_capped())), (gpu_narrow(), None)] {
        batch_invariance(ctx, capped);
    }
}

fn batch_invariance(ctx: &Context, capped: Option<&Context>) {
    let wg = workgroup_size(ctx);
    let mut rng = Rng::new(103);
    for dim in [576usize, 4099] {
        let rows = 70;
        let (x, w) = rms_inputs(&mut rng, rows, dim);
        let batch = run_rms(ctx, &x, &w, rows, dim, 1e-5);
        let sliced = capped.map(|c| run_rms(c, &x, &w, rows, dim, 1e-5));
        for r in [0usize, 1, 33, 69] {
            let row = &x[r * dim..(r + 1) * dim];
            let alone = run_rms(ctx, row, &w, 1, dim, 1e-5);
            // A row inside a 3-row batch at a different position.
            let mut three = rng.normals(dim, 3.0);
            three.extend_from_slice(row);
            three.extend(rng.normals(dim, 0.01));
            let mid = run_rms(ctx, &three, &w, 3, dim, 1e-5);
            let mut others = vec![
                ("alone", &alone[..]),
                ("in a 3-row batch", &mid[dim..2 * dim]),
            ];
            if let Some(sliced) = &sliced {
                others.push(("bound in slices", &sliced[r * dim..(r + 1) * dim]));
            }
            for (name, other) in others {
                let same = other
                    .iter()
                    .zip(&batch[r * dim..(r + 1) * dim])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "wg {wg} dim {dim} row {r}: {name} differs from the 70-row batch"
                );
            }
        }
    }
}

#[test]
fn rms_norm_in_slices_matches_reference() {
    // 64 KiB bindings: 16,320 values per slice, so 70 rows of 4099 span 18 slices.
    let ctx = gpu_capped();
    let mut rng = Rng::new(104);
    for (rows, dim) in [(70usize, 4099usize), (300, 576), (5, 16000)] {
        let (x, w) = rms_inputs(&mut rng, rows, dim);
        let got = run_rms(ctx, &x, &w, rows, dim, 1e-6);
        check_rms(
            &format!("sliced rows {rows} dim {dim}"),
            &got,
            &x,
            &w,
            rows,
            dim,
            1e-6,
        );
    }
}

#[test]
fn rms_norm_rejects_bad_input() {
    let ctx = gpu();
    let x = ctx.upload("x", &[1.0f32; 64]).unwrap();
    let w = ctx.upload("w", &[1.0f32; 16]).unwrap();
    let out = nan_out(ctx, 64);
    let plain = uniform_buffer(ctx);
    assert_invalid("rows 0", rms_norm(ctx, 0, 16, 1e-5, &x, &w, &out));
    assert_invalid("dim 0", rms_norm(ctx, 4, 0, 1e-5, &x, &w, &out));
    // Subnormal eps too: a driver that flushes subnormals would see 0.
    for eps in [
        -1e-6f32,
        f32::NAN,
        f32::INFINITY,
        -0.5,
        1e-40,
        f32::from_bits(1),
    ] {
        assert_invalid("eps", rms_norm(ctx, 4, 16, eps, &x, &w, &out));
        assert!(reference::rms_norm(&[1.0; 64], &[1.0; 16], 4, 16, eps).is_err());
    }
    assert_invalid("huge dim", rms_norm(ctx, 1, 1 << 33, 1e-5, &x, &w, &out));
    assert_invalid(
        "overflow",
        rms_norm(ctx, usize::MAX / 2, 4, 1e-5, &x, &w, &out),
    );
    assert_shape("x too small", rms_norm(ctx, 5, 16, 1e-5, &x, &w, &out));
    assert_shape("weight too small", rms_norm(ctx, 2, 32, 1e-5, &x, &w, &out));
    let small = nan_out(ctx, 40);
    assert_shape("out too small", rms_norm(ctx, 4, 16, 1e-5, &x, &w, &small));
    assert_invalid("out is x", rms_norm(ctx, 4, 16, 1e-5, &x, &w, &x));
    assert_invalid("out is weight", rms_norm(ctx, 1, 16, 1e-5, &x, &w, &w));
    assert_invalid("no STORAGE", rms_norm(ctx, 4, 16, 1e-5, &plain, &w, &out));
    assert_invalid("no STORAGE out", rms_norm(ctx, 4, 16, 1e-5, &x, &w, &plain));
    // A row wider than one (capped, 64 KiB) binding.
    let c = gpu_capped();
    let big = c.filled("big", 20000, 1.0f32).unwrap();
    let bw = c.filled("bw", 20000, 1.0f32).unwrap();
    let bo = c.filled("bo", 20000, f32::NAN).unwrap();
    match rms_norm(c, 1, 20000, 1e-5, &big, &bw, &bo) {
        Err(Error::TooLarge { .. }) => {}
        other => panic!("row over a binding: expected TooLarge, got {other:?}"),
    }
    // Nothing was written by any of the refused calls.
    assert!(read(ctx, "refused", &out, 64).iter().all(|v| v.is_nan()));
    let bo: Vec<f32> = c.read_back(&bo, 20000).unwrap();
    assert!(bo.iter().all(|v| v.is_nan()));
}

// ---------------------------------------------------------------------------------------------
// swiglu

/// Largest allowed |GPU - reference| for gate `g`, up `u` and reference output `want`.
///
/// The kernel computes `e = exp(-|g|)`, `s = (g >= 0 ? 1 : e) / (1 + e)` and `g * s * u`.
/// WGSL allows `exp(x)` an error of `3 + 2|x|` ulp and division 2.5 ulp; `1 + e`, the two
/// products and the reference's own rounding add 0.5 ulp each. For `g < 0` the relative error
/// of `e` passes to `s` scaled by `1 / (1 + e) <= 1`; for `g >= 0` by `e / (1 + e) <= e`,
/// which vanishes for large gates (where the result is exactly `g * u`). Sum, in units of
/// 2^-23 relative (an ulp at the bottom of a binade): `2.5 + 4 * 0.5 + exp's share`. Absolute
/// terms cover values an adapter may flush from subnormal to zero: an `e` below the normal range
/// (the output is then at most `|g| * e * |u|`), and a subnormal output (below
/// `f32::MIN_POSITIVE`).
fn swiglu_bound(g: f32, u: f32, want: f32) -> f64 {
    let g64 = f64::from(g);
    let e = (-g64.abs()).exp();
    let exp_ulps = 3.0 + 2.0 * g64.abs();
    let exp_share = if g < 0.0 { exp_ulps } else { exp_ulps * e };
    let ulps = 4.5 + exp_share;
    let min_normal = f64::from(f32::MIN_POSITIVE);
    let flushed_e = if e < min_normal {
        g64.abs() * e * f64::from(u.abs())
    } else {
        0.0
    };
    f64::from(want.abs()) * ulps * 2f64.powi(-23) + flushed_e + min_normal
}

/// Runs swiglu and checks every element against the reference and [`swiglu_bound`]; returns
/// the worst error in ulp-units (error / (|want| * 2^-23)).
fn check_swiglu(ctx: &Context, what: &str, gate: &[f32], up: &[f32]) -> f64 {
    let n = gate.len();
    let gb = ctx.upload("gate", gate).unwrap();
    let ub = ctx.upload("up", up).unwrap();
    let out = nan_out(ctx, n);
    swiglu(ctx, n, &gb, &ub, &out).unwrap();
    let got = read(ctx, what, &out, n);
    let want = reference::swiglu(gate, up).unwrap();
    let mut worst: f64 = 0.0;
    for i in 0..n {
        let (g, w) = (got[i], want[i]);
        assert!(
            !g.is_nan(),
            "{what}: NaN at {i} (gate {}, up {})",
            gate[i],
            up[i]
        );
        // Equal values (infinities from gate * up overflowing included) are no error.
        let err = if g == w {
            0.0
        } else {
            (f64::from(g) - f64::from(w)).abs()
        };
        assert!(
            err <= swiglu_bound(gate[i], up[i], w),
            "{what}: element {i} (gate {:e}, up {:e}): GPU {g:e} vs reference {w:e}",
            gate[i],
            up[i]
        );
        if w != 0.0 {
            worst = worst.max(err / (f64::from(w.abs()) * 2f64.powi(-23)));
        }
    }
    worst
}

#[test]
fn swiglu_matches_reference_over_sizes() {
    let ctx = gpu();
    let mut rng = Rng::new(201);
    let mut worst: f64 = 0.0;
    // 4,194,365 elements: 65,537 workgroups of 64, past the 65,535 of one grid dimension.
    for n in [1usize, 5, 64, 576, 1536, 4099, 1_000_003, 65_537 * 64 - 3] {
        let gate = rng.normals(n, 4.0);
        let up = rng.normals(n, 2.0);
        worst = worst.max(check_swiglu(ctx, &format!("swiglu n {n}"), &gate, &up));
    }
    eprintln!("swiglu: worst error {worst:.2} ulp-units");
}

#[test]
fn swiglu_extreme_gates() {
    let ctx = gpu();
    let gates = [
        100.0f32, -100.0, 1e4, -1e4, 88.7, -88.7, 88.8, -88.8, 89.0, -89.0, 103.0, -103.0, 17.0,
        -17.0, 0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, 3e38, -3e38, 20.5, -20.5, 40.0, -40.0,
    ];
    let ups = [1.0f32, -3.0, 0.5, 1e-3, 7.0];
    let mut gate = Vec::new();
    let mut up = Vec::new();
    for &g in &gates {
        for &u in &ups {
            gate.push(g);
            up.push(u);
        }
    }
    check_swiglu(ctx, "extreme gates", &gate, &up);
    let gb = ctx.upload("gate", &gate).unwrap();
    let ub = ctx.upload("up", &up).unwrap();
    let out = nan_out(ctx, gate.len());
    swiglu(ctx, gate.len(), &gb, &ub, &out).unwrap();
    let got = read(ctx, "extreme gates", &out, gate.len());
    for i in 0..gate.len() {
        let (g, u, r) = (gate[i], up[i], got[i]);
        assert!(!r.is_nan(), "gate {g} up {u}: NaN");
        if g >= 20.0 {
            // exp(-g) < 2^-28: the sigmoid rounds to 1, so the result is exactly g * u (or its
            // overflow, for 3e38 * 7).
            assert_eq!(r, g * u, "gate {g} up {u}");
        }
        if g <= -100.0 {
            // -0 (exp underflowed) or a value far below the normal range.
            assert!(r.abs() <= 1e-40 * u.abs(), "gate {g} up {u}: {r:e}");
        }
    }
}

#[test]
fn swiglu_gate_and_up_may_be_one_buffer_and_slices_match() {
    let mut rng = Rng::new(202);
    let n = 50_001;
    let gate = rng.normals(n, 3.0);
    let ctx = gpu();
    let gb = ctx.upload("gate", &gate).unwrap();
    let out = nan_out(ctx, n);
    swiglu(ctx, n, &gb, &gb, &out).unwrap();
    let same = read(ctx, "gate = up", &out, n);
    let want = reference::swiglu(&gate, &gate).unwrap();
    for i in 0..n {
        let err = (f64::from(same[i]) - f64::from(want[i])).abs();
        assert!(
            err <= swiglu_bound(gate[i], gate[i], want[i]),
            "gate = up: element {i}"
        );
    }
    // Bound in slices of 64 KiB (16 of them here): the same bits.
    let c = gpu_capped();
    let gc = c.upload("gate", &gate).unwrap();
    let oc = nan_out(c, n);
    swiglu(c, n, &gc, &gc, &oc).unwrap();
    let sliced = read(c, "gate = up, sliced", &oc, n);
    assert!(
        sliced
            .iter()
            .zip(&same)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "slices differ"
    );
}

#[test]
fn swiglu_rejects_bad_input() {
    let ctx = gpu();
    let g = ctx.upload("g", &[1.0f32; 64]).unwrap();
    let u = ctx.upload("u", &[1.0f32; 64]).unwrap();
    let out = nan_out(ctx, 64);
    let plain = uniform_buffer(ctx);
    assert_invalid("n 0", swiglu(ctx, 0, &g, &u, &out));
    assert_invalid("n over u32", swiglu(ctx, 1 << 33, &g, &u, &out));
    assert_shape("gate too small", swiglu(ctx, 65, &g, &u, &out));
    let small = ctx.upload("small", &[1.0f32; 32]).unwrap();
    assert_shape("up too small", swiglu(ctx, 64, &g, &small, &out));
    assert_shape("out too small", swiglu(ctx, 64, &g, &u, &small));
    assert_invalid("out is gate", swiglu(ctx, 64, &g, &u, &g));
    assert_invalid("out is up", swiglu(ctx, 64, &g, &u, &u));
    assert_invalid("no STORAGE", swiglu(ctx, 64, &plain, &u, &out));
    assert!(read(ctx, "refused", &out, 64).iter().all(|v| v.is_nan()));
}

// ---------------------------------------------------------------------------------------------
// add

fn check_add(ctx: &Context, what: &str, x: &[f32], y: &[f32]) {
    let n = x.len();
    let mut padded = x.to_vec();
    padded.extend([f32::NAN; TAIL]);
    let xb = ctx.upload("x", &padded).unwrap();
    let yb = ctx.upload("y", y).unwrap();
    add_in_place(ctx, n, &xb, &yb).unwrap();
    let got = read(ctx, what, &xb, n);
    let want = reference::add(x, y).unwrap();
    for i in 0..n {
        assert_eq!(
            got[i].to_bits(),
            want[i].to_bits(),
            "{what}: element {i}: {} + {}: GPU {} vs {}",
            x[i],
            y[i],
            got[i],
            want[i]
        );
    }
}

#[test]
fn add_is_exact_over_sizes() {
    let mut rng = Rng::new(301);
    // 4,194,365 elements: 65,537 workgroups of 64, past the 65,535 of one grid dimension.
    for n in [1usize, 5, 64, 576, 1536, 4099, 1_000_003, 65_537 * 64 - 3] {
        let x = rng.normals(n, 3.0);
        let y: Vec<f32> = (0..n)
            .map(|i| rng.normal() * 10f32.powi((i % 9) as i32 - 4))
            .collect();
        check_add(gpu(), &format!("add n {n}"), &x, &y);
    }
    // Slices of 64 KiB bindings.
    let x = rng.normals(100_003, 1.0);
    let y = rng.normals(100_003, 1.0);
    check_add(gpu_capped(), "add in slices", &x, &y);
    // Cancellation, signed zeros, infinities.
    let x = [1.0f32, -0.0, 0.0, f32::INFINITY, 3e38, -1.5, 1e-3];
    let y = [-1.0f32, -0.0, -0.0, 1.0, 3e38, 1.5, 1e7];
    check_add(gpu(), "specials", &x, &y);
}

#[test]
fn add_rejects_bad_input() {
    let ctx = gpu();
    let x = ctx.filled("x", 64, f32::NAN).unwrap();
    let y = ctx.upload("y", &[1.0f32; 64]).unwrap();
    let plain = uniform_buffer(ctx);
    assert_invalid("n 0", add_in_place(ctx, 0, &x, &y));
    assert_invalid("n over u32", add_in_place(ctx, 1 << 33, &x, &y));
    assert_shape("x too small", add_in_place(ctx, 65, &x, &y));
    let small = ctx.upload("small", &[1.0f32; 32]).unwrap();
    assert_shape("y too small", add_in_place(ctx, 64, &x, &small));
    assert_invalid("x is y", add_in_place(ctx, 64, &x, &x));
    assert_invalid("no STORAGE", add_in_place(ctx, 64, &x, &plain));
    let xs: Vec<f32> = ctx.read_back(&x, 64).unwrap();
    assert!(xs.iter().all(|v| v.is_nan()), "a refused call wrote");
}

// ---------------------------------------------------------------------------------------------
// bias add

/// Runs the bias add over `x` (rows of `bias.len()`) with a NaN tail after `x`.
fn run_bias_add(ctx: &Context, x: &[f32], bias: &[f32]) -> Vec<f32> {
    let mut padded = x.to_vec();
    padded.extend([f32::NAN; TAIL]);
    let xb = ctx.upload("x", &padded).unwrap();
    let bb = ctx.upload("bias", bias).unwrap();
    let args = BiasAddArgs {
        rows: x.len() / bias.len(),
        dim: bias.len(),
        x: &xb,
        bias: &bb,
    };
    let op = prepare_bias_add(ctx, &args).unwrap();
    ctx.run_pass("bias add", |pass| {
        op.encode(pass);
        Ok(())
    })
    .unwrap();
    read(ctx, "bias add", &xb, x.len())
}

#[test]
fn bias_add_is_exact_over_shapes_and_slices() {
    let mut rng = Rng::new(307);
    // Small rows, the qwen2 test model's Q and K/V widths, and 100,307 values in 64 KiB
    // slices (a slice starts mid-row: its first bias index is not 0).
    for (ctx, rows, dim) in [
        (gpu(), 1, 1),
        (gpu(), 3, 5),
        (gpu(), 13, 72),
        (gpu(), 13, 24),
        (gpu_capped(), 2711, 37),
    ] {
        let x = rng.normals(rows * dim, 3.0);
        let bias = rng.normals(dim, 0.5);
        let got = run_bias_add(ctx, &x, &bias);
        let want = reference::bias_add(&x, &bias).unwrap();
        for i in 0..x.len() {
            assert_eq!(
                got[i].to_bits(),
                want[i].to_bits(),
                "{rows} x {dim}, element {i}: GPU {} vs {}",
                got[i],
                want[i]
            );
        }
    }
    // NaN propagates from either side (its payload is the adapter's).
    let got = run_bias_add(gpu(), &[f32::NAN, 1.0, 2.0, 3.0], &[0.5, f32::NAN]);
    assert!(
        got[0].is_nan() && got[1].is_nan() && got[3].is_nan(),
        "{got:?}"
    );
    assert_eq!(got[2], 2.5);
}

#[test]
fn bias_add_rejects_bad_input() {
    let ctx = gpu();
    let x = ctx.filled("x", 64, f32::NAN).unwrap();
    let bias = ctx.upload("bias", &[1.0f32; 16]).unwrap();
    let plain = uniform_buffer(ctx);
    let args = |rows, dim, x, bias| BiasAddArgs { rows, dim, x, bias };
    assert_invalid("rows 0", prepare_bias_add(ctx, &args(0, 16, &x, &bias)));
    assert_invalid("dim 0", prepare_bias_add(ctx, &args(4, 0, &x, &bias)));
    assert_invalid(
        "over u32",
        prepare_bias_add(ctx, &args(1 << 20, 1 << 13, &x, &bias)),
    );
    assert_shape(
        "x too small",
        prepare_bias_add(ctx, &args(5, 16, &x, &bias)),
    );
    assert_shape(
        "bias too small",
        prepare_bias_add(ctx, &args(2, 32, &x, &bias)),
    );
    assert_invalid("x is bias", prepare_bias_add(ctx, &args(4, 16, &x, &x)));
    assert_invalid(
        "no STORAGE",
        prepare_bias_add(ctx, &args(4, 16, &x, &plain)),
    );
    let xs: Vec<f32> = ctx.read_back(&x, 64).unwrap();
    assert!(xs.iter().all(|v| v.is_nan()), "a refused call wrote");
}

// ---------------------------------------------------------------------------------------------
// embed

/// A table with special bit patterns mixed in (they must travel unchanged).
fn table(rng: &mut Rng, len: usize) -> Vec<f32> {
    let specials = [
        f32::from_bits(0x7fa0_0001),
        f32::from_bits(0xffc0_beef),
        -0.0,
        f32::INFINITY,
        f32::from_bits(0x8000_0123),
    ];
    let mut v = rng.normals(len, 1.0);
    for (i, x) in v.iter_mut().enumerate() {
        if i % 13 == 5 {
            *x = specials[(i / 13) % specials.len()];
        }
    }
    v
}

fn check_embed(ctx: &Context, what: &str, ids: &[u32], tab: &[f32], dim: usize) {
    let vocab = tab.len() / dim;
    let n = ids.len() * dim;
    let tokens = ctx.upload("tokens", ids).unwrap();
    let tb = ctx.upload("table", tab).unwrap();
    let out = nan_out(ctx, n);
    embed(ctx, &tokens, ids.len(), dim, vocab, &tb, &out).unwrap();
    let got: Vec<u32> = ctx.read_back(&out, n + TAIL).unwrap();
    assert!(
        got[n..].iter().all(|&b| f32::from_bits(b).is_nan()),
        "{what}: wrote past the end"
    );
    let want = reference::embed(ids, tab, dim).unwrap();
    for i in 0..n {
        assert_eq!(
            got[i],
            want[i].to_bits(),
            "{what}: token {} (id {}) element {}",
            i / dim,
            ids[i / dim],
            i % dim
        );
    }
}

#[test]
fn embed_gathers_bit_exact() {
    let ctx = gpu();
    let mut rng = Rng::new(401);
    for vocab in [1usize, 7, 1000] {
        for dim in [1usize, 5, 64, 576, 4099] {
            let tab = table(&mut rng, vocab * dim);
            for n_tokens in [1usize, 3, 70] {
                let mut ids: Vec<u32> = (0..n_tokens)
                    .map(|_| (rng.next_u64() % vocab as u64) as u32)
                    .collect();
                if n_tokens > 1 {
                    // Out-of-range ids get zero rows.
                    ids[n_tokens / 2] = vocab as u32;
                    ids[n_tokens - 1] = u32::MAX;
                }
                let what = format!("embed vocab {vocab} dim {dim} tokens {n_tokens}");
                check_embed(ctx, &what, &ids, &tab, dim);
            }
        }
    }
}

#[test]
fn embed_table_and_output_in_slices() {
    // 64 KiB bindings: a 300 x 576 table spans 11 slices, 70 output rows 3 slices.
    let ctx = gpu_capped();
    let mut rng = Rng::new(402);
    for (vocab, dim, n_tokens) in [
        (300usize, 576usize, 70usize),
        (5000, 64, 1000),
        (40, 4099, 9),
    ] {
        let tab = table(&mut rng, vocab * dim);
        let mut ids: Vec<u32> = (0..n_tokens)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect();
        ids[0] = (vocab - 1) as u32;
        ids[n_tokens - 1] = vocab as u32 + 3;
        check_embed(
            ctx,
            &format!("sliced embed {vocab} x {dim}"),
            &ids,
            &tab,
            dim,
        );
    }
}

#[test]
fn embed_rejects_bad_input() {
    assert!(embed_host_check(&[0, 5, 9], 10).is_ok());
    assert_invalid("id = vocab", embed_host_check(&[0, 10, 3], 10));
    assert_invalid("id u32::MAX", embed_host_check(&[u32::MAX], 10));
    assert_invalid("vocab 0", embed_host_check(&[], 0));
    assert!(embed_host_check(&[], 1).is_ok());

    let ctx = gpu();
    let tokens = ctx.upload("tokens", &[0u32, 1, 2, 3]).unwrap();
    let tab = ctx.upload("table", &[1.0f32; 40]).unwrap();
    let out = nan_out(ctx, 40);
    let plain = uniform_buffer(ctx);
    assert_invalid("n_tokens 0", embed(ctx, &tokens, 0, 10, 4, &tab, &out));
    assert_invalid("dim 0", embed(ctx, &tokens, 4, 0, 4, &tab, &out));
    assert_invalid("vocab 0", embed(ctx, &tokens, 4, 10, 0, &tab, &out));
    assert_invalid(
        "vocab over u32",
        embed(ctx, &tokens, 4, 1, 1 << 33, &tab, &out),
    );
    assert_invalid(
        "overflow",
        embed(ctx, &tokens, 4, usize::MAX / 2, 4, &tab, &out),
    );
    assert_shape("tokens too small", embed(ctx, &tokens, 5, 8, 4, &tab, &out));
    assert_shape("table too small", embed(ctx, &tokens, 4, 10, 5, &tab, &out));
    assert_shape("out too small", embed(ctx, &tokens, 4, 12, 3, &tab, &out));
    assert_invalid("out is table", embed(ctx, &tokens, 4, 10, 4, &tab, &tab));
    assert_invalid("out is tokens", embed(ctx, &tokens, 1, 1, 4, &tab, &tokens));
    assert_invalid("no STORAGE", embed(ctx, &plain, 4, 10, 4, &tab, &out));
    assert!(read(ctx, "refused", &out, 40).iter().all(|v| v.is_nan()));
}

// ---------------------------------------------------------------------------------------------
// prepared and encode forms

/// Submits what `f` records into one compute pass of a caller's encoder.
fn in_one_pass(ctx: &Context, f: impl FnOnce(&mut wgpu::ComputePass<'_>)) {
    let mut encoder = ctx.encoder("caller's encoder");
    {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        f(&mut pass);
    }
    ctx.submit("caller's step", encoder).unwrap();
}

/// The bits of the first `len` values of `buffer`.
fn bits(ctx: &Context, buffer: &wgpu::Buffer, len: usize) -> Vec<u32> {
    ctx.read_back(buffer, len).unwrap()
}

/// Every op through its plain function, then through `encode_*` (all four in one pass of the
/// caller's encoder), then through `prepare_*` recorded twice with new token ids written in
/// between: the same bits each way, on whole and sliced (64 KiB) bindings. Recording a prepared
/// op again creates no buffer and no bind group (a context of its own, so that other tests'
/// work does not count).
#[test]
fn prepared_and_encoded_ops_give_the_plain_functions_bits() {
    let own = Context::new().unwrap();
    for (name, ctx) in [("whole", &own), ("sliced", gpu_capped())] {
        let mut rng = Rng::new(501);
        let (rows, dim, vocab) = (37usize, 576usize, 300usize);
        let n = rows * dim;
        let ids: Vec<u32> = (0..rows)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect();
        let ids2: Vec<u32> = ids.iter().rev().map(|&i| (i + 7) % vocab as u32).collect();
        let tab = table(&mut rng, vocab * dim);
        let (tokens, tb) = (
            ctx.upload("tokens", &ids).unwrap(),
            ctx.upload("table", &tab).unwrap(),
        );
        let weight = ctx.upload("weight", &rng.normals(dim, 1.0)).unwrap();
        let gate = ctx.upload("gate", &rng.normals(n, 4.0)).unwrap();
        let up = ctx.upload("up", &rng.normals(n, 1.0)).unwrap();
        let y = ctx.upload("y", &rng.normals(n, 1.0)).unwrap();
        let outs = || -> [wgpu::Buffer; 4] { [(); 4].map(|()| nan_out(ctx, n)) };
        // Plain functions.
        let [e0, r0, s0, a0] = outs();
        embed(ctx, &tokens, rows, dim, vocab, &tb, &e0).unwrap();
        rms_norm(ctx, rows, dim, 1e-5, &e0, &weight, &r0).unwrap();
        swiglu(ctx, n, &gate, &up, &s0).unwrap();
        // The sum starts as a copy of the embedding (x += y in place).
        embed(ctx, &tokens, rows, dim, vocab, &tb, &a0).unwrap();
        add_in_place(ctx, n, &a0, &y).unwrap();
        let want: Vec<Vec<u32>> = [&e0, &r0, &s0, &a0]
            .iter()
            .map(|b| bits(ctx, b, n + TAIL))
            .collect();

        // Encode forms, all in one pass: each op reads what the one before wrote.
        let [e1, r1, s1, a1] = outs();
        let embed_args = |out| EmbedArgs {
            tokens: &tokens,
            n_tokens: rows,
            dim,
            vocab,
            table: &tb,
            out,
        };
        in_one_pass(ctx, |pass| {
            encode_embed(ctx, pass, &embed_args(&e1)).unwrap();
            let norm = RmsNormArgs {
                rows,
                dim,
                eps: 1e-5,
                x: &e1,
                weight: &weight,
                out: &r1,
            };
            encode_rms_norm(ctx, pass, &norm).unwrap();
            let act = SwigluArgs {
                n,
                gate: &gate,
                up: &up,
                out: &s1,
            };
            encode_swiglu(ctx, pass, &act).unwrap();
            encode_embed(ctx, pass, &embed_args(&a1)).unwrap();
            encode_add(ctx, pass, &AddArgs { n, x: &a1, y: &y }).unwrap();
        });
        for (i, b) in [&e1, &r1, &s1, &a1].iter().enumerate() {
            assert_eq!(bits(ctx, b, n + TAIL), want[i], "{name}: encoded op {i}");
        }

        // Prepared forms, recorded twice; the second time with other ids in the same buffer.
        let [e2, r2, s2, a2] = outs();
        let ops = [
            prepare_embed(ctx, &embed_args(&e2)).unwrap(),
            prepare_rms_norm(
                ctx,
                &RmsNormArgs {
                    rows,
                    dim,
                    eps: 1e-5,
                    x: &e2,
                    weight: &weight,
                    out: &r2,
                },
            )
            .unwrap(),
            prepare_swiglu(
                ctx,
                &SwigluArgs {
                    n,
                    gate: &gate,
                    up: &up,
                    out: &s2,
                },
            )
            .unwrap(),
            prepare_embed(ctx, &embed_args(&a2)).unwrap(),
            prepare_add(ctx, &AddArgs { n, x: &a2, y: &y }).unwrap(),
        ];
        if name == "sliced" {
            assert!(ops.iter().all(|op| op.num_dispatches() > 1), "not sliced");
        }
        in_one_pass(ctx, |pass| ops.iter().for_each(|op| op.encode(pass)));
        for (i, b) in [&e2, &r2, &s2, &a2].iter().enumerate() {
            assert_eq!(bits(ctx, b, n + TAIL), want[i], "{name}: prepared op {i}");
        }
        ctx.write_buffer(&tokens, 0, bytemuck::cast_slice(&ids2))
            .unwrap();
        let before = ctx.counters();
        in_one_pass(ctx, |pass| ops.iter().for_each(|op| op.encode(pass)));
        let step = ctx.counters().since(&before);
        let again = bits(ctx, &e2, n);
        if name == "whole" {
            assert_eq!(step.submissions, 1, "{step:?}");
            assert_eq!(step.buffers_created, 0, "{step:?}");
            assert_eq!(step.bind_groups_created, 0, "{step:?}");
        }
        let want2 = reference::embed(&ids2, &tab, dim).unwrap();
        let want2: Vec<u32> = want2.iter().map(|v| v.to_bits()).collect();
        assert_eq!(again, want2, "{name}: prepared embed with new ids");
    }
}

/// The encode and prepare forms refuse bad input with the plain functions' typed errors before
/// recording or creating anything: the caller's pass stays empty (its output untouched) and
/// no bind group is made.
#[test]
fn encode_forms_refuse_bad_input_before_recording() {
    let ctx = Context::new().unwrap();
    let x = ctx.upload("x", &[1.0f32; 64]).unwrap();
    let w = ctx.upload("w", &[1.0f32; 8]).unwrap();
    let out = nan_out(&ctx, 64);
    let small = ctx.upload("small", &[1.0f32; 32]).unwrap();
    let tokens = ctx.upload("tokens", &[0u32; 8]).unwrap();
    let plain = uniform_buffer(&ctx);
    let before = ctx.counters();
    in_one_pass(&ctx, |pass| {
        let norm = |rows, eps, x, out| RmsNormArgs {
            rows,
            dim: 8,
            eps,
            x,
            weight: &w,
            out,
        };
        assert_invalid(
            "rms rows 0",
            encode_rms_norm(&ctx, pass, &norm(0, 0.0, &x, &out)),
        );
        assert_invalid(
            "rms eps",
            encode_rms_norm(&ctx, pass, &norm(8, -1.0, &x, &out)),
        );
        assert_invalid(
            "rms alias",
            encode_rms_norm(&ctx, pass, &norm(8, 0.0, &x, &x)),
        );
        assert_shape(
            "rms small",
            encode_rms_norm(&ctx, pass, &norm(8, 0.0, &x, &small)),
        );
        let act = |n, gate, out| SwigluArgs {
            n,
            gate,
            up: &x,
            out,
        };
        assert_invalid("swiglu n 0", encode_swiglu(&ctx, pass, &act(0, &x, &out)));
        assert_invalid("swiglu alias", encode_swiglu(&ctx, pass, &act(64, &x, &x)));
        assert_invalid(
            "swiglu plain",
            encode_swiglu(&ctx, pass, &act(64, &plain, &out)),
        );
        assert_shape(
            "swiglu small",
            encode_swiglu(&ctx, pass, &act(64, &small, &out)),
        );
        let sum = |n, y| AddArgs { n, x: &out, y };
        assert_invalid("add n 0", encode_add(&ctx, pass, &sum(0, &x)));
        assert_invalid("add alias", encode_add(&ctx, pass, &sum(64, &out)));
        assert_shape("add small", encode_add(&ctx, pass, &sum(64, &small)));
        let gather = |n_tokens, vocab, out| EmbedArgs {
            tokens: &tokens,
            n_tokens,
            dim: 8,
            vocab,
            table: &x,
            out,
        };
        assert_invalid(
            "embed vocab 0",
            encode_embed(&ctx, pass, &gather(8, 0, &out)),
        );
        assert_invalid("embed alias", encode_embed(&ctx, pass, &gather(8, 8, &x)));
        assert_shape(
            "embed tokens",
            encode_embed(&ctx, pass, &gather(9, 8, &out)),
        );
        assert_shape("embed table", encode_embed(&ctx, pass, &gather(8, 9, &out)));
        assert_shape("embed out", encode_embed(&ctx, pass, &gather(8, 8, &small)));
    });
    assert_shape(
        "prepare small",
        prepare_add(
            &ctx,
            &AddArgs {
                n: 64,
                x: &out,
                y: &small,
            },
        ),
    );
    let step = ctx.counters().since(&before);
    assert_eq!(step.bind_groups_created, 0, "{step:?}");
    assert_eq!(step.buffers_created, 0, "{step:?}");
    assert!(read(&ctx, "refused", &out, 64).iter().all(|v| v.is_nan()));
}
