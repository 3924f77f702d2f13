//! CPU references of the small decoder kernels (`src/decoder/ops/`): RMSNorm, SwiGLU, the
//! residual add and the embedding gather. Plain loops; the norm accumulates in f64 and every
//! output is rounded once to f32.

use crate::{Error, Result};

fn check_len(what: &'static str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(Error::ShapeMismatch {
            what,
            expected,
            got: len,
        });
    }
    Ok(())
}

fn positive(what: &str, v: usize) -> Result<()> {
    if v == 0 {
        return Err(Error::InvalidArgument(format!("{what} must be positive")));
    }
    Ok(())
}

/// Llama RMSNorm of `rows` rows of `dim` values (`x` is `[rows, dim]`, `weight` is `[dim]`):
///
/// ```text
/// out[r, i] = x[r, i] / sqrt(mean_i(x[r, :]^2) + eps) * weight[i]
/// ```
///
/// The mean of squares is summed in f64 (no overflow for any finite f32 input). A row whose
/// `mean + eps` is 0 (a row of zeros with `eps = 0`) gives zeros rather than `0 / 0`.
///
/// # Errors
/// [`Error::InvalidArgument`] when `rows` or `dim` is 0 or `eps` is negative, subnormal (the GPU
/// kernel refuses those too: drivers may flush them) or not finite;
/// [`Error::ShapeMismatch`] when `x` or `weight` does not hold exactly `rows * dim` / `dim`
/// values.
pub fn rms_norm(x: &[f32], weight: &[f32], rows: usize, dim: usize, eps: f32) -> Result<Vec<f32>> {
    positive("rms_norm rows", rows)?;
    positive("rms_norm dim", dim)?;
    if !eps.is_finite() || eps < 0.0 || (eps != 0.0 && !eps.is_normal()) {
        return Err(Error::InvalidArgument(format!(
            "rms_norm eps {eps} must be 0 or a finite, normal f32 >= {:e}",
            f32::MIN_POSITIVE
        )));
    }
    let elems = rows
        .checked_mul(dim)
        .ok_or_else(|| Error::InvalidArgument("rms_norm: rows * dim overflows".into()))?;
    check_len("rms_norm x", x.len(), elems)?;
    check_len("rms_norm weight", weight.len(), dim)?;
    let mut out = Vec::with_capacity(elems);
    for row in x.chunks_exact(dim) {
        let mut sum = 0f64;
        for &v in row {
            sum += f64::from(v) * f64::from(v);
        }
        let denom = sum / dim as f64 + f64::from(eps);
        let r = if denom == 0.0 {
            0.0
        } else {
            1.0 / denom.sqrt()
        };
        for (&v, &w) in row.iter().zip(weight) {
            out.push((f64::from(v) * r * f64::from(w)) as f32);
        }
    }
    Ok(out)
}

/// SiLU-gated product: `out[i] = silu(gate[i]) * up[i]` with `silu(g) = g / (1 + exp(-g))`,
/// in f64 with the sigmoid evaluated where it cannot overflow (`exp` of `-|g|` only), so a
/// very negative gate gives `-0` (times `up`) and a very positive one gives `gate * up`.
///
/// # Errors
/// [`Error::ShapeMismatch`] when `gate` and `up` differ in length.
pub fn swiglu(gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
    check_len("swiglu up", up.len(), gate.len())?;
    Ok(gate
        .iter()
        .zip(up)
        .map(|(&g, &u)| {
            let g = f64::from(g);
            let e = (-g.abs()).exp();
            let sigmoid = if g >= 0.0 {
                1.0 / (1.0 + e)
            } else {
                e / (1.0 + e)
            };
            (g * sigmoid * f64::from(u)) as f32
        })
        .collect())
}

/// Element-wise sum `x[i] + y[i]` (the residual connection), one f32 addition per element
/// (correctly rounded, as the GPU's).
///
/// # Errors
/// [`Error::ShapeMismatch`] when `x` and `y` differ in length.
pub fn add(x: &[f32], y: &[f32]) -> Result<Vec<f32>> {
    check_len("add y", y.len(), x.len())?;
    Ok(x.iter().zip(y).map(|(&a, &b)| a + b).collect())
}

/// A bias added to every row: `x[r * dim + j] + bias[j]` with `dim = bias.len()`, one f32
/// addition per element (the GPU's bias add; Qwen2's Q/K/V biases).
///
/// # Errors
/// [`Error::InvalidArgument`] when `bias` is empty; [`Error::ShapeMismatch`] when `x` is not
/// a whole number of rows.
pub fn bias_add(x: &[f32], bias: &[f32]) -> Result<Vec<f32>> {
    positive("bias_add bias length", bias.len())?;
    check_len("bias_add x", x.len() % bias.len(), 0)?;
    Ok(x.chunks(bias.len())
        .flat_map(|row| row.iter().zip(bias).map(|(&a, &b)| a + b))
        .collect())
}

/// Embedding gather: row `ids[t]` of `table` (`[vocab, dim]`, `vocab = table.len() / dim`) for
/// each token, bit for bit; an id `>= vocab` gives a row of zeros (what the kernel writes).
///
/// # Errors
/// [`Error::InvalidArgument`] when `dim` is 0; [`Error::ShapeMismatch`] when `table.len()` is
/// not a multiple of `dim`.
pub fn embed(ids: &[u32], table: &[f32], dim: usize) -> Result<Vec<f32>> {
    positive("embed dim", dim)?;
    let vocab = table.len() / dim;
    check_len("embed table", table.len(), vocab * dim)?;
    let mut out = Vec::with_capacity(ids.len() * dim);
    for &id in ids {
        let id = id as usize;
        if id < vocab {
            out.extend_from_slice(&table[id * dim..(id + 1) * dim]);
        } else {
            out.extend(std::iter::repeat_n(0.0f32, dim));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_by_hand() {
        // mean of squares (9 + 16) / 2 = 12.5, eps 0.5: 1 / sqrt(13) = 0.27735...
        let out = rms_norm(&[3.0, -4.0], &[1.0, 2.0], 1, 2, 0.5).unwrap();
        let r = 1.0 / 13f64.sqrt();
        assert_eq!(out, vec![(3.0 * r) as f32, (-8.0 * r) as f32]);
        // A zero row with eps 0 gives zeros; huge values do not overflow.
        assert_eq!(rms_norm(&[0.0; 3], &[1.0; 3], 1, 3, 0.0).unwrap(), [0.0; 3]);
        let big = rms_norm(&[3e38, -3e38], &[1.0, 1.0], 1, 2, 1e-5).unwrap();
        assert_eq!(big, vec![1.0, -1.0]);
        assert!(rms_norm(&[1.0], &[1.0], 1, 1, -1.0).is_err());
        assert!(rms_norm(&[1.0], &[1.0], 1, 1, f32::NAN).is_err());
        assert!(rms_norm(&[1.0, 2.0], &[1.0], 1, 1, 0.0).is_err());
        assert!(rms_norm(&[], &[], 0, 1, 0.0).is_err());
    }

    #[test]
    fn swiglu_by_hand() {
        let out = swiglu(&[0.0, 1.0, -1e4, 1e4, -2.0], &[5.0, 2.0, 3.0, 0.5, 1.0]).unwrap();
        let s1 = 1.0 / (1.0 + (-1f64).exp());
        let s2 = -2.0 / (1.0 + 2f64.exp());
        assert_eq!(out, vec![0.0, (2.0 * s1) as f32, -0.0, 5e3, s2 as f32]);
        assert!(out[2].is_sign_negative());
        assert!(swiglu(&[1.0], &[]).is_err());
    }

    #[test]
    fn add_and_embed_by_hand() {
        assert_eq!(add(&[1.0, 2.0], &[0.5, -2.0]).unwrap(), vec![1.5, 0.0]);
        assert!(add(&[1.0], &[1.0, 2.0]).is_err());
        let table = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(
            embed(&[2, 0, 3], &table, 2).unwrap(),
            vec![5.0, 6.0, 1.0, 2.0, 0.0, 0.0]
        );
        assert!(embed(&[0], &table, 4).is_err());
        assert!(embed(&[0], &table, 0).is_err());
    }
}
