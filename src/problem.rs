//! Problem descriptions shared by the GPU API and the CPU reference: the shapes a caller
//! states and the results both sides return. Neither side owns them, so that the GPU modules
//! need not import the reference to describe their inputs and outputs (and the reference need
//! not import a GPU module). The old paths ([`reference::AttentionOutput`],
//! [`reference::mla::MlaShape`]) re-export them.
//!
//! [`reference::AttentionOutput`]: crate::reference::AttentionOutput
//! [`reference::mla::MlaShape`]: crate::reference::mla::MlaShape

use crate::{Error, Result};

/// Result of an attention computation (the CPU reference's or a GPU run read back): outputs
/// and log-sum-exps. The reference rounds them once from f64 to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput {
    /// Attention output, `[total_q, Hq, d_v]` row-major.
    pub out: Vec<f32>,
    /// Natural log of each row's softmax denominator (sink included), `[total_q, Hq]`.
    pub lse: Vec<f32>,
}

/// The dimensions of an MLA layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaShape {
    /// Attention heads (queries; the latent is shared by all).
    pub num_heads: usize,
    /// Query/key dims without position (DeepSeek-V2: 128).
    pub d_nope: usize,
    /// Decoupled RoPE dims (DeepSeek-V2: 64).
    pub d_rope: usize,
    /// Latent width, `kv_lora_rank` (DeepSeek-V2: 512).
    pub rank: usize,
    /// Value dims per head (DeepSeek-V2: 128).
    pub d_v: usize,
}

impl MlaShape {
    /// DeepSeek-V2's shape: 128 heads, nope 128, rope 64, rank 512, v 128.
    pub const DEEPSEEK_V2: MlaShape = MlaShape {
        num_heads: 128,
        d_nope: 128,
        d_rope: 64,
        rank: 512,
        d_v: 128,
    };

    /// Every dimension must be positive.
    pub fn validate(&self) -> Result<()> {
        for (what, d) in [
            ("heads", self.num_heads),
            ("d_nope", self.d_nope),
            ("d_rope", self.d_rope),
            ("rank", self.rank),
            ("d_v", self.d_v),
        ] {
            if d == 0 {
                return Err(Error::InvalidArgument(format!(
                    "MLA {what} must be positive"
                )));
            }
        }
        Ok(())
    }

    /// The default scale `1 / sqrt(d_nope + d_rope)`, rounded once to f32.
    pub fn default_scale(&self) -> f32 {
        (1.0 / ((self.d_nope + self.d_rope) as f64).sqrt()) as f32
    }
}
