//! ggml's K-quants in blocks of 256 values: Q4_K, Q5_K and Q6_K (the tensors of Q4_K_M and
//! Q5_K_M files), written from the format definitions (ggml's `block_q4_K`, `block_q5_K`,
//! `block_q6_K`).
//!
//! **Q4_K and Q5_K** hold an f16 `d`, an f16 `dmin`, 12 bytes of 6-bit scales and mins for the
//! block's 8 sub-blocks of 32 ([`scale_min`]), then (Q5_K) 32 bytes of fifth bits and 128 bytes
//! of 4-bit codes. Sub-block `s` has scale `d * sc[s]` and offset `dmin * m[s]` (each one f32
//! multiply) and its values are `scale * code - offset`. Codes come in 64-value pieces: byte `l`
//! of piece `p` (code bytes `32p .. 32p + 31`) holds element `64p + l` in its low nibble and
//! `64p + 32 + l` in its high nibble; the fifth bit of element `64p + l` is bit `2p` of
//! `qh[l]`, of element `64p + 32 + l` bit `2p + 1`.
//!
//! **Q6_K** holds 128 bytes of low 4 bits (`ql`), 64 bytes of high 2 bits (`qh`), 16 signed
//! 8-bit scales (one per 16 values) and an f16 `d` at the end. Values are
//! `(d * scale) * (code - 32)`. In each half `n` (128 values; `ql` bytes `64n ..`, `qh` bytes
//! `32n ..`), for `l` in 0..32 the four elements `l`, `l + 32`, `l + 64`, `l + 96` take the low
//! nibbles of `ql[l]` and `ql[l + 32]`, then their high nibbles, with bits 0-1, 2-3, 4-5, 6-7
//! of `qh[l]` on top.

use super::f16_at;

/// Elements per block.
pub const QK_K: usize = 256;

/// Scale and min of sub-block `s` (0..8) from the 12 packed bytes `q`: sub-blocks 0-3 keep
/// them in the low 6 bits of bytes `s` and `s + 4`; sub-blocks 4-7 in the nibbles of byte
/// `s + 4` (scale low, min high) with their top 2 bits in the top bits of bytes `s - 4` (scale)
/// and `s` (min).
pub fn scale_min(s: usize, q: &[u8]) -> (u8, u8) {
    if s < 4 {
        (q[s] & 63, q[s + 4] & 63)
    } else {
        (
            (q[s + 4] & 0x0F) | (q[s - 4] >> 6) << 4,
            (q[s + 4] >> 4) | (q[s] >> 6) << 4,
        )
    }
}

/// Q4_K and Q5_K (`qh` the 32 fifth-bit bytes for Q5_K).
fn q45_k(b: &[u8], qh: Option<&[u8]>, qs: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(&b[0..2]), f16_at(&b[2..4]));
    let packed = &b[4..16];
    for (p, piece) in out.chunks_exact_mut(64).enumerate() {
        let codes = &qs[32 * p..32 * p + 32];
        for half in 0..2 {
            let s = 2 * p + half;
            let (sc, m) = scale_min(s, packed);
            let (scale, offset) = (d * sc as f32, dmin * m as f32);
            for (l, y) in piece[32 * half..32 * half + 32].iter_mut().enumerate() {
                let mut q = (codes[l] >> (4 * half)) & 0x0F;
                if let Some(h) = qh {
                    q |= ((h[l] >> s) & 1) << 4;
                }
                *y = scale * q as f32 - offset;
            }
        }
    }
}

/// Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 code bytes).
pub fn q4_k(b: &[u8], out: &mut [f32]) {
    q45_k(b, None, &b[16..144], out);
}

/// Q5_K (176 bytes: d, dmin, 12 scale bytes, 32 fifth-bit bytes, 128 code bytes).
pub fn q5_k(b: &[u8], out: &mut [f32]) {
    q45_k(b, Some(&b[16..48]), &b[48..176], out);
}

/// Q6_K (210 bytes: 128 low-bit bytes, 64 high-bit bytes, 16 scales, d).
pub fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(&b[208..210]);
    for (n, half) in out.chunks_exact_mut(128).enumerate() {
        let (ql, qh) = (&ql[64 * n..64 * n + 64], &qh[32 * n..32 * n + 32]);
        for l in 0..32 {
            let low = [ql[l] & 0x0F, ql[l + 32] & 0x0F, ql[l] >> 4, ql[l + 32] >> 4];
            for (k, &lo) in low.iter().enumerate() {
                let code = (lo | ((qh[l] >> (2 * k)) & 3) << 4) as i32 - 32;
                let scale = d * (scales[8 * n + l / 16 + 2 * k] as i8) as f32;
                half[l + 32 * k] = scale * code as f32;
            }
        }
    }
}
