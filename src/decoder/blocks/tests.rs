//! The CPU dequantization against hand-made blocks of known values (every code, the 6-bit
//! packed scales, zero and extreme scales) and, bit for bit, against golden vectors from PyPI's
//! `gguf` package (`scripts/gguf-golden.py`).

use half::f16;

use super::kquants::scale_min;
use super::*;

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

/// The 16 code bytes of 32 4-bit codes (element j low nibble, j + 16 high nibble of byte j)
/// and the fifth bits as a little-endian word.
fn pack32(codes: &[u8; 32]) -> (Vec<u8>, [u8; 4]) {
    let qs = (0..16)
        .map(|j| (codes[j] & 15) | (codes[j + 16] & 15) << 4)
        .collect();
    let qh = (0..32).fold(0u32, |w, i| w | u32::from(codes[i] >> 4 & 1) << i);
    (qs, qh.to_le_bytes())
}

#[test]
fn q5_0_and_q5_1_read_every_code() {
    let codes: [u8; 32] = std::array::from_fn(|i| i as u8);
    let (qs, qh) = pack32(&codes);
    let block = [&h(0.5)[..], &qh, &qs].concat();
    let got = dequantize(GgmlType::Q5_0, &block, 32).unwrap();
    let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
    assert_eq!(got, want);
    assert_eq!((got[0], got[31]), (-8.0, 7.5));

    let codes: [u8; 32] = std::array::from_fn(|i| 31 - i as u8);
    let (qs, qh) = pack32(&codes);
    let block = [&h(0.25)[..], &h(-1.0), &qh, &qs].concat();
    let got = dequantize(GgmlType::Q5_1, &block, 32).unwrap();
    let want: Vec<f32> = (0..32).map(|i| (31 - i) as f32 * 0.25 - 1.0).collect();
    assert_eq!(got, want);
    assert_eq!((got[0], got[31]), (6.75, -1.0));
}

/// The 12 bytes holding 6-bit scales `sc` and mins `m` of 8 sub-blocks, packed as ggml does.
fn pack_scales(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for s in 0..4 {
        q[s] = sc[s] | (sc[s + 4] >> 4) << 6;
        q[s + 4] = m[s] | (m[s + 4] >> 4) << 6;
        q[s + 8] = (sc[s + 4] & 15) | (m[s + 4] & 15) << 4;
    }
    q
}

const SC: [u8; 8] = [1, 2, 63, 0, 33, 47, 63, 16];
const MN: [u8; 8] = [0, 63, 1, 2, 60, 7, 63, 31];

#[test]
fn k_quant_scales_unpack_all_six_bits() {
    let q = pack_scales(SC, MN);
    for s in 0..8 {
        assert_eq!(scale_min(s, &q), (SC[s], MN[s]), "sub-block {s}");
    }
    // Every bit of every field reaches its value: all ones gives 63 everywhere.
    for s in 0..8 {
        assert_eq!(scale_min(s, &[0xFF; 12]), (63, 63));
    }
}

/// The code of element e of a test K-quant block: every 5-bit value, varied per sub-block.
fn k_code(e: usize) -> u8 {
    ((e * 7 + e / 32) % 32) as u8
}

/// The code bytes (and Q5_K's fifth-bit bytes) of a block whose element e has code `code(e)`.
fn pack_k(code: impl Fn(usize) -> u8) -> (Vec<u8>, Vec<u8>) {
    let mut qs = vec![0u8; 128];
    let mut qh = vec![0u8; 32];
    for p in 0..4 {
        for l in 0..32 {
            let (lo, hi) = (code(64 * p + l), code(64 * p + 32 + l));
            qs[32 * p + l] = (lo & 15) | (hi & 15) << 4;
            qh[l] |= (lo >> 4 & 1) << (2 * p) | (hi >> 4 & 1) << (2 * p + 1);
        }
    }
    (qs, qh)
}

#[test]
fn q4_k_and_q5_k_apply_each_sub_block_scale_and_min() {
    let (d, dmin) = (0.5f32, 0.25f32);
    let scales = pack_scales(SC, MN);
    let (qs, qh) = pack_k(k_code);
    let want = |bits: u8| -> Vec<f32> {
        (0..256)
            .map(|e| {
                let s = e / 32;
                (d * SC[s] as f32) * (k_code(e) & bits) as f32 - dmin * MN[s] as f32
            })
            .collect()
    };
    let q4 = [&h(d)[..], &h(dmin), &scales, &qs].concat();
    assert_eq!(dequantize(GgmlType::Q4_K, &q4, 256).unwrap(), want(15));
    let q5 = [&h(d)[..], &h(dmin), &scales, &qh, &qs].concat();
    let got = dequantize(GgmlType::Q5_K, &q5, 256).unwrap();
    assert_eq!(got, want(31));
    // Sub-block 2 (scale 63, min 1) at its largest code, 31: 0.5 * 63 * 31 - 0.25.
    let e = (64..96).find(|&e| k_code(e) == 31).unwrap();
    assert_eq!(got[e], 976.25);
}

#[test]
fn q6_k_reads_extreme_codes_and_signed_scales() {
    let code = |e: usize| ((e * 5 + e / 64) % 64) as u8;
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for n in 0..2 {
        for l in 0..32 {
            let c: [u8; 4] = std::array::from_fn(|k| code(128 * n + l + 32 * k));
            ql[64 * n + l] = (c[0] & 15) | (c[2] & 15) << 4;
            ql[64 * n + l + 32] = (c[1] & 15) | (c[3] & 15) << 4;
            qh[32 * n + l] = (0..4).fold(0, |b, k| b | (c[k] >> 4) << (2 * k));
        }
    }
    let scales: [i8; 16] = [
        -128, 127, 1, -1, 0, 64, -64, 3, 5, -7, 9, 11, -13, 15, 100, -100,
    ];
    let d = 2f32.powi(-10);
    let block = [
        &ql[..],
        &qh,
        &scales.map(|s| s as u8)[..],
        &f16::from_f32(d).to_bits().to_le_bytes(),
    ]
    .concat();
    let got = dequantize(GgmlType::Q6_K, &block, 256).unwrap();
    for (e, &y) in got.iter().enumerate() {
        let want = (d * scales[e / 16] as f32) * (code(e) as i32 - 32) as f32;
        assert_eq!(y.to_bits(), want.to_bits(), "element {e}");
    }
    // Codes 0 and 63 are -32 and 31; scale -128 at element 0 (code 0): 2^-10 * -128 * -32.
    assert_eq!((code(0), got[0]), (0, 4.0));
    let e63 = (0..256).find(|&e| code(e) == 63).unwrap();
    assert_eq!(got[e63], (d * scales[e63 / 16] as f32) * 31.0);
}

#[test]
fn zero_scales_give_the_offsets_alone() {
    // Q4_1 with d = 0: every value is m, whatever the codes.
    let block = [&h(0.0)[..], &h(-3.5), &[0xFF; 16]].concat();
    assert_eq!(dequantize(GgmlType::Q4_1, &block, 32).unwrap(), [-3.5; 32]);
    // Q4_K with d = 0: each value is -(dmin * m) of its sub-block.
    let (qs, _) = pack_k(k_code);
    let block = [&h(0.0)[..], &h(2.0), &pack_scales(SC, MN), &qs].concat();
    let got = dequantize(GgmlType::Q4_K, &block, 256).unwrap();
    for (e, &y) in got.iter().enumerate() {
        assert_eq!(y, -(2.0 * MN[e / 32] as f32), "element {e}");
    }
}

#[test]
fn bad_lengths_and_types_are_refused_without_writing() {
    let mut out = [7.0f32; 256];
    // One byte short of a block, and 255 values (not whole blocks of 256).
    assert!(dequantize_into(GgmlType::Q6_K, &[0; 209], &mut out).is_err());
    assert!(dequantize_into(GgmlType::Q6_K, &[0; 210], &mut out[..255]).is_err());
    let e = dequantize_into(GgmlType::Q3_K, &[0; 110], &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Q3_K") && e.contains("Q6_K"), "{e}");
    assert_eq!(out, [7.0; 256]);
}

#[test]
fn supported_types_are_exactly_the_decodable_ones() {
    for id in 0..64 {
        let Some(ty) = GgmlType::from_id(id) else {
            continue;
        };
        let bytes = vec![0u8; ty.block_bytes() as usize];
        let r = dequantize(ty, &bytes, ty.block_size() as usize);
        assert_eq!(r.is_ok(), SUPPORTED.contains(&ty), "{ty}: {r:?}");
        assert_eq!(ty.can_dequantize(), SUPPORTED.contains(&ty), "{ty}");
    }
}

/// One entry of tests/data/gguf_golden.bin.
struct Golden {
    ty: GgmlType,
    blocks: usize,
    bytes: Vec<u8>,
    values: Vec<u32>,
}

fn golden() -> Vec<Golden> {
    let data: &[u8] = include_bytes!("../../../tests/data/gguf_golden.bin");
    let mut at = 0;
    let u32_at = |at: &mut usize| {
        let v = u32::from_le_bytes(data[*at..*at + 4].try_into().unwrap());
        *at += 4;
        v
    };
    assert_eq!(&data[..4], b"KVGG");
    at += 4;
    assert_eq!(u32_at(&mut at), 1, "golden file version");
    let n = u32_at(&mut at);
    let mut out = Vec::new();
    for _ in 0..n {
        let ty = GgmlType::from_id(u32_at(&mut at)).unwrap();
        let blocks = u32_at(&mut at) as usize;
        let len = u32_at(&mut at) as usize;
        let bytes = data[at..at + len].to_vec();
        at += len;
        let count = blocks * ty.block_size() as usize;
        let values = (0..count).map(|_| u32_at(&mut at)).collect();
        out.push(Golden {
            ty,
            blocks,
            bytes,
            values,
        });
    }
    assert_eq!(at, data.len(), "trailing bytes in the golden file");
    out
}

#[test]
fn every_supported_block_type_matches_the_gguf_package_bit_for_bit() {
    let golden = golden();
    let mut seen = Vec::new();
    for g in &golden {
        let n = g.blocks * g.ty.block_size() as usize;
        let got = dequantize(g.ty, &g.bytes, n).unwrap();
        for (i, (y, &want)) in got.iter().zip(&g.values).enumerate() {
            assert_eq!(
                y.to_bits(),
                want,
                "{} value {i} (block {}): {y:e} against the gguf package's {:e}",
                g.ty,
                i / g.ty.block_size() as usize,
                f32::from_bits(want)
            );
        }
        seen.push(g.ty);
    }
    // Every type but F32 (stored as is) has golden values.
    for ty in SUPPORTED.iter().filter(|&&t| t != GgmlType::F32) {
        assert!(seen.contains(ty), "no golden values for {ty}");
    }
}
