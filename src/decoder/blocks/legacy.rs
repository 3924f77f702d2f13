//! ggml's blocks of 32 values: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, written from the format
//! definitions (ggml's `block_q4_0` ... `block_q8_0`).
//!
//! Every block starts with an f16 scale `d` (and, for the `_1` formats, an f16 offset `m`).
//! 4-bit codes are packed two to a byte: byte `j` of the code section holds element `j` in its
//! low nibble and element `j + 16` in its high nibble. The 5-bit formats add a little-endian
//! 32-bit word `qh` whose bit `i` is the fifth (value 16) bit of element `i`. Values are
//! `(code - 8) * d` (Q4_0), `(code - 16) * d` (Q5_0), `code * d + m` (Q4_1, Q5_1) and
//! `q * d` with `q` a signed byte (Q8_0): one f32 multiply, then one f32 add where there is an
//! offset, as ggml and the `gguf` Python package compute them.

use super::f16_at;

/// Elements per block.
pub const QK: usize = 32;

/// The 32 codes of a block with 4-bit codes at `qs` (16 bytes) and, when `qh` is given, the
/// fifth bits from the little-endian word `qh`.
fn codes(qs: &[u8], qh: Option<&[u8]>) -> [u8; QK] {
    let high = qh.map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let mut q = [0u8; QK];
    for (j, &byte) in qs[..QK / 2].iter().enumerate() {
        let h0 = ((high >> j) & 1) as u8;
        let h1 = ((high >> (j + QK / 2)) & 1) as u8;
        q[j] = (byte & 0x0F) | h0 << 4;
        q[j + QK / 2] = (byte >> 4) | h1 << 4;
    }
    q
}

/// Q4_0 (18 bytes: d, 16 code bytes): `(code - 8) * d`.
pub fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(&b[0..2]);
    for (y, &q) in out.iter_mut().zip(&codes(&b[2..18], None)) {
        *y = (q as i32 - 8) as f32 * d;
    }
}

/// Q4_1 (20 bytes: d, m, 16 code bytes): `code * d + m`.
pub fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(&b[0..2]), f16_at(&b[2..4]));
    for (y, &q) in out.iter_mut().zip(&codes(&b[4..20], None)) {
        *y = q as f32 * d + m;
    }
}

/// Q5_0 (22 bytes: d, qh, 16 code bytes): `(code - 16) * d`.
pub fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(&b[0..2]);
    for (y, &q) in out.iter_mut().zip(&codes(&b[6..22], Some(&b[2..6]))) {
        *y = (q as i32 - 16) as f32 * d;
    }
}

/// Q5_1 (24 bytes: d, m, qh, 16 code bytes): `code * d + m`.
pub fn q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(&b[0..2]), f16_at(&b[2..4]));
    for (y, &q) in out.iter_mut().zip(&codes(&b[8..24], Some(&b[4..8]))) {
        *y = q as f32 * d + m;
    }
}

/// Q8_0 (34 bytes: d, 32 signed bytes): `q * d`.
pub fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(&b[0..2]);
    for (y, &q) in out.iter_mut().zip(&b[2..34]) {
        *y = (q as i8) as f32 * d;
    }
}
