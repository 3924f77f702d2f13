//! Where a decoder step's ops are recorded: all in one compute pass (a step's normal form), or
//! each op in a compute pass of its own labelled with the op's name, so that timing the step
//! ([`Context::timed_passes`]) says where its device time goes
//! ([`Decoder::set_pass_per_op`](super::model::Decoder::set_pass_per_op)).
//!
//! The ops and their order are the same either way, so are the results, bit for bit (tested);
//! only the pass boundaries differ. Those boundaries and their timestamps cost time (on
//! lavapipe about 20% of a SmolLM2 step, and on a GPU no dispatch overlaps the next pass's),
//! so the per-op times add up to more than the one-pass step: they tell shares.

use crate::gpu::Context;

/// The names an op's pass gets in a per-op recording, in the order a layer records them.
pub mod op {
    /// The token embedding gather.
    pub const EMBED: &str = "embed";
    /// The RMSNorm before attention.
    pub const ATTN_NORM: &str = "attn norm";
    /// The Q, K and V products (one grouped product or three).
    pub const QKV: &str = "qkv";
    /// The Q, K and V biases' adds (Qwen2).
    pub const QKV_BIAS: &str = "qkv bias";
    /// RoPE of the queries and keys.
    pub const ROPE: &str = "rope";
    /// The new keys and values appended into the paged cache.
    pub const APPEND: &str = "append";
    /// Paged attention (and its split-K merge).
    pub const ATTENTION: &str = "attention";
    /// The output product, added into the residual stream.
    pub const O: &str = "o + residual";
    /// The RMSNorm before the MLP.
    pub const FFN_NORM: &str = "ffn norm";
    /// The MLP's gate product.
    pub const GATE: &str = "gate";
    /// The MLP's up product.
    pub const UP: &str = "up";
    /// SwiGLU of the gate and up products.
    pub const SWIGLU: &str = "swiglu";
    /// The MLP's down product, added into the residual stream.
    pub const DOWN: &str = "down + residual";
    /// The final RMSNorm.
    pub const FINAL_NORM: &str = "final norm";
    /// The gather of each sequence's last row before the output projection (batches).
    pub const GATHER: &str = "gather";
    /// The output projection (the logits).
    pub const HEAD: &str = "head";
}

/// The label of a step recorded in one pass.
pub(crate) const ONE_PASS: &str = "decoder step";

/// Hands out the compute pass each op of a step records into.
pub(crate) struct StepPasses<'e> {
    ctx: &'e Context,
    encoder: &'e mut wgpu::CommandEncoder,
    pass: Option<wgpu::ComputePass<'static>>,
    per_op: bool,
}

impl<'e> StepPasses<'e> {
    /// Passes on `encoder`: one for the whole step, or one per op when `per_op`.
    pub fn new(ctx: &'e Context, encoder: &'e mut wgpu::CommandEncoder, per_op: bool) -> Self {
        Self {
            ctx,
            encoder,
            pass: None,
            per_op,
        }
    }

    /// The pass op `name` (one of [`op`]'s names) records into: the step's one pass, or a new
    /// pass labelled `name` (the previous op's pass ended).
    pub fn op(&mut self, name: &'static str) -> &mut wgpu::ComputePass<'static> {
        if self.per_op {
            self.pass = None;
        }
        let label = if self.per_op { name } else { ONE_PASS };
        self.pass.get_or_insert_with(|| {
            self.ctx
                .begin_compute_pass(self.encoder, Some(label))
                .forget_lifetime()
        })
    }
}
