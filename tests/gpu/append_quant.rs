//! Quantize-on-write: `append_kv` into FP8 (per-row and per-tensor scales), int8 and int4 pools,
//! checked word for word (values and scale words) against the CPU codec `quant::encode_rows`,
//! over random and edge-case rows, head dims, KV heads, block sizes, shuffled pools and both
//! source dtypes; and the exact integer arithmetic of `kv_store.wgsl` against Rust's f32.

use kvattn::cache::append_kv::SourceDtype;
use kvattn::cache::paged::{AppendBatch, PagedKvCache, PagedKvConfig, PoolSize};
use kvattn::cache::scales::CacheScales;
use kvattn::quant::f16::{f16_bits_to_f32, f32_to_f16_bits};
use kvattn::quant::fp8::{encode_e4m3, encode_e5m2};
use kvattn::quant::pack::pack_halves;
use kvattn::quant::{decode_rows, encode_rows, EncodedRows, KvDtype, ScaleMode, INT4_GROUP};

use crate::common::{gpu, Rng};

// ------------------------------------------------------------------------------------------
// Test data.

/// Kinds of token rows; every append cycles through them.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Gaussian values times a random scale from 1e-3 to 1e3.
    Gaussian,
    /// Gaussian values each times its own power of two (a wide dynamic range).
    DynamicRange,
    /// +0 everywhere.
    Zeros,
    /// -0 everywhere.
    NegZeros,
    /// Random signed zeros.
    MixedZeros,
    /// f32 subnormals only.
    Subnormals,
    /// Subnormals mixed with tiny and ordinary normal values.
    MixedSubnormals,
    /// Random f32 bit patterns (finite and in the format's range for int8/int4).
    RandomBits,
    /// Constant runs (every group of 32 values, or of 4, one random value).
    Constant,
    /// Values exactly halfway between two codes after scaling.
    Ties,
    /// Values around the scale rules' boundaries (FP8 exponent steps, the smallest normal int8
    /// scale, f16-subnormal int4 scales).
    Boundaries,
    /// FP8 only: values at and over saturation, infinities and NaN.
    Saturation,
}

const KINDS: [Kind; 12] = [
    Kind::Gaussian,
    Kind::DynamicRange,
    Kind::Zeros,
    Kind::NegZeros,
    Kind::MixedZeros,
    Kind::Subnormals,
    Kind::MixedSubnormals,
    Kind::RandomBits,
    Kind::Constant,
    Kind::Ties,
    Kind::Boundaries,
    Kind::Saturation,
];

/// 2^k, exact (subnormal powers included).
fn pow2(k: i32) -> f32 {
    2f64.powi(k) as f32
}

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[(rng.next_u64() % xs.len() as u64) as usize]
}

fn signed(x: f32, rng: &mut Rng) -> f32 {
    if rng.next_u64() & 1 == 1 {
        -x
    } else {
        x
    }
}

fn subnormal(rng: &mut Rng) -> f32 {
    let bits = (rng.next_u64() as u32) & 0x807F_FFFF;
    f32::from_bits(bits)
}

/// The tensor a row is written to: storage format and scale mode.
#[derive(Debug, Clone, PartialEq)]
struct Tensor {
    dtype: KvDtype,
    scales: CacheScales,
    head_dim: usize,
}

impl Tensor {
    fn new(dtype: KvDtype, scales: CacheScales, head_dim: usize) -> Self {
        Self {
            dtype,
            scales,
            head_dim,
        }
    }

    fn mode(&self) -> ScaleMode {
        self.scales.mode(0)
    }

    /// The factor values are multiplied by before encoding (1 without a per-tensor scale).
    fn tensor_scale(&self) -> f32 {
        match self.mode() {
            ScaleMode::PerTensor(s) => s,
            ScaleMode::PerRow => 1.0,
        }
    }

    /// Largest magnitude allowed in int8/int4 input (their CPU encoder refuses non-finite
    /// values, and int4 groups must keep their scale and min in the f16 range).
    fn max_abs(&self, src: SourceDtype) -> f32 {
        match (self.dtype, src) {
            (KvDtype::Int4, _) | (KvDtype::Int8, SourceDtype::F16) => 30000.0,
            (KvDtype::Int8, SourceDtype::F32) => f32::MAX,
            _ => f32::INFINITY,
        }
    }
}

/// One row of `t.head_dim` values of `kind` for tensor `t`.
fn row(rng: &mut Rng, t: &Tensor, src: SourceDtype, kind: Kind) -> Vec<f32> {
    let d = t.head_dim;
    let lim = t.max_abs(src);
    let fp8 = t.dtype.fp8_format();
    let ts = t.tensor_scale();
    let mut v: Vec<f32> = match kind {
        Kind::Gaussian => {
            let s = 10f32.powf(rng.uniform() as f32 * 6.0 - 3.0);
            rng.normals(d, s)
        }
        Kind::DynamicRange => (0..d)
            .map(|_| rng.normal() * pow2((rng.next_u64() % 61) as i32 - 30))
            .collect(),
        Kind::Zeros => vec![0.0; d],
        Kind::NegZeros => vec![-0.0; d],
        Kind::MixedZeros => (0..d).map(|_| signed(0.0, rng)).collect(),
        Kind::Subnormals => (0..d).map(|_| subnormal(rng)).collect(),
        Kind::MixedSubnormals => (0..d)
            .map(|i| match i % 4 {
                0 | 1 => subnormal(rng),
                2 => signed(f32::MIN_POSITIVE * (1.0 + rng.uniform() as f32 * 8.0), rng),
                _ => rng.normal() * pow2(-((rng.next_u64() % 130) as i32)),
            })
            .collect(),
        Kind::RandomBits => (0..d)
            .map(|_| {
                let b = rng.next_u64() as u32;
                if t.dtype.fp8_format().is_some() {
                    f32::from_bits(b)
                } else {
                    // Finite, exponent below the limit.
                    let max_field = if lim.is_finite() && lim < 1e30 {
                        141
                    } else {
                        254
                    };
                    let field = ((b >> 23) & 0xFF) % (max_field + 1);
                    f32::from_bits((b & 0x807F_FFFF) | (field << 23))
                }
            })
            .collect(),
        Kind::Constant => {
            let run = if t.dtype == KvDtype::Int4 {
                INT4_GROUP
            } else {
                4
            };
            let mut out = Vec::with_capacity(d);
            while out.len() < d {
                let c = match rng.next_u64() % 4 {
                    0 => 0.0,
                    1 => signed(0.0, rng),
                    2 => subnormal(rng),
                    _ => rng.normal() * pow2((rng.next_u64() % 21) as i32 - 10),
                };
                out.extend(std::iter::repeat_n(c, run));
            }
            out
        }
        Kind::Ties => ties(rng, t, d, ts),
        Kind::Boundaries => boundaries(rng, t, d, ts),
        Kind::Saturation => match fp8 {
            Some(_) => {
                let specials = [
                    448.0,
                    449.0,
                    464.0,
                    480.0,
                    57344.0,
                    61440.0,
                    65536.0,
                    1e30,
                    f32::MAX,
                    f32::INFINITY,
                    f32::NAN,
                    f32::from_bits(0x7FBF_FFFF), // signalling NaN with payload
                ];
                (0..d)
                    .map(|i| {
                        if i % 3 == 0 {
                            rng.normal() * 100.0 * ts
                        } else {
                            signed(
                                pick(rng, &specials) * if i % 2 == 0 { ts } else { 1.0 },
                                rng,
                            )
                        }
                    })
                    .collect()
            }
            None => rng.normals(d, 1000.0),
        },
    };
    // The per-group kinds fill whole groups of 32; a head dim that is not a multiple (80) gets
    // Gaussian values after them.
    while v.len() < d {
        v.push(rng.normal());
    }
    // Keep int8/int4 input inside their contract.
    for x in &mut v {
        if x.abs() > lim {
            *x = x.signum() * lim;
        }
    }
    v
}

/// A row whose values, once scaled, lie exactly halfway between two codes (ties to even).
fn ties(rng: &mut Rng, t: &Tensor, d: usize, ts: f32) -> Vec<f32> {
    match t.dtype {
        KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 => {
            let fmt = t.dtype.fp8_format().unwrap();
            let max_code = if t.dtype == KvDtype::Fp8E4M3 {
                0x7E
            } else {
                0x7B
            };
            // Per-row: the row's amax max * 2^j makes the scale 2^j; per-tensor: values times
            // the tensor scale (exact ties when it is a power of two).
            let j = if t.mode() == ScaleMode::PerRow {
                (rng.next_u64() % 41) as i32 - 20
            } else {
                0
            };
            let f = pow2(j) * ts;
            let mut v = vec![signed(fmt.max_value(), rng) * f];
            while v.len() < d {
                let c = (rng.next_u64() % max_code) as u8;
                let lo = fmt.decode(c) as f64;
                let hi = fmt.decode(c + 1) as f64;
                v.push(signed(((lo + hi) / 2.0) as f32, rng) * f);
            }
            v
        }
        KvDtype::Int8 => {
            // amax 127 * 2^j: scale 2^j exactly, values (n + 1/2) * 2^j.
            let f = pow2((rng.next_u64() % 31) as i32 - 15);
            let mut v = vec![signed(127.0 * f, rng)];
            while v.len() < d {
                let n = (rng.next_u64() % 254) as f32 - 127.0;
                v.push((n + 0.5) * f);
            }
            v
        }
        _ => {
            // Per group: min a = m * 2^j and max a + 15 * 2^j: f16 scale 2^j, min a exactly,
            // values a + (n + 1/2) * 2^j.
            let mut v = Vec::with_capacity(d);
            for _ in 0..d / INT4_GROUP {
                let j = (rng.next_u64() % 15) as i32 - 10;
                let f = pow2(j);
                let a = ((rng.next_u64() % 2001) as f32 - 1000.0) * f;
                v.push(a);
                v.push(a + 15.0 * f);
                while v.len() % INT4_GROUP != 0 {
                    let n = (rng.next_u64() % 15) as f32;
                    v.push(a + (n + 0.5) * f);
                }
            }
            v
        }
    }
}

/// A row around the boundaries of the scale rules.
fn boundaries(rng: &mut Rng, t: &Tensor, d: usize, ts: f32) -> Vec<f32> {
    let step = |x: f32, k: i32| f32::from_bits((x.to_bits() as i64 + k as i64) as u32);
    match t.dtype {
        KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 => {
            // amax just below, at and just above max * 2^j (per-tensor: the tensor's max).
            let fmt = t.dtype.fp8_format().unwrap();
            let j = (rng.next_u64() % 200) as i32 - 140;
            let base = if t.mode() == ScaleMode::PerRow {
                fmt.max_value() * pow2(j)
            } else {
                fmt.max_value() * ts
            };
            let amax = step(base, (rng.next_u64() % 5) as i32 - 2);
            let mut v = vec![signed(amax, rng)];
            while v.len() < d {
                let k = (rng.next_u64() % 9) as i32 - 4;
                let x = if rng.next_u64() % 2 == 0 {
                    step(amax, -k.abs())
                } else {
                    amax * rng.uniform() as f32
                };
                v.push(signed(x, rng));
            }
            v
        }
        KvDtype::Int8 => {
            // amax near 127 * 2^-126: amax / 127 just below the smallest normal rounds up to it
            // (a normal scale) or stays subnormal (scale 0).
            let amax = step(127.0 * f32::MIN_POSITIVE, (rng.next_u64() % 9) as i32 - 4);
            let mut v = vec![signed(amax, rng)];
            while v.len() < d {
                v.push(signed(amax * rng.uniform() as f32, rng));
            }
            v
        }
        _ => {
            // Groups whose f16 scale is subnormal, zero, or tiny-normal.
            let mut v = Vec::with_capacity(d);
            for _ in 0..d / INT4_GROUP {
                let span = pow2(-((rng.next_u64() % 24) as i32) - 10);
                let lo = signed(rng.uniform() as f32 * span, rng);
                for _ in 0..INT4_GROUP {
                    v.push(lo + rng.uniform() as f32 * span);
                }
            }
            v
        }
    }
}

// ------------------------------------------------------------------------------------------
// Appending through the paged cache and comparing with the CPU codec.

fn f16_round(x: f32) -> f32 {
    f16_bits_to_f32(f32_to_f16_bits(x))
}

/// Asserts `got == want` word for word (values, then scale words), naming the first bad row
/// and its input.
fn assert_same(what: &str, got: &EncodedRows, want: &EncodedRows, x: &[f32]) {
    assert_eq!(
        (got.dtype, got.head_dim, got.scale_mode),
        (want.dtype, want.head_dim, want.scale_mode),
        "{what}: format"
    );
    let d = want.head_dim;
    let wpr = want.dtype.words_per_row(d);
    let spr = want.dtype.scale_words_per_row(d, want.scale_mode);
    assert_eq!(got.words.len(), want.words.len(), "{what}: value words");
    assert_eq!(got.scales.len(), want.scales.len(), "{what}: scale words");
    let bad_row = got
        .words
        .iter()
        .zip(&want.words)
        .position(|(g, w)| g != w)
        .map(|i| (i / wpr, "values"))
        .or_else(|| {
            got.scales
                .iter()
                .zip(&want.scales)
                .position(|(g, w)| g != w)
                .map(|i| (i / spr, "scales"))
        });
    if let Some((r, part)) = bad_row {
        let bits: Vec<String> = x[r * d..(r + 1) * d]
            .iter()
            .map(|v| format!("{:08x}", v.to_bits()))
            .collect();
        panic!(
            "{what}: row {r} differs in its {part}\n GPU values {:08x?}\n CPU values {:08x?}\n \
             GPU scales {:08x?}\n CPU scales {:08x?}\n input bits [{}]",
            &got.words[r * wpr..(r + 1) * wpr],
            &want.words[r * wpr..(r + 1) * wpr],
            &got.scales[r * spr..(r + 1) * spr],
            &want.scales[r * spr..(r + 1) * spr],
            bits.join(" ")
        );
    }
}

/// A one-layer cache with K in `k` and V in `v`, `heads` KV heads, shuffled free blocks.
fn new_cache(k: &Tensor, v: &Tensor, heads: usize, block_size: usize, seed: u64) -> PagedKvCache {
    let cfg = PagedKvConfig {
        layers: 1,
        num_kv_heads: heads,
        head_dim_k: k.head_dim,
        head_dim_v: v.head_dim,
        k_dtype: k.dtype,
        v_dtype: v.dtype,
        k_scales: k.scales.clone(),
        v_scales: v.scales.clone(),
        block_size,
        prefix_caching: false,
        model_id: String::new(),
    };
    let mut cache = PagedKvCache::new(gpu(), cfg, PoolSize::Blocks(64 / block_size + 9)).unwrap();
    cache.shuffle_free_blocks(seed);
    cache
}

/// Appends a few batches of rows (every [`Kind`] in turn, then random kinds) to sequence 0 in
/// `src`; returns the values the CPU sees for K and V (f16-rounded for an f16 source).
fn append_rows(
    cache: &mut PagedKvCache,
    k: &Tensor,
    v: &Tensor,
    src: SourceDtype,
    rng: &mut Rng,
) -> (Vec<f32>, Vec<f32>) {
    let ctx = gpu();
    let heads = cache.config().num_kv_heads;
    cache.add_sequence(0, &[]).unwrap();
    let (mut kx, mut vx) = (Vec::new(), Vec::new());
    let mut r = 0;
    for n in [7usize, 1, 17, 4, 19] {
        let mut kn = Vec::new();
        let mut vn = Vec::new();
        for _ in 0..n * heads {
            let kind = if r < KINDS.len() {
                KINDS[r]
            } else {
                pick(rng, &KINDS)
            };
            kn.extend(row(rng, k, src, kind));
            let v_kind = pick(rng, &KINDS);
            vn.extend(row(rng, v, src, v_kind));
            r += 1;
        }
        let tokens: Vec<u32> = (0..n as u32).collect();
        match src {
            SourceDtype::F32 => {
                cache
                    .append_host(ctx, 0, &tokens, &[kn.clone()], &[vn.clone()])
                    .unwrap();
            }
            SourceDtype::F16 => {
                let halves = |x: &[f32]| -> Vec<u32> {
                    pack_halves(&x.iter().map(|&v| f32_to_f16_bits(v)).collect::<Vec<_>>())
                };
                let kb = ctx.upload("k f16", &halves(&kn)).unwrap();
                let vb = ctx.upload("v f16", &halves(&vn)).unwrap();
                let mut batch = AppendBatch::new();
                cache.append_tokens(ctx, &mut batch, 0, &tokens).unwrap();
                cache.write_layer(ctx, 0, &batch, &kb, &vb, src).unwrap();
                kn.iter_mut().for_each(|x| *x = f16_round(*x));
                vn.iter_mut().for_each(|x| *x = f16_round(*x));
            }
        }
        kx.extend(kn);
        vx.extend(vn);
    }
    (kx, vx)
}

/// Writes rows of every kind into K (`k`) and V (`v`) for every head dim, head count, block
/// size and source, and checks the stored words and scales against `encode_rows`.
fn check_grid(what: &str, pairs: &[(Tensor, Tensor)], seed: u64) {
    let ctx = gpu();
    let mut rng = Rng::new(seed);
    for (i, (k, v)) in pairs.iter().enumerate() {
        for (heads, block_size) in [(1usize, 1usize), (3, 16), (2, 1), (2, 16)] {
            for src in [SourceDtype::F32, SourceDtype::F16] {
                let label = format!(
                    "{what}: K {} {:?} d{} / V {} {:?} d{}, {heads} heads, block {block_size}, \
                     {src:?} source",
                    k.dtype,
                    k.mode(),
                    k.head_dim,
                    v.dtype,
                    v.mode(),
                    v.head_dim
                );
                let mut cache = new_cache(k, v, heads, block_size, seed + i as u64);
                let (kx, vx) = append_rows(&mut cache, k, v, src, &mut rng);
                let (kr, vr) = cache.read_rows(ctx, 0, 0).unwrap();
                let want_k = encode_rows(k.dtype, k.head_dim, &kx, k.mode()).unwrap();
                let want_v = encode_rows(v.dtype, v.head_dim, &vx, v.mode()).unwrap();
                assert_same(&format!("{label}: K"), &kr, &want_k, &kx);
                assert_same(&format!("{label}: V"), &vr, &want_v, &vx);
            }
        }
    }
}

fn per_row(dtype: KvDtype, d: usize) -> Tensor {
    Tensor::new(dtype, CacheScales::PerRow, d)
}

fn per_tensor(dtype: KvDtype, scale: f32, d: usize) -> Tensor {
    Tensor::new(dtype, CacheScales::PerTensor(vec![scale]), d)
}

#[test]
fn fp8_per_row_append_matches_cpu_codec() {
    let mut pairs = Vec::new();
    for (dk, dv) in [(32, 64), (64, 36), (96, 128), (128, 32)] {
        pairs.push((per_row(KvDtype::Fp8E4M3, dk), per_row(KvDtype::Fp8E5M2, dv)));
    }
    pairs.push((per_row(KvDtype::Fp8E5M2, 64), per_row(KvDtype::Fp8E4M3, 4)));
    check_grid("fp8 per-row", &pairs, 1);
}

#[test]
fn fp8_per_tensor_append_matches_cpu_codec() {
    // Power-of-two and arbitrary scales, down to the smallest one whose reciprocal is normal
    // (there f32 subnormal inputs give nonzero codes).
    let scales = [
        1.0f32,
        0.25,
        0.3712,
        1.7e-3,
        300.0,
        f32::MIN_POSITIVE,
        3.0e37,
    ];
    let dims = [32, 64, 96, 128];
    let mut pairs = Vec::new();
    for (i, &s) in scales.iter().enumerate() {
        let dk = dims[i % 4];
        let dv = dims[(i + 1) % 4];
        let sv = scales[(i + 3) % scales.len()];
        pairs.push((
            per_tensor(KvDtype::Fp8E4M3, s, dk),
            per_tensor(KvDtype::Fp8E5M2, sv, dv),
        ));
        pairs.push((
            per_tensor(KvDtype::Fp8E5M2, s, dv),
            per_row(KvDtype::Fp8E4M3, dk),
        ));
    }
    check_grid("fp8 per-tensor", &pairs, 2);
}

#[test]
fn int8_append_matches_cpu_codec() {
    let mut pairs = Vec::new();
    for (dk, dv) in [(32, 64), (64, 36), (96, 128), (128, 32), (4, 1024)] {
        pairs.push((per_row(KvDtype::Int8, dk), per_row(KvDtype::Int8, dv)));
    }
    check_grid("int8", &pairs, 3);
}

#[test]
fn int4_append_matches_cpu_codec() {
    let mut pairs = Vec::new();
    for (dk, dv) in [(32, 64), (64, 96), (96, 128), (128, 32), (1024, 32)] {
        pairs.push((per_row(KvDtype::Int4, dk), per_row(KvDtype::Int4, dv)));
    }
    check_grid("int4", &pairs, 4);
}

#[test]
fn mixed_k_and_v_formats_append_matches_cpu_codec() {
    let pairs = [
        (
            per_row(KvDtype::Int4, 64),
            per_tensor(KvDtype::Fp8E5M2, 0.3712, 32),
        ),
        (per_row(KvDtype::Int8, 96), per_row(KvDtype::Int4, 128)),
        (per_row(KvDtype::Fp8E4M3, 128), per_row(KvDtype::Int8, 64)),
        (per_row(KvDtype::F16, 64), per_row(KvDtype::Int4, 64)),
        (per_row(KvDtype::Int8, 32), per_row(KvDtype::Bf16, 32)),
        // Unscaled rows whose last 16-byte chunk is partial, f16 sources not whole 16-byte
        // units (read word by word; at head dim 4 a one-row source is 8 bytes).
        (per_row(KvDtype::F16, 12), per_row(KvDtype::Bf16, 20)),
        (per_row(KvDtype::F32, 36), per_row(KvDtype::F16, 4)),
    ];
    check_grid("mixed", &pairs, 5);
}

/// Every storage format (FP8 per row and per tensor) at head dims 64, 80, 96, 128 and 256 (int4:
/// its multiples of 32), K and V at different dims: the kernel's lanes per row and rows per
/// workgroup vary with the row's 16-byte chunks (1 to 64 lanes), and `check_grid`'s batches
/// (7, 1, 17, 4 and 19 rows, 1 to 3 heads) leave partial last workgroups.
#[test]
fn every_format_and_head_dim_append_matches_cpu_codec() {
    let mut pairs = Vec::new();
    for dtype in KvDtype::ALL {
        let dims: &[(usize, usize)] = if dtype == KvDtype::Int4 {
            &[(64, 96), (128, 256)]
        } else {
            &[(64, 80), (96, 128), (256, 80)]
        };
        for &(dk, dv) in dims {
            pairs.push((per_row(dtype, dk), per_row(dtype, dv)));
            if dtype.fp8_format().is_some() {
                pairs.push((per_tensor(dtype, 0.25, dk), per_tensor(dtype, 3.0, dv)));
            }
        }
    }
    check_grid("every format", &pairs, 6);
}

/// Every f16 bit pattern (NaN payloads, signalling NaNs, infinities, subnormals, both zeros) as
/// an f16 source, appended into f16 and bf16 pools and into f32 and int8 ones: the stored words
/// equal the CPU codec's encoding of the same values as f32 (f16 into f16 takes the kernel's
/// shortcut, which must still quiet NaNs exactly as the f32 round trip does).
#[test]
fn every_f16_source_pattern_appends_as_the_cpu_codec_encodes_it() {
    let ctx = gpu();
    let d = 128;
    let bits: Vec<u16> = (0..=u16::MAX).collect();
    let x: Vec<f32> = bits.iter().map(|&h| f16_bits_to_f32(h)).collect();
    let tokens: Vec<u32> = (0..(x.len() / d) as u32).collect();
    let src = ctx.upload("f16 patterns", &pack_halves(&bits)).unwrap();
    for (kt, vt) in [
        (per_row(KvDtype::F16, d), per_row(KvDtype::Bf16, d)),
        (per_row(KvDtype::F32, d), per_row(KvDtype::Int8, d)),
    ] {
        let mut cache = new_cache(&kt, &vt, 1, 64, 80);
        cache.add_sequence(0, &[]).unwrap();
        let mut batch = AppendBatch::new();
        cache.append_tokens(ctx, &mut batch, 0, &tokens).unwrap();
        cache
            .write_layer(ctx, 0, &batch, &src, &src, SourceDtype::F16)
            .unwrap();
        let (k, v) = cache.read_rows(ctx, 0, 0).unwrap();
        for (t, got) in [(&kt, &k), (&vt, &v)] {
            let want = encode_rows(t.dtype, d, &x, t.mode()).unwrap();
            let first = got.words.iter().zip(&want.words).position(|(g, w)| g != w);
            assert_eq!(first, None, "{}: first differing word", t.dtype);
            assert_eq!(got.words.len(), want.words.len(), "{}", t.dtype);
            assert_eq!(got.scales, want.scales, "{} scales", t.dtype);
        }
    }
}

#[test]
fn quantized_read_f32_matches_cpu_decode() {
    let ctx = gpu();
    let mut rng = Rng::new(6);
    let tensors = [
        per_row(KvDtype::Fp8E4M3, 64),
        per_row(KvDtype::Fp8E5M2, 96),
        per_tensor(KvDtype::Fp8E4M3, 0.3712, 32),
        per_tensor(KvDtype::Fp8E5M2, 4.0, 128),
        per_row(KvDtype::Int8, 64),
        per_row(KvDtype::Int4, 96),
    ];
    for (i, k) in tensors.iter().enumerate() {
        let v = &tensors[(i + 1) % tensors.len()];
        let mut cache = new_cache(k, v, 2, 16, 60 + i as u64);
        let (kx, vx) = append_rows(&mut cache, k, v, SourceDtype::F32, &mut rng);
        let (kf, vf) = cache.read_f32(ctx, 0, 0).unwrap();
        for (t, x, got) in [(k, &kx, &kf), (v, &vx, &vf)] {
            let want =
                decode_rows(&encode_rows(t.dtype, t.head_dim, x, t.mode()).unwrap()).unwrap();
            assert_eq!(got.len(), want.len());
            for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "{} {:?}: element {j}: GPU {g:e} vs CPU {w:e}",
                    t.dtype,
                    t.mode()
                );
            }
        }
    }
}

/// NaN, infinities and values at f32's extremes, appended on the GPU in every format: the
/// stored words and scales equal the CPU codec's (`encode_rows`, which takes every value), and
/// the per-format rules hold (README, "NaN, infinities and extreme values"): int8 rows and
/// int4 groups holding a non-finite value, or int4 values beyond f16's range, are poisoned
/// (NaN scale, codes 0: they read NaN); FP8 rows at f32's extremes read finite values.
#[test]
fn non_finite_and_extreme_input_matches_the_cpu_codec() {
    let ctx = gpu();
    let mut rng = Rng::new(7);
    let d = 64;
    let specials = [f32::NAN, -f32::NAN, f32::INFINITY, -f32::INFINITY];
    // Row r: Gaussian values with a few specials (row 0: NaN only; row 1: an infinity too;
    // rows 2, 3: int4 groups beyond the f16 range; row 4: one group of +infinity only; row 5:
    // f32's extremes, finite; rows 6, 7: random specials).
    let mut x = Vec::new();
    for r in 0..8 {
        let mut v = rng.normals(d, 3.0);
        match r {
            0 => v[5] = f32::NAN,
            1 => {
                v[3] = -f32::NAN;
                v[40] = f32::INFINITY;
            }
            2 => v.iter_mut().for_each(|x| *x = *x * 1e4 + 70000.0),
            3 => v[..32].iter_mut().for_each(|x| *x -= 70000.0),
            4 => v[32..].iter_mut().for_each(|x| *x = f32::INFINITY),
            5 => {
                v[0] = -3.4e38;
                v[1] = f32::MAX;
                v[2] = -f32::MAX;
            }
            _ => {
                for _ in 0..6 {
                    let i = (rng.next_u64() % d as u64) as usize;
                    v[i] = pick(&mut rng, &specials);
                }
            }
        }
        x.extend(v);
    }
    let tokens: Vec<u32> = (0..8).collect();
    let formats = [
        (per_row(KvDtype::Int8, d), per_row(KvDtype::Int4, d)),
        (per_row(KvDtype::Fp8E4M3, d), per_row(KvDtype::Fp8E5M2, d)),
        (per_row(KvDtype::F16, d), per_row(KvDtype::Bf16, d)),
    ];
    for (i, (kt, vt)) in formats.iter().enumerate() {
        let mut cache = new_cache(kt, vt, 1, 16, 70 + i as u64);
        cache.add_sequence(0, &[]).unwrap();
        cache
            .append_host(ctx, 0, &tokens, &[x.clone()], &[x.clone()])
            .unwrap();
        let (k, v) = cache.read_rows(ctx, 0, 0).unwrap();
        for (t, got) in [(kt, &k), (vt, &v)] {
            let want = encode_rows(t.dtype, d, &x, t.mode()).unwrap();
            assert_eq!(got.words, want.words, "{} words", t.dtype);
            assert_eq!(got.scales, want.scales, "{} scales", t.dtype);
            let back = decode_rows(got).unwrap();
            let row = |r: usize| &back[r * d..(r + 1) * d];
            match t.dtype {
                KvDtype::Int8 => {
                    for r in [0, 1, 4, 6, 7] {
                        assert_eq!(got.scales[r], 0x7FC0_0000, "int8 row {r} poisoned");
                        assert!(row(r).iter().all(|x| x.is_nan()), "int8 row {r}");
                    }
                    assert!(row(5).iter().all(|x| x.is_finite()), "int8 extremes");
                    assert!(row(5)[0] < -3.0e38 && row(5)[1] > 3.0e38);
                }
                KvDtype::Int4 => {
                    // Groups (two per row): NaN in group 0 of row 0, infinity in group 1 of
                    // row 1, a min beyond f16 in group 0 of row 3, +inf in group 1 of row 4,
                    // f32's extremes in group 0 of row 5. (Row 2's groups are poisoned only
                    // where their min leaves f16; the words above match the CPU either way.)
                    for g in [0, 3, 6, 9, 10] {
                        assert_eq!(got.scales[g], 0x7E00_7E00, "int4 group {g} poisoned");
                        assert!(back[g * 32..][..32].iter().all(|x| x.is_nan()), "group {g}");
                    }
                    assert!(back[32..64].iter().all(|x| x.is_finite()));
                }
                KvDtype::Fp8E4M3 | KvDtype::Fp8E5M2 => {
                    assert!(row(5).iter().all(|x| x.is_finite()), "{} extremes", t.dtype);
                    assert!(row(5)[0] < -2.9e38 && row(5)[1] > 2.9e38, "{}", t.dtype);
                    assert!(row(0)[5].is_nan() && row(0)[4].is_finite());
                    let inf = row(1)[40];
                    if t.dtype == KvDtype::Fp8E5M2 {
                        assert_eq!(inf, f32::INFINITY);
                    } else {
                        assert!(inf.is_nan(), "E4M3 has no infinity: {inf}");
                    }
                }
                _ => {
                    // f16 and bf16: f32's extremes overflow to infinity, NaN stays NaN.
                    assert_eq!(row(5)[0], f32::NEG_INFINITY, "{}", t.dtype);
                    assert_eq!(row(5)[1], f32::INFINITY, "{}", t.dtype);
                    assert!(row(0)[5].is_nan() && row(1)[40] == f32::INFINITY);
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// The arithmetic of kv_store.wgsl against Rust's f32, on random and edge-case bit patterns.

const HARNESS: &str = r#"
@group(0) @binding(0) var<storage, read> ab: array<vec2<u32>>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= arrayLength(&ab) {
        return;
    }
    let a = ab[i].x;
    let b = ab[i].y;
    out[2u * i] = vec4<u32>(kv_mul_bits(a, b), kv_div_bits(a, b), kv_add_bits(a, b), kv_sub_bits(a, b));
    out[2u * i + 1u] = vec4<u32>(
        bitcast<u32>(kv_round_clamp(a, -127, 127)),
        u32(kv_round_clamp(b, 0, 15)),
        kv_encode_e4m3(a),
        kv_encode_e5m2(b),
    );
}
"#;

/// A random f32 bit pattern biased to edge cases: every exponent class, extreme mantissas.
fn edge_bits(rng: &mut Rng) -> u32 {
    let r = rng.next_u64();
    let sign = (r as u32) & 0x8000_0000;
    let field = match (r >> 32) % 8 {
        0 => 0,
        1 => 1 + (r >> 40) as u32 % 3,
        2 => 255,
        3 => 252 + (r >> 40) as u32 % 3,
        4 => 100 + (r >> 40) as u32 % 55,
        _ => (r >> 40) as u32 % 256,
    };
    let mant = match (r >> 48) % 6 {
        0 => 0,
        1 => 1,
        2 => 0x7F_FFFF,
        3 => 0x40_0000,
        _ => (rng.next_u64() as u32) & 0x7F_FFFF,
    };
    sign | (field << 23) | mant
}

/// Pairs exercising every path: raw random bits, edge cases, products and quotients near the
/// subnormal boundary, products by powers of two at both ends of the normal range, sums with
/// cancellation and every exponent difference.
fn arithmetic_pairs(n: usize) -> Vec<[u32; 2]> {
    let mut rng = Rng::new(8);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let a = rng.next_u64() as u32;
        let b = rng.next_u64() as u32;
        let pair = match out.len() % 7 {
            0 => [a, b],
            1 => [edge_bits(&mut rng), edge_bits(&mut rng)],
            2 => {
                // Product exponent near the subnormal range: fa + fb - 127 in -26..=3.
                let fa = 1 + (a >> 8) % 254;
                let target = (b >> 8) % 30;
                let fb = (target as i32 + 127 - 26 - fa as i32).clamp(0, 254) as u32;
                [
                    (a & 0x807F_FFFF) | (fa << 23),
                    (b & 0x807F_FFFF) | (fb << 23),
                ]
            }
            3 => {
                // Quotient exponent near the subnormal range: fa - fb + 127 in -26..=3.
                let fa = (a >> 8) % 255;
                let target = (b >> 8) % 30;
                let fb = (fa as i32 + 127 + 26 - target as i32).clamp(0, 254) as u32;
                [
                    (a & 0x807F_FFFF) | (fa << 23),
                    (b & 0x807F_FFFF) | (fb << 23),
                ]
            }
            4 => {
                // Sums: opposite signs and nearby magnitudes (cancellation), small gaps.
                let fa = (a >> 8) % 255;
                let gap = (b >> 8) % 40;
                let fb = fa.saturating_sub(gap);
                let mb = if gap < 2 {
                    (a ^ (b & 0xFF)) & 0x7F_FFFF
                } else {
                    b & 0x7F_FFFF
                };
                [
                    (a & 0x807F_FFFF) | (fa << 23),
                    ((a ^ (b & 0x8000_0000)) & 0x8000_0000) | (fb << 23) | mb,
                ]
            }
            5 => {
                // b a power of two (kv_mul_bits' exponent-add path, per-row FP8 scaling), product
                // exponent fields at both ends of the normal range and past them.
                let fa = 1 + (a >> 8) % 254;
                let target = if b & 1 == 0 {
                    ((b >> 8) % 8) as i32 - 3
                } else {
                    250 + ((b >> 8) % 8) as i32
                };
                let fb = (target + 127 - fa as i32).clamp(1, 254) as u32;
                [
                    (a & 0x807F_FFFF) | (fa << 23),
                    (b & 0x8000_0000) | (fb << 23),
                ]
            }
            _ => {
                // Values around integers and halves (rounding to int8/int4 codes, FP8 ties).
                let x = ((a % 600) as f32 - 300.0) * 0.25 * if b & 1 == 0 { 1.0 } else { 8.0 };
                let y = f32::from_bits((x.to_bits() as i64 + (b as i64 % 3) - 1) as u32);
                [x.to_bits(), y.abs().to_bits()]
            }
        };
        out.push(pair);
    }
    out
}

#[test]
fn kv_store_arithmetic_matches_rust_f32() {
    let ctx = gpu();
    let source = [
        include_str!("../../shaders/lib/kv_format.wgsl"),
        include_str!("../../shaders/lib/kv_store.wgsl"),
        HARNESS,
    ]
    .join("\n");
    let module = ctx.compile_wgsl("kv_store harness", &source).unwrap();
    let pipeline = std::sync::Arc::new(ctx.device.create_compute_pipeline(
        &wgpu::ComputePipelineDescriptor {
            label: Some("kv_store harness"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        },
    ));
    let n = 64 * 2048;
    let pairs = arithmetic_pairs(n);
    let input = ctx.upload("pairs", &pairs).unwrap();
    let out = ctx.filled("results", 8 * n, 0u32).unwrap();
    ctx.dispatch(&pipeline, &[&input, &out], [(n / 64) as u32, 1, 1])
        .unwrap();
    let got: Vec<u32> = ctx.read_back(&out, 8 * n).unwrap();
    let same = |g: u32, w: f32| g == w.to_bits() || (w.is_nan() && f32::from_bits(g).is_nan());
    for (i, &[a, b]) in pairs.iter().enumerate() {
        let (x, y) = (f32::from_bits(a), f32::from_bits(b));
        let g = &got[8 * i..8 * i + 8];
        let what = format!("a {a:08x} ({x:e}), b {b:08x} ({y:e})");
        for (op, gv, want) in [
            ("*", g[0], x * y),
            ("/", g[1], x / y),
            ("+", g[2], x + y),
            ("-", g[3], x - y),
        ] {
            assert!(
                same(gv, want),
                "{what}: a {op} b: GPU {gv:08x} ({:e}), Rust {:08x} ({want:e})",
                f32::from_bits(gv),
                want.to_bits()
            );
        }
        let q8 = x.round_ties_even().clamp(-127.0, 127.0) as i8 as i32;
        assert_eq!(g[4] as i32, q8, "{what}: int8 rounding of a");
        let q4 = y.round_ties_even().clamp(0.0, 15.0) as u8 as u32;
        assert_eq!(g[5], q4, "{what}: int4 rounding of b");
        assert_eq!(g[6], u32::from(encode_e4m3(x)), "{what}: E4M3 of a");
        assert_eq!(g[7], u32::from(encode_e5m2(y)), "{what}: E5M2 of b");
    }
}
