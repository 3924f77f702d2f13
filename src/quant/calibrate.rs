//! Calibration of static per-tensor FP8 scales (vLLM's `k_scale` / `v_scale`): the largest
//! magnitude seen in sample K or V, divided by the format's largest finite value, times an
//! optional headroom factor for values larger than the samples showed.

use super::KvDtype;
use crate::{Error, Result};

/// The per-tensor scale of `dtype` (FP8) for `samples`: `amax(samples) / max_value * headroom`.
///
/// `headroom >= 1` leaves room for values beyond the samples' range (1.0: none; values beyond
/// it saturate). Non-finite samples are ignored. Errors (`InvalidArgument`): a dtype other than
/// FP8, a headroom that is not finite or below 1, no finite non-zero sample, or a scale that is not
/// a positive normal f32 with a normal reciprocal.
pub fn per_tensor_scale(dtype: KvDtype, samples: &[f32], headroom: f32) -> Result<f32> {
    let fmt = dtype.fp8_format().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "per-tensor scales are calibrated for FP8 only, not {dtype}"
        ))
    })?;
    if !(headroom.is_finite() && headroom >= 1.0) {
        return Err(Error::InvalidArgument(format!(
            "calibration headroom must be finite and at least 1, got {headroom}"
        )));
    }
    let amax = samples
        .iter()
        .filter(|x| x.is_finite())
        .fold(0.0f32, |m, x| m.max(x.abs()));
    if amax == 0.0 {
        return Err(Error::InvalidArgument(
            "calibration needs at least one finite non-zero sample".into(),
        ));
    }
    let scale = amax / fmt.max_value() * headroom;
    super::Fp8Scale::per_tensor(scale).map(|s| s.scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_maps_amax_to_the_format_max() {
        let s = per_tensor_scale(KvDtype::Fp8E4M3, &[1.0, -896.0, f32::NAN], 1.0).unwrap();
        assert_eq!(s, 2.0);
        let s = per_tensor_scale(KvDtype::Fp8E5M2, &[57344.0], 2.0).unwrap();
        assert_eq!(s, 2.0);
    }

    #[test]
    fn bad_calibrations_are_refused() {
        for (dtype, samples, headroom) in [
            (KvDtype::Int8, vec![1.0], 1.0),
            (KvDtype::Fp8E4M3, vec![0.0, f32::INFINITY], 1.0),
            (KvDtype::Fp8E4M3, vec![], 1.0),
            (KvDtype::Fp8E4M3, vec![1.0], 0.5),
            (KvDtype::Fp8E4M3, vec![1.0], f32::NAN),
            (KvDtype::Fp8E4M3, vec![f32::from_bits(1)], 1.0),
        ] {
            assert!(matches!(
                per_tensor_scale(dtype, &samples, headroom),
                Err(Error::InvalidArgument(_))
            ));
        }
    }
}
