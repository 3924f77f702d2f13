//! The value outputs are pre-filled with, so that a missing write shows.
//!
//! NaN cannot serve: it is a legitimate attention result (a row that saw a NaN score). The
//! sentinel is a signalling NaN with a payload of its own, which no arithmetic produces (every
//! NaN an operation returns is quiet) and no kernel writes: an output element that still holds
//! these bits after a kernel ran was never written.

/// Bits of the unwritten-output sentinel: a signalling NaN (`0x7FA0_0BAD`).
pub const UNWRITTEN_BITS: u32 = 0x7FA0_0BAD;

/// The unwritten-output sentinel as f32 (compare bits, [`is_unwritten`], never values).
pub const UNWRITTEN: f32 = f32::from_bits(UNWRITTEN_BITS);

/// Whether `x` holds the sentinel's bits (an output element no kernel wrote).
pub fn is_unwritten(x: f32) -> bool {
    x.to_bits() == UNWRITTEN_BITS
}
