//! GPU block pools: one tensor (K or V of one layer) stored as blocks of
//! `[num_kv_heads][block_size][row_stride]` u32 words (head-major inside a block, so a decode
//! workgroup reads one head's rows contiguously; `row_stride` is `words_per_row` rounded up to 4
//! words), followed, for formats with per-row scales, by the rows' scale words
//! `[num_kv_heads][block_size][scale_words_per_row]`, the block rounded up to a multiple of 4
//! words ([`KvDtype::block_words`]): every block and every row starts on a 16-byte boundary, and
//! kvattn writes the padding words as zero. Scales thus travel
//! with their block through every copy, swap and snapshot. A per-tensor FP8 scale lives in a
//! small uniform of the pool ([`BlockPool::scale_uniform`]). A pool larger than the adapter's
//! storage binding limit is split over several buffers; block ids map to (buffer, offset).

use super::allocator::BlockId;
use crate::gpu::{Context, Readback, STORAGE};
use crate::quant::{Fp8Scale, KvDtype, ScaleMode};
use crate::{Error, Result};

crate::wgsl_struct! {
    /// Mirror of the WGSL `TensorScale` uniform every pool carries: its per-tensor FP8 scale and
    /// reciprocal (1 and 1 for the other scale modes).
    pub struct TensorScale {
        /// Read multiplier: `value = decode(q) * scale`.
        pub scale: f32,
        /// Write multiplier: `q = encode(x * inv_scale)`, computed once on the host.
        pub inv_scale: f32,
        /// Padding.
        pub _pad0: u32,
        /// Padding.
        pub _pad1: u32,
    }
}

/// Shape and storage format of one tensor's pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolLayout {
    /// KV heads.
    pub num_kv_heads: usize,
    /// Values per token row.
    pub head_dim: usize,
    /// Storage format.
    pub dtype: KvDtype,
    /// Token slots per block: a power of two from 1 to 256.
    pub block_size: usize,
    /// Scales of a quantized format: [`ScaleMode::PerTensor`] (FP8 only) or
    /// [`ScaleMode::PerRow`] (also the mode of formats without scales).
    pub scale: ScaleMode,
}

impl PoolLayout {
    /// Checks heads, head dim (for the format) and block size.
    pub fn validate(&self) -> Result<()> {
        if self.num_kv_heads == 0 {
            return Err(Error::InvalidArgument(
                "a pool needs at least one KV head".into(),
            ));
        }
        if !self.block_size.is_power_of_two() || self.block_size > 256 {
            return Err(Error::InvalidArgument(format!(
                "block size {} is not a power of two from 1 to 256",
                self.block_size
            )));
        }
        self.dtype.check_scale_mode(self.scale)?;
        self.dtype.check_head_dim(self.head_dim)
    }

    /// u32 value words of one token row.
    pub fn words_per_row(&self) -> usize {
        self.dtype.words_per_row(self.head_dim)
    }

    /// u32 scale words of one token row (0 for unscaled formats and per-tensor FP8).
    pub fn scale_words_per_row(&self) -> usize {
        self.dtype.scale_words_per_row(self.head_dim, self.scale)
    }

    /// Token rows of one block (KV heads x slots): the WGSL `KV_BLOCK_ROWS`.
    pub fn block_rows(&self) -> usize {
        self.num_kv_heads * self.block_size
    }

    /// u32 words from one value row of a block to the next ([`KvDtype::row_stride`]:
    /// `words_per_row` rounded up to a multiple of 4).
    pub fn row_stride(&self) -> usize {
        self.dtype.row_stride(self.head_dim)
    }

    /// u32 words of one block: values, then scales, rounded up to a multiple of 4 words
    /// ([`KvDtype::block_words`]).
    pub fn block_words(&self) -> usize {
        self.dtype
            .block_words(self.head_dim, self.scale, self.block_rows())
    }

    /// Whether K/V of this layout carry a per-tensor scale.
    pub fn per_tensor_scale(&self) -> bool {
        matches!(self.scale, ScaleMode::PerTensor(_))
    }

    /// The uniform of this layout's per-tensor scale (1 and 1 without one).
    pub fn tensor_scale(&self) -> Result<TensorScale> {
        let s = match self.scale {
            ScaleMode::PerTensor(s) => Fp8Scale::per_tensor(s)?,
            ScaleMode::PerRow => Fp8Scale::ONE,
        };
        Ok(TensorScale {
            scale: s.scale,
            inv_scale: s.inv_scale,
            ..Default::default()
        })
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> u64 {
        self.block_words() as u64 * 4
    }

    /// Word index, inside its block, of the values of `head` at slot `offset`.
    pub fn row_in_block(&self, head: usize, offset: usize) -> usize {
        (head * self.block_size + offset) * self.row_stride()
    }

    /// Word index, inside its block, of the scale words of `head` at slot `offset`.
    pub fn scales_in_block(&self, head: usize, offset: usize) -> usize {
        self.block_rows() * self.row_stride()
            + (head * self.block_size + offset) * self.scale_words_per_row()
    }
}

/// The blocks of one tensor on the GPU.
#[derive(Debug)]
pub struct BlockPool {
    layout: PoolLayout,
    num_blocks: usize,
    blocks_per_buffer: usize,
    buffers: Vec<wgpu::Buffer>,
    scale_uniform: wgpu::Buffer,
    /// 16 bytes of storage nothing reads: bound where a kernel declares a view of the pool it
    /// does not use for this layout (WebGPU refuses one buffer in two bindings where either is
    /// writable).
    spare: wgpu::Buffer,
}

impl BlockPool {
    /// Most blocks of `layout` one buffer can hold: the storage binding limit
    /// ([`Capabilities::max_storage_buffer_binding_size`](crate::gpu::Capabilities)) over the
    /// block size.
    pub fn max_blocks_per_buffer(ctx: &Context, layout: &PoolLayout) -> Result<usize> {
        layout.validate()?;
        let caps = ctx.caps();
        // Whole 16-byte units: buffers are rounded up to 16 bytes (kernels read them as
        // vec4<u32>), which must stay within the limit.
        let per_binding = caps
            .max_storage_buffer_binding_size
            .min(caps.max_buffer_size)
            / 16
            * 16;
        let n = (per_binding / layout.block_bytes()) as usize;
        if n == 0 {
            return Err(Error::TooLarge {
                what: "one pool block".into(),
                bytes: layout.block_bytes(),
                limit: per_binding,
            });
        }
        Ok(n)
    }

    /// Allocates `num_blocks` blocks of `layout`, in as few buffers as the storage binding limit
    /// allows.
    pub fn new(ctx: &Context, layout: PoolLayout, num_blocks: usize, label: &str) -> Result<Self> {
        let per_buffer = Self::max_blocks_per_buffer(ctx, &layout)?;
        Self::with_blocks_per_buffer(ctx, layout, num_blocks, per_buffer, label)
    }

    /// Allocates `num_blocks` blocks, `blocks_per_buffer` per buffer (at most
    /// [`max_blocks_per_buffer`](Self::max_blocks_per_buffer)). The K and V pools of a cache
    /// use the same split, so a block's K and V live in buffers of the same index.
    pub fn with_blocks_per_buffer(
        ctx: &Context,
        layout: PoolLayout,
        num_blocks: usize,
        blocks_per_buffer: usize,
        label: &str,
    ) -> Result<Self> {
        let max = Self::max_blocks_per_buffer(ctx, &layout)?;
        if blocks_per_buffer == 0 || blocks_per_buffer > max {
            return Err(Error::InvalidArgument(format!(
                "{blocks_per_buffer} blocks per buffer for {label}: 1 to {max} fit one binding"
            )));
        }
        if num_blocks == 0 || num_blocks >= 1 << 31 {
            return Err(Error::InvalidArgument(format!(
                "a pool needs 1 to 2^31 - 1 blocks, not {num_blocks}"
            )));
        }
        let scale_uniform = ctx.uniform("tensor scale", &layout.tensor_scale()?)?;
        let spare = ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvattn pool spare"),
            size: 16,
            usage: STORAGE,
            mapped_at_creation: false,
        })?;
        let mut buffers = Vec::new();
        let mut left = num_blocks;
        while left > 0 {
            let n = left.min(blocks_per_buffer);
            let buffer = ctx.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                // Rounded up to 16 bytes, so that every word is part of a vec4<u32>.
                size: (n as u64 * layout.block_bytes()).next_multiple_of(16),
                usage: STORAGE,
                mapped_at_creation: false,
            })?;
            buffers.push(buffer);
            left -= n;
        }
        Ok(Self {
            layout,
            num_blocks,
            blocks_per_buffer,
            buffers,
            scale_uniform,
            spare,
        })
    }

    /// The uniform holding this pool's per-tensor scale and its reciprocal ([`TensorScale`]).
    pub fn scale_uniform(&self) -> &wgpu::Buffer {
        &self.scale_uniform
    }

    /// 16 bytes of storage nothing reads, for a kernel's unused view of the pool (see the
    /// field's docs).
    pub(crate) fn spare(&self) -> &wgpu::Buffer {
        &self.spare
    }

    /// The layout.
    pub fn layout(&self) -> &PoolLayout {
        &self.layout
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks per buffer (the last buffer may hold fewer).
    pub fn blocks_per_buffer(&self) -> usize {
        self.blocks_per_buffer
    }

    /// The buffers; buffer `i` holds blocks `i * blocks_per_buffer ..`.
    pub fn buffers(&self) -> &[wgpu::Buffer] {
        &self.buffers
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> u64 {
        self.num_blocks as u64 * self.layout.block_bytes()
    }

    /// (buffer index, block index inside that buffer) of `block`.
    pub fn locate(&self, block: BlockId) -> Result<(usize, usize)> {
        let b = block as usize;
        if b >= self.num_blocks {
            return Err(Error::InvalidArgument(format!(
                "block {block} out of range ({} blocks)",
                self.num_blocks
            )));
        }
        Ok((b / self.blocks_per_buffer, b % self.blocks_per_buffer))
    }

    /// Copies `blocks` to the host, in the given order: `blocks.len() * block_words` words. One
    /// submission (the block copies gathered into a staging buffer, then copied into a
    /// [`Readback`]), then a wait on that submission only.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a block lies outside the pool (nothing submitted);
    /// [`Error::TooLarge`] when the blocks exceed the adapter's buffer size; creation,
    /// submission and mapping errors.
    pub fn read_blocks(&self, ctx: &Context, blocks: &[BlockId]) -> Result<Vec<u32>> {
        pollster::block_on(self.read_blocks_async(ctx, blocks))
    }

    /// [`read_blocks`](Self::read_blocks) without blocking: the form to await in the browser.
    pub async fn read_blocks_async(&self, ctx: &Context, blocks: &[BlockId]) -> Result<Vec<u32>> {
        let bytes = self.layout.block_bytes();
        let total = bytes * blocks.len() as u64;
        if total == 0 {
            return Ok(Vec::new());
        }
        let located = blocks
            .iter()
            .map(|&b| self.locate(b))
            .collect::<Result<Vec<_>>>()?;
        let limit = ctx.caps().max_buffer_size;
        if total > limit {
            return Err(Error::TooLarge {
                what: format!("a readback of {} blocks", blocks.len()),
                bytes: total,
                limit,
            });
        }
        let gathered = ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvattn block gather"),
            size: total,
            usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })?;
        let readback = Readback::new(ctx, "kvattn block readback", total)?;
        let mut encoder = ctx.encoder("read blocks");
        for (i, &(buf, local)) in located.iter().enumerate() {
            encoder.copy_buffer_to_buffer(
                &self.buffers[buf],
                local as u64 * bytes,
                &gathered,
                i as u64 * bytes,
                bytes,
            );
        }
        readback.encode_copy(&mut encoder, &gathered, 0, total)?;
        let index = ctx.submit("read blocks", encoder)?;
        readback.read_async(ctx, index, (total / 4) as usize).await
    }

    /// Writes `words` (`blocks.len() * block_words`, in the given order) into `blocks`.
    pub fn write_blocks(&self, ctx: &Context, blocks: &[BlockId], words: &[u32]) -> Result<()> {
        let bw = self.layout.block_words();
        if words.len() != blocks.len() * bw {
            return Err(Error::ShapeMismatch {
                what: "block words",
                expected: blocks.len() * bw,
                got: words.len(),
            });
        }
        let located = blocks
            .iter()
            .map(|&b| self.locate(b))
            .collect::<Result<Vec<_>>>()?;
        for (chunk, &(buf, local)) in words.chunks(bw).zip(&located) {
            ctx.write_buffer(
                &self.buffers[buf],
                local as u64 * self.layout.block_bytes(),
                bytemuck::cast_slice(chunk),
            )?;
        }
        Ok(())
    }
}

/// The K and V pools of one layer.
#[derive(Debug)]
pub struct LayerPools {
    /// Keys.
    pub k: BlockPool,
    /// Values.
    pub v: BlockPool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every supported layout (format and scale mode, the head dims kvattn's kernels are tested
    /// at, block sizes 1 to 256, 1 to 8 KV heads) has blocks, value rows and scale sections on
    /// 16-byte boundaries, and whole 16-byte rows: the condition under which the attention
    /// kernels read rows as vec4<u32> (`attention::paged::rows_aligned`).
    #[test]
    fn every_supported_layout_has_16_byte_aligned_rows() {
        let mut checked = 0;
        for dtype in KvDtype::ALL {
            let modes: &[ScaleMode] = if dtype.fp8_format().is_some() {
                &[ScaleMode::PerRow, ScaleMode::PerTensor(0.5)]
            } else {
                &[ScaleMode::PerRow]
            };
            for &scale in modes {
                for head_dim in [64, 80, 96, 128, 256, 576, 512] {
                    if dtype.check_head_dim(head_dim).is_err() {
                        continue;
                    }
                    for block_size in (0..=8).map(|p| 1 << p) {
                        for num_kv_heads in 1..=8 {
                            let l = PoolLayout {
                                num_kv_heads,
                                head_dim,
                                dtype,
                                block_size,
                                scale,
                            };
                            l.validate().unwrap();
                            let what = format!("{l:?}");
                            assert_eq!(l.words_per_row() % 4, 0, "{what}");
                            assert_eq!(l.block_words() % 4, 0, "{what}");
                            assert_eq!(l.row_stride(), l.words_per_row(), "{what}");
                            let unpadded =
                                l.block_rows() * (l.words_per_row() + l.scale_words_per_row());
                            assert!(l.block_words() >= unpadded, "{what}");
                            assert!(l.block_words() < unpadded + 4, "{what}");
                            for h in 0..num_kv_heads {
                                for s in [0, block_size / 2, block_size - 1] {
                                    assert_eq!(l.row_in_block(h, s) % 4, 0, "{what}");
                                    let end = l.scales_in_block(h, s) + l.scale_words_per_row();
                                    assert!(end <= l.block_words(), "{what}");
                                }
                            }
                            assert_eq!(l.scales_in_block(0, 0) % 4, 0, "{what}");
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 700, "{checked} layouts");
    }

    /// Head dims whose rows are not whole 16-byte units get padded rows, so every row still
    /// starts on a 16-byte boundary; the example of issue 18 (int8, block size 1, 3 KV heads,
    /// head dim 128) is padded from 99 to 100 words.
    #[test]
    fn rows_and_blocks_are_padded_to_16_bytes() {
        let int8 = PoolLayout {
            num_kv_heads: 3,
            head_dim: 128,
            dtype: KvDtype::Int8,
            block_size: 1,
            scale: ScaleMode::PerRow,
        };
        assert_eq!(int8.block_words(), 100);
        assert_eq!(int8.scales_in_block(2, 0), 98);
        let f16 = PoolLayout {
            head_dim: 20,
            dtype: KvDtype::F16,
            ..int8
        };
        assert_eq!((f16.words_per_row(), f16.row_stride()), (10, 12));
        assert_eq!(f16.row_in_block(1, 0), 12);
        assert_eq!(f16.block_words(), 36);
        let fp8 = PoolLayout {
            head_dim: 4,
            dtype: KvDtype::Fp8E4M3,
            block_size: 2,
            ..int8
        };
        // 6 rows of 1 word padded to 4, then 6 scale words: 30 words, padded to 32.
        assert_eq!(fp8.row_in_block(2, 1), 20);
        assert_eq!(fp8.scales_in_block(2, 1), 29);
        assert_eq!(fp8.block_words(), 32);
    }
}
