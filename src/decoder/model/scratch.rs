//! A step's activations: the buffers every prepared step shape shares ([`Scratch`]), made or
//! grown by `Decoder::ensure_scratch`, and [`whole`] to bind one of them.

use super::step::StepCache;
use super::{Decoder, DecoderConfig};
use crate::decoder::ops::qmatmul::input_buffer;
use crate::gpu::Context;

use crate::Result;

/// Activation buffers for steps of up to `tokens` tokens, shared by every prepared step shape
/// (steps run one after another on the queue), with the token ids and positions each step
/// writes with [`Context::write_buffer`].
#[derive(Debug)]
pub(super) struct Scratch {
    tokens: usize,
    pub(super) ids: wgpu::Buffer,
    pub(super) positions: wgpu::Buffer,
    pub(super) x: wgpu::Buffer,
    pub(super) h: wgpu::Buffer,
    pub(super) q: wgpu::Buffer,
    pub(super) k: wgpu::Buffer,
    pub(super) v: wgpu::Buffer,
    pub(super) q_rot: wgpu::Buffer,
    pub(super) k_rot: wgpu::Buffer,
    pub(super) attn: wgpu::Buffer,
    pub(super) lse: wgpu::Buffer,
    pub(super) proj: wgpu::Buffer,
    pub(super) gate: wgpu::Buffer,
    pub(super) up: wgpu::Buffer,
    pub(super) act: wgpu::Buffer,
    /// The rows that need logits, gathered (`Logits::Last` over several sequences).
    pub(super) last: wgpu::Buffer,
}

impl Scratch {
    fn new(ctx: &Context, c: &DecoderConfig, t: usize) -> Result<Self> {
        let f = |what: &str, n: usize| ctx.filled(what, n.max(1), 0.0f32);
        // The inputs of the matrix products: readable by every kernel of the block-format
        // product (the row kernel reads x through a uniform window).
        let input = |what: &str, n: usize| input_buffer(ctx, what, &vec![0.0f32; n.max(1)]);
        Ok(Self {
            tokens: t,
            ids: ctx.filled("token ids", t, 0u32)?,
            positions: ctx.filled("positions", t, 0u32)?,
            x: f("residual", t * c.d_model)?,
            h: input("normed", t * c.d_model)?,
            q: f("q", t * c.q_dim())?,
            k: f("k", t * c.kv_dim())?,
            v: f("v", t * c.kv_dim())?,
            q_rot: f("q rotated", t * c.q_dim())?,
            k_rot: f("k rotated", t * c.kv_dim())?,
            attn: input("attention out", t * c.q_dim())?,
            lse: f("attention lse", t * c.n_heads)?,
            proj: f("projection", t * c.d_model)?,
            gate: f("gate", t * c.ffn)?,
            up: f("up", t * c.ffn)?,
            act: input("activation", t * c.ffn)?,
            last: input("rows that need logits", t * c.d_model)?,
        })
    }
}

/// The whole of a buffer as a binding.
pub(super) fn whole(buffer: &wgpu::Buffer) -> wgpu::BufferBinding<'_> {
    wgpu::BufferBinding {
        buffer,
        offset: 0,
        size: None,
    }
}

impl Decoder {
    /// Activations for steps of `t` tokens in `st` (made anew, with every prepared step
    /// dropped, when the current ones are smaller).
    pub(super) fn ensure_scratch(&self, ctx: &Context, st: &mut StepCache, t: usize) -> Result<()> {
        if st.scratch.as_ref().is_none_or(|s| s.tokens < t) {
            // Every prepared step binds the old activations: drop them with it.
            st.steps.clear();
            st.scratch = None;
            // Rounded up, so that steps of growing length (a recomputing run) do not make new
            // activations every step.
            st.scratch = Some(Scratch::new(
                ctx,
                &self.config,
                t.next_power_of_two().max(16),
            )?);
        }
        Ok(())
    }
}
