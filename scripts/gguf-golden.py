#!/usr/bin/env python3
"""Writes tests/data/gguf_golden.bin: ggml blocks and their values as PyPI's `gguf` package
dequantizes them, the independent implementation kvattn's CPU dequantization
(src/decoder/blocks/) is checked against, bit for bit.

Run once, from the repository root, in a virtual environment with the pinned package:

    python3 -m venv /tmp/gguf-env && /tmp/gguf-env/bin/pip install gguf==0.17.1
    /tmp/gguf-env/bin/python scripts/gguf-golden.py

The blocks are random bytes (a fixed seed) with some planted cases: every code at its largest
(all bits set), every code zero, a zero scale, a subnormal scale, the largest f16 scale and
negative scales. f16 scale fields are always finite (a NaN or infinite scale makes every value
of its block NaN or infinite, which the hand-written tests cover).

File layout, little-endian: b"KVGG", u32 version (1), u32 entry count; per entry: u32 ggml
type id, u32 block count, u32 byte count, the blocks' bytes, then one u32 per value (the f32
bits), block_size values per block.
"""

import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES, dequantize

SEED = 20261203
OUT = "tests/data/gguf_golden.bin"

# (type, blocks, byte offsets of the block's f16 scale fields)
CASES = [
    (T.F16, 64, []),
    (T.BF16, 64, []),
    (T.Q4_0, 16, [0]),
    (T.Q4_1, 16, [0, 2]),
    (T.Q5_0, 16, [0]),
    (T.Q5_1, 16, [0, 2]),
    (T.Q8_0, 16, [0]),
    (T.Q4_K, 6, [0, 2]),
    (T.Q5_K, 6, [0, 2]),
    (T.Q6_K, 6, [208]),
]

# Planted scale values (f16 bit patterns): zero, negative zero, smallest subnormal, a
# subnormal, largest finite, negative largest.
PLANTED = [0x0000, 0x8000, 0x0001, 0x03FF, 0x7BFF, 0xFBFF]


def finite_f16(rng):
    """A random finite f16 of moderate size (exponent field 5..20, either sign)."""
    exp = int(rng.integers(5, 21))
    mant = int(rng.integers(0, 1024))
    sign = int(rng.integers(0, 2))
    return sign << 15 | exp << 10 | mant


def no_nan_16(words, is_bf16):
    """16-bit float patterns with NaN and infinities replaced by finite ones."""
    exp_mask, mant_mask = (0x7F80, 0x007F) if is_bf16 else (0x7C00, 0x03FF)
    special = (words & exp_mask) == exp_mask
    return np.where(special, words & ~np.uint16(0x4000), words)


def blocks_of(qtype, n, fields, rng):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    if qtype in (T.F16, T.BF16):
        words = no_nan_16(raw.view(np.uint16), qtype == T.BF16)
        return words.view(np.uint8).reshape(n, type_size)
    scale_bytes = set(o + k for o in fields for k in range(2))
    code_bytes = [i for i in range(type_size) if i not in scale_bytes]
    for b in range(n):
        for o in fields:
            raw[b, o:o + 2] = np.frombuffer(struct.pack("<H", finite_f16(rng)), np.uint8)
    # Block 1: every code bit set; block 2: every code zero.
    raw[1, code_bytes] = 0xFF
    raw[2, code_bytes] = 0x00
    # Blocks 3..: each planted value in the first scale field in turn (the rest stay random).
    for i, bits in enumerate(PLANTED):
        if 3 + i < n:
            raw[3 + i, fields[0]:fields[0] + 2] = np.frombuffer(struct.pack("<H", bits), np.uint8)
    return raw


def main():
    rng = np.random.default_rng(SEED)
    out = bytearray(b"KVGG")
    out += struct.pack("<II", 1, len(CASES))
    for qtype, n, fields in CASES:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = blocks_of(qtype, n, fields, rng)
        values = dequantize(blocks.reshape(-1), qtype).astype(np.float32).reshape(-1)
        assert values.size == n * block_size, (qtype, values.size)
        out += struct.pack("<III", int(qtype), n, blocks.size)
        out += blocks.tobytes()
        out += values.view(np.uint32).astype("<u4").tobytes()
        print(f"{qtype.name}: {n} blocks, {values.size} values", file=sys.stderr)
    with open(OUT, "wb") as f:
        f.write(out)
    print(f"wrote {OUT} ({len(out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
