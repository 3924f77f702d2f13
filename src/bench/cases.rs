//! Benchmark cases (ARCHITECTURE.md section 13): what one case runs ([`Case`]), the bytes and
//! floating-point operations it must at least move and do ([`Case::kv_bytes`], [`Case::flops`]),
//! building its buffers once ([`prepare`]), timing it ([`measure`]) and judging it against the
//! adapter's ceilings ([`row`]). `kvattn bench` and the criterion benches both run these cases.
//!
//! A case is identified by [`Case::id`], for example `decode/hd128/g4/ctx4096/b1/f16/bs16`
//! (kernel, head dim, GQA group, keys per sequence, batch, KV storage format, block size or
//! `contig` for the contiguous cache).

mod fill;
mod prepare;
mod row;
mod sets;

pub use prepare::{measure, prepare, Measurement, Prepared};
pub use row::{row, Bound, Row};
pub use sets::{full_set, quick_set};

use crate::cache::paged::PagedKvConfig;
use crate::cache::pool::PoolLayout;
use crate::mla::MlaCacheConfig;
use crate::problem::MlaShape;
use crate::quant::KvDtype;
use crate::shader::Precision;
use crate::{Error, Result};

/// Dims of the RoPE keys of an MLA case (DeepSeek-V2's `qk_rope_head_dim`).
pub const MLA_ROPE_DIM: usize = 64;
/// Dims of an MLA case's per-head query part without position and of its values (DeepSeek-V2's
/// `qk_nope_head_dim` and `v_head_dim`).
pub const MLA_HEAD_DIM: usize = 128;

/// Which kernel a case runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum CaseKernel {
    /// Paged (or contiguous) attention with one query token per sequence.
    Decode,
    /// Paged attention over a causal chunk of query tokens after a cached prefix.
    Prefill,
    /// Writing new K and V rows into the cache, encoded into its storage format.
    AppendKv,
    /// MLA's absorbed decode path: query absorption, attention over the latent cache, output
    /// up-projection.
    MlaAbsorbed,
    /// The bandwidth kernel copying as many bytes as the decode case of the same fields reads.
    Copy,
}

impl CaseKernel {
    /// The name in case ids and tables: `decode`, `prefill`, `append_kv`, `mla_absorbed`,
    /// `copy`.
    pub fn name(self) -> &'static str {
        match self {
            CaseKernel::Decode => "decode",
            CaseKernel::Prefill => "prefill",
            CaseKernel::AppendKv => "append_kv",
            CaseKernel::MlaAbsorbed => "mla_absorbed",
            CaseKernel::Copy => "copy",
        }
    }
}

/// One benchmark case. Build one with a constructor ([`Case::decode`], [`Case::prefill`],
/// [`Case::append_kv`], [`Case::mla_absorbed`], [`Case::copy`]) and the `with_*` modifiers.
///
/// For [`CaseKernel::MlaAbsorbed`] `head_dim` is the latent rank, `q_heads` the attention heads
/// and `kv_heads` 1; the RoPE keys have [`MLA_ROPE_DIM`] dims and the query and value heads
/// [`MLA_HEAD_DIM`]. For [`CaseKernel::AppendKv`] `chunk` (= `context`) is the tokens written per
/// sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Case {
    /// The kernel.
    pub kernel: CaseKernel,
    /// Storage format of K and V (MLA: of the latent).
    pub kv_dtype: KvDtype,
    /// Keys per sequence: for prefill the cached prefix plus the chunk.
    pub context: usize,
    /// Query tokens per sequence: 1 for decode, the chunk for prefill, the tokens written for
    /// append.
    pub chunk: usize,
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dim of Q, K and V (MLA: the latent rank).
    pub head_dim: usize,
    /// Token slots per cache block (1 for the contiguous cache).
    pub block_size: usize,
    /// Whether the KV sits in a paged cache (`false`: the contiguous `[total_k, Hkv, d]`
    /// layout of [`decode`](crate::attention::decode::decode), decode only).
    pub paged: bool,
    /// Kernel precision.
    pub precision: Precision,
}

impl Case {
    /// Decode over a paged cache: GQA 32/8, head dim 128, one sequence of `context` keys,
    /// block size 16, f32 kernel.
    pub fn decode(kv_dtype: KvDtype, context: usize) -> Self {
        Self {
            kernel: CaseKernel::Decode,
            kv_dtype,
            context,
            chunk: 1,
            batch: 1,
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            paged: true,
            precision: Precision::F32,
        }
    }

    /// Causal prefill of `chunk` query tokens after `prefix` cached ones, otherwise as
    /// [`Case::decode`].
    pub fn prefill(kv_dtype: KvDtype, prefix: usize, chunk: usize) -> Self {
        Self {
            kernel: CaseKernel::Prefill,
            context: prefix + chunk,
            chunk,
            ..Self::decode(kv_dtype, 1)
        }
    }

    /// Writing `tokens` new K and V rows (f32 source) per sequence, 8 KV heads of 128.
    pub fn append_kv(kv_dtype: KvDtype, tokens: usize) -> Self {
        Self {
            kernel: CaseKernel::AppendKv,
            context: tokens,
            chunk: tokens,
            ..Self::decode(kv_dtype, 1)
        }
    }

    /// MLA absorbed decode with DeepSeek-V2's shape (128 heads, rank 512, RoPE 64, nope and v
    /// 128), a latent in `latent` over `context` tokens, block size 64.
    pub fn mla_absorbed(latent: KvDtype, context: usize) -> Self {
        let s = MlaShape::DEEPSEEK_V2;
        Self {
            kernel: CaseKernel::MlaAbsorbed,
            q_heads: s.num_heads,
            kv_heads: 1,
            head_dim: s.rank,
            block_size: 64,
            ..Self::decode(latent, context)
        }
    }

    /// The copy kernel moving the bytes [`Case::decode`]`(kv_dtype, context)` reads.
    pub fn copy(kv_dtype: KvDtype, context: usize) -> Self {
        Self {
            kernel: CaseKernel::Copy,
            ..Self::decode(kv_dtype, context)
        }
    }

    /// The same case with `q_heads` query heads and `kv_heads` KV heads.
    pub fn with_heads(self, q_heads: usize, kv_heads: usize) -> Self {
        Self {
            q_heads,
            kv_heads,
            ..self
        }
    }

    /// The same case with head dim `head_dim`.
    pub fn with_head_dim(self, head_dim: usize) -> Self {
        Self { head_dim, ..self }
    }

    /// The same case over `batch` sequences.
    pub fn with_batch(self, batch: usize) -> Self {
        Self { batch, ..self }
    }

    /// The same case with `block_size` slots per block.
    pub fn with_block_size(self, block_size: usize) -> Self {
        Self { block_size, ..self }
    }

    /// The same case in kernel precision `precision`.
    pub fn with_precision(self, precision: Precision) -> Self {
        Self { precision, ..self }
    }

    /// The same case over the contiguous cache (block size 1, identity block table).
    pub fn contiguous(self) -> Self {
        Self {
            paged: false,
            block_size: 1,
            ..self
        }
    }

    /// The same case with `context` keys per sequence; a prefill chunk longer than that is cut
    /// to it, an append writes `context` tokens.
    pub fn with_context(self, context: usize) -> Self {
        let chunk = match self.kernel {
            CaseKernel::Decode | CaseKernel::MlaAbsorbed | CaseKernel::Copy => self.chunk,
            CaseKernel::Prefill => self.chunk.min(context),
            CaseKernel::AppendKv => context,
        };
        Self {
            context,
            chunk,
            ..self
        }
    }

    /// GQA group: query heads per KV head.
    pub fn group(&self) -> usize {
        self.q_heads / self.kv_heads.max(1)
    }

    /// The id, e.g. `decode/hd128/g4/ctx4096/b1/f16/bs16`,
    /// `prefill/hd128/g4/ctx4608/q512/b1/f16/bs16`, `decode/hd128/g4/ctx16384/b1/f16/contig`,
    /// `append_kv/hd128/kv8/tok4096/b1/f16/bs16`, `mla_absorbed/r512/h128/ctx4096/b1/f16/bs64`,
    /// `copy/hd128/kv8/ctx16384/b1/f16` (the kernel precision is not part of it).
    pub fn id(&self) -> String {
        let (b, dtype) = (self.batch, self.kv_dtype);
        let storage = if self.paged {
            format!("bs{}", self.block_size)
        } else {
            "contig".to_string()
        };
        let (hd, ctx) = (self.head_dim, self.context);
        match self.kernel {
            CaseKernel::Decode => {
                format!(
                    "decode/hd{hd}/g{}/ctx{ctx}/b{b}/{dtype}/{storage}",
                    self.group()
                )
            }
            CaseKernel::Prefill => format!(
                "prefill/hd{hd}/g{}/ctx{ctx}/q{}/b{b}/{dtype}/{storage}",
                self.group(),
                self.chunk
            ),
            CaseKernel::AppendKv => format!(
                "append_kv/hd{hd}/kv{}/tok{}/b{b}/{dtype}/{storage}",
                self.kv_heads, self.chunk
            ),
            CaseKernel::MlaAbsorbed => format!(
                "mla_absorbed/r{hd}/h{}/ctx{ctx}/b{b}/{dtype}/{storage}",
                self.q_heads
            ),
            CaseKernel::Copy => format!("copy/hd{hd}/kv{}/ctx{ctx}/b{b}/{dtype}", self.kv_heads),
        }
    }

    /// Checks the fields: positive sizes, whole GQA groups, a chunk within the context (1 for
    /// decode and MLA, the context for append), a head dim the format takes, a power-of-two
    /// block size up to 256, one KV head for MLA, and the contiguous cache for decode in f32,
    /// f16 or bf16 only.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] or [`Error::UnsupportedHeadDim`] saying what is wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(format!("case {}: {m}", self.id())));
        for (what, v) in [
            ("context", self.context),
            ("chunk", self.chunk),
            ("batch", self.batch),
            ("q_heads", self.q_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return bad(format!("{what} must be positive"));
            }
        }
        if self.q_heads % self.kv_heads != 0 {
            return bad(format!(
                "{} query heads do not split into groups of {} KV heads",
                self.q_heads, self.kv_heads
            ));
        }
        if !self.block_size.is_power_of_two() || self.block_size > 256 {
            return bad(format!(
                "block size {} is not a power of two from 1 to 256",
                self.block_size
            ));
        }
        let chunk_ok = match self.kernel {
            CaseKernel::Decode | CaseKernel::MlaAbsorbed | CaseKernel::Copy => self.chunk == 1,
            CaseKernel::Prefill => self.chunk <= self.context,
            CaseKernel::AppendKv => self.chunk == self.context,
        };
        if !chunk_ok {
            return bad(format!(
                "chunk {} does not suit {} over {} keys",
                self.chunk,
                self.kernel.name(),
                self.context
            ));
        }
        if self.kernel == CaseKernel::MlaAbsorbed && self.kv_heads != 1 {
            return bad("MLA's latent cache has one KV head".into());
        }
        if !self.paged
            && (self.kernel != CaseKernel::Decode
                || !matches!(self.kv_dtype, KvDtype::F32 | KvDtype::F16 | KvDtype::Bf16))
        {
            return bad("the contiguous cache serves decode in f32, f16 or bf16 only".into());
        }
        self.kv_dtype.check_head_dim(self.head_dim)
    }

    /// The pool layouts of K and V (MLA: of the latent and the RoPE keys), block size included.
    pub fn layouts(&self) -> (PoolLayout, PoolLayout) {
        if self.kernel == CaseKernel::MlaAbsorbed {
            let c = self.mla_cache_config().paged();
            return (c.k_layout(), c.v_layout());
        }
        let c = self.paged_config();
        (c.k_layout(), c.v_layout())
    }

    /// The one-layer cache configuration of a paged case (prefix caching off, so that every
    /// sequence has blocks of its own).
    pub fn paged_config(&self) -> PagedKvConfig {
        PagedKvConfig {
            block_size: self.block_size,
            prefix_caching: false,
            ..PagedKvConfig::new(1, self.kv_heads, self.head_dim, self.kv_dtype)
        }
    }

    /// The one-layer latent cache configuration of an MLA case (prefix caching off).
    pub fn mla_cache_config(&self) -> MlaCacheConfig {
        MlaCacheConfig {
            block_size: self.block_size,
            prefix_caching: false,
            ..MlaCacheConfig::new(1, self.head_dim, MLA_ROPE_DIM, self.kv_dtype)
        }
    }

    /// The MLA layer shape of an MLA case.
    pub fn mla_shape(&self) -> MlaShape {
        MlaShape {
            num_heads: self.q_heads,
            d_nope: MLA_HEAD_DIM,
            d_rope: MLA_ROPE_DIM,
            rank: self.head_dim,
            d_v: MLA_HEAD_DIM,
        }
    }

    /// Bytes of the K and V rows of one token (every KV head, scales included).
    fn token_bytes(&self) -> u64 {
        let row = |l: PoolLayout| 4 * (l.words_per_row() + l.scale_words_per_row()) as u64;
        let (k, v) = self.layouts();
        self.kv_heads as u64 * (row(k) + row(v))
    }

    /// Bytes of every K and V row of the batch, scales included: what attention must read.
    fn cache_bytes(&self) -> u64 {
        self.batch as u64 * self.context as u64 * self.token_bytes()
    }

    /// Bytes the copy kernel of a [`CaseKernel::Copy`] case copies: every K and V row of the
    /// batch, scales included (what the decode case of the same fields reads), rounded down to
    /// the kernel's 16-byte loads.
    pub fn copy_bytes(&self) -> u64 {
        self.cache_bytes() / 16 * 16
    }

    /// The unique bytes the kernel must move: for attention and MLA every K and V row of the
    /// batch, scales included (the pool layouts' value and scale words); for append the f32
    /// source rows read plus the encoded rows and scales written; for copy the bytes read plus
    /// the bytes written. Weights (MLA's projections), queries and outputs are not counted.
    pub fn kv_bytes(&self) -> u64 {
        match self.kernel {
            CaseKernel::Decode | CaseKernel::Prefill | CaseKernel::MlaAbsorbed => {
                self.cache_bytes()
            }
            CaseKernel::AppendKv => {
                let source = self.kv_heads as u64 * 2 * self.head_dim as u64 * 4;
                self.batch as u64 * self.chunk as u64 * (source + self.token_bytes())
            }
            CaseKernel::Copy => 2 * self.copy_bytes(),
        }
    }

    /// Floating-point operations of the attention: `4 * q_heads * head_dim` per visible key and
    /// query token (a multiply and an add for `q . k` and for `p * v`), where query `i` of a
    /// chunk after `P` cached keys sees `P + i + 1` keys (decode: every key); for MLA
    /// `2 * heads * ((rank + rope) + rank)` per key (the projections are not counted); 0 for
    /// append and copy.
    pub fn flops(&self) -> u64 {
        let (b, ctx) = (self.batch as u64, self.context as u64);
        match self.kernel {
            CaseKernel::Decode | CaseKernel::Prefill => {
                let chunk = self.chunk as u64;
                let prefix = ctx - chunk.min(ctx);
                let visible = chunk * prefix + chunk * (chunk + 1) / 2;
                4 * self.q_heads as u64 * self.head_dim as u64 * visible * b
            }
            CaseKernel::MlaAbsorbed => {
                let rank = self.head_dim as u64;
                let per_key = (rank + MLA_ROPE_DIM as u64) + rank;
                2 * self.q_heads as u64 * ctx * per_key * b
            }
            CaseKernel::AppendKv | CaseKernel::Copy => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_bytes_flops_and_id() {
        let c = Case::decode(KvDtype::F16, 4096);
        assert_eq!(c.id(), "decode/hd128/g4/ctx4096/b1/f16/bs16");
        // 4096 tokens x 8 heads x (256 + 256) bytes.
        assert_eq!(c.kv_bytes(), 16_777_216);
        // 4 x 32 heads x 128 dims x 4096 keys.
        assert_eq!(c.flops(), 67_108_864);
        let b8 = c.with_batch(8);
        assert_eq!(b8.kv_bytes(), 8 * 16_777_216);
        assert_eq!(b8.flops(), 8 * 67_108_864);
        assert_eq!(c.contiguous().id(), "decode/hd128/g4/ctx4096/b1/f16/contig");
        assert_eq!(c.contiguous().kv_bytes(), c.kv_bytes());
        c.validate().unwrap();
    }

    #[test]
    fn quantized_bytes_count_the_scales() {
        // int8: 128 value bytes + one 4-byte scale per row, K and V, 8 heads.
        assert_eq!(
            Case::decode(KvDtype::Int8, 4096).kv_bytes(),
            4096 * 8 * 2 * 132
        );
        // fp8 per row: the same.
        assert_eq!(
            Case::decode(KvDtype::Fp8E4M3, 4096).kv_bytes(),
            4096 * 8 * 2 * 132
        );
        // int4: 64 value bytes + 4 groups of 32 with a 4-byte scale/min word each.
        assert_eq!(
            Case::decode(KvDtype::Int4, 4096).kv_bytes(),
            4096 * 8 * 2 * 80
        );
        assert_eq!(
            Case::decode(KvDtype::F32, 1024).kv_bytes(),
            1024 * 8 * 2 * 512
        );
    }

    #[test]
    fn causal_prefill_counts_visible_keys() {
        let c = Case::prefill(KvDtype::F16, 4096, 512);
        assert_eq!(c.id(), "prefill/hd128/g4/ctx4608/q512/b1/f16/bs16");
        assert_eq!(c.context, 4608);
        // 512 queries see 4096 + i + 1 keys: 512 x 4096 + 512 x 513 / 2 = 2,228,480.
        assert_eq!(c.flops(), 4 * 32 * 128 * 2_228_480);
        assert_eq!(c.flops(), 36_511_416_320);
        assert_eq!(c.kv_bytes(), 4608 * 8 * 512);
        // A chunk after no prefix: 512 x 513 / 2 keys.
        assert_eq!(
            Case::prefill(KvDtype::F16, 0, 512).flops(),
            4 * 32 * 128 * 131_328
        );
        // Tiny: 3 queries after 2 keys see 3, 4 and 5 keys.
        let tiny = Case::prefill(KvDtype::F32, 2, 3)
            .with_heads(1, 1)
            .with_head_dim(4);
        assert_eq!(tiny.flops(), 4 * 4 * 12);
    }

    #[test]
    fn mla_append_and_copy() {
        let m = Case::mla_absorbed(KvDtype::F16, 4096);
        assert_eq!(m.id(), "mla_absorbed/r512/h128/ctx4096/b1/f16/bs64");
        // Latent 512 f16 (1,024 bytes) and RoPE 64 f16 (128 bytes) per token.
        assert_eq!(m.kv_bytes(), 4096 * 1152);
        // 2 x 128 heads x 4096 keys x (576 + 512).
        assert_eq!(m.flops(), 1_140_850_688);
        m.validate().unwrap();

        let a = Case::append_kv(KvDtype::F16, 4096);
        assert_eq!(a.id(), "append_kv/hd128/kv8/tok4096/b1/f16/bs16");
        // Source: 4096 x 8 heads x 128 x 4 bytes, K and V; written: 4096 x 8 x 512.
        assert_eq!(a.kv_bytes(), 33_554_432 + 16_777_216);
        assert_eq!(a.flops(), 0);
        a.validate().unwrap();

        let c = Case::copy(KvDtype::F16, 16384);
        assert_eq!(c.id(), "copy/hd128/kv8/ctx16384/b1/f16");
        assert_eq!(c.copy_bytes(), 67_108_864);
        assert_eq!(c.kv_bytes(), 2 * 67_108_864);
        assert_eq!(c.flops(), 0);
    }

    #[test]
    fn context_override_and_validation() {
        let p = Case::prefill(KvDtype::F16, 0, 512).with_context(64);
        assert_eq!((p.context, p.chunk), (64, 64));
        p.validate().unwrap();
        let a = Case::append_kv(KvDtype::Int8, 4096).with_context(32);
        assert_eq!((a.context, a.chunk), (32, 32));
        assert!(Case::decode(KvDtype::Int8, 64)
            .contiguous()
            .validate()
            .is_err());
        assert!(Case::decode(KvDtype::F16, 64)
            .with_heads(30, 8)
            .validate()
            .is_err());
        assert!(Case::decode(KvDtype::Int4, 64)
            .with_head_dim(48)
            .validate()
            .is_err());
        assert!(Case::decode(KvDtype::F16, 0).validate().is_err());
        assert!(Case::decode(KvDtype::F16, 64)
            .with_block_size(3)
            .validate()
            .is_err());
    }
}
