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
