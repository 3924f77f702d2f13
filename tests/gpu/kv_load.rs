//! The WGSL decoders of every KV format against the CPU codec, bit for bit.

use kvattn::quant::dequant::dequantize;
use kvattn::quant::{decode_rows, encode_rows, EncodedRows, KvDtype, ScaleMode};

use crate::common::{gpu, Rng};

fn assert_bit_exact(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
        assert!(
            same,
            "{what}: element {i}: GPU {g:e} ({:#010x}) vs CPU {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn all_fp8_codes_decode_bit_exact() {
    let ctx = gpu();
    // 256 codes, four per word, as one row of 256 values; scales: 1, a power of two, and an
    // arbitrary per-tensor scale, plus per-row scales.
    let words: Vec<u32> = (0..64u32)
        .map(|w| (0..4).map(|b| (w * 4 + b) << (8 * b)).sum())
        .collect();
    for dtype in [KvDtype::Fp8E4M3, KvDtype::Fp8E5M2] {
        for scale in [1.0f32, 0.125, 0.3712] {
            let rows = EncodedRows {
                dtype,
                head_dim: 256,
                scale_mode: ScaleMode::PerTensor(scale),
                words: words.clone(),
                scales: Vec::new(),
            };
            let want = decode_rows(&rows).unwrap();
            assert_bit_exact(
                &format!("{dtype} x{scale}"),
                &dequantize(ctx, &rows).unwrap(),
                &want,
            );
        }
        let per_row = EncodedRows {
            dtype,
            head_dim: 32,
            scale_mode: ScaleMode::PerRow,
            words: words.clone(),
            scales: (0..8)
                .map(|r| (0.5f32 * (r as f32 + 1.0)).to_bits())
                .collect(),
        };
        let want = decode_rows(&per_row).unwrap();
        assert_bit_exact(
            &format!("{dtype} per row"),
            &dequantize(ctx, &per_row).unwrap(),
            &want,
        );
    }
}

#[test]
fn random_rows_of_every_format_decode_bit_exact() {
    let ctx = gpu();
    let mut rng = Rng::new(5);
    for dtype in KvDtype::ALL {
        for head_dim in [32usize, 64, 96, 128, 256] {
            let rows = 37;
            let mut x = rng.normals(rows * head_dim, 3.0);
            // Some large and some tiny values to reach saturation and subnormal codes.
            for i in (0..x.len()).step_by(17) {
                x[i] *= 1e3;
            }
            for i in (5..x.len()).step_by(23) {
                x[i] *= 1e-6;
            }
            let modes: &[ScaleMode] = if dtype.fp8_format().is_some() {
                &[ScaleMode::PerRow, ScaleMode::PerTensor(0.75)]
            } else {
                &[ScaleMode::PerRow]
            };
            for &mode in modes {
                let enc = encode_rows(dtype, head_dim, &x, mode).unwrap();
                let want = decode_rows(&enc).unwrap();
                let got = dequantize(ctx, &enc).unwrap();
                assert_bit_exact(&format!("{dtype} d{head_dim} {mode:?}"), &got, &want);
            }
        }
    }
}
