//! Uploading a model's weights ([`Decoder::upload`], [`Decoder::upload_from`]): each tensor is
//! checked against the [`DecoderConfig`] and put on the GPU, a layer's norms, matrices and
//! biases into a `GpuLayer`.

use super::step::StepCache;
use super::{Decoder, DecoderConfig, HostWeights};
use crate::decoder::weights::{GpuMatrix, LayerMatrix, WeightSource};
use crate::gpu::Context;
use crate::rope::RopeTables;
use crate::shader::Precision;
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

use crate::{Error, Result};

/// One layer's weights on the GPU: its norms, and its matrices in [`LayerMatrix::ALL`] order
/// with the bias added after each product (if any).
#[derive(Debug)]
pub(super) struct GpuLayer {
    pub(super) attn_norm: wgpu::Buffer,
    pub(super) ffn_norm: wgpu::Buffer,
    matrices: Vec<GpuMatrix>,
    biases: Vec<Option<wgpu::Buffer>>,
}

impl GpuLayer {
    pub(super) fn matrix(&self, which: LayerMatrix) -> &GpuMatrix {
        &self.matrices[which.index()]
    }

    pub(super) fn bias(&self, which: LayerMatrix) -> Option<&wgpu::Buffer> {
        self.biases[which.index()].as_ref()
    }
}

impl Decoder {
    /// Checks `weights` against `config` and uploads them; `precision` is the attention
    /// kernel's ([`Precision::F16`] needs `SHADER_F16`).
    pub fn upload(
        ctx: &Context,
        config: DecoderConfig,
        weights: &HostWeights,
        precision: Precision,
    ) -> Result<Self> {
        config.validate()?;
        weights.validate(&config)?;
        Self::upload_from(ctx, config, weights, precision, |_, _| {})
    }

    /// Uploads the weights `source` hands out, one tensor at a time, checking each against
    /// `config`: matrices in a GGUF block format stay in it on the GPU (see
    /// [`super::weights`](crate::decoder::weights)), with the biases of the Q, K and V
    /// products the source has ([`WeightSource::bias`]) and RoPE scaled by the source's
    /// frequency factors ([`WeightSource::rope_freqs`]). `progress(done, total)` is called after
    /// each norm and each matrix (with its bias).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `config` is invalid, a tensor has the wrong size, a
    /// block matrix's rows are not a multiple of 32 values, a bias comes with a matrix other
    /// than Q, K or V, or the RoPE frequency factors are not `head_dim / 2` finite positive
    /// values; [`Error::MissingFeature`] for
    /// [`Precision::F16`] without `SHADER_F16`; the source's errors; [`Error::Wgpu`] from wgpu.
    pub fn upload_from(
        ctx: &Context,
        config: DecoderConfig,
        source: &dyn WeightSource,
        precision: Precision,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        config.validate()?;
        if precision == Precision::F16 && !ctx.caps().shader_f16 {
            return Err(Error::MissingFeature("shader-f16"));
        }
        let c = config;
        let total = 3 + (2 + LayerMatrix::ALL.len()) * c.layers;
        let mut done = 0;
        let mut tick = || {
            done += 1;
            progress(done, total);
        };
        let vector = |what: &str, x: Vec<f32>| -> Result<wgpu::Buffer> {
            if x.len() != c.d_model {
                return Err(Error::InvalidArgument(format!(
                    "{what}: {} values, expected d_model = {}",
                    x.len(),
                    c.d_model
                )));
            }
            ctx.upload(what, &x)
        };
        let mut bytes = 0u64;
        let embed =
            GpuMatrix::upload(ctx, "embedding", &source.embedding()?, (c.vocab, c.d_model))?;
        bytes += embed.gpu_bytes();
        tick();
        let lm_head = match source.output()? {
            Some(data) => {
                let m = GpuMatrix::upload(ctx, "output projection", &data, (c.vocab, c.d_model))?;
                bytes += m.gpu_bytes();
                Some(m)
            }
            None => None,
        };
        tick();
        let rope_freqs = source.rope_freqs()?;
        let rope = |heads| RopeTables::scaled(ctx, &config.rope(heads), rope_freqs.as_deref());
        let (rope_q, rope_k) = (rope(c.n_heads)?, rope(c.n_kv_heads)?);
        let final_norm = vector("final norm", source.final_norm()?)?;
        bytes += final_norm.size();
        tick();
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let (attn, ffn) = source.norms(i)?;
            let attn_norm = vector("attn_norm", attn)?;
            let ffn_norm = vector("ffn_norm", ffn)?;
            bytes += attn_norm.size() + ffn_norm.size();
            tick();
            tick();
            let mut matrices = Vec::with_capacity(LayerMatrix::ALL.len());
            let mut biases = Vec::with_capacity(LayerMatrix::ALL.len());
            for which in LayerMatrix::ALL {
                let what = format!("layer {i} {}", which.gguf_name());
                let data = source.matrix(i, which)?;
                let m = GpuMatrix::upload(ctx, &what, &data, which.shape(&c))?;
                bytes += m.gpu_bytes();
                matrices.push(m);
                let bias = match source.bias(i, which)? {
                    Some(b) => {
                        let rows = which.shape(&c).0;
                        if !matches!(which, LayerMatrix::Q | LayerMatrix::K | LayerMatrix::V) {
                            return Err(Error::InvalidArgument(format!(
                                "{what}: a bias after this product is not supported (only \
                                 after Q, K and V)"
                            )));
                        }
                        if b.len() != rows {
                            return Err(Error::InvalidArgument(format!(
                                "{what} bias: {} values, expected {rows}",
                                b.len()
                            )));
                        }
                        let buffer = ctx.upload(&format!("{what} bias"), &b)?;
                        bytes += buffer.size();
                        Some(buffer)
                    }
                    None => None,
                };
                biases.push(bias);
                tick();
            }
            layers.push(GpuLayer {
                attn_norm,
                ffn_norm,
                matrices,
                biases,
            });
        }
        Ok(Self {
            config,
            precision,
            embed,
            layers,
            final_norm,
            lm_head,
            weight_bytes: bytes,
            rope_q,
            rope_k,
            steps: Mutex::new(StepCache::default()),
            pass_per_op: AtomicBool::new(false),
        })
    }
}
