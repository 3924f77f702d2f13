//! Choosing the next token from logits on the host: greedy, or temperature with top-k and top-p
//! (nucleus) filtering, reproducible from a seed.

use crate::rng::SplitMix64;
use crate::{Error, Result};

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy (argmax, the lowest id on ties); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Seed of the random draws.
    pub seed: u64,
}

impl Default for Sampling {
    /// Greedy.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl Sampling {
    /// Checks the settings: a finite temperature `>= 0`, `0 < top_p <= 1`.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "temperature {} must be finite and non-negative",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "top-p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// Checks that `logits` can be sampled from: not empty, and no NaN or +inf (the softmax of such
/// logits is NaN, as in PyTorch; a forward pass that produced one is broken, and picking a
/// token anyway would hide it). -inf is a token that can never be chosen.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first offending token id.
pub fn check_logits(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(Error::InvalidArgument("no logits to choose from".into()));
    }
    if let Some(i) = logits
        .iter()
        .position(|x| x.is_nan() || *x == f32::INFINITY)
    {
        return Err(Error::InvalidArgument(format!(
            "logit of token {i} is {}: the forward pass produced a non-finite value",
            logits[i]
        )));
    }
    Ok(())
}

/// The index of the largest logit (the lowest on ties). Errors as [`check_logits`] (NaN or +inf
/// anywhere, or no logits), and when every logit is -inf.
pub fn argmax(logits: &[f32]) -> Result<u32> {
    check_logits(logits)?;
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    match best {
        Some((i, x)) if x > f32::NEG_INFINITY => Ok(i as u32),
        _ => Err(Error::InvalidArgument(
            "every logit is -inf: no token can be chosen".into(),
        )),
    }
}

/// A sampler: [`Sampling`] plus its random state (SplitMix64).
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: Sampling,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler with `cfg` (checked).
    pub fn new(cfg: Sampling) -> Result<Self> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            rng: SplitMix64::new(cfg.seed),
        })
    }

    /// The next token for `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if self.cfg.temperature == 0.0 {
            return argmax(logits);
        }
        check_logits(logits)?;
        let mut ids: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i] > f32::NEG_INFINITY)
            .collect();
        if ids.is_empty() {
            return argmax(logits);
        }
        // Most likely first; ties by id, so the order is reproducible.
        ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if self.cfg.top_k > 0 {
            ids.truncate(self.cfg.top_k);
        }
        let t = f64::from(self.cfg.temperature);
        let top = f64::from(logits[ids[0]]);
        let mut probs: Vec<f64> = ids
            .iter()
            .map(|&i| ((f64::from(logits[i]) - top) / t).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&p| {
                    acc += p;
                    acc >= f64::from(self.cfg.top_p)
                })
                .map_or(probs.len(), |i| i + 1);
            ids.truncate(keep);
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
        }
        let u = self.rng.uniform();
        let mut acc = 0.0;
        for (&i, &p) in ids.iter().zip(&probs) {
            acc += p;
            if u < acc {
                return Ok(i as u32);
            }
        }
        Ok(*ids.last().expect("at least one candidate") as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_largest_and_the_lowest_id_on_ties() {
        assert_eq!(argmax(&[0.1, 3.0, -1.0, 3.0]).unwrap(), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -5.0]).unwrap(), 1);
        assert!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]).is_err());
        assert!(argmax(&[]).is_err());
        let mut s = Sampler::new(Sampling::default()).unwrap();
        assert_eq!(s.sample(&[0.0, 2.0, 1.0]).unwrap(), 1);
    }

    #[test]
    fn nan_or_positive_infinity_in_logits_is_an_error_never_a_token() {
        let greedy = Sampling::default();
        let warm = Sampling {
            temperature: 0.7,
            top_k: 3,
            ..greedy
        };
        for cfg in [greedy, warm] {
            let mut s = Sampler::new(cfg).unwrap();
            for bad in [f32::NAN, -f32::NAN, f32::INFINITY] {
                let err = s.sample(&[0.5, bad, 9.0]).unwrap_err();
                assert!(err.to_string().contains("token 1"), "{err}");
            }
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        let logits = [0.0f32, (2.0f32).ln(), -1.0e9, f32::NEG_INFINITY];
        let cfg = Sampling {
            temperature: 1.0,
            seed: 7,
            ..Sampling::default()
        };
        let mut s = Sampler::new(cfg).unwrap();
        let mut counts = [0usize; 4];
        let n = 30_000;
        for _ in 0..n {
            counts[s.sample(&logits).unwrap() as usize] += 1;
        }
        // p = 1/3, 2/3; never the -1e9 or -inf one.
        assert_eq!(counts[2] + counts[3], 0);
        let p1 = counts[1] as f64 / n as f64;
        assert!((p1 - 2.0 / 3.0).abs() < 0.02, "{p1}");
        // Same seed, same draws.
        let mut a = Sampler::new(cfg).unwrap();
        let mut b = Sampler::new(cfg).unwrap();
        let xs: Vec<u32> = (0..50).map(|_| a.sample(&logits).unwrap()).collect();
        let ys: Vec<u32> = (0..50).map(|_| b.sample(&logits).unwrap()).collect();
        assert_eq!(xs, ys);
    }

    #[test]
    fn top_k_and_top_p_filter() {
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let only = |cfg: Sampling| {
            let mut s = Sampler::new(cfg).unwrap();
            let mut seen = [false; 4];
            for _ in 0..2000 {
                seen[s.sample(&logits).unwrap() as usize] = true;
            }
            seen
        };
        let base = Sampling {
            temperature: 1.0,
            ..Sampling::default()
        };
        assert_eq!(
            only(Sampling { top_k: 2, ..base }),
            [true, true, false, false]
        );
        // p(3.0) = 0.64 of the four: top-p 0.5 keeps only it.
        assert_eq!(
            only(Sampling { top_p: 0.5, ..base }),
            [true, false, false, false]
        );
        assert!(Sampler::new(Sampling { top_p: 0.0, ..base }).is_err());
        assert!(Sampler::new(Sampling {
            temperature: f32::NAN,
            ..base
        })
        .is_err());
    }
}
