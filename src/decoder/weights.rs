//! Where a decoder's weights come from and how they sit on the GPU.
//!
//! A [`WeightSource`] hands the decoder one tensor at a time: norms as f32 vectors, matrices
//! (`[out, in]` row-major, `y = W x`) as f32 values ([`HostWeights`]) or as a GGUF tensor's
//! bytes in its block format ([`MatrixData::Blocks`], borrowed from the memory-mapped file).
//! Block matrices stay in their format on the GPU ([`QWeight`], read by the quantized product
//! and the embedding gather; a GGUF F32 tensor is such a "block" format too); f32 values
//! handed over as such ([`MatrixData::F32`]) go through the dense product
//! ([`crate::matmul::Linear`]), which takes any shape.

use std::borrow::Cow;

use super::gguf::GgmlType;
use super::model::{DecoderConfig, HostWeights};
use super::ops::qembed::{prepare_qembed, QEmbedArgs};
use super::ops::qmatmul::{prepare_qmatmul, QMatmulArgs, QWeight};
use super::ops::qmatmul_group::{can_group, prepare_qmatmul_group, GroupOutput};
use super::ops::PreparedOp;
use crate::decoder::ops::add::{prepare_add, AddArgs};
use crate::decoder::ops::embed::{prepare_embed, EmbedArgs};
use crate::gpu::Context;
use crate::matmul::{Linear, PreparedMatmul};
use crate::{Error, Result};

/// A matrix of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerMatrix {
    /// `[n_heads * head_dim, d_model]`.
    Q,
    /// `[n_kv_heads * head_dim, d_model]`.
    K,
    /// `[n_kv_heads * head_dim, d_model]`.
    V,
    /// `[d_model, n_heads * head_dim]`.
    O,
    /// `[ffn, d_model]`.
    Gate,
    /// `[ffn, d_model]`.
    Up,
    /// `[d_model, ffn]`.
    Down,
}

impl LayerMatrix {
    /// Every layer matrix, in the order a layer uses them.
    pub const ALL: [LayerMatrix; 7] = [
        LayerMatrix::Q,
        LayerMatrix::K,
        LayerMatrix::V,
        LayerMatrix::O,
        LayerMatrix::Gate,
        LayerMatrix::Up,
        LayerMatrix::Down,
    ];

    /// The matrix's place in [`LayerMatrix::ALL`].
    pub fn index(self) -> usize {
        match self {
            LayerMatrix::Q => 0,
            LayerMatrix::K => 1,
            LayerMatrix::V => 2,
            LayerMatrix::O => 3,
            LayerMatrix::Gate => 4,
            LayerMatrix::Up => 5,
            LayerMatrix::Down => 6,
        }
    }

    /// `(rows, values per row)` of the matrix in a model of shape `c` (`[out, in]`).
    pub fn shape(self, c: &DecoderConfig) -> (usize, usize) {
        match self {
            LayerMatrix::Q => (c.q_dim(), c.d_model),
            LayerMatrix::K | LayerMatrix::V => (c.kv_dim(), c.d_model),
            LayerMatrix::O => (c.d_model, c.q_dim()),
            LayerMatrix::Gate | LayerMatrix::Up => (c.ffn, c.d_model),
            LayerMatrix::Down => (c.d_model, c.ffn),
        }
    }

    /// The GGUF tensor name's part (`attn_q`, ...).
    pub fn gguf_name(self) -> &'static str {
        match self {
            LayerMatrix::Q => "attn_q",
            LayerMatrix::K => "attn_k",
            LayerMatrix::V => "attn_v",
            LayerMatrix::O => "attn_output",
            LayerMatrix::Gate => "ffn_gate",
            LayerMatrix::Up => "ffn_up",
            LayerMatrix::Down => "ffn_down",
        }
    }
}

/// A matrix's values as a source holds them.
#[derive(Debug, Clone)]
pub enum MatrixData<'a> {
    /// f32 values, row-major.
    F32(Cow<'a, [f32]>),
    /// A GGUF tensor's bytes, as the file stores them.
    Blocks {
        /// The tensor's type.
        ty: GgmlType,
        /// Its bytes.
        bytes: &'a [u8],
    },
}

/// The tensors of a decoder, one at a time (see the module docs).
pub trait WeightSource {
    /// The token embedding `[vocab, d_model]` (also the output projection when tied).
    fn embedding(&self) -> Result<MatrixData<'_>>;
    /// The output projection `[vocab, d_model]`; `None` when tied to the embedding.
    fn output(&self) -> Result<Option<MatrixData<'_>>>;
    /// The final RMSNorm weight `[d_model]`.
    fn final_norm(&self) -> Result<Vec<f32>>;
    /// Layer `layer`'s RMSNorm weights before attention and before the MLP, `[d_model]` each.
    fn norms(&self, layer: usize) -> Result<(Vec<f32>, Vec<f32>)>;
    /// Layer `layer`'s matrix `which`.
    fn matrix(&self, layer: usize, which: LayerMatrix) -> Result<MatrixData<'_>>;
    /// The bias added after layer `layer`'s product with matrix `which` (`[rows]` of the
    /// matrix), or `None` (the default: no biases). Only Q, K and V may have one (Qwen2).
    fn bias(&self, layer: usize, which: LayerMatrix) -> Result<Option<Vec<f32>>> {
        let _ = (layer, which);
        Ok(None)
    }
    /// RoPE frequency factors `[head_dim / 2]` ([`HostWeights::rope_freqs`]), or `None` (the
    /// default: unscaled RoPE).
    fn rope_freqs(&self) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
}

impl WeightSource for HostWeights {
    fn embedding(&self) -> Result<MatrixData<'_>> {
        Ok(MatrixData::F32(Cow::Borrowed(&self.embed)))
    }

    fn output(&self) -> Result<Option<MatrixData<'_>>> {
        Ok(self
            .lm_head
            .as_deref()
            .map(|h| MatrixData::F32(Cow::Borrowed(h))))
    }

    fn final_norm(&self) -> Result<Vec<f32>> {
        Ok(self.final_norm.clone())
    }

    fn norms(&self, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let l = &self.layers[layer];
        Ok((l.attn_norm.clone(), l.ffn_norm.clone()))
    }

    fn matrix(&self, layer: usize, which: LayerMatrix) -> Result<MatrixData<'_>> {
        let l = &self.layers[layer];
        let m = match which {
            LayerMatrix::Q => &l.wq,
            LayerMatrix::K => &l.wk,
            LayerMatrix::V => &l.wv,
            LayerMatrix::O => &l.wo,
            LayerMatrix::Gate => &l.w_gate,
            LayerMatrix::Up => &l.w_up,
            LayerMatrix::Down => &l.w_down,
        };
        Ok(MatrixData::F32(Cow::Borrowed(m)))
    }

    fn bias(&self, layer: usize, which: LayerMatrix) -> Result<Option<Vec<f32>>> {
        Ok(self.layers[layer].bias(which).map(<[f32]>::to_vec))
    }

    fn rope_freqs(&self) -> Result<Option<Vec<f32>>> {
        Ok(self.rope_freqs.clone())
    }
}

/// A matrix on the GPU.
#[derive(Debug)]
pub(crate) enum GpuMatrix {
    /// f32 rows, through the dense product.
    Dense {
        buffer: wgpu::Buffer,
        n: usize,
        k: usize,
    },
    /// A GGUF tensor's blocks (any type of [`crate::decoder::blocks::SUPPORTED`]), through the
    /// quantized product.
    Blocks(QWeight),
}

impl GpuMatrix {
    /// Uploads `data`, `n` rows of `k` values (`what` names it in errors).
    pub fn upload(
        ctx: &Context,
        what: &str,
        data: &MatrixData<'_>,
        (n, k): (usize, usize),
    ) -> Result<Self> {
        match data {
            MatrixData::F32(values) => {
                if values.len() != n * k {
                    return Err(Error::InvalidArgument(format!(
                        "{what}: {} values, expected {n} x {k}",
                        values.len()
                    )));
                }
                Ok(Self::Dense {
                    buffer: ctx.upload(what, values)?,
                    n,
                    k,
                })
            }
            MatrixData::Blocks { ty, bytes } => QWeight::upload(ctx, what, *ty, (n, k), bytes)
                .map(Self::Blocks)
                .map_err(|e| match e {
                    Error::ShapeMismatch { expected, got, .. } => Error::InvalidArgument(format!(
                        "{what}: {got} bytes, {n} x {k} {ty} values need {expected}"
                    )),
                    Error::InvalidArgument(m) => Error::InvalidArgument(format!("{what}: {m}")),
                    other => other,
                }),
        }
    }

    /// Bytes on the GPU.
    pub fn gpu_bytes(&self) -> u64 {
        match self {
            Self::Dense { buffer, .. } => buffer.size(),
            Self::Blocks(w) => w.gpu_bytes(),
        }
    }

    /// `y[y_row + t] = W x[x_row + t]` for `t < rows`, prepared.
    pub fn prepare(
        &self,
        ctx: &Context,
        x: &wgpu::Buffer,
        rows: (usize, usize, usize),
        y: &wgpu::Buffer,
    ) -> Result<Product> {
        self.prepare_into(ctx, x, rows, y, None)
    }

    /// `y[t] += W x[t]` for `t < rows` (a residual add), prepared: block weights add into
    /// `y` as they write it (one dispatch less); dense ones write `scratch` (as large as the
    /// product) and add it. Either way the bits of the product followed by the add.
    pub fn prepare_added(
        &self,
        ctx: &Context,
        x: &wgpu::Buffer,
        rows: usize,
        y: &wgpu::Buffer,
        scratch: &wgpu::Buffer,
    ) -> Result<Product> {
        self.prepare_into(ctx, x, (0, rows, 0), y, Some(scratch))
    }

    fn prepare_into(
        &self,
        ctx: &Context,
        x: &wgpu::Buffer,
        (x_row, rows, y_row): (usize, usize, usize),
        y: &wgpu::Buffer,
        added: Option<&wgpu::Buffer>,
    ) -> Result<Product> {
        match self {
            Self::Dense { buffer, n, k } => {
                let linear = Linear {
                    x,
                    x_row,
                    rows,
                    k: *k,
                    w: buffer,
                    n: *n,
                    y: added.unwrap_or(y),
                    y_row,
                };
                let matmul = linear.prepare(ctx)?;
                let add = match added {
                    Some(scratch) => Some(prepare_add(
                        ctx,
                        &AddArgs {
                            n: rows * n,
                            x: y,
                            y: scratch,
                        },
                    )?),
                    None => None,
                };
                Ok(Product::Dense { matmul, add })
            }
            Self::Blocks(w) => {
                let args = QMatmulArgs {
                    x,
                    x_row,
                    rows,
                    w,
                    y,
                    y_row,
                    accumulate: added.is_some(),
                };
                let (n, k) = w.shape();
                Ok(Product::Blocks {
                    op: prepare_qmatmul(ctx, &args)?,
                    flops: 2 * (rows * n * k) as u64,
                })
            }
        }
    }

    /// `y_d[0 .. n_d] = W_d x[x_row]` for each `(W_d, y_d)` of `outputs`: one row of `x` and
    /// every matrix in its block format, prepared as one grouped product where the row kernel
    /// takes them together ([`can_group`]: a CPU adapter, one type and row length, at most
    /// three). `None` otherwise: prepare each alone. Each output has the bits of its own
    /// product either way.
    pub fn prepare_group(
        ctx: &Context,
        x: &wgpu::Buffer,
        x_row: usize,
        outputs: &[(&Self, &wgpu::Buffer)],
    ) -> Result<Option<Product>> {
        let group: Option<Vec<GroupOutput>> = outputs
            .iter()
            .map(|&(m, y)| match m {
                Self::Blocks(w) => Some(GroupOutput { w, y }),
                Self::Dense { .. } => None,
            })
            .collect();
        let Some(group) = group.filter(|g| can_group(ctx, x, x_row, g)) else {
            return Ok(None);
        };
        let flops = group
            .iter()
            .map(|o| {
                let (n, k) = o.w.shape();
                2 * (n * k) as u64
            })
            .sum();
        Ok(Some(Product::Blocks {
            op: prepare_qmatmul_group(ctx, x, x_row, &group)?,
            flops,
        }))
    }

    /// The gather `out[t] = W[tokens[t]]` for `t < n_tokens` (the embedding), prepared.
    pub fn prepare_gather(
        &self,
        ctx: &Context,
        tokens: &wgpu::Buffer,
        n_tokens: usize,
        out: &wgpu::Buffer,
    ) -> Result<PreparedOp> {
        match self {
            Self::Dense { buffer, n, k } => prepare_embed(
                ctx,
                &EmbedArgs {
                    tokens,
                    n_tokens,
                    dim: *k,
                    vocab: *n,
                    table: buffer,
                    out,
                },
            ),
            Self::Blocks(table) => prepare_qembed(
                ctx,
                &QEmbedArgs {
                    tokens,
                    n_tokens,
                    table,
                    out,
                },
            ),
        }
    }
}

/// A matrix product prepared for a step.
#[derive(Debug)]
pub(crate) enum Product {
    /// A dense product, and with a residual its add.
    Dense {
        matmul: PreparedMatmul,
        add: Option<PreparedOp>,
    },
    Blocks {
        op: PreparedOp,
        flops: u64,
    },
}

impl Product {
    /// Records the product (creates nothing).
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>) {
        match self {
            Self::Dense { matmul, add } => {
                matmul.encode(pass);
                if let Some(add) = add {
                    add.encode(pass);
                }
            }
            Self::Blocks { op, .. } => op.encode(pass),
        }
    }

    /// FLOPs of one recording.
    pub fn flops(&self) -> u64 {
        match self {
            Self::Dense { matmul, .. } => matmul.flops(),
            Self::Blocks { flops, .. } => *flops,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_matrices_are_numbered_in_order() {
        for (i, m) in LayerMatrix::ALL.iter().enumerate() {
            assert_eq!(m.index(), i);
        }
    }
}
