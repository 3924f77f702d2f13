//! Recording a prepared step: `Decoder::encode_layers` records its ops, layer by layer, into
//! the step's compute passes.

use super::scratch::{whole, Scratch};
use super::step::Step;
use super::Decoder;
use crate::attention::paged_plan::AttentionIo;
use crate::cache::append_kv::SourceDtype;
use crate::cache::append_plan::AppendIo;
use crate::cache::paged::PagedKvCache;
use crate::decoder::passes::{op, StepPasses};
use crate::gpu::Context;

use crate::Result;

impl Decoder {
    /// Records a prepared step (whose plans were updated for this step) into `passes`.
    pub(super) fn encode_layers(
        &self,
        ctx: &Context,
        passes: &mut StepPasses<'_>,
        cache: &PagedKvCache,
        step: &Step,
        s: &Scratch,
    ) -> Result<()> {
        step.embed.encode(passes.op(op::EMBED));
        for (layer, ops) in step.layers.iter().enumerate() {
            ops.attn_norm.encode(passes.op(op::ATTN_NORM));
            let pass = passes.op(op::QKV);
            for product in &ops.qkv {
                product.encode(pass);
            }
            if !ops.qkv_bias.is_empty() {
                let pass = passes.op(op::QKV_BIAS);
                for bias in &ops.qkv_bias {
                    bias.encode(pass);
                }
            }
            step.rope.encode(passes.op(op::ROPE));
            let io = AppendIo {
                cache,
                layer,
                k: whole(&s.k_rot),
                v: whole(&s.v),
                src: SourceDtype::F32,
            };
            step.append.encode(ctx, passes.op(op::APPEND), &io)?;
            let io = AttentionIo {
                cache,
                layer,
                q: whole(&s.q_rot),
                out: whole(&s.attn),
                lse: whole(&s.lse),
            };
            step.attention.encode(ctx, passes.op(op::ATTENTION), &io)?;
            ops.o.encode(passes.op(op::O));
            ops.ffn_norm.encode(passes.op(op::FFN_NORM));
            ops.gate.encode(passes.op(op::GATE));
            ops.up.encode(passes.op(op::UP));
            step.swiglu.encode(passes.op(op::SWIGLU));
            ops.down.encode(passes.op(op::DOWN));
        }
        step.final_norm.encode(passes.op(op::FINAL_NORM));
        if let Some((gather, _)) = &step.gather {
            gather.encode(passes.op(op::GATHER));
        }
        let pass = passes.op(op::HEAD);
        for head in &step.head {
            head.encode(pass);
        }
        Ok(())
    }
}
