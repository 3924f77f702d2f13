//! CPU reference of rotary position embedding (RoPE), the oracle of the `rope` kernel.
//!
//! For a vector `x` of `head_dim` values at position `p`, pair `i` (`0 <= i < rotary_dim / 2`)
//! holds the two elements `(a, b)` that rotate together:
//!
//! - [`RopeStyle::NeoX`] (GPT-NeoX, Hugging Face `rotate_half`): `(x[i], x[i + rotary_dim / 2])`,
//!   the "half split";
//! - [`RopeStyle::GptJ`] (GPT-J, llama.cpp's "normal" mode): adjacent `(x[2i], x[2i + 1])`.
//!
//! The pair rotates by the angle `p * theta^(-2i / rotary_dim)`:
//! `a' = a cos - b sin`, `b' = a sin + b cos`. Elements from `rotary_dim` to `head_dim` (partial
//! rotary) are copied unchanged. Frequencies, angles, sines and cosines are computed in f64 and
//! every output is rounded once to f32.

use crate::{Error, Result};

/// Which elements of a head vector rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// GPT-NeoX / Hugging Face `rotate_half`: pair `i` is `(x[i], x[i + rotary_dim / 2])`.
    NeoX,
    /// GPT-J / llama.cpp "normal" mode (Llama GGUF files): pair `i` is `(x[2i], x[2i + 1])`.
    GptJ,
}

impl RopeStyle {
    /// Lower-case name (`neox`, `gptj`).
    pub fn name(self) -> &'static str {
        match self {
            RopeStyle::NeoX => "neox",
            RopeStyle::GptJ => "gptj",
        }
    }

    /// The two element indices (within one head vector) of pair `i`.
    pub fn pair(self, i: usize, rotary_dim: usize) -> (usize, usize) {
        match self {
            RopeStyle::NeoX => (i, i + rotary_dim / 2),
            RopeStyle::GptJ => (2 * i, 2 * i + 1),
        }
    }
}

/// Shape and parameters of a rotary embedding over `[n_tokens, num_heads, head_dim]` f32 rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Which elements rotate together.
    pub style: RopeStyle,
    /// Frequency base (10000 for Llama 2, 500000 for Llama 3); finite and positive.
    pub theta: f32,
    /// Leading elements of each head that rotate (partial rotary); even, `2..=head_dim`.
    pub rotary_dim: usize,
    /// Elements per head; even.
    pub head_dim: usize,
    /// Heads per token; at least 1.
    pub num_heads: usize,
}

impl RopeConfig {
    /// A full-rotary configuration (`rotary_dim == head_dim`).
    pub fn new(style: RopeStyle, theta: f32, head_dim: usize, num_heads: usize) -> Self {
        Self {
            style,
            theta,
            rotary_dim: head_dim,
            head_dim,
            num_heads,
        }
    }

    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::UnsupportedHeadDim`] for a head dim that is zero or odd;
    /// [`Error::InvalidArgument`] for a rotary dim that is zero, odd or larger than the head
    /// dim, a `theta` that is not finite and positive, or zero heads.
    pub fn validate(&self) -> Result<()> {
        if self.head_dim == 0 || self.head_dim % 2 != 0 {
            return Err(Error::UnsupportedHeadDim {
                head_dim: self.head_dim,
                reason: "RoPE needs a positive, even head dim".into(),
            });
        }
        if self.rotary_dim == 0 || self.rotary_dim % 2 != 0 || self.rotary_dim > self.head_dim {
            return Err(Error::InvalidArgument(format!(
                "RoPE rotary_dim {} must be even, at least 2 and at most head_dim {}",
                self.rotary_dim, self.head_dim
            )));
        }
        if !(self.theta.is_finite() && self.theta > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "RoPE theta {} must be finite and positive",
                self.theta
            )));
        }
        if self.num_heads == 0 {
            return Err(Error::InvalidArgument(
                "RoPE needs at least one head".into(),
            ));
        }
        Ok(())
    }

    /// Elements per token (`num_heads * head_dim`), or an error if that overflows.
    pub fn token_elems(&self) -> Result<usize> {
        self.num_heads
            .checked_mul(self.head_dim)
            .ok_or_else(|| Error::InvalidArgument("RoPE: num_heads * head_dim overflows".into()))
    }

    /// Elements of `n_tokens` tokens, or an error if that overflows.
    pub fn elems(&self, n_tokens: usize) -> Result<usize> {
        self.token_elems()?
            .checked_mul(n_tokens)
            .ok_or_else(|| Error::InvalidArgument("RoPE: tensor size overflows".into()))
    }

    /// Inverse frequency (radians per position) of each pair `i < rotary_dim / 2`:
    /// `theta^(-2i / rotary_dim)`, in f64. The GPU kernel's frequency table is derived from it.
    pub fn inv_freq(&self) -> Vec<f64> {
        let theta = f64::from(self.theta);
        let rot = self.rotary_dim as f64;
        (0..self.rotary_dim / 2)
            .map(|i| theta.powf(-2.0 * i as f64 / rot))
            .collect()
    }

    /// [`inv_freq`](Self::inv_freq) with pair `i`'s frequency divided by `factors[i]` (Llama
    /// 3.1's per-dimension frequency factors, GGUF `rope_freqs.weight`); `None`: unscaled.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] unless there is one factor per pair (`rotary_dim / 2`), each
    /// finite and positive.
    pub fn inv_freq_scaled(&self, factors: Option<&[f32]>) -> Result<Vec<f64>> {
        let mut f = self.inv_freq();
        let Some(factors) = factors else {
            return Ok(f);
        };
        if factors.len() != f.len() {
            return Err(Error::InvalidArgument(format!(
                "{} RoPE frequency factors for {} rotary pairs",
                factors.len(),
                f.len()
            )));
        }
        if let Some(bad) = factors.iter().find(|&&x| !(x.is_finite() && x > 0.0)) {
            return Err(Error::InvalidArgument(format!(
                "RoPE frequency factor {bad} must be finite and positive"
            )));
        }
        f.iter_mut()
            .zip(factors)
            .for_each(|(f, &s)| *f /= f64::from(s));
        Ok(f)
    }
}

/// Rotates `x` (`[n_tokens, num_heads, head_dim]` row-major) with token `t` at position
/// `positions[t]`, as the module docs define it, and returns the result in the same layout.
///
/// # Errors
/// The configuration's error ([`RopeConfig::validate`]), or [`Error::ShapeMismatch`] when `x`
/// does not hold `positions.len() * num_heads * head_dim` values.
pub fn rope(x: &[f32], positions: &[u32], cfg: &RopeConfig) -> Result<Vec<f32>> {
    rope_scaled(x, positions, cfg, None)
}

/// [`rope`] with each pair's frequency divided by its factor
/// ([`RopeConfig::inv_freq_scaled`]).
///
/// # Errors
/// As [`rope`], and the factors' errors.
pub fn rope_scaled(
    x: &[f32],
    positions: &[u32],
    cfg: &RopeConfig,
    factors: Option<&[f32]>,
) -> Result<Vec<f32>> {
    cfg.validate()?;
    let expected = cfg.elems(positions.len())?;
    if x.len() != expected {
        return Err(Error::ShapeMismatch {
            what: "rope input x",
            expected,
            got: x.len(),
        });
    }
    let inv_freq = cfg.inv_freq_scaled(factors)?;
    let mut out = x.to_vec();
    let d = cfg.head_dim;
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..cfg.num_heads {
            let base = (t * cfg.num_heads + h) * d;
            for (i, &f) in inv_freq.iter().enumerate() {
                let (ia, ib) = cfg.style.pair(i, cfg.rotary_dim);
                let (sin, cos) = (f64::from(pos) * f).sin_cos();
                let a = f64::from(x[base + ia]);
                let b = f64::from(x[base + ib]);
                out[base + ia] = (a * cos - b * sin) as f32;
                out[base + ib] = (a * sin + b * cos) as f32;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(g) - w).abs() <= tol,
                "element {i}: got {g}, want {w}"
            );
        }
    }

    fn cfg(style: RopeStyle, theta: f32, rotary_dim: usize, head_dim: usize) -> RopeConfig {
        RopeConfig {
            style,
            theta,
            rotary_dim,
            head_dim,
            num_heads: 1,
        }
    }

    #[test]
    fn position_zero_is_identity() {
        let x: Vec<f32> = (0..2 * 3 * 8).map(|i| i as f32 * 0.37 - 5.0).collect();
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            let c = RopeConfig {
                num_heads: 3,
                ..RopeConfig::new(style, 10000.0, 8, 3)
            };
            assert_eq!(rope(&x, &[0, 0], &c).unwrap(), x);
        }
    }

    #[test]
    fn first_pair_rotates_by_the_position_in_radians() {
        // Pair 0 has frequency theta^0 = 1: at position 1 it turns by exactly 1 radian.
        let (s, c) = 1f64.sin_cos();
        let gptj = rope(&[2.0, 3.0], &[1], &cfg(RopeStyle::GptJ, 10000.0, 2, 2)).unwrap();
        close(&gptj, &[2.0 * c - 3.0 * s, 2.0 * s + 3.0 * c], 1e-6);
        // With two elements both styles pair (x0, x1).
        let neox = rope(&[2.0, 3.0], &[1], &cfg(RopeStyle::NeoX, 10000.0, 2, 2)).unwrap();
        assert_eq!(neox, gptj);
    }

    #[test]
    fn quarter_turn_and_styles_differ() {
        // rotary_dim 4: pair 0 turns by p, pair 1 by p * theta^(-1/2). With theta = 4 / pi^2,
        // pair 1 turns by pi/2 at position 1 (up to the f32 rounding of theta).
        let theta = (4.0 / (std::f64::consts::PI * std::f64::consts::PI)) as f32;
        let x = [1.0f32, 0.0, 1.0, 0.0];
        let (s, c) = 1f64.sin_cos();
        // GPT-J pairs (x0, x1) by 1 rad, (x2, x3) by 90 degrees: (1, 0) -> (0, 1).
        let gptj = rope(&x, &[1], &cfg(RopeStyle::GptJ, theta, 4, 4)).unwrap();
        close(&gptj, &[c, s, 0.0, 1.0], 1e-6);
        // NeoX pairs (x0, x2) by 1 rad and (x1, x3) by 90 degrees: (0, 0) stays 0.
        let neox = rope(&x, &[1], &cfg(RopeStyle::NeoX, theta, 4, 4)).unwrap();
        close(&neox, &[c - s, 0.0, s + c, 0.0], 1e-6);
        assert_ne!(gptj, neox);
        // A quarter turn of (3, -2) is (2, 3).
        let q = rope(
            &[0.0, 3.0, 0.0, -2.0],
            &[1],
            &cfg(RopeStyle::NeoX, theta, 4, 4),
        )
        .unwrap();
        close(&[q[1], q[3]], &[2.0, 3.0], 1e-6);
    }

    #[test]
    fn partial_rotary_leaves_the_tail_untouched() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32).sin() + 0.5).collect();
        for style in [RopeStyle::NeoX, RopeStyle::GptJ] {
            let y = rope(&x, &[123], &cfg(style, 10000.0, 32, 64)).unwrap();
            assert_eq!(y[32..], x[32..], "{style:?}");
            assert_ne!(y[..32], x[..32], "{style:?}");
        }
    }

    #[test]
    fn neox_and_gptj_differ_but_preserve_pair_norms() {
        let x: Vec<f32> = (0..2 * 2 * 16)
            .map(|i| ((i * 7) % 11) as f32 - 5.0)
            .collect();
        let positions = [5, 1000];
        let mk = |style| RopeConfig {
            num_heads: 2,
            ..cfg(style, 500000.0, 16, 16)
        };
        let neox = rope(&x, &positions, &mk(RopeStyle::NeoX)).unwrap();
        let gptj = rope(&x, &positions, &mk(RopeStyle::GptJ)).unwrap();
        assert_ne!(neox, gptj);
        for (style, y) in [(RopeStyle::NeoX, &neox), (RopeStyle::GptJ, &gptj)] {
            for row in 0..4 {
                for i in 0..8 {
                    let (a, b) = style.pair(i, 16);
                    let n = |v: &[f32]| {
                        let (p, q) = (f64::from(v[row * 16 + a]), f64::from(v[row * 16 + b]));
                        (p * p + q * q).sqrt()
                    };
                    assert!((n(y) - n(&x)).abs() <= 1e-5 * n(&x).max(1.0), "{style:?}");
                }
            }
        }
    }

    #[test]
    fn positions_are_per_token() {
        // Token 1 of a batch at position 1000 equals a lone token at position 1000.
        let x: Vec<f32> = (0..2 * 8).map(|i| i as f32 - 3.5).collect();
        let c = cfg(RopeStyle::GptJ, 10000.0, 8, 8);
        let both = rope(&x, &[7, 1000], &c).unwrap();
        let lone = rope(&x[8..], &[1000], &c).unwrap();
        assert_eq!(both[8..], lone[..]);
    }

    #[test]
    fn invalid_configs_and_shapes_are_refused() {
        let ok = cfg(RopeStyle::NeoX, 10000.0, 4, 4);
        assert!(ok.validate().is_ok());
        for bad in [
            RopeConfig {
                head_dim: 5,
                rotary_dim: 4,
                ..ok
            },
            RopeConfig {
                head_dim: 0,
                rotary_dim: 0,
                ..ok
            },
            RopeConfig {
                rotary_dim: 3,
                ..ok
            },
            RopeConfig {
                rotary_dim: 0,
                ..ok
            },
            RopeConfig {
                rotary_dim: 6,
                ..ok
            },
            RopeConfig { theta: 0.0, ..ok },
            RopeConfig { theta: -1.0, ..ok },
            RopeConfig {
                theta: f32::NAN,
                ..ok
            },
            RopeConfig {
                theta: f32::INFINITY,
                ..ok
            },
            RopeConfig { num_heads: 0, ..ok },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
            assert!(rope(&[0.0; 4], &[0], &bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            RopeConfig { head_dim: 7, ..ok }.validate(),
            Err(Error::UnsupportedHeadDim { head_dim: 7, .. })
        ));
        assert!(matches!(
            rope(&[0.0; 5], &[0], &ok),
            Err(Error::ShapeMismatch {
                expected: 4,
                got: 5,
                ..
            })
        ));
        assert_eq!(rope(&[], &[], &ok).unwrap(), Vec::<f32>::new());
    }
}
