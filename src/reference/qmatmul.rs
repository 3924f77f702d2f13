//! CPU reference of the quantized matrix product (`src/decoder/ops/qmatmul.rs`):
//! `y[t, o] = sum_i W[o, i] x[t, i]` over a weight in a GGUF block format, with the kernel's
//! exact reduction order: an adapter gives the bits of [`qmatmul`] where WGSL's `fma` is fused
//! and those of [`qmatmul_unfused`] where it is a product then a sum (WGSL allows both;
//! lavapipe and llvmpipe do the latter).
//!
//! Each weight value is the CPU dequantization's ([`crate::decoder::blocks`]). Lane `l` of
//! [`LANES`] sums, with a fused multiply-add in f32, the values of the chunks (32 values) `c`
//! with `c % LANES == l` in increasing order; the partials are then added by the fixed tree
//! `p[j] += p[j + o]` for `o = LANES / 2, ..., 1`.

use crate::decoder::blocks::dequantize;
use crate::decoder::gguf::GgmlType;
use crate::{Error, Result};

/// Lanes that split a row's chunks (the kernel's `LANES`).
pub const LANES: usize = 16;
/// Values per chunk.
pub const CHUNK: usize = 32;

/// `rows` rows of `y` (`[rows, n]`) from the weight `w` (`n` rows of `k` values of type `ty`,
/// as the file stores them) and `x` (`[rows, k]`).
///
/// # Errors
/// [`Error::InvalidArgument`] when `k` is not a positive multiple of 32, `n` or `rows` is 0, or
/// `x` is not `rows * k` long; the errors of [`dequantize`] for `w`.
pub fn qmatmul(
    ty: GgmlType,
    n: usize,
    k: usize,
    w: &[u8],
    x: &[f32],
    rows: usize,
) -> Result<Vec<f32>> {
    product(ty, (n, k), w, x, rows, true)
}

/// [`qmatmul`] with every multiply-add rounded twice (the product, then the sum).
///
/// # Errors
/// Those of [`qmatmul`].
pub fn qmatmul_unfused(
    ty: GgmlType,
    n: usize,
    k: usize,
    w: &[u8],
    x: &[f32],
    rows: usize,
) -> Result<Vec<f32>> {
    product(ty, (n, k), w, x, rows, false)
}

fn product(
    ty: GgmlType,
    (n, k): (usize, usize),
    w: &[u8],
    x: &[f32],
    rows: usize,
    fused: bool,
) -> Result<Vec<f32>> {
    if k == 0 || k % CHUNK != 0 || n == 0 || rows == 0 {
        return Err(Error::InvalidArgument(format!(
            "qmatmul reference: k = {k} must be a positive multiple of {CHUNK}, n = {n} and \
             rows = {rows} positive"
        )));
    }
    if x.len() != rows * k {
        return Err(Error::InvalidArgument(format!(
            "qmatmul reference: x holds {} values, not rows * k = {}",
            x.len(),
            rows * k
        )));
    }
    let weights = dequantize(ty, w, n * k)?;
    let mut y = vec![0f32; rows * n];
    for (t, xr) in x.chunks_exact(k).enumerate() {
        for (o, wr) in weights.chunks_exact(k).enumerate() {
            y[t * n + o] = row_dot(wr, xr, fused);
        }
    }
    Ok(y)
}

/// One output: the lanes' partial sums (each multiply-add fused or not), then the tree.
pub fn row_dot(w: &[f32], x: &[f32], fused: bool) -> f32 {
    let mut parts = [0f32; LANES];
    for (c, (wc, xc)) in w.chunks_exact(CHUNK).zip(x.chunks_exact(CHUNK)).enumerate() {
        let p = &mut parts[c % LANES];
        for (&wv, &xv) in wc.iter().zip(xc) {
            *p = if fused {
                wv.mul_add(xv, *p)
            } else {
                wv * xv + *p
            };
        }
    }
    let mut step = LANES / 2;
    while step > 0 {
        for j in 0..step {
            parts[j] += parts[j + step];
        }
        step /= 2;
    }
    parts[0]
}
