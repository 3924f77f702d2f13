//! The RoPE kernel against the f64 CPU reference: both styles, head dims 64/80/128, full and
//! partial rotary, theta 1e4 and 5e5, positions from 0, a chunk after a 1,000-token prefix and
//! random positions up to 40,000 (and a few past a million).
//!
//! Tolerance (`kvattn::rope::error_bound`): an element whose input pair is `(a, b)` may differ
//! from the reference by `2^-20 * (|a| + |b|)`, derived from the kernel's f32 arithmetic (the
//! angle is exact: fixed-point turns, not `f32(position) * inv_freq`); the partial-rotary tail
//! must be bit-exact. The output is pre-filled with NaN, so a missing write fails.

use kvattn::gpu::{Context, STORAGE};
use kvattn::reference;
use kvattn::rope::{
    encode_rope, error_bound, rope, rope_host, Rope, RopeArgs, RopeConfig, RopeStyle, RopeTables,
};
use kvattn::Error;
use wgpu::util::DeviceExt;

use crate::common::{gpu, gpu_capped, max_abs_err, own_context, Rng};

/// Largest error and largest error / bound seen over a comparison.
#[derive(Default, Debug, Clone, Copy)]
struct Worst {
    abs: f64,
    ratio: f64,
}

/// Checks `got` against the reference element by element; returns the worst error.
fn check(what: &str, cfg: &RopeConfig, x: &[f32], positions: &[u32], got: &[f32]) -> Worst {
    let want = reference::rope(x, positions, cfg).unwrap();
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(
        max_abs_err(got, &want).is_finite(),
        "{what}: NaN in the output (a missing write)"
    );
    let mut worst = Worst::default();
    let d = cfg.head_dim;
    for row in 0..positions.len() * cfg.num_heads {
        let base = row * d;
        for i in 0..cfg.rotary_dim / 2 {
            let (ia, ib) = cfg.style.pair(i, cfg.rotary_dim);
            let bound = error_bound(x[base + ia], x[base + ib]);
            for e in [base + ia, base + ib] {
                let err = (f64::from(got[e]) - f64::from(want[e])).abs();
                assert!(
                    err <= bound,
                    "{what}: row {row} (position {}) pair {i} element {}: GPU {} vs reference \
                     {}, error {err:e} over the bound {bound:e}",
                    positions[row / cfg.num_heads],
                    e - base,
                    got[e],
                    want[e]
                );
                worst.abs = worst.abs.max(err);
                if bound > 0.0 {
                    worst.ratio = worst.ratio.max(err / bound);
                }
            }
        }
        for e in base + cfg.rotary_dim..base + d {
            assert_eq!(
                got[e].to_bits(),
                x[e].to_bits(),
                "{what}: row {row} tail element {} changed",
                e - base
            );
        }
    }
    worst
}

fn merge(a: Worst, b: Worst) -> Worst {
    Worst {
        abs: a.abs.max(b.abs),
        ratio: a.ratio.max(b.ratio),
    }
}

fn position_sets(rng: &mut Rng) -> Vec<(&'static str, Vec<u32>)> {
    vec![
        ("0..23", (0..23).collect()),
        ("1000..1037", (1000..1037).collect()),
        (
            "random <= 40000",
            (0..29).map(|_| (rng.next_u64() % 40_001) as u32).collect(),
        ),
        (
            "large",
            vec![
                32767,
                32768,
                40000,
                65535,
                65536,
                1 << 20,
                1_000_003,
                4_000_000,
            ],
        ),
    ]
}

#[test]
fn rope_matches_reference_over_the_grid() {
    let ctx = gpu();
    let mut rng = Rng::new(41);
    let mut worst = Worst::default();
    let mut cases = 0;
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        for (head_dim, partial) in [(64, 32), (80, 32), (128, 64)] {
            for rotary_dim in [head_dim, partial] {
                for theta in [10_000.0f32, 500_000.0] {
                    for (name, positions) in position_sets(&mut rng) {
                        let cfg = RopeConfig {
                            style,
                            theta,
                            rotary_dim,
                            head_dim,
                            num_heads: 3,
                        };
                        let x = rng.normals(positions.len() * 3 * head_dim, 2.0);
                        let got = rope_host(ctx, &cfg, &x, &positions).unwrap();
                        let what = format!(
                            "{} d{head_dim} rot{rotary_dim} theta{theta} positions {name}",
                            style.name()
                        );
                        worst = merge(worst, check(&what, &cfg, &x, &positions, &got));
                        cases += 1;
                    }
                }
            }
        }
    }
    eprintln!(
        "rope on {}: {cases} cases, max abs error {:.3e}, max error / bound {:.3}",
        ctx.adapter().backend,
        worst.abs,
        worst.ratio
    );
}

#[test]
fn chunk_after_prefix_equals_the_whole_sequence() {
    // Rows of a chunk at positions 1000.. are bitwise equal to the same rows rotated as part of
    // the whole 1,100-token sequence (the result depends only on the row and its position).
    let ctx = gpu();
    let mut rng = Rng::new(7);
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        let cfg = RopeConfig::new(style, 10_000.0, 64, 2);
        let row = 2 * 64;
        let x = rng.normals(1100 * row, 1.0);
        let all: Vec<u32> = (0..1100).collect();
        let whole = rope_host(ctx, &cfg, &x, &all).unwrap();
        let chunk = rope_host(ctx, &cfg, &x[1000 * row..], &all[1000..]).unwrap();
        assert!(
            whole[1000 * row..]
                .iter()
                .zip(&chunk)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{style:?}: chunk differs from the whole sequence"
        );
        check("whole", &cfg, &x, &all, &whole);
    }
}

#[test]
fn inputs_larger_than_a_binding_run_in_aligned_chunks() {
    // 64 KiB binding cap: 1,000 tokens of 5 heads x 80 (1,600 bytes per token) span 25
    // bindings, with chunk offsets aligned to the adapter's storage offset alignment. The
    // result is bitwise equal to the uncapped one.
    let capped = gpu_capped();
    let mut rng = Rng::new(99);
    for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
        let cfg = RopeConfig {
            rotary_dim: 32,
            ..RopeConfig::new(style, 500_000.0, 80, 5)
        };
        let positions: Vec<u32> = (0..1000).map(|t| 3 * t + 17).collect();
        let x = rng.normals(1000 * 5 * 80, 3.0);
        let got = rope_host(capped, &cfg, &x, &positions).unwrap();
        check("capped", &cfg, &x, &positions, &got);
        let uncapped = rope_host(gpu(), &cfg, &x, &positions).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            uncapped.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{style:?}: capped and uncapped differ"
        );
    }
}

fn buffer(ctx: &Context, data: &[f32], usage: wgpu::BufferUsages) -> wgpu::Buffer {
    ctx.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("rope test"),
            contents: bytemuck::cast_slice(data),
            usage,
        })
}

#[test]
fn rope_on_buffers_writes_only_its_range() {
    let ctx = gpu();
    let mut rng = Rng::new(3);
    let cfg = RopeConfig::new(RopeStyle::GptJ, 10_000.0, 64, 4);
    let positions = [5u32, 1000, 1001, 39_999];
    let n = positions.len() * 4 * 64;
    let x = rng.normals(n, 1.0);
    let input = buffer(ctx, &x, STORAGE);
    // A larger output: the elements past the tensor keep their NaN sentinel.
    let out = buffer(ctx, &vec![f32::NAN; n + 100], STORAGE);
    rope(ctx, &cfg, &input, &positions, &out).unwrap();
    let got: Vec<f32> = ctx.read_back(&out, n + 100).unwrap();
    check("buffers", &cfg, &x, &positions, &got[..n]);
    assert!(got[n..].iter().all(|v| v.is_nan()), "wrote past the tensor");
    // No tokens: nothing to do.
    rope(ctx, &cfg, &input, &[], &out).unwrap();
    assert_eq!(rope_host(ctx, &cfg, &[], &[]).unwrap(), Vec::<f32>::new());
}

#[test]
fn invalid_input_is_refused_and_writes_nothing() {
    let ctx = gpu();
    let ok = RopeConfig::new(RopeStyle::NeoX, 10_000.0, 64, 2);
    let positions = [0u32, 1, 2];
    let n = 3 * 2 * 64;
    let x = vec![1.0f32; n];
    let input = buffer(ctx, &x, STORAGE);
    let out = buffer(ctx, &vec![f32::NAN; n], STORAGE);
    let untouched = |what: &str| {
        let got: Vec<f32> = ctx.read_back(&out, n).unwrap();
        assert!(got.iter().all(|v| v.is_nan()), "{what}: output written");
    };

    let bad_configs = [
        (
            "odd head dim",
            RopeConfig {
                head_dim: 63,
                rotary_dim: 62,
                ..ok
            },
        ),
        (
            "odd rotary dim",
            RopeConfig {
                rotary_dim: 31,
                ..ok
            },
        ),
        (
            "zero rotary dim",
            RopeConfig {
                rotary_dim: 0,
                ..ok
            },
        ),
        (
            "rotary dim > head dim",
            RopeConfig {
                rotary_dim: 66,
                ..ok
            },
        ),
        ("theta 0", RopeConfig { theta: 0.0, ..ok }),
        (
            "theta NaN",
            RopeConfig {
                theta: f32::NAN,
                ..ok
            },
        ),
        ("zero heads", RopeConfig { num_heads: 0, ..ok }),
    ];
    for (what, cfg) in bad_configs {
        assert!(rope(ctx, &cfg, &input, &positions, &out).is_err(), "{what}");
        assert!(rope_host(ctx, &cfg, &x, &positions).is_err(), "{what}");
        untouched(what);
    }
    assert!(matches!(
        rope(
            ctx,
            &RopeConfig {
                head_dim: 63,
                rotary_dim: 62,
                ..ok
            },
            &input,
            &positions,
            &out
        ),
        Err(Error::UnsupportedHeadDim { head_dim: 63, .. })
    ));

    // Buffers too small for the tensor.
    let small = buffer(ctx, &x[..n - 4], STORAGE);
    assert!(matches!(
        rope(ctx, &ok, &small, &positions, &out),
        Err(Error::ShapeMismatch { expected, got, .. }) if expected == n && got == n - 4
    ));
    assert!(matches!(
        rope(ctx, &ok, &input, &positions, &small),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        rope(ctx, &ok, &input, &[0, 1, 2, 3], &out),
        Err(Error::ShapeMismatch { .. })
    ));
    untouched("too small");

    // In place is refused (the kernel reads and writes different buffers).
    assert!(matches!(
        rope(ctx, &ok, &out, &positions, &out),
        Err(Error::InvalidArgument(_))
    ));
    untouched("in place");

    // A buffer that cannot be bound as storage.
    let uniform = buffer(ctx, &x, wgpu::BufferUsages::UNIFORM);
    assert!(matches!(
        rope(ctx, &ok, &uniform, &positions, &out),
        Err(Error::InvalidArgument(_))
    ));
    untouched("not storage");

    // Host data of the wrong length.
    assert!(matches!(
        rope_host(ctx, &ok, &x[1..], &positions),
        Err(Error::ShapeMismatch { .. })
    ));
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn prepared_rope_reads_positions_from_a_gpu_buffer() {
    let ctx = own_context(Some(64 << 10));
    let mut rng = Rng::new(41);
    let align = (ctx.device.limits().min_storage_buffer_offset_alignment as usize / 4).max(1);
    let cases = [
        (
            RopeConfig {
                rotary_dim: 32,
                ..RopeConfig::new(RopeStyle::NeoX, 500_000.0, 80, 5)
            },
            1000usize,
        ),
        (RopeConfig::new(RopeStyle::GptJ, 10_000.0, 64, 4), 7),
    ];
    for (cfg, tokens) in cases {
        let n = tokens * cfg.num_heads * cfg.head_dim;
        let x = rng.normals(n, 2.0);
        let p1: Vec<u32> = (0..tokens as u32).map(|t| 3 * t + 17).collect();
        let p2: Vec<u32> = (0..tokens as u32).map(|t| 40_000 - 5 * t).collect();
        // x and out at an aligned offset inside larger buffers.
        let padded: Vec<f32> = [vec![7.0; align], x.clone()].concat();
        let input = buffer(&ctx, &padded, STORAGE);
        let total = align + n + 16;
        let out = buffer(&ctx, &vec![kvattn::gpu::UNWRITTEN; total], STORAGE);
        let positions = ctx.upload("positions", &p1).unwrap();
        let tables = RopeTables::new(&ctx, &cfg).unwrap();
        let args = RopeArgs {
            tables: &tables,
            x: wgpu::BufferBinding {
                buffer: &input,
                offset: (align * 4) as u64,
                size: None,
            },
            positions: &positions,
            tokens,
            out: wgpu::BufferBinding {
                buffer: &out,
                offset: (align * 4) as u64,
                size: std::num::NonZeroU64::new((n * 4) as u64),
            },
        };
        let prepared = Rope::prepare(&ctx, &args).unwrap();
        if tokens == 1000 {
            assert!(prepared.dispatches().len() > 1, "the capped context chunks");
        }
        // The rotation and the copy to a reusable staging buffer: one submission.
        let readback =
            kvattn::gpu::Readback::new(&ctx, "rope readback", (total * 4) as u64).unwrap();
        let run = || {
            let mut encoder = ctx.encoder("prepared rope");
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
                prepared.encode(&mut pass);
            }
            readback
                .encode_copy(&mut encoder, &out, 0, (total * 4) as u64)
                .unwrap();
            let index = ctx.submit("prepared rope", encoder).unwrap();
            readback.read::<f32>(&ctx, index, total).unwrap()
        };
        let got = run();
        let sentinel = |v: &[f32]| v.iter().all(|&x| kvattn::gpu::is_unwritten(x));
        assert!(
            sentinel(&got[..align]) && sentinel(&got[align + n..]),
            "wrote outside"
        );
        let want = rope_host(&ctx, &cfg, &x, &p1).unwrap();
        assert_eq!(
            bits(&got[align..align + n]),
            bits(&want),
            "prepared vs rope()"
        );
        check("prepared", &cfg, &x, &p1, &got[align..align + n]);
        // New positions in the same buffer: the same prepared rotation, nothing created.
        let before = ctx.counters();
        ctx.write_buffer(&positions, 0, bytemuck::cast_slice(&p2))
            .unwrap();
        let again = run();
        let spent = ctx.counters().since(&before);
        assert_eq!(
            (
                spent.buffers_created,
                spent.bind_groups_created,
                spent.submissions
            ),
            (0, 0, 1),
            "one submission for the rotation and its readback, nothing created"
        );
        let want2 = rope_host(&ctx, &cfg, &x, &p2).unwrap();
        assert_eq!(
            bits(&again[align..align + n]),
            bits(&want2),
            "new positions"
        );
        assert_ne!(
            bits(&again[align..align + n]),
            bits(&want),
            "positions changed"
        );
        // encode_rope: the same, into a caller's pass.
        let out2 = buffer(&ctx, &vec![kvattn::gpu::UNWRITTEN; n], STORAGE);
        ctx.run_pass("encode_rope", |pass| {
            encode_rope(
                &ctx,
                pass,
                &RopeArgs {
                    out: out2.as_entire_buffer_binding(),
                    ..args.clone()
                },
            )
        })
        .unwrap();
        let got3: Vec<f32> = ctx.read_back(&out2, n).unwrap();
        assert_eq!(bits(&got3), bits(&want2), "encode_rope");
    }
}

#[test]
fn prepared_rope_refuses_bad_bindings_before_recording() {
    let ctx = own_context(Some(64 << 10));
    let cfg = RopeConfig::new(RopeStyle::NeoX, 10_000.0, 64, 2);
    let tokens = 5;
    let n = tokens * 2 * 64;
    let input = buffer(&ctx, &vec![1.0; n + 64], STORAGE);
    let out = buffer(&ctx, &vec![kvattn::gpu::UNWRITTEN; n], STORAGE);
    let positions = ctx.upload("positions", &[0u32, 1, 2, 3, 4]).unwrap();
    // Four positions (16 bytes, the smallest buffer `upload` makes) for five tokens.
    let short = ctx.upload("positions", &[0u32, 1, 2, 3]).unwrap();
    let no_storage = buffer(&ctx, &vec![0.0; n], wgpu::BufferUsages::COPY_SRC);
    let tables = RopeTables::new(&ctx, &cfg).unwrap();
    let good = RopeArgs {
        tables: &tables,
        x: input.as_entire_buffer_binding(),
        positions: &positions,
        tokens,
        out: out.as_entire_buffer_binding(),
    };
    let before = ctx.counters();
    type Case<'a> = (&'a str, RopeArgs<'a>, fn(&Error) -> bool);
    let cases: Vec<Case> = vec![
        (
            "misaligned x",
            RopeArgs {
                x: wgpu::BufferBinding {
                    buffer: &input,
                    offset: 4,
                    size: None,
                },
                ..good.clone()
            },
            |e| matches!(e, Error::InvalidArgument(_)),
        ),
        (
            "short positions",
            RopeArgs {
                positions: &short,
                ..good.clone()
            },
            |e| matches!(e, Error::ShapeMismatch { .. }),
        ),
        (
            "too many tokens for out",
            RopeArgs {
                tokens: 6,
                positions: &input,
                ..good.clone()
            },
            |e| matches!(e, Error::ShapeMismatch { .. }),
        ),
        (
            "x is out",
            RopeArgs {
                x: out.as_entire_buffer_binding(),
                ..good.clone()
            },
            |e| matches!(e, Error::InvalidArgument(_)),
        ),
        (
            "out without STORAGE",
            RopeArgs {
                out: no_storage.as_entire_buffer_binding(),
                ..good.clone()
            },
            |e| matches!(e, Error::InvalidArgument(_)),
        ),
    ];
    for (what, args, want) in cases {
        let e = ctx
            .run_pass("t", |pass| encode_rope(&ctx, pass, &args))
            .expect_err(what);
        assert!(want(&e), "{what}: {e:?}");
    }
    assert_eq!(ctx.counters().since(&before).submissions, 0);
    let got: Vec<f32> = ctx.read_back(&out, n).unwrap();
    assert!(got.iter().all(|&v| kvattn::gpu::is_unwritten(v)), "written");
}

/// Tables with per-pair frequency factors (Llama 3.1's `rope_freqs.weight`) against
/// `rope_scaled` within the same bound, both styles; bad factors are refused before anything
/// is uploaded.
#[test]
fn frequency_factors_scale_each_pair_as_the_reference_does() {
    let ctx = gpu();
    let mut rng = Rng::new(59);
    for cfg in [
        RopeConfig::new(RopeStyle::GptJ, 500_000.0, 64, 3),
        RopeConfig::new(RopeStyle::NeoX, 10_000.0, 12, 2),
    ] {
        let pairs = cfg.head_dim / 2;
        let factors: Vec<f32> = (0..pairs).map(|i| 1.0 + (i % 5) as f32 * 1.75).collect();
        let positions: Vec<u32> = (0..9u32).map(|t| t * 997 + 3).collect();
        let n = positions.len() * cfg.num_heads * cfg.head_dim;
        let x = rng.normals(n, 2.0);
        let input = ctx.upload("x", &x).unwrap();
        let out = ctx.filled("out", n, kvattn::gpu::UNWRITTEN).unwrap();
        let pos = ctx.upload("positions", &positions).unwrap();
        let tables = RopeTables::scaled(ctx, &cfg, Some(&factors)).unwrap();
        let args = RopeArgs {
            tables: &tables,
            x: input.as_entire_buffer_binding(),
            positions: &pos,
            tokens: positions.len(),
            out: out.as_entire_buffer_binding(),
        };
        let prepared = Rope::prepare(ctx, &args).unwrap();
        ctx.run_pass("scaled rope", |pass| {
            prepared.encode(pass);
            Ok(())
        })
        .unwrap();
        let got: Vec<f32> = ctx.read_back(&out, n).unwrap();
        let want = reference::rope::rope_scaled(&x, &positions, &cfg, Some(&factors)).unwrap();
        let unscaled = reference::rope(&x, &positions, &cfg).unwrap();
        assert!(
            max_abs_err(&want, &unscaled) > 0.1,
            "the factors change the rotation"
        );
        for (e, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let d = cfg.head_dim;
            let (row, j) = (e / d, e % d);
            let i = (0..pairs)
                .find(|&i| {
                    let (a, b) = cfg.style.pair(i, d);
                    a == j || b == j
                })
                .unwrap();
            let (a, b) = cfg.style.pair(i, d);
            let bound = error_bound(x[row * d + a], x[row * d + b]);
            let err = (f64::from(g) - f64::from(w)).abs();
            assert!(err <= bound, "{cfg:?} element {e}: {g} vs {w}");
        }
    }
    let cfg = RopeConfig::new(RopeStyle::NeoX, 10_000.0, 8, 1);
    for bad in [
        &[1.0f32; 3][..],
        &[1.0, 0.0, 1.0, 1.0],
        &[1.0, f32::NAN, 1.0, 1.0],
    ] {
        match RopeTables::scaled(ctx, &cfg, Some(bad)) {
            Err(Error::InvalidArgument(_)) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}

fn whole(b: &wgpu::Buffer) -> wgpu::BufferBinding<'_> {
    b.as_entire_buffer_binding()
}

/// The rotation of `tokens` tokens of `x` into `out` (whole buffers) at `positions`.
fn args_of<'a>(
    tables: &'a RopeTables,
    x: &'a wgpu::Buffer,
    positions: &'a wgpu::Buffer,
    tokens: usize,
    out: &'a wgpu::Buffer,
) -> RopeArgs<'a> {
    RopeArgs {
        tables,
        x: whole(x),
        positions,
        tokens,
        out: whole(out),
    }
}

/// Runs `prepared` in one submission and reads back `out_q` and `out_k` (`nq` and `nk` values
/// plus 16 past each).
fn run_two(
    ctx: &Context,
    prepared: &kvattn::rope::PreparedRope,
    outs: [(&wgpu::Buffer, usize); 2],
) -> [Vec<f32>; 2] {
    ctx.run_pass("rope pair", |pass| {
        prepared.encode(pass);
        Ok(())
    })
    .unwrap();
    outs.map(|(b, n)| ctx.read_back(b, n + 16).unwrap())
}

/// `Rope::prepare_pair`: queries and keys of one step (different heads, the same positions,
/// head size and turns) rotate in one dispatch with the bits of two prepared rotations and
/// nothing written past either output; pairs that cannot share a dispatch (other turns, a
/// tensor over one binding, an output the other reads) take one rotation after the other with
/// the same bits; a bad second tensor is refused before anything is made.
#[test]
fn queries_and_keys_rotate_in_one_dispatch_with_the_bits_of_two() {
    let ctx = own_context(Some(64 << 10));
    let mut rng = Rng::new(67);
    let cases = [
        (RopeStyle::NeoX, 80, 32, [5, 2], 7usize),
        (RopeStyle::GptJ, 64, 64, [9, 3], 1),
        (RopeStyle::NeoX, 64, 64, [4, 4], 13),
    ];
    for (style, head_dim, rotary_dim, [hq, hk], tokens) in cases {
        let cfg = |heads| RopeConfig {
            rotary_dim,
            ..RopeConfig::new(style, 10_000.0, head_dim, heads)
        };
        let (cq, ck) = (cfg(hq), cfg(hk));
        let (nq, nk) = (tokens * hq * head_dim, tokens * hk * head_dim);
        let (xq, xk) = (rng.normals(nq, 2.0), rng.normals(nk, 2.0));
        let positions: Vec<u32> = (0..tokens as u32).map(|t| 40 * t + 3).collect();
        let pos = ctx.upload("positions", &positions).unwrap();
        let (tq, tk) = (
            RopeTables::new(&ctx, &cq).unwrap(),
            RopeTables::new(&ctx, &ck).unwrap(),
        );
        let inputs = [
            ctx.upload("xq", &xq).unwrap(),
            ctx.upload("xk", &xk).unwrap(),
        ];
        let fresh = |n: usize| ctx.filled("out", n + 16, kvattn::gpu::UNWRITTEN).unwrap();
        let args = |tables, x, out, n: usize| RopeArgs {
            out: wgpu::BufferBinding {
                size: std::num::NonZeroU64::new((n * 4) as u64),
                ..whole(out)
            },
            ..args_of(tables, x, &pos, tokens, out)
        };
        // Two prepared rotations: the bits to keep.
        let (sq, sk) = (fresh(nq), fresh(nk));
        let mut two = Rope::prepare(&ctx, &args(&tq, &inputs[0], &sq, nq))
            .unwrap()
            .dispatches()
            .to_vec();
        two.extend_from_slice(
            Rope::prepare(&ctx, &args(&tk, &inputs[1], &sk, nk))
                .unwrap()
                .dispatches(),
        );
        ctx.run_pass("two rotations", |pass| {
            two.iter().for_each(|d| d.encode(pass));
            Ok(())
        })
        .unwrap();
        let want = [
            ctx.read_back::<f32>(&sq, nq).unwrap(),
            ctx.read_back::<f32>(&sk, nk).unwrap(),
        ];
        check("two: q", &cq, &xq, &positions, &want[0]);
        check("two: k", &ck, &xk, &positions, &want[1]);
        // The pair: one dispatch, the same bits, the sentinel past each output.
        let (pq, pk) = (fresh(nq), fresh(nk));
        let pair = Rope::prepare_pair(
            &ctx,
            &args(&tq, &inputs[0], &pq, nq),
            &args(&tk, &inputs[1], &pk, nk),
        )
        .unwrap();
        assert_eq!(
            pair.dispatches().len(),
            1,
            "{style:?} {head_dim}: one dispatch"
        );
        let got = run_two(&ctx, &pair, [(&pq, nq), (&pk, nk)]);
        for (i, n) in [nq, nk].into_iter().enumerate() {
            assert_eq!(bits(&got[i][..n]), bits(&want[i]), "pair: tensor {i}");
            assert!(
                got[i][n..].iter().all(|&v| kvattn::gpu::is_unwritten(v)),
                "pair: wrote past tensor {i}"
            );
        }
    }
}

#[test]
fn rotations_that_cannot_share_a_dispatch_run_one_after_the_other() {
    let ctx = own_context(Some(64 << 10));
    let mut rng = Rng::new(71);
    let (cq, ck) = (
        RopeConfig::new(RopeStyle::NeoX, 10_000.0, 64, 4),
        RopeConfig::new(RopeStyle::NeoX, 10_000.0, 64, 2),
    );
    let other_theta = RopeConfig::new(RopeStyle::NeoX, 500_000.0, 64, 2);
    let positions: Vec<u32> = (0..300u32).map(|t| 7 * t + 1).collect();
    let pos = ctx.upload("positions", &positions).unwrap();
    let tables = [&cq, &ck, &other_theta].map(|c| RopeTables::new(&ctx, c).unwrap());
    // 300 tokens of 4 heads (300 KiB) pass the capped 64 KiB binding: chunks.
    let big = 300 * 4 * 64;
    let xq = rng.normals(big, 2.0);
    let xk = rng.normals(big / 2, 2.0);
    let bq = ctx.upload("xq", &xq).unwrap();
    let bk = ctx.upload("xk", &xk).unwrap();
    let filled = |n| ctx.filled("out", n, kvattn::gpu::UNWRITTEN).unwrap();
    type Case<'a> = (&'a str, usize, usize, usize);
    // (what, tokens, k's table, dispatches at least)
    let cases: [Case; 2] = [("other turns", 5, 2, 2), ("over one binding", 300, 1, 3)];
    for (what, tokens, k, least) in cases {
        let (oq, ok) = (filled(tokens * 4 * 64), filled(tokens * 2 * 64));
        let pair = Rope::prepare_pair(
            &ctx,
            &args_of(&tables[0], &bq, &pos, tokens, &oq),
            &args_of(&tables[k], &bk, &pos, tokens, &ok),
        )
        .unwrap();
        assert!(
            pair.dispatches().len() >= least,
            "{what}: {} dispatches",
            pair.dispatches().len()
        );
        ctx.run_pass(what, |pass| {
            pair.encode(pass);
            Ok(())
        })
        .unwrap();
        let p = &positions[..tokens];
        let got_q: Vec<f32> = ctx.read_back(&oq, tokens * 4 * 64).unwrap();
        let got_k: Vec<f32> = ctx.read_back(&ok, tokens * 2 * 64).unwrap();
        let kcfg = [&cq, &ck, &other_theta][k];
        assert_eq!(
            bits(&got_q),
            bits(&rope_host(&ctx, &cq, &xq[..got_q.len()], p).unwrap())
        );
        assert_eq!(
            bits(&got_k),
            bits(&rope_host(&ctx, kcfg, &xk[..got_k.len()], p).unwrap())
        );
    }
    // The keys read what the queries' rotation wrote: one after the other, as two would.
    let tokens = 3;
    let (mid, last) = (filled(tokens * 2 * 64), filled(tokens * 2 * 64));
    let chained = Rope::prepare_pair(
        &ctx,
        &args_of(&tables[1], &bk, &pos, tokens, &mid),
        &args_of(&tables[1], &mid, &pos, tokens, &last),
    )
    .unwrap();
    assert_eq!(chained.dispatches().len(), 2, "an output the other reads");
    ctx.run_pass("chained", |pass| {
        chained.encode(pass);
        Ok(())
    })
    .unwrap();
    let p = &positions[..tokens];
    let once = rope_host(&ctx, &ck, &xk[..tokens * 2 * 64], p).unwrap();
    let twice = rope_host(&ctx, &ck, &once, p).unwrap();
    let got: Vec<f32> = ctx.read_back(&last, tokens * 2 * 64).unwrap();
    assert_eq!(bits(&got), bits(&twice), "chained");
    // A bad second tensor: refused before anything is made.
    let fine = filled(tokens * 4 * 64);
    let before = ctx.counters();
    let e = Rope::prepare_pair(
        &ctx,
        &args_of(&tables[0], &bq, &pos, tokens, &fine),
        &args_of(&tables[1], &bk, &pos, tokens, &bk),
    )
    .expect_err("x is out");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    let spent = ctx.counters().since(&before);
    assert_eq!((spent.buffers_created, spent.bind_groups_created), (0, 0));
    // A second tensor whose one token (300 heads of 64, 75 KiB) passes the 64 KiB binding:
    // refused before the first tensor's dispatch is made.
    let wide = RopeConfig::new(RopeStyle::NeoX, 10_000.0, 64, 300);
    let wide_tables = RopeTables::new(&ctx, &wide).unwrap();
    let (wide_x, wide_out) = (filled(300 * 64), filled(300 * 64));
    let before_wide = ctx.counters();
    let e = Rope::prepare_pair(
        &ctx,
        &args_of(&tables[0], &bq, &pos, 1, &fine),
        &args_of(&wide_tables, &wide_x, &pos, 1, &wide_out),
    )
    .expect_err("a token over one binding");
    assert!(matches!(e, Error::TooLarge { .. }), "{e:?}");
    let spent = ctx.counters().since(&before_wide);
    assert_eq!((spent.buffers_created, spent.bind_groups_created), (0, 0));
}
