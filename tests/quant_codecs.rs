//! CPU tests of the KV storage codecs (ARCHITECTURE.md section 6) and a naga check of
//! `shaders/lib/kv_load.wgsl`. No GPU needed.

use kvattn::quant::fp8::{decode_e4m3, decode_e5m2, encode_e4m3, encode_e5m2, E4M3_MAX, E5M2_MAX};
use kvattn::quant::{
    decode_rows, encode_int4_rows_with, encode_int8_rows_with, encode_rows, pack, EncodedRows,
    Fp8Format, Fp8Scale, Int4Params, Int8Scale, KvDtype, ScaleMode,
};
use kvattn::Error;

/// xorshift64: deterministic, no rand crate.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Roughly normal (sum of four uniforms, centred, unit variance).
    fn normal(&mut self) -> f32 {
        let s: f64 = (0..4).map(|_| self.unit()).sum();
        ((s - 2.0) * 3f64.sqrt()) as f32
    }
}

/// The OCP value of an FP8 code from the sign/exponent/mantissa formula, computed independently
/// of the codec (in f64). `None` for NaN; infinities as f64 infinities.
fn ocp_value(code: u8, exp_bits: u32, man_bits: u32) -> Option<f64> {
    let bias = (1i32 << (exp_bits - 1)) - 1;
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code as u32 & 0x7F) >> man_bits) as i32;
    let m = (code as u32 & ((1 << man_bits) - 1)) as f64;
    let top = (1i32 << exp_bits) - 1;
    let frac = m / (1u32 << man_bits) as f64;
    if exp_bits == 4 && e == top && m as u32 == 7 {
        return None; // E4M3 "fn": only S.1111.111 is NaN
    }
    if exp_bits == 5 && e == top {
        return if m == 0.0 {
            Some(sign * f64::INFINITY)
        } else {
            None
        };
    }
    Some(if e == 0 {
        sign * 2f64.powi(1 - bias) * frac
    } else {
        sign * 2f64.powi(e - bias) * (1.0 + frac)
    })
}

type Enc = fn(f32) -> u8;
type Dec = fn(u8) -> f32;
/// (name, encode, decode, exponent bits, mantissa bits, largest finite code, largest value)
type Codec = (&'static str, Enc, Dec, u32, u32, u8, f32);

const CODECS: [Codec; 2] = [
    ("e4m3", encode_e4m3, decode_e4m3, 4, 3, 0x7E, E4M3_MAX),
    ("e5m2", encode_e5m2, decode_e5m2, 5, 2, 0x7B, E5M2_MAX),
];

#[test]
fn fp8_all_codes_decode_to_ocp_values() {
    for (name, _, dec, eb, mb, _, _) in CODECS {
        for c in 0..=255u8 {
            let got = dec(c);
            match ocp_value(c, eb, mb) {
                None => assert!(got.is_nan(), "{name} {c:#04x}"),
                Some(v) => {
                    assert_eq!(got as f64, v, "{name} {c:#04x}");
                    assert_eq!(
                        got.is_sign_negative(),
                        c & 0x80 != 0,
                        "{name} {c:#04x} sign"
                    );
                }
            }
        }
    }
    // Anchors by hand.
    assert_eq!(decode_e4m3(0x7E), 448.0);
    assert_eq!(decode_e4m3(0xFE), -448.0);
    assert_eq!(decode_e4m3(0x08), 2f32.powi(-6));
    assert_eq!(decode_e4m3(0x07), 7.0 * 2f32.powi(-9));
    assert_eq!(decode_e4m3(0x01), 2f32.powi(-9));
    assert_eq!(decode_e4m3(0x38), 1.0);
    assert!(decode_e4m3(0x7F).is_nan() && decode_e4m3(0xFF).is_nan());
    assert_eq!(decode_e4m3(0x80).to_bits(), 0x8000_0000);
    assert_eq!(decode_e5m2(0x7B), 57344.0);
    assert_eq!(decode_e5m2(0x7C), f32::INFINITY);
    assert_eq!(decode_e5m2(0xFC), f32::NEG_INFINITY);
    assert_eq!(decode_e5m2(0x01), 2f32.powi(-16));
    assert_eq!(decode_e5m2(0x04), 2f32.powi(-14));
    assert_eq!(decode_e5m2(0x3C), 1.0);
    for c in [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF] {
        assert!(decode_e5m2(c).is_nan());
    }
    assert_eq!(Fp8Format::E4M3.max_value(), 448.0);
    assert_eq!(Fp8Format::E5M2.max_value(), 57344.0);
}

#[test]
fn fp8_encode_decode_round_trips_every_finite_code() {
    for (name, enc, dec, ..) in CODECS {
        let mut finite = 0;
        for c in 0..=255u8 {
            let x = dec(c);
            if x.is_finite() {
                assert_eq!(enc(x), c, "{name} {c:#04x} ({x})");
                finite += 1;
            }
        }
        assert_eq!(finite, if name == "e4m3" { 254 } else { 248 });
    }
    assert_eq!(encode_e4m3(0.0), 0x00);
    assert_eq!(encode_e4m3(-0.0), 0x80);
    assert_eq!(encode_e5m2(0.0), 0x00);
    assert_eq!(encode_e5m2(-0.0), 0x80);
}

#[test]
fn fp8_ties_round_to_even_and_neighbours_round_to_nearest() {
    for (name, enc, dec, _, _, max_code, _) in CODECS {
        for c in 0..max_code {
            let lo = dec(c) as f64;
            let hi = dec(c + 1) as f64;
            let mid = (lo + hi) / 2.0;
            let mid32 = mid as f32;
            assert_eq!(mid32 as f64, mid, "midpoint is exact in f32");
            let even = if c % 2 == 0 { c } else { c + 1 };
            assert_eq!(enc(mid32), even, "{name} tie above {c:#04x}");
            assert_eq!(enc(-mid32), even | 0x80, "{name} tie below -{c:#04x}");
            // One f32 ulp either side of the midpoint goes to the nearer code.
            let below = f32::from_bits(mid32.to_bits() - 1);
            let above = f32::from_bits(mid32.to_bits() + 1);
            assert_eq!(enc(below), c, "{name} just below the tie above {c:#04x}");
            assert_eq!(
                enc(above),
                c + 1,
                "{name} just above the tie above {c:#04x}"
            );
            assert_eq!(enc(-above), (c + 1) | 0x80);
        }
    }
}

#[test]
fn fp8_saturates_underflows_and_keeps_nan() {
    for (name, enc, dec, _, _, max_code, max) in CODECS {
        let max_next = dec(max_code) as f64 + (dec(max_code) - dec(max_code - 1)) as f64;
        let over = [
            f32::from_bits(max.to_bits() + 1),
            ((max as f64 + max_next) / 2.0) as f32, // the tie above max
            max_next as f32,
            1e6,
            1e30,
            f32::MAX,
        ];
        for x in over {
            assert_eq!(enc(x), max_code, "{name} {x}");
            assert_eq!(enc(-x), max_code | 0x80, "{name} -{x}");
        }
        let nan_code = if name == "e4m3" { 0x7F } else { 0x7E };
        // Infinity stays non-finite: E5M2's infinity, E4M3's NaN (it has no infinity).
        let inf_code = if name == "e4m3" { 0x7F } else { 0x7C };
        assert_eq!(enc(f32::INFINITY), inf_code, "{name}");
        assert_eq!(enc(f32::NEG_INFINITY), inf_code | 0x80, "{name}");
        assert!(!dec(enc(f32::INFINITY)).is_finite());
        for n in [
            f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0x7FFF_FFFF),
        ] {
            assert_eq!(enc(n), nan_code, "{name}");
            assert_eq!(enc(-n), nan_code | 0x80, "{name}");
            assert!(dec(enc(n)).is_nan());
        }
        // Half the smallest subnormal is a tie with zero (even); f32 subnormals give ±0.
        let min_sub = dec(1);
        for x in [
            min_sub / 2.0,
            min_sub / 3.0,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
        ] {
            assert_eq!(enc(x), 0x00, "{name} {x:e}");
            assert_eq!(enc(-x), 0x80, "{name} -{x:e}");
        }
        assert_eq!(enc(f32::from_bits((min_sub / 2.0).to_bits() + 1)), 0x01);
    }
}

/// The `float8` crate (a port of CUDA's `__nv_cvt_float_to_fp8` with SATFINITE) must agree with
/// our encoder on every finite input, and our decoder with its decoder on every non-NaN code.
/// (SATFINITE saturates infinities too; we keep them non-finite, checked in
/// `fp8_saturates_underflows_and_keeps_nan`.)
/// Do not use float8's MAX / INFINITY constants (they are wrong). NaN: float8 gives `0x7F | sign`
/// for E4M3 (as we do) and `0x7E | top mantissa bits | sign` for E5M2; we compare NaN-ness only.
#[test]
fn fp8_agrees_with_float8_crate() {
    let ours: [(Enc, Enc, Dec, Dec); 2] = [
        (
            encode_e4m3,
            |x| float8::F8E4M3::from_f32(x).to_bits(),
            decode_e4m3,
            |c| float8::F8E4M3::from_bits(c).to_f32(),
        ),
        (
            encode_e5m2,
            |x| float8::F8E5M2::from_f32(x).to_bits(),
            decode_e5m2,
            |c| float8::F8E5M2::from_bits(c).to_f32(),
        ),
    ];
    let mut rng = Rng(0xDEAD_BEEF_CAFE_F00D);
    for (enc, their_enc, dec, their_dec) in ours {
        for c in 0..=255u8 {
            let (a, b) = (dec(c), their_dec(c));
            assert!(
                a.is_nan() == b.is_nan() && (a.is_nan() || a == b),
                "decode {c:#04x}"
            );
        }
        let check = |x: f32| {
            let (a, b) = (enc(x), their_enc(x));
            if x.is_nan() {
                assert!(dec(a).is_nan() && dec(b).is_nan() && (a & 0x80) == (b & 0x80));
            } else if x.is_infinite() {
                assert!(!dec(a).is_finite() && (a & 0x80) == (b & 0x80));
            } else {
                assert_eq!(a, b, "x = {x:e} ({:#010x})", x.to_bits());
            }
        };
        for _ in 0..300_000 {
            let r = rng.next_u64();
            check(f32::from_bits(r as u32)); // every exponent, NaN and infinities included
                                             // Exponents 2^-20 .. 2^19, where every FP8 code lives.
            let e = (r >> 32) as u32 % 40 + 107;
            check(f32::from_bits(((r >> 40) as u32 & 0x807F_FFFF) | (e << 23)));
            check(rng.normal() * 100.0);
        }
        for c in 0..=255u8 {
            let x = dec(c);
            if x.is_finite() {
                for y in [
                    x,
                    f32::from_bits(x.to_bits() + 1),
                    f32::from_bits(x.to_bits().max(1) - 1),
                ] {
                    check(y);
                }
            }
        }
        for x in [f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN] {
            check(x);
        }
    }
}

#[test]
fn f16_and_bf16_codecs_match_half() {
    use kvattn::quant::{bf16, f16};
    let mut rng = Rng(7);
    for _ in 0..200_000 {
        let x = f32::from_bits(rng.next_u64() as u32);
        let y = rng.normal() * 1000.0;
        for x in [x, y] {
            let h = f16::f32_to_f16_bits(x);
            let b = bf16::f32_to_bf16_bits(x);
            if x.is_nan() {
                assert!(f16::f16_bits_to_f32(h).is_nan() && bf16::bf16_bits_to_f32(b).is_nan());
            } else {
                assert_eq!(h, half::f16::from_f32(x).to_bits(), "{x:e}");
                assert_eq!(b, half::bf16::from_f32(x).to_bits(), "{x:e}");
                assert_eq!(f16::f16_bits_to_f32(h), half::f16::from_bits(h).to_f32());
                assert_eq!(bf16::bf16_bits_to_f32(b), half::bf16::from_bits(b).to_f32());
            }
        }
    }
}

fn random_rows(rng: &mut Rng, rows: usize, d: usize) -> Vec<f32> {
    (0..rows * d)
        .map(|i| {
            // Rows of different magnitudes, an occasional outlier, some exact zeros.
            let row_scale = [1e-3f32, 0.5, 3.0, 40.0, 900.0][(i / d) % 5];
            match rng.next_u64() % 50 {
                0 => 0.0,
                1 => rng.normal() * row_scale * 8.0,
                _ => rng.normal() * row_scale,
            }
        })
        .collect()
}

const DIMS: [usize; 6] = [32, 64, 80, 96, 128, 256];

#[test]
fn rows_have_the_documented_shapes_and_packing() {
    let mut rng = Rng(11);
    for dtype in KvDtype::ALL {
        for d in DIMS {
            if dtype.check_head_dim(d).is_err() {
                continue;
            }
            let n = 7;
            let x = random_rows(&mut rng, n, d);
            let enc = encode_rows(dtype, d, &x, ScaleMode::PerRow).unwrap();
            assert_eq!(enc.num_rows(), n);
            assert_eq!(enc.words.len(), n * dtype.words_per_row(d));
            assert_eq!(
                enc.scales.len(),
                n * dtype.scale_words_per_row(d, ScaleMode::PerRow)
            );
            assert_eq!(enc.words.len() * 32, x.len() * dtype.bits() as usize);
            assert_eq!(enc.scale_pool_words(), enc.scales);
            let expected_words: Vec<u32> = match dtype {
                KvDtype::F32 => x.iter().map(|v| v.to_bits()).collect(),
                KvDtype::F16 => pack::pack_halves(
                    &x.iter()
                        .map(|&v| half::f16::from_f32(v).to_bits())
                        .collect::<Vec<_>>(),
                ),
                KvDtype::Bf16 => pack::pack_halves(
                    &x.iter()
                        .map(|&v| half::bf16::from_f32(v).to_bits())
                        .collect::<Vec<_>>(),
                ),
                _ => continue,
            };
            assert_eq!(enc.words, expected_words, "{dtype} d={d}");
        }
    }
    // Element order inside a word: low bits first.
    let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
    let e = encode_rows(KvDtype::Int8, 32, &x, ScaleMode::PerRow).unwrap();
    assert_eq!(f32::from_bits(e.scales[0]), 31.0 / 127.0);
    assert_eq!(pack::byte_at(&e.words, 31), 127);
    assert_eq!(e.words[0] & 0xFF, 0);
    let e = encode_rows(KvDtype::Int4, 32, &x, ScaleMode::PerRow).unwrap();
    assert_eq!(e.words[0] & 0xF, 0);
    assert_eq!(e.words[3] >> 28, 15);
    let p = Int4Params::from_word(e.scales[0]);
    assert_eq!(p.min(), 0.0);
    assert_eq!(p.scale(), half::f16::from_f32(31.0 / 15.0).to_f32());
    let e = encode_rows(
        KvDtype::Fp8E4M3,
        4,
        &[1.0, 2.0, -1.0, 448.0],
        ScaleMode::PerRow,
    )
    .unwrap();
    assert_eq!(e.words, [0x7EB8_4038]);
    assert_eq!(f32::from_bits(e.scales[0]), 1.0);
    assert_eq!(pack::words_to_le_bytes(&e.words), [0x38, 0x40, 0xB8, 0x7E]);
}

#[test]
fn fp8_rows_decode_exactly_and_within_half_an_ulp() {
    let mut rng = Rng(12);
    for dtype in [KvDtype::Fp8E4M3, KvDtype::Fp8E5M2] {
        let fmt = dtype.fp8_format().unwrap();
        let man_bits = if fmt == Fp8Format::E4M3 { 3 } else { 2 };
        for mode in [
            ScaleMode::PerRow,
            ScaleMode::PerTensor(0.125),
            ScaleMode::PerTensor(3.0),
        ] {
            for d in DIMS {
                let n = 10;
                let x = random_rows(&mut rng, n, d);
                let enc = encode_rows(dtype, d, &x, mode).unwrap();
                let dec = decode_rows(&enc).unwrap();
                assert_eq!(dec.len(), x.len());
                for r in 0..n {
                    let row = &x[r * d..(r + 1) * d];
                    let s = match mode {
                        ScaleMode::PerTensor(t) => Fp8Scale::per_tensor(t).unwrap(),
                        ScaleMode::PerRow => {
                            let s = Fp8Scale::for_row(fmt, row);
                            assert_eq!(enc.scales[r], s.scale.to_bits());
                            // A power of two, and the row's amax lands in (max / 2, max].
                            assert_eq!(s.scale.to_bits() & 0x007F_FFFF, 0);
                            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                            if amax > 0.0 {
                                let t = amax * s.inv_scale;
                                assert!(t <= fmt.max_value() && t > fmt.max_value() / 2.0);
                            }
                            s
                        }
                    };
                    for (i, &v) in row.iter().enumerate() {
                        let q = pack::byte_at(&enc.words, r * d + i);
                        assert_eq!(q, fmt.encode(v * s.inv_scale));
                        let got = dec[r * d + i];
                        assert_eq!(got.to_bits(), (fmt.decode(q) * s.scale).to_bits());
                        // Error: half an ulp of the format, or half its smallest subnormal.
                        let t = (v * s.inv_scale).abs() as f64;
                        let ulp = if t >= fmt.max_value() as f64 {
                            f64::INFINITY // saturated (per-tensor scale too small)
                        } else {
                            let e = t
                                .log2()
                                .floor()
                                .max(1.0 - if man_bits == 3 { 7.0 } else { 15.0 });
                            2f64.powf(e - man_bits as f64)
                        };
                        let err = (got as f64 - v as f64).abs();
                        let tol = ulp / 2.0 * s.scale as f64 * (1.0 + 1e-6);
                        assert!(
                            t >= fmt.max_value() as f64 || err <= tol,
                            "{dtype} {mode:?} x={v} dec={got} err={err} tol={tol}"
                        );
                    }
                }
                // Re-encoding what was decoded gives back the same values.
                let again = decode_rows(&encode_rows(dtype, d, &dec, mode).unwrap()).unwrap();
                assert_eq!(again, dec, "{dtype} {mode:?} d={d}");
            }
        }
    }
}

#[test]
fn int8_rows_round_trip_within_half_a_step() {
    let mut rng = Rng(13);
    for d in DIMS {
        let n = 10;
        let x = random_rows(&mut rng, n, d);
        let enc = encode_rows(KvDtype::Int8, d, &x, ScaleMode::PerRow).unwrap();
        let dec = decode_rows(&enc).unwrap();
        let mut scales = Vec::new();
        for r in 0..n {
            let row = &x[r * d..(r + 1) * d];
            let s = Int8Scale::for_row(row);
            assert_eq!(f32::from_bits(enc.scales[r]), s.scale);
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(s.scale, amax / 127.0);
            for (i, &v) in row.iter().enumerate() {
                let q = pack::byte_at(&enc.words, r * d + i) as i8;
                assert!((-127..=127).contains(&q));
                let err = (dec[r * d + i] - v).abs();
                assert!(
                    err <= s.scale * 0.5 * (1.0 + 1e-5) + 1e-30,
                    "x={v} err={err}"
                );
            }
            scales.push(s);
        }
        // The explicit-scale encoder with the same pair reproduces the codes; re-encoding the
        // decoded values with those scales is stable.
        assert_eq!(encode_int8_rows_with(d, &x, &scales).unwrap(), enc);
        assert_eq!(encode_int8_rows_with(d, &dec, &scales).unwrap(), enc);
        // A different reciprocal (as a GPU might compute) is honoured.
        let bumped: Vec<Int8Scale> = scales
            .iter()
            .map(|s| Int8Scale {
                scale: s.scale,
                inv_scale: s.inv_scale * 1.5,
            })
            .collect();
        let other = encode_int8_rows_with(d, &x, &bumped).unwrap();
        assert_eq!(other.scales, enc.scales);
        assert_ne!(other.words, enc.words);
        assert!(matches!(
            encode_int8_rows_with(d, &x, &scales[1..]),
            Err(Error::ShapeMismatch { .. })
        ));
    }
}

#[test]
fn int4_rows_round_trip_within_half_a_step() {
    let mut rng = Rng(14);
    for d in [32, 64, 96, 128, 256] {
        let n = 10;
        let x = random_rows(&mut rng, n, d);
        let enc = encode_rows(KvDtype::Int4, d, &x, ScaleMode::PerRow).unwrap();
        assert_eq!(enc.scales.len(), n * d / 32);
        let dec = decode_rows(&enc).unwrap();
        let mut params = Vec::new();
        for (g, group) in x.chunks(32).enumerate() {
            let p = Int4Params::for_group(group);
            assert_eq!(enc.scales[g], p.to_word());
            let (lo, hi) = group
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            assert_eq!(p.min_h, half::f16::from_f32(lo).to_bits());
            assert_eq!(p.scale_h, half::f16::from_f32((hi - lo) / 15.0).to_bits());
            let (s, m) = (p.scale(), p.min());
            // Half a step, plus what rounding scale and min to f16 can add at the ends.
            let tol = 0.5 * s
                + (lo - m).abs()
                + 15.0 * ((hi - lo) / 15.0 - s).abs()
                + 1e-6 * hi.abs().max(lo.abs());
            for (i, &v) in group.iter().enumerate() {
                let q = pack::nibble_at(&enc.words, g * 32 + i);
                let got = dec[g * 32 + i];
                assert_eq!(got, (q as f32).mul_add(s, m));
                assert!((got - v).abs() <= tol, "x={v} got={got} tol={tol}");
            }
            params.push(p);
        }
        assert_eq!(encode_int4_rows_with(d, &x, &params).unwrap(), enc);
        assert_eq!(encode_int4_rows_with(d, &dec, &params).unwrap(), enc);
        assert!(matches!(
            encode_int4_rows_with(d, &x, &params[..params.len() - 1]),
            Err(Error::ShapeMismatch { .. })
        ));
    }
}

#[test]
fn float_rows_decode_exactly() {
    let mut rng = Rng(15);
    let x = random_rows(&mut rng, 5, 64);
    let f32s = decode_rows(&encode_rows(KvDtype::F32, 64, &x, ScaleMode::PerRow).unwrap()).unwrap();
    assert_eq!(f32s, x);
    let f16s = decode_rows(&encode_rows(KvDtype::F16, 64, &x, ScaleMode::PerRow).unwrap()).unwrap();
    let b16s =
        decode_rows(&encode_rows(KvDtype::Bf16, 64, &x, ScaleMode::PerRow).unwrap()).unwrap();
    for i in 0..x.len() {
        assert_eq!(f16s[i], half::f16::from_f32(x[i]).to_f32());
        assert_eq!(b16s[i], half::bf16::from_f32(x[i]).to_f32());
    }
}

#[test]
fn bad_input_gets_typed_errors() {
    let x = vec![1.0f32; 100];
    assert!(matches!(
        encode_rows(KvDtype::F16, 64, &x, ScaleMode::PerRow),
        Err(Error::ShapeMismatch {
            expected: 128,
            got: 100,
            ..
        })
    ));
    for (dtype, d) in [
        (KvDtype::F32, 0),
        (KvDtype::F16, 50),
        (KvDtype::Int4, 20),
        (KvDtype::Int8, 2048),
    ] {
        assert!(matches!(
            encode_rows(dtype, d, &x, ScaleMode::PerRow),
            Err(Error::UnsupportedHeadDim { head_dim, .. }) if head_dim == d
        ));
    }
    for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Int8, KvDtype::Int4] {
        assert!(matches!(
            encode_rows(dtype, 4 * 25, &x, ScaleMode::PerTensor(1.0)),
            Err(Error::InvalidArgument(_)) | Err(Error::UnsupportedHeadDim { .. })
        ));
    }
    assert!(matches!(
        encode_rows(KvDtype::Fp8E4M3, 4, &x, ScaleMode::PerTensor(-2.0)),
        Err(Error::InvalidArgument(_))
    ));
    // Non-finite input is stored, never refused: int8 and int4 poison the row (group) that holds
    // it, so it reads NaN; the other row is untouched.
    let mut bad = vec![0.5f32; 64];
    for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        bad[37] = special;
        for dtype in [KvDtype::Int8, KvDtype::Int4] {
            let e = encode_rows(dtype, 32, &bad, ScaleMode::PerRow).unwrap();
            let back = decode_rows(&e).unwrap();
            assert!(back[32..].iter().all(|x| x.is_nan()), "{dtype} {special}");
            assert!(
                back[..32].iter().all(|x| x.is_finite()),
                "{dtype} {special}"
            );
        }
    }
    // FP8 keeps non-finite values non-finite: E5M2 infinity, E4M3 NaN.
    bad[37] = f32::INFINITY;
    let e = encode_rows(KvDtype::Fp8E5M2, 32, &bad, ScaleMode::PerRow).unwrap();
    assert_eq!(pack::byte_at(&e.words, 37), 0x7C);
    assert_eq!(decode_rows(&e).unwrap()[36], 0.5);
    let e = encode_rows(KvDtype::Fp8E4M3, 32, &bad, ScaleMode::PerRow).unwrap();
    assert_eq!(pack::byte_at(&e.words, 37), 0x7F);
    // int4: a group whose scale or min overflows f16 is poisoned.
    let mut wide = vec![0.0f32; 32];
    wide[0] = -70000.0;
    let e = encode_rows(KvDtype::Int4, 32, &wide, ScaleMode::PerRow).unwrap();
    assert_eq!(e.scales, [0x7E00_7E00]);
    wide[0] = -60000.0;
    wide[1] = 60000.0;
    let e = encode_rows(KvDtype::Int4, 32, &wide, ScaleMode::PerRow).unwrap();
    assert!(decode_rows(&e).unwrap().iter().all(|x| x.is_finite()));
    wide[1] = f32::MAX;
    let e = encode_rows(KvDtype::Int4, 32, &wide, ScaleMode::PerRow).unwrap();
    assert_eq!(e.scales, [0x7E00_7E00]);
    // Empty input is zero rows.
    let e = encode_rows(KvDtype::Int4, 32, &[], ScaleMode::PerRow).unwrap();
    assert_eq!((e.num_rows(), decode_rows(&e).unwrap().len()), (0, 0));
    // Hand-built rows are checked before decoding.
    let good = encode_rows(KvDtype::Int8, 32, &[1.0; 64], ScaleMode::PerRow).unwrap();
    let mut r = good.clone();
    r.words.pop();
    assert!(matches!(decode_rows(&r), Err(Error::ShapeMismatch { .. })));
    let mut r = good.clone();
    r.scales.pop();
    assert!(matches!(
        decode_rows(&r),
        Err(Error::ShapeMismatch {
            expected: 2,
            got: 1,
            ..
        })
    ));
    let mut r = good.clone();
    r.head_dim = 30;
    assert!(matches!(
        decode_rows(&r),
        Err(Error::UnsupportedHeadDim { .. })
    ));
    assert!(matches!(good.decode_row(2), Err(Error::InvalidArgument(_))));
    assert_eq!(good.decode_row(1).unwrap(), vec![1.0; 32]);
    let per_tensor = EncodedRows {
        dtype: KvDtype::Fp8E4M3,
        head_dim: 4,
        scale_mode: ScaleMode::PerTensor(0.5),
        words: vec![0x3838_3838],
        scales: vec![],
    };
    assert_eq!(decode_rows(&per_tensor).unwrap(), vec![0.5; 4]);
    assert_eq!(per_tensor.scale_pool_words(), vec![0.5f32.to_bits()]);
}

// ---- WGSL: kv_format.wgsl + kv_load.wgsl parse and validates with naga, composed with a stub kernel ----

const KV_FORMAT: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/shaders/lib/kv_format.wgsl"
));
const KV_LOAD: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/shaders/lib/kv_load.wgsl"
));

const STUB_KERNEL: &str = r#"
@group(0) @binding(0) var<storage, read> k_pool: array<u32>;
@group(0) @binding(1) var<storage, read> v_pool: array<u32>;
@group(0) @binding(2) var<storage, read> k_scales: array<u32>;
@group(0) @binding(3) var<storage, read> v_scales: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;

fn kv_word(which: u32, i: u32) -> u32 {
    if which == 0u {
        return k_pool[i];
    }
    return v_pool[i];
}

fn kv_tensor_scale(which: u32) -> f32 {
    if which == 0u {
        return bitcast<f32>(k_scales[0]);
    }
    return bitcast<f32>(v_scales[0]);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.y;
    let c = gid.x;
    if c < K_DIM / 4u {
        out[2u * (row * 256u + c)] = kv_load4(0u, row, c);
    }
    if c < V_DIM / 4u {
        out[2u * (row * 256u + c) + 1u] = kv_load4(1u, row, c) + kv_load4_codes(1u, row, c);
    }
    // The pure helpers, so that they are validated even where kv_load4 does not reach them.
    let w = k_pool[0];
    out[0] += vec4<f32>(kv_unpack_f16x2(w), kv_unpack_bf16x2(w))
        + vec4<f32>(kv_fp8_e4m3(w & 0xffu), kv_fp8_e5m2(w >> 24u), kv_int8x4(w).y,
                    f32(kv_scale_words_per_row(K_DTYPE, K_DIM, K_SCALE_PER_TENSOR)))
        + kv_small_f32x4(kv_bytes(w) & vec4<u32>(15u));
}
"#;

fn validate(src: &str) -> (naga::Module, naga::valid::ModuleInfo) {
    let module =
        naga::front::wgsl::parse_str(src).unwrap_or_else(|e| panic!("{}", e.emit_to_string(src)));
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::empty(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{}", e.emit_to_string(src)));
    (module, info)
}

#[test]
fn kv_load_wgsl_is_valid_core_wgsl() {
    for lib in [KV_FORMAT, KV_LOAD] {
        assert!(
            !lib.lines().any(|l| l.trim_start().starts_with("enable")),
            "kv_format.wgsl and kv_load.wgsl must stay core WGSL"
        );
    }
    // The library calls kv_word / kv_tensor_scale, so it validates only with a kernel around it.
    let src = format!("{KV_FORMAT}\n{KV_LOAD}\n{STUB_KERNEL}");
    let (module, info) = validate(&src);
    // Codes match KvDtype::code.
    for (name, dtype) in [
        "KV_F32",
        "KV_F16",
        "KV_BF16",
        "KV_FP8_E4M3",
        "KV_FP8_E5M2",
        "KV_INT8",
        "KV_INT4",
    ]
    .into_iter()
    .zip(KvDtype::ALL)
    {
        let needle = format!("const {name}: u32 = {}u;", dtype.code());
        assert!(KV_FORMAT.contains(&needle), "missing `{needle}`");
    }
    // Every override combination the host can ask for processes and translates to SPIR-V.
    let overrides: Vec<&str> = module
        .overrides
        .iter()
        .filter_map(|(_, o)| o.name.as_deref())
        .collect();
    for name in [
        "K_DTYPE",
        "V_DTYPE",
        "K_DIM",
        "V_DIM",
        "K_SCALE_PER_TENSOR",
        "V_SCALE_PER_TENSOR",
        "KV_BLOCK_ROWS",
    ] {
        assert!(overrides.contains(&name), "override {name} missing");
    }
    for k in KvDtype::ALL {
        for v in KvDtype::ALL {
            for (kd, vd) in [(64u32, 128u32), (128, 96), (256, 512)] {
                if k.check_head_dim(kd as usize).is_err() || v.check_head_dim(vd as usize).is_err()
                {
                    continue;
                }
                let per_tensor = |d: KvDtype| d.fp8_format().is_some() && kd == 128;
                let mut pc = naga::back::PipelineConstants::default();
                pc.insert("K_DTYPE".into(), k.code() as f64);
                pc.insert("V_DTYPE".into(), v.code() as f64);
                pc.insert("K_DIM".into(), kd as f64);
                pc.insert("V_DIM".into(), vd as f64);
                pc.insert("K_SCALE_PER_TENSOR".into(), per_tensor(k) as u32 as f64);
                pc.insert("V_SCALE_PER_TENSOR".into(), per_tensor(v) as u32 as f64);
                pc.insert("KV_BLOCK_ROWS".into(), if kd == 128 { 48.0 } else { 1.0 });
                let (m, i) = naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    Some((naga::ShaderStage::Compute, "main")),
                    &pc,
                )
                .unwrap_or_else(|e| panic!("{k}/{v}: {e:?}"));
                naga::back::spv::write_vec(&m, &i, &naga::back::spv::Options::default(), None)
                    .unwrap_or_else(|e| panic!("{k}/{v}: {e:?}"));
            }
        }
    }
}
