//! How a case's result is compared with its oracle: errors, NMSE, bit-exact comparison, and the
//! deterministic data generator.

use crate::reference::AttentionOutput;

use super::report::Status;

/// A case's verdict and errors.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub status: Status,
    /// Largest absolute error of the output (NaN: not measured).
    pub max_err: f64,
    /// Normalized mean squared error of the output (NaN: not measured).
    pub nmse: f64,
    /// Largest absolute error of the lse, for attention kernels.
    pub lse_err: Option<f64>,
    /// The bounds of the output and the lse; `None`: bit-exact.
    pub bounds: Option<(f64, f64)>,
    /// The error of a kernel that failed to run, or what else is worth saying.
    pub note: Option<String>,
    /// A digest of the GPU result's bits ([`digest`]); `None` when nothing was measured.
    pub digest: Option<u64>,
}

impl Outcome {
    /// An attention kernel's outcome: its output and lse against the oracle's, passing when
    /// both errors are within `bounds` (output, lse).
    /// NaN and infinities count as exact where the reference has the same (README, "NaN,
    /// infinities and extreme values"); an element no kernel wrote, as infinitely wrong.
    pub fn attention(got: &AttentionOutput, want: &AttentionOutput, bounds: (f64, f64)) -> Self {
        let (bound, lse_bound) = bounds;
        let max_err = special_aware_err(&got.out, &want.out);
        let lse_err = special_aware_err(&got.lse, &want.lse);
        let pass = max_err <= bound && lse_err <= lse_bound;
        // NMSE over the elements the reference gives a finite value.
        let (g, w): (Vec<f32>, Vec<f32>) = got
            .out
            .iter()
            .zip(&want.out)
            .filter(|(_, w)| w.is_finite())
            .map(|(&g, &w)| (g, w))
            .unzip();
        Self {
            status: if pass { Status::Pass } else { Status::Fail },
            max_err,
            nmse: nmse(&g, &w),
            lse_err: Some(lse_err),
            bounds: Some(bounds),
            digest: Some(digest(&[&got.out, &got.lse])),
            note: (!pass).then(|| {
                format!(
                    "out error {max_err:.3e} (bound {bound:.3e}), lse error {lse_err:.3e} (bound {lse_bound:.3e})"
                )
            }),
        }
    }

    /// The outcome of a case whose GPU side returned `error`: unavailable (skipped, with the
    /// reason) when the adapter cannot run it (a limit it exceeds, a feature it lacks: a
    /// browser's WebGPU limits are often below native ones), else failed.
    pub fn from_error(error: &crate::Error) -> Self {
        match error {
            crate::Error::TooLarge { .. } | crate::Error::MissingFeature(_) => Self::unmeasured(
                Status::Unavailable,
                format!("this adapter cannot run it: {error}"),
            ),
            _ => Self::unmeasured(Status::Fail, error.to_string()),
        }
    }

    pub fn unmeasured(status: Status, note: String) -> Self {
        Self {
            status,
            max_err: f64::NAN,
            nmse: f64::NAN,
            lse_err: None,
            bounds: None,
            note: Some(note),
            digest: None,
        }
    }
}

/// xorshift64*: deterministic test data without dependencies.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `n` standard normal values (Box-Muller) times `scale`.
    pub(crate) fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let u1 = self.uniform().max(1e-300);
                let u2 = self.uniform();
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                z as f32 * scale
            })
            .collect()
    }
}

/// Largest absolute difference; NaN anywhere counts as infinite.
pub(crate) fn max_abs_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if g.is_nan() || w.is_nan() {
                f64::INFINITY
            } else if g == w {
                0.0
            } else {
                (f64::from(g) - f64::from(w)).abs()
            }
        })
        .fold(0.0, f64::max)
}

/// [`max_abs_err`], except that NaN where the reference is NaN, and an infinity equal to the
/// reference's, count as exact; an element still holding the unwritten-output sentinel is
/// infinitely wrong.
pub(crate) fn special_aware_err(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if crate::gpu::is_unwritten(g) {
                f64::INFINITY
            } else if (g.is_nan() && w.is_nan()) || (w.is_infinite() && g == w) {
                0.0
            } else {
                max_abs_err(&[g], &[w])
            }
        })
        .fold(0.0, f64::max)
}

/// `sum (got - want)^2 / sum want^2` (0 when both are all zero); NaN anywhere counts as infinite.
pub(crate) fn nmse(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() || got.iter().chain(want).any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - f64::from(w)).powi(2);
        den += f64::from(w).powi(2);
    }
    if num == 0.0 {
        0.0
    } else {
        num / den
    }
}

/// A bit-exact comparison: pass iff every value has the same bits.
pub(crate) fn exact_outcome(got: &[f32], want: &[f32]) -> Outcome {
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    Outcome {
        status: if same { Status::Pass } else { Status::Fail },
        max_err: max_abs_err(got, want),
        nmse: nmse(got, want),
        lse_err: None,
        bounds: None,
        note: (!same).then(|| "not bit-exact with the CPU codec".to_string()),
        digest: Some(digest(&[got])),
    }
}

/// FNV-1a (64-bit) over the bits of a result's parts, each prefixed by its length: two runs of
/// a case on the same data must give the same digest (NaN payloads and signed zeros included).
pub(crate) fn digest(parts: &[&[f32]]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |word: u64| {
        for byte in word.to_le_bytes() {
            h = (h ^ u64::from(byte)).wrapping_mul(PRIME);
        }
    };
    for part in parts {
        eat(part.len() as u64);
        for x in *part {
            eat(u64::from(x.to_bits()));
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_sees_every_bit_and_the_split_into_parts() {
        let x = [1.0f32, -0.0, f32::NAN, 3.5];
        let d = digest(&[&x]);
        assert_eq!(d, digest(&[&x.clone()]));
        let mut y = x;
        y[1] = 0.0;
        assert_ne!(d, digest(&[&y]), "signed zero");
        let mut y = x;
        y[3] = f32::from_bits(x[3].to_bits() ^ 1);
        assert_ne!(d, digest(&[&y]), "last bit");
        assert_ne!(digest(&[&x[..2], &x[2..]]), digest(&[&x[..1], &x[1..]]));
    }

    #[test]
    fn exact_comparison_catches_one_bit() {
        let want = vec![1.0f32, -2.5, 0.0, 3.25];
        assert_eq!(exact_outcome(&want, &want).status, Status::Pass);
        let mut got = want.clone();
        got[2] = -0.0; // equal as numbers, not as bits
        let o = exact_outcome(&got, &want);
        assert_eq!(o.status, Status::Fail);
        assert!(o.note.unwrap().contains("bit-exact"));
        assert_eq!(exact_outcome(&want[..3], &want).status, Status::Fail);
    }

    #[test]
    fn attention_comparison_holds_its_bounds_and_nan_rules() {
        let want = AttentionOutput {
            out: vec![1.0, f32::NAN, f32::INFINITY, 2.0],
            lse: vec![0.5, 1.5],
        };
        let o = Outcome::attention(&want, &want, (1e-4, 1e-4));
        assert_eq!((o.status, o.max_err), (Status::Pass, 0.0));
        let mut got = want.clone();
        got.out[3] += 1e-3;
        let o = Outcome::attention(&got, &want, (1e-4, 1e-4));
        assert_eq!(o.status, Status::Fail);
        assert!((o.max_err - 1e-3).abs() < 1e-6 && o.note.unwrap().contains("bound"));
        assert_eq!(
            Outcome::attention(&got, &want, (1e-2, 1e-4)).status,
            Status::Pass
        );
        // A NaN where the reference is finite, or an unwritten element, is infinitely wrong.
        let mut got = want.clone();
        got.out[0] = f32::NAN;
        assert_eq!(
            Outcome::attention(&got, &want, (1.0, 1.0)).max_err,
            f64::INFINITY
        );
        got.out[0] = crate::gpu::UNWRITTEN;
        assert_eq!(
            Outcome::attention(&got, &want, (1.0, 1.0)).status,
            Status::Fail
        );
        let mut got = want.clone();
        got.lse[1] = 1.6;
        assert_eq!(
            Outcome::attention(&got, &want, (1.0, 1e-4)).status,
            Status::Fail
        );
    }
}
