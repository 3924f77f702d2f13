//! Attention shapes of public models, for the capacity model ([`super::capacity`]) and
//! `kvattn capacity --model NAME`. Values from the models' published configs and papers, as
//! collected in `../shared/data/model-shapes.md`.
//!
//! ```
//! use kvattn::cache::capacity::{bytes_per_token, ScaleGranularity};
//! use kvattn::cache::presets::preset;
//! use kvattn::quant::KvDtype;
//!
//! let p = preset("qwen3-1.7b").unwrap();
//! let bpt = bytes_per_token(p.shape, KvDtype::Bf16, ScaleGranularity::PerTensor).unwrap();
//! assert_eq!(bpt, 114_688);
//! ```

use super::capacity::CacheShape;
use crate::{Error, Result};

/// A public model's attention shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPreset {
    /// The preset's name on the command line, e.g. "llama-3.1-70b".
    pub name: &'static str,
    /// Transformer layers (the same as `shape.layers()`).
    pub layers: usize,
    /// Query heads per layer.
    pub q_heads: usize,
    /// What a token leaves in the cache.
    pub shape: CacheShape,
    /// For an MLA preset: the head dim of the K and V rows of the MHA cache it is compared with,
    /// one K and one V row per query head ([`CacheShape::mha_equivalent`]). DeepSeek-V2: 128,
    /// its `v_head_dim` and `qk_nope_head_dim` (the per-head K without the 64-wide decoupled
    /// RoPE part), as in the paper's KV-cache comparison (`2 * n_h * d_h * l` with `d_h` = 128)
    /// and seed 000 section 4. `None` for MHA, GQA and MQA presets.
    pub mha_equivalent_head_dim: Option<usize>,
    /// Where the shape comes from, and anything worth knowing about it.
    pub notes: &'static str,
}

impl ModelPreset {
    /// The MHA cache this preset is compared with: `q_heads` KV heads of
    /// [`mha_equivalent_head_dim`](Self::mha_equivalent_head_dim) over its layers, for an MLA
    /// preset; `None` for the others.
    pub fn mha_equivalent(&self) -> Option<Result<CacheShape>> {
        self.mha_equivalent_head_dim
            .map(|head_dim| self.shape.mha_equivalent(self.q_heads, head_dim))
    }
}

const fn mha(
    name: &'static str,
    layers: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    notes: &'static str,
) -> ModelPreset {
    ModelPreset {
        name,
        layers,
        q_heads,
        shape: CacheShape::Mha {
            layers,
            kv_heads,
            head_dim,
        },
        mha_equivalent_head_dim: None,
        notes,
    }
}

/// Every preset, in the order of `kvattn capacity --help`.
pub const PRESETS: &[ModelPreset] = &[
    mha(
        "llama-3.1-8b",
        32,
        32,
        8,
        128,
        "Llama 3 paper, GQA with 8 KV heads",
    ),
    mha(
        "llama-3.1-70b",
        80,
        64,
        8,
        128,
        "Llama 3 paper, 128K context",
    ),
    mha("llama-3.1-405b", 126, 128, 8, 128, "Llama 3 paper"),
    mha("qwen2.5-1.5b", 28, 12, 2, 128, "config.json"),
    mha("qwen2.5-7b", 28, 28, 4, 128, "config.json"),
    mha(
        "qwen3-1.7b",
        28,
        16,
        8,
        128,
        "config.json; 114,688 bytes/token in bf16",
    ),
    mha("qwen3-8b", 36, 32, 8, 128, "config.json"),
    mha("mistral-7b", 32, 32, 8, 128, "v0.1 config.json"),
    ModelPreset {
        name: "deepseek-v2",
        layers: 60,
        q_heads: 128,
        shape: CacheShape::Mla {
            layers: 60,
            rank: 512,
            rope_dim: 64,
        },
        // v_head_dim = qk_nope_head_dim = 128: the paper's d_h in its MHA comparison.
        mha_equivalent_head_dim: Some(128),
        notes: "MLA: kv_lora_rank 512 + qk_rope_head_dim 64 per layer, 34,560 values/token; \
                vs MHA of the same 128 heads of 128 (v_head_dim = qk_nope_head_dim): \
                1,966,080 values/token",
    },
    mha(
        "smollm2-135m",
        30,
        9,
        3,
        64,
        "config.json; the decoder's test model",
    ),
];

/// The names of [`PRESETS`], in order.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.name).collect()
}

/// The preset called `name` (case-insensitive, `_` accepted for `-`). An unknown name is an
/// [`Error::InvalidArgument`] that lists the valid ones.
pub fn preset(name: &str) -> Result<&'static ModelPreset> {
    let wanted = name.trim().to_ascii_lowercase().replace('_', "-");
    PRESETS.iter().find(|p| p.name == wanted).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "unknown model {name:?}; valid: {}",
            preset_names().join(", ")
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::capacity::{bytes_per_token, total_bytes, CapacityQuery, ScaleGranularity};
    use crate::quant::KvDtype;

    fn bf16(name: &str) -> u64 {
        bytes_per_token(
            preset(name).unwrap().shape,
            KvDtype::Bf16,
            ScaleGranularity::PerTensor,
        )
        .unwrap()
    }

    #[test]
    fn names_lookup_and_consistency() {
        let want = [
            "llama-3.1-8b",
            "llama-3.1-70b",
            "llama-3.1-405b",
            "qwen2.5-1.5b",
            "qwen2.5-7b",
            "qwen3-1.7b",
            "qwen3-8b",
            "mistral-7b",
            "deepseek-v2",
            "smollm2-135m",
        ];
        assert_eq!(preset_names(), want);
        for p in PRESETS {
            assert_eq!(preset(p.name).unwrap(), p);
            assert_eq!(p.layers, p.shape.layers(), "{}", p.name);
            if let CacheShape::Mha { kv_heads, .. } = p.shape {
                assert_eq!(p.q_heads % kv_heads, 0, "{}: GQA groups", p.name);
            }
            for dtype in KvDtype::ALL {
                assert!(p.shape.check(dtype).is_ok(), "{} {dtype}", p.name);
            }
            // Every MLA preset, and only those, has an MHA equivalent.
            assert_eq!(
                p.mha_equivalent_head_dim.is_some(),
                p.shape.kind() == "mla",
                "{}",
                p.name
            );
        }
        assert_eq!(preset("Qwen3_1.7B").unwrap().name, "qwen3-1.7b");
        let err = preset("gpt-5").unwrap_err().to_string();
        assert!(
            err.contains("gpt-5") && err.contains("llama-3.1-70b") && err.contains("smollm2-135m")
        );
    }

    /// Seed 000 section 4: DeepSeek-V2's heads as MHA, 128 heads with K and V of 128 values in
    /// each of 60 layers.
    #[test]
    fn deepseek_v2_mha_equivalent() {
        let p = preset("deepseek-v2").unwrap();
        let mha = p.mha_equivalent().unwrap().unwrap();
        assert_eq!(
            mha,
            CacheShape::Mha {
                layers: 60,
                kv_heads: 128,
                head_dim: 128
            }
        );
        assert_eq!(mha.values_per_token().unwrap(), 2 * 60 * 128 * 128);
        assert_eq!(mha.values_per_token().unwrap(), 1_966_080);
        assert!(preset("qwen3-8b").unwrap().mha_equivalent().is_none());
    }

    /// Bytes per token in bf16 (model-shapes.md: 2 x layers x KV heads x head dim x 2; MLA:
    /// layers x (rank + rope dim) x 2), and seed 000 section 4's "32K" column: one request of
    /// 32,768 tokens.
    #[test]
    fn bf16_bytes_per_token_and_32k() {
        let want: [(&str, u64, u64); 10] = [
            ("llama-3.1-8b", 131_072, 4 << 30),
            ("llama-3.1-70b", 327_680, 10 << 30),
            ("llama-3.1-405b", 516_096, 63 << 28), // 15.75 GiB
            ("qwen2.5-1.5b", 28_672, 896 << 20),
            ("qwen2.5-7b", 57_344, 7 << 28),  // 1.75 GiB
            ("qwen3-1.7b", 114_688, 7 << 29), // 3.5 GiB
            ("qwen3-8b", 147_456, 9 << 29),   // 4.5 GiB
            ("mistral-7b", 131_072, 4 << 30),
            ("deepseek-v2", 69_120, 2_160 << 20), // 67.5 KiB x 32K = 2.109375 GiB
            ("smollm2-135m", 23_040, 720 << 20),
        ];
        for (name, bpt, per_32k) in want {
            assert_eq!(bf16(name), bpt, "{name}");
            let q = CapacityQuery {
                shape: preset(name).unwrap().shape,
                dtype: KvDtype::Bf16,
                scales: ScaleGranularity::PerTensor,
                block_size: Some(16),
                tokens_per_seq: 32_768,
                seqs: 1,
            };
            assert_eq!(total_bytes(&q).unwrap(), per_32k, "{name}");
        }
    }
}
