//! [`CacheScales`]: how a paged cache's quantized K or V is scaled, per layer.

use crate::quant::{Fp8Scale, KvDtype, ScaleMode};
use crate::{Error, Result};

/// Scales of one tensor kind (K or V) of a cache.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum CacheScales {
    /// Computed per token row as rows are written (FP8: a power of two; int8: `amax / 127`;
    /// int4: a scale and min per group of 32). Also the mode of f32/f16/bf16, which have none.
    #[default]
    PerRow,
    /// Static per-tensor FP8 scales (vLLM's `k_scale` / `v_scale`), from calibration (see
    /// [`per_tensor_scale`](crate::quant::per_tensor_scale)): one for every layer, or one per
    /// layer.
    PerTensor(Vec<f32>),
}

impl CacheScales {
    /// The scale mode of `layer`.
    pub fn mode(&self, layer: usize) -> ScaleMode {
        match self {
            CacheScales::PerRow => ScaleMode::PerRow,
            CacheScales::PerTensor(s) if s.len() == 1 => ScaleMode::PerTensor(s[0]),
            CacheScales::PerTensor(s) => ScaleMode::PerTensor(s.get(layer).copied().unwrap_or(1.0)),
        }
    }

    /// Checks the scales against `dtype` and the layer count: per-tensor scales only for FP8,
    /// one or `layers` of them, each a positive normal f32 with a normal reciprocal.
    pub fn validate(&self, what: &str, dtype: KvDtype, layers: usize) -> Result<()> {
        let CacheScales::PerTensor(s) = self else {
            return Ok(());
        };
        if dtype.fp8_format().is_none() {
            return Err(Error::InvalidArgument(format!(
                "{what}: per-tensor scales apply to FP8 only, the dtype is {dtype}"
            )));
        }
        if s.len() != 1 && s.len() != layers {
            return Err(Error::InvalidArgument(format!(
                "{what}: {} per-tensor scales for {layers} layers (give 1 or {layers})",
                s.len()
            )));
        }
        for &x in s {
            Fp8Scale::per_tensor(x)?;
        }
        Ok(())
    }

    /// The snapshot header value: "per-row", or "per-tensor:" and the scales' f32 bits in hex.
    pub fn describe(&self) -> String {
        match self {
            CacheScales::PerRow => "per-row".into(),
            CacheScales::PerTensor(s) => {
                let bits: Vec<String> = s.iter().map(|x| format!("{:08x}", x.to_bits())).collect();
                format!("per-tensor:{}", bits.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::capacity::{bytes_per_token, CacheShape, ScaleGranularity};
    use crate::cache::paged::PagedKvConfig;

    #[test]
    fn capacity_model_counts_the_pools_scale_words() {
        // The capacity model's bytes per token equal what the pools allocate per token slot,
        // scales included, for every format and scale mode.
        for dtype in KvDtype::ALL {
            for per_tensor in [false, true] {
                if per_tensor && dtype.fp8_format().is_none() {
                    continue;
                }
                let mut c = PagedKvConfig::new(3, 4, 128, dtype);
                if per_tensor {
                    c.k_scales = CacheScales::PerTensor(vec![0.5]);
                    c.v_scales = CacheScales::PerTensor(vec![0.25, 0.5, 1.0]);
                }
                c.validate().unwrap();
                let granularity = if per_tensor || dtype.fp8_format().is_none() {
                    ScaleGranularity::PerTensor
                } else {
                    ScaleGranularity::PerToken
                };
                let shape = CacheShape::Mha {
                    layers: 3,
                    kv_heads: 4,
                    head_dim: 128,
                };
                let model = bytes_per_token(shape, dtype, granularity).unwrap();
                assert_eq!(
                    model * c.block_size as u64,
                    c.bytes_per_block(),
                    "{dtype} per-tensor {per_tensor}"
                );
            }
        }
    }

    #[test]
    fn scales_are_validated() {
        let ok = CacheScales::PerTensor(vec![0.5]);
        assert!(ok.validate("K", KvDtype::Fp8E4M3, 4).is_ok());
        assert!(ok.validate("K", KvDtype::Int8, 4).is_err());
        let per_layer = CacheScales::PerTensor(vec![0.5, 1.0]);
        assert!(per_layer.validate("K", KvDtype::Fp8E5M2, 3).is_err());
        assert!(per_layer.validate("K", KvDtype::Fp8E5M2, 2).is_ok());
        assert_eq!(per_layer.mode(1), ScaleMode::PerTensor(1.0));
        assert!(CacheScales::PerTensor(vec![0.0])
            .validate("V", KvDtype::Fp8E4M3, 1)
            .is_err());
        assert_eq!(CacheScales::PerRow.mode(7), ScaleMode::PerRow);
        assert_eq!(CacheScales::PerRow.describe(), "per-row");
        assert_eq!(
            CacheScales::PerTensor(vec![1.0]).describe(),
            "per-tensor:3f800000"
        );
    }
}
