//! Packing of narrow codes into the `u32` words that every pool is made of.
//!
//! Little-endian inside a word: element `k * i + j` of a `k`-per-word packing sits in bits
//! `j * (32 / k) ..` of word `i` (16-bit values: element `2i` in the low half; bytes: element `4i`
//! in the low byte; nibbles: element `8i` in the low nibble). So the little-endian bytes of the
//! words are the codes in order (nibbles: low nibble first).
//!
//! The packers pad a partial last word with zero bits. The readers index like slices and panic
//! when `i` is past the end.

/// Packs 16-bit values two per word, element `2i` in the low half.
pub fn pack_halves(src: &[u16]) -> Vec<u32> {
    src.chunks(2)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0, |w, (j, &h)| w | ((h as u32) << (16 * j)))
        })
        .collect()
}

/// Packs bytes four per word, element `4i` in the low byte.
pub fn pack_bytes(src: &[u8]) -> Vec<u32> {
    src.chunks(4)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0, |w, (j, &b)| w | ((b as u32) << (8 * j)))
        })
        .collect()
}

/// Packs 4-bit codes (the low nibble of each byte) eight per word, element `8i` in the low nibble.
pub fn pack_nibbles(src: &[u8]) -> Vec<u32> {
    src.chunks(8)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0, |w, (j, &n)| w | (((n & 0xF) as u32) << (4 * j)))
        })
        .collect()
}

/// The 16-bit element `i` of words packed by [`pack_halves`].
pub fn half_at(words: &[u32], i: usize) -> u16 {
    (words[i / 2] >> (16 * (i % 2))) as u16
}

/// The byte element `i` of words packed by [`pack_bytes`].
pub fn byte_at(words: &[u32], i: usize) -> u8 {
    (words[i / 4] >> (8 * (i % 4))) as u8
}

/// The 4-bit element `i` of words packed by [`pack_nibbles`].
pub fn nibble_at(words: &[u32], i: usize) -> u8 {
    ((words[i / 8] >> (4 * (i % 8))) & 0xF) as u8
}

/// The words as little-endian bytes: the bytes a GPU buffer of these words holds.
pub fn words_to_le_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_low_first() {
        assert_eq!(
            pack_halves(&[0x1111, 0x2222, 0x3333]),
            [0x2222_1111, 0x3333]
        );
        assert_eq!(pack_bytes(&[1, 2, 3, 4, 5]), [0x0403_0201, 5]);
        assert_eq!(
            pack_nibbles(&[1, 2, 3, 4, 5, 6, 7, 0xF8, 9]),
            [0x8765_4321, 9]
        );
        let w = [0x8765_4321u32, 0xA9];
        assert_eq!(half_at(&w, 1), 0x8765);
        assert_eq!(byte_at(&w, 4), 0xA9);
        assert_eq!(nibble_at(&w, 7), 8);
        assert_eq!(nibble_at(&w, 9), 0xA);
        assert_eq!(words_to_le_bytes(&w[..1]), [0x21, 0x43, 0x65, 0x87]);
    }
}
